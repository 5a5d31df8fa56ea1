// Argument checks shared by the bindings of Apex's / DeepSpeed's multi-tensor-apply kernels (vendored from
// ColossalAI 0.5.0 extensions/csrc/kernel/cuda/multi_tensor_apply.cuh and DeepSpeed 0.19.8 csrc/adam/).
//
// What multi_tensor_apply assumes and does not (fully) check: every list has the same length, every tensor is
// contiguous, on the first tensor's device, with the numel of its counterpart in list 0, one dtype per list (the
// functor casts raw pointers), an int32 noop flag on that device; and no EMPTY tensor: a tensor with no chunk never
// triggers a launch, so a trailing empty tensor silently drops the pending launch of the tensors before it, and
// empty tensors count against the per-launch tensor slots. The bindings therefore drop empty tensors (updating an
// empty tensor is a no-op).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <climits>
#include <initializer_list>
#include <utility>
#include <vector>

#include "ported_checks.h"
#include "../csrc/pipegoose_check.h"

namespace pipegoose_ported {

using NamedList = std::pair<const char*, at::TensorList>;

inline void check_noop_flag(const char* op, const at::Tensor& noop) {
  check_cuda(op, "noop_flag", noop);
  PG_CHECK(noop.scalar_type() == at::kInt, op, ": noop_flag must be int32, got ", dtype_name(noop.scalar_type()));
  PG_CHECK(noop.numel() >= 1, op, ": noop_flag must have at least one element");
  check_contiguous(op, "noop_flag", noop);
}

// Checks the lists against each other and the noop flag; `int32_sizes`: the kernel stores numel in an int.
inline void check_lists(const char* op, const at::Tensor& noop, std::initializer_list<NamedList> lists,
                        bool int32_sizes) {
  const NamedList& first = *lists.begin();
  const size_t n = first.second.size();
  for (const auto& [name, list] : lists) {
    PG_CHECK(list.size() == n, op, ": ", name, " has ", list.size(), " tensors but ", first.first, " has ", n,
                "; the lists must have equal lengths");
    for (size_t i = 0; i < list.size(); ++i) {
      const at::Tensor& t = list[i];
      PG_CHECK(t.defined(), op, ": ", name, "[", i, "] is undefined");
      PG_CHECK(t.is_cuda(), op, ": ", name, "[", i, "] must be a CUDA tensor, got device ", t.device());
      PG_CHECK(t.device() == noop.device(), op, ": ", name, "[", i, "] is on ", t.device(), " but noop_flag is on ",
                  noop.device(), "; expected one device");
      PG_CHECK(t.is_contiguous(), op, ": ", name, "[", i, "] must be contiguous, got strides ", t.strides(),
                  " for sizes ", t.sizes());
      PG_CHECK(t.numel() == first.second[i].numel(), op, ": ", name, "[", i, "] has ", t.numel(),
                  " elements but ", first.first, "[", i, "] has ", first.second[i].numel());
      PG_CHECK(!int32_sizes || t.numel() <= INT_MAX, op, ": ", name, "[", i, "] has ", t.numel(),
                  " elements; the kernel stores sizes as 32-bit ints (at most ", INT_MAX, ")");
    }
  }
}

// The one dtype of a list (every tensor must share it), which must be among `allowed`.
inline at::ScalarType list_dtype(const char* op, const char* name, at::TensorList list,
                                 std::initializer_list<at::ScalarType> allowed) {
  const at::ScalarType t0 = list[0].scalar_type();
  for (size_t i = 1; i < list.size(); ++i) {
    PG_CHECK(list[i].scalar_type() == t0, op, ": every tensor of ", name, " must have one dtype (the kernel casts "
                "raw pointers); ", name, "[0] is ", dtype_name(t0), " but ", name, "[", i, "] is ",
                dtype_name(list[i].scalar_type()));
  }
  bool ok = false;
  std::string names;
  for (auto a : allowed) {
    ok = ok || a == t0;
    names += std::string(names.empty() ? "" : ", ") + dtype_name(a);
  }
  PG_CHECK(ok, op, ": ", name, " must be one of ", names, ", got ", dtype_name(t0));
  return t0;
}

// The lists as multi_tensor_apply takes them, without the empty tensors (see the note at the top).
inline std::vector<std::vector<at::Tensor>> non_empty(std::initializer_list<at::TensorList> lists) {
  std::vector<std::vector<at::Tensor>> out(lists.size());
  const at::TensorList& first = *lists.begin();
  for (size_t i = 0; i < first.size(); ++i) {
    if (first[i].numel() == 0) continue;
    size_t d = 0;
    for (const auto& list : lists) out[d++].push_back(list[i]);
  }
  return out;
}

inline int checked_chunk_size(const char* op, int64_t chunk_size) {
  PG_CHECK(chunk_size > 0 && chunk_size <= INT_MAX, op, ": chunk_size must be in [1, ", INT_MAX, "], got ",
              chunk_size);
  return static_cast<int>(chunk_size);
}

}  // namespace pipegoose_ported
