// Device code of the grouped GEMM benchmark's random fills: fp8, scales, quantized normal fp8 and the
// int4 -8 clear (host launchers in suite_gemm_fill.cu).
#pragma once

#include <cstdint>

#include <cuda_fp8.h>

#include "cuda/hd.hpp"

namespace epmoe::bench {
namespace {

// Eight bytes per thread step, one 8-byte store each (x is 8-byte aligned), bytes at the tail.
__global__ void fill_fp8_kernel(std::uint8_t* __restrict__ x, std::uint64_t n, std::uint64_t seed) {
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i * 8 < n;
       i += stride) {
    const std::uint64_t h = detail::splitmix64(seed ^ (i * 0x9e3779b97f4a7c15ull));
    std::uint64_t word = 0;
    for (int b = 0; b < 8; ++b) {
      const auto r = static_cast<std::uint32_t>(h >> (8 * b)) & 0xffu;
      const std::uint32_t exponent = 3u + (r >> 4) % 9u;  // 3..11
      word |= static_cast<std::uint64_t>(((r & 1u) << 7) | (exponent << 3) | ((r >> 1) & 7u)) << (8 * b);
    }
    if (i * 8 + 8 <= n) {
      reinterpret_cast<std::uint64_t*>(x)[i] = word;
    } else {
      for (std::uint64_t b = 0; i * 8 + b < n; ++b) x[i * 8 + b] = static_cast<std::uint8_t>(word >> (8 * b));
    }
  }
}

__global__ void fill_scales_kernel(float* __restrict__ x, std::uint64_t n, std::uint64_t seed) {
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const std::uint64_t h = detail::splitmix64(seed ^ (i * 0xd1b54a32d192ed03ull));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
    x[i] = ldexpf(1.0f + u, static_cast<int>(h % 7u) - 10);
  }
}

// A standard normal value from one 64-bit hash (Box-Muller on two 24-bit uniforms).
__device__ __forceinline__ float normal_at(std::uint64_t seed, std::uint64_t i) {
  const std::uint64_t h = detail::splitmix64(seed ^ (i * 0x9e3779b97f4a7c15ull));
  const float u1 = (static_cast<float>(h >> 40) + 0.5f) * (1.0f / 16777216.0f);  // (0, 1)
  const float u2 = static_cast<float>((h >> 8) & 0xffffffu) * (1.0f / 16777216.0f);
  return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
}

// blockIdx.x: a 128-column block, blockIdx.y: a 128-row tile; thread t owns row 128 * y + t of it.
// Each value is generated twice (amax, then the scaled store) rather than kept: 128 floats per thread.
__global__ void fill_normal_fp8_kernel(std::uint8_t* __restrict__ x, std::int64_t rows, std::int64_t cols,
                                       bool tile_amax, std::uint64_t seed) {
  __shared__ unsigned tile_max_bits;
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.y) * 128 + threadIdx.x;
  const std::int64_t col0 = static_cast<std::int64_t>(blockIdx.x) * 128;
  const bool live = row < rows;
  const auto base = static_cast<std::uint64_t>(row * cols + col0);
  float amax = 0.0f;
  if (live)
    for (int c = 0; c < 128; ++c) amax = fmaxf(amax, fabsf(normal_at(seed, base + c)));
  if (tile_amax) {
    if (threadIdx.x == 0) tile_max_bits = 0;
    __syncthreads();
    atomicMax(&tile_max_bits, __float_as_uint(amax));  // non-negative floats order as their bits
    __syncthreads();
    amax = __uint_as_float(tile_max_bits);
  }
  if (!live) return;
  const float scale = 448.0f / fmaxf(amax, 1e-4f);
  auto* out = reinterpret_cast<uint4*>(x + base);
  for (int c = 0; c < 128; c += 16) {
    unsigned word[4];
    for (int w = 0; w < 4; ++w) {
      const int k = c + 4 * w;
      const auto lo = __nv_cvt_float2_to_fp8x2(
          make_float2(normal_at(seed, base + k) * scale, normal_at(seed, base + k + 1) * scale),
          __NV_SATFINITE, __NV_E4M3);
      const auto hi = __nv_cvt_float2_to_fp8x2(
          make_float2(normal_at(seed, base + k + 2) * scale, normal_at(seed, base + k + 3) * scale),
          __NV_SATFINITE, __NV_E4M3);
      word[w] = static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16);
    }
    out[c / 16] = make_uint4(word[0], word[1], word[2], word[3]);
  }
}

__global__ void clear_int4_minus8_kernel(std::uint8_t* w, std::uint64_t bytes) {
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < bytes;
       i += stride) {
    std::uint8_t b = w[i];
    if ((b & 0x0fu) == 0x08u) b = static_cast<std::uint8_t>(b + 0x01u);  // -8 -> -7 (two's complement nibble)
    if ((b & 0xf0u) == 0x80u) b = static_cast<std::uint8_t>(b + 0x10u);
    w[i] = b;
  }
}

}  // namespace
}  // namespace epmoe::bench
