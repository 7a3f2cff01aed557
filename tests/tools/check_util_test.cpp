// check_against_reference: epmoe run's and epmoe check's accuracy verdict over all ranks' outputs.
#include "tools/epmoe/check_util.hpp"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "expect_error.hpp"

namespace epmoe::tools {
namespace {

struct TwoRanks {
  std::shared_ptr<SyntheticWeights> weights;
  std::vector<HostTensor> x, y;
  std::vector<TensorView> xv, yv;
};

TwoRanks forward_two_ranks() {
  MoeConfig c = MoeConfig::preset("tiny");
  c.num_ranks = 2;
  TwoRanks t;
  t.weights = std::make_shared<SyntheticWeights>(c, 5);
  for (int r = 0; r < 2; ++r) {
    t.x.push_back(synthetic_tokens(c, 6, r, 3 + r));
    t.y.emplace_back(DType::bf16, std::initializer_list<std::int64_t>{3 + r, c.hidden});
  }
  for (int r = 0; r < 2; ++r) {
    t.xv.push_back(t.x[static_cast<std::size_t>(r)]);
    t.yv.push_back(t.y[static_cast<std::size_t>(r)]);
  }
  MoeLayer layer(t.weights, {Mode::normal});
  layer.forward(t.xv, t.yv);
  return t;
}

TEST(CheckAgainstReference, PassesTheLayerAndFailsACorruptedRank) {
  TwoRanks t = forward_two_ranks();
  std::vector<std::size_t> progress;
  const CheckResult good = check_against_reference(*t.weights, t.xv, t.yv, Numerics::mirror, 1e-2,
                                                   [&](std::size_t r) { progress.push_back(r); });
  EXPECT_TRUE(good.pass);
  EXPECT_EQ(progress, (std::vector<std::size_t>{0, 1}));
  ASSERT_EQ(good.per_rank.size(), 2u);
  EXPECT_EQ(good.overall.count, (3 + 4) * t.weights->config().hidden);

  // One NaN in rank 1: that rank and the overall verdict fail, rank 0 still passes.
  t.y[1].data<bf16>()[7] = bf16::from_bits(0x7fc0);
  const CheckResult bad = check_against_reference(*t.weights, t.xv, t.yv, Numerics::mirror, 1e-2);
  EXPECT_FALSE(bad.pass);
  EXPECT_TRUE(bad.per_rank[0].within(1e-2));
  EXPECT_EQ(bad.per_rank[1].non_finite, 1);
  EXPECT_EQ(bad.overall.non_finite, 1);
  EXPECT_FALSE(to_json(bad)["pass"].get<bool>());
}

// A finite error, 10% on every element of rank 0: its rel_l2 (about 0.1) fails at 1e-2 while its calc_diff
// (about 5e-3) alone would pass; at a tolerance of 1.0 the same outputs pass. A verdict that only looked for
// NaN / Inf, ignored rel_l2 or ignored the tolerance given fails one of these.
TEST(CheckAgainstReference, FailsAFiniteErrorPastTheToleranceOnly) {
  TwoRanks t = forward_two_ranks();
  HostTensor& y0 = t.y[0];
  for (std::int64_t i = 0; i < y0.numel(); ++i)
    y0.data<bf16>()[i] = bf16::from_float(y0.data<bf16>()[i].to_float() * 1.1f);
  const CheckResult tight = check_against_reference(*t.weights, t.xv, t.yv, Numerics::mirror, 1e-2);
  EXPECT_FALSE(tight.pass);
  ASSERT_EQ(tight.per_rank.size(), 2u);
  EXPECT_EQ(tight.per_rank[0].non_finite, 0);
  EXPECT_NEAR(tight.per_rank[0].rel_l2, 0.1, 0.01);
  EXPECT_LT(tight.per_rank[0].calc_diff, 1e-2);
  EXPECT_TRUE(tight.per_rank[1].within(1e-2));
  EXPECT_GT(tight.overall.rel_l2, 1e-2);
  EXPECT_FALSE(to_json(tight)["pass"].get<bool>());

  const CheckResult loose = check_against_reference(*t.weights, t.xv, t.yv, Numerics::mirror, 1.0);
  EXPECT_TRUE(loose.pass);
  EXPECT_EQ(loose.tolerance, 1.0);
  EXPECT_TRUE(to_json(loose)["pass"].get<bool>());
}

TEST(CheckAgainstReference, NeedsOneOutputPerRank) {
  const TwoRanks t = forward_two_ranks();
  testing::expect_error_mentions(
      [&] {
        (void)check_against_reference(*t.weights, t.xv, std::span<const TensorView>(t.yv.data(), 1),
                                      Numerics::mirror, 1e-2);
      },
      "needs one y per x (2), got 1");
}

}  // namespace
}  // namespace epmoe::tools
