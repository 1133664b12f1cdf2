#include "afdep/comm.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

#include "afdep/launch.h"

namespace afdep {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("torch_afdep CUDA: ") + what + ": " +
                             cudaGetErrorString(e));
}

// Make `device` current for the scope (the caller's torch device normally already is).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != device) check(cudaSetDevice(device), "cudaSetDevice");
    dev_ = device;
  }
  ~DeviceGuard() {
    if (prev_ != dev_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0, dev_ = 0;
};

}  // namespace

Comm::Comm(const CommConfig& cfg) : device_(cfg.device) {
  DeviceGuard g(device_);
  Layout& L = L_;
  L.rank = cfg.rank;
  L.W = (int)cfg.is_ffn.size();
  L.F = 0;
  L.A = 0;
  std::vector<int> ffn, attn;
  for (int r = 0; r < L.W; ++r) (cfg.is_ffn[r] ? ffn : attn).push_back(r);
  L.F = (int)ffn.size();
  ffn_rank0_ = ffn.empty() ? -1 : ffn[0];
  is_ffn_ = cfg.is_ffn;
  L.A = (int)attn.size();
  if (L.F < 1 || L.A < 1) throw std::invalid_argument("need at least one FFN and one Attention rank");
  if (L.F > 64) throw std::invalid_argument("at most 64 FFN ranks");
  if (cfg.rank < 0 || cfg.rank >= L.W) throw std::invalid_argument("rank out of range");
  L.is_ffn = cfg.is_ffn[cfg.rank];
  L.my_index = 0;
  for (int r = 0; r < cfg.rank; ++r) L.my_index += (cfg.is_ffn[r] == L.is_ffn);
  L.S = cfg.num_sms;
  L.H = cfg.hidden;
  L.elem = cfg.elem;
  L.row_bytes = cfg.hidden * cfg.elem;
  L.scale_cols = cfg.scale_cols;
  L.E = cfg.num_experts;
  if (L.E % L.F) throw std::invalid_argument("num_experts must be divisible by ffn ranks");
  L.El = L.E / L.F;
  L.k = cfg.top_k;
  L.R = L.k < L.El ? L.k : L.El;
  L.C = cfg.capacity;
  // the count block carries the bucket beside the ahead mode in one int (layout.h)
  if (L.C > kMaxBucket) throw std::invalid_argument("capacity too large for the CUDA path");
  L.flags = cfg.flags & kAllRoleAware;
  L.timeout_ns = (uint64_t)(cfg.timeout_s * 1e9);
  if (L.k > 32) throw std::invalid_argument("the CUDA path supports top_k <= 32");
  if (L.row_bytes % 16 || L.H % 8) throw std::invalid_argument("hidden rows must be 16-byte multiples");
  if (L.S < 1 || L.S > 1024) throw std::invalid_argument("num_sms out of range");
  if (L.A > kMaxAttn) throw std::invalid_argument("at most 1024 Attention ranks");
  if (L.F > kMaxFfn) throw std::invalid_argument("at most 64 FFN ranks");
  if (cfg.ffn_ctas < 1 || cfg.ffn_ctas > 4096) throw std::invalid_argument("ffn_ctas out of range");
  if (cfg.attn_ctas < 1 || cfg.attn_ctas > 4096) throw std::invalid_argument("attn_ctas out of range");
  // The FFN's receive/reply and the Attention's combine do mostly local work (expansion,
  // reduction, collect) and may use more CTAs than the senders' S channels; only with the
  // directional protocol (layout.h kWideNeeds).
  const bool wide = (L.flags & kWideNeeds) == kWideNeeds;
  L.G = wide ? cfg.ffn_ctas : L.S;
  L.Ga = wide ? cfg.attn_ctas : L.S;
  L.early = (L.flags & kEarlyNeeds) == kEarlyNeeds ? 1 : 0;
  L.stream = (L.flags & kStreamNeeds) == kStreamNeeds ? 1 : 0;
  L.tokens = cfg.token_layout ? 1 : 0;
  // the token layout's view needs rows of exactly H elements, one after the other
  if (L.tokens && (int64_t)L.row_bytes != (int64_t)L.H * L.elem)
    throw std::invalid_argument("token layout: payload rows must be H * elem bytes");
  L.Gmax = L.S;
  if (L.G > L.Gmax) L.Gmax = L.G;
  if (L.Ga > L.Gmax) L.Gmax = L.Ga;
  compute_offsets(L);
  union_bytes_ = union_window_bytes(L);
  if (dispatch_smem_bytes(L) > 200 * 1024)
    throw std::invalid_argument("num_experts too large for the CUDA dispatch kernel's shared memory");

  // device workspace: peer table [W] u64 | counters [2][Gmax] u64 | ffn [F] | attn [A] |
  // mismatch [A]
  const size_t o_peer = 0;
  const size_t o_ctr = o_peer + (size_t)L.W * 8;
  const size_t o_ffn = o_ctr + (size_t)2 * L.Gmax * 8;
  const size_t o_attn = o_ffn + (size_t)L.F * 4;
  const size_t o_mism = o_attn + (size_t)L.A * 4;
  const size_t ws_bytes = o_mism + (size_t)L.A * 4;
  check(cudaMalloc(&workspace_, ws_bytes), "cudaMalloc(workspace)");
  check(cudaMemset(workspace_, 0, ws_bytes), "cudaMemset(workspace)");
  char* ws = static_cast<char*>(workspace_);
  check(cudaMemcpy(ws + o_ffn, ffn.data(), ffn.size() * 4, cudaMemcpyHostToDevice), "copy ffn");
  check(cudaMemcpy(ws + o_attn, attn.data(), attn.size() * 4, cudaMemcpyHostToDevice), "copy attn");
  L.peer_bases = reinterpret_cast<const uint64_t*>(ws + o_peer);
  L.counters = reinterpret_cast<uint64_t*>(ws + o_ctr);
  L.rank_of_ffn = reinterpret_cast<const int*>(ws + o_ffn);
  L.rank_of_attn = reinterpret_cast<const int*>(ws + o_attn);
  L.mismatch = reinterpret_cast<int*>(ws + o_mism);

  void* eh = nullptr;
  check(cudaHostAlloc(&eh, sizeof(ErrorBlock), cudaHostAllocMapped), "cudaHostAlloc(error block)");
  err_host_ = static_cast<ErrorBlock*>(eh);
  std::memset(err_host_, 0, sizeof(ErrorBlock));
  void* ed = nullptr;
  check(cudaHostGetDevicePointer(&ed, eh, 0), "cudaHostGetDevicePointer");
  L.err = static_cast<ErrorBlock*>(ed);

  // Stage trace for diagnostics (benchmarks/trace.py); off unless the config asks for it.
  if (cfg.trace) {
    const size_t tb = (size_t)kTraceRing * 2 * kTracePts * 8;
    check(cudaMalloc(&trace_, tb), "cudaMalloc(trace)");
    check(cudaMemset(trace_, 0, tb), "cudaMemset(trace)");
    L.trace = static_cast<uint64_t*>(trace_);
  }

  // Signal-value printout for debugging a protocol (diagnostics only; never in benchmarks).
  L.debug = cfg.debug;

  check(dispatch_prepare(L), "cudaFuncSetAttribute(dispatch)");
  if (cfg.transport == "nccl") {
    transport_ = make_nccl_transport(device_, cfg.rank, L.W);
    // A symmetric NCCL window has one size on every rank: the larger role's window (still
    // below the union layout, which holds both inboxes from every rank).
    Layout other = L;
    other.is_ffn = L.is_ffn ? 0 : 1;
    compute_offsets(other);
    if (other.window_bytes > L.window_bytes) L.window_bytes = other.window_bytes;
  } else if (cfg.transport == "ipc") {
    transport_ = make_ipc_transport(device_);
  } else {
    throw std::invalid_argument("transport must be 'ipc' or 'nccl', got '" + cfg.transport + "'");
  }
  transport_->allocate((size_t)L.window_bytes);
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

Comm::~Comm() {
  try {
    close(false);
  } catch (...) {
  }
}

std::string Comm::local_handle() { return transport_->export_handle(); }

void Comm::open(const std::vector<std::string>& handles) {
  DeviceGuard g(device_);
  if ((int)handles.size() != L_.W) throw std::invalid_argument("need one handle per rank");
  transport_->open_peers(handles, L_.rank);
  const auto& b = transport_->peer_bases();
  check(cudaMemcpy(const_cast<uint64_t*>(L_.peer_bases), b.data(), b.size() * 8,
                   cudaMemcpyHostToDevice),
        "copy peer table");
  if (L_.flags & F_PARAM_BASES) {  // the kernels' common bases without a global load
    L_.own_base = b[L_.rank];
    int f = 0, a = 0;
    for (int r = 0; r < L_.W; ++r) {
      if (is_ffn_[r] && f < kParamBases) L_.ffn_base[f] = b[r];
      if (!is_ffn_[r] && a < kParamBases) L_.attn_base[a] = b[r];
      (is_ffn_[r] ? f : a) += 1;
    }
  }
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  opened_ = true;
}

static void need(bool ok, const char* msg) {
  if (!ok) throw std::runtime_error(msg);
}

void Comm::dispatch(uint64_t x, uint64_t x_scales, uint64_t expert_ids, bool ids_64,
                    uint64_t weights, uint64_t route, int T, uint64_t stream, int bucket) {
  need(opened_ && !closed_, "torch_afdep CUDA: transport not open");
  need(!L_.is_ffn, "dispatch runs on Attention ranks");
  need(T >= 0 && T <= L_.C, "T exceeds capacity_tokens_per_rank");
  need(bucket == 0 || (bucket >= T && bucket <= L_.C),
       "bucket must satisfy T <= bucket <= capacity_tokens_per_rank");
  DeviceGuard g(device_);
  const bool all_peers = !(L_.flags & F_ROLE_WARPS) || !(L_.flags & F_ONE_WAY_COUNTS);
  DispatchArgs a{};
  a.x = reinterpret_cast<const void*>(x);
  a.x_scales = reinterpret_cast<const float*>(x_scales);
  a.expert_ids = reinterpret_cast<const void*>(expert_ids);
  a.ids_64 = ids_64 ? 1 : 0;
  a.weights = reinterpret_cast<const float*>(weights);
  a.route = reinterpret_cast<int64_t*>(route);
  a.T = T;
  a.do_send = 1;
  a.real_send = 1;
  a.do_recv = all_peers ? 1 : 0;
  a.real_recv = 0;
  a.bucket = bucket;  // carried in the count blocks; the FFN compares it with its own
  // the token layout's inbox stride is the bucket's share per channel (the FFN's view); the
  // expert layout's units (F_LL_EXPERTS) decide from the bucket on both sides
  need(bucket >= 1 || !L_.tokens, "the token layout needs a declared bucket");
  need(bucket >= 1 || !L_.llx, "AFDEP_LL_EXPERTS needs a declared bucket");
  a.stride = dispatch_stride(L_, bucket);
  check(launch_dispatch(L_, a, L_.S, reinterpret_cast<cudaStream_t>(stream), &last_form_[0]),
        "launch dispatch");
}

void Comm::receive(int bucket, uint64_t x, uint64_t x_scales, uint64_t weights, uint64_t offsets,
                   uint64_t src_rank, uint64_t src_token, uint64_t token_rows,
                   uint64_t token_index, uint64_t num_tokens, uint64_t stream) {
  need(opened_ && !closed_, "torch_afdep CUDA: transport not open");
  need(L_.is_ffn, "receive runs on FFN ranks");
  need(!L_.tokens, "receive is the expert layout's; the token layout calls receive_tokens");
  need(bucket >= 1 && bucket <= L_.C, "bucket out of range");
  DeviceGuard g(device_);
  const bool all_peers = !(L_.flags & F_ROLE_WARPS) || !(L_.flags & F_ONE_WAY_COUNTS);
  DispatchArgs a{};
  a.stride = dispatch_stride(L_, bucket);
  a.do_send = all_peers ? 1 : 0;
  a.real_send = 0;
  a.T = 0;
  a.do_recv = 1;
  a.real_recv = 1;
  a.bucket = bucket;
  a.out_x = reinterpret_cast<void*>(x);
  a.out_scales = reinterpret_cast<float*>(x_scales);
  a.out_weights = reinterpret_cast<float*>(weights);
  a.out_offsets = reinterpret_cast<int*>(offsets);
  a.out_src_rank = reinterpret_cast<int*>(src_rank);
  a.out_src_token = reinterpret_cast<int*>(src_token);
  a.out_token_rows = reinterpret_cast<int*>(token_rows);
  a.out_token_index = reinterpret_cast<int*>(token_index);
  a.out_num_tokens = reinterpret_cast<int*>(num_tokens);
  check(launch_dispatch(L_, a, L_.G,
                        reinterpret_cast<cudaStream_t>(stream), &last_form_[0]),
        "launch receive");
  reply_due_ = true;
}

void Comm::reply(int bucket, uint64_t rows, uint64_t token_rows, uint64_t token_index,
                 uint64_t num_tokens, uint64_t stream) {
  need(opened_ && !closed_, "torch_afdep CUDA: transport not open");
  need(L_.is_ffn, "reply runs on FFN ranks");
  need(!L_.tokens, "reply is the expert layout's; the token layout calls reply_tokens");
  need(bucket >= 1 && bucket <= L_.C, "bucket out of range");
  DeviceGuard g(device_);
  CombineArgs a{};
  a.do_send = 1;
  a.real_send = 1;
  a.rows = reinterpret_cast<const void*>(rows);
  a.token_rows = reinterpret_cast<const int*>(token_rows);
  a.token_index = reinterpret_cast<const int*>(token_index);
  a.num_tokens = reinterpret_cast<const int*>(num_tokens);
  a.bucket = bucket;
  a.div_bucket = make_fast_div((uint32_t)bucket);
  a.do_recv = (L_.flags & F_ROLE_WARPS) ? 0 : 1;
  a.real_recv = 0;
  check(launch_combine(L_, a, L_.G,
                       reinterpret_cast<cudaStream_t>(stream), &last_form_[1]),
        "launch reply");
  reply_due_ = false;
}

void Comm::receive_tokens(int bucket, uint64_t expert_ids, uint64_t weights, uint64_t src_rank,
                          uint64_t src_token, uint64_t num_tokens, uint64_t stream) {
  need(opened_ && !closed_, "torch_afdep CUDA: transport not open");
  need(L_.is_ffn, "receive_tokens runs on FFN ranks");
  need(L_.tokens, "receive_tokens needs the token layout");
  need(bucket >= 1 && bucket <= L_.C, "bucket out of range");
  DeviceGuard g(device_);
  const bool all_peers = !(L_.flags & F_ROLE_WARPS) || !(L_.flags & F_ONE_WAY_COUNTS);
  DispatchArgs a{};
  a.stride = dispatch_stride(L_, bucket);
  a.do_send = all_peers ? 1 : 0;  // the symmetric protocol's dummy sender
  a.real_send = 0;
  a.T = 0;
  a.do_recv = 1;
  a.real_recv = 1;
  a.bucket = bucket;
  a.out_expert_ids = reinterpret_cast<int*>(expert_ids);
  a.out_weights = reinterpret_cast<float*>(weights);
  a.out_src_rank = reinterpret_cast<int*>(src_rank);
  a.out_src_token = reinterpret_cast<int*>(src_token);
  a.out_num_tokens = reinterpret_cast<int*>(num_tokens);
  check(launch_dispatch(L_, a, L_.G,
                        reinterpret_cast<cudaStream_t>(stream), &last_form_[0]),
        "launch receive_tokens");
  reply_due_ = true;
}

void Comm::reply_tokens(int bucket, uint64_t rows, uint64_t src_token, uint64_t num_tokens,
                        uint64_t stream) {
  need(opened_ && !closed_, "torch_afdep CUDA: transport not open");
  need(L_.is_ffn, "reply_tokens runs on FFN ranks");
  need(L_.tokens, "reply_tokens needs the token layout");
  need(bucket >= 1 && bucket <= L_.C, "bucket out of range");
  DeviceGuard g(device_);
  CombineArgs a{};
  a.do_send = 1;
  a.real_send = 1;
  a.tokens = 1;
  a.rps = L_.S * ((bucket + L_.S - 1) / L_.S);
  a.div_rps = make_fast_div((uint32_t)a.rps);
  a.rows = reinterpret_cast<const void*>(rows);
  a.src_token = reinterpret_cast<const int*>(src_token);
  a.num_tokens = reinterpret_cast<const int*>(num_tokens);
  a.bucket = bucket;
  a.do_recv = (L_.flags & F_ROLE_WARPS) ? 0 : 1;
  a.real_recv = 0;
  check(launch_combine(L_, a, L_.G,
                       reinterpret_cast<cudaStream_t>(stream), &last_form_[1]),
        "launch reply_tokens");
  reply_due_ = false;
}

std::pair<uint64_t, uint64_t> Comm::token_view_ptrs() const {
  need(opened_ && !closed_, "torch_afdep CUDA: transport not open");
  need(L_.is_ffn && L_.tokens, "the token view exists on FFN ranks of the token layout");
  const uint64_t base = transport_->peer_bases()[L_.rank];
  return {base + (uint64_t)L_.off_payload, base + (uint64_t)L_.off_scales};
}

void Comm::combine(uint64_t route, uint64_t out, int T, uint64_t stream) {
  launch_collect(route, out, T, false, stream);
}

void Comm::combine_in_place(uint64_t route, int T, uint64_t stream) {
  need(L_.F == 1, "an in-place (zero-copy) combine needs exactly one FFN rank");
  launch_collect(route, 0, T, true, stream);
}

void Comm::launch_collect(uint64_t route, uint64_t out, int T, bool in_place, uint64_t stream) {
  need(opened_ && !closed_, "torch_afdep CUDA: transport not open");
  need(!L_.is_ffn, "combine runs on Attention ranks");
  need(T >= 0 && T <= L_.C, "T exceeds capacity_tokens_per_rank");
  DeviceGuard g(device_);
  CombineArgs a{};
  a.do_send = (L_.flags & F_ROLE_WARPS) ? 0 : 1;  // symmetric: a dummy reply sender too
  a.real_send = 0;
  a.bucket = 1;
  a.div_bucket = make_fast_div(1);
  a.do_recv = 1;
  a.real_recv = 1;
  a.route = reinterpret_cast<const int64_t*>(route);
  a.out = reinterpret_cast<void*>(out);
  a.T = T;
  a.in_place = in_place ? 1 : 0;
  check(launch_combine(L_, a, L_.Ga, reinterpret_cast<cudaStream_t>(stream),
                       &last_form_[1]),
        "launch combine");
}

void Comm::ping(int peer, int iters, bool initiator, uint64_t stream) {
  need(opened_ && !closed_, "torch_afdep CUDA: transport not open");
  need(peer >= 0 && peer < L_.W && peer != L_.rank, "ping: peer must be another group rank");
  need(iters >= 1 && iters <= 1000000, "ping: iters must be in [1, 1000000]");
  DeviceGuard g(device_);
  check(launch_ping(L_, peer, iters, ping_base_, initiator ? 1 : 0,
                    reinterpret_cast<cudaStream_t>(stream)), "launch ping");
  ping_base_ += (uint64_t)iters;
}

uint64_t Comm::view_ptr() const {
  need(opened_ && !closed_, "torch_afdep CUDA: transport not open");
  need(!L_.is_ffn && L_.F == 1, "the combine view exists on Attention ranks with one FFN rank");
  const auto& b = transport_->peer_bases();
  const int src = (L_.flags & F_ROLE_BUFFERS) ? 0 : ffn_rank0_;
  return b[L_.rank] + (uint64_t)L_.off_comb + (uint64_t)src * L_.C * L_.H * 2;
}

std::vector<uint64_t> Comm::trace() {
  std::vector<uint64_t> v;
  if (!trace_ || closed_) return v;
  DeviceGuard g(device_);
  v.resize((size_t)kTraceRing * 2 * kTracePts + 2);
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check(cudaMemcpy(v.data(), trace_, (size_t)kTraceRing * 2 * kTracePts * 8,
                   cudaMemcpyDeviceToHost), "copy trace");
  // CTA 0's exchange counters of both phases: which ring entries are the latest
  uint64_t c0 = 0, c1 = 0;
  check(cudaMemcpy(&c0, L_.counters, 8, cudaMemcpyDeviceToHost), "copy counter");
  check(cudaMemcpy(&c1, L_.counters + L_.Gmax, 8, cudaMemcpyDeviceToHost), "copy counter");
  v[(size_t)kTraceRing * 2 * kTracePts] = c0;
  v[(size_t)kTraceRing * 2 * kTracePts + 1] = c1;
  return v;
}

ErrorInfo Comm::poll_error(bool clear) {
  ErrorInfo e{};
  if (!err_host_) return e;
  volatile ErrorBlock* b = err_host_;
  e.timeout = b->timeout;
  e.route = b->route;
  e.route_peer = -1;
  if (e.timeout) {
    e.phase = b->timeout_phase;
    e.peer = b->timeout_peer;
    e.rank = b->timeout_rank;
  }
  if (e.route) {
    e.route_kind = b->route_kind;
    e.route_bad_id = b->route_bad_id;
    e.route_peer = b->route_peer;
    e.route_own = b->route_own;
    // An FFN's bucket mismatch (found by its receive) is reported once its reply has been
    // launched: that reply tells the Attention ranks (ReplyStatus) and completes the
    // exchange, so raising before it would leave them waiting until their timeout.
    if (e.route_kind == kRouteBucket && L_.is_ffn && reply_due_) {
      e.route = 0;
      e.route_kind = 0;
      e.route_bad_id = 0;
      e.route_peer = -1;
      e.route_own = 0;
    }
  }
  if (clear) {
    if (e.route) {
      b->route = 0;
      b->route_claim = 0;
    }
    if (e.timeout) {
      b->timeout = 0;
      b->timeout_claim = 0;
    }
  }
  return e;
}

void Comm::close(bool clean) {
  if (closed_) return;
  closed_ = true;
  cudaSetDevice(device_);
  cudaDeviceSynchronize();
  if (transport_) transport_->close(clean);
  if (workspace_) cudaFree(workspace_);
  workspace_ = nullptr;
  if (trace_) cudaFree(trace_);
  trace_ = nullptr;
  if (err_host_) cudaFreeHost(err_host_);
  err_host_ = nullptr;
}

}  // namespace afdep
