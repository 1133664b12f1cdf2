"""The main job runs end to end (CPU here) and reports a passing check."""

import pytest

from torch_afdep import demo


def test_demo_1a1f(capsys):
    assert demo.main(["--layout", "1A1F", "--steps", "2", "--tokens", "5", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "1A1F on cpu" in out and "PASS" in out
    assert "attention 0: max rel. error" in out


def test_demo_rejects_bad_layout():
    with pytest.raises(SystemExit):
        demo.main(["--layout", "2X2F"])
    with pytest.raises(SystemExit):
        demo.main(["--layout", "1A3F"])  # 8 experts do not split over 3 FFN ranks


def test_swiglu_reference_matches_manual():
    import torch

    w1, w3, w2 = demo._expert_weights(3)
    x = torch.randn(4, demo.HIDDEN, dtype=torch.float64)
    manual = (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T
    assert torch.allclose(demo.swiglu(x, w1, w3, w2), manual)
    ids, w = demo.route(x.float())
    assert ids.shape == (4, demo.TOP_K) and torch.allclose(w.sum(1), torch.ones(4))
