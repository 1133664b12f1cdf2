"""README's "The API in 20 lines" is examples/readme_api.py's marked block, verbatim, and that
file runs: 4 ranks, both the Buffer API and the functional form, checked against the fp64
reference."""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "examples", "readme_api.py")
BEGIN = '# ---- README "The API in 20 lines": begin ----\n'
END = '# ---- README "The API in 20 lines": end ----\n'


def marked_block() -> str:
    with open(SCRIPT) as f:
        text = f.read()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)]


def readme_block() -> str:
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    section = text[text.index("## The API in 20 lines\n"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"```python\n(.*?)```\n", section, re.S)
    assert len(blocks) == 1, "the section holds one python block"
    return blocks[0]


def test_readme_block_is_the_example_verbatim():
    block = readme_block()
    assert block == marked_block()
    for name in ("init_process_group", "Config(", "source_dispatch", "source_collect",
                 "worker_receive", "worker_reply", "afd_dispatch", "afd_combine",
                 "afd_receive", "afd_reply"):
        assert name in block, name
    # The functional calls run inside the Buffer's lifetime (the old README had them after).
    with_at = block.index("with Buffer(")
    assert all(block.index(f) > with_at and block.splitlines()[
        block[:block.index(f)].count("\n")].startswith("    ")
        for f in ("afd_dispatch", "afd_receive"))
    assert len(block.splitlines()) <= 40


def test_readme_example_runs():
    env = {k: v for k, v in os.environ.items() if not k.startswith("AFDEP_")}
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [env.get("PYTHONPATH")] if p])
    p = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, env=env,
                       timeout=400, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [ln for ln in p.stdout.splitlines() if "relative error against the fp64" in ln]
    assert len(lines) == 2, p.stdout  # one per Attention rank
    assert sum("expert rows in the last exchange" in ln for ln in p.stdout.splitlines()) == 2
    assert "OK:" in p.stdout and "finished on 4 ranks" in p.stdout
