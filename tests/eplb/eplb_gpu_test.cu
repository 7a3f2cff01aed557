// GPU EPLB mapping against ExpertPlacement::map_to_physical, bit for bit (static and dynamic
// choice), and the per-expert token counters against a CPU histogram, accumulated across calls.
// Fresh random ids for each run, outputs poisoned before each run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "epmoe/config.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/eplb.hpp"
#include "epmoe/eplb.hpp"
#include "gpu_test_util.hpp"
#include "test_random.hpp"

namespace epmoe {
// gtest prints parameters with this (found by ADL).
inline void PrintTo(DispatchAlgorithm algorithm, std::ostream* os) {
  *os << to_string(algorithm);
}

namespace {

using testing::bits_equal;
using testing::expect_error_mentions;

constexpr std::uint8_t kPoison = 0xff;

struct PlacementCase {
  ExpertPlacement placement;
  int topk = 8;
};

// The placements under test, by name.
PlacementCase setup_named(const std::string& name) {
  if (name == "ds_ep8_r32") return {ExpertPlacement::initial(256, 288, 8), 8};  // experts 0..31 twice
  if (name == "ds_ep8_no_redundancy") return {ExpertPlacement::initial(256, 256, 8), 8};  // one replica each
  if (name == "tiny_ep4") return {ExpertPlacement::initial(16, 20, 4), 4};
  // K = 3: not a power of two (the token index by division), and T * K not a multiple of 4 for odd T
  // (one id per thread instead of 16-byte vectors).
  if (name == "tiny_ep4_k3") return {ExpertPlacement::initial(16, 20, 4), 3};
  // Too many log2phy entries for the kernel's shared memory: rows read from global memory.
  if (name == "wide_e4096") return {ExpertPlacement::initial(4096, 5120, 8), 8};
  // A rebalanced placement under a skewed load: hot experts with many replicas, spread over ranks.
  std::vector<double> load(256);
  std::mt19937_64 rng(7);
  std::vector<int> rank(256);
  std::iota(rank.begin(), rank.end(), 0);
  std::shuffle(rank.begin(), rank.end(), rng);
  for (int e = 0; e < 256; ++e)
    load[static_cast<std::size_t>(e)] = std::round(1e5 / std::pow(rank[e] + 1.0, 1.2));
  const RebalanceResult r = rebalance_experts({load}, 288, 8, 1, 8);
  return {placement_from(r, 0, 8), 8};
}

// Ids [T, K] as a router makes them: K distinct experts per token, drawn from a skewed
// popularity so that some experts are hot.
HostTensor random_ids(int num_logical, std::int64_t tokens, int k, std::mt19937_64& rng) {
  HostTensor ids(DType::i32, {tokens, k});
  std::vector<double> weight(static_cast<std::size_t>(num_logical));
  for (int e = 0; e < num_logical; ++e)
    weight[static_cast<std::size_t>(e)] = 1.0 / (1.0 + (e * 7919 % num_logical));
  std::discrete_distribution<int> pick(weight.begin(), weight.end());
  std::int32_t* p = ids.data<std::int32_t>();
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (int j = 0; j < k; ++j) {
      int e = 0;
      do {
        e = pick(rng);
      } while (std::find(p + t * k, p + t * k + j, e) != p + t * k + j);
      p[t * k + j] = e;
    }
  }
  return ids;
}

std::vector<std::int64_t> histogram(const HostTensor& ids, int num_logical) {
  std::vector<std::int64_t> h(static_cast<std::size_t>(num_logical), 0);
  const std::int32_t* p = ids.data<std::int32_t>();
  for (std::int64_t i = 0; i < ids.numel(); ++i)
    if (p[i] >= 0 && p[i] < num_logical) ++h[static_cast<std::size_t>(p[i])];
  return h;
}

using MapCase = std::tuple<std::string, std::int64_t, DispatchAlgorithm>;

class EplbMapGpu : public ::testing::TestWithParam<MapCase> {};

TEST_P(EplbMapGpu, BitExactWithCpuAndCountsAccumulate) {
  EPMOE_REQUIRE_GPU();
  const auto& [name, tokens, algorithm] = GetParam();
  const PlacementCase s = setup_named(name);
  const ExpertPlacement& pl = s.placement;
  const int e_count = pl.num_logical();
  testing::SeededRng rng;
  std::uniform_int_distribution<int> rank_dist(0, pl.num_ranks() - 1);
  std::uniform_int_distribution<std::int64_t> offset_dist(0, std::int64_t{1} << 40);

  cuda::Stream stream;
  const cuda::DevicePlacement dpl = cuda::to_device(pl, stream);
  const cuda::DeviceTensor counts(DType::i64, {e_count});
  EPMOE_CUDA_CHECK(cudaMemsetAsync(counts.data<std::int64_t>(), 0, counts.nbytes(), stream));
  std::vector<std::int64_t> want_counts(static_cast<std::size_t>(e_count), 0);

  for (int call = 0; call < 3; ++call) {  // the counters accumulate across calls
    const int src_rank = rank_dist(rng);
    // Call 2's tokens cross a multiple of 2^32 (the hash's high word changes inside the launch).
    const std::int64_t token_offset = call == 0   ? 0
                                      : call == 1 ? offset_dist(rng)
                                                  : (std::int64_t{5} << 32) - tokens / 2;
    SCOPED_TRACE("call " + std::to_string(call) + ", src_rank " + std::to_string(src_rank) +
                 ", token_offset " + std::to_string(token_offset));
    const HostTensor ids = random_ids(e_count, tokens, s.topk, rng);
    HostTensor want(DType::i32, {tokens, s.topk});
    pl.map_to_physical(ids, want, src_rank, algorithm, token_offset);
    const std::vector<std::int64_t> h = histogram(ids, e_count);
    for (int e = 0; e < e_count; ++e)
      want_counts[static_cast<std::size_t>(e)] += h[static_cast<std::size_t>(e)];

    const cuda::DeviceTensor dids = cuda::to_device(ids, stream);
    const cuda::DeviceTensor dphys(DType::i32, {tokens, s.topk});
    dphys.fill_bytes(kPoison, stream);
    cuda::map_to_physical(dpl.view(), dids, dphys, src_rank, algorithm, stream, token_offset);
    cuda::count_experts(dids, counts, stream);  // the load counter (on logical ids here)
    const HostTensor got = cuda::to_host(dphys, stream);
    const auto* g = got.data<std::int32_t>();
    const auto* w = want.data<std::int32_t>();
    const auto* in = ids.data<std::int32_t>();
    EXPECT_TRUE(bits_equal(g, w, tokens * s.topk, [&](std::int64_t i) {
      return "physical[" + std::to_string(i / s.topk) + ", " + std::to_string(i % s.topk) + "] of logical " +
             std::to_string(in[i]) + ": got " + std::to_string(g[i]) + ", want " + std::to_string(w[i]);
    }));
    const HostTensor got_counts = cuda::to_host(counts, stream);
    const auto* c = got_counts.data<std::int64_t>();
    EXPECT_TRUE(bits_equal(c, want_counts.data(), e_count, [&](std::int64_t e) {
      return "counts[" + std::to_string(e) + "]: got " + std::to_string(c[e]) + ", want " +
             std::to_string(want_counts[static_cast<std::size_t>(e)]);
    }));
  }

  // Mapping alone: the same ids, counters untouched.
  const HostTensor ids = random_ids(e_count, tokens, s.topk, rng);
  HostTensor want(DType::i32, {tokens, s.topk});
  pl.map_to_physical(ids, want, 0, algorithm, 5);
  const cuda::DeviceTensor dids = cuda::to_device(ids, stream);
  const cuda::DeviceTensor dphys(DType::i32, {tokens, s.topk});
  dphys.fill_bytes(kPoison, stream);
  cuda::map_to_physical(dpl.view(), dids, dphys, 0, algorithm, stream, 5);
  const HostTensor got = cuda::to_host(dphys, stream);
  EXPECT_TRUE(bits_equal(got.data<std::int32_t>(), want.data<std::int32_t>(), tokens * s.topk,
                         [](std::int64_t i) { return "element " + std::to_string(i) + " (no counters)"; }));
  const HostTensor after = cuda::to_host(counts, stream);
  EXPECT_TRUE(bits_equal(after.data<std::int64_t>(), want_counts.data(), e_count,
                         [](std::int64_t e) { return "counts[" + std::to_string(e) + "] changed"; }));
}

INSTANTIATE_TEST_SUITE_P(Placements, EplbMapGpu,
                         ::testing::Combine(::testing::Values("ds_ep8_r32", "ds_rebalanced",
                                                              "ds_ep8_no_redundancy", "tiny_ep4",
                                                              "tiny_ep4_k3", "wide_e4096"),
                                            // 300001: several passes of the grid (each thread's
                                            // next ids loaded while it maps the current ones)
                                            ::testing::Values<std::int64_t>(1, 3, 128, 4097, 16384, 300001),
                                            ::testing::Values(DispatchAlgorithm::static_choice,
                                                              DispatchAlgorithm::dynamic_choice)),
                         [](const ::testing::TestParamInfo<MapCase>& info) {
                           return std::get<0>(info.param) + "_T" + std::to_string(std::get<1>(info.param)) +
                                  "_" + std::string(to_string(std::get<2>(info.param)));
                         });

// Out-of-range logical ids map to -1 and the counter skips them; the other elements are unaffected.
TEST(EplbGpu, OutOfRangeIdsMapToMinusOne) {
  EPMOE_REQUIRE_GPU();
  const PlacementCase s = setup_named("ds_rebalanced");
  const ExpertPlacement& pl = s.placement;
  const std::int64_t tokens = 300;
  testing::SeededRng rng;
  HostTensor ids = random_ids(pl.num_logical(), tokens, s.topk, rng);
  std::int32_t* p = ids.data<std::int32_t>();
  const std::vector<std::int32_t> bad{-1, pl.num_logical(), -1000, 1 << 30};
  for (std::size_t i = 0; i < bad.size(); ++i) p[37 * i + 5] = bad[i];
  cuda::Stream stream;
  const cuda::DevicePlacement dpl = cuda::to_device(pl, stream);
  const cuda::DeviceTensor counts(DType::i64, {pl.num_logical()});
  EPMOE_CUDA_CHECK(cudaMemsetAsync(counts.data<std::int64_t>(), 0, counts.nbytes(), stream));
  const cuda::DeviceTensor dids = cuda::to_device(ids, stream);
  const cuda::DeviceTensor dphys(DType::i32, {tokens, s.topk});
  for (auto algorithm : {DispatchAlgorithm::static_choice, DispatchAlgorithm::dynamic_choice}) {
    dphys.fill_bytes(kPoison, stream);
    cuda::map_to_physical(dpl.view(), dids, dphys, 3, algorithm, stream, 11);
    cuda::count_experts(dids, counts, stream);
    const HostTensor got = cuda::to_host(dphys, stream);
    for (std::int64_t i = 0; i < ids.numel(); ++i) {
      const std::int32_t e = p[i];
      const std::int32_t want =
          e >= 0 && e < pl.num_logical()
              ? pl.choose(e, 3, 11 + i / s.topk, static_cast<int>(i % s.topk), algorithm)
              : -1;
      ASSERT_EQ(got.data<std::int32_t>()[i], want) << "element " << i << ", logical " << e;
    }
  }
  std::vector<std::int64_t> want_counts = histogram(ids, pl.num_logical());
  for (auto& c : want_counts) c *= 2;
  const HostTensor got_counts = cuda::to_host(counts, stream);
  EXPECT_TRUE(bits_equal(got_counts.data<std::int64_t>(), want_counts.data(), pl.num_logical(),
                         [](std::int64_t e) { return "counts[" + std::to_string(e) + "]"; }));
}

// The load counter alone: more counters than its shared-memory histogram holds (one global atomic
// per id), odd element counts (no 16-byte loads), ids outside [0, C) skipped, accumulation.
TEST(EplbGpu, CountExpertsMatchesAHistogram) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  cuda::Stream stream;
  for (const std::int64_t num_counters : {std::int64_t{3}, std::int64_t{288}, std::int64_t{20000}}) {
    for (const std::int64_t n : {std::int64_t{1}, std::int64_t{4097}, std::int64_t{65536}}) {
      SCOPED_TRACE("counters " + std::to_string(num_counters) + ", n " + std::to_string(n));
      std::uniform_int_distribution<std::int32_t> id(-2, static_cast<std::int32_t>(num_counters) + 1);
      HostTensor ids(DType::i32, {n});
      std::vector<std::int64_t> want(static_cast<std::size_t>(num_counters), 0);
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int32_t v = id(rng);
        ids.data<std::int32_t>()[i] = v;
        if (v >= 0 && v < num_counters) want[static_cast<std::size_t>(v)] += 2;  // counted twice below
      }
      const cuda::DeviceTensor dids = cuda::to_device(ids, stream);
      const cuda::DeviceTensor counts(DType::i64, {num_counters});
      EPMOE_CUDA_CHECK(cudaMemsetAsync(counts.data<std::int64_t>(), 0, counts.nbytes(), stream));
      cuda::count_experts(dids, counts, stream);
      cuda::count_experts(dids, counts, stream);
      const HostTensor got = cuda::to_host(counts, stream);
      EXPECT_TRUE(bits_equal(got.data<std::int64_t>(), want.data(), num_counters, [&](std::int64_t c) {
        return "counts[" + std::to_string(c) + "]: got " + std::to_string(got.data<std::int64_t>()[c]) +
               ", want " + std::to_string(want[static_cast<std::size_t>(c)]);
      }));
    }
  }
}

TEST(EplbGpu, RefusesBadArguments) {
  EPMOE_REQUIRE_GPU();
  const ExpertPlacement pl = ExpertPlacement::initial(16, 20, 4);
  cuda::Stream stream;
  const cuda::DevicePlacement dpl = cuda::to_device(pl, stream);
  const cuda::PlacementView v = dpl.view();
  const std::int64_t t = 6, k = 4;
  const cuda::DeviceTensor ids(DType::i32, {t, k}), phys(DType::i32, {t, k}), counts(DType::i64, {16});
  const cuda::DeviceTensor i64_ids(DType::i64, {t, k}), short_phys(DType::i32, {t, k - 1});
  const cuda::DeviceTensor i32_counts(DType::i32, {16}), short_counts(DType::i64, {15});
  HostTensor host_ids(DType::i32, {t, k});
  const auto st = DispatchAlgorithm::static_choice;

  expect_error_mentions([&] { cuda::map_to_physical(v, host_ids, phys, 0, st, stream); }, "logical_ids");
  expect_error_mentions([&] { cuda::map_to_physical(v, i64_ids, phys, 0, st, stream); }, "logical_ids");
  expect_error_mentions([&] { cuda::map_to_physical(v, ids, short_phys, 0, st, stream); }, "physical_ids");
  expect_error_mentions([&] { cuda::map_to_physical(v, ids, phys, 4, st, stream); }, "src_rank");
  expect_error_mentions([&] { cuda::map_to_physical(v, ids, phys, -1, st, stream); }, "src_rank");
  expect_error_mentions([&] { cuda::map_to_physical(v, ids, phys, 0, st, stream, -3); }, "token_offset");
  expect_error_mentions([&] { cuda::count_experts(ids, i32_counts, stream); }, "counts must have dtype i64");
  expect_error_mentions([&] { cuda::count_experts(i64_ids, counts, stream); }, "ids must have dtype i32");
  expect_error_mentions([&] { cuda::count_experts(host_ids, counts, stream); }, "ids");
  const cuda::DeviceTensor cube_counts(DType::i64, {2, 2, 16}), no_counts(DType::i64, {0});
  expect_error_mentions([&] { cuda::count_experts(ids, cube_counts, stream); }, "counts");
  expect_error_mentions([&] { cuda::count_experts(ids, no_counts, stream); },
                        "counts: the number of counters must be in [1, 2^31), got 0");
  cuda::PlacementView bad = v;
  bad.logcnt = short_counts.view();
  expect_error_mentions([&] { cuda::map_to_physical(bad, ids, phys, 0, st, stream); }, "logcnt");
  bad = v;
  bad.slots_per_rank = 0;
  expect_error_mentions([&] { cuda::map_to_physical(bad, ids, phys, 0, st, stream); }, "slots_per_rank");
  bad = v;
  bad.log2phy = ids.view();  // a [6, 4] i32 table for 16 experts: logcnt's shape no longer matches
  expect_error_mentions([&] { cuda::map_to_physical(bad, ids, phys, 0, st, stream); }, "logcnt");

  const cuda::DeviceTensor no_ids(DType::i32, {0, k}), no_phys(DType::i32, {0, k});
  EXPECT_NO_THROW(cuda::map_to_physical(v, no_ids, no_phys, 0, st, stream, 0));
  EXPECT_NO_THROW(cuda::count_experts(no_ids, counts, stream));
  stream.synchronize();
}

}  // namespace
}  // namespace epmoe
