// Launch arguments of the two phase kernels (plain C++: shared by host code and kernels).
#pragma once

#include <cstdint>

#include "afdep/layout.h"  // FastDiv

namespace afdep {

// ---- what a launch needs besides the static layout ----------------------------------------
struct DispatchArgs {
  // Attention side (sender); T may be 0.
  const void* x;          // [T, H] payload (bf16 or fp8 bytes)
  const float* x_scales;  // [T, scale_cols] or null
  const void* expert_ids; // [T, k] int32 or int64
  int ids_64;             // 1: int64 ids
  const float* weights;   // [T, k]
  int64_t* route;         // [T] out
  int T;
  int do_send;            // this rank runs the send stage (real or dummy sender)
  int real_send;          // this rank has tokens (Attention)
  int stride;             // inbox slots per (source, channel) of this exchange: L.slots, or
                          // ceil(bucket / S) with the token layout (L.tokens) and the expert
                          // layout's units (L.llx); dispatch_stride
  // FFN side (receiver)
  int do_recv;
  int real_recv;          // FFN: expand into the outputs below
  int bucket;
  void* out_x;            // [A*bucket*R, H]
  float* out_scales;      // [A*bucket*R, scale_cols]
  float* out_weights;     // [A*bucket*R]
  int* out_offsets;       // [E_local + 1]
  int* out_src_rank;      // [rows]
  int* out_src_token;     // [rows]
  int* out_token_rows;    // [A, bucket, R]
  int* out_token_index;   // [A, bucket]
  int* out_num_tokens;    // [A]
  int* out_expert_ids;    // token layout: [A*S*stride, k] local ids in the source's columns
};

struct CombineArgs {
  // FFN side (reply sender)
  int do_send;
  int real_send;
  const void* rows;           // bf16  // [A*bucket*R, H]
  const int* token_rows;      // [A, bucket, R]
  const int* token_index;     // [A, bucket]
  const int* num_tokens;      // [A]
  int bucket;
  FastDiv div_bucket;         // expert layout: by bucket (a receipt slot's Attention index)
  int tokens;                 // token layout: row i of rows [A*rps, H] is the reply of the
                              // token src_token[i] of Attention index i / rps (-1: no token)
  int rps;                    // token layout: rows per source, S * ceil(bucket / S)
  const int* src_token;       // token layout: [A*rps]
  FastDiv div_rps;            // token layout: by rps (a row's Attention index)
  // Attention side (receiver)
  int do_recv;
  int real_recv;
  const int64_t* route;       // [T]
  void* out;                  // bf16 [T, H]; null with in_place
  int T;
  int in_place;               // F == 1: no copy; the caller reads the inbox rows [0, T) of the
                              // one FFN source, and rows of unrouted tokens are zeroed there
};

}  // namespace afdep
