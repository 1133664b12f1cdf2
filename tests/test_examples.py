"""Each example runs end to end and checks itself."""

import os
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


@pytest.fixture()
def examples_path():
    sys.path.insert(0, EXAMPLES)  # spawned ranks inherit sys.path and import the example
    yield
    sys.path.remove(EXAMPLES)


def test_dtensor_moe_example(examples_path, capsys):
    import dtensor_moe

    assert dtensor_moe.main(["--layout", "1A2F", "--steps", "2", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "exact slice: True" in out and "(backend afdep)" in out and "PASS" in out
