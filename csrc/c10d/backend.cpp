// The "afdep" c10d backend: a c10d::Backend that knows the AFD role of every
// rank of its group and hands ordinary collectives to inner backends.
//
// Routing: an op whose tensors live on a CUDA device goes to the CUDA inner
// backend (NCCL, when one was given); every other op goes to the CPU inner
// backend (gloo). The AFD exchange itself does not go through this class: it
// lives in torch.ops.afdep.*, which finds the group by name. This backend
// exists so that one process group can carry both the roles and the standard
// collectives that DeviceMesh, DTensor and functional collectives need.
//
// Portability: only virtual methods present in the Backend headers of torch
// 2.11 through 2.14 are overridden, each marked `override` so a changed
// signature fails the build instead of silently not overriding.

#include <torch/extension.h>
#include <torch/version.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace afdep {

namespace {

constexpr const char* kAttention = "attention";
constexpr const char* kFfn = "ffn";

#define AFDEP_STR_INNER(x) #x
#define AFDEP_STR(x) AFDEP_STR_INNER(x)
// "MAJOR.MINOR.PATCH" of the torch headers this file was compiled against.
constexpr const char* kTorchVersion = AFDEP_STR(TORCH_VERSION_MAJOR) "." AFDEP_STR(
    TORCH_VERSION_MINOR) "." AFDEP_STR(TORCH_VERSION_PATCH);

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
  JoinedWork(int rank, std::vector<c10::intrusive_ptr<c10d::Work>> parts)
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
  std::vector<c10::intrusive_ptr<c10d::Work>> parts_;
};

} // namespace

class AfdepBackend : public c10d::Backend {
 public:
  // Why the arguments cannot make a valid backend, or "" when they can.
  static std::string invalidReason(
      int rank,
      int size,
      const std::vector<std::string>& roles,
      const c10::intrusive_ptr<c10d::Backend>& cpuInner,
      const c10::intrusive_ptr<c10d::Backend>& cudaInner) {
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

  // Never throws: invalid arguments make a backend whose every use raises
  // ValueError with invalidReason(). (Throwing out of the Python constructor
  // crashed the interpreter with torch 2.11's pybind11, so the Python side
  // checks invalid_reason() before constructing; see backend.py.)
  AfdepBackend(
      int rank,
      int size,
      std::vector<std::string> roles,
      c10::intrusive_ptr<c10d::Backend> cpuInner,
      c10::intrusive_ptr<c10d::Backend> cudaInner)
      : c10d::Backend(rank, size),
        roles_(std::move(roles)),
        cpu_(std::move(cpuInner)),
        cuda_(std::move(cudaInner)) {
    invalid_ = invalidReason(rank, size, roles_, cpu_, cuda_);
    init();
  }

  // Raises ValueError when the backend was constructed from invalid arguments.
  void check() const {
    TORCH_CHECK_VALUE(invalid_.empty(), invalid_);
  }

  const std::vector<std::string>& roles() const {
    return roles_;
  }

  const std::string& role() const {
    check();
    return roles_[getRank()];
  }

  c10::intrusive_ptr<c10d::Backend> cpuInner() const {
    return cpu_;
  }

  c10::intrusive_ptr<c10d::Backend> cudaInner() const {
    return cuda_;
  }

  // ---- identity and lifecycle ------------------------------------------------

  const std::string getBackendName() const override {
    return "afdep";
  }

  void setTimeout(std::chrono::milliseconds timeout) override {
    check();
    cpu_->setTimeout(timeout);
    if (cuda_) {
      cuda_->setTimeout(timeout);
    }
  }

  void abort() override {
    if (cuda_) {
      cuda_->abort();
    }
    if (cpu_) {
      cpu_->abort();
    }
  }

  void shutdown() override {
    if (cuda_) {
      cuda_->shutdown();
    }
    if (cpu_) {
      cpu_->shutdown();
    }
  }

  void setSequenceNumberForGroup() override {
    check();
    cpu_->setSequenceNumberForGroup();
  }

  uint64_t getSequenceNumberForGroup() override {
    check();
    return cpu_->getSequenceNumberForGroup();
  }

  // ---- coalescing --------------------------------------------------------------
  // Only NCCL coalesces, so the backend reports support only when it has a CUDA
  // inner that does. Inside a coalescing block, CUDA ops are coalesced by the
  // CUDA inner (started lazily, before the first CUDA op) and CPU ops run
  // eagerly on gloo; endCoalescing() returns one Work covering both.

  bool supportsCoalescing() const override {
    return cuda_ && cuda_->supportsCoalescing();
  }

  void startCoalescing() override {
    TORCH_CHECK(!coalescing_, "afdep: startCoalescing() called twice");
    coalescing_ = true;
    cudaCoalescing_ = false;
    coalescedCpuWorks_.clear();
  }

  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    TORCH_CHECK(coalescing_, "afdep: endCoalescing() without startCoalescing()");
    coalescing_ = false;
    std::vector<c10::intrusive_ptr<c10d::Work>> parts;
    parts.swap(coalescedCpuWorks_);
    if (cudaCoalescing_) {
      cudaCoalescing_ = false;
      auto w = cuda_->endCoalescing();
      if (w) {
        parts.push_back(std::move(w));
      }
    }
    if (parts.empty()) {
      return c10::intrusive_ptr<c10d::Work>();
    }
    if (parts.size() == 1) {
      return parts.front();
    }
    return c10::make_intrusive<JoinedWork>(getRank(), std::move(parts));
  }

  // ---- collectives -------------------------------------------------------------

  c10::intrusive_ptr<c10d::Work> broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override {
    bool c = anyCuda(tensors);
    return track(c, pick(c, "broadcast")->broadcast(tensors, opts));
  }

  c10::intrusive_ptr<c10d::Work> allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override {
    bool c = anyCuda(tensors);
    return track(c, pick(c, "allreduce")->allreduce(tensors, opts));
  }

  c10::intrusive_ptr<c10d::Work> allreduce_sparse(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override {
    bool c = anyCuda(tensors);
    return track(c, pick(c, "allreduce_sparse")->allreduce_sparse(tensors, opts));
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override {
    bool c = anyCuda(tensors);
    return track(
        c, pick(c, "allreduce_coalesced")->allreduce_coalesced(tensors, opts));
  }

  c10::intrusive_ptr<c10d::Work> reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override {
    bool c = anyCuda(tensors);
    return track(c, pick(c, "reduce")->reduce(tensors, opts));
  }

  c10::intrusive_ptr<c10d::Work> allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    bool c = anyCuda(inputs) || anyCuda(outputs);
    return track(c, pick(c, "allgather")->allgather(outputs, inputs, opts));
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override {
    bool c = isCuda(input) || isCuda(output);
    return track(
        c, pick(c, "_allgather_base")->_allgather_base(output, input, opts));
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    bool c = anyCuda(inputs) || anyCuda(outputLists);
    return track(
        c,
        pick(c, "allgather_coalesced")
            ->allgather_coalesced(outputLists, inputs, opts));
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    bool c = anyCuda(inputs) || anyCuda(outputs);
    return track(
        c,
        pick(c, "allgather_into_tensor_coalesced")
            ->allgather_into_tensor_coalesced(outputs, inputs, opts));
  }

  c10::intrusive_ptr<c10d::Work> gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override {
    bool c = anyCuda(inputs) || anyCuda(outputs);
    return track(c, pick(c, "gather")->gather(outputs, inputs, opts));
  }

  c10::intrusive_ptr<c10d::Work> scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override {
    bool c = anyCuda(outputs) || anyCuda(inputs);
    return track(c, pick(c, "scatter")->scatter(outputs, inputs, opts));
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    bool c = anyCuda(outputs) || anyCuda(inputs);
    return track(
        c, pick(c, "reduce_scatter")->reduce_scatter(outputs, inputs, opts));
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override {
    bool c = isCuda(input) || isCuda(output);
    return track(
        c,
        pick(c, "_reduce_scatter_base")->_reduce_scatter_base(output, input, opts));
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    bool c = anyCuda(inputs) || anyCuda(outputs);
    return track(
        c,
        pick(c, "reduce_scatter_tensor_coalesced")
            ->reduce_scatter_tensor_coalesced(outputs, inputs, opts));
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplitSizes,
      std::vector<int64_t>& inputSplitSizes,
      const c10d::AllToAllOptions& opts) override {
    bool c = isCuda(input) || isCuda(output);
    return track(
        c,
        pick(c, "alltoall_base")
            ->alltoall_base(
                output, input, outputSplitSizes, inputSplitSizes, opts));
  }

  c10::intrusive_ptr<c10d::Work> alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override {
    bool c = anyCuda(inputs) || anyCuda(outputs);
    return track(c, pick(c, "alltoall")->alltoall(outputs, inputs, opts));
  }

  c10::intrusive_ptr<c10d::Work> send(
      std::vector<at::Tensor>& tensors,
      int dstRank,
      int tag) override {
    bool c = anyCuda(tensors);
    return track(c, pick(c, "send")->send(tensors, dstRank, tag));
  }

  c10::intrusive_ptr<c10d::Work> recv(
      std::vector<at::Tensor>& tensors,
      int srcRank,
      int tag) override {
    bool c = anyCuda(tensors);
    return track(c, pick(c, "recv")->recv(tensors, srcRank, tag));
  }

  c10::intrusive_ptr<c10d::Work> recvAnysource(
      std::vector<at::Tensor>& tensors,
      int tag) override {
    bool c = anyCuda(tensors);
    return track(c, pick(c, "recvAnysource")->recvAnysource(tensors, tag));
  }

  // The CUDA inner only when this rank has a CUDA device bound to the group
  // (init_process_group(device_id=...)) or the caller named devices; a barrier
  // that merely arrives with a CUDA dummy tensor still runs on gloo, so it
  // cannot pick a wrong GPU.
  c10::intrusive_ptr<c10d::Work> barrier(
      const c10d::BarrierOptions& opts) override {
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

  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks)
      override {
    check();
    cpu_->monitoredBarrier(opts, waitAllRanks);
  }

 private:
  // The inner backend for an op; CUDA tensors need the CUDA inner.
  c10d::Backend* pick(bool cuda, const char* op) {
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

  // Inside a coalescing block, keep the CPU works so endCoalescing() can wait
  // on them.
  c10::intrusive_ptr<c10d::Work> track(
      bool cuda,
      c10::intrusive_ptr<c10d::Work> work) {
    if (coalescing_ && !cuda && work) {
      coalescedCpuWorks_.push_back(work);
    }
    return work;
  }

  std::vector<std::string> roles_;
  std::string invalid_;
  c10::intrusive_ptr<c10d::Backend> cpu_;
  c10::intrusive_ptr<c10d::Backend> cuda_;
  bool coalescing_ = false;
  bool cudaCoalescing_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> coalescedCpuWorks_;
};

} // namespace afdep

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "torch_afdep._C: the 'afdep' c10d backend";
  // Registers torch's python Backend type, the base class below.
  py::module_::import("torch.distributed");

  m.attr("TORCH_VERSION") = py::str(afdep::kTorchVersion);

  m.def(
      "invalid_reason",
      [](int rank,
         int size,
         const std::vector<std::string>& roles,
         const c10::intrusive_ptr<c10d::Backend>& cpuInner,
         std::optional<c10::intrusive_ptr<c10d::Backend>> cudaInner) {
        c10::intrusive_ptr<c10d::Backend> cuda;
        if (cudaInner.has_value()) {
          cuda = std::move(*cudaInner);
        }
        return afdep::AfdepBackend::invalidReason(rank, size, roles, cpuInner, cuda);
      },
      "Why AfdepBackend(rank, size, roles, cpu_inner, cuda_inner) would be invalid, "
      "or '' when it is valid.",
      py::arg("rank"),
      py::arg("size"),
      py::arg("roles"),
      py::arg("cpu_inner"),
      py::arg("cuda_inner") = py::none());

  py::class_<
      afdep::AfdepBackend,
      c10d::Backend,
      c10::intrusive_ptr<afdep::AfdepBackend>>(
      m,
      "AfdepBackend",
      R"(c10d backend that knows every rank's AFD role and delegates collectives:
ops on CUDA tensors go to cuda_inner (NCCL), all others to cpu_inner (gloo).)")
      .def(
          py::init([](int rank,
                      int size,
                      std::vector<std::string> roles,
                      c10::intrusive_ptr<c10d::Backend> cpuInner,
                      std::optional<c10::intrusive_ptr<c10d::Backend>> cudaInner) {
            c10::intrusive_ptr<c10d::Backend> cuda;
            if (cudaInner.has_value()) {
              cuda = std::move(*cudaInner);
            }
            return c10::make_intrusive<afdep::AfdepBackend>(
                rank, size, std::move(roles), std::move(cpuInner), std::move(cuda));
          }),
          py::arg("rank"),
          py::arg("size"),
          py::arg("roles"),
          py::arg("cpu_inner"),
          py::arg("cuda_inner") = py::none())
      .def(
          "check",
          &afdep::AfdepBackend::check,
          "Raise ValueError if the constructor's arguments were invalid.")
      .def(
          "roles",
          [](const afdep::AfdepBackend& self) { return self.roles(); },
          "Role ('attention' or 'ffn') of every group rank.")
      .def(
          "role",
          [](const afdep::AfdepBackend& self) { return self.role(); },
          "Role of this rank.")
      .def(
          "cpu_inner",
          &afdep::AfdepBackend::cpuInner,
          "The backend that runs collectives on CPU tensors (gloo).")
      .def(
          "cuda_inner",
          [](const afdep::AfdepBackend& self) -> py::object {
            auto inner = self.cudaInner();
            if (!inner) {
              return py::none();
            }
            return py::cast(inner);
          },
          "The backend that runs collectives on CUDA tensors (NCCL), or None.")
      .def("__repr__", [](const afdep::AfdepBackend& self) {
        std::string s = "AfdepBackend(rank=" + std::to_string(self.getRank()) +
            ", size=" + std::to_string(self.getSize()) + ", roles=[";
        for (size_t i = 0; i < self.roles().size(); ++i) {
          s += (i ? ", '" : "'") + self.roles()[i] + "'";
        }
        s += std::string("], cuda_inner=") + (self.cudaInner() ? "yes" : "no") +
            ")";
        return s;
      });
}
