// The one-launch dispatch kernel (route in launch, send or copy-engine pack, and place in one grid).
// Host launcher in ep_kernels.cu.
#pragma once

#include <cstdint>

#include "comm/ep_device_common.cuh"
#include "comm/ep_kernels.hpp"
#include "comm/ep_place_kernels.cuh"
#include "comm/ep_route_kernels.cuh"
#include "comm/ep_send_kernels.cuh"

namespace epmoe::comm_detail {
namespace {

// A whole dispatch in one launch: blocks [0, send_blocks) send (or, with s.ce set, pack for the
// copy engines), the others place. Every block is resident at once (the launcher caps the grid at
// the occupancy), so the placing blocks that wait for the peers can never keep this rank's own send
// or pack blocks from running.
// kEarly: early counts (s.tagged and p.tagged set; never with the copy-engine packing).
// kRouteInLaunch (s.route_in_launch, with kEarly): every block first routes the tokens into its
// shared memory at route_smem_off (route_in_block; no route kernel before the launch), and send
// and place read the routing from there.
template <bool kEarly, bool kRouteInLaunch>
__global__ void __launch_bounds__(kThreads)
    dispatch_kernel(EpGeometry g, SendArgs s, PlaceArgs p, int send_blocks, int route_smem_off) {
  extern __shared__ __align__(128) int smem[];
  const int b = static_cast<int>(blockIdx.x);
  if constexpr (kRouteInLaunch) {
    static_assert(kEarly, "routing inside the launch comes with early counts");
    if (b == 0 && threadIdx.x == 0) stamp(kTraceRouteStart);
    const int words = (g.N + g.P) * g.W;
    auto* bitmaps = reinterpret_cast<std::uint32_t*>(reinterpret_cast<char*>(smem) + route_smem_off);
    auto* prefix = reinterpret_cast<std::int32_t*>(bitmaps + words);
    auto* count_row = prefix + words;
    auto* sids = reinterpret_cast<std::int32_t*>(
        (reinterpret_cast<std::uintptr_t>(count_row + g.count_row_len()) + 15u) & ~std::uintptr_t{15});
    const bool publish = b == 0;
    route_in_block(g, s.ids, s.T, s.tensor_scale, bitmaps, prefix, count_row, sids,
                   publish ? const_cast<std::uint32_t*>(s.bitmaps) : nullptr,
                   publish ? const_cast<std::int32_t*>(s.prefix) : nullptr,
                   publish ? const_cast<std::int32_t*>(s.count_row) : nullptr);
    if (b < send_blocks) {
      SendArgs routed = s;
      routed.bitmaps = bitmaps;
      routed.prefix = prefix;
      routed.count_row = count_row;
      send_body<true>(g, routed, b, send_blocks, reinterpret_cast<char*>(smem));
    } else {
      PlaceArgs routed = p;
      routed.bitmaps = bitmaps;
      routed.prefix = prefix;
      routed.count_row = count_row;
      place_body<true, true>(g, routed, b - send_blocks, static_cast<int>(gridDim.x) - send_blocks, smem);
    }
  } else if constexpr (kEarly) {
    if (b < send_blocks)
      send_body<true>(g, s, b, send_blocks, reinterpret_cast<char*>(smem));
    else
      place_body<true>(g, p, b - send_blocks, static_cast<int>(gridDim.x) - send_blocks, smem);
  } else {
    if (b < send_blocks && s.ce.staging != nullptr)
      pack_pieces(g, s, b, send_blocks);
    else if (b < send_blocks)
      send_body<false>(g, s, b, send_blocks, reinterpret_cast<char*>(smem));
    else
      place_body<false>(g, p, b - send_blocks, static_cast<int>(gridDim.x) - send_blocks, smem);
  }
}

}  // namespace
}  // namespace epmoe::comm_detail
