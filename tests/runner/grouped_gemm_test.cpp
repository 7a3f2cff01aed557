// The CPU reference of the FP8 block-scaled grouped GEMM: known answers, skipped rows left
// untouched, agreement with an independent dequantize-then-multiply, and bad arguments refused.
#include "epmoe/grouped_gemm.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>

#include "epmoe/quant.hpp"
#include "expect_error.hpp"

namespace epmoe {
namespace {

using testing::message_of;

void fill_fp8(HostTensor& t, float value) {
  const fp8_e4m3 q = fp8_e4m3::from_float(value);
  ASSERT_EQ(q.to_float(), value) << "not exact in e4m3";
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data<fp8_e4m3>()[i] = q;
}
void fill_f32(HostTensor& t, float value) {
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = value;
}

// Random e4m3 codes that are normal numbers (never zero, never NaN), random sign.
void fill_random_fp8(HostTensor& t, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> exponent(4, 10), mant(0, 7), sign(0, 1);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    t.data<fp8_e4m3>()[i] =
        fp8_e4m3::from_bits(static_cast<std::uint8_t>((sign(rng) << 7) | (exponent(rng) << 3) | mant(rng)));
  }
}
void fill_random_scales(HostTensor& t, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(0.5f, 2.0f);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = u(rng) * 0.01f;
}

constexpr std::uint16_t kPoisonBits = 0xffff;  // bf16 NaN: never a valid output

TEST(GroupedGemmCpu, ContiguousKnownAnswer) {
  // G = 2, N = 128, K = 256. a = 1, b[0] = 0.5, b[1] = -2; scales differ per K block. The contiguous
  // layout: group 0's rows in the first 128-row block, group 1's in the second, -1 between and after.
  const std::int64_t M = 133, N = 128, K = 256;
  HostTensor a(DType::fp8_e4m3, {M, K}), sa(DType::f32, {M, 2}), b(DType::fp8_e4m3, {2, N, K}),
      sb(DType::f32, {2, 1, 2}), ids(DType::i32, {M}), d(DType::bf16, {M, N});
  fill_fp8(a, 1.0f);
  for (std::int64_t i = 0; i < N * K; ++i) {
    b.data<fp8_e4m3>()[i] = fp8_e4m3::from_float(0.5f);
    b.data<fp8_e4m3>()[N * K + i] = fp8_e4m3::from_float(-2.0f);
  }
  for (std::int64_t m = 0; m < M; ++m) {
    sa.data<float>()[m * 2 + 0] = 1.0f + static_cast<float>(m);  // block 0
    sa.data<float>()[m * 2 + 1] = 0.25f;                         // block 1
  }
  sb.data<float>()[0] = 2.0f;  // group 0, block 0
  sb.data<float>()[1] = 4.0f;  // group 0, block 1
  sb.data<float>()[2] = 0.5f;  // group 1, block 0
  sb.data<float>()[3] = 1.0f;  // group 1, block 1
  std::int32_t groups[M];
  for (std::int64_t m = 0; m < M; ++m) groups[m] = m < 128 ? (m % 3 == 1 ? -1 : 0) : (m == 130 ? -1 : 1);
  std::memcpy(ids.data<std::int32_t>(), groups, sizeof(groups));
  d.fill_bytes(0xff);
  grouped_gemm_contiguous_cpu(a, sa, b, sb, ids, d);

  for (std::int64_t m = 0; m < M; ++m) {
    for (std::int64_t n = 0; n < N; ++n) {
      const bf16 got = d.data<bf16>()[m * N + n];
      if (groups[m] < 0) {
        EXPECT_EQ(got.bits, kPoisonBits) << "row " << m << " must be left untouched";
        continue;
      }
      const double bv = groups[m] == 0 ? 0.5 : -2.0;
      const float* sbg = sb.data<float>() + groups[m] * 2;
      // Σ over 128 values of 1 * bv, per block, times the block's scales.
      const double want =
          128.0 * bv * (sa.data<float>()[m * 2] * sbg[0] + sa.data<float>()[m * 2 + 1] * sbg[1]);
      EXPECT_EQ(got.to_float(), bf16::from_float(static_cast<float>(want)).to_float())
          << "d[" << m << ", " << n << "]";
    }
  }
  // Row 0: 128 * 0.5 * (1 * 2 + 0.25 * 4) = 192, exactly.
  EXPECT_EQ(d.data<bf16>()[0].to_float(), 192.0f);
}

// A 128-row block that holds two groups' rows (not the contiguous layout: each group is padded to 128
// rows) is refused, naming the row: the GPU kernels take each block as one group's and would leave rows of
// the other unwritten.
TEST(GroupedGemmCpu, ContiguousBlockOfTwoGroupsIsRefused) {
  const std::int64_t M = 4, N = 128, K = 128;
  HostTensor a(DType::fp8_e4m3, {M, K}), sa(DType::f32, {M, 1}), b(DType::fp8_e4m3, {2, N, K}),
      sb(DType::f32, {2, 1, 1}), ids(DType::i32, {M}), d(DType::bf16, {M, N});
  fill_fp8(a, 1.0f);
  fill_f32(sa, 1.0f);
  fill_f32(sb, 1.0f);
  const std::int32_t groups[M] = {0, 0, -1, 1};
  std::memcpy(ids.data<std::int32_t>(), groups, sizeof(groups));
  testing::expect_error_mentions([&] { grouped_gemm_contiguous_cpu(a, sa, b, sb, ids, d); },
                                 "m_indices[3] = 1 shares the 128-row block of rows [0, 128) with group 0");
}

TEST(GroupedGemmCpu, NonUniformColumnsAndWeightBlocks) {
  // N = 256 spans two weight-scale blocks; b varies along n and k.
  const std::int64_t M = 3, N = 256, K = 128;
  HostTensor a(DType::fp8_e4m3, {M, K}), sa(DType::f32, {M, 1}), b(DType::fp8_e4m3, {1, N, K}),
      sb(DType::f32, {1, 2, 1}), ids(DType::i32, {M}), d(DType::f64, {M, N});
  fill_f32(sa, 1.0f);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t k = 0; k < K; ++k)
      a.data<fp8_e4m3>()[m * K + k] = fp8_e4m3::from_float(k % 2 == 0 ? 1.0f : static_cast<float>(m + 1));
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t k = 0; k < K; ++k)
      b.data<fp8_e4m3>()[n * K + k] = fp8_e4m3::from_float(k < 64 ? 1.0f : (n % 2 == 0 ? 0.5f : -0.5f));
  sb.data<float>()[0] = 1.0f;
  sb.data<float>()[1] = 8.0f;
  for (std::int64_t m = 0; m < M; ++m) ids.data<std::int32_t>()[m] = 0;
  grouped_gemm_contiguous_cpu(a, sa, b, sb, ids, d);
  for (std::int64_t m = 0; m < M; ++m) {
    for (std::int64_t n = 0; n < N; ++n) {
      // k < 64: 32 even k (a = 1) + 32 odd k (a = m + 1), b = 1; k >= 64: the same counts, b = ±0.5.
      const double per_half = 32.0 * 1.0 + 32.0 * static_cast<double>(m + 1);
      const double want = (per_half + per_half * (n % 2 == 0 ? 0.5 : -0.5)) * (n < 128 ? 1.0 : 8.0);
      EXPECT_EQ(d.data<double>()[m * N + n], want) << "d[" << m << ", " << n << "]";
    }
  }
}

TEST(GroupedGemmCpu, MaskedSkipsRowsPastTheCount) {
  const std::int64_t G = 3, M_max = 5, N = 128, K = 128;
  HostTensor a(DType::fp8_e4m3, {G, M_max, K}), sa(DType::f32, {G, M_max, 1}), b(DType::fp8_e4m3, {G, N, K}),
      sb(DType::f32, {G, 1, 1}), counts(DType::i32, {G}), d(DType::bf16, {G, M_max, N});
  fill_fp8(a, 2.0f);
  fill_f32(sa, 0.5f);
  for (std::int64_t g = 0; g < G; ++g) {
    for (std::int64_t i = 0; i < N * K; ++i)
      b.data<fp8_e4m3>()[g * N * K + i] = fp8_e4m3::from_float(static_cast<float>(g + 1));
    sb.data<float>()[g] = 1.0f / 64.0f;
  }
  const std::int32_t valid[G] = {0, 5, 2};
  std::memcpy(counts.data<std::int32_t>(), valid, sizeof(valid));
  // NaN codes where nothing is read (group 2's rows past its count; group 0's weights, which no row uses)
  // are accepted; one in a row the GEMM reads is refused.
  a.data<fp8_e4m3>()[(2 * M_max + 3) * K + 7] = fp8_e4m3::from_bits(0x7f);
  b.data<fp8_e4m3>()[5] = fp8_e4m3::from_bits(0xff);
  a.data<fp8_e4m3>()[(1 * M_max + 4) * K + 9] = fp8_e4m3::from_bits(0x7f);
  EXPECT_THROW(grouped_gemm_masked_cpu(a, sa, b, sb, counts, d), Error);
  a.data<fp8_e4m3>()[(1 * M_max + 4) * K + 9] = fp8_e4m3::from_float(2.0f);
  // The same for the scales: a zero or negative scale in a row past the count passes, in a read row it is
  // refused (the GPU kernels' power-of-two scale path has no sign).
  sa.data<float>()[2 * M_max + 4] = 0.0f;
  sa.data<float>()[1 * M_max + 2] = -0.5f;
  EXPECT_NE(message_of([&] {
              grouped_gemm_masked_cpu(a, sa, b, sb, counts, d);
            }).find("a_scales must be positive: row 7 block 0 is -0.5"),
            std::string::npos);
  sa.data<float>()[1 * M_max + 2] = 0.5f;
  d.fill_bytes(0xff);
  grouped_gemm_masked_cpu(a, sa, b, sb, counts, d);
  for (std::int64_t g = 0; g < G; ++g) {
    for (std::int64_t r = 0; r < M_max; ++r) {
      for (std::int64_t n = 0; n < N; ++n) {
        const bf16 got = d.data<bf16>()[(g * M_max + r) * N + n];
        if (r >= valid[g]) {
          ASSERT_EQ(got.bits, kPoisonBits) << "group " << g << " row " << r << " must be left untouched";
        } else {
          // 128 * 2 * (g + 1) * 0.5 / 64 = 2 (g + 1)
          ASSERT_EQ(got.to_float(), 2.0f * static_cast<float>(g + 1)) << "group " << g << " row " << r;
        }
      }
    }
  }
}

// An independent path: dequantize both operands with the quantizers' dequantizers, multiply in f64.
TEST(GroupedGemmCpu, AgreesWithDequantizeThenMultiply) {
  std::mt19937_64 rng(12345);
  const std::int64_t G = 3, N = 384, K = 512, M = 384;
  HostTensor a(DType::fp8_e4m3, {M, K}), sa(DType::f32, {M, K / 128}), b(DType::fp8_e4m3, {G, N, K}),
      sb(DType::f32, {G, N / 128, K / 128}), ids(DType::i32, {M}), d(DType::f64, {M, N}),
      d16(DType::bf16, {M, N});
  fill_random_fp8(a, rng);
  fill_random_fp8(b, rng);
  fill_random_scales(sa, rng);
  fill_random_scales(sb, rng);
  // Groups of 128-row blocks: 2, -1 (padding), 0, with a few padding rows at the end of each block.
  for (std::int64_t m = 0; m < M; ++m) {
    const std::int32_t g = m < 128 ? 2 : m < 256 ? -1 : 0;
    ids.data<std::int32_t>()[m] = (m % 128) >= 120 ? -1 : g;
  }
  grouped_gemm_contiguous_cpu(a, sa, b, sb, ids, d);
  grouped_gemm_contiguous_cpu(a, sa, b, sb, ids, d16);

  HostTensor af(DType::f32, {M, K});
  dequantize_per_token_group_fp8(a, sa, af);
  std::vector<HostTensor> bf;
  for (std::int64_t g = 0; g < G; ++g) {
    HostTensor bg(DType::fp8_e4m3, {N, K}), sbg(DType::f32, {N / 128, K / 128});
    std::memcpy(bg.data<fp8_e4m3>(), b.data<fp8_e4m3>() + g * N * K, static_cast<std::size_t>(N * K));
    std::memcpy(sbg.data<float>(), sb.data<float>() + g * (N / 128) * (K / 128), sbg.nbytes());
    bf.emplace_back(DType::f32, std::initializer_list<std::int64_t>{N, K});
    dequantize_block_fp8(bg, sbg, bf.back());
  }
  for (std::int64_t m = 0; m < M; ++m) {
    const std::int32_t g = ids.data<std::int32_t>()[m];
    if (g < 0) continue;
    for (std::int64_t n = 0; n < N; ++n) {
      double want = 0;
      for (std::int64_t k = 0; k < K; ++k)
        want += static_cast<double>(af.data<float>()[m * K + k]) *
                bf[static_cast<std::size_t>(g)].data<float>()[n * K + k];
      const double got = d.data<double>()[m * N + n];
      // The dequantizers round each product's scale into f32 first: a few f32 ulps per term.
      ASSERT_NEAR(got, want, 1e-5 * (std::fabs(want) + 1.0)) << "d[" << m << ", " << n << "]";
      ASSERT_EQ(d16.data<bf16>()[m * N + n].bits, bf16::from_float(static_cast<float>(got)).bits);
    }
  }
}

TEST(GroupedGemmCpu, RefusesBadArguments) {
  const std::int64_t M = 4, N = 128, K = 256, G = 2;
  HostTensor a(DType::fp8_e4m3, {M, K}), sa(DType::f32, {M, 2}), b(DType::fp8_e4m3, {G, N, K}),
      sb(DType::f32, {G, 1, 2}), ids(DType::i32, {M}), d(DType::bf16, {M, N});
  fill_f32(sa, 1.0f);
  fill_f32(sb, 1.0f);
  EXPECT_NO_THROW(grouped_gemm_contiguous_cpu(a, sa, b, sb, ids, d));

  ids.data<std::int32_t>()[2] = 2;
  EXPECT_NE(message_of([&] {
              grouped_gemm_contiguous_cpu(a, sa, b, sb, ids, d);
            }).find("m_indices[2] = 2 must be -1 or a group in [0, 2)"),
            std::string::npos);
  ids.data<std::int32_t>()[2] = -2;
  EXPECT_NE(message_of([&] { grouped_gemm_contiguous_cpu(a, sa, b, sb, ids, d); }).find("m_indices[2] = -2"),
            std::string::npos);
  ids.data<std::int32_t>()[2] = 0;
  // Scales: a padding row's (m_indices -1) are not read, so zero passes; a read row's second K block
  // negative is refused by row and block.
  ids.data<std::int32_t>()[3] = -1;
  sa.data<float>()[3 * 2 + 0] = 0.0f;
  EXPECT_NO_THROW(grouped_gemm_contiguous_cpu(a, sa, b, sb, ids, d));
  sa.data<float>()[1 * 2 + 1] = -2.0f;
  EXPECT_NE(message_of([&] {
              grouped_gemm_contiguous_cpu(a, sa, b, sb, ids, d);
            }).find("a_scales must be positive: row 1 block 1 is -2"),
            std::string::npos);
  fill_f32(sa, 1.0f);
  ids.data<std::int32_t>()[3] = 0;

  HostTensor a_bf16(DType::bf16, {M, K});
  EXPECT_NE(message_of([&] {
              grouped_gemm_contiguous_cpu(a_bf16, sa, b, sb, ids, d);
            }).find("a must have dtype fp8_e4m3"),
            std::string::npos);
  HostTensor a_k(DType::fp8_e4m3, {M, 200}), b_k(DType::fp8_e4m3, {G, N, 200});
  EXPECT_NE(
      message_of([&] { grouped_gemm_contiguous_cpu(a_k, sa, b_k, sb, ids, d); }).find("multiple of 128"),
      std::string::npos);
  HostTensor a_wrong_k(DType::fp8_e4m3, {M, 384});
  EXPECT_NE(message_of([&] { grouped_gemm_contiguous_cpu(a_wrong_k, sa, b, sb, ids, d); }).find("b (K of a)"),
            std::string::npos);
  HostTensor sb_bad(DType::f32, {G, 2, 2});
  EXPECT_NE(message_of([&] {
              grouped_gemm_contiguous_cpu(a, sa, b, sb_bad, ids, d);
            }).find("b_scales must have shape"),
            std::string::npos);
  HostTensor sa_bad(DType::f32, {2, M});
  EXPECT_NE(message_of([&] {
              grouped_gemm_contiguous_cpu(a, sa_bad, b, sb, ids, d);
            }).find("a_scales must have shape"),
            std::string::npos);
  HostTensor ids_bad(DType::i32, {M + 1});
  EXPECT_NE(message_of([&] {
              grouped_gemm_contiguous_cpu(a, sa, b, sb, ids_bad, d);
            }).find("m_indices must have shape"),
            std::string::npos);
  HostTensor d_f32(DType::f32, {M, N});
  EXPECT_NE(message_of([&] {
              grouped_gemm_contiguous_cpu(a, sa, b, sb, ids, d_f32);
            }).find("d must be bf16 or f64"),
            std::string::npos);
  HostTensor d_bad(DType::bf16, {M, N + 128});
  EXPECT_NE(
      message_of([&] { grouped_gemm_contiguous_cpu(a, sa, b, sb, ids, d_bad); }).find("d must have shape"),
      std::string::npos);
  sb.data<float>()[1] = std::nanf("");
  EXPECT_NE(message_of([&] {
              grouped_gemm_contiguous_cpu(a, sa, b, sb, ids, d);
            }).find("b_scales must be positive and finite"),
            std::string::npos);
  fill_f32(sb, 1.0f);
  TensorView on_gpu = a.view();
  on_gpu.device = Device::cuda;
  EXPECT_NE(
      message_of([&] { grouped_gemm_contiguous_cpu(on_gpu, sa, b, sb, ids, d); }).find("a must live on cpu"),
      std::string::npos);

  // Masked.
  const std::int64_t M_max = 3;
  HostTensor am(DType::fp8_e4m3, {G, M_max, K}), sam(DType::f32, {G, M_max, 2}), counts(DType::i32, {G}),
      dm(DType::bf16, {G, M_max, N});
  fill_f32(sam, 1.0f);
  EXPECT_NO_THROW(grouped_gemm_masked_cpu(am, sam, b, sb, counts, dm));
  counts.data<std::int32_t>()[1] = 4;
  EXPECT_NE(message_of([&] {
              grouped_gemm_masked_cpu(am, sam, b, sb, counts, dm);
            }).find("masked_m[1] = 4 must be in [0, 3]"),
            std::string::npos);
  counts.data<std::int32_t>()[1] = -1;
  EXPECT_NE(message_of([&] { grouped_gemm_masked_cpu(am, sam, b, sb, counts, dm); }).find("masked_m[1] = -1"),
            std::string::npos);
  counts.data<std::int32_t>()[1] = 1;
  HostTensor b3(DType::fp8_e4m3, {G + 1, N, K});
  EXPECT_NE(
      message_of([&] { grouped_gemm_masked_cpu(am, sam, b3, sb, counts, dm); }).find("b (G and K of a)"),
      std::string::npos);
  HostTensor counts_bad(DType::i64, {G});
  EXPECT_NE(message_of([&] {
              grouped_gemm_masked_cpu(am, sam, b, sb, counts_bad, dm);
            }).find("masked_m must have dtype i32"),
            std::string::npos);
  HostTensor dm_bad(DType::bf16, {G, M_max + 1, N});
  EXPECT_NE(
      message_of([&] { grouped_gemm_masked_cpu(am, sam, b, sb, counts, dm_bad); }).find("d must have shape"),
      std::string::npos);
}

}  // namespace
}  // namespace epmoe
