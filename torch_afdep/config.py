"""Static description of one AFD exchange layout: who holds experts, who routes tokens, sizes."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

import torch

ATTENTION = "attention"
FFN = "ffn"
ROLES = (ATTENTION, FFN)

#: Payload dtypes the exchange carries in dispatch. Combine is always BF16.
PAYLOAD_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)

#: FP8 payloads carry one float32 scale per this many hidden elements.
FP8_BLOCK = 128

#: The route handle is an int64 bit mask over FFN ranks.
MAX_FFN_RANKS = 64

#: Most exchanges (micro-batch slots) one buffer can have in flight.
MAX_SLOTS = 16

#: The longest wait a Config may ask for: about 11.6 days (the waits' clocks count it in
#: milliseconds or nanoseconds, and a bound beyond this is not a bound).
MAX_TIMEOUT_S = 1e6

#: What an FFN rank receives: expert-major rows, or one row per token.
RECEIVE_LAYOUTS = ("experts", "tokens")


def check_int_range(name: str, value, low: int, high: Optional[int] = None,
                    why: str = "") -> int:
    """``value`` if it is an int (not a bool) in [low, high] (``high`` None: no bound); else
    TypeError / ValueError naming ``name``, the range (followed by ``why``) and the value."""
    allowed = (f"in [{low}, {high}]" if high is not None else f">= {low}") + why
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int {allowed}, got {type(value).__name__} "
                        f"{value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class Config:
    """Layout and sizes of an AFD exchange; identical on every rank of the group.

    Arguments:
        capacity_tokens_per_rank: the most tokens one Attention rank sends in one exchange
            (the largest ``bucket``); buffers are sized from it.
        hidden_size: H, elements per token row. A multiple of 128 for FP8 payloads and of 8
            for BF16 (16-byte rows on the GPU).
        num_experts: E, global experts. FFN rank ``f`` owns ``[f*E/F, (f+1)*E/F)``.
        top_k: k, experts per token (entries of ``expert_ids`` may be -1: no expert).
        ffn_ranks: F, ranks that hold experts (1..64).
        attention_ranks: A, ranks that route tokens.
        dtype: dispatch payload dtype, ``torch.bfloat16`` or ``torch.float8_e4m3fn``
            (pre-quantized by the caller, with per-128 float32 scales). Combine is BF16.
        roles: optional explicit role per group rank, length A + F, in any spelling
            ``parse_roles`` takes (``"FFAA"``, ``["ffn", "attention"]``, ...). Default: group ranks ``[0, F)`` are FFN ranks, ``[F, F+A)`` Attention ranks.
        num_sms: S, the CTAs (channels) of the Attention's dispatch kernel (of every kernel
            when the protocol controls are reverted). On every device it also sets the token
            layout's rows per source (``rows_per_source``: a multiple of S), so CPU and CUDA
            buffers of one config have the same N.
        local_sms: CUDA only: CTAs of the kernels that mostly do local work: the FFN ranks'
            receive and reply (expansion into the expert-major layout, fp32 reduction) and the
            Attention ranks' combine (collect); 0 = one per SM of the device, divided among
            the group's ranks that share it. Needs the directional protocol
            (``AFDEP_WIDE_LOCAL`` and the controls it builds on); otherwise those kernels use
            ``num_sms`` too.
        timeout_s: a receiver that waits longer than this raises, naming the peer and phase.
        receive_layout: what an FFN rank receives, fixed per buffer: ``"experts"`` (each
            token expanded into one row per local expert, grouped by expert; the reply sums
            them) or ``"tokens"`` (one row per token, a zero-copy view of the receive window,
            with the token's local expert ids and weights in the source's column order; the
            reply takes one row per token). docs/contract.md.
        num_slots: independent exchanges (micro-batches) a buffer can have in flight at once,
            selected per call with ``slot=``; each slot has its own transport state and
            memory (CUDA memory scales with it). 1..MAX_SLOTS.
    """

    capacity_tokens_per_rank: int
    hidden_size: int
    num_experts: int
    top_k: int
    ffn_ranks: int
    attention_ranks: int
    dtype: torch.dtype = torch.bfloat16
    roles: Optional[Tuple[str, ...]] = None
    num_sms: int = 24
    timeout_s: float = 100.0
    num_slots: int = 2
    local_sms: int = 0
    receive_layout: str = "experts"

    def __post_init__(self) -> None:
        check_int_range("capacity_tokens_per_rank", self.capacity_tokens_per_rank, 1, 1 << 20)
        check_int_range("hidden_size", self.hidden_size, 1, 1 << 16)
        check_int_range("num_experts", self.num_experts, 1, 1 << 16)
        check_int_range("top_k", self.top_k, 1, min(self.num_experts, 64))
        check_int_range("ffn_ranks", self.ffn_ranks, 1, MAX_FFN_RANKS)
        check_int_range("attention_ranks", self.attention_ranks, 1, 1 << 12)
        check_int_range("num_sms", self.num_sms, 1, 1024)
        check_int_range("num_slots", self.num_slots, 1, MAX_SLOTS)
        check_int_range("local_sms", self.local_sms, 0, 1024)
        if self.receive_layout not in RECEIVE_LAYOUTS:
            raise ValueError(f"receive_layout must be one of {', '.join(RECEIVE_LAYOUTS)}, "
                             f"got {self.receive_layout!r}")
        if self.num_experts % self.ffn_ranks != 0:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by ffn_ranks "
                f"({self.ffn_ranks}): each FFN rank owns num_experts/ffn_ranks experts"
            )
        if self.dtype not in PAYLOAD_DTYPES:
            raise TypeError(
                f"dtype must be torch.bfloat16 or torch.float8_e4m3fn, got {self.dtype}"
            )
        if self.dtype == torch.float8_e4m3fn and self.hidden_size % FP8_BLOCK != 0:
            raise ValueError(
                f"hidden_size must be a multiple of {FP8_BLOCK} for FP8 payloads, "
                f"got {self.hidden_size}"
            )
        if self.dtype == torch.bfloat16 and self.hidden_size % 8 != 0:
            raise ValueError(f"hidden_size must be a multiple of 8, got {self.hidden_size}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)):
            raise TypeError(f"timeout_s must be a number of seconds, got "
                            f"{type(self.timeout_s).__name__}")
        if not 0 < self.timeout_s <= MAX_TIMEOUT_S:  # also refuses NaN and infinity
            raise ValueError(f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}] seconds, got "
                             f"{self.timeout_s!r}")
        if self.roles is not None:
            roles = parse_roles(self.roles)
            object.__setattr__(self, "roles", roles)
            if len(roles) != self.world_size:
                raise ValueError(
                    f"roles must have attention_ranks + ffn_ranks = {self.world_size} "
                    f"entries, got {len(roles)}"
                )
            if roles.count(FFN) != self.ffn_ranks:
                raise ValueError(
                    f"roles name {roles.count(FFN)} 'ffn' ranks but ffn_ranks={self.ffn_ranks}"
                )

    # ---- derived layout -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.ffn_ranks + self.attention_ranks

    @property
    def experts_per_rank(self) -> int:
        """E_local: experts each FFN rank owns."""
        return self.num_experts // self.ffn_ranks

    @property
    def rows_per_token(self) -> int:
        """R = min(top_k, E_local): the most expert rows one token makes on one FFN rank."""
        return min(self.top_k, self.experts_per_rank)

    @property
    def scale_cols(self) -> int:
        """Scale columns per row: H/128 for FP8 payloads, 0 for BF16."""
        return self.hidden_size // FP8_BLOCK if self.dtype == torch.float8_e4m3fn else 0

    @property
    def role_list(self) -> Tuple[str, ...]:
        """Role of every group rank."""
        if self.roles is not None:
            return self.roles
        return (FFN,) * self.ffn_ranks + (ATTENTION,) * self.attention_ranks

    @property
    def ffn_group_ranks(self) -> Tuple[int, ...]:
        """Group rank of FFN index f, in order."""
        return tuple(r for r, role in enumerate(self.role_list) if role == FFN)

    @property
    def attention_group_ranks(self) -> Tuple[int, ...]:
        """Group rank of Attention index a, in order."""
        return tuple(r for r, role in enumerate(self.role_list) if role == ATTENTION)

    def role_of(self, group_rank: int) -> str:
        return self.role_list[group_rank]

    def role_index(self, group_rank: int) -> int:
        """Index of ``group_rank`` among the ranks of its role (f or a)."""
        role = self.role_list[group_rank]
        return self.role_list[:group_rank].count(role)

    def recv_rows(self, bucket: int) -> int:
        """Capacity of an FFN rank's expert-major rows for ``bucket``: A * bucket * R."""
        return self.attention_ranks * bucket * self.rows_per_token

    def rows_per_source(self, bucket: int) -> int:
        """Token layout: rows an FFN rank holds per Attention rank for ``bucket``,
        S * ceil(bucket / S) with S = num_sms (each of the S sending channels owns an equal
        share of the rows, so a view of the receive window needs no compaction)."""
        s = self.num_sms
        return s * ((bucket + s - 1) // s)

    def token_rows(self, bucket: int) -> int:
        """Token layout: N, the static row count of an FFN rank's receive for ``bucket``:
        A * rows_per_source(bucket); rows that hold no token have every expert id -1."""
        return self.attention_ranks * self.rows_per_source(bucket)

    def check_slot(self, slot: int) -> int:
        return check_int_range("slot", slot, 0, self.num_slots - 1)

    def check_bucket(self, bucket: int, num_tokens: Optional[int] = None) -> int:
        check_int_range("bucket", bucket, 1, self.capacity_tokens_per_rank)
        if num_tokens is not None and num_tokens > bucket:
            raise ValueError(
                f"x has {num_tokens} tokens but bucket is {bucket}: need T <= bucket "
                f"<= capacity_tokens_per_rank ({self.capacity_tokens_per_rank})"
            )
        return bucket

    def fingerprint(self) -> Tuple:
        """What must agree on every rank (checked collectively at Buffer construction)."""
        return (
            self.capacity_tokens_per_rank,
            self.hidden_size,
            self.num_experts,
            self.top_k,
            self.ffn_ranks,
            self.attention_ranks,
            str(self.dtype),
            self.role_list,
            self.num_sms,
            self.num_slots,
            self.local_sms,
            self.receive_layout,
        )


def parse_roles(spec: Sequence[str] | str) -> Tuple[str, ...]:
    """Roles of a group's ranks, in group-rank order, from any of their spellings:
    ``"FFAA"`` (one letter a rank), ``"ffn,ffn,attention,attention"``, or a sequence of
    ``"ffn"`` / ``"attention"`` (or ``"F"`` / ``"A"``). Returns a tuple of ``"ffn"`` /
    ``"attention"``; ValueError names the bad entry. (A *layout*, the counts only, is written
    ``"2A2F"``: see ``parse_layout``.)"""
    if not isinstance(spec, (str, list, tuple)):
        raise TypeError(f"roles must be a string such as 'FFAA' or a list/tuple of 'ffn' / "
                        f"'attention', got {type(spec).__name__}")
    if isinstance(spec, str):
        text = spec.strip()
        parts = ([p.strip() for p in text.split(",") if p.strip()] if "," in text
                 else list(text.replace(" ", "")))
    else:
        parts = list(spec)
    table = {"a": ATTENTION, "attention": ATTENTION, "f": FFN, "ffn": FFN}
    roles = []
    for p in parts:
        r = table.get(p.lower()) if isinstance(p, str) else None
        if r is None:
            raise ValueError(f"roles entries must be 'attention' or 'ffn' (or 'A' / 'F'), got "
                             f"{p!r} (in {spec!r}; e.g. 'FFAA' or ['ffn', 'attention'])")
        roles.append(r)
    return tuple(roles)


def parse_layout(spec: str) -> Tuple[int, int]:
    """``"2A2F"`` (Attention ranks, then FFN ranks) -> (attention_ranks, ffn_ranks). The
    default role order of such a layout puts the FFN ranks first (``Config.role_list``)."""
    import re

    m = re.fullmatch(r"\s*(\d+)\s*[aA]\s*(\d+)\s*[fF]\s*", str(spec))
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"layout must look like '2A2F' (Attention ranks, then FFN ranks, "
                         f"each >= 1), got {spec!r}")
    return int(m.group(1)), int(m.group(2))
