"""torch_afdep: Attention-FFN disaggregated MoE communication for PyTorch.

Role API: ``Buffer(group, Config(...))`` with ``source_dispatch`` / ``source_collect`` on
Attention ranks and ``worker_receive`` / ``worker_reply`` on FFN ranks. Ops:
``torch.ops.afdep.{dispatch, combine, receive, reply}`` (the token layout's FFN side:
``receive_tokens``, ``reply_tokens``) with wrappers ``afd_*``. The c10d
backend ``"afdep"`` is registered on import. Contract: docs/contract.md.
"""

from .config import ATTENTION, FFN, Config, parse_layout, parse_roles
from .errors import (AfdepBucketError, AfdepError, AfdepPeerLostError, AfdepRouteError,
                     AfdepStateError, AfdepTimeoutError)
from .types import Receipt, Received, TokenReceipt, TokenReceived
from .functional import afd_combine, afd_dispatch, afd_receive, afd_reply
from .buffer import Buffer

__version__ = "0.1.0"

__all__ = [
    "ATTENTION", "FFN", "Config", "parse_roles", "parse_layout", "Buffer", "Received", "Receipt",
    "TokenReceived", "TokenReceipt",
    "afd_dispatch", "afd_combine", "afd_receive", "afd_reply",
    "AfdepError", "AfdepRouteError", "AfdepStateError", "AfdepTimeoutError",
    "AfdepPeerLostError", "AfdepBucketError",
]


def _register_backend() -> None:
    """Register the "afdep" c10d backend (idempotent). When torch_afdep._C is missing or was
    built against another torch, the package still imports (the CPU contract and
    ``python -m torch_afdep doctor`` work) and the backend raises that ImportError when a
    process group asks for it."""
    try:
        from .distributed import backend
    except ImportError as err:
        import torch.distributed as dist

        reason = err

        def _unavailable(*_args, **_kwargs):
            raise ImportError(f"the 'afdep' c10d backend is unavailable: {reason}")

        if "AFDEP" not in getattr(dist.Backend, "_plugins", {}):
            dist.Backend.register_backend("afdep", _unavailable, extended_api=True,
                                          devices=["cpu", "cuda"])
        return
    backend.register_backend()


_register_backend()
