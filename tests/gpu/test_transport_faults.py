"""Faults on CUDA with real processes: a rank killed (os._exit) in the middle of an exchange,
and a rank that skips its part of an exchange after healthy ones. The CPU transport's faults:
tests/contract/test_faults.py; bodies in tests/helpers/transport_bodies.py.

On CUDA a waiting kernel ends at its own deadline (``timeout_s`` from its start) and
``CudaTransport.check_error()`` raises ``AfdepTimeoutError(peer=, phase=, rank=)``. Every
survivor must get exactly that, within ``timeout_s`` (+ slack) of launching the wait and of the
death, and then close without its peers and exit: ``spawn_world`` raises ``WorldError`` naming
only the killed rank, no child is left, and the world ends long before spawn_world's own
timeout. Survivors report through per-rank result files (the killed rank makes spawn_world
raise). Skipped cleanly without a CUDA GPU or without the built extension; rank r runs on
GPU r % n_gpus (shared GPUs need CUDA MPS).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


from tests.helpers import devices  # noqa: E402

devices.require_gpu_module()

from tests.helpers import transport_bodies as hb  # noqa: E402

ENV = devices.GPU_ENV
TIMEOUT_S, SLACK_S = hb.KILL_TIMEOUT_S, hb.KILL_SLACK_S
# layout -> (F, A, device of each group rank); group ranks [0, F) are FFN, then Attention
LAYOUTS = {"1A1F": (1, 1, devices.rank_devices(2)),
           "2A2F": (2, 2, devices.rank_devices(4))}


def kw(layout):
    F, A, _ = LAYOUTS[layout]
    return dict(capacity_tokens_per_rank=32, hidden_size=1024, num_experts=64, top_k=4,
                ffn_ranks=F, attention_ranks=A, dtype="bfloat16", num_sms=8,
                timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("layout", ["1A1F", "2A2F"])
@pytest.mark.parametrize("scenario", ["ffn_after_receive", "attention_before_collect"])
def test_rank_killed_mid_exchange(layout, scenario, tmp_path):
    """A rank dies with os._exit mid-exchange after two healthy, checked exchanges.
    ffn_after_receive: FFN rank 0 dies after its receive; every Attention rank's combine
    raises AfdepTimeoutError(peer=0, phase='combine'); in 2A2F the other FFN rank's next
    receive (no Attention rank sends again) raises it with an Attention peer, phase
    'dispatch'. attention_before_collect: the first Attention rank dies after its dispatch,
    before its collect, while the FFN ranks already wait in their next receive: they raise
    (peer = that rank, phase 'dispatch'); in 2A2F the other Attention rank collects its
    exchange (checked), dispatches the next and raises in combine with an FFN peer. Every
    survivor raises within timeout_s (+2 s) and closes without its peers in < 2 s; only the
    killed rank fails the world, and no process is left behind."""
    F, A, devs = LAYOUTS[layout]
    w = hb.run_kill_world(hb.kill_body, F + A, (kw(layout), str(tmp_path), scenario),
                          str(tmp_path), device_ids=devs, env=ENV)
    hb.check_kill_outcome(w, list(range(F)), list(range(F, F + A)), scenario)


def test_skipped_exchange_after_healthy_ones_times_out():
    """1A1F, after three healthy, checked exchanges a rank skips its part of the next one.
    Not a duplicate of test_cuda_transport.py::test_timeout_raises (fresh transports, nothing
    ever sent): here the waiting rank's signal slots already hold the previous exchange's
    sequence number, which must not satisfy the new wait. Attention skips its dispatch: the
    FFN receive raises AfdepTimeoutError(peer=1, phase='dispatch', rank=0). FFN receives but
    skips its reply: the Attention combine raises AfdepTimeoutError(peer=0, phase='combine',
    rank=1). Each after ~timeout_s; both ranks then close cleanly."""
    res = devices.spawn_gpu_world(hb.skip_body, 2, kw("1A1F"), env=ENV, timeout=240)
    ffn, att = res
    for part in ("skip_dispatch", "skip_reply"):
        for r in res:
            assert len(r[part]["healthy"]) == 3
            assert r[part]["close_s"] < TIMEOUT_S + SLACK_S + 30.0
    d = ffn["skip_dispatch"]["wait"]
    assert (d["type"], d["peer"], d["phase"], d["rank"]) == ("AfdepTimeoutError", 1,
                                                             "dispatch", 0), d
    assert ffn["skip_reply"]["received"] is True
    c = att["skip_reply"]["wait"]
    assert (c["type"], c["peer"], c["phase"], c["rank"]) == ("AfdepTimeoutError", 0,
                                                             "combine", 1), c
    for w in (d, c):
        assert TIMEOUT_S - 0.2 <= w["elapsed"] <= TIMEOUT_S + SLACK_S, w
