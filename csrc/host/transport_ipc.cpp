// CUDA IPC transport: cudaMalloc'd window, cudaIpcGetMemHandle / cudaIpcOpenMemHandle.
// Works across GPUs with peer access and for several processes on one GPU.
#include <cstring>
#include <stdexcept>
#include <string>

#include <cuda_runtime.h>

#include "afdep/transport.h"

namespace afdep {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("torch_afdep CUDA IPC: ") + what + ": " +
                             cudaGetErrorString(e));
}

class IpcTransport final : public Transport {
 public:
  explicit IpcTransport(int device) : device_(device) {}
  ~IpcTransport() override {
    try {
      close(false);
    } catch (...) {
    }
  }
  const char* name() const override { return "cuda_ipc"; }

  void* allocate(size_t bytes) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    check(cudaMalloc(&base_, bytes), "cudaMalloc(window)");
    check(cudaMemset(base_, 0, bytes), "cudaMemset(window)");
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    bytes_ = bytes;
    return base_;
  }

  std::string export_handle() override {
    cudaIpcMemHandle_t h;
    check(cudaIpcGetMemHandle(&h, base_), "cudaIpcGetMemHandle");
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  }

  void open_peers(const std::vector<std::string>& handles, int rank) override {
    check(cudaSetDevice(device_), "cudaSetDevice");
    bases_.assign(handles.size(), 0);
    opened_.assign(handles.size(), nullptr);
    for (size_t r = 0; r < handles.size(); ++r) {
      if ((int)r == rank) {
        bases_[r] = reinterpret_cast<uint64_t>(base_);
        continue;
      }
      if (handles[r].size() != sizeof(cudaIpcMemHandle_t))
        throw std::runtime_error("torch_afdep CUDA IPC: bad handle size from rank " +
                                 std::to_string(r));
      cudaIpcMemHandle_t h;
      std::memcpy(&h, handles[r].data(), sizeof(h));
      void* p = nullptr;
      check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
            ("cudaIpcOpenMemHandle(rank " + std::to_string(r) + ")").c_str());
      opened_[r] = p;
      bases_[r] = reinterpret_cast<uint64_t>(p);
    }
  }

  const std::vector<uint64_t>& peer_bases() const override { return bases_; }

  void close(bool /*clean: nothing collective to tear down*/) override {
    if (closed_) return;
    closed_ = true;
    cudaSetDevice(device_);
    for (void* p : opened_)
      if (p) cudaIpcCloseMemHandle(p);
    opened_.clear();
    if (base_) cudaFree(base_);
    base_ = nullptr;
  }

 private:
  int device_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  bool closed_ = false;
  std::vector<uint64_t> bases_;
  std::vector<void*> opened_;
};

}  // namespace

std::unique_ptr<Transport> make_ipc_transport(int device) {
  return std::unique_ptr<Transport>(new IpcTransport(device));
}

}  // namespace afdep
