// Static layout of one rank's registered window and the control words the kernels use.
// Plain C++ (no torch, no CUDA headers): shared by the host code and the kernels.
#pragma once

#include <cstdint>

namespace afdep {

// Protocol controls: bit `bit` of the mask torch_afdep/env.py builds (every bit set =
// role-aware). This list is the only C++ place that names them: it expands into the enum
// ControlFlags (F_ROLE_BUFFERS, F_NO_ENTRY_BARRIER, ...), kAllRoleAware and the extension's
// CONTROL_BITS dict (cuda_module.cpp), which a test compares with env.CONTROLS.
#define AFDEP_CONTROL_FLAGS(X)                                                                 \
  X(ROLE_BUFFERS, 0)        /* per-role inboxes (else union-sized windows everywhere) */      \
  X(NO_ENTRY_BARRIER, 1)    /* no entry barrier (else full barrier in both phases) */         \
  X(ONE_WAY_COUNTS, 2)      /* counts ride behind the payload A->F (else all-to-all first) */ \
  X(RECEIVER_WAIT_ONLY, 3)  /* only receivers wait, per channel (else full exit barrier) */   \
  X(ROLE_WARPS, 4)          /* each role runs only its stage (else both, with dummies) */     \
  X(SINGLE_FFN, 5)          /* F == 1: copy instead of the fp32 sum in combine */             \
  X(WIDE_LOCAL, 6)          /* FFN receive/reply and Attention combine: one CTA per SM */     \
  X(EARLY_COUNTS, 7)        /* counts before the payload, then a per-channel payload flag */  \
  X(STREAM_EXPANSION, 9)    /* sender CTAs with >= kStreamMinTokens tokens: counts ahead,     \
                               then one flag per row; the FFN expands each row as it lands */ \
  X(PDL, 10)                /* programmatic dependent launch of the transport kernels */      \
  X(ONE_FENCE, 11)          /* a signal is one system fence and a relaxed store (else the     \
                               fence and a release store: a second fence) */                  \
  X(LEAN_COUNTS, 12)        /* token layout: count blocks carry the count only (no            \
                               per-expert counts, which only the expert layout reads) */      \
  X(EARLY_LOADS, 13)        /* small T: independent global loads issued together at the       \
                               kernels' start */                                              \
  X(LL_SMALL, 14)           /* small buckets: the reply's rows (both layouts) and the token   \
                               layout's dispatch words travel in flagged 8-byte units, no     \
                               fence and no flag in front of them */                          \
  X(SMALL_KERNELS, 15)      /* launches on a small-T path (flagged units; the expert layout's \
                               count blocks) run kernels compiled for that path and one role  \
                               alone (compact code) */ \
  X(PARAM_BASES, 16)        /* the window bases of this rank and of the first kParamBases     \
                               ranks of each role ride in the kernels' parameters (else two   \
                               dependent global loads: rank table, then peer table) */      \
  X(LONE_TOKEN, 17)         /* flagged units, a sender CTA of one token: its slot is 0 in     \
                               every region, so the other warps store its units while warp 0  \
                               claims it (no slot counters, no barrier between) */            \
  X(LONE_EXPAND, 18)        /* the expert layout's units receive, one token in all: its rows  \
                               from its own entries, no count table */                        \
  X(LL_EXPERTS, 19)         /* small buckets: the expert layout's dispatch as flagged units   \
                               too; the FFN counts rows per (region, expert) from the         \
                               metadata units */                                              \
  X(EARLY_COLLECT, 20)      /* the token layout's flagged-unit collect: row warps poll their  \
                               units with the start units, no barrier between */              \
  X(FANOUT_EXPAND, 21)      /* the expert layout's units receive: a unit is a chunk of a      \
                               token's row, loaded once and stored into each of the token's   \
                               rows (kUnitExpFan, experimental) */                            \
  X(SPREAD_CHUNKS, 22)      /* the small combine forms and the token layout's units receive: \
                               a row's chunks go to one warp on each of several CTAs, not to  \
                               one CTA's warps */                                             \
  X(RAW_META, 25)           /* token layout, F_LONE_TOKEN: a lone token's raw ids and weights \
                               go ahead of its row; each FFN rank derives its own columns     \
                               (kRawSend, kRawRecv, experimental) */                          \
  X(UNIT_SIGNAL, 26)        /* the reply: a CTA that wrote only flagged row units adds its    \
                               completion count without a system fence */                     \
  X(SHUFFLE_MATCH, 27)      /* a token's repeated ids found by shuffles, not MATCH.ANY: the   \
                               sender's claim and the expert layout's lone receive */         \
  X(SETTLE_UNITS, 29)       /* the token layout's receive of flagged units polls a token's    \
                               metadata units together, not one after another */

enum ControlFlags : uint32_t {
#define AFDEP_CONTROL_ENUM(name, bit) F_##name = 1u << (bit),
  AFDEP_CONTROL_FLAGS(AFDEP_CONTROL_ENUM)
#undef AFDEP_CONTROL_ENUM
};
// every bit above (the Python defaults leave the experimental ones off)
constexpr uint32_t kAllRoleAware = 0
#define AFDEP_CONTROL_OR(name, bit) | F_##name
    AFDEP_CONTROL_FLAGS(AFDEP_CONTROL_OR)
#undef AFDEP_CONTROL_OR
    ;
constexpr int kMaxAttn = 1024;  // Attention ranks per group (combine kernel's shared table)
constexpr int kMaxFfn = 64;     // FFN ranks per group (the route is a 64-bit mask)
// F_PARAM_BASES: window bases of this many FFN and Attention indices in the parameter block
constexpr int kParamBases = 8;
// Early counts cost a second fence and flag on both sides; a sender CTA publishes its counts
// ahead of its payload only when that payload is at least this large (at 8 KB rows: 4 tokens),
// i.e. when crossing NVLink takes longer than the receiver's offset computation.
constexpr int64_t kEarlyMinBytes = 32 * 1024;
// The directional protocol: with any of these reverted, every rank waits for every other
// rank inside each phase.
constexpr uint32_t kDirectional = F_NO_ENTRY_BARRIER | F_ONE_WAY_COUNTS | F_RECEIVER_WAIT_ONLY |
                                  F_ROLE_WARPS;
// Wide grids need the directional protocol (the barriers and dummy stages of the reverted
// controls are per channel, i.e. S CTAs on every rank).
constexpr uint32_t kWideNeeds = F_WIDE_LOCAL | kDirectional;
// Streamed expansion: a sender CTA flags each row only from this many tokens; below, the
// fused or one-flag paths stay (2 x H200, H4096 BF16: 22 tokens per CTA were 4% slower with
// row flags, 86 tokens 9% faster).
constexpr int kStreamMinTokens = 48;
constexpr uint32_t kEarlyNeeds = F_EARLY_COUNTS | kDirectional;
constexpr uint32_t kStreamNeeds = F_STREAM_EXPANSION | kEarlyNeeds;
// Flagged units (F_LL_SMALL): a channel of at most kLLTokens tokens (ceil(bucket / S), which
// sender and receiver both know) sends its count, metadata, rows and scales as 8-byte units,
// each a 32-bit word and the low half of the exchange number; the sender's rows come from the
// early loads' registers, so F_EARLY_LOADS is needed too. The reply's rows go as units in
// both layouts when the bucket gives at most kLLTokens tokens per channel (Layout::llc).
constexpr int kLLTokens = 2;
constexpr uint32_t kLLNeeds = F_LL_SMALL | F_EARLY_LOADS | kDirectional;
// The expert layout's dispatch units (Layout::llx): only the small kernel forms hold them (the
// generic kernel does not), and their regions are indexed by Attention index (role buffers).
constexpr uint32_t kLLExpertNeeds = F_LL_EXPERTS | F_SMALL_KERNELS | F_ROLE_BUFFERS | kLLNeeds;
// ... and only where a channel holds one token (bucket <= S): with two (1A1F H4096 BF16 on
// one H200, T = 32 and 48) they were 4% and 11% slower than the count form, with one (T = 1
// and 7) 12% faster (session 30)
constexpr int kLLXTokens = 1;
// AFDEP_EARLY_COLLECT's form only in the token layout and where the collect's T <= S (one
// token per row warp group): at T = 48 it was 1% (token layout) and 5% (expert layout) slower
// than kSmallRecv, and the expert layout's collect 1-4% slower at T <= 24 too (its reply
// comes later, so the polling lanes spin longer on the GPU the ranks share; session 30)
constexpr int kEarlyCollectTokensPerSm = 1;

// AFDEP_DEBUG bits (diagnostics and memory-ordering experiments; default 0, never in
// benchmarks of record)
enum DebugBits : int {
  kDbgPrint = 1,     // CTA 0 prints exchange numbers and signal values (printf)
  kDbgThreadFence = 8,  // writers: every thread fences its own stores at system scope before
                        // the CTA signals (the old, slower form; default: the signalling
                        // thread's one fence after bar.sync covers the CTA's stores)
};

enum PhaseId : int { kPhaseDispatch = 0, kPhaseCombine = 1, kPhaseProbe = 2 };

// Optional stage trace (AFDEP_TRACE=1; diagnostics only): %globaltimer stamps of the last
// kTraceRing exchanges, [ring][phase][point]. Points 4-6 and 14 are the latest over CTAs, the
// rest CTA 0's (at small T the CTA that holds the tokens); point 15 is no time but CTA 0's
// SM. Each CTA keeps its stamps in shared memory and writes them when it ends
// (kernels/common.cuh trace_flush); CTA 0 writes 0 for a point its launch never reached.
constexpr int kTraceRing = 64;
constexpr int kTracePts = 16;
enum TracePoint : int {
  kTrStart = 0,    // kernel start (CTA 0)
  kTrSent = 1,     // send stage done, signals written (CTA 0)
  kTrWaited = 2,   // receiver's wait done (CTA 0)
  kTrEnd = 3,      // kernel end (CTA 0)
  kTrMaxSent = 4,  // latest CTA's kTrSent
  kTrMaxWaited = 5,
  kTrMaxEnd = 6,
  kTrReady = 7,    // FFN receive: expert offsets computed, expansion starts (CTA 0)
  kTrClaimed = 8,  // dispatch sender: tokens claimed (slots, metadata written) (CTA 0)
  kTrCopied = 9,   // dispatch sender: payload rows written, before the signalling fence (CTA 0)
  kTrWritten = 10, // FFN reply: reduced rows written, before the signalling fence (CTA 0)
  kTrTable = 11,   // FFN receive: count table in shared memory, before the scans (CTA 0)
  kTrLoaded = 12,  // thread 0's first loads arrived (CTA 0): dispatch sender, its token's
                   // expert id (F_EARLY_LOADS) and the exchange number; FFN reply
                   // (F_EARLY_LOADS, token layout), its first row's token index and vector;
                   // FFN reply (expert layout), its item's first 8 rows' vectors (at small
                   // T its first item; at large T, generic path, its last); FFN receive
                   // (flagged units), its first row's (token layout) or unit's (expert
                   // layout) metadata units seen
  kTrMasked = 13,  // dispatch sender: thread 0's last claimed token's route mask known (ids
                   // checked, duplicates matched), before its slot and metadata stores (CTA 0);
                   // FFN reply (expert layout): that item's receipt loaded; FFN receive
                   // (expert layout, one token in all): thread 0's row known (lone_row);
                   // FFN receive (token layout, F_SETTLE_UNITS): thread 0's first load of
                   // its first row's metadata units returned (fresh or not)
  kTrMaxStart = 14,  // latest CTA's kTrStart: against CTA 0's, how far apart the CTAs began
  kTrSm = 15,        // CTA 0's SM, %smid + 1 (not a time): on a GPU that ranks share, whether
                     // one rank's CTA 0 ran on the SM of another's
};

// Host-mapped (cudaHostAllocMapped) error words; the device writes, the host reads.
struct ErrorBlock {
  int timeout;        // 1 once some wait expired
  int timeout_claim;  // first reporter wins
  int timeout_phase;
  int timeout_peer;   // group rank waited for
  int timeout_rank;   // group rank that waited
  int route;          // 1 once a bad expert id (or an overflow) was seen
  int route_claim;
  int route_kind;     // 0 bad id, 1 more local entries than R, 2 receipt/slot overflow,
                      // 3 bucket mismatch (route_bad_id = the peer's bucket)
  long long route_bad_id;
  int route_peer;     // kind 3: group rank of the peer whose bucket differs (else -1)
  int route_own;      // kind 3: this rank's bucket (as the exchange saw it)
};

// Route error kinds (ErrorBlock::route_kind; torch_afdep/transport/cuda.py _ROUTE_KINDS).
enum RouteKind : int {
  kRouteBadId = 0,
  kRouteTooManyLocal = 1,
  kRouteOverflow = 2,
  kRouteBucket = 3,  // a sender dispatched with another bucket than the FFN received with
};

// The count block's word at +12 carries the sender's `ahead` mode (low kAheadBits bits) and
// its bucket (the rest; 0: not declared, not checked). The FFN takes nothing from a sender
// whose bucket differs from its own and reports kRouteBucket; its reply then writes a
// ReplyStatus into that sender's window (below) so the Attention reports it too.
constexpr int kAheadBits = 2;
constexpr int kAheadMask = (1 << kAheadBits) - 1;
constexpr int kMaxBucket = (1 << (31 - kAheadBits)) - 1;

// Written by an FFN rank's reply CTA 0 into Attention rank a's window at
// off_reply_status + ffn index * 16, only when the FFN took nothing from a because the
// buckets differed; `seq` is the combine exchange number, so a stale entry never matches.
struct ReplyStatus {
  uint64_t seq;
  int ffn_bucket;     // the FFN's bucket
  int sender_bucket;  // the bucket the Attention rank dispatched with
};
static_assert(sizeof(ReplyStatus) == 16, "ReplyStatus is one 16-byte entry per FFN rank");

// n / d for 0 <= n < 2^31 and a divisor d >= 1 known only at run time, without the integer
// division sequence (about 15 dependent instructions, two through the float unit), which the
// small-T paths met several times in a row: q = (umulhi(n, m) + n) >> s (fast_div in
// common.cuh), with s = ceil(log2 d) and m = ceil(2^(32+s) / d) - 2^32, made on the host.
struct FastDiv {
  uint32_t d, m, s;
};

constexpr FastDiv make_fast_div(uint32_t d) {
  uint32_t s = 0;
  while (s < 31 && (1u << s) < d) ++s;
  const uint64_t m = ((1ull << (32 + s)) + d - 1) / d - (1ull << 32);
  return {d, (uint32_t)m, s};
}

// the device's fast_div, on the host (the checks below; the bound: q exact for n < 2^31)
constexpr uint32_t fast_div_ref(uint32_t n, FastDiv f) {
  return (uint32_t)((((uint64_t)n * f.m >> 32) + n) >> f.s);
}
constexpr bool fast_div_ok(uint32_t d) {
  const uint32_t ns[] = {0u, 1u, d - 1, d, d + 1, 2 * d - 1, 1000003u, 0x7fffffffu - d,
                         0x7ffffffeu, 0x7fffffffu};
  for (uint32_t n : ns)
    if (n < 0x80000000u && fast_div_ref(n, make_fast_div(d)) != n / d) return false;
  return true;
}
static_assert(fast_div_ok(1) && fast_div_ok(2) && fast_div_ok(3) && fast_div_ok(5) &&
                  fast_div_ok(7) && fast_div_ok(24) && fast_div_ok(127) && fast_div_ok(129) &&
                  fast_div_ok(1000) && fast_div_ok(65535) && fast_div_ok(65537) &&
                  fast_div_ok(0x40000001u) && fast_div_ok(0x7fffffffu),
              "FastDiv: q = (umulhi(n, m) + n) >> s must equal n / d");

struct Layout {
  // world
  int rank, W, A, F, S;
  int is_ffn, my_index;  // role of this rank and its index among that role's ranks
  // sizes
  int H, elem, row_bytes, scale_cols;
  int E, El, k, R, C;
  int G;          // CTAs of the FFN's receive and reply kernels (S unless F_WIDE_LOCAL)
  int Ga;         // CTAs of the Attention's combine kernel (S unless F_WIDE_LOCAL)
  int Gmax;       // max(S, G, Ga): stride of the per-CTA counters
  int early;      // 1: counts published before the payload (kEarlyNeeds all set)
  int stream;     // 1: streamed expansion (kStreamNeeds all set): per-row payload flags
  int ll;         // 1: the dispatch's flagged units for small buckets (kLLNeeds, token layout)
  int llc;        // 1: the reply's flagged units for small buckets (kLLNeeds, either layout)
  int llx;        // 1: the dispatch's flagged units for small buckets, expert layout
                  // (kLLExpertNeeds); the same units and region layout as ll
  int tokens;     // 1: token-major receive layout (Config.receive_layout == "tokens"): the
                  // inbox slots of (source a, channel c) sit at stride ceil(bucket/S), indexed
                  // by Attention index, so the inbox is the FFN's [A*S*stride, H] input as is
  int slots;      // dispatch slots per (source, channel) = ceil(C / S)
  int meta_ints;  // ints per dispatch slot's metadata (token, nloc, experts[R], weights[R], pos[R])
  int nsrc_d;     // dispatch inbox sources (A role-aware, W union)
  int nsrc_c;     // combine inbox sources (F role-aware, W union)
  FastDiv div_S, div_nreg;  // by S, and by A * S (the dispatch inbox's regions)
  FastDiv div_El, div_nv;   // by E_local (an expert's FFN index), by row_bytes / 16
  FastDiv div_El4, div_R;   // by E_local / 4 (count blocks as 16-byte loads), by R
  FastDiv div_F, div_sc;    // by F (a (token, FFN) pair's token), by scale_cols (FP8)
  FastDiv div_El1;          // by E_local + 1 (a count block's words)
  uint32_t flags;
  uint64_t timeout_ns;
  // window offsets (identical on every rank)
  int64_t off_cnt, cnt_stride;  // count blocks [W][S]: {u64 seq, i32 count,
                                //   i32 ahead | bucket << kAheadBits, i32 ecnt[El]}
  int64_t off_disp_done;        // u64 [W][S]: payload of (src, ch) written (count-first or early)
  int64_t off_comb_done;        // u64 [W]: CTAs of source rank's reply kernels done, summed
  int64_t off_entry;            // u64 [2][W][S]
  int64_t off_exit;             // u64 [2][W][S]
  int64_t off_ping;             // u64: flag ping-pong word (probe.cu: the flag round trip)
  int64_t off_reply_status;     // ReplyStatus [W] by FFN index: bucket mismatch of a reply
  int64_t off_data;             // start of the data area
  int64_t off_payload, off_scales, off_meta;  // dispatch inbox arrays (FFN, or union)
  int64_t off_rowflag;          // u64 per dispatch slot: its row written (streamed expansion)
  int64_t off_ll;               // u64 units [nsrc_d][S][ll_region_units] (F_LL_SMALL)
  int64_t ll_token_units;       // one token's units: metadata, row words, scales (even)
  int64_t ll_region_units;      // 2 (count, ahead | bucket) + kLLTokens tokens
  int64_t off_comb;             // combine inbox [nsrc_c][C][H] bf16 (Attention, or union)
  int64_t off_llc_start;        // F_LL_SMALL reply: u64 units [F][2] per FFN index: the
                                // reply started (its receive done): ffn bucket | 0, sender bucket
  int64_t off_llc;              // F_LL_SMALL reply rows: u64 units [F][llc_tokens][H / 2]
  int llc_tokens;               // tokens a collect may take as units: kLLTokens * S
  int64_t signal_bytes, dispatch_bytes, combine_bytes, window_bytes;
  // device pointers
  const uint64_t* peer_bases;  // [W] window base of every group rank (own = local)
  const int* rank_of_ffn;      // [F]
  const int* rank_of_attn;     // [A]
  uint64_t* counters;          // [2][Gmax] per-CTA exchange counters (device-local)
  int* mismatch;               // [A] FFN: receive's CTA 0 writes the bucket of each source
                               // whose bucket differed (else 0); the reply reads it
  ErrorBlock* err;             // device view of the host-mapped error block
  uint64_t* trace;             // [kTraceRing][2][kTracePts] stage stamps, or null (no trace)
  int debug;                   // AFDEP_DEBUG bits (diagnostics): see kDbg* below
  // F_PARAM_BASES (filled when the peers are opened; 0: not here, read the tables above)
  uint64_t own_base;                // this rank's window
  uint64_t ffn_base[kParamBases];   // window of FFN index f < kParamBases
  uint64_t attn_base[kParamBases];  // window of Attention index a < kParamBases
};

inline int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Fill the size/offset fields of L from its world/size fields and flags.
inline void compute_offsets(Layout& L) {
  const bool role = (L.flags & F_ROLE_BUFFERS) != 0;
  L.slots = (L.C + L.S - 1) / L.S;
  L.div_S = make_fast_div((uint32_t)L.S);
  L.div_nreg = make_fast_div((uint32_t)(L.A * L.S));
  L.div_El = make_fast_div((uint32_t)(L.El > 0 ? L.El : 1));
  L.div_nv = make_fast_div((uint32_t)(L.row_bytes >= 16 ? L.row_bytes / 16 : 1));
  L.div_El4 = make_fast_div((uint32_t)(L.El >= 4 ? L.El / 4 : 1));
  L.div_R = make_fast_div((uint32_t)(L.R > 0 ? L.R : 1));
  L.div_F = make_fast_div((uint32_t)(L.F > 0 ? L.F : 1));
  L.div_El1 = make_fast_div((uint32_t)(L.El > 0 ? L.El + 1 : 1));
  L.div_sc = make_fast_div((uint32_t)(L.scale_cols > 0 ? L.scale_cols : 1));
  L.meta_ints = (int)round_up(2 + 3 * L.R, 4);
  L.nsrc_d = role ? L.A : L.W;
  L.nsrc_c = role ? L.F : L.W;
  const int64_t ws = (int64_t)L.W * L.S;
  int64_t o = 0;
  L.cnt_stride = 16 + round_up((int64_t)L.El * 4, 16);
  L.off_cnt = o;        o += ws * L.cnt_stride;
  L.off_disp_done = o;  o += ws * 8;
  L.off_comb_done = o;  o += (int64_t)L.W * 8;
  L.off_entry = o;      o += 2 * ws * 8;
  L.off_exit = o;       o += 2 * ws * 8;
  L.off_ping = o;       o += 8;
  o = round_up(o, 16);
  L.off_reply_status = o;  o += (int64_t)L.W * (int64_t)sizeof(ReplyStatus);
  o = round_up(o, 256);
  L.signal_bytes = o;
  L.off_data = o;
  // dispatch inbox
  const int64_t dslots = (int64_t)L.nsrc_d * L.S * L.slots;
  int64_t d = L.off_data;
  L.off_payload = d;  d += round_up(dslots * L.row_bytes, 256);
  L.off_scales = d;   d += round_up(dslots * L.scale_cols * 4, 256);
  L.off_meta = d;     d += round_up(dslots * L.meta_ints * 4, 256);
  L.off_rowflag = 0;
  if (L.flags & F_STREAM_EXPANSION) {
    L.off_rowflag = d;  d += round_up(dslots * 8, 256);
  }
  L.ll = ((L.flags & kLLNeeds) == kLLNeeds && L.tokens) ? 1 : 0;
  L.llx = ((L.flags & kLLExpertNeeds) == kLLExpertNeeds && !L.tokens) ? 1 : 0;
  L.off_ll = 0;
  L.ll_token_units = round_up(L.meta_ints + L.row_bytes / 4 + L.scale_cols, 2);
  L.ll_region_units = 2 + kLLTokens * L.ll_token_units;
  if (L.ll || L.llx) {
    L.off_ll = d;  d += round_up((int64_t)L.nsrc_d * L.S * L.ll_region_units * 8, 256);
  }
  L.dispatch_bytes = d - L.off_data;
  // combine inbox (shares the data area's start: one role uses one of the two)
  L.off_comb = L.off_data;
  L.combine_bytes = round_up((int64_t)L.nsrc_c * L.C * L.H * 2, 256);
  L.llc = (L.flags & kLLNeeds) == kLLNeeds ? 1 : 0;
  L.llc_tokens = kLLTokens * L.S;
  L.off_llc_start = L.off_llc = 0;
  if (L.llc) {  // the reply's units, behind the inbox (FFN-indexed)
    L.off_llc_start = L.off_comb + L.combine_bytes;
    L.combine_bytes += round_up((int64_t)L.F * 2 * 8, 256);
    L.off_llc = L.off_comb + L.combine_bytes;
    L.combine_bytes += round_up((int64_t)L.F * L.llc_tokens * (L.H / 2) * 8, 256);
  }
  int64_t data;
  if (role) {
    data = L.is_ffn ? L.dispatch_bytes : L.combine_bytes;
  } else {
    data = L.dispatch_bytes > L.combine_bytes ? L.dispatch_bytes : L.combine_bytes;
  }
  L.window_bytes = L.off_data + data;
}

// What the symmetric union layout registers on one rank (same formulas, W sources both ways).
inline int64_t union_window_bytes(const Layout& in) {
  Layout u = in;
  u.flags = in.flags & ~F_ROLE_BUFFERS;
  compute_offsets(u);
  return u.window_bytes;
}

}  // namespace afdep
