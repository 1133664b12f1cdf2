"""A compiled AFD MoE layer: ``torch_afdep.nn.AfdMoE`` under ``torch.compile(fullgraph=True)``.

    python examples/compiled_moe.py [--layout 2A2F | --roles FFAA] [--steps 4] [--tokens 8]
                                    [--receive-layout experts|tokens] [--backend inductor]
                                    [--device auto] [--allow-shared-gpu]

Spawns A Attention + F FFN ranks (CPU over gloo, or CUDA when GPUs and the CUDA extension are
present; ranks sharing a GPU need CUDA MPS). Every rank builds the same ``AfdMoE`` layer on one ``Buffer``: Attention ranks hold
the softmax top-k router and compile ``x -> router -> dispatch -> combine``; FFN ranks hold
their slice of the SwiGLU experts and compile ``receive -> grouped experts -> reply``
(``--receive-layout tokens``: one row per token received, its entries sorted by expert for
the grouped GEMM and summed back per token, one row per token replied). Each
role compiles into one graph (``fullgraph=True``: a graph break would be an error). The
outputs are checked against the same layer computed in float64 in one process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import torch_afdep
from torch_afdep.nn import AfdMoE, reference_moe
from torch_afdep.testing import spawn_world
from torch_afdep.tools import cli

HIDDEN, INTER, EXPERTS, TOP_K = 256, 128, 8, 2


def layer_weights(seed: int = 3):
    """Router [E, H] and stacked SwiGLU weights w1, w3 [E, I, H], w2 [E, H, I] (float32
    values that bfloat16 holds exactly, so the bf16 layer and the reference share them)."""
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(EXPERTS, HIDDEN, generator=g) * HIDDEN ** -0.5
    w1 = torch.randn(EXPERTS, INTER, HIDDEN, generator=g) * HIDDEN ** -0.5
    w3 = torch.randn(EXPERTS, INTER, HIDDEN, generator=g) * HIDDEN ** -0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * INTER ** -0.5
    return tuple(t.bfloat16().float() for t in (router, w1, w3, w2))


def tokens(a: int, step: int, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + a)
    return torch.randn(t, HIDDEN, generator=g).bfloat16().float()


def rank_main(rank, world, cfg, steps, t, backend, device_kind):
    torch.set_num_threads(1)  # several ranks share the machine's cores
    dev = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else \
        torch.device("cpu")
    buf = torch_afdep.Buffer(None, cfg, device=dev)
    router, w1, w3, w2 = layer_weights()
    moe = AfdMoE(buf, INTER, dtype=torch.bfloat16, device=dev)
    moe.load_weights(router, w1, w3, w2)  # each rank keeps what its role holds
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(backend)(gm, example_inputs)

    errors, times = [], []
    if buf.role == "attention":
        step_fn = torch.compile(lambda x: moe(x, return_routing=True), fullgraph=True,
                                backend=counting)
    else:
        step_fn = torch.compile(lambda: moe(), fullgraph=True, backend=counting)
    for step in range(steps):
        if buf.role == "attention":
            x = tokens(buf.role_index, step, t).to(dev)
            t0 = time.perf_counter()
            out, ids, w = step_fn(x)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            want = reference_moe(x, ids, w, w1, w3, w2)
            errors.append(float((out.cpu().double() - want).norm() / want.norm()))
        else:
            t0 = time.perf_counter()
            step_fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    method = moe.experts.method if moe.experts is not None else None
    buf.close()
    return {"role": buf.role, "index": buf.role_index, "graphs": len(graphs),
            "errors": errors, "times": times, "method": method}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_layout_arguments(p, default="2A2F")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--tokens", type=int, default=8, help="tokens per Attention rank")
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    cli.add_receive_layout_argument(p)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    cli.add_shared_gpu_argument(p)
    args = p.parse_args(argv)
    a, f, roles = cli.resolve_layout(p, args)
    kind = cli.device_kind(p, args.device)
    cfg = cli.make_config(p, capacity_tokens_per_rank=args.tokens, hidden_size=HIDDEN,
                          num_experts=EXPERTS, top_k=TOP_K, ffn_ranks=f, attention_ranks=a,
                          roles=roles, timeout_s=120.0, receive_layout=args.receive_layout)
    device_ids = None
    if kind == "cuda":  # before spawning: refuse GPUs shared without MPS
        device_ids = cli.gpu_placement(p, a + f, args.allow_shared_gpu)
    print(f"compiled AFD MoE: {a}A{f}F on {kind}, backend {args.backend}, {args.steps} steps "
          f"of {args.tokens} tokens per Attention rank, {cfg.receive_layout} receive layout",
          flush=True)
    results = spawn_world(rank_main, a + f, cfg, args.steps, args.tokens, args.backend, kind,
                          device_ids=device_ids, timeout=600)
    worst, ok = 0.0, True
    for r in results:
        later = r["times"][1:] or r["times"]
        med = statistics.median(later) * 1e3
        line = (f"  {r['role']} {r['index']}: {r['graphs']} graph (fullgraph), "
                f"first call {r['times'][0] * 1e3:,.0f} ms (compiles), then median "
                f"{med:,.2f} ms")
        if r["role"] == "attention":
            worst = max([worst] + r["errors"])
            line += f", max rel. error {max(r['errors']):.2e}"
        print(line)
        ok &= r["graphs"] == 1
    ok &= worst < 2e-2
    print(f"{'PASS' if ok else 'FAIL'}: max relative error {worst:.2e} against the fp64 "
          f"single-process layer (bf16 tolerance 2e-2)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
