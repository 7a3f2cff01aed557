// EPLB mapping kernel (device code; host launcher in eplb_gpu.cu, API in epmoe/cuda/eplb.hpp).
//
// The [T, K] ids are one flat array of n = T*K elements; each thread takes kEplbItems elements
// (coalesced: element base + u * stride), issuing all their loads before using any. Static choice
// depends only on the expert, so each block first tabulates it for every expert in shared memory;
// dynamic choice hashes (src_rank, token, k) per element, from per-block tables of each expert's
// replica count and first replica (only experts with several replicas read their log2phy row per
// element). Both go through eplb::choose_replica, the function ExpertPlacement::choose uses. The
// counters are a per-block shared-memory histogram (shared atomics), added to the global i64 counters
// once per non-empty bin at the end of the block.
#pragma once

#include <cstdint>

#include "eplb/replica_choice.hpp"

namespace epmoe::kernels {

inline constexpr int kEplbMaxThreads = 1024;  // block size: 256, 512 or 1024 (the launcher's choice)
inline constexpr int kEplbItems = 8;          // elements per thread per pass

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
  int topk_shift;              // log2(K) when K is a power of two (t = index >> shift), else -1
};

// The physical slot of logical expert e (with `count` replicas, its logcnt entry) for element `index`
// (= t * K + k), or -1 when the count is out of range.
template <bool kDynamic>
__device__ __forceinline__ std::int32_t choose(const EplbParams& p, int e, int count, std::uint32_t index) {
  if (count < 1 || count > p.max_replicas) return -1;
  const std::int32_t* replicas = p.log2phy + static_cast<std::int64_t>(e) * p.max_replicas;
  std::int64_t token = 0;
  int k = 0;
  if constexpr (kDynamic) {
    const std::uint32_t t = p.topk_shift >= 0 ? index >> p.topk_shift : index / p.topk;
    token = p.token_offset + t;
    k = static_cast<int>(index - t * p.topk);
  }
  return eplb::choose_replica(replicas, count, p.src_rank, p.slots_per_rank, token, k, kDynamic);
}

template <bool kDynamic, bool kCount>
__global__ void __launch_bounds__(kEplbMaxThreads) eplb_map_kernel(const EplbParams p) {
  const int threads = static_cast<int>(blockDim.x);
  // [E] static choice (static) or replica count, 0 when out of range (dynamic); [E] first replica
  // (dynamic); [E] histogram (kCount).
  extern __shared__ std::int32_t smem[];
  std::int32_t* const table = smem;
  std::int32_t* const first = smem + p.num_logical;
  unsigned* const hist = reinterpret_cast<unsigned*>(smem + p.num_logical * (kDynamic ? 2 : 1));

  const std::uint32_t stride = gridDim.x * static_cast<std::uint32_t>(threads);
  int e[kEplbItems];
  auto load = [&](std::uint32_t base) {
#pragma unroll
    for (int u = 0; u < kEplbItems; ++u) {
      const std::uint32_t i = base + u * stride;
      e[u] = i < p.n ? __ldg(p.logical + i) : -1;
    }
  };
  // The first pass's ids are requested before the tables are built, so that their latency overlaps
  // the tables' (two dependent loads per expert): at the sizes the layer uses (one pass) the kernel
  // is a chain of such latencies, not bandwidth.
  std::uint32_t base = blockIdx.x * static_cast<std::uint32_t>(threads) + threadIdx.x;
  load(base);
  for (int x = static_cast<int>(threadIdx.x); x < p.num_logical; x += threads) {
    if constexpr (kDynamic) {
      const int count = __ldg(p.logcnt + x);
      const bool valid = count >= 1 && count <= p.max_replicas;
      table[x] = valid ? count : 0;
      first[x] = valid ? __ldg(p.log2phy + static_cast<std::int64_t>(x) * p.max_replicas) : -1;
    } else {
      table[x] = choose<false>(p, x, __ldg(p.logcnt + x), 0);
    }
    if constexpr (kCount) hist[x] = 0u;
  }
  __syncthreads();

  for (; base < p.n; base += stride * kEplbItems) {
#pragma unroll
    for (int u = 0; u < kEplbItems; ++u) {
      const std::uint32_t i = base + u * stride;
      if (i >= p.n) continue;  // (not break: the items' chains may then overlap)
      std::int32_t physical = -1;
      if (e[u] >= 0 && e[u] < p.num_logical) {
        if constexpr (kDynamic) {
          // Only experts with replicas read their log2phy row (eplb::choose_replica, as the host); the
          // count comes from the block's table, not from logcnt again.
          const int count = table[e[u]];
          physical = count <= 1 ? first[e[u]] : choose<true>(p, e[u], count, i);
        } else {
          physical = table[e[u]];
        }
        if constexpr (kCount) atomicAdd(hist + e[u], 1u);
      }
      p.physical[i] = physical;
    }
    if (base + stride * kEplbItems < p.n) load(base + stride * kEplbItems);
  }

  if constexpr (kCount) {
    __syncthreads();
    for (int x = static_cast<int>(threadIdx.x); x < p.num_logical; x += threads) {
      const unsigned c = hist[x];
      if (c != 0u) atomicAdd(p.counts + x, static_cast<unsigned long long>(c));
    }
  }
}

}  // namespace epmoe::kernels
