// Rotary position embedding (RoPE, the rotate-half form of GPT-NeoX, Llama and their copies in transformers'
// apply_rotary_pos_emb) applied to the query and the key of an attention layer in one launch, forward and backward,
// for fp32, fp16 and bf16 tensors with fp32 math. Written for pipegoose; ops pipegoose::rope_forward / rope_backward
// / rope (binding: pipegoose/kernels/bindings/rope.cpp; schemas: docs/architecture.md "Op schemas").
//
// rope_forward(q [B, Hq, S, D], k [B, Hk, S, D], cos [Bc, S, R], sin [Bc, S, R]) -> (q_embed, k_embed), Bc 1 or B,
// R the rotated values of a head: D, or an even 2 <= R < D (partial rotary, GPT-NeoX's: the rest pass through):
//     x_embed = x * cos + rotate_half(x) * sin,   rotate_half(x) = cat(-x[..., R/2:R], x[..., :R/2])
//   on x[..., :R], with cos and sin broadcast over the heads (transformers' cos.unsqueeze(1)), that is, per half of
//   the rotated values:
//     y1 = x1 * c1 - x2 * s1,   y2 = x2 * c2 + x1 * s2,   y[..., R:] = x[..., R:]
// rope_backward(grad_q_embed, grad_k_embed, cos, sin, dtype=None) -> (grad_q, grad_k), the transposed rotation:
//     g1 = dy1 * c1 + dy2 * s2,   g2 = dy2 * c2 - dy1 * s1,   g[..., R:] = dy[..., R:]
// interleaved=True: the rotation of GPT-J, Cohere and GLM (transformers' rotate_half of x[..., ::2] and x[..., 1::2]),
// pairs of neighbours on x[..., :R]:
//     y[2i] = x[2i] c[2i] - x[2i+1] s[2i],   y[2i+1] = x[2i+1] c[2i+1] + x[2i] s[2i+1]
//   backward: g[2i] = dy[2i] c[2i] + dy[2i+1] s[2i+1],   g[2i+1] = dy[2i+1] c[2i+1] - dy[2i] s[2i]
//   (the tables as given, per value: Cohere's repeat each frequency twice, cos[2i] == cos[2i+1]; GLM's function makes
//   them so from its rotate-half tables before the call).
// cos and sin are used as given (both halves read: no assumption that cos[:R/2] == cos[R/2:R], as it is in Llama's
// tables), and they get no gradient. Each value is computed in fp32 and rounded once to the dtype (eager PyTorch in
// 16-bit rounds each product and the sum: three roundings; the kernel is the closer to exact).
//
// Layout: any strides for q, k, the gradients, cos and sin, as long as the last dimension is contiguous (stride 1; a
// tensor whose last stride is not 1 is copied first). Outputs are torch.empty_like their input: its strides where it is
// dense (a query of Llama, a transposed [B, S, H, D] projection, gives a result of the same layout, as eager PyTorch's
// product does), else dense strides in the input's order of dimensions. Dtypes: one for q, k, cos and sin (fp32, fp16,
// bf16), or fp16 / bf16 q and k with fp32 cos and sin, as under autocast, whose results are fp32 (PyTorch's promotion
// of q * cos; the passed-through values are converted, as torch.cat promotes them); the backward converts the output
// gradients to cos's dtype and writes the input gradients in `dtype` (q's; default cos's). R even. 64-bit offsets.
// Errors (RuntimeError naming the argument): not CUDA, devices differ, dtypes not one of those pairs, ranks or sizes
// that do not match the shapes above.
//
// Work (interleaved: one thread per (token, head, vector of the rotated values), whole pairs in each vector, or one
// value with its partner where no two load as one; the vectors passed through as below; never staged or laned).
// Rotate-half: one thread per (token, head, vector of a half): it loads 16 bytes of each half of the rotated values (8
// 16-bit or 4 fp32 values) and the matching vectors of cos and sin (the same for every head of a token: L1 hits), and
// stores 16 bytes of each half of the output; with partial rotary, one thread per group of vectors of the
// passed-through values copies them (one launch each way: the whole head read once and written once). Consecutive
// threads take consecutive vectors of a head (the rotated ones, then those passed through), then the next head: a
// token's heads are contiguous in Llama's layout, so a warp reads and writes whole lines. Where a pointer or a stride
// is not a multiple of 16 bytes, or R/2 or D - R not a multiple of the vector, the same kernel runs on the widest
// vector that fits (8, 4 or 2 bytes), down to one element per thread. A thread passes through two vectors of the widest
// width (16 bytes of the widest type; one where their count is odd; session 57, H100, bf16 forward + backward, Pythia's
// heads of 64 and 128 values with a quarter rotated: 81-82% of copy, against 72-73% with one), or up to 16 bytes' worth
// of narrower ones, as many as divide their count (session 56: Pythia-2.8b's heads, 80 values and 20 rotated, ran at
// 38% of copy with one vector of 4 bytes a thread and at 66% with three). Where the vectors are narrower than 16 bytes
// (the halves of the rotated values, or the tables' alignment, allow no wider) and the heads move in 16-byte chunks
// (one dtype in and out; head size, the four pointers of q, k and their results and every stride of them multiples of
// 16 bytes; a head at most 1 KiB; R/2 at most 32 vectors), rope_staged_kernel runs instead: each warp stages a few
// whole heads in shared memory (loaded and stored in 16-byte chunks), rotating them there (session 59, H100, bf16
// forward + backward, % of copy: Pythia-2.8b's heads of 80 with 20 rotated 65 -> 85, GPT-NeoX-20B's of 96 with 24
// rotated 72 -> 89; torch.compile 78 and 88). Where the halves take 16-byte vectors but only part of the head rotates,
// and a 16-bit head is 1 to 32 16-byte chunks dividing a warp (same conditions otherwise), rope_lane_kernel runs: a
// lane a chunk of the head, the partner vector by warp shuffles (session 60, H100, bf16 forward + backward: Pythia's
// heads of 64 and 128 with a quarter rotated 80-82 -> 88, torch.compile 84; on the H200 70 -> 70-71; 16-bit only).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>

#include "pipegoose_check.h"

namespace pipegoose {
namespace {

// Benchmark experiment (the build without it is what ships): -DPIPEGOOSE_ROPE_THREADS=N threads per block. (Several
// heads per thread, the cos / sin vectors loaded once for them, ran slower in bf16: session48.log, call 4.)
#ifndef PIPEGOOSE_ROPE_THREADS
#define PIPEGOOSE_ROPE_THREADS 256
#endif
constexpr int kThreads = PIPEGOOSE_ROPE_THREADS;
static_assert(kThreads % 32 == 0 && kThreads >= 32, "PIPEGOOSE_ROPE_THREADS: whole warps (the staged kernel's tiles)");
// The most bytes that one thread passes through with partial rotary where the values move in 16-byte vectors (narrower
// vectors: 16 bytes' worth). Benchmark experiment: -DPIPEGOOSE_ROPE_COPY_BYTES=B, a multiple of 16. Session 57, H100,
// bf16 forward + backward, % of copy (benchmarks.rope_partial; torch.compile 83 and 78):
//   heads of 64 and 128 values, a quarter rotated (16-byte vectors): 16 bytes 72-73, 32 bytes 81-82, 64 bytes 67-75;
//   heads of 80 with 20 rotated (4-byte vectors): 16 bytes 66, 32 bytes 57, 64 bytes 32.
// Slower: a thread taking every n-th vector of its head rather than contiguous ones, in the widest bitwise copy that
// fits (8 bytes for the heads of 80): 75-77 and 62 at 32 bytes (a later call than the numbers above, on the same GPU);
// in runs beside the shipped rule, a rotating thread taking 2 or 4 vectors of each half rather than one: whole heads
// of 64 values 89 -> 76 and 44, of 128 values 89 -> 82 and 65; and, where the halves take narrower vectors, up to 16
// or 32 bytes of them (the heads of 80: 3 + 2 or all 5 of a half's 4-byte vectors in a thread): 66 -> 53 and 43.
// Also slower (session 58, H100, bf16 forward + backward, each in its own process beside the shipped build:
// benchmarks/results/nvidia_h100_80gb_hbm3_2026-12-05/s58_rope_experiments_call1.md): __launch_bounds__(256, 8), at
// most 32 registers a thread for full occupancy (the 16-bit kernels of 16-byte vectors take 40 without it; four
// instances then spilled 8-16 bytes): quarter-rotated heads of 64 and 128 values 80-83 -> 66-73, whole heads 90-91 ->
// 86-87; and, for the heads of 80 with 20 rotated, one thread a 16-byte chunk of the head, rotated or not, loaded and
// stored whole with each rotated value's partner, cos and sin in scalar loads: 63 -> 52.
#ifndef PIPEGOOSE_ROPE_COPY_BYTES
#define PIPEGOOSE_ROPE_COPY_BYTES 32
#endif
static_assert(PIPEGOOSE_ROPE_COPY_BYTES >= 16 && PIPEGOOSE_ROPE_COPY_BYTES % 16 == 0,
              "PIPEGOOSE_ROPE_COPY_BYTES: a multiple of 16");
// The staged kernel (rope_staged_kernel): where the halves of the rotated values take vectors narrower than 16 bytes
// (Pythia-2.8b's heads of 80 values, 20 rotated: 4-byte vectors in 16-bit), each warp loads whole heads into shared
// memory in 16-byte chunks, rotates them there, and stores them in 16-byte chunks: every 32-byte sector read once and
// written whole, where the per-vector kernel's narrow loads and stores touch each sector several times (ncu, session
// 59, H100, bf16 forward of 4x2048x32 heads of 80: 18.0M L1-L2 sectors, 56% of them excess, L2 83% busy and DRAM 61%;
// torch.compile's kernel 13.7M, DRAM 73%). Benchmark experiments: -DPIPEGOOSE_ROPE_STAGE=0 never stages (the
// per-vector kernel everywhere), 2 stages wherever it fits (16-byte vectors too); -DPIPEGOOSE_ROPE_STAGE_VECS=N
// 16-byte chunks a lane (a warp's tile: 32 * N chunks). Both measured only on an earlier form of the staged kernel (a
// loop of the warp's lanes over its vectors, 73% of copy at the heads of 80 where the shipped form runs 85): staging
// 16-byte vectors took the quarter-rotated and whole heads from 80-91% to 67-70, and 4 chunks a lane the heads of 80
// from 73 to 64. Measurements: benchmarks/results/nvidia_h100_80gb_hbm3_2026-12-05/s59_rope_staged.md.
#ifndef PIPEGOOSE_ROPE_STAGE
#define PIPEGOOSE_ROPE_STAGE 1
#endif
#ifndef PIPEGOOSE_ROPE_STAGE_VECS
#define PIPEGOOSE_ROPE_STAGE_VECS 2
#endif
constexpr int kStageVecs = PIPEGOOSE_ROPE_STAGE_VECS;
static_assert(kStageVecs >= 1 && kStageVecs <= 8, "PIPEGOOSE_ROPE_STAGE_VECS: 1 to 8");
// The lane kernel (rope_lane_kernel): where the halves of the rotated values take 16-byte vectors but the rotated
// values are only part of the head (Pythia's heads of 64 and 128 values, a quarter rotated), one lane a 16-byte chunk
// of the head, rotated or passed through, its partner vector in the other half taken from the partner lane with warp
// shuffles: every load and store of a warp one run of whole sectors. The per-vector kernel's lanes there move 16 of
// each 32 bytes an instruction (a rotating lane x1 and x2 of one sector, a copying lane two halves of sectors).
// Session 60, forward + backward, % of copy (benchmarks.rope_partial --raw, GPT-NeoX's layout; "Session 60" in
// benchmarks/results/nvidia_h100_80gb_hbm3_2026-12-05/SUMMARY.md, the H200's run in ../nvidia_h200_2026-12-05), heads
// of 64 and 128 with a quarter rotated:
//   H100: bf16 80.4 / 82.3 -> 88.1 / 88.0 (torch.compile 83.5 / 83.9; 4 tiles a warp 87.5 / 86.9, 1 tile 84.6 /
//         84.4); fp32 91.6 / 92.8 -> 93.1 / 91.5, at 4 tiles 95.5 / 95.0 (compile 94.9 / 96.4);
//   H200 (4.1 TB/s of copy: at these sizes 16-bit runs near 70% whichever kernel, compile too): bf16 69.0 / 72.1 ->
//         70.0 / 71.0, fp16 70.5 / 72.4 -> 74.1 / 72.7; fp32 at 4 tiles 86.6 / 88.8 -> 85.5 / 84.3.
// So 16-bit only (fp32: the per-vector kernel). Heads whose chunks leave lanes idle ran slower than the per-vector
// kernel (H100, fp32 heads of 96, 24 chunks: 94.0 -> 84.6), and so did whole heads (H100, -DPIPEGOOSE_ROPE_LANES=2:
// bf16 heads of 64 and 128 91.1 / 89.6 -> 89.4 / 88.4): the lane kernel takes 16-bit heads of 1 to 32 chunks that
// divide a warp, rotated in part only. Benchmark experiments: -DPIPEGOOSE_ROPE_LANES=0 never (the per-vector kernel),
// 2 also for whole heads, 3 also for fp32; -DPIPEGOOSE_ROPE_LANE_TILES=N warp tiles a warp (N chunks a lane in flight).
#ifndef PIPEGOOSE_ROPE_LANES
#define PIPEGOOSE_ROPE_LANES 1
#endif
#ifndef PIPEGOOSE_ROPE_LANE_TILES
#define PIPEGOOSE_ROPE_LANE_TILES 2
#endif
constexpr int kLaneTiles = PIPEGOOSE_ROPE_LANE_TILES;
static_assert(kLaneTiles >= 1 && kLaneTiles <= 8, "PIPEGOOSE_ROPE_LANE_TILES: 1 to 8");

template <typename T> __device__ __forceinline__ float to_f(T x) { return static_cast<float>(x); }
template <typename T> __device__ __forceinline__ T from_f(float x) { return static_cast<T>(x); }

// One tensor of [B, H, S, D] elements: its strides (elements) and, for an output, those of the result.
struct Strides {
  int64_t b, h, s;
};

struct Params {
  const void* q;
  const void* k;
  void* q_out;
  void* k_out;
  const void* cos;
  const void* sin;
  Strides q_in, q_res, k_in, k_res;
  int64_t cos_b, cos_s, sin_b, sin_s;  // batch stride 0 where cos / sin hold one batch
  int64_t items;                      // B * S * (Hq + Hk) * (vecs + copies)
  int32_t seq, heads_q, heads, half;   // heads = Hq + Hk; half = R / 2
  int32_t vecs;                        // vectors per half of the rotated values
  int32_t copies, group;               // threads that pass a head's D - R last values through, vectors each
  int32_t dim, chunks, rows_per_block;  // the staged and lane kernels: D, 16-byte chunks a head, heads a warp tile
                                        // (items: heads)
  bool interleaved;                     // pairs (2i, 2i + 1) rotate (vecs: vectors of all R rotated values)
};

// The size of the widest of the three types; the elements of a 16-byte vector of it (the widest vector of a
// launch), and the most elements one thread passes through at v elements a vector (PIPEGOOSE_ROPE_COPY_BYTES of it
// where v is that widest vector, else 16 bytes' worth).
template <typename TI, typename TC, typename TO>
constexpr int kWidestSize = static_cast<int>(sizeof(TI) > sizeof(TC) ? (sizeof(TI) > sizeof(TO) ? sizeof(TI)
                                                                                                  : sizeof(TO))
                                                                     : (sizeof(TC) > sizeof(TO) ? sizeof(TC)
                                                                                                : sizeof(TO)));
template <typename TI, typename TC, typename TO>
constexpr int kWidestVec = 16 / kWidestSize<TI, TC, TO>;
template <typename TI, typename TC, typename TO>
constexpr int copy_elems(int v) {
  return (v == kWidestVec<TI, TC, TO> ? PIPEGOOSE_ROPE_COPY_BYTES : 16) / kWidestSize<TI, TC, TO>;
}

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

// 16-, 8- and 4-byte vectors move as uint4 / uint2 / uint32_t (one 128-, 64- or 32-bit load or store); ro: through the
// read-only cache (cos and sin).
template <typename T, int V, bool ro = false>
__device__ __forceinline__ Vec<T, V> load(const T* p) {
  Vec<T, V> r;
  if constexpr (V * sizeof(T) == 16) {
    const uint4 u = ro ? __ldg(reinterpret_cast<const uint4*>(p)) : *reinterpret_cast<const uint4*>(p);
    r = *reinterpret_cast<const Vec<T, V>*>(&u);
  } else if constexpr (V * sizeof(T) == 8) {
    const uint2 u = ro ? __ldg(reinterpret_cast<const uint2*>(p)) : *reinterpret_cast<const uint2*>(p);
    r = *reinterpret_cast<const Vec<T, V>*>(&u);
  } else if constexpr (V > 1 && V * sizeof(T) == 4) {
    const uint32_t u = ro ? __ldg(reinterpret_cast<const unsigned int*>(p)) : *reinterpret_cast<const uint32_t*>(p);
    r = *reinterpret_cast<const Vec<T, V>*>(&u);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) r.v[j] = p[j];
  }
  return r;
}

template <typename T, int V>
__device__ __forceinline__ void store(T* p, const Vec<T, V>& r) {
  if constexpr (V * sizeof(T) == 16) {
    *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&r);
  } else if constexpr (V * sizeof(T) == 8) {
    *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(&r);
  } else if constexpr (V > 1 && V * sizeof(T) == 4) {
    *reinterpret_cast<uint32_t*>(p) = *reinterpret_cast<const uint32_t*>(&r);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) p[j] = r.v[j];
  }
}

// Where one head of one token lives: its first element in the input and in the result (elements from the tensor's
// start), its batch and position (the tables' row), and whether it is q's or k's. head counts q's heads, then k's.
template <typename I>
struct Head {
  int64_t in, res;
  I b, s;
  bool is_q;
};

template <typename I>
__device__ __forceinline__ Head<I> head_at(const Params& p, I token, I head) {
  Head<I> h;
  h.b = token / p.seq;
  h.s = token - h.b * p.seq;
  h.is_q = head < static_cast<I>(p.heads_q);
  if (!h.is_q) head -= p.heads_q;
  const Strides in = h.is_q ? p.q_in : p.k_in;
  const Strides res = h.is_q ? p.q_res : p.k_res;
  h.in = static_cast<int64_t>(h.b) * in.b + static_cast<int64_t>(head) * in.h + static_cast<int64_t>(h.s) * in.s;
  h.res = static_cast<int64_t>(h.b) * res.b + static_cast<int64_t>(head) * res.h + static_cast<int64_t>(h.s) * res.s;
  return h;
}

// The tables' vectors of V elements at element e of row (b, s): cos and sin of each half of the rotated values.
template <typename TC, int V>
struct Tables {
  Vec<TC, V> c1, c2, s1, s2;
};

template <typename TC, int V, typename I>
__device__ __forceinline__ Tables<TC, V> tables_at(const Params& p, I b, I s, int64_t e) {
  const TC* c = static_cast<const TC*>(p.cos) + (static_cast<int64_t>(b) * p.cos_b +
                                                 static_cast<int64_t>(s) * p.cos_s + e);
  const TC* n = static_cast<const TC*>(p.sin) + (static_cast<int64_t>(b) * p.sin_b +
                                                 static_cast<int64_t>(s) * p.sin_s + e);
  return {load<TC, V, true>(c), load<TC, V, true>(c + p.half), load<TC, V, true>(n), load<TC, V, true>(n + p.half)};
}

// The rotation of one vector of each half (x1 at element e of the head, x2 at e + R/2) with the tables' vectors at the
// same elements; kBwd: the transposed rotation.
template <typename TI, typename TC, typename TO, int V, bool kBwd>
__device__ __forceinline__ void rotate_pair(const Tables<TC, V>& t, const Vec<TI, V>& x1, const Vec<TI, V>& x2,
                                            Vec<TO, V>& y1, Vec<TO, V>& y2) {
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float a = to_f(x1.v[j]), d = to_f(x2.v[j]);
    // one product rounded, then a fused multiply-add, spelled out so that every build and path (vector or scalar,
    // staged or not) rounds alike (left to the compiler, the contraction differed between the two paths by an ulp in
    // fp32)
    if (kBwd) {
      y1.v[j] = from_f<TO>(__fmaf_rn(a, to_f(t.c1.v[j]), __fmul_rn(d, to_f(t.s2.v[j]))));
      y2.v[j] = from_f<TO>(__fmaf_rn(d, to_f(t.c2.v[j]), -__fmul_rn(a, to_f(t.s1.v[j]))));
    } else {
      y1.v[j] = from_f<TO>(__fmaf_rn(a, to_f(t.c1.v[j]), -__fmul_rn(d, to_f(t.s1.v[j]))));
      y2.v[j] = from_f<TO>(__fmaf_rn(d, to_f(t.c2.v[j]), __fmul_rn(a, to_f(t.s2.v[j]))));
    }
  }
}

// The interleaved rotation (GPT-J's, Cohere's, GLM's: pairs of neighbours (x[2i], x[2i + 1]) rotate) of the V values
// at element e of the head (e even; x, y and the tables' rows c, n already at e), forward:
//     y[2i] = x[2i] c[2i] - x[2i+1] s[2i],   y[2i+1] = x[2i+1] c[2i+1] + x[2i] s[2i+1],
// backward (the transposed rotation):
//     g[2i] = dy[2i] c[2i] + dy[2i+1] s[2i+1],   g[2i+1] = dy[2i+1] c[2i+1] - dy[2i] s[2i],
// each value one product rounded then a fused multiply-add, as rotate_pair. With V = 1 (a misaligned view, or an odd
// head size: no two values load as one) a thread computes its own value, loading its partner and, in the backward, the
// partner's sine as scalars (each value then read twice: the narrow path only).
template <typename TI, typename TC, typename TO, int V, bool kBwd>
__device__ __forceinline__ void rotate_interleaved(const TI* x, const TC* c, const TC* n, int64_t e, TO* y) {
  const Vec<TI, V> xv = load<TI, V>(x);
  const Vec<TC, V> cv = load<TC, V, true>(c), sv = load<TC, V, true>(n);
  Vec<TO, V> yv;
  if constexpr (V == 1) {
    const bool even = (e & 1) == 0;
    const int to = even ? 1 : -1;   // the partner's offset
    const float m = __fmul_rn(to_f(x[to]), to_f(kBwd ? n[to] : sv.v[0]));
    yv.v[0] = from_f<TO>(__fmaf_rn(to_f(xv.v[0]), to_f(cv.v[0]), even != kBwd ? -m : m));
  } else {
    static_assert(V % 2 == 0, "whole pairs a vector");
#pragma unroll
    for (int j = 0; j < V; j += 2) {
      const float a = to_f(xv.v[j]), d = to_f(xv.v[j + 1]);
      if (kBwd) {
        yv.v[j] = from_f<TO>(__fmaf_rn(a, to_f(cv.v[j]), __fmul_rn(d, to_f(sv.v[j + 1]))));
        yv.v[j + 1] = from_f<TO>(__fmaf_rn(d, to_f(cv.v[j + 1]), -__fmul_rn(a, to_f(sv.v[j]))));
      } else {
        yv.v[j] = from_f<TO>(__fmaf_rn(a, to_f(cv.v[j]), -__fmul_rn(d, to_f(sv.v[j]))));
        yv.v[j + 1] = from_f<TO>(__fmaf_rn(d, to_f(cv.v[j + 1]), __fmul_rn(a, to_f(sv.v[j + 1]))));
      }
    }
  }
  store<TO, V>(y, yv);
}

// TI: the rotated tensors' element type (q, k; the output gradients), TC: cos and sin's, TO: the results'; kBwd: the
// transposed rotation (the backward); I: the index type of the item arithmetic (32-bit where it fits); kInter: the
// interleaved rotation (rotate_interleaved: a thread a vector of the R rotated values, vecs of them), else rotate-half.
template <typename TI, typename TC, typename TO, int V, bool kBwd, typename I, bool kInter = false>
__global__ void __launch_bounds__(kThreads) rope_kernel(const Params p) {
  const I item = static_cast<I>(blockIdx.x) * kThreads + threadIdx.x;
  if (item >= static_cast<I>(p.items)) return;
  const I per_head = static_cast<I>(p.vecs) + p.copies;
  const I per_token = static_cast<I>(p.heads) * per_head;
  const I token = item / per_token;
  const I r = item - token * per_token;
  const I head = r / per_head;
  const I w = r - head * per_head;   // this thread's vector of the head: rotated below vecs, else passed through
  const Head<I> h = head_at<I>(p, token, head);
  // first element of this vector within the head: in the first half of the rotated values, or past them (the first
  // of the thread's group of vectors passed through)
  const I e = w < static_cast<I>(p.vecs) ? w * V : 2 * static_cast<I>(p.half) + (w - p.vecs) * p.group * V;
  const TI* x = static_cast<const TI*>(h.is_q ? p.q : p.k) + (h.in + e);
  TO* y = static_cast<TO*>(h.is_q ? p.q_out : p.k_out) + (h.res + e);
  if (w >= static_cast<I>(p.vecs)) {   // partial rotary: passed through (converted where TO is not TI)
    // group vectors of V (up to copy_elems(V) elements in all): every load in flight before the first store
    constexpr int kGroup = copy_elems<TI, TC, TO>(V) / V;
    Vec<TI, V> a[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      if (g < p.group) a[g] = load<TI, V>(x + g * V);
    }
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      if (g < p.group) {
        Vec<TO, V> o;
#pragma unroll
        for (int j = 0; j < V; ++j) o.v[j] = from_f<TO>(to_f(a[g].v[j]));
        store<TO, V>(y + g * V, o);
      }
    }
    return;
  }
  if constexpr (kInter) {
    const int64_t t = static_cast<int64_t>(h.b) * p.cos_b + static_cast<int64_t>(h.s) * p.cos_s + e;
    const int64_t u = static_cast<int64_t>(h.b) * p.sin_b + static_cast<int64_t>(h.s) * p.sin_s + e;
    rotate_interleaved<TI, TC, TO, V, kBwd>(x, static_cast<const TC*>(p.cos) + t, static_cast<const TC*>(p.sin) + u,
                                            e, y);
    return;
  }
  const Vec<TI, V> x1 = load<TI, V>(x);
  const Vec<TI, V> x2 = load<TI, V>(x + p.half);
  Vec<TO, V> y1, y2;
  rotate_pair<TI, TC, TO, V, kBwd>(tables_at<TC, V, I>(p, h.b, h.s, e), x1, x2, y1, y2);
  store<TO, V>(y, y1);
  store<TO, V>(y + p.half, y2);
}

// The staged kernel (one type T for q, k and the results; TC the tables'): each warp takes rows_per_block (here: a
// warp's) heads of the items (token-major, q's heads then k's), from (blockIdx.x * warps + warp) * rows_per_block.
// Each lane loads up to kStageVecs 16-byte chunks of those heads into the warp's part of shared memory (consecutive
// lanes, consecutive chunks: whole sectors), the warp rotates the vectors of V elements there (one lane a vector of
// the first half and its partner, as rope_kernel does), and each lane stores the chunks it loaded. Warps go on
// independently (__syncwarp; session 59, H100, bf16 forward + backward: one tile a block between two __syncthreads
// ran Pythia-2.8b's heads at 69% of copy; a loop of the warp's lanes over its vectors, each lane's vector and tables
// found after the chunks loaded, at 73, and GPT-NeoX-20B's at 75, against 85 and 89). Needs: D * sizeof(T) a multiple
// of 16 and at most a warp's tile, R/2 at most 32 vectors, every pointer and head stride a multiple of 16 bytes
// (launch() checks).
template <typename T, typename TC, int V, bool kBwd, typename I>
__global__ void __launch_bounds__(kThreads) rope_staged_kernel(const Params p) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kChunk = 16 / sizeof(T);   // elements of a chunk
  __shared__ uint4 tiles[kWarps][32 * kStageVecs];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const I first = (static_cast<I>(blockIdx.x) * kWarps + warp) * p.rows_per_block;
  if (first >= static_cast<I>(p.items)) return;   // (the whole warp)
  uint4* tile = tiles[warp];
  const int rows = min(static_cast<I>(p.rows_per_block), static_cast<I>(p.items) - first);
  const int chunks = rows * p.chunks;
  // this lane's vector of the rotated values (rows * vecs <= 32: one a lane at most). Its tables load after the
  // chunks: loaded before them (with the chunks in flight), Pythia-2.8b's heads ran at 82% of copy and GPT-NeoX-20B's
  // at 76, against 85 and 89 (session 59, H100, bf16 forward + backward)
  const int task_row = lane / p.vecs;
  const int e = (lane - task_row * p.vecs) * V;
  T* out[kStageVecs];   // each loaded chunk's place in its result (nullptr: none)
#pragma unroll
  for (int i = 0; i < kStageVecs; ++i) {
    const int c = lane + i * 32;
    out[i] = nullptr;
    if (c < chunks) {
      const int row = c / p.chunks;
      const int at = (c - row * p.chunks) * kChunk;
      const I item = first + row;
      const I token = item / p.heads;
      const Head<I> h = head_at<I>(p, token, item - token * p.heads);
      tile[c] = *reinterpret_cast<const uint4*>(static_cast<const T*>(h.is_q ? p.q : p.k) + (h.in + at));
      out[i] = static_cast<T*>(h.is_q ? p.q_out : p.k_out) + (h.res + at);
    }
  }
  __syncwarp();
  if (task_row < rows) {
    const I token = (first + task_row) / p.heads;
    const I b = token / p.seq;
    const Tables<TC, V> t = tables_at<TC, V, I>(p, b, token - b * p.seq, e);
    T* x = reinterpret_cast<T*>(tile) + task_row * p.dim + e;
    Vec<T, V> y1, y2;
    rotate_pair<T, TC, T, V, kBwd>(t, load<T, V>(x), load<T, V>(x + p.half), y1, y2);
    store<T, V>(x, y1);
    store<T, V>(x + p.half, y2);
  }
  __syncwarp();
#pragma unroll
  for (int i = 0; i < kStageVecs; ++i) {
    if (out[i] != nullptr) *reinterpret_cast<uint4*>(out[i]) = tile[lane + i * 32];
  }
}

// The lane kernel (one type T for q, k, the results and, then, the tables; V: 16 bytes of T): each warp takes
// kLaneTiles tiles of rows_per_block (32 / chunks) heads, a lane a 16-byte chunk of one head. A lane of the first
// half of the rotated values gets its partner of the second half from the lane vecs to its right (__shfl_sync of the
// four words), and the reverse; each lane loads the table vectors of its own value (cos) and of the sine its formula
// takes (rotate_pair's, one half of it: bit for bit the same results), the lanes past the rotated values store what
// they loaded. Every chunk's load is issued before the first
// shuffle; all lanes take part in every shuffle (no early return). Needs: D * sizeof(T) 16 bytes times a divisor of 32
// (1 to 32 chunks; the kernel itself idles the lanes past the tile's heads, slower where tried), R/2 a multiple of V,
// every pointer and stride a multiple of 16 bytes (launch() checks).
template <typename T, int V, bool kBwd, typename I>
__global__ void __launch_bounds__(kThreads) rope_lane_kernel(const Params p) {
  constexpr int kWarps = kThreads / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = lane / p.chunks;
  const int c = lane - row * p.chunks;                     // this lane's chunk of its head
  const bool rot = c < 2 * p.vecs, first = c < p.vecs;     // rotated; in the first half
  // (an idle lane, past the warp tile's heads, takes its own words)
  const int partner = !rot || row >= p.rows_per_block ? lane : first ? lane + p.vecs : lane - p.vecs;
  const int ec = rot ? c * V : 0;                          // own element in the head (the cos vector's)
  const int ep = rot ? (first ? ec + p.half : ec - p.half) : 0;   // the partner's element
  const I tile0 = (static_cast<I>(blockIdx.x) * kWarps + warp) * kLaneTiles;
  uint4 a[kLaneTiles];
  T* out[kLaneTiles];
  I bs[kLaneTiles][2];
#pragma unroll
  for (int i = 0; i < kLaneTiles; ++i) {
    const I item = (tile0 + i) * static_cast<I>(p.rows_per_block) + row;
    a[i] = make_uint4(0u, 0u, 0u, 0u);
    out[i] = nullptr;
    bs[i][0] = bs[i][1] = 0;
    if (row < p.rows_per_block && item < static_cast<I>(p.items)) {
      const I token = item / p.heads;
      const Head<I> h = head_at<I>(p, token, item - token * p.heads);
      a[i] = *reinterpret_cast<const uint4*>(static_cast<const T*>(h.is_q ? p.q : p.k) + (h.in + c * V));
      out[i] = static_cast<T*>(h.is_q ? p.q_out : p.k_out) + (h.res + c * V);
      bs[i][0] = h.b;
      bs[i][1] = h.s;
    }
  }
#pragma unroll
  for (int i = 0; i < kLaneTiles; ++i) {
    uint4 o;
    o.x = __shfl_sync(0xffffffffu, a[i].x, partner);
    o.y = __shfl_sync(0xffffffffu, a[i].y, partner);
    o.z = __shfl_sync(0xffffffffu, a[i].z, partner);
    o.w = __shfl_sync(0xffffffffu, a[i].w, partner);
    if (out[i] == nullptr) continue;
    if (!rot) {
      *reinterpret_cast<uint4*>(out[i]) = a[i];
      continue;
    }
    // forward: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2; backward: g1 = dy1 c1 + dy2 s2, g2 = dy2 c2 - dy1 s1: the
    // own value times the cos at its element, and the partner's times the sine at the own element (forward) or at
    // the partner's (backward), subtracted in the first half of the forward and the second of the backward
    const int64_t tb = static_cast<int64_t>(bs[i][0]), ts = static_cast<int64_t>(bs[i][1]);
    const T* cp = static_cast<const T*>(p.cos) + (tb * p.cos_b + ts * p.cos_s);
    const T* sp = static_cast<const T*>(p.sin) + (tb * p.sin_b + ts * p.sin_s);
    const Vec<T, V> cv = load<T, V, true>(cp + ec);
    const Vec<T, V> sv = load<T, V, true>(sp + (kBwd ? ep : ec));
    const bool minus = first != kBwd;
    const Vec<T, V> own = *reinterpret_cast<const Vec<T, V>*>(&a[i]);
    const Vec<T, V> other = *reinterpret_cast<const Vec<T, V>*>(&o);
    Vec<T, V> y;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const float m = __fmul_rn(to_f(other.v[j]), to_f(sv.v[j]));
      y.v[j] = from_f<T>(__fmaf_rn(to_f(own.v[j]), to_f(cv.v[j]), minus ? -m : m));
    }
    store<T, V>(out[i], y);
  }
}

const char* kFwd = "pipegoose::rope_forward";
const char* kBwd = "pipegoose::rope_backward";

// The rank and sizes of q-like tensors ([B, H, S, D]) and of cos / sin ([Bc, S, R]); the dtype and device of all.
void check_args(const char* op, const char* qn, const at::Tensor& q, const char* kn, const at::Tensor& k,
                const at::Tensor& cos, const at::Tensor& sin) {
  PG_CHECK(q.defined() && k.defined() && cos.defined() && sin.defined(), op, ": ", qn, ", ", kn,
           ", cos and sin must be defined tensors");
  PG_CHECK(cos.is_cuda(), op, ": cos must be a CUDA tensor, got device ", cos.device());
  const char* names[] = {qn, kn, "sin"};
  const at::Tensor* tensors[] = {&q, &k, &sin};
  for (int i = 0; i < 3; ++i) {
    PG_CHECK(tensors[i]->device() == cos.device(), op, ": ", names[i], " is on ", tensors[i]->device(),
             " but cos is on ", cos.device(), "; expected one CUDA device");
  }
  const auto dt = cos.scalar_type();
  PG_CHECK(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, op,
           ": cos must be float32, float16 or bfloat16, got ", dt);
  PG_CHECK(sin.scalar_type() == dt, op, ": sin is ", sin.scalar_type(), " but cos is ", dt, "; expected one dtype");
  PG_CHECK(cos.dim() == 3, op, ": cos must have 3 dimensions [batch or 1, seq, rotated dims], got shape ",
           cos.sizes());
  PG_CHECK(sin.sizes() == cos.sizes(), op, ": sin has shape ", sin.sizes(), " but cos has ", cos.sizes(),
           "; expected equal shapes");
  PG_CHECK(q.dim() == 4, op, ": ", qn, " must have 4 dimensions [batch, heads, seq, head_dim], got shape ", q.sizes());
  PG_CHECK(k.dim() == 4, op, ": ", kn, " must have 4 dimensions [batch, heads, seq, head_dim], got shape ", k.sizes());
  const int64_t B = q.size(0), S = q.size(2), D = q.size(3);
  PG_CHECK(k.size(0) == B && k.size(2) == S && k.size(3) == D, op, ": ", kn, " has shape ", k.sizes(), " but ", qn,
           " has ", q.sizes(), "; expected the same batch, seq and head_dim");
  const int64_t R = cos.size(2);   // rotated values a head: D, or fewer (partial rotary)
  PG_CHECK(cos.size(1) == S && (R == D || (R >= 2 && R < D)) && (cos.size(0) == B || cos.size(0) == 1), op,
           ": cos has shape ", cos.sizes(), " but ", qn, " has ", q.sizes(), "; expected [", B, " or 1, ", S,
           ", R], R the rotated values a head: ", D, ", or 2 to ", D - 1, " (partial rotary)");
  PG_CHECK(R % 2 == 0, op, R == D ? ": head_dim must be even (two halves rotate), got "
                                  : ": cos's last size (the rotated values a head) must be even, got ", R);
  PG_CHECK(S <= INT32_MAX && q.size(1) + k.size(1) <= INT32_MAX && D <= INT32_MAX, op, ": ", qn, " ", q.sizes(),
           " and ", kn, " ", k.sizes(), " have more heads, positions or head_dim than 2**31 - 1");
}

// t itself where its last dimension is contiguous, else a contiguous copy.
at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

// (a dimension of size 1 is never stepped over: its stride, which may be anything, counts as 0)
int64_t step(const at::Tensor& t, int d) { return t.size(d) == 1 ? 0 : t.stride(d); }

Strides strides_of(const at::Tensor& t) { return {step(t, 0), step(t, 1), step(t, 2)}; }

bool multiple(int64_t v, int64_t m) { return v % m == 0; }

// The types of one launch: TI the rotated tensors', TC the tables', TO the results'. One dtype for all three, or the
// mixed-precision pairs of autocast: 16-bit q and k with fp32 tables give fp32 results (PyTorch's type promotion),
// and the backward of those takes fp32 output gradients to 16-bit input gradients.
template <typename F>
void by_types(c10::ScalarType ti, c10::ScalarType tc, c10::ScalarType to, F&& f) {
  using c10::ScalarType;
  if (ti == tc && tc == to) {
    by_dtype(ti, [&](auto t) { f(t, t, t); });
  } else if (tc == ScalarType::Float && to == ScalarType::Float) {
    if (ti == ScalarType::Half) f(c10::Half{}, float{}, float{});
    else f(c10::BFloat16{}, float{}, float{});
  } else {
    if (to == ScalarType::Half) f(float{}, float{}, c10::Half{});
    else f(float{}, float{}, c10::BFloat16{});
  }
}

// Whether (ti, tc, to) is one of by_types's combinations.
bool supported_types(c10::ScalarType ti, c10::ScalarType tc, c10::ScalarType to) {
  using c10::ScalarType;
  auto half = [](ScalarType t) { return t == ScalarType::Half || t == ScalarType::BFloat16; };
  auto any = [&](ScalarType t) { return t == ScalarType::Float || half(t); };
  return (ti == tc && tc == to && any(ti)) ||
         (tc == ScalarType::Float && ((half(ti) && to == ScalarType::Float) || (ti == ScalarType::Float && half(to))));
}

// The launch at V elements a vector (V: the widest that launch() found to fit; a narrower instance where v is
// narrower); staged: rope_staged_kernel (TI == TO), else rope_kernel.
template <typename TI, typename TC, typename TO, int V>
void launch_width(const Params& p, int v, bool bwd, bool staged, bool laned, bool narrow, unsigned blocks,
                  cudaStream_t stream) {
  if constexpr (V > 1) {
    if (v < V) return launch_width<TI, TC, TO, V / 2>(p, v, bwd, staged, laned, narrow, blocks, stream);
  }
  auto go = [&](auto kernel) {
    kernel<<<blocks, kThreads, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  // (lane instances only at 16-byte vectors of one type, where launch() may take them)
  if constexpr (std::is_same_v<TI, TO> && std::is_same_v<TI, TC> && PIPEGOOSE_ROPE_LANES != 0 &&
                (sizeof(TI) == 2 || PIPEGOOSE_ROPE_LANES == 3) && V == kWidestVec<TI, TC, TO>) {
    if (laned) {
      if (bwd) {
        narrow ? go(rope_lane_kernel<TI, V, true, uint32_t>) : go(rope_lane_kernel<TI, V, true, int64_t>);
      } else {
        narrow ? go(rope_lane_kernel<TI, V, false, uint32_t>) : go(rope_lane_kernel<TI, V, false, int64_t>);
      }
      return;
    }
  }
  // (staged instances only where launch() may stage: narrow vectors, unless PIPEGOOSE_ROPE_STAGE is 2)
  if constexpr (std::is_same_v<TI, TO> && (PIPEGOOSE_ROPE_STAGE == 2 || V < kWidestVec<TI, TC, TO>)) {
    if (staged) {
      if (bwd) {
        narrow ? go(rope_staged_kernel<TI, TC, V, true, uint32_t>) : go(rope_staged_kernel<TI, TC, V, true, int64_t>);
      } else {
        narrow ? go(rope_staged_kernel<TI, TC, V, false, uint32_t>)
               : go(rope_staged_kernel<TI, TC, V, false, int64_t>);
      }
      return;
    }
  }
  if (p.interleaved) {
    if (bwd) {
      narrow ? go(rope_kernel<TI, TC, TO, V, true, uint32_t, true>)
             : go(rope_kernel<TI, TC, TO, V, true, int64_t, true>);
    } else {
      narrow ? go(rope_kernel<TI, TC, TO, V, false, uint32_t, true>)
             : go(rope_kernel<TI, TC, TO, V, false, int64_t, true>);
    }
    return;
  }
  if (bwd) {
    narrow ? go(rope_kernel<TI, TC, TO, V, true, uint32_t>) : go(rope_kernel<TI, TC, TO, V, true, int64_t>);
  } else {
    narrow ? go(rope_kernel<TI, TC, TO, V, false, uint32_t>) : go(rope_kernel<TI, TC, TO, V, false, int64_t>);
  }
}

template <typename TI, typename TC, typename TO>
void launch(const Params& p0, bool bwd, cudaStream_t stream, const char* op) {
  Params p = p0;
  constexpr int kV = kWidestVec<TI, TC, TO>;   // elements per vector: 16 bytes of the widest type
  // the widest vector (kV, kV / 2, ..., 1 elements) that fits: every base pointer aligned to it, every stride, the
  // half of the rotated values and the count passed through (D - R) a multiple of it (a head of 80 with 20 rotated,
  // Pythia-2.8b's: 2 16-bit elements; a misaligned view: one)
  auto aligned = [](const void* ptr, int bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; };
  const Strides strides[] = {p.q_in, p.q_res, p.k_in, p.k_res};
  auto strided_by = [&](int v) {
    bool ok = true;
    for (const Strides& st : strides) ok = ok && multiple(st.b, v) && multiple(st.h, v) && multiple(st.s, v);
    return ok;
  };
  auto fits = [&](int v) {   // (interleaved: vectors of whole pairs, or one value; the R rotated values in vectors)
    return multiple(p.interleaved ? 2 * p.half : p.half, v) && multiple(p.copies, v) &&
           aligned(p.q, v * sizeof(TI)) && aligned(p.k, v * sizeof(TI)) && aligned(p.q_out, v * sizeof(TO)) &&
           aligned(p.k_out, v * sizeof(TO)) && aligned(p.cos, v * sizeof(TC)) && aligned(p.sin, v * sizeof(TC)) &&
           strided_by(v) && multiple(p.cos_b, v) && multiple(p.cos_s, v) && multiple(p.sin_b, v) &&
           multiple(p.sin_s, v);
  };
  int v = kV;
  while (v > 1 && !fits(v)) v /= 2;
  const int64_t tokens = p.items;  // (set by the caller to B * S)
  p.vecs = (p.interleaved ? 2 * p.half : p.half) / v;
  // staged (rope_staged_kernel) where the halves take vectors narrower than 16 bytes (PIPEGOOSE_ROPE_STAGE 1; 2: also
  // 16-byte ones), one type in and out, and the heads move in 16-byte chunks that fit the tile: head sizes, pointers
  // and head strides multiples of 16 bytes
  p.dim = 2 * p.half + p.copies;
  const int64_t row_bytes = static_cast<int64_t>(p.dim) * sizeof(TI);
  const bool staged = !p.interleaved && (PIPEGOOSE_ROPE_STAGE == 2 || (PIPEGOOSE_ROPE_STAGE == 1 && v < kV)) &&
                      std::is_same_v<TI, TO> && multiple(row_bytes, 16) && row_bytes <= 32 * kStageVecs * 16 &&
                      p.vecs <= 32 &&
                      aligned(p.q, 16) && aligned(p.k, 16) && aligned(p.q_out, 16) && aligned(p.k_out, 16) &&
                      strided_by(16 / sizeof(TI));
  // the lane kernel (rope_lane_kernel) where the halves take 16-byte vectors of one 16-bit type in and out (and then
  // in the tables), the rotated values are part of the head (PIPEGOOSE_ROPE_LANES 1; 2: whole heads too; 3: fp32
  // too), and a head is 1, 2, 4, 8, 16 or 32 chunks of 16 bytes, no lane of a warp idle (v == kV: pointers and
  // strides are multiples of 16 bytes)
  const bool laned = !staged && !p.interleaved && v == kV && std::is_same_v<TI, TO> && std::is_same_v<TI, TC> &&
                     (sizeof(TI) == 2 || PIPEGOOSE_ROPE_LANES == 3) &&
                     (PIPEGOOSE_ROPE_LANES >= 2 || (PIPEGOOSE_ROPE_LANES == 1 && p.copies > 0)) &&
                     multiple(row_bytes, 16) && row_bytes <= 32 * 16 && multiple(32, row_bytes / 16);
  if (staged) {
    p.chunks = static_cast<int32_t>(row_bytes / 16);
    // heads a warp: as many as the tile holds, at most one vector of the rotated values a lane
    p.rows_per_block = static_cast<int32_t>(std::min<int64_t>(32 * kStageVecs * 16 / row_bytes, 32 / p.vecs));
    p.items = tokens * p.heads;
  } else if (laned) {
    p.chunks = static_cast<int32_t>(row_bytes / 16);
    p.rows_per_block = 32 / p.chunks;   // heads a warp tile
    p.items = tokens * p.heads;
  } else {
    p.copies /= v;
    // the vectors passed through go copy_elems(v) / v at a time (two of the widest width; 16 bytes' worth of narrower
    // ones), or as many as divide their count (Pythia-2.8b's 30 vectors of 2 in 16-bit: 3 a thread), so that a
    // narrow vector does not mean a narrow thread
    p.group = copy_elems<TI, TC, TO>(v) / v;
    while (p.copies % p.group != 0) --p.group;
    p.copies /= p.group;
    p.items = tokens * p.heads * (p.vecs + p.copies);
  }
  if (p.items == 0) return;
  const int64_t per_block = staged  ? static_cast<int64_t>(p.rows_per_block) * (kThreads / 32)
                            : laned ? static_cast<int64_t>(p.rows_per_block) * (kThreads / 32) * kLaneTiles
                                    : kThreads;
  const int64_t blocks = (p.items + per_block - 1) / per_block;
  PG_CHECK(blocks <= INT32_MAX, op, ": ", p.items, " work items are more than one launch covers");
  // (32-bit item arithmetic where the last block's items fit: the lane kernel's item index reaches blocks * per_block)
  launch_width<TI, TC, TO, kV>(p, v, bwd, staged, laned, blocks * per_block <= INT32_MAX,
                               static_cast<unsigned>(blocks), stream);
}

// Rotates x (q-like) and y (k-like, x's dtype) into new tensors of their layout and dtype `out`; bwd: the transposed
// rotation.
std::tuple<at::Tensor, at::Tensor> rotate(const char* op, const at::Tensor& x_in, const at::Tensor& y_in,
                                          const at::Tensor& cos_in, const at::Tensor& sin_in, c10::ScalarType out,
                                          bool bwd, bool interleaved) {
  const at::Tensor x = last_dim_contiguous(x_in), y = last_dim_contiguous(y_in);
  const at::Tensor cos = last_dim_contiguous(cos_in), sin = last_dim_contiguous(sin_in);
  at::Tensor x_out = at::empty_like(x, x.options().dtype(out)), y_out = at::empty_like(y, y.options().dtype(out));
  if (x_out.numel() == 0 && y_out.numel() == 0) return {x_out, y_out};
  c10::cuda::CUDAGuard guard(cos.device());
  Params p{};
  p.q = x.const_data_ptr();
  p.k = y.const_data_ptr();
  p.q_out = x_out.mutable_data_ptr();
  p.k_out = y_out.mutable_data_ptr();
  p.cos = cos.const_data_ptr();
  p.sin = sin.const_data_ptr();
  p.q_in = strides_of(x);
  p.q_res = strides_of(x_out);
  p.k_in = strides_of(y);
  p.k_res = strides_of(y_out);
  p.cos_b = step(cos, 0);   // 0 for a table of one batch, broadcast over q's
  p.sin_b = step(sin, 0);
  p.cos_s = step(cos, 1);
  p.sin_s = step(sin, 1);
  p.seq = static_cast<int32_t>(x.size(2));
  p.heads_q = static_cast<int32_t>(x.size(1));
  p.heads = static_cast<int32_t>(x.size(1) + y.size(1));
  p.half = static_cast<int32_t>(cos.size(2) / 2);
  p.copies = static_cast<int32_t>(x.size(3) - cos.size(2));   // elements passed through; launch() makes them vectors
  p.items = x.size(0) * x.size(2);  // tokens; launch() multiplies by the work per token
  p.interleaved = interleaved;
  if (p.half == 0) return {x_out, y_out};
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  by_types(x.scalar_type(), cos.scalar_type(), out, [&](auto ti, auto tc, auto to) {
    launch<decltype(ti), decltype(tc), decltype(to)>(p, bwd, stream, op);
  });
  return {x_out, y_out};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rope_forward_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                                     const at::Tensor& sin, bool interleaved) {
  check_args(kFwd, "q", q, "k", k, cos, sin);
  const auto dt = q.scalar_type(), tab = cos.scalar_type();
  PG_CHECK(k.scalar_type() == dt, kFwd, ": k is ", k.scalar_type(), " but q is ", dt, "; expected one dtype");
  const auto out = tab == at::kFloat ? at::kFloat : dt;   // PyTorch's promotion of q * cos
  PG_CHECK(supported_types(dt, tab, out), kFwd, ": q is ", dt, " and cos ", tab,
           "; expected one dtype, or float16 / bfloat16 q and k with float32 cos and sin (autocast)");
  return rotate(kFwd, q, k, cos, sin, out, /*bwd=*/false, interleaved);
}

std::tuple<at::Tensor, at::Tensor> rope_backward_cuda(const at::Tensor& grad_q_embed, const at::Tensor& grad_k_embed,
                                                      const at::Tensor& cos, const at::Tensor& sin,
                                                      std::optional<at::ScalarType> dtype, bool interleaved) {
  check_args(kBwd, "grad_q_embed", grad_q_embed, "grad_k_embed", grad_k_embed, cos, sin);
  PG_CHECK(at::isFloatingType(grad_q_embed.scalar_type()) && at::isFloatingType(grad_k_embed.scalar_type()), kBwd,
           ": grad_q_embed and grad_k_embed must be floating point tensors, got ", grad_q_embed.scalar_type(), " and ",
           grad_k_embed.scalar_type());
  const auto tab = cos.scalar_type(), out = dtype.value_or(tab);
  PG_CHECK(supported_types(tab, tab, out), kBwd, ": dtype ", out, " with cos of ", tab,
           "; expected cos's dtype, or float16 / bfloat16 with float32 cos and sin (autocast)");
  return rotate(kBwd, grad_q_embed.to(tab), grad_k_embed.to(tab), cos, sin, out, /*bwd=*/true, interleaved);
}

}  // namespace pipegoose
