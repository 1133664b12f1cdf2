"""torch_afdep: Attention-FFN disaggregated MoE communication for PyTorch.

Role API: ``Buffer(group, Config(...))`` with ``source_dispatch`` / ``source_collect`` on
Attention ranks and ``worker_receive`` / ``worker_reply`` on FFN ranks. Ops:
``torch.ops.afdep.{dispatch, combine, receive, reply}`` with wrappers ``afd_*``. The c10d
backend ``"afdep"`` is registered on import. Contract: docs/contract.md.
"""

from .config import ATTENTION, FFN, Config, parse_roles
from .errors import AfdepError, AfdepRouteError, AfdepStateError, AfdepTimeoutError
from .ops import Receipt, Received, afd_combine, afd_dispatch, afd_receive, afd_reply
from .buffer import Buffer

__version__ = "0.1.0"

__all__ = [
    "ATTENTION", "FFN", "Config", "parse_roles", "Buffer", "Received", "Receipt",
    "afd_dispatch", "afd_combine", "afd_receive", "afd_reply",
    "AfdepError", "AfdepRouteError", "AfdepStateError", "AfdepTimeoutError",
]

# Register the "afdep" c10d backend (idempotent); fails loudly when torch_afdep._C was built
# against another torch.
from .distributed import backend as _backend  # noqa: E402

_backend.register_backend()
