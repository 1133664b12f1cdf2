"""CUDA path of the exchange contract: CUDA IPC peer memory in one NVLink domain.

``CudaTransport`` is the glue between torch tensors and ``torch_afdep._cuda`` (plain CUDA
runtime + pybind11): it passes raw device pointers and the current stream, launches nothing
but the four phase kernels, never synchronizes the host on the hot path, and allocates and
registers all memory in ``__init__`` (so exchanges can be captured in CUDA graphs after it).
The protocol is described in docs/protocol.md; its controls in torch_afdep/env.py.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from .. import env
from ..config import FFN, Config
from ..errors import AfdepBucketError, AfdepRouteError, AfdepTimeoutError
from .base import Transport

_PHASES = {0: "dispatch", 1: "combine", 2: "flag round-trip probe"}
_ROUTE_KINDS = {
    0: "expert id outside [-1, num_experts)",
    1: "more local entries for one FFN rank than rows_per_token (duplicated ids)",
    2: "receipt or slot index out of range (bucket/receipt mismatch)",
    3: "bucket mismatch",
}


def _ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


#: seconds ``CudaTransport.close`` waits for this rank's kernels beyond two ``timeout_s``
CLOSE_MARGIN_S = 30.0


def wait_bounded(fn: Callable[[], None], timeout_s: float) -> bool:
    """Run ``fn`` (a blocking wait, e.g. a device synchronize, which releases the GIL) on a
    daemon thread; True once it returned (its exception re-raised here), False when it is
    still running after ``timeout_s`` (it is then left running)."""
    done = threading.Event()
    failure = []

    def run():
        try:
            fn()
        except BaseException as e:  # handed to the caller
            failure.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="afdep-bounded-wait", daemon=True).start()
    if not done.wait(timeout_s):
        return False
    if failure:
        raise failure[0]
    return True


#: ``AFDEP_TRANSPORT``: how the ranks' windows are mapped into each other.
TRANSPORTS = {
    "ipc": "CUDA IPC handles (default; several ranks may share a GPU)",
    "nccl": "NCCL device API: ncclMemAlloc + symmetric window, LSA peer pointers (one rank "
            "per GPU, one NVLink domain; the extension must be built against the NCCL torch "
            "loads)",
}


def transport_kind(environ=None) -> str:
    """The transport ``AFDEP_TRANSPORT`` selects ("ipc" when unset)."""
    return env.get("AFDEP_TRANSPORT", environ)


class _DeviceMemory:
    """Exposes registered device memory to ``torch.as_tensor`` (CUDA array interface v2: no
    stream synchronization); the tensor does not own the memory."""

    def __init__(self, ptr: int, shape, typestr: str):
        self.__cuda_array_interface__ = {"shape": tuple(shape), "typestr": typestr,
                                         "data": (int(ptr), False), "version": 2}


def _device_tensor(ptr: int, shape, device: torch.device,
                   typestr: str = "<i2") -> torch.Tensor:
    """Tensor (int16 unless ``typestr`` says otherwise) aliasing ``shape`` elements at ``ptr``
    on ``device`` (no copy)."""
    with torch.cuda.device(device):  # older torch builds take the current device
        t = torch.as_tensor(_DeviceMemory(ptr, shape, typestr), device=device)
    if t.data_ptr() != ptr:
        raise RuntimeError("torch_afdep: the receive-buffer view was copied, not aliased")
    return t


class CudaTransport(Transport):
    """One rank's CUDA exchange state (collective to create over ``cpu_group``, a gloo group
    of the same ranks in the same order).

    A ``Buffer`` creates one per micro-batch slot (``slot``): each registers its own windows
    and keeps its own device counters and error block, so exchanges of different slots never
    share memory or sequence numbers (no kernel change; memory scales with the slot count).
    """

    def __init__(self, config: Config, group_rank: int, device, cpu_group=None,
                 flags: Optional[int] = None, slot: int = 0):
        from .. import _cuda  # the extension; ImportError when it was not built

        self.config = config
        self.slot = int(slot)
        self.rank = int(group_rank)
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.group = cpu_group
        settings = env.current()
        self.flags = settings.flags if flags is None else int(flags)
        self.transport_kind = settings.transport
        self.role = config.role_of(self.rank)
        self.is_ffn = self.role == FFN
        self.index = config.role_index(self.rank)
        self._closed = False
        self._view = None  # combine_view's [C, H] bfloat16 view of the receive buffer
        c = config
        elem = 1 if c.dtype == torch.float8_e4m3fn else 2
        ffn_ctas, attn_ctas = ((c.local_sms, c.local_sms) if c.local_sms
                               else self._auto_local_ctas(cpu_group))
        self._comm = _cuda.Comm(
            rank=self.rank, device=self.device.index,
            is_ffn=[1 if r == FFN else 0 for r in c.role_list],
            num_sms=c.num_sms, hidden=c.hidden_size, elem=elem, scale_cols=c.scale_cols,
            num_experts=c.num_experts, top_k=c.top_k, capacity=c.capacity_tokens_per_rank,
            timeout_s=float(c.timeout_s), flags=self.flags, ffn_ctas=int(ffn_ctas),
            attn_ctas=int(attn_ctas), transport=self.transport_kind,
            trace=bool(settings.trace), debug=int(settings.debug),
            token_layout=c.receive_layout == "tokens")
        #: CTAs of the FFN's receive/reply kernels (every rank must agree: Attention ranks
        #: count the reply kernel's CTAs) and of this rank's combine kernel (Attention)
        self.ffn_grid = int(self._comm.ffn_grid)
        self.attn_grid = int(self._comm.attn_grid)
        mine = (bytes(self._comm.local_handle()), self.flags, c.fingerprint(), self.ffn_grid,
                self.transport_kind)
        world = dist.get_world_size(cpu_group)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine, group=cpu_group)
        bad = [r for r, g in enumerate(gathered) if g[1] != self.flags or g[2] != c.fingerprint()
               or g[3] != self.ffn_grid or g[4] != self.transport_kind]
        if bad:
            self._comm.close(False)
            raise RuntimeError(
                f"torch_afdep: ranks {bad} differ in protocol controls, config, FFN grid or "
                f"transport (this rank: {env.describe_flags(self.flags)}, ffn grid "
                f"{self.ffn_grid}, AFDEP_TRANSPORT={self.transport_kind}); set the same "
                "AFDEP_* environment on every rank (and local_sms when the GPUs differ)")
        self._comm.open([g[0] for g in gathered])
        dist.barrier(group=cpu_group)
        self._token_x = self._token_scales = None  # token layout: views of the inbox
        self._token_bucket = None  # token layout: bucket of this slot's last receive
        if self.is_ffn and c.receive_layout == "tokens":
            self._make_token_views()

    def _make_token_views(self) -> None:
        """The token layout's [token_rows(C), H] payload and [.., H/128] float32 scale views of
        this slot's dispatch inbox, made once: every receive returns slices of them from row
        0, so the addresses a CUDA graph captures stay valid."""
        c = self.config
        n = c.token_rows(c.capacity_tokens_per_rank)
        x_ptr, s_ptr = (int(p) for p in self._comm.token_view_ptrs())
        if c.dtype == torch.float8_e4m3fn:
            self._token_x = _device_tensor(x_ptr, (n, c.hidden_size), self.device,
                                           "|u1").view(torch.float8_e4m3fn)
        else:
            self._token_x = _device_tensor(x_ptr, (n, c.hidden_size), self.device).view(c.dtype)
        if c.scale_cols:
            self._token_scales = _device_tensor(s_ptr, (n, c.scale_cols), self.device, "<f4")
        else:  # BF16: no scales, an empty [N, 0] tensor (no memory)
            self._token_scales = torch.empty(n, 0, dtype=torch.float32, device=self.device)

    def _auto_local_ctas(self, cpu_group):
        """(FFN grid, this rank's combine grid): one CTA per SM, divided among the group's
        ranks that share a GPU (their spinning kernels must leave SMs to each other). The
        FFN grid is the minimum over FFN ranks, so every rank agrees (collective)."""
        props = torch.cuda.get_device_properties(self.device)
        uuid_me = str(getattr(props, "uuid", "")) or f"dev{self.device.index}"
        me = (uuid_me, props.multi_processor_count)
        world = dist.get_world_size(cpu_group)
        devs = [None] * world
        dist.all_gather_object(devs, me, group=cpu_group)
        best = None
        for r, (uuid, sms) in enumerate(devs):
            if self.config.role_of(r) != FFN:
                continue
            sharing = sum(1 for u, _ in devs if u == uuid)
            g = max(1, sms // sharing)
            best = g if best is None else min(best, g)
        sharing_me = sum(1 for u, _ in devs if u == uuid_me)
        if sharing_me > 1:  # correct but ~1,000x slow without MPS: say so before running
            from ..mps import shared_gpu_problem

            problem = shared_gpu_problem(sharing_me)
            if problem:
                import warnings

                warnings.warn(f"torch_afdep: {problem}", RuntimeWarning, stacklevel=3)
        mine = max(1, props.multi_processor_count // sharing_me)
        return int(best or props.multi_processor_count), int(mine)

    # ---- sizes ------------------------------------------------------------------------
    @property
    def registered_bytes(self) -> int:
        return int(self._comm.registered_bytes)

    @property
    def union_bytes(self) -> int:
        return int(self._comm.union_bytes)

    @property
    def signal_bytes(self) -> int:
        return int(self._comm.signal_bytes)

    # ---- diagnostics ----------------------------------------------------------------------
    @property
    def last_forms(self) -> Tuple[Optional[str], Optional[str]]:
        """The kernel forms (csrc/include/afdep/forms.h, e.g. "kSmallRecv") of this rank's
        last launch of each phase: (dispatch or receive, reply or collect); None before the
        first. Chosen per launch on the host (from the controls, the bucket and T), recorded
        when the launch is made (also while a CUDA graph is captured)."""
        from .. import _cuda

        names = {v: k for k, v in _cuda.KERNEL_FORMS.items()}
        return tuple(names.get(f) for f in self._comm.last_forms())

    # ---- Attention --------------------------------------------------------------------
    def dispatch(self, x, expert_ids, weights, x_scales, bucket, route) -> None:
        t = x.shape[0]
        if t > bucket:
            raise ValueError(f"x has {t} tokens but bucket is {bucket}")
        self._comm.dispatch(_ptr(x), _ptr(x_scales), _ptr(expert_ids),
                            expert_ids.dtype == torch.int64, _ptr(weights), _ptr(route), int(t),
                            _stream(self.device), bucket=int(bucket))

    def combine(self, route, out) -> None:
        self._comm.combine(_ptr(route), _ptr(out), int(out.shape[0]), _stream(self.device))

    def combine_view(self, route) -> torch.Tensor:
        """One FFN rank: wait for the reply, zero the rows of unrouted tokens in the receive
        buffer and return rows [0, T) of it as a [T, H] bfloat16 view (no copy)."""
        t = int(route.shape[0])
        self._comm.combine_in_place(_ptr(route), t, _stream(self.device))
        if self._view is None:
            c = self.config
            self._view = _device_tensor(int(self._comm.view_ptr()),
                                        (c.capacity_tokens_per_rank, c.hidden_size),
                                        self.device).view(torch.bfloat16)
        return self._view[:t]

    # ---- FFN --------------------------------------------------------------------------
    def receive(self, bucket, x, x_scales, weights, expert_offsets, src_rank, src_token,
                token_rows, token_index, num_tokens) -> None:
        self._comm.receive(int(bucket), _ptr(x), _ptr(x_scales), _ptr(weights),
                           _ptr(expert_offsets), _ptr(src_rank), _ptr(src_token),
                           _ptr(token_rows), _ptr(token_index), _ptr(num_tokens),
                           _stream(self.device))

    def reply(self, rows, token_rows, token_index, num_tokens) -> None:
        bucket = token_index.shape[1]
        self._comm.reply(int(bucket), _ptr(rows), _ptr(token_rows), _ptr(token_index),
                         _ptr(num_tokens), _stream(self.device))

    def receive_tokens(self, bucket, expert_ids, weights, src_rank, src_token, num_tokens):
        """Token layout: wait for every Attention rank's tokens, write the metadata outputs
        and return (x [N, H], x_scales [N, H/128 or 0]) views of the inbox, N =
        Config.token_rows(bucket): row a * rps + c * ceil(bucket / S) + j holds token j of
        channel c of Attention index a (rps = Config.rows_per_source(bucket))."""
        self._comm.receive_tokens(int(bucket), _ptr(expert_ids), _ptr(weights), _ptr(src_rank),
                                  _ptr(src_token), _ptr(num_tokens), _stream(self.device))
        self._token_bucket = int(bucket)
        n = self.config.token_rows(int(bucket))
        return self._token_x[:n], self._token_scales[:n]

    def reply_tokens(self, rows, src_token, num_tokens) -> None:
        """Token layout: row i of rows [N, H] bfloat16 goes back as the reply of token
        src_token[i] (-1: none) of Attention index i // rows_per_source."""
        c = self.config
        bucket = self._token_bucket
        if bucket is None or c.token_rows(bucket) != rows.shape[0]:
            # rows of another bucket than the last receive's: a bucket with the row count's
            # rows_per_source (a multiple of num_sms; validate checked the count)
            bucket = min(rows.shape[0] // c.attention_ranks, c.capacity_tokens_per_rank)
        self._comm.reply_tokens(int(bucket), _ptr(rows), _ptr(src_token), _ptr(num_tokens),
                                _stream(self.device))

    # ---- diagnostics ------------------------------------------------------------------
    def flag_round_trip_us(self, peer: int, initiator: bool, iters: int = 1000,
                           warmup: int = 100):
        """Probe: ``iters`` flag round trips between this rank and group rank ``peer``, one
        thread per side spinning on its window (the latency term of a data-movement floor).
        Both ranks call it at the same time, the one with ``initiator=True`` timing it.
        Returns µs per round trip on the initiator, None on the responder. Synchronizes the
        device: outside timed regions only."""
        stream = torch.cuda.current_stream(self.device)
        self._comm.ping(int(peer), int(warmup), bool(initiator), stream.cuda_stream)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        self._comm.ping(int(peer), int(iters), bool(initiator), stream.cuda_stream)
        end.record(stream)
        end.synchronize()
        self.check_error()
        return start.elapsed_time(end) * 1000.0 / iters if initiator else None

    def trace(self):
        """Stage stamps of the last exchanges when the process runs with ``AFDEP_TRACE=1``
        (else None): ``(stamps, counters)`` with ``stamps`` an int64 tensor [ring, 2 phases,
        points] of %globaltimer ns (points: start, sent, waited, end, latest sent, latest
        waited, latest end, expansion ready, tokens claimed, payload written, reply rows
        written, count table loaded, first loads arrived (dispatch sender, FFN reply):
        csrc/include/afdep/layout.h TracePoint; 0 = not reached)
        indexed by exchange number modulo ring, and ``counters`` the (dispatch, combine) exchange numbers of CTA 0.
        Synchronizes the device: never call it inside a timed region."""
        from .. import _cuda

        v = self._comm.trace()
        if not v:
            return None
        ring, pts = int(_cuda.TRACE_RING), int(_cuda.TRACE_POINTS)
        stamps = torch.tensor(v[:ring * 2 * pts], dtype=torch.int64).view(ring, 2, pts)
        return stamps, (int(v[-2]), int(v[-1]))

    # ---- errors and lifecycle ---------------------------------------------------------
    def check_error(self, mid_exchange: bool = False) -> None:
        """Raise what the device reported (host-mapped memory; no synchronization).
        ``mid_exchange``: timeouts only, route errors stay pending (Transport.check_error)."""
        if self._closed:
            return
        if mid_exchange and not self._comm.poll_error(False)["timeout"]:
            return
        e = self._comm.poll_error(True)
        if e["timeout"]:
            phase = _PHASES.get(e["phase"], str(e["phase"]))
            raise AfdepTimeoutError(
                f"rank {e['rank']} waited longer than {self.config.timeout_s} s for rank "
                f"{e['peer']} in {phase} (slot {self.slot})", peer=e["peer"], phase=phase,
                rank=e["rank"])
        if e["route"]:
            if e["route_kind"] == 0:  # the same words as the host-side check
                from ..validate import expert_id_error

                err = expert_id_error(int(e["route_bad_id"]), self.config.num_experts)
                raise AfdepRouteError(f"{err} (seen by the kernels on slot {self.slot}; the "
                                      "entry was skipped)")
            if e["route_kind"] == 3:  # the ranks of one exchange used different buckets
                peer, own = e.get("route_peer", -1), e.get("route_own", 0)
                theirs = e["route_bad_id"]
                did = "received" if not self.is_ffn else "dispatched"
                effect = ("its tokens were not taken" if self.is_ffn else
                          "its reply rows count as zero")
                raise AfdepBucketError(
                    f"{_ROUTE_KINDS[3]}: group rank {peer} {did} with bucket {theirs} but this "
                    f"rank used bucket {own} on slot {self.slot}; every rank of an exchange "
                    f"must use the same bucket ({effect})", peer=int(peer),
                    phase="dispatch" if self.is_ffn else "combine", rank=self.rank)
            kind = _ROUTE_KINDS.get(e["route_kind"], "route error")
            raise AfdepRouteError(f"{kind} (value {e['route_bad_id']}, slot {self.slot}); the "
                                  "entry was skipped")

    def close(self, clean: bool = True) -> None:
        """Collective and idempotent. ``clean``: meet every peer (bounded by timeout_s) before
        unmapping, so no rank frees memory a peer may still write; after a failure
        (``clean=False``) free without waiting for peers (every kernel has a deadline).

        Raises AfdepTimeoutError, leaving the memory mapped, when this rank's queued kernels
        have not finished within ``2 * timeout_s + CLOSE_MARGIN_S`` s: every wait in them ends
        at its deadline, so one is stuck (a kernel bug), and it may still write that memory."""
        if self._closed:
            return
        self._closed = True
        self._view = None
        self._token_x = self._token_scales = None
        bound = 2.0 * float(self.config.timeout_s) + CLOSE_MARGIN_S  # a timed-out phase, then
        # the next one (which finds the error block's timeout and leaves)
        finished = True  # (a CUDA error from the synchronize still frees, as before)
        try:
            finished = wait_bounded(lambda: torch.cuda.synchronize(self.device), bound)
        finally:
            if finished:
                met = False  # a clean (for NCCL: collective) teardown needs every peer here
                try:
                    if clean and dist.is_initialized():
                        import datetime

                        work = dist.barrier(group=self.group, async_op=True)
                        work.wait(datetime.timedelta(
                            seconds=float(self.config.timeout_s) + 30.0))
                        met = True
                finally:
                    self._comm.close(met)
        if not finished:
            raise AfdepTimeoutError(
                f"rank {self.rank}: close() waited more than {bound:.0f} s for this rank's "
                "kernels to finish; every wait in them ends after timeout_s, so one is stuck. "
                "Its memory stays mapped (the kernel may still write it)",
                phase="close", rank=self.rank)

    def __del__(self):
        try:
            if not self._closed:
                self._comm.close(False)  # no peer to meet from a finalizer
        except Exception:
            pass
