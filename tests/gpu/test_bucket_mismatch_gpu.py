"""A bucket mismatch on CUDA is reported on every rank of the exchange, with nothing corrupted.

1A1F (group rank 0 FFN, group rank 1 Attention), both on GPU 0 (needs CUDA MPS, i.e.
``AFDEP_TEST_SHARED_GPU=1``) or one GPU each when there are two:

1. equal buckets (8 and 8, T = 5): the result matches ``torch_afdep.reference.moe_output``;
2. Attention bucket 4, FFN bucket 8 (T = 3): the FFN takes nothing from the Attention rank
   (no rows, zero tokens) and the Attention's result is all zeros (the FFN's reply rows are
   NaN-poisoned: none may arrive; the previous exchange's rows still sit in the receive
   buffer: none may be read); both ranks raise ``AfdepRouteError`` naming the bucket mismatch
   within ``timeout_s`` (the FFN after its reply, the Attention after its collect);
3. equal buckets again: the buffer still works (sequence numbers stayed in step).

The kernels carry the sender's bucket in its count blocks, the FFN's receive compares it, and
its reply flags the mismatch back (docs/protocol.md, Errors).
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.gpu

from tests.helpers import devices  # noqa: E402
from torch_afdep import env  # noqa: E402


def _skip_reason():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return "needs a CUDA GPU"
    try:
        import torch_afdep._cuda  # noqa: F401
    except Exception as e:  # not built, or a broken build
        return f"needs the built torch_afdep._cuda extension ({type(e).__name__}: {e})"
    if torch.cuda.device_count() < 2 and not env.get("AFDEP_TEST_SHARED_GPU"):
        return ("both ranks share GPU 0: needs CUDA MPS (AFDEP_TEST_SHARED_GPU=1) or 2 GPUs")
    return None


TIMEOUT_S = 10.0
BASE = dict(capacity_tokens_per_rank=16, hidden_size=256, num_experts=8, top_k=2, ffn_ranks=1,
            attention_ranks=1, num_sms=4, local_sms=8, num_slots=1, timeout_s=TIMEOUT_S)
# (tokens, Attention bucket, FFN bucket) of the three exchanges: equal, mismatched, equal
EXCHANGES = [(5, 8, 8), (3, 4, 8), (5, 8, 8)]
# the flagged units on one side only: the FFN's bucket 4 (its start units, at 4 tokens a
# channel, tell the mismatch) against the Attention's 16, and the reverse (the FFN's bucket 16:
# the count form)
FFN_UNITS = [(5, 8, 8), (3, 16, 4), (5, 8, 8)]
FFN_COUNTS = [(5, 8, 8), (3, 4, 16), (5, 8, 8)]
# Every receive path checks the bucket: id -> (environment, Config changes, exchanges)
CASES = {
    "role_aware": ({}, {}, EXCHANGES),
    "symmetric": ({"AFDEP_SYMMETRIC": "1"}, {}, EXCHANGES),
    # the Attention's bucket larger than the FFN's (T fits both)
    "attention_larger": ({}, {}, [(5, 8, 8), (3, 8, 4), (5, 8, 8)]),
    # early counts: one channel holding >= 32 KB but < 16 tokens (counts ahead, payload flag)
    "early_counts": ({}, dict(hidden_size=4096, num_sms=1),
                     [(5, 8, 8), (5, 6, 8), (5, 8, 8)]),
    # streamed expansion: one channel with >= 48 tokens and >= 32 KB (a flag per row)
    "stream_expansion": ({}, dict(capacity_tokens_per_rank=128, hidden_size=1024, num_sms=1),
                         [(64, 128, 128), (64, 64, 128), (64, 128, 128)]),
    "no_pdl": ({"AFDEP_PDL": "0"}, {}, EXCHANGES),
    "no_wide_local": ({"AFDEP_WIDE_LOCAL": "0"}, {}, EXCHANGES),
    # the token layout in the count form (AFDEP_LL_SMALL=0), and its flagged units (the
    # default: at most 2 tokens per channel, buckets 4 and 8 over 4 channels) on both sides,
    # or on one side only (early_collect_ffn_counts and _units below, the same defaults)
    "tokens": ({"AFDEP_LL_SMALL": "0"}, dict(receive_layout="tokens"), EXCHANGES),
    "ll_small": ({"AFDEP_LL_SMALL": "1"}, dict(receive_layout="tokens"), EXCHANGES),
    # AFDEP_RAW_META (experimental): the token layout's lone tokens (T = 5 over 4 channels of 2
    # at bucket 8: CTA 2 holds one) send raw metadata beside the others' entries; on one side
    # only, the FFN's count form (bucket 16) takes the raw region as a mismatch, and the
    # reverse
    "raw_meta": ({"AFDEP_RAW_META": "1"}, dict(receive_layout="tokens"), EXCHANGES),
    "raw_meta_ffn_counts": ({"AFDEP_RAW_META": "1"}, dict(receive_layout="tokens"), FFN_COUNTS),
    "raw_meta_ffn_units": ({"AFDEP_RAW_META": "1"}, dict(receive_layout="tokens"), FFN_UNITS),
    # the expert layout's reply: units by default (bucket 8 <= 2 x 4, the role_aware case), the
    # count form with AFDEP_LL_SMALL=0, and on one side only (early_collect_experts_ffn_counts
    # and _units below, the same defaults)
    "experts_counts": ({"AFDEP_LL_SMALL": "0"}, {}, EXCHANGES),
    # AFDEP_LL_EXPERTS (on by default; set here all the same): the expert layout's dispatch as
    # units on both sides (8 channels: one token each at buckets 4 and 8), and on one side
    # only: the FFN's count form (bucket 16) watching for the Attention's units, and the FFN's
    # units receive seeing the Attention's count block (bucket 16); reverted, the count blocks
    # on both sides at every bucket
    "ll_experts": ({"AFDEP_LL_EXPERTS": "1"}, dict(num_sms=8), EXCHANGES),
    "ll_experts_ffn_counts": ({"AFDEP_LL_EXPERTS": "1"}, dict(num_sms=8), FFN_COUNTS),
    "ll_experts_ffn_units": ({"AFDEP_LL_EXPERTS": "1"}, dict(num_sms=8), FFN_UNITS),
    # AFDEP_FANOUT_EXPAND (experimental): the FFN's units receive in kUnitExpFan, on both sides
    # and beside the Attention's count block (bucket 16)
    "ll_experts_fanout": ({"AFDEP_LL_EXPERTS": "1", "AFDEP_FANOUT_EXPAND": "1"}, dict(num_sms=8),
                          EXCHANGES),
    "ll_experts_fanout_ffn_units": ({"AFDEP_LL_EXPERTS": "1", "AFDEP_FANOUT_EXPAND": "1"},
                                    dict(num_sms=8), FFN_UNITS),
    # AFDEP_UNIT_SIGNAL=0 (on by default, as in early_collect_* below: the reply's units CTAs
    # unfenced): every reply CTA fences again; the FFN's start units (bucket 4) tell the
    # mismatch in either layout, and the FFN's count form (bucket 16) meets the Attention's units
    "unit_signal_off_ffn_units": ({"AFDEP_UNIT_SIGNAL": "0"}, dict(receive_layout="tokens"),
                                  FFN_UNITS),
    "unit_signal_off_ffn_counts": ({"AFDEP_UNIT_SIGNAL": "0"}, dict(receive_layout="tokens"),
                                   FFN_COUNTS),
    "unit_signal_off_experts_ffn_units": ({"AFDEP_UNIT_SIGNAL": "0"}, {}, FFN_UNITS),
    "ll_experts_reverted": ({"AFDEP_LL_EXPERTS": "0"}, dict(num_sms=8), EXCHANGES),
    # The flagged units on one side only, with the defaults (AFDEP_LL_SMALL and
    # AFDEP_EARLY_COLLECT on; set here all the same), in either layout: the FFN (bucket 16, 4 per
    # channel) expects the count block while the Attention (bucket 4) sends units, and replies
    # in the count form to a collect that watches for units (T = 3 <= 2 x 4), the token
    # layout's collect lanes meeting its completion count and reply status; and the reverse
    # (the FFN's bucket 4: its start units tell the mismatch). The expert layout's collect
    # keeps its barrier (kSmallRecv) with the control on.
    "early_collect_ffn_counts": ({"AFDEP_EARLY_COLLECT": "1"}, dict(receive_layout="tokens"),
                                 FFN_COUNTS),
    "early_collect_ffn_units": ({"AFDEP_EARLY_COLLECT": "1"}, dict(receive_layout="tokens"),
                                FFN_UNITS),
    "early_collect_experts_ffn_counts": ({"AFDEP_EARLY_COLLECT": "1"}, {}, FFN_COUNTS),
    "early_collect_experts_ffn_units": ({"AFDEP_EARLY_COLLECT": "1"}, {}, FFN_UNITS),
    # AFDEP_SPREAD_CHUNKS=0 (every other case spreads, the default): the reply's start units,
    # which tell the mismatch, from CTA 0's warps instead of the last CTA's last warp
    "early_collect_ffn_units_spread_off": ({"AFDEP_SPREAD_CHUNKS": "0"},
                                           dict(receive_layout="tokens"), FFN_UNITS),
    "ll_experts_ffn_units_spread_off": ({"AFDEP_SPREAD_CHUNKS": "0"}, dict(num_sms=8), FFN_UNITS),
}
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NVSHMEM_DISABLE_NVLS": "1"}


def _expert(cfg):
    return lambda e, rows: rows * (1.0 + e / cfg.num_experts)


def _ffn_rows(cfg, received, poison: bool):
    """The FFN's reply rows: ``_expert`` times the routing weight (NaN everywhere if poison)."""
    x = received.x.to(torch.float64)
    rows = torch.full(x.shape, float("nan"), dtype=torch.float64, device=x.device)
    if not poison:
        offs = received.expert_offsets.tolist()
        for e in range(cfg.experts_per_rank):
            lo, hi = offs[e], offs[e + 1]
            if hi > lo:
                rows[lo:hi] = x[lo:hi] * (1.0 + e / cfg.num_experts)
        n = offs[-1]
        rows[:n] *= received.weights[:n].to(torch.float64)[:, None]
    return rows.to(torch.bfloat16)


def _ffn_token_rows(cfg, received, poison: bool):
    """Token layout: each row's reply, the weighted sum of ``_expert`` over its local ids (NaN
    everywhere if poison; zero for rows without a token)."""
    x = received.x.to(torch.float64)
    if poison:
        return torch.full(x.shape, float("nan"), device=x.device).to(torch.bfloat16)
    ids = received.expert_ids.to(torch.int64)
    w = torch.where(ids >= 0, received.weights.to(torch.float64), 0.0)
    gain = 1.0 + torch.where(ids >= 0, ids, 0).to(torch.float64) / cfg.num_experts  # F = 1
    rows = x * (w * gain).sum(dim=1, keepdim=True)
    return torch.where((ids >= 0).any(dim=1, keepdim=True), rows, 0.0).to(torch.bfloat16)


def _raise_pending(buf):
    """Raise the device's pending error of every slot (no synchronization inside)."""
    for t in buf.transports:
        t.check_error()


def _error_after(buf, deadline):
    """The AfdepRouteError the device reported, polled until ``deadline`` (monotonic)."""
    from torch_afdep.errors import AfdepRouteError

    while True:
        torch.cuda.synchronize()
        try:
            _raise_pending(buf)
        except AfdepRouteError as e:
            return e
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)


def _body(rank, world, cfg_kw, exchanges):
    import torch_afdep
    from torch_afdep import Config
    from torch_afdep import reference as ref

    cfg = Config(**cfg_kw)
    buf = torch_afdep.Buffer(None, cfg, device="cuda")
    dev = torch.device("cuda", torch.cuda.current_device())
    is_ffn = rank < cfg.ffn_ranks
    rec = {"rank": rank, "role": "ffn" if is_ffn else "attention", "exchanges": [],
           "flags": buf.transports[0].flags}
    try:
        for i, (tokens, bucket_a, bucket_f) in enumerate(exchanges):
            # bucket_a: every Attention rank's, or a tuple by Attention index
            buckets_a = bucket_a if isinstance(bucket_a, tuple) else (bucket_a,)
            if is_ffn:  # an error when any source differed; poisoned rows when all did
                mismatch = any(b != bucket_f for b in buckets_a)
                poison = all(b != bucket_f for b in buckets_a)
            else:
                bucket_a = buckets_a[buf.role_index % len(buckets_a)]
                mismatch = bucket_a != bucket_f
            x = {"index": i}
            t0 = time.monotonic()
            if is_ffn and cfg.receive_layout == "tokens":
                received = buf.worker_receive(bucket_f)
                torch.cuda.synchronize()
                x["rows"] = int((received.src_token >= 0).sum().item())
                x["offsets_zero"] = x["rows"] == 0  # (no offsets in this layout)
                x["num_tokens"] = received.receipt.num_tokens.tolist()
                buf.worker_reply(_ffn_token_rows(cfg, received, poison=poison),
                                 received.receipt)
            elif is_ffn:
                received = buf.worker_receive(bucket_f)
                torch.cuda.synchronize()
                x["rows"] = int(received.expert_offsets[-1].item())
                x["offsets_zero"] = bool((received.expert_offsets == 0).all().item())
                x["num_tokens"] = received.receipt.num_tokens.tolist()
                buf.worker_reply(_ffn_rows(cfg, received, poison=poison), received.receipt)
            else:
                inp = ref.make_inputs(cfg, tokens, seed=100 + i, a=buf.role_index)
                buf.source_dispatch(inp.x.to(dev), inp.expert_ids.to(dev),
                                    inp.weights.to(dev), bucket_a)
                out = buf.source_collect()
                torch.cuda.synchronize()
                o = out.cpu().to(torch.float64)
                x["finite"] = bool(torch.isfinite(o).all().item())
                x["all_zero"] = bool((o == 0).all().item())
                x["shape"] = tuple(out.shape)
                if not mismatch:
                    want = ref.moe_output(cfg, inp.x, inp.expert_ids, inp.weights, _expert(cfg))
                    x["rel_err"] = ref.relative_error(o, want)
            torch.cuda.synchronize()
            x["forms"] = buf.transports[0].last_forms  # (dispatch/receive, reply/collect)
            err = _error_after(buf, t0 + TIMEOUT_S) if mismatch else None
            if not mismatch:
                torch.cuda.synchronize()
                _raise_pending(buf)  # nothing may be pending after an exchange that matched
            x["elapsed"] = time.monotonic() - t0
            x["error"] = None if err is None else str(err)
            x["error_is_value_error"] = isinstance(err, ValueError)
            if err is not None:
                _raise_pending(buf)  # reported once (cleared): nothing more pending
            rec["exchanges"].append(x)
    finally:
        buf.close()
    return rec


@pytest.mark.parametrize("case", list(CASES))
def test_bucket_mismatch_reported_on_both_roles(case):
    why = _skip_reason()
    if why:
        pytest.skip(why)
    from torch_afdep.testing import spawn_world

    env_extra, changes, exchanges = CASES[case]
    cfg_kw = {**BASE, **changes}
    hidden = cfg_kw["hidden_size"]
    devs = [0, 1] if torch.cuda.device_count() >= 2 else [0, 0]
    ffn, attn = spawn_world(_body, 2, cfg_kw, exchanges, device_ids=devs,
                            env={**ENV, **env_extra}, timeout=240.0)
    assert ffn["role"] == "ffn" and attn["role"] == "attention"
    for r in (ffn, attn):  # the case's controls reached both ranks
        assert not devices.controls_missed(r["flags"], env_extra), (r["role"], env_extra)

    for i in (0, 2):  # equal buckets: correct, and no error
        f, a = ffn["exchanges"][i], attn["exchanges"][i]
        assert f["error"] is None and a["error"] is None, (f, a)
        assert f["rows"] > 0 and f["num_tokens"] == [exchanges[i][0]], f
        assert a["finite"] and a["shape"] == (exchanges[i][0], hidden), a
        assert a["rel_err"] < 1.5e-2, a

    # the paths a case names ran (it cannot pass on another): the expert layout's dispatch as
    # units where ceil(bucket / num_sms) <= 1, else the count form that watches for units, and
    # reverted the plain count form everywhere; the token layout's collect without the barrier
    for i, (tokens, bucket_a, bucket_f) in enumerate(exchanges):
        f, a = ffn["exchanges"][i]["forms"], attn["exchanges"][i]["forms"]
        if case == "ll_experts_reverted":
            assert a[0] == "kCountSend" and f[0] == "kCountRecv", (i, a, f)
        elif case.startswith("ll_experts"):
            units = [-(-b // cfg_kw["num_sms"]) <= 1 for b in (bucket_a, bucket_f)]
            assert a[0] == ("kSmallSend" if units[0] else "kCountSend"), (i, a)
            unit_recv = "kUnitExpFan" if "fanout" in case else "kUnitExpRecv"
            assert f[0] == (unit_recv if units[1] else "kCountRecvLL"), (i, f)
        if case.startswith("early_collect"):  # (T <= num_sms; above it kSmallRecv)
            tokens_layout = cfg_kw.get("receive_layout") == "tokens"
            want = ("kEarlyCollect" if tokens_layout and tokens <= cfg_kw["num_sms"]
                    else "kSmallRecv")
            assert a[1] == want, (i, a)
        if case.startswith("raw_meta"):  # the token layout's units: ceil(bucket / S) <= 2
            units = [-(-b // cfg_kw["num_sms"]) <= 2 for b in (bucket_a, bucket_f)]
            assert a[0] == ("kRawSend" if units[0] else "kGeneric"), (i, a)
            assert f[0] == ("kRawRecv" if units[1] else "kGeneric"), (i, f)

    f, a = ffn["exchanges"][1], attn["exchanges"][1]
    _, bucket_a, bucket_f = exchanges[1]
    # the FFN took nothing from the Attention rank
    assert f["offsets_zero"] and f["rows"] == 0 and f["num_tokens"] == [0], f
    # the Attention got zeros: neither the poisoned reply rows nor exchange 1's stale rows
    assert a["finite"] and a["all_zero"] and a["shape"] == (exchanges[1][0], hidden), a
    # both ranks raised AfdepRouteError (a ValueError) naming the mismatch, within timeout_s
    for r, theirs, mine, peer in ((f, bucket_a, bucket_f, 1), (a, bucket_f, bucket_a, 0)):
        assert r["error"] is not None, r
        assert r["error_is_value_error"], r
        assert "bucket mismatch" in r["error"], r
        assert f"group rank {peer} " in r["error"], r
        assert f"with bucket {theirs} but this rank used bucket {mine}" in r["error"], r
        assert "slot 0" in r["error"], r
        assert r["elapsed"] < TIMEOUT_S, r


# AFDEP_LL_EXPERTS with two Attention ranks whose buckets differ in one exchange, so the FFN's
# receive meets both forms at once: its units receive (bucket 8) beside a count-block region
# of a mismatched source (bucket 16), then its count form (bucket 16) beside a mismatched
# source's units (bucket 8); the matched source's rows must come through exactly
MIXED = [(5, 8, 8), (3, (8, 16), 8), (3, (16, 8), 16), (5, 8, 8)]


@pytest.mark.parametrize("case", ["ll_experts_mixed_forms"])
def test_ll_experts_mixed_forms_in_one_exchange(case):
    why = _skip_reason()
    if why:
        pytest.skip(why)
    from torch_afdep.testing import spawn_world

    cfg_kw = {**BASE, "attention_ranks": 2, "num_sms": 8}  # buckets 8: units, 16: counts
    n = torch.cuda.device_count()
    ffn, a0, a1 = spawn_world(_body, 3, cfg_kw, MIXED, device_ids=[r % n for r in range(3)],
                              env={**ENV, "AFDEP_LL_EXPERTS": "1"}, timeout=240.0)
    for i in (0, 3):  # every bucket equal: both sources' rows, no error
        assert ffn["exchanges"][i]["error"] is None, ffn["exchanges"][i]
        assert ffn["exchanges"][i]["num_tokens"] == [5, 5], ffn["exchanges"][i]
        assert ffn["exchanges"][i]["forms"][0] == "kUnitExpRecv", ffn["exchanges"][i]
        for a in (a0, a1):
            assert a["exchanges"][i]["error"] is None and a["exchanges"][i]["rel_err"] < 1.5e-2
    # exchange 1: Attention index 1 (group rank 2) sent bucket 16 as a count block to the FFN's
    # units receive (bucket 8); exchange 2: index 0 (group rank 1) is the count form's match and
    # index 1 sent units (bucket 8) to the FFN's count form (bucket 16)
    for i, form, (ok, bad), bad_rank in ((1, "kUnitExpRecv", (a0, a1), 2),
                                         (2, "kCountRecvLL", (a0, a1), 2)):
        f = ffn["exchanges"][i]
        assert f["forms"][0] == form, (i, f)
        assert f["num_tokens"] == [3, 0] and f["rows"] > 0, (i, f)
        assert f["error"] is not None and f"group rank {bad_rank} " in f["error"], (i, f)
        assert ok["exchanges"][i]["error"] is None and ok["exchanges"][i]["rel_err"] < 1.5e-2
        b = bad["exchanges"][i]
        assert b["all_zero"] and b["error"] is not None and "bucket mismatch" in b["error"], b
    assert a0["exchanges"][1]["forms"][0] == "kSmallSend"
    assert a1["exchanges"][1]["forms"][0] == "kCountSend"
    assert a0["exchanges"][2]["forms"][0] == "kCountSend"
    assert a1["exchanges"][2]["forms"][0] == "kSmallSend"
