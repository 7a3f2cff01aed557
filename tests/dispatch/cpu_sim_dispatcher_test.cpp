// The N-rank simulation's dispatch/combine semantics (design.md §6).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "epmoe/dispatch.hpp"
#include "epmoe/permute.hpp"
#include "epmoe/quant.hpp"
#include "expect_error.hpp"
#include "test_random.hpp"

namespace epmoe {
namespace {

struct RankBatch {
  HostTensor x, scales, ids, weights;
};

// Random fp8 tokens with random distinct physical ids per token, drawn from the first id_pool slots
// (0: all of them; fewer concentrate the tokens on a few experts).
std::vector<RankBatch> make_batches(const MoeConfig& c, const std::vector<std::int64_t>& tokens,
                                    std::uint32_t seed, ActivationFormat format, int id_pool = 0) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> val(-3.0f, 3.0f);
  std::uniform_int_distribution<int> slot(0, (id_pool > 0 ? id_pool : c.num_physical_experts()) - 1);
  std::vector<RankBatch> out;
  for (std::int64_t T : tokens) {
    RankBatch b;
    HostTensor xf(DType::f32, {T, c.hidden});
    for (std::int64_t i = 0; i < xf.numel(); ++i) xf.data<float>()[i] = val(rng);
    if (format == ActivationFormat::bf16) {
      b.x = to_bf16(xf);
    } else {
      b.x = HostTensor(DType::fp8_e4m3, {T, c.hidden});
      b.scales = HostTensor(DType::f32, {T, c.hidden / 128});
      quantize_per_token_group_fp8(xf, b.x, b.scales);
    }
    b.ids = HostTensor(DType::i32, {T, c.topk});
    b.weights = HostTensor(DType::f32, {T, c.topk});
    for (std::int64_t t = 0; t < T; ++t) {
      std::set<int> used;
      for (int k = 0; k < c.topk; ++k) {
        int id;
        do id = slot(rng);
        while (used.count(id));
        used.insert(id);
        b.ids.data<std::int32_t>()[t * c.topk + k] = id;
        b.weights.data<float>()[t * c.topk + k] = 0.1f + 0.2f * static_cast<float>(k);
      }
    }
    out.push_back(std::move(b));
  }
  return out;
}

std::vector<DispatchInput> inputs_of(const std::vector<RankBatch>& batches) {
  std::vector<DispatchInput> in;
  for (const RankBatch& b : batches) in.push_back({b.x, b.scales, 1.0f, b.ids, b.weights});
  return in;
}

MoeConfig tiny(int ranks, int redundant = 0) {
  MoeConfig c = MoeConfig::preset("tiny");
  c.num_ranks = ranks;
  c.num_redundant_experts = redundant;
  return c;
}

// Dispatches `batches` (fp8_group, one per rank) through the simulation and checks that every
// (token, k) reaches its expert exactly once, with its bytes and weight, in the mode's layout, and that
// each token goes at most once to each other rank.
void expect_every_token_k_once(const MoeConfig& c, Mode mode, const std::vector<RankBatch>& batches) {
  const int ranks = c.num_ranks;
  std::vector<std::int64_t> tokens;
  for (const RankBatch& b : batches) tokens.push_back(b.x.size(0));
  auto dispatcher = make_dispatcher("cpu-sim", {c, mode, ActivationFormat::fp8_group, 0, ranks});
  std::vector<DispatchOutput> outs(static_cast<std::size_t>(ranks));
  dispatcher->dispatch(inputs_of(batches), outs);

  const int L = c.num_local_experts(), K = c.topk;
  const std::int64_t H = c.hidden;
  // (src rank, token, k) -> times seen
  std::map<std::tuple<int, std::int64_t, int>, int> seen;
  for (int dst = 0; dst < ranks; ++dst) {
    const DispatchOutput& o = outs[static_cast<std::size_t>(dst)];
    EXPECT_EQ(o.layout, mode == Mode::normal ? Layout::contiguous : Layout::masked);
    const std::int64_t rows = o.num_output_rows();
    for (std::int64_t row = 0; row < rows; ++row) {
      const std::int32_t recv = o.row_token.as<std::int32_t>()[row];
      int expert;
      if (o.layout == Layout::contiguous) {
        expert = o.m_indices.as<std::int32_t>()[row];
        EXPECT_EQ(expert < 0, recv < 0);
      } else {
        const std::int64_t M = o.rows.size(1);
        expert = static_cast<int>(row / M);
        const bool valid = row % M < o.masked_m.as<std::int32_t>()[expert];
        EXPECT_EQ(valid, recv >= 0);
      }
      if (recv < 0) continue;
      // Find which (src, token) this row holds by its bytes and id: search the sources.
      const void* data = o.layout == Layout::contiguous
                             ? o.rows.select(row).data
                             : o.rows.select(row / o.rows.size(1)).select(row % o.rows.size(1)).data;
      int matches = 0;
      for (int src = 0; src < ranks; ++src) {
        const RankBatch& b = batches[static_cast<std::size_t>(src)];
        for (std::int64_t t = 0; t < b.x.size(0); ++t) {
          for (int k = 0; k < K; ++k) {
            if (b.ids.data<std::int32_t>()[t * K + k] != dst * L + expert) continue;
            if (std::memcmp(b.x.view().select(t).data, data, static_cast<std::size_t>(H)) != 0) continue;
            EXPECT_EQ(o.row_weight.as<float>()[row], b.weights.data<float>()[t * K + k]);
            ++seen[{src, t, k}];
            ++matches;
          }
        }
      }
      EXPECT_EQ(matches, 1) << "row " << row << " of rank " << dst;
    }
    if (o.layout == Layout::contiguous) {
      ASSERT_EQ(o.expert_offsets.size(), static_cast<std::size_t>(L) + 1);
      for (int j = 0; j < L; ++j)
        EXPECT_EQ(o.expert_offsets[static_cast<std::size_t>(j)] % kContiguousAlign, 0);
    }
  }
  std::int64_t expected_pairs = 0;
  for (std::int64_t T : tokens) expected_pairs += T * K;
  EXPECT_EQ(static_cast<std::int64_t>(seen.size()), expected_pairs);
  for (const auto& [key, count] : seen) EXPECT_EQ(count, 1);

  // Each token at most once per destination rank.
  const DispatchStats& stats = dispatcher->last_stats();
  for (int src = 0; src < ranks; ++src) {
    const RankBatch& b = batches[static_cast<std::size_t>(src)];
    std::int64_t expected_sent = 0;
    for (std::int64_t t = 0; t < b.x.size(0); ++t) {
      std::set<int> dsts;
      for (int k = 0; k < K; ++k) dsts.insert(b.ids.data<std::int32_t>()[t * K + k] / L);
      dsts.erase(src);
      expected_sent += static_cast<std::int64_t>(dsts.size());
    }
    EXPECT_EQ(stats.tokens_sent[static_cast<std::size_t>(src)], expected_sent);
  }
}

class SimDispatch : public ::testing::TestWithParam<std::tuple<int, Mode>> {};

TEST_P(SimDispatch, EveryTokenKReachesItsExpertExactlyOnceAndBytesMatch) {
  const auto [ranks, mode] = GetParam();
  const MoeConfig c = tiny(ranks, ranks == 4 ? 4 : 0);
  std::vector<std::int64_t> tokens;
  for (int r = 0; r < ranks; ++r) tokens.push_back(r == 1 ? 0 : 17 + 5 * r);  // rank 1 sends nothing
  expect_every_token_k_once(
      c, mode, make_batches(c, tokens, 42u + static_cast<unsigned>(ranks), ActivationFormat::fp8_group));
}

// Random rounds: 1-8 ranks with redundant slots, any top-k, either mode, batches of 0 up to the
// low-latency limit, ids over every slot or concentrated on a few. The seed is printed on failure;
// EPMOE_TEST_SEED replays it.
TEST(SimDispatchSweep, RandomRoundsReachEveryExpertExactlyOnce) {
  using testing::pick;
  using testing::uniform;
  testing::SeededRng rng;
  for (int i = 0; i < 96; ++i) {  // (~0.2 s)
    MoeConfig c = tiny(pick(rng, {1, 2, 3, 4, 8}));
    c.topk = static_cast<int>(uniform(rng, 1, 6));
    c.num_redundant_experts = (c.num_ranks - c.num_experts % c.num_ranks) % c.num_ranks +
                              c.num_ranks * static_cast<int>(uniform(rng, 0, 1));
    c.max_tokens_per_rank = static_cast<int>(uniform(rng, 1, 40));
    c.validate();
    const Mode mode = pick(rng, {Mode::normal, Mode::low_latency});
    std::vector<std::int64_t> tokens;
    for (int r = 0; r < c.num_ranks; ++r)
      tokens.push_back(uniform(rng, 0, 3) == 0 ? 0 : uniform(rng, 1, c.max_tokens_per_rank));
    const int id_pool = pick(rng, {0, 0, static_cast<int>(uniform(rng, c.topk, c.num_physical_experts()))});
    SCOPED_TRACE(fmt::format("round {}: {}, {} mode, ids from {} slots", i, c.describe(),
                             mode == Mode::normal ? "normal" : "low-latency", id_pool));
    expect_every_token_k_once(
        c, mode,
        make_batches(c, tokens, static_cast<std::uint32_t>(rng()), ActivationFormat::fp8_group, id_pool));
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST_P(SimDispatch, IdentityExpertsCombineToWeightedSums) {
  const auto [ranks, mode] = GetParam();
  const MoeConfig c = tiny(ranks);
  const auto batches = make_batches(c, std::vector<std::int64_t>(static_cast<std::size_t>(ranks), 9), 7u,
                                    ActivationFormat::bf16);
  auto dispatcher = make_dispatcher("cpu-sim", {c, mode, ActivationFormat::bf16, 0, ranks});
  std::vector<DispatchOutput> outs(static_cast<std::size_t>(ranks));
  dispatcher->dispatch(inputs_of(batches), outs);
  const std::int64_t H = c.hidden;
  const int L = c.num_local_experts(), K = c.topk;
  // "Expert" p multiplies its input by (p + 1) / 16.
  std::vector<HostTensor> expert_out;
  std::vector<TensorView> expert_views, y_views;
  std::vector<HostTensor> ys;
  for (int r = 0; r < ranks; ++r) {
    const DispatchOutput& o = outs[static_cast<std::size_t>(r)];
    expert_out.emplace_back(DType::bf16, std::initializer_list<std::int64_t>{o.num_output_rows(), H});
    for (std::int64_t row = 0; row < o.num_output_rows(); ++row) {
      if (o.row_token.as<std::int32_t>()[row] < 0) continue;
      const int j = o.layout == Layout::contiguous ? o.m_indices.as<std::int32_t>()[row]
                                                   : static_cast<int>(row / o.rows.size(1));
      const bf16* src = o.rows.as<bf16>() + row * H;  // both layouts are [rows, H] in memory
      const float f = static_cast<float>(r * L + j + 1) / 16.0f;
      for (std::int64_t h = 0; h < H; ++h)
        expert_out.back().data<bf16>()[row * H + h] = bf16::from_float(src[h].to_float() * f);
    }
    expert_views.push_back(expert_out.back());
    ys.emplace_back(DType::bf16, std::initializer_list<std::int64_t>{9, H});
    ys.back().fill_bytes(0xff);
    y_views.push_back(ys.back());
  }
  dispatcher->combine(expert_views, y_views);
  for (int r = 0; r < ranks; ++r) {
    const RankBatch& b = batches[static_cast<std::size_t>(r)];
    for (std::int64_t t = 0; t < 9; ++t) {
      for (std::int64_t h = 0; h < H; ++h) {
        double expected = 0;
        for (int k = 0; k < K; ++k) {
          const int p = b.ids.data<std::int32_t>()[t * K + k];
          expected +=
              b.weights.data<float>()[t * K + k] *
              round_to_bf16(b.x.data<bf16>()[t * H + h].to_float() * static_cast<float>(p + 1) / 16.0f);
        }
        const double got = ys[static_cast<std::size_t>(r)].data<bf16>()[t * H + h].to_float();
        EXPECT_NEAR(got, expected, 2e-2 * std::abs(expected) + 1e-2)
            << "rank " << r << " token " << t << " h " << h;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(RanksAndModes, SimDispatch,
                         ::testing::Combine(::testing::Values(1, 2, 4, 8),
                                            ::testing::Values(Mode::normal, Mode::low_latency)),
                         [](const auto& test_info) {
                           return fmt::format(
                               "ranks{}_{}", std::get<0>(test_info.param),
                               std::get<1>(test_info.param) == Mode::normal ? "normal" : "low_latency");
                         });

// Normal mode without a host sync (DispatcherContext::host_sync = false): the layout at
// contiguous_rows_bound() rows holds the exact layout's rows first and -1 after them, with no offsets
// or token count for the host; the combine of the same expert outputs gives the same bits.
TEST(SimDispatch, NormalModeWithoutAHostSyncIsTheExactLayoutAtItsBound) {
  const MoeConfig c = tiny(4, /*redundant=*/4);
  const auto batches = make_batches(c, {c.max_tokens_per_rank, 17, 0, 40}, 21u, ActivationFormat::fp8_group);
  auto exact = make_dispatcher("cpu-sim", {c, Mode::normal, ActivationFormat::fp8_group, 0, 4});
  auto bound = make_dispatcher("cpu-sim", {c, Mode::normal, ActivationFormat::fp8_group, 0, 4, false});
  std::vector<DispatchOutput> want(4), got(4);
  exact->dispatch(inputs_of(batches), want);
  bound->dispatch(inputs_of(batches), got);
  const std::int64_t M = contiguous_rows_bound(c, c.max_tokens_per_rank);
  EXPECT_EQ(M % kContiguousAlign, 0);
  EXPECT_EQ(M, contiguous_capacity(4 * c.max_tokens_per_rank * std::min(c.topk, c.num_local_experts()),
                                   c.num_local_experts()));
  std::vector<HostTensor> outs_exact, outs_bound;
  std::vector<TensorView> views_exact, views_bound;
  for (int r = 0; r < 4; ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const DispatchOutput& w = want[static_cast<std::size_t>(r)];
    const DispatchOutput& g = got[static_cast<std::size_t>(r)];
    ASSERT_EQ(g.num_output_rows(), M);
    EXPECT_TRUE(g.expert_offsets.empty());
    EXPECT_EQ(g.num_recv_tokens, -1);
    const std::int64_t m = w.num_output_rows(), H = c.hidden;
    ASSERT_LE(m, M);
    EXPECT_EQ(std::memcmp(g.rows.data, w.rows.data, static_cast<std::size_t>(m * H)), 0);
    EXPECT_EQ(std::memcmp(g.scales.data, w.scales.data, static_cast<std::size_t>(m * (H / 128)) * 4), 0);
    EXPECT_EQ(std::memcmp(g.m_indices.data, w.m_indices.data, static_cast<std::size_t>(m) * 4), 0);
    EXPECT_EQ(std::memcmp(g.row_token.data, w.row_token.data, static_cast<std::size_t>(m) * 4), 0);
    for (std::int64_t row = m; row < M; ++row) {
      ASSERT_EQ(g.m_indices.as<std::int32_t>()[row], -1) << "row " << row;
      ASSERT_EQ(g.row_token.as<std::int32_t>()[row], -1) << "row " << row;
    }
    // Stand-in expert outputs: the same values on the exact rows, NaN past them (never read).
    outs_exact.emplace_back(DType::bf16, std::initializer_list<std::int64_t>{m, H});
    outs_bound.emplace_back(DType::bf16, std::initializer_list<std::int64_t>{M, H});
    outs_bound.back().fill_bytes(0xff);
    for (std::int64_t i = 0; i < m * H; ++i) {
      const bf16 v = bf16::from_float(static_cast<float>((i * 7 + r) % 23) - 11.0f);
      outs_exact.back().data<bf16>()[i] = v;
      outs_bound.back().data<bf16>()[i] = v;
    }
  }
  for (int r = 0; r < 4; ++r) {
    views_exact.push_back(outs_exact[static_cast<std::size_t>(r)]);
    views_bound.push_back(outs_bound[static_cast<std::size_t>(r)]);
  }
  std::vector<HostTensor> y_exact, y_bound;
  std::vector<TensorView> yv_exact, yv_bound;
  // Both poisoned (bf16 NaN): two combines that wrote nothing would otherwise compare equal.
  for (const RankBatch& b : batches) {
    y_exact.emplace_back(DType::bf16, std::initializer_list<std::int64_t>{b.x.size(0), c.hidden});
    y_bound.emplace_back(DType::bf16, std::initializer_list<std::int64_t>{b.x.size(0), c.hidden});
    y_exact.back().fill_bytes(0xff);
    y_bound.back().fill_bytes(0xff);
  }
  for (int r = 0; r < 4; ++r) {
    yv_exact.push_back(y_exact[static_cast<std::size_t>(r)]);
    yv_bound.push_back(y_bound[static_cast<std::size_t>(r)]);
  }
  exact->combine(views_exact, yv_exact);
  bound->combine(views_bound, yv_bound);
  for (int r = 0; r < 4; ++r) {
    const HostTensor& ye = y_exact[static_cast<std::size_t>(r)];
    EXPECT_EQ(std::memcmp(ye.view().data, y_bound[static_cast<std::size_t>(r)].view().data, ye.nbytes()), 0)
        << "rank " << r;
    std::int64_t not_written = 0;
    for (std::int64_t i = 0; i < ye.numel(); ++i) not_written += std::isnan(ye.data<bf16>()[i].to_float());
    EXPECT_EQ(not_written, 0) << "rank " << r << ": elements of y the combine left poisoned";
  }

  // The bound needs T <= max_tokens_per_rank on every rank.
  const auto big = make_batches(c, {c.max_tokens_per_rank + 1, 1, 1, 1}, 22u, ActivationFormat::fp8_group);
  try {
    bound->dispatch(inputs_of(big), got);
    FAIL() << "expected a throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("without a host sync"), std::string::npos) << e.what();
  }
}

TEST(SimDispatchErrors, LowLatencyRefusesTooManyTokensBeforeSending) {
  const MoeConfig c = tiny(2);
  auto dispatcher = make_dispatcher("cpu-sim", {c, Mode::low_latency, ActivationFormat::fp8_group, 0, 2});
  const auto batches =
      make_batches(c, {c.max_tokens_per_rank, c.max_tokens_per_rank + 1}, 3u, ActivationFormat::fp8_group);
  std::vector<DispatchOutput> outs(2);
  try {
    dispatcher->dispatch(inputs_of(batches), outs);
    FAIL() << "expected a throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_tokens_per_rank"), std::string::npos) << e.what();
  }
}

TEST(SimDispatchErrors, OutOfRangeIdsAndBadShapesAreRefused) {
  const MoeConfig c = tiny(2);
  auto dispatcher = make_dispatcher("cpu-sim", {c, Mode::normal, ActivationFormat::fp8_group, 0, 2});
  auto batches = make_batches(c, {4, 4}, 5u, ActivationFormat::fp8_group);
  std::vector<DispatchOutput> outs(2);
  batches[1].ids.data<std::int32_t>()[3] = c.num_physical_experts();
  try {
    dispatcher->dispatch(inputs_of(batches), outs);
    FAIL() << "expected a throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("out of range"), std::string::npos) << e.what();
  }
  batches[1].ids.data<std::int32_t>()[3] = -1;
  EXPECT_THROW(dispatcher->dispatch(inputs_of(batches), outs), Error);
  batches[1].ids.data<std::int32_t>()[3] = 0;
  auto inputs = inputs_of(batches);
  HostTensor wrong(DType::f32, {4, c.topk + 1});
  inputs[0].topk_weights = wrong;
  EXPECT_THROW(dispatcher->dispatch(inputs, outs), Error);
  inputs = inputs_of(batches);
  inputs[0].x_scales = TensorView{};
  EXPECT_THROW(dispatcher->dispatch(inputs, outs), Error);
  // Device memory the host dispatcher would read (ids) or a scale no quantizer gives: named, not read.
  inputs = inputs_of(batches);
  inputs[1].topk_ids.device = Device::cuda;
  testing::expect_error_mentions([&] { dispatcher->dispatch(inputs, outs); },
                                 "rank 1 topk_ids must live on cpu");
  batches[1].scales.data<float>()[2] = -1.0f;
  testing::expect_error_mentions([&] { dispatcher->dispatch(inputs_of(batches), outs); },
                                 "rank 1 x_scales must be positive and finite: element 2 is -1");
  batches[1].scales.data<float>()[2] = 0.25f;
  batches[0].weights.data<float>()[0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(dispatcher->dispatch(inputs_of(batches), outs), Error);
  std::vector<DispatchOutput> one(1);
  EXPECT_THROW(dispatcher->dispatch(std::span<const DispatchInput>(inputs_of(batches).data(), 1), one),
               Error);
}

TEST(SimDispatchErrors, UnknownDispatcherNamesTheKnownOnes) {
  try {
    (void)make_dispatcher("nope", {tiny(1), Mode::normal, ActivationFormat::bf16, 0, 1});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cpu-sim"), std::string::npos) << e.what();
  }
}

// Configs whose products overflow, and bounds asked of an invalid config: refused, not wrapped.
TEST(CpuSimDispatcher, BoundsRefuseOverflowingConfigs) {
  MoeConfig c = tiny(2);
  EXPECT_GT(contiguous_rows_bound(c, 64), 0);
  EXPECT_THROW(contiguous_rows_bound(c, -5), Error);
  EXPECT_THROW(contiguous_rows_bound(c, std::int64_t{1} << 62), Error);
  EXPECT_THROW(contiguous_capacity(INT64_MAX - 10, 256), Error);
  MoeConfig zero = c;
  zero.num_ranks = 0;  // (was a division by zero)
  EXPECT_THROW(contiguous_rows_bound(zero, 8), Error);
  MoeConfig huge = c;
  huge.num_experts = INT32_MAX;
  huge.num_redundant_experts = 1;
  EXPECT_THROW(huge.validate(), Error);
  huge = c;
  huge.hidden = std::int64_t{1} << 62;
  EXPECT_THROW(huge.validate(), Error);
}

// cpu-local keeps its own copy of the top-k weights: the caller may change or free its tensor between
// dispatch and combine.
TEST(CpuSimDispatcher, CpuLocalCopiesTheWeightsAndNeedsADispatch) {
  MoeConfig c = tiny(1);
  const std::int64_t T = 3, H = c.hidden;
  const int K = c.topk;
  auto dispatcher = make_dispatcher("cpu-local", {c, Mode::normal, ActivationFormat::bf16, 0, 1});
  HostTensor expert_out(DType::bf16, {T * K, H}), y(DType::bf16, {T, H});
  expert_out.fill_bytes(0);
  EXPECT_THROW(dispatcher->combine(std::vector<TensorView>{expert_out}, std::vector<TensorView>{y}), Error);
  // Small multiples of 1/2 and 1/8 throughout: every product and sum below is exact in f32 (in any
  // order), so the combine's result is known to the bit.
  HostTensor x(DType::bf16, {T, H}), ids(DType::i32, {T, K}), w(DType::f32, {T, K});
  for (std::int64_t i = 0; i < T * H; ++i)
    x.data<bf16>()[i] = bf16::from_float(0.5f * static_cast<float>(i % 7 - 3));
  for (std::int64_t i = 0; i < T * K; ++i) {
    ids.data<std::int32_t>()[i] = static_cast<std::int32_t>(i % c.num_physical_experts());
    w.data<float>()[i] = 0.125f * static_cast<float>(i + 1);  // a different weight for each (token, k)
  }
  std::vector<DispatchInput> in{{x, TensorView{}, 1.0f, ids, w}};
  std::vector<DispatchOutput> out(1);
  dispatcher->dispatch(in, out);
  // Stand-in expert k of token t: x[t] * (k + 1).
  for (std::int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k)
      for (std::int64_t h = 0; h < H; ++h)
        expert_out.data<bf16>()[(t * K + k) * H + h] =
            bf16::from_float(x.data<bf16>()[t * H + h].to_float() * static_cast<float>(k + 1));
  // The caller's weights change before the combine (as a freed tensor's memory would): the combine
  // must use the values handed to the dispatch.
  const std::vector<float> handed(w.data<float>(), w.data<float>() + T * K);
  for (std::int64_t i = 0; i < T * K; ++i) w.data<float>()[i] = -4.0f;
  y.fill_bytes(0xff);  // bf16 NaN: every element must be written
  dispatcher->combine(std::vector<TensorView>{expert_out}, std::vector<TensorView>{y});
  std::int64_t wrong = 0;
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t h = 0; h < H; ++h) {
      float sum = 0;
      for (int k = 0; k < K; ++k)
        sum += handed[static_cast<std::size_t>(t * K + k)] *
               expert_out.data<bf16>()[(t * K + k) * H + h].to_float();
      const float want = bf16::from_float(sum).to_float(), got = y.data<bf16>()[t * H + h].to_float();
      if (got == want) continue;
      if (wrong++ == 0) ADD_FAILURE() << "y[" << t << ", " << h << "] = " << got << ", want " << want;
    }
  }
  EXPECT_EQ(wrong, 0) << "elements of y other than the weighted sum of the weights handed to the dispatch";
  HostTensor wide(DType::bf16, {T, 2 * H});  // a column slice of it: not contiguous
  TensorView strided = wide.view();
  strided.shape[1] = H;
  EXPECT_THROW(dispatcher->combine(std::vector<TensorView>{expert_out}, std::vector<TensorView>{strided}),
               Error);
}

}  // namespace
}  // namespace epmoe
