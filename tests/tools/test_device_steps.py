"""scripts/device_steps.sh (one device call as a list of steps) without a GPU: it runs the
steps it is given in order, says so for a step it does not know, and packs $OUT into one
bundle.tgz whose call.log records the steps."""

from __future__ import annotations

import os
import subprocess
import tarfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_unknown_step_is_reported_and_out_is_packed(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, OUT=str(out), STEPS="nonesuch", LIMIT="60", AFDEP_COMMIT="abc1234")
    r = subprocess.run(["bash", "scripts/device_steps.sh"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(os.listdir(out)) == ["bundle.tgz"]
    with tarfile.open(out / "bundle.tgz") as t:
        log = t.extractfile("./call.log").read().decode()
    lines = [ln.split("] ", 1)[1] for ln in log.splitlines() if ln.startswith("[")]
    assert lines == ["commit=abc1234 steps=nonesuch", "unknown step nonesuch", "call done"]
