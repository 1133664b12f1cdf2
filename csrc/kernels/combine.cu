// This kernel serves both the FFN's reply (Comm::reply) and the Attention's collect
// (Comm::combine, Comm::combine_in_place).
// Combine phase: each FFN rank sums the rows of one token in fp32 and stores one BF16 row per
// (token, FFN rank) into the token's Attention rank, indexed by the original token index;
// Attention ranks sum the <= F rows of each token in fp32. One kernel serves both roles.
#include "afdep/launch.h"
#include "common.cuh"

namespace afdep {

namespace {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ void add_bf16x8(float (&acc)[8], const int4& v) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const float2 f = __bfloat1622float2(p[q]);
    acc[2 * q] += f.x;
    acc[2 * q + 1] += f.y;
  }
}

__device__ __forceinline__ int4 pack_bf16x8(const float (&acc)[8]) {
  int4 v;
  __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int q = 0; q < 4; ++q) p[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
  return v;
}

// ---- F_LL_SMALL reply: flagged units (common.cuh) -----------------------------------------
// Either layout, ceil(bucket / S) <= kLLTokens: the FFN writes, into each Attention rank's
// window, its start units (its receive is done; the bucket words of a mismatch) and every
// token's row as units (the token layout's row as is, the expert layout's reduced row); the
// Attention's collect reads them as they land, without waiting for the completion count and
// its fence. The FFN still signals completion afterwards, so that the counts stay in step for
// the exchanges that follow. Behind the count a collect reads only the start units (a count
// seen before them means the count form: another bucket) and the mismatch status, so the CTAs
// that wrote those fence first; with F_UNIT_SIGNAL the others add unfenced.

// The FFN's start units of FFN index f in a window: ffn bucket | 0, sender bucket | 0.
__device__ __forceinline__ uint64_t* llc_start(const Layout& L, char* base, int f) {
  return reinterpret_cast<uint64_t*>(base + L.off_llc_start) + 2 * (size_t)f;
}

// Token t's row units from FFN index f: H / 2 units (two BF16 values each).
__device__ __forceinline__ uint64_t* llc_row(const Layout& L, char* base, int f, int t) {
  return reinterpret_cast<uint64_t*>(base + L.off_llc) +
         ((size_t)f * L.llc_tokens + t) * (size_t)(L.H / 2);
}

// FFN: vectors [v0, v1) of the reduced row of receipt slot `item` -> its Attention rank's inbox
// (fp32 sum of the token's valid rows; one row is copied as is, none gives zeros).
// slot >= 0 (F_EARLY_LOADS): `item` is receipt slot `slot` of source ai, which may be past
// that source's token count; the count is loaded with the item's words and checked here.
// llf != 0 (F_LL_SMALL, small bucket): into the token's row units at its source instead.
// kDirect: the Attention window from attn_window, not ab (null), which no barrier has filled.
template <bool kDirect = false>
__device__ void reply_chunk(const Layout& L, const CombineArgs& a, char* const* ab, size_t item,
                            int ai, int v0, int v1, bool first, int lane, int (*s_rows)[32],
                            int warp, int src_idx, int slot = -1, uint32_t llf = 0) {
  // the loads before the checks: independent, so their latencies overlap (the check's early
  // return would otherwise keep the compiler from issuing the second before the first returns)
  const int tok = a.token_index[item];
  int row = -1;
  if (lane < L.R) row = a.token_rows[item * L.R + lane];
  const int count = slot >= 0 ? a.num_tokens[ai] : 0;
  // traced only, thread 0's first item: a branch on its receipt words waits for them, splitting
  // the expert layout's reply into the receipt's latency and the rows' (taken unless the xor
  // hits one value)
  const bool mark = L.trace != nullptr && threadIdx.x == 0 && first;
  if (mark && ((uint32_t)tok ^ (uint32_t)row ^ (uint32_t)count) != 0x80000001u)
    trace_mark(L, kTrMasked, -1);
  if (slot >= 0 && slot >= min(max(count, 0), a.bucket)) return;  // no token in this slot
  // units: tok < T <= bucket <= llc_tokens for a receipt's token
  if (tok < 0 || tok >= (llf ? L.llc_tokens : L.C)) {
    if (lane == 0 && first) report_route(L.err, tok, 2);
    return;
  }
  const int rows_cap = L.A * a.bucket * L.R;
  const bool ok = lane < L.R && row >= 0 && row < rows_cap;
  const unsigned b = __ballot_sync(kFull, ok);
  const int nvalid = __popc(b);
  if (ok) s_rows[warp][__popc(b & lanemask_lt())] = row;
  __syncwarp();
  const int nv = L.H / 8;
  char* const base = kDirect ? attn_window(L, ai) : ab[ai];
  int4* dst = reinterpret_cast<int4*>(base + L.off_comb) + ((size_t)src_idx * L.C + tok) * nv;
  uint64_t* dstu = llc_row(L, base, L.my_index, tok);
  const int4* rows = static_cast<const int4*>(a.rows);
  if (nvalid == 1 && llf) {
    const int4* src = rows + (size_t)s_rows[warp][0] * nv;
    for (int i = v0 + lane; i < v1; i += 32) st_ll_vec(dstu + 4 * (size_t)i, ld_nc_v4(src + i), llf);
  } else if (nvalid == 1) {
    warp_copy16<false>(dst + v0, rows + (size_t)s_rows[warp][0] * nv + v0, v1 - v0, lane);
  } else {
    for (int i = v0 + lane; i < v1; i += 32) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      int r = 0;
      for (; r + 8 <= nvalid; r += 8) {
        int4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = ld_nc_v4(rows + (size_t)s_rows[warp][r + u] * nv + i);
        if (mark && i == v0 && r == 0 && (uint32_t)v[0].x != 0x80000001u)  // (as above)
          trace_mark(L, kTrLoaded, -1);
#pragma unroll
        for (int u = 0; u < 8; ++u) add_bf16x8(acc, v[u]);
      }
      for (; r + 4 <= nvalid; r += 4) {
        int4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) v[u] = ld_nc_v4(rows + (size_t)s_rows[warp][r + u] * nv + i);
#pragma unroll
        for (int u = 0; u < 4; ++u) add_bf16x8(acc, v[u]);
      }
#pragma unroll 1  // at most 3 rows; unrolled, 4 KB of code in the middle of the reply
      for (; r < nvalid; ++r) add_bf16x8(acc, ld_nc_v4(rows + (size_t)s_rows[warp][r] * nv + i));
      if (llf) st_ll_vec(dstu + 4 * (size_t)i, pack_bf16x8(acc), llf);
      else dst[i] = pack_bf16x8(acc);
    }
  }
  __syncwarp();
  if ((L.debug & kDbgPrint) && tok == 0 && v0 == 0 && lane == 0)
    printf("afdep-dbg t %llu rank %d reply wrote token 0 word0 %08x (nvalid %d)\n",
           (unsigned long long)global_timer_ns(), L.rank, ld_cg_i32(reinterpret_cast<int*>(dst)),
           nvalid);
}

// FFN, token layout: row i of rows [A*rps, H] is already the token's reply (the caller
// summed its experts); copy it as is into its source's inbox at the token's index. Rows are
// split into 2^lg chunks of cv vectors (sized by the tokens received, not by the rows: most
// rows may be empty); src_token[i] < 0 marks an empty row.
__device__ void reply_token_rows(const Layout& L, const CombineArgs& a, char* const* ab, int lg,
                                 int cv, int gw, int nw, int lane, int src_idx) {
  const int nv = L.H / 8;
  const int nrows = L.A * a.rps;
  const int4* rows = static_cast<const int4*>(a.rows);
  for (int u = gw; u < (nrows << lg); u += nw) {
    const int h = u & ((1 << lg) - 1), row = u >> lg;
    const int tok = a.src_token[row];
    if (tok < 0) continue;
    if (tok >= L.C) {  // not a receipt's row: never write outside the inbox
      if (lane == 0 && h == 0) report_route(L.err, tok, kRouteOverflow);
      continue;
    }
    const int ai = fast_div(row, a.div_rps);
    const int v0 = h * cv, v1 = min(nv, v0 + cv);
    int4* dst = reinterpret_cast<int4*>(ab[ai] + L.off_comb) + ((size_t)src_idx * L.C + tok) * nv;
    if (v1 > v0) warp_copy16<false>(dst + v0, rows + (size_t)row * nv + v0, v1 - v0, lane);
  }
}

// FFN, CTA 0: if this rank's receive took nothing from Attention rank ai (its bucket
// differed), tell ai, ahead of the CTA's completion signal (the fence in front covers it).
__device__ __forceinline__ bool report_mismatch(const Layout& L, const CombineArgs& a, int ai,
                                                uint64_t n) {
  const int sb = L.mismatch[ai];
  if (sb == 0) return false;
  ReplyStatus* st = reinterpret_cast<ReplyStatus*>(attn_window(L, ai) +
                                                   L.off_reply_status) + L.my_index;
  st->ffn_bucket = a.bucket;
  st->sender_bucket = sb;
  st->seq = n;
  return true;
}

// reply_token_rows with F_EARLY_LOADS: each warp loads its chunk of the row together with the
// row's token index (the row is the caller's, always readable), then stores it only if the
// row holds a token, so the store waits for one load latency instead of two. llf != 0
// (F_LL_SMALL): the chunk goes into the token's row units at its source, flagged llf.
__device__ void reply_token_rows_early(const Layout& L, const CombineArgs& a, int lg, int cv,
                                       int gw, int nw, int lane, int src_idx, uint32_t llf) {
  constexpr int U = 4;  // vectors per lane loaded up front (a chunk of 128 vectors)
  const int nv = L.H / 8, nch = 1 << lg;
  const int nrows = L.A * a.rps;
  const int4* rows = static_cast<const int4*>(a.rows);
  for (int u = gw; u < nrows * nch; u += nw) {
    const int h = u & (nch - 1), row = u >> lg;
    const int v0 = h * cv, v1 = min(nv, v0 + cv);
    const int4* src = rows + (size_t)row * nv;
    const int tok = a.src_token[row];
    int4 v[U];
#pragma unroll
    for (int q = 0; q < U; ++q)
      if (v0 + lane + 32 * q < v1) v[q] = ld_nc_v4(src + v0 + lane + 32 * q);
    // traced only, thread 0's first row: a branch on its token index and first vector waits
    // for both (taken unless their xor hits one value), splitting the reply's first stage
    if (L.trace != nullptr && threadIdx.x == 0 && u == gw &&
        ((uint32_t)tok ^ (uint32_t)v[0].x) != 0x80000001u)
      trace_mark(L, kTrLoaded, -1);
    if (tok < 0) continue;
    // not a receipt's row: never write outside the inbox (units: tok < T <= llc_tokens)
    if (tok >= (llf ? L.llc_tokens : L.C)) {
      if (lane == 0 && h == 0) report_route(L.err, tok, kRouteOverflow);
      continue;
    }
    char* base = attn_window(L, fast_div(row, a.div_rps));
    if (llf) {
      uint64_t* dst = llc_row(L, base, L.my_index, tok);
#pragma unroll
      for (int q = 0; q < U; ++q) {
        const int i = v0 + lane + 32 * q;
        if (i < v1) st_ll_vec(dst + 4 * (size_t)i, v[q], llf);
      }
      for (int i = v0 + lane + 32 * U; i < v1; i += 32)
        st_ll_vec(dst + 4 * (size_t)i, ld_nc_v4(src + i), llf);
      continue;
    }
    int4* dst = reinterpret_cast<int4*>(base + L.off_comb) + ((size_t)src_idx * L.C + tok) * nv;
#pragma unroll
    for (int q = 0; q < U; ++q)
      if (v0 + lane + 32 * q < v1) dst[v0 + lane + 32 * q] = v[q];
    if (v0 + 32 * U < v1)
      warp_copy16<false>(dst + v0 + 32 * U, src + v0 + 32 * U, v1 - v0 - 32 * U, lane);
  }
}

// Attention, F_LL_SMALL collect: FFN index f's start units (its rows come as units), or its
// completion count (it sent the count form: no units). s_llc[f] = the form (1 units, 0 count),
// s_llc[kMaxFfn + f] and s_llc[2 * kMaxFfn + f] the start units' words. The count is polled
// relaxed and, once reached, read again with acquire, then the start units once more: they
// may have landed behind it (the FFN fences them before its count). Returns the form, or -1 at
// the deadline (reported).
__device__ int wait_reply_ll(const Layout& L, int f, uint64_t target, uint32_t llf,
                             uint64_t deadline, int* s_llc) {
  char* mine = own_window(L);
  const int sr = L.rank_of_ffn[f];
  const uint64_t* u = llc_start(L, mine, f);
  const uint64_t* done = reinterpret_cast<const uint64_t*>(mine + L.off_comb_done) + sr;
  uint32_t spins = 0;
  int form = -1;
  uint64_t v0 = 0, v1 = 0;
  while (form < 0) {
    ld_ll2(u, v0, v1);
    if (ll_fresh(v0, llf) && ll_fresh(v1, llf)) {
      form = 1;
    } else if (ld_ll(done) >= target && ld_acquire_sys(done) >= target) {
      ld_ll2(u, v0, v1);  // after the acquire: the start units, if sent, are visible
      form = ll_fresh(v0, llf) && ll_fresh(v1, llf) ? 1 : 0;
    } else if (ll_give_up(spins, deadline, L.err, kPhaseCombine, sr, L.rank)) {
      return -1;
    }
  }
  s_llc[f] = form;
  s_llc[kMaxFfn + f] = form ? (int)(uint32_t)v0 : 0;
  s_llc[2 * kMaxFfn + f] = form ? (int)(uint32_t)v1 : 0;
  return form;
}

// collect_chunk with F_LL_SMALL: the rows of FFN ranks in umask from their units (each vector
// spun on until its four units are fresh), the others' from the inbox (count form, read after
// the fence). With in_place the result goes into the one FFN's inbox row (the caller's view).
__device__ bool collect_chunk_ll(const Layout& L, const CombineArgs& a, int t, int v0, int v1,
                                 int lane, uint64_t bad, uint64_t route, uint64_t umask,
                                 uint32_t llf, uint64_t deadline) {
  uint64_t mask = route & ~bad;
  if (L.F < 64) mask &= (1ull << L.F) - 1;
  const int nv = L.H / 8;
  const bool role = (L.flags & F_ROLE_BUFFERS) != 0;
  char* mine = own_window(L);
  const int4* inbox = reinterpret_cast<const int4*>(mine + L.off_comb);
  const int src0 = role ? 0 : L.rank_of_ffn[0];
  int4* dst = a.in_place ? const_cast<int4*>(inbox) + ((size_t)src0 * L.C + t) * nv
                         : static_cast<int4*>(a.out) + (size_t)t * nv;
  for (int i = v0 + lane; i < v1; i += 32) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int4 one = make_int4(0, 0, 0, 0);  // F == 1: the row as is (zeros when not routed)
    uint64_t m = mask;
    while (m) {
      const int f = __ffsll((long long)m) - 1;
      m &= m - 1;
      int4 x;
      if ((umask >> f) & 1ull) {
        if (!wait_ll_vec(llc_row(L, mine, f, t) + 4 * (size_t)i, llf, deadline, L.err,
                         kPhaseCombine, L.rank_of_ffn[f], L.rank, x))
          return false;
      } else {
        x = ld_cg_v4(inbox + ((size_t)(role ? f : L.rank_of_ffn[f]) * L.C + t) * nv + i);
      }
      if (L.F == 1) one = x;
      else add_bf16x8(acc, x);
    }
    dst[i] = L.F == 1 ? one : pack_bf16x8(acc);
  }
  return true;
}

// FFN index f's bucket mismatch as the collect sees it (the mismatch status and its words):
// from its start units in s_llc when it replied in units (units), else from its reply status
// in the inbox (the count form; read after the wait's fence).
__device__ __forceinline__ bool reply_mismatch(const Layout& L, const char* mine,
                                               const int* s_llc, bool units, int f, uint64_t n,
                                               int& fb, int& sb) {
  if (units) {
    fb = s_llc[kMaxFfn + f];
    sb = s_llc[2 * kMaxFfn + f];
    return fb != 0;
  }
  const ReplyStatus* st = reinterpret_cast<const ReplyStatus*>(mine + L.off_reply_status) + f;
  if (__ldcg(reinterpret_cast<const unsigned long long*>(&st->seq)) != (unsigned long long)n)
    return false;
  fb = __ldcg(&st->ffn_bucket);
  sb = __ldcg(&st->sender_bucket);
  return true;
}

// ---- F_EARLY_COLLECT: the flagged-unit collect without a barrier between wait and rows ----
// What one lane of kEarlyCollect has learnt so far of each FFN index's reply (bit f), kept
// across its vectors so that each wait and fence is paid once per FFN rank: its start units
// came without a mismatch (units), it replied in the count form and this lane has fenced after
// its completion count (count), or its bucket differed (bad: it took nothing from this rank).
struct ReplySeen {
  uint64_t units = 0, count = 0, bad = 0;
};

// Vector i of token t's row from FFN index f in the inbox (the count form; read after a fence)
__device__ __forceinline__ int4 reply_inbox_vec(const Layout& L, const char* mine, int f, int t,
                                                int i) {
  const int src = (L.flags & F_ROLE_BUFFERS) ? f : L.rank_of_ffn[f];
  return ld_cg_v4(reinterpret_cast<const int4*>(mine + L.off_comb) +
                  ((size_t)src * L.C + t) * (L.H / 8) + i);
}

// FFN index f's reply to vector i of token t, for one lane (kEarlyCollect): the row's four
// units, f's start units and its completion count are loaded together in each spin, so the row
// is read by the load that sees it land, instead of one load latency after a barrier behind
// the start units. Returns 1 with x (from the units, or, when f replied in the count form,
// from the inbox after its completion count, an acquire and a fence), 0 when f's bucket
// differed (f counts as zero), -1 at the deadline (reported). Fresh row units are taken before
// the start units are seen: an FFN rank whose bucket differed booked this rank's regions empty
// and sends it no rows.
__device__ int wait_reply_row(const Layout& L, int f, int t, int i, uint64_t n, uint64_t target,
                              uint32_t llf, uint64_t deadline, ReplySeen& seen, int4& x) {
  const uint64_t bit = 1ull << f;
  char* mine = own_window(L);
  if (seen.bad & bit) return 0;
  if (seen.count & bit) {
    x = reply_inbox_vec(L, mine, f, t, i);
    return 1;
  }
  const int sr = L.rank_of_ffn[f];
  const uint64_t* row = llc_row(L, mine, f, t) + 4 * (size_t)i;
  const uint64_t* start = llc_start(L, mine, f);
  const uint64_t* done = reinterpret_cast<const uint64_t*>(mine + L.off_comb_done) + sr;
  uint32_t spins = 0;
  bool units = (seen.units & bit) != 0;  // only the row is awaited
  while (true) {
    // every load of a spin issued before any is tested: one load latency a spin, not three
    uint64_t r0, r1, r2, r3, s0 = 0, s1 = 0, d = 0;
    ld_ll2(row, r0, r1);
    ld_ll2(row + 2, r2, r3);
    if (!units) {
      ld_ll2(start, s0, s1);
      d = ld_ll(done);
    }
    if (ll_fresh(r0, llf) && ll_fresh(r1, llf) && ll_fresh(r2, llf) && ll_fresh(r3, llf)) {
      x = make_int4((int)(uint32_t)r0, (int)(uint32_t)r1, (int)(uint32_t)r2, (int)(uint32_t)r3);
      return 1;
    }
    if (!units) {
      bool fresh = ll_fresh(s0, llf) && ll_fresh(s1, llf);
      if (!fresh && d >= target && ld_acquire_sys(done) >= target) {
        ld_ll2(start, s0, s1);  // after the acquire: the start units, if sent, are visible
        fresh = ll_fresh(s0, llf) && ll_fresh(s1, llf);
        if (!fresh) {  // the count form: the row and the status in the inbox, after a fence
          sys_fence_after_wait();
          int fb = 0, sb = 0;
          if (reply_mismatch(L, mine, nullptr, false, f, n, fb, sb)) {
            seen.bad |= bit;
            return 0;
          }
          seen.count |= bit;
          x = reply_inbox_vec(L, mine, f, t, i);
          return 1;
        }
      }
      if (fresh) {
        if ((uint32_t)s0 != 0) {  // f's bucket differed
          seen.bad |= bit;
          return 0;
        }
        seen.units |= bit;
        units = true;
      }
    }
    if (ll_give_up(spins, deadline, L.err, kPhaseCombine, sr, L.rank)) return -1;
  }
}

// The collect of kEarlyCollect (F_EARLY_COLLECT; T <= kLLTokens * S, as kSmallRecv's). Warp 0
// of CTA 0 waits for every FFN rank's start units or completion count as kSmallRecv does (the
// kernel cannot end before every reply of this exchange is seen: the windows' reuse rests on
// it) and reports the mismatches; warps 1.. of every CTA hold the rows, each lane polling its
// vector's units with their FFN rank's start units (wait_reply_row). No barrier between the
// waits and the rows, and a CTA without rows leaves at once (at T = 1 and H 4096-7168 the
// row's 16 chunks sit on CTAs 0 and 1: no other CTA spins). Returns false at the deadline
// (reported). kSpread (F_SPREAD_CHUNKS): row unit u on warp 1 + u / G of CTA u % G instead of
// warp 1 + u % 15 of CTA u / 15 (the spinning lanes then sit on up to G SMs, not on CTAs 0-1).
template <bool kSpread>
__device__ bool collect_early(const Layout& L, const CombineArgs& a, uint64_t n,
                              uint64_t deadline, int* s_llc) {
  const int c = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint64_t target = n * (uint64_t)L.G;
  const uint32_t llf = ll_flag(n);
  const int nv = L.H / 8;
  bool ok = true;
  if (warp == 0) {
    if (c != 0) return true;
    int counted = 0;
    for (int f = lane; f < L.F && ok; f += 32) {
      const int form = wait_reply_ll(L, f, target, llf, deadline, s_llc);
      ok = form >= 0;
      counted |= form == 0 ? 1 : 0;
    }
    if (!__all_sync(kFull, ok)) return false;
    if (__any_sync(kFull, counted)) sys_fence_after_wait();  // before a reply status's loads
    trace_mark(L, kTrWaited, kTrMaxWaited);
#pragma unroll 1  // one step for F <= 32
    for (int f = lane; f < L.F; f += 32) {
      int fb = 0, sb = 0;
      if (reply_mismatch(L, own_window(L), s_llc, s_llc[f] == 1, f, n, fb, sb))
        report_route(L.err, fb, kRouteBucket, L.rank_of_ffn[f], sb);
    }
    return true;
  }
  const bool role = (L.flags & F_ROLE_BUFFERS) != 0;
  const int4* inbox = reinterpret_cast<const int4*>(own_window(L) + L.off_comb);
  const int src0 = role ? 0 : L.rank_of_ffn[0];
  const int nw = gridDim.x * (kWarps - 1);
  const int gw = grid_warp<kSpread>(warp - 1, kWarps - 1);
  const int clg = chunk_log2_fill(a.T, nw, nv), cv = (nv + (1 << clg) - 1) >> clg;
  const uint64_t fmask = L.F < 64 ? (1ull << L.F) - 1 : ~0ull;
  ReplySeen seen;
  for (int u = gw; u < (a.T << clg) && ok; u += nw) {
    const int h = u & ((1 << clg) - 1), t = u >> clg;
    const int v0 = h * cv, v1 = min(nv, v0 + cv);
    const uint64_t route = (uint64_t)a.route[t] & fmask;
    // with in_place (one FFN rank) the result goes into its inbox row (the caller's view)
    int4* dst = a.in_place ? const_cast<int4*>(inbox) + ((size_t)src0 * L.C + t) * nv
                           : static_cast<int4*>(a.out) + (size_t)t * nv;
    for (int i = v0 + lane; i < v1 && ok; i += 32) {
      float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      int4 one = make_int4(0, 0, 0, 0);  // F == 1: the row as is (zeros when not routed)
      for (uint64_t m = route; m && ok; m &= m - 1) {
        const int f = __ffsll((long long)m) - 1;
        int4 x;
        const int got = wait_reply_row(L, f, t, i, n, target, llf, deadline, seen, x);
        ok = got >= 0;
        if (got != 1) continue;
        if (L.F == 1) one = x;
        else add_bf16x8(acc, x);
      }
      if (ok) dst[i] = L.F == 1 ? one : pack_bf16x8(acc);
    }
  }
  return ok;
}

// Attention: vectors [v0, v1) of out[t] = fp32 sum over FFN ranks in route[t] of their rows;
// FFN ranks in `bad` (their bucket differed: they took nothing from this rank) count as zero.
// pre (one FFN rank, F_SINGLE_FFN): x0 holds this lane's vector v0 + lane of the row.
__device__ void collect_chunk(const Layout& L, const CombineArgs& a, int t, int v0, int v1,
                              int lane, uint64_t bad, uint64_t route, bool pre, int4 x0) {
  const uint64_t mask = route & ~bad;
  const int nv = L.H / 8;
  int4* out = static_cast<int4*>(a.out) + (size_t)t * nv;
  const bool role = (L.flags & F_ROLE_BUFFERS) != 0;
  const int4* inbox = reinterpret_cast<const int4*>(own_window(L) + L.off_comb);
  if (a.in_place) {  // F == 1: the reply row is the result; only unrouted rows need zeros
    if (!(mask & 1ull)) {
      const int src = role ? 0 : L.rank_of_ffn[0];
      int4* row = const_cast<int4*>(inbox) + ((size_t)src * L.C + t) * nv;
      const int4 z = make_int4(0, 0, 0, 0);
      for (int i = v0 + lane; i < v1; i += 32) row[i] = z;
    }
    return;
  }
  if (L.F == 1 && (L.flags & F_SINGLE_FFN)) {
    if (mask & 1ull) {
      const int src = role ? 0 : L.rank_of_ffn[0];
      const int4* row = inbox + ((size_t)src * L.C + t) * nv;
      int s = v0;
      if (pre) {
        if (v0 + lane < v1) out[v0 + lane] = x0;
        s = v0 + 32;
      }
      if (v1 > s) warp_copy16<true>(out + s, row + s, v1 - s, lane);
    } else {
      const int4 z = make_int4(0, 0, 0, 0);
      for (int i = v0 + lane; i < v1; i += 32) out[i] = z;
    }
    return;
  }
  for (int i = v0 + lane; i < v1; i += 32) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    uint64_t m = mask;
    if (L.F < 64) m &= (1ull << L.F) - 1;
    while (m) {
      const int f = __ffsll((long long)m) - 1;
      m &= m - 1;
      const int src = role ? f : L.rank_of_ffn[f];
      add_bf16x8(acc, ld_cg_v4(inbox + ((size_t)src * L.C + t) * nv + i));
    }
    out[i] = pack_bf16x8(acc);
  }
}

// kForm (KernelForm, afdep/forms.h): kGeneric runs every path; the small forms (see combine_form)
// only one role's path: the token layout's flagged-unit reply or collect, the expert layout's
// one-pass reply or its count-form collect, so that their code is compact
// kSpread (F_SPREAD_CHUNKS; kSmallSend, kUnitReply, kSmallRecv, kEarlyCollect only, its own
// instantiations so that the other code is unchanged): unit u on warp u / G of CTA u % G
// instead of warp u % 16 of CTA u / 16, so that a row's chunks spread over up to G SMs (at
// T = 1 the expert layout's reply loads 8 rows, 64 KB, and every small form moves at least
// one row's 8-16 KB: through one SM when a CTA's warps take them).
template <int kForm, bool kSpread = false>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(Layout L, CombineArgs a) {
  constexpr bool kSmall = kForm != kGeneric;
  // the reply's rows as flagged units: the token layout's (kSmallSend) or the expert
  // layout's (kUnitReply); the collect's units (kSmallRecv)
  constexpr bool kUnits = form_units(kForm) || kForm == kUnitReply;
  constexpr bool kSendOnly = form_send_only(kForm), kRecvOnly = form_recv_only(kForm);
  // the small replies, whose rows go out before their set-up (below)
  constexpr bool kRowsFirst = kForm == kSmallSend || kForm == kUnitReply;
  __shared__ int s_rows[kWarps][32];
  __shared__ int s_tb[kMaxAttn + 1];  // first receipt unit of each Attention index
  // window base of every Attention rank (FFN reply), loaded once with the receipt counts
  // instead of two dependent global loads in front of every row's remote stores
  __shared__ char* s_ab[kMaxAttn];
  pdl_wait(L);
  trace_begin(L);
  const int c = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t fl = L.flags;
  const uint64_t n = launch_number(L, kPhaseCombine);
  const uint64_t deadline = global_timer_ns() + L.timeout_ns;
  // the small forms run only with the four directional controls on (dispatch_form and
  // combine_form check them)
  const bool all_peers = !kSmall && !(fl & F_ROLE_WARPS);
  const bool rwo = kSmall || (fl & F_RECEIVER_WAIT_ONLY) != 0;
  char* mine = own_window(L);
  const int gw = grid_warp<kSpread>(warp, kWarps);
  const int nw = gridDim.x * kWarps;
  const int nv = L.H / 8;
  trace_mark(L, kTrStart, kTrMaxStart);

  if (!kSmall && !(fl & F_NO_ENTRY_BARRIER)) {
    if (!entry_barrier(L, kPhaseCombine, n, deadline, L.err)) return;
  }

  if (!kRecvOnly && a.do_send) {
    // F_UNIT_SIGNAL: this thread wrote something the completion count must follow (plain
    // rows, the start units, a mismatch status), not only flagged row units
    int plain = 1;
    // F_EARLY_LOADS with few rows (token layout) or receipt slots (expert layout): at least
    // four warps for each, in one pass of the grid. The units are fixed by the bucket, so no
    // warp waits for the token counts before loading its row (the counts only say which
    // slots hold tokens); large buckets keep the path below, sized by the tokens received
    const int units = a.tokens ? L.A * a.rps : L.A * a.bucket;
    if (kSmall || (a.real_send && (fl & F_EARLY_LOADS) && 4 * units <= nw)) {
      const int src_idx = (fl & F_ROLE_BUFFERS) ? L.my_index : L.rank;
      // every row (or slot) gets its own warps: about one unit per warp (chunk_log2)
      const int lg = chunk_log2(units, nw, nv);
      const int nch = 1 << lg;
      const int cv = (nv + nch - 1) >> lg;
      // s_ab: the completion signal below reads it too (after the bar.sync in front of it);
      // the small replies fill it after their rows (kRowsFirst, below)
      if (!kRowsFirst)
        for (int ai = tid; ai < L.A; ai += blockDim.x) s_ab[ai] = attn_window(L, ai);
      // F_LL_SMALL: the start units (every Attention rank, mismatch or not) and the rows as
      // units, in either layout when ceil(bucket / S) <= kLLTokens (the collect decides from
      // its T, which its bucket bounds; a collect watching for units also takes the count
      // form, see wait_reply_ll)
      const bool units_fit = L.llc && (a.tokens ? a.rps : a.bucket) <= L.llc_tokens;
      const uint32_t llf = (kUnits || (!kSmall && units_fit)) ? ll_flag(n) : 0u;
      if (kUnits) __builtin_assume(llf != 0u);  // (never 0) no plain-store path in this form
      plain = !llf || !(fl & F_UNIT_SIGNAL);
      // kRowsFirst: the rows first. Nothing in them reads s_ab (the expert layout's takes its
      // windows from attn_window, so no barrier stands in front of its receipt's loads) or
      // waits for the start units, and the set-up (a loop of indexed parameter reads, the
      // start units' loop, a barrier) put about 100 instructions between the kernel's start
      // and the first row's loads
      if (kForm == kSmallSend) {
        reply_token_rows_early(L, a, lg, cv, gw, nw, lane, src_idx, llf);
      } else if (kForm == kUnitReply) {
        for (int u = gw; u < units * nch; u += nw) {
          const int h = u & (nch - 1), q = u >> lg;
          const int ai = fast_div(q, a.div_bucket), v0 = h * cv, v1 = min(nv, v0 + cv);
          if (v1 > v0)
            reply_chunk<true>(L, a, nullptr, (size_t)q, ai, v0, v1, h == 0, lane, s_rows, warp,
                              src_idx, q - ai * a.bucket, llf);
        }
      }
      if (kRowsFirst)
        for (int ai = tid; ai < L.A; ai += blockDim.x) s_ab[ai] = attn_window(L, ai);
      // The start units, by the grid's last CTA (on CTA 0 the mismatch load and the stores sat
      // in front of the first row's first chunk)
      if (kSpread) {
        // by its last warp (gw = nw - 1: a chunk only when units * nch = nw), which did not
        // fill s_ab's entries and meets no barrier before these
        for (int ai = lane; llf && c == (int)gridDim.x - 1 && warp == kWarps - 1 && ai < L.A;
             ai += 32) {
          const int sb = L.mismatch[ai];
          st_ll2(llc_start(L, attn_window(L, ai), L.my_index), sb ? a.bucket : 0, sb, llf);
          plain = 1;
        }
      } else {  // whose warps hold no row (at most: units * nch <= nw)
        for (int ai = tid; llf && c == (int)gridDim.x - 1 && ai < L.A; ai += blockDim.x) {
          const int sb = L.mismatch[ai];
          st_ll2(llc_start(L, s_ab[ai], L.my_index), sb ? a.bucket : 0, sb, llf);
          plain = 1;
        }
      }
      if (kRowsFirst) {
        // (their rows went out above)
      } else if (!kSmall && a.tokens) {
        reply_token_rows_early(L, a, lg, cv, gw, nw, lane, src_idx, llf);
      } else {
        __syncthreads();
        for (int u = gw; u < units * nch; u += nw) {
          const int h = u & (nch - 1), q = u >> lg;
          const int ai = fast_div(q, a.div_bucket), v0 = h * cv, v1 = min(nv, v0 + cv);
          if (v1 > v0)
            reply_chunk(L, a, s_ab, (size_t)q, ai, v0, v1, h == 0, lane, s_rows, warp, src_idx,
                        q - ai * a.bucket, llf);
        }
      }
      // the bucket-mismatch status, as below (after the rows: only CTA 0 loads it)
      for (int ai = tid; c == 0 && ai < L.A; ai += blockDim.x)
        if (report_mismatch(L, a, ai, n)) plain = 1;
    } else if (a.real_send) {
      const int src_idx = (fl & F_ROLE_BUFFERS) ? L.my_index : L.rank;
      for (int ai = tid; ai < L.A; ai += blockDim.x) {
        s_tb[ai] = min(max(a.num_tokens[ai], 0), a.bucket);
        s_ab[ai] = attn_window(L, ai);
        if (c == 0) report_mismatch(L, a, ai, n);
      }
      __syncthreads();
      if (warp == 0) warp_exclusive_scan(s_tb, L.A, lane);
      __syncthreads();
      const int items = s_tb[L.A];
      const int lg = chunk_log2_fill(items, nw, nv);
      const int cv = (nv + (1 << lg) - 1) >> lg;
      if (a.tokens) {
        reply_token_rows(L, a, s_ab, lg, cv, gw, nw, lane, src_idx);
      } else {
        for (int u = gw; u < (items << lg); u += nw) {
          const int h = u & ((1 << lg) - 1), q = u >> lg;
          const int ai = upper_index(s_tb, L.A, q);
          const size_t item = (size_t)ai * a.bucket + (q - s_tb[ai]);
          const int v0 = h * cv, v1 = min(nv, v0 + cv);
          if (v1 > v0)
            reply_chunk(L, a, s_ab, item, ai, v0, v1, h == 0, lane, s_rows, warp, src_idx);
        }
      }
    }
    // F_UNIT_SIGNAL: a CTA that wrote only flagged row units adds its count without the
    // system fence. The collect takes those units by their flags, never behind this count; it
    // reads behind the count only the start units and mismatch status, whose CTAs still fence,
    // and where the count reaches its target those CTAs' fenced adds are in it
    const bool fenced = sys_fence_then_sync_or(L, plain);
    trace_mark(L, kTrWritten, -1);  // the signals (behind their fences where fenced) next
    if (rwo) {
      // "this CTA's rows are written": every CTA adds 1 to its count at each receiver
      const int ntg = all_peers ? L.W : L.A;
      for (int ti = tid; ti < ntg; ti += blockDim.x) {
        char* base = all_peers ? peer_base(L, ti)
                     : a.real_send ? s_ab[ti] : attn_window(L, ti);
        uint64_t* done = reinterpret_cast<uint64_t*>(base + L.off_comb_done) + L.rank;
        if (fenced) signal_add_sys(L, done, 1); else red_add_relaxed_sys(done, 1);
      }
    }
    if (!kSmall && (L.debug & kDbgPrint) && tid == 0 && (c == 0 || c == gridDim.x - 1))
      printf("afdep-dbg t %llu rank %d reply cta %d n %llu comb_done@attn0 %llu\n",
             (unsigned long long)global_timer_ns(), L.rank, c, (unsigned long long)n,
             (unsigned long long)ld_acquire_sys(reinterpret_cast<const uint64_t*>(
                 attn_window(L, 0) + L.off_comb_done) + L.rank));
    trace_mark(L, kTrSent, kTrMaxSent);
  }

  if (!rwo) {
    if (!exit_barrier(L, kPhaseCombine, n, deadline, L.err)) return;
  }

  if (kForm == kEarlyCollect) {  // F_EARLY_COLLECT: (a collect-only form)
    __shared__ int s_lle[3 * kMaxFfn];
    if (!__syncthreads_and(collect_early<kSpread>(L, a, n, deadline, s_lle) ? 1 : 0)) return;
  } else if (!kSendOnly && a.do_recv) {
    // F_EARLY_LOADS: the route of this warp's first token, loaded before the wait (the
    // dispatch kernel wrote it earlier in this stream), not after it
    // the chunking too, so that nothing after the wait divides
    const int clg = chunk_log2_fill(a.T, nw, nv);
    const int ccv = (nv + (1 << clg) - 1) >> clg;
    const bool pre_route = (fl & F_EARLY_LOADS) && a.real_recv && gw < (a.T << clg);
    const uint64_t route0 = pre_route ? (uint64_t)a.route[gw >> clg] : 0;
    // F_LL_SMALL (either layout, T <= kLLTokens * S): the replies' start units, or the count
    // form where an FFN rank sent that (see wait_reply_ll); the fence only for the latter
    const bool ll = kUnits || (!kSmall && L.llc && a.real_recv && a.T <= L.llc_tokens);
    __shared__ int s_llc[3 * kMaxFfn];
    int fence = 1;
    if (ll) {
      const uint64_t target = n * (uint64_t)L.G;
      const uint32_t llf = ll_flag(n);
      bool ok = true;
      int counted = 0;
      for (int f = tid; f < L.F && ok; f += blockDim.x) {
        const int form = wait_reply_ll(L, f, target, llf, deadline, s_llc);
        ok = form >= 0;
        counted |= form == 0 ? 1 : 0;
      }
      if (!__syncthreads_and(ok ? 1 : 0)) return;
      fence = __syncthreads_or(counted);
    } else if (rwo) {
      // every source's reply kernel ran G CTAs (S when the grid is not wide): n exchanges done
      // when its count reaches n * G
      const int nsrc = all_peers ? L.W : L.F;
      const uint64_t target = n * (uint64_t)L.G;
      bool ok = true;
      if (!kSmall && (L.debug & kDbgPrint) && tid == 0 && (c == 0 || c == gridDim.x - 1))
        printf("afdep-dbg t %llu rank %d combine cta %d n %llu target %llu comb_done[ffn0] %llu\n",
               (unsigned long long)global_timer_ns(), L.rank, c, (unsigned long long)n, (unsigned long long)target,
               (unsigned long long)ld_acquire_sys(reinterpret_cast<const uint64_t*>(
                   mine + L.off_comb_done) + (all_peers ? 0 : L.rank_of_ffn[0])));
      for (int i = tid; i < nsrc && ok; i += blockDim.x) {
        const int sr = all_peers ? i : L.rank_of_ffn[i];
        ok = wait_geq(reinterpret_cast<const uint64_t*>(mine + L.off_comb_done) + sr,
                      target, deadline, L.err, kPhaseCombine, sr, L.rank);
      }
      if (!__syncthreads_and(ok ? 1 : 0)) return;
    }
    // this rank's rows (or the exit barrier) seen: read the inbox (flagged units need none)
    if (fence) sys_fence_after_wait();
    trace_mark(L, kTrWaited, kTrMaxWaited);
    if (!kSmall && (L.debug & kDbgPrint) && tid == 0 && (c == 0 || c == gridDim.x - 1))
      printf("afdep-dbg t %llu rank %d combine cta %d n %llu waited, comb_done[ffn0] %llu\n",
             (unsigned long long)global_timer_ns(), L.rank, c, (unsigned long long)n,
             (unsigned long long)ld_acquire_sys(reinterpret_cast<const uint64_t*>(
                 mine + L.off_comb_done) + (all_peers ? 0 : L.rank_of_ffn[0])));
    if (!kSmall && (L.debug & kDbgPrint) && tid == 0 && c == 0)
      printf("afdep-dbg rank %d combine reads token 0 word0 %08x\n", L.rank,
             ld_cg_i32(reinterpret_cast<const int*>(mine + L.off_comb) +
                       (size_t)((L.flags & F_ROLE_BUFFERS) ? 0 : L.rank_of_ffn[0]) * L.C * L.H / 2));
    if (kSmall || a.real_recv) {
      // F_EARLY_LOADS, one FFN rank (F_SINGLE_FFN), count form, copied out: this lane's first
      // vector of the warp's first unit loads with the mismatch status below instead of after
      // it (the row is used only if that FFN rank's bucket matched)
      const bool pre_row = !ll && pre_route && (route0 & 1ull) && L.F == 1 &&
                           (fl & F_SINGLE_FFN) && !a.in_place;
      int4 x0 = make_int4(0, 0, 0, 0);
      if (pre_row) {
        const int h = gw & ((1 << clg) - 1), src = (fl & F_ROLE_BUFFERS) ? 0 : L.rank_of_ffn[0];
        const int4* row = reinterpret_cast<const int4*>(mine + L.off_comb) +
                          ((size_t)src * L.C + (gw >> clg)) * nv;
        if (h * ccv + lane < min(nv, h * ccv + ccv)) x0 = ld_cg_v4_now(row + h * ccv + lane);
      }
      // FFN ranks whose reply of this exchange says the buckets differed (they took nothing
      // from this rank): one load per lane, after the wait and its fence like the rows.
      // F_LL_SMALL: an FFN rank that sent units tells a mismatch in its start units instead.
      uint64_t bad = 0, umask = 0;
      for (int f0 = 0; f0 < L.F; f0 += 32) {
        const int f = f0 + lane;
        const bool units = ll && f < L.F && s_llc[f] == 1;
        int fb = 0, sb = 0;
        const bool b = f < L.F && reply_mismatch(L, mine, s_llc, units, f, n, fb, sb);
        bad |= (uint64_t)__ballot_sync(kFull, b) << f0;
        umask |= (uint64_t)__ballot_sync(kFull, units) << f0;
        if (b && c == 0 && warp == 0) report_route(L.err, fb, kRouteBucket, L.rank_of_ffn[f], sb);
      }
      bool ok = true;
      const uint32_t llf = ll_flag(n);
      for (int u = gw; u < (a.T << clg) && ok; u += nw) {
        const int h = u & ((1 << clg) - 1), t = u >> clg;
        const int v0 = h * ccv, v1 = min(nv, v0 + ccv);
        const uint64_t route = pre_route && u == gw ? route0 : (uint64_t)a.route[t];
        if (v1 <= v0) continue;
        if (ll) ok = collect_chunk_ll(L, a, t, v0, v1, lane, bad, route, umask, llf, deadline);
        else collect_chunk(L, a, t, v0, v1, lane, bad, route, pre_row && u == gw, x0);
      }
      if (ll) {  // (ll is the same in every thread, so all of them meet this barrier or none)
        if (!__syncthreads_and(ok ? 1 : 0)) return;
      }
    }
  }

  // A warp whose wait timed out returns from its row loop's helper and arrives here early:
  // no other barrier may follow those loops, or it would meet this one with the wrong warps
  __syncthreads();
  trace_mark(L, kTrEnd, kTrMaxEnd);
  trace_flush(L, kPhaseCombine, n);
  end_launch(L, kPhaseCombine, n);
}

}  // namespace

// The form a launch runs (F_SMALL_KERNELS), in one role only and with the four directional
// controls: the token layout's flagged-unit reply (its early path, one pass of the grid: 4
// warps per row); the expert layout's one-pass reply (4 warps per receipt slot), its rows as
// flagged units when the bucket is small; the collect of either layout from flagged units
// (T <= kLLTokens * S) or in the count form; else the generic kernel (also for debug output).
int combine_form(const Layout& L, const CombineArgs& a, int grid) {
  if (!(L.flags & F_SMALL_KERNELS) || L.debug || (L.flags & kDirectional) != kDirectional)
    return kGeneric;
  const bool send = a.do_send && a.real_send && !a.do_recv;
  const bool recv = a.do_recv && a.real_recv && !a.do_send;
  // the collect of either layout: flagged units (F_LL_SMALL, T <= kLLTokens * S); the early
  // collect in the token layout only (layout.h kEarlyCollectTokensPerSm)
  if (recv && L.llc && a.T <= L.llc_tokens)
    return (L.flags & F_EARLY_COLLECT) && L.tokens && a.T <= kEarlyCollectTokensPerSm * L.S
               ? kEarlyCollect
               : kSmallRecv;
  if (L.ll) {  // token layout
    if (send && a.tokens && a.rps <= L.llc_tokens && 4 * L.A * a.rps <= grid * kWarps)
      return kSmallSend;
    return kGeneric;
  }
  if (L.tokens) return kGeneric;
  // expert layout: the reply's one-pass path (4 warps per receipt slot; its rows as units
  // when the bucket is small and F_LL_SMALL is on) and the collect in the count form
  if (send && (L.flags & F_EARLY_LOADS) && 4 * L.A * a.bucket <= grid * kWarps)
    return L.llc && a.bucket <= L.llc_tokens ? kUnitReply : kCountSend;
  return recv ? kCountRecv : kGeneric;
}

// F_SPREAD_CHUNKS: a form that moves a small row's chunks, in its spread instantiation
template <int kForm>
cudaError_t launch_spreadable(bool spread, const Layout& L, const CombineArgs& a, int grid,
                              cudaStream_t stream) {
  return spread ? launch_transport_kernel(combine_kernel<kForm, true>, L, a, grid, 0, stream)
                : launch_transport_kernel(combine_kernel<kForm>, L, a, grid, 0, stream);
}

cudaError_t launch_combine(const Layout& L, const CombineArgs& a, int grid, cudaStream_t stream,
                           int* form) {
  const int f = combine_form(L, a, grid);
  if (form != nullptr) *form = f;
  const bool spread = (L.flags & F_SPREAD_CHUNKS) != 0;
  switch (f) {
    case kSmallSend:
      return launch_spreadable<kSmallSend>(spread, L, a, grid, stream);
    case kSmallRecv:
      return launch_spreadable<kSmallRecv>(spread, L, a, grid, stream);
    case kCountSend:
      return launch_transport_kernel(combine_kernel<kCountSend>, L, a, grid, 0, stream);
    case kUnitReply:
      return launch_spreadable<kUnitReply>(spread, L, a, grid, stream);
    case kCountRecv:
      return launch_transport_kernel(combine_kernel<kCountRecv>, L, a, grid, 0, stream);
    case kEarlyCollect:
      return launch_spreadable<kEarlyCollect>(spread, L, a, grid, stream);
    default:
      return launch_transport_kernel(combine_kernel<kGeneric>, L, a, grid, 0, stream);
  }
}

}  // namespace afdep
