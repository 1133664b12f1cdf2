"""CPU tests of benchmarks/overlap.py: arguments, the synthetic experts against their fp32
reference, the summary, and the whole script end to end in --cpu-smoke mode (two gloo ranks,
eager steps; the GPU measurement itself is not here)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from benchmarks import overlap
from torch_afdep import reference as ref


def test_defaults_match_the_issue():
    a = overlap.parse_args([])
    assert a.tokens == [128, 512] and (a.hidden, a.experts, a.top_k) == (4096, 128, 8)
    assert a.replays >= 200 and a.rounds >= 1 and a.attention_matmuls == "auto"
    q = overlap.parse_args(["--quick"])
    assert q.tokens == [128] and q.replays >= 200 and q.rounds == 1
    c = overlap.parse_args(["--cpu-smoke"])
    assert c.hidden < 4096 and isinstance(c.attention_matmuls, int)
    assert c.attention_delay_us == 0 and c.queue_ahead_us == 0
    assert overlap.parse_args(["--tokens", "64", "--attention-matmuls", "3"]).attention_matmuls == 3


@pytest.mark.parametrize("argv", [["--attention-matmuls", "x"], ["--attention-matmuls", "0"],
                                  ["--tokens", "0"],
                                  ["--top-k", "200"], ["--expert-method", "loop"]])
def test_bad_arguments(argv):
    with pytest.raises(SystemExit):
        overlap.parse_args(argv)


def test_expert_weights_are_reproducible_and_per_expert():
    spec = {"hidden": 64, "intermediate": 16, "experts": 8, "seed": 3}
    a13, a2 = overlap.expert_weights(spec, 0, 8, "cpu")
    b13, b2 = overlap.expert_weights(spec, 2, 3, "cpu")  # a slice of experts, rebuilt alone
    assert torch.equal(a13[2:5], b13) and torch.equal(a2[2:5], b2)
    assert not torch.equal(a13[0], a13[1])
    assert a13.dtype == torch.bfloat16 and a13.shape == (8, 32, 64) and a2.shape == (8, 64, 16)


def test_reference_matches_swiglu_experts_on_received_rows():
    """The check's fp32 reference and the FFN rank's SwiGLUExperts agree on the same rows
    laid out expert-major (so a GPU mismatch would mean a wrong exchange, not a wrong check)."""
    from torch_afdep.nn import SwiGLUExperts

    spec = {"hidden": 64, "intermediate": 16, "experts": 8, "seed": 5}
    w13, w2 = overlap.expert_weights(spec, 0, 8, "cpu")
    ex = SwiGLUExperts(8, 64, 16, dtype=torch.bfloat16, method="loop")
    with torch.no_grad():
        ex.w13.copy_(w13)
        ex.w2.copy_(w2)
    g = torch.Generator().manual_seed(0)
    T, k = 6, 3
    x = torch.randn(T, 64, generator=g).bfloat16()
    ids = torch.rand(T, 8, generator=g).topk(k, dim=1).indices
    w = torch.rand(T, k, generator=g) + 0.1
    want = overlap.expert_reference(x, ids, w, w13, w2)
    # expert-major rows, as worker_receive lays them out, plus two padding rows
    order = sorted((int(ids[t, j]), t, j) for t in range(T) for j in range(k))
    rows_x = torch.stack([x[t] for _, t, _ in order] + [x[0], x[0]])
    rows_w = torch.tensor([float(w[t, j]) for _, t, j in order] + [0.0, 0.0])
    counts = torch.bincount(torch.tensor([e for e, _, _ in order]), minlength=8)
    offs = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    rows = ex(rows_x, rows_w, offs)
    got = torch.zeros(T, 64)
    for i, (_, t, _) in enumerate(order):
        got[t] += rows[i].float()
    assert ref.relative_error(got, want) < 2e-2
    assert ref.relative_error(got * 1.1, want) > 5e-2  # the check sees a wrong output
    assert ref.relative_error(torch.full_like(got, float("nan")), want) == float("inf")


def test_summary_overlap_fraction():
    att = {"tokens": 128, "attention_matmuls": 4, "checks": {
        "exchange": [0.0], "pipelined": [1e-3, 2e-3], "serialized": [1e-3]},
        "samples": {"exchange": [[100.0] * 5, [110.0] * 5], "attention": [[100.0] * 5],
                    "pipelined": [[240.0, 250.0, 260.0]], "serialized": [[400.0]]}}
    ffn = {"tokens": 128, "samples": {"experts": [[100.0, 100.0, 100.0]]}}
    s = overlap.summarize(att, ffn, 2e-2)
    assert s["exchange_us"] == 105.0  # median of the round medians
    assert s["sum_of_parts_us"] == 305.0 and s["step_us"] == 250.0
    assert s["overlap_fraction"] == pytest.approx(1 - 250 / 305)
    assert s["step_vs_serialized"] == pytest.approx(250 / 400 - 1)
    assert s["correct"] and s["parts"]["experts"]["timed_on"] == "ffn"
    att["checks"]["pipelined"].append(0.5)
    assert not overlap.summarize(att, ffn, 2e-2)["correct"]


def test_cpu_smoke_end_to_end(tmp_path, capsys):
    rc = overlap.main(["--cpu-smoke", "--out-dir", str(tmp_path), "--name", "smoke",
                       "--checks", "2"])
    assert rc == 0
    doc = json.loads((tmp_path / "smoke.json").read_text())
    md = (tmp_path / "smoke.md").read_text()
    assert "pipelined step" in md and "CPU smoke" in md
    assert doc["config"]["cpu_smoke"] and doc["config"]["num_slots"] == 2
    assert doc["commit"] and doc["machine"]["description"] == "CPU (gloo)"
    (r,) = doc["results"]
    assert r["tokens"] == 8 and r["correct"]
    for part in overlap.PARTS:
        p = r["parts"][part]
        assert p["n"] == 3 and len(p["samples_us"]) == 1 and p["median_us"] > 0
    assert r["sum_of_parts_us"] == pytest.approx(
        r["exchange_us"] + r["attention_us"] + r["experts_us"])
    assert r["overlap_fraction"] == pytest.approx(1 - r["step_us"] / r["sum_of_parts_us"])
    for kind in overlap.CHECKED:  # the eager run + 2 replays, each within tolerance
        errs = r["checks"]["rel_err"][kind]
        assert len(errs) == 3 and max(errs) < 2e-2
    assert os.path.basename(str(tmp_path / "smoke.json")) in capsys.readouterr().out
