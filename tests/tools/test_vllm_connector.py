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


# ---- argument checks, without a world -----------------------------------------------------------
def _plugin_config(afd=None, **extra):
    """A stand-in VllmConfig of 2A2F (the Attention rank 1) with model sizes in hf_config;
    ``afd`` overrides AFD-config keys, ``extra`` extra_config keys (None removes one)."""
    cfg = _bodies.fake_vllm_config("attention", 1)
    a = cfg.additional_config["afd"]
    for table, changes in ((a, afd or {}), (a["extra_config"], extra)):
        for key, value in changes.items():
            if value is None:
                table.pop(key, None)
            else:
                table[key] = value
    return cfg


@pytest.mark.parametrize("afd, extra, exc, match", [
    # integer settings: floats are never truncated, words never int()-ed
    ({"num_attention_ranks": 1.7}, {}, ValueError,
     r"num_attention_ranks must be an int >= 1, got 1\.7 \(not truncated\)"),
    ({"num_ffn_ranks": "two"}, {}, ValueError, r"num_ffn_ranks must be an int in \[1, 64\], "
                                               r"got 'two'"),
    ({"num_ffn_ranks": True}, {}, TypeError, r"num_ffn_ranks must be an int .*got bool True"),
    ({}, {"capacity_tokens_per_rank": 8.9}, ValueError,
     r"extra_config\['capacity_tokens_per_rank'\] must be an int >= 1, got 8\.9"),
    ({}, {"capacity_tokens_per_rank": "8 tokens"}, ValueError,
     r"extra_config\['capacity_tokens_per_rank'\] must be an int >= 1, got '8 tokens'"),
    ({}, {"top_k": 2.5}, ValueError, r"extra_config\['top_k'\] must be an int >= 1, got 2\.5"),
    ({}, {"top_k": "two"}, ValueError, r"extra_config\['top_k'\] must be an int >= 1, got 'two'"),
    ({}, {"hidden_size": [128]}, TypeError,
     r"extra_config\['hidden_size'\] must be an int >= 1, got list \[128\]"),
    ({}, {"num_experts": float("nan")}, ValueError, r"extra_config\['num_experts'\] must be an "
                                                    r"int >= 1, got nan"),
    ({}, {"num_sms": "24.0"}, ValueError, r"extra_config\['num_sms'\] must be an int >= 1"),
    ({"port": "x"}, {}, ValueError, r"port must be an int in \[1, 65535\], got 'x'"),
    ({"port": 70000}, {}, ValueError, r"port must be in \[1, 65535\], got 70000"),
    # float settings
    ({}, {"timeout_s": "abc"}, ValueError,
     r"extra_config\['timeout_s'\] must be a number of seconds in \(0, 1e\+06\], got 'abc'"),
    ({}, {"timeout_s": 0}, ValueError, r"extra_config\['timeout_s'\] must be a number of "
                                       r"seconds in \(0, 1e\+06\], got 0"),
    ({}, {"timeout_s": -5.0}, ValueError, r"extra_config\['timeout_s'\] .*got -5\.0"),
    ({}, {"timeout_s": 1e7}, ValueError, r"extra_config\['timeout_s'\] .*got 10000000\.0"),
    ({}, {"timeout_s": float("inf")}, ValueError, r"extra_config\['timeout_s'\] .*got inf"),
    ({}, {"timeout_s": "nan"}, ValueError, r"extra_config\['timeout_s'\] .*got 'nan'"),
    ({}, {"timeout_s": True}, TypeError, r"extra_config\['timeout_s'\] must be a number of "
                                         r"seconds .*got bool True"),
    # ranges
    ({}, {"bucket": 0}, ValueError,
     r"extra_config\['bucket'\] must be in \[1, 8\] \(at most capacity_tokens_per_rank; "
     r"absent: the capacity\), got 0"),
    ({}, {"bucket": -2}, ValueError, r"extra_config\['bucket'\] must be in \[1, 8\]"),
    ({}, {"bucket": 9}, ValueError, r"extra_config\['bucket'\] must be in \[1, 8\]"),
    ({"afd_role_rank": 5}, {}, ValueError,
     r"afd_role_rank must be in \[0, 1\] \(num_attention_ranks = 2 Attention ranks\), got 5"),
    ({"afd_role_rank": -1}, {}, ValueError, r"afd_role_rank must be in \[0, 1\] "
                                            r"\(num_attention_ranks = 2 Attention ranks\), got -1"),
    ({"afd_role_rank": 2, "role": "ffn", "num_ffn_ranks": 2}, {}, ValueError,
     r"afd_role_rank must be in \[0, 1\] \(num_ffn_ranks = 2 FFN ranks\), got 2"),
    ({"afd_role_rank": 0.5}, {}, ValueError, r"afd_role_rank must be an int in \[0, 1\]"),
    ({}, {"num_layers": -3}, ValueError, r"extra_config\['num_layers'\] must be >= 1, got -3"),
    ({}, {"num_layers": 0}, ValueError, r"extra_config\['num_layers'\] must be >= 1, got 0"),
    ({}, {"num_ubatches": 0}, ValueError,
     r"extra_config\['num_ubatches'\] must be in \[1, 16\], got 0"),
    ({}, {"num_ubatches": None, "num_slots": 17}, ValueError,
     r"extra_config\['num_slots'\] must be in \[1, 16\], got 17"),
    ({}, {"device": "tpu"}, ValueError,
     r"extra_config\['device'\] must be 'cuda' or 'cpu' .*got 'tpu'"),
    ({}, {"device": "cuda:1"}, ValueError, r"extra_config\['device'\] must be 'cuda' or 'cpu'"),
])
def test_settings_are_parsed_strictly(afd, extra, exc, match):
    from torch_afdep.integrations.vllm import parse_settings

    with pytest.raises(exc, match=match):
        parse_settings(_plugin_config(afd, **extra))


def test_settings_name_where_a_value_came_from():
    """Values from the model config, the scheduler, the in-tree names, or the rank argument
    are named as such."""
    from torch_afdep.integrations.vllm import parse_settings

    cfg = _plugin_config()
    cfg.model_config.hf_config.num_hidden_layers = 2.5
    with pytest.raises(ValueError, match=r"model_config\.hf_config\.num_hidden_layers must be "
                                         r"an int >= 1, got 2\.5"):
        parse_settings(cfg)
    cfg = _plugin_config(capacity_tokens_per_rank=None)
    cfg.scheduler_config = SimpleNamespace(max_num_batched_tokens="many")
    with pytest.raises(ValueError, match=r"scheduler_config\.max_num_batched_tokens must be an "
                                         r"int >= 1, got 'many'"):
        parse_settings(cfg)
    with pytest.raises(ValueError, match=r"afd_role_rank \(absent: the rank argument\) must be "
                                         r"in \[0, 1\] .*got 5"):
        parse_settings(_plugin_config({"afd_role_rank": None}), rank=5)
    with pytest.raises(ValueError, match=r"afd_port must be an int in \[1, 65535\], got '1x'"):
        parse_settings(_plugin_config({"port": None, "afd_port": "1x"}))
    with pytest.raises(ValueError, match=r"extra_config\['afd_role_rank'\] must be in \[0, 1\]"):
        parse_settings(_plugin_config({"afd_role_rank": None}, afd_role_rank=3))
    with pytest.raises(ValueError, match=r"num_afd_stages must be in \[1, 16\], got 0"):
        parse_settings(_plugin_config({"num_afd_stages": 0}, num_ubatches=None))


def test_settings_take_ints_as_text():
    """What config files and command lines give: strings of ints, integral floats, numbers
    as text for timeout_s; the results are plain ints and floats."""
    from torch_afdep.integrations.vllm import parse_settings

    s = parse_settings(_plugin_config(
        {"num_attention_ranks": "2", "num_ffn_ranks": 2.0, "afd_role_rank": " 1 ",
         "port": "29601"},
        capacity_tokens_per_rank="8", top_k="2", bucket=" 4 ", num_layers=5.0,
        num_ubatches="3", timeout_s="30", num_sms="16", device="cpu"))
    assert (s.num_attention_ranks, s.num_ffn_ranks, s.role_rank, s.port) == (2, 2, 1, 29601)
    assert (s.capacity_tokens_per_rank, s.top_k, s.bucket, s.num_layers) == (8, 2, 4, 5)
    assert (s.num_ubatches, s.timeout_s, s.num_sms, s.device) == (3, 30.0, 16, "cpu")
    assert all(type(v) is int for v in (s.num_ffn_ranks, s.num_layers, s.bucket, s.port))
    assert parse_settings(_plugin_config(bucket=None)).bucket is None  # absent: the capacity
    with pytest.raises(ValueError, match="are the same setting; give one"):
        parse_settings(_plugin_config(num_ubatches="2", num_slots=3))


@pytest.mark.parametrize("change, exc, match", [
    ({"role_rank": 5}, ValueError, r"role_rank \(afd_role_rank\) must be in \[0, 1\] "
                                   r"\(num_attention_ranks = 2 Attention ranks\), got 5"),
    ({"role_rank": -1}, ValueError, r"role_rank \(afd_role_rank\) must be in \[0, 1\] .*got -1"),
    ({"role_rank": 1.0}, TypeError, r"role_rank \(afd_role_rank\) must be an int in \[0, 1\] "
                                    r".*got float 1\.0"),
    ({"num_layers": -3}, ValueError, r"num_layers must be >= 1, got -3"),
    ({"num_layers": 2.5}, TypeError, r"num_layers must be an int >= 1, got float 2\.5"),
    ({"bucket": 0}, ValueError, r"bucket must be in \[1, 8\] \(at most capacity_tokens_per_rank; "
                                r"None: the capacity\), got 0"),
    ({"num_ubatches": 0}, ValueError, r"num_ubatches must be in \[1, 16\], got 0"),
    ({"device": "tpu"}, ValueError, r"device must be 'cuda' or 'cpu' .*got 'tpu'"),
    ({"role": "expert"}, ValueError, r"role must be 'attention' or 'ffn', got 'expert'"),
    ({"port": 0}, ValueError, r"port must be in \[1, 65535\], got 0"),
])
def test_connector_settings_built_directly_are_checked(change, exc, match):
    from torch_afdep.integrations.vllm import ConnectorSettings

    fields = dict(role="attention", num_attention_ranks=2, num_ffn_ranks=2, role_rank=1,
                  capacity_tokens_per_rank=8, hidden_size=128, num_experts=8, top_k=2)
    ConnectorSettings(**fields)
    with pytest.raises(exc, match=match):
        ConnectorSettings(**{**fields, **change})


def _groupless_connector(role, monkeypatch, **extra):
    """An AfdepConnector of 2A2F marked initialized on a stand-in buffer with no process group,
    every exchange op replaced by one that raises: a check that names the argument ran
    before any communication."""
    from torch_afdep.integrations import vllm as mod

    def exchange(*args, **kwargs):
        raise AssertionError("an exchange started")

    for name in ("afd_dispatch", "afd_combine", "afd_receive", "afd_reply"):
        monkeypatch.setattr(mod._ops, name, exchange)
    conn = mod.AfdepConnector(0, 0, _bodies.fake_vllm_config(role, 1, **extra))
    conn.buffer = SimpleNamespace(group_name="no-such-group", buffer_id=0,
                                  device=torch.device("cpu"), role_index=1)
    conn._initialized = True
    return conn


@pytest.mark.parametrize("ubatch_idx, exc, match", [
    (True, TypeError, r"ubatch_idx must be an int in \[0, 2\) \(num_ubatches\), got bool True"),
    (0.7, TypeError, r"ubatch_idx must be an int in \[0, 2\) \(num_ubatches\), got float 0\.7"),
    (1.0, TypeError, r"ubatch_idx must be an int .*got float 1\.0"),
    ("1", TypeError, r"ubatch_idx must be an int .*got str '1'"),
    (torch.tensor(1), TypeError, r"ubatch_idx must be an int .*got Tensor"),
    (2, ValueError, r"ubatch_idx must be in \[0, 2\) \(num_ubatches\), got 2"),
    (-1, ValueError, r"ubatch_idx must be in \[0, 2\) \(num_ubatches\), got -1"),
])
def test_ubatch_idx_type_is_checked_first(ubatch_idx, exc, match, monkeypatch):
    """True is not slot 1 and 0.7 not slot 0, on every method that takes ubatch_idx."""
    attn = _groupless_connector("attention", monkeypatch)
    ffn = _groupless_connector("ffn", monkeypatch)
    ids, w = torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    h = torch.zeros(3, 128)
    calls = [
        lambda: attn.send_attn_output(h, {"topk_ids": ids, "topk_weights": w},
                                      ubatch_idx=ubatch_idx),
        lambda: attn.send_attn_output(h, {"topk_ids": ids, "topk_weights": w,
                                          "ubatch_idx": ubatch_idx}),
        lambda: attn.recv_ffn_output(None, ubatch_idx=ubatch_idx),
        lambda: ffn.recv_attn_output(ubatch_idx=ubatch_idx),
        lambda: ffn.send_ffn_output(torch.zeros(32, 128), None, ubatch_idx=ubatch_idx),
    ]
    for call in calls:
        with pytest.raises(exc, match=match):
            call()
    assert attn._sent == {} and ffn._open == {}
    assert attn._slot(1) == 1
    np = pytest.importorskip("numpy")
    assert attn._slot(np.int64(1)) == 1 and type(attn._slot(np.int64(1))) is int


@pytest.mark.parametrize("ids, weights, exc, match", [
    (torch.tensor([[0.0, 1.9]] * 3), None, TypeError,
     r"topk_ids \(topk_idx\) must be an integer tensor \[T, k\] .*got torch\.float32"),
    (torch.ones(3, 2, dtype=torch.bool), None, TypeError,
     r"topk_ids \(topk_idx\) must be an integer tensor .*got torch\.bool"),
    ([[0, 1]] * 3, None, TypeError, r"topk_ids \(topk_idx\) must be an integer tensor .*got "
                                    r"list"),
    (None, torch.ones(3, 2, dtype=torch.int64), TypeError,
     r"topk_weights must be a floating-point tensor \[T, k\], got torch\.int64"),
])
def test_send_attn_output_checks_the_routing(ids, weights, exc, match, monkeypatch):
    conn = _groupless_connector("attention", monkeypatch)
    ids = torch.zeros(3, 2, dtype=torch.int32) if ids is None else ids
    weights = torch.ones(3, 2) if weights is None else weights
    for meta, kw in (({"topk_ids": ids, "topk_weights": weights}, {}),
                     ({}, {"topk_idx": ids, "topk_weights": weights})):
        with pytest.raises(exc, match=match):
            conn.send_attn_output(torch.zeros(3, 128), meta, 0, **kw)
    assert conn._sent == {}
    # Narrower integer ids are exact: they are widened and reach the exchange.
    with pytest.raises(AssertionError, match="an exchange started"):
        conn.send_attn_output(torch.zeros(3, 128), {
            "topk_ids": torch.zeros(3, 2, dtype=torch.int16), "topk_weights": torch.ones(3, 2)},
            0)


@pytest.mark.parametrize("receive_layout", ["experts", "tokens"])
@pytest.mark.parametrize("weights_applied", [True, False])
def test_send_ffn_output_checks_the_rows(receive_layout, weights_applied, monkeypatch):
    """ffn_output must have the shape the receive gave (2A2F, bucket 8: expert layout
    A*bucket*R = 2*8*2 = 32 rows, token layout A*24*ceil(8/24) = 48 rows), a float dtype and
    the buffer's device; the exchange stays open after a refusal."""
    from torch_afdep.integrations.vllm import AfdepFfnMetadata

    conn = _groupless_connector("ffn", monkeypatch, receive_layout=receive_layout)
    tokens = receive_layout == "tokens"
    n = conn.config.token_rows(8) if tokens else conn.config.recv_rows(8)
    assert n == (48 if tokens else 32)
    meta = AfdepFfnMetadata(
        layer_idx=0, ubatch_idx=0, expert_offsets=None if tokens else
        torch.tensor([0, 3, 5, 5, 9], dtype=torch.int32),
        topk_weights=torch.ones(n, 2) if tokens else torch.ones(n), x_scales=None,
        src_rank=torch.zeros(n, dtype=torch.int32), src_token=torch.zeros(n, dtype=torch.int32),
        receipt=None, local_expert_start=4, num_local_experts=4,
        weights_applied=weights_applied or tokens, receive_layout=receive_layout,
        topk_ids=torch.zeros(n, 2, dtype=torch.int32) if tokens else None)
    conn._open[0] = meta
    layout = "token layout" if tokens else "expert layout"
    for rows, exc, match in (
            (torch.zeros(n + 1, 128), ValueError,
             rf"send_ffn_output \({layout}\): ffn_output must be \[{n}, 128\] \(one row per "
             rf"received row\), got \[{n + 1}, 128\]"),
            (torch.zeros(n * 128), ValueError, rf"ffn_output must be \[{n}, 128\] .*got "
                                               rf"\[{n * 128}\]"),
            (torch.zeros(n, 64), ValueError, rf"ffn_output must be \[{n}, 128\]"),
            (torch.zeros(n, 128, dtype=torch.int32), TypeError,
             r"ffn_output must have a floating-point dtype, got torch\.int32"),
            (torch.zeros(n, 128, device="meta"), ValueError,
             r"ffn_output must be on cpu \(the buffer's device\), got meta"),
            ([[0.0] * 128] * n, TypeError, rf"ffn_output must be a torch\.Tensor \[{n}, 128\], "
                                           r"got list"),
    ):
        with pytest.raises(exc, match=match):
            conn.send_ffn_output(rows, meta, ubatch_idx=0)
        assert conn._open[0] is meta  # still open: nothing was sent
    with pytest.raises(AssertionError, match="an exchange started"):
        conn.send_ffn_output(torch.zeros(n, 128), meta)
