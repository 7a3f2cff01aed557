// Device code of the synthetic GPU experts: the FP8 block-scaled and W4A8 int4 generator kernels
// (host launchers in synthetic_gpu.cu).
#pragma once

#include <cstdint>

#include "cuda/ptx.cuh"
#include "weights/synthetic_math.hpp"

namespace epmoe::cuda {
namespace {

constexpr int kBlock = 128;                             // checkpoint scale block (rows and columns)
constexpr int kThreads = 256;                           // one CTA per 128 x 128 block
constexpr int kPerThread = kBlock * kBlock / kThreads;  // 64 values per thread

// One 128 x 128 block of an [N, K] matrix: values bound * uniform_pm1(stream, row * K + col), then
// quantized with the block's amax as quantize_block_fp8 does. N and K are multiples of 128.
__global__ void __launch_bounds__(kThreads)
    synthetic_block_fp8_kernel(std::uint64_t stream, float bound, std::uint32_t K,
                               std::uint8_t* __restrict__ q, float* __restrict__ scale_inv) {
  __shared__ float warp_max[kThreads / 32];
  const std::uint32_t cb = blockIdx.x, rb = blockIdx.y;
  float v[kPerThread];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const std::uint32_t idx = threadIdx.x + j * kThreads;
    const std::uint64_t row = rb * kBlock + idx / kBlock, col = cb * kBlock + idx % kBlock;
    v[j] = detail::rn_mul(bound, detail::synth_uniform_pm1(stream, row * K + col));
    amax = fmaxf(amax, fabsf(v[j]));
  }
  for (int offset = 16; offset > 0; offset /= 2)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_max[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) amax = fmaxf(amax, warp_max[w]);
  const float scale = fmaxf(amax, 1e-10f) / 448.0f;  // == fp8_scale_for_amax (kMinAmax, IEEE division)
  if (threadIdx.x == 0) scale_inv[rb * (K / kBlock) + cb] = scale;
#pragma unroll
  for (int j = 0; j < kPerThread; j += 2) {
    const std::uint32_t idx = threadIdx.x + j * kThreads;
    const std::uint16_t pair = ptx::float2_to_e4m3x2(v[j] / scale, v[j + 1] / scale);
    const std::uint64_t row = rb * kBlock + idx / kBlock, col = cb * kBlock + idx % kBlock;
    const std::uint64_t row2 = rb * kBlock + (idx + kThreads) / kBlock,
                        col2 = cb * kBlock + (idx + kThreads) % kBlock;
    q[row * K + col] = static_cast<std::uint8_t>(pair & 0xff);
    q[row2 * K + col2] = static_cast<std::uint8_t>(pair >> 8);
  }
}

// One warp per (row, 128-wide group) of an [N, K] matrix in the W4A8 checkpoint format, as
// quantize_int4_grouped does: scale = max(amax, kMinAmax) / 7, q = clamp(rint(x / scale), -8, 7)
// (round half to even), two values per byte, the even column in the low nibble.
constexpr int kInt4WarpsPerBlock = kThreads / 32;
__global__ void __launch_bounds__(kThreads)
    synthetic_int4_kernel(std::uint64_t stream, float bound, std::uint32_t K, std::uint64_t num_groups,
                          std::uint8_t* __restrict__ packed, float* __restrict__ scales) {
  const std::uint64_t group = blockIdx.x * static_cast<std::uint64_t>(kInt4WarpsPerBlock) + threadIdx.x / 32;
  if (group >= num_groups) return;  // the whole warp leaves together
  const int lane = threadIdx.x % 32;
  const std::uint32_t groups_per_row = K / kBlock;
  const std::uint64_t row = group / groups_per_row, g = group % groups_per_row;
  const std::uint64_t col0 = g * kBlock + static_cast<std::uint64_t>(lane) * 4;
  float v[4];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[i] = detail::rn_mul(bound, detail::synth_uniform_pm1(stream, row * K + col0 + i));
    amax = fmaxf(amax, fabsf(v[i]));
  }
  for (int offset = 16; offset > 0; offset /= 2)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const float scale = fmaxf(amax, 1e-10f) / 7.0f;
  unsigned q[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    q[i] = static_cast<unsigned>(static_cast<int>(fminf(fmaxf(rintf(v[i] / scale), -8.0f), 7.0f))) & 0xfu;
  std::uint8_t* dst = packed + row * (K / 2) + col0 / 2;
  dst[0] = static_cast<std::uint8_t>(q[0] | (q[1] << 4));
  dst[1] = static_cast<std::uint8_t>(q[2] | (q[3] << 4));
  if (lane == 0) scales[row * groups_per_row + g] = scale;
}

}  // namespace
}  // namespace epmoe::cuda
