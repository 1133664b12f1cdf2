"""Each example runs end to end and checks itself; every example answers an unsupported layout
with an argparse error (usage, reason, exit status 2), not a traceback."""

import importlib
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples")
WITH_LAYOUT = ["compiled_moe", "dtensor_moe", "two_microbatch_pipeline", "vllm_connector_loop"]


@pytest.fixture()
def examples_path():
    sys.path.insert(0, EXAMPLES)  # spawned ranks inherit sys.path and import the example
    yield
    sys.path.remove(EXAMPLES)


def test_dtensor_moe_example_roles_afaf(examples_path, capsys):
    """--roles AFF: the backend's AFDEP_ROLES and the Config take the same non-default order."""
    import dtensor_moe

    assert dtensor_moe.main(["--roles", "AFF", "--steps", "2", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 attention" in out and "rank 2 ffn" in out
    assert "exact slice: True" in out and "(backend afdep)" in out and "PASS" in out


@pytest.mark.parametrize("name", WITH_LAYOUT)
@pytest.mark.parametrize("layout, fragment", [
    ("1A3F", "cannot run layout 1A3F with these arguments: num_experts (8) must be divisible "
             "by ffn_ranks (3)"),
    ("1A65F", "cannot run layout 1A65F with these arguments"),
    ("2X2F", "argument --layout: layout must look like '2A2F'"),
])
def test_unsupported_layout_is_an_argparse_error(examples_path, capsys, name, layout,
                                                 fragment):
    mod = importlib.import_module(name)
    with pytest.raises(SystemExit) as e:
        mod.main(["--layout", layout])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:") and fragment in err, err
