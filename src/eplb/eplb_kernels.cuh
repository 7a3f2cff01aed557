// EPLB mapping kernel (device code; host launcher in eplb_gpu.cu, API in epmoe/cuda/eplb.hpp).
//
// The [T, K] ids are one flat array of n = T*K elements; each thread takes up to kEplbItems elements
// per pass (coalesced: element base + u * stride), issuing all their loads before using any. Static
// choice depends only on the expert, so each block first tabulates it for every expert in shared
// memory; dynamic choice hashes (src_rank, token, k) per element, with each block's copy of the
// replica counts and (when it fits, kEplbSmemRows) of log2phy in shared memory. Both go through
// eplb::choose_replica, the function ExpertPlacement::choose uses. The counters are a per-block
// shared-memory histogram (shared atomics), summed over the block's cluster (distributed shared
// memory) and added to the global i64 counters once per non-empty bin and cluster.
#pragma once

#include <cstdint>

#include <cooperative_groups.h>

#include "eplb/replica_choice.hpp"

namespace epmoe::kernels {

inline constexpr int kEplbThreads = 256;
inline constexpr int kEplbItems = 8;  // elements per thread per pass

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
  unsigned long long* counts;  // [E] or nullptr (kCount == false)
  bool rows_in_smem;           // dynamic: log2phy copied to shared memory (E * max_replicas <= kEplbSmemRows)
};

// Dynamic choice keeps log2phy in shared memory up to this many entries (16 KiB; DeepSeek-V3's 256
// experts with up to 16 replicas each), else reads the replicated experts' rows from global memory.
inline constexpr int kEplbSmemRows = 4096;

// The physical slot of logical expert e for element `index` (= t * K + k) from the global tables,
// or -1 when e's replica count is out of range.
template <bool kDynamic>
__device__ __forceinline__ std::int32_t choose(const EplbParams& p, int e, std::uint32_t index) {
  const int count = __ldg(p.logcnt + e);
  if (count < 1 || count > p.max_replicas) return -1;
  const std::int32_t* replicas = p.log2phy + static_cast<std::int64_t>(e) * p.max_replicas;
  std::int64_t token = 0;
  int k = 0;
  if constexpr (kDynamic) {
    const std::uint32_t t = index / p.topk;
    token = p.token_offset + t;
    k = static_cast<int>(index - t * p.topk);
  }
  return eplb::choose_replica(replicas, count, p.src_rank, p.slots_per_rank, token, k, kDynamic);
}

template <bool kDynamic, bool kCount>
__global__ void __launch_bounds__(kEplbThreads) eplb_map_kernel(const EplbParams p) {
  // [E] static choice (static) or replica count, 0 when out of range (dynamic); [E] histogram
  // (kCount); [E * max_replicas] log2phy (dynamic with rows_in_smem).
  extern __shared__ std::int32_t smem[];
  const int num_logical = p.num_logical;
  std::int32_t* const table = smem;
  unsigned* const hist = reinterpret_cast<unsigned*>(smem + num_logical);
  std::int32_t* const rows = smem + num_logical * (kCount ? 2 : 1);

  const std::uint32_t stride = gridDim.x * kEplbThreads;
  int e[kEplbItems];
  auto load = [&](std::uint32_t base) {
#pragma unroll
    for (int u = 0; u < kEplbItems; ++u) {
      const std::uint32_t i = base + u * stride;
      e[u] = i < p.n ? __ldg(p.logical + i) : -1;
    }
  };
  // The first pass's ids are requested before the tables are built, so that their latency overlaps
  // the tables': at the sizes the layer uses (one pass) the kernel is a chain of latencies, not
  // bandwidth.
  std::uint32_t base = blockIdx.x * kEplbThreads + threadIdx.x;
  load(base);
  for (int x = static_cast<int>(threadIdx.x); x < num_logical; x += kEplbThreads) {
    if constexpr (kDynamic) {
      const int count = __ldg(p.logcnt + x);
      table[x] = count >= 1 && count <= p.max_replicas ? count : 0;
    } else {
      table[x] = choose<false>(p, x, 0);
    }
    if constexpr (kCount) hist[x] = 0u;
  }
  if (kDynamic && p.rows_in_smem) {
    for (int x = static_cast<int>(threadIdx.x); x < num_logical * p.max_replicas; x += kEplbThreads)
      rows[x] = __ldg(p.log2phy + x);
  }
  __syncthreads();

  for (; base < p.n; base += stride * kEplbItems) {
    // All of a pass's choices first, then its stores: a global load of a replica row (dynamic, rows
    // not in shared memory) may not move above an earlier item's store (they could alias), and the
    // items' loads should overlap, not follow one another.
    std::int32_t physical[kEplbItems];
#pragma unroll
    for (int u = 0; u < kEplbItems; ++u) {
      const std::uint32_t i = base + u * stride;
      physical[u] = -1;
      if (i < p.n && e[u] >= 0 && e[u] < num_logical) {
        if constexpr (kDynamic) {
          const int count = table[e[u]];
          if (count == 0) {
            physical[u] = -1;
          } else if (p.rows_in_smem) {
            const std::uint32_t t = i / p.topk;
            physical[u] =
                eplb::choose_replica(rows + e[u] * p.max_replicas, count, p.src_rank, p.slots_per_rank,
                                     p.token_offset + t, static_cast<int>(i - t * p.topk), true);
          } else {
            physical[u] = choose<true>(p, e[u], i);
          }
        } else {
          physical[u] = table[e[u]];
        }
        if constexpr (kCount) atomicAdd(hist + e[u], 1u);
      }
    }
#pragma unroll
    for (int u = 0; u < kEplbItems; ++u) {
      const std::uint32_t i = base + u * stride;
      if (i < p.n) p.physical[i] = physical[u];
    }
    if (base + stride * kEplbItems < p.n) load(base + stride * kEplbItems);
  }

  if constexpr (kCount) {
    // The blocks of a cluster add up their histograms through distributed shared memory and flush
    // each bin once per cluster: every bin of every block went to the same E global counters, and
    // those same-address atomics, not the ids, set the kernel's length at T = 16384 (128 blocks).
    // Without a cluster launch the cluster is the block itself.
    cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    cluster.sync();  // every histogram of the cluster complete
    const int blocks = static_cast<int>(cluster.num_blocks()), rank = static_cast<int>(cluster.block_rank());
    for (int x = rank + blocks * static_cast<int>(threadIdx.x); x < num_logical; x += blocks * kEplbThreads) {
      unsigned c = 0;
      for (int r = 0; r < blocks; ++r) c += cluster.map_shared_rank(hist, r)[x];
      if (c != 0u) atomicAdd(p.counts + x, static_cast<unsigned long long>(c));
    }
    cluster.sync();  // no block leaves while another still reads its histogram
  }
}

}  // namespace epmoe::kernels
