"""The main job: a small AFD MoE layer run through the exchange, checked against one process.

    python -m torch_afdep.demo [--layout 2A2F | --roles FFAA] [--steps 5] [--tokens 16]
                               [--receive-layout experts|tokens] [--device auto]
                               [--allow-shared-gpu]

Spawns A Attention + F FFN ranks (CPU over gloo, or CUDA when GPUs and the CUDA extension
are present; ranks share GPUs round robin when there are fewer GPUs than ranks, which needs
CUDA MPS: without it the demo refuses unless ``--allow-shared-gpu``). Attention ranks route
their tokens with a softmax top-k router; FFN ranks run SwiGLU experts on the rows they
receive (``--receive-layout experts``, the default: rows grouped by local expert, one
weighted row per (token, expert) back; ``tokens``: one row per token with its local expert
ids and weights, the token's weighted sum back); the combined outputs are checked against the same layer computed in fp64 in a single
process, and a short report is printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from torch_afdep.testing import spawn_world
from torch_afdep.tools import cli

HIDDEN, INTER, EXPERTS, TOP_K = 256, 512, 8, 2


def _expert_weights(e: int, dtype=torch.float64):
    """SwiGLU weights of global expert e (w1, w3 [I, H], w2 [H, I]); any process can rebuild
    them from e, which is how the single-process reference gets the same layer."""
    g = torch.Generator().manual_seed(10_000 + e)
    s = HIDDEN ** -0.5
    w1 = torch.randn(INTER, HIDDEN, generator=g) * s
    w3 = torch.randn(INTER, HIDDEN, generator=g) * s
    w2 = torch.randn(HIDDEN, INTER, generator=g) * INTER ** -0.5
    return w1.to(dtype), w3.to(dtype), w2.to(dtype)


def synthetic_layer(seed: int, hidden: int, inter: int, experts: int):
    """Random weights of one decoder layer (an attention stand-in and its MoE), the same in
    every process for the same arguments: (attn [H, H], router [E, H], w1 [E, I, H],
    w3 [E, I, H], w2 [E, H, I]), float32, scaled by 1/sqrt(fan-in)."""
    g = torch.Generator().manual_seed(seed)
    h, i = hidden ** -0.5, inter ** -0.5
    attn = torch.randn(hidden, hidden, generator=g) * h
    router = torch.randn(experts, hidden, generator=g) * h
    w1 = torch.randn(experts, inter, hidden, generator=g) * h
    w3 = torch.randn(experts, inter, hidden, generator=g) * h
    w2 = torch.randn(experts, hidden, inter, generator=g) * i
    return attn, router, w1, w3, w2


def _router_weight(dtype=torch.float64):
    g = torch.Generator().manual_seed(7)
    return (torch.randn(EXPERTS, HIDDEN, generator=g) * HIDDEN ** -0.5).to(dtype)


def route(x: torch.Tensor, top_k: int = TOP_K):
    """Softmax top-k router: x [T, H] -> (expert_ids [T, k] int64, weights [T, k] float32),
    weights renormalized over the chosen experts."""
    logits = x.to(torch.float32) @ _router_weight(torch.float32).to(x.device).T
    probs = logits.softmax(dim=-1)
    w, ids = probs.topk(top_k, dim=-1)
    return ids, (w / w.sum(dim=-1, keepdim=True)).to(torch.float32)


def swiglu(x: torch.Tensor, w1, w3, w2) -> torch.Tensor:
    """[n, H] -> [n, H]: w2 (silu(w1 x) * w3 x)."""
    return (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def _tokens(a: int, step: int, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + a)
    return torch.randn(t, HIDDEN, generator=g)


def _rank_main(rank, world, cfg, steps, tokens, device_kind):
    import torch_afdep

    dev = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else \
        torch.device("cpu")
    if dev.type == "cpu":
        torch.set_num_threads(1)  # several ranks share the cores: no thread oversubscription
    buf = torch_afdep.Buffer(None, cfg, device=dev)
    times, errors, rows = [], [], []
    if buf.role == "ffn":
        el = cfg.experts_per_rank
        experts = [[w.to(dev, torch.float32) for w in _expert_weights(buf.role_index * el + e)]
                   for e in range(el)]
    for step in range(steps):
        if buf.role == "attention":
            x32 = _tokens(buf.role_index, step, tokens)
            x = x32.to(torch.bfloat16)
            ids, w = route(x32)
            x, ids, w = x.to(dev), ids.to(dev), w.to(dev)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            buf.source_dispatch(x, ids, w, bucket=cfg.capacity_tokens_per_rank)
            out = buf.source_collect()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            want = _reference(x.cpu(), ids.cpu(), w.cpu())
            err = (out.cpu().double() - want).norm() / want.norm().clamp(min=1e-30)
            errors.append(float(err))
        else:
            rec = buf.worker_receive(cfg.capacity_tokens_per_rank)
            if cfg.receive_layout == "tokens":
                y, n = _token_experts(rec, experts, cfg.hidden_size)
            else:
                y, n = _expert_major_experts(rec, experts, cfg.hidden_size)
            buf.worker_reply(y.to(torch.bfloat16), rec.receipt)
            rows.append(n)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    buf.close()
    return {"role": buf.role, "index": buf.role_index, "times": times, "errors": errors,
            "rows": rows, "device": str(dev)}


def _expert_major_experts(rec, experts, hidden: int):
    """The expert layout's FFN work: each local expert on its slice of the rows.

    Arguments:
        rec: a ``Received`` (x [A*bucket*R, H] bfloat16 grouped by local expert, weights
            [A*bucket*R] float32, expert_offsets [E_local+1] int32).
        experts: per local expert (w1 [I, H], w3 [I, H], w2 [H, I]) float32.
        hidden: H.
    Returns:
        (y [A*bucket*R, H] float32, row i = weights[i] * its expert's output, zeros past
        the rows; rows: the received expert rows, an int read on the host).
    """
    offs = rec.expert_offsets.tolist()  # host copy: fine for a demo
    y = torch.zeros(rec.x.shape[0], hidden, dtype=torch.float32, device=rec.x.device)
    for e, (w1, w3, w2) in enumerate(experts):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            y[lo:hi] = swiglu(rec.x[lo:hi].float(), w1, w3, w2) * rec.weights[lo:hi, None]
    return y, offs[-1]


def _token_experts(rec, experts, hidden: int):
    """The token layout's FFN work: each local expert on the rows that name it, weighted and
    summed per token.

    Arguments:
        rec: a ``TokenReceived`` (x [N, H] bfloat16, one row per token, read only;
            expert_ids [N, k] int32 local ids or -1; weights [N, k] float32).
        experts: per local expert (w1 [I, H], w3 [I, H], w2 [H, I]) float32.
        hidden: H.
    Returns:
        (y [N, H] float32, row r = sum over its local ids e of weight * expert e's output,
        zeros for rows without a token; rows: the tokens received, an int read on the host).
    """
    ids = rec.expert_ids.to(torch.int64)
    y = torch.zeros(rec.x.shape[0], hidden, dtype=torch.float32, device=rec.x.device)
    for e, (w1, w3, w2) in enumerate(experts):
        r, j = (ids == e).nonzero(as_tuple=True)  # host sync: fine for a demo
        if r.numel():
            y.index_add_(0, r, swiglu(rec.x[r].float(), w1, w3, w2) * rec.weights[r, j, None])
    return y, int(rec.num_tokens.sum())


def _reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The whole MoE layer for one Attention rank's tokens, in fp64, in this process."""
    xd = x.to(torch.float64)
    out = torch.zeros_like(xd)
    for e in ids.unique().tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        out.index_add_(0, tok, swiglu(xd[tok], *_expert_weights(e)) * w[tok, j, None].double())
    return out


#: argparse types of ``--layout`` (kept under the names the examples used).
parse_layout = cli.layout
_cuda_ready = cli.cuda_ready


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_afdep.demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_layout_arguments(p, default="2A2F")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--tokens", type=int, default=16, help="tokens per Attention rank")
    cli.add_receive_layout_argument(p)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    cli.add_shared_gpu_argument(p)
    args = p.parse_args(argv)
    a, f, roles = cli.resolve_layout(p, args)
    kind = cli.device_kind(p, args.device)
    cfg = cli.make_config(p, capacity_tokens_per_rank=max(args.tokens, 1), hidden_size=HIDDEN,
                          num_experts=EXPERTS, top_k=TOP_K, ffn_ranks=f, attention_ranks=a,
                          roles=roles, timeout_s=60.0, receive_layout=args.receive_layout)
    world = a + f
    device_ids = None
    if kind == "cuda":  # before spawning: refuse GPUs shared without MPS
        device_ids = cli.gpu_placement(p, world, args.allow_shared_gpu)
    order = f" (roles {''.join(r[0].upper() for r in cfg.role_list)})" if roles else ""
    print(f"torch_afdep demo: {a}A{f}F{order} on {kind}"
          + (f" (GPUs {device_ids})" if device_ids else " (gloo)")
          + f", {EXPERTS} SwiGLU experts (H={HIDDEN}, I={INTER}), top-{TOP_K}, "
          f"{args.tokens} tokens per Attention rank, {args.steps} steps, "
          f"{cfg.receive_layout} receive layout", flush=True)
    t0 = time.perf_counter()
    results = spawn_world(_rank_main, world, cfg, args.steps, args.tokens, kind,
                          backend="gloo", device_ids=device_ids, timeout=600)
    wall = time.perf_counter() - t0
    worst = 0.0
    for r in results:
        if r["role"] == "attention":
            med = statistics.median(r["times"]) * 1e6 if r["times"] else 0.0
            worst = max([worst] + r["errors"])
            print(f"  attention {r['index']}: max rel. error {max(r['errors']):.2e}, "
                  f"median exchange {med:,.0f} us (eager, wall clock)")
        else:
            what = "tokens" if cfg.receive_layout == "tokens" else "expert rows"
            print(f"  ffn {r['index']}: {what} per step {r['rows']}")
    ok = worst < 2e-2
    print(f"{'PASS' if ok else 'FAIL'}: max relative error {worst:.2e} against the fp64 "
          f"single-process layer (bf16 tolerance 2e-2); {wall:.1f} s in all")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
