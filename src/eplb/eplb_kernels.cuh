// EPLB mapping kernel (device code; host launcher in eplb_gpu.cu, API in epmoe/cuda/eplb.hpp).
//
// The [T, K] ids are one flat array of n = T*K elements; each thread takes kEplbItems elements
// (coalesced: element base + u * stride), issuing all their loads before using any. At the sizes the
// layer uses (one pass, ~1 MB of ids) the kernel is a chain of latencies, not bandwidth, so:
//  - each block copies the placement (logcnt and, when they fit, the log2phy rows) into shared memory
//    with one round of independent loads, issued after the first pass's ids so both latencies overlap;
//    static choice then tabulates each expert's slot from those rows (no serial global loads);
//  - dynamic choice hashes (src_rank, token, k) per element with the token-independent half of the hash
//    tabulated per k (eplb::replica_hash_high), and picks from the shared rows;
//  - each pass computes all its choices before its stores (so no load waits behind a store that might
//    alias it);
//  - the counters are a per-block shared-memory histogram, flushed into row (block % rows) of the
//    [rows, E] global counters: fewer blocks add into one address (same-address atomics serialize).
// Both choices go through eplb::choose_replica's pieces, as ExpertPlacement::choose, bit for bit.
#pragma once

#include <cstdint>

#include "eplb/replica_choice.hpp"

namespace epmoe::kernels {

inline constexpr int kEplbMaxThreads = 1024;  // block size: 256, 512 or 1024 (the launcher's choice)
inline constexpr int kEplbItems = 8;          // elements per thread per pass
inline constexpr int kEplbHashK = 32;         // k < kEplbHashK take the hash's high half from the table
inline constexpr int kEplbSmemInts = 12288;   // 48 KiB of shared memory at most

struct EplbParams {
  const std::int32_t* logical;  // [n]
  std::int32_t* physical;       // [n]
  std::uint32_t n;              // T * K
  std::uint32_t topk;           // K
  const std::int32_t* log2phy;  // [E, max_replicas]
  const std::int32_t* logcnt;   // [E]
  int num_logical;              // E
  int max_replicas;
  int src_rank;
  int slots_per_rank;
  std::int64_t token_offset;
  unsigned long long* counts;  // [count_rows, E] or nullptr (kCount == false)
  int count_rows;
  int topk_shift;     // log2(K) when K is a power of two (t = index >> shift), else -1
  bool rows_in_smem;  // the log2phy rows fit in shared memory beside the other tables
};

// Shared-memory ints the kernel needs (the launcher's size; rows_in_smem decides the third term).
__host__ __device__ constexpr int eplb_smem_ints(int num_logical, int max_replicas, bool rows_in_smem) {
  return 2 * num_logical + kEplbHashK + (rows_in_smem ? num_logical * max_replicas : 0);
}

template <bool kDynamic, bool kCount>
__global__ void __launch_bounds__(kEplbMaxThreads) eplb_map_kernel(const EplbParams p) {
  const int threads = static_cast<int>(blockDim.x);
  const int num_logical = p.num_logical;
  const int max_replicas = p.max_replicas;
  // [E] replica count, 0 when out of range (dynamic) / static choice; [E] histogram; [kEplbHashK]
  // the hash's high half per k (dynamic); [E, max_replicas] the log2phy rows (rows_in_smem).
  extern __shared__ std::int32_t smem[];
  std::int32_t* const table = smem;
  unsigned* const hist = reinterpret_cast<unsigned*>(smem + num_logical);
  std::uint32_t* const khigh = reinterpret_cast<std::uint32_t*>(smem + 2 * num_logical);
  std::int32_t* const smem_rows = smem + 2 * num_logical + kEplbHashK;
  const std::int32_t* const rows = p.rows_in_smem ? smem_rows : p.log2phy;

  const std::uint32_t stride = gridDim.x * static_cast<std::uint32_t>(threads);
  int e[kEplbItems];
  auto load = [&](std::uint32_t base) {
#pragma unroll
    for (int u = 0; u < kEplbItems; ++u) {
      const std::uint32_t i = base + u * stride;
      e[u] = i < p.n ? __ldg(p.logical + i) : -1;
    }
  };
  std::uint32_t base = blockIdx.x * static_cast<std::uint32_t>(threads) + threadIdx.x;
  load(base);

  // The tables: independent loads only (counts, rows), then what derives from them after a barrier.
  for (int x = static_cast<int>(threadIdx.x); x < num_logical; x += threads) {
    const int count = __ldg(p.logcnt + x);
    table[x] = count >= 1 && count <= max_replicas ? count : 0;
    if constexpr (kCount) hist[x] = 0u;
  }
  if (p.rows_in_smem) {
    for (int x = static_cast<int>(threadIdx.x); x < num_logical * max_replicas; x += threads)
      smem_rows[x] = __ldg(p.log2phy + x);
  }
  const auto token_high = static_cast<std::uint32_t>(static_cast<std::uint64_t>(p.token_offset) >> 32);
  if constexpr (kDynamic) {
    if (threadIdx.x < kEplbHashK)
      khigh[threadIdx.x] = eplb::replica_hash_high(p.src_rank, token_high, static_cast<int>(threadIdx.x));
  }
  __syncthreads();
  if constexpr (!kDynamic) {
    // table[x]: the replica count -> the slot every element of expert x maps to (-1 when out of range).
    for (int x = static_cast<int>(threadIdx.x); x < num_logical; x += threads) {
      const int count = table[x];
      table[x] = count == 0 ? -1
                            : eplb::choose_replica(rows + static_cast<std::int64_t>(x) * max_replicas, count,
                                                   p.src_rank, p.slots_per_rank, 0, 0, false);
    }
    __syncthreads();
  }

  for (; base < p.n; base += stride * kEplbItems) {
    std::int32_t physical[kEplbItems];
#pragma unroll
    for (int u = 0; u < kEplbItems; ++u) {
      const std::uint32_t i = base + u * stride;
      physical[u] = -1;
      if (i >= p.n || e[u] < 0 || e[u] >= num_logical) continue;
      if constexpr (kDynamic) {
        const int count = table[e[u]];
        if (count != 0) {
          int index = 0;
          if (count > 1) {
            const std::uint32_t t = p.topk_shift >= 0 ? i >> p.topk_shift : i / p.topk;
            const int k = static_cast<int>(i - t * p.topk);
            const auto token = static_cast<std::uint64_t>(p.token_offset) + t;
            const auto high_word = static_cast<std::uint32_t>(token >> 32);
            const std::uint32_t high = high_word == token_high && k < kEplbHashK
                                           ? khigh[k]
                                           : eplb::replica_hash_high(p.src_rank, high_word, k);
            index = eplb::replica_index(eplb::replica_hash_finish(high, static_cast<std::uint32_t>(token)),
                                        count);
          }
          physical[u] = rows[static_cast<std::int64_t>(e[u]) * max_replicas + index];
        }
      } else {
        physical[u] = table[e[u]];
      }
      if constexpr (kCount) atomicAdd(hist + e[u], 1u);
    }
    // The next pass's ids are requested before this pass's stores.
    const std::uint32_t this_base = base;
    if (base + stride * kEplbItems < p.n) load(base + stride * kEplbItems);
#pragma unroll
    for (int u = 0; u < kEplbItems; ++u) {
      const std::uint32_t i = this_base + u * stride;
      if (i < p.n) p.physical[i] = physical[u];
    }
  }

  if constexpr (kCount) {
    __syncthreads();
    unsigned long long* const row =
        p.counts + static_cast<std::int64_t>(blockIdx.x % static_cast<unsigned>(p.count_rows)) * num_logical;
    for (int x = static_cast<int>(threadIdx.x); x < num_logical; x += threads) {
      const unsigned c = hist[x];
      if (c != 0u) atomicAdd(row + x, static_cast<unsigned long long>(c));
    }
  }
}

}  // namespace epmoe::kernels
