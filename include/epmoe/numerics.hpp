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
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{0x7fff};  // canonical NaN, as CUDA
    const std::uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);  // round to nearest-even
    return bf16{static_cast<std::uint16_t>(rounded >> 16)};
  }
  float to_float() const { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }
};
static_assert(sizeof(bf16) == 2);

inline float round_to_bf16(float f) { return bf16::from_float(f).to_float(); }

// ---------------------------------------------------------------- fp8 e4m3 (OCP "E4M3FN")
inline constexpr float kFp8E4m3Max = 448.0f;

struct fp8_e4m3 {
  std::uint8_t bits = 0;

  static constexpr fp8_e4m3 from_bits(std::uint8_t b) { return fp8_e4m3{b}; }

  // Round to nearest-even, saturating to ±448 (also for ±Inf); NaN -> 0x7f (sign kept).
  static fp8_e4m3 from_float(float f) {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    const std::uint8_t sign = static_cast<std::uint8_t>((u >> 24) & 0x80u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return fp8_e4m3{static_cast<std::uint8_t>(sign | 0x7f)};
    const float a = std::fabs(f);
    if (a >= kFp8E4m3Max) return fp8_e4m3{static_cast<std::uint8_t>(sign | 0x7e)};
    // Quantum of the binade that holds a (subnormals share the quantum of the lowest binade).
    int exp2 = 0;
    std::frexp(a, &exp2);                       // a = m * 2^exp2, m in [0.5, 1)
    const int e = exp2 - 1 < -6 ? -6 : exp2 - 1;  // a in [2^e, 2^(e+1)), clamped to min normal
    const float quantum = std::ldexp(1.0f, e - 3);
    const float r = std::nearbyint(a / quantum) * quantum;  // exact: dividing by a power of 2
    if (r > kFp8E4m3Max) return fp8_e4m3{static_cast<std::uint8_t>(sign | 0x7e)};
    if (r == 0.0f) return fp8_e4m3{sign};
    if (r < 0.015625f) {  // subnormal: r = mant * 2^-9
      return fp8_e4m3{static_cast<std::uint8_t>(sign | static_cast<std::uint8_t>(r * 512.0f))};
    }
    std::frexp(r, &exp2);
    const int re = exp2 - 1;
    const int mant = static_cast<int>(std::ldexp(r, 3 - re)) - 8;
    return fp8_e4m3{static_cast<std::uint8_t>(sign | ((re + 7) << 3) | mant)};
  }

  float to_float() const {
    const float sign = (bits & 0x80) ? -1.0f : 1.0f;
    const int exponent = (bits >> 3) & 0xf;
    const int mant = bits & 0x7;
    if (exponent == 0xf && mant == 0x7) return std::nanf("");
    if (exponent == 0) return sign * std::ldexp(static_cast<float>(mant), -9);
    return sign * std::ldexp(static_cast<float>(8 + mant), exponent - 10);
  }
};
static_assert(sizeof(fp8_e4m3) == 1);

inline float round_to_fp8(float f) { return fp8_e4m3::from_float(f).to_float(); }

// ---------------------------------------------------------------- packed signed int4
// Two values per byte: element 2i in the low nibble, element 2i+1 in the high nibble,
// two's complement in [-8, 7].
inline constexpr int kInt4Min = -8;
inline constexpr int kInt4Max = 7;

inline std::uint8_t pack_int4(int lo, int hi) {
  return static_cast<std::uint8_t>((static_cast<unsigned>(lo) & 0xfu) |
                                   ((static_cast<unsigned>(hi) & 0xfu) << 4));
}
inline int unpack_int4_lo(std::uint8_t b) { return static_cast<int>(static_cast<std::int8_t>(b << 4)) >> 4; }
inline int unpack_int4_hi(std::uint8_t b) { return static_cast<int>(static_cast<std::int8_t>(b)) >> 4; }
inline int unpack_int4(const std::uint8_t* packed, std::int64_t index) {
  const std::uint8_t b = packed[index >> 1];
  return (index & 1) ? unpack_int4_hi(b) : unpack_int4_lo(b);
}

}  // namespace epmoe
