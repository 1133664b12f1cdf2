// NCCL device-API transport: the window is allocated with ncclMemAlloc, registered as a
// symmetric NCCL window, and every peer's base is its load/store-accessible (LSA) pointer,
// read once by a one-block kernel into the same peer table the kernels already use. Needs one
// rank per GPU (NCCL's rule) and every rank in one NVLink domain (LSA team = world).
//
// Built only when setup found the NCCL headers (AFDEP_WITH_NCCL); the device API has no ABI
// promise before NCCL 2.31, so the loaded libnccl must be exactly the headers' version.
#include "afdep/transport.h"

#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#ifdef AFDEP_WITH_NCCL
#include <nccl.h>
#include <nccl_device.h>
#endif

namespace afdep {

#ifdef AFDEP_WITH_NCCL

int nccl_header_version() { return NCCL_VERSION_CODE; }

int nccl_runtime_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return -1;
  return v;
}

namespace {

std::string version_str(int v) {
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

void nccl_check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess)
    throw std::runtime_error(std::string("torch_afdep NCCL transport: ") + what + " failed: " +
                             ncclGetErrorString(r));
}

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("torch_afdep NCCL transport: ") + what + ": " +
                             cudaGetErrorString(e));
}

// Peer p's window base in this process: its LSA pointer (world rank p, one LSA team).
__global__ void lsa_peer_table(ncclWindow_t win, int world, uint64_t* out) {
  const int p = blockIdx.x * blockDim.x + threadIdx.x;
  if (p < world) out[p] = reinterpret_cast<uint64_t>(ncclGetPeerPointer(win, 0, p));
}

class NcclTransport final : public Transport {
 public:
  NcclTransport(int device, int rank, int world) : device_(device), rank_(rank), world_(world) {
    const int rt = nccl_runtime_version();
    if (rt != NCCL_VERSION_CODE)
      throw std::runtime_error(
          "torch_afdep NCCL transport: built against NCCL " + version_str(NCCL_VERSION_CODE) +
          " headers but libnccl " + (rt < 0 ? std::string("(unknown)") : version_str(rt)) +
          " is loaded; the NCCL device API needs the exact version before 2.31: rebuild "
          "torch_afdep beside the nvidia-nccl-cu13 that torch loads, or use AFDEP_TRANSPORT=ipc");
  }
  ~NcclTransport() override {
    try {
      close(false);
    } catch (...) {
    }
  }

  const char* name() const override { return "nccl-lsa"; }

  void* allocate(size_t bytes) override {
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    nccl_check(ncclMemAlloc(&base_, bytes), "ncclMemAlloc(window)");
    bytes_ = bytes;
    cuda_check(cudaMemset(base_, 0, bytes), "cudaMemset(window)");
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    return base_;
  }

  // Rank 0 hands out the communicator's unique id; the others have nothing to share (the
  // window is registered collectively in open_peers).
  std::string export_handle() override {
    if (rank_ != 0) return std::string();
    ncclUniqueId id;
    nccl_check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    return std::string(id.internal, sizeof(id.internal));
  }

  void open_peers(const std::vector<std::string>& handles, int rank) override {
    if ((int)handles.size() != world_ || rank != rank_)
      throw std::invalid_argument("torch_afdep NCCL transport: one handle per rank expected");
    if (handles[0].size() != sizeof(ncclUniqueId))
      throw std::invalid_argument("torch_afdep NCCL transport: rank 0's handle is not an id");
    cuda_check(cudaSetDevice(device_), "cudaSetDevice");
    // Never NVLink multicast on the shared machines (an explicit setting is respected).
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    ncclUniqueId id;
    std::memcpy(id.internal, handles[0].data(), sizeof(id.internal));
    const ncclResult_t r = ncclCommInitRank(&comm_, world_, id, rank_);
    if (r != ncclSuccess)
      throw std::runtime_error(
          std::string("torch_afdep NCCL transport: ncclCommInitRank failed (") +
          ncclGetErrorString(r) + "); NCCL needs one rank per GPU: use AFDEP_TRANSPORT=ipc "
          "when ranks share a GPU");
    nccl_check(ncclCommWindowRegister(comm_, base_, bytes_, &win_, NCCL_WIN_COLL_SYMMETRIC),
               "ncclCommWindowRegister");
    ncclDevCommRequirements reqs;
    std::memset(&reqs, 0, sizeof(reqs));  // no barriers, no multimem, no GIN
    nccl_check(ncclDevCommCreate(comm_, &reqs, &dev_), "ncclDevCommCreate");
    dev_created_ = true;
    if (dev_.lsaSize != world_)
      throw std::runtime_error(
          "torch_afdep NCCL transport: only " + std::to_string(dev_.lsaSize) + " of " +
          std::to_string(world_) + " ranks are load/store accessible (one NVLink domain is "
          "required)");
    uint64_t* d = nullptr;
    cuda_check(cudaMalloc(&d, (size_t)world_ * 8), "cudaMalloc(peer table)");
    lsa_peer_table<<<(world_ + 255) / 256, 256>>>(win_, world_, d);
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    bases_.assign(world_, 0);
    if (e == cudaSuccess) e = cudaMemcpy(bases_.data(), d, (size_t)world_ * 8, cudaMemcpyDeviceToHost);
    cudaFree(d);
    cuda_check(e, "reading the LSA peer table");
    bases_[rank_] = reinterpret_cast<uint64_t>(base_);  // own window: the local pointer
  }

  const std::vector<uint64_t>& peer_bases() const override { return bases_; }

  void close(bool clean) override {
    if (closed_) return;
    closed_ = true;
    cudaSetDevice(device_);
    cudaDeviceSynchronize();
    if (comm_ && clean) {  // every peer reached close: the collective teardown cannot hang
      if (dev_created_) ncclDevCommDestroy(comm_, &dev_);
      if (win_) ncclCommWindowDeregister(comm_, win_);
      ncclCommDestroy(comm_);
    } else if (comm_) {  // a peer may be gone: tear down without talking to it
      ncclCommAbort(comm_);
    }
    comm_ = nullptr;
    win_ = nullptr;
    if (base_) ncclMemFree(base_);
    base_ = nullptr;
    bases_.clear();
  }

 private:
  int device_, rank_, world_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  ncclComm_t comm_ = nullptr;
  ncclWindow_t win_ = nullptr;
  ncclDevComm dev_{};
  bool dev_created_ = false;
  bool closed_ = false;
  std::vector<uint64_t> bases_;
};

}  // namespace

std::unique_ptr<Transport> make_nccl_transport(int device, int rank, int world) {
  return std::unique_ptr<Transport>(new NcclTransport(device, rank, world));
}

#else  // built without the NCCL headers

int nccl_header_version() { return 0; }
int nccl_runtime_version() { return -1; }

std::unique_ptr<Transport> make_nccl_transport(int, int, int) {
  throw std::runtime_error(
      "torch_afdep was built without the NCCL headers (no nvidia-nccl-cu13 found at build "
      "time, or AFDEP_NCCL=0): AFDEP_TRANSPORT=nccl is unavailable; rebuild with the NCCL "
      "that torch loads installed, or use AFDEP_TRANSPORT=ipc");
}

#endif

}  // namespace afdep
