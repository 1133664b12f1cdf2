"""Aggregation of the per-rank records into result rows, and the Markdown / PNG writers.

Record layout (what ``benchmarks.run`` collects): ``raw`` is a list of world entries

    {"arm", "layout", "repeat", "status": "ran" | "skipped" | "failed", "error",
     "ranks": {group rank: {"meta": {...}, "cells": {cell index: record}}}}

and ``plan`` names the layouts (with the GPU of every group rank), the receive layouts and
the cells (each with its ``receive_layout``). Every result row carries ``receive_layout``:
"experts" or "tokens", or "any" for ``nccl_bare``, which does not depend on it and is timed
once per cell (in the first receive layout's cells).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch_afdep import env
from torch_afdep.config import FP8_BLOCK

from . import common, stats

SCHEMA = "torch_afdep.benchmarks/1"
ARM_LABELS = {"afdep": "afdep", "afdep_alt": "afdep_alt (afdep with --alt-env)",
              "symmetric": "symmetric (AFDEP_SYMMETRIC=1)",
              "nccl": "nccl (all_to_all_single + torch ops)",
              "nccl_bare": "nccl_bare (bare all_to_all_single, reference)"}
COMPARISONS = (("afdep", "symmetric"), ("afdep", "nccl"), ("afdep_alt", "afdep"))
#: Arms compared across receive layouts (tokens vs experts, same cell, paired by repeat).
CROSS_LAYOUT_ARMS = ("afdep", "afdep_alt", "symmetric", "nccl")
#: Arms that run the torch_afdep kernels.
KERNEL_ARMS = ("afdep", "afdep_alt", "symmetric")
#: The receive_layout of nccl_bare rows (two bare all-to-alls: no layout).
BARE_LAYOUT = "any"


# ---- receive layouts ----------------------------------------------------------------------
def receive_layouts(plan: Dict[str, Any]) -> List[str]:
    """The plan's receive layouts in run order (plans without the field: experts only)."""
    return list(plan.get("receive_layouts") or ["experts"])


def cell_layout(cell: Dict[str, Any]) -> str:
    return cell.get("receive_layout", "experts")


def arm_cells(arm: str, plan: Dict[str, Any]) -> List[int]:
    """Indices of the plan's cells that ``arm`` runs: every cell, except that nccl_bare runs
    the first receive layout's cells only (it is the same two all-to-alls in every layout)."""
    cells = plan["cells"]
    if arm != "nccl_bare":
        return list(range(len(cells)))
    first = receive_layouts(plan)[0]
    return [i for i, c in enumerate(cells) if cell_layout(c) == first]


def row_layout(arm: str, cell: Dict[str, Any]) -> str:
    """The receive_layout a result row of ``arm`` for ``cell`` records."""
    return BARE_LAYOUT if arm == "nccl_bare" else cell_layout(cell)


# ---- layouts ------------------------------------------------------------------------------
def layout_ranks(attention: int, ffn: int) -> Tuple[Tuple[str, ...], List[int]]:
    """Default roles (FFN ranks first) and group ranks of (A, F)."""
    roles = ("ffn",) * ffn + ("attention",) * attention
    return roles, list(range(attention + ffn))


def gpu_of_ranks(world: int, gpus: int) -> List[int]:
    """Round-robin: group rank r on GPU r % gpus."""
    return [r % max(gpus, 1) for r in range(world)]


# ---- bytes and floors ---------------------------------------------------------------------
def dispatch_row_bytes(hidden: int, dtype: str) -> int:
    """Payload bytes of one dispatched token row (FP8 adds its float32 scales)."""
    if dtype == "fp8":
        return hidden + 4 * (hidden // FP8_BLOCK)
    return 2 * hidden


def link_bytes(reach: Dict[int, Sequence[int]], attention_ranks: Sequence[int],
               ffn_ranks: Sequence[int], gpu_of: Sequence[int], row_dispatch: int,
               row_combine: int) -> Tuple[int, int]:
    """(bytes on the busiest GPU->GPU link in dispatch, same in combine).

    reach[a] = tokens Attention index a sends to each FFN index; pairs on the same GPU do
    not cross a link and are left out."""
    disp: Dict[Tuple[int, int], int] = {}
    comb: Dict[Tuple[int, int], int] = {}
    for a, ra in enumerate(attention_ranks):
        tokens = reach.get(a)
        if tokens is None:
            continue
        for f, rf in enumerate(ffn_ranks):
            ga, gf = gpu_of[ra], gpu_of[rf]
            if ga == gf or f >= len(tokens):
                continue
            disp[(ga, gf)] = disp.get((ga, gf), 0) + int(tokens[f]) * row_dispatch
            comb[(gf, ga)] = comb.get((gf, ga), 0) + int(tokens[f]) * row_combine
    return max(disp.values(), default=0), max(comb.values(), default=0)


def floor_us(dispatch_bytes: int, combine_bytes: int, ceiling_gbps: Optional[float]
             ) -> Optional[float]:
    """Time to move the busiest link's bytes each way at the peer-copy ceiling (the data
    term; ``add_flag_floor`` adds the measured flag round trip)."""
    if not ceiling_gbps or (dispatch_bytes + combine_bytes) == 0:
        return None
    return (dispatch_bytes + combine_bytes) / (ceiling_gbps * 1e9) * 1e6


def add_flag_floor(rows: List[Dict[str, Any]]) -> None:
    """Every row with a data floor gets ``floor_with_flag_us``: plus the flag round trip
    measured in its layout's afdep worlds (median over them; one dispatch signal and one
    combine signal cross the link per exchange)."""
    rtt = _rtts(rows)
    for r in rows:
        if r["layout"] in rtt and r.get("floor_us") is not None:
            r["floor_with_flag_us"] = r["floor_us"] + rtt[r["layout"]]


def _rtts(rows: List[Dict[str, Any]]) -> Dict[str, float]:
    """Per layout, the median of its rows' measured flag round trips."""
    out: Dict[str, List[float]] = {}
    for r in rows:
        if r.get("flag_rtt_us") is not None:
            out.setdefault(r["layout"], []).append(r["flag_rtt_us"])
    return {k: stats.median(v) for k, v in out.items()}


def achieved_gbps(dispatch_bytes: int, combine_bytes: int, latency_us: Optional[float]
                  ) -> Optional[float]:
    if not latency_us or (dispatch_bytes + combine_bytes) == 0:
        return None
    return (dispatch_bytes + combine_bytes) / (latency_us * 1e-6) / 1e9


# ---- aggregation --------------------------------------------------------------------------
def _short(err: Optional[str], n: int = 400) -> Optional[str]:
    if err is None:
        return None
    err = str(err)
    return err if len(err) <= n else err[:n] + " ..."


def repeat_latency(world: Dict[str, Any], index: int, attention_ranks: Sequence[int],
                   all_ranks: Sequence[int]) -> Tuple[Optional[float], str, Optional[str],
                                                       Dict[int, Optional[float]]]:
    """(latency of this repeat = max over Attention ranks of their medians, status, error,
    per-rank medians) for cell ``index`` of one world."""
    if world.get("status") == "skipped":
        return None, "skipped", world.get("error"), {}
    ranks = world.get("ranks", {})
    per_rank: Dict[int, Optional[float]] = {}
    status, error = "ok", None
    for r in all_ranks:
        rec = ranks.get(r, {}).get("cells", {}).get(index)
        if rec is None:
            status = "failed"
            error = error or world.get("error") or f"rank {r} left no record for this cell"
            continue
        st = rec.get("status", "failed")
        if st != "ok" and status == "ok":
            status, error = st, rec.get("error")
        if r in attention_ranks:
            per_rank[r] = rec.get("median_us")
    if status != "ok":
        return None, status, error, per_rank
    lat = stats.max_over_ranks(per_rank)
    if lat is None:
        return None, "failed", "no timing from an Attention rank", per_rank
    return lat, "ok", None, per_rank


def _world(raw, arm, layout, repeat):
    for w in raw:
        if w["arm"] == arm and w["layout"] == layout and w["repeat"] == repeat:
            return w
    return None


def _cell_records(world, index, ranks):
    if not world:
        return {}
    return {r: world.get("ranks", {}).get(r, {}).get("cells", {}).get(index) for r in ranks}


def aggregate(raw: List[Dict[str, Any]], plan: Dict[str, Any],
              ceiling_gbps: Optional[float]) -> Tuple[List[Dict], List[Dict]]:
    """(results rows, comparison rows)."""
    rows: List[Dict[str, Any]] = []
    comps: List[Dict[str, Any]] = []
    repeats = plan["repeats"]
    runs = {arm: set(arm_cells(arm, plan)) for arm in plan["arms"]}
    for lay in plan["layouts"]:
        name, A, F = lay["name"], lay["attention"], lay["ffn"]
        roles, ranks = layout_ranks(A, F)
        att = [r for r in ranks if roles[r] == "attention"]
        ffn = [r for r in ranks if roles[r] == "ffn"]
        gpu_of = lay["gpus"]
        for index, cell in enumerate(plan["cells"]):
            by_arm: Dict[str, Dict[str, Any]] = {}
            for arm in plan["arms"]:
                if index not in runs[arm]:
                    continue
                lats, sts, errs = [], [], []
                per_rank_all = []
                extra: Dict[str, Any] = {}
                for rep in range(repeats):
                    w = _world(raw, arm, name, rep)
                    if w is None:
                        lats.append(None)
                        sts.append("not_run")
                        errs.append("not run")
                        per_rank_all.append({})
                        continue
                    lat, st, err, pr = repeat_latency(w, index, att, ranks)
                    lats.append(lat)
                    sts.append(st)
                    if err:
                        errs.append(_short(err))
                    per_rank_all.append({str(k): v for k, v in pr.items()})
                    recs = _cell_records(w, index, ranks)
                    _collect_extra(extra, recs, roles, rep)
                    for rec in recs.values():
                        if rec and rec.get("graph") is not None:
                            extra["graph"] = bool(rec["graph"])
                ok = [x for x in lats if x is not None]
                status = "ok" if len(ok) == repeats else ("partial" if ok else
                                                          next((s for s in sts if s != "ok"),
                                                               "failed"))
                row = {
                    "arm": arm, "layout": name, "receive_layout": row_layout(arm, cell),
                    "attention_ranks": A, "ffn_ranks": F,
                    "hidden": cell["hidden"], "dtype": cell["dtype"],
                    "routing": cell["routing"], "tokens": cell["tokens"],
                    "bucket": cell["tokens"], "experts": plan["experts"],
                    "top_k": plan["top_k"], "capacity": plan["capacity"],
                    "latency_us": stats.median(ok),
                    "repeats_us": lats,
                    # slowest / fastest repeat (fresh worlds): how far one world's result
                    # can be from another's; None with fewer than 2 repeats measured
                    "repeat_spread": (max(ok) / min(ok) if len(ok) >= 2 and min(ok) > 0
                                      else None),
                    "repeat_status": sts,
                    "per_rank_median_us": per_rank_all,
                    "status": status,
                    "errors": sorted(set(e for e in errs if e)),
                    "sms": plan["sms"] if arm in KERNEL_ARMS else None,
                }
                reach = extra.pop("reach", {})
                rtts = extra.pop("flag_rtt_runs", None)
                if rtts:
                    row["flag_rtt_us"] = stats.median(rtts)
                if arm == "nccl_bare":
                    d_row = dispatch_row_bytes(cell["hidden"], cell["dtype"])
                    d_row -= 4 * (cell["hidden"] // 128) if cell["dtype"] == "fp8" else 0
                else:
                    d_row = dispatch_row_bytes(cell["hidden"], cell["dtype"])
                if reach:
                    db, cb = link_bytes(reach, att, ffn, gpu_of, d_row, 2 * cell["hidden"])
                    row["link_bytes_dispatch"] = db
                    row["link_bytes_combine"] = cb
                    row["floor_us"] = floor_us(db, cb, ceiling_gbps)
                    row["achieved_GBps"] = achieved_gbps(db, cb, row["latency_us"])
                row.update(extra)
                rows.append(row)
                by_arm[arm] = row
            for a_arm, b_arm in COMPARISONS:
                if a_arm in by_arm and b_arm in by_arm:
                    a, b = by_arm[a_arm]["repeats_us"], by_arm[b_arm]["repeats_us"]
                    pct = stats.paired_change_pct(a, b)
                    comp = {"layout": name, "receive_layout": cell_layout(cell),
                            "hidden": cell["hidden"], "dtype": cell["dtype"],
                            "routing": cell["routing"], "tokens": cell["tokens"],
                            "arm": a_arm, "baseline": b_arm,
                            "baseline_layout": cell_layout(cell), "change_pct": pct,
                            "wins": stats.wins(a, b),
                            "pairs": len(stats.paired_ratios(a, b))}
                    comps.append(comp)
                    by_arm[a_arm][f"vs_{b_arm}_pct"] = pct
    comps += cross_layout_comparisons(rows)
    add_flag_floor(rows)
    return rows, comps


def _row_key(r: Dict[str, Any], receive_layout: str, arm: str) -> Tuple:
    return (r["layout"], receive_layout, r["hidden"], r["dtype"], r["routing"], r["tokens"],
            arm)


def cross_layout_comparisons(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per arm of ``CROSS_LAYOUT_ARMS`` and cell, the token layout against the expert layout
    of the same run (paired by repeat: both ran in the same world). Sets the token row's
    ``vs_experts_pct`` and ``tokens_over_experts`` (geometric mean of the paired ratios)."""
    index = {_row_key(r, r["receive_layout"], r["arm"]): r for r in rows}
    comps = []
    for r in rows:
        if r["receive_layout"] != "tokens" or r["arm"] not in CROSS_LAYOUT_ARMS:
            continue
        base = index.get(_row_key(r, "experts", r["arm"]))
        if base is None:
            continue
        a, b = r["repeats_us"], base["repeats_us"]
        pct = stats.paired_change_pct(a, b)
        comps.append({"layout": r["layout"], "receive_layout": "tokens", "hidden": r["hidden"],
                      "dtype": r["dtype"], "routing": r["routing"], "tokens": r["tokens"],
                      "arm": r["arm"], "baseline": r["arm"], "baseline_layout": "experts",
                      "change_pct": pct, "wins": stats.wins(a, b),
                      "pairs": len(stats.paired_ratios(a, b))})
        r["vs_experts_pct"] = pct
        r["tokens_over_experts"] = stats.geomean(stats.paired_ratios(a, b))
    return comps


def find_comparison(comps: List[Dict[str, Any]], layout: str, hidden: int, dtype: str,
                    routing: str, tokens: int, arm: str, receive_layout: str, baseline: str,
                    baseline_layout: str) -> Optional[Dict[str, Any]]:
    for c in comps:
        if (c["layout"], c["hidden"], c["dtype"], c["routing"], c["tokens"], c["arm"],
                c.get("receive_layout", "experts"), c["baseline"],
                c.get("baseline_layout", c.get("receive_layout", "experts"))) == (
                layout, hidden, dtype, routing, tokens, arm, receive_layout, baseline,
                baseline_layout):
            return c
    return None


def targets(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The issue's two numbers per (layout, hidden, dtype, routing), afdep arm: the token
    layout's round trip at the smallest T (T=1 in the default grid), with the symmetric token
    arm and the expert layout beside it, and the token / expert ratio at the largest T
    (T=2,048) of the same run (geometric mean of the per-repeat ratios, wins = repeats where
    tokens was faster)."""
    index = {_row_key(r, r["receive_layout"], r["arm"]): r for r in rows}
    out = []
    for (layout, hidden, dtype, routing) in groups_of(rows):
        ts = sorted({r["tokens"] for r in rows if r["arm"] == "afdep"
                     and r["receive_layout"] == "tokens" and r["layout"] == layout
                     and r["hidden"] == hidden and r["dtype"] == dtype
                     and r["routing"] == routing})
        if not ts:
            continue
        lo, hi = ts[0], ts[-1]

        def get(t, rl, arm="afdep"):
            return index.get((layout, rl, hidden, dtype, routing, t, arm)) or {}

        tok_lo, sym_lo, exp_lo = get(lo, "tokens"), get(lo, "tokens", "symmetric"), \
            get(lo, "experts")
        tok_hi, exp_hi = get(hi, "tokens"), get(hi, "experts")
        pairs = stats.paired_ratios(tok_hi.get("repeats_us") or [],
                                    exp_hi.get("repeats_us") or [])
        out.append({
            "layout": layout, "hidden": hidden, "dtype": dtype, "routing": routing,
            "small_tokens": lo, "tokens_small_us": tok_lo.get("latency_us"),
            "symmetric_tokens_small_us": sym_lo.get("latency_us"),
            "tokens_small_vs_symmetric_pct": tok_lo.get("vs_symmetric_pct"),
            "experts_small_us": exp_lo.get("latency_us"),
            "large_tokens": hi, "tokens_large_us": tok_hi.get("latency_us"),
            "experts_large_us": exp_hi.get("latency_us"),
            "tokens_over_experts_large": stats.geomean(pairs) if pairs else None,
            "tokens_wins_large": (stats.wins(tok_hi["repeats_us"], exp_hi["repeats_us"])
                                  if pairs else None)})
    return out


def _collect_extra(extra: Dict[str, Any], recs: Dict[int, Optional[Dict]], roles, rep: int):
    """Registered bytes per role, control flags, kernel forms per role, correctness errors and
    reach (first repeat that has them)."""
    reach = extra.setdefault("reach", {})
    a_idx = {r: i for i, r in enumerate([r for r, ro in enumerate(roles) if ro == "attention"])}
    for r, rec in recs.items():
        if not rec:
            continue
        role = roles[r]
        if rec.get("registered_bytes") is not None:
            extra.setdefault("registered_bytes", {}).setdefault(role, rec["registered_bytes"])
        if rec.get("union_bytes") is not None:
            extra.setdefault("union_bytes", rec["union_bytes"])
        if rec.get("flags") is not None:
            extra.setdefault("afdep_flags", rec["flags"])
        if rec.get("kernel_forms") is not None:  # [dispatch or receive, collect or reply]
            extra.setdefault("kernel_forms", {}).setdefault(role, rec["kernel_forms"])
        if rec.get("flag_rtt_us") is not None:  # measured once per world (initiator only)
            extra.setdefault("flag_rtt_runs", []).append(rec["flag_rtt_us"])
        for k in ("eager_rel_err", "graph_rel_err"):
            if rec.get(k) is not None:
                extra[f"max_{k}"] = max(extra.get(f"max_{k}", 0.0), rec[k])
        if role == "attention" and rec.get("reach_tokens") is not None and r in a_idx:
            if a_idx[r] not in reach:
                reach[a_idx[r]] = rec["reach_tokens"]


def registered_summary(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Registered bytes per role against the union layout, per (arm, layout, hidden, dtype)."""
    seen = {}
    for r in rows:
        if r["arm"] not in KERNEL_ARMS or "registered_bytes" not in r:
            continue
        key = (r["arm"], r["layout"], r["receive_layout"], r["hidden"], r["dtype"])
        if key in seen:
            continue
        u = r.get("union_bytes")
        ent = {"arm": r["arm"], "layout": r["layout"], "receive_layout": r["receive_layout"],
               "hidden": r["hidden"],
               "dtype": r["dtype"], "capacity": r["capacity"], "union_bytes": u,
               "flags": r.get("afdep_flags")}
        for role, b in r["registered_bytes"].items():
            ent[f"{role}_bytes"] = b
            ent[f"{role}_vs_union"] = (b / u) if (u and b is not None) else None
        seen[key] = ent
    return list(seen.values())


# ---- writers ------------------------------------------------------------------------------
def _fmt_us(v: Optional[float]) -> str:
    if v is None:
        return "—"
    return f"{v:,.1f}"


def _fmt_pct(v: Optional[float]) -> str:
    if v is None:
        return "—"
    s = f"{v:+.1f}%"
    return s.replace("-", "−")


def _fmt_bytes(b: Optional[int]) -> str:
    if b is None:
        return "—"
    return f"{b / 2**20:,.1f} MiB"


def groups_of(rows: List[Dict[str, Any]]):
    """[(layout, hidden, dtype, routing), ...] in order of first appearance."""
    out = []
    for r in rows:
        k = (r["layout"], r["hidden"], r["dtype"], r["routing"])
        if k not in out:
            out.append(k)
    return out


def markdown(doc: Dict[str, Any]) -> str:
    rows, comps = doc["results"], doc.get("comparisons", [])
    m = doc.get("machine", {})
    probe = doc.get("probe") or {}
    lines = [f"# torch_afdep: AFD round trip, {m.get('name', '?')}", ""]
    lines.append(f"- commit `{doc.get('commit')}`, {doc.get('started')}; driver "
                 f"{m.get('driver')}; torch {doc.get('env', {}).get('torch')}, CUDA "
                 f"{doc.get('env', {}).get('cuda')}, NCCL {doc.get('env', {}).get('nccl')}")
    a = doc.get("args", {})
    lines.append(f"- E{a.get('experts')} / top-{a.get('top_k')}, capacity "
                 f"{a.get('capacity')}, bucket = T, {a.get('sms')} transport SMs (afdep arms; "
                 f"the NCCL arms use NCCL's own channel choice); {a.get('repeats')} repeats, "
                 f"{a.get('replays')} timed replays each after {a.get('warmup')} warm-up "
                 f"replays; Attention ranks wait {a.get('attention_delay_us', 0):g} µs after "
                 f"each alignment before timing"
                 + (f", queue-ahead {a.get('queue_ahead_us'):g} µs" if a.get("queue_ahead_us")
                    else ""))
    ev = doc.get("env", {}).get("vars") or {}
    afdep_how = [f"transport {env.get('AFDEP_TRANSPORT', ev)}"]
    if a.get("zero_copy"):
        afdep_how.append("zero-copy collect where one FFN rank")
    if a.get("afdep_env"):
        afdep_how.append("afdep arm with " + " ".join(a["afdep_env"]))
    if a.get("alt_env"):
        afdep_how.append("afdep_alt arm: the afdep arm with " + " ".join(a["alt_env"]))
    if env.get("AFDEP_DEBUG", ev):
        afdep_how.append(f"AFDEP_DEBUG={ev['AFDEP_DEBUG']} (diagnostic setting: not a result "
                         "of record)")
    lines.append("- afdep arms: " + ", ".join(afdep_how))
    lines.append("- Communication only: one dispatch + combine round trip under CUDA graphs, "
                 "µs, lower is better; per repeat the MAX over Attention ranks of each rank's "
                 "median replay; latency = median over repeats (one fresh process group per "
                 "arm per repeat, arms interleaved); % = geometric mean of per-repeat paired "
                 "ratios, (wins/pairs) in parentheses.")
    ceil = probe.get("peer_copy_ceiling_GBps")
    pc = probe.get("peer_copy_GBps") or {}
    rtt = _rtts(rows)
    if pc:
        lines.append("- Peer-copy ceiling (cudaMemcpy D2D, "
                     f"{_fmt_bytes(probe.get('peer_copy_bytes'))}): "
                     + ", ".join(f"{k}: {v:,.1f} GB/s" for k, v in pc.items())
                     + f"; floor = busiest link's bytes each way / {ceil:,.1f} GB/s"
                     + (", plus the flag round trip measured by a one-thread ping-pong kernel "
                        "between the first Attention and the first FFN rank ("
                        + ", ".join(f"{lay} {v:.2f} µs" for lay, v in rtt.items())
                        + ", median over afdep worlds)." if rtt else
                        "; no flag round-trip term (not measured in this run)."))
    else:
        lines.append("- Peer-copy ceiling: not measured (fewer than 2 GPUs), so no floor.")
    lines.append("")
    reg = registered_summary(rows)
    if reg:
        lines += ["## Registered buffer bytes per role", "",
                  "| arm | layout | receive layout | hidden | dtype | FFN rank | "
                  "Attention rank | union | FFN / union | Attention / union |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for e in reg:
            lines.append(
                f"| {e['arm']} | {e['layout']} | {e.get('receive_layout', 'experts')} | "
                f"{e['hidden']} | {e['dtype']} | "
                f"{_fmt_bytes(e.get('ffn_bytes'))} | {_fmt_bytes(e.get('attention_bytes'))} | "
                f"{_fmt_bytes(e.get('union_bytes'))} | {_fmt_ratio(e.get('ffn_vs_union'))} | "
                f"{_fmt_ratio(e.get('attention_vs_union'))} |")
        lines.append("")
    lines += _targets_table(doc.get("targets") or targets(rows))
    arms = present_arms(rows)
    for (layout, hidden, dtype, routing) in groups_of(rows):
        for rl in present_layouts(rows):
            lines += _group_table(rows, comps, arms, layout, hidden, dtype, routing, rl)
    notes = doc.get("notes") or []
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


LAYOUT_TITLES = {"experts": "expert layout", "tokens": "token layout"}


def present_layouts(rows: List[Dict[str, Any]]) -> List[str]:
    """Receive layouts that have rows (nccl_bare's "any" aside), experts first."""
    have = {r.get("receive_layout", "experts") for r in rows} - {BARE_LAYOUT}
    return [x for x in ("experts", "tokens") if x in have] + sorted(have - {"experts",
                                                                            "tokens"})


def _targets_table(tg: List[Dict[str, Any]]) -> List[str]:
    """The token layout's two target numbers per group (``targets``), afdep arm."""
    if not tg:
        return []
    lines = ["## Token layout: the targets (afdep arm, this run)", "",
             "| layout | hidden | dtype | routing | tokens, µs (small T) | vs symmetric tokens "
             "| experts, µs (small T) | tokens / experts (large T) | tokens faster |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in tg:
        ratio = e.get("tokens_over_experts_large")
        lines.append(
            f"| {e['layout']} | {e['hidden']:,} | {e['dtype'].upper()} | {e['routing']} | "
            f"T={e['small_tokens']:,}: {_fmt_us(e.get('tokens_small_us'))} | "
            f"{_fmt_pct(e.get('tokens_small_vs_symmetric_pct'))} | "
            f"{_fmt_us(e.get('experts_small_us'))} | "
            f"T={e['large_tokens']:,}: {'—' if ratio is None else f'{ratio:.3f}×'} | "
            f"{e.get('tokens_wins_large') or '—'} |")
    lines += ["", "Small T is the smallest T of the grid (T=1 by default), large T the largest "
              "(T=2,048); tokens / experts is the geometric mean of the per-repeat ratios "
              "(both layouts ran in the same world of each repeat).", ""]
    return lines


def _group_table(rows, comps, arms, layout, hidden, dtype, routing, rl) -> List[str]:
    """One table: T columns x arms of receive layout ``rl`` (nccl_bare's layout-free row
    too), the same-layout comparisons, and for the token layout the paired change against
    the expert layout of the same arm."""
    sub = [r for r in rows if (r["layout"], r["hidden"], r["dtype"], r["routing"]) ==
           (layout, hidden, dtype, routing)
           and r.get("receive_layout", "experts") in (rl, BARE_LAYOUT)]
    if not any(r.get("receive_layout", "experts") == rl for r in sub):
        return []
    ts = sorted({r["tokens"] for r in sub})
    lines = [f"## {layout}, hidden {hidden:,}, {dtype.upper()}, {routing} routing, "
             f"{LAYOUT_TITLES.get(rl, rl)}", ""]
    lines.append("| | " + " | ".join(f"T={t:,}" for t in ts) + " |")
    lines.append("|---|" + "---|" * len(ts))
    get = {(r["arm"], r["tokens"]): r for r in sub}
    for arm in arms:
        if not any(r["arm"] == arm for r in sub):
            continue
        cells = []
        for t in ts:
            r = get.get((arm, t))
            if r is None:
                cells.append("—")
            elif r["latency_us"] is None:
                cells.append(r["status"])
            else:
                s = _fmt_us(r["latency_us"])
                cells.append(s + ("*" if r["status"] != "ok" else ""))
        eager = any(r["arm"] == arm and r.get("graph") is False for r in sub)
        label = f"{arm} (eager, no graph)" if eager else arm
        if arm == "nccl_bare":
            label += " (any layout)"
        lines.append(f"| {label}, µs | " + " | ".join(cells) + " |")
    spread_arms = [x for x in KERNEL_ARMS if x in arms]
    if spread_arms and any((get.get((x, t)) or {}).get("repeat_spread") is not None
                           for x in spread_arms for t in ts):
        lines.append(f"| repeat spread (slowest / fastest), {' / '.join(spread_arms)} | "
                     + " | ".join(" / ".join(
                         _fmt_spread((get.get((x, t)) or {}).get("repeat_spread"))
                         for x in spread_arms) for t in ts) + " |")
    pairs = [(a, rl, b, rl, f"{a} vs {b}") for a, b in COMPARISONS]
    if rl == "tokens":
        pairs += [(a, "tokens", a, "experts", f"{a} tokens vs experts")
                  for a in CROSS_LAYOUT_ARMS]
    for a_arm, a_rl, b_arm, b_rl, label in pairs:
        found = [find_comparison(comps, layout, hidden, dtype, routing, t, a_arm, a_rl, b_arm,
                                 b_rl) for t in ts]
        if all(c is None for c in found):
            continue
        cells = ["—" if c is None or c["change_pct"] is None else
                 f"{_fmt_pct(c['change_pct'])} ({c['wins']})" for c in found]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    ref = get_any(get, ts, ("afdep", "symmetric", "nccl"))
    if any(ref.get(t, {}).get("floor_us") is not None for t in ts):
        lines.append("| data floor at ceiling, µs | " + " | ".join(
            _fmt_us(ref.get(t, {}).get("floor_us")) for t in ts) + " |")
        if any(ref.get(t, {}).get("floor_with_flag_us") is not None for t in ts):
            lines.append("| floor + flag round trip, µs | " + " | ".join(
                _fmt_us(ref.get(t, {}).get("floor_with_flag_us")) for t in ts) + " |")
        for arm in ("afdep", "nccl"):
            if arm in arms:
                lines.append(f"| {arm} achieved GB/s | " + " | ".join(
                    _fmt_gbps(get.get((arm, t), {}).get("achieved_GBps")) for t in ts)
                    + " |")
    lines.append("")
    bad = [r for r in sub if r["status"] != "ok"]
    for r in bad:
        err = "; ".join(r["errors"])[:300] if r["errors"] else ""
        lines.append(f"- {r['arm']} T={r['tokens']}: {r['status']} "
                     f"({', '.join(r['repeat_status'])}) {err}".rstrip())
    if bad:
        lines.append("")
    return lines


def present_arms(rows: List[Dict[str, Any]]) -> List[str]:
    """Arms that have rows, in the canonical order (afdep, symmetric, nccl, nccl_bare)."""
    have = {r["arm"] for r in rows}
    order = [a for a in ARM_LABELS if a in have]
    return order + sorted(have - set(order))


def get_any(get, ts, arms):
    """Per T, the row of the first arm in ``arms`` that has a floor."""
    out = {}
    for t in ts:
        for arm in arms:
            r = get.get((arm, t))
            if r is not None and r.get("floor_us") is not None:
                out[t] = r
                break
    return out


def _fmt_spread(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:.2f}×"


def _fmt_ratio(v: Optional[float]) -> str:
    return "—" if v is None else f"{100 * v:.0f}%"


def _fmt_gbps(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:,.0f}"


def write_markdown(path: str, doc: Dict[str, Any]) -> None:
    common.write_text(path, markdown(doc) + "\n")


def write_plot(path: str, doc: Dict[str, Any]) -> Optional[str]:
    """Latency vs T per arm (log-log) with a ratio panel, one pair of axes per
    (layout, hidden, dtype, routing). Returns None when written, else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.gridspec import GridSpec
    except Exception as e:  # noqa: BLE001
        return f"matplotlib unavailable ({type(e).__name__}: {e}); no plot"
    rows = doc["results"]
    groups = groups_of(rows)
    if not groups:
        return "no results to plot"
    arms = present_arms(rows)
    ncol = min(3, len(groups))
    nrow = math.ceil(len(groups) / ncol)
    fig = plt.figure(figsize=(5.2 * ncol, 5.0 * nrow))
    gs = GridSpec(2 * nrow, ncol, figure=fig, height_ratios=[3, 1.3] * nrow, hspace=0.08)
    styles = {"afdep": ("C0", "o"), "afdep_alt": ("C3", "D"), "symmetric": ("C1", "s"),
              "nccl": ("C2", "^"), "nccl_bare": ("C7", "v")}
    for i, (layout, hidden, dtype, routing) in enumerate(groups):
        rr, cc = divmod(i, ncol)
        ax = fig.add_subplot(gs[2 * rr, cc])
        axr = fig.add_subplot(gs[2 * rr + 1, cc], sharex=ax)
        sub = [r for r in rows if (r["layout"], r["hidden"], r["dtype"], r["routing"]) ==
               (layout, hidden, dtype, routing)]
        by = {}
        for arm in arms:
            for rl in present_layouts(rows) + [BARE_LAYOUT]:
                pts = sorted((r["tokens"], r["latency_us"]) for r in sub
                             if r["arm"] == arm and r.get("receive_layout", "experts") == rl
                             and r["latency_us"] is not None)
                if not pts:
                    continue
                color, mk = styles.get(arm, (None, "x"))
                ls = {"experts": "-", "tokens": "--"}.get(rl, ":")
                label = arm if rl == BARE_LAYOUT else f"{arm} {rl}"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, marker=mk, color=color,
                        label=label, ms=4)
                by[(arm, rl)] = dict(pts)
        fl = sorted((r["tokens"], r["floor_us"]) for r in sub
                    if r["arm"] == "afdep" and r.get("floor_us")
                    and r.get("receive_layout", "experts") == "experts")
        if fl:
            ax.plot([p[0] for p in fl], [p[1] for p in fl], ":", color="k", label="data floor")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{layout} H{hidden} {dtype} {routing}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.tick_params(labelbottom=False)
        if cc == 0:
            ax.set_ylabel("round trip, µs")
        if i == 0:
            ax.legend(fontsize=6)
        # ratio panel: afdep against symmetric and nccl of the same layout, and afdep
        # tokens against afdep experts
        ratios = [(("afdep", rl), (base, rl), styles[base][0], ls, f"afdep/{base} {rl}")
                  for rl, ls in (("experts", "-"), ("tokens", "--"))
                  for base in ("symmetric", "nccl")]
        ratios.append((("afdep", "tokens"), ("afdep", "experts"), "k", "-.",
                       "afdep tokens/experts"))
        ratios += [(("afdep_alt", rl), ("afdep", rl), styles["afdep_alt"][0], ls,
                    f"afdep_alt/afdep {rl}") for rl, ls in (("experts", "-"), ("tokens", "--"))]
        drawn = False
        for num, den, color, ls, label in ratios:
            if num in by and den in by:
                ts = sorted(set(by[num]) & set(by[den]))
                if ts:
                    axr.plot(ts, [by[num][t] / by[den][t] for t in ts], ls, marker=".",
                             color=color, ms=3, label=label)
                    drawn = True
        if drawn:
            axr.axhline(1.0, color="k", lw=0.7)
            axr.set_xscale("log")
            axr.grid(True, which="both", alpha=0.3)
            if cc == 0:
                axr.set_ylabel("ratio")
            if i == 0:
                axr.legend(fontsize=5)
        axr.set_xlabel("tokens per Attention rank (T)")
    m = doc.get("machine", {})
    fig.suptitle(f"torch_afdep AFD round trip, {m.get('name', '')}, {doc.get('commit', '')}",
                 fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return None
