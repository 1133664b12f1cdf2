"""The design docs name only things that exist: files they link or quote, tests they cite,
environment variables. (docs/history.md is exempt: it may name what has since gone.)"""

import glob
import os
import re

import pytest

from tests.helpers.scripts import ROOT
from torch_afdep import env

DOCS = ["README.md", "docs/contract.md", "docs/protocol.md", "docs/vllm.md",
        "benchmarks/README.md", "results/README.md"]
#: top-level folders whose paths the docs quote in backticks
TOP = ("tests", "scripts", "benchmarks", "torch_afdep", "csrc", "examples", "docs", "results")


def _text(doc: str) -> str:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        return f.read()


def _test_sources() -> str:
    return "".join(open(p, encoding="utf-8").read()
                   for p in glob.glob(os.path.join(ROOT, "tests", "**", "*.py"), recursive=True))


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    base = os.path.dirname(os.path.join(ROOT, doc))
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _text(doc)):
        path = target.split("#", 1)[0]
        if not path or re.match(r"[a-z]+:", path):  # an anchor in the same file, or a URL
            continue
        if not os.path.exists(os.path.normpath(os.path.join(base, path))):
            missing.append(target)
    assert not missing, f"{doc} links to files that do not exist: {missing}"


def _defines(source: str, name: str, prefix: bool) -> bool:
    """Whether ``source`` defines ``name`` (with ``prefix``: a name that starts with it)."""
    return re.search(r"def " + re.escape(name) + ("" if prefix else r"\b"), source) is not None


@pytest.mark.parametrize("doc", DOCS)
def test_quoted_paths_and_tests_exist(doc):
    text = _text(doc)
    missing = []
    # a name followed by * or <...> is a pattern (a test name's prefix, or a file a tool
    # writes, e.g. `results/benchmarks/soak-<machine>.json`): its folder must exist
    pat = r"`((?:%s)/[A-Za-z0-9_./-]*)(?:::([A-Za-z0-9_]+))?([*<]?)" % "|".join(TOP)
    for path, test, more in re.findall(pat, text):
        full = os.path.join(ROOT, path)
        if not os.path.exists(os.path.dirname(full) if more and not test else full):
            missing.append(path)
        elif test and not _defines(open(full, encoding="utf-8").read(), test, bool(more)):
            missing.append(f"{path}::{test}")
    srcs = _test_sources()
    missing += [name for name, more in set(re.findall(r"`(test_[A-Za-z0-9_]+)([*<]?)", text))
                if not _defines(srcs, name, bool(more))]
    assert not missing, f"{doc} names files or tests that do not exist: {sorted(missing)}"


@pytest.mark.parametrize("doc", [d for d in DOCS if d != "results/README.md"])
def test_environment_variables_are_registered(doc):
    """(results/README.md is exempt: its rows name the controls of past A/B runs.)"""
    names = set(re.findall(r"\bAFDEP_[A-Z0-9_]*[A-Z0-9]\b(?!\*)", _text(doc)))
    unknown = sorted(n for n in names if n not in env.SETTINGS)
    assert not unknown, f"{doc} names AFDEP_ variables torch_afdep/env.py does not register: {unknown}"


def test_the_checks_catch_a_stale_reference(tmp_path, monkeypatch):
    """The checks above fail on a doc naming a removed test file, test and variable."""
    doc = tmp_path / "stale.md"
    doc.write_text("see `tests/gpu/test_nn_gpu.py`, `test_not_a_test_anywhere`, AFDEP_NOT_A_VAR "
                   "and [a link](nowhere.md)\n", encoding="utf-8")
    monkeypatch.setitem(globals(), "ROOT", str(tmp_path))
    for check in (test_relative_links_resolve, test_quoted_paths_and_tests_exist,
                  test_environment_variables_are_registered):
        with pytest.raises(AssertionError):
            check("stale.md")
