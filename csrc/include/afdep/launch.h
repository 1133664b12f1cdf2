// Host-side entry points of the kernels (compiled by nvcc, called from csrc/host/comm.cpp).
#pragma once

#include <cstddef>
#include <cuda_runtime.h>

#include "afdep/args.h"
#include "afdep/layout.h"

namespace afdep {

size_t dispatch_smem_bytes(const Layout& L);
cudaError_t dispatch_prepare(const Layout& L);
// The dispatch inbox's slots per (source, channel) of an exchange with this bucket (sender and
// receiver agree): ceil(bucket / S) in the token layout, and in the expert layout when the
// exchange goes as flagged units (F_LL_EXPERTS); else L.slots.
int dispatch_stride(const Layout& L, int bucket);
// grid: S for senders (and every rank of the reverted protocol), L.G for the FFN's kernels.
// form (optional): the KernelForm (afdep/forms.h) the launch ran.
cudaError_t launch_dispatch(const Layout& L, const DispatchArgs& a, int grid, cudaStream_t stream,
                            int* form = nullptr);
cudaError_t launch_combine(const Layout& L, const CombineArgs& a, int grid, cudaStream_t stream,
                           int* form = nullptr);
// Flag ping-pong with group rank `peer` (both sides call it with the same iters and base).
cudaError_t launch_ping(const Layout& L, int peer, int iters, uint64_t base, int initiator,
                        cudaStream_t stream);
// One thread writes %globaltimer (ns, the clock of the kernels' trace stamps) to *out.
cudaError_t launch_stamp(uint64_t* out, cudaStream_t stream);
// One thread reads %globaltimer `reads` times: out[0..2] = smallest step (ns), steps, span (ns).
cudaError_t launch_timer_step(uint64_t* out, int reads, cudaStream_t stream);

}  // namespace afdep
