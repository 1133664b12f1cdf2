"""Environment controls of the CUDA protocol: one registry, parsed once into a bit mask.

Every control but the experimental ``AFDEP_SIZED_GRID`` and ``AFDEP_PDL`` defaults to 1 (the
role-aware change is on); setting it to 0 reverts that one change, and ``AFDEP_SYMMETRIC=1``
reverts all of them at once, so the same kernels run the symmetric union protocol the
benchmarks compare against. docs/protocol.md describes each. All ranks of a group must agree
(checked when a CUDA transport is created).
"""

from __future__ import annotations

import os
from typing import Dict, Mapping, NamedTuple, Optional


class Control(NamedTuple):
    bit: int
    default: int
    description: str


#: name -> (bit in the mask passed to C++, default, what 0 reverts)
CONTROLS: Dict[str, Control] = {
    "AFDEP_ROLE_BUFFERS": Control(
        1 << 0, 1,
        "per-role inboxes: FFN ranks hold dispatch inboxes for A sources, Attention ranks "
        "combine inboxes for F sources; 0 = every rank registers the union-sized window"),
    "AFDEP_NO_ENTRY_BARRIER": Control(
        1 << 1, 1,
        "no entry barrier (sequence numbers guard reuse); 0 = full barrier among all ranks at "
        "the entry of both phases"),
    "AFDEP_ONE_WAY_COUNTS": Control(
        1 << 2, 1,
        "counts ride behind each sender CTA's payload, Attention -> FFN only; 0 = counts are "
        "exchanged all-to-all first and every rank spins until all arrive"),
    "AFDEP_RECEIVER_WAIT_ONLY": Control(
        1 << 3, 1,
        "only receivers wait, per sending CTA; 0 = full exit barrier among all ranks and "
        "channels in both phases"),
    "AFDEP_ROLE_WARPS": Control(
        1 << 4, 1,
        "each role runs only its own stage; 0 = every rank runs both stages (Attention ranks "
        "as dummy expert holders receiving nothing, FFN ranks as senders of nothing)"),
    "AFDEP_SINGLE_FFN": Control(
        1 << 5, 1,
        "with one FFN rank, combine copies the single reply row (no fp32 sum loop); 0 = the "
        "general sum"),
    "AFDEP_WIDE_LOCAL": Control(
        1 << 6, 1,
        "the kernels that mostly do local work (FFN receive and reply: expansion and fp32 "
        "reduction; Attention combine: collect) run Config.local_sms CTAs, default one per "
        "SM; needs the four directional controls above; 0 = num_sms CTAs like every other "
        "kernel"),
    "AFDEP_EARLY_COUNTS": Control(
        1 << 7, 1,
        "a sender CTA with few tokens (but >= 32 KB of payload) publishes its counts before "
        "copying the payload (the FFN computes its offsets while the payload is in flight) "
        "and then a per-channel payload flag; needs the four directional controls; 0 = counts "
        "after the payload"),
    "AFDEP_SIZED_GRID": Control(
        1 << 8, 0,
        "experimental, off by default (2 x H200: passes its tests, measured no gain): the "
        "wide local kernels run their wide grid only from 32 tokens (FFN: A x bucket, "
        "Attention: T) and num_sms CTAs below, and the FFN's last reply CTA stores the "
        "exchange number once per Attention rank instead of every CTA adding 1; needs "
        "AFDEP_WIDE_LOCAL and the four directional controls; 0 = fixed grids"),
    "AFDEP_STREAM_EXPANSION": Control(
        1 << 9, 1,
        "sender CTAs with >= 48 tokens (and >= 32 KB) publish their counts first, then send "
        "each row with its own flag, and the FFN expands every row as soon as it lands "
        "(slot-major), overlapping the expansion with the transfer at large T; needs "
        "AFDEP_EARLY_COUNTS and the four directional controls; 0 = one payload flag per "
        "channel, and large-T channels send counts last"),
    "AFDEP_PDL": Control(
        1 << 10, 0,
        "experimental, off by default until measured on a GPU: the dispatch and combine "
        "kernels launch with programmatic dependent launch, so each may be scheduled while "
        "the previous kernel of its stream drains and waits (griddepcontrol.wait) before "
        "touching anything, and the dispatch lets the next kernel's CTAs take idle SMs as soon "
        "as it starts; 0 = ordinary launches"),
}

#: Reverts every control above.
SYMMETRIC = "AFDEP_SYMMETRIC"

ALL_ROLE_AWARE = sum(c.bit for c in CONTROLS.values())

#: The mask of an environment that sets no control (experimental changes stay off).
DEFAULT = sum(c.bit for c in CONTROLS.values() if c.default)


def _parse_bool(name: str, value: str) -> int:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return 1
    if v in ("0", "false", "no", "off"):
        return 0
    raise ValueError(f"{name} must be 0 or 1, got {value!r}")


def flags(env: Optional[Mapping[str, str]] = None) -> int:
    """The control bit mask for ``env`` (default: os.environ)."""
    env = os.environ if env is None else env
    if SYMMETRIC in env and _parse_bool(SYMMETRIC, env[SYMMETRIC]):
        return 0
    mask = 0
    for name, c in CONTROLS.items():
        on = _parse_bool(name, env[name]) if name in env else c.default
        if on:
            mask |= c.bit
    return mask


def describe(mask: int) -> Dict[str, int]:
    """{control name: 0/1} for a mask."""
    return {name: int(bool(mask & c.bit)) for name, c in CONTROLS.items()}


def is_symmetric(mask: int) -> bool:
    return mask == 0


_CACHED: Optional[int] = None


def current() -> int:
    """The mask of this process's environment, parsed once."""
    global _CACHED
    if _CACHED is None:
        _CACHED = flags()
    return _CACHED
