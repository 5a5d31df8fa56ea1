// torch.library binding of pipegoose's LayerNorm kernels (pipegoose/kernels/csrc/layer_norm.cu).
// Schemas: docs/architecture.md, "Op schemas", Ours. The entry points check every argument themselves.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward_cuda(
    const at::Tensor& input, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, std::optional<at::ScalarType> out_dtype);
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& input, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd);

TORCH_LIBRARY_FRAGMENT(pipegoose, m) {
  m.def("layer_norm_forward(Tensor input, Tensor? weight, Tensor? bias, float eps, ScalarType? out_dtype) "
        "-> (Tensor output, Tensor mean, Tensor rstd)");
  m.def("layer_norm_backward(Tensor grad_output, Tensor input, Tensor? weight, Tensor? bias, Tensor mean, "
        "Tensor rstd) -> (Tensor grad_input, Tensor grad_weight, Tensor grad_bias)");
}

TORCH_LIBRARY_IMPL(pipegoose, CUDA, m) {
  m.impl("layer_norm_forward", &layer_norm_forward_cuda);
  m.impl("layer_norm_backward", &layer_norm_backward_cuda);
}
