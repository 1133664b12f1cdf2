"""Soak test: one CUDA graph per rank of a whole exchange, replayed many times with fresh
random inputs, sampled replays checked on the GPU.

1A1F on 2 GPUs (spawned processes: group rank 0 = FFN on cuda:0, rank 1 = Attention on
cuda:1), through the public ``torch_afdep.Buffer``:

- Attention graph: ``source_dispatch`` + ``source_collect`` of T tokens. Before every replay
  the host enqueues fresh inputs into the captured tensors (``normal_`` payload, distinct
  top-k ids from ``rand().topk()`` with about ``--drop`` of the entries set to -1, weights
  ``uniform_(0.1, 1.1)``, all on the GPU from a seeded generator) and poisons the output with
  NaN.
- FFN graph: ``worker_receive``, an expert that scales each row by ``s_e = 1 + e/E`` and its
  routing weight (``bf16((x * s_e) * w)``, device-only), ``worker_reply``.

No host barrier per replay: the kernels order the ranks (each Attention dispatch follows its
previous combine, which needed the FFN's reply; each FFN receive waits for the dispatch).
Each rank only synchronizes its own device every ``--sync-every`` replays (bounds how far the
host runs ahead) and then reads the host-mapped error block (``check_error``, no sync).

Checks, every ``--check-every``-th replay, enqueued on the GPU right after the replay (no host
sync; counters stay on the device until the end):

- exact: the output must equal, bit for bit, ``bf16(sum_j bf16((x * s_j) * w_j))`` over the
  token's valid entries (zeros without one). All terms of one element are the same payload
  element times positive factors in [0.1, 2.2], so fp32 sums of <= k bf16 terms are exact in
  any order; the prediction is exact, not approximate.
- reference: the elementwise relative error against the fp32 reference ``sum_j w_j s_j x``
  (no intermediate rounding) must stay below ``2**-6``. Bound: one bf16 rounding of each row
  and one of the sum, each <= 2**-8 relative (bf16 keeps 8 significant bits), and no
  cancellation (same-sign terms), so the error is <= (1 + 2**-8)**2 - 1 ~ 2**-7 (plus fp32
  rounding, ~2**-21); the tolerance leaves a factor 2. Where the reference is 0 the output
  must be exactly 0. ``max_err`` in the JSON is the largest of these relative errors.
- FFN side: ``expert_offsets`` starts at 0, never decreases and stays within the row capacity
  (the data the FFN received is checked end to end by the Attention output: payload, expert
  and weight of every row enter it).

Writes ``<out-dir>/<name>.json``: machine, commit, config, replays, checks, errors,
mismatches, max_err, replays_per_s, wall_s, per-rank records. Exit status 1 when anything
failed.

    python -m benchmarks.soak --replays 100000 --check-every 100   # -> results/benchmarks/
    python -m benchmarks.soak --cpu-smoke        # eager on the CPU path (gloo), tiny config
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from . import common

#: Elementwise relative tolerance against the fp32 reference (see the module docstring).
REL_TOL = 2.0 ** -6
FFN_RANK, ATTN_RANK = 0, 1


# ---- arguments ------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replays", type=int, default=None,
                   help="graph replays per rank (default 100000; 20 with --cpu-smoke)")
    p.add_argument("--check-every", type=int, default=None,
                   help="check every N-th replay (default 100; 1 with --cpu-smoke)")
    p.add_argument("--sync-every", type=int, default=32,
                   help="each rank synchronizes its own device every N replays (default 32)")
    p.add_argument("--tokens", type=int, default=None, help="T per replay (default 128)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 4096)")
    p.add_argument("--experts", type=int, default=None, help="E (default 128)")
    p.add_argument("--top-k", type=int, default=None, help="k (default 8)")
    p.add_argument("--sms", type=int, default=24, help="num_sms (default 24)")
    p.add_argument("--drop", type=float, default=0.2,
                   help="fraction of routing entries set to -1 (default 0.2)")
    p.add_argument("--timeout", type=float, default=5.0, help="config timeout_s (default 5)")
    p.add_argument("--seed", type=int, default=0)
    common.add_output_args(p, "output stem (default soak-<machine>-<date>)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run a few eager exchanges on the CPU path (gloo) instead: exercises "
                        "the script's plumbing and checks without GPUs")
    p.add_argument("--inject-fault", type=int, default=-1, metavar="REPLAY",
                   help="self-test of the checks: the FFN scales its rows by 1.01 in this "
                        "replay (the run must then fail if the replay is checked)")
    p.add_argument("--world-timeout", type=float, default=None,
                   help="seconds before the spawned world is killed (default: from --replays)")
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = build_parser()
    a = p.parse_args(argv)
    smoke = a.cpu_smoke
    defaults = {"replays": (100_000, 20), "check_every": (100, 1), "tokens": (128, 16),
                "hidden": (4096, 256), "experts": (128, 16), "top_k": (8, 4)}
    for k, (gpu, cpu) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, cpu if smoke else gpu)
    if a.replays < 1 or a.check_every < 1 or a.sync_every < 1 or a.tokens < 1:
        p.error("--replays, --check-every, --sync-every and --tokens must be >= 1")
    if not 0.0 <= a.drop < 1.0:
        p.error("--drop must be in [0, 1)")
    if a.top_k > a.experts:
        p.error("--top-k must be <= --experts")
    if a.hidden % 8:
        p.error("--hidden must be a multiple of 8")
    return a


def config_kw(a: argparse.Namespace) -> Dict[str, Any]:
    return dict(capacity_tokens_per_rank=a.tokens, hidden_size=a.hidden, num_experts=a.experts,
                top_k=a.top_k, ffn_ranks=1, attention_ranks=1, num_sms=a.sms,
                timeout_s=float(a.timeout))


# ---- the model the checks use -------------------------------------------------------------
def expert_scale(e: torch.Tensor, num_experts: int) -> torch.Tensor:
    """s_e = 1 + e/E in fp32 (e: global expert ids, any int dtype, >= 0)."""
    return 1.0 + e.to(torch.float32) / num_experts


def expert_rows(x, weights, offsets, num_experts: int, first_expert: int = 0, gain=None):
    """The FFN expert, device-only: row i of local expert e -> bf16((x_i * s_g) * w_i).
    ``gain`` (a 0-d fp32 tensor, 1.0 = exact no-op) lets ``--inject-fault`` corrupt a replay."""
    n = x.shape[0]
    el = torch.searchsorted(offsets[1:].to(torch.int64),
                            torch.arange(n, device=x.device, dtype=torch.int64), right=True)
    s = expert_scale(el + first_expert, num_experts)
    rows = x.to(torch.float32) * s[:, None] * weights[:, None]
    if gain is not None:
        rows = rows * gain
    return rows.to(torch.bfloat16)


def exact_output(x, ids, w, num_experts: int) -> torch.Tensor:
    """What source_collect must return, bit for bit (1 FFN rank; ids distinct or -1)."""
    valid = ids >= 0
    s = expert_scale(ids.clamp(min=0), num_experts)
    rows = (x.to(torch.float32)[:, None, :] * s[:, :, None] * w[:, :, None])
    rows = rows.to(torch.bfloat16).to(torch.float32)
    return torch.where(valid[:, :, None], rows, 0.0).sum(dim=1).to(torch.bfloat16)


def reference_output(x, ids, w, num_experts: int) -> torch.Tensor:
    """fp32 reference without intermediate rounding: sum_j w_j * s_j * x."""
    valid = ids >= 0
    coef = torch.where(valid, expert_scale(ids.clamp(min=0), num_experts) * w, 0.0)
    return (coef[:, :, None] * x.to(torch.float32)[:, None, :]).sum(dim=1)


def check_replay(out, x, ids, w, num_experts: int):
    """(mismatching elements [int64 0-d], max elementwise relative error [fp32 0-d]); both
    stay on the device. NaN anywhere in ``out`` shows as mismatches and a NaN error."""
    want = exact_output(x, ids, w, num_experts)
    mism = (out != want).sum()
    r = reference_output(x, ids, w, num_experts)
    err = (out.to(torch.float32) - r).abs() / r.abs().clamp(min=1e-30)
    zero = r == 0
    err = torch.where(zero, torch.where(out.to(torch.float32) == 0, 0.0, float("inf")), err)
    return mism, err.max() if err.numel() else torch.zeros((), device=out.device)


# ---- one rank -----------------------------------------------------------------------------
def soak_body(rank, world, cfg_kw, opts):
    import torch_afdep
    from torch_afdep.config import Config
    from torch_afdep.errors import AfdepRouteError, AfdepTimeoutError

    cpu = opts["cpu_smoke"]
    dev = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    cfg = Config(**cfg_kw)
    buf = torch_afdep.Buffer(dist.group.WORLD, cfg, device=dev)
    E, k, T, H = cfg.num_experts, cfg.top_k, cfg.capacity_tokens_per_rank, cfg.hidden_size
    replays, every, sync_every = opts["replays"], opts["check_every"], opts["sync_every"]
    stop_file = opts["stop_file"]
    role = buf.role
    rec: Dict[str, Any] = {"role": role, "rank": rank, "device": str(dev), "errors": [],
                           "route_errors": 0, "replays_done": 0, "checks": 0}
    mism_total = torch.zeros((), dtype=torch.int64, device=dev)
    bad_replays = torch.zeros((), dtype=torch.int64, device=dev)
    max_err = torch.zeros((), dtype=torch.float32, device=dev)

    def sync():
        if not cpu:
            torch.cuda.synchronize(dev)

    def poll_errors() -> bool:
        """False when the run must stop (a timeout here, or the peer asked to stop)."""
        for t in buf.transports:
            try:
                t.check_error()
            except AfdepRouteError as e:
                rec["route_errors"] += 1
                rec["errors"].append(f"AfdepRouteError: {e}")
            except AfdepTimeoutError as e:
                rec["errors"].append(f"AfdepTimeoutError: {e}")
                with open(stop_file, "w") as f:
                    f.write(str(rank))
                return False
        return not os.path.exists(stop_file)

    try:
        if role == "attention":
            g = torch.Generator(device=dev)
            g.manual_seed(opts["seed"] * 1_000_003 + 11)
            xs = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
            ids_s = torch.empty(T, k, dtype=torch.int64, device=dev)
            ws = torch.empty(T, k, dtype=torch.float32, device=dev)
            drop = opts["drop"]

            def fresh_inputs():
                xs.normal_(generator=g)
                scores = torch.rand(T, E, generator=g, device=dev)
                ids_s.copy_(scores.topk(k, dim=1).indices)
                ids_s.masked_fill_(torch.rand(T, k, generator=g, device=dev) < drop, -1)
                ws.uniform_(0.1, 1.1, generator=g)

            def step():
                buf.source_dispatch(xs, ids_s, ws, T)
                return buf.source_collect()

            def checked(out):
                nonlocal mism_total, bad_replays, max_err
                m, e = check_replay(out, xs, ids_s, ws, E)
                mism_total = mism_total + m
                bad_replays = bad_replays + ((m > 0) | ~(e < REL_TOL)).to(torch.int64)
                max_err = torch.where(torch.isnan(e) | (e > max_err), e, max_err)
                rec["checks"] += 1

            fresh_inputs()
            out = step()  # eager warm-up exchange, checked
            checked(out)
            graph = None
            if not cpu:
                sync()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = step()
            dist.barrier()
            t0 = time.monotonic()
            for i in range(replays):
                fresh_inputs()
                if graph is not None:
                    out.fill_(float("nan"))
                    graph.replay()
                else:
                    out = step()
                if i % every == 0:
                    checked(out)
                rec["replays_done"] = i + 1
                if (i + 1) % sync_every == 0 or i + 1 == replays:
                    sync()
                    if not poll_errors():
                        break
        else:
            bucket = T
            gain = torch.ones((), dtype=torch.float32, device=dev)
            fault_at = opts["fault_at"]

            def step():
                r = buf.worker_receive(bucket)
                rows = expert_rows(r.x, r.weights, r.expert_offsets, E, gain=gain)
                buf.worker_reply(rows, r.receipt)
                return r

            cap = cfg.recv_rows(bucket)

            def checked(r):
                nonlocal bad_replays
                offs = r.expert_offsets.to(torch.int64)
                ok = (offs[0] == 0) & (offs[1:] >= offs[:-1]).all() & (offs[-1] <= cap)
                bad_replays = bad_replays + (~ok).to(torch.int64)
                rec["checks"] += 1

            r = step()
            checked(r)
            graph = None
            if not cpu:
                sync()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    r = step()
            dist.barrier()
            t0 = time.monotonic()
            for i in range(replays):
                if i == fault_at:
                    gain.fill_(1.01)
                if graph is not None:
                    if i % every == 0:  # stale rows would show in the Attention's check
                        r.x.view(torch.uint8).fill_(0xFF)
                        r.weights.fill_(float("nan"))
                    graph.replay()
                else:
                    r = step()
                if i == fault_at:
                    gain.fill_(1.0)
                if i % every == 0:
                    checked(r)
                rec["replays_done"] = i + 1
                if (i + 1) % sync_every == 0 or i + 1 == replays:
                    sync()
                    if not poll_errors():
                        break
        sync()
        rec["wall_s"] = time.monotonic() - t0
        poll_errors()
        rec["replays_per_s"] = rec["replays_done"] / max(rec["wall_s"], 1e-9)
        rec["mismatches"] = int(mism_total)
        rec["bad_replays"] = int(bad_replays)
        rec["max_err"] = float(max_err)
    finally:
        timed_out = any(e.startswith("AfdepTimeoutError") for e in rec["errors"])
        try:
            if timed_out:
                for t in buf.transports:
                    t.close(clean=False)
            buf.close()
        except Exception as e:  # noqa: BLE001 (recorded; the run already failed or ends)
            rec["errors"].append(f"close: {type(e).__name__}: {e}")
    return rec


# ---- the run --------------------------------------------------------------------------------
def machine_info(cpu: bool) -> Dict[str, Any]:
    names = [] if cpu else (common.nvidia_smi().get("names") or [])
    info = dict(common.software())
    if names:
        info["gpus"] = names
    info["name"] = common.machine_name(names) or "cpu-smoke"
    return info


def summarize(a: argparse.Namespace, per_rank: List[Dict[str, Any]], wall_s: float,
              world_error: Optional[str]) -> Dict[str, Any]:
    att = next((r for r in per_rank if r and r.get("role") == "attention"), {})
    errors = [f"rank {r['rank']}: {e}" for r in per_rank if r for e in r.get("errors", [])]
    if world_error:
        errors.append(world_error)
    bad = sum(r.get("bad_replays", 0) for r in per_rank if r)
    if bad:
        errors.append(f"{bad} checked replays failed (mismatching elements: "
                      f"{att.get('mismatches')}, max relative error {att.get('max_err')})")
    done = min((r.get("replays_done", 0) for r in per_rank if r), default=0)
    if done < a.replays and not world_error:
        errors.append(f"stopped after {done} of {a.replays} replays")
    checks = att.get("checks", 0)
    return {
        "name": None, "mode": "cpu-smoke" if a.cpu_smoke else "cuda-graphs",
        "machine": machine_info(a.cpu_smoke), "commit": common.git_commit(),
        "config": {**config_kw(a), "dtype": "bfloat16", "layout": "1A1F",
                   "check_every": a.check_every, "sync_every": a.sync_every, "drop": a.drop,
                   "seed": a.seed, "rel_tol": REL_TOL, "inject_fault": a.inject_fault},
        "replays": done, "replays_requested": a.replays, "checks": checks,
        "mismatches": att.get("mismatches"), "max_err": att.get("max_err"),
        "errors": errors, "ok": not errors and done == a.replays,
        "replays_per_s": att.get("replays_per_s"), "wall_s": wall_s,
        "loop_s": att.get("wall_s"), "per_rank": per_rank,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def main(argv: Optional[List[str]] = None) -> int:
    a = parse_args(argv)
    if not a.cpu_smoke:
        import importlib.util

        if importlib.util.find_spec("torch_afdep._cuda") is None:
            print("soak: the CUDA extension torch_afdep._cuda is missing; use --cpu-smoke",
                  file=sys.stderr)
            return 2
        if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
            print("soak: needs 2 CUDA GPUs (or --cpu-smoke)", file=sys.stderr)
            return 2
    kw = config_kw(a)
    world_timeout = a.world_timeout or (120.0 + a.replays * (0.05 if a.cpu_smoke else 0.002))
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="afdep-soak-") as tmp:
        opts = {"cpu_smoke": a.cpu_smoke, "replays": a.replays, "check_every": a.check_every,
                "sync_every": a.sync_every, "seed": a.seed, "drop": a.drop,
                "stop_file": os.path.join(tmp, "stop"), "fault_at": a.inject_fault}
        per_rank, world_error = common.spawn(soak_body, 2, kw, opts, timeout=world_timeout,
                                             device_ids=None if a.cpu_smoke else [0, 1])
    doc = summarize(a, per_rank or [{}, {}], time.monotonic() - t0, world_error)
    name = a.name or f"soak-{common.machine_slug(doc['machine'].get('gpus', []))}-" \
                     f"{common.timestamp()}"
    doc["name"] = name
    path = common.output_path(a.out_dir, name, "json")
    common.write_json(path, doc)
    rps = doc["replays_per_s"]
    print(f"soak {doc['mode']}: {doc['replays']} replays, {doc['checks']} checks, "
          f"mismatches {doc['mismatches']}, max_err {doc['max_err']}, "
          f"{'%.0f' % rps if rps else '?'} replays/s, wall {doc['wall_s']:.1f} s, "
          f"{'OK' if doc['ok'] else 'FAILED'}")
    for e in doc["errors"][:10]:
        print("  error:", e[:500])
    print("wrote", path)
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
