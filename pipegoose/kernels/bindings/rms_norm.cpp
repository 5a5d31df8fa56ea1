// torch.library binding of pipegoose's RMSNorm kernels (pipegoose/kernels/csrc/rms_norm.cu).
// Schemas: docs/architecture.md, "Op schemas", Ours. The entry points check every argument themselves.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

std::tuple<at::Tensor, at::Tensor> rms_norm_forward_cuda(const at::Tensor& input,
                                                         const std::optional<at::Tensor>& weight, double eps,
                                                         std::optional<at::ScalarType> out_dtype);
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_cuda(const at::Tensor& grad_output, const at::Tensor& input,
                                                          const std::optional<at::Tensor>& weight,
                                                          const at::Tensor& rstd);

TORCH_LIBRARY_FRAGMENT(pipegoose, m) {
  m.def("rms_norm_forward(Tensor input, Tensor? weight, float eps, ScalarType? out_dtype) "
        "-> (Tensor output, Tensor rstd)");
  m.def("rms_norm_backward(Tensor grad_output, Tensor input, Tensor? weight, Tensor rstd) "
        "-> (Tensor grad_input, Tensor grad_weight)");
}

TORCH_LIBRARY_IMPL(pipegoose, CUDA, m) {
  m.impl("rms_norm_forward", &rms_norm_forward_cuda);
  m.impl("rms_norm_backward", &rms_norm_backward_cuda);
}
