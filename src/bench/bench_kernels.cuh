// Device code of the benchmark harness (host side in bench.cu).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

namespace epmoe::bench::kernels {

__device__ __forceinline__ std::uint64_t global_timer_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One thread spins until `ns` nanoseconds of global time have passed.
__global__ void sleep_kernel(std::uint64_t ns) {
  const std::uint64_t start = global_timer_ns();
  while (global_timer_ns() - start < ns) __nanosleep(1000);
}

__device__ __forceinline__ std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// x[i] = ±(1 + u) * 2^e with u in [0, 1) and e in [-8, 7], from a hash of (seed, i).
__global__ void fill_random_bf16_kernel(__nv_bfloat16* __restrict__ x, std::uint64_t n, std::uint64_t seed) {
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const std::uint64_t h = splitmix64(seed ^ (i * 0x9e3779b97f4a7c15ull));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
    const int e = static_cast<int>((h >> 8) & 15u) - 8;
    const float v = ldexpf(1.0f + u, e);
    x[i] = __float2bfloat16_rn((h & 1u) != 0u ? -v : v);
  }
}

}  // namespace epmoe::bench::kernels
