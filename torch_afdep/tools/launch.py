"""``python -m torch_afdep.tools.launch``: run a script on N local ranks, each as under torchrun.

    python -m torch_afdep.tools.launch [--nproc 4] [--allow-shared-gpu] script.py [args ...]

For scripts that call ``dist.init_process_group(...)`` themselves with the env:// rendezvous
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), such as
``examples/readme_api.py``, on a machine without torchrun's elastic agent in the way: ranks are
spawned with ``torch_afdep.testing.spawn_world`` (a rank that fails or hangs fails the run with
its traceback), one GPU per rank round robin when the CUDA extension is built (refused when
ranks would share a GPU without CUDA MPS, unless ``--allow-shared-gpu``). A script may set a
global ``RESULT``: ``launch()`` returns every rank's.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import Any, List, Optional

from . import cli


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_script_rank(rank: int, world: int, path: str, argv: List[str], master_port: int
                    ) -> Any:
    """One rank (module level: spawn pickles it by name).

    Arguments:
        rank, world: this rank and the world size (from ``spawn_world``).
        path: the script, run with ``__name__ == "__main__"`` as torchrun runs it.
        argv: the script's arguments (``sys.argv[1:]``).
        master_port: the rendezvous port every rank uses.
    Returns:
        The script's global ``RESULT`` (None when it sets none).
    """
    import runpy

    import torch.distributed as dist

    # spawn_world made a default group; the script creates its own, as under torchrun.
    dist.destroy_process_group()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(master_port))
    sys.argv = [path] + list(argv)
    try:
        ns = runpy.run_path(path, run_name="__main__")
    except SystemExit as e:  # a script's sys.exit(0) is a normal end
        if e.code not in (None, 0):
            raise RuntimeError(f"{path} exited with status {e.code}") from None
        return None
    return ns.get("RESULT")


def launch(path: str, nproc: int, argv: Optional[List[str]] = None,
           device_ids: Optional[List[int]] = None, timeout: float = 300.0) -> List[Any]:
    """Run ``path`` on ``nproc`` spawned ranks; every rank's ``RESULT``, in rank order.

    Arguments:
        path: the script.
        nproc: ranks to spawn.
        argv: the script's arguments.
        device_ids: the CUDA device of each rank, or None (CPU).
        timeout: seconds before the world is killed (``WorldError``).
    """
    from ..testing import spawn_world

    return spawn_world(run_script_rank, nproc, os.path.abspath(path), list(argv or []),
                       _free_port(), backend="gloo", device_ids=device_ids, timeout=timeout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_afdep.tools.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="ranks to spawn")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    cli.add_shared_gpu_argument(p)
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.nproc < 1:
        p.error(f"--nproc must be >= 1, got {args.nproc}")
    device_ids = (cli.gpu_placement(p, args.nproc, args.allow_shared_gpu)
                  if cli.cuda_ready() else None)
    from ..testing import WorldError

    try:
        results = launch(args.script, args.nproc, args.script_args, device_ids, args.timeout)
    except WorldError as e:
        print(f"FAIL: {args.script} on {args.nproc} ranks:{e}", file=sys.stderr)
        return 1
    done = sum(r is not None for r in results)
    print(f"OK: {args.script} finished on {args.nproc} ranks ({done} set a RESULT)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
