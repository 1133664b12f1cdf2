"""``Buffer``: the role API an engine uses to drive AFD exchanges directly."""

from __future__ import annotations

import os
from typing import List, Optional

import torch
import torch.distributed as dist

from . import ops, registry
from .config import ATTENTION, FFN, Config
from .errors import AfdepError, AfdepStateError, AfdepTimeoutError

_ID_DTYPES = (torch.int32, torch.int64)


def _check_tensor(name: str, t, dtypes, shape, device) -> None:
    """TypeError/ValueError naming ``name`` unless t is a contiguous tensor as described.

    ``shape`` entries of None match any size."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} (the buffer's device), got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous())")


def _is_symbolic() -> bool:
    return torch.compiler.is_compiling()


class Buffer:
    """One rank's end of AFD exchanges on ``group`` (collective to create and to close).

    Args:
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
        if not isinstance(config, Config):
            raise TypeError(f"config must be a torch_afdep.Config, got {type(config).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call "
                               "dist.init_process_group(...) before creating a Buffer")
        self.group = dist.group.WORLD if group is None else group
        self.config = config
        self.rank = dist.get_rank(self.group)
        self.group_name = self.group.group_name
        self.device = self._pick_device(device)
        # The first op call imports torch._dynamo (seconds); do it before any peer waits.
        import torch._dynamo  # noqa: F401

        # Collective first, so every rank raises the same error on any mismatch.
        self._check_same_config_everywhere()
        size = dist.get_world_size(self.group)
        if size != config.world_size:
            raise ValueError(
                f"group has {size} ranks but config needs attention_ranks + ffn_ranks = "
                f"{config.attention_ranks} + {config.ffn_ranks} = {config.world_size}")
        self.role = config.role_of(self.rank)
        self.role_index = config.role_index(self.rank)

        self.buffer_id = registry.next_id(self.group_name)
        #: Ordering token of the ops (host-side call counters); see ops.py.
        self.state = torch.zeros(2, dtype=torch.int64)
        self._closed = False
        self._broken: Optional[BaseException] = None
        n = config.num_slots
        #: Per slot: phase (advanced by the ops' real kernels, see ops._enter), the route of
        #: the open dispatch (Attention) and the receive count (FFN).
        self._slot_phase: List[str] = ["idle"] * n
        self._slot_route: List[Optional[torch.Tensor]] = [None] * n
        self._slot_seq: List[int] = [0] * n
        #: One transport per micro-batch slot.
        self.transports: list = []
        try:
            for slot in range(n):
                self.transports.append(self._make_transport(slot))
        except BaseException:
            for t in self.transports:
                try:
                    t.close(clean=False)
                except Exception:
                    pass
            raise
        registry.add(self)

    def _make_transport(self, slot: int):
        if self.device.type == "cuda":
            from ._cuda_impl import CudaTransport

            return CudaTransport(self.config, self.rank, self.device, self.group, slot=slot)
        from ._cpu_impl import CpuTransport

        return CpuTransport(self.config, self.rank, self.group, self.buffer_id, slot)

    @property
    def transport(self):
        """The transport of slot 0 (``transports[slot]`` for the others)."""
        return self.transports[0]

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
        """``"idle"``, ``"dispatched"`` (Attention) or ``"received"`` (FFN) for ``slot``."""
        self.config.check_slot(slot)
        return self._slot_phase[slot]

    # ---- construction helpers -----------------------------------------------------------
    def _pick_device(self, device) -> torch.device:
        if device is None:
            if torch.cuda.is_available() and _cuda_extension_available():
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device("cpu")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or a CUDA device, got {device}")
        return device

    def _check_same_config_everywhere(self) -> None:
        """Every rank raises the same error when configs or roles differ across ranks."""
        mine = (self.config.fingerprint(), self.device.type, _backend_roles(self.group))
        all_ = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(all_, mine, group=self.group)
        names = ("capacity_tokens_per_rank", "hidden_size", "num_experts", "top_k",
                 "ffn_ranks", "attention_ranks", "dtype", "roles", "num_sms", "num_slots")
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

    # ---- state checks ---------------------------------------------------------------------
    def _require_open(self, what: str) -> None:
        if self._closed:
            raise AfdepStateError(f"{what}: this Buffer is closed")
        if self._broken is not None:
            raise AfdepStateError(
                f"{what}: this Buffer is unusable after an earlier failure: {self._broken}")
        if not _is_symbolic():  # traced: the ops poll at run time instead (ops._enter)
            for t in self.transports:
                t.check_error()

    def _require_role(self, role: str, what: str) -> None:
        self._require_open(what)
        if self.role != role:
            other = {"attention": "source_dispatch/source_collect",
                     "ffn": "worker_receive/worker_reply"}[self.role]
            raise AfdepStateError(
                f"{what} is for {role} ranks; group rank {self.rank} is an {self.role} rank "
                f"(use {other})")

    def _check_dispatch_args(self, x, expert_ids, weights, x_scales, bucket) -> None:
        cfg = self.config
        if isinstance(bucket, bool) or not isinstance(bucket, int):
            raise TypeError(f"bucket must be an int, got {type(bucket).__name__}")
        _check_tensor("x", x, (cfg.dtype,), (None, cfg.hidden_size), self.device)
        t = x.shape[0]
        cfg.check_bucket(bucket, t)
        _check_tensor("expert_ids", expert_ids, _ID_DTYPES, (t, cfg.top_k), self.device)
        _check_tensor("weights", weights, (torch.float32,), (t, cfg.top_k), self.device)
        if cfg.scale_cols:
            if x_scales is None:
                raise ValueError("x_scales [T, hidden_size/128] float32 is required for FP8 x")
            _check_tensor("x_scales", x_scales, (torch.float32,), (t, cfg.scale_cols),
                          self.device)
        elif x_scales is not None:
            raise ValueError("x_scales must be None for BF16 payloads")
        if t and self._check_values():
            lo, hi = int(expert_ids.min()), int(expert_ids.max())
            if lo < -1 or hi >= cfg.num_experts:
                bad = lo if lo < -1 else hi
                raise ValueError(
                    f"expert_ids must be in [-1, {cfg.num_experts}) (num_experts="
                    f"{cfg.num_experts}; -1 = no expert), got {bad}")

    def _check_values(self) -> bool:
        """Value checks need the data on the host: always on CPU; on CUDA in eager mode
        unless AFDEP_CHECK_INPUTS=0 (inside graphs the kernels check and report)."""
        if _is_symbolic():
            return False
        if self.device.type == "cpu":
            return True
        if torch.cuda.is_current_stream_capturing():
            return False
        return os.environ.get("AFDEP_CHECK_INPUTS", "1") != "0"

    def _check_route(self, route) -> None:
        _check_tensor("route", route, (torch.int64,), (None,), self.device)
        if route.shape[0] > self.config.capacity_tokens_per_rank:
            raise ValueError(f"route has {route.shape[0]} tokens, more than "
                             f"capacity_tokens_per_rank ({self.config.capacity_tokens_per_rank})")

    def _check_reply_args(self, rows, receipt) -> None:
        if not isinstance(receipt, ops.Receipt):
            raise TypeError(f"receipt must be the Receipt from worker_receive, got "
                            f"{type(receipt).__name__}")
        if receipt.buffer_key != (self.group_name, self.buffer_id):
            raise ValueError(f"receipt belongs to buffer {receipt.buffer_key}, not to this "
                             f"buffer {(self.group_name, self.buffer_id)}")
        cfg = self.config
        cfg.check_slot(receipt.slot)
        a, b, r = cfg.attention_ranks, receipt.bucket, cfg.rows_per_token
        _check_tensor("rows", rows, (torch.bfloat16,), (cfg.recv_rows(b), cfg.hidden_size),
                      self.device)
        _check_tensor("receipt.token_rows", receipt.token_rows, (torch.int32,), (a, b, r),
                      self.device)
        _check_tensor("receipt.token_index", receipt.token_index, (torch.int32,), (a, b),
                      self.device)
        _check_tensor("receipt.num_tokens", receipt.num_tokens, (torch.int32,), (a,),
                      self.device)

    def _run(self, fn, *args):
        """Run a transport step; a failure inside it (timeout, dead peer) makes the buffer
        unusable rather than leaving a half-done exchange to confuse the next one."""
        try:
            return fn(*args)
        except (ValueError, TypeError, AfdepStateError):
            raise
        except BaseException as e:
            self._broken = e
            raise

    # ---- Attention ranks ------------------------------------------------------------------
    def _slot_arg(self, slot) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int):
            raise TypeError(f"slot must be an int, got {type(slot).__name__}")
        return self.config.check_slot(slot)

    def source_dispatch(self, x: torch.Tensor, expert_ids: torch.Tensor,
                        weights: torch.Tensor, bucket: int,
                        x_scales: Optional[torch.Tensor] = None, *, slot: int = 0) -> None:
        """Send this rank's tokens to the FFN ranks that hold their experts.

        Args:
            x: [T, H] ``config.dtype`` (bfloat16, or pre-quantized float8_e4m3fn).
            expert_ids: [T, top_k] int32 or int64, global expert ids in [0, E) or -1.
            weights: [T, top_k] float32 routing weights (applied by the FFN-side caller).
            bucket: static token bucket, T <= bucket <= capacity_tokens_per_rank; every rank
                of the exchange uses the same bucket.
            x_scales: [T, H/128] float32 per-128 scales, FP8 only.
            slot: micro-batch slot in [0, num_slots); its previous exchange must be collected.
        """
        self._require_role(ATTENTION, "source_dispatch")
        slot = self._slot_arg(slot)
        if self._slot_phase[slot] != "idle":
            raise AfdepStateError(
                f"source_dispatch called twice without source_collect on slot {slot}: collect "
                f"its previous exchange first (or use another slot)")
        self._check_dispatch_args(x, expert_ids, weights, x_scales, bucket)
        self._slot_route[slot] = self._run(
            torch.ops.afdep.dispatch, self.state, x, expert_ids, weights, x_scales,
            self.group_name, self.buffer_id, bucket, slot)

    def source_collect(self, *, slot: int = 0, zero_copy: bool = False) -> torch.Tensor:
        """Receive and sum the FFN ranks' replies of ``slot``: [T, H] bfloat16 (fp32 sums).

        ``zero_copy=True`` (one FFN rank only): no copy out of the receive buffer; the result
        is a view of it, rows of tokens without an expert zeroed there. The view stays valid
        until the next ``source_dispatch`` on the same slot (the FFN's next reply overwrites
        it) or ``close()``; read it, never write it. Eager and CUDA graphs only (the op path,
        ``torch.ops.afdep.combine``, is the one ``torch.compile`` traces).
        """
        self._require_role(ATTENTION, "source_collect")
        slot = self._slot_arg(slot)
        if not isinstance(zero_copy, bool):
            raise TypeError(f"zero_copy must be a bool, got {type(zero_copy).__name__}")
        if zero_copy and self.config.ffn_ranks != 1:
            raise ValueError(f"zero_copy needs ffn_ranks == 1 (one reply row per token to "
                             f"view); this buffer has ffn_ranks={self.config.ffn_ranks}")
        route = self._slot_route[slot]
        if self._slot_phase[slot] != "dispatched" or route is None:
            raise AfdepStateError(
                f"source_collect called without a preceding source_dispatch on slot {slot}")
        if zero_copy:
            out = self._run(self._collect_view, route, slot)
        else:
            out = self._run(torch.ops.afdep.combine, self.state, route, self.group_name,
                            self.buffer_id, slot)
        self._slot_route[slot] = None
        return out

    def _collect_view(self, route: torch.Tensor, slot: int) -> torch.Tensor:
        transport = ops._enter(self, slot, "combine")
        out = transport.combine_view(route)
        ops._leave(self, slot, "combine")
        ops._bump(self.state, ops._RECV_CALLS)
        return out

    # ---- FFN ranks --------------------------------------------------------------------------
    def worker_receive(self, bucket: int, *, slot: int = 0) -> ops.Received:
        """Receive every Attention rank's tokens of ``slot``, expanded into expert-major rows.

        Returns a ``Received`` (shapes in docs/contract.md) whose ``receipt`` (it records the
        slot) goes to ``worker_reply``."""
        self._require_role(FFN, "worker_receive")
        slot = self._slot_arg(slot)
        if self._slot_phase[slot] != "idle":
            raise AfdepStateError(
                f"worker_receive called twice without worker_reply on slot {slot}: reply to "
                f"its previous exchange first (or use another slot)")
        if isinstance(bucket, bool) or not isinstance(bucket, int):
            raise TypeError(f"bucket must be an int, got {type(bucket).__name__}")
        self.config.check_bucket(bucket)
        outs = self._run(torch.ops.afdep.receive, self.state, self.group_name,
                         self.buffer_id, bucket, slot)
        self._slot_seq[slot] += 1
        return ops._package(self, bucket, outs, self._slot_seq[slot], slot)

    def worker_reply(self, rows: torch.Tensor, receipt: ops.Receipt, *,
                     slot: Optional[int] = None) -> None:
        """Send the caller's expert outputs back, one fp32-summed BF16 row per token.

        Args:
            rows: [A*bucket*R, H] bfloat16, row i = expert output of Received.x[i] already
                multiplied by Received.weights[i]; rows past expert_offsets[-1] are ignored.
            receipt: ``Received.receipt`` of the slot's current exchange.
            slot: defaults to the receipt's slot; when given it must be the receipt's.
        """
        self._require_role(FFN, "worker_reply")
        if slot is not None:
            slot = self._slot_arg(slot)
        if isinstance(receipt, ops.Receipt):
            slot = ops._receipt_slot(receipt, slot)
            self.config.check_slot(slot)
        slot = 0 if slot is None else slot
        if self._slot_phase[slot] != "received":
            raise AfdepStateError(
                f"worker_reply called without a preceding worker_receive on slot {slot}")
        self._check_reply_args(rows, receipt)
        if receipt.sequence != self._slot_seq[slot]:
            raise AfdepStateError(
                f"stale receipt: it is from exchange {receipt.sequence}, the current one is "
                f"{self._slot_seq[slot]} (slot {slot})")
        self._run(torch.ops.afdep.reply, self.state, rows, receipt.token_rows,
                  receipt.token_index, receipt.num_tokens, self.group_name, self.buffer_id,
                  slot)

    # ---- lifecycle --------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Collective and idempotent: finish pending work, free buffers. Call it after every
        exchange and graph replay has finished on every rank."""
        if self._closed:
            return
        self._closed = True
        registry.remove(self)
        clean = self._broken is None
        first: Optional[BaseException] = None
        try:
            for t in self.transports:
                try:
                    t.close(clean=clean)
                except BaseException as e:  # close the other slots without waiting
                    first = first or e
                    clean = False
            if first is not None:
                raise first
        finally:
            if self._broken is None and first is None:
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
        if any(p != "idle" for p in self._slot_phase) and self._broken is None:
            self._broken = exc
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (f"Buffer(group={self.group_name!r}, id={self.buffer_id}, rank={self.rank}, "
                f"role={self.role!r}, device={self.device}, closed={self._closed})")


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
