// torch.library binding of Megatron-LM's scaled masked softmax (ColossalAI 0.5.0 copy,
// extensions/csrc/kernel/cuda/scaled_masked_softmax_kernel.cu; Megatron-LM megatron/fused_kernels at
// 040eac9414ccbd1301ae16369c3044c5632b7e14). Written for pipegoose; the kernel file is vendored, not copied here.
//
// Every assumption of the kernel is checked before the call (the upstream code asserts some and silently
// misbehaves on others): fp16/bf16, 4-D contiguous input, mask [b or 1, 1, sq, sk] of 0/1 bytes, 1 <= sk <= 2048,
// sk % 4 == 0 for sk > 64, sq >= 2, sq a multiple of the rows per block, grid and 32-bit index limits, aligned
// pointers. The upstream backward writes into output_grads; this binding hands it a private copy.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>

#include "ported_checks.h"
#include "../csrc/pipegoose_check.h"

// Host entry points of the vendored kernel file (global namespace there).
at::Tensor fwd_cuda(const at::Tensor& input, const at::Tensor& mask, float scale_factor);
at::Tensor bwd_cuda(const at::Tensor& output_grads, const at::Tensor& softmax_results, float scale_factor);
int get_batch_per_block(int query_seq_len, int key_seq_len, int batches, int attn_heads);

namespace {
using namespace pipegoose_ported;

constexpr const char* kFwd = "pipegoose::scaled_masked_softmax_forward";
constexpr const char* kBwd = "pipegoose::scaled_masked_softmax_backward";
constexpr int64_t kMaxGridYZ = 65535;

void check_rows(const char* op, const char* arg, int64_t b, int64_t np, int64_t sq, int64_t sk, bool need_sq_div) {
  PG_CHECK(sq >= 2, op, ": ", arg, " query length (dim 2) must be at least 2 (the kernel asserts sq > 1), got ",
              sq);
  check_softmax_key_len(op, arg, sk);
  const int64_t bpb = softmax_batches_per_block(sk);
  if (need_sq_div) {
    PG_CHECK(sq % bpb == 0, op, ": ", arg, " query length (dim 2) must be a multiple of ", bpb,
                " (rows per thread block for key length ", sk, "), got ", sq);
  } else {
    PG_CHECK((b * np * sq) % bpb == 0, op, ": ", arg, " b*np*sq must be a multiple of ", bpb,
                " (rows per thread block for key length ", sk, "), got ", b * np * sq);
  }
  PG_CHECK(np <= kMaxGridYZ, op, ": ", arg, " heads (dim 1) must be at most ", kMaxGridYZ, " (grid y), got ", np);
  PG_CHECK(b <= kMaxGridYZ, op, ": ", arg, " batch (dim 0) must be at most ", kMaxGridYZ, " (grid z), got ", b);
  check_int32_index(op, arg, b * np * sq * sk);
}

at::Tensor forward(const at::Tensor& input, const at::Tensor& mask, double scale) {
  check_cuda(kFwd, "input", input);
  check_cuda(kFwd, "mask", mask);
  check_same_device(kFwd, "mask", mask, input, "input");
  check_dim(kFwd, "input", input, 4, "[b, np, sq, sk]");
  check_dim(kFwd, "mask", mask, 4, "[b or 1, 1, sq, sk]");
  check_half_or_bf16(kFwd, "input", input);
  check_contiguous(kFwd, "input", input);
  const int64_t b = input.size(0), np = input.size(1), sq = input.size(2), sk = input.size(3);
  PG_CHECK(mask.scalar_type() == at::kBool || mask.scalar_type() == at::kByte, kFwd,
              ": mask must be bool or uint8 (True/nonzero = masked), got ", dtype_name(mask.scalar_type()));
  PG_CHECK((mask.size(0) == 1 || mask.size(0) == b) && mask.size(1) == 1 && mask.size(2) == sq &&
                  mask.size(3) == sk,
              kFwd, ": mask must have shape [", b, " or 1, 1, ", sq, ", ", sk, "] for input ", input.sizes(),
              ", got ", mask.sizes());
  const float scale_f = static_cast<float>(scale);
  // The upstream launcher converts the scale to the input dtype before use.
  const float scale_in_dtype = input.scalar_type() == at::kHalf ? static_cast<float>(static_cast<at::Half>(scale_f))
                                                               : static_cast<float>(static_cast<at::BFloat16>(scale_f));
  PG_CHECK(std::isfinite(scale_in_dtype), kFwd, ": scale must be finite in ", dtype_name(input.scalar_type()),
              ", got ", scale);
  if (input.numel() == 0) {
    return at::empty_like(input, at::MemoryFormat::Contiguous);
  }
  check_rows(kFwd, "input", b, np, sq, sk, /*need_sq_div=*/true);
  c10::cuda::CUDAGuard guard(input.device());
  // The kernel reads the mask as bytes and masks only where the byte equals 1: normalise to contiguous 0/1.
  at::Tensor mask01 = mask.scalar_type() == at::kBool ? mask.contiguous() : mask.ne(0);
  if (softmax_vector_width(sk) > 1) {
    check_aligned(kFwd, "input", input, 4);
    if (reinterpret_cast<uintptr_t>(mask01.data_ptr()) % 4 != 0) mask01 = mask01.clone();
  }
  return fwd_cuda(input, mask01, scale_f);
}

at::Tensor backward(const at::Tensor& output_grads, const at::Tensor& softmax_results, double scale) {
  check_cuda(kBwd, "output_grads", output_grads);
  check_cuda(kBwd, "softmax_results", softmax_results);
  check_same_device(kBwd, "softmax_results", softmax_results, output_grads, "output_grads");
  check_dim(kBwd, "output_grads", output_grads, 4, "[b, np, sq, sk]");
  check_half_or_bf16(kBwd, "output_grads", output_grads);
  PG_CHECK(softmax_results.scalar_type() == output_grads.scalar_type(), kBwd,
              ": softmax_results must have the dtype of output_grads (", dtype_name(output_grads.scalar_type()),
              "), got ", dtype_name(softmax_results.scalar_type()));
  PG_CHECK(softmax_results.sizes() == output_grads.sizes(), kBwd,
              ": softmax_results must have the shape of output_grads ", output_grads.sizes(), ", got ",
              softmax_results.sizes());
  PG_CHECK(std::isfinite(scale), kBwd, ": scale must be finite, got ", scale);
  if (output_grads.numel() == 0) {
    return at::empty_like(output_grads, at::MemoryFormat::Contiguous);
  }
  const int64_t b = output_grads.size(0), np = output_grads.size(1), sq = output_grads.size(2),
                sk = output_grads.size(3);
  check_rows(kBwd, "output_grads", b, np, sq, sk, /*need_sq_div=*/false);
  c10::cuda::CUDAGuard guard(output_grads.device());
  // Upstream computes in place into its first argument: give it a private contiguous copy.
  at::Tensor grads = output_grads.clone(at::MemoryFormat::Contiguous);
  at::Tensor probs = softmax_results.contiguous();
  if (softmax_vector_width(sk) > 1 && reinterpret_cast<uintptr_t>(probs.data_ptr()) % (4 * probs.element_size()))
    probs = probs.clone(at::MemoryFormat::Contiguous);
  return bwd_cuda(grads, probs, static_cast<float>(scale));
}

int64_t batch_per_block(int64_t sq, int64_t sk, int64_t b, int64_t np) {
  const char* op = "pipegoose::scaled_masked_softmax_get_batch_per_block";
  PG_CHECK(sk >= 1 && sk <= 2048, op, ": sk must be in [1, 2048], got ", sk);
  PG_CHECK(sq >= 0 && sq <= INT_MAX && b >= 0 && b <= INT_MAX && np >= 0 && np <= INT_MAX, op,
              ": sq, b and np must be non-negative 32-bit ints, got ", sq, ", ", b, ", ", np);
  return get_batch_per_block(static_cast<int>(sq), static_cast<int>(sk), static_cast<int>(b), static_cast<int>(np));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pipegoose, m) {
  m.def("scaled_masked_softmax_forward(Tensor input, Tensor mask, float scale) -> Tensor");
  m.def("scaled_masked_softmax_backward(Tensor output_grads, Tensor softmax_results, float scale) -> Tensor");
  m.def("scaled_masked_softmax_get_batch_per_block(int sq, int sk, int b, int np) -> int");
}

TORCH_LIBRARY_IMPL(pipegoose, CUDA, m) {
  m.impl("scaled_masked_softmax_forward", &forward);
  m.impl("scaled_masked_softmax_backward", &backward);
}

// No tensor arguments: the dispatcher can only reach a backend-independent kernel.
TORCH_LIBRARY_IMPL(pipegoose, CompositeExplicitAutograd, m) {
  m.impl("scaled_masked_softmax_get_batch_per_block", &batch_per_block);
}
