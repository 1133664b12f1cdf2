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
// F_EARLY_COLLECT: its code kept out of kSmallRecv); kUnitExpRecv issuing its first unit's
// loads before the table's pass (kUnitExpEarly, F_EARLY_EXPAND: its code kept out of
// kUnitExpRecv); kUnitReply with few rows in all, each warp loading its chunk of every row
// with its slot's receipt instead of after it (kSpecReply, F_SPEC_REPLY: spec_reply_fits);
// kSmallSend whose lone token's row sits on the warps past the claiming warp 0
// (kLoneSplitSend, F_LONE_SPLIT: its code kept out of kSmallSend); the token layout's
// kSmallSend and kSmallRecv with a lone token's raw ids and weights as its metadata units
// (kRawSend, kRawRecv, F_RAW_META: raw_meta in dispatch.cu).
// All small forms assume the four directional controls. A launch takes a small form only
// where the generic kernel would take that path too (the host's dispatch_form /
// combine_form), except kUnitExpRecv, kUnitExpEarly and the expert layout's kSmallSend and
// kLoneSplitSend (the generic kernel has no expert-layout units, so F_LL_EXPERTS needs
// F_SMALL_KERNELS), and kRawSend and kRawRecv (the generic kernel has no raw metadata): these
// run with debug output on too.
// (name, value): one list for the enum and the names the Python module exports
#define AFDEP_KERNEL_FORMS(X)                                                             \
  X(kGeneric, 0) X(kSmallSend, 1) X(kSmallRecv, 2) X(kCountSend, 3) X(kCountRecv, 4)      \
  X(kUnitReply, 5) X(kUnitExpRecv, 6) X(kCountRecvLL, 7) X(kEarlyCollect, 8)               \
  X(kUnitExpEarly, 9) X(kSpecReply, 10) X(kLoneSplitSend, 11) X(kRawSend, 12) X(kRawRecv, 13)

enum KernelForm : int {
#define AFDEP_FORM_ENUM(name, value) name = value,
  AFDEP_KERNEL_FORMS(AFDEP_FORM_ENUM)
#undef AFDEP_FORM_ENUM
};
__host__ __device__ constexpr bool form_units(int f) {
  return f == kSmallSend || f == kSmallRecv || f == kUnitExpRecv || f == kUnitExpEarly ||
         f == kLoneSplitSend || f == kRawSend || f == kRawRecv;
}
__host__ __device__ constexpr bool form_send_only(int f) {
  return f == kSmallSend || f == kCountSend || f == kUnitReply || f == kSpecReply ||
         f == kLoneSplitSend || f == kRawSend;
}
__host__ __device__ constexpr bool form_recv_only(int f) {
  return f == kSmallRecv || f == kCountRecv || f == kUnitExpRecv || f == kCountRecvLL ||
         f == kEarlyCollect || f == kUnitExpEarly || f == kRawRecv;
}

// kSpecReply (F_SPEC_REPLY): a warp stages its chunk of every row, at most kSpecVecs 16-byte
// vectors a lane (8 KB a warp; no more than kSpecWarps warps of a CTA hold a chunk)
constexpr int kSpecVecs = 16;
constexpr int kSpecWarps = 2;

// kSpecReply's chunks per receipt slot, log2: the largest power of two at or below the row's
// vectors / 32 whose chunks of every slot fit kSpecWarps warps a CTA of `grid` CTAs, at least
// 1 (fewer chunks than the grid's warps allow: each a longer chunk, rather than no kSpecReply
// at all). Integer arithmetic without a division, so that the host's spec_reply_fits and the
// kernel agree exactly.
__host__ __device__ inline int spec_chunk_log2(int units, int grid, int nv) {
  int lg = 0;
  while ((64 << lg) <= nv && (2 << lg) * units <= kSpecWarps * grid) ++lg;
  return lg;
}

// Whether the expert layout's one-pass reply of `units` receipt slots (A * bucket) on `grid`
// CTAs can take kSpecReply: every row a slot's entries may name, rows [0, units * R), staged
// by each chunk's warp (units * R rows x its vectors a lane at most kSpecVecs, two vectors a
// lane at most), and at most kSpecWarps chunks a CTA (unit u on warp u / grid of CTA
// u % grid).
__host__ __device__ inline bool spec_reply_fits(int units, int R, int H, int grid) {
  const int nv = H / 8, lg = spec_chunk_log2(units, grid, nv);
  const int cv = (nv + (1 << lg) - 1) >> lg, per_lane = (cv + 31) / 32;
  return units >= 1 && per_lane <= 2 && units * R * per_lane <= kSpecVecs &&
         (units << lg) <= kSpecWarps * grid;
}

}  // namespace afdep
