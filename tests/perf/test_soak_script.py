"""CPU tests of benchmarks/soak.py: its arguments, the check model (exact prediction and the
fp32-reference tolerance) against known answers, and the whole script end to end in
--cpu-smoke mode (two spawned gloo ranks, eager exchanges through torch_afdep.Buffer, JSON
written), including an injected fault that the checks must catch. The GPU run itself
(CUDA graphs, 100,000 replays) is not exercised here.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from benchmarks import soak
from benchmarks.common import ROOT


def test_defaults_and_smoke_defaults():
    a = soak.parse_args([])
    assert (a.replays, a.check_every, a.tokens, a.hidden) == (100_000, 100, 128, 4096)
    assert a.replays // a.check_every >= 1000  # at least 1,000 checked replays by default
    s = soak.parse_args(["--cpu-smoke"])
    assert s.cpu_smoke and s.replays < 100 and s.check_every == 1
    assert soak.parse_args(["--replays", "7", "--check-every", "3"]).replays == 7


@pytest.mark.parametrize("argv", [["--replays", "0"], ["--check-every", "0"],
                                  ["--top-k", "9", "--experts", "8"], ["--hidden", "100"],
                                  ["--drop", "1.0"]])
def test_bad_arguments_rejected(argv):
    with pytest.raises(SystemExit):
        soak.parse_args(argv)


def _inputs(T=64, H=256, E=16, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    ids = ids.masked_fill(torch.rand(T, k, generator=g) < 0.3, -1)
    ids[0] = -1  # a token without experts
    w = torch.rand(T, k, generator=g) * 1.0 + 0.1
    return x, ids, w, E


def _slow_exact(x, ids, w, E):
    """The exact model written as loops (fp32 sums of bf16 rows, one bf16 rounding)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= 0:
                s = torch.tensor(1.0, dtype=torch.float32) + torch.tensor(
                    float(e), dtype=torch.float32) / E
                out[t] += ((x[t].float() * s) * w[t, j]).to(torch.bfloat16).float()
    return out.to(torch.bfloat16)


def test_check_model_exact_and_within_tolerance():
    x, ids, w, E = _inputs()
    want = soak.exact_output(x, ids, w, E)
    assert torch.equal(want, _slow_exact(x, ids, w, E))
    assert bool((want[0] == 0).all())
    mism, err = soak.check_replay(want, x, ids, w, E)
    assert int(mism) == 0 and float(err) < soak.REL_TOL
    # the fp64 truth (the same formula in float64) is within the same elementwise bound
    valid = ids >= 0
    coef = torch.where(valid, (1.0 + ids.clamp(min=0).double() / E) * w.double(), 0.0)
    ref64 = (coef[:, :, None] * x.double()[:, None, :]).sum(dim=1)
    nz = ref64 != 0
    rel = ((want.double() - ref64).abs()[nz] / ref64.abs()[nz]).max()
    assert float(rel) < soak.REL_TOL and bool((want.double()[~nz] == 0).all())


def test_check_catches_corruption():
    x, ids, w, E = _inputs(seed=1)
    good = soak.exact_output(x, ids, w, E)
    for corrupt in ("nan", "scale", "zero_row", "nonzero_empty"):
        out = good.clone()
        if corrupt == "nan":
            out[3, 5] = float("nan")
        elif corrupt == "scale":
            out[7] = (out[7].float() * 1.02).to(torch.bfloat16)
        elif corrupt == "zero_row":
            out[int((ids >= 0).any(1).nonzero()[0])] = 0
        else:
            out[0, 0] = 1e-3  # token 0 has no expert: must stay exactly zero
        mism, err = soak.check_replay(out, x, ids, w, E)
        assert int(mism) > 0, corrupt
        assert not float(err) < soak.REL_TOL, corrupt


def _run(tmp_path, *extra):
    cmd = [sys.executable, "-m", "benchmarks.soak", "--cpu-smoke", "--replays", "10",
           "--out-dir", str(tmp_path), *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return p


def test_cpu_smoke_end_to_end(tmp_path):
    p = _run(tmp_path, "--name", "smoke")
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.load(open(tmp_path / "smoke.json"))
    for key in ("machine", "commit", "config", "replays", "checks", "errors", "max_err",
                "replays_per_s", "wall_s"):
        assert key in doc, key
    assert doc["ok"] and doc["errors"] == [] and doc["mode"] == "cpu-smoke"
    assert doc["replays"] == 10 and doc["checks"] == 11  # warm-up + every replay
    assert doc["mismatches"] == 0 and 0 < doc["max_err"] < soak.REL_TOL
    assert doc["replays_per_s"] > 0 and doc["wall_s"] > 0
    assert doc["config"]["hidden_size"] == 256 and doc["config"]["layout"] == "1A1F"
    assert {r["role"] for r in doc["per_rank"]} == {"ffn", "attention"}
    assert "OK" in p.stdout


def test_cpu_smoke_injected_fault_fails(tmp_path):
    p = _run(tmp_path, "--name", "fault", "--inject-fault", "4")
    assert p.returncode == 1, p.stdout + p.stderr
    doc = json.load(open(tmp_path / "fault.json"))
    assert not doc["ok"] and doc["mismatches"] > 0
    assert any("checked replays failed" in e for e in doc["errors"]), doc["errors"]
    assert doc["config"]["inject_fault"] == 4
