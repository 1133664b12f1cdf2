// Dispatch phase: Attention ranks send each token once per destination FFN rank; FFN ranks
// expand what arrived into the expert-major layout. One kernel serves both roles; the control
// flags select the role-aware protocol or the symmetric union baseline (docs/protocol.md).
#include "kernels/common.cuh"
#include "core/launch.h"

namespace afdep {

namespace {

constexpr unsigned kFull = 0xffffffffu;

// Sender side of one token (one warp). count_only: only claim slots and count experts.
__device__ void send_token(const Layout& L, const DispatchArgs& a, int t, bool count_only,
                           bool add_ecnt, int* s_cnt, int* s_ecnt, int src_idx, int c) {
  const int lane = threadIdx.x & 31;
  long long e = -1;
  float w = 0.f;
  if (lane < L.k) {
    const size_t i = (size_t)t * L.k + lane;
    e = a.ids_64 ? reinterpret_cast<const long long*>(a.expert_ids)[i]
                 : (long long)reinterpret_cast<const int*>(a.expert_ids)[i];
    w = a.weights[i];
  }
  const bool valid = lane < L.k && e >= 0 && e < L.E;
  if (!count_only && lane < L.k && (e < -1 || e >= L.E)) report_route(L.err, e, 0);
  const int f = valid ? (int)(e / L.El) : -1;
  const unsigned lo = __reduce_or_sync(kFull, (valid && f < 32) ? (1u << f) : 0u);
  const unsigned hi = __reduce_or_sync(kFull, (valid && f >= 32) ? (1u << (f - 32)) : 0u);
  uint64_t mask = (uint64_t)lo | ((uint64_t)hi << 32);
  if (!count_only && lane == 0) a.route[t] = (int64_t)mask;
  while (mask) {
    const int fd = __ffsll((long long)mask) - 1;
    mask &= mask - 1;
    const unsigned b = __ballot_sync(kFull, valid && f == fd);
    const int r = __popc(b & lanemask_lt());
    const int nloc = min(__popc(b), L.R);
    if (!count_only && lane == 0 && __popc(b) > L.R) report_route(L.err, fd, 1);
    int slot = 0;
    if (lane == 0) slot = atomicAdd(&s_cnt[fd], 1);
    slot = __shfl_sync(kFull, slot, 0);
    const bool mine = valid && f == fd && r < L.R;
    if (add_ecnt && mine) atomicAdd(&s_ecnt[e], 1);
    if (count_only) continue;
    if (slot >= L.slots) {  // cannot happen with T <= C; never write out of bounds
      if (lane == 0) report_route(L.err, t, 2);
      continue;
    }
    char* base = peer_base(L, L.rank_of_ffn[fd]);
    const size_t gslot = ((size_t)src_idx * L.S + c) * L.slots + slot;
    int* meta = reinterpret_cast<int*>(base + L.off_meta) + gslot * L.meta_ints;
    if (lane == 0) {
      meta[0] = t;
      meta[1] = nloc;
    }
    if (mine) {
      meta[2 + r] = (int)(e - (long long)fd * L.El);
      meta[2 + L.R + r] = __float_as_int(w);
    }
    const int4* src = reinterpret_cast<const int4*>(static_cast<const char*>(a.x) +
                                                    (size_t)t * L.row_bytes);
    int4* dst = reinterpret_cast<int4*>(base + L.off_payload + gslot * L.row_bytes);
    warp_copy16<false>(dst, src, L.row_bytes / 16, lane);
    if (L.scale_cols) {
      const float* ss = a.x_scales + (size_t)t * L.scale_cols;
      float* ds = reinterpret_cast<float*>(base + L.off_scales) + gslot * L.scale_cols;
      for (int i = lane; i < L.scale_cols; i += 32) ds[i] = ss[i];
    }
  }
}

// Write this CTA's counts into the count block (rank, c) of each target, then release seq.
__device__ void publish_counts(const Layout& L, uint64_t n, bool all_peers, const int* s_cnt,
                               const int* s_ecnt) {
  const int c = blockIdx.x;
  const int ntg = all_peers ? L.W : L.F;
  const int per = L.El + 1;
  for (int i = threadIdx.x; i < ntg * per; i += blockDim.x) {
    const int ti = i / per, e = i % per;
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
    char* blk = cnt_block(L, peer_base(L, d), L.rank, c);
    int v = 0;
    if (f >= 0) v = (e == 0) ? s_cnt[f] : s_ecnt[(size_t)f * L.El + (e - 1)];
    if (e == 0)
      *reinterpret_cast<int*>(blk + 8) = v;
    else
      reinterpret_cast<int*>(blk + 16)[e - 1] = v;
  }
  __syncthreads();
  for (int ti = threadIdx.x; ti < ntg; ti += blockDim.x) {
    const int d = all_peers ? ti : L.rank_of_ffn[ti];
    fence_acq_rel_sys();
    st_release_sys(reinterpret_cast<uint64_t*>(cnt_block(L, peer_base(L, d), L.rank, c)), n);
  }
}

__device__ __forceinline__ int blk_count(const Layout& L, char* mine, int src_rank, int ch) {
  return ld_cg_i32(reinterpret_cast<const int*>(cnt_block(L, mine, src_rank, ch) + 8));
}

// Receiver side: expand every arrived token into the expert-major outputs.
__device__ void expand(const Layout& L, const DispatchArgs& a, uint64_t n, int* smem) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int c = blockIdx.x;
  char* mine = peer_base(L, L.rank);
  int* s_off = smem;               // [El + 1] per-expert totals, then prefix sums
  int* s_rc = smem + L.El + 1;     // [A * S] tokens per (source, channel)
  __shared__ int s_rows[kWarps][32];
  const int nreg = L.A * L.S;
  for (int e = tid; e <= L.El; e += blockDim.x) s_off[e] = 0;
  for (int i = tid; i < nreg; i += blockDim.x)
    s_rc[i] = blk_count(L, mine, L.rank_of_attn[i / L.S], i % L.S);
  __syncthreads();
  // per-expert totals over every (source, channel): independent loads, shared atomics
  for (int i = tid; i < nreg * L.El; i += blockDim.x) {
    const int g = i / L.El, e = i % L.El;
    const int v = ld_cg_i32(
        reinterpret_cast<const int*>(cnt_block(L, mine, L.rank_of_attn[g / L.S], g % L.S) + 16) + e);
    if (v) atomicAdd(&s_off[e], v);
  }
  __syncthreads();
  if (warp == 0) {  // exclusive prefix sums over El entries, one warp
    const int per = (L.El + 31) / 32;
    const int b0 = min(lane * per, L.El), b1 = min(b0 + per, L.El);
    int local = 0;
    for (int e = b0; e < b1; ++e) local += s_off[e];
    int incl = local;
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    int run = incl - local;
    for (int e = b0; e < b1; ++e) {
      const int v = s_off[e];
      s_off[e] = run;
      run += v;
    }
    if (lane == 31) s_off[L.El] = incl;
  }
  __syncthreads();
  trace_mark(L, kPhaseDispatch, n, kTrReady, -1);
  const int rows_cap = L.A * a.bucket * L.R;
  int* cur = L.cursors + (size_t)(n & 1) * L.El;
  if (c == 0) {
    int* nxt = L.cursors + (size_t)((n + 1) & 1) * L.El;
    for (int e = tid; e <= L.El; e += blockDim.x) {
      a.out_offsets[e] = min(s_off[e], rows_cap);
      if (e < L.El) nxt[e] = 0;
    }
    for (int ai = tid; ai < L.A; ai += blockDim.x) {
      int tot = 0;
      for (int ch = 0; ch < L.S; ++ch) tot += s_rc[ai * L.S + ch];
      a.out_num_tokens[ai] = min(tot, a.bucket);
    }
  }
  const bool role = (L.flags & F_ROLE_BUFFERS) != 0;
  for (int g = c; g < L.A * L.S; g += gridDim.x) {
    const int ai = g / L.S, ch = g % L.S;
    const int sr = L.rank_of_attn[ai];
    const int cnt = min(s_rc[g], L.slots);
    if (cnt == 0) continue;
    int s0 = 0;
    for (int q = 0; q < ch; ++q) s0 += s_rc[ai * L.S + q];
    const int src_idx = role ? ai : sr;
    for (int j = warp; j < cnt; j += kWarps) {
      const int s = s0 + j;
      if (s >= a.bucket) {
        if (lane == 0) report_route(L.err, s, 2);
        continue;
      }
      const size_t gslot = ((size_t)src_idx * L.S + ch) * L.slots + j;
      const int* meta = reinterpret_cast<const int*>(mine + L.off_meta) + gslot * L.meta_ints;
      const int tok = ld_cg_i32(meta);
      const int nloc = min(max(ld_cg_i32(meta + 1), 0), L.R);
      int myrow = -1;
      float myw = 0.f;
      if (lane < nloc) {
        const int el = ld_cg_i32(meta + 2 + lane);
        myw = __int_as_float(ld_cg_i32(meta + 2 + L.R + lane));
        if (el >= 0 && el < L.El) {
          const int row = s_off[el] + atomicAdd(&cur[el], 1);
          if (row < s_off[el + 1] && row < rows_cap) myrow = row;
        }
      }
      const size_t item = (size_t)ai * a.bucket + s;
      if (lane < L.R) a.out_token_rows[item * L.R + lane] = myrow;
      if (lane == 0) a.out_token_index[item] = tok;
      if (myrow >= 0) {
        a.out_weights[myrow] = myw;
        a.out_src_rank[myrow] = sr;
        a.out_src_token[myrow] = tok;
      }
      s_rows[warp][lane] = myrow;
      __syncwarp();
      const int4* src = reinterpret_cast<const int4*>(mine + L.off_payload + gslot * L.row_bytes);
      const int nv = L.row_bytes / 16;
      for (int r = 0; r < nloc; ++r) {
        const int row = s_rows[warp][r];
        if (row < 0) continue;
        int4* dst = reinterpret_cast<int4*>(static_cast<char*>(a.out_x) + (size_t)row * L.row_bytes);
        warp_copy16<true>(dst, src, nv, lane);
        if (L.scale_cols) {
          const float* ss = reinterpret_cast<const float*>(mine + L.off_scales) + gslot * L.scale_cols;
          float* ds = a.out_scales + (size_t)row * L.scale_cols;
          for (int i = lane; i < L.scale_cols; i += 32) ds[i] = __int_as_float(ld_cg_i32(reinterpret_cast<const int*>(ss + i)));
        }
      }
      __syncwarp();
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(Layout L, DispatchArgs a) {
  extern __shared__ int smem[];
  const int c = blockIdx.x, tid = threadIdx.x, warp = tid >> 5;
  const uint32_t fl = L.flags;
  const uint64_t n = L.counters[kPhaseDispatch * L.S + c] + 1;
  const uint64_t deadline = global_timer_ns() + L.timeout_ns;
  const bool all_peers = !(fl & F_ROLE_WARPS) || !(fl & F_ONE_WAY_COUNTS);
  const bool count_first = !(fl & F_ONE_WAY_COUNTS);
  const bool rwo = (fl & F_RECEIVER_WAIT_ONLY) != 0;
  char* mine = peer_base(L, L.rank);
  trace_mark(L, kPhaseDispatch, n, kTrStart, -1);

  if (!(fl & F_NO_ENTRY_BARRIER)) {
    if (!entry_barrier(L, kPhaseDispatch, n, deadline, L.err)) return;
  }

  if (a.do_send) {
    int* s_cnt = smem;         // [F] slots claimed per destination FFN
    int* s_ecnt = smem + L.F;  // [E] rows per global expert
    const int T = a.real_send ? a.T : 0;
    const int chunk = (T + L.S - 1) / L.S;
    const int lo = min(T, c * chunk), hi = min(T, lo + chunk);
    const int src_idx = (fl & F_ROLE_BUFFERS) ? L.my_index : L.rank;
    for (int i = tid; i < L.F + L.E; i += blockDim.x) smem[i] = 0;
    __syncthreads();
    if (count_first) {
      for (int t = lo + warp; t < hi; t += kWarps)
        send_token(L, a, t, true, true, s_cnt, s_ecnt, src_idx, c);
      __syncthreads();
      publish_counts(L, n, true, s_cnt, s_ecnt);
      // everyone spins until every rank's counts arrived
      bool ok = true;
      for (int i = tid; i < L.W * L.S && ok; i += blockDim.x)
        ok = wait_geq(reinterpret_cast<const uint64_t*>(cnt_block(L, mine, i / L.S, i % L.S)), n,
                      deadline, L.err, kPhaseDispatch, i / L.S, L.rank);
      if (!__syncthreads_and(ok ? 1 : 0)) return;
      for (int i = tid; i < L.F; i += blockDim.x) s_cnt[i] = 0;
      __syncthreads();
    }
    for (int t = lo + warp; t < hi; t += kWarps)
      send_token(L, a, t, false, !count_first, s_cnt, s_ecnt, src_idx, c);
    __syncthreads();
    if (!count_first) {
      publish_counts(L, n, all_peers, s_cnt, s_ecnt);
    } else if (rwo) {
      for (int d = tid; d < L.W; d += blockDim.x) {
        fence_acq_rel_sys();
        st_release_sys(sig_slot(peer_base(L, d), L.off_disp_done, L.W, L.S, L.rank, c), n);
      }
    }
    trace_mark(L, kPhaseDispatch, n, kTrSent, kTrMaxSent);
  }

  if (!rwo) {
    if (!exit_barrier(L, kPhaseDispatch, n, deadline, L.err)) return;
  }

  if (a.do_recv) {
    const int nsrc = all_peers ? L.W : L.A;
    bool ok = true;
    for (int i = tid; i < nsrc * L.S && ok; i += blockDim.x) {
      const int sr = all_peers ? i / L.S : L.rank_of_attn[i / L.S];
      const int ch = i % L.S;
      ok = wait_geq(reinterpret_cast<const uint64_t*>(cnt_block(L, mine, sr, ch)), n, deadline,
                    L.err, kPhaseDispatch, sr, L.rank);
      if (ok && count_first && rwo)
        ok = wait_geq(sig_slot(mine, L.off_disp_done, L.W, L.S, sr, ch), n, deadline, L.err,
                      kPhaseDispatch, sr, L.rank);
    }
    if (!__syncthreads_and(ok ? 1 : 0)) return;
    trace_mark(L, kPhaseDispatch, n, kTrWaited, kTrMaxWaited);
    if (a.real_recv) expand(L, a, n, smem);
  }

  __syncthreads();
  trace_mark(L, kPhaseDispatch, n, kTrEnd, kTrMaxEnd);
  if (tid == 0) L.counters[kPhaseDispatch * L.S + c] = n;
}

}  // namespace

size_t dispatch_smem_bytes(const Layout& L) {
  const size_t send = (size_t)(L.F + L.E) * 4;
  const size_t recv = (size_t)(L.El + 1 + L.A * L.S) * 4;
  return send > recv ? send : recv;
}

cudaError_t dispatch_prepare(const Layout& L) {
  const size_t smem = dispatch_smem_bytes(L);
  if (smem > 48 * 1024)
    return cudaFuncSetAttribute(dispatch_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)smem);
  return cudaSuccess;
}

cudaError_t launch_dispatch(const Layout& L, const DispatchArgs& a, cudaStream_t stream) {
  dispatch_kernel<<<L.S, kThreads, dispatch_smem_bytes(L), stream>>>(L, a);
  return cudaGetLastError();
}

}  // namespace afdep
