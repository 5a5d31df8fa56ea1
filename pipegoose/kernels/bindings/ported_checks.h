// Argument checks shared by the bindings of the ported (upstream) kernels. Every failed check raises a
// c10::Error (RuntimeError in Python) whose message names the op and the argument and says what was expected.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <climits>
#include <cstdint>
#include <string>
#include "../csrc/pipegoose_check.h"

namespace pipegoose_ported {

inline const char* dtype_name(at::ScalarType t) { return c10::toString(t); }

inline void check_cuda(const char* op, const char* arg, const at::Tensor& t) {
  PG_CHECK(t.defined(), op, ": ", arg, " must be a tensor, got None/undefined");
  PG_CHECK(t.is_cuda(), op, ": ", arg, " must be a CUDA tensor, got device ", t.device());
}

inline void check_same_device(const char* op, const char* arg, const at::Tensor& t, const at::Tensor& ref,
                              const char* ref_arg) {
  PG_CHECK(t.device() == ref.device(), op, ": ", arg, " is on ", t.device(), " but ", ref_arg, " is on ",
              ref.device(), "; expected one device");
}

inline void check_contiguous(const char* op, const char* arg, const at::Tensor& t) {
  PG_CHECK(t.is_contiguous(), op, ": ", arg, " must be contiguous (row-major), got strides ", t.strides(),
              " for sizes ", t.sizes(), "; call .contiguous() first");
}

inline void check_dim(const char* op, const char* arg, const at::Tensor& t, int64_t dim, const char* layout) {
  PG_CHECK(t.dim() == dim, op, ": ", arg, " must be ", dim, "-D ", layout, ", got shape ", t.sizes());
}

inline void check_half_or_bf16(const char* op, const char* arg, const at::Tensor& t) {
  PG_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16, op, ": ", arg,
              " must be float16 or bfloat16 (the kernel has no other instantiation), got ",
              dtype_name(t.scalar_type()));
}

inline void check_int32_index(const char* op, const char* arg, int64_t n) {
  PG_CHECK(n <= INT_MAX, op, ": ", arg, " has ", n, " elements; the kernel indexes with 32-bit ints (at most ",
              INT_MAX, ")");
}

// The pointer alignment a vectorised load/store of `elems` elements needs.
inline void check_aligned(const char* op, const char* arg, const at::Tensor& t, int64_t elems) {
  const int64_t bytes = elems * static_cast<int64_t>(t.element_size());
  PG_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % bytes == 0, op, ": ", arg, " data pointer must be ",
              bytes, "-byte aligned for the kernel's vector loads (a view with a storage offset is not); "
              "pass a fresh tensor or .clone() it");
}

inline int64_t next_pow2_log2(int64_t n) {
  int64_t l = 0;
  while ((int64_t(1) << l) < n) ++l;
  return l;
}

// Megatron's warp-softmax launch geometry (all copies): rows per 128-thread block for a key length sk.
inline int64_t softmax_batches_per_block(int64_t sk) {
  const int64_t next_pow2 = int64_t(1) << next_pow2_log2(sk);
  const int64_t warp = next_pow2 < 32 ? next_pow2 : 32;
  const int64_t batches_per_warp = next_pow2 <= 128 ? 2 : 1;
  return (128 / warp) * batches_per_warp;
}

// Elements per vectorised load/store of Megatron's warp softmax for a key length sk (1 or 4).
inline int64_t softmax_vector_width(int64_t sk) {
  const int64_t next_pow2 = int64_t(1) << next_pow2_log2(sk);
  const int64_t warp = next_pow2 < 32 ? next_pow2 : 32;
  return (next_pow2 / warp) < 4 ? 1 : 4;
}

// Key length checks of Megatron's warp softmax: 1 <= sk <= 2048 (template instantiations up to 2^11), and a
// multiple of 4 once loads are 4 wide (sk > 64), else a vector load crosses into the next row.
inline void check_softmax_key_len(const char* op, const char* arg, int64_t sk) {
  PG_CHECK(sk >= 1 && sk <= 2048, op, ": ", arg, " key length (last dim) must be in [1, 2048], got ", sk);
  PG_CHECK(softmax_vector_width(sk) == 1 || sk % 4 == 0, op, ": ", arg,
              " key length (last dim) must be a multiple of 4 when it exceeds 64 (4-wide vector loads), got ", sk);
}

}  // namespace pipegoose_ported
