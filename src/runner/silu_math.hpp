// SiLU·mul in f32 with the same bits on the host and on the device: the definition of the CPU
// reference (silu_quant_cpu.cpp, expert_mlp_cpu.cpp). The GPU SiLU·mul + quantization kernel uses a
// fast approximation of it instead (silu_quant_kernels.cuh: silu_mul_fast) and takes only
// div_markstein from here.
//
// act = silu(g) * u, silu(g) = g / (1 + exp(-g)), evaluated with IEEE-exact basic operations only
// (round-to-nearest-even +, *, /, fused multiply-add and exact bit manipulation), each spelled out
// through the rn_* helpers so that nvcc cannot contract a multiply and an add behind our back; the
// host compiler builds in ISO mode (no FP contraction). Compiled by g++ and by nvcc (as
// __host__ __device__), the same operation sequence gives the same bits on both sides; std::exp
// and the device's expf differ from each other, so neither is used.
//
//   e = exp(-|g|) in (0, 1] (below, ~1 ulp), d = 1 + e,
//   silu(g) = g / d            for g >= 0   (= g / (1 + exp(-g)))
//   silu(g) = (g * e) / d      for g <  0   (= g exp(g) / (1 + exp(g)), the same function, no overflow)
//   act = silu(g) * u.
// Relative error of silu against the exact function: a few ulp of f32.
#pragma once

#include <cstdint>

#include "cuda/hd.hpp"

#if !defined(__CUDA_ARCH__)
#include <bit>
#include <cmath>
#endif

namespace epmoe::act {

using detail::rn_add;
using detail::rn_div;
using detail::rn_fma;
using detail::rn_mul;

EPMOE_HD inline float copy_sign(float magnitude, float sign) {
#if defined(__CUDA_ARCH__)
  return copysignf(magnitude, sign);
#else
  return std::copysign(magnitude, sign);
#endif
}

using detail::f32_bits;
using detail::f32_from_bits;

// exp(a) for a <= 0, about 1 ulp; 0 below a = -87 (where exp(a) < 2^-125; silu never needs more:
// there 1 + e == 1 and g * e is below 1e-35).
//   a = n ln2 + r, |r| <= ln2/2: n = round(a log2e) by the 1.5 * 2^23 trick (the fma keeps a * log2e
//   unrounded, and n in [-126, 0] then sits in the low bits of t); ln2 split Cody-Waite style
//   (n * kLn2Hi exact); exp(r) by its degree-7 Taylor polynomial (truncation < 0.1 ulp) in Horner
//   form with fmas; 2^n built from its bits (a normal number for n >= -126), and p * 2^n rounded
//   once (only where the result is subnormal does that multiplication round at all).
EPMOE_HD inline float exp_nonpositive(float a) {
  constexpr float kLog2e = 0x1.715476p+0f;   // 1/ln2
  constexpr float kLn2Hi = 0x1.62e400p-1f;   // 0.693145751953125 (12 trailing zero bits)
  constexpr float kLn2Lo = 0x1.7f7d1cp-20f;  // ln2 - kLn2Hi
  constexpr float kRoundMagic = 0x1.8p+23f;  // t = a*log2e + magic rounds to magic + n
  constexpr float kCutoff = -87.0f;          // a * log2e >= -125.6 above it: n >= -126
  if (!(a >= kCutoff)) return 0.0f;          // includes -inf and NaN (the caller propagates NaN)
  const float t = rn_fma(a, kLog2e, kRoundMagic);
  const float n = rn_add(t, -kRoundMagic);
  float r = rn_fma(-n, kLn2Hi, a);
  r = rn_fma(-n, kLn2Lo, r);
  float p = 0x1.a01a02p-13f;          // 1/5040
  p = rn_fma(p, r, 0x1.6c16c2p-10f);  // 1/720
  p = rn_fma(p, r, 0x1.111112p-7f);   // 1/120
  p = rn_fma(p, r, 0x1.555556p-5f);   // 1/24
  p = rn_fma(p, r, 0x1.555556p-3f);   // 1/6
  p = rn_fma(p, r, 0.5f);
  p = rn_fma(p, r, 1.0f);
  p = rn_fma(p, r, 1.0f);
  // n = bits(t) - bits(magic), in [-126, 0]; 2^n = bits (n + 127) << 23.
  const std::uint32_t biased = f32_bits(t) - f32_bits(kRoundMagic) + 127u;
  return rn_mul(p, f32_from_bits(biased << 23));
}

// silu(g) = g / (1 + exp(-g)) (see the header comment for the formula per sign).
EPMOE_HD inline float silu(float g) {
  const float e = exp_nonpositive(g > 0.0f ? -g : g);  // exp(-|g|)
  const float d = rn_add(1.0f, e);
  return rn_div(g >= 0.0f ? g : rn_mul(g, e), d);
}

// The GEMM2 input before quantization: silu(gate) * up, in f32.
EPMOE_HD inline float silu_mul(float gate, float up) {
  return rn_mul(silu(gate), up);
}

// a / s from y = RN(1/s) (one reciprocal shared by many quotients), by Markstein's theorem:
// q0 = RN(a y) is within 1 ulp of a / s, r = a - s q0 is exact (fma), and RN(q0 + r y) is the
// correctly rounded a / s, provided nothing underflows or overflows. r underflows only for tiny
// |a| (below ~2^-100 here); the sign is taken from a so that a = -0 gives -0 as the division does.
// The FP8 quantizer uses it with s = group scale >= kMinAmax / 448 and |a| <= 448 s: there the
// result's e4m3 rounding equals that of the IEEE quotient for every a (tested on the host).
EPMOE_HD inline float div_markstein(float a, float s, float y) {
  const float q0 = rn_mul(a, y);
  const float r = rn_fma(-s, q0, a);
  return copy_sign(rn_fma(r, y, q0), a);
}

}  // namespace epmoe::act
