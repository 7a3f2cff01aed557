// The benchmark suites' shared host side (src/bench/suites.cpp) without a GPU: the registry that
// `epmoe bench` and `bench all` list, the default token counts, --quick's timing, the
// EPMOE_BENCH_*_VARIANTS lists and how a result is reported as it is measured.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "bench/bench.hpp"
#include "scoped_env.hpp"

namespace epmoe::bench {
namespace {

TEST(BenchSuites, EverySuiteIsRegisteredOnceInOrderWithHelp) {
  const std::vector<Suite> list = suites();
  std::set<std::string> names;
  for (std::size_t i = 0; i < list.size(); ++i) {
    EXPECT_TRUE(names.insert(list[i].name).second) << "registered twice: " << list[i].name;
    EXPECT_FALSE(list[i].help.empty()) << list[i].name;
    EXPECT_TRUE(static_cast<bool>(list[i].run)) << list[i].name;
    if (i > 0) {
      EXPECT_LE(list[i - 1].order, list[i].order) << list[i - 1].name << " before " << list[i].name;
    }
  }
  // What the README and `epmoe bench --help` promise, the copy ceiling first (`bench all` measures it
  // before the suites that compare against it).
  for (const char* name :
       {"copy", "quant", "router", "eplb", "silu_quant", "permute", "gather", "gemm", "comm", "layer"})
    EXPECT_EQ(names.count(name), 1u) << name;
  ASSERT_FALSE(list.empty());
  EXPECT_EQ(list.front().name, "copy");
  // "all" is the CLI's word for every suite, never a suite's own name.
  EXPECT_EQ(names.count("all"), 0u);
}

TEST(BenchSuites, TokensComeFromTheOptionsElseTheSuitesDefaults) {
  SuiteOptions options;
  EXPECT_EQ(tokens_or_default(options), (std::vector<std::int64_t>{128, 4096, 16384}));
  EXPECT_EQ(tokens_or_default(options, {1, 32}), (std::vector<std::int64_t>{1, 32}));
  options.quick = true;
  EXPECT_EQ(tokens_or_default(options), (std::vector<std::int64_t>{128, 4096}));
  options.tokens = {7, 9};  // --tokens wins over --quick and the suite's list
  EXPECT_EQ(tokens_or_default(options, {1, 32}), (std::vector<std::int64_t>{7, 9}));
}

TEST(BenchSuites, QuickTimesFewerRuns) {
  SuiteOptions options;
  const TimingOptions full = timing_for(options);
  options.quick = true;
  const TimingOptions quick = timing_for(options);
  EXPECT_GE(quick.warmup, 1);
  EXPECT_GE(quick.iterations, 1);
  EXPECT_LT(quick.iterations, full.iterations);
  EXPECT_LE(quick.warmup, full.warmup);
  EXPECT_FALSE(quick.burst);
  EXPECT_FALSE(full.burst);
}

TEST(BenchSuites, VariantListsNameWholeEntries) {
  constexpr const char* kVar = "EPMOE_BENCH_TEST_VARIANTS";
  {
    testing::ScopedEnv unset(kVar, nullptr);
    EXPECT_TRUE(env_list_has(kVar, "anything"));  // unset: every variant
  }
  {
    testing::ScopedEnv empty(kVar, "");
    EXPECT_TRUE(env_list_has(kVar, "anything"));  // empty: every variant too
  }
  testing::ScopedEnv set(kVar, "split,wave0_first,tma");
  EXPECT_TRUE(env_list_has(kVar, "split"));
  EXPECT_TRUE(env_list_has(kVar, "wave0_first"));
  EXPECT_TRUE(env_list_has(kVar, "tma"));
  // Whole entries only: not a prefix, a suffix or a piece of one.
  EXPECT_FALSE(env_list_has(kVar, "wave0"));
  EXPECT_FALSE(env_list_has(kVar, "first"));
  EXPECT_FALSE(env_list_has(kVar, "spli"));
  EXPECT_FALSE(env_list_has(kVar, "split,wave0_first"));
  EXPECT_FALSE(env_list_has(kVar, ""));
  testing::ScopedEnv trailing(kVar, "a,,b,");
  EXPECT_TRUE(env_list_has(kVar, "a"));
  EXPECT_TRUE(env_list_has(kVar, "b"));
  EXPECT_FALSE(env_list_has(kVar, "c"));
}

TEST(BenchSuites, EmitReportsEachResultAsItIsMeasuredAndKeepsIt) {
  std::vector<std::string> seen;
  SuiteOptions options;
  options.on_result = [&](const Result& r) { seen.push_back(r.bench); };
  std::vector<Result> results;  // (ceilings given: without one make_result measures the GPU's)
  emit(options, results, make_result("a.one", {}, 10.0, 1e6, 0.0, 4000.0));
  emit(options, results, make_result("a.two", {}, 20.0, 1e6, 0.0, 4000.0));
  EXPECT_EQ(seen, (std::vector<std::string>{"a.one", "a.two"}));
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[1].bench, "a.two");
  EXPECT_DOUBLE_EQ(results[1].time_us, 20.0);
  // Without a callback the result is only kept.
  SuiteOptions quiet;
  emit(quiet, results, make_result("a.three", {}, 30.0, 1e6, 0.0, 4000.0));
  EXPECT_EQ(results.size(), 3u);
  EXPECT_EQ(seen.size(), 2u);
}

}  // namespace
}  // namespace epmoe::bench
