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

// v30's trimmed grid (GroupedGemmOptions::trim_ctas): the CTAs that run `tiles` equal tiles in as many
// rounds as `ctas` CTAs would, where the last round would be at least half busy (a smaller tail costs its
// few CTAs little, and v21 splits it where that pays): ceil(T / ceil(T / C)); else `ctas`. The launcher
// asks it (contiguous: the tiles it knows; masked: the tiles it expects, to decide whether the kernel
// should count them), the kernel applies the same rule to the tiles it counts (GemmScheduler::
// plan_split). With tiles <= ctas the answer is ctas or tiles: one tile per busy CTA either way.
EPMOE_HD inline std::int32_t trimmed_ctas(std::int32_t tiles, std::int32_t ctas) {
  if (2 * (tiles % ctas) < ctas) return ctas;
  const std::int32_t rounds = tiles / ctas + 1;
  return (tiles + rounds - 1) / rounds;
}

}  // namespace epmoe::kernels
