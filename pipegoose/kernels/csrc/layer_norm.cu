// LayerNorm forward/backward for pipegoose: entry points of the ops layer_norm_forward and layer_norm_backward
// (schemas in docs/architecture.md, registered by pipegoose/kernels/bindings/layer_norm.cpp). The kernels are in
// norm_kernels.cuh (shared with rms_norm.cu).
#include "norm_kernels.cuh"

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward_cuda(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, std::optional<at::ScalarType> out_dtype) {
  auto r = pipegoose::norm::norm_forward</*RMS=*/false>(
      "layer_norm_forward", input, weight.value_or(at::Tensor()), bias.value_or(at::Tensor()), eps, out_dtype);
  return {r.out, r.mean, r.rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd) {
  auto r = pipegoose::norm::norm_backward</*RMS=*/false>("layer_norm_backward", grad_output, input,
                                                         weight.value_or(at::Tensor()), bias.value_or(at::Tensor()),
                                                         mean, rstd);
  return {r.grad_input, r.grad_weight, r.grad_bias};
}
