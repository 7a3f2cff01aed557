// Device code of the symmetric-window helpers: the LSA peer-pointer kernel (host launcher in
// symmetric.cu).
#pragma once

#include <nccl_device.h>

namespace epmoe::comm_detail {
namespace {

// Peer r of the world is LSA rank lsa_rank + (r - world_rank) when that lies in [0, lsa_size)
// (LSA teams are consecutive world ranks).
__global__ void peer_pointers_kernel(ncclWindow_t window, int world_rank, int lsa_rank, int lsa_size,
                                     int world_size, void** out) {
  for (int r = static_cast<int>(threadIdx.x); r < world_size; r += static_cast<int>(blockDim.x)) {
    const int lsa_peer = lsa_rank + (r - world_rank);
    out[r] = (lsa_peer >= 0 && lsa_peer < lsa_size) ? ncclGetLsaPointer(window, 0, lsa_peer) : nullptr;
  }
}

}  // namespace
}  // namespace epmoe::comm_detail
