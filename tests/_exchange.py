"""Shared spawned-world bodies for the CPU contract tests (module level: spawn pickles them)."""

from __future__ import annotations

import torch

import torch_afdep
from torch_afdep import reference as ref


def expert_fn(e: int, rows: torch.Tensor) -> torch.Tensor:
    """A cheap, expert-dependent, nonlinear function of float rows [n, H] -> [n, H]."""
    return torch.tanh(rows) * (1.0 + 0.25 * ((e % 7) - 3)) + 0.01 * (e + 1)


def make_inputs(cfg, a: int, tokens: int, routing: str, seed: int):
    """Attention index a's inputs for one exchange (identical on every rank for a seed)."""
    g = torch.Generator().manual_seed(seed * 1009 + a)
    x32 = torch.randn(tokens, cfg.hidden_size, generator=g)
    if cfg.dtype == torch.float8_e4m3fn:
        blocks = x32.view(tokens, cfg.hidden_size // 128, 128)
        amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
        scales = (amax / 448.0).to(torch.float32)
        x = (blocks / scales[:, :, None]).view(tokens, cfg.hidden_size).to(torch.float8_e4m3fn)
    else:
        scales = None
        x = x32.to(torch.bfloat16)
    ids, w = ref.random_routing(cfg, tokens, routing, generator=g)
    if a % 2 == 1:
        ids = ids.to(torch.int32)  # both id dtypes in one exchange
    return x, ids, w, scales


def ffn_compute(cfg, f: int, received) -> torch.Tensor:
    """Apply expert_fn per local expert to the received rows, times each row's weight."""
    xr = received.x.to(torch.float64)
    if received.x_scales is not None:
        xr = xr * received.x_scales.to(torch.float64).repeat_interleave(128, dim=1)
    out = torch.full((xr.shape[0], cfg.hidden_size), float("nan"), dtype=torch.float64)
    offs = received.expert_offsets.tolist()
    for e in range(cfg.experts_per_rank):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            out[lo:hi] = expert_fn(f * cfg.experts_per_rank + e, xr[lo:hi])
    n = offs[-1]
    out[:n] *= received.weights[:n].to(torch.float64)[:, None]
    return out.to(torch.bfloat16)


def run_exchanges(rank, world, cases, seed0):
    """``cases``: list of (Config, plan); plan: list of (bucket, tokens per Attention index,
    routing) exchanges, run back to back on one Buffer per Config.

    Attention ranks return their relative error per exchange; FFN ranks check the received
    layout exactly and return their per-expert counts."""
    return [run_plan(cfg, plan, seed0 + 100 * i) for i, (cfg, plan) in enumerate(cases)]


def run_plan(cfg, plan, seed0):
    buf = torch_afdep.Buffer(None, cfg, device="cpu")
    results = []
    try:
        for step, (bucket, tokens, routing) in enumerate(plan):
            seed = seed0 + step
            all_inputs = [make_inputs(cfg, a, tokens[a], routing, seed)
                          for a in range(cfg.attention_ranks)]
            if buf.role == "attention":
                x, ids, w, s = all_inputs[buf.role_index]
                buf.source_dispatch(x, ids, w, bucket=bucket, x_scales=s)
                out = buf.source_collect()
                assert out.dtype == torch.bfloat16 and out.shape == (tokens[buf.role_index],
                                                                      cfg.hidden_size)
                want = ref.moe_output(cfg, x, ids, w, expert_fn, s)
                results.append(ref.relative_error(out, want))
                if tokens[buf.role_index]:
                    # bf16 storage of the expert output bounds the error per element.
                    assert torch.allclose(out.double(), want, atol=3e-2, rtol=3e-2), step
            else:
                received = buf.worker_receive(bucket)
                check_received(cfg, buf.role_index, received, all_inputs, bucket)
                rows = ffn_compute(cfg, buf.role_index, received)
                buf.worker_reply(rows, received.receipt)
                offs = received.expert_offsets
                results.append((offs[1:] - offs[:-1]).tolist())
    finally:
        buf.close()
    return results


def check_received(cfg, f, rec, all_inputs, bucket):
    """Exact checks of one FFN rank's received layout against the inputs of every source."""
    el, r = cfg.experts_per_rank, cfg.rows_per_token
    rows_cap = cfg.recv_rows(bucket)
    assert rec.x.shape == (rows_cap, cfg.hidden_size) and rec.x.dtype == cfg.dtype
    assert rec.weights.shape == (rows_cap,)
    assert rec.receipt.token_rows.shape == (cfg.attention_ranks, bucket, r)
    want_counts = ref.expert_counts(cfg, [inp[1] for inp in all_inputs])[f]
    offs = rec.expert_offsets.to(torch.int64)
    assert offs[0] == 0
    assert torch.equal(offs[1:] - offs[:-1], want_counts), (offs, want_counts)
    n = int(offs[-1])
    a_ranks = cfg.attention_group_ranks
    seen = set()
    for i in range(n):
        e = int(torch.searchsorted(offs, torch.tensor(i), right=True)) - 1
        src = a_ranks.index(int(rec.src_rank[i]))
        t = int(rec.src_token[i])
        x, ids, w, s = all_inputs[src]
        row_ids = ref.dedupe(ids[t:t + 1])[0]
        js = (row_ids == f * el + e).nonzero().flatten()
        assert js.numel() == 1, (i, e, src, t)
        j = int(js[0])
        assert (src, t, e) not in seen
        seen.add((src, t, e))
        assert torch.equal(rec.x[i].view(torch.uint8), x[t].view(torch.uint8))
        if s is not None:
            assert torch.equal(rec.x_scales[i], s[t])
        assert rec.weights[i].item() == w[t, j].item()
    # The receipt maps every (source, token) back to its rows.
    for a in range(cfg.attention_ranks):
        k = int(rec.receipt.num_tokens[a])
        ids = ref.dedupe(all_inputs[a][1])
        hits = ((ids >= f * el) & (ids < (f + 1) * el)).any(dim=1)
        assert k == int(hits.sum())
        assert torch.equal(rec.receipt.token_index[a, :k].to(torch.int64),
                           hits.nonzero().flatten())
        for s_ in range(k):
            rows = [int(v) for v in rec.receipt.token_rows[a, s_] if v >= 0]
            for row in rows:
                assert a_ranks.index(int(rec.src_rank[row])) == a
                assert int(rec.src_token[row]) == int(rec.receipt.token_index[a, s_])


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
    cfg = buf0.config
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
            x, ids, w, s = inputs[i][buf.role_index]
            if op == "d":
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
            want = ref.moe_output(cfg, x, ids, w, expert_fn, s)
            results.append(ref.relative_error(out, want))
            assert out.shape == (x.shape[0], cfg.hidden_size)
            if x.shape[0]:
                assert torch.allclose(out.double(), want, atol=3e-2, rtol=3e-2), (i, ex)
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
                check_received(cfg, f, rec, inputs[i], ex["bucket"])
                open_[i] = rec
                continue
            assert op == "p", op
            rec = open_.pop(i)
            # Receiving other slots in between left this exchange's rows untouched.
            check_received(cfg, f, rec, inputs[i], ex["bucket"])
            rows = ffn_compute(cfg, f, rec)
            if api == "buffer":
                buf.worker_reply(rows, rec.receipt)
            else:
                torch_afdep.afd_reply(rows, rec.receipt, **kw)
            offs = rec.expert_offsets
            results.append((offs[1:] - offs[:-1]).tolist())
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


def _expect(exc_type, fragment, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        assert fragment in str(e), f"{fragment!r} not in {e!r}"
        return str(e)
    raise AssertionError(f"{getattr(fn, '__name__', fn)} did not raise {exc_type.__name__} "
                         f"({fragment!r})")


def slots_world_body(rank, world):
    """Every slot check that needs a world, in one 2A2F world (see tests/test_slots.py)."""
    torch.set_num_threads(1)  # several ranks share few cores
    from torch_afdep import AfdepStateError, Buffer, Config

    out = {}
    # num_slots must agree across ranks (checked before any buffer id is taken).
    try:
        Buffer(None, Config(**SLOT_CFG, num_slots=2 + rank % 2), device="cpu")
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    b3 = Buffer(None, Config(**SLOT_CFG, num_slots=3), device="cpu")
    b2 = Buffer(None, Config(**SLOT_CFG), device="cpu")
    b1 = Buffer(None, Config(**SLOT_CFG, num_slots=1), device="cpu")
    bufs = (b3, b2, b1)
    out["ids"] = [b.buffer_id for b in bufs]
    out["transports"] = [len(b.transports) for b in bufs]
    out["tags"] = [t._tag0 for b in bufs for t in b.transports]
    out["registered_bytes"] = [b.registered_bytes for b in bufs]

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
        for x, ids, w, s in (inputs[0][b3.role_index], inputs[1][b3.role_index]):
            b3.source_dispatch(x, ids, w, 8, slot=0)
            msgs += [
                _expect(AfdepStateError, "twice without source_collect on slot 0",
                        b3.source_dispatch, x, ids, w, 8, slot=0),
                _expect(AfdepStateError, "afdep::dispatch: slot 0 still holds a dispatched",
                        torch_afdep.afd_dispatch, x, ids, w, bucket=8, slot=0, **kw),
                _expect(AfdepStateError, "without a preceding source_dispatch on slot 1",
                        b3.source_collect, slot=1),
                _expect(AfdepStateError, "afdep::combine: no dispatch is open on slot 2",
                        torch_afdep.afd_combine, torch.zeros(0, dtype=torch.int64), slot=2,
                        **kw),
                _expect(ValueError, "slot must be in [0, 2]", b3.source_dispatch, x, ids, w, 8,
                        slot=3),
                _expect(ValueError, "slot must be in [0, 2]", torch_afdep.afd_dispatch,
                        x, ids, w, bucket=8, slot=-1, **kw),
                _expect(TypeError, "slot must be an int", b3.source_collect, slot=True),
                _expect(ValueError, "slot must be in [0, 0]", b1.source_collect, slot=1),
            ]
            got = b3.source_collect(slot=0)
            want = ref.moe_output(cfg, x, ids, w, expert_fn, s)
            assert ref.relative_error(got, want) < 1e-2
            assert all(p == "idle" for p in b3._slot_phase)
    else:
        f = b3.role_index
        rec = b3.worker_receive(8, slot=0)
        rows = ffn_compute(cfg, f, rec)
        msgs += [
            _expect(AfdepStateError, "twice without worker_reply on slot 0", b3.worker_receive,
                    8, slot=0),
            _expect(AfdepStateError, "afdep::receive: slot 0 still holds a received",
                    torch_afdep.afd_receive, bucket=8, slot=0, **kw),
            _expect(AfdepStateError, "receipt is from slot 0, not slot 1", b3.worker_reply,
                    rows, rec.receipt, slot=1),
            _expect(AfdepStateError, "receipt is from slot 0, not slot 2",
                    torch_afdep.afd_reply, rows, rec.receipt, slot=2, **kw),
            _expect(AfdepStateError, "afdep::reply: no receive is open on slot 1",
                    torch_afdep.afd_reply, rows, rec.receipt._replace(slot=1), **kw),
            _expect(AfdepStateError, "without a preceding worker_receive on slot 1",
                    b3.worker_reply, rows, rec.receipt._replace(slot=1)),
            _expect(ValueError, "slot must be in [0, 2]", b3.worker_reply, rows,
                    rec.receipt._replace(slot=5)),
        ]
        b3.worker_reply(rows, rec.receipt)
        rec2 = b3.worker_receive(8, slot=0)
        check_received(cfg, f, rec2, inputs[1], 8)
        msgs.append(_expect(AfdepStateError, "stale receipt", b3.worker_reply,
                            ffn_compute(cfg, f, rec2), rec.receipt))
        b3.worker_reply(ffn_compute(cfg, f, rec2), rec2.receipt)
        assert rec2.receipt.sequence == rec.receipt.sequence + 1
    out["messages"] = msgs
    for b in bufs:
        b.close()
    return out


def zero_copy_body(rank, world):
    """nA1F (F = world - A... one FFN rank): Attention ranks collect with
    ``source_collect(zero_copy=True)`` on two slots, mixed with copying collects; every result
    against the fp64 reference, views of one slot share storage across exchanges, views of
    two slots never do. Returns the Attention ranks' (slot, data_ptr) per zero-copy collect."""
    torch.set_num_threads(1)
    cfg = torch_afdep.Config(capacity_tokens_per_rank=16, hidden_size=256, num_experts=8,
                             top_k=3, ffn_ranks=1, attention_ranks=world - 1, num_slots=2,
                             timeout_s=20.0)
    buf = torch_afdep.Buffer(None, cfg, device="cpu")
    plan = [(0, 16, "partial", True), (1, 7, "random", True), (0, 1, "skewed", False),
            (0, 16, "random", True), (1, 0, "random", True), (1, 16, "partial", True)]
    ptrs = []
    try:
        if buf.role == "attention":
            _expect(TypeError, "zero_copy must be a bool", buf.source_collect, zero_copy=1)
        for step, (slot, t, routing, zc) in enumerate(plan):
            tokens = [t if (a + step) % 2 == 0 else max(t - 3, 0)
                      for a in range(cfg.attention_ranks)]
            all_inputs = [make_inputs(cfg, a, tokens[a], routing, 40 + step)
                          for a in range(cfg.attention_ranks)]
            if buf.role == "attention":
                x, ids, w, s = all_inputs[buf.role_index]
                buf.source_dispatch(x, ids, w, bucket=16, x_scales=s, slot=slot)
                out = buf.source_collect(slot=slot, zero_copy=zc)
                want = ref.moe_output(cfg, x, ids, w, expert_fn, s)
                assert out.shape == (x.shape[0], cfg.hidden_size) and out.dtype == torch.bfloat16
                if x.shape[0]:
                    assert torch.allclose(out.double(), want, atol=3e-2, rtol=3e-2), step
                    if routing == "partial":  # token 0 reaches no expert: zeros
                        assert bool((out[0] == 0).all()), step
                if zc:
                    ptrs.append((slot, out.untyped_storage().data_ptr()))
            else:
                rec = buf.worker_receive(16, slot=slot)
                check_received(cfg, 0, rec, all_inputs, 16)
                buf.worker_reply(ffn_compute(cfg, 0, rec), rec.receipt, slot=slot)
    finally:
        buf.close()
    if buf.role == "attention":
        by_slot = {}
        for slot, p in ptrs:
            by_slot.setdefault(slot, set()).add(p)
        assert all(len(v) == 1 for v in by_slot.values()), by_slot
        assert by_slot[0] != by_slot[1]
    return ptrs


def zero_copy_refused_body(rank, world):
    """2A2F: zero_copy raises before any communication; the buffer still works."""
    torch.set_num_threads(1)
    cfg = torch_afdep.Config(capacity_tokens_per_rank=8, hidden_size=128, num_experts=8,
                             top_k=2, ffn_ranks=2, attention_ranks=2, timeout_s=20.0)
    buf = torch_afdep.Buffer(None, cfg, device="cpu")
    try:
        all_inputs = [make_inputs(cfg, a, 5, "random", 3) for a in range(2)]
        if buf.role == "attention":
            x, ids, w, s = all_inputs[buf.role_index]
            buf.source_dispatch(x, ids, w, bucket=8)
            _expect(ValueError, "zero_copy needs ffn_ranks == 1", buf.source_collect,
                    zero_copy=True)
            out = buf.source_collect()
            want = ref.moe_output(cfg, x, ids, w, expert_fn, s)
            assert torch.allclose(out.double(), want, atol=3e-2, rtol=3e-2)
        else:
            rec = buf.worker_receive(8)
            check_received(cfg, buf.role_index, rec, all_inputs, 8)
            buf.worker_reply(ffn_compute(cfg, buf.role_index, rec), rec.receipt)
    finally:
        buf.close()
    return True
