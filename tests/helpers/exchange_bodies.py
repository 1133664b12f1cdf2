"""Spawned-world bodies of the exchange contract: layouts and plans of exchanges, micro-batch
slots, zero-copy collects. Each body takes ``device`` ("cpu" or "cuda") last and runs the
public API (Buffer, afd_*) on it; inputs are rebuilt from seeds on every rank, so FFN ranks
check what they received and Attention ranks what they got back (``checks``)."""

from __future__ import annotations

import torch

import torch_afdep
from torch_afdep import reference as ref

from . import checks
from .devices import rank_device, sync

#: allclose bound of the Attention output (bf16 storage of the expert output).
CLOSE = 3e-2


def make_inputs(cfg, a: int, tokens: int, routing: str, seed: int):
    """Attention index a's host inputs (the same on every rank); odd indices send int32 ids,
    so one exchange mixes both id dtypes."""
    return ref.make_inputs(cfg, tokens, routing, seed, a,
                           id_dtype=torch.int32 if a % 2 else torch.int64)


def to_device(inp, dev):
    x, ids, w, s = inp
    return x.to(dev), ids.to(dev), w.to(dev), None if s is None else s.to(dev)


def collect_checked(cfg, out, inp) -> float:
    """Check an Attention output against the fp64 reference (``tanh_expert``)."""
    return checks.check_attention(cfg, inp, out, expert=checks.tanh_expert, tol=1e-2,
                                  close=CLOSE)


def receive_checked(cfg, f, rec, inputs, bucket, dev):
    checks.check_received(cfg, f, rec, inputs, bucket, ordered=dev.type == "cpu")


def run_exchanges(rank, world, cases, seed0, device):
    """``cases``: list of (Config, plan); plan: list of (bucket, tokens per Attention index,
    routing) exchanges, run back to back on one Buffer per Config.

    Attention ranks return their relative error per exchange; FFN ranks check the received
    layout exactly and return their per-expert counts."""
    return [run_plan(cfg, plan, seed0 + 100 * i, device) for i, (cfg, plan) in enumerate(cases)]


def run_plan(cfg, plan, seed0, device):
    dev = rank_device(device)
    buf = torch_afdep.Buffer(None, cfg, device=dev)
    results = []
    try:
        for step, (bucket, tokens, routing) in enumerate(plan):
            seed = seed0 + step
            all_inputs = [make_inputs(cfg, a, tokens[a], routing, seed)
                          for a in range(cfg.attention_ranks)]
            if buf.role == "attention":
                inp = all_inputs[buf.role_index]
                x, ids, w, s = to_device(inp, dev)
                buf.source_dispatch(x, ids, w, bucket=bucket, x_scales=s)
                out = buf.source_collect()
                sync(dev)
                results.append(collect_checked(cfg, out, inp))
            else:
                received = buf.worker_receive(bucket)
                receive_checked(cfg, buf.role_index, received, all_inputs, bucket, dev)
                rows = checks.ffn_compute(cfg, buf.role_index, received)
                buf.worker_reply(rows, received.receipt)
                offs = received.expert_offsets.cpu()
                results.append((offs[1:] - offs[:-1]).tolist())
        sync(dev)
    finally:
        buf.close()
    return results


# ---- micro-batch slots ------------------------------------------------------------------
def slot_inputs(cfg, exchanges):
    """Inputs of every exchange of a slot plan, per Attention index (same on every rank)."""
    return [[make_inputs(cfg, a, ex["tokens"][a], ex["routing"], ex["seed"])
             for a in range(cfg.attention_ranks)] for ex in exchanges]


def run_slot_plan(bufs, exchanges, attn_orders, ffn_orders, api="buffer"):
    """Run exchanges on micro-batch slots in a per-rank order and check each against the
    reference.

    ``bufs``: a Buffer or a list of Buffers of one group (same Config but for num_slots).
    ``exchanges[i]``: dict(slot, bucket, tokens [per Attention index], routing, seed, and
    optionally buffer: index into bufs).
    ``attn_orders[a]`` / ``ffn_orders[f]``: list of ("d"ispatch | "c"ollect, i) and
    ("r"eceive | "p" reply, i): the order that rank runs its half of the exchanges in.
    ``api``: "buffer" (role methods) or "ops" (the afd_* wrappers).
    Returns the Attention ranks' relative errors (FFN ranks: expert row counts)."""
    bufs = bufs if isinstance(bufs, (list, tuple)) else [bufs]
    buf0 = bufs[0]
    cfg, dev = buf0.config, buf0.device
    inputs = slot_inputs(cfg, exchanges)
    results = []

    def pick(ex):
        b = bufs[ex.get("buffer", 0)]
        return b, dict(group=b.group_name, buffer_id=b.buffer_id)

    if buf0.role == "attention":
        routes = {}
        for op, i in attn_orders[buf0.role_index]:
            ex = exchanges[i]
            buf, kw = pick(ex)
            inp = inputs[i][buf.role_index]
            if op == "d":
                x, ids, w, s = to_device(inp, dev)
                if api == "buffer":
                    buf.source_dispatch(x, ids, w, ex["bucket"], s, slot=ex["slot"])
                else:
                    routes[i] = torch_afdep.afd_dispatch(x, ids, w, bucket=ex["bucket"],
                                                         x_scales=s, slot=ex["slot"], **kw)
                continue
            assert op == "c", op
            if api == "buffer":
                out = buf.source_collect(slot=ex["slot"])
            else:
                out = torch_afdep.afd_combine(routes.pop(i), slot=ex["slot"], **kw)
            sync(dev)
            try:
                results.append(collect_checked(cfg, out, inp))
            except AssertionError as e:
                raise AssertionError(f"exchange {i} {ex}: {e}") from None
    else:
        f = buf0.role_index
        open_ = {}
        for op, i in ffn_orders[f]:
            ex = exchanges[i]
            buf, kw = pick(ex)
            if op == "r":
                if api == "buffer":
                    rec = buf.worker_receive(ex["bucket"], slot=ex["slot"])
                else:
                    rec = torch_afdep.afd_receive(bucket=ex["bucket"], slot=ex["slot"], **kw)
                assert rec.receipt.slot == ex["slot"]
                receive_checked(cfg, f, rec, inputs[i], ex["bucket"], dev)
                open_[i] = rec
                continue
            assert op == "p", op
            rec = open_.pop(i)
            # Receiving other slots in between left this exchange's rows untouched.
            receive_checked(cfg, f, rec, inputs[i], ex["bucket"], dev)
            rows = checks.ffn_compute(cfg, f, rec)
            if api == "buffer":
                buf.worker_reply(rows, rec.receipt)
            else:
                torch_afdep.afd_reply(rows, rec.receipt, **kw)
            offs = rec.expert_offsets.cpu()
            results.append((offs[1:] - offs[:-1]).tolist())
    sync(dev)
    return results


SLOT_CFG = dict(capacity_tokens_per_rank=8, hidden_size=128, num_experts=8, top_k=3,
                ffn_ranks=2, attention_ranks=2, timeout_s=30.0)


def _ex(slot, bucket, tokens, routing, seed, buffer=0):
    return dict(slot=slot, bucket=bucket, tokens=tokens, routing=routing, seed=seed,
                buffer=buffer)


# Round 1 on 2 slots, round 2 on 3 slots (slots 0 and 1 reused), different buckets, token
# counts and routings per exchange; each rank runs its own interleaving.
SLOT_EXCHANGES = [
    _ex(0, 8, [8, 3], "random", 11), _ex(1, 8, [5, 0], "skewed", 12),
    _ex(0, 7, [7, 1], "partial", 13), _ex(1, 8, [2, 8], "random", 14),
    _ex(2, 4, [4, 4], "skewed", 15),
]
SLOT_ATTN_ORDERS = [
    [("d", 0), ("d", 1), ("c", 1), ("c", 0), ("d", 2), ("d", 3), ("d", 4),
     ("c", 4), ("c", 2), ("c", 3)],
    [("d", 1), ("d", 0), ("c", 0), ("c", 1), ("d", 4), ("d", 2), ("d", 3),
     ("c", 3), ("c", 4), ("c", 2)],
]
SLOT_FFN_ORDERS = [
    [("r", 0), ("r", 1), ("p", 1), ("p", 0), ("r", 2), ("r", 3), ("r", 4),
     ("p", 3), ("p", 2), ("p", 4)],
    [("r", 1), ("r", 0), ("p", 0), ("p", 1), ("r", 4), ("r", 3), ("r", 2),
     ("p", 2), ("p", 4), ("p", 3)],
]
# Two buffers of one group (3 and 2 slots) interleaved: tag ranges must not collide.
CROSS_EXCHANGES = [
    _ex(1, 8, [6, 2], "random", 21, buffer=0), _ex(1, 8, [3, 7], "random", 22, buffer=1),
    _ex(0, 8, [8, 8], "skewed", 23, buffer=1), _ex(2, 8, [1, 5], "partial", 24, buffer=0),
]
CROSS_ATTN = [[("d", 0), ("d", 1), ("d", 2), ("d", 3), ("c", 3), ("c", 1), ("c", 2), ("c", 0)]] * 2
CROSS_FFN = [[("r", 2), ("r", 0), ("r", 3), ("r", 1), ("p", 1), ("p", 3), ("p", 0), ("p", 2)]] * 2

_DIRECTIONAL = ("AFDEP_NO_ENTRY_BARRIER", "AFDEP_ONE_WAY_COUNTS", "AFDEP_RECEIVER_WAIT_ONLY",
                "AFDEP_ROLE_WARPS")


def lockstep_protocol() -> bool:
    """True when a reverted control makes every CUDA rank wait for every other rank in each
    phase (the symmetric union protocol): then ranks must issue the same phase sequence over
    the slots, so per-rank slot interleavings cannot run (docs/protocol.md)."""
    from torch_afdep import controls

    f = controls.flags()
    return any(not f & controls.CONTROLS[n].bit for n in _DIRECTIONAL)


def slots_world_body(rank, world, device):
    """Every slot check that needs a world, in one 2A2F world (tests/contract/test_slots.py)."""
    torch.set_num_threads(1)  # several ranks share few cores
    from torch_afdep import AfdepStateError, Buffer, Config

    dev = rank_device(device)
    expect = checks.expect
    out = {}
    # num_slots must agree across ranks (checked before any buffer id is taken).
    try:
        Buffer(None, Config(**SLOT_CFG, num_slots=2 + rank % 2), device=dev)
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    b3 = Buffer(None, Config(**SLOT_CFG, num_slots=3), device=dev)
    b2 = Buffer(None, Config(**SLOT_CFG), device=dev)
    b1 = Buffer(None, Config(**SLOT_CFG, num_slots=1), device=dev)
    bufs = (b3, b2, b1)
    out["ids"] = [b.buffer_id for b in bufs]
    out["transports"] = [len(b.transports) for b in bufs]
    # gloo tag ranges exist on the CPU transport only
    out["tags"] = [t._tag0 for b in bufs for t in b.transports] if dev.type == "cpu" else None
    out["registered_bytes"] = [b.registered_bytes for b in bufs]
    out["per_slot_bytes"] = [[int(t.registered_bytes) for t in b.transports] for b in bufs]

    plan3 = SLOT_EXCHANGES
    plan2 = [dict(ex, slot=ex["slot"] % 2) for ex in SLOT_EXCHANGES[:4]]
    plan2_orders = ([[o for o in order if o[1] < 4] for order in SLOT_ATTN_ORDERS],
                    [[o for o in order if o[1] < 4] for order in SLOT_FFN_ORDERS])
    out["buffer_3_slots"] = run_slot_plan(b3, plan3, SLOT_ATTN_ORDERS, SLOT_FFN_ORDERS)
    out["ops_3_slots"] = run_slot_plan(b3, plan3, SLOT_ATTN_ORDERS, SLOT_FFN_ORDERS, "ops")
    out["buffer_2_slots"] = run_slot_plan(b2, plan2, *plan2_orders)
    out["ops_2_slots"] = run_slot_plan(b2, plan2, *plan2_orders, "ops")
    out["cross_buffers"] = run_slot_plan([b3, b2], CROSS_EXCHANGES, CROSS_ATTN, CROSS_FFN)
    plan1 = [dict(ex, slot=0) for ex in plan3[:2]]
    out["one_slot"] = run_slot_plan(b1, plan1, [[("d", 0), ("c", 0), ("d", 1), ("c", 1)]] * 2,
                                    [[("r", 0), ("p", 0), ("r", 1), ("p", 1)]] * 2)

    # Misuse: errors before any communication; the buffers stay usable.
    msgs = []
    cfg = b3.config
    inputs = slot_inputs(cfg, [_ex(0, 8, [5, 5], "random", 31), _ex(0, 8, [3, 3], "random", 32)])
    kw = dict(group=b3.group_name, buffer_id=b3.buffer_id)
    if b3.role == "attention":
        for inp in (inputs[0][b3.role_index], inputs[1][b3.role_index]):
            x, ids, w, s = to_device(inp, dev)
            b3.source_dispatch(x, ids, w, 8, slot=0)
            msgs += [
                expect(AfdepStateError, "twice without source_collect on slot 0",
                       b3.source_dispatch, x, ids, w, 8, slot=0),
                expect(AfdepStateError, "afdep::dispatch: slot 0 still holds a dispatched",
                       torch_afdep.afd_dispatch, x, ids, w, bucket=8, slot=0, **kw),
                expect(AfdepStateError, "without a preceding source_dispatch on slot 1",
                       b3.source_collect, slot=1),
                expect(AfdepStateError, "afdep::combine: no dispatch is open on slot 2",
                       torch_afdep.afd_combine, torch.zeros(0, dtype=torch.int64, device=dev),
                       slot=2, **kw),
                expect(ValueError, "slot must be in [0, 2]", b3.source_dispatch, x, ids, w, 8,
                       slot=3),
                expect(ValueError, "slot must be in [0, 2]", torch_afdep.afd_dispatch,
                       x, ids, w, bucket=8, slot=-1, **kw),
                expect(TypeError, "slot must be an int", b3.source_collect, slot=True),
                expect(ValueError, "slot must be in [0, 0]", b1.source_collect, slot=1),
            ]
            got = b3.source_collect(slot=0)
            sync(dev)
            want = ref.moe_output(cfg, inp[0], inp[1], inp[2], checks.tanh_expert, inp[3])
            assert ref.relative_error(got, want) < 1e-2
            assert all(b3.phase(s) == "idle" for s in range(b3.num_slots))
    else:
        f = b3.role_index
        rec = b3.worker_receive(8, slot=0)
        rows = checks.ffn_compute(cfg, f, rec)
        msgs += [
            expect(AfdepStateError, "twice without worker_reply on slot 0", b3.worker_receive,
                   8, slot=0),
            expect(AfdepStateError, "afdep::receive: slot 0 still holds a received",
                   torch_afdep.afd_receive, bucket=8, slot=0, **kw),
            expect(AfdepStateError, "receipt is from slot 0, not slot 1", b3.worker_reply,
                   rows, rec.receipt, slot=1),
            expect(AfdepStateError, "receipt is from slot 0, not slot 2",
                   torch_afdep.afd_reply, rows, rec.receipt, slot=2, **kw),
            expect(AfdepStateError, "afdep::reply: no receive is open on slot 1",
                   torch_afdep.afd_reply, rows, rec.receipt._replace(slot=1), **kw),
            expect(AfdepStateError, "without a preceding worker_receive on slot 1",
                   b3.worker_reply, rows, rec.receipt._replace(slot=1)),
            expect(ValueError, "slot must be in [0, 2]", b3.worker_reply, rows,
                   rec.receipt._replace(slot=5)),
        ]
        b3.worker_reply(rows, rec.receipt)
        rec2 = b3.worker_receive(8, slot=0)
        receive_checked(cfg, f, rec2, inputs[1], 8, dev)
        msgs.append(expect(AfdepStateError, "stale receipt", b3.worker_reply,
                           checks.ffn_compute(cfg, f, rec2), rec.receipt))
        b3.worker_reply(checks.ffn_compute(cfg, f, rec2), rec2.receipt)
        assert rec2.receipt.sequence == rec.receipt.sequence + 1
    out["messages"] = msgs
    sync(dev)
    for b in bufs:
        b.close()
    return out


def zero_copy_body(rank, world, device):
    """nA1F (one FFN rank): Attention ranks collect with ``source_collect(zero_copy=True)``
    on two slots, mixed with copying collects; every result against the fp64 reference,
    views of one slot share storage across exchanges, views of two slots never do. Returns
    the Attention ranks' (slot, data_ptr) per zero-copy collect."""
    torch.set_num_threads(1)
    dev = rank_device(device)
    cfg = torch_afdep.Config(capacity_tokens_per_rank=16, hidden_size=256, num_experts=8,
                             top_k=3, ffn_ranks=1, attention_ranks=world - 1, num_slots=2,
                             timeout_s=20.0)
    buf = torch_afdep.Buffer(None, cfg, device=dev)
    plan = [(0, 16, "partial", True), (1, 7, "random", True), (0, 1, "skewed", False),
            (0, 16, "random", True), (1, 0, "random", True), (1, 16, "partial", True)]
    ptrs = []
    try:
        if buf.role == "attention":
            checks.expect(TypeError, "zero_copy must be a bool", buf.source_collect,
                          zero_copy=1)
        for step, (slot, t, routing, zc) in enumerate(plan):
            tokens = [t if (a + step) % 2 == 0 else max(t - 3, 0)
                      for a in range(cfg.attention_ranks)]
            all_inputs = [make_inputs(cfg, a, tokens[a], routing, 40 + step)
                          for a in range(cfg.attention_ranks)]
            if buf.role == "attention":
                inp = all_inputs[buf.role_index]
                x, ids, w, s = to_device(inp, dev)
                buf.source_dispatch(x, ids, w, bucket=16, x_scales=s, slot=slot)
                out = buf.source_collect(slot=slot, zero_copy=zc)
                sync(dev)
                collect_checked(cfg, out, inp)  # tokens without an expert: zeros
                if zc:
                    ptrs.append((slot, out.untyped_storage().data_ptr()))
            else:
                rec = buf.worker_receive(16, slot=slot)
                receive_checked(cfg, 0, rec, all_inputs, 16, dev)
                buf.worker_reply(checks.ffn_compute(cfg, 0, rec), rec.receipt, slot=slot)
        sync(dev)
    finally:
        buf.close()
    if buf.role == "attention":
        by_slot = {}
        for slot, p in ptrs:
            by_slot.setdefault(slot, set()).add(p)
        assert all(len(v) == 1 for v in by_slot.values()), by_slot
        assert by_slot[0] != by_slot[1]
    return ptrs


def zero_copy_refused_body(rank, world, device):
    """2A2F: zero_copy raises before any communication; the buffer still works."""
    torch.set_num_threads(1)
    dev = rank_device(device)
    cfg = torch_afdep.Config(capacity_tokens_per_rank=8, hidden_size=128, num_experts=8,
                             top_k=2, ffn_ranks=2, attention_ranks=2, timeout_s=20.0)
    buf = torch_afdep.Buffer(None, cfg, device=dev)
    try:
        all_inputs = [make_inputs(cfg, a, 5, "random", 3) for a in range(2)]
        if buf.role == "attention":
            inp = all_inputs[buf.role_index]
            x, ids, w, s = to_device(inp, dev)
            buf.source_dispatch(x, ids, w, bucket=8)
            checks.expect(ValueError, "zero_copy needs ffn_ranks == 1", buf.source_collect,
                          zero_copy=True)
            out = buf.source_collect()
            sync(dev)
            collect_checked(cfg, out, inp)
        else:
            rec = buf.worker_receive(8)
            receive_checked(cfg, buf.role_index, rec, all_inputs, 8, dev)
            buf.worker_reply(checks.ffn_compute(cfg, buf.role_index, rec), rec.receipt)
        sync(dev)
    finally:
        buf.close()
    return True
