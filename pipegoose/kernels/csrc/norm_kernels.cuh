// LayerNorm and RMSNorm forward/backward kernels, written for pipegoose (private header shared by
// layer_norm.cu and rms_norm.cu; the bool template parameter RMS selects the norm).
//
// Layout. A row of H elements is cut into "chunks" of VEC elements (VEC * sizeof(input) = 16 bytes when the
// row length and every pointer allow it, VEC = 1 otherwise). TPR threads work on one row; thread t owns the
// chunks t, t + TPR, ..., t + (NV - 1) * TPR, so each thread holds NV * VEC values in registers (packed in the
// tensor's own dtype, converted to fp32 on use) and every register array is indexed with compile-time constants.
// TPR <= 32 is a power of two (sub-warp groups); TPR > 32 is a multiple of 32 (several warps per row, reduced
// through shared memory). A block holds RPB = blockDim.x / TPR row groups.
//
// The backward and the forward's prefetching plans (short rows) run a persistent grid (as many blocks as fit the GPU
// at once); each row group walks over rows with a stride and, in the prefetching (PF) variants, loads the next row's
// chunks before reducing the current one, so that 16-byte loads stay in flight through the reductions (Hopper needs
// ~32-64 KB in flight per SM). The forward's other plans run a full grid (one block per row group and row).
// Forward: one read of x, one write of y; LayerNorm statistics in two passes over the row held in registers, or, for
// rows of 1024 threads and the widest rows, per-chunk moments merged across the block (merge_chunk, block_moments).
// Backward: keeps per-column partial sums of dy * xhat (and dy) in fp32 (registers, or shared memory for wide
// rows), writes one partial row per block (per cluster in the cluster kernel) into an fp32 workspace [nacc, blocks,
// H], and norm_col_reduce_kernel sums the partial rows column-wise in a fixed order (deterministic, no atomics). The
// register plan of vector rows (up to 512 threads per row; 704 for 16-bit RMSNorm rows of 9224-11264 columns where no
// cluster runs) runs norm_bwd_async_kernel, which streams x and dy through a ring of shared-memory stages with cp.async
// instead of prefetching into registers (see there); norm_bwd_kernel runs the other plans.
// Rows wider than the register capacity: the forward takes norm_fwd_split_kernel for fp32 vector rows up to 65536
// columns (block per row, or for LayerNorm rows over 57344 columns block per SM; the first 32768 values in registers,
// the rest in shared memory; where a block may have 128 KB of it), norm_fwd_wide_kernel on the other vector rows
// (block per row, two reads of the row, the second from L2), norm_fwd_generic_kernel on the scalar path (three scalar
// reads); the backward of vector rows a thread block cluster per row on sm_90 and newer (norm_bwd_cluster_kernel, one
// read of x and dy; also for rows of 8200-16384 columns that a register plan could take: 16-bit RMSNorm from 9224, fp32
// RMSNorm 16384 only) where x and dy have one element size, else the two-kernel path (norm_bwd_rowstats_kernel +
// norm_bwd_cols_kernel, two reads; fp32 LayerNorm at 16384 columns: the shared-memory accumulator plan), of scalar rows
// norm_bwd_generic_kernel.
// Launch plans per hidden size: fwd_plan / bwd_plan below. A build with -DPIPEGOOSE_NORM_HIDDEN=H0 (a benchmark
// experiment, off in the shipped build; see the host side) adds instantiations specialised to H == H0.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <limits>
#include <optional>
#include <initializer_list>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <type_traits>
#include "pipegoose_async.cuh"
#include "pipegoose_check.h"
#include "pipegoose_occupancy.h"

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

// Raw chunk of N elements of T held in 32-bit registers (a plain word array: always register-resident with
// compile-time indices), converted to fp32 element by element on use. Little-endian: element 0 of a 16-bit
// pair is the low half of its word.
template <typename T, int N>
struct Raw {
  static constexpr int kBytes = static_cast<int>(sizeof(T)) * N;
  static constexpr int kWords = kBytes < 4 ? 1 : kBytes / 4;
  uint32_t u[kWords];
};

// The 16-bit conversions are volatile asm on purpose: each use re-extracts the element from its packed word
// (one ALU op) instead of letting the compiler keep all NV * VEC converted floats live across the passes over
// the row, which doubles the registers of the prefetching kernels and makes them spill.
template <typename T, int N>
__device__ __forceinline__ float raw_get(const Raw<T, N>& r, int i) {
  if constexpr (std::is_same<T, float>::value) {
    return __uint_as_float(r.u[i]);
  } else if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    const uint32_t w = r.u[i >> 1];
    float f;
    if (i & 1) {
      asm volatile("and.b32 %0, %1, 0xffff0000;" : "=f"(f) : "r"(w));
    } else {
      asm volatile("shl.b32 %0, %1, 16;" : "=f"(f) : "r"(w));
    }
    return f;
  } else {
    const uint32_t w = r.u[i >> 1];
    float f;
    if (i & 1) {
      asm volatile("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, hi; }" : "=f"(f) : "r"(w));
    } else {
      asm volatile("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, lo; }" : "=f"(f) : "r"(w));
    }
    return f;
  }
}

template <typename T, int N>
__device__ __forceinline__ void raw_zero(Raw<T, N>& r) {
#pragma unroll
  for (int k = 0; k < Raw<T, N>::kWords; ++k) r.u[k] = 0u;  // +0.0 in every dtype
}

template <typename T>
__device__ __forceinline__ uint32_t bits16(float v) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  } else {
    return __half_as_ushort(__float2half_rn(v));
  }
}

// Rounds N floats to T and packs them into 32-bit words (element 0 in the low half of a 16-bit pair).
template <typename T, int N>
__device__ __forceinline__ void raw_pack(const float (&in)[N], Raw<T, N>& r) {
  if constexpr (std::is_same<T, float>::value) {
#pragma unroll
    for (int i = 0; i < N; ++i) r.u[i] = __float_as_uint(in[i]);
  } else if constexpr (N == 1) {
    r.u[0] = bits16<T>(in[0]);
  } else {
#pragma unroll
    for (int k = 0; k < N / 2; ++k) r.u[k] = bits16<T>(in[2 * k]) | (bits16<T>(in[2 * k + 1]) << 16);
  }
}

// Loads of x and dy (read once per kernel). Session 9 A/B (benchmarks/results/nvidia_h200_2026-11-30/
// norm_session9.log, H200): a plain ld.global ran the forward 1-5 points of copy faster than the evict-first
// ld.global.cs of sessions 1-8 at every size from 512 to 32768 columns (bf16 LayerNorm 16384x8192: 90.7 -> 94.9,
// fp32 RMSNorm 16384x16384: 95.1 -> 99.4), except rows of one 1024-thread block (the widest rows of each plan: one block
// per SM, 128 KB of loads in flight), where allocating in L1 cost up to 5.5 points (bf16 RMSNorm 65536: 94.0 -> 88.5)
// and ld.global.nc.L1::no_allocate ran best (95.4); the synchronous backward gained up to 7.5 points (fp32 RMSNorm
// 16384: 91.2 -> 98.8). Neither the L2::256B prefetch hint (with .cs or with .nc.L1::no_allocate) nor .nc alone beat
// these. Ld::kPlain (ld.global) and Ld::kNoL1 (ld.global.nc.L1::no_allocate) are the two streaming modes; Ld::kCached
// (__ldg) reads the backward's parameters, which every row reads again; Ld::kParam the forward's (with an L2 policy,
// below). -DPIPEGOOSE_NORM_LD_CS (a benchmark experiment, off in the shipped build) turns both streaming modes back
// into ld.global.cs, the loads before session 9.
enum class Ld { kCached, kParam, kPlain, kNoL1 };

template <Ld M, typename V>
__device__ __forceinline__ V ld_hint(const V* p) {
#if defined(PIPEGOOSE_NORM_LD_CS)
  if constexpr (M == Ld::kPlain || M == Ld::kNoL1) return __ldcs(p);
#endif
  if constexpr (M == Ld::kCached || M == Ld::kParam) {
#if !defined(PIPEGOOSE_NORM_FWD_PARAM_LDG) && !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800)
    // The forward kernels' 16-byte parameter chunks read into registers (Ld::kParam: load_params, load_params_m; the
    // row, split and two-read kernels) carry an L2 evict_last policy, so that the streamed rows do not evict the
    // parameters that every row reads again. Not covered: chunks under 16 bytes (__ldg), the parameters that
    // LayerNorm rows of one block per SM stage through shared memory (cp.async) and the generic kernel's scalar
    // reads. H200, benchmarks.norm_raw, forward, % of copy:
    // - session 23 (call 7, the fp32 split forward only, in the form of a volatile ld.global.L2::cache_hint, 16384
    //   rows): LayerNorm 65536 / 61440 columns 77.0 / 76.8 -> 86.9 / 89.4, 49152 / 40000 +1.0 / +0.1; RMSNorm -1.0
    //   to -2.2; session 24 (call 1, that form), LayerNorm 8192 x 65536: 76.3 -> 89.6;
    // - session 24 (call 2, this form in every forward but LayerNorm's split one, which kept session 23's; 36 shapes,
    //   mean of two runs each): bf16 LayerNorm +0.15 to +1.6 (16384 x 32768 95.8 -> 97.4); bf16 input with fp32
    //   parameters: LayerNorm 16384 x 4096 84.5 -> 87.2, 16384 x 16384 +1.15, RMSNorm 16384 x 4096 91.9 -> 92.8; the
    //   rest -0.65 (fp32 RMSNorm 16384 x 8192 99.65 -> 99.0) to +0.8, RMSNorm's split forward among them (fp32
    //   8192 x 65536 96.0 -> 96.2);
    // - session 24 (call 3, this form everywhere, LayerNorm's split forward included): fp32 LayerNorm 16384 x 65536 /
    //   61440 / 49152 / 40000 86.8 / 89.2 / 87.9 / 86.3, 8192 x 65536 87.8 (session 23's form: 89.4-89.6 in calls 1
    //   and 2, another machine; not yet compared in one process: -DPIPEGOOSE_NORM_SPLIT_LDPOL builds that form).
    // The same policy on the backward's parameter loads cost up to 3.4 points (fp32 LayerNorm 32768 x 2048 96.6 ->
    // 93.2; session 24 call 1): they keep __ldg. -DPIPEGOOSE_NORM_FWD_PARAM_LDG (a benchmark experiment) reads the
    // forward's parameters with __ldg too, as before session 24. The asm is not volatile, so the compiler may hoist a
    // load out of a row loop: right, since the parameters are read-only for the whole kernel (the host never lets w or
    // b alias y, mean or rstd, which it allocates), as .nc requires anyway.
    if constexpr (M == Ld::kParam && std::is_same<V, uint4>::value) {
      uint64_t pol;
      asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
      uint4 v;
      asm("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
          : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
      return v;
    }
#endif
    return __ldg(p);
  } else if constexpr (std::is_same<V, uint4>::value) {
    uint4 v;
    if constexpr (M == Ld::kNoL1) {
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    } else {
      asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    }
    return v;
  } else {
    // Narrower chunks (scalar rows, 8-byte chunks) only stream plainly: kNoL1 is for the 16-byte rows of 1024 threads.
    static_assert(M == Ld::kPlain, "ld_hint: Ld::kNoL1 takes 16-byte chunks");
    V v;
    if constexpr (std::is_same<V, uint2>::value) {
      asm volatile("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    } else if constexpr (std::is_same<V, unsigned int>::value) {
      asm volatile("ld.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
    } else {
      static_assert(std::is_same<V, unsigned short>::value, "ld_hint: 2, 4, 8 or 16 bytes");
      asm volatile("ld.global.u16 %0, [%1];" : "=h"(v) : "l"(p));
    }
    return v;
  }
}

// Stores of y and dx (written once). Session 9 A/B (norm_session9.log): st.global.cs (evict-first) ran the backward's
// dx up to 8 points of copy faster (fp32 RMSNorm 65536x1024: 86.4 -> 94.6, bf16 RMSNorm 32768x2048: 83.6 -> 86.8) and
// the forward's y 2-3 points slower than st.global; so dx is stored with .cs (kDxStream) and y plain.
// -DPIPEGOOSE_NORM_DX_PLAIN (a benchmark experiment) stores dx plain, as before session 9.
#if defined(PIPEGOOSE_NORM_DX_PLAIN)
constexpr bool kDxStream = false;
#else
constexpr bool kDxStream = true;
#endif

// Loads one chunk of N elements (aligned to its size) into r with the load mode M (above).
template <typename T, int N, Ld M = Ld::kPlain>
__device__ __forceinline__ void raw_load(const T* __restrict__ p, Raw<T, N>& r) {
  constexpr int B = Raw<T, N>::kBytes;
  if constexpr (B % 16 == 0) {
#pragma unroll
    for (int k = 0; k < B / 16; ++k) {
      const uint4 v = ld_hint<M>(reinterpret_cast<const uint4*>(p) + k);
      r.u[4 * k] = v.x;
      r.u[4 * k + 1] = v.y;
      r.u[4 * k + 2] = v.z;
      r.u[4 * k + 3] = v.w;
    }
  } else if constexpr (B == 8) {
    const uint2 v = ld_hint<M>(reinterpret_cast<const uint2*>(p));
    r.u[0] = v.x;
    r.u[1] = v.y;
  } else if constexpr (B == 4) {
    r.u[0] = ld_hint<M>(reinterpret_cast<const unsigned int*>(p));
  } else {
    static_assert(B == 2, "chunk size");
    r.u[0] = ld_hint<M>(reinterpret_cast<const unsigned short*>(p));
  }
}

// Reads N consecutive elements at p (aligned to N * sizeof(T)) as floats (cached loads: parameters).
template <int N, typename T>
__device__ __forceinline__ void load_f(const T* __restrict__ p, float (&out)[N]) {
  Raw<T, N> r;
  raw_load<T, N, Ld::kCached>(p, r);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = raw_get(r, i);
}

// Writes N floats rounded to T at p (aligned to N * sizeof(T)).
template <int N, typename T, bool ST_STREAM = false>
__device__ __forceinline__ void store_f(T* __restrict__ p, const float (&in)[N]) {
  constexpr int B = Raw<T, N>::kBytes;
  Raw<T, N> r;
  raw_pack<T, N>(in, r);
  if constexpr (B % 16 == 0) {
#pragma unroll
    for (int k = 0; k < B / 16; ++k) {
      const uint4 v = make_uint4(r.u[4 * k], r.u[4 * k + 1], r.u[4 * k + 2], r.u[4 * k + 3]);
      if constexpr (ST_STREAM) {
        __stcs(reinterpret_cast<uint4*>(p) + k, v);
      } else {
        reinterpret_cast<uint4*>(p)[k] = v;
      }
    }
  } else if constexpr (B == 8) {
    *reinterpret_cast<uint2*>(p) = make_uint2(r.u[0], r.u[1]);
  } else if constexpr (B == 4) {
    *reinterpret_cast<unsigned int*>(p) = r.u[0];
  } else {
    static_assert(B == 2, "chunk size");
    *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(r.u[0]);
  }
}

// The backward's and the generic forward's parameters (weight, bias) are float32 or the input's dtype, chosen at run
// time (p_f32): the branch is uniform and halves the number of kernel instantiations. (The forward's row kernel takes
// the parameter type as a template argument instead: with its parameters loaded before the reductions, the branches
// and the waits behind them left its output loop; session 8.)
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

// Weight cache of the backward: the launches stage the weight once per block as fp32 in shared memory (sw[H]; a null
// weight stages ones) when it fits (kParamCacheBytes), so that the row loop reads it with 16-byte shared loads
// instead of re-reading global memory per row behind the null and dtype branches (which cost ~14 instructions per 4
// parameters in the profile of the first version).
constexpr size_t kParamCacheBytes = 64 * 1024;

template <typename Tin>
__device__ __forceinline__ void stage_weight(const void* __restrict__ w, bool p_f32, int H, float* sw) {
  // Eight independent loads per thread in flight (a plain loop would wait for each load before the next).
  constexpr int U = 8;
  for (int j0 = threadIdx.x; j0 < H; j0 += U * blockDim.x) {
    float vw[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int j = j0 + k * static_cast<int>(blockDim.x);
      vw[k] = j < H && w != nullptr ? param_at<Tin>(w, p_f32, j) : 1.f;
    }
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const int j = j0 + k * static_cast<int>(blockDim.x);
      if (j < H) sw[j] = vw[k];
    }
  }
  __syncthreads();
}

// Reads N consecutive floats of shared memory at p (16-byte aligned when N % 4 == 0).
template <int N>
__device__ __forceinline__ void lds_f(const float* p, float (&out)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int k = 0; k < N / 4; ++k) {
      const float4 v = reinterpret_cast<const float4*>(p)[k];
      out[4 * k] = v.x;
      out[4 * k + 1] = v.y;
      out[4 * k + 2] = v.z;
      out[4 * k + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = p[i];
  }
}

// ---------------------------------------------------------------------------------------------------------
// Row reduction
// ---------------------------------------------------------------------------------------------------------
// Sums K values over the TPR threads of each row group; every thread of the group gets the same (bitwise)
// result: the xor butterfly adds the same two operands on both partners, and the cross-warp step reads the
// partials in one fixed order. buf: shared float[K * 32], 16-byte aligned (one slot per warp of the block). Callers alternate
// two buffers between consecutive calls, which makes one __syncthreads per call enough. Every thread of the
// block must call it (it may synchronise the block).
// NAMED (kernels whose row groups synchronise apart): the cross-warp step waits on named barrier `bar` (1-15) of the
// tpr threads of the row group instead of the whole block, and only the row group's threads must call it. The id in
// a register makes ptxas reserve all 16 barriers of the block ("used 16 barriers"); the occupancy rules count 64 per
// SM on sm_90 (so at most four such blocks per SM: the launch bounds ask for three or four) and fewer on sm_120.
// Immediate ids (a switch over the row group) cost the 16-bit LayerNorm kernels 8-96 bytes of spills at 64
// registers (ptxas, session 6), so the register id stays until an A/B on those GPUs says otherwise.
// rg >= 0: the caller's row group index (threadIdx.x / tpr), which spares the cross-warp step a run-time division.
template <int K, bool NAMED = false>
__device__ __forceinline__ void row_sum(float (&v)[K], int tpr, float* buf, int bar = 0, int rg = -1) {
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
    if constexpr (NAMED) {
      asm volatile("bar.sync %0, %1;" ::"r"(bar), "r"(tpr) : "memory");
    } else {
      __syncthreads();
    }
    const int nw = tpr >> 5;
    const int first = (rg >= 0 ? rg : warp / nw) * nw;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      float s = 0.f;
      if (!NAMED && (nw & 3) == 0) {
        // 16-byte reads (first is a multiple of nw, so of 4; buf is 16-byte aligned), same summation order. (Not
        // in the NAMED kernels: there they took 16 more bytes of spills in the 512-thread 16-bit LayerNorm kernel.)
        const float4* b4 = reinterpret_cast<const float4*>(buf + k * 32 + first);
        for (int i = 0; i < (nw >> 2); ++i) {
          const float4 q = b4[i];
          s += q.x;
          s += q.y;
          s += q.z;
          s += q.w;
        }
      } else {
        for (int i = 0; i < nw; ++i) s += buf[k * 32 + first + i];
      }
      v[k] = s;
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Row geometry (used by the launch plans on the host side, and at compile time by the specialised kernels)
// ---------------------------------------------------------------------------------------------------------
constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int round_tpr(int64_t n) {
  if (n <= 32) {
    int p = 1;
    while (p < n) p <<= 1;
    return p;
  }
  return static_cast<int>(ceil_div(n, 32) * 32);
}

constexpr int rows_per_block(int tpr) { return tpr >= 256 ? 1 : 256 / tpr; }

// Compile-time geometry of a kernel specialised to H == HC (HC > 0: the backward's shipped sizes BwdSpecHidden and
// BwdSpecExtra, and PIPEGOOSE_NORM_HIDDEN builds, see the host side): chunks per row, threads per row (every plan of
// fwd_plan / bwd_plan with NV chunks per thread takes round_tpr(ceil_div(chunks, NV)); the launches static_assert it
// against the plan), rows per block (one with the backward's shared-memory accumulators: ONE_ROW) and 1 / H. HC == 0
// (the generic kernels): unused.
template <int HC, int VEC, int NV, bool ONE_ROW>
struct FixedRow {
  static_assert(HC >= 0 && HC % VEC == 0, "FixedRow: HC must be a multiple of VEC");
  static constexpr int chunks = HC / VEC;
  static constexpr int tpr = HC > 0 ? round_tpr(ceil_div(chunks, NV)) : 1;
  static constexpr int rpb = ONE_ROW ? 1 : rows_per_block(tpr);
  static constexpr float inv_h = HC > 0 ? 1.f / static_cast<float>(HC) : 0.f;
};

// Whether chunk c = t + n * tpr of thread t (0 <= t < tpr) lies in a row of nchunks chunks. FIXED (tpr and
// nchunks compile-time constants, n unrolled): true at compile time for every n whose chunks all lie in the row,
// so that the test remains only on a partial last stride.
template <bool FIXED>
__device__ __forceinline__ bool chunk_in(int c, int n, int tpr, int nchunks) {
  if constexpr (FIXED) {
    if ((n + 1) * tpr <= nchunks) return true;
  }
  return c < nchunks;
}

// ---------------------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------------------

// Loads the chunks of one row owned by thread t (zeros outside the row, or for an invalid row). FIXED: see
// chunk_in.
template <typename T, int VEC, int NV, bool FIXED, Ld M = Ld::kPlain>
__device__ __forceinline__ void load_row(const T* __restrict__ base, bool valid, int t, int tpr, int nchunks,
                                         Raw<T, VEC> (&out)[NV]) {
#pragma unroll
  for (int n = 0; n < NV; ++n) {
    const int c = t + n * tpr;
    if (valid && chunk_in<FIXED>(c, n, tpr, nchunks)) {
      raw_load<T, VEC, M>(base + static_cast<int64_t>(c) * VEC, out[n]);
    } else {
      raw_zero(out[n]);
    }
  }
}

// Fills a chunk with v (v rounded to T; the forward's stand-in for an absent weight (1) or bias (0), exact in every
// dtype).
template <typename T, int N>
__device__ __forceinline__ void raw_fill(Raw<T, N>& r, float v) {
  float f[N];
#pragma unroll
  for (int i = 0; i < N; ++i) f[i] = v;
  raw_pack<T, N>(f, r);
}

// Loads N parameters at element j (weight, and bias unless RMS; N * sizeof(Tp) <= 16 bytes, or a chunk held for the
// whole kernel): cached loads, weight and bias issued together; an absent weight reads as ones, an absent bias as
// zeros.
template <typename Tp, int N, bool RMS>
__device__ __forceinline__ void load_params(const Tp* __restrict__ w, const Tp* __restrict__ b, int j,
                                            Raw<Tp, N>& pw, Raw<Tp, N>& pb) {
  if (w != nullptr) raw_load<Tp, N, Ld::kParam>(w + j, pw); else raw_fill(pw, 1.f);
  if constexpr (!RMS) {
    if (b != nullptr) raw_load<Tp, N, Ld::kParam>(b + j, pb); else raw_fill(pb, 0.f);
  }
}

// LayerNorm rows of one block per SM (the NOL1 kernels): the parameters of a thread's chunks are copied into its own
// slots of dynamic shared memory with cp.async, the first fwd_param_stages chunks' before the row reductions and chunk
// n + stages's as soon as chunk n is written, instead of being loaded chunk by chunk after the reductions: there, each
// chunk waited for its own L2 round trip (the loads sat behind the chunk's branch), and with one block per SM nothing
// else ran meanwhile. The copies hold no registers (loads into registers one or more chunks ahead spilled 8-204 bytes:
// ptxas, 64 registers with 32 words of x). Shared memory: stages * 1024 * fwd_param_bytes, at most kFwdParamSmem bytes;
// fewer than two stages: none. Session 12 A/B (norm_raw, % of copy, no staging -> 2 / 3 / 4 stages): fp32 16384x32768
// 87.1 -> 92.0 / 95.8 / 95.3, bf16 8192x65536 81.2 -> 88.3 / 89.2 / 87.1 (fp16 alike). RMSNorm (one parameter array) is
// not staged: fp32 16384x32768 97.3 -> 96.4 / 95.4 (4 / 6 stages) / 94.8 (8), 16-bit 8192x65536 +0.4-1.5.
// -DPIPEGOOSE_NORM_FWD_PSMEM=0 builds the kernels without staging.
#if defined(PIPEGOOSE_NORM_FWD_PSMEM)
constexpr int kFwdParamSmem = PIPEGOOSE_NORM_FWD_PSMEM;
#else
constexpr int kFwdParamSmem = 96 * 1024;
#endif
constexpr int kFwdRowThreadsMax = 1024;  // the NOL1 kernels' blocks (one row of 1024 threads)
constexpr int fwd_param_bytes(int vec, int p_bytes, bool rms) { return vec * p_bytes * (rms ? 1 : 2); }
constexpr int fwd_param_stages(int vec, int p_bytes, bool rms, int nv) {
  const int k = kFwdParamSmem / (fwd_param_bytes(vec, p_bytes, rms) * kFwdRowThreadsMax);
  return rms || k < 2 ? 0 : k < nv ? k : nv;
}

// Stand-ins for an absent weight (ones) and bias (zeros), 32 bytes in every parameter dtype. The row kernel reads
// them in place of a null parameter with a zero stride (launch_fwd passes them with wm / bm = 0, see
// load_params_m), so that its loads need no test and no fill of the absent values per chunk (session 12, SASS of the
// 16-bit LayerNorm's output loop: about 15 of the 81 instructions per chunk were those).
static __device__ __align__(16) const uint32_t kParamOnes[3][8] = {
    {0x3f800000u, 0x3f800000u, 0x3f800000u, 0x3f800000u, 0x3f800000u, 0x3f800000u, 0x3f800000u, 0x3f800000u},
    {0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u},
    {0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u, 0x3c003c00u}};
static __device__ __align__(16) const uint32_t kParamZeros[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};

// The row kernel's parameters at element j (ZS, fwd_zero_stride): w + j * wm and b + j * bm, never null (an absent one
// is a stand-in with multiplier 0); else as given, null when absent, tested per load (load_params). Session 12 A/B
// (norm_raw, null tests -> zero stride, % of copy, two runs each): bf16 LayerNorm 512-4096 columns 87.4-88.3 ->
// 88.2-89.3, RMSNorm bf16 and fp32 at 8192 +0.7-1.2, the rest -0.6 to +0.9; but LayerNorm with fp32 parameters and a
// 16-bit input spilled 12-20 bytes and ran 7-8 points slower (bf16 16384x4096 81.1 -> 73.9), so those kernels keep the
// null tests. -DPIPEGOOSE_NORM_FWD_NULLCHK (a benchmark experiment) gives every kernel the null tests.
template <typename Tin, typename Tp, bool RMS>
constexpr bool fwd_zero_stride() {
#if defined(PIPEGOOSE_NORM_FWD_NULLCHK)
  return false;
#else
  return RMS || sizeof(Tp) == sizeof(Tin);
#endif
}
template <bool ZS, typename Tp, int N, bool RMS>
__device__ __forceinline__ void load_params_m(const Tp* __restrict__ w, const Tp* __restrict__ b, int wm, int bm,
                                              int j, Raw<Tp, N>& pw, Raw<Tp, N>& pb) {
  if constexpr (ZS) {
    raw_load<Tp, N, Ld::kParam>(w + j * wm, pw);
    if constexpr (!RMS) raw_load<Tp, N, Ld::kParam>(b + j * bm, pb);
  } else {
    load_params<Tp, N, RMS>(w, b, j, pw, pb);
  }
}
// The address of the parameters at element j (for the copies of staged parameters), as load_params_m reads them.
template <bool ZS, typename Tp>
__device__ __forceinline__ const Tp* param_src(const Tp* p, int m, int j, bool ones) {
  if constexpr (ZS) {
    return p + j * m;
  } else {
    constexpr int k = std::is_same<Tp, float>::value ? 0 : std::is_same<Tp, __nv_bfloat16>::value ? 1 : 2;
    return p != nullptr ? p + j : reinterpret_cast<const Tp*>(ones ? kParamOnes[k] : kParamZeros);
  }
}

// The forward's parameters in registers (PREG): the thread's parameters are loaded once, with the first row's x, so
// that no load waits after the row reductions, where x's chunks of 16 bytes (twice with prefetch) and the parameters
// take at most 36 words of registers (RMSNorm rows of four chunks with parameters of the input's dtype, LayerNorm rows
// of two); elsewhere each chunk's parameters are loaded after the reductions (16 bytes of weight and bias at a time,
// issued together). Session 8 plan grid (norm_fwd_plans_session8.log): holding 48 words needed blocks of 768 threads
// (80 registers; 64 spilled 16-24 bytes), and those plans ran 3-7 points of copy slower than loading per chunk (fp32
// LayerNorm 1024-4096 columns: 85-87 against 92; RMSNorm bf16 with fp32 parameters at 4096: 86 against 89).
constexpr int fwd_data_words(int in_bytes, int p_bytes, int nv, bool rms, bool pf) {
  return 4 * nv * (pf ? 2 : 1) + (16 / in_bytes) * p_bytes / 4 * nv * (rms ? 1 : 2);
}
constexpr bool fwd_preg(int in_bytes, int p_bytes, int nv, bool rms, bool pf, bool preg_on) {
  return preg_on && fwd_data_words(in_bytes, p_bytes, nv, rms, pf) <= 36;
}

// (n, mean, M2) += (nb, mb, m2b): Chan et al.'s update in delta form, mean + d * nb / n, so that the rounding is at
// the scale of the difference d of the two means, not of n * mean (the symmetric form (na * ma + nb * mb) / n lost
// 2-3 ulp of the mean on rows of mean 1000 and spread 1, session 10's emulation; this form stays within 0.5). Both
// empty: unchanged zeros.
__device__ __forceinline__ void chan_merge(float& n, float& mean, float& m2, float nb, float mb, float m2b) {
  const float nn = n + nb;
  const float r = nn > 0.f ? nb / nn : 0.f;
  const float d = mb - mean;
  mean = fmaf(d, r, mean);
  m2 = (m2 + m2b) + d * d * (n * r);
  n = nn;
}

// Merges one chunk of VEC values into (n, mean, M2): the chunk's own mean and M2 (two passes over its values), then
// chan_merge. Only the chunk is unpacked at a time.
template <typename T, int VEC>
__device__ __forceinline__ void merge_chunk(float& n, float& mean, float& m2, const Raw<T, VEC>& r) {
  float cs = 0.f;
#pragma unroll
  for (int i = 0; i < VEC; ++i) cs += raw_get(r, i);
  const float cm = cs * (1.f / VEC);
  float cq = 0.f;
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const float d = raw_get(r, i) - cm;
    cq += d * d;
  }
  chan_merge(n, mean, m2, static_cast<float>(VEC), cm, cq);
}

// (n, mean, M2) merged over the 32 lanes of a warp in an xor butterfly (chan_merge); the lanes may differ in the last
// bits (the merge is not symmetric), lane 0's result is the one used.
__device__ __forceinline__ void warp_moments(float& n, float& mean, float& m2) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float nb = __shfl_xor_sync(0xffffffffu, n, off);
    const float mb = __shfl_xor_sync(0xffffffffu, mean, off);
    const float qb = __shfl_xor_sync(0xffffffffu, m2, off);
    chan_merge(n, mean, m2, nb, mb, qb);
  }
}

// LayerNorm statistics of a row held by the whole block (rows of 1024 threads) in ONE block-wide step: each thread
// brings (count, mean, M2) of its own values (merge_chunk over its chunks), each warp merges its threads' with
// chan_merge in an xor butterfly (warp_moments), then, after the block's one barrier, every warp merges the 32 warps' results the
// same way and takes lane 0's, so every thread of the block ends with the same bits. Replaces the two sums (mean, then
// the squared deviations), each with its barrier: with one block of 1024 threads per SM, no other block's loads run
// while the block waits at a barrier. buf: shared float[96], alternated between consecutive rows as in row_sum.
__device__ __forceinline__ void block_moments(float& n, float& mean, float& m2, float* buf) {
  warp_moments(n, mean, m2);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) {
    buf[warp] = n;
    buf[32 + warp] = mean;
    buf[64 + warp] = m2;
  }
  __syncthreads();
  const bool has = lane < static_cast<int>(blockDim.x >> 5);
  n = has ? buf[lane] : 0.f;
  mean = has ? buf[32 + lane] : 0.f;
  m2 = has ? buf[64 + lane] : 0.f;
  warp_moments(n, mean, m2);
  mean = __shfl_sync(0xffffffffu, mean, 0);
  m2 = __shfl_sync(0xffffffffu, m2, 0);
}

// LayerNorm row kernels of at most kFwdHoldFloats values per thread (full-grid plans, not the rows of one block per
// SM) convert the row to fp32 once and keep x - mean (HOLDF), instead of unpacking each 16-bit value again on each of
// its three uses and subtracting the mean twice. Session 12 plan grid (norm_raw --fwd-plans, bf16, % of copy): four
// chunks per thread 89.1 / 89.8 / 85.8 / 86.1 -> 90.5 / 91.1 / 89.7 / 89.4 at 512 / 1024 / 2048 / 4096 columns,
// ahead of the eight-chunk plan the 16-bit rows took (88.5 / 89.9 / 88.7 / 89.1); fp32 within 0.3 but 8192 columns
// (+1.3). RMSNorm keeps its packed rows: holding them cost the 16-bit four-chunk plan 2 points (16 bytes of spills).
// -DPIPEGOOSE_NORM_FWD_HOLDF=0 builds the kernels without it.
#if defined(PIPEGOOSE_NORM_FWD_HOLDF)
constexpr int kFwdHoldFloats = PIPEGOOSE_NORM_FWD_HOLDF;
#else
constexpr int kFwdHoldFloats = 32;
#endif

// Launch bounds: 1024 threads (64 registers; ptxas: no spills, except 4 bytes in the eight-chunk plans with fp32
// parameters). (Session 7 tried the full-grid four-chunk plans at blocks of <= 512 threads, three per SM: 40
// registers instead of 58-60, 75% occupancy; the forward did not get faster: -3 to +3 points of copy,
// benchmarks/results/nvidia_h200_2026-11-30/SUMMARY.md.)
constexpr int kFwdThreads = 1024;

// Row kernel. A row group of tpr threads owns rows rg0, rg0 + stride, ... (stride = gridDim.x * rows per block; a
// full grid gives each row group one row); x stays packed in its own dtype in registers (converted to fp32 on each
// use), and with PF the next row's chunks are loaded before the current row is reduced, so that every thread keeps
// NV 16-byte loads in flight through the reductions (the latency of one row is hidden behind the previous one).
// PREG (fwd_preg; PREG_ON false forces it off, a benchmark experiment): the parameters of the thread's chunks
// stay in registers. The output is fma((x - mean) * rstd, w, b) (RMS: (x * rstd) * w).
//
// x [rows, H] (Tin), w/b [H] (Tp: float32 or Tin; either may be null), y [rows, H] (Tout), mean/rstd [rows] fp32
// (mean unused when RMS). Requires H % VEC == 0 and every pointer aligned to VEC elements when VEC > 1, and
// ceil(H / VEC) <= NV * tpr; blockDim.x a multiple of tpr.
// HC > 0 (PIPEGOOSE_NORM_HIDDEN builds only): specialised to H == HC; H, tpr, the rows per block and 1 / H are the
// constants of FixedRow<HC, VEC, NV, false> (the arguments h_arg and tpr_arg are then ignored; blockDim.x must be
// rpb * tpr of that geometry). HC == 0: the run-time arguments.
// MINB: the launch bounds' blocks of kFwdThreads per SM (2: at most 32 registers; the experiment plans only).
// NOL1: x is loaded with ld.global.nc.L1::no_allocate (Ld::kNoL1), else ld.global, and LayerNorm takes its statistics
// in one block-wide step (block_moments) instead of two sums; the launches set it for rows of 1024 threads (one row
// per block and SM, see ld_hint), and it requires tpr == blockDim.x.
template <typename Tin, typename Tout, typename Tp, int VEC, int NV, bool RMS, bool PF, bool PREG_ON, int HC,
          bool NOL1 = false, int MINB = 1>
__global__ void __launch_bounds__(kFwdThreads, MINB)
norm_fwd_kernel(const Tin* __restrict__ x, const Tp* __restrict__ w, const Tp* __restrict__ b, int wm, int bm,
                Tout* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                int64_t rows, int h_arg, int tpr_arg, float eps) {
  using G = FixedRow<HC, VEC, NV, false>;
  constexpr bool FIXED = HC > 0;
  constexpr Ld LDX = NOL1 ? Ld::kNoL1 : Ld::kPlain;
  constexpr bool PREG = VEC > 1 ? fwd_preg(sizeof(Tin), sizeof(Tp), NV, RMS, PF, PREG_ON) : PREG_ON;
  // Parameters per load when they are not held (16 bytes of Tp, at most a chunk).
  constexpr int PG = PREG ? VEC : (16 / static_cast<int>(sizeof(Tp)) < VEC ? 16 / static_cast<int>(sizeof(Tp)) : VEC);
  __shared__ __align__(16) float red[2][NOL1 && !RMS ? 96 : 32];
  const int H = FIXED ? HC : h_arg;
  const int tpr = FIXED ? G::tpr : tpr_arg;
  const int rpb = FIXED ? G::rpb : blockDim.x / tpr;
  const int rg = threadIdx.x / tpr;
  const int t = threadIdx.x - rg * tpr;
  const int nchunks = FIXED ? G::chunks : H / VEC;  // exact: VEC == 1 or H % VEC == 0
  const float inv_h = FIXED ? G::inv_h : 1.f / static_cast<float>(H);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * rpb;
  int parity = 0;
  int64_t base = static_cast<int64_t>(blockIdx.x) * rpb;
  Raw<Tin, VEC> cur[NV];
  Raw<Tp, VEC> pw[PREG ? NV : 1], pb[PREG ? NV : 1];
  constexpr bool ZS = fwd_zero_stride<Tin, Tp, RMS>();  // the launch passes stand-ins for absent parameters
  constexpr bool HOLDF = !RMS && !NOL1 && !PF && VEC > 1 && NV * VEC <= kFwdHoldFloats;
  // NOL1: the parameters staged through shared memory, PST chunks ahead (fwd_param_stages); slot s of thread tid holds
  // the 16-byte pieces of one chunk's weight then bias, piece h at ((s * PP + h) * TB + tid) * 16 bytes (TB: the
  // NOL1 block, 1024 threads, a constant so that the offsets are immediates; a warp's reads and copies of one piece
  // are 512 contiguous bytes).
  constexpr int PST = NOL1 && !PREG && VEC * sizeof(Tp) % 16 == 0
                          ? fwd_param_stages(VEC, sizeof(Tp), RMS, NV) : 0;
  constexpr int PWP = VEC * static_cast<int>(sizeof(Tp)) / 16;  // 16-byte pieces of one chunk's weight
  constexpr int PP = PWP * (RMS ? 1 : 2);
  constexpr int TB = kFwdRowThreadsMax;
  extern __shared__ __align__(16) uint4 fwd_psmem[];
  auto stage_q = [&](int n) {  // copies chunk n's parameters into slot n % PST (a chunk outside the row: chunk 0's)
    if constexpr (PST > 0) {
      const int c = t + n * tpr;
      const int j = (chunk_in<FIXED>(c, n, tpr, nchunks) ? c : 0) * VEC;
      const uint4* src_w = reinterpret_cast<const uint4*>(param_src<ZS>(w, wm, j, true));
      uint4* slot = fwd_psmem + (n % PST) * PP * TB + threadIdx.x;
#pragma unroll
      for (int h = 0; h < PWP; ++h) cp_async16(slot + h * TB, src_w + h, 16);
      if constexpr (!RMS) {
        const uint4* src_b = reinterpret_cast<const uint4*>(param_src<ZS>(b, bm, j, false));
#pragma unroll
        for (int h = 0; h < PWP; ++h) cp_async16(slot + (PWP + h) * TB, src_b + h, 16);
      }
      cp_async_commit();
    }
  };
  if constexpr (PF) load_row<Tin, VEC, NV, FIXED, LDX>(x + (base + rg) * H, base + rg < rows, t, tpr, nchunks, cur);
  if constexpr (PREG) {
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const int c = t + n * tpr;
      if (chunk_in<FIXED>(c, n, tpr, nchunks)) load_params_m<ZS, Tp, VEC, RMS>(w, b, wm, bm, c * VEC, pw[n], pb[n]);
    }
  }
  for (; base < rows; base += stride) {
    const int64_t row = base + rg;
    const bool valid = row < rows;
    Raw<Tin, VEC> nxt[PF ? NV : 1];
    if constexpr (PF) {
      const int64_t nrow = row + stride;
      load_row<Tin, VEC, NV, FIXED, LDX>(x + nrow * H, nrow < rows, t, tpr, nchunks, nxt);
    } else {
      load_row<Tin, VEC, NV, FIXED, LDX>(x + row * H, valid, t, tpr, nchunks, cur);
    }
#pragma unroll
    for (int n = 0; n < PST; ++n) stage_q(n);
    // HOLDF: the row converted to fp32 once (x - mean in place after the mean), instead of on each of its uses.
    float xf[HOLDF ? NV : 1][HOLDF ? VEC : 1];
    if constexpr (HOLDF) {
#pragma unroll
      for (int n = 0; n < NV; ++n)
#pragma unroll
        for (int i = 0; i < VEC; ++i) xf[n][i] = raw_get(cur[n], i);
    }
    float mean = 0.f;
    float q[1] = {0.f};
    if constexpr (!RMS && NOL1) {
      // The thread's own (count, mean, M2), merged chunk by chunk (merge_chunk: the whole thread's values unpacked at
      // once spilled 144 bytes in the 16-bit kernels, an array of chunk means 28), then block_moments.
      float cn = 0.f;
#pragma unroll
      for (int n = 0; n < NV; ++n)
        if (chunk_in<FIXED>(t + n * tpr, n, tpr, nchunks)) merge_chunk(cn, mean, q[0], cur[n]);
      block_moments(cn, mean, q[0], red[parity]);
      parity ^= 1;
    } else {
      if constexpr (!RMS) {
        float s[1] = {0.f};
#pragma unroll
        for (int n = 0; n < NV; ++n)
#pragma unroll
          for (int i = 0; i < VEC; ++i) {  // zeros outside the row
            if constexpr (HOLDF) s[0] += xf[n][i]; else s[0] += raw_get(cur[n], i);
          }
        row_sum<1>(s, tpr, red[parity], 0, rg);
        parity ^= 1;
        mean = s[0] * inv_h;
      }
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        if (chunk_in<FIXED>(t + n * tpr, n, tpr, nchunks)) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            if constexpr (HOLDF) {  // LayerNorm only
              xf[n][i] -= mean;
              q[0] += xf[n][i] * xf[n][i];
            } else {
              const float d = raw_get(cur[n], i) - mean;
              q[0] += d * d;
            }
          }
        }
      }
      row_sum<1>(q, tpr, red[parity], 0, rg);
      parity ^= 1;
    }
    const float rstd = rsqrtf(q[0] * inv_h + eps);
    if (valid) {
      if (t == 0) {
        if constexpr (!RMS) mean_out[row] = mean;
        rstd_out[row] = rstd;
      }
      Tout* yr = y + row * H;
      if constexpr (PST > 0) {
#pragma unroll
        for (int n = 0; n < NV; ++n) {
          // Chunk n's copies have landed once at most (copies committed) - (n + 1) groups are in flight.
          cp_async_wait_upto((n + PST < NV ? n + PST : NV) - (n + 1));
          Raw<Tp, VEC> cw, cb;
          const uint4* slot = fwd_psmem + (n % PST) * PP * TB + threadIdx.x;
#pragma unroll
          for (int h = 0; h < PWP; ++h) {
            const uint4 v = slot[h * TB];
            cw.u[4 * h] = v.x, cw.u[4 * h + 1] = v.y, cw.u[4 * h + 2] = v.z, cw.u[4 * h + 3] = v.w;
            if constexpr (!RMS) {
              const uint4 u = slot[(PWP + h) * TB];
              cb.u[4 * h] = u.x, cb.u[4 * h + 1] = u.y, cb.u[4 * h + 2] = u.z, cb.u[4 * h + 3] = u.w;
            }
          }
          const int c = t + n * tpr;
          float o[VEC];
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float v = raw_get(cur[n], i);
            o[i] = RMS ? v * rstd * raw_get(cw, i) : fmaf((v - mean) * rstd, raw_get(cw, i), raw_get(cb, i));
          }
          if (chunk_in<FIXED>(c, n, tpr, nchunks)) store_f<VEC>(yr + static_cast<int64_t>(c) * VEC, o);
          // The slot is free once its values are used (o above): refill it with chunk n + PST's.
          if (n + PST < NV) stage_q(n + PST);
        }
      } else {
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int c = t + n * tpr;
        if (chunk_in<FIXED>(c, n, tpr, nchunks)) {
          float o[VEC];
#pragma unroll
          for (int g0 = 0; g0 < VEC; g0 += PG) {
            Raw<Tp, PG> cw, cb;
            if constexpr (PREG) {
              cw = pw[n];
              if constexpr (!RMS) cb = pb[n];
            } else {
              load_params_m<ZS, Tp, PG, RMS>(w, b, wm, bm, c * VEC + g0, cw, cb);
            }
#pragma unroll
            for (int i = 0; i < PG; ++i) {
              if constexpr (HOLDF) {  // LayerNorm only: xf holds x - mean
                o[g0 + i] = fmaf(xf[n][g0 + i] * rstd, raw_get(cw, i), raw_get(cb, i));
              } else {
                const float v = raw_get(cur[n], g0 + i);
                o[g0 + i] = RMS ? v * rstd * raw_get(cw, i) : fmaf((v - mean) * rstd, raw_get(cw, i), raw_get(cb, i));
              }
            }
          }
          store_f<VEC>(yr + static_cast<int64_t>(c) * VEC, o);
        }
      }
      }
    }
    // Staged rows (PST > 0) wait for all their copies in the output loop above, so none outlives the row. That loop
    // runs only for a valid row, and the NOL1 blocks hold one row group (rpb 1), so every row the row loop reaches is
    // valid. A kernel with several row groups per block would need cp_async_wait<0>() here before the next row's
    // copies reuse the slots.
    if constexpr (PF) {
#pragma unroll
      for (int n = 0; n < NV; ++n) cur[n] = nxt[n];
    }
  }
}

// Any H (the launches use it for scalar rows wider than the register plans): one block per row (grid-stride), the row
// is read three times (LN) / twice (RMS), one element at a time; later reads partly hit L2. blockDim.x must be a
// multiple of 32.
template <typename Tin, typename Tout, bool RMS>
__global__ void __launch_bounds__(1024)
norm_fwd_generic_kernel(const Tin* __restrict__ x, const void* __restrict__ w, const void* __restrict__ b, bool p_f32,
                        Tout* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                        int64_t rows, int H, float eps) {
  __shared__ __align__(16) float red[2][32];  // row_sum reads it 16 bytes at a time
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

// Rows wider than the register plans on the vector path (fwd_plan gives nv 0: fp32 rows over 32768 columns, 16-bit rows
// over 65536) that norm_fwd_split_kernel does not take (fp32 rows over 65536 columns, 16-bit rows, fp32 rows where a
// block cannot have its 128 KB of shared memory): norm_fwd_wide_kernel. One block of kWideThreads per row (grid-stride
// over rows), two reads of the row instead of the generic kernel's three (LayerNorm) scalar ones: the statistics pass
// loads x 16 bytes at a time with an L2 evict-last policy; the output pass reads it again with evict-first, from L2,
// since the launch keeps the rows in flight within half the L2 (wide_grid). LayerNorm statistics in one pass: each
// thread merges the mean and the sum of squared deviations of its chunks (Chan et al.'s pairwise update in delta form,
// every chunk's own two-pass moments), then the block merges the threads' (count, mean, M2) (block_moments): no
// cancellation of large terms, as in the register kernel's two passes. Before sm_80 (no createpolicy) the loads carry
// no L2 policy.
constexpr int kWideThreads = 1024;
constexpr int kWideUnroll = 4;  // chunks in flight per thread and pass

__device__ __forceinline__ uint64_t l2_policy(bool last) {
  uint64_t pol = 0;
#if !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800)
  if (last) {
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  } else {
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  }
#endif
  return pol;
}

// Loads 16 bytes at p (aligned) with the L2 policy pol (l2_policy).
__device__ __forceinline__ uint4 ld_pol16(const void* p, uint64_t pol) {
  uint4 v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  (void)pol;
  v = *reinterpret_cast<const uint4*>(p);
#else
  asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
#endif
  return v;
}

template <typename T, int N>
__device__ __forceinline__ void raw_load_pol(const T* p, Raw<T, N>& r, uint64_t pol) {
  static_assert(Raw<T, N>::kBytes == 16, "raw_load_pol: one 16-byte chunk");
  const uint4 v = ld_pol16(p, pol);
  r.u[0] = v.x;
  r.u[1] = v.y;
  r.u[2] = v.z;
  r.u[3] = v.w;
}

// (Session 15 timed this kernel as a plan for rows of 2048-32768 columns, with blocks of 256-1024 threads, 2 or 4
// chunks in flight, 32-register launch bounds and one block per row, in the manner of torch.compile's looped
// kernels: it trailed the register plans at 16 of 20 rows; session15.log.)
// Blocks per launch of norm_fwd_wide_kernel: at least one per SM, at most what fits, and beyond one per SM no more
// rows in flight than half the L2 holds (the output pass re-reads each row from there).
inline int64_t wide_grid(int64_t rows, int64_t row_bytes, int sms, int occ) {
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  const int64_t half_l2 = static_cast<int64_t>(prop->l2CacheSize) / 2;
  const int64_t l2_rows = std::max<int64_t>(1, half_l2 / std::max<int64_t>(1, row_bytes));
  const int64_t fit = static_cast<int64_t>(sms) * occ;
  return std::max<int64_t>(1, std::min<int64_t>(rows, std::max<int64_t>(sms, std::min(fit, l2_rows))));
}

// x [rows, H] (Tin, 16-byte aligned, H % VEC == 0, VEC * sizeof(Tin) == 16), w/b [H] (Tp, aligned to VEC elements, or
// null), y [rows, H] (Tout, aligned to VEC elements), mean/rstd [rows] fp32. blockDim.x = kWideThreads.
template <typename Tin, typename Tout, typename Tp, int VEC, bool RMS>
__global__ void __launch_bounds__(kWideThreads)
norm_fwd_wide_kernel(const Tin* __restrict__ x, const Tp* __restrict__ w, const Tp* __restrict__ b,
                     Tout* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows,
                     int H, float eps) {
  constexpr int U = kWideUnroll;
  __shared__ __align__(16) float red[2][3][32];
  const int nchunks = H / VEC;
  const int tid = threadIdx.x;
  const int step = blockDim.x;
  const float inv_h = 1.f / static_cast<float>(H);
  const uint64_t keep = l2_policy(true);
  const uint64_t drop = l2_policy(false);
  int parity = 0;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const Tin* xr = x + row * H;
    // Statistics pass.
    float n = 0.f, m = 0.f, m2 = 0.f;  // RMS: m2 is the sum of squares
    for (int c0 = tid; c0 < nchunks; c0 += U * step) {
      Raw<Tin, VEC> r[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + u * step;
        if (c < nchunks) raw_load_pol(xr + static_cast<int64_t>(c) * VEC, r[u], keep); else raw_zero(r[u]);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if constexpr (RMS) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float v = raw_get(r[u], i);
            m2 += v * v;  // zeros past the row
          }
        } else {
          if (c0 + u * step < nchunks) merge_chunk(n, m, m2, r[u]);
        }
      }
    }
    float mean = 0.f, var = 0.f;
    if constexpr (RMS) {
      float q[1] = {m2};
      row_sum<1>(q, step, red[parity][0], 0, 0);
      var = q[0] * inv_h;
    } else {
      block_moments(n, m, m2, &red[parity][0][0]);
      mean = m;
      var = m2 * inv_h;
    }
    parity ^= 1;
    const float rstd = rsqrtf(var + eps);
    if (tid == 0) {
      if constexpr (!RMS) mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
    // Output pass.
    Tout* yr = y + row * H;
    for (int c0 = tid; c0 < nchunks; c0 += U * step) {
      Raw<Tin, VEC> r[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + u * step;
        if (c < nchunks) raw_load_pol(xr + static_cast<int64_t>(c) * VEC, r[u], drop);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + u * step;
        if (c < nchunks) {
          Raw<Tp, VEC> pw, pb;
          load_params<Tp, VEC, RMS>(w, b, c * VEC, pw, pb);
          float o[VEC];
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            const float v = raw_get(r[u], i);
            o[i] = RMS ? v * rstd * raw_get(pw, i) : fmaf((v - mean) * rstd, raw_get(pw, i), raw_get(pb, i));
          }
          store_f<VEC>(yr + static_cast<int64_t>(c) * VEC, o);
        }
      }
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
// DxRow: one element's dx from x, g = dy * w and its row's constants (mean, rstd, c1 = mean_j(g), c2 =
// mean_j(g * xhat)). FMA (dx_fma) computes it as fma(x - mean, k1, rstd * (g - c1)) with k1 = -rstd^2 * c2 per row
// (LayerNorm: FADD, FFMA for g - c1 from dy * w, FMUL, FFMA; RMSNorm, mean and c1 zero: FMUL, FMUL, FFMA): one
// instruction fewer per element than rstd * (g - c1 - (x - mean) * rstd * c2), which recomputes xhat (FADD, FMUL,
// FFMA, FFMA, FMUL; RMSNorm FMUL, FMUL, FFMA, FMUL). x - mean stays the exact difference it is in xhat. (rstd^2
// flushes to zero or overflows only at rstd below 1e-19 or above 1e19.) norm_bwd_cols_kernel keeps its own form: it
// computes xhat for the weight gradient anyway.
template <bool FMA>
struct DxRow {
  float m, r, c1, c2, k1;
  __device__ __forceinline__ DxRow(float mean, float rstd, float c1_, float c2_)
      : m(mean), r(rstd), c1(c1_), c2(c2_), k1(-(rstd * rstd) * c2_) {}
  __device__ __forceinline__ float operator()(float x, float g) const {
    if constexpr (FMA) {
      return fmaf(x - m, k1, r * (g - c1));
    } else {
      return r * (g - c1 - (x - m) * r * c2);
    }
  }
};

// Whether the backward of Tin inputs computes dx in DxRow's fma form; HC: the kernel's compile-time hidden size (0:
// none). Session 30 (H200, benchmarks.norm_raw, backward, % of copy, two alternating runs, old form -> fma form):
// - 16-bit gained: RMSNorm bf16 16384-65536 columns +1.4 to +1.9 (16384 x 16384: 93.9 -> 95.8), 4096 +0.7, fp16 +0.1
//   to +0.6; LayerNorm +0.1 to +0.8 at 512-4096 and 16384-65536 (bf16 16384 x 4096: 86.3 -> 86.8), but 6144 and 8192
//   -0.2 to -0.7; RMSNorm at 768 columns bf16 -0.6, fp16 +1.0;
// - LayerNorm's kernel specialised to 768 columns spilled 8 bytes at its 64 registers (ptxas, sm_90) and lost 1.2-1.7
//   (bf16 32768 x 768: 74.5 -> 72.8): it keeps the old form;
// - fp32 moved by -1.5 (LayerNorm 32768 x 2048: 97.9 -> 96.4) to +0.6: it keeps the old form.
// A benchmark build may set -DPIPEGOOSE_NORM_DX_FMA=0 (the old form everywhere) or 2 (the fma form everywhere).
#if defined(PIPEGOOSE_NORM_DX_FMA)
constexpr int kDxFma = PIPEGOOSE_NORM_DX_FMA;
static_assert(kDxFma >= 0 && kDxFma <= 2, "PIPEGOOSE_NORM_DX_FMA: 0, 1 or 2");
#else
constexpr int kDxFma = 1;
#endif
template <typename Tin, bool RMS, int HC>
constexpr bool dx_fma() {
  return kDxFma == 2 || (kDxFma == 1 && sizeof(Tin) == 2 && !(!RMS && HC == 768));
}

// norm_bwd_kernel. dy [rows, H] (Tdy), x [rows, H] (Tin), w [H] (float32 when p_f32, else Tin; or null), mean/rstd [rows] fp32,
// dx [rows, H] (Tin). ws: fp32 [NACC, gridDim.x, H] (NACC = 2 for LN: dw, db; 1 for RMS), or null when no
// parameter gradient is wanted.
//
// Persistent grid: each row group of tpr threads walks over rows rg0, rg0 + stride, ...; x and dy stay packed in
// their own dtypes in registers. PF: the next row's x, dy, mean and rstd are loaded before the current row is
// reduced (two packed rows live), so loads stay in flight through the row reduction and the dx stores.
// The per-column sums (dw, db) of the rows a thread sees live in registers (ACC_SMEM false), or for wide rows in
// dynamic shared memory [NACC][tpr][NV * VEC + 1] owned slot by slot by one thread (ACC_SMEM true; requires one
// row group per block). At the end, with several row groups per block, dynamic shared memory [RPB][H] floats
// combines them in a fixed order; each block writes one partial row per accumulator into ws.
// HC > 0 (BwdSpecHidden, BwdSpecExtra, or PIPEGOOSE_NORM_HIDDEN builds): specialised to H == HC as norm_fwd_kernel,
// with the geometry FixedRow<HC, VEC, NV, ACC_SMEM>.
template <bool ACC_SMEM, bool F32>
struct BwdBounds {
  // Register accumulators: blocks of 256 threads, three per SM for fp32 input and grad_output (<= 80 registers;
  // RMSNorm's generic fp32 kernel spills 4 bytes there and still ran 12% faster at 512 columns, session 5 A/B), two
  // otherwise (<= 128 registers; at three per SM the 16-bit variants spill 68-224 bytes); shared-memory
  // accumulators: up to 512 threads per row, <= 128 registers.
  static constexpr int threads = ACC_SMEM ? 512 : 256;
#if defined(PIPEGOOSE_NORM_BWD_MINB)
  // Benchmark experiment (off in the shipped build): this many resident blocks for every register plan.
  static constexpr int min_blocks = ACC_SMEM ? 1 : PIPEGOOSE_NORM_BWD_MINB;
#else
  static constexpr int min_blocks = ACC_SMEM ? 1 : (F32 ? 3 : 2);
#endif
};

template <typename Tin, typename Tdy, int VEC, int NV, bool RMS, bool ACC_SMEM, bool PF, int HC>
__global__ void __launch_bounds__(BwdBounds<ACC_SMEM, sizeof(Tin) == 4 && sizeof(Tdy) == 4>::threads,
                                   BwdBounds<ACC_SMEM, sizeof(Tin) == 4 && sizeof(Tdy) == 4>::min_blocks)
norm_bwd_kernel(const Tdy* __restrict__ dy, const Tin* __restrict__ x, const void* __restrict__ w, bool p_f32,
                const float* __restrict__ mean, const float* __restrict__ rstd, Tin* __restrict__ dx,
                float* __restrict__ ws, int64_t rows, int h_arg, int tpr_arg, bool pcache) {
  using G = FixedRow<HC, VEC, NV, ACC_SMEM>;
  constexpr bool FIXED = HC > 0;
  constexpr int NACC = RMS ? 1 : 2;
  constexpr int PG = VEC < 4 ? VEC : 4;
  extern __shared__ __align__(16) float bwd_smem[];  // [the weight cache sw[H4] when pcache][dyn_smem]
  __shared__ __align__(16) float red[2][64];
  const int H = FIXED ? HC : h_arg;
  const int tpr = FIXED ? G::tpr : tpr_arg;
  const int rpb = FIXED ? G::rpb : blockDim.x / tpr;
  const unsigned nthreads = FIXED ? G::rpb * G::tpr : blockDim.x;  // unsigned as blockDim.x (HC == 0: as before)
  const int rg = threadIdx.x / tpr;
  const int t = threadIdx.x - rg * tpr;
  const int nchunks = FIXED ? G::chunks : H / VEC;
  const float inv_h = FIXED ? G::inv_h : 1.f / static_cast<float>(H);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * rpb;
  // pcache: the weight as fp32 in sw (stage_weight), H rounded up to 4 floats; the rest of the dynamic shared
  // memory (dyn_smem) follows it.
  float* sw = bwd_smem;
  float* dyn_smem = bwd_smem + (pcache ? ((H + 3) & ~3) : 0);
  // ACC_SMEM: thread t's NV * VEC slots are contiguous (compile-time offsets from one base: no address
  // registers) with a stride of NV * VEC + 1 words between threads (odd: no bank conflicts).
  const int acc_stride = (NV * VEC + 1) * tpr;  // floats per accumulator
  float* acc_t = dyn_smem + t * (NV * VEC + 1);
  const bool want_acc = ws != nullptr;

  float acc_w[ACC_SMEM ? 1 : NV][ACC_SMEM ? 1 : VEC];
  float acc_b[ACC_SMEM ? 1 : NV][ACC_SMEM ? 1 : VEC];  // unused (and dropped by the compiler) when RMS
  if constexpr (ACC_SMEM) {
    // Only the owning thread ever touches its slots: no barrier needed.
#pragma unroll
    for (int a = 0; a < NACC; ++a)
#pragma unroll
      for (int k = 0; k < NV * VEC; ++k) acc_t[a * acc_stride + k] = 0.f;
  } else {
#pragma unroll
    for (int n = 0; n < NV; ++n)
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        acc_w[n][i] = 0.f;
        acc_b[n][i] = 0.f;
      }
  }

  int parity = 0;
  int64_t base = static_cast<int64_t>(blockIdx.x) * rpb;
  Raw<Tin, VEC> xc[NV];
  Raw<Tdy, VEC> dc[NV];
  float m = 0.f, r = 0.f;
  if constexpr (PF) {
    const int64_t row = base + rg;
    const bool valid = row < rows;
    load_row<Tin, VEC, NV, FIXED>(x + row * H, valid, t, tpr, nchunks, xc);
    load_row<Tdy, VEC, NV, FIXED>(dy + row * H, valid, t, tpr, nchunks, dc);
    if (valid) {
      if constexpr (!RMS) m = mean[row];
      r = rstd[row];
    }
  }
  if (pcache) stage_weight<Tin>(w, p_f32, H, sw);  // after the first loads: they overlap
  for (; base < rows; base += stride) {
    const int64_t row = base + rg;
    const bool valid = row < rows;
    Raw<Tin, VEC> xn[PF ? NV : 1];
    Raw<Tdy, VEC> dn[PF ? NV : 1];
    float mn = 0.f, rn = 0.f;
    if constexpr (PF) {
      const int64_t nrow = row + stride;
      const bool nvalid = nrow < rows;
      load_row<Tin, VEC, NV, FIXED>(x + nrow * H, nvalid, t, tpr, nchunks, xn);
      load_row<Tdy, VEC, NV, FIXED>(dy + nrow * H, nvalid, t, tpr, nchunks, dn);
      if (nvalid) {
        if constexpr (!RMS) mn = mean[nrow];
        rn = rstd[nrow];
      }
    } else {
      load_row<Tin, VEC, NV, FIXED>(x + row * H, valid, t, tpr, nchunks, xc);
      load_row<Tdy, VEC, NV, FIXED>(dy + row * H, valid, t, tpr, nchunks, dc);
      m = 0.f;
      r = 0.f;
      if (valid) {
        if constexpr (!RMS) m = mean[row];
        r = rstd[row];
      }
    }
    // First pass: g = w * dy, the two row sums, the column sums. (g is recomputed in the second pass from the
    // packed dy and the weight, an L1 hit, rather than held in NV * VEC more registers; parameters are read in
    // groups of PG elements, 16 bytes of fp32, for the same reason.)
    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const int c = t + n * tpr;
#pragma unroll
      for (int g0 = 0; g0 < VEC; g0 += PG) {
        float wv[PG];
#pragma unroll
        for (int k = 0; k < PG; ++k) wv[k] = 1.f;
        if (chunk_in<FIXED>(c, n, tpr, nchunks)) {
          if (pcache) lds_f<PG>(sw + c * VEC + g0, wv);
          else if (w != nullptr) load_param<PG, Tin>(w, p_f32, c * VEC + g0, wv);
        }
#pragma unroll
        for (int k = 0; k < PG; ++k) {
          const int i = g0 + k;
          const float xh = (raw_get(xc[n], i) - m) * r;  // out-of-row slots: dy == 0, so they add nothing below
          const float d = raw_get(dc[n], i);
          if constexpr (ACC_SMEM) {
            if (want_acc && chunk_in<FIXED>(c, n, tpr, nchunks)) {
              acc_t[n * VEC + i] += d * xh;
              if constexpr (!RMS) acc_t[acc_stride + n * VEC + i] += d;
            }
          } else {
            acc_w[n][i] += d * xh;
            if constexpr (!RMS) acc_b[n][i] += d;
          }
          const float g = d * wv[k];
          if constexpr (!RMS) s[0] += g;
          s[1] += g * xh;
        }
      }
    }
    row_sum<2>(s, tpr, red[parity]);
    parity ^= 1;
    if (valid) {
      const DxRow<dx_fma<Tin, RMS, HC>()> dxo(m, r, RMS ? 0.f : s[0] * inv_h, s[1] * inv_h);
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int c = t + n * tpr;
        if (chunk_in<FIXED>(c, n, tpr, nchunks)) {
          float o[VEC];
#pragma unroll
          for (int g0 = 0; g0 < VEC; g0 += PG) {
            float wv[PG];
#pragma unroll
            for (int k = 0; k < PG; ++k) wv[k] = 1.f;
            if (pcache) lds_f<PG>(sw + c * VEC + g0, wv);
            else if (w != nullptr) load_param<PG, Tin>(w, p_f32, c * VEC + g0, wv);
#pragma unroll
            for (int k = 0; k < PG; ++k) {
              const int i = g0 + k;
              const float g = raw_get(dc[n], i) * wv[k];
              o[i] = dxo(raw_get(xc[n], i), g);
            }
          }
          store_f<VEC, Tin, kDxStream>(dx + row * H + static_cast<int64_t>(c) * VEC, o);
        }
      }
    }
    if constexpr (PF) {
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        xc[n] = xn[n];
        dc[n] = dn[n];
      }
      m = mn;
      r = rn;
    }
  }

  if (!want_acc) return;
  const int64_t P = gridDim.x;
  if constexpr (ACC_SMEM) {
#pragma unroll
    for (int a = 0; a < NACC; ++a) {
      float* out = ws + (a * P + blockIdx.x) * static_cast<int64_t>(H);
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int c = t + n * tpr;
        if (chunk_in<FIXED>(c, n, tpr, nchunks)) {
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
        if (chunk_in<FIXED>(c, n, tpr, nchunks)) {
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
        if (chunk_in<FIXED>(c, n, tpr, nchunks)) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            dyn_smem[rg * H + c * VEC + i] = a == 0 ? acc_w[n][i] : acc_b[n][i];
          }
        }
      }
      __syncthreads();
      float* out = ws + (a * P + blockIdx.x) * static_cast<int64_t>(H);
      for (int j = threadIdx.x; j < H; j += nthreads) {
        float sum = 0.f;
        for (int g = 0; g < rpb; ++g) sum += dyn_smem[g * H + j];
        out[j] = sum;
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Backward with asynchronous copies (the register-accumulator plan of vector rows whose input and grad_output
// have the same element size)
// ---------------------------------------------------------------------------------------------------------
// norm_bwd_kernel's prefetching plan keeps the next row of x and dy in registers: 105-118 registers for 16-bit
// inputs, two blocks of 256 threads per SM, one row ahead, and the profile of the fourth session found that backward
// latency-bound (25% occupancy, 0.9 eligible warps per scheduler). Here each thread copies its own chunks of the
// rows S - 1 ahead (S stages: AsyncBounds) straight into a ring of shared-memory stages with cp.async (sm_80 and
// later; no registers held while the copies are in flight), and reads the current row back from its stage in both
// passes.
// Every thread reads only the slots its own copies wrote, so cp.async.wait_group alone orders them: no block
// barrier per row beyond the row reduction's. Out-of-row slots and rows past the end are zero-filled by the copy
// itself (source size 0), so the passes read them unconditionally. Shared memory: [the weight cache sw[H4] when
// pcache][x stages: S * rpb rows of NV * tpr chunks][dy stages: the same]; the end of the kernel reuses the
// stage area to combine the row groups' column sums (launch_bwd sizes it for both).
// Same arguments and requirements as norm_bwd_kernel with ACC_SMEM = false and 16-byte chunks of x and dy, and the
// same arithmetic in the same order.
// Stages and resident blocks per SM (the launch bound), from the session 6 A/B on the H200 (bwd % of copy, bf16
// LayerNorm / RMSNorm): 256-thread blocks of the 16-bit kernels specialised to a hidden size (BwdSpecHidden: no
// spills at 64 registers; since session 16 also those compiled for their threads per row, TPRC) run four blocks of two
// stages (1024-4096 columns: LayerNorm 76-77 -> 83-85, RMSNorm about
// even); the others three blocks of three stages (at 512 columns, generic: LayerNorm 85 against 72 with four blocks
// of two, where it spills 68 bytes; fp32 1024: 91 against 86). 512-thread blocks (rows of 257-512 threads): two
// blocks of two stages (64 registers); with four chunks per thread (NV = 4) launch bounds of one block (76-108
// registers then, 86-117 in session 32's ptxas for sm_90; no spills; its two stages, 128 KB at the widest rows, leave
// no room for a second block there anyway). Packed rows (pack_tpb, session 17) in blocks of 512 or 1024 threads: two
// blocks or one, of two stages, at 64 registers. Tried and dropped (session 6 A/B, before the rows of a block
// synchronised apart on named barriers): the specialised kernels in blocks of up to 1024 threads, one per SM (fewer
// workspace rows: 132 instead of 528; the workspace and its column reduction cost 8-18% of the backward at
// [8192-16384, 4096] bf16), 0-20 points slower at every size (RMSNorm bf16 8192: 79 against 95; fp32 4096: 75 against
// 97); session 17's packing (pack_tpb) gains where that lost; and (session 15, call 5)
// one block's bounds for the generic 16-bit LayerNorm kernel of 512-thread blocks (91 registers instead of 64 and 32
// bytes of spills): 3-20 points slower at 4608-8000 columns. Also dropped (session 32, call 1; session32.log): bulk
// copies (cp.async.bulk, the TMA's one-dimensional form) instead of a cp.async per thread and chunk, in the kernels
// whose rows are whole warps (the specialised sizes and TPRC), lane 0 of each warp copying its warp's chunks of the row
// (two copies of 512 bytes per tensor at two chunks per thread) onto an mbarrier of its own per stage: correct (the
// GPU norm tests and the sanitizers passed on it), but 1-16 points slower in 16-bit (bf16 LayerNorm 1024 / 4096 / 8192
// columns 91.0 / 87.7 / 84.1 -> 79.3 / 77.0 / 72.2, RMSNorm 90.1 / 89.3 / 90.3 -> 86.4 / 86.1 / 78.1) and -5.8 to +0.6
// in fp32; with three stages 1-4 points less behind, still slower.
// -DPIPEGOOSE_NORM_BWD_STAGES=S and -DPIPEGOOSE_NORM_BWD_ASYNC_MINB=B (benchmark experiments, off in the shipped
// build) set every kernel's (STAGES=3: 0.2-7.3 points slower, bf16 1024-8192 columns, session 33, call 4).
// Blocks of 768 threads (kWideRegTpb) hold one 16-bit RMSNorm row of 608-704 threads of two chunks (bwd_plan's wide
// register rows, 9224-11264 columns: 577-704 chunks per stride), one block per SM, kWideRegStages stages (with the
// weight cache, 220 KB of shared memory at 11264 columns; where they do not fit, launch_bwd takes the plan without
// them). -DPIPEGOOSE_NORM_BWD_WIDE_STAGES=S (a benchmark experiment, off in the shipped build) sets their stages.
constexpr int kWideRegTpb = 768;
constexpr int kWideRegMinH = 9224, kWideRegMaxH = 11264;
#if defined(PIPEGOOSE_NORM_BWD_WIDE_STAGES)
constexpr int kWideRegStages = PIPEGOOSE_NORM_BWD_WIDE_STAGES;
#else
constexpr int kWideRegStages = 4;
static_assert(kWideRegStages * 2 * 704 * 8 * (2 + 2) + 4 * kWideRegMaxH <= 227 * 1024 - 1024,  // (2 chunks, 704 thr.)
              "the wide register rows: their stages of x and dy and the weight cache in an H200's shared memory");
#endif
template <int TPB, bool SPEC16, int NV = 2>
struct AsyncBounds {
  static_assert(TPB == 256 || TPB == 512 || TPB == kWideRegTpb || TPB == 1024,
                "AsyncBounds: 256, 512, 768 or 1024 threads per block");
#if defined(PIPEGOOSE_NORM_BWD_STAGES)
  static constexpr int stages = PIPEGOOSE_NORM_BWD_STAGES;
#else
  static constexpr int stages = TPB == kWideRegTpb ? kWideRegStages : TPB >= 512 || SPEC16 ? 2 : 3;
#endif
#if defined(PIPEGOOSE_NORM_BWD_ASYNC_MINB)
  static constexpr int min_blocks = PIPEGOOSE_NORM_BWD_ASYNC_MINB;
#else
  static constexpr int min_blocks = TPB >= kWideRegTpb ? 1 : TPB == 512 ? (NV == 4 ? 1 : 2) : SPEC16 ? 4 : 3;
#endif
  static_assert(stages >= 2 && stages <= 8, "PIPEGOOSE_NORM_BWD_STAGES: expected 2 to 8");
};

// Issues the copies of the chunks of one row owned by thread t into its stage slots (stage: the row image of
// NV * tpr chunks); zeros for chunks outside the row and for an invalid row.
template <typename T, int VEC, int NV, bool FIXED>
__device__ __forceinline__ void async_row(T* stage, const T* __restrict__ row_ptr, const T* __restrict__ any,
                                          bool valid, int t, int tpr, int nchunks) {
  constexpr int B = VEC * static_cast<int>(sizeof(T));
  static_assert(B % 16 == 0, "async_row: 16-byte chunks");
#pragma unroll
  for (int n = 0; n < NV; ++n) {
    const int c = t + n * tpr;
    const bool in = valid && chunk_in<FIXED>(c, n, tpr, nchunks);
    const char* src = in ? reinterpret_cast<const char*>(row_ptr + static_cast<int64_t>(c) * VEC)
                         : reinterpret_cast<const char*>(any);
    char* dst = reinterpret_cast<char*>(stage + c * VEC);
#pragma unroll
    for (int k = 0; k < B / 16; ++k) cp_async16(dst + 16 * k, in ? src + 16 * k : src, in ? 16 : 0);
  }
}

// Reads one 16-byte-multiple chunk of shared memory into r.
template <typename T, int N>
__device__ __forceinline__ void raw_lds(const T* p, Raw<T, N>& r) {
  static_assert(Raw<T, N>::kBytes % 16 == 0, "raw_lds: 16-byte chunks");
#pragma unroll
  for (int k = 0; k < Raw<T, N>::kBytes / 16; ++k) {
    const uint4 v = reinterpret_cast<const uint4*>(p)[k];
    r.u[4 * k] = v.x;
    r.u[4 * k + 1] = v.y;
    r.u[4 * k + 2] = v.z;
    r.u[4 * k + 3] = v.w;
  }
}

// Shared memory of the stages, in bytes (per block).
constexpr size_t bwd_async_stage_bytes(int stages, int rpb, int nv, int tpr, int vec, int in_bytes, int dy_bytes) {
  return static_cast<size_t>(stages) * rpb * nv * tpr * vec * static_cast<size_t>(in_bytes + dy_bytes);
}

// Rows of two chunks per thread of the register plan without a specialised kernel (widths not in BwdSpecHidden or
// BwdSpecExtra), by their threads per row (tpr, a multiple of 32 up to 512 there): how they run in
// norm_bwd_async_kernel.
// - kRuntime: the kernel of run-time geometry (TPRC = 0), as before session 16.
// - kFixed: the kernel compiled for tpr (TPRC = tpr; rows per block TPB / tpr and the index arithmetic are
//   compile-time constants, H is not; for 16-bit rows, four blocks of two stages per SM at 64 registers, as the
//   specialised kernels); rows of up to 256 threads in blocks of 256, wider ones in blocks of 512.
// - kPacked: kFixed with rows of 96-224 threads packed into blocks of 512 threads (5, 3, 2 or 2 rows instead of 2, 1,
//   1 or 1): as many rows per SM, a third to a half of the workspace's partial rows.
// Chosen from session 16's A/B of the raw backward (H200, % of copy, two rounds; benchmarks/results/
// nvidia_h200_2026-11-30/session16.log): 16-bit kFixed against kRuntime +4.6 to +19.0 points at 640-7168 columns
// (LayerNorm bf16 5120: 66.3 -> 84.7), but 16-bit LayerNorm at 384 and 512 columns (tpr 32) 16 to 23 points slower;
// kPacked another +1 to +9 at tpr 96-224 (bf16 2560: LayerNorm 67.7 -> 76.7, RMSNorm 74.2 -> 81.4). fp32 is mixed
// (each choice below is the best of the three at its measured tpr; the others follow their neighbours): LayerNorm
// kFixed at 384-640 and 2560-3584 columns (+3 to +9) but tpr 384 (3072 columns: 89.0 against 90.9), kPacked at
// 1152-1792 (+1.5 to +7); RMSNorm lost 1 to 6 points on kFixed at tpr 64 and 160 (384-512, 1152-1280 columns) and
// gained 2 to 8 from tpr 224 (1792-3584).
// Tried and dropped (session 16, call 4): 16-bit rows whose lanes are busier with one chunk per thread (640-1280 and
// 1600-1792 columns, 768 included) on one chunk per thread, compiled for 96-224 threads per row and packed into blocks
// of 512: 5-17 points slower (RMSNorm bf16 1152: 73.3 against 90.4), but LayerNorm at 640 columns (+1.5).
// -DPIPEGOOSE_NORM_BWD_NO_TPRC (a benchmark experiment, off in the shipped build) runs every such row kRuntime, as
// before session 16; -DPIPEGOOSE_NORM_BWD_TPRC_FIXED every tpr from 32 kFixed, -DPIPEGOOSE_NORM_BWD_PACK every tpr
// from 32 kFixed and 96-224 kPacked (session 16's "tprc" and "pack" builds).
enum class Tprc { kRuntime, kFixed, kPacked };

// Blocks that the rows of two chunks per thread of the register plan fill, by dtype (vec: 8 for 16-bit, 4 for fp32),
// op, threads per row and kernel (spec: the kernel specialised to the row's size, BwdSpecHidden or BwdSpecExtra; else
// the one compiled for tpr, tprc_mode): 0 where they keep their unpacked blocks (256 threads; rows of 257-512 threads
// 512), else 512 or 1024 (kPacked; at most 15 rows per block: the named barriers). Fewer, wider blocks per SM keep as
// many rows in flight and leave fewer partial rows of column sums in the workspace (at [16384, 4096] 16-bit: 264
// instead of 528).
// Session 17's A/B of the raw backward (H200, % of copy, two rounds, bf16 and fp16 alike; benchmarks/results/
// nvidia_h200_2026-11-30/session17.log), against session 16's choices (-DPIPEGOOSE_NORM_BWD_NO_PACK_TABLE):
// - 16-bit, blocks of 512 at tpr 64 and 128 and the specialised 4096 (tpr 256): -0.1 to +5.0 (LayerNorm bf16
//   [8192, 4096]: 71.8 -> 76.8, [16384, 4096]: 82.5 -> 86.4); blocks of 1024 gained less or lost at most of these
//   rows (within 0.6 more at LayerNorm [16384, 4096] and 1600 columns and RMSNorm bf16 2048).
// - 16-bit, blocks of 1024: LayerNorm at tpr 96 and 192-224 (1152-1536 and 2816-3584 columns: +0.2 to +5.5) and
//   RMSNorm from tpr 288 (4608-8192 columns: +1.0 to +6.2), both ops at tpr 256 without the specialised kernel (4000
//   columns: +0.1 to +6.3, where blocks of 512 lost 2.4 to 4.6) and LayerNorm at 288-320 and 384, 448, 480 (4608,
//   5120, 6144, 7168, 7680 columns: -0.4 to +3.5). LayerNorm keeps its blocks at tpr 352, 416 and 512 (5632, 6656,
//   8192 columns: 0.7 to 2.8 slower in 1024); RMSNorm at tpr 96 and 160-224 keeps 512 (call 2: 0.1 to 3.0 slower
//   in 1024), and so does LayerNorm at tpr 160 (2056-2560 columns; 1024 ran +0.2 to +0.7 at 2560, not yet taken).
// - fp32: LayerNorm at tpr 160 and 384-448 in blocks of 1024 (1152-1280 columns: +0.4 to +0.9, 3072-3584: -0.0 to
//   +2.9); RMSNorm at tpr 128 in blocks of 512 (1016 columns: 87.1-87.6 -> 95.0-96.1; 1024, specialised: +0.8).
//   Elsewhere packing lost up to 6.0 points (LayerNorm 768 in blocks of 512; 3840, tpr 480, in 1024: -0.4) or gained
//   at most 0.6 (LayerNorm 1792 in blocks of 1024).
// -DPIPEGOOSE_NORM_BWD_PACK_TPB=P (a benchmark experiment, off in the shipped build; P = 512 or 1024) packs every row
// of 64 to P / 2 threads into blocks of P instead; -DPIPEGOOSE_NORM_BWD_NO_PACK_TABLE packs as session 16 did (16-bit
// tpr 96 and 160-224, fp32 LayerNorm 160-224 and fp32 RMSNorm 192 into blocks of 512, nothing else).
#if defined(PIPEGOOSE_NORM_BWD_PACK_TPB)
constexpr int kPackTpb = PIPEGOOSE_NORM_BWD_PACK_TPB;
static_assert(kPackTpb == 512 || kPackTpb == 1024, "PIPEGOOSE_NORM_BWD_PACK_TPB: expected 512 or 1024");
#endif
constexpr int pack_tpb(int vec, bool rms, int tpr, bool spec) {
  if (tpr < 64 || tpr > 512 || tpr % 32 != 0) return 0;
#if defined(PIPEGOOSE_NORM_BWD_NO_TPRC) || defined(PIPEGOOSE_NORM_BWD_TPRC_FIXED)
  return 0;
#elif defined(PIPEGOOSE_NORM_BWD_PACK)
  return !spec && (tpr == 96 || tpr == 160 || tpr == 192 || tpr == 224) ? 512 : 0;
#elif defined(PIPEGOOSE_NORM_BWD_PACK_TPB)
  return 2 * tpr <= kPackTpb && kPackTpb / tpr <= 15 ? kPackTpb : 0;
#elif defined(PIPEGOOSE_NORM_BWD_NO_PACK_TABLE)
  if (spec) return 0;
  const bool packable = tpr == 96 || tpr == 160 || tpr == 192 || tpr == 224;
  if (vec == 8) return packable ? 512 : 0;
  if (vec != 4) return 0;
  if (!rms) return tpr >= 160 && tpr <= 224 ? 512 : 0;
  return tpr == 192 ? 512 : 0;
#else
  if (vec == 8) {
    if (tpr == 256) return spec ? 512 : 1024;
    if (rms) return tpr >= 288 ? 1024 : 512;
    if (tpr == 352 || tpr == 416 || tpr == 512) return 0;
    return tpr == 96 || tpr >= 192 ? 1024 : 512;
  }
  if (vec != 4) return 0;
  if (!rms) return tpr == 160 || (tpr >= 384 && tpr <= 448) ? 1024 : tpr == 192 || tpr == 224 ? 512 : 0;
  return tpr == 128 || tpr == 192 ? 512 : 0;
#endif
}
// The largest block of packed rows that this build launches.
constexpr int kMaxPackTpb = [] {
  int m = 512;
  for (int t = 64; t <= 512; t += 32) {
    for (int v = 4; v <= 8; v += 4) {
      for (int k = 0; k < 4; ++k) {
        if (pack_tpb(v, k & 1, t, k & 2) > m) m = pack_tpb(v, k & 1, t, k & 2);
      }
    }
  }
  return m;
}();

// Rows of two chunks per thread of the register plan without a specialised kernel (widths not in BwdSpecHidden or
// BwdSpecExtra), by their threads per row (tpr, a multiple of 32 up to 512 there): how they run in
// norm_bwd_async_kernel.
// - kRuntime: the kernel of run-time geometry (TPRC = 0), as before session 16.
// - kFixed: the kernel compiled for tpr (TPRC = tpr; rows per block TPB / tpr and the index arithmetic are
//   compile-time constants, H is not; for 16-bit rows, four blocks of two stages per SM at 64 registers, as the
//   specialised kernels); rows of up to 256 threads in blocks of 256, wider ones in blocks of 512.
// - kPacked: kFixed in the blocks of pack_tpb.
// Chosen from session 16's A/B of the raw backward (H200, % of copy, two rounds; benchmarks/results/
// nvidia_h200_2026-11-30/session16.log): 16-bit kFixed against kRuntime +4.6 to +19.0 points at 640-7168 columns
// (LayerNorm bf16 5120: 66.3 -> 84.7), but 16-bit LayerNorm at 384 and 512 columns (tpr 32) 16 to 23 points slower;
// packed into blocks of 512, another +1 to +9 at tpr 96-224 (bf16 2560: LayerNorm 67.7 -> 76.7, RMSNorm 74.2 -> 81.4).
// fp32 is mixed (each choice below is the best of the three at its measured tpr; the others follow their
// neighbours): LayerNorm kFixed at 384-640 and 2560-3584 columns (+3 to +9) but tpr 384 (3072 columns: 89.0 against
// 90.9), packed at 1152-1792 (+1.5 to +7); RMSNorm lost 1 to 6 points on kFixed at tpr 64 and 160 (384-512, 1152-1280
// columns) and gained 2 to 8 from tpr 224 (1792-3584).
// Tried and dropped (session 16, call 4): 16-bit rows whose lanes are busier with one chunk per thread (640-1280 and
// 1600-1792 columns, 768 included) on one chunk per thread, compiled for 96-224 threads per row and packed into blocks
// of 512: 5-17 points slower (RMSNorm bf16 1152: 73.3 against 90.4), but LayerNorm at 640 columns (+1.5).
// -DPIPEGOOSE_NORM_BWD_NO_TPRC (a benchmark experiment, off in the shipped build) runs every such row kRuntime, as
// before session 16; -DPIPEGOOSE_NORM_BWD_TPRC_FIXED every tpr from 32 kFixed, -DPIPEGOOSE_NORM_BWD_PACK every tpr
// from 32 kFixed and 96-224 packed into 512 (session 16's "tprc" and "pack" builds).
constexpr Tprc tprc_mode(int vec, bool rms, int tpr) {
  if (tpr < 32 || tpr > 512 || tpr % 32 != 0) return Tprc::kRuntime;
  if (pack_tpb(vec, rms, tpr, false) != 0) return Tprc::kPacked;
#if defined(PIPEGOOSE_NORM_BWD_NO_TPRC)
  return Tprc::kRuntime;
#elif defined(PIPEGOOSE_NORM_BWD_TPRC_FIXED) || defined(PIPEGOOSE_NORM_BWD_PACK)
  return Tprc::kFixed;
#else
  if (vec == 8) return tpr == 32 ? Tprc::kRuntime : Tprc::kFixed;
  if (vec != 4) return Tprc::kRuntime;
  if (!rms) return tpr == 32 || tpr == 384 ? Tprc::kRuntime : Tprc::kFixed;
  return tpr == 96 || tpr >= 224 ? Tprc::kFixed : Tprc::kRuntime;
#endif
}

// Whether norm_bwd_async_kernel<Tin, ..., RMS, HC, TPB, TPRC> always takes the weight from shared memory (the launch
// must give it the cache's bytes), instead of choosing at run time between that copy and global memory: the 16-bit
// LayerNorm kernels compiled for their threads per row (TPRC) and those specialised to the widths of BwdPcache16Ln, the
// 16-bit RMSNorm kernels specialised to those of BwdPcache16Rms, and the fp32 ones specialised to those of
// BwdPcache32Ln and BwdPcache32Rms (below; this kernel runs only where x and dy have one element size). Without
// the global path's pointer and flags in the row loop their spills go (52 bytes at 64, 128 and 256 threads per row, 8
// at 8192; ptxas, sm_90; the kernel of 512 threads per row went from 56 to 88 bytes and still gained), and the raw
// backward gained 0.9-8.7 points of copy at 896-8192 columns but 1536 (-0.6 to +0.3) (bf16 1600: 74.4 -> 82.2, 7680:
// 74.1 -> 82.7, 8192: 76.6 -> 81.9; session 18, call 2), and 5.7-6.3 at 768 (call 4). The others went -4.8 to +0.2 so,
// mostly losses: RMSNorm, fp32, LayerNorm's 1024, 2048 and 4096 specialisations (e.g. bf16 2048 88.5 -> 85.3, 1024 89.6
// -> 86.4). -DPIPEGOOSE_NORM_BWD_PCACHE_ARG (a benchmark experiment, off in the shipped build): never, as before
// session 18.
// The specialised widths among them (BwdPcache16Ln; raw backward, 16384 rows, % of copy, two rounds; benchmarks/results/
// nvidia_h200_2026-11-30/session40.log and session41.log): 768 and 8192 (session 18); 1152, 1600 and 4608 (where a
// specialised kernel with the run-time choice lost 1.7-2.7 points to the kernels compiled for their threads per row,
// this one gained 1.8-4.6 over them; session 41, call 1); 576 and 7168 (specialised with it: +3.7 / +4.9 and +1.7 /
// +1.9 in bf16 / fp16); 896, 960, 1280 and 5120 (+0.8 to +2.9 in both; call 1, against the run-time choice). Left at
// the run-time choice: 1536, 2304, 2560, 3072 and 3840 (-0.3 to +1.8, one dtype or neither above +0.8) and 1024,
// 2048 and 4096 (-0.8 to -3.2, as in session 18). -DPIPEGOOSE_NORM_BWD_PCACHE_SPEC (a benchmark experiment): every
// specialised 16-bit LayerNorm width.
template <int... Hs>
using Sizes = std::integer_sequence<int, Hs...>;
template <int... Hs>
constexpr bool has_size(Sizes<Hs...>, int64_t H) {
  return ((H == Hs) || ... || false);
}
using BwdPcache16Ln = Sizes<576, 768, 896, 960, 1152, 1280, 1600, 4608, 5120, 7168, 8192>;
// The 16-bit RMSNorm kernels specialised to these widths take the weight from shared memory only too (session 41,
// call 3: every 16-bit RMSNorm specialisation so, against the run-time choice, gained at 576 / 768 / 6144, +4.7 /
// +1.2 / +1.0 in bf16 and +2.6 / +1.1 / +1.1 in fp16, and elsewhere went -5.2 to +0.7: 8192 -5.2, 3840 -3.2, 896
// +0.6).
using BwdPcache16Rms = Sizes<576, 768, 6144>;
// The fp32 kernels specialised to these widths also (session 42; raw backward, 16384 rows, % of
// copy, two rounds; benchmarks/results/nvidia_h200_2026-11-30/session42.log). Call 1, every fp32 specialisation so
// against the run-time choice: LayerNorm 576 / 1024 / 1152 / 1280 +2.6 / +2.0 / +1.0 / +1.9, RMSNorm 576 / 1152 +1.0 /
// +0.8, elsewhere -3.4 to +0.4 (LayerNorm 4096 -3.4, 2048 -3.0, 3840 -2.9). Call 2, these lists against
// -DPIPEGOOSE_NORM_BWD_NO_PCACHE32 (a benchmark experiment: no fp32 kernel so): LayerNorm +2.6 / +1.6 / +1.6 / +1.1,
// RMSNorm +1.0 / +1.5.
using BwdPcache32Ln = Sizes<576, 1024, 1152, 1280>;
using BwdPcache32Rms = Sizes<576, 1152>;
#if defined(PIPEGOOSE_NORM_BWD_NO_PCACHE32)
constexpr bool kBwdPcache32 = false;
#else
constexpr bool kBwdPcache32 = true;
#endif
constexpr bool bwd_async_pcache(bool rms, int in_bytes, int hc, int tprc) {
#if defined(PIPEGOOSE_NORM_BWD_PCACHE_ARG)
  static_cast<void>(rms);
  static_cast<void>(in_bytes);
  static_cast<void>(hc);
  static_cast<void>(tprc);
  return false;
#elif defined(PIPEGOOSE_NORM_BWD_PCACHE_SPEC)
  return !rms && in_bytes == 2 && (tprc > 0 || hc > 0);
#else
  if (in_bytes == 4) return kBwdPcache32 && (rms ? has_size(BwdPcache32Rms{}, hc) : has_size(BwdPcache32Ln{}, hc));
  return in_bytes == 2 && (rms ? has_size(BwdPcache16Rms{}, hc) : tprc > 0 || has_size(BwdPcache16Ln{}, hc));
#endif
}

// TPB: blockDim.x (256, 512 for rows of 257-512 threads, or pack_tpb's 512 or 1024), or kWideRegTpb (768) for the wide
// register rows, whose blockDim.x is their threads per row (608-704). TPRC > 0 (with HC == 0): the
// threads per row, and the rows per block TPB / TPRC, are compile-time constants (H is not).
template <typename Tin, typename Tdy, int VEC, int NV, bool RMS, int HC, int TPB, int TPRC = 0>
__global__ void __launch_bounds__(TPB, (AsyncBounds<TPB, (HC != 0 || TPRC != 0) && sizeof(Tin) == 2, NV>::min_blocks))
norm_bwd_async_kernel(const Tdy* __restrict__ dy, const Tin* __restrict__ x, const void* __restrict__ w, bool p_f32,
                      const float* __restrict__ mean, const float* __restrict__ rstd, Tin* __restrict__ dx,
                      float* __restrict__ ws, int64_t rows, int h_arg, int tpr_arg, bool pcache_arg) {
  // bwd_async_pcache: the weight always from its shared-memory copy (ones when there is none; launch_bwd sizes it).
  const bool pcache = bwd_async_pcache(RMS, sizeof(Tin), HC, TPRC) || pcache_arg;
  using G = FixedRow<HC, VEC, NV, false>;
  constexpr bool FIXED = HC > 0;
  constexpr int NACC = RMS ? 1 : 2;
  constexpr int PG = VEC < 4 ? VEC : 4;
  constexpr int S = AsyncBounds<TPB, (HC != 0 || TPRC != 0) && sizeof(Tin) == 2>::stages;
  extern __shared__ __align__(16) float bwd_smem[];
  __shared__ __align__(16) float red[2][64];
  const int H = FIXED ? HC : h_arg;
  const int tpr = FIXED ? G::tpr : TPRC > 0 ? TPRC : tpr_arg;
  // (Specialised kernels: rows_per_block(G::tpr) rows in blocks of 256 threads, more when packed into 512 or 1024.)
  static_assert(!FIXED || G::tpr <= TPB, "norm_bwd_async_kernel: a row wider than the block");
  const int rpb = FIXED ? TPB / G::tpr : TPRC > 0 ? TPB / TPRC : blockDim.x / tpr;
  const unsigned nthreads = FIXED ? TPB / G::tpr * G::tpr : TPRC > 0 ? TPB / TPRC * TPRC : blockDim.x;
  const int rg = threadIdx.x / tpr;
  const int t = threadIdx.x - rg * tpr;
  const int nchunks = FIXED ? G::chunks : H / VEC;
  const float inv_h = FIXED ? G::inv_h : 1.f / static_cast<float>(H);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * rpb;
  float* sw = bwd_smem;
  float* dyn_smem = bwd_smem + (pcache ? ((H + 3) & ~3) : 0);
  const int rowlen = NV * tpr * VEC;  // elements of one stage row
  Tin* xs = reinterpret_cast<Tin*>(dyn_smem);
  Tdy* ds = reinterpret_cast<Tdy*>(xs + static_cast<int64_t>(S) * rpb * rowlen);
  const bool want_acc = ws != nullptr;

  float acc_w[NV][VEC];
  float acc_b[NV][VEC];  // unused (and dropped by the compiler) when RMS
#pragma unroll
  for (int n = 0; n < NV; ++n)
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      acc_w[n][i] = 0.f;
      acc_b[n][i] = 0.f;
    }

  // Prologue: the first S - 1 rows of this row group in flight, one commit group per row.
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * rpb + rg;
#pragma unroll
  for (int k = 0; k < S - 1; ++k) {
    const int64_t row = row0 + k * stride;
    const bool valid = row < rows;
    const int slot = k * rpb + rg;
    async_row<Tin, VEC, NV, FIXED>(xs + slot * rowlen, x + (valid ? row : 0) * H, x, valid, t, tpr, nchunks);
    async_row<Tdy, VEC, NV, FIXED>(ds + slot * rowlen, dy + (valid ? row : 0) * H, dy, valid, t, tpr, nchunks);
    cp_async_commit();
  }
  float m = 0.f, r = 0.f;
  if (row0 < rows) {
    if constexpr (!RMS) m = mean[row0];
    r = rstd[row0];
  }
  if (pcache) stage_weight<Tin>(w, p_f32, H, sw);  // after the first copies: they overlap

  int parity = 0;
  int stage = 0;  // the stage of the current row; the row S - 1 ahead goes to the stage before it
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * rpb; base < rows; base += stride) {
    const int64_t row = base + rg;
    const bool valid = row < rows;
    {
      const int64_t arow = row + (S - 1) * stride;
      const bool avalid = arow < rows;
      const int slot = (stage == 0 ? S - 1 : stage - 1) * rpb + rg;
      async_row<Tin, VEC, NV, FIXED>(xs + slot * rowlen, x + (avalid ? arow : 0) * H, x, avalid, t, tpr, nchunks);
      async_row<Tdy, VEC, NV, FIXED>(ds + slot * rowlen, dy + (avalid ? arow : 0) * H, dy, avalid, t, tpr,
                                     nchunks);
      cp_async_commit();
    }
    float mn = 0.f, rn = 0.f;
    {
      const int64_t nrow = row + stride;
      if (nrow < rows) {
        if constexpr (!RMS) mn = mean[nrow];
        rn = rstd[nrow];
      }
    }
    cp_async_wait<S - 1>();  // this row's group (committed S - 1 groups ago) has landed
    const Tin* xrow = xs + (stage * rpb + rg) * rowlen;
    const Tdy* drow = ds + (stage * rpb + rg) * rowlen;

    float s[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const int c = t + n * tpr;
      Raw<Tin, VEC> xc;
      Raw<Tdy, VEC> dc;
      raw_lds(xrow + c * VEC, xc);
      raw_lds(drow + c * VEC, dc);
#pragma unroll
      for (int g0 = 0; g0 < VEC; g0 += PG) {
        float wv[PG];
#pragma unroll
        for (int k = 0; k < PG; ++k) wv[k] = 1.f;
        if (chunk_in<FIXED>(c, n, tpr, nchunks)) {
          if (pcache) lds_f<PG>(sw + c * VEC + g0, wv);
          else if (w != nullptr) load_param<PG, Tin>(w, p_f32, c * VEC + g0, wv);
        }
#pragma unroll
        for (int k = 0; k < PG; ++k) {
          const int i = g0 + k;
          const float xh = (raw_get(xc, i) - m) * r;  // zero-filled slots: dy == 0, so they add nothing below
          const float d = raw_get(dc, i);
          acc_w[n][i] += d * xh;
          if constexpr (!RMS) acc_b[n][i] += d;
          const float g = d * wv[k];
          if constexpr (!RMS) s[0] += g;
          s[1] += g * xh;
        }
      }
    }
    row_sum<2, true>(s, tpr, red[parity], 1 + rg);  // rpb <= 15 when tpr > 32
    parity ^= 1;
    if (valid) {
      const DxRow<dx_fma<Tin, RMS, HC>()> dxo(m, r, RMS ? 0.f : s[0] * inv_h, s[1] * inv_h);
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int c = t + n * tpr;
        if (chunk_in<FIXED>(c, n, tpr, nchunks)) {
          Raw<Tin, VEC> xc;
          Raw<Tdy, VEC> dc;
          raw_lds(xrow + c * VEC, xc);
          raw_lds(drow + c * VEC, dc);
          float o[VEC];
#pragma unroll
          for (int g0 = 0; g0 < VEC; g0 += PG) {
            float wv[PG];
#pragma unroll
            for (int k = 0; k < PG; ++k) wv[k] = 1.f;
            if (pcache) lds_f<PG>(sw + c * VEC + g0, wv);
            else if (w != nullptr) load_param<PG, Tin>(w, p_f32, c * VEC + g0, wv);
#pragma unroll
            for (int k = 0; k < PG; ++k) {
              const int i = g0 + k;
              const float g = raw_get(dc, i) * wv[k];
              o[i] = dxo(raw_get(xc, i), g);
            }
          }
          store_f<VEC, Tin, kDxStream>(dx + row * H + static_cast<int64_t>(c) * VEC, o);
        }
      }
    }
    m = mn;
    r = rn;
    stage = stage == S - 1 ? 0 : stage + 1;
  }
  cp_async_wait<0>();  // the zero-fill copies past the last row still write the stages that are reused below
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Every block of this persistent grid is resident: the column reduction (a programmatic dependent launch) may be
  // launched now; it waits for this grid's completion before it reads ws.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif

  if (!want_acc) return;
  const int64_t P = gridDim.x;
  if (rpb == 1) {
#pragma unroll
    for (int a = 0; a < NACC; ++a) {
      float* out = ws + (a * P + blockIdx.x) * static_cast<int64_t>(H);
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int c = t + n * tpr;
        if (chunk_in<FIXED>(c, n, tpr, nchunks)) store_f<VEC>(out + c * VEC, a == 0 ? acc_w[n] : acc_b[n]);
      }
    }
  } else {
    // Combine the row groups of the block in a fixed order (as norm_bwd_kernel), in the stage area.
#pragma unroll
    for (int a = 0; a < NACC; ++a) {
      __syncthreads();  // every thread is past its last stage read (a == 0), or the previous readers are done
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int c = t + n * tpr;
        if (chunk_in<FIXED>(c, n, tpr, nchunks)) {
#pragma unroll
          for (int i = 0; i < VEC; ++i) dyn_smem[rg * H + c * VEC + i] = a == 0 ? acc_w[n][i] : acc_b[n][i];
        }
      }
      __syncthreads();
      float* out = ws + (a * P + blockIdx.x) * static_cast<int64_t>(H);
      for (int j = threadIdx.x; j < H; j += nthreads) {
        float sum = 0.f;
        for (int g = 0; g < rpb; ++g) sum += dyn_smem[g * H + j];
        out[j] = sum;
      }
    }
  }
}

// fp32 rows of 32772-65536 columns (8193-16384 chunks of four), wider than a block's registers hold: one block of
// kSplitThreads per row (a full grid, as the register plans of the widest rows; with PF, below, a block per SM walking
// rows), thread t owning chunks t + n * 1024
// for n < 16 (so the row's first 32768 values lie in registers, the rest, up to as many, in shared memory), the first
// eight in registers (loaded with ld.global.nc.L1::no_allocate), the other eight in shared memory (128 KB per block,
// copied with cp.async into the thread's own slots, so that no barrier guards them). One read of x and one write of y,
// where norm_fwd_wide_kernel reads the row twice. LayerNorm statistics in one block-wide step (merge_chunk per chunk,
// block_moments), as the register plans of 1024-thread rows. The parameters are read per chunk in the output loop (L2
// hits). Needs split_smem(NR) bytes of dynamic shared memory (the host checks smem_fits). Session 22 (H200,
// benchmarks.norm_raw, forward, % of copy, 16384 rows, call 4; wide kernel -> this one): RMSNorm 36864 / 40000 / 65536
// columns 83.9 / 82.1 / 69.9 -> 95.8 / 95.7 / 96.4, LayerNorm 80.1 / 68.8 / 65.5 -> 85.3 / 86.3 / 71.9. Also measured
// there and dropped: a thread block cluster of eight 512-thread blocks per row (each block's slab streamed through a
// ring of shared-memory stages, its statistics pushed into every block, the previous row's output written while the
// cluster barrier completes, as norm_bwd_cluster_kernel does): RMSNorm 62.6 / 63.1 / 80.6, LayerNorm 43.4 / 44.7 /
// 62.8; and the slab held in registers by clusters of 2-8 blocks of 512 or 1024 threads: 70-79 (LayerNorm) and 81-87
// (RMSNorm) at 65536 columns. NR: chunks per thread in registers (the launches: kSplitReg; 4, a benchmark experiment),
// the other kSplitChunks - NR in shared memory (split_smem(NR) bytes); four in registers and twelve in shared memory
// ran 1.0-9.0 points slower at every row of the comparison above (call 5).
// PF: a grid of one block per SM (the host: at most sm_count() blocks), each walking rows; the next row's register
// chunks are loaded as this row's output frees them, its shared-memory part copied after this row's last output, so
// that its reads are in flight while this row is written (without PF a block's row is read only after the previous
// block has finished). Session 23 (ncu, 16384 x 65536, a block per row): LayerNorm's forward took 2.88 ms against
// RMSNorm's 2.16 on the same bytes, both at 64 registers and one block per SM; the longer statistics (a chain of
// merge_chunk per thread) and output loop leave DRAM idle for longer between a block's reads. Measured and dropped
// there: LayerNorm statistics in two passes over the thread's values instead of merge_chunk (70-71% of copy at
// 57344-65536 columns, 85-90 at 36864-49152, against 72-82 and 85-86), and PF for RMSNorm (below).
constexpr int kSplitThreads = 1024;
constexpr int kSplitChunks = 16;  // chunks per thread: a row of up to 16 * 1024 * 4 = 65536 fp32 values
constexpr int kSplitReg = 8;
constexpr size_t split_smem(int nr) { return static_cast<size_t>(kSplitChunks - nr) * kSplitThreads * 16; }
// LayerNorm rows of more than kSplitPipeChunks chunks of four (57344 columns) take norm_fwd_split_kernel's PF form (a
// block per SM, the next row loaded while this one is written; launch_fwd). Session 23 (H200, raw forward, fp32, % of
// copy, 16384 rows; a block per row -> PF): LayerNorm 53248 / 57344 / 59392 / 61440 / 63488 / 65536 columns 86.0 /
// 77.4-79.6 / 73.4 / 73.5 / 70.1 / 72.4 -> 82.3-83.6 / 77.4 / 76.5 / 77.0 / 76.4 / 77.0, 4096 x 65536 70.1 -> 75.3;
// RMSNorm 36864-65536 94.6-96.9 -> 81.7-92.5.
constexpr int kSplitPipeChunks = 57344 / 4;

template <typename Tout, typename Tp, bool RMS, int NR, bool PF>
__global__ void __launch_bounds__(kSplitThreads, 1)
norm_fwd_split_kernel(const float* __restrict__ x, const Tp* __restrict__ w, const Tp* __restrict__ b, int wm, int bm,
                      Tout* __restrict__ y, float* __restrict__ mean_out, float* __restrict__ rstd_out, int64_t rows,
                      int H, float eps) {
  constexpr int VEC = 4;
  constexpr int NS = kSplitChunks - NR, TPB = kSplitThreads;
  constexpr bool ZS = fwd_zero_stride<float, Tp, RMS>();
  constexpr int PG = 16 / static_cast<int>(sizeof(Tp)) < VEC ? 16 / static_cast<int>(sizeof(Tp)) : VEC;
  extern __shared__ __align__(16) uint4 fwd_split_smem[];
  float* xs = reinterpret_cast<float*>(fwd_split_smem);  // chunk NR * TPB + c' of the row at xs + c' * VEC
  __shared__ __align__(16) float red[2][RMS ? 32 : 96];
  const int t = threadIdx.x;
  const int nchunks = H / VEC;
  const int nsm = nchunks - NR * TPB;  // chunks of the row in shared memory (may be <= 0 for a short row)
  const float inv_h = 1.f / static_cast<float>(H);
  int parity = 0;
#if defined(PIPEGOOSE_NORM_SPLIT_LDPOL)
  const uint64_t keep_params = l2_policy(true);
#endif
  Raw<float, VEC> cur[NR];
  // The block's first row (every row without PF): the shared-memory part with cp.async, then the register part.
  auto load = [&](int64_t row) {
    const float* xr = x + row * H;
    async_row<float, VEC, NS, false>(xs, xr + static_cast<int64_t>(NR) * TPB * VEC, x, true, t, TPB, nsm);
    cp_async_commit();
    load_row<float, VEC, NR, false, Ld::kNoL1>(xr, true, t, TPB, nchunks, cur);
  };
  if (PF && blockIdx.x < rows) load(blockIdx.x);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    if constexpr (!PF) load(row);
    float n = 0.f, m = 0.f, q = 0.f;
    if constexpr (RMS) {
      float s[1] = {0.f};
#pragma unroll
      for (int k = 0; k < NR; ++k)
#pragma unroll
        for (int i = 0; i < VEC; ++i) s[0] += raw_get(cur[k], i) * raw_get(cur[k], i);  // zeros outside the row
      cp_async_wait<0>();
#pragma unroll
      for (int k = 0; k < NS; ++k) {
        Raw<float, VEC> c;
        raw_lds(xs + (t + k * TPB) * VEC, c);  // zero-filled outside the row
#pragma unroll
        for (int i = 0; i < VEC; ++i) s[0] += raw_get(c, i) * raw_get(c, i);
      }
      row_sum<1>(s, TPB, red[parity], 0, 0);
      q = s[0];
    } else {
#pragma unroll
      for (int k = 0; k < NR; ++k)
        if (t + k * TPB < nchunks) merge_chunk(n, m, q, cur[k]);
      cp_async_wait<0>();
#pragma unroll
      for (int k = 0; k < NS; ++k) {
        if (t + k * TPB < nsm) {
          Raw<float, VEC> c;
          raw_lds(xs + (t + k * TPB) * VEC, c);
          merge_chunk(n, m, q, c);
        }
      }
      block_moments(n, m, q, red[parity]);
    }
    parity ^= 1;
    const float mean = m;  // 0 for RMSNorm
    const float rstd = rsqrtf(q * inv_h + eps);
    if (t == 0) {
      if constexpr (!RMS) mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
    Tout* yr = y + row * H;
    auto out = [&](const Raw<float, VEC>& xc, int c) {
      float o[VEC];
#pragma unroll
      for (int g0 = 0; g0 < VEC; g0 += PG) {
        Raw<Tp, PG> cw, cb;
#if defined(PIPEGOOSE_NORM_SPLIT_LDPOL)
        // -DPIPEGOOSE_NORM_SPLIT_LDPOL (a benchmark experiment): LayerNorm's fp32 parameters with session 23's form of
        // the L2 policy (a volatile ld.global.L2::cache_hint, see ld_hint), to compare it in one process with the
        // shipped ld.global.nc form
        if constexpr (!RMS && ZS && std::is_same<Tp, float>::value) {
          raw_load_pol<float, 4>(w + (c * VEC + g0) * wm, cw, keep_params);
          raw_load_pol<float, 4>(b + (c * VEC + g0) * bm, cb, keep_params);
        } else {
          load_params_m<ZS, Tp, PG, RMS>(w, b, wm, bm, c * VEC + g0, cw, cb);
        }
#else
        load_params_m<ZS, Tp, PG, RMS>(w, b, wm, bm, c * VEC + g0, cw, cb);  // evict_last (Ld::kParam)
#endif
#pragma unroll
        for (int i = 0; i < PG; ++i) {
          const float v = raw_get(xc, g0 + i);
          o[g0 + i] = RMS ? v * rstd * raw_get(cw, i) : fmaf((v - mean) * rstd, raw_get(cw, i), raw_get(cb, i));
        }
      }
      store_f<VEC>(yr + static_cast<int64_t>(c) * VEC, o);
    };
    // PF: the block's next row is loaded as this row's output frees the registers (chunk by chunk) and the slots (after
    // the last one), so that its reads are in flight while this row is written. Only the thread that read a slot
    // copies into it, after its read in program order: PTX performs cp.async as a weak memory operation of the
    // executing thread, so its earlier ld.shared cannot observe the later copy (and the asm's "memory" clobber keeps
    // the compiler from moving the read past it); no barrier or fence guards the slots.
    const int64_t nrow = row + gridDim.x;
    const bool more = PF && nrow < rows;
    const float* xn = x + (more ? nrow : row) * H;
#pragma unroll
    for (int k = 0; k < NR; ++k) {
      const int c = t + k * TPB;
      if (c < nchunks) out(cur[k], c);
      if (more) {
        if (c < nchunks) {
          raw_load<float, VEC, Ld::kNoL1>(xn + static_cast<int64_t>(c) * VEC, cur[k]);
        } else {
          raw_zero(cur[k]);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < NS; ++k) {
      const int c = t + k * TPB;
      if (c < nsm) {
        Raw<float, VEC> v;
        raw_lds(xs + c * VEC, v);
        out(v, NR * TPB + c);
      }
    }
    // after the loop: a copy between two chunks' outputs (its asm a compiler barrier) kept the next chunk's
    // parameter loads from being issued early
    if (more) {
      async_row<float, VEC, NS, false>(xs, xn + static_cast<int64_t>(NR) * TPB * VEC, x, true, t, TPB, nsm);
      cp_async_commit();
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// Backward of wide rows on sm_90: one row shared by a thread block cluster
// ---------------------------------------------------------------------------------------------------------
// Rows too wide for the register plans of one block (16-bit LayerNorm from 16384 columns, 16-bit and fp32 RMSNorm
// from 16392 and 16388, fp32 LayerNorm from 16388) take the two-kernel path below on GPUs before sm_90: it reads x and
// dy twice, five passes over an activation instead of three (three fifths of one pass's speed; 55-62% of copy measured
// on the H200). On sm_90 a cluster of CL blocks (CL SMs; bwd_cluster_size: the fewest of 2, 3, 4, 5 and 8 that hold
// the row, fp32: of 2, 4 and 8) shares each row instead, for vector rows from 8200 columns (16-bit RMSNorm: 9224, fp32
// RMSNorm: 16384) up to 65536 (launch_bwd says which plans it replaced there, and what was timed):
// - block k of the cluster (its rank) owns the chunks [k * cpb, (k + 1) * cpb) of every row the cluster walks (rows
//   cluster, cluster + clusters, ...); thread t of the block's nt threads owns the chunks t + n * nt of that slab
//   (n < NV), their weight and their column sums in registers; nt is the fewest multiple of 32 threads that hold the
//   slab (launch_bwd_cluster), so a slab that fills part of the block's capacity takes fewer threads, not idle slots;
// - x and dy stream through a ring of stages (bwd_cluster_stages) of shared memory with cp.async, as in
//   norm_bwd_async_kernel: each thread copies and later reads only its own slots, so no barrier guards the stages;
// - step j takes R rows (bwd_cluster_rows): pass 1 sums their two row sums each (one for RMSNorm) over the block (warp
//   shuffles, one __syncthreads), and lanes of warp 0 write them into slot `rank` of every block's `part` (distributed
//   shared memory), then the block runs pass 2 of step j - 1's rows, dx = rstd * (dy * w - c1 - xhat * c2) from their
//   stages. Each thread adds the CL slots in rank order, the same bits in every block. Two exchanges (the kernel's
//   template parameter MBAR; launch_bwd_cluster's rule says which rows take which):
//   - the cluster barrier: the block arrives after its push, runs pass 2, waits, and reads step j's sums; `part`
//     alternates between two buffers, so one barrier per step suffices (a block rewrites a buffer two steps later,
//     after the next barrier, which every reader of it has passed);
//   - MBAR (session 36): the pushes are st.async stores that complete the bytes of an mbarrier per buffer in the
//     receiving block. Step j's sums are read a step later: thread 0 waits for them before step j + 1's block
//     barrier, which makes them visible to every thread, and pass 2 of step j follows. No thread spins past that
//     barrier, no cluster barrier per step, and the wait has pass 2 of step j - 1 and pass 1 of step j + 1 to hide in.
//     Three buffers: a block's threads read buffer b after step j + 1's block barrier while warp 0 already pushes step
//     j + 1's sums, so b takes new sums (step j + 3) only after the block's step j + 2 push, which follows every read;
// - two steps of R rows are in use at once, and the copies of the next S - 2R rows are in flight; each step loads the
//   next step's mean and rstd, a step ahead of their use.
// Pushing the sums and overlapping the barrier with pass 2 (rather than reading the other blocks' sums after the
// barrier, then pass 2) took the raw backward of these rows at 16384-65536 columns from 72.8-80.4% of copy to
// 74.1-81.1 in bf16 and from 84.0-90.4 to 89.6-92.7 in fp32; loading mean and rstd a step ahead, from 73.3-80.4 to
// 80.1-87.1 (LayerNorm bf16), from 78.5-79.8 to 90.8-91.2 (RMSNorm bf16 32768-65536), and in fp32 from 89.4-92.8 to
// 99.8-101.6 (H200, session 14, calls 1-2).
// One read of x and dy and one write of dx; the column sums go to ws [NACC, clusters, H] like the other plans' (one
// partial row per cluster; norm_col_reduce_kernel sums them in a fixed order). The body compiles for sm_90 and newer
// only (clusters): the host launches it only on such a GPU.
constexpr int kClThreads = 512;
constexpr int kClValues = 16;     // values per thread and row: NV = kClValues / VEC chunks
// (1024 threads of 8 values, 64 registers, ran the 16-bit rows 6.4-14.1 points of copy slower: H200, session 14,
// call 2.)
constexpr int kClMaxCluster = 8;  // the portable cluster size limit
// Stages: as many as fit kClSmemBytes of shared memory per block, 3 to 7 (fp32: 3 of 64 KB; 16-bit: 6 of 32 KB).
// -DPIPEGOOSE_NORM_BWD_CL_SMEM_KB=N (a benchmark experiment, off in the shipped build) sets the budget: 224 KB (16-bit:
// 7 stages, three rows in flight instead of two) ran within 0.5 points of 192 KB (H200, session 14, call 1).
// Measured and dropped (session 33, call 3; session33.log): stages of the block's slab (cpb chunks) instead of the
// block's capacity, as many as fit 192 KB (a run-time count, 5 to 11), so that rows whose slab fills part of the block
// keep more rows in flight: -1.1 to +2.3 points at the cluster's rows of 8704-12288 and 20000-24576 columns (bf16
// LayerNorm 10240: 67.7 -> 68.9, fp32 LayerNorm 11264: 90.1 -> 91.5), but -5.0 to +0.6 on full slabs (16384 and 32768
// columns, the same stages; bf16 RMSNorm 16384: 95.5 -> 90.7): the cost of the run-time stage count.
// Measured and dropped (session 35, calls 1-2; session35.log): each thread copying and summing only the chunks of its
// block's slab instead of every slot of the block (zeros past the slab): +1.1 to +2.3 points where the slab fills part
// of the block (bf16 LayerNorm 8704 / 10240: 60.2 / 67.4 -> 61.3 / 69.2), -2.4 to -5.6 on full slabs (bf16 RMSNorm
// 16384: 95.3 -> 90.5: the test in the unrolled loops); that loop only for partial slabs, a branch-free one for full
// ones: -1.9 to -10.7 everywhere (two loops in one kernel).
#if defined(PIPEGOOSE_NORM_BWD_CL_SMEM_KB)
constexpr int kClSmemBytes = PIPEGOOSE_NORM_BWD_CL_SMEM_KB * 1024;
#else
constexpr int kClSmemBytes = 192 * 1024;
#endif
constexpr int bwd_cluster_stages(int in_bytes, int dy_bytes) {
  const int n = kClSmemBytes / (kClThreads * kClValues * (in_bytes + dy_bytes));
  return n > 7 ? 7 : n < 3 ? 3 : n;
}

// Rows per step (one block reduction and one cluster barrier for R rows): two for 16-bit rows (at least five stages),
// one for fp32 (three stages; four of 64 KB do not fit). Two rows per step took the bf16 backward at 16384-65536
// columns from 50.9-60.3% of copy to 71.6-78.1 (H200, session 13, call 3); with pass 2 overlapping the barrier, one
// 16-bit row per step still ran LayerNorm 17.6-18.8 points slower (session 14, call 1).
// -DPIPEGOOSE_NORM_BWD_CL_ROWS=R (a benchmark experiment, off in the shipped build) sets the 16-bit rows' (R rows need
// 2R + 1 stages: with fewer, one row per step). Three rows per step with 7 stages (CL_SMEM_KB=224) ran -2.8 to +2.3
// points against two at 8704-65536 columns (bf16; RMSNorm behind at 16384-65536; session 33, call 4).
#if defined(PIPEGOOSE_NORM_BWD_CL_ROWS)
constexpr int kClRows16 = PIPEGOOSE_NORM_BWD_CL_ROWS;
#else
constexpr int kClRows16 = 2;
#endif
static_assert(kClRows16 >= 1 && kClRows16 <= 3, "PIPEGOOSE_NORM_BWD_CL_ROWS: expected 1 to 3");
constexpr int bwd_cluster_rows(int in_bytes, int dy_bytes) {
  return in_bytes + dy_bytes == 4 && bwd_cluster_stages(in_bytes, dy_bytes) > 2 * kClRows16 ? kClRows16 : 1;
}

// Shared memory of the stages of norm_bwd_cluster_kernel, in bytes (per block).
constexpr size_t bwd_cluster_smem(int in_bytes, int dy_bytes) {
  return static_cast<size_t>(bwd_cluster_stages(in_bytes, dy_bytes)) * kClThreads * kClValues *
         static_cast<size_t>(in_bytes + dy_bytes);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned cluster_special(int which) {
  unsigned v;
  if (which == 0) {
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(v));
  } else if (which == 1) {
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(v));
  } else if (which == 2) {
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(v));
  } else {
    asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(v));
  }
  return v;
}

// The cluster barrier in two halves (every thread of every block of the cluster arrives, then waits): the writes of
// this thread before cluster_arrive are visible to every thread of the cluster after its next cluster_wait. Work
// between the two overlaps the barrier.
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
// cluster_arrive without ordering any memory access: for a wait that only needs every block to have started.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}

// Writes v to the float2 at p (shared memory of this block) in the block of rank `rank` of the cluster.
__device__ __forceinline__ void st_cluster_f2(float2* p, unsigned rank, float2 v) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  uint32_t ra;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(ra) : "r"(a), "r"(rank));
  asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};" ::"r"(ra), "f"(v.x), "f"(v.y) : "memory");
}

// The mbarrier exchange (MBAR): an mbarrier in this block's shared memory (count 1). mbar_init_fence makes the
// initialisations before it visible to the cluster's other blocks, after the next cluster barrier.
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(a) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// Arms the mbarrier's current phase: it completes once `bytes` bytes have landed (complete_tx of st_async_f2). Relaxed:
// it publishes nothing, so the thread need not wait for its earlier stores (the dx of the step before); armed with
// .release (session 35, call 2) the mbarriers gained less over the cluster barrier (16-bit LayerNorm +2.2 to +7.1
// points of copy, against +2.4 to +9.8 relaxed in call 3; both with every thread waiting after pass 2, before session
// 36's deferred wait).
__device__ __forceinline__ void mbar_arm(uint64_t* bar, uint32_t bytes) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  asm volatile("mbarrier.arrive.expect_tx.relaxed.cluster.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes)
               : "memory");
}
// Waits until the phase of parity `phase` of the mbarrier has completed; the bytes that completed it are then visible.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t phase) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(bar));
  uint32_t done = 0;
  do {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(a), "r"(phase)
        : "memory");
  } while (done == 0);
}
// Writes v to the float2 at p in the block of rank `rank`, completing 8 bytes of that block's mbarrier `bar`.
__device__ __forceinline__ void st_async_f2(float2* p, uint64_t* bar, unsigned rank, float2 v) {
  uint32_t ra, rb;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(ra)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(p))), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(rb)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(bar))), "r"(rank));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::"r"(ra),
               "f"(v.x), "f"(v.y), "r"(rb)
               : "memory");
}

#endif

// Launched in clusters of CL = gridDim.x / clusters blocks of nt threads (1-D grid and clusters; nt a multiple of 32,
// at most kClThreads, nt * NV >= cpb), with bwd_cluster_smem bytes of dynamic shared memory; cpb: chunks per block
// (cpb <= kClThreads * NV, CL * cpb >= H / VEC). The blocks' row sums travel to the other blocks of the cluster as
// plain stores into their shared memory, made visible by the cluster barrier (arrive with release, wait with acquire)
// that every block passes once per step, or (MBAR) as st.async stores that complete the bytes of an mbarrier in the
// receiving block: each block then waits only for its own mbarrier, with no cluster barrier per step and no release
// fence over the thread's earlier global stores (the dx of the step before; ncu, session 34, call 3: membar 0.9 of 6.8
// cycles per issued instruction). launch_bwd_cluster says which rows take which.
template <typename Tin, typename Tdy, int VEC, int NV, bool RMS, bool MBAR>
__global__ void __launch_bounds__(kClThreads, 1)
norm_bwd_cluster_kernel(const Tdy* __restrict__ dy, const Tin* __restrict__ x, const void* __restrict__ w, bool p_f32,
                        const float* __restrict__ mean, const float* __restrict__ rstd, Tin* __restrict__ dx,
                        float* __restrict__ ws, int64_t rows, int H, int cpb) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(NV * VEC == kClValues, "norm_bwd_cluster_kernel: kClValues values per thread");
  static_assert(VEC * sizeof(Tin) == 16 && VEC * sizeof(Tdy) == 16, "norm_bwd_cluster_kernel: 16-byte chunks");
  constexpr int NACC = RMS ? 1 : 2;
  constexpr int S = bwd_cluster_stages(static_cast<int>(sizeof(Tin)), static_cast<int>(sizeof(Tdy)));
  constexpr int R = bwd_cluster_rows(static_cast<int>(sizeof(Tin)), static_cast<int>(sizeof(Tdy)));
  static_assert(S >= 2 * R + 1, "norm_bwd_cluster_kernel: stages for two steps of R rows in use and one row in flight");
  constexpr int kWarps = kClThreads / 32;
  constexpr int NB = MBAR ? 3 : 2;  // buffers of the row sums
  extern __shared__ __align__(16) float bwd_smem[];
  __shared__ __align__(16) float red[2][2 * R][kWarps];  // [parity][sum of row][warp]
  // [buffer][rank][row]: the row sums of each block of the cluster, pushed by that block
  __shared__ __align__(16) float2 part[NB][kClMaxCluster][R];
  __shared__ __align__(8) uint64_t full[NB];  // MBAR: [buffer], completed by the bytes of part[buffer]
  const unsigned rank = cluster_special(0);
  const unsigned cl = cluster_special(1);
  const int64_t cid = cluster_special(2);
  const int64_t ncl = cluster_special(3);
  const int t = threadIdx.x;
  const int warp = t >> 5, lane = t & 31;
  const int nt = static_cast<int>(blockDim.x);  // a multiple of 32, at most kClThreads
  const int nwarps = nt >> 5;
  const int c0 = static_cast<int>(rank) * cpb;  // the block's first chunk
  const int nchunks = max(0, min(cpb, H / VEC - c0));
  const int64_t col0 = static_cast<int64_t>(c0) * VEC;
  const float inv_h = 1.f / static_cast<float>(H);
  constexpr int rowlen = NV * kClThreads * VEC;  // elements of one stage
  Tin* xs = reinterpret_cast<Tin*>(bwd_smem);
  Tdy* ds = reinterpret_cast<Tdy*>(xs + S * rowlen);

  float wv[NV][VEC];
  float acc_w[NV][VEC];
  float acc_b[NV][VEC];  // unused (and dropped by the compiler) when RMS
#pragma unroll
  for (int n = 0; n < NV; ++n) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      wv[n][i] = 1.f;
      acc_w[n][i] = 0.f;
      acc_b[n][i] = 0.f;
    }
  }

  // The cluster's k-th row (cid + k * ncl) goes to stage k % S, one commit group per row. Step j takes rows jR ..
  // jR + R - 1: their sums (pass 1), pushed to every block of the cluster, then the dx of step j - 1's rows (pass 2)
  // between the arrival at the cluster barrier and the wait, so the barrier's latency hides behind pass 2 (MBAR: after
  // thread 0's wait for step j - 1's sums before the block barrier). In use at
  // once: the R rows of step j and the R of step j - 1; in flight: S - 2R rows. Prologue: rows 0 .. S - 2R - 1.
  // A block may write into another's shared memory only once that block runs: every block arrives here, and waits
  // before its first write (below).
  const uint32_t step_bytes = static_cast<uint32_t>(cl * R * sizeof(float2));  // MBAR: into part[buf] per step
  if constexpr (MBAR) {
    if (t == 0) {
#pragma unroll
      for (int b = 0; b < NB; ++b) mbar_init(&full[b]);
      mbar_init_fence();
#pragma unroll
      for (int b = 0; b < NB; ++b) mbar_arm(&full[b], step_bytes);
    }
  }
  cluster_arrive_relaxed();
  int islot = 0;
  auto issue = [&](int64_t k) {
    const int64_t row = cid + k * ncl;
    const bool valid = row < rows;
    const int64_t off = valid ? row * H + col0 : 0;
    async_row<Tin, VEC, NV, false>(xs + islot * rowlen, x + off, x, valid, t, nt, nchunks);
    async_row<Tdy, VEC, NV, false>(ds + islot * rowlen, dy + off, dy, valid, t, nt, nchunks);
    cp_async_commit();
    islot = islot + 1 == S ? 0 : islot + 1;
  };
#pragma unroll
  for (int k = 0; k < S - 2 * R; ++k) issue(k);
  if (w != nullptr) {
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const int c = t + n * nt;
      if (c < nchunks) load_param<VEC, Tin>(w, p_f32, (c0 + c) * VEC, wv[n]);
    }
  }
  auto slot_of = [&](int first, int q) { return first + q >= S ? first + q - S : first + q; };
  // Pass 2 of the R rows from `row0` (stride ncl) in the stages from `first`: dx = rstd * (dy * w - a1 - xhat * a2)
  // (DxRow).
  auto pass2 = [&](int64_t row0, int first, const float* pm, const float* pr, const float* a1, const float* a2) {
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const int64_t rq = row0 + q * ncl;
      if (rq >= rows) break;
      const Tin* xrow = xs + slot_of(first, q) * rowlen;
      const Tdy* drow = ds + slot_of(first, q) * rowlen;
      const DxRow<dx_fma<Tin, RMS, 0>()> dxo(pm[q], pr[q], a1[q], a2[q]);
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int c = t + n * nt;
        if (c < nchunks) {
          Raw<Tin, VEC> xc;
          Raw<Tdy, VEC> dc;
          raw_lds(xrow + c * VEC, xc);
          raw_lds(drow + c * VEC, dc);
          float o[VEC];
#pragma unroll
          for (int i = 0; i < VEC; ++i) {
            o[i] = dxo(raw_get(xc, i), raw_get(dc, i) * wv[n][i]);
          }
          store_f<VEC, Tin, kDxStream>(dx + rq * H + col0 + static_cast<int64_t>(c) * VEC, o);
        }
      }
    }
  };

  int parity = 0;
  int buf = 0, pbuf = 0;  // the buffers of part and full of this step and of the step before
  uint32_t phases = 0;  // MBAR: bit b, the parity of full[b]'s current phase
  int stage = 0;  // the stage of the step's first row
  // The previous step's rows, stages, mean, rstd and cluster sums (scaled by 1 / H), for its pass 2.
  int64_t prow = rows;  // rows: no previous step
  int pstage = 0;
  float pm[R], pr[R], pa1[R], pa2[R];
#pragma unroll
  for (int q = 0; q < R; ++q) pm[q] = pr[q] = pa1[q] = pa2[q] = 0.f;
  // The mean and rstd of the R rows from row0 (stride ncl); a row past the end: zero-filled stages and r = 0 add
  // nothing below.
  auto load_stats = [&](int64_t row0, float* m, float* r) {
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const int64_t rq = row0 + q * ncl;
      m[q] = 0.f;
      r[q] = 0.f;
      if (rq < rows) {
        if constexpr (!RMS) m[q] = mean[rq];
        r[q] = rstd[rq];
      }
    }
  };
  float m[R], r[R];  // the step's
  load_stats(cid, m, r);
  // Every block's sums of the step in buffer b, added in rank order (the same bits in every block), scaled by 1 / H.
  auto read_sums = [&](int b) {
#pragma unroll
    for (int q = 0; q < R; ++q) {
      float c1 = 0.f, c2 = 0.f;
      for (unsigned p = 0; p < cl; ++p) {
        const float2 v = part[b][p][q];
        c1 += v.x;
        c2 += v.y;
      }
      pa1[q] = RMS ? 0.f : c1 * inv_h;
      pa2[q] = c2 * inv_h;
    }
  };
  cluster_wait();
  // The same steps, so the same barriers, in every block.
  for (int64_t k = 0, row = cid; row < rows; k += R, row += R * ncl) {
#pragma unroll
    for (int q = 0; q < R; ++q) issue(k + S - 2 * R + q);  // into the stages of step j - 2, done
    cp_async_wait<S - 2 * R>();  // the step's R groups have landed

    float s[2 * R];
#pragma unroll
    for (int q = 0; q < R; ++q) {
      const Tin* xrow = xs + slot_of(stage, q) * rowlen;
      const Tdy* drow = ds + slot_of(stage, q) * rowlen;
      float s0 = 0.f, s1 = 0.f;
#pragma unroll
      for (int n = 0; n < NV; ++n) {
        const int c = t + n * nt;
        Raw<Tin, VEC> xc;
        Raw<Tdy, VEC> dc;
        raw_lds(xrow + c * VEC, xc);
        raw_lds(drow + c * VEC, dc);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float xh = (raw_get(xc, i) - m[q]) * r[q];  // zero-filled slots: dy == 0, so they add nothing
          const float d = raw_get(dc, i);
          acc_w[n][i] += d * xh;
          if constexpr (!RMS) acc_b[n][i] += d;
          const float g = d * wv[n][i];
          if constexpr (!RMS) s0 += g;
          s1 += g * xh;
        }
      }
      s[2 * q] = s0;
      s[2 * q + 1] = s1;
    }
    // The block's sums, pushed into slot `rank` of every block's `part`.
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
      for (int j = 0; j < 2 * R; ++j) {
        if (!RMS || (j & 1)) s[j] += __shfl_xor_sync(0xffffffffu, s[j], off);
      }
    }
    if (lane == 0) {
#pragma unroll
      for (int j = 0; j < 2 * R; ++j) red[parity][j][warp] = s[j];
    }
    if constexpr (MBAR) {
      // The previous step's sums: thread 0 waits for them, the block barrier makes them visible to every thread.
      // Then it arms that mbarrier again for the buffer's next sums (step j + 2): those cannot land before the arm,
      // since they follow this block's push of step j + 1. The prologue's arms are not ordered before the first
      // bytes, which would only leave the count negative until the arrival, the phase still pending.
      if (t == 0 && prow < rows) {
        mbar_wait(&full[pbuf], (phases >> pbuf) & 1u);
        phases ^= 1u << pbuf;
        mbar_arm(&full[pbuf], step_bytes);
      }
    }
    __syncthreads();
    if constexpr (MBAR) {
      if (prow < rows) read_sums(pbuf);
    }
    if (warp == 0) {
      float b[2 * R];
#pragma unroll
      for (int j = 0; j < 2 * R; ++j) b[j] = lane < nwarps && (!RMS || (j & 1)) ? red[parity][j][lane] : 0.f;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
        for (int j = 0; j < 2 * R; ++j) {
          if (!RMS || (j & 1)) b[j] += __shfl_xor_sync(0xffffffffu, b[j], off);
        }
      }
      if (lane < static_cast<int>(cl)) {  // lane p writes block p's slot
#pragma unroll
        for (int q = 0; q < R; ++q) {
          if constexpr (MBAR) {
            st_async_f2(&part[buf][rank][q], &full[buf], lane, make_float2(b[2 * q], b[2 * q + 1]));
          } else {
            st_cluster_f2(&part[buf][rank][q], lane, make_float2(b[2 * q], b[2 * q + 1]));
          }
        }
      }
    }
    if constexpr (MBAR) {
      if (prow < rows) pass2(prow, pstage, pm, pr, pa1, pa2);
    } else {
      cluster_arrive();
      if (prow < rows) pass2(prow, pstage, pm, pr, pa1, pa2);
      cluster_wait();
      read_sums(buf);
    }
#pragma unroll
    for (int q = 0; q < R; ++q) {
      pm[q] = m[q];
      pr[q] = r[q];
    }
    load_stats(row + R * ncl, m, r);  // the next step's, a step ahead of their use
    parity ^= 1;
    pbuf = buf;
    buf = buf + 1 == NB ? 0 : buf + 1;
    prow = row;
    pstage = stage;
    stage = slot_of(stage, R);
  }
  if constexpr (MBAR) {
    if (prow < rows) {
      if (t == 0) mbar_wait(&full[pbuf], (phases >> pbuf) & 1u);
      __syncthreads();
      read_sums(pbuf);
    }
  }
  if (prow < rows) pass2(prow, pstage, pm, pr, pa1, pa2);
  // No block writes into another's `part` after its last arrival, which every block has waited for (MBAR: after the
  // last step's sums, which every block has received; the barrier below keeps each block until the others are done).
  cp_async_wait<0>();  // the zero-fill copies past the last row still write this block's stages
  if constexpr (MBAR) {
    cluster_arrive_relaxed();
    cluster_wait();
  }

  if (ws == nullptr) return;
#pragma unroll
  for (int a = 0; a < NACC; ++a) {
    float* out = ws + (a * ncl + cid) * static_cast<int64_t>(H) + col0;
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      const int c = t + n * nt;
      if (c < nchunks) store_f<VEC>(out + c * VEC, a == 0 ? acc_w[n] : acc_b[n]);
    }
  }
#endif
}

// Any H: one block per row (persistent grid), two passes over the row; the per-column sums accumulate in the
// block's own workspace rows (each column always updated by the same thread, so no races).
template <typename Tin, typename Tdy, bool RMS>
__global__ void __launch_bounds__(1024)
norm_bwd_generic_kernel(const Tdy* __restrict__ dy, const Tin* __restrict__ x, const void* __restrict__ w, bool p_f32,
                        const float* __restrict__ mean, const float* __restrict__ rstd, Tin* __restrict__ dx,
                        float* __restrict__ ws, int64_t rows, int H) {
  __shared__ __align__(16) float red[2][64];  // row_sum reads it 16 bytes at a time
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
    const DxRow<dx_fma<Tin, RMS, 0>()> dxo(m, r, RMS ? 0.f : s[0] * inv_h, s[1] * inv_h);
    Tin* dxr = dx + row * H;
    for (int j = threadIdx.x; j < H; j += tpr) {
      const float d = to_f(dyr[j]);
      const float g = w != nullptr ? d * param_at<Tin>(w, p_f32, j) : d;
      dxr[j] = from_f<Tin>(dxo(to_f(xr[j]), g));
    }
  }
}

// Wide rows (vector rows beyond the register plans: bf16/fp16 H > 16384, fp32 H > 16384), in two kernels.
// The register plans hold a row of x and dy in the registers of one block; a wider row does not fit, and the
// generic kernel, which keeps the column sums in its workspace rows, pays a read-modify-write of fp32 sums per
// element (14-24% of copy bandwidth on the H200). Here:
// 1. norm_bwd_rowstats_kernel: per row, c1 = mean_j(g) (LayerNorm) and c2 = mean_j(g * xhat) into stats [rows, 2]
//    (one block per row, grid-stride; reads x and dy).
// 2. norm_bwd_cols_kernel: blocks own column slabs of kColThreads chunks and a range of rows; each thread keeps
//    its chunk's weight and column sums in registers while it walks down the rows (kColRows rows loaded at a time),
//    writes dx and, at the end, one partial row per block into ws [NACC, gridDim.y, H] (reads x and dy again,
//    writes dx).
// Five passes over an activation instead of the minimum three, but each at full width; deterministic (fixed
// summation orders, no atomics).
constexpr int kStatThreads = 512;
constexpr int kColThreads = 256;
constexpr int kColRows = 4;

template <typename Tin, typename Tdy, int VEC, bool RMS>
__global__ void __launch_bounds__(kStatThreads)
norm_bwd_rowstats_kernel(const Tdy* __restrict__ dy, const Tin* __restrict__ x, const void* __restrict__ w,
                         bool p_f32, const float* __restrict__ mean, const float* __restrict__ rstd,
                         float2* __restrict__ stats, int64_t rows, int H) {
  constexpr int U = 4;  // chunks loaded at a time per thread
  __shared__ __align__(16) float red[2][64];
  const int nchunks = H / VEC;
  const float inv_h = 1.f / static_cast<float>(H);
  int parity = 0;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const Tin* xr = x + row * H;
    const Tdy* dyr = dy + row * H;
    const float m = RMS ? 0.f : mean[row];
    const float r = rstd[row];
    float s[2] = {0.f, 0.f};
    for (int c0 = threadIdx.x; c0 < nchunks; c0 += U * kStatThreads) {
      Raw<Tin, VEC> xc[U];
      Raw<Tdy, VEC> dc[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + u * kStatThreads;
        if (c < nchunks) {
          raw_load<Tin, VEC>(xr + static_cast<int64_t>(c) * VEC, xc[u]);
          raw_load<Tdy, VEC>(dyr + static_cast<int64_t>(c) * VEC, dc[u]);
        } else {
          raw_zero(xc[u]);
          raw_zero(dc[u]);  // dy == 0: adds nothing below
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + u * kStatThreads;
        constexpr int PG = VEC < 4 ? VEC : 4;
#pragma unroll
        for (int g0 = 0; g0 < VEC; g0 += PG) {
          float wv[PG];
#pragma unroll
          for (int k = 0; k < PG; ++k) wv[k] = 1.f;
          if (w != nullptr && c < nchunks) load_param<PG, Tin>(w, p_f32, c * VEC + g0, wv);
#pragma unroll
          for (int k = 0; k < PG; ++k) {
            const float g = raw_get(dc[u], g0 + k) * wv[k];
            if constexpr (!RMS) s[0] += g;
            s[1] += g * ((raw_get(xc[u], g0 + k) - m) * r);
          }
        }
      }
    }
    row_sum<2>(s, kStatThreads, red[parity]);
    parity ^= 1;
    if (threadIdx.x == 0) stats[row] = make_float2(RMS ? 0.f : s[0] * inv_h, s[1] * inv_h);
  }
}

// grid (ceil(chunks / kColThreads), P): block (bx, p) owns chunks bx * kColThreads + t and rows [p * rpp, (p + 1) *
// rpp) (rows_per_part = rpp). ws: fp32 [NACC, P, H] or null (no parameter gradients).
template <typename Tin, typename Tdy, int VEC, bool RMS>
__global__ void __launch_bounds__(kColThreads)
norm_bwd_cols_kernel(const Tdy* __restrict__ dy, const Tin* __restrict__ x, const void* __restrict__ w,
                     bool p_f32, const float* __restrict__ mean, const float* __restrict__ rstd,
                     const float2* __restrict__ stats, Tin* __restrict__ dx, float* __restrict__ ws, int64_t rows,
                     int H, int64_t rows_per_part) {
  const int nchunks = H / VEC;
  const int c = blockIdx.x * kColThreads + threadIdx.x;
  if (c >= nchunks) return;  // no barrier below
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_part;
  const int64_t r1 = r0 + rows_per_part < rows ? r0 + rows_per_part : rows;
  float wv[VEC], acc_w[VEC], acc_b[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    wv[i] = 1.f;
    acc_w[i] = 0.f;
    acc_b[i] = 0.f;
  }
  if (w != nullptr) load_param<VEC, Tin>(w, p_f32, c * VEC, wv);
  const int64_t off = static_cast<int64_t>(c) * VEC;
  for (int64_t row0 = r0; row0 < r1; row0 += kColRows) {
    Raw<Tin, VEC> xc[kColRows];
    Raw<Tdy, VEC> dc[kColRows];
#pragma unroll
    for (int u = 0; u < kColRows; ++u) {
      const int64_t row = row0 + u;
      if (row < r1) {
        raw_load<Tin, VEC>(x + row * H + off, xc[u]);
        raw_load<Tdy, VEC>(dy + row * H + off, dc[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kColRows; ++u) {
      const int64_t row = row0 + u;
      if (row < r1) {
        const float m = RMS ? 0.f : mean[row];
        const float r = rstd[row];
        const float2 st = stats[row];
        float o[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float xh = (raw_get(xc[u], i) - m) * r;
          const float d = raw_get(dc[u], i);
          acc_w[i] += d * xh;
          if constexpr (!RMS) acc_b[i] += d;
          o[i] = r * (d * wv[i] - st.x - xh * st.y);
        }
        store_f<VEC, Tin, kDxStream>(dx + row * H + off, o);
      }
    }
  }
  if (ws == nullptr) return;
  const int64_t P = gridDim.y;
  store_f<VEC>(ws + static_cast<int64_t>(blockIdx.y) * H + off, acc_w);
  if constexpr (!RMS) store_f<VEC>(ws + (P + blockIdx.y) * static_cast<int64_t>(H) + off, acc_b);
}

// ws fp32 [NACC, P, H] -> out_a[H] = sum_p ws[0, p, :] (TA), out_b[H] = sum_p ws[1, p, :] (TB, may be null).
// Block (32, LANES): 32 columns per block, the LANES thread rows stride over P with ILP independent partial sums
// each (ILP loads in flight per array and thread), added pairwise, then the lanes in order: a fixed summation order
// (deterministic). launch_col_reduce picks LANES and ILP.
template <typename TA, typename TB, int LANES, int ILP>
__global__ void __launch_bounds__(32 * LANES)
norm_col_reduce_kernel(const float* __restrict__ ws, int64_t P, int H, TA* __restrict__ out_a,
                       TB* __restrict__ out_b) {
  static_assert(ILP >= 1 && (ILP & (ILP - 1)) == 0, "norm_col_reduce_kernel: ILP a power of two");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Launched as a programmatic dependent of the backward kernel (launch_col_reduce): wait until that grid has
  // completed and its writes to ws are visible (returns at once after an ordinary launch).
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  __shared__ float sa[LANES][33];
  __shared__ float sb[LANES][33];
  const int col = blockIdx.x * 32 + threadIdx.x;
  float a[ILP], bs[ILP];
#pragma unroll
  for (int k = 0; k < ILP; ++k) a[k] = bs[k] = 0.f;
  if (col < H) {
    const float* wa = ws + col;
    const float* wb = ws + P * H + col;
    int64_t p = threadIdx.y;
    for (; p + LANES * (ILP - 1) < P; p += LANES * ILP) {
#pragma unroll
      for (int k = 0; k < ILP; ++k) {
        if (out_a != nullptr) a[k] += wa[(p + LANES * k) * H];
        if (out_b != nullptr) bs[k] += wb[(p + LANES * k) * H];
      }
    }
#pragma unroll
    for (int k = 0; k < ILP; ++k) {
      if (p + LANES * k < P) {
        if (out_a != nullptr) a[k] += wa[(p + LANES * k) * H];
        if (out_b != nullptr) bs[k] += wb[(p + LANES * k) * H];
      }
    }
  }
  // Adjacent pairs first: (a0 + a1) + (a2 + a3) for ILP = 4.
#pragma unroll
  for (int w = 1; w < ILP; w *= 2) {
#pragma unroll
    for (int k = 0; k + w < ILP; k += 2 * w) {
      a[k] += a[k + w];
      bs[k] += bs[k + w];
    }
  }
  sa[threadIdx.y][threadIdx.x] = a[0];
  sb[threadIdx.y][threadIdx.x] = bs[0];
  __syncthreads();
  if (threadIdx.y == 0 && col < H) {
    float ta = 0.f, tb = 0.f;
#pragma unroll
    for (int k = 0; k < LANES; ++k) {
      ta += sa[k][threadIdx.x];
      tb += sb[k][threadIdx.x];
    }
    if (out_a != nullptr) out_a[col] = from_f<TA>(ta);
    if (out_b != nullptr) out_b[col] = from_f<TB>(tb);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Host side: launch plans and launches
// ---------------------------------------------------------------------------------------------------------
template <int V> struct IC { static constexpr int value = V; };

template <typename T> struct CudaT { using type = T; };
template <> struct CudaT<at::Half> { using type = __half; };
template <> struct CudaT<at::BFloat16> { using type = __nv_bfloat16; };

// A launch plan: nv chunks of VEC elements per thread (0 = the kernels of the widest rows: the forward's wide or
// generic kernel, the backward's two-kernel path or generic kernel), tpr threads per row, the backward's column sums in
// shared memory (acc_smem), the next row prefetched (pf), and for a forward plan without prefetch a persistent grid
// (persist; prefetching plans always run one) instead of a full one.
struct Cfg {
  int nv = 0;
  int tpr = 0;
  bool acc_smem = false;
  bool pf = false;
  bool persist = false;
};

// Forward plans (chunks = H / VEC; RMS and the element size V = VEC select among the plans measured on the H200:
// session 5's plan grid, benchmarks/results/nvidia_h200_2026-11-30/norm_fwd_plans_session5.log, and session 8's of
// the kernel with parameters loaded up front, norm_fwd_plans_session8.log):
// - rows below 512 columns of at least 16 chunks whose lanes are 75% in use or more with four chunks per thread, and
//   rows of exactly 8 chunks (64 columns of 16-bit, 32 of fp32), or of 16-bit rows 4 (32 columns), with two: no
//   prefetch, on a full grid, but 16-bit LayerNorm's rows of two-chunk threads on a persistent one; the parameters in
//   registers where fwd_preg allows it (RMSNorm with parameters of the input's dtype, four chunks), else loaded per
//   chunk. Session 31's call 5 (plan grid, % of copy; 32 columns lie below the issue's range but took the prefetching
//   plan with one thread per row): bf16 32 columns LayerNorm 48.6 -> 82.6 (persistent; full grid 79.5), RMSNorm 48.4
//   -> 90.0 (full; persistent 86.3); fp32 LayerNorm 32 columns 89.5 on the persistent grid, 93.6 on the full one
//   (RMSNorm, already on the full grid: 97.1 and 96.9 in two timings, 91.2 persistent); fp32 rows of 4 chunks (16
//   columns) were not measured and keep the prefetching plan.
//   Session 31 (H200, % of copy, forward;
//   benchmarks/results/nvidia_h200_2026-11-30/session31.log): its plan grid (norm_raw --fwd-plans, bf16 and fp32, 64,
//   128, 256 columns) had these plans fastest or within 0.2 points, but fp32 RMSNorm at 64 and 128 columns (two chunks
//   per thread 1.7 and 0.8 points faster), and 16-bit LayerNorm at 64 columns took the persistent grid from it (84.7
//   against the full grid's 80.5). The raw A/B against the persistent prefetching plan that these rows took before
//   (two alternating rounds, every row on a full grid) gained, in bf16, LayerNorm 64 / 128 / 192 / 256 / 384 / 448
//   columns 69.5 / 81.9 / 82.5 / 84.1 / 84.5 / 82.4 -> 80.7 / 89.7 / 86.8 / 90.9 / 87.5 / 88.6, RMSNorm 74.2 / 85.9 /
//   87.2 / 88.1 / 89.7 / 88.0 -> 90.5 / 91.6 / 90.8 / 91.7 / 91.8 / 92.3; fp16 alike; fp32 +2.6 to +7.9 (LayerNorm 64:
//   86.9 -> 94.8). It lost where lanes idle: 16-bit 96 columns (12 chunks, two per thread on eight threads: LayerNorm
//   -12, RMSNorm -4) and 320 (40 chunks, four per thread on sixteen threads: RMSNorm -2.4 to -3.5; fp32 LayerNorm
//   -0.9), which keep the prefetching plan. 16-bit LayerNorm rows with fp32 parameters keep it too (no two- or
//   four-chunk kernel without prefetch is built for them: fwd_p32_only_pf_below_512).
//   -DPIPEGOOSE_NORM_FWD_SMALL_PF (a benchmark experiment, off in the shipped build): the prefetching plan for every
//   such row, as before;
// - other rows below 512 columns: four chunks per thread (up to 512 threads per row) on a persistent grid that
//   prefetches the next row (pf);
// - wider rows: one block per row group and row (a full grid, no prefetch: the GPU keeps as many blocks in flight as
//   fit; 1-17% faster than the persistent grid there), four chunks per thread for RMSNorm up to 8192 columns and
//   LayerNorm up to 4096, else eight, up to 1024 threads per row. (16-bit LayerNorm took eight chunks from 512
//   columns (session 8: within 0.8 points of the best plan of the grid at every width) until its four-chunk plan
//   kept its row in fp32 (HOLDF, session 12: 1.0-2.0 points ahead at 512-2048 columns, 0.3 at 4096); with fp32
//   parameters (P32) it still takes eight: bf16 16384x4096 83.9 against 82.9 with four, session 12 call 3);
// - then (nv 0) norm_fwd_split_kernel (fp32 up to 65536 columns) or norm_fwd_wide_kernel, or norm_fwd_generic_kernel
//   for scalar rows. Scalar rows (VEC = 1): four values per thread with prefetch, up to 1024 threads per row.
template <int V, bool RMS, bool P32 = false>
constexpr Cfg fwd_plan(int64_t chunks, bool vec) {
  if (!vec) {
    const int tpr = round_tpr(ceil_div(chunks, 4));
    return tpr <= 1024 ? Cfg{4, tpr, false, true} : Cfg{};
  }
  const int64_t h = chunks * V;
  if (h < 512) {
#if !defined(PIPEGOOSE_NORM_FWD_SMALL_PF)
    const int nv = chunks >= 16 ? 4 : 2;
    const int tpr = round_tpr(ceil_div(chunks, nv));
    if (chunks >= (V == 8 ? 4 : 8) && !(P32 && !RMS) &&
        chunks * 100 >= static_cast<int64_t>(nv) * tpr * (nv == 4 ? 75 : 100)) {
      return {nv, tpr, false, false, nv == 2 && !RMS && V == 8};
    }
#endif
    const int tpr4 = round_tpr(ceil_div(chunks, 4));
    if (tpr4 <= 512) return {4, tpr4, false, true};
  }
  int nv = h <= (RMS ? 8192 : P32 ? 0 : 4096) ? 4 : 8;
#if !defined(PIPEGOOSE_NORM_FWD_NO_LANE_RULE)
  // Rows whose four-chunk plan leaves lanes idle (chunks short of 4 * tpr) take eight chunks per thread: LayerNorm
  // below 90% of the lanes in use, 16-bit RMSNorm below 85%, or below 70% where four chunks need one warp per row.
  // Session 18 (raw forward, % of copy, bf16, four -> eight chunks): LayerNorm 576 / 1152 / 1280 / 1600 / 1792 / 2304
  // / 3584 columns 76.7 / 69.0 / 72.7 / 79.7 / 85.8 / 78.8 / 85.9 -> 86.0 / 86.7 / 90.1 / 88.2 / 89.7 / 83.9 / 89.5,
  // RMSNorm 576 / 1152 / 1280 / 1536 / 2304 82.9 / 78.2 / 82.4 / 89.1 / 87.7 -> 90.3 / 91.2 / 91.5 / 91.2 / 91.4;
  // RMSNorm at 768 (75%, one warp) 92.4 -> 91.1, and with the lanes in use (1000, 1792, 3584, 5120, 7680 in the plan
  // grid) eight chunks lost 1.5-3.7. fp32 RMSNorm keeps four (eight lost 0.3-2.5 at 1000-5120 columns).
  // -DPIPEGOOSE_NORM_FWD_NO_LANE_RULE (a benchmark experiment, off in the shipped build): four chunks, as before.
  if (nv == 4 && (!RMS || V == 8)) {
    const int tpr4 = round_tpr(ceil_div(chunks, 4));
    const int pct = !RMS ? 90 : tpr4 <= 32 ? 70 : 85;
    if (chunks * 100 < 4 * static_cast<int64_t>(tpr4) * pct) nv = 8;
  }
#endif
  const int tpr = round_tpr(ceil_div(chunks, nv));
  if (tpr <= 1024) return {nv, tpr, false, false};
  const int tpr8 = round_tpr(ceil_div(chunks, 8));
  if (tpr8 <= 1024) return {8, tpr8, false, false};
  return Cfg{};
}

// 16-bit LayerNorm rows with fp32 parameters never take a two- or four-chunk plan without prefetch (below 512 columns
// they prefetch, wider ones take eight chunks, and rows past 8192 chunks none), so launch_fwd instantiates no such
// kernel for them; checked here over every row that has a register plan.
constexpr bool fwd_p32_only_pf_below_512() {
  for (int64_t chunks = 1; chunks <= int64_t{8} * 1024 + 1; ++chunks) {
    const Cfg c = fwd_plan<8, false, true>(chunks, true);
    if ((c.nv == 2 || c.nv == 4) && !c.pf) return false;
  }
  return true;
}
static_assert(fwd_p32_only_pf_below_512(), "fwd_plan: a two- or four-chunk plan without prefetch for LayerNorm with "
                                           "fp32 parameters and a 16-bit input (launch_fwd builds none)");

// The plans of rows below 512 columns, as session 31 measured them (fwd_plan's comment).
constexpr bool fwd_plan_is(Cfg c, int nv, int tpr, bool pf, bool persist) {
  return c.nv == nv && c.tpr == tpr && c.pf == pf && c.persist == persist && !c.acc_smem;
}
#if !defined(PIPEGOOSE_NORM_FWD_SMALL_PF)  // (that experiment restores the plans before session 31)
static_assert(fwd_plan_is(fwd_plan<8, true>(8, true), 2, 4, false, false) &&     // 16-bit RMSNorm, 64 columns
              fwd_plan_is(fwd_plan<8, false>(8, true), 2, 4, false, true) &&     // 16-bit LayerNorm, 64
              fwd_plan_is(fwd_plan<8, true>(16, true), 4, 4, false, false) &&    // 128
              fwd_plan_is(fwd_plan<8, false>(24, true), 4, 8, false, false) &&   // 192 (75% of the lanes)
              fwd_plan_is(fwd_plan<8, true>(56, true), 4, 16, false, false) &&   // 448
              fwd_plan_is(fwd_plan<8, true>(12, true), 4, 4, true, false) &&     // 96: prefetching plan
              fwd_plan_is(fwd_plan<8, false>(40, true), 4, 16, true, false) &&   // 320 (62.5%): prefetching plan
              fwd_plan_is(fwd_plan<8, false, true>(16, true), 4, 4, true, false) &&  // LayerNorm, fp32 parameters
              fwd_plan_is(fwd_plan<4, false>(16, true), 4, 4, false, false) &&   // fp32 LayerNorm, 64 columns
              fwd_plan_is(fwd_plan<4, true>(80, true), 4, 32, true, false) &&    // fp32 RMSNorm, 320: prefetching
              fwd_plan_is(fwd_plan<4, false>(8, true), 2, 4, false, false) &&    // fp32 LayerNorm, 32: full grid
              fwd_plan_is(fwd_plan<8, true>(4, true), 2, 2, false, false) &&     // 16-bit RMSNorm, 32 columns
              fwd_plan_is(fwd_plan<8, false>(4, true), 2, 2, false, true) &&     // 16-bit LayerNorm, 32: persistent
              fwd_plan_is(fwd_plan<8, true>(6, true), 4, 2, true, false) &&      // 48 (75%): prefetching plan
              fwd_plan_is(fwd_plan<4, true>(4, true), 4, 1, true, false),        // fp32, 16 columns: prefetching
              "fwd_plan: the plans of rows below 512 columns");
#endif

// Backward plans. Vector rows: two chunks per thread with register column sums and prefetch, up to 512 threads per row
// when ASYNC (grad_output of the input's element size: norm_bwd_async_kernel; bf16/fp16 H <= 8192, fp32 H <= 4096;
// session 6 A/B: 8192 bf16 LayerNorm 64 -> 88% of copy, RMSNorm 81 -> 94, 4096 fp32 83-85 -> 95-96 against the
// shared-memory plan), else up to 256 (bf16/fp16 H <= 4096, fp32 H <= 2048); when ASYNC, four chunks per thread with
// register column sums where they hold no more accumulators than two 16-bit chunks (fp32 H <= 8192, 16-bit RMSNorm H <=
// 16384; session 7 A/B: fp32 8192 LayerNorm 76-86 -> 93, RMSNorm 87-90 -> 95, bf16 RMSNorm 16384 75-77 -> 84; fp32 rows
// only where that keeps 16 warps per SM, else the eight-chunk plan below: session 32); two chunks per thread in one
// block of up to 768 threads for 16-bit RMSNorm rows of 9224-11264 columns where no cluster runs (the wide register
// rows, session 33, below);
// four chunks per thread with shared-memory column sums and prefetch (<= 512 threads: H <= 16384 / 8192); for fp32,
// eight chunks (32 values) per thread with shared-memory column sums without prefetch (H <= 16384); then (and for
// 16-bit LayerNorm rows from 16384 columns) the two-kernel path (nv 0 with vector rows). Scalar rows: four values per
// thread with prefetch, register column sums up to 256 threads per row, shared-memory ones up to 512.
template <int V, bool RMS, bool ASYNC, bool WIDE = true>
constexpr Cfg bwd_plan(int64_t chunks, bool vec) {
  if (!vec) {
    const int tpr = round_tpr(ceil_div(chunks, 4));
    if (tpr <= 256) return {4, tpr, false, true};
    if (tpr <= 512) return {4, tpr, true, true};
    return Cfg{};
  }
  // 16-bit LayerNorm rows of 16384 columns and more: the two-kernel path (nv 0), 20-22% faster than the
  // shared-memory accumulator plan at 16384 columns (bf16, bf16 or fp32 parameters; H200, session 5 A/B), where
  // RMSNorm and fp32 inputs ran 11-36% slower on it.
  // Measured and dropped (session 34, call 2; session34.log): 16-bit LayerNorm rows of 8200-16376 columns on the
  // four-chunk register plan (ptxas sm_90: 128 registers, 28 bytes of spill stores, one block per SM) instead of the
  // cluster kernel: 10-26 points slower (bf16 8704 / 12288 / 14336 columns 60.3 / 76.8 / 84.4 -> 50.3 / 57.6 / 60.3).
  if (!RMS && V == 8 && chunks * V >= 16384) return Cfg{};
  const int tpr4 = round_tpr(ceil_div(chunks, 4));
#if defined(PIPEGOOSE_NORM_BWD_SMEM_ACC)
  // Build-time experiment (benchmarks/build_cost.py --specialise): rows of at least one warp take the
  // shared-memory accumulator plan (four chunks per thread, twice the bytes in flight) instead of the register one.
  if (tpr4 >= 32 && tpr4 <= 512) return {4, tpr4, true, true};
#endif
  const int tpr2 = round_tpr(ceil_div(chunks, 2));
#if defined(PIPEGOOSE_NORM_BWD_ASYNC256)
  // Benchmark experiment (off in the shipped build): the register plan up to 256 threads per row only, as before
  // session 6.
  constexpr int kMaxRegTpr = 256;
#else
  constexpr int kMaxRegTpr = ASYNC ? 512 : 256;
#endif
  if (tpr2 <= kMaxRegTpr) return {2, tpr2, false, true};
#if !defined(PIPEGOOSE_NORM_BWD_NO_WIDE_REG) && !defined(PIPEGOOSE_NORM_BWD_ASYNC256)
  // 16-bit RMSNorm rows of 9224-11264 columns where no cluster runs (since session 37 the cluster kernel takes them on
  // sm_90 and newer: launch_bwd): two chunks per thread in one block of 577-704 threads per row (kWideRegTpb, four
  // stages, one block per SM), where they ran a cluster per row (session 32) and before that the four-chunk register
  // plan. Session 33 (call 1, raw backward, bf16, 16384 rows, % of copy, two rounds;
  // session33.log), cluster -> this plan with 4 stages, 10240 / 11264 columns: 73.6 / 78.7 -> 81.4 / 82.2 (at 9216,
  // where the four-chunk plan runs 86.0, it ran 78.4 against the cluster's 68.6 of session 32); call 2, the rule
  // against the cluster, bf16 and fp16: +1.9 to +13.1 at 9224-11264 columns (bf16 9224 / 10000 / 10240 / 11264: 63.8 /
  // 66.1 / 73.6 / 78.6 -> 72.7 / 79.2 / 81.3 / 82.0). Measured in call 1 and not taken: at 12288 columns four stages
  // and the weight cache no longer fit (67.9 against the cluster's 83.4); three stages and two ran 63.6-76.8 (RMSNorm)
  // at 8704-12288; 16-bit LayerNorm rows of 8704-12288 columns lost 0.6-6.8 points with three stages, 2.4-9.3 with two
  // and 3.8-17.9 with four against the cluster, and every plan was within 0.5 at 8192 (where the 512-thread plan runs).
  // -DPIPEGOOSE_NORM_BWD_NO_WIDE_REG (a benchmark experiment, off in the shipped build): the plans before session 33
  // (the cluster from 9224 columns on sm_90). WIDE = false: the plan without this rule (launch_bwd's fallback where the
  // stages do not fit).
  if (WIDE && ASYNC && RMS && V == 8 && chunks * V >= kWideRegMinH && chunks * V <= kWideRegMaxH) {
    return {2, tpr2, false, true};
  }
#endif
#if !defined(PIPEGOOSE_NORM_BWD_FP32_REG4) && !defined(PIPEGOOSE_NORM_BWD_NO_REG4)
  // fp32 rows past the two-chunk plan take four chunks per thread in registers (below) only where that kernel keeps 16
  // warps or more per SM: 512 threads per row, or for RMSNorm up to 320 (ptxas, sm_90: RMSNorm's kernel 96 registers,
  // so that two blocks of 320 threads fit, with no registers to spare; LayerNorm's 117 fit one); the other rows take
  // eight chunks per thread with shared-memory column sums (264 floats per thread at 256 threads per row: 66 KB, so
  // on a GPU with 63 KB or less of shared memory per block fp32 LayerNorm rows of 7172-7680 columns take the generic
  // kernel, where the plan before session 32 fitted). Session 32
  // (call 2, raw backward, % of copy, two rounds; session32.log), four chunks in registers -> eight in shared memory,
  // 4608 / 5120 / 6144 / 7168 / 8192 columns: LayerNorm 63.3 / 67.9 / 73.7 / 80.4 / 94.3 -> 90.4 / 92.6 / 86.5 / 91.8
  // / 82.7, RMSNorm 95.6 / 95.4 / 82.3 / 86.6 / 97.2 -> 91.7 / 92.0 / 92.6 / 92.3 / 92.3.
  // -DPIPEGOOSE_NORM_BWD_FP32_REG4 (a benchmark experiment, off in the shipped build): four chunks in registers for
  // every such row, as before (so does -DPIPEGOOSE_NORM_BWD_NO_REG4, below, for its own plan).
  if (ASYNC && V == 4 && tpr2 > 512 && tpr4 != 512 && !(RMS && tpr4 <= 320)) {
    const int tprw = round_tpr(ceil_div(chunks, 8));
    if (tprw <= 512) return {8, tprw, true, false};
  }
#endif
#if !defined(PIPEGOOSE_NORM_BWD_NO_REG4)
  // Four chunks per thread with register column sums in the asynchronous-copy kernel up to 512 threads per row, where
  // that holds no more accumulators than two 16-bit chunks: fp32 rows (H <= 8192; since session 32 only those that the
  // rule above leaves here), 16-bit RMSNorm rows (H <= 16384; from 9224 columns the cluster kernel on sm_90, elsewhere
  // 9224-11264 columns take the wide register rows above). -DPIPEGOOSE_NORM_BWD_NO_REG4 (a benchmark experiment, off in
  // the shipped build) sends them to the shared-memory accumulator plan below, as before session 7.
  if (ASYNC && (V == 4 || RMS) && tpr4 <= 512) return {4, tpr4, false, true};
#endif
  if (tpr4 <= 512) return {4, tpr4, true, true};
  if constexpr (32 / V > 4) {
    const int tprw = round_tpr(ceil_div(chunks, 32 / V));
    if (tprw <= 512) return {32 / V, tprw, true, false};
  }
  return Cfg{};
}

// The fp32 rows past the two-chunk plan (session 32's rule in bwd_plan).
constexpr bool bwd_plan_is(Cfg c, int nv, int tpr, bool acc_smem, bool pf) {
  return c.nv == nv && c.tpr == tpr && c.acc_smem == acc_smem && c.pf == pf;
}
#if !defined(PIPEGOOSE_NORM_BWD_FP32_REG4) && !defined(PIPEGOOSE_NORM_BWD_NO_REG4) && \
    !defined(PIPEGOOSE_NORM_BWD_SMEM_ACC) && !defined(PIPEGOOSE_NORM_BWD_ASYNC256)  // (experiments with other plans)
static_assert(bwd_plan_is(bwd_plan<4, false, true>(1152, true), 8, 160, true, false) &&  // LayerNorm 4608 columns
              bwd_plan_is(bwd_plan<4, false, true>(1792, true), 8, 224, true, false) &&  // LayerNorm 7168
              bwd_plan_is(bwd_plan<4, false, true>(2048, true), 4, 512, false, true) &&  // LayerNorm 8192: registers
              bwd_plan_is(bwd_plan<4, true, true>(1280, true), 4, 320, false, true) &&   // RMSNorm 5120: registers
              bwd_plan_is(bwd_plan<4, true, true>(1536, true), 8, 192, true, false) &&   // RMSNorm 6144
              bwd_plan_is(bwd_plan<4, true, true>(2048, true), 4, 512, false, true) &&   // RMSNorm 8192: registers
              bwd_plan_is(bwd_plan<4, false, false>(1280, true), 4, 320, true, true),    // mixed dtypes: unchanged
              "bwd_plan: the fp32 rows past the two-chunk plan");
#if !defined(PIPEGOOSE_NORM_BWD_NO_WIDE_REG)  // session 33's wide register rows
static_assert(bwd_plan_is(bwd_plan<8, true, true>(1152, true), 4, 288, false, true) &&   // bf16 RMSNorm 9216
              bwd_plan_is(bwd_plan<8, true, true>(1153, true), 2, 608, false, true) &&   // 9224: wide register rows
              bwd_plan_is(bwd_plan<8, true, true>(1408, true), 2, 704, false, true) &&   // 11264: wide register rows
              bwd_plan_is(bwd_plan<8, true, true, false>(1153, true), 4, 320, false, true) &&  // its fallback
              bwd_plan_is(bwd_plan<8, true, true>(1409, true), 4, 384, false, true) &&   // 11272
              bwd_plan_is(bwd_plan<8, false, true>(1280, true), 4, 320, true, true),     // bf16 LayerNorm 10240
              "bwd_plan: the 16-bit rows past 8192 columns");
#endif
#endif

// Shape-specialised build: a benchmark experiment (issue #6: one build per shape against the generic build), used
// by benchmarks/build_cost.py --specialise. What ships: the generic forward, and the backward specialised to the
// sizes BwdSpecHidden and BwdSpecExtra (below), the only place where the experiment found a gain.
// Compiling with -DPIPEGOOSE_NORM_HIDDEN=H0 (H0 > 0, a multiple of 8 so that every dtype's vector chunk divides
// it) adds instantiations of norm_fwd_kernel / norm_bwd_kernel with HC = H0: the plan fwd_plan / bwd_plan would
// choose for H0 (evaluated at compile time, so the same plan), with H, the chunks and threads per row, the rows
// per block and 1 / H as compile-time constants. Calls with H == H0 on the vector path run them; every other
// call (another H, the scalar path of unaligned pointers or H % VEC != 0, the generic kernels) runs the HC = 0
// kernels, unchanged. Without the macro no HC > 0 kernel is instantiated. The value is required: a bare
// -DPIPEGOOSE_NORM_HIDDEN (= 1) fails the static_assert below.
// Shipped backward specialisations: the common hidden sizes of the models we fuse (BERT-base / GPT-2 768, 1024,
// 2048, 4096, 8192). The generic backward pays for run-time row bounds; at [16384, 4096] bf16 a build specialised
// to the size took 0.149 ms against 0.182 ms (H200, benchmarks/results/nvidia_h200_2026-11-29/SUMMARY.md). Each
// size adds one kernel per (input, grad dtype) pair; -DPIPEGOOSE_NORM_NO_SPEC leaves them out (benchmarks/norm_spec.py
// builds both ways to compare).
#if defined(PIPEGOOSE_NORM_NO_SPEC)
using BwdSpecHidden = Sizes<>;
#else
using BwdSpecHidden = Sizes<768, 1024, 2048, 4096, 8192>;
#endif
// More model widths, for inputs and gradients of one dtype only (BwdSpecExtra): SmolLM2-135M 576, Qwen2-0.5B 896,
// SmolLM2-360M 960, Gemma-3-1B 1152, GPT-2 large 1280, Qwen2-1.5B 1536, GPT-2 XL 1600, Gemma-2-2B 2304, Phi-2 /
// GPT-NeoX-2.7B 2560, Llama-3.2-3B 3072, Qwen2-7B 3584, Gemma-3-12B 3840, Gemma-2-27B 4608, Llama-2-13B 5120,
// GPT-NeoX-20B 6144, Yi-34B 7168. Each list keeps the widths where a -DPIPEGOOSE_NORM_HIDDEN=H build ran the raw
// backward faster than the shipped one by about 0.8 points of copy or more (16-bit: in bf16 and in fp16; 16384 rows,
// two rounds in alternating processes; benchmarks/results/nvidia_h200_2026-11-30/session39.log and session40.log):
// - 2560 / 3072 / 3584 / 5120 / 6144 (session 39, call 3): bf16 LayerNorm +3.6 / +3.9 / +0.3 / +1.5 / -4.9, RMSNorm
//   +1.9 / +1.6 / +1.6 / +2.0 / +2.6; fp32 LayerNorm +0.3 / +1.3 / +1.8 / -0.6 / +4.4, RMSNorm -2.4 / -0.8 / -2.4 /
//   -0.9 / +0.7. Against a build without the lists (-DPIPEGOOSE_NORM_NO_SPEC16 -DPIPEGOOSE_NORM_NO_SPEC32; session
//   40, call 1): fp16 LayerNorm 2560 / 3072 / 5120 +3.1 / +4.1 / +1.1, RMSNorm +1.1 to +2.2; fp32 LayerNorm 3072 /
//   3584 / 6144 +1.6 / +1.8 / +5.2.
// - 896 / 1280 / 1536 / 1600 / 2304 / 7168 (session 40, call 1): LayerNorm bf16 +1.8 / +1.9 / +3.8 / -2.2 / +1.6 /
//   -4.0 (fp16 alike), fp32 +1.2 / +2.0 / +1.4 / +1.2 / +0.9 / +0.1; RMSNorm bf16 +2.6 / +3.6 / +2.5 / +1.7 / +0.8 /
//   +2.1 (fp16 +1.5 to +3.3), fp32 +1.1 / +12.2 / -1.9 / +1.0 / -0.4 / +1.2 (896: -0.1 in call 2's check, left out).
// - 576 / 960 / 1152 / 3840 / 4608 (session 40, call 2): LayerNorm bf16 -0.4 / +3.2 / -2.6 / +0.8 / -2.7 (fp16
//   alike), fp32 +2.0 / +1.9 / +1.2 / +2.0 / +1.9; RMSNorm bf16 +1.4 / +2.8 / +2.4 / +1.4 / +2.2 (fp16 +1.3 to +3.0),
//   fp32 +0.9 / +0.3 / +14.3 / -2.6 / -0.3.
// - 16-bit LayerNorm 576 / 1152 / 1600 / 4608 / 7168 (session 41), with the weight always from shared memory
//   (BwdPcache16Ln, where it lost above). Against a build without the 16-bit lists (session 41, call 2), every 16-bit
//   LayerNorm width of the list: bf16 +0.9 to +4.6 (576: 44.3 -> 47.9, 1280: 66.2 -> 70.8, 7168: 91.7 -> 93.1), fp16
//   +1.5 to +4.5. 6144 stays out: -16.0 / -18.4 specialised with the shared-memory weight (call 1).
// -DPIPEGOOSE_NORM_NO_SPEC16 leaves the 16-bit lists out, -DPIPEGOOSE_NORM_NO_SPEC32 the fp32 ones. Mixed pairs (a
// 16-bit input with fp32 gradients) keep the kernels compiled for their threads per row.
#if defined(PIPEGOOSE_NORM_NO_SPEC) || defined(PIPEGOOSE_NORM_NO_SPEC16)
using BwdSpec16Ln = Sizes<>;
using BwdSpec16Rms = Sizes<>;
#else
using BwdSpec16Ln = Sizes<576, 896, 960, 1152, 1280, 1536, 1600, 2304, 2560, 3072, 3840, 4608, 5120, 7168>;
using BwdSpec16Rms =
    Sizes<576, 896, 960, 1152, 1280, 1536, 1600, 2304, 2560, 3072, 3584, 3840, 4608, 5120, 6144, 7168>;
#endif
#if defined(PIPEGOOSE_NORM_NO_SPEC) || defined(PIPEGOOSE_NORM_NO_SPEC32)
using BwdSpec32Ln = Sizes<>;
using BwdSpec32Rms = Sizes<>;
#else
using BwdSpec32Ln = Sizes<576, 896, 960, 1152, 1280, 1536, 1600, 2304, 3072, 3584, 3840, 4608, 6144>;
using BwdSpec32Rms = Sizes<576, 1152, 1280, 1600, 7168>;
#endif
// The widths of launch_bwd<Tin, Tdy, RMS> with a specialised kernel beyond BwdSpecHidden.
template <typename Tin, typename Tdy, bool RMS>
using BwdSpecExtra = std::conditional_t<
    !std::is_same<Tin, Tdy>::value, Sizes<>,
    std::conditional_t<sizeof(Tin) == 2, std::conditional_t<RMS, BwdSpec16Rms, BwdSpec16Ln>,
                       std::conditional_t<RMS, BwdSpec32Rms, BwdSpec32Ln>>>;
// f(IC<HC>{}) for each HC of the list, in order, until one returns true; whether one did.
template <int... Hs, typename F>
bool any_size(Sizes<Hs...>, F&& f) {
  return (f(IC<Hs>{}) || ... || false);
}

#if defined(PIPEGOOSE_NORM_HIDDEN)
static_assert(PIPEGOOSE_NORM_HIDDEN > 0, "PIPEGOOSE_NORM_HIDDEN: expected a hidden size > 0");
static_assert(PIPEGOOSE_NORM_HIDDEN % 8 == 0, "PIPEGOOSE_NORM_HIDDEN: expected a multiple of 8");
static_assert(PIPEGOOSE_NORM_HIDDEN <= std::numeric_limits<int>::max(), "PIPEGOOSE_NORM_HIDDEN: expected < 2^31");
constexpr int kSpecHidden = static_cast<int>(PIPEGOOSE_NORM_HIDDEN);
#endif

inline bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Dynamic shared memory a block may use on this device (the opt-in limit less 1 KB for the kernels' static shared
// memory): 227 KB on the H100/H200, 163 KB on the A100, 99 KB on sm_86/sm_89, 63 KB on sm_75. The environment
// variable PIPEGOOSE_NORM_SMEM_LIMIT (bytes; read once per process) lowers it, so that the plans of a GPU with less
// shared memory, and their fallbacks, can be tested on a larger one.
inline size_t smem_limit() {
  static const long long kOverride = [] {
    const char* v = std::getenv("PIPEGOOSE_NORM_SMEM_LIMIT");
    if (v == nullptr || *v == '\0') return -1LL;
    char* end = nullptr;
    const long long n = std::strtoll(v, &end, 10);
    return end != nullptr && *end == '\0' && n >= 0 ? n : -2LL;
  }();
  PG_CHECK(kOverride != -2, "PIPEGOOSE_NORM_SMEM_LIMIT: expected a number of bytes >= 0, got '",
           std::getenv("PIPEGOOSE_NORM_SMEM_LIMIT"), "'");
  const size_t optin = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
  const size_t limit = optin > 1024 ? optin - 1024 : 0;
  return kOverride >= 0 ? std::min(limit, static_cast<size_t>(kOverride)) : limit;
}

// Whether `bytes` of dynamic shared memory fit smem_limit() (a function, so that a constant 0 is no "pointless
// comparison of unsigned integer with zero", nvcc warning #186).
inline bool smem_fits(size_t bytes) { return bytes <= smem_limit(); }

// Raises a kernel's dynamic shared memory limit to smem when needed (the default, 48 KB, counts the kernel's static
// shared memory too, so any request above 32 KB sets it). Cached per device and kernel: the attribute is set once
// per size increase, not per launch.
inline void allow_smem(const void* kernel, size_t smem) {
  if (smem <= 32 * 1024) return;
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, size_t> done;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  size_t& cur = done[std::make_pair(dev, kernel)];
  if (smem <= cur) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  cur = smem;
}

#if defined(PIPEGOOSE_NORM_FWD_EXPERIMENT)
// Benchmark experiment (off in the shipped build; norm_raw --fwd-plans): the forward plan of vector rows with
// Tout == Tin, bf16 or fp32 input, is read from PIPEGOOSE_NORM_FWD_EXP = "grid,nv,pf,preg" (grid 0 persistent / 1
// full, nv 1, 2, 4 or 8 chunks per thread or 0 for norm_fwd_wide_kernel (grid, pf, preg then unused), pf 1 to
// prefetch the next row (nv 2 or 4 only), preg 1 for the parameters
// in registers where fwd_preg allows, 0 for loads per chunk), and an optional fifth field minb (",2": the kernel's
// launch bounds ask for two blocks of 1024 threads per SM, at most 32 registers; nv 2 or 4 without prefetch only);
// unset or malformed, or a plan the row cannot take (more than 1024 threads per row, a row on the generic or scalar
// path): the shipped plan.
struct FwdExp {
  bool on = false;
  int grid = 0, nv = 0, pf = 0, preg = 0, minb = 1;
};
inline FwdExp fwd_exp() {
  FwdExp e;
  const char* v = std::getenv("PIPEGOOSE_NORM_FWD_EXP");
  if (v == nullptr) return e;
  int end = 0;
  e.on = std::sscanf(v, "%d,%d,%d,%d%n", &e.grid, &e.nv, &e.pf, &e.preg, &end) == 4;
  if (e.on && v[end] == ',') {  // an optional fifth field: minb (1, or 2 for nv 2 or 4 without prefetch)
    int end2 = 0;
    e.on = std::sscanf(v + end, ",%d%n", &e.minb, &end2) == 1 && (e.minb == 1 || (e.minb == 2 && e.pf == 0 &&
                                                                                   (e.nv == 2 || e.nv == 4)));
    end += end2;
  }
  e.on = e.on && v[end] == '\0' && (e.nv == 0 || e.nv == 1 || e.nv == 2 || e.nv == 4 || e.nv == 8) &&
         (e.pf == 0 || e.nv == 2 || e.nv == 4);
  return e;
}
#endif

// The device address of this module's kParamOnes (ones: the row of Tp) or kParamZeros, on the current device
// (cached per device).
template <typename Tp>
const Tp* fwd_stand_in(bool ones) {
  static std::mutex mu;
  static std::map<int, std::pair<const char*, const char*>> cache;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(dev);
  if (it == cache.end()) {
    void* o = nullptr;
    void* z = nullptr;
    C10_CUDA_CHECK(cudaGetSymbolAddress(&o, kParamOnes));
    C10_CUDA_CHECK(cudaGetSymbolAddress(&z, kParamZeros));
    it = cache.emplace(dev, std::make_pair(static_cast<const char*>(o), static_cast<const char*>(z))).first;
  }
  constexpr int k = std::is_same<Tp, float>::value ? 0 : std::is_same<Tp, __nv_bfloat16>::value ? 1 : 2;
  return reinterpret_cast<const Tp*>(ones ? it->second.first + 32 * k : it->second.second);
}

template <typename Tin, typename Tout, typename Tp, bool RMS>
void launch_fwd(const Tin* x, const Tp* w, const Tp* b, Tout* y, float* mean, float* rstd, int64_t rows, int H,
                float eps, cudaStream_t stream) {
  constexpr int V = 16 / sizeof(Tin);
  bool vec = H % V == 0 && aligned(x, 16) && aligned(y, V * sizeof(Tout));
  if (w != nullptr) vec = vec && aligned(w, V * sizeof(Tp));
  if (b != nullptr) vec = vec && aligned(b, V * sizeof(Tp));
  constexpr bool P32 = sizeof(Tin) == 2 && sizeof(Tp) == 4;  // fp32 parameters of a 16-bit input
  Cfg cfg = fwd_plan<V, RMS, P32>(vec ? H / V : H, vec);
  bool full_grid = !cfg.pf && !cfg.persist;
  // The row and split kernels' parameters: never null (load_params_m).
  constexpr bool ZS = fwd_zero_stride<Tin, Tp, RMS>();
  const Tp* wk = ZS && w == nullptr ? fwd_stand_in<Tp>(true) : w;
  const Tp* bk = ZS && b == nullptr ? fwd_stand_in<Tp>(false) : b;
  const int wm = w != nullptr ? 1 : 0, bm = b != nullptr ? 1 : 0;
#if defined(PIPEGOOSE_NORM_FWD_EXPERIMENT)
  const FwdExp ex = fwd_exp();
  bool exp_on = ex.on && vec && cfg.nv != 0 && std::is_same<Tin, Tout>::value && !std::is_same<Tin, __half>::value &&
                (ex.nv == 0 || round_tpr(ceil_div(H / V, ex.nv)) <= 1024);
#if defined(PIPEGOOSE_NORM_HIDDEN)
  exp_on = exp_on && H != kSpecHidden;  // that size runs its specialised kernel on the shipped plan
#endif
  if (exp_on) {
    cfg = ex.nv == 0 ? Cfg{} : Cfg{ex.nv, round_tpr(ceil_div(H / V, ex.nv)), false, ex.pf != 0};
    full_grid = ex.grid != 0;
  }
#endif
  const int sms = sm_count();
  if (cfg.nv == 0 && vec) {
    // fp32 rows of up to 65536 columns: the first 32768 values in registers, the rest in shared memory
    // (norm_fwd_split_kernel), one read; wider rows (fp32 or 16-bit), or a device with less than its 128 KB of shared
    // memory per block: norm_fwd_wide_kernel (two reads).
    if constexpr (sizeof(Tin) == 4) {
      auto split = [&](auto nr_c, auto pf_c) {
        constexpr int NR = decltype(nr_c)::value;
        constexpr bool PF = decltype(pf_c)::value;
        if (H / V > kSplitThreads * kSplitChunks || !smem_fits(split_smem(NR))) return false;
        auto kernel = &norm_fwd_split_kernel<Tout, Tp, RMS, NR, PF>;
        allow_smem(reinterpret_cast<const void*>(kernel), split_smem(NR));
        const int64_t grid = std::min<int64_t>(rows, PF ? static_cast<int64_t>(sms) : (1LL << 31) - 1);
        kernel<<<static_cast<unsigned>(grid), kSplitThreads, split_smem(NR), stream>>>(x, wk, bk, wm, bm, y, mean,
                                                                                      rstd, rows, H, eps);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return true;
      };
      using No = std::false_type;
      using Yes = std::true_type;
      // the shipped plan: the PF form for LayerNorm rows past kSplitPipeChunks
      auto shipped_split = [&]() {
        if constexpr (RMS) {
          return split(IC<kSplitReg>{}, No{});
        } else {
          return H / V > kSplitPipeChunks ? split(IC<kSplitReg>{}, Yes{}) : split(IC<kSplitReg>{}, No{});
        }
      };
#if defined(PIPEGOOSE_NORM_FWD_EXPERIMENT)
      // PIPEGOOSE_NORM_FWD_WIDE (benchmark experiment, off in the shipped build): split4 (four chunks per thread in
      // registers, twelve in shared memory), split8 (a block per row), pipe8 (a block per SM, the next row loaded
      // during this row's output) or wide (norm_fwd_wide_kernel). A PIPEGOOSE_NORM_FWD_EXP plan (exp_on) keeps its
      // meaning: nv 0 is norm_fwd_wide_kernel.
      if (const char* v = std::getenv("PIPEGOOSE_NORM_FWD_WIDE")) {
        const std::string e(v);
        if (e == "split4" && split(IC<4>{}, No{})) return;
        if (e == "split8" && split(IC<8>{}, No{})) return;
        if (e == "pipe8" && split(IC<8>{}, Yes{})) return;
        if (e != "split4" && e != "split8" && e != "pipe8" && e != "wide") {
          PG_CHECK(false, "PIPEGOOSE_NORM_FWD_WIDE: expected split4, split8, pipe8 or wide, got '", e, "'");
        }
      } else if (!exp_on && shipped_split()) {
        return;
      }
#else
      if (shipped_split()) return;
#endif
    }
    auto kernel = &norm_fwd_wide_kernel<Tin, Tout, Tp, V, RMS>;
    const int occ = occupancy(reinterpret_cast<const void*>(kernel), kWideThreads, 0);
    const int64_t grid = wide_grid(rows, static_cast<int64_t>(H) * sizeof(Tin), sms, occ);
    kernel<<<static_cast<unsigned>(grid), kWideThreads, 0, stream>>>(x, w, b, y, mean, rstd, rows, H, eps);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  if (cfg.nv == 0) {
    const int threads = 1024;
    const int64_t grid = std::min<int64_t>(rows, static_cast<int64_t>(sms) * 2);
    norm_fwd_generic_kernel<Tin, Tout, RMS><<<static_cast<unsigned>(grid), threads, 0, stream>>>(
        x, w, b, std::is_same<Tp, float>::value, y, mean, rstd, rows, H, eps);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const int rpb = rows_per_block(cfg.tpr);
  const int threads = rpb * cfg.tpr;
  auto go = [&](auto nv_c, auto vec_c, auto pf_c, auto preg_c, auto h_c, auto mb_c) {
    constexpr int MB = decltype(mb_c)::value;
    constexpr int NV = decltype(nv_c)::value;
    constexpr int VEC = decltype(vec_c)::value;
    constexpr bool PF = decltype(pf_c)::value != 0;
    constexpr bool PREG = decltype(preg_c)::value != 0;
    constexpr int HC = decltype(h_c)::value;
    auto run = [&](auto kernel, size_t smem) {
      allow_smem(reinterpret_cast<const void*>(kernel), smem);
      const int occ = occupancy(reinterpret_cast<const void*>(kernel), threads, smem);
      // Prefetching plans: a persistent grid (as many blocks as fit on the GPU at once, each walking over rows with
      // a stride). The plans without prefetch: one block per row group and row (a full grid; see fwd_plan).
      const int64_t full = std::min<int64_t>(ceil_div(rows, rpb), (1LL << 31) - 1);
      const int64_t resident = static_cast<int64_t>(sms) * occ;
      const int64_t grid = std::max<int64_t>(1, full_grid ? full : std::min<int64_t>(full, resident));
      kernel<<<static_cast<unsigned>(grid), threads, smem, stream>>>(x, wk, bk, wm, bm, y, mean, rstd, rows, H,
                                                                     cfg.tpr, eps);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    // Rows of 1024 threads (eight chunks per thread at the widest rows) load x without allocating in L1 (ld_hint) and
    // stage their parameters through shared memory (fwd_param_stages), where the device has enough of it; else the
    // kernel without either.
    if constexpr (NV == 8 && VEC > 1) {
      constexpr size_t smem = static_cast<size_t>(fwd_param_stages(VEC, sizeof(Tp), RMS, NV)) * kFwdRowThreadsMax *
                              fwd_param_bytes(VEC, sizeof(Tp), RMS);
      static_assert(kFwdRowThreadsMax == 1024, "the NOL1 kernels run rows of 1024 threads");
      if (cfg.tpr == 1024 && threads == kFwdRowThreadsMax && smem_fits(smem)) {
        run(&norm_fwd_kernel<Tin, Tout, Tp, VEC, NV, RMS, PF, PREG, HC, true>, smem);
        return;
      }
    }
    run(&norm_fwd_kernel<Tin, Tout, Tp, VEC, NV, RMS, PF, PREG, HC, false, MB>, 0);
  };
#if defined(PIPEGOOSE_NORM_HIDDEN)
  // H == kSpecHidden on the vector path: cfg is this compile-time plan; the vector branches below with HC = H.
  constexpr Cfg spec = fwd_plan<V, RMS, P32>(kSpecHidden / V, true);
  if constexpr (spec.nv != 0) {
    if (vec && H == kSpecHidden) {
      static_assert((spec.nv == 2 || spec.nv == 4 || spec.nv == 8) && !(spec.nv != 4 && spec.pf),
                    "fwd_plan: vector plans");
      static_assert(spec.tpr == FixedRow<kSpecHidden, V, spec.nv, false>::tpr, "FixedRow: the plan's tpr");
      go(IC<spec.nv>{}, IC<V>{}, IC<spec.pf ? 1 : 0>{}, IC<spec.nv == 2 ? 0 : 1>{}, IC<kSpecHidden>{}, IC<1>{});
      return;
    }
  }
#endif
#if defined(PIPEGOOSE_NORM_FWD_EXPERIMENT)
  if constexpr (std::is_same<Tin, Tout>::value && !std::is_same<Tin, __half>::value) {
    if (exp_on) {
      auto pick = [&](auto nv_c, auto pf_c) {
        constexpr bool MB2 = (decltype(nv_c)::value == 2 || decltype(nv_c)::value == 4) && decltype(pf_c)::value == 0;
        if constexpr (MB2) {
          if (ex.minb == 2) {
            if (ex.preg) go(nv_c, IC<V>{}, pf_c, IC<1>{}, IC<0>{}, IC<2>{});
            else go(nv_c, IC<V>{}, pf_c, IC<0>{}, IC<0>{}, IC<2>{});
            return;
          }
        }
        if (ex.preg) go(nv_c, IC<V>{}, pf_c, IC<1>{}, IC<0>{}, IC<1>{});
        else go(nv_c, IC<V>{}, pf_c, IC<0>{}, IC<0>{}, IC<1>{});
      };
      if (cfg.nv == 1) {
        pick(IC<1>{}, IC<0>{});
      } else if (cfg.nv == 2) {
        if (cfg.pf) pick(IC<2>{}, IC<1>{}); else pick(IC<2>{}, IC<0>{});
      } else if (cfg.nv == 4) {
        if (cfg.pf) pick(IC<4>{}, IC<1>{}); else pick(IC<4>{}, IC<0>{});
      } else {
        pick(IC<8>{}, IC<0>{});
      }
      return;
    }
  }
#endif
  if (!vec) {
    go(IC<4>{}, IC<1>{}, IC<1>{}, IC<1>{}, IC<0>{}, IC<1>{});
  } else if (cfg.nv == 4 && cfg.pf) {
    go(IC<4>{}, IC<V>{}, IC<1>{}, IC<1>{}, IC<0>{}, IC<1>{});
  } else if (cfg.nv == 2) {
    // rows of 8 chunks, and 16-bit rows of 4 (fwd_plan), parameters loaded per chunk (as sessions 31-32 timed them)
    if constexpr (P32 && !RMS) {  // no such plan (fwd_p32_only_pf_below_512)
      TORCH_INTERNAL_ASSERT(false, "layer_norm forward: no two-chunk plan for fp32 parameters of a 16-bit input (H = ",
                            H, ")");
    } else {
      go(IC<2>{}, IC<V>{}, IC<0>{}, IC<0>{}, IC<0>{}, IC<1>{});
    }
  } else if (cfg.nv == 4) {
    if constexpr (P32 && !RMS) {  // no such plan (fwd_p32_only_pf_below_512)
      TORCH_INTERNAL_ASSERT(false, "layer_norm forward: no four-chunk plan without prefetch for fp32 parameters of a "
                            "16-bit input (H = ", H, ")");
    } else {
      go(IC<4>{}, IC<V>{}, IC<0>{}, IC<1>{}, IC<0>{}, IC<1>{});
    }
  } else {
    go(IC<8>{}, IC<V>{}, IC<0>{}, IC<1>{}, IC<0>{}, IC<1>{});
  }
}

// Whether the norm kernels use thread block clusters on the current device: sm_90 and newer, unless the environment
// variable PIPEGOOSE_NORM_CLUSTERS is 0 (read once per process; 1 or unset: on), so that the plans of a GPU without
// clusters (the backward's wide rows on their other plans, the column reduction launched without programmatic
// serialisation, also an sm_90 feature) can be tested on one that has them.
inline bool has_clusters() {
  static const std::string kValue = [] {
    const char* v = std::getenv("PIPEGOOSE_NORM_CLUSTERS");
    return std::string(v == nullptr ? "" : v);
  }();
  PG_CHECK(kValue.empty() || kValue == "0" || kValue == "1", "PIPEGOOSE_NORM_CLUSTERS: expected 0 or 1, got '", kValue,
           "'");
  return kValue != "0" && at::cuda::getCurrentDeviceProperties()->major >= 9;
}

// The cluster size of norm_bwd_cluster_kernel for rows of `chunks` chunks of vec elements: the fewest blocks whose
// blocks hold their slab of the row (kClThreads * kClValues / vec chunks), of 2, 3, 4, 5 and 8 for 16-bit rows and of
// 2, 4 and 8 for fp32, or 0 when none does. Each step costs about as much as 1000 chunks' work whatever the slab (a
// block reduction, the exchange), so more chunks per block per step run faster:
// - Session 37 (call 1, raw backward, % of copy, two rounds; session37.log), -DPIPEGOOSE_NORM_BWD_EXPERIMENT with
//   PIPEGOOSE_NORM_BWD_CL_SIZE=N, the fewest blocks against the power of two: bf16 LayerNorm 18432 / 20480 / 22528 /
//   24576 columns, 3 blocks for 4: 67.7 / 75.4 / 82.3 / 86.5 -> 86.3 / 82.6 / 86.1 / 93.3; RMSNorm 77.3 / 85.3 / 91.2
//   / 93.9 -> 93.5 / 93.1 / 91.9 / 99.3; 36864 / 40960, 5 blocks for 8: LayerNorm 66.5 / 74.0 -> 78.7 / 84.7, RMSNorm
//   75.7 / 84.0 -> 89.9 / 93.9. But 6 blocks at 49152 and 7 at 57344 lost (LayerNorm 85.0 / 84.9 -> 78.7 / 81.8,
//   RMSNorm 92.4 / 95.0 -> 89.3 / 91.8; by our arithmetic, not profiled: two such clusters fill 12 or 14 of a GPC's
//   16-18 SMs), and so did every fp32 row but LayerNorm 18432 (+2.9) and RMSNorm 24576 (+1.6), by up to 22 points
//   (20480 columns, 3 blocks: LayerNorm 97.1 -> 76.5, RMSNorm 101.2 -> 79.3, where the slab of 83% of the block
//   takes the cluster barrier instead of the mbarriers).
// - Larger clusters (3-6 blocks where 2 or 4 hold the row) ran 14-60 points slower (session 35, call 1; bf16
//   LayerNorm 8704 columns: 61.3 -> 44.8 / 35.5 / 27.3 / 21.0 at 3 / 4 / 5 / 6 blocks).
inline int bwd_cluster_size(int64_t chunks, int vec) {
  const int64_t per_block = kClThreads * kClValues / vec;
  static constexpr int kSizes16[] = {2, 3, 4, 5, 8};  // 16-bit rows (vec 8)
  static constexpr int kSizes32[] = {2, 4, 8};        // fp32 rows (vec 4)
  const bool f32 = vec == 4;
  const int* sizes = f32 ? kSizes32 : kSizes16;
  const int n = f32 ? 3 : 5;
  for (int i = 0; i < n; ++i) {
    if (ceil_div(chunks, sizes[i]) <= per_block) return sizes[i];
  }
  return 0;
}

// Launches norm_bwd_cluster_kernel on rows of vector chunks (H % VEC == 0, 16-byte aligned x, dy and dx, the weight
// aligned to its chunks) in clusters of cl blocks, as many clusters as fit the GPU at once (at most one per row);
// fills ws [NACC, clusters, H] when want_ws. Returns false, launching nothing, when the stages do not fit this
// device's shared memory (smem_limit) or no cluster of cl such blocks fits the GPU.
template <typename Tin, typename Tdy, bool RMS>
bool launch_bwd_cluster(const Tdy* dy, const Tin* x, const void* w, bool p_f32, const float* mean, const float* rstd,
                        Tin* dx, int64_t rows, int H, int cl, bool want_ws, const at::TensorOptions& fopts,
                        cudaStream_t stream, at::Tensor& ws) {
  constexpr int V = 16 / sizeof(Tin);
  constexpr int NV = kClValues / V;
  constexpr int NACC = RMS ? 1 : 2;
  static_assert(sizeof(Tdy) == sizeof(Tin), "launch_bwd_cluster: x and dy of one element size");
  const size_t smem = bwd_cluster_smem(static_cast<int>(sizeof(Tin)), static_cast<int>(sizeof(Tdy)));
  if (cl < 2 || cl > kClMaxCluster || smem > smem_limit()) return false;
  const int cpb = static_cast<int>(ceil_div(H / V, cl));
  PG_CHECK(cpb <= kClThreads * NV, "pipegoose norm backward: internal error: ", cpb,
           " chunks per block of a cluster of ", cl, " for ", H, " columns");
  // The row sums' exchange and the threads per block. Session 36 (call 1, raw backward, % of copy, two rounds, bf16
  // and fp32, 8704-65536 columns; session36.log), against session 35's kernel (512 threads; mbarriers waited for by
  // every thread after pass 2 for 16-bit LayerNorm and for slabs that fill at most 3/4 of a 16-bit block or 2/3 of an
  // fp32 one, the cluster barrier for the others):
  // - the mbarriers waited for by thread 0 a step later (MBAR), 512 threads: 16-bit +0.8 to +9.1 where the slab fills
  //   3/4 of the block or more (bf16 RMSNorm 65536: 90.4 -> 99.5), within 0.4 on the partial LayerNorm slabs, -2.8 at
  //   bf16 RMSNorm 20480; fp32 +3.6 to +13.2 on slabs filling up to 3/4, -0.7 to -7.5 on fuller ones (fp32 RMSNorm
  //   16384: 101.8 -> 94.6);
  // - blocks of as few threads as hold the slab (`threads` below) on top: 16-bit partial slabs +2.0 to +9.4 more (bf16
  //   LayerNorm 8704 / 12288 / 20480 / 24576: 63.3 / 83.6 / 67.7 / 79.1 at first -> 72.8 / 90.2 / 75.5 / 86.3); full
  //   slabs run 512 threads, as before (within -0.1 to +1.6 of the first variant).
  // The rule: MBAR for 16-bit rows and for fp32 slabs that fill at most 3/4 of the block (fp32 LayerNorm 11264 / 24576:
  // 90.3 / 88.5 -> 101.7 / 101.0), the cluster barrier for fuller fp32 slabs (there -0.6 to +0.6); slab-sized blocks
  // for every row.
  // At every timed row it ran within 1.8 of the best of the four variants (bf16 LayerNorm 20480: 75.5, against 77.3
  // for nt threads on session 35's exchange).
  // -DPIPEGOOSE_NORM_BWD_EXPERIMENT with PIPEGOOSE_NORM_BWD_CL_EXCHANGE=barrier or mbar takes one exchange for every
  // row, and PIPEGOOSE_NORM_BWD_CL_THREADS=full kClThreads threads for every row (slab: the rule's count; benchmark
  // experiments).
  constexpr int kCap = kClThreads * NV;  // chunks a block holds
  bool mbar = sizeof(Tin) == 2 || 4 * cpb <= 3 * kCap;
  int threads = static_cast<int>(std::min<int64_t>(kClThreads, ceil_div(ceil_div(cpb, NV), 32) * 32));
#if defined(PIPEGOOSE_NORM_BWD_EXPERIMENT)
  if (const char* v = std::getenv("PIPEGOOSE_NORM_BWD_CL_EXCHANGE")) {
    const std::string e(v);
    PG_CHECK(e == "barrier" || e == "mbar", "PIPEGOOSE_NORM_BWD_CL_EXCHANGE: expected barrier or mbar, got '", e, "'");
    mbar = e == "mbar";
  }
  if (const char* v = std::getenv("PIPEGOOSE_NORM_BWD_CL_THREADS")) {
    const std::string e(v);
    PG_CHECK(e == "full" || e == "slab", "PIPEGOOSE_NORM_BWD_CL_THREADS: expected full or slab, got '", e, "'");
    if (e == "full") threads = kClThreads;
  }
#endif
  auto kernel = mbar ? &norm_bwd_cluster_kernel<Tin, Tdy, V, NV, RMS, true>
                     : &norm_bwd_cluster_kernel<Tin, Tdy, V, NV, RMS, false>;
  allow_smem(reinterpret_cast<const void*>(kernel), smem);
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = static_cast<unsigned>(cl);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.blockDim = dim3(static_cast<unsigned>(threads), 1, 1);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  // Clusters resident at once, cached per device, kernel, cluster size and threads per block.
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, int, int>, int> cache;
  int dev = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  const auto key = std::make_tuple(dev, reinterpret_cast<const void*>(kernel), cl, threads);
  int fit = -1;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) fit = it->second;
  }
  if (fit < 0) {
    config.gridDim = dim3(static_cast<unsigned>(cl) * static_cast<unsigned>(sm_count()), 1, 1);
    C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&fit, kernel, &config));
    std::lock_guard<std::mutex> lock(mu);
    cache[key] = fit;
  }
  if (fit <= 0) return false;
  const int64_t ncl = std::max<int64_t>(1, std::min<int64_t>(rows, fit));
  config.gridDim = dim3(static_cast<unsigned>(ncl * cl), 1, 1);
  if (want_ws) ws = at::empty({NACC, ncl, H}, fopts);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, dy, x, w, p_f32, mean, rstd, dx,
                                    want_ws ? ws.data_ptr<float>() : nullptr, rows, H, cpb));
  return true;
}

// Backward (dx, plus the workspace partial rows when want_ws). Returns the workspace [NACC, P, H] (undefined when
// want_ws is false). The caller reduces it with launch_col_reduce.
template <typename Tin, typename Tdy, bool RMS>
at::Tensor launch_bwd(const Tdy* dy, const Tin* x, const void* w, bool p_f32, const float* mean, const float* rstd,
                      Tin* dx, int64_t rows, int H, bool want_ws, const at::TensorOptions& fopts,
                      cudaStream_t stream) {
  constexpr int NACC = RMS ? 1 : 2;
  constexpr int V = 16 / sizeof(Tin);
  (void)has_clusters();  // a malformed PIPEGOOSE_NORM_CLUSTERS is an error on every backward, before any launch
  // The register plan of vector rows takes the asynchronous-copy kernel (norm_bwd_async_kernel), and the wide rows the
  // cluster kernel (norm_bwd_cluster_kernel), when x and dy have the same element size; -DPIPEGOOSE_NORM_BWD_SYNC (a
  // benchmark experiment, off in the shipped build) keeps norm_bwd_kernel there, and the wide rows on their plans
  // before session 13.
#if defined(PIPEGOOSE_NORM_BWD_SYNC)
  constexpr bool kAsyncBwd = false;
#else
  constexpr bool kAsyncBwd = sizeof(Tdy) == sizeof(Tin);
#endif
  const int pbytes = V * (p_f32 ? 4 : static_cast<int>(sizeof(Tin)));
  bool vec = H % V == 0 && aligned(x, 16) && aligned(dx, 16) && aligned(dy, V * sizeof(Tdy));
  if (w != nullptr) vec = vec && aligned(w, pbytes);
  Cfg cfg = bwd_plan<V, RMS, kAsyncBwd>(vec ? H / V : H, vec);
#if defined(PIPEGOOSE_NORM_BWD_EXPERIMENT)
  // Benchmark experiment (off in the shipped build; norm_raw --bwd-wide): PIPEGOOSE_NORM_BWD_EXP=wide sends every
  // vector row to the two-kernel path.
  const char* bx = std::getenv("PIPEGOOSE_NORM_BWD_EXP");
  const bool exp_wide = bx != nullptr && std::string(bx) == "wide" && vec;  // the two-kernel path, never a cluster
  if (exp_wide) cfg = Cfg{};
  // PIPEGOOSE_NORM_BWD_EXP=cluster sends every vector row that a cluster can hold to the cluster kernel.
  const bool exp_cluster = bx != nullptr && std::string(bx) == "cluster" && vec;
#else
  constexpr bool exp_wide = false;
  constexpr bool exp_cluster = false;
#endif
  // The four-chunk register plan keeps two stages of 512 x 4 chunks of x and dy (128 KB at the widest rows); on a GPU
  // with less shared memory (sm_86/sm_89: 99 KB) such rows take the shared-memory accumulator plan it replaced (as
  // before session 7), not the generic kernel.
  auto reg4_fits = [&](int tpr) {
    constexpr int kStages = AsyncBounds<512, false, 4>::stages;
    return bwd_async_stage_bytes(kStages, 1, 4, tpr, V, static_cast<int>(sizeof(Tin)), static_cast<int>(sizeof(Tdy))) <=
           smem_limit();
  };
  // The wide register rows (bwd_plan: 16-bit RMSNorm, 9224-11264 columns, where no cluster runs: cl_min below) need
  // their four stages and the weight cache (220 KB at 11264 columns); where they do not fit, the plan without them
  // (bwd_plan<..., false>: the four-chunk register plan, checked next).
  // The weight cache's bytes (stage_weight: H floats, rounded up to a multiple of four).
  const size_t psmem = sizeof(float) * static_cast<size_t>((H + 3) & ~3);
  if (vec && cfg.nv == 2 && cfg.tpr > 512) {
    constexpr int kS = AsyncBounds<kWideRegTpb, false>::stages;
    const size_t need = bwd_async_stage_bytes(kS, 1, 2, cfg.tpr, V, static_cast<int>(sizeof(Tin)),
                                              static_cast<int>(sizeof(Tdy))) +
                        (w != nullptr ? psmem : 0);
    if (need > smem_limit()) cfg = bwd_plan<V, RMS, kAsyncBwd, false>(H / V, vec);
  }
  if (vec && cfg.nv == 4 && !cfg.acc_smem && !reg4_fits(cfg.tpr)) cfg.acc_smem = true;
  at::Tensor ws;
  const int sms = sm_count();
  if constexpr (kAsyncBwd) {
    // Vector rows from 8200 columns (16-bit RMSNorm: 9224, fp32 RMSNorm: 16384; sessions 32-36, below) run a cluster
    // per row on sm_90 and newer (norm_bwd_cluster_kernel), in place of the two-kernel path past the register plans and
    // of the register and shared-memory plans from there; before session 32, from 12288 columns. Raw backward against
    // those plans (H200, session 14, call 3, % of copy):
    // at 12288 columns LayerNorm bf16 46.0 -> 75.8, fp32 84.1 -> 93.1, RMSNorm bf16 71.9 -> 82.5; at 16384 RMSNorm
    // bf16 84.0 -> 94.0 and fp32 99.1 -> 101.9; at 8192 and below, and for fp32 RMSNorm at 12288 (100.2 -> 94.2), the
    // cluster lost, and rows of 8200-12280 columns (fp32: 8196-12284) were not timed.
    // -DPIPEGOOSE_NORM_BWD_NO_CLUSTER (a benchmark experiment, off in the shipped build) keeps every row on the plans
    // before session 13.
#if defined(PIPEGOOSE_NORM_BWD_NO_CLUSTER)
    constexpr bool kCluster = false;
#else
    constexpr bool kCluster = true;
#endif
    // Session 32 (call 3, raw backward, 16384 rows, % of copy; session32.log) timed the rows of 8200-12280 columns
    // that session 14 had not, shipped plan -> cluster, 8704 / 9216 / 10240 / 11264 columns: LayerNorm bf16 34.0 /
    // 35.5 / 38.4 / 41.7 -> 60.4 / 62.8 / 67.7 / 72.7, fp32 72.3 / 75.5 / 80.5 / 84.8 -> 80.4 / 82.5 / 86.8 / 90.3;
    // RMSNorm bf16 85.4 / 85.8 / 64.7 / 70.1 -> 67.1 / 68.6 / 73.3 / 78.5 (by our arithmetic, not profiled: its
    // four-chunk plan's stages and weight cache fit two blocks per SM up to 9216 columns, one beyond), fp32 89.4-99.1
    // -> 82.0-91.0. So the cluster runs LayerNorm rows from 8200 columns, 16-bit RMSNorm rows from 9224, fp32 RMSNorm
    // rows from 16384. Sessions 33-36 ran 16-bit RMSNorm rows of 9224-11264 columns on bwd_plan's wide register rows;
    // session 36's cluster kernel (slab-sized blocks, the deferred mbarrier wait) beat them there (call 2, raw
    // backward, bf16, 16384 rows, % of copy, two rounds; session36.log): 9224 / 10000 / 10240 / 11264 columns 72.5 /
    // 79.5 / 81.2 / 81.9 -> 79.2 / 84.2 / 89.7 / 93.4, so since session 37 the cluster takes them again (session37.log,
    // call 1: 79.9 / 84.8 / 89.6 / 93.6; the wide register rows stay where no cluster runs). In session 36's call 2,
    // the cluster from 6144 columns (-DPIPEGOOSE_NORM_BWD_CLUSTER_MIN=6144) lost at 6144 / 7168 / 8192 columns to the
    // register plans: bf16 LayerNorm 90.4 / 91.2 / 89.9 -> 63.0 / 71.7 / 78.3, RMSNorm 89.4 / 92.7 / 97.3 -> 69.5 /
    // 78.6 / 84.7, fp32 LayerNorm 90.2 / 96.5 / 97.6 -> 84.3 / 90.8 / 95.0.
    // -DPIPEGOOSE_NORM_BWD_CLUSTER_MIN=H (a benchmark experiment, off in the shipped build): from H columns for every
    // op and dtype but fp32 RMSNorm (16384, as shipped).
#if defined(PIPEGOOSE_NORM_BWD_CLUSTER_MIN)
    const int cl_min = RMS && V == 4 ? 16384 : PIPEGOOSE_NORM_BWD_CLUSTER_MIN;
#else
    const int cl_min = !RMS ? 8200 : V == 4 ? 16384 : kWideRegMinH;
#endif
    const bool wide = cfg.nv == 0 || H >= cl_min || exp_cluster;
    int cl = kCluster && vec && wide && !exp_wide && has_clusters() ? bwd_cluster_size(H / V, V) : 0;
#if defined(PIPEGOOSE_NORM_BWD_EXPERIMENT)
    // PIPEGOOSE_NORM_BWD_CL_SIZE=N (benchmark experiment): clusters of N blocks (2 to 8, any N, fewer than
    // bwd_cluster_size's too) where each block of N holds its slab of the row.
    if (const char* v = std::getenv("PIPEGOOSE_NORM_BWD_CL_SIZE"); v != nullptr && cl > 0) {
      const int n = std::atoi(v);
      if (n >= 2 && n <= kClMaxCluster && ceil_div(H / V, n) <= kClThreads * kClValues / V) cl = n;
    }
#endif
    if (cl > 0 && launch_bwd_cluster<Tin, Tdy, RMS>(dy, x, w, p_f32, mean, rstd, dx, rows, H, cl, want_ws, fopts,
                                                     stream, ws)) {
      return ws;
    }
  }
  if (cfg.nv == 0 && vec) {
    // Wide vector rows: the two-kernel path (norm_bwd_rowstats_kernel, norm_bwd_cols_kernel).
    auto stats = at::empty({std::max<int64_t>(rows, 1), 2}, fopts);
    auto k1 = &norm_bwd_rowstats_kernel<Tin, Tdy, V, RMS>;
    const int occ1 = occupancy(reinterpret_cast<const void*>(k1), kStatThreads, 0);
    const int64_t g1 = std::max<int64_t>(1, std::min<int64_t>(rows, static_cast<int64_t>(sms) * occ1));
    k1<<<static_cast<unsigned>(g1), kStatThreads, 0, stream>>>(dy, x, w, p_f32, mean, rstd,
                                                               reinterpret_cast<float2*>(stats.data_ptr<float>()),
                                                               rows, H);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    auto k2 = &norm_bwd_cols_kernel<Tin, Tdy, V, RMS>;
    const int occ2 = occupancy(reinterpret_cast<const void*>(k2), kColThreads, 0);
    const int64_t gx = ceil_div(H / V, kColThreads);
    // Row parts: about two waves of blocks in all, at least kColRows rows each (gridDim.y <= 65535).
    const int64_t want = std::max<int64_t>(1, ceil_div(2LL * sms * occ2, gx));
    const int64_t rpp = std::max<int64_t>(kColRows, ceil_div(rows, std::min<int64_t>(want, 65535)));
    const int64_t P = std::max<int64_t>(1, ceil_div(rows, rpp));
    if (want_ws) ws = at::empty({NACC, P, H}, fopts);
    k2<<<dim3(static_cast<unsigned>(gx), static_cast<unsigned>(P)), kColThreads, 0, stream>>>(
        dy, x, w, p_f32, mean, rstd, reinterpret_cast<const float2*>(stats.data_ptr<float>()), dx,
        want_ws ? ws.data_ptr<float>() : nullptr, rows, H, rpp);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return ws;
  }
  // The generic kernel: no shared memory beyond the static; also the fallback of a plan whose shared memory does not
  // fit this device (smem_limit).
  auto run_generic = [&] {
    const int threads = 1024;
    const int occ = occupancy(reinterpret_cast<const void*>(&norm_bwd_generic_kernel<Tin, Tdy, RMS>), threads, 0);
    const int64_t P = std::max<int64_t>(1, std::min<int64_t>(rows, static_cast<int64_t>(sms) * occ));
    if (want_ws) ws = at::empty({NACC, P, H}, fopts);
    norm_bwd_generic_kernel<Tin, Tdy, RMS><<<static_cast<unsigned>(P), threads, 0, stream>>>(
        dy, x, w, p_f32, mean, rstd, dx, want_ws ? ws.data_ptr<float>() : nullptr, rows, H);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (cfg.nv == 0) {
    run_generic();
    return ws;
  }
  // Packed rows (pack_tpb) fill blocks of 512 or 1024 threads; the specialised sizes (try_spec below) have their own
  // choice.
  bool spec_h = false;
#if defined(PIPEGOOSE_NORM_HIDDEN)
  spec_h = spec_h || H == kSpecHidden;
#endif
  spec_h = spec_h || has_size(BwdSpecHidden{}, H) || has_size(BwdSpecExtra<Tin, Tdy, RMS>{}, H);
  const int ptpb = kAsyncBwd && vec && cfg.nv == 2 && !cfg.acc_smem ? pack_tpb(V, RMS, cfg.tpr, spec_h) : 0;
  const int rpb = cfg.acc_smem ? 1 : ptpb != 0 ? ptpb / cfg.tpr : rows_per_block(cfg.tpr);
  const int threads = rpb * cfg.tpr;
  auto go = [&](auto nv_c, auto vec_c, auto smem_c, auto pf_c, auto h_c) {
    constexpr int NV = decltype(nv_c)::value;
    constexpr int VEC = decltype(vec_c)::value;
    constexpr bool ACC = decltype(smem_c)::value != 0;
    constexpr bool PF = decltype(pf_c)::value != 0;
    constexpr int HC = decltype(h_c)::value;
    constexpr bool ASYNC = kAsyncBwd && !ACC && VEC > 1;
    size_t smem = 0;
    if (ACC) smem = sizeof(float) * NACC * (NV * VEC + 1) * static_cast<size_t>(cfg.tpr);
    else if (rpb > 1) smem = sizeof(float) * static_cast<size_t>(rpb) * H;
    // The weight cache (stage_weight) in front of it, when there is a weight and it fits, except for the
    // LayerNorm's shared-memory accumulator plans of 16-bit inputs: there it cost 2-7% (bf16 8192 and 16384
    // columns, H200, session 4 A/B), where RMSNorm gained 5-17%.
    const bool pcache = w != nullptr && psmem <= kParamCacheBytes && !(!RMS && ACC && sizeof(Tin) == 2);
    // Launches kernel with smem_k bytes of dynamic shared memory, plus the weight cache when it fits too; a plan
    // that does not fit this device's shared memory at all runs the generic kernel.
    // need_pc: the kernel always reads the weight cache (bwd_async_pcache), so it runs only with it.
    auto launch = [&](auto kernel, size_t smem_k, bool need_pc = false) {
      const size_t limit = smem_limit();
      if (smem_k + (need_pc ? psmem : 0) > limit) {
        run_generic();
        return;
      }
      const bool pc = need_pc || (pcache && smem_k + psmem <= limit);
      if (pc) smem_k += psmem;
      allow_smem(reinterpret_cast<const void*>(kernel), smem_k);
      const int occ = occupancy(reinterpret_cast<const void*>(kernel), threads, smem_k);
      // Measured and dropped (session 34, call 2; session34.log): as few blocks as take the same number of row steps
      // (16384 rows of two per block: 256 blocks of 32 steps, not 264 of 31-32): -2.3 to +1.2 points of copy at the
      // sweep's 512-8192 columns (bf16 RMSNorm 4096: 89.0 -> 86.7, bf16 LayerNorm 512: 86.5 -> 87.7). The last,
      // partial step costs little: bf16 LayerNorm 4096 columns over 16368 / 16384 / 16896 rows (31, 31.03, 32 steps
      // of 264 blocks) ran 87.3 / 87.0 / 87.3% of copy.
      const int64_t P = std::max<int64_t>(1, std::min<int64_t>(ceil_div(rows, rpb), static_cast<int64_t>(sms) * occ));
      if (want_ws) ws = at::empty({NACC, P, H}, fopts);
      kernel<<<static_cast<unsigned>(P), threads, smem_k, stream>>>(
          dy, x, w, p_f32, mean, rstd, dx, want_ws ? ws.data_ptr<float>() : nullptr, rows, H, cfg.tpr, pc);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if constexpr (ASYNC) {
      // Stages and blocks per SM: AsyncBounds. The stage area also holds the end's combine of the row groups
      // (rpb * H floats).
      const size_t combine = rpb > 1 ? sizeof(float) * static_cast<size_t>(rpb) * H : 0;
      auto async = [&](auto tpb_c, auto tprc_c) {
        constexpr int TPB = decltype(tpb_c)::value;
        constexpr int TPRC = decltype(tprc_c)::value;
        constexpr int S = AsyncBounds<TPB, (HC != 0 || TPRC != 0) && sizeof(Tin) == 2>::stages;
        const size_t stage = bwd_async_stage_bytes(S, rpb, NV, cfg.tpr, VEC, static_cast<int>(sizeof(Tin)),
                                                   static_cast<int>(sizeof(Tdy)));
        launch(&norm_bwd_async_kernel<Tin, Tdy, VEC, NV, RMS, HC, TPB, TPRC>, std::max(stage, combine),
               bwd_async_pcache(RMS, sizeof(Tin), HC, TPRC));
      };
      // Rows of two chunks per thread without a specialised kernel (HC == 0) whose tprc_mode is kFixed or kPacked run
      // the kernel compiled for their threads per row (TPRC; true if so): kFixed rows of 32-256 threads in blocks of
      // 256 and of 288-512 in blocks of 512, kPacked rows in pack_tpb's blocks. Only the kernels of those modes are
      // instantiated.
      auto fixed_tpr = [&](auto tpb_c) -> bool {
        constexpr int TPB = decltype(tpb_c)::value;
        static_assert(TPB == 256 || TPB == 512 || TPB == 1024, "fixed_tpr: blocks of 256, 512 or 1024 threads");
        bool done = false;
        if constexpr (HC == 0 && NV == 2) {
          auto one = [&](auto t_c) {
            constexpr int T = decltype(t_c)::value;
            constexpr Tprc mode = tprc_mode(VEC, RMS, T);
            constexpr Tprc want = TPB == 256 || (TPB == 512 && T > 256) ? Tprc::kFixed : Tprc::kPacked;
            constexpr bool fits = T <= TPB && (want == Tprc::kFixed || TPB == pack_tpb(VEC, RMS, T, false));
            if constexpr (fits && mode == want) {
              if (done || cfg.tpr != T) return;
              PG_CHECK(threads == TPB / T * T, "pipegoose norm backward: internal error: ", threads, " threads for ",
                       T, " per row in blocks of ", TPB);
              async(tpb_c, t_c);
              done = true;
            }
          };
          // every multiple of 32 up to 512 that fits the block; `one` instantiates only the kernels of the modes
          [&](auto... t_c) { (one(t_c), ...); }(IC<32>{}, IC<64>{}, IC<96>{}, IC<128>{}, IC<160>{}, IC<192>{},
                                                IC<224>{}, IC<256>{}, IC<288>{}, IC<320>{}, IC<352>{}, IC<384>{},
                                                IC<416>{}, IC<448>{}, IC<480>{}, IC<512>{});
        }
        return done;
      };
      PG_CHECK(threads <= (cfg.tpr > 512 ? kWideRegTpb : kMaxPackTpb) && (cfg.tpr <= 32 || rpb <= 15),
               "pipegoose norm backward: internal error: ", rpb,
               " rows of ", cfg.tpr, " threads per block for the register plan (named barriers 1-15)");
      constexpr int kSpecTpr = HC == 0 ? 0 : FixedRow<HC, VEC, NV, false>::tpr;
      if (cfg.tpr > 512) {
        // bwd_plan's wide register rows (16-bit RMSNorm, 577-704 threads of two chunks): one row per block of
        // kWideRegTpb.
        if constexpr (RMS && NV == 2 && VEC == 8 && (HC == 0 || kSpecTpr > 512)) {
          PG_CHECK(threads == cfg.tpr && cfg.tpr <= kWideRegTpb, "pipegoose norm backward: internal error: ", threads,
                   " threads for ", H, " columns");
          async(IC<kWideRegTpb>{}, IC<0>{});
        } else {
          PG_CHECK(false, "pipegoose norm backward: internal error: ", cfg.tpr, " threads per row for ", H, " columns");
        }
      } else if (threads > 512) {
        if constexpr (kMaxPackTpb == 1024 && NV == 2) {
          if constexpr (HC == 0) {
            PG_CHECK(fixed_tpr(IC<1024>{}), "pipegoose norm backward: internal error: no kernel for ", cfg.tpr,
                     " threads per row in blocks of 1024");
          } else if constexpr (pack_tpb(VEC, RMS, kSpecTpr, true) == 1024) {
            async(IC<1024>{}, IC<0>{});
          } else {
            PG_CHECK(false, "pipegoose norm backward: internal error: ", threads, " threads for ", H, " columns");
          }
        } else {
          PG_CHECK(false, "pipegoose norm backward: internal error: ", threads, " threads for ", H, " columns");
        }
      } else if (threads > 256) {
        // (A specialised kernel of two chunks per thread whose rows pack_tpb packs into blocks of 1024 never runs
        // in blocks of 512: not instantiated.)
        if constexpr (HC == 0 ||
                      (kSpecTpr > 256 && kSpecTpr <= 512 && !(NV == 2 && pack_tpb(VEC, RMS, kSpecTpr, true) == 1024)) ||
                      (NV == 2 && pack_tpb(VEC, RMS, kSpecTpr, true) == 512)) {
          if (!fixed_tpr(IC<512>{})) async(IC<512>{}, IC<0>{});
        } else {
          PG_CHECK(false, "pipegoose norm backward: internal error: ", threads, " threads for ", H, " columns");
        }
      } else {
        // (Four chunks per thread only past 512 threads of two: never in blocks of 256.)
        if constexpr (NV == 2 && (HC == 0 || (kSpecTpr <= 256 && pack_tpb(VEC, RMS, kSpecTpr, true) == 0))) {
          if (!fixed_tpr(IC<256>{})) async(IC<256>{}, IC<0>{});
        } else {
          PG_CHECK(false, "pipegoose norm backward: internal error: ", threads, " threads for ", H, " columns");
        }
      }
    } else {
      PG_CHECK(ACC || threads <= 256, "pipegoose norm backward: internal error: ", threads,
               " threads for the register plan");
      launch(&norm_bwd_kernel<Tin, Tdy, VEC, NV, RMS, ACC, PF, HC>, smem);
    }
  };
  // Specialised kernels (H == HC on the vector path; the plan is cfg's, evaluated at compile time): the shipped
  // backward sizes BwdSpecHidden and BwdSpecExtra, and the PIPEGOOSE_NORM_HIDDEN experiment's size.
  auto try_spec = [&](auto h_c) -> bool {
    constexpr int HC = decltype(h_c)::value;
    constexpr Cfg spec = bwd_plan<V, RMS, kAsyncBwd>(HC / V, true);
    if constexpr (HC % V == 0 && spec.nv != 0) {
      if (vec && H == HC && !(spec.nv == 4 && !spec.acc_smem && !reg4_fits(spec.tpr)) && cfg.nv == spec.nv &&
          cfg.tpr == spec.tpr) {
        static_assert(spec.tpr == FixedRow<HC, V, spec.nv, spec.acc_smem>::tpr, "FixedRow: the plan's tpr");
        if constexpr (!spec.acc_smem) {
          static_assert((spec.nv == 2 || (spec.nv == 4 && kAsyncBwd)) && spec.pf, "bwd_plan: register plan");
          go(IC<spec.nv>{}, IC<V>{}, IC<0>{}, IC<1>{}, IC<HC>{});
        } else if constexpr (spec.pf) {
          static_assert(spec.nv == 4, "bwd_plan: shared-memory plan with prefetch");
          go(IC<4>{}, IC<V>{}, IC<1>{}, IC<sizeof(Tdy) == sizeof(Tin) ? 1 : 0>{}, IC<HC>{});
        } else {
          static_assert(spec.nv == 32 / V && 32 / V > 4, "bwd_plan: wide shared-memory plan");
          go(IC<32 / V>{}, IC<V>{}, IC<1>{}, IC<0>{}, IC<HC>{});
        }
        return true;
      }
    }
    return false;
  };
#if defined(PIPEGOOSE_NORM_HIDDEN)
  if (try_spec(IC<kSpecHidden>{})) return ws;
#endif
  if (any_size(BwdSpecHidden{}, try_spec) || any_size(BwdSpecExtra<Tin, Tdy, RMS>{}, try_spec)) return ws;
  if (!vec) {
    if (cfg.acc_smem) go(IC<4>{}, IC<1>{}, IC<1>{}, IC<1>{}, IC<0>{});
    else go(IC<4>{}, IC<1>{}, IC<0>{}, IC<1>{}, IC<0>{});
  } else if (!cfg.acc_smem) {
    if constexpr (kAsyncBwd && (V == 4 || RMS)) {
      if (cfg.nv == 4) {
        go(IC<4>{}, IC<V>{}, IC<0>{}, IC<1>{}, IC<0>{});
        return ws;
      }
    }
    go(IC<2>{}, IC<V>{}, IC<0>{}, IC<1>{}, IC<0>{});
  } else if (cfg.pf) {
    // fp32 dy with a 16-bit input: two rows of fp32 dy do not fit the 128 registers, so no prefetch there.
    go(IC<4>{}, IC<V>{}, IC<1>{}, IC<sizeof(Tdy) == sizeof(Tin) ? 1 : 0>{}, IC<0>{});
  } else {
    if constexpr (32 / V > 4) go(IC<32 / V>{}, IC<V>{}, IC<1>{}, IC<0>{}, IC<0>{});
  }
  return ws;
}

// Column sums of the workspace into the parameter gradients (either output may be null): 16 lanes of four loads in
// flight. ncu (session 6, [16384, 4096] bf16 LayerNorm, 528 partial rows) measured this at 9.5 us, 1.83 TB/s, 26%
// occupancy: 128 blocks with too few bytes in flight. 32 lanes of eight loads were no faster in the whole backward
// (session 7 A/B: 0-1.7 points of copy slower at 18 of 20 shapes; see
// benchmarks/results/nvidia_h200_2026-11-30/SUMMARY.md).
// On sm_90 and newer it is a programmatic dependent launch: its blocks are launched while the backward kernel before
// it in the stream finishes, and wait for it in the kernel (griddepcontrol.wait) instead of behind the launch. Raw
// backward +0.2 to +1.7 points of copy (mean of two rounds) at 512-8192 columns in session 15's call 4 (H200).
// Tried and dropped in session 15 (benchmarks/results/nvidia_h200_2026-11-30/session15.log): the register plans'
// blocks adding their column sums across a cluster of 2, 4 or 8 before the workspace (fewer partial rows, but fewer
// resident blocks: up to 4.9 points slower), and the row kernel summing its own workspace after a grid barrier in a
// cooperative launch (no second kernel; LayerNorm 0.2-5.7 points slower). Session 18 (call 4): 16-byte loads, blocks of
// 8 x 64 threads over 32 columns each holding a float4 per partial row (four times the bytes in flight): within 0.6
// points at 576-4096 columns; from 5120 slower by 1.0-3.5 in 16-bit (bf16 32768: 67.9 -> 65.1), 0.4-2.5 in fp32.
// Session 39 (call 1; benchmarks/results/nvidia_h200_2026-11-30/session39.log): each 32-column tile split over a
// cluster of up to 8 blocks (about four blocks per SM; block 0 adds the others' sums, pushed into its shared memory,
// in rank order), still a programmatic dependent launch: -0.0 to +0.9 at 64-512 and 65536 columns, slower at
// 1024-16384 (bf16 LayerNorm / RMSNorm 4096: 86.3 / 87.1 -> 82.6 / 83.2; 8192 x 8192: 81.7 / 89.7 -> 76.6 / 84.1; fp32
// -0.1 to -3.1).
template <typename TA, typename TB>
void launch_col_reduce(const at::Tensor& ws, int H, TA* out_a, TB* out_b, cudaStream_t stream) {
  constexpr int kLanes = 16, kIlp = 4;
  const int64_t P = ws.size(1);
  const dim3 block(32, kLanes);
  const int64_t grid = ceil_div(H, 32);
  auto kernel = &norm_col_reduce_kernel<TA, TB, kLanes, kIlp>;
  bool pdl = has_clusters();
#if defined(PIPEGOOSE_NORM_BWD_EXPERIMENT)
  // PIPEGOOSE_NORM_BWD_PDL=0 (benchmark experiment, off in the shipped build): an ordinary launch.
  if (const char* v = std::getenv("PIPEGOOSE_NORM_BWD_PDL")) pdl = pdl && std::string(v) != "0";
#endif
  if (pdl) {
    cudaLaunchConfig_t config = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    config.gridDim = dim3(static_cast<unsigned>(grid), 1, 1);
    config.blockDim = block;
    config.dynamicSmemBytes = 0;
    config.stream = stream;
    config.attrs = attr;
    config.numAttrs = 1;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, static_cast<const float*>(ws.data_ptr<float>()), P, H, out_a,
                                      out_b));
    return;
  }
  kernel<<<static_cast<unsigned>(grid), block, 0, stream>>>(ws.data_ptr<float>(), P, H, out_a, out_b);
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
    default: PG_CHECK(false, "pipegoose norm: unsupported dtype ", t);
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
  PG_CHECK(t.defined(), op, ": ", name, ": expected a tensor, got None");
  PG_CHECK(t.is_cuda(), op, ": ", name, ": expected a CUDA tensor, got device ", t.device());
  PG_CHECK(is_float_type(t.scalar_type()), op, ": ", name,
              ": expected dtype float32, float16 or bfloat16, got ", t.scalar_type());
  PG_CHECK(t.dim() >= 1, op, ": ", name, ": expected at least one dimension [..., H], got a 0-d tensor");
  PG_CHECK(t.size(-1) >= 1, op, ": ", name, ": expected a last dimension H >= 1, got shape ", t.sizes());
  PG_CHECK(t.size(-1) <= std::numeric_limits<int>::max(), op, ": ", name,
              ": expected a last dimension H < 2^31, got ", t.size(-1));
}

inline void check_param(const char* op, const char* name, const at::Tensor& p, const at::Tensor& input) {
  PG_CHECK(p.is_cuda() && p.device() == input.device(), op, ": ", name,
              ": expected a CUDA tensor on the input's device ", input.device(), ", got ", p.device());
  PG_CHECK(is_float_type(p.scalar_type()), op, ": ", name,
              ": expected dtype float32, float16 or bfloat16, got ", p.scalar_type());
  PG_CHECK(p.numel() == input.size(-1), op, ": ", name, ": expected H = ", input.size(-1),
              " elements (the input's last dimension), got shape ", p.sizes());
}

inline void check_stat(const char* op, const char* name, const at::Tensor& s, const at::Tensor& input,
                       int64_t rows) {
  PG_CHECK(s.defined(), op, ": ", name, ": expected a tensor, got None");
  PG_CHECK(s.is_cuda() && s.device() == input.device(), op, ": ", name,
              ": expected a CUDA tensor on the input's device ", input.device(), ", got ", s.device());
  PG_CHECK(s.scalar_type() == at::kFloat, op, ": ", name, ": expected dtype float32, got ", s.scalar_type());
  PG_CHECK(s.numel() == rows, op, ": ", name, ": expected ", rows,
              " elements (one per row of the input), got shape ", s.sizes());
}

// The dtype the kernels read a parameter in: the input's dtype when it matches, float32 otherwise.
inline at::ScalarType param_compute_dtype(const at::Tensor& weight, const at::Tensor& bias, at::ScalarType in) {
  const at::Tensor& p = weight.defined() ? weight : bias;
  if (!p.defined()) return in;
  return p.scalar_type() == in ? in : at::kFloat;
}

// t as one dimension: itself when it has one (an aten::reshape costs ~1.5 us of host time per call, and a norm
// layer calls these five times per forward + backward).
inline at::Tensor flat(const at::Tensor& t) { return t.dim() == 1 ? t : t.reshape({-1}); }

inline at::Tensor param_as(const at::Tensor& p, at::ScalarType t) {
  if (!p.defined()) return p;
  return flat(p).to(t).contiguous();
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
  PG_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": eps: expected a finite value >= 0, got ", eps);
  const at::ScalarType out_t = out_dtype.has_value() ? *out_dtype : input_.scalar_type();
  PG_CHECK(is_float_type(out_t), op, ": out_dtype: expected float32, float16 or bfloat16, got ", out_t);

  c10::cuda::CUDAGuard guard(input_.device());
  const at::Tensor input = input_.contiguous();
  const int H = static_cast<int>(input.size(-1));
  const int64_t rows = input.numel() / H;
  const at::ScalarType in_t = input.scalar_type();
  // Output types computed directly: the input's or float32; any other out_dtype is rounded from float32.
  const at::ScalarType y_t = (out_t == in_t || out_t == at::kFloat) ? out_t : at::kFloat;
  // The kernels read the parameters in the input's dtype or float32; a float32 output of a 16-bit input reads them
  // in float32 (converted first when they are 16-bit), which spares that rare case its own kernels.
  const at::ScalarType p_t = y_t != in_t ? at::kFloat : param_compute_dtype(weight_, bias_, in_t);
  const at::Tensor weight = param_as(weight_, p_t);
  const at::Tensor bias = param_as(bias_, p_t);
  const auto fopts = input.options().dtype(at::kFloat);

  FwdResult r;
  r.out = at::empty(input_.sizes(), input.options().dtype(y_t));
  r.mean = RMS ? at::Tensor() : at::empty({rows}, fopts);
  r.rstd = at::empty({rows}, fopts);
  if (rows > 0) {
    cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    dispatch_float(in_t, [&](auto tin) {
      using Tin = typename decltype(tin)::type;
      auto with = [&](auto to, auto tp) {
        using Tout = typename decltype(to)::type;
        using Tp = typename decltype(tp)::type;
        launch_fwd<Tin, Tout, Tp, RMS>(cptr<Tin>(input), cptr<Tp>(weight), RMS ? nullptr : cptr<Tp>(bias),
                                       mptr<Tout>(r.out), RMS ? nullptr : mptr<float>(r.mean), mptr<float>(r.rstd),
                                       rows, H, static_cast<float>(eps), stream);
      };
      if (y_t != in_t) {
        with(Tag<float>{}, Tag<float>{});
      } else if (p_t == at::kFloat) {
        with(Tag<Tin>{}, Tag<float>{});
      } else {
        with(Tag<Tin>{}, Tag<Tin>{});
      }
    });
  }
  if (y_t != out_t) r.out = r.out.to(out_t);
  return r;
}

struct BwdResult {
  at::Tensor grad_input, grad_weight, grad_bias;
};

// need_weight / need_bias: whether the parameter's gradient is computed (a frozen parameter's is not: its part of the
// column reduction is skipped, and with no gradient needed at all neither workspace nor reduction is used); one not
// computed is returned as an empty [0] tensor, as for a None parameter.
template <bool RMS>
BwdResult norm_backward(const char* op, const at::Tensor& grad_, const at::Tensor& input_, const at::Tensor& weight_,
                        const at::Tensor& bias_, const at::Tensor& mean_, const at::Tensor& rstd_,
                        bool need_weight = true, bool need_bias = true) {
  check_input(op, "input", input_);
  check_input(op, "grad_output", grad_);
  PG_CHECK(grad_.device() == input_.device(), op, ": grad_output: expected the input's device ", input_.device(),
              ", got ", grad_.device());
  PG_CHECK(grad_.sizes() == input_.sizes(), op, ": grad_output: expected the input's shape ", input_.sizes(),
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
  const at::Tensor mean = RMS ? at::Tensor() : flat(mean_).contiguous();
  const at::Tensor rstd = flat(rstd_).contiguous();
  const auto fopts = input.options().dtype(at::kFloat);

  BwdResult r;
  r.grad_input = at::empty(input_.sizes(), input.options());
  const bool want_w = weight_.defined() && need_weight;
  const bool want_b = !RMS && bias_.defined() && need_bias;
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
