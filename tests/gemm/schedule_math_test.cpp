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

}  // namespace
}  // namespace epmoe::kernels
