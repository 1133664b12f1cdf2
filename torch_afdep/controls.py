"""The protocol controls (a view of :mod:`torch_afdep.env`, which holds every ``AFDEP_*``
variable): each control defaults to 1 (the role-aware change on) except the experimental
``AFDEP_RAW_META`` and ``AFDEP_FANOUT_EXPAND``; 0 reverts that one
change, and ``AFDEP_SYMMETRIC=1`` reverts all of them at once, so the same kernels run the
symmetric union protocol the benchmarks compare against. docs/protocol.md describes each. All
ranks of a group must agree (checked when a CUDA transport is created).
"""

from __future__ import annotations

from typing import Dict, Mapping, NamedTuple, Optional

from . import env as _env


class Control(NamedTuple):
    bit: int
    default: int
    description: str


#: name -> (bit in the mask passed to C++, default, what 0 reverts)
CONTROLS: Dict[str, Control] = {
    name: Control(s.bit, s.default, s.meaning) for name, s in _env.CONTROLS.items()}

SYMMETRIC = _env.SYMMETRIC
ALL_ROLE_AWARE = _env.ALL_ROLE_AWARE
DEFAULT = _env.DEFAULT_FLAGS
describe = _env.describe_flags


def flags(env: Optional[Mapping[str, str]] = None) -> int:
    """The control bit mask for ``env`` (default: os.environ)."""
    return _env.protocol_flags(env)


def is_symmetric(mask: int) -> bool:
    return mask == 0


def current() -> int:
    """The mask of this process's environment, parsed once."""
    return _env.current().flags
