// Bit-reproducible f32 math shared by the CPU router and the GPU routing kernel.
//
// Everything here uses IEEE-exact basic operations only (round-to-nearest-even +, -, *, /, fused
// multiply-add, ldexp and comparisons), each spelled out through the rn_* helpers so that nvcc cannot
// contract a multiply and an add into an FMA behind our back. Compiled by the host compiler and by nvcc
// (as __host__ __device__), the same operation sequence yields the same bits on both sides.
#pragma once

#include "cuda/hd.hpp"

#include <cstdint>
#if defined(__CUDACC__)
#include "cuda/ptx.cuh"  // rcp_approx_ftz (device code only)
#endif
#if !defined(__CUDA_ARCH__)
#include <bit>
#include <cmath>
#endif

namespace epmoe::routing {

using detail::rn_add;
using detail::rn_div;
using detail::rn_fma;
using detail::rn_mul;

EPMOE_HD inline float rn_max(float a, float b) {  // exact; the non-NaN one when one is NaN
#if defined(__CUDA_ARCH__)
  return fmaxf(a, b);
#else
  return std::fmax(a, b);
#endif
}

EPMOE_HD inline float neg_abs(float x) {  // -|x|, exact
#if defined(__CUDA_ARCH__)
  return -fabsf(x);
#else
  return -std::fabs(x);
#endif
}

using detail::f32_bits;
using detail::f32_from_bits;

// x * 2^n with a single rounding (exact unless the result is subnormal or out of range).
EPMOE_HD inline float rn_ldexp(float x, int n) {
#if defined(__CUDA_ARCH__)
  return ldexpf(x, n);
#else
  return std::ldexp(x, n);
#endif
}

// exp(a) for a <= 0 (a finite or -inf), max error about 1 ulp, subnormal results rounded once.
//   a = n*ln2 + r, |r| <= ln2/2, with ln2 split into ln2_hi (12 trailing zero bits, so n*ln2_hi is
//   exact for |n| < 2^12) and ln2_lo (Cody-Waite); exp(r) from its degree-7 Taylor polynomial
//   (truncation error < 0.1 ulp on |r| <= ln2/2) evaluated by Horner with FMAs; then scaled by 2^n.
EPMOE_HD inline float exp_nonpositive(float a) {
  constexpr float kLog2e = 0x1.715476p+0f;   // 1/ln2
  constexpr float kLn2Hi = 0x1.62e400p-1f;   // 0.693145751953125
  constexpr float kLn2Lo = 0x1.7f7d1cp-20f;  // ln2 - kLn2Hi
  constexpr float kRoundMagic = 0x1.8p+23f;  // adding it rounds |v| < 2^22 to an integer
  constexpr float kUnderflow = -104.0f;      // exp(-104) < 2^-150: rounds to +0
  if (!(a >= kUnderflow)) return 0.0f;       // includes -inf (NaN is the caller's business)
  // n = round(a / ln2); fma keeps a*log2e unrounded so that the host and the device agree.
  const float n = rn_add(rn_fma(a, kLog2e, kRoundMagic), -kRoundMagic);
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
  return rn_ldexp(p, static_cast<int>(n));
}

// 1 / (1 + exp(-x)) in f32. With e = exp(-|x|) in (0, 1]: 1/(1+e) for x >= 0, e/(1+e) for x < 0
// (no overflow, full relative accuracy on the tiny side). Saturates to exactly 1 for large x and to
// +0 below about -104; NaN propagates.
EPMOE_HD inline float sigmoid_f32(float x) {
  if (x != x) return x;
  const float a = x > 0.0f ? -x : x;
  const float e = exp_nonpositive(a);
  const float d = rn_add(1.0f, e);
  return x >= 0.0f ? rn_div(1.0f, d) : rn_div(e, d);
}

// sigmoid_f32 in fewer operations (the GPU router's version), bit for bit the same on every
// non-NaN input (NaN gives 0 here): the same rounded operations on the same values, rearranged.
//  - The range test is a clamp: a = max(-|x|, -104). exp_nonpositive(-104) rounds to +0, as every
//    a < -104 does there; -|x| differs from sigmoid_f32's a only for x = +0 (-0 instead of +0),
//    which gives the same n, r and p.
//  - No ldexp: the polynomial runs on coefficients scaled by 2^64 (p' = 2^64 p exactly: every
//    intermediate is normal, so each rounding commutes with the power-of-two scale); n is added to
//    p's exponent field as an integer (2^(64 + n) p is normal for n in [-151, 0], so this is exact),
//    and the final multiply by 2^-64 rounds once, as ldexp does (subnormal results included). The
//    integer n comes straight from the bits of t = a*log2e + 1.5*2^23: bits(t) = 0x4b400000 + n,
//    whose low 9 bits shifted left by 23 are n << 23 modulo 2^32.
//  - One division, 1/d or e/d.
// sigmoid_exp_neg_abs is its e = exp(-|x|), which sigmoid_f32_branch_free shares.
EPMOE_HD inline float sigmoid_exp_neg_abs(float x) {
  constexpr float kLog2e = 0x1.715476p+0f;
  constexpr float kLn2Hi = 0x1.62e400p-1f;
  constexpr float kLn2Lo = 0x1.7f7d1cp-20f;
  constexpr float kRoundMagic = 0x1.8p+23f;
  const float a = rn_max(neg_abs(x), -104.0f);
  const float t = rn_fma(a, kLog2e, kRoundMagic);
  const float n = rn_add(t, -kRoundMagic);
  float r = rn_fma(-n, kLn2Hi, a);
  r = rn_fma(-n, kLn2Lo, r);
  float p = 0x1.a01a02p+51f;          // 2^64 / 5040
  p = rn_fma(p, r, 0x1.6c16c2p+54f);  // 2^64 / 720
  p = rn_fma(p, r, 0x1.111112p+57f);  // 2^64 / 120
  p = rn_fma(p, r, 0x1.555556p+59f);  // 2^64 / 24
  p = rn_fma(p, r, 0x1.555556p+61f);  // 2^64 / 6
  p = rn_fma(p, r, 0x1p+63f);
  p = rn_fma(p, r, 0x1p+64f);
  p = rn_fma(p, r, 0x1p+64f);
  return rn_mul(f32_from_bits(f32_bits(p) + (f32_bits(t) << 23)), 0x1p-64f);
}

EPMOE_HD inline float sigmoid_f32_fast(float x) {
  const float e = sigmoid_exp_neg_abs(x);
  return rn_div(x >= 0.0f ? 1.0f : e, rn_add(1.0f, e));
}

// n / d rounded to nearest even without a branch, for the sigmoid's quotients only: n = 1 or
// n = e, d = rn(1 + e), e in [0, 1]. On the device: for d in (1, 2] (then n is 1 or in
// (2^-24, 1], and the quotient is normal) the fast path of div.rn.f32 (reciprocal estimate, one
// Newton step, one residual correction) is correctly rounded — div.rn's FCHK only sends inputs
// outside that range to the slow path. d == 1 (e <= 2^-24, subnormal e included) needs no case of
// its own: rcp.approx(1) = 1, so q0 = n, the residual is 0 and q = n = n / 1 (no flush to zero).
// __fdiv_rn keeps FCHK and its branch, which splits the 32 sigmoids of a g8 lane into 32 basic
// blocks that run one after another; this version lets them interleave. Checked against
// __fdiv_rn through the whole sigmoid on all 2^32 inputs by the GPU test
// RouterMathGpu.BranchFreeSigmoidBitIdenticalOnEveryFloat. On the host: n / d.
EPMOE_HD inline float div_rn_sigmoid(float n, float d) {
#if defined(__CUDA_ARCH__)
  float r = ptx::rcp_approx_ftz(d);
  r = rn_fma(r, rn_fma(-d, r, 1.0f), r);
  const float q0 = rn_mul(n, r);
  return rn_fma(rn_fma(-d, q0, n), r, q0);
#else
  return n / d;
#endif
}

// sigmoid_f32_fast with div_rn_sigmoid for its division: the same bits (the GPU routers' default).
EPMOE_HD inline float sigmoid_f32_branch_free(float x) {
  const float e = sigmoid_exp_neg_abs(x);
  return div_rn_sigmoid(x >= 0.0f ? 1.0f : e, rn_add(1.0f, e));
}

// ---- the sieve (route_g8_sieve_kernel): an approximate sigmoid with a proven error bound decides
// which experts can matter; only those get the exact one.
//
// kSieveApproxErr bounds |sigmoid_approx(x) - sigmoid_f32_fast(x)| over every f32 x (the kernel's
// rcp.approx(1 + ex2.approx(-x log2e)), exponent clamped to 126; the GPU test
// RouterMathGpu.SieveSigmoidWithinItsBoundOnEveryFloat checks all 2^32 inputs; v3 measured
// 2^-22.4 at most).
inline constexpr float kSieveApproxErr = 0x1p-18f;

// The sieve's margin M for a bias whose largest |b| is `bias_abs_max` (+inf when a bias is not
// finite, NaN included: then every value is computed exactly). With ca = rn(sa + b) the approximate
// and c = rn(s + b) the exact selection value, |sa - s| <= err:
//   |ca - c| <= err + 2^-24 (|sa + b| + |s + b|) <= delta = err + 2^-22 (|b|max + 2);
//   a group's approximate score rn(a1 + a2) is within 2 delta + 2^-22 (|b|max + 2) of the exact
//   rn(t1 + t2) (order statistics move by at most delta);
//   M = 2 delta + 2^-20 (|b|max + 2) covers that, and the roundings of the thresholds a2 - M and
//   tau' - M (each <= 2^-24 (|b|max + 1 + M)).
// Rounded upwards on the device; on the host (the CPU emulation of the kernel) computed in double
// and rounded up to a float. Any M above the bound gives the same outputs (only the work changes).
EPMOE_HD inline float sieve_margin(float bias_abs_max) {
  const float kInf = f32_from_bits(0x7f800000u);
  if (!(bias_abs_max <= 0x1p+100f)) return kInf;  // NaN, inf, or too large to be useful
#if defined(__CUDA_ARCH__)
  const float slack = __fadd_ru(bias_abs_max, 2.0f);
  const float delta = __fmaf_ru(slack, 0x1p-22f, kSieveApproxErr);
  return __fmaf_ru(slack, 0x1p-20f, __fmul_ru(2.0f, delta));
#else
  const double slack = static_cast<double>(bias_abs_max) + 2.0;
  const double delta = slack * 0x1p-22 + static_cast<double>(kSieveApproxErr);
  const double m = slack * 0x1p-20 + 2.0 * delta;
  const float f = static_cast<float>(m);
  return static_cast<double>(f) >= m ? f : std::nextafter(f, kInf);
#endif
}

// The sigmoid the GPU kernels use: branch-free by default, sigmoid_f32_fast (with __fdiv_rn) when
// kRnDiv (kept to time one against the other).
template <bool kRnDiv>
EPMOE_HD inline float sigmoid_f32_gpu(float x) {
  if constexpr (kRnDiv) {
    return sigmoid_f32_fast(x);
  } else {
    return sigmoid_f32_branch_free(x);
  }
}

}  // namespace epmoe::routing
