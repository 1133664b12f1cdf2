"""Alias of :mod:`torch_afdep.transport.cuda` (the CUDA transport's old home)."""

from .transport.cuda import *  # noqa: F401,F403
from .transport.cuda import TRANSPORTS, CudaTransport, transport_kind  # noqa: F401
