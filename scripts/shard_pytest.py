"""Run a pytest selection as N concurrent shards on one GPU, then retry the failures alone.

    python scripts/shard_pytest.py --shards 3 --budget 480 --out DIR [--serial-k EXPR] \
        [--resume SUMMARY_OR_LOG ...] -- <pytest args>

Every GPU test starts its own world. With forked worlds (about 3 s a test on one H200) one
shard is the fastest: three concurrent shards ran slower (34 tests in 200 s). With one shard
every test runs in it, with the whole budget, and the summary is what ``--resume`` takes.
With N > 1 each shard runs with ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100/N`` (under the MPS
daemon the GPU's reported SM count shrinks with it, and the transport sizes its local grids
from that),
so the spinning receivers of the concurrent worlds leave each other SMs. Worlds whose kernels
wait at barriers (the symmetric protocol, reverted directional controls) need all their CTAs
resident at once and starve beside other worlds (one H200, 4 shards: 16 timeouts): the tests
that ``--serial-k`` selects run alone, after the shards. A test that fails in a shard runs
again alone, without the limit; only a test that fails alone counts as failed (its shard log
and its lone log are both kept). ``--resume`` takes an earlier run's summary.txt, or the
pytest -v log of a shard whose call was cut off before the summary (repeatable), and leaves
out the tests that passed there (a suite longer than one device call, finished over several
calls at one commit; the new summary counts them as passed earlier; skipped tests run again).
The budget covers the collection and the shards' 20 s to stop after SIGINT, so a caller's
time limit of the budget plus a few seconds holds (with one shard, or when the tests that run
alone find too little time to start). Writes
``DIR/shard<i>.log``, ``DIR/alone.log`` and ``DIR/summary.txt``; exit status 0 when every test
passed or skipped.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

# pytest -v: "<node id> PASSED [ 10%]" (setup errors and skips included, unlike -rA's lines)
_RESULT = re.compile(r"^(\S+::.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: |$)")


#: seconds a shard gets to stop after SIGINT before it is killed
_GRACE_S = 20.0


def collect(pytest_args):
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", *pytest_args],
                         capture_output=True, text=True)
    ids = [ln.strip() for ln in out.stdout.splitlines() if "::" in ln and not ln.startswith(" ")]
    if not ids and out.returncode not in (0, 5):
        sys.exit(f"collection failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return ids


def results(log_path):
    got = {}
    with open(log_path, errors="replace") as f:
        for ln in f:
            m = _RESULT.match(ln)
            if m and got.get(m.group(1)) not in ("FAILED", "ERROR"):
                got[m.group(1)] = m.group(2)
    return got


def earlier_results(path):
    """{node id: "PASSED"} from a summary.txt ("PASSED <id>") or a pytest -v log
    ("<id> PASSED [ 10%]"). Skips are not taken: a test skipped for want of something that
    one call lacked (the MPS daemon, say) runs again; one skipped by design skips again at
    once."""
    done = {}
    with open(path, errors="replace") as f:
        for ln in f:
            word, _, node = ln.rstrip("\n").partition(" ")
            if word == "PASSED":
                done[node.split("  (")[0]] = word
    done.update((t, v) for t, v in results(path).items() if v == "PASSED")
    return done


def shard_budget(budget_s, shards, elapsed_s):
    """Seconds the shards may run: their share of the budget (half with several shards, the
    rest being for the tests that run alone) less what the collection took and less the SIGINT
    grace, so a caller's limit of the budget plus a few seconds holds (a call cut off by its
    caller writes no summary)."""
    return budget_s * (0.5 if shards > 1 else 1.0) - elapsed_s - _GRACE_S


def run_shards(ids, n, out_dir, budget_s):
    """Run ``ids`` (node ids) round-robin over ``n`` concurrent pytest processes."""
    shards = [ids[i::n] for i in range(n)]
    procs = []
    for i, part in enumerate(shards):
        if not part:
            continue
        env = dict(os.environ)
        if n > 1:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, 100 // n))
        log = open(os.path.join(out_dir, f"shard{i}.log"), "w")
        cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
               "--durations=20", *part]
        procs.append((i, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env),
                      log))
    deadline = time.monotonic() + budget_s
    late = []
    for i, p, log in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.send_signal(2)  # SIGINT: pytest prints what it has
            late.append(p)
    stop_by = time.monotonic() + _GRACE_S  # one grace for all the shards stopped
    for p in late:
        try:
            p.wait(timeout=max(0.1, stop_by - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for _, _, log in procs:
        log.close()
    got = {}
    for i, _, _ in procs:
        got.update(results(os.path.join(out_dir, f"shard{i}.log")))
    return got


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--budget", type=float, default=480.0, help="seconds for shards + retries")
    p.add_argument("--out", default=".")
    p.add_argument("--serial-k", default="",
                   help="-k expression of the tests that run alone after the shards")
    p.add_argument("--resume", action="append", default=[],
                   help="summary.txt of an earlier run, or a pytest -v log (a shard log of a "
                        "call cut off before its summary): its passed tests are done; "
                        "repeatable")
    p.add_argument("pytest_args", nargs=argparse.REMAINDER,
                   help="after --: the selection (paths, -m, -k) to collect")
    a = p.parse_args(argv)
    args = [x for x in a.pytest_args if x != "--"]
    if a.shards < 1:
        p.error(f"--shards must be >= 1, got {a.shards}")
    missing = [r for r in a.resume if not os.path.isfile(r)]
    if missing:
        p.error(f"--resume: no such file: {', '.join(missing)}")
    os.makedirs(a.out, exist_ok=True)
    t0 = time.monotonic()
    ids = collect(args)
    done = {}
    for path in a.resume:
        done.update(earlier_results(path))
    earlier = {t: done[t] for t in ids if t in done}
    ids = [t for t in ids if t not in earlier]
    # one shard runs alone anyway: no lone phase, and the whole budget for it
    serial = (set(collect(args + ["-k", a.serial_k])) if a.serial_k and a.shards > 1
              else set())
    got = run_shards([t for t in ids if t not in serial], a.shards, a.out,
                     shard_budget(a.budget, a.shards, time.monotonic() - t0))
    bad = [t for t in ids if got.get(t) in ("FAILED", "ERROR")]
    retried = {}
    alone = [t for t in ids if t in serial] + bad
    if alone:
        left = a.budget - (time.monotonic() - t0)
        if left > 30:
            alone_log = os.path.join(a.out, "alone.log")
            with open(alone_log, "w") as log:
                try:
                    subprocess.run(
                        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *alone],
                        stdout=log, stderr=subprocess.STDOUT, timeout=left)
                except subprocess.TimeoutExpired:
                    log.write("\n(budget spent: the rest of the tests that run alone did not run)\n")
            retried = results(alone_log)
    final = {t: retried.get(t, got.get(t, "NOT RUN")) for t in ids}
    final.update(earlier)
    counts = {}
    for v in final.values():
        counts[v] = counts.get(v, 0) + 1
    lines = [f"{v} {t}" + ("  (failed in its shard, passed alone)" if t in bad and v == "PASSED"
                           else "  (in the resumed run)" if t in earlier else "")
             for t, v in final.items()]
    summary = (f"{len(final)} tests, {a.shards} shards, {time.monotonic() - t0:.0f} s"
               + (f" ({len(earlier)} done in the resumed run)" if earlier else "") + ": "
               + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    with open(os.path.join(a.out, "summary.txt"), "w") as f:
        f.write(summary + "\n" + "\n".join(lines) + "\n")
    print(summary)
    for ln in lines:
        if not ln.startswith(("PASSED", "SKIPPED")) or "alone" in ln:
            print(ln)
    return 0 if all(v in ("PASSED", "SKIPPED") for v in final.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
