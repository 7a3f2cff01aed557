// The benchmark harness's host side (src/bench/bench.cpp) without a GPU: what a result derives from
// its bytes and flops, its line and its JSON (which scripts read: null for a non-finite number), the
// date format and where "commit" comes from.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <regex>
#include <string>

#include "bench/bench.hpp"
#include "scoped_env.hpp"

namespace epmoe::bench {
namespace {

TEST(BenchResult, DerivesRatesAndFloorFromBytesFlopsAndCeiling) {
  // 2 GB in 1000 us = 2000 GB/s; 3e12 flop in 1000 us = 3000 TFLOP/s; 2 GB at 4000 GB/s = 500 us.
  const Result r = make_result("x.y", {{"n", std::int64_t{7}}}, 1000.0, 2e9, 3e12, 4000.0);
  EXPECT_EQ(r.bench, "x.y");
  EXPECT_DOUBLE_EQ(r.gbps, 2000.0);
  EXPECT_DOUBLE_EQ(r.tflops, 3000.0);
  EXPECT_DOUBLE_EQ(r.floor_us, 500.0);
  EXPECT_EQ(r.copy_us, 0.0);
  // No time measured: no rates (not a division by zero); no ceiling: no floor.
  const Result z = make_result("x.z", {}, 0.0, 2e9, 3e12, 0.0);
  EXPECT_EQ(z.gbps, 0.0);
  EXPECT_EQ(z.tflops, 0.0);
  EXPECT_EQ(z.floor_us, 0.0);
}

TEST(BenchResult, JsonHasTheDocumentedKeysAndNullForNonFinite) {
  Result r =
      make_result("permute", {{"layout", std::string("masked")}, {"tokens", std::int64_t{128}}, {"s", 0.5}},
                  20.0, 4e6, 0.0, 4000.0);
  nlohmann::json j = to_json(r);
  EXPECT_EQ(j["bench"], "permute");
  EXPECT_EQ(j["params"]["layout"], "masked");
  EXPECT_EQ(j["params"]["tokens"], 128);
  EXPECT_EQ(j["params"]["s"], 0.5);
  for (const char* key : {"time_us", "gbps", "tflops", "floor_us"}) EXPECT_TRUE(j.contains(key)) << key;
  EXPECT_FALSE(j.contains("copy_us"));  // only where a copy was timed
  r.copy_us = 10.0;
  j = to_json(r);
  EXPECT_DOUBLE_EQ(j["copy_us"].get<double>(), 10.0);
  EXPECT_DOUBLE_EQ(j["vs_copy"].get<double>(), 2.0);
  // A failed measurement's NaN must not reach the file as a bare NaN (not JSON).
  r.time_us = std::numeric_limits<double>::quiet_NaN();
  const std::string text = to_json(r).dump();
  EXPECT_EQ(text.find("NaN"), std::string::npos) << text;
  EXPECT_TRUE(nlohmann::json::parse(text)["time_us"].is_null()) << text;
}

TEST(BenchResult, LineNamesTheBenchItsParamsAndTheRatios) {
  Result r = make_result("gemm.masked", {{"groups", std::int64_t{32}}, {"n", std::int64_t{4096}}}, 300.0,
                         1.2e9, 9e11, 4000.0);
  r.copy_us = 150.0;
  const std::string line = describe(r);
  EXPECT_NE(line.find("gemm.masked"), std::string::npos) << line;
  EXPECT_NE(line.find("groups=32 n=4096"), std::string::npos) << line;
  EXPECT_NE(line.find("300.00 us"), std::string::npos) << line;
  EXPECT_NE(line.find("3000.0 TFLOP/s"), std::string::npos) << line;
  EXPECT_NE(line.find("floor   300.00 us  x1.00"), std::string::npos) << line;
  EXPECT_NE(line.find("copy   150.00 us  x2.00"), std::string::npos) << line;
}

TEST(BenchResult, DateIsUtcIso8601) {
  EXPECT_TRUE(std::regex_match(utc_now_iso8601(), std::regex(R"(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z)")))
      << utc_now_iso8601();
}

TEST(BenchResult, CommitIsTheBuildsAndTheEnvironmentOnlyWhereThatIsUnknown) {
  const std::string built = build_commit();
  ASSERT_FALSE(built.empty());
  const testing::ScopedEnv env("EPMOE_COMMIT", "from-the-environment");
  EXPECT_EQ(git_commit(), built == "unknown" ? "from-the-environment" : built);
}

}  // namespace
}  // namespace epmoe::bench
