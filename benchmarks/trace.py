"""Where the round trip's time goes: per-stage medians from the kernels' %globaltimer trace.

    python -m benchmarks.trace [--tokens 1 128 2048] [--hidden 4096] [--arms afdep symmetric]
                               [--receive-layout experts|tokens] [--repeats N]
                               [--afdep-env NAME=VALUE ...] [--stand-in copy|none]

Runs 1A1F on two GPUs (or both ranks on one GPU under CUDA MPS when only one is visible;
its stages then share one clock), fresh processes per arm, ``AFDEP_TRACE=1``, the same
graph step and alignment as ``benchmarks.run``'s afdep arm (``--receive-layout`` picks the
buffer's ``Config.receive_layout``), then reads every rank's trace ring (the last 64
exchanges) and prints, per token count, median stage times in µs. Stages on one GPU are exact;
stages that cross GPUs (marked ``x``) assume the two GPUs' %globaltimer agree, which the
``x clock check`` line lets you judge (a flag crossing should take ~1 µs, never < 0; but
"F last signal -> A CTA0 done seen" is typically < 0 where the reply sends flagged units, whose
start units the collect sees before the reply's last signal).
Diagnostics only: the stamps cost a few ns per CTA and the numbers are not the benchmark's.
Each kernel's CTA 0 also records its SM; the lines "... on ...'s SM (share of exchanges)" say
how often two ranks' CTA 0s ran on one SM (on one GPU under MPS: the token's sender and its
receiver, the reply and the collect).

The Attention's stream also gets a one-thread %globaltimer stamp kernel right after the start
event and right before the end event, so the time outside the kernels (graph launch, kernel
start, completion) is split into "start stamp -> dispatch start" and "combine end -> end
stamp"; those two kernels add a few µs to the event latency here. ``--repeats`` runs fresh
process groups per arm (slow and fast worlds differ at small T), and every stage reports its
median, 90th percentile and maximum over the replays.

``--exchanges-per-replay K`` captures K exchanges back to back in each graph (the second
starts as soon as the first has collected, with no idle GPU between them) and reports each
position on its own: position 0 is the usual cold exchange after the idle gap, positions >= 1
show what the same stages cost with the kernels' code and data just used. The event latency
then brackets all K; the start stamp's line belongs to position 0, the end stamp's to the last,
and the outside-kernel line is left out.

``--compare A.json B.json ...`` runs nothing: it prints the stage medians of saved ``--out``
files side by side (per arm and token count of the first file; a stage's median over a file's
repeats), the way a control's trace is read against the defaults'. No GPU needed.

``--stand-in none`` drops the FFN's stand-in expert (``benchmarks.run``'s copy kernel, which
every arm runs between receive and reply): the reply sends a fixed tensor, so "F gap: receive
end -> reply start" is the launch gap between the transport's own kernels, and the difference
from the default run is what the caller's one kernel adds (results not checked).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from benchmarks import arms, common
from torch_afdep import mps

# trace points (csrc/include/afdep/layout.h TracePoint)
POINTS = 16
(START, SENT, WAITED, END, MAX_SENT, MAX_WAITED, MAX_END, READY, CLAIMED, COPIED, WRITTEN,
 TABLE, LOADED, MASKED, MAX_START, SM) = range(POINTS)
D, C = 0, 1  # phases

def _gap(a, i: int, b, j: int) -> Optional[int]:
    """a[i] - b[j] in ns; None when either point was never stamped (0: e.g. the count table
    point, which only the expert layout's receive stamps, and not where one token arrived in
    all: AFDEP_LONE_EXPAND builds no table)."""
    return a[i] - b[j] if a[i] and b[j] else None


def _units_first(df) -> bool:
    """The FFN receive's thread 0 saw its first token's metadata units (LOADED) no later than
    the offsets were ready: the expert layout's units receive, whose offsets follow from them
    where one token arrived in all (AFDEP_LONE_EXPAND)."""
    g = _gap(df, READY, df, LOADED)
    return g is not None and g >= 0


def _units_after(df) -> bool:
    """... after the offsets: the token layout's units receive (it places the rows by formula
    and waits for the metadata units behind the offsets)."""
    g = _gap(df, LOADED, df, READY)
    return g is not None and g > 0


def _less(a: Optional[int], b: Optional[int]) -> Optional[int]:
    """a - b; None when either is."""
    return a - b if a is not None and b is not None else None


#: (name, fn(att dispatch, att combine, ffn dispatch, ffn combine) -> ns or None, crosses GPUs)
#: Each kernel's "CTA0 start -> last CTA start": how far apart its CTAs began (after their
#: programmatic-launch wait), to tell a late CTA from a slow one in a stage that ends at the
#: latest CTA.
STAGES = [
    ("A dispatch: start -> last CTA sent", lambda da, ca, df, cf: _gap(da, MAX_SENT, da, START), False),
    ("  A dispatch: CTA0 start -> last CTA start",
     lambda da, ca, df, cf: _gap(da, MAX_START, da, START), False),
    # CTA 0's steps (at small T the CTA that holds the tokens): claim, payload copy, signal
    ("  A CTA0: start -> tokens claimed", lambda da, ca, df, cf: _gap(da, CLAIMED, da, START), False),
    # thread 0's first loads (its token's expert id, the exchange number): their latency
    ("    A CTA0: start -> first loads arrived",
     lambda da, ca, df, cf: _gap(da, LOADED, da, START), False),
    ("    A CTA0: first loads arrived -> tokens claimed",
     lambda da, ca, df, cf: _gap(da, CLAIMED, da, LOADED), False),
    # thread 0's (last) token: its route mask (id checks, duplicates matched), then its slot
    # and metadata stores
    ("      A CTA0: first loads arrived -> route mask known",
     lambda da, ca, df, cf: _gap(da, MASKED, da, LOADED), False),
    ("      A CTA0: route mask known -> tokens claimed",
     lambda da, ca, df, cf: _gap(da, CLAIMED, da, MASKED), False),
    # (AFDEP_RAW_META: warp 0 stamps "claimed" after its raw metadata, its row vectors and the
    # route, so "loads -> claimed" holds its copy and this stage is about 0; no "route mask
    # known" stamp)
    ("  A CTA0: claimed -> payload written", lambda da, ca, df, cf: _gap(da, COPIED, da, CLAIMED), False),
    ("  A CTA0: payload written -> counts signalled",
     lambda da, ca, df, cf: _gap(da, SENT, da, COPIED), False),
    # the latest CTA's signal against CTA 0's: other CTAs' work (or their signals' fences)
    ("  A dispatch: CTA0 signalled -> last CTA signalled",
     lambda da, ca, df, cf: _gap(da, MAX_SENT, da, SENT), False),
    ("A dispatch kernel (start -> last CTA end)", lambda da, ca, df, cf: _gap(da, MAX_END, da, START), False),
    ("A gap: dispatch end -> combine start", lambda da, ca, df, cf: _gap(ca, START, da, MAX_END), False),
    ("x F receive started before A dispatch", lambda da, ca, df, cf: _gap(da, START, df, START), True),
    ("x A last sent -> F CTA0 counts seen", lambda da, ca, df, cf: _gap(df, WAITED, da, MAX_SENT), True),
    ("F counts seen -> offsets ready", lambda da, ca, df, cf: _gap(df, READY, df, WAITED), False),
    ("  F CTA0: counts seen -> count table loaded",
     lambda da, ca, df, cf: _gap(df, TABLE, df, WAITED), False),
    # the expert layout's units receive, thread 0's first unit (at T = 1 the token's): its
    # metadata units seen, then the offsets, which follow from them where one token arrived
    # in all (AFDEP_LONE_EXPAND); absent where the units are seen after the offsets
    ("  F CTA0: counts seen -> token units seen",
     lambda da, ca, df, cf: _gap(df, LOADED, df, WAITED) if _units_first(df) else None, False),
    ("  F CTA0: token units seen -> offsets ready",
     lambda da, ca, df, cf: _gap(df, READY, df, LOADED) if _units_first(df) else None, False),
    # ... split where thread 0 knows its entry's row (AFDEP_LONE_EXPAND's lone_row: duplicates
    # matched, the distinct ids below its own counted), then CTA 0's offsets and receipt
    ("    F CTA0: token units seen -> row known",
     lambda da, ca, df, cf: _gap(df, MASKED, df, LOADED) if _units_first(df) else None, False),
    ("    F CTA0: row known -> offsets ready",
     lambda da, ca, df, cf: _gap(df, READY, df, MASKED) if _units_first(df) else None, False),
    ("F expansion (ready -> last CTA end)", lambda da, ca, df, cf: _gap(df, MAX_END, df, READY), False),
    # CTA 0's own end against the latest CTA's wait (every CTA of the receive waits for the
    # headers or counts; the placement is spread over the grid)
    ("  F CTA0: ready -> its end", lambda da, ca, df, cf: _gap(df, END, df, READY), False),
    # the token layout's units receive, thread 0's first row (at T = 1 the token's): its
    # metadata units seen (their wait), then that row's metadata written, its CTA's barrier
    ("    F CTA0: ready -> token units seen",
     lambda da, ca, df, cf: _gap(df, LOADED, df, READY) if _units_after(df) else None, False),
    # ... split where thread 0's first poll of them returned (AFDEP_SETTLE_UNITS' receive;
    # stale or not): the load's latency, then the polls after it
    ("      F CTA0: ready -> first poll returned",
     lambda da, ca, df, cf: _gap(df, MASKED, df, READY) if _units_after(df) else None, False),
    ("      F CTA0: first poll returned -> token units seen",
     lambda da, ca, df, cf: _gap(df, LOADED, df, MASKED) if _units_after(df) else None, False),
    ("    F CTA0: token units seen -> its end",
     lambda da, ca, df, cf: _gap(df, END, df, LOADED) if _units_after(df) else None, False),
    ("  F receive: CTA0 counts seen -> last CTA counts seen",
     lambda da, ca, df, cf: _gap(df, MAX_WAITED, df, WAITED), False),
    ("  F receive: CTA0 start -> last CTA start",
     lambda da, ca, df, cf: _gap(df, MAX_START, df, START), False),
    ("F gap: receive end -> reply start", lambda da, ca, df, cf: _gap(cf, START, df, MAX_END), False),
    ("F reply (start -> last CTA signalled)", lambda da, ca, df, cf: _gap(cf, MAX_SENT, cf, START), False),
    ("  F reply: CTA0 start -> last CTA start",
     lambda da, ca, df, cf: _gap(cf, MAX_START, cf, START), False),
    ("  F CTA0: start -> reduced rows written",
     lambda da, ca, df, cf: _gap(cf, WRITTEN, cf, START), False),
    # thread 0's first row (token layout, early loads): its token index and first vector
    ("    F CTA0: start -> first row loaded",
     lambda da, ca, df, cf: _gap(cf, LOADED, cf, START), False),
    ("    F CTA0: first row loaded -> rows written",
     lambda da, ca, df, cf: _gap(cf, WRITTEN, cf, LOADED), False),
    # CTA 0's completion signal behind its rows (a system fence, then the count), and the
    # latest CTA's signal against CTA 0's: at small T the reply's rows go as flagged units,
    # which the collect takes without these signals, so this tail is off the Attention's path
    ("  F CTA0: rows written -> signalled", lambda da, ca, df, cf: _gap(cf, SENT, cf, WRITTEN), False),
    ("  F reply: CTA0 signalled -> last CTA signalled",
     lambda da, ca, df, cf: _gap(cf, MAX_SENT, cf, SENT), False),
    # the expert layout's reply, thread 0's item: its receipt (token index, rows, count), then
    # its first 8 rows' vectors (the LOADED point above; only a token with 8 or more rows
    # stamps it). At small T (the one-pass reply: one item per warp) that is its first item;
    # on the generic path at large T thread 0 walks many items and the points hold its last,
    # so these two stages mean something at small T only
    ("    F CTA0: start -> receipt loaded",
     lambda da, ca, df, cf: _gap(cf, MASKED, cf, START), False),
    ("    F CTA0: receipt loaded -> first rows loaded",
     lambda da, ca, df, cf: _gap(cf, LOADED, cf, MASKED), False),
    # typically negative where the reply sends flagged units (small T): the collect's "done
    # seen" is the start units, which the reply writes before its rows and its last CTA's signal
    ("x F last signal -> A CTA0 done seen", lambda da, ca, df, cf: _gap(ca, WAITED, cf, MAX_SENT), True),
    ("A collect (done seen -> last CTA end)", lambda da, ca, df, cf: _gap(ca, MAX_END, ca, WAITED), False),
    # the collect split: CTA 0's own end (at small T it holds the rows) against the latest
    # CTA's wait (every CTA of the default collect waits for every reply)
    ("  A CTA0: done seen -> its end", lambda da, ca, df, cf: _gap(ca, END, ca, WAITED), False),
    ("  A collect: CTA0 done seen -> last CTA done seen",
     lambda da, ca, df, cf: _gap(ca, MAX_WAITED, ca, WAITED), False),
    ("  A collect: CTA0 start -> last CTA start",
     lambda da, ca, df, cf: _gap(ca, MAX_START, ca, START), False),
    ("A kernels total (dispatch start -> combine end)", lambda da, ca, df, cf: _gap(ca, MAX_END, da, START), False),
    # the transport's own chain: the total less the caller's kernel between receive and reply
    # (on one GPU that gap is 2-3 µs longer than on two, since the ranks share the GPU around it)
    ("A kernels total - F gap", lambda da, ca, df, cf: _less(_gap(ca, MAX_END, da, START),
                                                           _gap(cf, START, df, MAX_END)), False),
]
#: stages of the Attention stream's stamps st = (after the start event, before the end event)
#: (the start stamp precedes a replay's first exchange, the end stamp follows its last)
STAMP_STAGES = [
    ("A stream: start stamp -> dispatch start", lambda st, da, ca: _gap(da, START, st, 0), "first"),
    ("A stream: combine end -> end stamp", lambda st, da, ca: _gap(st, 1, ca, MAX_END), "last"),
]
OUTSIDE = "A event latency - kernels total"
#: (name, fn(att dispatch, att combine, ffn dispatch, ffn combine) -> (SM, SM)): two kernels'
#: CTA 0s (at T = 1 the token's sender and its receiver, then the reply and the collect)
#: whose SMs (the SM point, %smid + 1; 0 where not stamped) the summary compares. On a GPU
#: that the ranks share, one CTA's stores and the other's polls then pass one SM's memory
#: pipeline.
SM_PAIRS = [
    ("A dispatch CTA0 on F receive CTA0's SM", lambda da, ca, df, cf: (da[SM], df[SM])),
    ("F reply CTA0 on A collect CTA0's SM", lambda da, ca, df, cf: (cf[SM], ca[SM])),
]


def trace_devices(n_gpus: int, mps_running: bool) -> Optional[List[int]]:
    """The GPU of each of the two ranks: [0, 1] with two GPUs, [0, 0] on one GPU under MPS
    (without MPS two spinning ranks time-slice one GPU), None when neither is possible."""
    if n_gpus >= 2:
        return [0, 1]
    if n_gpus == 1 and mps_running:
        return [0, 0]
    return None


def timer_step(device, reads: int = 4096) -> Dict[str, int]:
    """%globaltimer's resolution on ``device`` (the clock of every stage stamp): the smallest
    step one thread saw it advance over ``reads`` back-to-back reads, the steps and their
    span in ns."""
    from torch_afdep import _cuda

    out = torch.zeros(3, dtype=torch.int64, device=device)
    _cuda.timer_step(out.data_ptr(), reads, torch.cuda.current_stream(device).cuda_stream)
    step, steps, span = out.tolist()
    return {"step_ns": step, "steps": steps, "span_ns": span, "reads": reads}


def body(rank: int, world: int, spec: Dict[str, Any]) -> Dict[str, Any]:
    import torch_afdep

    from torch_afdep import _cuda

    rk = arms._Rank(rank, world, spec)
    out: Dict[str, Any] = {"rows": [], "globaltimer": timer_step(rk.device)}
    rl = spec.get("receive_layout", "experts")
    cfg = rk.config(spec["hidden"], spec["dtype"], rl)
    buf = torch_afdep.Buffer(None, cfg, device=rk.device)
    try:
        for i, T in enumerate(spec["tokens"]):
            cell = {"arm": spec["arm"], "layout": "1A1F", "receive_layout": rl,
                    "hidden": spec["hidden"],
                    "dtype": spec["dtype"], "routing": spec["routing"], "tokens": T}
            c = arms._AfdepCell(rk, cfg, cell, 1000 + i, buf,
                                stand_in=spec.get("stand_in", "copy"))
            c.setup()
            for _ in range(3):
                c.step()
            rk.sync()
            graph = torch.cuda.CUDAGraph()
            k = spec.get("per_replay", 1)
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                for _ in range(k):  # back to back: the next dispatch queues behind the collect
                    c.step()
            torch.cuda.synchronize()
            st = torch.zeros(spec["replays"], 2, dtype=torch.int64, device=rk.device)
            stream = torch.cuda.current_stream().cuda_stream
            host = [[0.0, 0.0] for _ in range(spec["replays"])]

            def after_start(j):
                _cuda.stamp(st.data_ptr() + 16 * j, stream)
                host[j][0] = time.perf_counter()

            def before_end(j):
                host[j][1] = time.perf_counter()
                _cuda.stamp(st.data_ptr() + 16 * j + 8, stream)

            around = (after_start, before_end)
            lat = arms._time_graph(rk, graph, spec["warmup"], spec["replays"], -1,
                                   spec["attention_delay_us"] * 1e-6, spec["queue_ahead_us"],
                                   around=around)
            buf.transport.check_error()
            stamps, ctr = buf.transport.trace()
            got: List[Any] = [None] * world
            dist.all_gather_object(got, (rk.role, stamps.tolist(), ctr,
                                         c.extra.get("kernel_forms")), group=rk.ctrl)
            if rk.is_attention:
                for pos in range(k):
                    row = summarize(T, got, lat, spec["replays"], st.tolist(), per_replay=k,
                                    position=pos)
                    # host time of graph.replay() (the graph launch call): when it outlasts the
                    # queue-ahead sleep, the GPU waits for the host inside the measured interval
                    row["host_replay_us"] = _spread([(b - a) * 1e6 for a, b in host])
                    # the Attention's kernel forms in the graph: [dispatch, collect]; the
                    # (first) FFN rank's: [receive, reply]
                    row["kernel_forms"] = c.extra.get("kernel_forms")
                    row["ffn_kernel_forms"] = next(g[3] for g in got if g[0] == "ffn")
                    out["rows"].append(row)
            del graph
            c.release()
    finally:
        buf.close()
    return out


def _spread(v: List[float]) -> Dict[str, float]:
    v = sorted(v)
    return {"median": statistics.median(v), "p90": v[min(len(v) - 1, int(0.9 * len(v)))],
            "max": v[-1]}


def summarize(T: int, got, lat: List[float], replays: int,
              st: Optional[List[List[int]]] = None, per_replay: int = 1,
              position: int = 0) -> Dict[str, Any]:
    """Per-stage medians (``stages_us``) and median / p90 / max (``spread_us``) over the
    exchanges at ``position`` of each replay among the last min(replays * per_replay,
    ring - 1). ``got``: per rank (role, stamps [ring][2][points], (dispatch, combine) exchange
    numbers, ...: further items unread); ``lat``: the timed replays' event latencies, µs;
    ``st``: per timed replay the Attention stream's (after start, before end) stamps, ns.
    Each replay runs ``per_replay`` exchanges and the last timed replay ends with the last
    exchange, so exchange n is replay len(lat) - 1 - (last - n) // per_replay at position
    per_replay - 1 - (last - n) % per_replay. The event latency is the replay's (all its
    exchanges); the start stamp's stage belongs to position 0, the end stamp's to the last;
    the outside-kernel line (the replay's interval less one exchange's kernels) only with
    per_replay 1."""
    att = next(g for g in got if g[0] == "attention")
    ffn = next(g for g in got if g[0] == "ffn")
    ring = len(att[1])
    last = att[2][1]  # last combine exchange number
    if not 0 <= position < per_replay:
        raise ValueError(f"position must be in [0, per_replay={per_replay}), got {position}")
    n_use = min(replays * per_replay, ring - 1, len(lat) * per_replay)
    whole = per_replay == 1  # one replay interval per exchange
    names = [name for name, _, _ in STAGES]
    at = {"first": position == 0, "last": position == per_replay - 1}
    stamp_stages = [(name, fn) for name, fn, where in STAMP_STAGES if at[where]]
    if st is not None:
        names += [name for name, _ in stamp_stages]
    if whole:
        names.append(OUTSIDE)
    per: Dict[str, List[float]] = {name: [] for name in names}
    same: Dict[str, List[float]] = {}
    for n in range(last - n_use + 1, last + 1):
        if per_replay - 1 - (last - n) % per_replay != position:
            continue
        j = len(lat) - 1 - (last - n) // per_replay
        da, ca = att[1][n % ring][D], att[1][n % ring][C]
        df, cf = ffn[1][n % ring][D], ffn[1][n % ring][C]
        for name, fn, _ in STAGES:
            v = fn(da, ca, df, cf)
            if v is not None:
                per[name].append(v / 1000.0)
        if st is not None:
            for name, fn in stamp_stages:
                v = fn(st[j], da, ca)
                if v is not None:
                    per[name].append(v / 1000.0)
        if whole:
            per[OUTSIDE].append(lat[j] - (ca[MAX_END] - da[START]) / 1000.0)
        for name, fn in SM_PAIRS:
            a, b = fn(da, ca, df, cf)
            if a and b:
                same.setdefault(name, []).append(1.0 if a == b else 0.0)
    return {"tokens": T, "position": position, "per_replay": per_replay,
            "latency_us": statistics.median(lat) if lat else None,
            "latency_spread_us": _spread(lat) if lat else None,
            "stages_us": {k: statistics.median(v) for k, v in per.items() if v},
            "spread_us": {k: _spread(v) for k, v in per.items() if v},
            # the share of exchanges in which each pair's CTA 0s ran on one SM
            "same_sm": {k: sum(v) / len(v) for k, v in same.items() if v}}


def _print_rows(title: str, rows: List[Dict[str, Any]]) -> None:
    print(f"\n== {title}")
    print(f"{'stage (median µs; p90 for the outside-kernel lines)':58s}" +
          "".join(f"{'T=' + str(r['tokens']):>13s}" for r in rows))
    print(f"{'event latency (start..end events), median / p90':58s}" +
          "".join(f"{r['latency_us']:7.1f}/{r['latency_spread_us']['p90']:5.1f}" for r in rows))
    # every stage some row has, in STAGES' order (a T = 1 row may lack one: e.g. the expert
    # layout's lone-token receive builds no count table), then the stream's lines
    known = [n for n, _, _ in STAGES]
    seen = list(dict.fromkeys(n for r in rows for n in r["stages_us"]))
    names = sorted(seen, key=lambda n: known.index(n) if n in known else len(known) + seen.index(n))
    for name in names:
        if name.startswith("A stream") or name == OUTSIDE:
            cells = "".join(f"{r['stages_us'][name]:7.1f}/{r['spread_us'][name]['p90']:5.1f}"
                            for r in rows)
        else:
            cells = "".join(f"{r['stages_us'].get(name, float('nan')):13.1f}" for r in rows)
        print(f"{name:58s}" + cells)
    for name, _ in SM_PAIRS:
        if any(name in r.get("same_sm", {}) for r in rows):
            print(f"{name + ' (share of exchanges)':58s}" + "".join(
                f"{r.get('same_sm', {}).get(name, float('nan')):13.2f}" for r in rows))
    if all("host_replay_us" in r for r in rows):
        print(f"{'host: graph.replay() call, median / p90':58s}" +
              "".join(f"{r['host_replay_us']['median']:7.1f}/{r['host_replay_us']['p90']:5.1f}"
                      for r in rows))


def compare(docs: List[Dict[str, Any]], labels: List[str]) -> str:
    """Stage medians of saved runs side by side: for each arm, token count and position of
    the first run (``docs``: ``--out`` files' contents), one line per stage, one column per
    run (its median over the run's repeats; "-" where the run lacks the stage or the row).
    ``labels`` name the columns in a legend above the tables."""
    lines = [f"[{i + 1}] {label}" for i, label in enumerate(labels)]
    known = [n for n, _, _ in STAGES]

    def rows_of(doc, arm):
        return [row for rep in doc.get("results", {}).get(arm, []) for row in rep]

    for arm in docs[0].get("results", {}):
        keys = list(dict.fromkeys((r["tokens"], r.get("position", 0))
                                  for r in rows_of(docs[0], arm)))
        for tokens, pos in keys:
            cols = []
            for doc in docs:
                same = [r for r in rows_of(doc, arm)
                        if r["tokens"] == tokens and r.get("position", 0) == pos]
                stages: Dict[str, List[float]] = {}
                for r in same:
                    for name, v in r["stages_us"].items():
                        stages.setdefault(name, []).append(v)
                    for name, v in r.get("same_sm", {}).items():
                        stages.setdefault(name + " (share of exchanges)", []).append(v)
                cols.append({n: statistics.median(v) for n, v in stages.items()})
            seen = list(dict.fromkeys(n for c in cols for n in c))
            names = sorted(seen, key=lambda n: (known.index(n) if n in known
                                                else len(known) + seen.index(n)))
            where = f", exchange position {pos}" if pos else ""
            lines.append(f"\n== {arm}, T={tokens}{where} (median µs)")
            lines.append(f"{'stage':62s}" + "".join(f"{'[' + str(i + 1) + ']':>8s}"
                                                    for i in range(len(docs))))
            for n in names:
                lines.append(f"{n:62s}" + "".join(
                    f"{c[n]:8.2f}" if n in c else f"{'-':>8s}" for c in cols))
    return "\n".join(lines)


def _label(path: str, doc: Dict[str, Any]) -> str:
    args = doc.get("args", {})
    env = " ".join(args.get("afdep_env") or [])
    return (f"{path}: commit {doc.get('commit', '?')}, {doc.get('machine', '?')}, "
            f"{args.get('receive_layout', '?')} layout" + (f", {env}" if env else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", nargs="+", default=None, metavar="JSON",
                   help="print saved --out files' stage medians side by side and exit")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 128, 512, 2048])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp8"])
    p.add_argument("--routing", default="random")
    p.add_argument("--receive-layout", default="experts", choices=["experts", "tokens"],
                   help="Config.receive_layout of the traced buffers")
    p.add_argument("--arms", nargs="+", default=["afdep", "symmetric"],
                   choices=["afdep", "symmetric"])
    p.add_argument("--sms", type=int, default=24)
    p.add_argument("--local-sms", type=int, default=0,
                   help="Config.local_sms (0: the default, one CTA per SM divided among the "
                        "ranks sharing the GPU)")
    p.add_argument("--replays", type=int, default=60)
    p.add_argument("--exchanges-per-replay", type=int, default=1,
                   help="exchanges captured back to back in each graph (1..8), each position "
                        "reported on its own")
    p.add_argument("--capacity", type=int, default=0, help="tokens per rank (default max T)")
    common.add_timing_args(p, queue_ahead_us=200.0, attention_delay_us=300.0)
    p.add_argument("--repeats", type=int, default=1, help="fresh process groups per arm")
    p.add_argument("--afdep-env", nargs="+", default=[], metavar="NAME=VALUE",
                   help="protocol controls for the afdep arm only (e.g. AFDEP_WIDE_LOCAL=0)")
    p.add_argument("--stand-in", default="copy", choices=list(arms.STAND_INS),
                   help="the FFN's expert between receive and reply: copy (benchmarks.run's "
                        "stand-in) or none (the reply sends a fixed tensor; the FFN gap is "
                        "then the transport kernels' own launch gap)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if args.compare:
        import json

        docs = []
        for path in args.compare:
            try:
                with open(path) as f:
                    docs.append(json.load(f))
            except (OSError, ValueError) as e:
                p.error(f"--compare: cannot read {path}: {e}")
        print(compare(docs, [_label(path, d) for path, d in zip(args.compare, docs)]))
        return 0
    afdep_env = common.parse_afdep_env(p, args.afdep_env)  # the same rules as benchmarks.run
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    common.check_local_sms(p, args)
    if not 1 <= args.exchanges_per_replay <= 8:
        p.error(f"--exchanges-per-replay must be in [1, 8], got {args.exchanges_per_replay}")
    common.check_timing_args(p, args)
    if min(args.tokens) < 1 or (args.capacity and max(args.tokens) > args.capacity):
        p.error(f"--tokens must be in [1, --capacity={args.capacity or 'max T'}], "
                f"got {args.tokens}")
    devices = trace_devices(torch.cuda.device_count() if torch.cuda.is_available() else 0,
                            mps.mps_running())
    if devices is None:
        print("benchmarks.trace needs two CUDA GPUs, or one with CUDA MPS running "
              f"(`{mps.START_COMMAND}`, as scripts/gpu_suite.sh does)", file=sys.stderr)
        return 2
    import tempfile

    out_dir = tempfile.mkdtemp(prefix="afdep-trace-")
    results: Dict[str, List[List[Dict[str, Any]]]] = {arm: [] for arm in args.arms}
    timers: List[Dict[str, int]] = []  # %globaltimer's resolution, once per world
    for rep in range(args.repeats):
        for arm in args.arms:  # arms interleaved, one fresh world each
            spec = {"arm": arm, "attention_ranks": 1, "ffn_ranks": 1,
                    "capacity": args.capacity or max(args.tokens), "experts": 128, "top_k": 8,
                    "sms": args.sms, "local_sms": args.local_sms,
                    "kernel_timeout_s": 20.0, "ctrl_timeout_s": 120, "hidden": args.hidden,
                    "dtype": args.dtype, "routing": args.routing, "tokens": args.tokens,
                    "receive_layout": args.receive_layout,
                    "warmup": 10, "replays": args.replays,
                    "per_replay": args.exchanges_per_replay,
                    "attention_delay_us": args.attention_delay_us,
                    "queue_ahead_us": args.queue_ahead_us, "out_dir": out_dir,
                    "stand_in": args.stand_in}
            env = {"AFDEP_TRACE": "1"}
            env.update({"AFDEP_SYMMETRIC": "1"} if arm == "symmetric" else afdep_env)
            res, error = common.spawn(body, 2, spec, device_ids=devices, env=env, timeout=600)
            if res is None:
                print(f"benchmarks.trace: {arm} repeat {rep} failed: {error}", file=sys.stderr)
                return 1
            rows = res[0]["rows"] or res[1]["rows"]
            results[arm].append(rows)
            timers.append(res[0]["globaltimer"])
            extra = f", {' '.join(args.afdep_env)}" if arm == "afdep" and args.afdep_env else ""
            if args.stand_in != "copy":
                extra += f", stand-in {args.stand_in}"
            t = timers[-1]
            print(f"%globaltimer: smallest step {t['step_ns']} ns ({t['steps']} steps over "
                  f"{t['span_ns']} ns, {t['reads']} reads)")
            k = args.exchanges_per_replay
            for pos in range(k):
                where = f", exchange {pos + 1} of {k} per replay" if k > 1 else ""
                _print_rows(f"{arm}{extra}, repeat {rep}: 1A1F {args.receive_layout} layout, "
                            f"GPUs {devices}, H{args.hidden} {args.dtype} "
                            f"{args.routing}, {args.sms} SMs, {args.replays} replays{where}",
                            [r for r in rows if r["position"] == pos])
    if args.out:
        names = common.nvidia_smi().get("names") or []
        common.write_json(args.out, {"args": vars(args), "results": results,
                                     "globaltimer": timers,
                                     "machine": common.machine_name(names),
                                     "commit": common.git_commit(), "devices": devices,
                                     "env": dict(common.software(), vars=common.recorded_env())})
    return 0


if __name__ == "__main__":
    sys.exit(main())
