// Probes: a flag ping-pong between two ranks' windows, the latency term of the benchmarks'
// data-movement floor (one thread per side; nothing else runs in it), a one-thread
// %globaltimer stamp that benchmarks.trace puts on the stream around a graph replay, and the
// timer's resolution.
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

// One thread reads %globaltimer `reads` times back to back: out[0] = the smallest step it saw
// advance (its resolution: the trace's sub-stages are quantized to it), out[1] = how many
// times it advanced, out[2] = the time the reads spanned (ns).
__global__ void timer_step_kernel(uint64_t* out, int reads) {
  const uint64_t t0 = global_timer_ns();
  uint64_t prev = t0, step = ~0ull, changes = 0;
  for (int i = 0; i < reads; ++i) {
    const uint64_t t = global_timer_ns();
    if (t != prev) {
      step = t - prev < step ? t - prev : step;
      ++changes;
      prev = t;
    }
  }
  out[0] = changes ? step : 0;
  out[1] = changes;
  out[2] = prev - t0;
}

}  // namespace

cudaError_t launch_stamp(uint64_t* out, cudaStream_t stream) {
  stamp_kernel<<<1, 1, 0, stream>>>(out);
  return cudaGetLastError();
}

cudaError_t launch_timer_step(uint64_t* out, int reads, cudaStream_t stream) {
  timer_step_kernel<<<1, 1, 0, stream>>>(out, reads);
  return cudaGetLastError();
}

cudaError_t launch_ping(const Layout& L, int peer, int iters, uint64_t base, int initiator,
                        cudaStream_t stream) {
  ping_kernel<<<1, 1, 0, stream>>>(L, peer, iters, base, initiator);
  return cudaGetLastError();
}

}  // namespace afdep
