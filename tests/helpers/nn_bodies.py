"""Spawned-world body of the ``torch_afdep.nn`` contract test (CPU: DTensor expert sharding
over a gloo FFN mesh, aot_eager compiles); the CUDA-graph AfdMoE bodies are in
``graph_bodies``."""

from __future__ import annotations

import torch

from torch_afdep import Buffer, Config
from torch_afdep import reference as ref


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


def nn_world_body(rank, world, backend="aot_eager", receive_layout="experts"):
    """AfdMoE on 1A2F with expert weights as DTensors over the FFN mesh: eager with every
    expert method, compiled fullgraph (one and two micro-batch slots), FP8 payloads; the
    Attention rank checks every output against the single-process fp64 layer.
    ``receive_layout`` is the buffers' ``Config.receive_layout`` (the FFN's expert path)."""
    torch.set_num_threads(1)  # several ranks share few cores
    from torch_afdep.distributed import role_meshes, shard_experts
    from torch_afdep.nn import AfdMoE, quantize_fp8, reference_layer, reference_moe

    cfg = Config(**NN_CFG, receive_layout=receive_layout)
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

    res = {"role": buf.role, "errors": {}, "methods": [], "layout": buf.config.receive_layout}
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
    assert all(buf.phase(s) == "idle" for s in range(buf.num_slots))
    buf.close()

    # FP8 payloads (quantized per 128 on the Attention rank), float32 parameters.
    cfg8 = Config(**{**NN_CFG, "dtype": torch.float8_e4m3fn}, receive_layout=receive_layout)
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
