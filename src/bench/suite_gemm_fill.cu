// Device fills of the grouped GEMM benchmark's random inputs (suite_gemm_fill.hpp).
#include "bench/suite_gemm_fill.hpp"

#include <algorithm>

#include "epmoe/cuda/launch.hpp"

namespace epmoe::bench {
namespace {

__device__ __forceinline__ std::uint64_t hash64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Eight bytes per thread step, one 8-byte store each (x is 8-byte aligned), bytes at the tail.
__global__ void fill_fp8_kernel(std::uint8_t* __restrict__ x, std::uint64_t n, std::uint64_t seed) {
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i * 8 < n;
       i += stride) {
    const std::uint64_t h = hash64(seed ^ (i * 0x9e3779b97f4a7c15ull));
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
    const std::uint64_t h = hash64(seed ^ (i * 0xd1b54a32d192ed03ull));
    const float u = static_cast<float>(h >> 40) * (1.0f / 16777216.0f);
    x[i] = ldexpf(1.0f + u, static_cast<int>(h % 7u) - 10);
  }
}

unsigned blocks_for(std::uint64_t threads_needed) {
  const std::uint64_t cap = static_cast<std::uint64_t>(cuda::device_props().sm_count) * 8;
  return static_cast<unsigned>(std::clamp<std::uint64_t>((threads_needed + 255) / 256, 1, cap));
}

}  // namespace

void fill_random_fp8(TensorView x, std::uint64_t seed, cudaStream_t stream) {
  EPMOE_CHECK(x.dtype == DType::fp8_e4m3 || x.dtype == DType::u8, "x must be fp8_e4m3 or u8, got {}",
              x.describe());
  expect_device(x, Device::cuda, "x");
  expect_contiguous(x, "x");
  EPMOE_CHECK(reinterpret_cast<std::uintptr_t>(x.data) % 8 == 0, "x must be 8-byte aligned, got {}",
              x.describe());
  const auto n = static_cast<std::uint64_t>(x.numel());
  if (n == 0) return;
  fill_fp8_kernel<<<blocks_for((n + 7) / 8), 256, 0, stream>>>(static_cast<std::uint8_t*>(x.data), n, seed);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void fill_random_scales(TensorView x, std::uint64_t seed, cudaStream_t stream) {
  expect_dtype(x, DType::f32, "x");
  expect_device(x, Device::cuda, "x");
  expect_contiguous(x, "x");
  const auto n = static_cast<std::uint64_t>(x.numel());
  if (n == 0) return;
  fill_scales_kernel<<<blocks_for(n), 256, 0, stream>>>(static_cast<float*>(x.data), n, seed);
  EPMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace epmoe::bench
