// The gated RMSNorm of the linear-attention and state-space layers, forward and backward in one kernel each way, for
// fp32, fp16 and bf16 with fp32 math. Written for pipegoose; ops pipegoose::rms_norm_gated_forward /
// rms_norm_gated_backward / rms_norm_gated (binding: pipegoose/kernels/bindings/rms_norm_gated.cpp; schemas:
// docs/architecture.md "Op schemas").
//
// Two orders, over groups of `group_size` consecutive values of the last dimension D (D a multiple of it; one group =
// the whole row), s(g) = silu(g) = g * sigmoid(g), rstd = rsqrt(mean over the group of v^2 + eps):
//   norm_before_gate = true  (Qwen3-Next's, Qwen3.5's, OLMo-Hybrid's RMSNormGated):  y = x * rstd(x) * w * s(g)
//   norm_before_gate = false (Mamba2's, Bamba's, Nemotron-H's, Zamba2's, Granite-4's, Falcon-H1's MambaRMSNormGated):
//                            z = x * s(g);  y = z * rstd(z) * w
// rms_norm_gated_forward(input [*, D], gate [*, D], weight [D]?, eps, group_size, norm_before_gate, out_dtype?)
//     -> (output [*, D] of out_dtype (default: the input's), rstd float32 [rows, D / group_size])
// rms_norm_gated_backward(grad_output [*, D], input, gate, weight?, rstd, group_size, norm_before_gate, weight_grad)
//     -> (grad_input, grad_gate (the input's dtype), grad_weight (the weight's dtype; an empty [0] tensor of the
//        input's dtype without a weight or with weight_grad false))
// Backward, with n the normalised value (x * rstd, or z * rstd) and m = mean over the group of dn * n:
//   norm_before_gate:  a = n * w;  grad_gate = dy * a * s'(g);  dn = dy * s(g) * w;  grad_w = sum_rows dy * s(g) * n;
//                      grad_input = rstd * (dn - n * m)
//   gate first:        dn = dy * w;  grad_w = sum_rows dy * n;  dz = rstd * (dn - n * m);  grad_input = dz * s(g);
//                      grad_gate = dz * x * s'(g)
// with s'(g) = sigmoid(g) (1 + g (1 - sigmoid(g))), torch's silu_backward. Each value is computed in fp32 from the
// stored inputs and rounded once (transformers' modules round the normalised value to the input's dtype before the
// weight: about one unit in the last place of that dtype apart, the kernel the closer to exact).
//
// Dtypes: input and gate one of fp32 / fp16 / bf16; weight the input's dtype or fp32; out_dtype the input's or fp32;
// grad_output in fp32 or fp64 is read in fp32, of another dtype in the input's. Non-contiguous tensors are copied to contiguous
// ones; outputs are contiguous. 64-bit offsets. Errors (RuntimeError naming the argument): not CUDA, devices differ,
// dtypes as above, an empty last dimension, gate or grad_output not of the input's shape, weight not [D], group_size
// not dividing D or outside [1, 16384], eps negative or not finite, rstd not float32 [rows, D / group_size].
//
// Launch: a block of (tpg, segs) threads, tpg a power of two (the threads of one group's segment of a row, each
// holding up to kPerThread values: tpg = the next power of two of group_size / kPerThread), segs = 256 / tpg
// segments (rows) of one group a block (1 where tpg >= 256). Values move in 16-byte vectors (4 fp32, 8 16-bit) where
// D, the group and every pointer allow, one at a time otherwise, with the same math. The sum of squares and the
// backward's dot product are reduced with warp shuffles (and shared memory across the warps of a segment above 32
// threads). The forward runs one row per segment; the backward's blocks each take a group and rows at a stride
// (enough blocks to fill the GPU once), keep the weight gradient's partial sums in registers, add them over the
// block's segments, and write one row of partial sums a block, which at::sum adds in fp32.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "pipegoose_check.h"
#include "pipegoose_occupancy.h"

namespace pipegoose {
namespace {

constexpr int kPerThread = 16;             // values of a group's segment that one thread holds
constexpr int kMaxGroup = kPerThread * 1024;
constexpr int kBlock = 256;                // threads a block where a segment has fewer

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}
template <typename T, int N>
__device__ __forceinline__ void store(T* p, const Pack<T, N>& v) {
  *reinterpret_cast<Pack<T, N>*>(p) = v;
}

__device__ __forceinline__ float sigmoid(float g) { return __frcp_rn(1.f + __expf(-g)); }

// The sum of v over the tpg = blockDim.x threads of each segment (threadIdx.y): every thread of the block calls it
// (it may synchronise the block) and gets its segment's sum. red: 32 floats of shared memory.
__device__ __forceinline__ float segment_sum(float v, float* red) {
  const int tpg = blockDim.x;
  for (int o = min(tpg, 32) >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (tpg <= 32) return v;
  const int tid = threadIdx.y * tpg + threadIdx.x;
  __syncthreads();   // (red is reused by the next call)
  if ((tid & 31) == 0) red[tid >> 5] = v;
  __syncthreads();
  const int nw = tpg >> 5;
  float s = 0.f;
  for (int i = 0; i < nw; ++i) s += red[threadIdx.y * nw + i];
  return s;
}

template <typename W, int VEC>
__device__ __forceinline__ void load_weight(const W* w, int64_t col, float (&out)[VEC]) {
  if (w == nullptr) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = 1.f;
    return;
  }
  const Pack<W, VEC> p = load<W, VEC>(w + col);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = static_cast<float>(p.v[i]);
}

template <typename T, typename W, typename O, int VEC>
__global__ void __launch_bounds__(1024) forward_kernel(const T* __restrict__ x, const T* __restrict__ g,
                                                       const W* __restrict__ w, O* __restrict__ y,
                                                       float* __restrict__ rstd_out, int64_t rows, int64_t D,
                                                       int group, int groups, float eps, bool norm_first) {
  constexpr int NV = kPerThread / VEC;
  __shared__ float red[32];
  const int tpg = blockDim.x, lane = threadIdx.x;
  const int grp = static_cast<int>(blockIdx.x % groups);
  const int64_t row = static_cast<int64_t>(blockIdx.x / groups) * blockDim.y + threadIdx.y;
  const bool valid = row < rows;
  const int64_t base = row * D + static_cast<int64_t>(grp) * group;
  float a[kPerThread];   // x (norm first) or z = x * s(g) (gate first)
  float ss = 0.f;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int c = (k * tpg + lane) * VEC;
    if (valid && c < group) {
      const Pack<T, VEC> xv = load<T, VEC>(x + base + c);
      if (norm_first) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) a[k * VEC + i] = static_cast<float>(xv.v[i]);
      } else {
        const Pack<T, VEC> gv = load<T, VEC>(g + base + c);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float gf = static_cast<float>(gv.v[i]);
          a[k * VEC + i] = static_cast<float>(xv.v[i]) * (gf * sigmoid(gf));
        }
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) ss += a[k * VEC + i] * a[k * VEC + i];
    }
  }
  ss = segment_sum(ss, red);
  const float r = rsqrtf(ss / static_cast<float>(group) + eps);
  if (!valid) return;   // (no synchronisation below)
  if (lane == 0) rstd_out[row * groups + grp] = r;
#pragma unroll
  for (int k = 0; k < NV; ++k) {
    const int c = (k * tpg + lane) * VEC;
    if (c < group) {
      float wv[VEC];
      load_weight<W, VEC>(w, static_cast<int64_t>(grp) * group + c, wv);
      Pack<O, VEC> out;
      if (norm_first) {
        const Pack<T, VEC> gv = load<T, VEC>(g + base + c);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float gf = static_cast<float>(gv.v[i]);
          out.v[i] = static_cast<O>(a[k * VEC + i] * r * wv[i] * (gf * sigmoid(gf)));
        }
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) out.v[i] = static_cast<O>(a[k * VEC + i] * r * wv[i]);
      }
      store<O, VEC>(y + base + c, out);
    }
  }
}

// kCache: the normalised values and their gradients stay in registers between the two passes over a row (segments of
// up to 256 threads); without it (wider groups, 1024 threads a block, 64 registers a thread) the second pass reads
// the row's inputs again (from L1 / L2: the same thread read them just before).
template <typename T, typename W, typename O, int VEC, bool kCache>
__global__ void __launch_bounds__(kCache ? 256 : 1024)
    backward_kernel(const O* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ g,
                    const W* __restrict__ w, const float* __restrict__ rstd, T* __restrict__ dx, T* __restrict__ dg,
                    float* __restrict__ dw_partial, int64_t rows, int64_t D, int group, int groups, bool norm_first,
                    int64_t row_blocks) {
  constexpr int NV = kPerThread / VEC;
  __shared__ float red[kBlock > 32 ? kBlock : 32];
  const int tpg = blockDim.x, lane = threadIdx.x, segs = blockDim.y;
  const int grp = static_cast<int>(blockIdx.x % groups);
  const int64_t rb = blockIdx.x / groups;
  const int64_t gcol = static_cast<int64_t>(grp) * group;
  float acc[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) acc[i] = 0.f;
  const float inv_group = 1.f / static_cast<float>(group);

  for (int64_t r0 = rb * segs; r0 < rows; r0 += row_blocks * segs) {   // the same trip count for the whole block
    const int64_t row = r0 + threadIdx.y;
    const bool valid = row < rows;
    const int64_t base = row * D + gcol;
    const float r = valid ? rstd[row * groups + grp] : 0.f;
    float n[kCache ? kPerThread : 1], dn[kCache ? kPerThread : 1];
    float dot = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = (k * tpg + lane) * VEC;
      if (valid && c < group) {
        const Pack<T, VEC> xv = load<T, VEC>(x + base + c);
        const Pack<T, VEC> gv = load<T, VEC>(g + base + c);
        const Pack<O, VEC> dyv = load<O, VEC>(dy + base + c);
        float wv[VEC];
        load_weight<W, VEC>(w, gcol + c, wv);
        Pack<T, VEC> dgv;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float xf = static_cast<float>(xv.v[i]), gf = static_cast<float>(gv.v[i]);
          const float d = static_cast<float>(dyv.v[i]);
          const float sig = sigmoid(gf), s = gf * sig;
          float ni, dni;
          if (norm_first) {
            ni = xf * r;
            const float ds = sig * (1.f + gf * (1.f - sig));
            dgv.v[i] = static_cast<T>(d * (ni * wv[i]) * ds);
            const float da = d * s;
            dni = da * wv[i];
            acc[k * VEC + i] += da * ni;
          } else {
            ni = xf * s * r;
            dni = d * wv[i];
            acc[k * VEC + i] += d * ni;
          }
          dot += dni * ni;
          if constexpr (kCache) {
            n[k * VEC + i] = ni;
            dn[k * VEC + i] = dni;
          }
        }
        if (norm_first) store<T, VEC>(dg + base + c, dgv);
      }
    }
    const float m = segment_sum(dot, red) * inv_group;
    if (valid) {
#pragma unroll
      for (int k = 0; k < NV; ++k) {
        const int c = (k * tpg + lane) * VEC;
        if (c < group) {
          float ni[VEC], dni[VEC];
          Pack<T, VEC> xv, gv;
          if (!kCache || !norm_first) {
            xv = load<T, VEC>(x + base + c);
            gv = load<T, VEC>(g + base + c);
          }
          if constexpr (kCache) {
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
              ni[i] = n[k * VEC + i];
              dni[i] = dn[k * VEC + i];
            }
          } else {
            const Pack<O, VEC> dyv = load<O, VEC>(dy + base + c);
            float wv[VEC];
            load_weight<W, VEC>(w, gcol + c, wv);
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
              const float xf = static_cast<float>(xv.v[i]), gf = static_cast<float>(gv.v[i]);
              const float d = static_cast<float>(dyv.v[i]);
              if (norm_first) {
                ni[i] = xf * r;
                dni[i] = d * (gf * sigmoid(gf)) * wv[i];
              } else {
                ni[i] = xf * (gf * sigmoid(gf)) * r;
                dni[i] = d * wv[i];
              }
            }
          }
          Pack<T, VEC> dxv, dgv;
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float dz = r * (dni[i] - ni[i] * m);
            if (norm_first) {
              dxv.v[i] = static_cast<T>(dz);
            } else {
              const float xf = static_cast<float>(xv.v[i]), gf = static_cast<float>(gv.v[i]);
              const float sig = sigmoid(gf);
              dxv.v[i] = static_cast<T>(dz * (gf * sig));
              dgv.v[i] = static_cast<T>(dz * xf * (sig * (1.f + gf * (1.f - sig))));
            }
          }
          store<T, VEC>(dx + base + c, dxv);
          if (!norm_first) store<T, VEC>(dg + base + c, dgv);
        }
      }
    }
  }
  if (dw_partial == nullptr) return;
  // the weight gradient's partial sums: over the block's segments (one group), then one row of partials a block
  float* out = dw_partial + rb * D + gcol;
  if (segs == 1) {
#pragma unroll
    for (int k = 0; k < NV; ++k) {
      const int c = (k * tpg + lane) * VEC;
      if (c < group) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) out[c + i] = acc[k * VEC + i];
      }
    }
    return;
  }
  const int tid = threadIdx.y * tpg + lane;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    __syncthreads();
    red[tid] = acc[j];
    __syncthreads();
    if (threadIdx.y == 0) {
      float s = 0.f;
      for (int q = 0; q < segs; ++q) s += red[q * tpg + lane];
      const int c = ((j / VEC) * tpg + lane) * VEC + j % VEC;
      if (c < group) out[c] = s;
    }
  }
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

int next_pow2(int v) {
  int p = 1;
  while (p < v) p <<= 1;
  return p;
}

struct Plan {
  int tpg, segs, groups;
};

Plan plan_for(int64_t D, int group) {
  const int tpg = next_pow2(std::max(1, (group + kPerThread - 1) / kPerThread));
  return Plan{tpg, tpg >= kBlock ? 1 : kBlock / tpg, static_cast<int>(D / group)};
}

bool is_float_kind(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// The checks both directions make; returns D.
int64_t check_common(const at::Tensor& input, const at::Tensor& gate, const std::optional<at::Tensor>& weight,
                     int64_t group_size) {
  PG_CHECK(input.is_cuda(), "input: expected a CUDA tensor, got device ", input.device());
  PG_CHECK(is_float_kind(input.scalar_type()), "input: expected dtype float32, float16 or bfloat16, got ",
           input.scalar_type());
  PG_CHECK(input.dim() >= 1, "input: expected at least one dimension [*, D]");
  PG_CHECK(gate.device() == input.device(), "gate: on ", gate.device(), ", expected the input's device ",
           input.device());
  PG_CHECK(gate.scalar_type() == input.scalar_type(), "gate: expected the input's dtype ", input.scalar_type(),
           ", got ", gate.scalar_type());
  PG_CHECK(gate.sizes() == input.sizes(), "gate: expected the input's shape ", input.sizes(), ", got ",
           gate.sizes());
  const int64_t D = input.size(-1);
  PG_CHECK(D >= 1, "input: expected a last dimension D >= 1, got shape ", input.sizes());
  PG_CHECK(group_size >= 1 && group_size <= kMaxGroup, "group_size: expected 1 to ", kMaxGroup, ", got ",
           group_size);
  PG_CHECK(D % group_size == 0, "group_size: expected a divisor of the last dimension ", D, ", got ", group_size);
  PG_CHECK(D / group_size <= std::numeric_limits<int>::max(), "group_size: ", D / group_size,
           " groups a row exceed the kernel's int count");
  if (weight.has_value()) {
    const at::Tensor& w = *weight;
    PG_CHECK(w.device() == input.device(), "weight: on ", w.device(), ", expected the input's device ",
             input.device());
    PG_CHECK(w.scalar_type() == input.scalar_type() || w.scalar_type() == at::kFloat,
             "weight: expected the input's dtype ", input.scalar_type(), " or float32, got ", w.scalar_type());
    PG_CHECK(w.dim() == 1 && w.size(0) == D, "weight: expected shape [", D, "] (the input's last dimension), got ",
             w.sizes());
  }
  return D;
}

template <typename F>
void by_weight_and_out(at::ScalarType t, at::ScalarType wt, at::ScalarType ot, F&& f) {
  by_dtype(t, [&](auto tv) {
    using T = decltype(tv);
    const bool wf = wt == at::kFloat, of = ot == at::kFloat;
    if (wf && of) {
      f(T{}, float{}, float{});
    } else if (wf) {
      f(T{}, float{}, T{});
    } else if (of) {
      f(T{}, T{}, float{});
    } else {
      f(T{}, T{}, T{});
    }
  });
}

}  // namespace
}  // namespace pipegoose

// The entry points (global, as the binding declares them).
using pipegoose::aligned;
using pipegoose::by_weight_and_out;
using pipegoose::check_common;
using pipegoose::kBlock;
using pipegoose::Plan;
using pipegoose::plan_for;

std::tuple<at::Tensor, at::Tensor> rms_norm_gated_forward_cuda(const at::Tensor& input_, const at::Tensor& gate_,
                                                               const std::optional<at::Tensor>& weight_, double eps,
                                                               int64_t group_size, bool norm_before_gate,
                                                               std::optional<at::ScalarType> out_dtype) {
  const int64_t D = check_common(input_, gate_, weight_, group_size);
  PG_CHECK(std::isfinite(eps) && eps >= 0.0, "eps: expected a finite number >= 0, got ", eps);
  const at::ScalarType ot = out_dtype.value_or(input_.scalar_type());
  PG_CHECK(ot == input_.scalar_type() || ot == at::kFloat, "out_dtype: expected the input's dtype ",
           input_.scalar_type(), " or float32, got ", ot);
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = input_.contiguous(), gate = gate_.contiguous();
  const std::optional<at::Tensor> weight =
      weight_.has_value() ? std::optional<at::Tensor>(weight_->contiguous()) : std::nullopt;
  const int64_t rows = input.numel() / D;
  const Plan plan = plan_for(D, static_cast<int>(group_size));
  at::Tensor y = at::empty(input.sizes(), input.options().dtype(ot));
  at::Tensor rstd = at::empty({rows, plan.groups}, input.options().dtype(at::kFloat));
  if (rows == 0) return {y, rstd};
  const int64_t blocks = (rows + plan.segs - 1) / plan.segs * plan.groups;
  PG_CHECK(blocks <= std::numeric_limits<int>::max(), "input: ", rows, " rows of ", plan.groups,
           " groups exceed one launch's blocks");
  const at::ScalarType wt = weight.has_value() ? weight->scalar_type() : input.scalar_type();
  const auto stream = at::cuda::getCurrentCUDAStream();
  by_weight_and_out(input.scalar_type(), wt, ot, [&](auto tv, auto wv, auto ov) {
    using T = decltype(tv);
    using W = decltype(wv);
    using O = decltype(ov);
    constexpr int V = 16 / sizeof(T);
    const T* xp = static_cast<const T*>(input.data_ptr());
    const T* gp = static_cast<const T*>(gate.data_ptr());
    const W* wp = weight.has_value() ? static_cast<const W*>(weight->data_ptr()) : nullptr;
    O* yp = static_cast<O*>(y.data_ptr());
    const bool vec = D % V == 0 && group_size % V == 0 && aligned(xp, 16) && aligned(gp, 16) &&
                     aligned(yp, V * sizeof(O)) && (wp == nullptr || aligned(wp, V * sizeof(W)));
    const dim3 block(plan.tpg, plan.segs);
    auto k = vec ? pipegoose::forward_kernel<T, W, O, V> : pipegoose::forward_kernel<T, W, O, 1>;
    k<<<static_cast<unsigned>(blocks), block, 0, stream>>>(xp, gp, wp, yp, rstd.data_ptr<float>(), rows, D,
                                                           static_cast<int>(group_size), plan.groups,
                                                           static_cast<float>(eps), norm_before_gate);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rms_norm_gated_backward_cuda(
    const at::Tensor& grad_output_, const at::Tensor& input_, const at::Tensor& gate_,
    const std::optional<at::Tensor>& weight_, const at::Tensor& rstd_, int64_t group_size, bool norm_before_gate,
    bool weight_grad) {
  const int64_t D = check_common(input_, gate_, weight_, group_size);
  PG_CHECK(grad_output_.device() == input_.device(), "grad_output: on ", grad_output_.device(),
           ", expected the input's device ", input_.device());
  PG_CHECK(grad_output_.sizes() == input_.sizes(), "grad_output: expected the input's shape ", input_.sizes(),
           ", got ", grad_output_.sizes());
  PG_CHECK(grad_output_.is_floating_point(), "grad_output: expected a floating point tensor, got ",
           grad_output_.scalar_type());
  const int64_t rows = input_.numel() / D;
  const Plan plan = plan_for(D, static_cast<int>(group_size));
  PG_CHECK(rstd_.device() == input_.device() && rstd_.scalar_type() == at::kFloat && rstd_.dim() == 2 &&
               rstd_.size(0) == rows && rstd_.size(1) == plan.groups,
           "rstd: expected a float32 tensor [", rows, ", ", plan.groups, "] on ", input_.device(),
           " (the forward's), got ", rstd_.scalar_type(), " ", rstd_.sizes(), " on ", rstd_.device());
  const c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = input_.contiguous(), gate = gate_.contiguous(), rstd = rstd_.contiguous();
  const std::optional<at::Tensor> weight =
      weight_.has_value() ? std::optional<at::Tensor>(weight_->contiguous()) : std::nullopt;
  // the output gradient in fp32 (given in fp32 or fp64) or else the input's dtype (the forward's two output dtypes)
  const at::ScalarType g_t = grad_output_.scalar_type();
  const at::ScalarType ot = g_t == at::kFloat || g_t == at::kDouble ? at::kFloat : input.scalar_type();
  const at::Tensor dy = grad_output_.to(ot).contiguous();
  at::Tensor dx = at::empty(input.sizes(), input.options());
  at::Tensor dg = at::empty(input.sizes(), input.options());
  const bool want_dw = weight.has_value() && weight_grad;
  at::Tensor dw = want_dw ? at::Tensor() : at::empty({0}, input.options());
  if (rows == 0) {
    if (want_dw) dw = at::zeros_like(*weight);
    return {dx, dg, dw};
  }
  const at::ScalarType wt = weight.has_value() ? weight->scalar_type() : input.scalar_type();
  const auto stream = at::cuda::getCurrentCUDAStream();
  by_weight_and_out(input.scalar_type(), wt, ot, [&](auto tv, auto wv, auto ov) {
    using T = decltype(tv);
    using W = decltype(wv);
    using O = decltype(ov);
    constexpr int V = 16 / sizeof(T);
    const T* xp = static_cast<const T*>(input.data_ptr());
    const T* gp = static_cast<const T*>(gate.data_ptr());
    const O* dyp = static_cast<const O*>(dy.data_ptr());
    const W* wp = weight.has_value() ? static_cast<const W*>(weight->data_ptr()) : nullptr;
    T* dxp = static_cast<T*>(dx.data_ptr());
    T* dgp = static_cast<T*>(dg.data_ptr());
    const bool vec = D % V == 0 && group_size % V == 0 && aligned(xp, 16) && aligned(gp, 16) && aligned(dxp, 16) &&
                     aligned(dgp, 16) && aligned(dyp, V * sizeof(O)) && (wp == nullptr || aligned(wp, V * sizeof(W)));
    const bool cache = plan.tpg <= kBlock;
    using Kernel = void (*)(const O*, const T*, const T*, const W*, const float*, T*, T*, float*, int64_t, int64_t,
                            int, int, bool, int64_t);
    using pipegoose::backward_kernel;
    Kernel k = vec ? (cache ? backward_kernel<T, W, O, V, true> : backward_kernel<T, W, O, V, false>)
                   : (cache ? backward_kernel<T, W, O, 1, true> : backward_kernel<T, W, O, 1, false>);
    const int threads = plan.tpg * plan.segs;
    // enough blocks to fill the GPU once (each takes a group and every row_blocks-th segment of rows)
    const int64_t fill = static_cast<int64_t>(pipegoose::sm_count()) *
                         pipegoose::occupancy(reinterpret_cast<const void*>(k), threads, 0);
    const int64_t row_blocks =
        std::max<int64_t>(1, std::min<int64_t>((rows + plan.segs - 1) / plan.segs, fill / plan.groups));
    PG_CHECK(row_blocks * plan.groups <= std::numeric_limits<int>::max(), "input: ", plan.groups,
             " groups exceed one launch's blocks");
    at::Tensor partial;
    if (want_dw) partial = at::empty({row_blocks, D}, input.options().dtype(at::kFloat));
    k<<<static_cast<unsigned>(row_blocks * plan.groups), dim3(plan.tpg, plan.segs), 0, stream>>>(
        dyp, xp, gp, wp, rstd.data_ptr<float>(), dxp, dgp, want_dw ? partial.data_ptr<float>() : nullptr, rows, D,
        static_cast<int>(group_size), plan.groups, norm_before_gate, row_blocks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (want_dw) dw = (row_blocks == 1 ? partial.view({D}) : partial.sum(0)).to(weight->scalar_type());
  });
  return {dx, dg, dw};
}
