"""GPU tests of the CUDA transport (CUDA IPC in one NVLink domain), driven directly, against
the fp64 reference: every protocol control, graph replays, zero-copy views, timeouts,
registered bytes, the NCCL transport, the trace tool.

Skipped cleanly without a CUDA GPU or without the built extension (torch_afdep._cuda). Rank r
runs on GPU r % n_gpus; ranks sharing a GPU need CUDA MPS (tests/helpers/devices.py).
"""

from __future__ import annotations


import pytest
import torch

pytestmark = pytest.mark.gpu


from tests.helpers import devices  # noqa: E402

devices.require_gpu_module()

from torch_afdep import controls  # noqa: E402
from torch_afdep.testing import spawn_world  # noqa: E402

from tests.helpers import transport_bodies as gw  # noqa: E402
from tests.helpers.devices import need_gpus, rank_devices, spawn_gpu_world  # noqa: E402

BASE_ENV = devices.GPU_ENV
SYM = {"AFDEP_SYMMETRIC": "1"}
STREAM = {"AFDEP_STREAM_EXPANSION": "1"}  # the default: per-row flags, expansion as rows land
# the small-batch changes (default 1) reverted: ordinary launches, a release flag after the
# fence, each load after the one it follows; PREVIOUS reverts these three and the token
# layout's flagged units (the defaults before them)
NO_PDL = {"AFDEP_PDL": "0"}
NO_ONE_FENCE = {"AFDEP_ONE_FENCE": "0"}
NO_EARLY = {"AFDEP_EARLY_LOADS": "0"}
PREVIOUS = devices.PREVIOUS_DEFAULTS

# layout name -> (F, A, device of each group rank, num_experts); rank r on GPU r % n_gpus
LAYOUTS = {name: (f, a, rank_devices(f + a), e) for name, (f, a, e) in {
    "1A1F": (1, 1, 128),
    "2A2F": (2, 2, 128),
    "3A1F": (1, 3, 128),
    "1A3F": (3, 1, 96),
    # 8-GPU layouts (one rank per GPU; collected only where 8 GPUs are present)
    "4A4F": (4, 4, 128),
    "6A2F": (2, 6, 128),
    "7A1F": (1, 7, 128),
}.items()}
EIGHT_GPUS = torch.cuda.device_count() >= 8


def cfg_kw(layout, cap, hidden, dtype="bfloat16", timeout=10.0):
    F, A, _, E = LAYOUTS[layout]
    return dict(capacity_tokens_per_rank=cap, hidden_size=hidden, num_experts=E, top_k=8,
                ffn_ranks=F, attention_ranks=A, dtype=dtype, num_sms=24, timeout_s=timeout)


def tokens_plan(A, cap):
    """Different T per Attention rank in one exchange, covering 0, 1, 7, 128 and the bucket."""
    ts = [t for t in (0, 1, 7, 128, cap) if t <= cap]
    plan = []
    kinds = ["random", "skewed", "partial"]
    for i in range(max(len(ts), 3)):
        tok = [ts[(i + a) % len(ts)] for a in range(A)]
        plan.append((cap, tok, kinds[i % 3]))
    # a bucket smaller than capacity
    if cap > 8:
        plan.append((8, [min(8, 7 + a % 2) for a in range(A)], "partial"))
    return plan


def run(layout, kw, plan, env=None, seed=1, bad_ids=False, body=None):
    F, A, devs, _ = LAYOUTS[layout]
    e = dict(BASE_ENV)
    e.update(env or {})
    body = body or gw.exchanges_body
    return spawn_gpu_world(body, F + A, kw, plan, seed, bad_ids, device_ids=devs, env=e,
                       timeout=600)


CASES = [
    ("1A1F", 128, 2048, "bfloat16"),
    ("1A1F", 2048, 4096, "bfloat16"),
    ("1A1F", 2048, 7168, "float8_e4m3fn"),
    ("1A1F", 128, 7168, "float8_e4m3fn"),
    ("2A2F", 128, 4096, "bfloat16"),
    ("2A2F", 2048, 2048, "float8_e4m3fn"),
    ("3A1F", 128, 2048, "float8_e4m3fn"),
    ("3A1F", 2048, 4096, "bfloat16"),
    ("1A3F", 128, 7168, "bfloat16"),
    ("1A3F", 2048, 2048, "float8_e4m3fn"),
] + ([("4A4F", 128, 4096, "bfloat16"), ("4A4F", 2048, 2048, "float8_e4m3fn"),
      ("6A2F", 2048, 4096, "bfloat16"), ("6A2F", 128, 7168, "float8_e4m3fn"),
      ("7A1F", 128, 2048, "float8_e4m3fn"), ("7A1F", 2048, 4096, "bfloat16")]
     if EIGHT_GPUS else [])


@pytest.mark.parametrize("layout,cap,hidden,dtype", CASES)
def test_eager_role_aware(layout, cap, hidden, dtype):
    """The defaults: the plan's exchanges (T 0 ... bucket, and bucket 8) exact on every rank,
    on the small kernel forms where T is small: every Attention rank's collects at T <= 48
    take the flagged units with their barrier (kSmallRecv: the early collect is the token
    layout's), every FFN rank's receive at bucket 8 takes the dispatch's units (kUnitExpRecv,
    AFDEP_LL_EXPERTS: one token a channel) and its reply sends units (kUnitReply)."""
    kw = cfg_kw(layout, cap, hidden, dtype)
    stats = run(layout, kw, tokens_plan(LAYOUTS[layout][1], cap))
    assert all(s["registered_bytes"] <= s["union_bytes"] for s in stats)
    llx = controls.CONTROLS["AFDEP_LL_EXPERTS"].bit
    for r, s in enumerate(stats):
        if s["role"] == "attention":
            assert "kSmallRecv" in s["forms"][1], (r, s["forms"])
            assert "kEarlyCollect" not in s["forms"][1], (r, s["forms"])
            continue
        if s["flags"] & llx:
            assert "kUnitExpRecv" in s["forms"][0], (r, s["forms"])
        assert "kUnitReply" in s["forms"][1], (r, s["forms"])


def test_dispatch_smem_between_40_and_48_kb():
    """A configuration whose dispatch kernels take 44 KB of dynamic shared memory: 1A1F, 1,024
    experts on the one FFN rank, 10 channels (the receive's [regions][local experts] table).
    With the kernels' static arrays (up to 5.8 KB) a block needs more than the 48 KB a launch
    gets without the opt-in attribute, which dispatch_prepare sets from 40 KB of dynamic memory
    on (it once did so only above 48 KB: these launches would have failed). Exchanges at T = 0,
    1, 7 and the bucket exact on every rank; the receive ran in the units form (bucket 8: one
    token a channel, kUnitExpRecv) and in another (bucket 64: the count form)."""
    kw = dict(cfg_kw("1A1F", 64, 1024), num_experts=1024, num_sms=10)
    # dispatch_smem_bytes' largest term here (expand_units' arrays), mirrored: if it drifts out
    # of (40, 46] KB this test no longer covers the margin
    nreg, el = 10, 1024
    units = (6 * nreg + nreg * el + el + 1 + nreg + 1) * 4
    assert 40 * 1024 < units <= 46 * 1024, units
    stats = run("1A1F", kw, [(64, [0], "random"), (64, [1], "random"), (64, [7], "skewed"),
                             (64, [64], "partial"), (8, [8], "random")], seed=91)
    ffn = [s for s in stats if s["role"] == "ffn"]
    assert ffn and all("kUnitExpRecv" in s["forms"][0] and len(s["forms"][0]) >= 2
                       for s in ffn), [s["forms"] for s in ffn]


@pytest.mark.parametrize("layout,cap,hidden,dtype", CASES)
def test_eager_symmetric(layout, cap, hidden, dtype):
    """AFDEP_SYMMETRIC=1: every control reverted, the union layout, the generic kernels."""
    kw = cfg_kw(layout, cap, hidden, dtype)
    stats = run(layout, kw, tokens_plan(LAYOUTS[layout][1], cap), env=SYM)
    assert all(s["registered_bytes"] == s["union_bytes"] for s in stats)
    assert all(s["forms"] == [{"kGeneric"}, {"kGeneric"}] for s in stats), \
        [s["forms"] for s in stats]


@pytest.mark.parametrize("delay,env", [
    ("AFDEP_TEST_REPLY_DELAY_MS", {}), ("AFDEP_TEST_REPLY_DELAY_MS", SYM),
    ("AFDEP_TEST_DISPATCH_DELAY_MS", {}), ("AFDEP_TEST_DISPATCH_DELAY_MS", SYM),
    ("AFDEP_TEST_REPLY_DELAY_MS", NO_PDL), ("AFDEP_TEST_DISPATCH_DELAY_MS", NO_PDL),
    ("AFDEP_TEST_REPLY_DELAY_MS", NO_ONE_FENCE), ("AFDEP_TEST_DISPATCH_DELAY_MS", NO_ONE_FENCE),
    ("AFDEP_TEST_REPLY_DELAY_MS", PREVIOUS), ("AFDEP_TEST_REPLY_DELAY_MS", NO_EARLY),
    ("AFDEP_TEST_DISPATCH_DELAY_MS", NO_EARLY)],
    ids=["reply-role_aware", "reply-symmetric", "dispatch-role_aware", "dispatch-symmetric",
         "reply-no_pdl", "dispatch-no_pdl",
         "reply-no_one_fence", "dispatch-no_one_fence", "reply-previous", "reply-no_early_loads",
         "dispatch-no_early_loads"])
def test_receiver_never_reads_the_previous_exchange(delay, env):
    """Regression (2 x H200, 2026-11-30): with the sender 20 ms late, a receiver spinning on
    its signal read the previous exchange's rows (the 5th exchange of this plan returned the
    4th's result for all 128 tokens), in the role-aware and the symmetric protocol alike. Every
    reading thread now fences after its CTA's wait (kernels/common.cuh sys_fence_after_wait)."""
    kw = cfg_kw("1A1F", 128, 7168, "float8_e4m3fn")
    run("1A1F", kw, tokens_plan(1, 128), env={**env, delay: "20"})


@pytest.mark.parametrize("env", [{}, SYM, {"AFDEP_TEST_REPLY_DELAY_MS": "20"}],
                         ids=["role_aware", "symmetric", "reply_delayed"])
def test_zero_copy_collect(env):
    """One FFN rank: ``combine_view`` returns the receive buffer's rows (no copy), unrouted
    rows zeroed, poisoned with NaN before every dispatch, against the fp64 reference."""
    kw = cfg_kw("1A1F", 128, 4096, "bfloat16")
    stats = run("1A1F", kw, tokens_plan(1, 128), env=env, body=gw.view_exchanges_body)
    att = [s for s in stats if s["role"] == "attention"][0]
    assert len(att["rel_err"]) == len(tokens_plan(1, 128))


SINGLE = ["AFDEP_ROLE_BUFFERS", "AFDEP_NO_ENTRY_BARRIER", "AFDEP_ONE_WAY_COUNTS",
          "AFDEP_RECEIVER_WAIT_ONLY", "AFDEP_ROLE_WARPS", "AFDEP_SINGLE_FFN", "AFDEP_WIDE_LOCAL",
          "AFDEP_EARLY_COUNTS", "AFDEP_PDL", "AFDEP_ONE_FENCE", "AFDEP_EARLY_LOADS",
          "AFDEP_PARAM_BASES", "AFDEP_LL_EXPERTS", "AFDEP_SPREAD_CHUNKS", "AFDEP_UNIT_SIGNAL"]
# AFDEP_STREAM_EXPANSION acts only from 48 tokens per CTA (these cases have at most 6):
# test_stream_expansion_reverted_eager reverts it at T = 2048
# test_each_control_reverted_alone's (cap, hidden, dtype) per layout: the controls' own eager
# tests leave these cells out (the same exchanges with the same control at 0)
ALONE_CELLS = {"1A1F": (128, 2048, "bfloat16"), "2A2F": (128, 2048, "bfloat16"),
               "3A1F": (128, 2048, "float8_e4m3fn")}


def not_alone(cases):
    """``cases`` without test_each_control_reverted_alone's cells."""
    return [c for c in cases if ALONE_CELLS.get(c[0]) != tuple(c[1:4])]


@pytest.mark.parametrize("layout", sorted(ALONE_CELLS))
@pytest.mark.parametrize("control", SINGLE)
def test_each_control_reverted_alone(control, layout):
    """Every control reverted on its own still delivers the contract exactly (each mixed
    protocol is a real code path: the symmetric arm is all of them at once)."""
    kw = cfg_kw(layout, *ALONE_CELLS[layout])
    run(layout, kw, tokens_plan(LAYOUTS[layout][1], 128), env={control: "0"}, seed=11)


@pytest.mark.parametrize("layout,cap,hidden,dtype", [c for c in CASES if c[0] == "1A1F"]
                         + [("2A2F", 2048, 2048, "float8_e4m3fn")])
def test_stream_expansion_reverted_eager(layout, cap, hidden, dtype):
    """AFDEP_STREAM_EXPANSION=0 (on by default, where test_eager_role_aware runs these cases:
    sender CTAs with >= 48 tokens and >= 32 KB claim every token first and flag each row, the
    FFN expanding rows slot-major as they land): one payload flag per channel, and large-T
    channels send their counts last. The plan's T = bucket = 2048 cells are the ones the
    control changes (86 tokens per channel), T = 128 takes the one-flag early path (6 per
    channel), T <= 7 the plain one; in 2A2F one exchange mixes them."""
    kw = cfg_kw(layout, cap, hidden, dtype)
    run(layout, kw, tokens_plan(LAYOUTS[layout][1], cap), env={"AFDEP_STREAM_EXPANSION": "0"},
        seed=7)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_stream_expansion_graph_replays(dtype):
    # T = 1180 over 24 channels: 50 tokens per channel (row flags) and 30 in the last (one
    # payload flag), so each replay mixes both completion forms in one region table
    kw = cfg_kw("1A1F", 2048, 2048, dtype)
    res = spawn_gpu_world(gw.graph_body, 2, kw, 2048, [1180], 100, 7000, env={**BASE_ENV, **STREAM}, timeout=600)
    assert all(r == 100 for r in res)


@pytest.mark.parametrize("layout,cap,hidden,dtype",
                         not_alone([c for c in CASES if c[0] == "1A1F"])
                         + [("2A2F", 128, 4096, "bfloat16")])
def test_pdl_reverted_eager(layout, cap, hidden, dtype):
    """AFDEP_PDL=0: ordinary launches (the default, programmatic dependent launch, runs in
    every other test). Back-to-back exchanges of the plan (T 0 ... bucket) must stay exact."""
    kw = cfg_kw(layout, cap, hidden, dtype)
    run(layout, kw, tokens_plan(LAYOUTS[layout][1], cap), env=NO_PDL, seed=9)


@pytest.mark.parametrize("layout,cap,hidden,dtype", [("1A1F", 128, 2048, "bfloat16"),
                                                    ("2A2F", 128, 4096, "bfloat16"),
                                                    ("3A1F", 128, 2048, "float8_e4m3fn")])
def test_small_kernels_reverted_eager(layout, cap, hidden, dtype):
    """AFDEP_SMALL_KERNELS=0: the generic kernels on every path. With the default the plan's
    small-T exchanges (and bucket 128 at hidden 2,048) run the small forms (the count-block
    dispatch and receive, the reply's units, the collect's units) and the larger ones the
    generic kernels, in one sequence (test_eager_role_aware); here every exchange runs the
    generic kernels."""
    kw = cfg_kw(layout, cap, hidden, dtype)
    stats = run(layout, kw, tokens_plan(LAYOUTS[layout][1], cap),
                env={"AFDEP_SMALL_KERNELS": "0"}, seed=11)
    assert all(s["forms"] == [{"kGeneric"}, {"kGeneric"}] for s in stats), \
        [s["forms"] for s in stats]


# the eager cases that the small-batch controls' tests share
EAGER_SMALL = [c for c in CASES if c[0] == "1A1F"] + [("2A2F", 128, 4096, "bfloat16"),
                                                     ("3A1F", 128, 2048, "float8_e4m3fn")]


def graph_replays_1a1f(dtype, bucket, tokens, env, seed, forms=None):
    """100 checked CUDA-graph replays of one 1A1F exchange (H2048), fresh
    inputs each; ``forms``: the kernel forms the captured launches must run, (FFN's,
    Attention's), each (dispatch or receive, reply or collect), None for a phase not checked;
    then every control that ``env`` sets must have reached each rank's flags as set."""
    kw = cfg_kw("1A1F", bucket, 2048, dtype)
    res = spawn_gpu_world(gw.graph_body, 2, kw, bucket, [tokens], 100, seed, "partial",
                          forms is not None, env={**BASE_ENV, **env}, timeout=600)
    if forms is None:
        assert all(r == 100 for r in res)
        return
    for (checked, got, flags), want in zip(res, forms):  # rank 0 is the FFN rank
        assert checked == 100
        assert all(w is None or g == w for g, w in zip(got, want)), (got, want)
        assert not devices.controls_missed(flags, env), (env, hex(flags))


@pytest.mark.parametrize("dtype,bucket,tokens", [("bfloat16", 128, 128),
                                                 ("float8_e4m3fn", 2048, 1180)],
                         ids=["bf16-T128", "fp8-T1180"])
def test_pdl_reverted_graph_replays(dtype, bucket, tokens):
    """AFDEP_PDL=0 (no programmatic edges) inside captured graphs: 100 checked replays, fresh
    inputs each (the default's programmatic edges: test_cuda_graph_replays and the others)."""
    graph_replays_1a1f(dtype, bucket, tokens, NO_PDL, 8000)


@pytest.mark.parametrize("layout,cap,hidden,dtype",
                         not_alone([c for c in CASES if c[0] == "1A1F"])
                         + [("2A2F", 128, 4096, "bfloat16")])
def test_one_fence_reverted_eager(layout, cap, hidden, dtype):
    """AFDEP_ONE_FENCE=0 (a release flag after the fence: two system fences per signal):
    back-to-back exchanges of the plan (T 0 ... bucket) stay exact."""
    kw = cfg_kw(layout, cap, hidden, dtype)
    run(layout, kw, tokens_plan(LAYOUTS[layout][1], cap), env=NO_ONE_FENCE, seed=11)


@pytest.mark.parametrize(
    "layout,cap,hidden,dtype,env",
    [pytest.param(*c, NO_EARLY, id="-".join(map(str, c)) + "-reverted")
     for c in not_alone(EAGER_SMALL)]
    + [pytest.param(*c, PREVIOUS, id="-".join(map(str, c)) + "-previous_defaults")
       for c in EAGER_SMALL])
def test_early_loads_reverted_eager(layout, cap, hidden, dtype, env):
    """AFDEP_EARLY_LOADS=0 (each load after the one it follows: ids in the claim, rows after
    it; header then entries; counts, then rows; route after the wait), alone and with PDL and
    one fence reverted too (the defaults before the small-batch changes). The default's
    preloaded rows, metadata loaded at once and early replies run in every other test.
    Back-to-back exchanges of the plan (T 0 ... bucket) stay exact."""
    kw = cfg_kw(layout, cap, hidden, dtype)
    run(layout, kw, tokens_plan(LAYOUTS[layout][1], cap), env=env, seed=13)


@pytest.mark.parametrize("dtype,bucket,tokens", [("bfloat16", 8, 1), ("bfloat16", 32, 7),
                                                 ("float8_e4m3fn", 2048, 1180)],
                         ids=["bf16-T1", "bf16-T7", "fp8-T1180"])
def test_early_loads_reverted_graph_replays(dtype, bucket, tokens):
    """AFDEP_EARLY_LOADS=0 inside captured graphs: 100 checked replays, fresh inputs each (the
    default's early paths at T 1 and 7: test_cuda_graph_replays and the others)."""
    graph_replays_1a1f(dtype, bucket, tokens, NO_EARLY, 9100)


# The expert layout's reply rows as flagged units (AFDEP_LL_SMALL: bucket <= 2 x num_sms = 48)
# below the edge (bucket 8), at it (48: every channel 2 tokens) and above it (49: the count
# form, to a collect that watches for units at T <= 48); with the generic kernels (the same
# units) and with the control at 0 (the count form everywhere)
UNIT_CELLS = [("bfloat16", 8, 1), ("bfloat16", 48, 48), ("float8_e4m3fn", 49, 7)]


@pytest.mark.parametrize("env", [{"AFDEP_SMALL_KERNELS": "0"}, {"AFDEP_LL_SMALL": "0"}],
                         ids=["generic_kernels", "ll_off"])
@pytest.mark.parametrize("dtype,bucket,tokens", UNIT_CELLS,
                         ids=["bf16-B8-T1", "bf16-B48-T48", "fp8-B49-T7"])
def test_expert_reply_units_graph_replays(dtype, bucket, tokens, env):
    """100 checked graph replays of the expert layout around the reply units' edge, through
    the generic kernels and with the units off (the defaults: test_ll_experts_graph_replays,
    on the same cells)."""
    graph_replays_1a1f(dtype, bucket, tokens, env, 9200)


@pytest.mark.parametrize("layout", ["2A2F", "3A1F", "1A3F"])
def test_expert_reply_units_eager(layout):
    """Several FFN ranks' units summed at the collect (2A2F, 1A3F), several Attention ranks'
    units from one FFN rank (3A1F): the plan's T 0, 1, 7, 48 at bucket 48 and 7-8 at bucket 8,
    back to back."""
    kw = cfg_kw(layout, 48, 2048, "float8_e4m3fn" if layout == "1A3F" else "bfloat16")
    run(layout, kw, tokens_plan(LAYOUTS[layout][1], 48), seed=17)


def test_flag_round_trip_probe():
    """benchmarks.run's floor term: the initiator gets a plausible round trip per call (an
    NVLink flag crosses and returns in about 1.4 µs on these machines), the responder None."""
    kw = cfg_kw("1A1F", 8, 128)
    init, resp = spawn_gpu_world(gw.flag_round_trip_body, 2, kw, 3,
                                    env=BASE_ENV, timeout=300)
    assert resp == [None, None, None]
    assert all(0.2 < v < 100.0 for v in init), init


def test_stamp_kernel_runs_in_stream_order():
    """benchmarks.trace's stream stamps: %globaltimer read in order with the stream's work
    (a ~0.5 ms sleep kernel between two stamps shows up between them)."""
    from torch_afdep import _cuda

    st = torch.zeros(2, dtype=torch.int64, device="cuda:0")
    stream = torch.cuda.current_stream(0).cuda_stream
    _cuda.stamp(st.data_ptr(), stream)
    torch.cuda._sleep(1_000_000)  # ~0.5 ms at 2 GHz
    _cuda.stamp(st.data_ptr() + 8, stream)
    t0, t1 = st.tolist()
    assert t0 > 0 and 100_000 < t1 - t0 < 100_000_000, (t0, t1)


def test_globaltimer_step_is_measured():
    """benchmarks.trace's clock check: one thread sees %globaltimer advance (in steps of at
    most 2 µs, or the trace's sub-microsecond stages mean nothing) over 4,096 reads in a
    plausible time."""
    from benchmarks import trace

    t = trace.timer_step(torch.device("cuda:0"))
    assert t["steps"] > 0 and 0 < t["step_ns"] <= 2000, t
    assert 0 < t["span_ns"] < 10_000_000, t


def test_route_errors_reported_and_skipped():
    kw = cfg_kw("1A1F", 128, 2048)
    stats = run("1A1F", kw, [(128, [7], "random"), (128, [128], "partial")], bad_ids=True)
    att = [s for s in stats if s["role"] == "attention"][0]
    assert att["errors"] == ["AfdepRouteError", "AfdepRouteError"]


def test_registered_bytes_per_role():
    for layout in ("1A1F", "2A2F", "3A1F", "1A3F"):
        kw = cfg_kw(layout, 2048, 4096)
        F, A, devs, _ = LAYOUTS[layout]
        stats = spawn_world(gw.sizes_body, F + A, kw, device_ids=devs, env=BASE_ENV)
        total = sum(s["registered_bytes"] for s in stats)
        union = sum(s["union_bytes"] for s in stats)
        print(layout, [(s["role"], s["registered_bytes"]) for s in stats], "union", union,
              f"{100.0 * total / union:.1f}%")
        assert total < union


# AFDEP_LL_EXPERTS (on by default; set here all the same): the expert layout's dispatch as
# flagged units when a channel holds one token (bucket <= num_sms = 24; the FFN's receive in
# kUnitExpRecv), the count form above that (the FFN's count-form receive then also watches
# for units, kCountRecvLL), back to back in one plan
LLX = {"AFDEP_LL_EXPERTS": "1"}


def llx_plan(A):
    """tokens_plan at capacity 128 (buckets 128: the count form; 8: units), then buckets 24
    (every channel one token at T = 24: units), 2 (units) and 48 (two tokens a channel: the
    count form)."""
    return tokens_plan(A, 128) + [
        (24, [(24, 1, 7)[a % 3] for a in range(A)], "random"),
        (2, [(1, 2, 0)[a % 3] for a in range(A)], "skewed"),
        (48, [(0, 48, 33)[a % 3] for a in range(A)], "partial"),
    ]


@pytest.mark.parametrize("layout,dtype", [("1A1F", "bfloat16"), ("1A1F", "float8_e4m3fn"),
                                          ("2A2F", "bfloat16"), ("3A1F", "float8_e4m3fn"),
                                          ("1A3F", "bfloat16")])
def test_ll_experts_eager(layout, dtype):
    """AFDEP_LL_EXPERTS=1: every exchange of llx_plan exact on every rank (the FFN's rows,
    offsets, weights, payload bits and receipts against every source; the Attention's output
    against the fp64 reference), the control on in every rank's transport."""
    A = LAYOUTS[layout][1]
    res = run(layout, cfg_kw(layout, 128, 2048, dtype), llx_plan(A), env=LLX, seed=19)
    for r, st in enumerate(res):  # the path ran: units receives, and count-form ones watching
        assert st["flags"] & controls.CONTROLS["AFDEP_LL_EXPERTS"].bit, (r, hex(st["flags"]))
        if st["role"] == "ffn":
            assert {"kUnitExpRecv", "kCountRecvLL"} <= st["forms"][0], (r, st["forms"])


@pytest.mark.parametrize("dtype,bucket,tokens", UNIT_CELLS,
                         ids=["bf16-B8-T1", "bf16-B48-T48", "fp8-B49-T7"])
def test_ll_experts_graph_replays(dtype, bucket, tokens):
    """AFDEP_LL_EXPERTS=1, 100 checked graph replays around the units' edge (bucket 8: units;
    48, two tokens a channel, and 49: the count form, whose receive watches for units)."""
    units = bucket <= 24
    graph_replays_1a1f(dtype, bucket, tokens, LLX, 9400,
                       forms=(("kUnitExpRecv" if units else "kCountRecvLL", None),
                              ("kSmallSend" if units else "kCountSend", None)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_ll_experts_sanitizer_small(dtype):
    """Small 1A1F exchanges with AFDEP_LL_EXPERTS=1 (run under compute-sanitizer by
    scripts/gpu_suite.sh): units at buckets 24 and 8, the count form at 64 and 48."""
    kw = cfg_kw("1A1F", 64, 1024, dtype)
    run("1A1F", kw, [(24, [7], "partial"), (24, [24], "random"), (64, [64], "random"),
                     (8, [1], "skewed"), (48, [33], "random"), (24, [0], "random")], env=LLX,
        seed=23)


# AFDEP_LONE_EXPAND (on by default): the expert layout's units receive where one token arrived
# in all (kUnitExpRecv) takes the token's rows from its own entries, without the count table.
# The default's lone exchanges also run in the T = 1 cells of the tests above and in the
# hostile graphs; test_trace_stages_are_ordered shows the path ran (no count-table stamp at
# T = 1)
LONE_BIT = controls.CONTROLS["AFDEP_LONE_EXPAND"].bit



def one_source(A, i):
    """Tokens per Attention index: 1 for index i % A, 0 for every other."""
    return [1 if a == i % A else 0 for a in range(A)]


def lone_plan(A):
    """Exchanges in which every FFN rank receives at most one token in all (its rows then come
    from AFDEP_LONE_EXPAND's path), between ones where it receives none or several: T = 1 on
    one source at buckets 1, 2, 8 and 24 in every routing kind ("partial" drops entries, so
    some tokens reach fewer experts or none), T = 0 everywhere, and 2 + 1 + ... tokens."""
    return [(1, one_source(A, 0), "random"), (8, one_source(A, 1), "partial"),
            (24, one_source(A, 2), "skewed"), (8, [0] * A, "random"),
            (24, [2] + [1] * (A - 1), "random"), (2, one_source(A, 3), "partial"),
            (24, one_source(A, 4), "partial"), (1, one_source(A, 5), "skewed")]


@pytest.mark.parametrize("value", ["1", "0"], ids=["on", "reverted"])
@pytest.mark.parametrize("layout,dtype", [("1A1F", "bfloat16"), ("1A1F", "float8_e4m3fn"),
                                          ("2A2F", "bfloat16"), ("3A1F", "float8_e4m3fn"),
                                          ("1A3F", "bfloat16")])
def test_lone_expand_eager(layout, dtype, value):
    """AFDEP_LONE_EXPAND=1 (the default) and 0: every exchange of lone_plan exact on every rank
    (the FFN's rows, offsets, weights, payload bits and receipts against every source; the
    Attention's output against the fp64 reference), every receive in kUnitExpRecv. With the
    stage trace on: the receives of one token in all built no count table with the control on
    (the lone path ran), every other receive built one."""
    A = LAYOUTS[layout][1]
    plan = lone_plan(A)
    res = run(layout, cfg_kw(layout, 24, 2048, dtype), plan,
              env={"AFDEP_LONE_EXPAND": value, "AFDEP_TRACE": "1"}, seed=71)
    for r, st in enumerate(res):
        assert bool(st["flags"] & LONE_BIT) == (value == "1"), (r, hex(st["flags"]))
        if st["role"] == "ffn":
            assert st["forms"][0] == {"kUnitExpRecv"}, (r, st["forms"])
            assert len(st["tables"]) == len(plan), (r, st["tables"])
            for i, (got, table) in enumerate(st["tables"]):
                assert table == (value == "0" or got != 1), (r, i, got, table)
            assert any(got == 1 for got, _ in st["tables"]), (r, st["tables"])


@pytest.mark.parametrize("value", ["1", "0"], ids=["on", "reverted"])
@pytest.mark.parametrize("dtype,bucket", [("bfloat16", 1), ("float8_e4m3fn", 8)])
def test_lone_expand_graph_replays(dtype, bucket, value):
    """AFDEP_LONE_EXPAND=1 (the default) and 0, 100 checked graph replays of a 1A1F exchange
    of one token (fresh ids and weights each replay, some entries -1: the token reaches 0-8
    experts), the receive in kUnitExpRecv."""
    graph_replays_1a1f(dtype, bucket, 1, {"AFDEP_LONE_EXPAND": value}, 9900,
                       forms=(("kUnitExpRecv", None), ("kSmallSend", None)))


# AFDEP_FANOUT_EXPAND (experimental, off by default): the expert layout's units receive in its
# own form, kUnitExpFan, whose (token, chunk) units each store a chunk of the token's row into
# every row of its entries; both of its paths: the lone token's (AFDEP_LONE_EXPAND) and the
# count table's
FANOUT = {"AFDEP_FANOUT_EXPAND": "1"}
FANOUT_BIT = controls.CONTROLS["AFDEP_FANOUT_EXPAND"].bit


@pytest.mark.parametrize("lone", ["1", "0"], ids=["lone", "lone_off"])
@pytest.mark.parametrize("layout,dtype,hidden,local_sms", [
    ("1A1F", "bfloat16", 2048, 0), ("1A1F", "float8_e4m3fn", 2048, 0),
    ("2A2F", "bfloat16", 2048, 0), ("3A1F", "float8_e4m3fn", 2048, 0),
    ("1A3F", "bfloat16", 2048, 0),
    ("1A1F", "bfloat16", 8192, 1), ("1A1F", "float8_e4m3fn", 4096, 2),
    ("2A2F", "bfloat16", 4096, 5)])
def test_fanout_expand_eager(layout, dtype, hidden, local_sms, lone):
    """AFDEP_FANOUT_EXPAND=1: every exchange of lone_plan, then llx_plan (units at buckets up to
    24 with 1-24 tokens; the count form above, kCountRecvLL), exact on every rank (the FFN's
    rows, offsets, weights, payload bits and receipts against every source; the Attention's
    output against the fp64 reference); every units receive in kUnitExpFan. With the stage
    trace: with AFDEP_LONE_EXPAND on (lone) the receives of one token in all built no count
    table, every other units receive built one; lone_off: every units receive built one.
    local_sms 1, 2, 5 (the FFN's receive on 16, 32, 80 warps): the table's units outnumber the
    warps (several a warp), and at H 8,192 on one CTA so do the lone token's (32 on 16 warps:
    the offsets' 16 slices on the first pass, the copy in two); 0: a CTA per SM."""
    A = LAYOUTS[layout][1]
    plan = lone_plan(A) + llx_plan(A)
    kw = dict(cfg_kw(layout, 128, hidden, dtype), local_sms=local_sms)
    res = run(layout, kw, plan,
              env={**FANOUT, **LLX, "AFDEP_LONE_EXPAND": lone, "AFDEP_TRACE": "1"}, seed=73)
    nlone = len(lone_plan(A))
    for r, st in enumerate(res):
        assert st["flags"] & FANOUT_BIT, (r, hex(st["flags"]))
        assert bool(st["flags"] & LONE_BIT) == (lone == "1"), (r, hex(st["flags"]))
        if st["role"] == "ffn":
            # buckets <= 24 (one token a channel): units; 48 and 128: the count form, or on
            # a small grid the generic kernel (dispatch_form: a channel of 16 tokens or more,
            # or of 32 KB with early copies, as at H 8,192 on 1 CTA and H 4,096 on 5)
            if local_sms == 0:
                assert st["forms"][0] == {"kUnitExpFan", "kCountRecvLL"}, (r, st["forms"])
            else:
                assert "kUnitExpFan" in st["forms"][0], (r, st["forms"])
                assert st["forms"][0] <= {"kUnitExpFan", "kCountRecvLL", "kGeneric"}, \
                    (r, st["forms"])
            assert len(st["tables"]) == len(plan), (r, st["tables"])
            for i, (got, table) in enumerate(st["tables"][:nlone]):
                assert table == (lone == "0" or got != 1), (r, i, got, table)
            assert any(got == 1 for got, _ in st["tables"][:nlone]), (r, st["tables"])


@pytest.mark.parametrize("dtype,bucket,tokens", [("bfloat16", 1, 1), ("float8_e4m3fn", 8, 1),
                                                 ("bfloat16", 24, 24), ("float8_e4m3fn", 8, 7)],
                         ids=["bf16-B1-T1", "fp8-B8-T1", "bf16-B24-T24", "fp8-B8-T7"])
def test_fanout_expand_graph_replays(dtype, bucket, tokens):
    """AFDEP_FANOUT_EXPAND=1, 100 checked graph replays of a 1A1F exchange (fresh ids and
    weights each replay, some entries -1), the receive in kUnitExpFan: one token (the lone
    path) and 7 or 24 (the count table's, one token a channel at bucket 24)."""
    graph_replays_1a1f(dtype, bucket, tokens, FANOUT, 9950,
                       forms=(("kUnitExpFan", None), ("kSmallSend", None)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_fanout_expand_sanitizer_small(dtype):
    """Small 1A1F exchanges with AFDEP_FANOUT_EXPAND=1 (run under compute-sanitizer by
    scripts/gpu_suite.sh): units at buckets 24 and 8 (one token in all: the lone path; 7 and
    24: the table's), the count form at 64 and 48."""
    kw = cfg_kw("1A1F", 64, 1024, dtype)
    run("1A1F", kw, [(24, [7], "partial"), (24, [24], "random"), (64, [64], "random"),
                     (8, [1], "skewed"), (48, [33], "random"), (24, [0], "random"),
                     (1, [1], "partial")], env=FANOUT, seed=29)


def bucket1_plan(A):
    """Buckets 1: a token from every source, from one, from none, in every routing kind
    ("partial" leaves a token 0-8 valid entries: no row, one row copied, several summed), then
    bucket 8 and 1 again."""
    return [(1, [1] * A, "random"), (1, one_source(A, 0), "partial"), (1, [0] * A, "random"),
            (1, [1] * A, "skewed"), (1, one_source(A, A - 1), "random"), (1, [1] * A, "partial"),
            (8, [(3, 8, 1)[a % 3] for a in range(A)], "random"), (1, [1] * A, "random")]


# AFDEP_UNIT_SIGNAL (on by default; set here all the same): a reply CTA that wrote only flagged
# row units adds its completion count without a system fence; the CTAs of the start units and
# of a mismatch status still fence (reverted: test_each_control_reverted_alone)
UNIT = {"AFDEP_UNIT_SIGNAL": "1"}
UNIT_BIT = controls.CONTROLS["AFDEP_UNIT_SIGNAL"].bit


@pytest.mark.parametrize("layout,dtype", [("1A1F", "bfloat16"), ("2A2F", "float8_e4m3fn"),
                                          ("3A1F", "bfloat16"), ("1A3F", "bfloat16")])
def test_unit_signal_eager(layout, dtype):
    """AFDEP_UNIT_SIGNAL=1: every exchange of lone_plan, llx_plan and bucket1_plan exact on
    every rank. The expert layout's replies of flagged units (kUnitReply, most of their CTAs'
    counts unfenced) alternate with replies in the count form (buckets 48 and 128, every CTA
    fenced), whose collects read the rows behind the count: the counts stay in step across
    both."""
    A = LAYOUTS[layout][1]
    res = run(layout, cfg_kw(layout, 128, 2048, dtype), lone_plan(A) + llx_plan(A) +
              bucket1_plan(A), env={**UNIT, **LLX}, seed=89)
    for r, st in enumerate(res):
        assert st["flags"] & UNIT_BIT, (r, hex(st["flags"]))
        if st["role"] == "ffn":
            assert "kUnitReply" in st["forms"][1] and len(st["forms"][1]) > 1, (r, st["forms"])


@pytest.mark.parametrize("dtype,bucket,tokens", [("bfloat16", 1, 1), ("float8_e4m3fn", 24, 7)],
                         ids=["bf16-B1-T1", "fp8-B24-T7"])
def test_unit_signal_graph_replays(dtype, bucket, tokens):
    """AFDEP_UNIT_SIGNAL=1, 100 checked graph replays of a 1A1F exchange whose reply goes as
    flagged units (kUnitReply) with unfenced counts: every replay's rows exact, so no collect
    took a count ahead of the start units it reads behind it."""
    graph_replays_1a1f(dtype, bucket, tokens, UNIT, 9993,
                       forms=((None, "kUnitReply"), (None, "kSmallRecv")))


def test_unit_signal_sanitizer_small():
    """Small 1A1F exchanges with AFDEP_UNIT_SIGNAL=1 (run under compute-sanitizer by
    scripts/gpu_suite.sh): units replies at buckets 1 and 8 around a count-form one (48)."""
    kw = cfg_kw("1A1F", 48, 4096)
    run("1A1F", kw, [(1, [1], "random"), (8, [5], "partial"), (48, [40], "random"),
                     (1, [1], "skewed")], env=UNIT, seed=37)


# AFDEP_SPREAD_CHUNKS (on by default): the small combine forms give a row's chunks to one warp
# on each of several CTAs; the same forms (kUnitReply, kSmallRecv). The default's exchanges
# run in every other small-T test; these revert it, or run it on small grids
SPREAD_BIT = controls.CONTROLS["AFDEP_SPREAD_CHUNKS"].bit


@pytest.mark.parametrize("layout,dtype,local_sms,value", [
    ("1A1F", "bfloat16", 0, "0"), ("1A1F", "float8_e4m3fn", 0, "0"), ("2A2F", "bfloat16", 0, "0"),
    ("3A1F", "float8_e4m3fn", 0, "0"), ("1A3F", "bfloat16", 0, "0"), ("1A1F", "bfloat16", 5, "1"),
    ("2A2F", "bfloat16", 1, "1")])
def test_spread_chunks_eager(layout, dtype, local_sms, value):
    """Every exchange of llx_plan exact on every rank, its small-bucket replies in kUnitReply
    and its collects in kSmallRecv: with AFDEP_SPREAD_CHUNKS=0 (a row's chunks on one CTA's
    warps) on the automatic local grid (one CTA per SM; test_ll_experts_eager runs the same
    plans with the default), and with it on (the default) on grids of 5 and 1 CTAs (fewer CTAs
    than a row's chunks: a CTA takes several, G = 1 the unspread mapping)."""
    A = LAYOUTS[layout][1]
    kw = dict(cfg_kw(layout, 128, 2048, dtype), local_sms=local_sms)
    res = run(layout, kw, llx_plan(A), env={"AFDEP_SPREAD_CHUNKS": value}, seed=43)
    for r, st in enumerate(res):
        assert bool(st["flags"] & SPREAD_BIT) == (value == "1"), (r, hex(st["flags"]))
        want = "kUnitReply" if st["role"] == "ffn" else "kSmallRecv"
        assert want in st["forms"][1], (r, st["forms"])


@pytest.mark.parametrize("value", ["1", "0"], ids=["on", "reverted"])
@pytest.mark.parametrize("dtype,bucket,tokens", UNIT_CELLS,
                         ids=["bf16-B8-T1", "bf16-B48-T48", "fp8-B49-T7"])
def test_spread_chunks_graph_replays(dtype, bucket, tokens, value):
    """AFDEP_SPREAD_CHUNKS=1 (the default) and 0, 100 checked graph replays around the reply
    units' edge (buckets 8 and 48: kUnitReply, spread with the control on; 49: kCountSend,
    never spread); every collect in kSmallRecv."""
    # the reply's units up to bucket 48 (2 x 24 channels), the count form above
    graph_replays_1a1f(dtype, bucket, tokens, {"AFDEP_SPREAD_CHUNKS": value}, 9700,
                       forms=((None, "kUnitReply" if bucket <= 48 else "kCountSend"),
                              (None, "kSmallRecv")))


def test_spread_chunks_reverted_sanitizer_small():
    """Small 1A1F exchanges with AFDEP_SPREAD_CHUNKS=0 (run under compute-sanitizer by
    scripts/gpu_suite.sh; the default's small cases run there in test_ll_experts_sanitizer_small):
    units at buckets 24 and 8 (T 0, 1, 7, 24), the count form at 64."""
    kw = cfg_kw("1A1F", 64, 1024, "bfloat16")
    res = run("1A1F", kw, [(24, [7], "partial"), (24, [24], "random"), (64, [64], "random"),
                           (8, [1], "skewed"), (24, [0], "random")],
              env={"AFDEP_SPREAD_CHUNKS": "0"}, seed=47)
    assert not any(st["flags"] & SPREAD_BIT for st in res), [hex(st["flags"]) for st in res]
    assert res[0]["forms"][1] == {"kUnitReply", "kCountSend"}, res[0]["forms"]  # rank 0: FFN
    # T = 64 > 2 x 24 channels: the count form's collect (not a spread form)
    assert res[1]["forms"][1] == {"kSmallRecv", "kCountRecv"}, res[1]["forms"]


@pytest.mark.parametrize("layout", ["1A1F", "2A2F"])
def test_spread_chunks_without_param_bases(layout):
    """AFDEP_SPREAD_CHUNKS (the default) with AFDEP_PARAM_BASES=0: every window base is then
    two dependent global loads, so a start unit written through a base another warp had not yet
    stored (the race a review found in the spread reply's first version) would land elsewhere
    and the collect would miss it; buckets 1-3 (a row's chunks on the most CTAs; at bucket 1
    once with T = 0 on the first source) and llx_plan exact on every rank, the small-bucket
    replies in kUnitReply's spread instantiation."""
    A = LAYOUTS[layout][1]
    env = {"AFDEP_SPREAD_CHUNKS": "1", "AFDEP_PARAM_BASES": "0"}
    smallest = [(1, [1] * A, "random"), (1, [a % 2 for a in range(A)], "skewed"),
                (2, [(2, 1)[a % 2] for a in range(A)], "partial"),
                (3, [(3, 2)[a % 2] for a in range(A)], "random")]
    res = run(layout, cfg_kw(layout, 128, 2048), smallest + llx_plan(A), env=env, seed=61)
    for r, st in enumerate(res):
        if st["role"] == "ffn":
            # (bucket 128 takes the count form or the generic reply, by the grid)
            assert "kUnitReply" in st["forms"][1], (r, st["forms"])


# AFDEP_EARLY_COLLECT (on by default) is the token layout's collect (tests/gpu/
# test_token_layout_gpu.py): in the expert layout its collect keeps the barrier behind the
# start units (kSmallRecv), where the early form was 1-4% slower on one H200. Exported or
# reverted, the expert layout's collects are the same form and exact.
@pytest.mark.parametrize("value", ["1", "0"])
@pytest.mark.parametrize("layout,dtype", [("1A1F", "bfloat16"), ("2A2F", "float8_e4m3fn")])
def test_early_collect_not_in_expert_layout(layout, dtype, value):
    """AFDEP_EARLY_COLLECT=1 or 0: every exchange of llx_plan exact on every rank, and every
    Attention collect of flagged units (T <= 48) in kSmallRecv, never kEarlyCollect."""
    A = LAYOUTS[layout][1]
    res = run(layout, cfg_kw(layout, 128, 2048, dtype), llx_plan(A),
              env={"AFDEP_EARLY_COLLECT": value}, seed=29)
    bit = controls.CONTROLS["AFDEP_EARLY_COLLECT"].bit
    for r, st in enumerate(res):
        assert bool(st["flags"] & bit) == (value == "1"), (r, hex(st["flags"]))
        if st["role"] == "attention":
            assert "kSmallRecv" in st["forms"][1], (r, st["forms"])
            assert "kEarlyCollect" not in st["forms"][1], (r, st["forms"])


@pytest.mark.parametrize("env", [{}, SYM], ids=["role_aware", "symmetric"])
@pytest.mark.parametrize("layout,dtype", [("1A1F", "bfloat16"), ("1A1F", "float8_e4m3fn"),
                                          ("2A2F", "float8_e4m3fn"), ("3A1F", "bfloat16"),
                                          ("1A3F", "float8_e4m3fn")]
                         + ([("4A4F", "bfloat16"), ("6A2F", "float8_e4m3fn"),
                             ("7A1F", "bfloat16")] if EIGHT_GPUS else []))
def test_cuda_graph_replays(layout, dtype, env):
    F, A, devs, _ = LAYOUTS[layout]
    kw = cfg_kw(layout, 128, 2048, dtype)
    tokens = [(7, 128, 1)[a % 3] for a in range(A)]
    e = dict(BASE_ENV)
    e.update(env)
    res = spawn_gpu_world(gw.graph_body, F + A, kw, 128, tokens, 100, 5000, device_ids=devs, env=e,
                      timeout=600)
    assert all(r == 100 for r in res)


def _nccl_built() -> bool:
    try:
        import torch_afdep._cuda as c

        return int(getattr(c, "NCCL_VERSION_CODE", 0)) != 0
    except Exception:
        return False


NCCL = {"AFDEP_TRANSPORT": "nccl"}
needs_nccl = pytest.mark.skipif(not _nccl_built(),
                                reason="torch_afdep._cuda was built without the NCCL headers")
#: NCCL takes one rank per GPU: the 1A1F NCCL worlds need two
nccl_1a1f = need_gpus(2, "the NCCL transport takes one rank per GPU")


@needs_nccl
@nccl_1a1f
@pytest.mark.parametrize("env", [NCCL, {**NCCL, **SYM}], ids=["role_aware", "symmetric"])
@pytest.mark.parametrize("cap,hidden,dtype", [(128, 4096, "bfloat16"),
                                              (2048, 7168, "float8_e4m3fn")])
def test_nccl_transport_eager(env, cap, hidden, dtype):
    """The same kernels over NCCL device-API windows (LSA peer pointers) instead of CUDA IPC."""
    kw = cfg_kw("1A1F", cap, hidden, dtype)
    run("1A1F", kw, tokens_plan(1, cap), env=env)


@needs_nccl
@nccl_1a1f
def test_nccl_transport_graph_replays():
    kw = cfg_kw("1A1F", 128, 2048, "bfloat16")
    res = spawn_gpu_world(gw.graph_body, 2, kw, 128, [128], 100, 7000, env={**BASE_ENV, **NCCL}, timeout=600)
    assert res == [100, 100]


@needs_nccl
def test_nccl_transport_refuses_two_ranks_on_one_gpu():
    """NCCL allows one rank per GPU: a shared-GPU layout fails at construction with a hint."""
    from torch_afdep.testing import WorldError

    kw = cfg_kw("2A2F", 128, 1024)
    with pytest.raises(WorldError, match="one rank per GPU"):
        # two ranks on one GPU whatever the machine has (construction only: no MPS needed)
        spawn_world(gw.sizes_body, 4, kw, device_ids=[d % devices.gpu_count() for d in
                                                      (0, 1, 0, 1)],
                    env={**BASE_ENV, **NCCL}, timeout=120)


def test_timeout_raises():
    kw = cfg_kw("1A1F", 128, 2048, timeout=2.0)
    res = spawn_gpu_world(gw.timeout_body, 2, kw, env=BASE_ENV, timeout=120)
    ffn, att = res[0], res[1]
    assert ffn["raised"] == ("dispatch", "dispatch", 1, 0), ffn
    assert att["raised"] == ("combine", "combine", 0, 1), att
    for r in res:
        assert 1.9 <= r["elapsed"] <= 6.0, r


def test_sanitizer_small():
    """Small 1A1F exchange (run under compute-sanitizer by scripts/gpu_suite.sh)."""
    kw = cfg_kw("1A1F", 32, 1024)
    run("1A1F", kw, [(32, [7], "partial"), (32, [32], "random"), (32, [0], "random")])


@pytest.mark.parametrize("layout,afdep_env", [
    ("experts", []), ("tokens", []), ("experts", ["AFDEP_RAW_META=1"]),
    ("tokens", ["AFDEP_RAW_META=1"]), ("experts", ["AFDEP_FANOUT_EXPAND=1"]),
    ("experts", ["AFDEP_UNIT_SIGNAL=0"]), ("experts", ["AFDEP_SHUFFLE_MATCH=0"]),
    ("tokens", ["AFDEP_SHUFFLE_MATCH=0"]), ("tokens", ["AFDEP_SETTLE_UNITS=0"])],
    ids=["experts-defaults", "tokens-defaults", "experts-raw_meta", "tokens-raw_meta",
         "experts-fanout", "experts-unit_signal_off", "experts-match_any",
         "tokens-match_any", "tokens-spin_each"])
def test_trace_stages_are_ordered(layout, afdep_env, tmp_path):
    """benchmarks.trace (AFDEP_TRACE=1) on two GPUs, or on one under CUDA MPS: every stage of
    a T = 1, a T = 128 and again a T = 1 exchange is recorded and the CTA-0 sub-stages (claim,
    payload, signal; the claim's first loads; count table; reply rows and, in the token layout
    at T = 1, the reply's first row loaded) are non-negative and add up within the stage they
    split (the reply also at CTA 0's signal); each kernel's latest CTA start is at or after
    CTA 0's. raw_meta: AFDEP_RAW_META=1, whose T = 1 dispatch in the token layout (kRawSend)
    stamps the claim after its copy; the expert layout keeps kSmallSend. fanout:
    AFDEP_FANOUT_EXPAND=1, the T = 1 receive in kUnitExpFan (stamped as kUnitExpRecv);
    unit_signal_off: AFDEP_UNIT_SIGNAL=0 (on by default), the default forms; match_any:
    AFDEP_SHUFFLE_MATCH=0 (on by default), the default forms (the claim's and the lone
    receive's repeated ids by MATCH.ANY); spin_each: AFDEP_SETTLE_UNITS=0 (on by default), the
    default forms (the token layout's receive spinning on each metadata unit in turn). Where the
    token layout's receive settles its units (not spin_each, not raw_meta), its wait splits at
    its first poll's return."""
    import json

    from benchmarks import trace  # the repository root is on sys.path (pythonpath)
    from torch_afdep import mps

    if trace.trace_devices(devices.gpu_count(), mps.mps_running()) is None:
        pytest.skip("benchmarks.trace needs two GPUs, or one with CUDA MPS running")

    out = tmp_path / "trace.json"
    # T = 1 again after T = 128 in the same buffer: its ring slots held T = 128's exchanges
    # (40 replays a cell wrap the 64-slot ring), whose count-table stamps must not show through
    assert trace.main(["--tokens", "1", "128", "1", "--arms", "afdep", "--replays", "40",
                       "--receive-layout", layout, "--out", str(out)]
                      + (["--afdep-env", *afdep_env] if afdep_env else [])) == 0
    data = json.loads(out.read_text())
    rows = data["results"]["afdep"][0]
    assert [r["tokens"] for r in rows] == [1, 128, 1]
    if afdep_env:  # the T = 1 dispatch's form (T = 128: the count form or generic)
        want = {"AFDEP_RAW_META=1": "kRawSend" if layout == "tokens" else "kSmallSend",
                "AFDEP_FANOUT_EXPAND=1": "kSmallSend", "AFDEP_UNIT_SIGNAL=0": "kSmallSend",
                "AFDEP_SHUFFLE_MATCH=0": "kSmallSend", "AFDEP_SETTLE_UNITS=0": "kSmallSend"}
        assert rows[0]["kernel_forms"][0] == want[afdep_env[0]], rows[0]["kernel_forms"]
    # the T = 1 receive's and reply's forms
    want_ffn = {"experts": ["kUnitExpFan" if afdep_env == ["AFDEP_FANOUT_EXPAND=1"]
                            else "kUnitExpRecv", "kUnitReply"],
                "tokens": ["kRawRecv" if afdep_env == ["AFDEP_RAW_META=1"] else "kSmallRecv",
                           "kSmallSend"]}
    for r in (rows[0], rows[2]):
        assert r["ffn_kernel_forms"] == want_ffn[layout], r["ffn_kernel_forms"]
    assert data["globaltimer"] and data["globaltimer"][0]["step_ns"] > 0, data["globaltimer"]
    for r in rows:
        s = r["stages_us"]
        parts = [s["  A CTA0: start -> tokens claimed"], s["  A CTA0: claimed -> payload written"],
                 s["  A CTA0: payload written -> counts signalled"]]
        assert all(0 <= p < 1000 for p in parts), (r["tokens"], parts)
        assert sum(parts) <= s["A dispatch: start -> last CTA sent"] + 1.0, s
        loads = [s["    A CTA0: start -> first loads arrived"],
                 s["    A CTA0: first loads arrived -> tokens claimed"]]
        assert all(0 <= p for p in loads), (r["tokens"], loads)
        assert abs(sum(loads) - parts[0]) < 0.5, (r["tokens"], loads, parts[0])
        table = "  F CTA0: counts seen -> count table loaded"
        if layout == "experts" and r["tokens"] == 1:
            # one token in all: AFDEP_LONE_EXPAND (on by default) builds no count table
            assert table not in s and s["F counts seen -> offsets ready"] >= 0, s
            # ... and its offsets follow the token's metadata units
            ul = [s["  F CTA0: counts seen -> token units seen"],
                  s["  F CTA0: token units seen -> offsets ready"]]
            assert all(0 <= p for p in ul), ul
            assert abs(sum(ul) - s["F counts seen -> offsets ready"]) < 0.5, (ul, s)
            rk = [s["    F CTA0: token units seen -> row known"],
                  s["    F CTA0: row known -> offsets ready"]]
            assert all(0 <= p for p in rk), rk
            assert abs(sum(rk) - ul[1]) < 0.5, (rk, s)
        elif layout == "experts":  # the token layout's receive has no count table
            assert 0 <= s[table] <= s["F counts seen -> offsets ready"], s
        assert 0 <= s["  F CTA0: start -> reduced rows written"] <= \
            s["F reply (start -> last CTA signalled)"], s
        # the reply split at CTA 0's signal: its rows, its fence and count, the other CTAs
        tail = [s["  F CTA0: start -> reduced rows written"],
                s["  F CTA0: rows written -> signalled"],
                s["  F reply: CTA0 signalled -> last CTA signalled"]]
        assert all(0 <= p for p in tail), tail
        assert abs(sum(tail) - s["F reply (start -> last CTA signalled)"]) < 0.5, (tail, s)
        assert 0 <= s["  A dispatch: CTA0 signalled -> last CTA signalled"] <= \
            s["A dispatch: start -> last CTA sent"], s
        if layout == "tokens" and r["tokens"] == 1:  # the units receive's token units
            tu = [s["    F CTA0: ready -> token units seen"],
                  s["    F CTA0: token units seen -> its end"]]
            assert all(0 <= p for p in tu), tu
            assert abs(sum(tu) - s["  F CTA0: ready -> its end"]) < 0.5, (tu, s)
            polled = [s.get("      F CTA0: ready -> first poll returned"),
                      s.get("      F CTA0: first poll returned -> token units seen")]
            if afdep_env not in (["AFDEP_SETTLE_UNITS=0"], ["AFDEP_RAW_META=1"]):  # settled
                assert all(p is not None and 0 <= p for p in polled), (polled, s)
                assert abs(sum(polled) - tu[0]) < 0.5, (polled, tu, s)
            else:  # spin_each and kRawRecv stamp no first poll
                assert polled == [None, None], (polled, s)
        if layout == "tokens" and r["tokens"] == 1:  # the reply's early loads
            rl = [s["    F CTA0: start -> first row loaded"],
                  s["    F CTA0: first row loaded -> rows written"]]
            assert all(0 <= p for p in rl), rl
            assert abs(sum(rl) - s["  F CTA0: start -> reduced rows written"]) < 0.5, (rl, s)
        assert 0 < s["A kernels total (dispatch start -> combine end)"] < r["latency_us"], s
        # every CTA stamps its start (the latest one's against CTA 0's); the latest start
        # precedes the latest end
        spread = {k: v for k, v in s.items() if k.endswith("CTA0 start -> last CTA start")}
        assert len(spread) == 4 and all(0 <= v < 1000 for v in spread.values()), spread
        assert spread["  A dispatch: CTA0 start -> last CTA start"] <= \
            s["A dispatch kernel (start -> last CTA end)"], s
