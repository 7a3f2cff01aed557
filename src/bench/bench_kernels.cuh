// Device code of the benchmark harness (host side in bench.cu).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "cuda/hd.hpp"
#include "cuda/ptx.cuh"

namespace epmoe::bench::kernels {

// One thread spins until `ns` nanoseconds of global time have passed.
__global__ void sleep_kernel(std::uint64_t ns) {
  const std::uint64_t start = ptx::global_timer_ns();
  while (ptx::global_timer_ns() - start < ns) __nanosleep(1000);
}

// x[i] = ±(1 + u) * 2^e with u in [0, 1) and e in [-8, 7], from a hash of (seed, i).
__global__ void fill_random_bf16_kernel(__nv_bfloat16* __restrict__ x, std::uint64_t n, std::uint64_t seed) {
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const std::uint64_t h = epmoe::detail::splitmix64(seed ^ (i * 0x9e3779b97f4a7c15ull));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
    const int e = static_cast<int>((h >> 8) & 15u) - 8;
    const float v = ldexpf(1.0f + u, e);
    x[i] = __float2bfloat16_rn((h & 1u) != 0u ? -v : v);
  }
}

// Streams `passes` times: dst[f * n + i] = src[i] for f < fanout, i < n (16-byte vectors). Each
// warp loads 8 vectors per lane (4 KB) before it stores any (restrict: the loads are not held
// behind the stores), so the grid keeps HBM busy with reads and fanout times as many writes, the
// shape of the dispatch's place step (read a token row, write it to each of its expert rows).
__global__ void stream_fanout_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, std::uint64_t n,
                                     int fanout, int passes) {
  constexpr int kU = 8;
  const unsigned lane = threadIdx.x & 31u;
  const std::uint64_t warp = (static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const std::uint64_t warps = (static_cast<std::uint64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int pass = 0; pass < passes; ++pass) {
    for (std::uint64_t base = warp * 32 * kU; base < n; base += warps * 32 * kU) {
      uint4 r[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const std::uint64_t i = base + lane + 32u * u;
        r[u] = i < n ? src[i] : make_uint4(0, 0, 0, 0);
      }
      for (int f = 0; f < fanout; ++f) {
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const std::uint64_t i = base + lane + 32u * u;
          if (i < n) dst[static_cast<std::uint64_t>(f) * n + i] = r[u];
        }
      }
    }
  }
}

}  // namespace epmoe::bench::kernels
