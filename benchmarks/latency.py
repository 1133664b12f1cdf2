"""Round-trip latency (dispatch + combine) under CUDA graphs: role-aware vs AFDEP_SYMMETRIC=1.

1A1F on 2 GPUs by default (hidden 4096, BF16, capacity 2048, E=128, top-8, 24 SMs). Each arm
runs in fresh processes (one spawned world per arm and repeat, arms alternating). Before each
timed replay the ranks meet at a gloo barrier; the FFN rank then replays at once (its receive
kernel waits on the device), the Attention rank waits 0.3 ms on the host so the FFN side is
already spinning, and times its own replay with CUDA events. The FFN replies with the received
rows (already BF16; no compute). Reported: median over the replays per rank, max over
Attention ranks; JSON with machine, commit, config and per-repeat numbers.

    python benchmarks/latency.py [--tokens 1,8,32,128,512,2048] [--replays 200] [--repeats 2]
                                 [--out benchmarks/results/latency_1a1f_h4096.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

ARMS = {
    "role_aware": {},
    "symmetric": {"AFDEP_SYMMETRIC": "1"},
}
BASE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def bench_body(rank, world, cfg_kw, tokens_list, replays, warmup, seed, queue_ahead_us=0.0):
    from torch_afdep._cuda_impl import CudaTransport
    from torch_afdep.config import FFN, Config
    from torch_afdep import reference as ref

    kw = dict(cfg_kw)
    kw["dtype"] = getattr(torch, kw["dtype"])
    cfg = Config(**kw)
    dev = torch.device("cuda", torch.cuda.current_device())
    t = CudaTransport(cfg, rank, dev, dist.group.WORLD)
    role, idx = cfg.role_of(rank), cfg.role_index(rank)
    A, R, H = cfg.attention_ranks, cfg.rows_per_token, cfg.hidden_size
    result = {"role": role, "registered_bytes": t.registered_bytes,
              "union_bytes": t.union_bytes, "us": {}}
    try:
        for T in tokens_list:
            bucket = T
            if role == FFN:
                rows = A * bucket * R
                x = torch.empty(rows, H, dtype=cfg.dtype, device=dev)
                xs = torch.empty(rows, cfg.scale_cols, dtype=torch.float32, device=dev)
                w = torch.empty(rows, dtype=torch.float32, device=dev)
                off = torch.empty(cfg.experts_per_rank + 1, dtype=torch.int32, device=dev)
                sr = torch.empty(rows, dtype=torch.int32, device=dev)
                st = torch.empty(rows, dtype=torch.int32, device=dev)
                tr = torch.empty(A, bucket, R, dtype=torch.int32, device=dev)
                ti = torch.empty(A, bucket, dtype=torch.int32, device=dev)
                nt = torch.empty(A, dtype=torch.int32, device=dev)

                def step():
                    t.receive(bucket, x, xs if cfg.scale_cols else None, w, off, sr, st, tr,
                              ti, nt)
                    t.reply(x, tr, ti, nt)  # received rows as the reply (BF16, no compute)
            else:
                g = torch.Generator().manual_seed(seed + T)
                x = torch.randn(T, H, generator=g).to(cfg.dtype).to(dev)
                ids, wts = ref.random_routing(cfg, T, "random", generator=g)
                ids, wts = ids.to(dev), wts.to(dev)
                route = torch.empty(T, dtype=torch.int64, device=dev)
                out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)

                def step():
                    t.dispatch(x, ids, wts, None, bucket, route)
                    t.combine(route, out)

            for _ in range(3):  # eager warm-up (pairs across ranks)
                step()
            torch.cuda.synchronize()
            t.check_error()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            times = []
            for i in range(warmup + replays):
                dist.barrier()
                torch.cuda.synchronize()
                if role == FFN:
                    graph.replay()
                    torch.cuda.synchronize()
                else:
                    _spin(3e-4)
                    if queue_ahead_us > 0:
                        # keep the GPU busy while the host submits the events and the graph,
                        # so the start event is not taken before the graph is even launched
                        torch.cuda._sleep(int(queue_ahead_us * 2000))
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    if i >= warmup:
                        times.append(start.elapsed_time(end) * 1000.0)
            t.check_error()
            if role != FFN:
                result["us"][T] = times
            del graph
    finally:
        t.close()
    return result


def machine_info():
    info = {"host": platform.node(), "python": platform.python_version(),
            "torch": torch.__version__}
    try:
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception as e:  # noqa: BLE001
        info["gpus"] = str(e)
    try:
        info["nvidia_smi_topo"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True,
                                                 text=True, timeout=20).stdout
    except Exception:  # noqa: BLE001
        pass
    return info


def commit():
    if os.environ.get("AFDEP_COMMIT"):
        return os.environ["AFDEP_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001
        return "unknown"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", default="1,8,32,128,512,2048")
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--capacity", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--num-sms", type=int, default=24)
    p.add_argument("--layout", default="1A1F", help="nAmF, ranks alternate over the GPUs")
    p.add_argument("--arms", default="role_aware,symmetric")
    p.add_argument("--queue-ahead-us", type=float, default=0.0,
                   help="enqueue a ~N us sleep kernel before the start event so host graph "
                        "launch latency is excluded (0 = off; results so far used 0)")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                 "latency_1a1f_h4096_bf16.json"))
    args = p.parse_args(argv)
    from torch_afdep.testing import spawn_world

    layout = args.layout.upper()
    A = int(layout.split("A")[0])
    F = int(layout.split("A")[1].rstrip("F"))
    ngpu = torch.cuda.device_count()
    devices = [r % max(ngpu, 1) for r in range(F + A)]
    tokens = [int(v) for v in args.tokens.split(",")]
    cfg_kw = dict(capacity_tokens_per_rank=args.capacity, hidden_size=args.hidden,
                  num_experts=args.experts, top_k=args.top_k, ffn_ranks=F, attention_ranks=A,
                  dtype="bfloat16", num_sms=args.num_sms, timeout_s=60.0)
    arms = args.arms.split(",")
    runs = []
    for rep in range(args.repeats):
        order = arms if rep % 2 == 0 else list(reversed(arms))
        for arm in order:
            env = dict(BASE_ENV)
            env.update(ARMS[arm])
            res = spawn_world(bench_body, F + A, cfg_kw, tokens, args.replays, args.warmup,
                              1234 + rep, args.queue_ahead_us, device_ids=devices, env=env,
                              timeout=900)
            att = [r for r in res if r["role"] == "attention"]
            med = {T: max(statistics.median(r["us"][T]) for r in att) for T in tokens}
            runs.append({"repeat": rep, "arm": arm, "median_us_max_over_attention": med,
                         "per_rank_median_us": [{T: statistics.median(r["us"][T]) for T in tokens}
                                                for r in att],
                         "per_rank_p10_p90_us": [
                             {T: (sorted(r["us"][T])[len(r["us"][T]) // 10],
                                  sorted(r["us"][T])[len(r["us"][T]) * 9 // 10]) for T in tokens}
                             for r in att],
                         "registered_bytes": [r["registered_bytes"] for r in res],
                         "union_bytes": [r["union_bytes"] for r in res]})
            print(f"repeat {rep} {arm:>10}: " +
                  "  ".join(f"T={T}:{med[T]:.1f}" for T in tokens), flush=True)
    summary = {}
    for arm in arms:
        summary[arm] = {T: statistics.median([r["median_us_max_over_attention"][T]
                                              for r in runs if r["arm"] == arm]) for T in tokens}
    doc = {"benchmark": "round trip dispatch+combine under CUDA graphs",
           "machine": machine_info(), "commit": commit(), "config": cfg_kw, "layout": layout,
           "devices": devices, "queue_ahead_us": args.queue_ahead_us, "replays": args.replays, "warmup": args.warmup,
           "repeats": args.repeats, "method": __doc__, "runs": runs,
           "summary_median_over_repeats_us": summary,
           "controls_env": ARMS}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"\n{layout} hidden {args.hidden} bf16, E={args.experts} top-{args.top_k}, "
          f"capacity {args.capacity}, {args.num_sms} SMs: round trip us (median, max over "
          "Attention ranks, median over repeats)")
    print("T".rjust(6) + "".join(a.rjust(14) for a in arms) +
          ("   change" if "role_aware" in arms and "symmetric" in arms else ""))
    for T in tokens:
        line = f"{T:6d}" + "".join(f"{summary[a][T]:14.1f}" for a in arms)
        if "role_aware" in summary and "symmetric" in summary:
            line += f"   {100.0 * (summary['role_aware'][T] / summary['symmetric'][T] - 1):+.1f}%"
        print(line)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
