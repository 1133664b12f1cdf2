"""Every ``AFDEP_*`` environment variable torch_afdep reads: one registry, parsed once.

Each entry says its type, default, meaning and when it is read. Protocol controls carry the
bit they set in the mask passed to the CUDA kernels (``csrc/include/afdep/layout.h``
``ControlFlags``; a test checks the two lists name the same bits). C++ never reads the
environment: values reach it through ``CommConfig``.

This module imports nothing but the standard library, so ``setup.py`` can load it for the
build-time variables without importing torch_afdep.

- ``get(name, environ=None)``: one variable's parsed value (``ValueError`` naming it and the
  allowed values when it is malformed).
- ``current()``: every run-time value of this process, parsed once (``reset()`` re-reads).
- ``protocol_flags(environ=None)``: the control bit mask (``AFDEP_SYMMETRIC=1`` gives 0).
- ``unknown_notes(environ=None)``: the ``AFDEP_*`` names set that have no effect (typos, and
  the retired controls of ``RETIRED``); ``current()`` warns about them at its first parse.
"""

from __future__ import annotations

import difflib
import os
import warnings
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple

# When a variable is read.
AT_IMPORT = "import"
AT_GROUP = "afdep group creation"
AT_BUFFER = "Buffer creation (CUDA)"
AT_DISPATCH = "dispatch (eager CUDA)"
AT_BUILD = "build time (setup.py)"
AT_BENCH = "benchmarks"
AT_TESTS = "tests"


class Setting(NamedTuple):
    """One environment variable.

    kind: ``"bool"`` (0/1, true/false, yes/no, on/off), ``"int"``, ``"float"``, ``"str"`` or
    ``"choice"`` (one of ``choices``, case-insensitive). ``bit``: protocol control bit (0 for
    everything else). ``experimental``: a protocol control that stays off by default."""

    name: str
    kind: str
    default: Any
    meaning: str
    read: str
    bit: int = 0
    choices: Tuple[str, ...] = ()


def _control(name: str, bit: int, default: int, meaning: str) -> Setting:
    return Setting(name, "bool", default, meaning, AT_BUFFER, bit=1 << bit)


#: Protocol controls: 1 = the role-aware change is on; 0 reverts that one change. The bit
#: positions are ``ControlFlags`` of the kernels.
_CONTROLS = (
    _control("AFDEP_ROLE_BUFFERS", 0, 1,
             "per-role inboxes: FFN ranks hold dispatch inboxes for A sources, Attention "
             "ranks combine inboxes for F sources; 0 = every rank registers the union-sized "
             "window"),
    _control("AFDEP_NO_ENTRY_BARRIER", 1, 1,
             "no entry barrier (sequence numbers guard reuse); 0 = full barrier among all "
             "ranks at the entry of both phases"),
    _control("AFDEP_ONE_WAY_COUNTS", 2, 1,
             "counts ride behind each sender CTA's payload, Attention -> FFN only; 0 = counts "
             "are exchanged all-to-all first and every rank spins until all arrive"),
    _control("AFDEP_RECEIVER_WAIT_ONLY", 3, 1,
             "only receivers wait, per sending CTA; 0 = full exit barrier among all ranks and "
             "channels in both phases"),
    _control("AFDEP_ROLE_WARPS", 4, 1,
             "each role runs only its own stage; 0 = every rank runs both stages (Attention "
             "ranks as dummy expert holders receiving nothing, FFN ranks as senders of "
             "nothing)"),
    _control("AFDEP_SINGLE_FFN", 5, 1,
             "with one FFN rank, combine copies the single reply row (no fp32 sum loop); 0 = "
             "the general sum"),
    _control("AFDEP_WIDE_LOCAL", 6, 1,
             "the kernels that mostly do local work (FFN receive and reply: expansion and "
             "fp32 reduction; Attention combine: collect) run Config.local_sms CTAs, default "
             "one per SM; needs the four directional controls above; 0 = num_sms CTAs like "
             "every other kernel"),
    _control("AFDEP_EARLY_COUNTS", 7, 1,
             "a sender CTA with few tokens (but >= 32 KB of payload) publishes its counts "
             "before copying the payload (the FFN computes its offsets while the payload is "
             "in flight) and then a per-channel payload flag; needs the four directional "
             "controls; 0 = counts after the payload"),
    _control("AFDEP_STREAM_EXPANSION", 9, 1,
             "sender CTAs with >= 48 tokens (and >= 32 KB) publish their counts first, then "
             "send each row with its own flag, and the FFN expands every row as soon as it "
             "lands (slot-major), overlapping the expansion with the transfer at large T; "
             "needs AFDEP_EARLY_COUNTS and the four directional controls; 0 = one payload "
             "flag per channel, and large-T channels send counts last"),
    _control("AFDEP_PDL", 10, 1,
             "the dispatch and combine kernels launch with programmatic dependent launch, so "
             "each may be scheduled while the previous kernel of its stream drains and waits "
             "(griddepcontrol.wait) before touching anything; 0 = ordinary launches"),
    _control("AFDEP_ONE_FENCE", 11, 1,
             "every signal a kernel writes to a peer (counts ready, payload flags, reply "
             "done) is one system-scope fence followed by a relaxed store or add, the fence "
             "ordering the CTA's data before it; 0 = the fence followed by a release store or "
             "add (the release is a second system fence)"),
    _control("AFDEP_LEAN_COUNTS", 12, 1,
             "token layout: a sender CTA's count block carries its token count only, not its "
             "per-expert counts (the token layout's receiver never reads them: E_local fewer "
             "stores over NVLink in front of every count signal); 0 = the full count block"),
    _control("AFDEP_EARLY_LOADS", 13, 1,
             "at small T each kernel issues its independent global loads at its start so "
             "their latencies overlap (dispatch: the CTA's rows, scales, expert ids and "
             "weights with the exchange number; receive: a row's metadata words at once; "
             "reply: every row's data with its token index, without waiting for the token "
             "counts; collect: the routes before the wait); 0 = each load after the one it "
             "follows in the code"),
    _control("AFDEP_LL_SMALL", 14, 1,
             "at most 2 tokens per channel (ceil(bucket / num_sms) <= 2, rows in the early "
             "loads' registers): the token layout's dispatch (count, metadata, rows, scales) "
             "and the reply's rows in both layouts travel as 8-byte units, each a 32-bit word "
             "and the exchange number's low half, so no sender waits for a fence and no "
             "receiver for a count flag; the FFN's receive moves the rows into their slots of "
             "the receive window, the zero-copy collect into its inbox rows; needs "
             "AFDEP_EARLY_LOADS and the four directional controls; 0 = the payload, then a "
             "fence and the count flag"),
    _control("AFDEP_SMALL_KERNELS", 15, 1,
             "with the four directional controls, a launch on a small-T path runs a form of "
             "its kernel compiled for that path and its role alone: the flagged units "
             "(AFDEP_LL_SMALL: the token layout's dispatch and reply, either layout's "
             "collect), or in the expert layout a channel of fewer than 16 tokens and 32 KB "
             "(no fused, streamed or early-count copy), the one-pass reply (its rows as "
             "units or not) and the count-form collect (12-43 KB of code instead of 83-125 "
             "KB); the same protocol; 0 = the generic kernels"),
    _control("AFDEP_PARAM_BASES", 16, 1,
             "the window addresses of this rank and of the first 8 ranks of each role travel "
             "in the kernels' parameters, so the dispatch's stores to an FFN rank and the "
             "reply's to an Attention rank need no global load first; the same protocol; 0 = "
             "each address from the role's rank table, then the peer table (two dependent "
             "loads)"),
    _control("AFDEP_LONE_TOKEN", 17, 1,
             "flagged units (AFDEP_LL_SMALL), small kernel forms (AFDEP_SMALL_KERNELS): a "
             "sender CTA that holds one token (T <= num_sms) knows its slot, 0 in every "
             "region, so one warp claims the token (route, id checks, metadata units) while "
             "every other warp already stores the count units and the row's units; the same "
             "units; 0 = the claim in shared memory, a barrier, then the copy"),
    _control("AFDEP_LONE_EXPAND", 18, 1,
             "the expert layout's receive of flagged units (AFDEP_LL_EXPERTS) where one token "
             "arrived in all (e.g. T = 1 from one Attention rank): its rows follow from its own "
             "entries (one row per distinct local expert, experts in order), so no CTA builds "
             "the count table of rows per (region, expert), scans it or meets a barrier behind "
             "it; every warp with a chunk of the row loads the token's units and works out its "
             "row by warp shuffles; the same outputs; 0 = the count table, its scan and the "
             "offsets, then the rows"),
    _control("AFDEP_LL_EXPERTS", 19, 1,
             "the expert layout's dispatch where a channel holds one token (bucket <= "
             "num_sms) travels as the token layout's flagged units (count, metadata, rows, "
             "scales) instead of the payload, a fence and a count block with per-expert "
             "counts; the FFN derives each region's rows per expert from the entries' "
             "positions in the metadata units and expands each row as its units land; needs "
             "AFDEP_LL_SMALL, AFDEP_SMALL_KERNELS, AFDEP_ROLE_BUFFERS, AFDEP_EARLY_LOADS and "
             "the four directional controls; 0 = the count-block path"),
    _control("AFDEP_EARLY_COLLECT", 20, 1,
             "the token layout's collect of flagged reply units at T <= num_sms "
             "(AFDEP_LL_SMALL's collect): the warps that hold rows poll each vector's units "
             "together with their FFN rank's start units, so a row is read in the load that "
             "sees it land, with no barrier behind the start units; one warp of CTA 0 still "
             "waits for every FFN rank's reply and CTAs without rows leave at once (the "
             "expert layout keeps the barrier: there it was slower); needs AFDEP_LL_SMALL, "
             "AFDEP_EARLY_LOADS, AFDEP_SMALL_KERNELS and the four directional controls; 0 = "
             "every CTA waits for every FFN rank's start units, meets a barrier, then reads "
             "the rows"),
    _control("AFDEP_FANOUT_EXPAND", 21, 0,
             "experimental, off by default (one H100, 0d14212: its GPU tests pass; 1A1F H4096 "
             "4-5% slower at T = 1-7, 7.5% faster at T = 24): the expert layout's receive of "
             "flagged units (AFDEP_LL_EXPERTS) in its own form, kUnitExpFan, whose units are "
             "(token, chunk of its row) instead of (token, "
             "entry, chunk): a warp loads the token's metadata units and its chunk's row units "
             "once and stores the chunk into every row of the token's entries, the chunks one "
             "warp on each of several CTAs; at T = 1 (8 rows at 1A1F) 16 warps load the row's "
             "units once where 128 warps loaded each chunk 8 times and the metadata units 128 "
             "times; the same outputs; 0 = kUnitExpRecv, one unit per (token, entry, chunk)"),
    _control("AFDEP_SPREAD_CHUNKS", 22, 1,
             "the small-T forms that move a small row's chunks (the reply's kSmallSend and "
             "kUnitReply, the collect's kSmallRecv and kEarlyCollect, the token layout's "
             "receive of flagged units, kSmallRecv or kRawRecv, placing its rows) give them to "
             "one warp on each of several CTAs instead of to one CTA's warps, so that a row's "
             "loads and stores spread over up to the kernel's grid of CTAs (one per SM by default; "
             "at T = 1 the expert layout's reply loads 8 rows, 64 KB); the same outputs; 0 = "
             "unit u on warp u % 16 of CTA u / 16"),
    _control("AFDEP_RAW_META", 25, 0,
             "experimental, off by default (one H200, b08bcd0: its graph, trace-ordering and "
             "bucket-mismatch tests pass, memcheck clean; token layout 1A1F T = 1 within the "
             "repeats' spread of 0, T = 7 1.8% faster in 3 of 3 repeats): the token layout with "
             "AFDEP_LONE_TOKEN (and AFDEP_SMALL_KERNELS), where a token's 2 + 2k metadata "
             "units fit its slot (R >= 2k / 3 is enough): a sender CTA of one token runs "
             "kRawSend, whose warp 0 stores the token's raw ids and weights as its metadata "
             "units as soon as it has the mask of FFN ranks they reach, then its row vectors, "
             "and only then the route and the id reports; the "
             "FFN's receive (kRawRecv) derives its local ids and columns from them (duplicates "
             "matched, other ranks' ids dropped), so that most of the claim's work is off the "
             "path to the FFN; the same outputs; 0 = warp 0 claims first (route, duplicates, this "
             "rank's entries) and the metadata units carry the entries"),
    _control("AFDEP_UNIT_SIGNAL", 26, 1,
             "the reply of flagged units (either layout, small buckets): a CTA that wrote only "
             "flagged row units adds its completion count without the system fence in front "
             "(the collect takes those units by their flags, not behind the count); the CTAs "
             "that wrote the start units or a mismatch status, which the collect reads behind "
             "the count, still fence; at T = 1 (one H100) the reply kernel ends 0.45 us "
             "(token layout) and 0.8 us (expert layout) sooner, the round trip unchanged; the "
             "same outputs; 0 = every CTA fences before its count"),
    _control("AFDEP_SHUFFLE_MATCH", 27, 1,
             "a token's repeated expert ids are found by one shuffle per entry instead of "
             "MATCH.ANY, in the small forms' claim (kSmallSend, both layouts) and in the expert "
             "layout's receive of one token in all (kUnitExpRecv, kUnitExpFan; "
             "AFDEP_LONE_EXPAND), whose rows then come from the same pass of shuffles, each in "
             "instantiations of its own; at T = 1 (one H100, 1A1F H4096 BF16) the lone "
             "receive knows its row 0.4 us after the token's units instead of 0.6, and the "
             "round trip is 2.6% (expert layout) and 1.4% (token layout) shorter; the same "
             "outputs; 0 = MATCH.ANY (__match_any_sync), and a second pass of shuffles for the "
             "lone receive's rows"),
    _control("AFDEP_SETTLE_UNITS", 29, 1,
             "the token layout's receive of flagged units (kSmallRecv, with "
             "AFDEP_SPREAD_CHUNKS) polls a token's metadata units (its header, and each "
             "entry's id, weight and column) together, each poll reloading every unit still "
             "stale, in an instantiation of its own, so that units which land together are seen "
             "one load latency after the last lands; at T = 1, 7 and 24 (one H100, 1A1F H4096 "
             "BF16) the round trip is 2.2%, 1.2% and 2.4% shorter; the same outputs; 0 = each "
             "unit spun on in turn (a unit whose first load was stale costs a latency of its "
             "own after the one before it is seen)"),
)

SYMMETRIC = "AFDEP_SYMMETRIC"

_OTHERS = (
    Setting(SYMMETRIC, "bool", 0,
            "1 reverts every protocol control at once (the symmetric baseline arm)", AT_BUFFER),
    Setting("AFDEP_TRANSPORT", "choice", "ipc",
            "CUDA transport: ipc (CUDA IPC handles; several ranks may share a GPU) or nccl "
            "(NCCL device-API windows, LSA peer pointers; one rank per GPU)", AT_BUFFER,
            choices=("ipc", "nccl")),
    Setting("AFDEP_CHECK_INPUTS", "bool", 1,
            "0 skips the host-side expert-id range check of eager CUDA dispatch (inside "
            "graphs the kernels check and report AfdepRouteError)", AT_DISPATCH),
    Setting("AFDEP_ROLES", "str", "",
            "roles of afdep groups created without AfdepOptions, e.g. FFAA or "
            "ffn,ffn,attention,attention",
            AT_GROUP),
    Setting("AFDEP_TRACE", "bool", 0,
            "diagnostics: 1 records per-stage timestamps in the kernels (benchmarks.trace)",
            AT_BUFFER),
    Setting("AFDEP_DEBUG", "int", 0,
            "diagnostics bit mask: 1 prints signal values from the kernels, 8 fences in "
            "every writer thread (the older, slower form); never in benchmarks", AT_BUFFER),
    Setting("AFDEP_BUILD_CUDA", "choice", "auto",
            "0/1 forces the CUDA extension off/on (auto: on when nvcc is found)", AT_BUILD,
            choices=("auto", "0", "1")),
    Setting("AFDEP_CUDA_ARCH", "str", "",
            "nvcc -gencode targets of the CUDA extension (empty: sm_90a)", AT_BUILD),
    Setting("AFDEP_NCCL", "bool", 1,
            "0 builds the CUDA extension without the NCCL transport", AT_BUILD),
    Setting("AFDEP_NCCL_HOME", "str", "",
            "NCCL (include/, lib/) for the NCCL transport (empty: the nvidia-nccl wheel)",
            AT_BUILD),
    Setting("AFDEP_PTXAS_V", "bool", 0, "1 prints ptxas register and spill counts", AT_BUILD),
    Setting("AFDEP_COMMIT", "str", "",
            "the commit recorded in result files (empty: git rev-parse)", AT_BENCH),
    Setting("AFDEP_BENCH_INJECT", "str", "",
            "benchmark test hook: inject failures (never set in real runs)", AT_BENCH),
    Setting("AFDEP_WORLD_START", "choice", "auto",
            "how spawn_world starts ranks: forkserver (a server process that imported torch "
            "once forks every rank: about 0.1 s instead of seconds per world), spawn (a fresh "
            "interpreter per rank), or auto: forkserver for CPU worlds, spawn for GPU worlds",
            AT_TESTS, choices=("auto", "spawn", "forkserver")),
    Setting("AFDEP_WORLD_STACKS_S", "float", 0.0,
            "spawned test worlds print every rank's Python stacks after this many seconds "
            "(0: never)", AT_TESTS),
    Setting("AFDEP_TEST_SHARED_GPU", "bool", 0,
            "GPU tests: run layouts whose ranks share a GPU (needs CUDA MPS)", AT_TESTS),
    Setting("AFDEP_TEST_REPLY_DELAY_MS", "float", 0.0,
            "GPU tests: the FFN's expert waits this long before replying", AT_TESTS),
    Setting("AFDEP_TEST_DISPATCH_DELAY_MS", "float", 0.0,
            "GPU tests: the Attention waits this long before dispatching", AT_TESTS),
    Setting("AFDEP_TEST_COMBINE_DELAY_MS", "float", 0.0,
            "GPU tests: the Attention waits this long before combining", AT_TESTS),
    Setting("AFDEP_TEST_BUFFERS", "int", 1000,
            "GPU lifecycle test: buffers created and closed", AT_TESTS),
    Setting("AFDEP_FUZZ_SEEDS", "int", 0,
            "tests/contract/test_fuzz.py runs seeds 0..N-1 (0: its default count)", AT_TESTS),
    Setting("AFDEP_FUZZ_SEED", "str", "",
            "tests/contract/test_fuzz.py runs only these comma-separated seeds", AT_TESTS),
    Setting("AFDEP_GPU_BODIES_ON_CPU", "bool", 0,
            "import the GPU test bodies without a GPU (smoke tests)", AT_TESTS),
    Setting("AFDEP_TEST_OUT", "str", "",
            "contract tests: the folder a spawned world's ranks write their records to",
            AT_TESTS),
)

#: name -> Setting, for every variable torch_afdep reads.
SETTINGS: Dict[str, Setting] = {s.name: s for s in _CONTROLS + _OTHERS}

#: The protocol controls, in bit order.
CONTROLS: Dict[str, Setting] = {s.name: s for s in _CONTROLS}

#: Every control bit.
ALL_ROLE_AWARE = sum(c.bit for c in _CONTROLS)

#: The mask of an environment that sets no control (experimental changes stay off).
DEFAULT_FLAGS = sum(c.bit for c in _CONTROLS if c.default)

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse(name: str, raw: str) -> Any:
    """``raw`` as the value of ``name``; ValueError naming it and the allowed values."""
    s = SETTINGS[name]
    v = raw.strip()
    if s.kind == "bool":
        low = v.lower()
        if low in _TRUE:
            return 1
        if low in _FALSE:
            return 0
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    if s.kind == "int":
        try:
            return int(v, 0)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if s.kind == "float":
        try:
            return float(v)
        except ValueError:
            raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if s.kind == "choice":
        low = v.lower() or str(s.default)
        if low not in s.choices:
            raise ValueError(f"{name} must be one of {', '.join(s.choices)}, got {raw!r}")
        return low
    return v


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The parsed value of ``name`` in ``environ`` (default: os.environ), or its default."""
    environ = os.environ if environ is None else environ
    s = SETTINGS[name]  # KeyError: not a registered variable
    raw = environ.get(name)
    if raw is None or (raw.strip() == "" and s.kind != "str"):
        return s.default
    return parse(name, raw)


def protocol_flags(environ: Optional[Mapping[str, str]] = None) -> int:
    """The control bit mask of ``environ`` (default: os.environ)."""
    if get(SYMMETRIC, environ):
        return 0
    mask = 0
    for name, c in CONTROLS.items():
        if get(name, environ):
            mask |= c.bit
    return mask


def describe_flags(mask: int) -> Dict[str, int]:
    """{control name: 0/1} for a mask."""
    return {name: int(bool(mask & c.bit)) for name, c in CONTROLS.items()}


#: Controls removed from the kernels (most were measured and not kept; see docs/history.md), or
#: renamed: name -> what became of it. Setting one has no effect; ``unknown_notes`` says so
#: instead of calling it a typo.
RETIRED: Dict[str, str] = {
    "AFDEP_FFN_WIDE": "renamed: set AFDEP_WIDE_LOCAL instead",
    "AFDEP_ROW_BATCH": "reverted in session 6: slower in 5 of 6 cells at T >= 1,536 on 2 x H200",
    "AFDEP_RELAXED_POLL": "removed in session 12: no faster in any of 9 cells",
    "AFDEP_PARAM_PREFETCH": "removed in session 14: the compiler dropped its loads, so it never ran",
    "AFDEP_EARLY_SETUP": "removed in session 19: a longer gap before the reply",
    "AFDEP_EAGER_GATE": "reverted in session 26: every process slow on a shared GPU",
    "AFDEP_EAGER_PLACE": "removed in session 33: some processes 1.1-3.5x slower on a shared GPU",
    "AFDEP_SIZED_GRID": "removed in session 33: no gain on 2 x H200, a slower reply on one",
    "AFDEP_EARLY_EXPAND": "removed in session 36: 7.6-9% slower at T <= 24",
    "AFDEP_SPEC_REPLY": "removed in session 36: 0.2-2% slower at T <= 4",
    "AFDEP_LONE_SPLIT": "removed in session 36: within 1% of off",
    "AFDEP_PAIRED_POLL": "removed in session 42: slower at T = 1 and 7 (+2.7%, +3.6%)",
    "AFDEP_REPLY_PRELOAD": "removed in session 42: no gain at T = 1 and 2 (+1.2%, -0.4%)",
    "AFDEP_EARLY_COLLECT_EXPERTS": "removed in session 43: the expert layout's collect no "
                                   "shorter (1.7 us at T = 1), +1.1% at T = 1",
    "AFDEP_EARLY_ADDRESS": "removed in session 44: +1.0% (token layout) and +0.9% (expert "
                           "layout) at T = 1",
    "AFDEP_LEAD_POLL": "removed in session 45: the expert layout's wait for a lone token's "
                       "units no shorter (1.70 us at T = 1), +0.9% at T = 1, +4.7% at T = 7",
    "AFDEP_STAGGER_POLL": "removed in session 45: the token layout's receive no shorter (its "
                          "first poll returned 1.25 us after ready against 0.86), within 2.4% "
                          "either way",
    "AFDEP_WARM_PARAMS": "withdrawn in session 45 before any GPU run: at 0 it changed the code "
                         "the kernels ran (docs/history.md)",
    "AFDEP_EARLY_UNITS": "removed in session 46: the token layout's receive no shorter (its "
                         "first poll returned 1.18 us after ready against 1.12), +0.3% and "
                         "-0.2% at T = 1 and 7",
    "AFDEP_LL_CONTIG": "removed in session 47: +0.1% at T = 1 in both layouts, -1.6% and "
                       "+0.7% at T = 7 (token, expert layout)",
    "AFDEP_SPREAD_SEND": "removed in session 48: +2.7% (token layout) and +1.3% (expert "
                         "layout) at T = 1, +1.0% and +1.3% at T = 7",
    "AFDEP_WARM_LINES": "removed in session 48 before its A/B: its token-layout graph "
                        "replays timed out (cause not found)",
    "AFDEP_REWARM_PARAMS": "removed in session 50: the token layout's receive no shorter (its "
                           "first poll returned 0.96 us after ready against 0.90)",
}


def unknown(environ: Optional[Mapping[str, str]] = None) -> Tuple[str, ...]:
    """``AFDEP_*`` names set in ``environ`` that torch_afdep does not read (typos, or the
    retired controls of ``RETIRED``)."""
    environ = os.environ if environ is None else environ
    return tuple(sorted(k for k in environ if k.startswith("AFDEP_") and k not in SETTINGS))


def unknown_notes(environ: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """{name: why it has no effect} for every ``unknown`` name: a retired control's fate, or,
    for a likely typo, the registered name closest to it."""
    notes = {}
    for name in unknown(environ):
        if name in RETIRED:
            notes[name] = f"a retired control ({RETIRED[name]}); it has no effect"
        else:
            close = difflib.get_close_matches(name, list(SETTINGS), n=1, cutoff=0.8)
            notes[name] = "not read by torch_afdep" + (
                f" (did you mean {close[0]}?)" if close else " (a typo?)")
    return notes


def warn_unknown(environ: Optional[Mapping[str, str]] = None) -> None:
    """One ``UserWarning`` listing the ``AFDEP_*`` variables of ``environ`` that have no
    effect (``unknown_notes``); nothing when there are none. ``current()`` calls it at its first
    parse, so each process of a world warns once (Python's default filter also hides a repeat
    from the same place)."""
    notes = unknown_notes(environ)
    if notes:
        warnings.warn("torch_afdep: " + "; ".join(f"{k} is set but {v}" for k, v in
                                                  notes.items()), UserWarning, stacklevel=3)


class Values(NamedTuple):
    """The run-time settings of one process (``current()``)."""

    flags: int
    transport: str
    check_inputs: int
    roles: str
    trace: int
    debug: int


def read(environ: Optional[Mapping[str, str]] = None) -> Values:
    """Parse every run-time setting of ``environ`` (default: os.environ)."""
    return Values(
        flags=protocol_flags(environ),
        transport=get("AFDEP_TRANSPORT", environ),
        check_inputs=get("AFDEP_CHECK_INPUTS", environ),
        roles=get("AFDEP_ROLES", environ),
        trace=get("AFDEP_TRACE", environ),
        debug=get("AFDEP_DEBUG", environ),
    )


_CURRENT: Optional[Values] = None


def current() -> Values:
    """This process's run-time settings, parsed on first use and kept."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = read()
        warn_unknown()  # a retired control or a typo would otherwise do nothing, silently
    return _CURRENT


def reset() -> None:
    """Forget the parsed settings; the next ``current()`` reads the environment again."""
    global _CURRENT
    _CURRENT = None


__all__ = ["Setting", "SETTINGS", "CONTROLS", "SYMMETRIC", "ALL_ROLE_AWARE", "DEFAULT_FLAGS",
           "RETIRED", "parse", "get", "protocol_flags", "describe_flags", "unknown", "unknown_notes",
           "warn_unknown", "Values", "read",
           "current", "reset"]
