"""Run a function on a world of spawned processes (tests, demo, examples).

``spawn_world(fn, world_size, *args)`` starts ``world_size`` fresh processes, initializes the
default process group in each (a FileStore, so no port is needed), calls
``fn(rank, world_size, *args)`` and returns the per-rank return values. An exception on any
rank is re-raised in the parent with that rank's traceback; a rank that does not finish in
``timeout`` seconds fails the call (all ranks are killed). With ``AFDEP_WORLD_STACKS_S=N`` in
the environment, every rank prints its threads' Python stacks to stderr after N seconds (where
a hung rank is stuck).

CPU worlds start from a fork server that has imported torch and torch_afdep once (about 0.1 s
per world instead of several seconds of imports per rank); GPU worlds start fresh interpreters
(spawn), as CUDA needs. ``AFDEP_WORLD_START=spawn|forkserver`` overrides the choice. Either
way a rank sees the parent's environment of the moment of the call, plus ``env``; its gloo
binds the loopback interface (``GLOO_SOCKET_IFNAME=lo``) unless that environment names one,
since every rank runs on this host.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional

import torch.multiprocessing as mp

from . import env as _env

#: imported once by the fork server, so forked ranks start without importing them again
_PRELOAD = ["torch", "torch.distributed", "torch_afdep"]


class WorldError(RuntimeError):
    """A rank of a spawned world failed; the message holds its traceback."""


def save_rank_record(outdir: str, rank: int, record: Any) -> None:
    """Write one rank's record to ``outdir`` atomically, so it survives the rank (or a peer)
    dying later; fault tests read it back with :func:`load_rank_record`."""
    tmp = os.path.join(outdir, f"rank{rank}.pkl.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(record, f)
    os.replace(tmp, os.path.join(outdir, f"rank{rank}.pkl"))


def load_rank_record(outdir: str, rank: int, missing: Any = FileNotFoundError) -> Any:
    """The record :func:`save_rank_record` wrote; ``missing`` is returned when the rank
    wrote none (by default that raises FileNotFoundError)."""
    path = os.path.join(outdir, f"rank{rank}.pkl")
    if missing is not FileNotFoundError and not os.path.exists(path):
        return missing
    with open(path, "rb") as f:
        return pickle.load(f)


def cuda_probe_body(rank: int, world_size: int) -> float:
    """A world's smallest CUDA work (scripts/gpu_suite.sh: do forked ranks get a working
    CUDA context here?): 2.0 from every rank when they do."""
    import torch

    return float(torch.ones(2, device="cuda").sum().item())


def use_loopback_gloo() -> None:
    """Bind this process's gloo groups to the loopback interface unless ``GLOO_SOCKET_IFNAME``
    names one: for processes whose peers all run on this host. Gloo otherwise resolves the
    hostname first, a lookup that can stall where DNS does not answer."""
    if "GLOO_SOCKET_IFNAME" not in os.environ and os.path.isdir("/sys/class/net/lo"):
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"


def _start_method(device_ids) -> str:
    """forkserver for CPU worlds, spawn for GPU worlds (or AFDEP_WORLD_START)."""
    method = _env.get("AFDEP_WORLD_START")
    if method == "auto":
        method = "spawn" if device_ids is not None else "forkserver"
    return method


def _all_joined(store, rank: int, world_size: int) -> None:
    """Return once every rank's ``init_process_group`` has returned. Gloo's full-mesh connect
    can finish on one side of a pair before the other: a rank whose body is over at once then
    closes its sockets under a slower peer that is still connecting, and that peer's init
    fails with "Connection closed by peer" (CI, four ranks printing and exiting)."""
    import datetime

    store.set(f"afdep_world/joined/{rank}", "1")
    store.wait([f"afdep_world/joined/{r}" for r in range(world_size)],
               datetime.timedelta(seconds=300))


def _entry(rank, world_size, fn, args, backend, store_path, result_q, device_ids, env):
    # a forked rank inherits the fork server's environment: make it the caller's (env holds
    # all of it then), as a spawned rank's would be
    for k in [k for k in os.environ if k not in env]:
        del os.environ[k]
    os.environ.update(env)
    use_loopback_gloo()  # every rank of this world runs on this host
    # ranks share the caller's stdout and stderr: one write per line, so the lines of ranks
    # printing at once never interleave mid-line (with PYTHONUNBUFFERED a print writes its
    # text and its newline separately)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(line_buffering=True, write_through=False)
        except (AttributeError, ValueError, OSError):  # replaced or closed streams
            pass
    if os.environ.get("AFDEP_WORLD_STACKS_S"):  # diagnostics: where a hung rank is stuck
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["AFDEP_WORLD_STACKS_S"]), exit=False)
    try:
        import torch
        import torch.distributed as dist

        if "OMP_NUM_THREADS" not in os.environ:
            # ranks share the machine's cores: without this every rank starts one intra-op
            # thread per core and the fp64 reference checks crawl under oversubscription
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        if device_ids is not None:
            torch.cuda.set_device(device_ids[rank])
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size)
        _all_joined(store, rank, world_size)
        try:
            out = fn(rank, world_size, *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        result_q.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report everything, including KeyboardInterrupt in a child
        result_q.put((rank, False, traceback.format_exc()))


def _report_early(rank: int, text: str, world_size: int, results: dict, failures: dict) -> None:
    """A rank failed while others still run: its error to stderr now. The world's WorldError
    comes only once every rank has ended, and a peer that never ends (a stuck kernel) would
    keep the first error from being seen at all until spawn_world's timeout."""
    running = sorted(set(range(world_size)) - set(results) - set(failures))
    if running:
        sys.stderr.write(f"spawn_world: rank {rank} failed while ranks {running} still run:\n"
                         f"{text}\n")
        sys.stderr.flush()


def spawn_world(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 300.0,
    device_ids: Optional[List[int]] = None,
    env: Optional[dict] = None,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return their results.

    ``fn`` must be importable (module level). ``device_ids[rank]`` selects each rank's GPU
    (several ranks may share one). ``env`` is applied in each child before torch is used
    (forked CPU ranks have torch imported already: variables torch reads at import do not
    reach them; none of ours is read then).
    """
    method = _start_method(device_ids)
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    child_env = {**os.environ, **(env or {})}
    result_q = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="afdep-world-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_entry,
                args=(r, world_size, fn, args, backend, store_path, result_q, device_ids,
                      child_env),
                daemon=False,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict = {}
        failures: dict = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) + len(failures) < world_size:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(results) - set(failures))
                    raise WorldError(
                        f"ranks {missing} did not finish within {timeout:.0f} s"
                        + "".join(f"\n--- rank {r} failed:\n{t}" for r, t in failures.items())
                    )
                if not result_q.empty():
                    rank, ok, payload = result_q.get()
                    if ok:
                        results[rank] = pickle.loads(payload)
                    else:
                        failures[rank] = payload
                        _report_early(rank, payload, world_size, results, failures)
                    continue
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and r not in results and r not in failures]
                if dead and result_q.empty():
                    time.sleep(0.2)  # a result may still be in flight
                    if result_q.empty():
                        for r in dead:
                            failures.setdefault(
                                r, f"process exited with code {procs[r].exitcode}")
                        for r in dead:  # (once all are recorded: none of them counts as running)
                            _report_early(r, failures[r], world_size, results, failures)
                        continue
                time.sleep(0.01)
        finally:
            for p in procs:
                p.join(timeout=0.5 if failures else 5.0)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        if failures:
            raise WorldError(
                "".join(f"\n--- rank {r} failed:\n{t}" for r, t in sorted(failures.items()))
            )
        return [results[r] for r in range(world_size)]
