"""The main job runs end to end (CPU here) and reports a passing check, in both receive
layouts; layouts and roles are parsed by torch_afdep.config; bad ones and GPUs shared without
MPS end in argparse errors."""

import os
import subprocess
import sys

import pytest
import torch

from torch_afdep import demo
from torch_afdep.tools import cli


def test_demo_1a1f_roles_af(capsys):
    """--roles AF (Attention first, not the default order) runs and passes."""
    assert demo.main(["--roles", "AF", "--steps", "2", "--tokens", "5", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "1A1F (roles AF) on cpu" in out and "PASS" in out
    assert "attention 0: max rel. error" in out


def test_demo_token_layout_2a2f(capsys):
    """--receive-layout tokens: checked against the fp64 reference (PASS), and each FFN rank
    reports exactly the tokens that reach it, counted here from the demo's own routing."""
    steps, tokens = 2, 5
    assert demo.main(["--layout", "2A2F", "--receive-layout", "tokens", "--steps", str(steps),
                      "--tokens", str(tokens), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "tokens receive layout" in out and "PASS" in out
    el = demo.EXPERTS // 2
    for f in range(2):
        want = []
        for step in range(steps):
            n = 0
            for a in range(2):
                ids, _ = demo.route(demo._tokens(a, step, tokens))
                n += int(((ids // el) == f).any(dim=1).sum())
            want.append(n)
        assert f"  ffn {f}: tokens per step {want}" in out, (want, out)
    errors = [float(line.split("max rel. error ")[1].split(",")[0])
              for line in out.splitlines() if line.startswith("  attention")]
    assert len(errors) == 2 and all(e < 2e-2 for e in errors), out


def test_demo_rejects_an_unknown_receive_layout(capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(["--receive-layout", "rows", "--device", "cpu"])
    assert e.value.code == 2
    assert "argument --receive-layout: invalid choice: 'rows'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, fragment", [
    (["--layout", "2X2F"], "argument --layout: layout must look like '2A2F'"),
    (["--layout", "0A1F"], "argument --layout: layout must look like '2A2F'"),
    (["--layout", "1A3F"], "cannot run layout 1A3F with these arguments: num_experts (8) "
                           "must be divisible by ffn_ranks (3)"),
    (["--roles", "FFXA"], "argument --roles: roles entries must be"),
    (["--roles", "FFAA", "--layout", "1A3F"], "--layout 1A3F and --roles FFAA (2A2F) disagree"),
    (["--roles", "FF"], "needs at least one Attention and one FFN rank"),
])
def test_demo_rejects_bad_layout(argv, fragment, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(argv + ["--device", "cpu"])
    assert e.value.code == 2
    assert fragment in capsys.readouterr().err


def _fake_one_gpu(monkeypatch, pipe_dir):
    """A one-GPU CUDA machine as far as the demo's checks can tell, and a spawn that records
    where the ranks would go instead of starting them."""
    monkeypatch.setattr(cli, "cuda_ready", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(pipe_dir))
    calls = []

    def spawn(fn, world, cfg, steps, tokens, kind, **kwargs):
        calls.append(kwargs["device_ids"])
        return [{"role": "ffn", "index": 0, "rows": [3]},
                {"role": "attention", "index": 0, "times": [1e-3], "errors": [0.0]}]

    monkeypatch.setattr(demo, "spawn_world", spawn)
    return calls


def test_demo_refuses_a_shared_gpu_without_mps(monkeypatch, tmp_path, capsys):
    calls = _fake_one_gpu(monkeypatch, tmp_path)
    with pytest.raises(SystemExit) as e:
        demo.main(["--layout", "1A1F", "--device", "cuda"])
    assert e.value.code == 2 and calls == []  # refused before spawning anything
    err = capsys.readouterr().err
    assert "2 ranks would share one GPU but CUDA MPS is not running" in err
    assert "nvidia-cuda-mps-control -d" in err and "--allow-shared-gpu" in err
    # --allow-shared-gpu: a warning, then the run
    assert demo.main(["--layout", "1A1F", "--device", "cuda", "--allow-shared-gpu"]) == 0
    assert calls == [[0, 0]]
    assert "warning: 2 ranks would share one GPU" in capsys.readouterr().err
    # MPS running (its control pipe exists): no refusal, no warning
    os.mkfifo(tmp_path / "control")
    assert demo.main(["--layout", "1A1F", "--device", "cuda"]) == 0
    assert calls[-1] == [0, 0] and "MPS" not in capsys.readouterr().err


def test_alias_modules():
    import torch_afdep.demo
    import torch_afdep.tools.demo

    assert torch_afdep.demo is torch_afdep.tools.demo is demo
    p = subprocess.run([sys.executable, "-m", "torch_afdep.demo", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "--allow-shared-gpu" in p.stdout and "--roles" in p.stdout
    assert "--receive-layout" in p.stdout


def test_swiglu_reference_matches_manual():
    w1, w3, w2 = demo._expert_weights(3)
    x = torch.randn(4, demo.HIDDEN, dtype=torch.float64)
    manual = (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T
    assert torch.allclose(demo.swiglu(x, w1, w3, w2), manual)
    ids, w = demo.route(x.float())
    assert ids.shape == (4, demo.TOP_K) and torch.allclose(w.sum(1), torch.ones(4))
