// RMSNorm forward/backward for pipegoose: entry points of the ops rms_norm_forward and rms_norm_backward
// (schemas in docs/architecture.md, registered by pipegoose/kernels/bindings/rms_norm.cpp). The kernels are in
// norm_kernels.cuh (shared with layer_norm.cu).
#include "norm_kernels.cuh"

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cuda(const at::Tensor& input,
                                                         const std::optional<at::Tensor>& weight, double eps,
                                                         std::optional<at::ScalarType> out_dtype) {
  auto r = pipegoose::norm::norm_forward</*RMS=*/true>("rms_norm_forward", input, weight.value_or(at::Tensor()),
                                                       at::Tensor(), eps, out_dtype);
  return {r.out, r.rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                                                          const std::optional<at::Tensor>& weight,
                                                          const at::Tensor& rstd) {
  auto r = pipegoose::norm::norm_backward</*RMS=*/true>("rms_norm_backward", grad_output, input,
                                                        weight.value_or(at::Tensor()), at::Tensor(), at::Tensor(),
                                                        rstd);
  return {r.grad_input, r.grad_weight};
}
