// What the FP8 and W4A8 grouped GEMM GPU tests share: random operands (never zero, never NaN), a
// fresh seed per run (test_random.hpp, with its draws), the poison of the outputs, the check of an output
// against the f64 reference, and the random sweeps' problem draws.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "epmoe/tensor.hpp"
#include "test_random.hpp"

namespace epmoe::testing {

inline constexpr double kTolerance = 5e-3;
inline constexpr std::uint16_t kPoison = 0xffff;  // bf16 NaN: never a valid output

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

// An i32 [n] host tensor holding `values` (m_indices, masked counts). (std::copy, not memcpy: with no
// values the tensor's data is null, and memcpy's pointer arguments must not be, even for zero bytes: UBSan
// caught a sweep's empty contiguous problem, session 52.)
inline HostTensor host_i32(const std::vector<std::int32_t>& values) {
  HostTensor t(DType::i32, {static_cast<std::int64_t>(values.size())});
  std::copy(values.begin(), values.end(), t.data<std::int32_t>());
  return t;
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
// every other row must still hold the poison. Two bounds: design.md section 8's relative L2 error over
// all valid values, and one per value, so that a few wrong values cannot hide in the mean (one 16-byte
// store of another row's results moves the L2 error of a 2M-value output by ~3e-3 only). The per-value
// bound is 2^-6 of the value plus 2^-4 of the row's RMS: a value taken from another row or column, or
// garbage, misses by about the RMS. The tensor cores' FP8 accumulation is far less exact than f32 (the L2
// error beyond the bf16 rounding is ~1.2e-3, and single values measured up to 0.66% of their row's RMS,
// on an H100 with a K = 128 W4A8 row; bench/NOTES.md, session 64), hence no tighter bound.
inline void check_output(const HostTensor& got, const HostTensor& ref, const std::vector<bool>& valid,
                         std::int64_t n) {
  const bf16* g = got.data<bf16>();
  const double* r = ref.data<double>();
  double err2 = 0, ref2 = 0, dot = 0, sum2 = 0;
  std::int64_t non_finite = 0, overwritten = 0, checked = 0, outside = 0;
  std::ostringstream first, first_outside;
  for (std::size_t row = 0; row < valid.size(); ++row) {
    const std::int64_t row_begin = static_cast<std::int64_t>(row) * n;
    double row_ref2 = 0;
    if (valid[row])
      for (std::int64_t j = 0; j < n; ++j) row_ref2 += r[row_begin + j] * r[row_begin + j];
    const double row_rms = n > 0 ? std::sqrt(row_ref2 / static_cast<double>(n)) : 0.0;
    for (std::int64_t j = 0; j < n; ++j) {
      const std::int64_t i = row_begin + j;
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
      const double bound = 0x1p-6 * std::abs(y) + 0x1p-4 * row_rms;
      if (!(std::abs(x - y) <= bound) && outside++ < 4)
        first_outside << " row " << row << " col " << j << ": " << x << " against " << y << " (bound "
                      << bound << ");";
      err2 += (x - y) * (x - y);
      ref2 += y * y;
      dot += x * y;
      sum2 += x * x + y * y;
      ++checked;
    }
  }
  EXPECT_EQ(non_finite, 0) << first.str();
  EXPECT_EQ(overwritten, 0) << "skipped rows were written:" << first.str();
  EXPECT_EQ(outside, 0) << "values outside their bound, first:" << first_outside.str();
  if (checked == 0) return;
  const double rel = std::sqrt(err2 / ref2);
  // (DeepGEMM's measure, printed beside ours: 1 - 2xy / (x^2 + y^2) is at most rel^2, so the L2 bound
  // holds it too.)
  const double calc_diff = 1.0 - 2.0 * dot / sum2;
  EXPECT_LE(rel, kTolerance) << "relative L2 error over " << checked << " values (calc_diff " << calc_diff
                             << ")";
  std::printf("    rel_l2 %.3g, calc_diff %.3g over %lld values\n", rel, calc_diff,
              static_cast<long long>(checked));
}

// ---------------------------------------------------------------- the random sweeps
// (GroupedGemmSweepGpu, W4A8GemmSweepGpu: random problems under the automatic kernel choices.)
// Rows per group: +-30% around `expected` (mode 0), uniform in [0, limit] (1), all `limit` (2), or half
// of the groups empty and the rest uniform in [1, limit] (3); each within [0, limit].
inline std::vector<std::int32_t> random_rows(std::mt19937_64& rng, std::int64_t groups, std::int64_t expected,
                                             std::int64_t limit) {
  const std::int64_t mode = uniform(rng, 0, 3);
  std::uniform_real_distribution<double> spread(0.7, 1.3);
  std::vector<std::int32_t> rows;
  for (std::int64_t g = 0; g < groups; ++g) {
    std::int64_t r = limit;
    if (mode == 0) r = std::llround(static_cast<double>(expected) * spread(rng));
    if (mode == 1) r = uniform(rng, 0, limit);
    if (mode == 3) r = uniform(rng, 0, 1) == 0 ? 0 : uniform(rng, 1, limit);
    rows.push_back(static_cast<std::int32_t>(std::clamp<std::int64_t>(r, 0, limit)));
  }
  return rows;
}

inline std::string rows_text(const std::vector<std::int32_t>& rows) {
  std::ostringstream os;
  for (std::size_t i = 0; i < rows.size(); ++i) os << (i > 0 ? "," : "") << rows[i];
  return os.str();
}

struct SweepProblem {
  bool masked = false;
  std::vector<std::int32_t> rows;  // masked: masked_m, within [0, M_max]; contiguous: rows per group
  // Masked, when not empty: the counts the launch reads, one above M_max and one negative, which the
  // kernel clamps to `rows`.
  std::vector<std::int32_t> device_rows;
  std::int64_t m_max = 0;       // masked
  std::int64_t expected_m = 0;  // masked: the launch's hint (mostly the mean; else 0, M_max, far off)
  std::int64_t n = 0, k = 0;
  bool holes = false;                // contiguous: -1 rows inside groups
  std::int64_t trailing_blocks = 0;  // contiguous: all-padding 128-row blocks at the end

  std::string describe() const {
    std::ostringstream os;
    os << (masked ? "masked" : "contiguous") << " G " << rows.size() << ", N " << n << ", K " << k;
    if (masked) {
      os << ", M_max " << m_max << ", expected_m " << expected_m << ", masked_m " << rows_text(rows);
      if (!device_rows.empty()) os << " (on the device: " << rows_text(device_rows) << ")";
    } else {
      os << ", holes " << holes << ", trailing blocks " << trailing_blocks << ", rows " << rows_text(rows);
    }
    return os.str();
  }
};

// N and K (multiples of 128, up to 7168) drawn, then halved in turn until the reference's multiply-adds
// (valid rows x N x K) fit the sweep's budget.
inline void draw_n_k(std::mt19937_64& rng, SweepProblem& p) {
  constexpr std::int64_t kBudget = 1'500'000'000;
  std::int64_t rows = 0;
  for (const std::int32_t r : p.rows) rows += r;
  p.n = 128 * pick<std::int64_t>(rng, {1, 2, 3, 4, 8, 12, 16, 32, 56});
  p.k = 128 * pick<std::int64_t>(rng, {1, 2, 3, 9, 16, 32, 56});
  const auto halve = [](std::int64_t& v) { v = std::max<std::int64_t>(128, v / 2 / 128 * 128); };
  while (rows * p.n * p.k > kBudget && (p.n > 128 || p.k > 128)) halve(p.n >= p.k ? p.n : p.k);
}

inline SweepProblem draw_masked_problem(std::mt19937_64& rng) {
  SweepProblem p;
  p.masked = true;
  const std::int64_t G = pick<std::int64_t>(rng, {1, 2, 3, 7, 16, 32, 48});
  const std::int64_t expected =
      pick<std::int64_t>(rng, {1, 4, 8, 9, 16, 19, 24, 32, 33, 48, 64, 65, 96, 128, 129, 192, 256});
  p.m_max = uniform(rng, 0, 3) == 0 ? expected : expected * 13 / 10 + uniform(rng, 1, 80);
  p.rows = random_rows(rng, G, expected, p.m_max);
  if (G >= 2 && uniform(rng, 0, 4) == 0) {
    const auto high = static_cast<std::size_t>(uniform(rng, 0, G - 1));
    const auto low = (high + 1) % static_cast<std::size_t>(G);
    p.rows[high] = static_cast<std::int32_t>(p.m_max);
    p.rows[low] = 0;
    p.device_rows = p.rows;
    p.device_rows[high] = static_cast<std::int32_t>(p.m_max + uniform(rng, 1, 100));
    p.device_rows[low] = static_cast<std::int32_t>(-uniform(rng, 1, 5));
  }
  draw_n_k(rng, p);
  std::int64_t mean = 0;
  for (const std::int32_t r : p.rows) mean += r;
  mean /= G;
  const std::int64_t hints[] = {mean, mean, mean, mean, mean, mean, 0, p.m_max, mean / 8, 4 * mean + 1};
  p.expected_m = hints[uniform(rng, 0, 9)];
  return p;
}

inline SweepProblem draw_contiguous_problem(std::mt19937_64& rng) {
  SweepProblem p;
  const std::int64_t G = pick<std::int64_t>(rng, {1, 2, 5, 8, 16, 33, 64});
  const std::int64_t expected = pick<std::int64_t>(rng, {1, 16, 64, 100, 128, 129, 200, 256, 512, 1024});
  p.rows = random_rows(rng, G, expected, 2 * expected);
  draw_n_k(rng, p);
  p.holes = uniform(rng, 0, 3) == 0;
  p.trailing_blocks = uniform(rng, 0, 2);
  return p;
}

// Problems per sweep test.
inline constexpr int kSweepProblems = 24;

}  // namespace epmoe::testing
