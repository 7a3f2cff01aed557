// GPU router against route_cpu: sigmoid (noaux_tc) bit for bit, ids and weights; softmax ids
// exactly and weights within f32 rounding. Fresh random inputs with ties of every kind, outputs
// poisoned before each run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "epmoe/config.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/launch.hpp"
#include "epmoe/cuda/router.hpp"
#include "epmoe/router.hpp"
#include "gpu_test_util.hpp"
#include "routing/router_kernels.cuh"
#include "routing/router_math.hpp"
#include "test_random.hpp"

namespace epmoe {
namespace {

using testing::bits_equal;
using testing::expect_error_mentions;

constexpr std::uint8_t kPoison = 0xff;  // i32 -1, f32 NaN: never a valid output

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// The configs under test, by name: the two presets and shapes that reach every lane layout of the
// kernel (experts per lane 1..16, vector and scalar loads, 1..32 groups, all groups kept).
MoeConfig config_named(const std::string& name) {
  if (name == "tiny" || name == "deepseek_v3")
    return MoeConfig::preset(name == "tiny" ? "tiny" : "deepseek-v3");
  MoeConfig c = MoeConfig::preset("deepseek-v3");
  c.name = name;
  auto set = [&c](int e, int k, int g, int kg) {
    c.num_experts = e, c.topk = k, c.num_groups = g, c.topk_groups = kg;
  };
  if (name == "v2_like") set(160, 6, 8, 3);          // 20 experts per group: padded lanes, scalar loads
  if (name == "flat64") set(64, 6, 1, 1);            // 2 per lane
  if (name == "flat384") set(384, 8, 1, 1);          // 12 of 16 slots per lane used
  if (name == "flat512_k32") set(512, 32, 1, 1);     // 16 per lane, top-32
  if (name == "all_groups_kept") set(256, 8, 8, 8);  // grouped config, plain top-k
  if (name == "groups32") set(256, 8, 32, 6);        // one lane per group
  if (name == "groups16") set(128, 8, 16, 4);        // two lanes per group, 4 per lane
  if (name == "no_renorm") {
    c.renormalize = false;
    c.routed_scaling_factor = 1.0f;
  }
  if (name.rfind("softmax", 0) == 0) {
    c.scoring = Scoring::softmax;
    c.routed_scaling_factor = 1.0f;
    if (name == "softmax_mixtral") set(8, 2, 1, 1);
    if (name == "softmax_qwen") set(128, 8, 1, 1);
    if (name == "softmax_flat64") set(64, 6, 1, 1);
    if (name == "softmax_grouped") set(256, 8, 8, 4);
    if (name == "softmax_tiny") set(16, 4, 4, 2);
    if (name.rfind("softmax_flat256", 0) == 0) set(256, 8, 1, 1);  // route_g8_softmax_kernel's shape
    if (name == "softmax_flat256_k6") set(256, 6, 1, 1);
    if (name == "softmax_flat256_no_renorm") c.renormalize = false;
    if (name == "softmax_all_groups_kept") set(256, 8, 8, 8);  // no group selection: the g8 shape too
  }
  c.validate();
  return c;
}

// Bias: even experts from a small set of values (so that equal scores tie exactly after the
// bias), odd experts continuous; with `periodic`, every group repeats group 0's bias (so that
// groups with equal logits tie as groups).
HostTensor random_bias(const MoeConfig& c, bool periodic, std::mt19937_64& rng) {
  const int e_count = c.num_experts;
  const int per_group = e_count / c.num_groups;
  HostTensor bias(DType::f32, {e_count});
  float* b = bias.data<float>();
  std::normal_distribution<float> normal(0.0f, 0.05f);
  std::uniform_int_distribution<int> pick(0, 3);
  const float discrete[4] = {0.125f, -0.0625f, 0.25f, 0.03125f};
  for (int e = 0; e < e_count; ++e) {
    if (periodic && e >= per_group) {
      b[e] = b[e % per_group];
    } else {
      b[e] = e % 2 == 0 ? discrete[pick(rng)] : normal(rng);
    }
  }
  return bias;
}

// Sigmoid logits [T, E], rows of kinds that produce every kind of tie and the zero-sum fallback.
HostTensor random_sigmoid_logits(const MoeConfig& c, std::int64_t tokens, std::mt19937_64& rng) {
  const int n = c.num_experts;
  const int per_group = n / c.num_groups;
  HostTensor logits(DType::f32, {tokens, n});
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_real_distribution<float> very_negative(-200.0f, -110.0f);
  std::uniform_real_distribution<float> large(20.0f, 60.0f);
  for (std::int64_t t = 0; t < tokens; ++t) {
    float* row = logits.data<float>() + t * n;
    switch (t % 8) {
      case 1:  // a coarse grid: equal scores, equal biased scores where the bias is equal
        for (int e = 0; e < n; ++e) row[e] = std::round(normal(rng) * 2.0f) / 4.0f + 0.125f;
        break;
      case 2:  // every score underflows to 0: selection by bias alone, weights 1/K (sum == 0)
        for (int e = 0; e < n; ++e) row[e] = very_negative(rng);
        break;
      case 3:  // every score saturates to exactly 1
        for (int e = 0; e < n; ++e) row[e] = large(rng);
        break;
      case 4: {  // one value everywhere
        const float v = normal(rng);
        for (int e = 0; e < n; ++e) row[e] = v != 0.0f ? v : 0.5f;
        break;
      }
      case 5:  // half the experts underflow
        for (int e = 0; e < n; ++e) row[e] = e % 2 == 0 ? very_negative(rng) : normal(rng);
        break;
      case 6:  // every group a copy of group 0 (group ties under a periodic bias)
        for (int e = 0; e < n; ++e) row[e] = e < per_group ? normal(rng) : row[e % per_group];
        break;
      case 7:  // near 0: scores near 0.5, many near-ties
        for (int e = 0; e < n; ++e) row[e] = normal(rng) * 0.005f + 1e-4f;
        break;
      default:
        for (int e = 0; e < n; ++e) row[e] = normal(rng);
        break;
    }
  }
  return logits;
}

// Softmax logits: distinct values at least 0.04 apart (a random permutation of a grid plus
// jitter), so that the selection is decided far above rounding and the GPU must agree exactly.
HostTensor random_softmax_logits(const MoeConfig& c, std::int64_t tokens, std::mt19937_64& rng) {
  const int n = c.num_experts;
  HostTensor logits(DType::f32, {tokens, n});
  std::vector<int> perm(static_cast<std::size_t>(n));
  std::uniform_real_distribution<float> jitter(0.0f, 0.01f);
  std::uniform_real_distribution<float> shift(-20.0f, 20.0f);
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    const float offset = shift(rng);
    float* row = logits.data<float>() + t * n;
    for (int e = 0; e < n; ++e) row[e] = offset + 0.05f * static_cast<float>(perm[e] - n / 2) + jitter(rng);
  }
  return logits;
}

struct Outputs {
  HostTensor ids, weights;
};

Outputs route_on_gpu(const MoeConfig& c, const HostTensor& logits, const HostTensor& bias, bool misaligned,
                     const cuda::RouteKernelChoice& choice = cuda::route_kernel_choice_from_env()) {
  const std::int64_t tokens = logits.size(0);
  cuda::Stream stream;
  // Misaligned: the logits one float past a 256-byte boundary (the kernel's scalar-load path).
  const cuda::DeviceBuffer logit_buffer(logits.nbytes() + 16);
  const TensorView dlogits = TensorView::contiguous(logit_buffer.as<float>() + (misaligned ? 1 : 0),
                                                    DType::f32, {tokens, c.num_experts}, Device::cuda);
  cuda::copy_to_device(dlogits, logits, stream);
  const cuda::DeviceTensor dbias = cuda::to_device(bias, stream);
  const cuda::DeviceTensor dids(DType::i32, {tokens, c.topk});
  const cuda::DeviceTensor dweights(DType::f32, {tokens, c.topk});
  dids.fill_bytes(kPoison, stream);
  dweights.fill_bytes(kPoison, stream);
  cuda::route(c, dlogits, dbias, dids, dweights, stream, choice);
  return {cuda::to_host(dids, stream), cuda::to_host(dweights, stream)};
}

Outputs route_on_cpu(const MoeConfig& c, const HostTensor& logits, const HostTensor& bias) {
  const std::int64_t tokens = logits.size(0);
  Outputs out{HostTensor(DType::i32, {tokens, c.topk}), HostTensor(DType::f32, {tokens, c.topk})};
  out.ids.fill_bytes(kPoison);
  out.weights.fill_bytes(kPoison);
  route_cpu(c, logits, bias, out.ids, out.weights);
  return out;
}

// ---------------------------------------------------------------- sigmoid: bit-exact
using SigmoidCase = std::tuple<std::string, std::int64_t, bool>;  // config, T, periodic bias

class RouterSigmoidGpu : public ::testing::TestWithParam<SigmoidCase> {};

void expect_same_routes(const MoeConfig& c, const HostTensor& logits, const HostTensor& bias, bool misaligned,
                        const cuda::RouteKernelChoice& choice) {
  const std::int64_t tokens = logits.size(0);
  const Outputs want = route_on_cpu(c, logits, bias);
  const Outputs got = route_on_gpu(c, logits, bias, misaligned, choice);
  const std::int64_t k = c.topk;
  const auto* gi = got.ids.data<std::int32_t>();
  const auto* wi = want.ids.data<std::int32_t>();
  const float* gw = got.weights.data<float>();
  const float* ww = want.weights.data<float>();
  auto where = [k](std::int64_t i) {
    return "[" + std::to_string(i / k) + ", " + std::to_string(i % k) + "]";
  };
  EXPECT_TRUE(bits_equal(gi, wi, tokens * k, [&](std::int64_t i) {
    return "ids" + where(i) + " (token kind " + std::to_string(i / k % 8) + "): got " +
           std::to_string(gi[i]) + ", want " + std::to_string(wi[i]);
  }));
  EXPECT_TRUE(bits_equal(gw, ww, tokens * k, [&](std::int64_t i) {
    return "weights" + where(i) + " (token kind " + std::to_string(i / k % 8) + "): got " +
           std::to_string(gw[i]) + " (0x" + std::to_string(bits_of(gw[i])) + "), want " +
           std::to_string(ww[i]) + " (0x" + std::to_string(bits_of(ww[i])) + ")";
  }));
}

void check_sigmoid(const MoeConfig& c, std::int64_t tokens, bool periodic, bool misaligned,
                   const cuda::RouteKernelChoice& choice = cuda::route_kernel_choice_from_env()) {
  testing::SeededRng rng;
  const HostTensor bias = random_bias(c, periodic, rng);
  const HostTensor logits = random_sigmoid_logits(c, tokens, rng);
  expect_same_routes(c, logits, bias, misaligned, choice);
}

std::string sigmoid_case_name(const ::testing::TestParamInfo<SigmoidCase>& info) {
  return std::get<0>(info.param) + "_T" + std::to_string(std::get<1>(info.param)) +
         (std::get<2>(info.param) ? "_periodic_bias" : "_mixed_bias");
}

TEST_P(RouterSigmoidGpu, BitExactWithCpu) {
  EPMOE_REQUIRE_GPU();
  const auto& [name, tokens, periodic] = GetParam();
  check_sigmoid(config_named(name), tokens, periodic, false);
}

INSTANTIATE_TEST_SUITE_P(Presets, RouterSigmoidGpu,
                         ::testing::Combine(::testing::Values("tiny", "deepseek_v3"),
                                            ::testing::Values<std::int64_t>(1, 3, 128, 4097, 16384),
                                            ::testing::Bool()),
                         sigmoid_case_name);

INSTANTIATE_TEST_SUITE_P(Layouts, RouterSigmoidGpu,
                         ::testing::Combine(::testing::Values("v2_like", "flat64", "flat384", "flat512_k32",
                                                              "all_groups_kept", "groups32", "groups16",
                                                              "no_renorm"),
                                            ::testing::Values<std::int64_t>(3, 4097), ::testing::Bool()),
                         sigmoid_case_name);

// ---------------------------------------------------------------- every kernel choice
// The same inputs through each kernel the router can take (RouteKernelChoice): route_g8_kernel
// forced below its switch point and the general kernel above it, each with the branch-free and
// the __fdiv_rn sigmoid.
using ChoiceCase = std::tuple<std::string, std::int64_t, bool>;  // kernel, T, __fdiv_rn sigmoid

cuda::RouteKernelChoice choice_named(const std::string& kernel, bool rn_division) {
  cuda::RouteKernelChoice c;
  c.kernel = kernel.rfind("g8", 0) == 0 ? cuda::RouteKernelChoice::Kernel::g8
                                        : cuda::RouteKernelChoice::Kernel::general;
  c.rn_division = rn_division;
  c.sieve = kernel.rfind("g8_sieve", 0) == 0;
  if (kernel == "g8_sieve_tma1") c.tma_stages = 1;
  if (kernel == "g8_sieve_tma2") c.tma_stages = 2;
  if (kernel == "g8_sieve_tma0") c.tma_stages = 0;
  if (kernel.rfind("g8_sieve_tma", 0) == 0) c.token_lanes = 8;
  if (kernel.rfind("g8_sieve_pairs", 0) == 0) c.token_lanes = 16;  // v9: 2 tokens per warp
  if (kernel == "g8_sieve_pairs_tma2") c.tma_stages = 2;
  return c;
}

std::string choice_case_name(const ::testing::TestParamInfo<ChoiceCase>& info) {
  return std::get<0>(info.param) + "_T" + std::to_string(std::get<1>(info.param)) +
         (std::get<2>(info.param) ? "_rn_div" : "_branch_free_div");
}

class RouterKernelChoiceGpu : public ::testing::TestWithParam<ChoiceCase> {};

TEST_P(RouterKernelChoiceGpu, BitExactWithCpu) {
  EPMOE_REQUIRE_GPU();
  const auto& [kernel, tokens, rn_division] = GetParam();
  const cuda::RouteKernelChoice choice = choice_named(kernel, rn_division);
  for (const bool periodic : {false, true})
    check_sigmoid(config_named("deepseek_v3"), tokens, periodic, false, choice);
  check_sigmoid(config_named("no_renorm"), tokens, false, false, choice);
}

INSTANTIATE_TEST_SUITE_P(Kernels, RouterKernelChoiceGpu,
                         ::testing::Combine(::testing::Values("g8", "general"),
                                            ::testing::Values<std::int64_t>(1, 5, 128, 4097, 20000),
                                            ::testing::Bool()),
                         choice_case_name);

// route_g8_sieve_kernel (v5) at every T the tests above use, with each staging (v7: TMA copies, one
// or two stage buffers per warp). A warp's buffer is reused (its mbarrier's parity flips) from
// T = 16897 with one buffer (4224 warps) and from T = 21121 with two (2640 warps); T = 65537 takes
// each buffer 3-4 times and ends on a partial quad.
INSTANTIATE_TEST_SUITE_P(
    Sieve, RouterKernelChoiceGpu,
    ::testing::Combine(::testing::Values("g8_sieve", "g8_sieve_tma0", "g8_sieve_tma1", "g8_sieve_tma2",
                                         "g8_sieve_pairs", "g8_sieve_pairs_tma2"),
                       ::testing::Values<std::int64_t>(1, 3, 5, 128, 4097, 16384, 20000, 65537),
                       ::testing::Bool()),
    choice_case_name);

// The traced sieve instances (RouteKernelChoice::trace, the bench's "router.trace" rows): the same
// outputs bit for bit, and one record per warp with a unit whose stamps are in phase order. T = 20000
// gives quads' warps two units (only the first is stamped); T = 5 one partial unit.
TEST(RouterGpu, TracedSieveKeepsTheBitsAndStampsInOrder) {
  EPMOE_REQUIRE_GPU();
  constexpr int kWords = cuda::kRouteTraceWordsPerWarp, kPhases = kWords - 4;
  const std::size_t words = cuda::route_trace_words();
  const cuda::DeviceBuffer trace(words * sizeof(std::uint64_t));
  for (const int lanes : {8, 16}) {
    for (const std::int64_t tokens : {5, 4097, 20000}) {
      SCOPED_TRACE("lanes " + std::to_string(lanes) + ", T " + std::to_string(tokens));
      cuda::RouteKernelChoice choice = choice_named("g8_sieve_tma1", false);
      choice.token_lanes = lanes;
      choice.trace = trace.as<std::uint64_t>();
      trace.fill_bytes(0);
      EPMOE_CUDA_CHECK(cudaDeviceSynchronize());  // (the legacy stream's memset, before the router's stream)
      check_sigmoid(config_named("deepseek_v3"), tokens, false, false, choice);
      std::vector<std::uint64_t> h(words);
      EPMOE_CUDA_CHECK(
          cudaMemcpy(h.data(), trace.data(), words * sizeof(std::uint64_t), cudaMemcpyDeviceToHost));
      const std::int64_t units = (tokens + 32 / lanes - 1) / (32 / lanes);
      std::int64_t launched = 0, stamped = 0;
      for (std::size_t w = 0; w < words; w += kWords) {
        const std::uint64_t* r = &h[w];
        launched += r[2] != 0 ? 1 : 0;
        if (r[2 + kPhases - 1] == 0) continue;  // no unit, or not launched
        ++stamped;
        for (int i = 1; i < kPhases; ++i)
          ASSERT_LE(r[1 + i], r[2 + i]) << "warp " << w / kWords << " phase " << i;
        ASSERT_LE(r[1], r[2 + kPhases]) << "warp " << w / kWords;
      }
      EXPECT_EQ(stamped, std::min(units, launched));
      EXPECT_GT(stamped, 0);
    }
  }
  cuda::RouteKernelChoice general = choice_named("general", false);
  general.trace = trace.as<std::uint64_t>();
  const MoeConfig c = config_named("deepseek_v3");
  testing::SeededRng rng;
  const HostTensor logits = random_sigmoid_logits(c, 8, rng);
  expect_error_mentions([&] { route_on_gpu(c, logits, random_bias(c, false, rng), false, general); },
                        "router trace");
}

// Every layout's config through the sieve choice (where g8 does not apply it falls back, so these
// check that it does so), and the default path: automatic with the sieve at T >= 1024.
TEST(RouterGpu, SieveChoiceOnEveryConfig) {
  EPMOE_REQUIRE_GPU();
  for (const char* name : {"tiny", "deepseek_v3", "v2_like", "all_groups_kept", "groups16", "no_renorm"}) {
    SCOPED_TRACE(name);
    check_sigmoid(config_named(name), 4097, false, false, choice_named("g8_sieve", false));
  }
  cuda::RouteKernelChoice automatic_sieve;
  automatic_sieve.sieve = true;
  for (const std::int64_t tokens : {128, 4097})
    check_sigmoid(config_named("deepseek_v3"), tokens, true, false, automatic_sieve);
}

// route_g8_kernel keeps kRouterG8Candidates (64) candidates per token; a quad with a longer list
// runs K selection rounds instead. A constant bias makes the candidates the kept experts tied with
// the second-largest value: rows with `top` equal maxima per group (and the rest below) give 4 * top
// candidates: 64 fills the list exactly, 68 and 128 (every value equal) take the rounds.
TEST(RouterGpu, LongCandidateListsTakeTheRoundsPath) {
  EPMOE_REQUIRE_GPU();
  const MoeConfig c = config_named("deepseek_v3");
  testing::SeededRng rng;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::int64_t tokens = 4099, e_count = c.num_experts, per_group = e_count / c.num_groups;
  HostTensor bias(DType::f32, {e_count});
  for (std::int64_t e = 0; e < e_count; ++e) bias.data<float>()[e] = 0.0625f;
  HostTensor logits(DType::f32, {tokens, e_count});
  for (std::int64_t t = 0; t < tokens; ++t) {
    float* row = logits.data<float>() + t * e_count;
    const std::int64_t kind = (t / 3) % 6;  // quads of mixed kinds, and whole quads of one kind
    const int top = kind == 0 ? 16 : kind == 1 ? 17 : kind == 2 ? 32 : kind == 3 ? 15 : 0;
    if (top == 0) {
      for (std::int64_t i = 0; i < e_count; ++i) row[i] = normal(rng);
      continue;
    }
    const float high = 1.5f + 0.25f * static_cast<float>(t % 4);
    for (std::int64_t g = 0; g < c.num_groups; ++g) {
      std::vector<int> order(static_cast<std::size_t>(per_group));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      // Every group has `top` maxima; groups differ only below them (all groups tie, ids decide).
      for (std::int64_t i = 0; i < per_group; ++i)
        row[g * per_group + order[static_cast<std::size_t>(i)]] =
            i < top ? high : high - 1.0f - std::fabs(normal(rng));
    }
  }
  for (const bool rn_division : {false, true}) {
    expect_same_routes(c, logits, bias, false, choice_named("g8", rn_division));
    expect_same_routes(c, logits, bias, false, choice_named("g8_sieve_tma1", rn_division));
    expect_same_routes(c, logits, bias, false, choice_named("g8_sieve_pairs", rn_division));
  }
  expect_same_routes(c, logits, bias, false, cuda::route_kernel_choice_from_env());
}

// The sieve's own list boundary: its candidates are route_g8_kernel's plus the kept experts within
// the margin below tau. Rows of `top` tied maxima and `extra` experts 1e-5 below them per group
// (scores ~1.5e-6 apart: within the margin, exactly distinct) give 4 * top exact candidates and
// 4 * (top + extra) sieve candidates: (16, 0) and (15, 1) fill the list exactly, (16, 1) and
// (2, 15) take the rounds path where route_g8_kernel does not. Group offsets 0 (exact ties: the
// exact group scores), 2e-6 * g (apart by less than the margin: the same) and 0.01 * g (decided by
// the approximation).
TEST(RouterGpu, SieveCandidateListBoundary) {
  EPMOE_REQUIRE_GPU();
  const MoeConfig c = config_named("deepseek_v3");
  testing::SeededRng rng;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::int64_t tokens = 4101, e_count = c.num_experts, per_group = e_count / c.num_groups;
  HostTensor bias(DType::f32, {e_count});
  for (std::int64_t e = 0; e < e_count; ++e) bias.data<float>()[e] = 0.0625f;
  const int shapes[][2] = {{16, 0}, {15, 1}, {16, 1}, {2, 15}, {2, 14}, {1, 20}, {8, 8}, {0, 0}};
  HostTensor logits(DType::f32, {tokens, e_count});
  for (std::int64_t t = 0; t < tokens; ++t) {
    float* row = logits.data<float>() + t * e_count;
    const auto& shape = shapes[(t / 3) % 8];  // quads of mixed kinds, and whole quads of one kind
    const int top = shape[0], extra = shape[1];
    if (top == 0) {
      for (std::int64_t i = 0; i < e_count; ++i) row[i] = normal(rng);
      continue;
    }
    const float spacing = (t / 24) % 3 == 0 ? 0.0f : (t / 24) % 3 == 1 ? 2e-6f : 0.01f;
    const float high = 1.5f + 0.25f * static_cast<float>(t % 4);
    for (std::int64_t g = 0; g < c.num_groups; ++g) {
      std::vector<int> order(static_cast<std::size_t>(per_group));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      const float h = high + spacing * static_cast<float>(g);
      for (std::int64_t i = 0; i < per_group; ++i)
        row[g * per_group + order[static_cast<std::size_t>(i)]] = i < top ? h
                                                                  : i < top + extra
                                                                      ? h - 1e-5f
                                                                      : h - 1.0f - std::fabs(normal(rng));
    }
  }
  for (const bool rn_division : {false, true}) {
    expect_same_routes(c, logits, bias, false, choice_named("g8_sieve_tma1", rn_division));
    expect_same_routes(c, logits, bias, false, choice_named("g8_sieve_pairs", rn_division));
  }
  expect_same_routes(c, logits, bias, false, choice_named("g8", false));
}

// A huge bias: 2^99 makes the margin ~2^80 (every kept expert a candidate: the rounds path), 2^101
// makes it infinite (every expert evaluated exactly, the group scores always exact).
TEST(RouterGpu, SieveHugeBiasFallsBackToExact) {
  EPMOE_REQUIRE_GPU();
  const MoeConfig c = config_named("deepseek_v3");
  for (const float huge : {0x1p+99f, 0x1p+101f, -0x1p+101f}) {
    testing::SeededRng rng;
    SCOPED_TRACE("bias " + std::to_string(huge));
    HostTensor bias = random_bias(c, false, rng);
    bias.data<float>()[37] = huge;
    const HostTensor logits = random_sigmoid_logits(c, 4097, rng);
    expect_same_routes(c, logits, bias, false, choice_named("g8_sieve_tma1", false));
    expect_same_routes(c, logits, bias, false, choice_named("g8_sieve_pairs", false));
  }
}

// ---------------------------------------------------------------- the branch-free sigmoid
// sigmoid_f32_branch_free (div_rn_sigmoid: reciprocal estimate, Newton step, residual correction,
// no branch) must give sigmoid_f32_fast's (__fdiv_rn) and sigmoid_f32's bits on every non-NaN
// float: checked on all 2^32 bit patterns.
__global__ void branch_free_sigmoid_kernel(unsigned int* mismatches, unsigned int* first_bad) {
  unsigned int bad = 0;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (1ull << 32);
       i += stride) {
    const float x = __uint_as_float(static_cast<std::uint32_t>(i));
    if (x != x) continue;
    const std::uint32_t got = __float_as_uint(routing::sigmoid_f32_branch_free(x));
    const bool ok = got == __float_as_uint(routing::sigmoid_f32_fast(x)) &&
                    got == __float_as_uint(routing::sigmoid_f32(x));
    if (!ok) {
      ++bad;
      atomicMin(first_bad, static_cast<unsigned int>(i));
    }
  }
  if (bad != 0u) atomicAdd(mismatches, bad);
}

TEST(RouterMathGpu, BranchFreeSigmoidBitIdenticalOnEveryFloat) {
  EPMOE_REQUIRE_GPU();
  cuda::Stream stream;
  const cuda::DeviceBuffer mismatches(4), first_bad(4);
  mismatches.fill_bytes(0, stream);
  first_bad.fill_bytes(0xff, stream);
  branch_free_sigmoid_kernel<<<132 * 16, 256, 0, stream>>>(mismatches.as<unsigned int>(),
                                                           first_bad.as<unsigned int>());
  EPMOE_CUDA_CHECK_LAUNCH();
  unsigned int bad = 0, first = 0;
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(&bad, mismatches.data(), 4, cudaMemcpyDeviceToHost, stream));
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(&first, first_bad.data(), 4, cudaMemcpyDeviceToHost, stream));
  stream.synchronize();
  std::printf("branch-free sigmoid: %u mismatches over all non-NaN floats\n", bad);
  EXPECT_EQ(bad, 0u) << "first mismatching input bits 0x" << std::hex << first;
}

// ---------------------------------------------------------------- the sieve's approximation
// route_g8_sieve_kernel's exactness rests on |sigmoid_approx(x) - sigmoid_f32_fast(x)| <=
// routing::kSieveApproxErr for every f32 x: checked on all 2^32 bit patterns (NaN included), the
// difference taken in f64 (exact for two floats in [0, 1]).
__global__ void sieve_sigmoid_error_kernel(unsigned long long* worst_bits, unsigned int* over) {
  double worst = 0.0;
  unsigned int bad = 0;
  const std::uint64_t stride = static_cast<std::uint64_t>(gridDim.x) * blockDim.x;
  for (std::uint64_t i = static_cast<std::uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (1ull << 32);
       i += stride) {
    const float x = __uint_as_float(static_cast<std::uint32_t>(i));
    const double d = fabs(static_cast<double>(kernels::sigmoid_approx(x)) -
                          static_cast<double>(routing::sigmoid_f32_fast(x)));
    worst = d > worst ? d : worst;
    bad += d <= static_cast<double>(routing::kSieveApproxErr) ? 0u : 1u;  // NaN counts as bad
  }
  atomicMax(worst_bits, static_cast<unsigned long long>(__double_as_longlong(worst)));
  if (bad != 0u) atomicAdd(over, bad);
}

TEST(RouterMathGpu, SieveSigmoidWithinItsBoundOnEveryFloat) {
  EPMOE_REQUIRE_GPU();
  cuda::Stream stream;
  const cuda::DeviceBuffer worst(8), over(4);
  worst.fill_bytes(0, stream);
  over.fill_bytes(0, stream);
  sieve_sigmoid_error_kernel<<<132 * 16, 256, 0, stream>>>(worst.as<unsigned long long>(),
                                                           over.as<unsigned int>());
  EPMOE_CUDA_CHECK_LAUNCH();
  unsigned long long worst_bits = 0;
  unsigned int bad = 0;
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(&worst_bits, worst.data(), 8, cudaMemcpyDeviceToHost, stream));
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(&bad, over.data(), 4, cudaMemcpyDeviceToHost, stream));
  stream.synchronize();
  double w = 0.0;
  std::memcpy(&w, &worst_bits, 8);
  std::printf("max |sigmoid_approx - sigmoid_f32_fast| = %.6g (2^%.2f), bound 2^-18\n", w, std::log2(w));
  EXPECT_EQ(bad, 0u) << "inputs beyond the bound; worst " << w;
  EXPECT_LE(w, static_cast<double>(routing::kSieveApproxErr));
}

TEST(RouterGpu, MisalignedLogitsTakeTheScalarPath) {
  EPMOE_REQUIRE_GPU();
  check_sigmoid(config_named("deepseek_v3"), 1000, true, true);
  check_sigmoid(config_named("groups16"), 1000, false, true);
  check_sigmoid(config_named("deepseek_v3"), 1000, false, true, choice_named("g8_sieve", false));
}

// ---------------------------------------------------------------- softmax: within rounding
// Ids equal to route_cpu's, weights within 1e-5 relative (finite).
void expect_softmax_routes(const MoeConfig& c, const HostTensor& logits,
                           const cuda::RouteKernelChoice& choice = cuda::route_kernel_choice_from_env()) {
  const std::int64_t tokens = logits.size(0);
  std::mt19937_64 rng(7);
  const HostTensor no_bias;
  const Outputs want = route_on_cpu(c, logits, no_bias);
  const HostTensor bias = random_bias(c, false, rng);  // a bias on the device, to show it is ignored
  const Outputs got = route_on_gpu(c, logits, bias, false, choice);
  const std::int64_t k = c.topk;
  const auto* gi = got.ids.data<std::int32_t>();
  const auto* wi = want.ids.data<std::int32_t>();
  EXPECT_TRUE(bits_equal(gi, wi, tokens * k, [&](std::int64_t i) {
    return "ids[" + std::to_string(i / k) + ", " + std::to_string(i % k) + "]: got " + std::to_string(gi[i]) +
           ", want " + std::to_string(wi[i]);
  }));
  const float* gw = got.weights.data<float>();
  const float* ww = want.weights.data<float>();
  double max_rel = 0.0;
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < tokens * k; ++i) {
    const double rel = std::fabs(static_cast<double>(gw[i]) - ww[i]) / std::max(std::fabs(ww[i]), 1e-30f);
    if (!std::isfinite(gw[i]) || !(rel <= 1e-5)) ++bad;
    if (std::isfinite(rel)) max_rel = std::max(max_rel, rel);
  }
  EXPECT_EQ(bad, 0) << "weights off by more than 1e-5 relative; max relative error " << max_rel;
}

cuda::RouteKernelChoice forced_g8() {
  cuda::RouteKernelChoice choice = cuda::route_kernel_choice_from_env();
  choice.kernel = cuda::RouteKernelChoice::Kernel::g8;
  return choice;
}

// (config, T, staging): staging -1 is the automatic choice (the general kernel below T = 1024, then
// route_g8_softmax_kernel where its shape applies); 0, 1, 2 force route_g8_softmax_kernel (E = 256, no
// group selection, K <= 8) at every T with that many TMA stage buffers (0: per-lane loads).
using SoftmaxCase = std::tuple<std::string, std::int64_t, int>;

class RouterSoftmaxGpu : public ::testing::TestWithParam<SoftmaxCase> {};

TEST_P(RouterSoftmaxGpu, MatchesCpuWithinRounding) {
  EPMOE_REQUIRE_GPU();
  const auto& [name, tokens, staging] = GetParam();
  const MoeConfig c = config_named(name);
  testing::SeededRng rng;
  cuda::RouteKernelChoice choice = cuda::route_kernel_choice_from_env();
  if (staging >= 0) {
    choice = forced_g8();
    choice.tma_stages = staging;
  }
  expect_softmax_routes(c, random_softmax_logits(c, tokens, rng), choice);
}

std::string softmax_case_name(const ::testing::TestParamInfo<SoftmaxCase>& info) {
  const int staging = std::get<2>(info.param);
  return std::get<0>(info.param) + "_T" + std::to_string(std::get<1>(info.param)) +
         (staging >= 0 ? "_tma" + std::to_string(staging) : "");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RouterSoftmaxGpu,
    ::testing::Combine(::testing::Values("softmax_mixtral", "softmax_qwen", "softmax_flat64",
                                         "softmax_grouped", "softmax_tiny", "softmax_flat256",
                                         "softmax_flat256_no_renorm", "softmax_all_groups_kept"),
                       ::testing::Values<std::int64_t>(1, 3, 128, 4097), ::testing::Values(-1)),
    softmax_case_name);

INSTANTIATE_TEST_SUITE_P(G8Forced, RouterSoftmaxGpu,
                         ::testing::Combine(::testing::Values("softmax_flat256", "softmax_flat256_no_renorm",
                                                              "softmax_flat256_k6",
                                                              "softmax_all_groups_kept"),
                                            ::testing::Values<std::int64_t>(1, 3, 5, 128, 4097, 16384, 65537),
                                            ::testing::Values(0, 1, 2)),
                         softmax_case_name);

// Exact ties of logits (a coarse grid, equal values broken by the lower index as route_cpu does),
// rows of one value (every expert a candidate: the rounds path, weights 1/K), rows with large
// spreads (exp(x - max) tiny or 0 for most experts) and a row with a run of equal maxima longer than
// K, through the g8 softmax kernel and the general one.
TEST(RouterSoftmaxG8Gpu, TiesAndFlatRows) {
  EPMOE_REQUIRE_GPU();
  for (const char* name : {"softmax_flat256", "softmax_flat256_no_renorm"}) {
    const MoeConfig c = config_named(name);
    SCOPED_TRACE(name);
    testing::SeededRng rng;
    std::normal_distribution<float> normal(0.0f, 2.0f);
    const std::int64_t tokens = 4099;
    HostTensor logits(DType::f32, {tokens, c.num_experts});
    for (std::int64_t t = 0; t < tokens; ++t) {
      float* row = logits.data<float>() + t * c.num_experts;
      for (int e = 0; e < c.num_experts; ++e) {
        switch (t % 4) {
          case 0:  // coarse grid: many exact ties
            row[e] = std::round(normal(rng) * 2.0f) / 4.0f;
            break;
          case 1:  // one value
            row[e] = 0.75f;
            break;
          case 2:  // large spread: exp(x - max) down to ~1e-20 among the top K. (Not wider: where a
                   // chosen expert's softmax score underflows to 0, route_cpu's tie rule picks the
                   // lowest index among those zeros, while the kernels select by logit.)
            row[e] = normal(rng) * 6.0f;
            break;
          default:  // 12 equal maxima spread over the lanes, the rest well below
            row[e] = e % 21 == 3 ? 5.0f : normal(rng) - 10.0f;
            break;
        }
      }
    }
    expect_softmax_routes(c, logits, forced_g8());
    cuda::RouteKernelChoice general = forced_g8();
    general.kernel = cuda::RouteKernelChoice::Kernel::general;
    expect_softmax_routes(c, logits, general);
  }
}

// ---------------------------------------------------------------- arguments
TEST(RouterGpu, RefusesBadArguments) {
  EPMOE_REQUIRE_GPU();
  const MoeConfig c = MoeConfig::preset("deepseek-v3");
  const std::int64_t t = 5, e = c.num_experts, k = c.topk;
  cuda::Stream stream;
  const cuda::DeviceTensor logits(DType::f32, {t, e}), bias(DType::f32, {e});
  const cuda::DeviceTensor ids(DType::i32, {t, k}), weights(DType::f32, {t, k});
  const cuda::DeviceTensor bad_dtype(DType::bf16, {t, e}), short_ids(DType::i32, {t, k - 1});
  const cuda::DeviceTensor i32_weights(DType::i32, {t, k}), short_bias(DType::f32, {e - 1});
  const cuda::DeviceTensor wrong_experts(DType::f32, {t, e + 1});
  HostTensor host_logits(DType::f32, {t, e});
  TensorView strided = logits.view();
  strided.shape[0] = 2;
  strided.stride[0] = 2 * e;  // every other row: not contiguous

  expect_error_mentions([&] { cuda::route(c, host_logits, bias, ids, weights, stream); }, "logits");
  expect_error_mentions([&] { cuda::route(c, bad_dtype, bias, ids, weights, stream); }, "logits");
  expect_error_mentions([&] { cuda::route(c, wrong_experts, bias, ids, weights, stream); }, "logits");
  expect_error_mentions([&] { cuda::route(c, strided, bias, ids.view().slice_rows(0, 2), weights, stream); },
                        "logits");
  expect_error_mentions([&] { cuda::route(c, logits, bias, short_ids, weights, stream); }, "topk_ids");
  expect_error_mentions([&] { cuda::route(c, logits, bias, ids, i32_weights, stream); }, "topk_weights");
  expect_error_mentions([&] { cuda::route(c, logits, TensorView{}, ids, weights, stream); },
                        "correction_bias");
  expect_error_mentions([&] { cuda::route(c, logits, short_bias, ids, weights, stream); }, "correction_bias");

  MoeConfig too_many_k = c;
  too_many_k.topk = 33;
  too_many_k.num_groups = 1;
  too_many_k.topk_groups = 1;
  EXPECT_FALSE(cuda::route_supports(too_many_k));
  expect_error_mentions([&] { cuda::route(too_many_k, logits, bias, ids, weights, stream); }, "topk");
  MoeConfig too_many_experts = c;
  too_many_experts.num_experts = 1024;
  too_many_experts.num_groups = 1;
  too_many_experts.topk_groups = 1;
  EXPECT_FALSE(cuda::route_supports(too_many_experts));
  expect_error_mentions([&] { cuda::route(too_many_experts, logits, bias, ids, weights, stream); },
                        "experts per lane");
  MoeConfig invalid = c;
  invalid.topk_groups = 9;
  expect_error_mentions([&] { cuda::route(invalid, logits, bias, ids, weights, stream); }, "topk_groups");
  EXPECT_TRUE(cuda::route_supports(c));
  EXPECT_TRUE(cuda::route_supports(MoeConfig::preset("tiny")));

  // T = 0: nothing to do, no error.
  const cuda::DeviceTensor no_logits(DType::f32, {0, e}), no_ids(DType::i32, {0, k}),
      no_w(DType::f32, {0, k});
  EXPECT_NO_THROW(cuda::route(c, no_logits, bias, no_ids, no_w, stream));
  stream.synchronize();
}

}  // namespace
}  // namespace epmoe
