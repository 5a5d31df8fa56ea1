// torch.library binding of Apex's "mixed" fused LayerNorm (ColossalAI 0.5.0 copy,
// extensions/csrc/kernel/cuda/layer_norm_kernel.cu; Apex csrc/layer_norm_cuda_kernel.cu, = Megatron-LM's
// fused_mix_prec_layer_norm_cuda). Written for pipegoose; the kernel file is vendored, not copied here.
//
// Checked before the call: CUDA, one device, contiguous, normalized_shape matching the input's trailing dims and
// gamma/beta's shape, the dtype combinations the kernel instantiates (input fp32 -> output fp32/fp16/bf16, input
// fp16 -> fp16, bf16 -> bf16; output dtype = gamma dtype = beta dtype), 1 <= H <= 65536, 32-bit indexing,
// dout/mean/invvar shapes and dtypes for the backward. Empty inputs return empty results without a launch.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "ported_checks.h"
#include "../csrc/pipegoose_check.h"

// Host entry points of the vendored kernel file (global namespace there).
void cuda_layer_norm(at::Tensor* output, at::Tensor* mean, at::Tensor* invvar, at::Tensor* input, int n1, int n2,
                     c10::IntArrayRef normalized_shape, at::Tensor* gamma, at::Tensor* beta, double epsilon);
void cuda_layer_norm_gradient(at::Tensor* dout, at::Tensor* mean, at::Tensor* invvar, at::Tensor* input, int n1,
                              int n2, c10::IntArrayRef normalized_shape, at::Tensor* gamma, at::Tensor* beta,
                              double epsilon, at::Tensor* grad_input, at::Tensor* grad_gamma,
                              at::Tensor* grad_beta);

namespace {
using namespace pipegoose_ported;

constexpr const char* kFwd = "pipegoose::fused_layer_norm_affine_forward";
constexpr const char* kBwd = "pipegoose::fused_layer_norm_affine_backward";
constexpr int64_t kHiddenMax = 65536;  // kernels.yaml limits.hidden_max

// Validates input/gamma/beta against normalized_shape; returns (n1 rows, n2 = H).
std::pair<int64_t, int64_t> check_common(const char* op, const at::Tensor& input, c10::IntArrayRef normalized_shape,
                                         const at::Tensor& gamma, const at::Tensor& beta, double eps) {
  check_cuda(op, "input", input);
  check_cuda(op, "gamma", gamma);
  check_cuda(op, "beta", beta);
  check_same_device(op, "gamma", gamma, input, "input");
  check_same_device(op, "beta", beta, input, "input");
  check_contiguous(op, "input", input);
  check_contiguous(op, "gamma", gamma);
  check_contiguous(op, "beta", beta);
  const int64_t nd = static_cast<int64_t>(normalized_shape.size());
  PG_CHECK(nd >= 1, op, ": normalized_shape must have at least one dim, got ", normalized_shape);
  PG_CHECK(input.dim() >= nd && input.sizes().slice(input.dim() - nd).equals(normalized_shape), op,
              ": input's trailing dims must equal normalized_shape ", normalized_shape, ", got input shape ",
              input.sizes());
  PG_CHECK(gamma.sizes().equals(normalized_shape), op, ": gamma must have shape normalized_shape ",
              normalized_shape, ", got ", gamma.sizes());
  PG_CHECK(beta.sizes().equals(normalized_shape), op, ": beta must have shape normalized_shape ",
              normalized_shape, ", got ", beta.sizes());
  const auto in_t = input.scalar_type(), out_t = gamma.scalar_type();
  PG_CHECK(in_t == at::kFloat || in_t == at::kHalf || in_t == at::kBFloat16, op,
              ": input must be float32, float16 or bfloat16, got ", dtype_name(in_t));
  PG_CHECK(beta.scalar_type() == out_t, op, ": beta must have gamma's dtype (", dtype_name(out_t), "), got ",
              dtype_name(beta.scalar_type()));
  const bool ok = in_t == at::kFloat ? (out_t == at::kFloat || out_t == at::kHalf || out_t == at::kBFloat16)
                                     : out_t == in_t;
  PG_CHECK(ok, op, ": gamma/beta dtype is the output dtype and must be ",
              in_t == at::kFloat ? "float32, float16 or bfloat16" : dtype_name(in_t), " for a ", dtype_name(in_t),
              " input, got ", dtype_name(out_t),
              " (the kernel has no such instantiation; e.g. fp16 input with fp32 weights needs another kernel)");
  PG_CHECK(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and >= 0, got ", eps);
  int64_t n2 = 1;
  for (auto s : normalized_shape) n2 *= s;
  PG_CHECK(n2 >= 1 && n2 <= kHiddenMax, op, ": normalized size (product of normalized_shape) must be in [1, ",
              kHiddenMax, "], got ", n2);
  const int64_t n1 = input.numel() / n2;
  check_int32_index(op, "input", input.numel());
  return {n1, n2};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& input, c10::IntArrayRef normalized_shape,
                                                       const at::Tensor& gamma, const at::Tensor& beta,
                                                       double eps) {
  auto [n1, n2] = check_common(kFwd, input, normalized_shape, gamma, beta, eps);
  at::Tensor output = at::empty(input.sizes(), input.options().dtype(gamma.scalar_type()));
  at::Tensor mean = at::empty({n1}, input.options().dtype(at::kFloat));
  at::Tensor invvar = at::empty({n1}, input.options().dtype(at::kFloat));
  if (n1 == 0) return {output, mean, invvar};
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor in = input, g = gamma, b = beta;
  cuda_layer_norm(&output, &mean, &invvar, &in, static_cast<int>(n1), static_cast<int>(n2), normalized_shape, &g, &b,
                  eps);
  return {output, mean, invvar};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& dout, const at::Tensor& mean,
                                                        const at::Tensor& invvar, const at::Tensor& input,
                                                        c10::IntArrayRef normalized_shape, const at::Tensor& gamma,
                                                        const at::Tensor& beta, double eps) {
  auto [n1, n2] = check_common(kBwd, input, normalized_shape, gamma, beta, eps);
  check_cuda(kBwd, "dout", dout);
  check_cuda(kBwd, "mean", mean);
  check_cuda(kBwd, "invvar", invvar);
  check_same_device(kBwd, "dout", dout, input, "input");
  check_same_device(kBwd, "mean", mean, input, "input");
  check_same_device(kBwd, "invvar", invvar, input, "input");
  PG_CHECK(dout.sizes().equals(input.sizes()), kBwd, ": dout must have the input's shape ", input.sizes(),
              ", got ", dout.sizes());
  PG_CHECK(dout.scalar_type() == gamma.scalar_type(), kBwd, ": dout must have the output dtype (gamma's, ",
              dtype_name(gamma.scalar_type()), "), got ", dtype_name(dout.scalar_type()));
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"mean", &mean}, {"invvar", &invvar}}) {
    PG_CHECK(t->scalar_type() == at::kFloat, kBwd, ": ", name, " must be float32 (from the forward), got ",
                dtype_name(t->scalar_type()));
    PG_CHECK(t->numel() == n1, kBwd, ": ", name, " must have one value per row (", n1, "), got shape ",
                t->sizes());
    check_contiguous(kBwd, name, *t);
  }
  at::Tensor grad_input = at::empty(input.sizes(), input.options());
  at::Tensor grad_gamma = at::empty(gamma.sizes(), gamma.options());
  at::Tensor grad_beta = at::empty(beta.sizes(), beta.options());
  if (n1 == 0) {
    grad_gamma.zero_();
    grad_beta.zero_();
    return {grad_input, grad_gamma, grad_beta};
  }
  c10::cuda::CUDAGuard guard(input.device());
  at::Tensor d = dout.contiguous(), m = mean, iv = invvar, in = input, g = gamma, b = beta;
  cuda_layer_norm_gradient(&d, &m, &iv, &in, static_cast<int>(n1), static_cast<int>(n2), normalized_shape, &g, &b,
                           eps, &grad_input, &grad_gamma, &grad_beta);
  return {grad_input, grad_gamma, grad_beta};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pipegoose, m) {
  m.def("fused_layer_norm_affine_forward(Tensor input, int[] normalized_shape, Tensor gamma, Tensor beta, float eps)"
        " -> (Tensor output, Tensor mean, Tensor invvar)");
  m.def("fused_layer_norm_affine_backward(Tensor dout, Tensor mean, Tensor invvar, Tensor input, "
        "int[] normalized_shape, Tensor gamma, Tensor beta, float eps) "
        "-> (Tensor grad_input, Tensor grad_gamma, Tensor grad_beta)");
}

TORCH_LIBRARY_IMPL(pipegoose, CUDA, m) {
  m.impl("fused_layer_norm_affine_forward", &forward);
  m.impl("fused_layer_norm_affine_backward", &backward);
}
