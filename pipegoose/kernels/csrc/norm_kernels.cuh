// LayerNorm and RMSNorm forward/backward kernels, written for pipegoose (private header shared by
// layer_norm.cu and rms_norm.cu; the bool template parameter RMS selects the norm).
//
// Layout. A row of H elements is cut into "chunks" of VEC elements (VEC * sizeof(input) = 16 bytes when the
// row length and every pointer allow it, VEC = 1 otherwise). TPR threads work on one row; thread t owns the
// chunks t, t + TPR, ..., t + (NV - 1) * TPR, so each thread holds NV * VEC values in registers and every
// register array is indexed with compile-time constants. TPR <= 32 is a power of two (sub-warp groups);
// TPR > 32 is a multiple of 32 (several warps per row, reduced through shared memory). A block holds
// RPB = blockDim.x / TPR row groups.
//
// Forward: one read of x, one write of y, two-pass mean/variance from registers.
// Backward: a persistent grid; each block walks over many rows, keeps per-column partial sums of dy * xhat
// (and dy) in fp32 (registers, or shared memory for the widest rows), writes one partial row per block into an
// fp32 workspace [nacc, blocks, H], and norm_col_reduce_kernel sums the partial rows column-wise in a fixed
// order (deterministic, no atomics).
// Rows wider than the register capacity take the *_generic kernels (block per row, re-reading the row).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <initializer_list>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

namespace pipegoose {
namespace norm {

// ---------------------------------------------------------------------------------------------------------
// Element conversions and vector access
// ---------------------------------------------------------------------------------------------------------
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Reads N consecutive elements at p (aligned to N * sizeof(T)) as floats.
template <int N, typename T>
__device__ __forceinline__ void load_f(const T* __restrict__ p, float (&out)[N]) {
  const Pack<T, N> r = *reinterpret_cast<const Pack<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = to_f(r.v[i]);
}

template <int N, typename T>
__device__ __forceinline__ void store_f(T* __restrict__ p, const float (&in)[N]) {
  Pack<T, N> r;
#pragma unroll
  for (int i = 0; i < N; ++i) r.v[i] = from_f<T>(in[i]);
  *reinterpret_cast<Pack<T, N>*>(p) = r;
}

// Parameters (weight, bias) are float32 or the input's dtype, chosen at run time (p_f32): the branch is uniform
// and halves the number of kernel instantiations.
template <int N, typename Tin>
__device__ __forceinline__ void load_param(const void* __restrict__ p, bool p_f32, int off, float (&out)[N]) {
  if (p_f32) {
    load_f<N>(static_cast<const float*>(p) + off, out);
  } else {
    load_f<N>(static_cast<const Tin*>(p) + off, out);
  }
}

template <typename Tin>
__device__ __forceinline__ float param_at(const void* __restrict__ p, bool p_f32, int j) {
  return p_f32 ? static_cast<const float*>(p)[j] : to_f(static_cast<const Tin*>(p)[j]);
}

// ---------------------------------------------------------------------------------------------------------
// Row reduction
// ---------------------------------------------------------------------------------------------------------
// Sums K values over the TPR threads of each row group; every thread of the group gets the same (bitwise)
// result: the xor butterfly adds the same two operands on both partners, and the cross-warp step reads the
// partials in one fixed order. buf: shared float[K * 32] (one slot per warp of the block). Callers alternate
// two buffers between consecutive calls, which makes one __syncthreads per call enough. Every thread of the
// block must call it (it may synchronise the block).
template <int K>
__device__ __forceinline__ void row_sum(float (&v)[K], int tpr, float* buf) {
  const int width = tpr < 32 ? tpr : 32;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    if (off < width) {
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] += __shfl_xor_sync(0xffffffffu, v[k], off);
    }
  }
  if (tpr > 32) {
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
      for (int k = 0; k < K; ++k) buf[k * 32 + warp] = v[k];
    }
    __syncthreads();
    const int nw = tpr >> 5;
    const int first = (warp / nw) * nw;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      float s = 0.f;
      for (int i = 0; i < nw; ++i) s += buf[k * 32 + first + i];
      v[k] = s;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------------------
template <int NV, int VEC>
struct FwdBounds {
  static constexpr int value = NV * VEC <= 32 ? 1024 : 512;
};

// x [rows, H] (Tin), w/b [H] (float32 when p_f32, else Tin; either may be null), y [rows, H] (Tout), mean/rstd
// [rows] fp32 (mean unused when RMS). Requires H % VEC == 0 and every pointer aligned to VEC elements when
// VEC > 1, and ceil(H / VEC) <= NV * tpr.
template <typename Tin, typename Tout, int VEC, int NV, bool RMS>
__global__ void __launch_bounds__(FwdBounds<NV, VEC>::value)
norm_fwd_kernel(const Tin* __restrict__ x, const void* __restrict__ w, const void* __restrict__ b, bool p_f32,
                Tout* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                int64_t rows, int H, int tpr, float eps) {
  __shared__ float red[2][32];
  const int rpb = blockDim.x / tpr;
  const int rg = threadIdx.x / tpr;
  const int t = threadIdx.x - rg * tpr;
  const int nchunks = H / VEC;  // exact: VEC == 1 or H % VEC == 0
  const float inv_h = 1.f / static_cast<float>(H);
  int parity = 0;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * rpb; base < rows;
       base += static_cast<int64_t>(gridDim.x) * rpb) {
    const int64_t row = base + rg;
    const bool valid = row < rows;
    const Tin* xr = x + row * H;
    float v[NV][VEC];
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const int c = t + n * tpr;
      if (valid && c < nchunks) {
        load_f<VEC>(xr + static_cast<int64_t>(c) * VEC, v[n]);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[n][i] = 0.f;
      }
    }
    float mean = 0.f;
    if constexpr (!RMS) {
      float s[1] = {0.f};
#pragma unroll
      for (int n = 0; n < NV; ++n)
#pragma unroll
        for (int i = 0; i < VEC; ++i) s[0] += v[n][i];
      row_sum<1>(s, tpr, red[parity]);
      parity ^= 1;
      mean = s[0] * inv_h;
    }
    float q[1] = {0.f};
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const bool in = (t + n * tpr) < nchunks;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float d = in ? v[n][i] - mean : 0.f;
        q[0] += d * d;
      }
    }
    row_sum<1>(q, tpr, red[parity]);
    parity ^= 1;
    const float rstd = rsqrtf(q[0] * inv_h + eps);
    if (valid) {
      if (t == 0) {
        if constexpr (!RMS) mean_out[row] = mean;
        rstd_out[row] = rstd;
      }
      Tout* yr = y + row * H;
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int c = t + n * tpr;
        if (c < nchunks) {
          float o[VEC];
#pragma unroll
          for (int i = 0; i < VEC; ++i) o[i] = (v[n][i] - mean) * rstd;
          if (w != nullptr) {
            float wv[VEC];
            load_param<VEC, Tin>(w, p_f32, c * VEC, wv);
#pragma unroll
            for (int i = 0; i < VEC; ++i) o[i] *= wv[i];
          }
          if constexpr (!RMS) {
            if (b != nullptr) {
              float bv[VEC];
              load_param<VEC, Tin>(b, p_f32, c * VEC, bv);
#pragma unroll
              for (int i = 0; i < VEC; ++i) o[i] += bv[i];
            }
          }
          store_f<VEC>(yr + static_cast<int64_t>(c) * VEC, o);
        }
      }
    }
  }
}

// Any H: one block per row (grid-stride), the row is read three times (LN) / twice (RMS); later reads mostly
// hit L2. blockDim.x must be a multiple of 32.
template <typename Tin, typename Tout, bool RMS>
__global__ void __launch_bounds__(1024)
norm_fwd_generic_kernel(const Tin* __restrict__ x, const void* __restrict__ w, const void* __restrict__ b, bool p_f32,
                        Tout* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                        int64_t rows, int H, float eps) {
  __shared__ float red[2][32];
  const int tpr = blockDim.x;
  const float inv_h = 1.f / static_cast<float>(H);
  int parity = 0;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const Tin* xr = x + row * H;
    float mean = 0.f;
    if constexpr (!RMS) {
      float s[1] = {0.f};
      for (int j = threadIdx.x; j < H; j += tpr) s[0] += to_f(xr[j]);
      row_sum<1>(s, tpr, red[parity]);
      parity ^= 1;
      mean = s[0] * inv_h;
    }
    float q[1] = {0.f};
    for (int j = threadIdx.x; j < H; j += tpr) {
      const float d = to_f(xr[j]) - mean;
      q[0] += d * d;
    }
    row_sum<1>(q, tpr, red[parity]);
    parity ^= 1;
    const float rstd = rsqrtf(q[0] * inv_h + eps);
    if (threadIdx.x == 0) {
      if constexpr (!RMS) mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
    Tout* yr = y + row * H;
    for (int j = threadIdx.x; j < H; j += tpr) {
      float o = (to_f(xr[j]) - mean) * rstd;
      if (w != nullptr) o *= param_at<Tin>(w, p_f32, j);
      if constexpr (!RMS) {
        if (b != nullptr) o += param_at<Tin>(b, p_f32, j);
      }
      yr[j] = from_f<Tout>(o);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------------------
// LN:  xhat = (x - mean) * rstd, g = w * dy,  dx = rstd * (g - mean_j(g) - xhat * mean_j(g * xhat))
// RMS: xhat = x * rstd,          g = w * dy,  dx = rstd * (g - xhat * mean_j(g * xhat))
// dw_j = sum_rows dy * xhat, db_j = sum_rows dy.
//
// dy [rows, H] (Tdy), x [rows, H] (Tin), w [H] (float32 when p_f32, else Tin; or null), mean/rstd [rows] fp32,
// dx [rows, H] (Tin). ws: fp32 [NACC, gridDim.x, H] (NACC = 2 for LN: dw, db; 1 for RMS), or null when no
// parameter gradient is wanted. ACC_SMEM (the widest rows, 32 values per thread): the per-column sums live in
// dynamic shared memory [NACC][tpr][NV * VEC + 1] instead of registers; it requires one row group per block. Otherwise, with several row groups per block, dynamic
// shared memory [RPB][H] floats combines the row groups at the end.
template <typename Tin, typename Tdy, int VEC, int NV, bool RMS, bool ACC_SMEM>
__global__ void __launch_bounds__(512)
norm_bwd_kernel(const Tdy* __restrict__ dy, const Tin* __restrict__ x, const void* __restrict__ w, bool p_f32,
                const float* __restrict__ mean, const float* __restrict__ rstd, Tin* __restrict__ dx,
                float* __restrict__ ws, int64_t rows, int H, int tpr) {
  constexpr int NACC = RMS ? 1 : 2;
  extern __shared__ float dyn_smem[];
  __shared__ float red[2][64];
  const int rpb = blockDim.x / tpr;
  const int rg = threadIdx.x / tpr;
  const int t = threadIdx.x - rg * tpr;
  const int nchunks = H / VEC;
  const float inv_h = 1.f / static_cast<float>(H);
  // ACC_SMEM: thread t's NV * VEC slots are contiguous (compile-time offsets from one base: no address
  // registers) with a stride of NV * VEC + 1 words between threads (odd: no bank conflicts).
  const int acc_stride = (NV * VEC + 1) * tpr;  // floats per accumulator
  float* acc_t = dyn_smem + t * (NV * VEC + 1);

  float acc_w[ACC_SMEM ? 1 : NV][ACC_SMEM ? 1 : VEC];
  float acc_b[ACC_SMEM ? 1 : NV][ACC_SMEM ? 1 : VEC];  // unused (and dropped by the compiler) when RMS
  float wreg[ACC_SMEM ? 1 : NV][ACC_SMEM ? 1 : VEC];
  if constexpr (ACC_SMEM) {
    // Only the owning thread ever touches its slots: no barrier needed.
#pragma unroll
    for (int a = 0; a < NACC; ++a)
#pragma unroll
      for (int k = 0; k < NV * VEC; ++k) acc_t[a * acc_stride + k] = 0.f;
  } else {
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const int c = t + n * tpr;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        acc_w[n][i] = 0.f;
        acc_b[n][i] = 0.f;
        wreg[n][i] = 1.f;
      }
      if (w != nullptr && c < nchunks) load_param<VEC, Tin>(w, p_f32, c * VEC, wreg[n]);
    }
  }

  int parity = 0;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * rpb; base < rows;
       base += static_cast<int64_t>(gridDim.x) * rpb) {
    const int64_t row = base + rg;
    const bool valid = row < rows;
    // x stays in its own (packed) type: xhat is recomputed from it in the second pass, which saves registers.
    Pack<Tin, VEC> xv[NV];
    float gv[NV][VEC];
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const int c = t + n * tpr;
      if (valid && c < nchunks) {
        xv[n] = *reinterpret_cast<const Pack<Tin, VEC>*>(x + row * H + static_cast<int64_t>(c) * VEC);
        load_f<VEC>(dy + row * H + static_cast<int64_t>(c) * VEC, gv[n]);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          xv[n].v[i] = from_f<Tin>(0.f);
          gv[n][i] = 0.f;
        }
      }
    }
    const float m = (!RMS && valid) ? mean[row] : 0.f;
    const float r = valid ? rstd[row] : 0.f;
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const int c = t + n * tpr;
      float wv[VEC];
      if constexpr (ACC_SMEM) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) wv[i] = 1.f;
        if (w != nullptr && c < nchunks) load_param<VEC, Tin>(w, p_f32, c * VEC, wv);
      } else {
#pragma unroll
        for (int i = 0; i < VEC; ++i) wv[i] = wreg[n][i];
      }
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float xh = (to_f(xv[n].v[i]) - m) * r;  // out-of-row slots: dy == 0, so they add nothing below
        const float d = gv[n][i];
        if constexpr (ACC_SMEM) {
          if (c < nchunks) {
            acc_t[n * VEC + i] += d * xh;
            if constexpr (!RMS) acc_t[acc_stride + n * VEC + i] += d;
          }
        } else {
          acc_w[n][i] += d * xh;
          if constexpr (!RMS) acc_b[n][i] += d;
        }
        const float g = d * wv[i];
        gv[n][i] = g;
        if constexpr (!RMS) s[0] += g;
        s[1] += g * xh;
      }
    }
    row_sum<2>(s, tpr, red[parity]);
    parity ^= 1;
    if (valid) {
      const float c1 = RMS ? 0.f : s[0] * inv_h;
      const float c2 = s[1] * inv_h;
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int c = t + n * tpr;
        if (c < nchunks) {
          float o[VEC];
#pragma unroll
          for (int i = 0; i < VEC; ++i) o[i] = r * (gv[n][i] - c1 - (to_f(xv[n].v[i]) - m) * r * c2);
          store_f<VEC>(dx + row * H + static_cast<int64_t>(c) * VEC, o);
        }
      }
    }
  }

  if (ws == nullptr) return;
  const int64_t P = gridDim.x;
  if constexpr (ACC_SMEM) {
#pragma unroll
    for (int a = 0; a < NACC; ++a) {
      float* out = ws + (a * P + blockIdx.x) * static_cast<int64_t>(H);
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int c = t + n * tpr;
        if (c < nchunks) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) out[c * VEC + i] = acc_t[a * acc_stride + n * VEC + i];
        }
      }
    }
  } else if (rpb == 1) {
#pragma unroll
    for (int a = 0; a < NACC; ++a) {
      float* out = ws + (a * P + blockIdx.x) * static_cast<int64_t>(H);
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int c = t + n * tpr;
        if (c < nchunks) {
          store_f<VEC>(out + c * VEC, a == 0 ? acc_w[n] : acc_b[n]);
        }
      }
    }
  } else {
    // Combine the row groups of the block in a fixed order, one accumulator at a time.
#pragma unroll
    for (int a = 0; a < NACC; ++a) {
      __syncthreads();  // previous readers of dyn_smem are done
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int c = t + n * tpr;
        if (c < nchunks) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            dyn_smem[rg * H + c * VEC + i] = a == 0 ? acc_w[n][i] : acc_b[n][i];
          }
        }
      }
      __syncthreads();
      float* out = ws + (a * P + blockIdx.x) * static_cast<int64_t>(H);
      for (int j = threadIdx.x; j < H; j += blockDim.x) {
        float sum = 0.f;
        for (int g = 0; g < rpb; ++g) sum += dyn_smem[g * H + j];
        out[j] = sum;
      }
    }
  }
}

// Any H: one block per row (persistent grid), two passes over the row; the per-column sums accumulate in the
// block's own workspace rows (each column always updated by the same thread, so no races).
template <typename Tin, typename Tdy, bool RMS>
__global__ void __launch_bounds__(1024)
norm_bwd_generic_kernel(const Tdy* __restrict__ dy, const Tin* __restrict__ x, const void* __restrict__ w, bool p_f32,
                        const float* __restrict__ mean, const float* __restrict__ rstd, Tin* __restrict__ dx,
                        float* __restrict__ ws, int64_t rows, int H) {
  __shared__ float red[2][64];
  const int tpr = blockDim.x;
  const float inv_h = 1.f / static_cast<float>(H);
  const int64_t P = gridDim.x;
  float* ws_w = ws == nullptr ? nullptr : ws + static_cast<int64_t>(blockIdx.x) * H;
  float* ws_b = (ws == nullptr || RMS) ? nullptr : ws + (P + blockIdx.x) * static_cast<int64_t>(H);
  if (ws != nullptr) {
    for (int j = threadIdx.x; j < H; j += tpr) {
      ws_w[j] = 0.f;
      if constexpr (!RMS) ws_b[j] = 0.f;
    }
  }
  int parity = 0;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const Tin* xr = x + row * H;
    const Tdy* dyr = dy + row * H;
    const float m = RMS ? 0.f : mean[row];
    const float r = rstd[row];
    float s[2] = {0.f, 0.f};
    for (int j = threadIdx.x; j < H; j += tpr) {
      const float xh = (to_f(xr[j]) - m) * r;
      const float d = to_f(dyr[j]);
      const float g = w != nullptr ? d * param_at<Tin>(w, p_f32, j) : d;
      if constexpr (!RMS) s[0] += g;
      s[1] += g * xh;
      if (ws != nullptr) {
        ws_w[j] += d * xh;
        if constexpr (!RMS) ws_b[j] += d;
      }
    }
    row_sum<2>(s, tpr, red[parity]);
    parity ^= 1;
    const float c1 = RMS ? 0.f : s[0] * inv_h;
    const float c2 = s[1] * inv_h;
    Tin* dxr = dx + row * H;
    for (int j = threadIdx.x; j < H; j += tpr) {
      const float xh = (to_f(xr[j]) - m) * r;
      const float d = to_f(dyr[j]);
      const float g = w != nullptr ? d * param_at<Tin>(w, p_f32, j) : d;
      dxr[j] = from_f<Tin>(r * (g - c1 - xh * c2));
    }
  }
}

// ws fp32 [NACC, P, H] -> out_a[H] = sum_p ws[0, p, :] (TA), out_b[H] = sum_p ws[1, p, :] (TB, may be null).
// Block (32, 16): 32 columns per block, the 16 thread rows stride over P; fixed summation order.
template <typename TA, typename TB>
__global__ void __launch_bounds__(512)
norm_col_reduce_kernel(const float* __restrict__ ws, int64_t P, int H, TA* __restrict__ out_a,
                       TB* __restrict__ out_b) {
  __shared__ float sa[16][33];
  __shared__ float sb[16][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  float a = 0.f, bsum = 0.f;
  if (col < H) {
    for (int64_t p = threadIdx.y; p < P; p += 16) {
      if (out_a != nullptr) a += ws[p * H + col];
      if (out_b != nullptr) bsum += ws[(P + p) * H + col];
    }
  }
  sa[threadIdx.y][threadIdx.x] = a;
  sb[threadIdx.y][threadIdx.x] = bsum;
  __syncthreads();
  if (threadIdx.y == 0 && col < H) {
    float ta = 0.f, tb = 0.f;
#pragma unroll
    for (int k = 0; k < 16; ++k) {
      ta += sa[k][threadIdx.x];
      tb += sb[k][threadIdx.x];
    }
    if (out_a != nullptr) out_a[col] = from_f<TA>(ta);
    if (out_b != nullptr) out_b[col] = from_f<TB>(tb);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Host side: configuration choice and launches
// ---------------------------------------------------------------------------------------------------------
template <int V> struct IC { static constexpr int value = V; };

template <typename T> struct CudaT { using type = T; };
template <> struct CudaT<at::Half> { using type = __half; };
template <> struct CudaT<at::BFloat16> { using type = __nv_bfloat16; };

struct Cfg {
  int nv = 0;    // chunks per thread; 0 = generic kernel
  int tpr = 0;   // threads per row
  bool acc_smem = false;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int round_tpr(int64_t n) {
  if (n <= 32) {
    int p = 1;
    while (p < n) p <<= 1;
    return p;
  }
  return static_cast<int>(ceil_div(n, 32) * 32);
}

// nvs: ascending chunks-per-thread choices instantiated (register path). Prefer a warp (or less) per row for
// short rows, then about 256 threads per row, then up to max_tpr with the most values per thread; acc_nv > 0: the backward's shared-memory
// accumulator variant with acc_nv chunks per thread and up to 512 threads per row; else the generic kernel.
inline Cfg choose(int64_t chunks, std::initializer_list<int> nvs, int max_tpr, int acc_nv) {
  for (int nv : nvs) {
    if (nv <= 4 && ceil_div(chunks, nv) <= 32) return {nv, round_tpr(ceil_div(chunks, nv)), false};
  }
  for (int nv : nvs) {
    const int tpr = round_tpr(ceil_div(chunks, nv));
    if (tpr <= 256) return {nv, tpr, false};
  }
  Cfg best;  // wide rows: the most values per thread (fewest warps to reduce over) that fits
  for (int nv : nvs) {
    const int tpr = round_tpr(ceil_div(chunks, nv));
    if (tpr <= max_tpr) best = {nv, tpr, false};
  }
  if (best.nv != 0) return best;
  if (acc_nv > 0) {
    const int tpr = round_tpr(ceil_div(chunks, acc_nv));
    if (tpr <= 512) return {acc_nv, tpr, true};
  }
  return Cfg{};  // generic
}

inline int rows_per_block(int tpr) { return tpr >= 256 ? 1 : 256 / tpr; }

inline bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

inline int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// Resident blocks per SM for a kernel at a block size and dynamic smem size (cached per device).
inline int occupancy(const void* kernel, int threads, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, size_t>, int> cache;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const auto key = std::make_tuple(dev, kernel, threads, smem);
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  int n = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
  n = std::max(n, 1);
  std::lock_guard<std::mutex> lock(mu);
  cache[key] = n;
  return n;
}

inline void allow_smem(const void* kernel, size_t smem) {
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
}

constexpr int64_t kMaxGrid = 2147483647LL;

template <typename Tin, typename Tout, bool RMS>
void launch_fwd(const Tin* x, const void* w, const void* b, bool p_f32, Tout* y, float* mean, float* rstd,
                int64_t rows, int H, float eps, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(Tin);
  const int pbytes = V * (p_f32 ? 4 : static_cast<int>(sizeof(Tin)));
  bool vec = H % V == 0 && aligned(x, 16) && aligned(y, V * sizeof(Tout));
  if (w != nullptr) vec = vec && aligned(w, pbytes);
  if (b != nullptr) vec = vec && aligned(b, pbytes);
  // Register path: up to 32 values per thread, 1024 threads per row.
  const Cfg cfg = vec ? choose(H / V, {1, 2, 4}, 1024, 0) : choose(H, {4}, 1024, 0);
  if (cfg.nv == 0) {
    const int threads = 1024;
    const int64_t grid = std::min<int64_t>(rows, static_cast<int64_t>(sm_count()) * 2);
    norm_fwd_generic_kernel<Tin, Tout, RMS><<<static_cast<unsigned>(grid), threads, 0, stream>>>(
        x, w, b, p_f32, y, mean, rstd, rows, H, eps);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const int rpb = rows_per_block(cfg.tpr);
  const int threads = rpb * cfg.tpr;
  const int64_t grid = std::min<int64_t>(ceil_div(rows, rpb), kMaxGrid);
  auto go = [&](auto nv_c, auto vec_c) {
    constexpr int NV = decltype(nv_c)::value;
    constexpr int VEC = decltype(vec_c)::value;
    norm_fwd_kernel<Tin, Tout, VEC, NV, RMS><<<static_cast<unsigned>(grid), threads, 0, stream>>>(
        x, w, b, p_f32, y, mean, rstd, rows, H, cfg.tpr, eps);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (vec) {
    switch (cfg.nv) {
      case 1: go(IC<1>{}, IC<V>{}); break;
      case 2: go(IC<2>{}, IC<V>{}); break;
      default: go(IC<4>{}, IC<V>{}); break;
    }
  } else {
    go(IC<4>{}, IC<1>{});
  }
}

// Backward (dx, plus the workspace partial rows when ws_out is requested). Returns the workspace [NACC, P, H]
// (undefined when want_ws is false). The caller reduces it with launch_col_reduce.
template <typename Tin, typename Tdy, bool RMS>
at::Tensor launch_bwd(const Tdy* dy, const Tin* x, const void* w, bool p_f32, const float* mean, const float* rstd,
                      Tin* dx, int64_t rows, int H, bool want_ws, const at::TensorOptions& fopts,
                      cudaStream_t stream) {
  constexpr int NACC = RMS ? 1 : 2;
  constexpr int V = 16 / sizeof(Tin);
  const int pbytes = V * (p_f32 ? 4 : static_cast<int>(sizeof(Tin)));
  bool vec = H % V == 0 && aligned(x, 16) && aligned(dx, 16) && aligned(dy, V * sizeof(Tdy));
  if (w != nullptr) vec = vec && aligned(w, pbytes);
  // Register path: x, g, w and the NACC column sums, 16 values each per thread, up to 512 threads per row;
  // then the shared-memory accumulator variant (32 values of x and g per thread).
  const Cfg cfg = vec ? (V == 4 ? choose(H / V, {1, 2, 4}, 512, 8) : choose(H / V, {1, 2}, 512, 4))
                      : choose(H, {4}, 512, 0);
  at::Tensor ws;
  const int sms = sm_count();
  if (cfg.nv == 0) {
    const int threads = 1024;
    const int occ = occupancy(reinterpret_cast<const void*>(&norm_bwd_generic_kernel<Tin, Tdy, RMS>), threads, 0);
    const int64_t P = std::max<int64_t>(1, std::min<int64_t>(rows, static_cast<int64_t>(sms) * occ));
    if (want_ws) ws = at::empty({NACC, P, H}, fopts);
    norm_bwd_generic_kernel<Tin, Tdy, RMS><<<static_cast<unsigned>(P), threads, 0, stream>>>(
        dy, x, w, p_f32, mean, rstd, dx, want_ws ? ws.data_ptr<float>() : nullptr, rows, H);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return ws;
  }
  const int rpb = cfg.acc_smem ? 1 : rows_per_block(cfg.tpr);
  const int threads = rpb * cfg.tpr;
  auto go = [&](auto nv_c, auto vec_c, auto smem_c) {
    constexpr int NV = decltype(nv_c)::value;
    constexpr int VEC = decltype(vec_c)::value;
    constexpr bool ACC = decltype(smem_c)::value != 0;
    auto kernel = &norm_bwd_kernel<Tin, Tdy, VEC, NV, RMS, ACC>;
    size_t smem = 0;
    if (ACC) smem = sizeof(float) * NACC * (NV * VEC + 1) * static_cast<size_t>(cfg.tpr);
    else if (rpb > 1) smem = sizeof(float) * static_cast<size_t>(rpb) * H;
    allow_smem(reinterpret_cast<const void*>(kernel), smem);
    const int occ = occupancy(reinterpret_cast<const void*>(kernel), threads, smem);
    const int64_t P = std::max<int64_t>(1, std::min<int64_t>(ceil_div(rows, rpb), static_cast<int64_t>(sms) * occ));
    if (want_ws) ws = at::empty({NACC, P, H}, fopts);
    kernel<<<static_cast<unsigned>(P), threads, smem, stream>>>(
        dy, x, w, p_f32, mean, rstd, dx, want_ws ? ws.data_ptr<float>() : nullptr, rows, H, cfg.tpr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (!vec) {
    go(IC<4>{}, IC<1>{}, IC<0>{});
  } else if (cfg.acc_smem) {
    go(IC<32 / V>{}, IC<V>{}, IC<1>{});
  } else {
    switch (cfg.nv) {
      case 1: go(IC<1>{}, IC<V>{}, IC<0>{}); break;
      case 2: go(IC<2>{}, IC<V>{}, IC<0>{}); break;
      default: go(IC<16 / V>{}, IC<V>{}, IC<0>{}); break;  // 4 (fp32 only)
    }
  }
  return ws;
}

// Column sums of the workspace into the parameter gradients (either output may be null).
template <typename TA, typename TB>
void launch_col_reduce(const at::Tensor& ws, int H, TA* out_a, TB* out_b, cudaStream_t stream) {
  const int64_t P = ws.size(1);
  const dim3 block(32, 16);
  const int64_t grid = ceil_div(H, 32);
  norm_col_reduce_kernel<TA, TB><<<static_cast<unsigned>(grid), block, 0, stream>>>(ws.data_ptr<float>(), P, H, out_a, out_b);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// ---------------------------------------------------------------------------------------------------------
// Host drivers shared by the LayerNorm and RMSNorm entry points: argument checks, dtype dispatch.
// ---------------------------------------------------------------------------------------------------------
template <typename T> struct Tag { using type = T; };

inline bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

template <typename F>
void dispatch_float(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(Tag<float>{}); break;
    case at::kHalf: f(Tag<__half>{}); break;
    case at::kBFloat16: f(Tag<__nv_bfloat16>{}); break;
    default: TORCH_CHECK(false, "pipegoose norm: unsupported dtype ", t);
  }
}

template <typename T> inline const T* cptr(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<const T*>(t.data_ptr()) : nullptr;
}
inline const void* vptr(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }
template <typename T> inline T* mptr(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<T*>(t.data_ptr()) : nullptr;
}

inline void check_input(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", name, ": expected a tensor, got None");
  TORCH_CHECK(t.is_cuda(), op, ": ", name, ": expected a CUDA tensor, got device ", t.device());
  TORCH_CHECK(is_float_type(t.scalar_type()), op, ": ", name,
              ": expected dtype float32, float16 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() >= 1, op, ": ", name, ": expected at least one dimension [..., H], got a 0-d tensor");
  TORCH_CHECK(t.size(-1) >= 1, op, ": ", name, ": expected a last dimension H >= 1, got shape ", t.sizes());
  TORCH_CHECK(t.size(-1) <= std::numeric_limits<int>::max(), op, ": ", name,
              ": expected a last dimension H < 2^31, got ", t.size(-1));
}

inline void check_param(const char* op, const char* name, const at::Tensor& p, const at::Tensor& input) {
  TORCH_CHECK(p.is_cuda() && p.device() == input.device(), op, ": ", name,
              ": expected a CUDA tensor on the input's device ", input.device(), ", got ", p.device());
  TORCH_CHECK(is_float_type(p.scalar_type()), op, ": ", name,
              ": expected dtype float32, float16 or bfloat16, got ", p.scalar_type());
  TORCH_CHECK(p.numel() == input.size(-1), op, ": ", name, ": expected H = ", input.size(-1),
              " elements (the input's last dimension), got shape ", p.sizes());
}

inline void check_stat(const char* op, const char* name, const at::Tensor& s, const at::Tensor& input,
                       int64_t rows) {
  TORCH_CHECK(s.defined(), op, ": ", name, ": expected a tensor, got None");
  TORCH_CHECK(s.is_cuda() && s.device() == input.device(), op, ": ", name,
              ": expected a CUDA tensor on the input's device ", input.device(), ", got ", s.device());
  TORCH_CHECK(s.scalar_type() == at::kFloat, op, ": ", name, ": expected dtype float32, got ", s.scalar_type());
  TORCH_CHECK(s.numel() == rows, op, ": ", name, ": expected ", rows,
              " elements (one per row of the input), got shape ", s.sizes());
}

// The dtype the kernels read a parameter in: the input's dtype when it matches, float32 otherwise.
inline at::ScalarType param_compute_dtype(const at::Tensor& weight, const at::Tensor& bias, at::ScalarType in) {
  const at::Tensor& p = weight.defined() ? weight : bias;
  if (!p.defined()) return in;
  return p.scalar_type() == in ? in : at::kFloat;
}

inline at::Tensor param_as(const at::Tensor& p, at::ScalarType t) {
  if (!p.defined()) return p;
  return p.reshape({-1}).to(t).contiguous();
}

struct FwdResult {
  at::Tensor out, mean, rstd;
};

template <bool RMS>
FwdResult norm_forward(const char* op, const at::Tensor& input_, const at::Tensor& weight_, const at::Tensor& bias_,
                       double eps, std::optional<at::ScalarType> out_dtype) {
  check_input(op, "input", input_);
  if (weight_.defined()) check_param(op, "weight", weight_, input_);
  if (bias_.defined()) check_param(op, "bias", bias_, input_);
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": eps: expected a finite value >= 0, got ", eps);
  const at::ScalarType out_t = out_dtype.has_value() ? *out_dtype : input_.scalar_type();
  TORCH_CHECK(is_float_type(out_t), op, ": out_dtype: expected float32, float16 or bfloat16, got ", out_t);

  c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = input_.contiguous();
  const int H = static_cast<int>(input.size(-1));
  const int64_t rows = input.numel() / H;
  const at::ScalarType in_t = input.scalar_type();
  const at::ScalarType p_t = param_compute_dtype(weight_, bias_, in_t);
  const at::Tensor weight = param_as(weight_, p_t);
  const at::Tensor bias = param_as(bias_, p_t);
  const bool p_f32 = p_t == at::kFloat;
  // Output types computed directly: the input's or float32; any other out_dtype is rounded from float32.
  const at::ScalarType y_t = (out_t == in_t || out_t == at::kFloat) ? out_t : at::kFloat;
  const auto fopts = input.options().dtype(at::kFloat);

  FwdResult r;
  r.out = at::empty(input_.sizes(), input.options().dtype(y_t));
  r.mean = RMS ? at::Tensor() : at::empty({rows}, fopts);
  r.rstd = at::empty({rows}, fopts);
  if (rows > 0) {
    cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    dispatch_float(in_t, [&](auto tin) {
      using Tin = typename decltype(tin)::type;
      auto with_out = [&](auto to) {
        using Tout = typename decltype(to)::type;
        launch_fwd<Tin, Tout, RMS>(cptr<Tin>(input), vptr(weight), RMS ? nullptr : vptr(bias), p_f32,
                                   mptr<Tout>(r.out), RMS ? nullptr : mptr<float>(r.mean), mptr<float>(r.rstd), rows,
                                   H, static_cast<float>(eps), stream);
      };
      if (y_t == at::kFloat) with_out(Tag<float>{}); else with_out(Tag<Tin>{});
    });
  }
  if (y_t != out_t) r.out = r.out.to(out_t);
  return r;
}

struct BwdResult {
  at::Tensor grad_input, grad_weight, grad_bias;
};

template <bool RMS>
BwdResult norm_backward(const char* op, const at::Tensor& grad_, const at::Tensor& input_, const at::Tensor& weight_,
                        const at::Tensor& bias_, const at::Tensor& mean_, const at::Tensor& rstd_) {
  check_input(op, "input", input_);
  check_input(op, "grad_output", grad_);
  TORCH_CHECK(grad_.device() == input_.device(), op, ": grad_output: expected the input's device ", input_.device(),
              ", got ", grad_.device());
  TORCH_CHECK(grad_.sizes() == input_.sizes(), op, ": grad_output: expected the input's shape ", input_.sizes(),
              ", got ", grad_.sizes());
  if (weight_.defined()) check_param(op, "weight", weight_, input_);
  if (bias_.defined()) check_param(op, "bias", bias_, input_);
  const int H = static_cast<int>(input_.size(-1));
  const int64_t rows = input_.numel() / H;
  if (!RMS) check_stat(op, "mean", mean_, input_, rows);
  check_stat(op, "rstd", rstd_, input_, rows);

  c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = input_.contiguous();
  const at::ScalarType in_t = input.scalar_type();
  // grad_output is read in its own dtype when it is the input's or float32 (autocast), else as float32.
  const at::ScalarType g_t = (grad_.scalar_type() == in_t || grad_.scalar_type() == at::kFloat) ? grad_.scalar_type()
                                                                                               : at::kFloat;
  const at::Tensor grad = grad_.to(g_t).contiguous();
  const at::ScalarType p_t = param_compute_dtype(weight_, bias_, in_t);
  const at::Tensor weight = param_as(weight_, p_t);
  const bool p_f32 = p_t == at::kFloat;
  const at::Tensor mean = RMS ? at::Tensor() : mean_.reshape({-1}).contiguous();
  const at::Tensor rstd = rstd_.reshape({-1}).contiguous();
  const auto fopts = input.options().dtype(at::kFloat);

  BwdResult r;
  r.grad_input = at::empty(input_.sizes(), input.options());
  const bool want_w = weight_.defined();
  const bool want_b = !RMS && bias_.defined();
  r.grad_weight = want_w ? at::empty(weight_.sizes(), weight_.options()) : at::empty({0}, input.options());
  r.grad_bias = want_b ? at::empty(bias_.sizes(), bias_.options()) : at::empty({0}, input.options());
  if (rows == 0) {
    if (want_w) r.grad_weight.zero_();
    if (want_b) r.grad_bias.zero_();
    return r;
  }
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor ws;
  dispatch_float(in_t, [&](auto tin) {
    using Tin = typename decltype(tin)::type;
    auto with_dy = [&](auto tdy) {
      using Tdy = typename decltype(tdy)::type;
      ws = launch_bwd<Tin, Tdy, RMS>(cptr<Tdy>(grad), cptr<Tin>(input), vptr(weight), p_f32,
                                     RMS ? nullptr : cptr<float>(mean), cptr<float>(rstd), mptr<Tin>(r.grad_input),
                                     rows, H, want_w || want_b, fopts, stream);
    };
    if (g_t == at::kFloat) with_dy(Tag<float>{}); else with_dy(Tag<Tin>{});
  });
  if (want_w || want_b) {
    const at::ScalarType a_t = want_w ? weight_.scalar_type() : at::kFloat;
    const at::ScalarType b_t = want_b ? bias_.scalar_type() : at::kFloat;
    dispatch_float(a_t, [&](auto ta) {
      using TA = typename decltype(ta)::type;
      dispatch_float(b_t, [&](auto tb) {
        using TB = typename decltype(tb)::type;
        launch_col_reduce<TA, TB>(ws, H, want_w ? mptr<TA>(r.grad_weight) : nullptr,
                                  want_b ? mptr<TB>(r.grad_bias) : nullptr, stream);
      });
    });
  }
  return r;
}

}  // namespace norm
}  // namespace pipegoose
