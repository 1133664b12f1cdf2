"""Hostile device inputs, their exact model and the hostile graph-replay body (it drives
``CudaTransport`` inside CUDA graphs; tests/gpu/test_hostile_graphs.py).

Hostile inputs (``hostile_inputs``), replayed inside CUDA graphs where the host cannot look
at them:

- ``bad_ids``: some entries outside ``[-1, E)`` (``>= E`` and ``< -1``, up to +-2**40 for
  int64 ids); every third replay is clean (the error must not stick);
- ``dups``: an id repeated within a token (with a different weight), sometimes all k entries
  the same expert;
- ``nonfinite``: NaN, +Inf and -Inf at random payload positions, whole NaN / Inf rows, a
  NaN payload row on a token without experts;
- ``one_expert``: every token goes to one expert (alone, or among other experts);
- ``no_route``: every entry -1;
- ``mixed``: all of the above in one exchange (the compute-sanitizer variant).

Exactness (``expected_output``): the FFN ranks reply ``bf16((x * s_e) * w)`` per row with
``s_e = 1 + e/E`` (``checks.ffn_rows``); the reply sums a token's rows in fp32 and the
combine sums the <= F reply rows in fp32. All rows of one output element are the same
payload element times positive factors in [0.1, 2.2], so the fp32 sums of at most k bf16
values are exact in any order (the values span < 24 bits): the output is predicted bit for
bit, NaN and +-Inf included. It is also compared with the fp64 reference (finite elements).

The contract (docs/contract.md) is the spec: out-of-range ids are treated as -1 (and the
Attention rank reports ``AfdepRouteError``); a duplicated id counts once (first occurrence and
its weight), as ``torch_afdep.reference.dedupe`` says.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_afdep import reference as ref
from torch_afdep.config import FFN

from . import transport_bodies as tb
from .checks import clean_ids, contract_ids, ffn_rows, scale_expert

KINDS = ("bad_ids", "dups", "nonfinite", "one_expert", "no_route", "mixed")
BAD_IDS_32 = (1 << 31) - 1, -(1 << 31), -2, -3, -1000
BAD_IDS_64 = BAD_IDS_32 + ((1 << 40), -(1 << 40))


# ---- inputs --------------------------------------------------------------------------------
def _seed(seed0: int, scenario: int, replay: int) -> int:
    return seed0 * 100_003 + scenario * 1_009 + replay + 2  # replay may be -1 (warm-up)


def hostile_inputs(cfg, a: int, tokens: int, kind: str, seed: int, id_dtype=torch.int64):
    """Attention index ``a``'s inputs of one exchange (identical on every rank for a seed).

    Returns a dict: x, ids (what the kernel gets, ``id_dtype``), w, sc (FP8 scales or None),
    bad (some id outside [-1, E)), dups (some valid id repeated within a token)."""
    if kind not in KINDS:
        raise ValueError(f"unknown hostile kind {kind!r}")
    E, k, T = cfg.num_experts, cfg.top_k, tokens
    g = torch.Generator().manual_seed(seed * 7919 + a * 104_729 + 3)
    x32 = torch.randn(T, cfg.hidden_size, generator=g)
    routing = "partial" if seed % 2 else "random"
    ids, w = ref.random_routing(cfg, T, routing, generator=g)
    ids = ids.clone()
    if kind in ("nonfinite", "mixed") and T:
        if cfg.dtype != torch.bfloat16:
            raise ValueError("nonfinite payloads need bfloat16 (float8_e4m3fn has no Inf)")
        u = torch.rand(T, cfg.hidden_size, generator=g)
        x32 = torch.where(u < 0.01, torch.full_like(x32, float("nan")), x32)
        x32 = torch.where((u >= 0.01) & (u < 0.02), torch.full_like(x32, float("inf")), x32)
        x32 = torch.where((u >= 0.02) & (u < 0.03), torch.full_like(x32, float("-inf")), x32)
        x32[0] = float("nan")  # with "partial" routing token 0 has no expert: output 0
        if T > 2:
            x32[1] = float("inf")
            x32[2] = float("nan")
    if kind == "one_expert" and T:
        hot = int(torch.randint(0, E, (1,), generator=g))
        if seed % 2 == 0:  # the only expert of every token, in one column
            ids.fill_(-1)
            ids[:, seed % k] = hot
        else:  # one of the (distinct) experts of every token
            col = torch.randint(0, k, (T,), generator=g)
            for t in range(T):
                if not bool((ids[t] == hot).any()):
                    ids[t, int(col[t])] = hot
    if kind == "no_route":
        ids.fill_(-1)
    if kind in ("dups", "mixed") and T:
        pick = torch.rand(T, generator=g)
        for t in range(T):
            valid = (ids[t] >= 0).nonzero().flatten().tolist()
            if not valid or k < 2:
                continue
            src = valid[int(torch.randint(0, len(valid), (1,), generator=g))]
            if pick[t] < 0.15:  # every entry the same expert
                ids[t] = ids[t, src]
            elif pick[t] < 0.7:
                dst = int(torch.randint(0, k - 1, (1,), generator=g))
                dst = dst if dst < src else dst + 1
                ids[t, dst] = ids[t, src]
    bad = False
    if kind in ("bad_ids", "mixed") and T and (kind == "mixed" or seed % 3 != 2):
        pool = BAD_IDS_64 if id_dtype == torch.int64 else BAD_IDS_32
        pool = pool + (E, E + 1, E + 5)
        m = torch.rand(T, k, generator=g) < 0.15
        m[T // 2, int(torch.randint(0, k, (1,), generator=g))] = True  # at least one
        choice = torch.randint(0, len(pool), (T, k), generator=g)
        vals = torch.tensor(pool, dtype=torch.int64)[choice]
        ids = torch.where(m, vals, ids)
        bad = True
    x, sc = ref.to_payload(cfg, x32)
    clean = clean_ids(cfg, ids)
    dups = bool((ref.dedupe(clean) != clean).any()) if T else False
    return {"x": x, "ids": ids.to(id_dtype), "w": w, "sc": sc, "bad": bad, "dups": dups}


def dup_tokens(cfg, ids) -> torch.Tensor:
    """[T] bool: tokens with a repeated valid id."""
    clean = clean_ids(cfg, ids)
    return (ref.dedupe(clean) != clean).any(dim=1)


# ---- the exact model -------------------------------------------------------------------------
def expected_output(cfg, x, cids, w, sc=None) -> torch.Tensor:
    """source_collect's output bit for bit (module docstring), from contract ids ``cids``."""
    T, H = x.shape
    El, E = cfg.experts_per_rank, cfg.num_experts
    xf = x.to(torch.float32)
    if sc is not None:
        xf = xf * sc.repeat_interleave(128, dim=1)
    out = torch.zeros(T, H, dtype=torch.float32)
    for f in range(cfg.ffn_ranks):
        part = torch.zeros(T, H, dtype=torch.float32)
        hit = torch.zeros(T, dtype=torch.bool)
        for j in range(cids.shape[1]):
            e = cids[:, j]
            m = (e >= f * El) & (e < (f + 1) * El)
            if not bool(m.any()):
                continue
            s = 1.0 + e.clamp(min=0).to(torch.float32) / E
            row = (xf * s[:, None] * w[:, j:j + 1]).to(torch.bfloat16).to(torch.float32)
            part[m] += row[m]
            hit |= m
        part = part.to(torch.bfloat16).to(torch.float32)
        out[hit] += part[hit]
    return out.to(torch.bfloat16)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Elementwise: equal values, or both NaN."""
    return (got == want) | (torch.isnan(got) & torch.isnan(want))


def check_attention_exact(cfg, inp, route, out, skip_dup_tokens=False) -> dict:
    """route and out of one Attention rank against the contract, bit for bit (NaN/Inf kept),
    and the finite elements against the fp64 reference. ``skip_dup_tokens``: leave tokens
    with repeated ids out (compute-sanitizer variant: memory safety only for those)."""
    x, ids, w, sc = inp["x"], inp["ids"], inp["w"], inp["sc"]
    cids = contract_ids(cfg, ids)
    T = x.shape[0]
    got_route = route.cpu()
    want_route = ref.route_mask(cfg, cids)
    o = out.cpu()
    keep = torch.ones(T, dtype=torch.bool)
    if skip_dup_tokens:
        keep = ~dup_tokens(cfg, ids)
    assert torch.equal(got_route[keep], want_route[keep]), (
        f"route {got_route[keep][:8].tolist()} != {want_route[keep][:8].tolist()}")
    want = expected_output(cfg, x, cids, w, sc)
    ok = same_bits(o[keep], want[keep])
    bad = (~ok).nonzero()
    assert bool(ok.all()), (
        f"{len(bad)} output elements differ from the exact model; first (token, col) "
        f"{bad[:4].tolist()}: got {o[keep][~ok][:4].tolist()} want {want[keep][~ok][:4].tolist()}"
        f" (dup tokens {int(dup_tokens(cfg, ids).sum())}, bad ids {inp['bad']})")
    none = keep & (want_route == 0)
    assert bool((o[none] == 0).all()), "tokens with no (valid) expert must be exactly zero"
    rel = 0.0
    if T:
        ref64 = ref.moe_output(cfg, x, cids, w, scale_expert(cfg), sc)[keep]
        fin = torch.isfinite(ref64)
        num = (o[keep].to(torch.float64) - ref64)[fin].norm().item()
        rel = num / max(ref64[fin].norm().item(), 1e-30)
        assert rel < 1e-2, f"relative error {rel} against the fp64 reference"
    return {"rel": rel, "nan": int(torch.isnan(o).sum()), "inf": int(torch.isinf(o).sum())}


def check_ffn_contract(cfg, f, o, inputs) -> None:
    """What FFN index f received, against the contract ids of every Attention rank (payload
    and scales bitwise, weights of the first occurrence, counts, receipt)."""
    tb.check_ffn(cfg, f, o, [(i["x"], contract_ids(cfg, i["ids"]), i["w"], i["sc"])
                             for i in inputs])


# ---- the graph body --------------------------------------------------------------------------
def _expect_route_error(t, expected: bool, allowed: bool = False) -> str:
    """check_error after a replay: AfdepRouteError iff ``expected`` (or when ``allowed``)."""
    from torch_afdep.errors import AfdepRouteError

    try:
        t.check_error()
    except AfdepRouteError as e:
        if expected or allowed:
            return str(e)
        raise AssertionError(f"unexpected AfdepRouteError: {e}") from e
    if expected:
        raise AssertionError("out-of-range expert ids were not reported (no AfdepRouteError)")
    return ""


def hostile_graph_body(rank, world, cfg_kw, scenarios, seed0, dup_mode="contract"):
    """For each scenario ``{"kind", "tokens" (T per Attention index), "replays", "id_dtype"}``:
    one checked eager exchange, then one exchange per rank captured in a CUDA graph and
    replayed with fresh hostile inputs copied into the captured tensors; outputs poisoned
    (NaN / 0xFF / -7) before every replay; every replay checked on every rank.

    dup_mode "contract": duplicated ids are checked against the contract (counted once);
    "memory": tokens with duplicates are left out of the data checks (sanitizer variant)."""
    cfg = tb.make_config(cfg_kw)
    dev = torch.device("cuda", torch.cuda.current_device())
    t = tb._transport(cfg, rank)
    role, idx = cfg.role_of(rank), cfg.role_index(rank)
    A = cfg.attention_ranks
    # "forms": the kernel forms each phase's captured launch ran (a test of a path asserts it)
    stats = {"role": role, "checked": 0, "route_errors": 0, "dup_route_errors": 0,
             "nonfinite_out": 0, "per_kind": {}, "forms": [set(), set()], "flags": t.flags}
    memory_only = dup_mode == "memory"
    try:
        for si, sc_def in enumerate(scenarios):
            kind, tokens, replays = sc_def["kind"], sc_def["tokens"], sc_def["replays"]
            id_dtype = getattr(torch, sc_def.get("id_dtype", "int64"))
            bucket = sc_def.get("bucket", cfg.capacity_tokens_per_rank)

            def inputs_of(i):
                return [hostile_inputs(cfg, a, tokens[a], kind, _seed(seed0, si, i), id_dtype)
                        for a in range(A)]

            def after(i, inputs, route=None, out=None, o=None):
                if role == FFN:
                    _expect_route_error(t, False)
                    if memory_only and any(inp["dups"] for inp in inputs):
                        return
                    check_ffn_contract(cfg, idx, o, inputs)
                else:
                    inp = inputs[idx]
                    msg = _expect_route_error(t, inp["bad"], allowed=inp["dups"])
                    if msg:
                        stats["route_errors"] += 1
                        stats["dup_route_errors"] += int(not inp["bad"])
                    r = check_attention_exact(cfg, inp, route, out, skip_dup_tokens=memory_only)
                    stats["nonfinite_out"] += r["nan"] + r["inf"]
                stats["checked"] += 1
                stats["per_kind"][kind] = stats["per_kind"].get(kind, 0) + 1

            if role == FFN:
                o = tb.FfnOutputs(cfg, bucket, dev)

                def step():
                    o.receive(t)
                    rows = ffn_rows(cfg, idx, o.x, o.x_scales if cfg.scale_cols else None,
                                       o.weights, o.offsets)
                    t.reply(rows, o.token_rows, o.token_index, o.num_tokens)

                o.poison()
                step()  # eager warm-up, checked like a replay
                torch.cuda.synchronize()
                after(-1, inputs_of(-1), o=o)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    step()
                for ph in (0, 1):
                    stats["forms"][ph].add(t.last_forms[ph])
                dist.barrier()
                for i in range(replays):
                    inputs = inputs_of(i)
                    o.poison()
                    g.replay()
                    torch.cuda.synchronize()
                    try:
                        after(i, inputs, o=o)
                    except AssertionError as e:
                        raise AssertionError(f"scenario {si} ({kind}, T={tokens}), replay {i}: "
                                             f"{e}") from e
            else:
                T = tokens[idx]
                first = inputs_of(-1)
                xs = first[idx]["x"].to(dev)
                ids_s = first[idx]["ids"].to(dev)
                ws = first[idx]["w"].to(dev)
                scs = None if first[idx]["sc"] is None else first[idx]["sc"].to(dev)
                route = torch.empty(T, dtype=torch.int64, device=dev)
                out = torch.empty(T, cfg.hidden_size, dtype=torch.bfloat16, device=dev)

                def poison():
                    route.fill_(-7)
                    out.fill_(float("nan"))

                def step():
                    t.dispatch(xs, ids_s, ws, scs, bucket, route)
                    t.combine(route, out)

                poison()
                step()
                torch.cuda.synchronize()
                after(-1, first, route, out)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    step()
                for ph in (0, 1):
                    stats["forms"][ph].add(t.last_forms[ph])
                dist.barrier()
                for i in range(replays):
                    inputs = inputs_of(i)
                    mine = inputs[idx]
                    xs.copy_(mine["x"])
                    ids_s.copy_(mine["ids"])
                    ws.copy_(mine["w"])
                    if scs is not None:
                        scs.copy_(mine["sc"])
                    poison()
                    g.replay()
                    torch.cuda.synchronize()
                    try:
                        after(i, inputs, route, out)
                    except AssertionError as e:
                        raise AssertionError(f"scenario {si} ({kind}, T={tokens}), replay {i}: "
                                             f"{e}") from e
            torch.cuda.synchronize()
            dist.barrier()
    finally:
        t.close()
    return stats
