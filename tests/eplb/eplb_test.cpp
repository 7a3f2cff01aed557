#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "eplb/replica_choice.hpp"
#include "epmoe/eplb.hpp"
#include "epmoe/tensor.hpp"
#include "expect_error.hpp"
#include "test_random.hpp"

namespace epmoe {
namespace {

// Deterministic uniform [0, 1) from a 64-bit engine (std distributions differ between libraries).
double uniform(std::mt19937_64& rng) {
  return static_cast<double>(rng() >> 11) * 0x1.0p-53;
}

std::vector<double> random_load(int num_experts, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<double> load(static_cast<std::size_t>(num_experts));
  for (double& v : load) v = std::floor(1000.0 * uniform(rng));
  return load;
}

// Zipf-like: the expert of popularity rank r (a random permutation) gets 1e5 / (r + 1)^s tokens.
std::vector<double> zipf_load(int num_experts, double s, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int> rank(static_cast<std::size_t>(num_experts));
  for (int i = 0; i < num_experts; ++i) rank[i] = i;
  for (int i = num_experts - 1; i > 0; --i)
    std::swap(rank[i], rank[rng() % static_cast<std::uint64_t>(i + 1)]);
  std::vector<double> load(static_cast<std::size_t>(num_experts));
  for (int e = 0; e < num_experts; ++e) load[e] = std::round(1e5 / std::pow(rank[e] + 1.0, s));
  return load;
}

// Structural checks of one result; returns the placements of each layer with num_gpus ranks.
std::vector<ExpertPlacement> check_result(const RebalanceResult& r,
                                          const std::vector<std::vector<double>>& load, int num_physical,
                                          int num_gpus) {
  const int L = static_cast<int>(load.size());
  const int E = static_cast<int>(load[0].size());
  const int P = num_physical;
  EXPECT_EQ(r.num_layers, L);
  EXPECT_EQ(r.num_logical, E);
  EXPECT_EQ(r.num_physical, P);
  EXPECT_GE(r.max_replicas, 1);
  EXPECT_LE(r.max_replicas, P - E + 1);
  EXPECT_EQ(r.phy2log.size(), static_cast<std::size_t>(L * P));
  EXPECT_EQ(r.logcnt.size(), static_cast<std::size_t>(L * E));
  EXPECT_EQ(r.log2phy.size(), static_cast<std::size_t>(L * E * r.max_replicas));
  std::vector<ExpertPlacement> placements;
  for (int l = 0; l < L; ++l) {
    std::vector<int> count(static_cast<std::size_t>(E), 0);
    for (int p = 0; p < P; ++p) {
      const int e = r.phy2log[l * P + p];
      EXPECT_TRUE(e >= 0 && e < E) << "layer " << l << " slot " << p;
      if (e >= 0 && e < E) ++count[e];
    }
    int sum = 0;
    for (int e = 0; e < E; ++e) {
      const int cnt = r.logcnt[l * E + e];
      EXPECT_GE(cnt, 1) << "layer " << l << " expert " << e;
      EXPECT_EQ(cnt, count[e]) << "layer " << l << " expert " << e;
      sum += cnt;
      int previous = -1;
      for (int i = 0; i < r.max_replicas; ++i) {
        const int slot = r.log2phy[(l * E + e) * r.max_replicas + i];
        if (i < cnt) {
          EXPECT_GT(slot, previous);
          EXPECT_TRUE(slot >= 0 && slot < P && r.phy2log[l * P + slot] == e);
          previous = slot;
        } else {
          EXPECT_EQ(slot, -1);
        }
      }
    }
    EXPECT_EQ(sum, P);
    placements.push_back(placement_from(r, l, num_gpus));
    const ExpertPlacement& pl = placements.back();
    EXPECT_EQ(pl.num_physical(), P);
    EXPECT_EQ(pl.num_logical(), E);
    for (int p = 0; p < P; ++p) EXPECT_EQ(pl.phy2log()[p], r.phy2log[l * P + p]);
    for (int e = 0; e < E; ++e) {
      EXPECT_EQ(pl.logcnt()[e], r.logcnt[l * E + e]);
      for (int i = 0; i < pl.logcnt()[e]; ++i) {
        EXPECT_EQ(pl.log2phy()[e * pl.max_replicas() + i], r.log2phy[(l * E + e) * r.max_replicas + i]);
      }
    }
  }
  return placements;
}

// Balanced vs naive (initial()) max GPU load for every layer; returns the worst ratio.
double check_better_than_naive(const std::vector<std::vector<double>>& load, int P, int groups, int nodes,
                               int gpus, const char* what) {
  const RebalanceResult r = rebalance_experts(load, P, groups, nodes, gpus);
  const auto placements = check_result(r, load, P, gpus);
  const int E = static_cast<int>(load[0].size());
  const ExpertPlacement naive = ExpertPlacement::initial(E, P, gpus);
  double worst = 0.0;
  for (std::size_t l = 0; l < load.size(); ++l) {
    const double balanced = busiest_rank_load(placements[l], load[l]);
    const double baseline = busiest_rank_load(naive, load[l]);
    const double total = std::accumulate(load[l].begin(), load[l].end(), 0.0);
    EXPECT_LE(balanced, baseline) << what << " layer " << l;
    EXPECT_LT(balanced / (total / gpus), 1.25) << what << " layer " << l;  // close to the mean
    worst = std::max(worst, balanced / baseline);
    std::cout << "[ eplb     ] " << what << " layer " << l
              << ": max GPU load balanced/naive = " << balanced / baseline
              << ", balanced/mean = " << balanced / (total / gpus) << "\n";
  }
  return worst;
}

TEST(EplbPlacement, InitialPlacement) {
  const ExpertPlacement pl = ExpertPlacement::initial(8, 12, 4);
  EXPECT_EQ(pl.num_physical(), 12);
  EXPECT_EQ(pl.slots_per_rank(), 3);
  EXPECT_EQ(pl.max_replicas(), 2);
  for (int p = 0; p < 12; ++p) EXPECT_EQ(pl.phy2log()[p], p % 8);
  for (int e = 0; e < 8; ++e) {
    EXPECT_EQ(pl.logcnt()[e], e < 4 ? 2 : 1);
    EXPECT_EQ(pl.log2phy()[e * 2], e);
    EXPECT_EQ(pl.log2phy()[e * 2 + 1], e < 4 ? e + 8 : -1);
  }
  EXPECT_EQ(pl.rank_of_slot(11), 3);
  EXPECT_THROW((void)pl.rank_of_slot(12), Error);
  EXPECT_THROW((void)pl.rank_of_slot(-1), Error);
  EXPECT_THROW((void)ExpertPlacement{}.rank_of_slot(0), Error);  // an empty placement (divided by 0)
}

TEST(EplbPlacement, ConstructorRefusesBadTables) {
  EXPECT_THROW(ExpertPlacement({0, 1, 2}, 3, 2), Error);      // 3 slots, 2 ranks
  EXPECT_THROW(ExpertPlacement({0, 1, 2, 4}, 4, 2), Error);   // id out of range
  EXPECT_THROW(ExpertPlacement({0, 1, -1, 2}, 4, 2), Error);  // negative id
  EXPECT_THROW(ExpertPlacement({0, 1, 1, 0}, 3, 2), Error);   // expert 2 missing
  EXPECT_THROW(ExpertPlacement({0, 1}, 2, 0), Error);         // no ranks
  EXPECT_THROW(ExpertPlacement({}, 2, 1), Error);             // no slots
  EXPECT_THROW(ExpertPlacement::initial(8, 6, 2), Error);     // P < E
  try {
    (void)ExpertPlacement({0, 1, 1, 0}, 3, 2);
    FAIL() << "expected a throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("logical expert 2 has no physical slot"), std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(ExpertPlacement({3, 2, 1, 0, 0, 0}, 4, 3));
}

TEST(EplbPlacement, StaticChoicePrefersOwnRank) {
  // 4 ranks x 2 slots. Expert 0 lives in slots 0 (rank 0), 4 (rank 2), 7 (rank 3).
  const ExpertPlacement pl({0, 1, 2, 3, 0, 1, 2, 0}, 4, 4);
  const auto s = DispatchAlgorithm::static_choice;
  EXPECT_EQ(pl.logcnt()[0], 3);
  EXPECT_EQ(pl.choose(0, 0, 0, 0, s), 0);
  EXPECT_EQ(pl.choose(0, 2, 5, 1, s), 4);
  EXPECT_EQ(pl.choose(0, 3, 9, 2, s), 7);
  EXPECT_EQ(pl.choose(0, 1, 0, 0, s), 4);  // no replica on rank 1: replica 1 % 3
  EXPECT_EQ(pl.choose(1, 0, 0, 0, s), 1);  // own replica (slot 1 is on rank 0)
  EXPECT_EQ(pl.choose(1, 2, 0, 0, s), 5);  // own replica
  EXPECT_EQ(pl.choose(1, 3, 0, 0, s), 5);  // replica 3 % 2 = 1 -> slot 5
  EXPECT_EQ(pl.choose(3, 3, 0, 0, s), 3);  // single replica
  // The choice does not depend on the token or k.
  for (int t = 0; t < 100; ++t) EXPECT_EQ(pl.choose(0, 1, t, t % 8, s), 4);
  EXPECT_THROW((void)pl.choose(4, 0, 0, 0, s), Error);
  EXPECT_THROW((void)pl.choose(0, 4, 0, 0, s), Error);
  EXPECT_THROW((void)pl.choose(-1, 0, 0, 0, s), Error);
}

TEST(EplbPlacement, DynamicChoiceSpreadsAndIsDeterministic) {
  // Expert 0 has 4 replicas, one on each rank.
  const ExpertPlacement pl({0, 1, 0, 2, 0, 3, 0, 4}, 5, 4);
  const auto d = DispatchAlgorithm::dynamic_choice;
  for (int rank = 0; rank < 4; ++rank) {
    std::vector<int> hits(8, 0);
    const int tokens = 20000;
    for (int t = 0; t < tokens; ++t) {
      for (int k = 0; k < 2; ++k) {
        const int slot = pl.choose(0, rank, t, k, d);
        ASSERT_TRUE(slot == 0 || slot == 2 || slot == 4 || slot == 6) << slot;
        ++hits[slot];
        EXPECT_EQ(slot, pl.choose(0, rank, t, k, d));  // deterministic
      }
    }
    for (int slot : {0, 2, 4, 6}) {
      const double share = hits[slot] / (2.0 * tokens);
      EXPECT_NEAR(share, 0.25, 0.02) << "rank " << rank << " slot " << slot;
    }
  }
  // Neighbouring tokens, k and ranks do not move in lockstep.
  int differ_k = 0, differ_rank = 0;
  for (int t = 0; t < 1000; ++t) {
    differ_k += pl.choose(0, 0, t, 0, d) != pl.choose(0, 0, t, 1, d);
    differ_rank += pl.choose(0, 0, t, 0, d) != pl.choose(0, 1, t, 0, d);
  }
  EXPECT_GT(differ_k, 600);
  EXPECT_GT(differ_rank, 600);
  EXPECT_EQ(pl.choose(3, 1, 17, 3, d), 5);  // single replica
}

// The same for three replicas (the multiply-shift reduction on a count that is not a power of two) and
// token indices past 2^32 (the hash's high word), with K = 8.
TEST(EplbPlacement, DynamicChoiceSpreadsOverThreeReplicasAndLargeTokenIndices) {
  const ExpertPlacement pl({0, 1, 0, 2, 0, 3}, 4, 3);  // expert 0 on slots 0, 2, 4
  const auto d = DispatchAlgorithm::dynamic_choice;
  for (const std::int64_t offset : {std::int64_t{0}, (std::int64_t{1} << 40) + 12345}) {
    std::vector<int> hits(6, 0);
    const int tokens = 12000;
    for (int t = 0; t < tokens; ++t) {
      for (int k = 0; k < 8; ++k) ++hits[static_cast<std::size_t>(pl.choose(0, 1, offset + t, k, d))];
    }
    for (int slot : {0, 2, 4}) {
      EXPECT_NEAR(hits[static_cast<std::size_t>(slot)] / (8.0 * tokens), 1.0 / 3.0, 0.015)
          << "offset " << offset << " slot " << slot;
    }
    EXPECT_EQ(hits[1] + hits[3] + hits[5], 0);
  }
}

// The GPU kernel's register form of the static choice (<= 4 replicas) against choose_replica, on
// every count, rank and slot pattern drawn (replicas on the rank or not, several on it).
TEST(EplbPlacement, StaticChoiceOfFourEqualsChooseReplica) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 20000; ++trial) {
    const int ranks = 1 + static_cast<int>(rng() % 8);
    const int slots_per_rank = 1 + static_cast<int>(rng() % 5);
    const int src_rank = static_cast<int>(rng() % static_cast<unsigned>(ranks));
    const int count = 1 + static_cast<int>(rng() % 4);
    std::vector<std::int32_t> slots(static_cast<std::size_t>(count));
    for (auto& v : slots)
      v = static_cast<std::int32_t>(rng() % static_cast<unsigned>(ranks * slots_per_rank));
    std::sort(slots.begin(), slots.end());
    std::int32_t r[4] = {-1, -1, -1, -1};
    std::copy(slots.begin(), slots.end(), r);
    const std::int32_t want = eplb::choose_replica(r, count, src_rank, slots_per_rank, 0, 0, false);
    ASSERT_EQ(eplb::choose_static_replica4(r, count, src_rank, slots_per_rank), want)
        << "trial " << trial << ", count " << count << ", rank " << src_rank << " of " << ranks;
  }
}

TEST(EplbPlacement, MapToPhysical) {
  const ExpertPlacement pl({0, 1, 0, 2, 0, 3, 0, 4}, 5, 4);
  const int T = 64, K = 3;
  HostTensor ids(DType::i32, {T, K});
  HostTensor out(DType::i32, {T, K});
  for (int i = 0; i < T * K; ++i) ids.data<std::int32_t>()[i] = i % 5;
  for (auto algo : {DispatchAlgorithm::static_choice, DispatchAlgorithm::dynamic_choice}) {
    pl.map_to_physical(ids, out, 2, algo, 1000);
    for (int t = 0; t < T; ++t) {
      for (int k = 0; k < K; ++k) {
        EXPECT_EQ(out.data<std::int32_t>()[t * K + k],
                  pl.choose(ids.data<std::int32_t>()[t * K + k], 2, 1000 + t, k, algo));
      }
    }
  }
  pl.map_to_physical(ids, out, 2, DispatchAlgorithm::static_choice);
  EXPECT_EQ(out.data<std::int32_t>()[0], 4);  // expert 0 on rank 2 is slot 4

  HostTensor wrong_dtype(DType::i64, {T, K});
  HostTensor wrong_shape(DType::i32, {T, K + 1});
  const auto s = DispatchAlgorithm::static_choice;
  testing::expect_error_mentions([&] { pl.map_to_physical(wrong_dtype, out, 0, s); }, "logical_ids");
  testing::expect_error_mentions([&] { pl.map_to_physical(ids, wrong_dtype, 0, s); }, "physical_ids");
  testing::expect_error_mentions([&] { pl.map_to_physical(ids, wrong_shape, 0, s); }, "physical_ids");
  testing::expect_error_mentions([&] { pl.map_to_physical(ids, out, 4, s); }, "src_rank");
  ids.data<std::int32_t>()[7] = 5;
  testing::expect_error_mentions([&] { pl.map_to_physical(ids, out, 0, s); }, "logical_ids[2, 1] = 5");
  ids.data<std::int32_t>()[7] = -1;
  testing::expect_error_mentions([&] { pl.map_to_physical(ids, out, 0, s); }, "logical_ids[2, 1] = -1");
}

TEST(EplbRebalance, HottestExpertsGetTheReplicas) {
  // Global policy (one node): 16 experts, 4 redundant slots, experts 3, 7, 11, 13 are hot.
  std::vector<double> layer(16, 1.0);
  layer[3] = 100;
  layer[7] = 90;
  layer[11] = 80;
  layer[13] = 70;
  const std::vector<std::vector<double>> load{layer};
  const RebalanceResult r = rebalance_experts(load, 20, 1, 1, 4);
  check_result(r, load, 20, 4);
  for (int e = 0; e < 16; ++e) {
    const bool hot = e == 3 || e == 7 || e == 11 || e == 13;
    EXPECT_EQ(r.logcnt[e], hot ? 2 : 1) << "expert " << e;
  }
  // One very hot expert: its 5 replicas land on 5 different GPUs.
  std::vector<double> one(16, 1.0);
  one[9] = 1000;
  const RebalanceResult r1 = rebalance_experts({one}, 24, 1, 1, 8);
  check_result(r1, {one}, 24, 8);
  EXPECT_EQ(r1.logcnt[9], 9);
  std::set<int> gpus;
  for (int i = 0; i < r1.logcnt[9]; ++i) gpus.insert(r1.log2phy[9 * r1.max_replicas + i] / 3);
  EXPECT_EQ(gpus.size(), 8u);  // 9 replicas over 8 GPUs: every GPU gets at least one
}

TEST(EplbRebalance, SlotCostReplicatesOnlyWhereAReplicaPaysForItsWeightReads) {
  // 16 experts over 4 GPUs, 4 redundant slots. Expert 3 carries 70 (two replicas keep 35 each >= the
  // cost 30; a third would keep 23), expert 7 carries 40 (two replicas would keep 20 < 30: no
  // replica); experts 0, 1 and 2 get nothing, so the spare slots go to them (the coldest, fewest
  // replicas first, lowest id).
  std::vector<double> layer(16, 5.0);
  layer[3] = 70;
  layer[7] = 40;
  layer[0] = layer[1] = layer[2] = 0;
  const std::vector<std::vector<double>> load{layer};
  const RebalanceResult r = rebalance_experts(load, 20, 1, 1, 4, 30.0);
  check_result(r, load, 20, 4);
  EXPECT_EQ(r.logcnt[3], 2);
  EXPECT_EQ(r.logcnt[7], 1);
  EXPECT_EQ(r.logcnt[0] + r.logcnt[1] + r.logcnt[2], 6);  // 3 + the 3 spare slots
  for (int e : {0, 1, 2}) EXPECT_EQ(r.logcnt[e], 2) << "expert " << e;
  // GPUs packed on load / replicas + 30 per loaded replica (14 loaded replicas over 4 GPUs): the
  // numbers of loaded replicas differ by at most one and the modelled costs by at most the largest
  // item (70: expert 7's slot), as greedy packing guarantees.
  std::vector<double> cost(4, 0.0);
  std::vector<int> loaded(4, 0);
  for (int p = 0; p < 20; ++p) {
    const int e = r.phy2log[p];
    if (layer[e] > 0) {
      cost[p / 5] += layer[e] / r.logcnt[e] + 30.0;
      ++loaded[p / 5];
    }
  }
  EXPECT_LE(*std::max_element(loaded.begin(), loaded.end()) - *std::min_element(loaded.begin(), loaded.end()),
            1);
  EXPECT_LE(*std::max_element(cost.begin(), cost.end()) - *std::min_element(cost.begin(), cost.end()),
            70.0 + 1e-9);
  // slot_cost 0 is DeepSeek's algorithm: expert 7 gets its replica then.
  EXPECT_EQ(rebalance_experts(load, 20, 1, 1, 4, 0.0).logcnt[7], 2);
  testing::expect_error_mentions([&] { rebalance_experts(load, 20, 1, 1, 4, -1.0); }, "slot_cost");
  testing::expect_error_mentions([&] { rebalance_experts(load, 20, 1, 1, 4, std::nan("")); }, "slot_cost");
}

TEST(EplbRebalance, ReplicaCountsFollowLoadInGlobalPolicy) {
  // With one node, a heavier expert never has fewer replicas than a lighter one.
  std::vector<std::vector<double>> load;
  for (std::uint64_t seed = 0; seed < 3; ++seed) load.push_back(zipf_load(64, 1.0, seed));
  const RebalanceResult r = rebalance_experts(load, 96, 1, 1, 8);
  check_result(r, load, 96, 8);
  for (int l = 0; l < 3; ++l) {
    for (int a = 0; a < 64; ++a) {
      for (int b = 0; b < 64; ++b) {
        if (load[l][a] > load[l][b]) {
          EXPECT_GE(r.logcnt[l * 64 + a], r.logcnt[l * 64 + b]);
        }
      }
    }
  }
}

TEST(EplbRebalance, HierarchicalBeatsNaive) {
  // DeepSeek-V3 shape: 256 experts in 8 groups, 2 nodes x 8 GPUs, 32 redundant slots.
  const int E = 256, P = 288, groups = 8, nodes = 2, gpus = 16;
  std::vector<std::vector<double>> load;
  for (std::uint64_t seed = 1; seed <= 2; ++seed) load.push_back(random_load(E, seed));
  for (std::uint64_t seed = 3; seed <= 4; ++seed) load.push_back(zipf_load(E, 1.0, seed));
  load.push_back(zipf_load(E, 1.5, 5));
  const double worst = check_better_than_naive(load, P, groups, nodes, gpus, "hierarchical");
  EXPECT_LT(worst, 1.0);

  // Every replica of a group's experts sits on that group's node.
  const RebalanceResult r = rebalance_experts(load, P, groups, nodes, gpus);
  for (int l = 0; l < r.num_layers; ++l) {
    std::vector<int> node_of_group(groups, -1);
    for (int p = 0; p < P; ++p) {
      const int g = r.phy2log[l * P + p] / (E / groups);
      const int node = p / (P / nodes);
      if (node_of_group[g] < 0) node_of_group[g] = node;
      EXPECT_EQ(node_of_group[g], node) << "layer " << l << " group " << g;
    }
    for (int n = 0; n < nodes; ++n) {
      EXPECT_EQ(std::count(node_of_group.begin(), node_of_group.end(), n), groups / nodes);
    }
  }
}

TEST(EplbRebalance, GlobalBeatsNaive) {
  // groups = 3 is not a multiple of nodes = 2: global policy.
  {
    std::vector<std::vector<double>> load;
    for (std::uint64_t seed = 10; seed <= 11; ++seed) load.push_back(random_load(60, seed));
    for (std::uint64_t seed = 12; seed <= 13; ++seed) load.push_back(zipf_load(60, 1.2, seed));
    const double worst = check_better_than_naive(load, 64, 3, 2, 8, "global (groups 3, nodes 2)");
    EXPECT_LT(worst, 1.0);
  }
  // One node, one group.
  {
    std::vector<std::vector<double>> load;
    for (std::uint64_t seed = 20; seed <= 21; ++seed) load.push_back(random_load(256, seed));
    for (std::uint64_t seed = 22; seed <= 23; ++seed) load.push_back(zipf_load(256, 1.0, seed));
    const double worst = check_better_than_naive(load, 288, 1, 1, 32, "global (nodes 1)");
    EXPECT_LT(worst, 1.0);
  }
}

TEST(EplbRebalance, NoRedundantSlotsAndUniformLoad) {
  // P == E: a permutation; uniform (and all-zero) loads still give a valid placement.
  const std::vector<std::vector<double>> load{std::vector<double>(32, 5.0), std::vector<double>(32, 0.0)};
  const RebalanceResult r = rebalance_experts(load, 32, 4, 2, 4);
  check_result(r, load, 32, 4);
  EXPECT_EQ(r.max_replicas, 1);
  const RebalanceResult r2 = rebalance_experts(load, 40, 4, 2, 4);
  check_result(r2, load, 40, 4);
  // Layer 0's spare slots go to distinct experts (equal loads: each replica halves one's share); layer
  // 1's (all idle) all go to each node's first expert, as DeepSeek's argmax takes the lowest index.
  EXPECT_EQ(*std::max_element(r2.logcnt.begin(), r2.logcnt.begin() + 32), 2);
  EXPECT_EQ(r2.logcnt[32 + r2.phy2log[40]], 5);
  EXPECT_EQ(r2.max_replicas, 5);
}

// Random shapes and loads (uniform, Zipf, all zero, all equal, one expert with everything) through
// both policies, with and without a slot cost: every result is a valid placement (check_result); a
// hierarchical one keeps each group's replicas on one node; without a slot cost the global policy's
// replica counts follow the load. rebalance_experts alone may leave the busiest GPU busier than the
// initial placement (DeepSeek's greedy replication on small shapes: EplbRebalance.
// KeepsTheCurrentPlacementWhereDeepSeeksIsWorse); rebalance_placement from the initial placement never
// does across GPUs, and otherwise gives rebalance_experts' placement. The seed is printed on failure;
// EPMOE_TEST_SEED replays it.
TEST(EplbRebalanceSweep, RandomShapesAndLoadsGiveValidPlacements) {
  using testing::pick;
  testing::SeededRng rng;
  for (int i = 0; i < 256; ++i) {  // (~10 ms)
    const int nodes = pick(rng, {1, 2, 4});
    const int gpus = nodes * pick(rng, {1, 2, 4, 8});
    const int groups = pick(rng, {1, 2, 3, 4, 8});
    const int E = groups * static_cast<int>(testing::uniform(rng, 1, 16));
    const int P = (E + gpus - 1) / gpus * gpus + gpus * static_cast<int>(testing::uniform(rng, 0, 3));
    const double slot_cost = pick(rng, {0.0, 0.0, 50.0});
    std::vector<std::vector<double>> load;
    std::string kinds;
    for (int l = static_cast<int>(testing::uniform(rng, 1, 3)); l > 0; --l) {
      const int kind = static_cast<int>(testing::uniform(rng, 0, 4));
      kinds += "uzaeo"[kind];
      switch (kind) {
        case 0:
          load.push_back(random_load(E, rng()));
          break;
        case 1:
          load.push_back(zipf_load(E, pick(rng, {0.5, 1.0, 2.0}), rng()));
          break;
        case 2:
          load.emplace_back(static_cast<std::size_t>(E), 0.0);
          break;
        case 3:
          load.emplace_back(static_cast<std::size_t>(E), 7.0);
          break;
        default:
          load.emplace_back(static_cast<std::size_t>(E), 0.0);
          load.back()[rng() % static_cast<std::uint64_t>(E)] = 1e4;
      }
    }
    const bool hierarchical = groups % nodes == 0;
    SCOPED_TRACE(fmt::format("case {}: E {} P {} groups {} nodes {} gpus {} slot_cost {} layers {} ({}) {}",
                             i, E, P, groups, nodes, gpus, slot_cost, load.size(), kinds,
                             hierarchical ? "hierarchical" : "global"));
    const RebalanceResult r = rebalance_experts(load, P, groups, nodes, gpus, slot_cost);
    const auto placements = check_result(r, load, P, gpus);
    const ExpertPlacement initial = ExpertPlacement::initial(E, P, gpus);
    for (std::size_t l = 0; l < load.size(); ++l) {
      const ExpertPlacement kept = rebalance_placement(initial, load[l], groups, nodes, slot_cost);
      const double before = busiest_rank_load(initial, load[l], slot_cost);
      const double after = busiest_rank_load(kept, load[l], slot_cost);
      // (On one GPU rebalance_experts' placement is taken as it is: with a slot cost its replicas of a
      // hot expert add slot costs the model counts, and buy nothing it counts.)
      if (gpus > 1) {
        EXPECT_LE(after, before * (1 + 1e-12)) << "layer " << l << ": rebalance_placement made it worse";
      }
      if (kept.phy2log() != placements[l].phy2log()) {
        EXPECT_EQ(kept.phy2log(), initial.phy2log())
            << "layer " << l << ": neither DeepSeek's nor the current";
        EXPECT_GT(busiest_rank_load(placements[l], load[l], slot_cost), before) << "layer " << l;
      }
      if (hierarchical) {
        std::vector<int> node_of_group(static_cast<std::size_t>(groups), -1);
        for (int p = 0; p < P; ++p) {
          const int g = r.phy2log[l * P + p] / (E / groups), node = p / (P / nodes);
          if (node_of_group[g] < 0) node_of_group[g] = node;
          EXPECT_EQ(node_of_group[g], node) << "layer " << l << ": group " << g << " on two nodes";
        }
      } else if (slot_cost == 0) {
        for (int a = 0; a < E; ++a) {
          for (int b = 0; b < E; ++b) {
            if (load[l][a] > load[l][b]) {
              EXPECT_GE(r.logcnt[l * E + a], r.logcnt[l * E + b])
                  << "layer " << l << " experts " << a << ", " << b;
            }
          }
        }
      }
    }
  }
}

// DeepSeek's greedy replication gives all 12 spare slots of 4 experts on 4 GPUs to the one hot expert;
// 13 replicas in 4 slots per GPU put 4 of them on one GPU (4/13 of the hot load, 0.31) where the initial
// placement (each GPU one replica of every expert) has 0.25 everywhere. rebalance_placement keeps that.
TEST(EplbRebalance, KeepsTheCurrentPlacementWhereDeepSeeksIsWorse) {
  const std::vector<double> load = {0, 1000, 0, 0};
  const ExpertPlacement initial = ExpertPlacement::initial(4, 16, 4);
  EXPECT_DOUBLE_EQ(busiest_rank_load(initial, load), 250.0);
  const ExpertPlacement deepseek = placement_from(rebalance_experts({load}, 16, 1, 1, 4), 0, 4);
  EXPECT_EQ(deepseek.logcnt()[1], 13);
  EXPECT_DOUBLE_EQ(busiest_rank_load(deepseek, load), 4 * 1000.0 / 13);
  EXPECT_EQ(rebalance_placement(initial, load, 1, 1).phy2log(), initial.phy2log());
  // From a placement DeepSeek's does improve on (the hot expert once), DeepSeek's is taken.
  std::vector<std::int32_t> once(16);
  for (int p = 0; p < 16; ++p) once[p] = p == 0 ? 1 : (p % 3 == 0 ? 0 : (p % 3 == 1 ? 2 : 3));
  const ExpertPlacement single(once, 4, 4);
  EXPECT_DOUBLE_EQ(busiest_rank_load(single, load), 1000.0);
  EXPECT_EQ(rebalance_placement(single, load, 1, 1).phy2log(), deepseek.phy2log());
  // On one rank every placement carries everything: DeepSeek's is taken.
  const ExpertPlacement one_rank = ExpertPlacement::initial(4, 16, 1);
  EXPECT_EQ(rebalance_placement(one_rank, load, 1, 1).phy2log(),
            placement_from(rebalance_experts({load}, 16, 1, 1, 1), 0, 1).phy2log());
  // The slot cost counts once per loaded slot.
  EXPECT_DOUBLE_EQ(busiest_rank_load(initial, load, 10.0), 260.0);
  testing::expect_error_mentions([&] { (void)busiest_rank_load(initial, std::vector<double>(3, 1.0)); },
                                 "load has 3 experts");
  testing::expect_error_mentions(
      [&] {
        (void)busiest_rank_load(initial, std::vector<double>{0, -1, 0, 0});
      },
      "load[1] = -1");
  testing::expect_error_mentions([&] { (void)busiest_rank_load(initial, load, -1.0); }, "slot_cost");
  testing::expect_error_mentions(
      [&] { (void)rebalance_placement(initial, std::vector<double>(5, 1.0), 1, 1); }, "load has 5 experts");
}

// The placements DeepSeek's eplb.py (deepseek-ai/EPLB) gives for loads with ties, where a tie rule of
// our own would show: idle experts, integer counts, and a global policy whose GPUs do not divide over
// the nodes. The expected tables were computed by running eplb.py's algorithm on these inputs.
TEST(EplbRebalance, TiedLoadsGiveDeepSeeksPlacement) {
  struct Case {
    std::vector<double> load;
    int physical, groups, nodes, gpus;
    std::vector<std::int32_t> phy2log, logcnt;
  };
  const std::vector<Case> cases = {
      // Idle experts: every extra replica goes to the lowest id (DeepSeek's first argmax).
      {{0, 0, 0, 0, 0, 0, 0, 0}, 12, 1, 1, 4, {0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0}, {5, 1, 1, 1, 1, 1, 1, 1}},
      {{0, 0, 3, 2}, 8, 1, 1, 4, {3, 0, 3, 1, 2, 2, 2, 2}, {1, 1, 4, 2}},
      // Hierarchical over 2 nodes with tied groups and experts.
      {{2, 2, 1, 1, 0, 0, 4, 4}, 12, 4, 2, 4, {6, 6, 4, 7, 7, 5, 0, 2, 0, 1, 3, 1}, {2, 2, 1, 1, 1, 1, 2, 2}},
      // 4 groups over 3 nodes: the global policy, which does not need the 4 GPUs to divide over 3 nodes.
      {{9, 1, 1, 1, 1, 1, 1, 1}, 8, 4, 3, 4, {0, 7, 1, 4, 2, 5, 3, 6}, {1, 1, 1, 1, 1, 1, 1, 1}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "physical " << c.physical << " groups " << c.groups << " nodes "
                                      << c.nodes << " gpus " << c.gpus);
    const RebalanceResult r = rebalance_experts({c.load}, c.physical, c.groups, c.nodes, c.gpus);
    EXPECT_EQ(r.phy2log, c.phy2log);
    EXPECT_EQ(r.logcnt, c.logcnt);
  }
}

TEST(EplbRebalance, RefusesBadInputs) {
  const std::vector<double> ok(16, 1.0);
  std::vector<double> negative = ok;
  negative[5] = -1.0;
  std::vector<double> nan = ok;
  nan[2] = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> inf = ok;
  inf[3] = std::numeric_limits<double>::infinity();
  testing::expect_error_mentions([&] { rebalance_experts({ok, negative}, 16, 1, 1, 4); }, "load[1][5]");
  testing::expect_error_mentions([&] { rebalance_experts({nan}, 16, 1, 1, 4); }, "load[0][2]");
  testing::expect_error_mentions([&] { rebalance_experts({inf}, 16, 1, 1, 4); }, "load[0][3]");
  testing::expect_error_mentions(
      [&] {
        rebalance_experts({ok, std::vector<double>(15, 1.0)}, 16, 1, 1, 4);
      },
      "load[1] has 15");
  testing::expect_error_mentions([&] { rebalance_experts({}, 16, 1, 1, 4); }, "at least one layer");
  testing::expect_error_mentions([&] { rebalance_experts({std::vector<double>{}}, 16, 1, 1, 4); },
                                 "load[0] is empty");
  testing::expect_error_mentions([&] { rebalance_experts({ok}, 12, 1, 1, 4); },
                                 "num_physical (12) must be at least");
  testing::expect_error_mentions([&] { rebalance_experts({ok}, 18, 1, 1, 4); }, "multiple of num_gpus");
  testing::expect_error_mentions([&] { rebalance_experts({ok}, 18, 2, 2, 3); },
                                 "num_gpus (3) must be a multiple of num_nodes (2)");
  testing::expect_error_mentions([&] { rebalance_experts({ok}, 16, 0, 1, 4); },
                                 "num_groups must be positive");
  testing::expect_error_mentions([&] { rebalance_experts({ok}, 16, 1, 1, 0); }, "num_gpus must be positive");
  testing::expect_error_mentions([&] { rebalance_experts({std::vector<double>(10, 1.0)}, 12, 4, 2, 4); },
                                 "multiple of num_groups");
  // groups 3, nodes 2: global policy, so 16 % 3 != 0 is fine.
  EXPECT_NO_THROW(rebalance_experts({ok}, 16, 3, 2, 4));

  const RebalanceResult r = rebalance_experts({ok, ok}, 16, 1, 1, 4);
  testing::expect_error_mentions([&] { (void)placement_from(r, 2, 4); }, "layer 2");
  testing::expect_error_mentions([&] { (void)placement_from(r, 0, 3); }, "multiple of num_ranks");
}

}  // namespace
}  // namespace epmoe
