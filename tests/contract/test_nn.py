"""torch_afdep.nn on CPU with real processes: the AFD MoE block (router, dispatch, combine |
receive, SwiGLU experts on DTensor-sharded weights, reply) eager with every expert method,
under torch.compile(fullgraph=True) with one and two micro-batch slots, FP8 payloads, all
against the single-process fp64 layer; the expert formulations against each other without a
world; and the compiled MoE example. (On CUDA the layer is tested eager, compiled and in
CUDA graphs by tests/gpu/test_cuda_graphs.py: DTensor experts on a CUDA mesh need NCCL, one
rank per GPU.)"""

import os
import sys

import pytest
import torch

from torch_afdep.testing import spawn_world

from tests.helpers import nn_bodies

#: examples/ at the repository root (this file is tests/contract/<name>.py)
EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")


def test_afd_moe_world():
    ffn0, ffn1, attn = spawn_world(nn_bodies.nn_world_body, 3, timeout=240)
    assert ffn0["methods"] == ffn1["methods"] == ["grouped", "dense", "loop"]
    errs = attn["errors"]
    assert sorted(errs) == ["compiled", "compiled_two_slots", "eager_dense", "eager_grouped",
                            "eager_loop", "fp8_fp32_params"]
    for name, values in errs.items():
        tol = 1e-2 if name.startswith("fp8") else 2e-2  # bf16 parameters and activations
        assert all(e < tol for e in values), (name, values)
    # fullgraph: one graph per compiled function on each role.
    for r in (ffn0, ffn1, attn):
        assert r["graphs_one_slot"] == 1 and r["graphs"] == 2, r
    # bf16 experts trace with the grouped GEMM (no host read of the offsets).
    assert ffn0["grouped_in_graphs"] == ffn1["grouped_in_graphs"] == [True, True]
    assert attn["grouped_in_graphs"] == [False, False]


def _received(n_rows, el, hidden, seed, dtype=torch.bfloat16):
    """A synthetic Received-like (x, weights, offsets) with padding rows full of NaN."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 4, (el,), generator=g)
    offs = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    n = int(offs[-1])
    assert n <= n_rows
    x = torch.randn(n_rows, hidden, generator=g).to(dtype)
    w = torch.rand(n_rows, generator=g)
    x[n:] = float("nan")
    w[n:] = float("nan")
    return x, w, offs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_methods_agree(dtype):
    from torch_afdep.nn import SwiGLUExperts, swiglu

    torch.manual_seed(0)
    ex = SwiGLUExperts(4, 64, 32, dtype=dtype)
    x, w, offs = _received(20, 4, 64, 1)
    outs = {}
    for m in ("grouped", "dense", "loop"):
        ex.method = m
        outs[m] = ex(x, w, offs)
        assert outs[m].dtype == torch.bfloat16 and outs[m].shape == (20, 64)
    n = int(offs[-1])
    want = torch.zeros(20, 64, dtype=torch.float64)
    o = offs.tolist()
    for e in range(4):
        sl = slice(o[e], o[e + 1])
        want[sl] = swiglu(x[sl].double(), ex.w13[e, :32].double(), ex.w13[e, 32:].double(),
                          ex.w2[e].double()) * w[sl, None].double()
    tol = 1e-2 if dtype == torch.float32 else 3e-2
    for m, out in outs.items():
        assert torch.isfinite(out).all(), m
        assert bool((out[n:] == 0).all()), m  # padding rows are zeros
        err = (out.double() - want).norm() / want.norm()
        assert err < tol, (m, float(err))


def test_compiled_dense_and_grouped_need_no_host_reads():
    """fullgraph compile of both host-read-free methods (a host read would graph-break)."""
    from torch_afdep.nn import SwiGLUExperts

    ex = SwiGLUExperts(3, 32, 16, dtype=torch.bfloat16)
    x, w, offs = _received(12, 3, 32, 2)
    for m in ("grouped", "dense"):
        ex.method = m
        got = torch.compile(ex, fullgraph=True, backend="aot_eager")(x, w, offs)
        torch.testing.assert_close(got, ex(x, w, offs), rtol=2e-2, atol=2e-2)
    ex.method = "loop"
    with pytest.raises(Exception):
        torch.compile(ex, fullgraph=True, backend="aot_eager")(x, w, offs)


def test_router_and_fp8_helpers():
    from torch_afdep.nn import TopKRouter, dequantize_rows, quantize_fp8

    r = TopKRouter(64, 8, 3)
    x = torch.randn(5, 64)
    ids, w = r(x)
    assert ids.dtype == torch.int64 and ids.shape == (5, 3) and w.dtype == torch.float32
    torch.testing.assert_close(w.sum(1), torch.ones(5))
    q, s = quantize_fp8(torch.randn(4, 256))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (4, 2)
    assert dequantize_rows(q, s, torch.float32).shape == (4, 256)


def test_compiled_moe_example(capsys):
    sys.path.insert(0, EXAMPLES)
    try:
        import compiled_moe

        assert compiled_moe.main(["--layout", "1A1F", "--steps", "2", "--tokens", "6",
                                  "--device", "cpu"]) == 0  # inductor
    finally:
        sys.path.remove(EXAMPLES)
    out = capsys.readouterr().out
    assert "PASS" in out and "fullgraph" in out
