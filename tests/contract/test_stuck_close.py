"""CudaTransport.close with a stuck kernel: its synchronize is bounded (wait_bounded), so a
kernel that never ends (a kernel bug: every wait in the kernels has a deadline) gives an
AfdepTimeoutError after 2 * timeout_s + CLOSE_MARGIN_S instead of hanging close, and leaves
the memory mapped, since the kernel may still write it. Runs without a GPU: the transport's
device synchronize and its extension handle are stand-ins."""

import threading
import time
import types

import pytest
import torch

from torch_afdep.errors import AfdepTimeoutError
from torch_afdep.transport import cuda as tc


def test_wait_bounded_returns_raises_or_gives_up():
    assert tc.wait_bounded(lambda: None, 5.0) is True
    gate = threading.Event()
    t0 = time.monotonic()
    assert tc.wait_bounded(gate.wait, 0.3) is False  # still blocked: left running
    assert 0.3 <= time.monotonic() - t0 < 5.0
    gate.set()

    def fail():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        tc.wait_bounded(fail, 5.0)


class _Comm:
    """The extension's Comm as close() uses it: records close(met)."""

    def __init__(self):
        self.closed = []

    def close(self, met):
        self.closed.append(met)


def _transport(timeout_s):
    t = object.__new__(tc.CudaTransport)  # no extension, no GPU: only what close() reads
    t._closed = False
    t._view = t._token_x = t._token_scales = None
    t.config = types.SimpleNamespace(timeout_s=timeout_s)  # the one field close() reads
    t.rank = 1
    t.device = torch.device("cpu")
    t.group = None
    t._comm = _Comm()
    return t


@pytest.fixture
def short_margin(monkeypatch):
    monkeypatch.setattr(tc, "CLOSE_MARGIN_S", 0.2)


def test_close_with_a_stuck_kernel_raises_and_keeps_the_memory(monkeypatch, short_margin):
    gate = threading.Event()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: gate.wait())
    t = _transport(timeout_s=0.1)
    t0 = time.monotonic()
    try:
        with pytest.raises(AfdepTimeoutError, match="rank 1: close.*stuck") as e:
            t.close()
    finally:
        gate.set()  # let the stand-in's waiter thread end
    assert e.value.phase == "close" and e.value.rank == 1
    assert 0.4 <= time.monotonic() - t0 < 5.0  # 2 * timeout_s + margin
    assert t._comm.closed == []  # not unmapped: the stuck kernel may still write it
    t.close()  # idempotent: nothing more
    assert t._comm.closed == []


def test_close_after_kernels_finish_or_fail_unmaps(monkeypatch, short_margin):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    t = _transport(timeout_s=0.1)
    t.close(clean=False)
    assert t._comm.closed == [False]

    def sticky(device=None):
        raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(torch.cuda, "synchronize", sticky)
    t = _transport(timeout_s=0.1)
    with pytest.raises(RuntimeError, match="launch failure"):
        t.close(clean=False)
    assert t._comm.closed == [False]  # a finished (failed) kernel frees as before
