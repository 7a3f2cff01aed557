// FP8 quantization kernels (device code; the host launchers are in quant_fp8.cu).
//
// Memory-bound: every thread moves 16-byte vectors of bf16 (8 values) and writes 8 e4m3 bytes;
// a half-warp (16 lanes x 8 values) owns one 128-channel group, so a group's amax is a 4-step
// shuffle reduction and no shared memory is needed. Grids are persistent (sized to fill the
// SMs) and stride over the work; each warp keeps two steps of loads in flight before using them.
#pragma once

#include <cstdint>

#include "cuda/ptx.cuh"

namespace epmoe::kernels {

inline constexpr int kQuantThreads = 256;                  // threads per block for every kernel here
inline constexpr int kQuantGroup = 128;                    // channels per per-token-group scale
inline constexpr int kVec = 8;                             // bf16 values per 16-byte vector
inline constexpr int kLanesPerGroup = kQuantGroup / kVec;  // 16: a half-warp per group
inline constexpr int kUnroll = 2;                          // independent 16-byte loads per thread per step
inline constexpr float kFp8Max = 448.0f;
inline constexpr float kMinAmaxDevice = 1e-10f;  // == epmoe::kMinAmax

// amax of the 8 bf16 values of a 16-byte vector, per 16-bit half (see ptx::bf16x2_abs_bits).
__device__ __forceinline__ std::uint32_t abs_max_bits(uint4 v) {
  using namespace ptx;
  return __vmaxu2(__vmaxu2(bf16x2_abs_bits(v.x), bf16x2_abs_bits(v.y)),
                  __vmaxu2(bf16x2_abs_bits(v.z), bf16x2_abs_bits(v.w)));
}

// 8 bf16 values -> 8 e4m3 bytes (element order kept, element 0 in the lowest byte), as
// e4m3(x / scale) with an IEEE round-to-nearest division (no fast-math), as in the CPU reference.
// kByInverse: multiply by s = 1 / scale instead, which is bit-identical when scale is a power of
// two (then 1 / scale is exact, and x / scale and x * (1 / scale) are the same real number,
// rounded once either way), and much cheaper than a division.
template <bool kByInverse = false>
__device__ __forceinline__ uint2 quantize_vec8(uint4 v, float s) {
  using namespace ptx;
  auto q2 = [s](float2 f) -> std::uint32_t {
    return kByInverse ? float2_to_e4m3x2(f.x * s, f.y * s) : float2_to_e4m3x2(f.x / s, f.y / s);
  };
  uint2 out;
  out.x = q2(bf16x2_to_float2(v.x)) | (q2(bf16x2_to_float2(v.y)) << 16);
  out.y = q2(bf16x2_to_float2(v.z)) | (q2(bf16x2_to_float2(v.w)) << 16);
  return out;
}

// ---------------------------------------------------------------- per-token-group
// Groups are numbered g = t * groups_per_row + j over the contiguous [T, K] input, so group g
// is the 128 values at x + 128 g. A warp takes groups (2w + half) + u * 2 * num_warps for
// u < kUnroll per step; the loop bound is warp-uniform, so the shuffles always see all lanes.
template <bool kPow2, bool kMnMajor>
__global__ void __launch_bounds__(kQuantThreads)
    per_token_group_fp8_kernel(const std::uint16_t* __restrict__ x, std::uint8_t* __restrict__ q,
                               float* __restrict__ scales, std::uint32_t num_groups,
                               std::uint32_t groups_per_row, std::uint32_t tokens,
                               std::uint32_t tokens_padded) {
  const int lane = threadIdx.x % kLanesPerGroup;
  const int half = (threadIdx.x / kLanesPerGroup) % 2;
  const std::uint32_t warp = (blockIdx.x * kQuantThreads + threadIdx.x) / 32;
  const std::uint32_t num_warps = gridDim.x * (kQuantThreads / 32);
  const std::uint64_t step = 2ull * num_warps;  // groups per unrolled slot

  for (std::uint64_t base = 2ull * warp; base < num_groups; base += step * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::uint64_t g = base + half + u * step;
      v[u] = g < num_groups ? ptx::ld_nc_v4(x + g * kQuantGroup + lane * kVec) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::uint64_t g = base + half + u * step;
      const std::uint32_t amax_bits = ptx::group_max_u16x2<kLanesPerGroup>(abs_max_bits(v[u]));
      float scale = fmaxf(ptx::bf16_bits_max_to_float(amax_bits), kMinAmaxDevice) / kFp8Max;
      if constexpr (kPow2) scale = ptx::round_up_pow2(scale);
      if (g >= num_groups) continue;  // after the shuffle: all lanes took part in it
      if constexpr (kPow2) {
        ptx::st_v2(q + g * kQuantGroup + lane * kVec, quantize_vec8<true>(v[u], 1.0f / scale));  // exact
      } else {
        ptx::st_v2(q + g * kQuantGroup + lane * kVec, quantize_vec8(v[u], scale));
      }
      if constexpr (kMnMajor) {
        if (lane < 4) {
          const auto g32 = static_cast<std::uint32_t>(g);
          const std::uint32_t t = g32 / groups_per_row;
          const std::uint32_t j = g32 - t * groups_per_row;
          float* column = scales + static_cast<std::uint64_t>(j) * tokens_padded;
          if (lane == 0) {
            column[t] = scale;
          } else if (t == tokens - 1 && t + lane < tokens_padded) {
            column[t + lane] = 0.0f;  // TMA padding of this group's column
          }
        }
      } else {
        if (lane == 0) scales[g] = scale;
      }
    }
  }
}

// ---------------------------------------------------------------- per-tensor
// One step of the per-tensor kernels' grid-stride loop over n / 8 vectors of 8 bf16: vectors base,
// base + threads, ... (kUnroll of them) loaded before any is used; zeros past `vectors`.
__device__ __forceinline__ void load_vec8_step(const std::uint16_t* __restrict__ x, std::uint64_t base,
                                               std::uint64_t threads, std::uint64_t vectors,
                                               uint4 (&v)[kUnroll]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const std::uint64_t i = base + u * threads;
    v[u] = i < vectors ? ptx::ld_nc_v4(x + i * kVec) : make_uint4(0, 0, 0, 0);
  }
}

// q = e4m3(x / scale) over n elements; scale from *scale_ptr when given, else scale_value.
// Vectors of 8 stride over the grid; the n % 8 tail elements go to the first threads.
__global__ void __launch_bounds__(kQuantThreads)
    per_tensor_fp8_kernel(const std::uint16_t* __restrict__ x, std::uint8_t* __restrict__ q, std::uint64_t n,
                          const float* __restrict__ scale_ptr, float scale_value) {
  const float scale = scale_ptr != nullptr ? *scale_ptr : scale_value;
  const std::uint64_t tid = static_cast<std::uint64_t>(blockIdx.x) * kQuantThreads + threadIdx.x;
  const std::uint64_t threads = static_cast<std::uint64_t>(gridDim.x) * kQuantThreads;
  const std::uint64_t vectors = n / kVec;
  for (std::uint64_t base = tid; base < vectors; base += threads * kUnroll) {
    uint4 v[kUnroll];
    load_vec8_step(x, base, threads, vectors, v);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const std::uint64_t i = base + u * threads;
      if (i < vectors) ptx::st_v2(q + i * kVec, quantize_vec8(v[u], scale));
    }
  }
  const std::uint64_t tail = vectors * kVec + tid;
  if (tail < n) {
    const float f = __uint_as_float(static_cast<std::uint32_t>(x[tail]) << 16);
    q[tail] = static_cast<std::uint8_t>(ptx::float2_to_e4m3x2(f / scale, 0.0f) & 0xffu);
  }
}

// The per-tensor amax and scale: three kernels in a row, the second and third launched as
// programmatic dependent launches (quant_fp8.cu), so that their launches overlap the kernel before:
// zero_amax_kernel zeroes the result word; amax_kernel reads and reduces x, then waits for the zero
// before its atomicMax; amax_to_fp8_scale_kernel waits for every block's max, then turns it into the
// scale (one kernel instead of a memset, a kernel and a kernel, each waiting for the last to end).
__global__ void zero_amax_kernel(unsigned int* amax_bits) {
  *amax_bits = 0u;
  ptx::launch_dependents();
}

// *amax_bits (zeroed by zero_amax_kernel) = max over x of |x|, as f32 bits (non-negative floats order
// like their bit patterns, so an integer atomicMax is exact).
__global__ void __launch_bounds__(kQuantThreads)
    amax_kernel(const std::uint16_t* __restrict__ x, std::uint64_t n, unsigned int* __restrict__ amax_bits) {
  ptx::launch_dependents();
  const std::uint64_t tid = static_cast<std::uint64_t>(blockIdx.x) * kQuantThreads + threadIdx.x;
  const std::uint64_t threads = static_cast<std::uint64_t>(gridDim.x) * kQuantThreads;
  const std::uint64_t vectors = n / kVec;
  std::uint32_t m = 0;
  for (std::uint64_t base = tid; base < vectors; base += threads * kUnroll) {
    uint4 v[kUnroll];
    load_vec8_step(x, base, threads, vectors, v);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) m = __vmaxu2(m, abs_max_bits(v[u]));
  }
  const std::uint64_t tail = vectors * kVec + tid;
  if (tail < n) m = __vmaxu2(m, static_cast<std::uint32_t>(x[tail]) & 0x7fffu);

  __shared__ float warp_max[kQuantThreads / 32];
  const float amax = ptx::group_max<32>(ptx::bf16_bits_max_to_float(m));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x < 32) {
    float block_max = threadIdx.x < kQuantThreads / 32 ? warp_max[threadIdx.x] : 0.0f;
    block_max = ptx::group_max<32>(block_max);
    if (threadIdx.x == 0) {
      ptx::grid_dependency_wait();  // the zero stored
      if (block_max > 0.0f) atomicMax(amax_bits, __float_as_uint(block_max));
    }
  }
}

// In place: *value = max(amax, kMinAmax) / 448 (the per-tensor scale from the amax), once every block
// of amax_kernel has added its max.
__global__ void amax_to_fp8_scale_kernel(float* value) {
  ptx::grid_dependency_wait();
  *value = fmaxf(*value, kMinAmaxDevice) / kFp8Max;
}

}  // namespace epmoe::kernels
