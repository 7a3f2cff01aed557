// Token counter per expert or slot (device code; host launcher in eplb_gpu.cu, API in
// epmoe/cuda/eplb.hpp: count_experts).
//
// counts[id] += the number of elements equal to id, for ids in [0, num_counters); others (the
// mapping's -1) are skipped. The layer runs it on the physical ids, on its side stream beside the
// dispatch, so the per-slot (and through the placement, per-expert) load costs the critical path
// nothing; the mapping kernel no longer counts (eplb_kernels.cuh).
//  - Each thread reads kEplbWidth consecutive ids with one 16-byte load (kWide; else one id), and
//    adds them to a per-block shared-memory histogram (num_counters <= kEplbCountBins), which the
//    block adds to the global counters once per non-empty bin at its end; with more counters, one
//    global atomic per id.
#pragma once

#include <cstdint>
#include <type_traits>

namespace epmoe::kernels {

inline constexpr int kEplbCountThreads = 512;
inline constexpr int kEplbCountBins = 8192;  // 32 KiB of shared memory

template <bool kShared, bool kWide>
__global__ void __launch_bounds__(kEplbCountThreads)
    eplb_count_kernel(const std::int32_t* __restrict__ ids, std::uint32_t n, int num_counters,
                      unsigned long long* __restrict__ counts) {
  constexpr int kW = kWide ? 4 : 1;
  using Vec = std::conditional_t<kWide, int4, int>;
  extern __shared__ unsigned hist[];
  if constexpr (kShared) {
    for (int x = static_cast<int>(threadIdx.x); x < num_counters; x += kEplbCountThreads) hist[x] = 0u;
    __syncthreads();
  }
  const auto add = [&](int id) {
    if (static_cast<unsigned>(id) >= static_cast<unsigned>(num_counters)) return;
    if constexpr (kShared) {
      atomicAdd(hist + id, 1u);
    } else {
      atomicAdd(counts + id, 1ull);
    }
  };
  const std::uint32_t vectors = n / kW;
  const std::uint32_t stride = gridDim.x * static_cast<std::uint32_t>(kEplbCountThreads);
  for (std::uint32_t v = blockIdx.x * static_cast<std::uint32_t>(kEplbCountThreads) + threadIdx.x;
       v < vectors; v += stride) {
    const Vec x = __ldg(reinterpret_cast<const Vec*>(ids) + v);
    if constexpr (kWide) {
      add(x.x);
      add(x.y);
      add(x.z);
      add(x.w);
    } else {
      add(x);
    }
  }
  if constexpr (kShared) {
    __syncthreads();
    for (int x = static_cast<int>(threadIdx.x); x < num_counters; x += kEplbCountThreads) {
      const unsigned c = hist[x];
      if (c != 0u) atomicAdd(counts + x, static_cast<unsigned long long>(c));
    }
  }
}

}  // namespace epmoe::kernels
