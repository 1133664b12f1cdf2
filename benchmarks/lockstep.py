"""Each kernel of an exchange on its own: the four kernels in lockstep, for ``ncu``.

    python -m benchmarks.lockstep [--tokens 1] [--receive-layout tokens|experts]
                                  [--hidden 4096] [--dtype bf16|fp8] [--exchanges 14]
                                  [--device cuda|cpu] [--out FILE.json]

1A1F (both ranks on GPU 0 with one GPU, GPUs 0 and 1 with two). Every exchange runs its four
steps one after another, each rank synchronizing its device and both meeting on gloo in
between: the Attention's dispatch; then the FFN's receive, the stand-in expert
(``torch_exchange.stand_in_expert``) and the reply; then the Attention's collect. So no
kernel ever waits for a peer (its data arrived before it started), and each kernel's time is
its own work: what ``benchmarks.trace`` cannot separate from the waits of a live exchange.

That is also what makes every kernel safe under ``ncu``'s kernel replay, which restores the
profiled process's memory before each pass: a replayed sender writes the same data and
exchange number again; a replayed receiver finds its data already in place. (A replayed
reply adds its completion count once per pass, so later collects find the count ahead; in
lockstep the rows are in place anyway.) No MPS daemon is needed: no two kernels spin at once.
``scripts/gpu_profile.sh`` runs it under ``ncu``.

Without ``ncu`` it times each step with CUDA events (host launch included, so these are
upper bounds) and checks every Attention output against the stand-in expert's exact result
(``arms.expected_output``) on fresh inputs each exchange. Writes one JSON document: config,
machine, commit, per-exchange step times and errors.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List

from benchmarks import arms, common
from benchmarks import torch_exchange as tx

STEPS = {"attention": ("dispatch", "collect"), "ffn": ("receive", "reply")}


def body(rank: int, world: int, spec: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist

    import torch_afdep
    from torch_afdep import reference as ref
    from torch_afdep.config import Config

    cuda = spec["device"] == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = Config(capacity_tokens_per_rank=spec["capacity"], hidden_size=spec["hidden"],
                 num_experts=spec["experts"], top_k=spec["top_k"], ffn_ranks=1,
                 attention_ranks=1, dtype=arms.DTYPES[spec["dtype"]], num_sms=spec["sms"],
                 timeout_s=float(spec["kernel_timeout_s"]),
                 receive_layout=spec["receive_layout"], num_slots=1)
    role = cfg.role_of(rank)
    att = role == "attention"
    T = bucket = spec["tokens"]
    buf = torch_afdep.Buffer(None, cfg, device=dev)
    names = STEPS[role]
    times: Dict[str, List[float]] = {n: [] for n in names}
    errors: List[float] = []

    def timed(name, fn):
        """fn() between two events (CUDA) or two clock reads (CPU); returns fn's value."""
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = fn()
            b.record()
            torch.cuda.synchronize()
            times[name].append(a.elapsed_time(b) * 1000.0)
        else:
            t0 = time.perf_counter()
            out = fn()
            times[name].append((time.perf_counter() - t0) * 1e6)
        return out

    try:
        n_rows = (cfg.token_rows(bucket) if cfg.receive_layout == "tokens"
                  else cfg.recv_rows(bucket))
        reply = None if att else tx.new_reply(n_rows, cfg.hidden_size, dev)
        for e in range(spec["exchanges"]):
            if att:  # fresh inputs every exchange, made before the lockstep begins
                x, ids, w, sc = ref.make_inputs(cfg, T, spec["routing"], seed=spec["seed"] + e,
                                                device=dev)
                want = arms.expected_output(x, arms.reply_rows(cfg, ids, cfg.receive_layout))
                timed("dispatch", lambda: buf.source_dispatch(x, ids, w, bucket, x_scales=sc))
            dist.barrier()  # the dispatch's data is in the FFN's window
            if not att:
                rec = timed("receive", lambda: buf.worker_receive(bucket))
                rows = tx.stand_in_expert(reply, rec.x)
                timed("reply", lambda: buf.worker_reply(rows, rec.receipt))
            dist.barrier()  # the reply's rows are in the Attention's window
            if att:
                out = timed("collect", lambda: buf.source_collect())
                errors.append(arms.output_error(out.float(), want))
    finally:
        buf.close()
    # the pid names this rank in profiler exports (scripts/ncu_summary.py --lockstep)
    return {"role": role, "pid": os.getpid(), "times_us": times, "errors": errors}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--receive-layout", choices=("tokens", "experts"), default="tokens")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--dtype", choices=sorted(arms.DTYPES), default="bf16")
    p.add_argument("--routing", default="random")
    p.add_argument("--exchanges", type=int, default=14)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", default=None, help="JSON result file (default: print only)")
    args = p.parse_args(argv)
    if not 1 <= args.tokens <= 2048:
        p.error("--tokens must be in [1, 2048]")
    if not 1 <= args.exchanges <= 10000:
        p.error("--exchanges must be in [1, 10000]")
    spec = {"tokens": args.tokens, "receive_layout": args.receive_layout,
            "hidden": args.hidden, "dtype": args.dtype, "routing": args.routing,
            "exchanges": args.exchanges, "device": args.device, "capacity": 2048,
            "experts": 128, "top_k": 8, "sms": 24, "kernel_timeout_s": 30, "seed": 4242}
    devs = None
    if args.device == "cuda":
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            p.error("--device cuda: no GPU visible (use --device cpu)")
        devs = [0, 1] if n >= 2 else [0, 0]
    got, err = common.spawn(body, 2, spec, timeout=600, device_ids=devs)
    smi = common.nvidia_smi() if args.device == "cuda" else {}
    doc = {"spec": spec, "machine": common.machine_name(smi.get("names", [])) or "cpu",
           "driver": smi.get("driver"), "commit": common.git_commit(),
           "software": common.software(), "env": common.recorded_env(), "devices": devs,
           "error": err, "ranks": got}
    if got:
        for r in got:
            for name, v in r["times_us"].items():
                tail = sorted(v[1:] or v)
                print(f"{r['role']:9s} {name:8s} median {tail[len(tail) // 2]:8.1f} us "
                      f"(event span, launch included; {len(v)} exchanges)")
            if r["errors"]:
                print(f"attention max output error {max(r['errors']):.2e}")
    else:
        print(f"world failed: {err}", file=sys.stderr)
    if args.out:
        common.write_json(args.out, doc)
    bad = not got or any(e > 2e-2 for r in got for e in r["errors"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
