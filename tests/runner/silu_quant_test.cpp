// The CPU SiLU·mul + quantization reference (epmoe/silu_quant.hpp) and the shared f32 math behind it
// (src/runner/silu_math.hpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>

#include "epmoe/quant.hpp"
#include "epmoe/silu_quant.hpp"
#include "expect_error.hpp"
#include "runner/silu_math.hpp"
#include "test_random.hpp"

namespace epmoe {
namespace {

constexpr std::uint8_t kPoison = 0xff;

// Random bf16 GEMM1 output [rows, 2I]: N(0, sigma^2) with sigma varying per row, never zero.
HostTensor random_h(std::int64_t rows, std::int64_t inter, std::mt19937_64& rng) {
  HostTensor h(DType::bf16, {rows, 2 * inter});
  std::uniform_int_distribution<int> exponent(-6, 4);
  for (std::int64_t r = 0; r < rows; ++r) {
    std::normal_distribution<float> normal(0.0f, std::ldexp(1.0f, exponent(rng)));
    for (std::int64_t j = 0; j < 2 * inter; ++j) {
      float v = 0.0f;
      while (v == 0.0f) v = bf16::from_float(normal(rng)).to_float();
      h.data<bf16>()[r * 2 * inter + j] = bf16::from_float(v);
    }
  }
  return h;
}

// Distance between two floats in units in the last place (same sign, finite).
std::int64_t ulp_distance(float a, float b) {
  std::int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  if (ia < 0) ia = std::numeric_limits<std::int32_t>::min() - ia;
  if (ib < 0) ib = std::numeric_limits<std::int32_t>::min() - ib;
  return std::llabs(static_cast<std::int64_t>(ia) - ib);
}

// ---------------------------------------------------------------- the f32 math

TEST(SiluMulQuantCpu, ExpNonPositiveIsAccurate) {
  testing::SeededRng rng;
  std::uniform_real_distribution<float> arg(-87.0f, 0.0f);
  std::int64_t worst = 0;
  for (int i = 0; i < 200000; ++i) {
    const float a = i < 100 ? -static_cast<float>(i) * 0.87f : arg(rng);
    const float want = static_cast<float>(std::exp(static_cast<double>(a)));
    worst = std::max(worst, ulp_distance(act::exp_nonpositive(a), want));
  }
  EXPECT_LE(worst, 2) << "exp_nonpositive is off by " << worst << " ulp";
  EXPECT_EQ(act::exp_nonpositive(0.0f), 1.0f);
  EXPECT_EQ(act::exp_nonpositive(-0.0f), 1.0f);
  EXPECT_EQ(act::exp_nonpositive(-88.0f), 0.0f);
  EXPECT_EQ(act::exp_nonpositive(-std::numeric_limits<float>::infinity()), 0.0f);
}

TEST(SiluMulQuantCpu, SiluIsAccurate) {
  testing::SeededRng rng;
  std::int64_t worst = 0;
  for (int i = 0; i < 200000; ++i) {
    // bf16 gate values over the whole useful range (GEMM1 outputs are bf16).
    const float g = bf16::from_float(std::ldexp(std::uniform_real_distribution<float>(-1.0f, 1.0f)(rng),
                                                std::uniform_int_distribution<int>(-20, 7)(rng)))
                        .to_float();
    const double gd = g;
    const double exact = gd / (1.0 + std::exp(-gd));
    const float got = act::silu(g);
    if (std::fabs(exact) < 1e-30) continue;
    worst = std::max(worst, ulp_distance(got, static_cast<float>(exact)));
  }
  EXPECT_LE(worst, 4) << "silu is off by " << worst << " ulp";
  EXPECT_EQ(act::silu(0.0f), 0.0f);
  EXPECT_EQ(act::silu(200.0f), 200.0f);
  EXPECT_EQ(act::silu(-200.0f), 0.0f);
  EXPECT_TRUE(std::isnan(act::silu(std::nanf(""))));
  EXPECT_EQ(silu_mul(1.5f, -2.0f), act::silu(1.5f) * -2.0f);
}

// The GPU's group quantizer divides by Markstein's method; its e4m3 bytes must equal those of the
// IEEE quotient for every (a, s) the quantizer can meet: s = max(amax, kMinAmax) / 448, |a| <= amax.
TEST(SiluMulQuantCpu, MarksteinQuotientGivesTheSameFp8) {
  testing::SeededRng rng;
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::int64_t mismatches = 0, checked = 0;
  for (int it = 0; it < 40000; ++it) {
    float amax = std::ldexp(1.0f + unit(rng), static_cast<int>(rng() % 240) - 130);
    if (it % 5 == 0) amax = std::ldexp(448.0f, static_cast<int>(rng() % 200) - 100);
    const float s = fp8_scale_for_amax(amax, false);
    const float y = 1.0f / s;
    for (int j = 0; j < 128; ++j) {
      float a = 0.0f;
      switch (rng() % 5) {
        case 0:
          a = amax * (2.0f * unit(rng) - 1.0f);
          break;
        case 1: {  // near an e4m3 rounding midpoint (times s), a few f32 ulps either way
          const auto code = static_cast<std::uint8_t>(rng() % 0x7e);
          const float mid =
              (fp8_e4m3::from_bits(code).to_float() + fp8_e4m3::from_bits(code + 1).to_float()) / 2;
          std::uint32_t bits;
          const float base = mid * s;
          std::memcpy(&bits, &base, 4);
          bits += static_cast<std::uint32_t>(static_cast<int>(rng() % 7) - 3);
          std::memcpy(&a, &bits, 4);
          break;
        }
        case 2:
          a = amax;
          break;
        case 3:
          a = amax * std::ldexp(unit(rng), -static_cast<int>(rng() % 40));
          break;
        default:
          a = j % 2 ? -0.0f : 0.0f;
          break;
      }
      if (rng() & 1) a = -a;
      if (std::fabs(a) > amax) a = std::copysign(amax, a);
      ++checked;
      if (fp8_e4m3::from_float(act::div_markstein(a, s, y)).bits != fp8_e4m3::from_float(a / s).bits) {
        if (mismatches++ < 5) ADD_FAILURE() << "a = " << a << ", s = " << s;
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << checked;
}

// ---------------------------------------------------------------- silu_mul_quant_cpu

TEST(SiluMulQuantCpu, Fp8GroupIsSiluThenTheGroupQuantizer) {
  testing::SeededRng rng;
  for (const bool pow2 : {false, true}) {
    const std::int64_t rows = 5, inter = 256;
    const HostTensor h = random_h(rows, inter, rng);
    HostTensor q(DType::fp8_e4m3, {rows, inter}), s(DType::f32, {rows, inter / 128});
    silu_mul_quant_cpu(h, q, s, {ActivationFormat::fp8_group, pow2, 1.0f});

    HostTensor act(DType::f32, {rows, inter});
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < inter; ++j)
        act.data<float>()[r * inter + j] = silu_mul(h.data<bf16>()[r * 2 * inter + j].to_float(),
                                                    h.data<bf16>()[r * 2 * inter + inter + j].to_float());
    HostTensor q_ref(DType::fp8_e4m3, {rows, inter}), s_ref(DType::f32, {rows, inter / 128});
    quantize_per_token_group_fp8(act, q_ref, s_ref, 128, pow2);
    EXPECT_EQ(std::memcmp(q.data<fp8_e4m3>(), q_ref.data<fp8_e4m3>(), q.nbytes()), 0);
    EXPECT_EQ(std::memcmp(s.data<float>(), s_ref.data<float>(), s.nbytes()), 0);

    // And it approximates the exact function: |dequant - silu(g) u| <= half an e4m3 step of the group.
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < inter; ++j) {
        const double g = h.data<bf16>()[r * 2 * inter + j].to_float(),
                     u = h.data<bf16>()[r * 2 * inter + inter + j].to_float();
        const double exact = g / (1.0 + std::exp(-g)) * u;
        const double scale = s.data<float>()[r * (inter / 128) + j / 128];
        const double deq = static_cast<double>(q.data<fp8_e4m3>()[r * inter + j].to_float()) * scale;
        EXPECT_LE(std::fabs(deq - exact), std::fabs(exact) / 16 + scale / 256 + 1e-30)
            << "row " << r << " col " << j << " pow2 " << pow2;
      }
  }
}

TEST(SiluMulQuantCpu, Fp8TensorAndBf16) {
  testing::SeededRng rng;
  const std::int64_t rows = 3, inter = 128;
  const HostTensor h = random_h(rows, inter, rng);
  HostTensor act(DType::f32, {rows, inter});
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < inter; ++j)
      act.data<float>()[r * inter + j] = silu_mul(h.data<bf16>()[r * 2 * inter + j].to_float(),
                                                  h.data<bf16>()[r * 2 * inter + inter + j].to_float());

  HostTensor q(DType::fp8_e4m3, {rows, inter}), q_ref(DType::fp8_e4m3, {rows, inter});
  silu_mul_quant_cpu(h, q, TensorView{}, {ActivationFormat::fp8_tensor, false, 0.0173f});
  quantize_per_tensor_fp8(act, q_ref, 0.0173f);
  EXPECT_EQ(std::memcmp(q.data<fp8_e4m3>(), q_ref.data<fp8_e4m3>(), q.nbytes()), 0);

  HostTensor b(DType::bf16, {rows, inter});
  silu_mul_quant_cpu(h, b, TensorView{}, {ActivationFormat::bf16, false, 1.0f});
  for (std::int64_t i = 0; i < rows * inter; ++i)
    ASSERT_EQ(b.data<bf16>()[i].bits, bf16::from_float(act.data<float>()[i]).bits) << i;
}

TEST(SiluMulQuantCpu, ContiguousSkipsPaddingRows) {
  testing::SeededRng rng;
  const std::int64_t rows = 7, inter = 256;
  const HostTensor h = random_h(rows, inter, rng);
  HostTensor m_indices(DType::i32, {rows});
  const std::int32_t ids[rows] = {0, -1, 2, 2, -1, -1, 5};
  std::memcpy(m_indices.data<std::int32_t>(), ids, sizeof(ids));
  HostTensor q(DType::fp8_e4m3, {rows, inter}), s(DType::f32, {rows, inter / 128});
  q.fill_bytes(kPoison);
  s.fill_bytes(kPoison);
  silu_mul_quant_contiguous_cpu(h, m_indices, q, s, {});
  HostTensor q_all(DType::fp8_e4m3, {rows, inter}), s_all(DType::f32, {rows, inter / 128});
  silu_mul_quant_cpu(h, q_all, s_all, {});
  for (std::int64_t r = 0; r < rows; ++r) {
    const auto* qr = reinterpret_cast<const std::uint8_t*>(q.data<fp8_e4m3>() + r * inter);
    const auto* sr = reinterpret_cast<const std::uint8_t*>(s.data<float>() + r * 2);
    if (ids[r] < 0) {
      for (std::int64_t j = 0; j < inter; ++j) ASSERT_EQ(qr[j], kPoison) << "padding row " << r << " written";
      for (int j = 0; j < 8; ++j) ASSERT_EQ(sr[j], kPoison) << "padding row " << r << " scale written";
    } else {
      EXPECT_EQ(std::memcmp(qr, q_all.data<fp8_e4m3>() + r * inter, inter), 0) << "row " << r;
      EXPECT_EQ(std::memcmp(sr, s_all.data<float>() + r * 2, 8), 0) << "row " << r;
    }
  }
}

TEST(SiluMulQuantCpu, MaskedProcessesOnlyValidRows) {
  testing::SeededRng rng;
  const std::int64_t experts = 3, m_max = 4, inter = 128;
  const HostTensor h2 = random_h(experts * m_max, inter, rng);
  TensorView h = h2.view();
  h.rank = 3;
  h.shape = {experts, m_max, 2 * inter, 0};
  h.stride = {m_max * 2 * inter, 2 * inter, 1, 0};
  HostTensor masked_m(DType::i32, {experts});
  const std::int32_t mm[experts] = {2, 0, 4};
  std::memcpy(masked_m.data<std::int32_t>(), mm, sizeof(mm));
  HostTensor q(DType::fp8_e4m3, {experts, m_max, inter}), s(DType::f32, {experts, m_max, 1});
  q.fill_bytes(kPoison);
  s.fill_bytes(kPoison);
  silu_mul_quant_masked_cpu(h, masked_m, q, s, {ActivationFormat::fp8_group, true, 1.0f});
  HostTensor q_all(DType::fp8_e4m3, {experts * m_max, inter}), s_all(DType::f32, {experts * m_max, 1});
  silu_mul_quant_cpu(h2, q_all, s_all, {ActivationFormat::fp8_group, true, 1.0f});
  for (std::int64_t e = 0; e < experts; ++e)
    for (std::int64_t m = 0; m < m_max; ++m) {
      const std::int64_t r = e * m_max + m;
      const auto* qr = reinterpret_cast<const std::uint8_t*>(q.data<fp8_e4m3>() + r * inter);
      if (m >= mm[e]) {
        for (std::int64_t j = 0; j < inter; ++j) ASSERT_EQ(qr[j], kPoison) << "row " << e << "," << m;
        std::uint32_t bits;
        std::memcpy(&bits, s.data<float>() + r, 4);
        EXPECT_EQ(bits, 0xffffffffu);
      } else {
        EXPECT_EQ(std::memcmp(qr, q_all.data<fp8_e4m3>() + r * inter, inter), 0) << "row " << e << "," << m;
        EXPECT_EQ(s.data<float>()[r], s_all.data<float>()[r]);
      }
    }
  masked_m.data<std::int32_t>()[1] = 5;
  EXPECT_THROW(silu_mul_quant_masked_cpu(h, masked_m, q, s, {}), Error);
  masked_m.data<std::int32_t>()[1] = -1;
  EXPECT_THROW(silu_mul_quant_masked_cpu(h, masked_m, q, s, {}), Error);
}

TEST(SiluMulQuantCpu, RefusesBadArguments) {
  using testing::expect_error_mentions;

  HostTensor h(DType::bf16, {2, 256}), q(DType::fp8_e4m3, {2, 128}), s(DType::f32, {2, 1});
  h.fill_bytes(0x3c);
  EXPECT_NO_THROW(silu_mul_quant_cpu(h, q, s, {}));
  HostTensor h_f32(DType::f32, {2, 256});
  expect_error_mentions([&] { silu_mul_quant_cpu(h_f32, q, s, {}); }, "h must have dtype bf16");
  HostTensor h_odd(DType::bf16, {2, 200});
  expect_error_mentions([&] { silu_mul_quant_cpu(h_odd, q, s, {}); }, "twice a positive multiple of 128");
  HostTensor q_bad(DType::fp8_e4m3, {2, 256});
  expect_error_mentions([&] { silu_mul_quant_cpu(h, q_bad, s, {}); }, "q must have shape");
  expect_error_mentions([&] { silu_mul_quant_cpu(h, h, s, {}); }, "q must have dtype fp8_e4m3");
  HostTensor s_bad(DType::f32, {2, 2});
  expect_error_mentions([&] { silu_mul_quant_cpu(h, q, s_bad, {}); }, "scales must have shape");
  expect_error_mentions(
      [&] {
        silu_mul_quant_cpu(h, q, s, {ActivationFormat::fp8_tensor, false, 0.0f});
      },
      "tensor_scale must be positive");
  HostTensor m_bad(DType::i32, {3});
  expect_error_mentions([&] { silu_mul_quant_contiguous_cpu(h, m_bad, q, s, {}); },
                        "m_indices must have shape");
  // An act that overflows f32: silu(3e38) * 3e38.
  HostTensor h_big(DType::bf16, {1, 256}), q1(DType::fp8_e4m3, {1, 128}), s1(DType::f32, {1, 1});
  for (int j = 0; j < 256; ++j) h_big.data<bf16>()[j] = bf16::from_float(3e38f);
  expect_error_mentions([&] { silu_mul_quant_cpu(h_big, q1, s1, {}); }, "is not finite");
}

}  // namespace
}  // namespace epmoe
