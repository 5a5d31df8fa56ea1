// torch.library binding of pipegoose's gradient clipping passes (pipegoose/kernels/csrc/clip_grad_norm.cu): the total
// norm of a list of tensors and their in-place multiplication by a coefficient on the device. Schemas:
// docs/architecture.md, "Op schemas", Ours. The entry points check every argument before their first launch.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace pipegoose {
at::Tensor multi_tensor_norm_cuda(at::TensorList tensors, double norm_type);
void multi_tensor_mul_cuda(at::TensorList tensors, const at::Tensor& coef);
}  // namespace pipegoose

TORCH_LIBRARY_FRAGMENT(pipegoose, m) {
  m.def("multi_tensor_norm(Tensor[] tensors, float norm_type) -> Tensor");
  m.def("multi_tensor_mul_(Tensor(a!)[] tensors, Tensor coef) -> ()");
}

TORCH_LIBRARY_IMPL(pipegoose, CUDA, m) {
  m.impl("multi_tensor_norm", &pipegoose::multi_tensor_norm_cuda);
  m.impl("multi_tensor_mul_", &pipegoose::multi_tensor_mul_cuda);
}
