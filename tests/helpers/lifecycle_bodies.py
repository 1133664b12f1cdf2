"""Spawned-world bodies of the lifecycle and CPU fault tests: the *parts* of a world.

A world runs several *parts* in one pair of processes (spawned worlds are slow to start); each
part's outcome is recorded separately, so one failing part fails one test, and every rank
writes its results to ``outdir/rank<r>.pkl`` as it goes: a rank that is killed on purpose
makes ``spawn_world`` raise ``WorldError``, and the survivor's file is how its report gets out.

Layout of every world: 2 ranks, group rank 0 = FFN, group rank 1 = Attention (1A1F). Every
part gets the rank's device (``lifecycle_world`` takes "cpu" or "cuda"; the fault worlds run
the CPU transport's failure semantics, CUDA's are in tests/gpu).
Exactness: the FFN ranks reply ``bf16((x * (g + 1) * scale) * w)`` per row (g = global
expert, all in fp32); with top_k = 2 a token's reply is the fp32 sum of at most two such rows,
so ``exact_output`` predicts the combined output bit for bit; it is also checked against the
fp64 reference.
"""

from __future__ import annotations

import datetime
import gc
import os
import time
import traceback

import torch
import torch.distributed as dist

import torch_afdep
from torch_afdep import AfdepError, AfdepStateError, Buffer, Config
from torch_afdep import reference as ref
from torch_afdep import env, registry
from torch_afdep.testing import load_rank_record, save_rank_record

from .devices import rank_device, sync

SMALL = dict(capacity_tokens_per_rank=8, hidden_size=128, num_experts=4, top_k=2,
             ffn_ranks=1, attention_ranks=1, timeout_s=30.0)
#: Timeout of the fault scenarios (a survivor must report within this).
FAST_TIMEOUT = 3.0
FFN_RANK, ATTN_RANK = 0, 1


def cfg_of(**kw) -> Config:
    return Config(**{**SMALL, **kw})


def warm_up_process() -> None:
    """The first afdep op call of a process imports torch._dynamo (torch.library's custom-op
    glue), 5-7 s on a 2-core machine. Pay it before any bounded wait, so a peer's
    ``timeout_s`` is not spent on an import."""
    import torch._dynamo  # noqa: F401


# ---- inputs, expert rows, exact model ----------------------------------------------------
def make_inputs(cfg: Config, t: int, seed: int):
    """(x, ids, w) on the host, "partial" routing (some tokens reach no expert)."""
    x, ids, w, _ = ref.make_inputs(cfg, t, "partial", seed)
    return x, ids, w


def ffn_rows(cfg: Config, f: int, rec, scale: float = 1.0) -> torch.Tensor:
    """Row i of local expert e -> bf16((x_i * (g + 1) * scale) * w_i), g = f*E_local + e.

    No host reads of the counts, so it also traces under torch.compile(fullgraph=True)."""
    el = cfg.experts_per_rank
    mult = torch.tensor([(f * el + e + 1) * scale for e in range(el)] + [0.0],
                        dtype=torch.float32, device=rec.x.device)
    idx = torch.arange(rec.x.shape[0], dtype=torch.int32, device=rec.x.device)
    e = torch.searchsorted(rec.expert_offsets[1:].contiguous(), idx, right=True)
    rows = (rec.x.float() * mult[e][:, None]) * rec.weights[:, None]
    return rows.to(torch.bfloat16)


def exact_output(cfg: Config, x, ids, w, scale: float = 1.0) -> torch.Tensor:
    """What source_collect must return, bit for bit (1 FFN rank, top_k <= 2)."""
    ids = ref.dedupe(ids)
    out = torch.zeros(x.shape[0], cfg.hidden_size, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            g = int(ids[t, j])
            if g >= 0:
                row = (x[t].float() * float((g + 1) * scale)) * w[t, j]
                out[t] += row.to(torch.bfloat16).float()
    return out.to(torch.bfloat16)


def check_output(cfg: Config, out, x, ids, w, scale: float = 1.0) -> dict:
    out = out.cpu()
    want = exact_output(cfg, x, ids, w, scale)
    rel = ref.relative_error(out, ref.moe_output(cfg, x, ids, w,
                                                 lambda g, r: r * ((g + 1) * scale)))
    return {"exact": bool(out.shape == want.shape and torch.equal(out, want)), "rel": rel}


def counts_ok(cfg: Config, rec, f: int, ids) -> bool:
    offs = rec.expert_offsets.cpu().to(torch.int64)
    want = ref.expert_counts(cfg, [ids])[f]
    return bool(torch.equal(offs[1:] - offs[:-1], want))


# ---- one exchange, split so the tests can interleave ------------------------------------
def attn_send(buf: Buffer, t: int, seed: int, bucket: int = 8):
    x, ids, w = make_inputs(buf.config, t, seed)
    dev = buf.device
    buf.source_dispatch(x.to(dev), ids.to(dev), w.to(dev), bucket=bucket)
    return x, ids, w


def attn_finish(buf: Buffer, sent, scale: float = 1.0) -> dict:
    out = buf.source_collect()
    sync(buf.device)
    return check_output(buf.config, out, *sent, scale)


def ffn_recv(buf: Buffer, bucket: int = 8):
    return buf.worker_receive(bucket)


def ffn_finish(buf: Buffer, rec, t: int, seed: int, scale: float = 1.0) -> bool:
    _, ids, _ = make_inputs(buf.config, t, seed)
    ok = counts_ok(buf.config, rec, buf.role_index, ids)
    buf.worker_reply(ffn_rows(buf.config, buf.role_index, rec, scale), rec.receipt)
    return ok


def exchange(buf: Buffer, t: int, seed: int, scale: float = 1.0, bucket: int = 8):
    """One whole exchange; Attention returns check_output's dict, FFN its counts check."""
    if buf.role == "attention":
        return attn_finish(buf, attn_send(buf, t, seed, bucket), scale)
    return ffn_finish(buf, ffn_recv(buf, bucket), t, seed, scale)


def expect(exc_type, fn, *args, **kwargs) -> str:
    """Call fn; it must raise exc_type; return 'TypeName: message'."""
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        return f"{type(e).__name__}: {e}"
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc_type.__name__}")


def error_info(e: BaseException, t0: float, death_file: str = "") -> dict:
    info = {"type": type(e).__name__, "message": str(e), "is_afdep": isinstance(e, AfdepError),
            "peer": getattr(e, "peer", None), "phase": getattr(e, "phase", None),
            "rank": getattr(e, "rank", None), "waited": time.monotonic() - t0}
    if death_file and os.path.exists(death_file):
        with open(death_file) as f:
            info["after_death"] = time.time() - float(f.read())
    return info


# ---- running parts ----------------------------------------------------------------------
_save = save_rank_record


def load_results(outdir: str, rank: int) -> dict:
    return load_rank_record(outdir, rank)


def run_parts(rank: int, world: int, outdir: str, parts, device: str = "cpu") -> dict:
    """Run ``parts`` (names of part_* functions here) in order on ``device``; a barrier
    between parts keeps the ranks in step. Each part's value or traceback is saved after it
    ran."""
    warm_up_process()
    dev = rank_device(device)
    results = {}
    _save(outdir, rank, results)
    for n, name in enumerate(parts):
        t0 = time.monotonic()
        try:
            value = globals()["part_" + name](rank, world, outdir, dev)
            results[name] = {"ok": True, "value": value}
        except BaseException:
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["seconds"] = time.monotonic() - t0
        _save(outdir, rank, results)
        if n + 1 < len(parts):  # (a last part may have lost its peer on purpose)
            dist.barrier()
    results["registry_at_end"] = sorted(registry._BUFFERS)
    _save(outdir, rank, results)
    return results


# ---- lifecycle parts ----------------------------------------------------------------------
def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _live(cls) -> int:
    return sum(1 for o in gc.get_objects() if type(o) is cls)


#: Buffers of the leak part per device: (warm-up, counted, exchange every, record every).
#: On CUDA every buffer registers and maps device memory (slower); AFDEP_TEST_BUFFERS sets
#: the count there.
def leak_plan(dev):
    if dev.type == "cuda":
        return 1, int(env.get("AFDEP_TEST_BUFFERS")), 100, 100
    return 50, 1000, 10, 100


def _transport_class(dev):
    if dev.type == "cuda":
        from torch_afdep.transport.cuda import CudaTransport

        return CudaTransport
    from torch_afdep.transport.cpu import CpuTransport

    return CpuTransport


def part_leak(rank, world, outdir, dev):
    """Create and close ``warmup + count`` buffers (some with a checked exchange); host RSS
    (and free device memory on CUDA) after the warm-up and after each quarter of the rest,
    and what is left alive."""
    warmup, count, every, record = leak_plan(dev)
    cfg = cfg_of()
    results = []

    def one(i):
        with Buffer(None, cfg, device=dev) as buf:
            if i % every == 0:  # some buffers also carry an exchange
                res = exchange(buf, 1 + i % 8, 5000 + i)
                if i % record == 0:
                    results.append(res)

    def free_bytes():
        sync(dev)
        return torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else 0

    for i in range(warmup):
        one(i)
    gc.collect()
    rss, free = [_rss_bytes()], [free_bytes()]
    quarter = max(1, count // 4)
    t0 = time.monotonic()
    for i in range(warmup, warmup + count):
        one(i)
        done = i - warmup + 1
        if done % quarter == 0 or done == count:
            gc.collect()
            rss.append(_rss_bytes())
            free.append(free_bytes())
    seconds = time.monotonic() - t0
    return {"rss": rss, "free": free, "growth": rss[-1] - rss[0], "seconds": seconds,
            "count": count, "warmup": warmup, "live_buffers": _live(Buffer),
            "live_transports": _live(_transport_class(dev)),
            "registry": sorted(registry._BUFFERS), "next_id": registry._NEXT_ID.get(
                dist.group.WORLD.group_name), "checks": results}


def part_close(rank, world, outdir, dev):
    """close() is collective (it waits for the slowest rank) and idempotent; every role method
    after it raises AfdepStateError; the afd_* wrappers no longer find the buffer."""
    cfg = cfg_of()
    buf = Buffer(None, cfg, device=dev)
    key = (buf.group_name, buf.buffer_id)
    first = exchange(buf, 5, 11)
    rec = None
    if buf.role == "ffn":
        rec = ffn_recv(buf)
        ffn_finish(buf, rec, 4, 12)
    else:
        attn_finish(buf, attn_send(buf, 4, 12))
    if rank == FFN_RANK:
        time.sleep(1.0)  # the other rank's close must wait for this one
    t0 = time.monotonic()
    buf.close()
    close_s = time.monotonic() - t0
    in_registry = key in registry._BUFFERS
    t0 = time.monotonic()
    buf.close()  # idempotent: no second collective (the ranks call it a different number
    if rank == ATTN_RANK:  # of times, and nothing waits)
        buf.close()
    again_s = time.monotonic() - t0
    x, ids, w = (t.to(dev) for t in make_inputs(cfg, 3, 13))
    rows = torch.zeros(cfg.recv_rows(8), cfg.hidden_size, dtype=torch.bfloat16, device=dev)
    receipt = rec.receipt if rec is not None else None
    after = {
        "source_dispatch": expect(AfdepStateError, buf.source_dispatch, x, ids, w, bucket=8),
        "source_collect": expect(AfdepStateError, buf.source_collect),
        "worker_receive": expect(AfdepStateError, buf.worker_receive, 8),
        "worker_reply": expect(AfdepStateError, buf.worker_reply, rows, receipt),
    }
    name, bid = buf.group_name, buf.buffer_id
    wrappers = {
        "afd_dispatch": expect(RuntimeError, torch_afdep.afd_dispatch, x, ids, w, group=name,
                               bucket=8, buffer_id=bid),
        "afd_combine": expect(RuntimeError, torch_afdep.afd_combine,
                              torch.zeros(3, dtype=torch.int64, device=dev), group=name,
                              buffer_id=bid),
        "afd_receive": expect(RuntimeError, torch_afdep.afd_receive, group=name, bucket=8,
                              buffer_id=bid),
        "afd_reply": expect(RuntimeError, torch_afdep.afd_reply, rows, receipt, group=name),
    }
    return {"first": first, "close_s": close_s, "again_s": again_s, "closed": buf.closed,
            "in_registry": in_registry, "after": after, "wrappers": wrappers,
            "repr": repr(buf)}


class Boom(Exception):
    pass


def part_context(rank, world, outdir, dev):
    """``with Buffer(...)`` closes the buffer on normal exit and when the body raises (on
    every rank, outside an exchange); a new buffer works afterwards."""
    cfg = cfg_of()
    with Buffer(None, cfg, device=dev) as b1:
        r1 = exchange(b1, 6, 21)
        open_inside = (b1.group_name, b1.buffer_id) in registry._BUFFERS
    key1 = (b1.group_name, b1.buffer_id)
    raised = None
    try:
        with Buffer(None, cfg, device=dev) as b2:
            r2 = exchange(b2, 7, 22)
            raise Boom("body failed")
    except Boom as e:
        raised = str(e)
    key2 = (b2.group_name, b2.buffer_id)
    with Buffer(None, cfg, device=dev) as b3:
        r3 = exchange(b3, 8, 23)
    return {"results": [r1, r2, r3], "open_inside": open_inside,
            "closed": [b1.closed, b2.closed, b3.closed], "raised": raised,
            "left_in_registry": [k for k in (key1, key2) if k in registry._BUFFERS]}


def part_context_abort(rank, world, outdir, dev):
    """The Attention rank's body raises between dispatch and collect (the FFN rank finishes
    its side and leaves its ``with`` normally): both ranks must get out, bounded by timeout_s,
    with the buffer closed. On its own group: the abandoned reply stays queued there."""
    group = dist.new_group([0, 1])
    cfg = cfg_of(timeout_s=FAST_TIMEOUT)
    t0 = time.monotonic()
    buf = None
    outcome = None
    try:
        with Buffer(group, cfg, device=dev) as buf:
            if buf.role == "attention":
                attn_send(buf, 5, 31)
                raise Boom("attention body failed mid-exchange")
            rec = ffn_recv(buf)
            ffn_finish(buf, rec, 5, 31)
    except BaseException as e:
        outcome = {"type": type(e).__name__, "message": str(e),
                   "context": type(e.__context__).__name__ if e.__context__ else None}
    return {"outcome": outcome, "seconds": time.monotonic() - t0,
            "closed": buf is not None and buf.closed}


MISMATCHES = [
    ("capacity_tokens_per_rank", {"capacity_tokens_per_rank": 16}),
    ("hidden_size", {"hidden_size": 256}),
    ("top_k", {"top_k": 1}),
    ("num_experts", {"num_experts": 8}),
    ("dtype", {"dtype": torch.float8_e4m3fn}),
    ("roles", {"roles": ("attention", "ffn")}),
]


def part_mismatch(rank, world, outdir, dev):
    """Configs that differ across ranks: each detected at construction, the same error on
    every rank, promptly; then a matching buffer works (and got the same id everywhere).
    Last, A/F counts that differ (so the world size differs): recorded, not asserted here."""
    out = {}
    for field, change in MISMATCHES:
        base = {"roles": ("ffn", "attention")} if field == "roles" else {}
        cfg = cfg_of(**{**base, **(change if rank == ATTN_RANK else {})})
        t0 = time.monotonic()
        try:
            Buffer(None, cfg, device=dev)
            out[field] = {"error": None}
        except Exception as e:
            out[field] = {"error": f"{type(e).__name__}: {e}"}
        out[field]["seconds"] = time.monotonic() - t0
    with Buffer(None, cfg_of(), device=dev) as buf:
        after = {"buffer_id": buf.buffer_id, "result": exchange(buf, 4, 41)}
    # attention_ranks differs: the world size the config needs differs. A group with a short
    # timeout bounds a rank that would wait for the other in the construction collective.
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=FAST_TIMEOUT))
    cfg = cfg_of(attention_ranks=2 if rank == ATTN_RANK else 1)
    t0 = time.monotonic()
    try:
        Buffer(group, cfg, device=dev)
        size = {"error": None}
    except Exception as e:
        size = {"error": f"{type(e).__name__}: {e}"}
    size["seconds"] = time.monotonic() - t0
    if rank == ATTN_RANK:
        time.sleep(FAST_TIMEOUT + 2.0)  # stay alive while the other rank would wait
    return {"fields": out, "after": after, "world_size": size}


def part_groups(rank, world, outdir, dev):
    """Two buffers on the default group, one on a gloo subgroup and one on an afdep-backend
    group, all with exchanges in flight at once, completed in different orders."""
    from torch_afdep.distributed import AfdepOptions

    cfg = cfg_of()
    g_gloo = dist.new_group([0, 1])
    g_afdep = dist.new_group([0, 1], backend="afdep", pg_options=AfdepOptions(roles="FA"))
    bufs = [Buffer(None, cfg, device=dev), Buffer(None, cfg, device=dev),
            Buffer(g_gloo, cfg, device=dev), Buffer(g_afdep, cfg, device=dev)]
    tokens = [3, 8, 5, 1]
    scales = [1.0, 2.0, 3.0, 0.5]  # a reply delivered to the wrong buffer would show
    rounds = [  # (Attention dispatch order, collect order, FFN receive order, reply order)
        ([0, 2, 1, 3], [2, 0, 3, 1], [1, 3, 0, 2], [0, 2, 1, 3]),
        ([3, 2, 1, 0], [0, 1, 2, 3], [0, 1, 2, 3], [3, 0, 2, 1]),
    ]
    results = []
    for rnd, (send_o, coll_o, recv_o, reply_o) in enumerate(rounds):
        seeds = [100 * rnd + 50 + i for i in range(4)]
        got = {}
        if rank == ATTN_RANK:
            sent = {}
            for i in send_o:
                sent[i] = attn_send(bufs[i], tokens[i], seeds[i])
            for i in coll_o:
                got[i] = attn_finish(bufs[i], sent[i], scales[i])
        else:
            recs = {}
            for i in recv_o:
                recs[i] = ffn_recv(bufs[i])
            for i in reply_o:
                got[i] = ffn_finish(bufs[i], recs[i], tokens[i], seeds[i], scales[i])
        results.append([got[i] for i in range(4)])
    # The wrappers need buffer_id when a group has two open buffers.
    amb = expect(RuntimeError, torch_afdep.afd_combine, torch.zeros(1, dtype=torch.int64),
                 group=bufs[0].group_name)
    ids = [(b.group_name, b.buffer_id) for b in bufs]
    for b in bufs:  # collective: the same order on every rank
        b.close()
    return {"results": results, "ambiguous": amb, "ids": ids,
            "names": [b.group_name for b in bufs]}


ATTN_MODES = ["compiled", "methods", "compiled", "wrappers", "compiled", "methods"]
FFN_MODES = ["methods", "compiled", "wrappers", "compiled", "methods", "compiled"]


def part_compile(rank, world, outdir, dev):
    """Exchanges alternate between a torch.compile(fullgraph=True, backend="aot_eager") step
    built from the afd_* wrappers and eager calls (Buffer methods, or the wrappers)."""
    import torch._dynamo.utils

    cfg = cfg_of()
    buf = Buffer(None, cfg, device=dev)
    name, bid = buf.group_name, buf.buffer_id
    t_compiled = 6

    def attention_step(x, ids, w):
        route = torch_afdep.afd_dispatch(x, ids, w, group=name, bucket=8, buffer_id=bid)
        return torch_afdep.afd_combine(route, group=name, buffer_id=bid)

    def ffn_step():
        rec = torch_afdep.afd_receive(group=name, bucket=8, buffer_id=bid)
        torch_afdep.afd_reply(ffn_rows(cfg, 0, rec), rec.receipt, group=name, buffer_id=bid)
        return rec.expert_offsets

    counters = torch._dynamo.utils.counters
    graphs0 = counters["stats"]["unique_graphs"]
    if buf.role == "attention":
        step = torch.compile(attention_step, fullgraph=True, backend="aot_eager")
        modes = ATTN_MODES
    else:
        step = torch.compile(ffn_step, fullgraph=True, backend="aot_eager")
        modes = FFN_MODES
    results = []
    for i, mode in enumerate(modes):
        t = t_compiled if ATTN_MODES[i] == "compiled" else 3 + 5 * (i % 2)
        seed = 70 + i
        x, ids, w = make_inputs(cfg, t, seed)
        if buf.role == "attention":
            xd, idd, wd = x.to(dev), ids.to(dev), w.to(dev)
            if mode == "compiled":
                out = step(xd, idd, wd)
            elif mode == "wrappers":
                route = torch_afdep.afd_dispatch(xd, idd, wd, group=name, bucket=8,
                                                 buffer_id=bid)
                out = torch_afdep.afd_combine(route, group=name, buffer_id=bid)
            else:
                buf.source_dispatch(xd, idd, wd, bucket=8)
                out = buf.source_collect()
            results.append((mode, check_output(cfg, out, x, ids, w)))
        else:
            if mode == "compiled":
                offs = step()
            elif mode == "wrappers":
                rec = torch_afdep.afd_receive(group=name, bucket=8, buffer_id=bid)
                torch_afdep.afd_reply(ffn_rows(cfg, 0, rec), rec.receipt, group=name,
                                      buffer_id=bid)
                offs = rec.expert_offsets
            else:
                rec = buf.worker_receive(8)
                buf.worker_reply(ffn_rows(cfg, 0, rec), rec.receipt)
                offs = rec.expert_offsets
            want = ref.expert_counts(cfg, [ids])[0]
            offs = offs.cpu()
            results.append((mode, bool(torch.equal((offs[1:] - offs[:-1]).long(), want))))
    sync(dev)
    graphs = counters["stats"]["unique_graphs"] - graphs0
    state = buf.state.tolist()
    buf.close()
    return {"results": results, "graphs": graphs, "state": state}


# ---- fault parts ------------------------------------------------------------------------
def part_ordering(rank, world, outdir, dev):
    """Out-of-order calls and wrong receipts raise clear errors, and the next exchange is
    still exact."""
    cfg = cfg_of()
    buf = Buffer(None, cfg, device=dev)
    other = Buffer(None, cfg, device=dev)
    errors, exact = {}, []
    # On the other buffer: an exchange whose receipt the FFN rank keeps (a wrong receipt).
    foreign = None
    if rank == FFN_RANK:
        foreign = ffn_recv(other)
        ffn_finish(other, foreign, 4, 80)
    else:
        exact.append(attn_finish(other, attn_send(other, 4, 80)))
    rows8 = torch.zeros(cfg.recv_rows(8), cfg.hidden_size, dtype=torch.bfloat16)
    # Exchange 0: reply before receive / collect before dispatch; twice in a row.
    if rank == FFN_RANK:
        errors["reply_before_receive"] = expect(AfdepStateError, buf.worker_reply, rows8,
                                                foreign.receipt)
        rec0 = ffn_recv(buf)
        errors["receive_twice"] = expect(AfdepStateError, buf.worker_receive, 8)
        ffn_finish(buf, rec0, 6, 81)
    else:
        errors["collect_before_dispatch"] = expect(AfdepStateError, buf.source_collect)
        sent = attn_send(buf, 6, 81)
        x, ids, w = make_inputs(cfg, 7, 999)
        errors["dispatch_twice"] = expect(AfdepStateError, buf.source_dispatch, x, ids, w,
                                          bucket=8)
        exact.append(attn_finish(buf, sent))
    # Exchange 1: stale, foreign and mis-bucketed receipts; then the right one.
    if rank == FFN_RANK:
        rec1 = ffn_recv(buf)
        rows = ffn_rows(cfg, 0, rec1)
        errors["stale_receipt"] = expect(AfdepStateError, buf.worker_reply, rows,
                                         rec0.receipt)
        errors["foreign_receipt"] = expect(ValueError, buf.worker_reply, rows,
                                           foreign.receipt)
        errors["wrong_bucket_receipt"] = expect(ValueError, buf.worker_reply, rows,
                                                rec1.receipt._replace(bucket=4))
        errors["not_a_receipt"] = expect(TypeError, buf.worker_reply, rows,
                                         tuple(rec1.receipt))
        ffn_finish(buf, rec1, 8, 82)
    else:
        exact.append(attn_finish(buf, attn_send(buf, 8, 82)))
    # Exchange 2 (bucket 4): rows sized for another bucket, then the right rows.
    if rank == FFN_RANK:
        rec2 = ffn_recv(buf, bucket=4)
        errors["rows_of_other_bucket"] = expect(ValueError, buf.worker_reply, rows8,
                                                rec2.receipt)
        ffn_finish(buf, rec2, 4, 83)
    else:
        exact.append(attn_finish(buf, attn_send(buf, 4, 83, bucket=4)))
    # Exchange 3: nothing wrong; still exact.
    if rank == FFN_RANK:
        ffn_finish(buf, ffn_recv(buf), 5, 84)
    else:
        exact.append(attn_finish(buf, attn_send(buf, 5, 84)))
    other.close()
    buf.close()
    return {"errors": errors, "exact": exact}


def part_skip(rank, world, outdir, dev):
    """The Attention rank skips an exchange: the FFN rank's worker_receive raises
    AfdepTimeoutError naming the Attention rank and the dispatch phase after ~timeout_s, the
    buffer refuses further use, and both ranks close within a bounded time."""
    group = dist.new_group([0, 1])  # a skipped exchange leaves this group's ranks out of step
    cfg = cfg_of(timeout_s=FAST_TIMEOUT)
    buf = Buffer(group, cfg, device=dev)
    first = exchange(buf, 5, 90)
    out = {"first": first}
    if rank == FFN_RANK:
        t0 = time.monotonic()
        try:
            buf.worker_receive(8)
            out["error"] = None
        except BaseException as e:
            out["error"] = error_info(e, t0)
        out["after"] = expect(AfdepStateError, buf.worker_receive, 8)
    t0 = time.monotonic()
    try:
        buf.close()
        out["close"] = None
    except BaseException as e:
        out["close"] = error_info(e, t0)
    out["close_s"] = time.monotonic() - t0
    return out


def part_kill_ffn(rank, world, outdir, dev):
    """The FFN rank dies (os._exit) right after worker_receive; the Attention rank's
    source_collect raises an AfdepError naming the FFN rank and the phase, within timeout_s
    of the death; it then refuses further use and closes promptly. Must be the last part."""
    group = dist.new_group([0, 1])
    cfg = cfg_of(timeout_s=FAST_TIMEOUT)
    death = os.path.join(outdir, "death")
    buf = Buffer(group, cfg, device=dev)
    first = exchange(buf, 5, 95)  # a healthy exchange first
    if rank == FFN_RANK:
        ffn_recv(buf)
        with open(death, "w") as f:
            f.write(repr(time.time()))
        os._exit(1)
    sent = attn_send(buf, 6, 96)
    t0 = time.monotonic()
    try:
        buf.source_collect()
        err = None
    except BaseException as e:
        err = error_info(e, t0, death)
    after = expect(AfdepStateError, buf.source_dispatch, *sent, bucket=8)
    t0 = time.monotonic()
    buf.close()
    return {"first": first, "error": err, "after": after, "close_s": time.monotonic() - t0}


def part_kill_attention(rank, world, outdir, dev):
    """The Attention rank dies (os._exit) right after source_dispatch; the FFN rank keeps
    serving exchanges until one raises an AfdepError naming the Attention rank and the phase,
    within timeout_s of the death; then it closes promptly. Must be the last part."""
    group = dist.new_group([0, 1])
    cfg = cfg_of(timeout_s=FAST_TIMEOUT)
    death = os.path.join(outdir, "death")
    buf = Buffer(group, cfg, device=dev)
    first = exchange(buf, 5, 97)
    if rank == ATTN_RANK:
        attn_send(buf, 6, 98)
        time.sleep(0.5)  # let the dispatch leave
        with open(death, "w") as f:
            f.write(repr(time.time()))
        os._exit(1)
    err, calls = None, []
    t0 = time.monotonic()
    for i in range(4):
        try:
            calls.append("worker_receive")
            t0 = time.monotonic()
            rec = buf.worker_receive(8)
            calls.append("worker_reply")
            t0 = time.monotonic()
            buf.worker_reply(ffn_rows(cfg, 0, rec), rec.receipt)
        except BaseException as e:
            err = error_info(e, t0, death)
            err["call"] = calls[-1]
            break
    after = expect(AfdepStateError, buf.worker_receive, 8)
    t0 = time.monotonic()
    buf.close()
    return {"first": first, "error": err, "calls": calls, "after": after,
            "close_s": time.monotonic() - t0}


# ---- world entry points ---------------------------------------------------------------------
#: Parts of the lifecycle world per device. The CPU-only parts test the CPU transport's
#: behaviour: gloo and afdep-backend subgroups (an afdep group on CUDA would bring an NCCL
#: inner, one rank per GPU), and an abort whose unread reply stays queued on gloo.
LIFECYCLE_PARTS = {
    "cpu": ["leak", "close", "context", "mismatch", "groups", "compile", "context_abort"],
    "cuda": ["leak", "close", "context", "mismatch", "compile"],
}


def lifecycle_world(rank, world, outdir, device):
    return run_parts(rank, world, outdir, LIFECYCLE_PARTS[device], device)


def faults_world(rank, world, outdir):
    return run_parts(rank, world, outdir, ["ordering", "skip", "kill_ffn"])


def kill_attention_world(rank, world, outdir):
    return run_parts(rank, world, outdir, ["kill_attention"])


def environ_body(rank, ws, names):
    """The rank's values of ``names`` (None: unset) and its parent process id (the caller's
    for a spawned rank, the fork server's for a forked one)."""
    return [os.environ.get(n) for n in names], os.getppid()


def sleeping_body(rank, ws, seconds):
    """Sleeps past AFDEP_WORLD_STACKS_S, so the rank's stack dump fires."""
    time.sleep(seconds)
    return rank


def printing_body(rank, ws, lines):
    """Prints ``lines`` lines of about 100 characters, as ranks of the examples do."""
    for i in range(lines):
        print(f"rank {rank} line {i} " + "x" * 80)
    return lines
