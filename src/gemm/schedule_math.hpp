// Integer arithmetic of the GEMMs' tile schedules, shared by the kernels and the host tests.
#pragma once

#include <cstdint>

#include "cuda/hd.hpp"

namespace epmoe::kernels {

// n / d for 0 <= n < 2^24 and d >= 1, given inv = 1.0f / d (rounded to nearest): n converts to float
// exactly, the float quotient is within one of the true one (d = 1: exact; d >= 2: error <= 2 / d), and
// one correction step fixes it. Why: a division by a run-time int is ~25 dependent instructions, and
// a tile turn of the FP8 GEMM had several (bench/NOTES.md, session 35).
EPMOE_HD inline std::int32_t div_small(std::int32_t n, std::int32_t d, float inv) {
  std::int32_t q = static_cast<std::int32_t>(static_cast<float>(n) * inv);  // truncates toward zero
  const std::int32_t r = n - q * d;
  q += static_cast<std::int32_t>(r >= d) - static_cast<std::int32_t>(r < 0);
  return q;
}

}  // namespace epmoe::kernels
