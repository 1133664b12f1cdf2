// The transport interface: each rank registers one window; the kernels see a table of every
// rank's window base (own rank = the local pointer) and address signal slots inside it.
// Kernels know nothing of how the table was built (CUDA IPC, or NCCL LSA windows).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace afdep {

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  // Allocate and zero this rank's window (collective only through the host glue).
  virtual void* allocate(size_t bytes) = 0;
  // Opaque bytes the host glue hands to every peer.
  virtual std::string export_handle() = 0;
  // Map every peer's window; handles[r] is rank r's export_handle().
  virtual void open_peers(const std::vector<std::string>& handles, int rank) = 0;
  // Base pointer of every rank's window in this process (after open_peers).
  virtual const std::vector<uint64_t>& peer_bases() const = 0;
  // Unmap peers and free the window. Idempotent. clean: every peer reached close too (a
  // transport with collective teardown may talk to them); else tear down locally.
  virtual void close(bool clean) = 0;
};

std::unique_ptr<Transport> make_ipc_transport(int device);
// NCCL device-API (LSA window) transport; throws when built without the NCCL headers or
// when the loaded libnccl is not the headers' version.
std::unique_ptr<Transport> make_nccl_transport(int device, int rank, int world);
int nccl_header_version();   // NCCL_VERSION_CODE of the build's headers; 0 without NCCL
int nccl_runtime_version();  // ncclGetVersion of the loaded libnccl; -1 without NCCL

}  // namespace afdep
