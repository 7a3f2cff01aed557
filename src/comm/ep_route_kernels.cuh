// Routing kernels of expert-parallel dispatch: route, scan and route_small (ids -> bitmaps, prefixes,
// count row), and route_in_block for the one-launch dispatch. Host launcher in ep_kernels.cu.
#pragma once

#include <algorithm>
#include <cstdint>

#include "comm/ep_device_common.cuh"
#include "comm/ep_kernels.hpp"

namespace epmoe::comm_detail {
namespace {

// ---------------------------------------------------------------- route
__device__ __forceinline__ void route_item(const EpGeometry& g, const std::int32_t* ids, std::int64_t i,
                                           std::uint32_t* bitmaps, int* status) {
  const std::int64_t t = i / g.K;
  const int k = static_cast<int>(i % g.K);
  const int id = ids[i];
  if (id < 0 || id >= g.P) {
    atomicOr(status, kInputIdOutOfRange);
    return;
  }
  bool duplicate = false;
  for (int k2 = 0; k2 < k; ++k2) duplicate |= ids[t * g.K + k2] == id;
  if (duplicate) {
    atomicOr(status, kInputDuplicateId);
    return;
  }
  const std::uint32_t bit = 1u << (t & 31);
  atomicOr(&bitmaps[static_cast<std::int64_t>(id / g.L) * g.W + (t >> 5)], bit);
  atomicOr(&bitmaps[static_cast<std::int64_t>(g.N + id) * g.W + (t >> 5)], bit);
}

__global__ void __launch_bounds__(kThreads)
    route_kernel(EpGeometry g, const std::int32_t* ids, std::int64_t T, std::uint32_t* bitmaps,
                 std::int32_t* count_row) {
  const std::int64_t items = T * g.K;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < items;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    route_item(g, ids, i, bitmaps, &count_row[g.status_index()]);
}

// One block per bucket: exclusive popcount prefix over its words; the total into the count row.
__global__ void __launch_bounds__(kThreads)
    scan_kernel(EpGeometry g, const std::uint32_t* bitmaps, std::int32_t* prefix, std::int32_t* count_row,
                std::int64_t T, std::int32_t host_status, std::uint32_t scale_bits) {
  const int bucket = static_cast<int>(blockIdx.x);
  if (bucket == 0 && threadIdx.x == 0) stamp(kTraceRouteStart);
  const int per = (g.W + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  const int begin = std::min(g.W, static_cast<int>(threadIdx.x) * per), end = std::min(g.W, begin + per);
  const std::uint32_t* words = bitmaps + static_cast<std::int64_t>(bucket) * g.W;
  int local = 0;
  for (int w = begin; w < end; ++w) local += __popc(words[w]);
  int total = 0;
  int running = block_exclusive_scan(local, &total);
  for (int w = begin; w < end; ++w) {
    prefix[static_cast<std::int64_t>(bucket) * g.W + w] = running;
    running += __popc(words[w]);
  }
  if (threadIdx.x == 0) {
    count_row[bucket] = total;  // tokens per destination (bucket < N), rows per physical expert
    if (bucket == 0) {
      if (host_status != 0) atomicOr(&count_row[g.status_index()], host_status);
      count_row[g.status_index() + 1] = static_cast<std::int32_t>(T);
      count_row[g.status_index() + 2] = static_cast<std::int32_t>(scale_bits);
    }
  }
}

// Small shapes (the low-latency path): route and scan in one block, the bitmaps in shared memory;
// replaces two memsets and two kernels. Same outputs as route + scan.
constexpr int kRouteSmallThreads = 1024;
constexpr std::int64_t kRouteSmallWords = 12 * 1024;  // 48 KB of bitmaps
constexpr std::int64_t kRouteSmallItems = 8 * 1024;
__global__ void __launch_bounds__(kRouteSmallThreads)
    route_small_kernel(EpGeometry g, const std::int32_t* ids, std::int64_t T, std::int64_t routed_T,
                       std::int32_t host_status, std::uint32_t scale_bits, std::uint32_t* bitmaps,
                       std::int32_t* prefix, std::int32_t* count_row) {
  extern __shared__ std::uint32_t sbits[];
  __shared__ int status;
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) stamp(kTraceRouteStart);
  const int buckets = g.N + g.P;
  const int words = buckets * g.W;
  for (int i = tid; i < words; i += kRouteSmallThreads) sbits[i] = 0;
  if (tid == 0) status = host_status;
  __syncthreads();
  const std::int64_t items = routed_T * g.K;
  for (std::int64_t i = tid; i < items; i += kRouteSmallThreads) route_item(g, ids, i, sbits, &status);
  __syncthreads();
  for (int b = tid; b < buckets; b += kRouteSmallThreads) {
    int running = 0;
    for (int w = 0; w < g.W; ++w) {
      const std::uint32_t v = sbits[b * g.W + w];
      prefix[static_cast<std::int64_t>(b) * g.W + w] = running;
      bitmaps[static_cast<std::int64_t>(b) * g.W + w] = v;
      running += __popc(v);
    }
    count_row[b] = running;
  }
  if (tid == 0) {
    count_row[g.status_index()] = status;
    count_row[g.status_index() + 1] = static_cast<std::int32_t>(T);
    count_row[g.status_index() + 2] = static_cast<std::int32_t>(scale_bits);
    count_row[g.status_index() + 3] = 0;
  }
}

// Routing inside the dispatch launch (SendArgs::route_in_launch): every block of the launch routes
// the T tokens itself, block-wide, into shared memory (route_small_kernel's outputs: bitmaps,
// prefixes, count row), so that no block waits for a route kernel and its kernel boundary (~3 us
// of the 128-token call, bench/NOTES.md LL v6). The ids are staged in shared memory (`sids`, T x K)
// in one round of loads, issued together with the clearing of the bitmaps: routing item by item
// from global memory made each thread wait for one id load (and the duplicate check's) per round,
// ~4 round trips at 128 tokens (LL v7's stamps: 4.5 us before the send). `global_*` (one block's,
// else null) also receive the routing: the combine's home kernel reads the bitmaps and prefixes.
__device__ void route_in_block(const EpGeometry& g, const std::int32_t* ids, std::int64_t T,
                               float tensor_scale, std::uint32_t* bitmaps, std::int32_t* prefix,
                               std::int32_t* count_row, std::int32_t* sids, std::uint32_t* global_bitmaps,
                               std::int32_t* global_prefix, std::int32_t* global_count_row) {
  const int tid = static_cast<int>(threadIdx.x), nthreads = static_cast<int>(blockDim.x);
  const int buckets = g.N + g.P;
  const int words = buckets * g.W;
  const int items = static_cast<int>(T) * g.K;
  if ((reinterpret_cast<std::uintptr_t>(ids) & 15u) == 0) {
    const int quads = items / 4;
    for (int i = tid; i < quads; i += nthreads)
      reinterpret_cast<int4*>(sids)[i] = reinterpret_cast<const int4*>(ids)[i];
    for (int i = 4 * quads + tid; i < items; i += nthreads) sids[i] = ids[i];
  } else {
    for (int i = tid; i < items; i += nthreads) sids[i] = ids[i];
  }
  for (int i = tid; i < words; i += nthreads) bitmaps[i] = 0;
  if (tid == 0) count_row[g.status_index()] = 0;
  __syncthreads();
  for (int i = tid; i < items; i += nthreads) route_item(g, sids, i, bitmaps, &count_row[g.status_index()]);
  __syncthreads();
  for (int b = tid; b < buckets; b += nthreads) {
    int running = 0;
    for (int w = 0; w < g.W; ++w) {
      prefix[b * g.W + w] = running;
      running += __popc(bitmaps[b * g.W + w]);
    }
    count_row[b] = running;
  }
  if (tid == 0) {
    count_row[g.status_index() + 1] = static_cast<std::int32_t>(T);
    count_row[g.status_index() + 2] = __float_as_int(tensor_scale);
    count_row[g.status_index() + 3] = 0;
  }
  __syncthreads();
  if (global_bitmaps != nullptr) {
    for (int i = tid; i < words; i += nthreads) {
      global_bitmaps[i] = bitmaps[i];
      global_prefix[i] = prefix[i];
    }
    for (int i = tid; i < g.count_row_len(); i += nthreads) global_count_row[i] = count_row[i];
  }
}

}  // namespace
}  // namespace epmoe::comm_detail
