// EPLB mapping kernel (device code; host launcher in eplb_gpu.cu, API in epmoe/cuda/eplb.hpp).
//
// The [T, K] ids are one flat array of n = T*K elements. At the sizes the layer uses (one pass of the
// grid, ~1 MB of ids) the kernel is a chain of latencies (launch, the ids' and the tables' loads, the
// barriers, the stores), not bandwidth, and what it executes between them shows directly (session 18,
// ncu): so it is kept short.
//  - Each thread maps kEplbWidth consecutive elements per pass with one 16-byte load and one 16-byte
//    store (kWide; the launcher's choice when n and both pointers allow it, else one element per
//    thread), and requests the next pass's ids before this pass's stores.
//  - Each block copies the placement (logcnt and, when they fit, the log2phy rows) into shared memory
//    with one round of independent loads issued after the first pass's ids; static choice then
//    tabulates each expert's slot from those rows (eplb::choose_replica).
//  - Dynamic choice is branch-free: the hash's token-independent half is tabulated per k
//    (eplb::replica_hash_high; the launcher splits a launch whose tokens cross a multiple of 2^32, so the
//    token's high word is one per launch), then eplb::replica_hash_finish of the token's low word and
//    eplb::replica_index (0 for a single replica, as choose_replica's shortcut).
//  - No counters: the per-expert load is counted later, off the critical path, from the physical ids
//    (eplb_count_kernel.cuh). Counting here cost a barrier and a flush of atomics whose round trip
//    ended the kernel (+0.4-0.6 us of a ~1.7 us kernel at T = 4096, more with more blocks: bench/NOTES.md).
// The CPU twin (ExpertPlacement::choose) uses the same functions, so both agree bit for bit.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/ptx.cuh"
#include "eplb/replica_choice.hpp"

namespace epmoe::kernels {

inline constexpr int kEplbMaxThreads = 1024;  // block size: 256, 512 or 1024 (the launcher's choice)
inline constexpr int kEplbWidth = 4;          // elements per thread per pass (kWide)
inline constexpr int kEplbSmemInts = 12288;   // 48 KiB of shared memory at most

struct EplbParams {
  const std::int32_t* logical;  // [n]
  std::int32_t* physical;       // [n]
  std::uint32_t n;              // elements of this launch (a whole number of tokens)
  std::uint32_t topk;           // K
  int topk_shift;               // log2(K) (kPow2K)
  const std::int32_t* log2phy;  // [E, max_replicas]
  const std::int32_t* logcnt;   // [E]
  int num_logical;              // E
  int max_replicas;
  int src_rank;
  int slots_per_rank;
  std::uint32_t token_high;  // the high word of every token of this launch (dynamic)
  std::uint32_t token_low;   // the low word of the launch's first token (dynamic)
  bool rows_in_smem;         // the log2phy rows fit in shared memory beside the other tables
  bool static_in_registers;  // static choice with max_replicas <= 4: each thread tabulates its experts
                             // from registers (no rows in shared memory, no second barrier)
};

// Shared-memory ints the kernel needs: [E] count or static choice, [K] the hash's high half per k
// (dynamic), [E, max_replicas] the log2phy rows (rows_in_smem).
__host__ __device__ constexpr std::int64_t eplb_smem_ints(std::int64_t num_logical, std::int64_t max_replicas,
                                                          std::int64_t topk, bool dynamic,
                                                          bool rows_in_smem) {
  return num_logical + (dynamic ? topk : 0) + (rows_in_smem ? num_logical * max_replicas : 0);
}

template <bool kDynamic, bool kPow2K, bool kWide>
__global__ void __launch_bounds__(kEplbMaxThreads) eplb_map_kernel(const EplbParams p) {
  constexpr int kW = kWide ? kEplbWidth : 1;
  using Vec = std::conditional_t<kWide, int4, int>;
  const int threads = static_cast<int>(blockDim.x);
  const int num_logical = p.num_logical;
  const int max_replicas = p.max_replicas;
  extern __shared__ std::int32_t smem[];
  std::int32_t* const table = smem;
  std::uint32_t* const khigh = reinterpret_cast<std::uint32_t*>(smem + num_logical);
  std::int32_t* const smem_rows = smem + num_logical + (kDynamic ? p.topk : 0);
  const std::int32_t* const rows = p.rows_in_smem ? smem_rows : p.log2phy;

  const std::uint32_t vectors = p.n / kW;  // (kWide: the launcher's choice only when n % kW == 0)
  const std::uint32_t stride = gridDim.x * static_cast<std::uint32_t>(threads);
  std::uint32_t v = blockIdx.x * static_cast<std::uint32_t>(threads) + threadIdx.x;
  Vec ids{};
  if (v < vectors) ids = __ldg(reinterpret_cast<const Vec*>(p.logical) + v);

  // Both tables' loads are issued before either is stored (one latency, not two in a row).
  const int row_ints = p.rows_in_smem ? num_logical * max_replicas : 0;
  for (int x = static_cast<int>(threadIdx.x); x < num_logical || x < row_ints; x += threads) {
    const int count = x < num_logical && (kDynamic || !p.static_in_registers) ? __ldg(p.logcnt + x) : 0;
    const int slot = x < row_ints ? __ldg(p.log2phy + x) : 0;
    if (x < num_logical && (kDynamic || !p.static_in_registers))
      table[x] = count >= 1 && count <= max_replicas ? count : 0;
    if (x < row_ints) smem_rows[x] = slot;
  }
  if constexpr (kDynamic) {
    for (int k = static_cast<int>(threadIdx.x); k < static_cast<int>(p.topk); k += threads)
      khigh[k] = eplb::replica_hash_high(p.src_rank, p.token_high, k);
  }
  if constexpr (!kDynamic) {
    if (p.static_in_registers) {
      // table[x]: the static slot, from the count and the (<= 4) slots loaded together by this thread.
      for (int x = static_cast<int>(threadIdx.x); x < num_logical; x += threads) {
        const int count = __ldg(p.logcnt + x);
        std::int32_t r[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) r[j] = j < max_replicas ? __ldg(p.log2phy + x * max_replicas + j) : -1;
        table[x] = count >= 1 && count <= max_replicas
                       ? eplb::choose_static_replica4(r, count, p.src_rank, p.slots_per_rank)
                       : -1;
      }
    }
  }
  __syncthreads();
  if (!kDynamic && !p.static_in_registers) {
    // table[x]: the replica count -> the slot every element of expert x maps to (-1 when out of range).
    for (int x = static_cast<int>(threadIdx.x); x < num_logical; x += threads) {
      const int count = table[x];
      table[x] = count == 0 ? -1
                            : eplb::choose_replica(rows + static_cast<std::int64_t>(x) * max_replicas, count,
                                                   p.src_rank, p.slots_per_rank, 0, 0, false);
    }
    __syncthreads();
  }

  // The physical slot of element i (logical expert e).
  auto map_one = [&](int e, std::uint32_t i) -> std::int32_t {
    if (static_cast<unsigned>(e) >= static_cast<unsigned>(num_logical)) return -1;
    if constexpr (kDynamic) {
      const int count = table[e];
      const std::uint32_t t = kPow2K ? i >> p.topk_shift : i / p.topk;
      const std::uint32_t k = i - t * p.topk;
      const std::uint32_t h = eplb::replica_hash_finish(khigh[k], p.token_low + t);
      return count == 0 ? -1 : rows[e * max_replicas + eplb::replica_index(h, count)];
    } else {
      return table[e];
    }
  };

  for (; v < vectors; v += stride) {
    Vec out;
    if constexpr (kWide) {
      const std::uint32_t i = v * kW;
      out = make_int4(map_one(ids.x, i), map_one(ids.y, i + 1), map_one(ids.z, i + 2), map_one(ids.w, i + 3));
    } else {
      out = map_one(ids, v);
    }
    if (v + stride < vectors) ids = __ldg(reinterpret_cast<const Vec*>(p.logical) + v + stride);
    reinterpret_cast<Vec*>(p.physical)[v] = out;
  }
}

}  // namespace epmoe::kernels
