"""CPU tests of the benchmark harness (benchmarks/): arguments, the shared core
(benchmarks.common), statistics, aggregation, writers, the nccl arm's torch-op exchange
against torch_afdep.reference, and the whole harness end to end in --cpu-smoke mode (gloo,
eager steps; the GPU run itself is not here).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys
import time
import types

import pytest
import torch

from benchmarks import arms, common, overlap, report, run, soak, stats
from benchmarks import torch_exchange as tx
from benchmarks.common import ROOT
from torch_afdep import env
from torch_afdep import reference as ref
from torch_afdep.config import Config


# ---- arguments ----------------------------------------------------------------------------
def test_defaults_match_the_issue():
    a = run.parse_args([])
    assert a.layout == ["1A1F"]
    assert a.hidden == [2048, 4096, 7168]
    assert a.dtype == ["bf16", "fp8"]
    assert a.routing == ["random", "skewed"]
    assert a.tokens == [1, 8, 32, 128, 512, 2048]
    assert a.arms == ["afdep", "symmetric", "nccl", "nccl_bare"]
    assert a.receive_layouts == ["experts", "tokens"]
    assert (a.experts, a.top_k, a.capacity, a.sms) == (128, 8, 2048, 24)
    assert a.repeats >= 3 and a.replays >= 200


def test_quick_grid_and_explicit_flags_win():
    a = run.parse_args(["--quick"])
    assert a.hidden == [2048] and a.tokens == [1, 128] and a.replays < 200
    b = run.parse_args(["--quick", "--tokens", "4", "--replays", "7", "--warmup", "3"])
    assert b.tokens == [4] and b.replays == 7 and b.warmup == 3


@pytest.mark.parametrize("text,want", [("1A1F", (1, 1)), ("2a2f", (2, 2)), ("3A1F", (3, 1)),
                                       ("7A1F", (7, 1)), ("1A4F", (1, 4))])
def test_layouts_parse(text, want):
    assert run.parse_layout(text) == want


def test_layouts_accepted_by_the_cli():
    a = run.parse_args(["--layout", "2A2F", "3A1F", "7a1f", "1A1F"])
    assert a.layout == ["2A2F", "3A1F", "7A1F", "1A1F"]


@pytest.mark.parametrize("argv", [["--layout", "2X2F"], ["--layout", "0A1F"],
                                  ["--layout", "1A3F"],  # 128 experts over 3 FFN ranks
                                  ["--tokens", "4096"], ["--tokens", "0"],
                                  ["--hidden", "1000"], ["--repeats", "0"],
                                  ["--dtype", "fp16"], ["--arms", "deepep"],
                                  ["--afdep-env", "AFDEP_BOGUS=1"],
                                  ["--afdep-env", "AFDEP_SPREAD_CHUNKS=2"],
                                  ["--afdep-env", "AFDEP_SPREAD_CHUNKS"],
                                  ["--arms", "afdep", "afdep_alt"],  # no --alt-env
                                  ["--alt-env", "AFDEP_LL_SMALL=1"],  # no afdep_alt arm
                                  ["--arms", "afdep_alt", "--alt-env", "AFDEP_BOGUS=1"],
                                  ["--local-sms", "-1"], ["--local-sms", "1025"]])
def test_bad_arguments_exit_with_a_message(argv, capsys):
    with pytest.raises(SystemExit) as e:
        run.parse_args(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_experts_fix_for_three_ffn_ranks():
    a = run.parse_args(["--layout", "1A3F", "--experts", "96"])
    assert a.layout == ["1A3F"] and a.experts == 96


def test_plan_maps_ranks_round_robin_and_skips_nccl_when_gpus_are_shared():
    a = run.parse_args(["--layout", "1A1F", "2A2F", "7A1F", "--quick"])
    plan = run.make_plan(a, 2)
    gpus = {lay["name"]: lay["gpus"] for lay in plan["layouts"]}
    assert gpus == {"1A1F": [0, 1], "2A2F": [0, 1, 0, 1], "7A1F": [0, 1] * 4}
    assert len(plan["cells"]) == 4  # 2 T x 2 receive layouts, experts first
    assert [c["receive_layout"] for c in plan["cells"]] == ["experts"] * 2 + ["tokens"] * 2
    assert report.arm_cells("afdep", plan) == [0, 1, 2, 3]
    assert report.arm_cells("nccl_bare", plan) == [0, 1]  # layout-free: timed once per cell
    one = run.make_plan(run.parse_args(["--receive-layouts", "tokens", "--quick"]), 2)
    assert report.arm_cells("nccl_bare", one) == [0, 1]
    assert {c["receive_layout"] for c in one["cells"]} == {"tokens"}
    assert run.skip_reason("nccl", 2, 2, {}) is None
    assert "one GPU per rank" in run.skip_reason("nccl", 4, 2, {})
    assert run.skip_reason("afdep", 8, 2, {"afdep_cuda_ext": True}) is None
    assert "_cuda" in run.skip_reason("symmetric", 2, 2, {"afdep_cuda_ext": False,
                                                          "afdep_cuda_ext_error": "x"})


def test_local_sms_reaches_the_plan_and_every_afdep_config():
    """--local-sms (Config.local_sms: CTAs of the FFN's receive and reply and of the
    Attention's collect) is recorded in the plan and given to each afdep buffer's Config;
    0, the default, keeps Config's own default."""
    assert run.parse_args([]).local_sms == 0
    a = run.parse_args(["--quick", "--local-sms", "8"])
    assert run.make_plan(a, 1)["local_sms"] == 8
    spec = {"capacity": 64, "experts": 8, "top_k": 2, "sms": 4, "kernel_timeout_s": 5.0,
            "local_sms": 8}
    rank = types.SimpleNamespace(spec=spec, F=1, A=1)
    assert arms._Rank.config(rank, 256, "bf16", "tokens").local_sms == 8
    del spec["local_sms"]  # a spec written before the option: the default
    assert arms._Rank.config(rank, 256, "bf16").local_sms == 0


def test_arm_order_rotates_across_repeats():
    arms = ["afdep", "symmetric", "nccl", "nccl_bare"]
    firsts = [run.arm_order(arms, r)[0] for r in range(4)]
    assert sorted(firsts) == sorted(arms)
    for r in range(4):
        assert sorted(run.arm_order(arms, r)) == sorted(arms)


def test_default_grid_fits_the_time_budget_estimate():
    """Both receive layouts, full grid: on one GPU (the NCCL arms skip: one GPU per rank)
    within about 8 minutes and the default --time-budget; two GPUs need more (or fewer
    repeats)."""
    a = run.parse_args([])
    one = run.estimate_run_s(a, run.make_plan(a, 1), 1)
    assert one < min(8 * 60, a.time_budget)
    two = run.estimate_run_s(a, run.make_plan(a, 2), 2)
    assert two > one  # plus nccl (144 cells) and nccl_bare (72 cells, once per cell)
    a2 = run.parse_args(["--repeats", "2"])
    assert run.estimate_run_s(a2, run.make_plan(a2, 2), 2) < a2.time_budget


def test_shared_gpu_needs_mps_for_the_afdep_arms(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))  # no daemon there
    assert run.ranks_per_gpu([0, 0]) == 2 and run.ranks_per_gpu([0, 1]) == 1
    why = run.skip_reason("afdep", 2, 1, {}, gpus=[0, 0])
    assert why and "MPS" in why
    assert run.skip_reason("afdep", 2, 2, {}, gpus=[0, 1]) is None
    assert run.skip_reason("afdep", 2, 1, {}, cpu_smoke=True, gpus=[0, 0]) is None
    os.mkfifo(str(tmp_path / "control"))  # what a running daemon leaves
    assert run.skip_reason("symmetric", 2, 1, {}, gpus=[0, 0]) is None
    assert "one GPU per rank" in run.skip_reason("nccl", 2, 1, {}, gpus=[0, 0])


def test_inject_parsing():
    assert run.parse_inject("") == []
    assert run.parse_inject("nccl,1,0,setup; *,2,1,eager") == [
        {"arm": "nccl", "index": 1, "rank": 0, "phase": "setup"},
        {"arm": None, "index": 2, "rank": 1, "phase": "eager"}]


# ---- statistics ---------------------------------------------------------------------------
def test_median_and_percentiles():
    assert stats.median([3.0, 1.0, 2.0]) == 2.0
    assert stats.median([4.0, 1.0, 2.0, 3.0]) == 2.5
    assert stats.median([None, 5.0, float("nan")]) == 5.0
    assert stats.median([]) is None
    s = stats.summarize_samples([float(x) for x in range(1, 101)])
    assert s["median_us"] == 50.5 and s["min_us"] == 1.0 and s["n"] == 100
    assert abs(s["p10_us"] - 10.9) < 1e-9 and abs(s["p90_us"] - 90.1) < 1e-9


def test_max_over_attention_ranks():
    assert stats.max_over_ranks({2: 10.0, 3: 12.5}) == 12.5
    assert stats.max_over_ranks({2: 10.0, 3: None}) is None  # a missing rank invalidates
    assert stats.max_over_ranks({}) is None


def test_geometric_mean_of_paired_ratios():
    # ratios 0.5, 1, 2 -> geometric mean 1 -> 0 % (an arithmetic mean would say +16.7 %)
    assert abs(stats.paired_change_pct([10, 20, 40], [20, 20, 20])) < 1e-12
    assert abs(stats.paired_change_pct([9, 18, 27], [10, 20, 30]) - (-10.0)) < 1e-9
    # pairs by repeat index; incomplete pairs are dropped
    assert abs(stats.paired_change_pct([9, None, 27], [10, 20, None]) - (-10.0)) < 1e-9
    assert stats.paired_change_pct([None], [1.0]) is None
    assert stats.wins([9, 21, 27], [10, 20, 30]) == "2/3"
    g = stats.geomean([1.0, 4.0])
    assert abs(g - 2.0) < 1e-12


# ---- aggregation and writers --------------------------------------------------------------
def _synthetic(arms=("afdep", "symmetric", "nccl", "nccl_bare"), repeats=3):
    """2A1F (ranks: 0 = FFN, 1 and 2 = Attention), two cells, per-rank medians chosen so that
    the max over ranks and the median over repeats are easy to read off."""
    plan = {"cells": [{"hidden": 2048, "dtype": "bf16", "routing": "random", "tokens": 1},
                      {"hidden": 2048, "dtype": "bf16", "routing": "random", "tokens": 2048}],
            "layouts": [{"name": "2A1F", "attention": 2, "ffn": 1, "gpus": [0, 1, 0]}],
            "arms": list(arms), "repeats": repeats, "experts": 128, "top_k": 8,
            "capacity": 2048, "sms": 24}
    base = {"afdep": 20.0, "symmetric": 30.0, "nccl": 50.0, "nccl_bare": 40.0}
    raw = []
    for rep in range(repeats):
        for arm in arms:
            ranks = {0: {"meta": {}, "cells": {}}, 1: {"meta": {}, "cells": {}},
                     2: {"meta": {}, "cells": {}}}
            for idx, cell in enumerate(plan["cells"]):
                scale = 1.0 if idx == 0 else 10.0
                b = base[arm] * scale + rep  # repeats 0, 1, 2 add 0, 1, 2 µs
                ranks[0]["cells"][idx] = {"status": "ok", "registered_bytes": 300,
                                          "union_bytes": 400, "flags": 63,
                                          "kernel_forms": ["kSmallRecv", "kSmallSend"]}
                ranks[1]["cells"][idx] = {"status": "ok", "median_us": b,
                                          "reach_tokens": [cell["tokens"]],
                                          "registered_bytes": 100, "union_bytes": 400,
                                          "kernel_forms": ["kSmallSend", "kEarlyCollect"]}
                ranks[2]["cells"][idx] = {"status": "ok", "median_us": b + 0.5,
                                          "reach_tokens": [cell["tokens"]]}
            raw.append({"arm": arm, "layout": "2A1F", "repeat": rep, "status": "ran",
                        "error": None, "ranks": ranks})
    return raw, plan


def test_aggregate_latency_is_median_of_repeats_of_max_over_ranks():
    raw, plan = _synthetic()
    rows, comps = report.aggregate(raw, plan, ceiling_gbps=400.0)
    r = next(x for x in rows if x["arm"] == "afdep" and x["tokens"] == 1)
    assert r["repeats_us"] == [20.5, 21.5, 22.5]        # max over ranks 1, 2
    assert r["latency_us"] == 21.5                      # median over repeats
    assert abs(r["repeat_spread"] - 22.5 / 20.5) < 1e-12  # slowest / fastest repeat
    assert r["status"] == "ok" and r["errors"] == []
    c = next(x for x in comps if x["arm"] == "afdep" and x["baseline"] == "symmetric"
             and x["tokens"] == 1)
    want = (math.exp(sum(math.log((20.5 + i) / (30.5 + i)) for i in range(3)) / 3) - 1) * 100
    assert abs(c["change_pct"] - want) < 1e-9 and c["wins"] == "3/3"
    assert r["vs_symmetric_pct"] == c["change_pct"]
    assert "vs_nccl_pct" in r
    assert r["registered_bytes"] == {"ffn": 300, "attention": 100}
    assert r["union_bytes"] == 400
    # the kernel forms each role's launches ran (dispatch or receive, collect or reply)
    assert r["kernel_forms"] == {"ffn": ["kSmallRecv", "kSmallSend"],
                                 "attention": ["kSmallSend", "kEarlyCollect"]}


def test_floor_and_achieved_bandwidth_use_the_busiest_link():
    raw, plan = _synthetic()
    rows, _ = report.aggregate(raw, plan, ceiling_gbps=400.0)
    r = next(x for x in rows if x["arm"] == "afdep" and x["tokens"] == 2048)
    # FFN on GPU 0; Attention rank 1 on GPU 1 crosses the link, rank 2 shares GPU 0.
    assert r["link_bytes_dispatch"] == 2048 * 2 * 2048
    assert r["link_bytes_combine"] == 2048 * 2 * 2048
    assert abs(r["floor_us"] - 2 * 2048 * 4096 / 400e9 * 1e6) < 1e-6
    assert abs(r["achieved_GBps"] - 2 * 2048 * 4096 / (r["latency_us"] * 1e-6) / 1e9) < 1e-6
    assert report.dispatch_row_bytes(7168, "fp8") == 7168 + 4 * 56
    assert report.floor_us(0, 0, 400.0) is None and report.floor_us(10, 10, None) is None


def test_failed_and_skipped_repeats_are_recorded_not_fatal():
    raw, plan = _synthetic()
    # repeat 1 of the nccl arm: rank 2 failed on cell 0 and left no record of cell 1
    w = next(x for x in raw if x["arm"] == "nccl" and x["repeat"] == 1)
    w["ranks"][2]["cells"][0] = {"status": "failed", "error": "boom"}
    del w["ranks"][2]["cells"][1]
    w["error"] = "world timed out"
    for x in raw:
        if x["arm"] == "nccl_bare":
            x.update(status="skipped", error="NCCL needs one GPU per rank", ranks={})
    rows, comps = report.aggregate(raw, plan, ceiling_gbps=None)
    n0 = next(x for x in rows if x["arm"] == "nccl" and x["tokens"] == 1)
    assert n0["repeats_us"][1] is None and n0["status"] == "partial"
    assert n0["latency_us"] == stats.median([50.5, 52.5])
    assert any("boom" in e for e in n0["errors"])
    n1 = next(x for x in rows if x["arm"] == "nccl" and x["tokens"] == 2048)
    assert any("timed out" in e for e in n1["errors"])
    bare = next(x for x in rows if x["arm"] == "nccl_bare")
    assert bare["status"] == "skipped" and bare["latency_us"] is None
    c = next(x for x in comps if x["baseline"] == "nccl" and x["tokens"] == 1)
    assert c["pairs"] == 2
    assert "floor_us" in n0 and n0["floor_us"] is None


def _doc(tmp_path):
    raw, plan = _synthetic()
    args = vars(run.parse_args(["--layout", "2A2F"]))
    probe = {"peer_copy_GBps": {"0->1": 390.0, "1->0": 395.0},
             "peer_copy_ceiling_GBps": 395.0, "peer_copy_bytes": 2**30, "nccl_version": "2.28.9"}
    machine = {"name": "2 × NVIDIA H200", "gpus": ["NVIDIA H200"] * 2, "count": 2,
               "driver": "999.1"}
    return run.build_doc(raw, plan, probe, machine, args, datetime.datetime.now(),
                         time.monotonic(), ["a note"], {}, final=True, complete=True)


def test_json_schema_fields(tmp_path):
    doc = _doc(tmp_path)
    path = str(tmp_path / "x.json")
    common.write_json(path, doc)
    d = json.load(open(path))
    for k in ("machine", "commit", "env", "results", "comparisons", "registered", "probe",
              "args", "method", "notes", "worlds", "started", "finished"):
        assert k in d, k
    assert d["machine"]["count"] == 2 and d["machine"]["driver"] == "999.1"
    assert isinstance(d["commit"], str) and d["commit"]
    for k in ("torch", "cuda", "nccl", "vars", "child_vars", "arm_vars"):
        assert k in d["env"], k
    assert d["env"]["child_vars"]["NCCL_NVLS_ENABLE"] == "0"
    assert d["env"]["arm_vars"]["symmetric"] == {"AFDEP_SYMMETRIC": "1"}
    assert len(d["results"]) == 2 * 4
    for r in d["results"]:
        for k in ("arm", "layout", "hidden", "dtype", "routing", "tokens", "latency_us",
                  "repeats_us", "status"):
            assert k in r, k
        assert r["layout"] == "2A1F" and len(r["repeats_us"]) == 3
    reg = d["registered"]
    assert reg and reg[0]["ffn_vs_union"] == 0.75 and reg[0]["attention_vs_union"] == 0.25


def _synthetic_layouts(repeats=3):
    """1A1F (rank 0 = FFN, 1 = Attention), cells T=1 and T=2048 in both receive layouts
    (experts first, as make_plan orders them); nccl_bare ran the expert cells only. Token
    rows are 0.8x their expert row (T=1) and 0.5x (T=2048)."""
    cells = [{"receive_layout": rl, "hidden": 4096, "dtype": "fp8", "routing": "random",
              "tokens": t} for rl in ("experts", "tokens") for t in (1, 2048)]
    plan = {"cells": cells, "receive_layouts": ["experts", "tokens"],
            "layouts": [{"name": "1A1F", "attention": 1, "ffn": 1, "gpus": [0, 1]}],
            "arms": ["afdep", "symmetric", "nccl", "nccl_bare"], "repeats": repeats,
            "experts": 128, "top_k": 8, "capacity": 2048, "sms": 24}
    base = {"afdep": 20.0, "symmetric": 30.0, "nccl": 50.0, "nccl_bare": 10.0}
    raw = []
    for rep in range(repeats):
        for arm in plan["arms"]:
            ranks = {0: {"meta": {}, "cells": {}}, 1: {"meta": {}, "cells": {}}}
            for idx in report.arm_cells(arm, plan):
                c = cells[idx]
                lat = base[arm] * (1 if c["tokens"] == 1 else 10) + rep
                if c["receive_layout"] == "tokens":
                    lat *= 0.8 if c["tokens"] == 1 else 0.5
                ranks[0]["cells"][idx] = {"status": "ok"}
                ranks[1]["cells"][idx] = {"status": "ok", "median_us": lat,
                                          "reach_tokens": [c["tokens"]]}
            raw.append({"arm": arm, "layout": "1A1F", "repeat": rep, "status": "ran",
                        "error": None, "ranks": ranks})
    return raw, plan


def test_both_receive_layouts_are_aggregated_compared_and_written(tmp_path):
    raw, plan = _synthetic_layouts()
    args = vars(run.parse_args([]))
    probe = {"peer_copy_GBps": {"0->1": 400.0}, "peer_copy_ceiling_GBps": 400.0,
             "peer_copy_bytes": 2**30}
    doc = run.build_doc(raw, plan, probe, {"name": "1 × NVIDIA H200"}, args,
                        datetime.datetime.now(), time.monotonic(), [], {}, final=True,
                        complete=True)
    rows = doc["results"]
    assert all("receive_layout" in r for r in rows)
    got = sorted((r["arm"], r["receive_layout"]) for r in rows if r["tokens"] == 1)
    assert got == sorted([("afdep", "experts"), ("afdep", "tokens"), ("symmetric", "experts"),
                          ("symmetric", "tokens"), ("nccl", "experts"), ("nccl", "tokens"),
                          ("nccl_bare", "any")])  # nccl_bare once per cell
    tok = next(r for r in rows if r["arm"] == "afdep" and r["receive_layout"] == "tokens"
               and r["tokens"] == 2048)
    assert abs(tok["tokens_over_experts"] - 0.5) < 1e-12
    assert abs(tok["vs_experts_pct"] + 50.0) < 1e-9
    # same-layout comparisons pair arms of that layout only
    c = report.find_comparison(doc["comparisons"], "1A1F", 4096, "fp8", "random", 1, "afdep",
                               "tokens", "symmetric", "tokens")
    want = (math.exp(sum(math.log(0.8 * (20 + i) / (0.8 * (30 + i))) for i in range(3)) / 3)
            - 1) * 100
    assert abs(c["change_pct"] - want) < 1e-9 and c["wins"] == "3/3"
    # the issue's targets: token layout at T=1, tokens / experts at T=2048
    (tg,) = doc["targets"]
    assert tg["small_tokens"] == 1 and tg["tokens_small_us"] == 0.8 * 21
    assert tg["experts_small_us"] == 21 and tg["symmetric_tokens_small_us"] == 0.8 * 31
    assert tg["large_tokens"] == 2048 and abs(tg["tokens_over_experts_large"] - 0.5) < 1e-12
    assert tg["tokens_wins_large"] == "3/3"
    md = report.markdown(doc)
    assert "## Token layout: the targets (afdep arm, this run)" in md
    assert "| 1A1F | 4,096 | FP8 | random | T=1: 16.8 | " in md and "T=2,048: 0.500× | 3/3 |" in md
    for title in ("expert layout", "token layout"):
        assert f"## 1A1F, hidden 4,096, FP8, random routing, {title}" in md
    assert md.count("| nccl_bare (any layout), µs | 11.0 | 101.0 |") == 2
    assert "| afdep tokens vs experts | −20.0% (3/3) | −50.0% (3/3) |" in md
    tokens_table = md.split("token layout\n")[1]
    assert "| afdep, µs | 16.8 | 100.5 |" in tokens_table
    path = str(tmp_path / "x.png")
    msg = report.write_plot(path, doc)
    assert msg is None or "matplotlib" in msg


def test_flag_round_trip_completes_every_floor_of_its_layout(tmp_path):
    """The afdep worlds' measured flag round trip (first Attention rank's records, one per
    repeat) is added to the data floor of every arm's rows and named in the Markdown."""
    raw, plan = _synthetic()
    for w in raw:
        if w["arm"] == "afdep":
            for cell in w["ranks"][1]["cells"].values():
                cell["flag_rtt_us"] = 1.0 + w["repeat"]  # 1.0, 2.0, 3.0 -> median 2.0
    rows, _ = report.aggregate(raw, plan, ceiling_gbps=400.0)
    for r in rows:
        if r["arm"] == "afdep":
            assert r["flag_rtt_us"] == 2.0
        assert abs(r["floor_with_flag_us"] - (r["floor_us"] + 2.0)) < 1e-9, r["arm"]
    args = vars(run.parse_args(["--layout", "2A2F"]))
    probe = {"peer_copy_GBps": {"0->1": 390.0}, "peer_copy_ceiling_GBps": 390.0,
             "peer_copy_bytes": 2**30}
    doc = run.build_doc(raw, plan, probe, {"name": "m"}, args, datetime.datetime.now(),
                        time.monotonic(), [], {}, final=True, complete=True)
    md = report.markdown(doc)
    assert "plus the flag round trip" in md and "2A1F 2.00 µs" in md
    assert "| floor + flag round trip, µs |" in md
    # without a measurement the floor stays the data term and says so
    raw, plan = _synthetic()
    rows, _ = report.aggregate(raw, plan, ceiling_gbps=400.0)
    assert all("floor_with_flag_us" not in r for r in rows)


def test_repeat_spread_needs_two_measured_repeats():
    raw, plan = _synthetic(repeats=1)
    rows, _ = report.aggregate(raw, plan, ceiling_gbps=None)
    assert all(r["repeat_spread"] is None for r in rows)
    doc = {"results": rows, "comparisons": [], "args": {}, "machine": {}, "probe": {}}
    assert "repeat spread" not in report.markdown(doc)


def test_markdown_tables(tmp_path):
    doc = _doc(tmp_path)
    path = str(tmp_path / "x.md")
    report.write_markdown(path, doc)
    md = open(path).read()
    assert "## 2A1F, hidden 2,048, BF16, random routing, expert layout" in md
    assert "| | T=1 | T=2,048 |" in md
    for arm in ("afdep", "symmetric", "nccl"):
        assert f"| {arm}, µs |" in md
    assert "| nccl_bare (any layout), µs |" in md
    assert "| afdep vs symmetric |" in md and "| afdep vs nccl |" in md
    # T=1: afdep repeats 20.5..22.5, symmetric 30.5..32.5; T=2,048: 200.5..202.5, 300.5..302.5
    assert ("| repeat spread (slowest / fastest), afdep / symmetric | 1.10× / 1.07× | "
            "1.01× / 1.01× |") in md
    assert "(3/3)" in md and "−" in md  # afdep faster: a negative change, typeset
    assert "data floor" in md and "395.0 GB/s" in md
    assert "Registered buffer bytes" in md


def test_plot_is_optional(tmp_path):
    doc = _doc(tmp_path)
    path = str(tmp_path / "x.png")
    msg = report.write_plot(path, doc)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert msg and "matplotlib" in msg and not os.path.exists(path)
    else:
        assert msg is None and os.path.getsize(path) > 0


# ---- the shared core ----------------------------------------------------------------------
def test_machine_slug_names_results_files():
    assert common.machine_slug(["NVIDIA H200", "NVIDIA H200"]) == "h200x2"
    assert common.machine_slug(["NVIDIA H100 80GB HBM3"] * 4) == "h100x4"
    assert common.machine_slug([]) == "cpu"
    assert common.machine_name(["NVIDIA H200"] * 2) == "2 × NVIDIA H200"
    assert common.machine_name([]) is None


def test_commit_from_the_registry_then_git(monkeypatch):
    monkeypatch.setenv("AFDEP_COMMIT", "0fea946")
    assert common.git_commit() == "0fea946"
    monkeypatch.delenv("AFDEP_COMMIT")
    c = common.git_commit()
    assert c == "unknown" or len(c.split("-")[0]) == 40


def test_every_harness_writes_to_results_benchmarks_by_default():
    want = os.path.join(ROOT, "results", "benchmarks")
    assert common.DEFAULT_OUT_DIR == want
    assert run.parse_args([]).out_dir == want
    assert overlap.parse_args([]).out_dir == want
    assert soak.parse_args([]).out_dir == want


def test_output_folder_is_created_when_written(tmp_path):
    path = common.output_path(str(tmp_path / "a" / "b"), "stem", "json")
    assert path == str(tmp_path / "a" / "b" / "stem.json")
    common.write_json(path, {"x": float("nan"), "y": object})
    assert json.load(open(path))["y"] == str(object)


def test_failed_world_is_an_outcome_not_an_exception():
    ranks, err = common.spawn(_raise_on_rank_one, 2, timeout=120)
    assert ranks is None and "WorldError" in err and "rank 1 failed" in err
    ranks, err = common.spawn(_child_env, 1, timeout=120, env={"AFDEP_TRACE": "1"})
    assert err is None
    assert ranks[0] == dict(common.CHILD_ENV, AFDEP_TRACE="1")


def _raise_on_rank_one(rank, world):
    if rank == 1:
        raise RuntimeError("boom")
    return rank


def _child_env(rank, world):
    names = set(common.CHILD_ENV) | {"AFDEP_TRACE"}
    return {k: v for k, v in os.environ.items() if k in names}


def test_cell_inputs_are_the_references_and_the_same_for_every_arm():
    """Every arm of a repeat builds a cell's inputs from reference.make_inputs with the same
    seed: only the repeat, the cell and the Attention index change them."""
    s = arms.cell_seed(1234, 1, 3)
    assert s == arms.cell_seed(1234, 1, 3) != arms.cell_seed(1234, 2, 3)
    assert s != arms.cell_seed(1234, 1, 4)
    cfg = Config(capacity_tokens_per_rank=16, hidden_size=256, num_experts=16, top_k=4,
                 ffn_ranks=2, attention_ranks=1, dtype=torch.float8_e4m3fn)
    a, b = ref.make_inputs(cfg, 8, "skewed", s), ref.make_inputs(cfg, 8, "skewed", s)
    assert all(torch.equal(x.view(torch.uint8) if x.dtype == cfg.dtype else x, y.view(
        torch.uint8) if y.dtype == cfg.dtype else y) for x, y in zip(a, b))
    ids = a.expert_ids.clone()
    ids[0, 1] = ids[0, 0]   # a repeat makes no row
    ids[1, 2] = -1          # nor does -1
    want = (ref.dedupe(ids) >= 0).sum(dim=1)
    assert torch.equal(arms.served_rows(cfg, ids), want)
    assert int(want[0]) == cfg.top_k - 1


def test_no_contract_logic_left_in_benchmarks():
    """Block quantization and duplicate-id handling live in torch_afdep.reference only."""
    assert not hasattr(tx, "local_entries") and not hasattr(tx, "dequantize_rows")
    assert not hasattr(arms, "make_inputs") and not hasattr(arms, "check_output")
    for name in os.listdir(os.path.join(ROOT, "benchmarks")):
        if name.endswith(".py"):
            src = open(os.path.join(ROOT, "benchmarks", name)).read()
            assert "448" not in src and "amax" not in src, name


# ---- the nccl arm's exchange, against the reference ---------------------------------------
def _simulate(cfg, inputs, bucket):
    """Run the torch-op exchange of every rank in one process: pack on each Attention rank,
    'all_to_all' by slicing, expand + expert + reduce on each FFN rank, collect."""
    lay = tx.row_layout(cfg.hidden_size, cfg.dtype, cfg.top_k)
    sends = []
    for x, ids, w, sc in inputs:
        s = tx.new_send_buffer(lay, cfg.ffn_ranks, bucket, "cpu")
        tx.pack_dispatch(s, lay, x, ids, w, sc)
        sends.append(s)
    sources = torch.tensor(cfg.attention_group_ranks, dtype=torch.int32)
    replies, expanded = [], []
    for f in range(cfg.ffn_ranks):
        recv = torch.cat([s[f] for s in sends])              # [A*bucket, row_bytes]
        ex = tx.expand(tx.unpack(recv, lay), f, cfg.experts_per_rank, cfg.rows_per_token,
                       bucket, sources)
        expanded.append(ex)
        n = ex.x.shape[0]
        el = torch.searchsorted(ex.expert_offsets[1:].to(torch.int64), torch.arange(n),
                                right=True)
        e = (el + f * cfg.experts_per_rank).to(torch.float32)
        rows = (ref.dequantize(ex.x, ex.x_scales) * (1 + e / cfg.num_experts)[:, None]
                * ex.weights[:, None]).to(torch.bfloat16)     # the caller weights each row
        replies.append(tx.reduce_rows(rows, ex.row_token, cfg.attention_ranks * bucket)
                       .view(cfg.attention_ranks, bucket, cfg.hidden_size))
    outs = [tx.collect(torch.stack([r[a] for r in replies]), inputs[a][0].shape[0])
            for a in range(cfg.attention_ranks)]
    return outs, expanded


def _inputs(cfg, tokens, routing, seed):
    """One (x, ids, weights, x_scales) per Attention index from reference.make_inputs, with
    a repeated id and a token without experts; odd T sends int32 ids."""
    out = []
    for a, t in enumerate(tokens):
        x, ids, w, sc = ref.make_inputs(cfg, t, routing, seed, a,
                                        id_dtype=torch.int32 if t % 2 else torch.int64)
        if t > 3:
            ids[2, 3] = ids[2, 1]      # a repeated id counts once
            ids[3] = -1                # a token with no expert at all
        out.append((x, ids, w, sc))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("A,F,E,k,tokens,bucket,routing", [
    (1, 1, 128, 8, [16], 16, "random"),
    (1, 1, 128, 8, [5], 16, "skewed"),            # T < bucket: padding rows reach nobody
    (2, 2, 128, 8, [16, 7], 16, "partial"),
    (3, 1, 64, 8, [9, 0, 4], 9, "random"),        # a source with no tokens
    (1, 4, 16, 8, [12], 12, "random"),            # R = E_local = 4 < top_k
    (2, 3, 24, 6, [8, 8], 8, "skewed"),
])
def test_torch_exchange_matches_reference(dtype, A, F, E, k, tokens, bucket, routing):
    cfg = Config(capacity_tokens_per_rank=64, hidden_size=256, num_experts=E, top_k=k,
                 ffn_ranks=F, attention_ranks=A, dtype=dtype)
    inputs = _inputs(cfg, tokens, routing, A * 100 + F * 10 + k)
    outs, expanded = _simulate(cfg, inputs, bucket)
    counts = ref.expert_counts(cfg, [i[1] for i in inputs])
    for f, ex in enumerate(expanded):
        want = torch.cat([torch.zeros(1, dtype=torch.int64), counts[f].cumsum(0)])
        assert ex.expert_offsets.dtype == torch.int32
        assert torch.equal(ex.expert_offsets.to(torch.int64), want)
        assert ex.x.shape == (cfg.recv_rows(bucket), cfg.hidden_size)
        total = int(want[-1])
        # every row is (source, token, local expert) of the reference, with its weight
        lo = f * cfg.experts_per_rank
        el = torch.searchsorted(want[1:], torch.arange(total), right=True)
        got = sorted(zip(ex.src_rank[:total].tolist(), ex.src_token[:total].tolist(),
                         (el + lo).tolist(), ex.weights[:total].tolist()))
        exp = []
        for a, (x, ids, w, sc) in enumerate(inputs):
            d = ref.dedupe(ids)
            m = (d >= lo) & (d < lo + cfg.experts_per_rank)
            tt, jj = m.nonzero(as_tuple=True)
            exp += list(zip([cfg.attention_group_ranks[a]] * len(tt), tt.tolist(),
                            d[tt, jj].tolist(), w[tt, jj].tolist()))
        assert got == sorted(exp)
    for a, (x, ids, w, sc) in enumerate(inputs):
        want = ref.moe_output(cfg, x, ids, w, lambda e, r: r * (1 + e / cfg.num_experts), sc)
        assert outs[a].shape == (x.shape[0], cfg.hidden_size)
        assert outs[a].dtype == torch.bfloat16
        if x.shape[0]:
            assert ref.relative_error(outs[a], want) < 1.5e-2
            zero = ref.route_mask(cfg, ids) == 0
            assert bool((outs[a][zero] == 0).all())


def test_row_layout_alignment():
    for h, dt, k in ((2048, torch.bfloat16, 8), (7168, torch.float8_e4m3fn, 8),
                     (136, torch.bfloat16, 3)):
        lay = tx.row_layout(h, dt, k)
        assert lay.row_bytes % 16 == 0
        assert lay.scale_off % 4 == 0 and lay.ids_off % 4 == 0 and lay.w_off % 4 == 0
        assert lay.w_off + 4 * k <= lay.row_bytes
    with pytest.raises(TypeError):
        tx.row_layout(128, torch.float16, 8)
    assert tx.splits(("ffn", "attention", "attention"), "attention", 5) == [0, 5, 5]


def test_stand_in_expert_is_cheap_and_checkable():
    """The timed step's 'expert' copies the first EXPERT_COLS columns of each received row
    (any payload dtype) into a reply of ones made once; the other columns are untouched."""
    x = ref.to_payload(Config(capacity_tokens_per_rank=4, hidden_size=256, num_experts=4,
                              top_k=1, ffn_ranks=1, attention_ranks=1,
                              dtype=torch.float8_e4m3fn), torch.randn(3, 256))[0]
    reply = tx.new_reply(3, 256, "cpu")
    assert reply.dtype == torch.bfloat16 and bool((reply == 1).all())
    out = tx.stand_in_expert(reply, x)
    assert out is reply
    assert torch.equal(out[:, :tx.EXPERT_COLS], x[:, :tx.EXPERT_COLS].to(torch.bfloat16))
    assert bool((out[:, tx.EXPERT_COLS:] == 1).all())
    assert torch.equal(tx.stand_in_row(x), out.to(torch.float32))
    narrow = tx.stand_in_expert(tx.new_reply(2, 64, "cpu"), torch.randn(2, 64).bfloat16())
    assert narrow.shape == (2, 64)  # H < EXPERT_COLS: the whole row


@pytest.mark.parametrize("receive_layout", ["experts", "tokens"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_expected_output_of_the_benchmark_expert(receive_layout, dtype):
    """With the stand-in expert an exchange returns rows(t) * stand_in_row(x)[t], rows(t) =
    the token's expert rows (expert layout) or reached FFN ranks (token layout); the
    harness checks outputs against this, payload columns and the rest separately."""
    cfg = Config(capacity_tokens_per_rank=16, hidden_size=256, num_experts=16, top_k=4,
                 ffn_ranks=2, attention_ranks=1, dtype=dtype)
    (x, ids, w, sc), = _inputs(cfg, [8], "partial", 3)
    lay = tx.row_layout(cfg.hidden_size, cfg.dtype, cfg.top_k)
    rows = arms.reply_rows(cfg, ids, receive_layout)
    want = arms.expected_output(x, rows)
    send = tx.new_send_buffer(lay, cfg.ffn_ranks, 8, "cpu")
    tx.pack_dispatch(send, lay, x, ids, w, sc)
    sources = torch.tensor([2], dtype=torch.int32)
    replies = []
    for f in range(cfg.ffn_ranks):
        got = tx.unpack(send[f], lay)
        if receive_layout == "tokens":
            tv = tx.token_view(got, f, cfg.experts_per_rank, 8, sources)
            replies.append(tx.stand_in_expert(tx.new_reply(8, 256, "cpu"), tv.x))
        else:
            ex = tx.expand(got, f, cfg.experts_per_rank, cfg.rows_per_token, 8, sources)
            reply = tx.stand_in_expert(tx.new_reply(ex.x.shape[0], 256, "cpu"), ex.x)
            replies.append(tx.reduce_rows(reply, ex.row_token, 8))
    if receive_layout == "tokens":
        out = tx.collect_tokens(torch.stack(replies), ref.tokens_per_ffn(cfg, ids))
        assert torch.equal(rows, ref.tokens_per_ffn(cfg, ids).sum(dim=1))
    else:
        out = tx.collect(torch.stack(replies), 8)
        assert torch.equal(rows, arms.served_rows(cfg, ids))
    assert arms.output_error(out, want) < 5e-3  # one BF16 rounding
    assert bool((out[rows == 0] == 0).all())    # a token with no expert gets zeros
    bad = out.clone()
    bad[1, :4] = 0                              # a wrong payload in a few columns shows
    assert arms.output_error(bad, want) > 2e-2
    assert arms.output_error(out * 2, want) > 0.5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("A,F,E,k,tokens,bucket,routing", [
    (1, 1, 128, 8, [16], 16, "random"),
    (1, 1, 128, 8, [5], 16, "skewed"),            # T < bucket: padding rows hold no token
    (2, 2, 128, 8, [16, 7], 16, "partial"),
    (3, 1, 64, 8, [9, 0, 4], 9, "random"),        # a source with no tokens
    (1, 4, 16, 8, [12], 12, "random"),            # R = E_local = 4 < top_k
])
def test_token_view_is_the_token_contract(dtype, A, F, E, k, tokens, bucket, routing):
    """The nccl arm's token layout against the contract (docs/contract.md, "The token
    layout"): per FFN rank one row per token that reached it, local ids in the source's
    column order (-1 for other ranks, -1 ids and repeats; rows without a token all -1),
    weights 0 where the id is -1, src_rank/src_token (-1: no token), num_tokens; the reply
    is one row per token, and collect sums the reached FFN ranks' rows."""
    cfg = Config(capacity_tokens_per_rank=64, hidden_size=256, num_experts=E, top_k=k,
                 ffn_ranks=F, attention_ranks=A, dtype=dtype, receive_layout="tokens")
    inputs = _inputs(cfg, tokens, routing, A * 100 + F * 10 + k + 1)
    lay = tx.row_layout(cfg.hidden_size, cfg.dtype, cfg.top_k)
    sends = []
    for x, ids, w, sc in inputs:
        snd = tx.new_send_buffer(lay, F, bucket, "cpu")
        tx.pack_dispatch(snd, lay, x, ids, w, sc)
        sends.append(snd)
    sources = torch.tensor(cfg.attention_group_ranks, dtype=torch.int32)
    el = cfg.experts_per_rank
    replies = []
    for f in range(F):
        tv = tx.token_view(tx.unpack(torch.cat([snd[f] for snd in sends]), lay), f, el, bucket,
                           sources)
        n = A * bucket
        assert tv.x.shape == (n, cfg.hidden_size) and tv.x.dtype == dtype
        assert tv.expert_ids.shape == (n, k) and tv.expert_ids.dtype == torch.int32
        assert tv.weights.dtype == torch.float32 and tv.src_token.dtype == torch.int32
        assert (tv.x_scales is None) == (dtype == torch.bfloat16)
        held = 0
        for a, (x, ids, w, sc) in enumerate(inputs):
            t = x.shape[0]
            rows = slice(a * bucket, a * bucket + t)
            want_ids = ref.local_expert_ids(ids, f, el)
            hit = (want_ids >= 0).any(dim=1)
            assert torch.equal(tv.expert_ids[rows].to(torch.int64), want_ids)
            assert torch.equal(tv.weights[rows], torch.where(want_ids >= 0, w,
                                                             torch.zeros_like(w)))
            assert torch.equal(tv.x[rows].view(torch.uint8), x.view(torch.uint8))
            if sc is not None:
                assert torch.equal(tv.x_scales[rows], sc)
            tok = torch.arange(t, dtype=torch.int32)
            none = torch.full((t,), -1, dtype=torch.int32)
            assert torch.equal(tv.src_token[rows], torch.where(hit, tok, none))
            src = torch.full((t,), int(sources[a]), dtype=torch.int32)
            assert torch.equal(tv.src_rank[rows], torch.where(hit, src, none))
            pad = slice(a * bucket + t, (a + 1) * bucket)
            assert bool((tv.expert_ids[pad] == -1).all()) and bool((tv.src_token[pad] == -1)
                                                                   .all())
            assert int(tv.num_tokens[a]) == int(hit.sum())
            held += int(hit.sum())
        assert int(tv.num_tokens.sum()) == held
        # the caller's MoE output per token: sum over its local experts of weight * expert
        e = tv.expert_ids.to(torch.int64)
        scale = torch.where(e >= 0, tv.weights * (1 + (e + f * el) / E), torch.zeros_like(
            tv.weights)).sum(dim=1)
        reply = (ref.dequantize(tv.x, tv.x_scales) * scale[:, None]).to(torch.bfloat16)
        reply[tv.src_token < 0] = 7.0  # rows without a token: the collect ignores them
        replies.append(reply.view(A, bucket, cfg.hidden_size))
    for a, (x, ids, w, sc) in enumerate(inputs):
        out = tx.collect_tokens(torch.stack([r[a] for r in replies]),
                                ref.tokens_per_ffn(cfg, ids))
        want = ref.moe_output(cfg, x, ids, w, lambda e, r: r * (1 + e / E), sc)
        assert out.shape == (x.shape[0], cfg.hidden_size) and out.dtype == torch.bfloat16
        if x.shape[0]:
            assert ref.relative_error(out, want) < 1.5e-2
            assert bool((out[ref.route_mask(cfg, ids) == 0] == 0).all())


# ---- the command --------------------------------------------------------------------------
def _run_cli(*argv, env=None, timeout=300):
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "benchmarks.run", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=e)


def test_help_works():
    p = _run_cli("--help", timeout=120)
    assert p.returncode == 0, p.stderr
    assert "--layout" in p.stdout and "--quick" in p.stdout and "--arms" in p.stdout


def test_dry_run_plans_without_a_gpu():
    p = _run_cli("--dry-run", "--gpus", "2", "--layout", "1A1F", "2A2F", timeout=120)
    assert p.returncode == 0, p.stderr
    assert "1A1F: 2 ranks on GPUs [0, 1]" in p.stdout
    assert "skipped (NCCL needs one GPU per rank" in p.stdout
    assert "estimated wall time" in p.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_no_gpu_is_a_clear_error():
    p = _run_cli("--quick", timeout=120)
    assert p.returncode == 2
    assert "no CUDA GPU" in p.stderr


@pytest.mark.slow
def test_cpu_smoke_end_to_end(tmp_path):
    """The whole harness on the CPU over gloo, both receive layouts (the default), BF16 and
    FP8: spawned worlds, per-rank records, failure recording (an injected set-up failure in
    the nccl arm's second cell), nccl_bare once per cell, JSON/Markdown."""
    p = _run_cli("--cpu-smoke", "--quick", "--tokens", "1", "8", "--repeats", "1",
                 "--replays", "2", "--warmup", "1", "--arms", "afdep", "nccl", "nccl_bare",
                 "--dtype", "bf16", "fp8", "--hidden", "256", "--kernel-timeout", "10",
                 "--out-dir", str(tmp_path), "--name", "smoke", "--no-plot",
                 env={"AFDEP_BENCH_INJECT": "nccl,1,0,setup", "AFDEP_SYMMETRIC": "1"},
                 timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.load(open(tmp_path / "smoke.json"))
    assert os.path.exists(tmp_path / "smoke.md")
    assert d["env"]["stripped_from_parent"] == {"AFDEP_SYMMETRIC": "1"}
    assert d["plan"]["receive_layouts"] == ["experts", "tokens"]
    rows = {(r["arm"], r["receive_layout"], r["dtype"], r["tokens"]): r for r in d["results"]}
    assert len(rows) == len(d["results"]) == 2 * 2 * 2 * 2 + 2 * 2
    assert {k[1] for k in rows if k[0] == "nccl_bare"} == {"any"}
    for key, r in rows.items():
        if key == ("nccl", "experts", "bf16", 8):
            assert r["status"] == "failed" and "injected failure" in " ".join(r["errors"])
            continue
        assert r["status"] == "ok", r
        assert r["latency_us"] > 0 and len(r["repeats_us"]) == 1
        if key[0] != "nccl_bare":
            assert r["max_eager_rel_err"] < 1e-2 and r["max_graph_rel_err"] < 1e-2, key
    comps = d["comparisons"]
    assert [c for c in comps if c["baseline"] == "nccl" and c["tokens"] == 1
            and c["receive_layout"] == "tokens"]
    assert [c for c in comps if c["arm"] == "afdep" and c["baseline_layout"] == "experts"
            and c["receive_layout"] == "tokens"]
    assert {w["arm"] for w in d["worlds"]} == {"afdep", "nccl", "nccl_bare"}
    assert {t["dtype"] for t in d["targets"]} == {"bf16", "fp8"}
    md = open(tmp_path / "smoke.md").read()
    assert "token layout" in md and "expert layout" in md


@pytest.mark.slow
def test_stalled_world_is_ended_and_recorded(tmp_path):
    """A rank that stops making progress: the parent ends that world's processes after
    --stall-timeout, records the failure and goes on with the next world."""
    p = _run_cli("--cpu-smoke", "--quick", "--tokens", "1", "8", "--repeats", "1",
                 "--replays", "2", "--warmup", "1", "--arms", "nccl", "nccl_bare",
                 "--hidden", "256", "--stall-timeout", "6", "--out-dir", str(tmp_path),
                 "--name", "stall", "--receive-layouts", "experts", "--no-plot",
                 env={"AFDEP_BENCH_INJECT": "nccl,1,1,hang"}, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.load(open(tmp_path / "stall.json"))
    rows = {(r["arm"], r["tokens"]): r for r in d["results"]}
    assert rows[("nccl", 1)]["status"] == "ok"
    assert rows[("nccl", 8)]["status"] == "failed"
    assert any("no progress" in e for e in rows[("nccl", 8)]["errors"])
    assert rows[("nccl_bare", 1)]["status"] == "ok" and rows[("nccl_bare", 8)]["status"] == "ok"
    w = next(w for w in d["worlds"] if w["arm"] == "nccl")
    assert w["status"] == "failed" and "no progress" in w["error"]


@pytest.mark.slow
def test_cpu_smoke_zero_copy(tmp_path):
    """--zero-copy: the afdep arm collects with a view of the receive buffer (one FFN rank)
    and its results still check against the reference in eager steps and graph replays, in
    both receive layouts."""
    p = _run_cli("--cpu-smoke", "--quick", "--tokens", "1", "8", "--repeats", "1",
                 "--replays", "2", "--warmup", "1", "--arms", "afdep", "--zero-copy",
                 "--hidden", "256", "--kernel-timeout", "10", "--out-dir", str(tmp_path),
                 "--name", "zc", "--no-plot", timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.load(open(tmp_path / "zc.json"))
    assert d["args"]["zero_copy"] is True and d["args"]["layout"] == ["1A1F"]
    md = open(tmp_path / "zc.md").read()
    assert "- afdep arms: transport ipc, zero-copy collect where one FFN rank" in md
    assert {r["receive_layout"] for r in d["results"]} == {"experts", "tokens"}
    for r in d["results"]:
        assert r["status"] == "ok", r
        assert r["max_eager_rel_err"] < 1e-2 and r["max_graph_rel_err"] < 1e-2


def test_cpu_smoke_afdep_env_reaches_the_afdep_arm_only(tmp_path):
    """--afdep-env sets a control in the afdep arm's processes (recorded per world from the
    children's own parse of the environment); the symmetric arm stays fully reverted."""
    p = _run_cli("--cpu-smoke", "--quick", "--tokens", "1", "--repeats", "1", "--replays", "2",
                 "--warmup", "1", "--arms", "afdep", "symmetric", "--hidden", "256",
                 "--afdep-env", "AFDEP_RAW_META=1", "--kernel-timeout", "10",
                 "--out-dir", str(tmp_path), "--name", "ab", "--receive-layouts", "experts",
                 "--no-plot", timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.load(open(tmp_path / "ab.json"))
    assert d["args"]["afdep_env"] == ["AFDEP_RAW_META=1"]
    flags = {w["arm"]: w["afdep_flags"] for w in d["worlds"]}
    assert flags == {"afdep": env.DEFAULT_FLAGS | env.CONTROLS["AFDEP_RAW_META"].bit,
                     "symmetric": 0}
    md = open(tmp_path / "ab.md").read()
    assert "- afdep arms: transport ipc, afdep arm with AFDEP_RAW_META=1" in md


def test_cpu_smoke_alt_arm_is_the_afdep_arm_with_one_change(tmp_path):
    """--arms afdep afdep_alt --alt-env X=1: the afdep_alt worlds run the afdep arm's flags plus
    X (on top of --afdep-env), interleaved with it in one run, and the results carry a paired
    'afdep_alt vs afdep' comparison in every cell."""
    p = _run_cli("--cpu-smoke", "--quick", "--tokens", "1", "--repeats", "2", "--replays", "2",
                 "--warmup", "1", "--arms", "afdep", "afdep_alt", "--hidden", "256",
                 "--afdep-env", "AFDEP_PDL=0", "--alt-env", "AFDEP_RAW_META=1",
                 "--kernel-timeout", "10", "--out-dir", str(tmp_path), "--name", "alt",
                 "--receive-layouts", "tokens", "--no-plot", timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.load(open(tmp_path / "alt.json"))
    assert d["args"]["alt_env"] == ["AFDEP_RAW_META=1"]
    base = env.DEFAULT_FLAGS & ~env.CONTROLS["AFDEP_PDL"].bit
    flags = {(w["arm"], w["repeat"]): w["afdep_flags"] for w in d["worlds"]}
    assert flags == {("afdep", 0): base, ("afdep", 1): base,
                     ("afdep_alt", 0): base | env.CONTROLS["AFDEP_RAW_META"].bit,
                     ("afdep_alt", 1): base | env.CONTROLS["AFDEP_RAW_META"].bit}
    order = [w["arm"] for w in d["worlds"]]
    assert order[:2] != order[2:], order  # the arm order rotates over the repeats
    rows = {r["arm"]: r for r in d["results"]}
    assert set(rows) == {"afdep", "afdep_alt"}
    assert all(r["status"] == "ok" for r in rows.values()), rows
    comps = [c for c in d["comparisons"] if (c["arm"], c["baseline"]) == ("afdep_alt", "afdep")]
    assert len(comps) == 1 and comps[0]["pairs"] == 2, comps
    md = open(tmp_path / "alt.md").read()
    assert "afdep_alt arm: the afdep arm with AFDEP_RAW_META=1" in md
    assert "| afdep_alt vs afdep |" in md


def test_lockstep_cpu_runs_every_step_and_checks_outputs(tmp_path):
    """benchmarks.lockstep on CPU (gloo): the four steps timed on their ranks, every
    Attention output checked against the stand-in expert's exact result, pids recorded."""
    from benchmarks import lockstep

    out = tmp_path / "ls.json"
    for layout in ("tokens", "experts"):
        assert lockstep.main(["--device", "cpu", "--exchanges", "3", "--tokens", "5",
                              "--hidden", "256", "--receive-layout", layout,
                              "--out", str(out)]) == 0
        doc = json.loads(out.read_text())
        ranks = {r["role"]: r for r in doc["ranks"]}
        assert sorted(ranks["attention"]["times_us"]) == ["collect", "dispatch"]
        assert sorted(ranks["ffn"]["times_us"]) == ["receive", "reply"]
        assert all(len(v) == 3 for r in ranks.values() for v in r["times_us"].values())
        assert len(ranks["attention"]["errors"]) == 3
        assert max(ranks["attention"]["errors"]) < 1e-6
        assert ranks["attention"]["pid"] != ranks["ffn"]["pid"]
