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


# ---- argument checks, without a world ----------------------------------------------------------
_CHECK_CFG = dict(capacity_tokens_per_rank=8, hidden_size=64, num_experts=4, top_k=2,
                  ffn_ranks=2, attention_ranks=1)


def _groupless_buffer(role):
    """A ``torch_afdep.Buffer`` of 1A2F (H=64, E=4, k=2, capacity 8) on CPU with no process
    group or transport behind it (its collective constructor skipped): what ``AfdMoE`` reads
    from a buffer, and nothing an exchange could run on."""
    from torch_afdep import Buffer, Config

    buf = Buffer.__new__(Buffer)
    buf.config = Config(**_CHECK_CFG)
    buf.group_name, buf.buffer_id = "no-such-group", 0
    buf.role, buf.role_index, buf.device = role, 0, torch.device("cpu")
    return buf


@pytest.fixture
def no_exchange(monkeypatch):
    """Every exchange op AfdMoE calls raises: a check that names the argument ran first."""
    import torch_afdep.nn as nn_mod

    def exchange(*args, **kwargs):
        raise AssertionError("an exchange started")

    for name in ("afd_dispatch", "afd_combine", "afd_receive", "afd_reply"):
        monkeypatch.setattr(nn_mod, name, exchange)


@pytest.fixture
def no_allocation(monkeypatch):
    """AfdMoE's submodules (the only allocations of its constructor) raise when built."""
    import torch_afdep.nn as nn_mod

    def build(*args, **kwargs):
        raise AssertionError("parameters were allocated")

    monkeypatch.setattr(nn_mod, "TopKRouter", build)
    monkeypatch.setattr(nn_mod, "SwiGLUExperts", build)


@pytest.mark.parametrize("role", ["attention", "ffn"])
@pytest.mark.parametrize("kwargs, exc, match", [
    ({"intermediate_size": 0}, ValueError, r"intermediate_size must be an int >= 1, got 0"),
    ({"intermediate_size": -1}, ValueError, r"intermediate_size must be an int >= 1, got -1"),
    ({"intermediate_size": 2.5}, TypeError,
     r"intermediate_size must be an int >= 1, got float 2\.5"),
    ({"intermediate_size": "32"}, TypeError,
     r"intermediate_size must be an int >= 1, got str '32'"),
    ({"intermediate_size": True}, TypeError,
     r"intermediate_size must be an int >= 1, got bool True"),
    ({"method": "bogus"}, ValueError, r"method must be one of \('auto', 'grouped', 'dense', "
                                      r"'loop'\), got 'bogus'"),
    ({"dtype": torch.int32}, TypeError,
     r"dtype must be one of torch\.bfloat16, torch\.float16, torch\.float32, torch\.float64 "
     r".*got torch\.int32"),
    ({"dtype": torch.float8_e4m3fn}, TypeError, r"dtype must be one of .*got torch\.float8"),
    ({"dtype": "bfloat16"}, TypeError, r"dtype must be one of .*got 'bfloat16'"),
    ({"router_dtype": torch.int64}, TypeError, r"router_dtype must be one of .*torch\.int64"),
    ({"bucket": 0}, ValueError, r"bucket must be in \[1, 8\], got 0"),
    ({"bucket": 9}, ValueError, r"bucket must be in \[1, 8\], got 9"),
])
def test_afd_moe_constructor_checks_arguments(role, kwargs, exc, match, no_allocation):
    """The same checks on both roles, before anything is allocated."""
    from torch_afdep.nn import AfdMoE

    kwargs = {"intermediate_size": 32, **kwargs}
    with pytest.raises(exc, match=match):
        AfdMoE(_groupless_buffer(role), **kwargs)


@pytest.mark.parametrize("buffer", [None, "buffer", object()])
def test_afd_moe_needs_a_buffer(buffer):
    from torch_afdep.nn import AfdMoE

    with pytest.raises(TypeError, match=r"buffer must be a torch_afdep\.Buffer .*got "
                                        + type(buffer).__name__):
        AfdMoE(buffer, 32)


@pytest.mark.parametrize("x, exc, match", [
    (torch.zeros(3, 72), ValueError, r"x must have shape \[T, 64\] .*got \[3, 72\]"),
    (torch.zeros(64), ValueError, r"x must have shape \[T, 64\] .*got \[64\]"),
    (torch.zeros(2, 3, 64), ValueError, r"x must have shape \[T, 64\] .*got \[2, 3, 64\]"),
    (torch.zeros(3, 64, dtype=torch.int64), TypeError,
     r"x must have a floating-point dtype .*got torch\.int64"),
    (torch.zeros(3, 64, dtype=torch.bool), TypeError, r"x must have a floating-point dtype"),
    ([[0.0] * 64], TypeError, r"x must be a torch\.Tensor \[T, 64\] .*got list"),
    (torch.zeros(9, 64), ValueError, r"x has 9 tokens but bucket is 8"),
    (torch.zeros(3, 64, device="meta"), ValueError,
     r"x must be on cpu \(the buffer's device\), got meta"),
])
def test_afd_moe_checks_x_before_routing(x, exc, match, no_exchange):
    from torch_afdep.nn import AfdMoE

    moe = AfdMoE(_groupless_buffer("attention"), 32)
    for call in (moe, moe.dispatch):
        with pytest.raises(exc, match=match):
            call(x)
    # A good x passes the checks and reaches the exchange (here: the stub that raises).
    with pytest.raises(AssertionError, match="an exchange started"):
        moe(torch.zeros(3, 64, dtype=torch.bfloat16))


def test_afd_moe_x_check_traces_without_host_reads():
    """The x checks read static metadata only: fullgraph compile of the Attention side up to
    the exchange is one graph; a bad x surfaces inside torch's tracing error with our
    message (docs/contract.md: checks that run while tracing cannot keep their type)."""
    from torch_afdep.nn import AfdMoE

    moe = AfdMoE(_groupless_buffer("attention"), 32)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def route(x):
        moe._check_x(x)
        return moe.router(x)

    fn = torch.compile(route, fullgraph=True, backend=recording)
    x = torch.randn(5, 64)
    ids, w = fn(x)
    assert len(graphs) == 1
    want_ids, want_w = moe.router(x)
    assert torch.equal(ids, want_ids) and torch.allclose(w, want_w)
    with pytest.raises(Exception, match=r"x must have shape \[T, 64\]"):
        fn(torch.randn(5, 72))


def test_load_weights_checks_shapes_and_keeps_the_weights(no_exchange):
    from torch_afdep.nn import AfdMoE

    moe = AfdMoE(_groupless_buffer("attention"), 32)
    before = moe.router.weight.clone()
    with pytest.raises(ValueError, match=r"router_weight must have shape \[4, 64\] "
                                         r"\(\[num_experts, hidden_size\]\), got \[4, 65\]"):
        moe.load_weights(router_weight=torch.ones(4, 65))
    with pytest.raises(ValueError, match=r"router_weight must have shape \[4, 64\]"):
        moe.load_weights(router_weight=torch.ones(64, 4))
    with pytest.raises(TypeError, match=r"router_weight must have a floating-point dtype, "
                                        r"got torch\.int64"):
        moe.load_weights(router_weight=torch.ones(4, 64, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"router_weight must be a torch\.Tensor \[4, 64\]"):
        moe.load_weights(router_weight=[[1.0] * 64] * 4)
    with pytest.raises(ValueError, match=r"Attention ranks need router_weight \[4, 64\]"):
        moe.load_weights()
    assert torch.equal(moe.router.weight, before)  # nothing copied
    moe.load_weights(router_weight=torch.ones(4, 64))
    assert bool((moe.router.weight == 1).all())

    ffn = AfdMoE(_groupless_buffer("ffn"), 32, dtype=torch.float32)  # experts 0, 1 of 4
    w13, w2 = ffn.experts.w13.clone(), ffn.experts.w2.clone()
    good = dict(w1=torch.ones(4, 32, 64), w3=torch.ones(4, 32, 64), w2=torch.ones(4, 64, 32))
    for name, bad, exc, match in (
            ("w1", torch.ones(4, 33, 64), ValueError,
             r"w1 must have shape \[4, 32, 64\] \(all experts\) or \[2, 32, 64\] \(this "
             r"rank's experts\), got \[4, 33, 64\]"),
            ("w3", torch.ones(3, 32, 64), ValueError, r"w3 must have shape \[4, 32, 64\]"),
            ("w2", torch.ones(4, 32, 64), ValueError,
             r"w2 must have shape \[4, 64, 32\] \(all experts\) or \[2, 64, 32\]"),
            ("w2", "weights", TypeError, r"w2 must be a torch\.Tensor \[4, 64, 32\], got str"),
    ):
        with pytest.raises(exc, match=match):
            ffn.load_weights(**{**good, name: bad})
    with pytest.raises(ValueError, match=r"FFN ranks need w1, w3 \[4, 32, 64\] and w2 "
                                         r"\[4, 64, 32\]"):
        ffn.load_weights(w1=good["w1"])
    assert torch.equal(ffn.experts.w13, w13) and torch.equal(ffn.experts.w2, w2)
    ffn.load_weights(**good)  # full stacks, and this rank's two experts, both load
    ffn.load_weights(**{k: v[:2] for k, v in good.items()})
    assert bool((ffn.experts.w13 == 1).all()) and bool((ffn.experts.w2 == 1).all())


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"intermediate_size": 0}, ValueError, r"intermediate_size must be an int >= 1, got 0"),
    ({"intermediate_size": 2.5}, TypeError, r"intermediate_size must be an int >= 1, got "
                                            r"float 2\.5"),
    ({"intermediate_size": "32"}, TypeError, r"intermediate_size must be an int >= 1"),
    ({"num_local_experts": 0}, ValueError, r"num_local_experts must be an int >= 1, got 0"),
    ({"hidden_size": -8}, ValueError, r"hidden_size must be an int >= 1, got -8"),
    ({"first_expert": -1}, ValueError, r"first_expert must be an int >= 0, got -1"),
    ({"method": "bogus"}, ValueError, r"method must be one of .*got 'bogus'"),
    ({"method": None}, ValueError, r"method must be one of .*got None"),
    ({"dtype": torch.int32}, TypeError, r"dtype must be one of .*got torch\.int32"),
    ({"dtype": torch.float8_e4m3fn}, TypeError, r"dtype must be one of .*float8_e4m3fn"),
    # (torch._grouped_mm has no float64 kernel on CPU)
    ({"dtype": torch.float64, "method": "grouped"}, ValueError,
     r"method='grouped' needs torch\._grouped_mm, which does not run for torch\.float64 on cpu"),
])
def test_swiglu_experts_constructor_checks_arguments(kwargs, exc, match):
    from torch_afdep.nn import SwiGLUExperts

    args = {"num_local_experts": 2, "hidden_size": 64, "intermediate_size": 32, **kwargs}
    with pytest.raises(exc, match=match):
        SwiGLUExperts(args.pop("num_local_experts"), args.pop("hidden_size"),
                      args.pop("intermediate_size"), **args)


def test_router_constructor_checks_arguments():
    from torch_afdep.nn import TopKRouter

    with pytest.raises(ValueError, match=r"top_k must be in \[1, 4\] \(num_experts\), got 5"):
        TopKRouter(64, 4, 5)
    with pytest.raises(TypeError, match=r"num_experts must be an int >= 1, got float 4\.0"):
        TopKRouter(64, 4.0, 2)
    with pytest.raises(TypeError, match=r"dtype must be one of .*got torch\.int32"):
        TopKRouter(64, 4, 2, dtype=torch.int32)


def test_param_dtypes_all_run():
    """PARAM_DTYPES is honest: experts (both layouts, the methods that run for the dtype)
    and the router build and give finite results in each of them."""
    from torch_afdep.nn import PARAM_DTYPES, SwiGLUExperts, TopKRouter, grouped_mm_supported

    x, w, offs = _received(12, 3, 64, 4)
    xt, _, ids, wt = _token_received(9, 2, 3, 64, 5)
    for dtype in PARAM_DTYPES:
        ex = SwiGLUExperts(3, 64, 16, dtype=dtype)
        methods = ["dense", "loop"] + (["grouped"] if grouped_mm_supported("cpu", dtype)
                                       else [])
        for m in methods:
            ex.method = m
            out, tok = ex(x, w, offs), ex.forward_tokens(xt, ids, wt)
            assert out.dtype == tok.dtype == torch.bfloat16, (dtype, m)
            assert torch.isfinite(out).all() and torch.isfinite(tok).all(), (dtype, m)
        got_ids, got_w = TopKRouter(64, 4, 2, dtype=dtype)(torch.randn(5, 64))
        assert got_ids.shape == (5, 2) and torch.isfinite(got_w).all(), dtype
