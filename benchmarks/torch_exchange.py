"""The AFD exchange written with plain torch ops around two all_to_all_single calls.

This is what the ``nccl`` arm runs: the same contract as ``torch_afdep`` (docs/contract.md),
built the way a user would build it from ``torch.distributed`` and ordinary tensor ops, so
that every step is graph-capturable (static shapes, no host sync):

- dispatch: each Attention rank packs every token once per FFN rank into a fixed byte row
  (payload, FP8 scales, expert ids, routing weights) and sends ``bucket`` rows to every FFN
  rank (capacity-padded splits; a padding row has every id -1 and so reaches no expert);
- the FFN rank drops ids it does not own (and repeated ids, first occurrence wins: the
  contract's rule, ``torch_afdep.reference.local_expert_ids``), and expands the tokens
  into one row per (token, local expert), expert-major, with
  ``expert_offsets`` prefix sums, weights, source rank and source token per row;
- combine: the FFN rank sums each token's rows in fp32 and sends one BF16 row per token
  back; the Attention rank sums the rows of its FFN ranks in fp32 and returns BF16.

The token layout (``Config(receive_layout="tokens")``) is built from the same dispatch:
``token_view`` gives the FFN rank one row per received token (a view of the received bytes)
with its local expert ids in the source's column order and their weights; the FFN sends one
row per token back with no reduction, and the Attention rank sums, per token, the rows of
the FFN ranks the token reached (``collect_tokens``).

The benchmark's stand-in "expert" (``new_reply`` + ``stand_in_expert``) is the same in every
arm: a BF16 reply tensor made once (ones), whose first ``EXPERT_COLS`` columns each step
overwrites with the received rows' first columns cast to BF16. It costs a few µs at most
in every cell, and the reply still carries each token's payload back for the check.

The helpers here are device-agnostic functions of tensors (tests check them on the CPU
against ``torch_afdep.reference``); the communication itself lives in ``benchmarks.arms``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from torch_afdep import reference as ref
from torch_afdep.config import FP8_BLOCK

_ALIGN = 16

#: Columns of each received row the stand-in expert copies into its reply (one FP8 block).
EXPERT_COLS = 128


class RowLayout(NamedTuple):
    """Byte layout of one dispatched token row (all offsets multiples of 4)."""

    hidden: int
    elem: int          # payload bytes per element (2 for BF16, 1 for FP8)
    scale_cols: int    # float32 scales per row (H/128 for FP8, else 0)
    top_k: int
    x_off: int
    scale_off: int
    ids_off: int
    w_off: int
    row_bytes: int


def row_layout(hidden: int, dtype: torch.dtype, top_k: int) -> RowLayout:
    """The packed row for ``hidden`` elements of ``dtype`` and ``top_k`` ids and weights."""
    if dtype == torch.float8_e4m3fn:
        elem, scale_cols = 1, hidden // FP8_BLOCK
    elif dtype == torch.bfloat16:
        elem, scale_cols = 2, 0
    else:
        raise TypeError(f"payload dtype must be bfloat16 or float8_e4m3fn, got {dtype}")
    x_off = 0
    scale_off = _round_up(hidden * elem, 4)
    ids_off = scale_off + 4 * scale_cols
    w_off = ids_off + 4 * top_k
    row_bytes = _round_up(w_off + 4 * top_k, _ALIGN)
    return RowLayout(hidden, elem, scale_cols, top_k, x_off, scale_off, ids_off, w_off,
                     row_bytes)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _payload_dtype(layout: RowLayout) -> torch.dtype:
    return torch.float8_e4m3fn if layout.elem == 1 else torch.bfloat16


def new_send_buffer(layout: RowLayout, ffn_ranks: int, bucket: int, device) -> torch.Tensor:
    """[F, bucket, row_bytes] uint8 dispatch send buffer; every id starts as -1 (padding)."""
    buf = torch.zeros(ffn_ranks, bucket, layout.row_bytes, dtype=torch.uint8, device=device)
    buf[..., layout.ids_off:layout.ids_off + 4 * layout.top_k] = 0xFF  # int32 -1
    return buf


def pack_dispatch(send: torch.Tensor, layout: RowLayout, x: torch.Tensor,
                  expert_ids: torch.Tensor, weights: torch.Tensor,
                  x_scales: Optional[torch.Tensor] = None) -> None:
    """Attention side: write T tokens into rows [0, T) of every FFN rank's slot of ``send``.

    send [F, bucket, row_bytes] uint8 (from ``new_send_buffer``); x [T, H] payload dtype;
    expert_ids [T, k] int32/int64; weights [T, k] float32; x_scales [T, H/128] float32 (FP8).
    Rows [T, bucket) keep their padding (ids -1). Every FFN rank gets every token: with
    fixed-size splits, sending only the tokens that reach a rank would move the same bytes.
    """
    t = x.shape[0]
    lay = layout
    send[:, :t, lay.x_off:lay.x_off + lay.hidden * lay.elem].copy_(
        x.contiguous().view(torch.uint8).unsqueeze(0))
    if lay.scale_cols:
        if x_scales is None:
            raise ValueError("x_scales is required for FP8 payloads")
        dst = send[:, :t, lay.scale_off:lay.scale_off + 4 * lay.scale_cols].view(torch.float32)
        dst.copy_(x_scales.unsqueeze(0))
    send[:, :t, lay.ids_off:lay.ids_off + 4 * lay.top_k].view(torch.int32).copy_(
        expert_ids.unsqueeze(0))
    send[:, :t, lay.w_off:lay.w_off + 4 * lay.top_k].view(torch.float32).copy_(
        weights.unsqueeze(0))


class Unpacked(NamedTuple):
    x: torch.Tensor                  # [n, H] payload dtype (a strided view)
    x_bytes: torch.Tensor            # [n, H*elem] uint8 view of the payload
    x_scales: Optional[torch.Tensor] # [n, H/128] float32 view, FP8 only
    expert_ids: torch.Tensor         # [n, k] int32 view
    weights: torch.Tensor            # [n, k] float32 view


def unpack(recv: torch.Tensor, layout: RowLayout) -> Unpacked:
    """FFN side: views of the received rows ``recv`` [n, row_bytes] uint8 (no copies)."""
    lay = layout
    xb = recv[:, lay.x_off:lay.x_off + lay.hidden * lay.elem]
    x = xb.view(_payload_dtype(lay))
    sc = None
    if lay.scale_cols:
        sc = recv[:, lay.scale_off:lay.scale_off + 4 * lay.scale_cols].view(torch.float32)
    ids = recv[:, lay.ids_off:lay.ids_off + 4 * lay.top_k].view(torch.int32)
    w = recv[:, lay.w_off:lay.w_off + 4 * lay.top_k].view(torch.float32)
    return Unpacked(x, xb, sc, ids, w)


class Expanded(NamedTuple):
    """An FFN rank's expert-major rows, as ``worker_receive`` would return them.

    Capacity ``n*R`` rows (n = A*bucket tokens received); rows past ``expert_offsets[-1]``
    are unspecified. ``row_token`` is the flat received-token index of each row (n for rows
    past the end), what ``reduce_rows`` needs.
    """

    x: torch.Tensor               # [n*R, H] payload dtype
    x_scales: Optional[torch.Tensor]
    weights: torch.Tensor         # [n*R] float32
    expert_offsets: torch.Tensor  # [E_local + 1] int32
    src_rank: torch.Tensor        # [n*R] int32 group rank of the source
    src_token: torch.Tensor       # [n*R] int32 token index at the source
    row_token: torch.Tensor       # [n*R] int64 flat token index, n = none


def expand(received: Unpacked, ffn_index: int, experts_per_rank: int, rows_per_token: int,
           bucket: int, source_ranks: torch.Tensor) -> Expanded:
    """FFN side: received tokens -> expert-major rows (static shapes, no host sync).

    received: ``unpack`` of the [A*bucket, row_bytes] rows, source a's tokens at rows
    [a*bucket, (a+1)*bucket); source_ranks [A] int32: group rank of Attention index a.
    """
    ids = received.expert_ids
    n, k = ids.shape
    el = experts_per_rank
    local = ref.local_expert_ids(ids, ffn_index, el)                  # [n, k], -1 = dropped
    key = torch.where(local >= 0, local, torch.full_like(local, el)).reshape(-1)
    order = torch.argsort(key, stable=True)                           # dropped entries last
    sorted_key = key.index_select(0, order)
    bounds = torch.arange(el + 1, dtype=torch.int64, device=ids.device)
    offsets = torch.searchsorted(sorted_key, bounds).to(torch.int32)  # [E_local + 1]
    cap = n * rows_per_token                                          # <= n*k
    order = order[:cap]
    tok = torch.div(order, k, rounding_mode="floor")
    valid = torch.arange(cap, device=ids.device) < offsets[el].to(torch.int64)
    x = received.x_bytes.index_select(0, tok).view(received.x.dtype)
    sc = None if received.x_scales is None else received.x_scales.index_select(0, tok)
    w = received.weights.reshape(-1).index_select(0, order)
    src_a = torch.div(tok, bucket, rounding_mode="floor")
    src_rank = source_ranks.to(torch.int32).index_select(0, src_a)
    src_token = (tok - src_a * bucket).to(torch.int32)
    row_token = torch.where(valid, tok, torch.full_like(tok, n))
    return Expanded(x, sc, w, offsets, src_rank, src_token, row_token)


def reduce_rows(rows: torch.Tensor, row_token: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """FFN side of combine: [num_tokens, H] BF16, the fp32 sum of each token's rows.

    rows [n*R, H] BF16 (already weighted); row_token [n*R] int64 from ``expand`` (num_tokens
    marks rows past the end; they land in a dropped sink row)."""
    acc = torch.zeros(num_tokens + 1, rows.shape[1], dtype=torch.float32, device=rows.device)
    acc.index_add_(0, row_token, rows.to(torch.float32))
    return acc[:num_tokens].to(torch.bfloat16)


def collect(replies: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Attention side of combine: replies [F, bucket, H] BF16 (one slot per FFN rank) ->
    [T, H] BF16, the fp32 sum over FFN ranks of the first T rows."""
    return replies[:, :num_tokens].to(torch.float32).sum(dim=0).to(torch.bfloat16)


def splits(roles: Sequence[str], role: str, count: int) -> list:
    """all_to_all_single split sizes in group-rank order: ``count`` rows to/from each rank of
    ``role``, 0 for the others."""
    return [count if r == role else 0 for r in roles]


# ---- the token layout ---------------------------------------------------------------------
class TokenView(NamedTuple):
    """An FFN rank's received tokens in the token layout, as ``worker_receive`` of a
    ``Config(receive_layout="tokens")`` buffer returns them (n = A*bucket rows, source a's
    tokens at rows [a*bucket, (a+1)*bucket), row = token index)."""

    x: torch.Tensor                  # [n, H] payload dtype, a view of the received bytes
    x_scales: Optional[torch.Tensor] # [n, H/128] float32 view, FP8 only
    expert_ids: torch.Tensor         # [n, k] int32 local ids in column order, -1 elsewhere
    weights: torch.Tensor            # [n, k] float32, 0 where the id is -1
    src_rank: torch.Tensor           # [n] int32 group rank of the source, -1: no token
    src_token: torch.Tensor          # [n] int32 token index at the source, -1: no token
    num_tokens: torch.Tensor         # [A] int32 tokens that reached this rank per source


def token_view(received: Unpacked, ffn_index: int, experts_per_rank: int, bucket: int,
               source_ranks: torch.Tensor) -> TokenView:
    """FFN side, token layout: received rows -> one row per token (static shapes, no host
    sync, no payload copy). A row "holds a token" when at least one of its ids is local
    (padding rows and tokens of other FFN ranks have every id -1)."""
    n = received.expert_ids.shape[0]
    local = ref.local_expert_ids(received.expert_ids, ffn_index, experts_per_rank)
    mine = local >= 0
    weights = torch.where(mine, received.weights, torch.zeros_like(received.weights))
    held = mine.any(dim=1)
    row = torch.arange(n, device=local.device)
    src_a = torch.div(row, bucket, rounding_mode="floor")
    none = torch.full((n,), -1, dtype=torch.int32, device=local.device)
    src_rank = torch.where(held, source_ranks.to(torch.int32).index_select(0, src_a), none)
    src_token = torch.where(held, (row - src_a * bucket).to(torch.int32), none)
    num_tokens = held.view(-1, bucket).sum(dim=1).to(torch.int32)
    return TokenView(received.x, received.x_scales, local.to(torch.int32), weights, src_rank,
                     src_token, num_tokens)


def collect_tokens(replies: torch.Tensor, reach: torch.Tensor) -> torch.Tensor:
    """Attention side of the token layout's combine: replies [F, bucket, H] BF16 (one row per
    token from every FFN rank), reach [T, F] bool (token t reached FFN index f) -> [T, H]
    BF16, the fp32 sum of the rows of the FFN ranks each token reached (the rows of the
    others are ignored, as the contract says)."""
    t = reach.shape[0]
    rows = replies[:, :t].to(torch.float32)
    keep = reach.t()[:, :, None]
    return torch.where(keep, rows, torch.zeros_like(rows)).sum(dim=0).to(torch.bfloat16)


# ---- the stand-in expert (every arm) ------------------------------------------------------
def new_reply(rows: int, hidden: int, device) -> torch.Tensor:
    """[rows, H] BF16 ones: the stand-in expert's reply, made once per cell (not timed)."""
    return torch.ones(rows, hidden, dtype=torch.bfloat16, device=device)


def stand_in_expert(reply: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The timed "expert": copy the first ``EXPERT_COLS`` columns of the received rows ``x``
    [rows, H] (any payload dtype) into ``reply`` as BF16; the other columns stay 1. Returns
    ``reply``. A token gets back ``stand_in_row`` of its row times its reply-row count."""
    c = min(EXPERT_COLS, reply.shape[1])
    reply[:, :c].copy_(x[:, :c])
    return reply


def stand_in_row(x: torch.Tensor) -> torch.Tensor:
    """[T, H] float32: what the stand-in expert replies for each source row of ``x``
    (its first ``EXPERT_COLS`` columns in BF16, then ones)."""
    c = min(EXPERT_COLS, x.shape[1])
    out = torch.ones(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    out[:, :c] = x[:, :c].to(torch.bfloat16).to(torch.float32)
    return out
