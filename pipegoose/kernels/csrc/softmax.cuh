// Private header of pipegoose's fused softmax (pipegoose/kernels/csrc/softmax.cu): kernels, launch plans and
// the per-dtype launch functions. See softmax.cu for the layout of the work.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>

#include "pipegoose_async.cuh"

namespace pipegoose {
namespace softmax_detail {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// ------------------------------------------------------------------------------------------------------------
// Shape specialisation switch: a benchmark experiment (issue #6), used by benchmarks/build_cost.py --specialise;
// the generic build, without the macro, is what ships.
// -DPIPEGOOSE_SOFTMAX_KEYS=K0 (K0 > 0, a multiple of 8) adds, per dtype, the forward and backward
// register-resident kernels of K0's plans (the forward with and without mask words, kFwdNoMask; the backward's
// causal and non-causal plans where they differ, kBwdMidVecs) in which the key length (row length) is the
// compile-time constant K0: template argument
// KC = K0 of the register-resident kernels (KC = 0: the length is read at run time, as in the generic build). Folded
// there: which of a thread's vectors exist (and that they are whole), the bounds of the stores, the clamp of the
// causal bound and the output row offsets. run() takes them for the calls with sk == K0 whose rows are on the vector
// path (FwdArgs / BwdArgs::fast), with the TPR / NV / BLOCK that the generic plan takes for K0 (reg_plan()); every
// other call (other sk, unaligned rows, the two-pass kernels) runs the generic kernels, unchanged. One build per
// shape; the value is required: a bare -DPIPEGOOSE_SOFTMAX_KEYS (= 1) fails the static_assert below. Without the
// macro no KC > 0 kernel is instantiated.
#if defined(PIPEGOOSE_SOFTMAX_KEYS)
constexpr long long kSpecKeysValue = (PIPEGOOSE_SOFTMAX_KEYS);
static_assert(kSpecKeysValue > 0 && kSpecKeysValue % 8 == 0 && kSpecKeysValue <= std::numeric_limits<int32_t>::max(),
              "PIPEGOOSE_SOFTMAX_KEYS must be the key length to specialise for: a positive multiple of 8 (e.g. 2048)");
constexpr int kSpecKeys = static_cast<int>(kSpecKeysValue);
#endif

// ------------------------------------------------------------------------------------------------------------
// Element traits: 16-byte vector <-> fp32 values.

template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static constexpr int kVec = 4;
  __device__ __forceinline__ static void unpack(const uint4& r, float (&f)[4]) {
    f[0] = __uint_as_float(r.x);
    f[1] = __uint_as_float(r.y);
    f[2] = __uint_as_float(r.z);
    f[3] = __uint_as_float(r.w);
  }
  __device__ __forceinline__ static uint4 pack(const float (&f)[4]) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
  __device__ __forceinline__ static float load1(const float* p) { return *p; }
  __device__ __forceinline__ static void store1(float* p, float v) { *p = v; }
};

template <>
struct Elem<__half> {
  static constexpr int kVec = 8;
  __device__ __forceinline__ static float2 to2(uint32_t w) {
    __half2 h;
    *reinterpret_cast<uint32_t*>(&h) = w;
    return __half22float2(h);
  }
  __device__ __forceinline__ static uint32_t from2(float a, float b) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  __device__ __forceinline__ static void unpack(const uint4& r, float (&f)[8]) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 p = to2(w[i]);
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
  __device__ __forceinline__ static uint4 pack(const float (&f)[8]) {
    return make_uint4(from2(f[0], f[1]), from2(f[2], f[3]), from2(f[4], f[5]), from2(f[6], f[7]));
  }
  __device__ __forceinline__ static float load1(const __half* p) { return __half2float(*p); }
  __device__ __forceinline__ static void store1(__half* p, float v) { *p = __float2half_rn(v); }
};

template <>
struct Elem<__nv_bfloat16> {
  static constexpr int kVec = 8;
  __device__ __forceinline__ static float2 to2(uint32_t w) {
    // bf16 -> fp32 is a shift: the low half is element 0.
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
  __device__ __forceinline__ static uint32_t from2(float a, float b) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&h);
  }
  __device__ __forceinline__ static void unpack(const uint4& r, float (&f)[8]) {
    const uint32_t w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 p = to2(w[i]);
      f[2 * i] = p.x;
      f[2 * i + 1] = p.y;
    }
  }
  __device__ __forceinline__ static uint4 pack(const float (&f)[8]) {
    return make_uint4(from2(f[0], f[1]), from2(f[2], f[3]), from2(f[4], f[5]), from2(f[6], f[7]));
  }
  __device__ __forceinline__ static float load1(const __nv_bfloat16* p) { return __bfloat162float(*p); }
  __device__ __forceinline__ static void store1(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
};

// ------------------------------------------------------------------------------------------------------------
// Kernel arguments. Rows of a 4-D view [d0, d1, d2, sk]; a tensor's row r = (i0, i1, i2) starts at
// i0 * s0 + i1 * s1 + i2 * s2, or at r * flat when its rows are evenly spaced (flat >= 0).

struct RowStrides {
  int64_t s0, s1, s2, flat;
};

template <typename T>
struct FwdArgs {
  const T* x;
  const uint8_t* mask;  // bool bytes, nullptr when there is no mask
  T* y;                 // contiguous [rows, sk]
  int64_t rows, sk, d1, d2;
  RowStrides xs, ms;
  int64_t causal_shift;  // sk - sq: key j is visible to query i when j <= i + causal_shift
  float scale;           // user scale * log2(e): the kernels use exp2
  bool causal, x_vec, m_vec, y_vec, rows32;
  bool fast;     // x_vec && sk % V == 0 && (no mask || m_vec): every vector whole and aligned
  bool reverse;  // run the rows in reverse order (causal: longest rows first)
  bool heads_inner;  // the grid's slots walk the rows with d1 innermost (see heads_inner_takes)
};

template <typename T>
struct BwdArgs {
  const T* dy;
  const T* y;
  T* dx;  // contiguous [rows, sk]
  int64_t rows, sk, d1, d2;
  RowStrides gs, ys;
  int64_t causal_shift;
  float scale;
  bool causal, g_vec, y_vec, dx_vec, rows32;
  bool fast;     // g_vec && y_vec && sk % V == 0
  bool reverse;  // as FwdArgs::reverse
};

struct RowPos {
  int64_t i0, i1, i2;
};

__device__ __forceinline__ RowPos split_row(int64_t r, int64_t d1, int64_t d2, bool rows32) {
  RowPos p;
  if (rows32) {  // 32-bit division is much cheaper than the 64-bit routine
    const uint32_t rr = static_cast<uint32_t>(r), e1 = static_cast<uint32_t>(d1), e2 = static_cast<uint32_t>(d2);
    const uint32_t t = rr / e2;
    p.i2 = rr - t * e2;
    p.i0 = t / e1;
    p.i1 = t - static_cast<uint32_t>(p.i0) * e1;
  } else {
    const int64_t t = r / d2;
    p.i2 = r - t * d2;
    p.i0 = t / d1;
    p.i1 = t - p.i0 * d1;
  }
  return p;
}

__device__ __forceinline__ int64_t row_offset(const RowStrides& s, int64_t r, const RowPos& p) {
  return s.flat >= 0 ? r * s.flat : p.i0 * s.s0 + p.i1 * s.s1 + p.i2 * s.s2;
}

// Key length (row length) of the register-resident kernels' arguments: a.sk, or KC when it is a compile-time
// constant (KC > 0, see PIPEGOOSE_SOFTMAX_KEYS). Read where it is used, as a.sk was before KC existed.
template <int KC, typename Args>
__device__ __forceinline__ int64_t keys_of(const Args& a) {
  return KC > 0 ? int64_t{KC} : a.sk;
}

__device__ __forceinline__ int64_t causal_limit(bool causal, int64_t q, int64_t shift, int64_t sk) {
  if (!causal) return sk;
  const int64_t lim = q + shift + 1;
  return lim < 0 ? 0 : (lim > sk ? sk : lim);
}

// ------------------------------------------------------------------------------------------------------------
// Vector helpers. c0 is the first column of the vector; columns >= limit are masked (not read), columns >= sk
// do not exist.

template <int V>
__device__ __forceinline__ uint32_t load_mask_bits(const uint8_t* __restrict__ m, int64_t c0, int64_t sk,
                                                   int64_t limit, bool vec_ok) {
  uint32_t bits = 0;
  if (vec_ok && c0 + V <= sk) {
    if constexpr (V == 4) {
      const uint32_t w = *reinterpret_cast<const uint32_t*>(m + c0);
#pragma unroll
      for (int k = 0; k < 4; ++k) bits |= (((w >> (8 * k)) & 0xffu) != 0u) << k;
    } else {
      const uint2 w = *reinterpret_cast<const uint2*>(m + c0);
#pragma unroll
      for (int k = 0; k < 4; ++k) bits |= (((w.x >> (8 * k)) & 0xffu) != 0u) << k;
#pragma unroll
      for (int k = 0; k < 4; ++k) bits |= (((w.y >> (8 * k)) & 0xffu) != 0u) << (k + 4);
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (c0 + k < limit) bits |= (m[c0 + k] != 0) << k;
  }
  return bits;
}

// Scaled scores (in log2 units) of one vector; masked or invisible columns give -inf.
template <typename T>
__device__ __forceinline__ void load_scores(const T* __restrict__ x, const uint8_t* __restrict__ m, int64_t c0,
                                            int64_t sk, int64_t limit, bool x_vec, bool m_vec, float scale,
                                            float (&v)[Elem<T>::kVec]) {
  constexpr int V = Elem<T>::kVec;
  if (c0 < limit) {
    if (x_vec && c0 + V <= sk) {
      Elem<T>::unpack(*reinterpret_cast<const uint4*>(x + c0), v);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = (c0 + k < limit) ? Elem<T>::load1(x + c0 + k) : 0.f;
    }
    const uint32_t mb = m != nullptr ? load_mask_bits<V>(m, c0, sk, limit, m_vec) : 0u;
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = (c0 + k < limit && !((mb >> k) & 1u)) ? v[k] * scale : neg_inf();
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = neg_inf();
  }
}

// Raw vector of one tensor with the columns >= limit zeroed (and not read when the vector is partial), so that
// the backward's arithmetic needs no per-element bounds: a zero y gives a zero dx and adds nothing to the dot.
template <typename T>
__device__ __forceinline__ uint4 load_raw(const T* __restrict__ p, int64_t c0, int64_t sk, int64_t limit,
                                          bool vec_ok) {
  constexpr int V = Elem<T>::kVec;
  uint4 r = make_uint4(0u, 0u, 0u, 0u);
  if (c0 < limit) {
    const int64_t rem = limit - c0;
    T* e = reinterpret_cast<T*>(&r);
    if (vec_ok && c0 + V <= sk) {
      r = *reinterpret_cast<const uint4*>(p + c0);
      if (rem < V) {  // the causal boundary vector
#pragma unroll
        for (int k = 0; k < V; ++k)
          if (k >= rem) e[k] = T{};
      }
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k)
        if (k < rem) e[k] = p[c0 + k];
    }
  }
  return r;
}

template <typename T>
__device__ __forceinline__ void store_vals(T* __restrict__ y, int64_t c0, int64_t sk, bool vec_ok,
                                           const float (&v)[Elem<T>::kVec]) {
  constexpr int V = Elem<T>::kVec;
  if (c0 >= sk) return;
  if (vec_ok && c0 + V <= sk) {
    *reinterpret_cast<uint4*>(y + c0) = Elem<T>::pack(v);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (c0 + k < sk) Elem<T>::store1(y + c0 + k, v[k]);
  }
}

// ------------------------------------------------------------------------------------------------------------
// Reductions over the TPR threads of a row group, of one float, or of a float2 (two rows at once: the causal row
// pairs). For TPR > 32, `smem` holds (BLOCK / 32) values; the caller uses a different buffer for consecutive
// reductions (see the kernels for why that is race free).

__device__ __forceinline__ float shfl_xor(float v, int o) { return __shfl_xor_sync(0xffffffffu, v, o); }
__device__ __forceinline__ float2 shfl_xor(float2 v, int o) { return make_float2(shfl_xor(v.x, o), shfl_xor(v.y, o)); }
template <bool MAX>
__device__ __forceinline__ float combine(float a, float b) { return MAX ? fmaxf(a, b) : a + b; }
template <bool MAX>
__device__ __forceinline__ float2 combine(float2 a, float2 b) {
  return make_float2(combine<MAX>(a.x, b.x), combine<MAX>(a.y, b.y));
}

template <int TPR, bool MAX, typename F>
__device__ __forceinline__ F group_reduce(F v, F* smem) {
  constexpr int W = TPR < 32 ? TPR : 32;
#pragma unroll
  for (int o = W / 2; o > 0; o >>= 1) v = combine<MAX>(v, shfl_xor(v, o));
  if constexpr (TPR > 32) {
    constexpr int NW = TPR / 32;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int first = (threadIdx.x / TPR) * NW;  // first warp of this row group
    if (lane == 0) smem[warp] = v;
    __syncthreads();
    v = smem[first + lane % NW];  // every group of NW lanes holds all partials: all lanes end with the total
#pragma unroll
    for (int o = NW / 2; o > 0; o >>= 1) v = combine<MAX>(v, shfl_xor(v, o));
  }
  return v;
}

// ------------------------------------------------------------------------------------------------------------
// Load phase of the register-resident kernels. Every load of a row is issued before any loaded value is used
// (conversion, masking and the causal boundary are applied only after the last load), so each thread has all of
// its vectors in flight at once: one DRAM round trip per row instead of one per vector. (The previous layout
// converted each vector inside its load branch, which made the warp wait for vector i before issuing vector i+1.)
// FAST: 16-byte vectors allowed and sk % V == 0 (every vector is whole), so a load is one predicated instruction;
// otherwise the vector-or-scalar choice is made per vector.

// Cache hints measured and dropped (session 29, H200, benchmarks.softmax_raw, every op and length, bf16 and fp32, two
// alternating runs): the 16-byte loads as ld.global.nc.L1::no_allocate or ld.global.cs moved by -9.5 to +0.1 points
// (fp32 plain backward at 2048 keys 102.5 -> 93.0); st.global.cs on the causal zeros or on every store by -4.7 to +0.6
// (fp32 causal forward at 256 keys 92.9 -> 88.2). The compiler's loads (ld.global.nc) and plain stores stay.

// Raw vector at column c0; zeros (not read) when c0 >= limit. On the FAST path the causal boundary vector is read
// whole (its columns >= limit exist and are masked afterwards); on the general path only columns < limit are read.
template <typename T, bool FAST>
__device__ __forceinline__ uint4 load_vec(const T* __restrict__ p, int64_t c0, int64_t sk, int64_t limit,
                                          bool vec_ok) {
  constexpr int V = Elem<T>::kVec;
  uint4 r = make_uint4(0u, 0u, 0u, 0u);
  if (c0 < limit) {
    if (FAST || (vec_ok && c0 + V <= sk)) {
      r = *reinterpret_cast<const uint4*>(p + c0);
    } else {
      const int64_t rem = limit - c0;
      T* e = reinterpret_cast<T*>(&r);
#pragma unroll
      for (int k = 0; k < V; ++k)
        if (k < rem) e[k] = p[c0 + k];
    }
  }
  return r;
}

// Raw mask bytes of the vector at c0 (byte k of .x / .y = column c0 + k / c0 + 4 + k); zeros when c0 >= limit.
template <int V, bool FAST>
__device__ __forceinline__ uint2 load_mask_vec(const uint8_t* __restrict__ m, int64_t c0, int64_t sk,
                                               int64_t limit, bool vec_ok) {
  uint2 w = make_uint2(0u, 0u);
  if (c0 < limit) {
    if (FAST || (vec_ok && c0 + V <= sk)) {
      if constexpr (V == 8) {
        w = *reinterpret_cast<const uint2*>(m + c0);
      } else {
        w.x = *reinterpret_cast<const uint32_t*>(m + c0);
      }
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k)
        if (c0 + k < limit) {
          const uint32_t b = m[c0 + k] != 0 ? 1u : 0u;
          if (k < 4) {
            w.x |= b << (8 * k);
          } else {
            w.y |= b << (8 * (k - 4));
          }
        }
    }
  }
  return w;
}

// Number of visible columns of the vector at c0, clamped to [0, V].
template <int V>
__device__ __forceinline__ int visible_in(int64_t c0, int64_t limit) {
  const int64_t r = limit - c0;
  return r <= 0 ? 0 : (r >= V ? V : static_cast<int>(r));
}

// Rows of KC keys, KC > 0 a multiple of V (see PIPEGOOSE_SOFTMAX_KEYS): whether the vector of slot i of a lane
// (vector index i * TPR + lane) exists; an existing vector is whole. A compile-time constant once i is unrolled,
// except for a slot that straddles the end of the row.
template <int V, int TPR, int KC>
__device__ __forceinline__ bool vec_in_row(int i, int lane) {
  static_assert(KC > 0 && KC % V == 0, "vec_in_row: KC must be a positive multiple of the vector width");
  constexpr int kVecs = KC / V;  // vectors per row
  if ((i + 1) * TPR <= kVecs) return true;
  if (i * TPR >= kVecs) return false;
  return i * TPR + lane < kVecs;
}

// Bound of the loads of slot i: limit (the causal bound, 0 for an invalid row); with KC > 0, also 0 for a slot
// beyond the row, known at compile time (limit <= KC excludes it already; this lets the compiler drop its loads).
template <int V, int TPR, int KC>
__device__ __forceinline__ int64_t slot_limit(int i, int lane, int64_t limit) {
  if constexpr (KC > 0) {
    return vec_in_row<V, TPR, KC>(i, lane) ? limit : 0;
  } else {
    return limit;
  }
}

// Store of slot i (first column c0) of a row of sk columns: store_vals, or with KC > 0 (sk == KC) a store whose
// column bounds are known at compile time.
template <typename T, int TPR, int KC>
__device__ __forceinline__ void store_slot(T* __restrict__ y, int i, int lane, int64_t c0, int64_t sk, bool vec_ok,
                                           const float (&v)[Elem<T>::kVec]) {
  constexpr int V = Elem<T>::kVec;
  if constexpr (KC > 0) {
    if (!vec_in_row<V, TPR, KC>(i, lane)) return;
    if (vec_ok) {  // the vector is whole
      *reinterpret_cast<uint4*>(y + c0) = Elem<T>::pack(v);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) Elem<T>::store1(y + c0 + k, v[k]);
    }
  } else {
    store_vals<T>(y, c0, sk, vec_ok, v);
  }
}

// Scaled scores (log2 units) of a raw vector; masked or invisible columns give -inf.
template <typename T>
__device__ __forceinline__ void scores_of(const uint4& r, const uint2& mw, int vis, float scale,
                                          float (&v)[Elem<T>::kVec]) {
  constexpr int V = Elem<T>::kVec;
  Elem<T>::unpack(r, v);
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const uint32_t byte = (k < 4 ? mw.x >> (8 * k) : mw.y >> (8 * (k - 4))) & 0xffu;
    v[k] = (k < vis && byte == 0u) ? v[k] * scale : neg_inf();
  }
}

// Zero the elements k >= vis of a raw vector (the causal boundary: a zero y gives a zero dx and adds nothing).
template <typename T>
__device__ __forceinline__ void zero_from(uint4& r, int vis) {
  constexpr int PER = Elem<T>::kVec / 4;  // elements per 32-bit word (element 0 in the low bits)
  auto keep = [&](int word) -> uint32_t {
    const int first = word * PER;
    if constexpr (PER == 1) {
      return first < vis ? 0xffffffffu : 0u;
    } else {
      return first + 1 < vis ? 0xffffffffu : (first < vis ? 0x0000ffffu : 0u);
    }
  };
  r.x &= keep(0);
  r.y &= keep(1);
  r.z &= keep(2);
  r.w &= keep(3);
}

// Pairwise (tree) max / sum of a thread's values: log2(n) dependent steps instead of n.
template <int N>
__device__ __forceinline__ float tree_max(const float (&v)[N]) {
  if constexpr (N == 1) {
    return v[0];
  } else {
    float h[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) h[i] = fmaxf(v[2 * i], v[2 * i + 1]);
    return tree_max<N / 2>(h);
  }
}
template <int N>
__device__ __forceinline__ float tree_sum(const float (&v)[N]) {
  if constexpr (N == 1) {
    return v[0];
  } else {
    float h[N / 2];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) h[i] = v[2 * i] + v[2 * i + 1];
    return tree_sum<N / 2>(h);
  }
}


// Row handled by slot idx of the grid order: causal launches run the rows in reverse (within each head the
// longest rows, the last queries, start first), so the last wave holds the shortest rows instead of the longest.
__device__ __forceinline__ int64_t row_of(int64_t idx, int64_t rows, bool reverse) {
  return reverse ? rows - 1 - idx : idx;
}

// Row of a forward's slot idx: row_of, and with a.heads_inner the slots walk the rows in (d0, d2, d1) order, the heads
// innermost, so that the d1 rows that share a padding-mask row (a mask broadcast over d1) run together and all but the
// first read it from L2. In the rows' own order the d2 rows of a head come between them: at [1, 4, 4096, 4096] in
// bf16 (a head's x and y: 64 MiB, more than the 60 MiB of L2) every head read the mask from memory again. Taken from
// heads of half the L2 (heads_inner_takes).
template <typename T>
__device__ __forceinline__ int64_t fwd_row_of(const FwdArgs<T>& a, int64_t idx) {
  const int64_t s = row_of(idx, a.rows, a.reverse);
  if (!a.heads_inner) return s;
  const RowPos p = split_row(s, a.d2, a.d1, a.rows32);  // s in (d0, d2, d1) order: p.i1 the query, p.i2 the head
  return (p.i0 * a.d1 + p.i2) * a.d2 + p.i1;
}

// ------------------------------------------------------------------------------------------------------------
// At least 1024 resident threads per SM (64 registers per thread): enough loads in flight to cover HBM latency.
constexpr int min_blocks(int block) { return block >= 1024 ? 1 : 1024 / block; }

// Raw forward plans (fwd_raw): the 16-bit plans of four vectors per thread and at least 64 threads per row (rows
// of 1025 keys and more) keep a thread's vectors as the loaded 16-bit words and convert them again in each of the
// three steps (max, sum, store); their calls without a padding mask run a kernel that holds no mask words
// (softmax_fwd_reg_kernel's NM). ptxas still gives them 56 registers (sm_90), as before: the occupancy is the same,
// the gain is in the code. Session 11 (H200, benchmarks.softmax_raw, forward, % of copy, shipped plans -> raw,
// bf16): plain 4096 keys 91.5 -> 92.5, 8192 90.7 -> 93.1, 16384 89.5 -> 95.3 (2048: 93.5 -> 92.8); causal 2048-8192
// 71-78 -> 76-82, 16384 65.9 -> 69.9; padding-masked unchanged; fp16 alike.
// With launch bounds of 1536 or 2048 threads per SM (40 or 32 registers: spills) they ran 67-83 and 36-52 (only the
// causal rows of 16384 keys ran faster at 1536: bf16 71.7 against 69.9), and the short-row plans at 2048 ran 37-47:
// all plans keep min_blocks. A benchmark build may turn them off with -DPIPEGOOSE_SOFTMAX_FWD_RAW=0 (with
// -DPIPEGOOSE_SOFTMAX_FWD_NM=0 too: the forward plans before session 11).
#if defined(PIPEGOOSE_SOFTMAX_FWD_RAW)
constexpr int kFwdRaw = PIPEGOOSE_SOFTMAX_FWD_RAW;
static_assert(kFwdRaw == 0 || kFwdRaw == 1, "PIPEGOOSE_SOFTMAX_FWD_RAW: 0 or 1");
#else
constexpr int kFwdRaw = 1;
#endif
template <typename T, int TPR, int NV>
constexpr bool fwd_raw() {
  return kFwdRaw == 1 && sizeof(T) == 2 && NV == 4 && TPR >= 64;
}

// Which forward calls without a padding mask run the kernel that holds no mask words (softmax_fwd_reg_kernel's NM):
// kFwdNoMask 0: those of the raw plans; 1: also the causal calls of every plan; 2: every call without a mask. Session
// 11 (H200, benchmarks.softmax_raw, forward, % of copy, 0 -> 2, calls 4-6): causal bf16 128-1024 keys 77.4-80.8 ->
// 81.4-85.1, causal fp32 256 keys 86.8-87.4 -> 93.1-93.8 (the other causal fp32 rows of 128-16384 keys moved by -0.5
// to +1.4); plain bf16 128 keys 92.9 -> 91.8 and 256-512 0.3-0.5 lower, plain fp32 within 0.5: the plain calls of the
// plans other than the raw ones keep the kernel with mask words (1). Every-16-bit-plan raw words (not kept) gave the
// same causal gain and lost up to 1.1 points on plain rows. A benchmark build may set it with
// -DPIPEGOOSE_SOFTMAX_FWD_NM=0, 1 or 2.
#if defined(PIPEGOOSE_SOFTMAX_FWD_NM)
constexpr int kFwdNoMask = PIPEGOOSE_SOFTMAX_FWD_NM;
static_assert(kFwdNoMask >= 0 && kFwdNoMask <= 2, "PIPEGOOSE_SOFTMAX_FWD_NM: 0, 1 or 2");
#else
constexpr int kFwdNoMask = 1;
#endif

// Measured and dropped (session 30, H200, benchmarks.softmax_raw, causal forward, % of copy, two alternating runs):
// in the kernels without mask words (NM), a branch per slot that skips the exponentials and partial sums of a
// thread's slots wholly above the diagonal, instead of computing exp2(-inf) = 0 there. ptxas (sm_90) then gave the
// 16-bit plans of 128-1024 keys 64 registers instead of 56 (eight blocks of 128 threads per SM instead of nine), and
// they lost 1.7-4.5 points (bf16 256 keys 83.5 -> 79.2, 128 keys 80.7 -> 79.0); fp32 lost 0.2-0.7. (ncu, bf16 128
// keys, the shipped kernel: issue slots 65% busy, DRAM 73% of peak, 31 warps per SM.)
// Causal rows, register-resident plans of long rows: the output vectors wholly above the diagonal (columns >= the
// causal bound, zeros whatever the scores) are stored right after the row's loads are issued, so that these writes
// overlap the loads' round trip instead of waiting behind the row's reductions. Session 27 (H200,
// benchmarks.softmax_raw, causal, % of copy, two alternating runs each, every plan with and without):
// - backward, 16-bit: 2048 keys 85 -> 88.5, 4096 82 -> 86, 8192 83 -> 89, 16384 87.5 -> 95; fp32: 4096 92.3 -> 96,
//   8192 89.2 -> 96, 16384 79.1 -> 94; but 16-bit rows of 128-256 keys lost 2-3.5 points, fp32 rows of 128-2048 up
//   to 1.5 (2048: a tie);
// - forward: 16-bit 16384 keys 70.2 -> 71.5 (bf16) and 70.3 -> 72.2 (fp16), fp32 16384 keys a tie; elsewhere it lost
//   (16-bit 128 keys 81 -> 72, 2048-4096 keys 3.5 points, fp32 3 points).
// The plain and padding-masked rows share the causal rows' kernels. On the every-plan build they moved by at most
// 1 point, except the plain bf16 forward at 16384 keys (95.4 -> 91.9, one run), which shares its kernel with the
// causal rows of 16384 keys (no-mask words, kFwdNoMask). So only the backward takes it, on plans of at least 2048
// keys (16-bit) or 4096 (fp32) (kCausalEarlyZero 1). A benchmark build may set -DPIPEGOOSE_SOFTMAX_EARLY_ZERO=0 (never), 1 or 2 (every plan of
// both passes, session 27's experiment).
#if defined(PIPEGOOSE_SOFTMAX_EARLY_ZERO)
constexpr int kCausalEarlyZero = PIPEGOOSE_SOFTMAX_EARLY_ZERO;
static_assert(kCausalEarlyZero >= 0 && kCausalEarlyZero <= 2, "PIPEGOOSE_SOFTMAX_EARLY_ZERO: 0, 1 or 2");
#else
constexpr int kCausalEarlyZero = 1;
#endif

// Whether the plan of TPR threads with NV vectors each stores a causal row's zeros early (see kCausalEarlyZero).
template <typename T, bool BWD, int TPR, int NV>
constexpr bool early_zero() {
  constexpr int64_t keys = int64_t{TPR} * NV * Elem<T>::kVec;  // the longest row of the plan
  if constexpr (kCausalEarlyZero == 2) {
    return true;
  } else if constexpr (kCausalEarlyZero == 1) {
    return BWD && keys >= (sizeof(T) == 2 ? 2048 : 4096);
  } else {
    return false;
  }
}

// Whether the vector at column c0 of a causal row was stored early by a plan that does (EZ), and so not again.
template <bool EZ>
__device__ __forceinline__ bool stored_early(bool causal, int64_t c0, int64_t limit) {
  return EZ && causal && c0 >= limit;
}

// The early zero stores of one row (see kCausalEarlyZero): the thread's vectors at columns >= limit.
template <typename T, int TPR, int NV, int KC>
__device__ __forceinline__ void store_early_zeros(T* __restrict__ y, int lane, int64_t sk, int64_t limit, bool vec_ok) {
  constexpr int V = Elem<T>::kVec;
  const float zeros[V] = {};
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    const int64_t c0 = static_cast<int64_t>(i * TPR + lane) * V;
    if (c0 >= limit) store_slot<T, TPR, KC>(y, i, lane, c0, sk, vec_ok, zeros);
  }
}

// One row of a raw plan (fwd_raw): the row's loaded words raw / mw stay packed; each step converts them again.
template <typename T, int TPR, int NV, int KC>
__device__ __forceinline__ void fwd_raw_row(const FwdArgs<T>& a, uint4 (&raw)[NV], const uint2 (&mw)[NV], int lane,
                                            bool valid, int64_t row, int64_t limit, float* red_max, float* red_sum) {
  constexpr int V = Elem<T>::kVec;
  // The opaque words make the compiler convert them again below instead of keeping converted copies alive.
  auto opaque = [&]() {
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      asm volatile("" : "+r"(raw[i].x), "+r"(raw[i].y), "+r"(raw[i].z), "+r"(raw[i].w));
    }
  };
  auto scores = [&](int i, float (&v)[V]) {
    scores_of<T>(raw[i], mw[i],
                 visible_in<V>(static_cast<int64_t>(i * TPR + lane) * V, slot_limit<V, TPR, KC>(i, lane, limit)),
                 a.scale, v);
  };
  float part[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    float v[V];
    scores(i, v);
    part[i] = tree_max<V>(v);
  }
  const float mx = group_reduce<TPR, true>(tree_max<NV>(part), red_max);
  const float ref = mx == neg_inf() ? 0.f : mx;  // all masked: exp2(-inf) = 0 everywhere, the sum stays 0
  opaque();
#pragma unroll
  for (int i = 0; i < NV; ++i) {
    float v[V];
    scores(i, v);
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = exp2f(v[k] - ref);
    part[i] = tree_sum<V>(v);
  }
  const float sum = group_reduce<TPR, false>(tree_sum<NV>(part), red_sum);
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  opaque();
  if (valid) {
    T* y = a.y + row * keys_of<KC>(a);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c0 = static_cast<int64_t>(i * TPR + lane) * V;
      if (stored_early<early_zero<T, false, TPR, NV>()>(a.causal, c0, limit)) continue;
      float v[V];
      scores(i, v);
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = exp2f(v[k] - ref) * inv;
      store_slot<T, TPR, KC>(y, i, lane, c0, keys_of<KC>(a), a.y_vec, v);
    }
  }
}

// Register-resident forward: TPR threads per row, NV vectors per thread, R rows per thread (R > 1 only with
// TPR <= 32, shuffle-only reductions; fwd_rows() says which plans take it: one load phase covers R rows), BLOCK
// threads per block; KC > 0: rows of KC keys on the vector path (see
// PIPEGOOSE_SOFTMAX_KEYS), KC = 0: the row length a.sk is read at run time. A block takes R * BLOCK / TPR
// consecutive slots per step: row group g of the block takes slots base + r * BLOCK / TPR + g, r < R, so that for
// each r the block's loads cover one contiguous stretch of rows (of heads, at one query, with a.heads_inner).
template <typename T, int TPR, int NV, int R, int BLOCK, bool FAST, int KC, bool NM = false>
__device__ __forceinline__ void fwd_reg_rows(const FwdArgs<T>& a, float* red_max, float* red_sum) {
  constexpr int V = Elem<T>::kVec;
  constexpr int RPB = BLOCK / TPR;
  static_assert(KC == 0 || (FAST && KC % V == 0 && KC <= TPR * NV * V), "KC: a vector-path row that fits the plan");
  static_assert(R == 1 || TPR <= 32, "fwd_reg_rows: several rows per thread need shuffle-only reductions");
  const int lane = threadIdx.x % TPR;
  const int64_t step = static_cast<int64_t>(gridDim.x) * RPB * R;
  // The loop bound is uniform over the block: every thread reaches the shuffles and barriers.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * RPB * R; base < a.rows; base += step) {
    bool valid[R];
    int64_t row[R];
    int64_t limit[R];  // invalid rows read nothing
    const T* x[R];
    const uint8_t* m[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t idx = base + r * RPB + threadIdx.x / TPR;
      valid[r] = idx < a.rows;
      row[r] = fwd_row_of(a, idx);
      limit[r] = 0;
      x[r] = a.x;
      m[r] = NM ? nullptr : a.mask;
      if (valid[r]) {
        RowPos p{0, 0, 0};
        if (a.xs.flat < 0 || m[r] != nullptr || a.causal) p = split_row(row[r], a.d1, a.d2, a.rows32);
        limit[r] = causal_limit(a.causal, p.i2, a.causal_shift, keys_of<KC>(a));
        x[r] += row_offset(a.xs, row[r], p);
        if (m[r] != nullptr) m[r] += row_offset(a.ms, row[r], p);
      }
    }
    // Load phase: every x (and mask) vector of the thread's rows is requested before any is used.
    uint4 raw[R][NV];
    uint2 mw[R][NV];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int i = 0; i < NV; ++i)
        raw[r][i] = load_vec<T, FAST>(x[r], static_cast<int64_t>(i * TPR + lane) * V, keys_of<KC>(a),
                                      slot_limit<V, TPR, KC>(i, lane, limit[r]), a.x_vec);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int i = 0; i < NV; ++i)
        mw[r][i] = !NM && a.mask != nullptr
                       ? load_mask_vec<V, FAST>(m[r], static_cast<int64_t>(i * TPR + lane) * V, keys_of<KC>(a),
                                                slot_limit<V, TPR, KC>(i, lane, limit[r]), a.m_vec)
                       : make_uint2(0u, 0u);
    if constexpr (early_zero<T, false, TPR, NV>()) {
      if (a.causal) {
#pragma unroll
        for (int r = 0; r < R; ++r)
          if (valid[r])
            store_early_zeros<T, TPR, NV, KC>(a.y + row[r] * keys_of<KC>(a), lane, keys_of<KC>(a), limit[r], a.y_vec);
      }
    }
    if constexpr (fwd_raw<T, TPR, NV>()) {
      static_assert(R == 1, "fwd_reg_rows: raw plans take one row per thread");
      fwd_raw_row<T, TPR, NV, KC>(a, raw[0], mw[0], lane, valid[0], row[0], limit[0], red_max, red_sum);
      continue;
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v[NV][V];
      float part[NV];
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        scores_of<T>(raw[r][i], mw[r][i],
                     visible_in<V>(static_cast<int64_t>(i * TPR + lane) * V,
                                   slot_limit<V, TPR, KC>(i, lane, limit[r])),
                     a.scale, v[i]);
        part[i] = tree_max<V>(v[i]);
      }
      const float mx = group_reduce<TPR, true>(tree_max<NV>(part), red_max);
      const float ref = mx == neg_inf() ? 0.f : mx;  // all masked: exp2(-inf) = 0 everywhere, the sum stays 0
#pragma unroll
      for (int i = 0; i < NV; ++i) {
#pragma unroll
        for (int k = 0; k < V; ++k) v[i][k] = exp2f(v[i][k] - ref);
        part[i] = tree_sum<V>(v[i]);
      }
      const float sum = group_reduce<TPR, false>(tree_sum<NV>(part), red_sum);
      const float inv = sum > 0.f ? 1.f / sum : 0.f;
      if (valid[r]) {
        T* y = a.y + row[r] * keys_of<KC>(a);
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          const int64_t c0 = static_cast<int64_t>(i * TPR + lane) * V;
          if (stored_early<early_zero<T, false, TPR, NV>()>(a.causal, c0, limit[r])) continue;
#pragma unroll
          for (int k = 0; k < V; ++k) v[i][k] *= inv;
          store_slot<T, TPR, KC>(y, i, lane, c0, keys_of<KC>(a), a.y_vec, v[i]);
        }
      }
    }
  }
}

// NM: launched for calls without a padding mask only (kFwdNoMask says which), which then hold no mask words.
template <typename T, int TPR, int NV, int R, int BLOCK, int KC, bool NM = false>
__global__ void __launch_bounds__(BLOCK, min_blocks(BLOCK)) softmax_fwd_reg_kernel(const FwdArgs<T> a) {
  static_assert(BLOCK % TPR == 0 && (TPR & (TPR - 1)) == 0, "TPR must be a power of two dividing BLOCK");
  __shared__ float red_max[BLOCK / 32 > 0 ? BLOCK / 32 : 1];
  __shared__ float red_sum[BLOCK / 32 > 0 ? BLOCK / 32 : 1];
  if constexpr (KC > 0) {  // launched for a.fast rows of KC keys only (run())
    fwd_reg_rows<T, TPR, NV, R, BLOCK, true, KC, NM>(a, red_max, red_sum);
  } else if (a.fast) {  // uniform over the grid
    fwd_reg_rows<T, TPR, NV, R, BLOCK, true, 0, NM>(a, red_max, red_sum);
  } else {
    fwd_reg_rows<T, TPR, NV, R, BLOCK, false, 0, NM>(a, red_max, red_sum);
  }
}

// Register-resident backward: dx = scale * y * (dy - sum_j dy_j y_j). y stays in registers as raw vectors; dy too,
// or (STAGE) in dynamic shared memory, NV * BLOCK vectors, each thread reading back only its own slots (no barrier),
// which halves the registers of the largest plans: they then fit 64 registers without spilling. On the FAST path
// dy goes to shared memory by cp.async (no register, no wait), so that all loads of the row are in flight at once.
// KC: as in fwd_reg_rows.
template <typename T, int TPR, int NV, int BLOCK, bool STAGE, bool FAST, int KC>
__device__ __forceinline__ void bwd_reg_rows(const BwdArgs<T>& a, float* red_sum, uint4* stage) {
  constexpr int V = Elem<T>::kVec;
  constexpr int RPB = BLOCK / TPR;
  static_assert(KC == 0 || (FAST && KC % V == 0 && KC <= TPR * NV * V), "KC: a vector-path row that fits the plan");
  const int lane = threadIdx.x % TPR;
  const int64_t step = static_cast<int64_t>(gridDim.x) * RPB;
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * RPB; base < a.rows; base += step) {
    const int64_t idx = base + threadIdx.x / TPR;
    const bool valid = idx < a.rows;
    const int64_t row = row_of(idx, a.rows, a.reverse);
    int64_t limit = 0;
    const T* g = a.dy;
    const T* y = a.y;
    if (valid) {
      RowPos p{0, 0, 0};
      if (a.gs.flat < 0 || a.ys.flat < 0 || a.causal) p = split_row(row, a.d1, a.d2, a.rows32);
      limit = causal_limit(a.causal, p.i2, a.causal_shift, keys_of<KC>(a));
      g += row_offset(a.gs, row, p);
      y += row_offset(a.ys, row, p);
    }
    // Load phase: every dy and y vector of the row is requested before any is used.
    uint4 rg[STAGE ? 1 : NV], ry[NV];
    if constexpr (STAGE && FAST) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int64_t c0 = static_cast<int64_t>(i * TPR + lane) * V;
        const int bytes = visible_in<V>(c0, slot_limit<V, TPR, KC>(i, lane, limit)) *
                          static_cast<int>(sizeof(T));  // zero filled beyond
        cp_async16(&stage[i * BLOCK + threadIdx.x], bytes > 0 ? g + c0 : g, bytes);
      }
    }
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int64_t c0 = static_cast<int64_t>(i * TPR + lane) * V;
      const int64_t lim = slot_limit<V, TPR, KC>(i, lane, limit);
      ry[i] = load_vec<T, FAST>(y, c0, keys_of<KC>(a), lim, a.y_vec);
      if constexpr (!STAGE) {
        rg[i] = load_vec<T, FAST>(g, c0, keys_of<KC>(a), lim, a.g_vec);
      } else if constexpr (!FAST) {  // general path: through registers (waits on each load; rare layouts)
        stage[i * BLOCK + threadIdx.x] = load_raw<T>(g, c0, keys_of<KC>(a), lim, a.g_vec);
      }
    }
    if constexpr (early_zero<T, true, TPR, NV>()) {
      if (a.causal && valid)
        store_early_zeros<T, TPR, NV, KC>(a.dx + row * keys_of<KC>(a), lane, keys_of<KC>(a), limit, a.dx_vec);
    }
    if (a.causal) {  // the boundary vector was read whole on the FAST path: zero its invisible columns
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int vis = visible_in<V>(static_cast<int64_t>(i * TPR + lane) * V, slot_limit<V, TPR, KC>(i, lane, limit));
        zero_from<T>(ry[i], vis);
        if constexpr (!STAGE) zero_from<T>(rg[i], vis);
      }
    }
    if constexpr (STAGE && FAST) cp_async_wait_all();  // this thread's own slots are now readable by it
    auto dy_of = [&](int i) -> uint4 {
      if constexpr (STAGE) {
        return stage[i * BLOCK + threadIdx.x];
      } else {
        return rg[i];
      }
    };
    float part[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      float fg[V], fy[V];
      Elem<T>::unpack(dy_of(i), fg);
      Elem<T>::unpack(ry[i], fy);
#pragma unroll
      for (int k = 0; k < V; ++k) fy[k] = fg[k] * fy[k];
      part[i] = tree_sum<V>(fy);
    }
    const float dot = group_reduce<TPR, false>(tree_sum<NV>(part), red_sum);
    // Make the raw words opaque so that the compiler unpacks them again below instead of keeping the unpacked
    // fp32 copies (twice the registers) alive across the reduction; the memory clobber keeps the shared memory
    // reads of dy below the reduction (hoisted above it, they need registers the largest plans do not have).
    if constexpr (STAGE) asm volatile("" ::: "memory");
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      asm volatile("" : "+r"(ry[i].x), "+r"(ry[i].y), "+r"(ry[i].z), "+r"(ry[i].w));
      if constexpr (!STAGE) asm volatile("" : "+r"(rg[i].x), "+r"(rg[i].y), "+r"(rg[i].z), "+r"(rg[i].w));
    }
    if (valid) {
      T* dx = a.dx + row * keys_of<KC>(a);
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int64_t c0 = static_cast<int64_t>(i * TPR + lane) * V;
        if (stored_early<early_zero<T, true, TPR, NV>()>(a.causal, c0, limit)) continue;
        float fg[V], fy[V];
        Elem<T>::unpack(dy_of(i), fg);
        Elem<T>::unpack(ry[i], fy);
#pragma unroll
        for (int k = 0; k < V; ++k) fy[k] = a.scale * fy[k] * (fg[k] - dot);
        store_slot<T, TPR, KC>(dx, i, lane, c0, keys_of<KC>(a), a.dx_vec, fy);
      }
    }
    if constexpr (TPR > 32) __syncthreads();  // red_sum is read after the barrier; guard its reuse
  }
}

template <typename T, int TPR, int NV, int BLOCK, bool STAGE, int KC>
__global__ void __launch_bounds__(BLOCK, min_blocks(BLOCK)) softmax_bwd_reg_kernel(const BwdArgs<T> a) {
  static_assert(BLOCK % TPR == 0 && (TPR & (TPR - 1)) == 0, "TPR must be a power of two dividing BLOCK");
  __shared__ float red_sum[BLOCK / 32 > 0 ? BLOCK / 32 : 1];
  extern __shared__ uint4 stage[];  // NV * BLOCK when STAGE
  if constexpr (KC > 0) {  // launched for a.fast rows of KC keys only (run())
    bwd_reg_rows<T, TPR, NV, BLOCK, STAGE, true, KC>(a, red_sum, stage);
  } else if (a.fast) {  // uniform over the grid
    bwd_reg_rows<T, TPR, NV, BLOCK, STAGE, true, 0>(a, red_sum, stage);
  } else {
    bwd_reg_rows<T, TPR, NV, BLOCK, STAGE, false, 0>(a, red_sum, stage);
  }
}
// ------------------------------------------------------------------------------------------------------------
// Two-pass paths for rows beyond the register budget (any length): one block per row.

constexpr int kTwoPassBlock = 512;

__device__ __forceinline__ void combine_max_sum(float& m, float& s, float m2, float s2) {
  const float mm = fmaxf(m, m2);
  if (mm == neg_inf()) {
    m = mm;
    s = 0.f;
    return;
  }
  s = s * exp2f(m - mm) + s2 * exp2f(m2 - mm);
  m = mm;
}

template <typename T>
__global__ void __launch_bounds__(kTwoPassBlock) softmax_fwd_two_pass_kernel(const FwdArgs<T> a) {
  constexpr int V = Elem<T>::kVec;
  constexpr int NW = kTwoPassBlock / 32;
  __shared__ float sm_m[NW], sm_s[NW];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t idx = blockIdx.x; idx < a.rows; idx += gridDim.x) {
    const int64_t row = fwd_row_of(a, idx);
    RowPos p{0, 0, 0};
    if (a.xs.flat < 0 || a.mask != nullptr || a.causal) p = split_row(row, a.d1, a.d2, a.rows32);
    const int64_t limit = causal_limit(a.causal, p.i2, a.causal_shift, a.sk);
    const T* x = a.x + row_offset(a.xs, row, p);
    const uint8_t* m = a.mask != nullptr ? a.mask + row_offset(a.ms, row, p) : nullptr;
    // Pass 1: running max and sum of exp2 relative to it.
    float mx = neg_inf(), sum = 0.f;
#pragma unroll 2
    for (int64_t c0 = static_cast<int64_t>(threadIdx.x) * V; c0 < limit; c0 += static_cast<int64_t>(kTwoPassBlock) * V) {
      float v[V];
      load_scores<T>(x, m, c0, a.sk, limit, a.x_vec, a.m_vec, a.scale, v);
      float vm = v[0];
#pragma unroll
      for (int k = 1; k < V; ++k) vm = fmaxf(vm, v[k]);
      if (vm == neg_inf()) continue;
      if (vm > mx) {
        sum *= exp2f(mx - vm);
        mx = vm;
      }
#pragma unroll
      for (int k = 0; k < V; ++k) sum += exp2f(v[k] - mx);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, mx, o), s2 = __shfl_xor_sync(0xffffffffu, sum, o);
      combine_max_sum(mx, sum, m2, s2);
    }
    if (lane == 0) {
      sm_m[warp] = mx;
      sm_s[warp] = sum;
    }
    __syncthreads();
    mx = sm_m[lane % NW];  // every group of NW lanes holds all partials: all lanes end with the total
    sum = sm_s[lane % NW];
#pragma unroll
    for (int o = NW / 2; o > 0; o >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, mx, o), s2 = __shfl_xor_sync(0xffffffffu, sum, o);
      combine_max_sum(mx, sum, m2, s2);
    }
    const float ref = mx == neg_inf() ? 0.f : mx;
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    // Pass 2: normalise; the invisible causal tail is written as zeros without being read.
    T* y = a.y + row * a.sk;
#pragma unroll 2
    for (int64_t c0 = static_cast<int64_t>(threadIdx.x) * V; c0 < a.sk; c0 += static_cast<int64_t>(kTwoPassBlock) * V) {
      float v[V];
      load_scores<T>(x, m, c0, a.sk, limit, a.x_vec, a.m_vec, a.scale, v);
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = exp2f(v[k] - ref) * inv;
      store_vals<T>(y, c0, a.sk, a.y_vec, v);
    }
    __syncthreads();  // sm_m / sm_s are reused by the next row
  }
}

template <typename T>
__global__ void __launch_bounds__(kTwoPassBlock) softmax_bwd_two_pass_kernel(const BwdArgs<T> a) {
  constexpr int V = Elem<T>::kVec;
  __shared__ float red_sum[kTwoPassBlock / 32];
  for (int64_t idx = blockIdx.x; idx < a.rows; idx += gridDim.x) {
    const int64_t row = row_of(idx, a.rows, a.reverse);
    RowPos p{0, 0, 0};
    if (a.gs.flat < 0 || a.ys.flat < 0 || a.causal) p = split_row(row, a.d1, a.d2, a.rows32);
    const int64_t limit = causal_limit(a.causal, p.i2, a.causal_shift, a.sk);
    const T* g = a.dy + row_offset(a.gs, row, p);
    const T* y = a.y + row_offset(a.ys, row, p);
    float dot = 0.f;
#pragma unroll 2
    for (int64_t c0 = static_cast<int64_t>(threadIdx.x) * V; c0 < limit; c0 += static_cast<int64_t>(kTwoPassBlock) * V) {
      float fg[V], fy[V];
      Elem<T>::unpack(load_raw<T>(g, c0, a.sk, limit, a.g_vec), fg);
      Elem<T>::unpack(load_raw<T>(y, c0, a.sk, limit, a.y_vec), fy);
#pragma unroll
      for (int k = 0; k < V; ++k) dot += (c0 + k < limit) ? fg[k] * fy[k] : 0.f;
    }
    dot = group_reduce<kTwoPassBlock, false>(dot, red_sum);
    T* dx = a.dx + row * a.sk;
#pragma unroll 2
    for (int64_t c0 = static_cast<int64_t>(threadIdx.x) * V; c0 < a.sk; c0 += static_cast<int64_t>(kTwoPassBlock) * V) {
      float fg[V], fy[V];
      Elem<T>::unpack(load_raw<T>(g, c0, a.sk, limit, a.g_vec), fg);
      Elem<T>::unpack(load_raw<T>(y, c0, a.sk, limit, a.y_vec), fy);
#pragma unroll
      for (int k = 0; k < V; ++k) fy[k] = (c0 + k < limit) ? a.scale * fy[k] * (fg[k] - dot) : 0.f;
      store_vals<T>(dx, c0, a.sk, a.dx_vec, fy);
    }
    __syncthreads();  // red_sum is reused by the next row
  }
}

// ------------------------------------------------------------------------------------------------------------
// Causal forward of long 16-bit rows staged in shared memory (kCausalSmemMin). The register-resident plans of these
// rows hold the whole row in registers, so an SM runs two rows at a time (two blocks of 512 threads), and a causal row
// reads half a row on average: too few loads in flight to cover the DRAM round trip. Here a row's visible vectors go
// to shared memory by cp.async (no registers), its zeros above the diagonal are stored while they land, and the three
// steps (max, sum, store) read shared memory; a block of kCausalSmemBlock threads takes one row, and an SM holds as
// many rows as its shared memory takes (six of 16384 keys, three of 32768, on sm_90).
constexpr int kCausalSmemBlock = 256;

// Key lengths of the 16-bit causal forward calls that take the staged kernel (vector path, no padding mask):
// [kCausalSmemMin, kCausalSmemMax]; kCausalSmemMin 0: none. Session 27 (H200, benchmarks.softmax_raw, causal forward,
// % of copy, two alternating runs per build, against the register-resident plans): bf16 16384 keys 70.3 -> 85.1-85.5,
// 32768 keys 59.5 -> 90.1-90.2 (fp16 alike); but 8192 keys 75 -> 75, 4096 82 -> 62, 2048 82 -> 45, 1024 85 -> 29:
// eight blocks of 256 threads per SM hold eight rows, whose visible halves (2-8 KB at 2048-8192 keys) are too few
// bytes in flight, where the register plans of those rows run 8-32 rows per SM. So it takes rows of 16384 keys and
// more. (A Triton kernel of the same memory traffic, reading the lower triangle and writing the whole matrix, ran
// 93-96% of copy in bf16 at 4096-16384 keys: the traffic itself allows 90%.) A benchmark build may set the lower
// bound with -DPIPEGOOSE_SOFTMAX_CAUSAL_SMEM=K (0: off).
#if defined(PIPEGOOSE_SOFTMAX_CAUSAL_SMEM)
constexpr int64_t kCausalSmemMin = PIPEGOOSE_SOFTMAX_CAUSAL_SMEM;
static_assert(kCausalSmemMin >= 0, "PIPEGOOSE_SOFTMAX_CAUSAL_SMEM: a key length, or 0 (off)");
#else
constexpr int64_t kCausalSmemMin = 16384;
#endif
constexpr int64_t kCausalSmemMax = 32768;  // 64 KB of 16-bit keys per row

template <typename T>
__global__ void __launch_bounds__(kCausalSmemBlock, 2048 / kCausalSmemBlock)
    softmax_fwd_causal_smem_kernel(const FwdArgs<T> a) {
  constexpr int V = Elem<T>::kVec;
  constexpr int B = kCausalSmemBlock;
  extern __shared__ uint4 srow[];  // the row's visible vectors (sk / V of them at most)
  __shared__ float red_max[B / 32];
  __shared__ float red_sum[B / 32];
  const int nvec = static_cast<int>(a.sk / V);  // a.fast: every vector whole; sk <= kCausalSmemMax
  const uint2 nomask = make_uint2(0u, 0u);
  for (int64_t idx = blockIdx.x; idx < a.rows; idx += gridDim.x) {
    const int64_t row = row_of(idx, a.rows, a.reverse);
    const RowPos p = split_row(row, a.d1, a.d2, a.rows32);
    const int64_t limit = causal_limit(true, p.i2, a.causal_shift, a.sk);
    const T* x = a.x + row_offset(a.xs, row, p);
    T* y = a.y + row * a.sk;
    const int nvis = static_cast<int>((limit + V - 1) / V);  // vectors holding a visible key
    for (int v = threadIdx.x; v < nvis; v += B) cp_async16(&srow[v], x + static_cast<int64_t>(v) * V, 16);
    for (int v = nvis + threadIdx.x; v < nvec; v += B)
      *reinterpret_cast<uint4*>(y + static_cast<int64_t>(v) * V) = make_uint4(0u, 0u, 0u, 0u);
    cp_async_wait_all();
    __syncthreads();
    float mx = neg_inf();
    for (int v = threadIdx.x; v < nvis; v += B) {
      float f[V];
      scores_of<T>(srow[v], nomask, visible_in<V>(static_cast<int64_t>(v) * V, limit), a.scale, f);
      mx = fmaxf(mx, tree_max<V>(f));
    }
    mx = group_reduce<B, true>(mx, red_max);
    const float ref = mx == neg_inf() ? 0.f : mx;  // no visible key: the sum stays 0
    float sum = 0.f;
    for (int v = threadIdx.x; v < nvis; v += B) {
      float f[V];
      scores_of<T>(srow[v], nomask, visible_in<V>(static_cast<int64_t>(v) * V, limit), a.scale, f);
#pragma unroll
      for (int k = 0; k < V; ++k) f[k] = exp2f(f[k] - ref);
      sum += tree_sum<V>(f);
    }
    sum = group_reduce<B, false>(sum, red_sum);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int v = threadIdx.x; v < nvis; v += B) {
      float f[V];
      scores_of<T>(srow[v], nomask, visible_in<V>(static_cast<int64_t>(v) * V, limit), a.scale, f);
#pragma unroll
      for (int k = 0; k < V; ++k) f[k] = exp2f(f[k] - ref) * inv;
      *reinterpret_cast<uint4*>(y + static_cast<int64_t>(v) * V) = Elem<T>::pack(f);
    }
    __syncthreads();  // srow, red_max and red_sum are reused by the next row
  }
}

// ------------------------------------------------------------------------------------------------------------
// Causal forward of square score matrices (sq == sk) in row pairs. Causal row q reads ceil((q + 1) / V) vectors, half
// a row on average, so a register-resident plan (one row per TPR threads, slots for a whole row) has only half as many
// loads in flight as on plain rows, and the SM's other rows cannot make up for it: its residency is fixed by the
// registers. Here TPR threads take two rows whose visible vectors add up to one row's, in the slots of one row.
// The V rows of vector group g (rows gV .. gV + V - 1, g + 1 visible vectors each; V keys per vector) go with the V
// rows of group nvec - 2 - g (nvec - 1 - g visible vectors), row gV + k with row (nvec - 2 - g) V + k; where the two
// groups are one (the middle group, nvec even), its rows pair among themselves, gV + k with gV + V - 1 - k; the last
// group (nvec visible vectors) runs alone. Every work item then reads nvec vectors and writes 2 nvec (1 alone), and
// a head of sk rows is (sk + V) / 2 items. Slot vector index vi (lane + i * TPR, as in the other kernels) < va holds
// vector vi of row a, va <= vi < nvec vector vi - va of row b; the zeros above the two diagonals (nvec - va vectors of
// row a, nvec - vb of row b: nvec in all for a pair) are spread over the slots the same way. Both rows' max and sum
// reduce at once (a float2). kCausalPair says which calls take it.

// Which plans take it (causal_pair_plan): kCausalPair 1: the 16-bit plans of at least 64 threads per row (rows of 1025
// keys and more, up to the staged kernel above, which takes 16384 and more where they fit); 2: also the shorter 16-bit
// rows (from 40 keys) and the fp32 rows of 20 to 512 keys; 0: none. (The plan of 32 threads with four vectors, 513-1024
// keys, spills 12 bytes with pairs: ptxas, sm_90; and gained only 0.6 points at 1024 keys.) Session 28 (H200,
// benchmarks.softmax_raw, causal forward, % of copy, two alternating runs, register-resident plans -> pairs): bf16 1024
// keys 85.0 -> 85.6, 2048 82.1 -> 86.5, 4096 81.7 -> 87.8, 8192 75.4 -> 86.9 (fp16 alike); but bf16 128 keys 80.8 ->
// 72.0, 256 83.0 -> 80.0, 512 a tie, fp32 128 keys 90.4 -> 85.8, 256-512 1 point lower. Storing the zeros right after
// the loads were issued, instead of after the values, lost everywhere (bf16 4096 keys 85.0, 128 keys 61.3). So did
// storing them from blocks of their own (session 29: a grid twice as large, half of its blocks storing only the zeros
// of the other half's items, after them or interleaved): bf16 forward 2048 keys 85.3 -> 80.9 / 83.9, backward 128
// keys 78.9 -> 50.5 / 63.1; no length gained more than 1.2 points. A benchmark build may set
// -DPIPEGOOSE_SOFTMAX_CAUSAL_PAIR=0, 1 or 2.
#if defined(PIPEGOOSE_SOFTMAX_CAUSAL_PAIR)
constexpr int kCausalPair = PIPEGOOSE_SOFTMAX_CAUSAL_PAIR;
static_assert(kCausalPair >= 0 && kCausalPair <= 2, "PIPEGOOSE_SOFTMAX_CAUSAL_PAIR: 0, 1 or 2");
#else
constexpr int kCausalPair = 1;
#endif

struct PairRows {
  int qa, qb;  // query rows of a work item; qb < 0: row qa alone
};

// Rows of work item t (0 <= t < (sk + V) / 2) of a head of nvec vectors per row: the rows alone first, then the pairs.
// 32-bit: the register-resident plans take rows of at most 32768 keys.
template <int V>
__device__ __forceinline__ PairRows pair_rows(int t, int nvec) {
  if (t < V) return {(nvec - 1) * V + t, -1};
  const int p = t - V, g = p / V, k = p % V, h = nvec - 2 - g;  // h >= g
  return {g * V + k, h > g ? h * V + k : g * V + V - 1 - k};
}

template <typename T, int TPR, int NV, int BLOCK>
__global__ void __launch_bounds__(BLOCK, min_blocks(BLOCK)) softmax_fwd_causal_pair_kernel(const FwdArgs<T> a) {
  static_assert(BLOCK % TPR == 0 && (TPR & (TPR - 1)) == 0, "TPR must be a power of two dividing BLOCK");
  constexpr int V = Elem<T>::kVec;
  constexpr int RPB = BLOCK / TPR;
  __shared__ float2 red_max[BLOCK / 32 > 0 ? BLOCK / 32 : 1];
  __shared__ float2 red_sum[BLOCK / 32 > 0 ? BLOCK / 32 : 1];
  const int lane = threadIdx.x % TPR;
  const int64_t sk = a.sk;  // a.fast: sk % V == 0; causal_pair_takes: sq == sk; a register plan: nvec <= TPR * NV
  const int nvec = static_cast<int>(sk / V);
  const int64_t per_head = (sk + V) / 2;
  const int64_t items = a.rows / sk * per_head;
  const uint2 nomask = make_uint2(0u, 0u);
  const int64_t step = static_cast<int64_t>(gridDim.x) * RPB;
  // The loop bound is uniform over the block: every thread reaches the shuffles and barriers.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * RPB; base < items; base += step) {
    const int64_t idx = base + threadIdx.x / TPR;
    const bool valid = idx < items;
    // An invalid item reads nothing (limits 0) and writes nothing; an item without row b has vb = 0 (nothing of
    // row b read, stored or zeroed).
    int64_t ra = 0, rb = 0;
    int la = 0, lb = 0, va = nvec, vb = 0;
    const T* xa = a.x;
    const T* xb = a.x;
    if (valid) {
      const int64_t h = idx / per_head;
      const PairRows pr = pair_rows<V>(static_cast<int>(idx - h * per_head), nvec);
      ra = h * sk + pr.qa;
      la = pr.qa + 1;
      va = pr.qa / V + 1;
      xa += row_offset(a.xs, ra, a.xs.flat < 0 ? split_row(ra, a.d1, a.d2, a.rows32) : RowPos{0, 0, 0});
      if (pr.qb >= 0) {
        rb = h * sk + pr.qb;
        lb = pr.qb + 1;
        vb = pr.qb / V + 1;
        xb += row_offset(a.xs, rb, a.xs.flat < 0 ? split_row(rb, a.d1, a.d2, a.rows32) : RowPos{0, 0, 0});
      }
    }
    // Slot i: row a's vector vi (vi < va) or row b's vector vi - va; its first column and the row's bound.
    auto in_a = [&](int i) { return i * TPR + lane < va; };
    auto col = [&](int i) { return (in_a(i) ? i * TPR + lane : i * TPR + lane - va) * V; };
    auto bound = [&](int i) { return in_a(i) ? la : lb; };
    uint4 raw[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) raw[i] = load_vec<T, true>(in_a(i) ? xa : xb, col(i), sk, bound(i), true);
    auto scores = [&](int i, float (&f)[V]) {
      scores_of<T>(raw[i], nomask, visible_in<V>(col(i), bound(i)), a.scale, f);
    };
    // The opaque words make the compiler convert them again below instead of keeping converted copies alive.
    auto opaque = [&]() {
#pragma unroll
      for (int i = 0; i < NV; ++i) asm volatile("" : "+r"(raw[i].x), "+r"(raw[i].y), "+r"(raw[i].z), "+r"(raw[i].w));
    };
    float2 part = make_float2(neg_inf(), neg_inf());
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      float f[V];
      scores(i, f);
      const float m = tree_max<V>(f);
      if (in_a(i)) {
        part.x = fmaxf(part.x, m);
      } else {
        part.y = fmaxf(part.y, m);
      }
    }
    const float2 mx = group_reduce<TPR, true>(part, red_max);
    // A row holds at least one visible key (q + 1 of them); an absent row b has a max of -inf and is not stored.
    const float2 ref = make_float2(mx.x == neg_inf() ? 0.f : mx.x, mx.y == neg_inf() ? 0.f : mx.y);
    opaque();
    part = make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      float f[V];
      scores(i, f);
      const float r = in_a(i) ? ref.x : ref.y;
#pragma unroll
      for (int k = 0; k < V; ++k) f[k] = exp2f(f[k] - r);
      if (in_a(i)) {
        part.x += tree_sum<V>(f);
      } else {
        part.y += tree_sum<V>(f);
      }
    }
    const float2 sum = group_reduce<TPR, false>(part, red_sum);
    const float2 inv = make_float2(sum.x > 0.f ? 1.f / sum.x : 0.f, sum.y > 0.f ? 1.f / sum.y : 0.f);
    opaque();
    if (valid) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const bool ia = in_a(i);
        const int c0 = col(i);
        if (!ia && c0 >= vb * V) continue;  // beyond row b's visible vectors (no row b: vb = 0)
        float f[V];
        scores(i, f);
        const float r = ia ? ref.x : ref.y, s = ia ? inv.x : inv.y;
#pragma unroll
        for (int k = 0; k < V; ++k) f[k] = exp2f(f[k] - r) * s;
        *reinterpret_cast<uint4*>(a.y + (ia ? ra : rb) * sk + c0) = Elem<T>::pack(f);
      }
      // Zeros above the diagonals: zi < nvec - va: row a's vector va + zi; then row b's from vb.
      const int za = nvec - va, zb = vb > 0 ? nvec - vb : 0;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int zi = i * TPR + lane;
        if (zi < za) {
          *reinterpret_cast<uint4*>(a.y + ra * sk + (va + zi) * V) = make_uint4(0u, 0u, 0u, 0u);
        } else if (zi < za + zb) {
          *reinterpret_cast<uint4*>(a.y + rb * sk + (vb + zi - za) * V) = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
  }
}

// Causal backward of square matrices in the same row pairs: dx = scale * y * (dy - dot) for two rows at once, dy and y
// read only where visible, in the slots of one row as above; dy in registers, or (STAGE, NV >= 4) in shared memory by
// cp.async, each thread reading back only its own slots, as in bwd_reg_rows. EZ: the zeros above the diagonals are
// stored right after the loads are issued, else after the values. causal_pair_bwd_plan says which plans take it.
// Session 28 (H200, benchmarks.softmax_raw, causal backward, % of copy, two alternating runs, register-resident plans
// -> pairs with the zeros late / early):
// - 16-bit (bf16; fp16 alike): 128 keys 67.4 -> 78.7 / 79.1, 256 68.2 -> 80.9 / 81.4, 512 81.9 -> 89.7 / 87.9, 1024
//   81.1 -> 90.7 / 89.6, 2048 88.8 -> 87.4 / 87.0, 4096 86.5 -> 89.5 / 89.0, 8192 88.2 -> 87.6 / 88.0, 16384
//   94.4 -> 93.1 / 95.5;
// - fp32: 128 keys 76.9 -> 87.3 / 88.1, 256 94.9 -> 93.8 / 92.4, 512 93.9 -> 93.3 / 92.4, 1024 93.9 -> 92.5 / 91.7,
//   2048 93.4 -> 95.2 / 94.1, 4096 95.2 -> 94.0 / 93.0, 8192 95.4 -> 93.3 / 93.2, 16384 93.4 -> 91.7 / 97.6.
// So the plans of the winning lengths take it (kCausalPairBwd 1): in 16-bit those of up to two vectors per thread
// (rows of up to 1024 keys), in fp32 those of one (up to 128 keys); in both the plan of 128 threads with four vectors
// (16-bit 2049-4096 keys, fp32 1025-2048); and, with the zeros early, the plan that holds 16384 keys (16-bit 512
// threads: 8193-16384 keys; fp32 1024 threads: 8193-16384). A benchmark build may set
// -DPIPEGOOSE_SOFTMAX_CAUSAL_PAIR_BWD=0 (none) or 2 (every plan, the zeros as -DPIPEGOOSE_SOFTMAX_PAIR_BWD_EARLY_ZERO=0
// or 1 says: late or early).
#if defined(PIPEGOOSE_SOFTMAX_CAUSAL_PAIR_BWD)
constexpr int kCausalPairBwd = PIPEGOOSE_SOFTMAX_CAUSAL_PAIR_BWD;
static_assert(kCausalPairBwd >= 0 && kCausalPairBwd <= 2, "PIPEGOOSE_SOFTMAX_CAUSAL_PAIR_BWD: 0, 1 or 2");
#else
constexpr int kCausalPairBwd = 1;
#endif
#if defined(PIPEGOOSE_SOFTMAX_PAIR_BWD_EARLY_ZERO)
constexpr bool kCausalPairBwdEarlyZero = PIPEGOOSE_SOFTMAX_PAIR_BWD_EARLY_ZERO;
#else
constexpr bool kCausalPairBwdEarlyZero = false;
#endif

// Keys held by a plan of TPR threads with NV vectors each.
template <typename T, int TPR, int NV>
constexpr int64_t plan_keys() {
  return int64_t{TPR} * NV * Elem<T>::kVec;
}

// Whether the backward plan of TPR threads with NV vectors each has a row-pair kernel, see kCausalPairBwd; and whether
// that kernel stores the zeros early.
template <typename T, int TPR, int NV>
constexpr bool causal_pair_bwd_plan() {
  if constexpr (NV == 2 && TPR >= 128) return false;  // kBwdMidVecs' plans: rows without the causal mask only
  if constexpr (kCausalPairBwd == 1) {
    return (sizeof(T) == 2 ? NV <= 2 : NV == 1) || (TPR == 128 && NV == 4) || plan_keys<T, TPR, NV>() == 16384;
  }
  return kCausalPairBwd == 2;
}
template <typename T, int TPR, int NV>
constexpr bool causal_pair_bwd_early_zero() {
  return kCausalPairBwd == 1 ? plan_keys<T, TPR, NV>() == 16384 : kCausalPairBwdEarlyZero;
}

template <typename T, int TPR, int NV, int BLOCK, bool STAGE, bool EZ>
__global__ void __launch_bounds__(BLOCK, min_blocks(BLOCK)) softmax_bwd_causal_pair_kernel(const BwdArgs<T> a) {
  static_assert(BLOCK % TPR == 0 && (TPR & (TPR - 1)) == 0, "TPR must be a power of two dividing BLOCK");
  constexpr int V = Elem<T>::kVec;
  constexpr int RPB = BLOCK / TPR;
  __shared__ float2 red_sum[BLOCK / 32 > 0 ? BLOCK / 32 : 1];
  extern __shared__ uint4 stage[];  // NV * BLOCK when STAGE
  const int lane = threadIdx.x % TPR;
  const int64_t sk = a.sk;  // a.fast: sk % V == 0; causal_pair_takes: sq == sk; a register plan: nvec <= TPR * NV
  const int nvec = static_cast<int>(sk / V);
  const int64_t per_head = (sk + V) / 2;
  const int64_t items = a.rows / sk * per_head;
  const int64_t step = static_cast<int64_t>(gridDim.x) * RPB;
  // The loop bound is uniform over the block: every thread reaches the shuffles and barriers.
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * RPB; base < items; base += step) {
    const int64_t idx = base + threadIdx.x / TPR;
    const bool valid = idx < items;
    // As in softmax_fwd_causal_pair_kernel: an invalid item reads and writes nothing; without row b, vb = 0. (The
    // setup and the zero stores repeat the forward's: shared helpers cost registers here, 64 per thread, and made
    // ptxas spill 4-8 bytes in some plans, sm_90.)
    int64_t ra = 0, rb = 0;
    int la = 0, lb = 0, va = nvec, vb = 0;
    const T *ga = a.dy, *gb = a.dy, *ya = a.y, *yb = a.y;
    if (valid) {
      const int64_t h = idx / per_head;
      const PairRows pr = pair_rows<V>(static_cast<int>(idx - h * per_head), nvec);
      const bool split = a.gs.flat < 0 || a.ys.flat < 0;
      ra = h * sk + pr.qa;
      la = pr.qa + 1;
      va = pr.qa / V + 1;
      const RowPos pa = split ? split_row(ra, a.d1, a.d2, a.rows32) : RowPos{0, 0, 0};
      ga += row_offset(a.gs, ra, pa);
      ya += row_offset(a.ys, ra, pa);
      if (pr.qb >= 0) {
        rb = h * sk + pr.qb;
        lb = pr.qb + 1;
        vb = pr.qb / V + 1;
        const RowPos pb = split ? split_row(rb, a.d1, a.d2, a.rows32) : RowPos{0, 0, 0};
        gb += row_offset(a.gs, rb, pb);
        yb += row_offset(a.ys, rb, pb);
      }
    }
    auto in_a = [&](int i) { return i * TPR + lane < va; };
    auto col = [&](int i) { return (in_a(i) ? i * TPR + lane : i * TPR + lane - va) * V; };
    auto bound = [&](int i) { return in_a(i) ? la : lb; };
    // Load phase: every dy and y vector of both rows is requested before any is used.
    uint4 rg[STAGE ? 1 : NV], ry[NV];
    if constexpr (STAGE) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int bytes = visible_in<V>(col(i), bound(i)) * static_cast<int>(sizeof(T));  // zero filled beyond
        const T* g = in_a(i) ? ga : gb;
        cp_async16(&stage[i * BLOCK + threadIdx.x], bytes > 0 ? g + col(i) : g, bytes);
      }
    }
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      ry[i] = load_vec<T, true>(in_a(i) ? ya : yb, col(i), sk, bound(i), true);
      if constexpr (!STAGE) rg[i] = load_vec<T, true>(in_a(i) ? ga : gb, col(i), sk, bound(i), true);
    }
    // Zeros above the diagonals: zi < nvec - va: row a's vector va + zi; then row b's from vb.
    auto store_zeros = [&]() {
      if (!valid) return;
      const int za = nvec - va, zb = vb > 0 ? nvec - vb : 0;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int zi = i * TPR + lane;
        if (zi < za) {
          *reinterpret_cast<uint4*>(a.dx + ra * sk + (va + zi) * V) = make_uint4(0u, 0u, 0u, 0u);
        } else if (zi < za + zb) {
          *reinterpret_cast<uint4*>(a.dx + rb * sk + (vb + zi - za) * V) = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    };
    if constexpr (EZ) store_zeros();
    // The boundary vectors were read whole: zero their invisible columns (a zero y gives a zero dx, adds nothing).
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int vis = visible_in<V>(col(i), bound(i));
      zero_from<T>(ry[i], vis);
      if constexpr (!STAGE) zero_from<T>(rg[i], vis);
    }
    if constexpr (STAGE) cp_async_wait_all();  // this thread's own slots are now readable by it
    auto dy_of = [&](int i) -> uint4 {
      if constexpr (STAGE) {
        return stage[i * BLOCK + threadIdx.x];
      } else {
        return rg[i];
      }
    };
    float2 part = make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      float fg[V], fy[V];
      Elem<T>::unpack(dy_of(i), fg);
      Elem<T>::unpack(ry[i], fy);
#pragma unroll
      for (int k = 0; k < V; ++k) fy[k] = fg[k] * fy[k];
      if (in_a(i)) {
        part.x += tree_sum<V>(fy);
      } else {
        part.y += tree_sum<V>(fy);
      }
    }
    const float2 dot = group_reduce<TPR, false>(part, red_sum);
    // As in bwd_reg_rows: opaque raw words, and the shared memory reads of dy kept below the reduction.
    if constexpr (STAGE) asm volatile("" ::: "memory");
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      asm volatile("" : "+r"(ry[i].x), "+r"(ry[i].y), "+r"(ry[i].z), "+r"(ry[i].w));
      if constexpr (!STAGE) asm volatile("" : "+r"(rg[i].x), "+r"(rg[i].y), "+r"(rg[i].z), "+r"(rg[i].w));
    }
    if (valid) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const bool ia = in_a(i);
        const int c0 = col(i);
        if (!ia && c0 >= vb * V) continue;  // beyond row b's visible vectors (no row b: vb = 0)
        float fg[V], fy[V];
        Elem<T>::unpack(dy_of(i), fg);
        Elem<T>::unpack(ry[i], fy);
        const float d = ia ? dot.x : dot.y;
#pragma unroll
        for (int k = 0; k < V; ++k) fy[k] = a.scale * fy[k] * (fg[k] - d);
        *reinterpret_cast<uint4*>(a.dx + (ia ? ra : rb) * sk + c0) = Elem<T>::pack(fy);
      }
    }
    if constexpr (!EZ) store_zeros();
    if constexpr (TPR > 32) __syncthreads();  // red_sum is read after the barrier; guard its reuse
  }
}

// ------------------------------------------------------------------------------------------------------------
// Host side: plans and launches.

constexpr int kSmallBlock = 128;  // block size when a row takes at most one warp

template <int TPR>
constexpr int block_for() {
  return TPR >= kSmallBlock ? TPR : kSmallBlock;
}

inline unsigned grid_for(int64_t rows, int rows_per_block) {
  const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
  return static_cast<unsigned>(std::min<int64_t>(blocks, std::numeric_limits<int32_t>::max()));
}

// Per-thread budget: 32 fp32 values in the forward; 16 raw 32-bit words of y (+ dy in shared memory) in the
// backward.
template <typename T>
constexpr int fwd_max_nv() {
  return sizeof(T) == 4 ? 8 : 4;
}
template <typename T>
constexpr int bwd_max_nv() {
  return 4;
}

// Rows per thread of the forward plans (fwd_reg_rows' R): the plans of one vector per thread take kFwdRowsMax rows
// per thread (within the per-thread budget); the others one. Since kFwdShortVecs, the one-vector plans serve rows of
// at most kFwdShortVecs vectors (32 keys in 16-bit, 16 in fp32), which no benchmark times. Session 10 measured R
// when the 128- and 256-key rows still ran on one-vector plans (H200, benchmarks.softmax_raw, forward, % of copy, one
// row -> four): 16-bit 77-78 -> 82-84, fp32 at 128 keys 87.5 -> 89.0, padding-masked and causal rows +2 to +4; eight
// rows per thread in fp32 fell to 66.5; two rows per thread on the two- and four-vector plans lost 1-5 points (16-bit
// 512 keys 92.8 -> 87.9, fp32 256 keys 99.6 -> 96.3), so those take one. A benchmark build may set the cap with
// -DPIPEGOOSE_SOFTMAX_FWD_ROWS=1, 2, 4 or 8 (1: one row per thread, the plans before session 10; 8: fp32 only,
// 16-bit stays at its budget of 4).
#if defined(PIPEGOOSE_SOFTMAX_FWD_ROWS)
constexpr int kFwdRowsMax = PIPEGOOSE_SOFTMAX_FWD_ROWS;
static_assert(kFwdRowsMax == 1 || kFwdRowsMax == 2 || kFwdRowsMax == 4 || kFwdRowsMax == 8,
              "PIPEGOOSE_SOFTMAX_FWD_ROWS: 1, 2, 4 or 8 rows per thread");
#else
constexpr int kFwdRowsMax = 4;
#endif
// Vectors per thread of the forward on rows of more than kFwdShortVecs and at most fwd_short_max() vectors (up to 512
// keys in 16-bit, 128 in fp32): 2 to 16 threads per row instead of up to 32 with one or two vectors each, so fewer
// shuffle steps per element and one load phase of kFwdShortVecs vectors; rows of up to kFwdShortVecs vectors keep
// one vector per thread (and several rows per thread, fwd_rows). Session 10 (H200, benchmarks.softmax_raw, forward,
// % of copy, one vector per thread -> four): 16-bit rows of 128 and 256 keys 82-84 -> 92-93, padding-masked 68-70 ->
// 89-93, causal 54-55 -> 77-80, fp32 of 128 keys 88.9 -> 97.1 (two vectors per thread: 99.3 plain, but 2-7 points
// below four on the masked and causal rows). A benchmark build may set it with -DPIPEGOOSE_SOFTMAX_FWD_VPT=1, 2 or 4
// (1: the plans before session 10).
#if defined(PIPEGOOSE_SOFTMAX_FWD_VPT)
constexpr int kFwdShortVecs = PIPEGOOSE_SOFTMAX_FWD_VPT;
static_assert(kFwdShortVecs == 1 || kFwdShortVecs == 2 || kFwdShortVecs == 4,
              "PIPEGOOSE_SOFTMAX_FWD_VPT: 1, 2 or 4 vectors per thread");
#else
constexpr int kFwdShortVecs = 4;
#endif

// Vectors per thread of the backward on rows of 129 to 512 vectors (16-bit 1025-4096 keys, fp32 513-2048) without
// the causal mask: 128 or 256 threads with two vectors each, dy and y in registers, instead of 64 or 128 threads with
// four (dy staged in shared memory). Session 11 (H200, benchmarks.softmax_raw, backward, % of copy, four -> two;
// call 2): bf16 2048 keys 95.8 -> 99.7-99.8, 4096 95.7 -> 98.9-99.1 (fp16 and padding-masked alike), fp32 1024 keys
// 100.1 -> 103.3-103.6, 2048 100.2 -> 102.5-102.6. Call 1 (two vectors on every wide plan): at 1024 vectors and beyond
// equal or worse (bf16 8192 keys 98.3 -> 96.6, fp32 8192 101.9 -> 92.6); causal rows worse at 2048 keys (bf16 84.9 ->
// 77.0, fp32 94.1 -> 90.8), better only for fp32 at 1024 (94.0 -> 95.4): causal rows keep four. A benchmark build may
// set it with -DPIPEGOOSE_SOFTMAX_BWD_MID_NV=4 (the plans before session 11) or 2.
#if defined(PIPEGOOSE_SOFTMAX_BWD_MID_NV)
constexpr int kBwdMidVecs = PIPEGOOSE_SOFTMAX_BWD_MID_NV;
static_assert(kBwdMidVecs == 2 || kBwdMidVecs == 4, "PIPEGOOSE_SOFTMAX_BWD_MID_NV: 2 or 4 vectors per thread");
#else
constexpr int kBwdMidVecs = 2;
#endif

template <typename T>
constexpr int64_t fwd_short_max() {
  // 16-bit: up to 64 vectors (16 threads x 4 vectors x 8 values: the per-thread budget of 32 values); at most 16
  // threads per row in any case
  return std::min<int64_t>(sizeof(T) == 2 ? 64 : 32, int64_t{16} * kFwdShortVecs);
}

template <typename T, int TPR, int NV>
constexpr int fwd_rows() {
  if (TPR > 32 || NV > 1) return 1;
  return fwd_max_nv<T>() < kFwdRowsMax ? fwd_max_nv<T>() : kFwdRowsMax;
}

template <typename T, int TPR, int NV, int KC = 0>
void launch_fwd(const FwdArgs<T>& a, cudaStream_t st) {
  constexpr int B = block_for<TPR>();
  constexpr int R = fwd_rows<T, TPR, NV>();
  if constexpr (fwd_raw<T, TPR, NV>() || kFwdNoMask > 0) {
    if (a.mask == nullptr && (fwd_raw<T, TPR, NV>() || kFwdNoMask == 2 || a.causal)) {
      softmax_fwd_reg_kernel<T, TPR, NV, R, B, KC, true><<<grid_for(a.rows, R * (B / TPR)), B, 0, st>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
  }
  softmax_fwd_reg_kernel<T, TPR, NV, R, B, KC><<<grid_for(a.rows, R * (B / TPR)), B, 0, st>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Shared memory a block of the current device may use (static + dynamic, after opting in), in bytes: 227 KB on sm_90,
// 163 KB on sm_80, 99 KB on sm_86 / sm_89, 64 KB on sm_75.
inline size_t smem_optin() {
  return at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
}

// A block's static + dynamic shared memory above 48 KB needs the kernel's dynamic limit raised first. The value set is
// the same for every launch of the kernel on a device (the caller's constant), so concurrent launches from several
// host threads cannot lower it under one another.
inline void allow_dynamic_smem(const void* kernel, size_t static_bytes, size_t dynamic_bytes, size_t limit) {
  if (static_bytes + dynamic_bytes > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(limit)));
}

// PAIR: softmax_bwd_causal_pair_kernel (causal_pair_takes), else softmax_bwd_reg_kernel.
template <typename T, int TPR, int NV, int KC = 0, bool PAIR = false>
void launch_bwd(const BwdArgs<T>& a, cudaStream_t st) {
  constexpr int B = block_for<TPR>();
  constexpr bool STAGE = NV >= 4;  // dy in shared memory: see softmax_bwd_reg_kernel
  constexpr int smem = STAGE ? NV * B * static_cast<int>(sizeof(uint4)) : 0;
  // the kernels' static red_sum (float, or float2 for the pairs): keep in step
  constexpr size_t kStatic = (B / 32 > 0 ? B / 32 : 1) * (PAIR ? sizeof(float2) : sizeof(float));
  auto kernel = [] {
    if constexpr (PAIR) {
      return softmax_bwd_causal_pair_kernel<T, TPR, NV, B, STAGE, causal_pair_bwd_early_zero<T, TPR, NV>()>;
    } else {
      return softmax_bwd_reg_kernel<T, TPR, NV, B, STAGE, KC>;
    }
  }();
  if constexpr (kStatic + smem > 48 * 1024) {
    if (kStatic + smem > smem_optin()) {  // sm_75 (64 KB): the plan of 1024 threads does not fit; two passes do
      softmax_bwd_two_pass_kernel<T><<<grid_for(a.rows, 1), kTwoPassBlock, 0, st>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    allow_dynamic_smem(reinterpret_cast<const void*>(kernel), kStatic, smem, smem);
  }
  const int64_t units = PAIR ? a.rows / a.sk * ((a.sk + Elem<T>::kVec) / 2) : a.rows;  // work items or rows
  kernel<<<grid_for(units, B / TPR), B, smem, st>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The staged kernel's static shared memory (red_max, red_sum): keep in step with its __shared__ arrays.
constexpr size_t kCausalSmemStatic = 2 * (kCausalSmemBlock / 32) * sizeof(float);

// Whether a forward call takes softmax_fwd_causal_smem_kernel (see kCausalSmemMin): a row's keys must also fit the
// device's shared memory (on sm_75, 64 KB, rows up to 32736 16-bit keys).
template <typename T>
bool causal_smem_takes(const FwdArgs<T>& a) {
  return sizeof(T) == 2 && kCausalSmemMin > 0 && a.causal && a.mask == nullptr && a.fast && a.y_vec &&
         a.sk >= kCausalSmemMin && a.sk <= kCausalSmemMax &&
         kCausalSmemStatic + static_cast<size_t>(a.sk) * sizeof(T) <= smem_optin();
}

template <typename T>
void launch_fwd_causal_smem(const FwdArgs<T>& a, cudaStream_t st) {
  const size_t smem = static_cast<size_t>(a.sk) * sizeof(T);
  auto kernel = softmax_fwd_causal_smem_kernel<T>;
  // one limit per device for every launch: the largest row this kernel takes there
  const size_t limit = std::min(kCausalSmemMax * sizeof(T), smem_optin() - kCausalSmemStatic);
  allow_dynamic_smem(reinterpret_cast<const void*>(kernel), kCausalSmemStatic, smem, limit);
  kernel<<<grid_for(a.rows, 1), kCausalSmemBlock, smem, st>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Whether the forward plan of TPR threads with NV vectors each has a row-pair kernel (softmax_fwd_causal_pair_kernel),
// see kCausalPair. fp32 (kCausalPair 2) up to four vectors per thread: with eight, the two rows' state spills (ptxas,
// sm_90: 64 registers and 124 bytes of spill stores).
template <typename T, int TPR, int NV>
constexpr bool causal_pair_plan() {
  if constexpr (sizeof(T) == 2) {
    return NV > 1 && (kCausalPair == 2 || (kCausalPair == 1 && TPR >= 64));
  } else {
    return NV > 1 && NV <= 4 && kCausalPair == 2;
  }
}

// Whether a forward's slots walk the heads innermost (fwd_row_of): a padding mask broadcast over d1 (stride 0, d1 > 1)
// whose rows differ along the queries (d2 > 1, stride not 0; a mask broadcast over the queries too is reread by
// consecutive rows anyway), with heads too large for the L2 to keep a mask row from one head's read of it to the next:
// a head's scores and output (d2 * sk elements each) at least half the L2. Session 29 (H200, 60 MiB of L2;
// benchmarks.softmax_raw, padding-masked forward of [b, np, sk, sk] with a [b, 1, sk, sk] mask, % of copy, two
// alternating runs, the rows' order -> heads innermost at every length):
// - heads of 32 MiB and more gained: bf16 [1, 4, 4096, 4096] (64 MiB) 80.8 -> 90.0, fp16 81.0 -> 89.8, fp32 (128
//   MiB) 90.3 -> 95.1; fp32 [1, 16, 2048, 2048] (32 MiB) 92.0 -> 93.6;
// - heads of 16 MiB and less lost up to 5.8 points: bf16 [1, 16, 2048, 2048] 89.8 -> 87.7, [4, 16, 1024, 1024]
//   92.9 -> 89.4, fp32 256 keys 98.6 -> 92.8 (only the shortest rows, 128 keys, gained 1.7-2 points).
// Causal calls with such a mask take the same bound (their rows read less: not measured). kHeadsInner 1: those calls;
// 0: none; 2: every call with such a mask, whatever the heads' size. A benchmark build may set
// -DPIPEGOOSE_SOFTMAX_HEADS_INNER=0, 1 or 2.
#if defined(PIPEGOOSE_SOFTMAX_HEADS_INNER)
constexpr int kHeadsInner = PIPEGOOSE_SOFTMAX_HEADS_INNER;
static_assert(kHeadsInner >= 0 && kHeadsInner <= 2, "PIPEGOOSE_SOFTMAX_HEADS_INNER: 0, 1 or 2");
#else
constexpr int kHeadsInner = 1;
#endif
template <typename T>
bool heads_inner_takes(const FwdArgs<T>& a) {
  if (kHeadsInner == 0 || a.mask == nullptr || a.d1 <= 1 || a.d2 <= 1 || a.ms.s1 != 0 || a.ms.s2 == 0) return false;
  const int64_t head_bytes = 2 * a.d2 * a.sk * static_cast<int64_t>(sizeof(T));
  return kHeadsInner == 2 || 2 * head_bytes >= at::cuda::getCurrentDeviceProperties()->l2CacheSize;
}

// Whether a call takes a row-pair kernel: causal, square (sq == sk, so that rows pair up within a head), without a
// padding mask, every vector whole and aligned.
template <typename T>
bool causal_pair_takes(const FwdArgs<T>& a) {
  return a.causal && a.causal_shift == 0 && a.mask == nullptr && a.fast && a.y_vec;
}
template <typename T>
bool causal_pair_takes(const BwdArgs<T>& a) {
  return a.causal && a.causal_shift == 0 && a.fast && a.dx_vec;
}

template <typename T, int TPR, int NV>
void launch_fwd_causal_pair(const FwdArgs<T>& a, cudaStream_t st) {
  constexpr int B = block_for<TPR>();
  const int64_t items = a.rows / a.sk * ((a.sk + Elem<T>::kVec) / 2);
  softmax_fwd_causal_pair_kernel<T, TPR, NV, B><<<grid_for(items, B / TPR), B, 0, st>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Largest key length served by the register-resident kernels (beyond: two-pass).
template <typename T>
constexpr int64_t fwd_register_max_cols() {
  return int64_t{1024} * fwd_max_nv<T>() * Elem<T>::kVec;
}
template <typename T>
constexpr int64_t bwd_register_max_cols() {
  return int64_t{1024} * bwd_max_nv<T>() * Elem<T>::kVec;
}

#if defined(PIPEGOOSE_SOFTMAX_KEYS)
// TPR and NV of the register-resident plan that run() takes for rows of nvec vectors, causal or not ({0, 0}: the
// two-pass kernels), as a constant expression, for the specialised key length; run() asserts that the two agree.
struct RegPlan {
  int tpr, nv;
};
template <typename T, bool BWD>
constexpr RegPlan reg_plan(int64_t nvec, bool causal) {
  constexpr int MAXNV = BWD ? bwd_max_nv<T>() : fwd_max_nv<T>();
  if (!BWD && kFwdShortVecs > 1 && nvec > kFwdShortVecs && nvec <= fwd_short_max<T>())
    for (int tpr = 2; tpr <= 16; tpr *= 2)
      if (nvec <= int64_t{tpr} * kFwdShortVecs) return {tpr, kFwdShortVecs};
  for (int tpr = 1; tpr <= 32; tpr *= 2)
    if (nvec <= tpr) return {tpr, 1};
  if (nvec <= 64) return {32, 2};
  if (nvec <= 128) return BWD && sizeof(T) == 2 ? RegPlan{64, 2} : RegPlan{32, 4};
  if (BWD && kBwdMidVecs == 2 && !causal && nvec <= 512) return {nvec <= 256 ? 128 : 256, 2};
  if (MAXNV == 8 && nvec <= 256) return {32, MAXNV};
  for (int tpr = 64; tpr <= 1024; tpr *= 2)
    if (nvec <= int64_t{tpr} * MAXNV) return {tpr, MAXNV};
  return {0, 0};
}
#endif

// Plans in order of capacity: rows of up to 32 vectors use 1..32 threads with one vector each (the forward: from
// kFwdShortVecs + 1 vectors, 2..16 threads with kFwdShortVecs vectors each), then a warp with 2, 4 (, 8) vectors
// (16-bit backward: 2 warps with 2 vectors instead of one warp with 4; the backward of rows of 129..512 vectors
// without the causal mask: 128 or 256 threads with 2, kBwdMidVecs), then 64..1024 threads with the full per-thread
// budget, then the two-pass kernels.
template <typename T, bool BWD, typename Args>
void run(const Args& a, cudaStream_t st) {
  constexpr int V = Elem<T>::kVec;
  constexpr int MAXNV = BWD ? bwd_max_nv<T>() : fwd_max_nv<T>();
  const int64_t nvec = (a.sk + V - 1) / V;
  auto go = [&](auto tpr, auto nv) {
    constexpr int TPR = decltype(tpr)::value, NV = decltype(nv)::value;
#if defined(PIPEGOOSE_SOFTMAX_KEYS)
    // Rows of kSpecKeys keys on the vector path: this plan's kernel with the key length as a constant.
    if (a.sk == kSpecKeys && a.fast) {
      constexpr RegPlan kp0 = reg_plan<T, BWD>(kSpecKeys / Elem<T>::kVec, false);
      constexpr RegPlan kp1 = reg_plan<T, BWD>(kSpecKeys / Elem<T>::kVec, true);
      const RegPlan kp = a.causal ? kp1 : kp0;
      TORCH_INTERNAL_ASSERT(kp.tpr == TPR && kp.nv == NV, "softmax: reg_plan() disagrees with run() for ",
                            kSpecKeys, " keys");
      if constexpr ((kp0.tpr == TPR && kp0.nv == NV) || (kp1.tpr == TPR && kp1.nv == NV)) {
        if constexpr (BWD) {
          launch_bwd<T, TPR, NV, kSpecKeys>(a, st);
        } else {
          launch_fwd<T, TPR, NV, kSpecKeys>(a, st);
        }
        return;
      }
    }
#endif
    if constexpr (BWD) {
      if constexpr (causal_pair_bwd_plan<T, TPR, NV>()) {
        if (causal_pair_takes(a)) return launch_bwd<T, TPR, NV, 0, true>(a, st);
      }
      launch_bwd<T, TPR, NV>(a, st);
    } else {
      if constexpr (causal_pair_plan<T, TPR, NV>()) {
        if (causal_pair_takes(a)) return launch_fwd_causal_pair<T, TPR, NV>(a, st);
      }
      launch_fwd<T, TPR, NV>(a, st);
    }
  };
  if constexpr (!BWD && sizeof(T) == 2) {
    if (causal_smem_takes(a)) return launch_fwd_causal_smem(a, st);
  }
  using I1 = std::integral_constant<int, 1>;
  using I2 = std::integral_constant<int, 2>;
  using I4 = std::integral_constant<int, 4>;
  using IMAX = std::integral_constant<int, MAXNV>;
  if constexpr (!BWD && kFwdShortVecs > 1) {
    // Forward rows of kFwdShortVecs + 1 to fwd_short_max<T>() vectors: kFwdShortVecs vectors per thread.
    using IS = std::integral_constant<int, kFwdShortVecs>;
    if (nvec > kFwdShortVecs && nvec <= fwd_short_max<T>()) {
      if (nvec <= 2 * kFwdShortVecs) return go(std::integral_constant<int, 2>{}, IS{});
      if (nvec <= 4 * kFwdShortVecs) return go(std::integral_constant<int, 4>{}, IS{});
      if (nvec <= 8 * kFwdShortVecs) return go(std::integral_constant<int, 8>{}, IS{});
      return go(std::integral_constant<int, 16>{}, IS{});
    }
  }
  if (nvec <= 1) return go(std::integral_constant<int, 1>{}, I1{});
  if (nvec <= 2) return go(std::integral_constant<int, 2>{}, I1{});
  if (nvec <= 4) return go(std::integral_constant<int, 4>{}, I1{});
  if (nvec <= 8) return go(std::integral_constant<int, 8>{}, I1{});
  if (nvec <= 16) return go(std::integral_constant<int, 16>{}, I1{});
  if (nvec <= 32) return go(std::integral_constant<int, 32>{}, I1{});
  if (nvec <= 64) return go(std::integral_constant<int, 32>{}, I2{});
  if constexpr (BWD && sizeof(T) == 2) {
    // 16-bit backward, 65..128 vectors: two warps per row with dy and y in registers. (One warp with 4 vectors
    // needs dy staged in shared memory and still spills at 64 registers.)
    if (nvec <= 128) return go(std::integral_constant<int, 64>{}, I2{});
  } else {
    if (nvec <= 128) return go(std::integral_constant<int, 32>{}, I4{});
  }
  if constexpr (BWD && kBwdMidVecs == 2) {
    if (!a.causal && nvec <= 512) {  // see kBwdMidVecs
      if (nvec <= 256) return go(std::integral_constant<int, 128>{}, I2{});
      return go(std::integral_constant<int, 256>{}, I2{});
    }
  }
  if constexpr (MAXNV == 8) {
    if (nvec <= 256) return go(std::integral_constant<int, 32>{}, IMAX{});
  }
  if (nvec <= 64 * MAXNV) return go(std::integral_constant<int, 64>{}, IMAX{});
  if (nvec <= 128 * MAXNV) return go(std::integral_constant<int, 128>{}, IMAX{});
  if (nvec <= 256 * MAXNV) return go(std::integral_constant<int, 256>{}, IMAX{});
  if (nvec <= 512 * MAXNV) return go(std::integral_constant<int, 512>{}, IMAX{});
  if (nvec <= 1024 * MAXNV) return go(std::integral_constant<int, 1024>{}, IMAX{});
  if constexpr (BWD) {
    softmax_bwd_two_pass_kernel<T><<<grid_for(a.rows, 1), kTwoPassBlock, 0, st>>>(a);
  } else {
    softmax_fwd_two_pass_kernel<T><<<grid_for(a.rows, 1), kTwoPassBlock, 0, st>>>(a);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// One translation unit per dtype (softmax_fp32.cu, softmax_fp16.cu, softmax_bf16.cu) instantiates these, so that
// a parallel build compiles the three at once.
void launch_forward(const FwdArgs<float>& a, cudaStream_t st);
void launch_forward(const FwdArgs<__half>& a, cudaStream_t st);
void launch_forward(const FwdArgs<__nv_bfloat16>& a, cudaStream_t st);
void launch_backward(const BwdArgs<float>& a, cudaStream_t st);
void launch_backward(const BwdArgs<__half>& a, cudaStream_t st);
void launch_backward(const BwdArgs<__nv_bfloat16>& a, cudaStream_t st);

}  // namespace softmax_detail
}  // namespace pipegoose
