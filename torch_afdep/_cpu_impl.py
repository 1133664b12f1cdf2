"""Alias of :mod:`torch_afdep.transport.cpu` (the CPU transport's old home)."""

from .transport.cpu import *  # noqa: F401,F403
from .transport.cpu import CpuTransport, local_routes, tag_base  # noqa: F401
