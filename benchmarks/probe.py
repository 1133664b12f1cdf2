"""Machine facts the report needs, measured in one spawned process (the parent stays off CUDA).

- GPU names, count, compute capability, peer access between GPUs 0 and 1;
- the peer-copy bandwidth ceiling: a large device-to-device copy between GPU 0 and GPU 1,
  each direction, GB/s (10^9 bytes per second);
- whether the torch_afdep CUDA extension imports (the afdep arms need it).

A flag round trip between GPUs needs a spinning kernel, which plain torch cannot express, so
it is not measured: the data-movement floor has no latency term (see benchmarks/README.md).
"""

from __future__ import annotations

import time
from typing import Any, Dict


def _copy_gbps(src_dev: int, dst_dev: int, nbytes: int, iters: int) -> float:
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src_dev}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst_dev}")
    a.fill_(1)

    def sync():
        torch.cuda.synchronize(src_dev)
        torch.cuda.synchronize(dst_dev)

    for _ in range(2):
        b.copy_(a)
    sync()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            b.copy_(a)
        sync()
        best = min(best, (time.perf_counter() - t0) / iters)
    del a, b
    torch.cuda.empty_cache()
    return nbytes / best / 1e9


def probe_main(rank: int, world_size: int, opts: Dict[str, Any]) -> Dict[str, Any]:
    import torch

    out: Dict[str, Any] = {"errors": []}
    n = torch.cuda.device_count()
    out["gpu_count"] = n
    out["gpus"] = [torch.cuda.get_device_name(i) for i in range(n)]
    if n:
        p = torch.cuda.get_device_properties(0)
        out["capability"] = f"{p.major}.{p.minor}"
        out["sm_count"] = p.multi_processor_count
        out["memory_gib"] = round(p.total_memory / 2**30, 1)
    try:
        v = torch.cuda.nccl.version()
        out["nccl_version"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    except Exception as e:  # noqa: BLE001
        out["nccl_version"] = None
        out["errors"].append(f"nccl version: {e}")
    try:
        import torch_afdep._cuda  # noqa: F401

        out["afdep_cuda_ext"] = True
    except Exception as e:  # noqa: BLE001
        out["afdep_cuda_ext"] = False
        out["afdep_cuda_ext_error"] = f"{type(e).__name__}: {e}"
    out["peer_copy_GBps"] = {}
    if n >= 2 and opts.get("peer_copy_mib", 0) > 0:
        out["peer_access_0_1"] = bool(torch.cuda.can_device_access_peer(0, 1))
        nbytes = int(opts["peer_copy_mib"]) * 2**20
        for s, d in ((0, 1), (1, 0)):
            try:
                out["peer_copy_GBps"][f"{s}->{d}"] = _copy_gbps(s, d, nbytes,
                                                                 int(opts.get("iters", 8)))
            except Exception as e:  # noqa: BLE001
                out["errors"].append(f"peer copy {s}->{d}: {type(e).__name__}: {e}")
    vals = list(out["peer_copy_GBps"].values())
    out["peer_copy_ceiling_GBps"] = max(vals) if vals else None
    out["peer_copy_bytes"] = int(opts.get("peer_copy_mib", 0)) * 2**20
    return out
