"""The exchange contract on CPU with real processes (gloo): layouts, dtypes, token counts,
routings, consecutive exchanges, against the fp64 single-process reference."""

import pytest
import torch

from torch_afdep import Config
from torch_afdep.testing import spawn_world

import _exchange


def _cases(f, a, e, k, cap=8):
    out = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        cfg = Config(capacity_tokens_per_rank=cap, hidden_size=256, num_experts=e, top_k=k,
                     ffn_ranks=f, attention_ranks=a, dtype=dtype)
        # T in {0, 1, 7, bucket} across Attention ranks in one exchange, three routings,
        # consecutive exchanges with different buckets.
        ts = [0, 1, 7, cap]
        plan = [
            (cap, [ts[i % 4] for i in range(a)], "random"),
            (cap, [ts[(i + 1) % 4] for i in range(a)], "skewed"),
            (7, [min(7, ts[(i + 2) % 4]) for i in range(a)], "partial"),
            (cap, [ts[(i + 3) % 4] for i in range(a)], "random"),
        ]
        if a == 1:
            plan += [(cap, [0], "random"), (1, [1], "partial"), (cap, [7], "skewed")]
        out.append((cfg, plan))
    return out


LAYOUTS = {
    "1A1F": (1, 1, 8, 3),
    "2A2F": (2, 2, 8, 3),
    "3A1F": (1, 3, 8, 3),
    "1A3F": (3, 1, 12, 4),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_exchange_matches_fp64_reference(layout):
    f, a, e, k = LAYOUTS[layout]
    cases = _cases(f, a, e, k)
    results = spawn_world(_exchange.run_exchanges, f + a, cases, 1234)
    cfg0 = cases[0][0]
    for rank, per_case in enumerate(results):
        role = cfg0.role_of(rank)
        for (cfg, plan), res in zip(cases, per_case):
            assert len(res) == len(plan)
            if role == "attention":
                # bf16 output of fp32 sums: relative error well under 1e-2 (0 for T = 0).
                assert all(err < 1e-2 for err in res), (layout, cfg.dtype, res)
            else:
                assert all(len(c) == cfg.experts_per_rank for c in res)
    # Something was actually routed in every layout.
    ffn_rows = [sum(sum(c) for c in res) for r, pc in enumerate(results)
                if cfg0.role_of(r) == "ffn" for res in pc]
    assert sum(ffn_rows) > 0


def test_explicit_roles_interleaved():
    """Roles from Config(roles=...): FFN ranks need not come first."""
    roles = ("attention", "ffn", "attention", "ffn")
    cases = []
    for dtype in (torch.bfloat16,):
        cfg = Config(capacity_tokens_per_rank=8, hidden_size=128, num_experts=8, top_k=2,
                     ffn_ranks=2, attention_ranks=2, dtype=dtype, roles=roles)
        cases.append((cfg, [(8, [8, 3], "random"), (8, [1, 0], "partial")]))
    results = spawn_world(_exchange.run_exchanges, 4, cases, 99)
    for rank in (0, 2):
        assert all(err < 1e-2 for err in results[rank][0])
