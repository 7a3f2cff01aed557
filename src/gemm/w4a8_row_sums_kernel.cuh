// The W4A8 GEMM's pre-pass for the codes' offset term (device code; launched by
// w4a8_grouped_gemm.cu before a masked GEMM whose tile takes the term from it, W4A8Traits::kOffsetSums).
//
// The codes are offset binary (c = v + 8, w4a8_layout.hpp), so each K block's partial product holds
// 2^-9 Σ_k A[m, k] · c and needs -8 · 2^-9 Σ_k A[m, k] = -2^-6 Σ_k A[m, k] added per activation row and
// K block. This kernel computes that term once per (row, K block) for the GEMM's producer to copy into
// each stage beside the activation tile (kBM floats), instead of each consumer warpgroup recomputing
// it with a wgmma per K step.
//
// Layout: sums[(g * K/128 + kb) * sums_rows + r], sums_rows = round_up(M_max, 32). Rows
// r < min(masked_m[g], M_max) hold the term (f32 sums of the e4m3 values, then the exact power-of-two
// factor); rows up to round_up(that count, 32) are written 0 (a tile of up to 32 rows copies them; the
// GEMM never stores those rows); rows beyond are not written.
//
// A warp per row, kW4SumsLoads 16-byte loads per lane issued before any is used (K = 7168: one
// round of 14; 2048: one of 4), the 8 lanes of a K block reduce with shuffles. Session 20
// measured two other shapes slower: a warp looping over its row's 512-byte pieces one at a time (a
// chain of 14 memory latencies), and a warp per (row, 512 bytes) with a grid sized for every row of
// M_max (57 000 blocks at 128 x 256 rows, nearly all exiting at once). Here the grid is small and
// fixed, (kW4SumsSlabs, G) blocks of kW4SumsWarps rows that stride over the group's rows. Each block
// lets the GEMM launch at once (programmatic dependent launch: only the GEMM's sums-copying warp waits
// for this grid).
#pragma once

#include <cstdint>

#include <cuda_fp8.h>

#include "cuda/ptx.cuh"
#include "gemm/w4a8_layout.hpp"

namespace epmoe::kernels {

inline constexpr int kW4SumsWarps = 8;   // rows per block and pass
inline constexpr int kW4SumsSlabs = 4;   // blocks per group (at most)
inline constexpr int kW4SumsLoads = 16;  // 16-byte loads per lane in flight

__device__ __forceinline__ float w4a8_sum_e4m3x4(std::uint32_t v) {
  const __half2_raw lo =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xffffu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v >> 16), __NV_E4M3);
  const float2 a = __half22float2(__half2(lo)), b = __half22float2(__half2(hi));
  return (a.x + a.y) + (b.x + b.y);
}

// grid (min(kW4SumsSlabs, ceil(sums_rows / kW4SumsWarps)), G), kW4SumsWarps warps per block.
__global__ void __launch_bounds__(kW4SumsWarps * 32)
    w4a8_row_sums_kernel(const std::uint8_t* __restrict__ a, const std::int32_t* __restrict__ masked_m,
                         std::int32_t m_max, std::int32_t k, std::int32_t sums_rows,
                         float* __restrict__ sums) {
  ptx::launch_dependents();
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int32_t g = static_cast<std::int32_t>(blockIdx.y);
  const std::int32_t count = min(max(__ldg(masked_m + g), 0), m_max);
  const auto written = static_cast<std::int32_t>(min(w4a8::row_sums_rows(count), std::int64_t{sums_rows}));
  const std::int32_t num_kb = k / w4a8::kBlockK;
  const std::int32_t chunks = k / 16;  // 8 per K block
  for (std::int32_t r = static_cast<std::int32_t>(blockIdx.x * kW4SumsWarps + threadIdx.x / 32); r < written;
       r += static_cast<std::int32_t>(gridDim.x) * kW4SumsWarps) {
    const auto* row = reinterpret_cast<const uint4*>(a + (static_cast<std::int64_t>(g) * m_max + r) * k);
    const bool valid = r < count;
    for (std::int32_t c0 = 0; c0 < chunks; c0 += 32 * kW4SumsLoads) {
      uint4 v[kW4SumsLoads];
#pragma unroll
      for (int i = 0; i < kW4SumsLoads; ++i) {
        const std::int32_t c = c0 + 32 * i + lane;
        v[i] = valid && c < chunks ? __ldg(row + c) : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int i = 0; i < kW4SumsLoads; ++i) {
        const std::int32_t c = c0 + 32 * i + lane;
        if (c0 + 32 * i >= chunks) break;  // warp-uniform
        float s = (w4a8_sum_e4m3x4(v[i].x) + w4a8_sum_e4m3x4(v[i].y)) +
                  (w4a8_sum_e4m3x4(v[i].z) + w4a8_sum_e4m3x4(v[i].w));
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        s += __shfl_xor_sync(0xffffffffu, s, 4);
        if (lane % 8 == 0 && c < chunks)
          sums[w4a8::row_sums_index(g, num_kb, c / 8, sums_rows, r)] = w4a8::kOffsetFactor * s;
      }
    }
  }
}

}  // namespace epmoe::kernels
