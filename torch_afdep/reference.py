"""The exchange contract's semantics in one place: FP8 block quantization, duplicate and
invalid expert ids, which entries each FFN rank serves, test and benchmark inputs, and the
single-process fp64 reference of what ``source_collect`` returns.

The CPU transport, ``torch_afdep.nn``, the tests and the benchmarks all import these, so they
cannot drift apart. Everything but the fp64 loops works on any device and traces under
``torch.compile`` (no host syncs).
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Sequence

import torch

from .config import FP8_BLOCK, Config


#: FP8 E4M3's largest finite value: a block's amax maps to it.
FP8_MAX = 448.0

#: Smallest block amax used for a scale (an all-zero block still gets a finite scale).
FP8_MIN_AMAX = 1e-4


def quantize_fp8(x: torch.Tensor):
    """Per-128-element block quantization of rows [T, H] (H a multiple of 128).

    Returns (x_fp8 [T, H] float8_e4m3fn, scales [T, H/128] float32) with
    x ~= x_fp8 * scales: scale = max(block amax, 1e-4) / 448."""
    t, h = x.shape
    blocks = x.to(torch.float32).reshape(t, h // FP8_BLOCK, FP8_BLOCK)
    scales = (blocks.abs().amax(dim=2).clamp(min=FP8_MIN_AMAX) / FP8_MAX).to(torch.float32)
    q = (blocks / scales[:, :, None]).reshape(t, h).to(torch.float8_e4m3fn)
    return q.contiguous(), scales.contiguous()


def dequantize(x: torch.Tensor, x_scales: torch.Tensor | None) -> torch.Tensor:
    """[T, H] payload (+ [T, H/128] float32 scales for FP8) -> [T, H] float64."""
    xf = x.to(torch.float64)
    if x_scales is None or x_scales.numel() == 0:
        return xf
    h = x.shape[1]
    s = x_scales.to(torch.float64).repeat_interleave(FP8_BLOCK, dim=1)[:, :h]
    return xf * s


def to_payload(config: Config, x32: torch.Tensor):
    """Float rows [T, H] -> (x [T, H] in ``config.dtype``, x_scales [T, H/128] float32 or
    None): BF16 as is, FP8 through ``quantize_fp8``."""
    if config.dtype != torch.float8_e4m3fn:
        return x32.to(torch.bfloat16).contiguous(), None
    return quantize_fp8(x32)


def first_occurrence(expert_ids: torch.Tensor) -> torch.Tensor:
    """[T, k] bool: entry (t, j) is a valid id (>= 0) not seen earlier in token t. The contract
    counts a duplicated expert once, at its first occurrence."""
    ids = expert_ids.to(torch.int64)
    keep = ids >= 0
    k = ids.shape[1]
    if k > 1:
        same = ids[:, :, None] == ids[:, None, :]  # [T, j, j']
        pos = torch.arange(k, device=ids.device)
        earlier = pos[None, :] < pos[:, None]  # [j, j']: j' < j
        keep = keep & ~(same & earlier).any(dim=2)
    return keep


def dedupe(expert_ids: torch.Tensor) -> torch.Tensor:
    """[T, k] int64 copy of ``expert_ids`` where a repeated id within a token becomes -1."""
    ids = expert_ids.to(torch.int64)
    return torch.where(first_occurrence(ids), ids, torch.full_like(ids, -1))


def local_expert_ids(expert_ids: torch.Tensor, ffn_index: int, experts_per_rank: int
                     ) -> torch.Tensor:
    """[T, k] int64: per entry, the local expert id in [0, E_local) when FFN index
    ``ffn_index`` serves it (a valid first occurrence of one of its experts), else -1 (ids of
    other ranks, -1 ids, repeats). Same column order as ``expert_ids``."""
    ids = expert_ids.to(torch.int64)
    local = ids - ffn_index * experts_per_rank
    keep = first_occurrence(ids) & (local >= 0) & (local < experts_per_rank)
    return torch.where(keep, local, torch.full_like(local, -1))


def compact_local_routes(expert_ids: torch.Tensor, weights: torch.Tensor, ffn_index: int,
                         experts_per_rank: int, rows_per_token: int):
    """The entries of each token that FFN index ``ffn_index`` serves, compacted to the front
    in their column order.

    Returns (local_ids [T, R] int32, -1 padded; local_w [T, R] float32, 0 padded;
    hits [T] bool: the token reaches this FFN rank), R = ``rows_per_token``."""
    lid = local_expert_ids(expert_ids, ffn_index, experts_per_rank)
    mine = lid >= 0
    order = torch.argsort((~mine).to(torch.int8), dim=1, stable=True)  # chosen first
    sel = torch.gather(mine, 1, order)[:, :rows_per_token]
    ids = torch.gather(lid, 1, order)[:, :rows_per_token]
    w = torch.gather(weights.to(torch.float32), 1, order)[:, :rows_per_token]
    local_ids = torch.where(sel, ids, torch.full_like(ids, -1)).to(torch.int32)
    local_w = torch.where(sel, w, torch.zeros_like(w))
    return local_ids.contiguous(), local_w.contiguous(), sel.any(dim=1)


def expert_counts(config: Config, expert_ids: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rows each FFN rank receives per local expert: [F, E_local] int64, over all sources."""
    counts = torch.zeros(config.num_experts, dtype=torch.int64)
    for ids in expert_ids:
        flat = dedupe(ids).reshape(-1)
        flat = flat[flat >= 0]
        counts += torch.bincount(flat, minlength=config.num_experts)
    return counts.view(config.ffn_ranks, config.experts_per_rank)


def tokens_per_ffn(config: Config, expert_ids: torch.Tensor) -> torch.Tensor:
    """[T, F] bool: token t reaches FFN index f (has a valid id of one of its experts)."""
    ids = expert_ids.to(torch.int64)
    valid = (ids >= 0) & (ids < config.num_experts)
    f = torch.where(valid, ids // config.experts_per_rank, torch.full_like(ids, -1))
    ranks = torch.arange(config.ffn_ranks, device=ids.device)
    return (f[:, :, None] == ranks[None, None, :]).any(dim=1)


def route_mask(config: Config, expert_ids: torch.Tensor) -> torch.Tensor:
    """[T] int64 route handle: bit f set when the token reaches FFN index f."""
    hit = tokens_per_ffn(config, expert_ids).to(torch.int64)
    bits = torch.ones(config.ffn_ranks, dtype=torch.int64, device=hit.device) << torch.arange(
        config.ffn_ranks, dtype=torch.int64, device=hit.device)
    return (hit * bits).sum(dim=1)


class Inputs(NamedTuple):
    """One Attention rank's inputs of one exchange: x [T, H] ``config.dtype``; expert_ids
    [T, k] int64 (or int32); weights [T, k] float32; x_scales [T, H/128] float32 or None."""

    x: torch.Tensor
    expert_ids: torch.Tensor
    weights: torch.Tensor
    x_scales: Optional[torch.Tensor]


def make_inputs(config: Config, tokens: int, routing: str = "random", seed: int = 0,
                a: int = 0, device="cpu", id_dtype: torch.dtype = torch.int64) -> Inputs:
    """Attention index ``a``'s inputs for one exchange, the same on every rank and device for
    one (seed, a): rows from randn (quantized per ``config.dtype``), routing from
    ``random_routing(kind=routing)``."""
    g = torch.Generator().manual_seed(seed * 1009 + a * 7919 + 17)
    x, scales = to_payload(config, torch.randn(tokens, config.hidden_size, generator=g))
    ids, w = random_routing(config, tokens, routing, generator=g)
    return Inputs(x.to(device), ids.to(id_dtype).to(device), w.to(device),
                  None if scales is None else scales.to(device))


def moe_output(
    config: Config,
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    expert_fn: Callable[[int, torch.Tensor], torch.Tensor],
    x_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """What ``source_collect`` must return for one Attention rank, in float64:
    out[t] = sum_j [expert_ids[t, j] >= 0] * weights[t, j] * expert_fn(e, x[t]).

    ``expert_fn(e, rows)`` maps float64 rows [n, H] of global expert e to [n, H].
    """
    xf = dequantize(x, x_scales)
    out = torch.zeros(x.shape[0], config.hidden_size, dtype=torch.float64)
    ids = dedupe(expert_ids)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        y = expert_fn(e, xf[tok])
        out.index_add_(0, tok, y * weights[tok, slot].to(torch.float64)[:, None])
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / max(||ref||, tiny), in float64; NaN anywhere gives inf."""
    o = out.to(torch.float64).cpu()
    r = ref.to(torch.float64).cpu()
    if not torch.isfinite(o).all():
        return float("inf")
    denom = max(r.norm().item(), 1e-30)
    return (o - r).norm().item() / denom


def random_routing(
    config: Config, num_tokens: int, kind: str = "random", generator: torch.Generator | None = None,
    invalid_fraction: float = 0.25,
) -> List[torch.Tensor]:
    """(expert_ids [T, k] int64, weights [T, k] float32) for ``kind`` in
    ``"random"`` (k distinct experts per token), ``"skewed"`` (most tokens pick from a few hot
    experts) and ``"partial"`` (random, with about ``invalid_fraction`` of entries -1, and
    some tokens with no expert at all)."""
    g = generator
    e, k = config.num_experts, config.top_k
    if kind == "skewed":
        hot = max(k, e // 16)
        scores = torch.rand(num_tokens, e, generator=g)
        scores[:, :hot] += 4.0  # the first experts are hot
        ids = scores.topk(k, dim=1).indices
    else:
        ids = torch.rand(num_tokens, e, generator=g).topk(k, dim=1).indices
    ids = ids.to(torch.int64)
    if kind == "partial":
        drop = torch.rand(num_tokens, k, generator=g) < invalid_fraction
        if num_tokens > 1:
            drop[0] = True  # one token with no expert at all
        ids = torch.where(drop, torch.full_like(ids, -1), ids)
    elif kind not in ("random", "skewed"):
        raise ValueError(f"routing kind must be 'random', 'skewed' or 'partial', got {kind!r}")
    w = torch.rand(num_tokens, k, generator=g).to(torch.float32) + 0.1
    return [ids, w]
