// torch.library binding of pipegoose's multi-tensor Adam / AdamW step (pipegoose/kernels/csrc/multi_tensor_adam.cu).
// Schema: docs/architecture.md, "Op schemas", Ours. Updates params, exp_avgs and exp_avg_sqs in place (declared in the
// schema); the entry point checks every argument before its first launch.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace pipegoose {
void adam_step_cuda(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, double lr, double beta1, double beta2, double eps, int64_t step,
                    bool adam_w_mode, bool bias_correction, double weight_decay);
}  // namespace pipegoose

TORCH_LIBRARY_FRAGMENT(pipegoose, m) {
  m.def("adam_step(Tensor[] grads, Tensor(a!)[] params, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, float lr, "
        "float beta1, float beta2, float eps, int step, bool adam_w_mode, bool bias_correction, float weight_decay) "
        "-> ()");
}

TORCH_LIBRARY_IMPL(pipegoose, CUDA, m) { m.impl("adam_step", &pipegoose::adam_step_cuda); }
