"""One JSON summary of what scripts/gpu_profile.sh wrote for a cell: per kernel role, the ncu
durations of every launch (both cache controls) and the sampled warp stalls: their reasons,
the instructions that hold the most samples, and the samples per span of code between
%globaltimer reads (the trace's stages, as scripts/sass_spans.py names them).

Usage:
    python scripts/ncu_summary.py --dir PROFILE_DIR --cell tokens-T1 [--commit HASH]
                                  [--out FILE.json]
Reads PROFILE_DIR/dur-<cell>-cc{all,none}.csv (``ncu --page raw --csv``),
samp-<cell>-details.csv and samp-<cell>-source.csv (``--page source --print-source sass``).

Roles: in 1A1F each process launches one dispatch_kernel and one combine_kernel per exchange;
on the Attention process they are the dispatch and the collect, on the FFN process the
receive and the reply. A process's role comes from the pids in the lockstep JSON that the same
run wrote beside its export (dur-<cell>-cc<cc>.json, samp-<cell>.json), else from the grids:
the Attention's dispatch runs num_sms CTAs, fewer than the FFN's receive (Config.local_sms),
so the process whose dispatch grid is smaller is the Attention (a tie: unknown).
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import os
import statistics
import sys
from typing import Any, Dict, List, Optional

ROLE_OF = {("attention", "dispatch_kernel"): "A dispatch", ("attention", "combine_kernel"): "A collect",
           ("ffn", "dispatch_kernel"): "F receive", ("ffn", "combine_kernel"): "F reply"}
WARMUP = 2  # launches per kernel left out of the medians (module load, first touches)
HOT = 12  # instructions listed per sampled result (hot_instructions)


def num(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def kernel_base(name: str) -> str:
    """'void unnamed>::dispatch_kernel<1>(Layout, DispatchArgs)' -> 'dispatch_kernel'."""
    return name.split("(")[0].split("::")[-1].split("<")[0].strip()


def kernel_form(name: str) -> str:
    """The template argument (KernelForm) as written, '' for an untemplated kernel."""
    head = name.split("(")[0]
    return head[head.index("<") + 1:head.rindex(">")] if "<" in head else ""


def read_raw(path: str) -> List[Dict[str, str]]:
    """Rows of an ``ncu --page raw --csv`` export (its second line holds the units)."""
    with open(path) as f:
        rows = list(csv.reader(f))
    head = rows[0]
    return [dict(zip(head, r)) for r in rows[2:] if len(r) == len(head)]


def roles_from_grids(rows: List[Dict[str, str]]) -> Dict[str, str]:
    grids: Dict[str, int] = {}
    for r in rows:
        if kernel_base(r["Kernel Name"]) == "dispatch_kernel":
            g = int(r["Grid Size"].strip("()").split(",")[0])
            grids[r["Process ID"]] = min(g, grids.get(r["Process ID"], g))
    if len(grids) != 2 or len(set(grids.values())) != 2:
        return {p: "unknown" for p in grids}
    small = min(grids, key=grids.get)
    return {p: "attention" if p == small else "ffn" for p in grids}


def durations(path: str, roles: Optional[Dict[str, str]] = None) -> List[Dict[str, Any]]:
    rows = read_raw(path)
    roles = roles or roles_from_grids(rows)
    groups: Dict[tuple, List[Dict[str, str]]] = collections.defaultdict(list)
    for r in rows:
        groups[(r["Process ID"], r["Kernel Name"])].append(r)
    out = []
    for (pid, name), rs in sorted(groups.items()):
        role = roles.get(pid, "unknown")
        d = [num(r["gpu__time_duration.sum"]) for r in rs]
        inst = [num(r.get("smsp__inst_executed.sum", "")) for r in rs]
        tail = d[WARMUP:] or d
        out.append({"role": ROLE_OF.get((role, kernel_base(name)), f"{role} {name}"),
                    "kernel": kernel_base(name), "form": kernel_form(name), "pid": pid,
                    "grid": rs[0]["Grid Size"], "launches": len(d),
                    "duration_us": d, "duration_median_us": statistics.median(tail),
                    "inst_executed_median": statistics.median(inst[WARMUP:] or inst)})
    return out


def source_blocks(path: str) -> List[List[Dict[str, str]]]:
    """Per profiled result, its SASS rows from a ``--page source`` export."""
    blocks: List[List[Dict[str, str]]] = []
    head: Optional[List[str]] = None
    with open(path) as f:
        for r in csv.reader(f):
            if not r:
                continue
            if r[0] == "Kernel Name":
                blocks.append([])
                head = None
            elif r[0] == "Address":
                head = r
            elif head is not None and blocks:
                blocks[-1].append(dict(zip(head, r)))
    return blocks


def sampling(details: str, source: str, roles: Optional[Dict[str, str]] = None
             ) -> List[Dict[str, Any]]:
    """Stall reasons (fractions of the samples) of every sampled result. The results' order in
    the source page is the details page's; a templated kernel's block may appear twice there
    (the same rows), so a page with twice the blocks takes every other one."""
    with open(details) as f:
        rows = list(csv.DictReader(f))
    results: Dict[str, Dict[str, str]] = {}
    for r in rows:
        results.setdefault(r["ID"], r)
    order = sorted(results, key=int)
    roles = roles or roles_from_grids(list(results.values()))
    blocks = source_blocks(source)
    if len(blocks) == 2 * len(order):
        blocks = blocks[::2]
    if len(blocks) != len(order):
        raise SystemExit(f"{source}: {len(blocks)} source blocks for {len(order)} results")
    out = []
    for rid, block in zip(order, blocks):
        r = results[rid]
        stalls: collections.Counter = collections.Counter()
        for x in block:
            for k, v in x.items():
                if k.startswith("stall_") and "Not Issued" not in k:
                    stalls[k[len("stall_"):]] += num(v)
        total = sum(stalls.values()) or 1.0
        role = roles.get(r["Process ID"], "unknown")
        out.append({"role": ROLE_OF.get((role, kernel_base(r["Kernel Name"])), role),
                    "kernel": kernel_base(r["Kernel Name"]), "form": kernel_form(r["Kernel Name"]),
                    "result": int(rid), "samples": int(total),
                    "inst_executed": int(sum(num(x.get("Instructions Executed", "")) for x in block)),
                    "stall_fraction": {k: round(v / total, 4) for k, v in stalls.most_common()},
                    "hot": hot_instructions(block, total),
                    "spans": timer_spans(block, total)})
    return out


def row_stalls(x: Dict[str, str]) -> collections.Counter:
    """One SASS row's samples per stall reason (the issued and not-issued columns together)."""
    c: collections.Counter = collections.Counter()
    for k, v in x.items():
        if k.startswith("stall_") and "Not Issued" not in k and num(v):
            c[k[len("stall_"):]] += num(v)
    return c


def hot_instructions(block: List[Dict[str, str]], total: float, n: int = HOT
                     ) -> List[Dict[str, Any]]:
    """The n SASS instructions with the most samples: where a warp of this kernel waits."""
    rows = [(sum(row_stalls(x).values()), x) for x in block]
    rows = sorted((t for t in rows if t[0] > 0), key=lambda t: -t[0])[:n]
    return [{"address": x.get("Address", ""), "sass": x.get("Source", "").strip(),
             "fraction": round(v / total, 4),
             "stalls": {k: int(c) for k, c in row_stalls(x).most_common(3)}} for v, x in rows]


def timer_spans(block: List[Dict[str, str]], total: float) -> List[Dict[str, Any]]:
    """Samples per span of code between %globaltimer reads (the trace stamps and deadlines,
    as scripts/sass_spans.py prints them), in address order: which stage's code the warps sat
    in. A span starts at its timer read; the first one at the kernel's first instruction."""
    def addr(x: Dict[str, str]) -> int:
        try:
            return int(x.get("Address", ""), 16)
        except ValueError:
            return -1
    spans: List[Dict[str, Any]] = []
    for x in sorted(block, key=addr):
        if not spans or "SR_GLOBALTIMER" in x.get("Source", ""):
            spans.append({"start": x.get("Address", ""), "instructions": 0, "samples": 0.0})
        spans[-1]["instructions"] += 1
        spans[-1]["samples"] += sum(row_stalls(x).values())
    return [{"start": s["start"], "instructions": s["instructions"],
             "fraction": round(s["samples"] / total, 4)} for s in spans]


def lockstep_roles(path: str) -> Optional[Dict[str, str]]:
    """{pid: role} from a benchmarks.lockstep JSON (None when absent or without pids)."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        ranks = json.load(f).get("ranks") or []
    roles = {str(r["pid"]): r["role"] for r in ranks if "pid" in r}
    return roles or None


def summarize(d: str, cell: str) -> Dict[str, Any]:
    doc: Dict[str, Any] = {"cell": cell, "durations": {}, "sampling": None}
    for cc in ("all", "none"):
        p = os.path.join(d, f"dur-{cell}-cc{cc}.csv")
        if os.path.exists(p):
            roles = lockstep_roles(os.path.join(d, f"dur-{cell}-cc{cc}.json"))
            doc["durations"][f"cache_control_{cc}"] = durations(p, roles)
    det = os.path.join(d, f"samp-{cell}-details.csv")
    src = os.path.join(d, f"samp-{cell}-source.csv")
    if os.path.exists(det) and os.path.exists(src):
        doc["sampling"] = sampling(det, src, lockstep_roles(os.path.join(d, f"samp-{cell}.json")))
    return doc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--cell", required=True, help="e.g. tokens-T1")
    p.add_argument("--commit", default=None)
    p.add_argument("--machine", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    doc = summarize(args.dir, args.cell)
    doc.update({"commit": args.commit, "machine": args.machine})
    for k, rows in doc["durations"].items():
        for r in rows:
            print(f"{k:20s} {r['role']:11s} {r['form']:2s} median {r['duration_median_us']:6.2f} us "
                  f"inst {r['inst_executed_median']:9.0f} ({r['launches']} launches)")
    for s in doc["sampling"] or []:
        top = ", ".join(f"{k} {v * 100:.0f}%" for k, v in list(s["stall_fraction"].items())[:5])
        print(f"sampled #{s['result']} {s['role']:11s} {s['samples']:5d} samples: {top}")
        for h in s["hot"][:5]:
            why = ", ".join(f"{k} {v}" for k, v in h["stalls"].items())
            print(f"    {h['address']:>8s} {h['fraction'] * 100:5.1f}%  {h['sass'][:60]:60s} {why}")
        spans = "  ".join(f"{x['start']}:{x['fraction'] * 100:.0f}%" for x in s["spans"])
        print(f"    by %globaltimer span: {spans}")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
