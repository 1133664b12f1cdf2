"""scripts/shard_pytest.py (the GPU suite's SHARDS=n driver), on two quick CPU tests: one runs
in a shard, the one --serial-k selects runs alone afterwards, and the summary counts both;
--resume with that summary runs neither again."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.scripts import load_script

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_shards_then_serial_tests_alone(tmp_path):
    sel = ["tests/contract/test_slots.py", "-k", "tag_ranges or num_slots_default"]
    out = subprocess.run(
        [sys.executable, "scripts/shard_pytest.py", "--shards", "2", "--budget", "240",
         "--out", str(tmp_path), "--serial-k", "num_slots_default", "--", *sel],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = (tmp_path / "summary.txt").read_text()
    assert summary.startswith("2 tests, 2 shards") and "PASSED 2" in summary, summary
    shards = "".join(p.read_text() for p in tmp_path.glob("shard*.log"))
    alone = (tmp_path / "alone.log").read_text()
    assert "test_tag_ranges_never_overlap PASSED" in shards, shards[-2000:]
    assert "test_num_slots_default_and_fingerprint PASSED" in alone, alone[-2000:]
    assert "test_num_slots_default_and_fingerprint" not in shards

    # --resume: what passed there is done; only the rest runs (here: nothing)
    again = tmp_path / "again"
    out = subprocess.run(
        [sys.executable, "scripts/shard_pytest.py", "--shards", "2", "--budget", "240",
         "--out", str(again), "--resume", str(tmp_path / "summary.txt"), "--", *sel],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = (again / "summary.txt").read_text()
    assert "(2 done in the resumed run)" in summary and "PASSED 2" in summary, summary
    assert not list(again.glob("shard*.log")), "a resumed test ran again"

    # a call cut off before its summary: its shard logs (pytest -v) resume as well, several at once
    logs = [str(p) for p in sorted(tmp_path.glob("shard*.log"))] + [str(tmp_path / "alone.log")]
    from_logs = tmp_path / "from_logs"
    out = subprocess.run(
        [sys.executable, "scripts/shard_pytest.py", "--shards", "1", "--budget", "240",
         "--out", str(from_logs), *[x for log in logs for x in ("--resume", log)], "--", *sel],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = (from_logs / "summary.txt").read_text()
    assert "(2 done in the resumed run)" in summary and "PASSED 2" in summary, summary
    assert not list(from_logs.glob("shard*.log")), "a test the logs passed ran again"


def test_budget_counts_the_collection_and_the_stop():
    """The shards' time is the budget less the collection and the SIGINT grace (a call's limit
    of budget + a few seconds once ended the suite before its summary was written)."""
    shard_pytest = load_script("shard_pytest")
    grace = shard_pytest._GRACE_S
    assert shard_pytest.shard_budget(500, 1, 12.0) == 500 - 12.0 - grace
    assert shard_pytest.shard_budget(500, 3, 12.0) == 250 - 12.0 - grace


def test_missing_resume_file_is_an_error_before_anything_runs(tmp_path):
    out = subprocess.run(
        [sys.executable, "scripts/shard_pytest.py", "--shards", "1", "--budget", "60",
         "--out", str(tmp_path), "--resume", str(tmp_path / "nope.txt"), "--",
         "tests/contract/test_slots.py", "-k", "tag_ranges"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--resume: no such file" in out.stderr, out.stderr
    assert not (tmp_path / "summary.txt").exists()


def test_resume_takes_passes_only(tmp_path):
    """A skip in an earlier call may be for want of something that call lacked (the MPS
    daemon): it is not taken as done."""
    shard_pytest = load_script("shard_pytest")
    summary = tmp_path / "summary.txt"
    summary.write_text("3 tests, 1 shards, 9 s: PASSED 1, SKIPPED 1, FAILED 1\n"
                       "PASSED tests/a.py::t1  (in the resumed run)\n"
                       "SKIPPED tests/a.py::t2\nFAILED tests/a.py::t3\n")
    log = tmp_path / "shard0.log"
    log.write_text("tests/b.py::u1[x-1] PASSED [ 50%]\ntests/b.py::u2 SKIPPED (no MPS) [100%]\n")
    assert shard_pytest.earlier_results(str(summary)) == {"tests/a.py::t1": "PASSED"}
    assert shard_pytest.earlier_results(str(log)) == {"tests/b.py::u1[x-1]": "PASSED"}
