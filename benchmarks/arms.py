"""What one rank of one benchmark world runs (spawned by ``benchmarks.run``).

``world_main(rank, world_size, spec)`` runs every cell of one layout for one arm:

- ``afdep`` / ``symmetric``: a ``torch_afdep.Buffer`` per (receive layout, hidden, dtype);
  Attention ranks capture ``source_dispatch`` + ``source_collect``, FFN ranks
  ``worker_receive`` + the stand-in expert (``torch_exchange.stand_in_expert``: the first 128
  columns of every received row copied as BF16 into a reply of ones made once) +
  ``worker_reply``. The two arms differ only in the environment (``AFDEP_SYMMETRIC=1``).
- ``nccl``: the same contract, per receive layout, from ``all_to_all_single`` (NCCL) and
  torch ops (``benchmarks.torch_exchange``), capacity-padded to ``bucket`` rows per pair, with
  the same stand-in expert.
- ``nccl_bare``: one ``all_to_all_single`` each way moving T x H per pair, nothing else (it
  does not depend on the receive layout: run for the first layout's cells only).

Cells carry ``receive_layout`` ("experts" or "tokens"); ``spec["indices"]`` names the cells
of the plan this world runs.

Per cell: fresh inputs, eager warm-up exchanges (their output checked on Attention ranks),
one CUDA graph per role step, warm-up replays, then timed replays, each preceded by
``torch.cuda.synchronize()`` and a barrier on a gloo group, timed with CUDA events on
Attention ranks. Each rank appends one JSON line per cell to ``<out_dir>/rank<r>.jsonl``
(so results survive a world that is killed later). Ranks agree (over gloo) after each phase;
a failure before any communication skips the cell, a later one ends the world (the
remaining cells are recorded as not run) since the peers' state is then unknown.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import time
import traceback
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from torch_afdep import reference as ref

from . import common, stats
from . import torch_exchange as tx

AFDEP_ARMS = ("afdep", "afdep_alt", "symmetric")
NCCL_ARMS = ("nccl", "nccl_bare")
ALL_ARMS = AFDEP_ARMS + NCCL_ARMS

DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def cell_key(c: Dict[str, Any]) -> str:
    return (f"{c.get('receive_layout', 'experts')}/H{c['hidden']}/{c['dtype']}/"
            f"{c['routing']}/T{c['tokens']}")


def cell_seed(base: int, repeat: int, index: int) -> int:
    """Seed of cell ``index`` in ``repeat`` (``reference.make_inputs`` adds the Attention
    index): the same in every arm, so paired comparisons see the same data; different across
    cells and repeats."""
    return base + repeat * 1_000_003 + index * 1009


# ---- inputs -------------------------------------------------------------------------------
def served_rows(cfg, expert_ids: torch.Tensor) -> torch.Tensor:
    """[T] int64: the expert rows each token makes, summed over the FFN ranks that serve
    its entries (repeated and -1 ids make none)."""
    rows = torch.zeros(expert_ids.shape[0], dtype=torch.int64, device=expert_ids.device)
    for f in range(cfg.ffn_ranks):
        rows += (ref.local_expert_ids(expert_ids, f, cfg.experts_per_rank) >= 0).sum(dim=1)
    return rows


def reached_ffn_ranks(cfg, expert_ids: torch.Tensor) -> torch.Tensor:
    """[T] int64: the FFN ranks each token reaches (the token layout's reply rows)."""
    return ref.tokens_per_ffn(cfg, expert_ids).sum(dim=1).to(torch.int64)


def reply_rows(cfg, expert_ids: torch.Tensor, receive_layout: str) -> torch.Tensor:
    """[T] int64: the reply rows summed into each token's output: one per expert row in the
    expert layout (``served_rows``), one per reached FFN rank in the token layout."""
    if receive_layout == "tokens":
        return reached_ffn_ranks(cfg, expert_ids)
    return served_rows(cfg, expert_ids)


def expected_output(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """With the stand-in expert (``torch_exchange.stand_in_expert``) and unweighted rows,
    out[t] = rows(t) * stand_in_row(x)[t]: rows(t) times the first 128 columns of x[t] in BF16,
    rows(t) in every other column."""
    return tx.stand_in_row(x) * rows.to(torch.float32)[:, None]


def output_error(out: torch.Tensor, want: torch.Tensor) -> float:
    """The larger relative error of the payload columns (the first ``EXPERT_COLS``) and of the
    rest, so that a wrong payload is not diluted by the many constant columns."""
    c = min(tx.EXPERT_COLS, want.shape[1])
    err = ref.relative_error(out[:, :c], want[:, :c])
    if want.shape[1] > c:
        err = max(err, ref.relative_error(out[:, c:], want[:, c:]))
    return err


def open_log(spec: Dict[str, Any], rank: int):
    """This rank's JSONL record file; its first line names the process id, so the parent
    can end a stalled world's processes."""
    f = open(os.path.join(spec["out_dir"], f"rank{rank}.jsonl"), "a", buffering=1)
    f.write(json.dumps({"kind": "start", "rank": rank, "pid": os.getpid()}) + "\n")
    f.flush()
    return f


# ---- per-rank context ---------------------------------------------------------------------
class _Rank:
    def __init__(self, rank: int, world: int, spec: Dict[str, Any]):
        from torch_afdep.config import Config

        self.rank, self.world, self.spec = rank, world, spec
        self.arm = spec["arm"]
        self.A, self.F = spec["attention_ranks"], spec["ffn_ranks"]
        probe_cfg = Config(capacity_tokens_per_rank=spec["capacity"], hidden_size=128,
                           num_experts=spec["experts"], top_k=spec["top_k"],
                           ffn_ranks=self.F, attention_ranks=self.A)
        self.roles = probe_cfg.role_list
        self.role = probe_cfg.role_of(rank)
        self.index = probe_cfg.role_index(rank)
        self.is_attention = self.role == "attention"
        self.att_ranks = probe_cfg.attention_group_ranks
        self.cuda = spec.get("device", "cuda") == "cuda"
        self.device = (torch.device("cuda", torch.cuda.current_device()) if self.cuda
                       else torch.device("cpu"))
        self._log = open_log(spec, rank)
        self.ctrl = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=spec["ctrl_timeout_s"]))
        self.aborted: Optional[str] = None

    def config(self, hidden: int, dtype: str, receive_layout: str = "experts"):
        from torch_afdep.config import Config

        s = self.spec
        return Config(capacity_tokens_per_rank=s["capacity"], hidden_size=hidden,
                      num_experts=s["experts"], top_k=s["top_k"], ffn_ranks=self.F,
                      attention_ranks=self.A, dtype=DTYPES[dtype], num_sms=s["sms"],
                      local_sms=s.get("local_sms", 0),
                      timeout_s=float(s["kernel_timeout_s"]),
                      receive_layout=receive_layout,
                      num_slots=1)  # one exchange in flight: the protocol cost only

    def write(self, rec: Dict[str, Any]) -> None:
        rec.setdefault("rank", self.rank)
        rec.setdefault("role", self.role)
        self._log.write(json.dumps(rec) + "\n")
        self._log.flush()

    def agree(self, err: Optional[str]) -> Optional[str]:
        """Every rank learns whether any rank failed; returns the first error (or None)."""
        got: List[Any] = [None] * self.world
        dist.all_gather_object(got, err, group=self.ctrl)
        for r, e in enumerate(got):
            if e is not None:
                return f"rank {r}: {e}"
        return None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def align(self, failed: int = 0) -> int:
        """Synchronize the device, then a gloo all-reduce that is both the barrier and a
        way to tell the peers this rank failed. Returns 1 if any rank failed."""
        self.sync()
        t = torch.tensor([failed], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ctrl)
        return int(t[0])

    def close(self) -> None:
        try:
            self._log.close()
        except Exception:
            pass


def _err(e: BaseException) -> str:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    return f"{type(e).__name__}: {e}\n" + "".join(tb[-6:])


class _PeerFailed(RuntimeError):
    pass


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _time_graph(rk: _Rank, graph, warmup: int, replays: int, fail_at: int = -1,
                attention_delay_s: float = 0.0, queue_ahead_us: float = 0.0,
                around=None) -> List[float]:
    """Replay ``graph`` warmup + replays times, ranks aligned before each; returns the timed
    replays in µs on Attention ranks (empty on FFN ranks).

    After each alignment Attention ranks spin ``attention_delay_s`` on the host before they
    start timing, so the FFN ranks' graphs are already launched and waiting (the steady state
    of serving) rather than the measurement including how late a peer left the barrier.
    ``queue_ahead_us`` > 0 first enqueues a sleep kernel of about that long on Attention
    ranks, so the start event and the graph are both queued before the GPU reaches them (the
    host's graph-launch time is then not measured).

    ``around`` = (after_start, before_end): callables of the timed replay's index, run on
    Attention ranks right after the start event and right before the end event
    (benchmarks.trace stamps the stream there).

    A rank that fails says so in the next alignment, so every rank leaves the loop at the
    same replay (and the following agreement pairs up) instead of waiting for a timeout."""
    timed = rk.is_attention and rk.cuda
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)] if timed else []
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)] if timed else []
    wall: List[float] = []
    for i in range(warmup + replays):
        if rk.align():
            raise _PeerFailed(f"a peer failed at replay {i}")
        j = i - warmup
        try:
            if i == fail_at:
                raise RuntimeError(f"injected failure (replay {i}, rank {rk.rank})")
            if attention_delay_s and rk.is_attention and j >= 0:
                _spin(attention_delay_s)
            if timed and j >= 0:
                if queue_ahead_us > 0:
                    torch.cuda._sleep(int(queue_ahead_us * 2000))  # ~2 GHz clock
                starts[j].record()
                if around:
                    around[0](j)
            t0 = time.perf_counter()
            graph.replay()
            if j >= 0:
                if timed:
                    if around:
                        around[1](j)
                    ends[j].record()
                elif not rk.cuda:  # CPU smoke mode: wall clock, the numbers mean nothing
                    wall.append((time.perf_counter() - t0) * 1e6)
        except Exception:
            rk.align(failed=1)
            raise
    rk.sync()
    if not rk.is_attention:
        return []
    if not rk.cuda:
        return wall
    return [s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends)]


class _EagerGraph:
    """CPU smoke mode's stand-in for a CUDA graph: replay() runs the step eagerly."""

    def __init__(self, step):
        self._step = step

    def replay(self) -> None:
        self._step()


# ---- one cell, any arm --------------------------------------------------------------------
class _Cell:
    """Builds the step of one arm for one cell; subclasses fill ``setup`` and ``step``."""

    def __init__(self, rk: _Rank, cfg, cell: Dict[str, Any], seed: int):
        self.rk, self.cfg, self.cell, self.seed = rk, cfg, cell, seed
        self.T = cell["tokens"]
        self.bucket = self.T
        self.receive_layout = cell.get("receive_layout", "experts")
        self.out = None
        self.extra: Dict[str, Any] = {}

    def setup(self) -> None:
        rk = self.rk
        if rk.is_attention:
            got = ref.make_inputs(self.cfg, self.T, self.cell["routing"], seed=self.seed,
                                  a=rk.index, device=rk.device)
            self.x, self.ids, self.w, self.sc = got
            rows = reply_rows(self.cfg, self.ids, self.receive_layout)
            self.want = expected_output(self.x, rows)
            reach = ref.tokens_per_ffn(self.cfg, self.ids).sum(dim=0)
            self.extra["reach_tokens"] = [int(r) for r in reach]  # tokens to each FFN index
            self.extra["rows"] = int(served_rows(self.cfg, self.ids).sum())  # expert rows

    def step(self):  # pragma: no cover - GPU only
        raise NotImplementedError

    def check(self) -> Optional[float]:
        if not self.rk.is_attention or self.out is None:
            return None
        return output_error(self.out, self.want)

    def release(self) -> None:
        for name in list(vars(self)):
            if name not in ("rk", "cfg", "cell", "seed", "T", "bucket", "receive_layout",
                            "extra"):
                setattr(self, name, None)


#: What the FFN runs between receive and reply in an afdep cell: "copy" (stand_in_expert, the
#: expert of every arm) or "none" (benchmarks.trace's diagnostic: the reply sends the cell's
#: reply tensor as it is, so the FFN's gap is the transport kernels' own launch gap)
STAND_INS = ("copy", "none")


class _AfdepCell(_Cell):
    def __init__(self, rk, cfg, cell, seed, buf, zero_copy=False, stand_in="copy"):
        if stand_in not in STAND_INS:
            raise ValueError(f"stand_in must be one of {STAND_INS}, got {stand_in!r}")
        super().__init__(rk, cfg, cell, seed)
        self.buf = buf
        self.zero_copy = bool(zero_copy) and cfg.ffn_ranks == 1
        self.stand_in = stand_in

    def setup(self):
        super().setup()
        if not self.rk.is_attention:
            cfg = self.cfg
            n = (cfg.token_rows(self.bucket) if cfg.receive_layout == "tokens"
                 else cfg.recv_rows(self.bucket))
            self.reply = tx.new_reply(n, cfg.hidden_size, self.rk.device)

    def step(self):
        buf = self.buf
        if self.rk.is_attention:
            buf.source_dispatch(self.x, self.ids, self.w, self.bucket, x_scales=self.sc)
            self.out = buf.source_collect(zero_copy=self.zero_copy)
        else:
            rec = buf.worker_receive(self.bucket)  # Received or TokenReceived (the layout's)
            rows = self.reply if self.stand_in == "none" else tx.stand_in_expert(self.reply,
                                                                                 rec.x)
            buf.worker_reply(rows, rec.receipt)
        # the kernel forms this rank's launches ran (the CUDA transport's; the last step is the
        # one the graph captured): [dispatch or receive, collect or reply]
        forms = getattr(buf.transport, "last_forms", None)
        if forms is not None:
            self.extra["kernel_forms"] = list(forms)


class _NcclCell(_Cell):
    """The expert layout's contract from all_to_all_single + torch ops
    (benchmarks.torch_exchange)."""

    def setup(self):
        super().setup()
        rk, cfg, T = self.rk, self.cfg, self.bucket
        self.lay = tx.row_layout(cfg.hidden_size, cfg.dtype, cfg.top_k)
        H, A, F, W = cfg.hidden_size, cfg.attention_ranks, cfg.ffn_ranks, rk.world
        dev = rk.device
        self.zero = [0] * W
        self.to_ffn = tx.splits(rk.roles, "ffn", T)
        self.to_att = tx.splits(rk.roles, "attention", T)
        if rk.is_attention:
            self.send = tx.new_send_buffer(self.lay, F, T, dev)
            self.recv_d = torch.empty(0, self.lay.row_bytes, dtype=torch.uint8, device=dev)
            self.send_c = torch.empty(0, H, dtype=torch.bfloat16, device=dev)
            self.recv_c = torch.empty(F * T, H, dtype=torch.bfloat16, device=dev)
        else:
            self.recv = torch.empty(A * T, self.lay.row_bytes, dtype=torch.uint8, device=dev)
            self.send_d = torch.empty(0, self.lay.row_bytes, dtype=torch.uint8, device=dev)
            self.recv_c0 = torch.empty(0, H, dtype=torch.bfloat16, device=dev)
            self.sources = torch.tensor(rk.att_ranks, dtype=torch.int32, device=dev)
            self.reply = tx.new_reply(self.reply_rows(), H, dev)
        self.extra["row_bytes"] = self.lay.row_bytes

    def reply_rows(self) -> int:
        return self.cfg.recv_rows(self.bucket)

    def step(self):
        rk, cfg, T = self.rk, self.cfg, self.bucket
        if rk.is_attention:
            tx.pack_dispatch(self.send, self.lay, self.x, self.ids, self.w, self.sc)
            dist.all_to_all_single(self.recv_d, self.send.view(-1, self.lay.row_bytes),
                                   self.zero, self.to_ffn)
            dist.all_to_all_single(self.recv_c, self.send_c, self.to_ffn, self.zero)
            self.out = tx.collect(self.recv_c.view(cfg.ffn_ranks, T, cfg.hidden_size), T)
        else:
            dist.all_to_all_single(self.recv, self.send_d, self.to_att, self.zero)
            got = tx.unpack(self.recv, self.lay)
            ex = tx.expand(got, rk.index, cfg.experts_per_rank, cfg.rows_per_token, T,
                           self.sources)
            rows = tx.stand_in_expert(self.reply, ex.x)  # the same expert as every arm
            reply = tx.reduce_rows(rows, ex.row_token, cfg.attention_ranks * T)
            dist.all_to_all_single(self.recv_c0, reply, self.zero, self.to_att)


class _NcclTokenCell(_NcclCell):
    """The token layout's contract from all_to_all_single + torch ops: the FFN rank gets one
    row per (token, FFN rank) with its local ids in column order (``tx.token_view``) and
    replies one row per token, no reduction; the Attention rank sums the rows of the FFN
    ranks each token reached (``tx.collect_tokens``)."""

    def reply_rows(self) -> int:
        return self.cfg.attention_ranks * self.bucket

    def step(self):
        rk, cfg, T = self.rk, self.cfg, self.bucket
        if rk.is_attention:
            tx.pack_dispatch(self.send, self.lay, self.x, self.ids, self.w, self.sc)
            reach = ref.tokens_per_ffn(cfg, self.ids)
            dist.all_to_all_single(self.recv_d, self.send.view(-1, self.lay.row_bytes),
                                   self.zero, self.to_ffn)
            dist.all_to_all_single(self.recv_c, self.send_c, self.to_ffn, self.zero)
            self.out = tx.collect_tokens(self.recv_c.view(cfg.ffn_ranks, T, cfg.hidden_size),
                                         reach)
        else:
            dist.all_to_all_single(self.recv, self.send_d, self.to_att, self.zero)
            got = tx.token_view(tx.unpack(self.recv, self.lay), rk.index,
                                cfg.experts_per_rank, T, self.sources)
            self.received = got  # the whole contract is built, whether the expert reads it
            reply = tx.stand_in_expert(self.reply, got.x)
            dist.all_to_all_single(self.recv_c0, reply, self.zero, self.to_att)


class _BareCell(_Cell):
    """One all_to_all_single each way: T x H payload per (Attention, FFN) pair in dispatch,
    T x H BF16 back; no packing, no permutation, no reduction."""

    def setup(self):
        rk, cfg, T = self.rk, self.cfg, self.bucket
        H, A, F, W = cfg.hidden_size, cfg.attention_ranks, cfg.ffn_ranks, rk.world
        dev = rk.device
        db = H * (1 if cfg.dtype == torch.float8_e4m3fn else 2)
        cb = 2 * H
        self.zero = [0] * W
        self.to_ffn = tx.splits(rk.roles, "ffn", T)
        self.to_att = tx.splits(rk.roles, "attention", T)
        u8 = torch.uint8
        if rk.is_attention:
            g = torch.Generator(device=dev).manual_seed(self.seed + 7 * rk.index)
            self.send_d = torch.randint(0, 120, (F * T, db), dtype=u8, device=dev, generator=g)
            self.recv_d = torch.empty(0, db, dtype=u8, device=dev)
            self.send_c = torch.empty(0, cb, dtype=u8, device=dev)
            self.recv_c = torch.empty(F * T, cb, dtype=u8, device=dev)
            self.extra["reach_tokens"] = [T] * F
        else:
            self.recv_d = torch.empty(A * T, db, dtype=u8, device=dev)
            self.send_d = torch.empty(0, db, dtype=u8, device=dev)
            self.send_c = torch.zeros(A * T, cb, dtype=u8, device=dev)
            self.recv_c = torch.empty(0, cb, dtype=u8, device=dev)

    def step(self):
        rk = self.rk
        if rk.is_attention:
            dist.all_to_all_single(self.recv_d, self.send_d, self.zero, self.to_ffn)
            dist.all_to_all_single(self.recv_c, self.send_c, self.to_ffn, self.zero)
        else:
            dist.all_to_all_single(self.recv_d, self.send_d, self.to_att, self.zero)
            dist.all_to_all_single(self.recv_c, self.send_c, self.zero, self.to_att)


def _inject(spec: Dict[str, Any], rk: _Rank, index: int, phase: str) -> None:
    """Test hook: raise where spec['inject'] names (arm, cell index, rank, phase)."""
    for inj in spec.get("inject") or ():
        if not (inj.get("arm") in (None, rk.arm) and inj.get("index") == index
                and inj.get("rank") == rk.rank):
            continue
        if inj.get("phase") == "hang" and phase == "setup":
            time.sleep(1e6)  # a rank that stops making progress (the stall watchdog's case)
        if inj.get("phase") == phase:
            raise RuntimeError(f"injected failure ({rk.arm}, cell {index}, rank {rk.rank}, "
                               f"{phase})")


def _run_cell(rk: _Rank, cell_obj: _Cell, spec: Dict[str, Any], rec: Dict[str, Any],
              index: int = -1) -> bool:
    """Run one cell through its phases; fills ``rec``. Returns False when the world must
    stop (a failure after communication began)."""
    phase = "setup"
    graph = None
    try:
        err = None
        try:
            _inject(spec, rk, index, "setup")
            cell_obj.setup()
        except Exception as e:  # noqa: BLE001
            err = _err(e)
        err = rk.agree(err)
        if err is not None:
            rec.update(status="failed", phase=phase, error=err)
            return True  # nothing was exchanged: the next cell can run

        phase = "eager"
        err = None
        try:
            _inject(spec, rk, index, "eager")
            for _ in range(spec["eager_steps"]):
                cell_obj.step()
            rk.sync()
            rel = cell_obj.check()
            if rel is not None:
                rec["eager_rel_err"] = rel
            phase = "capture"
            rec["graph"] = rk.cuda and rk.arm not in (spec.get("eager_arms") or ())
            if rec["graph"]:
                graph = torch.cuda.CUDAGraph()
                # thread_local: NCCL's watchdog thread may query events while we capture.
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    cell_obj.step()
                torch.cuda.synchronize()
            else:
                graph = _EagerGraph(cell_obj.step)
        except Exception as e:  # noqa: BLE001
            err = _err(e)
        err = rk.agree(err)
        if err is not None:
            rec.update(status="failed", phase=phase, error=err)
            return False

        phase = "replay"
        err = None
        samples: List[float] = []
        try:
            fail_at = -1
            try:
                _inject(spec, rk, index, "replay")
            except RuntimeError:
                fail_at = spec["warmup"] + spec["replays"] // 2
            t0 = time.perf_counter()
            samples = _time_graph(rk, graph, spec["warmup"], spec["replays"], fail_at,
                                  spec.get("attention_delay_us", 0.0) * 1e-6,
                                  spec.get("queue_ahead_us", 0.0))
            rec["replay_wall_s"] = time.perf_counter() - t0
            rel = cell_obj.check()
            if rel is not None:
                rec["graph_rel_err"] = rel
            afdep_buf = getattr(cell_obj, "buf", None)
            if afdep_buf is not None:
                afdep_buf.transport.check_error()
        except Exception as e:  # noqa: BLE001
            err = _err(e)
        err = rk.agree(err)
        if err is not None:
            rec.update(status="failed", phase=phase, error=err)
            return False
        rec["status"] = "ok"
        if rk.is_attention:
            rec.update(stats.summarize_samples(samples))
            bad = [k for k in ("eager_rel_err", "graph_rel_err")
                   if rec.get(k) is not None and not rec[k] < spec["check_tol"]]
            if bad:
                rec["status"] = "wrong"
                rec["error"] = (f"output differs from the expected sum of expert rows "
                                f"({', '.join(f'{k}={rec[k]:.3g}' for k in bad)})")
        return True
    finally:
        rec.update(cell_obj.extra)
        cell_obj.release()
        del graph  # frees the graph's memory pool; gc runs once per (hidden, dtype) group
        rk.sync()


def _afdep_cells(rk: _Rank, spec, groups, emit) -> None:
    import torch_afdep

    rtt = _flag_rtt(rk) if rk.cuda and spec.get("flag_probe", True) else None
    for (receive_layout, hidden, dtype), cells in groups:
        cfg = rk.config(hidden, dtype, receive_layout)
        info: Dict[str, Any] = {}
        buf = None
        err = None
        try:
            buf = torch_afdep.Buffer(None, cfg, device=rk.device)
            t = buf.transport
            info = {"registered_bytes": getattr(t, "registered_bytes", None),
                    "union_bytes": getattr(t, "union_bytes", None),
                    "flags": getattr(t, "flags", None),
                    # CTAs of the FFN's receive/reply and the Attention's combine kernels
                    # (senders use spec["sms"])
                    "ffn_grid": getattr(t, "ffn_grid", None),
                    "attn_grid": getattr(t, "attn_grid", None),
                    "flag_rtt_us": rtt}
        except Exception as e:  # noqa: BLE001
            err = _err(e)
        err = rk.agree(err)
        if err is not None:
            for idx, cell in cells:
                emit(idx, cell, {"status": "failed", "phase": "buffer", "error": err})
            if buf is not None:
                _close_quietly(buf)
            continue
        try:
            for idx, cell in cells:
                if rk.aborted:
                    emit(idx, cell, {"status": "not_run", "error": rk.aborted})
                    continue
                rec = dict(info)
                seed = cell_seed(spec["seed"], spec["repeat"], idx)
                c = _AfdepCell(rk, cfg, cell, seed, buf, spec.get("zero_copy", False))
                go_on = _run_cell(rk, c, spec, rec, idx)
                emit(idx, cell, rec)
                if not go_on:
                    rk.aborted = f"world stopped after cell {cell_key(cell)} failed"
        finally:
            gc.collect()
            if not rk.aborted:
                buf.close()  # collective; after an abort the peers' state is unknown, so
                #              the buffer is left to process exit


def _flag_rtt(rk: _Rank) -> Optional[float]:
    """Flag round trip between the first Attention and the first FFN rank (the latency term
    of the data-movement floor), on a small buffer of its own so a failure here cannot touch
    the measured one. Collective (every rank creates and closes the buffer); µs on the first
    Attention rank, None elsewhere, or where it fails (logged)."""
    import torch_afdep
    from torch_afdep.config import Config

    a0 = rk.att_ranks[0]
    f0 = next(r for r, role in enumerate(rk.roles) if role == "ffn")
    cfg = Config(capacity_tokens_per_rank=8, hidden_size=128, num_experts=rk.spec["experts"],
                 top_k=rk.spec["top_k"], ffn_ranks=rk.F, attention_ranks=rk.A,
                 num_sms=1, timeout_s=float(rk.spec["kernel_timeout_s"]), num_slots=1)
    out, err = None, None
    try:  # collective: a bad config raises the same error on every rank
        buf = torch_afdep.Buffer(None, cfg, device=rk.device)
    except Exception as e:  # noqa: BLE001
        rk.write({"kind": "probe_error", "error": _err(e)})
        return None
    try:
        t = buf.transport
        if rk.rank in (a0, f0) and hasattr(t, "flag_round_trip_us"):
            peer = f0 if rk.rank == a0 else a0
            out = t.flag_round_trip_us(peer, initiator=rk.rank == a0)
    except Exception as e:  # noqa: BLE001
        err = _err(e)
        rk.write({"kind": "probe_error", "error": err})
    finally:
        try:
            buf.close()
        except Exception as e:  # noqa: BLE001
            rk.write({"kind": "probe_error", "error": _err(e)})
    return out


def _close_quietly(buf) -> None:
    try:
        buf.close()
    except Exception:
        pass


def _nccl_cells(rk: _Rank, spec, groups, emit) -> None:
    for (receive_layout, hidden, dtype), cells in groups:
        cfg = rk.config(hidden, dtype, receive_layout)
        if spec["arm"] == "nccl_bare":
            kind = _BareCell
        else:
            kind = _NcclTokenCell if receive_layout == "tokens" else _NcclCell
        for idx, cell in cells:
            if rk.aborted:
                emit(idx, cell, {"status": "not_run", "error": rk.aborted})
                continue
            seed = cell_seed(spec["seed"], spec["repeat"], idx)
            rec: Dict[str, Any] = {}
            go_on = _run_cell(rk, kind(rk, cfg, cell, seed), spec, rec, idx)
            emit(idx, cell, rec)
            if not go_on:
                rk.aborted = f"world stopped after cell {cell_key(cell)} failed"
        gc.collect()


def group_cells(cells: List[Dict[str, Any]], indices: Optional[List[int]] = None):
    """[((receive_layout, hidden, dtype), [(index, cell), ...]), ...] in first-seen order,
    over the cells named by ``indices`` (default: all)."""
    groups: Dict[Any, List] = {}
    for i in (range(len(cells)) if indices is None else indices):
        c = cells[i]
        key = (c.get("receive_layout", "experts"), c["hidden"], c["dtype"])
        groups.setdefault(key, []).append((i, c))
    return list(groups.items())


def world_main(rank: int, world_size: int, spec: Dict[str, Any]) -> Dict[str, Any]:
    """Body of one spawned rank: every cell of ``spec['cells']`` for ``spec['arm']``."""
    t_start = time.perf_counter()
    rk = _Rank(rank, world_size, spec)
    meta = {"kind": "meta", "arm": rk.arm, "repeat": spec["repeat"], "pid": os.getpid(),
            "device": str(rk.device),
            "gpu": torch.cuda.get_device_name(rk.device) if rk.cuda else None,
            "env": common.recorded_env()}
    from torch_afdep import env

    meta["afdep_flags_env"] = env.current().flags
    rk.write(meta)

    def emit(idx, cell, rec):
        out = {"kind": "cell", "index": idx, "key": cell_key(cell)}
        out.update(rec)
        rk.write(out)

    try:
        groups = group_cells(spec["cells"], spec.get("indices"))
        if spec["arm"] in AFDEP_ARMS:
            _afdep_cells(rk, spec, groups, emit)
        else:
            _nccl_cells(rk, spec, groups, emit)
    finally:
        # CUDA graphs holding NCCL kernels must be gone before the communicator is
        # destroyed (spawn_world destroys the group after this returns).
        gc.collect()
        rk.sync()
        if not rk.aborted:
            try:
                dist.barrier(group=rk.ctrl)
            except Exception:
                pass
        rk.write({"kind": "end", "wall_s": time.perf_counter() - t_start,
                  "aborted": rk.aborted})
        rk.close()
    return {"rank": rank, "aborted": rk.aborted}
