"""Zero-copy collect (``Buffer.source_collect(zero_copy=True)``, one FFN rank) on the CPU
path, with real processes: results against the fp64 reference, view lifetimes per slot, and
the clear error for more than one FFN rank. The CUDA view is tested in tests/gpu."""

from torch_afdep.testing import spawn_world

import _exchange


def test_zero_copy_collect_3a1f():
    results = spawn_world(_exchange.zero_copy_body, 4, timeout=240)
    attn = results[1:]
    for ptrs in attn:
        assert len(ptrs) == 5  # every zero-copy collect of the plan ran and was checked


def test_zero_copy_refused_with_two_ffn_ranks():
    assert spawn_world(_exchange.zero_copy_refused_body, 4, timeout=240) == [True] * 4
