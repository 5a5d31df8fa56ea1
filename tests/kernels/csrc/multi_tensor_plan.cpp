// Test extension (CPU, host compiler): pipegoose_multi_tensor.cuh's launch plan and chunk search, with the tables of
// the Adam and clipping kernels and a small one that splits often. Built by tests/kernels/test_multi_tensor_plan.py.
#include <torch/extension.h>

#include <array>
#include <cstdint>
#include <vector>

#include "pipegoose_multi_tensor.cuh"

namespace mt = pipegoose::multi_tensor;

namespace {

using Small = mt::Table<2, 3, int32_t>;        // two lists, three tensors a launch
using Adam = mt::Table<4, 384, int32_t>;       // multi_tensor_adam.cu's TensorTable
using Clip = mt::Table<1, 1024, int64_t>;      // clip_grad_norm.cu's Table

template <typename TableT>
std::vector<mt::Launch<TableT>> plan_of(const std::vector<std::vector<at::Tensor>>& lists, int64_t elems_per_chunk) {
  TORCH_CHECK(lists.size() == TableT::lists, "expected ", TableT::lists, " lists");
  std::array<at::TensorList, TableT::lists> views;
  for (int k = 0; k < TableT::lists; ++k) views[k] = lists[k];
  return mt::plan<TableT>("test_op", "xs", views, elems_per_chunk);
}

// Each launch as a dict of its table's used entries.
template <typename TableT>
py::list describe(const std::vector<std::vector<at::Tensor>>& lists, int64_t elems_per_chunk) {
  py::list out;
  for (const auto& l : plan_of<TableT>(lists, elems_per_chunk)) {
    py::dict d;
    d["count"] = l.count;
    d["chunks"] = l.chunks;
    py::list ptr, numel, start, aligned;
    for (int k = 0; k < TableT::lists; ++k) {
      py::list p;
      for (int i = 0; i < l.count; ++i) p.append(reinterpret_cast<uintptr_t>(l.table.ptr[k][i]));
      ptr.append(p);
    }
    for (int i = 0; i < l.count; ++i) {
      numel.append(l.table.numel[i]);
      aligned.append(static_cast<int>(l.table.aligned[i]));
    }
    for (int i = 0; i <= l.count; ++i) start.append(static_cast<int64_t>(l.table.chunk_start[i]));
    d["ptr"] = ptr;
    d["numel"] = numel;
    d["chunk_start"] = start;
    d["aligned"] = aligned;
    out.append(d);
  }
  return out;
}

// The chunk walk of every launch, as the kernels do it: (launch, block, chunk, tensor) for each chunk a block visits.
// grid 0: a block per chunk, each searching from tensor 0 (multi_tensor_adam.cu: the chunk index is the block's,
// of the table's chunk type); otherwise `grid` blocks (at most the chunks), block b walking its chunk_range, the first
// chunk's tensor by find_tensor and the next ones' by next_tensor (clip_grad_norm.cu, int64 chunks).
template <typename TableT>
std::vector<std::array<int64_t, 4>> walk(const std::vector<std::vector<at::Tensor>>& lists, int64_t elems_per_chunk,
                                         int64_t grid) {
  std::vector<std::array<int64_t, 4>> out;
  const auto launches = plan_of<TableT>(lists, elems_per_chunk);
  for (size_t li = 0; li < launches.size(); ++li) {
    const auto& l = launches[li];
    if (grid == 0) {
      for (int64_t b = 0; b < l.chunks; ++b) {
        const auto block = static_cast<typename TableT::chunk_type>(b);
        out.push_back({static_cast<int64_t>(li), b, b, mt::find_tensor(l.table, 0, l.count, block)});
      }
      continue;
    }
    const int64_t g = std::min(grid, l.chunks);
    for (int64_t b = 0; b < g; ++b) {
      const mt::ChunkRange r = mt::chunk_range(l.chunks, g, b);
      int t = mt::find_tensor(l.table, 0, l.count, static_cast<typename TableT::chunk_type>(r.first));
      for (int64_t c = r.first; c < r.stop; ++c) {
        t = mt::next_tensor(l.table, t, static_cast<typename TableT::chunk_type>(c));
        out.push_back({static_cast<int64_t>(li), b, c, t});
      }
    }
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("describe_small", &describe<Small>);
  m.def("describe_adam", &describe<Adam>);
  m.def("describe_clip", &describe<Clip>);
  m.def("walk_small", &walk<Small>);
  m.def("walk_adam", &walk<Adam>);
  m.def("walk_clip", &walk<Clip>);
  m.attr("adam_table_bytes") = sizeof(Adam);
  m.attr("clip_table_bytes") = sizeof(Clip);
}
