// Bit-level checks of bf16, fp8 e4m3 and packed int4 (numerics.hpp) against hand-computed answers
// and against brute-force references written independently of the implementation.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <vector>

#include "epmoe/numerics.hpp"

namespace epmoe {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

float from_bits32(std::uint32_t u) {
  return std::bit_cast<float>(u);
}
std::uint32_t bits32(float f) {
  return std::bit_cast<std::uint32_t>(f);
}

// ================================================================ bf16

// Independent reference: pick the nearer of the two bf16 neighbours of f (in f64), ties to the even one.
std::uint16_t reference_bf16(float f) {
  const std::uint32_t u = bits32(f);
  if (std::isnan(f)) return 0x7fff;
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t mag = u & 0x7fffffffu;
  if (mag == 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7f80);
  const std::uint16_t lower = static_cast<std::uint16_t>(mag >> 16);  // truncation towards zero
  const double a = std::fabs(static_cast<double>(f));
  const double lo = static_cast<double>(from_bits32(static_cast<std::uint32_t>(lower) << 16));
  const int biased_exp = lower >> 7;
  const double ulp = std::ldexp(1.0, (biased_exp == 0 ? 1 : biased_exp) - 127 - 7);
  const double hi = lo + ulp;  // may be 2^128, i.e. the next value is Inf
  std::uint16_t m;
  if (a - lo < hi - a) {
    m = lower;
  } else if (a - lo > hi - a) {
    m = static_cast<std::uint16_t>(lower + 1);
  } else {
    m = (lower & 1) ? static_cast<std::uint16_t>(lower + 1) : lower;
  }
  return static_cast<std::uint16_t>(sign | m);
}

TEST(Bf16, KnownAnswers) {
  EXPECT_EQ(bf16::from_float(1.0f).bits, 0x3f80);
  EXPECT_EQ(bf16::from_float(-2.0f).bits, 0xc000);
  EXPECT_EQ(bf16::from_float(0.0f).bits, 0x0000);
  EXPECT_EQ(bf16::from_float(-0.0f).bits, 0x8000);
  EXPECT_EQ(bf16::from_bits(0x4049).to_float(), 3.140625f);
  EXPECT_EQ(bf16::from_bits(0x3f81).to_float(), 1.0f + 0x1p-7f);
  EXPECT_TRUE(std::signbit(bf16::from_bits(0x8000).to_float()));
  EXPECT_EQ(bf16::from_bits(0x8000).to_float(), 0.0f);
  // Exactly representable.
  EXPECT_EQ(bf16::from_float(1.0f + 0x1p-7f).bits, 0x3f81);
  EXPECT_EQ(round_to_bf16(3.140625f), 3.140625f);
  // Smallest subnormal bf16 is 2^-133.
  EXPECT_EQ(bf16::from_float(0x1p-133f).bits, 0x0001);
  EXPECT_EQ(bf16::from_bits(0x0001).to_float(), 0x1p-133f);
}

TEST(Bf16, RoundToNearestEvenTies) {
  // 1 + 2^-8 lies halfway between 1 (0x3f80, even) and 1 + 2^-7 (0x3f81, odd).
  EXPECT_EQ(bf16::from_float(1.0f + 0x1p-8f).bits, 0x3f80);
  // 1 + 3*2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (0x3f82, even).
  EXPECT_EQ(bf16::from_float(1.0f + 3 * 0x1p-8f).bits, 0x3f82);
  EXPECT_EQ(round_to_bf16(1.0f + 3 * 0x1p-8f), 1.0f + 0x1p-6f);
  // Just above / below a tie goes to the nearer value.
  EXPECT_EQ(bf16::from_float(std::nextafter(1.0f + 0x1p-8f, 2.0f)).bits, 0x3f81);
  EXPECT_EQ(bf16::from_float(std::nextafter(1.0f + 3 * 0x1p-8f, 0.0f)).bits, 0x3f81);
  EXPECT_EQ(bf16::from_float(-(1.0f + 0x1p-8f)).bits, 0xbf80);
  EXPECT_EQ(bf16::from_float(-(1.0f + 3 * 0x1p-8f)).bits, 0xbf82);
  // Carry into the exponent: 2 - 2^-9 rounds up to 2.
  EXPECT_EQ(bf16::from_float(2.0f - 0x1p-9f).bits, 0x4000);
  // Rounding past the largest finite bf16 gives Inf, as IEEE round-to-nearest does.
  EXPECT_EQ(bf16::from_float(std::numeric_limits<float>::max()).bits, 0x7f80);
  EXPECT_EQ(bf16::from_float(from_bits32(0x7f7f7fffu)).bits, 0x7f7f);
}

TEST(Bf16, NaNAndInf) {
  EXPECT_EQ(bf16::from_float(kNaN).bits, 0x7fff);
  EXPECT_EQ(bf16::from_float(-kNaN).bits, 0x7fff);
  EXPECT_EQ(bf16::from_float(from_bits32(0x7f800001u)).bits, 0x7fff);  // signalling NaN stays NaN
  EXPECT_EQ(bf16::from_float(from_bits32(0xff80ffffu)).bits, 0x7fff);  // would truncate to -Inf
  EXPECT_EQ(bf16::from_float(kInf).bits, 0x7f80);
  EXPECT_EQ(bf16::from_float(-kInf).bits, 0xff80);
  EXPECT_TRUE(std::isnan(bf16::from_bits(0x7fff).to_float()));
  EXPECT_EQ(bf16::from_bits(0x7f80).to_float(), kInf);
  EXPECT_EQ(bf16::from_bits(0xff80).to_float(), -kInf);
}

TEST(Bf16, EveryValueRoundTrips) {
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const bf16 v = bf16::from_bits(static_cast<std::uint16_t>(b));
    const float f = v.to_float();
    if (std::isnan(f)) continue;
    EXPECT_EQ(bf16::from_float(f).bits, b) << std::hex << b;
  }
}

TEST(Bf16, MatchesReferenceRounding) {
  // Every bf16 neighbourhood, at the interesting low-half patterns (exact, tie +- 1 ulp, max).
  int failures = 0;
  for (std::uint32_t hi = 0; hi < 0x10000u && failures < 10; ++hi) {
    for (std::uint32_t lo : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      const float f = from_bits32((hi << 16) | lo);
      if (std::isnan(f)) continue;
      const std::uint16_t want = reference_bf16(f);
      if (bf16::from_float(f).bits != want) {
        ADD_FAILURE() << "bits 0x" << std::hex << bits32(f) << ": got 0x" << bf16::from_float(f).bits
                      << ", want 0x" << want;
        ++failures;
      }
    }
  }
  std::mt19937 rng(1234);
  for (int i = 0; i < 200000 && failures < 10; ++i) {
    const float f = from_bits32(static_cast<std::uint32_t>(rng()));
    if (std::isnan(f)) continue;
    if (bf16::from_float(f).bits != reference_bf16(f)) {
      ADD_FAILURE() << "bits 0x" << std::hex << bits32(f);
      ++failures;
    }
  }
}

// ================================================================ fp8 e4m3

// OCP E4M3FN, written from the spec: bias 7, subnormals m/8 * 2^-6, S.1111.111 is NaN, no Inf.
double spec_e4m3(std::uint8_t code) {
  const double sign = (code & 0x80) ? -1.0 : 1.0;
  const int e = (code >> 3) & 0xf;
  const int m = code & 0x7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  if (e == 0) return sign * (m / 8.0) * std::pow(2.0, -6);
  return sign * (1.0 + m / 8.0) * std::pow(2.0, e - 7);
}

// Brute force: the nearest of the 127 non-negative finite codes, ties to the even code,
// saturating at 448; NaN -> a NaN code.
std::uint8_t reference_e4m3(float f) {
  if (std::isnan(f)) return 0x7f;
  const std::uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 448.0) return static_cast<std::uint8_t>(sign | 0x7e);
  int best = 0;
  double best_d = a;
  for (int c = 1; c <= 0x7e; ++c) {
    const double d = std::fabs(spec_e4m3(static_cast<std::uint8_t>(c)) - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return static_cast<std::uint8_t>(sign | best);
}

TEST(Fp8E4m3, DecodesEveryCodeToTheSpecValue) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    const float got = fp8_e4m3::from_bits(code).to_float();
    const double want = spec_e4m3(code);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << std::hex << c;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << std::hex << c;
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << std::hex << c;
    }
  }
  // The only NaNs are 0x7f and 0xff; the positive codes increase strictly.
  int nans = 0;
  for (int c = 0; c < 256; ++c)
    nans += std::isnan(fp8_e4m3::from_bits(static_cast<std::uint8_t>(c)).to_float());
  EXPECT_EQ(nans, 2);
  for (int c = 0; c < 0x7e; ++c) {
    EXPECT_LT(fp8_e4m3::from_bits(static_cast<std::uint8_t>(c)).to_float(),
              fp8_e4m3::from_bits(static_cast<std::uint8_t>(c + 1)).to_float());
  }
}

TEST(Fp8E4m3, KnownCodes) {
  auto dec = [](int c) { return fp8_e4m3::from_bits(static_cast<std::uint8_t>(c)).to_float(); };
  EXPECT_TRUE(std::isnan(dec(0x7f)));
  EXPECT_TRUE(std::isnan(dec(0xff)));
  EXPECT_EQ(dec(0x7e), 448.0f);
  EXPECT_EQ(dec(0xfe), -448.0f);
  EXPECT_EQ(dec(0x7d), 416.0f);
  EXPECT_EQ(dec(0x78), 256.0f);
  EXPECT_EQ(dec(0x77), 240.0f);
  EXPECT_EQ(dec(0x38), 1.0f);
  EXPECT_EQ(dec(0x3f), 1.875f);
  EXPECT_EQ(dec(0x40), 2.0f);
  EXPECT_EQ(dec(0x08), 0x1p-6f);      // smallest normal
  EXPECT_EQ(dec(0x07), 7 * 0x1p-9f);  // largest subnormal
  EXPECT_EQ(dec(0x01), 0x1p-9f);      // smallest subnormal
  EXPECT_EQ(dec(0x81), -0x1p-9f);
  EXPECT_EQ(dec(0x00), 0.0f);
  EXPECT_EQ(dec(0x80), 0.0f);
  EXPECT_TRUE(std::signbit(dec(0x80)));

  EXPECT_EQ(fp8_e4m3::from_float(1.0f).bits, 0x38);
  EXPECT_EQ(fp8_e4m3::from_float(-1.0f).bits, 0xb8);
  EXPECT_EQ(fp8_e4m3::from_float(0.0f).bits, 0x00);
  EXPECT_EQ(fp8_e4m3::from_float(-0.0f).bits, 0x80);
  EXPECT_EQ(fp8_e4m3::from_float(448.0f).bits, 0x7e);
  EXPECT_EQ(fp8_e4m3::from_float(0x1p-6f).bits, 0x08);
  EXPECT_EQ(fp8_e4m3::from_float(0x1p-9f).bits, 0x01);
  EXPECT_EQ(fp8_e4m3::from_float(3.0f).bits, 0x44);
  EXPECT_EQ(round_to_fp8(1.1f), 1.125f);
  EXPECT_EQ(round_to_fp8(300.0f), 288.0f);
  EXPECT_EQ(round_to_fp8(-300.0f), -288.0f);
}

TEST(Fp8E4m3, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    const auto code = static_cast<std::uint8_t>(c);
    const float f = fp8_e4m3::from_bits(code).to_float();
    if (std::isnan(f)) continue;
    EXPECT_EQ(fp8_e4m3::from_float(f).bits, code) << std::hex << c;
  }
}

TEST(Fp8E4m3, TiesGoToTheEvenCode) {
  for (int sign : {0x00, 0x80}) {
    for (int c = 0; c < 0x7e; ++c) {
      const auto lo = static_cast<std::uint8_t>(sign | c);
      const auto hi = static_cast<std::uint8_t>(sign | (c + 1));
      const float a = fp8_e4m3::from_bits(lo).to_float();
      const float b = fp8_e4m3::from_bits(hi).to_float();
      const float mid = (a + b) / 2;  // exact: both have at most 4 significant bits
      ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(a) + b) / 2);
      const std::uint8_t even = (c & 1) ? hi : lo;
      EXPECT_EQ(fp8_e4m3::from_float(mid).bits, even)
          << "between 0x" << std::hex << int{lo} << " and 0x" << int{hi};
      const float towards_b = std::nextafter(mid, b);
      const float towards_a = std::nextafter(mid, a);
      EXPECT_EQ(fp8_e4m3::from_float(towards_b).bits, hi) << std::hex << int{lo};
      EXPECT_EQ(fp8_e4m3::from_float(towards_a).bits, lo) << std::hex << int{lo};
    }
  }
}

TEST(Fp8E4m3, SaturatesAt448) {
  for (float f : {447.0f, 448.0f, 449.0f, 463.9f, 464.0f, 464.1f, 480.0f, 1e9f,
                  std::numeric_limits<float>::max(), kInf}) {
    EXPECT_EQ(fp8_e4m3::from_float(f).bits, 0x7e) << f;
    EXPECT_EQ(fp8_e4m3::from_float(-f).bits, 0xfe) << -f;
    EXPECT_EQ(round_to_fp8(f), 448.0f) << f;
  }
}

TEST(Fp8E4m3, NaNBecomesNaN) {
  for (float f : {kNaN, -kNaN, from_bits32(0x7f800001u), from_bits32(0xffc00000u)}) {
    const fp8_e4m3 q = fp8_e4m3::from_float(f);
    EXPECT_EQ(q.bits & 0x7f, 0x7f) << std::hex << int{q.bits};
    EXPECT_TRUE(std::isnan(q.to_float()));
  }
  EXPECT_EQ(fp8_e4m3::from_float(kNaN).bits, 0x7f);
}

TEST(Fp8E4m3, TinyValues) {
  EXPECT_EQ(fp8_e4m3::from_float(0x1p-10f).bits, 0x00);  // halfway between 0 and 2^-9: even is 0
  EXPECT_EQ(fp8_e4m3::from_float(-0x1p-10f).bits, 0x80);
  EXPECT_EQ(fp8_e4m3::from_float(std::nextafter(0x1p-10f, 1.0f)).bits, 0x01);
  EXPECT_EQ(fp8_e4m3::from_float(-std::nextafter(0x1p-10f, 1.0f)).bits, 0x81);
  EXPECT_EQ(fp8_e4m3::from_float(std::nextafter(0x1p-10f, 0.0f)).bits, 0x00);
  EXPECT_EQ(fp8_e4m3::from_float(0x1p-11f).bits, 0x00);
  EXPECT_EQ(fp8_e4m3::from_float(1e-30f).bits, 0x00);
  EXPECT_EQ(fp8_e4m3::from_float(std::numeric_limits<float>::denorm_min()).bits, 0x00);
  EXPECT_EQ(fp8_e4m3::from_float(-std::numeric_limits<float>::denorm_min()).bits, 0x80);
  EXPECT_EQ(fp8_e4m3::from_float(3 * 0x1p-10f).bits, 0x02);  // 1.5 * 2^-9: tie, to even 2 * 2^-9
  EXPECT_EQ(fp8_e4m3::from_float(5 * 0x1p-10f).bits, 0x02);  // 2.5 * 2^-9: tie, to even 2 * 2^-9
}

TEST(Fp8E4m3, MatchesBruteForceOnEveryBf16AndRandomFloats) {
  int failures = 0;
  auto check = [&](float f) {
    const std::uint8_t want = reference_e4m3(f);
    const std::uint8_t got = fp8_e4m3::from_float(f).bits;
    if (got != want && failures < 10) {
      ADD_FAILURE() << "f = " << f << " (0x" << std::hex << bits32(f) << "): got 0x" << int{got}
                    << ", want 0x" << int{want};
      ++failures;
    }
  };
  for (std::uint32_t b = 0; b < 0x10000u; ++b) {
    const float f = bf16::from_bits(static_cast<std::uint16_t>(b)).to_float();
    if (!std::isnan(f)) check(f);
  }
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> log2_mag(-14.0f, 10.0f);
  for (int i = 0; i < 100000; ++i) {
    const float f = std::exp2(log2_mag(rng)) * ((rng() & 1) ? -1.0f : 1.0f);
    check(f);
  }
}

// ================================================================ packed int4

TEST(Int4, PackUnpackEveryPair) {
  for (int lo = kInt4Min; lo <= kInt4Max; ++lo) {
    for (int hi = kInt4Min; hi <= kInt4Max; ++hi) {
      const std::uint8_t b = pack_int4(lo, hi);
      EXPECT_EQ(b, static_cast<std::uint8_t>((lo & 0xf) | ((hi & 0xf) << 4))) << lo << " " << hi;
      EXPECT_EQ(unpack_int4_lo(b), lo);
      EXPECT_EQ(unpack_int4_hi(b), hi);
      const std::uint8_t bytes[2] = {pack_int4(hi, lo), b};
      EXPECT_EQ(unpack_int4(bytes, 0), hi);
      EXPECT_EQ(unpack_int4(bytes, 1), lo);
      EXPECT_EQ(unpack_int4(bytes, 2), lo);
      EXPECT_EQ(unpack_int4(bytes, 3), hi);
    }
  }
  EXPECT_EQ(pack_int4(-8, 7), 0x78);
  EXPECT_EQ(pack_int4(-1, 0), 0x0f);
  EXPECT_EQ(pack_int4(1, -2), 0xe1);
  // Every byte decodes to a pair that packs back to it.
  for (int b = 0; b < 256; ++b) {
    const auto byte = static_cast<std::uint8_t>(b);
    EXPECT_EQ(pack_int4(unpack_int4_lo(byte), unpack_int4_hi(byte)), byte);
  }
}

}  // namespace
}  // namespace epmoe
