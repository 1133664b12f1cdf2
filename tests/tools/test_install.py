"""Installation: the package metadata, and scripts/setup.sh's decision to rebuild
(scripts/setup_check.py), without building anything."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.helpers.scripts import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _setup_check():
    return load_script("setup_check")


def test_metadata_declares_torch_211_and_no_exact_pins(tmp_path):
    """egg_info writes the metadata only (no compiler runs); engines keep their own torch."""
    env = dict(os.environ, AFDEP_BUILD_CUDA="0")
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path)],
                   cwd=ROOT, env=env, check=True, capture_output=True, timeout=120)
    with open(tmp_path / "torch_afdep.egg-info" / "requires.txt") as f:
        lines = [ln.strip() for ln in f]
    install_requires = lines[:lines.index("")] if "" in lines else lines
    assert install_requires == ["torch>=2.11"]
    assert not any("==" in ln for ln in lines)


@pytest.fixture
def tree(tmp_path):
    """A small copy of the build inputs: csrc/, setup.py and a built-looking package."""
    shutil.copytree(os.path.join(ROOT, "csrc"), tmp_path / "csrc",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, "setup.py"), tmp_path / "setup.py")
    (tmp_path / "torch_afdep").mkdir()
    (tmp_path / "torch_afdep" / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    return tmp_path


def test_stamp_changes_with_a_source_and_is_stable_otherwise(tree):
    check = _setup_check()
    first = check.stamp(str(tree), "2.13.0", {})
    assert check.stamp(str(tree), "2.13.0", {}) == first
    assert check.stamp(str(tree), "2.13.0", {"AFDEP_UNRELATED": "1"}) == first

    kernel = tree / "csrc" / "kernels" / "dispatch.cu"
    original = kernel.read_bytes()
    kernel.write_bytes(original + b"\n// one more line\n")
    assert check.stamp(str(tree), "2.13.0", {}) != first
    kernel.write_bytes(original)
    assert check.stamp(str(tree), "2.13.0", {}) == first

    (tree / "csrc" / "kernels" / "new.cuh").write_text("// a new header\n")
    assert check.stamp(str(tree), "2.13.0", {}) != first
    (tree / "csrc" / "kernels" / "new.cuh").unlink()

    assert check.stamp(str(tree), "2.11.0", {}) != first
    assert check.stamp(str(tree), "2.13.0", {"AFDEP_CUDA_ARCH": "sm_100a"}) != first
    with open(tree / "setup.py", "a") as f:
        f.write("\n# changed\n")
    assert check.stamp(str(tree), "2.13.0", {}) != first


def test_build_is_skipped_only_when_the_stamp_matches(tree):
    check = _setup_check()
    stamp_file = tree / "stamp"
    assert check.build_needed(str(stamp_file), str(tree), "2.13.0", {})  # never built

    stamp_file.write_text(check.stamp(str(tree), "2.13.0", {}) + "\n")
    assert not check.build_needed(str(stamp_file), str(tree), "2.13.0", {})

    assert check.build_needed(str(stamp_file), str(tree), "2.14.0", {})  # torch changed
    (tree / "csrc" / "host" / "comm.cpp").write_text("// edited\n")
    assert check.build_needed(str(stamp_file), str(tree), "2.13.0", {})

    stamp_file.write_text(check.stamp(str(tree), "2.13.0", {}))
    assert not check.build_needed(str(stamp_file), str(tree), "2.13.0", {})
    for so in (tree / "torch_afdep").glob("_C.*.so"):  # built modules removed (git clean)
        so.unlink()
    assert check.build_needed(str(stamp_file), str(tree), "2.13.0", {})


def test_requirements_check(tmp_path):
    check = _setup_check()
    met = tmp_path / "met.txt"
    met.write_text("# a comment\npytest\n\ntorch>=2.11  # inline comment\n")
    assert check.requirements_met(str(met))
    unmet = tmp_path / "unmet.txt"
    unmet.write_text("torch<1.0\n")
    assert not check.requirements_met(str(unmet))
    missing = tmp_path / "missing.txt"
    missing.write_text("no-such-package-afdep-test\n")
    assert not check.requirements_met(str(missing))
