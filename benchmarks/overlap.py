"""Is the exchange hidden behind compute? A two-micro-batch MoE layer step on 1A1F.

    python -m benchmarks.overlap [--quick]                      # -> results/benchmarks/
    python -m benchmarks.overlap --cpu-smoke --out-dir /tmp/overlap   # plumbing only, no GPU

One Attention and one FFN process, one GPU each (``NCCL_NVLS_ENABLE=0`` in every process), a
``torch_afdep.Buffer`` with two micro-batch slots; hidden 4096 BF16, E=128 top-8, random
routing, T tokens per micro-batch (bucket = T). Compute is synthetic:

- attention (Attention rank): ``n`` chained bf16 ``[T, H] @ [H, H]`` matmuls per micro-batch;
  ``--attention-matmuls auto`` picks ``n`` so one micro-batch's attention takes about
  ``--attention-ratio`` times one exchange round trip (measured first, for each T);
- experts (FFN rank): ``torch_afdep.nn.SwiGLUExperts`` (grouped GEMMs on the GPU) over the
  received expert-major rows, random bf16 weights, intermediate size ``--intermediate``;
  each row's routing weight applied once, as the contract asks.

Five steps per T, each captured in one CUDA graph per rank, two micro-batches each:

1. exchange alone: Attention dispatch(s0), collect(s0), dispatch(s1), collect(s1); FFN
   receive, reply with the received rows (identity experts) on s0 then s1;
2. attention alone (Attention rank only): attn(mb0), attn(mb1);
3. experts alone (FFN rank only, timed there): the experts on the rows of (1)'s eager run;
4. pipelined: Attention attn(mb0), dispatch(s0), attn(mb1), dispatch(s1), collect(s0),
   collect(s1); FFN receive(s0), experts, reply(s0), receive(s1), experts, reply(s1);
5. serialized: Attention attn(mb0), dispatch(s0), collect(s0), attn(mb1), dispatch(s1),
   collect(s1); the FFN graph is (4)'s.

Timing follows ``benchmarks.arms._time_graph`` (which this script calls): before every replay
both ranks synchronize their device and meet in a gloo all-reduce; the timing rank then spins
``--attention-delay-us`` on the host (the peer's graph is launched and waiting), enqueues a
``--queue-ahead-us`` sleep kernel (the host's graph launch is not measured) and times one
replay with CUDA events. ``--rounds`` rounds of ``--warmup`` + ``--replays`` replays per step,
the step order rotating each round; a step's time is the median of its round medians.

Reported per T: the parts (1), (2), (3) and their sum, the pipelined step (4), the serialized
step (5), the overlap fraction ``1 - step / sum of parts`` and the step against (5). After
the timing, ``--checks`` replays of (1), (4) and (5) with fresh inputs are checked on the
Attention rank (and the eager runs before capture): (4) and (5) against the same experts in
fp32 (relative error), (1) against the sum of the token's rows.

Output in ``--out-dir`` (default results/benchmarks/): ``<gpu>x<count>-<date>-overlap.json``
(machine, commit, config, per step the per-round medians, spread and samples, the summary)
and ``.md`` (a table).
``--cpu-smoke`` runs the same plumbing on the CPU over gloo with small sizes and eager
steps instead of graphs: its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import math
import os
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from torch_afdep import reference as ref

from . import common, stats

PARTS = ("exchange", "attention", "experts", "pipelined", "serialized")
#: Which role times each step (the other replays its own graph, or nothing).
TIMED_ON = {"exchange": "attention", "attention": "attention", "experts": "ffn",
            "pipelined": "attention", "serialized": "attention"}
CHECKED = ("exchange", "pipelined", "serialized")

GPU_DEFAULTS = dict(tokens=[128, 512], hidden=4096, experts=128, top_k=8, intermediate=64,
                    attention_matmuls="auto", rounds=3, replays=200, warmup=20, checks=3,
                    attention_delay_us=300.0, queue_ahead_us=200.0, world_timeout=240.0)
QUICK = dict(tokens=[128], rounds=1, warmup=10, checks=2, world_timeout=150.0)
CPU_SMOKE = dict(tokens=[8], hidden=256, experts=16, top_k=4, intermediate=32,
                 attention_matmuls="2", rounds=1, replays=3, warmup=1, checks=1,
                 attention_delay_us=0.0, queue_ahead_us=0.0, world_timeout=120.0)


# ---- arguments ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="tokens per micro-batch (default 128 512; --quick 128)")
    p.add_argument("--hidden", type=int, default=None, help="default 4096")
    p.add_argument("--experts", type=int, default=None, help="default 128")
    p.add_argument("--top-k", type=int, default=None, help="default 8")
    p.add_argument("--intermediate", type=int, default=None,
                   help="expert intermediate size (default 64: one micro-batch's experts "
                        "then read ~200 MB of weights, about one round trip)")
    p.add_argument("--expert-method", default="auto",
                   choices=("auto", "grouped", "dense", "loop"),
                   help="SwiGLUExperts method (auto: grouped GEMMs where torch._grouped_mm "
                        "runs; loop is eager only, so CPU smoke only)")
    p.add_argument("--attention-matmuls", default=None,
                   help="chained [T,H]@[H,H] matmuls per micro-batch, or 'auto' (default): "
                        "sized from the measured exchange")
    p.add_argument("--attention-ratio", type=float, default=1.0,
                   help="auto: one micro-batch's attention ~ this x one exchange round trip")
    p.add_argument("--max-attention-matmuls", type=int, default=64)
    p.add_argument("--rounds", type=int, default=None, help="rounds per step (default 3)")
    p.add_argument("--replays", type=int, default=None,
                   help="timed replays per step and round (default 200)")
    p.add_argument("--warmup", type=int, default=None, help="untimed replays before them")
    p.add_argument("--checks", type=int, default=None,
                   help="checked replays of each exchanging step, fresh inputs each")
    common.add_timing_args(p, queue_ahead_us=None, attention_delay_us=None)  # 200, 300
    p.add_argument("--sms", type=int, default=24, help="SMs of each exchange kernel")
    p.add_argument("--kernel-timeout", type=float, default=20.0,
                   help="Config.timeout_s: a receiver that waits longer raises")
    p.add_argument("--world-timeout", type=float, default=None,
                   help="seconds before the spawned ranks are ended (default 240)")
    p.add_argument("--check-tol", type=float, default=2e-2,
                   help="largest relative error of a checked output")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--quick", action="store_true",
                   help="T=128 only, one round (~30 s on 2 x H200)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="CPU over gloo, small sizes, eager steps: exercises the plumbing, "
                        "the numbers mean nothing")
    common.add_output_args(p, "output stem (default <gpu>x<count>-<date>-overlap)")
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for k, v in GPU_DEFAULTS.items():
        if getattr(args, k) is None:
            if args.cpu_smoke and k in CPU_SMOKE:
                v = CPU_SMOKE[k]
            elif args.quick and k in QUICK:
                v = QUICK[k]
            setattr(args, k, v)
    if str(args.attention_matmuls) != "auto":
        try:
            args.attention_matmuls = int(args.attention_matmuls)
        except ValueError:
            p.error(f"--attention-matmuls must be an int or 'auto', got "
                    f"{args.attention_matmuls!r}")
        if args.attention_matmuls < 1:
            p.error("--attention-matmuls must be >= 1 (or auto)")
    if args.cpu_smoke and args.attention_matmuls == "auto":
        args.attention_matmuls = 2  # nothing to calibrate against on the CPU
    if args.expert_method == "loop" and not args.cpu_smoke:
        p.error("--expert-method loop reads offsets on the host: it cannot be captured")
    if min(args.tokens) < 1:
        p.error("--tokens must be >= 1")
    if args.top_k > args.experts or args.top_k < 1:
        p.error("--top-k must be in [1, --experts]")
    if args.hidden % 8:
        p.error("--hidden must be a multiple of 8")
    if args.rounds < 1 or args.replays < 1 or args.warmup < 0 or args.checks < 0:
        p.error("--rounds and --replays must be >= 1, --warmup and --checks >= 0")
    if args.max_attention_matmuls < 1 or args.attention_ratio <= 0:
        p.error("--max-attention-matmuls must be >= 1 and --attention-ratio > 0")
    common.check_timing_args(p, args)
    return args


# ---- per-rank context ---------------------------------------------------------------------
class _Ctx:
    def __init__(self, rank: int, spec: Dict[str, Any]):
        self.rank = rank
        self.spec = spec
        self.cuda = spec["device"] == "cuda"
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.cuda
                       else torch.device("cpu"))
        self.is_attention = False

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def align(self, failed: int = 0) -> int:
        """Device synchronized, then a gloo all-reduce (the barrier that also says whether
        any rank failed)."""
        self.sync()
        t = torch.tensor([failed], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t[0])

    def agree(self, err: Optional[str]) -> None:
        """Every rank learns whether any rank failed in the phase just done, and raises."""
        got: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(got, err)
        bad = [(r, e) for r, e in enumerate(got) if e is not None]
        if bad:
            r, e = bad[0]
            raise RuntimeError(f"rank {r} failed:\n{e}")


class _Clock:
    """The face ``benchmarks.arms._time_graph`` needs: ``is_attention`` there means "this
    rank times the replays" (so the FFN rank can time its experts)."""

    def __init__(self, ctx: _Ctx, timed: bool):
        self.rank, self.cuda, self.is_attention = ctx.rank, ctx.cuda, timed
        self._ctx = ctx

    def sync(self) -> None:
        self._ctx.sync()

    def align(self, failed: int = 0) -> int:
        return self._ctx.align(failed)


class _Noop:
    def replay(self) -> None:
        pass


class _Step:
    """A step run once eagerly (pairing with the peer's eager run), then captured in a CUDA
    graph; on the CPU ``replay`` runs it eagerly. ``out`` holds the latest outputs (static
    graph outputs on CUDA)."""

    def __init__(self, ctx: _Ctx, fn):
        self.fn = fn
        self.graph = None
        self.out = fn()
        ctx.sync()
        self.eager_out = self.out
        if ctx.cuda:
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA calls do not invalidate the capture
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.out = fn()
            ctx.sync()

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.out = self.fn()


def _err(e: BaseException) -> str:
    return "".join(traceback.format_exception(type(e), e, e.__traceback__)[-8:])


def _say(ctx: _Ctx, msg: str) -> None:
    if ctx.is_attention:
        print(f"  [attention rank] {msg}", flush=True)


def _phase(ctx: _Ctx, fn):
    """Run ``fn``; every rank learns whether any rank failed in it (no one waits out a
    timeout for a peer that is already gone)."""
    out, err = None, None
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001
        err = _err(e)
    ctx.agree(err)
    return out


# ---- synthetic compute --------------------------------------------------------------------
def expert_weights(spec: Dict[str, Any], first: int, count: int, device):
    """(w13 [count, 2I, H], w2 [count, H, I]) bf16 of global experts [first, first+count):
    the same bits on every rank and device (a seeded CPU base, rolled and scaled per expert
    with exact elementwise ops), so the Attention rank can rebuild the FFN rank's experts."""
    h, i, e_all = spec["hidden"], spec["intermediate"], spec["experts"]
    g = torch.Generator().manual_seed(spec["seed"] + 77)
    b13 = (torch.randn(2 * i, h, generator=g) * h ** -0.5).to(device)
    b2 = (torch.randn(h, i, generator=g) * i ** -0.5).to(device)
    w13 = torch.empty(count, 2 * i, h, dtype=torch.bfloat16, device=device)
    w2 = torch.empty(count, h, i, dtype=torch.bfloat16, device=device)
    for j in range(count):
        e = first + j
        s = 0.5 + e / e_all
        w13[j].copy_(torch.roll(b13, shifts=e, dims=1) * s)
        w2[j].copy_(torch.roll(b2, shifts=e, dims=0) * s)
    return w13, w2


def expert_reference(x, ids, w, w13, w2) -> torch.Tensor:
    """fp32 MoE output of the synthetic experts (all E, on the device of ``x``): out[t] =
    sum_j w[t, j] * swiglu_{ids[t, j]}(x[t]); ids are distinct per token (random routing)."""
    i = w2.shape[2]
    xf = x.float()
    out = torch.zeros_like(xf)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        w13e = w13[e].float()
        xt = xf[tok]
        y = (torch.nn.functional.silu(xt @ w13e[:i].T) * (xt @ w13e[i:].T)) @ w2[e].float().T
        out.index_add_(0, tok, y * w[tok, j, None])
    return out


class _AttentionSide:
    def __init__(self, ctx: _Ctx, buf, spec: Dict[str, Any], T: int, wq: List[torch.Tensor]):
        self.ctx, self.buf, self.spec, self.T = ctx, buf, spec, T
        self.cfg = buf.config
        self.wq = wq  # shared across T; grown by ensure_matmuls
        self.n = 0
        dev, h = ctx.device, spec["hidden"]
        self.xin = [torch.empty(T, h, dtype=torch.bfloat16, device=dev) for _ in range(2)]
        self.ids = [torch.empty(T, self.cfg.top_k, dtype=torch.int64, device=dev)
                    for _ in range(2)]
        self.w = [torch.empty(T, self.cfg.top_k, dtype=torch.float32, device=dev)
                  for _ in range(2)]
        self.set_inputs(0)

    def set_inputs(self, k: int) -> None:
        """Fresh inputs number ``k`` (micro-batch mb is the reference's Attention index)."""
        for mb in range(2):
            got = ref.make_inputs(self.cfg, self.T, "random",
                                  seed=self.spec["seed"] + self.T * 31 + k, a=mb)
            self.xin[mb].copy_(got.x)
            self.ids[mb].copy_(got.expert_ids)
            self.w[mb].copy_(got.weights)

    def ensure_matmuls(self, n: int) -> None:
        h = self.spec["hidden"]
        g = torch.Generator(device=self.ctx.device).manual_seed(self.spec["seed"] + 5
                                                                 + len(self.wq))
        while len(self.wq) < n:
            self.wq.append((torch.randn(h, h, device=self.ctx.device, generator=g)
                            * h ** -0.5).to(torch.bfloat16))
        self.n = n

    def attn(self, mb: int) -> torch.Tensor:
        h = self.xin[mb]
        for wt in self.wq[:self.n]:
            h = h @ wt
        return h

    def _dispatch(self, x, mb):
        self.buf.source_dispatch(x, self.ids[mb], self.w[mb], self.T, slot=mb)

    def exchange(self):
        out = []
        for mb in range(2):
            self._dispatch(self.xin[mb], mb)
            out.append(self.buf.source_collect(slot=mb))
        return {"x": list(self.xin), "out": out}

    def attention(self):
        return {"x": [self.attn(0), self.attn(1)]}

    def pipelined(self):
        h0 = self.attn(0)
        self._dispatch(h0, 0)
        h1 = self.attn(1)
        self._dispatch(h1, 1)
        o0 = self.buf.source_collect(slot=0)
        o1 = self.buf.source_collect(slot=1)
        return {"x": [h0, h1], "out": [o0, o1]}

    def serialized(self):
        h0 = self.attn(0)
        self._dispatch(h0, 0)
        o0 = self.buf.source_collect(slot=0)
        h1 = self.attn(1)
        self._dispatch(h1, 1)
        o1 = self.buf.source_collect(slot=1)
        return {"x": [h0, h1], "out": [o0, o1]}

    def check(self, kind: str, res, ref_w) -> float:
        """Largest relative error of the step's two micro-batch outputs."""
        worst = 0.0
        for mb in range(2):
            x, out = res["x"][mb], res["out"][mb]
            if kind == "exchange":  # identity experts, unweighted rows: rows summed
                want = x.float() * (self.ids[mb] >= 0).sum(dim=1, keepdim=True).float()
            else:
                want = expert_reference(x, self.ids[mb], self.w[mb], *ref_w)
            worst = max(worst, ref.relative_error(out, want))
        return worst


class _FfnSide:
    def __init__(self, ctx: _Ctx, buf, T: int, experts):
        self.ctx, self.buf, self.T, self.experts = ctx, buf, T, experts
        self.keep = None  # the rows of the eager exchange, for the experts-alone step

    def exchange(self):
        got = []
        for s in range(2):
            rec = self.buf.worker_receive(self.T, slot=s)
            self.buf.worker_reply(rec.x, rec.receipt)  # identity experts (BF16 rows as sent)
            got.append((rec.x, rec.weights, rec.expert_offsets))
        if self.keep is None:
            self.ctx.sync()
            self.keep = [tuple(t.clone() for t in g) for g in got]
        return None

    def experts_alone(self):
        return [self.experts(x, w, offs) for x, w, offs in self.keep]

    def layer(self):
        for s in range(2):
            rec = self.buf.worker_receive(self.T, slot=s)
            rows = self.experts(rec.x, rec.weights, rec.expert_offsets)
            self.buf.worker_reply(rows, rec.receipt)
        return None


# ---- one rank -----------------------------------------------------------------------------
def _time(ctx: _Ctx, step, timed: bool, spec, warmup: int, replays: int) -> List[float]:
    from .arms import _time_graph

    return _time_graph(_Clock(ctx, timed), step if step is not None else _Noop(), warmup,
                       replays, -1, spec["attention_delay_us"] * 1e-6, spec["queue_ahead_us"])


def _calibrate_matmuls(ctx: _Ctx, att: _AttentionSide, spec, exchange_us: float
                       ) -> Dict[str, Any]:
    """Attention rank: matmuls per micro-batch so that attn(mb) ~ ratio x one round trip."""
    probe = 4
    att.ensure_matmuls(probe)
    step = _Step(ctx, lambda: att.attn(0))
    for _ in range(3):
        step.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 20
    start.record()
    for _ in range(reps):
        step.replay()
    end.record()
    ctx.sync()
    per_us = start.elapsed_time(end) * 1000.0 / reps / probe
    target = spec["attention_ratio"] * exchange_us / 2.0
    n = int(min(spec["max_attention_matmuls"], max(1, round(target / max(per_us, 1e-3)))))
    del step
    return {"matmul_us": per_us, "target_us": target, "exchange_2mb_us": exchange_us,
            "matmuls": n}


def _cell(ctx: _Ctx, buf, spec, T: int, side_state) -> Dict[str, Any]:
    rec: Dict[str, Any] = {"tokens": T, "samples": {}, "round_order": []}
    att = ffn = None
    steps: Dict[str, Any] = {}

    def setup():
        nonlocal att, ffn
        if ctx.is_attention:
            att = _AttentionSide(ctx, buf, spec, T, side_state["wq"])
            n = spec["attention_matmuls"]
            att.ensure_matmuls(0 if n == "auto" else n)
        else:
            ffn = _FfnSide(ctx, buf, T, side_state["experts"])

    _phase(ctx, setup)
    me = att if ctx.is_attention else ffn
    _phase(ctx, lambda: steps.__setitem__("exchange", _Step(ctx, me.exchange)))

    if spec["attention_matmuls"] == "auto":
        calib = _time(ctx, steps["exchange"], ctx.is_attention, spec, 10, 50)

        def calibrate():
            if ctx.is_attention:
                rec["calibration"] = _calibrate_matmuls(ctx, att, spec,
                                                        stats.median(calib))
                att.ensure_matmuls(rec["calibration"]["matmuls"])
        _phase(ctx, calibrate)
    if ctx.is_attention:
        rec["attention_matmuls"] = att.n
        _say(ctx, f"T={T}: exchange captured; {att.n} attention matmuls per micro-batch "
                  f"{rec.get('calibration') or ''}")

    def capture_alone():
        if ctx.is_attention:
            steps["attention"] = _Step(ctx, att.attention)
        else:
            steps["experts"] = _Step(ctx, ffn.experts_alone)
    _phase(ctx, capture_alone)
    for kind in ("pipelined", "serialized"):
        fn = getattr(att, kind) if ctx.is_attention else ffn.layer
        _phase(ctx, lambda: steps.__setitem__(kind, _Step(ctx, fn)))

    checks: Dict[str, List[float]] = {k: [] for k in CHECKED}
    ref_w = side_state.get("ref_w")

    def check_eager():
        if ctx.is_attention:
            for kind in CHECKED:
                checks[kind].append(att.check(kind, steps[kind].eager_out, ref_w))
    _phase(ctx, check_eager)

    _say(ctx, f"T={T}: all steps captured, eager outputs checked "
              f"{ {k: f'{v[0]:.1e}' for k, v in checks.items()} if ctx.is_attention else ''}")
    # timing: rounds, step order rotating
    for r in range(spec["rounds"]):
        order = list(PARTS[r % len(PARTS):] + PARTS[:r % len(PARTS)])
        rec["round_order"].append(order)
        for part in order:
            timed = (TIMED_ON[part] == "attention") == ctx.is_attention
            samples = _time(ctx, steps.get(part), timed, spec, spec["warmup"],
                            spec["replays"])
            if timed:
                rec["samples"].setdefault(part, []).append(samples)

    # correctness of the graphs with fresh inputs
    for kind in CHECKED:
        for k in range(spec["checks"]):
            if ctx.is_attention:
                att.set_inputs(1000 + k)
                for o in steps[kind].out["out"]:
                    o.fill_(float("nan"))  # a replay that does not write them shows
            _time(ctx, steps[kind], False, spec, 0, 1)
            if ctx.is_attention:
                checks[kind].append(att.check(kind, steps[kind].out, ref_w))
    if ctx.is_attention:
        rec["checks"] = checks
        rec["first_check_is_eager"] = True
    ctx.sync()
    for t in buf.transports:
        t.check_error()
    steps.clear()
    gc.collect()
    ctx.sync()
    return rec


def world_main(rank: int, world_size: int, spec: Dict[str, Any]) -> Dict[str, Any]:
    """One spawned rank: every T of ``spec['tokens']``; returns this rank's records."""
    import torch_afdep
    from torch_afdep.nn import SwiGLUExperts, grouped_mm_supported

    t0 = time.perf_counter()
    ctx = _Ctx(rank, spec)
    if not ctx.cuda:
        torch.set_num_threads(1)  # two ranks share the machine's cores
    cfg = torch_afdep.Config(
        capacity_tokens_per_rank=max(spec["tokens"]), hidden_size=spec["hidden"],
        num_experts=spec["experts"], top_k=spec["top_k"], ffn_ranks=1, attention_ranks=1,
        num_sms=spec["sms"], timeout_s=float(spec["kernel_timeout"]), num_slots=2)
    out: Dict[str, Any] = {"rank": rank, "pid": os.getpid(), "cells": [],
                           "device_name": (torch.cuda.get_device_name(ctx.device)
                                           if ctx.cuda else "cpu")}
    with torch_afdep.Buffer(None, cfg, device=ctx.device) as buf:
        ctx.is_attention = buf.role == "attention"
        out["role"] = buf.role
        side_state: Dict[str, Any] = {"wq": []}

        def weights():
            el = cfg.experts_per_rank
            if ctx.is_attention:  # the reference needs every expert (one FFN rank here)
                side_state["ref_w"] = expert_weights(spec, 0, cfg.num_experts, ctx.device)
            else:
                first = buf.role_index * el
                ex = SwiGLUExperts(el, cfg.hidden_size, spec["intermediate"],
                                   first_expert=first, dtype=torch.bfloat16,
                                   device=ctx.device, method=spec["expert_method"])
                w13, w2 = expert_weights(spec, first, el, ctx.device)
                with torch.no_grad():
                    ex.w13.copy_(w13)
                    ex.w2.copy_(w2)
                del w13, w2
                side_state["experts"] = ex
                method = spec["expert_method"]
                if method == "auto":  # what the captured graphs use (see torch_afdep.nn)
                    method = ("grouped" if grouped_mm_supported(ctx.device, torch.bfloat16)
                              else "dense" if ctx.cuda else "loop")
                out["expert_method"] = method
        _phase(ctx, weights)
        try:
            for T in spec["tokens"]:
                out["cells"].append(_cell(ctx, buf, spec, T, side_state))
        finally:
            ctx.sync()
    out["wall_s"] = time.perf_counter() - t0
    return out


# ---- summary and output -------------------------------------------------------------------
def summarize(att: Dict[str, Any], ffn: Dict[str, Any], tol: float) -> Dict[str, Any]:
    """One T's record from the two ranks' records."""
    parts: Dict[str, Any] = {}
    for part in PARTS:
        src = att if TIMED_ON[part] == "attention" else ffn
        rounds = src["samples"].get(part, [])
        pooled = [s for r in rounds for s in r]
        round_medians = [stats.median(r) for r in rounds]
        entry = stats.summarize_samples(pooled)
        entry["pooled_median_us"] = entry.pop("median_us")
        entry.update(timed_on=TIMED_ON[part], round_medians_us=round_medians,
                     median_us=stats.median(round_medians),
                     samples_us=[[round(s, 2) for s in r] for r in rounds])
        parts[part] = entry
    med = {p: parts[p]["median_us"] for p in PARTS}
    out: Dict[str, Any] = {"tokens": att["tokens"],
                           "attention_matmuls": att.get("attention_matmuls"),
                           "calibration": att.get("calibration"), "parts": parts}
    if None not in med.values():
        total = med["exchange"] + med["attention"] + med["experts"]
        out.update(
            exchange_us=med["exchange"], attention_us=med["attention"],
            experts_us=med["experts"], sum_of_parts_us=total, step_us=med["pipelined"],
            serialized_us=med["serialized"],
            overlap_fraction=1.0 - med["pipelined"] / total if total > 0 else None,
            serialized_overlap_fraction=(1.0 - med["serialized"] / total
                                         if total > 0 else None),
            step_vs_serialized=(med["pipelined"] / med["serialized"] - 1.0
                                if med["serialized"] > 0 else None),
            hidden_us=total - med["pipelined"],
            largest_part_us=max(med["exchange"], med["attention"], med["experts"]))
    checks = att.get("checks", {})
    worst = {k: (max(v) if v else None) for k, v in checks.items()}
    out["checks"] = {"rel_err": checks, "worst": worst, "tol": tol}
    out["correct"] = bool(checks) and all(
        w is not None and math.isfinite(w) and w < tol for w in worst.values())
    return out


def _fmt(v, pct=False) -> str:
    if v is None:
        return "—"
    if pct:
        return f"{100 * v:+.1f}%"
    return f"{v:,.1f}"


def markdown(doc: Dict[str, Any]) -> str:
    c, cells = doc["config"], doc["results"]
    head = "| | " + " | ".join(f"T = {r['tokens']}" for r in cells) + " |"
    sep = "| --- |" + " --- |" * len(cells)

    def row(label, key, pct=False):
        return f"| {label} | " + " | ".join(_fmt(r.get(key), pct) for r in cells) + " |"

    lines = [
        f"# Two-micro-batch overlap, 1A1F on {doc['machine']['description']}",
        "",
        f"Commit `{doc['commit']}`, {doc['date']}. Hidden {c['hidden']} BF16, "
        f"E{c['experts']} / top-{c['top_k']}, random routing, T tokens per micro-batch "
        f"(bucket T), 2 slots, {c['sms']} SMs. Synthetic attention: chained "
        f"[T,{c['hidden']}]@[{c['hidden']},{c['hidden']}] bf16 matmuls "
        f"({c['attention_matmuls']}); synthetic experts: SwiGLU, intermediate "
        f"{c['intermediate']}, {doc.get('expert_method')} on the FFN rank. Each step one CUDA "
        f"graph per rank; µs, median of {c['rounds']} round median(s) of {c['replays']} "
        f"replays, ranks aligned before each replay."
        + (" **CPU smoke run: the numbers mean nothing.**" if c["cpu_smoke"] else ""),
        "",
        head, sep,
        "| attention matmuls per micro-batch | "
        + " | ".join(str(r.get("attention_matmuls")) for r in cells) + " |",
        row("(1) exchange alone (2 round trips)", "exchange_us"),
        row("(2) attention alone (2 micro-batches)", "attention_us"),
        row("(3) experts alone (2 micro-batches, FFN rank)", "experts_us"),
        row("sum of parts (1)+(2)+(3)", "sum_of_parts_us"),
        row("(5) serialized step", "serialized_us"),
        row("**(4) pipelined step**", "step_us"),
        row("overlap: 1 − pipelined / sum of parts", "overlap_fraction", pct=True),
        row("1 − serialized / sum of parts", "serialized_overlap_fraction", pct=True),
        row("pipelined vs serialized", "step_vs_serialized", pct=True),
        "| worst rel. error (pipelined / serialized / exchange) | " + " | ".join(
            " / ".join(f"{r['checks']['worst'].get(k) or 0:.1e}"
                       for k in ("pipelined", "serialized", "exchange")) for r in cells)
        + " |",
        "| correct | " + " | ".join("yes" if r["correct"] else "**NO**" for r in cells)
        + " |",
        "",
        "Pipelined: Attention attn(mb0) → dispatch(s0) → attn(mb1) → dispatch(s1) → "
        "collect(s0) → collect(s1); FFN receive(s0) → experts → reply(s0) → receive(s1) → "
        "experts → reply(s1). Serialized: attn, dispatch, collect per micro-batch in turn. "
        "Checked outputs: the eager run and the graph replays with fresh inputs, against the "
        "experts in fp32 (tolerance "
        f"{c['check_tol']:g}).",
        "",
    ]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if not args.cpu_smoke:
        ok = torch.cuda.is_available() and torch.cuda.device_count() >= 2
        try:
            importlib.import_module("torch_afdep._cuda")
        except ImportError:
            ok = False
        if not ok:
            print("benchmarks.overlap needs 2 CUDA GPUs and the built torch_afdep._cuda "
                  "extension (AFDEP_BUILD_CUDA=1 pip install --no-build-isolation --no-deps "
                  "-e .); --cpu-smoke exercises the plumbing without them", file=sys.stderr)
            return 2
    spec = {k: getattr(args, k) for k in (
        "tokens", "hidden", "experts", "top_k", "intermediate", "expert_method",
        "attention_matmuls",
        "attention_ratio", "max_attention_matmuls", "rounds", "replays", "warmup", "checks",
        "attention_delay_us", "queue_ahead_us", "sms", "kernel_timeout", "seed")}
    spec["device"] = "cpu" if args.cpu_smoke else "cuda"
    print(f"overlap: 1A1F on {spec['device']}, T = {args.tokens}, hidden {args.hidden} bf16, "
          f"E{args.experts} top-{args.top_k}, intermediate {args.intermediate}, "
          f"{args.rounds} round(s) x {args.replays} replays per step", flush=True)
    t0 = time.perf_counter()
    ranks, error = common.spawn(world_main, 2, spec, timeout=args.world_timeout,
                                device_ids=None if args.cpu_smoke else [0, 1])
    if ranks is None:
        print(f"FAILED: {error}", file=sys.stderr)
        return 1
    wall = time.perf_counter() - t0
    att = next(r for r in ranks if r["role"] == "attention")
    ffn = next(r for r in ranks if r["role"] == "ffn")
    results = [summarize(a, f, args.check_tol) for a, f in zip(att["cells"], ffn["cells"])]
    names = [] if args.cpu_smoke else [r["device_name"] for r in ranks]
    n_gpu = 0 if args.cpu_smoke else torch.cuda.device_count()
    machine = {"gpus_used": names, "device_count": n_gpu,
               "gpu": names[0] if names else None,
               "description": common.machine_name(names) or "CPU (gloo)"}
    date = datetime.date.today().isoformat()
    doc = {
        "kind": "overlap",
        "machine": machine,
        "commit": common.git_commit(),
        "date": date,
        "env": dict(common.software(), child_env=dict(common.CHILD_ENV)),
        "config": dict(spec, layout="1A1F", num_slots=2, routing="random", dtype="bf16",
                       cpu_smoke=args.cpu_smoke, quick=args.quick, check_tol=args.check_tol,
                       ranks={"ffn": ffn["rank"], "attention": att["rank"]},
                       timing="one CUDA graph per rank and step; cuda sync + gloo all-reduce "
                              "before each replay; CUDA events on the timing rank "
                              "(benchmarks.arms._time_graph)"),
        "expert_method": ffn.get("expert_method"),
        "results": results,
        "wall_s": wall,
        "rank_wall_s": {r["role"]: r["wall_s"] for r in ranks},
    }
    stem = args.name or f"{common.machine_slug(names)}-{date}-overlap"
    jpath = common.output_path(args.out_dir, stem, "json")
    mpath = common.output_path(args.out_dir, stem, "md")
    common.write_json(jpath, doc)
    md = markdown(doc)
    common.write_text(mpath, md)
    print(md)
    print(f"wrote {jpath} and {mpath} ({wall:.0f} s)")
    ok = all(r["correct"] for r in results)
    if not ok:
        print("FAIL: a checked output is off (see checks in the JSON)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
