// Probes: a flag ping-pong between two ranks' windows, the latency term of the benchmarks'
// data-movement floor (one thread per side; nothing else runs in it), and a one-thread
// %globaltimer stamp that benchmarks.trace puts on the stream around a graph replay.
#include "afdep/launch.h"
#include "common.cuh"

namespace afdep {

namespace {

// The initiator stores base + i into the peer's ping word and waits for the same value in
// its own; the responder waits, then echoes. Values only grow (base advances per call).
__global__ void ping_kernel(Layout L, int peer, int iters, uint64_t base, int initiator) {
  uint64_t* mine = reinterpret_cast<uint64_t*>(peer_base(L, L.rank) + L.off_ping);
  uint64_t* theirs = reinterpret_cast<uint64_t*>(peer_base(L, peer) + L.off_ping);
  const uint64_t deadline = global_timer_ns() + L.timeout_ns;
  for (int i = 1; i <= iters; ++i) {
    const uint64_t v = base + (uint64_t)i;
    if (initiator) st_release_sys(theirs, v);
    if (!wait_geq(mine, v, deadline, L.err, kPhaseProbe, peer, L.rank)) return;
    if (!initiator) st_release_sys(theirs, v);
  }
}

__global__ void stamp_kernel(uint64_t* out) { *out = global_timer_ns(); }

}  // namespace

cudaError_t launch_stamp(uint64_t* out, cudaStream_t stream) {
  stamp_kernel<<<1, 1, 0, stream>>>(out);
  return cudaGetLastError();
}

cudaError_t launch_ping(const Layout& L, int peer, int iters, uint64_t base, int initiator,
                        cudaStream_t stream) {
  ping_kernel<<<1, 1, 0, stream>>>(L, peer, iters, base, initiator);
  return cudaGetLastError();
}

}  // namespace afdep
