"""The one owner of an open buffer's exchange state: its transports (one per micro-batch
slot), the per-slot state machine, and the ordering token of the ops.

Each slot has a host-side phase: Attention ``idle -> dispatched -> idle``, FFN
``idle -> received -> idle``. ``begin(slot, op)`` checks that the phase allows ``op``, polls
that slot's device error block once and returns its transport; ``end(slot, op)`` advances the
phase after the op's work. The ops' real kernels call them (eagerly, inside a compiled graph,
and while a CUDA graph is captured; not on CUDA graph replays), and so does the role API's
zero-copy collect: an exchange that would reuse a slot before its previous one finished
raises ``AfdepStateError`` before any communication.

``Slots`` objects are found by ``(group_name, buffer_id)`` through ``torch_afdep.registry``,
which is how the ops, given only a group name, reach their state.
"""

from __future__ import annotations

import contextlib
from typing import List, Optional, Tuple

import torch

from .config import ATTENTION, FFN, Config
from .errors import AfdepStateError
from .transport.base import Transport

#: Entries of the ordering token (host-side call counters).
SEND_CALLS, RECV_CALLS = 0, 1

#: op -> (phase it needs, phase after it, counter it bumps)
TRANSITIONS = {
    "dispatch": ("idle", "dispatched", SEND_CALLS),
    "combine": ("dispatched", "idle", RECV_CALLS),
    "receive": ("idle", "received", RECV_CALLS),
    "reply": ("received", "idle", SEND_CALLS),
}

_OUT_OF_ORDER = {
    "dispatch": "slot {slot} still holds a dispatched exchange: combine it first "
                "(source_dispatch called twice without source_collect on slot {slot})",
    "combine": "no dispatch is open on slot {slot} (source_collect called without a "
               "preceding source_dispatch on slot {slot})",
    "receive": "slot {slot} still holds a received exchange: reply to it first "
               "(worker_receive called twice without worker_reply on slot {slot})",
    "reply": "no receive is open on slot {slot} (worker_reply called without a preceding "
             "worker_receive on slot {slot})",
}

_ROLE_OF_OP = {"dispatch": ATTENTION, "combine": ATTENTION, "receive": FFN, "reply": FFN}

_ORDER_CHECKS = True


@contextlib.contextmanager
def order_checks_off():
    """Testing only (torch.library.opcheck calls one op several times in a row): run the
    kernels without the per-slot phase checks."""
    global _ORDER_CHECKS
    old, _ORDER_CHECKS = _ORDER_CHECKS, False
    try:
        yield
    finally:
        _ORDER_CHECKS = old


def _differs(got: torch.Tensor, want: torch.Tensor) -> Optional[str]:
    """How a handle passed back to an op (a route, a receipt tensor) differs from the one the
    op's partner returned: ``"shape"``, ``"values"`` (compared on CPU only: on CUDA they stay
    on the device) or None."""
    if got is want:
        return None
    if tuple(got.shape) != tuple(want.shape):
        return "shape"
    if got.device.type == "cpu" and not torch.equal(got, want):
        return "values"
    return None


class Slots:
    """Exchange state of one open buffer on one rank.

    Attributes:
        config, rank, role, device, group_name, buffer_id: as the Buffer's.
        transports: one ``Transport`` per slot.
        state: [2] int64 CPU tensor, the ops' ordering token (declared mutated by every op,
            which orders one buffer's ops in a traced graph and keeps ``reply`` alive).
        closed: set by ``close``; broken: the failure that made the buffer unusable, or None.
    """

    def __init__(self, config: Config, rank: int, device: torch.device, group_name: str,
                 buffer_id: int, transports: List[Transport]):
        self.config = config
        self.rank = rank
        self.role = config.role_of(rank)
        self.device = device
        self.group_name = group_name
        self.buffer_id = buffer_id
        self.transports = transports
        self.state = torch.zeros(2, dtype=torch.int64)
        self.closed = False
        self.broken: Optional[BaseException] = None
        n = config.num_slots
        self._phase: List[str] = ["idle"] * n
        self._route: List[Optional[torch.Tensor]] = [None] * n
        # the receipt tensors each slot's open receive returned, as the reply must get them
        self._receipt: List[Optional[Tuple[Tuple[str, torch.Tensor], ...]]] = [None] * n
        self._sequence: List[int] = [0] * n

    @property
    def key(self):
        return (self.group_name, self.buffer_id)

    def check_usable(self, what: str) -> None:
        if self.closed:
            raise AfdepStateError(f"{what}: this Buffer is closed")
        if self.broken is not None:
            raise AfdepStateError(
                f"{what}: this Buffer is unusable after an earlier failure: {self.broken} "
                "(close it and create a new Buffer; docs/contract.md, Failures)")

    def require_role(self, role: str, what: str) -> None:
        self.check_usable(what)
        if self.role != role:
            other = {"attention": "source_dispatch/source_collect",
                     "ffn": "worker_receive/worker_reply"}[self.role]
            raise AfdepStateError(
                f"{what} is for {role} ranks; group rank {self.rank} is an {self.role} rank "
                f"(use {other})")

    # ---- the state machine ----------------------------------------------------------------
    def phase(self, slot: int) -> str:
        return self._phase[self.config.check_slot(slot)]

    def begin(self, slot: int, op: str) -> Transport:
        """The transport of ``slot`` once this rank's role runs ``op`` and the slot's phase
        allows it; raises the slot's pending device error first (one poll)."""
        self.require_role(_ROLE_OF_OP[op], f"afdep::{op}")
        transport = self.transports[self.config.check_slot(slot)]
        # an op that ends an exchange raises only timeouts: a route error the kernels saw
        # in this exchange is raised by the slot's next dispatch / receive, once every rank
        # has finished the exchange (raising here would leave the peers waiting)
        transport.check_error(mid_exchange=op in ("combine", "reply"))
        self.expect(slot, op)
        return transport

    def expect(self, slot: int, op: str) -> None:
        """AfdepStateError unless ``slot``'s phase allows ``op`` (ValueError for a slot out of
        range)."""
        self.config.check_slot(slot)
        if _ORDER_CHECKS and self._phase[slot] != TRANSITIONS[op][0]:
            raise AfdepStateError(
                f"afdep::{op}: " + _OUT_OF_ORDER[op].format(slot=slot) + "; each slot holds "
                "one exchange at a time: use another slot for the next micro-batch")

    def end(self, slot: int, op: str, state: torch.Tensor,
            route: Optional[torch.Tensor] = None,
            receipt: Optional[Tuple[Tuple[str, torch.Tensor], ...]] = None) -> None:
        """Advance ``slot`` past ``op`` and bump the op's counter in ``state`` (the ordering
        token the op was given: under torch.compile it may be a functionalized copy of
        ``self.state``); a dispatch records its route for the collect, a receive its receipt
        tensors ((name, tensor) pairs) for the reply."""
        _, after, counter = TRANSITIONS[op]
        self._phase[slot] = after
        if op == "dispatch":
            self._route[slot] = route
        elif op == "combine":
            self._route[slot] = None
        elif op == "receive":
            self._sequence[slot] += 1
            self._receipt[slot] = receipt
        else:
            self._receipt[slot] = None
        state[counter] += 1

    def check_route(self, slot: int, route: torch.Tensor) -> None:
        """ValueError unless ``route`` is the route the dispatch open on ``slot`` returned:
        its shape on every device, and on CPU its values (the CPU transport sizes its
        receives from them: a foreign route would break the exchange, not just the sums).
        On CUDA the values stay on the device; a route of the right shape is trusted."""
        want = self._route[slot]
        bad = _ORDER_CHECKS and want is not None and _differs(route, want)
        if bad == "shape":
            raise ValueError(f"route must be the [T] int64 route afd_dispatch returned on "
                             f"slot {slot} (T = {want.shape[0]}), got shape "
                             f"{tuple(route.shape)}")
        if bad == "values":
            raise ValueError(f"route differs from the route afd_dispatch returned on slot "
                             f"{slot}: pass that route, unchanged")

    def check_receipt(self, slot: int, tensors: Tuple[Tuple[str, torch.Tensor], ...]) -> None:
        """The reply's receipt tensors against those the receive open on ``slot`` returned:
        their shapes on every device (ValueError: another bucket), and on CPU their values
        (AfdepStateError: a receipt of an earlier exchange, which would send rows the
        Attention ranks do not expect). On CUDA a receipt of the right shapes is trusted."""
        want = self._receipt[slot]
        for (name, got), (_, exp) in zip(tensors, want if _ORDER_CHECKS and want else ()):
            bad = _differs(got, exp)
            if bad == "shape":
                raise ValueError(f"{name} must have the shape the receive on slot {slot} gave, "
                                 f"{tuple(exp.shape)}, got {tuple(got.shape)}: reply with "
                                 f"that receive's receipt")
            if bad == "values":
                raise AfdepStateError(
                    f"{name} differs from the receipt of the receive open on slot {slot} "
                    f"(a receipt of an earlier exchange?): reply with that receive's receipt")

    def open_route(self, slot: int) -> torch.Tensor:
        """The route of the dispatch open on ``slot`` (AfdepStateError when none is)."""
        route = self._route[self.config.check_slot(slot)]
        if self._phase[slot] != "dispatched" or route is None:
            raise AfdepStateError("source_collect: " + _OUT_OF_ORDER["combine"].format(
                slot=slot))
        return route

    def sequence(self, slot: int) -> int:
        """Receives completed on ``slot`` (the ``Receipt.sequence`` of the latest)."""
        return self._sequence[slot]

    def exchange_open(self) -> bool:
        return any(p != "idle" for p in self._phase)

    def check_errors(self) -> None:
        """Raise any slot's pending device error (lifecycle checks, not the hot path)."""
        for t in self.transports:
            t.check_error()
