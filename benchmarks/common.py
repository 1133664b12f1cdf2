"""What every benchmark harness (``run``, ``overlap``, ``soak``, ``trace``) shares: the
command-line pieces, fresh-process worlds with timeouts, provenance (machine, commit,
software, environment) and result writing.

Kept in one place so that the harnesses cannot disagree on how a machine or a commit is
named, which environment a spawned rank gets, or where results go by default.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Where results go unless ``--out-dir`` says otherwise (created when a run writes).
DEFAULT_OUT_DIR = os.path.join(ROOT, "results", "benchmarks")

#: Result folders: changes there do not make a commit "-dirty" (a run writes into them).
RESULT_DIRS = ("results/",)

#: Every spawned rank of every harness: NVLink multicast (NVLS) stays off.
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
             "NVSHMEM_DISABLE_NVLS": "1"}

#: Environment variables recorded with results (what can change a measurement).
RECORDED_PREFIXES = ("AFDEP_", "NCCL_", "TORCH_NCCL", "CUDA_VISIBLE", "NVSHMEM_",
                     "TORCH_SYMM")


# ---- command line -------------------------------------------------------------------------
def add_output_args(p: argparse.ArgumentParser, name_help: str) -> None:
    """``--out-dir`` (default ``results/benchmarks``) and ``--name`` (the output stem)."""
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR,
                   help="folder of the result files (created when needed)")
    p.add_argument("--name", default=None, help=name_help)


def add_timing_args(p, queue_ahead_us: Optional[float], attention_delay_us: Optional[float]
                    ) -> None:
    """The two knobs of ``benchmarks.arms._time_graph``'s alignment, as every harness that
    times graph replays spells them (defaults may be None: filled in later)."""
    p.add_argument("--attention-delay-us", type=float, default=attention_delay_us,
                   help="host spin on the timing rank after each alignment, before timing, "
                        "so the peer's graphs are already launched and waiting; 0 = time "
                        "right after the barrier")
    p.add_argument("--queue-ahead-us", type=float, default=queue_ahead_us,
                   help="enqueue a ~N µs sleep kernel before the start event, so the host's "
                        "graph launch is not measured (0 = off; 2 x H200: the "
                        "graph.replay() call took 6-17 µs, and with 50 µs some fresh worlds "
                        "still ran late in a tenth of the replays)")


def check_timing_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 0 <= args.attention_delay_us <= 1e5:
        p.error("--attention-delay-us must be in [0, 100000]")
    if not 0 <= args.queue_ahead_us <= 1e4:
        p.error("--queue-ahead-us must be in [0, 10000]")


def check_local_sms(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--local-sms`` (Config.local_sms; 0 keeps Config's default), the same in every tool."""
    if not 0 <= args.local_sms <= 1024:
        p.error(f"--local-sms must be in [0, 1024] (0: the default), got {args.local_sms}")


def parse_afdep_env(p: argparse.ArgumentParser, items: List[str],
                    option: str = "--afdep-env") -> Dict[str, str]:
    """``--afdep-env NAME=0|1`` items (or ``option``'s) -> {NAME: value}; NAME must be a
    protocol control."""
    from torch_afdep import env

    out: Dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in env.CONTROLS or value not in ("0", "1"):
            p.error(f"{option} takes NAME=0|1 with NAME one of {sorted(env.CONTROLS)}, "
                    f"got {item!r}")
        out[name] = value
    return out


# ---- provenance ---------------------------------------------------------------------------
def _cmd(argv: List[str], timeout: float = 20.0) -> Optional[str]:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        return out.stdout.strip() if out.returncode == 0 else None
    except Exception:  # noqa: BLE001 (no git or nvidia-smi: the fact is just unknown)
        return None


def git_commit() -> str:
    """The commit results are recorded against: ``AFDEP_COMMIT`` when set (a copied tree
    without .git names itself), else git HEAD, + "-dirty" when the tree differs from it
    outside the result folders; "unknown" without either."""
    from torch_afdep import env

    named = env.get("AFDEP_COMMIT")
    if named:
        return named
    head = _cmd(["git", "rev-parse", "HEAD"]) or "unknown"
    status = _cmd(["git", "status", "--porcelain"])
    if status:
        paths = [ln[3:].strip().strip('"') for ln in status.splitlines()]
        if any(not path.startswith(RESULT_DIRS) for path in paths):
            head += "-dirty"
    return head


def nvidia_smi() -> Dict[str, Any]:
    """{"names": GPU names, "driver": version} from nvidia-smi; {} without it. Keeps the
    calling process off CUDA (the parent of a world should not hold a GPU context)."""
    out = _cmd(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if not out:
        return {}
    rows = [[c.strip() for c in ln.split(",")] for ln in out.splitlines() if ln.strip()]
    return {"names": [r[0] for r in rows],
            "driver": rows[0][1] if rows and len(rows[0]) > 1 else None}


def machine_slug(gpu_names: List[str]) -> str:
    """How result files name a machine: "h200x2" for two NVIDIA H200, "cpu" without GPUs."""
    if not gpu_names:
        return "cpu"
    words = gpu_names[0].replace("NVIDIA", "").split()
    base = (words[0] if words else "gpu").lower()
    return re.sub(r"[^a-z0-9._-]", "", f"{base}x{len(gpu_names)}")


def machine_name(gpu_names: List[str]) -> Optional[str]:
    """"2 × NVIDIA H200" (what the reports print); None without GPUs."""
    return f"{len(gpu_names)} × {gpu_names[0]}" if gpu_names else None


def software() -> Dict[str, Any]:
    """torch, CUDA and Python versions and the host name."""
    import torch

    return {"torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "host": platform.node()}


def recorded_env(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The variables of ``environ`` (default: os.environ) that results record, as set."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(RECORDED_PREFIXES)}


def timestamp(when: Optional[datetime.datetime] = None) -> str:
    """20261130-162649: the date part of default output stems."""
    return (when or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")


# ---- worlds -------------------------------------------------------------------------------
def spawn(fn: Callable[..., Any], world: int, *args: Any, timeout: float,
          device_ids: Optional[List[int]] = None, env: Optional[Dict[str, str]] = None,
          backend: str = "gloo", watch: Optional[Callable[[], None]] = None
          ) -> Tuple[Optional[List[Any]], Optional[str]]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes (``CHILD_ENV`` plus
    ``env`` in each). Returns (per-rank results, None), or (None, the error) when a rank
    failed or the world outlived ``timeout`` seconds: a failed world is an outcome to
    record, and the harness goes on.

    ``watch``, when given, is called about every 0.5 s while the world runs (a stall check,
    a progress bar); the world then waits on a helper thread. An interrupt (Ctrl-C) of the
    caller propagates from here."""
    from torch_afdep.testing import spawn_world

    child = dict(CHILD_ENV)
    child.update(env or {})
    out: Dict[str, Any] = {}

    def target() -> None:
        try:
            out["ranks"] = spawn_world(fn, world, *args, backend=backend, timeout=timeout,
                                       device_ids=device_ids, env=child)
        except Exception as e:  # noqa: BLE001 (recorded as the world's outcome)
            out["error"] = f"{type(e).__name__}: {e}"

    if watch is None:
        target()
    else:
        th = threading.Thread(target=target, daemon=True)
        th.start()
        while th.is_alive():
            th.join(timeout=0.5)
            watch()
    return out.get("ranks"), out.get("error")


# ---- output -------------------------------------------------------------------------------
def output_path(out_dir: str, stem: str, ext: str) -> str:
    """``<out_dir>/<stem>.<ext>``, the folder created on first use."""
    os.makedirs(out_dir, exist_ok=True)
    return os.path.join(out_dir, f"{stem}.{ext}")


def write_json(path: str, doc: Dict[str, Any]) -> None:
    """Write ``doc`` atomically (a killed run never leaves half a file); values JSON cannot
    hold are written as their str()."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
