"""dist.destroy_process_group() of a "cpu:gloo,cuda:afdep" group prints nothing.

torch's _new_process_group_helper picks the default backend of a multi-device group by
comparing the first plugin's name ("AFDEP") with the device map's values ("afdep"); they never
match, the group keeps BackendType UNDEFINED, and destroy's hasHooks() printed "No backend of
type 0 found ..." on every rank. The afdep backend's creator sets the type torch meant (CUSTOM).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CYCLES = 15  # per rank: 2 ranks x 15 = 30 init/destroy cycles
WARNING = "No backend of type"

_BODY = textwrap.dedent("""
    import sys
    import torch.distributed as dist
    import torch_afdep  # registers the backend

    rank, folder, cycles = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    for i in range(cycles):
        dist.init_process_group("cpu:gloo,cuda:afdep", init_method=f"file://{folder}/rdv{i}",
                                rank=rank, world_size=2)
        dist.barrier()
        dist.destroy_process_group()
    print(f"rank {rank}: {cycles} cycles done", flush=True)
""")


def test_destroy_prints_no_backend_warning(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)
    procs = [subprocess.Popen([sys.executable, "-c", _BODY, str(rank), str(tmp_path),
                               str(CYCLES)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=240)
            outputs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (rc, out, err) in enumerate(outputs):
        assert rc == 0, f"rank {rank} exited {rc}:\n{err[-3000:]}"
        assert f"{CYCLES} cycles done" in out
        assert WARNING not in err, f"rank {rank} warned:\n{err[-3000:]}"
