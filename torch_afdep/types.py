"""What the FFN side's receive returns and its reply takes back (plain NamedTuples, so they
pass through ``torch.compile`` and CUDA graphs unchanged)."""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch


class Receipt(NamedTuple):
    """What ``worker_reply`` / ``afd_reply`` need to send each token's reply back.

    Attributes:
        token_rows: [A, bucket, R] int32, rows (indices into ``Received.x``) of inbox slot
            (a, s), -1 for none.
        token_index: [A, bucket] int32, source token index of inbox slot (a, s).
        num_tokens: [A] int32, tokens received from Attention index a.
        sequence: the buffer's receive count on this micro-batch slot when it was made
            (``worker_reply`` refuses a receipt of an earlier exchange); ``afd_receive``
            stamps the ``sequence`` it is given.
        bucket: the bucket of the exchange.
        buffer_key: (group_name, buffer_id) of the buffer that made it.
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
    """An FFN rank's inputs for one exchange (static, capacity-sized; docs/contract.md).

    Attributes:
        x: [A*bucket*R, H] payload dtype, rows grouped by local expert.
        x_scales: [A*bucket*R, H/128] float32 (FP8) or None (BF16).
        weights: [A*bucket*R] float32, the routing weight of each row.
        expert_offsets: [E_local+1] int32; rows of local expert e are
            ``x[expert_offsets[e]:expert_offsets[e+1]]``.
        src_rank: [A*bucket*R] int32, source group rank of each row.
        src_token: [A*bucket*R] int32, source token index of each row.
        receipt: pass it to ``worker_reply`` (it records the slot).
    """

    x: torch.Tensor
    x_scales: Optional[torch.Tensor]
    weights: torch.Tensor
    expert_offsets: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    receipt: Receipt


class TokenReceipt(NamedTuple):
    """What ``worker_reply`` / ``afd_reply`` need to send the token layout's rows back.

    Attributes:
        src_token: [N] int32, the source token index of each row (-1: no token).
        num_tokens: [A] int32, tokens received from Attention index a.
        sequence, bucket, buffer_key, slot: as in ``Receipt``.
    """

    src_token: torch.Tensor
    num_tokens: torch.Tensor
    sequence: int
    bucket: int
    buffer_key: Tuple[str, int]
    slot: int = 0


class TokenReceived(NamedTuple):
    """An FFN rank's inputs for one exchange in the token layout
    (``Config(receive_layout="tokens")``): one row per token that reached this rank
    (deduplicated), N = ``Config.token_rows(bucket)`` rows, static.

    Attributes:
        x: [N, H] payload dtype, a view of the receive window (no copy): valid until the
            reply of this slot; read it, never write it.
        x_scales: [N, H/128] float32 view (FP8) or None (BF16).
        expert_ids: [N, k] int32, the token's ids in the source's column order, as local ids
            in [0, E_local) for experts on this rank and -1 for every other column (ids of
            other ranks, -1 ids, repeats after the first occurrence). Rows that hold no token
            have every id -1 (and unspecified payload).
        weights: [N, k] float32, the source's routing weight of each column with a local id,
            0 elsewhere.
        src_rank: [N] int32, source group rank of each row (-1: no token).
        src_token: [N] int32, source token index of each row (-1: no token).
        num_tokens: [A] int32, tokens received from each Attention index.
        receipt: pass it to ``worker_reply`` with rows [N, H] bfloat16.
    """

    x: torch.Tensor
    x_scales: Optional[torch.Tensor]
    expert_ids: torch.Tensor
    weights: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    num_tokens: torch.Tensor
    receipt: TokenReceipt


__all__ = ["Receipt", "Received", "TokenReceipt", "TokenReceived"]
