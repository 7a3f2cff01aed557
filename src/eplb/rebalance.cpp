// DeepSeek's expert-parallel load balancer (design.md §5), written from the published algorithm:
//   1. balanced packing of expert groups onto nodes by group load,
//   2. inside each node, replicas for the experts with the highest load per replica until the
//      node's physical slots are full,
//   3. balanced packing of the node's replicas onto its GPUs by per-replica load.
// The global policy is the same with one node and one group.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

#include "epmoe/eplb.hpp"
#include "epmoe/error.hpp"

namespace epmoe {
namespace {

// The load one replica carries in the model the GPUs are packed on (and busiest_rank_load measures):
// its share of the expert's load, plus the slot cost when the expert has any load.
double replica_load(double expert_load, int replicas, double slot_cost) {
  return expert_load / replicas + (expert_load > 0 ? slot_cost : 0.0);
}

// Where each item went: pack[i] is its pack, slot[i] its position inside that pack.
struct Packing {
  std::vector<int> pack, slot;
};

// Puts n weighted items into num_packs packs of exactly n / num_packs items each, heaviest item
// first, each into the least loaded pack that still has room (ties go to the lower pack index).
// With one item per pack the items keep their own index (nothing to balance, nothing to move).
Packing balanced_packing(std::span<const double> weight, int num_packs) {
  const int n = static_cast<int>(weight.size());
  const int per_pack = n / num_packs;
  Packing out{std::vector<int>(weight.size()), std::vector<int>(weight.size(), 0)};
  if (per_pack == 1) {
    std::iota(out.pack.begin(), out.pack.end(), 0);
    return out;
  }
  std::vector<int> order(weight.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return weight[a] > weight[b]; });
  std::vector<double> pack_load(static_cast<std::size_t>(num_packs), 0.0);
  std::vector<int> pack_size(static_cast<std::size_t>(num_packs), 0);
  for (int item : order) {
    int best = -1;
    for (int p = 0; p < num_packs; ++p) {
      if (pack_size[p] < per_pack && (best < 0 || pack_load[p] < pack_load[best])) best = p;
    }
    out.pack[item] = best;
    out.slot[item] = pack_size[best]++;
    pack_load[best] += weight[item];
  }
  return out;
}

// Grows n experts to num_slots replicas. Replica i < n is expert i; every further replica goes to
// the expert with the highest load per replica, the lowest index among equals (DeepSeek's argmax, so
// that tied loads, e.g. integer counts or idle experts, give eplb.py's placement).
struct Replication {
  std::vector<int> replica_expert;  // [num_slots]
  std::vector<int> count;           // [n]
};

Replication replicate_experts(std::span<const double> weight, int num_slots, double slot_cost) {
  const int n = static_cast<int>(weight.size());
  Replication out;
  out.replica_expert.resize(static_cast<std::size_t>(num_slots));
  std::iota(out.replica_expert.begin(), out.replica_expert.begin() + n, 0);
  out.count.assign(weight.size(), 1);
  for (int r = n; r < num_slots; ++r) {
    int best = 0;
    for (int e = 1; e < n; ++e) {
      const double per = weight[e] / out.count[e];
      const double best_per = weight[best] / out.count[best];
      if (per > best_per) best = e;
    }
    if (slot_cost > 0 && weight[best] / (out.count[best] + 1) < slot_cost) {
      // No replica pays for its weight reads: this slot replicates the coldest expert (fewest
      // replicas first, then the lowest id) instead.
      best = 0;
      for (int e = 1; e < n; ++e) {
        if (weight[e] < weight[best] || (weight[e] == weight[best] && out.count[e] < out.count[best]))
          best = e;
      }
    }
    out.replica_expert[r] = best;
    ++out.count[best];
  }
  return out;
}

void rebalance_layer(std::span<const double> load, int num_physical, int num_groups, int num_nodes,
                     int num_gpus, double slot_cost, std::span<std::int32_t> phy2log,
                     std::span<std::int32_t> logcnt) {
  const int num_logical = static_cast<int>(load.size());
  const int group_size = num_logical / num_groups;
  const int groups_per_node = num_groups / num_nodes;
  const int logical_per_node = num_logical / num_nodes;
  const int physical_per_node = num_physical / num_nodes;
  const int gpus_per_node = num_gpus / num_nodes;
  const int slots_per_gpu = num_physical / num_gpus;

  // 1. Groups to nodes. node_expert lists the logical experts node by node: node n holds
  //    node_expert[n * logical_per_node, (n + 1) * logical_per_node).
  std::vector<double> group_load(static_cast<std::size_t>(num_groups), 0.0);
  for (int e = 0; e < num_logical; ++e) group_load[e / group_size] += load[e];
  const Packing groups = balanced_packing(group_load, num_nodes);
  std::vector<int> node_expert(static_cast<std::size_t>(num_logical));
  for (int e = 0; e < num_logical; ++e) {
    const int g = e / group_size;
    const int position = (groups.pack[g] * groups_per_node + groups.slot[g]) * group_size + e % group_size;
    node_expert[position] = e;
  }

  std::vector<double> node_load(static_cast<std::size_t>(logical_per_node));
  std::vector<double> load_of_replica(static_cast<std::size_t>(physical_per_node));
  for (int node = 0; node < num_nodes; ++node) {
    const int* experts = node_expert.data() + static_cast<std::ptrdiff_t>(node) * logical_per_node;
    for (int j = 0; j < logical_per_node; ++j) node_load[j] = load[experts[j]];

    // 2. Replicas inside the node.
    const Replication rep = replicate_experts(node_load, physical_per_node, slot_cost);
    for (int j = 0; j < logical_per_node; ++j) logcnt[experts[j]] = rep.count[j];

    // 3. Replicas to the node's GPUs, by the load each replica carries.
    for (int r = 0; r < physical_per_node; ++r) {
      const int j = rep.replica_expert[r];
      load_of_replica[r] = replica_load(node_load[j], rep.count[j], slot_cost);
    }
    const Packing gpus = balanced_packing(load_of_replica, gpus_per_node);
    for (int r = 0; r < physical_per_node; ++r) {
      const int slot = node * physical_per_node + gpus.pack[r] * slots_per_gpu + gpus.slot[r];
      phy2log[slot] = experts[rep.replica_expert[r]];
    }
  }
}

}  // namespace

RebalanceResult rebalance_experts(const std::vector<std::vector<double>>& load, int num_physical,
                                  int num_groups, int num_nodes, int num_gpus, double slot_cost) {
  EPMOE_CHECK(std::isfinite(slot_cost) && slot_cost >= 0, "slot_cost must be finite and >= 0, got {}",
              slot_cost);
  EPMOE_CHECK(!load.empty(), "load must have at least one layer ([L][E] per-expert loads)");
  const std::size_t num_logical_sz = load[0].size();
  EPMOE_CHECK(num_logical_sz > 0, "load[0] is empty: each layer needs one load per logical expert");
  EPMOE_CHECK(num_logical_sz <= (1u << 24), "load has {} experts per layer, too many", num_logical_sz);
  const int num_logical = static_cast<int>(num_logical_sz);
  for (std::size_t l = 0; l < load.size(); ++l) {
    EPMOE_CHECK(load[l].size() == num_logical_sz,
                "load[{}] has {} experts but load[0] has {}: every layer needs the same number", l,
                load[l].size(), num_logical_sz);
    for (std::size_t e = 0; e < num_logical_sz; ++e) {
      const double v = load[l][e];
      EPMOE_CHECK(std::isfinite(v) && v >= 0.0, "load[{}][{}] = {} must be finite and non-negative", l, e, v);
    }
  }
  EPMOE_CHECK(num_gpus > 0, "num_gpus must be positive, got {}", num_gpus);
  EPMOE_CHECK(num_nodes > 0, "num_nodes must be positive, got {}", num_nodes);
  EPMOE_CHECK(num_groups > 0, "num_groups must be positive, got {}", num_groups);
  EPMOE_CHECK(num_physical >= num_logical,
              "num_physical ({}) must be at least the number of logical experts ({})", num_physical,
              num_logical);
  EPMOE_CHECK(num_physical % num_gpus == 0, "num_physical ({}) must be a multiple of num_gpus ({})",
              num_physical, num_gpus);
  // (DeepSeek's global policy, for groups that do not divide over the nodes, places over all GPUs as one
  // node: only the hierarchical policy needs the GPUs to divide over the nodes.)
  const bool hierarchical = num_groups % num_nodes == 0;
  if (hierarchical) {
    EPMOE_CHECK(
        num_gpus % num_nodes == 0,
        "num_gpus ({}) must be a multiple of num_nodes ({}) for the hierarchical policy (num_groups % "
        "num_nodes == 0)",
        num_gpus, num_nodes);
    EPMOE_CHECK(num_logical % num_groups == 0,
                "the number of logical experts ({}) must be a multiple of num_groups ({}) for the "
                "hierarchical policy (num_groups % num_nodes == 0)",
                num_logical, num_groups);
  } else {
    num_groups = 1;
    num_nodes = 1;
  }

  RebalanceResult result;
  result.num_layers = static_cast<int>(load.size());
  result.num_logical = num_logical;
  result.num_physical = num_physical;
  const auto L = load.size();
  const auto E = num_logical_sz;
  const auto P = static_cast<std::size_t>(num_physical);
  result.phy2log.assign(L * P, -1);
  result.logcnt.assign(L * E, 0);
  for (std::size_t l = 0; l < L; ++l) {
    rebalance_layer(load[l], num_physical, num_groups, num_nodes, num_gpus, slot_cost,
                    std::span<std::int32_t>(result.phy2log).subspan(l * P, P),
                    std::span<std::int32_t>(result.logcnt).subspan(l * E, E));
  }

  // log2phy: each expert's replicas in increasing slot order, -1 padded to the largest count.
  result.max_replicas = *std::max_element(result.logcnt.begin(), result.logcnt.end());
  const auto R = static_cast<std::size_t>(result.max_replicas);
  result.log2phy.assign(L * E * R, -1);
  std::vector<std::size_t> filled(E);
  for (std::size_t l = 0; l < L; ++l) {
    std::fill(filled.begin(), filled.end(), 0);
    for (std::size_t p = 0; p < P; ++p) {
      const auto e = static_cast<std::size_t>(result.phy2log[l * P + p]);
      result.log2phy[(l * E + e) * R + filled[e]++] = static_cast<std::int32_t>(p);
    }
  }
  return result;
}

ExpertPlacement placement_from(const RebalanceResult& result, int layer, int num_ranks) {
  EPMOE_CHECK(layer >= 0 && layer < result.num_layers, "layer {} is out of range [0, {})", layer,
              result.num_layers);
  const auto P = static_cast<std::size_t>(result.num_physical);
  EPMOE_CHECK(result.phy2log.size() == static_cast<std::size_t>(result.num_layers) * P,
              "result.phy2log has {} entries, expected num_layers * num_physical = {}", result.phy2log.size(),
              static_cast<std::size_t>(result.num_layers) * P);
  const auto begin =
      result.phy2log.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(layer) * P);
  return ExpertPlacement(std::vector<std::int32_t>(begin, begin + static_cast<std::ptrdiff_t>(P)),
                         result.num_logical, num_ranks);
}

double busiest_rank_load(const ExpertPlacement& placement, std::span<const double> load, double slot_cost) {
  EPMOE_CHECK(static_cast<int>(load.size()) == placement.num_logical(),
              "load has {} experts, the placement {} logical experts", load.size(), placement.num_logical());
  EPMOE_CHECK(std::isfinite(slot_cost) && slot_cost >= 0, "slot_cost must be finite and >= 0, got {}",
              slot_cost);
  std::vector<double> rank_load(static_cast<std::size_t>(placement.num_ranks()), 0.0);
  for (int p = 0; p < placement.num_physical(); ++p) {
    const int e = placement.phy2log()[p];
    const double v = load[e];
    EPMOE_CHECK(std::isfinite(v) && v >= 0.0, "load[{}] = {} must be finite and non-negative", e, v);
    rank_load[placement.rank_of_slot(p)] += replica_load(v, placement.logcnt()[e], slot_cost);
  }
  return *std::max_element(rank_load.begin(), rank_load.end());
}

ExpertPlacement rebalance_placement(const ExpertPlacement& current, std::span<const double> load,
                                    int num_groups, int num_nodes, double slot_cost) {
  EPMOE_CHECK(static_cast<int>(load.size()) == current.num_logical(),
              "load has {} experts, the current placement {} logical experts", load.size(),
              current.num_logical());
  const RebalanceResult result =
      rebalance_experts({std::vector<double>(load.begin(), load.end())}, current.num_physical(), num_groups,
                        num_nodes, current.num_ranks(), slot_cost);
  ExpertPlacement next = placement_from(result, 0, current.num_ranks());
  if (current.num_ranks() == 1) return next;
  // Sums in another order may differ in the last bits where the loads are equal: only a clear loss
  // keeps the current placement.
  const double now = busiest_rank_load(current, load, slot_cost);
  const double then = busiest_rank_load(next, load, slot_cost);
  return then > now * (1 + 1e-12) ? current : next;
}

}  // namespace epmoe
