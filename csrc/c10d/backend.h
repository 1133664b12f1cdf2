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
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace afdep {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using BackendPtr = c10::intrusive_ptr<c10d::Backend>;

class AfdepBackend : public c10d::Backend {
 public:
  // Why the arguments cannot make a valid backend, or "" when they can.
  static std::string invalidReason(
      int rank,
      int size,
      const std::vector<std::string>& roles,
      const BackendPtr& cpuInner,
      const BackendPtr& cudaInner);

  // Never throws: invalid arguments make a backend whose every use raises
  // ValueError with invalidReason(). (Throwing out of the Python constructor
  // crashed the interpreter with torch 2.11's pybind11, so the Python side
  // checks invalid_reason() before constructing; see backend.py.)
  AfdepBackend(
      int rank,
      int size,
      std::vector<std::string> roles,
      BackendPtr cpuInner,
      BackendPtr cudaInner);

  // Raises ValueError when the backend was constructed from invalid arguments.
  void check() const;

  const std::vector<std::string>& roles() const {
    return roles_;
  }
  const std::string& role() const;
  BackendPtr cpuInner() const {
    return cpu_;
  }
  BackendPtr cudaInner() const {
    return cuda_;
  }

  // ---- identity and lifecycle ------------------------------------------------
  const std::string getBackendName() const override {
    return "afdep";
  }
  void setTimeout(std::chrono::milliseconds timeout) override;
  void abort() override;
  void shutdown() override;
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;

  // ---- coalescing (see backend.cpp) ------------------------------------------
  bool supportsCoalescing() const override;
  void startCoalescing() override;
  WorkPtr endCoalescing() override;

  // ---- collectives: each goes to the inner backend its tensors' device needs ---
  WorkPtr broadcast(
      std::vector<at::Tensor>& tensors,
      const c10d::BroadcastOptions& opts) override;
  WorkPtr allreduce(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override;
  WorkPtr allreduce_sparse(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceOptions& opts) override;
  WorkPtr allreduce_coalesced(
      std::vector<at::Tensor>& tensors,
      const c10d::AllreduceCoalescedOptions& opts) override;
  WorkPtr reduce(
      std::vector<at::Tensor>& tensors,
      const c10d::ReduceOptions& opts) override;
  WorkPtr allgather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  WorkPtr _allgather_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::AllgatherOptions& opts) override;
  WorkPtr allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputLists,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  WorkPtr allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  WorkPtr gather(
      std::vector<std::vector<at::Tensor>>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::GatherOptions& opts) override;
  WorkPtr scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ScatterOptions& opts) override;
  WorkPtr reduce_scatter(
      std::vector<at::Tensor>& outputs,
      std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  WorkPtr _reduce_scatter_base(
      at::Tensor& output,
      at::Tensor& input,
      const c10d::ReduceScatterOptions& opts) override;
  WorkPtr reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  WorkPtr alltoall_base(
      at::Tensor& output,
      at::Tensor& input,
      std::vector<int64_t>& outputSplitSizes,
      std::vector<int64_t>& inputSplitSizes,
      const c10d::AllToAllOptions& opts) override;
  WorkPtr alltoall(
      std::vector<at::Tensor>& outputs,
      std::vector<at::Tensor>& inputs,
      const c10d::AllToAllOptions& opts) override;
  WorkPtr send(std::vector<at::Tensor>& tensors, int dstRank, int tag) override;
  WorkPtr recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) override;
  WorkPtr recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  WorkPtr barrier(const c10d::BarrierOptions& opts) override;
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool waitAllRanks)
      override;

 private:
  // The inner backend for an op; CUDA tensors need the CUDA inner.
  c10d::Backend* pick(bool cuda, const char* op);
  // Inside a coalescing block, keep the CPU works so endCoalescing() can wait
  // on them.
  WorkPtr track(bool cuda, WorkPtr work);

  std::vector<std::string> roles_;
  std::string invalid_;
  BackendPtr cpu_;
  BackendPtr cuda_;
  bool coalescing_ = false;
  bool cudaCoalescing_ = false;
  std::vector<WorkPtr> coalescedCpuWorks_;
};

} // namespace afdep
