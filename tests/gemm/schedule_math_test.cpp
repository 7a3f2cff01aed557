// The tile schedules' division without integer division (src/gemm/schedule_math.hpp), on the host:
// the same float operations as on the device.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>

#include "gemm/schedule_math.hpp"

namespace epmoe::kernels {
namespace {

TEST(ScheduleMath, DivSmallEqualsIntegerDivisionOverItsRange) {
  std::mt19937 rng(12345);
  std::uniform_int_distribution<std::int32_t> any_n(0, (1 << 24) - 1);
  const auto check = [](std::int32_t n, std::int32_t d) {
    const float inv = 1.0f / static_cast<float>(d);
    ASSERT_EQ(div_small(n, d, inv), n / d) << n << " / " << d;
  };
  // Every divisor up to 3000 (band widths, band tile counts): all small numerators, the multiples of d
  // and their neighbours near the top of the range, and random numerators.
  for (std::int32_t d = 1; d <= 3000; ++d) {
    for (std::int32_t n = 0; n < 4096; ++n) check(n, d);
    for (std::int32_t k = ((1 << 24) - 1) / d - 64; k <= ((1 << 24) - 1) / d; ++k) {
      for (std::int32_t e = -1; e <= 1; ++e) {
        const std::int64_t n = std::int64_t{k} * d + e;
        if (n >= 0 && n < (1 << 24)) check(static_cast<std::int32_t>(n), d);
      }
    }
    for (int i = 0; i < 200; ++i) check(any_n(rng), d);
  }
  // Large divisors.
  for (const std::int32_t d : {4093, 65521, 1 << 20, (1 << 24) - 1}) {
    for (int i = 0; i < 100000; ++i) check(any_n(rng), d);
  }
}

// v30's trimmed grid: the anchor rows' counts worked out by hand, then for every tile count and grid up
// to 300 CTAs: never more CTAs, the same rounds, every CTA of the trimmed grid busy in every round but the
// last, and a trim exactly where the last round is at least half busy (and a smaller grid exists).
TEST(ScheduleMath, TrimmedCtasKeepTheRoundsOnFewerCtas) {
  EXPECT_EQ(trimmed_ctas(1024, 132), 128);  // masked 32 x 192 / 32 x 32: 7.76 rounds -> 8 x 128
  EXPECT_EQ(trimmed_ctas(1792, 132), 128);  // their K = 2048 rows: 13.58 -> 14 x 128
  EXPECT_EQ(trimmed_ctas(992, 132), 124);   // a tail of 68 (>= 66)
  EXPECT_EQ(trimmed_ctas(1296, 132), 130);  // contiguous 32 x 256, K = 7168
  EXPECT_EQ(trimmed_ctas(928, 132), 132);   // a tail of 4: left to v21 / its few CTAs
  EXPECT_EQ(trimmed_ctas(4096, 132), 132);  // the decode rows: 31.03 rounds
  EXPECT_EQ(trimmed_ctas(2128, 132), 132);  // contiguous 32 x 256, K = 2048: a tail of 16
  EXPECT_EQ(trimmed_ctas(1056, 132), 132);  // whole rounds
  EXPECT_EQ(trimmed_ctas(100, 132), 100);   // fewer tiles than CTAs: one each
  EXPECT_EQ(trimmed_ctas(60, 132), 132);    //   (under half: the grid as it is, the rest idle)
  for (std::int32_t ctas = 1; ctas <= 300; ++ctas) {
    for (std::int32_t tiles = 1; tiles <= 20 * ctas; ++tiles) {
      const std::int32_t got = trimmed_ctas(tiles, ctas);
      const std::int32_t rounds = (tiles + ctas - 1) / ctas;
      ASSERT_GE(got, 1);
      ASSERT_LE(got, ctas) << tiles << " tiles on " << ctas;
      ASSERT_EQ((tiles + got - 1) / got, rounds) << tiles << " tiles on " << ctas << " -> " << got;
      const bool trimmed = got < ctas;
      const bool rule = 2 * (tiles % ctas) >= ctas;
      // Trimmed exactly where the rule holds and the same rounds fit on fewer CTAs.
      ASSERT_EQ(trimmed, rule && (tiles + rounds - 1) / rounds < ctas) << tiles << " tiles on " << ctas;
      if (trimmed) {
        ASSERT_GT(tiles, (rounds - 1) * got);           // the last round not empty
        ASSERT_EQ(got, (tiles + rounds - 1) / rounds);  // the fewest CTAs with those rounds
      }
    }
  }
}

}  // namespace
}  // namespace epmoe::kernels
