// Synthetic weights (src/weights/synthetic.cpp): the same seed gives the same bytes, another seed
// other bytes; SyntheticWeights builds each expert on first use exactly as make_synthetic_expert
// does, and refuses what it cannot build with the argument named.
#include <gtest/gtest.h>

#include <cstring>

#include "epmoe/config.hpp"
#include "epmoe/weights.hpp"
#include "expect_error.hpp"

namespace epmoe {
namespace {

using testing::expect_error_mentions;

bool same_bytes(const HostTensor& a, const HostTensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined();  // (quant none: no scales)
  const TensorView va = a.view(), vb = b.view();
  return va.dtype == vb.dtype && va.nbytes() == vb.nbytes() &&
         std::memcmp(va.data, vb.data, va.nbytes()) == 0;
}

bool same_expert(const ExpertWeights& a, const ExpertWeights& b) {
  return a.quant == b.quant && same_bytes(a.w13, b.w13) && same_bytes(a.w13_scale, b.w13_scale) &&
         same_bytes(a.w2, b.w2) && same_bytes(a.w2_scale, b.w2_scale);
}

TEST(SyntheticExpert, SameSeedSameBytesOtherSeedOtherBytes) {
  for (const QuantScheme quant : {QuantScheme::fp8, QuantScheme::w4a8, QuantScheme::none}) {
    SCOPED_TRACE(to_string(quant));
    const auto a = make_synthetic_expert(quant, 256, 128, 11);
    const auto b = make_synthetic_expert(quant, 256, 128, 11);
    const auto c = make_synthetic_expert(quant, 256, 128, 12);
    EXPECT_TRUE(same_expert(*a, *b));
    EXPECT_FALSE(same_bytes(a->w13, c->w13));
    EXPECT_FALSE(same_bytes(a->w2, c->w2));
  }
}

TEST(SyntheticExpert, DimsOffThe128GridAreRefusedByName) {
  for (const auto& [hidden, intermediate] :
       {std::pair<std::int64_t, std::int64_t>{0, 128}, {256, -128}, {200, 128}, {256, 100}}) {
    expect_error_mentions(
        [&] { (void)make_synthetic_expert(QuantScheme::fp8, hidden, intermediate, 1); },
        {"make_synthetic_expert", "hidden and intermediate must be positive multiples of 128"});
  }
}

TEST(SyntheticWeights, BuildsEachExpertOnFirstUseAsMakeSyntheticExpertDoes) {
  MoeConfig c = MoeConfig::preset("tiny");
  c.quant = QuantScheme::fp8;
  const SyntheticWeights w(c, 5);
  EXPECT_EQ(w.experts_built(), 0u);
  const int logical = c.num_experts - 1;
  const ExpertWeights& e = w.routed_expert(logical);
  EXPECT_EQ(w.experts_built(), 1u);
  EXPECT_EQ(&w.routed_expert(logical), &e);  // built once
  EXPECT_EQ(w.experts_built(), 1u);
  EXPECT_TRUE(
      same_expert(e, *make_synthetic_expert(c.quant, c.hidden, c.intermediate, w.expert_seed(logical))));
  EXPECT_NE(w.expert_seed(0), w.expert_seed(1));
  expect_error_mentions([&] { (void)w.routed_expert(c.num_experts); }, "logical expert id must be in [0, ");
  expect_error_mentions([&] { (void)w.routed_expert(-1); }, "logical expert id must be in [0, ");
}

TEST(SyntheticWeights, AFactoryThatBuildsTheWrongExpertIsNamed) {
  MoeConfig c = MoeConfig::preset("tiny");
  c.quant = QuantScheme::fp8;
  SyntheticWeights w(c, 5);
  w.set_expert_factory(
      [](QuantScheme quant, std::int64_t hidden, std::int64_t intermediate, std::uint64_t seed) {
        return make_synthetic_expert(quant, hidden, 2 * intermediate, seed);
      });
  expect_error_mentions([&] { (void)w.routed_expert(0); }, "the expert factory built");
  w.set_expert_factory([](QuantScheme, std::int64_t, std::int64_t, std::uint64_t) {
    return std::unique_ptr<ExpertWeights>();
  });
  expect_error_mentions([&] { (void)w.routed_expert(1); }, "the expert factory returned no");
}

}  // namespace
}  // namespace epmoe
