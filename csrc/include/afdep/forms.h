// The kernel forms, shared by host and device code: the kernels take one as their template
// argument, the host's dispatch_form / combine_form pick it per launch, and Comm records the
// last one of each phase (Comm::last_forms, for tests and diagnostics).
#pragma once

#include <cuda_runtime.h>

namespace afdep {

// Which code a transport kernel is compiled for (its template argument, F_SMALL_KERNELS): every
// path (kGeneric); the token layout's flagged-unit path (F_LL_SMALL) of a sender or a receiver
// (kSmallSend, kSmallRecv); or the expert layout's count-block path of one role with few
// tokens per channel: no fused, streamed or early-count copy (kCountSend, kCountRecv); or the
// expert layout's one-pass reply with its rows as flagged units (kUnitReply; the collect of
// either layout takes them in kSmallRecv); the expert layout's receive of flagged units
// (kUnitExpRecv, F_LL_EXPERTS; its sender is kSmallSend), and with that control its
// count-block receive (kCountRecvLL: kCountRecv, each wait also
// watching for the units of a sender whose bucket differs); the flagged-unit collect whose
// row warps poll their units without a barrier behind the start units (kEarlyCollect,
// F_EARLY_COLLECT: its code kept out of kSmallRecv); the token layout's kSmallSend and
// kSmallRecv with a lone token's raw ids and weights as its metadata units (kRawSend,
// kRawRecv, F_RAW_META: raw_meta in dispatch.cu); kUnitExpRecv whose units are (token, chunk
// of its row), each chunk stored into every row of the token's entries (kUnitExpFan,
// F_FANOUT_EXPAND: expand_units in dispatch.cu).
// All small forms assume the four directional controls. A launch takes a small form only
// where the generic kernel would take that path too (the host's dispatch_form /
// combine_form), except kUnitExpRecv and the expert layout's kSmallSend (the generic kernel
// has no expert-layout units, so F_LL_EXPERTS needs F_SMALL_KERNELS), and kRawSend and
// kRawRecv (the generic kernel has no raw metadata), and kUnitExpFan as kUnitExpRecv: these run
// with debug output on too.
// (name, value): one list for the enum and the names the Python module exports
#define AFDEP_KERNEL_FORMS(X)                                                             \
  X(kGeneric, 0) X(kSmallSend, 1) X(kSmallRecv, 2) X(kCountSend, 3) X(kCountRecv, 4)      \
  X(kUnitReply, 5) X(kUnitExpRecv, 6) X(kCountRecvLL, 7) X(kEarlyCollect, 8)               \
  X(kRawSend, 9) X(kRawRecv, 10) X(kUnitExpFan, 11)

enum KernelForm : int {
#define AFDEP_FORM_ENUM(name, value) name = value,
  AFDEP_KERNEL_FORMS(AFDEP_FORM_ENUM)
#undef AFDEP_FORM_ENUM
};
__host__ __device__ constexpr bool form_units(int f) {
  return f == kSmallSend || f == kSmallRecv || f == kUnitExpRecv || f == kRawSend ||
         f == kRawRecv || f == kUnitExpFan;
}
__host__ __device__ constexpr bool form_send_only(int f) {
  return f == kSmallSend || f == kCountSend || f == kUnitReply || f == kRawSend;
}
__host__ __device__ constexpr bool form_recv_only(int f) {
  return f == kSmallRecv || f == kCountRecv || f == kUnitExpRecv || f == kCountRecvLL ||
         f == kEarlyCollect || f == kRawRecv || f == kUnitExpFan;
}
// the expert layout's receive of flagged units (expand_units), either instantiation
__host__ __device__ constexpr bool form_unit_exp(int f) {
  return f == kUnitExpRecv || f == kUnitExpFan;
}

}  // namespace afdep
