"""scripts/device_steps.sh (one device call as a list of steps) without a GPU: it runs the
steps it is given in order, says so for a step it does not know, and packs $OUT into one
bundle.tgz whose call.log records the steps."""

from __future__ import annotations

import os
import subprocess
import tarfile

from tests.helpers.scripts import ROOT


def _call(tmp_path, **env_vars):
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OUT=str(out), AFDEP_COMMIT="abc1234", **env_vars)
    r = subprocess.run(["bash", "scripts/device_steps.sh"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(os.listdir(out)) == ["bundle.tgz"]
    with tarfile.open(out / "bundle.tgz") as t:
        log = t.extractfile("./call.log").read().decode()
    return [ln.split("] ", 1)[1] for ln in log.splitlines() if ln.startswith("[")]


def test_unknown_step_is_reported_and_out_is_packed(tmp_path):
    lines = _call(tmp_path, STEPS="nonesuch", LIMIT="60")
    assert lines == ["commit=abc1234 steps=nonesuch limit=60s", "unknown step nonesuch",
                     "call done"]


def test_steps_without_time_left_are_skipped_and_the_call_still_packs(tmp_path):
    """LIMIT=30: no step has its MIN_STEP_S (45) after its reserve (a timeout of 0 or less
    would mean no limit, or an error), so each says so, nothing runs, and the results are
    packed."""
    lines = _call(tmp_path, STEPS="build suite san bench profile", LIMIT="30")
    assert lines[0] == "commit=abc1234 steps=build suite san bench profile limit=30s"
    assert len(lines) == 7 and lines[-1] == "call done", lines
    assert all(ln.startswith("skipped: ") and ln.endswith("s left") for ln in lines[1:6]), lines


def test_ab_without_its_settings_is_reported_not_fatal(tmp_path):
    lines = _call(tmp_path, STEPS="ab nonesuch", LIMIT="60")
    assert lines[1:] == ["ab: set AB_ENV and AB_T", "unknown step nonesuch", "call done"], lines


def test_numbered_ab_steps_read_their_own_settings(tmp_path):
    """ab2 reads AB2_ENV / AB2_T, not AB_ENV: with only AB_* set it says which it lacks; with
    AB2_* set and no time left it gets as far as the time check (skipped, not misreported)."""
    lines = _call(tmp_path, STEPS="ab2 ab3", LIMIT="60", AB_ENV="X=1", AB_T="1",
                  AB3_ENV="Y=1", AB3_T="1 2", AB3_LIMIT="10")
    assert lines[1] == "ab2: set AB2_ENV and AB2_T", lines
    assert lines[2].startswith("skipped: ") and lines[2].endswith("s left"), lines
    assert lines[3:] == ["call done"], lines


def test_numbered_trace_steps_read_their_own_settings(tmp_path):
    """trace2 is a step (TRACE2_LAYOUTS / TRACE2_T / TRACE2_EXTRA), not an unknown one: with
    no time left it gets as far as the time check and stops at its first layout."""
    lines = _call(tmp_path, STEPS="trace2", LIMIT="50", TRACE_LAYOUTS="a b c",
                  TRACE2_LAYOUTS="tokens", TRACE2_EXTRA="--afdep-env X=1")
    assert len(lines) == 3 and lines[1].startswith("skipped: "), lines
    assert lines[2] == "call done", lines


def test_probe_step_is_known_and_bounded_by_the_time_left(tmp_path):
    """probe is a step (poll_probe's modes), not an unknown one: with no time left it says so
    before building anything."""
    lines = _call(tmp_path, STEPS="probe", LIMIT="30", PROBE_MODES="queue")
    assert len(lines) == 3 and lines[1].startswith("skipped: "), lines
    assert lines[2] == "call done", lines


def test_probe_step_runs_the_two_process_modes_as_two_ranks(tmp_path):
    """ipcq (and ipc) run poll_probe as two processes: rank 1 in the background, its stderr in
    <mode>.err1, and rank 0, whose output is the mode's JSON; other modes run once. A stand-in
    nvcc "builds" a stand-in probe that prints its arguments."""
    fake_probe = tmp_path / "fake_probe"
    fake_probe.write_text('#!/usr/bin/env bash\necho "{\\"args\\": \\"$*\\"}"\n'
                          'echo "args $*" >&2\n')
    fake_probe.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nvcc = bin_dir / "nvcc"
    nvcc.write_text('#!/usr/bin/env bash\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && o=$2; shift; '
                    f'done\ncp {fake_probe} "$o"\n')
    nvcc.chmod(0o755)
    out = tmp_path / "out"
    lines = _call(tmp_path, STEPS="probe", LIMIT="120", PROBE_MODES="ipcq queue",
                  PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert lines[1:] == ["probe ipcq queue", "probe ipcq rc=0", "probe queue rc=0",
                         "call done"], lines
    with tarfile.open(out / "bundle.tgz") as t:
        read = {m.name: t.extractfile(m).read().decode() for m in t.getmembers() if m.isfile()}
    assert read["./probe/ipcq.json"].startswith('{"args": "ipcq 0 '), read
    assert read["./probe/ipcq.err1"].startswith("args ipcq 1 "), read
    assert read["./probe/queue.json"] == '{"args": "queue"}\n', read


def test_probe_step_under_its_own_mps_daemon(tmp_path):
    """PROBE_MPS=1: the modes run under a daemon started through scripts/mps.sh (a stand-in
    nvidia-cuda-mps-control here, which logs its calls), into <mode>-mps.json, and the daemon
    is told to quit after them."""
    fake_probe = tmp_path / "fake_probe"
    fake_probe.write_text('#!/usr/bin/env bash\necho "{}"\n')
    fake_probe.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvcc").write_text('#!/usr/bin/env bash\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && '
                                  f'o=$2; shift; done\ncp {fake_probe} "$o"\n')
    calls = tmp_path / "mps_calls"
    (bin_dir / "nvidia-cuda-mps-control").write_text(
        f'#!/usr/bin/env bash\necho "${{1:-$(cat)}} $CUDA_MPS_PIPE_DIRECTORY" >> {calls}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    lines = _call(tmp_path, STEPS="probe", LIMIT="120", PROBE_MODES="queue", PROBE_MPS="1",
                  PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert lines[1:] == ["probe queue", "probe: MPS daemon started", "probe queue-mps rc=0",
                         "call done"], lines
    assert calls.read_text().splitlines() == ["-d /tmp/afdep-probe-mps-pipe",
                                              "quit /tmp/afdep-probe-mps-pipe"]


def test_a_second_probe_step_reads_its_own_settings_and_builds_nothing(tmp_path):
    """probe2 runs PROBE2_MODES, under MPS when PROBE2_MPS=1 (files <mode>-mps.*, beside the
    first step's <mode>.*), with the binary the first probe step built: nvcc runs once."""
    fake_probe = tmp_path / "fake_probe"
    fake_probe.write_text('#!/usr/bin/env bash\necho "{\\"args\\": \\"$*\\"}"\n')
    fake_probe.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    builds = tmp_path / "builds"
    (bin_dir / "nvcc").write_text(f'#!/usr/bin/env bash\necho built >> {builds}\n'
                                  'while [ $# -gt 0 ]; do [ "$1" = -o ] && o=$2; shift; done\n'
                                  f'cp {fake_probe} "$o"\n')
    (bin_dir / "nvidia-cuda-mps-control").write_text("#!/usr/bin/env bash\ncat > /dev/null\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    out = tmp_path / "out"
    lines = _call(tmp_path, STEPS="probe probe2", LIMIT="120", PROBE_MODES="launch",
                  PROBE2_MODES="launch", PROBE2_MPS="1", PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert lines[1:] == ["probe launch", "probe launch rc=0", "probe2 launch",
                         "probe: MPS daemon started", "probe launch-mps rc=0", "call done"], lines
    assert builds.read_text().splitlines() == ["built"]
    with tarfile.open(out / "bundle.tgz") as t:
        names = sorted(m.name for m in t.getmembers() if m.isfile())
    assert "./probe/launch.json" in names and "./probe/launch-mps.json" in names, names
    assert "./probe/poll_probe" not in names, names


def test_a_tree_that_is_no_checkout_runs_no_step(tmp_path):
    """TREE names the checkout the library steps build and run; where it holds none the call
    says so, runs none of its steps and still packs."""
    lines = _call(tmp_path, STEPS="build suite", LIMIT="600", TREE=str(tmp_path / "nonesuch"))
    assert lines[1] == f"TREE={tmp_path / 'nonesuch'}: no checkout there", lines
    assert lines[2:] == ["call done"], lines
