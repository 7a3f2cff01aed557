// Expert permutation kernels (device code; host launchers in permute.cu; the weighted gather back
// in gather_kernels.cuh).
//
// Permutation, deterministic (no output depends on the order atomics land in):
//   1. count:   one block per chunk of kPermuteChunk entries (i = t*K + k): the chunk's per-expert
//               histogram (shared-memory atomics: only the counts matter) -> hist[chunk][E].
//   2. scan:    one block, a thread per expert: hist[c][e] becomes the exclusive running sum over
//               chunks (the expert-relative base of chunk c), the totals give counts, the padded
//               block offsets (contiguous, a block scan) or masked_m (clamped to M_max).
//   3. rank:    one block per chunk: each warp ranks its 128 entries stably (match_any + popc over
//               4 rounds of 32, per-warp counters in shared memory), an exclusive scan over the 8
//               warps per expert gives each entry's rank inside the chunk, so row = expert offset +
//               chunk base + rank: src_row[i] and row_src[row].
//   2+3 fused for up to kPermuteInlineScanChunks chunks (T <= 32768 at K = 8): one block per chunk
//               reads the whole histogram (chunks x E counts from L2, 32 loads in flight per thread),
//               so that it has its own chunk bases and the totals (block 0 writes offsets / counts
//               or masked_m), then ranks its chunk; no serial scan over chunks, one launch less.
//   1-3 fused the same way when every chunk's block fits on the device at once (the default up to
//               kPermuteInlineScanChunks): a cooperative launch, each block counts its chunk, a
//               grid-wide barrier, then 2+3. One index launch instead of two.
//   1-3 for small batches (<= kPermuteSmallChunks chunks, e.g. T <= 256 at K = 8): one block does
//               the count, the scan and the chunks' ranks in order (one launch instead of three).
//   4. copy:    a warp per (token, segment of 32 x kPermuteCopyVecs 16-byte vectors): a whole
//               7168-byte fp8 row (bf16: 2 segments), so the row-id load and the K shuffles are paid
//               once per token. The segment and (segment-0 warp) the scales are loaded before the
//               wait for the index kernel (inputs), then the row ids, then the data goes to each of
//               the token's K rows. A few leading blocks fill m_indices and the row_src of the rows
//               that hold no entry. One block per 4 segments (no persistent loop).
// Each launch after the first is a programmatic dependent launch (PDL, permute.cu): its blocks are
// scheduled while the previous kernel runs and wait in griddepcontrol.wait until it has finished
// and its writes are visible, so the launch gaps between the 3-4 kernels overlap.
#pragma once

#include <cstdint>

#include <cooperative_groups.h>
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
// Copy: a warp per (token, 32 x 14 16-byte vectors = 7 KB, a whole fp8 row of H = 7168; bf16 rows take
// 2), 4 warps per block (short blocks: less drain at the end of the grid than with 8), 6 blocks per
// SM (56 data registers per lane, <= 80 in all).
inline constexpr int kPermuteCopyVecs = 14;
inline constexpr int kPermuteCopyThreads = 128;
inline constexpr int kPermuteCopyWarps = kPermuteCopyThreads / 32;
inline constexpr int kPermuteCopyMinBlocks = 6;

// ---------------------------------------------------------------- 1. count
// Counts chunk blockIdx.x's ids (kPermuteChunk of them, from blockIdx.x * kPermuteChunk) per expert in
// the block's shared `counts` and writes them to hist row blockIdx.x; ids outside [0, experts) count
// nowhere. No barrier after the last read of `counts`: a caller that reuses them syncs first (the fused
// scan's grid sync).
__device__ __forceinline__ void count_chunk(const std::int32_t* __restrict__ ids, std::uint32_t entries,
                                            std::uint32_t experts, int (&counts)[kPermuteExpertsMax],
                                            std::int32_t* __restrict__ hist) {
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

__global__ void __launch_bounds__(kPermuteThreads)
    permute_count_kernel(const std::int32_t* __restrict__ ids, std::uint32_t entries, std::uint32_t experts,
                         std::int32_t* __restrict__ hist) {
  __shared__ int counts[kPermuteExpertsMax];
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  count_chunk(ids, entries, experts, counts, hist);
}

// ---------------------------------------------------------------- 2. scan
// Contiguous: offsets [E + 1] (padded block starts, [E] = M_sum) and counts [E]. Masked: masked_m.
template <bool kMasked>
__global__ void __launch_bounds__(kPermuteScanThreads)
    permute_scan_kernel(std::int32_t* __restrict__ hist, std::uint32_t chunks, std::uint32_t experts,
                        std::int32_t m_max, std::int32_t* __restrict__ offsets,
                        std::int32_t* __restrict__ counts, std::int32_t* __restrict__ masked_m) {
  constexpr int kBatch = 16;  // independent loads in flight
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
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

// ---------------------------------------------------------------- 3. rank
struct PermuteRankParams {
  const std::int32_t* ids;
  std::uint32_t entries, experts, chunks;
  const std::int32_t* chunk_base;  // hist after the scan (multi-block path)
  const std::int32_t* offsets;     // contiguous: expert block starts (multi-block path)
  std::int32_t m_max;              // masked
  std::int32_t* src_row;
  std::int32_t* row_src;
};

using PermuteWarpCounts = int[kPermuteWarps][kPermuteExpertsMax];

// Ranks chunk `chunk`'s entries stably by expert. On return (after a __syncthreads) id[r] is the
// expert of this lane's entry in round r (-1: skipped), rank[r] its rank among the same expert's
// entries of its warp, and warp_count[w][e] the number of expert e's entries in warps < w of the
// chunk, so that an entry's rank inside the chunk is warp_count[warp][id] + rank; on_total(e, n)
// is called with the chunk's count n of each expert e. Each warp owns 128 consecutive entries,
// round r at + 32 r + lane, so (warp, round, lane) order is entry order.
template <class OnTotal>
__device__ __forceinline__ void permute_rank_chunk(const PermuteRankParams& p, std::uint32_t chunk,
                                                   PermuteWarpCounts& warp_count, int (&id)[kPermuteRounds],
                                                   int (&rank)[kPermuteRounds], OnTotal on_total) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (std::uint32_t i = threadIdx.x; i < kPermuteWarps * p.experts; i += kPermuteThreads)
    warp_count[i / p.experts][i % p.experts] = 0;
  const std::uint32_t first = chunk * kPermuteChunk + warp * (32 * kPermuteRounds) + lane;
#pragma unroll
  for (int r = 0; r < kPermuteRounds; ++r) {
    const std::uint32_t i = first + 32 * r;
    const int v = i < p.entries ? __ldg(p.ids + i) : -1;
    id[r] = static_cast<std::uint32_t>(v) < p.experts ? v : -1;
  }
  __syncthreads();  // counters zeroed
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
    on_total(e, run);
  }
  __syncthreads();
}

// src_row / row_src of this lane's entries of chunk `chunk`, given each expert's first row
// start(e) (contiguous) and its number of entries before this chunk base(e).
template <bool kMasked, class Start, class Base>
__device__ __forceinline__ void permute_write_rows(const PermuteRankParams& p, std::uint32_t chunk,
                                                   const PermuteWarpCounts& warp_count,
                                                   const int (&id)[kPermuteRounds],
                                                   const int (&rank)[kPermuteRounds], Start start,
                                                   Base base) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const std::uint32_t first = chunk * kPermuteChunk + warp * (32 * kPermuteRounds) + lane;
#pragma unroll
  for (int r = 0; r < kPermuteRounds; ++r) {
    const std::uint32_t i = first + 32 * r;
    if (i >= p.entries) continue;
    int row = -1;
    if (id[r] >= 0) {
      const int rel = base(id[r]) + warp_count[warp][id[r]] + rank[r];
      if constexpr (kMasked) {
        row = rel < p.m_max ? id[r] * p.m_max + rel : -1;  // past M_max: dropped
      } else {
        row = start(id[r]) + rel;
      }
    }
    p.src_row[i] = row;
    if (row >= 0) p.row_src[row] = static_cast<int>(i);
  }
}

// From each expert's total entries (this thread's kPerThread experts, e = threadIdx.x * kPerThread + j),
// the layout's per-expert outputs, written where `writer` (one block of the grid): masked_m = min(total,
// M_max) (masked), or offsets (each expert's rows padded to 128) with offsets[E] and counts
// (contiguous); contiguous also leaves each expert's first row in start[] for every block. The block
// scan syncs the block: every thread has read its totals before any start[] is written.
template <bool kMasked, class BlockScan, int kPerThread>
__device__ __forceinline__ void permute_write_layout(const int (&total)[kPerThread],
                                                     const PermuteRankParams& p, bool writer, int* start,
                                                     typename BlockScan::TempStorage& scan_storage,
                                                     std::int32_t* offsets, std::int32_t* counts,
                                                     std::int32_t* masked_m) {
  if constexpr (kMasked) {
    if (!writer) return;
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const std::uint32_t e = threadIdx.x * kPerThread + j;
      if (e < p.experts) masked_m[e] = min(total[j], p.m_max);
    }
  } else {
    int offset[kPerThread];
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) offset[j] = (total[j] + 127) / 128 * 128;
    int aggregate = 0;
    BlockScan(scan_storage).ExclusiveSum(offset, offset, aggregate);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const std::uint32_t e = threadIdx.x * kPerThread + j;
      if (e >= p.experts) continue;
      start[e] = offset[j];
      if (writer) {
        offsets[e] = offset[j];
        counts[e] = total[j];
      }
    }
    if (writer && threadIdx.x == 0) offsets[p.experts] = aggregate;
  }
}

// Multi-block path: one block per chunk, bases from the scan.
template <bool kMasked>
__global__ void __launch_bounds__(kPermuteThreads) permute_rank_kernel(PermuteRankParams p) {
  __shared__ PermuteWarpCounts warp_count;
  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  int id[kPermuteRounds], rank[kPermuteRounds];
  permute_rank_chunk(p, blockIdx.x, warp_count, id, rank, [](std::uint32_t, int) {});
  const std::int32_t* base = p.chunk_base + static_cast<std::uint64_t>(blockIdx.x) * p.experts;
  permute_write_rows<kMasked>(
      p, blockIdx.x, warp_count, id, rank, [&](int e) { return __ldg(p.offsets + e); },
      [&](int e) { return __ldg(base + e); });
}

// Scan + rank fused (at most kPermuteInlineScanChunks chunks): block c sums the histogram of all
// chunks itself (chunks < c into its bases, all into the totals; integer sums, so the order the
// shared-memory atomics land in does not matter), derives the expert offsets (contiguous) with a
// block scan, and ranks chunk c. Block 0 writes offsets / counts (contiguous) or masked_m (masked).
// Writes exactly what kernels 2 and 3 write.
inline constexpr std::uint32_t kPermuteInlineScanChunks = 256;

// kCount: step 1 fused in as well (a cooperative launch, every chunk's block resident): block c
// writes chunk c's histogram to `hist`, then all blocks meet at a grid-wide barrier (which also
// makes the histogram visible) before reading it; one launch instead of two, no gap between them.
template <bool kMasked, bool kCount = false>
__global__ void __launch_bounds__(kPermuteThreads)
    permute_scan_rank_kernel(PermuteRankParams p, std::int32_t* __restrict__ offsets,
                             std::int32_t* __restrict__ counts, std::int32_t* __restrict__ masked_m,
                             std::int32_t* __restrict__ hist = nullptr) {
  using BlockScan = cub::BlockScan<int, kPermuteThreads>;
  constexpr int kPerThread = kPermuteExpertsMax / kPermuteThreads;
  constexpr int kBatch = 32;  // histogram loads in flight per thread (each batch is an L2 round trip)
  // One shared-memory object, so that every address is one base plus an offset: as separate arrays,
  // ptxas re-made each array's base (S2R SR_CgaCtaId and two more) for the unrolled atomics below,
  // 34-38 times in the kernel.
  struct Shared {
    PermuteWarpCounts warp_count;
    int base[kPermuteExpertsMax];   // entries of each expert in the chunks before this one
    int start[kPermuteExpertsMax];  // totals, then (contiguous) each expert's first row
    typename BlockScan::TempStorage scan_storage;
  };
  __shared__ Shared sh;
  auto& warp_count = sh.warp_count;
  auto& base = sh.base;
  auto& start = sh.start;
  auto& scan_storage = sh.scan_storage;

  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  if constexpr (kCount) {
    count_chunk(p.ids, p.entries, p.experts, base, hist);
    cooperative_groups::this_grid().sync();
  }
  for (std::uint32_t e = threadIdx.x; e < p.experts; e += kPermuteThreads) base[e] = start[e] = 0;
  __syncthreads();
  const std::uint32_t n = p.chunks * p.experts;  // <= 256 * 1024
  const std::uint32_t before = blockIdx.x * p.experts;
  for (std::uint32_t i0 = threadIdx.x; i0 < n; i0 += kBatch * kPermuteThreads) {
    int v[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const std::uint32_t i = i0 + u * kPermuteThreads;
      v[u] = i < n ? __ldcg(p.chunk_base + i) : 0;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const std::uint32_t i = i0 + u * kPermuteThreads;
      if (i >= n || v[u] == 0) continue;
      const std::uint32_t e = i % p.experts;
      atomicAdd(&start[e], v[u]);
      if (i < before) atomicAdd(&base[e], v[u]);
    }
  }
  __syncthreads();
  int total[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const std::uint32_t e = threadIdx.x * kPerThread + j;
    total[j] = e < p.experts ? start[e] : 0;
  }
  // (start[] held the totals: the scan's sync orders every read of them before the first store)
  permute_write_layout<kMasked, BlockScan>(total, p, blockIdx.x == 0, start, scan_storage, offsets, counts,
                                           masked_m);
  // (permute_rank_chunk's first __syncthreads publishes start)
  int id[kPermuteRounds], rank[kPermuteRounds];
  permute_rank_chunk(p, blockIdx.x, warp_count, id, rank, [](std::uint32_t, int) {});
  permute_write_rows<kMasked>(
      p, blockIdx.x, warp_count, id, rank, [&](int e) { return start[e]; }, [&](int e) { return base[e]; });
}

// Small batches (at most kPermuteSmallChunks chunks): count, scan and rank in one block, one
// launch instead of three; the chunks go in order, with running per-expert bases in shared memory.
// Writes exactly what kernels 1-3 write.
inline constexpr std::uint32_t kPermuteSmallChunks = 2;

template <bool kMasked>
__global__ void __launch_bounds__(kPermuteThreads)
    permute_index_small_kernel(PermuteRankParams p, std::int32_t* __restrict__ offsets,
                               std::int32_t* __restrict__ counts, std::int32_t* __restrict__ masked_m) {
  using BlockScan = cub::BlockScan<int, kPermuteThreads>;
  constexpr int kPerThread = kPermuteExpertsMax / kPermuteThreads;
  __shared__ PermuteWarpCounts warp_count;
  __shared__ int base[kPermuteExpertsMax];         // totals, then the running expert-relative base
  __shared__ int chunk_total[kPermuteExpertsMax];  // this chunk's count of each expert
  __shared__ int start[kPermuteExpertsMax];        // contiguous: first row of each expert
  __shared__ typename BlockScan::TempStorage scan_storage;

  ptx::grid_dependency_wait();
  ptx::launch_dependents();
  for (std::uint32_t e = threadIdx.x; e < p.experts; e += kPermuteThreads) base[e] = 0;
  __syncthreads();
  for (std::uint32_t i = threadIdx.x; i < p.entries; i += kPermuteThreads) {
    const int v = __ldg(p.ids + i);
    if (static_cast<std::uint32_t>(v) < p.experts) atomicAdd(&base[v], 1);
  }
  __syncthreads();
  int total[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const std::uint32_t e = threadIdx.x * kPerThread + j;
    total[j] = e < p.experts ? base[e] : 0;
  }
  permute_write_layout<kMasked, BlockScan>(total, p, true, start, scan_storage, offsets, counts, masked_m);
  __syncthreads();  // every total read: base becomes the running base
  for (std::uint32_t e = threadIdx.x; e < p.experts; e += kPermuteThreads) base[e] = 0;

  for (std::uint32_t chunk = 0; chunk < p.chunks; ++chunk) {
    int id[kPermuteRounds], rank[kPermuteRounds];
    // (its first __syncthreads also publishes base)
    permute_rank_chunk(p, chunk, warp_count, id, rank, [&](std::uint32_t e, int n) { chunk_total[e] = n; });
    permute_write_rows<kMasked>(
        p, chunk, warp_count, id, rank, [&](int e) { return start[e]; }, [&](int e) { return base[e]; });
    __syncthreads();  // every entry has read base and warp_count
    for (std::uint32_t e = threadIdx.x; e < p.experts; e += kPermuteThreads) base[e] += chunk_total[e];
  }
}

// ---------------------------------------------------------------- 4. copy (+ fill)
struct PermuteCopyParams {
  const uint4* x;         // [T, vecs_per_row]
  const float* x_scales;  // [T, groups] (fp8)
  const std::int32_t* src_row;
  std::uint32_t tokens, topk, vecs_per_row, segments, groups;
  uint4* rows;                     // [rows, vecs_per_row]
  float* scales;                   // token-major [rows, groups] or MN-major
  std::uint32_t scale_ld;          // MN-major: padded rows of one scale column
  std::uint32_t m_max;             // masked: rows per expert
  std::uint32_t fill_blocks;       // blocks [0, fill_blocks) fill, the others copy
  std::uint32_t token_order_rows;  // (experiment) token t's k-th row written to row t*K + k
  // Fill: the rows that hold no entry get m_indices = -1 (contiguous) and row_src = -1.
  std::uint32_t experts, total_rows;  // total_rows: M (contiguous) or E * M_max (masked)
  const std::int32_t* offsets;        // contiguous
  const std::int32_t* counts;         // contiguous
  const std::int32_t* masked_m;       // masked
  std::int32_t* m_indices;            // contiguous
  std::int32_t* row_src;
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

// The fill blocks of the copy kernel: rows that hold no entry (disjoint from those the rank step wrote).
template <bool kMasked>
__device__ __forceinline__ void permute_fill(const PermuteCopyParams& p) {
  constexpr int kThreads = kPermuteCopyThreads;
  const std::uint32_t fill_blocks = p.fill_blocks;
  const std::uint32_t first = blockIdx.x * kThreads + threadIdx.x;
  if constexpr (kMasked) {
    for (std::uint32_t row = first; row < p.total_rows; row += fill_blocks * kThreads) {
      const std::uint32_t e = row / p.m_max;
      if (static_cast<int>(row - e * p.m_max) >= __ldg(p.masked_m + e)) p.row_src[row] = -1;
    }
  } else {
    __shared__ int starts[kPermuteExpertsMax];
    for (std::uint32_t e = threadIdx.x; e < p.experts; e += kThreads) starts[e] = __ldg(p.offsets + e);
    __syncthreads();
    for (std::uint32_t row = first; row < p.total_rows; row += fill_blocks * kThreads) {
      const std::uint32_t e = permute_find_block(starts, p.experts, static_cast<int>(row));
      const bool valid = static_cast<int>(row) < starts[e] + __ldg(p.counts + e);
      p.m_indices[row] = valid ? static_cast<int>(e) : -1;
      if (!valid) p.row_src[row] = -1;
    }
  }
}

// The scales of token t into its rows (my_row: lane k < K holds row k, -1 for none; all 32 lanes).
template <bool kMnMajor, bool kMasked>
__device__ __forceinline__ void permute_copy_scales(const PermuteCopyParams& p, std::uint32_t t, int my_row,
                                                    int lane) {
  for (std::uint32_t g0 = 0; g0 < p.groups; g0 += 32) {
    const std::uint32_t g = g0 + lane;
    const float sv = g < p.groups ? __ldg(p.x_scales + static_cast<std::uint64_t>(t) * p.groups + g) : 0.0f;
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

// A warp per (token, segment): the token's data and scales are inputs of the permutation (nothing
// launched since the first kernel of the call writes them), so they are loaded before
// ptx::grid_dependency_wait: under PDL the copy blocks that are resident while the index kernel runs already
// hold their data when the row ids arrive. Then the row ids (one per lane k < K), and the segment and
// scales go to each row. One item per warp, no loop (the grid covers every item).
template <bool kScales, bool kMnMajor, bool kMasked>
__global__ void __launch_bounds__(kPermuteCopyThreads, kPermuteCopyMinBlocks)
    permute_copy_kernel(PermuteCopyParams p) {
  if (blockIdx.x < p.fill_blocks) {  // first, so that they run beside the copy, not after it
    ptx::grid_dependency_wait();
    permute_fill<kMasked>(p);
    return;
  }
  const int lane = threadIdx.x % 32;
  const std::uint32_t item = ((blockIdx.x - p.fill_blocks) * kPermuteCopyThreads + threadIdx.x) / 32;
  const bool active = item < p.tokens * p.segments;  // warp-uniform
  const std::uint32_t t = active ? item / p.segments : 0;
  const std::uint32_t s = item - t * p.segments;
  const std::uint32_t v0 = s * 32 * kPermuteCopyVecs + lane;
  const uint4* src = p.x + static_cast<std::uint64_t>(t) * p.vecs_per_row;
  // Whole segment inside the row (every fp8 row of H = 7168): no per-vector guards, which would
  // hold 14 predicates and addresses in registers.
  const bool full = (s + 1) * 32 * kPermuteCopyVecs <= p.vecs_per_row;  // warp-uniform
  uint4 v[kPermuteCopyVecs];
  if (active && full) {
#pragma unroll
    for (int u = 0; u < kPermuteCopyVecs; ++u) v[u] = ptx::ld_nc_v4(src + v0 + 32 * u);
  } else {
#pragma unroll
    for (int u = 0; u < kPermuteCopyVecs; ++u) {
      const std::uint32_t idx = v0 + 32 * u;
      v[u] = active && idx < p.vecs_per_row ? ptx::ld_nc_v4(src + idx) : make_uint4(0, 0, 0, 0);
    }
  }
  float sv[2] = {0.0f, 0.0f};  // scales g = lane, lane + 32 (G <= 64; larger G: loaded after the rows)
  const bool scales_here = kScales && active && s == 0;
  if (scales_here && p.groups <= 64) {
    const float* xs = p.x_scales + static_cast<std::uint64_t>(t) * p.groups;
    if (static_cast<std::uint32_t>(lane) < p.groups) sv[0] = __ldg(xs + lane);
    if (static_cast<std::uint32_t>(lane) + 32 < p.groups) sv[1] = __ldg(xs + lane + 32);
  }
  ptx::grid_dependency_wait();  // src_row is the rank kernel's output
  if (!active) return;
  int my_row = static_cast<std::uint32_t>(lane) < p.topk ? __ldg(p.src_row + t * p.topk + lane) : -1;
  if (p.token_order_rows != 0u && my_row >= 0) my_row = static_cast<int>(t * p.topk + lane);  // (experiment)
  if (__ballot_sync(0xffffffffu, my_row >= 0) == 0u) return;  // warp-uniform: no rows

  for (std::uint32_t k = 0; k < p.topk; ++k) {
    const int row = __shfl_sync(0xffffffffu, my_row, static_cast<int>(k));
    if (row < 0) continue;  // warp-uniform
    uint4* dst = p.rows + static_cast<std::uint64_t>(row) * p.vecs_per_row + v0;
    if (full) {
#pragma unroll
      for (int u = 0; u < kPermuteCopyVecs; ++u) dst[32 * u] = v[u];
    } else {
#pragma unroll
      for (int u = 0; u < kPermuteCopyVecs; ++u)
        if (v0 + 32 * u < p.vecs_per_row) dst[32 * u] = v[u];
    }
    if (scales_here && p.groups <= 64) {
      const auto r = static_cast<std::uint32_t>(row);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const std::uint32_t g = static_cast<std::uint32_t>(lane) + 32u * h;
        if (g >= p.groups) continue;
        if constexpr (!kMnMajor) {
          p.scales[static_cast<std::uint64_t>(r) * p.groups + g] = sv[h];
        } else if constexpr (kMasked) {
          const std::uint32_t e = r / p.m_max;
          p.scales[(static_cast<std::uint64_t>(e) * p.groups + g) * p.scale_ld + (r - e * p.m_max)] = sv[h];
        } else {
          p.scales[static_cast<std::uint64_t>(g) * p.scale_ld + r] = sv[h];
        }
      }
    }
  }
  if (scales_here && p.groups > 64) permute_copy_scales<kMnMajor, kMasked>(p, t, my_row, lane);
}

}  // namespace epmoe::kernels
