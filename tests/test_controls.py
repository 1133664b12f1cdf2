"""The protocol controls registry (torch_afdep/controls.py) and its agreement with the C++ flags."""

from __future__ import annotations

import glob
import os
import warnings

import pytest

from torch_afdep import controls, env


def test_defaults_are_role_aware_and_symmetric_reverts_all():
    experimental = [n for n, c in controls.CONTROLS.items() if not c.default]
    # experimental, off by default until an A/B shows them faster with no slow processes
    assert experimental == ["AFDEP_FANOUT_EXPAND", "AFDEP_RAW_META"]
    assert controls.flags({}) == controls.DEFAULT
    assert controls.DEFAULT == controls.ALL_ROLE_AWARE & ~sum(
        controls.CONTROLS[n].bit for n in experimental)
    assert controls.flags({"AFDEP_SYMMETRIC": "1"}) == 0
    assert controls.flags({"AFDEP_SYMMETRIC": "1", "AFDEP_LL_EXPERTS": "1",
                           "AFDEP_EARLY_COLLECT": "1", "AFDEP_SPREAD_CHUNKS": "1",
                           "AFDEP_RAW_META": "1"}) == 0
    assert controls.flags({"AFDEP_SYMMETRIC": "0"}) == controls.DEFAULT
    assert controls.flags({n: "1" for n in experimental}) == controls.ALL_ROLE_AWARE
    bits = [c.bit for c in controls.CONTROLS.values()]
    assert len(set(bits)) == len(bits) and sum(bits) == controls.ALL_ROLE_AWARE


@pytest.mark.parametrize("name", sorted(controls.CONTROLS))
def test_each_control_sets_only_its_bit(name):
    bit = controls.CONTROLS[name].bit
    off = controls.flags({name: "0"})
    on = controls.flags({name: "1"})
    assert off == controls.DEFAULT & ~bit and on == controls.DEFAULT | bit
    assert controls.describe(off)[name] == 0 and controls.describe(on)[name] == 1


def test_bad_value_names_the_variable():
    with pytest.raises(ValueError, match="AFDEP_WIDE_LOCAL must be 0 or 1"):
        controls.flags({"AFDEP_WIDE_LOCAL": "maybe"})


def test_bits_match_the_cuda_extension():
    """env.CONTROLS and the kernels' ControlFlags (csrc/include/afdep/layout.h, exported as
    _cuda.CONTROL_BITS) name the same bits; CI builds _cuda."""
    cuda = pytest.importorskip("torch_afdep._cuda")
    python_bits = {name: s.bit for name, s in env.CONTROLS.items()}
    cpp_bits = {"AFDEP_" + name: bit for name, bit in cuda.CONTROL_BITS.items()}
    assert python_bits == cpp_bits
    assert cuda.ALL_ROLE_AWARE == env.ALL_ROLE_AWARE
    for name, bit in cuda.CONTROL_BITS.items():  # the per-bit attributes older code reads
        assert getattr(cuda, name) == bit


def test_retired_controls_are_not_registered_nor_read_and_history_says_why():
    assert env.RETIRED and not set(env.RETIRED) & set(env.SETTINGS)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readers = []
    for folder in ("torch_afdep", "csrc", "benchmarks", "examples", "scripts"):
        for path in glob.glob(os.path.join(root, folder, "**", "*.*"), recursive=True):
            if path.endswith((".py", ".cu", ".cuh", ".h", ".cpp", ".sh")) and \
                    not path.endswith(os.path.join("torch_afdep", "env.py")):
                text = open(path, encoding="utf-8").read()
                readers += [f"{path}: {n}" for n in env.RETIRED if n in text]
    assert not readers, f"retired controls still named in code: {readers}"
    with open(os.path.join(root, "docs", "history.md"), encoding="utf-8") as f:
        history = f.read()
    assert [n for n in env.RETIRED if n not in history] == []


def test_unknown_notes_tell_a_retired_control_from_a_typo():
    notes = env.unknown_notes({"AFDEP_EARLY_EXPAND": "1", "AFDEP_ROLE_BUFERS": "0",
                               "AFDEP_ZZZ": "1", "AFDEP_PDL": "1", "OTHER": "1"})
    assert set(notes) == {"AFDEP_EARLY_EXPAND", "AFDEP_ROLE_BUFERS", "AFDEP_ZZZ"}
    assert notes["AFDEP_EARLY_EXPAND"].startswith("a retired control (removed in session 36")
    assert notes["AFDEP_ROLE_BUFERS"] == ("not read by torch_afdep "
                                          "(did you mean AFDEP_ROLE_BUFFERS?)")
    assert notes["AFDEP_ZZZ"] == "not read by torch_afdep (a typo?)"
    assert env.unknown_notes({"AFDEP_PDL": "0"}) == {}


def test_current_warns_once_about_variables_without_effect(monkeypatch):
    for name in env.unknown():  # whatever the runner exports: only this test's variable
        monkeypatch.delenv(name)
    monkeypatch.setenv("AFDEP_SPEC_REPLY", "1")
    env.reset()
    try:
        with pytest.warns(UserWarning, match=r"AFDEP_SPEC_REPLY is set but a retired control"):
            first = env.current()
        assert first.flags == env.DEFAULT_FLAGS  # it sets no bit
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert env.current() is first  # parsed once: no second warning
    finally:
        monkeypatch.delenv("AFDEP_SPEC_REPLY")
        env.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        env.current()  # a clean environment parses silently
    env.reset()
