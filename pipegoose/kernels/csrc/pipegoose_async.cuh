// Asynchronous global -> shared copies (cp.async) shared by pipegoose's own kernels (softmax.cuh, norm_kernels.cuh).
// Source: written in this project. Before sm_80 (no cp.async) every function still builds and stays correct: the copy
// is a plain load and store, commit and wait do nothing (the kernels then run without the overlap).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pipegoose {

// Copies 16 bytes from global to shared memory asynchronously (cp.async.cg: no register, bypassing L1); the bytes from
// src_bytes on are zero filled, and src_bytes 0 reads nothing (src must still be a valid address). Before sm_80: a
// plain load of the whole 16 bytes (the callers pass whole 16-byte vectors), its bytes from src_bytes on zeroed, and
// a store.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (src_bytes > 0) {
    v = *reinterpret_cast<const uint4*>(src);
    auto keep = [&](int word) -> uint32_t {  // bytes word * 4 .. word * 4 + 3, the first in the low bits
      const int n = src_bytes - word * 4;
      return n >= 4 ? 0xffffffffu : (n <= 0 ? 0u : 0xffffffffu >> (8 * (4 - n)));
    };
    v.x &= keep(0);
    v.y &= keep(1);
    v.z &= keep(2);
    v.w &= keep(3);
  }
  *reinterpret_cast<uint4*>(dst) = v;
#else
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(src_bytes) : "memory");
#endif
}

// Closes this thread's current group of copies.
__device__ __forceinline__ void cp_async_commit() {
#if !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// cp_async_wait<N>() for a count known only after unrolling (n: 0-7; larger waits as 7).
__device__ __forceinline__ void cp_async_wait_upto(int n) {
  switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    default: cp_async_wait<7>(); break;
  }
}

// Waits until every copy of this thread has landed (committed or not).
__device__ __forceinline__ void cp_async_wait_all() {
#if !(defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800)
  asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

}  // namespace pipegoose
