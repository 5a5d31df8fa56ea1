// Host helpers for launch plans of pipegoose's kernels: the GPU's SM count and a kernel's resident blocks per SM.
// Written for pipegoose; used by norm_kernels.cuh (LayerNorm, RMSNorm) and cross_entropy.cu.
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <map>
#include <mutex>
#include <tuple>

namespace pipegoose {

// SMs of the current device.
inline int sm_count() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

// Resident blocks per SM for a kernel at a block size and dynamic smem size (at least 1; cached per device, kernel,
// block size and smem size).
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

}  // namespace pipegoose
