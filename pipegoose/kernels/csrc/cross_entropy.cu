// Softmax cross-entropy over class logits, forward and backward, for fp32, fp16 and bf16 logits with fp32 math.
// Written for pipegoose; ops pipegoose::cross_entropy_forward / cross_entropy_forward_reduced /
// cross_entropy_backward / cross_entropy_backward_ (binding: pipegoose/kernels/bindings/cross_entropy.cpp; schemas:
// docs/architecture.md "Op schemas").
//
// cross_entropy_forward(logits [N, V], target [N] int64, ignore_index) -> (loss [N] fp32, lse [N] fp32):
//     lse_i = log(sum_j exp(x_ij)), loss_i = lse_i - x_i[target_i]; a row whose target is ignore_index gets loss 0
//     (and lse 0). A target outside [0, V) that is not ignore_index gives loss NaN (PyTorch's kernel stops the
//     process with a device-side assert there; a check on the host would cost a synchronisation per call).
// cross_entropy_forward_reduced(logits, target, ignore_index, mean) -> (out [] fp32, lse [N] fp32, count [] int64):
//     the same rows reduced in the same launch: out = the sum of the rows' losses, divided by count (the rows whose
//     target is not ignore_index) where `mean` (0 / 0 = NaN with every row ignored, as F.cross_entropy); the sum in
//     fp64 in a fixed order, so the same inputs give the same bits on every run.
// cross_entropy_backward(grad_loss [N], logits, target, lse, ignore_index) -> grad_logits [N, V] (grad_loss at any
//     stride, 0 included: a reduced loss's gradient expanded to every row):
//     dx_ij = grad_loss_i * (exp(x_ij - lse_i) - [j == target_i]), rounded once to the logits' dtype; ignored rows
//     get zeros, out-of-range targets NaN.
// cross_entropy_backward_(grad_loss, logits, target, lse, ignore_index) -> (): the same gradient written over the
//     logits (contiguous [N, V]): the fused linear cross-entropy's chunk then holds one [C, V] buffer, not two.
// The math is F.cross_entropy(logits.float(), target, reduction="none")'s (what transformers' loss computes after
// upcasting the logits), without an fp32 copy of the logits: the forward reads them once (an online softmax: the row's
// running maximum and the sum of exponentials rescaled when the maximum grows, as in flash attention), the backward
// reads them once and writes the gradient once.
//
// The forward: one block of 256 threads per row; the backward: one block of 512 threads per row, or 2, 4 or 8 where
// one per row leaves the GPU's last wave of blocks part-empty (few or long rows: 883 rows of 151936 classes fill 1.7
// waves of the H200's 528 resident blocks; parts_for). Rows whose start is 16-byte aligned take 16-byte vectors (4
// fp32 or 8 16-bit values), the rest and the tail of a row scalar loads. The forward's 16-bit loop takes each
// vector's maximum on packed pairs and widens values one by one (bf16 by a shift), and its exponentials are MUFU.EX2
// alone (ex2.approx.ftz): 195 SASS instructions per 32 values on sm_90, where the loop before session 49 took 328 and
// was issue-bound (the 16-bit forward ran at 54-65% of a device copy in session 47's benchmark, fp32 at 83-87%).
// logits: last dim contiguous, rows at any stride (a [B, S, V] output's view); offsets are 64-bit. Errors
// (RuntimeError naming the argument): not CUDA, devices differ, logits not 2-D or not fp32/fp16/bf16 or its last dim
// not contiguous, target not 1-D int64 of N elements, grad_loss / lse not [N], lse not fp32 (grad_loss of another
// dtype is converted to fp32).
// Precision: the loss is (max - x_t) + log(sum of exp(x - max)), accurate at any logit size; the backward's
// exp(x - lse) carries lse's fp32 rounding, a relative error of about 2^-24 * |lse| in each probability (6e-6 at logits
// of 100, 6e-4 at 1e4), as every kernel that keeps the log-sum-exp in fp32 for the backward.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

#include "pipegoose_check.h"
#include "pipegoose_occupancy.h"

namespace pipegoose {
namespace {

// Benchmark experiments (the build without them is what ships): -DPIPEGOOSE_CE_THREADS=N threads per block of the
// forward, -DPIPEGOOSE_CE_UNROLL=U vectors a thread loads before it computes there, -DPIPEGOOSE_CE_PARTS=N blocks per
// row of the backward. Measured on the H200 (session 49, .gpu/ce_var.py, CUDA graphs; benchmark shapes 883-4194 rows
// of 32000-151936 classes): the forward at 256 threads ran as fast as at 512 in bf16 and up to 7.5% faster in fp16
// (V 32000), at 1024 up to 27% slower; 8 vectors per thread up to 72% slower than 4 (registers); loading the next 4
// vectors before summing the current 4 (a register double buffer) slower at every shape; the forward split over a
// thread block cluster of 2 or 4 blocks per row (partial sums merged through distributed shared memory) 6-190% slower
// than one block per row. The backward split into 4 blocks per row ran 3-4% faster at 883 rows of 151936 in 16-bit
// (as fast in fp32), into 2 2% faster in fp32 at 2668 rows of 50304 and 1% slower in 16-bit there (where parts_for
// keeps one block per row: its rows hold too few vectors per thread for two).
#ifndef PIPEGOOSE_CE_THREADS
#define PIPEGOOSE_CE_THREADS 256
#endif
#ifndef PIPEGOOSE_CE_UNROLL
#define PIPEGOOSE_CE_UNROLL 4
#endif
constexpr int kThreads = PIPEGOOSE_CE_THREADS;   // the forward's
constexpr int kBwdThreads = 512;
constexpr int kUnroll = PIPEGOOSE_CE_UNROLL;
constexpr int kWarps = kThreads / 32;
constexpr float kLog2e = 1.4426950408889634f;

template <typename T> __device__ __forceinline__ float to_f(T x) { return static_cast<float>(x); }

// 2^x, flushing subnormal results to zero (MUFU.EX2 alone; exp2f adds a rescaling around it for subnormal results).
// Used by the forward only, where every flushed term is below 2^-126 beside a sum of at least 1 (the row's maximum
// contributes exactly 1), so it changes no result.
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The two 16-bit values of a 32-bit word (the lower address first), as floats; and their packed maximum (exact; a NaN
// beside a number gives the number, as fmaxf).
__device__ __forceinline__ float2 unpack(uint32_t w, c10::BFloat16) {
  return {__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u)};
}
__device__ __forceinline__ float2 unpack(uint32_t w, c10::Half) {
  float lo, hi;
  asm("{.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;}"
      : "=f"(lo), "=f"(hi) : "r"(w));
  return {lo, hi};
}
__device__ __forceinline__ uint32_t max2(uint32_t a, uint32_t b, c10::BFloat16) {
  uint32_t d;
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm("max.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#else   // before sm_80: in fp32, repacked (exact: the values are bf16's)
  const float2 x = unpack(a, c10::BFloat16{}), y = unpack(b, c10::BFloat16{});
  d = (__float_as_uint(fmaxf(x.x, y.x)) >> 16) | (__float_as_uint(fmaxf(x.y, y.y)) & 0xffff0000u);
#endif
  return d;
}
__device__ __forceinline__ uint32_t max2(uint32_t a, uint32_t b, c10::Half) {
  uint32_t d;
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm("max.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#else   // before sm_80: in fp32, repacked (exact: the values are fp16's)
  const float2 x = unpack(a, c10::Half{}), y = unpack(b, c10::Half{});
  asm("{.reg .b16 l, h;\n\tcvt.rn.f16.f32 l, %1;\n\tcvt.rn.f16.f32 h, %2;\n\tmov.b32 %0, {l, h};}"
      : "=r"(d) : "f"(fmaxf(x.x, y.x)), "f"(fmaxf(x.y, y.y)));
#endif
  return d;
}

// The running (maximum, sum of exp(x - maximum)) of a thread or warp, merged with another.
struct MaxSum {
  float m, s;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};   // both empty (or every value -inf): no NaN from -inf - -inf
  return {m, a.s * ex2_ftz((a.m - m) * kLog2e) + b.s * ex2_ftz((b.m - m) * kLog2e)};
}

// Adds the values of one chunk (their maximum cm) to a running pair.
template <int K>
__device__ __forceinline__ void add_chunk(MaxSum& r, const float (&x)[K]) {
  float cm = x[0];
#pragma unroll
  for (int e = 1; e < K; ++e) cm = fmaxf(cm, x[e]);
  const float m = fmaxf(r.m, cm);
  if (m == -INFINITY) return;   // -inf values only: nothing to add yet
  float s = r.s * ex2_ftz((r.m - m) * kLog2e);
#pragma unroll
  for (int e = 0; e < K; ++e) s += ex2_ftz((x[e] - m) * kLog2e);
  r = {m, s};
}

// Adds U 16-byte vectors of T to a running pair: fp32 through add_chunk; 16-bit values take their maximum packed (two
// per instruction, exact) and are widened one by one as the sum needs them, into two partial sums.
template <typename T, int U>
__device__ __forceinline__ void add_vectors(MaxSum& r, const uint4 (&a)[U]) {
  if constexpr (std::is_same_v<T, float>) {
    float v[4 * U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      v[4 * k] = __uint_as_float(a[k].x);
      v[4 * k + 1] = __uint_as_float(a[k].y);
      v[4 * k + 2] = __uint_as_float(a[k].z);
      v[4 * k + 3] = __uint_as_float(a[k].w);
    }
    add_chunk(r, v);
  } else {
    uint32_t mx = a[0].x;
#pragma unroll
    for (int k = 0; k < U; ++k) {
      if (k > 0) mx = max2(mx, a[k].x, T{});
      mx = max2(mx, a[k].y, T{});
      mx = max2(mx, a[k].z, T{});
      mx = max2(mx, a[k].w, T{});
    }
    const float2 cm2 = unpack(mx, T{});
    const float m = fmaxf(r.m, fmaxf(cm2.x, cm2.y));
    if (m == -INFINITY) return;   // -inf values only: nothing to add yet
    float s0 = r.s * ex2_ftz((r.m - m) * kLog2e), s1 = 0.f;
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const uint32_t w[4] = {a[k].x, a[k].y, a[k].z, a[k].w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = unpack(w[e], T{});
        s0 += ex2_ftz((f.x - m) * kLog2e);
        s1 += ex2_ftz((f.y - m) * kLog2e);
      }
    }
    r = {m, s0 + s1};
  }
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

// The forward of one row (blockIdx.x): loss and lse written by thread 0. Every thread of the block takes the same
// branch (the row's target decides), so an ignored row's block passes no barrier and a computed row's passes the
// same ones in every thread.
template <typename T>
__device__ __forceinline__ void row_forward(const T* __restrict__ logits, int64_t row_stride, int64_t V,
                                            const int64_t* __restrict__ target, int64_t ignore_index,
                                            float* __restrict__ loss, float* __restrict__ lse) {
  constexpr int VEC = 16 / sizeof(T);
  const int64_t row = blockIdx.x;
  const int64_t t = target[row];
  if (t == ignore_index) {
    if (threadIdx.x == 0) {
      loss[row] = 0.f;
      lse[row] = 0.f;
    }
    return;
  }
  const T* x = logits + row * row_stride;
  // the target's logit, loaded now: its latency passes under the row's
  const float xt = (threadIdx.x == 0 && t >= 0 && t < V) ? to_f<T>(x[t]) : 0.f;
  MaxSum r{-INFINITY, 0.f};
  int64_t done = 0;
  if (reinterpret_cast<uintptr_t>(x) % 16 == 0) {
    const int64_t nvec = V / VEC;
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    int64_t i = threadIdx.x;
    constexpr int64_t kStep = int64_t{kUnroll} * kThreads;
    for (; i + (kUnroll - 1) * kThreads < nvec; i += kStep) {   // kUnroll vectors in flight per thread
      uint4 a[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) a[k] = x4[i + k * kThreads];
      add_vectors<T>(r, a);
    }
    for (; i < nvec; i += kThreads) {
      const uint4 a[1] = {x4[i]};
      add_vectors<T>(r, a);
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
    loss[row] = (t >= 0 && t < V) ? (r.m - xt) + log_s : NAN;
  }
}

// Forward: one block per row; 32 registers, so that an SM of 2048 threads (sm_80, sm_90, sm_100) holds 8.
template <typename T>
__global__ void __launch_bounds__(kThreads, 2048 / kThreads)
    ce_fwd_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t V, const int64_t* __restrict__ target,
                  int64_t ignore_index, float* __restrict__ loss, float* __restrict__ lse) {
  row_forward<T>(logits, row_stride, V, target, ignore_index, loss, lse);
}

// The block's sum of one double per thread, in a fixed order (the same result on every run), to thread 0.
__device__ __forceinline__ double block_sum(double v) {
  __shared__ double part[kWarps];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    v = 0.0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += part[w];
  }
  return v;
}

// Forward with the loss's reduction: each block computes its row as ce_fwd_kernel (the per-row losses go to the
// workspace `rows`), then counts itself in `arrived` (zero before the launch); the block that arrives last sums the
// rows' losses in fp64, in a fixed order (deterministic, whichever block is last), counts the rows not ignored, and
// writes out = sum / count (`mean`; 0 / 0 = NaN, as F.cross_entropy) or the sum, and the count. One launch (after a
// 4-byte memset of the counter) where the per-row kernel's mean took four more (sum, compare, count, divide).
template <typename T>
__global__ void __launch_bounds__(kThreads, 2048 / kThreads)
    ce_fwd_reduce_kernel(const T* __restrict__ logits, int64_t row_stride, int64_t V,
                         const int64_t* __restrict__ target, int64_t ignore_index, float* __restrict__ rows,
                         float* __restrict__ lse, unsigned int* __restrict__ arrived, float* __restrict__ out,
                         int64_t* __restrict__ count, bool mean) {
  row_forward<T>(logits, row_stride, V, target, ignore_index, rows, lse);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    __threadfence();   // this row's loss (written by this thread) visible to every block before its arrival is
    last = atomicAdd(arrived, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int64_t n = gridDim.x;
  double s = 0.0, c = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) {
    s += static_cast<double>(__ldcg(rows + i));   // (from L2: other blocks wrote them)
    c += target[i] != ignore_index ? 1.0 : 0.0;
  }
  s = block_sum(s);
  __syncthreads();   // block_sum's shared slots are reused
  c = block_sum(c);
  if (threadIdx.x == 0) {
    *count = static_cast<int64_t>(c);
    *out = static_cast<float>(mean ? s / c : s);
  }
}

// The part [lo, hi) of n items that part p of `parts` takes (contiguous, sizes differing by at most one).
__device__ __forceinline__ void part_range(int64_t n, int p, int parts, int64_t& lo, int64_t& hi) {
  lo = n * p / parts;
  hi = n * (p + 1) / parts;
}

// Backward: `parts` blocks per row (blockIdx.x = row * parts + part), block p writing the p-th slice of the row's
// vectors (and its share of the scalar rest). grad_loss at any stride: 0 for a reduced loss's gradient expanded to
// every row. Each element of the gradient is computed from the same element of the logits alone (and the row's lse
// and target), read and written by one thread: `grad` may be `logits` itself (the in-place kernel), so the body takes
// plain pointers and each kernel says how they alias.
template <typename T>
__device__ __forceinline__ void bwd_block(const float* grad_loss, int64_t grad_stride, const T* logits,
                                          int64_t row_stride, int64_t V, const int64_t* target, int64_t ignore_index,
                                          const float* lse, T* grad, int parts) {
  constexpr int VEC = 16 / sizeof(T);
  const int64_t row = blockIdx.x / parts;
  const int part = static_cast<int>(blockIdx.x % parts);
  const int64_t t = target[row];
  const T* x = logits + row * row_stride;
  T* dx = grad + row * V;
  const bool ignored = t == ignore_index;
  const float g = ignored ? 0.f : grad_loss[row * grad_stride];
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
    int64_t lo, hi;
    part_range(nvec, part, parts, lo, hi);
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float4* d4 = reinterpret_cast<float4*>(dx);
    for (int64_t i = lo + threadIdx.x; i < hi; i += kBwdThreads) {
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
  for (int64_t j = done + int64_t{part} * kBwdThreads + threadIdx.x; j < V; j += int64_t{parts} * kBwdThreads) {
    dx[j] = static_cast<T>(value(ignored ? 0.f : to_f<T>(x[j]), j));
  }
}

template <typename T>
__global__ void __launch_bounds__(kBwdThreads)
    ce_bwd_kernel(const float* __restrict__ grad_loss, int64_t grad_stride, const T* __restrict__ logits,
                  int64_t row_stride, int64_t V, const int64_t* __restrict__ target, int64_t ignore_index,
                  const float* __restrict__ lse, T* __restrict__ grad, int parts) {
  bwd_block(grad_loss, grad_stride, logits, row_stride, V, target, ignore_index, lse, grad, parts);
}

// The gradient written over the logits (contiguous [N, V]): the same body, `data` read and written (no __restrict__
// on it, so no read-only-cache loads of memory the kernel writes).
template <typename T>
__global__ void __launch_bounds__(kBwdThreads)
    ce_bwd_inplace_kernel(const float* __restrict__ grad_loss, int64_t grad_stride, T* data, int64_t V,
                          const int64_t* __restrict__ target, int64_t ignore_index, const float* __restrict__ lse,
                          int parts) {
  bwd_block(grad_loss, grad_stride, static_cast<const T*>(data), V, V, target, ignore_index, lse, data, parts);
}

// The backward's blocks per row for `rows` rows of `nvec` vectors. A block's time is about proportional to its share
// of a row, and the blocks run in waves of `slots` (SMs * resident blocks): p blocks per row take about
// ceil(rows * p / slots) / p row-times. Of the counts 1, 2, 4 and 8 that keep at least kMinVecs vectors per thread,
// the fewest within 2% of the least time: more than one where one block per row leaves the last wave part-empty (few
// or long rows). -DPIPEGOOSE_CE_PARTS=N forces N (a benchmark experiment).
constexpr int kMinVecs = 8;
int parts_for(int64_t rows, int64_t nvec, int slots, int max_parts) {
#ifdef PIPEGOOSE_CE_PARTS
  return std::min(PIPEGOOSE_CE_PARTS, max_parts);
#endif
  auto time = [&](int p) { return std::ceil(static_cast<double>(rows) * p / slots) / p; };
  int top = 1;   // the most parts allowed
  while (top * 2 <= max_parts && nvec >= int64_t{top} * 2 * kBwdThreads * kMinVecs) top *= 2;
  double least = time(1);
  for (int p = 2; p <= top; p *= 2) least = std::min(least, time(p));
  int p = 1;
  while (p < top && time(p) > least * 1.02) p *= 2;
  return p;
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
const char* kBwdInplace = "pipegoose::cross_entropy_backward_";
const char* kFwdReduced = "pipegoose::cross_entropy_forward_reduced";

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

std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_forward_reduced_cuda(const at::Tensor& logits,
                                                                                  const at::Tensor& target_in,
                                                                                  int64_t ignore_index, bool mean) {
  check_logits_target(kFwdReduced, logits, target_in);
  const int64_t n = logits.size(0), v = logits.size(1);
  const auto fopts = logits.options().dtype(at::kFloat);
  at::Tensor out = at::empty({}, fopts), lse = at::empty({n}, fopts);
  at::Tensor count = at::empty({}, fopts.dtype(at::kLong));
  if (n == 0) {   // no row: the sum 0, the mean 0 / 0
    out.fill_(mean ? NAN : 0.f);
    count.zero_();
    return {out, lse, count};
  }
  const at::Tensor target = target_in.contiguous();
  at::Tensor rows = at::empty({n}, fopts);
  at::Tensor arrived = at::empty({1}, fopts.dtype(at::kInt));
  const int64_t stride = logits.stride(0);
  c10::cuda::CUDAGuard guard(logits.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaMemsetAsync(arrived.mutable_data_ptr(), 0, sizeof(unsigned int), stream));
  by_dtype(logits.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    ce_fwd_reduce_kernel<T><<<static_cast<unsigned>(n), kThreads, 0, stream>>>(
        logits.const_data_ptr<T>(), stride, v, target.const_data_ptr<int64_t>(), ignore_index,
        rows.mutable_data_ptr<float>(), lse.mutable_data_ptr<float>(),
        reinterpret_cast<unsigned int*>(arrived.mutable_data_ptr<int32_t>()), out.mutable_data_ptr<float>(),
        count.mutable_data_ptr<int64_t>(), mean);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {out, lse, count};
}

namespace {

void check_backward(const char* op, const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
                    const at::Tensor& lse) {
  check_logits_target(op, logits, target);
  const int64_t n = logits.size(0);
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"grad_loss", &grad_loss}, {"lse", &lse}}) {
    PG_CHECK(t->defined() && t->device() == logits.device(), op, ": ", name, " must be a tensor on logits' device");
    PG_CHECK(t->dim() == 1 && t->size(0) == n, op, ": ", name, " must be 1-D with ", n, " elements, got shape ",
             t->sizes());
  }
  PG_CHECK(lse.scalar_type() == at::kFloat, op, ": lse must be float32, got ", lse.scalar_type());
}

// The backward into `grad` (contiguous [N, V], the logits' dtype), which is `logits` itself for the in-place op.
void launch_backward(const at::Tensor& grad_loss_in, const at::Tensor& logits, const at::Tensor& target_in,
                     const at::Tensor& lse_in, int64_t ignore_index, const at::Tensor& grad) {
  const int64_t n = logits.size(0), v = logits.size(1);
  if (n == 0) return;
  const bool in_place = grad.is_same(logits);
  const at::Tensor target = target_in.contiguous(), lse = lse_in.contiguous();
  // (a mean's or sum's gradient comes expanded from one value, at stride 0: read in place)
  const at::Tensor gl = grad_loss_in.to(at::kFloat);
  const int64_t stride = logits.stride(0);
  c10::cuda::CUDAGuard guard(logits.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  by_dtype(logits.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const void* kernel = in_place ? reinterpret_cast<const void*>(ce_bwd_inplace_kernel<T>)
                                  : reinterpret_cast<const void*>(ce_bwd_kernel<T>);
    int parts = parts_for(n, v / (16 / static_cast<int64_t>(sizeof(T))),
                          occupancy(kernel, kBwdThreads, 0) * sm_count(), 8);
    if (n * parts > INT32_MAX) parts = 1;
    const auto blocks = static_cast<unsigned>(n * parts);
    if (in_place) {
      ce_bwd_inplace_kernel<T><<<blocks, kBwdThreads, 0, stream>>>(
          gl.const_data_ptr<float>(), gl.stride(0), grad.mutable_data_ptr<T>(), v, target.const_data_ptr<int64_t>(),
          ignore_index, lse.const_data_ptr<float>(), parts);
    } else {
      ce_bwd_kernel<T><<<blocks, kBwdThreads, 0, stream>>>(
          gl.const_data_ptr<float>(), gl.stride(0), logits.const_data_ptr<T>(), stride, v,
          target.const_data_ptr<int64_t>(), ignore_index, lse.const_data_ptr<float>(), grad.mutable_data_ptr<T>(),
          parts);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

at::Tensor cross_entropy_backward_cuda(const at::Tensor& grad_loss, const at::Tensor& logits, const at::Tensor& target,
                                       const at::Tensor& lse, int64_t ignore_index) {
  check_backward(kBwd, grad_loss, logits, target, lse);
  at::Tensor grad = at::empty(logits.sizes(), logits.options().memory_format(at::MemoryFormat::Contiguous));
  launch_backward(grad_loss, logits, target, lse, ignore_index, grad);
  return grad;
}

void cross_entropy_backward_inplace_cuda(const at::Tensor& grad_loss, const at::Tensor& logits,
                                         const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index) {
  check_backward(kBwdInplace, grad_loss, logits, target, lse);
  PG_CHECK(logits.is_contiguous(), kBwdInplace, ": logits must be contiguous (the gradient is written over it), got "
           "strides ", logits.strides(), " for shape ", logits.sizes());
  for (auto [name, t] : {std::pair<const char*, const at::Tensor*>{"grad_loss", &grad_loss}, {"target", &target},
                         {"lse", &lse}}) {
    PG_CHECK(!t->is_alias_of(logits), kBwdInplace, ": ", name, " must not share memory with logits");
  }
  launch_backward(grad_loss, logits, target, lse, ignore_index, logits);
}

}  // namespace pipegoose
