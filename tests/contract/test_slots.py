"""Micro-batch slots with real processes, on every device: 2 and 3 slots in interleaved orders
(each rank its own), two buffers of one group interleaved, misuse errors, registered memory
per slot; the config field and the two-micro-batch pipeline example. Every exchange is
checked against the fp64 reference (torch_afdep.reference) and every FFN rank checks what it
received, exactly. A whole two-micro-batch step inside one CUDA graph: tests/gpu."""

import os
import sys

import pytest
import torch

from torch_afdep import Config
from torch_afdep.config import MAX_SLOTS
from torch_afdep.transport.cpu import _TAGS_PER_SLOT, tag_base

from tests.helpers import exchange_bodies as xb
from tests.helpers.devices import spawn_on

#: examples/ at the repository root (this file is tests/contract/<name>.py)
EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")


def test_slots_2a2f_world(device):
    if device == "cuda" and xb.lockstep_protocol():
        pytest.skip("per-rank slot interleavings need the role-aware CUDA protocol (a "
                    "reverted directional control makes every rank wait for every other)")
    results = spawn_on(device, xb.slots_world_body, 4, timeout=300)
    ffn, attn = results[:2], results[2:]
    # num_slots differs across ranks: every rank raises the same error.
    assert len({r["mismatch"] for r in results}) == 1
    assert "num_slots: 2 on rank 0 vs 3 on rank 1" in results[0]["mismatch"]
    for r in results:
        assert r["ids"] == [0, 1, 2]
        assert r["transports"] == [3, 2, 1]
        assert r["registered_bytes"] == [sum(p) for p in r["per_slot_bytes"]]
        if device == "cpu":  # gloo messages: nothing registered, disjoint tag ranges
            assert r["registered_bytes"] == [0, 0, 0]
            tags = sorted(r["tags"])
            assert all(b - a >= _TAGS_PER_SLOT for a, b in zip(tags, tags[1:])), tags
        else:  # every slot registers the same layout; memory scales with the slot count
            b3, b2, b1 = r["per_slot_bytes"]
            assert len(set(b3 + b2 + b1)) == 1 and b1[0] > 0, r["per_slot_bytes"]
            assert r["registered_bytes"] == [3 * b1[0], 2 * b1[0], b1[0]]
    plans = {"buffer_3_slots": 5, "ops_3_slots": 5, "buffer_2_slots": 4, "ops_2_slots": 4,
             "cross_buffers": 4, "one_slot": 2}
    for name, n in plans.items():
        for r in attn:
            assert len(r[name]) == n and all(e < 1e-2 for e in r[name]), (name, r[name])
        for r in ffn:
            assert len(r[name]) == n
    # Something was routed to both FFN ranks.
    assert all(sum(map(sum, r["buffer_3_slots"])) > 0 for r in ffn)
    assert all(len(r["messages"]) == 16 for r in attn)
    assert all(len(r["messages"]) == 8 for r in ffn)


def test_tag_ranges_never_overlap():
    seen = set()
    for buffer_id in range(5):
        for slot in range(MAX_SLOTS):
            base = tag_base(buffer_id, slot)
            tags = set(range(base, base + _TAGS_PER_SLOT))
            assert not tags & seen
            seen |= tags
    with pytest.raises(ValueError):
        tag_base(0, MAX_SLOTS)


@pytest.mark.parametrize("value, exc, fragment", [
    (0, ValueError, "num_slots must be in [1, 16]"),
    (17, ValueError, "num_slots must be in [1, 16]"),
    (2.0, TypeError, "num_slots must be an int"),
])
def test_num_slots_validation(value, exc, fragment):
    with pytest.raises(exc) as info:
        Config(capacity_tokens_per_rank=8, hidden_size=128, num_experts=4, top_k=2,
               ffn_ranks=1, attention_ranks=1, num_slots=value)
    assert fragment in str(info.value)


def test_num_slots_default_and_fingerprint():
    kw = dict(capacity_tokens_per_rank=8, hidden_size=128, num_experts=4, top_k=2,
              ffn_ranks=1, attention_ranks=1)
    assert Config(**kw).num_slots == 2
    assert Config(**kw).fingerprint() != Config(**kw, num_slots=3).fingerprint()
    assert Config(**kw, num_slots=3).check_slot(2) == 2


def test_two_microbatch_pipeline_example(capsys):
    sys.path.insert(0, EXAMPLES)
    try:
        import two_microbatch_pipeline as ex

        assert ex.main(["--layers", "3", "--tokens", "8", "--attention-ms", "15",
                        "--expert-ms", "15"]) == 0
    finally:
        sys.path.remove(EXAMPLES)
    out = capsys.readouterr().out
    assert "PASS" in out and "pipelined (2 slots)" in out and "serial (1 slot)" in out
    assert "sum of its parts" in out


class _RecordingTransport:
    """A transport stand-in that records how each op polled its device errors."""

    def __init__(self):
        self.polls = []

    def check_error(self, mid_exchange: bool = False) -> None:
        self.polls.append(mid_exchange)


@pytest.mark.parametrize("role,ops", [("attention", ("dispatch", "combine")),
                                      ("ffn", ("receive", "reply"))])
def test_ops_that_end_an_exchange_poll_timeouts_only(role, ops):
    # a route error the kernels saw mid-exchange is raised by the next opening op, never by
    # the collect / reply that completes the exchange (that would leave the peers waiting)
    from torch_afdep.slots import Slots

    cfg = Config(capacity_tokens_per_rank=4, hidden_size=128, num_experts=8, top_k=2,
                    ffn_ranks=1, attention_ranks=1)
    rank = 1 if role == "attention" else 0
    assert cfg.role_of(rank) == role
    t = _RecordingTransport()
    slots = Slots(cfg, rank, torch.device("cpu"), "g", 0, [t])
    opening, ending = ops
    slots.begin(0, opening)
    slots.end(0, opening, slots.state, route=torch.zeros(1, dtype=torch.int64))
    slots.begin(0, ending)
    assert t.polls == [False, True]
