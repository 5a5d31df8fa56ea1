// torch.library binding of DeepSpeed's multi-tensor Adam/AdamW step (DeepSpeed 0.19.8 csrc/adam/multi_tensor_adam.cu,
// adapted from Apex). Written for pipegoose; the kernel file is vendored, not copied here. Updates params,
// exp_avgs and exp_avg_sqs in place (declared in the schema). 64-bit sizes are handled by the kernel itself.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "multi_tensor_checks.h"
#include "../csrc/pipegoose_check.h"

// Host entry point of the vendored kernel file (global namespace there).
void multi_tensor_adam_cuda(int chunk_size, at::Tensor noop_flag, std::vector<std::vector<at::Tensor>> tensor_lists,
                            const float lr, const float beta1, const float beta2, const float epsilon,
                            const int step, const int mode, const int bias_correction, const float weight_decay);

namespace {
using namespace pipegoose_ported;

constexpr const char* kOp = "pipegoose::deepspeed_multi_tensor_adam";

void adam(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList grads, at::TensorList params,
          at::TensorList exp_avgs, at::TensorList exp_avg_sqs, double lr, double beta1, double beta2, double eps,
          int64_t step, int64_t mode, int64_t bias_correction, double weight_decay) {
  const int chunk = checked_chunk_size(kOp, chunk_size);
  check_noop_flag(kOp, noop_flag);
  check_lists(kOp, noop_flag, {{"grads", grads}, {"params", params}, {"exp_avgs", exp_avgs},
                               {"exp_avg_sqs", exp_avg_sqs}}, /*int32_sizes=*/false);
  PG_CHECK(mode == 0 || mode == 1, kOp, ": mode must be 0 (Adam, L2) or 1 (AdamW), got ", mode);
  PG_CHECK(bias_correction == 0 || bias_correction == 1, kOp, ": bias_correction must be 0 or 1, got ",
              bias_correction);
  PG_CHECK(step >= (bias_correction ? 1 : 0) && step <= INT_MAX, kOp, ": step must be in [",
              bias_correction ? 1 : 0, ", ", INT_MAX, "] (1-based with bias correction), got ", step);
  for (auto [name, v] : {std::pair<const char*, double>{"lr", lr}, {"beta1", beta1}, {"beta2", beta2}, {"eps", eps},
                         {"weight_decay", weight_decay}}) {
    PG_CHECK(std::isfinite(v), kOp, ": ", name, " must be finite, got ", v);
  }
  PG_CHECK(!bias_correction || (beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1), kOp,
              ": with bias correction beta1 and beta2 must be in [0, 1), got ", beta1, ", ", beta2);
  if (grads.empty()) return;
  // The kernel reads all four lists with the dtype of grads[0].
  const auto g = list_dtype(kOp, "grads", grads, {at::kFloat, at::kHalf, at::kBFloat16});
  list_dtype(kOp, "params", params, {g});
  list_dtype(kOp, "exp_avgs", exp_avgs, {g});
  list_dtype(kOp, "exp_avg_sqs", exp_avg_sqs, {g});
  auto lists = non_empty({grads, params, exp_avgs, exp_avg_sqs});
  if (lists[0].empty()) return;
  c10::cuda::CUDAGuard guard(noop_flag.device());
  multi_tensor_adam_cuda(chunk, noop_flag, lists, static_cast<float>(lr), static_cast<float>(beta1),
                         static_cast<float>(beta2), static_cast<float>(eps), static_cast<int>(step),
                         static_cast<int>(mode), static_cast<int>(bias_correction), static_cast<float>(weight_decay));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pipegoose, m) {
  m.def("deepspeed_multi_tensor_adam(int chunk_size, Tensor(a!) noop_flag, Tensor[] grads, Tensor(b!)[] params, "
        "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, float lr, float beta1, float beta2, float eps, int step, "
        "int adam_w_mode, int bias_correction, float weight_decay) -> ()");
}

TORCH_LIBRARY_IMPL(pipegoose, CUDA, m) { m.impl("deepspeed_multi_tensor_adam", &adam); }
