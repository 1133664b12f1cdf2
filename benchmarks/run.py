"""One command for the communication-only AFD round trip on this machine's GPUs.

    python -m benchmarks.run [--layout 1A1F] [--hidden 2048 4096 7168] [--dtype bf16 fp8]
                             [--routing random skewed] [--tokens 1 8 32 128 512 2048]
                             [--arms afdep symmetric nccl nccl_bare] [--repeats 3]
                             [--receive-layouts experts tokens] [--gpus N]
                             [--replays 200] [--quick] [--dry-run]

Arms (same contract, docs/contract.md): ``afdep`` (role-aware kernels), ``symmetric`` (the
same kernels with AFDEP_SYMMETRIC=1), ``nccl`` (all_to_all_single + torch ops), and
``nccl_bare`` (one bare all_to_all_single each way, a reference line); on request
``afdep_alt`` (the afdep arm plus ``--alt-env`` controls: an A/B of one change in one run). Every arm but
``nccl_bare`` runs each receive layout (``Config(receive_layout=...)``: "experts", "tokens");
``nccl_bare`` does not depend on it and runs once per cell. Each repeat spawns one fresh
process group per (arm, layout) covering all cells of both receive layouts, arms
interleaved (rotated each repeat). Writes results/benchmarks/<machine>-<date>.{json,md,png} (``--out-dir``).
Method and caveats: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from torch_afdep import env as afdep_env
from torch_afdep import mps

from . import common, report

DEFAULTS = dict(experts=128, top_k=8, capacity=2048, sms=24, hidden=[2048, 4096, 7168],
                dtype=["bf16", "fp8"], routing=["random", "skewed"],
                tokens=[1, 8, 32, 128, 512, 2048], layout=["1A1F"], repeats=3, replays=200,
                arms=["afdep", "symmetric", "nccl", "nccl_bare"],
                receive_layouts=["experts", "tokens"])
QUICK = dict(hidden=[2048], dtype=["bf16"], routing=["random"], tokens=[1, 128], repeats=2,
             replays=30, warmup=5)
ARMS = ("afdep", "afdep_alt", "symmetric", "nccl", "nccl_bare")
#: Arms that run the torch_afdep kernels (afdep_alt: the afdep arm with --alt-env on top)
KERNEL_ARMS = ("afdep", "afdep_alt", "symmetric")
RECEIVE_LAYOUTS = ("experts", "tokens")
ARM_ENV = {"afdep": {}, "afdep_alt": {}, "symmetric": {afdep_env.SYMMETRIC: "1"}, "nccl": {},
           "nccl_bare": {}}
ARM_BACKEND = {"afdep": "gloo", "afdep_alt": "gloo", "symmetric": "gloo",
               "nccl": "cpu:gloo,cuda:nccl", "nccl_bare": "cpu:gloo,cuda:nccl"}
_LAYOUT_RE = re.compile(r"^(\d+)A(\d+)F$", re.IGNORECASE)


# ---- arguments ----------------------------------------------------------------------------
def parse_layout(text: str):
    """'3A1F' -> (3, 1) (Attention ranks, FFN ranks)."""
    m = _LAYOUT_RE.match(text.strip())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(
            f"layout must look like 1A1F, 2A2F, 3A1F, 7A1F (Attention ranks A, FFN ranks F), "
            f"got {text!r}")
    return int(m.group(1)), int(m.group(2))


def _layout_arg(text: str) -> str:
    a, f = parse_layout(text)
    return f"{a}A{f}F"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Communication-only AFD round trip (dispatch + combine) under CUDA graphs: "
                    "afdep vs symmetric vs NCCL all_to_all_single.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("grid")
    g.add_argument("--layout", nargs="+", type=_layout_arg, default=None,
                   help="layouts xAyF; group ranks [0,F) are FFN, the rest Attention, rank r "
                        "on GPU r %% n_gpus (default 1A1F)")
    g.add_argument("--hidden", nargs="+", type=int, default=None,
                   help="hidden sizes (default 2048 4096 7168)")
    g.add_argument("--dtype", nargs="+", choices=("bf16", "fp8"), default=None,
                   help="dispatch payload (default bf16 fp8); combine is BF16")
    g.add_argument("--routing", nargs="+", choices=("random", "skewed"), default=None,
                   help="torch_afdep.reference.random_routing kinds (default random skewed)")
    g.add_argument("--tokens", nargs="+", type=int, default=None,
                   help="tokens per Attention rank; bucket = T (default 1 8 32 128 512 2048)")
    g.add_argument("--zero-copy", action="store_true",
                   help="afdep arms collect with source_collect(zero_copy=True) in layouts "
                        "with one FFN rank (a view of the receive buffer, no copy)")
    g.add_argument("--no-flag-probe", action="store_true",
                   help="skip the flag round-trip probe of the afdep worlds (the floor's "
                        "latency term)")
    g.add_argument("--afdep-env", nargs="+", default=[], metavar="NAME=VALUE",
                   help="protocol controls for the afdep arm only, e.g. AFDEP_RAW_META=1: "
                        "an experimental change against the symmetric and NCCL arms in one "
                        "run (the symmetric arm stays fully reverted)")
    g.add_argument("--alt-env", nargs="+", default=[], metavar="NAME=VALUE",
                   help="protocol controls for the afdep_alt arm, on top of --afdep-env: one "
                        "change against the afdep arm in the same run (fresh worlds, arms "
                        "interleaved, paired repeats: the 'afdep_alt vs afdep' row)")
    g.add_argument("--arms", nargs="+", choices=ARMS, default=None,
                   help="arms to run (default afdep symmetric nccl nccl_bare; afdep_alt "
                        "needs --alt-env)")
    g.add_argument("--receive-layouts", nargs="+", choices=RECEIVE_LAYOUTS, default=None,
                   help="Config.receive_layout of the afdep, symmetric and nccl arms, each "
                        "measured in the same worlds (default experts tokens); nccl_bare "
                        "runs once per cell whatever this says")
    g.add_argument("--experts", type=int, default=DEFAULTS["experts"])
    g.add_argument("--top-k", type=int, default=DEFAULTS["top_k"])
    g.add_argument("--capacity", type=int, default=DEFAULTS["capacity"],
                   help="capacity_tokens_per_rank of the afdep buffers")
    g.add_argument("--sms", type=int, default=DEFAULTS["sms"],
                   help="Config.num_sms of the afdep arms")
    g.add_argument("--local-sms", type=int, default=0,
                   help="Config.local_sms of the afdep arms (0: the default, one CTA per SM "
                        "divided among the ranks sharing a GPU)")
    g.add_argument("--gpus", type=int, default=0,
                   help="GPUs to spread ranks over (0 = every visible GPU; with --dry-run, "
                        "the GPU count to plan for)")
    m = p.add_argument_group("method")
    m.add_argument("--repeats", type=int, default=None, help="fresh process groups per arm "
                   "(default 3)")
    m.add_argument("--replays", type=int, default=None, help="timed graph replays per cell "
                   "(default 200)")
    m.add_argument("--warmup", type=int, default=10, help="untimed replays per cell")
    common.add_timing_args(m, queue_ahead_us=200.0, attention_delay_us=300.0)
    m.add_argument("--eager-arms", nargs="*", choices=ARMS, default=[],
                   help="fallback: time these arms' steps eagerly instead of as CUDA graph "
                        "replays (rows say graph: false; the tables mark them)")
    m.add_argument("--eager-steps", type=int, default=2,
                   help="eager exchanges before capture (checked on Attention ranks)")
    m.add_argument("--seed", type=int, default=1234)
    m.add_argument("--quick", action="store_true",
                   help="tiny smoke grid: H2048 bf16 random, T 1 128, 2 repeats, 30 replays "
                        "(explicit flags still win)")
    r = p.add_argument_group("robustness and output")
    r.add_argument("--world-timeout", type=float, default=0,
                   help="seconds before a world (one arm, one layout, one repeat) is killed; "
                        "0 = estimated from the grid")
    r.add_argument("--stall-timeout", type=float, default=120.0,
                   help="end a world whose ranks record nothing for this many seconds "
                        "(0 = only --world-timeout)")
    r.add_argument("--kernel-timeout", type=float, default=20.0,
                   help="Config.timeout_s of the afdep buffers (a stuck wait raises)")
    r.add_argument("--time-budget", type=float, default=460,
                   help="seconds; do not start a world that would likely end past it (the "
                        "results then say complete: false); 0 = no budget")
    r.add_argument("--peer-copy-mib", type=int, default=1024,
                   help="size of the peer-copy ceiling measurement (0 = skip)")
    r.add_argument("--check-tol", type=float, default=2e-2,
                   help="relative error above which an arm's output is marked wrong")
    common.add_output_args(r, "output stem (default <machine>-<date>)")
    r.add_argument("--no-plot", action="store_true")
    r.add_argument("--keep-raw", action="store_true",
                   help="keep the per-rank JSONL records next to the results")
    r.add_argument("--cpu-smoke", action="store_true",
                   help="exercise the whole harness on the CPU over gloo (eager steps "
                        "instead of graphs, wall-clock timing): the numbers mean nothing")
    r.add_argument("--dry-run", action="store_true",
                   help="print the plan and a time estimate, run nothing (no GPU needed)")
    return p


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    for k, v in DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, QUICK[k] if args.quick and k in QUICK else v)
    if args.quick and "--warmup" not in (argv if argv is not None else sys.argv[1:]):
        args.warmup = QUICK["warmup"]
    _validate(p, args)
    return args


def _validate(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.replays < 1:
        p.error("--replays must be >= 1")
    common.check_timing_args(p, args)
    if args.warmup < 0 or args.eager_steps < 1:
        p.error("--warmup must be >= 0 and --eager-steps >= 1")
    args.afdep_env_vars = common.parse_afdep_env(p, args.afdep_env)
    args.alt_env_vars = common.parse_afdep_env(p, args.alt_env, "--alt-env")
    if ("afdep_alt" in args.arms) != bool(args.alt_env):
        p.error("the afdep_alt arm and --alt-env go together: --arms ... afdep_alt "
                "--alt-env NAME=VALUE ...")
    bad = [t for t in args.tokens if t < 1 or t > args.capacity]
    if bad:
        p.error(f"--tokens must be in [1, --capacity={args.capacity}], got {bad}")
    for h in args.hidden:
        if h % 128 != 0 and "fp8" in args.dtype:
            p.error(f"--hidden {h}: FP8 needs a multiple of 128")
        if h % 8 != 0:
            p.error(f"--hidden {h}: must be a multiple of 8")
    for lay in args.layout:
        a, f = parse_layout(lay)
        if args.experts % f != 0:
            p.error(f"--experts {args.experts} is not divisible by F={f} of layout {lay} "
                    f"(each FFN rank owns E/F experts); pick --experts accordingly, e.g. "
                    f"{args.experts - args.experts % f}")
    if args.gpus < 0:
        p.error("--gpus must be >= 0")
    common.check_local_sms(p, args)
    if args.top_k < 1 or args.top_k > args.experts:
        p.error("--top-k must be in [1, --experts]")
    args.arms = list(dict.fromkeys(args.arms))
    args.layout = list(dict.fromkeys(args.layout))
    args.receive_layouts = list(dict.fromkeys(args.receive_layouts))


# ---- plan ---------------------------------------------------------------------------------
def make_plan(args: argparse.Namespace, n_gpus: int) -> Dict[str, Any]:
    """Cells: receive layout outermost, so a world runs every expert-layout cell before the
    token-layout ones (one buffer per (receive layout, hidden, dtype) at a time, and a failure
    in one layout that ends the world leaves the other's cells measured)."""
    cells = [{"receive_layout": rl, "hidden": h, "dtype": d, "routing": r, "tokens": t}
             for rl in args.receive_layouts for h in args.hidden for d in args.dtype
             for r in args.routing for t in args.tokens]
    layouts = []
    for lay in args.layout:
        a, f = parse_layout(lay)
        layouts.append({"name": lay, "attention": a, "ffn": f,
                        "gpus": report.gpu_of_ranks(a + f, n_gpus)})
    return {"cells": cells, "layouts": layouts, "arms": list(args.arms),
            "receive_layouts": list(args.receive_layouts), "repeats": args.repeats, "experts": args.experts, "top_k": args.top_k,
            "capacity": args.capacity, "sms": args.sms, "local_sms": args.local_sms}


def arm_order(arms: List[str], repeat: int) -> List[str]:
    """Arms rotated by the repeat index, so no arm always runs first (or last)."""
    k = repeat % max(len(arms), 1)
    return arms[k:] + arms[:k]


def ranks_per_gpu(gpus: List[int]) -> int:
    """The most ranks of one layout placed on any one GPU."""
    return max((gpus.count(g) for g in set(gpus)), default=0)


def skip_reason(arm: str, world: int, n_gpus: int, probe: Dict[str, Any],
                cpu_smoke: bool = False, gpus: Optional[List[int]] = None) -> Optional[str]:
    """Why ``arm`` cannot run a layout of ``world`` ranks here (None: it can). ``gpus``, the
    layout's GPU of every rank, also checks that ranks sharing a GPU have CUDA MPS (without
    it the afdep arms' spinning kernels time-slice the GPU: ~1,000x slower)."""
    if cpu_smoke:
        return None
    if arm in ("nccl", "nccl_bare") and world > n_gpus:
        return (f"NCCL needs one GPU per rank: {world} ranks on {n_gpus} GPU(s)")
    if arm in KERNEL_ARMS and gpus is not None:
        problem = mps.shared_gpu_problem(ranks_per_gpu(gpus))
        if problem:
            return problem
    if arm in KERNEL_ARMS and probe.get("afdep_cuda_ext") is False:
        return ("torch_afdep._cuda does not import ("
                f"{probe.get('afdep_cuda_ext_error')}); build it: "
                "AFDEP_BUILD_CUDA=1 pip install --no-build-isolation --no-deps -e .")
    return None


def estimate_world_s(n_cells: int, args: argparse.Namespace, world: int) -> float:
    """Rough wall time of one world: start-up plus per cell (set-up, eager, capture, and
    replays at ~0.5 ms each with the per-replay alignment)."""
    per_replay = 0.0003 + 0.00005 * world
    per_cell = (0.15 + (args.warmup + args.replays) * per_replay
                + args.replays * args.attention_delay_us * 1e-6)
    return 12.0 + n_cells * per_cell


def default_world_timeout(n_cells: int, args: argparse.Namespace, world: int) -> float:
    return 120.0 + 4.0 * estimate_world_s(n_cells, args, world)


# ---- machine facts ------------------------------------------------------------------------
def env_info(probe: Dict[str, Any], stripped: Dict[str, str]) -> Dict[str, Any]:
    sw = common.software()
    return {"torch": sw["torch"], "cuda": sw["cuda"], "nccl": probe.get("nccl_version"),
            "python": sw["python"], "host": sw["host"], "vars": common.recorded_env(),
            "child_vars": dict(common.CHILD_ENV), "arm_vars": ARM_ENV,
            "stripped_from_parent": stripped}


def _strip_control_env() -> Dict[str, str]:
    """Protocol controls in the parent's environment would leak into every arm; the arms set
    their own. Remove them (recorded in the JSON)."""
    names = {afdep_env.SYMMETRIC, *afdep_env.CONTROLS}
    stripped = {}
    for k in list(os.environ):
        if k in names:
            stripped[k] = os.environ.pop(k)
    return stripped


# ---- progress -----------------------------------------------------------------------------
class Progress:
    """tqdm when importable, else a one-line counter on stderr."""

    def __init__(self, total: int, disable: bool = False):
        self.total, self.n = total, 0
        self._bar = None
        self._t0 = time.monotonic()
        self._disable = disable
        self._desc = ""
        if not disable:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="cell", dynamic_ncols=True, file=sys.stderr)
            except Exception:
                self._bar = None

    def set(self, n: int, desc: str = "") -> None:
        n = min(n, self.total)
        if n == self.n and not desc:
            return
        delta, self.n = n - self.n, n
        if self._disable:
            return
        if self._bar is not None:
            if desc:
                self._bar.set_description(desc, refresh=False)
            self._bar.update(delta)
        else:
            el = time.monotonic() - self._t0
            if sys.stderr.isatty():
                sys.stderr.write(f"\r[{self.n}/{self.total}] {el:6.0f}s {desc[:60]:<60}")
            elif delta or desc != self._desc:  # logs: one line per change
                sys.stderr.write(f"[{self.n}/{self.total}] {el:.0f}s {desc}\n")
            sys.stderr.flush()
        self._desc = desc

    def close(self) -> None:
        if self._disable:
            return
        if self._bar is not None:
            self._bar.close()
        elif sys.stderr.isatty():
            sys.stderr.write("\n")


def _count_cells(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for ln in f if '"kind": "cell"' in ln)
    except OSError:
        return 0


def _records_size(dir_: str, world: int) -> int:
    total = 0
    for r in range(world):
        try:
            total += os.path.getsize(os.path.join(dir_, f"rank{r}.jsonl"))
        except OSError:
            pass
    return total


def _kill_world(dir_: str, world: int) -> List[int]:
    """SIGKILL the processes of one world, by the ids they recorded (only ours)."""
    killed = []
    for r, ent in read_rank_files(dir_, world).items():
        pid = (ent.get("start") or {}).get("pid")
        if not pid or pid == os.getpid():
            continue
        try:
            os.kill(int(pid), signal.SIGKILL)
            killed.append(int(pid))
        except (OSError, ValueError):
            pass
    return killed


def read_rank_files(dir_: str, world: int) -> Dict[int, Dict[str, Any]]:
    ranks: Dict[int, Dict[str, Any]] = {}
    for r in range(world):
        ent: Dict[str, Any] = {"start": None, "meta": None, "cells": {}, "end": None}
        try:
            with open(os.path.join(dir_, f"rank{r}.jsonl")) as f:
                for ln in f:
                    try:
                        rec = json.loads(ln)
                    except ValueError:
                        continue  # a line cut short by a kill
                    kind = rec.pop("kind", None)
                    if kind == "start":
                        ent["start"] = rec
                    elif kind == "meta":
                        ent["meta"] = rec
                    elif kind == "cell":
                        ent["cells"][rec["index"]] = rec
                    elif kind == "end":
                        ent["end"] = rec
        except OSError:
            pass
        ranks[r] = ent
    return ranks


def parse_inject(text: str) -> List[Dict[str, Any]]:
    """Test hook: AFDEP_BENCH_INJECT="arm,cell_index,rank,phase;..." makes that rank raise in
    that phase (setup, eager, replay) of that cell. Arm '*' = any arm."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        arm, index, rank, phase = [x.strip() for x in part.split(",")]
        out.append({"arm": None if arm == "*" else arm, "index": int(index),
                    "rank": int(rank), "phase": phase})
    return out


# ---- one world ----------------------------------------------------------------------------
def run_world(arm: str, layout: Dict[str, Any], repeat: int, plan: Dict[str, Any],
              args: argparse.Namespace, work_dir: str, progress: Progress, done_before: int,
              timeout: float) -> Dict[str, Any]:
    from .arms import world_main

    world = layout["attention"] + layout["ffn"]
    out_dir = os.path.join(work_dir, f"{layout['name']}-{arm}-r{repeat}")
    os.makedirs(out_dir, exist_ok=True)
    spec = {"arm": arm, "repeat": repeat, "attention_ranks": layout["attention"],
            "ffn_ranks": layout["ffn"], "experts": args.experts, "top_k": args.top_k,
            "capacity": args.capacity, "sms": args.sms, "local_sms": args.local_sms,
            "kernel_timeout_s": args.kernel_timeout,
            "ctrl_timeout_s": max(60.0, 3 * args.kernel_timeout), "cells": plan["cells"],
            "indices": report.arm_cells(arm, plan),
            "warmup": args.warmup, "replays": args.replays, "eager_steps": args.eager_steps,
            "seed": args.seed, "check_tol": args.check_tol, "out_dir": out_dir,
            "attention_delay_us": 0.0 if args.cpu_smoke else args.attention_delay_us,
            "queue_ahead_us": 0.0 if args.cpu_smoke else args.queue_ahead_us,
            "eager_arms": list(args.eager_arms),
            "zero_copy": bool(args.zero_copy),
            "flag_probe": not args.no_flag_probe,
            "device": "cpu" if args.cpu_smoke else "cuda",
            "inject": parse_inject(afdep_env.get("AFDEP_BENCH_INJECT"))}
    env = dict(ARM_ENV[arm])
    if arm in ("afdep", "afdep_alt"):
        env.update(args.afdep_env_vars)
    if arm == "afdep_alt":
        env.update(args.alt_env_vars)
    desc = f"r{repeat} {layout['name']} {arm}"
    seen = {"size": -1, "changed": time.monotonic(), "stalled": None}

    def watch() -> None:
        """Progress, and the stall watchdog: a world whose ranks record nothing for
        --stall-timeout seconds has its processes ended."""
        progress.set(done_before + _count_cells(os.path.join(out_dir, "rank0.jsonl")), desc)
        size = _records_size(out_dir, world)
        if size != seen["size"]:
            seen["size"], seen["changed"] = size, time.monotonic()
        elif (seen["stalled"] is None and args.stall_timeout > 0
              and time.monotonic() - seen["changed"] > args.stall_timeout):
            seen["stalled"] = (f"no progress for {args.stall_timeout:.0f} s: ended the "
                               f"world's processes {_kill_world(out_dir, world)}")
            sys.stderr.write(f"\nworld {desc}: {seen['stalled']}\n")

    t0 = time.monotonic()
    try:
        _, error = common.spawn(
            world_main, world, spec, timeout=timeout, env=env, watch=watch,
            backend="gloo" if args.cpu_smoke else ARM_BACKEND[arm],
            device_ids=None if args.cpu_smoke else layout["gpus"])
    except BaseException:
        _kill_world(out_dir, world)  # interrupted: leave no rank holding a GPU
        raise
    if seen["stalled"]:
        error = seen["stalled"] + "\n" + (error or "")
    ranks = read_rank_files(out_dir, world)
    entry = {"arm": arm, "layout": layout["name"], "repeat": repeat,
             "status": "failed" if error else "ran", "error": error,
             "wall_s": time.monotonic() - t0, "ranks": ranks, "out_dir": out_dir}
    return entry


def world_summary(w: Dict[str, Any]) -> Dict[str, Any]:
    out = {k: w.get(k) for k in ("arm", "layout", "repeat", "status", "error", "wall_s")}
    metas = [r.get("meta") or {} for r in (w.get("ranks") or {}).values()]
    flags = sorted({m.get("afdep_flags_env") for m in metas} - {None})
    if w.get("arm") not in KERNEL_ARMS:
        flags = []
    out["afdep_flags"] = flags[0] if len(flags) == 1 else (flags or None)
    out["gpus"] = sorted({m.get("gpu") for m in metas} - {None})
    return out


def sanity_notes(rows: List[Dict[str, Any]], raw: List[Dict[str, Any]]) -> List[str]:
    """Warnings that would make a comparison meaningless."""
    notes = []
    for w in raw:
        f = world_summary(w)["afdep_flags"]
        if w["arm"] == "symmetric" and f not in (None, 0):
            notes.append(f"WARNING: symmetric arm repeat {w['repeat']} ran with protocol "
                         f"flags {f}, not 0 (AFDEP_SYMMETRIC=1 did not revert every control)")
        if w["arm"] in ("afdep", "afdep_alt") and f == 0:
            notes.append(f"WARNING: {w['arm']} arm repeat {w['repeat']} ran with every control "
                         "off (flags 0): it measured the symmetric protocol")
    for r in rows:
        if r["arm"] in KERNEL_ARMS and r.get("afdep_flags") is not None:
            if (r["arm"] == "symmetric") != (r["afdep_flags"] == 0):
                notes.append(f"WARNING: {r['arm']} {r['layout']} H{r['hidden']} {r['dtype']}: "
                             f"transport flags {r['afdep_flags']}")
                break
    wrong = [r for r in rows if r["status"] == "wrong"]
    if wrong:
        notes.append(f"WARNING: {len(wrong)} rows produced wrong outputs (status 'wrong')")
    return notes


def build_doc(raw: List[Dict[str, Any]], plan: Dict[str, Any], probe: Dict[str, Any],
              machine: Dict[str, Any], args: Dict[str, Any], started: datetime.datetime,
              t_start: float, notes: List[str], stripped: Dict[str, str], final: bool,
              complete: bool) -> Dict[str, Any]:
    """The results document (what the JSON holds and the Markdown/plot are made from)."""
    rows, comps = report.aggregate(raw, plan, probe.get("peer_copy_ceiling_GBps"))
    return {"schema": report.SCHEMA, "machine": machine, "commit": common.git_commit(),
            "started": started.isoformat(timespec="seconds"),
            "finished": datetime.datetime.now().isoformat(timespec="seconds") if final
            else None,
            "wall_s": time.monotonic() - t_start, "complete": complete,
            "env": env_info(probe, stripped), "args": args, "plan": plan, "probe": probe,
            "method": METHOD, "notes": list(notes) + sanity_notes(rows, raw),
            "worlds": [world_summary(w) for w in raw],
            "registered": report.registered_summary(rows),
            "targets": report.targets(rows),
            "results": rows, "comparisons": comps}


# ---- main ---------------------------------------------------------------------------------
def _probe(args, n_gpus: int) -> Dict[str, Any]:
    from .probe import probe_main

    ranks, error = common.spawn(probe_main, 1, {"peer_copy_mib": args.peer_copy_mib,
                                                "iters": 8}, timeout=180, device_ids=[0])
    if ranks is None:
        return {"errors": [f"probe failed: {error}"], "peer_copy_GBps": {},
                "peer_copy_ceiling_GBps": None}
    return ranks[0]


def estimate_run_s(args: argparse.Namespace, plan: Dict[str, Any], n_gpus: int) -> float:
    """Estimated wall time of the whole run: every world that is not skipped, each repeat."""
    total = 0.0
    for lay in plan["layouts"]:
        world = lay["attention"] + lay["ffn"]
        for arm in plan["arms"]:
            if n_gpus and skip_reason(arm, world, n_gpus, {}):
                continue
            total += estimate_world_s(len(report.arm_cells(arm, plan)), args, world)
    return total * args.repeats


def _dry_run(args, plan, n_gpus: int) -> int:
    n = len(plan["cells"])
    print(f"{n} cells ({' + '.join(plan['receive_layouts'])} receive layouts; nccl_bare runs "
          f"{len(report.arm_cells('nccl_bare', plan))}) x {len(plan['arms'])} arms x "
          f"{args.repeats} repeats x {len(plan['layouts'])} layout(s); {args.replays} timed "
          f"replays per cell")
    for lay in plan["layouts"]:
        world = lay["attention"] + lay["ffn"]
        print(f"  {lay['name']}: {world} ranks on GPUs {lay['gpus']}")
        for arm in plan["arms"]:
            why = skip_reason(arm, world, n_gpus, {}, gpus=lay["gpus"]) if n_gpus else None
            if why:
                print(f"    {arm}: skipped ({why})")
            else:
                est = estimate_world_s(len(report.arm_cells(arm, plan)), args, world)
                print(f"    {arm}: ~{est:.0f} s per world")
    total = estimate_run_s(args, plan, n_gpus)
    print(f"estimated wall time: ~{total / 60:.1f} min (plus ~20 s of probes; arms skipped "
          "above only for want of MPS are counted, as if it ran)")
    if args.time_budget > 0 and total > args.time_budget:
        print(f"note: more than --time-budget {args.time_budget:.0f} s: the run would stop "
              "starting worlds there (raise --time-budget, or fewer --repeats / cells)")
    return 0


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    started = datetime.datetime.now()
    t_start = time.monotonic()
    import torch

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.gpus:
        if args.gpus > n_gpus and not args.dry_run:
            print(f"benchmarks.run: --gpus {args.gpus} but only {n_gpus} visible",
                  file=sys.stderr)
            return 2
        n_gpus = args.gpus
    plan = make_plan(args, max(n_gpus, 1))
    if args.dry_run:
        return _dry_run(args, plan, n_gpus)
    if args.cpu_smoke:
        n_gpus = 0
    elif n_gpus == 0:
        print("benchmarks.run: no CUDA GPU visible (torch.cuda.is_available() is False); "
              "this benchmark needs at least one GPU, two for NVLink numbers. "
              "Use --dry-run to see the plan.", file=sys.stderr)
        return 2
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C so the results written so far get
    # their Markdown and plot.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    stripped = _strip_control_env()
    if stripped:
        print(f"benchmarks.run: ignoring protocol controls set in the environment "
              f"{sorted(stripped)}: each arm sets its own", file=sys.stderr)
    os.environ.update(common.CHILD_ENV)

    probe = _probe(args, n_gpus) if not args.cpu_smoke else {
        "peer_copy_GBps": {}, "peer_copy_ceiling_GBps": None, "errors": ["--cpu-smoke"]}
    smi = common.nvidia_smi() if not args.cpu_smoke else {}
    names = smi.get("names") or probe.get("gpus") or []
    machine = {"name": common.machine_name(names) or ("cpu-smoke" if args.cpu_smoke
                                                      else "unknown"),
               "gpus": names, "count": len(names) or n_gpus, "driver": smi.get("driver"),
               "capability": probe.get("capability"), "sm_count": probe.get("sm_count"),
               "gpus_used": n_gpus, "mps_running": mps.mps_running()}
    used = names[:n_gpus] if n_gpus else names
    stem = args.name or f"{common.machine_slug(used)}-{common.timestamp(started)}"
    paths = {ext: common.output_path(args.out_dir, stem, ext) for ext in ("json", "md", "png")}
    work_dir = tempfile.mkdtemp(prefix="afdep-bench-")
    notes = ["The data floor counts payload bytes only (FP8 scales included, ids/weights and "
             "protocol metadata not) on the busiest GPU-to-GPU link, each way at the "
             "measured peer-copy ceiling. 'floor + flag round trip' adds the round trip of "
             "a flag between the first Attention and the first FFN rank, measured in each "
             "afdep world by a one-thread ping-pong kernel over the same windows (CUDA "
             "only; 1,000 round trips after 100 warm-up ones).",
             "bucket = T in every cell; the FFN's stand-in 'expert' is the same in every arm "
             "and both receive layouts: a BF16 reply of ones made once per cell, whose first "
             "128 columns each step overwrites with the received rows' first 128 columns cast "
             "to BF16 (a few µs at most; no full-row cast of FP8 payloads). The output check "
             "compares those columns with the payload and the rest with the row counts.",
             "receive_layout 'experts' = expert-major rows (Received), 'tokens' = one row per "
             "token (TokenReceived); both layouts of one arm run in the same world of each "
             "repeat, experts first. nccl_bare does not depend on the layout: its rows say "
             "receive_layout 'any' and are timed once per cell.",
             "nccl_bare moves T x H elements of the payload dtype per pair in dispatch "
             "(1 byte for FP8, no scales) and T x H BF16 back."]
    if probe.get("peer_copy_ceiling_GBps") is None:
        notes.append("peer-copy ceiling not measured: "
                     + "; ".join(probe.get("errors") or ["fewer than 2 GPUs"]))

    raw: List[Dict[str, Any]] = []
    arm_n = {arm: len(report.arm_cells(arm, plan)) for arm in plan["arms"]}
    total = sum(arm_n.values()) * len(plan["layouts"]) * args.repeats
    progress = Progress(total)
    done = 0
    budget_stop: Optional[str] = None
    world_times: Dict[str, float] = {}

    def doc_now(final: bool) -> Dict[str, Any]:
        return build_doc(raw, plan, probe, machine, vars(args), started, t_start,
                         notes + ([budget_stop] if budget_stop else []), stripped, final,
                         complete=final and not budget_stop)

    try:
        for rep in range(args.repeats):
            for lay in plan["layouts"]:
                world = lay["attention"] + lay["ffn"]
                for arm in arm_order(plan["arms"], rep):
                    n_cells = arm_n[arm]
                    why = skip_reason(arm, world, n_gpus, probe, args.cpu_smoke,
                                      gpus=lay["gpus"])
                    if why is None and budget_stop is None and args.time_budget > 0:
                        est = world_times.get((lay["name"], n_cells),
                                              estimate_world_s(n_cells, args, world))
                        if time.monotonic() - t_start + est > args.time_budget:
                            budget_stop = (f"time budget {args.time_budget:.0f} s reached: "
                                           f"stopped before repeat {rep} {lay['name']} {arm}")
                    if budget_stop:
                        done += n_cells
                        progress.set(done)
                        continue
                    if why:
                        raw.append({"arm": arm, "layout": lay["name"], "repeat": rep,
                                    "status": "skipped", "error": why, "wall_s": 0.0,
                                    "ranks": {}})
                        done += n_cells
                        progress.set(done)
                        continue
                    timeout = args.world_timeout or default_world_timeout(n_cells, args, world)
                    ent = run_world(arm, lay, rep, plan, args, work_dir, progress, done,
                                    timeout)
                    raw.append(ent)
                    if ent["status"] == "ran":
                        key = (lay["name"], n_cells)
                        world_times[key] = max(world_times.get(key, 0.0), ent["wall_s"])
                    done += n_cells
                    progress.set(done)
                    if ent["error"]:
                        sys.stderr.write(f"\nworld {lay['name']} {arm} repeat {rep} failed: "
                                         f"{ent['error'][-800:]}\n")
                    common.write_json(paths["json"], doc_now(final=False))
    finally:
        progress.close()
        doc = doc_now(final=True)
        common.write_json(paths["json"], doc)
        try:
            report.write_markdown(paths["md"], doc)
        except Exception as e:  # noqa: BLE001  (the JSON is what matters)
            doc["notes"].append(f"Markdown failed: {type(e).__name__}: {e}")
        try:
            plot_note = "plot disabled (--no-plot)" if args.no_plot else \
                report.write_plot(paths["png"], doc)
        except Exception as e:  # noqa: BLE001
            plot_note = f"plot failed: {type(e).__name__}: {e}"
        if plot_note:
            doc["notes"].append(plot_note)
            common.write_json(paths["json"], doc)
        if args.keep_raw:
            dst = os.path.join(args.out_dir, f"{stem}-raw")
            shutil.copytree(work_dir, dst, dirs_exist_ok=True)
        shutil.rmtree(work_dir, ignore_errors=True)
    try:
        print(report.markdown(doc))
    except Exception:  # noqa: BLE001
        pass
    print(f"\nwrote {paths['json']}\n      {paths['md']}"
          + ("" if plot_note else f"\n      {paths['png']}"))
    bad = [r for r in doc["results"] if r["status"] not in ("ok", "skipped")]
    return 1 if bad and not any(r["status"] == "ok" for r in doc["results"]) else 0


METHOD = (
    "Each repeat spawns one fresh process group per (arm, layout) covering every cell; arm "
    "order rotates each repeat; a world runs both receive layouts (experts, then tokens). "
    "Per cell: fresh inputs (the same in every arm of a repeat), "
    "eager warm-up exchanges checked against the expected output, one CUDA graph per role "
    "step (Attention: dispatch + collect; FFN: receive + stand-in expert (the first 128 "
    "columns of each row copied into a precomputed BF16 reply) + reply), warm-up "
    "replays, then timed replays, each after torch.cuda.synchronize() and a gloo barrier, "
    "timed with CUDA events on Attention ranks. A repeat's latency is the max over Attention "
    "ranks of each rank's median; latency_us is the median over repeats; comparisons are the "
    "geometric mean of per-repeat paired ratios.")


if __name__ == "__main__":
    sys.exit(main())
