"""Spawned-world bodies for the op, compile and error tests (module level: spawn pickles them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import torch_afdep
from torch_afdep import AfdepStateError, Buffer, Config
from torch_afdep import reference as ref

SMALL = dict(capacity_tokens_per_rank=8, hidden_size=128, num_experts=4, top_k=2,
             ffn_ranks=1, attention_ranks=1, timeout_s=30.0)


def _attn_inputs(cfg, t, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, cfg.hidden_size, generator=g).bfloat16()
    ids, w = ref.random_routing(cfg, t, "partial", generator=g)
    return x, ids, w


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
            x, ids, w = _attn_inputs(cfg, 5, 1)
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


def compile_body(rank, world):
    """torch.compile(fullgraph=True, backend=aot_eager) of one role step; returns the Dynamo
    graph's code and the max relative error over three compiled exchanges."""
    cfg = Config(**SMALL)
    buf = Buffer(None, cfg, device="cpu")
    name = buf.group_name
    graphs = []
    # The CUDA transport polls its error block through pybind11, which Dynamo cannot trace: an
    # untraceable poll here too (the traced wrappers must skip it; the ops poll at run time).
    polls = [0]
    for t in buf.transports:
        @torch.compiler.disable
        def poll(orig=t.check_error):
            polls[0] += 1
            orig()
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
            x, ids, w = _attn_inputs(cfg, 6, seed)
            got = step(x, ids, w)
            want = ref.moe_output(cfg, x, ids, w, lambda e, r: r) * 0.5
            errors.append(ref.relative_error(got, want))
    else:
        step = torch.compile(ffn_step, fullgraph=True, backend=recording_backend)
        for seed in range(3):
            _, ids, _ = _attn_inputs(cfg, 6, seed)
            offs = step()
            counts.append(((offs[1:] - offs[:-1]).tolist(),
                           ref.expert_counts(cfg, [ids])[0].tolist()))
    buf.close()
    return {"graphs": graphs, "errors": errors, "counts": counts, "polls": polls[0]}


from _exchange import _expect  # noqa: E402  (one helper for both body modules)


def bad_input_body(rank, world):
    """Every bad argument raises before any communication; the buffer still works after."""
    cfg = Config(**SMALL)
    messages = []
    with Buffer(None, cfg, device="cpu") as buf:
        x, ids, w = _attn_inputs(cfg, 5, 7)
        if buf.role == "attention":
            d = buf.source_dispatch
            cases = [
                (TypeError, "x must have dtype", (x.float(), ids, w), {"bucket": 8}),
                (TypeError, "x must be a torch.Tensor", (x.tolist(), ids, w), {"bucket": 8}),
                (ValueError, "x must have shape", (x[:, :64], ids, w), {"bucket": 8}),
                (ValueError, "x must be contiguous",
                 (torch.cat([x, x], 1)[:, ::2], ids, w), {"bucket": 8}),
                (ValueError, "x must be on cpu", (x.to("meta"), ids, w), {"bucket": 8}),
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
                 {"bucket": 8, "x_scales": torch.ones(5, 1)}),
            ]
            for exc, frag, args, kw in cases:
                messages.append(_expect(exc, frag, d, *args, **kw))
            _expect(AfdepStateError, "for ffn ranks", buf.worker_receive, 8)
            _expect(AfdepStateError, "without a preceding source_dispatch", buf.source_collect)
            buf.source_dispatch(x, ids, w, bucket=8)
            _expect(AfdepStateError, "twice without source_collect", buf.source_dispatch,
                    x, ids, w, bucket=8)
            out = buf.source_collect()
            want = ref.moe_output(cfg, x, ids, w, lambda e, r: r * (e + 1))
            assert ref.relative_error(out, want) < 1e-2
            # A second exchange after all of that still works.
            buf.source_dispatch(x, ids, w, bucket=8)
            out = buf.source_collect()
            assert ref.relative_error(out, want) < 1e-2
        else:
            _expect(AfdepStateError, "without a preceding worker_receive", buf.worker_reply,
                    torch.zeros(8 * 2, 128, dtype=torch.bfloat16), None)
            _expect(ValueError, "bucket must be in [1, 8]", buf.worker_receive, 0)
            rec = buf.worker_receive(8)
            rows = _identity_times_expert(cfg, rec)
            _expect(AfdepStateError, "twice without worker_reply", buf.worker_receive, 8)
            _expect(ValueError, "rows must have shape", buf.worker_reply, rows[:-1],
                    rec.receipt)
            _expect(TypeError, "rows must have dtype", buf.worker_reply, rows.float(),
                    rec.receipt)
            _expect(TypeError, "receipt must be the Receipt", buf.worker_reply, rows,
                    tuple(rec.receipt))
            _expect(ValueError, "receipt belongs to buffer", buf.worker_reply, rows,
                    rec.receipt._replace(buffer_key=("other", 3)))
            _expect(AfdepStateError, "stale receipt", buf.worker_reply, rows,
                    rec.receipt._replace(sequence=rec.receipt.sequence - 1))
            buf.worker_reply(rows, rec.receipt)
            rec2 = buf.worker_receive(8)
            _expect(AfdepStateError, "stale receipt", buf.worker_reply,
                    _identity_times_expert(cfg, rec2), rec.receipt)
            buf.worker_reply(_identity_times_expert(cfg, rec2), rec2.receipt)
    _expect(AfdepStateError, "closed", buf.source_dispatch if buf.role == "attention"
            else buf.worker_receive, *((x, ids, w, 8) if buf.role == "attention" else (8,)))
    buf.close()  # idempotent
    # World size that does not match the config.
    messages.append(_expect(ValueError, "attention_ranks + ffn_ranks",
                            Buffer, None, Config(**{**SMALL, "attention_ranks": 2})))
    return messages


def _identity_times_expert(cfg, rec):
    offs = rec.expert_offsets.tolist()
    rows = torch.full((rec.x.shape[0], cfg.hidden_size), float("nan"))
    for e in range(cfg.experts_per_rank):
        rows[offs[e]:offs[e + 1]] = rec.x[offs[e]:offs[e + 1]].float() * (e + 1)
    n = offs[-1]
    rows[:n] *= rec.weights[:n, None]
    return rows.bfloat16()


def mismatch_body(rank, world):
    """Configs that differ across ranks: every rank raises the same error."""
    cfg = Config(**{**SMALL, "hidden_size": 128 if rank == 0 else 256})
    try:
        Buffer(None, cfg, device="cpu")
    except ValueError as e:
        return str(e)
    return None


def registry_body(rank, world):
    """Two buffers on one group (different ids) and a buffer on a subgroup at once."""
    cfg = Config(**SMALL)
    b0 = Buffer(None, cfg, device="cpu")
    b1 = Buffer(None, cfg, device="cpu")
    assert (b0.buffer_id, b1.buffer_id) == (0, 1)
    errs = []
    for step, buf in enumerate((b1, b0, b1)):
        x, ids, w = _attn_inputs(cfg, 3 + step, 20 + step)
        if buf.role == "attention":
            buf.source_dispatch(x, ids, w, bucket=8)
            out = buf.source_collect()
            errs.append(ref.relative_error(out, ref.moe_output(cfg, x, ids, w,
                                                               lambda e, r: r * (e + 1))))
        else:
            rec = buf.worker_receive(8)
            buf.worker_reply(_identity_times_expert(cfg, rec), rec.receipt)
    try:
        torch_afdep.afd_combine(torch.zeros(1, dtype=torch.int64), group=b0.group_name)
        raise AssertionError("ambiguous buffer not detected")
    except RuntimeError as e:
        assert "open torch_afdep buffers" in str(e)
    b1.close()
    b0.close()
    dist.barrier()
    return errs


def timeout_body(rank, world):
    """The FFN rank never receives: the Attention rank raises AfdepTimeoutError naming the
    peer and the phase within the configured timeout, and both ranks shut down."""
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
    x, ids, w = _attn_inputs(cfg, 4, 3)
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


# ---- torch_afdep.nn ---------------------------------------------------------------------
NN_CFG = dict(capacity_tokens_per_rank=8, hidden_size=128, num_experts=8, top_k=2,
              ffn_ranks=2, attention_ranks=1, timeout_s=60.0)
NN_INTER = 64


def nn_weights(cfg, inter, seed=5):
    """Full layer weights (router [E, H], w1, w3 [E, I, H], w2 [E, H, I]), float32 values
    that bfloat16 holds exactly."""
    g = torch.Generator().manual_seed(seed)
    e, h = cfg.num_experts, cfg.hidden_size
    router = torch.randn(e, h, generator=g) * h ** -0.5
    w1 = torch.randn(e, inter, h, generator=g) * h ** -0.5
    w3 = torch.randn(e, inter, h, generator=g) * h ** -0.5
    w2 = torch.randn(e, h, inter, generator=g) * inter ** -0.5
    return tuple(t.bfloat16().float() for t in (router, w1, w3, w2))


def nn_tokens(cfg, a, step, t):
    g = torch.Generator().manual_seed(100 * step + a)
    return torch.randn(t, cfg.hidden_size, generator=g).bfloat16().float()


def nn_world_body(rank, world, backend="aot_eager"):
    """AfdMoE on 1A2F with expert weights as DTensors over the FFN mesh: eager with every
    expert method, compiled fullgraph (one and two micro-batch slots), FP8 payloads; the
    Attention rank checks every output against the single-process fp64 layer."""
    torch.set_num_threads(1)  # several ranks share few cores
    from torch_afdep.distributed import role_meshes, shard_experts
    from torch_afdep.nn import AfdMoE, quantize_fp8, reference_layer, reference_moe

    cfg = Config(**NN_CFG)
    meshes = role_meshes(cfg, "cpu")
    buf = Buffer(None, cfg, device="cpu")
    router_w, w1, w3, w2 = nn_weights(cfg, NN_INTER)
    moe = AfdMoE(buf, NN_INTER, dtype=torch.bfloat16)
    ffn = buf.role == "ffn"
    if ffn:
        moe.load_weights(w1=shard_experts(w1, meshes.ffn_mesh),
                         w3=shard_experts(w3, meshes.ffn_mesh),
                         w2=shard_experts(w2, meshes.ffn_mesh))
    else:
        moe.load_weights(router_w)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm.code)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(backend)(gm, example_inputs)

    res = {"role": buf.role, "errors": {}, "methods": []}
    a = buf.role_index

    def check(name, x, out, ids, w):
        want = reference_moe(x, ids, w, w1, w3, w2)
        err = ref.relative_error(out, want)
        res["errors"].setdefault(name, []).append(err)
        return want

    step = 0
    # Eager: every expert method gives the layer (FFN side switches, Attention the same call).
    for method in ("grouped", "dense", "loop"):
        if ffn:
            moe.experts.method = method
            res["methods"].append(moe.experts.resolved_method())
            done = moe()
            assert done.shape == (0,)
        else:
            x = nn_tokens(cfg, a, step, 7 if method != "dense" else 0)
            out, ids, w = moe(x, return_routing=True)
            assert out.dtype == x.dtype and out.shape == x.shape
            want = check("eager_" + method, x, out, ids, w)
            full = reference_layer(x, router_w, w1, w3, w2, cfg.top_k)
            assert torch.equal(full, want)  # the module routes exactly like the reference
        step += 1
    # Compiled, fullgraph.
    if ffn:
        moe.experts.method = "auto"
        serve = torch.compile(lambda: moe(), fullgraph=True, backend=recording)
        for _ in range(2):
            serve()
    else:
        layer = torch.compile(lambda x: moe(x, return_routing=True), fullgraph=True,
                              backend=recording)
        for t in (8, 8):
            x = nn_tokens(cfg, a, step, t)
            out, ids, w = layer(x)
            check("compiled", x, out, ids, w)
            step += 1
    res["graphs_one_slot"] = len(graphs)
    # Compiled two micro-batches on slots 0 and 1, overlapped: d0 d1 c1 c0 | r0 p0 r1 p1.
    if ffn:
        def two():
            moe(slot=0)
            return moe(slot=1)

        two_c = torch.compile(two, fullgraph=True, backend=recording)
        two_c()
    else:
        def two(x0, x1):
            r0, ids0, w0 = moe.dispatch(x0, slot=0, return_routing=True)
            r1, ids1, w1_ = moe.dispatch(x1, slot=1, return_routing=True)
            o1 = moe.combine(r1, slot=1)
            o0 = moe.combine(r0, slot=0)
            return o0, o1, ids0, w0, ids1, w1_

        two_c = torch.compile(two, fullgraph=True, backend=recording)
        x0, x1 = nn_tokens(cfg, a, step, 8), nn_tokens(cfg, a, step + 1, 5)
        o0, o1, ids0, w0, ids1, wt1 = two_c(x0, x1)
        check("compiled_two_slots", x0, o0, ids0, w0)
        check("compiled_two_slots", x1, o1, ids1, wt1)
    res["graphs"] = len(graphs)
    res["grouped_in_graphs"] = ["_grouped_mm" in g for g in graphs]
    assert all(p == "idle" for p in buf._slot_phase)
    buf.close()

    # FP8 payloads (quantized per 128 on the Attention rank), float32 parameters.
    cfg8 = Config(**{**NN_CFG, "dtype": torch.float8_e4m3fn})
    buf8 = Buffer(None, cfg8, device="cpu")
    moe8 = AfdMoE(buf8, NN_INTER, dtype=torch.float32)
    moe8.load_weights(router_w, w1, w3, w2)
    if ffn:
        moe8()
    else:
        x = nn_tokens(cfg, a, 50, 6)
        out, ids, w = moe8(x, return_routing=True)
        q, s = quantize_fp8(x)
        xq = q.float() * s.repeat_interleave(128, dim=1)
        want = reference_moe(xq, ids, w, w1, w3, w2)
        res["errors"]["fp8_fp32_params"] = [ref.relative_error(out, want)]
    buf8.close()
    return res


# ---- vLLM connector ---------------------------------------------------------------------
VLLM_LAYERS, VLLM_UBATCHES, VLLM_INTER = 3, 2, 32
VLLM_TOKENS = (6, 3)  # tokens per micro-batch on every Attention rank


def fake_vllm_config(role, role_rank, num_attention=2, num_ffn=2, **extra):
    """A stand-in VllmConfig: model sizes in hf_config, the plugin's AFD config in
    additional_config["afd"]."""
    from types import SimpleNamespace

    hf = SimpleNamespace(hidden_size=128, n_routed_experts=8, num_experts_per_tok=2,
                         num_hidden_layers=VLLM_LAYERS)
    afd = {"enabled": True, "connector": "afdep", "role": role,
           "num_attention_ranks": num_attention, "num_ffn_ranks": num_ffn,
           "afd_role_rank": role_rank, "host": "127.0.0.1", "port": 29655,
           "extra_config": {"capacity_tokens_per_rank": 8, "num_ubatches": VLLM_UBATCHES,
                            "timeout_s": 60.0, **extra}}
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=hf),
                           additional_config={"afd": afd})


def vllm_layer_weights(layer, hidden=128, experts=8, inter=VLLM_INTER):
    from torch_afdep.demo import synthetic_layer

    attn, router, w1, w3, w2 = synthetic_layer(700 + layer, hidden, inter, experts)
    return router, attn, w1, w3, w2


def vllm_tokens(a, step, ub, t, hidden=128):
    g = torch.Generator().manual_seed(10_000 * step + 100 * a + ub)
    return torch.randn(t, hidden, generator=g).bfloat16().float()


def vllm_world_body(rank, world, steps=3):
    """Replay the AFD plugin's call sequence on 1A2F: two micro-batches ping-ponged over
    several layers, a warm-up step, then a "capture" phase with static inputs and outputs
    (the connector's preallocated per-slot output, and an engine-owned output tensor). Every
    layer's output is checked against the single-process fp64 MoE of that layer."""
    torch.set_num_threads(1)  # several ranks share few cores
    from torch_afdep import AfdepStateError
    from torch_afdep.integrations.vllm import AfdepConnector
    from torch_afdep.nn import SwiGLUExperts, reference_moe, topk_route

    role = "ffn" if rank < 2 else "attention"
    idx = rank if role == "ffn" else rank - 2
    conn = AfdepConnector(rank, 0, fake_vllm_config(role, idx, num_attention=world - 2))
    res = {"role": role, "errors": [], "messages": []}

    def expect(exc, frag, fn, *a, **k):
        try:
            fn(*a, **k)
        except exc as e:
            assert frag in str(e), (frag, str(e))
            res["messages"].append(str(e))
            return
        raise AssertionError(f"no {exc.__name__} ({frag})")

    expect(AfdepStateError, "init_afd_connector", conn.recv_ffn_output
           if role == "attention" else conn.recv_attn_output)
    conn.init_afd_connector()
    assert conn.is_initialized and conn.buffer.config.num_slots == VLLM_UBATCHES
    weights = [vllm_layer_weights(l) for l in range(VLLM_LAYERS)]
    L, U = VLLM_LAYERS, VLLM_UBATCHES
    if role == "attention":
        expect(AfdepStateError, "nothing was sent on ubatch 1", conn.recv_ffn_output,
               ubatch_idx=1)
        expect(ValueError, "ubatch_idx must be in [0, 2)", conn.send_attn_output,
               torch.zeros(1, 128), None, 2, topk_ids=torch.zeros(1, 2, dtype=torch.int64),
               topk_weights=torch.ones(1, 2))
        expect(AfdepStateError, "for ffn ranks", conn.recv_attn_output)
        static_x = [torch.zeros(t, 128) for t in VLLM_TOKENS]
        engine_out = torch.zeros(VLLM_TOKENS[1], 128, dtype=torch.bfloat16)
        ptrs = {}
        for step in range(steps):
            capture = step > 0  # warm-up step, then "captured" steps on static tensors
            h = []
            for ub, t in enumerate(VLLM_TOKENS):
                x = vllm_tokens(idx, step, ub, t)
                if capture:
                    static_x[ub].copy_(x)
                    x = static_x[ub]
                h.append(x)
            layer_in = [None] * U

            def attention_and_send(layer, ub):
                router, attn, *_ = weights[layer]
                hh = (h[ub] + 0.5 * torch.tanh(h[ub] @ attn.T)).bfloat16().float()
                ids, w = topk_route(hh, router, 2)
                layer_in[ub] = (hh, ids, w)
                meta = {"layer_idx": layer, "stage_idx": ub, "topk_idx": ids,
                        "topk_weights": w}
                return conn.send_attn_output(hh, meta, ubatch_idx=ub)

            handles = [attention_and_send(0, ub) for ub in range(U)]
            if step == 0:
                expect(AfdepStateError, "ubatch 0 was sent and not received",
                       conn.send_attn_output, h[0], {"topk_ids": layer_in[0][1],
                                                     "topk_weights": layer_in[0][2]}, 0)
            for layer in range(L):
                for ub in range(U):
                    if capture and ub == 1:
                        out = conn.recv_ffn_output(engine_out, ubatch_idx=ub)
                        assert out is engine_out
                    elif capture:
                        out = conn.recv_ffn_output(None, ubatch_idx=ub)
                        key = (layer, ub)
                        ptrs.setdefault(ub, set()).add(out.data_ptr())
                    else:
                        out = conn.recv_ffn_output(handles[ub])
                    hh, ids, w = layer_in[ub]
                    _, _, w1, w3, w2 = weights[layer]
                    want = reference_moe(hh, ids, w, w1, w3, w2)
                    res["errors"].append(ref.relative_error(out, want))
                    h[ub] = hh + out.float()
                    if layer + 1 < L:
                        handles[ub] = attention_and_send(layer + 1, ub)
        res["stable_outputs"] = {ub: len(p) for ub, p in ptrs.items()}
    else:
        expect(AfdepStateError, "pass the metadata", conn.send_ffn_output,
               torch.zeros(1, 128))
        el = conn.config.experts_per_rank
        experts = []
        for layer in range(L):
            ex = SwiGLUExperts(el, 128, VLLM_INTER, dtype=torch.float32)
            _, _, w1, w3, w2 = weights[layer]
            ex.load(*(t[idx * el:(idx + 1) * el] for t in (w1, w3, w2)))
            experts.append(ex)
        seen = []
        for step in range(steps):
            for layer in range(L):
                for ub in range(U):
                    rows, meta = conn.recv_attn_output()
                    seen.append((meta.layer_idx, meta.ubatch_idx))
                    assert meta.local_expert_start == idx * el
                    ex = experts[meta.layer_idx]
                    if layer % 2:  # the model applies the weights itself
                        y = ex(rows, meta.topk_weights, meta.expert_offsets, meta.x_scales)
                        meta.weights_applied = True
                    else:  # unweighted rows: the connector applies them
                        ones = torch.ones_like(meta.topk_weights)
                        y = ex(rows, ones, meta.expert_offsets, meta.x_scales)
                    conn.send_ffn_output(y, meta, ubatch_idx=ub)
        assert seen == [(l, u) for _ in range(steps) for l in range(L) for u in range(U)], seen
    conn.close()
    conn.close()  # idempotent
    return res
