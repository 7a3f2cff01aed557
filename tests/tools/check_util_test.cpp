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
