"""The protocol controls registry (torch_afdep/controls.py) and its agreement with the C++ flags."""

from __future__ import annotations

import pytest

from torch_afdep import controls, env


def test_defaults_are_role_aware_and_symmetric_reverts_all():
    experimental = [n for n, c in controls.CONTROLS.items() if not c.default]
    # experimental, off by default until an A/B shows them faster with no slow processes
    assert experimental == ["AFDEP_RAW_META"]
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
