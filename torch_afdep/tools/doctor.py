"""``python -m torch_afdep doctor``: what this machine has, what torch_afdep would use, and
whether a tiny exchange works.

    python -m torch_afdep doctor [--json] [--verbose] [--no-selftest]

Reports the torch / CUDA / NCCL versions, whether the compiled parts (``torch_afdep._C``, the
c10d backend, and ``torch_afdep._cuda``, the CUDA transport) are built and importable, the GPUs,
their peer access and whether CUDA MPS runs, the transport a ``Buffer`` would pick, the
relevant environment (``NCCL_NVLS_ENABLE`` and friends; the protocol controls' mode; the
``AFDEP_*`` variables that are set, every one described by ``torch_afdep.env``, and any
``AFDEP_*`` name torch_afdep does not read), then runs a 1A1F self-test exchange on two spawned
CPU processes (and, on a CUDA machine with the extension, on the GPUs) in both receive
layouts (``Config.receive_layout``: expert-major rows, and one row per token), each checked
against ``torch_afdep.reference`` and reported on its own. ``--verbose`` lists every protocol control and every registered
variable with its value and meaning. Exits 1 when it found a problem, printing a hint for
each; ``--json`` prints one JSON object with every fact (``--verbose`` or not) plus ``"ok"``
and ``"problems"``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import env as _env
from .. import mps
from ..config import parse_roles

REBUILD = "pip install --no-build-isolation --no-deps -e ."

#: NVLink multicast switches: the GPU machines this project uses must keep multicast off.
MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": ("0", "NCCL NVLink SHARP / multicast; must be 0"),
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": ("1", "PyTorch symmetric-memory multicast; keep 1"),
    "NVSHMEM_DISABLE_NVLS": ("1", "NVSHMEM NVLink SHARP; keep 1"),
}

#: AFDEP_* variables other than the protocol controls: name -> meaning. Derived from the
#: registry (``torch_afdep.env.SETTINGS``); kept for code that read the doctor's own list.
OTHER_AFDEP_ENV: Dict[str, str] = {
    name: s.meaning for name, s in _env.SETTINGS.items() if name not in _env.CONTROLS}

#: The self-test exchange: one Attention rank, one FFN rank, two exchanges.
SELFTEST_CONFIG = dict(capacity_tokens_per_rank=8, hidden_size=128, num_experts=4, top_k=2,
                       ffn_ranks=1, attention_ranks=1, timeout_s=30.0)
SELFTEST_TOKENS = (6, 8)
SELFTEST_TOLERANCE = 1e-2
#: Receive layouts the self-test runs (one spawned world each).
SELFTEST_LAYOUTS = ("experts", "tokens")


class Report:
    """Facts, problems (each with its hint) and warnings gathered by the checks."""

    def __init__(self) -> None:
        self.facts: Dict[str, Any] = {}
        self.problems: List[str] = []
        self.warnings: List[str] = []

    def problem(self, message: str) -> None:
        self.problems.append(message)

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def as_dict(self) -> Dict[str, Any]:
        out = {"ok": not self.problems, "problems": list(self.problems),
               "warnings": list(self.warnings)}
        out.update(self.facts)
        return out


# ---- versions ----------------------------------------------------------------------------
def _version_triple(version: str) -> Optional[Tuple[int, int, int]]:
    m = re.match(r"\s*(\d+)\.(\d+)\.(\d+)", str(version))
    return tuple(int(x) for x in m.groups()) if m else None  # type: ignore[return-value]


def _format_nccl(v: Any) -> str:
    if isinstance(v, (tuple, list)):
        return ".".join(str(p) for p in v)
    if isinstance(v, int):  # NCCL_VERSION_CODE: major*10000 + minor*100 + patch (>= 2.9)
        if v >= 10000:
            return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
        return f"{v // 1000}.{v // 100 % 10}.{v % 100}"
    return str(v)


def torch_nccl_version() -> str:
    """The NCCL torch loaded (``torch.cuda.nccl.version()``), or "n/a"."""
    try:
        return _format_nccl(torch.cuda.nccl.version())
    except Exception:  # CPU builds of torch have no NCCL bindings
        return "n/a"


def _cuda_runtime_str(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}" if v else "n/a"


def check_versions(rep: Report, cuda_ext) -> None:
    nccl_headers = "n/a" if cuda_ext is None else "n/a (not recorded by torch_afdep._cuda)"
    nccl_loaded = "n/a"
    if cuda_ext is not None:
        for name in ("NCCL_VERSION_CODE", "nccl_version", "nccl_build_version", "NCCL_VERSION"):
            v = getattr(cuda_ext, name, None)
            if v is not None:
                try:
                    v = v() if callable(v) else v
                    nccl_headers = ("n/a (built without NCCL: AFDEP_TRANSPORT=nccl unavailable)"
                                    if v == 0 else _format_nccl(v))
                except Exception as e:  # a broken binding: report, do not fail the doctor
                    nccl_headers = f"n/a ({e})"
                break
        if hasattr(cuda_ext, "nccl_runtime_version"):
            try:
                rv = int(cuda_ext.nccl_runtime_version())
                nccl_loaded = _format_nccl(rv) if rv > 0 else "n/a"
            except Exception as e:
                nccl_loaded = f"n/a ({e})"
        if nccl_headers[:1].isdigit() and nccl_loaded[:1].isdigit() and nccl_headers != nccl_loaded:
            rep.problem(f"torch_afdep._cuda was built against NCCL {nccl_headers} but libnccl "
                        f"{nccl_loaded} is loaded: AFDEP_TRANSPORT=nccl will refuse to start; "
                        f"rebuild beside the NCCL torch loads ({REBUILD})")
    ext_runtime = "n/a"
    if cuda_ext is not None and hasattr(cuda_ext, "runtime_version"):
        try:
            ext_runtime = _cuda_runtime_str(int(cuda_ext.runtime_version()))
        except Exception:
            pass
    from .. import __version__

    rep.facts["versions"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_afdep": __version__,
        "cuda_torch": torch.version.cuda or "n/a",
        "cuda_runtime_extension": ext_runtime,
        "nccl_torch": torch_nccl_version(),
        "nccl_headers_extension": nccl_headers,
        "nccl_loaded_extension": nccl_loaded,
    }


# ---- compiled parts ------------------------------------------------------------------------
def _import(name: str):
    """(module or None, error string or None)."""
    try:
        return importlib.import_module(name), None
    except Exception as e:  # ImportError, or an OSError from a missing shared library
        return None, f"{type(e).__name__}: {e}"


def c_extension():
    """``torch_afdep._C`` (the c10d backend), or None with the import error."""
    return _import("torch_afdep._C")


def cuda_extension():
    """``torch_afdep._cuda`` (the CUDA transport), or None with the import error."""
    return _import("torch_afdep._cuda")


def check_extensions(rep: Report, c_mod, c_err, cuda_mod, cuda_err) -> None:
    c_info: Dict[str, Any] = {"importable": c_mod is not None, "error": c_err,
                              "torch_version": None, "matches_torch": None}
    if c_mod is None:
        rep.problem(f"torch_afdep._C (the afdep c10d backend) cannot be imported ({c_err}): "
                    f"build it with {REBUILD}")
    else:
        built = str(getattr(c_mod, "TORCH_VERSION", "?"))
        match = _version_triple(built) is not None and \
            _version_triple(built) == _version_triple(torch.__version__)
        c_info.update(torch_version=built, matches_torch=match)
        if not match:
            rep.problem(f"_C built against torch {built}, running {torch.__version__}: "
                        f"rebuild with {REBUILD}")
    try:
        from ..distributed import backend as _backend

        registered = bool(_backend.is_registered())
    except Exception as e:
        registered = False
        c_info["backend_error"] = f"{type(e).__name__}: {e}"
    c_info["backend_registered"] = registered
    if c_mod is not None and not registered:
        rep.problem("the 'afdep' c10d backend is not registered: import torch_afdep before "
                    "dist.init_process_group (torch_afdep.distributed.register_backend())")

    cuda_info: Dict[str, Any] = {"importable": cuda_mod is not None, "error": cuda_err,
                                 "device_count": None}
    if cuda_mod is not None:
        try:
            cuda_info["device_count"] = int(cuda_mod.device_count())
        except Exception as e:
            cuda_info["error"] = f"device_count failed: {e}"
    elif torch.cuda.is_available():
        rep.problem(f"GPUs are present but torch_afdep._cuda cannot be imported ({cuda_err}): "
                    f"buffers fall back to CPU; build it with AFDEP_BUILD_CUDA=1 {REBUILD}")
    rep.facts["extensions"] = {"_C": c_info, "_cuda": cuda_info}


# ---- GPUs and transport ----------------------------------------------------------------------
def check_gpus(rep: Report) -> None:
    info: Dict[str, Any] = {"available": False, "count": 0, "devices": [], "peer_access": []}
    rep.facts["gpus"] = info
    try:
        if not torch.cuda.is_available():
            return
        n = torch.cuda.device_count()
        info.update(available=True, count=n)
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            info["devices"].append({"index": i, "name": p.name,
                                    "capability": f"{p.major}.{p.minor}",
                                    "memory_bytes": int(p.total_memory)})
        matrix = [[i == j or bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)]
                  for i in range(n)]
        info["peer_access"] = matrix
        info["mps_running"] = mps.mps_running()
        if n == 1 and not info["mps_running"]:
            # Not a problem (results stay correct), but every multi-rank run here is slow.
            rep.warn(mps.shared_gpu_problem(2))
        missing = [(i, j) for i in range(n) for j in range(n) if not matrix[i][j]]
        if missing:
            rep.problem(f"GPU pairs without peer access: {missing}; the CUDA transport maps "
                        "peer memory, so the ranks of one group need GPUs that can access each "
                        "other (one NVLink domain), or use CUDA_VISIBLE_DEVICES to pick such GPUs")
    except Exception as e:
        rep.problem(f"could not query the GPUs ({type(e).__name__}: {e}): check the driver "
                    "(nvidia-smi) and CUDA_VISIBLE_DEVICES")


def check_transport(rep: Report, cuda_mod) -> None:
    """Mirror of ``Buffer``'s default device choice."""
    if torch.cuda.is_available() and cuda_mod is not None:
        from .._cuda_impl import TRANSPORTS, transport_kind

        try:
            kind = transport_kind()
        except ValueError as e:
            rep.problem(str(e))
            kind = "ipc"
        name, desc = f"cuda-{kind}", (TRANSPORTS[kind] + " (torch_afdep._cuda kernels, no host "
                                      "synchronization)")
    else:
        name, desc = "cpu-gloo", "CPU: gloo point-to-point messages (no usable GPU transport)"
    rep.facts["transport"] = {"name": name, "description": desc}


# ---- environment ---------------------------------------------------------------------------
def _control_mode(mask: int) -> str:
    """One line for a control mask: role-aware, symmetric, or mixed (naming what differs)."""
    if mask == 0:
        return "symmetric (every control reverted)"
    if mask == _env.DEFAULT_FLAGS:
        return "role-aware"
    differ = [f"{n}={v}" for n, v in _env.describe_flags(mask).items()
              if v != _env.CONTROLS[n].default]
    return "mixed: " + ", ".join(differ) + " (defaults otherwise)"


def check_environment(rep: Report, env=None) -> None:
    """Multicast switches, protocol controls and every other AFDEP_* variable of ``env``
    (default: os.environ), each validated the way torch_afdep will parse it."""
    env = os.environ if env is None else env
    gpus = torch.cuda.is_available()
    multicast = {}
    for name, (want, meaning) in MULTICAST_ENV.items():
        value = env.get(name)
        multicast[name] = {"value": value, "want": want, "meaning": meaning}
    nvls = env.get("NCCL_NVLS_ENABLE")
    if nvls is not None and nvls.strip() != "0":
        rep.problem(f"NCCL_NVLS_ENABLE is not 0 (it is {nvls!r}): export NCCL_NVLS_ENABLE=0 "
                    "(NVLink multicast must stay off)")
    elif nvls is None and gpus:
        rep.problem("NCCL_NVLS_ENABLE is not 0 (unset, so NCCL may use NVLink multicast): "
                    "export NCCL_NVLS_ENABLE=0")
    # Unset without GPUs: nothing here uses NCCL, so there is nothing to warn about.
    if gpus:
        for name in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
            if env.get(name, "").strip() != "1":
                rep.warn(f"{name} is not 1: export {name}=1 (NVLink multicast off)")

    ctl: Dict[str, Any] = {}
    for name, c in _env.CONTROLS.items():
        ctl[name] = {"value": env.get(name), "default": c.default, "meaning": c.meaning}
    try:
        mask: Optional[int] = _env.protocol_flags(env)
    except ValueError as e:
        mask = None
        rep.problem(f"bad protocol control: {e}; set it to 0 or 1, or unset it")
    if mask is not None:
        for name, on in _env.describe_flags(mask).items():
            ctl[name]["effective"] = on
    mode = "invalid" if mask is None else _control_mode(mask)

    other: Dict[str, Any] = {}
    for name, s in _env.SETTINGS.items():
        if name in _env.CONTROLS:
            continue
        raw = env.get(name)
        other[name] = {"value": raw, "default": s.default, "meaning": s.meaning,
                       "read": s.read}
        if raw is None:
            continue
        try:
            value = _env.get(name, env)
            if name == "AFDEP_ROLES" and value.strip():
                parse_roles(value)
        except ValueError as e:
            hint = (": use e.g. FFAA or 'ffn,ffn,attention,attention'"
                    if name == "AFDEP_ROLES" else "")
            rep.problem(f"{name}={raw!r} is invalid ({e}){hint}")
    unknown = _env.unknown_notes(env)
    for name, why in unknown.items():
        rep.warn(f"{name} is set but {why}")
    rep.facts["environment"] = {"multicast": multicast, "controls": ctl, "control_mode": mode,
                                "control_mask": mask, "afdep_other": other,
                                "afdep_unknown": {k: env[k] for k in unknown}}


# ---- self-test -----------------------------------------------------------------------------
def _selftest_inputs(cfg, tokens: int, seed: int):
    from .. import reference as ref

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cfg.hidden_size, generator=g).to(torch.bfloat16)
    ids, w = ref.random_routing(cfg, tokens, "partial", generator=g)
    return x, ids, w


def _selftest_expert(e: int, rows: torch.Tensor) -> torch.Tensor:
    return rows * (e + 1)


def _selftest_expert_rows(cfg, f: int, rec, dev) -> Tuple[torch.Tensor, List[int]]:
    """The FFN side's reply of the expert layout and its per-local-expert row counts.

    Arguments:
        cfg: the self-test Config; f: this FFN index; rec: the ``Received``; dev: its device.
    Returns:
        (rows [A*bucket*R, H] bfloat16, each row its expert's output times its weight;
        counts, rows per local expert, read on the host).
    """
    offs = rec.expert_offsets.cpu().tolist()
    rows = torch.zeros(rec.x.shape[0], cfg.hidden_size, dtype=torch.float32, device=dev)
    base = f * cfg.experts_per_rank
    for e in range(cfg.experts_per_rank):
        lo, hi = offs[e], offs[e + 1]
        rows[lo:hi] = _selftest_expert(base + e, rec.x[lo:hi].float())
    n = offs[-1]
    rows[:n] *= rec.weights[:n, None]
    return rows.to(torch.bfloat16), [offs[e + 1] - offs[e] for e in range(cfg.experts_per_rank)]


def _selftest_token_rows(cfg, f: int, rec, dev) -> Tuple[torch.Tensor, List[int]]:
    """The FFN side's reply of the token layout and its per-local-expert entry counts.

    Arguments:
        cfg: the self-test Config; f: this FFN index; rec: the ``TokenReceived``; dev: its
            device.
    Returns:
        (rows [N, H] bfloat16, row r = sum over local ids e of the row of weight * expert e's
        output, NaN for rows without a token (the reply must ignore them); counts, entries
        per local expert, read on the host).
    """
    ids = rec.expert_ids.to(torch.int64)
    rows = torch.zeros(rec.x.shape[0], cfg.hidden_size, dtype=torch.float32, device=dev)
    base = f * cfg.experts_per_rank
    counts = []
    for e in range(cfg.experts_per_rank):
        r, j = (ids == e).nonzero(as_tuple=True)
        counts.append(int(r.numel()))
        rows.index_add_(0, r, _selftest_expert(base + e, rec.x[r].float()) *
                        rec.weights[r, j, None])
    rows[~(ids >= 0).any(dim=1)] = float("nan")
    return rows.to(torch.bfloat16), counts


def selftest_body(rank: int, world: int, device_kind: str, receive_layout: str = "experts"):
    """One rank of the self-test world (module level: spawn pickles it by name).

    Attention returns its relative errors against the fp64 reference; the FFN rank checks its
    per-expert counts against the reference and returns them. ``receive_layout`` is the
    buffer's ``Config.receive_layout``."""
    from .. import Buffer, Config
    from .. import reference as ref

    cfg = Config(**SELFTEST_CONFIG, receive_layout=receive_layout)
    dev = torch.device("cuda", torch.cuda.current_device()) if device_kind == "cuda" else \
        torch.device("cpu")
    out: Dict[str, Any] = {"role": None, "errors": [], "counts_ok": []}
    with Buffer(None, cfg, device=dev) as buf:
        out["role"] = buf.role
        for step, t in enumerate(SELFTEST_TOKENS):
            x, ids, w = _selftest_inputs(cfg, t, 1234 + step)
            if buf.role == "attention":
                buf.source_dispatch(x.to(dev), ids.to(dev), w.to(dev),
                                    bucket=cfg.capacity_tokens_per_rank)
                got = buf.source_collect().cpu()
                want = ref.moe_output(cfg, x, ids, w, _selftest_expert)
                out["errors"].append(ref.relative_error(got, want))
            else:
                rec = buf.worker_receive(cfg.capacity_tokens_per_rank)
                make = _selftest_token_rows if receive_layout == "tokens" else \
                    _selftest_expert_rows
                rows, got_counts = make(cfg, buf.role_index, rec, dev)
                buf.worker_reply(rows, rec.receipt)
                want_counts = ref.expert_counts(cfg, [ids])[buf.role_index].tolist()
                out["counts_ok"].append(got_counts == want_counts)
    return out


def _short_world_error(message: str) -> str:
    """The last line of each failed rank's traceback in a WorldError message."""
    parts = re.split(r"\n--- rank (\d+) failed:\n", "\n" + message)
    if len(parts) < 3:
        return message.strip().splitlines()[-1] if message.strip() else message
    head = parts[0].strip()
    out = [head] if head else []
    for i in range(1, len(parts) - 1, 2):
        lines = [ln for ln in parts[i + 1].strip().splitlines() if ln.strip()]
        out.append(f"rank {parts[i]}: {lines[-1].strip() if lines else '?'}")
    return "; ".join(out)


def _spawn(fn, world: int, *args, **kwargs):
    """Indirection so tests can simulate a failing world."""
    from ..testing import spawn_world

    return spawn_world(fn, world, *args, **kwargs)


def run_selftest(device_kind: str, timeout: float = 120.0,
                 receive_layout: str = "experts") -> Dict[str, Any]:
    """Run the 1A1F self-test on ``device_kind`` ("cpu" or "cuda") in ``receive_layout``
    (``"experts"`` or ``"tokens"``); never raises. Returns its result (``"ok"``,
    ``"error"``, ``"max_rel_error"``, ``"seconds"``, ...)."""
    kwargs: Dict[str, Any] = {"timeout": timeout}
    if device_kind == "cuda":
        n = torch.cuda.device_count()
        kwargs["device_ids"] = [r % n for r in range(2)]
        kwargs["env"] = {k: os.environ.get(k, want) for k, (want, _) in MULTICAST_ENV.items()}
    t0 = time.perf_counter()
    res: Dict[str, Any] = {"device": device_kind, "layout": "1A1F",
                           "receive_layout": receive_layout, "ran": True, "ok": False,
                           "exchanges": len(SELFTEST_TOKENS), "max_rel_error": None,
                           "seconds": None, "error": None}
    if "device_ids" in kwargs:
        res["device_ids"] = kwargs["device_ids"]
    try:
        results = _spawn(selftest_body, 2, device_kind, receive_layout, **kwargs)
        attn = [r for r in results if r["role"] == "attention"]
        ffn = [r for r in results if r["role"] == "ffn"]
        errors = [e for r in attn for e in r["errors"]]
        res["max_rel_error"] = max(errors) if errors else None
        bad = []
        if len(errors) != len(SELFTEST_TOKENS) or not all(e < SELFTEST_TOLERANCE
                                                          for e in errors):
            bad.append(f"combined output differs from the reference (relative errors "
                       f"{[f'{e:.3g}' for e in errors]}, tolerance {SELFTEST_TOLERANCE})")
        if not ffn or not all(ok for r in ffn for ok in r["counts_ok"]):
            bad.append("the FFN rank's per-expert counts differ from the reference")
        if bad:
            res["error"] = "; ".join(bad)
        else:
            res["ok"] = True
    except Exception as e:
        res["error"] = _short_world_error(str(e)) if str(e) else type(e).__name__
    res["seconds"] = round(time.perf_counter() - t0, 2)
    return res


def _run_layouts(rep: Report, device_kind: str) -> Dict[str, Any]:
    """The self-test of ``device_kind`` in every layout of ``SELFTEST_LAYOUTS``: each failing
    layout is a problem of its own. Returns {"ran", "ok", "layouts": {layout: result}}."""
    layouts = {}
    for layout in SELFTEST_LAYOUTS:
        res = run_selftest(device_kind, receive_layout=layout)
        layouts[layout] = res
        if not res["ok"]:
            rep.problem(f"self-test failed: {device_kind} 1A1F, {layout} layout: "
                        f"{res['error']}")
    return {"ran": True, "ok": all(r["ok"] for r in layouts.values()), "layouts": layouts}


def check_selftest(rep: Report, cuda_mod, enabled: bool) -> None:
    tests: Dict[str, Any] = {}
    rep.facts["selftest"] = tests
    if not enabled:
        tests["cpu"] = {"ran": False, "reason": "--no-selftest"}
        tests["cuda"] = {"ran": False, "reason": "--no-selftest"}
        return
    tests["cpu"] = _run_layouts(rep, "cpu")
    if not torch.cuda.is_available():
        tests["cuda"] = {"ran": False, "reason": "no GPU"}
    elif cuda_mod is None:
        tests["cuda"] = {"ran": False, "reason": "torch_afdep._cuda is not built"}
    else:
        tests["cuda"] = _run_layouts(rep, "cuda")


# ---- the whole check and its printout ---------------------------------------------------------
def diagnose(selftest: bool = True) -> Report:
    """Run every check; never raises (a failing check becomes a problem)."""
    rep = Report()
    c_mod, c_err = c_extension()
    cuda_mod, cuda_err = cuda_extension()
    steps = [
        ("versions", lambda: check_versions(rep, cuda_mod)),
        ("extensions", lambda: check_extensions(rep, c_mod, c_err, cuda_mod, cuda_err)),
        ("GPUs", lambda: check_gpus(rep)),
        ("transport", lambda: check_transport(rep, cuda_mod)),
        ("environment", lambda: check_environment(rep)),
        ("self-test", lambda: check_selftest(rep, cuda_mod, selftest)),
    ]
    for name, step in steps:
        try:
            step()
        except Exception as e:  # a bug in a check must not hide the others
            rep.problem(f"doctor could not check {name}: {type(e).__name__}: {e}")
    return rep


def _yes(v) -> str:
    return "yes" if v else "no"


def format_text(d: Dict[str, Any], verbose: bool = False) -> str:
    """The text report of ``Report.as_dict()``; ``verbose`` lists every protocol control and
    every registered AFDEP_* variable (otherwise: the control mode and the variables set)."""
    lines = ["torch_afdep doctor"]

    def section(title: str) -> None:
        lines.append("")
        lines.append(f"== {title}")

    def row(key: str, value: Any) -> None:
        lines.append(f"  {key:<32} {value}")

    v = d.get("versions")
    if v:
        section("versions")
        row("python", v["python"])
        row("torch", v["torch"])
        row("torch_afdep", v["torch_afdep"])
        row("CUDA (torch build)", v["cuda_torch"])
        row("CUDA runtime (_cuda)", v["cuda_runtime_extension"])
        row("NCCL (loaded by torch)", v["nccl_torch"])
        row("NCCL headers (_cuda build)", v["nccl_headers_extension"])
    x = d.get("extensions")
    if x:
        section("extensions")
        c = x["_C"]
        if c["importable"]:
            row("torch_afdep._C", f"built, importable; compiled against torch "
                f"{c['torch_version']}, running {v['torch'] if v else torch.__version__}"
                + (" (match)" if c["matches_torch"] else " (MISMATCH)"))
        else:
            row("torch_afdep._C", f"NOT importable: {c['error']}")
        row("afdep c10d backend", "registered" if c.get("backend_registered") else
            "NOT registered")
        u = x["_cuda"]
        if u["importable"]:
            row("torch_afdep._cuda", f"built, importable; CUDA runtime "
                f"{v['cuda_runtime_extension'] if v else '?'}; sees {u['device_count']} GPU(s)")
        else:
            row("torch_afdep._cuda", f"not importable ({u['error']})")
    g = d.get("gpus")
    if g is not None:
        section("GPUs")
        if not g["available"]:
            row("GPUs", "none")
        else:
            for dev in g["devices"]:
                sm = dev["capability"].replace(".", "")
                row(f"cuda:{dev['index']}",
                    f"{dev['name']} (sm_{sm}, {dev['memory_bytes'] / 2**30:.1f} GiB)")
            n = g["count"]
            if n > 1:
                lines.append("  peer access (row can access column):")
                lines.append("        " + " ".join(f"{j:>3}" for j in range(n)))
                for i in range(n):
                    lines.append(f"    {i:>3} " + " ".join(
                        f"{'-' if i == j else _yes(g['peer_access'][i][j]):>3}"
                        for j in range(n)))
            else:
                row("peer access", "n/a (one GPU)")
            if "mps_running" in g:
                row("CUDA MPS", "running" if g["mps_running"] else
                    f"not running (no control pipe in {mps.pipe_directory()})")
    t = d.get("transport")
    if t:
        section("transport")
        row(t["name"], t["description"])
    e = d.get("environment")
    if e:
        section("environment")
        for name, info in e["multicast"].items():
            val = "(unset)" if info["value"] is None else info["value"]
            row(name, f"{val:<10} want {info['want']}: {info['meaning']}")
        if verbose:
            lines.append(f"  protocol controls (torch_afdep.env; mode: {e['control_mode']}):")
            for name, info in e["controls"].items():
                val = "(unset)" if info["value"] is None else info["value"]
                eff = info.get("effective", "?")
                lines.append(f"    {name:<26} {val:<8} -> {eff}  {info['meaning']}")
            lines.append("  other AFDEP_* variables (torch_afdep.env):")
            shown = e["afdep_other"]
        else:
            row("protocol controls", f"{e['control_mode']} ({len(e['controls'])} controls; "
                "--verbose lists them)")
            shown = {n: i for n, i in e["afdep_other"].items() if i["value"] is not None}
            lines.append(f"  other AFDEP_* variables set: {len(shown) or 'none'} "
                         f"(--verbose lists all {len(e['afdep_other'])})")
        for name, info in shown.items():
            val = "(unset)" if info["value"] is None else info["value"]
            lines.append(f"    {name:<26} {val:<8} {info['meaning']}")
        for name, val in e["afdep_unknown"].items():
            what = "(retired: no effect)" if name in _env.RETIRED else "(unknown to torch_afdep)"
            lines.append(f"    {name:<26} {val:<8} {what}")
    s = d.get("selftest")
    if s is not None:
        section("self-test (1A1F, 2 processes, each receive layout, checked against "
                "torch_afdep.reference)")
        for kind in ("cpu", "cuda"):
            dev = s.get(kind)
            if dev is None:
                continue
            if not dev.get("ran"):
                row(kind, f"skipped ({dev.get('reason')})")
                continue
            for layout, r in dev["layouts"].items():
                if r["ok"]:
                    where = f" on GPUs {r['device_ids']}" if r.get("device_ids") else ""
                    row(f"{kind} {layout}", f"PASS{where}: {r['exchanges']} exchanges, max "
                        f"rel. error {r['max_rel_error']:.2e}, {r['seconds']:.1f} s")
                else:
                    row(f"{kind} {layout}", f"FAIL after {r['seconds']:.1f} s: {r['error']}")
    section("result")
    for w in d.get("warnings", []):
        lines.append(f"  warning: {w}")
    if d["ok"]:
        lines.append("  OK: no problems found")
    else:
        lines.append(f"  FAIL: {len(d['problems'])} problem(s)")
        for p in d["problems"]:
            lines.append(f"  - {p}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m torch_afdep doctor",
        description="Check this machine's torch_afdep setup and run a tiny self-test exchange.")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="list every protocol control and AFDEP_* variable with its meaning")
    p.add_argument("--no-selftest", action="store_true", help="skip the self-test exchange")
    args = p.parse_args(argv)
    rep = diagnose(selftest=not args.no_selftest)
    d = rep.as_dict()
    if args.json:
        print(json.dumps(d, indent=2, sort_keys=False, default=str))
    else:
        print(format_text(d, verbose=args.verbose))
    sys.stdout.flush()
    return 0 if d["ok"] else 1


__all__ = ["diagnose", "main", "run_selftest", "selftest_body"]
