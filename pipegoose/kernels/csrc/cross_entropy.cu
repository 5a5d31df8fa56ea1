// Softmax cross-entropy over class logits, forward and backward, for fp32, fp16 and bf16 logits with fp32 math.
// Written for pipegoose; ops pipegoose::cross_entropy_forward / cross_entropy_backward (binding:
// pipegoose/kernels/bindings/cross_entropy.cpp; schemas: docs/architecture.md "Op schemas").
//
// cross_entropy_forward(logits [N, V], target [N] int64, ignore_index) -> (loss [N] fp32, lse [N] fp32):
//     lse_i = log(sum_j exp(x_ij)), loss_i = lse_i - x_i[target_i]; a row whose target is ignore_index gets loss 0
//     (and lse 0). A target outside [0, V) that is not ignore_index gives loss NaN (PyTorch's kernel stops the
//     process with a device-side assert there; a check on the host would cost a synchronisation per call).
// cross_entropy_backward(grad_loss [N] fp32, logits, target, lse, ignore_index) -> grad_logits [N, V]:
//     dx_ij = grad_loss_i * (exp(x_ij - lse_i) - [j == target_i]), rounded once to the logits' dtype; ignored rows
//     get zeros, out-of-range targets NaN.
// The math is F.cross_entropy(logits.float(), target, reduction="none")'s (what transformers' loss computes after
// upcasting the logits), without an fp32 copy of the logits: the forward reads them once (an online softmax: the row's
// running maximum and the sum of exponentials rescaled when the maximum grows, as in flash attention), the backward
// reads them once and writes the gradient once.
//
// One block per row. Rows whose start is 16-byte aligned take 16-byte vectors (4 fp32 or 8 16-bit values), the rest
// and the tail of a row scalar loads. logits: last dim contiguous, rows at any stride (a [B, S, V] output's view);
// offsets are 64-bit. Errors (RuntimeError naming the argument): not CUDA, devices differ, logits not 2-D or not
// fp32/fp16/bf16 or its last dim not contiguous, target not 1-D int64 of N elements, grad_loss / lse not [N], lse not
// fp32 (grad_loss of another dtype is converted to fp32).
// Precision: the loss is (max - x_t) + log(sum of exp(x - max)), accurate at any logit size; the backward's
// exp(x - lse) carries lse's fp32 rounding, a relative error of about 2^-24 * |lse| in each probability (6e-6 at logits
// of 100, 6e-4 at 1e4), as every kernel that keeps the log-sum-exp in fp32 for the backward.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#include "pipegoose_check.h"

namespace pipegoose {
namespace {

// Benchmark experiments (the build without them is what ships): -DPIPEGOOSE_CE_THREADS=N threads per block,
// -DPIPEGOOSE_CE_UNROLL=U vectors a thread loads before it computes, in the forward.
#ifndef PIPEGOOSE_CE_THREADS
#define PIPEGOOSE_CE_THREADS 512
#endif
#ifndef PIPEGOOSE_CE_UNROLL
#define PIPEGOOSE_CE_UNROLL 4
#endif
constexpr int kThreads = PIPEGOOSE_CE_THREADS;
constexpr int kUnroll = PIPEGOOSE_CE_UNROLL;
constexpr int kWarps = kThreads / 32;
constexpr float kLog2e = 1.4426950408889634f;

template <typename T> __device__ __forceinline__ float to_f(T x) { return static_cast<float>(x); }

// The running (maximum, sum of exp(x - maximum)) of a thread or warp, merged with another.
struct MaxSum {
  float m, s;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};   // both empty (or every value -inf): no NaN from -inf - -inf
  return {m, a.s * exp2f((a.m - m) * kLog2e) + b.s * exp2f((b.m - m) * kLog2e)};
}

// Adds the values of one chunk (their maximum cm) to a running pair.
template <int K>
__device__ __forceinline__ void add_chunk(MaxSum& r, const float (&x)[K]) {
  float cm = x[0];
#pragma unroll
  for (int e = 1; e < K; ++e) cm = fmaxf(cm, x[e]);
  const float m = fmaxf(r.m, cm);
  if (m == -INFINITY) return;   // -inf values only: nothing to add yet
  float s = r.s * exp2f((r.m - m) * kLog2e);
#pragma unroll
  for (int e = 0; e < K; ++e) s += exp2f((x[e] - m) * kLog2e);
  r = {m, s};
}

// The block's merged pair, returned to every thread.
__device__ __forceinline__ MaxSum block_reduce(MaxSum r) {
  __shared__ float sm[kWarps], ss[kWarps];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    MaxSum o{__shfl_xor_sync(0xffffffffu, r.m, off), __shfl_xor_sync(0xffffffffu, r.s, off)};
    r = merge(r, o);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    sm[warp] = r.m;
    ss[warp] = r.s;
  }
  __syncthreads();
  r = {lane < kWarps ? sm[lane] : -INFINITY, lane < kWarps ? ss[lane] : 0.f};
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    MaxSum o{__shfl_xor_sync(0xffffffffu, r.m, off), __shfl_xor_sync(0xffffffffu, r.s, off)};
    r = merge(r, o);
  }
  return r;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) ce_fwd_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t V,
                                                          const int64_t* __restrict__ target, int64_t ignore_index,
                                                          float* __restrict__ loss, float* __restrict__ lse) {
  constexpr int VEC = 16 / sizeof(T);
  const int64_t row = blockIdx.x;
  const int64_t t = target[row];
  if (t == ignore_index) {   // the whole block leaves: no barrier is reached
    if (threadIdx.x == 0) {
      loss[row] = 0.f;
      lse[row] = 0.f;
    }
    return;
  }
  const T* x = logits + row * row_stride;
  MaxSum r{-INFINITY, 0.f};
  int64_t done = 0;
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    const int64_t nvec = V / VEC;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    int64_t i = threadIdx.x;
    for (; i + (kUnroll - 1) * kThreads < nvec; i += kUnroll * kThreads) {   // kUnroll vectors in flight per thread
      float4 a[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) a[k] = x4[i + k * kThreads];
      float v[kUnroll * VEC];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const T* ea = reinterpret_cast<const T*>(&a[k]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) v[k * VEC + e] = to_f<T>(ea[e]);
      }
      add_chunk(r, v);
    }
    for (; i < nvec; i += kThreads) {
      const float4 a = x4[i];
      const T* ea = reinterpret_cast<const T*>(&a);
      float v[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) v[e] = to_f<T>(ea[e]);
      add_chunk(r, v);
    }
    done = nvec * VEC;
  }
  for (int64_t j = done + threadIdx.x; j < V; j += kThreads) {
    const float v[1] = {to_f<T>(x[j])};
    add_chunk(r, v);
  }
  r = block_reduce(r);
  if (threadIdx.x == 0) {
    const float log_s = logf(r.s);
    lse[row] = r.m + log_s;
    // (max - x_t) + log(sum): exact where x_t is near the maximum, where lse - x_t would lose lse's low bits
    loss[row] = (t >= 0 && t < V) ? (r.m - to_f<T>(x[t])) + log_s : NAN;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) ce_bwd_kernel(const float* __restrict__ grad_loss, const T* __restrict__ logits,
                                                          int64_t row_stride, int64_t V,
                                                          const int64_t* __restrict__ target, int64_t ignore_index,
                                                          const float* __restrict__ lse, T* __restrict__ grad) {
  constexpr int VEC = 16 / sizeof(T);
  const int64_t row = blockIdx.x;
  const int64_t t = target[row];
  const T* x = logits + row * row_stride;
  T* dx = grad + row * V;
  const bool ignored = t == ignore_index;
  const float g = ignored ? 0.f : grad_loss[row];
  const float l = ignored ? 0.f : lse[row];
  const bool bad = !ignored && !(t >= 0 && t < V);
  // dx = g * exp(x - l) - g * [j == t]; x - l first (l * log2e overflows for logits past 2.4e38)
  auto value = [&](float xv, int64_t j) -> float {
    if (ignored) return 0.f;
    if (bad) return NAN;
    const float p = exp2f((xv - l) * kLog2e);
    return g * p - (j == t ? g : 0.f);
  };
  int64_t done = 0;
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(dx) % 16 == 0) {
    const int64_t nvec = V / VEC;
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float4* d4 = reinterpret_cast<float4*>(dx);
    for (int64_t i = threadIdx.x; i < nvec; i += kThreads) {
      const float4 a = ignored ? make_float4(0.f, 0.f, 0.f, 0.f) : x4[i];
      const T* ea = reinterpret_cast<const T*>(&a);
      float4 o;
      T* eo = reinterpret_cast<T*>(&o);
#pragma unroll
      for (int e = 0; e < VEC; ++e) eo[e] = static_cast<T>(value(to_f<T>(ea[e]), i * VEC + e));
      d4[i] = o;
    }
    done = nvec * VEC;
  }
  for (int64_t j = done + threadIdx.x; j < V; j += kThreads) {
    dx[j] = static_cast<T>(value(ignored ? 0.f : to_f<T>(x[j]), j));
  }
}


void check_logits_target(const char* op, const at::Tensor& logits, const at::Tensor& target) {
  PG_CHECK(logits.defined() && target.defined(), op, ": logits and target must be defined tensors");
  PG_CHECK(logits.is_cuda(), op, ": logits must be a CUDA tensor, got device ", logits.device());
  PG_CHECK(target.device() == logits.device(), op, ": target is on ", target.device(), " but logits is on ",
           logits.device());
  const auto dt = logits.scalar_type();
  PG_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op,
           ": logits must be float32, float16 or bfloat16, got ", dt);
  PG_CHECK(logits.dim() == 2, op, ": logits must be 2-D [N, V], got shape ", logits.sizes());
  PG_CHECK(logits.size(1) >= 1, op, ": logits must have at least one class, got shape ", logits.sizes());
  PG_CHECK(logits.size(1) == 1 || logits.stride(1) == 1, op, ": logits' last dim must be contiguous, got strides ",
           logits.strides());
  PG_CHECK(target.scalar_type() == at::kLong, op, ": target must be int64 class indices, got ", target.scalar_type());
  PG_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), op, ": target must be 1-D with ", logits.size(0),
           " elements (logits' rows), got shape ", target.sizes());
  PG_CHECK(logits.size(0) <= INT32_MAX, op, ": ", logits.size(0), " rows are more than one launch covers");
}

const char* kFwd = "pipegoose::cross_entropy_forward";
const char* kBwd = "pipegoose::cross_entropy_backward";

}  // namespace

std::tuple<at::Tensor, at::Tensor> cross_entropy_forward_cuda(const at::Tensor& logits, const at::Tensor& target_in,
                                                              int64_t ignore_index) {
  check_logits_target(kFwd, logits, target_in);
  const int64_t n = logits.size(0), v = logits.size(1);
  const auto fopts = logits.options().dtype(at::kFloat);
  at::Tensor loss = at::empty({n}, fopts), lse = at::empty({n}, fopts);
  if (n == 0) return {loss, lse};
  const at::Tensor target = target_in.contiguous();
  const int64_t stride = logits.stride(0);   // (0 for rows expanded from one)
  c10::cuda::CUDAGuard guard(logits.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  by_dtype(logits.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    ce_fwd_kernel<T><<<static_cast<unsigned>(n), kThreads, 0, stream>>>(
        logits.const_data_ptr<T>(), stride, v, target.const_data_ptr<int64_t>(), ignore_index,
        loss.mutable_data_ptr<float>(), lse.mutable_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {loss, lse};
}

at::Tensor cross_entropy_backward_cuda(const at::Tensor& grad_loss_in, const at::Tensor& logits,
                                       const at::Tensor& target_in, const at::Tensor& lse_in, int64_t ignore_index) {
  check_logits_target(kBwd, logits, target_in);
  const int64_t n = logits.size(0), v = logits.size(1);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"grad_loss", &grad_loss_in}, {"lse", &lse_in}}) {
    PG_CHECK(t->defined() && t->device() == logits.device(), kBwd, ": ", name, " must be a tensor on logits' device");
    PG_CHECK(t->dim() == 1 && t->size(0) == n, kBwd, ": ", name, " must be 1-D with ", n, " elements, got shape ",
             t->sizes());
  }
  PG_CHECK(lse_in.scalar_type() == at::kFloat, kBwd, ": lse must be float32, got ", lse_in.scalar_type());
  at::Tensor grad = at::empty({n, v}, logits.options().memory_format(at::MemoryFormat::Contiguous));
  if (n == 0) return grad;
  const at::Tensor target = target_in.contiguous(), lse = lse_in.contiguous();
  const at::Tensor gl = grad_loss_in.to(at::kFloat).contiguous();
  const int64_t stride = logits.stride(0);
  c10::cuda::CUDAGuard guard(logits.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  by_dtype(logits.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    ce_bwd_kernel<T><<<static_cast<unsigned>(n), kThreads, 0, stream>>>(
        gl.const_data_ptr<float>(), logits.const_data_ptr<T>(), stride, v, target.const_data_ptr<int64_t>(),
        ignore_index, lse.const_data_ptr<float>(), grad.mutable_data_ptr<T>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return grad;
}

}  // namespace pipegoose
