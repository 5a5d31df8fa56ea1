// torch.library binding of Apex's multi-tensor scale (amp_C.multi_tensor_scale; ColossalAI 0.5.0 copy
// extensions/csrc/kernel/cuda/multi_tensor_scale_kernel.cu). Written for pipegoose; the kernel file is vendored,
// not copied here. dst[i] = src[i] * scale (dst may be src); noop_flag is set to 1 when a non-finite value is met.
// src and dst lists are each float32 or float16 (the kernel has no bfloat16 instantiation).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "multi_tensor_checks.h"
#include "../csrc/pipegoose_check.h"

// Host entry point of the vendored kernel file (global namespace there).
void multi_tensor_scale_cuda(int chunk_size, at::Tensor noop_flag, std::vector<std::vector<at::Tensor>> tensor_lists,
                             float scale);

namespace {
using namespace pipegoose_ported;

constexpr const char* kOp = "pipegoose::multi_tensor_scale";

void scale(int64_t chunk_size, const at::Tensor& noop_flag, at::TensorList src, at::TensorList dst, double s) {
  const int chunk = checked_chunk_size(kOp, chunk_size);
  check_noop_flag(kOp, noop_flag);
  check_lists(kOp, noop_flag, {{"src", src}, {"dst", dst}}, /*int32_sizes=*/true);
  PG_CHECK(!std::isnan(s), kOp, ": scale must not be NaN");
  if (src.empty()) return;
  list_dtype(kOp, "src", src, {at::kFloat, at::kHalf});
  list_dtype(kOp, "dst", dst, {at::kFloat, at::kHalf});
  auto lists = non_empty({src, dst});
  if (lists[0].empty()) return;
  c10::cuda::CUDAGuard guard(noop_flag.device());
  multi_tensor_scale_cuda(chunk, noop_flag, lists, static_cast<float>(s));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pipegoose, m) {
  m.def("multi_tensor_scale(int chunk_size, Tensor(a!) noop_flag, Tensor[] src, Tensor(b!)[] dst, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(pipegoose, CUDA, m) { m.impl("multi_tensor_scale", &scale); }
