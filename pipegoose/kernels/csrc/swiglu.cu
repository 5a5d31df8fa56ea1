// SwiGLU's gated activation, silu(gate) * up, forward and backward, for fp32, fp16 and bf16 tensors with fp32 math.
// Written for pipegoose; ops pipegoose::swiglu_forward / swiglu_backward / swiglu and, for gate and up in one tensor,
// pipegoose::silu_and_mul_forward / silu_and_mul_backward / silu_and_mul; GeGLU's the same, geglu_* and
// gelu_and_mul_*; GELU alone, gelu_forward / gelu_backward / gelu; squared ReLU, squared_relu_forward /
// squared_relu_backward / squared_relu (binding: pipegoose/kernels/bindings/swiglu.cpp; schemas: docs/architecture.md
// "Op schemas").
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
// sigmoid through __expf and a correctly rounded reciprocal: relative error about 1e-6 (|gate| < 88), well inside
// fp32's test tolerance; exp(-gate) overflows to inf for gate < -88 and gives sigmoid 0, as expf does.
//
// silu_and_mul (vLLM's name for it; the MLP of Phi-3 and GLM, whose gate_up_proj puts gate and up in one output):
// silu_and_mul_forward(x [..., 2d]) -> out [..., d]:  out = silu(x[..., :d]) * x[..., d:]
// silu_and_mul_backward(grad_output [..., d], x [..., 2d]) -> grad_x [..., 2d]  (grad_gate in the first half of each
//     row, grad_up in the second: the gradient of the packed tensor, so autograd concatenates nothing)
// The same math per value as above. x's rows may lie at any stride (the output of a linear layer sliced, a row of a
// wider tensor) provided its leading dimensions flatten to one row index with a stride and its last dimension is
// contiguous; otherwise it is copied to a contiguous tensor first. grad_output likewise. Outputs are contiguous.
// One thread per 16-byte vector of the output's rows (where d, the row strides and every pointer allow; one value per
// thread otherwise), kThreads a block, its row and column from its index by a division (32-bit multiply-and-shift
// below 2^32 vectors, 64-bit beyond). Errors (RuntimeError naming the
// argument): not CUDA, devices differ, dtype not fp32/fp16/bf16, x of no dimension or an odd last dimension,
// grad_output not of x's shape with the last dimension halved.
//
// GeGLU (the gated MLP of Gemma, Gemma-2 and Gemma-3: down_proj(gelu(gate_proj(x)) * up_proj(x))), as the pair above
// with GELU for SiLU: ops pipegoose::geglu_forward / geglu_backward / geglu, each with a string `approximate`, "tanh"
// (GELU's tanh approximation, transformers' gelu_pytorch_tanh: Gemma's default) or "none" (erf GELU), as F.gelu takes:
// geglu_forward(gate [*], up [*], approximate) -> out [*]:  out = gelu(gate) * up
// geglu_backward(grad_output [*], gate, up, approximate) -> (grad_gate, grad_up):
//     grad_up = grad_output * gelu(gate);  grad_gate = grad_output * up * gelu'(gate)
// with the functions of torch's gelu and gelu_backward (tanh: 0.5 g (1 + tanh(k (g + 0.044715 g^3))), k =
// sqrt(2 / pi), computed as g * sigmoid(2 k (g + 0.044715 g^3)); none: 0.5 g (1 + erf(g / sqrt(2))), computed as
// 0.5 g erfc(-g / sqrt(2))): the same values where torch's are accurate, and no cancellation for negative gates (see
// GeluTanh and GeluErf), in fp32 and rounded once as above.
// The same launch, layouts and errors as swiglu's, and a RuntimeError naming approximate for another string.
//
// gelu_and_mul (vLLM's gelu_and_mul and gelu_tanh_and_mul in one op; the gate of Gemma 4's MoE experts, whose
// gate_up_proj puts gate and up in one output): silu_and_mul with GeGLU's activation and math per value,
// gelu_and_mul_forward(x [..., 2d], approximate) -> out [..., d]:  out = gelu(x[..., :d]) * x[..., d:]
// gelu_and_mul_backward(grad_output [..., d], x [..., 2d], approximate) -> grad_x [..., 2d]
// The same launch, layouts and errors as silu_and_mul's, and a RuntimeError naming approximate for another string.
//
// gelu (GELU alone, the activation of the MLPs without a gate: GPT-2's, GPT-J's, Phi's, CodeGen's gelu_new, Bloom's
// BloomGelu, which transformers compute as several elementwise ops; F.gelu's function): ops pipegoose::gelu_forward /
// gelu_backward / gelu, with approximate as geglu's:
// gelu_forward(x [*], approximate) -> out [*]:  out = gelu(x)
// gelu_backward(grad_output [*], x, approximate) -> grad_x [*]:  grad_x = grad_output * gelu'(x)
// GeGLU's GELU per value (GeluTanh, GeluErf) in fp32, rounded once; swiglu's launch (16-byte vectors, kUnroll per
// thread, the scalar kernel for a view at an odd element offset), contiguous copies of non-contiguous inputs,
// contiguous outputs. Errors (RuntimeError naming the argument): not CUDA, devices differ, dtype not fp32/fp16/bf16,
// grad_output of another shape or not floating point, approximate another string.
//
// squared_relu (Primer's squared ReLU, relu(x)^2: transformers' relu2, ReLUSquaredActivation, the activation of the
// MLPs without a gate of Nemotron, Nemotron-H, Persimmon, Arcee, Jais2, NanoChat; transformers compute it as relu
// then square, two kernels forward, three backward): ops pipegoose::squared_relu_forward / squared_relu_backward /
// squared_relu, gelu's launch, layouts and errors without approximate:
// squared_relu_forward(x [*]) -> out [*]:  out = relu(x)^2
// squared_relu_backward(grad_output [*], x) -> grad_x [*]:  grad_x = grad_output * 2 relu(x) where x > 0, else 0
// In fp32, rounded once: the same bits as eager PyTorch's relu, square and their backward (each a product of two
// values of the dtype rounded once), NaN in x giving NaN as torch.relu does, and 0 where x <= 0 whatever grad_output
// holds (threshold_backward's; grad_output * 0 would be NaN for an infinite one). One exception: fp16 x past 32752,
// where eager rounds 2 x to fp16 (inf) before the product and the kernel does not (x^2 is inf there already).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

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

// The gate's activations: value(g), and value and derivative together (the backward needs both).
struct Silu {
  __device__ __forceinline__ static float value(float g) { return g * sigmoid(g); }
  __device__ __forceinline__ static void both(float g, float& a, float& da) {
    const float s = sigmoid(g);
    a = g * s;
    da = s * (1.f + g * (1.f - s));
  }
};

// GELU's tanh approximation (F.gelu(approximate="tanh"), transformers' gelu_pytorch_tanh and gelu_new), in fp32:
// 0.5 g (1 + tanh(y)) with y = k (g + 0.044715 g^3), k = sqrt(2 / pi), computed as g * sigmoid(2 y) (the same function:
// 1 + tanh(y) = 2 sigmoid(2 y)), which keeps its relative accuracy where 1 + tanh(y) cancels (g below about -3, where
// torch's 0.5 g (1 + tanhf(y)) loses every digit of values near 1e-7), and costs one exp. Derivative:
// s + g * 2 s (1 - s) * k (1 + 3 * 0.044715 g^2), s = sigmoid(2 y) = 1 / (1 + e), e = exp(-2 y), and 1 - s as e * s
// (1 - s itself cancels once s rounds to 1, g of about 4.5 to 9: 16 units in the last place off; a review); g^2
// capped at 1e30 (the factor it sits in is 0 past |g| of about 10), so a finite gate past 1.8e19 gives 0 there, not
// 0 * inf = NaN.
struct GeluTanh {
  static constexpr float kTwoBeta = 1.5957691216057308f;   // 2 sqrt(2 / pi)
  static constexpr float kBeta = 0.7978845608028654f;      // sqrt(2 / pi)
  static constexpr float kKappa = 0.044715f;
  __device__ __forceinline__ static float value(float g) { return g * sigmoid(kTwoBeta * (g + kKappa * g * g * g)); }
  __device__ __forceinline__ static void both(float g, float& a, float& da) {
    const float g2 = g * g;
    const float e = __expf(-kTwoBeta * (g + kKappa * g2 * g));
    const float s = __frcp_rn(1.f + e);
    const float one_minus_s = isinf(e) ? 1.f : e * s;   // (e = inf: s = 0, and e * s would be NaN)
    a = g * s;
    da = s + g * (2.f * s * one_minus_s) * (kBeta * (1.f + 3.f * kKappa * fminf(g2, 1e30f)));
  }
};

// GELU (erf; F.gelu's approximate="none"), in fp32: g * Phi(g) with Phi(g) = 0.5 (1 + erf(g / sqrt(2))) computed as
// 0.5 erfc(-g / sqrt(2)), the same function, accurate where 1 + erf cancels (g below about -3, where torch's form
// loses the digits of values near 1e-7; a review); derivative Phi(g) + g exp(-g^2 / 2) / sqrt(2 pi), torch's.
struct GeluErf {
  static constexpr float kSqrt1_2 = 0.7071067811865476f;     // 1 / sqrt(2)
  static constexpr float kInvSqrt2Pi = 0.3989422804014327f;  // 1 / sqrt(2 pi)
  __device__ __forceinline__ static float value(float g) { return 0.5f * g * erfcf(-g * kSqrt1_2); }
  __device__ __forceinline__ static void both(float g, float& a, float& da) {
    const float cdf = 0.5f * erfcf(-g * kSqrt1_2);
    a = g * cdf;
    da = cdf + g * (kInvSqrt2Pi * expf(-0.5f * g * g));
  }
};

// Squared ReLU, relu(g)^2, derivative 2 relu(g); relu(NaN) is NaN (torch.relu's). grad: the backward's grad_x of
// (grad_output, g), 0 where g <= 0 (threshold_backward zeroes an infinite grad_output there too).
struct SquaredRelu {
  __device__ __forceinline__ static float relu(float g) { return g > 0.f || g != g ? g : 0.f; }
  __device__ __forceinline__ static float value(float g) {
    const float r = relu(g);
    return r * r;
  }
  __device__ __forceinline__ static float grad(float dy, float g) {
    return g > 0.f || g != g ? dy * (2.f * g) : 0.f;
  }
};

// grad_x = grad_output * act'(g) of the plain activation (op gelu's GELUs; squared ReLU has its own, above).
template <typename Act>
__device__ __forceinline__ float act_grad(float dy, float g) {
  float a, da;
  Act::both(g, a, da);
  return dy * da;
}
template <>
__device__ __forceinline__ float act_grad<SquaredRelu>(float dy, float g) { return SquaredRelu::grad(dy, g); }

template <typename Act>
__device__ __forceinline__ float fwd_math(float g, float u) { return Act::value(g) * u; }

template <typename Act>
__device__ __forceinline__ void bwd_math(float dy, float g, float u, float& dg, float& du) {
  float a, da;
  Act::both(g, a, da);
  du = dy * a;   // act(g) first, as torch: dy * g can overflow where silu(g) is 0 (g near -3e38)
  dg = dy * u * da;
}

// The plain activation (ops gelu, squared_relu): act(x) of (x); and grad_x = grad_output * act'(x) of
// (grad_output, x).
template <typename Act>
struct ActFwd {
  static constexpr int kIn = 1, kOut = 1;
  __device__ __forceinline__ static void apply(const float (&x)[1], float (&y)[1]) { y[0] = Act::value(x[0]); }
};
template <typename Act>
struct ActBwd {
  static constexpr int kIn = 2, kOut = 1;
  __device__ __forceinline__ static void apply(const float (&x)[2], float (&y)[1]) {
    y[0] = act_grad<Act>(x[0], x[1]);
  }
};

// The forward and the backward: act(gate) * up of (gate, up); and (grad_gate, grad_up) of (grad_output, gate, up).
template <typename Act>
struct Fwd {
  static constexpr int kIn = 2, kOut = 1;
  __device__ __forceinline__ static void apply(const float (&x)[2], float (&y)[1]) {
    y[0] = fwd_math<Act>(x[0], x[1]);
  }
};
template <typename Act>
struct Bwd {
  static constexpr int kIn = 3, kOut = 2;
  __device__ __forceinline__ static void apply(const float (&x)[3], float (&y)[2]) {
    bwd_math<Act>(x[0], x[1], x[2], y[0], y[1]);
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

// ---------------------------------------------------------------------------------------------------------------------
// silu_and_mul: gate and up as the two halves of each row of x
// ---------------------------------------------------------------------------------------------------------------------

// V values of T, read and written as one access (16 bytes where V = 16 / sizeof(T)).
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// A [rows, d]-shaped view: base pointer and row stride in elements (the last dimension is contiguous).
template <typename T>
struct Rows {
  T* p;
  int64_t stride;
};

// Unsigned 32-bit division by a divisor fixed for a launch, as a multiply and a shift (Granlund and Montgomery's
// round-up multiplier): with shift = ceil(log2(div)) and mul = floor(2^32 * (2^shift - div) / div) + 1,
// n / div = (umulhi(n, mul) + n) >> shift (the sum in 64 bits), exact for every n < 2^32 and 1 <= div <= 2^31.
struct DivU32 {
  uint32_t div, mul, shift;
};

DivU32 make_div(uint32_t div) {
  uint32_t shift = 0;
  while ((uint64_t{1} << shift) < div) ++shift;
  const uint64_t mul = ((uint64_t{1} << 32) * ((uint64_t{1} << shift) - div)) / div + 1;
  return {div, static_cast<uint32_t>(mul), shift};
}

__device__ __forceinline__ uint32_t divide(uint32_t n, DivU32 f) {
  return static_cast<uint32_t>((static_cast<uint64_t>(__umulhi(n, f.mul)) + n) >> f.shift);
}

// Forward (kBackward false): y[r, c] = act(x[r, c]) * x[r, c + d].
// Backward: (dx[r, c], dx[r, c + d]) = swiglu's (geglu's, for a GELU) (grad_gate, grad_up) of (dy[r, c], x[r, c],
// x[r, c + d]).
// Thread i of the grid takes vector i of the output's rows x d_vec vectors (V values each): row i / d_vec, column
// i % d_vec, so every lane has work but the last block's tail (a launch of 2D blocks, tx along a row and ty rows,
// left lanes idle where d_vec is not a multiple of tx: 69-87% of copy backward on the H100 at intermediate sizes
// 1408-5632 in session 65's bf16 sweep, against 99-102% for this one). kWide: 64-bit vector indices and division,
// where the threads are 2^32 or more (or d_vec more than 2^31); else 32-bit ones and DivU32.
template <typename Act, typename T, int V, bool kBackward, bool kWide>
__global__ void __launch_bounds__(kThreads)
    act_and_mul_kernel(Rows<const T> x, Rows<const T> dy, Rows<T> out, int64_t total, DivU32 f, int64_t d_vec,
                        int64_t d) {
  using P = Pack<T, V>;
  int64_t row, col;
  if constexpr (kWide) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
    if (i >= total) return;
    row = i / d_vec;
    col = (i - row * d_vec) * V;
  } else {
    const uint32_t i = blockIdx.x * static_cast<uint32_t>(kThreads) + threadIdx.x;
    if (i >= static_cast<uint32_t>(total)) return;
    const uint32_t r = divide(i, f);
    row = r;
    col = static_cast<int64_t>(i - r * f.div) * V;
  }
  const T* xr = x.p + row * x.stride + col;
  const P g = *reinterpret_cast<const P*>(xr);
  const P u = *reinterpret_cast<const P*>(xr + d);
  T* orow = out.p + row * out.stride + col;
  if constexpr (kBackward) {
    const P dv = *reinterpret_cast<const P*>(dy.p + row * dy.stride + col);
    P dg, du;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      float a, b;
      bwd_math<Act>(to_f<T>(dv.v[e]), to_f<T>(g.v[e]), to_f<T>(u.v[e]), a, b);
      dg.v[e] = from_f<T>(a);
      du.v[e] = from_f<T>(b);
    }
    *reinterpret_cast<P*>(orow) = dg;
    *reinterpret_cast<P*>(orow + d) = du;
  } else {
    P y;
#pragma unroll
    for (int e = 0; e < V; ++e) y.v[e] = from_f<T>(fwd_math<Act>(to_f<T>(g.v[e]), to_f<T>(u.v[e])));
    *reinterpret_cast<P*>(orow) = y;
  }
}

const char* kSamFwd = "pipegoose::silu_and_mul_forward";
const char* kSamBwd = "pipegoose::silu_and_mul_backward";
const char* kGamFwd = "pipegoose::gelu_and_mul_forward";
const char* kGamBwd = "pipegoose::gelu_and_mul_backward";

void check_packed(const char* op, const at::Tensor& x) {
  PG_CHECK(x.defined(), op, ": x must be a defined tensor");
  PG_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got device ", x.device());
  const auto dt = x.scalar_type();
  PG_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op,
           ": x must be float32, float16 or bfloat16, got ", dt);
  PG_CHECK(x.dim() >= 1, op, ": x must have at least one dimension (gate and up are the halves of the last)");
  PG_CHECK(x.size(-1) % 2 == 0, op, ": x's last dimension must be even (gate and up are its two halves), got ",
           x.size(-1));
}

// t as [rows, cols] with a contiguous last dimension: a view where its leading dimensions flatten to one row stride
// (reshape's view), else a contiguous copy.
at::Tensor as_rows(const at::Tensor& t, int64_t cols) {
  at::Tensor r = t.reshape({-1, cols});
  return cols > 1 && r.stride(1) != 1 ? r.contiguous() : r;
}

// The launch over rows x d values: one thread for each V of them (a vector, or a value), kThreads a block (op: the
// op's name, for the error).
template <typename Act, typename T, int V, bool kBackward>
void launch_act_and_mul(const char* op, Rows<const T> x, Rows<const T> dy, Rows<T> out, int64_t rows, int64_t d,
                        cudaStream_t stream) {
  const int64_t d_vec = d / V;
  const int64_t total = rows * d_vec;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  PG_CHECK(blocks <= INT32_MAX, op, ": ", rows, " rows of ", d, " values are more than one launch covers");
  // (32-bit indices where every thread's index, the last block's idle ones too, is below 2^32)
  const bool wide = blocks * kThreads > static_cast<int64_t>(UINT32_MAX) || d_vec > (int64_t{1} << 31);
  const DivU32 f = wide ? DivU32{0, 0, 0} : make_div(static_cast<uint32_t>(d_vec));
  const dim3 grid(static_cast<unsigned>(blocks));
  if (wide) {
    act_and_mul_kernel<Act, T, V, kBackward, true><<<grid, kThreads, 0, stream>>>(x, dy, out, total, f, d_vec, d);
  } else {
    act_and_mul_kernel<Act, T, V, kBackward, false><<<grid, kThreads, 0, stream>>>(x, dy, out, total, f, d_vec, d);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Vectors of 16 bytes where d, every row stride and every pointer are multiples of them.
template <typename Act, typename T, bool kBackward>
void dispatch_act_and_mul(const char* op, Rows<const T> x, Rows<const T> dy, Rows<T> out, int64_t rows, int64_t d,
                          cudaStream_t stream) {
  constexpr int V = 16 / sizeof(T);
  bool vec = d % V == 0 && aligned16(x.p) && aligned16(out.p) && (rows <= 1 || (x.stride % V == 0 &&
                                                                                   out.stride % V == 0));
  if (kBackward) vec = vec && aligned16(dy.p) && (rows <= 1 || dy.stride % V == 0);
  if (vec) {
    launch_act_and_mul<Act, T, V, kBackward>(op, x, dy, out, rows, d, stream);
  } else {
    launch_act_and_mul<Act, T, 1, kBackward>(op, x, dy, out, rows, d, stream);
  }
}

// silu_and_mul's and gelu_and_mul's entry points, for the activation Act (fwd, bwd: the ops' names, for the errors).
template <typename Act>
at::Tensor packed_forward(const char* fwd, const at::Tensor& x_in) {
  check_packed(fwd, x_in);
  const int64_t d = x_in.size(-1) / 2;
  std::vector<int64_t> shape(x_in.sizes().begin(), x_in.sizes().end());
  shape.back() = d;
  at::Tensor out = at::empty(shape, x_in.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = as_rows(x_in, 2 * d);
  const int64_t rows = x.size(0);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  by_dtype(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    dispatch_act_and_mul<Act, scalar_t, false>(fwd, {x.const_data_ptr<scalar_t>(), x.stride(0)}, {nullptr, 0},
                                               {out.mutable_data_ptr<scalar_t>(), d}, rows, d, stream);
  });
  return out;
}

template <typename Act>
at::Tensor packed_backward(const char* bwd, const at::Tensor& grad_output, const at::Tensor& x_in) {
  check_packed(bwd, x_in);
  PG_CHECK(grad_output.defined(), bwd, ": grad_output must be a defined tensor");
  PG_CHECK(grad_output.device() == x_in.device(), bwd, ": grad_output is on ", grad_output.device(),
           " but x is on ", x_in.device());
  PG_CHECK(at::isFloatingType(grad_output.scalar_type()), bwd,
           ": grad_output must be a floating point tensor, got ", grad_output.scalar_type());
  const int64_t d = x_in.size(-1) / 2;
  std::vector<int64_t> expect(x_in.sizes().begin(), x_in.sizes().end());
  expect.back() = d;
  PG_CHECK(grad_output.sizes() == c10::IntArrayRef(expect), bwd, ": grad_output has shape ", grad_output.sizes(),
           " but x has ", x_in.sizes(), "; expected x's shape with the last dimension halved, ",
           c10::IntArrayRef(expect));
  at::Tensor dx = at::empty(x_in.sizes(), x_in.options().memory_format(at::MemoryFormat::Contiguous));
  if (dx.numel() == 0) return dx;
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = as_rows(x_in, 2 * d);
  const at::Tensor dy = as_rows(grad_output.to(x_in.scalar_type()), d);
  const int64_t rows = x.size(0);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  by_dtype(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    dispatch_act_and_mul<Act, scalar_t, true>(bwd, {x.const_data_ptr<scalar_t>(), x.stride(0)},
                                              {dy.const_data_ptr<scalar_t>(), dy.stride(0)},
                                              {dx.mutable_data_ptr<scalar_t>(), 2 * d}, rows, d, stream);
  });
  return dx;
}

// F.gelu's approximate: true for "tanh", false for "none"; a RuntimeError naming approximate for another string.
bool gelu_tanh(const char* op, c10::string_view approximate) {
  PG_CHECK(approximate == "tanh" || approximate == "none", op, ": approximate must be \"tanh\" or \"none\", got \"",
           std::string(approximate), "\"");
  return approximate == "tanh";
}

}  // namespace

at::Tensor silu_and_mul_forward_cuda(const at::Tensor& x) { return packed_forward<Silu>(kSamFwd, x); }

at::Tensor silu_and_mul_backward_cuda(const at::Tensor& grad_output, const at::Tensor& x) {
  return packed_backward<Silu>(kSamBwd, grad_output, x);
}

at::Tensor gelu_and_mul_forward_cuda(const at::Tensor& x, c10::string_view approximate) {
  return gelu_tanh(kGamFwd, approximate) ? packed_forward<GeluTanh>(kGamFwd, x) : packed_forward<GeluErf>(kGamFwd, x);
}

at::Tensor gelu_and_mul_backward_cuda(const at::Tensor& grad_output, const at::Tensor& x,
                                      c10::string_view approximate) {
  return gelu_tanh(kGamBwd, approximate) ? packed_backward<GeluTanh>(kGamBwd, grad_output, x)
                                         : packed_backward<GeluErf>(kGamBwd, grad_output, x);
}

namespace {

// swiglu's and geglu's entry points, for the activation Act (op: the op's name, for the errors).
template <typename Act>
at::Tensor pair_forward(const char* op, const at::Tensor& gate_in, const at::Tensor& up_in) {
  check_pair(op, gate_in, up_in);
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
    const Launch l = plan(n, 16 / sizeof(scalar_t), aligned16(g) && aligned16(u) && aligned16(y), op);
    swiglu_kernel<scalar_t, Fwd<Act>><<<l.grid, kThreads, 0, stream>>>(g, u, nullptr, y, nullptr, l.n_vec, n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

template <typename Act>
std::tuple<at::Tensor, at::Tensor> pair_backward(const char* op, const at::Tensor& grad_output,
                                                 const at::Tensor& gate_in, const at::Tensor& up_in) {
  check_pair(op, gate_in, up_in);
  PG_CHECK(grad_output.defined(), op, ": grad_output must be a defined tensor");
  PG_CHECK(grad_output.device() == gate_in.device(), op, ": grad_output is on ", grad_output.device(),
           " but gate is on ", gate_in.device());
  PG_CHECK(grad_output.sizes() == gate_in.sizes(), op, ": grad_output has shape ", grad_output.sizes(),
           " but gate has ", gate_in.sizes(), "; expected equal shapes");
  PG_CHECK(at::isFloatingType(grad_output.scalar_type()), op, ": grad_output must be a floating point tensor, got ",
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
    const Launch l = plan(n, 16 / sizeof(scalar_t), aligned, op);
    swiglu_kernel<scalar_t, Bwd<Act>><<<l.grid, kThreads, 0, stream>>>(pdy, g, u, pdg, pdu, l.n_vec, n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {dg, du};
}

const char* kGegluFwd = "pipegoose::geglu_forward";
const char* kGegluBwd = "pipegoose::geglu_backward";

}  // namespace

namespace {

const char* kGeluFwd = "pipegoose::gelu_forward";
const char* kGeluBwd = "pipegoose::gelu_backward";
const char* kSquaredReluFwd = "pipegoose::squared_relu_forward";
const char* kSquaredReluBwd = "pipegoose::squared_relu_backward";

void check_one(const char* op, const at::Tensor& x) {
  PG_CHECK(x.defined(), op, ": x must be a defined tensor");
  PG_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got device ", x.device());
  const auto dt = x.scalar_type();
  PG_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op,
           ": x must be float32, float16 or bfloat16, got ", dt);
}

// The plain activations' entry points (gelu, squared_relu), for the activation Act (op: the op's name, for the errors).
template <typename Act>
at::Tensor unary_forward(const char* op, const at::Tensor& x_in) {
  check_one(op, x_in);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t n = x.numel();
  if (n == 0) return out;
  c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  by_dtype(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    scalar_t* y = out.mutable_data_ptr<scalar_t>();
    const Launch l = plan(n, 16 / sizeof(scalar_t), aligned16(px) && aligned16(y), op);
    swiglu_kernel<scalar_t, ActFwd<Act>><<<l.grid, kThreads, 0, stream>>>(px, nullptr, nullptr, y, nullptr, l.n_vec,
                                                                          n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

template <typename Act>
at::Tensor unary_backward(const char* op, const at::Tensor& grad_output, const at::Tensor& x_in) {
  check_one(op, x_in);
  PG_CHECK(grad_output.defined(), op, ": grad_output must be a defined tensor");
  PG_CHECK(grad_output.device() == x_in.device(), op, ": grad_output is on ", grad_output.device(), " but x is on ",
           x_in.device());
  PG_CHECK(grad_output.sizes() == x_in.sizes(), op, ": grad_output has shape ", grad_output.sizes(), " but x has ",
           x_in.sizes(), "; expected equal shapes");
  PG_CHECK(at::isFloatingType(grad_output.scalar_type()), op, ": grad_output must be a floating point tensor, got ",
           grad_output.scalar_type());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor dy = grad_output.to(x.scalar_type()).contiguous();
  at::Tensor dx = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t n = x.numel();
  if (n == 0) return dx;
  c10::cuda::CUDAGuard guard(x.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  by_dtype(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* pdy = dy.const_data_ptr<scalar_t>();
    const scalar_t* px = x.const_data_ptr<scalar_t>();
    scalar_t* pdx = dx.mutable_data_ptr<scalar_t>();
    const Launch l = plan(n, 16 / sizeof(scalar_t), aligned16(pdy) && aligned16(px) && aligned16(pdx), op);
    swiglu_kernel<scalar_t, ActBwd<Act>><<<l.grid, kThreads, 0, stream>>>(pdy, px, nullptr, pdx, nullptr, l.n_vec,
                                                                          n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return dx;
}

}  // namespace

at::Tensor gelu_forward_cuda(const at::Tensor& x, c10::string_view approximate) {
  return gelu_tanh(kGeluFwd, approximate) ? unary_forward<GeluTanh>(kGeluFwd, x)
                                          : unary_forward<GeluErf>(kGeluFwd, x);
}

at::Tensor gelu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& x, c10::string_view approximate) {
  return gelu_tanh(kGeluBwd, approximate) ? unary_backward<GeluTanh>(kGeluBwd, grad_output, x)
                                          : unary_backward<GeluErf>(kGeluBwd, grad_output, x);
}

at::Tensor squared_relu_forward_cuda(const at::Tensor& x) { return unary_forward<SquaredRelu>(kSquaredReluFwd, x); }

at::Tensor squared_relu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& x) {
  return unary_backward<SquaredRelu>(kSquaredReluBwd, grad_output, x);
}

at::Tensor swiglu_forward_cuda(const at::Tensor& gate, const at::Tensor& up) {
  return pair_forward<Silu>(kFwd, gate, up);
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gate,
                                                        const at::Tensor& up) {
  return pair_backward<Silu>(kBwd, grad_output, gate, up);
}

at::Tensor geglu_forward_cuda(const at::Tensor& gate, const at::Tensor& up, c10::string_view approximate) {
  return gelu_tanh(kGegluFwd, approximate) ? pair_forward<GeluTanh>(kGegluFwd, gate, up)
                                           : pair_forward<GeluErf>(kGegluFwd, gate, up);
}

std::tuple<at::Tensor, at::Tensor> geglu_backward_cuda(const at::Tensor& grad_output, const at::Tensor& gate,
                                                       const at::Tensor& up, c10::string_view approximate) {
  return gelu_tanh(kGegluBwd, approximate) ? pair_backward<GeluTanh>(kGegluBwd, grad_output, gate, up)
                                           : pair_backward<GeluErf>(kGegluBwd, grad_output, gate, up);
}

}  // namespace pipegoose
