"""The transport interface: what one micro-batch slot of a buffer does on its device.

``Transport`` is implemented by ``cpu.CpuTransport`` (gloo point-to-point messages) and
``cuda.CudaTransport`` (CUDA IPC / NCCL peer memory and the phase kernels);
``make_transport`` picks one by device. Transports know nothing of the role API or of
torch.distributed beyond the CPU group they are given: the caller (``torch_afdep.slots``)
checks the state machine and the arguments before any method here runs.

Every method runs on the current stream (CUDA) and, for outputs, writes into tensors the
caller allocated with the shapes of docs/contract.md.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch

from ..config import Config


@runtime_checkable
class Transport(Protocol):
    """One slot's exchange endpoint (collective to create and to close)."""

    #: Peer-visible memory this slot registered, and what the union layout would (0 on CPU).
    registered_bytes: int
    union_bytes: int

    # ---- Attention ------------------------------------------------------------------------
    def dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                 x_scales: Optional[torch.Tensor], bucket: int, route: torch.Tensor) -> None:
        """Send x [T, H] (+ x_scales [T, H/128] float32), expert_ids [T, k] int32/int64 and
        weights [T, k] float32 to the FFN ranks; write route [T] int64 (bit f: reached f)."""

    def combine(self, route: torch.Tensor, out: torch.Tensor) -> None:
        """Wait for the replies of route [T] int64 and write their fp32 sum to out [T, H]
        bfloat16."""

    def combine_view(self, route: torch.Tensor) -> torch.Tensor:
        """One FFN rank: like ``combine``, returning [T, H] bfloat16 rows of the transport's
        own receive memory (valid until the slot's next dispatch)."""

    # ---- FFN ------------------------------------------------------------------------------
    def receive(self, bucket: int, x: torch.Tensor, x_scales: torch.Tensor,
                weights: torch.Tensor, expert_offsets: torch.Tensor, src_rank: torch.Tensor,
                src_token: torch.Tensor, token_rows: torch.Tensor, token_index: torch.Tensor,
                num_tokens: torch.Tensor) -> None:
        """Wait for every Attention rank's tokens and write the expert-major outputs (shapes:
        ``ops.receive``)."""

    def reply(self, rows: torch.Tensor, token_rows: torch.Tensor, token_index: torch.Tensor,
              num_tokens: torch.Tensor) -> None:
        """Sum each token's rows [A*bucket*R, H] bfloat16 in fp32 and send one row back."""

    def receive_tokens(self, bucket: int, expert_ids: torch.Tensor, weights: torch.Tensor,
                       src_rank: torch.Tensor, src_token: torch.Tensor,
                       num_tokens: torch.Tensor):
        """Token layout: wait for every Attention rank's tokens, write the metadata outputs
        (shapes: ``ops.receive_tokens``) and return (x [N, H], x_scales [N, H/128 or 0])
        views of the receive window."""

    def reply_tokens(self, rows: torch.Tensor, src_token: torch.Tensor,
                     num_tokens: torch.Tensor) -> None:
        """Token layout: send row i of rows [N, H] bfloat16 back as its token's reply."""

    # ---- errors and lifecycle -------------------------------------------------------------
    def check_error(self, mid_exchange: bool = False) -> None:
        """Raise what the device reported since the last call (AfdepTimeoutError,
        AfdepRouteError); no synchronization. ``mid_exchange`` (the op that ends an exchange:
        combine, reply): timeouts only; route errors stay pending for the next op, so the
        exchange in which the kernels skipped an entry still completes on every rank."""

    def close(self, clean: bool = True) -> None:
        """Free everything; ``clean`` meets every peer first (bounded by timeout_s)."""


def make_transport(config: Config, rank: int, group, device: torch.device, buffer_id: int,
                   slot: int) -> Transport:
    """The transport of ``slot`` for ``device``: CUDA peer memory on a CUDA device, gloo
    messages on the CPU. Collective over ``group`` (a group that carries CPU tensors)."""
    if device.type == "cuda":
        from .cuda import CudaTransport

        return CudaTransport(config, rank, device, group, slot=slot)
    from .cpu import CpuTransport

    return CpuTransport(config, rank, group, buffer_id, slot)
