// Expert permutation and weighted-gather kernels (device code; host launchers in permute.cu).
//
// Permutation, four launches, deterministic (no output depends on the order atomics land in):
//   1. count:   one block per chunk of kPermuteChunk entries (i = t*K + k): the chunk's per-expert
//               histogram (shared-memory atomics: only the counts matter) -> hist[chunk][E].
//   2. scan:    one block, a thread per expert: hist[c][e] becomes the exclusive running sum over
//               chunks (the expert-relative base of chunk c), the totals give counts, the padded
//               block offsets (contiguous, a block scan) or masked_m (clamped to M_max).
//   3. rank:    one block per chunk: each warp ranks its 128 entries stably (match_any + popc over
//               4 rounds of 32, per-warp counters in shared memory), an exclusive scan over the 8
//               warps per expert gives each entry's rank inside the chunk, so row = expert offset +
//               chunk base + rank: src_row[i] and row_src[row]. Extra blocks fill m_indices and the
//               row_src of rows that hold no entry.
//   4. copy:    a warp per (token, 2 KB segment): the token's segment is read once into registers
//               (16-byte loads) and written to each of its K rows; the segment-0 warp also copies
//               the token's scales.
// Gather: a warp per (token, 1 KB segment of y): the K rows' segments are loaded (4 k's at a time,
// 8 independent 16-byte loads per lane) and accumulated in f32 in k order with separately rounded
// multiply and add (the CPU's operation sequence), then rounded to bf16.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cub/block/block_scan.cuh>

#include "cuda/ptx.cuh"

namespace epmoe::kernels {

inline constexpr int kPermuteThreads = 256;
inline constexpr int kPermuteWarps = kPermuteThreads / 32;
inline constexpr int kPermuteRounds = 4;                                // entries per lane per chunk
inline constexpr int kPermuteChunk = kPermuteThreads * kPermuteRounds;  // 1024 entries
inline constexpr int kPermuteExpertsMax = 1024;
inline constexpr int kPermuteScanThreads = kPermuteExpertsMax;  // scan: a thread per expert
inline constexpr int kPermuteCopyVecs = 4;  // 16-byte vectors per lane per copy segment (2 KB)
inline constexpr int kGatherVecs = 2;       // 16-byte vectors per lane per gather segment (1 KB)
inline constexpr int kGatherKBatch = 4;     // rows loaded together

// ---------------------------------------------------------------- 1. count
__global__ void __launch_bounds__(kPermuteThreads)
    permute_count_kernel(const std::int32_t* __restrict__ ids, std::uint32_t entries, std::uint32_t experts,
                         std::int32_t* __restrict__ hist) {
  __shared__ int counts[kPermuteExpertsMax];
  for (std::uint32_t e = threadIdx.x; e < experts; e += kPermuteThreads) counts[e] = 0;
  __syncthreads();
  const std::uint32_t begin = blockIdx.x * kPermuteChunk;
  int id[kPermuteRounds];
#pragma unroll
  for (int r = 0; r < kPermuteRounds; ++r) {
    const std::uint32_t i = begin + r * kPermuteThreads + threadIdx.x;
    id[r] = i < entries ? __ldg(ids + i) : -1;
  }
#pragma unroll
  for (int r = 0; r < kPermuteRounds; ++r)
    if (static_cast<std::uint32_t>(id[r]) < experts) atomicAdd(&counts[id[r]], 1);
  __syncthreads();
  for (std::uint32_t e = threadIdx.x; e < experts; e += kPermuteThreads)
    hist[static_cast<std::uint64_t>(blockIdx.x) * experts + e] = counts[e];
}

// ---------------------------------------------------------------- 2. scan
// Contiguous: offsets [E + 1] (padded block starts, [E] = M_sum) and counts [E]. Masked: masked_m.
template <bool kMasked>
__global__ void __launch_bounds__(kPermuteScanThreads)
    permute_scan_kernel(std::int32_t* __restrict__ hist, std::uint32_t chunks, std::uint32_t experts,
                        std::int32_t m_max, std::int32_t* __restrict__ offsets,
                        std::int32_t* __restrict__ counts, std::int32_t* __restrict__ masked_m) {
  constexpr int kBatch = 16;  // independent loads in flight
  const std::uint32_t e = threadIdx.x;
  int run = 0;
  if (e < experts) {
    for (std::uint32_t c0 = 0; c0 < chunks; c0 += kBatch) {
      int v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
        v[u] = c0 + u < chunks ? hist[static_cast<std::uint64_t>(c0 + u) * experts + e] : 0;
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (c0 + u < chunks) hist[static_cast<std::uint64_t>(c0 + u) * experts + e] = run;
        run += v[u];
      }
    }
  }
  if constexpr (kMasked) {
    if (e < experts) masked_m[e] = min(run, m_max);
  } else {
    using BlockScan = cub::BlockScan<int, kPermuteScanThreads>;
    __shared__ typename BlockScan::TempStorage storage;
    const int padded = (run + 127) / 128 * 128;
    int offset = 0, total = 0;
    BlockScan(storage).ExclusiveSum(padded, offset, total);
    if (e < experts) {
      offsets[e] = offset;
      counts[e] = run;
    }
    if (e == 0) offsets[experts] = total;
  }
}

// ---------------------------------------------------------------- 3. rank (+ fill)
struct PermuteRankParams {
  const std::int32_t* ids;
  std::uint32_t entries, experts, chunks;
  const std::int32_t* chunk_base;  // hist after the scan
  const std::int32_t* offsets;     // contiguous
  const std::int32_t* counts;      // contiguous
  const std::int32_t* masked_m;    // masked
  std::int32_t m_max;              // masked
  std::int32_t* src_row;
  std::int32_t* row_src;
  std::int32_t* m_indices;   // contiguous
  std::uint32_t total_rows;  // M (contiguous) or E * M_max (masked)
};

// Largest e in [0, experts) with starts[e] <= row, given starts[0] <= row.
__device__ __forceinline__ std::uint32_t permute_find_block(const int* starts, std::uint32_t experts,
                                                            int row) {
  std::uint32_t lo = 0, hi = experts;
  while (hi - lo > 1) {
    const std::uint32_t mid = (lo + hi) / 2;
    if (starts[mid] <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

template <bool kMasked>
__global__ void __launch_bounds__(kPermuteThreads) permute_rank_kernel(PermuteRankParams p) {
  __shared__ int warp_count[kPermuteWarps][kPermuteExpertsMax];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (blockIdx.x >= p.chunks) {
    // Fill: the rows that hold no entry.
    const std::uint32_t fill_blocks = gridDim.x - p.chunks;
    const std::uint32_t first = (blockIdx.x - p.chunks) * kPermuteThreads + threadIdx.x;
    if constexpr (kMasked) {
      for (std::uint32_t row = first; row < p.total_rows; row += fill_blocks * kPermuteThreads) {
        const std::uint32_t e = row / static_cast<std::uint32_t>(p.m_max);
        const int m = static_cast<int>(row - e * static_cast<std::uint32_t>(p.m_max));
        if (m >= __ldg(p.masked_m + e)) p.row_src[row] = -1;
      }
    } else {
      int* starts = &warp_count[0][0];
      for (std::uint32_t e = threadIdx.x; e < p.experts; e += kPermuteThreads)
        starts[e] = __ldg(p.offsets + e);
      __syncthreads();
      for (std::uint32_t row = first; row < p.total_rows; row += fill_blocks * kPermuteThreads) {
        const std::uint32_t e = permute_find_block(starts, p.experts, static_cast<int>(row));
        const bool valid = static_cast<int>(row) < starts[e] + __ldg(p.counts + e);
        p.m_indices[row] = valid ? static_cast<int>(e) : -1;
        if (!valid) p.row_src[row] = -1;
      }
    }
    return;
  }

  for (std::uint32_t i = threadIdx.x; i < kPermuteWarps * p.experts; i += kPermuteThreads)
    warp_count[i / p.experts][i % p.experts] = 0;
  __syncthreads();

  // Warp w's entries: [chunk start + 128 w, + 128), round r at + 32 r + lane.
  const std::uint32_t first = blockIdx.x * kPermuteChunk + warp * (32 * kPermuteRounds) + lane;
  int id[kPermuteRounds], rank[kPermuteRounds];
#pragma unroll
  for (int r = 0; r < kPermuteRounds; ++r) {
    const std::uint32_t i = first + 32 * r;
    const int v = i < p.entries ? __ldg(p.ids + i) : -1;
    id[r] = static_cast<std::uint32_t>(v) < p.experts ? v : -1;
  }
  const std::uint32_t lanes_below = (1u << lane) - 1u;
#pragma unroll
  for (int r = 0; r < kPermuteRounds; ++r) {
    const std::uint32_t peers = __match_any_sync(0xffffffffu, id[r]);
    const int below = __popc(peers & lanes_below);
    const int before = id[r] >= 0 ? warp_count[warp][id[r]] : 0;
    __syncwarp();
    if (id[r] >= 0 && below == 0) warp_count[warp][id[r]] = before + __popc(peers);  // one writer per id
    __syncwarp();
    rank[r] = before + below;
  }
  __syncthreads();
  // Per expert, exclusive scan over the warps (warp order = entry order).
  for (std::uint32_t e = threadIdx.x; e < p.experts; e += kPermuteThreads) {
    int run = 0;
#pragma unroll
    for (int w = 0; w < kPermuteWarps; ++w) {
      const int v = warp_count[w][e];
      warp_count[w][e] = run;
      run += v;
    }
  }
  __syncthreads();
  const std::int32_t* base = p.chunk_base + static_cast<std::uint64_t>(blockIdx.x) * p.experts;
#pragma unroll
  for (int r = 0; r < kPermuteRounds; ++r) {
    const std::uint32_t i = first + 32 * r;
    if (i >= p.entries) continue;
    int row = -1;
    if (id[r] >= 0) {
      const int rel = __ldg(base + id[r]) + warp_count[warp][id[r]] + rank[r];
      if constexpr (kMasked) {
        row = rel < p.m_max ? id[r] * p.m_max + rel : -1;
      } else {
        row = __ldg(p.offsets + id[r]) + rel;
      }
    }
    p.src_row[i] = row;
    if (row >= 0) p.row_src[row] = static_cast<int>(i);
  }
}

// ---------------------------------------------------------------- 4. copy
struct PermuteCopyParams {
  const uint4* x;         // [T, vecs_per_row]
  const float* x_scales;  // [T, groups] (fp8)
  const std::int32_t* src_row;
  std::uint32_t tokens, topk, vecs_per_row, segments, groups;
  uint4* rows;             // [rows, vecs_per_row]
  float* scales;           // token-major [rows, groups] or MN-major
  std::uint32_t scale_ld;  // MN-major: padded rows of one scale column
  std::uint32_t m_max;     // masked MN-major: rows per expert
};

template <bool kScales, bool kMnMajor, bool kMasked>
__global__ void __launch_bounds__(kPermuteThreads) permute_copy_kernel(PermuteCopyParams p) {
  const int lane = threadIdx.x % 32;
  const std::uint32_t num_warps = gridDim.x * kPermuteWarps;
  const std::uint32_t items = p.tokens * p.segments;
  for (std::uint32_t item = (blockIdx.x * kPermuteThreads + threadIdx.x) / 32; item < items;
       item += num_warps) {
    const std::uint32_t t = item / p.segments;
    const std::uint32_t s = item - t * p.segments;
    const int my_row = static_cast<std::uint32_t>(lane) < p.topk ? __ldg(p.src_row + t * p.topk + lane) : -1;
    if (__ballot_sync(0xffffffffu, my_row >= 0) == 0u) continue;  // warp-uniform

    const std::uint32_t v0 = s * 32 * kPermuteCopyVecs + lane;
    const uint4* src = p.x + static_cast<std::uint64_t>(t) * p.vecs_per_row;
    uint4 v[kPermuteCopyVecs];
#pragma unroll
    for (int u = 0; u < kPermuteCopyVecs; ++u) {
      const std::uint32_t idx = v0 + 32 * u;
      v[u] = idx < p.vecs_per_row ? ptx::ld_nc_v4(src + idx) : make_uint4(0, 0, 0, 0);
    }
    for (std::uint32_t k = 0; k < p.topk; ++k) {
      const int row = __shfl_sync(0xffffffffu, my_row, static_cast<int>(k));
      if (row < 0) continue;  // warp-uniform
      uint4* dst = p.rows + static_cast<std::uint64_t>(row) * p.vecs_per_row;
#pragma unroll
      for (int u = 0; u < kPermuteCopyVecs; ++u) {
        const std::uint32_t idx = v0 + 32 * u;
        if (idx < p.vecs_per_row) dst[idx] = v[u];
      }
    }

    if constexpr (kScales) {
      if (s != 0) continue;
      for (std::uint32_t g0 = 0; g0 < p.groups; g0 += 32) {
        const std::uint32_t g = g0 + lane;
        const float sv =
            g < p.groups ? __ldg(p.x_scales + static_cast<std::uint64_t>(t) * p.groups + g) : 0.0f;
        for (std::uint32_t k = 0; k < p.topk; ++k) {
          const int row = __shfl_sync(0xffffffffu, my_row, static_cast<int>(k));
          if (row < 0 || g >= p.groups) continue;
          const auto r = static_cast<std::uint32_t>(row);
          if constexpr (!kMnMajor) {
            p.scales[static_cast<std::uint64_t>(r) * p.groups + g] = sv;
          } else if constexpr (kMasked) {
            const std::uint32_t e = r / p.m_max;
            p.scales[(static_cast<std::uint64_t>(e) * p.groups + g) * p.scale_ld + (r - e * p.m_max)] = sv;
          } else {
            p.scales[static_cast<std::uint64_t>(g) * p.scale_ld + r] = sv;
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------- gather
struct GatherParams {
  const uint4* rows;  // expert output [num_rows, vecs_per_row] bf16
  std::uint32_t num_rows;
  const std::int32_t* src_row;  // [T, K]
  const float* weights;         // [T, K]
  std::uint32_t tokens, topk, vecs_per_row, segments;
  uint4* y;  // [T, vecs_per_row] bf16
};

__device__ __forceinline__ std::uint32_t gather_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return (static_cast<std::uint32_t>(__bfloat16_as_ushort(v.y)) << 16) | __bfloat16_as_ushort(v.x);
}

__global__ void __launch_bounds__(kPermuteThreads) gather_weighted_kernel(GatherParams p) {
  const int lane = threadIdx.x % 32;
  const std::uint32_t num_warps = gridDim.x * kPermuteWarps;
  const std::uint32_t items = p.tokens * p.segments;
  for (std::uint32_t item = (blockIdx.x * kPermuteThreads + threadIdx.x) / 32; item < items;
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
      dst[idx] = make_uint4(gather_bf16x2(acc[u][0], acc[u][1]), gather_bf16x2(acc[u][2], acc[u][3]),
                            gather_bf16x2(acc[u][4], acc[u][5]), gather_bf16x2(acc[u][6], acc[u][7]));
    }
  }
}

}  // namespace epmoe::kernels
