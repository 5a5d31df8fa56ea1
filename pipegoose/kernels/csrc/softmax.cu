// Fused scaled softmax over the last dimension (plain, boolean padding mask, causal), forward and out-of-place
// backward, for fp32 / fp16 / bf16 with fp32 math. Written for pipegoose; ops: pipegoose::softmax_forward,
// pipegoose::softmax_backward (binding: pipegoose/kernels/bindings/softmax.cpp, semantics: docs/architecture.md).
//
// Layout of the work
//   A row is the last dimension of a 4-D view [d0, d1, d2 (= sq), sk]; rows are numbered in row-major order of
//   (d0, d1, d2) and located through the tensor's strides, so strided rows need no copy. The output is contiguous.
//   Each thread owns whole 16-byte vectors (4 fp32 or 8 fp16/bf16 values) at vector index lane + i * TPR,
//   i < NV, where TPR threads share one row:
//     * TPR <= 32: several rows per warp / block, reductions with warp shuffles; the forward's one-vector plans
//       also give each thread several rows (fwd_rows in softmax.cuh), all loaded before the first is reduced;
//     * TPR  > 32: one row per TPR threads, reductions through shared memory;
//   the row stays in registers between the reductions (NV and the vector width are compile-time constants, so
//   the register arrays never go to local memory). Rows too long for the register budget take a two-pass path
//   (online max/sum, then a second read) that works for any length. The 16-bit causal forward of rows of 16384 to
//   32768 keys stages each row in shared memory instead, one row per block (softmax.cuh, kCausalSmemMin), so that
//   an SM holds more rows than their registers would allow. On square causal matrices one row group may take a
//   short row and a long one, whose visible vectors add up to one row: the 16-bit forward from 1025 keys
//   (softmax_fwd_causal_pair_kernel, kCausalPair) and the backward at the key lengths where that measured faster
//   (softmax_bwd_causal_pair_kernel, kCausalPairBwd).
//   Vector loads/stores are used when the row start and strides allow it (checked at run time); otherwise the
//   same layout is walked with scalar accesses.
//   Causal rows are read only up to their last visible key; the masked tail is written as zeros without being
//   read (forward), and in the backward (causal flag) neither dy nor y is read there.
//   All row and element offsets are 64-bit.
//   Benchmark experiment (issue #6): -DPIPEGOOSE_SOFTMAX_KEYS=K0 builds in one key length as a compile-time constant
//   (softmax.cuh says what changes); the generic build, without it, is what ships.

#include "softmax.cuh"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>
#include <optional>
#include "pipegoose_check.h"

namespace pipegoose {
namespace {

using namespace softmax_detail;

// Evenly spaced rows: the element stride between consecutive rows, or -1.
int64_t flat_row_stride(const at::Tensor& t) {
  int64_t rs = -1, expect = 0;
  for (int d = 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (rs < 0) {
      rs = t.stride(d);
      expect = t.stride(d) * t.size(d);
    } else {
      if (t.stride(d) != expect) return -1;
      expect *= t.size(d);
    }
  }
  return rs < 0 ? 0 : rs;
}

RowStrides row_strides(const at::Tensor& t) {
  return RowStrides{t.stride(0), t.stride(1), t.stride(2), flat_row_stride(t)};
}

// 16-byte vectors (V elements of `elem_size` bytes, or V mask bytes) are usable when the base pointer and every
// row start are aligned to the vector.
bool vector_ok(const at::Tensor& t, int64_t vec_elems) {
  const int64_t vec_bytes = vec_elems * static_cast<int64_t>(t.element_size());
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % vec_bytes != 0) return false;
  for (int d = 0; d < 3; ++d)
    if (t.size(d) > 1 && t.stride(d) % vec_elems != 0) return false;
  return true;
}

bool scalar_type_ok(at::ScalarType s) {
  return s == at::kFloat || s == at::kHalf || s == at::kBFloat16;
}


template <typename T>
void forward_impl(const at::Tensor& input, const at::Tensor* mask, float scale, bool causal, at::Tensor& out,
                  cudaStream_t st) {
  constexpr int V = Elem<T>::kVec;
  FwdArgs<T> a{};
  a.x = reinterpret_cast<const T*>(input.data_ptr());
  a.mask = mask != nullptr ? reinterpret_cast<const uint8_t*>(mask->data_ptr()) : nullptr;
  a.y = reinterpret_cast<T*>(out.data_ptr());
  a.sk = input.size(3);
  a.rows = input.numel() / a.sk;
  a.d1 = input.size(1);
  a.d2 = input.size(2);
  a.xs = row_strides(input);
  a.ms = mask != nullptr ? row_strides(*mask) : RowStrides{0, 0, 0, 0};
  a.causal_shift = input.size(3) - input.size(2);
  a.scale = scale * kLog2e;
  a.causal = causal;
  a.x_vec = vector_ok(input, V);
  a.m_vec = mask != nullptr && vector_ok(*mask, V);
  a.y_vec = vector_ok(out, V) && a.sk % V == 0;
  a.rows32 = a.rows <= std::numeric_limits<int32_t>::max();
  a.fast = a.x_vec && a.sk % V == 0 && (mask == nullptr || a.m_vec);
  a.reverse = causal;
  a.heads_inner = heads_inner_takes(a);
  launch_forward(a, st);
}

template <typename T>
void backward_impl(const at::Tensor& grad_output, const at::Tensor& output, float scale, bool causal,
                   at::Tensor& out, cudaStream_t st) {
  constexpr int V = Elem<T>::kVec;
  BwdArgs<T> a{};
  a.dy = reinterpret_cast<const T*>(grad_output.data_ptr());
  a.y = reinterpret_cast<const T*>(output.data_ptr());
  a.dx = reinterpret_cast<T*>(out.data_ptr());
  a.sk = output.size(3);
  a.rows = output.numel() / a.sk;
  a.d1 = output.size(1);
  a.d2 = output.size(2);
  a.gs = row_strides(grad_output);
  a.ys = row_strides(output);
  a.causal_shift = output.size(3) - output.size(2);
  a.scale = scale;
  a.causal = causal;
  a.g_vec = vector_ok(grad_output, V);
  a.y_vec = vector_ok(output, V);
  a.dx_vec = vector_ok(out, V) && a.sk % V == 0;
  a.rows32 = a.rows <= std::numeric_limits<int32_t>::max();
  a.fast = a.g_vec && a.y_vec && a.sk % V == 0;
  a.reverse = causal;
  launch_backward(a, st);
}

}  // namespace

// Entry points, called by pipegoose/kernels/bindings/softmax.cpp, which checks devices, dtypes and shapes (with
// messages naming the argument) and brings the tensors to the 4-D form asserted here: [d0, d1, sq, sk] with a
// contiguous last dim; a mask is bool and already expanded to the input's sizes (broadcast dims have stride 0).
// The result is a new contiguous tensor of the input's sizes and dtype.

at::Tensor softmax_forward_cuda(const at::Tensor& input, const std::optional<at::Tensor>& mask, double scale,
                                bool causal) {
  TORCH_INTERNAL_ASSERT(input.is_cuda() && input.dim() == 4 && scalar_type_ok(input.scalar_type()));
  TORCH_INTERNAL_ASSERT(input.size(3) <= 1 || input.stride(3) == 1);
  const at::Tensor* m = mask.has_value() && mask->defined() ? &*mask : nullptr;
  if (m != nullptr) {
    TORCH_INTERNAL_ASSERT(m->scalar_type() == at::kBool && m->sizes() == input.sizes() &&
                          m->device() == input.device());
    TORCH_INTERNAL_ASSERT(m->size(3) <= 1 || m->stride(3) == 1);
  }
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor out = at::empty(input.sizes(), input.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const cudaStream_t st = at::cuda::getCurrentCUDAStream();
  const float s = static_cast<float>(scale);
  switch (input.scalar_type()) {
    case at::kFloat: forward_impl<float>(input, m, s, causal, out, st); break;
    case at::kHalf: forward_impl<__half>(input, m, s, causal, out, st); break;
    case at::kBFloat16: forward_impl<__nv_bfloat16>(input, m, s, causal, out, st); break;
    default: PG_CHECK(false, "softmax_forward: input must be float32, float16 or bfloat16, got ", input.scalar_type());
  }
  return out;
}

at::Tensor softmax_backward_cuda(const at::Tensor& grad_output, const at::Tensor& output, double scale,
                                 bool causal) {
  TORCH_INTERNAL_ASSERT(output.is_cuda() && output.dim() == 4 && scalar_type_ok(output.scalar_type()));
  TORCH_INTERNAL_ASSERT(grad_output.sizes() == output.sizes() && grad_output.scalar_type() == output.scalar_type() &&
                        grad_output.device() == output.device());
  TORCH_INTERNAL_ASSERT(output.size(3) <= 1 || (output.stride(3) == 1 && grad_output.stride(3) == 1));
  const c10::cuda::CUDAGuard guard(output.device());
  at::Tensor out = at::empty(output.sizes(), output.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const cudaStream_t st = at::cuda::getCurrentCUDAStream();
  const float s = static_cast<float>(scale);
  switch (output.scalar_type()) {
    case at::kFloat: backward_impl<float>(grad_output, output, s, causal, out, st); break;
    case at::kHalf: backward_impl<__half>(grad_output, output, s, causal, out, st); break;
    case at::kBFloat16: backward_impl<__nv_bfloat16>(grad_output, output, s, causal, out, st); break;
    default: PG_CHECK(false, "softmax_backward: output must be float32, float16 or bfloat16, got ", output.scalar_type());
  }
  return out;
}

}  // namespace pipegoose
