// The whole layer on the CPU: the N-rank simulation against the direct reference, rank-count
// independence, EPLB placements and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <tuple>
#include <vector>

#include "epmoe/layer.hpp"
#include "expect_error.hpp"
#include "test_random.hpp"

namespace epmoe {
namespace {

MoeConfig tiny(int ranks, QuantScheme quant, int redundant = 0) {
  MoeConfig c = MoeConfig::preset("tiny");
  c.num_ranks = ranks;
  c.quant = quant;
  c.num_redundant_experts = redundant;
  return c;
}

struct Batch {
  std::vector<HostTensor> x, y;
  std::vector<TensorView> xv, yv;
};

Batch make_batch(const MoeConfig& c, const std::vector<std::int64_t>& tokens, std::uint64_t seed) {
  Batch b;
  for (std::size_t r = 0; r < tokens.size(); ++r) {
    b.x.push_back(synthetic_tokens(c, seed, static_cast<int>(r), tokens[r]));
    b.y.emplace_back(DType::bf16, std::initializer_list<std::int64_t>{tokens[r], c.hidden});
    b.y.back().fill_bytes(0xff);  // poison: bf16 NaN
  }
  for (auto& t : b.x) b.xv.push_back(t);
  for (auto& t : b.y) b.yv.push_back(t);
  return b;
}

ErrorReport check(const ModelWeights& w, const Batch& b, Numerics numerics = Numerics::mirror) {
  double worst = 0;
  ErrorReport worst_report;
  for (std::size_t r = 0; r < b.x.size(); ++r) {
    HostTensor expected(numerics == Numerics::mirror ? DType::bf16 : DType::f64,
                        {b.x[r].size(0), w.config().hidden});
    reference_forward(w, b.x[r], expected, numerics);
    const ErrorReport e = compare(b.y[r], expected);
    EXPECT_EQ(e.non_finite, 0) << "rank " << r;
    if (e.rel_l2 >= worst) {
      worst = e.rel_l2;
      worst_report = e;
    }
  }
  return worst_report;
}

// A rebalance over the load `counted` (per logical expert) that the test relies on to move work: it
// changed the placement and unloaded the busiest rank, by the model EPLB packs on. One that kept the
// placement would leave "the same results from other slots" untested.
void expect_rebalance_moved_experts(const ExpertPlacement& before, const ExpertPlacement& after,
                                    const std::vector<std::int64_t>& counted) {
  EXPECT_NE(after.phy2log(), before.phy2log()) << "the rebalance kept the placement";
  const std::vector<double> load(counted.begin(), counted.end());
  EXPECT_LT(busiest_rank_load(after, load), busiest_rank_load(before, load));
}

// A placement that serves `counted` (per logical expert) badly: rank 0's slots hold the busiest experts,
// the other slots the rest, then the idlest again. A rebalance from it must move experts, where from the
// initial placement it may rightly keep it (a random load that placement already serves best: ~5% of
// the seeds of AutoModeServesPrefillAndDecodeWithOneLayer).
ExpertPlacement busiest_experts_on_rank_zero(const MoeConfig& c, const std::vector<std::int64_t>& counted) {
  std::vector<std::int32_t> by_load(static_cast<std::size_t>(c.num_experts));
  std::iota(by_load.begin(), by_load.end(), 0);
  std::stable_sort(by_load.begin(), by_load.end(), [&](std::int32_t a, std::int32_t b) {
    return counted[static_cast<std::size_t>(a)] > counted[static_cast<std::size_t>(b)];
  });
  std::vector<std::int32_t> phy2log;
  for (int s = 0; s < c.num_physical_experts(); ++s)
    phy2log.push_back(s < c.num_experts
                          ? by_load[static_cast<std::size_t>(s)]
                          : by_load[static_cast<std::size_t>(c.num_experts - 1 - (s - c.num_experts))]);
  return ExpertPlacement(phy2log, c.num_experts, c.num_ranks);
}

class LayerVsReference : public ::testing::TestWithParam<std::tuple<int, Mode, QuantScheme>> {};

TEST_P(LayerVsReference, WithinTolerance) {
  const auto [ranks, mode, quant] = GetParam();
  const MoeConfig c = tiny(ranks, quant);
  testing::SeededRng rng;
  auto w = std::make_shared<SyntheticWeights>(c, rng());
  MoeLayer layer(w, {mode});
  std::vector<std::int64_t> tokens;
  for (int r = 0; r < ranks; ++r)
    tokens.push_back(r == ranks - 1 && ranks > 1 ? 0 : 13 + 3 * r);  // one rank idle
  Batch b = make_batch(c, tokens, rng());
  ForwardStats stats;
  layer.forward(b.xv, b.yv, &stats);
  const ErrorReport e = check(*w, b);
  EXPECT_LE(e.rel_l2, 1e-2);
  EXPECT_LE(e.calc_diff, 1e-2);
  // The mirrored pipeline differs from the reference only in summation order: far below tolerance.
  EXPECT_LE(e.rel_l2, 5e-3);
  // And the quantized pipeline is close to f64 arithmetic on the same quantized inputs.
  const ErrorReport exact = check(*w, b, Numerics::exact);
  EXPECT_LE(exact.rel_l2, quant == QuantScheme::none ? 2e-2 : 8e-2);
  std::int64_t rows = 0;
  for (std::int64_t n : stats.rows_per_rank) rows += n;
  std::int64_t all_tokens = 0;
  for (std::int64_t t : tokens) all_tokens += t;
  EXPECT_EQ(rows, all_tokens * c.topk);
}

INSTANTIATE_TEST_SUITE_P(
    Tiny, LayerVsReference,
    ::testing::Combine(::testing::Values(1, 2, 4), ::testing::Values(Mode::normal, Mode::low_latency),
                       ::testing::Values(QuantScheme::fp8, QuantScheme::w4a8, QuantScheme::none)),
    [](const auto& test_info) {
      return fmt::format("ranks{}_{}_{}", std::get<0>(test_info.param),
                         std::get<1>(test_info.param) == Mode::normal ? "normal" : "low_latency",
                         to_string(std::get<2>(test_info.param)));
    });

TEST(Layer, LocalDispatcherMatchesReference) {
  const MoeConfig c = tiny(1, QuantScheme::fp8);
  testing::SeededRng rng;
  auto w = std::make_shared<SyntheticWeights>(c, rng());
  LayerOptions o;
  o.dispatcher = "cpu-local";
  MoeLayer layer(w, o);
  Batch b = make_batch(c, {21}, rng());
  layer.forward(b.xv, b.yv);
  EXPECT_LE(check(*w, b).rel_l2, 5e-3);
}

TEST(Layer, ResultsDoNotDependOnRankCount) {
  // The same 64 tokens split over 1, 2, 4 and 8 ranks give the same outputs up to rounding.
  const std::int64_t total = 64;
  std::vector<HostTensor> outputs;
  const MoeConfig c1 = tiny(1, QuantScheme::fp8);
  testing::SeededRng rng;
  HostTensor all = synthetic_tokens(c1, rng(), 0, total);
  const std::uint64_t weights_seed = rng();  // the same model at every rank count
  for (int ranks : {1, 2, 4, 8}) {
    const MoeConfig c = tiny(ranks, QuantScheme::fp8);
    auto w = std::make_shared<SyntheticWeights>(c, weights_seed);
    MoeLayer layer(w, {Mode::normal});
    HostTensor y(DType::bf16, {total, c.hidden});
    y.fill_bytes(0xff);
    std::vector<TensorView> xv, yv;
    const std::int64_t per = total / ranks;
    for (int r = 0; r < ranks; ++r) {
      xv.push_back(all.view().slice_rows(r * per, (r + 1) * per));
      yv.push_back(y.view().slice_rows(r * per, (r + 1) * per));
    }
    layer.forward(xv, yv);
    outputs.push_back(std::move(y));
  }
  for (std::size_t i = 1; i < outputs.size(); ++i) {
    const ErrorReport e = compare(outputs[i], outputs[0]);
    EXPECT_EQ(e.non_finite, 0);
    EXPECT_LE(e.rel_l2, 5e-3) << "split " << i;
  }
}

TEST(Layer, RedundantExpertsDynamicChoiceAndRebalance) {
  MoeConfig c = tiny(4, QuantScheme::fp8, /*redundant=*/4);
  c.dispatch_algorithm = DispatchAlgorithm::dynamic_choice;
  testing::SeededRng rng;
  auto w = std::make_shared<SyntheticWeights>(c, rng());
  MoeLayer layer(w, {Mode::low_latency});
  const std::uint64_t batch_seed = rng();
  Batch b = make_batch(c, {32, 32, 32, 32}, batch_seed);
  layer.forward(b.xv, b.yv);
  EXPECT_LE(check(*w, b).rel_l2, 5e-3);
  const std::vector<std::int64_t> load = layer.expert_load();
  std::int64_t counted = 0;
  for (std::int64_t n : load) counted += n;
  EXPECT_EQ(counted, 4 * 32 * c.topk);

  const ExpertPlacement before = layer.placement();
  layer.rebalance();
  for (std::int64_t n : layer.expert_load()) EXPECT_EQ(n, 0);
  EXPECT_EQ(layer.placement().num_physical(), c.num_physical_experts());
  expect_rebalance_moved_experts(before, layer.placement(), load);
  Batch again = make_batch(c, {32, 32, 32, 32}, batch_seed);
  layer.forward(again.xv, again.yv);
  EXPECT_LE(check(*w, again).rel_l2, 5e-3);
  const ErrorReport same = compare(again.y[0], b.y[0]);
  EXPECT_LE(same.rel_l2, 5e-3);  // a placement change moves work, not results
}

TEST(Layer, BadInputIsRefusedWithClearMessages) {
  const MoeConfig c = tiny(2, QuantScheme::fp8);
  testing::SeededRng rng;
  auto w = std::make_shared<SyntheticWeights>(c, rng());
  MoeLayer layer(w, {Mode::low_latency});
  {
    Batch b = make_batch(c, {c.max_tokens_per_rank + 1, 1}, rng());
    try {
      layer.forward(b.xv, b.yv);
      FAIL() << "expected a throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("max_tokens_per_rank"), std::string::npos) << e.what();
    }
  }
  {
    Batch b = make_batch(c, {4, 4}, rng());
    b.x[1].data<bf16>()[17] = bf16::from_bits(0x7fc0);  // NaN
    try {
      layer.forward(b.xv, b.yv);
      FAIL() << "expected a throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1 x must be finite"), std::string::npos) << e.what();
    }
  }
  {
    // Finite x too large for the layer's bf16 sums: an error naming it, in the layer and in the reference
    // (both numerics), never an output of Inf / NaN. Mirror numerics stop at the f32 SiLU product; exact
    // numerics (f64 inside) at the bf16 output.
    Batch b = make_batch(c, {4, 4}, rng());
    for (auto& x : b.x)
      for (std::int64_t i = 0; i < x.numel(); ++i)
        x.data<bf16>()[i] = bf16::from_float(x.data<bf16>()[i].to_float() * 1e20f);
    const std::string silu = "silu(gate) * up is not finite";
    const std::string overflow = "y (the layer's output; x is too large for bf16) must be finite";
    const std::vector<std::int64_t> load_before = layer.expert_load();
    testing::expect_error_mentions([&] { layer.forward(b.xv, b.yv); }, silu);
    EXPECT_EQ(layer.expert_load(), load_before);  // a forward that failed is not counted
    MoeLayer exact_layer(w, {Mode::low_latency, Device::cpu, Numerics::exact});
    testing::expect_error_mentions([&] { exact_layer.forward(b.xv, b.yv); }, "rank 0 " + overflow);
    for (std::int64_t n : exact_layer.expert_load()) EXPECT_EQ(n, 0);
    HostTensor y16(DType::bf16, {4, c.hidden}), y64(DType::f64, {4, c.hidden});
    testing::expect_error_mentions([&] { reference_forward(*w, b.x[0], y16, Numerics::mirror); }, silu);
    testing::expect_error_mentions([&] { reference_forward(*w, b.x[0], y16, Numerics::exact); }, overflow);
    EXPECT_NO_THROW(reference_forward(*w, b.x[0], y64, Numerics::exact));  // f64 holds it
    // A device y is refused, and the batch is not counted.
    Batch ok = make_batch(c, {4, 4}, rng());
    ok.yv[1].device = Device::cuda;
    testing::expect_error_mentions([&] { layer.forward(ok.xv, ok.yv); }, "rank 1 y must live on cpu");
    EXPECT_EQ(layer.expert_load(), load_before);
    TensorView on_gpu = y16;  // compare reads both on the host
    on_gpu.device = Device::cuda;
    testing::expect_error_mentions([&] { (void)compare(on_gpu, y64); }, "actual must live on cpu");
    testing::expect_error_mentions([&] { (void)compare(y64, on_gpu); }, "expected must live on cpu");
  }
  {
    Batch b = make_batch(c, {4, 4}, rng());
    HostTensor wrong(DType::bf16, {4, c.hidden + 128});
    b.xv[0] = wrong;
    EXPECT_THROW(layer.forward(b.xv, b.yv), Error);
    b = make_batch(c, {4}, rng());
    EXPECT_THROW(layer.forward(b.xv, b.yv), Error);  // one rank missing
  }
  MoeConfig bad = c;
  bad.hidden = 200;
  try {
    bad.validate();
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("hidden must be a positive multiple of 128"), std::string::npos)
        << e.what();
  }
}

// design.md §8's 1e-2 and the allowances layer_tolerance documents (few tokens; narrow rows).
TEST(Layer, ToleranceRule) {
  const MoeConfig dsv3 = MoeConfig::preset("deepseek-v3"), narrow = MoeConfig::preset("tiny");
  EXPECT_EQ(layer_tolerance(dsv3, 16), 1e-2);
  EXPECT_EQ(layer_tolerance(dsv3, 4096), 1e-2);
  EXPECT_EQ(layer_tolerance(dsv3, 15), 1.5e-2);
  EXPECT_EQ(layer_tolerance(narrow, 16), 2e-2);
  EXPECT_EQ(layer_tolerance(narrow, 2), 3e-2);
}

TEST(Layer, ModeNamesAndTheirResolution) {
  EXPECT_EQ(parse_mode("auto"), Mode::automatic);
  EXPECT_EQ(parse_mode("low-latency"), Mode::low_latency);
  EXPECT_EQ(to_string(Mode::automatic), "auto");
  EXPECT_EQ(parse_mode(to_string(Mode::low_latency)), Mode::low_latency);
  EXPECT_EQ(parse_batch_kind("prefill"), BatchKind::prefill);
  EXPECT_EQ(to_string(BatchKind::decode), "decode");
  EXPECT_THROW(parse_batch_kind("extend"), Error);
  EXPECT_EQ(resolve_mode(Mode::automatic, BatchKind::prefill), Mode::normal);
  EXPECT_EQ(resolve_mode(Mode::automatic, BatchKind::decode), Mode::low_latency);
  for (const BatchKind kind : {BatchKind::prefill, BatchKind::decode}) {
    EXPECT_EQ(resolve_mode(Mode::normal, kind), Mode::normal);
    EXPECT_EQ(resolve_mode(Mode::low_latency, kind), Mode::low_latency);
  }
  // A dispatcher serves one mode: auto is the layer's to resolve.
  const MoeConfig c = tiny(2, QuantScheme::fp8);
  try {
    (void)make_dispatcher("cpu-sim", {c, Mode::automatic, ActivationFormat::fp8_group, 0, 2});
    FAIL() << "expected a throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mode must be normal or low-latency, got auto"), std::string::npos)
        << e.what();
  }
}

// One layer in auto mode serves prefill batches in normal mode and decode batches in low-latency mode,
// with the same bits as a layer of each mode, and counts both kinds' load.
TEST(Layer, AutoModeServesPrefillAndDecodeWithOneLayer) {
  MoeConfig c = tiny(2, QuantScheme::fp8, /*redundant=*/2);
  c.max_tokens_per_rank = 16;
  testing::SeededRng rng;
  auto w = std::make_shared<SyntheticWeights>(c, rng());
  MoeLayer layer(w, {Mode::automatic});
  MoeLayer normal(w, {Mode::normal}), low_latency(w, {Mode::low_latency});

  // A prefill batch larger than the low-latency buffers, then a decode batch.
  const std::uint64_t prefill_seed = rng(), decode_seed = rng();
  Batch prefill = make_batch(c, {40, 23}, prefill_seed),
        prefill_fixed = make_batch(c, {40, 23}, prefill_seed);
  ForwardStats stats;
  layer.forward(prefill.xv, prefill.yv, BatchKind::prefill, &stats);
  EXPECT_EQ(stats.mode, Mode::normal);
  normal.forward(prefill_fixed.xv, prefill_fixed.yv, BatchKind::decode);  // a fixed mode serves every kind
  EXPECT_LE(check(*w, prefill).rel_l2, 5e-3);
  Batch decode = make_batch(c, {16, 5}, decode_seed), decode_fixed = make_batch(c, {16, 5}, decode_seed);
  layer.forward(decode.xv, decode.yv, BatchKind::decode, &stats);
  EXPECT_EQ(stats.mode, Mode::low_latency);
  low_latency.forward(decode_fixed.xv, decode_fixed.yv);
  EXPECT_LE(check(*w, decode).rel_l2, 5e-3);
  for (int r = 0; r < 2; ++r) {
    const std::size_t n = static_cast<std::size_t>(prefill.y[r].nbytes());
    EXPECT_EQ(std::memcmp(prefill.y[r].data<bf16>(), prefill_fixed.y[r].data<bf16>(), n), 0) << "rank " << r;
    const std::size_t m = static_cast<std::size_t>(decode.y[r].nbytes());
    EXPECT_EQ(std::memcmp(decode.y[r].data<bf16>(), decode_fixed.y[r].data<bf16>(), m), 0) << "rank " << r;
  }
  const std::vector<std::int64_t> load = layer.expert_load();
  std::int64_t counted = 0;
  for (std::int64_t n : load) counted += n;
  EXPECT_EQ(counted, (40 + 23 + 16 + 5) * c.topk);

  // A rebalance serves both kinds: same results, other slots. (From a placement that serves this load
  // badly, so that the rebalance must move experts.)
  layer.set_placement(busiest_experts_on_rank_zero(c, load));
  const ExpertPlacement before = layer.placement();
  layer.rebalance();
  expect_rebalance_moved_experts(before, layer.placement(), load);
  Batch again = make_batch(c, {16, 5}, decode_seed);
  layer.forward(again.xv, again.yv, BatchKind::decode);
  EXPECT_LE(compare(again.y[0], decode.y[0]).rel_l2, 5e-3);
  EXPECT_LE(check(*w, again).rel_l2, 5e-3);

  // Refusals: no batch kind, and a decode batch over the low-latency buffers.
  try {
    layer.forward(decode.xv, decode.yv);
    FAIL() << "expected a throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs each forward's batch kind"), std::string::npos) << e.what();
  }
  Batch big = make_batch(c, {17, 1}, rng());
  try {
    layer.forward(big.xv, big.yv, BatchKind::decode);
    FAIL() << "expected a throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_tokens_per_rank = 16"), std::string::npos) << e.what();
  }
  layer.forward(big.xv, big.yv, BatchKind::prefill);  // the same batch as a prefill batch is fine
  EXPECT_LE(check(*w, big).rel_l2, 5e-3);
}

// Normal mode without a host sync: the layout at its bound (the CPU runner finds each expert's rows
// from m_indices alone) gives the same bits.
TEST(Layer, NormalModeWithoutAHostSyncGivesTheSameBits) {
  for (const QuantScheme quant : {QuantScheme::fp8, QuantScheme::w4a8}) {
    SCOPED_TRACE(to_string(quant));
    const MoeConfig c = tiny(4, quant, /*redundant=*/4);
    testing::SeededRng rng;
    auto w = std::make_shared<SyntheticWeights>(c, rng());
    LayerOptions no_sync;
    no_sync.host_sync = false;
    MoeLayer exact(w, {Mode::normal}), bound(w, no_sync);
    const std::uint64_t batch_seed = rng();
    Batch a = make_batch(c, {c.max_tokens_per_rank, 9, 0, 31}, batch_seed),
          b = make_batch(c, {c.max_tokens_per_rank, 9, 0, 31}, batch_seed);
    exact.forward(a.xv, a.yv);
    bound.forward(b.xv, b.yv);
    for (int r = 0; r < 4; ++r)
      EXPECT_EQ(
          std::memcmp(a.y[r].data<bf16>(), b.y[r].data<bf16>(), static_cast<std::size_t>(a.y[r].nbytes())), 0)
          << "rank " << r;
    EXPECT_LE(check(*w, b).rel_l2, 5e-3);
    // The bound needs T <= max_tokens_per_rank: refused before the load counters see the batch.
    const std::vector<std::int64_t> load = bound.expert_load();
    Batch big = make_batch(c, {c.max_tokens_per_rank + 1, 1, 1, 1}, rng());
    try {
      bound.forward(big.xv, big.yv);
      FAIL() << "expected a throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("without a host sync"), std::string::npos) << e.what();
    }
    EXPECT_EQ(bound.expert_load(), load);
  }
}

TEST(Layer, DeepSeekV3DimsFewTokensTwoRanks) {
  // The real dims, a couple of tokens: only the experts touched are built.
  MoeConfig c = MoeConfig::preset("deepseek-v3");
  c.num_ranks = 2;
  testing::SeededRng rng;
  auto w = std::make_shared<SyntheticWeights>(c, rng());
  MoeLayer layer(w, {Mode::low_latency});
  Batch b = make_batch(c, {1, 1}, rng());
  layer.forward(b.xv, b.yv);
  EXPECT_LE(check(*w, b).rel_l2, 5e-3);
  EXPECT_LE(w->experts_built(), static_cast<std::size_t>(2 * c.topk));
}

}  // namespace
}  // namespace epmoe
