"""Randomized exchange contract (tests/contract/test_fuzz.py): configurations and plans drawn
from a seed, the inputs of each exchange, the token-layout receive check, and the world body
that runs many configurations back to back (one Buffer each) and records every contract
violation with the seed and exchange that showed it.

Everything is drawn from the seed alone (``random.Random(seed)`` for the configuration and the
plan, seeded ``torch.Generator``s for tensors), so every rank of a world, and a developer
reproducing one seed, rebuild the same configuration, plan and inputs:
``describe(seed)`` prints them.
"""

from __future__ import annotations

import random
from typing import Dict, List

import torch

import torch_afdep
from torch_afdep import reference as ref

from . import checks
from .devices import rank_device, sync

#: Attention tolerances: relative error against the fp64 reference, and the elementwise
#: allclose bound (bf16 storage of the expert output), as tests/helpers/exchange_bodies.py.
TOL = 1e-2
CLOSE = 3e-2

HIDDEN = {torch.bfloat16: (8, 16, 136, 256), torch.float8_e4m3fn: (128, 256)}
ROUTINGS = ("random", "skewed", "partial")


# ---- what a seed draws -------------------------------------------------------------------
def draw_config(seed: int) -> torch_afdep.Config:
    """The configuration of ``seed``: A + F in {2, 3, 4} in a random role order, E_local in
    1..6, top_k in 1..min(8, E), BF16 or FP8 at a small hidden size, capacity 1..12,
    num_sms 1..4, either receive layout, one or two slots."""
    rng = random.Random(seed)
    world = rng.choice((2, 3, 4))
    f = rng.randint(1, world - 1)
    a = world - f
    roles = ["A"] * a + ["F"] * f
    rng.shuffle(roles)
    e_local = rng.randint(1, 6)
    e = e_local * f
    top_k = rng.randint(1, min(8, e))
    dtype = torch.float8_e4m3fn if rng.random() < 0.25 else torch.bfloat16
    return torch_afdep.Config(
        capacity_tokens_per_rank=rng.randint(1, 12), hidden_size=rng.choice(HIDDEN[dtype]),
        num_experts=e, top_k=top_k, ffn_ranks=f, attention_ranks=a, dtype=dtype,
        roles="".join(roles), num_sms=rng.randint(1, 4),
        receive_layout=rng.choice(("experts", "tokens")), num_slots=rng.choice((1, 2)),
        timeout_s=30.0)


def _tokens(rng: random.Random, bucket: int) -> int:
    """T in [0, bucket], the edges (0, 1, bucket) about half the time."""
    pick = rng.random()
    if pick < 0.15:
        return 0
    if pick < 0.3:
        return min(1, bucket)
    if pick < 0.5:
        return bucket
    return rng.randint(0, bucket)


def draw_plan(seed: int, cfg: torch_afdep.Config) -> List[Dict]:
    """3-5 exchanges of ``seed`` on ``cfg``. Each: bucket, tokens per Attention index,
    routing, dups (repeat earlier columns in some tokens), empty (all ids -1 in some tokens),
    id dtype per Attention index, slot, api per group rank ("buffer": the role API,
    "ops": afd_*), and ``overlap``: with two slots, an exchange may run in flight together with
    the next one (on the other slot): every rank issues both dispatches / receives, then
    collects / replies in its own order."""
    rng = random.Random(seed * 7919 + 1)
    plan = []
    for _ in range(rng.randint(3, 5)):
        bucket = rng.randint(1, cfg.capacity_tokens_per_rank)
        plan.append(dict(
            bucket=bucket,
            tokens=[_tokens(rng, bucket) for _ in range(cfg.attention_ranks)],
            routing=rng.choice(ROUTINGS),
            dups=rng.random() < 0.5,
            empty=rng.random() < 0.3,
            id_dtypes=[rng.choice(("int32", "int64")) for _ in range(cfg.attention_ranks)],
            slot=rng.randrange(cfg.num_slots),
            apis=[rng.choice(("buffer", "ops")) for _ in range(cfg.world_size)],
            overlap=False,
            order=rng.randrange(1 << 30),  # per-rank completion orders of an overlap group
        ))
    i = 0
    while i + 1 < len(plan):  # pair consecutive exchanges on different slots
        if plan[i]["slot"] != plan[i + 1]["slot"] and rng.random() < 0.5:
            plan[i]["overlap"] = True
            i += 2
        else:
            i += 1
    return plan


def groups(plan: List[Dict]) -> List[List[int]]:
    """The exchange indices run together: [i, i+1] for an overlap, else [i]."""
    out, i = [], 0
    while i < len(plan):
        n = 2 if plan[i]["overlap"] else 1
        out.append(list(range(i, i + n)))
        i += n
    return out


def exchange_inputs(cfg, seed: int, step: int, ex: Dict, a: int) -> ref.Inputs:
    """Attention index ``a``'s host inputs of exchange ``step`` (the same on every rank):
    ``reference.make_inputs`` with the exchange's routing, then (``dups``) tokens whose later
    columns repeat an earlier column's id (with their own, different weights: only the first
    occurrence counts) and (``empty``) tokens with every id -1."""
    t = ex["tokens"][a]
    inp = ref.make_inputs(cfg, t, ex["routing"], seed=seed * 1000 + step, a=a)
    ids = inp.expert_ids.clone()
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + a * 13 + 5)
    k = cfg.top_k
    if ex["dups"] and k > 1 and t > 0:
        for tok in (torch.rand(t, generator=g) < 0.5).nonzero().flatten().tolist():
            for _ in range(int(torch.randint(1, k, (1,), generator=g))):
                j, j2 = sorted(torch.randperm(k, generator=g)[:2].tolist())
                ids[tok, j2] = ids[tok, j]
    if ex["empty"] and t > 0:
        none = torch.rand(t, generator=g) < 0.2
        ids[none] = -1
    return ref.Inputs(inp.x, ids.to(getattr(torch, ex["id_dtypes"][a])), inp.weights,
                      inp.x_scales)


def describe(seed: int) -> str:
    """The configuration and plan of ``seed``, for a failure message or by hand."""
    cfg = draw_config(seed)
    lines = [f"seed {seed}: {short(cfg)}"]
    for i, ex in enumerate(draw_plan(seed, cfg)):
        lines.append(f"  exchange {i}: " + ", ".join(
            f"{k}={v}" for k, v in ex.items() if k != "order"))
    return "\n".join(lines)


def short(cfg) -> str:
    roles = "".join(r[0].upper() for r in cfg.role_list)
    return (f"{cfg.attention_ranks}A{cfg.ffn_ranks}F roles={roles} E={cfg.num_experts} "
            f"(E_local={cfg.experts_per_rank}) top_k={cfg.top_k} "
            f"R={cfg.rows_per_token} H={cfg.hidden_size} {str(cfg.dtype).split('.')[-1]} "
            f"C={cfg.capacity_tokens_per_rank} num_sms={cfg.num_sms} "
            f"layout={cfg.receive_layout} slots={cfg.num_slots}")


# ---- one configuration on one rank --------------------------------------------------------
def _ffn_check(cfg, f, rec, inputs, ex) -> List[str]:
    """Problems of one FFN receive (both layouts)."""
    if rec.receipt.slot != ex["slot"] or rec.receipt.bucket != ex["bucket"]:
        return [f"receipt slot/bucket {rec.receipt.slot}/{rec.receipt.bucket}"]
    if cfg.receive_layout == "tokens":
        if not isinstance(rec, torch_afdep.TokenReceived):
            return [f"token layout received a {type(rec).__name__}"]
        return checks.check_token_rows(cfg, f, rec, inputs, ex["bucket"])
    try:
        checks.check_received(cfg, f, rec, inputs, ex["bucket"])
    except AssertionError as e:
        return [str(e)]
    if rec.x_scales is not None and cfg.scale_cols == 0:
        return ["x_scales is not None for a BF16 payload"]
    return []


def _rows_received(cfg, rec) -> int:
    if cfg.receive_layout == "tokens":
        return int(rec.num_tokens.sum())
    return int(rec.expert_offsets[-1])


def run_config(seed: int, device) -> Dict:
    """Run ``seed``'s configuration and plan on this rank (one Buffer, closed after).

    Returns {"seed", "role", "problems": [(exchange, text)], "rows": routed rows or tokens
    (FFN) / output tokens (Attention)}. A contract violation seen by a check is recorded (the
    exchange still completes, so peers stay in step); any exception is re-raised naming the
    seed and exchange."""
    dev = rank_device(device)
    cfg = draw_config(seed)
    plan = draw_plan(seed, cfg)
    buf = torch_afdep.Buffer(None, cfg, device=dev)
    me = buf.rank
    res = {"seed": seed, "role": buf.role, "problems": [], "rows": 0}
    kw = dict(group=buf.group_name, buffer_id=buf.buffer_id)
    previous = {}  # slot -> this Attention rank's inputs of the slot's previous exchange
    step = None
    try:
        for grp in groups(plan):
            inputs = {i: [exchange_inputs(cfg, seed, i, plan[i], a)
                          for a in range(cfg.attention_ranks)] for i in grp}
            # the completion order of this rank (an overlap group: its own permutation)
            done_order = list(grp)
            random.Random(plan[grp[0]]["order"] + me).shuffle(done_order)
            if buf.role == "attention":
                a = buf.role_index
                routes = {}
                for step in grp:
                    ex = plan[step]
                    x, ids, w, s = (None if v is None else v.to(dev) for v in inputs[step][a])
                    if ex["apis"][me] == "buffer":
                        buf.source_dispatch(x, ids, w, ex["bucket"], s, slot=ex["slot"])
                    else:
                        routes[step] = torch_afdep.afd_dispatch(
                            x, ids, w, bucket=ex["bucket"], x_scales=s, slot=ex["slot"], **kw)
                for step in done_order:
                    ex = plan[step]
                    if ex["apis"][me] == "buffer":
                        out, route = buf.source_collect(slot=ex["slot"]), None
                    else:
                        route = routes.pop(step)
                        out = torch_afdep.afd_combine(route, slot=ex["slot"], **kw)
                    sync(dev)
                    inp = inputs[step][a]
                    try:
                        assert not out.requires_grad, "output requires grad"
                        checks.check_attention(cfg, inp, out, route, expert=checks.tanh_expert,
                                               tol=TOL, close=CLOSE,
                                               previous=previous.get(ex["slot"]))
                    except AssertionError as e:
                        res["problems"].append((step, f"Attention {a} (rank {me}): {e}"))
                    previous[ex["slot"]] = inp
                    res["rows"] += out.shape[0]
            else:
                f = buf.role_index
                open_ = {}
                for step in grp:
                    ex = plan[step]
                    if ex["apis"][me] == "buffer":
                        rec = buf.worker_receive(ex["bucket"], slot=ex["slot"])
                    else:
                        rec = torch_afdep.afd_receive(bucket=ex["bucket"], slot=ex["slot"],
                                                      **kw)
                    for p in _ffn_check(cfg, f, rec, inputs[step], ex):
                        res["problems"].append((step, f"FFN {f} (rank {me}) receive: {p}"))
                    open_[step] = rec
                for step in done_order:
                    ex = plan[step]
                    rec = open_.pop(step)
                    if len(grp) > 1:  # the other slot's receive left this one untouched
                        for p in _ffn_check(cfg, f, rec, inputs[step], ex):
                            res["problems"].append(
                                (step, f"FFN {f} (rank {me}) after the other slot: {p}"))
                    if cfg.receive_layout == "tokens":
                        rows = checks.token_moe_rows(cfg, f, rec)
                    else:  # rows past expert_offsets[-1] are NaN: the reply ignores them
                        rows = checks.ffn_compute(cfg, f, rec)
                    res["rows"] += _rows_received(cfg, rec)
                    if ex["apis"][me] == "buffer":
                        buf.worker_reply(rows, rec.receipt)
                    else:
                        torch_afdep.afd_reply(rows, rec.receipt, **kw)
                    sync(dev)
            for s in range(cfg.num_slots):
                if buf.phase(s) != "idle":
                    res["problems"].append((grp[-1], f"rank {me}: slot {s} is "
                                                     f"{buf.phase(s)!r} after the exchanges"))
        step = None
    except Exception as e:
        where = f"exchange {step}" if step is not None else "a Buffer call"
        raise RuntimeError(f"fuzz seed {seed}, {where}, rank {me} ({buf.role}): "
                           f"{type(e).__name__}: {e}\n{describe(seed)}") from e
    finally:
        try:
            buf.close()
        except Exception:
            pass
    return res


def fuzz_world(rank: int, world: int, seeds: List[int], device: str) -> List[Dict]:
    """Every seed's configuration (all of world size ``world``), one after another."""
    torch.set_num_threads(1)  # several ranks share few cores
    out = []
    for seed in seeds:
        assert draw_config(seed).world_size == world, seed
        out.append(run_config(seed, device))
    sync(rank_device(device))
    return out
