"""Micro-batch slots on CUDA: one CudaTransport per slot (own windows, counters, error block).

- eager, 2A2F, three slots in interleaved orders per rank (Buffer API);
- a whole two-micro-batch layer step captured in one CUDA graph per rank (Attention:
  dispatch slot 0, dispatch slot 1, combine slot 1, combine slot 0; FFN: receive, experts,
  reply on slot 0 then slot 1), replayed with fresh inputs, checked every replay;
- registered memory scales with the slot count.

Skipped cleanly without two CUDA GPUs or without the built extension. The bodies take the
device from the spawned world (they also run on CPU without the graph, for debugging).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


import gpu_worlds as gw  # noqa: E402  (tests/gpu is on sys.path under pytest)

gw.skip_unless_two_gpus()

import torch.distributed as dist  # noqa: E402



ENV = gw.GPU_ENV


def _device():
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _slot_inputs(cfg, tokens, routing, seed, slot):
    """Inputs of every Attention index for the exchange on ``slot`` (same on every rank)."""
    return [gw.make_inputs(cfg, a, tokens[a], routing, 2 * seed + slot)
            for a in range(cfg.attention_ranks)]


def _check_errors(buf):
    for t in buf.transports:
        t.check_error()


def interleaved_body(rank, world, cfg_kw, rounds, seed0):
    """rounds: list of (attention order, ffn order) over slots 0..2, e.g. ("012", "201")
    meaning dispatch/receive in that order, then collect/reply in reverse of it."""
    import torch_afdep

    cfg = gw.make_config(cfg_kw)
    dev = _device()
    buf = torch_afdep.Buffer(dist.group.WORLD, cfg, device=dev)
    role, idx = buf.role, buf.role_index
    bucket = cfg.capacity_tokens_per_rank
    checked = 0
    try:
        assert len(buf.transports) == cfg.num_slots
        for r, (a_order, f_order) in enumerate(rounds):
            tokens = {s: [(bucket // (s + 1) + a) % (bucket + 1) for a in
                          range(cfg.attention_ranks)] for s in range(cfg.num_slots)}
            inputs = {s: _slot_inputs(cfg, tokens[s], "random", seed0 + r, s)
                      for s in range(cfg.num_slots)}
            if role == "attention":
                order = [int(c) for c in a_order]
                for s in order:
                    x, ids, w, sc = inputs[s][idx]
                    buf.source_dispatch(x.to(dev), ids.to(dev), w.to(dev), bucket,
                                        None if sc is None else sc.to(dev), slot=s)
                for s in reversed(order):
                    out = buf.source_collect(slot=s)
                    torch.cuda.synchronize() if dev.type == "cuda" else None
                    _check_errors(buf)
                    x, ids, w, sc = inputs[s][idx]
                    gw.check_attention(cfg, x, ids, w, sc, gw.ref.route_mask(
                        cfg, gw.clean_ids(cfg, ids)), out)
                    checked += 1
            else:
                order = [int(c) for c in f_order]
                recs = {s: buf.worker_receive(bucket, slot=s) for s in order}
                for s in reversed(order):
                    rec = recs[s]
                    want = gw.ref.expert_counts(cfg, [gw.clean_ids(cfg, i[1])
                                                      for i in inputs[s]])[idx]
                    offs = rec.expert_offsets.cpu().to(torch.int64)
                    assert torch.equal(offs[1:] - offs[:-1], want), (s, offs, want)
                    rows = gw.ffn_rows(cfg, idx, rec.x, rec.x_scales, rec.weights,
                                       rec.expert_offsets)
                    buf.worker_reply(rows, rec.receipt)
                    checked += 1
        if dev.type == "cuda":
            torch.cuda.synchronize()
        _check_errors(buf)
        return {"checked": checked, "registered": buf.registered_bytes,
                "per_slot": [t.registered_bytes for t in buf.transports]}
    finally:
        buf.close()


_DIRECTIONAL = ("AFDEP_NO_ENTRY_BARRIER", "AFDEP_ONE_WAY_COUNTS", "AFDEP_RECEIVER_WAIT_ONLY",
                "AFDEP_ROLE_WARPS")


def _lockstep() -> bool:
    """True when a reverted control makes every rank wait for every other rank in each phase
    (the symmetric union protocol): then both roles must issue the same phase sequence over the
    slots, so a slot cannot be collected before an earlier one (docs/protocol.md)."""
    from torch_afdep import controls

    f = controls.flags()
    return any(not f & controls.CONTROLS[n].bit for n in _DIRECTIONAL)


def two_microbatch_graph_body(rank, world, cfg_kw, tokens, replays, seed0, use_graph=True):
    """One CUDA graph per rank holding a whole two-micro-batch layer step."""
    import torch_afdep

    cfg = gw.make_config(cfg_kw)
    dev = _device()
    buf = torch_afdep.Buffer(dist.group.WORLD, cfg, device=dev)
    name = buf.group_name
    role, idx = buf.role, buf.role_index
    bucket = cfg.capacity_tokens_per_rank
    use_graph = use_graph and dev.type == "cuda"
    lockstep = _lockstep()
    checked = 0
    try:
        if role == "attention":
            first = {s: _slot_inputs(cfg, tokens[s], "partial", seed0 - 1, s)[idx]
                     for s in (0, 1)}
            xs = {s: first[s][0].to(dev) for s in (0, 1)}
            ids = {s: first[s][1].to(torch.int64).to(dev) for s in (0, 1)}
            ws = {s: first[s][2].to(dev) for s in (0, 1)}
            scs = {s: None if first[s][3] is None else first[s][3].to(dev) for s in (0, 1)}

            def step():
                r0 = torch_afdep.afd_dispatch(xs[0], ids[0], ws[0], group=name, bucket=bucket,
                                              x_scales=scs[0], slot=0)
                r1 = torch_afdep.afd_dispatch(xs[1], ids[1], ws[1], group=name, bucket=bucket,
                                              x_scales=scs[1], slot=1)
                if lockstep:  # every rank combines slot 0, then slot 1
                    o0 = torch_afdep.afd_combine(r0, group=name, slot=0)
                    o1 = torch_afdep.afd_combine(r1, group=name, slot=1)
                else:  # role-aware: collect the later micro-batch first
                    o1 = torch_afdep.afd_combine(r1, group=name, slot=1)
                    o0 = torch_afdep.afd_combine(r0, group=name, slot=0)
                return {0: (r0, o0), 1: (r1, o1)}

            res = step()  # eager warm-up, checked
            if use_graph:
                torch.cuda.synchronize()
            for s in (0, 1):
                x, i, w, sc = first[s]
                gw.check_attention(cfg, x, i, w, sc, *res[s])
            if use_graph:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    res = step()
                assert all(p == "idle" for p in buf._slot_phase)
            dist.barrier()
            for k in range(replays):
                fresh = {s: _slot_inputs(cfg, tokens[s], "partial", seed0 + k, s)[idx]
                         for s in (0, 1)}
                for s in (0, 1):
                    xs[s].copy_(fresh[s][0])
                    ids[s].copy_(fresh[s][1].to(torch.int64))
                    ws[s].copy_(fresh[s][2])
                    if scs[s] is not None:
                        scs[s].copy_(fresh[s][3])
                if use_graph:
                    g.replay()
                    torch.cuda.synchronize()
                else:
                    res = step()
                _check_errors(buf)
                for s in (0, 1):
                    x, i, w, sc = fresh[s]
                    gw.check_attention(cfg, x, i, w, sc, *res[s])
                    checked += 1
        else:
            def step():
                outs, recs = {}, {}
                for s in (0, 1):
                    recs[s] = torch_afdep.afd_receive(group=name, bucket=bucket, slot=s)
                    outs[s] = recs[s].expert_offsets
                    if not lockstep:  # role-aware: answer each micro-batch as it arrives
                        _reply(recs.pop(s))
                for s in sorted(recs):  # lockstep: both receives, then both replies
                    _reply(recs[s])
                return outs

            def _reply(rec):
                rows = gw.ffn_rows(cfg, idx, rec.x, rec.x_scales, rec.weights,
                                   rec.expert_offsets)
                torch_afdep.afd_reply(rows, rec.receipt, group=name)

            def check(offsets, seed):
                for s in (0, 1):
                    inputs = _slot_inputs(cfg, tokens[s], "partial", seed, s)
                    want = gw.ref.expert_counts(cfg, [gw.clean_ids(cfg, i[1])
                                                      for i in inputs])[idx]
                    offs = offsets[s].cpu().to(torch.int64)
                    assert torch.equal(offs[1:] - offs[:-1], want), (s, offs, want)

            offsets = step()
            if use_graph:
                torch.cuda.synchronize()
            check(offsets, seed0 - 1)
            if use_graph:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    offsets = step()
            dist.barrier()
            for k in range(replays):
                if use_graph:
                    g.replay()
                    torch.cuda.synchronize()
                else:
                    offsets = step()
                _check_errors(buf)
                check(offsets, seed0 + k)
                checked += 1
        return checked
    finally:
        if dev.type == "cuda":
            torch.cuda.synchronize()
        buf.close()


def _kw(F, A, num_slots, cap=128, hidden=2048, dtype="bfloat16"):
    return dict(capacity_tokens_per_rank=cap, hidden_size=hidden, num_experts=64, top_k=8,
                ffn_ranks=F, attention_ranks=A, dtype=dtype, num_sms=24, timeout_s=10.0,
                num_slots=num_slots)


def test_three_slots_interleaved_2a2f():
    rounds = [("012", "201"), ("210", "012"), ("102", "120")]
    res = gw.spawn_gpu_world(interleaved_body, 4, _kw(2, 2, 3), rounds, 5, device_ids=[0, 1, 0, 1],
                      env=ENV, timeout=300)
    assert all(r["checked"] == 9 for r in res)
    for r in res:
        assert len(r["per_slot"]) == 3 and r["registered"] == sum(r["per_slot"])
        assert len(set(r["per_slot"])) == 1  # every slot registers the same layout


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_two_microbatch_layer_step_in_one_cuda_graph(dtype):
    tokens = {0: [128], 1: [37]}
    res = gw.spawn_gpu_world(two_microbatch_graph_body, 2, _kw(1, 1, 2, dtype=dtype), tokens, 20, 40,
                      device_ids=[0, 1], env=ENV, timeout=300)
    assert res == [20, 40]  # FFN: one check per replay; Attention: one per micro-batch


def test_registered_bytes_scale_with_slots():
    one = gw.spawn_gpu_world(interleaved_body, 2, _kw(1, 1, 1), [("0", "0")], 9, device_ids=[0, 1],
                      env=ENV, timeout=300)
    three = gw.spawn_gpu_world(interleaved_body, 2, _kw(1, 1, 3), [("012", "012")], 9,
                        device_ids=[0, 1], env=ENV, timeout=300)
    for a, b in zip(one, three):
        assert b["registered"] == 3 * a["registered"] > 0
