"""The protocol controls registry (torch_afdep/controls.py) and its agreement with the C++ flags."""

from __future__ import annotations

import pytest

from torch_afdep import controls


def test_defaults_are_role_aware_and_symmetric_reverts_all():
    experimental = [n for n, c in controls.CONTROLS.items() if not c.default]
    # the sized grid measured no gain (GPU record, run 15); PDL is not yet measured
    assert experimental == ["AFDEP_SIZED_GRID", "AFDEP_PDL"]
    assert controls.flags({}) == controls.DEFAULT
    assert controls.DEFAULT == controls.ALL_ROLE_AWARE & ~sum(
        controls.CONTROLS[n].bit for n in experimental)
    assert controls.flags({"AFDEP_SYMMETRIC": "1"}) == 0
    assert controls.flags({"AFDEP_SYMMETRIC": "1", "AFDEP_SIZED_GRID": "1"}) == 0
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
    """The kernels read the same bits (csrc/core/layout.h ControlFlags); CI builds _cuda."""
    cuda = pytest.importorskip("torch_afdep._cuda")
    names = {"AFDEP_ROLE_BUFFERS": "ROLE_BUFFERS", "AFDEP_NO_ENTRY_BARRIER": "NO_ENTRY_BARRIER",
             "AFDEP_ONE_WAY_COUNTS": "ONE_WAY_COUNTS",
             "AFDEP_RECEIVER_WAIT_ONLY": "RECEIVER_WAIT_ONLY",
             "AFDEP_ROLE_WARPS": "ROLE_WARPS", "AFDEP_SINGLE_FFN": "SINGLE_FFN",
             "AFDEP_WIDE_LOCAL": "WIDE_LOCAL", "AFDEP_EARLY_COUNTS": "EARLY_COUNTS",
             "AFDEP_SIZED_GRID": "SIZED_GRID", "AFDEP_STREAM_EXPANSION": "STREAM_EXPANSION",
             "AFDEP_PDL": "PDL"}
    assert set(names) == set(controls.CONTROLS)
    for env_name, attr in names.items():
        assert getattr(cuda, attr) == controls.CONTROLS[env_name].bit, env_name
