// Shared device helpers and the kernel parameter block of torch_afdep's CUDA path.
// Written for this project; see docs/protocol.md for the protocol these kernels implement.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cuda_runtime.h>
#include <cuda_bf16.h>

#include "afdep/layout.h"
#include "afdep/args.h"
#include "afdep/forms.h"

namespace afdep {

constexpr int kThreads = 512;  // threads per transport CTA (16 warps)
constexpr int kWarps = kThreads / 32;

// ---- memory-model primitives -------------------------------------------------------------
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Atomic add with release semantics at system scope (peer memory over NVLink included).
__device__ __forceinline__ void red_add_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Strong but unordered store / add at system scope: the caller's fence orders what precedes.
__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void red_add_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Shared-memory flag handed between warps of a CTA with acquire/release at CTA scope.
__device__ __forceinline__ int ld_acquire_cta_shared(const int* p) {
  int v;
  asm volatile("ld.acquire.cta.shared.b32 %0, [%1];"
               : "=r"(v) : "r"((unsigned)__cvta_generic_to_shared(p)) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_cta_shared(int* p, int v) {
  asm volatile("st.release.cta.shared.b32 [%0], %1;"
               :: "r"((unsigned)__cvta_generic_to_shared(p)), "r"(v) : "memory");
}

__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

// Programmatic dependent launch (F_PDL). A kernel launched with programmatic stream
// serialization may be scheduled while the previous kernel in its stream drains; pdl_wait,
// the first thing every transport kernel does, holds it until that kernel has completed and
// its memory is visible, so only the launch latency overlaps. griddepcontrol needs sm_90.
__device__ __forceinline__ void pdl_wait(const Layout& L) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (L.flags & F_PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next PDL-launched kernel of the stream be scheduled now: its CTAs take free SMs
// and sit in pdl_wait, instead of being launched once this grid has ended.
__device__ __forceinline__ void pdl_launch_dependents(const Layout& L) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (L.flags & F_PDL) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Host: launch a transport kernel; under F_PDL with the programmatic-serialization attribute
// (cudaLaunchKernelEx), else the plain launch.
template <typename Args>
inline cudaError_t launch_transport_kernel(void (*kernel)(Layout, Args), const Layout& L,
                                           const Args& a, int grid, size_t smem,
                                           cudaStream_t stream) {
  if (!(L.flags & F_PDL)) {
    kernel<<<grid, kThreads, smem, stream>>>(L, a);
    return cudaGetLastError();
  }
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, L, a);
  return e != cudaSuccess ? e : cudaGetLastError();
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int4 ld_nc_v4(const int4* p) {
  int4 v;
  asm volatile("ld.global.nc.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm volatile("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

// ---- L2-only loads of inbox data (written by peers) and warp copies ---------------------
// Plain (non-volatile) L2-only loads: the compiler may batch them; the acquire polls' "memory"
// clobbers keep them after the wait that published the data.
__device__ __forceinline__ int ld_cg_i32(const int* p) { return __ldcg(p); }

__device__ __forceinline__ int4 ld_cg_v4(const int4* p) { return __ldcg(p); }

// The same load, issued where it is written (volatile: never merged with a later, predicated
// copy of it, which would make it wait for the predicate's own load; F_EARLY_LOADS).
__device__ __forceinline__ int ld_cg_i32_now(const int* p) {
  int v;
  asm volatile("ld.global.cg.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int4 ld_cg_v4_now(const int4* p) {
  int4 v;
  asm volatile("ld.global.cg.v4.s32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// Copy nv 16-byte vectors with one warp; several loads in flight per lane.
template <bool kSrcCg>
__device__ __forceinline__ void warp_copy16(int4* __restrict__ dst, const int4* __restrict__ src,
                                            int nv, int lane) {
  constexpr int U = 8;
  for (int i = lane; i < nv; i += 32 * U) {
    int4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = i + u * 32;
      if (j < nv) v[u] = kSrcCg ? ld_cg_v4(src + j) : ld_nc_v4(src + j);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int j = i + u * 32;
      if (j < nv) dst[j] = v[u];
    }
  }
}

// Exclusive prefix sum of v[0..m) in place by one warp; v[m] = total.
__device__ __forceinline__ void warp_exclusive_scan(int* v, int m, int lane) {
  const int per = (m + 31) / 32;
  const int b0 = min(lane * per, m), b1 = min(b0 + per, m);
  int local = 0;
  for (int e = b0; e < b1; ++e) local += v[e];
  int incl = local;
  for (int d = 1; d < 32; d <<= 1) {
    const int x = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += x;
  }
  int run = incl - local;
  for (int e = b0; e < b1; ++e) {
    const int x = v[e];
    v[e] = run;
    run += x;
  }
  if (lane == 31) v[m] = incl;
}

// Largest g in [0, m) with v[g] <= q (v non-decreasing, v[0] <= q).
__device__ __forceinline__ int upper_index(const int* v, int m, int q) {
  int lo = 0, hi = m - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (v[mid] <= q) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// n / f.d for 0 <= n < 2^31 (FastDiv, layout.h): three instructions
__device__ __forceinline__ int fast_div(int n, const FastDiv& f) {
  return (int)((__umulhi((unsigned)n, f.m) + (unsigned)n) >> f.s);
}

// A warp's index among the grid's `per` warps a CTA (warp w of this CTA): CTA-major (the
// default: a CTA's warps take consecutive units, so a small row's chunks sit on one CTA) or,
// kSpread (F_SPREAD_CHUNKS), warp-major (consecutive units on consecutive CTAs, a small row's
// chunks over up to gridDim.x SMs).
template <bool kSpread>
__device__ __forceinline__ int grid_warp(int w, int per) {
  return kSpread ? w * (int)gridDim.x + (int)blockIdx.x : (int)blockIdx.x * per + w;
}

// Chunks per row for the small-T paths, whose rows get their own warps in one pass of the
// grid: a power of two (so that unit u splits into chunk u & (nch - 1) and row u >> lg by a
// mask and a shift), at most one chunk per lane-vector and about warps / units; the quotient
// comes from the float unit (any nch >= 1 is correct, it only sizes the work). Returns lg.
__device__ __forceinline__ int chunk_log2(int units, int warps, int nv) {
  const int most = max(nv / 32, 1);
  const int fit = units > 0 ? (int)__fdividef((float)warps, (float)units) : most;
  return 31 - __clz(max(1, min(most, fit)));
}

// Chunks per row for the paths sized by what arrived: the power of two at or below
// ceil(2 * warps / items), so that the grid's warps hold about one or two units each (chunk_log2
// holds at most one); at most the largest power of two with a 16-byte vector per lane in each
// chunk. Unit u is chunk u & (nch - 1) of row u >> lg, with no division after a wait. Rounding
// down, not up: a warp moves about the same bytes in fewer units, each of which pays its index
// lookups (the measurement: docs/history.md, session 22). The quotient comes from the float
// unit (any nch >= 1 is correct, it only sizes the work). Returns lg.
__device__ __forceinline__ int chunk_log2_fill(int items, int warps, int nv) {
  if (items <= 0 || items >= 2 * warps) return 0;
  const int want = (int)ceilf(__fdividef(2.f * (float)warps, (float)items));
  const int down = 31 - __clz(max(want, 1));     // floor(log2(want))
  const int most = 31 - __clz(max(nv / 32, 1));  // floor(log2(vectors / 32))
  return min(down, most);
}

// ---- error reporting into host-mapped memory ---------------------------------------------
// Out of line: these run only on an error, and inlined at every check they put an atomic, two
// system fences and the stores in the middle of the hot path's instruction stream, which a
// cold launch then fetches past.
static __device__ __noinline__ void report_timeout(ErrorBlock* err, int phase, int peer,
                                                   int rank) {
  if (atomicCAS(&err->timeout_claim, 0, 1) == 0) {
    err->timeout_phase = phase;
    err->timeout_peer = peer;
    err->timeout_rank = rank;
    __threadfence_system();
    *(volatile int*)&err->timeout = 1;
    __threadfence_system();
  }
}

// peer/own: kRouteBucket only (the peer's group rank and this rank's bucket); else -1, 0.
static __device__ __noinline__ void report_route(ErrorBlock* err, long long bad_id, int kind,
                                                    int peer = -1, int own = 0) {
  if (atomicCAS(&err->route_claim, 0, 1) == 0) {
    err->route_bad_id = bad_id;
    err->route_kind = kind;
    err->route_peer = peer;
    err->route_own = own;
    __threadfence_system();
    *(volatile int*)&err->route = 1;
    __threadfence_system();
  }
}

// Spin until *p >= target or the deadline passes. Returns false on timeout (and reports it).
__device__ __forceinline__ bool wait_geq(const uint64_t* p, uint64_t target, uint64_t deadline,
                                         ErrorBlock* err, int phase, int peer, int rank) {
  if (ld_acquire_sys(p) >= target) return true;
  uint32_t spins = 0;
  while (true) {
    if (ld_acquire_sys(p) >= target) return true;
    if ((++spins & 31u) == 0) {
      if (global_timer_ns() > deadline) {
        report_timeout(err, phase, peer, rank);
        return false;
      }
      // another CTA of this rank already gave up: stop too (host-mapped: read rarely)
      if ((spins & 1023u) == 0 && *(volatile int*)&err->timeout) return false;
    }
  }
}

// Before one thread of the CTA signals peers that the CTA's data is written: the CTA meets,
// and the signalling thread's fence.acq_rel.sys (in front of every signal) orders the whole
// CTA's stores by cumulativity. AFDEP_DEBUG=8 adds a fence in every writer thread first (the
// older form: ~4 us per exchange at T = 1, no case found that needs it; the stale reads once
// blamed on this side were the reader's, see sys_fence_after_wait).
__device__ __forceinline__ void sys_fence_then_sync(const Layout& L) {
  if (L.debug & kDbgThreadFence) fence_acq_rel_sys();
  __syncthreads();
}

// sys_fence_then_sync whose barrier also returns whether any thread's p was nonzero
__device__ __forceinline__ bool sys_fence_then_sync_or(const Layout& L, int p) {
  if (L.debug & kDbgThreadFence) fence_acq_rel_sys();
  return __syncthreads_or(p) != 0;
}

// One thread signals a peer that the data its CTA wrote before (behind a bar.sync) is there:
// a system fence, whose cumulativity covers the CTA's stores, then the flag. A release store
// after the fence is a second system fence; F_ONE_FENCE stores the flag relaxed instead (the
// fence already orders everything before it).
__device__ __forceinline__ void signal_store_sys(const Layout& L, uint64_t* p, uint64_t v) {
  fence_acq_rel_sys();
  if (L.flags & F_ONE_FENCE) st_relaxed_sys(p, v); else st_release_sys(p, v);
}

__device__ __forceinline__ void signal_add_sys(const Layout& L, uint64_t* p, uint64_t v) {
  fence_acq_rel_sys();
  if (L.flags & F_ONE_FENCE) red_add_relaxed_sys(p, v); else red_add_release_sys(p, v);
}

// After a CTA's wait for a peer's signal, before its threads read what the peer wrote: every
// reading thread fences at system scope. Measured on 2 x H200: with only the waiting thread's
// acquire and a bar.sync ordering the other threads' loads after it, a combine read the
// previous exchange's rows from the inbox (tests/gpu: AFDEP_TEST_REPLY_DELAY_MS repro).
__device__ __forceinline__ void sys_fence_after_wait() { fence_acq_rel_sys(); }

// ---- flagged 8-byte units (F_LL_SMALL) ----------------------------------------------------
// A unit is one 32-bit word in its low half and the low half of the exchange number (ll_flag)
// in its high half. A 64-bit store is single-copy atomic, so a receiver that reads the number
// reads the word with it: the sender needs no fence before a flag, the receiver none after a
// wait. (A stale unit could only match after 2^32 exchanges without one store to it.)
__device__ __forceinline__ uint64_t ll_unit(int word, uint32_t flag) {
  return ((uint64_t)flag << 32) | (uint32_t)word;
}

__device__ __forceinline__ void st_ll(uint64_t* p, int word, uint32_t flag) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(ll_unit(word, flag))
               : "memory");
}

// two units at a 16-byte aligned p
__device__ __forceinline__ void st_ll2(uint64_t* p, int w0, int w1, uint32_t flag) {
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p),
               "l"(ll_unit(w0, flag)), "l"(ll_unit(w1, flag))
               : "memory");
}

// one 16-byte row vector as four units at a 16-byte aligned p (read back by wait_ll_vec)
__device__ __forceinline__ void st_ll_vec(uint64_t* p, int4 v, uint32_t flag) {
  st_ll2(p, v.x, v.y, flag);
  st_ll2(p + 2, v.z, v.w, flag);
}

__device__ __forceinline__ uint64_t ld_ll(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void ld_ll2(const uint64_t* p, uint64_t& a, uint64_t& b) {
  asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p)
               : "memory");
}

__device__ __forceinline__ bool ll_fresh(uint64_t v, uint32_t flag) {
  return (uint32_t)(v >> 32) == flag;
}

// A unit no load returns in practice (its flag would be exchange 0x01234566's, and its word
// the same bits): traced code branches on a loaded unit against it to stamp the load's return.
constexpr uint64_t kNoUnit = 0x0123456789abcdefull;

// The flag of exchange n: never 0, which a window's zeroed units hold.
__device__ __forceinline__ uint32_t ll_flag(uint64_t n) {
  return (uint32_t)(n % 0xffffffffull) + 1u;
}

// One more spin of a wait on flagged units: true when it must give up (the deadline passed,
// reported; or another CTA of this rank gave up), checked every 32 spins as in wait_geq.
__device__ __forceinline__ bool ll_give_up(uint32_t& spins, uint64_t deadline, ErrorBlock* err,
                                           int phase, int peer, int rank) {
  if ((++spins & 31u) != 0) return false;
  if (global_timer_ns() > deadline) {
    report_timeout(err, phase, peer, rank);
    return true;
  }
  return (spins & 1023u) == 0 && *(volatile int*)&err->timeout;
}

// Spin until unit p carries `flag`; its word, or false at the deadline (reported).
__device__ __forceinline__ bool wait_ll(const uint64_t* p, uint32_t flag, uint64_t deadline,
                                        ErrorBlock* err, int phase, int peer, int rank,
                                        int& word) {
  uint32_t spins = 0;
  while (true) {
    const uint64_t v = ld_ll(p);
    if (ll_fresh(v, flag)) {
      word = (int)(uint32_t)v;
      return true;
    }
    if (ll_give_up(spins, deadline, err, phase, peer, rank)) return false;
  }
}

// Four units at a 16-byte aligned p (one 16-byte row vector), spun on until all are fresh.
__device__ __forceinline__ bool wait_ll_vec(const uint64_t* p, uint32_t flag, uint64_t deadline,
                                            ErrorBlock* err, int phase, int peer, int rank,
                                            int4& v) {
  uint32_t spins = 0;
  while (true) {
    uint64_t a, b, c, d;
    ld_ll2(p, a, b);
    ld_ll2(p + 2, c, d);
    if (ll_fresh(a, flag) && ll_fresh(b, flag) && ll_fresh(c, flag) && ll_fresh(d, flag)) {
      v = make_int4((int)(uint32_t)a, (int)(uint32_t)b, (int)(uint32_t)c, (int)(uint32_t)d);
      return true;
    }
    if (ll_give_up(spins, deadline, err, phase, peer, rank)) return false;
  }
}

// A unit loaded earlier as v: its word if it is fresh, else spin on it (wait_ll).
__device__ __forceinline__ bool ll_settle(const uint64_t* p, uint64_t v, uint32_t flag,
                                          uint64_t deadline, ErrorBlock* err, int phase, int peer,
                                          int rank, int& word) {
  if (ll_fresh(v, flag)) {
    word = (int)(uint32_t)v;
    return true;
  }
  return wait_ll(p, flag, deadline, err, phase, peer, rank, word);
}

// ---- exchange numbers ----------------------------------------------------------------------
// Exchange number of this launch: every CTA counts its own launches (a phase's grid is the
// same at every launch).
__device__ __forceinline__ uint64_t launch_number(const Layout& L, int phase) {
  return L.counters[phase * L.Gmax + blockIdx.x] + 1;
}

// Record this launch's exchange number; thread 0, after the CTA's last use of it.
__device__ __forceinline__ void end_launch(const Layout& L, int phase, uint64_t n) {
  if (threadIdx.x != 0) return;
  L.counters[phase * L.Gmax + blockIdx.x] = n;
}

// ---- optional stage trace (L.trace null: one predictable branch) -----------------------
// Thread 0 of each CTA keeps its stamps in shared memory and writes them to the ring at the
// kernel's end (trace_flush). A stamp is then one %globaltimer read and a shared store: it
// never waits for the exchange number (the ring slot's address depends on it), which a
// global store in the middle of a stage did (CTA 0 stalled at the start stamp until the
// number's load returned, which the untraced kernel only needs at its signal).
__device__ __forceinline__ uint64_t* trace_stamps() {
  __shared__ uint64_t s_stamps[kTrSm];  // the time points (kTrSm is written at the flush)
  return s_stamps;
}

// First thing of a kernel: no stamp yet (0 = not reached in this launch).
__device__ __forceinline__ void trace_begin(const Layout& L) {
  if (L.trace == nullptr || threadIdx.x != 0) return;
  uint64_t* s = trace_stamps();
  for (int i = 0; i < kTrSm; ++i) s[i] = 0;
}

// Called by every thread at a converged point; thread 0 stamps `pt` and, with max_pt >= 0,
// the "latest over CTAs" point `max_pt` with the same time.
__device__ __forceinline__ void trace_mark(const Layout& L, int pt, int max_pt) {
  if (L.trace == nullptr || threadIdx.x != 0) return;
  const uint64_t t = global_timer_ns();
  uint64_t* s = trace_stamps();
  s[pt] = t;
  if (max_pt >= 0) s[max_pt] = t;
}

// Last thing before end_launch (thread 0): CTA 0's stamps into the ring slot of exchange n
// of `phase`, 0 for a point this launch did not reach (else the slot's exchange of kTraceRing
// launches before would show through, e.g. a count table where a lone token's receive built
// none); every CTA folds its latest-over-CTAs points in with atomicMax (always reached).
__device__ __forceinline__ void trace_flush(const Layout& L, int phase, uint64_t n) {
  if (L.trace == nullptr || threadIdx.x != 0) return;
  const uint64_t* s = trace_stamps();
  uint64_t* p = L.trace + ((n % kTraceRing) * 2 + phase) * kTracePts;
  if (blockIdx.x == 0) {
    uint32_t sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    p[kTrSm] = (uint64_t)sm + 1;
  }
  for (int i = 0; i < kTrSm; ++i) {
    if (i == kTrMaxSent || i == kTrMaxWaited || i == kTrMaxEnd || i == kTrMaxStart) {
      if (s[i] != 0)
        atomicMax(reinterpret_cast<unsigned long long*>(p + i), (unsigned long long)s[i]);
    } else if (blockIdx.x == 0) {
      p[i] = s[i];
    }
  }
}

// ---- window addressing -------------------------------------------------------------------
__device__ __forceinline__ char* peer_base(const Layout& L, int r) {
  return reinterpret_cast<char*>(L.peer_bases[r]);
}

// The windows the kernels address by role index, and their own. F_PARAM_BASES: from the
// parameter block (the host's entries are 0 without it, and past kParamBases); otherwise the
// role's rank table, then the peer table: two dependent global loads, which sat in front of
// the dispatch's first remote store and of every reply row's.
__device__ __forceinline__ char* own_window(const Layout& L) {
  return L.own_base ? reinterpret_cast<char*>(L.own_base) : peer_base(L, L.rank);
}

__device__ __forceinline__ char* ffn_window(const Layout& L, int f) {
  const uint64_t b = f < kParamBases ? L.ffn_base[f] : 0;
  return b ? reinterpret_cast<char*>(b) : peer_base(L, L.rank_of_ffn[f]);
}

__device__ __forceinline__ char* attn_window(const Layout& L, int ai) {
  const uint64_t b = ai < kParamBases ? L.attn_base[ai] : 0;
  return b ? reinterpret_cast<char*>(b) : peer_base(L, L.rank_of_attn[ai]);
}

__device__ __forceinline__ uint64_t* sig_slot(char* base, int64_t off, int W, int S, int src, int ch) {
  return reinterpret_cast<uint64_t*>(base + off) + (size_t)src * S + ch;
}

// count block (header + per-local-expert counts) of (src, ch) inside a window
__device__ __forceinline__ char* cnt_block(const Layout& L, char* base, int src, int ch) {
  return base + L.off_cnt + ((size_t)src * L.S + ch) * L.cnt_stride;
}

// Per-channel entry barrier among all ranks (symmetric mode only).
__device__ __forceinline__ bool entry_barrier(const Layout& L, int phase, uint64_t n,
                                              uint64_t deadline, ErrorBlock* err) {
  const int c = blockIdx.x;
  const int64_t off = L.off_entry + (int64_t)phase * L.W * L.S * 8;
  for (int p = threadIdx.x; p < L.W; p += blockDim.x)
    st_release_sys(sig_slot(peer_base(L, p), off, L.W, L.S, L.rank, c), n);
  bool ok = true;
  for (int p = threadIdx.x; p < L.W && ok; p += blockDim.x)
    ok = wait_geq(sig_slot(own_window(L), off, L.W, L.S, p, c), n, deadline, err, phase, p,
                  L.rank);
  return __syncthreads_and(ok ? 1 : 0);
}

// Full exit barrier among all ranks and all channels (symmetric mode only).
__device__ __forceinline__ bool exit_barrier(const Layout& L, int phase, uint64_t n,
                                             uint64_t deadline, ErrorBlock* err) {
  const int c = blockIdx.x;
  const int64_t off = L.off_exit + (int64_t)phase * L.W * L.S * 8;
  sys_fence_then_sync(L);
  for (int p = threadIdx.x; p < L.W; p += blockDim.x)
    signal_store_sys(L, sig_slot(peer_base(L, p), off, L.W, L.S, L.rank, c), n);
  bool ok = true;
  for (int i = threadIdx.x; i < L.W * L.S && ok; i += blockDim.x) {
    ok = wait_geq(sig_slot(own_window(L), off, L.W, L.S, i / L.S, i % L.S), n, deadline,
                  err, phase, i / L.S, L.rank);
  }
  return __syncthreads_and(ok ? 1 : 0);
}

}  // namespace afdep
