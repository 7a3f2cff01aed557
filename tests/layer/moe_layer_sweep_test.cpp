// Random layers on the CPU, each against the direct reference (design.md §8): model dims, routing
// (groups, scoring, renormalisation, scaling factor, a skewed load), shared experts, quant and scale
// format, ranks and redundant slots, static or dynamic replica choice, both modes, batches of 0 tokens
// up to the low-latency limit (more in normal mode), and a rebalance between forwards. The fixed cases
// of moe_layer_test.cpp each hold most of these at the tiny preset's values; here any combination may
// come up. The seed is printed on failure; EPMOE_TEST_SEED replays it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "epmoe/layer.hpp"
#include "test_random.hpp"

namespace epmoe {
namespace {

using testing::pick;
using testing::uniform;

constexpr int kLayers = 16;  // per run (2-5 s on the CI machine)

MoeConfig draw_config(std::mt19937_64& rng) {
  MoeConfig c = MoeConfig::preset("tiny");
  c.name = "sweep";
  c.hidden = 128 * uniform(rng, 1, 4);
  c.intermediate = 128 * uniform(rng, 1, 3);
  c.num_groups = pick(rng, {1, 2, 4});
  const int experts_per_group = pick(rng, {2, 3, 4, 8});
  c.num_experts = c.num_groups * experts_per_group;
  c.topk_groups = static_cast<int>(uniform(rng, 1, c.num_groups));
  c.topk = static_cast<int>(uniform(rng, 1, std::min(c.topk_groups * experts_per_group, 8)));
  c.scoring = pick(rng, {Scoring::sigmoid, Scoring::softmax});
  c.renormalize = pick(rng, {true, false});
  c.routed_scaling_factor = pick(rng, {1.0f, 2.5f});
  c.num_shared_experts = static_cast<int>(uniform(rng, 0, 2));
  c.quant = pick(rng, {QuantScheme::fp8, QuantScheme::w4a8, QuantScheme::none});
  c.power_of_two_scales = pick(rng, {false, true});
  c.num_ranks = pick(rng, {1, 2, 3, 4, 8});
  // Redundant slots: the fewest that make the physical experts a multiple of the ranks, plus 0-2 per rank.
  c.num_redundant_experts = (c.num_ranks - c.num_experts % c.num_ranks) % c.num_ranks +
                            c.num_ranks * static_cast<int>(uniform(rng, 0, 2));
  c.dispatch_algorithm = pick(rng, {DispatchAlgorithm::static_choice, DispatchAlgorithm::dynamic_choice});
  c.max_tokens_per_rank = static_cast<int>(uniform(rng, 1, 48));
  c.validate();
  return c;
}

struct Batch {
  std::vector<HostTensor> x, y;
  std::vector<TensorView> xv, yv;
  std::int64_t tokens = 0;
};

// Each rank's batch: 0 tokens now and then, else any count up to the limit (twice it in normal mode,
// which has none); outputs poisoned (bf16 NaN).
Batch draw_batch(const MoeConfig& c, Mode mode, std::mt19937_64& rng) {
  Batch b;
  const std::int64_t most = mode == Mode::low_latency ? c.max_tokens_per_rank : 2 * c.max_tokens_per_rank;
  const std::uint64_t seed = rng();
  for (int r = 0; r < c.num_ranks; ++r) {
    const std::int64_t t = uniform(rng, 0, 4) == 0 ? 0 : uniform(rng, 1, most);
    b.x.push_back(synthetic_tokens(c, seed, r, t));
    b.y.emplace_back(DType::bf16, std::initializer_list<std::int64_t>{t, c.hidden});
    b.y.back().fill_bytes(0xff);
    b.tokens += t;
  }
  for (auto& t : b.x) b.xv.push_back(t);
  for (auto& t : b.y) b.yv.push_back(t);
  return b;
}

TEST(LayerSweep, RandomLayersMatchTheReference) {
  testing::SeededRng rng;
  for (int i = 0; i < kLayers; ++i) {
    const MoeConfig c = draw_config(rng);
    const Mode mode = pick(rng, {Mode::normal, Mode::low_latency});
    const double skew = pick(rng, {0.0, 0.0, 2.0});
    SCOPED_TRACE(fmt::format("layer {}: {}, {} mode, skew {}", i, c.describe(), to_string(mode), skew));
    auto w = std::make_shared<SyntheticWeights>(c, rng());
    if (skew > 0) w->skew_routing(skew);
    MoeLayer layer(w, {mode});
    std::int64_t counted_tokens = 0;  // since construction or the last rebalance
    for (int f = 0; f < 2; ++f) {
      SCOPED_TRACE("forward " + std::to_string(f));
      Batch b = draw_batch(c, mode, rng);
      ForwardStats stats;
      layer.forward(b.xv, b.yv, &stats);
      counted_tokens += b.tokens;
      for (int r = 0; r < c.num_ranks; ++r) {
        HostTensor expected(DType::bf16, {b.x[r].size(0), c.hidden});
        reference_forward(*w, b.x[r], expected, Numerics::mirror);
        const ErrorReport e = compare(b.y[r], expected);
        EXPECT_EQ(e.non_finite, 0) << "rank " << r << " (every row written?)";
        EXPECT_LE(e.rel_l2, 1e-2) << "rank " << r;
        EXPECT_LE(e.calc_diff, 1e-2) << "rank " << r;
      }
      std::int64_t rows = 0;
      for (const std::int64_t n : stats.rows_per_rank) rows += n;
      EXPECT_EQ(rows, b.tokens * c.topk) << "expert rows computed: one per (token, k)";
      std::int64_t load = 0;
      for (const std::int64_t n : layer.expert_load()) load += n;
      EXPECT_EQ(load, counted_tokens * c.topk) << "the EPLB load counters";
      if (f == 0 && pick(rng, {false, true})) {
        layer.rebalance(c.num_ranks % 2 == 0 ? pick(rng, {1, 2}) : 1);  // (nodes must divide the ranks)
        counted_tokens = 0;
        EXPECT_EQ(layer.placement().num_physical(), c.num_physical_experts());
      }
    }
    if (mode == Mode::low_latency) {
      // One token past the buffers on one rank: refused before anything runs.
      Batch over = draw_batch(c, mode, rng);
      const int r = static_cast<int>(uniform(rng, 0, c.num_ranks - 1));
      over.x[r] = synthetic_tokens(c, 1, r, c.max_tokens_per_rank + 1);
      over.y[r] = HostTensor(DType::bf16, {c.max_tokens_per_rank + 1, c.hidden});
      over.xv[r] = over.x[r];
      over.yv[r] = over.y[r];
      EXPECT_THROW(layer.forward(over.xv, over.yv), Error);
    }
  }
}

}  // namespace
}  // namespace epmoe
