// torch.library binding of Apex's multi-tensor L2 norm (amp_C.multi_tensor_l2norm; ColossalAI 0.5.0 copy
// extensions/csrc/kernel/cuda/multi_tensor_l2norm_kernel.cu). Written for pipegoose; the kernel file is vendored,
// not copied here. Returns (global norm [1] float32, per-tensor norms [n] float32 or [0]); sets noop_flag to 1
// when it meets a non-finite value. float32/float16 only (the kernel has no bfloat16 instantiation).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "multi_tensor_checks.h"

// Host entry point of the vendored kernel file (global namespace there).
std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_cuda(int chunk_size, at::Tensor noop_flag,
                                                            std::vector<std::vector<at::Tensor>> tensor_lists,
                                                            std::optional<bool> per_tensor_python);

namespace {
using namespace pipegoose_ported;

constexpr const char* kOp = "pipegoose::multi_tensor_l2norm";

std::tuple<at::Tensor, at::Tensor> l2norm(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList tensors,
                                          bool per_tensor) {
  const int chunk = checked_chunk_size(kOp, chunk_size);
  check_noop_flag(kOp, noop_flag);
  check_lists(kOp, noop_flag, {{"tensors", tensors}}, /*int32_sizes=*/true);
  const auto opts = noop_flag.options().dtype(at::kFloat);
  const int64_t n = static_cast<int64_t>(tensors.size());
  if (n > 0) list_dtype(kOp, "tensors", tensors, {at::kFloat, at::kHalf});
  std::vector<int64_t> kept;
  for (int64_t i = 0; i < n; ++i)
    if (tensors[i].numel() > 0) kept.push_back(i);
  if (kept.empty()) return {at::zeros({1}, opts), at::zeros({per_tensor ? n : 0}, opts)};
  c10::cuda::CUDAGuard guard(noop_flag.device());
  auto lists = non_empty({tensors});
  auto [norm, norms] = multi_tensor_l2norm_cuda(chunk, noop_flag, lists, per_tensor);
  if (!per_tensor || static_cast<int64_t>(kept.size()) == n) return {norm, norms};
  // Empty tensors were dropped before the call: their norm is 0.
  at::Tensor full = at::zeros({n}, opts);
  full.index_copy_(0, at::tensor(kept, noop_flag.options().dtype(at::kLong)), norms);
  return {norm, full};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pipegoose, m) {
  m.def("multi_tensor_l2norm(int chunk_size, Tensor(a!) noop_flag, Tensor[] tensors, bool per_tensor) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pipegoose, CUDA, m) { m.impl("multi_tensor_l2norm", &l2norm); }
