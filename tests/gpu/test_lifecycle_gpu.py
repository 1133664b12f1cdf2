"""Buffer lifecycle on CUDA (issue: reliability): many buffers created and closed in one
process leak no device or host memory, and a CUDA graph holding an exchange can be destroyed
and recaptured (with a different T) while the buffer lives on.

Skipped cleanly without two CUDA GPUs or without the built extension.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

pytestmark = pytest.mark.gpu


import gpu_worlds as gw  # noqa: E402  (tests/gpu is on sys.path under pytest)

gw.skip_unless_two_gpus()

import torch.distributed as dist  # noqa: E402

ENV = gw.GPU_ENV
KW = dict(capacity_tokens_per_rank=64, hidden_size=1024, num_experts=32, top_k=4, ffn_ranks=1,
          attention_ranks=1, dtype="bfloat16", num_sms=8, timeout_s=20.0)


def _device():
    """The spawned rank's GPU; the CPU (gloo path, no graphs) when run without one, which
    is how these bodies are smoke-tested on a CPU machine."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _exchange(buf, cfg, seed, tokens=5):
    """One checked eager exchange through the Buffer API (both roles call it)."""
    dev = buf.device
    x, ids, w, sc = gw.make_inputs(cfg, 0, tokens, "random", seed)
    if buf.role == "ffn":
        rec = buf.worker_receive(tokens)
        rows = gw.ffn_rows(cfg, 0, rec.x, rec.x_scales, rec.weights, rec.expert_offsets)
        buf.worker_reply(rows, rec.receipt)
        _sync(dev)
        want = gw.ref.expert_counts(cfg, [gw.clean_ids(cfg, ids)])[0]
        offs = rec.expert_offsets.cpu().to(torch.int64)
        assert torch.equal(offs[1:] - offs[:-1], want)
    else:
        buf.source_dispatch(x.to(dev), ids.to(dev), w.to(dev), tokens)
        out = buf.source_collect()
        _sync(dev)
        gw.check_attention(cfg, x, ids, w, sc, gw.ref.route_mask(cfg, gw.clean_ids(cfg, ids)),
                           out)


def many_buffers_body(rank, world, cfg_kw, n, every):
    """Create and close ``n`` CUDA buffers; one checked exchange on every ``every``-th.
    Returns [(i, free device bytes, host RSS bytes)] samples."""
    import torch_afdep

    cfg = gw.make_config(cfg_kw)
    dev = _device()
    samples = []

    def sample(i):
        gc.collect()
        _sync(dev)
        free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else 0
        samples.append((i, free, _rss()))

    with torch_afdep.Buffer(dist.group.WORLD, cfg, device=dev) as buf:  # warm everything up
        _exchange(buf, cfg, 1)
    sample(0)
    for i in range(1, n + 1):
        buf = torch_afdep.Buffer(dist.group.WORLD, cfg, device=dev)
        try:
            if i % every == 0:
                _exchange(buf, cfg, 100 + i)
        finally:
            buf.close()
        if i % max(1, n // 8) == 0 or i == n:
            sample(i)
    return samples


def test_many_cuda_buffers_leak_nothing():
    """1,000 CUDA buffers (two slots each: windows, IPC mappings, workspaces, host-mapped
    error blocks) created and closed in one process: free device memory returns to within
    16 MiB of the start and is flat over the second half; host RSS grows by at most 64 MiB
    in total and 16 MiB over the second half. Every 100th buffer runs a checked exchange."""
    n = int(os.environ.get("AFDEP_TEST_BUFFERS", "1000"))
    res = gw.spawn_gpu_world(many_buffers_body, 2, KW, n, 100, device_ids=[0, 1], env=ENV,
                             timeout=1200)
    for rank, samples in enumerate(res):
        base, half, last = samples[0], samples[len(samples) // 2], samples[-1]
        print(f"rank {rank}: {n} buffers: device free {base[1] - last[1]:+d} B vs start, "
              f"{half[1] - last[1]:+d} B over the second half; RSS {last[2] - base[2]:+d} B, "
              f"{last[2] - half[2]:+d} B over the second half")
        assert base[1] - last[1] <= 16 << 20, samples
        assert abs(half[1] - last[1]) <= 4 << 20, samples
        assert last[2] - base[2] <= 64 << 20, samples
        assert last[2] - half[2] <= 16 << 20, samples


def recapture_body(rank, world, cfg_kw, plan, replays):
    """For each T in ``plan``: capture one exchange per rank in a CUDA graph, replay it
    ``replays`` times with fresh inputs (checked every time), then destroy the graph; the
    buffer stays open across captures. Returns the number of checked replays."""
    import torch_afdep

    cfg = gw.make_config(cfg_kw)
    dev = _device()
    graphs = dev.type == "cuda"
    buf = torch_afdep.Buffer(dist.group.WORLD, cfg, device=dev)
    checked = 0
    try:
        for k, T in enumerate(plan):
            seeds = [1000 * (k + 1) + j for j in range(replays + 1)]
            x0, ids0, w0, sc0 = gw.make_inputs(cfg, 0, T, "partial", seeds[0])
            if buf.role == "attention":
                xs, ids, ws = x0.to(dev), ids0.to(torch.int64).to(dev), w0.to(dev)

                def step():
                    buf.source_dispatch(xs, ids, ws, T)
                    return buf.source_collect()
            else:
                def step():
                    rec = buf.worker_receive(T)
                    rows = gw.ffn_rows(cfg, 0, rec.x, rec.x_scales, rec.weights,
                                       rec.expert_offsets)
                    buf.worker_reply(rows, rec.receipt)
                    return rec.expert_offsets

            res = step()  # eager warm-up on the captured tensors (allocator, lazy init)
            _sync(dev)
            g = None
            if graphs:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    res = step()
            dist.barrier()
            for j in range(1, replays + 1):
                x, i, w, sc = gw.make_inputs(cfg, 0, T, "partial", seeds[j])
                if buf.role == "attention":
                    xs.copy_(x)
                    ids.copy_(i.to(torch.int64))
                    ws.copy_(w)
                    res.fill_(float("nan"))
                if graphs:
                    g.replay()
                else:
                    res = step()
                _sync(dev)
                for t in buf.transports:
                    t.check_error()
                if buf.role == "attention":
                    gw.check_attention(cfg, x, i, w, sc,
                                       gw.ref.route_mask(cfg, gw.clean_ids(cfg, i)), res)
                else:
                    want = gw.ref.expert_counts(cfg, [gw.clean_ids(cfg, i)])[0]
                    offs = res.cpu().to(torch.int64)
                    assert torch.equal(offs[1:] - offs[:-1], want), (k, j)
                checked += 1
            del g, res
            gc.collect()
            _sync(dev)
            dist.barrier()
    finally:
        buf.close()
    return checked


def test_cuda_graph_destroyed_and_recaptured():
    """An exchange captured, replayed 20 times with fresh checked inputs, the graph destroyed,
    then captured again with a different T (and again), on one open buffer."""
    res = gw.spawn_gpu_world(recapture_body, 2, KW, [7, 33, 1], 20, device_ids=[0, 1],
                             env=ENV, timeout=600)
    assert res == [60, 60]
