// One rank's CUDA exchange state: layout, registered window (through a Transport), device
// workspace, host-mapped error block, and the four phase launches.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "afdep/args.h"
#include "afdep/layout.h"
#include "afdep/transport.h"

namespace afdep {

struct CommConfig {
  int rank = 0;
  int device = 0;
  std::vector<int> is_ffn;  // per group rank: 1 FFN, 0 Attention
  int num_sms = 24;   // S: CTAs (channels) of the senders' kernels
  int ffn_ctas = 24;   // CTAs of the FFN's receive/reply kernels when grids are wide
  int attn_ctas = 24;  // CTAs of the Attention's combine kernel when grids are wide
  int hidden = 0;
  int elem = 2;  // payload bytes per element (2 bf16, 1 fp8)
  int scale_cols = 0;
  int num_experts = 0;
  int top_k = 0;
  int capacity = 0;
  double timeout_s = 100.0;
  uint32_t flags = kAllRoleAware;
  // Token-major receive layout (Config.receive_layout == "tokens"); every rank must agree.
  bool token_layout = false;
  std::string transport = "ipc";  // "ipc" (CUDA IPC) or "nccl" (NCCL LSA windows)
  // Diagnostics, set by the Python side from AFDEP_TRACE / AFDEP_DEBUG (C++ reads no
  // environment): per-stage timestamps, and the DebugBits mask of layout.h.
  bool trace = false;
  int debug = 0;
};

struct ErrorInfo {
  int timeout, phase, peer, rank;
  int route, route_kind;
  long long route_bad_id;
  int route_peer, route_own;  // kRouteBucket: the peer's group rank, this rank's bucket
};

class Comm {
 public:
  explicit Comm(const CommConfig& cfg);
  ~Comm();
  std::string local_handle();
  void open(const std::vector<std::string>& handles);
  int64_t registered_bytes() const { return L_.window_bytes; }
  int64_t union_bytes() const { return union_bytes_; }
  int ffn_grid() const { return L_.G; }
  int attn_grid() const { return L_.Ga; }
  const Layout& layout() const { return L_; }
  bool is_ffn() const { return L_.is_ffn != 0; }

  // bucket: the static bucket of this exchange (T <= bucket <= capacity), carried to the FFN
  // ranks, which refuse another bucket than theirs; 0 declares none (not checked).
  void dispatch(uint64_t x, uint64_t x_scales, uint64_t expert_ids, bool ids_64, uint64_t weights,
                uint64_t route, int T, uint64_t stream, int bucket = 0);
  void receive(int bucket, uint64_t x, uint64_t x_scales, uint64_t weights, uint64_t offsets,
               uint64_t src_rank, uint64_t src_token, uint64_t token_rows, uint64_t token_index,
               uint64_t num_tokens, uint64_t stream);
  void reply(int bucket, uint64_t rows, uint64_t token_rows, uint64_t token_index,
             uint64_t num_tokens, uint64_t stream);
  // Token layout (FFN): wait for every sender's tokens like receive, then write per row of the
  // inbox view ([A * rps] rows, rps = S * ceil(bucket / S)) the local ids in the source's
  // columns [., k] and weights, src_rank, src_token (-1: no token), and num_tokens [A]. The
  // payload stays where it landed: token_view_ptrs()'s rows.
  void receive_tokens(int bucket, uint64_t expert_ids, uint64_t weights, uint64_t src_rank,
                      uint64_t src_token, uint64_t num_tokens, uint64_t stream);
  // Token layout (FFN): row i of rows [A * rps, H] bf16 goes back as the reply of token
  // src_token[i] (-1: none) of Attention index i / rps; no reduction.
  void reply_tokens(int bucket, uint64_t rows, uint64_t src_token, uint64_t num_tokens,
                    uint64_t stream);
  // Token layout (FFN): addresses of this rank's dispatch inbox payload rows [., H] and
  // scales [., scale_cols] f32, the rows receive_tokens reports (fixed for the Comm's life).
  std::pair<uint64_t, uint64_t> token_view_ptrs() const;
  void combine(uint64_t route, uint64_t out, int T, uint64_t stream);
  // F == 1 only: wait like combine, zero the inbox rows of tokens without a route, copy
  // nothing; the result is view_ptr()'s rows [0, T) (valid until the next dispatch).
  void combine_in_place(uint64_t route, int T, uint64_t stream);
  // Address of this Attention rank's combine inbox row 0 of the single FFN source ([C, H] bf16).
  uint64_t view_ptr() const;
  // Probe: `iters` flag round trips with group rank `peer`, who calls it with initiator
  // false (the same iters, in the same order of calls); time it on the initiator's stream.
  void ping(int peer, int iters, bool initiator, uint64_t stream);
  // A bucket mismatch found by an FFN's receive is held back until its reply is launched.
  ErrorInfo poll_error(bool clear);
  // CommConfig::trace only: [kTraceRing][2][kTracePts] stamps, then CTA 0's counters of both
  // phases (synchronizes the device; empty when tracing is off).
  std::vector<uint64_t> trace();
  // clean: every peer reached close (collective teardown allowed); else local only.
  void close(bool clean = true);
  const char* transport_name() const { return transport_ ? transport_->name() : "none"; }
  // The KernelForm (afdep/forms.h) of this rank's last launch of each phase: (dispatch or
  // receive, reply or collect); -1 before the first. For tests and diagnostics: a form is
  // chosen per launch, on the host, from the flags, the bucket and T.
  std::pair<int, int> last_forms() const { return {last_form_[0], last_form_[1]}; }

 private:
  void launch_collect(uint64_t route, uint64_t out, int T, bool in_place, uint64_t stream);

  Layout L_{};
  uint64_t ping_base_ = 0;  // ping values used so far (they only grow)
  int device_;
  int64_t union_bytes_ = 0;
  std::unique_ptr<Transport> transport_;
  void* workspace_ = nullptr;  // peer table, counters, role tables
  ErrorBlock* err_host_ = nullptr;
  void* trace_ = nullptr;
  bool opened_ = false, closed_ = false;
  bool reply_due_ = false;  // FFN: a receive was launched and its reply not yet
  int last_form_[2] = {-1, -1};  // last_forms()
  int ffn_rank0_ = -1;  // group rank of the first FFN rank (the union layout's view source)
  std::vector<int> is_ffn_;  // role of every group rank (F_PARAM_BASES: role indices)
};

}  // namespace afdep
