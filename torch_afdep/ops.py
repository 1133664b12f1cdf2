"""The ``torch.ops.afdep`` custom ops: schemas, real kernels and fake kernels.

Schemas (docs/contract.md):

    afdep::dispatch(Tensor(a!) state, Tensor x, Tensor expert_ids, Tensor weights,
                    Tensor? x_scales, str group_name, int buffer_id, int bucket, int slot)
        -> Tensor
    afdep::combine(Tensor(a!) state, Tensor route, str group_name, int buffer_id, int slot)
        -> Tensor
    afdep::receive(Tensor(a!) state, str group_name, int buffer_id, int bucket, int slot)
        -> Tensor[9]
    afdep::reply(Tensor(a!) state, Tensor rows, Tensor token_rows, Tensor token_index,
                 Tensor num_tokens, str group_name, int buffer_id, int slot) -> Tensor
    afdep::receive_tokens(Tensor(a!) state, str group_name, int buffer_id, int bucket,
                          int slot) -> Tensor[7]                      (token layout)
    afdep::reply_tokens(Tensor(a!) state, Tensor rows, Tensor src_token, Tensor num_tokens,
                        str group_name, int buffer_id, int slot) -> Tensor (token layout)

Each real kernel finds the buffer's ``slots.Slots`` from ``(group_name, buffer_id)``, lets
it check the slot's phase (``begin``), runs that slot's transport on the current stream and
advances the phase (``end``). ``state`` is the buffer's ordering token: declared mutated, it
orders one buffer's ops in a traced graph and keeps ``reply`` from being eliminated.
The real kernels validate their arguments (``torch_afdep.validate``) after the state checks
and before anything is sent, so a bad argument raises its real TypeError / ValueError with
our message eagerly and inside compiled code alike (at run time: dynamo would hide an
exception raised while tracing). The fake kernels only give shapes and never raise for bad
values.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import registry, validate
from .config import Config
from .errors import AfdepBucketError


# ---- dispatch (Attention) -----------------------------------------------------------------
@torch.library.custom_op("afdep::dispatch", mutates_args=("state",))
def dispatch(
    state: torch.Tensor,
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    x_scales: Optional[torch.Tensor],
    group_name: str,
    buffer_id: int,
    bucket: int,
    slot: int,
    check_values: bool = False,
) -> torch.Tensor:
    """Attention: send each token once to every FFN rank holding one of its experts.

    Arguments:
        x: [T, H] payload dtype (bfloat16 or float8_e4m3fn).
        expert_ids: [T, k] int32/int64 global expert ids, -1 = none.
        weights: [T, k] float32 routing weights.
        x_scales: [T, H/128] float32 (FP8) or None.
        bucket: static token bucket (T <= bucket); slot: micro-batch slot.
        check_values: eager callers on CUDA read expert_ids on the host to refuse bad ids
            before the launch (``validate``; the CPU transport always checks them).
    Returns:
        route: [T] int64, bit f set when the token reached FFN index f.
    """
    slots = registry.lookup(group_name, buffer_id)
    transport = slots.begin(slot, "dispatch")
    validate.dispatch_args(slots.config, slots.device, x, expert_ids, weights, x_scales,
                           bucket, check_values)
    route = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    transport.dispatch(x, expert_ids, weights, x_scales, bucket, route)
    slots.end(slot, "dispatch", state, route)
    return route


@dispatch.register_fake
def _(state, x, expert_ids, weights, x_scales, group_name, buffer_id, bucket, slot,
      check_values=False):
    registry.lookup(group_name, buffer_id)
    return x.new_empty((x.shape[0],), dtype=torch.int64)


# ---- combine (Attention) ------------------------------------------------------------------
@torch.library.custom_op("afdep::combine", mutates_args=("state",))
def combine(state: torch.Tensor, route: torch.Tensor, group_name: str, buffer_id: int,
            slot: int) -> torch.Tensor:
    """Attention: receive one reply row per (token, FFN rank) and sum them in fp32.

    Arguments:
        route: [T] int64 from dispatch on the same slot.
    Returns:
        out: [T, H] bfloat16.
    """
    slots = registry.lookup(group_name, buffer_id)
    transport = slots.begin(slot, "combine")
    validate.route(slots.config, slots.device, route)
    slots.check_route(slot, route)
    out = torch.empty(route.shape[0], slots.config.hidden_size, dtype=torch.bfloat16,
                      device=route.device)
    try:
        transport.combine(route, out)
    except AfdepBucketError:
        slots.end(slot, "combine", state)  # the exchange finished (without data)
        raise
    slots.end(slot, "combine", state)
    return out


@combine.register_fake
def _(state, route, group_name, buffer_id, slot):
    cfg = registry.lookup(group_name, buffer_id).config
    return route.new_empty((route.shape[0], cfg.hidden_size), dtype=torch.bfloat16)


# ---- receive (FFN) ------------------------------------------------------------------------
def receive_outputs(cfg: Config, bucket: int, empty) -> Tuple[torch.Tensor, ...]:
    """The nine receive outputs, each made by ``empty(shape, dtype)``."""
    rows = cfg.recv_rows(bucket)
    a, r = cfg.attention_ranks, cfg.rows_per_token
    i32 = torch.int32
    return (
        empty((rows, cfg.hidden_size), cfg.dtype),       # x
        empty((rows, cfg.scale_cols), torch.float32),    # x_scales
        empty((rows,), torch.float32),                   # weights
        empty((cfg.experts_per_rank + 1,), i32),         # expert_offsets
        empty((rows,), i32),                             # src_rank
        empty((rows,), i32),                             # src_token
        empty((a, bucket, r), i32),                      # token_rows
        empty((a, bucket), i32),                         # token_index
        empty((a,), i32),                                # num_tokens
    )


@torch.library.custom_op("afdep::receive", mutates_args=("state",))
def receive(state: torch.Tensor, group_name: str, buffer_id: int, bucket: int, slot: int
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                       torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FFN: receive every Attention rank's tokens and expand them expert-major.

    Returns (A = attention_ranks, R = rows_per_token):
        x [A*bucket*R, H] payload dtype, x_scales [A*bucket*R, H/128 or 0] float32,
        weights [A*bucket*R] float32, expert_offsets [E_local+1] int32,
        src_rank [A*bucket*R] int32, src_token [A*bucket*R] int32,
        token_rows [A, bucket, R] int32, token_index [A, bucket] int32, num_tokens [A] int32.
    """
    slots = registry.lookup(group_name, buffer_id)
    transport = slots.begin(slot, "receive")
    validate.receive_args(slots.config, bucket)
    device = slots.device
    outs = receive_outputs(slots.config, bucket,
                           lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device))
    transport.receive(bucket, *outs)
    slots.end(slot, "receive", state, receipt=(("receipt.token_rows", outs[6]),
                                               ("receipt.token_index", outs[7]),
                                               ("receipt.num_tokens", outs[8])))
    return outs


@receive.register_fake
def _(state, group_name, buffer_id, bucket, slot):
    slots = registry.lookup(group_name, buffer_id)
    device = slots.device
    # A bad bucket raises in the real kernel (at run time, with its real type); shapes here
    # only need to be valid.
    bucket = min(max(int(bucket), 1), slots.config.capacity_tokens_per_rank)
    return receive_outputs(slots.config, bucket,
                           lambda shape, dtype: state.new_empty(shape, dtype=dtype,
                                                                device=device))


# ---- reply (FFN) --------------------------------------------------------------------------
@torch.library.custom_op("afdep::reply", mutates_args=("state",))
def reply(
    state: torch.Tensor,
    rows: torch.Tensor,
    token_rows: torch.Tensor,
    token_index: torch.Tensor,
    num_tokens: torch.Tensor,
    group_name: str,
    buffer_id: int,
    slot: int,
) -> torch.Tensor:
    """FFN: sum each received token's rows in fp32 and send one BF16 row back to its source.

    Arguments:
        rows: [A*bucket*R, H] bfloat16, already weighted.
        token_rows: [A, bucket, R] int32; token_index: [A, bucket] int32; num_tokens: [A]
            int32 (from receive on the same slot).
    Returns:
        an empty [0] int32 tensor: a dependency token for whatever must follow the reply.
    """
    slots = registry.lookup(group_name, buffer_id)
    transport = slots.begin(slot, "reply")
    validate.reply_tensors(slots.config, slots.device, rows, token_rows, token_index,
                           num_tokens)
    slots.check_receipt(slot, (("receipt.token_rows", token_rows),
                               ("receipt.token_index", token_index),
                               ("receipt.num_tokens", num_tokens)))
    transport.reply(rows, token_rows, token_index, num_tokens)
    slots.end(slot, "reply", state)
    return torch.empty(0, dtype=torch.int32, device=rows.device)


@reply.register_fake
def _(state, rows, token_rows, token_index, num_tokens, group_name, buffer_id, slot):
    registry.lookup(group_name, buffer_id)
    return rows.new_empty((0,), dtype=torch.int32)


# ---- the token layout (FFN; Config(receive_layout="tokens")) ------------------------------
def token_outputs(cfg: Config, bucket: int, empty) -> Tuple[torch.Tensor, ...]:
    """The token receive's outputs, each made by ``empty(shape, dtype)``."""
    n, k, i32 = cfg.token_rows(bucket), cfg.top_k, torch.int32
    return (
        empty((n, cfg.hidden_size), cfg.dtype),       # x (a view of the window)
        empty((n, cfg.scale_cols), torch.float32),    # x_scales (a view of the window)
        empty((n, k), i32),                           # expert_ids
        empty((n, k), torch.float32),                 # weights
        empty((n,), i32),                             # src_rank
        empty((n,), i32),                             # src_token
        empty((cfg.attention_ranks,), i32),           # num_tokens
    )


@torch.library.custom_op("afdep::receive_tokens", mutates_args=("state",))
def receive_tokens(state: torch.Tensor, group_name: str, buffer_id: int, bucket: int,
                   slot: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                       torch.Tensor, torch.Tensor, torch.Tensor]:
    """FFN, token layout: receive every Attention rank's tokens, one row per token.

    Returns (N = Config.token_rows(bucket), A = attention_ranks, k = top_k):
        x [N, H] payload dtype and x_scales [N, H/128 or 0] float32, views of the receive
        window (valid until this slot's reply); expert_ids [N, k] int32 (local ids in the
        source's column order, -1 elsewhere; rows without a token all -1); weights [N, k]
        float32 (0 where the id is -1); src_rank [N] int32, src_token [N] int32 (-1: no
        token); num_tokens [A] int32.
    """
    slots = registry.lookup(group_name, buffer_id)
    transport = slots.begin(slot, "receive")
    validate.receive_args(slots.config, bucket)
    device = slots.device
    _, _, ids, w, src_rank, src_token, num = token_outputs(
        slots.config, bucket, lambda shape, dtype: torch.empty(shape, dtype=dtype,
                                                               device=device))
    x, x_scales = transport.receive_tokens(bucket, ids, w, src_rank, src_token, num)
    slots.end(slot, "receive", state, receipt=(("receipt.src_token", src_token),
                                               ("receipt.num_tokens", num)))
    return x, x_scales, ids, w, src_rank, src_token, num


@receive_tokens.register_fake
def _(state, group_name, buffer_id, bucket, slot):
    slots = registry.lookup(group_name, buffer_id)
    device = slots.device
    bucket = min(max(int(bucket), 1), slots.config.capacity_tokens_per_rank)
    return token_outputs(slots.config, bucket,
                         lambda shape, dtype: state.new_empty(shape, dtype=dtype,
                                                              device=device))


@torch.library.custom_op("afdep::reply_tokens", mutates_args=("state",))
def reply_tokens(state: torch.Tensor, rows: torch.Tensor, src_token: torch.Tensor,
                 num_tokens: torch.Tensor, group_name: str, buffer_id: int, slot: int
                 ) -> torch.Tensor:
    """FFN, token layout: send each row back as its token's reply (no reduction here).

    Arguments:
        rows: [N, H] bfloat16, row i = the weighted sum of token i's local expert outputs.
        src_token: [N] int32; num_tokens: [A] int32 (from receive_tokens on the same slot).
    Returns:
        an empty [0] int32 dependency token.
    """
    slots = registry.lookup(group_name, buffer_id)
    transport = slots.begin(slot, "reply")
    validate.token_reply_tensors(slots.config, slots.device, rows, src_token, num_tokens)
    slots.check_receipt(slot, (("receipt.src_token", src_token),
                               ("receipt.num_tokens", num_tokens)))
    transport.reply_tokens(rows, src_token, num_tokens)
    slots.end(slot, "reply", state)
    return torch.empty(0, dtype=torch.int32, device=rows.device)


@reply_tokens.register_fake
def _(state, rows, src_token, num_tokens, group_name, buffer_id, slot):
    registry.lookup(group_name, buffer_id)
    return rows.new_empty((0,), dtype=torch.int32)


def _order_checks_off():
    """Alias of ``slots.order_checks_off`` (testing only)."""
    from .slots import order_checks_off

    return order_checks_off()


def __getattr__(name):
    # Old homes of names that moved: the wrappers (torch_afdep.functional) and the result
    # types (torch_afdep.types). Resolved lazily so ops imports nothing above it.
    if name in ("afd_dispatch", "afd_combine", "afd_receive", "afd_reply"):
        from . import functional

        return getattr(functional, name)
    if name in ("Receipt", "Received"):
        from . import types

        return getattr(types, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
