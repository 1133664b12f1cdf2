"""The protocol controls registry (torch_afdep/controls.py) and its agreement with the C++ flags."""

from __future__ import annotations

import pytest

from torch_afdep import controls


def test_defaults_are_all_role_aware_and_symmetric_reverts_all():
    assert controls.flags({}) == controls.ALL_ROLE_AWARE
    assert controls.flags({"AFDEP_SYMMETRIC": "1"}) == 0
    assert controls.flags({"AFDEP_SYMMETRIC": "0"}) == controls.ALL_ROLE_AWARE
    bits = [c.bit for c in controls.CONTROLS.values()]
    assert len(set(bits)) == len(bits) and sum(bits) == controls.ALL_ROLE_AWARE


@pytest.mark.parametrize("name", sorted(controls.CONTROLS))
def test_each_control_reverts_only_its_bit(name):
    mask = controls.flags({name: "0"})
    assert mask == controls.ALL_ROLE_AWARE & ~controls.CONTROLS[name].bit
    assert controls.describe(mask)[name] == 0
    assert sum(controls.describe(mask).values()) == len(controls.CONTROLS) - 1


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
             "AFDEP_WIDE_LOCAL": "WIDE_LOCAL", "AFDEP_EARLY_COUNTS": "EARLY_COUNTS"}
    assert set(names) == set(controls.CONTROLS)
    for env_name, attr in names.items():
        assert getattr(cuda, attr) == controls.CONTROLS[env_name].bit, env_name
