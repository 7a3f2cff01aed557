// The weighted gather of expert rows back to token order (device code; host launcher in permute.cu,
// API in epmoe/cuda/permute.hpp): y[t] = sum over k of w[t, k] * expert_out[src_row[t, k]].
// A warp per (token, 1 KB segment of y): the K rows' segments are loaded (4 k's at a time, 8
// independent 16-byte loads per lane) and accumulated in f32 in k order with separately rounded
// multiply and add (the CPU's operation sequence), then rounded to bf16. A row id outside the
// expert output (or -1) adds nothing.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "cuda/ptx.cuh"

namespace epmoe::kernels {

inline constexpr int kGatherThreads = 256;
inline constexpr int kGatherWarps = kGatherThreads / 32;
inline constexpr int kGatherVecs = 2;    // 16-byte vectors per lane per gather segment (1 KB)
inline constexpr int kGatherKBatch = 4;  // rows loaded together

struct GatherParams {
  const uint4* rows;  // expert output [num_rows, vecs_per_row] bf16
  std::uint32_t num_rows;
  const std::int32_t* src_row;  // [T, K]
  const float* weights;         // [T, K]
  std::uint32_t tokens, topk, vecs_per_row, segments;
  uint4* y;  // [T, vecs_per_row] bf16
};

__global__ void __launch_bounds__(kGatherThreads) gather_weighted_kernel(GatherParams p) {
  const int lane = threadIdx.x % 32;
  const std::uint32_t num_warps = gridDim.x * kGatherWarps;
  const std::uint32_t items = p.tokens * p.segments;
  for (std::uint32_t item = (blockIdx.x * kGatherThreads + threadIdx.x) / 32; item < items;
       item += num_warps) {
    const std::uint32_t t = item / p.segments;
    const std::uint32_t s = item - t * p.segments;
    int my_row = -1;
    float my_w = 0.0f;
    if (static_cast<std::uint32_t>(lane) < p.topk) {
      const int r = __ldg(p.src_row + t * p.topk + lane);
      my_row = r >= 0 && static_cast<std::uint32_t>(r) < p.num_rows ? r : -1;
      my_w = __ldg(p.weights + t * p.topk + lane);
    }
    const std::uint32_t v0 = s * 32 * kGatherVecs + lane;
    float acc[kGatherVecs][8];
#pragma unroll
    for (int u = 0; u < kGatherVecs; ++u)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[u][i] = 0.0f;

    for (std::uint32_t k0 = 0; k0 < p.topk; k0 += kGatherKBatch) {
      int row[kGatherKBatch];
      float w[kGatherKBatch];
      uint4 v[kGatherKBatch][kGatherVecs];
#pragma unroll
      for (int j = 0; j < kGatherKBatch; ++j) {
        const std::uint32_t k = k0 + j;
        const int src_lane = static_cast<int>(min(k, 31u));
        const int r = __shfl_sync(0xffffffffu, my_row, src_lane);
        w[j] = __shfl_sync(0xffffffffu, my_w, src_lane);
        row[j] = k < p.topk ? r : -1;
#pragma unroll
        for (int u = 0; u < kGatherVecs; ++u) {
          const std::uint32_t idx = v0 + 32 * u;
          v[j][u] = row[j] >= 0 && idx < p.vecs_per_row
                        ? ptx::ld_nc_v4(p.rows + static_cast<std::uint64_t>(row[j]) * p.vecs_per_row + idx)
                        : make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int j = 0; j < kGatherKBatch; ++j) {
        if (row[j] < 0) continue;
#pragma unroll
        for (int u = 0; u < kGatherVecs; ++u) {
          const std::uint32_t words[4] = {v[j][u].x, v[j][u].y, v[j][u].z, v[j][u].w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 f = ptx::bf16x2_to_float2(words[i]);
            acc[u][2 * i] = __fadd_rn(acc[u][2 * i], __fmul_rn(w[j], f.x));
            acc[u][2 * i + 1] = __fadd_rn(acc[u][2 * i + 1], __fmul_rn(w[j], f.y));
          }
        }
      }
    }
    uint4* dst = p.y + static_cast<std::uint64_t>(t) * p.vecs_per_row;
#pragma unroll
    for (int u = 0; u < kGatherVecs; ++u) {
      const std::uint32_t idx = v0 + 32 * u;
      if (idx >= p.vecs_per_row) continue;
      dst[idx] = make_uint4(ptx::pack_bf16x2(acc[u][0], acc[u][1]), ptx::pack_bf16x2(acc[u][2], acc[u][3]),
                            ptx::pack_bf16x2(acc[u][4], acc[u][5]), ptx::pack_bf16x2(acc[u][6], acc[u][7]));
    }
  }
}

}  // namespace epmoe::kernels
