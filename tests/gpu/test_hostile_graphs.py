"""Hostile inputs inside CUDA graph replays (the host cannot see them there), against the
contract (docs/contract.md), on the CUDA transport.

Every test captures one exchange per rank (Attention: dispatch + combine; FFN: receive, the
``checks.ffn_rows`` expert, reply) per scenario, replays it with fresh hostile inputs
copied into the captured tensors, poisons every output before each replay, and checks every
replay on every rank: the Attention output bit for bit against an exact model (NaN and +-Inf
positions included; tokens without a valid expert exactly zero) and against the fp64
reference, the route handle, and everything the FFN ranks received (rows, expert offsets,
weights, payload bits, receipt). Bodies and the hostile input kinds: tests/helpers/hostile.py.

Layouts: 1A1F = rank 0 FFN, rank 1 Attention; 2A2F = ranks 0, 1 FFN, ranks 2, 3 Attention;
1A2F = ranks 0, 1 FFN, rank 2 Attention; rank r on GPU r % n_gpus (CUDA IPC; ranks sharing a
GPU under CUDA MPS).
Skipped cleanly without a CUDA GPU or without the built extension; rank r runs on
GPU r % n_gpus (shared GPUs need CUDA MPS).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


from tests.helpers import devices  # noqa: E402

devices.require_gpu_module()

from tests.helpers import hostile as hb  # noqa: E402
from torch_afdep import controls  # noqa: E402


ENV = devices.GPU_ENV
LAYOUTS = {name: (f, a, devices.rank_devices(f + a))
           for name, (f, a) in {"1A1F": (1, 1), "2A2F": (2, 2), "1A2F": (2, 1)}.items()}


def kw(layout, cap=128, hidden=2048, experts=128, top_k=8, sms=24, timeout=30.0):
    F, A, _ = LAYOUTS[layout]
    return dict(capacity_tokens_per_rank=cap, hidden_size=hidden, num_experts=experts,
                top_k=top_k, ffn_ranks=F, attention_ranks=A, dtype="bfloat16", num_sms=sms,
                timeout_s=timeout)


def sc(kind, tokens, replays=8, id_dtype="int64"):
    return {"kind": kind, "tokens": list(tokens), "replays": replays, "id_dtype": id_dtype}


def run(layout, cfg_kw, scenarios, seed, dup_mode="contract", timeout=600, env=None):
    F, A, devs = LAYOUTS[layout]
    return devices.spawn_gpu_world(hb.hostile_graph_body, F + A, cfg_kw, scenarios, seed, dup_mode,
                       device_ids=devs, env={**ENV, **(env or {})}, timeout=timeout)


def _att(stats):
    return [s for s in stats if s["role"] == "attention"]


def _replays(scenarios):
    """Checks one rank makes: one eager warm-up plus the replays, per scenario."""
    return sum(1 + s["replays"] for s in scenarios)


# (a) out-of-range ids, (c) NaN/Inf payloads, (d) one expert, (f) no route; in 1A1F
SCEN_1A1F = [
    sc("bad_ids", [128], 12),
    sc("bad_ids", [77], 6, "int32"),
    sc("nonfinite", [128], 8),
    sc("one_expert", [128], 6),
    sc("no_route", [64], 4),
    sc("no_route", [1], 2, "int32"),
]
# the same plus (e) T = 0 on some Attention ranks, in 2A2F
SCEN_2A2F = [
    sc("bad_ids", [128, 0], 8),
    sc("bad_ids", [5, 128], 6, "int32"),
    sc("nonfinite", [0, 128], 6),
    sc("one_expert", [128, 97], 6),
    sc("no_route", [128, 0], 3),
    sc("nonfinite", [0, 0], 3),
]


# the defaults, and the four small-batch controls reverted (the defaults before them)
PREVIOUS = devices.PREVIOUS_DEFAULTS


@pytest.mark.parametrize("env", [{}, PREVIOUS], ids=["defaults", "previous_defaults"])
@pytest.mark.parametrize("layout", ["1A1F", "2A2F"])
def test_hostile_graph_replays(layout, env):
    """Out-of-range ids (>= E and < -1, up to +-2**40) in some entries of some tokens:
    check_error raises AfdepRouteError on the Attention rank after exactly the replays that
    had them (clean replays in between must not raise: the error does not stick), nothing on
    the FFN ranks, and every valid entry of every token is exact (the bad ones count as -1).
    NaN / +-Inf payloads pass through unchanged (NaN stays NaN, Inf stays Inf with its sign;
    a NaN row without experts gives zeros). All tokens on one expert. Every entry -1: route 0,
    output exactly zero, the FFN ranks receive nothing. 2A2F adds T = 0 on one or both
    Attention ranks."""
    scen = SCEN_1A1F if layout == "1A1F" else SCEN_2A2F
    stats = run(layout, kw(layout), scen, seed=3, env=env)
    for s in stats:
        assert s["checked"] == _replays(scen), s
    for s in _att(stats):
        assert s["route_errors"] > 0 and s["dup_route_errors"] == 0, s
        assert s["nonfinite_out"] > 0 or layout == "2A2F", s  # the NaN/Inf reached the output
    if layout == "2A2F":
        assert sum(s["nonfinite_out"] for s in _att(stats)) > 0


# Hostile inputs at bucket 48 over 48 channels (one token each), where the reply goes as
# flagged units, and so does the expert layout's dispatch (AFDEP_LL_EXPERTS, on by default,
# where a channel holds one token)
SCEN_LLX = {
    "1A1F": [sc("bad_ids", [48], 8), sc("bad_ids", [1], 4, "int32"), sc("nonfinite", [48], 4),
             sc("one_expert", [33], 4), sc("no_route", [7], 2), sc("dups", [48], 4)],
    "2A2F": [sc("bad_ids", [48, 0], 6), sc("bad_ids", [7, 48], 6, "int32"),
             sc("nonfinite", [0, 48], 4),
             sc("one_expert", [48, 31], 4), sc("no_route", [48, 0], 2),
             sc("dups", [1, 48], 4, "int32")],
}


@pytest.mark.parametrize("arm", ["defaults", "count_form", "spread_off", "fanout",
                                 "match_any"])
@pytest.mark.parametrize("layout", ["1A1F", "2A2F"])
def test_units_hostile_graph_replays(layout, arm):
    """test_hostile_graph_replays' kinds (and duplicated ids, checked against the contract)
    at bucket 48 over 48 channels, where the reply goes as flagged units and, with the
    defaults, the expert layout's dispatch too (AFDEP_LL_EXPERTS: kSmallSend, kUnitExpRecv);
    count_form: AFDEP_LL_EXPERTS=0, the count-block dispatch (kCountSend, kCountRecv);
    spread_off: AFDEP_SPREAD_CHUNKS=0, the reply's and collect's chunks on one CTA's warps
    (spread over the CTAs in the other arms); fanout: AFDEP_FANOUT_EXPAND=1, the receive in
    kUnitExpFan; match_any: AFDEP_SHUFFLE_MATCH=0, the claim's repeated ids found by
    MATCH.ANY (by shuffles in the other arms). The collect takes the units with a barrier behind the start units in every arm
    (kSmallRecv: AFDEP_EARLY_COLLECT is the token layout's), the reply is kUnitReply in every
    arm.
    Out-of-range ids reported on the Attention rank after the replays that had them, every
    valid entry exact on every rank, NaN / Inf passed through, tokens without a route giving
    zeros."""
    scen = SCEN_LLX[layout]
    # 48 sender channels: one token each at bucket 48 (the dispatch units' edge)
    env = {"defaults": {}, "count_form": {"AFDEP_LL_EXPERTS": "0"},
           "spread_off": {"AFDEP_SPREAD_CHUNKS": "0"},
           "fanout": {"AFDEP_FANOUT_EXPAND": "1"},
           "match_any": {"AFDEP_SHUFFLE_MATCH": "0"}}[arm]
    stats = run(layout, kw(layout, cap=48, sms=48), scen, seed=9, env=env)
    units = arm != "count_form"
    spread = controls.CONTROLS["AFDEP_SPREAD_CHUNKS"].bit
    shuffle = controls.CONTROLS["AFDEP_SHUFFLE_MATCH"].bit
    for s in stats:
        assert s["checked"] == _replays(scen), s
        assert bool(s["flags"] & spread) == (arm != "spread_off"), (arm, hex(s["flags"]))
        assert bool(s["flags"] & shuffle) == (arm != "match_any"), (arm, hex(s["flags"]))
        # the arm's dispatch path ran, and the expert layout's collect never takes the early one
        want = {"ffn": ("kUnitExpFan" if arm == "fanout" else "kUnitExpRecv") if units
                else "kCountRecv",
                "attention": "kSmallSend" if units else "kCountSend"}[s["role"]]
        assert s["forms"][0] == {want}, s["forms"]
        # and the reply in units (bucket 48 <= 2 x 48 channels), spread but in spread_off
        assert s["forms"][1] == {"kSmallRecv" if s["role"] == "attention" else "kUnitReply"}, \
            s["forms"]
    for s in _att(stats):
        assert s["route_errors"] > 0, s


# The same kinds where every FFN rank receives one token in all (AFDEP_LONE_EXPAND's path in
# kUnitExpRecv: the token's rows from its own entries, no count table), or none
SCEN_LONE = {
    "1A1F": [sc("bad_ids", [1], 6), sc("dups", [1], 6, "int32"), sc("nonfinite", [1], 3),
             sc("one_expert", [1], 4), sc("no_route", [1], 2), sc("mixed", [1], 4)],
    "2A2F": [sc("bad_ids", [1, 0], 6), sc("dups", [0, 1], 6, "int32"),
             sc("nonfinite", [1, 0], 3), sc("one_expert", [0, 1], 4), sc("no_route", [1, 0], 2),
             sc("mixed", [0, 1], 4)],
}


@pytest.mark.parametrize("arm", ["defaults", "lone_off", "fanout", "fanout_lone_off",
                                 "match_any", "match_any_fanout"])
@pytest.mark.parametrize("layout", ["1A1F", "2A2F"])
def test_lone_expand_hostile_graph_replays(layout, arm):
    """test_units_hostile_graph_replays' kinds (and the mixed one) with one token in all from
    one source at bucket 48 over 48 channels: the expert layout's dispatch as units
    (kSmallSend, kUnitExpRecv), whose receive takes AFDEP_LONE_EXPAND's path with the defaults
    (lone_off: AFDEP_LONE_EXPAND=0, the count table); fanout: the same with
    AFDEP_FANOUT_EXPAND=1 (the receive in kUnitExpFan); match_any: AFDEP_SHUFFLE_MATCH=0, the
    claim's repeated ids and the lone receive's rows by MATCH.ANY (with the fan-out form:
    match_any_fanout; by shuffles in the other arms). Out-of-range ids reported on the
    Attention rank after the replays that had them, duplicates counted once, every valid entry
    exact on every rank, NaN / Inf passed through, a token without a route giving zeros."""
    scen = SCEN_LONE[layout]
    env = {"defaults": {}, "lone_off": {"AFDEP_LONE_EXPAND": "0"},
           "fanout": {"AFDEP_FANOUT_EXPAND": "1"},
           "fanout_lone_off": {"AFDEP_FANOUT_EXPAND": "1", "AFDEP_LONE_EXPAND": "0"},
           "match_any": {"AFDEP_SHUFFLE_MATCH": "0"},
           "match_any_fanout": {"AFDEP_SHUFFLE_MATCH": "0", "AFDEP_FANOUT_EXPAND": "1"}}[arm]
    stats = run(layout, kw(layout, cap=48, sms=48), scen, seed=13, env=env)
    lone = controls.CONTROLS["AFDEP_LONE_EXPAND"].bit
    shuffle = controls.CONTROLS["AFDEP_SHUFFLE_MATCH"].bit
    fan = "fanout" in arm
    for s in stats:
        assert s["checked"] == _replays(scen), s
        assert bool(s["flags"] & lone) == ("lone_off" not in arm), (arm, hex(s["flags"]))
        assert bool(s["flags"] & shuffle) == (not arm.startswith("match_any")), \
            (arm, hex(s["flags"]))
        want = {"ffn": "kUnitExpFan" if fan else "kUnitExpRecv",
                "attention": "kSmallSend"}[s["role"]]
        assert s["forms"][0] == {want}, s["forms"]
    assert sum(s["route_errors"] for s in _att(stats)) > 0, stats


@pytest.mark.parametrize("layout,experts,llx", [("1A1F", 128, False), ("2A2F", 128, False),
                                                ("2A2F", 8, False), ("2A2F", 8, True),
                                                ("2A2F", 8, "fanout"),
                                                ("2A2F", 8, "match_any")],
                         ids=["1A1F-R8", "2A2F-R8", "2A2F-E8-R4-clip",
                              "2A2F-E8-R4-clip-ll_experts", "2A2F-E8-R4-clip-fanout",
                              "2A2F-E8-R4-clip-match_any"])
def test_graph_duplicate_ids(layout, experts, llx):
    """Duplicated expert ids within a token (some tokens with all k entries equal): per the
    contract a duplicate counts once, with its first occurrence's weight
    (torch_afdep.reference.dedupe): the FFN ranks receive one row per distinct (token,
    expert), and the output is exact against the deduplicated routing. In the E=8 case
    (E_local = 4 < top_k = 8, so R = 4) duplicates also push a token past R entries on one
    FFN rank (the kernel's clipping path); an AfdepRouteError there is allowed but the data
    must still follow the contract. With llx, at capacity 48 over 48 channels, the dispatch
    goes as flagged units (AFDEP_LL_EXPERTS, the default there), whose entry layout holds
    R = 4 entries here, not top_k; the others run at capacity 128 (5-6 tokens a channel: the
    count-block dispatch); "fanout": as llx with AFDEP_FANOUT_EXPAND=1 (kUnitExpFan);
    "match_any": as llx with AFDEP_SHUFFLE_MATCH=0 (the claim's and the lone receive's
    repeated ids by MATCH.ANY; by shuffles in the other llx cases)."""
    A = LAYOUTS[layout][1]
    if llx:
        scen = [sc("dups", [48] * A, 10), sc("dups", [33, 1][:A], 4, "int32")]
        env = {"fanout": {"AFDEP_FANOUT_EXPAND": "1"},
               "match_any": {"AFDEP_SHUFFLE_MATCH": "0"}}.get(llx)
        stats = run(layout, kw(layout, cap=48, experts=experts, sms=48), scen, seed=5, env=env)
    else:
        scen = [sc("dups", [128] * A, 10), sc("dups", [33] * A, 4, "int32")]
        stats = run(layout, kw(layout, experts=experts), scen, seed=5)
    for s in stats:
        assert s["checked"] == _replays(scen), s
        if llx:  # the units path ran
            want = {"ffn": "kUnitExpFan" if llx == "fanout" else "kUnitExpRecv",
                    "attention": "kSmallSend"}[s["role"]]
            assert s["forms"][0] == {want}, s["forms"]


@pytest.mark.parametrize("layout", ["1A1F", "1A2F"])
def test_hostile_sanitizer_small(layout):
    """Tiny config, few replays of the 'mixed' hostile kind (out-of-range ids, duplicates,
    NaN/Inf, tokens without experts, in one exchange), one expert and no route, for
    compute-sanitizer memcheck (scripts/gpu_suite.sh runs ``pytest -k sanitizer`` under it):
    no out-of-bounds access. Checked like the other tests, except tokens with duplicated ids
    (memory safety only here; their data is checked by test_graph_duplicate_ids). 1A2F has
    E_local = 2 < top_k = 4, so duplicates reach the clipping path."""
    F, A, _ = LAYOUTS[layout]
    cfg = kw(layout, cap=16, hidden=256, experts=16 if layout == "1A1F" else 4, top_k=4,
             sms=4, timeout=120.0)
    scen = [sc("mixed", [16], 3), sc("mixed", [5], 2, "int32"), sc("one_expert", [16], 1),
            sc("no_route", [7], 1)]
    stats = run(layout, cfg, scen, seed=7, dup_mode="memory", timeout=900)
    for s in _att(stats):
        assert s["checked"] == _replays(scen) and s["route_errors"] > 0, s
