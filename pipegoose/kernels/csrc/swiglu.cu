// SwiGLU's gated activation, silu(gate) * up, forward and backward, for fp32, fp16 and bf16 tensors with fp32 math.
// Written for pipegoose; ops pipegoose::swiglu_forward / swiglu_backward / swiglu (binding:
// pipegoose/kernels/bindings/swiglu.cpp; schemas: docs/architecture.md "Op schemas").
//
// swiglu_forward(gate [*], up [*]) -> out [*]:  out = gate * sigmoid(gate) * up
// swiglu_backward(grad_output [*], gate, up) -> (grad_gate, grad_up):
//     s = sigmoid(gate);  grad_up = grad_output * gate * s;  grad_gate = grad_output * up * s * (1 + gate * (1 - s))
// (torch's silu and silu_backward formulas), each value computed in fp32 from the stored inputs and rounded once to
// the dtype (eager PyTorch in 16-bit rounds silu(gate) first, then the product: the kernel is the closer to exact).
// One dtype for every tensor; grad_output of another dtype is converted first. Any shape and number of elements
// (64-bit offsets); non-contiguous tensors are copied to contiguous ones first; outputs are contiguous, of gate's
// shape. Errors (RuntimeError naming the argument): not CUDA, devices differ, dtype not fp32/fp16/bf16 or differing,
// shapes differing.
//
// The data is read and written once, in 16-byte vectors (4 fp32 or 8 16-bit values) where every pointer is 16-byte
// aligned (a view at an odd element offset takes the scalar kernel, with the same math); the tail that is not a
// whole vector is done by block 0. A thread loads all its vectors before it computes (kUnroll per tensor).
// sigmoid through __expf and a correctly rounded reciprocal: relative error about 1e-6 (|gate| < 88), well inside fp32's
// test tolerance; exp(-gate) overflows to inf for gate < -88 and gives sigmoid 0, as expf does.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <tuple>

#include "pipegoose_check.h"

namespace pipegoose {
namespace {

// Benchmark experiments (the build without them is what ships): -DPIPEGOOSE_SWIGLU_THREADS=N threads per block,
// -DPIPEGOOSE_SWIGLU_UNROLL=U vectors per thread and tensor, -DPIPEGOOSE_SWIGLU_LDCS=1 streaming loads (__ldcs).
#ifndef PIPEGOOSE_SWIGLU_LDCS
#define PIPEGOOSE_SWIGLU_LDCS 0
#endif
#ifndef PIPEGOOSE_SWIGLU_THREADS
#define PIPEGOOSE_SWIGLU_THREADS 256
#endif
#ifndef PIPEGOOSE_SWIGLU_UNROLL
#define PIPEGOOSE_SWIGLU_UNROLL 2
#endif
constexpr int kThreads = PIPEGOOSE_SWIGLU_THREADS;
constexpr int kUnroll = PIPEGOOSE_SWIGLU_UNROLL;

__device__ __forceinline__ float4 load16(const float4* p) {
#if PIPEGOOSE_SWIGLU_LDCS
  return __ldcs(p);
#else
  return *p;
#endif
}

template <typename T> __device__ __forceinline__ float to_f(T x) { return static_cast<float>(x); }
template <typename T> __device__ __forceinline__ T from_f(float x) { return static_cast<T>(x); }

__device__ __forceinline__ float sigmoid(float g) { return __frcp_rn(1.f + __expf(-g)); }

__device__ __forceinline__ float fwd_math(float g, float u) { return g * sigmoid(g) * u; }

__device__ __forceinline__ void bwd_math(float dy, float g, float u, float& dg, float& du) {
  const float s = sigmoid(g);
  du = dy * (g * s);   // silu(g) first, as torch: dy * g can overflow where silu(g) is 0 (g near -3e38)
  dg = dy * u * (s * (1.f + g * (1.f - s)));
}

// The forward and the backward: silu(gate) * up of (gate, up); and (grad_gate, grad_up) of (grad_output, gate, up).
struct Fwd {
  static constexpr int kIn = 2, kOut = 1;
  __device__ __forceinline__ static void apply(const float (&x)[2], float (&y)[1]) { y[0] = fwd_math(x[0], x[1]); }
};
struct Bwd {
  static constexpr int kIn = 3, kOut = 2;
  __device__ __forceinline__ static void apply(const float (&x)[3], float (&y)[2]) {
    bwd_math(x[0], x[1], x[2], y[0], y[1]);
  }
};

// Block b owns vectors [b * kThreads * kUnroll, (b + 1) * kThreads * kUnroll): a thread loads all its vectors of
// every input, then computes and stores them; the elements past the last whole vector (fewer than one vector, or all
// of them where a pointer is not aligned) go one at a time over the grid.
// The inputs x0, x1[, x2] and outputs y0[, y1] (the unused ones null) as __restrict__ parameters: the loads take the
// read-only path (LDG.CONSTANT), which pointers passed in an array would not.
template <typename T, typename Op>
__global__ void __launch_bounds__(kThreads)
    swiglu_kernel(const T* __restrict__ x0, const T* __restrict__ x1, const T* __restrict__ x2, T* __restrict__ y0,
                  T* __restrict__ y1, int64_t n_vec, int64_t n) {
  constexpr int V = 16 / sizeof(T), NI = Op::kIn, NO = Op::kOut;
  const T* const a_in[3] = {x0, x1, x2};
  T* const a_out[2] = {y0, y1};
  const int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads * kUnroll + threadIdx.x;
  float4 r[NI][kUnroll];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t i = base + static_cast<int64_t>(k) * kThreads;
    if (i < n_vec) {
#pragma unroll
      for (int t = 0; t < NI; ++t) r[t][k] = load16(reinterpret_cast<const float4*>(a_in[t]) + i);
    }
  }
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const int64_t i = base + static_cast<int64_t>(k) * kThreads;
    if (i < n_vec) {
      float4 o[NO];
#pragma unroll
      for (int e = 0; e < V; ++e) {
        float x[NI], y[NO];
#pragma unroll
        for (int t = 0; t < NI; ++t) x[t] = to_f<T>(reinterpret_cast<const T*>(&r[t][k])[e]);
        Op::apply(x, y);
#pragma unroll
        for (int t = 0; t < NO; ++t) reinterpret_cast<T*>(&o[t])[e] = from_f<T>(y[t]);
      }
#pragma unroll
      for (int t = 0; t < NO; ++t) reinterpret_cast<float4*>(a_out[t])[i] = o[t];
    }
  }
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = n_vec * V + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    float x[NI], y[NO];
#pragma unroll
    for (int t = 0; t < NI; ++t) x[t] = to_f<T>(a_in[t][i]);
    Op::apply(x, y);
#pragma unroll
    for (int t = 0; t < NO; ++t) a_out[t][i] = from_f<T>(y[t]);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }


// The launch shape: n_vec whole vectors when every pointer is aligned (else none: the blocks then walk all n elements
// one at a time, as many blocks as the vectors would take), and the blocks that cover them.
struct Launch {
  int64_t n_vec;
  unsigned grid;
};

Launch plan(int64_t n, int64_t v, bool aligned, const char* op) {
  const int64_t n_vec = aligned ? n / v : 0;
  const int64_t units = aligned ? n_vec : (n + v - 1) / v;
  const int64_t per_block = static_cast<int64_t>(kThreads) * kUnroll;
  const int64_t blocks = units > 0 ? (units + per_block - 1) / per_block : 1;
  PG_CHECK(blocks <= INT32_MAX, op, ": ", n, " elements are more than one launch covers");
  return {n_vec, static_cast<unsigned>(blocks)};
}

const char* kFwd = "pipegoose::swiglu_forward";
const char* kBwd = "pipegoose::swiglu_backward";

void check_pair(const char* op, const at::Tensor& gate, const at::Tensor& up) {
  PG_CHECK(gate.defined() && up.defined(), op, ": gate and up must be defined tensors");
  PG_CHECK(gate.is_cuda(), op, ": gate must be a CUDA tensor, got device ", gate.device());
  PG_CHECK(up.device() == gate.device(), op, ": up is on ", up.device(), " but gate is on ", gate.device(),
           "; expected one CUDA device");
  const auto dt = gate.scalar_type();
  PG_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op,
           ": gate must be float32, float16 or bfloat16, got ", dt);
  PG_CHECK(up.scalar_type() == dt, op, ": up is ", up.scalar_type(), " but gate is ", dt, "; expected one dtype");
  PG_CHECK(up.sizes() == gate.sizes(), op, ": up has shape ", up.sizes(), " but gate has ", gate.sizes(),
           "; expected equal shapes (no broadcasting)");
}

}  // namespace

at::Tensor swiglu_forward_cuda(const at::Tensor& gate_in, const at::Tensor& up_in) {
  check_pair(kFwd, gate_in, up_in);
  const at::Tensor gate = gate_in.contiguous(), up = up_in.contiguous();
  at::Tensor out = at::empty(gate.sizes(), gate.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t n = gate.numel();
  if (n == 0) return out;
  c10::cuda::CUDAGuard guard(gate.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  by_dtype(gate.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* g = gate.const_data_ptr<scalar_t>();
    const scalar_t* u = up.const_data_ptr<scalar_t>();
    scalar_t* y = out.mutable_data_ptr<scalar_t>();
    const Launch l = plan(n, 16 / sizeof(scalar_t), aligned16(g) && aligned16(u) && aligned16(y), kFwd);
    swiglu_kernel<scalar_t, Fwd><<<l.grid, kThreads, 0, stream>>>(g, u, nullptr, y, nullptr, l.n_vec, n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gate_in,
                                                        const at::Tensor& up_in) {
  check_pair(kBwd, gate_in, up_in);
  PG_CHECK(grad_output.defined(), kBwd, ": grad_output must be a defined tensor");
  PG_CHECK(grad_output.device() == gate_in.device(), kBwd, ": grad_output is on ", grad_output.device(),
           " but gate is on ", gate_in.device());
  PG_CHECK(grad_output.sizes() == gate_in.sizes(), kBwd, ": grad_output has shape ", grad_output.sizes(),
           " but gate has ", gate_in.sizes(), "; expected equal shapes");
  PG_CHECK(at::isFloatingType(grad_output.scalar_type()), kBwd, ": grad_output must be a floating point tensor, got ",
           grad_output.scalar_type());
  const at::Tensor gate = gate_in.contiguous(), up = up_in.contiguous();
  const at::Tensor dy = grad_output.to(gate.scalar_type()).contiguous();
  const auto opts = gate.options().memory_format(at::MemoryFormat::Contiguous);
  at::Tensor dg = at::empty(gate.sizes(), opts), du = at::empty(gate.sizes(), opts);
  const int64_t n = gate.numel();
  if (n == 0) return {dg, du};
  c10::cuda::CUDAGuard guard(gate.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  by_dtype(gate.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* pdy = dy.const_data_ptr<scalar_t>();
    const scalar_t* g = gate.const_data_ptr<scalar_t>();
    const scalar_t* u = up.const_data_ptr<scalar_t>();
    scalar_t* pdg = dg.mutable_data_ptr<scalar_t>();
    scalar_t* pdu = du.mutable_data_ptr<scalar_t>();
    const bool aligned = aligned16(pdy) && aligned16(g) && aligned16(u) && aligned16(pdg) && aligned16(pdu);
    const Launch l = plan(n, 16 / sizeof(scalar_t), aligned, kBwd);
    swiglu_kernel<scalar_t, Bwd><<<l.grid, kThreads, 0, stream>>>(pdy, g, u, pdg, pdu, l.n_vec, n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {dg, du};
}

}  // namespace pipegoose
