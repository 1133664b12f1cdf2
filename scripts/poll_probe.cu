// What polling costs the threads that do the work, on one GPU: the latency of one thread's
// dependent loads and of a flag's store-to-load crossing between two CTAs, alone and while
// other CTAs spin on flags (as a waiting receive's CTAs do while the sender works), with and
// without a __nanosleep between their polls; and how long __nanosleep(N) actually sleeps.
// Standalone (no torch, no library): every number of the T = 1 chain's stages is a few such
// latencies, and on a GPU that ranks share the other rank's waiting CTAs spin beside them.
// Build and run (prints one JSON object):
//   nvcc -O3 -arch=sm_90a -o /tmp/poll_probe scripts/poll_probe.cu && /tmp/poll_probe
// Two processes on one GPU (under a CUDA MPS daemon, as the benchmarks' ranks share it), each
// with its own window opened by the other through a CUDA IPC handle, as the library's ranks:
//   d=$(mktemp -d); /tmp/poll_probe ipc 1 $d & /tmp/poll_probe ipc 0 $d; wait
// (rank 0 prints the flag round trips, relaxed stores and fenced release stores)
// A row's crossing by format (flagged 8-byte units or 128-byte lines), size and sender CTAs:
//   /tmp/poll_probe rows
// A fresh kernel's row (a new sender kernel each round, a persistent receiver):
//   /tmp/poll_probe fresh
// Where a token's metadata waits (the sender's SM or the receiver's), senders and receivers
// spread over CTAs or not:
//   /tmp/poll_probe queue
// The same crossing between two processes under MPS, through a CUDA IPC handle (rank 0 prints):
//   d=$(mktemp -d); /tmp/poll_probe ipcq 1 $d & /tmp/poll_probe ipcq 0 $d; wait
// A kernel's first load as the library launches its kernels (graph, PDL, parameter block):
//   /tmp/poll_probe launch
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
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
// the library's signal: a system fence, then the flag (release = a second fence in front)
__device__ __forceinline__ void st_rel_sys(uint64_t* p, uint64_t v) {
  asm volatile("fence.acq_rel.sys;\n\tst.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v)
               : "memory");
}
__device__ __forceinline__ void put(uint64_t* p, uint64_t v, bool release) {
  if (release) st_rel_sys(p, v); else st_sys(p, v);
}
// A sender CTA's start of round r: thread 0 waits until the receiver side posts r at *go
// (it is polling round r), then stamps the round's start at *stamp (null: no stamp); false in
// every thread at the deadline
__device__ bool sender_round_start(const uint64_t* go, uint64_t r, uint64_t* stamp,
                                   uint64_t deadline) {
  int quit = 0;
  if (threadIdx.x == 0) {
    while (ld_sys(go) != r)
      if (now_ns() > deadline) { quit = 1; break; }
    if (stamp != nullptr) st_sys(stamp, now_ns());
  }
  return !__syncthreads_or(quit);
}

struct Args {
  uint64_t* chain;   // [kChain * 16]: a pointer chase, one 128-B line a step
  uint64_t* ping;    // [32]: ping word at 0, pong word at 16 (different lines)
  uint64_t* polled;  // [pollers' flags, one line each]
  uint64_t* stop;    // set when the measurement is over
  uint64_t* out;     // [4]: chain ns per load, ping-pong ns per round trip, spins, -
  int steps, rounds, poll_sleep_ns, poll_lines, release;
};
constexpr int kChain = 64;

// CTA 0 thread 0: the dependent loads, then the initiator of the ping-pong; CTA 1 thread 0:
// the responder; CTAs 2.. : pollers (every thread spins on one of poll_lines flag lines, which
// nobody writes, until stop).
__global__ void probe(Args a) {
  const int c = blockIdx.x;
  if (c >= 2) {
    // poll_lines < 0: every poller spins on the ping word's line itself (the flag the
    // measured round trip writes), as a receive's waiting threads spin on the lines the
    // sender's stores land in
    const uint64_t* f = a.poll_lines < 0
                            ? a.ping
                            : a.polled + 16 * ((c * blockDim.x + threadIdx.x) % a.poll_lines);
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
      put(a.ping, (uint64_t)r, a.release);
      while (ld_sys(a.ping + 16) != (uint64_t)r) {
      }
    }
    a.out[1] = (now_ns() - p0) / (uint64_t)a.rounds;
    st_sys(a.stop, 1);
  } else {
    for (int r = 1; r <= a.rounds; ++r) {
      while (ld_sys(a.ping) != (uint64_t)r) {
      }
      put(a.ping + 16, (uint64_t)r, a.release);
    }
  }
}

// One token's crossing as the T = 1 exchange sends it: CTA 0 (512 threads) writes 26
// metadata units (warp 0, first) and an 8 KB row as 16 KB of flagged units (each thread one
// 16-byte vector as four 8-byte units, two 16-byte stores); CTA 1 (512 threads) polls them
// all until every one carries the round's flag (warp 0 the metadata, each thread its row
// vector's units). out[r]: ns from the sender's first store to the receiver's "all seen";
// out[rounds + r]: to warp 0 of the receiver seeing the metadata. contiguous: a warp's first
// store instruction writes the first halves of its 32 vectors as 512 contiguous bytes and the
// second the second halves (the library's rows: each lane's 32 bytes in turn, every
// instruction half-filling 1 KB). gpu_scope: the row's stores at .gpu scope (enough on one
// GPU, not across GPUs). sleepy: each receiver thread sleeps 200 ns between polls of its row
// units (is it the polling that slows the stores?).
constexpr int kMetaUnits = 26, kRowVecs = 512;
__global__ void crossing(uint64_t* meta, uint64_t* row, uint64_t* sync, uint64_t* out,
                         int rounds, int contiguous, int gpu_scope, int sleepy) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint64_t deadline = now_ns() + 5000000000ull;
  // unit index of half h (0, 1) of vector v
  auto unit = [&](int v, int h) {
    return contiguous ? 128 * (v >> 5) + 64 * h + 2 * (v & 31) : 4 * v + 2 * h;
  };
  for (int r = 1; r <= rounds; ++r) {
    const uint64_t f = (uint64_t)r << 32;
    if (blockIdx.x == 0) {
      if (!sender_round_start(sync, r, sync + 16, deadline)) return;
      if (warp == 0 && lane < kMetaUnits) st_sys(meta + lane, f | (uint32_t)lane);
      const int v = tid;
      uint64_t* p0 = row + unit(v, 0);
      uint64_t* p1 = row + unit(v, 1);
      if (gpu_scope) {
        asm volatile("st.relaxed.gpu.global.v2.u64 [%0], {%1, %2};" ::"l"(p0), "l"(f | 1),
                     "l"(f | 2) : "memory");
        asm volatile("st.relaxed.gpu.global.v2.u64 [%0], {%1, %2};" ::"l"(p1), "l"(f | 3),
                     "l"(f | 4) : "memory");
      } else {
        asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p0), "l"(f | 1),
                     "l"(f | 2) : "memory");
        asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p1), "l"(f | 3),
                     "l"(f | 4) : "memory");
      }
      __syncthreads();
    } else {
      if (tid == 0) st_sys(sync, (uint64_t)r);
      bool ok = true;
      if (warp == 0 && lane < kMetaUnits) {
        while ((ld_sys(meta + lane) >> 32) != (uint64_t)r)
          if (now_ns() > deadline) { ok = false; break; }
      }
      __syncwarp();
      const uint64_t tm = now_ns();
      const int v = tid;
      for (int h = 0; h < 2 && ok; ++h) {
        const uint64_t* p = row + unit(v, h);
        while ((ld_sys(p) >> 32) != (uint64_t)r || (ld_sys(p + 1) >> 32) != (uint64_t)r) {
          if (now_ns() > deadline) { ok = false; break; }
          if (sleepy) __nanosleep(200);
        }
      }
      const bool all = __syncthreads_and(ok);
      if (!all) return;
      if (tid == 0) {
        const uint64_t t0 = ld_sys(sync + 16), t1 = now_ns();
        out[r - 1] = t1 - t0;
        out[rounds + r - 1] = tm - t0;
      }
      __syncthreads();
    }
  }
}

// The same row sent by G CTAs (CTA g: vectors [g * 512 / G, (g + 1) * 512 / G), each thread
// up to one vector; CTA 0's warp 0 also the metadata) and polled by G receiver CTAs (CTA G + g
// polls the same slice; CTA G's warp 0 the metadata). out[r]: ns from the first sender's
// first store to the last receiver CTA's "all seen".
__global__ void crossing_spread(uint64_t* meta, uint64_t* row, uint64_t* sync, uint64_t* out,
                                int rounds, int G) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool sender = blockIdx.x < G;
  const int g = sender ? blockIdx.x : blockIdx.x - G;
  const int per = kRowVecs / G, v = g * per + tid;
  const bool mine = tid < per;
  const uint64_t deadline = now_ns() + 5000000000ull;
  for (int r = 1; r <= rounds; ++r) {
    const uint64_t f = (uint64_t)r << 32;
    if (sender) {
      // (every receiver CTA posts at its own word)
      if (!sender_round_start(sync + 32 * g, r, g == 0 ? sync + 16 : nullptr, deadline)) return;
      if (g == 0 && warp == 0 && lane < kMetaUnits) st_sys(meta + lane, f | (uint32_t)lane);
      if (mine) {
        uint64_t* p = row + 4 * v;
        asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(f | 1),
                     "l"(f | 2) : "memory");
        asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p + 2), "l"(f | 3),
                     "l"(f | 4) : "memory");
      }
      __syncthreads();
    } else {
      if (tid == 0) st_sys(sync + 32 * g, (uint64_t)r);
      bool ok = true;
      if (g == 0 && warp == 0 && lane < kMetaUnits) {
        while ((ld_sys(meta + lane) >> 32) != (uint64_t)r)
          if (now_ns() > deadline) { ok = false; break; }
      }
      for (int h = 0; h < 4 && ok && mine; ++h) {
        const uint64_t* p = row + 4 * v + h;
        while ((ld_sys(p) >> 32) != (uint64_t)r)
          if (now_ns() > deadline) { ok = false; break; }
      }
      if (!__syncthreads_and(ok)) return;
      if (tid == 0) {
        const uint64_t t0 = ld_sys(sync + 16), t1 = now_ns();
        atomicMax(reinterpret_cast<unsigned long long*>(out + r - 1),
                  (unsigned long long)(t1 - t0));
      }
      __syncthreads();
    }
  }
}

// A row's crossing by format, size and sender CTAs: G sender CTAs (512 threads) store a row of
// `data` bytes, one 16-byte store per slot, slots dealt out in order (CTA g: slots [512 g,
// 512 g + 512), then [512 (G + g), ...) ...), so a warp's store instruction writes 512
// contiguous bytes); one receiver CTA (512 threads) polls every slot until it carries the
// round and checks its data. fmt 0: flagged 8-byte units (4 bytes of data, 4 of flag, as the
// library's rows; a slot = 8 bytes of data). fmt 1: 128-byte lines, each 8 slots, whose last
// 8 bytes are the flag (120 bytes of data a line); the receiver takes a line only when its
// flag is the round's, then checks all 8 slots: `tears` counts lines whose flag was seen
// before their data (a 128-byte store's parts arriving apart). out[r]: ns from the first
// sender's first store to the receiver's "all seen".
__device__ __forceinline__ void ld_sys2(const uint64_t* p, uint64_t& x, uint64_t& y) {
  asm volatile("ld.relaxed.sys.global.v2.u64 {%0, %1}, [%2];" : "=l"(x), "=l"(y) : "l"(p)
               : "memory");
}
__device__ __forceinline__ void st_sys2(uint64_t* p, uint64_t x, uint64_t y) {
  asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(x), "l"(y)
               : "memory");
}
// Spins until slot s of a row of flagged units (two 8-byte units, flag in each high half)
// carries round r; false at the deadline.
__device__ __forceinline__ bool wait_slot(const uint64_t* row, int s, uint64_t r,
                                          uint64_t deadline) {
  for (;;) {
    uint64_t x, y;
    ld_sys2(row + 2 * s, x, y);
    if ((x >> 32) == r && (y >> 32) == r) return true;
    if (now_ns() > deadline) return false;
  }
}
__device__ __forceinline__ uint64_t row_word(int fmt, uint32_t r, int s, int j) {
  // fmt 0: flag r in the high half of each unit; fmt 1: data words (the flag word is r)
  return fmt == 0 ? ((uint64_t)r << 32) | (uint32_t)(2 * s + j)
                  : ((uint64_t)(r * 2654435761u) << 32) | (uint32_t)(2 * s + j);
}
__global__ void crossing_fmt(uint64_t* row, uint64_t* sync, uint64_t* out, uint64_t* tears,
                             int rounds, int fmt, int slots, int G) {
  const int tid = threadIdx.x, lane = tid & 31;
  const bool sender = blockIdx.x < G;
  const uint64_t deadline = now_ns() + 5000000000ull;
  for (int r = 1; r <= rounds; ++r) {
    if (sender) {
      const int g = blockIdx.x;
      if (!sender_round_start(sync, r, g == 0 ? sync + 16 : nullptr, deadline)) return;
      for (int s = 512 * g + tid; s < slots; s += 512 * G) {
        const bool flag_slot = fmt == 1 && (s & 7) == 7;
        st_sys2(row + 2 * s, row_word(fmt, r, s, 0),
                flag_slot ? (uint64_t)r : row_word(fmt, r, s, 1));
      }
      __syncthreads();
    } else {
      if (tid == 0) st_sys(sync, (uint64_t)r);
      bool ok = true;
      uint64_t torn = 0;
      for (int base = tid - lane; base < slots && ok; base += 512) {
        const int s = base + lane;
        const bool have = s < slots;
        for (;;) {
          uint64_t x = 0, y = 0;
          if (have) ld_sys2(row + 2 * s, x, y);
          bool seen;
          if (fmt == 0) {
            seen = !have || ((x >> 32) == (uint64_t)r && (y >> 32) == (uint64_t)r);
          } else {  // the line's flag (its slot 7), then every slot's data
            const bool fl = __shfl_sync(0xffffffffu, y, lane | 7) == (uint64_t)r;
            const bool good = !have || (x == row_word(1, r, s, 0) &&
                                        ((s & 7) == 7 || y == row_word(1, r, s, 1)));
            const unsigned bad = __ballot_sync(0xffffffffu, !good);
            const bool mine_good = ((bad >> (lane & ~7)) & 0xffu) == 0;
            if (fl && !mine_good && (lane & 7) == 0) ++torn;  // polls, not lines
            seen = !have || (fl && mine_good);
          }
          if (__all_sync(0xffffffffu, seen)) break;
          if (now_ns() > deadline) { ok = false; break; }
        }
      }
      const bool all = __syncthreads_and(ok);
      if (torn) atomicAdd(reinterpret_cast<unsigned long long*>(tears), torn);
      if (!all) return;
      if (tid == 0) out[r - 1] = now_ns() - ld_sys(sync + 16);
      __syncthreads();
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

// Two processes: each writes the other's window and spins on its own (word 0: the ping-pong,
// word 16: a start handshake, so that both kernels run before the timing starts).
__global__ void ipc_ping(uint64_t* mine, uint64_t* theirs, int initiator, int rounds,
                         uint64_t* out) {
  const uint64_t deadline = now_ns() + 5000000000ull;
  st_sys(theirs + 16, 1);
  while (ld_sys(mine + 16) != 1)
    if (now_ns() > deadline) return;
  for (int release = 0; release < 2; ++release) {
    const uint64_t base = (uint64_t)release * rounds;
    const uint64_t s = now_ns();
    for (int r = 1; r <= rounds; ++r) {
      const uint64_t v = base + (uint64_t)r;
      if (initiator) put(theirs, v, release);
      while (ld_sys(mine) != v)
        if (now_ns() > deadline) return;
      if (!initiator) put(theirs, v, release);
    }
    out[release] = (now_ns() - s) / (uint64_t)rounds;
  }
}

// Two processes' windows: writes this rank's CUDA IPC handle of win to <dir>/<tag><rank>.bin
// (whole, through a rename); with peer >= 0 waits for <dir>/<tag><peer>.bin and returns the
// peer's window opened through it (nullptr, said on stderr, when it never came)
static void* share_window(const char* dir, const char* tag, int rank, int peer, void* win) {
  cudaIpcMemHandle_t h;
  CK(cudaIpcGetMemHandle(&h, win));
  char path[512], tmp[520];
  std::snprintf(path, sizeof path, "%s/%s%d.bin", dir, tag, rank);
  std::snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE* f = std::fopen(tmp, "wb");
  std::fwrite(&h, sizeof h, 1, f);
  std::fclose(f);
  std::rename(tmp, path);
  if (peer < 0) return nullptr;
  std::snprintf(path, sizeof path, "%s/%s%d.bin", dir, tag, peer);
  cudaIpcMemHandle_t ph;
  for (int i = 0;; ++i) {
    f = std::fopen(path, "rb");
    if (f != nullptr && std::fread(&ph, sizeof ph, 1, f) == 1) break;
    if (f != nullptr) std::fclose(f);
    if (i > 100000) {
      std::fprintf(stderr, "rank %d: no handle from rank %d\n", rank, peer);
      return nullptr;
    }
    struct timespec ts = {0, 100000};
    nanosleep(&ts, nullptr);
  }
  std::fclose(f);
  void* theirs = nullptr;
  CK(cudaIpcOpenMemHandle(&theirs, ph, cudaIpcMemLazyEnablePeerAccess));
  return theirs;
}

static int ipc_main(int rank, const char* dir) {
  uint64_t *win, *out;
  CK(cudaMalloc(&win, 4096));
  CK(cudaMemset(win, 0, 4096));
  CK(cudaMalloc(&out, 2 * 8));
  CK(cudaMemset(out, 0, 2 * 8));
  CK(cudaDeviceSynchronize());
  void* theirs = share_window(dir, "h", rank, 1 - rank, win);
  if (theirs == nullptr) return 1;
  const int rounds = 2000;
  ipc_ping<<<1, 32>>>(win, static_cast<uint64_t*>(theirs), rank == 0, rounds, out);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  uint64_t o[2];
  CK(cudaMemcpy(o, out, sizeof o, cudaMemcpyDeviceToHost));
  if (rank == 0)
    std::printf("{\"ipc_round_trip_ns\": {\"relaxed\": %llu, \"release\": %llu}}\n",
                (unsigned long long)o[0], (unsigned long long)o[1]);
  CK(cudaIpcCloseMemHandle(theirs));
  return o[0] && o[1] ? 0 : 1;  // 0 ns: a wait timed out
}

// A fresh kernel's row: the sender is a new kernel each round (launched from the host once the
// previous round was seen), the receiver one persistent CTA polling every slot of the row (8 KB
// as 16 KB of flagged units, a warp's store 512 contiguous bytes, as crossing_fmt's fmt 0). The
// sender stamps its start (globaltimer) and then, by mode: 0 stores at once; 1 first loads
// an 8 KB source row (a separate buffer, as the dispatch loads its tokens) and stores it; 2 as
// 1, but its last warp first asks L2 for the row's first and last lines (prefetch.global.L2,
// as the library's small forms once tried). out[r]: ns from the sender's start stamp to the
// receiver's "all seen" (fresh kernels against crossing_fmt's persistent sender).
__global__ void fresh_send(uint64_t* row, const int4* src, uint64_t* stamp, int slots, int r,
                           int mode) {
  const int tid = threadIdx.x;
  if (tid == 0) st_sys(stamp + r, now_ns());
  if (mode == 2 && tid >> 5 == 15 && (tid & 31) < 2) {
    const uint64_t* p = (tid & 1) ? row + 2 * (slots - 1) : row;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
  }
  for (int s = tid; s < slots; s += blockDim.x) {
    uint32_t d0 = (uint32_t)(2 * s), d1 = (uint32_t)(2 * s + 1);
    if (mode >= 1) {  // half a 16-byte source vector a slot
      const int4 v = src[s >> 1];
      d0 ^= (uint32_t)((s & 1) ? v.z : v.x);
      d1 ^= (uint32_t)((s & 1) ? v.w : v.y);
    }
    st_sys2(row + 2 * s, ((uint64_t)r << 32) | d0, ((uint64_t)r << 32) | d1);
  }
}
__global__ void fresh_recv(const uint64_t* row, uint64_t* stamp, uint64_t* out,
                           int slots, int rounds) {
  const int tid = threadIdx.x;
  const uint64_t deadline = now_ns() + 20000000000ull;
  for (int r = 1; r <= rounds; ++r) {
    bool ok = true;
    for (int s = tid; s < slots && ok; s += blockDim.x) ok = wait_slot(row, s, r, deadline);
    if (!__syncthreads_and(ok)) return;
    if (tid == 0) {
      const uint64_t t1 = now_ns();
      uint64_t t0;
      while ((t0 = ld_sys(stamp + r)) == 0) {
      }
      out[r - 1] = t1 - t0;
      st_sys(stamp, (uint64_t)r);  // seen: the host may launch the next sender
    }
    __syncthreads();
  }
}

// rounds [at, at + n) of a device array of per-round ns, the first 10 (warm-up) dropped, sorted
static std::vector<uint64_t> sorted_rounds(const uint64_t* dev, int at, int n) {
  std::vector<uint64_t> v(n);
  CK(cudaMemcpy(v.data(), dev + at, n * 8, cudaMemcpyDeviceToHost));
  std::vector<uint64_t> kept(v.begin() + 10, v.end());
  std::sort(kept.begin(), kept.end());
  return kept;
}

static int fresh_main() {
  const int rounds = 110, slots = 1024;  // 8 KB of data as 16 KB of units
  std::printf("{\"rounds\": %d, \"cases\": [", rounds - 10);
  uint64_t *row, *stamp, *out;
  int4* src;
  CK(cudaMalloc(&row, 2 * slots * 8));
  CK(cudaMalloc(&stamp, (rounds + 1) * 8));
  CK(cudaMalloc(&out, rounds * 8));
  CK(cudaMalloc(&src, 8192));
  CK(cudaMemset(src, 1, 8192));
  cudaStream_t s1, s2;
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  const char* names[] = {"store_at_once", "load_then_store", "load_then_store_prefetched"};
  for (int mode = 0; mode < 3; ++mode) {
    for (int rep = 0; rep < 2; ++rep) {
      CK(cudaMemset(row, 0, 2 * slots * 8));
      CK(cudaMemset(stamp, 0, (rounds + 1) * 8));
      CK(cudaDeviceSynchronize());
      fresh_recv<<<1, 512, 0, s1>>>(row, stamp, out, slots, rounds);
      CK(cudaGetLastError());
      for (int r = 1; r <= rounds; ++r) {
        fresh_send<<<1, 512, 0, s2>>>(row, src, stamp, slots, r, mode);
        CK(cudaStreamSynchronize(s2));
        // until the receiver saw round r (its word 0 of stamp), read through a copy on s2
        for (int i = 0;; ++i) {
          uint64_t seen = 0;
          CK(cudaMemcpyAsync(&seen, stamp, 8, cudaMemcpyDeviceToHost, s2));
          CK(cudaStreamSynchronize(s2));
          if (seen >= (uint64_t)r) break;
          if (i > 1000000) { std::fprintf(stderr, "fresh: round %d never seen\n", r); return 1; }
        }
      }
      CK(cudaStreamSynchronize(s1));
      const std::vector<uint64_t> all = sorted_rounds(out, 0, rounds);
      std::printf("%s{\"sender\": \"%s\", \"rep\": %d, \"min_ns\": %llu, \"median_ns\": %llu, "
                  "\"p90_ns\": %llu}", mode || rep ? ", " : "", names[mode], rep,
                  (unsigned long long)all[0], (unsigned long long)all[all.size() / 2],
                  (unsigned long long)all[all.size() * 9 / 10]);
    }
  }
  std::printf("]}\n");
  return 0;
}

// Where a token's units queue: G sender CTAs store an 8 KB row as 16 KB of flagged units
// (slots dealt out as in crossing_fmt) and CTA 0's warp 0 its 26 metadata units, after its own
// row slots (meta_last, as the T = 1 dispatch's claim ends after the other warps' row stores
// began) or before them. Rc receiver CTAs poll the row's slots (an equal range each);
// receiver CTA 0's warp 0 polls the metadata first. meta_alone: receiver CTA 0 polls only the
// metadata and CTAs 1 .. Rc the row (no row poller on the metadata's SM). out[r]: ns from
// the first store to the last receiver CTA's "all seen"; out[rounds + r]: to the metadata
// seen. Is it the sender's SM (one CTA's 16 KB in front of its metadata) or the receiver's
// (its warps polling the row beside the metadata's poll) that the metadata waits behind?
// H hammer CTAs (after the receivers) stand for the FFN's other receive CTAs, which spin on
// every region's count units until they see them: lane 0 of each polls the metadata's first
// unit (the line the token's count units share), lanes 1-23 as many other lines that nobody
// writes, until lane 0 sees the round. Does a line that many SMs poll take longer to show a
// store?
// base: the index of this grid's first CTA in that numbering (ipcq runs the senders and the
// receivers as two grids in two processes; queue one grid, base 0)
__global__ void crossing_queue(uint64_t* meta, uint64_t* row, uint64_t* sync, uint64_t* out,
                               const uint64_t* idle, int rounds, int G, int Rc, int meta_last,
                               int meta_alone, int base) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, slots = 1024;
  const int b = (int)blockIdx.x + base;
  const bool sender = b < G, hammer = b >= G + Rc;
  const uint64_t deadline = now_ns() + 5000000000ull;
  for (int r = 1; r <= rounds; ++r) {
    const uint64_t f = (uint64_t)r << 32;
    if (hammer) {
      if (warp != 0) continue;
      bool seen = false;
      while (!seen) {  // (>= r: a hammer that missed round r stops at r + 1's store)
        const uint64_t v = lane == 0 ? ld_sys(meta) : lane < 24 ? ld_sys(idle + 16 * lane) : 0;
        seen = __shfl_sync(0xffffffffu, (uint32_t)(v >> 32), 0) >= (uint32_t)r;
        if (now_ns() > deadline) return;
      }
      continue;
    }
    if (sender) {
      const int g = b;
      if (!sender_round_start(sync, r, g == 0 ? sync + 16 : nullptr, deadline)) return;
      const bool mw = g == 0 && warp == 0;
      if (mw && !meta_last && lane < kMetaUnits) st_sys(meta + lane, f | (uint32_t)lane);
      for (int s = 512 * g + tid; s < slots; s += 512 * G)
        st_sys2(row + 2 * s, f | (uint32_t)(2 * s), f | (uint32_t)(2 * s + 1));
      if (mw && meta_last && lane < kMetaUnits) st_sys(meta + lane, f | (uint32_t)lane);
      __syncthreads();
    } else {
      const int q = b - G;
      if (q == 0 && tid == 0) st_sys(sync, (uint64_t)r);
      bool ok = true;
      if (q == 0 && warp == 0) {
        if (lane < kMetaUnits)
          while ((ld_sys(meta + lane) >> 32) != (uint64_t)r)
            if (now_ns() > deadline) { ok = false; break; }
        __syncwarp();
        if (lane == 0) out[rounds + r - 1] = now_ns() - ld_sys(sync + 16);
      }
      const int rq = meta_alone ? q - 1 : q, nr = meta_alone ? Rc - 1 : Rc;
      const int per = (slots + nr - 1) / nr, s1 = min(slots, (rq + 1) * per);
      if (rq >= 0)
        for (int s = rq * per + tid; s < s1 && ok; s += 512) ok = wait_slot(row, s, r, deadline);
      if (!__syncthreads_and(ok)) return;
      if (tid == 0)
        atomicMax(reinterpret_cast<unsigned long long*>(out + r - 1),
                  (unsigned long long)(now_ns() - ld_sys(sync + 16)));
      __syncthreads();
    }
  }
}

static int queue_main() {
  const int rounds = 210;
  uint64_t *meta, *row, *sync, *out, *idle;
  CK(cudaMalloc(&meta, 64 * 8));
  CK(cudaMalloc(&idle, 24 * 16 * 8));
  CK(cudaMemset(idle, 0, 24 * 16 * 8));
  CK(cudaMalloc(&row, 2 * 1024 * 8));
  CK(cudaMalloc(&sync, 32 * 8));
  CK(cudaMalloc(&out, 2 * rounds * 8));
  struct Case { int G, Rc, meta_last, meta_alone, H; };
  const Case cases[] = {{1, 2, 1, 0, 0},  {1, 2, 0, 0, 0},  {4, 2, 1, 0, 0},  {24, 2, 1, 0, 0},
                        {1, 3, 1, 1, 0},  {24, 3, 1, 1, 0}, {1, 8, 1, 0, 0},  {24, 8, 1, 0, 0},
                        {1, 9, 1, 1, 0},  {24, 9, 1, 1, 0}, {1, 2, 1, 0, 23}, {1, 2, 0, 0, 23},
                        {1, 2, 1, 0, 48}, {1, 2, 0, 0, 48}};
  std::printf("{\"rounds\": %d, \"cases\": [", rounds - 10);
  bool first = true;
  for (const Case& k : cases) {
    for (int rep = 0; rep < 2; ++rep) {
      CK(cudaMemset(meta, 0, 64 * 8));
      CK(cudaMemset(row, 0, 2 * 1024 * 8));
      CK(cudaMemset(sync, 0, 32 * 8));
      CK(cudaMemset(out, 0, 2 * rounds * 8));
      crossing_queue<<<k.G + k.Rc + k.H, 512>>>(meta, row, sync, out, idle, rounds, k.G, k.Rc,
                                                k.meta_last, k.meta_alone, 0);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      const std::vector<uint64_t> all = sorted_rounds(out, 0, rounds);
      const std::vector<uint64_t> md = sorted_rounds(out, rounds, rounds);
      std::printf("%s{\"sender_ctas\": %d, \"receiver_ctas\": %d, \"meta_last\": %d, "
                  "\"meta_alone\": %d, \"hammer_ctas\": %d, \"rep\": %d, "
                  "\"all_median_ns\": %llu, \"meta_median_ns\": %llu, \"meta_p90_ns\": %llu}",
                  first ? "" : ", ", k.G, k.Rc, k.meta_last, k.meta_alone, k.H, rep,
                  (unsigned long long)all[all.size() / 2], (unsigned long long)md[md.size() / 2],
                  (unsigned long long)md[md.size() * 9 / 10]);
      first = false;
    }
  }
  std::printf("]}\n");
  return 0;
}

// ipcq mode: queue's crossing between two processes on one GPU (under a CUDA MPS daemon, as
// the benchmarks' ranks share it): rank 0 polls its own window, rank 1 stores into it through
// a CUDA IPC handle, as the library's Attention rank stores into the FFN's window. Does a row
// and its metadata cross slower through an IPC mapping than within one process (queue)?
// Cases in step: before case k rank 0 clears the window and posts k + 1 at word 24 of its
// sync block, rank 1 launches its senders once it reads that, and posts k + 1 at word 25 when
// they are done, which rank 0 waits for before the next case. Rank 0 prints the JSON.
static void ipcq_post(uint64_t* word, uint64_t v) {
  CK(cudaMemcpy(word, &v, 8, cudaMemcpyHostToDevice));
}
static bool ipcq_wait(const uint64_t* word, uint64_t v, int rank) {
  for (int i = 0;; ++i) {
    uint64_t got = 0;
    CK(cudaMemcpy(&got, word, 8, cudaMemcpyDeviceToHost));
    if (got == v) return true;
    if (i > 200000) {
      std::fprintf(stderr, "ipcq rank %d: word never became %llu\n", rank, (unsigned long long)v);
      return false;
    }
    struct timespec ts = {0, 50000};
    nanosleep(&ts, nullptr);
  }
}
static int ipcq_main(int rank, const char* dir) {
  const int rounds = 210, kMeta = 64, kRow = 2 * 1024, kSync = 32;
  uint64_t *win, *out = nullptr;
  CK(cudaMalloc(&win, (kMeta + kRow + kSync) * 8));
  CK(cudaMemset(win, 0, (kMeta + kRow + kSync) * 8));
  if (rank == 0) CK(cudaMalloc(&out, 2 * rounds * 8));
  CK(cudaDeviceSynchronize());
  // rank 0: its own window (it shares it); rank 1: rank 0's, opened through the handle
  uint64_t* w = static_cast<uint64_t*>(share_window(dir, "q", rank, rank == 1 ? 0 : -1, win));
  if (rank == 0) w = win;
  if (w == nullptr) return 1;
  uint64_t *meta = w, *row = w + kMeta, *sync = w + kMeta + kRow;
  struct Case { int G, Rc, meta_last; };
  const Case cases[] = {{1, 2, 1}, {1, 2, 0}, {4, 2, 1}, {24, 2, 1}};
  if (rank == 0) std::printf("{\"rounds\": %d, \"cases\": [", rounds - 10);
  int k = 0;
  for (const Case& c : cases) {
    for (int rep = 0; rep < 2; ++rep, ++k) {
      if (rank == 0) {
        CK(cudaMemset(meta, 0, (kMeta + kRow) * 8));
        CK(cudaMemset(sync, 0, 24 * 8));
        CK(cudaMemset(out, 0, 2 * rounds * 8));
        CK(cudaDeviceSynchronize());
        ipcq_post(sync + 24, (uint64_t)k + 1);
        crossing_queue<<<c.Rc, 512>>>(meta, row, sync, out, nullptr, rounds, c.G, c.Rc,
                                      c.meta_last, 0, c.G);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        if (!ipcq_wait(sync + 25, (uint64_t)k + 1, 0)) return 1;
        const std::vector<uint64_t> all = sorted_rounds(out, 0, rounds);
        const std::vector<uint64_t> md = sorted_rounds(out, rounds, rounds);
        std::printf("%s{\"sender_ctas\": %d, \"receiver_ctas\": %d, \"meta_last\": %d, "
                    "\"rep\": %d, \"all_median_ns\": %llu, \"meta_median_ns\": %llu, "
                    "\"meta_p90_ns\": %llu}", k ? ", " : "", c.G, c.Rc, c.meta_last, rep,
                    (unsigned long long)all[all.size() / 2],
                    (unsigned long long)md[md.size() / 2],
                    (unsigned long long)md[md.size() * 9 / 10]);
      } else {
        if (!ipcq_wait(sync + 24, (uint64_t)k + 1, 1)) return 1;
        crossing_queue<<<c.G, 512>>>(meta, row, sync, nullptr, nullptr, rounds, c.G, c.Rc,
                                     c.meta_last, 0, 0);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        ipcq_post(sync + 25, (uint64_t)k + 1);
      }
    }
  }
  if (rank == 0) std::printf("]}\n");
  if (rank == 1) CK(cudaIpcCloseMemHandle(w));
  return 0;
}

// launch mode: a kernel's first load as the library's kernels meet it. first_load (main mode)
// reads a line in L2 190-224 ns after its start stamp; in the T = 1 chain every kernel's first
// load returns 0.7-0.9 µs after its start stamp (the dispatch's token, the receive's first
// poll, the reply's first row). What the chain has that first_load has not, one at a time:
// a large parameter block whose load address needs four of its lines; 24 CTAs of 512 threads;
// a CUDA graph; a programmatic (PDL) launch that waits in griddepcontrol.wait; an idle host
// between replays; L2 emptied between replays (a 256 MB write), so that the parameter block
// and the code come from memory; straight-line code before the load (256 or 1,024
// multiply-adds, 4 or 16 KB), with the SMs' instruction caches filled by other code in front
// (icache_cold) or not: what fetching a kernel's code costs at its start; the SMs' constant
// caches filled by 64 other kernels' 4 KB parameter blocks in front (params_cold); the
// address from three dependent constant reads (indexed), as the library's window bases;
// code that branches forward over blocks it does not run (branchy), as the library's paths
// skip what a role or a size does not take, and every SM's instruction caches filled by
// 256 KB of other code from four warps first (icache_deep: icache_cold's 64 KB from one warp
// may leave a cache that holds 128 KB with the probe's own lines).
// Each case: rounds after 10 warm-up ones; ns from the start stamp (after the wait) to the
// load's return, thread 0 of CTA 0.
struct BigArgs {  // 824 B, as the library's Layout and arguments; four lines feed the load
  const uint64_t* base;
  uint64_t pad0[7];
  uint64_t off;
  uint64_t pad1[7];
  uint64_t stride;
  uint64_t pad2[31];
  uint64_t rank;
  uint64_t pad3[47];
  uint64_t* out;
  int* ctr;
  int pdl, pad4;
  int idx, tab[15];             // (indexed: a line of its own)
  const uint64_t* ptrs[8];      // (indexed: another)
  int never[8];                 // (branchy: 0, each skips a block)
};
// kCode = -1 (indexed): the address from three dependent constant reads, as the library's
// window bases (ptrs[tab[idx]] + off), instead of four independent ones
// kCode = -3 / -4 (branchy): 8 blocks of 16 multiply-adds that run, each followed by a block
// of 64 / 16 (1 KB / 256 B) that a parameter skips: 8 taken forward branches over code never
// run, as many as the library's dispatch passes between its start stamp and its first loads
template <int kCode>
__global__ void __launch_bounds__(512, 1) launch_load(BigArgs a) {
  if (a.pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const uint64_t t0 = now_ns();
  // kCode multiply-adds (16 B of code each) in four chains seeded by the clock, which the
  // load's address waits for: ptxas folds a chain of constant adds, not x * x + i
  uint32_t x[4] = {(uint32_t)t0, (uint32_t)t0 + 1, (uint32_t)t0 + 2, (uint32_t)t0 + 3};
#pragma unroll
  for (int i = 0; i < kCode; ++i)
    asm volatile("mad.lo.u32 %0, %0, %0, %1;" : "+r"(x[i & 3]) : "r"((uint32_t)i));
  if constexpr (kCode == -3 || kCode == -4) {
    constexpr int kSkip = kCode == -3 ? 64 : 16;
#pragma unroll
    for (int b = 0; b < 8; ++b) {
#pragma unroll
      for (int i = 0; i < 16; ++i)
        asm volatile("mad.lo.u32 %0, %0, %0, %1;" : "+r"(x[i & 3]) : "r"((uint32_t)(b * 16 + i)));
      if (a.never[b]) {
#pragma unroll
        for (int i = 0; i < kSkip; ++i)
          asm volatile("mad.lo.u32 %0, %0, %0, %1;"
                       : "+r"(x[i & 3])
                       : "r"((uint32_t)(1000 + b * kSkip + i)));
      }
    }
  }
  const uint32_t h = (kCode > 0 || kCode < -2) ? x[0] ^ x[1] ^ x[2] ^ x[3] : 0u;
  const uint64_t* p = kCode == -1 ? a.ptrs[a.tab[a.idx & 15] & 7] + a.off
                                : a.base + a.off + a.stride * a.rank + (h == 1u ? 1 : 0);
  const uint64_t v = ld_sys(p);
  if (v == 0x0123456789abcdefull) a.out[1023] = v;  // (the branch waits for the load)
  const uint64_t dt = now_ns() - t0;
  a.out[atomicAdd(a.ctr, 1) & 511] = dt;
}
// Other code through every SM's instruction caches (64 KB of straight-line multiply-adds, one
// warp a SM), so that launch_load's code comes from L2 (the chain's kernels run between
// other kernels); out[1022] keeps the result. kSeed: four distinct 64 KB bodies (icache_deep
// runs all four from four warps a SM, one a scheduler)
template <int kSeed = 0>
__global__ void icache_flush(uint64_t* out) {
  uint32_t x[4] = {threadIdx.x, threadIdx.x + 1, threadIdx.x + 2, blockIdx.x};
#pragma unroll
  for (int i = 0; i < 4096; ++i)
    asm volatile("mad.lo.u32 %0, %0, %0, %1;"
                 : "+r"(x[i & 3])
                 : "r"((uint32_t)(i * 7 + 3 + kSeed * 65537)));
  if ((x[0] ^ x[1] ^ x[2] ^ x[3]) == 12345u) out[1022] = x[0];
}
// Other parameter blocks through every SM's constant caches: each launch (64 of them, on
// every SM) reads the 64 lines of its own 4 KB block; out[1021] keeps the result
struct HugeArgs { uint32_t w[1024]; uint64_t* out; };
__global__ void param_flush(HugeArgs h) {
  const int l = threadIdx.x & 31;
  const uint32_t v = h.w[(2 * l) * 16] ^ h.w[(2 * l + 1) * 16];
  if (v == 0xdeadbeefu) h.out[1021] = v;
}
// L2 emptied between rounds: 256 MB written from every SM
__global__ void thrash(uint4* p, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = make_uint4((uint32_t)i, 1, 2, 3);
}

static int launch_main() {
  const int rounds = 110;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint64_t *line, *out;
  int* ctr;
  uint4* big;
  const size_t big_n = (256u << 20) / 16;
  CK(cudaMalloc(&line, 64 * 8));
  CK(cudaMemset(line, 0, 64 * 8));
  CK(cudaMalloc(&out, 1024 * 8));
  CK(cudaMalloc(&ctr, 4));
  CK(cudaMalloc(&big, big_n * 16));
  BigArgs a{};
  a.base = line;
  a.off = 8;
  a.stride = 16;
  a.rank = 1;  // line + 24: word 24, a line of its own
  a.idx = 5;   // indexed: ptrs[tab[5]] + 8 = line + 16 + 8, the same word
  a.tab[5] = 3;
  a.ptrs[3] = line + 16;
  a.out = out;
  a.ctr = ctr;
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // one round: (thrash), writer (the line just written, as a producer kernel leaves it), the
  // probe kernel (PDL-launched or not)
  auto round = [&](int grid, int threads, int code, bool pdl, bool cold, int flush) {
    if (cold) thrash<<<sms * 4, 512, 0, s>>>(big, big_n);
    if (flush & 1) icache_flush<<<sms, 32, 0, s>>>(out);
    if (flush & 4) {
      icache_flush<0><<<sms, 128, 0, s>>>(out);
      icache_flush<1><<<sms, 128, 0, s>>>(out);
      icache_flush<2><<<sms, 128, 0, s>>>(out);
      icache_flush<3><<<sms, 128, 0, s>>>(out);
    }
    for (int k = 0; (flush & 2) && k < 64; ++k) {
      HugeArgs hp;
      for (int i = 0; i < 1024; ++i) hp.w[i] = (uint32_t)(k * 1024 + i);
      hp.out = out;
      param_flush<<<sms, 32, 0, s>>>(hp);
    }
    writer<<<1, 1, 0, s>>>(const_cast<uint64_t*>(a.base) + 24, 1);
    BigArgs b = a;
    b.pdl = pdl;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(threads);
    cfg.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = pdl ? 1 : 0;
    if (code == 1024) CK(cudaLaunchKernelEx(&cfg, launch_load<1024>, b));
    else if (code == 256) CK(cudaLaunchKernelEx(&cfg, launch_load<256>, b));
    else if (code == -3) CK(cudaLaunchKernelEx(&cfg, launch_load<-3>, b));
    else if (code == -4) CK(cudaLaunchKernelEx(&cfg, launch_load<-4>, b));
    else if (code < 0) CK(cudaLaunchKernelEx(&cfg, launch_load<-1>, b));
    else CK(cudaLaunchKernelEx(&cfg, launch_load<0>, b));
  };
  // code: multiply-adds in front of the load (> 0), indexed (-1), branchy 1 KB / 256 B (-3 / -4);
  // cold: L2 emptied; flush bits: 1 instruction caches (64 KB), 2 parameter blocks, 4 instruction
  // caches deep (256 KB; the JSON's icache_cold is then 2)
  struct Case { const char* name; int grid, threads, code, graph, pdl, idle_us, cold, flush; };
  const Case cases[] = {
      {"plain_1x32", 1, 32, 0, 0, 0, 0, 0, 0},
      {"plain_24x512", 24, 512, 0, 0, 0, 0, 0, 0},
      {"graph_24x512", 24, 512, 0, 1, 0, 0, 0, 0},
      {"graph_pdl_24x512", 24, 512, 0, 1, 1, 0, 0, 0},
      {"graph_pdl_idle500us", 24, 512, 0, 1, 1, 500, 0, 0},
      {"graph_pdl_l2_cold", 24, 512, 0, 1, 1, 0, 1, 0},
      {"graph_pdl_icache_cold", 24, 512, 0, 1, 1, 0, 0, 1},
      {"graph_pdl_code256", 24, 512, 256, 1, 1, 0, 0, 0},
      {"graph_pdl_code256_icache_cold", 24, 512, 256, 1, 1, 0, 0, 1},
      {"graph_pdl_code1024", 24, 512, 1024, 1, 1, 0, 0, 0},
      {"graph_pdl_code1024_icache_cold", 24, 512, 1024, 1, 1, 0, 0, 1},
      {"graph_pdl_code1024_l2_cold", 24, 512, 1024, 1, 1, 0, 1, 1},
      {"graph_pdl_params_cold", 24, 512, 0, 1, 1, 0, 0, 2},
      {"graph_pdl_indexed", 24, 512, -1, 1, 1, 0, 0, 0},
      {"graph_pdl_indexed_params_cold", 24, 512, -1, 1, 1, 0, 0, 2},
      {"graph_pdl_indexed_all_cold", 24, 512, -1, 1, 1, 0, 1, 3},
      {"graph_pdl_icache_deep", 24, 512, 0, 1, 1, 0, 0, 4},
      {"graph_pdl_code256_icache_deep", 24, 512, 256, 1, 1, 0, 0, 4},
      {"graph_pdl_code1024_icache_deep", 24, 512, 1024, 1, 1, 0, 0, 4},
      {"graph_pdl_branchy1k", 24, 512, -3, 1, 1, 0, 0, 0},
      {"graph_pdl_branchy1k_icache_cold", 24, 512, -3, 1, 1, 0, 0, 1},
      {"graph_pdl_branchy1k_icache_deep", 24, 512, -3, 1, 1, 0, 0, 4},
      {"graph_pdl_branchy256", 24, 512, -4, 1, 1, 0, 0, 0},
      {"graph_pdl_branchy256_icache_deep", 24, 512, -4, 1, 1, 0, 0, 4},
      {"graph_pdl_branchy1k_all_cold", 24, 512, -3, 1, 1, 0, 1, 6},
  };
  std::printf("{\"rounds\": %d, \"sms\": %d, \"cases\": [", rounds - 10, sms);
  bool first = true;
  for (const Case& k : cases) {
    for (int rep = 0; rep < 2; ++rep) {
      CK(cudaMemset(ctr, 0, 4));
      CK(cudaMemset(out, 0, 1024 * 8));
      CK(cudaDeviceSynchronize());
      cudaGraphExec_t ge = nullptr;
      if (k.graph) {
        cudaGraph_t g;
        CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        round(k.grid, k.threads, k.code, k.pdl, k.cold, k.flush);
        CK(cudaStreamEndCapture(s, &g));
        CK(cudaGraphInstantiate(&ge, g, 0));
        CK(cudaGraphDestroy(g));
      }
      for (int r = 0; r < rounds; ++r) {
        if (ge) CK(cudaGraphLaunch(ge, s));
        else round(k.grid, k.threads, k.code, k.pdl, k.cold, k.flush);
        // every round alone on the GPU (as a replay of the chain), the host idle in between
        CK(cudaStreamSynchronize(s));
        if (k.idle_us) {
          struct timespec ts = {0, 1000L * k.idle_us};
          nanosleep(&ts, nullptr);
        }
      }
      CK(cudaGetLastError());
      if (ge) CK(cudaGraphExecDestroy(ge));
      const std::vector<uint64_t> v = sorted_rounds(out, 0, rounds);
      std::printf("%s{\"case\": \"%s\", \"grid\": %d, \"threads\": %d, \"code_mads\": %d, "
                  "\"graph\": %d, \"pdl\": %d, \"idle_us\": %d, \"l2_cold\": %d, "
                  "\"icache_cold\": %d, \"params_cold\": %d, \"rep\": %d, "
                  "\"min_ns\": %llu, \"median_ns\": %llu, \"p90_ns\": %llu}",
                  first ? "" : ", ", k.name, k.grid, k.threads, k.code, k.graph, k.pdl,
                  k.idle_us, k.cold, (k.flush & 4) ? 2 : (k.flush & 1), (k.flush >> 1) & 1, rep,
                  (unsigned long long)v[0],
                  (unsigned long long)v[v.size() / 2], (unsigned long long)v[v.size() * 9 / 10]);
      first = false;
    }
  }
  std::printf("]}\n");
  return 0;
}

// rows mode: crossing_fmt's cases, one JSON object
static int rows_main() {
  const int rounds = 210, max_slots = 4096;
  uint64_t *row, *sync, *out, *tears;
  CK(cudaMalloc(&row, 2 * max_slots * 8));
  CK(cudaMalloc(&sync, 32 * 8));
  CK(cudaMalloc(&out, rounds * 8));
  CK(cudaMalloc(&tears, 8));
  struct Case { int fmt, data, G; };
  // 8 KB (a 4,096-wide BF16 row) as units and as lines, from 1, 2, 4 CTAs; smaller rows as
  // units (does the time follow the bytes?); 16 KB as lines (the same bytes as 8 KB as units)
  const Case cases[] = {{0, 8192, 1}, {1, 8192, 1}, {0, 8192, 2}, {1, 8192, 2},
                        {0, 8192, 4}, {1, 8192, 4}, {0, 4096, 1}, {0, 2048, 1},
                        {0, 512, 1},  {1, 4096, 1}, {1, 16384, 1}, {0, 16384, 1}};
  std::printf("{\"rounds\": %d, \"cases\": [", rounds - 10);
  bool first = true;
  for (const Case& k : cases) {
    const int slots = k.fmt == 0 ? k.data / 8 : 8 * ((k.data + 119) / 120);
    for (int rep = 0; rep < 2; ++rep) {
      CK(cudaMemset(row, 0, 2 * max_slots * 8));
      CK(cudaMemset(sync, 0, 32 * 8));
      CK(cudaMemset(out, 0, rounds * 8));
      CK(cudaMemset(tears, 0, 8));
      crossing_fmt<<<k.G + 1, 512>>>(row, sync, out, tears, rounds, k.fmt, slots, k.G);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      uint64_t torn = 0;
      CK(cudaMemcpy(&torn, tears, 8, cudaMemcpyDeviceToHost));
      const std::vector<uint64_t> all = sorted_rounds(out, 0, rounds);
      std::printf("%s{\"format\": \"%s\", \"data_bytes\": %d, \"stored_bytes\": %d, "
                  "\"sender_ctas\": %d, \"rep\": %d, \"min_ns\": %llu, \"median_ns\": %llu, "
                  "\"p90_ns\": %llu, \"torn_polls\": %llu}",
                  first ? "" : ", ", k.fmt ? "lines128" : "units8", k.data, 16 * slots, k.G,
                  rep, (unsigned long long)all[0], (unsigned long long)all[all.size() / 2],
                  (unsigned long long)all[all.size() * 9 / 10], (unsigned long long)torn);
      first = false;
    }
  }
  std::printf("]}\n");
  return 0;
}

int main(int argc, char** argv) {
  // every kernel loaded at start: fresh mode launches its sender beside a running receiver,
  // and under lazy loading (CUDA's default) that launch waited for the receiver to end
  setenv("CUDA_MODULE_LOADING", "EAGER", 1);
  if (argc == 4 && std::string(argv[1]) == "ipc") return ipc_main(std::atoi(argv[2]), argv[3]);
  if (argc == 4 && std::string(argv[1]) == "ipcq") return ipcq_main(std::atoi(argv[2]), argv[3]);
  if (argc == 2 && std::string(argv[1]) == "rows") return rows_main();
  if (argc == 2 && std::string(argv[1]) == "fresh") return fresh_main();
  if (argc == 2 && std::string(argv[1]) == "queue") return queue_main();
  if (argc == 2 && std::string(argv[1]) == "launch") return launch_main();
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
  // one token's crossing, both store patterns (medians over rounds; the first 10 dropped)
  {
    const int rounds = 210;
    uint64_t *meta, *row, *sync, *cout;
    CK(cudaMalloc(&meta, 64 * 8));
    CK(cudaMalloc(&row, 4 * kRowVecs * 8));
    CK(cudaMalloc(&sync, 32 * 8));
    CK(cudaMalloc(&cout, 2 * rounds * 8));
    std::printf("}, \"crossing_ns\": {");
    const char* names[] = {"per_lane", "contiguous", "gpu_scope", "sleepy_receiver"};
    const int modes[4][3] = {{0, 0, 0}, {1, 0, 0}, {0, 1, 0}, {0, 0, 1}};
    for (int m = 0; m < 4; ++m) {
      CK(cudaMemset(meta, 0, 64 * 8));
      CK(cudaMemset(row, 0, 4 * kRowVecs * 8));
      CK(cudaMemset(sync, 0, 32 * 8));
      crossing<<<2, 512>>>(meta, row, sync, cout, rounds, modes[m][0], modes[m][1], modes[m][2]);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      const std::vector<uint64_t> all = sorted_rounds(cout, 0, rounds);
      const std::vector<uint64_t> md = sorted_rounds(cout, rounds, rounds);
      std::printf("%s\"%s\": {\"all_units_median\": %llu, \"metadata_median\": %llu}",
                  m ? ", " : "", names[m],
                  (unsigned long long)all[all.size() / 2], (unsigned long long)md[md.size() / 2]);
    }
  }
  // the row spread over G sender CTAs and G receiver CTAs
  {
    const int rounds = 210;
    uint64_t *meta, *row, *sync, *cout;
    CK(cudaMalloc(&meta, 64 * 8));
    CK(cudaMalloc(&row, 4 * kRowVecs * 8));
    CK(cudaMalloc(&sync, 32 * 16 * 8));
    CK(cudaMalloc(&cout, rounds * 8));
    std::printf("}, \"spread_crossing_ns\": {");
    const int gs[] = {1, 2, 4, 8};
    for (int i = 0; i < 4; ++i) {
      CK(cudaMemset(meta, 0, 64 * 8));
      CK(cudaMemset(row, 0, 4 * kRowVecs * 8));
      CK(cudaMemset(sync, 0, 32 * 16 * 8));
      CK(cudaMemset(cout, 0, rounds * 8));
      crossing_spread<<<2 * gs[i], 512>>>(meta, row, sync, cout, rounds, gs[i]);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      const std::vector<uint64_t> all = sorted_rounds(cout, 0, rounds);
      std::printf("%s\"%d\": %llu", i ? ", " : "", gs[i], (unsigned long long)all[all.size() / 2]);
    }
  }
  std::printf("}, \"cases\": [");
  // pollers: CTAs x threads, lines they spread over, sleep between polls
  struct Case { int ctas, threads, lines, sleep, release = 0; };
  const Case cases[] = {{0, 32, 1, 0},     {12, 32, 24, 0},   {12, 512, 24, 0},
                        {12, 32, 24, 100}, {12, 512, 24, 100}, {12, 512, 24, 500},
                        {22, 512, 512, 0}, {22, 512, 512, 100}, {12, 32, -1, 0},
                        {12, 512, -1, 0},  {12, 512, -1, 100}, {12, 512, -1, 500},
                        {0, 32, 1, 0, 1}};
  bool first = true;
  for (const Case& k : cases) {
    for (int rep = 0; rep < 3; ++rep) {
      CK(cudaMemset(ping, 0, 32 * 8));
      CK(cudaMemset(stop, 0, 8));
      CK(cudaMemset(out, 0, 4 * 8));
      Args a{chain, ping, polled, stop, out, 2000, 2000, k.sleep, k.lines, k.release};
      const int grid = 2 + std::min(k.ctas, sms - 2);
      probe<<<grid, k.ctas ? k.threads : 32>>>(a);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      uint64_t o[4];
      CK(cudaMemcpy(o, out, sizeof o, cudaMemcpyDeviceToHost));
      std::printf("%s{\"poll_ctas\": %d, \"poll_threads\": %d, \"poll_lines\": %d, "
                  "\"poll_sleep_ns\": %d, \"release\": %d, \"rep\": %d, \"load_ns\": %llu, "
                  "\"round_trip_ns\": %llu, \"poll_spins\": %llu}",
                  first ? "" : ", ", k.ctas, k.ctas ? k.threads : 0, k.lines, k.sleep,
                  k.release, rep,
                  (unsigned long long)o[0], (unsigned long long)o[1],
                  (unsigned long long)o[2]);
      first = false;
    }
  }
  std::printf("]}\n");
  return 0;
}
