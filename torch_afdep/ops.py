"""The ``torch.ops.afdep`` custom ops, their fake kernels and thin Python wrappers.

Schemas (see docs/contract.md):

    afdep::dispatch(Tensor(a!) state, Tensor x, Tensor expert_ids, Tensor weights,
                    Tensor? x_scales, str group_name, int buffer_id, int bucket, int slot)
        -> Tensor
    afdep::combine(Tensor(a!) state, Tensor route, str group_name, int buffer_id, int slot)
        -> Tensor
    afdep::receive(Tensor(a!) state, str group_name, int buffer_id, int bucket, int slot)
        -> Tensor[9]
    afdep::reply(Tensor(a!) state, Tensor rows, Tensor token_rows, Tensor token_index,
                 Tensor num_tokens, str group_name, int buffer_id, int slot) -> Tensor

Each op finds its buffer from ``(group_name, buffer_id)`` and runs the transport of micro-batch
slot ``slot`` (CPU over gloo or CUDA over NVLink) on the current stream. ``state`` is the
buffer's ordering token: the ops declare it mutated (and bump the host-side call counter in
it), which orders the ops of one buffer in a traced graph and keeps ``reply`` from being
eliminated.

Each slot has a host-side phase (Attention: idle -> dispatched -> idle; FFN: idle -> received
-> idle) that the real kernels advance when they run (eagerly, inside a compiled graph, or
while a CUDA graph is captured; not on CUDA graph replays): an op that would reuse a slot
before its previous exchange finished raises ``AfdepStateError`` before any communication.

The wrappers (``afd_dispatch`` ...) validate arguments and call the ops; unlike the ``Buffer``
role methods they keep no Python state, so they trace under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional, Tuple

import torch

from . import registry
from .config import Config
from .errors import AfdepStateError

# Entries of the state tensor.
_SEND_CALLS, _RECV_CALLS = 0, 1

#: Per-slot order checks in the real kernels; off only inside ``_order_checks_off()``
#: (torch.library.opcheck calls one op several times in a row).
_CHECK_ORDER = True

#: phase a slot must be in before each op, and the phase after it.
_TRANSITIONS = {
    "dispatch": ("idle", "dispatched"),
    "combine": ("dispatched", "idle"),
    "receive": ("idle", "received"),
    "reply": ("received", "idle"),
}
_OUT_OF_ORDER = {
    "dispatch": "slot {slot} still holds a dispatched exchange: combine it first",
    "combine": "no dispatch is open on slot {slot}",
    "receive": "slot {slot} still holds a received exchange: reply to it first",
    "reply": "no receive is open on slot {slot}",
}


@contextlib.contextmanager
def _order_checks_off():
    """Testing only (opcheck): let the kernels run without the per-slot phase checks."""
    global _CHECK_ORDER
    old, _CHECK_ORDER = _CHECK_ORDER, False
    try:
        yield
    finally:
        _CHECK_ORDER = old


def _bump(state: torch.Tensor, entry: int) -> None:
    state[entry] += 1


def _enter(buf, slot: int, op: str):
    """The transport of ``slot`` once the slot's phase allows ``op`` (real kernels only; fake
    kernels never touch host state); ``_leave`` advances the phase after the op's work."""
    buf.config.check_slot(slot)
    for t in buf.transports:  # a device error of an earlier (maybe compiled) call raises here
        t.check_error()
    before = _TRANSITIONS[op][0]
    phase = buf._slot_phase[slot]
    if _CHECK_ORDER and phase != before:
        raise AfdepStateError(
            f"afdep::{op}: " + _OUT_OF_ORDER[op].format(slot=slot) + " (each slot holds one "
            "exchange at a time; use another slot for the next micro-batch)")
    return buf.transports[slot]


def _leave(buf, slot: int, op: str) -> None:
    buf._slot_phase[slot] = _TRANSITIONS[op][1]


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
) -> torch.Tensor:
    """Attention: send each token once to every FFN rank holding one of its experts.

    x [T, H] payload dtype; expert_ids [T, k] int32/int64 (-1 = none); weights [T, k] float32;
    x_scales [T, H/128] float32 (FP8) or None; slot: micro-batch slot. Returns route [T] int64
    (bit f: reached FFN f).
    """
    buf = registry.lookup(group_name, buffer_id)
    transport = _enter(buf, slot, "dispatch")
    route = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    transport.dispatch(x, expert_ids, weights, x_scales, bucket, route)
    _leave(buf, slot, "dispatch")
    _bump(state, _SEND_CALLS)
    return route


@dispatch.register_fake
def _(state, x, expert_ids, weights, x_scales, group_name, buffer_id, bucket, slot):
    registry.lookup(group_name, buffer_id).config.check_slot(slot)
    return x.new_empty((x.shape[0],), dtype=torch.int64)


# ---- combine (Attention) ------------------------------------------------------------------
@torch.library.custom_op("afdep::combine", mutates_args=("state",))
def combine(state: torch.Tensor, route: torch.Tensor, group_name: str, buffer_id: int,
            slot: int) -> torch.Tensor:
    """Attention: receive one reply row per (token, FFN rank) and sum them in fp32.

    route [T] int64 from dispatch on the same slot. Returns out [T, H] bfloat16.
    """
    buf = registry.lookup(group_name, buffer_id)
    transport = _enter(buf, slot, "combine")
    out = torch.empty(route.shape[0], buf.config.hidden_size, dtype=torch.bfloat16,
                      device=route.device)
    transport.combine(route, out)
    _leave(buf, slot, "combine")
    _bump(state, _RECV_CALLS)
    return out


@combine.register_fake
def _(state, route, group_name, buffer_id, slot):
    cfg = registry.lookup(group_name, buffer_id).config
    cfg.check_slot(slot)
    return route.new_empty((route.shape[0], cfg.hidden_size), dtype=torch.bfloat16)


# ---- receive (FFN) ------------------------------------------------------------------------
def _receive_outputs(cfg: Config, bucket: int, device, empty) -> Tuple[torch.Tensor, ...]:
    rows = cfg.recv_rows(bucket)
    a, r = cfg.attention_ranks, cfg.rows_per_token
    i32 = torch.int32
    return (
        empty((rows, cfg.hidden_size), cfg.dtype, device),       # x
        empty((rows, cfg.scale_cols), torch.float32, device),    # x_scales
        empty((rows,), torch.float32, device),                   # weights
        empty((cfg.experts_per_rank + 1,), i32, device),         # expert_offsets
        empty((rows,), i32, device),                             # src_rank
        empty((rows,), i32, device),                             # src_token
        empty((a, bucket, r), i32, device),                      # token_rows
        empty((a, bucket), i32, device),                         # token_index
        empty((a,), i32, device),                                # num_tokens
    )


def _torch_empty(shape, dtype, device):
    return torch.empty(shape, dtype=dtype, device=device)


@torch.library.custom_op("afdep::receive", mutates_args=("state",))
def receive(state: torch.Tensor, group_name: str, buffer_id: int, bucket: int, slot: int
            ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                       torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FFN: receive every Attention rank's tokens and expand them expert-major.

    Returns (x [A*bucket*R, H] payload dtype, x_scales [A*bucket*R, H/128 or 0] float32,
    weights [A*bucket*R] float32, expert_offsets [E_local+1] int32, src_rank [A*bucket*R]
    int32, src_token [A*bucket*R] int32, token_rows [A, bucket, R] int32,
    token_index [A, bucket] int32, num_tokens [A] int32) of micro-batch slot ``slot``.
    """
    buf = registry.lookup(group_name, buffer_id)
    transport = _enter(buf, slot, "receive")
    outs = _receive_outputs(buf.config, bucket, buf.device, _torch_empty)
    transport.receive(bucket, *outs)
    _leave(buf, slot, "receive")
    _bump(state, _RECV_CALLS)
    return outs


@receive.register_fake
def _(state, group_name, buffer_id, bucket, slot):
    buf = registry.lookup(group_name, buffer_id)
    buf.config.check_slot(slot)

    def empty(shape, dtype, device):
        return state.new_empty(shape, dtype=dtype, device=device)

    return _receive_outputs(buf.config, bucket, buf.device, empty)


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

    rows [A*bucket*R, H] bfloat16 (already weighted); token_rows [A, bucket, R] int32;
    token_index [A, bucket] int32; num_tokens [A] int32 (from receive on the same slot).
    Returns an empty [0] int32 tensor: a dependency token for whatever must follow the reply.
    """
    buf = registry.lookup(group_name, buffer_id)
    transport = _enter(buf, slot, "reply")
    transport.reply(rows, token_rows, token_index, num_tokens)
    _leave(buf, slot, "reply")
    _bump(state, _SEND_CALLS)
    return torch.empty(0, dtype=torch.int32, device=rows.device)


@reply.register_fake
def _(state, rows, token_rows, token_index, num_tokens, group_name, buffer_id, slot):
    registry.lookup(group_name, buffer_id).config.check_slot(slot)
    return rows.new_empty((0,), dtype=torch.int32)


# ---- wrappers -----------------------------------------------------------------------------
class Receipt(NamedTuple):
    """What ``worker_reply`` needs to send each token's reply back.

    token_rows [A, bucket, R] int32: rows (indices into Received.x) of inbox slot (a, s), -1
    for none; token_index [A, bucket] int32: source token index of slot (a, s); num_tokens [A]
    int32: tokens received from Attention index a; sequence: the buffer's receive count on
    this micro-batch slot when it was made; bucket; buffer_key: (group_name, buffer_id);
    slot: the micro-batch slot of the exchange.
    """

    token_rows: torch.Tensor
    token_index: torch.Tensor
    num_tokens: torch.Tensor
    sequence: int
    bucket: int
    buffer_key: Tuple[str, int]
    slot: int = 0


class Received(NamedTuple):
    """An FFN rank's inputs for one exchange (static, capacity-sized; see docs/contract.md).

    x [A*bucket*R, H] payload dtype, grouped by local expert; x_scales [A*bucket*R, H/128]
    float32 (FP8) or None (BF16); weights [A*bucket*R] float32; expert_offsets [E_local+1]
    int32 (rows of local expert e: x[expert_offsets[e]:expert_offsets[e+1]]);
    src_rank / src_token [A*bucket*R] int32: source group rank and token of each row;
    receipt: pass to worker_reply (it records the slot).
    """

    x: torch.Tensor
    x_scales: Optional[torch.Tensor]
    weights: torch.Tensor
    expert_offsets: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    receipt: Receipt


def _group_name(group) -> str:
    if isinstance(group, str):
        return group
    if group is None:
        import torch.distributed as dist

        group = dist.group.WORLD
    return group.group_name


def afd_dispatch(x, expert_ids, weights, *, group=None, bucket: int, x_scales=None,
                 buffer_id: Optional[int] = None, slot: int = 0) -> torch.Tensor:
    """Attention: validated ``torch.ops.afdep.dispatch`` on micro-batch ``slot``; returns
    route [T] int64 (pass it to ``afd_combine`` with the same slot)."""
    buf = registry.resolve(_group_name(group), buffer_id)
    buf._require_role("attention", "afd_dispatch")
    buf.config.check_slot(slot)
    buf._check_dispatch_args(x, expert_ids, weights, x_scales, bucket)
    return torch.ops.afdep.dispatch(buf.state, x, expert_ids, weights, x_scales,
                                    buf.group_name, buf.buffer_id, bucket, slot)


def afd_combine(route, *, group=None, buffer_id: Optional[int] = None, slot: int = 0
                ) -> torch.Tensor:
    """Attention: ``torch.ops.afdep.combine`` on micro-batch ``slot``; returns out [T, H]
    bfloat16."""
    buf = registry.resolve(_group_name(group), buffer_id)
    buf._require_role("attention", "afd_combine")
    buf.config.check_slot(slot)
    buf._check_route(route)
    return torch.ops.afdep.combine(buf.state, route, buf.group_name, buf.buffer_id, slot)


def afd_receive(*, group=None, bucket: int, buffer_id: Optional[int] = None,
                sequence: int = 0, slot: int = 0) -> Received:
    """FFN: ``torch.ops.afdep.receive`` on micro-batch ``slot``, packaged as a ``Received``
    (its receipt records the slot)."""
    buf = registry.resolve(_group_name(group), buffer_id)
    buf._require_role("ffn", "afd_receive")
    buf.config.check_slot(slot)
    buf.config.check_bucket(bucket)
    outs = torch.ops.afdep.receive(buf.state, buf.group_name, buf.buffer_id, bucket, slot)
    return _package(buf, bucket, outs, sequence, slot)


def _package(buf, bucket: int, outs, sequence: int, slot: int = 0) -> Received:
    x, x_scales, weights, offsets, src_rank, src_token, token_rows, token_index, num = outs
    receipt = Receipt(token_rows, token_index, num, sequence, bucket,
                      (buf.group_name, buf.buffer_id), slot)
    return Received(x, x_scales if buf.config.scale_cols else None, weights, offsets,
                    src_rank, src_token, receipt)


def _receipt_slot(receipt: Receipt, slot: Optional[int]) -> int:
    """The slot a reply goes to: the receipt's; an explicit ``slot`` must agree with it."""
    if slot is not None and slot != receipt.slot:
        raise AfdepStateError(f"receipt is from slot {receipt.slot}, not slot {slot}: reply "
                              f"on the slot the rows were received on")
    return receipt.slot


def afd_reply(rows, receipt: Receipt, *, group=None, buffer_id: Optional[int] = None,
              slot: Optional[int] = None) -> torch.Tensor:
    """FFN: ``torch.ops.afdep.reply`` for the rows of ``receipt``'s exchange, on the receipt's
    slot (``slot``, when given, must match it); returns the op's empty dependency token."""
    buf = registry.resolve(_group_name(group), buffer_id)
    buf._require_role("ffn", "afd_reply")
    buf._check_reply_args(rows, receipt)
    slot = _receipt_slot(receipt, slot)
    return torch.ops.afdep.reply(buf.state, rows, receipt.token_rows, receipt.token_index,
                                 receipt.num_tokens, buf.group_name, buf.buffer_id, slot)
