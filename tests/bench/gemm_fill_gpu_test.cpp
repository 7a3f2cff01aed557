// The grouped GEMM benchmark's quantized-normal operands (src/bench/suite_gemm_fill.hpp): every
// block's largest magnitude is exactly 448 (its scale makes it so), no NaN, and the values are
// spread like a normal's, not constant.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "bench/suite_gemm_fill.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "gpu_test_util.hpp"

namespace epmoe::bench {
namespace {

// e4m3 (OCP, as __nv_fp8_e4m3): sign, 4 exponent bits (bias 7), 3 mantissa bits; 0x7f / 0xff NaN.
float e4m3_value(std::uint8_t b) {
  const int sign = b >> 7, exponent = (b >> 3) & 15, mantissa = b & 7;
  const float magnitude = exponent == 0
                              ? std::ldexp(static_cast<float>(mantissa) / 8.0f, -6)
                              : std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
  return sign ? -magnitude : magnitude;
}

std::vector<std::uint8_t> filled(std::int64_t rows, std::int64_t cols, std::int64_t block_rows) {
  const cuda::DeviceTensor x(DType::fp8_e4m3, {rows, cols});
  x.fill_bytes(0x7f, nullptr);  // NaN: every byte must be written
  fill_quantized_normal_fp8(x, block_rows, 12345, nullptr);
  const HostTensor host = cuda::to_host(x, nullptr);
  const auto* p = static_cast<const std::uint8_t*>(host.view().data);
  return std::vector<std::uint8_t>(p, p + rows * cols);
}

TEST(GemmFillGpu, EachRowBlockPeaksAt448) {
  EPMOE_REQUIRE_GPU();
  const std::int64_t rows = 130, cols = 384;  // a partial last 128-row tile
  const std::vector<std::uint8_t> x = filled(rows, cols, 1);
  std::int64_t nonzero = 0;
  double sum_sq = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t b = 0; b < cols / 128; ++b) {
      float amax = 0;
      for (std::int64_t c = 0; c < 128; ++c) {
        const std::uint8_t byte = x[static_cast<std::size_t>(r * cols + b * 128 + c)];
        ASSERT_NE(byte & 0x7f, 0x7f) << "NaN at row " << r << ", column " << b * 128 + c;
        const float v = e4m3_value(byte);
        amax = std::max(amax, std::fabs(v));
        nonzero += v != 0.0f;
        sum_sq += static_cast<double>(v) * v;
      }
      EXPECT_EQ(amax, 448.0f) << "row " << r << ", block " << b;
    }
  }
  EXPECT_GT(nonzero, rows * cols * 9 / 10);
  // The largest of 128 normals is ~2.6 sigma, so the values' rms is ~448 / 2.6: far from 448 (a
  // constant) and from 0.
  const double rms = std::sqrt(sum_sq / static_cast<double>(rows * cols));
  EXPECT_GT(rms, 100.0);
  EXPECT_LT(rms, 250.0);
}

TEST(GemmFillGpu, Each128x128BlockPeaksAt448) {
  EPMOE_REQUIRE_GPU();
  const std::int64_t rows = 256, cols = 256;
  const std::vector<std::uint8_t> x = filled(rows, cols, 128);
  for (std::int64_t rb = 0; rb < rows / 128; ++rb) {
    for (std::int64_t cb = 0; cb < cols / 128; ++cb) {
      float amax = 0;
      int rows_at_448 = 0;
      for (std::int64_t r = rb * 128; r < rb * 128 + 128; ++r) {
        float row_max = 0;
        for (std::int64_t c = cb * 128; c < cb * 128 + 128; ++c) {
          const std::uint8_t byte = x[static_cast<std::size_t>(r * cols + c)];
          ASSERT_NE(byte & 0x7f, 0x7f) << "NaN at " << r << ", " << c;
          row_max = std::max(row_max, std::fabs(e4m3_value(byte)));
        }
        amax = std::max(amax, row_max);
        rows_at_448 += row_max == 448.0f;
      }
      EXPECT_EQ(amax, 448.0f) << "block " << rb << ", " << cb;
      // Per-row scales would put 448 in all 128 rows; one per block, in the few whose largest value
      // rounds to it (within 3.5% of the block's maximum).
      EXPECT_LT(rows_at_448, 64) << "one scale per 128 x 128 block, not per row";
    }
  }
}

TEST(GemmFillGpu, RefusesBadShapes) {
  EPMOE_REQUIRE_GPU();
  const cuda::DeviceTensor odd(DType::fp8_e4m3, {4, 100});
  testing::expect_error_mentions([&] { fill_quantized_normal_fp8(odd, 1, 1, nullptr); }, "cols % 128");
  const cuda::DeviceTensor x(DType::fp8_e4m3, {4, 128});
  testing::expect_error_mentions([&] { fill_quantized_normal_fp8(x, 64, 1, nullptr); }, "block_rows");
}

}  // namespace
}  // namespace epmoe::bench
