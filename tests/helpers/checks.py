"""Test expert functions and the checks of one exchange against ``torch_afdep.reference``.

- ``tanh_expert`` / ``ffn_compute``: a nonlinear, expert-dependent test expert (fp64, host
  reads the offsets); ``scale_expert`` / ``ffn_rows``: ``rows * (1 + e/E)``, device-side and
  graph-capturable (no host reads).
- ``check_received``: everything an FFN rank received (rows per expert, payload and scale
  bits, weights of each first occurrence, receipt) against every source's inputs.
- ``check_attention``: what an Attention rank got back (route, zeros, finiteness, error
  against the fp64 reference, with a diagnosis of the wrong tokens).

Inputs are ``reference.Inputs`` (or any (x, expert_ids, weights, x_scales) tuple) on the
host; received and returned tensors may be on any device (they are copied to the host).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import List

import torch

from torch_afdep import reference as ref


# ---- expert functions -------------------------------------------------------------------
def tanh_expert(e: int, rows: torch.Tensor) -> torch.Tensor:
    """A cheap, expert-dependent, nonlinear function of float rows [n, H] -> [n, H]."""
    return torch.tanh(rows) * (1.0 + 0.25 * ((e % 7) - 3)) + 0.01 * (e + 1)


def scale_expert(cfg):
    """``rows * (1 + e/E)``: the expert ``ffn_rows`` applies on the device."""
    return lambda e, rows: rows * (1.0 + e / cfg.num_experts)


def _scales_or_none(x_scales):
    return None if x_scales is None or x_scales.numel() == 0 else x_scales


def ffn_compute(cfg, f: int, received) -> torch.Tensor:
    """``tanh_expert`` per local expert on the received rows, times each row's weight, in
    fp64 on the rows' device (rows past the last offset stay NaN: never read)."""
    xr = ref.dequantize(received.x, _scales_or_none(received.x_scales))
    out = torch.full((xr.shape[0], cfg.hidden_size), float("nan"), dtype=torch.float64,
                     device=xr.device)
    offs = received.expert_offsets.tolist()
    for e in range(cfg.experts_per_rank):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            out[lo:hi] = tanh_expert(f * cfg.experts_per_rank + e, xr[lo:hi])
    n = offs[-1]
    out[:n] *= received.weights[:n].to(torch.float64)[:, None]
    return out.to(torch.bfloat16)


def ffn_rows(cfg, f, x, x_scales, weights, offsets) -> torch.Tensor:
    """Device-side expert (graph-capturable): rows * (1 + e/E) * weight -> bf16."""
    n = x.shape[0]
    el = torch.searchsorted(offsets[1:].to(torch.int64),
                            torch.arange(n, device=x.device, dtype=torch.int64), right=True)
    e = (el + f * cfg.experts_per_rank).to(torch.float32)
    xf = x.to(torch.float32)
    if x_scales is not None and x_scales.numel() > 0:
        xf = xf * x_scales.repeat_interleave(128, dim=1)
    return (xf * (1.0 + e / cfg.num_experts)[:, None] * weights[:, None]).to(torch.bfloat16)


# ---- ids ----------------------------------------------------------------------------------
def clean_ids(cfg, ids) -> torch.Tensor:
    """int64 ids with entries outside [0, E) as -1 (how the contract treats them)."""
    ids = ids.to(torch.int64)
    return torch.where((ids >= 0) & (ids < cfg.num_experts), ids, torch.full_like(ids, -1))


def contract_ids(cfg, ids) -> torch.Tensor:
    """The ids the contract acts on: out-of-range -> -1, later duplicates -> -1 (int64)."""
    return ref.dedupe(clean_ids(cfg, ids))


# ---- what an FFN rank received ------------------------------------------------------------
def _host(rec) -> SimpleNamespace:
    """A ``Received`` (Buffer / afd_receive) or a transport's output tensors, on the host."""
    if hasattr(rec, "receipt"):
        r = rec.receipt
        t = (rec.x, rec.x_scales, rec.weights, rec.expert_offsets, rec.src_rank,
             rec.src_token, r.token_rows, r.token_index, r.num_tokens)
    else:
        t = (rec.x, rec.x_scales, rec.weights, rec.offsets, rec.src_rank, rec.src_token,
             rec.token_rows, rec.token_index, rec.num_tokens)
    names = ("x", "x_scales", "weights", "offsets", "src_rank", "src_token", "token_rows",
             "token_index", "num_tokens")
    host = {n: None if v is None else v.cpu() for n, v in zip(names, t)}
    host["x_scales"] = _scales_or_none(host["x_scales"])
    return SimpleNamespace(**host)


def check_received(cfg, f: int, rec, inputs, bucket=None, ordered=False) -> int:
    """Exact checks of FFN index ``f``'s received layout against ``inputs`` (one per
    Attention index); returns the number of rows. Ids are taken as the contract does
    (out-of-range and repeated entries count as -1).

    ``bucket``: also check the static shapes. ``ordered``: the receipt lists tokens in
    source order (the CPU transport does; the contract does not promise it)."""
    h = _host(rec)
    el, rpt = cfg.experts_per_rank, cfg.rows_per_token
    lo_e, hi_e = f * el, (f + 1) * el
    att = list(cfg.attention_group_ranks)
    if bucket is not None:
        rows_cap = cfg.recv_rows(bucket)
        assert h.x.shape == (rows_cap, cfg.hidden_size) and h.x.dtype == cfg.dtype
        assert h.weights.shape == (rows_cap,)
        assert h.token_rows.shape == (cfg.attention_ranks, bucket, rpt)
    cids = [contract_ids(cfg, inp[1]) for inp in inputs]
    # rows per local expert, and the prefix sums
    offs = h.offsets.to(torch.int64)
    counts = ref.expert_counts(cfg, cids)[f]
    want_offs = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    assert torch.equal(offs, want_offs), f"expert_offsets {offs.tolist()} != {want_offs.tolist()}"
    n = int(offs[-1])
    sr = h.src_rank[:n].to(torch.int64)
    st = h.src_token[:n].to(torch.int64)
    e_row = torch.searchsorted(offs[1:], torch.arange(n), right=True) + lo_e
    a_of = torch.full((max(att + [0]) + 1,), -1, dtype=torch.int64)
    a_of[torch.tensor(att, dtype=torch.int64)] = torch.arange(len(att))
    assert bool(((sr >= 0) & (sr < a_of.numel())).all()), "src_rank out of range"
    a_row = a_of[sr]
    assert bool((a_row >= 0).all()), "src_rank not an Attention rank"
    # every row is one (source, token, local expert) the contract sends, each exactly once
    max_t = max([inp[0].shape[0] for inp in inputs] + [1])
    key = (a_row * max_t + st) * cfg.num_experts + e_row
    assert key.unique().numel() == n, "a (source, token, expert) row arrived twice"
    bits = torch.int16 if h.x.dtype == torch.bfloat16 else torch.uint8
    for a, (x, ids, w, sc) in enumerate(inputs):
        m = a_row == a
        if not bool(m.any()):
            continue
        t = st[m]
        assert bool(((t >= 0) & (t < x.shape[0])).all()), f"src_token out of range from a={a}"
        match = cids[a][t] == e_row[m][:, None]  # [rows, k]
        assert bool((match.sum(dim=1) == 1).all()), f"a row from a={a} is not a routed entry"
        j = match.to(torch.float32).argmax(dim=1)
        got_w = h.weights[:n][m].contiguous().view(torch.int32)
        want_w = w[t, j].contiguous().view(torch.int32)
        assert torch.equal(got_w, want_w), f"weights from a={a} (first occurrence's)"
        assert torch.equal(h.x[:n][m].view(bits), x[t].view(bits)), f"payload from a={a}"
        if sc is not None:
            # bits, not values: a NaN scale must arrive as the same NaN
            assert torch.equal(h.x_scales[:n][m].contiguous().view(torch.int32),
                               sc[t].contiguous().view(torch.int32)), f"scales from a={a}"
    # the receipt maps every (source, token) back to its rows
    for a in range(cfg.attention_ranks):
        reach = (cids[a] >= lo_e) & (cids[a] < hi_e)
        tokens = reach.any(dim=1).nonzero().flatten()
        k = int(h.num_tokens[a])
        assert k == tokens.numel(), f"num_tokens[{a}] = {k}, want {tokens.numel()}"
        ti = h.token_index[a, :k].to(torch.int64)
        assert torch.equal(ti.sort().values, tokens), f"token_index[{a}]"
        if ordered:
            assert torch.equal(ti, tokens), f"token_index[{a}] not in source order"
        tr = h.token_rows[a, :k].to(torch.int64)  # [k, R]
        valid = tr >= 0
        per_tok = reach[ti].sum(dim=1)
        assert torch.equal(valid.sum(dim=1), per_tok), f"token_rows[{a}] row counts"
        assert torch.equal(valid, torch.arange(rpt)[None, :] < per_tok[:, None]), (
            f"token_rows[{a}]: -1 only after the valid rows")
        rows = tr[valid]
        assert bool((rows < n).all()), f"token_rows[{a}] past the received rows"
        assert bool((sr[rows] == att[a]).all()), f"token_rows[{a}] point at another source"
        tok_of = ti[:, None].expand(-1, rpt)[valid]
        assert torch.equal(st[rows], tok_of), f"token_rows[{a}] point at another token"
    return n


# ---- the token layout: what an FFN rank received, and its MoE rows ------------------------
def check_token_rows(cfg, f: int, rec, inputs, bucket: int) -> List[str]:
    """Every row of FFN index ``f``'s token-layout receive against ``inputs`` (one
    ``reference.Inputs`` per Attention index, on the host): shapes and dtypes, the receipt,
    every routed token once in its source's block with its exact payload and scales, local
    ids in the source's column order, the first occurrences' weights, rows without a token
    all -1 with weights 0. Returns the problems (empty: all right)."""
    inputs = [ref.Inputs(*(None if t is None else t.cpu() for t in inp)) for inp in inputs]
    problems = []
    rps, el, k = cfg.rows_per_source(bucket), cfg.experts_per_rank, cfg.top_k
    n_rows = cfg.token_rows(bucket)
    want_shapes = [("x", rec.x, (n_rows, cfg.hidden_size), cfg.dtype),
                   ("expert_ids", rec.expert_ids, (n_rows, k), torch.int32),
                   ("weights", rec.weights, (n_rows, k), torch.float32),
                   ("src_rank", rec.src_rank, (n_rows,), torch.int32),
                   ("src_token", rec.src_token, (n_rows,), torch.int32),
                   ("num_tokens", rec.num_tokens, (cfg.attention_ranks,), torch.int32)]
    if cfg.scale_cols:
        want_shapes.append(("x_scales", rec.x_scales, (n_rows, cfg.scale_cols), torch.float32))
    elif rec.x_scales is not None:
        problems.append("x_scales is not None for a BF16 payload")
    for name, t, shape, dtype in want_shapes:
        if t is None or tuple(t.shape) != shape or t.dtype != dtype:
            problems.append(f"{name}: {None if t is None else (tuple(t.shape), t.dtype)}, "
                            f"want {(shape, dtype)}")
    r = rec.receipt
    if r.bucket != bucket or not torch.equal(r.src_token.cpu(), rec.src_token.cpu()) or (
            not torch.equal(r.num_tokens.cpu(), rec.num_tokens.cpu())):
        problems.append("receipt disagrees with the receive (bucket, src_token, num_tokens)")
    if problems:
        return problems
    ids, w = rec.expert_ids.cpu(), rec.weights.cpu()
    tok, srank = rec.src_token.cpu(), rec.src_rank.cpu()
    x = rec.x.cpu()
    xs = None if rec.x_scales is None else rec.x_scales.cpu()
    bits = torch.int16 if cfg.dtype == torch.bfloat16 else torch.uint8
    for a, inp in enumerate(inputs):
        lid = ref.local_expert_ids(inp.expert_ids, f, el)
        want = (lid >= 0).any(dim=1).nonzero().flatten().tolist()
        n = int(rec.num_tokens[a])
        block = range(a * rps, (a + 1) * rps)  # the source's rows, in no promised order
        rows = [i for i in block if int(tok[i]) >= 0]
        got = [int(tok[i]) for i in rows]
        if len(rows) != n or sorted(got) != want or len(set(got)) != len(got):
            problems.append(f"source {a}: tokens {got} (num_tokens {n}), want each of {want} "
                            "once")
            continue
        for i in rows:
            t = int(tok[i])
            if int(srank[i]) != cfg.attention_group_ranks[a]:
                problems.append(f"row {i}: src_rank {int(srank[i])}, want "
                                f"{cfg.attention_group_ranks[a]}")
            if not torch.equal(x[i].view(bits), inp.x[t].view(bits)):
                problems.append(f"row {i}: payload of source {a} token {t} differs")
            if xs is not None and not torch.equal(xs[i].view(torch.int32),
                                                  inp.x_scales[t].view(torch.int32)):
                problems.append(f"row {i}: scales of source {a} token {t} differ")
            if not torch.equal(ids[i].to(torch.int64), lid[t]):
                problems.append(f"row {i} (source {a} token {t}): ids {ids[i].tolist()} != "
                                f"{lid[t].tolist()} (input ids {inp.expert_ids[t].tolist()})")
            want_w = torch.where(lid[t] >= 0, inp.weights[t], 0.0)
            if not torch.equal(w[i].view(torch.int32), want_w.view(torch.int32)):
                problems.append(f"row {i} (source {a} token {t}): weights {w[i].tolist()} != "
                                f"{want_w.tolist()}")
        empty = [i for i in block if int(tok[i]) < 0]
        if empty and not (bool((ids[empty] == -1).all()) and bool((srank[empty] == -1).all())):
            problems.append(f"source {a}: rows without a token are not all -1 (ids, src_rank)")
        if empty and not bool((w[empty] == 0).all()):
            problems.append(f"source {a}: rows without a token have nonzero weights")
    return problems


def token_moe_rows(cfg, f: int, rec, expert=None) -> torch.Tensor:
    """The caller's MoE in the token layout, with ``expert(global id, rows)`` (default
    ``tanh_expert``): row i = sum over token i's local ids j of w[i, j] * expert(ids[i, j],
    x[i]) in fp64; rows without a token (src_token -1) are NaN: the reply must ignore them."""
    expert = tanh_expert if expert is None else expert
    xf = ref.dequantize(rec.x.cpu(), None if rec.x_scales is None else rec.x_scales.cpu())
    ids, w = rec.expert_ids.cpu().to(torch.int64), rec.weights.cpu().to(torch.float64)
    out = torch.zeros_like(xf)
    for e in torch.unique(ids[ids >= 0]).tolist():
        r, j = (ids == e).nonzero(as_tuple=True)
        out.index_add_(0, r, expert(f * cfg.experts_per_rank + e, xf[r])
                       * w[r, j, None])
    out[rec.src_token.cpu() < 0] = float("nan")
    return out.to(torch.bfloat16).to(rec.x.device)


# ---- what an Attention rank got back -----------------------------------------------------
def check_attention(cfg, inp, out, route=None, *, expert, tol=1.5e-2, close=None,
                    previous=None) -> float:
    """``out`` (and ``route`` when given) of one Attention rank for ``inp`` = (x, ids, w, sc)
    on the host; returns the relative error against the fp64 reference with ``expert``.

    ``close``: also ``allclose`` with that atol = rtol (bf16 storage of the expert output
    bounds each element's error). ``previous``: the rank's previous inputs; a failure then
    also says which wrong tokens hold that exchange's result (a stale read)."""
    x, ids, w, sc = inp
    idc = clean_ids(cfg, ids)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (x.shape[0], cfg.hidden_size), (
        out.dtype, tuple(out.shape))
    want_route = ref.route_mask(cfg, idc)
    if route is not None:
        got_route = route.cpu()
        assert torch.equal(got_route, want_route), f"route {got_route[:8]} != {want_route[:8]}"
    want = ref.moe_output(cfg, x, idc, w, expert, sc)
    o = out.cpu().to(torch.float64)
    assert bool(torch.isfinite(o).all()), "non-finite output (unwritten rows?)"
    assert bool((o[want_route == 0] == 0).all()), "tokens with no expert must be zero"
    err = ref.relative_error(o, want) if x.shape[0] else 0.0
    if err >= tol:
        stale = None
        if previous is not None:
            px, pids, pw, psc = previous
            stale = ref.moe_output(cfg, px, clean_ids(cfg, pids), pw, expert, psc)
        raise AssertionError(f"relative error {err}; "
                             + diagnose_tokens(o, want, want_route, idc, stale=stale))
    if close is not None and x.shape[0]:
        assert torch.allclose(o, want, atol=close, rtol=close), err
    return err


def diagnose_tokens(o, want, route, ids, show=6, stale=None) -> str:
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


def expect(exc_type, fragment, fn, *args, **kwargs) -> str:
    """``fn(*args, **kwargs)`` must raise ``exc_type`` with ``fragment`` in its message;
    returns the message."""
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        assert fragment in str(e), f"{fragment!r} not in {e!r}"
        return str(e)
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc_type.__name__} "
                         f"({fragment!r})")
