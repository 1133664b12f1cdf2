// This kernel serves both the Attention's dispatch (Comm::dispatch) and the FFN's receive
// (Comm::receive).
// Dispatch phase: Attention ranks send each token once per destination FFN rank; FFN ranks
// expand what arrived into the expert-major layout. One kernel serves both roles; the control
// flags select the role-aware protocol or the symmetric union baseline (docs/protocol.md).
#include "common.cuh"
#include "afdep/launch.h"

namespace afdep {

namespace {

constexpr unsigned kFull = 0xffffffffu;
// The count block's `ahead` word: how the receiver learns that a region's payload is complete.
// kAheadRaw (F_RAW_META, flagged units only): the region's one token came from a lone sender
// CTA with raw metadata units (raw_meta), its payload complete as for kAheadNone.
enum Ahead : int { kAheadNone = 0, kAheadChannel = 1, kAheadRows = 2, kAheadRaw = 3 };

// Token layout with F_LEAN_COUNTS: count blocks carry the header only (the token layout's
// receiver never reads the per-expert counts).
__device__ __forceinline__ bool lean_counts(const Layout& L) {
  return L.tokens && (L.flags & F_LEAN_COUNTS);
}

// ---- F_LL_SMALL: the dispatch's flagged units (common.cuh) ---------------------------------
constexpr int kPreVecs = 2;  // F_EARLY_LOADS: 16-byte row vectors per thread (see Preload)

// This exchange uses the units: a channel holds at most kLLTokens tokens and its rows fit in
// the early loads' registers. Sender and receiver decide alike (both know bucket and H); a
// sender with another bucket may decide otherwise, so each receiver wait also watches the
// other form and takes such a region as a bucket mismatch.
__host__ __device__ __forceinline__ bool units_fit(const Layout& L, int stride) {
  const int nv = L.row_bytes / 16;
  return stride <= kLLTokens && stride * nv <= kPreVecs * kThreads &&
         stride * L.scale_cols <= kThreads;
}
__host__ __device__ __forceinline__ bool ll_exchange(const Layout& L, const DispatchArgs& a) {
  return L.ll && units_fit(L, a.stride);
}
// F_LL_EXPERTS: the expert layout's exchange goes as the same units under the same limits
// (its stride is then ceil(bucket / S), dispatch_stride); only the small forms send or take
// them (dispatch_form), so the generic kernel never sees such an exchange.
__host__ __device__ __forceinline__ bool llx_exchange(const Layout& L, const DispatchArgs& a) {
  return L.llx && a.stride <= kLLXTokens && units_fit(L, a.stride);
}
// F_RAW_META (token layout, kRawSend / kRawRecv): a lone token's metadata units are its raw ids
// and weights in the source's columns: [0] its index, [1] k, [2, 2 + k) the ids (a valid id as
// is, any other -1), [2 + k, 2 + 2k) the weights' bits. They fit where 2 + 2k <= meta_ints
// (= 2 + 3R rounded up to 4: R >= 2k / 3 is enough). Sender and receivers decide alike: the
// flags and the config agree.
__host__ __device__ __forceinline__ bool raw_meta(const Layout& L) {
  constexpr uint32_t kNeeds = F_RAW_META | F_LONE_TOKEN | F_SMALL_KERNELS | kLLNeeds;
  return L.tokens && (L.flags & kNeeds) == kNeeds && 2 + 2 * L.k <= L.meta_ints;
}

// Units of region (src_idx, ch) in a window: [0] token count, [1] ahead | bucket << kAheadBits,
// then token j's ll_token_units from 2 + j * ll_token_units: its metadata words [0,
// meta_ints), its row's words, its scales.
__device__ __forceinline__ uint64_t* ll_region(const Layout& L, char* base, int src_idx, int ch) {
  return reinterpret_cast<uint64_t*>(base + L.off_ll) + ((size_t)src_idx * L.S + ch) *
                                                            (size_t)L.ll_region_units;
}

__device__ __forceinline__ uint64_t* ll_token(const Layout& L, uint64_t* region, int j) {
  return region + 2 + (size_t)j * L.ll_token_units;
}

// F_SHUFFLE_MATCH: whether a lane below this one holds the same key, among lanes [0, n) (keys
// of lanes past n never repeat a key: distinct negatives). One warp, every lane takes part.
// n shuffles in place of MATCH.ANY: at T = 1 the lone receive knows its rows 0.2 us sooner
// this way (the sender's route mask no sooner)
__device__ __forceinline__ bool repeats_below(int key, int n) {
  const int lane = threadIdx.x & 31;
  bool rep = false;
#pragma unroll 4
  for (int b = 0; b < n; ++b) {
    const int v = __shfl_sync(kFull, key, b);
    rep = rep || (b < lane && v == key);
  }
  return rep;
}

// One warp: bit f set for each FFN index f that some lane's valid id lives on (f: that id's
// FFN index), the same mask in every lane.
__device__ __forceinline__ uint64_t ffn_bits(bool valid, int f) {
  const unsigned lo = __reduce_or_sync(kFull, (valid && f < 32) ? (1u << f) : 0u);
  const unsigned hi = __reduce_or_sync(kFull, (valid && f >= 32) ? (1u << (f - 32)) : 0u);
  return (uint64_t)lo | ((uint64_t)hi << 32);
}

// Claim stage of one token (one warp; i = token index inside this CTA's range). Lanes read the
// k expert ids; duplicated ids count once (first occurrence); for each reached FFN rank one
// slot of region (src, c) is claimed with a shared atomic, and each local entry takes the next
// position of its expert within this CTA (s_ecnt), which the receiver turns into the row of
// the expert-major layout without any atomics. Unless count_only, the slot's metadata is
// written to the FFN rank and s_slot[i][f] records the slot (-1: not reached).
// pre: e_pre / w_pre already hold this lane's id and weight (F_EARLY_LOADS: -1 / 0 past k).
// llf != 0 (F_LL_SMALL): the metadata words go out as units flagged llf instead.
// kLone (F_LONE_TOKEN, units only): the CTA's only token: slot 0 in every region and position
// 0 in every expert, no shared-memory arrays (s_cnt, s_ecnt, s_slot unused), and the FFN
// windows from ffn_window (fb unused: no barrier behind the shared table's writes)
// kShuffle (F_SHUFFLE_MATCH's instantiations): repeated ids by shuffles (repeats_below)
template <bool kLone = false, bool kShuffle = false>
__device__ void claim_token(const Layout& L, const DispatchArgs& a, char* const* fb, int t, int i,
                            bool count_only, int* s_cnt, int* s_ecnt, int* s_slot, int src_idx,
                            int c, bool pre, long long e_pre, float w_pre, uint32_t llf) {
  const int lane = threadIdx.x & 31;
  long long e = -1;
  float w = 0.f;
  if (pre) {
    e = e_pre;
    w = w_pre;
  } else if (lane < L.k) {
    const size_t j = (size_t)t * L.k + lane;
    e = a.ids_64 ? reinterpret_cast<const long long*>(a.expert_ids)[j]
                 : (long long)reinterpret_cast<const int*>(a.expert_ids)[j];
    w = a.weights[j];
  }
  bool valid = lane < L.k && e >= 0 && e < L.E;
  if (!count_only && lane < L.k && (e < -1 || e >= L.E)) report_route(L.err, e, 0);
  // a valid id is in [0, E), so 32 bits hold it: no 64-bit match, and no 64-bit division (a
  // 70-instruction subroutine, which sat in front of every claim)
  const int e32 = valid ? (int)e : -2 - lane;  // invalid lanes: distinct negative values
  if (kShuffle) {
    const bool rep = repeats_below(e32, L.k);
    valid = valid && !rep;
  } else {
    const unsigned same = __match_any_sync(kFull, e32);
    valid = valid && (same & lanemask_lt()) == 0;
  }
  const int f = valid ? fast_div(e32, L.div_El) : -1;
  uint64_t mask = ffn_bits(valid, f);
  // traced only: a branch on the mask waits for it (taken unless every one of 64 FFN ranks is
  // reached), splitting the claim into the route's computation and the stores that follow
  if (L.trace != nullptr && !count_only && mask != ~0ull) trace_mark(L, kTrMasked, -1);
  if (!count_only) {
    if (lane == 0) a.route[t] = (int64_t)mask;
#pragma unroll 1  // one step for F <= 32; unrolled, 1.2 KB of code in front of every claim
    for (int q = lane; q < L.F && !kLone; q += 32) s_slot[i * L.F + q] = -1;
    __syncwarp();
  }
  while (mask) {
    const int fd = __ffsll((long long)mask) - 1;
    mask &= mask - 1;
    const unsigned b = __ballot_sync(kFull, valid && f == fd);
    const int r = __popc(b & lanemask_lt());
    const int nloc = min(__popc(b), L.R);
    if (!count_only && lane == 0 && __popc(b) > L.R) report_route(L.err, fd, 1);
    int slot = 0;  // kLone: the only token, slot 0 of each region
    if (!kLone) {
      if (lane == 0) slot = atomicAdd(&s_cnt[fd], 1);
      slot = __shfl_sync(kFull, slot, 0);
    }
    const bool mine = valid && f == fd && r < L.R;
    int pos = 0;
    if (mine && !lean_counts(L) && !kLone) pos = atomicAdd(&s_ecnt[e32], 1);  // lean: unread
    if (count_only) continue;
    if (slot >= a.stride) {  // cannot happen with T <= bucket <= C; never write out of bounds
      if (lane == 0) report_route(L.err, t, 2);
      continue;
    }
    if (lane == 0 && !kLone) s_slot[i * L.F + fd] = slot;
    char* base = kLone ? ffn_window(L, fd) : fb[fd];
    // the token layout keeps the source's columns: the entry's column instead of its
    // position within the expert
    const int el = e32 - fd * L.El, col = L.tokens ? lane : pos;
    if (llf) {
      uint64_t* u = ll_token(L, ll_region(L, base, src_idx, c), slot);
      if (lane == 0) {
        st_ll(u, t, llf);
        st_ll(u + 1, nloc, llf);
      }
      if (mine) {
        st_ll(u + 2 + r, el, llf);
        st_ll(u + 2 + L.R + r, __float_as_int(w), llf);
        st_ll(u + 2 + 2 * L.R + r, col, llf);
      }
      continue;
    }
    const size_t gslot = ((size_t)src_idx * L.S + c) * a.stride + slot;
    int* meta = reinterpret_cast<int*>(base + L.off_meta) + gslot * L.meta_ints;
    if (lane == 0) {
      meta[0] = t;
      meta[1] = nloc;
    }
    if (mine) {
      meta[2 + r] = el;
      meta[2 + L.R + r] = __float_as_int(w);
      meta[2 + 2 * L.R + r] = col;
    }
  }
}

// F_EARLY_LOADS on the sender: what a CTA with few tokens loads at the kernel's start, so that
// these loads, the exchange number's and each other's latencies overlap, instead of the claim
// waiting for the ids and the copy then for the rows.
// kPreVecs (above): 16-byte row vectors per thread: 16 KB per CTA (2 rows at H4096)
// a preloaded CTA never sends its counts ahead (the copy stage below relies on it)
static_assert((int64_t)kPreVecs * kThreads * 16 < kEarlyMinBytes, "preloaded rows go ahead");

struct Preload {
  int4 v[kPreVecs];  // vector tid + j * kThreads of the CTA's rows [lo, hi), flattened
  float s;           // scale tid of those rows (FP8)
  long long e;       // this lane's expert id of the warp's first token (-1 past k)
  float w;           // and its weight
  bool ids;          // e / w hold the warp's first token (lo + warp < hi)
  bool rows;         // v / s hold the CTA's rows (they fit: fewer than kWarps tokens)
  bool lone;         // F_LONE_TOKEN: one token, rows held, units: e / w in every warp
  bool spare0;       // lone, and warp 0 holds none of the row (warps 1.. hold it all)
};

// units: this launch sends flagged units (F_LL_SMALL)
__device__ __forceinline__ void preload_sender(const Layout& L, const DispatchArgs& a,
                                               Preload& p, bool units) {
  p.ids = p.rows = p.lone = p.spare0 = false;
  p.e = -1;
  p.w = 0.f;
  if (!(L.flags & F_EARLY_LOADS) || !a.do_send || !a.real_send) return;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int chunk = fast_div(a.T + L.S - 1, L.div_S);  // the row loads' addresses wait for it
  const int lo = min(a.T, (int)blockIdx.x * chunk), hi = min(a.T, lo + chunk);
  const int ntok = hi - lo, nv = L.row_bytes / 16;
  if (ntok <= 0) return;
  // F_LONE_TOKEN: every warp loads the token's ids, to know the FFN ranks it stores to
  const bool lone = units && ntok == 1 && (L.flags & F_LONE_TOKEN);
  if ((warp < ntok || lone) && lane < L.k) {
    const size_t j = (size_t)(lo + (lone ? 0 : warp)) * L.k + lane;  // lone: every warp, token lo
    p.e = a.ids_64 ? reinterpret_cast<const long long*>(a.expert_ids)[j]
                   : (long long)reinterpret_cast<const int*>(a.expert_ids)[j];
    p.w = a.weights[j];
  }
  p.ids = warp < ntok;
  p.rows = ntok < kWarps && ntok * nv <= kPreVecs * kThreads && ntok * L.scale_cols <= kThreads;
  p.lone = lone && p.rows;
  // a lone token's warp 0 claims it while the other warps store its row (send_lone_token):
  // where the row fits in warps 1.., none of it waits behind the claim
  p.spare0 = p.lone && nv <= kPreVecs * (kThreads - 32) && L.scale_cols <= kThreads - 32;
  if (!p.rows) return;
  const int4* x = reinterpret_cast<const int4*>(static_cast<const char*>(a.x) +
                                                (size_t)lo * L.row_bytes);
  const bool s0 = units && p.spare0;  // (constant false in the forms without units)
  const int first = s0 ? tid - 32 : tid, step = s0 ? kThreads - 32 : kThreads;
  // (s0: warp 0 holds none of the row; testing v >= 0 instead would give its lanes vectors
  // 448-479 again at j = 1, which warps 1.. hold, and it would store them after its claim)
#pragma unroll
  for (int j = 0; j < kPreVecs; ++j) {
    const int v = first + j * step;
    if ((!s0 || first >= 0) && v < ntok * nv) p.v[j] = ld_nc_v4(x + v);
  }
  if (L.scale_cols && (!s0 || first >= 0) && first < ntok * L.scale_cols)
    p.s = a.x_scales[(size_t)lo * L.scale_cols + first];
}

// Copy stage of a preloaded CTA: each thread stores its vectors (and scale) into every slot
// its token claimed. llf != 0 (F_LL_SMALL): into the token's units of each claimed region
// instead, each 16-byte vector as four units and each scale as one, flagged llf.
// kLone (F_LONE_TOKEN): one token, in slot 0 of the FFN ranks in lone_mask, the windows from
// ffn_window (s_slot and fb unused).
template <bool kLone = false>
__device__ void copy_preloaded(const Layout& L, const DispatchArgs& a, char* const* fb, int ntok,
                               const int* s_slot, int src_idx, int c, const Preload& p,
                               uint32_t llf, uint64_t lone_mask = 0) {
  const int nv = L.row_bytes / 16;
  // the vectors and scale this thread holds (preload_sender's mapping)
  const bool spare0 = kLone && p.spare0;
  const int first = spare0 ? (int)threadIdx.x - 32 : threadIdx.x;
  const int step = spare0 ? kThreads - 32 : kThreads;
#pragma unroll
  for (int j = 0; j < kPreVecs; ++j) {
    const int v = first + j * step;
    if ((spare0 && first < 0) || v >= ntok * nv) continue;
    const int i = fast_div(v, L.div_nv), col = v - i * nv;
#pragma unroll 1  // one store per FFN rank; unrolled, this loop was 15 KB of code per call site
    for (int fd = 0; fd < L.F; ++fd) {
      const int slot = kLone ? (((lone_mask >> fd) & 1) ? 0 : -1) : s_slot[i * L.F + fd];
      if (slot < 0) continue;
      char* const b = kLone ? ffn_window(L, fd) : fb[fd];
      if (llf) {
        st_ll_vec(ll_token(L, ll_region(L, b, src_idx, c), slot) + L.meta_ints + 4 * col, p.v[j],
                  llf);
        continue;
      }
      const size_t gslot = ((size_t)src_idx * L.S + c) * a.stride + slot;
      reinterpret_cast<int4*>(b + L.off_payload + gslot * L.row_bytes)[col] = p.v[j];
    }
  }
  if (L.scale_cols && (!spare0 || first >= 0) && first < ntok * L.scale_cols) {
    const int i = fast_div(first, L.div_sc), q = first - i * L.scale_cols;
    for (int fd = 0; fd < L.F; ++fd) {
      const int slot = kLone ? (((lone_mask >> fd) & 1) ? 0 : -1) : s_slot[i * L.F + fd];
      if (slot < 0) continue;
      char* const b = kLone ? ffn_window(L, fd) : fb[fd];
      if (llf) {
        uint64_t* u = ll_token(L, ll_region(L, b, src_idx, c), slot) + L.meta_ints + 4 * nv;
        st_ll(u + q, __float_as_int(p.s), llf);
        continue;
      }
      const size_t gslot = ((size_t)src_idx * L.S + c) * a.stride + slot;
      reinterpret_cast<float*>(b + L.off_scales)[gslot * L.scale_cols + q] = p.s;
    }
  }
}

// Copy vectors [v0, v1) of token t's row (and, with v0 == 0, its scales) into slot `slot` of
// region (src_idx, c) at FFN index fd. One warp.
__device__ __forceinline__ void copy_row(const Layout& L, const DispatchArgs& a, char* const* fb,
                                         int t, int fd, int slot, int src_idx, int c, int v0,
                                         int v1, int lane) {
  char* base = fb[fd];
  const size_t gslot = ((size_t)src_idx * L.S + c) * a.stride + slot;
  const int4* src = reinterpret_cast<const int4*>(static_cast<const char*>(a.x) +
                                                  (size_t)t * L.row_bytes);
  int4* dst = reinterpret_cast<int4*>(base + L.off_payload + gslot * L.row_bytes);
  if (v1 > v0) warp_copy16<false>(dst + v0, src + v0, v1 - v0, lane);
  if (v0 == 0 && L.scale_cols) {
    const float* ss = a.x_scales + (size_t)t * L.scale_cols;
    float* ds = reinterpret_cast<float*>(base + L.off_scales) + gslot * L.scale_cols;
    for (int q = lane; q < L.scale_cols; q += 32) ds[q] = ss[q];
  }
}

// Fused copy stage (many tokens): one warp copies a token's row (nv 16-byte vectors at src)
// and its scale_cols scales into every slot it claimed: slot s_slot[f] of FFN index f, at
// inbox row gslot0 + slot (rows are whole vectors: 16 nv bytes). Out of line, with scalar
// arguments only (a Layout passed by reference would be copied to the stack): the small-T
// claim loop never calls it, and inlined its unrolled copy sat in the middle of that loop.
__device__ __noinline__ void copy_token_rows(char* const* fb, const int* s_slot, int F,
                                             const int4* src, const float* src_scales, int nv,
                                             int scale_cols, int64_t off_payload,
                                             int64_t off_scales, size_t gslot0) {
  const int lane = threadIdx.x & 31;
  // Whole chunks of 8 vectors per lane first, their loads unpredicated: with the predicated
  // form alone ptxas ran out of predicates here and issued the first loads one store at a
  // time (three dependent round trips per chunk), which cost 3-5% at T = 512. The row is
  // loaded once for all F destinations.
  constexpr int U = 8;
  const int nfull = nv / (32 * U) * (32 * U);
  for (int i = lane; i < nfull; i += 32 * U) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = ld_nc_v4(src + i + u * 32);
#pragma unroll 1
    for (int fd = 0; fd < F; ++fd) {
      const int slot = s_slot[fd];
      if (slot < 0) continue;
      int4* dst = reinterpret_cast<int4*>(fb[fd] + off_payload + (gslot0 + slot) * nv * 16);
#pragma unroll
      for (int u = 0; u < U; ++u) dst[i + u * 32] = v[u];
    }
  }
  for (int fd = 0; fd < F; ++fd) {
    const int slot = s_slot[fd];
    if (slot < 0) continue;
    const size_t gslot = gslot0 + slot;
    if (nfull < nv)
      warp_copy16<false>(reinterpret_cast<int4*>(fb[fd] + off_payload + gslot * nv * 16) + nfull,
                         src + nfull, nv - nfull, lane);
    if (scale_cols) {
      float* ds = reinterpret_cast<float*>(fb[fd] + off_scales) + gslot * scale_cols;
      for (int q = lane; q < scale_cols; q += 32) ds[q] = src_scales[q];
    }
  }
}

// Copy stage for few tokens: every (token, destination) row of this CTA, split into chunks so
// one token's row is spread over the whole CTA.
__device__ void copy_tokens(const Layout& L, const DispatchArgs& a, char* const* fb, int lo,
                            int ntok, const int* s_slot, int src_idx, int c) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nv = L.row_bytes / 16;
  const int pairs = ntok * L.F;
  const int lg = chunk_log2_fill(pairs, kWarps / 2, nv);
  const int cv = (nv + (1 << lg) - 1) >> lg;
  for (int u = warp; u < (pairs << lg); u += kWarps) {
    const int pi = u >> lg, h = u & ((1 << lg) - 1);
    const int i = fast_div(pi, L.div_F), fd = pi - i * L.F;
    const int slot = s_slot[i * L.F + fd];
    if (slot < 0) continue;
    copy_row(L, a, fb, lo + i, fd, slot, src_idx, c, h * cv, min(nv, h * cv + cv), lane);
  }
}

// Streamed expansion: one warp per (token, FFN) row, each row followed by its own flag, so the
// FFN expands it without waiting for the rest of the channel. The flag store by lane 0 comes
// after __syncwarp and a system fence, which order the whole warp's row stores before it.
__device__ void copy_rows_flagged(const Layout& L, const DispatchArgs& a, char* const* fb, int lo,
                                  int ntok, const int* s_slot, int src_idx, int c, uint64_t n) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nv = L.row_bytes / 16;
  for (int u = warp; u < ntok * L.F; u += kWarps) {
    const int i = fast_div(u, L.div_F), fd = u - i * L.F;
    const int slot = s_slot[i * L.F + fd];
    if (slot < 0) continue;
    copy_row(L, a, fb, lo + i, fd, slot, src_idx, c, 0, nv, lane);
    __syncwarp();
    if (lane == 0) {
      const size_t gslot = ((size_t)src_idx * L.S + c) * a.stride + slot;
      signal_store_sys(L, reinterpret_cast<uint64_t*>(fb[fd] + L.off_rowflag) + gslot, n);
    }
  }
}

// The sender's bucket from a count word (ahead | bucket << kAheadBits) when it declared one
// that differs from the receiver's (its region is then taken as empty), else 0.
__device__ __forceinline__ int differing_bucket(uint32_t word, int bucket) {
  const int sb = (int)(word >> kAheadBits);
  return sb != 0 && sb != bucket ? sb : 0;
}

// Write this CTA's counts into the count block (rank, c) of each target, then release seq.
// ahead (early counts: the payload follows): kAheadNone, the counts imply the payload;
// kAheadChannel, wait for the region's payload flag; kAheadRows, wait for each row's flag.
// The same word carries the sender's bucket (layout.h kAheadBits; 0: not declared), which
// the FFN compares with its own.
__device__ void publish_counts(const Layout& L, char* const* fb, uint64_t n, bool all_peers,
                               const int* s_cnt, const int* s_ecnt, int ahead, int bucket) {
  const int c = blockIdx.x;
  const int ntg = all_peers ? L.W : L.F;
  const int per = lean_counts(L) ? 1 : L.El + 1;  // lean: the header only
  for (int i = threadIdx.x; i < ntg * per; i += blockDim.x) {
    const int ti = per == 1 ? i : fast_div(i, L.div_El1), e = i - ti * per;
    int d, f;
    if (all_peers) {
      d = ti;
      f = -1;
      for (int q = 0; q < L.F; ++q)
        if (L.rank_of_ffn[q] == d) f = q;
    } else {
      d = L.rank_of_ffn[ti];
      f = ti;
    }
    char* blk = cnt_block(L, all_peers ? peer_base(L, d) : fb[f], L.rank, c);
    int v = 0;
    if (f >= 0) v = (e == 0) ? s_cnt[f] : s_ecnt[(size_t)f * L.El + (e - 1)];
    if (e == 0) {
      *reinterpret_cast<int*>(blk + 8) = v;
      *reinterpret_cast<int*>(blk + 12) = ahead | (bucket << kAheadBits);
    } else
      reinterpret_cast<int*>(blk + 16)[e - 1] = v;
  }
  sys_fence_then_sync(L);
  for (int ti = threadIdx.x; ti < ntg; ti += blockDim.x) {
    char* base = all_peers ? peer_base(L, ti) : fb[ti];
    signal_store_sys(L, reinterpret_cast<uint64_t*>(cnt_block(L, base, L.rank, c)), n);
  }
}

__device__ __forceinline__ int blk_count(const Layout& L, char* mine, int src_rank, int ch) {
  return ld_cg_i32(reinterpret_cast<const int*>(cnt_block(L, mine, src_rank, ch) + 8));
}

// The expert counts of every region (Attention index, channel) into s_tab [nreg][El], as V
// (int4: four counts, or int) with `per` V per region and div by per. In batches: a store
// through the generic s_tab keeps the compiler from issuing a later global load ahead of it,
// so one load and one store per step paid one load latency per step.
template <typename V>
__device__ __forceinline__ void load_count_table(const Layout& L, char* mine, int* s_tab,
                                                 int nreg, int per, const FastDiv& div) {
  constexpr int kBatch = 4;
  const int total = nreg * per;
#pragma unroll 1
  for (int i0 = threadIdx.x; i0 < total; i0 += kBatch * blockDim.x) {
    V v[kBatch];
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = i0 + b * blockDim.x;
      if (i >= total) break;
      const int g = fast_div(i, div), e = i - g * per;
      const int ai = fast_div(g, L.div_S), ch = g - ai * L.S;
      v[b] = __ldcg(reinterpret_cast<const V*>(cnt_block(L, mine, L.rank_of_attn[ai], ch) + 16) +
                    e);
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int i = i0 + b * blockDim.x;
      if (i >= total) break;
      reinterpret_cast<V*>(s_tab)[i] = v[b];  // region g's El ints are its per V
    }
  }
}

// expand's shared-memory ints: s_tab [nreg][El], s_off [El + 1], s_rb [nreg + 1], s_ready,
// s_ahead [nreg], s_maxj [1]
__host__ __device__ __forceinline__ int expand_smem_ints(const Layout& L) {
  const int nreg = L.A * L.S;
  return nreg * L.El + L.El + 3 * nreg + 3;
}

// Each expert's rows in earlier regions: its column of s_tab [nreg][El] (rows per region and
// expert) scanned in place, and its total into s_off[e]. Eight regions' loads in flight at a
// time (one at a time, the store before each next load, the scan was a chain of nreg
// shared-memory latencies).
__device__ __forceinline__ void scan_expert_rows(int* s_tab, int* s_off, int nreg, int El) {
  constexpr int kScanBatch = 8;
  for (int e = threadIdx.x; e < El; e += blockDim.x) {
    int run = 0, g = 0;
#pragma unroll 1  // one batch of code (unrolled twice, 2 KB more on the small-T path)
    for (; g + kScanBatch <= nreg; g += kScanBatch) {
      int v[kScanBatch];
#pragma unroll
      for (int i = 0; i < kScanBatch; ++i) v[i] = s_tab[(g + i) * El + e];
#pragma unroll
      for (int i = 0; i < kScanBatch; ++i) {
        s_tab[(g + i) * El + e] = run;
        run += v[i];
      }
    }
    for (; g < nreg; ++g) {
      const int v = s_tab[g * El + e];
      s_tab[g * El + e] = run;
      run += v;
    }
    s_off[e] = run;
  }
}

// Token q of the expansion, in region g = (Attention index ai, channel ch) at slot j, with
// receipt slot s (its arrival order within its source): false (reported once, by `report`)
// when s is past the bucket (cannot happen with T <= bucket; never written out of bounds)
__device__ __forceinline__ bool locate_token(const Layout& L, const DispatchArgs& a,
                                             const int* s_rb, int q, int g, bool report, int& ai,
                                             int& ch, int& j, int& s) {
  ai = fast_div(g, L.div_S);
  ch = g - ai * L.S;
  j = q - s_rb[g];
  s = q - s_rb[ai * L.S];
  if (s < a.bucket) return true;
  if (report) report_route(L.err, s, 2);
  return false;
}

// Entry r of receipt item `item` (token tok of source rank sr, from region g): its row of the
// expert-major layout, from its local expert el (-1: no entry) and its position pos among the
// region's rows of el; -1 when out of range or past its expert's rows. With `write` (one lane)
// also its receipt (token_rows, token_index) and the row's weight w and source.
__device__ __forceinline__ int entry_row(const Layout& L, const DispatchArgs& a, const int* s_off,
                                         const int* s_tab, int g, int el, int pos, int rows_cap,
                                         size_t item, int r, int tok, float w, int sr,
                                         bool write) {
  int row = -1;
  if (el >= 0 && el < L.El && pos >= 0) {
    row = s_off[el] + s_tab[g * L.El + el] + pos;
    if (row >= s_off[el + 1] || row >= rows_cap) row = -1;
  }
  if (write) {
    a.out_token_rows[item * L.R + r] = row;
    if (r == 0) a.out_token_index[item] = tok;
    if (row >= 0) {
      a.out_weights[row] = w;
      a.out_src_rank[row] = sr;
      a.out_src_token[row] = tok;
    }
  }
  return row;
}

// After the table's scan (s_off: each expert's rows; s_rb: each region's tokens): both turned
// into exclusive prefixes (s_off[El], s_rb[nreg]: the totals), and CTA 0 writes the expert
// offsets and every source's token count. Starts and ends with a barrier.
__device__ __forceinline__ void finish_offsets(const Layout& L, const DispatchArgs& a, int* s_off,
                                               int* s_rb) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nreg = L.A * L.S;
  __syncthreads();
  if (warp == 0) warp_exclusive_scan(s_off, L.El, lane);
  if (warp == 1) warp_exclusive_scan(s_rb, nreg, lane);
  __syncthreads();
  trace_mark(L, kTrReady, -1);
  if (blockIdx.x == 0) {
    const int rows_cap = L.A * a.bucket * L.R;
    for (int e = tid; e <= L.El; e += blockDim.x) a.out_offsets[e] = min(s_off[e], rows_cap);
    for (int ai = tid; ai < L.A; ai += blockDim.x)
      a.out_num_tokens[ai] = min(s_rb[(ai + 1) * L.S] - s_rb[ai * L.S], a.bucket);
  }
}

// Receiver side: expand every arrived token into the expert-major outputs. Rows are placed
// without atomics: row = offset of the expert + rows of that expert in earlier regions (source,
// channel) + the entry's position within its region (from the sender). Work is split into
// (token, local entry, chunk of the row) units over every warp of the grid.
template <int kForm>
__device__ void expand(const Layout& L, const DispatchArgs& a, uint64_t n, uint64_t deadline,
                       int* smem) {
  // the count form's senders hold too few tokens per channel for row flags or counts ahead
  constexpr bool kSmall = kForm != kGeneric;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int c = blockIdx.x;
  char* mine = own_window(L);
  const int nreg = L.A * L.S, El = L.El;
  int* s_tab = smem;                // [nreg][El] rows per (region, expert) -> prefix over regions
  int* s_off = s_tab + nreg * El;   // [El + 1] first row of each expert
  int* s_rb = s_off + El + 1;       // [nreg + 1] first token (receive order) of each region
  int* s_ready = s_rb + nreg + 1;   // [nreg] early counts: region's payload seen complete
  int* s_ahead = s_ready + nreg;     // [nreg] kAhead*: how the region's payload is flagged;
                                     // -1: the sender's bucket differs (region taken empty)
  int* s_maxj = s_ahead + nreg;      // [1] streamed expansion: most tokens in one region
  // The header of region tid for the bucket check below, loaded with the table (their loads
  // in flight together: see load_count_table)
  int h_count = 0, h_word = 0;
  if (tid < nreg) {
    const int ai = fast_div(tid, L.div_S), ch = tid - ai * L.S;
    const int* hdr = reinterpret_cast<const int*>(cnt_block(L, mine, L.rank_of_attn[ai], ch));
    h_count = ld_cg_i32(hdr + 2);
    h_word = ld_cg_i32(hdr + 3);
  }
  if (El % 4 == 0)  // count blocks are 16-byte aligned: four counts per load
    load_count_table<int4>(L, mine, s_tab, nreg, El / 4, L.div_El4);
  else
    load_count_table<int>(L, mine, s_tab, nreg, El, L.div_El);
  // Bucket check (one int per sender CTA): a region whose sender declared another bucket
  // is taken as empty (no rows, no waits, nothing written for it); CTA 0 records it per
  // source for the reply (L.mismatch) and reports it once per source (kRouteBucket).
  // F_LL_EXPERTS: the regions' forms (the receive's waits) behind expand's arrays; a region
  // that came as units declared another bucket (the same bucket gives the same form)
  const int* s_formx = smem + expand_smem_ints(L);
  const bool llx = (kForm == kGeneric || kForm == kCountRecvLL) && L.llx;
  int bad = 0;
  for (int g = tid; g < nreg; g += blockDim.x) {
    const int ai = fast_div(g, L.div_S), ch = g - ai * L.S;
    const int sr = L.rank_of_attn[ai];
    const bool units = llx && s_formx[g];
    const int count = units ? 0 : g == tid ? h_count : blk_count(L, mine, sr, ch);
    const int word = units ? s_formx[2 * nreg + g]
                     : g == tid ? h_word
                                : ld_cg_i32(reinterpret_cast<const int*>(
                                      cnt_block(L, mine, sr, ch) + 12));
    int sb = differing_bucket((uint32_t)word, a.bucket);
    if (units && sb == 0) sb = a.bucket;  // (cannot happen: the same bucket, the same form)
    const bool differs = sb != 0;
    s_rb[g] = differs ? 0 : min(max(count, 0), L.slots);
    s_ready[g] = 0;
    s_ahead[g] = differs ? -1 : (word & kAheadMask);
    bad |= differs ? 1 : 0;
    if (c == 0 && ch == 0) {
      L.mismatch[ai] = differs ? sb : 0;
      if (differs) report_route(L.err, sb, kRouteBucket, sr, a.bucket);
    }
  }
  if (__syncthreads_or(bad)) {  // only on a mismatch: drop the differing regions' counts
    for (int i = tid; i < nreg * El; i += blockDim.x)
      if (s_ahead[fast_div(i, L.div_El)] < 0) s_tab[i] = 0;
    __syncthreads();
  }
  trace_mark(L, kTrTable, -1);
  scan_expert_rows(s_tab, s_off, nreg, El);
  if (!kSmall && L.stream && warp == kWarps - 1) {  // s_rb still holds counts (scan next)
    int m = 0, rows = 0;
    for (int g = lane; g < nreg; g += 32) {
      m = max(m, s_rb[g]);
      rows |= s_ahead[g] == kAheadRows;
    }
    m = __reduce_max_sync(0xffffffffu, m);
    rows = __any_sync(0xffffffffu, rows);
    if (lane == 0) *s_maxj = rows ? m : -1;  // -1: no row flags in this exchange
  }
  finish_offsets(L, a, s_off, s_rb);
  const int rows_cap = L.A * a.bucket * L.R;
  const bool role = (L.flags & F_ROLE_BUFFERS) != 0;
  const int nv = L.row_bytes / 16;
  const int ntok = s_rb[nreg];
  const int items = ntok * L.R;
  const int nw = gridDim.x * kWarps, gw = c * kWarps + warp;
  const int lg = chunk_log2_fill(items, nw, nv);
  const int cv = (nv + (1 << lg) - 1) >> lg;
  int fenced = -1;  // early counts: last region whose payload flag this warp fenced after
  // With row flags, visit (slot, region) slot-major, the order in which rows land (every
  // channel sends its slots in turn); otherwise region-major, without gaps.
  const bool slot_major = !kSmall && L.stream && *s_maxj >= 0;
  const int units = slot_major ? *s_maxj * nreg * L.R : items;
  for (int u = gw; u < (units << lg); u += nw) {
    const int h = u & ((1 << lg) - 1), it = u >> lg;
    const int qr = fast_div(it, L.div_R), r = it - qr * L.R;
    int q, g;
    if (slot_major) {
      const int jr = fast_div(qr, L.div_nreg);
      g = qr - jr * nreg;
      q = s_rb[g] + jr;
      if (q >= s_rb[g + 1]) continue;  // region g holds fewer tokens
    } else {
      q = qr;
      g = upper_index(s_rb, nreg, q);
    }
    int ai, ch, j, s;
    if (!locate_token(L, a, s_rb, q, g, lane == 0 && r == 0 && h == 0, ai, ch, j, s)) continue;
    const int sr = L.rank_of_attn[ai];
    const size_t gslot = ((size_t)(role ? ai : sr) * L.S + ch) * L.slots + j;
    const int v0 = h * cv, v1 = min(nv, v0 + cv);
    const int4* src = reinterpret_cast<const int4*>(mine + L.off_payload + gslot * L.row_bytes);
    const int* ss = reinterpret_cast<const int*>(mine + L.off_scales) + gslot * L.scale_cols;
    // F_EARLY_LOADS, count form (its senders never send ahead: the payload is complete): this
    // lane's first vector of the chunk (and FP8 scale) loads before the metadata that says
    // where it goes, so the copy pays no load latency of its own
    const bool pre = kSmall && (L.flags & F_EARLY_LOADS);
    int4 x0 = make_int4(0, 0, 0, 0);
    int s0 = 0;
    if (pre && v0 + lane < v1) x0 = ld_cg_v4_now(src + v0 + lane);
    if (pre && h == 0 && lane < L.scale_cols) s0 = ld_cg_i32_now(ss + lane);
    const int* meta = reinterpret_cast<const int*>(mine + L.off_meta) + gslot * L.meta_ints;
    const int tok = ld_cg_i32(meta);
    const int nloc = min(max(ld_cg_i32(meta + 1), 0), L.R);
    const size_t item = (size_t)ai * a.bucket + s;
    float w = 0.f;
    int el = -1, pos = -1;
    if (L.flags & F_EARLY_LOADS) {  // the entry's words with the header's, then masked
      el = ld_cg_i32_now(meta + 2 + r);
      pos = ld_cg_i32_now(meta + 2 + 2 * L.R + r);
      w = __int_as_float(ld_cg_i32_now(meta + 2 + L.R + r));
    } else if (r < nloc) {
      el = ld_cg_i32(meta + 2 + r);
      pos = ld_cg_i32(meta + 2 + 2 * L.R + r);
      w = __int_as_float(ld_cg_i32(meta + 2 + L.R + r));
    }
    const int row = entry_row(L, a, s_off, s_tab, g, r < nloc ? el : -1, pos, rows_cap, item, r,
                              tok, w, sr, h == 0 && lane == 0);
    if (row < 0) continue;
    if (!kSmall && L.early && s_ahead[g] == kAheadRows) {  // counts first: wait for the row's flag
      int ok = 1;
      if (lane == 0)
        ok = wait_geq(reinterpret_cast<const uint64_t*>(mine + L.off_rowflag) + gslot, n,
                      deadline, L.err, kPhaseDispatch, sr, L.rank);
      if (!__shfl_sync(0xffffffffu, ok, 0)) return;
      sys_fence_after_wait();
    } else if (!kSmall && L.early && s_ahead[g] == kAheadChannel) {  // the region's payload flag
      int ok = 1;
      if (lane == 0 && !ld_acquire_cta_shared(s_ready + g)) {
        ok = wait_geq(sig_slot(mine, L.off_disp_done, L.W, L.S, sr, ch), n, deadline, L.err,
                      kPhaseDispatch, sr, L.rank);
        if (ok) st_release_cta_shared(s_ready + g, 1);
      }
      if (!__shfl_sync(0xffffffffu, ok, 0)) return;
      if (g != fenced) {  // see sys_fence_after_wait
        sys_fence_after_wait();
        fenced = g;
      }
    }
    int4* dst = reinterpret_cast<int4*>(static_cast<char*>(a.out_x) + (size_t)row * L.row_bytes);
    if (pre) {
      if (v0 + lane < v1) dst[v0 + lane] = x0;
      if (v1 - v0 > 32) warp_copy16<true>(dst + v0 + 32, src + v0 + 32, v1 - v0 - 32, lane);
    } else if (v1 > v0) {
      warp_copy16<true>(dst + v0, src + v0, v1 - v0, lane);
    }
    if (h == 0 && L.scale_cols) {
      float* ds = a.out_scales + (size_t)row * L.scale_cols;
      const int q0 = pre ? lane + 32 : lane;
      if (pre && lane < L.scale_cols) ds[lane] = __int_as_float(s0);
      for (int q2 = q0; q2 < L.scale_cols; q2 += 32) ds[q2] = __int_as_float(ld_cg_i32(ss + q2));
    }
  }
}

// F_LL_SMALL receiver, region g = (Attention index, channel): spin on both forms, its two
// header units (count; ahead | bucket, one 16-byte load) and, while they are stale, its count
// block's flag (polled relaxed, read once more with acquire when it has arrived, so that no
// poll pays the acquire's L1 invalidation; the caller fences once after the wait when any
// region came as a count block).
// Units: s_form[g] = 1, the count in s_form[nreg + g], the ahead | bucket word in
// s_form[2 * nreg + g]. Count block: s_form[g] = 0. Returns the form, or -1 at the deadline
// (reported).
__device__ int wait_region_ll(const Layout& L, char* mine, int g, uint64_t n, uint64_t deadline,
                               int* s_form) {
  const int nreg = L.A * L.S, ai = fast_div(g, L.div_S), ch = g - ai * L.S;
  const int sr = L.rank_of_attn[ai];
  const uint32_t llf = ll_flag(n);
  const uint64_t* u = ll_region(L, mine, ai, ch);
  const uint64_t* flag = reinterpret_cast<const uint64_t*>(cnt_block(L, mine, sr, ch));
  uint32_t spins = 0;
  while (true) {
    uint64_t v0, v1;
    ld_ll2(u, v0, v1);
    if (ll_fresh(v0, llf) && ll_fresh(v1, llf)) {
      s_form[g] = 1;
      s_form[nreg + g] = (int)(uint32_t)v0;
      s_form[2 * nreg + g] = (int)(uint32_t)v1;
      return 1;
    }
    if (ld_ll(flag) >= n && ld_acquire_sys(flag) >= n) {  // acquired as wait_geq does
      s_form[g] = 0;
      return 0;
    }
    if (ll_give_up(spins, deadline, L.err, kPhaseDispatch, sr, L.rank)) return -1;
  }
}

// F_LL_SMALL: the rows (and scales) of the regions that came as flagged units, from their
// units into their inbox slots, where the FFN's view reads them after this kernel. Each row
// is split into chunks over the grid's warps (one token's row would keep one warp busy for
// several load latencies); every vector waits for its own four units.
// kSpread (F_SPREAD_CHUNKS, kSmallRecv's spread instantiation): counted from the grid's end
// warp-major (unit u on warp 15 - u / G of CTA G - 1 - u % G), so that a row's chunks spread
// over up to G SMs instead of sitting on the last CTA's warps (at T = 1 its 16 KB of units)
template <bool kSpread = false>
__device__ void place_rows_ll(const Layout& L, const DispatchArgs& a, uint64_t n,
                              uint64_t deadline, const int* s_cnt, const int* s_form) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  char* mine = own_window(L);
  const int nreg = L.A * L.S, stride = a.stride, rps = L.S * stride, nv = L.row_bytes / 16;
  // warps counted from the grid's end: the first rows' metadata (place_tokens) sits on the
  // first CTAs, so their rows move in parallel with it
  const int rows = stride * nreg, nw = gridDim.x * kWarps;
  const int gw = nw - 1 - grid_warp<kSpread>(warp, kWarps);
  const int lg = chunk_log2(rows, nw, nv), nch = 1 << lg;
  const int cv = (nv + nch - 1) >> lg;
  const uint32_t llf = ll_flag(n);
  for (int u = gw; u < rows * nch; u += nw) {  // no divisions: this runs right after a barrier
    const int h = u & (nch - 1), q = u >> lg, j = fast_div(q, L.div_nreg), g = q - j * nreg;
    if (!s_form[g] || j >= s_cnt[g]) continue;  // s_cnt: 0 where the bucket differs
    const int ai = fast_div(g, L.div_S), ch = g - ai * L.S, sr = L.rank_of_attn[ai];
    const size_t row = (size_t)ai * rps + (size_t)ch * stride + j;  // == its inbox slot
    const uint64_t* ut = ll_token(L, ll_region(L, mine, ai, ch), j) + L.meta_ints;
    int4* dst = reinterpret_cast<int4*>(mine + L.off_payload + row * L.row_bytes);
    bool ok = true;
    for (int v = h * cv + lane; v < min(nv, h * cv + cv) && ok; v += 32) {
      int4 x;
      ok = wait_ll_vec(ut + 4 * v, llf, deadline, L.err, kPhaseDispatch, sr, L.rank, x);
      if (ok) dst[v] = x;
    }
    if (h == 0 && L.scale_cols) {
      float* ds = reinterpret_cast<float*>(mine + L.off_scales) + row * L.scale_cols;
      for (int q2 = lane; q2 < L.scale_cols && ok; q2 += 32) {
        int wd = 0;
        ok = wait_ll(ut + 4 * nv + q2, llf, deadline, L.err, kPhaseDispatch, sr, L.rank, wd);
        if (ok) ds[q2] = __int_as_float(wd);
      }
    }
    if (!__all_sync(kFull, ok)) return;
  }
}

// Token layout, region g = (Attention index, channel) seen (either form): its token count and
// `ahead` word into place_tokens' arrays (smem: s_cnt, s_ready, s_ahead, s_form, each [nreg]).
// Bucket check as in expand: a differing sender's region is taken as empty, CTA 0 records it
// for the reply and reports it once per source.
__device__ void book_region(const Layout& L, const DispatchArgs& a, int g, char* mine, int* smem) {
  const int nreg = L.A * L.S, stride = a.stride;
  const int ai = fast_div(g, L.div_S), ch = g - ai * L.S;
  const int sr = L.rank_of_attn[ai];  // only the count form and the reports use it
  int *s_cnt = smem, *s_ready = s_cnt + nreg, *s_ahead = s_ready + nreg;
  const int* s_form = s_ahead + nreg;
  const bool units = (L.ll || L.llx) && s_form[g];  // (llx: the expert layout's units)
  const int count = units ? s_form[nreg + g] : blk_count(L, mine, sr, ch);
  const int word = units ? s_form[2 * nreg + g]
                         : ld_cg_i32(reinterpret_cast<const int*>(
                               cnt_block(L, mine, sr, ch) + 12));
  const int sb = differing_bucket((uint32_t)word, a.bucket);
  const bool differs = sb != 0;
  // a channel never sends more than ceil(T/S) <= stride tokens; guard the view anyway
  if (!differs && count > stride && blockIdx.x == 0) report_route(L.err, count, kRouteOverflow);
  s_cnt[g] = differs ? 0 : min(max(count, 0), stride);
  s_ready[g] = 0;
  s_ahead[g] = differs ? -1 : (word & kAheadMask);
  if (blockIdx.x == 0 && ch == 0) {
    L.mismatch[ai] = differs ? sb : 0;
    if (differs) report_route(L.err, sb, kRouteBucket, sr, a.bucket);
  }
}

// Token layout: row `row` of the receive holds no token: every id -1, weight 0, source -1.
// One warp.
__device__ __forceinline__ void write_empty_row(const Layout& L, const DispatchArgs& a,
                                                size_t row, int lane) {
  if (lane < L.k) {
    a.out_expert_ids[row * L.k + lane] = -1;
    a.out_weights[row * L.k + lane] = 0.f;
  }
  if (lane == 0) {
    a.out_src_rank[row] = -1;
    a.out_src_token[row] = -1;
  }
}

// Token layout: row `row`'s metadata from one warp's entries (lane < nloc: local id el, weight
// w, the source's column col; col -1: none), the token index tok and source rank sr.
__device__ __forceinline__ void write_row_meta(const Layout& L, const DispatchArgs& a,
                                               size_t row, int sr, int tok, int el, float w,
                                               int col, int warp, int lane) {
  __shared__ int s_cid[kWarps][32];   // a row's local id of each column (per warp)
  __shared__ float s_cw[kWarps][32];  // and its weight
  const int k = L.k;
  // lane q becomes column q: the entry whose column is q (at most one: columns are the
  // first occurrences of distinct ids), else -1 / 0. Scattered through shared memory: a
  // store and a load per lane instead of R rounds of three shuffles.
  s_cid[warp][lane] = -1;
  s_cw[warp][lane] = 0.f;
  __syncwarp();
  if (col >= 0 && col < k) {
    s_cid[warp][col] = el;
    s_cw[warp][col] = w;
  }
  __syncwarp();
  const int id = s_cid[warp][lane];
  const float wq = s_cw[warp][lane];
  __syncwarp();  // read before the warp's next row writes them
  if (lane < k) {
    a.out_expert_ids[row * k + lane] = id;
    a.out_weights[row * k + lane] = wq;
  }
  if (lane == 0) {
    a.out_src_rank[row] = sr;
    a.out_src_token[row] = tok;
  }
}

// F_SETTLE_UNITS (the token layout's receive), load_token_units' wait: the warp polls until
// the header's two units and every entry below the header's count are fresh, each poll
// reloading, at once, every unit still stale. Units that land together are then seen one
// load latency after the last lands, where spinning on each in turn (header, then id, weight,
// column) costs a latency for each one whose first load was stale. Entries from the header's
// count on are never written: they are polled only until the header is seen. uh, ue, uw, uc:
// the units' first loads. Not in the expert layout's receive, where every warp of a token's
// entries and chunks polls the same units: there it was slower (+0.8% at T = 1, +1.5% at
// T = 24; one H100, 3bc31e9).
// stamp (traced only, thread 0's first row): kTrMasked once its first load of the header
// returns, so the trace splits the wait into that load's latency and the polls after it
__device__ __forceinline__ bool settle_token_units(const Layout& L, const uint64_t* u,
                                                   uint32_t llf, uint64_t deadline, int sr,
                                                   uint64_t uh, uint64_t ue, uint64_t uw,
                                                   uint64_t uc, bool stamp, int& tok, int& nloc,
                                                   int& el, int& wi, int& col) {
  const int lane = threadIdx.x & 31;
  int nl = -1;  // the header's entry count, once both its units are fresh
  uint32_t spins = 0;
  if (stamp && uh != kNoUnit) trace_mark(L, kTrMasked, -1);  // (a branch on uh waits for it)
  while (true) {
    const bool hf = lane >= 2 || ll_fresh(uh, llf);
    if (nl < 0) {  // (nl is the warp's: every lane takes this branch alike)
      if (__all_sync(kFull, hf)) nl = min(max(__shfl_sync(kFull, (int)(uint32_t)uh, 1), 0), L.R);
    }
    const bool need = lane < L.R && (nl < 0 || lane < nl);
    const bool ef = !need || (ll_fresh(ue, llf) && ll_fresh(uw, llf) && ll_fresh(uc, llf));
    if (__all_sync(kFull, hf && ef)) break;
    int quit = 0;  // lane 0 counts the spins and reports; every lane gives up with it
    if (lane == 0) quit = ll_give_up(spins, deadline, L.err, kPhaseDispatch, sr, L.rank);
    if (__shfl_sync(kFull, quit, 0)) return false;
    if (!hf) uh = ld_ll(u + lane);
    if (need && !ll_fresh(ue, llf)) ue = ld_ll(u + 2 + lane);
    if (need && !ll_fresh(uw, llf)) uw = ld_ll(u + 2 + L.R + lane);
    if (need && !ll_fresh(uc, llf)) uc = ld_ll(u + 2 + 2 * L.R + lane);
  }
  tok = __shfl_sync(kFull, (int)(uint32_t)uh, 0);
  nloc = nl;
  const bool mine = lane < nl;
  el = mine ? (int)(uint32_t)ue : -1;
  wi = mine ? (int)(uint32_t)uw : 0;
  col = mine ? (int)(uint32_t)uc : -1;
  return true;
}

// Flagged units (F_LL_SMALL, F_LL_EXPERTS), one warp: token u's index and entry count (in
// every lane) and lane r's entry r (its local id, weight bits, and column or position; -1, 0,
// -1 from nloc on), all loaded at once (one latency), then each spun on until fresh. False
// at the deadline (reported), in every lane.
// Each unit is spun on in turn (the header, then each lane's id, weight and column), so a unit
// that landed while an earlier one was spun on costs a load latency all the same (its first
// load was stale). kSettle (F_SETTLE_UNITS): settle_token_units instead. stamp: as
// settle_token_units'.
template <bool kSettle = false>
__device__ __forceinline__ bool load_token_units(const Layout& L, const uint64_t* u, uint32_t llf,
                                                 uint64_t deadline, int sr, int& tok, int& nloc,
                                                 int& el, int& wi, int& col, bool stamp = false) {
  const int lane = threadIdx.x & 31;
  uint64_t uh = 0, ue = 0, uw = 0, uc = 0;
  if (lane < 2) uh = ld_ll(u + lane);
  if (lane < L.R) {  // entries past the header's count are masked below
    ue = ld_ll(u + 2 + lane);
    uw = ld_ll(u + 2 + L.R + lane);
    uc = ld_ll(u + 2 + 2 * L.R + lane);
  }
  if constexpr (kSettle)
    return settle_token_units(L, u, llf, deadline, sr, uh, ue, uw, uc, stamp, tok, nloc, el, wi,
                              col);
  bool ok = true;
  constexpr int ph = kPhaseDispatch;
  if (lane < 2) ok = ll_settle(u + lane, uh, llf, deadline, L.err, ph, sr, L.rank, tok);
  nloc = min(max(__shfl_sync(kFull, tok, 1), 0), L.R);
  tok = __shfl_sync(kFull, tok, 0);
  el = -1;
  wi = 0;
  col = -1;
  if (lane < nloc) {
    ok = ok && ll_settle(u + 2 + lane, ue, llf, deadline, L.err, ph, sr, L.rank, el) &&
         ll_settle(u + 2 + L.R + lane, uw, llf, deadline, L.err, ph, sr, L.rank, wi) &&
         ll_settle(u + 2 + 2 * L.R + lane, uc, llf, deadline, L.err, ph, sr, L.rank, col);
  }
  return __all_sync(kFull, ok);
}

// F_RAW_META (kRawRecv): a lone token's raw metadata units (raw_meta), waited for, as columns:
// lane c's entry is column c's id when it is valid, its first occurrence and on this FFN rank
// (el: its local id, wi: its weight's bits, col = c), else none (el -1, wi 0, col -1). The
// same entries as the sender's claim would have written (claim_token), in column order.
__device__ __forceinline__ bool load_raw_units(const Layout& L, const uint64_t* u, uint32_t llf,
                                               uint64_t deadline, int sr, int& tok, int& el,
                                               int& wi, int& col) {
  const int lane = threadIdx.x & 31;
  constexpr int ph = kPhaseDispatch;
  uint64_t uh = 0, ui = 0, uw = 0;
  if (lane < 2) uh = ld_ll(u + lane);
  if (lane < L.k) {
    ui = ld_ll(u + 2 + lane);
    uw = ld_ll(u + 2 + L.k + lane);
  }
  bool ok = true;
  int hv = 0, id = -1;
  wi = 0;
  if (lane < 2) ok = ll_settle(u + lane, uh, llf, deadline, L.err, ph, sr, L.rank, hv);
  if (lane < L.k)
    ok = ok && ll_settle(u + 2 + lane, ui, llf, deadline, L.err, ph, sr, L.rank, id) &&
         ll_settle(u + 2 + L.k + lane, uw, llf, deadline, L.err, ph, sr, L.rank, wi);
  tok = __shfl_sync(kFull, hv, 0);
  const bool valid = lane < L.k && id >= 0 && id < L.E;
  const int e32 = valid ? id : -2 - lane;  // invalid lanes: distinct negative values
  // every lane matches, the invalid ones too: a full-mask collective behind `valid &&` would
  // run in the valid lanes only, and the warp would wait there for the others forever
  const unsigned same = __match_any_sync(kFull, e32);
  const bool first = valid && (same & lanemask_lt()) == 0;
  const int f = first ? fast_div(e32, L.div_El) : -1;
  const bool mine = first && f == L.my_index;
  el = mine ? e32 - f * L.El : -1;
  col = mine ? lane : -1;
  if (!mine) wi = 0;
  return __all_sync(kFull, ok);
}

// Receiver side of the token layout: the payload already sits where the FFN reads it (the
// inbox slot of token j of region (a, c) is row a * rps + c * stride + j of the [A*rps, H]
// view), so this writes only the metadata of every row and waits until each reported row's
// payload has landed (the caller's MoE reads x right after this kernel). Units are rows,
// slot-major (j, region): the order in which rows land when each row has its own flag.
// booked: every region's arrays are already written (the small receive books each region as
// its wait ends) and published by a barrier.
// kSettle (F_SETTLE_UNITS; kSmallRecv's spread instantiation only): settle_token_units
template <int kForm, bool kSpread = false, bool kSettle = false>
__device__ void place_tokens(const Layout& L, const DispatchArgs& a, uint64_t n, uint64_t deadline,
                             int* smem, bool booked) {
  constexpr bool kSmall = kForm != kGeneric;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int c = blockIdx.x;
  char* mine = own_window(L);
  const int nreg = L.A * L.S, stride = a.stride, rps = L.S * stride;
  int* s_cnt = smem;              // [nreg] tokens of each region (0: none or bucket differs)
  int* s_ready = s_cnt + nreg;    // [nreg] early counts: region's payload seen complete
  int* s_ahead = s_ready + nreg;  // [nreg] kAhead* of the region; -1: the bucket differs
  // F_LL_SMALL: [nreg] 1 where the region came as flagged units, then their counts and
  // ahead | bucket words (wait_region_ll)
  const int* s_form = s_ahead + nreg;
  const uint32_t llf = ll_flag(n);
  if (!booked) {
    for (int g = tid; g < nreg; g += blockDim.x)
      book_region(L, a, g, mine, smem);
    __syncthreads();
  }
  trace_mark(L, kTrReady, -1);
  if (c == 0) {
    for (int ai = tid; ai < L.A; ai += blockDim.x) {
      int sum = 0;
      for (int ch = 0; ch < L.S; ++ch) sum += s_cnt[ai * L.S + ch];
      a.out_num_tokens[ai] = min(sum, a.bucket);
    }
  }
  const int nw = gridDim.x * kWarps, gw = c * kWarps + warp;
  int fenced = -1;  // early counts: last region whose payload flag this warp fenced after
  for (int u = gw; u < stride * nreg; u += nw) {
    const int j = fast_div(u, L.div_nreg), g = u - j * nreg;
    const int ai = fast_div(g, L.div_S), ch = g - ai * L.S;
    const size_t row = (size_t)ai * rps + (size_t)ch * stride + j;  // == its inbox slot
    if (j >= s_cnt[g]) {  // no token in this row
      write_empty_row(L, a, row, lane);
      continue;
    }
    const int sr = L.rank_of_attn[ai];
    const int* meta = reinterpret_cast<const int*>(mine + L.off_meta) + row * L.meta_ints;
    int tok = 0, nloc = 0, el = -1, col = -1;
    float w = 0.f;
    if (L.ll && s_form[g]) {  // flagged units: all loaded at once, then each one waited for
      int wi = 0;
      const uint64_t* ut = ll_token(L, ll_region(L, mine, ai, ch), j);
      // traced only: thread 0's first row (at T = 1 the token's) stamps its metadata units'
      // first load returned (settled units) and the units seen
      const bool traced = L.trace != nullptr && tid == 0 && u == gw;
      // kRawRecv: the region's one token came from a lone sender CTA, with raw metadata
      if (kForm == kRawRecv && s_ahead[g] == kAheadRaw) {
        if (!load_raw_units(L, ut, llf, deadline, sr, tok, el, wi, col)) return;
      } else if (!load_token_units<kSettle>(L, ut, llf, deadline, sr, tok, nloc, el, wi, col,
                                            traced)) {
        return;
      }
      if (traced) trace_mark(L, kTrLoaded, -1);
      w = __int_as_float(wi);
      if (el < 0 || el >= L.El) col = -1;
    } else if (L.flags & F_EARLY_LOADS) {  // every entry's words with the header's, then masked
      tok = ld_cg_i32(meta);
      nloc = min(max(ld_cg_i32(meta + 1), 0), L.R);
      if (lane < L.R) {
        el = ld_cg_i32_now(meta + 2 + lane);
        w = __int_as_float(ld_cg_i32_now(meta + 2 + L.R + lane));
        col = ld_cg_i32_now(meta + 2 + 2 * L.R + lane);
      }
      if (lane >= nloc) el = -1;
      if (el < 0 || el >= L.El) col = -1;
    } else {
      tok = ld_cg_i32(meta);
      nloc = min(max(ld_cg_i32(meta + 1), 0), L.R);
      if (lane < nloc) {
        el = ld_cg_i32(meta + 2 + lane);
        w = __int_as_float(ld_cg_i32(meta + 2 + L.R + lane));
        col = ld_cg_i32(meta + 2 + 2 * L.R + lane);
        if (el < 0 || el >= L.El) col = -1;
      }
    }
    write_row_meta(L, a, row, sr, tok, el, w, col, warp, lane);
    // (a small form's senders never publish counts ahead: their rows are below kEarlyMinBytes)
    if (!kSmall && L.early && s_ahead[g] == kAheadRows) {  // counts first: wait for the row's flag
      int ok = 1;
      if (lane == 0) {
        ok = wait_geq(reinterpret_cast<const uint64_t*>(mine + L.off_rowflag) + row, n, deadline,
                      L.err, kPhaseDispatch, sr, L.rank);
        if (ok) sys_fence_after_wait();  // the row is read by the next kernel
      }
      if (!__shfl_sync(kFull, ok, 0)) return;
    } else if (!kSmall && L.early && s_ahead[g] == kAheadChannel) {  // the region's payload flag
      int ok = 1;
      if (lane == 0 && !ld_acquire_cta_shared(s_ready + g)) {
        ok = wait_geq(sig_slot(mine, L.off_disp_done, L.W, L.S, sr, ch), n, deadline, L.err,
                      kPhaseDispatch, sr, L.rank);
        if (ok) st_release_cta_shared(s_ready + g, 1);
      }
      if (!__shfl_sync(kFull, ok, 0)) return;
      if (g != fenced) {  // see sys_fence_after_wait
        sys_fence_after_wait();
        fenced = g;
      }
    }
  }
  if (kSmall || L.ll) place_rows_ll<kSpread>(L, a, n, deadline, s_cnt, s_form);
}

// F_LONE_EXPAND (expand_units): the row of entry r of the only token that arrived, from the
// token's entries in this warp's lanes (lane r: entry r, as load_token_units gives them), the
// row the count table would give: a valid entry (r < nloc, local id in range, position 0: its
// region's only token) takes the number of distinct valid ids below its own (experts in order,
// one row each; a repeated id shares its first's row), any other -1. With `books` (one warp
// for each slice 0 .. nbook - 1: the warp's index in its CTA, CTA 0's warps; kFan: `slice`,
// one warp a slice on any CTA) the warp also writes the expert offsets of its slice (experts
// 32 * slice + 32 * nbook * i + lane) and, slice 0, the token's receipt (item: its source's
// slot 0) and every source's token count (1 for source ai).
template <bool kFan = false, bool kShuffle = false>
__device__ __forceinline__ int lone_row(const Layout& L, const DispatchArgs& a, int r, int nloc,
                                        int el, int pos, int wi, int tok, int ai, int sr,
                                        size_t item, bool books, int nbook, int slice = 0) {
  const int lane = threadIdx.x & 31, warp = kFan ? slice : (int)(threadIdx.x >> 5);
  const int rows_cap = L.A * a.bucket * L.R;
  const bool valid = lane < nloc && el >= 0 && el < L.El && pos == 0;
  // every lane matches (distinct negative keys where invalid): see load_raw_units
  const int key = valid ? el : -2 - lane;
  bool first;
  int below = 0;  // the distinct valid ids below this lane's
  if (kShuffle) {  // one pass of shuffles: repeats and smaller ids together
    bool rep = false;
    unsigned smaller = 0;
    for (int b = 0; b < L.R; ++b) {  // lanes past R hold no valid entry (nloc <= R)
      const int v = __shfl_sync(kFull, key, b);
      rep = rep || (b < lane && v == key);
      smaller |= (v >= 0 && v < el ? 1u : 0u) << b;  // valid keys are the ids (>= 0)
    }
    first = valid && !rep;
    const unsigned firsts = __ballot_sync(kFull, first);
    below = __popc(smaller & firsts);
  } else {
    const unsigned same = __match_any_sync(kFull, key);
    first = valid && (same & lanemask_lt()) == 0;
  }
  const int fid = first ? el : 0x7fffffff;  // the distinct valid ids, in their first lanes
  if (!kShuffle)
    for (int b = 0; b < L.R; ++b) below += __shfl_sync(kFull, fid, b) < el ? 1 : 0;
  const int row = valid && below < rows_cap ? below : -1;  // this lane's entry's row
  // traced only: a branch on thread 0's row waits for it (taken unless the row is -3), so the
  // stamp splits the lone path into the rows' computation and the offsets' book-keeping
  if (L.trace != nullptr && books && threadIdx.x == 0 && row != -3) trace_mark(L, kTrMasked, -1);
  if (books) {
    for (int e0 = warp * 32; e0 <= L.El; e0 += nbook * 32) {  // rows of the experts below e
      const int e = e0 + lane;
      int at = 0;
      for (int b = 0; b < L.R; ++b) at += __shfl_sync(kFull, fid, b) < e ? 1 : 0;
      if (e <= L.El) a.out_offsets[e] = min(at, rows_cap);
    }
    if (warp == 0) {
      trace_mark(L, kTrReady, -1);
      if (lane < L.R) a.out_token_rows[item * L.R + lane] = row;
      if (lane == 0) a.out_token_index[item] = tok;
      if (first && row >= 0) {
        a.out_weights[row] = __int_as_float(wi);
        a.out_src_rank[row] = sr;
        a.out_src_token[row] = tok;
      }
      for (int x = lane; x < L.A; x += 32) a.out_num_tokens[x] = x == ai ? 1 : 0;
    }
  }
  return __shfl_sync(kFull, row, r);
}

// kUnitExpFan (expand_units<true>), one warp: vectors [v0, v1) of a token's row (its units at
// ur; x0..x3: this lane's first vector's units, loaded with the metadata) into every row that
// a lane's entry took (row >= 0; a repeated row is stored twice, with the same values), and
// with `scales` the row's scales. Lanes step through the chunk together, so that each
// vector's stores can take the rows by shuffles. False at a deadline (reported), in every lane.
__device__ __forceinline__ bool fan_chunk(const Layout& L, const DispatchArgs& a,
                                          const uint64_t* ur, uint64_t x0, uint64_t x1,
                                          uint64_t x2, uint64_t x3, uint32_t llf,
                                          uint64_t deadline, int sr, int row, int v0, int v1,
                                          bool scales) {
  const int lane = threadIdx.x & 31;
  const unsigned rows = __ballot_sync(kFull, row >= 0);
  if (rows == 0) return true;
  const int nv = L.row_bytes / 16;
  char* const out = static_cast<char*>(a.out_x);
  bool got = true;
  for (int w0 = v0; w0 < v1; w0 += 32) {
    const int v = w0 + lane;
    int4 x = make_int4(0, 0, 0, 0);
    if (v < v1 && got) {
      if (w0 == v0 && ll_fresh(x0, llf) && ll_fresh(x1, llf) && ll_fresh(x2, llf) &&
          ll_fresh(x3, llf))
        x = make_int4((int)(uint32_t)x0, (int)(uint32_t)x1, (int)(uint32_t)x2, (int)(uint32_t)x3);
      else
        got = wait_ll_vec(ur + 4 * (size_t)v, llf, deadline, L.err, kPhaseDispatch, sr, L.rank, x);
    }
    for (unsigned m = rows; m != 0; m &= m - 1) {
      const int dr = __shfl_sync(kFull, row, __ffs(m) - 1);
      if (v < v1 && got) reinterpret_cast<int4*>(out + (size_t)dr * L.row_bytes)[v] = x;
    }
  }
  for (int q0 = 0; scales && q0 < L.scale_cols; q0 += 32) {
    const int q = q0 + lane;
    int wd = 0;
    if (q < L.scale_cols && got)
      got = wait_ll(ur + 4 * (size_t)nv + q, llf, deadline, L.err, kPhaseDispatch, sr, L.rank, wd);
    for (unsigned m = rows; m != 0; m &= m - 1) {
      const int dr = __shfl_sync(kFull, row, __ffs(m) - 1);
      if (q < L.scale_cols && got) a.out_scales[(size_t)dr * L.scale_cols + q] = __int_as_float(wd);
    }
  }
  return __all_sync(kFull, got);
}

// F_LL_EXPERTS, the expert layout's receive of flagged units (kUnitExpRecv). Every region is
// booked (s_cnt: its tokens, 0 on a bucket mismatch; s_form: it came as units) and s_tab was
// zeroed before the waits. No per-expert counts travel: an entry's position is its rank among
// its region's entries of that expert (the sender's claim), so a region's rows of an expert
// are its largest position + 1, read from the metadata units. Then as expand: the offsets, the
// receipts, and (token, entry, chunk) units, each copying its chunk of the row from the units
// into the expert-major row as they land. F_LONE_EXPAND: where one token arrived in all, no
// table, no scan and no barrier: each unit's warp works out its row from the token's entries
// (lone_row).
// kFan (kUnitExpFan, F_FANOUT_EXPAND): (token, chunk) units instead, lane r working out entry
// r's row; the warp loads its chunk's units once and stores each vector into every row of the
// token (kUnitExpRecv's warps of a token's R entries each loaded the chunk and the token's
// metadata units again), and the chunks go one warp to a CTA (grid_warp's spread mapping)
template <bool kFan = false, bool kShuffle = false>
__device__ void expand_units(const Layout& L, const DispatchArgs& a, uint64_t n,
                             uint64_t deadline, int* smem) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, c = blockIdx.x;
  char* mine = own_window(L);
  const int nreg = L.A * L.S, El = L.El, stride = a.stride;
  const int* s_cnt = smem;              // [nreg] booked token counts (book_region)
  const int* s_form = smem + 3 * nreg;  // [nreg] 1: the region came as units
  int* s_tab = smem + 6 * nreg;         // [nreg][El] rows per (region, expert) -> prefix
  int* s_off = s_tab + nreg * El;       // [El + 1] first row of each expert
  int* s_rb = s_off + El + 1;           // [nreg + 1] first token (receive order) of each region
  const uint32_t llf = ll_flag(n);
  // (a region that came as a count block is a bucket mismatch, booked empty: every sender of
  // this form declares its bucket, Comm::dispatch)
  for (int g = tid; g < nreg; g += blockDim.x) s_rb[g] = s_form[g] ? s_cnt[g] : 0;
  // F_LONE_EXPAND: lone = the one region that holds a token, when one token arrived in all (a
  // region holds at most stride = 1 token here, kLLXTokens, as book_region clamps its count,
  // so the regions that hold one are the tokens). Each warp reads the booked counts itself, 32
  // regions a step (both words loaded together), and stops at a second token: no barrier in
  // front of the table's pass
  static_assert(kLLXTokens == 1, "lone_row takes position 0 and receipt slot 0");
  int lone = -1;
  if (L.flags & F_LONE_EXPAND) {
    int held = 0, at = -1;
    for (int g0 = 0; g0 < nreg && held <= 1; g0 += 32) {
      const int g = min(g0 + lane, nreg - 1);
      const int form = s_form[g], cnt = s_cnt[g];
      const unsigned b = __ballot_sync(kFull, g0 + lane < nreg && form && cnt > 0);
      if (b && at < 0) at = g0 + __ffs(b) - 1;
      held += __popc(b);
    }
    if (held == 1) lone = at;
  }
  if (lone < 0) {
    bool ok = true;
    for (int q = warp; q < nreg * stride && ok; q += kWarps) {  // slot-major
      const int j = fast_div(q, L.div_nreg), g = q - j * nreg;
      if (!s_form[g] || j >= s_cnt[g]) continue;
      const int ai = fast_div(g, L.div_S), ch = g - ai * L.S;
      int tok, nloc, el, wi, pos;
      ok = load_token_units(L, ll_token(L, ll_region(L, mine, ai, ch), j), llf, deadline,
                            L.rank_of_attn[ai], tok, nloc, el, wi, pos);
      if (ok && lane < nloc && el >= 0 && el < El && pos >= 0 && pos < stride)
        atomicMax(&s_tab[g * El + el], pos + 1);
    }
    if (!__syncthreads_and(ok ? 1 : 0)) return;
    trace_mark(L, kTrTable, -1);
    scan_expert_rows(s_tab, s_off, nreg, El);
    finish_offsets(L, a, s_off, s_rb);
  }
  const int rows_cap = L.A * a.bucket * L.R;
  const int nv = L.row_bytes / 16;
  const int items = (lone >= 0 ? 1 : s_rb[nreg]) * (kFan ? 1 : L.R);
  const int nw = gridDim.x * kWarps, gw = grid_warp<kFan>(warp, kWarps);
  const int lg = chunk_log2_fill(items, nw, nv);
  const int cv = (nv + (1 << lg) - 1) >> lg;
  // lone_row's book-keeping: kUnitExpRecv, CTA 0's warps w = 0 .. nbook - 1 that hold a unit
  // in the first pass (slice w); kFan, every warp that does (gw < nbook: slice gw), its units
  // on as many SMs
  const int nbook = min(items << lg, kFan ? nw : kWarps);
  for (int u = gw; u < (items << lg); u += nw) {
    const int h = u & ((1 << lg) - 1), it = u >> lg;
    const int q = kFan ? it : fast_div(it, L.div_R), r = kFan ? lane : it - q * L.R;
    int g, ai, ch, j, s;
    if (lone >= 0) {  // token 0: its region's slot 0, its source's receipt slot 0
      g = lone;
      ai = fast_div(g, L.div_S);
      ch = g - ai * L.S;
      j = s = 0;
    } else {
      g = upper_index(s_rb, nreg, q);
      if (!locate_token(L, a, s_rb, q, g, lane == 0 && r == 0 && h == 0, ai, ch, j, s)) continue;
    }
    const int sr = L.rank_of_attn[ai];
    const uint64_t* ut = ll_token(L, ll_region(L, mine, ai, ch), j);
    const uint64_t* ur = ut + L.meta_ints;  // the row: four units per 16-byte vector
    const int v0 = h * cv, v1 = min(nv, v0 + cv);
    // this lane's first vector of the chunk loads with the metadata: one latency for both
    uint64_t x0 = 0, x1 = 0, x2 = 0, x3 = 0;
    if (v0 + lane < v1) {
      ld_ll2(ur + 4 * (size_t)(v0 + lane), x0, x1);
      ld_ll2(ur + 4 * (size_t)(v0 + lane) + 2, x2, x3);
    }
    int tok, nloc, el, wi, pos;
    if (!load_token_units(L, ut, llf, deadline, sr, tok, nloc, el, wi, pos)) return;
    // traced only: thread 0's first unit (at T = 1 the token's), its metadata units seen; in
    // the lone path before the offsets, which follow from them
    if (L.trace != nullptr && tid == 0 && u == gw) trace_mark(L, kTrLoaded, -1);
    const size_t item = (size_t)ai * a.bucket + s;
    int row;
    if (lone >= 0) {  // first-pass unit warps (CTA 0's; kFan: all) write the offsets, unit 0
                      // the receipt
      row = lone_row<kFan, kShuffle>(L, a, r, nloc, el, pos, wi, tok, ai, sr, item,
                                     (kFan || c == 0) && u == gw, nbook, gw);  // (first pass)
    } else {
      if (!kFan) {  // entry r: lane r's (kFan: r is this lane)
        el = __shfl_sync(kFull, el, r);
        pos = __shfl_sync(kFull, pos, r);
        wi = __shfl_sync(kFull, wi, r);
      }
      row = entry_row(L, a, s_off, s_tab, g, r < nloc ? el : -1, pos, rows_cap, item, r, tok,
                      __int_as_float(wi), sr, h == 0 && (kFan ? r < L.R : lane == 0));
    }
    if (kFan) {
      if (!fan_chunk(L, a, ur, x0, x1, x2, x3, llf, deadline, sr, row, v0, v1, h == 0))
        return;
      continue;
    }
    if (row < 0) continue;
    int4* dst = reinterpret_cast<int4*>(static_cast<char*>(a.out_x) + (size_t)row * L.row_bytes);
    bool got = true;
    for (int v = v0 + lane; v < v1 && got; v += 32) {
      int4 x;
      if (v == v0 + lane && ll_fresh(x0, llf) && ll_fresh(x1, llf) && ll_fresh(x2, llf) &&
          ll_fresh(x3, llf))
        x = make_int4((int)(uint32_t)x0, (int)(uint32_t)x1, (int)(uint32_t)x2, (int)(uint32_t)x3);
      else
        got = wait_ll_vec(ur + 4 * (size_t)v, llf, deadline, L.err, kPhaseDispatch, sr, L.rank, x);
      if (got) dst[v] = x;
    }
    if (h == 0 && L.scale_cols) {
      float* ds = a.out_scales + (size_t)row * L.scale_cols;
      for (int q2 = lane; q2 < L.scale_cols && got; q2 += 32) {
        int wd = 0;
        got = wait_ll(ur + 4 * (size_t)nv + q2, llf, deadline, L.err, kPhaseDispatch, sr, L.rank,
                      wd);
        if (got) ds[q2] = __int_as_float(wd);
      }
    }
    if (!__all_sync(kFull, got)) return;
  }
}

// The FFN ranks a token reaches: bit f for each FFN index f holding one of its valid ids
// (e: this lane's id, -1 past k). One warp, the same mask in every lane.
__device__ __forceinline__ uint64_t token_ffn_mask(const Layout& L, long long e) {
  const int lane = threadIdx.x & 31;
  const bool valid = lane < L.k && e >= 0 && e < L.E;
  const int f = valid ? fast_div((int)e, L.div_El) : -1;
  return ffn_bits(valid, f);
}

// F_RAW_META: warp 0 of a lone token's CTA stores the token's raw metadata units (raw_meta)
// into slot 0 of its region at every FFN rank in fmask, from the ids and weights it preloaded
// (e, w: this lane's; -1 / 0 past k). Unlike the claim, it matches no duplicate and computes no
// rank's entries first (the receiver does, load_raw_units); only the mask of FFN ranks (one
// division and two reductions, token_ffn_mask) comes before these stores.
__device__ __forceinline__ void store_raw_meta(const Layout& L, int t, int src_idx, int c,
                                               long long e, float w, uint64_t fmask,
                                               uint32_t llf) {
  const int lane = threadIdx.x & 31;
  const int id = lane < L.k && e >= 0 && e < L.E ? (int)e : -1;
#pragma unroll 1
  for (uint64_t m = fmask; m != 0; m &= m - 1) {
    uint64_t* u = ll_token(L, ll_region(L, ffn_window(L, __ffsll((long long)m) - 1), src_idx, c),
                           0);
    if (lane == 0) {
      st_ll(u, t, llf);
      st_ll(u + 1, L.k, llf);
    }
    if (lane < L.k) {
      st_ll(u + 2 + lane, id, llf);
      st_ll(u + 2 + L.k + lane, __float_as_int(w), llf);
    }
  }
}

// F_LONE_TOKEN: the send stage of a CTA holding one token on the flagged-unit path (pre.lone:
// count-first, fused, streamed and early-count copies are all off there). The token's slot is
// 0 in every region it reaches, and which FFN ranks it reaches follows from its ids, which
// every warp holds. So warp 0 claims it (route, id checks, metadata units) while the other
// warps store the region's count units and the row's units: no shared-memory claim and no
// barrier between the claim and the copy. Every unit carries its flag: any order will do.
// The FFN windows come from ffn_window, not the kernel's shared table: nothing here waits at a
// barrier behind the table's writes.
// kRaw (kRawSend, F_RAW_META): warp 0 stores the token's raw metadata units (raw_meta) once it
// has the FFN-rank mask, then its row vectors (none where the row fits in warps 1..,
// Preload::spare0), and only then the rest of the claim (route, id
// reports), which no FFN rank waits for: each derives its columns from the raw ids
// (load_raw_units)
template <bool kRaw = false, bool kShuffle = false>
__device__ void send_lone_token(const Layout& L, const DispatchArgs& a, uint64_t n,
                                const Preload& pre) {
  const int c = blockIdx.x, tid = threadIdx.x, warp = tid >> 5;
  const int T = a.T, chunk = fast_div(T + L.S - 1, L.div_S), t = c * chunk;  // lo; hi = t + 1
  const uint32_t llf = ll_flag(n);
  const int src_idx = L.my_index;  // the token layout's regions: by Attention index
  if (!kRaw && warp == 0) {
    claim_token<true, kShuffle>(L, a, nullptr, t, 0, false, nullptr, nullptr, nullptr, src_idx,
                                c, true, pre.e, pre.w, llf);
    trace_mark(L, kTrClaimed, -1);
    // Preload::spare0: warps 1.. store the region counts and the whole row, so warp 0 is done
    // (its mask's reductions and the copy's loops put about 0.45 us between its claim and
    // CTA 0's end at T = 1)
    if (pre.spare0) {
      trace_mark(L, kTrCopied, -1);
      trace_mark(L, kTrSent, kTrMaxSent);
      return;
    }
  }
  const uint64_t fmask = token_ffn_mask(L, pre.e);
  if (kRaw && warp == 0) store_raw_meta(L, t, src_idx, c, pre.e, pre.w, fmask, llf);
  for (int fd = tid - 32; fd < L.F; fd += blockDim.x)  // warp 0 claims meanwhile
    if (fd >= 0)
      st_ll2(ll_region(L, ffn_window(L, fd), src_idx, c), (int)((fmask >> fd) & 1),
             (kRaw ? kAheadRaw : kAheadNone) | (a.bucket << kAheadBits), llf);
  copy_preloaded<true>(L, a, nullptr, 1, nullptr, src_idx, c, pre, llf, fmask);
  if (kRaw && warp == 0) {  // the route: the same FFN ranks as the claim's (fmask)
    if (threadIdx.x < L.k && (pre.e < -1 || pre.e >= L.E)) report_route(L.err, pre.e, 0);
    if (threadIdx.x == 0) a.route[t] = (int64_t)fmask;
    trace_mark(L, kTrClaimed, -1);
  }
  trace_mark(L, kTrCopied, -1);
  trace_mark(L, kTrSent, kTrMaxSent);
}

// kForm (KernelForm, afdep/forms.h): kGeneric runs every path; the small forms (see
// dispatch_form) only one role's path at few tokens per channel, so that their code is compact
// kSpread (F_SPREAD_CHUNKS; kSmallRecv and kRawRecv only, instantiations of their own):
// place_rows_ll's chunks warp-major
// kShuffle (F_SHUFFLE_MATCH; kSmallSend, kUnitExpRecv and kUnitExpFan only, instantiations of
// their own, so that no other form carries its code): repeated ids by shuffles
// kSettle (F_SETTLE_UNITS; kSmallRecv with kSpread only, the token layout): a token's metadata
// units polled together (settle_token_units)
template <int kForm, bool kSpread = false, bool kShuffle = false, bool kSettle = false>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(Layout L, DispatchArgs a) {
  constexpr bool kSmall = kForm != kGeneric;
  constexpr bool kUnits = form_units(kForm);
  constexpr bool kSendOnly = form_send_only(kForm), kRecvOnly = form_recv_only(kForm);
  extern __shared__ __align__(16) int smem[];
  pdl_wait(L);
  // the exchange number first: the flagged units and the trace's "loaded" test wait for it,
  // and issued behind the preload's address arithmetic it came back last
  const uint64_t n = launch_number(L, kPhaseDispatch);
  trace_begin(L);
  // the start stamp before the first loads: a stamp behind the first store of a loaded value
  // (the FFN bases into shared memory) waited for that load, and the stages missed its latency
  trace_mark(L, kTrStart, kTrMaxStart);
  // the next kernel (the Attention's combine; on the FFN its CTAs find no free SM until ours
  // end) may take the SMs this grid leaves idle and wait there in pdl_wait. Not when every
  // rank waits for every other inside this kernel: on a GPU that ranks share, those parked
  // CTAs could keep another rank's dispatch off the SMs it needs to finish (2A2F and 3A1F on
  // one H200 under MPS timed out); the combine then launches as this grid ends.
  if (kSmall || (L.flags & kDirectional) == kDirectional) pdl_launch_dependents(L);
  Preload pre;  // (F_LONE_TOKEN: the small send form only, kept out of the generic kernel)
  if (!kRecvOnly) preload_sender(L, a, pre, kUnits);
  const int c = blockIdx.x, tid = threadIdx.x, warp = tid >> 5;
  const uint32_t fl = L.flags;
  // window base of every FFN rank, loaded once (in the shadow of the exchange number's load)
  // instead of two dependent global loads in front of every remote store
  __shared__ char* s_fb[kMaxFfn];
  for (int i = tid; !kRecvOnly && i < L.F; i += blockDim.x)
    s_fb[i] = ffn_window(L, i);
  const uint64_t deadline = global_timer_ns() + L.timeout_ns;
  // the small forms run only with the four directional controls on (dispatch_form and
  // combine_form check them)
  const bool all_peers = !kSmall && (!(fl & F_ROLE_WARPS) || !(fl & F_ONE_WAY_COUNTS));
  const bool count_first = !kSmall && !(fl & F_ONE_WAY_COUNTS);
  const bool rwo = kSmall || (fl & F_RECEIVER_WAIT_ONLY) != 0;
  char* mine = own_window(L);
  // traced only: a branch on thread 0's loaded values waits for them, so this stamp splits
  // the claim stage into the loads' latency and the claim's own work (n >= 1: always taken)
  if (L.trace != nullptr && tid == 0 && !kRecvOnly && a.do_send &&
      (n | (uint64_t)(pre.e + 2)) != 0)
    trace_mark(L, kTrLoaded, -1);
  if (!kSmall && (L.debug & kDbgPrint) && tid == 0 && c == 0)
    printf("afdep-dbg t %llu rank %d %s n %llu T %d\n", (unsigned long long)global_timer_ns(),
           L.rank, a.real_send ? "dispatch" : "receive", (unsigned long long)n, a.T);

  if (!kSmall && !(fl & F_NO_ENTRY_BARRIER)) {
    if (!entry_barrier(L, kPhaseDispatch, n, deadline, L.err)) return;
  }

  if (kUnits && !kRecvOnly && a.do_send && pre.lone) {
    send_lone_token<kForm == kRawSend, kShuffle>(L, a, n, pre);
  } else if (!kRecvOnly && a.do_send) {
    int* s_cnt = smem;                 // [F] slots claimed per destination FFN
    int* s_ecnt = smem + L.F;          // [E] entries per global expert (positions)
    int* s_slot = s_ecnt + L.E;        // [ceil(T/S)][F] claimed slot per (token, FFN) or -1
    const int T = a.real_send ? a.T : 0;
    const int chunk = fast_div(T + L.S - 1, L.div_S);
    const int lo = min(T, c * chunk), hi = min(T, lo + chunk);
    // the token layout indexes its inbox by Attention index in the union layout too (the
    // FFN's view is [A][S][stride] rows; union dummy senders send no rows)
    const int src_idx = ((fl & F_ROLE_BUFFERS) || L.tokens) ? L.my_index : L.rank;
    const int send_bucket = a.real_send ? a.bucket : 0;  // dummy senders declare none
    for (int i = tid; i < L.F + L.E; i += blockDim.x) smem[i] = 0;
    __syncthreads();
    if (count_first) {
      for (int t = lo + warp; t < hi; t += kWarps)
        claim_token(L, a, s_fb, t, t - lo, true, s_cnt, s_ecnt, s_slot, src_idx, c,
                    pre.ids && t == lo + warp, pre.e, pre.w, 0u);
      __syncthreads();
      publish_counts(L, s_fb, n, true, s_cnt, s_ecnt, kAheadNone, send_bucket);
      // everyone spins until every rank's counts arrived
      bool ok = true;
      for (int i = tid; i < L.W * L.S && ok; i += blockDim.x)
        ok = wait_geq(reinterpret_cast<const uint64_t*>(cnt_block(L, mine, i / L.S, i % L.S)), n,
                      deadline, L.err, kPhaseDispatch, i / L.S, L.rank);
      if (!__syncthreads_and(ok ? 1 : 0)) return;
      // the real pass claims again (same totals), now recording slots and positions
      for (int i = tid; i < L.F + L.E; i += blockDim.x) smem[i] = 0;
      __syncthreads();
    }
    // Many tokens: each warp copies its token right after claiming it (copies overlap the
    // other warps' claims). Few tokens: claim all, then spread the rows over every warp; with
    // early counts the counts go out between the two, so the receiver computes its offsets
    // while the payload is in flight, and a per-channel flag marks the payload complete.
    // Streamed expansion: CTAs with many tokens claim them all first (counts ahead, then
    // flagged rows); few tokens gain nothing from row flags (a fence per row).
    const bool stream = !kSmall && L.stream && hi - lo >= kStreamMinTokens;
    const bool fused = !kSmall && hi - lo >= kWarps && !stream;
    const int nv = L.row_bytes / 16;
    // F_LL_SMALL: metadata, rows (from the early loads' registers: ll_exchange admits only
    // channels that preload_sender loads whole) and the count go out as flagged units
    const uint32_t llf = kUnits ? ll_flag(n)
                         : (!kSmall && a.real_send && ll_exchange(L, a)) ? ll_flag(n) : 0u;
    for (int t = lo + warp; t < hi; t += kWarps) {
      claim_token<false, kShuffle>(L, a, s_fb, t, t - lo, false, s_cnt, s_ecnt, s_slot,
                                   src_idx, c, pre.ids && t == lo + warp, pre.e, pre.w, llf);
      if (!fused) continue;
      __syncwarp();
      copy_token_rows(s_fb, s_slot + (t - lo) * L.F, L.F,
                      reinterpret_cast<const int4*>(static_cast<const char*>(a.x) +
                                                    (size_t)t * L.row_bytes),
                      L.scale_cols ? a.x_scales + (size_t)t * L.scale_cols : nullptr, nv,
                      L.scale_cols, L.off_payload, L.off_scales,
                      ((size_t)src_idx * L.S + c) * a.stride);
    }
    if (fused) sys_fence_then_sync(L); else __syncthreads();
    trace_mark(L, kTrClaimed, -1);
    // Counts ahead only when this CTA's payload is worth overlapping (kEarlyMinBytes); the
    // receiver reads the choice from the count block's `ahead` word.
    const bool ahead = !kSmall && L.early && !fused && !llf &&
                       (int64_t)(hi - lo) * L.row_bytes >= kEarlyMinBytes;
    const bool row_flags = ahead && stream;  // else one payload flag per channel
    if (ahead)  // metadata fenced inside
      publish_counts(L, s_fb, n, false, s_cnt, s_ecnt, row_flags ? kAheadRows : kAheadChannel,
                     send_bucket);
    if (row_flags) {
      copy_rows_flagged(L, a, s_fb, lo, hi - lo, s_slot, src_idx, c, n);
      __syncthreads();
    } else if (!fused) {  // (a preloaded CTA is never fused, streamed or ahead: too few bytes)
      if (kUnits || llf) {  // no fence: each unit carries its own flag
        if (pre.rows) copy_preloaded(L, a, s_fb, hi - lo, s_slot, src_idx, c, pre, llf);
        for (int fd = tid; fd < L.F; fd += blockDim.x)
          st_ll2(ll_region(L, s_fb[fd], src_idx, c), s_cnt[fd],
                 kAheadNone | (send_bucket << kAheadBits), llf);
      } else {
        if (pre.rows) copy_preloaded(L, a, s_fb, hi - lo, s_slot, src_idx, c, pre, 0u);
        else copy_tokens(L, a, s_fb, lo, hi - lo, s_slot, src_idx, c);
        sys_fence_then_sync(L);
      }
    }
    trace_mark(L, kTrCopied, -1);
    if (!kUnits && !count_first && !ahead && !llf)  // (ll_flag is never 0)
      publish_counts(L, s_fb, n, all_peers, s_cnt, s_ecnt, kAheadNone, send_bucket);
    if (ahead && !row_flags) {
      for (int ti = tid; ti < L.F; ti += blockDim.x)
        signal_store_sys(L, sig_slot(s_fb[ti], L.off_disp_done, L.W, L.S, L.rank, c), n);
    } else if (count_first && rwo) {
      for (int d = tid; d < L.W; d += blockDim.x)
        signal_store_sys(L, sig_slot(peer_base(L, d), L.off_disp_done, L.W, L.S, L.rank, c), n);
    }
    trace_mark(L, kTrSent, kTrMaxSent);
  }

  if (!rwo) {
    if (!exit_barrier(L, kPhaseDispatch, n, deadline, L.err)) return;
  }

  if (!kSendOnly && a.do_recv) {
    const int nsrc = all_peers ? L.W : L.A;
    bool ok = true;
    int fence = 1;
    bool booked = false;
    if (kUnits) {
      // F_LL_SMALL, small form: each thread books its regions as their waits end, and one
      // barrier publishes them; only a count-block region (a bucket mismatch) or a timeout
      // takes the second path: the fence, then those regions' counts
      int* s_form = smem + 3 * L.A * L.S;  // place_tokens' arrays come first
      int st = 0;                          // bit 0: timed out, bit 1: a count block came
      if (form_unit_exp(kForm))  // expand_units' rows per (region, expert), zeroed meanwhile
        for (int i = tid; i < L.A * L.S * L.El; i += blockDim.x) smem[6 * L.A * L.S + i] = 0;
      for (int i = tid; i < L.A * L.S && !(st & 1); i += blockDim.x) {
        const int form = wait_region_ll(L, mine, i, n, deadline, s_form);
        if (form == 1) book_region(L, a, i, mine, smem);
        st |= form < 0 ? 1 : form == 0 ? 2 : 0;
      }
      if (__syncthreads_or(st)) {
        if (__syncthreads_or(st & 1)) return;
        sys_fence_after_wait();
        for (int i = tid; i < L.A * L.S; i += blockDim.x)
          if (!s_form[i]) book_region(L, a, i, mine, smem);
        __syncthreads();
      }
      booked = true;
      fence = 0;
    } else if (!kSmall && L.ll && a.real_recv) {  // F_LL_SMALL: either form (ll_exchange)
      fence = 0;
      int* s_form = smem + 3 * L.A * L.S;  // place_tokens' arrays come first
      for (int i = tid; i < L.A * L.S && ok; i += blockDim.x) {
        const int form = wait_region_ll(L, mine, i, n, deadline, s_form);
        ok = form >= 0;
        fence |= form == 0 ? 1 : 0;
      }
      if (!__syncthreads_and(ok ? 1 : 0)) return;
      fence = __syncthreads_or(fence);
    } else if ((kForm == kGeneric || kForm == kCountRecvLL) && L.llx && a.real_recv) {
      // F_LL_EXPERTS, the count form: a sender whose bucket differs may come as units, so every
      // region is awaited in either form (the forms behind expand's arrays), and expand takes
      // one that came as units as a bucket mismatch (kCountRecv keeps its code without this)
      int* s_formx = smem + expand_smem_ints(L);
      for (int i = tid; i < L.A * L.S && ok; i += blockDim.x)
        ok = wait_region_ll(L, mine, i, n, deadline, s_formx) >= 0;
      if (!__syncthreads_and(ok ? 1 : 0)) return;
    } else {
      for (int i = tid; i < nsrc * L.S && ok; i += blockDim.x) {
        const int ai = fast_div(i, L.div_S), ch = i - ai * L.S;
        const int sr = all_peers ? ai : L.rank_of_attn[ai];
        ok = wait_geq(reinterpret_cast<const uint64_t*>(cnt_block(L, mine, sr, ch)), n,
                      deadline, L.err, kPhaseDispatch, sr, L.rank);
        if (ok && count_first && rwo)
          ok = wait_geq(sig_slot(mine, L.off_disp_done, L.W, L.S, sr, ch), n, deadline, L.err,
                        kPhaseDispatch, sr, L.rank);
      }
      if (!__syncthreads_and(ok ? 1 : 0)) return;
    }
    // counts (and, unless early, payloads) seen: read them (flagged units need no fence)
    if (fence) sys_fence_after_wait();
    trace_mark(L, kTrWaited, kTrMaxWaited);
    if (kSmall || a.real_recv) {
      if (form_unit_exp(kForm))
        expand_units<kForm == kUnitExpFan, kShuffle>(L, a, n, deadline, smem);
      else if (kUnits || (!kSmall && L.tokens))
        place_tokens<kForm, kSpread, kSettle>(L, a, n, deadline, smem, booked);
      else expand<kForm>(L, a, n, deadline, smem);
    }
  }

  // A warp whose wait timed out returns from its row loop's helper and arrives here early:
  // no other barrier may follow those loops, or it would meet this one with the wrong warps
  __syncthreads();
  trace_mark(L, kTrEnd, kTrMaxEnd);
  trace_flush(L, kPhaseDispatch, n);
  end_launch(L, kPhaseDispatch, n);
}

}  // namespace

size_t dispatch_smem_bytes(const Layout& L) {
  const size_t send = ((size_t)L.F + L.E + (size_t)L.slots * L.F) * 4;
  const size_t nreg = (size_t)L.A * L.S;
  size_t recv = (nreg * L.El + L.El + 1 + 3 * nreg + 2) * 4;
  if (L.ll && recv < 6 * nreg * 4) recv = 6 * nreg * 4;  // place_tokens' arrays + s_form
  // F_LL_EXPERTS: the booked arrays, then expand_units' table, offsets and region starts
  // and the count form's expand (the regions' forms behind its arrays)
  const size_t units = (6 * nreg + nreg * L.El + L.El + 1 + nreg + 1) * 4;
  const size_t count = ((size_t)expand_smem_ints(L) + 3 * nreg) * 4;
  if (L.llx && recv < units) recv = units;
  if (L.llx && recv < count) recv = count;
  return send > recv ? send : recv;
}

int dispatch_stride(const Layout& L, int bucket) {
  const int per = (bucket + L.S - 1) / L.S;
  if (L.tokens) return per;
  DispatchArgs a{};
  a.stride = per;
  return bucket >= 1 && llx_exchange(L, a) ? per : L.slots;
}

// The form a launch runs (F_SMALL_KERNELS), in one role only and with the four directional
// controls: the flagged-unit path (L.ll: token layout, early loads), or the expert layout's
// count-block path at few tokens per channel; else the generic kernel (also for debug output).
int dispatch_form(const Layout& L, const DispatchArgs& a) {
  const bool send = a.do_send && a.real_send && !a.do_recv;
  const bool recv = a.do_recv && a.real_recv && !a.do_send;
  // F_LL_EXPERTS (its needs hold F_SMALL_KERNELS and the directional controls): only these
  // forms hold the expert layout's units, so they run with debug output on too
  // (a launch of both roles, the last case, cannot occur with the directional controls)
  // (F_FANOUT_EXPAND: kUnitExpFan instead of kUnitExpRecv)
  if (L.llx && llx_exchange(L, a))
    return send ? kSmallSend
           : recv ? ((L.flags & F_FANOUT_EXPAND) ? kUnitExpFan : kUnitExpRecv)
                  : kGeneric;
  // F_RAW_META (its needs hold F_SMALL_KERNELS and the directional controls): only these forms
  // know the raw metadata, so, as above, they run with debug output on too
  if (L.ll && raw_meta(L) && ll_exchange(L, a))
    return send ? kRawSend : recv ? kRawRecv : kGeneric;
  if (!(L.flags & F_SMALL_KERNELS) || L.debug || (L.flags & kDirectional) != kDirectional)
    return kGeneric;
  if (L.ll) {
    if (!ll_exchange(L, a)) return kGeneric;
    if (send) return kSmallSend;
    return recv ? kSmallRecv : kGeneric;
  }
  if (L.tokens) return kGeneric;
  // expert layout: the most tokens a channel of this exchange holds (a sender's own T; a
  // receiver's senders have at most its bucket), below the fused copy, the row flags and the
  // counts ahead (a mismatched sender's region is taken as empty, whatever it sent)
  const int per = send ? (a.T + L.S - 1) / L.S : (a.bucket + L.S - 1) / L.S;
  if (per >= kWarps || (L.early && (int64_t)per * L.row_bytes >= kEarlyMinBytes)) return kGeneric;
  return send ? kCountSend : recv ? (L.llx ? kCountRecvLL : kCountRecv) : kGeneric;
}

cudaError_t dispatch_prepare(const Layout& L) {
  // Without the attribute a block's dynamic and static shared memory together must fit 48 KB,
  // and the instantiations' static arrays take up to 5.8 KB (cuobjdump --dump-resource-usage):
  // below the margin nothing is set, so no kernel is loaded before its first launch
  constexpr size_t kStaticMargin = 8 * 1024;
  const size_t smem = dispatch_smem_bytes(L);
  if (smem + kStaticMargin <= 48 * 1024) return cudaSuccess;
  const auto attr = cudaFuncAttributeMaxDynamicSharedMemorySize;
  cudaError_t e = cudaFuncSetAttribute(dispatch_kernel<kGeneric>, attr, (int)smem);
  if (e == cudaSuccess) e = cudaFuncSetAttribute(dispatch_kernel<kSmallSend>, attr, (int)smem);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(dispatch_kernel<kSmallSend, false, true>, attr, (int)smem);
  if (e == cudaSuccess) e = cudaFuncSetAttribute(dispatch_kernel<kRawSend>, attr, (int)smem);
  if (e == cudaSuccess) e = cudaFuncSetAttribute(dispatch_kernel<kRawRecv>, attr, (int)smem);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(dispatch_kernel<kRawRecv, true>, attr, (int)smem);
  if (e == cudaSuccess) e = cudaFuncSetAttribute(dispatch_kernel<kSmallRecv>, attr, (int)smem);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(dispatch_kernel<kSmallRecv, true>, attr, (int)smem);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(dispatch_kernel<kSmallRecv, true, false, true>, attr, (int)smem);
  if (e == cudaSuccess) e = cudaFuncSetAttribute(dispatch_kernel<kCountSend>, attr, (int)smem);
  if (e == cudaSuccess) e = cudaFuncSetAttribute(dispatch_kernel<kCountRecv>, attr, (int)smem);
  if (e == cudaSuccess) e = cudaFuncSetAttribute(dispatch_kernel<kUnitExpRecv>, attr, (int)smem);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(dispatch_kernel<kUnitExpRecv, false, true>, attr, (int)smem);
  if (e == cudaSuccess) e = cudaFuncSetAttribute(dispatch_kernel<kUnitExpFan>, attr, (int)smem);
  if (e == cudaSuccess)
    e = cudaFuncSetAttribute(dispatch_kernel<kUnitExpFan, false, true>, attr, (int)smem);
  if (e == cudaSuccess) e = cudaFuncSetAttribute(dispatch_kernel<kCountRecvLL>, attr, (int)smem);
  return e;
}

// F_SPREAD_CHUNKS: a receive form that places rows from their units, in its spread
// instantiation (place_rows_ll's chunks warp-major)
// (F_SETTLE_UNITS: kSmallRecv's spread instantiation with settled metadata units)
template <int kForm>
cudaError_t launch_spreadable(const Layout& L, const DispatchArgs& a, int grid, size_t smem,
                              cudaStream_t stream) {
  if (kForm == kSmallRecv && (L.flags & F_SPREAD_CHUNKS) && (L.flags & F_SETTLE_UNITS))
    return launch_transport_kernel(dispatch_kernel<kSmallRecv, true, false, true>, L, a, grid,
                                   smem, stream);
  return (L.flags & F_SPREAD_CHUNKS)
             ? launch_transport_kernel(dispatch_kernel<kForm, true>, L, a, grid, smem, stream)
             : launch_transport_kernel(dispatch_kernel<kForm>, L, a, grid, smem, stream);
}

// F_SHUFFLE_MATCH: a form that finds repeated ids, in its shuffle instantiation
template <int kForm>
cudaError_t launch_shuffling(const Layout& L, const DispatchArgs& a, int grid, size_t smem,
                             cudaStream_t stream) {
  if (L.flags & F_SHUFFLE_MATCH)
    return launch_transport_kernel(dispatch_kernel<kForm, false, true>, L, a, grid, smem, stream);
  return launch_transport_kernel(dispatch_kernel<kForm>, L, a, grid, smem, stream);
}

cudaError_t launch_dispatch(const Layout& L, const DispatchArgs& a, int grid, cudaStream_t stream,
                            int* form) {
  const size_t smem = dispatch_smem_bytes(L);
  const int f = dispatch_form(L, a);
  if (form != nullptr) *form = f;
  switch (f) {
    case kSmallSend:
      return launch_shuffling<kSmallSend>(L, a, grid, smem, stream);
    case kRawSend:
      return launch_transport_kernel(dispatch_kernel<kRawSend>, L, a, grid, smem, stream);
    case kRawRecv:
      return launch_spreadable<kRawRecv>(L, a, grid, smem, stream);
    case kSmallRecv:
      return launch_spreadable<kSmallRecv>(L, a, grid, smem, stream);
    case kCountSend:
      return launch_transport_kernel(dispatch_kernel<kCountSend>, L, a, grid, smem, stream);
    case kCountRecv:
      return launch_transport_kernel(dispatch_kernel<kCountRecv>, L, a, grid, smem, stream);
    case kUnitExpRecv:
      return launch_shuffling<kUnitExpRecv>(L, a, grid, smem, stream);
    case kUnitExpFan:
      return launch_shuffling<kUnitExpFan>(L, a, grid, smem, stream);
    case kCountRecvLL:
      return launch_transport_kernel(dispatch_kernel<kCountRecvLL>, L, a, grid, smem, stream);
    default:
      return launch_transport_kernel(dispatch_kernel<kGeneric>, L, a, grid, smem, stream);
  }
}

}  // namespace afdep
