"""torch_afdep.nn and the vLLM connector on CUDA: the AFD MoE block eager, compiled
(fullgraph, inductor) and with a two-micro-batch layer step captured in a CUDA graph; the
connector's ping-pong over layers captured in CUDA graphs on both roles. Every output is
checked against the fp64 single-process layer.

Skipped cleanly without two CUDA GPUs or without the built extension. The bodies take the
device from the spawned world (they also run on CPU without the graphs, for debugging).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


import gpu_worlds as gw  # noqa: E402  (tests/gpu is on sys.path under pytest)

gw.skip_unless_two_gpus()

import torch.distributed as dist  # noqa: E402

from torch_afdep import reference as ref  # noqa: E402

ENV = gw.GPU_ENV
H, I, E, K = 1024, 512, 32, 4


def _device():
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _weights(seed=1, layers=1):
    out = []
    for layer in range(layers):
        g = torch.Generator().manual_seed(seed + layer)
        router = torch.randn(E, H, generator=g) * H ** -0.5
        w1 = torch.randn(E, I, H, generator=g) * H ** -0.5
        w3 = torch.randn(E, I, H, generator=g) * H ** -0.5
        w2 = torch.randn(E, H, I, generator=g) * I ** -0.5
        out.append(tuple(t.bfloat16().float() for t in (router, w1, w3, w2)))
    return out


def _tokens(a, seed, t):
    g = torch.Generator().manual_seed(seed * 97 + a)
    return torch.randn(t, H, generator=g).bfloat16().float()


def _config(F, A, cap, dtype="bfloat16"):
    from torch_afdep import Config

    return Config(capacity_tokens_per_rank=cap, hidden_size=H, num_experts=E, top_k=K,
                  ffn_ranks=F, attention_ranks=A, num_slots=2, timeout_s=20.0,
                  dtype=getattr(torch, dtype))


def moe_body(rank, world, F, A, cap, tokens, replays, dtype="bfloat16", use_graph=True):
    """AfdMoE: eager, compiled (fullgraph), and a captured two-micro-batch step."""
    import torch_afdep
    from torch_afdep.nn import AfdMoE, quantize_fp8, reference_moe

    dev = _device()
    use_graph = use_graph and dev.type == "cuda"
    cfg = _config(F, A, cap, dtype)
    buf = torch_afdep.Buffer(dist.group.WORLD, cfg, device=dev)
    (router, w1, w3, w2), = _weights()
    moe = AfdMoE(buf, I, dtype=torch.bfloat16, device=dev)
    moe.load_weights(router, w1, w3, w2)
    a = buf.role_index
    errors = []
    tol = 2e-2

    def check(x, out, ids, w):
        x = x.cpu()
        if cfg.dtype == torch.float8_e4m3fn:  # the experts see the FP8 payload
            q, sc = quantize_fp8(x)
            x = q.float() * sc.repeat_interleave(128, dim=1)
        want = reference_moe(x, ids.cpu(), w.cpu(), w1, w3, w2)
        err = ref.relative_error(out.float().cpu(), want)
        assert err < tol, err
        errors.append(err)

    try:
        ffn = buf.role == "ffn"
        method = moe.experts.resolved_method() if ffn else None
        # eager
        if ffn:
            moe()
        else:
            x = _tokens(a, 0, tokens[0]).to(dev)
            check(x, *moe(x, return_routing=True))
        # compiled, fullgraph
        if ffn:
            serve = torch.compile(lambda: moe(), fullgraph=True)
            serve()
            serve()
        else:
            layer = torch.compile(lambda x: moe(x, return_routing=True), fullgraph=True)
            for s in (1, 2):
                x = _tokens(a, s, tokens[0]).to(dev)
                check(x, *layer(x))
        _sync(dev)
        # a two-micro-batch layer step in one CUDA graph
        if ffn:
            def step():
                moe(slot=0)
                return moe(slot=1)
        else:
            xs = [_tokens(a, 3, t).to(dev) for t in tokens]

            def step():
                r0, i0, w0 = moe.dispatch(xs[0], slot=0, return_routing=True)
                r1, i1, wt1 = moe.dispatch(xs[1], slot=1, return_routing=True)
                o1 = moe.combine(r1, slot=1)
                o0 = moe.combine(r0, slot=0)
                return [(o0, i0, w0), (o1, i1, wt1)]
        res = step()  # warm-up
        _sync(dev)
        if not ffn:
            for x, r in zip(xs, res):
                check(x, *r)
        if use_graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                res = step()
        dist.barrier()
        for k in range(replays):
            if not ffn:
                for ub, t in enumerate(tokens):
                    xs[ub].copy_(_tokens(a, 10 + 2 * k + ub, t))
            if use_graph:
                g.replay()
            else:
                res = step()
            _sync(dev)
            for t in buf.transports:
                t.check_error()
            if not ffn:
                for x, r in zip(xs, res):
                    check(x, *r)
        return {"role": buf.role, "method": method, "errors": errors}
    finally:
        _sync(dev)
        buf.close()


def connector_body(rank, world, F, A, layers, tokens, replays, use_graph=True):
    """The vLLM connector's ping-pong over layers, captured in one CUDA graph per rank."""
    from torch_afdep.integrations.vllm import AfdepConnector, ConnectorSettings
    from torch_afdep.nn import SwiGLUExperts, reference_moe, topk_route

    dev = _device()
    use_graph = use_graph and dev.type == "cuda"
    role = "ffn" if rank < F else "attention"
    idx = rank if role == "ffn" else rank - F
    settings = ConnectorSettings(
        role=role, num_attention_ranks=A, num_ffn_ranks=F, role_rank=idx,
        capacity_tokens_per_rank=max(tokens), hidden_size=H, num_experts=E, top_k=K,
        num_ubatches=2, num_layers=layers, device=dev.type, timeout_s=20.0)
    conn = AfdepConnector(rank, rank, settings)
    conn.init_afd_connector()
    weights = _weights(seed=50, layers=layers)
    checked = 0
    try:
        if role == "attention":
            xs = [_tokens(idx, 0, t).to(dev) for t in tokens]
            routers = [w[0].to(dev) for w in weights]  # no host copies inside the capture
            record = []

            def step():
                record.clear()
                h = list(xs)
                saved = [None, None]

                def send(layer, ub):
                    router = routers[layer]
                    hh = torch.tanh(h[ub]).bfloat16().float()  # stand-in attention
                    ids, w = topk_route(hh, router, K)
                    saved[ub] = (layer, hh, ids, w)
                    conn.send_attn_output(hh, {"topk_idx": ids, "topk_weights": w},
                                          ubatch_idx=ub)

                for ub in (0, 1):
                    send(0, ub)
                for layer in range(layers):
                    for ub in (0, 1):
                        out = conn.recv_ffn_output(None, ubatch_idx=ub)
                        # the slot's output buffer is reused by its next layer: keep a copy
                        record.append(saved[ub] + (out.clone(),))
                        h[ub] = saved[ub][1] + out.float()
                        if layer + 1 < layers:
                            send(layer + 1, ub)

            def check():
                nonlocal checked
                for layer, hh, ids, w, out in record:
                    _, w1, w3, w2 = weights[layer]
                    want = reference_moe(hh.cpu(), ids.cpu(), w.cpu(), w1, w3, w2)
                    err = ref.relative_error(out.float().cpu(), want)
                    assert err < 2e-2, (layer, err)
                    checked += 1

            step()
            _sync(dev)
            check()
            if use_graph:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    step()
            dist.barrier()
            for k in range(replays):
                for ub, t in enumerate(tokens):
                    xs[ub].copy_(_tokens(idx, k + 1, t))
                if use_graph:
                    g.replay()
                else:
                    step()
                _sync(dev)
                check()
        else:
            el = conn.config.experts_per_rank
            experts = []
            for layer in range(layers):
                ex = SwiGLUExperts(el, H, I, dtype=torch.bfloat16, device=dev)
                _, w1, w3, w2 = weights[layer]
                ex.load(*(t[idx * el:(idx + 1) * el].to(dev) for t in (w1, w3, w2)))
                experts.append(ex)

            def step():
                for _ in range(layers * 2):
                    rows, meta = conn.recv_attn_output()
                    y = experts[meta.layer_idx](rows, meta.topk_weights, meta.expert_offsets,
                                                meta.x_scales)
                    meta.weights_applied = True
                    conn.send_ffn_output(y, meta)

            step()
            _sync(dev)
            if use_graph:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    step()
            dist.barrier()
            for k in range(replays):
                if use_graph:
                    g.replay()
                else:
                    step()
                _sync(dev)
                checked += 1
        for t in conn.buffer.transports:
            t.check_error()
        return checked
    finally:
        _sync(dev)
        conn.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_afd_moe_eager_compiled_and_graph_1a1f(dtype):
    res = gw.spawn_gpu_world(moe_body, 2, 1, 1, 64, [64, 17], 10, dtype, device_ids=[0, 1], env=ENV,
                      timeout=600)
    ffn, attn = res
    assert ffn["method"] == "grouped"  # bf16 grouped GEMM on sm90
    assert len(attn["errors"]) == 1 + 2 + 2 + 2 * 10


def test_afd_moe_2a2f_graph():
    res = gw.spawn_gpu_world(moe_body, 4, 2, 2, 32, [32, 5], 5, device_ids=[0, 1, 0, 1], env=ENV,
                      timeout=600)
    assert all(len(r["errors"]) == 1 + 2 + 2 + 2 * 5 for r in res if r["role"] == "attention")


def test_vllm_connector_in_cuda_graphs_1a1f():
    res = gw.spawn_gpu_world(connector_body, 2, 1, 1, 3, [48, 16], 10, device_ids=[0, 1], env=ENV,
                      timeout=600)
    assert res == [10, 3 * 2 * 11]
