"""CUDA-graph bodies through the public API (Buffer, afd_*, AfdMoE, the vLLM connector):
a two-micro-batch layer step in one graph, a graph destroyed and recaptured on one open
buffer, AfdMoE eager / compiled / captured, the connector's layer ping-pong captured. Every
replay is checked against the fp64 reference. The bodies take the device from the spawned
world (on a CPU-only world they run eagerly, without graphs, for debugging).
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from torch_afdep import reference as ref

from .checks import clean_ids, ffn_rows
from .devices import sync, world_device
from .exchange_bodies import lockstep_protocol
from .transport_bodies import check_attention, make_config


def _slot_inputs(cfg, tokens, routing, seed, slot):
    """Inputs of every Attention index for the exchange on ``slot`` (same on every rank)."""
    return [ref.make_inputs(cfg, tokens[a], routing, 2 * seed + slot, a)
            for a in range(cfg.attention_ranks)]


def _check_errors(buf):
    for t in buf.transports:
        t.check_error()


def two_microbatch_graph_body(rank, world, cfg_kw, tokens, replays, seed0, use_graph=True):
    """One CUDA graph per rank holding a whole two-micro-batch layer step."""
    import torch_afdep

    cfg = make_config(cfg_kw)
    dev = world_device()
    buf = torch_afdep.Buffer(dist.group.WORLD, cfg, device=dev)
    name = buf.group_name
    role, idx = buf.role, buf.role_index
    bucket = cfg.capacity_tokens_per_rank
    use_graph = use_graph and dev.type == "cuda"
    lockstep = lockstep_protocol()
    checked = 0
    try:
        if role == "attention":
            first = {s: _slot_inputs(cfg, tokens[s], "partial", seed0 - 1, s)[idx]
                     for s in (0, 1)}
            xs = {s: first[s][0].to(dev) for s in (0, 1)}
            ids = {s: first[s][1].to(torch.int64).to(dev) for s in (0, 1)}
            ws = {s: first[s][2].to(dev) for s in (0, 1)}
            scs = {s: None if first[s][3] is None else first[s][3].to(dev) for s in (0, 1)}

            def step():
                r0 = torch_afdep.afd_dispatch(xs[0], ids[0], ws[0], group=name, bucket=bucket,
                                              x_scales=scs[0], slot=0)
                r1 = torch_afdep.afd_dispatch(xs[1], ids[1], ws[1], group=name, bucket=bucket,
                                              x_scales=scs[1], slot=1)
                if lockstep:  # every rank combines slot 0, then slot 1
                    o0 = torch_afdep.afd_combine(r0, group=name, slot=0)
                    o1 = torch_afdep.afd_combine(r1, group=name, slot=1)
                else:  # role-aware: collect the later micro-batch first
                    o1 = torch_afdep.afd_combine(r1, group=name, slot=1)
                    o0 = torch_afdep.afd_combine(r0, group=name, slot=0)
                return {0: (r0, o0), 1: (r1, o1)}

            res = step()  # eager warm-up, checked
            if use_graph:
                torch.cuda.synchronize()
            for s in (0, 1):
                x, i, w, sc = first[s]
                check_attention(cfg, x, i, w, sc, *res[s])
            if use_graph:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    res = step()
                assert all(buf.phase(s) == "idle" for s in range(buf.num_slots))
            dist.barrier()
            for k in range(replays):
                fresh = {s: _slot_inputs(cfg, tokens[s], "partial", seed0 + k, s)[idx]
                         for s in (0, 1)}
                for s in (0, 1):
                    xs[s].copy_(fresh[s][0])
                    ids[s].copy_(fresh[s][1].to(torch.int64))
                    ws[s].copy_(fresh[s][2])
                    if scs[s] is not None:
                        scs[s].copy_(fresh[s][3])
                if use_graph:
                    g.replay()
                    torch.cuda.synchronize()
                else:
                    res = step()
                _check_errors(buf)
                for s in (0, 1):
                    x, i, w, sc = fresh[s]
                    check_attention(cfg, x, i, w, sc, *res[s])
                    checked += 1
        else:
            def step():
                outs, recs = {}, {}
                for s in (0, 1):
                    recs[s] = torch_afdep.afd_receive(group=name, bucket=bucket, slot=s)
                    outs[s] = recs[s].expert_offsets
                    if not lockstep:  # role-aware: answer each micro-batch as it arrives
                        _reply(recs.pop(s))
                for s in sorted(recs):  # lockstep: both receives, then both replies
                    _reply(recs[s])
                return outs

            def _reply(rec):
                rows = ffn_rows(cfg, idx, rec.x, rec.x_scales, rec.weights,
                                   rec.expert_offsets)
                torch_afdep.afd_reply(rows, rec.receipt, group=name)

            def check(offsets, seed):
                for s in (0, 1):
                    inputs = _slot_inputs(cfg, tokens[s], "partial", seed, s)
                    want = ref.expert_counts(cfg, [clean_ids(cfg, i[1])
                                                      for i in inputs])[idx]
                    offs = offsets[s].cpu().to(torch.int64)
                    assert torch.equal(offs[1:] - offs[:-1], want), (s, offs, want)

            offsets = step()
            if use_graph:
                torch.cuda.synchronize()
            check(offsets, seed0 - 1)
            if use_graph:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    offsets = step()
            dist.barrier()
            for k in range(replays):
                if use_graph:
                    g.replay()
                    torch.cuda.synchronize()
                else:
                    offsets = step()
                _check_errors(buf)
                check(offsets, seed0 + k)
                checked += 1
        return checked
    finally:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        buf.close()


def recapture_body(rank, world, cfg_kw, plan, replays):
    """For each T in ``plan``: capture one exchange per rank in a CUDA graph, replay it
    ``replays`` times with fresh inputs (checked every time), then destroy the graph; the
    buffer stays open across captures. Returns the number of checked replays."""
    import torch_afdep

    cfg = make_config(cfg_kw)
    dev = world_device()
    graphs = dev.type == "cuda"
    buf = torch_afdep.Buffer(dist.group.WORLD, cfg, device=dev)
    checked = 0
    try:
        for k, T in enumerate(plan):
            seeds = [1000 * (k + 1) + j for j in range(replays + 1)]
            x0, ids0, w0, sc0 = ref.make_inputs(cfg, T, "partial", seeds[0])
            if buf.role == "attention":
                xs, ids, ws = x0.to(dev), ids0.to(torch.int64).to(dev), w0.to(dev)

                def step():
                    buf.source_dispatch(xs, ids, ws, T)
                    return buf.source_collect()
            else:
                def step():
                    rec = buf.worker_receive(T)
                    rows = ffn_rows(cfg, 0, rec.x, rec.x_scales, rec.weights,
                                       rec.expert_offsets)
                    buf.worker_reply(rows, rec.receipt)
                    return rec.expert_offsets

            res = step()  # eager warm-up on the captured tensors (allocator, lazy init)
            sync(dev)
            g = None
            if graphs:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    res = step()
            dist.barrier()
            for j in range(1, replays + 1):
                x, i, w, sc = ref.make_inputs(cfg, T, "partial", seeds[j])
                if buf.role == "attention":
                    xs.copy_(x)
                    ids.copy_(i.to(torch.int64))
                    ws.copy_(w)
                    res.fill_(float("nan"))
                if graphs:
                    g.replay()
                else:
                    res = step()
                sync(dev)
                for t in buf.transports:
                    t.check_error()
                if buf.role == "attention":
                    check_attention(cfg, x, i, w, sc,
                                       ref.route_mask(cfg, clean_ids(cfg, i)), res)
                else:
                    want = ref.expert_counts(cfg, [clean_ids(cfg, i)])[0]
                    offs = res.cpu().to(torch.int64)
                    assert torch.equal(offs[1:] - offs[:-1], want), (k, j)
                checked += 1
            del g, res
            gc.collect()
            sync(dev)
            dist.barrier()
    finally:
        buf.close()
    return checked


# ---- torch_afdep.nn and the vLLM connector in CUDA graphs ----------------------------
H, I, E, K = 1024, 512, 32, 4


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


def _config(F, A, cap, dtype="bfloat16", receive_layout="experts"):
    from torch_afdep import Config

    return Config(capacity_tokens_per_rank=cap, hidden_size=H, num_experts=E, top_k=K,
                  ffn_ranks=F, attention_ranks=A, num_slots=2, timeout_s=20.0,
                  dtype=getattr(torch, dtype), receive_layout=receive_layout)


def moe_body(rank, world, F, A, cap, tokens, replays, dtype="bfloat16",
             receive_layout="experts", use_graph=True):
    """AfdMoE: eager, compiled (fullgraph), and a captured two-micro-batch step, in either
    receive layout (the FFN runs SwiGLUExperts.forward or forward_tokens)."""
    import torch_afdep
    from torch_afdep.nn import AfdMoE, quantize_fp8, reference_moe

    dev = world_device()
    use_graph = use_graph and dev.type == "cuda"
    cfg = _config(F, A, cap, dtype, receive_layout)
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
        sync(dev)
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
        sync(dev)
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
            sync(dev)
            for t in buf.transports:
                t.check_error()
            if not ffn:
                for x, r in zip(xs, res):
                    check(x, *r)
        return {"role": buf.role, "method": method, "errors": errors,
                "layout": buf.config.receive_layout}
    finally:
        sync(dev)
        buf.close()


def connector_body(rank, world, F, A, layers, tokens, replays, receive_layout="experts",
                   use_graph=True):
    """The vLLM connector's ping-pong over layers, captured in one CUDA graph per rank, in
    either receive layout (the FFN's model runs forward or forward_tokens)."""
    from torch_afdep.integrations.vllm import AfdepConnector, ConnectorSettings
    from torch_afdep.nn import SwiGLUExperts, reference_moe, topk_route

    dev = world_device()
    use_graph = use_graph and dev.type == "cuda"
    role = "ffn" if rank < F else "attention"
    idx = rank if role == "ffn" else rank - F
    settings = ConnectorSettings(
        role=role, num_attention_ranks=A, num_ffn_ranks=F, role_rank=idx,
        capacity_tokens_per_rank=max(tokens), hidden_size=H, num_experts=E, top_k=K,
        num_ubatches=2, num_layers=layers, device=dev.type, timeout_s=20.0,
        receive_layout=receive_layout)
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
            sync(dev)
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
                sync(dev)
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
                    ex = experts[meta.layer_idx]
                    if meta.receive_layout == "tokens":  # one weighted sum per token
                        y = ex.forward_tokens(rows, meta.topk_ids, meta.topk_weights,
                                              meta.x_scales)
                    else:
                        y = ex(rows, meta.topk_weights, meta.expert_offsets, meta.x_scales)
                        meta.weights_applied = True
                    conn.send_ffn_output(y, meta)

            step()
            sync(dev)
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
                sync(dev)
                checked += 1
        for t in conn.buffer.transports:
            t.check_error()
        return checked
    finally:
        sync(dev)
        conn.close()
