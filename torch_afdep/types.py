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


__all__ = ["Receipt", "Received"]
