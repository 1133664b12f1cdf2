"""``Buffer``: the role API an engine uses to drive AFD exchanges directly."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import ops  # noqa: F401  (registers torch.ops.afdep.*)
from . import registry, validate
from .config import ATTENTION, FFN, Config
from .errors import AfdepError, AfdepStateError, AfdepTimeoutError
from .functional import receive, reply
from .slots import Slots
from .transport import make_transport
from .types import Receipt, TokenReceipt


#: What a rank that failed its own checks in ``Buffer()`` publishes for its peers.
_FAILED = "torch_afdep: this rank's Buffer() failed"


class Buffer:
    """One rank's end of AFD exchanges on ``group`` (collective to create and to close).

    Arguments:
        group: a process group whose size is ``config.attention_ranks + config.ffn_ranks``
            and which carries CPU tensors (gloo, ``"afdep"``, ``"cpu:gloo,cuda:afdep"``,
            ``"cpu:gloo,cuda:nccl"``). None means the default group.
        config: the same ``Config`` on every rank (checked).
        device: where tensors live and which implementation runs: ``"cpu"`` (gloo messages)
            or a CUDA device (NVLink peer memory). Default: the current CUDA device when
            CUDA and the CUDA extension are available, else CPU.

    Attention ranks call ``source_dispatch`` then ``source_collect``; FFN ranks call
    ``worker_receive`` then ``worker_reply``. ``config.num_slots`` exchanges (micro-batches)
    may be in flight at once, one per slot, selected with ``slot=`` (default 0); each slot
    has its own transport (own gloo tags on CPU, own registered windows and device counters
    on CUDA), so slots never overwrite each other, and reusing a slot before its exchange
    finished raises ``AfdepStateError``.
    """

    def __init__(self, group=None, config: Optional[Config] = None, device=None):
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call "
                               "dist.init_process_group(...) before creating a Buffer")
        self.group = dist.group.WORLD if group is None else group
        if not isinstance(self.group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup or None (the "
                            f"default group), got {type(group).__name__}")
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError("this process is not a member of group: create the Buffer on a "
                             "group that holds this rank")
        self.group_name = self.group.group_name
        # Counted before any check that one rank alone may fail, so every rank's attempt
        # numbers stay in step; that rank tells the others (they raise at once, not after
        # timeout_s).
        attempt = registry.next_attempt(self.group_name)
        try:
            if not isinstance(config, Config):
                raise TypeError(
                    f"config must be a torch_afdep.Config, got {type(config).__name__}")
            self.config = config
            self.device = self._pick_device(device)
        except (TypeError, ValueError) as e:
            self._publish(attempt, (_FAILED, f"{type(e).__name__}: {e}"))
            raise
        # The first op call imports torch._dynamo (seconds); do it before any peer waits.
        import torch._dynamo  # noqa: F401

        # Collective first, so every rank raises the same error on any mismatch.
        self._check_same_config_everywhere(attempt)
        size = dist.get_world_size(self.group)
        if size != config.world_size:
            raise ValueError(
                f"group has {size} ranks but config needs attention_ranks + ffn_ranks = "
                f"{config.attention_ranks} + {config.ffn_ranks} = {config.world_size}")
        self.role = config.role_of(self.rank)
        self.role_index = config.role_index(self.rank)
        self.buffer_id = registry.next_id(self.group_name)
        transports: list = []
        try:
            for slot in range(config.num_slots):
                transports.append(make_transport(config, self.rank, self.group, self.device,
                                                 self.buffer_id, slot))
        except BaseException:
            for t in transports:
                try:
                    t.close(clean=False)
                except Exception:
                    pass
            raise
        #: The exchange state the ops run on (transports, per-slot phases, ordering token).
        self._slots = Slots(config, self.rank, self.device, self.group_name, self.buffer_id,
                            transports)
        registry.add(self._slots)

    # ---- read-only views -------------------------------------------------------------------
    @property
    def state(self) -> torch.Tensor:
        """[2] int64 CPU tensor: the ops' ordering token (see ``torch_afdep.ops``)."""
        return self._slots.state

    @property
    def transports(self) -> list:
        """One ``Transport`` per micro-batch slot."""
        return self._slots.transports

    @property
    def transport(self):
        """The transport of slot 0 (``transports[slot]`` for the others)."""
        return self._slots.transports[0]

    @property
    def num_slots(self) -> int:
        return self.config.num_slots

    @property
    def registered_bytes(self) -> int:
        """Registered (peer-visible) memory of this rank, summed over slots (0 on CPU)."""
        return sum(int(t.registered_bytes) for t in self.transports)

    @property
    def union_bytes(self) -> int:
        """What the union layout would register, summed over slots (0 on CPU)."""
        return sum(int(t.union_bytes) for t in self.transports)

    def phase(self, slot: int = 0) -> str:
        """The host-side phase of ``slot``: ``"idle"``, ``"dispatched"`` (Attention, between
        dispatch and collect) or ``"received"`` (FFN, between receive and reply)."""
        return self._slots.phase(validate.check_int("slot", slot))

    # ---- construction helpers -----------------------------------------------------------
    def _pick_device(self, device) -> torch.device:
        if device is None:
            if torch.cuda.is_available() and _cuda_extension_available():
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device("cpu")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError, ValueError):
            raise ValueError(f"device must be 'cpu' or a CUDA device ('cuda', 'cuda:1', a "
                             f"torch.device), got {device!r}") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or a CUDA device, got {device}")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device={str(device)!r} but CUDA is not available here "
                                 "(no GPU or a CPU-only torch): use device='cpu'")
            if not _cuda_extension_available():
                raise ValueError(f"device={str(device)!r} but torch_afdep._cuda was not built "
                                 "(no nvcc at install time): rebuild with nvcc on PATH, or "
                                 "use device='cpu'")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            elif not 0 <= device.index < torch.cuda.device_count():
                raise ValueError(f"device index must be in [0, {torch.cuda.device_count()}),"
                                 f" got {device.index}")
        return device

    def _check_same_config_everywhere(self, attempt: int) -> None:
        """Every rank raises the same error when configs or roles differ across ranks; a
        rank that never creates its Buffer gives an error after ``timeout_s`` naming it."""
        mine = (self.config.fingerprint(), self.device.type, _backend_roles(self.group))
        all_ = self._gather_bounded(mine, attempt)
        for r, other in enumerate(all_):
            if other[0] == _FAILED:
                raise ValueError(f"group rank {r} could not create its Buffer: {other[1]}")
        names = ("capacity_tokens_per_rank", "hidden_size", "num_experts", "top_k",
                 "ffn_ranks", "attention_ranks", "dtype", "roles", "num_sms", "num_slots",
                 "local_sms", "receive_layout")
        for r, other in enumerate(all_):
            if other[0] != all_[0][0]:
                diffs = [f"{n}: {a!r} on rank 0 vs {b!r} on rank {r}"
                         for n, a, b in zip(names, all_[0][0], other[0]) if a != b]
                raise ValueError("torch_afdep Config differs across ranks: " + "; ".join(diffs))
            if other[1] != all_[0][1]:
                raise ValueError(f"Buffer device type differs across ranks: {all_[0][1]!r} on "
                                 f"rank 0 vs {other[1]!r} on rank {r}")
        backend_roles = all_[0][2]
        if backend_roles is not None and tuple(backend_roles) != self.config.role_list:
            raise ValueError(
                f"config roles {list(self.config.role_list)} differ from the roles the afdep "
                f"backend was given for this group {list(backend_roles)}")

    def _publish(self, attempt: int, mine) -> str:
        """Put this rank's ``mine`` (picklable) under construction ``attempt``'s key in the
        c10d store; returns the attempt's key prefix (the rank number follows it)."""
        import pickle

        store = dist.distributed_c10d._get_default_store()
        prefix = f"torch_afdep/{self.group_name}/attempt{attempt}/rank"
        store.set(prefix + str(self.rank), pickle.dumps(mine))
        return prefix

    def _gather_bounded(self, mine, attempt: int) -> list:
        """Every group rank's ``mine`` (picklable), through the c10d store rather than a
        collective: bounded by ``timeout_s`` (a collective would wait for the process group's
        own timeout), it names the ranks that did not arrive, and it leaves no collective
        work behind when construction fails."""
        import pickle
        import time

        store = dist.distributed_c10d._get_default_store()
        size = dist.get_world_size(self.group)
        prefix = self._publish(attempt, mine)
        keys = [prefix + str(r) for r in range(size)]
        deadline = time.monotonic() + float(self.config.timeout_s)
        pause = 0.001
        while True:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            if not missing:
                break
            if time.monotonic() > deadline:
                raise AfdepTimeoutError(
                    f"rank {self.rank}: Buffer() waited more than {self.config.timeout_s} s for "
                    f"group ranks {missing} to create their Buffer (creating a Buffer is "
                    f"collective: every rank of the group must call it)",
                    peer=missing[0], phase="construct", rank=self.rank)
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        return [pickle.loads(store.get(k)) for k in keys]

    def _run(self, fn, *args):
        """Run an op; a failure inside the transport (timeout, lost peer) makes the buffer
        unusable rather than leaving a half-done exchange to confuse the next one. Argument,
        order and route errors are raised before anything is sent: the buffer stays usable."""
        try:
            return fn(*args)
        except (ValueError, TypeError, AfdepStateError):
            raise
        except BaseException as e:
            self._slots.broken = e
            raise

    # ---- Attention ranks ------------------------------------------------------------------
    def source_dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor,
                        weights: torch.Tensor, bucket: int,
                        x_scales: Optional[torch.Tensor] = None, *, slot: int = 0) -> None:
        """Send this rank's tokens to the FFN ranks that hold their experts.

        Arguments:
            x: [T, H] ``config.dtype`` (bfloat16, or pre-quantized float8_e4m3fn).
            expert_ids: [T, top_k] int32 or int64, global expert ids in [0, E) or -1.
            weights: [T, top_k] float32 routing weights (applied by the FFN-side caller).
            bucket: static token bucket, T <= bucket <= capacity_tokens_per_rank; every rank
                of the exchange uses the same bucket.
            x_scales: [T, H/128] float32 per-128 scales, FP8 only.
            slot: micro-batch slot in [0, num_slots); its previous exchange must be collected.
        Returns:
            None; ``source_collect(slot=slot)`` returns the result.
        """
        self._slots.require_role(ATTENTION, "source_dispatch")
        validate.python_types(self.device, ints=(("bucket", bucket), ("slot", slot)),
                              tensors=(("x", x), ("expert_ids", expert_ids),
                                       ("weights", weights)),
                              optional_tensors=(("x_scales", x_scales),))
        self._run(torch.ops.afdep.dispatch, self.state, x, expert_ids, weights, x_scales,
                  self.group_name, self.buffer_id, bucket, slot,
                  validate.check_values_eagerly(self.device))

    def source_collect(self, *, slot: int = 0, zero_copy: bool = False) -> torch.Tensor:
        """Receive and sum the FFN ranks' replies of ``slot``.

        Arguments:
            slot: the slot of the open dispatch.
            zero_copy: one FFN rank only: no copy out of the receive buffer; the result is a
                view of it, rows of tokens without an expert zeroed there. The view stays
                valid until the next ``source_dispatch`` on the same slot (the FFN's next
                reply overwrites it) or ``close()``; read it, never write it (not enforced).
                Eager and CUDA graphs only (``torch.compile`` traces the op path).
        Returns:
            out: [T, H] bfloat16, each token's fp32 sum over FFN ranks (zero for tokens
            without a valid expert).
        """
        self._slots.require_role(ATTENTION, "source_collect")
        self.config.check_slot(validate.check_int("slot", slot))
        if not isinstance(zero_copy, bool):
            raise TypeError(f"zero_copy must be a bool, got {type(zero_copy).__name__}")
        if zero_copy and self.config.ffn_ranks != 1:
            raise ValueError(f"zero_copy needs ffn_ranks == 1 (one reply row per token to "
                             f"view); this buffer has ffn_ranks={self.config.ffn_ranks}")
        route = self._slots.open_route(slot)
        if zero_copy:
            return self._run(self._collect_view, route, slot)
        return self._run(torch.ops.afdep.combine, self.state, route, self.group_name,
                         self.buffer_id, slot)

    def _collect_view(self, route: torch.Tensor, slot: int) -> torch.Tensor:
        transport = self._slots.begin(slot, "combine")
        try:
            out = transport.combine_view(route)
        finally:  # done, or finished without data (AfdepBucketError); else the buffer breaks
            self._slots.end(slot, "combine", self.state)
        return out

    # ---- FFN ranks --------------------------------------------------------------------------
    def worker_receive(self, bucket: int, *, slot: int = 0):
        """Receive every Attention rank's tokens of ``slot``.

        Arguments:
            bucket: the bucket every Attention rank dispatched with.
            slot: micro-batch slot; its previous exchange must have been replied to.
        Returns:
            expert layout: a ``Received`` (x [A*bucket*R, H] grouped by local expert,
            x_scales, weights [A*bucket*R], expert_offsets [E_local+1], src_rank, src_token);
            token layout: a ``TokenReceived`` (x [N, H] a view of the receive window,
            x_scales, expert_ids [N, k] int32 local ids or -1, weights [N, k] float32,
            src_rank, src_token, num_tokens), N = ``Config.token_rows(bucket)``. Shapes and
            dtypes in ``torch_afdep.types``. Its ``receipt`` goes to ``worker_reply``.
        """
        self._slots.require_role(FFN, "worker_receive")
        validate.python_types(self.device, ints=(("bucket", bucket), ("slot", slot)))
        return self._run(self._receive, bucket, slot)

    def _receive(self, bucket: int, slot: int):
        out = receive(self._slots, bucket, slot, 0)
        # stamp the receive count the op just advanced (stale receipts are refused)
        seq = self._slots.sequence(slot)
        return out._replace(receipt=out.receipt._replace(sequence=seq))

    def worker_reply(self, rows: torch.Tensor, receipt: Receipt, *,
                     slot: Optional[int] = None) -> None:
        """Send the caller's expert outputs back, one fp32-summed BF16 row per token.

        Arguments:
            rows: expert layout: [A*bucket*R, H] bfloat16, row i = expert output of
                Received.x[i] already multiplied by Received.weights[i] (rows past
                expert_offsets[-1] are ignored); token layout: [N, H] bfloat16, row i = the
                sum over token i's local experts of weight * expert output (the caller's MoE
                output; rows without a token are ignored).
            receipt: the receipt of the slot's current exchange.
            slot: defaults to the receipt's slot; when given it must be the receipt's.
        Returns:
            None.
        """
        self._slots.require_role(FFN, "worker_reply")
        if slot is not None:
            self.config.check_slot(validate.check_int("slot", slot))
        # Out of order first: a reply with nothing received is that, whatever it carries.
        self._slots.expect(receipt.slot if isinstance(receipt, (Receipt, TokenReceipt)) else
                           (slot or 0), "reply")
        slot = validate.receipt(self.config, self._slots.key, receipt, slot, rows)
        validate.python_types(self.device, tensors=(("rows", rows),))
        if receipt.sequence != self._slots.sequence(slot):
            raise AfdepStateError(
                f"stale receipt: it is from exchange {receipt.sequence}, the current one is "
                f"{self._slots.sequence(slot)} (slot {slot})")
        self._run(reply, self._slots, rows, receipt, slot)

    # ---- lifecycle --------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._slots.closed

    def close(self) -> None:
        """Collective and idempotent: finish pending work, free buffers. Call it after every
        exchange and graph replay has finished on every rank."""
        slots = self._slots
        if slots.closed:
            return
        slots.closed = True
        registry.remove(slots)
        clean = slots.broken is None
        first: Optional[BaseException] = None
        try:
            for t in slots.transports:
                try:
                    t.close(clean=clean)
                except BaseException as e:  # close the other slots without waiting
                    first = first or e
                    clean = False
            if first is not None:
                raise first
        finally:
            # After a failure this rank frees everything without meeting its peers (a barrier
            # on a group gloo has dropped pairs of would only time out again).
            if slots.broken is None and first is None:
                self._closing_barrier()

    def _closing_barrier(self) -> None:
        """No rank frees memory a peer may still read; a peer that never arrives (or died)
        gives an error after ``timeout_s`` instead of a hang."""
        import datetime

        try:
            work = dist.barrier(group=self.group, async_op=True)
            ok = work.wait(datetime.timedelta(seconds=float(self.config.timeout_s)))
        except RuntimeError as e:
            raise AfdepTimeoutError(f"rank {self.rank}: close() could not meet every peer: "
                                    f"{e}", phase="close", rank=self.rank) from e
        if ok is False:
            raise AfdepTimeoutError(f"rank {self.rank}: close() waited more than "
                                    f"{self.config.timeout_s} s for its peers",
                                    phase="close", rank=self.rank)

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        # Unwinding: an exchange left half done is abandoned, and a failing close must not
        # replace the body's exception.
        if self._slots.exchange_open() and self._slots.broken is None:
            self._slots.broken = exc
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"Buffer(group={self.group_name!r}, id={self.buffer_id}, rank={self.rank}, "
                f"role={self.role!r}, device={self.device}, closed={self.closed})")


def _cuda_extension_available() -> bool:
    try:
        from . import _cuda  # noqa: F401
    except ImportError:
        return False
    return True


def _backend_roles(group):
    """Roles the afdep c10d backend was given for ``group`` (None for other backends)."""
    try:
        from .distributed.backend import roles_of
    except ImportError:
        return None
    return roles_of(group)


__all__ = ["Buffer", "AfdepError"]
