// Quantizers and dequantizers (quant.hpp): known answers, round trips and argument validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <utility>

#include "epmoe/quant.hpp"
#include "expect_error.hpp"
#include "test_random.hpp"

namespace epmoe {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Runs f, expecting an epmoe::Error whose message contains every needle.

// Random values whose magnitude spans several binades (never zero).
HostTensor random_f32(std::initializer_list<std::int64_t> shape, std::uint32_t seed, float spread = 6.0f) {
  HostTensor t(DType::f32, shape);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> log2_mag(-spread, spread);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    t.data<float>()[i] = std::exp2(log2_mag(rng)) * ((rng() & 1) ? -1.0f : 1.0f);
  }
  return t;
}

// Largest representable magnitude gap around a dequantized FP8 value: half a step of the e4m3 grid
// (relative 2^-4 for normals, absolute 2^-10 * scale for subnormals), plus the f32 division's rounding.
void expect_fp8_close(float x, float deq, float scale) {
  const float bound = (std::fabs(x) * 0x1p-4f + 0x1p-10f * scale) * (1.0f + 1e-5f);
  EXPECT_LE(std::fabs(deq - x), bound) << "x = " << x << ", dequantized " << deq << ", scale " << scale;
}

bool is_power_of_two(float s) {
  int e = 0;
  return std::frexp(s, &e) == 0.5f;
}

// ================================================================ scales

TEST(QuantScale, KnownAnswers) {
  EXPECT_EQ(fp8_scale_for_amax(448.0f, false), 1.0f);
  EXPECT_EQ(fp8_scale_for_amax(896.0f, false), 2.0f);
  EXPECT_EQ(fp8_scale_for_amax(1.0f, false), 1.0f / 448.0f);
  EXPECT_EQ(fp8_scale_for_amax(0.0f, false), kMinAmax / 448.0f);
  EXPECT_EQ(fp8_scale_for_amax(1e-20f, false), kMinAmax / 448.0f);
  EXPECT_TRUE(std::isfinite(fp8_scale_for_amax(0.0f, false)));
  EXPECT_GT(fp8_scale_for_amax(0.0f, false), 0.0f);
}

TEST(QuantScale, PowerOfTwoRoundsUp) {
  EXPECT_EQ(fp8_scale_for_amax(448.0f, true), 1.0f);    // already a power of two: kept
  EXPECT_EQ(fp8_scale_for_amax(14.0f, true), 0x1p-5f);  // 14 / 448 = 2^-5 exactly
  EXPECT_EQ(fp8_scale_for_amax(449.0f, true), 2.0f);
  EXPECT_EQ(fp8_scale_for_amax(300.0f, true), 1.0f);
  EXPECT_EQ(fp8_scale_for_amax(224.0f, true), 0.5f);
  EXPECT_EQ(fp8_scale_for_amax(225.0f, true), 1.0f);
  EXPECT_EQ(fp8_scale_for_amax(1.0f, true), 0x1p-8f);  // 1/448 in (2^-9, 2^-8]
  EXPECT_EQ(fp8_scale_for_amax(std::nextafter(448.0f, 0.0f), true), 1.0f);
  const float zero_scale = fp8_scale_for_amax(0.0f, true);
  EXPECT_TRUE(is_power_of_two(zero_scale));
  EXPECT_GE(zero_scale, kMinAmax / 448.0f);
  EXPECT_LT(zero_scale / 2, kMinAmax / 448.0f);
  // Random amax over many binades: the smallest power of two not below the plain scale.
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> log2_mag(-30.0f, 30.0f);
  for (int i = 0; i < 10000; ++i) {
    const float amax = std::exp2(log2_mag(rng)) * (1.0f + static_cast<float>(rng() % 1000) / 1000.0f);
    const float plain = fp8_scale_for_amax(amax, false);
    const float p2 = fp8_scale_for_amax(amax, true);
    ASSERT_TRUE(is_power_of_two(p2)) << amax;
    ASSERT_GE(p2, plain) << amax;
    ASSERT_LT(p2 / 2, plain) << amax;
  }
}

TEST(QuantScale, RefusesBadAmax) {
  testing::expect_error_mentions([] { fp8_scale_for_amax(kNaN, false); }, {"amax"});
  testing::expect_error_mentions([] { fp8_scale_for_amax(kInf, true); }, {"amax"});
  testing::expect_error_mentions([] { fp8_scale_for_amax(-1.0f, false); }, {"amax"});
}

// ================================================================ per-token-group FP8

TEST(QuantPerTokenGroup, KnownAnswers) {
  // Two tokens, K = 8, groups of 4.
  HostTensor x(DType::f32, {2, 8});
  float* xs = x.data<float>();
  // Token 0, group 0: amax 448 -> scale 1 and exact codes.
  const float g00[4] = {448.0f, -1.0f, 0.5f, 3.0f};
  // Token 0, group 1: amax 896 -> scale 2; 2.2 / 2 = 1.1 -> 1.125.
  const float g01[4] = {-896.0f, 2.0f, 2.2f, 0.0f};
  // Token 1, group 0: all zeros. Token 1, group 1: amax 7 -> scale 1/64; 7 * 64 = 448.
  const float g11[4] = {7.0f, -3.5f, 0.25f, 1.0f};
  for (int j = 0; j < 4; ++j) {
    xs[j] = g00[j];
    xs[4 + j] = g01[j];
    xs[8 + j] = 0.0f;
    xs[12 + j] = g11[j];
  }
  HostTensor q(DType::fp8_e4m3, {2, 8});
  HostTensor s(DType::f32, {2, 2});
  quantize_per_token_group_fp8(x, q, s, 4);
  const float* ss = s.data<float>();
  EXPECT_EQ(ss[0], 1.0f);
  EXPECT_EQ(ss[1], 2.0f);
  EXPECT_EQ(ss[2], kMinAmax / 448.0f);
  EXPECT_EQ(ss[3], 7.0f / 448.0f);
  const std::uint8_t want[16] = {0x7e, 0xb8, 0x30, 0x44, 0xfe, 0x38, 0x39, 0x00,
                                 0x00, 0x00, 0x00, 0x00, 0x7e, 0xf6, 0x58, 0x68};
  for (int i = 0; i < 16; ++i) EXPECT_EQ(q.data<fp8_e4m3>()[i].bits, want[i]) << "element " << i;

  HostTensor out(DType::f32, {2, 8});
  out.fill_bytes(0xff);
  dequantize_per_token_group_fp8(q, s, out, 4);
  const float deq[16] = {448.0f, -1.0f, 0.5f, 3.0f, -896.0f, 2.0f,  2.25f, 0.0f,
                         0.0f,   0.0f,  0.0f, 0.0f, 7.0f,    -3.5f, 0.25f, 1.0f};
  for (int i = 0; i < 16; ++i) EXPECT_EQ(out.data<float>()[i], deq[i]) << "element " << i;
}

// f32 -> bf16 by its definition, independent of bf16::from_float's carry trick: of the two bf16 values
// around x (x's bits truncated to the top 16, and the next one away from zero), the nearer, the even one
// on a tie (finite x).
std::uint16_t bf16_nearest_even(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t low = u & 0xffff0000u;
  const float below = std::bit_cast<float>(low), above = std::bit_cast<float>(low + 0x10000u);
  // (Past bf16's largest, the next value is 2^128, which f32 holds only as Inf.)
  const double above_d = std::isinf(above) ? std::copysign(0x1p128, static_cast<double>(x)) : above;
  const double d_below = std::fabs(static_cast<double>(x) - below);
  const double d_above = std::fabs(above_d - x);
  const bool up = d_above < d_below || (d_above == d_below && ((low >> 16) & 1u) != 0);
  return static_cast<std::uint16_t>((up ? low + 0x10000u : low) >> 16);
}

// f32 -> bf16: round to nearest even at bit 16 of the f32 pattern, any rank.
TEST(QuantBf16, RoundsToNearestEvenAnyRank) {
  HostTensor x(DType::f32, {2, 3, 4});
  float* v = x.data<float>();
  v[0] = 1.0f + 0x1p-8f;       // half way between 1 and 1 + 2^-7: to the even 1
  v[1] = 1.0f + 3 * 0x1p-8f;   // half way between 1 + 2^-7 and 1 + 2^-6: to the even 1 + 2^-6
  v[2] = 1.0f + 0x1.2p-8f;     // past half way: up
  v[3] = -(1.0f + 0x1.2p-8f);  // the same below zero
  v[4] = 0x1.fep127f;          // bf16's largest: kept
  v[5] = 0x1p-130f;            // subnormal, kept
  v[6] = -0.0f;
  v[7] = std::numeric_limits<float>::max();  // past half way to 2^128: Inf (not saturating)
  v[8] = -0x1.ffp127f;                       // the tie there: to the even -2^128, i.e. -Inf
  v[9] = 0x1.fefffep127f;                    // just below the tie: the largest
  testing::SeededRng rng;
  for (int i = 10; i < 24; ++i)
    v[i] = std::ldexp(std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng), i - 16);
  HostTensor b = to_bf16(x);
  ASSERT_EQ(b.dtype(), DType::bf16);
  ASSERT_EQ(b.view().rank, 3);
  EXPECT_EQ(b.size(0), 2);
  EXPECT_EQ(b.size(1), 3);
  EXPECT_EQ(b.size(2), 4);
  const bf16* o = b.data<bf16>();
  EXPECT_EQ(o[0].to_float(), 1.0f);
  EXPECT_EQ(o[1].to_float(), 1.0f + 0x1p-6f);
  EXPECT_EQ(o[2].to_float(), 1.0f + 0x1p-7f);
  EXPECT_EQ(o[3].to_float(), -(1.0f + 0x1p-7f));
  EXPECT_EQ(o[4].to_float(), 0x1.fep127f);
  EXPECT_EQ(o[5].to_float(), 0x1p-130f);
  EXPECT_EQ(o[6].bits, 0x8000u);
  EXPECT_EQ(o[7].bits, 0x7f80u);
  EXPECT_EQ(o[8].bits, 0xff80u);
  EXPECT_EQ(o[9].to_float(), 0x1.fep127f);
  for (int i = 0; i < 24; ++i) EXPECT_EQ(o[i].bits, bf16_nearest_even(v[i])) << i << ": " << v[i];

  HostTensor into(DType::bf16, {2, 3, 4});
  convert_to_bf16(x, into);
  EXPECT_EQ(std::memcmp(into.view().data, b.view().data, b.nbytes()), 0);

  // Rank 1, and an empty tensor.
  HostTensor x1(DType::f32, {3});
  x1.data<float>()[0] = 2.5f, x1.data<float>()[1] = -0x1.0101p0f, x1.data<float>()[2] = 0x1p100f;
  HostTensor b1 = to_bf16(x1);
  ASSERT_EQ(b1.view().rank, 1);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(b1.data<bf16>()[i].bits, bf16_nearest_even(x1.data<float>()[i])) << i;
  HostTensor empty(DType::f32, {0, 16});
  HostTensor b0 = to_bf16(empty);
  EXPECT_EQ(b0.size(0), 0);
  EXPECT_EQ(b0.size(1), 16);
}

TEST(QuantBf16, RefusesBadArguments) {
  HostTensor x = random_f32({2, 8}, 5);
  HostTensor out(DType::bf16, {2, 8});
  EXPECT_NO_THROW(convert_to_bf16(x, out));
  HostTensor xb(DType::bf16, {2, 8});
  testing::expect_error_mentions([&] { convert_to_bf16(xb, out); }, {"x", "dtype"});
  HostTensor out_f32(DType::f32, {2, 8});
  testing::expect_error_mentions([&] { convert_to_bf16(x, out_f32); }, {"out", "dtype"});
  HostTensor out_shape(DType::bf16, {2, 7});
  testing::expect_error_mentions([&] { convert_to_bf16(x, out_shape); }, {"out", "shape"});
  TensorView on_gpu = x.view();
  on_gpu.device = Device::cuda;
  testing::expect_error_mentions([&] { (void)to_bf16(on_gpu); }, {"x", "cpu"});
  // out over x's own bytes.
  TensorView alias = TensorView::contiguous(x.view().data, DType::bf16, {2, 8});
  testing::expect_error_mentions([&] { convert_to_bf16(x, alias); }, {"out", "overlap"});
  x.data<float>()[3] = std::numeric_limits<float>::quiet_NaN();
  testing::expect_error_mentions([&] { (void)to_bf16(x); }, {"x", "finite", "element 3"});
}

TEST(QuantPerTokenGroup, MatchesDefinitionAndRoundTrips) {
  for (bool pow2 : {false, true}) {
    for (bool use_bf16 : {false, true}) {
      const std::int64_t t = 5, k = 384;
      HostTensor xf = random_f32({t, k}, 11 + pow2 + 2 * use_bf16);
      // Make one group's amax tiny, to exercise the subnormal range, and one group all zeros.
      for (int j = 0; j < 128; ++j) xf.data<float>()[1 * k + j] *= 1e-6f;
      for (int j = 0; j < 128; ++j) xf.data<float>()[2 * k + 256 + j] = 0.0f;
      HostTensor x = use_bf16 ? to_bf16(xf) : std::move(xf);
      HostTensor q(DType::fp8_e4m3, {t, k});
      HostTensor s(DType::f32, {t, k / 128});
      quantize_per_token_group_fp8(x, q, s, 128, pow2);
      HostTensor out(DType::f32, {t, k});
      dequantize_per_token_group_fp8(q, s, out, 128);
      for (std::int64_t i = 0; i < t; ++i) {
        for (std::int64_t g = 0; g < k / 128; ++g) {
          float amax = 0.0f;
          auto val = [&](std::int64_t j) {
            const std::int64_t idx = i * k + g * 128 + j;
            return use_bf16 ? x.data<bf16>()[idx].to_float() : x.data<float>()[idx];
          };
          for (int j = 0; j < 128; ++j) amax = std::max(amax, std::fabs(val(j)));
          const float scale = s.data<float>()[i * (k / 128) + g];
          float want_scale = std::max(amax, kMinAmax) / 448.0f;
          if (pow2) want_scale = std::exp2(std::ceil(std::log2(static_cast<double>(want_scale))));
          ASSERT_EQ(scale, want_scale) << "token " << i << " group " << g;
          for (int j = 0; j < 128; ++j) {
            const std::int64_t idx = i * k + g * 128 + j;
            ASSERT_EQ(q.data<fp8_e4m3>()[idx].bits, fp8_e4m3::from_float(val(j) / scale).bits);
            ASSERT_EQ(out.data<float>()[idx], q.data<fp8_e4m3>()[idx].to_float() * scale);
            expect_fp8_close(val(j), out.data<float>()[idx], scale);
          }
        }
      }
      // The all-zero group: finite scale, zeros out.
      const float zs = s.data<float>()[2 * (k / 128) + 2];
      EXPECT_TRUE(std::isfinite(zs) && zs > 0.0f);
      for (int j = 0; j < 128; ++j) EXPECT_EQ(out.data<float>()[2 * k + 256 + j], 0.0f);
    }
  }
}

TEST(QuantPerTokenGroup, PowerOfTwoScalesGiveExactCodes) {
  // amax 288 -> plain scale 288/448, power-of-two scale 1: every fp8 value stays exact.
  HostTensor x(DType::f32, {1, 4});
  const float v[4] = {288.0f, -1.0f, 0.0625f, -0.875f};
  for (int j = 0; j < 4; ++j) x.data<float>()[j] = v[j];
  HostTensor q(DType::fp8_e4m3, {1, 4});
  HostTensor s(DType::f32, {1, 1});
  quantize_per_token_group_fp8(x, q, s, 4, true);
  EXPECT_EQ(s.data<float>()[0], 1.0f);
  for (int j = 0; j < 4; ++j) EXPECT_EQ(q.data<fp8_e4m3>()[j].to_float(), v[j]);
  quantize_per_token_group_fp8(x, q, s, 4, false);
  EXPECT_EQ(s.data<float>()[0], 288.0f / 448.0f);
  EXPECT_EQ(q.data<fp8_e4m3>()[0].bits, 0x7e);
}

TEST(QuantPerTokenGroup, RefusesBadArguments) {
  HostTensor x = random_f32({2, 256}, 3);
  HostTensor q(DType::fp8_e4m3, {2, 256});
  HostTensor s(DType::f32, {2, 2});
  EXPECT_NO_THROW(quantize_per_token_group_fp8(x, q, s));

  HostTensor xi(DType::i32, {2, 256});
  testing::expect_error_mentions([&] { quantize_per_token_group_fp8(xi, q, s); }, {"x", "f32 or bf16"});
  HostTensor x3(DType::f32, {2, 2, 64});
  testing::expect_error_mentions([&] { quantize_per_token_group_fp8(x3, q, s); }, {"x", "rank 2"});
  HostTensor q_bad(DType::fp8_e4m3, {2, 128});
  testing::expect_error_mentions([&] { quantize_per_token_group_fp8(x, q_bad, s); }, {"q", "shape"});
  HostTensor q_dtype(DType::u8, {2, 256});
  testing::expect_error_mentions([&] { quantize_per_token_group_fp8(x, q_dtype, s); }, {"q", "dtype"});
  HostTensor s_bad(DType::f32, {2, 3});
  testing::expect_error_mentions([&] { quantize_per_token_group_fp8(x, q, s_bad); }, {"scales", "shape"});
  HostTensor s_dtype(DType::bf16, {2, 2});
  testing::expect_error_mentions([&] { quantize_per_token_group_fp8(x, q, s_dtype); }, {"scales", "dtype"});
  testing::expect_error_mentions([&] { quantize_per_token_group_fp8(x, q, s, 96); },
                                 {"x", "multiple of group"});
  testing::expect_error_mentions([&] { quantize_per_token_group_fp8(x, q, s, 0); }, {"group", "positive"});
  testing::expect_error_mentions([&] { quantize_per_token_group_fp8(x, q, s, -128); }, {"group", "positive"});

  TensorView on_gpu = x.view();
  on_gpu.device = Device::cuda;
  testing::expect_error_mentions([&] { quantize_per_token_group_fp8(on_gpu, q, s); }, {"x", "cpu"});
  TensorView strided = x.view();
  strided.shape[0] = 1;
  strided.shape[1] = 128;
  strided.stride[1] = 2;
  HostTensor q1(DType::fp8_e4m3, {1, 128});
  HostTensor s1(DType::f32, {1, 1});
  testing::expect_error_mentions([&] { quantize_per_token_group_fp8(strided, q1, s1); }, {"x", "contiguous"});

  x.data<float>()[300] = kNaN;
  testing::expect_error_mentions([&] { quantize_per_token_group_fp8(x, q, s); }, {"x must be finite", "300"});
  x.data<float>()[300] = -kInf;
  testing::expect_error_mentions([&] { quantize_per_token_group_fp8(x, q, s); }, {"x must be finite"});
  HostTensor xb(DType::bf16, {2, 256});
  xb.data<bf16>()[5] = bf16::from_bits(0x7f80);
  testing::expect_error_mentions([&] { quantize_per_token_group_fp8(xb, q, s); }, {"x must be finite"});
}

TEST(QuantPerTokenGroup, DequantRefusesBadArguments) {
  HostTensor q(DType::fp8_e4m3, {2, 256});
  HostTensor s(DType::f32, {2, 2});
  for (int i = 0; i < 4; ++i) s.data<float>()[i] = 1.0f;
  HostTensor out(DType::f32, {2, 256});
  EXPECT_NO_THROW(dequantize_per_token_group_fp8(q, s, out));
  HostTensor out_bf16(DType::bf16, {2, 256});
  testing::expect_error_mentions([&] { dequantize_per_token_group_fp8(q, s, out_bf16); }, {"out", "dtype"});
  HostTensor out_bad(DType::f32, {2, 255});
  testing::expect_error_mentions([&] { dequantize_per_token_group_fp8(q, s, out_bad); }, {"out", "shape"});
  testing::expect_error_mentions([&] { dequantize_per_token_group_fp8(q, s, out, 100); },
                                 {"q", "multiple of group"});
  s.data<float>()[3] = 0.0f;
  testing::expect_error_mentions([&] { dequantize_per_token_group_fp8(q, s, out); }, {"scales", "positive"});
  s.data<float>()[3] = -1.0f;
  testing::expect_error_mentions([&] { dequantize_per_token_group_fp8(q, s, out); },
                                 {"scales", "positive", "element 3"});
  s.data<float>()[3] = kInf;
  testing::expect_error_mentions([&] { dequantize_per_token_group_fp8(q, s, out); },
                                 {"scales must be positive and finite"});
  // Finite, but 448 x it is not: the dequantized values would be Inf.
  s.data<float>()[3] = 1e37f;
  testing::expect_error_mentions([&] { dequantize_per_token_group_fp8(q, s, out); },
                                 {"scales", "448 x it finite", "element 3"});
  s.data<float>()[3] = 1.0f;
  q.data<fp8_e4m3>()[7] = fp8_e4m3::from_bits(0xff);
  testing::expect_error_mentions([&] { dequantize_per_token_group_fp8(q, s, out); }, {"q must be finite"});
}

// ================================================================ 128 x 128 block FP8

TEST(QuantBlock, KnownAnswersWithPartialLastBlock) {
  const std::int64_t n = 200, k = 256;  // row blocks: [0, 128) and the partial [128, 200)
  HostTensor w(DType::f32, {n, k});
  float* ws = w.data<float>();
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t j = 0; j < k; ++j) ws[i * k + j] = 1.0f;
  }
  ws[5 * k + 7] = -448.0f;   // block (0, 0): amax 448 -> scale 1
  ws[3 * k + 200] = 44.8f;   // block (0, 1): amax 44.8 -> scale 0.1f
  ws[199 * k + 0] = 896.0f;  // block (1, 0): amax 896 (last row of the partial block) -> scale 2
  // block (1, 1): all ones -> scale 1/448, every code 448.
  HostTensor q(DType::fp8_e4m3, {n, k});
  HostTensor s(DType::f32, {2, 2});
  quantize_block_fp8(w, q, s);
  EXPECT_EQ(s.data<float>()[0], 1.0f);
  EXPECT_EQ(s.data<float>()[1], 44.8f / 448.0f);
  EXPECT_EQ(s.data<float>()[2], 2.0f);
  EXPECT_EQ(s.data<float>()[3], 1.0f / 448.0f);
  const fp8_e4m3* qs = q.data<fp8_e4m3>();
  EXPECT_EQ(qs[5 * k + 7].bits, 0xfe);
  EXPECT_EQ(qs[0].bits, 0x38);            // 1 / 1
  EXPECT_EQ(qs[3 * k + 200].bits, 0x7e);  // amax maps to 448
  EXPECT_EQ(qs[199 * k + 0].bits, 0x7e);
  EXPECT_EQ(qs[150 * k + 3].bits, 0x30);  // 1 / 2 = 0.5
  EXPECT_EQ(qs[150 * k + 130].bits, 0x7e);
  EXPECT_EQ(qs[199 * k + 255].bits, 0x7e);

  HostTensor out(DType::f32, {n, k});
  out.fill_bytes(0xff);
  dequantize_block_fp8(q, s, out);
  EXPECT_EQ(out.data<float>()[5 * k + 7], -448.0f);
  EXPECT_EQ(out.data<float>()[199 * k + 0], 896.0f);
  EXPECT_EQ(out.data<float>()[150 * k + 3], 1.0f);
  EXPECT_EQ(out.data<float>()[150 * k + 130], 448.0f * (1.0f / 448.0f));
  for (std::int64_t i = 0; i < n * k; ++i) ASSERT_FALSE(std::isnan(out.data<float>()[i])) << i;
}

TEST(QuantBlock, MatchesDefinitionAndRoundTrips) {
  for (bool use_bf16 : {false, true}) {
    const std::int64_t n = 300, k = 384, rb = 3, cb = 3;
    HostTensor wf = random_f32({n, k}, 21 + use_bf16, 8.0f);
    HostTensor w = use_bf16 ? to_bf16(wf) : std::move(wf);
    HostTensor q(DType::fp8_e4m3, {n, k});
    HostTensor s(DType::f32, {rb, cb});
    quantize_block_fp8(w, q, s);
    HostTensor out(DType::f32, {n, k});
    dequantize_block_fp8(q, s, out);
    auto val = [&](std::int64_t idx) {
      return use_bf16 ? w.data<bf16>()[idx].to_float() : w.data<float>()[idx];
    };
    for (std::int64_t bi = 0; bi < rb; ++bi) {
      for (std::int64_t bj = 0; bj < cb; ++bj) {
        float amax = 0.0f;
        for (std::int64_t i = bi * 128; i < std::min(n, (bi + 1) * 128); ++i) {
          for (std::int64_t j = bj * 128; j < (bj + 1) * 128; ++j)
            amax = std::max(amax, std::fabs(val(i * k + j)));
        }
        const float scale = s.data<float>()[bi * cb + bj];
        ASSERT_EQ(scale, amax / 448.0f);
        for (std::int64_t i = bi * 128; i < std::min(n, (bi + 1) * 128); ++i) {
          for (std::int64_t j = bj * 128; j < (bj + 1) * 128; ++j) {
            const std::int64_t idx = i * k + j;
            ASSERT_EQ(q.data<fp8_e4m3>()[idx].bits, fp8_e4m3::from_float(val(idx) / scale).bits);
            ASSERT_EQ(out.data<float>()[idx], q.data<fp8_e4m3>()[idx].to_float() * scale);
            expect_fp8_close(val(idx), out.data<float>()[idx], scale);
          }
        }
      }
    }
  }
}

TEST(QuantBlock, SmallBlockAndAllZero) {
  HostTensor w(DType::f32, {3, 4});  // block 2: row blocks [0,2), [2,3)
  HostTensor q(DType::fp8_e4m3, {3, 4});
  HostTensor s(DType::f32, {2, 2});
  quantize_block_fp8(w, q, s, 2);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(s.data<float>()[i], kMinAmax / 448.0f);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(q.data<fp8_e4m3>()[i].bits, 0x00);
}

TEST(QuantBlock, RefusesBadArguments) {
  HostTensor w = random_f32({130, 256}, 5);
  HostTensor q(DType::fp8_e4m3, {130, 256});
  HostTensor s(DType::f32, {2, 2});
  EXPECT_NO_THROW(quantize_block_fp8(w, q, s));
  HostTensor s_floor(DType::f32, {1, 2});  // N/128 rounded down is wrong: the last block counts
  testing::expect_error_mentions([&] { quantize_block_fp8(w, q, s_floor); }, {"scale_inv", "shape [2, 2]"});
  HostTensor w_k(DType::f32, {128, 200});
  HostTensor q_k(DType::fp8_e4m3, {128, 200});
  HostTensor s_k(DType::f32, {1, 2});
  testing::expect_error_mentions([&] { quantize_block_fp8(w_k, q_k, s_k); }, {"w", "multiple of block"});
  testing::expect_error_mentions([&] { quantize_block_fp8(w, q, s, 0); }, {"block", "positive"});
  HostTensor q_bad(DType::fp8_e4m3, {128, 256});
  testing::expect_error_mentions([&] { quantize_block_fp8(w, q_bad, s); }, {"q", "shape"});
  w.data<float>()[1000] = kInf;
  testing::expect_error_mentions([&] { quantize_block_fp8(w, q, s); }, {"w must be finite"});
  w.data<float>()[1000] = kNaN;
  testing::expect_error_mentions([&] { quantize_block_fp8(w, q, s); }, {"w must be finite"});

  HostTensor out(DType::f32, {130, 256});
  for (int i = 0; i < 4; ++i) s.data<float>()[i] = 1.0f;
  EXPECT_NO_THROW(dequantize_block_fp8(q, s, out));
  testing::expect_error_mentions([&] { dequantize_block_fp8(q, s_floor, out); }, {"scale_inv", "shape"});
  s.data<float>()[2] = -1.0f;
  testing::expect_error_mentions([&] { dequantize_block_fp8(q, s, out); }, {"scale_inv", "positive"});
  s.data<float>()[2] = kNaN;
  testing::expect_error_mentions([&] { dequantize_block_fp8(q, s, out); },
                                 {"scale_inv must be positive and finite"});
  s.data<float>()[2] = 1e37f;
  testing::expect_error_mentions([&] { dequantize_block_fp8(q, s, out); }, {"scale_inv", "448 x it finite"});
}

// ================================================================ per-tensor FP8

TEST(QuantPerTensor, KnownAnswers) {
  HostTensor x(DType::f32, {2, 3});
  const float v[6] = {1.0f, -2.0f, 0.5f, 100.0f, -0.0f, 7.0f};
  for (int i = 0; i < 6; ++i) x.data<float>()[i] = v[i];
  EXPECT_EQ(per_tensor_fp8_scale(x), 100.0f / 448.0f);
  HostTensor q(DType::fp8_e4m3, {2, 3});
  quantize_per_tensor_fp8(x, q, 0.5f);
  // x / 0.5 = 2, -4, 1, 200, -0, 14. The e4m3 grid in [128, 256) has step 16, so 200 is the tie
  // between 192 (0x74) and 208 (0x75) and goes to the even code 0x74.
  const std::uint8_t want[6] = {0x40, 0xc8, 0x38, 0x74, 0x80, 0x56};
  EXPECT_EQ(q.data<fp8_e4m3>()[0].bits, want[0]);
  EXPECT_EQ(q.data<fp8_e4m3>()[1].bits, want[1]);
  EXPECT_EQ(q.data<fp8_e4m3>()[2].bits, want[2]);
  EXPECT_EQ(q.data<fp8_e4m3>()[3].bits, want[3]);
  EXPECT_EQ(q.data<fp8_e4m3>()[3].to_float(), 192.0f);
  EXPECT_EQ(q.data<fp8_e4m3>()[4].bits, want[4]);
  EXPECT_EQ(q.data<fp8_e4m3>()[5].bits, want[5]);
  HostTensor out(DType::f32, {2, 3});
  dequantize_per_tensor_fp8(q, 0.5f, out);
  const float deq[6] = {1.0f, -2.0f, 0.5f, 96.0f, 0.0f, 7.0f};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out.data<float>()[i], deq[i]) << i;
  // A static scale too small for the data saturates at +-448.
  quantize_per_tensor_fp8(x, q, 0.001f);
  EXPECT_EQ(q.data<fp8_e4m3>()[3].bits, 0x7e);
  EXPECT_EQ(q.data<fp8_e4m3>()[1].bits, 0xfe);
}

TEST(QuantPerTensor, RoundTripsAnyRank) {
  for (bool use_bf16 : {false, true}) {
    HostTensor xf = random_f32({4, 96}, 31 + use_bf16);
    HostTensor x2 = use_bf16 ? to_bf16(xf) : std::move(xf);
    TensorView x = x2.view();  // view it as rank 3
    x = TensorView::contiguous(x.data, x.dtype, {2, 2, 96});
    const float scale = per_tensor_fp8_scale(x);
    HostTensor q(DType::fp8_e4m3, {2, 2, 96});
    quantize_per_tensor_fp8(x, q, scale);
    HostTensor out(DType::f32, {2, 2, 96});
    dequantize_per_tensor_fp8(q, scale, out);
    for (std::int64_t i = 0; i < 384; ++i) {
      const float v = use_bf16 ? x2.data<bf16>()[i].to_float() : x2.data<float>()[i];
      ASSERT_EQ(q.data<fp8_e4m3>()[i].bits, fp8_e4m3::from_float(v / scale).bits);
      expect_fp8_close(v, out.data<float>()[i], scale);
    }
  }
  HostTensor zeros(DType::bf16, {8});
  EXPECT_EQ(per_tensor_fp8_scale(zeros), kMinAmax / 448.0f);
}

TEST(QuantPerTensor, RefusesBadArguments) {
  HostTensor x = random_f32({4, 8}, 41);
  HostTensor q(DType::fp8_e4m3, {4, 8});
  HostTensor out(DType::f32, {4, 8});
  for (float bad : {0.0f, -0.0f, -1.0f, kNaN, kInf, -kInf}) {
    testing::expect_error_mentions([&] { quantize_per_tensor_fp8(x, q, bad); },
                                   {"scale must be positive and finite"});
    testing::expect_error_mentions([&] { dequantize_per_tensor_fp8(q, bad, out); },
                                   {"scale must be positive and finite"});
  }
  // The largest scale a quantizer can give (FLT_MAX / 448) dequantizes; one that overflows 448 x it does not.
  EXPECT_NO_THROW(quantize_per_tensor_fp8(x, q, 1e37f));
  EXPECT_NO_THROW(dequantize_per_tensor_fp8(q, std::numeric_limits<float>::max() / 448.0f, out));
  testing::expect_error_mentions([&] { dequantize_per_tensor_fp8(q, 1e37f, out); },
                                 {"scale", "448 x it finite", "1e+37"});
  HostTensor q_bad(DType::fp8_e4m3, {32});
  testing::expect_error_mentions([&] { quantize_per_tensor_fp8(x, q_bad, 1.0f); },
                                 {"q must have the shape of x"});
  HostTensor out_bad(DType::f32, {4, 9});
  testing::expect_error_mentions([&] { dequantize_per_tensor_fp8(q, 1.0f, out_bad); },
                                 {"out must have the shape of q"});
  HostTensor out_dtype(DType::f64, {4, 8});
  testing::expect_error_mentions([&] { dequantize_per_tensor_fp8(q, 1.0f, out_dtype); }, {"out", "dtype"});
  x.data<float>()[9] = kNaN;
  testing::expect_error_mentions([&] { quantize_per_tensor_fp8(x, q, 1.0f); }, {"x must be finite"});
  testing::expect_error_mentions([&] { (void)per_tensor_fp8_scale(x); }, {"x must be finite"});
  HostTensor xi(DType::i64, {4});
  testing::expect_error_mentions([&] { (void)per_tensor_fp8_scale(xi); }, {"x", "f32 or bf16"});
}

// ================================================================ grouped int4

TEST(QuantInt4, KnownAnswers) {
  // One row, K = 16, groups of 8.
  HostTensor w(DType::f32, {1, 16});
  // Group 0: amax 7 -> scale 1; halves round to even.
  const float g0[8] = {7.0f, -7.0f, 2.5f, 3.5f, -2.5f, 0.5f, -0.5f, 1.49f};
  // Group 1: amax 14 -> scale 2; 5/2 = 2.5 -> 2, 7/2 = 3.5 -> 4, -3/2 = -1.5 -> -2.
  const float g1[8] = {14.0f, 5.0f, 7.0f, -3.0f, -14.0f, 0.0f, 1.0f, 3.0f};
  for (int j = 0; j < 8; ++j) {
    w.data<float>()[j] = g0[j];
    w.data<float>()[8 + j] = g1[j];
  }
  HostTensor packed(DType::i4x2, {1, 8});
  HostTensor s(DType::f32, {1, 2});
  quantize_int4_grouped(w, packed, s, 8);
  EXPECT_EQ(s.data<float>()[0], 1.0f);
  EXPECT_EQ(s.data<float>()[1], 2.0f);
  const int want[16] = {7, -7, 2, 4, -2, 0, 0, 1, 7, 2, 4, -2, -7, 0, 0, 2};
  const auto* p = static_cast<const std::uint8_t*>(packed.view().data);
  for (int j = 0; j < 16; ++j) EXPECT_EQ(unpack_int4(p, j), want[j]) << "element " << j;
  EXPECT_EQ(p[0], 0x97);  // low nibble 7, high nibble -7 = 0x9
  EXPECT_EQ(p[1], 0x42);
  HostTensor out(DType::f32, {1, 16});
  out.fill_bytes(0xff);
  dequantize_int4_grouped(packed, s, out, 8);
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(out.data<float>()[j], static_cast<float>(want[j]) * (j < 8 ? 1.0f : 2.0f)) << j;
  }
}

TEST(QuantInt4, ExtremeCodesAndZeroGroup) {
  HostTensor packed(DType::i4x2, {2, 2});
  auto* p = static_cast<std::uint8_t*>(packed.view().data);
  p[0] = pack_int4(-8, 7);
  p[1] = pack_int4(-1, 0);
  p[2] = pack_int4(1, -2);
  p[3] = pack_int4(3, -8);
  HostTensor s(DType::f32, {2, 1});
  s.data<float>()[0] = 0.5f;
  s.data<float>()[1] = 3.0f;
  HostTensor out(DType::f32, {2, 4});
  dequantize_int4_grouped(packed, s, out, 4);
  const float want[8] = {-4.0f, 3.5f, -0.5f, 0.0f, 3.0f, -6.0f, 9.0f, -24.0f};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(out.data<float>()[i], want[i]) << i;

  HostTensor w(DType::bf16, {1, 128});  // all zeros
  HostTensor pz(DType::i4x2, {1, 64});
  pz.fill_bytes(0xab);
  HostTensor sz(DType::f32, {1, 1});
  quantize_int4_grouped(w, pz, sz);
  EXPECT_EQ(sz.data<float>()[0], kMinAmax / 7.0f);
  for (int j = 0; j < 64; ++j) EXPECT_EQ(static_cast<const std::uint8_t*>(pz.view().data)[j], 0x00);
}

TEST(QuantInt4, MatchesDefinitionAndRoundTrips) {
  for (bool use_bf16 : {false, true}) {
    const std::int64_t n = 7, k = 512, groups = 4;
    HostTensor wf = random_f32({n, k}, 51 + use_bf16, 4.0f);
    HostTensor w = use_bf16 ? to_bf16(wf) : std::move(wf);
    HostTensor packed(DType::i4x2, {n, k / 2});
    HostTensor s(DType::f32, {n, groups});
    quantize_int4_grouped(w, packed, s);
    HostTensor out(DType::f32, {n, k});
    dequantize_int4_grouped(packed, s, out);
    const auto* p = static_cast<const std::uint8_t*>(packed.view().data);
    for (std::int64_t i = 0; i < n; ++i) {
      for (std::int64_t g = 0; g < groups; ++g) {
        float amax = 0.0f;
        auto val = [&](std::int64_t idx) {
          return use_bf16 ? w.data<bf16>()[idx].to_float() : w.data<float>()[idx];
        };
        for (std::int64_t j = g * 128; j < (g + 1) * 128; ++j)
          amax = std::max(amax, std::fabs(val(i * k + j)));
        const float scale = s.data<float>()[i * groups + g];
        ASSERT_EQ(scale, amax / 7.0f);
        for (std::int64_t j = g * 128; j < (g + 1) * 128; ++j) {
          const float v = val(i * k + j);
          const int code = unpack_int4(p + i * (k / 2), j);
          ASSERT_EQ(static_cast<float>(code), std::nearbyint(v / scale)) << i << " " << j;
          ASSERT_GE(code, -7);
          ASSERT_LE(code, 7);
          ASSERT_EQ(out.data<float>()[i * k + j], static_cast<float>(code) * scale);
          ASSERT_LE(std::fabs(out.data<float>()[i * k + j] - v), 0.5f * scale * (1.0f + 1e-5f)) << v;
        }
      }
    }
  }
}

TEST(QuantInt4, RefusesBadArguments) {
  HostTensor w = random_f32({4, 256}, 61);
  HostTensor packed(DType::i4x2, {4, 128});
  HostTensor s(DType::f32, {4, 2});
  EXPECT_NO_THROW(quantize_int4_grouped(w, packed, s));
  HostTensor packed_u8(DType::u8, {4, 128});
  testing::expect_error_mentions([&] { quantize_int4_grouped(w, packed_u8, s); }, {"packed", "i4x2"});
  HostTensor packed_full(DType::i4x2, {4, 256});  // one byte per value is wrong
  testing::expect_error_mentions([&] { quantize_int4_grouped(w, packed_full, s); },
                                 {"packed", "shape [4, 128]"});
  HostTensor s_bad(DType::f32, {4, 1});
  testing::expect_error_mentions([&] { quantize_int4_grouped(w, packed, s_bad); }, {"scales", "shape"});
  testing::expect_error_mentions([&] { quantize_int4_grouped(w, packed, s, 96); },
                                 {"w", "multiple of group"});
  testing::expect_error_mentions([&] { quantize_int4_grouped(w, packed, s, 0); }, {"group", "positive"});
  HostTensor w_odd(DType::f32, {4, 3});
  HostTensor p_odd(DType::i4x2, {4, 1});
  HostTensor s_odd(DType::f32, {4, 1});
  testing::expect_error_mentions([&] { quantize_int4_grouped(w_odd, p_odd, s_odd, 3); }, {"w", "even"});
  w.data<float>()[17] = kNaN;
  testing::expect_error_mentions([&] { quantize_int4_grouped(w, packed, s); }, {"w must be finite", "17"});
  w.data<float>()[17] = kInf;
  testing::expect_error_mentions([&] { quantize_int4_grouped(w, packed, s); }, {"w must be finite"});

  HostTensor out(DType::f32, {4, 256});
  for (int i = 0; i < 8; ++i) s.data<float>()[i] = 1.0f;
  EXPECT_NO_THROW(dequantize_int4_grouped(packed, s, out));
  testing::expect_error_mentions([&] { dequantize_int4_grouped(packed_full, s, out); }, {"packed", "shape"});
  HostTensor out_bad(DType::bf16, {4, 256});
  testing::expect_error_mentions([&] { dequantize_int4_grouped(packed, s, out_bad); }, {"out", "dtype"});
  s.data<float>()[1] = 0.0f;
  testing::expect_error_mentions([&] { dequantize_int4_grouped(packed, s, out); }, {"scales", "positive"});
  s.data<float>()[1] = kNaN;
  testing::expect_error_mentions([&] { dequantize_int4_grouped(packed, s, out); },
                                 {"scales must be positive and finite"});
  s.data<float>()[1] = 4.5e37f;  // 7 x it is finite, but a code of -8 x it overflows f32
  testing::expect_error_mentions([&] { dequantize_int4_grouped(packed, s, out); },
                                 {"scales", "8 x it finite"});
  s.data<float>()[1] = 4e37f;  // 8 x it does not
  EXPECT_NO_THROW(dequantize_int4_grouped(packed, s, out));
}

}  // namespace
}  // namespace epmoe
