"""torch_afdep.nn on CPU with real processes: the AFD MoE block (router, dispatch, combine |
receive, SwiGLU experts on DTensor-sharded weights, reply) eager with every expert method,
under torch.compile(fullgraph=True) with one and two micro-batch slots, FP8 payloads, all
against the single-process fp64 layer, in both receive layouts (expert-major rows, and one
row per token: Config(receive_layout="tokens")); the expert formulations against each other
and the fp64 reference without a world, for both layouts; and the compiled MoE example. (On CUDA the layer is tested eager, compiled and in
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


@pytest.mark.parametrize("receive_layout", ["experts", "tokens"])
def test_afd_moe_world(receive_layout):
    ffn0, ffn1, attn = spawn_world(nn_bodies.nn_world_body, 3, "aot_eager", receive_layout,
                                   timeout=240)
    assert ffn0["layout"] == ffn1["layout"] == attn["layout"] == receive_layout
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


@pytest.mark.parametrize("receive_layout", ["experts", "tokens"])
def test_compiled_moe_example(capsys, receive_layout):
    sys.path.insert(0, EXAMPLES)
    try:
        import compiled_moe

        assert compiled_moe.main(["--layout", "1A1F", "--steps", "2", "--tokens", "6",
                                  "--device", "cpu", "--receive-layout",
                                  receive_layout]) == 0  # inductor
    finally:
        sys.path.remove(EXAMPLES)
    out = capsys.readouterr().out
    assert "PASS" in out and "fullgraph" in out
    assert f"{receive_layout} receive layout" in out


# ---- the token layout's expert path, without a world -----------------------------------------
def _token_received(n_rows, k, el, hidden, seed, fp8=False):
    """A synthetic TokenReceived-like (x, x_scales, expert_ids, weights): fresh random rows,
    local ids in [0, el) or -1 (each id at most once per row, as the receive gives them),
    every third row without a token; rows without a token hold NaN payload (FP8: NaN
    scales), and the weights of -1 columns are NaN (poison: neither may reach the output)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.rand(n_rows, el, generator=g).argsort(dim=1)[:, :k].to(torch.int32)
    drop = torch.rand(n_rows, k, generator=g) < 0.3
    ids = torch.where(drop, torch.full_like(perm, -1), perm)
    empty = torch.arange(n_rows) % 3 == 1
    ids[empty] = -1
    w = torch.rand(n_rows, k, generator=g) + 0.1
    w[ids < 0] = float("nan")
    x32 = torch.randn(n_rows, hidden, generator=g)
    if fp8:
        from torch_afdep.nn import quantize_fp8

        x, scales = quantize_fp8(x32)
        scales[empty] = float("nan")
    else:
        x, scales = x32.bfloat16(), None
        x[empty] = float("nan")
    return x, scales, ids, w


def _token_reference(ex, x, scales, ids, w):
    """fp64: row r = sum_j [ids[r, j] >= 0] w[r, j] swiglu_{ids[r, j]}(x[r]) (0 elsewhere)."""
    from torch_afdep import reference as ref
    from torch_afdep.nn import swiglu

    xd = ref.dequantize(x, scales)
    i = ex.intermediate_size
    out = torch.zeros(x.shape[0], ex.hidden_size, dtype=torch.float64)
    for r, j in (ids >= 0).nonzero().tolist():
        e = int(ids[r, j])
        y = swiglu(xd[r:r + 1], ex.w13[e, :i].double(), ex.w13[e, i:].double(),
                   ex.w2[e].double())
        out[r] += float(w[r, j]) * y[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_token_expert_methods_agree(dtype, fp8):
    """forward_tokens with every formulation against the fp64 reference, poisoned rows and
    weights kept out, and against the expert layout's forward on the same entries expanded
    expert-major (the two layouts give the same layer)."""
    from torch_afdep.nn import SwiGLUExperts

    torch.manual_seed(11)
    el, k, n, h = 4, 3, 21, 128
    ex = SwiGLUExperts(el, h, 32, dtype=dtype)
    x, scales, ids, w = _token_received(n, k, el, h, 3 + fp8, fp8)
    want = _token_reference(ex, x, scales, ids, w)
    has = (ids >= 0).any(dim=1)
    assert int(has.sum()) >= n // 2 and bool((~has).any())
    # The expert layout of the same entries: rows grouped by expert, NaN padding past them.
    tok, col = (ids >= 0).nonzero(as_tuple=True)
    order = torch.argsort(ids[tok, col].to(torch.int64), stable=True)
    tok, col = tok[order], col[order]
    counts = torch.bincount(ids[tok, col].to(torch.int64), minlength=el)
    offs = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    pad = 5
    xe = torch.cat([x[tok], x[:pad].clone().fill_(float("nan"))])
    se = None if scales is None else torch.cat([scales[tok], torch.ones(pad, h // 128)])
    we = torch.cat([w[tok, col], torch.full((pad,), float("nan"))])
    tol = 2e-2 if dtype == torch.float32 else 4e-2
    for m in ("grouped", "dense", "loop"):
        ex.method = m
        out = ex.forward_tokens(x, ids, w, scales)
        assert out.dtype == torch.bfloat16 and out.shape == (n, h), m
        assert torch.isfinite(out).all(), m
        assert bool((out[~has] == 0).all()), m  # rows without a token are zeros
        err = (out.double() - want).norm() / want.norm()
        assert err < tol, (m, float(err))
        rows = ex(xe, we, offs, se).double()  # expert layout: one weighted row per entry
        summed = torch.zeros(n, h, dtype=torch.float64).index_add_(0, tok, rows[:len(tok)])
        assert (out.double() - summed).norm() / summed.norm() < tol, m
    if dtype == torch.bfloat16:  # every formulation computes the same thing
        ex.method = "loop"
        ref_out = ex.forward_tokens(x, ids, w, scales)
        for m in ("grouped", "dense"):
            ex.method = m
            torch.testing.assert_close(ex.forward_tokens(x, ids, w, scales), ref_out,
                                       rtol=2e-2, atol=2e-2)


def test_token_path_compiles_without_host_reads():
    """fullgraph compile of forward_tokens with grouped and dense (fixed-size N*k entries, no
    host reads); the graph of grouped holds the grouped GEMM, the sort and the index_add."""
    from torch_afdep.nn import SwiGLUExperts

    ex = SwiGLUExperts(3, 128, 16, dtype=torch.bfloat16)
    x, _, ids, w = _token_received(14, 2, 3, 128, 9)
    want = _token_reference(ex, x, None, ids, w)
    for m in ("grouped", "dense"):
        ex.method = m
        codes = []

        def recording(gm, example_inputs):
            codes.append(gm.code)
            return gm.forward

        fn = torch.compile(ex.forward_tokens, fullgraph=True, backend=recording)
        got = fn(x, ids, w)
        assert len(codes) == 1, m
        if m == "grouped":
            assert all(op in codes[0] for op in ("_grouped_mm", "argsort", "index_add")), m
        assert torch.isfinite(got).all(), m
        assert (got.double() - want).norm() / want.norm() < 4e-2, m
        # A second input of the same shapes reuses the graph (static shapes).
        x2, _, ids2, w2 = _token_received(14, 2, 3, 128, 10)
        got2 = fn(x2, ids2, w2)
        assert len(codes) == 1, m
        want2 = _token_reference(ex, x2, None, ids2, w2)
        assert (got2.double() - want2).norm() / want2.norm() < 4e-2, m
    ex.method = "loop"
    with pytest.raises(Exception):
        torch.compile(ex.forward_tokens, fullgraph=True, backend="aot_eager")(x, ids, w)
