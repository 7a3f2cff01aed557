// The GPU layer on one GPU against the CPU reference (mirror numerics, routed from the GPU's gate
// logits), eager against graph replay, and before against after a rebalance; the synthetic GPU
// weights against the CPU's, and the gate GEMM against the CPU's.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>

#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/gate.hpp"
#include "epmoe/cuda/layer.hpp"
#include "epmoe/cuda/synthetic.hpp"
#include "epmoe/layer.hpp"
#include "epmoe/router.hpp"
#include "gpu_test_util.hpp"
#include "layer/layer_test_util.hpp"
#include "test_random.hpp"

namespace epmoe {
namespace {

using cuda::DeviceTensor;
using testing::bits_equal;

MoeConfig one_rank(std::string_view preset, int redundant = 0, int max_tokens = 32,
                   QuantScheme quant = QuantScheme::fp8) {
  MoeConfig c = MoeConfig::preset(preset);
  c.quant = quant;
  c.num_ranks = 1;
  c.num_redundant_experts = redundant;
  c.max_tokens_per_rank = max_tokens;
  c.validate();
  return c;
}

std::shared_ptr<SyntheticWeights> gpu_synthetic(const MoeConfig& c, std::uint64_t seed) {
  auto w = std::make_shared<SyntheticWeights>(c, seed);
  w->set_expert_factory(cuda::gpu_expert_factory(0));
  return w;
}

template <class T>
::testing::AssertionResult same_bits(const HostTensor& got, const HostTensor& want, const char* what) {
  if (got.numel() != want.numel()) return ::testing::AssertionFailure() << what << ": sizes differ";
  return bits_equal(got.data<T>(), want.data<T>(), got.numel(),
                    [&](std::int64_t i) { return std::string(what) + " element " + std::to_string(i); });
}

// Packed int4 (i4x2) has no element type of its own: compare the bytes.
::testing::AssertionResult same_raw_bytes(const HostTensor& got, const HostTensor& want, const char* what) {
  if (got.nbytes() != want.nbytes()) return ::testing::AssertionFailure() << what << ": sizes differ";
  const auto* g = static_cast<const std::uint8_t*>(got.view().data);
  const auto* w = static_cast<const std::uint8_t*>(want.view().data);
  return bits_equal(g, w, static_cast<std::int64_t>(got.nbytes()),
                    [&](std::int64_t i) { return std::string(what) + " byte " + std::to_string(i); });
}

TEST(SyntheticGpu, Fp8ExpertBitIdenticalWithCpu) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  const std::pair<std::int64_t, std::int64_t> dims[] = {{256, 128}, {7168, 2048}};
  for (const auto& [H, I] : dims) {
    SCOPED_TRACE(::testing::Message() << "H=" << H << " I=" << I);
    const std::uint64_t seed = rng();
    const auto cpu = make_synthetic_expert(QuantScheme::fp8, H, I, seed);
    const auto gpu = cuda::gpu_expert_factory(0)(QuantScheme::fp8, H, I, seed);
    EXPECT_TRUE(same_bits<fp8_e4m3>(gpu->w13, cpu->w13, "w13"));
    EXPECT_TRUE(same_bits<float>(gpu->w13_scale, cpu->w13_scale, "w13_scale"));
    EXPECT_TRUE(same_bits<fp8_e4m3>(gpu->w2, cpu->w2, "w2"));
    EXPECT_TRUE(same_bits<float>(gpu->w2_scale, cpu->w2_scale, "w2_scale"));
  }
}

TEST(SyntheticGpu, W4a8ExpertBitIdenticalWithCpu) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  const std::pair<std::int64_t, std::int64_t> dims[] = {{256, 128}, {7168, 2048}};
  for (const auto& [H, I] : dims) {
    SCOPED_TRACE(::testing::Message() << "H=" << H << " I=" << I);
    const std::uint64_t seed = rng();
    const auto cpu = make_synthetic_expert(QuantScheme::w4a8, H, I, seed);
    const auto gpu = cuda::gpu_expert_factory(0)(QuantScheme::w4a8, H, I, seed);
    EXPECT_TRUE(same_raw_bytes(gpu->w13, cpu->w13, "w13"));
    EXPECT_TRUE(same_bits<float>(gpu->w13_scale, cpu->w13_scale, "w13_scale"));
    EXPECT_TRUE(same_raw_bytes(gpu->w2, cpu->w2, "w2"));
    EXPECT_TRUE(same_bits<float>(gpu->w2_scale, cpu->w2_scale, "w2_scale"));
  }
}

TEST(GateGemmGpu, MatchesCpuToF32Rounding) {
  EPMOE_REQUIRE_GPU();
  const MoeConfig c = one_rank("deepseek-v3");
  testing::SeededRng rng;
  SyntheticWeights w(c, rng());
  const std::int64_t T = 37;
  const HostTensor x = synthetic_tokens(c, rng(), 0, T);
  HostTensor want(DType::f32, {T, c.num_experts});
  router_logits_cpu(x, w.gate_weight(), want);
  cuda::Stream stream;
  DeviceTensor dx = cuda::to_device(x, stream), dg = cuda::to_device(w.gate_weight(), stream);
  DeviceTensor dl(DType::f32, {T, c.num_experts});
  dl.fill_bytes(0xff, stream);
  cuda::GateGemm gate;
  gate.run(dx, dg, dl, stream);
  const HostTensor got = cuda::to_host(dl, stream);
  const ErrorReport r = compare(got, want);
  EXPECT_EQ(r.non_finite, 0);
  EXPECT_LE(r.rel_l2, 1e-5);  // 7168-term f32 sums in another order; the products are exact
  testing::expect_error_mentions([&] { gate.run(dx, dg, dx, stream); }, "logits");
}

// The gate at the tiny model's dims and decode-sized batches (cuBLAS picks other kernels there than
// at DeepSeek-V3's): every logit written (outputs poisoned with NaN first) and equal to the CPU's.
TEST(GateGemmGpu, EveryLogitWrittenAtSmallShapes) {
  EPMOE_REQUIRE_GPU();
  const MoeConfig c = one_rank("tiny");
  testing::SeededRng rng;
  SyntheticWeights w(c, rng());
  cuda::Stream stream;
  cuda::GateGemm gate;
  const DeviceTensor dg = cuda::to_device(w.gate_weight(), stream);
  for (const std::int64_t T : {1, 2, 3, 7, 16, 32, 100}) {
    SCOPED_TRACE("T = " + std::to_string(T));
    const HostTensor x = synthetic_tokens(c, rng(), 0, T);
    HostTensor want(DType::f32, {T, c.num_experts});
    router_logits_cpu(x, w.gate_weight(), want);
    const DeviceTensor dx = cuda::to_device(x, stream);
    DeviceTensor dl(DType::f32, {T, c.num_experts});
    dl.fill_bytes(0xff, stream);
    gate.run(dx, dg, dl, stream);
    const ErrorReport r = compare(cuda::to_host(dl, stream), want);
    EXPECT_EQ(r.non_finite, 0);
    EXPECT_LE(r.rel_l2, 1e-5);
  }
}

struct LayerCase {
  const char* preset;
  Mode mode;
  std::int64_t tokens;
  int redundant;
  QuantScheme quant = QuantScheme::fp8;
  // W4A8: GpuLayerOptions::w4a8_codes. The synthetic weights never hold -8, so "auto" packs them
  // sign-magnitude; the offset-binary codes (what a checkpoint holding -8 gets) take the kernels' offset
  // term, a different sum from the reference's (bench/NOTES.md, session 65).
  const char* w4a8_codes = "auto";
};

// The case's layer options: its mode, and in normal mode buffers for its batch.
cuda::GpuLayerOptions options_for(const LayerCase& p) {
  cuda::GpuLayerOptions o;
  o.w4a8_codes = p.w4a8_codes;
  o.mode = p.mode;
  o.max_tokens = p.mode == Mode::normal ? std::max<std::int64_t>(p.tokens, 1) : 0;
  return o;
}

class GpuLayerOneRank : public ::testing::TestWithParam<LayerCase> {};

TEST_P(GpuLayerOneRank, MatchesReferenceEagerAndGraph) {
  EPMOE_REQUIRE_GPU();
  const LayerCase p = GetParam();
  const MoeConfig c = one_rank(p.preset, p.redundant, 32, p.quant);
  testing::SeededRng rng;
  auto w = gpu_synthetic(c, rng());
  cuda::GpuMoeLayer layer(w, options_for(p));
  const HostTensor x = synthetic_tokens(c, rng(), 0, p.tokens);
  const testing::LayerForward eager = testing::layer_forward(layer, x, false);
  testing::expect_matches_reference(*w, x, eager, "eager forward");
  // Repeats reuse the buffers; graph replays give the same bits.
  EXPECT_TRUE(same_bits<bf16>(testing::layer_forward(layer, x, false).y, eager.y, "eager repeat"));
  if (p.mode == Mode::low_latency) {
    EXPECT_TRUE(same_bits<bf16>(testing::layer_forward(layer, x, true).y, eager.y, "graph"));
    EXPECT_TRUE(same_bits<bf16>(testing::layer_forward(layer, x, true).y, eager.y, "graph replay"));
    EXPECT_EQ(layer.graphs_captured(), 1u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, GpuLayerOneRank,
    ::testing::Values(LayerCase{"tiny", Mode::low_latency, 1, 0}, LayerCase{"tiny", Mode::low_latency, 32, 0},
                      LayerCase{"tiny", Mode::low_latency, 19, 4}, LayerCase{"tiny", Mode::normal, 100, 0},
                      LayerCase{"tiny", Mode::normal, 7, 4},
                      LayerCase{"deepseek-v3", Mode::low_latency, 4, 0},
                      LayerCase{"deepseek-v3", Mode::normal, 6, 32},
                      LayerCase{"tiny", Mode::low_latency, 32, 4, QuantScheme::w4a8},
                      LayerCase{"tiny", Mode::normal, 50, 0, QuantScheme::w4a8},
                      LayerCase{"deepseek-v3", Mode::low_latency, 4, 0, QuantScheme::w4a8},
                      LayerCase{"deepseek-v3", Mode::normal, 5, 32, QuantScheme::w4a8},
                      LayerCase{"tiny", Mode::low_latency, 32, 4, QuantScheme::w4a8, "offset_binary"},
                      LayerCase{"tiny", Mode::normal, 50, 0, QuantScheme::w4a8, "offset_binary"},
                      LayerCase{"deepseek-v3", Mode::low_latency, 16, 0, QuantScheme::w4a8, "offset_binary"},
                      LayerCase{"deepseek-v3", Mode::normal, 20, 32, QuantScheme::w4a8, "offset_binary"}),
    [](const auto& case_info) {
      const std::string_view codes = case_info.param.w4a8_codes;
      return std::string(case_info.param.preset[0] == 't' ? "tiny" : "dsv3") + "_" +
             std::string(to_string(case_info.param.quant)) +
             (codes == "auto" ? "" : "_" + std::string(codes)) + "_" +
             (case_info.param.mode == Mode::normal ? "normal" : "ll") + "_T" +
             std::to_string(case_info.param.tokens) + "_R" + std::to_string(case_info.param.redundant);
    });

// GpuLayerOptions::shared_stream: the shared expert inline or on its own stream gives the same
// bits (only where it runs changes); "auto" is inline here (normal mode, one rank); a bad name is
// refused.
TEST(GpuLayer, SharedStreamChoiceKeepsTheBits) {
  EPMOE_REQUIRE_GPU();
  const MoeConfig c = one_rank("tiny", 0);
  ASSERT_GT(c.num_shared_experts, 0);
  testing::SeededRng rng;
  auto w = gpu_synthetic(c, rng());
  const HostTensor x = synthetic_tokens(c, rng(), 0, 50);
  std::vector<HostTensor> ys;
  for (const char* where : {"own", "main", "auto"}) {
    cuda::GpuLayerOptions o;
    o.mode = Mode::normal;
    o.max_tokens = x.size(0);
    o.shared_stream = where;
    cuda::GpuMoeLayer layer(w, o);
    testing::LayerForward f = testing::layer_forward(layer, x, false);
    // The other choices are compared with the first alone: it must be right itself.
    if (ys.empty()) testing::expect_matches_reference(*w, x, f, "shared expert on its own stream");
    ys.push_back(std::move(f.y));
  }
  EXPECT_TRUE(same_bits<bf16>(ys[1], ys[0], "main against own"));
  EXPECT_TRUE(same_bits<bf16>(ys[2], ys[0], "auto against own"));
  cuda::GpuLayerOptions bad;
  bad.shared_stream = "side";
  testing::expect_error_mentions([&] { cuda::GpuMoeLayer layer(w, bad); }, "shared_stream");
}

// One layer in auto mode (both paths around one set of weights) gives each batch kind the bits of a
// layer of that kind's mode: prefill through the contiguous path (a batch over the low-latency
// buffers), decode through the masked path, eager and by graph replay; both kinds count their load.
class GpuLayerAutoMode : public ::testing::TestWithParam<std::tuple<const char*, QuantScheme>> {};

TEST_P(GpuLayerAutoMode, EachBatchKindGetsItsModesBits) {
  EPMOE_REQUIRE_GPU();
  const auto [preset, quant] = GetParam();
  const MoeConfig c = one_rank(preset, /*redundant=*/4, /*max_tokens=*/16, quant);
  testing::SeededRng rng;
  auto w = gpu_synthetic(c, rng());
  const std::int64_t prefill_tokens = 40, decode_tokens = 16;
  cuda::GpuLayerOptions o;
  o.mode = Mode::automatic;
  o.max_tokens = prefill_tokens;
  cuda::GpuMoeLayer layer(w, o);
  EXPECT_EQ(layer.max_tokens(), prefill_tokens);
  EXPECT_FALSE(layer.shared_expert_on_own_stream(BatchKind::prefill));  // "auto": inline in normal mode
  EXPECT_TRUE(layer.shared_expert_on_own_stream(BatchKind::decode));
  cuda::GpuLayerOptions on;
  on.mode = Mode::normal;
  on.max_tokens = prefill_tokens;
  cuda::GpuMoeLayer normal(w, on);
  cuda::GpuMoeLayer low_latency(w, {});

  const HostTensor xp = synthetic_tokens(c, rng(), 0, prefill_tokens),
                   xd = synthetic_tokens(c, rng(), 0, decode_tokens);
  const testing::LayerForward prefill = testing::layer_forward(layer, xp, false, {}, {}, BatchKind::prefill);
  testing::expect_matches_reference(*w, xp, prefill, "auto, prefill");
  EXPECT_TRUE(
      same_bits<bf16>(prefill.y, testing::layer_forward(normal, xp, false).y, "prefill against normal"));
  const testing::LayerForward decode = testing::layer_forward(layer, xd, false, {}, {}, BatchKind::decode);
  testing::expect_matches_reference(*w, xd, decode, "auto, decode");
  EXPECT_TRUE(same_bits<bf16>(decode.y, testing::layer_forward(low_latency, xd, false).y,
                              "decode against low-latency"));
  EXPECT_TRUE(same_bits<bf16>(testing::layer_forward(layer, xd, true).y, decode.y, "decode graph"));
  // A prefill forward between graph replays leaves the graph's buffers alone.
  EXPECT_TRUE(same_bits<bf16>(testing::layer_forward(layer, xp, false, {}, {}, BatchKind::prefill).y,
                              prefill.y, "prefill again"));
  EXPECT_TRUE(same_bits<bf16>(testing::layer_forward(layer, xd, true).y, decode.y, "decode graph replay"));
  EXPECT_EQ(layer.graphs_captured(), 1u);
  const std::vector<std::int64_t> load = layer.expert_load();
  EXPECT_EQ(std::accumulate(load.begin(), load.end(), std::int64_t{0}),
            (2 * prefill_tokens + 3 * decode_tokens) * c.topk);

  // Refusals: no batch kind; a decode batch over max_tokens_per_rank (eager or graph).
  DeviceTensor dx = cuda::to_device(xp, layer.stream()), dy(DType::bf16, {prefill_tokens, c.hidden});
  testing::expect_error_mentions([&] { layer.forward(dx, dy); }, "needs each forward's batch kind");
  testing::expect_error_mentions([&] { layer.forward(dx, dy, BatchKind::decode); },
                                 "max_tokens_per_rank = 16");
  testing::expect_error_mentions([&] { layer.forward_graph(dx, dy); }, "max_tokens_per_rank = 16");
  // A layer of one mode runs every kind in it, and has no other mode's graphs.
  EXPECT_TRUE(same_bits<bf16>(testing::layer_forward(normal, xp, false, {}, {}, BatchKind::decode).y,
                              prefill.y, "normal layer, decode kind"));
  testing::expect_error_mentions([&] { normal.forward_graph(dx, dy); },
                                 "CUDA graphs serve the low-latency mode");
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuLayerAutoMode,
                         ::testing::Values(std::tuple{"tiny", QuantScheme::fp8},
                                           std::tuple{"tiny", QuantScheme::w4a8},
                                           std::tuple{"deepseek-v3", QuantScheme::fp8}),
                         [](const auto& case_info) {
                           return std::string(std::get<0>(case_info.param)[0] == 't' ? "tiny" : "dsv3") +
                                  "_" + std::string(to_string(std::get<1>(case_info.param)));
                         });

// A one-rank tiny layer on synthetic weights, default options (the load and rebalance tests).
struct TinyLayer {
  explicit TinyLayer(std::uint64_t weights_seed) : w(gpu_synthetic(c, weights_seed)) {}
  MoeConfig c = one_rank("tiny", 4);
  std::shared_ptr<SyntheticWeights> w;
  cuda::GpuMoeLayer layer{w, {}};
};

// The per-expert load is counted per slot and folded through the placement it was counted under
// (cuda::count_experts on the physical ids): across a placement change, the same tokens (the same
// logical routing) count the same per expert again, wherever their slots moved.
TEST(GpuLayer, ExpertLoadSpansAPlacementChange) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  TinyLayer tiny(rng());
  const HostTensor x = synthetic_tokens(tiny.c, rng(), 0, 32);
  testing::layer_forward(tiny.layer, x, false);
  const std::vector<std::int64_t> once = tiny.layer.expert_load();
  EXPECT_EQ(std::accumulate(once.begin(), once.end(), std::int64_t{0}), 32 * tiny.c.topk);
  // Every logical expert in the reverse slot order.
  const int E = tiny.c.num_experts, P = tiny.c.num_physical_experts();
  std::vector<std::int32_t> phy2log(static_cast<std::size_t>(P));
  for (int s = 0; s < P; ++s) phy2log[static_cast<std::size_t>(s)] = E - 1 - s % E;
  EXPECT_GT(tiny.layer.set_placement(ExpertPlacement(phy2log, E, 1)), 0);
  testing::layer_forward(tiny.layer, x, false);
  const std::vector<std::int64_t> twice = tiny.layer.expert_load();
  ASSERT_EQ(twice.size(), once.size());
  for (std::size_t e = 0; e < once.size(); ++e) EXPECT_EQ(twice[e], 2 * once[e]) << "expert " << e;
  tiny.layer.reset_load();
  for (std::int64_t v : tiny.layer.expert_load()) EXPECT_EQ(v, 0);
}

// A placement change whose slots cannot all take their experts changes nothing: the slots rewritten
// before the refused one get their experts back, the tables and the placement stay, and the output keeps
// every bit (it used to keep the new experts in the early slots, and the refused slot half-written,
// under the old tables: wrong output, no error).
TEST(GpuLayer, ARefusedPlacementKeepsTheOldExpertsAndResults) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  const MoeConfig c = one_rank("tiny", 4);
  auto w = std::make_shared<testing::RefusingWeights>(gpu_synthetic(c, rng()));
  cuda::GpuMoeLayer layer(w, {});
  const HostTensor x = synthetic_tokens(c, rng(), 0, 32);
  const testing::LayerForward before = testing::layer_forward(layer, x, false);
  testing::expect_matches_reference(*w, x, before, "before the refused placement");
  const std::vector<std::int32_t> initial = layer.placement().phy2log();
  // Every logical expert in the reverse slot order; the expert bound for the middle slot is refused, so
  // the slots before it are rewritten first.
  const int E = c.num_experts, P = c.num_physical_experts();
  std::vector<std::int32_t> phy2log(static_cast<std::size_t>(P));
  for (int s = 0; s < P; ++s) phy2log[static_cast<std::size_t>(s)] = E - 1 - s % E;
  const ExpertPlacement reversed(phy2log, E, 1);
  w->refuse_once = phy2log[static_cast<std::size_t>(P / 2)];
  ASSERT_NE(initial[static_cast<std::size_t>(P / 2)], w->refuse_once);
  testing::expect_error_mentions([&] { layer.set_placement(reversed); }, "refused by the test");
  EXPECT_EQ(w->refuse_once, -1) << "the refused expert was never read: the test checks nothing";
  EXPECT_EQ(layer.placement().phy2log(), initial);
  EXPECT_TRUE(same_bits<bf16>(testing::layer_forward(layer, x, false).y, before.y, "after the refusal"));
  // The same placement, now that every expert loads: installed, same bits.
  EXPECT_GT(layer.set_placement(reversed), 0);
  EXPECT_TRUE(same_bits<bf16>(testing::layer_forward(layer, x, false).y, before.y, "after the placement"));
}

// A NaN in the correction bias would be picked first by every token's routing on the GPU (its order
// key is the largest): the layer refuses it at construction, as the CPU router does at each call.
TEST(GpuLayer, ANanCorrectionBiasIsRefused) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  const MoeConfig c = one_rank("tiny", 4);
  auto w = std::make_shared<testing::RefusingWeights>(gpu_synthetic(c, rng()));
  ASSERT_EQ(c.scoring, Scoring::sigmoid);
  const TensorView bias = w->correction_bias();
  w->bias_override = HostTensor(DType::f32, {bias.shape[0]});
  std::copy_n(bias.as<float>(), bias.shape[0], w->bias_override.view().as<float>());
  w->bias_override.view().as<float>()[3] = std::numeric_limits<float>::quiet_NaN();
  testing::expect_error_mentions([&] { cuda::GpuMoeLayer layer(w, {}); },
                                 "correction_bias must be finite, element 3");
}

TEST(GpuLayer, RebalanceMovesExpertsAndKeepsResults) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  TinyLayer tiny(rng());
  const HostTensor x = synthetic_tokens(tiny.c, rng(), 0, 32);
  const testing::LayerForward before = testing::layer_forward(tiny.layer, x, true);
  // The forwards after the rebalance are compared with this one alone: it must be right itself.
  testing::expect_matches_reference(*tiny.w, x, before, "graph before the rebalance");
  for (int i = 0; i < 3; ++i) testing::layer_forward(tiny.layer, x, true);
  const std::vector<std::int64_t> load = tiny.layer.expert_load();
  EXPECT_EQ(std::accumulate(load.begin(), load.end(), std::int64_t{0}),
            4 * 32 * tiny.c.topk);  // every (token, k) of four forwards counted once
  const int rewritten = tiny.layer.rebalance();
  EXPECT_GT(rewritten, 0);
  for (std::int64_t v : tiny.layer.expert_load()) EXPECT_EQ(v, 0);
  // The captured graph stays valid (slots rewritten in place) and gives the same bits.
  EXPECT_TRUE(
      same_bits<bf16>(testing::layer_forward(tiny.layer, x, true).y, before.y, "graph after rebalance"));
  EXPECT_TRUE(
      same_bits<bf16>(testing::layer_forward(tiny.layer, x, false).y, before.y, "eager after rebalance"));
}

// A rebalance that moves experts (DeepSeek's algorithm unchanged: slot cost 0) leaves every output
// bit as it was, in both modes and both quant schemes, at the tiny dims and DeepSeek-V3's with 32
// redundant slots; in low-latency mode through the graph captured before it too.
class GpuLayerRebalance : public ::testing::TestWithParam<LayerCase> {};

TEST_P(GpuLayerRebalance, MovedExpertsGiveTheSameBits) {
  EPMOE_REQUIRE_GPU();
  const LayerCase p = GetParam();
  const MoeConfig c = one_rank(p.preset, p.redundant, 32, p.quant);
  testing::SeededRng rng;
  auto w = gpu_synthetic(c, rng());
  cuda::GpuMoeLayer layer(w, options_for(p));
  const bool ll = p.mode == Mode::low_latency;
  const HostTensor x = synthetic_tokens(c, rng(), 0, p.tokens);
  const testing::LayerForward before = testing::layer_forward(layer, x, false);
  testing::expect_matches_reference(*w, x, before, "before the rebalance");
  if (ll) {
    EXPECT_TRUE(same_bits<bf16>(testing::layer_forward(layer, x, true).y, before.y, "graph before"));
  }
  const int rewritten = layer.rebalance(1, /*slot_cost_tokens=*/0.0);
  EXPECT_GT(rewritten, 0) << "the rebalance moved no expert: the test checks nothing";
  EXPECT_TRUE(same_bits<bf16>(testing::layer_forward(layer, x, false).y, before.y, "eager after"));
  if (ll) {
    EXPECT_TRUE(same_bits<bf16>(testing::layer_forward(layer, x, true).y, before.y, "graph after"));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuLayerRebalance,
                         ::testing::Values(LayerCase{"tiny", Mode::normal, 40, 4},
                                           LayerCase{"tiny", Mode::low_latency, 32, 4, QuantScheme::w4a8},
                                           LayerCase{"deepseek-v3", Mode::low_latency, 8, 32},
                                           LayerCase{"deepseek-v3", Mode::normal, 12, 32, QuantScheme::w4a8}),
                         [](const auto& case_info) {
                           return std::string(case_info.param.preset[0] == 't' ? "tiny" : "dsv3") + "_" +
                                  std::string(to_string(case_info.param.quant)) + "_" +
                                  (case_info.param.mode == Mode::normal ? "normal" : "ll");
                         });

// capture_graphs with a list of batch sizes (as an engine's --cuda-graph-bs): one graph each, and
// every replay gives the eager forward's bits for its size, in any order.
TEST(GpuLayer, GraphsCapturedForAListOfBatchSizes) {
  EPMOE_REQUIRE_GPU();
  const MoeConfig c = one_rank("tiny", 4);
  testing::SeededRng rng;
  auto w = gpu_synthetic(c, rng());
  cuda::GpuMoeLayer layer(w, {});
  const std::int64_t sizes[] = {1, 7, 32, 0};
  layer.capture_graphs(sizes);
  EXPECT_EQ(layer.graphs_captured(), 4u);
  for (const std::int64_t T : {32, 1, 7, 0, 32}) {
    SCOPED_TRACE("T = " + std::to_string(T));
    const HostTensor x = synthetic_tokens(c, rng(), 0, T);
    const testing::LayerForward eager = testing::layer_forward(layer, x, false);
    // The replay is compared with the eager forward alone: it must be right itself (an empty batch
    // has nothing to compare).
    if (T > 0) testing::expect_matches_reference(*w, x, eager, "eager forward");
    EXPECT_TRUE(same_bits<bf16>(testing::layer_forward(layer, x, true).y, eager.y, "replay"));
  }
  EXPECT_EQ(layer.graphs_captured(), 4u);  // no capture on the way
  const std::int64_t too_big[] = {c.max_tokens_per_rank + 1};
  testing::expect_error_mentions([&] { layer.capture_graphs(too_big); }, "graph batch size");
}

// A timed eager forward's spans (what `epmoe run --trace` draws): in order on the main stream, inside
// the forward, the second micro-batch absent without two-batch overlap; an untimed forward leaves them.
TEST(GpuLayer, TimedForwardRecordsItsPhaseSpans) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  for (const Mode mode : {Mode::low_latency, Mode::normal}) {
    SCOPED_TRACE(std::string(to_string(mode)));
    const MoeConfig c = one_rank("tiny", 4);
    auto w = gpu_synthetic(c, rng());
    cuda::GpuLayerOptions o;
    o.mode = mode;
    o.timing = true;
    cuda::GpuMoeLayer layer(w, o);
    const HostTensor x = synthetic_tokens(c, rng(), 0, 24);
    const testing::LayerForward f = testing::layer_forward(layer, x, false);
    testing::expect_matches_reference(*w, x, f, "timed forward");
    const cuda::GpuForwardSpans sp = layer.last_spans();
    const double end = sp.total[1];
    EXPECT_GT(end, 0.0);
    EXPECT_EQ(sp.route[0], 0.0);
    const std::array<double, 8> chain = {sp.route[0],   sp.route[1],   sp.dispatch[0][0], sp.dispatch[0][1],
                                         sp.gemm[0][0], sp.gemm[0][1], sp.combine[0][0],  sp.combine[0][1]};
    for (std::size_t i = 1; i < chain.size(); ++i) EXPECT_LE(chain[i - 1], chain[i]) << "span edge " << i;
    EXPECT_LE(chain.back(), end);
    EXPECT_EQ(sp.dispatch[1][0], -1.0);
    EXPECT_EQ(sp.gemm[1][0], -1.0);
    EXPECT_FALSE(sp.gemm_on_compute_stream);
    EXPECT_GE(sp.shared[0], 0.0);
    EXPECT_LE(sp.shared[1], end);
    EXPECT_EQ(sp.shared_on_own_stream, layer.shared_expert_on_own_stream());
    EXPECT_EQ(layer.times().forwards, 1);
    layer.set_timing(false);
    testing::layer_forward(layer, x, false);
    EXPECT_EQ(layer.last_spans().total[1], end) << "an untimed forward changed the spans";
  }
}

TEST(GpuLayer, GemmsAloneAreTimedWithoutChangingTheNextForward) {
  EPMOE_REQUIRE_GPU();
  const MoeConfig c = one_rank("tiny");
  testing::SeededRng rng;
  auto w = gpu_synthetic(c, rng());
  cuda::GpuLayerOptions o;
  o.mode = Mode::normal;
  cuda::GpuMoeLayer layer(w, o);
  testing::expect_error_mentions([&] { layer.time_gemms_alone(); }, "eager forward");
  const HostTensor x = synthetic_tokens(c, rng(), 0, 20);
  const testing::LayerForward first = testing::layer_forward(layer, x, false);
  // The forward after the timing is compared with this one alone: it must be right itself.
  testing::expect_matches_reference(*w, x, first, "forward before the timing");
  testing::expect_error_mentions([&] { layer.time_gemms_alone(0); }, "reps");
  const cuda::GpuMoeLayer::GemmTimes t = layer.time_gemms_alone(3);
  EXPECT_GT(t.routed_ms, 0.0);
  EXPECT_GT(t.shared_ms, 0.0);
  EXPECT_TRUE(
      same_bits<bf16>(testing::layer_forward(layer, x, false).y, first.y, "forward after the timing"));
}

// Random batches through a fresh layer per draw (a fresh seed per run, in the failure message): the tiny
// model mostly and DeepSeek-V3 dims at a few tokens, either mode and quant, 0 or some redundant slots, the
// shared expert inline or on its own stream, a buffer of 1-64 tokens and a batch of 0 to all of them (0: a
// forward that writes nothing), and one token past the buffer now and then, which is refused. Each forward
// against the CPU reference, again for the same bits, and by graph replay in low-latency mode.
TEST(GpuLayerSweep, RandomBatchesMatchTheReference) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  const auto uniform = [&](std::int64_t lo, std::int64_t hi) { return testing::uniform(rng, lo, hi); };
  for (int i = 0; i < 8; ++i) {
    const bool dsv3 = uniform(0, 3) == 0;
    const Mode mode = uniform(0, 1) == 0 ? Mode::low_latency : Mode::normal;
    const QuantScheme quant = uniform(0, 1) == 0 ? QuantScheme::fp8 : QuantScheme::w4a8;
    const int redundant = uniform(0, 1) == 0 ? 0 : (dsv3 ? 32 : 4);
    const std::int64_t max_tokens = dsv3 ? uniform(1, 8) : std::int64_t{1} << uniform(0, 6);
    // (An empty batch in one draw of five.)
    const std::int64_t tokens =
        uniform(0, 4) == 0 ? 0 : std::min(uniform(1, max_tokens), dsv3 ? std::int64_t{6} : max_tokens);
    const bool over = uniform(0, 4) == 0;
    const char* shared = uniform(0, 1) == 0 ? "own" : "main";
    std::ostringstream what;
    what << "draw " << i << ": " << (dsv3 ? "deepseek-v3" : "tiny") << ", "
         << (mode == Mode::normal ? "normal" : "low-latency") << ", " << to_string(quant) << ", " << redundant
         << " redundant slots, buffer " << max_tokens << " tokens, batch " << tokens << ", shared expert "
         << shared << (over ? ", then one past the buffer" : "");
    SCOPED_TRACE(what.str());
    std::printf("  %s\n", what.str().c_str());
    const MoeConfig c =
        one_rank(dsv3 ? "deepseek-v3" : "tiny", redundant, static_cast<int>(max_tokens), quant);
    auto w = gpu_synthetic(c, rng());
    cuda::GpuLayerOptions o;
    o.mode = mode;
    o.max_tokens = max_tokens;
    o.shared_stream = shared;
    cuda::GpuMoeLayer layer(w, o);
    const HostTensor x = synthetic_tokens(c, rng(), 0, tokens);
    const testing::LayerForward eager = testing::layer_forward(layer, x, false);
    if (tokens > 0) testing::expect_matches_reference(*w, x, eager, "eager forward");
    EXPECT_TRUE(same_bits<bf16>(testing::layer_forward(layer, x, false).y, eager.y, "eager repeat"));
    if (mode == Mode::low_latency) {
      EXPECT_TRUE(same_bits<bf16>(testing::layer_forward(layer, x, true).y, eager.y, "graph replay"));
    }
    if (over) {
      DeviceTensor big_x(DType::bf16, {max_tokens + 1, c.hidden}),
          big_y(DType::bf16, {max_tokens + 1, c.hidden});
      testing::expect_error_mentions([&] { layer.forward(big_x, big_y); }, "max_tokens");
    }
  }
}

TEST(GpuLayer, RefusesBadInput) {
  EPMOE_REQUIRE_GPU();
  const MoeConfig c = one_rank("tiny");
  auto w = gpu_synthetic(c, 1);
  cuda::GpuMoeLayer layer(w, {});
  DeviceTensor x(DType::bf16, {33, c.hidden}), y(DType::bf16, {33, c.hidden});
  testing::expect_error_mentions([&] { layer.forward(x, y); }, "max_tokens");
  DeviceTensor xf(DType::f32, {4, c.hidden});
  testing::expect_error_mentions([&] { layer.forward(xf, y.view().slice_rows(0, 4)); }, "x");
  MoeConfig q = c;
  q.quant = QuantScheme::none;
  testing::expect_error_mentions([&] { cuda::GpuMoeLayer bad(std::make_shared<SyntheticWeights>(q, 1), {}); },
                                 "none");
  cuda::GpuLayerOptions big;
  big.max_tokens = 64;
  testing::expect_error_mentions([&] { cuda::GpuMoeLayer bad(w, big); }, "max_tokens_per_rank");
  // Dispatchers by name: the registered GPU ones, not the CPU simulation's; on one rank only "local".
  for (const char* name : {"nope", "cpu-sim"}) {
    cuda::GpuLayerOptions named;
    named.dispatcher = name;
    testing::expect_error_mentions([&] { cuda::GpuMoeLayer bad(w, named); },
                                   "dispatcher must be one of auto, local");
  }
  cuda::GpuLayerOptions nvlink;
  nvlink.dispatcher = "nvlink";
  testing::expect_error_mentions([&] { cuda::GpuMoeLayer bad(w, nvlink); },
                                 "'local' serves exactly one rank");
}

}  // namespace
}  // namespace epmoe
