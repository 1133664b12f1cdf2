"""torch_afdep as an AFD connector of vLLM's AFD plugin (Attention-FFN disaggregation).

vLLM's AFD support (the in-tree ``vllm/distributed/afd_transfer`` connectors and the
out-of-tree AFD plugin) moves each MoE layer's input from Attention to FFN servers and the
result back through a *connector* object. ``AfdepConnector`` implements that contract on a
``torch_afdep.Buffer`` (NVLink peer memory on CUDA, gloo on CPU)::

    # Attention ranks, per layer and micro-batch (ubatch_idx = micro-batch slot)
    handle = conn.send_attn_output(hidden_states, metadata, ubatch_idx=ub)   # dispatch
    out = conn.recv_ffn_output(handle, ubatch_idx=ub)                         # combine
    # FFN ranks
    rows, meta = conn.recv_attn_output(ubatch_idx=ub)                         # receive
    conn.send_ffn_output(expert_rows, meta, ubatch_idx=ub)                    # reply
    # (receive_layout "tokens": rows are token-major hidden states, the reply one row each)

Method signatures follow the plugin's ``AFDConnectorBase`` (vLLM ``afd_transfer`` base with
``ubatch_idx``): ``__init__(rank, local_rank, config[, afd_config])``, ``init_afd_connector()``,
``is_initialized``, ``send_attn_output(hidden_states, metadata, ubatch_idx=None)``,
``recv_ffn_output(handle=None, ubatch_idx=None)``, ``recv_attn_output(timeout_ms=None,
ubatch_idx=None)``, ``send_ffn_output(ffn_output, metadata, ubatch_idx=None)``, ``close()``.
Nothing here imports vLLM; ``register_with_vllm()`` does, lazily, to register the connector.

What this connector assumes (the plugin leaves these to the connector):

- **Routing happens on Attention ranks.** ``metadata`` of ``send_attn_output`` (any object or
  mapping; keyword arguments override it) carries ``topk_ids`` (or vLLM's name ``topk_idx``)
  ``[T, k]`` int32/int64 global expert ids (-1 = none) and ``topk_weights`` ``[T, k]``, and may
  carry ``ubatch_idx`` (else ``stage_idx``), ``layer_idx`` and, for FP8 payloads already
  quantized, ``scale`` ``[T, H/128]`` float32 (BF16/other float hidden states are cast, or
  quantized per 128 elements when the exchange is FP8).
- **FFN ranks get expert-major rows by default** (``extra_config["receive_layout"] =
  "experts"``). ``recv_attn_output`` returns
  ``(rows [A*bucket*R, H], AfdepFfnMetadata)``: rows grouped by local expert, with
  ``expert_offsets``, each row's routing weight ``topk_weights``, ``x_scales`` (FP8), the
  ``layer_idx`` (counted per micro-batch slot, modulo ``num_layers`` when known) and the
  ``receipt``. The FFN model runs its experts on ``rows[expert_offsets[e]:expert_offsets[e+1]]``
  (e.g. ``torch_afdep.nn.SwiGLUExperts``, or ``torch._grouped_mm`` with
  ``offs=expert_offsets[1:]``) and passes the per-row outputs to ``send_ffn_output`` with the
  same metadata. The connector multiplies each row by its routing weight unless the model did
  and set ``metadata.weights_applied = True``; it then sums each token's rows and sends one
  row per token back.
- **Or token-major hidden states** (``extra_config["receive_layout"] = "tokens"``, the
  ``Config.receive_layout`` of the exchange): ``recv_attn_output`` returns
  ``(hidden_states [N, H], AfdepFfnMetadata)`` with N = ``Config.token_rows(bucket)``
  (static), one row per token that reached this FFN rank, which is what an FFN model runner's
  fused MoE takes, with the routing context: ``topk_ids`` ``[N, k]`` int32 *local* expert
  ids in ``[0, num_local_experts)`` in the source's column order, -1 for columns this rank
  does not serve (``global_topk_ids()`` gives global ids, -1 kept), ``topk_weights``
  ``[N, k]`` float32 (0 where the id is -1), ``x_scales`` (FP8), ``src_rank`` /
  ``src_token`` ``[N]`` and ``num_tokens`` ``[A]``; rows without a token have every id -1
  (``metadata.token_mask()``) and unspecified contents. ``hidden_states`` is a view of the
  receive window: read it, never write it (run the MoE out of place), valid until
  ``send_ffn_output``. ``send_ffn_output`` takes ``[N, H]``, row i = the token's MoE output
  (its local experts' outputs weighted by ``topk_weights`` and summed: the routing weights
  must be applied by the model; rows without a token are ignored) and sends it back as is.
- **ubatch_idx selects a micro-batch slot** (``num_ubatches`` is the Buffer API's
  ``Config.num_slots``; the extra config takes either name): up to that many exchanges are in
  flight at once; a slot is reused only after its exchange finished
  (``AfdepStateError`` otherwise). On FFN ranks ``ubatch_idx=None`` cycles through the slots.
- **CUDA graphs.** All memory is allocated in ``init_afd_connector``; ``recv_ffn_output``
  writes into a preallocated per-slot output ``[capacity, H]`` (and returns a view of its first
  T rows, the same address every step) or into ``handle`` when that is a tensor of the right
  shape (the engine's own static buffer). Every exchange uses one static ``bucket``
  (``extra_config["bucket"]``, default the capacity). The connector's methods are eager
  Python (state per slot); call them outside ``torch.compile``'d regions (or use
  ``torch_afdep.nn`` / ``torch_afdep.afd_*`` inside them).
- ``timeout_ms`` is accepted and ignored: ``timeout_s`` (extra config) bounds every wait.

Configuration. The connector reads the plugin's AFD config (``afd_config`` argument, or
``vllm_config.additional_config["afd"]``, or the in-tree ``vllm_config.afd_config``): role
(``"attention"`` / ``"ffn"``, or ``"A"`` / ``"F"``: ``parse_roles``' spellings),
``num_attention_ranks``/``num_ffn_ranks`` (or ``extra_config["afd_size"] = "2A2F"``, a layout
as ``torch_afdep.config.parse_layout`` reads it: Attention ranks, then FFN ranks),
``afd_role_rank``, ``host``/``port``, and these ``extra_config`` keys (model sizes default to
``model_config.hf_config``): ``capacity_tokens_per_rank`` (tokens per Attention rank and
micro-batch; default ``scheduler_config.max_num_batched_tokens``), ``num_ubatches`` (or its
Buffer API name ``num_slots``, the same setting; default ``num_afd_stages`` or 2),
``bucket``, ``hidden_size``, ``num_experts``, ``top_k``, ``num_layers``, ``dtype``
(``"bfloat16"`` | ``"float8_e4m3fn"``), ``receive_layout`` (``"experts"``, the default, |
``"tokens"``), ``num_sms``, ``timeout_s``, ``device`` (``"cuda"`` | ``"cpu"``). AFD group ranks: FFN ranks ``[0, F)`` then Attention ranks
``[F, F+A)``, each at ``afd_role_rank`` within its role.

Every setting is checked when it is read (``parse_settings``; TypeError / ValueError naming
the key, what is allowed and the value given, before any group or memory exists). Integer
settings are ints, floats without a fractional part or strings of ints (``"2"``, as config
files and command lines give them); ``1.7``, ``"two"`` and bools are refused, never
truncated. ``afd_role_rank`` (default: the ``rank`` argument) is in ``[0, ranks of that
role)``; ``num_ubatches`` in ``[1, MAX_SLOTS]``; ``num_layers`` >= 1; ``bucket`` in
``[1, capacity_tokens_per_rank]`` (absent: the capacity; 0 is refused); ``port`` in
``[1, 65535]``; ``timeout_s`` a number of seconds (or a string of one) in
``(0, MAX_TIMEOUT_S]``; ``device`` absent, ``"cuda"`` or ``"cpu"``.

Example (AFD plugin: register the name, then select it)::

    # in a plugin entry point / before the engine starts, on every rank
    from torch_afdep.integrations.vllm import register_with_vllm
    register_with_vllm("afdep")

    vllm serve deepseek-ai/DeepSeek-V2-Lite --additional-config '{"afd": {
        "enabled": true, "connector": "afdep", "role": "attention",
        "num_attention_ranks": 2, "num_ffn_ranks": 2, "afd_role_rank": 0,
        "host": "10.0.0.1", "port": 29600,
        "extra_config": {"capacity_tokens_per_rank": 256, "num_ubatches": 2}}}'

(the FFN servers use ``"role": "ffn"``). More in docs/vllm.md.

The AFD process group: ``group=`` when given; else the default group when its size is A + F;
else, when torch.distributed is not initialized, a new default gloo group at
``tcp://host:port``; else vLLM's ``init_afd_process_group`` when vLLM provides it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import types
from typing import Any, Dict, Mapping, Optional

import torch
import torch.distributed as dist

from .. import ops as _ops
from ..config import (ATTENTION, FFN, MAX_FFN_RANKS, MAX_SLOTS, MAX_TIMEOUT_S,
                      RECEIVE_LAYOUTS, Config, check_int_range, parse_layout, parse_roles)
from ..errors import AfdepStateError

CONNECTOR_NAME = "afdep"
#: How messages name the roles.
_ROLE_NAMES = {ATTENTION: "Attention", FFN: "FFN"}
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float8_e4m3fn": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn}
#: extra_config["device"]: where the buffer lives (None: Buffer's default).
DEVICES = ("cuda", "cpu")
#: TCP ports the rendezvous may use.
_PORTS = (1, 65535)
_INT_TEXT = re.compile(r"\s*[+-]?\d+\s*")


# ---- metadata and handles ------------------------------------------------------------------
@dataclasses.dataclass
class AfdepSendHandle:
    """What ``send_attn_output`` returns (pass it to ``recv_ffn_output``): ``route`` [T] int64
    (bit f: the token reached FFN index f; ``afd_dispatch``'s handle), the micro-batch slot
    ``ubatch_idx``, T as ``num_tokens``, and the layer."""

    route: torch.Tensor
    ubatch_idx: int
    num_tokens: int
    layer_idx: Optional[int] = None


@dataclasses.dataclass
class AfdepFfnMetadata:
    """The metadata ``recv_attn_output`` returns on FFN ranks; pass it to ``send_ffn_output``.

    Expert layout (``receive_layout == "experts"``), N = A*bucket*R rows: expert_offsets
    [E_local+1] int32: rows of local expert e are ``rows[expert_offsets[e]:expert_offsets[e+1]]``
    (global expert ``local_expert_start + e``); topk_weights [N] float32: each row's routing
    weight; topk_ids None. Set ``weights_applied = True`` when the model already multiplied
    rows by topk_weights.

    Token layout (``receive_layout == "tokens"``), N = ``Config.token_rows(bucket)`` rows, one
    per token: topk_ids [N, k] int32 local expert ids in [0, num_local_experts) or -1;
    topk_weights [N, k] float32 (0 where the id is -1); num_tokens [A] int32 tokens from each
    Attention rank; expert_offsets None; weights_applied is True (the model's rows are the
    weighted sums; the connector cannot apply weights to them).

    Both: x_scales [N, H/128] float32 (FP8) or None; src_rank / src_token [N] int32: each
    row's source (-1: a token-layout row without a token); receipt: the exchange's receipt."""

    layer_idx: int
    ubatch_idx: int
    expert_offsets: Optional[torch.Tensor]
    topk_weights: torch.Tensor
    x_scales: Optional[torch.Tensor]
    src_rank: torch.Tensor
    src_token: torch.Tensor
    receipt: Any
    local_expert_start: int
    num_local_experts: int
    weights_applied: bool = False
    receive_layout: str = "experts"
    topk_ids: Optional[torch.Tensor] = None
    num_tokens: Optional[torch.Tensor] = None

    @property
    def stage_idx(self) -> int:
        return self.ubatch_idx

    def token_mask(self) -> torch.Tensor:
        """Token layout: which rows hold a token.

        Returns:
            mask: [N] bool, True where the row has at least one local expert id.
        """
        if self.topk_ids is None:
            raise ValueError("token_mask() is for the token layout (receive_layout='tokens')")
        return (self.topk_ids >= 0).any(dim=1)

    def global_topk_ids(self) -> torch.Tensor:
        """Token layout: ``topk_ids`` as global expert ids.

        Returns:
            ids: [N, k] int32, ``local_expert_start + topk_ids`` where topk_ids >= 0, else -1.
        """
        if self.topk_ids is None:
            raise ValueError("global_topk_ids() is for the token layout "
                             "(receive_layout='tokens')")
        return torch.where(self.topk_ids >= 0, self.topk_ids + self.local_expert_start,
                           self.topk_ids)


# ---- settings -------------------------------------------------------------------------------
def _get(obj, *names, default=None):
    """First present, non-None attribute or key of ``obj`` among ``names``."""
    if obj is None:
        return default
    for n in names:
        v = obj.get(n) if isinstance(obj, Mapping) else getattr(obj, n, None)
        if v is not None:
            return v
    return default


def _int_setting(key: str, value, low: int, high: Optional[int] = None,
                 why: str = "") -> int:
    """An integer setting read strictly: an int, a float without a fractional part (2.0), or
    a string of an int ("2", as config files and command lines give it). Anything else, a
    fractional float (never truncated), a bool or another string, and a value outside
    [low, high] raise TypeError / ValueError naming ``key``, what is allowed and the value."""
    allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
    allowed += why
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise TypeError(f"{key} must be an int {allowed}, got {type(value).__name__} "
                        f"{value!r}")
    if isinstance(value, str):
        if not _INT_TEXT.fullmatch(value):
            raise ValueError(f"{key} must be an int {allowed}, got {value!r}")
        v = int(value)
    elif isinstance(value, numbers.Integral):
        v = int(value)
    else:
        if not float(value).is_integer():  # also NaN and infinity
            raise ValueError(f"{key} must be an int {allowed}, got {value!r} (not truncated)")
        v = int(value)
    return check_int_range(key, v, low, high, why)


def _seconds_setting(key: str, value) -> float:
    """A wait bound in seconds: a number or a string of one ("2.5", "60") in
    (0, MAX_TIMEOUT_S]; TypeError / ValueError naming ``key`` otherwise (bools, other
    strings, NaN, infinity, zero, negative numbers)."""
    allowed = f"a number of seconds in (0, {MAX_TIMEOUT_S:g}]"
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise TypeError(f"{key} must be {allowed}, got {type(value).__name__} {value!r}")
    try:
        v = float(value)
    except ValueError:
        raise ValueError(f"{key} must be {allowed}, got {value!r}") from None
    if not (math.isfinite(v) and 0 < v <= MAX_TIMEOUT_S):
        raise ValueError(f"{key} must be {allowed}, got {value!r}")
    return v


def _role_ranks(role: str, n_att: int, n_ffn: int):
    """(ranks of ``role``, what to say about that count) for afd_role_rank's range."""
    n = n_att if role == ATTENTION else n_ffn
    count = "num_attention_ranks" if role == ATTENTION else "num_ffn_ranks"
    return n, f" ({count} = {n} {_ROLE_NAMES[role]} ranks)"


def _check_device(key: str, device) -> None:
    if device is not None and device not in DEVICES:
        raise ValueError(f"{key} must be 'cuda' or 'cpu' (or absent: the Buffer's default), "
                         f"got {device!r}")


@dataclasses.dataclass(frozen=True)
class ConnectorSettings:
    """Everything the connector needs, resolved from vLLM's configs (``parse_settings``).

    Built directly, its fields are checked too (TypeError / ValueError naming the field):
    role ``"attention"`` / ``"ffn"``; role_rank (``afd_role_rank``) in [0, ranks of that
    role); num_ubatches in [1, MAX_SLOTS]; num_layers None or >= 1; bucket None (the
    capacity) or in [1, capacity_tokens_per_rank]; device None, ``"cuda"`` or ``"cpu"``;
    port in [1, 65535]. The exchange's sizes are checked by ``Config`` (``afdep_config``)."""

    role: str
    num_attention_ranks: int
    num_ffn_ranks: int
    role_rank: int
    capacity_tokens_per_rank: int
    hidden_size: int
    num_experts: int
    top_k: int
    num_ubatches: int = 2
    num_layers: Optional[int] = None
    bucket: Optional[int] = None
    dtype: torch.dtype = torch.bfloat16
    receive_layout: str = "experts"
    device: Optional[str] = None
    num_sms: int = 24
    timeout_s: float = 100.0
    host: str = "127.0.0.1"
    port: int = 29600

    def __post_init__(self) -> None:
        if self.role not in (ATTENTION, FFN):
            raise ValueError(f"role must be {ATTENTION!r} or {FFN!r}, got {self.role!r}")
        check_int_range("num_attention_ranks", self.num_attention_ranks, 1)
        check_int_range("num_ffn_ranks", self.num_ffn_ranks, 1, MAX_FFN_RANKS)
        n, why = _role_ranks(self.role, self.num_attention_ranks, self.num_ffn_ranks)
        check_int_range("role_rank (afd_role_rank)", self.role_rank, 0, n - 1, why)
        check_int_range("capacity_tokens_per_rank", self.capacity_tokens_per_rank, 1)
        check_int_range("num_ubatches", self.num_ubatches, 1, MAX_SLOTS)
        if self.num_layers is not None:
            check_int_range("num_layers", self.num_layers, 1)
        if self.bucket is not None:
            check_int_range("bucket", self.bucket, 1, self.capacity_tokens_per_rank,
                         " (at most capacity_tokens_per_rank; None: the capacity)")
        _check_device("device", self.device)
        check_int_range("port", self.port, *_PORTS)

    @property
    def num_slots(self) -> int:
        """The Buffer API's name of ``num_ubatches`` (``Config.num_slots``)."""
        return self.num_ubatches

    @property
    def group_rank(self) -> int:
        """This rank in the AFD group: FFN ranks first, then Attention ranks."""
        return self.role_rank if self.role == FFN else self.num_ffn_ranks + self.role_rank

    def afdep_config(self) -> Config:
        return Config(capacity_tokens_per_rank=self.capacity_tokens_per_rank,
                      hidden_size=self.hidden_size, num_experts=self.num_experts,
                      top_k=self.top_k, ffn_ranks=self.num_ffn_ranks,
                      attention_ranks=self.num_attention_ranks, dtype=self.dtype,
                      num_sms=self.num_sms, timeout_s=self.timeout_s,
                      num_slots=self.num_ubatches, receive_layout=self.receive_layout)


def parse_settings(config, afd_config=None, rank: int = 0) -> ConnectorSettings:
    """Resolve ``ConnectorSettings`` from a VllmConfig-like object (or a mapping of the same
    fields) and the plugin's AFD config (see the module docstring for the keys)."""
    if isinstance(config, ConnectorSettings):
        return config
    afd = afd_config
    if afd is None:
        additional = _get(config, "additional_config")
        afd = _get(additional, "afd") if additional is not None else None
    if afd is None:
        afd = _get(config, "afd_config")
    if afd is None and isinstance(config, Mapping):
        afd = config
    if afd is None:
        raise ValueError("no AFD config: pass afd_config, or a vllm_config with "
                         "additional_config['afd'] or afd_config")
    extra = dict(_get(afd, "extra_config", "afd_extra_config", default={}) or {})
    raw_role = str(_get(afd, "role", "afd_role", default=ATTENTION))
    try:
        (role,) = parse_roles([raw_role.strip()])
    except ValueError:
        raise ValueError(f"AFD role must be 'attention' or 'ffn' (or 'A' / 'F'), got "
                         f"{raw_role!r}") from None
    n_att = _get(afd, "num_attention_ranks", default=None)
    n_ffn = _get(afd, "num_ffn_ranks", default=None)
    size = extra.get("afd_size")
    if size is not None:
        try:
            n_att, n_ffn = parse_layout(str(size))
        except ValueError as e:
            raise ValueError(f"afd_size must look like '2A2F': {e}") from None
    if n_att is None or n_ffn is None:
        raise ValueError("the AFD config must give num_attention_ranks and num_ffn_ranks "
                         "(or extra_config afd_size, e.g. '2A2F')")
    n_att = _int_setting("num_attention_ranks", n_att, 1)
    n_ffn = _int_setting("num_ffn_ranks", n_ffn, 1, MAX_FFN_RANKS)
    hf = _get(_get(config, "model_config"), "hf_config")
    hf = _get(hf, "text_config", default=hf)

    def setting(key, low, high=None, hf_names=(), why=""):
        """extra_config[key] (else the first model-config name present), strictly parsed;
        None when absent."""
        if extra.get(key) is not None:
            return _int_setting(f"extra_config[{key!r}]", extra[key], low, high, why)
        for n in hf_names:
            v = _get(hf, n)
            if v is not None:
                return _int_setting(f"model_config.hf_config.{n}", v, low, high, why)
        return None

    def need(key, *hf_names):
        v = setting(key, 1, hf_names=hf_names)
        if v is None:
            raise ValueError(f"set extra_config[{key!r}] (not found in the model config)")
        return v

    if _get(afd, "afd_role_rank") is not None:
        rank_key, role_rank = "afd_role_rank", _get(afd, "afd_role_rank")
    elif extra.get("afd_role_rank") is not None:
        rank_key, role_rank = "extra_config['afd_role_rank']", extra["afd_role_rank"]
    else:
        rank_key, role_rank = "afd_role_rank (absent: the rank argument)", rank
    n_role, why = _role_ranks(role, n_att, n_ffn)
    role_rank = _int_setting(rank_key, role_rank, 0, n_role - 1, why)

    capacity = setting("capacity_tokens_per_rank", 1)
    if capacity is None:
        capacity = setting("max_num_tokens", 1)
    if capacity is None:
        batched = _get(_get(config, "scheduler_config"), "max_num_batched_tokens")
        if batched is not None:
            capacity = _int_setting("scheduler_config.max_num_batched_tokens", batched, 1)
    if capacity is None:
        raise ValueError("set extra_config['capacity_tokens_per_rank']: the most tokens one "
                         "Attention rank sends in one micro-batch")
    ubatches = setting("num_ubatches", 1, MAX_SLOTS)
    slots = setting("num_slots", 1, MAX_SLOTS)
    if ubatches is not None and slots is not None and ubatches != slots:
        raise ValueError(f"extra_config num_ubatches ({ubatches}) and num_slots "
                         f"({slots}) are the same setting; give one")
    ubatches = ubatches if ubatches is not None else slots
    if ubatches is None:
        stages = _get(afd, "num_afd_stages", default=None)
        ubatches = 2 if stages is None else _int_setting("num_afd_stages", stages, 1, MAX_SLOTS)
    dtype = extra.get("dtype", "bfloat16")
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"extra_config['dtype'] must be one of {sorted(_DTYPES)}, "
                             f"got {dtype!r}")
        dtype = _DTYPES[dtype]
    layout = extra.get("receive_layout", "experts")
    if layout not in RECEIVE_LAYOUTS:
        raise ValueError(f"extra_config['receive_layout'] must be one of "
                         f"{list(RECEIVE_LAYOUTS)}, got {layout!r}")
    device = extra.get("device")
    _check_device("extra_config['device']", device)
    timeout_s = extra.get("timeout_s")
    port_key = "port" if _get(afd, "port") is not None else "afd_port"
    port = _get(afd, "port", "afd_port", default=29600)
    return ConnectorSettings(
        role=role, num_attention_ranks=n_att, num_ffn_ranks=n_ffn, role_rank=role_rank,
        capacity_tokens_per_rank=capacity,
        hidden_size=need("hidden_size", "hidden_size"),
        num_experts=need("num_experts", "n_routed_experts", "num_experts", "num_local_experts"),
        top_k=need("top_k", "num_experts_per_tok", "moe_topk"),
        num_ubatches=ubatches,
        num_layers=setting("num_layers", 1, hf_names=("num_hidden_layers",)),
        bucket=setting("bucket", 1, capacity, why=" (at most capacity_tokens_per_rank; "
                       "absent: the capacity)"),
        dtype=dtype, receive_layout=layout, device=device,
        num_sms=24 if extra.get("num_sms") is None else setting("num_sms", 1),
        timeout_s=100.0 if timeout_s is None else _seconds_setting(
            "extra_config['timeout_s']", timeout_s),
        host=str(_get(afd, "host", "afd_host", default="127.0.0.1")),
        port=_int_setting(port_key, port, *_PORTS))


# ---- the connector ----------------------------------------------------------------------------
class AfdepConnector:
    """vLLM AFD connector over a ``torch_afdep.Buffer`` (see the module docstring).

    Arguments:
        rank, local_rank: this process's rank and local rank (as the plugin passes them).
        config: a VllmConfig (or a mapping of the same fields), or ``ConnectorSettings``.
        afd_config: the plugin's AFD config (``AFDConfig`` or a mapping); default: read it
            from ``config``.
        group: the AFD process group (all A + F ranks, CPU-capable: gloo / afdep); default:
            see the module docstring.
    """

    def __init__(self, rank: int, local_rank: int, config, afd_config=None, *, group=None):
        self.rank = rank
        self.local_rank = local_rank
        self.vllm_config = config
        self.settings = parse_settings(config, afd_config, rank)
        self.config = self.settings.afdep_config()
        self.role = self.settings.role
        self.num_ubatches = self.settings.num_ubatches
        self.bucket = self.config.check_bucket(
            self.config.capacity_tokens_per_rank if self.settings.bucket is None
            else self.settings.bucket)
        self._group = group
        self.buffer = None
        self._initialized = False
        self._outputs: Optional[torch.Tensor] = None
        self._sent: Dict[int, AfdepSendHandle] = {}
        self._open: Dict[int, AfdepFfnMetadata] = {}
        self._recv_count = [0] * self.num_ubatches
        self._next_slot = 0

    # ---- lifecycle ------------------------------------------------------------------------
    def init_afd_connector(self) -> None:
        """Collective over the AFD group: create the buffer (all memory) and the outputs."""
        if self._initialized:
            return
        from ..buffer import Buffer

        group = self._resolve_group()
        device = self.settings.device
        if device == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        self.buffer = Buffer(group, self.config, device=device)
        if self.buffer.role != self.role:
            role = self.buffer.role
            self.buffer.close()
            raise ValueError(f"AFD group rank {self.settings.group_rank} is an "
                             f"{_ROLE_NAMES[role]} rank but this connector was configured as "
                             f"{_ROLE_NAMES[self.role]}")
        if self.role == ATTENTION:
            self._outputs = torch.zeros(self.num_ubatches, self.config.capacity_tokens_per_rank,
                                        self.config.hidden_size, dtype=torch.bfloat16,
                                        device=self.buffer.device)
        self._initialized = True

    def _resolve_group(self):
        want = self.config.world_size
        if self._group is not None:
            return self._group
        if dist.is_initialized() and dist.get_world_size() == want:
            if dist.get_rank() != self.settings.group_rank:
                raise ValueError(
                    f"default group rank {dist.get_rank()} is not this connector's AFD rank "
                    f"{self.settings.group_rank} (FFN ranks first, then Attention ranks); pass "
                    "group= or fix afd_role_rank")
            return dist.group.WORLD
        init_method = f"tcp://{self.settings.host}:{self.settings.port}"
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=init_method, world_size=want,
                                    rank=self.settings.group_rank)
            return dist.group.WORLD
        try:  # vLLM's helper for a second, independent process group
            from vllm.distributed.parallel_state import init_afd_process_group
        except ImportError as e:
            raise RuntimeError(
                f"torch.distributed already runs a world of {dist.get_world_size()} ranks, not "
                f"the AFD group of {want}: pass group= (a gloo or afdep group of the A + F "
                "ranks)") from e
        import datetime

        return init_afd_process_group(
            backend="gloo", init_method=init_method, world_size=want,
            rank=self.settings.group_rank, group_name="afdep",
            timeout=datetime.timedelta(seconds=max(60.0, self.settings.timeout_s)))

    @property
    def is_initialized(self) -> bool:
        return self._initialized

    @property
    def num_slots(self) -> int:
        """The Buffer API's name of ``num_ubatches``."""
        return self.num_ubatches

    def get_connector_rank(self) -> int:
        return self.rank

    def get_connector_local_rank(self) -> int:
        return self.local_rank

    def configure_metadata(self, metadata, **kwargs) -> None:
        """Nothing to add: the routing travels in the exchange itself."""
        return None

    def close(self) -> None:
        """Collective (every rank of the AFD group) and idempotent."""
        if self.buffer is not None:
            self.buffer.close()
        self._initialized = False

    def _require(self, role: str, what: str) -> None:
        if not self._initialized:
            raise AfdepStateError(f"{what}: call init_afd_connector() first")
        if self.role != role:
            raise AfdepStateError(f"{what} is for {role} ranks; this connector is an "
                                  f"{self.role} rank")

    def _slot(self, ubatch_idx) -> int:
        """``ubatch_idx`` checked, type first (never converted: True or 0.7 are refused, not
        read as slot 1 or 0): an int (or an integer scalar such as numpy's) in
        [0, num_ubatches)."""
        if isinstance(ubatch_idx, (bool, torch.Tensor)) or \
                not isinstance(ubatch_idx, numbers.Integral):
            raise TypeError(f"ubatch_idx must be an int in [0, {self.num_ubatches}) "
                            f"(num_ubatches), got {type(ubatch_idx).__name__} {ubatch_idx!r}")
        ubatch_idx = int(ubatch_idx)
        if not 0 <= ubatch_idx < self.num_ubatches:
            raise ValueError(f"ubatch_idx must be in [0, {self.num_ubatches}) "
                             f"(num_ubatches), got {ubatch_idx}")
        return ubatch_idx

    # ---- Attention ------------------------------------------------------------------------
    def send_attn_output(self, hidden_states: torch.Tensor, metadata=None,
                         ubatch_idx: Optional[int] = None, **kwargs) -> AfdepSendHandle:
        """Dispatch this micro-batch's tokens on slot ``ubatch_idx``.

        Arguments:
            hidden_states: [T, H] float (cast to bfloat16, or quantized per 128 for FP8
                exchanges), or float8_e4m3fn with ``scale`` [T, H/128] float32.
            metadata: object or mapping with the routing (keyword arguments override):
                ``topk_ids`` (or ``topk_idx``) [T, k] integer dtype (int32 / int64; other
                integer dtypes are widened to int64), global expert ids or -1;
                ``topk_weights`` [T, k] float (cast to float32); optionally ``ubatch_idx`` /
                ``stage_idx``, ``layer_idx`` and ``scale``.
            ubatch_idx: the micro-batch slot, an int in [0, num_ubatches) (default: the
                metadata's, else 0).
        Returns:
            the ``AfdepSendHandle`` (route [T] int64) for ``recv_ffn_output``.
        """
        self._require(ATTENTION, "send_attn_output")
        if ubatch_idx is None:
            ubatch_idx = _get(metadata, "ubatch_idx", "stage_idx", default=0)
        slot = self._slot(ubatch_idx)
        if slot in self._sent:
            raise AfdepStateError(f"send_attn_output: ubatch {slot} was sent and not received "
                                  "yet (call recv_ffn_output for it first)")
        ids = kwargs.get("topk_ids", kwargs.get("topk_idx"))
        if ids is None:
            ids = _get(metadata, "topk_ids", "topk_idx")
        w = kwargs.get("topk_weights", _get(metadata, "topk_weights"))
        if ids is None or w is None:
            raise ValueError("send_attn_output needs the routing: topk_ids (or topk_idx) "
                             "[T, k] and topk_weights [T, k], in metadata or as keywords")
        if not isinstance(ids, torch.Tensor) or ids.dtype == torch.bool or \
                ids.is_floating_point() or ids.is_complex():
            what = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise TypeError(f"topk_ids (topk_idx) must be an integer tensor [T, k] (int32 or "
                            f"int64 expert ids, -1 = none; never truncated from floats), got "
                            f"{what}")
        if not isinstance(w, torch.Tensor) or not w.is_floating_point():
            what = w.dtype if isinstance(w, torch.Tensor) else type(w).__name__
            raise TypeError(f"topk_weights must be a floating-point tensor [T, k], got {what}")
        scales = kwargs.get("scale", kwargs.get("x_scales", _get(metadata, "scale",
                                                                  "x_scales")))
        x, scales = self._payload(hidden_states, scales)
        if ids.dtype not in (torch.int32, torch.int64):
            ids = ids.to(torch.int64)  # int8/int16/uint8: exact
        route = _ops.afd_dispatch(x, ids.contiguous(), w.to(torch.float32).contiguous(),
                                  group=self.buffer.group_name, buffer_id=self.buffer.buffer_id,
                                  bucket=self.bucket, x_scales=scales, slot=slot)
        handle = AfdepSendHandle(route, slot, int(x.shape[0]), _get(metadata, "layer_idx"))
        self._sent[slot] = handle
        return handle

    def _payload(self, hidden_states: torch.Tensor, scales):
        if self.config.dtype == torch.float8_e4m3fn:
            if hidden_states.dtype == torch.float8_e4m3fn:
                if scales is None:
                    raise ValueError("FP8 hidden_states need metadata.scale [T, H/128] float32")
                return hidden_states.contiguous(), scales.to(torch.float32).contiguous()
            from ..nn import quantize_fp8

            return quantize_fp8(hidden_states)
        return hidden_states.to(torch.bfloat16).contiguous(), None

    def recv_ffn_output(self, handle=None, ubatch_idx: Optional[int] = None) -> torch.Tensor:
        """The combined FFN output ``[T, H]`` of slot ``ubatch_idx`` (or of ``handle``).

        ``handle``: the ``AfdepSendHandle`` of ``send_attn_output``, or a preallocated tensor
        ``[T, H]`` to write the output into (returned), or None. Without a tensor the output
        is a view of this slot's preallocated ``[capacity, H]`` bfloat16 buffer (same address
        every step: CUDA graphs can capture the call); it is overwritten by the next
        ``recv_ffn_output`` of the same ubatch (the next layer), so consume or copy it first."""
        self._require(ATTENTION, "recv_ffn_output")
        dest = handle if isinstance(handle, torch.Tensor) else None
        if ubatch_idx is not None:
            ubatch_idx = self._slot(ubatch_idx)
        if isinstance(handle, AfdepSendHandle):
            if ubatch_idx is not None and ubatch_idx != handle.ubatch_idx:
                raise AfdepStateError(f"handle is from ubatch {handle.ubatch_idx}, not "
                                      f"{ubatch_idx}")
            ubatch_idx = handle.ubatch_idx
        if ubatch_idx is None:
            if len(self._sent) != 1:
                raise AfdepStateError(f"recv_ffn_output: pass ubatch_idx ({len(self._sent)} "
                                      "micro-batches are in flight)")
            ubatch_idx = next(iter(self._sent))
        slot = self._slot(ubatch_idx)
        sent = self._sent.get(slot)
        if sent is None:
            raise AfdepStateError(f"recv_ffn_output: nothing was sent on ubatch {slot}")
        t = sent.num_tokens
        if dest is None:
            dest = self._outputs[slot, :t]
        elif tuple(dest.shape) != (t, self.config.hidden_size):
            raise ValueError(f"output tensor must have shape [{t}, {self.config.hidden_size}] "
                             f"(the tokens sent on ubatch {slot}), got {list(dest.shape)}")
        out = _ops.afd_combine(sent.route, group=self.buffer.group_name,
                               buffer_id=self.buffer.buffer_id, slot=slot)
        del self._sent[slot]
        dest.copy_(out)
        return dest

    # ---- FFN ------------------------------------------------------------------------------
    def recv_attn_output(self, timeout_ms: Optional[int] = None,
                         ubatch_idx: Optional[int] = None):
        """Receive slot ``ubatch_idx`` (default: the next slot in turn) from every Attention
        rank.

        Arguments:
            timeout_ms: ignored (``timeout_s`` bounds every wait).
            ubatch_idx: the micro-batch slot, or None for the next slot in turn.
        Returns:
            expert layout: ``(rows [A*bucket*R, H], AfdepFfnMetadata)``, rows in the payload
            dtype (bfloat16 or float8_e4m3fn) grouped by local expert; token layout:
            ``(hidden_states [N, H], AfdepFfnMetadata)``, N = ``Config.token_rows(bucket)``,
            one payload-dtype row per token (a read-only view of the receive window, valid
            until ``send_ffn_output``), the metadata carrying topk_ids / topk_weights [N, k].
        """
        self._require(FFN, "recv_attn_output")
        slot = self._next_slot if ubatch_idx is None else self._slot(ubatch_idx)
        if slot in self._open:
            raise AfdepStateError(f"recv_attn_output: ubatch {slot} was received and not "
                                  "answered yet (call send_ffn_output for it first)")
        rec = _ops.afd_receive(group=self.buffer.group_name, buffer_id=self.buffer.buffer_id,
                               bucket=self.bucket, slot=slot,
                               sequence=self._recv_count[slot] + 1)
        count = self._recv_count[slot]
        self._recv_count[slot] += 1
        self._next_slot = (slot + 1) % self.num_ubatches
        layers = self.settings.num_layers
        el = self.config.experts_per_rank
        common = dict(layer_idx=count % layers if layers else count, ubatch_idx=slot,
                      x_scales=rec.x_scales, src_rank=rec.src_rank, src_token=rec.src_token,
                      receipt=rec.receipt, local_expert_start=self.buffer.role_index * el,
                      num_local_experts=el)
        if self.config.receive_layout == "tokens":
            meta = AfdepFfnMetadata(expert_offsets=None, topk_weights=rec.weights,
                                    weights_applied=True, receive_layout="tokens",
                                    topk_ids=rec.expert_ids, num_tokens=rec.num_tokens,
                                    **common)
        else:
            meta = AfdepFfnMetadata(expert_offsets=rec.expert_offsets,
                                    topk_weights=rec.weights, **common)
        self._open[slot] = meta
        return rec.x, meta

    def send_ffn_output(self, ffn_output: torch.Tensor, metadata=None,
                        ubatch_idx: Optional[int] = None) -> None:
        """Send ``metadata``'s exchange's FFN output back to the Attention ranks.

        Arguments:
            ffn_output: expert layout: [A*bucket*R, H] float (any float dtype, cast to
                bfloat16), row i = the expert output of received row i (weighted unless
                ``metadata.weights_applied`` is False, then the connector multiplies by
                topk_weights); token layout: [N, H] float, row i = token i's MoE output
                (its local experts' outputs weighted by topk_weights and summed), sent as
                is; rows without a token are ignored.
            metadata: the ``AfdepFfnMetadata`` of ``recv_attn_output`` (or None with the
                ``ubatch_idx`` of an open exchange).
            ubatch_idx: the micro-batch slot (checked against the metadata's).
        Returns:
            None.
        """
        self._require(FFN, "send_ffn_output")
        if ubatch_idx is not None:
            ubatch_idx = self._slot(ubatch_idx)
        if not isinstance(metadata, AfdepFfnMetadata):
            if ubatch_idx is None and len(self._open) == 1:
                ubatch_idx = next(iter(self._open))
            if ubatch_idx is None or ubatch_idx not in self._open:
                raise AfdepStateError("send_ffn_output: pass the metadata recv_attn_output "
                                      "returned (or the ubatch_idx of an open exchange)")
            metadata = self._open[ubatch_idx]
        elif ubatch_idx is not None and ubatch_idx != metadata.ubatch_idx:
            raise AfdepStateError(f"metadata is from ubatch {metadata.ubatch_idx}, not "
                                  f"{ubatch_idx}")
        slot = metadata.ubatch_idx
        if self._open.get(slot) is not metadata:
            raise AfdepStateError(f"send_ffn_output: ubatch {slot} has no open exchange for "
                                  "this metadata (already answered?)")
        rows = ffn_output
        tokens = metadata.receive_layout == "tokens"
        # The shape the receive gave (static per bucket): one output row per received row.
        n = self.config.token_rows(self.bucket) if tokens else self.config.recv_rows(self.bucket)
        h = self.config.hidden_size
        layout = "token layout" if tokens else "expert layout"
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"send_ffn_output ({layout}): ffn_output must be a torch.Tensor "
                            f"[{n}, {h}], got {type(rows).__name__}")
        if tuple(rows.shape) != (n, h):
            raise ValueError(f"send_ffn_output ({layout}): ffn_output must be [{n}, {h}] (one "
                             f"row per received row), got {list(rows.shape)}")
        if not rows.is_floating_point():
            raise TypeError(f"send_ffn_output: ffn_output must have a floating-point dtype, "
                            f"got {rows.dtype}")
        if rows.device != self.buffer.device:
            raise ValueError(f"send_ffn_output: ffn_output must be on {self.buffer.device} "
                             f"(the buffer's device), got {rows.device}")
        if tokens:
            if not metadata.weights_applied:
                raise ValueError("send_ffn_output (token layout): the rows are each token's "
                                 "weighted sum over its experts, so the model applies "
                                 "topk_weights; weights_applied=False cannot be honored")
        elif not metadata.weights_applied:
            n = rows.shape[0]
            valid = torch.arange(n, device=rows.device) < metadata.expert_offsets[-1]
            rows = torch.where(valid[:, None],
                               rows.float() * metadata.topk_weights[:n, None], 0.0)
        rows = rows.to(torch.bfloat16).contiguous()
        _ops.afd_reply(rows, metadata.receipt, group=self.buffer.group_name,
                       buffer_id=self.buffer.buffer_id)
        del self._open[slot]

    def __repr__(self) -> str:
        s = self.settings
        return (f"AfdepConnector(role={self.role!r}, afd_rank={s.group_rank}, "
                f"{s.num_attention_ranks}A{s.num_ffn_ranks}F, ubatches={self.num_ubatches}, "
                f"initialized={self._initialized})")


# ---- registration ------------------------------------------------------------------------------
def _vllm_classes(factory=None, base=None):
    """(AFDConnectorFactory, AFDConnectorBase) of the AFD plugin or of vLLM (imported now)."""
    candidates = (("afd_plugin.connectors.factory", "afd_plugin.connectors.base"),
                  ("vllm.distributed.afd_transfer.afd_connector.factory",
                   "vllm.distributed.afd_transfer.afd_connector.base"))
    if factory is not None and base is not None:
        return factory, base
    import importlib

    errors = []
    for fmod, bmod in candidates:
        try:
            f = factory or importlib.import_module(fmod).AFDConnectorFactory
            b = base or importlib.import_module(bmod).AFDConnectorBase
            return f, b
        except (ImportError, AttributeError) as e:
            errors.append(f"{fmod}: {e}")
    raise ImportError("neither the vLLM AFD plugin nor vLLM's afd_transfer is importable ("
                      + "; ".join(errors) + ")")


def register_with_vllm(name: str = CONNECTOR_NAME, *, factory=None, base=None,
                       replace: bool = True):
    """Register ``AfdepConnector`` with the AFD connector factory under ``name``.

    Builds ``AfdepAFDConnector`` (a subclass of ``AfdepConnector`` and the plugin's
    ``AFDConnectorBase``, so the factory's type check passes), makes it an attribute of this
    module and registers it as ``(name, "torch_afdep.integrations.vllm",
    "AfdepAFDConnector")``. ``factory`` / ``base`` default to the plugin's (or vLLM's).
    Returns the class. The AFD plugin also validates connector names against its supported
    list; add ``name`` there if your version checks it."""
    factory, base = _vllm_classes(factory, base)
    cls = types.new_class("AfdepAFDConnector", (AfdepConnector, base),
                          exec_body=lambda ns: ns.update({"__module__": __name__,
                                                          "__doc__": AfdepConnector.__doc__}))
    globals()["AfdepAFDConnector"] = cls
    kwargs = {}
    try:
        import inspect

        if "replace" in inspect.signature(factory.register_connector).parameters:
            kwargs["replace"] = replace
    except (TypeError, ValueError):
        pass
    factory.register_connector(name, __name__, "AfdepAFDConnector", **kwargs)
    return cls


__all__ = ["AfdepConnector", "AfdepFfnMetadata", "AfdepSendHandle", "ConnectorSettings",
           "parse_settings", "register_with_vllm", "CONNECTOR_NAME"]
