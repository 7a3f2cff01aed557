// Expert-parallel load balancing (design.md §5): placement of logical experts in physical slots,
// replica choice at dispatch time, and DeepSeek's rebalance algorithm.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "epmoe/config.hpp"
#include "epmoe/error.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe {

// One layer's placement. P = num_physical slots, rank r owns slots [r*P/ranks, (r+1)*P/ranks).
class ExpertPlacement {
 public:
  ExpertPlacement() = default;
  // From a phy2log table [P]; every logical expert in [0, num_logical) must appear at least once.
  ExpertPlacement(std::vector<std::int32_t> phy2log, int num_logical, int num_ranks);
  // Default placement: slot p holds logical p % E (the R redundant slots replicate experts 0..R-1).
  static ExpertPlacement initial(int num_logical, int num_physical, int num_ranks);

  int num_logical() const { return num_logical_; }
  int num_physical() const { return static_cast<int>(phy2log_.size()); }
  int num_ranks() const { return num_ranks_; }
  int slots_per_rank() const { return num_physical() / num_ranks_; }
  int max_replicas() const { return max_replicas_; }
  int rank_of_slot(int physical) const {
    EPMOE_CHECK(physical >= 0 && physical < num_physical(),
                "rank_of_slot: physical slot must be in [0, {}), got {}", num_physical(), physical);
    return physical / slots_per_rank();
  }

  const std::vector<std::int32_t>& phy2log() const { return phy2log_; }
  const std::vector<std::int32_t>& log2phy() const { return log2phy_; }  // [E, max_replicas], -1 padded
  const std::vector<std::int32_t>& logcnt() const { return logcnt_; }    // [E]

  // Replica choice for one (token, k) of a token that lives on src_rank.
  //  static:  the replica on src_rank if there is one, else replica (src_rank % count) — a fixed
  //           preference per (rank, expert);
  //  dynamic: replica hash(src_rank, token, k) % count — spreads one expert's tokens over its
  //           replicas; deterministic, so reruns agree.
  std::int32_t choose(std::int32_t logical, int src_rank, std::int64_t token, int k,
                      DispatchAlgorithm algorithm) const;

  // logical_ids [T, K] i32 -> physical_ids (out) [T, K] i32, tokens numbered from token_offset.
  void map_to_physical(TensorView logical_ids, TensorView physical_ids, int src_rank,
                       DispatchAlgorithm algorithm, std::int64_t token_offset = 0) const;

 private:
  std::vector<std::int32_t> phy2log_, log2phy_, logcnt_;
  int num_logical_ = 0, num_ranks_ = 1, max_replicas_ = 0;
};

// DeepSeek's EPLB output for every layer.
struct RebalanceResult {
  int num_layers = 0, num_logical = 0, num_physical = 0, max_replicas = 0;
  std::vector<std::int32_t> phy2log;  // [L, P]
  std::vector<std::int32_t> log2phy;  // [L, E, max_replicas], -1 padded
  std::vector<std::int32_t> logcnt;   // [L, E]
};

// DeepSeek's rebalance: hierarchical (pack groups to nodes, replicate within nodes, pack replicas
// to GPUs) when num_groups % num_nodes == 0, else global (one node, one group).
//   load: [L][E] per-expert load, non-negative and finite.
//   num_physical % num_gpus == 0, num_physical >= E; the hierarchical policy also needs
//   num_gpus % num_nodes == 0 and E % num_groups == 0 (the global one places over all GPUs as one node).
//   Ties (equal loads, e.g. idle experts) are broken as eplb.py's argmax and sort break them: the lowest
//   index first, so that slot_cost = 0 gives its placement on integer counts too.
//   slot_cost: the fixed cost, in load units, of a slot that receives any load — reading its weights
//   once per forward, which dominates when each expert gets few tokens (decode). 0 (the default) is
//   DeepSeek's algorithm exactly. Above 0, an expert gets another replica only while each replica
//   keeps at least slot_cost of load (a replica below that costs more weight reads than it saves);
//   the remaining slots replicate the coldest experts (which then cost nothing when unused), and
//   GPUs are packed on load / replicas + slot_cost per loaded replica.
RebalanceResult rebalance_experts(const std::vector<std::vector<double>>& load, int num_physical,
                                  int num_groups, int num_nodes, int num_gpus, double slot_cost = 0.0);

// Placement of one layer of a rebalance result.
ExpertPlacement placement_from(const RebalanceResult& result, int layer, int num_ranks);

// The load of the busiest rank under a placement, by the model the rebalance packs on: the sum over
// the rank's slots of load[e] / replicas(e), plus slot_cost for each slot whose expert has load.
// load: [E] per logical expert, finite and non-negative.
double busiest_rank_load(const ExpertPlacement& placement, std::span<const double> load,
                         double slot_cost = 0.0);

// One layer's rebalance from its current placement (what MoeLayer / GpuMoeLayer::rebalance install):
// rebalance_experts' placement, unless across ranks it would leave the busiest rank busier by
// busiest_rank_load than the current placement does, in which case the current placement stays.
// DeepSeek's greedy replication can do that on small shapes: one hot expert of 4 on 4 ranks with 16
// slots gets 13 replicas, 4 of them on one rank (0.31 of the load against the current 4 x 4's 0.25).
// On one rank every placement carries the whole load, so rebalance_experts' placement is taken.
ExpertPlacement rebalance_placement(const ExpertPlacement& current, std::span<const double> load,
                                    int num_groups, int num_nodes, double slot_cost = 0.0);

}  // namespace epmoe
