"""The exchange contract with real processes, on every device: layouts, dtypes, token counts,
routings, consecutive exchanges, explicit roles and zero-copy collects, against the fp64
single-process reference; every FFN rank checks what it received exactly."""

import pytest
import torch

from torch_afdep import Config

from tests.helpers import exchange_bodies as xb
from tests.helpers.devices import spawn_on


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


def _check_results(cases, results, layout):
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


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_exchange_matches_fp64_reference(layout, device):
    f, a, e, k = LAYOUTS[layout]
    cases = _cases(f, a, e, k)
    results = spawn_on(device, xb.run_exchanges, f + a, cases, 1234, timeout=300)
    _check_results(cases, results, layout)


@pytest.mark.devices("cuda")
@pytest.mark.parametrize("layout,dtype", [("1A1F", torch.bfloat16),
                                          ("2A2F", torch.float8_e4m3fn)])
def test_exchange_at_gpu_sizes(layout, dtype, device):
    """Sizes the CUDA kernels split over many CTAs (hidden 2,048, E 128, top-8, capacity
    128, 24 sender SMs): T = 0, 1, 7, 16, 128 and the bucket, three routings."""
    f, a = {"1A1F": (1, 1), "2A2F": (2, 2)}[layout]
    cfg = Config(capacity_tokens_per_rank=128, hidden_size=2048, num_experts=128, top_k=8,
                 ffn_ranks=f, attention_ranks=a, dtype=dtype, num_sms=24, timeout_s=10.0)
    plan = [(128, [7, 128][:a], "random"), (16, [0, 16][:a], "partial"),
            (128, [128, 1][:a], "skewed")]
    results = spawn_on(device, xb.run_exchanges, f + a, [(cfg, plan)], 77, timeout=300)
    _check_results([(cfg, plan)], results, layout)


def test_explicit_roles_interleaved(device):
    """Roles from Config(roles=...): FFN ranks need not come first."""
    roles = ("attention", "ffn", "attention", "ffn")
    cfg = Config(capacity_tokens_per_rank=8, hidden_size=128, num_experts=8, top_k=2,
                 ffn_ranks=2, attention_ranks=2, dtype=torch.bfloat16, roles=roles)
    cases = [(cfg, [(8, [8, 3], "random"), (8, [1, 0], "partial")])]
    results = spawn_on(device, xb.run_exchanges, 4, cases, 99, timeout=300)
    for rank in (0, 2):
        assert all(err < 1e-2 for err in results[rank][0])
    for rank in (1, 3):  # the FFN ranks checked what they received; something arrived
        assert len(results[rank][0]) == 2
    assert sum(sum(c) for r in (1, 3) for c in results[r][0]) > 0


def test_zero_copy_collect_3a1f(device):
    """``source_collect(zero_copy=True)`` with one FFN rank: results against the fp64
    reference, view lifetimes per slot (one storage per slot, two slots never share)."""
    results = spawn_on(device, xb.zero_copy_body, 4, timeout=240)
    attn = results[1:]
    for ptrs in attn:
        assert len(ptrs) == 5  # every zero-copy collect of the plan ran and was checked


def test_zero_copy_refused_with_two_ffn_ranks(device):
    assert spawn_on(device, xb.zero_copy_refused_body, 4, timeout=240) == [True] * 4
