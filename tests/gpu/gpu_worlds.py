"""Spawned-world bodies of the GPU tests (module level: spawn pickles them by name).

Every body drives ``torch_afdep._cuda_impl.CudaTransport`` directly and checks each exchange
against ``torch_afdep.reference`` (fp64 on the CPU). Inputs are derived from a seed, so every
rank can rebuild every Attention rank's inputs and the FFN ranks check what they received.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from torch_afdep import reference as ref
from torch_afdep.config import FFN, Config

#: Environment of every GPU world: NVLink multicast stays off on the shared machines.
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}


def skip_unless_two_gpus() -> None:
    """Skip the calling test module unless 2 CUDA GPUs and the built extension are there.
    ``AFDEP_GPU_BODIES_ON_CPU=1`` imports the module anyway, so a script can smoke-test the
    bodies that also run on the CPU path (the tests themselves still need the GPUs)."""
    import pytest

    if os.environ.get("AFDEP_GPU_BODIES_ON_CPU") == "1":
        return

    try:
        import torch_afdep._cuda  # noqa: F401

        ok = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    except Exception:
        ok = False
    if not ok:
        pytest.skip("needs 2 CUDA GPUs and the torch_afdep._cuda extension",
                    allow_module_level=True)


def make_config(kw) -> Config:
    kw = dict(kw)
    if isinstance(kw.get("dtype"), str):
        kw["dtype"] = getattr(torch, kw["dtype"])
    if isinstance(kw.get("roles"), str):
        from torch_afdep.config import parse_roles

        kw["roles"] = parse_roles(kw["roles"])
    return Config(**kw)


def make_inputs(cfg, a: int, tokens: int, routing: str, seed: int, bad_ids: bool = False):
    """Attention index a's inputs for one exchange (identical on every rank for a seed)."""
    g = torch.Generator().manual_seed(seed * 1009 + a * 7919 + 17)
    x, scales = ref.to_payload(cfg, torch.randn(tokens, cfg.hidden_size, generator=g))
    ids, w = ref.random_routing(cfg, tokens, routing, generator=g)
    if bad_ids and tokens > 0:
        ids = ids.clone()
        ids[tokens // 2, 0] = cfg.num_experts + 5
        if cfg.top_k > 1:
            ids[tokens - 1, 1] = -3
    if (a + seed) % 2 == 1:
        ids = ids.to(torch.int32)  # both id dtypes
    return x, ids, w, scales


def clean_ids(cfg, ids):
    ids = ids.to(torch.int64)
    return torch.where((ids >= 0) & (ids < cfg.num_experts), ids, torch.full_like(ids, -1))


def expert_scale(cfg, e):
    return 1.0 + e / cfg.num_experts


def expert_fn_factory(cfg):
    return lambda e, rows: rows * expert_scale(cfg, e)


def ffn_rows(cfg, f, x, x_scales, weights, offsets):
    """Device-side expert function (graph-capturable): rows * (1 + e/E) * weight -> bf16."""
    n = x.shape[0]
    el = torch.searchsorted(offsets[1:].to(torch.int64),
                            torch.arange(n, device=x.device, dtype=torch.int64), right=True)
    e = (el + f * cfg.experts_per_rank).to(torch.float32)
    xf = x.to(torch.float32)
    if x_scales is not None and x_scales.numel() > 0:
        xf = xf * x_scales.repeat_interleave(128, dim=1)
    return (xf * (1.0 + e / cfg.num_experts)[:, None] * weights[:, None]).to(torch.bfloat16)


class FfnOutputs:
    def __init__(self, cfg, bucket, device):
        A, R, H = cfg.attention_ranks, cfg.rows_per_token, cfg.hidden_size
        rows = A * bucket * R
        self.bucket = bucket
        self.x = torch.empty(rows, H, dtype=cfg.dtype, device=device)
        self.x_scales = torch.empty(rows, cfg.scale_cols, dtype=torch.float32, device=device)
        self.weights = torch.empty(rows, dtype=torch.float32, device=device)
        self.offsets = torch.empty(cfg.experts_per_rank + 1, dtype=torch.int32, device=device)
        self.src_rank = torch.empty(rows, dtype=torch.int32, device=device)
        self.src_token = torch.empty(rows, dtype=torch.int32, device=device)
        self.token_rows = torch.empty(A, bucket, R, dtype=torch.int32, device=device)
        self.token_index = torch.empty(A, bucket, dtype=torch.int32, device=device)
        self.num_tokens = torch.empty(A, dtype=torch.int32, device=device)

    def poison(self):
        self.x.view(torch.uint8).fill_(0xFF)
        self.x_scales.fill_(float("nan"))
        self.weights.fill_(float("nan"))
        for t in (self.offsets, self.src_rank, self.src_token, self.token_rows,
                  self.token_index, self.num_tokens):
            t.fill_(-7)

    def receive(self, t):
        t.receive(self.bucket, self.x, self.x_scales if self.x_scales.shape[1] else None,
                  self.weights, self.offsets, self.src_rank, self.src_token, self.token_rows,
                  self.token_index, self.num_tokens)


def check_ffn(cfg, f, o: FfnOutputs, inputs):
    """Everything an FFN rank received, against the inputs of every Attention rank."""
    El, R = cfg.experts_per_rank, cfg.rows_per_token
    lo, hi = f * El, (f + 1) * El
    att = cfg.attention_group_ranks
    ids_all = [clean_ids(cfg, inp[1]) for inp in inputs]
    counts = ref.expert_counts(cfg, ids_all)[f]
    offs = o.offsets.cpu().to(torch.int64)
    want_offs = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    assert torch.equal(offs, want_offs), f"expert_offsets {offs.tolist()} != {want_offs.tolist()}"
    total = int(offs[-1])
    sr = o.src_rank.cpu()[:total].to(torch.int64)
    st = o.src_token.cpu()[:total].to(torch.int64)
    wr = o.weights.cpu()[:total]
    el = torch.searchsorted(offs[1:], torch.arange(total), right=True)
    # multiset of (a, token, expert, weight bits) against the reference
    a_of_rank = {r: i for i, r in enumerate(att)}
    assert all(int(r) in a_of_rank for r in sr.unique().tolist()), "src_rank not an Attention rank"
    got = sorted(zip([a_of_rank[int(r)] for r in sr.tolist()], st.tolist(),
                     (el + lo).tolist(), wr.view(torch.int32).tolist()))
    want = []
    for a, (x, ids, w, sc) in enumerate(inputs):
        ids = ids_all[a]
        m = (ids >= lo) & (ids < hi)
        tt, jj = m.nonzero(as_tuple=True)
        want += list(zip([a] * len(tt), tt.tolist(), ids[tt, jj].tolist(),
                         w[tt, jj].contiguous().view(torch.int32).tolist()))
    assert got == sorted(want), f"received rows differ ({len(got)} vs {len(want)})"
    # payload and scales bitwise
    if total:
        xr = o.x.cpu()[:total]
        ibits = torch.int16 if cfg.dtype == torch.bfloat16 else torch.uint8
        for a, (x, ids, w, sc) in enumerate(inputs):
            m = sr == att[a]
            if not m.any():
                continue
            assert torch.equal(xr[m].view(ibits), x[st[m]].view(ibits)), f"payload from a={a}"
            if sc is not None:
                assert torch.equal(o.x_scales.cpu()[:total][m], sc[st[m]]), f"scales from a={a}"
    # receipt
    nt = o.num_tokens.cpu()
    tr = o.token_rows.cpu()
    ti = o.token_index.cpu()
    for a, (x, ids, w, sc) in enumerate(inputs):
        ids = ids_all[a]
        reach = ((ids >= lo) & (ids < hi))
        tokens = reach.any(dim=1).nonzero().flatten()
        n = int(nt[a])
        assert n == len(tokens), f"num_tokens[{a}] = {n}, want {len(tokens)}"
        assert sorted(ti[a, :n].tolist()) == tokens.tolist(), f"token_index[{a}]"
        for s in range(n):
            tok = int(ti[a, s])
            rows = tr[a, s]
            valid = rows[rows >= 0]
            assert len(valid) == int(reach[tok].sum()), f"token_rows[{a},{s}]"
            assert bool((rows[len(valid):] == -1).all()), f"token_rows[{a},{s}] tail"
            assert bool((sr[valid.long()] == att[a]).all()) and bool((st[valid.long()] == tok).all())


def check_attention(cfg, x, ids, w, sc, route, out, tol=1.5e-2, previous=None):
    """``previous``: the (x, ids, w, sc) of this rank's previous exchange; a failure then
    also says which wrong tokens hold that exchange's result (a stale read)."""
    idc = clean_ids(cfg, ids)
    want_route = ref.route_mask(cfg, idc)
    got_route = route.cpu()
    assert torch.equal(got_route, want_route), f"route {got_route[:8]} != {want_route[:8]}"
    want = ref.moe_output(cfg, x, idc, w, expert_fn_factory(cfg), sc)
    o = out.cpu().to(torch.float64)
    assert bool(torch.isfinite(o).all()), "non-finite output (unwritten rows?)"
    zero = want_route == 0
    assert bool((o[zero] == 0).all()), "tokens with no expert must be zero"
    err = ref.relative_error(o, want) if x.shape[0] else 0.0
    if err >= tol:
        stale = None
        if previous is not None:
            px, pids, pw, psc = previous
            stale = ref.moe_output(cfg, px, clean_ids(cfg, pids), pw, expert_fn_factory(cfg), psc)
        raise AssertionError(f"relative error {err}; "
                             + diagnose_tokens(o, want, want_route, idc, stale=stale))
    return err


def diagnose_tokens(o, want, route, ids, show=6, stale=None):
    """Which tokens of a failed combine are wrong, and what they look like instead (the
    expected row of another token, zero, a multiple of the right row, or ``stale``: the
    previous exchange's result)."""
    tok_err = (o - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30)
    bad = (tok_err > 1.5e-2).nonzero().flatten().tolist()
    lines = [f"{len(bad)}/{o.shape[0]} tokens wrong"]
    if stale is not None and bad:
        n = min(stale.shape[0], o.shape[0])
        se = (o[:n] - stale[:n]).norm(dim=1) / stale[:n].norm(dim=1).clamp_min(1e-30)
        hits = [t for t in bad if t < n and float(se[t]) < 1.5e-2]
        lines.append(f"{len(hits)} of them hold the previous exchange's result")
    for t in bad[:show]:
        d = (want - o[t]).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30)
        best = int(d.argmin())
        ratio = float(o[t].norm() / want[t].norm().clamp_min(1e-30))
        cos = float((o[t] @ want[t]) / (o[t].norm() * want[t].norm()).clamp_min(1e-30))
        lines.append(f"t={t} err={float(tok_err[t]):.3g} |o|/|want|={ratio:.3g} cos={cos:.3g} "
                     f"closest want[{best}] ({float(d[best]):.3g}) route={int(route[t])} "
                     f"ids={ids[t].tolist()}")
    return "; ".join(lines)


def _transport(cfg, rank):
    from torch_afdep._cuda_impl import CudaTransport

    return CudaTransport(cfg, rank, torch.device("cuda", torch.cuda.current_device()),
                         dist.group.WORLD)


def flag_round_trip_body(rank, world, cfg_kw, calls):
    """The flag ping-pong probe between group ranks 0 and 1 (the benchmarks' floor term),
    ``calls`` times in a row (the ping values keep growing across calls); then one exchange
    on the same transport still checks exactly."""
    cfg = make_config(cfg_kw)
    t = _transport(cfg, rank)
    try:
        out = [t.flag_round_trip_us(1 - rank, initiator=rank == 0, iters=200, warmup=20)
               for _ in range(calls)]
        t.check_error()
        return out
    finally:
        t.close()


def _delay_cycles(name):
    ms = float(os.environ.get(name, "0") or 0)
    return int(ms * 2e6)  # about 2 GHz SM clock: a rough delay is enough


def exchanges_body(rank, world, cfg_kw, plan, seed0, bad_ids=False, view=False):
    """plan: list of (bucket, [T per Attention rank], routing). Returns per-rank stats.
    ``view``: Attention ranks collect with ``combine_view`` (one FFN rank; no copy), after
    poisoning the whole receive-buffer view with NaN before each dispatch."""
    cfg = make_config(cfg_kw)
    dev = torch.device("cuda", torch.cuda.current_device())
    t = _transport(cfg, rank)
    stats = {"registered_bytes": t.registered_bytes, "union_bytes": t.union_bytes,
             "role": cfg.role_of(rank), "errors": []}
    role, idx = cfg.role_of(rank), cfg.role_index(rank)
    # Diagnostics: a GPU-side delay (stream order kept) before the FFN's reply or before the
    # Attention's combine tells a receiver that reads too early from one that reads wrong data.
    delay_reply = _delay_cycles("AFDEP_TEST_REPLY_DELAY_MS")
    delay_combine = _delay_cycles("AFDEP_TEST_COMBINE_DELAY_MS")
    delay_dispatch = _delay_cycles("AFDEP_TEST_DISPATCH_DELAY_MS")
    inputs_prev = None
    view_out = None
    try:
        for i, (bucket, tokens, routing) in enumerate(plan):
            seed = seed0 + i
            inputs = [make_inputs(cfg, a, tokens[a], routing, seed, bad_ids)
                      for a in range(cfg.attention_ranks)]
            if role == FFN:
                o = FfnOutputs(cfg, bucket, dev)
                o.poison()
                o.receive(t)
                rows = ffn_rows(cfg, idx, o.x, o.x_scales if cfg.scale_cols else None,
                                o.weights, o.offsets)
                if delay_reply:
                    torch.cuda._sleep(delay_reply)
                t.reply(rows, o.token_rows, o.token_index, o.num_tokens)
                torch.cuda.synchronize()
                t.check_error()
                check_ffn(cfg, idx, o, inputs)
            else:
                x, ids, w, sc = inputs[idx]
                T = x.shape[0]
                route = torch.full((T,), -7, dtype=torch.int64, device=dev)
                out = torch.full((T, cfg.hidden_size), float("nan"), dtype=torch.bfloat16,
                                 device=dev)
                if view_out is not None:  # rows the FFN or the zeroing must rewrite
                    view_out.fill_(float("nan"))
                xd, idd, wd = x.to(dev), ids.to(dev), w.to(dev)
                scd = None if sc is None else sc.to(dev)
                if delay_dispatch:
                    torch.cuda._sleep(delay_dispatch)
                t.dispatch(xd, idd, wd, scd, bucket, route)
                if delay_combine:
                    torch.cuda._sleep(delay_combine)
                if view:
                    out = t.combine_view(route)
                    view_out = t._view  # the whole [C, H] buffer, poisoned next time
                else:
                    t.combine(route, out)
                torch.cuda.synchronize()
                try:
                    t.check_error()
                except Exception as e:  # noqa: BLE001
                    if not bad_ids:
                        raise
                    stats["errors"].append(type(e).__name__)
                try:
                    err = check_attention(cfg, x, ids, w, sc, route, out,
                                          previous=inputs_prev)
                except AssertionError as e:
                    raise AssertionError(f"exchange {i} (bucket {bucket}, tokens {tokens}, "
                                         f"{routing}): {e}") from None
                stats.setdefault("rel_err", []).append(err)
                inputs_prev = inputs[idx]
    finally:
        t.close()
    return stats


def view_exchanges_body(rank, world, cfg_kw, plan, seed0, bad_ids=False):
    """``exchanges_body`` with zero-copy collects (``CudaTransport.combine_view``)."""
    return exchanges_body(rank, world, cfg_kw, plan, seed0, bad_ids, view=True)


def graph_body(rank, world, cfg_kw, bucket, tokens, replays, seed0, routing="partial"):
    """Capture one exchange per rank in a CUDA graph; replay with fresh inputs each time."""
    cfg = make_config(cfg_kw)
    dev = torch.device("cuda", torch.cuda.current_device())
    t = _transport(cfg, rank)
    role, idx = cfg.role_of(rank), cfg.role_index(rank)
    checked = 0
    try:
        if role == FFN:
            o = FfnOutputs(cfg, bucket, dev)

            def step():
                o.receive(t)
                rows = ffn_rows(cfg, idx, o.x, o.x_scales if cfg.scale_cols else None,
                                o.weights, o.offsets)
                t.reply(rows, o.token_rows, o.token_index, o.num_tokens)

            # eager warm-up exchange (pairs with the Attention ranks' one)
            o.poison()
            step()
            torch.cuda.synchronize()
            t.check_error()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            dist.barrier()
            for i in range(replays):
                inputs = [make_inputs(cfg, a, tokens[a], routing, seed0 + i)
                          for a in range(cfg.attention_ranks)]
                o.poison()
                g.replay()
                torch.cuda.synchronize()
                t.check_error()
                check_ffn(cfg, idx, o, inputs)
                checked += 1
        else:
            T = tokens[idx]
            x0, ids0, w0, sc0 = make_inputs(cfg, idx, T, routing, seed0 - 1)
            xs = x0.to(dev)
            ids_s = ids0.to(torch.int64).to(dev)
            ws = w0.to(dev)
            scs = None if sc0 is None else sc0.to(dev)
            route = torch.empty(T, dtype=torch.int64, device=dev)
            out = torch.empty(T, cfg.hidden_size, dtype=torch.bfloat16, device=dev)

            def step():
                t.dispatch(xs, ids_s, ws, scs, bucket, route)
                t.combine(route, out)

            step()
            torch.cuda.synchronize()
            t.check_error()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            dist.barrier()
            for i in range(replays):
                x, ids, w, sc = make_inputs(cfg, idx, T, routing, seed0 + i)
                xs.copy_(x)
                ids_s.copy_(ids.to(torch.int64))
                ws.copy_(w)
                if sc is not None:
                    scs.copy_(sc)
                route.fill_(-7)
                out.fill_(float("nan"))
                g.replay()
                torch.cuda.synchronize()
                t.check_error()
                check_attention(cfg, x, ids, w, sc, route, out)
                checked += 1
    finally:
        t.close()
    return checked


def timeout_body(rank, world, cfg_kw):
    """One side never sends: the waiting rank raises AfdepTimeoutError within the timeout."""
    from torch_afdep.errors import AfdepTimeoutError

    cfg = make_config(cfg_kw)
    dev = torch.device("cuda", torch.cuda.current_device())
    t = _transport(cfg, rank)
    res = {}
    try:
        if cfg.role_of(rank) == FFN:
            o = FfnOutputs(cfg, 8, dev)
            t0 = time.monotonic()
            o.receive(t)  # no Attention rank dispatches
            torch.cuda.synchronize()
            res["elapsed"] = time.monotonic() - t0
            try:
                t.check_error()
                res["raised"] = None
            except AfdepTimeoutError as e:
                res["raised"] = ("dispatch", e.phase, e.peer, e.rank)
            dist.barrier()
        else:
            dist.barrier()
            route = torch.zeros(0, dtype=torch.int64, device=dev)
            out = torch.zeros(3, cfg.hidden_size, dtype=torch.bfloat16, device=dev)
            route = torch.ones(3, dtype=torch.int64, device=dev)
            t0 = time.monotonic()
            t.combine(route, out)  # no FFN rank replies
            torch.cuda.synchronize()
            res["elapsed"] = time.monotonic() - t0
            try:
                t.check_error()
                res["raised"] = None
            except AfdepTimeoutError as e:
                res["raised"] = ("combine", e.phase, e.peer, e.rank)
    finally:
        t.close()
    return res


def sizes_body(rank, world, cfg_kw):
    cfg = make_config(cfg_kw)
    t = _transport(cfg, rank)
    try:
        return {"role": cfg.role_of(rank), "registered_bytes": t.registered_bytes,
                "union_bytes": t.union_bytes, "signal_bytes": t.signal_bytes}
    finally:
        t.close()


def buffer_body(rank, world, cfg_kw, plan, seed0):
    """The same checks through the public Buffer API (torch_afdep.Buffer on a CUDA device)."""
    import torch_afdep

    cfg = make_config(cfg_kw)
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = torch_afdep.Buffer(dist.group.WORLD, cfg, device=dev)
    role, idx = cfg.role_of(rank), cfg.role_index(rank)
    done = 0
    try:
        assert type(buf.transport).__name__ == "CudaTransport"
        for i, (bucket, tokens, routing) in enumerate(plan):
            inputs = [make_inputs(cfg, a, tokens[a], routing, seed0 + i)
                      for a in range(cfg.attention_ranks)]
            if role == FFN:
                rec = buf.worker_receive(bucket)
                rows = ffn_rows(cfg, idx, rec.x, rec.x_scales, rec.weights, rec.expert_offsets)
                buf.worker_reply(rows, rec.receipt)
                torch.cuda.synchronize()
            else:
                x, ids, w, sc = inputs[idx]
                buf.source_dispatch(x.to(dev), ids.to(dev), w.to(dev), bucket,
                                    None if sc is None else sc.to(dev))
                out = buf.source_collect()
                torch.cuda.synchronize()
                route = ref.route_mask(cfg, clean_ids(cfg, ids))
                check_attention(cfg, x, ids, w, sc, route, out)
            done += 1
    finally:
        buf.close()
    return done


def spawn_gpu_world(fn, world, *args, device_ids, **kw):
    """``spawn_world`` for GPU worlds: one rank per GPU where the machine has enough GPUs
    (``device_ids`` is the mapping for two GPUs). Several ranks on one GPU need that GPU to run kernels of
    several processes at once (the spin-waits assume it): CUDA MPS does, plain time-slicing
    did not on the lent H200s (a receiver's spinning kernel kept its peer's kernel off the GPU
    until the receiver timed out). Such worlds skip unless ``AFDEP_TEST_SHARED_GPU=1``, which
    scripts/gpu_suite.sh sets after it started an MPS daemon."""
    import pytest

    from torch_afdep.testing import spawn_world

    device_ids = list(device_ids)
    if len(set(device_ids)) < len(device_ids) and torch.cuda.device_count() >= len(device_ids):
        device_ids = list(range(len(device_ids)))  # enough GPUs: one rank per GPU
    if len(set(device_ids)) < len(device_ids) and os.environ.get("AFDEP_TEST_SHARED_GPU") != "1":
        pytest.skip(f"ranks share a GPU (devices {device_ids}): needs CUDA MPS "
                    "(AFDEP_TEST_SHARED_GPU=1)")
    return spawn_world(fn, world, *args, device_ids=device_ids, **kw)
