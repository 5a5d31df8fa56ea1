// Gradient clipping's two passes over many tensors, for fp32, fp16 and bf16: the total norm of a list of tensors
// (L1, L2 or max), and the in-place multiplication by a coefficient that is read on the device. Written for
// pipegoose; ops pipegoose::multi_tensor_norm and pipegoose::multi_tensor_mul_ (binding:
// pipegoose/kernels/bindings/clip_grad_norm.cpp; schemas: docs/architecture.md "Op schemas").
//
// Both walk the tensors of a launch as one sequence of chunks (kThreads * kUnroll 16-byte vectors: 4096 fp32 or 8192
// 16-bit elements; a tensor's last chunk may be shorter). The tensors' pointers, sizes and chunk count prefix sums
// travel in the kernel's parameter block (Table, about 25 KB; pipegoose_multi_tensor.cuh), so there is no
// host-to-device copy and no host sync. A launch has a fixed number of blocks (the resident blocks of all SMs, at most
// the chunk count); each block walks one contiguous range of chunks (the blocks' ranges differ by at most one chunk),
// finds its first chunk's tensor by a binary search over the prefix sums (multi_tensor::find_tensor) and then steps
// to the next tensor with one table read a chunk. (Blocks that took chunks b, b + grid, ..., with a binary search a
// chunk, read at half the speed: the norm of 1e9 bf16 or fp32 gradients in 171 tensors at 1.43-1.46 TB/s against
// 2.90-3.05 TB/s, on an H100, session 56; that walk's switch is gone since session 57.) A list of more than
// kMaxTensors tensors takes several launches. A tensor whose pointer is not 16-byte aligned (a view at an odd offset
// into a flat buffer) takes the scalar path, as does the tail of a tensor that is not a whole number of vectors.
// Offsets are 64-bit.
//
// Norm (multi_tensor_norm): each thread accumulates |x| (L1), x * x (L2) or max |x| (inf; nan wins, as in torch) in
// fp32, in kUnroll independent accumulators; the block combines them and writes one partial per block. One more
// launch of one block combines the partials of every launch in fp64, in a fixed order, and writes the norm (the
// square root for L2) as a float32 scalar. No atomics: the same input gives the same bits on the same GPU. As in
// torch's _foreach_norm, squares accumulate in fp32: an element above about 1.8e19 in magnitude gives an infinite
// L2 norm.
// Scale (multi_tensor_mul_): every block reads the float32 coefficient first and returns when it is exactly 1
// (x * 1 == x for every x, nan and inf included), so that a clipping step whose gradients are already within
// max_norm reads and writes nothing. Otherwise each element becomes x * coef, computed in fp32 and rounded once to
// the tensor's dtype (torch's _foreach_mul_ with a tensor computes in fp32 too). Loads and stores are streaming
// (__ldcs / __stcs): each byte is touched once. The norm's loads are not: with gradients that fit in L2, the scale
// pass that follows finds them there.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "pipegoose_check.h"
#include "pipegoose_multi_tensor.cuh"
#include "pipegoose_occupancy.h"

namespace pipegoose {
namespace {

constexpr const char* kNormOp = "pipegoose::multi_tensor_norm";
constexpr const char* kMulOp = "pipegoose::multi_tensor_mul_";

// Benchmark experiments (the build without them is what ships): -DPIPEGOOSE_CLIP_THREADS=N threads per block,
// -DPIPEGOOSE_CLIP_UNROLL=U 16-byte vectors per thread and chunk, -DPIPEGOOSE_CLIP_MINB=B the launch bounds' minimum
// blocks per SM (0: none; with the contiguous walk the norm kernel takes 37-38 registers and the scaling kernel 37-40,
// ptxas for sm_90: 6 blocks of 256 per SM).
#ifndef PIPEGOOSE_CLIP_THREADS
#define PIPEGOOSE_CLIP_THREADS 256
#endif
#ifndef PIPEGOOSE_CLIP_UNROLL
#define PIPEGOOSE_CLIP_UNROLL 4
#endif
#ifndef PIPEGOOSE_CLIP_MINB
#define PIPEGOOSE_CLIP_MINB 0
#endif
constexpr int kThreads = PIPEGOOSE_CLIP_THREADS;
constexpr int kUnroll = PIPEGOOSE_CLIP_UNROLL;   // 16-byte vectors per thread and chunk
constexpr int kMinBlocks = PIPEGOOSE_CLIP_MINB;
constexpr int kFinalThreads = 512;  // the one block that combines the partials
constexpr int kMaxTensors = 1024;   // tensors per launch: 1024 * 25 + 8 bytes of table
template <typename T> constexpr int64_t kChunkElems = static_cast<int64_t>(kThreads) * kUnroll * (16 / sizeof(T));
// the chunk of a dtype: 4096 fp32, 8192 fp16 or bf16 elements
int64_t chunk_elems(at::ScalarType dtype) { return dtype == at::kFloat ? kChunkElems<float> : kChunkElems<at::Half>; }

// one list; blocks walk the chunks, so chunks are counted in int64
using Table = multi_tensor::Table<1, kMaxTensors, int64_t>;
static_assert(sizeof(Table) + sizeof(int) + sizeof(int64_t) + sizeof(void*) <= 32764,
              "the kernels' parameters exceed 32764 bytes");

enum NormKind : int { kL1 = 0, kL2 = 1, kMax = 2 };


template <typename T> __device__ __forceinline__ float to_f(T x) { return static_cast<float>(x); }

// max that keeps a nan from either side (fmaxf drops it): one max.NaN instruction on sm_80 and later (the generic
// form is four: two compares, an or and a select per element of the inf norm)
template <typename F> __device__ __forceinline__ F nan_max(F a, F b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<F, float>) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
  }
#endif
  return (a > b || a != a) ? a : b;
}

template <int K> __device__ __forceinline__ float accumulate(float acc, float x) {
  if constexpr (K == kL2) {
    return fmaf(x, x, acc);
  } else if constexpr (K == kL1) {
    return acc + fabsf(x);
  } else {
    return nan_max(acc, fabsf(x));
  }
}

template <int K, typename F> __device__ __forceinline__ F combine(F a, F b) {
  if constexpr (K == kMax) {
    return nan_max(a, b);
  } else {
    return a + b;
  }
}

// The combination of v over the block (every thread passes its value; thread 0 gets the result). fp32 or fp64.
// Called once per kernel: a second call would need a __syncthreads() before its writes to warp_vals.
template <int K, int kBlock, typename F> __device__ __forceinline__ F block_combine(F v) {
  static_assert(kBlock % 32 == 0 && kBlock <= 1024, "whole warps");
  __shared__ F warp_vals[kBlock / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = combine<K>(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_vals[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kBlock / 32 ? warp_vals[lane] : F(0);   // 0 is the identity of +, and of max over |x| >= 0
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = combine<K>(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  return v;
}

template <typename T, int K>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    norm_kernel(const __grid_constant__ Table table, int n_tensors, int64_t n_chunks, float* __restrict__ partials) {
  constexpr int V = 16 / sizeof(T);
  float acc[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) acc[u] = 0.f;
  // the block's contiguous range of chunks: its first chunk's tensor by a search, each next one's by a table read
  const multi_tensor::ChunkRange r = multi_tensor::chunk_range(n_chunks, gridDim.x, blockIdx.x);
  int t = multi_tensor::find_tensor(table, 0, n_tensors, r.first);
  for (int64_t c = r.first; c < r.stop; ++c) {
    t = multi_tensor::next_tensor(table, t, c);
    const int64_t begin = (c - table.chunk_start[t]) * kChunkElems<T>;
    const int64_t end = min(table.numel[t], begin + kChunkElems<T>);
    const T* x = static_cast<const T*>(table.ptr[0][t]);
    int64_t scalar_from = begin;
    if (table.aligned[t]) {
      const int64_t full_vecs = (end - begin) / V;
      const float4* x4 = reinterpret_cast<const float4*>(x + begin);
      float4 r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t k = threadIdx.x + static_cast<int64_t>(u) * kThreads;
        if (k < full_vecs) r[u] = x4[k];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t k = threadIdx.x + static_cast<int64_t>(u) * kThreads;
        if (k < full_vecs) {
          const T* e = reinterpret_cast<const T*>(&r[u]);
#pragma unroll
          for (int j = 0; j < V; ++j) acc[u] = accumulate<K>(acc[u], to_f<T>(e[j]));
        }
      }
      scalar_from = begin + full_vecs * V;
    }
    // the scalar path (a misaligned tensor's chunk, a tensor's tail): kUnroll loads in flight, then the sums
    for (int64_t i = scalar_from + threadIdx.x; i < end; i += kThreads * kUnroll) {
      float v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = i + static_cast<int64_t>(u) * kThreads;
        if (j < end) v[u] = to_f<T>(x[j]);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (i + static_cast<int64_t>(u) * kThreads < end) acc[u] = accumulate<K>(acc[u], v[u]);
      }
    }
  }
  float a = acc[0];
#pragma unroll
  for (int u = 1; u < kUnroll; ++u) a = combine<K>(a, acc[u]);
  a = block_combine<K, kThreads>(a);
  if (threadIdx.x == 0) partials[blockIdx.x] = a;
}

template <int K>
__global__ void __launch_bounds__(kFinalThreads)
    finalize_kernel(const float* __restrict__ partials, int64_t n, float* __restrict__ out) {
  double a = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kFinalThreads) a = combine<K>(a, static_cast<double>(partials[i]));
  a = block_combine<K, kFinalThreads>(a);
  if (threadIdx.x == 0) out[0] = static_cast<float>(K == kL2 ? sqrt(a) : a);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    mul_kernel(const __grid_constant__ Table table, int n_tensors, int64_t n_chunks, const float* __restrict__ coef) {
  const float s = *coef;
  if (s == 1.f) return;   // x * 1 == x: nothing to read or write
  constexpr int V = 16 / sizeof(T);
  // the block's contiguous range of chunks: its first chunk's tensor by a search, each next one's by a table read
  const multi_tensor::ChunkRange r = multi_tensor::chunk_range(n_chunks, gridDim.x, blockIdx.x);
  int t = multi_tensor::find_tensor(table, 0, n_tensors, r.first);
  for (int64_t c = r.first; c < r.stop; ++c) {
    t = multi_tensor::next_tensor(table, t, c);
    const int64_t begin = (c - table.chunk_start[t]) * kChunkElems<T>;
    const int64_t end = min(table.numel[t], begin + kChunkElems<T>);
    T* x = static_cast<T*>(table.ptr[0][t]);
    int64_t scalar_from = begin;
    if (table.aligned[t]) {
      const int64_t full_vecs = (end - begin) / V;
      float4* x4 = reinterpret_cast<float4*>(x + begin);
      float4 r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t k = threadIdx.x + static_cast<int64_t>(u) * kThreads;
        if (k < full_vecs) r[u] = __ldcs(x4 + k);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t k = threadIdx.x + static_cast<int64_t>(u) * kThreads;
        if (k < full_vecs) {
          T* e = reinterpret_cast<T*>(&r[u]);
#pragma unroll
          for (int j = 0; j < V; ++j) e[j] = static_cast<T>(to_f<T>(e[j]) * s);
          __stcs(x4 + k, r[u]);
        }
      }
      scalar_from = begin + full_vecs * V;
    }
    for (int64_t i = scalar_from + threadIdx.x; i < end; i += kThreads * kUnroll) {   // loads first, as above
      T v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = i + static_cast<int64_t>(u) * kThreads;
        if (j < end) v[u] = x[j];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = i + static_cast<int64_t>(u) * kThreads;
        if (j < end) x[j] = static_cast<T>(to_f<T>(v[u]) * s);
      }
    }
  }
}

// The checks both ops make: a non-empty list of defined, contiguous CUDA tensors on one device, of one dtype among
// float32, float16 and bfloat16, whose memory does not overlap (the multiplication would scale a shared element a
// racy number of times; the norm would count it twice).
void check_tensors(const char* op, at::TensorList tensors) {
  PG_CHECK(!tensors.empty(), op, ": tensors must hold at least one tensor, got an empty list");
  const at::Tensor& first = tensors[0];
  multi_tensor::check_first(op, "tensors", first);
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;   // [begin, end) bytes of the non-empty tensors, with index
  std::vector<size_t> index;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& x = tensors[i];
    multi_tensor::check_like_first(op, "tensors", i, x, "tensors", first);
    if (x.numel() == 0) continue;
    const auto b = reinterpret_cast<uintptr_t>(x.data_ptr());
    spans.emplace_back(b, b + static_cast<uintptr_t>(x.numel()) * x.element_size());
    index.push_back(i);
  }
  std::vector<size_t> order(spans.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return std::tie(spans[a], a) < std::tie(spans[b], b); });
  size_t reach = 0;   // the span ending last among those sorted so far
  for (size_t k = 1; k < order.size(); ++k) {
    if (spans[order[k - 1]].second > spans[order[reach]].second) reach = k - 1;
    const size_t prev = order[reach], cur = order[k];
    PG_CHECK(spans[cur].first >= spans[prev].second, op, ": tensors[", std::min(index[prev], index[cur]),
             "] and tensors[", std::max(index[prev], index[cur]),
             "] overlap in memory; expected distinct tensors (pass each gradient once)");
  }
}

using Launch = multi_tensor::Launch<Table>;

std::vector<Launch> plan(const char* op, at::TensorList tensors, int64_t elems_per_chunk) {
  return multi_tensor::plan<Table>(op, "tensors", {tensors}, elems_per_chunk);
}

int64_t grid_for(const void* kernel, int64_t chunks) {
  const int64_t resident = static_cast<int64_t>(sm_count()) * occupancy(kernel, kThreads, 0);
  return std::max<int64_t>(1, std::min(chunks, resident));
}

template <typename T, int K>
void norm_launches(const std::vector<Launch>& launches, float* out, const at::Tensor& like, cudaStream_t stream) {
  const void* kernel = reinterpret_cast<const void*>(&norm_kernel<T, K>);
  std::vector<int64_t> grids;
  int64_t n_partials = 0;
  for (const Launch& l : launches) {
    grids.push_back(grid_for(kernel, l.chunks));
    n_partials += grids.back();
  }
  at::Tensor partials = at::empty({n_partials}, like.options().dtype(at::kFloat));
  float* p = partials.data_ptr<float>();
  for (size_t i = 0; i < launches.size(); ++i) {
    norm_kernel<T, K><<<static_cast<unsigned>(grids[i]), kThreads, 0, stream>>>(launches[i].table, launches[i].count,
                                                                                launches[i].chunks, p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    p += grids[i];
  }
  finalize_kernel<K><<<1, kFinalThreads, 0, stream>>>(partials.data_ptr<float>(), n_partials, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void norm_by_kind(int kind, const std::vector<Launch>& launches, float* out, const at::Tensor& like,
                  cudaStream_t stream) {
  if (kind == kL2) {
    norm_launches<T, kL2>(launches, out, like, stream);
  } else if (kind == kL1) {
    norm_launches<T, kL1>(launches, out, like, stream);
  } else {
    norm_launches<T, kMax>(launches, out, like, stream);
  }
}

}  // namespace

at::Tensor multi_tensor_norm_cuda(at::TensorList tensors, double norm_type) {
  check_tensors(kNormOp, tensors);
  int kind = -1;
  if (norm_type == 2.0) {
    kind = kL2;
  } else if (norm_type == 1.0) {
    kind = kL1;
  } else if (std::isinf(norm_type) && norm_type > 0) {
    kind = kMax;
  }
  PG_CHECK(kind >= 0, kNormOp, ": norm_type must be 1, 2 or inf, got ", norm_type);
  const at::Tensor& first = tensors[0];
  c10::cuda::CUDAGuard guard(first.device());
  at::Tensor out = at::empty({}, first.options().dtype(at::kFloat));
  const at::ScalarType dtype = first.scalar_type();
  const std::vector<Launch> launches = plan(kNormOp, tensors, chunk_elems(dtype));
  if (launches.empty()) return out.zero_();   // only empty tensors: the norm is 0
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  by_dtype(dtype, [&](auto tag) {
    norm_by_kind<decltype(tag)>(kind, launches, out.data_ptr<float>(), first, stream);
  });
  return out;
}

void multi_tensor_mul_cuda(at::TensorList tensors, const at::Tensor& coef) {
  check_tensors(kMulOp, tensors);
  const at::Tensor& first = tensors[0];
  PG_CHECK(coef.defined() && coef.numel() == 1 && coef.scalar_type() == at::kFloat, kMulOp,
           ": coef must be a float32 tensor of one element, got ",
           coef.defined() ? c10::toString(coef.scalar_type()) : "an undefined tensor", " with ",
           coef.defined() ? coef.numel() : 0, " elements");
  PG_CHECK(coef.device() == first.device(), kMulOp, ": coef is on ", coef.device(), " but tensors[0] is on ",
           first.device(), "; expected the tensors' device");
  const auto c_begin = reinterpret_cast<uintptr_t>(coef.data_ptr());
  for (size_t i = 0; i < tensors.size(); ++i) {   // the kernel reads coef while it writes the tensors
    const auto b = reinterpret_cast<uintptr_t>(tensors[i].data_ptr());
    const auto e = b + static_cast<uintptr_t>(tensors[i].numel()) * tensors[i].element_size();
    PG_CHECK(tensors[i].numel() == 0 || c_begin + sizeof(float) <= b || c_begin >= e, kMulOp, ": coef lies in tensors[",
             i, "]; expected a tensor of its own (the kernel reads it while it scales the tensors)");
  }
  c10::cuda::CUDAGuard guard(first.device());
  const at::ScalarType dtype = first.scalar_type();
  const std::vector<Launch> launches = plan(kMulOp, tensors, chunk_elems(dtype));
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float* c = coef.data_ptr<float>();
  by_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    const void* kernel = reinterpret_cast<const void*>(&mul_kernel<T>);
    for (const Launch& l : launches) {
      mul_kernel<T><<<static_cast<unsigned>(grid_for(kernel, l.chunks)), kThreads, 0, stream>>>(l.table, l.count,
                                                                                                 l.chunks, c);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

}  // namespace pipegoose
