"""Shared spawned-world bodies for the CPU contract tests (module level: spawn pickles them)."""

from __future__ import annotations

import torch

import torch_afdep
from torch_afdep import reference as ref


def expert_fn(e: int, rows: torch.Tensor) -> torch.Tensor:
    """A cheap, expert-dependent, nonlinear function of float rows [n, H] -> [n, H]."""
    return torch.tanh(rows) * (1.0 + 0.25 * ((e % 7) - 3)) + 0.01 * (e + 1)


def make_inputs(cfg, a: int, tokens: int, routing: str, seed: int):
    """Attention index a's inputs for one exchange (identical on every rank for a seed)."""
    g = torch.Generator().manual_seed(seed * 1009 + a)
    x32 = torch.randn(tokens, cfg.hidden_size, generator=g)
    if cfg.dtype == torch.float8_e4m3fn:
        blocks = x32.view(tokens, cfg.hidden_size // 128, 128)
        amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
        scales = (amax / 448.0).to(torch.float32)
        x = (blocks / scales[:, :, None]).view(tokens, cfg.hidden_size).to(torch.float8_e4m3fn)
    else:
        scales = None
        x = x32.to(torch.bfloat16)
    ids, w = ref.random_routing(cfg, tokens, routing, generator=g)
    if a % 2 == 1:
        ids = ids.to(torch.int32)  # both id dtypes in one exchange
    return x, ids, w, scales


def ffn_compute(cfg, f: int, received) -> torch.Tensor:
    """Apply expert_fn per local expert to the received rows, times each row's weight."""
    xr = received.x.to(torch.float64)
    if received.x_scales is not None:
        xr = xr * received.x_scales.to(torch.float64).repeat_interleave(128, dim=1)
    out = torch.full((xr.shape[0], cfg.hidden_size), float("nan"), dtype=torch.float64)
    offs = received.expert_offsets.tolist()
    for e in range(cfg.experts_per_rank):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            out[lo:hi] = expert_fn(f * cfg.experts_per_rank + e, xr[lo:hi])
    n = offs[-1]
    out[:n] *= received.weights[:n].to(torch.float64)[:, None]
    return out.to(torch.bfloat16)


def run_exchanges(rank, world, cases, seed0):
    """``cases``: list of (Config, plan); plan: list of (bucket, tokens per Attention index,
    routing) exchanges, run back to back on one Buffer per Config.

    Attention ranks return their relative error per exchange; FFN ranks check the received
    layout exactly and return their per-expert counts."""
    return [run_plan(cfg, plan, seed0 + 100 * i) for i, (cfg, plan) in enumerate(cases)]


def run_plan(cfg, plan, seed0):
    buf = torch_afdep.Buffer(None, cfg, device="cpu")
    results = []
    try:
        for step, (bucket, tokens, routing) in enumerate(plan):
            seed = seed0 + step
            all_inputs = [make_inputs(cfg, a, tokens[a], routing, seed)
                          for a in range(cfg.attention_ranks)]
            if buf.role == "attention":
                x, ids, w, s = all_inputs[buf.role_index]
                buf.source_dispatch(x, ids, w, bucket=bucket, x_scales=s)
                out = buf.source_collect()
                assert out.dtype == torch.bfloat16 and out.shape == (tokens[buf.role_index],
                                                                      cfg.hidden_size)
                want = ref.moe_output(cfg, x, ids, w, expert_fn, s)
                results.append(ref.relative_error(out, want))
                if tokens[buf.role_index]:
                    # bf16 storage of the expert output bounds the error per element.
                    assert torch.allclose(out.double(), want, atol=3e-2, rtol=3e-2), step
            else:
                received = buf.worker_receive(bucket)
                check_received(cfg, buf.role_index, received, all_inputs, bucket)
                rows = ffn_compute(cfg, buf.role_index, received)
                buf.worker_reply(rows, received.receipt)
                offs = received.expert_offsets
                results.append((offs[1:] - offs[:-1]).tolist())
    finally:
        buf.close()
    return results


def check_received(cfg, f, rec, all_inputs, bucket):
    """Exact checks of one FFN rank's received layout against the inputs of every source."""
    el, r = cfg.experts_per_rank, cfg.rows_per_token
    rows_cap = cfg.recv_rows(bucket)
    assert rec.x.shape == (rows_cap, cfg.hidden_size) and rec.x.dtype == cfg.dtype
    assert rec.weights.shape == (rows_cap,)
    assert rec.receipt.token_rows.shape == (cfg.attention_ranks, bucket, r)
    want_counts = ref.expert_counts(cfg, [inp[1] for inp in all_inputs])[f]
    offs = rec.expert_offsets.to(torch.int64)
    assert offs[0] == 0
    assert torch.equal(offs[1:] - offs[:-1], want_counts), (offs, want_counts)
    n = int(offs[-1])
    a_ranks = cfg.attention_group_ranks
    seen = set()
    for i in range(n):
        e = int(torch.searchsorted(offs, torch.tensor(i), right=True)) - 1
        src = a_ranks.index(int(rec.src_rank[i]))
        t = int(rec.src_token[i])
        x, ids, w, s = all_inputs[src]
        row_ids = ref.dedupe(ids[t:t + 1])[0]
        js = (row_ids == f * el + e).nonzero().flatten()
        assert js.numel() == 1, (i, e, src, t)
        j = int(js[0])
        assert (src, t, e) not in seen
        seen.add((src, t, e))
        assert torch.equal(rec.x[i].view(torch.uint8), x[t].view(torch.uint8))
        if s is not None:
            assert torch.equal(rec.x_scales[i], s[t])
        assert rec.weights[i].item() == w[t, j].item()
    # The receipt maps every (source, token) back to its rows.
    for a in range(cfg.attention_ranks):
        k = int(rec.receipt.num_tokens[a])
        ids = ref.dedupe(all_inputs[a][1])
        hits = ((ids >= f * el) & (ids < (f + 1) * el)).any(dim=1)
        assert k == int(hits.sum())
        assert torch.equal(rec.receipt.token_index[a, :k].to(torch.int64),
                           hits.nonzero().flatten())
        for s_ in range(k):
            rows = [int(v) for v in rec.receipt.token_rows[a, s_] if v >= 0]
            for row in rows:
                assert a_ranks.index(int(rec.src_rank[row])) == a
                assert int(rec.src_token[row]) == int(rec.receipt.token_index[a, s_])
