#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "epmoe/router.hpp"
#include "expect_error.hpp"
#include "routing/router_math.hpp"
#include "test_random.hpp"

namespace epmoe {
namespace {

// |y - z| in units of the f32 ulp of the exact value z (subnormal ulp below 2^-126).
double ulp_error(float y, double z) {
  int e = 0;
  std::frexp(z, &e);  // z in [2^(e-1), 2^e)
  const double ulp = std::ldexp(1.0, std::max(e - 24, -149));
  return std::fabs(static_cast<double>(y) - z) / ulp;
}

double sigmoid_ref(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// ------------------------------------------------------------------ sigmoid

TEST(RouterSigmoid, AccurateOverDenseSweep) {
  double max_err = 0.0;
  float worst = 0.0f;
  float prev = 0.0f;
  for (int i = -100 * 1024; i <= 100 * 1024; ++i) {
    const float x = static_cast<float>(i) / 1024.0f + 0x1p-13f * static_cast<float>(i % 7);
    const float y = router_sigmoid(x);
    ASSERT_TRUE(y >= 0.0f && y <= 1.0f) << x;
    ASSERT_GE(y, prev) << "not monotonic at " << x;
    prev = y;
    const double err = ulp_error(y, sigmoid_ref(x));
    if (err > max_err) {
      max_err = err;
      worst = x;
    }
  }
  std::cout << "router_sigmoid max error over [-100, 100]: " << max_err << " ulp at x = " << worst << "\n";
  RecordProperty("sigmoid_max_ulp", std::to_string(max_err));
  EXPECT_LE(max_err, 3.0);
}

TEST(RouterSigmoid, ExpHelperWithinOneUlp) {
  double max_err = 0.0;
  for (int i = 0; i <= 104 * 4096; ++i) {
    const float a = -static_cast<float>(i) / 4096.0f - 0x1p-15f * static_cast<float>(i % 5);
    max_err = std::max(max_err, ulp_error(routing::exp_nonpositive(a), std::exp(static_cast<double>(a))));
  }
  EXPECT_LE(max_err, 1.0);
  EXPECT_EQ(routing::exp_nonpositive(0.0f), 1.0f);
  EXPECT_EQ(routing::exp_nonpositive(-0.0f), 1.0f);
  EXPECT_EQ(routing::exp_nonpositive(-200.0f), 0.0f);
  EXPECT_EQ(routing::exp_nonpositive(-std::numeric_limits<float>::infinity()), 0.0f);
  // Subnormal results are rounded once: exp(-100) = 3.72e-44 = 26.6 * 2^-149.
  EXPECT_EQ(routing::exp_nonpositive(-100.0f), 27 * 0x1p-149f);
}

TEST(RouterSigmoid, SaturatesWithoutNaNOrInf) {
  const float inf = std::numeric_limits<float>::infinity();
  const float big = std::numeric_limits<float>::max();
  EXPECT_EQ(router_sigmoid(0.0f), 0.5f);
  EXPECT_EQ(router_sigmoid(-0.0f), 0.5f);
  EXPECT_EQ(router_sigmoid(20.0f), 1.0f);
  EXPECT_EQ(router_sigmoid(1e30f), 1.0f);
  EXPECT_EQ(router_sigmoid(big), 1.0f);
  EXPECT_EQ(router_sigmoid(inf), 1.0f);
  EXPECT_EQ(router_sigmoid(-105.0f), 0.0f);
  EXPECT_EQ(router_sigmoid(-1e30f), 0.0f);
  EXPECT_EQ(router_sigmoid(-big), 0.0f);
  EXPECT_EQ(router_sigmoid(-inf), 0.0f);
  EXPECT_GT(router_sigmoid(-100.0f), 0.0f);  // subnormal, not flushed
  EXPECT_TRUE(std::isnan(router_sigmoid(std::numeric_limits<float>::quiet_NaN())));
  for (float x : {1e-30f, -1e-30f, 1e-3f, -1e-3f, 0.5f, -0.5f, 10.0f, -10.0f, -87.0f, -90.0f}) {
    EXPECT_LE(ulp_error(router_sigmoid(x), sigmoid_ref(x)), 3.0) << x;
  }
}

// sigmoid_f32_fast (the GPU router's) must give sigmoid_f32's bits on every non-NaN input (checked
// once over all 2^32 patterns; here every 61st pattern, which visits every exponent, both signs,
// the subnormal-result range and the clamp, plus the edges).
TEST(RouterSigmoid, FastVersionBitIdentical) {
  std::int64_t checked = 0;
  for (std::uint64_t u = 0; u < (1ull << 32); u += 61) {
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(u));
    if (std::isnan(x)) continue;
    ++checked;
    ASSERT_EQ(std::bit_cast<std::uint32_t>(routing::sigmoid_f32_fast(x)),
              std::bit_cast<std::uint32_t>(routing::sigmoid_f32(x)))
        << "x = " << x << " (0x" << std::hex << u << ")";
  }
  EXPECT_GT(checked, 70000000);
  const float inf = std::numeric_limits<float>::infinity();
  for (float x :
       {0.0f, -0.0f, inf, -inf, 104.0f, -104.0f, std::nextafter(-104.0f, 0.0f), -103.62f, -87.3f, -87.4f,
        0x1p-149f, -0x1p-149f, std::numeric_limits<float>::max(), -std::numeric_limits<float>::max()}) {
    EXPECT_EQ(std::bit_cast<std::uint32_t>(routing::sigmoid_f32_fast(x)),
              std::bit_cast<std::uint32_t>(routing::sigmoid_f32(x)))
        << x;
    // The host twin of the GPU's branch-free version (its division is n / d here; the device's is
    // checked on every float by RouterMathGpu.BranchFreeSigmoidBitIdenticalOnEveryFloat).
    EXPECT_EQ(std::bit_cast<std::uint32_t>(routing::sigmoid_f32_branch_free(x)),
              std::bit_cast<std::uint32_t>(routing::sigmoid_f32(x)))
        << x;
  }
  EXPECT_EQ(routing::sigmoid_f32_fast(std::numeric_limits<float>::quiet_NaN()), 0.0f);
}

// ------------------------------------------------------------------ brute-force reference

struct Routed {
  std::vector<std::int32_t> ids;
  std::vector<float> weights;
};

Routed run_router(const MoeConfig& c, std::vector<float>& logits, std::vector<float>& bias) {
  const std::int64_t tokens = static_cast<std::int64_t>(logits.size()) / c.num_experts;
  Routed r;
  r.ids.assign(static_cast<std::size_t>(tokens * c.topk), -7);
  r.weights.assign(static_cast<std::size_t>(tokens * c.topk), -7.0f);
  TensorView b =
      bias.empty() ? TensorView{} : TensorView::contiguous(bias.data(), DType::f32, {c.num_experts});
  route_cpu(c, TensorView::contiguous(logits.data(), DType::f32, {tokens, c.num_experts}), b,
            TensorView::contiguous(r.ids.data(), DType::i32, {tokens, c.topk}),
            TensorView::contiguous(r.weights.data(), DType::f32, {tokens, c.topk}));
  return r;
}

// One token: enumerate every subset of topk_groups groups, keep the one with the largest total group
// score (ties: the lexicographically smallest index list), then sort all experts of those groups.
struct Reference {
  std::vector<int> ids;
  std::vector<float> score;   // f32 scores of all experts (selection input, the router's values)
  std::vector<double> exact;  // double scores of all experts
};

Reference brute_force(const MoeConfig& c, const float* logit, const float* bias) {
  const int n = c.num_experts;
  Reference ref;
  ref.score.resize(n);
  ref.exact.resize(n);
  std::vector<float> choice(n);
  if (c.scoring == Scoring::sigmoid) {
    for (int e = 0; e < n; ++e) {
      ref.score[e] = router_sigmoid(logit[e]);
      ref.exact[e] = sigmoid_ref(logit[e]);
      choice[e] = ref.score[e] + bias[e];
    }
  } else {
    const float m = *std::max_element(logit, logit + n);
    float sum = 0.0f;
    double dsum = 0.0;
    for (int e = 0; e < n; ++e) {
      ref.score[e] = std::exp(logit[e] - m);
      sum += ref.score[e];
      dsum += std::exp(static_cast<double>(logit[e]) - m);
    }
    for (int e = 0; e < n; ++e) {
      ref.score[e] /= sum;
      ref.exact[e] = std::exp(static_cast<double>(logit[e]) - m) / dsum;
      choice[e] = ref.score[e];
    }
  }
  const int groups = c.num_groups;
  const int per_group = n / groups;
  std::vector<double> group_score(groups);
  for (int g = 0; g < groups; ++g) {
    std::vector<float> v(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
    std::sort(v.begin(), v.end(), std::greater<>());
    group_score[g] = c.scoring == Scoring::sigmoid && groups > 1 ? static_cast<double>(v[0] + v[1]) : v[0];
  }
  // The subset with the largest total is the one whose scores, sorted in descending order, are
  // lexicographically largest; compared that way rather than by a double sum, which absorbs scores far
  // below the others (softmax: 1 + 2.8e-19 == 1 + 2.9e-18) and so breaks real differences as ties.
  std::vector<int> best;
  std::vector<double> best_scores;
  for (unsigned mask = 0; mask < (1u << groups); ++mask) {
    if (std::popcount(mask) != c.topk_groups) continue;
    std::vector<int> subset;
    std::vector<double> scores;
    for (int g = 0; g < groups; ++g) {
      if (mask & (1u << g)) {
        subset.push_back(g);
        scores.push_back(group_score[g]);
      }
    }
    std::sort(scores.begin(), scores.end(), std::greater<>());
    if (best.empty() || scores > best_scores || (scores == best_scores && subset < best)) {
      best_scores = scores;
      best = subset;
    }
  }
  std::vector<int> candidates;
  for (int g : best)
    for (int i = 0; i < per_group; ++i) candidates.push_back(g * per_group + i);
  std::sort(candidates.begin(), candidates.end(),
            [&](int a, int b) { return choice[a] != choice[b] ? choice[a] > choice[b] : a < b; });
  ref.ids.assign(candidates.begin(), candidates.begin() + c.topk);
  return ref;
}

void check_against_brute_force(const MoeConfig& c, std::vector<float>& logits, std::vector<float>& bias) {
  const Routed r = run_router(c, logits, bias);
  const int n = c.num_experts;
  const int k = c.topk;
  const std::int64_t tokens = static_cast<std::int64_t>(logits.size()) / n;
  const double s = c.routed_scaling_factor;
  for (std::int64_t t = 0; t < tokens; ++t) {
    const Reference ref = brute_force(c, logits.data() + t * n, bias.empty() ? nullptr : bias.data());
    const std::int32_t* ids = r.ids.data() + t * k;
    const float* w = r.weights.data() + t * k;
    std::vector<int> got(ids, ids + k);
    ASSERT_EQ(got, ref.ids) << c.name << " token " << t;
    std::vector<int> sorted = got;
    std::sort(sorted.begin(), sorted.end());
    ASSERT_TRUE(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end()) << "duplicate id";
    ASSERT_GE(sorted.front(), 0);
    ASSERT_LT(sorted.back(), n);

    // Weights: the exact f32 recipe (sum in selection order, w / sum, times s) ...
    float fsum = 0.0f;
    for (int i = 0; i < k; ++i) fsum += ref.score[ids[i]];
    double dsum = 0.0;
    for (int i = 0; i < k; ++i) dsum += ref.exact[ids[i]];
    double wsum = 0.0;
    for (int i = 0; i < k; ++i) {
      const float expect = c.renormalize ? ref.score[ids[i]] / fsum * c.routed_scaling_factor
                                         : ref.score[ids[i]] * c.routed_scaling_factor;
      ASSERT_EQ(std::bit_cast<std::uint32_t>(w[i]), std::bit_cast<std::uint32_t>(expect)) << "token " << t;
      // ... and close to the exact value.
      const double exact = c.renormalize ? ref.exact[ids[i]] / dsum * s : ref.exact[ids[i]] * s;
      ASSERT_NEAR(w[i], exact, 2e-6 * s) << "token " << t << " k " << i;
      wsum += w[i];
    }
    if (c.renormalize) {
      ASSERT_NEAR(wsum, s, 4e-6 * s) << "token " << t;
    }
  }
}

std::vector<float> random_logits(std::int64_t count, unsigned seed, float stddev = 2.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(static_cast<std::size_t>(count));
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<float> random_bias(int count, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-0.5f, 0.5f);
  std::vector<float> v(static_cast<std::size_t>(count));
  for (float& x : v) x = dist(rng);
  return v;
}

TEST(Router, SigmoidTinyMatchesBruteForce) {
  const MoeConfig c = MoeConfig::preset("tiny");
  auto logits = random_logits(512 * c.num_experts, 1);
  auto bias = random_bias(c.num_experts, 2);
  check_against_brute_force(c, logits, bias);
}

TEST(Router, SigmoidDeepSeekV3MatchesBruteForce) {
  const MoeConfig c = MoeConfig::preset("deepseek-v3");
  auto logits = random_logits(256 * c.num_experts, 3);
  auto bias = random_bias(c.num_experts, 4);
  check_against_brute_force(c, logits, bias);
}

TEST(Router, SigmoidManyTiesMatchesBruteForce) {
  // Logits and bias on a coarse grid: equal group scores and equal expert scores everywhere.
  for (const char* preset : {"tiny", "deepseek-v3"}) {
    const MoeConfig c = MoeConfig::preset(preset);
    std::mt19937 rng(5);
    std::uniform_int_distribution<int> level(-2, 2);
    std::vector<float> logits(static_cast<std::size_t>(128 * c.num_experts));
    for (float& x : logits) x = static_cast<float>(level(rng));
    std::vector<float> bias(static_cast<std::size_t>(c.num_experts));
    for (float& b : bias) b = 0.25f * static_cast<float>(level(rng) > 1);
    check_against_brute_force(c, logits, bias);
  }
}

TEST(Router, SigmoidWithoutRenormalization) {
  MoeConfig c = MoeConfig::preset("deepseek-v3");
  c.renormalize = false;
  c.routed_scaling_factor = 1.0f;
  auto logits = random_logits(64 * c.num_experts, 6);
  auto bias = random_bias(c.num_experts, 7);
  check_against_brute_force(c, logits, bias);
}

TEST(Router, SoftmaxMatchesBruteForce) {
  MoeConfig grouped = MoeConfig::preset("tiny");  // 16 experts, top-4, 4 groups keep 2
  grouped.scoring = Scoring::softmax;
  grouped.routed_scaling_factor = 1.0f;
  MoeConfig plain = grouped;  // Mixtral / Qwen style: no groups
  plain.num_experts = 64;
  plain.topk = 6;
  plain.num_groups = 1;
  plain.topk_groups = 1;
  MoeConfig v2 = MoeConfig::preset("deepseek-v3");  // DeepSeek-V2-like group-limited greedy
  v2.scoring = Scoring::softmax;
  v2.renormalize = false;
  v2.routed_scaling_factor = 16.0f;
  std::vector<float> no_bias;
  unsigned seed = 10;
  for (const MoeConfig& c : {grouped, plain, v2}) {
    auto logits = random_logits(256 * c.num_experts, seed++);
    check_against_brute_force(c, logits, no_bias);
  }
  // A bias, when given, is ignored by softmax scoring.
  auto logits = random_logits(32 * grouped.num_experts, seed);
  auto bias = random_bias(grouped.num_experts, seed);
  EXPECT_EQ(run_router(grouped, logits, bias).ids, run_router(grouped, logits, no_bias).ids);
}

// Random routing configurations against the brute force: 1-16 groups of 1-32 experts (sigmoid's
// grouped scores need 2 per group), any kept groups and top-k, either scoring, with or without
// renormalisation, scaling factors, bias or none (sigmoid), logits of several spreads or on a coarse
// grid (ties everywhere), batches of 1-64 tokens. The seed is printed on failure; EPMOE_TEST_SEED
// replays it.
TEST(RouterSweep, RandomConfigurationsMatchBruteForce) {
  using testing::pick;
  using testing::uniform;
  testing::SeededRng rng;
  for (int i = 0; i < 200; ++i) {
    MoeConfig c = MoeConfig::preset("tiny");
    c.name = "sweep";
    c.scoring = pick(rng, {Scoring::sigmoid, Scoring::softmax});
    c.num_groups = pick(rng, {1, 1, 2, 3, 4, 8, 16});
    const bool paired = c.scoring == Scoring::sigmoid && c.num_groups > 1;  // (top-2 sums per group)
    const int per_group = static_cast<int>(uniform(rng, paired ? 2 : 1, pick(rng, {4, 8, 32})));
    c.num_experts = c.num_groups * per_group;
    c.topk_groups = static_cast<int>(uniform(rng, 1, c.num_groups));
    c.topk = static_cast<int>(uniform(rng, 1, std::min(c.topk_groups * per_group, 16)));
    c.renormalize = pick(rng, {true, false});
    c.routed_scaling_factor = pick(rng, {1.0f, 2.5f, 16.0f});
    c.validate();
    const std::int64_t tokens = uniform(rng, 1, 64);
    const auto logit_seed = static_cast<unsigned>(rng());
    std::vector<float> logits;
    const bool grid = pick(rng, {false, false, true});
    if (grid) {
      std::mt19937 level_rng(logit_seed);
      std::uniform_int_distribution<int> level(-2, 2);
      logits.resize(static_cast<std::size_t>(tokens * c.num_experts));
      for (float& x : logits) x = static_cast<float>(level(level_rng));
    } else {
      logits = random_logits(tokens * c.num_experts, logit_seed, pick(rng, {0.5f, 2.0f, 8.0f}));
    }
    std::vector<float> bias;
    if (c.scoring == Scoring::sigmoid) {
      bias = pick(rng, {false, true}) ? random_bias(c.num_experts, static_cast<unsigned>(rng()))
                                      : std::vector<float>(static_cast<std::size_t>(c.num_experts), 0.0f);
    }
    SCOPED_TRACE(
        fmt::format("case {}: {}, {} tokens, {} logits", i, c.describe(), tokens, grid ? "grid" : "normal"));
    check_against_brute_force(c, logits, bias);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(Router, PlainSigmoidTopK) {
  MoeConfig c = MoeConfig::preset("tiny");
  c.num_groups = 1;
  c.topk_groups = 1;
  auto logits = random_logits(128 * c.num_experts, 12);
  auto bias = random_bias(c.num_experts, 13);
  check_against_brute_force(c, logits, bias);
}

TEST(Router, TiesGoToLowerIndices) {
  {
    const MoeConfig c = MoeConfig::preset("tiny");
    std::vector<float> logits(c.num_experts, 0.25f);
    std::vector<float> bias(c.num_experts, 0.0f);
    const Routed r = run_router(c, logits, bias);
    EXPECT_EQ(r.ids, (std::vector<std::int32_t>{0, 1, 2, 3}));
    for (float w : r.weights) EXPECT_EQ(w, 0.625f);  // 2.5 / 4, exactly
  }
  {
    const MoeConfig c = MoeConfig::preset("deepseek-v3");
    std::vector<float> logits(c.num_experts, -1.0f);
    std::vector<float> bias(c.num_experts, 0.0f);
    const Routed r = run_router(c, logits, bias);
    EXPECT_EQ(r.ids, (std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 6, 7}));
    for (float w : r.weights) EXPECT_EQ(w, 0.3125f);
  }
  {
    // Equal top experts in different groups; equal group scores: the lower group/expert first.
    const MoeConfig c = MoeConfig::preset("tiny");  // groups of 4 experts
    std::vector<float> logits(c.num_experts, -3.0f);
    std::vector<float> bias(c.num_experts, 0.0f);
    logits[13] = 2.0f;  // group 3
    logits[6] = 2.0f;   // group 1
    logits[5] = 1.0f;   // group 1 (group score of 1 = s(2) + s(1))
    logits[12] = 1.0f;  // group 3 (same group score as group 1)
    logits[0] = 1.5f;   // group 0: s(1.5) + s(-3) is lower
    const Routed r = run_router(c, logits, bias);
    EXPECT_EQ(r.ids, (std::vector<std::int32_t>{6, 13, 5, 12}));
  }
  {
    // The group of the single best expert loses against two groups with a better top-2 sum.
    const MoeConfig c = MoeConfig::preset("tiny");
    std::vector<float> logits(c.num_experts, -4.0f);
    std::vector<float> bias(c.num_experts, 0.0f);
    logits[0] = 6.0f;
    logits[4] = 2.0f;
    logits[5] = 2.0f;
    logits[8] = 2.0f;
    logits[9] = 2.0f;
    const Routed r = run_router(c, logits, bias);
    EXPECT_EQ(r.ids, (std::vector<std::int32_t>{4, 5, 8, 9}));
  }
  {
    // Bias steers the choice, but the weights use the unbiased scores.
    MoeConfig c = MoeConfig::preset("tiny");
    c.num_groups = 1;
    c.topk_groups = 1;
    c.topk = 2;
    std::vector<float> logits(c.num_experts, 0.0f);
    std::vector<float> bias(c.num_experts, 0.0f);
    logits[3] = 1.0f;
    bias[7] = 1.0f;
    const Routed r = run_router(c, logits, bias);
    EXPECT_EQ(r.ids, (std::vector<std::int32_t>{7, 3}));
    const float s0 = router_sigmoid(0.0f);
    const float s1 = router_sigmoid(1.0f);
    EXPECT_EQ(r.weights[0], s0 / (s0 + s1) * 2.5f);
    EXPECT_EQ(r.weights[1], s1 / (s0 + s1) * 2.5f);
  }
}

TEST(Router, DeterministicAndRowIndependent) {
  const MoeConfig c = MoeConfig::preset("deepseek-v3");
  auto logits = random_logits(64 * c.num_experts, 20);
  auto bias = random_bias(c.num_experts, 21);
  const Routed a = run_router(c, logits, bias);
  const Routed b = run_router(c, logits, bias);
  EXPECT_EQ(a.ids, b.ids);
  EXPECT_EQ(0, std::memcmp(a.weights.data(), b.weights.data(), a.weights.size() * sizeof(float)));
  std::vector<float> row(logits.begin() + 17 * c.num_experts, logits.begin() + 18 * c.num_experts);
  const Routed one = run_router(c, row, bias);
  EXPECT_TRUE(std::equal(one.ids.begin(), one.ids.end(), a.ids.begin() + 17 * c.topk));
  EXPECT_TRUE(std::equal(one.weights.begin(), one.weights.end(), a.weights.begin() + 17 * c.topk));
  // Zero tokens is fine.
  std::vector<float> none;
  EXPECT_TRUE(run_router(c, none, bias).ids.empty());
}

TEST(Router, UnderflowedScoresStillGiveFiniteWeights) {
  MoeConfig c = MoeConfig::preset("tiny");
  std::vector<float> logits(c.num_experts, -500.0f);
  std::vector<float> bias(c.num_experts, 0.0f);
  const Routed r = run_router(c, logits, bias);
  for (float w : r.weights) EXPECT_EQ(w, 0.625f);
}

// ------------------------------------------------------------------ validation

using testing::expect_error_mentions;

TEST(Router, RefusesBadInputs) {
  const MoeConfig c = MoeConfig::preset("tiny");
  const int n = c.num_experts;
  const int k = c.topk;
  auto logits = random_logits(4 * n, 30);
  auto bias = random_bias(n, 31);
  std::vector<std::int32_t> ids(4 * k + 8);
  std::vector<float> w(4 * k + 8);
  auto L = [&](std::int64_t t, std::int64_t e) {
    return TensorView::contiguous(logits.data(), DType::f32, {t, e});
  };
  auto B = TensorView::contiguous(bias.data(), DType::f32, {n});
  auto I = TensorView::contiguous(ids.data(), DType::i32, {4, k});
  auto W = TensorView::contiguous(w.data(), DType::f32, {4, k});
  EXPECT_NO_THROW(route_cpu(c, L(4, n), B, I, W));

  expect_error_mentions([&] { route_cpu(c, L(2, 2 * n), B, I, W); }, "logits");
  expect_error_mentions(
      [&] { route_cpu(c, TensorView::contiguous(logits.data(), DType::f32, {4 * n}), B, I, W); }, "logits");
  expect_error_mentions(
      [&] {
        route_cpu(c, TensorView::contiguous(logits.data(), DType::bf16, {4, n}), B, I, W);
      },
      "logits");
  expect_error_mentions(
      [&] { route_cpu(c, L(4, n), TensorView::contiguous(bias.data(), DType::f32, {n - 1}), I, W); },
      "correction_bias");
  expect_error_mentions([&] { route_cpu(c, L(4, n), TensorView{}, I, W); }, "correction_bias");
  expect_error_mentions(
      [&] {
        route_cpu(c, L(4, n), B, TensorView::contiguous(ids.data(), DType::i32, {4, k + 1}), W);
      },
      "topk_ids");
  expect_error_mentions(
      [&] {
        route_cpu(c, L(4, n), B, TensorView::contiguous(ids.data(), DType::f32, {4, k}), W);
      },
      "topk_ids");
  expect_error_mentions(
      [&] {
        route_cpu(c, L(4, n), B, I, TensorView::contiguous(w.data(), DType::f32, {3, k}));
      },
      "topk_weights");
  expect_error_mentions(
      [&] {
        route_cpu(c, L(4, n), B, I, TensorView::contiguous(w.data(), DType::i32, {4, k}));
      },
      "topk_weights");
  expect_error_mentions(
      [&] {
        route_cpu(c, TensorView::contiguous(logits.data(), DType::f32, {4, n}, Device::cuda), B, I, W);
      },
      "logits");

  logits[5] = std::numeric_limits<float>::quiet_NaN();
  expect_error_mentions([&] { route_cpu(c, L(4, n), B, I, W); }, "logits");
  logits[5] = 0.0f;
  bias[3] = std::numeric_limits<float>::infinity();
  expect_error_mentions([&] { route_cpu(c, L(4, n), B, I, W); }, "correction_bias");
  bias[3] = 0.0f;

  MoeConfig bad = c;
  bad.topk = 0;
  EXPECT_THROW(route_cpu(bad, L(4, n), B, I, W), Error);
  bad = c;
  bad.num_groups = 3;  // does not divide 16
  EXPECT_THROW(route_cpu(bad, L(4, n), B, I, W), Error);

  MoeConfig soft = c;
  soft.scoring = Scoring::softmax;
  EXPECT_NO_THROW(route_cpu(soft, L(4, n), TensorView{}, I, W));
}

// ------------------------------------------------------------------ gate GEMM

TEST(RouterLogits, MatchesSequentialF32Sum) {
  const std::int64_t tokens = 3, hidden = 256, experts = 5;
  std::mt19937 rng(40);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  HostTensor x(DType::bf16, {tokens, hidden});
  HostTensor gate(DType::bf16, {experts, hidden});
  for (std::int64_t i = 0; i < x.numel(); ++i) x.data<bf16>()[i] = bf16::from_float(dist(rng));
  for (std::int64_t i = 0; i < gate.numel(); ++i) gate.data<bf16>()[i] = bf16::from_float(0.05f * dist(rng));
  HostTensor logits(DType::f32, {tokens, experts});
  router_logits_cpu(x, gate, logits);
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t e = 0; e < experts; ++e) {
      float acc = 0.0f;
      double exact = 0.0;
      for (std::int64_t h = 0; h < hidden; ++h) {
        const float a = x.data<bf16>()[t * hidden + h].to_float();
        const float b = gate.data<bf16>()[e * hidden + h].to_float();
        const float p = a * b;
        acc += p;
        exact += static_cast<double>(a) * b;
      }
      EXPECT_EQ(logits.data<float>()[t * experts + e], acc);
      EXPECT_NEAR(logits.data<float>()[t * experts + e], exact, 1e-4);
    }
  }
}

TEST(RouterLogits, RefusesBadInputs) {
  HostTensor x(DType::bf16, {2, 128});
  HostTensor gate(DType::bf16, {4, 128});
  HostTensor logits(DType::f32, {2, 4});
  EXPECT_NO_THROW(router_logits_cpu(x, gate, logits));
  HostTensor xf(DType::f32, {2, 128});
  expect_error_mentions([&] { router_logits_cpu(xf, gate, logits); }, "x must have dtype bf16");
  HostTensor gate_h(DType::bf16, {4, 64});
  expect_error_mentions([&] { router_logits_cpu(x, gate_h, logits); }, "gate_weight");
  HostTensor out_bad(DType::f32, {2, 5});
  expect_error_mentions([&] { router_logits_cpu(x, gate, out_bad); }, "logits");
  HostTensor out_bf(DType::bf16, {2, 4});
  expect_error_mentions([&] { router_logits_cpu(x, gate, out_bf); }, "logits");
  x.data<bf16>()[7] = bf16::from_bits(0x7fc0);
  expect_error_mentions([&] { router_logits_cpu(x, gate, logits); }, "x must be finite");
}

// Finite inputs whose dot product overflows f32: an error naming the logit, not an Inf / NaN logit.
TEST(RouterLogits, RefusesAnOverflowingProduct) {
  HostTensor x(DType::bf16, {1, 128}), gate(DType::bf16, {2, 128}), logits(DType::f32, {1, 2});
  for (int h = 0; h < 128; ++h) {
    x.data<bf16>()[h] = bf16::from_float(h < 2 ? 3e38f : 0.0f);
    gate.data<bf16>()[h] = bf16::from_float(1.0f);
    gate.data<bf16>()[128 + h] = bf16::from_float(1.0f);
  }
  expect_error_mentions([&] { router_logits_cpu(x, gate, logits); }, "overflows f32");
}

}  // namespace
}  // namespace epmoe
