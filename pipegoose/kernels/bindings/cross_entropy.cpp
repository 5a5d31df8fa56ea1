// torch.library binding of pipegoose's cross-entropy kernels (pipegoose/kernels/csrc/cross_entropy.cu).
// Schemas: docs/architecture.md, "Op schemas", Ours. The entry points check every argument themselves. The autograd
// formula is Python's (pipegoose/nn/fusion/ops/cross_entropy.py: one call per training step, so host time does not
// matter here as it does for the norms).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

namespace pipegoose {
std::tuple<at::Tensor, at::Tensor> cross_entropy_forward_cuda(const at::Tensor& logits, const at::Tensor& target,
                                                              int64_t ignore_index);
std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_forward_reduced_cuda(const at::Tensor& logits,
                                                                                  const at::Tensor& target,
                                                                                  int64_t ignore_index, bool mean);
at::Tensor cross_entropy_backward_cuda(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
                                       const at::Tensor& lse, int64_t ignore_index);
void cross_entropy_backward_inplace_cuda(const at::Tensor& grad_loss, const at::Tensor& logits,
                                         const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index);
}  // namespace pipegoose

TORCH_LIBRARY_FRAGMENT(pipegoose, m) {
  m.def("cross_entropy_forward(Tensor logits, Tensor target, int ignore_index) -> (Tensor loss, Tensor lse)");
  m.def("cross_entropy_forward_reduced(Tensor logits, Tensor target, int ignore_index, bool mean) "
        "-> (Tensor out, Tensor lse, Tensor count)");
  m.def("cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor target, Tensor lse, int ignore_index) "
        "-> Tensor");
  m.def("cross_entropy_backward_(Tensor grad_loss, Tensor(a!) logits, Tensor target, Tensor lse, int ignore_index) "
        "-> ()");
}

TORCH_LIBRARY_IMPL(pipegoose, CUDA, m) {
  m.impl("cross_entropy_forward", &pipegoose::cross_entropy_forward_cuda);
  m.impl("cross_entropy_forward_reduced", &pipegoose::cross_entropy_forward_reduced_cuda);
  m.impl("cross_entropy_backward", &pipegoose::cross_entropy_backward_cuda);
  m.impl("cross_entropy_backward_", &pipegoose::cross_entropy_backward_inplace_cuda);
}
