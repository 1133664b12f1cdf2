// The "afdep" c10d backend's methods (class and routing rules: backend.h).
#include "c10d/backend.h"

#include <exception>
#include <utility>

namespace afdep {

namespace {

constexpr const char* kAttention = "attention";
constexpr const char* kFfn = "ffn";

bool anyCuda(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (t.defined() && t.is_cuda()) {
      return true;
    }
  }
  return false;
}

bool anyCuda(const std::vector<std::vector<at::Tensor>>& lists) {
  for (const auto& l : lists) {
    if (anyCuda(l)) {
      return true;
    }
  }
  return false;
}

bool isCuda(const at::Tensor& t) {
  return t.defined() && t.is_cuda();
}

// The Work returned by endCoalescing() when the block's ops went to more than
// one place (CPU ops run eagerly on gloo, which does not coalesce; CUDA ops are
// coalesced by NCCL). Waiting on it waits on every part.
class JoinedWork : public c10d::Work {
 public:
  JoinedWork(int rank, std::vector<WorkPtr> parts)
      : c10d::Work(rank, c10d::OpType::COALESCED), parts_(std::move(parts)) {}

  bool isCompleted() override {
    for (auto& w : parts_) {
      if (!w->isCompleted()) {
        return false;
      }
    }
    return true;
  }

  bool isSuccess() const override {
    for (const auto& w : parts_) {
      if (!w->isSuccess()) {
        return false;
      }
    }
    return true;
  }

  std::exception_ptr exception() const override {
    for (const auto& w : parts_) {
      auto e = w->exception();
      if (e) {
        return e;
      }
    }
    return nullptr;
  }

  std::vector<at::Tensor> result() override {
    std::vector<at::Tensor> out;
    for (auto& w : parts_) {
      auto r = w->result();
      out.insert(out.end(), r.begin(), r.end());
    }
    return out;
  }

  void synchronize() override {
    for (auto& w : parts_) {
      w->synchronize();
    }
  }

  bool wait(std::chrono::milliseconds timeout) override {
    bool ok = true;
    for (auto& w : parts_) {
      ok = w->wait(timeout) && ok;
    }
    return ok;
  }

  void abort() override {
    for (auto& w : parts_) {
      w->abort();
    }
  }

 private:
  std::vector<WorkPtr> parts_;
};

} // namespace

std::string AfdepBackend::invalidReason(
    int rank,
    int size,
    const std::vector<std::string>& roles,
    const BackendPtr& cpuInner,
    const BackendPtr& cudaInner) {
  if (size <= 0) {
    return c10::str("afdep: group size must be positive, got ", size);
  }
  if (rank < 0 || rank >= size) {
    return c10::str("afdep: rank ", rank, " is outside a group of size ", size);
  }
  if (static_cast<int>(roles.size()) != size) {
    return c10::str(
        "afdep: roles has ",
        roles.size(),
        " entries but the group has ",
        size,
        " ranks");
  }
  for (size_t i = 0; i < roles.size(); ++i) {
    if (roles[i] != kAttention && roles[i] != kFfn) {
      return c10::str(
          "afdep: roles[", i, "] must be 'attention' or 'ffn', got '", roles[i], "'");
    }
  }
  if (!cpuInner) {
    return "afdep: a CPU inner backend (gloo) is required";
  }
  const std::pair<const char*, const c10d::Backend*> inners[] = {
      {"CPU", cpuInner.get()}, {"CUDA", cudaInner.get()}};
  for (const auto& [what, inner] : inners) {
    if (inner && (inner->getSize() != size || inner->getRank() != rank)) {
      return c10::str(
          "afdep: the ",
          what,
          " inner backend is rank ",
          inner->getRank(),
          " of ",
          inner->getSize(),
          ", expected rank ",
          rank,
          " of ",
          size);
    }
  }
  return "";
}

AfdepBackend::AfdepBackend(
    int rank,
    int size,
    std::vector<std::string> roles,
    BackendPtr cpuInner,
    BackendPtr cudaInner)
    : c10d::Backend(rank, size),
      roles_(std::move(roles)),
      cpu_(std::move(cpuInner)),
      cuda_(std::move(cudaInner)) {
  invalid_ = invalidReason(rank, size, roles_, cpu_, cuda_);
  init();
}

void AfdepBackend::check() const {
  TORCH_CHECK_VALUE(invalid_.empty(), invalid_);
}

const std::string& AfdepBackend::role() const {
  check();
  return roles_[getRank()];
}

// ---- identity and lifecycle ------------------------------------------------

void AfdepBackend::setTimeout(std::chrono::milliseconds timeout) {
  check();
  cpu_->setTimeout(timeout);
  if (cuda_) {
    cuda_->setTimeout(timeout);
  }
}

void AfdepBackend::abort() {
  if (cuda_) {
    cuda_->abort();
  }
  if (cpu_) {
    cpu_->abort();
  }
}

void AfdepBackend::shutdown() {
  if (cuda_) {
    cuda_->shutdown();
  }
  if (cpu_) {
    cpu_->shutdown();
  }
}

void AfdepBackend::setSequenceNumberForGroup() {
  check();
  cpu_->setSequenceNumberForGroup();
}

uint64_t AfdepBackend::getSequenceNumberForGroup() {
  check();
  return cpu_->getSequenceNumberForGroup();
}

// ---- coalescing --------------------------------------------------------------
// Only NCCL coalesces, so the backend reports support only when it has a CUDA
// inner that does. Inside a coalescing block, CUDA ops are coalesced by the
// CUDA inner (started lazily, before the first CUDA op) and CPU ops run
// eagerly on gloo; endCoalescing() returns one Work covering both.

bool AfdepBackend::supportsCoalescing() const {
  return cuda_ && cuda_->supportsCoalescing();
}

void AfdepBackend::startCoalescing() {
  TORCH_CHECK(!coalescing_, "afdep: startCoalescing() called twice");
  coalescing_ = true;
  cudaCoalescing_ = false;
  coalescedCpuWorks_.clear();
}

WorkPtr AfdepBackend::endCoalescing() {
  TORCH_CHECK(coalescing_, "afdep: endCoalescing() without startCoalescing()");
  coalescing_ = false;
  std::vector<WorkPtr> parts;
  parts.swap(coalescedCpuWorks_);
  if (cudaCoalescing_) {
    cudaCoalescing_ = false;
    auto w = cuda_->endCoalescing();
    if (w) {
      parts.push_back(std::move(w));
    }
  }
  if (parts.empty()) {
    return WorkPtr();
  }
  if (parts.size() == 1) {
    return parts.front();
  }
  return c10::make_intrusive<JoinedWork>(getRank(), std::move(parts));
}

// ---- collectives -------------------------------------------------------------

WorkPtr AfdepBackend::broadcast(
    std::vector<at::Tensor>& tensors,
    const c10d::BroadcastOptions& opts) {
  bool c = anyCuda(tensors);
  return track(c, pick(c, "broadcast")->broadcast(tensors, opts));
}

WorkPtr AfdepBackend::allreduce(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  bool c = anyCuda(tensors);
  return track(c, pick(c, "allreduce")->allreduce(tensors, opts));
}

WorkPtr AfdepBackend::allreduce_sparse(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceOptions& opts) {
  bool c = anyCuda(tensors);
  return track(c, pick(c, "allreduce_sparse")->allreduce_sparse(tensors, opts));
}

WorkPtr AfdepBackend::allreduce_coalesced(
    std::vector<at::Tensor>& tensors,
    const c10d::AllreduceCoalescedOptions& opts) {
  bool c = anyCuda(tensors);
  return track(
      c, pick(c, "allreduce_coalesced")->allreduce_coalesced(tensors, opts));
}

WorkPtr AfdepBackend::reduce(
    std::vector<at::Tensor>& tensors,
    const c10d::ReduceOptions& opts) {
  bool c = anyCuda(tensors);
  return track(c, pick(c, "reduce")->reduce(tensors, opts));
}

WorkPtr AfdepBackend::allgather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  bool c = anyCuda(inputs) || anyCuda(outputs);
  return track(c, pick(c, "allgather")->allgather(outputs, inputs, opts));
}

WorkPtr AfdepBackend::_allgather_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::AllgatherOptions& opts) {
  bool c = isCuda(input) || isCuda(output);
  return track(
      c, pick(c, "_allgather_base")->_allgather_base(output, input, opts));
}

WorkPtr AfdepBackend::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputLists,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  bool c = anyCuda(inputs) || anyCuda(outputLists);
  return track(
      c,
      pick(c, "allgather_coalesced")
          ->allgather_coalesced(outputLists, inputs, opts));
}

WorkPtr AfdepBackend::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  bool c = anyCuda(inputs) || anyCuda(outputs);
  return track(
      c,
      pick(c, "allgather_into_tensor_coalesced")
          ->allgather_into_tensor_coalesced(outputs, inputs, opts));
}

WorkPtr AfdepBackend::gather(
    std::vector<std::vector<at::Tensor>>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  bool c = anyCuda(inputs) || anyCuda(outputs);
  return track(c, pick(c, "gather")->gather(outputs, inputs, opts));
}

WorkPtr AfdepBackend::scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  bool c = anyCuda(outputs) || anyCuda(inputs);
  return track(c, pick(c, "scatter")->scatter(outputs, inputs, opts));
}

WorkPtr AfdepBackend::reduce_scatter(
    std::vector<at::Tensor>& outputs,
    std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  bool c = anyCuda(outputs) || anyCuda(inputs);
  return track(
      c, pick(c, "reduce_scatter")->reduce_scatter(outputs, inputs, opts));
}

WorkPtr AfdepBackend::_reduce_scatter_base(
    at::Tensor& output,
    at::Tensor& input,
    const c10d::ReduceScatterOptions& opts) {
  bool c = isCuda(input) || isCuda(output);
  return track(
      c,
      pick(c, "_reduce_scatter_base")->_reduce_scatter_base(output, input, opts));
}

WorkPtr AfdepBackend::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  bool c = anyCuda(inputs) || anyCuda(outputs);
  return track(
      c,
      pick(c, "reduce_scatter_tensor_coalesced")
          ->reduce_scatter_tensor_coalesced(outputs, inputs, opts));
}

WorkPtr AfdepBackend::alltoall_base(
    at::Tensor& output,
    at::Tensor& input,
    std::vector<int64_t>& outputSplitSizes,
    std::vector<int64_t>& inputSplitSizes,
    const c10d::AllToAllOptions& opts) {
  bool c = isCuda(input) || isCuda(output);
  return track(
      c,
      pick(c, "alltoall_base")
          ->alltoall_base(
              output, input, outputSplitSizes, inputSplitSizes, opts));
}

WorkPtr AfdepBackend::alltoall(
    std::vector<at::Tensor>& outputs,
    std::vector<at::Tensor>& inputs,
    const c10d::AllToAllOptions& opts) {
  bool c = anyCuda(inputs) || anyCuda(outputs);
  return track(c, pick(c, "alltoall")->alltoall(outputs, inputs, opts));
}

WorkPtr AfdepBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  bool c = anyCuda(tensors);
  return track(c, pick(c, "send")->send(tensors, dstRank, tag));
}

WorkPtr AfdepBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  bool c = anyCuda(tensors);
  return track(c, pick(c, "recv")->recv(tensors, srcRank, tag));
}

WorkPtr AfdepBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  bool c = anyCuda(tensors);
  return track(c, pick(c, "recvAnysource")->recvAnysource(tensors, tag));
}

// The CUDA inner only when this rank has a CUDA device bound to the group
// (init_process_group(device_id=...)) or the caller named devices; a barrier
// that merely arrives with a CUDA dummy tensor still runs on gloo, so it
// cannot pick a wrong GPU.
WorkPtr AfdepBackend::barrier(const c10d::BarrierOptions& opts) {
  check();
  auto bound = getBoundDeviceId();
  bool c = cuda_ &&
      ((bound.has_value() && bound->is_cuda()) || !opts.device_ids.empty());
  if (c) {
    return track(true, pick(true, "barrier")->barrier(opts));
  }
  c10d::BarrierOptions cpuOpts = opts;
  cpuOpts.device_ids.clear();
  cpuOpts.device = at::Device(at::kCPU);
  return track(false, cpu_->barrier(cpuOpts));
}

void AfdepBackend::monitoredBarrier(
    const c10d::BarrierOptions& opts,
    bool waitAllRanks) {
  check();
  cpu_->monitoredBarrier(opts, waitAllRanks);
}

// ---- routing -----------------------------------------------------------------

c10d::Backend* AfdepBackend::pick(bool cuda, const char* op) {
  check();
  if (!cuda) {
    return cpu_.get();
  }
  TORCH_CHECK(
      cuda_,
      "afdep: ",
      op,
      " got CUDA tensors but this afdep group has no CUDA inner backend "
      "(it was created where torch.cuda.is_available() was False)");
  // The group binds its device to this backend; hand it on so NCCL can use it.
  auto bound = getBoundDeviceId();
  if (bound.has_value() && !cuda_->getBoundDeviceId().has_value()) {
    cuda_->setBoundDeviceId(bound);
  }
  if (coalescing_ && !cudaCoalescing_) {
    cuda_->startCoalescing();
    cudaCoalescing_ = true;
  }
  return cuda_.get();
}

WorkPtr AfdepBackend::track(bool cuda, WorkPtr work) {
  if (coalescing_ && !cuda && work) {
    coalescedCpuWorks_.push_back(work);
  }
  return work;
}

} // namespace afdep
