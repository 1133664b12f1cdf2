"""Spawned-world bodies that drive ``CudaTransport`` directly (the transport tests: eager
exchanges under each protocol control, graph replays, zero-copy views, timeouts, registered
bytes, killed and skipping ranks). Each exchange is checked with ``checks`` against
``torch_afdep.reference`` (fp64 on the CPU); inputs come from a seed, so every rank rebuilds
every Attention rank's inputs and the FFN ranks check what they received.

The contract through the public API (Buffer, afd_*) on CUDA is tested by tests/contract.
"""

from __future__ import annotations

import os
import time
import traceback

import torch
import torch.distributed as dist

from torch_afdep import env
from torch_afdep import reference as ref
from torch_afdep.config import FFN, Config
from torch_afdep.testing import load_rank_record, save_rank_record

from .checks import check_attention as _check_attention
from .checks import check_received, ffn_rows, scale_expert


def make_config(kw) -> Config:
    kw = dict(kw)
    if isinstance(kw.get("dtype"), str):
        kw["dtype"] = getattr(torch, kw["dtype"])
    if isinstance(kw.get("roles"), str):
        from torch_afdep.config import parse_roles

        kw["roles"] = parse_roles(kw["roles"])
    return Config(**kw)


def make_inputs(cfg, a: int, tokens: int, routing: str, seed: int, bad_ids: bool = False):
    """Attention index a's host inputs for one exchange (identical on every rank for a seed);
    ``bad_ids``: two entries out of range. Ids are int32 for odd ``a + seed``."""
    x, ids, w, scales = ref.make_inputs(cfg, tokens, routing, seed, a)
    if bad_ids and tokens > 0:
        ids = ids.clone()
        ids[tokens // 2, 0] = cfg.num_experts + 5
        if cfg.top_k > 1:
            ids[tokens - 1, 1] = -3
    if (a + seed) % 2 == 1:
        ids = ids.to(torch.int32)  # both id dtypes
    return x, ids, w, scales


class FfnOutputs:
    def __init__(self, cfg, bucket, device):
        A, R, H = cfg.attention_ranks, cfg.rows_per_token, cfg.hidden_size
        rows = A * bucket * R
        self.bucket = bucket
        self.x = torch.empty(rows, H, dtype=cfg.dtype, device=device)
        self.x_scales = torch.empty(rows, cfg.scale_cols, dtype=torch.float32, device=device)
        self.weights = torch.empty(rows, dtype=torch.float32, device=device)
        self.offsets = torch.empty(cfg.experts_per_rank + 1, dtype=torch.int32, device=device)
        self.src_rank = torch.empty(rows, dtype=torch.int32, device=device)
        self.src_token = torch.empty(rows, dtype=torch.int32, device=device)
        self.token_rows = torch.empty(A, bucket, R, dtype=torch.int32, device=device)
        self.token_index = torch.empty(A, bucket, dtype=torch.int32, device=device)
        self.num_tokens = torch.empty(A, dtype=torch.int32, device=device)

    def poison(self):
        self.x.view(torch.uint8).fill_(0xFF)
        self.x_scales.fill_(float("nan"))
        self.weights.fill_(float("nan"))
        for t in (self.offsets, self.src_rank, self.src_token, self.token_rows,
                  self.token_index, self.num_tokens):
            t.fill_(-7)

    def receive(self, t):
        t.receive(self.bucket, self.x, self.x_scales if self.x_scales.shape[1] else None,
                  self.weights, self.offsets, self.src_rank, self.src_token, self.token_rows,
                  self.token_index, self.num_tokens)


def check_ffn(cfg, f, o: FfnOutputs, inputs) -> None:
    """Everything FFN index f received (a transport's outputs), against every source."""
    check_received(cfg, f, o, inputs)


def check_attention(cfg, x, ids, w, sc, route, out, tol=1.5e-2, previous=None) -> float:
    """One Attention rank's route and output of ``ffn_rows``'s expert (1 + e/E)."""
    return _check_attention(cfg, (x, ids, w, sc), out, route, expert=scale_expert(cfg),
                            tol=tol, previous=previous)


def _transport(cfg, rank):
    from torch_afdep.transport.cuda import CudaTransport

    return CudaTransport(cfg, rank, torch.device("cuda", torch.cuda.current_device()),
                         dist.group.WORLD)


def flag_round_trip_body(rank, world, cfg_kw, calls):
    """The flag ping-pong probe between group ranks 0 and 1 (the benchmarks' floor term),
    ``calls`` times in a row (the ping values keep growing across calls); then one exchange
    on the same transport still checks exactly."""
    cfg = make_config(cfg_kw)
    t = _transport(cfg, rank)
    try:
        out = [t.flag_round_trip_us(1 - rank, initiator=rank == 0, iters=200, warmup=20)
               for _ in range(calls)]
        t.check_error()
        return out
    finally:
        t.close()


def _delay_cycles(name):
    ms = float(env.get(name))
    return int(ms * 2e6)  # about 2 GHz SM clock: a rough delay is enough


def exchanges_body(rank, world, cfg_kw, plan, seed0, bad_ids=False, view=False):
    """plan: list of (bucket, [T per Attention rank], routing). Returns per-rank stats.
    ``view``: Attention ranks collect with ``combine_view`` (one FFN rank; no copy), after
    poisoning the whole receive-buffer view with NaN before each dispatch."""
    cfg = make_config(cfg_kw)
    dev = torch.device("cuda", torch.cuda.current_device())
    t = _transport(cfg, rank)
    # "forms": the kernel forms this rank's launches ran, per phase (0: dispatch or receive,
    # 1: reply or collect), so that a test of a path can assert that its form ran
    stats = {"registered_bytes": t.registered_bytes, "union_bytes": t.union_bytes,
             "role": cfg.role_of(rank), "errors": [], "flags": t.flags, "forms": [set(), set()]}
    role, idx = cfg.role_of(rank), cfg.role_index(rank)
    # Diagnostics: a GPU-side delay (stream order kept) before the FFN's reply or before the
    # Attention's combine tells a receiver that reads too early from one that reads wrong data.
    delay_reply = _delay_cycles("AFDEP_TEST_REPLY_DELAY_MS")
    delay_combine = _delay_cycles("AFDEP_TEST_COMBINE_DELAY_MS")
    delay_dispatch = _delay_cycles("AFDEP_TEST_DISPATCH_DELAY_MS")
    inputs_prev = None
    view_out = None
    try:
        for i, (bucket, tokens, routing) in enumerate(plan):
            seed = seed0 + i
            inputs = [make_inputs(cfg, a, tokens[a], routing, seed, bad_ids)
                      for a in range(cfg.attention_ranks)]
            if role == FFN:
                o = FfnOutputs(cfg, bucket, dev)
                o.poison()
                o.receive(t)
                rows = ffn_rows(cfg, idx, o.x, o.x_scales if cfg.scale_cols else None,
                                o.weights, o.offsets)
                if delay_reply:
                    torch.cuda._sleep(delay_reply)
                stats["forms"][0].add(t.last_forms[0])
                t.reply(rows, o.token_rows, o.token_index, o.num_tokens)
                stats["forms"][1].add(t.last_forms[1])
                torch.cuda.synchronize()
                t.check_error()
                check_ffn(cfg, idx, o, inputs)
                tr = t.trace()
                if tr is not None:  # AFDEP_TRACE=1: (tokens received, count table stamped)
                    from benchmarks.trace import TABLE  # the trace point's index

                    stamps, (n_disp, _) = tr
                    table = bool(stamps[n_disp % stamps.shape[0], 0, TABLE] != 0)
                    stats.setdefault("tables", []).append((int(o.num_tokens.sum()), table))
            else:
                x, ids, w, sc = inputs[idx]
                T = x.shape[0]
                route = torch.full((T,), -7, dtype=torch.int64, device=dev)
                out = torch.full((T, cfg.hidden_size), float("nan"), dtype=torch.bfloat16,
                                 device=dev)
                if view_out is not None:  # rows the FFN or the zeroing must rewrite
                    view_out.fill_(float("nan"))
                xd, idd, wd = x.to(dev), ids.to(dev), w.to(dev)
                scd = None if sc is None else sc.to(dev)
                if delay_dispatch:
                    torch.cuda._sleep(delay_dispatch)
                t.dispatch(xd, idd, wd, scd, bucket, route)
                stats["forms"][0].add(t.last_forms[0])
                if delay_combine:
                    torch.cuda._sleep(delay_combine)
                if view:
                    out = t.combine_view(route)
                    view_out = t._view  # the whole [C, H] buffer, poisoned next time
                else:
                    t.combine(route, out)
                stats["forms"][1].add(t.last_forms[1])
                torch.cuda.synchronize()
                try:
                    t.check_error()
                except Exception as e:  # noqa: BLE001
                    if not bad_ids:
                        raise
                    stats["errors"].append(type(e).__name__)
                try:
                    err = check_attention(cfg, x, ids, w, sc, route, out,
                                          previous=inputs_prev)
                except AssertionError as e:
                    raise AssertionError(f"exchange {i} (bucket {bucket}, tokens {tokens}, "
                                         f"{routing}): {e}") from None
                stats.setdefault("rel_err", []).append(err)
                inputs_prev = inputs[idx]
    finally:
        t.close()
    return stats


def view_exchanges_body(rank, world, cfg_kw, plan, seed0, bad_ids=False):
    """``exchanges_body`` with zero-copy collects (``CudaTransport.combine_view``)."""
    return exchanges_body(rank, world, cfg_kw, plan, seed0, bad_ids, view=True)


def graph_body(rank, world, cfg_kw, bucket, tokens, replays, seed0, routing="partial",
               forms=False):
    """Capture one exchange per rank in a CUDA graph; replay with fresh inputs each time.
    Returns the replays checked, with ``forms`` also the captured launches' kernel forms
    (dispatch or receive, reply or collect) and the transport's control flags."""
    cfg = make_config(cfg_kw)
    dev = torch.device("cuda", torch.cuda.current_device())
    t = _transport(cfg, rank)
    role, idx = cfg.role_of(rank), cfg.role_index(rank)
    checked = 0
    try:
        if role == FFN:
            o = FfnOutputs(cfg, bucket, dev)

            def step():
                o.receive(t)
                rows = ffn_rows(cfg, idx, o.x, o.x_scales if cfg.scale_cols else None,
                                o.weights, o.offsets)
                t.reply(rows, o.token_rows, o.token_index, o.num_tokens)

            # eager warm-up exchange (pairs with the Attention ranks' one)
            o.poison()
            step()
            torch.cuda.synchronize()
            t.check_error()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            captured = t.last_forms
            dist.barrier()
            for i in range(replays):
                inputs = [make_inputs(cfg, a, tokens[a], routing, seed0 + i)
                          for a in range(cfg.attention_ranks)]
                o.poison()
                g.replay()
                torch.cuda.synchronize()
                t.check_error()
                check_ffn(cfg, idx, o, inputs)
                checked += 1
        else:
            T = tokens[idx]
            x0, ids0, w0, sc0 = make_inputs(cfg, idx, T, routing, seed0 - 1)
            xs = x0.to(dev)
            ids_s = ids0.to(torch.int64).to(dev)
            ws = w0.to(dev)
            scs = None if sc0 is None else sc0.to(dev)
            route = torch.empty(T, dtype=torch.int64, device=dev)
            out = torch.empty(T, cfg.hidden_size, dtype=torch.bfloat16, device=dev)

            def step():
                t.dispatch(xs, ids_s, ws, scs, bucket, route)
                t.combine(route, out)

            step()
            torch.cuda.synchronize()
            t.check_error()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            captured = t.last_forms
            dist.barrier()
            for i in range(replays):
                x, ids, w, sc = make_inputs(cfg, idx, T, routing, seed0 + i)
                xs.copy_(x)
                ids_s.copy_(ids.to(torch.int64))
                ws.copy_(w)
                if sc is not None:
                    scs.copy_(sc)
                route.fill_(-7)
                out.fill_(float("nan"))
                g.replay()
                torch.cuda.synchronize()
                t.check_error()
                check_attention(cfg, x, ids, w, sc, route, out)
                checked += 1
    finally:
        t.close()
    return (checked, captured, t.flags) if forms else checked


def timeout_body(rank, world, cfg_kw):
    """One side never sends: the waiting rank raises AfdepTimeoutError within the timeout."""
    from torch_afdep.errors import AfdepTimeoutError

    cfg = make_config(cfg_kw)
    dev = torch.device("cuda", torch.cuda.current_device())
    t = _transport(cfg, rank)
    res = {}
    try:
        if cfg.role_of(rank) == FFN:
            o = FfnOutputs(cfg, 8, dev)
            t0 = time.monotonic()
            o.receive(t)  # no Attention rank dispatches
            torch.cuda.synchronize()
            res["elapsed"] = time.monotonic() - t0
            try:
                t.check_error()
                res["raised"] = None
            except AfdepTimeoutError as e:
                res["raised"] = ("dispatch", e.phase, e.peer, e.rank)
            dist.barrier()
        else:
            dist.barrier()
            route = torch.zeros(0, dtype=torch.int64, device=dev)
            out = torch.zeros(3, cfg.hidden_size, dtype=torch.bfloat16, device=dev)
            route = torch.ones(3, dtype=torch.int64, device=dev)
            t0 = time.monotonic()
            t.combine(route, out)  # no FFN rank replies
            torch.cuda.synchronize()
            res["elapsed"] = time.monotonic() - t0
            try:
                t.check_error()
                res["raised"] = None
            except AfdepTimeoutError as e:
                res["raised"] = ("combine", e.phase, e.peer, e.rank)
    finally:
        t.close()
    return res


def sizes_body(rank, world, cfg_kw):
    cfg = make_config(cfg_kw)
    t = _transport(cfg, rank)
    try:
        return {"role": cfg.role_of(rank), "registered_bytes": t.registered_bytes,
                "union_bytes": t.union_bytes, "signal_bytes": t.signal_bytes}
    finally:
        t.close()


# ---- fault bodies ---------------------------------------------------------------------------
_save = save_rank_record


def load_record(outdir: str, rank: int) -> dict:
    return load_rank_record(outdir, rank, missing={})


KILL_TIMEOUT_S = 3.0  # timeout_s of the kill worlds
KILL_SLACK_S = 2.0  # how much later than timeout_s a survivor may see its error
KILL_WORLD_TIMEOUT = 240.0  # spawn_world's own limit; a kill world must end well before it


def run_kill_world(body, world, args, outdir, device_ids=None, env=None):
    """Spawn a world in which one rank dies (``body(rank, world, *args)``, recording into
    ``outdir``); returns spawn_world's message, the elapsed time, the children left and every
    rank's record."""
    import multiprocessing

    import pytest

    from torch_afdep.testing import WorldError

    from . import devices

    t0 = time.monotonic()
    with pytest.raises(WorldError) as info:
        devices.spawn_gpu_world(body, world, *args, device_ids=device_ids,
                                env={**devices.GPU_ENV, **(env or {})},
                                timeout=KILL_WORLD_TIMEOUT)
    return {"message": str(info.value), "elapsed": time.monotonic() - t0,
            "children": multiprocessing.active_children(),
            "records": [load_record(outdir, r) for r in range(world)]}


def check_wait(rec, peers, phase) -> None:
    """A survivor's recorded wait: AfdepTimeoutError naming a peer of ``peers``, the phase and
    its own rank, after its whole deadline (no early, spurious error) and not much later."""
    w = rec.get("wait")
    assert w is not None, f"rank {rec.get('rank')} recorded no wait: {rec.get('error', rec)}"
    assert w["type"] == "AfdepTimeoutError", w
    assert w["phase"] == phase and w["peer"] in peers and w["rank"] == rec["rank"], w
    assert f"rank {w['peer']}" in w["message"] and phase in w["message"], w
    assert KILL_TIMEOUT_S - 0.2 <= w["elapsed"] <= KILL_TIMEOUT_S + KILL_SLACK_S, w
    if "after_death" in w:
        assert w["after_death"] <= KILL_TIMEOUT_S + KILL_SLACK_S, w


def check_kill_outcome(w, ffn, att, scenario, healthy=2) -> None:
    """What ``run_kill_world`` returned, for kill_body's two scenarios (any body that records
    the same fields): only the victim failed the world, nothing is left behind, every rank
    checked the healthy exchanges, every survivor raised what its wait allows and closed
    without its peers in < 2 s. ``ffn``, ``att``: the group ranks of each role."""
    victim = ffn[0] if scenario == "ffn_after_receive" else att[0]
    assert f"--- rank {victim} failed:" in w["message"], w["message"]
    assert "process exited with code 1" in w["message"], w["message"]
    survivors = [r for r in sorted(ffn + att) if r != victim]
    for r in survivors:
        assert f"--- rank {r} failed:" not in w["message"], w["message"]
    assert w["children"] == []
    assert w["elapsed"] < KILL_WORLD_TIMEOUT - 60, w["elapsed"]
    recs = w["records"]
    assert recs[victim].get("victim") is True, recs[victim]
    for r in ffn + att:  # the healthy exchanges before the fault were checked everywhere
        assert recs[r].get("healthy", []) == [True] * healthy, recs[r]
    if scenario == "attention_before_collect":
        assert recs[victim].get("saw_ffn_waiting") is True, recs[victim]
    for r in survivors:
        rec = recs[r]
        assert "error" not in rec, rec["error"]
        if scenario == "ffn_after_receive":
            if r in att:
                check_wait(rec, [victim], "combine")
            else:
                assert rec.get("exchange_n") is True, rec
                check_wait(rec, att, "dispatch")
        else:
            if r in ffn:
                check_wait(rec, [victim], "dispatch")
                assert "after_death" in rec["wait"], rec
            else:
                assert rec.get("exchange_n") is True, rec
                check_wait(rec, ffn, "combine")
        assert rec.get("close_s", 99.0) < 2.0, rec


def _touch(path: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(repr(time.time()))
    os.replace(path + ".tmp", path)


def _wait_files(paths, limit: float) -> bool:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if all(os.path.exists(p) for p in paths):
            return True
        time.sleep(0.01)
    return False


class _Exchange:
    """Eager exchanges on one transport, checked on every rank (plain routing)."""

    def __init__(self, cfg, rank, t, dev, bucket=32):
        self.cfg, self.rank, self.t, self.dev, self.bucket = cfg, rank, t, dev, bucket
        self.role, self.idx = cfg.role_of(rank), cfg.role_index(rank)
        self.tokens = [bucket - 3 * a for a in range(cfg.attention_ranks)]
        self.o = FfnOutputs(cfg, bucket, dev) if self.role == FFN else None

    def inputs(self, n):
        return [make_inputs(self.cfg, a, self.tokens[a], "partial", 900 + n)
                for a in range(self.cfg.attention_ranks)]

    def dispatch(self, n):
        x, ids, w, sc = self.inputs(n)[self.idx]
        T = x.shape[0]
        self.route = torch.full((T,), -7, dtype=torch.int64, device=self.dev)
        self.out = torch.full((T, self.cfg.hidden_size), float("nan"), dtype=torch.bfloat16,
                              device=self.dev)
        self.t.dispatch(x.to(self.dev), ids.to(self.dev), w.to(self.dev),
                        None if sc is None else sc.to(self.dev), self.bucket, self.route)

    def combine(self):
        self.t.combine(self.route, self.out)

    def check_attention(self, n):
        torch.cuda.synchronize()
        self.t.check_error()
        x, ids, w, sc = self.inputs(n)[self.idx]
        return check_attention(self.cfg, x, ids, w, sc, self.route, self.out)

    def receive(self):
        self.o.poison()
        self.o.receive(self.t)

    def reply(self):
        o = self.o
        rows = ffn_rows(self.cfg, self.idx, o.x, o.x_scales if self.cfg.scale_cols else None,
                           o.weights, o.offsets)
        self.t.reply(rows, o.token_rows, o.token_index, o.num_tokens)

    def check_ffn(self, n):
        torch.cuda.synchronize()
        self.t.check_error()
        check_ffn(self.cfg, self.idx, self.o, self.inputs(n))
        return True

    def whole(self, n):
        if self.role == FFN:
            self.receive()
            self.reply()
            return self.check_ffn(n)
        self.dispatch(n)
        self.combine()
        return self.check_attention(n)


def _timed_wait(t, t_launch: float, death_file: str = "") -> dict:
    """Synchronize (the waiting kernel ends by itself at its deadline) and read the error."""
    torch.cuda.synchronize()
    now = time.monotonic()
    rec = {"elapsed": now - t_launch, "type": None}
    if death_file and os.path.exists(death_file):
        with open(death_file) as f:
            rec["after_death"] = time.time() - float(f.read())
    try:
        t.check_error()
    except Exception as e:  # noqa: BLE001 (recorded; the test asserts the type)
        rec.update(type=type(e).__name__, message=str(e), peer=getattr(e, "peer", None),
                   phase=getattr(e, "phase", None), rank=getattr(e, "rank", None))
    return rec


def kill_body(rank, world, cfg_kw, outdir, scenario, healthy=2):
    """A rank dies (os._exit) in the middle of an exchange; every survivor's waiting kernel
    must end at its deadline and check_error raise AfdepTimeoutError naming the peer and the
    phase; the survivor then closes without its peers and returns.

    scenario "ffn_after_receive": FFN index 0 dies after receiving exchange n (its reply never
    comes) while the Attention ranks wait in combine; other FFN ranks reply, then wait for an
    exchange n+1 no Attention rank sends.
    scenario "attention_before_collect": Attention index 0 dispatches exchange n and dies
    before its collect, once every FFN rank replied to n and is waiting in receive n+1; the
    other Attention ranks collect n and dispatch n+1, then wait in combine n+1."""
    cfg = make_config(cfg_kw)
    dev = torch.device("cuda", torch.cuda.current_device())
    t = _transport(cfg, rank)
    ex = _Exchange(cfg, rank, t, dev)
    role = ex.role
    rec = {"role": role, "rank": rank, "healthy": [], "victim": False}
    _save(outdir, rank, rec)
    death = os.path.join(outdir, "death")
    ffn_ranks, att_ranks = cfg.ffn_group_ranks, cfg.attention_group_ranks
    try:
        for n in range(healthy):
            ex.whole(n)  # raises unless exact
            rec["healthy"].append(True)
        dist.barrier()
        _save(outdir, rank, rec)
        n = healthy
        limit = float(cfg.timeout_s) + 60.0
        if scenario == "ffn_after_receive":
            victim = ffn_ranks[0]
            if rank == victim:
                ex.receive()
                torch.cuda.synchronize()  # every Attention rank's dispatch n arrived
                rec["victim"] = True
                _save(outdir, rank, rec)
                _touch(death)
                os._exit(1)
            if role == FFN:
                ex.receive()
                ex.reply()
                rec["exchange_n"] = ex.check_ffn(n)
                _save(outdir, rank, rec)
                t0 = time.monotonic()
                ex.receive()  # n+1: no Attention rank sends it
                rec["wait"] = _timed_wait(t, t0, death)
            else:
                ex.dispatch(n)
                t0 = time.monotonic()
                ex.combine()
                rec["wait"] = _timed_wait(t, t0, death)
        elif scenario == "attention_before_collect":
            victim = att_ranks[0]
            replied = [os.path.join(outdir, f"waiting{r}") for r in ffn_ranks]
            if rank == victim:
                ex.dispatch(n)
                torch.cuda.synchronize()
                rec["victim"] = True
                rec["saw_ffn_waiting"] = _wait_files(replied, limit)
                _save(outdir, rank, rec)
                time.sleep(0.2)  # the FFN ranks' receive n+1 kernels are spinning by now
                _touch(death)
                os._exit(1)
            if role == FFN:
                ex.receive()
                ex.reply()
                torch.cuda.synchronize()  # the reply rows of n landed before the death
                t0 = time.monotonic()
                ex.receive()  # n+1: the victim never dispatches it
                _touch(os.path.join(outdir, f"waiting{rank}"))
                rec["wait"] = _timed_wait(t, t0, death)
            else:
                ex.dispatch(n)
                ex.combine()
                ex.check_attention(n)  # raises unless exact
                rec["exchange_n"] = True
                _save(outdir, rank, rec)
                ex.dispatch(n + 1)
                t0 = time.monotonic()
                ex.combine()  # no FFN rank replies to n+1
                rec["wait"] = _timed_wait(t, t0, death)
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
        _save(outdir, rank, rec)
        t0 = time.monotonic()
        t.close(clean=False)
        rec["close_s"] = time.monotonic() - t0
    except BaseException:
        rec["error"] = traceback.format_exc()
        _save(outdir, rank, rec)
        raise
    finally:
        try:
            t.close(clean=False)
        except Exception:
            pass
    _save(outdir, rank, rec)
    return rec


def skip_body(rank, world, cfg_kw, healthy=3):
    """After ``healthy`` checked exchanges a rank skips its part of the next one (the waiting
    peer's signal slots hold the previous exchange's sequence number, which must not satisfy
    the wait): on transport 1 the Attention rank skips its dispatch (the FFN rank's receive
    times out: peer = Attention, phase dispatch); on transport 2 the FFN rank receives but
    skips its reply (the Attention rank's combine times out: peer = FFN, phase combine).
    Both ranks close cleanly afterwards (both are alive)."""
    cfg = make_config(cfg_kw)
    dev = torch.device("cuda", torch.cuda.current_device())
    role = cfg.role_of(rank)
    out = {"role": role}
    for name in ("skip_dispatch", "skip_reply"):
        t = _transport(cfg, rank)
        ex = _Exchange(cfg, rank, t, dev)
        res = {"healthy": [ex.whole(n) for n in range(healthy)]}
        dist.barrier()
        n = healthy
        if name == "skip_dispatch":
            if role == FFN:
                t0 = time.monotonic()
                ex.receive()
                res["wait"] = _timed_wait(t, t0)
        else:
            if role == FFN:
                ex.receive()
                torch.cuda.synchronize()
                res["received"] = ex.check_ffn(n)  # the exchange arrived; no reply follows
            else:
                ex.dispatch(n)
                t0 = time.monotonic()
                ex.combine()
                res["wait"] = _timed_wait(t, t0)
        t0 = time.monotonic()
        t.close()  # clean: both ranks meet
        res["close_s"] = time.monotonic() - t0
        out[name] = res
    return out
