// Random device inputs for the grouped GEMM benchmark (suite_gemm.cpp); device code in
// suite_gemm_fill.cu.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "epmoe/tensor.hpp"

namespace epmoe::bench {

// e4m3 normal numbers (never zero, never NaN) of random sign, exponent in [-4, 4] and mantissa,
// from a hash of (seed, index). x: fp8_e4m3 or u8, contiguous, on the device.
void fill_random_fp8(TensorView x, std::uint64_t seed, cudaStream_t stream);

// Positive f32 values (1 + u) * 2^e, u in [0, 1), e in [-10, -4], from a hash of (seed, index).
void fill_random_scales(TensorView x, std::uint64_t seed, cudaStream_t stream);

}  // namespace epmoe::bench
