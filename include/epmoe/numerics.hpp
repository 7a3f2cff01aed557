// CPU-exact number formats: bf16, fp8 e4m3 and packed signed int4.
//
// These are the bit-level definitions every GPU kernel is checked against, so they follow the
// CUDA conversions exactly: bf16 and e4m3 round to nearest-even; e4m3 saturates at ±448 and
// maps ±Inf to ±448 (CUDA's __nv_fp8_e4m3 uses __NV_SATFINITE); NaN becomes the format's NaN.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace epmoe {

// ---------------------------------------------------------------- bf16
struct bf16 {
  std::uint16_t bits = 0;

  static constexpr bf16 from_bits(std::uint16_t b) { return bf16{b}; }
  static bf16 from_float(float f) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{0x7fff};      // canonical NaN, as CUDA
    const std::uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);  // round to nearest-even
    return bf16{static_cast<std::uint16_t>(rounded >> 16)};
  }
  float to_float() const { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }
};
static_assert(sizeof(bf16) == 2);

inline float round_to_bf16(float f) {
  return bf16::from_float(f).to_float();
}

// ---------------------------------------------------------------- fp8 e4m3 (OCP "E4M3FN")
inline constexpr float kFp8E4m3Max = 448.0f;

struct fp8_e4m3 {
  std::uint8_t bits = 0;

  static constexpr fp8_e4m3 from_bits(std::uint8_t b) { return fp8_e4m3{b}; }

  // Round to nearest-even, saturating to ±448 (also for ±Inf); NaN -> 0x7f (sign kept).
  static fp8_e4m3 from_float(float f) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    const std::uint8_t sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
    const std::uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return fp8_e4m3{static_cast<std::uint8_t>(sign | 0x7f)};
    if (a < 0x3c800000u) {
      // Below the smallest normal 2^-6: multiples of 2^-9. Scaling by 512 is exact; the
      // integer rounds to nearest-even (8 lands on the smallest normal, code 0x08).
      const float scaled = std::bit_cast<float>(a) * 512.0f;
      return fp8_e4m3{static_cast<std::uint8_t>(sign | static_cast<std::uint8_t>(std::nearbyint(scaled)))};
    }
    // Normal: keep 3 of the 23 mantissa bits, rounding to nearest-even (a carry bumps the exponent).
    const std::uint32_t rounded = a + 0x7ffffu + ((a >> 20) & 1u);
    const std::uint32_t exponent = (rounded >> 23) - 120u;  // rebias 127 -> 7
    const std::uint32_t mant = (rounded >> 20) & 0x7u;
    if (exponent > 15u || (exponent == 15u && mant == 7u))
      return fp8_e4m3{static_cast<std::uint8_t>(sign | 0x7e)};
    return fp8_e4m3{static_cast<std::uint8_t>(sign | (exponent << 3) | mant)};
  }

  // Exact, by assembling the f32 bit pattern (no libm on this hot path of every CPU GEMM).
  constexpr float to_float() const {
    const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x80u) << 24;
    const std::uint32_t exponent = (bits >> 3) & 0xfu, mant = bits & 0x7u;
    if (exponent == 0xf && mant == 0x7) return std::bit_cast<float>(sign | 0x7fc00000u);
    if (exponent == 0) {  // subnormal: mant * 2^-9
      const float v = static_cast<float>(mant) * (1.0f / 512.0f);
      return sign ? -v : v;
    }
    return std::bit_cast<float>(sign | ((exponent + 120u) << 23) | (mant << 20));
  }
};
static_assert(sizeof(fp8_e4m3) == 1);

inline float round_to_fp8(float f) {
  return fp8_e4m3::from_float(f).to_float();
}

// ---------------------------------------------------------------- packed signed int4
// Two values per byte: element 2i in the low nibble, element 2i+1 in the high nibble,
// two's complement in [-8, 7].
inline constexpr int kInt4Min = -8;
inline constexpr int kInt4Max = 7;

inline std::uint8_t pack_int4(int lo, int hi) {
  return static_cast<std::uint8_t>((static_cast<unsigned>(lo) & 0xfu) |
                                   ((static_cast<unsigned>(hi) & 0xfu) << 4));
}
inline int unpack_int4_lo(std::uint8_t b) {
  return static_cast<int>(static_cast<std::int8_t>(b << 4)) >> 4;
}
inline int unpack_int4_hi(std::uint8_t b) {
  return static_cast<int>(static_cast<std::int8_t>(b)) >> 4;
}
inline int unpack_int4(const std::uint8_t* packed, std::int64_t index) {
  const std::uint8_t b = packed[index >> 1];
  return (index & 1) ? unpack_int4_hi(b) : unpack_int4_lo(b);
}

}  // namespace epmoe
