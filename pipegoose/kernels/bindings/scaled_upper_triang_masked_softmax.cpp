// torch.library binding of Megatron-LM's scaled causal ("upper triangular masked") softmax (ColossalAI 0.5.0 copy,
// extensions/csrc/kernel/cuda/scaled_upper_triang_masked_softmax_kernel.cu; Megatron-LM megatron/fused_kernels at
// 040eac9414ccbd1301ae16369c3044c5632b7e14). Written for pipegoose; the kernel file is vendored, not copied here.
//
// Checked before the call: fp16/bf16, 3-D contiguous [attn_batches, sq, sk] with sq == sk, 1 <= sk <= 2048,
// sk % 4 == 0 for sk > 64, attn_batches a multiple of the rows per block (and within grid y), 32-bit indexing,
// aligned pointers. The upstream backward writes into output_grads; this binding hands it a private copy.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>

#include "ported_checks.h"
#include "../csrc/pipegoose_check.h"

// Host entry points of the vendored kernel file (global namespace there).
at::Tensor fwd_cuda(const at::Tensor& input, float scale_factor);
at::Tensor bwd_cuda(const at::Tensor& output_grads, const at::Tensor& softmax_results, float scale_factor);

namespace {
using namespace pipegoose_ported;

constexpr const char* kFwd = "pipegoose::scaled_upper_triang_masked_softmax_forward";
constexpr const char* kBwd = "pipegoose::scaled_upper_triang_masked_softmax_backward";

void check_shape(const char* op, const char* arg, const at::Tensor& t) {
  check_dim(op, arg, t, 3, "[attn_batches, sq, sk]");
  check_half_or_bf16(op, arg, t);
  const int64_t ab = t.size(0), sq = t.size(1), sk = t.size(2);
  PG_CHECK(sq == sk, op, ": ", arg, " must be square in its last two dims (causal: sq == sk), got ", t.sizes());
  if (t.numel() == 0) return;
  check_softmax_key_len(op, arg, sk);
  const int64_t bpb = softmax_batches_per_block(sk);
  PG_CHECK(ab % bpb == 0, op, ": ", arg, " attn_batches (dim 0) must be a multiple of ", bpb,
              " (rows per thread block for length ", sk, "), got ", ab);
  PG_CHECK(ab / bpb <= 65535, op, ": ", arg, " attn_batches (dim 0) must be at most ", 65535 * bpb,
              " (grid y), got ", ab);
  check_int32_index(op, arg, t.numel());
}

at::Tensor forward(const at::Tensor& input, double scale) {
  check_cuda(kFwd, "input", input);
  check_shape(kFwd, "input", input);
  check_contiguous(kFwd, "input", input);
  const float scale_f = static_cast<float>(scale);
  // The upstream launcher converts the scale to the input dtype before use.
  const float scale_in_dtype = input.scalar_type() == at::kHalf ? static_cast<float>(static_cast<at::Half>(scale_f))
                                                               : static_cast<float>(static_cast<at::BFloat16>(scale_f));
  PG_CHECK(std::isfinite(scale_in_dtype), kFwd, ": scale must be finite in ", dtype_name(input.scalar_type()),
              ", got ", scale);
  if (input.numel() == 0) return at::empty_like(input, at::MemoryFormat::Contiguous);
  if (softmax_vector_width(input.size(2)) > 1) check_aligned(kFwd, "input", input, 4);
  c10::cuda::CUDAGuard guard(input.device());
  return fwd_cuda(input, scale_f);
}

at::Tensor backward(const at::Tensor& output_grads, const at::Tensor& softmax_results, double scale) {
  check_cuda(kBwd, "output_grads", output_grads);
  check_cuda(kBwd, "softmax_results", softmax_results);
  check_same_device(kBwd, "softmax_results", softmax_results, output_grads, "output_grads");
  check_shape(kBwd, "output_grads", output_grads);
  PG_CHECK(softmax_results.scalar_type() == output_grads.scalar_type(), kBwd,
              ": softmax_results must have the dtype of output_grads (", dtype_name(output_grads.scalar_type()),
              "), got ", dtype_name(softmax_results.scalar_type()));
  PG_CHECK(softmax_results.sizes() == output_grads.sizes(), kBwd,
              ": softmax_results must have the shape of output_grads ", output_grads.sizes(), ", got ",
              softmax_results.sizes());
  PG_CHECK(std::isfinite(scale), kBwd, ": scale must be finite, got ", scale);
  if (output_grads.numel() == 0) return at::empty_like(output_grads, at::MemoryFormat::Contiguous);
  c10::cuda::CUDAGuard guard(output_grads.device());
  // Upstream computes in place into its first argument: give it a private contiguous copy.
  at::Tensor grads = output_grads.clone(at::MemoryFormat::Contiguous);
  at::Tensor probs = softmax_results.contiguous();
  if (softmax_vector_width(output_grads.size(2)) > 1 &&
      reinterpret_cast<uintptr_t>(probs.data_ptr()) % (4 * probs.element_size()))
    probs = probs.clone(at::MemoryFormat::Contiguous);
  return bwd_cuda(grads, probs, static_cast<float>(scale));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pipegoose, m) {
  m.def("scaled_upper_triang_masked_softmax_forward(Tensor input, float scale) -> Tensor");
  m.def("scaled_upper_triang_masked_softmax_backward(Tensor output_grads, Tensor softmax_results, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pipegoose, CUDA, m) {
  m.impl("scaled_upper_triang_masked_softmax_forward", &forward);
  m.impl("scaled_upper_triang_masked_softmax_backward", &backward);
}
