"""Spawned-world bodies of the op tests: opcheck, torch.compile tracing, bad inputs and
ordering errors, config mismatches, several buffers on one group, a silent peer. Bodies
that take ``device`` run the public API on it (tests/contract/test_ops.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import torch_afdep
from torch_afdep import AfdepStateError, Buffer, Config
from torch_afdep import reference as ref

from .checks import expect
from .devices import rank_device, sync

SMALL = dict(capacity_tokens_per_rank=8, hidden_size=128, num_experts=4, top_k=2,
             ffn_ranks=1, attention_ranks=1, timeout_s=30.0)


def attn_inputs(cfg, t, seed, dev="cpu"):
    """(x, ids, w) of one Attention rank, "partial" routing (some tokens reach no expert)."""
    x, ids, w, _ = ref.make_inputs(cfg, t, "partial", seed, device=dev)
    return x, ids, w


def identity_times_expert(cfg, rec):
    """FFN rows ``x * (e + 1) * weight`` (host read of the offsets), on the rows' device."""
    offs = rec.expert_offsets.tolist()
    rows = torch.full((rec.x.shape[0], cfg.hidden_size), float("nan"), device=rec.x.device)
    for e in range(cfg.experts_per_rank):
        rows[offs[e]:offs[e + 1]] = rec.x[offs[e]:offs[e + 1]].float() * (e + 1)
    n = offs[-1]
    rows[:n] *= rec.weights[:n, None]
    return rows.bfloat16()


def _times_expert(e, r):
    return r * (e + 1)


def opcheck_body(rank, world):
    """opcheck every op; the two roles run paired ops so each real call has a partner.

    opcheck calls one op several times in a row, so the per-slot order checks are off here."""
    from torch_afdep.ops import _order_checks_off

    cfg = Config(**SMALL)
    buf = Buffer(None, cfg, device="cpu")
    out = {}
    utils = ("test_schema", "test_autograd_registration", "test_faketensor",
             "test_aot_dispatch_dynamic")
    opcheck = torch.library.opcheck
    with _order_checks_off():
        if buf.role == "attention":
            x, ids, w = attn_inputs(cfg, 5, 1)
            out["dispatch"] = opcheck(torch.ops.afdep.dispatch.default,
                                      (buf.state, x, ids, w, None, buf.group_name, 0, 8, 1),
                                      test_utils=utils)
            route = torch.ops.afdep.dispatch(buf.state, x, ids, w, None, buf.group_name, 0, 8,
                                             1)
            out["combine"] = opcheck(torch.ops.afdep.combine.default,
                                     (buf.state, route, buf.group_name, 0, 1), test_utils=utils)
        else:
            out["receive"] = opcheck(torch.ops.afdep.receive.default,
                                     (buf.state, buf.group_name, 0, 8, 1), test_utils=utils)
            rec = torch.ops.afdep.receive(buf.state, buf.group_name, 0, 8, 1)
            rows = torch.randn(rec[0].shape).bfloat16()
            out["reply"] = opcheck(torch.ops.afdep.reply.default,
                                   (buf.state, rows, rec[6], rec[7], rec[8], buf.group_name, 0,
                                    1), test_utils=utils)
    buf.close()
    return out


def compile_body(rank, world, device):
    """torch.compile(fullgraph=True, backend=aot_eager) of one role step; returns the Dynamo
    graph's code and the max relative error over three compiled exchanges."""
    dev = rank_device(device)
    cfg = Config(**SMALL)
    buf = Buffer(None, cfg, device=dev)
    name = buf.group_name
    graphs = []
    # The CUDA transport polls its error block through pybind11, which Dynamo cannot trace:
    # an untraceable poll on every transport (the traced wrappers must skip it; the ops poll
    # at run time).
    polls = [0]
    for t in buf.transports:
        @torch.compiler.disable
        def poll(mid_exchange=False, orig=t.check_error):
            polls[0] += 1
            orig(mid_exchange)
        t.check_error = poll

    def recording_backend(gm, example_inputs):
        graphs.append(gm.code.strip())
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend("aot_eager")(gm, example_inputs)

    def attention_step(x, ids, w):
        route = torch_afdep.afd_dispatch(x, ids, w, group=name, bucket=8)
        return torch_afdep.afd_combine(route, group=name).float() * 0.5

    def ffn_step():
        rec = torch_afdep.afd_receive(group=name, bucket=8)
        rows = (rec.x.float() * rec.weights[:, None]).bfloat16()  # identity experts
        torch_afdep.afd_reply(rows, rec.receipt, group=name)
        return rec.expert_offsets

    errors, counts = [], []
    if buf.role == "attention":
        step = torch.compile(attention_step, fullgraph=True, backend=recording_backend)
        for seed in range(3):
            x, ids, w = attn_inputs(cfg, 6, seed)
            got = step(x.to(dev), ids.to(dev), w.to(dev))
            want = ref.moe_output(cfg, x, ids, w, lambda e, r: r) * 0.5
            errors.append(ref.relative_error(got, want))
    else:
        step = torch.compile(ffn_step, fullgraph=True, backend=recording_backend)
        for seed in range(3):
            _, ids, _ = attn_inputs(cfg, 6, seed)
            offs = step().cpu()
            counts.append(((offs[1:] - offs[:-1]).tolist(),
                           ref.expert_counts(cfg, [ids])[0].tolist()))
    sync(dev)
    buf.close()
    return {"graphs": graphs, "errors": errors, "counts": counts, "polls": polls[0]}


def _bad_inputs(buf, dev):
    """Every bad argument raises before any communication; the buffer still works after."""
    cfg = buf.config
    messages = []
    x, ids, w = attn_inputs(cfg, 5, 7, dev)
    if buf.role == "attention":
        d = buf.source_dispatch
        cases = [
            (TypeError, "x must have dtype", (x.float(), ids, w), {"bucket": 8}),
            (TypeError, "x must be a torch.Tensor", (x.tolist(), ids, w), {"bucket": 8}),
            (ValueError, "x must have shape", (x[:, :64], ids, w), {"bucket": 8}),
            (ValueError, "x must be contiguous",
             (torch.cat([x, x], 1)[:, ::2], ids, w), {"bucket": 8}),
            (ValueError, f"x must be on {dev}", (x.to("meta"), ids, w), {"bucket": 8}),
            (TypeError, "expert_ids must have dtype", (x, ids.float(), w), {"bucket": 8}),
            (ValueError, "expert_ids must be in [-1, 4)",
             (x, torch.where(ids == 1, 4, ids), w), {"bucket": 8}),
            (ValueError, "expert_ids must be in [-1, 4)", (x, ids - 3, w), {"bucket": 8}),
            (ValueError, "weights must have shape", (x, ids, w[:, :1]), {"bucket": 8}),
            (TypeError, "weights must have dtype", (x, ids, w.double()), {"bucket": 8}),
            (ValueError, "bucket is 4", (x, ids, w), {"bucket": 4}),
            (ValueError, "bucket must be in [1, 8]", (x, ids, w), {"bucket": 9}),
            (TypeError, "bucket must be an int", (x, ids, w), {"bucket": 8.0}),
            (ValueError, "x_scales must be None", (x, ids, w),
             {"bucket": 8, "x_scales": torch.ones(5, 1, device=dev)}),
        ]
        for exc, frag, args, kw in cases:
            messages.append(expect(exc, frag, d, *args, **kw))
        expect(AfdepStateError, "for ffn ranks", buf.worker_receive, 8)
        expect(AfdepStateError, "without a preceding source_dispatch", buf.source_collect)
        buf.source_dispatch(x, ids, w, bucket=8)
        expect(AfdepStateError, "twice without source_collect", buf.source_dispatch,
               x, ids, w, bucket=8)
        out = buf.source_collect()
        want = ref.moe_output(cfg, x.cpu(), ids.cpu(), w.cpu(), _times_expert)
        assert ref.relative_error(out, want) < 1e-2
        # A second exchange after all of that still works.
        buf.source_dispatch(x, ids, w, bucket=8)
        out = buf.source_collect()
        assert ref.relative_error(out, want) < 1e-2
    else:
        expect(AfdepStateError, "without a preceding worker_receive", buf.worker_reply,
               torch.zeros(8 * 2, 128, dtype=torch.bfloat16, device=dev), None)
        expect(ValueError, "bucket must be in [1, 8]", buf.worker_receive, 0)
        rec = buf.worker_receive(8)
        rows = identity_times_expert(cfg, rec)
        expect(AfdepStateError, "twice without worker_reply", buf.worker_receive, 8)
        expect(ValueError, "rows must have shape", buf.worker_reply, rows[:-1], rec.receipt)
        expect(TypeError, "rows must have dtype", buf.worker_reply, rows.float(), rec.receipt)
        expect(TypeError, "receipt must be the Receipt", buf.worker_reply, rows,
               tuple(rec.receipt))
        expect(ValueError, "receipt belongs to buffer", buf.worker_reply, rows,
               rec.receipt._replace(buffer_key=("other", 3)))
        expect(AfdepStateError, "stale receipt", buf.worker_reply, rows,
               rec.receipt._replace(sequence=rec.receipt.sequence - 1))
        buf.worker_reply(rows, rec.receipt)
        rec2 = buf.worker_receive(8)
        expect(AfdepStateError, "stale receipt", buf.worker_reply,
               identity_times_expert(cfg, rec2), rec.receipt)
        buf.worker_reply(identity_times_expert(cfg, rec2), rec2.receipt)
    sync(dev)
    return messages, (x, ids, w)


def errors_world_body(rank, world, device):
    """One 1A1F world for the error tests: two buffers on one group (registry), every bad
    argument (before any communication), use after close, configs that differ across ranks.
    Returns {"registry": Attention errors, "bad_inputs": messages, "mismatch": message}."""
    dev = rank_device(device)
    cfg = Config(**SMALL)
    res = {"registry": _registry(cfg, dev)}  # first: it checks the first buffer ids
    with Buffer(None, cfg, device=dev) as buf:
        messages, (x, ids, w) = _bad_inputs(buf, dev)
    expect(AfdepStateError, "closed", buf.source_dispatch if buf.role == "attention"
           else buf.worker_receive, *((x, ids, w, 8) if buf.role == "attention" else (8,)))
    buf.close()  # idempotent
    # World size that does not match the config.
    messages.append(expect(ValueError, "attention_ranks + ffn_ranks",
                           Buffer, None, Config(**{**SMALL, "attention_ranks": 2}), dev))
    res["bad_inputs"] = messages
    # Configs that differ across ranks: every rank raises the same error.
    try:
        Buffer(None, Config(**{**SMALL, "hidden_size": 128 if rank == 0 else 256}), device=dev)
        res["mismatch"] = None
    except ValueError as e:
        res["mismatch"] = str(e)
    return res


def _registry(cfg, dev):
    """Two buffers on one group (different ids), exchanges alternating between them; the
    wrappers refuse to guess between two open buffers."""
    b0 = Buffer(None, cfg, device=dev)
    b1 = Buffer(None, cfg, device=dev)
    assert (b0.buffer_id, b1.buffer_id) == (0, 1)
    errs = []
    for step, buf in enumerate((b1, b0, b1)):
        x, ids, w = attn_inputs(cfg, 3 + step, 20 + step)
        if buf.role == "attention":
            buf.source_dispatch(x.to(dev), ids.to(dev), w.to(dev), bucket=8)
            out = buf.source_collect()
            errs.append(ref.relative_error(out, ref.moe_output(cfg, x, ids, w, _times_expert)))
        else:
            rec = buf.worker_receive(8)
            buf.worker_reply(identity_times_expert(cfg, rec), rec.receipt)
    try:
        torch_afdep.afd_combine(torch.zeros(1, dtype=torch.int64, device=dev),
                                group=b0.group_name)
        raise AssertionError("ambiguous buffer not detected")
    except RuntimeError as e:
        assert "open torch_afdep buffers" in str(e)
    sync(dev)
    b1.close()
    b0.close()
    dist.barrier()
    return errs


def timeout_body(rank, world):
    """The FFN rank never receives: the Attention rank raises AfdepTimeoutError naming the
    peer and the phase within the configured timeout, and both ranks shut down. (On CUDA the
    waiting kernel ends at its deadline and the transport reports it: tests/gpu.)"""
    import time

    cfg = Config(**{**SMALL, "timeout_s": 2.0})
    buf = Buffer(None, cfg, device="cpu")
    if buf.role == "ffn":
        time.sleep(6.0)  # alive but silent, past the Attention rank's timeout
        try:
            buf.close()  # the Attention rank left: close reports it, no hang
        except torch_afdep.AfdepTimeoutError as e:
            return str(e)
        return None
    x, ids, w = attn_inputs(cfg, 4, 3)
    ids[:, 0] = 0  # every token goes to the FFN rank
    buf.source_dispatch(x, ids, w, bucket=8)
    t0 = time.monotonic()
    try:
        buf.source_collect()
    except torch_afdep.AfdepTimeoutError as e:
        waited = time.monotonic() - t0
        info = (e.peer, e.phase, e.rank, waited, str(e))
    else:
        raise AssertionError("source_collect did not time out")
    try:
        buf.source_dispatch(x, ids, w, bucket=8)
        raise AssertionError("a broken buffer accepted another exchange")
    except AfdepStateError as e:
        assert "unusable after an earlier failure" in str(e)
    buf.close()
    return info
