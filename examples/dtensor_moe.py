"""Expert weights sharded over the FFN ranks with DTensor, an AFD MoE layer run through the ops.

    python examples/dtensor_moe.py [--layout 2A2F | --roles FFAA] [--steps 3] [--tokens 8]

Every rank joins one ``"afdep"`` process group (its roles from ``AFDEP_ROLES``, e.g.
``FFAA``: the layout's default order, FFN ranks first, or ``--roles``); the FFN ranks
build a DeviceMesh over their role group and shard the stacked SwiGLU weights ``[E, ...]``
with ``distribute_tensor(..., [Shard(0)])``, so FFN index f holds exactly the experts
``[f*E/F, (f+1)*E/F)`` the exchange routes to it. Attention ranks route with a softmax top-k
router and call ``afd_dispatch`` / ``afd_combine``; FFN ranks call ``afd_receive``, run their
local experts on the expert-major rows and ``afd_reply``. Outputs are checked against the
fp64 single-process layer.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

import torch_afdep
from torch_afdep.distributed import local_experts, role_meshes, shard_experts
from torch_afdep.testing import spawn_world
from torch_afdep.tools import cli, demo


def stacked_expert_weights():
    """w1, w3 [E, I, H] and w2 [E, H, I] float32 of all experts (the layer's full weights)."""
    ws = [demo._expert_weights(e, torch.float32) for e in range(demo.EXPERTS)]
    return tuple(torch.stack([w[i] for w in ws]) for i in range(3))


def rank_main(rank, world, cfg, steps, tokens):
    meshes = role_meshes(cfg, "cpu")
    group = dist.group.WORLD
    buf = torch_afdep.Buffer(group, cfg, device="cpu")
    errors, shards = [], None
    if buf.role == "ffn":
        # Rank 0 of the FFN mesh scatters the stacked weights; each FFN rank keeps its slice.
        full = stacked_expert_weights()
        w1, w3, w2 = (local_experts(shard_experts(w, meshes.ffn_mesh)) for w in full)
        lo = buf.role_index * cfg.experts_per_rank
        shards = (w1.shape[0], torch.equal(w1, full[0][lo:lo + cfg.experts_per_rank]))
    for step in range(steps):
        if buf.role == "attention":
            x32 = demo._tokens(buf.role_index, step, tokens)
            x = x32.to(torch.bfloat16)
            ids, w = demo.route(x32)
            route = torch_afdep.afd_dispatch(x, ids, w, group=group, bucket=tokens)
            out = torch_afdep.afd_combine(route, group=group)
            want = demo._reference(x, ids, w)
            errors.append(float((out.double() - want).norm() / want.norm()))
        else:
            rec = torch_afdep.afd_receive(group=group, bucket=tokens)
            offs = rec.expert_offsets.tolist()
            y = torch.zeros(rec.x.shape[0], cfg.hidden_size)
            for e in range(cfg.experts_per_rank):
                lo, hi = offs[e], offs[e + 1]
                if hi > lo:
                    y[lo:hi] = demo.swiglu(rec.x[lo:hi].float(), w1[e], w3[e], w2[e]) * \
                        rec.weights[lo:hi, None]
            torch_afdep.afd_reply(y.to(torch.bfloat16), rec.receipt, group=group)
    buf.close()
    return {"role": buf.role, "errors": errors, "shards": shards,
            "backend": str(dist.get_backend(group))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_layout_arguments(p, default="2A2F")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=8, help="tokens per Attention rank")
    args = p.parse_args(argv)
    a, f, roles = cli.resolve_layout(p, args)
    cfg = cli.make_config(p, capacity_tokens_per_rank=args.tokens, hidden_size=demo.HIDDEN,
                          num_experts=demo.EXPERTS, top_k=demo.TOP_K, ffn_ranks=f,
                          attention_ranks=a, roles=roles)
    # The backend's roles and the Config's must agree (Buffer checks): one spelling, FFAA.
    spec = "".join("F" if r == torch_afdep.FFN else "A" for r in cfg.role_list)
    results = spawn_world(rank_main, a + f, cfg, args.steps, args.tokens,
                          backend="afdep", env={"AFDEP_ROLES": spec})
    worst = 0.0
    for r, res in enumerate(results):
        if res["role"] == "ffn":
            n, exact = res["shards"]
            print(f"rank {r} ffn: holds {n} experts as a DTensor shard (exact slice: {exact})")
            worst = worst if exact else float("inf")
        else:
            worst = max([worst] + res["errors"])
            print(f"rank {r} attention: max rel. error {max(res['errors']):.2e} "
                  f"(backend {res['backend']})")
    ok = worst < 2e-2
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
