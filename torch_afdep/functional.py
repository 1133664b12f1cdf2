"""The functional form of the exchange: validated calls of ``torch.ops.afdep.*`` that keep no
Python state of their own, so they trace under ``torch.compile(fullgraph=True)`` and capture
in CUDA graphs. They need an open ``Buffer`` on the group (created eagerly, before any
compiled region); ``group`` may be a ProcessGroup, its ``group_name``, or None (the default
group), and ``buffer_id`` picks among several open buffers of one group.

Attention ranks call ``afd_dispatch`` then ``afd_combine``; FFN ranks ``afd_receive`` then
``afd_reply``, each on the same micro-batch ``slot``. The ops check roles, order and
arguments when they run (before anything is sent), so errors keep their real types inside
compiled code too.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import ops  # noqa: F401  (registers torch.ops.afdep.*)
from . import registry, validate
from .config import FFN
from .types import Receipt, Received, TokenReceipt, TokenReceived


def _group_name(group) -> str:
    if isinstance(group, str):
        return group
    import torch.distributed as dist

    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup, its group_name or None (the default "
                        f"group), got {type(group).__name__}")
    return group.group_name


def _slots(group, buffer_id):
    return registry.resolve(_group_name(group), buffer_id)


def afd_dispatch(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, *,
                 group=None, bucket: int, x_scales: Optional[torch.Tensor] = None,
                 buffer_id: Optional[int] = None, slot: int = 0) -> torch.Tensor:
    """Attention: send this rank's tokens to the FFN ranks that hold their experts.

    Arguments:
        x: [T, H] ``config.dtype`` (bfloat16, or float8_e4m3fn pre-quantized per 128).
        expert_ids: [T, top_k] int32 or int64 global expert ids in [0, E), or -1.
        weights: [T, top_k] float32 routing weights (applied by the FFN-side caller).
        bucket: static token bucket, T <= bucket <= capacity; the same on every rank.
        x_scales: [T, H/128] float32, FP8 only.
        slot: micro-batch slot in [0, num_slots).
    Returns:
        route: [T] int64 (bit f: the token reached FFN index f); pass it to ``afd_combine``
        on the same slot.
    """
    slots = _slots(group, buffer_id)
    validate.python_types(slots.device, ints=(("bucket", bucket), ("slot", slot)),
                          tensors=(("x", x), ("expert_ids", expert_ids), ("weights", weights)),
                          optional_tensors=(("x_scales", x_scales),))
    return torch.ops.afdep.dispatch(slots.state, x, expert_ids, weights, x_scales,
                                    slots.group_name, slots.buffer_id, bucket, slot,
                                    validate.check_values_eagerly(slots.device))


def afd_combine(route: torch.Tensor, *, group=None, buffer_id: Optional[int] = None,
                slot: int = 0) -> torch.Tensor:
    """Attention: receive and sum the FFN ranks' replies of ``slot``.

    Arguments:
        route: [T] int64 from ``afd_dispatch`` on the same slot.
    Returns:
        out: [T, H] bfloat16, the fp32 sum of every FFN rank's reply row of each token
        (zero for tokens without a valid expert).
    """
    slots = _slots(group, buffer_id)
    validate.python_types(slots.device, ints=(("slot", slot),), tensors=(("route", route),))
    return torch.ops.afdep.combine(slots.state, route, slots.group_name, slots.buffer_id,
                                   slot)


def package(slots, bucket: int, outs, sequence: int, slot: int) -> Received:
    """The nine outputs of ``afdep::receive`` as a ``Received`` with its ``Receipt``."""
    x, x_scales, weights, offsets, src_rank, src_token, token_rows, token_index, num = outs
    receipt = Receipt(token_rows, token_index, num, sequence, bucket, slots.key, slot)
    return Received(x, x_scales if slots.config.scale_cols else None, weights, offsets,
                    src_rank, src_token, receipt)


def package_tokens(slots, bucket: int, outs, sequence: int, slot: int) -> TokenReceived:
    """The seven outputs of ``afdep::receive_tokens`` as a ``TokenReceived``."""
    x, x_scales, ids, w, src_rank, src_token, num = outs
    receipt = TokenReceipt(src_token, num, sequence, bucket, slots.key, slot)
    return TokenReceived(x, x_scales if slots.config.scale_cols else None, ids, w, src_rank,
                         src_token, num, receipt)


def receive(slots, bucket: int, slot: int, sequence: int):
    """The receive op of the buffer's layout, packaged (both APIs call this)."""
    if slots.config.receive_layout == "tokens":
        outs = torch.ops.afdep.receive_tokens(slots.state, slots.group_name, slots.buffer_id,
                                              bucket, slot)
        return package_tokens(slots, bucket, outs, sequence, slot)
    outs = torch.ops.afdep.receive(slots.state, slots.group_name, slots.buffer_id, bucket,
                                   slot)
    return package(slots, bucket, outs, sequence, slot)


def reply(slots, rows, receipt, slot: int) -> torch.Tensor:
    """The reply op of the buffer's layout (both APIs call this)."""
    if slots.config.receive_layout == "tokens":
        return torch.ops.afdep.reply_tokens(slots.state, rows, receipt.src_token,
                                            receipt.num_tokens, slots.group_name,
                                            slots.buffer_id, slot)
    return torch.ops.afdep.reply(slots.state, rows, receipt.token_rows, receipt.token_index,
                                 receipt.num_tokens, slots.group_name, slots.buffer_id, slot)


def afd_receive(*, group=None, bucket: int, buffer_id: Optional[int] = None,
                sequence: int = 0, slot: int = 0):
    """FFN: receive every Attention rank's tokens of ``slot``, expanded expert-major.

    Arguments:
        bucket: the bucket every Attention rank dispatched with.
        sequence: stamped into the receipt as ``Receipt.sequence`` (the role API stamps its
            receive count there and refuses stale receipts; the functional form keeps no
            count, so the caller may pass its own step number or leave 0).
        slot: micro-batch slot.
    Returns:
        a ``Received`` (expert layout) or a ``TokenReceived`` (token layout; shapes in
        ``torch_afdep.types``); its ``receipt`` goes to ``afd_reply``.
    """
    slots = _slots(group, buffer_id)
    validate.python_types(slots.device, ints=(("bucket", bucket), ("slot", slot)))
    return receive(slots, bucket, slot, sequence)


def afd_reply(rows: torch.Tensor, receipt: Receipt, *, group=None,
              buffer_id: Optional[int] = None, slot: Optional[int] = None) -> torch.Tensor:
    """FFN: send each token's expert outputs back, one fp32-summed BF16 row per token.

    Arguments:
        rows: expert layout: [A*bucket*R, H] bfloat16, row i the expert output of
            ``Received.x[i]`` already multiplied by ``Received.weights[i]`` (rows past
            ``expert_offsets[-1]`` are ignored); token layout: [N, H] bfloat16, row i the
            weighted sum of token i's local expert outputs (rows without a token ignored).
        receipt: the receipt of the exchange; ``slot``, when given, must be its slot.
    Returns:
        an empty [0] int32 dependency token.
    """
    slots = _slots(group, buffer_id)
    slots.require_role(FFN, "afd_reply")
    slot = validate.receipt(slots.config, slots.key, receipt, slot, rows)
    validate.python_types(slots.device, tensors=(("rows", rows),))
    return reply(slots, rows, receipt, slot)


__all__ = ["afd_dispatch", "afd_combine", "afd_receive", "afd_reply"]
