// EPLB on the GPU (design.md §5): logical -> physical expert ids for each (token, k), and the
// per-logical-expert token counters that rebalancing reads. CPU twin: ExpertPlacement::map_to_physical
// (epmoe/eplb.hpp); both choose replicas through the same function (src/eplb/replica_choice.hpp),
// so the physical ids agree bit for bit, for static and dynamic choice.
//
// The mapping call only enqueues work on `stream` (no allocation, no host synchronisation, CUDA-graph
// capturable) and throws epmoe::Error naming the argument when a rule is broken.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "epmoe/config.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/eplb.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe::cuda {

// One layer's placement tables on the device (views; see DevicePlacement for an owning copy).
struct PlacementView {
  TensorView log2phy;  // [E, max_replicas] i32, Device::cuda, contiguous: each expert's slots in
                       // increasing order, -1 padded (ExpertPlacement::log2phy())
  TensorView logcnt;   // [E] i32, Device::cuda: replicas per expert, in [1, max_replicas]
  int num_ranks = 1;
  int slots_per_rank = 0;  // P / num_ranks; rank r owns slots [r * slots_per_rank, (r + 1) * slots_per_rank)
};

// An owning device copy of an ExpertPlacement's tables (allocates: not for hot paths).
struct DevicePlacement {
  DeviceTensor log2phy, logcnt;
  int num_ranks = 1;
  int slots_per_rank = 0;
  PlacementView view() const { return {log2phy.view(), logcnt.view(), num_ranks, slots_per_rank}; }
};
// Copies the tables on `stream` and waits for the copies.
DevicePlacement to_device(const ExpertPlacement& placement, cudaStream_t stream);

// logical_ids [T, K] i32 -> physical_ids (out) [T, K] i32 for tokens living on src_rank, tokens
// numbered from token_offset (dynamic choice hashes token_offset + t), as
// ExpertPlacement::map_to_physical.
// Contents are checked on the device, without throwing: an out-of-range logical id, or an expert
// whose logcnt is outside [1, max_replicas], gets physical id -1. (The CPU twin throws instead.)
// T may be 0 (nothing is launched). E <= kMaxMappedExperts. The load is counted separately
// (count_experts), so that the mapping on the critical path does not wait for counters.
inline constexpr int kMaxMappedExperts = 4096;
void map_to_physical(const PlacementView& placement, TensorView logical_ids, TensorView physical_ids,
                     int src_rank, DispatchAlgorithm algorithm, cudaStream_t stream,
                     std::int64_t token_offset = 0);

// The load counter: counts[id] += the number of elements of ids (i32, any shape, contiguous, on the
// device) equal to id, for id in [0, C) with C = counts.size(0) (counts: [C] i64 on the device);
// other ids (the mapping's -1) are skipped. Counts accumulate across calls until the caller clears
// them (cudaMemsetAsync). On physical ids (C = P slots) it gives the per-slot load, from which the
// per-expert load follows through the placement's phy2log (the layer does so).
void count_experts(TensorView ids, TensorView counts, cudaStream_t stream);

}  // namespace epmoe::cuda
