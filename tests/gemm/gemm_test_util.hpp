// What the FP8 and W4A8 grouped GEMM GPU tests share: random operands (never zero, never NaN), a
// fresh seed per run, the poison of the outputs and the check of an output against the f64 reference.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <vector>

#include "epmoe/tensor.hpp"

namespace epmoe::testing {

inline constexpr double kTolerance = 5e-3;
inline constexpr std::uint16_t kPoison = 0xffff;  // bf16 NaN: never a valid output

inline std::uint64_t fresh_seed() {
  std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

// e4m3 normal numbers of random sign, exponent and mantissa (never zero, never NaN).
inline void fill_random_fp8(std::uint8_t* p, std::int64_t n, std::mt19937_64& rng) {
  std::uint64_t bits = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    if (i % 4 == 0) bits = rng();
    const auto r = static_cast<unsigned>(bits >> (16 * (i % 4))) & 0xffffu;
    const unsigned exponent = 3 + (r >> 8) % 9;  // 3..11: 2^-4 .. 2^4
    p[i] = static_cast<std::uint8_t>(((r & 1u) << 7) | (exponent << 3) | ((r >> 1) & 7u));
  }
}

// Positive f32 scales spread over a few octaves.
inline void fill_random_scales(float* p, std::int64_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(1.0f, 2.0f);
  std::uniform_int_distribution<int> e(-10, -4);
  for (std::int64_t i = 0; i < n; ++i) p[i] = std::ldexp(u(rng), e(rng));
}

// A masked layout's activations [G, M_max, K] (e4m3 bytes): random codes in every row (fill_random_fp8),
// then NaN codes in the rows past each group's count, so that nothing of them may leak into valid rows.
// `counts_out` (i32 [G]) receives the counts.
inline void fill_masked_activations(std::uint8_t* a, const std::vector<std::int32_t>& counts,
                                    std::int64_t M_max, std::int64_t K, std::int32_t* counts_out,
                                    std::mt19937_64& rng) {
  const auto G = static_cast<std::int64_t>(counts.size());
  fill_random_fp8(a, G * M_max * K, rng);
  for (std::int64_t g = 0; g < G; ++g) {
    counts_out[g] = counts[static_cast<std::size_t>(g)];
    for (std::int64_t r = counts[static_cast<std::size_t>(g)]; r < M_max; ++r)
      std::memset(a + (g * M_max + r) * K, 0x7f, static_cast<std::size_t>(K));
  }
}

// The valid rows of a masked output [G, M_max, n] flattened to rows: row r of group g while r < counts[g].
inline std::vector<bool> masked_valid(const std::vector<std::int32_t>& counts, std::int64_t M_max) {
  std::vector<bool> valid;
  for (const std::int32_t c : counts)
    for (std::int64_t r = 0; r < M_max; ++r) valid.push_back(r < c);
  return valid;
}

// Compares got (bf16 [rows, n] flattened) against the f64 reference on the rows where valid[row];
// every other row must still hold the poison.
inline void check_output(const HostTensor& got, const HostTensor& ref, const std::vector<bool>& valid,
                         std::int64_t n) {
  const bf16* g = got.data<bf16>();
  const double* r = ref.data<double>();
  double err2 = 0, ref2 = 0, dot = 0, sum2 = 0;
  std::int64_t non_finite = 0, overwritten = 0, checked = 0;
  std::ostringstream first;
  for (std::size_t row = 0; row < valid.size(); ++row) {
    for (std::int64_t j = 0; j < n; ++j) {
      const std::int64_t i = static_cast<std::int64_t>(row) * n + j;
      if (!valid[row]) {
        if (g[i].bits != kPoison) {
          if (overwritten++ < 4) first << " row " << row << " col " << j << " = " << g[i].to_float() << ";";
        }
        continue;
      }
      const double x = g[i].to_float(), y = r[i];
      if (!std::isfinite(x)) {
        if (non_finite++ < 4) first << " non-finite at row " << row << " col " << j << ";";
        continue;
      }
      err2 += (x - y) * (x - y);
      ref2 += y * y;
      dot += x * y;
      sum2 += x * x + y * y;
      ++checked;
    }
  }
  EXPECT_EQ(non_finite, 0) << first.str();
  EXPECT_EQ(overwritten, 0) << "skipped rows were written:" << first.str();
  if (checked == 0) return;
  const double rel = std::sqrt(err2 / ref2);
  const double calc_diff = 1.0 - 2.0 * dot / sum2;
  EXPECT_LE(rel, kTolerance) << "relative L2 error over " << checked << " values (calc_diff " << calc_diff
                             << ")";
  EXPECT_LE(calc_diff, kTolerance);
  std::printf("    rel_l2 %.3g, calc_diff %.3g over %lld values\n", rel, calc_diff,
              static_cast<long long>(checked));
}

}  // namespace epmoe::testing
