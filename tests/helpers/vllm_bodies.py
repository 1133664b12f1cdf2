"""Spawned-world body and stand-in config of the vLLM connector tests (the plugin's call
sequence on 1A2F, CPU, in either receive layout); the CUDA-graph connector body is in
``graph_bodies``."""

from __future__ import annotations

import torch

from torch_afdep import reference as ref


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


def vllm_world_body(rank, world, steps=3, receive_layout="experts"):
    """Replay the AFD plugin's call sequence on 1A2F: two micro-batches ping-ponged over
    several layers, a warm-up step, then a "capture" phase with static inputs and outputs
    (the connector's preallocated per-slot output, and an engine-owned output tensor, both
    poisoned with NaN before each receive). Every layer's output is checked against the
    single-process fp64 MoE of that layer. ``receive_layout`` goes to the connector's
    extra config; with ``"tokens"`` the FFN side checks the token-major hidden states and
    routing context it gets and replies one row per token (rows without a token NaN)."""
    torch.set_num_threads(1)  # several ranks share few cores
    from torch_afdep import AfdepStateError
    from torch_afdep.integrations.vllm import AfdepConnector
    from torch_afdep.nn import SwiGLUExperts, reference_moe, topk_route

    role = "ffn" if rank < 2 else "attention"
    idx = rank if role == "ffn" else rank - 2
    conn = AfdepConnector(rank, 0, fake_vllm_config(role, idx, num_attention=world - 2,
                                                    receive_layout=receive_layout))
    res = {"role": role, "errors": [], "messages": [], "problems": []}

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
    assert conn.buffer.config.receive_layout == receive_layout
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
                    if capture:  # poison: the receive must overwrite every row it returns
                        engine_out.fill_(float("nan"))
                        conn._outputs.fill_(float("nan"))
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
                    if receive_layout == "tokens":
                        res["problems"] += _check_token_meta(conn, rows, meta)
                        y = ex.forward_tokens(rows, meta.topk_ids, meta.topk_weights,
                                              meta.x_scales)
                        y[~meta.token_mask()] = float("nan")  # poison: must not be sent
                        if step == 0 and layer == 0 and ub == 0:
                            meta.weights_applied = False
                            expect(ValueError, "cannot be honored", conn.send_ffn_output, y,
                                   meta)
                            meta.weights_applied = True
                            expect(ValueError, "one row per received row",
                                   conn.send_ffn_output, y[:-1], meta)
                        conn.send_ffn_output(y, meta, ubatch_idx=ub)
                        continue
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


def _check_token_meta(conn, rows, meta):
    """What a token-layout receive gives the FFN runner: token-major hidden states [N, H],
    local ids [N, k] in [-1, E_local), weights 0 where the id is -1, one source token per
    row with a token and -1 elsewhere, num_tokens tokens in all. Returns problems."""
    cfg = conn.config
    n, k, el = cfg.token_rows(conn.bucket), cfg.top_k, cfg.experts_per_rank
    problems = []
    if meta.receive_layout != "tokens" or meta.expert_offsets is not None:
        problems.append(f"layout {meta.receive_layout!r}, offsets {meta.expert_offsets}")
    if tuple(rows.shape) != (n, cfg.hidden_size) or rows.dtype != torch.bfloat16:
        return problems + [f"hidden states {tuple(rows.shape)} {rows.dtype}"]
    ids, w = meta.topk_ids, meta.topk_weights
    if tuple(ids.shape) != (n, k) or ids.dtype != torch.int32 or tuple(w.shape) != (n, k):
        return problems + [f"ids {tuple(ids.shape)} {ids.dtype}, weights {tuple(w.shape)}"]
    if bool(((ids < -1) | (ids >= el)).any()):
        problems.append(f"ids out of [-1, {el}): {ids.tolist()}")
    if not bool((w[ids < 0] == 0).all()) or not bool((w[ids >= 0] > 0).all()):
        problems.append("weights not 0 exactly where the id is -1")
    mask = meta.token_mask()
    if int(mask.sum()) != int(meta.num_tokens.sum()):
        problems.append(f"{int(mask.sum())} rows with a token, num_tokens "
                        f"{meta.num_tokens.tolist()}")
    if not bool((meta.src_token[~mask] == -1).all()) or bool((meta.src_token[mask] < 0).any()):
        problems.append("src_token is not -1 exactly on rows without a token")
    g = meta.global_topk_ids()
    want = torch.where(ids >= 0, ids + meta.local_expert_start, -1)
    if not torch.equal(g, want):
        problems.append("global_topk_ids differ")
    if not bool(torch.isfinite(rows[mask].float()).all()):
        problems.append("a token's hidden state is not finite")
    return problems
