"""torch_afdep's vLLM AFD connector driven by a minimal stand-in engine loop.

    python examples/vllm_connector_loop.py [--layout 1A1F] [--layers 3] [--steps 3]
                                           [--tokens 12] [--receive-layout experts|tokens]

Every rank builds the connector the way vLLM's AFD plugin does — ``AfdepConnector(rank,
local_rank, vllm_config)`` with the plugin's config in ``vllm_config.additional_config["afd"]``
and the model sizes in ``vllm_config.model_config.hf_config`` — and calls
``init_afd_connector()``. Then:

- the stand-in Attention engine splits each step's batch into two micro-batches
  (``ubatch_idx`` 0 and 1) and ping-pongs them through the layers: attention + router of one
  micro-batch, ``send_attn_output``, while the FFN side works on it the other micro-batch's
  attention runs, then ``recv_ffn_output`` into a static per-micro-batch output. The first
  step warms up; the later steps reuse static input buffers, as captured CUDA graphs would;
- the stand-in FFN server loops ``recv_attn_output`` -> its SwiGLU experts on the expert-major
  rows -> ``send_ffn_output``, knowing the layer from the returned metadata. With
  ``--receive-layout tokens`` (the connector's ``extra_config["receive_layout"]``) it gets
  token-major hidden states with ``topk_ids`` / ``topk_weights`` instead, as an FFN model
  runner's fused MoE takes them, and sends one row per token back.

Every layer's output is checked against the fp64 single-process MoE layer.
"""

from __future__ import annotations

import argparse
import sys
import time
from types import SimpleNamespace

import torch

from torch_afdep.integrations.vllm import parse_settings
from torch_afdep.nn import SwiGLUExperts, reference_moe, topk_route
from torch_afdep.testing import spawn_world
from torch_afdep.tools import cli, demo

HIDDEN, INTER, EXPERTS, TOP_K, UBATCHES = 128, 64, 8, 2, 2


def vllm_config(role: str, role_rank: int, a: int, f: int, layers: int, capacity: int,
                receive_layout: str = "experts"):
    """What the engine hands the connector (only the fields the connector reads)."""
    hf = SimpleNamespace(hidden_size=HIDDEN, n_routed_experts=EXPERTS,
                         num_experts_per_tok=TOP_K, num_hidden_layers=layers)
    afd = {"enabled": True, "connector": "afdep", "role": role, "num_attention_ranks": a,
           "num_ffn_ranks": f, "afd_role_rank": role_rank, "host": "127.0.0.1",
           "port": 29611, "extra_config": {"capacity_tokens_per_rank": capacity,
                                           "num_ubatches": UBATCHES, "timeout_s": 120.0,
                                           "receive_layout": receive_layout}}
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=hf),
                           additional_config={"afd": afd})


def layer_weights(layer: int):
    """(attn, router, w1, w3, w2) of one layer: see torch_afdep.demo.synthetic_layer."""
    return demo.synthetic_layer(400 + layer, HIDDEN, INTER, EXPERTS)


class StandInAttentionEngine:
    """The Attention side of a decode step with two micro-batches (DBO-style ping-pong)."""

    def __init__(self, conn, layers, tokens):
        self.conn, self.layers = conn, layers
        self.weights = [layer_weights(l) for l in range(layers)]
        half = (tokens + 1) // 2
        self.sizes = [half, tokens - half]
        self.static_in = [torch.zeros(t, HIDDEN) for t in self.sizes]
        self.static_out = [torch.zeros(t, HIDDEN, dtype=torch.bfloat16) for t in self.sizes]
        self.errors = []

    def _attention_and_send(self, layer, ub, h, saved):
        attn, router, *_ = self.weights[layer]
        hh = (h + 0.5 * torch.tanh(h @ attn.T)).bfloat16().float()  # "attention"
        ids, w = topk_route(hh, router, TOP_K)  # router on the Attention side
        meta = {"layer_idx": layer, "stage_idx": ub, "topk_idx": ids, "topk_weights": w}
        saved[ub] = (hh, ids, w)
        self.conn.send_attn_output(hh, meta, ubatch_idx=ub)

    def step(self, x: torch.Tensor, static: bool) -> torch.Tensor:
        mbs = list(torch.split(x, self.sizes))
        if static:  # replayed graphs read fixed input buffers
            for ub in range(UBATCHES):
                self.static_in[ub].copy_(mbs[ub])
                mbs[ub] = self.static_in[ub]
        saved = [None] * UBATCHES
        for ub in range(UBATCHES):
            self._attention_and_send(0, ub, mbs[ub], saved)
        for layer in range(self.layers):
            for ub in range(UBATCHES):
                dest = self.static_out[ub] if static else None
                out = self.conn.recv_ffn_output(dest, ubatch_idx=ub)
                hh, ids, w = saved[ub]
                _, _, w1, w3, w2 = self.weights[layer]
                want = reference_moe(hh, ids, w, w1, w3, w2)
                self.errors.append(float((out.double() - want).norm() /
                                         want.norm().clamp(min=1e-30)))
                mbs[ub] = hh + out.float()
                if layer + 1 < self.layers:
                    self._attention_and_send(layer + 1, ub, mbs[ub], saved)
        return torch.cat(mbs)


class StandInFfnServer:
    """The FFN side: receive, run this rank's experts of the layer, send back."""

    def __init__(self, conn, layers):
        self.conn = conn
        el, f = conn.config.experts_per_rank, conn.buffer.role_index
        self.experts = []
        for l in range(layers):
            ex = SwiGLUExperts(el, HIDDEN, INTER, dtype=torch.float32)
            _, _, w1, w3, w2 = layer_weights(l)
            ex.load(*(t[f * el:(f + 1) * el] for t in (w1, w3, w2)))
            self.experts.append(ex)
        self.served = 0

    def serve(self, exchanges: int) -> None:
        for _ in range(exchanges):
            rows, meta = self.conn.recv_attn_output()
            ex = self.experts[meta.layer_idx]
            if meta.receive_layout == "tokens":  # token-major: the fused MoE's own input
                y = ex.forward_tokens(rows, meta.topk_ids, meta.topk_weights, meta.x_scales)
            else:
                y = ex(rows, meta.topk_weights, meta.expert_offsets, meta.x_scales)
            meta.weights_applied = True
            self.conn.send_ffn_output(y, meta, ubatch_idx=meta.ubatch_idx)
            self.served += 1


def rank_main(rank, world, a, f, layers, steps, tokens, receive_layout="experts"):
    from torch_afdep.integrations.vllm import AfdepConnector

    torch.set_num_threads(1)
    role = "ffn" if rank < f else "attention"
    role_rank = rank if role == "ffn" else rank - f
    conn = AfdepConnector(rank, 0, vllm_config(role, role_rank, a, f, layers,
                                               (tokens + 1) // 2, receive_layout))
    conn.init_afd_connector()
    out = {"role": role, "index": role_rank, "times": []}
    if role == "attention":
        eng = StandInAttentionEngine(conn, layers, tokens)
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + role_rank)
            x = torch.randn(tokens, HIDDEN, generator=g).bfloat16().float()
            t0 = time.perf_counter()
            eng.step(x, static=step > 0)
            out["times"].append(time.perf_counter() - t0)
        out["errors"] = eng.errors
    else:
        srv = StandInFfnServer(conn, layers)
        srv.serve(steps * layers * UBATCHES)
        out["served"] = srv.served
    conn.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_layout_arguments(p, default="1A1F", with_roles=False)  # FFN ranks first
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=12, help="tokens per Attention rank and step")
    cli.add_receive_layout_argument(p)
    args = p.parse_args(argv)
    a, f, _ = cli.resolve_layout(p, args)
    # What every rank's connector will build: an unsupported layout fails here, not there.
    cli.build_or_error(p, a, f, lambda: parse_settings(
        vllm_config("ffn", 0, a, f, args.layers, (args.tokens + 1) // 2,
                    args.receive_layout)).afdep_config())
    print(f"vLLM AFD connector loop: {a}A{f}F on cpu (gloo), {args.layers} layers, "
          f"{UBATCHES} ubatches, {args.steps} steps (1 warm-up) of {args.tokens} tokens, "
          f"{args.receive_layout} receive layout", flush=True)
    results = spawn_world(rank_main, a + f, a, f, args.layers, args.steps, args.tokens,
                          args.receive_layout, timeout=600)
    worst = 0.0
    for r in results:
        if r["role"] == "attention":
            worst = max([worst] + r["errors"])
            ms = ", ".join(f"{t * 1e3:.1f}" for t in r["times"])
            print(f"  attention {r['index']}: step times {ms} ms; max rel. error per layer and "
                  f"ubatch {max(r['errors']):.2e}")
        else:
            print(f"  ffn {r['index']}: served {r['served']} (layer, ubatch) exchanges")
    ok = worst < 2e-2
    print(f"{'PASS' if ok else 'FAIL'}: max relative error {worst:.2e} against the fp64 "
          f"single-process MoE layer")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
