"""The vLLM AFD-plugin connector (torch_afdep.integrations.vllm) on CPU: the plugin's call
sequence replayed on a 1A2F world (two micro-batches, several layers, warm-up then a
"capture" phase on static tensors) in both receive layouts (expert-major rows; token-major
hidden states with their routing context, one reply row per token), settings parsing, registration with a stand-in factory
that loads connectors the way the plugin does, no vLLM import, and the example engine loop."""

import importlib
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from torch_afdep.testing import spawn_world

from tests.helpers import vllm_bodies as _bodies

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples")


@pytest.mark.parametrize("receive_layout", ["experts", "tokens"])
def test_plugin_call_sequence_1a2f(receive_layout):
    results = spawn_world(_bodies.vllm_world_body, 3, 3, receive_layout, timeout=240)
    ffn, attn = results[:2], results[2:]
    n = 3 * 3 * 2  # steps x layers x micro-batches
    for r in attn:
        assert len(r["errors"]) == n and all(e < 1e-2 for e in r["errors"]), r["errors"]
        # Captured steps read the same preallocated output every time.
        assert r["stable_outputs"] == {0: 1}
        assert len(r["messages"]) == 5
    for r in ffn:
        assert not r["problems"], r["problems"][:5]
        # tokens: also weights_applied=False and a wrong row count are refused
        assert len(r["messages"]) == (4 if receive_layout == "tokens" else 2), r["messages"]


def test_no_vllm_import_at_load():
    before = set(sys.modules)
    mod = importlib.import_module("torch_afdep.integrations.vllm")
    new = set(sys.modules) - before
    assert not [m for m in new if m.split(".")[0] in ("vllm", "afd_plugin")]
    assert mod.CONNECTOR_NAME == "afdep"


def test_settings_from_plugin_config():
    from torch_afdep.integrations.vllm import parse_settings

    s = parse_settings(_bodies.fake_vllm_config("attention", 1, dtype="fp8", bucket=4))
    assert (s.role, s.num_attention_ranks, s.num_ffn_ranks, s.role_rank) == \
        ("attention", 2, 2, 1)
    assert s.group_rank == 3 and s.num_layers == 3 and s.bucket == 4
    assert (s.hidden_size, s.num_experts, s.top_k) == (128, 8, 2)
    assert s.dtype == torch.float8_e4m3fn
    cfg = s.afdep_config()
    assert cfg.num_slots == 2 and cfg.attention_ranks == 2 and cfg.capacity_tokens_per_rank == 8
    ffn = parse_settings(_bodies.fake_vllm_config("ffn", 0))
    assert ffn.group_rank == 0
    assert ffn.receive_layout == "experts" and ffn.afdep_config().receive_layout == "experts"


def test_receive_layout_setting():
    """extra_config receive_layout reaches the Config; anything else is refused by name."""
    from torch_afdep.integrations.vllm import parse_settings

    s = parse_settings(_bodies.fake_vllm_config("ffn", 1, receive_layout="tokens"))
    assert s.receive_layout == "tokens" and s.afdep_config().receive_layout == "tokens"
    with pytest.raises(ValueError, match=r"extra_config\['receive_layout'\] must be one of "
                                         r"\['experts', 'tokens'\], got 'rows'"):
        parse_settings(_bodies.fake_vllm_config("ffn", 1, receive_layout="rows"))


def test_settings_from_in_tree_afd_config():
    """vLLM's in-tree AFD config: afd_* names, afd_size "AxF", num_afd_stages."""
    from torch_afdep.integrations.vllm import parse_settings

    hf = SimpleNamespace(text_config=SimpleNamespace(hidden_size=256, num_experts=16,
                                                     num_experts_per_tok=4,
                                                     num_hidden_layers=2))
    afd = SimpleNamespace(afd_connector="afdep", afd_role="ffn", afd_host="h", afd_port=1,
                          num_afd_stages=3,
                          afd_extra_config={"afd_size": "3A1F", "afd_role_rank": 0})
    vcfg = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf), afd_config=afd,
                           scheduler_config=SimpleNamespace(max_num_batched_tokens=64))
    s = parse_settings(vcfg, rank=5)
    assert (s.role, s.num_attention_ranks, s.num_ffn_ranks, s.num_ubatches) == ("ffn", 3, 1, 3)
    assert (s.hidden_size, s.num_experts, s.top_k, s.capacity_tokens_per_rank) == \
        (256, 16, 4, 64)
    assert (s.host, s.port, s.role_rank) == ("h", 1, 0)


@pytest.mark.parametrize("afd, fragment", [
    ({"role": "expert", "num_attention_ranks": 1, "num_ffn_ranks": 1}, "role must be"),
    ({"role": "ffn"}, "num_attention_ranks and num_ffn_ranks"),
    ({"role": "ffn", "extra_config": {"afd_size": "2x2"}}, "afd_size must look like"),
    ({"role": "ffn", "num_attention_ranks": 1, "num_ffn_ranks": 1,
      "extra_config": {"hidden_size": 8, "num_experts": 2, "top_k": 1}},
     "capacity_tokens_per_rank"),
])
def test_settings_errors(afd, fragment):
    from torch_afdep.integrations.vllm import parse_settings

    with pytest.raises(ValueError) as info:
        parse_settings(SimpleNamespace(additional_config={"afd": afd}))
    assert fragment in str(info.value)


def test_num_slots_is_num_ubatches():
    """The Buffer API's name, num_slots, is the same setting as vLLM's num_ubatches."""
    from torch_afdep.integrations.vllm import parse_settings

    def settings(**extra):
        afd = {"role": "ffn", "num_attention_ranks": 1, "num_ffn_ranks": 1,
               "extra_config": {"hidden_size": 8, "num_experts": 2, "top_k": 1,
                                "capacity_tokens_per_rank": 4, **extra}}
        return parse_settings(SimpleNamespace(additional_config={"afd": afd}))

    s = settings(num_slots=3)
    assert s.num_ubatches == 3 and s.num_slots == 3 and s.afdep_config().num_slots == 3
    assert settings(num_ubatches=4, num_slots=4).num_ubatches == 4
    assert settings().num_ubatches == 2
    with pytest.raises(ValueError, match="are the same setting; give one"):
        settings(num_ubatches=2, num_slots=3)


@pytest.mark.parametrize("role, size, want", [
    ("F", "2a2f", ("ffn", 2, 2)),
    ("Attention", " 3A1F ", ("attention", 3, 1)),
    ("a", "1A2F", ("attention", 1, 2)),
])
def test_role_and_layout_spellings(role, size, want):
    """Roles as parse_roles reads them, afd_size as parse_layout reads it."""
    from torch_afdep.integrations.vllm import parse_settings

    afd = {"role": role, "extra_config": {"afd_size": size, "hidden_size": 8,
                                          "num_experts": 4, "top_k": 1,
                                          "capacity_tokens_per_rank": 4}}
    s = parse_settings(SimpleNamespace(additional_config={"afd": afd}))
    assert (s.role, s.num_attention_ranks, s.num_ffn_ranks) == want


def test_register_with_a_plugin_like_factory():
    """The plugin's factory imports the module and checks issubclass(cls, AFDConnectorBase)."""
    import abc

    from torch_afdep.integrations import vllm as mod

    class Base(abc.ABC):
        @abc.abstractmethod
        def send_attn_output(self, hidden_states, metadata, ubatch_idx=None): ...

        @property
        @abc.abstractmethod
        def is_initialized(self): ...

    class Factory:
        registry = {}

        @classmethod
        def register_connector(cls, name, module_path, class_name, *, replace=False):
            def loader():
                c = vars(importlib.import_module(module_path))[class_name]
                assert issubclass(c, Base)
                return c
            cls.registry[name] = loader

    cls = mod.register_with_vllm("afdep", factory=Factory, base=Base)
    loaded = Factory.registry["afdep"]()
    assert loaded is cls and issubclass(cls, mod.AfdepConnector)
    conn = loaded(0, 0, _bodies.fake_vllm_config("ffn", 0))  # abstract methods all present
    assert not conn.is_initialized and conn.get_connector_rank() == 0
    with pytest.raises(ImportError):
        mod._vllm_classes()  # neither the plugin nor vLLM is installed here


@pytest.mark.parametrize("receive_layout", ["experts", "tokens"])
def test_vllm_connector_loop_example(capsys, receive_layout):
    sys.path.insert(0, EXAMPLES)
    try:
        import vllm_connector_loop

        assert vllm_connector_loop.main(["--layout", "1A1F", "--layers", "2",
                                         "--steps", "2", "--receive-layout",
                                         receive_layout]) == 0
    finally:
        sys.path.remove(EXAMPLES)
    out = capsys.readouterr().out
    assert "PASS" in out and "ubatch" in out
    assert f"{receive_layout} receive layout" in out
