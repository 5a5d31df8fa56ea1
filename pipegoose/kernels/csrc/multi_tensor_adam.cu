// Multi-tensor Adam / AdamW step for fp32, fp16 and bf16 tensors with fp32 math. Written for pipegoose; op
// pipegoose::adam_step (binding: pipegoose/kernels/bindings/adam_step.cpp; schema: docs/architecture.md "Op schemas").
//
// One launch updates many tensors: their pointers, sizes and the prefix sums of their chunk counts travel in the
// kernel's parameter block (TensorTable, about 17 KB; pipegoose_multi_tensor.cuh), so no host-to-device copy is
// needed and the step stays asynchronous. A list longer than kMaxTensors tensors takes several launches. Block b
// finds its tensor by a binary search over the prefix sums (multi_tensor::find_tensor) and updates one chunk (4096
// fp32 or 2048 16-bit elements).
// Each thread loads all of its vectors of the four tensors (grad, param, exp_avg, exp_avg_sq) before it computes,
// so that 4 * kUnroll loads are in flight per thread. A tensor whose four pointers are not all 16-byte aligned (a
// view into a flat buffer at an odd offset) takes the scalar path, with the same math; the tail of a tensor that is
// not a whole number of vectors does too. Offsets are 64-bit. Loads and stores are streaming (__ldcs / __stcs):
// every byte is touched once.
//
// The math, per element, in fp32 from the stored values (each stored value rounded once):
//   L2 (adam_w_mode false): g += weight_decay * p (where weight_decay != 0)
//   m = beta1 * m + (1 - beta1) * g;  v = beta2 * v + (1 - beta2) * g * g
//   AdamW (adam_w_mode true): p *= 1 - lr * weight_decay
//   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps),  bc = 1 - beta ** step (1 without bias correction)
// which is torch.optim.Adam / AdamW's update (torch._fused_adam_ / _fused_adamw_ do the same in fp32). fp32 tensors
// take the correctly rounded square root and division; 16-bit ones approximate ones of 2^-23 and 2 ulp (sqrt_approx,
// div_full below), whose error the rounding to 16 bits hides.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "pipegoose_check.h"
#include "pipegoose_multi_tensor.cuh"

namespace pipegoose {
namespace {

constexpr const char* kOp = "pipegoose::adam_step";
// Benchmark experiments (the build without them is what ships): -DPIPEGOOSE_ADAM_THREADS=N threads per block,
// -DPIPEGOOSE_ADAM_UNROLL32=U / -DPIPEGOOSE_ADAM_UNROLL16=U vectors per thread and tensor, -DPIPEGOOSE_ADAM_MINB32=B /
// -DPIPEGOOSE_ADAM_MINB16=B the launch bounds' minimum blocks per SM.
//
// Measured (H200, session 46, benchmarks/results/nvidia_h200_2026-11-30/session46.log calls 4-6; AdamW over 976M
// parameters, % of copy): the 16-bit step is bound by instruction issue, not by memory. --use_fast_math (approximate
// division and square root, denormals flushed) took it from 84% to 97-99% in both calls that timed it; not shipped
// (flushing subnormals changes values). Session 47: the approximate square root and division alone, subnormals kept,
// for 16-bit tensors (shipped, see sqrt_approx). Launch geometry moved it little: 83-88% at two or four vectors per thread, 128 or 256 threads, two or
// four blocks per SM (one vector and four blocks timed 98% once, in call 4, and 83% twice in calls 5 and 6, where
// its bf16 SASS is that of the shipped build). fp32 ran at 95-98% in every geometry tried.
#ifndef PIPEGOOSE_ADAM_THREADS
#define PIPEGOOSE_ADAM_THREADS 256
#endif
#ifndef PIPEGOOSE_ADAM_UNROLL32
#define PIPEGOOSE_ADAM_UNROLL32 4
#endif
#ifndef PIPEGOOSE_ADAM_UNROLL16
#define PIPEGOOSE_ADAM_UNROLL16 1
#endif
#ifndef PIPEGOOSE_ADAM_MINB32
#define PIPEGOOSE_ADAM_MINB32 2
#endif
#ifndef PIPEGOOSE_ADAM_MINB16
#define PIPEGOOSE_ADAM_MINB16 4
#endif
constexpr int kThreads = PIPEGOOSE_ADAM_THREADS;
// 16-byte vectors per thread and tensor in one chunk (4 fp32 or 8 16-bit values each) and the blocks per SM the
// register budget allows: fp32 4 vectors, 2 blocks (a chunk of 4096 elements); 16-bit 1 vector, 4 blocks (2048;
// the GPU tests and the sanitizers ran on this geometry)
template <typename T> constexpr int kUnroll = sizeof(T) == 4 ? PIPEGOOSE_ADAM_UNROLL32 : PIPEGOOSE_ADAM_UNROLL16;
template <typename T> constexpr int kMinBlocks = sizeof(T) == 4 ? PIPEGOOSE_ADAM_MINB32 : PIPEGOOSE_ADAM_MINB16;
template <typename T> constexpr int64_t kChunkElems = static_cast<int64_t>(kThreads) * kUnroll<T> * (16 / sizeof(T));
constexpr int kMaxTensors = 384;                      // tensors per launch: 384 * 45 + 4 bytes of table

// lists grad, param, exp_avg, exp_avg_sq; block b updates chunk b, so chunks are counted in int32 (a grid size)
using TensorTable = multi_tensor::Table<4, kMaxTensors, int32_t>;

struct Hyper {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, inv_bc2_sqrt, decay, weight_decay;
  bool adam_w;
};

// c10's Half and BFloat16 convert to and from float on the device (round to nearest even)
template <typename T> __device__ __forceinline__ float to_f(T x) { return static_cast<float>(x); }
template <typename T> __device__ __forceinline__ T from_f(float x) { return static_cast<T>(x); }

// The 16-bit step's square root and division: PTX sqrt.approx.f32 (relative error 2^-23) and div.full.f32 (2 ulp
// over the full range), subnormals kept (no .ftz): what -prec-sqrt=false -prec-div=false emit. Their error is far
// below the 2^-9 (bf16) or 2^-12 (fp16) of the rounding that stores each value, and the correctly rounded
// instructions made the 16-bit step bound by instruction issue: AdamW over 976M bf16 parameters ran at 80.5% of
// copy, with these at 97.4% (H200, session 47 call 2, .gpu/adam_var.py; fp32 96.2% either way, so fp32 keeps the
// correctly rounded ones).
__device__ __forceinline__ float sqrt_approx(float x) {
  float r;
  asm("sqrt.approx.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ float div_full(float a, float b) {
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

template <bool kApprox>
__device__ __forceinline__ void adam_math(const Hyper& h, float g, float& p, float& m, float& v) {
  if (!h.adam_w && h.weight_decay != 0.f) g = fmaf(h.weight_decay, p, g);   // as torch: no 0 * inf = nan
  m = fmaf(h.beta1, m, h.one_minus_beta1 * g);
  v = fmaf(h.beta2, v, h.one_minus_beta2 * g * g);
  const float denom = fmaf(kApprox ? sqrt_approx(v) : sqrtf(v), h.inv_bc2_sqrt, h.eps);
  if (h.adam_w) p *= h.decay;
  p -= h.step_size * (kApprox ? div_full(m, denom) : m / denom);
}

// 16-bit tensors take the approximate square root and division (above), fp32 the correctly rounded ones
template <typename T> constexpr bool kApproxMath = sizeof(T) == 2;

template <typename T>
__device__ __forceinline__ void scalar_update(const Hyper& h, T* g, T* p, T* m, T* v, int64_t i) {
  float pf = to_f<T>(p[i]), mf = to_f<T>(m[i]), vf = to_f<T>(v[i]);
  adam_math<kApproxMath<T>>(h, to_f<T>(g[i]), pf, mf, vf);
  p[i] = from_f<T>(pf);
  m[i] = from_f<T>(mf);
  v[i] = from_f<T>(vf);
}

template <typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocks<T>)
    adam_kernel(const __grid_constant__ TensorTable table, const Hyper h, int n_tensors) {
  constexpr int V = 16 / sizeof(T);   // elements per 16-byte vector
  const int32_t block = static_cast<int32_t>(blockIdx.x);
  const int t = multi_tensor::find_tensor(table, 0, n_tensors, block);
  const int64_t numel = table.numel[t];
  const int64_t chunk = block - table.chunk_start[t];
  const int64_t begin = chunk * kChunkElems<T>;   // first element of this chunk
  const int64_t end = min(numel, begin + kChunkElems<T>);
  T* g = static_cast<T*>(table.ptr[0][t]);
  T* p = static_cast<T*>(table.ptr[1][t]);
  T* m = static_cast<T*>(table.ptr[2][t]);
  T* v = static_cast<T*>(table.ptr[3][t]);
  if (!table.aligned[t]) {
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) scalar_update(h, g, p, m, v, i);
    return;
  }
  const int64_t full_vecs = (end - begin) / V;   // whole vectors in this chunk
  const float4* g4 = reinterpret_cast<const float4*>(g + begin);
  float4* p4 = reinterpret_cast<float4*>(p + begin);
  float4* m4 = reinterpret_cast<float4*>(m + begin);
  float4* v4 = reinterpret_cast<float4*>(v + begin);
  constexpr int U = kUnroll<T>;
  float4 rg[U], rp[U], rm[U], rv[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t k = threadIdx.x + static_cast<int64_t>(u) * kThreads;
    if (k < full_vecs) {
      rg[u] = __ldcs(g4 + k);
      rp[u] = __ldcs(p4 + k);
      rm[u] = __ldcs(m4 + k);
      rv[u] = __ldcs(v4 + k);
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int64_t k = threadIdx.x + static_cast<int64_t>(u) * kThreads;
    if (k < full_vecs) {
      T* eg = reinterpret_cast<T*>(&rg[u]);
      T* ep = reinterpret_cast<T*>(&rp[u]);
      T* em = reinterpret_cast<T*>(&rm[u]);
      T* ev = reinterpret_cast<T*>(&rv[u]);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        float pf = to_f<T>(ep[e]), mf = to_f<T>(em[e]), vf = to_f<T>(ev[e]);
        adam_math<kApproxMath<T>>(h, to_f<T>(eg[e]), pf, mf, vf);
        ep[e] = from_f<T>(pf);
        em[e] = from_f<T>(mf);
        ev[e] = from_f<T>(vf);
      }
      __stcs(p4 + k, rp[u]);
      __stcs(m4 + k, rm[u]);
      __stcs(v4 + k, rv[u]);
    }
  }
  // the tail of the tensor that is not a whole vector (only in its last chunk)
  for (int64_t i = begin + full_vecs * V + threadIdx.x; i < end; i += kThreads) scalar_update(h, g, p, m, v, i);
}

static_assert(sizeof(TensorTable) + sizeof(Hyper) + sizeof(int) <= 32764, "the kernel's parameters exceed 32764 bytes");

const char* kListNames[4] = {"grads", "params", "exp_avgs", "exp_avg_sqs"};

}  // namespace

void adam_step_cuda(at::TensorList grads, at::TensorList params, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, double lr, double beta1, double beta2, double eps, int64_t step,
                    bool adam_w_mode, bool bias_correction, double weight_decay) {
  const at::TensorList lists[4] = {grads, params, exp_avgs, exp_avg_sqs};
  const size_t n = grads.size();
  for (int l = 1; l < 4; ++l) {
    PG_CHECK(lists[l].size() == n, kOp, ": ", kListNames[l], " has ", lists[l].size(), " tensors but grads has ", n,
             "; the lists must have equal lengths");
  }
  for (auto [name, x] : {std::pair<const char*, double>{"lr", lr}, {"beta1", beta1}, {"beta2", beta2},
                         {"eps", eps}, {"weight_decay", weight_decay}}) {
    PG_CHECK(std::isfinite(x), kOp, ": ", name, " must be finite, got ", x);
  }
  PG_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1, kOp, ": beta1 and beta2 must be in [0, 1), got ",
           beta1, ", ", beta2);
  PG_CHECK(step >= 1 || !bias_correction, kOp, ": step must be >= 1 (it counts this step) with bias correction, got ",
           step);
  if (n == 0) return;
  const at::Tensor& first = params[0];
  const at::ScalarType dtype = multi_tensor::check_first(kOp, "params", first);
  for (int l = 0; l < 4; ++l) {
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor& x = lists[l][i];
      multi_tensor::check_like_first(kOp, kListNames[l], i, x, "params", first);
      PG_CHECK(x.numel() == params[i].numel(), kOp, ": ", kListNames[l], "[", i, "] has ", x.numel(),
               " elements but params[", i, "] has ", params[i].numel());
    }
  }
  // every launch planned before the first (a refused list leaves every tensor as it was)
  const int64_t elems_per_chunk = dtype == at::kFloat ? kChunkElems<float> : kChunkElems<at::Half>;
  const auto launches = multi_tensor::plan<TensorTable>(kOp, "grads", {grads, params, exp_avgs, exp_avg_sqs},
                                                        elems_per_chunk);
  const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
  const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
  PG_CHECK(bc1 > 0 && bc2 > 0, kOp, ": the bias corrections 1 - beta ** step are not positive (beta1 ", beta1,
           ", beta2 ", beta2, ", step ", step, ")");
  Hyper h;
  h.beta1 = static_cast<float>(beta1);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.eps = static_cast<float>(eps);
  h.step_size = static_cast<float>(lr / bc1);
  h.inv_bc2_sqrt = static_cast<float>(1.0 / std::sqrt(bc2));
  h.decay = static_cast<float>(1.0 - lr * weight_decay);
  h.weight_decay = static_cast<float>(weight_decay);
  h.adam_w = adam_w_mode;

  c10::cuda::CUDAGuard guard(first.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (const auto& l : launches) {   // a block per chunk
    const unsigned grid = static_cast<unsigned>(l.chunks);
    if (dtype == at::kFloat) {
      adam_kernel<float><<<grid, kThreads, 0, stream>>>(l.table, h, l.count);
    } else if (dtype == at::kHalf) {
      adam_kernel<at::Half><<<grid, kThreads, 0, stream>>>(l.table, h, l.count);
    } else {
      adam_kernel<at::BFloat16><<<grid, kThreads, 0, stream>>>(l.table, h, l.count);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace pipegoose
