// EPMOE_HD marks functions compiled for both the host and the device (the shared definitions that
// keep CPU references and GPU kernels bit-identical).
#pragma once

#ifndef EPMOE_HD
#if defined(__CUDACC__)
#define EPMOE_HD __host__ __device__
#else
#define EPMOE_HD
#endif
#endif

#include <cstdint>
#if !defined(__CUDA_ARCH__)
#include <bit>
#include <cmath>
#endif

namespace epmoe::detail {

// The splitmix64 finaliser: a bijection of 64-bit words with good avalanche, the counter-based random
// numbers of the synthetic weights and the benchmarks' inputs (a hash of seed and index: no state, the
// same value on the host and the device).
EPMOE_HD inline std::uint64_t mix64_finalize(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// splitmix64's output for state z (the golden-ratio increment, then the finaliser).
EPMOE_HD inline std::uint64_t splitmix64(std::uint64_t z) {
  return mix64_finalize(z + 0x9e3779b97f4a7c15ull);
}

// Round-to-nearest-even f32 operations spelled out, so that nvcc cannot contract a multiply and an
// add into an FMA: the same operation sequence gives the same bits on the host and the device.
EPMOE_HD inline float rn_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

EPMOE_HD inline float rn_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

EPMOE_HD inline float rn_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

EPMOE_HD inline float rn_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

EPMOE_HD inline std::uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  return std::bit_cast<std::uint32_t>(x);
#endif
}

EPMOE_HD inline float f32_from_bits(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  return std::bit_cast<float>(u);
#endif
}

}  // namespace epmoe::detail
