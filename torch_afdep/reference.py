"""Single-process fp64 reference of the AFD exchange contract (for tests and the demo)."""

from __future__ import annotations

from typing import Callable, List, Sequence

import torch

from .config import FP8_BLOCK, Config


def dequantize(x: torch.Tensor, x_scales: torch.Tensor | None) -> torch.Tensor:
    """[T, H] payload (+ [T, H/128] float32 scales for FP8) -> [T, H] float64."""
    xf = x.to(torch.float64)
    if x_scales is None:
        return xf
    t, h = x.shape
    s = x_scales.to(torch.float64).repeat_interleave(FP8_BLOCK, dim=1)[:, :h]
    return xf * s


def to_payload(config: Config, x32: torch.Tensor):
    """Float rows [T, H] -> (x [T, H] in ``config.dtype``, x_scales [T, H/128] float32 or
    None): BF16 as is, FP8 E4M3 with one scale per 128 elements (block amax / 448)."""
    if config.dtype != torch.float8_e4m3fn:
        return x32.to(torch.bfloat16), None
    t = x32.shape[0]
    blocks = x32.view(t, config.hidden_size // FP8_BLOCK, FP8_BLOCK)
    scales = (blocks.abs().amax(dim=2).clamp(min=1e-4) / 448.0).to(torch.float32)
    x = (blocks / scales[:, :, None]).view(t, config.hidden_size).to(torch.float8_e4m3fn)
    return x, scales


def dedupe(expert_ids: torch.Tensor) -> torch.Tensor:
    """[T, k] int64 copy of ``expert_ids`` where a repeated id within a token becomes -1
    (the contract counts a duplicated expert once: its first occurrence)."""
    ids = expert_ids.to(torch.int64).clone()
    for t in range(ids.shape[0]):
        seen = set()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= 0 and e in seen:
                ids[t, j] = -1
            seen.add(e)
    return ids


def expert_counts(config: Config, expert_ids: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rows each FFN rank receives per local expert: [F, E_local] int64, over all sources."""
    counts = torch.zeros(config.num_experts, dtype=torch.int64)
    for ids in expert_ids:
        flat = dedupe(ids).reshape(-1)
        flat = flat[flat >= 0]
        counts += torch.bincount(flat, minlength=config.num_experts)
    return counts.view(config.ffn_ranks, config.experts_per_rank)


def tokens_per_ffn(config: Config, expert_ids: torch.Tensor) -> torch.Tensor:
    """[T, F] bool: token t reaches FFN index f (deduplicated over its experts)."""
    t = expert_ids.shape[0]
    hit = torch.zeros(t, config.ffn_ranks, dtype=torch.bool)
    ids = expert_ids.to(torch.int64)
    for j in range(ids.shape[1]):
        valid = ids[:, j] >= 0
        f = torch.where(valid, ids[:, j] // config.experts_per_rank, torch.zeros_like(ids[:, j]))
        hit[torch.arange(t)[valid], f[valid]] = True
    return hit


def route_mask(config: Config, expert_ids: torch.Tensor) -> torch.Tensor:
    """[T] int64 route handle: bit f set when the token reaches FFN index f."""
    hit = tokens_per_ffn(config, expert_ids).to(torch.int64)
    bits = torch.ones(config.ffn_ranks, dtype=torch.int64) << torch.arange(
        config.ffn_ranks, dtype=torch.int64)
    return (hit * bits).sum(dim=1)


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
