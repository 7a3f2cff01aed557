// Synchronization kernels of the expert-parallel communicator: the LSA barrier and the flag watcher.
// Host launchers in ep_kernels.cu.
#pragma once

#include <cstdint>

#include "comm/ep_device_common.cuh"
#include "comm/ep_kernels.hpp"
#include "cuda/ptx.cuh"

namespace epmoe::comm_detail {
namespace {

// The communicator's barrier over its LSA team: this rank's `epoch` into its slot of every rank's
// barrier window (itself included; a release store at system scope, so whatever this rank's stream
// did before is visible to whoever sees it), then a bounded wait until every rank's slot in this
// rank's window reaches `epoch` (epochs compare modulo 2^32, like the sequence numbers).
__global__ void lsa_barrier_kernel(void* const* windows, std::uint32_t* own, int me, int n,
                                   std::uint32_t epoch, FlagSync sync) {
  const int tid = static_cast<int>(threadIdx.x);
  __threadfence_system();  // the stream's earlier kernels wrote into peers' windows too
  for (int d = tid; d < n; d += static_cast<int>(blockDim.x))
    st_release_sys(static_cast<std::uint32_t*>(windows[d]) + me, epoch);
  for (int d = tid; d < n; d += static_cast<int>(blockDim.x))
    if (!wait_flag(own + d, epoch, sync, CommPhase::setup, me, d)) return;
}

__global__ void watch_flags_kernel(const std::uint32_t* local_flags, const std::uint32_t* const* peer_flags,
                                   std::int64_t parity_words, int n, std::uint32_t* out,
                                   unsigned long long* time_ns) {
  // The GPU's global timer, one clock for every process on the device: the ranks' records order.
  if (threadIdx.x == 0) *time_ns = ptx::global_timer_ns_ordered();
  for (int d = static_cast<int>(threadIdx.x); d < n; d += static_cast<int>(blockDim.x)) {
    for (int parity = 0; parity < 2; ++parity) {
      out[4 * d + parity] = ld_acquire_sys(local_flags + parity * parity_words + 4 * d);
      out[4 * d + 2 + parity] = ld_acquire_sys(peer_flags[d] + parity * parity_words);
    }
  }
  __threadfence_system();
}

}  // namespace
}  // namespace epmoe::comm_detail
