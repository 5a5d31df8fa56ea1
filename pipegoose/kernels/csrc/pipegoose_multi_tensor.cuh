// What pipegoose's multi-tensor kernels share (multi_tensor_adam.cu, clip_grad_norm.cu): the table of a launch's
// tensors that travels in the kernel's parameter block, the search for the tensor of a chunk, the host-side plan of
// the launches, and the checks of the tensor lists. Written for pipegoose.
//
// A launch's tensors form one sequence of chunks of elems_per_chunk elements (a tensor's last chunk may be shorter):
// tensor i of the table owns chunks [chunk_start[i], chunk_start[i + 1]). The table travels in the kernel's parameter
// block (CUDA 12.1+ takes up to 32764 bytes of parameters on sm_70 and later), so a launch needs no host-to-device
// copy and no host sync. A list of more tensors than a table holds, or of more chunks than its chunk index type
// counts, takes several launches. Empty tensors take no slot.
//
// Host and device code alike, so that the plan and the search compile without nvcc too (the CPU test
// tests/kernels/test_multi_tensor_plan.py builds them with the host compiler and walks the chunks as the kernels do).
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "pipegoose_check.h"

#if defined(__CUDACC__)
#define PIPEGOOSE_MT_HD __host__ __device__ __forceinline__
#else
#define PIPEGOOSE_MT_HD inline
#endif

namespace pipegoose {
namespace multi_tensor {

// The tensors of one launch: kLists parallel lists (Adam: grad, param, exp_avg, exp_avg_sq) of at most kMaxTensors
// tensors, their sizes and the prefix sums of their chunk counts, as Chunk (int32_t where a block is a chunk, so the
// chunk count is a grid size; int64_t where blocks walk the chunks).
template <int kLists, int kMaxTensors, typename Chunk>
struct Table {
  static constexpr int lists = kLists;
  static constexpr int max_tensors = kMaxTensors;
  using chunk_type = Chunk;
  void* ptr[kLists][kMaxTensors];
  int64_t numel[kMaxTensors];
  Chunk chunk_start[kMaxTensors + 1];   // tensor i owns chunks [chunk_start[i], chunk_start[i + 1])
  uint8_t aligned[kMaxTensors];         // the tensor's pointers in every list are 16-byte aligned: the vector path
};

// The tensor of chunk c: the last i in [from, n_tensors) with chunk_start[i] <= c (from: 0, or the tensor of an
// earlier chunk of the same launch, as chunks only increase along a block's walk). Every thread of a block reads the
// same entries: constant-cache broadcasts.
template <typename TableT, typename C>
PIPEGOOSE_MT_HD int find_tensor(const TableT& table, int from, int n_tensors, C c) {
  int lo = from, hi = n_tensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (table.chunk_start[mid] <= c) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// A block's contiguous range of chunks [first, stop) when `grid` blocks split a launch's n_chunks (grid <= n_chunks):
// the first n_chunks % grid blocks take one chunk more (clip_grad_norm.cu).
struct ChunkRange {
  int64_t first, stop;
};
PIPEGOOSE_MT_HD ChunkRange chunk_range(int64_t n_chunks, int64_t grid, int64_t block) {
  const int64_t per = n_chunks / grid, extra = n_chunks % grid;
  const int64_t first = block * per + (block < extra ? block : extra);
  return {first, first + per + (block < extra ? 1 : 0)};
}

// The tensor of chunk c on a contiguous walk, t the tensor of the walk's previous chunk (or of its first, from
// find_tensor): t itself or a later one, one table read a tensor passed. c < chunk_start[n_tensors] keeps t below
// n_tensors.
template <typename TableT, typename C>
PIPEGOOSE_MT_HD int next_tensor(const TableT& table, int t, C c) {
  while (table.chunk_start[t + 1] <= c) ++t;
  return t;
}

inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// One launch: its table, how many tensors it holds and how many chunks they make.
template <typename TableT>
struct Launch {
  TableT table;
  int count = 0;
  int64_t chunks = 0;
};

// The launches that cover lists (kLists lists of equal lengths whose i-th tensors have equal sizes, as checked by
// the caller), in order, the empty tensors left out. Raises (before any launch: a refused list leaves every tensor
// as it was) if one tensor has more chunks than a launch counts. `op` and `name` (of lists[0]) name the tensor.
template <typename TableT>
std::vector<Launch<TableT>> plan(const char* op, const char* name,
                                 const std::array<at::TensorList, TableT::lists>& lists, int64_t elems_per_chunk) {
  using Chunk = typename TableT::chunk_type;
  constexpr int64_t kMaxChunks = std::numeric_limits<Chunk>::max();
  std::vector<Launch<TableT>> launches(1);
  const at::TensorList first = lists[0];
  for (size_t i = 0; i < first.size(); ++i) {
    const int64_t numel = first[i].numel();
    if (numel == 0) continue;
    const int64_t c = (numel + elems_per_chunk - 1) / elems_per_chunk;
    PG_CHECK(c <= kMaxChunks, op, ": ", name, "[", i, "] has ", numel, " elements, more than one launch covers (",
             elems_per_chunk, " * ", kMaxChunks, ")");
    if (launches.back().count == TableT::max_tensors || launches.back().chunks + c > kMaxChunks) {
      launches.emplace_back();
    }
    Launch<TableT>& l = launches.back();
    bool ok = true;
    for (int k = 0; k < TableT::lists; ++k) {
      l.table.ptr[k][l.count] = lists[k][i].data_ptr();
      ok = ok && aligned16(l.table.ptr[k][l.count]);
    }
    l.table.numel[l.count] = numel;
    l.table.aligned[l.count] = ok ? 1 : 0;
    l.table.chunk_start[l.count] = static_cast<Chunk>(l.chunks);
    l.chunks += c;
    ++l.count;
    l.table.chunk_start[l.count] = static_cast<Chunk>(l.chunks);
  }
  if (launches.back().count == 0) launches.pop_back();
  return launches;
}

// The first tensor of an op's lists (named `name`[0]): defined, float32, float16 or bfloat16, on a CUDA device.
// Returns its dtype.
inline at::ScalarType check_first(const char* op, const char* name, const at::Tensor& first) {
  PG_CHECK(first.defined(), op, ": ", name, "[0] is undefined");
  const at::ScalarType dtype = first.scalar_type();
  PG_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op, ": ", name,
           " must be float32, float16 or bfloat16, got ", dtype, " for ", name, "[0]");
  PG_CHECK(first.is_cuda(), op, ": ", name, "[0] must be a CUDA tensor, got device ", first.device());
  return dtype;
}

// Tensor `name`[i] against the first one (`first_name`[0], checked by check_first): defined, on its device, of its
// dtype, contiguous.
inline void check_like_first(const char* op, const char* name, size_t i, const at::Tensor& x, const char* first_name,
                             const at::Tensor& first) {
  PG_CHECK(x.defined(), op, ": ", name, "[", i, "] is undefined");
  PG_CHECK(x.device() == first.device(), op, ": ", name, "[", i, "] is on ", x.device(), " but ", first_name,
           "[0] is on ", first.device(), "; expected one CUDA device");
  PG_CHECK(x.scalar_type() == first.scalar_type(), op, ": ", name, "[", i, "] is ", x.scalar_type(), " but ",
           first_name, "[0] is ", first.scalar_type(), "; the kernel takes one dtype for every tensor");
  PG_CHECK(x.is_contiguous(), op, ": ", name, "[", i, "] must be contiguous, got strides ", x.strides(),
           " for sizes ", x.sizes());
}

}  // namespace multi_tensor
}  // namespace pipegoose
