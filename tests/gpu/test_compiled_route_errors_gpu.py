"""Out-of-range expert ids inside ``torch.compile(fullgraph=True)`` on CUDA: the host cannot
read the ids there, so the dispatch kernel skips the entries (nothing out of bounds, the
exchange completes: the collect inside the same compiled step raises nothing) and the slot's
next dispatch raises ``AfdepRouteError`` (a ValueError)
naming ``expert_ids`` and its range, in the words of the eager check; the buffer stays usable.
The CPU path raises before sending, compiled or not (tests/contract/test_failures.py)."""

from __future__ import annotations

import pytest
import torch

import torch_afdep as ta
from torch_afdep import reference as ref

from tests.helpers import devices

pytestmark = pytest.mark.gpu
devices.require_gpu_module()


def _expert(e, rows):
    return rows * (1.0 + e / 8)


def compiled_bad_ids_body(rank, world):
    cfg = ta.Config(capacity_tokens_per_rank=8, hidden_size=128, num_experts=8, top_k=4,
                    ffn_ranks=1, attention_ranks=1, timeout_s=30.0)
    dev = devices.world_device()
    out = {}
    with ta.Buffer(None, cfg, device=dev) as buf:
        if buf.role == "attention":
            inp = ref.make_inputs(cfg, 3, "random", 1, 0, device=dev)

            @torch.compile(fullgraph=True, backend="aot_eager")
            def step(x, ids, w):
                return ta.afd_combine(ta.afd_dispatch(x, ids, w, bucket=8))

            for bad in (cfg.num_experts, 1000, -5):
                ids = inp.expert_ids.clone()
                ids[1, 2] = bad
                got = step(inp.x, ids, inp.weights)
                torch.cuda.synchronize()
                # the skipped entry contributes nothing: the output is that of the clean ids
                clean = torch.where(ids == bad, torch.full_like(ids, -1), ids)
                want = ref.moe_output(cfg, inp.x.cpu(), clean.cpu(), inp.weights.cpu(), _expert)
                out[("err", bad)] = ref.relative_error(got, want)
                try:
                    buf.source_dispatch(inp.x, inp.expert_ids, inp.weights, bucket=8)
                    out[("raised", bad)] = None
                except ValueError as e:
                    out[("raised", bad)] = (type(e).__name__, str(e))
                # still usable: a clean exchange
                buf.source_dispatch(inp.x, inp.expert_ids, inp.weights, bucket=8)
                want = ref.moe_output(cfg, inp.x.cpu(), inp.expert_ids.cpu(),
                                      inp.weights.cpu(), _expert)
                out[("after", bad)] = ref.relative_error(buf.source_collect(), want)
        else:
            for _ in range(6):  # three compiled exchanges, three clean ones
                rec = buf.worker_receive(8)
                xr = rec.x.float()
                rows = torch.zeros_like(xr)
                offs = rec.expert_offsets.tolist()
                for e in range(cfg.experts_per_rank):
                    lo, hi = offs[e], offs[e + 1]
                    rows[lo:hi] = _expert(e, xr[lo:hi]) * rec.weights[lo:hi, None]
                buf.worker_reply(rows.bfloat16(), rec.receipt)
            torch.cuda.synchronize()
    return out


def test_compiled_bad_ids_raise_route_error_on_the_next_op():
    out = devices.spawn_gpu_world(compiled_bad_ids_body, 2, timeout=300)[1]
    for bad in (8, 1000, -5):
        assert out[("err", bad)] < 2e-2, out
        kind, msg = out[("raised", bad)]
        assert kind == "AfdepRouteError", (bad, kind)
        assert "expert_ids must be in [-1, 8)" in msg and f"got {bad}" in msg, msg
        assert out[("after", bad)] < 2e-2, out
