"""Open buffers by (group name, buffer id): how the ops, given a group name, find the buffer's
``slots.Slots`` (its transports and per-slot state)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

_BUFFERS: Dict[Tuple[str, int], object] = {}
_NEXT_ID: Dict[str, int] = {}
_ATTEMPTS: Dict[str, int] = {}


def next_id(group_name: str) -> int:
    """Ids count buffers created on a group; every rank creates them in the same order."""
    i = _NEXT_ID.get(group_name, 0)
    _NEXT_ID[group_name] = i + 1
    return i


def next_attempt(group_name: str) -> int:
    """Counts Buffer() calls on a group, failed ones included (every rank makes the same
    calls): names each construction's handshake keys in the store, so a failed attempt's keys
    are never read by the next one."""
    i = _ATTEMPTS.get(group_name, 0)
    _ATTEMPTS[group_name] = i + 1
    return i


def add(slots) -> None:
    _BUFFERS[(slots.group_name, slots.buffer_id)] = slots


def remove(slots) -> None:
    _BUFFERS.pop((slots.group_name, slots.buffer_id), None)


def lookup(group_name: str, buffer_id: int):
    try:
        return _BUFFERS[(group_name, buffer_id)]
    except KeyError:
        open_ids = sorted(i for g, i in _BUFFERS if g == group_name)
        raise RuntimeError(
            f"no open torch_afdep Buffer {buffer_id} on group {group_name!r} "
            f"(open buffer ids there: {open_ids}); create Buffer(group, config) first"
        ) from None


def resolve(group_name: str, buffer_id: Optional[int]):
    """The buffer ``buffer_id`` on the group, or its only open buffer when None."""
    if buffer_id is not None:
        if isinstance(buffer_id, bool) or not isinstance(buffer_id, int):
            raise TypeError(f"buffer_id must be an int (Buffer.buffer_id) or None, got "
                            f"{type(buffer_id).__name__}")
        return lookup(group_name, buffer_id)
    ids = [i for g, i in _BUFFERS if g == group_name]
    if len(ids) != 1:
        raise RuntimeError(
            f"group {group_name!r} has {len(ids)} open torch_afdep buffers; pass buffer_id "
            f"(one of {sorted(ids)})" if ids else
            f"no open torch_afdep Buffer on group {group_name!r}; create Buffer(group, config)"
        )
    return _BUFFERS[(group_name, ids[0])]
