// What polling costs the threads that do the work, on one GPU: the latency of one thread's
// dependent loads and of a flag's store-to-load crossing between two CTAs, alone and while
// other CTAs spin on flags (as a waiting receive's CTAs do while the sender works), with and
// without a __nanosleep between their polls; and how long __nanosleep(N) actually sleeps.
// Standalone (no torch, no library): every number of the T = 1 chain's stages is a few such
// latencies, and on a GPU that ranks share the other rank's waiting CTAs spin beside them.
// Build and run (prints one JSON object):
//   nvcc -O3 -arch=sm_90a -o /tmp/poll_probe scripts/poll_probe.cu && /tmp/poll_probe
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                        \
  do {                                                                               \
    cudaError_t e_ = (x);                                                            \
    if (e_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint64_t ld_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

struct Args {
  uint64_t* chain;   // [kChain * 16]: a pointer chase, one 128-B line a step
  uint64_t* ping;    // [32]: ping word at 0, pong word at 16 (different lines)
  uint64_t* polled;  // [pollers' flags, one line each]
  uint64_t* stop;    // set when the measurement is over
  uint64_t* out;     // [4]: chain ns per load, ping-pong ns per round trip, spins, -
  int steps, rounds, poll_sleep_ns, poll_lines;
};
constexpr int kChain = 64;

// CTA 0 thread 0: the dependent loads, then the initiator of the ping-pong; CTA 1 thread 0:
// the responder; CTAs 2.. : pollers (every thread spins on one of poll_lines flag lines, which
// nobody writes, until stop).
__global__ void probe(Args a) {
  const int c = blockIdx.x;
  if (c >= 2) {
    const uint64_t* f = a.polled + 16 * ((c * blockDim.x + threadIdx.x) % a.poll_lines);
    uint64_t spins = 0, sink = 0;
    while (ld_sys(a.stop) == 0) {
      sink += ld_sys(f);
      ++spins;
      if (a.poll_sleep_ns > 0) __nanosleep(a.poll_sleep_ns);
    }
    if (sink == 12345) a.out[3] = sink;  // keeps the loads
    if (threadIdx.x == 0) atomicAdd(reinterpret_cast<unsigned long long*>(&a.out[2]), spins);
    return;
  }
  if (threadIdx.x != 0) return;
  // let the pollers start (and the responder reach its loop)
  const uint64_t t0 = now_ns();
  while (now_ns() - t0 < 20000) {
  }
  if (c == 0) {
    uint64_t idx = 0;
    const uint64_t s = now_ns();
    for (int i = 0; i < a.steps; ++i) idx = ld_sys(a.chain + 16 * (idx % kChain));
    const uint64_t e = now_ns();
    a.out[0] = (e - s) / (uint64_t)a.steps + (idx == 999999 ? 1 : 0);
    const uint64_t p0 = now_ns();
    for (int r = 1; r <= a.rounds; ++r) {
      st_sys(a.ping, (uint64_t)r);
      while (ld_sys(a.ping + 16) != (uint64_t)r) {
      }
    }
    a.out[1] = (now_ns() - p0) / (uint64_t)a.rounds;
    st_sys(a.stop, 1);
  } else {
    for (int r = 1; r <= a.rounds; ++r) {
      while (ld_sys(a.ping) != (uint64_t)r) {
      }
      st_sys(a.ping + 16, (uint64_t)r);
    }
  }
}

// A kernel's first load: one thread stamps, loads p (written by `writer` just before, or not),
// branches on the value (which waits for it) and stamps again; out[i] = the ns between.
__global__ void writer(uint64_t* p, uint64_t v) { st_sys(p, v); }
__global__ void first_load(const uint64_t* p, uint64_t* out, int i) {
  const uint64_t t0 = now_ns();
  const uint64_t v = ld_sys(p);
  if (v == 0x0123456789abcdefull) out[1023] = v;  // (the branch waits for the load)
  out[i] = now_ns() - t0;
}

// one thread: __nanosleep(n) `reps` times; out = mean ns a call
__global__ void sleep_probe(int n, int reps, uint64_t* out) {
  const uint64_t s = now_ns();
  for (int i = 0; i < reps; ++i) __nanosleep(n);
  *out = (now_ns() - s) / (uint64_t)reps;
}

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint64_t *chain, *ping, *polled, *stop, *out;
  const int max_lines = 1024;
  CK(cudaMalloc(&chain, kChain * 16 * 8));
  CK(cudaMalloc(&ping, 32 * 8));
  CK(cudaMalloc(&polled, max_lines * 16 * 8));
  CK(cudaMalloc(&stop, 8));
  CK(cudaMalloc(&out, 4 * 8));
  std::vector<uint64_t> h(kChain * 16, 0);
  for (int i = 0; i < kChain; ++i) h[16 * i] = (uint64_t)((i * 37 + 11) % kChain);  // a cycle
  CK(cudaMemcpy(chain, h.data(), h.size() * 8, cudaMemcpyHostToDevice));
  CK(cudaMemset(polled, 0, max_lines * 16 * 8));

  std::printf("{\"sms\": %d, \"sleep_ns\": {", sms);
  const int sleeps[] = {0, 20, 50, 100, 200, 500, 1000};
  for (int i = 0; i < 7; ++i) {
    sleep_probe<<<1, 1>>>(sleeps[i], 200, out);
    uint64_t v = 0;
    CK(cudaMemcpy(&v, out, 8, cudaMemcpyDeviceToHost));
    std::printf("%s\"%d\": %llu", i ? ", " : "", sleeps[i], (unsigned long long)v);
  }
  // first loads of fresh kernels: a line just written (TLB and L2 warm), a line of a new 2-MB
  // page each time that a writer kernel touched first (translation fetched once, by another
  // SM), and a new page's line that nothing touched since the allocation was cleared
  std::printf("}, \"first_load_ns\": {");
  uint64_t* big = nullptr;
  const size_t page = 2u << 20, pages = 512;  // 1 GB
  CK(cudaMalloc(&big, page * pages));
  CK(cudaMemset(big, 0, page * pages));
  uint64_t* fl_out = nullptr;
  CK(cudaMalloc(&fl_out, 1024 * 8));
  const char* names[] = {"same_line_written", "new_page_written", "new_page_untouched"};
  for (int mode = 0; mode < 3; ++mode) {
    const int reps = 100;
    for (int i = 0; i < reps; ++i) {
      uint64_t* p = mode == 0 ? polled : big + (page / 8) * (size_t)(i + 1 + mode * 200);
      if (mode < 2) writer<<<1, 1>>>(p, (uint64_t)i + 1);
      first_load<<<1, 1>>>(p, fl_out, i);
    }
    CK(cudaDeviceSynchronize());
    std::vector<uint64_t> v(reps);
    CK(cudaMemcpy(v.data(), fl_out, reps * 8, cudaMemcpyDeviceToHost));
    std::sort(v.begin(), v.end());
    std::printf("%s\"%s\": {\"min\": %llu, \"median\": %llu, \"max\": %llu}", mode ? ", " : "",
                names[mode], (unsigned long long)v[0], (unsigned long long)v[reps / 2],
                (unsigned long long)v[reps - 1]);
  }
  std::printf("}, \"cases\": [");
  // pollers: CTAs x threads, lines they spread over, sleep between polls
  struct Case { int ctas, threads, lines, sleep; };
  const Case cases[] = {{0, 32, 1, 0},     {12, 32, 24, 0},   {12, 512, 24, 0},
                        {12, 32, 24, 100}, {12, 512, 24, 100}, {12, 512, 24, 500},
                        {22, 512, 512, 0}, {22, 512, 512, 100}};
  bool first = true;
  for (const Case& k : cases) {
    for (int rep = 0; rep < 3; ++rep) {
      CK(cudaMemset(ping, 0, 32 * 8));
      CK(cudaMemset(stop, 0, 8));
      CK(cudaMemset(out, 0, 4 * 8));
      Args a{chain, ping, polled, stop, out, 2000, 2000, k.sleep, k.lines};
      const int grid = 2 + std::min(k.ctas, sms - 2);
      probe<<<grid, k.ctas ? k.threads : 32>>>(a);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      uint64_t o[4];
      CK(cudaMemcpy(o, out, sizeof o, cudaMemcpyDeviceToHost));
      std::printf("%s{\"poll_ctas\": %d, \"poll_threads\": %d, \"poll_lines\": %d, "
                  "\"poll_sleep_ns\": %d, \"rep\": %d, \"load_ns\": %llu, "
                  "\"round_trip_ns\": %llu, \"poll_spins\": %llu}",
                  first ? "" : ", ", k.ctas, k.ctas ? k.threads : 0, k.lines, k.sleep, rep,
                  (unsigned long long)o[0], (unsigned long long)o[1],
                  (unsigned long long)o[2]);
      first = false;
    }
  }
  std::printf("]}\n");
  return 0;
}
