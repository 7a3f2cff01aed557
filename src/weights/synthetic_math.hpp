// The counter-based generator behind every synthetic tensor, compiled for the host and the
// device, so that weights generated on the GPU are bit-identical with the CPU's.
#pragma once

#include <cstdint>

#include "cuda/hd.hpp"

namespace epmoe::detail {

// Value i of stream `stream`, uniform in [-1, 1) on a 2^-23 grid (24 random bits; both operations
// are exact, so contraction could not change the result either).
EPMOE_HD inline float synth_uniform_pm1(std::uint64_t stream, std::uint64_t i) {
  const std::uint64_t bits = splitmix64(stream ^ splitmix64(i));
  return rn_add(rn_mul(static_cast<float>(bits >> 40), 2.0f / 16777216.0f), -1.0f);
}

// Stream tags of SyntheticWeights (weights.hpp).
enum SynthTag : std::uint64_t { kTagW13 = 1, kTagW2, kTagGate, kTagBias, kTagTokens, kTagShared, kTagCalib };

}  // namespace epmoe::detail
