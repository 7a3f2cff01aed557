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

// Standard normal values (from a hash of (seed, index)) quantized to e4m3 as DeepGEMM's tests and a
// model's per-group quantization do: each block of `block_rows` (1 or 128) rows x 128 columns is
// scaled so that its largest magnitude becomes 448. x: fp8_e4m3 [rows, cols] (any leading dims folded
// into rows), contiguous, cols a multiple of 128, on the device.
void fill_quantized_normal_fp8(TensorView x, std::int64_t block_rows, std::uint64_t seed,
                               cudaStream_t stream);

// Which values the benchmark's FP8 operands hold (EPMOE_BENCH_GEMM_DATA): the tensor cores' power,
// and with it the clock a power-limited card allows, depends on the operands' bits, so a time is only
// comparable with another taken on the same kind of data.
enum class Fp8Data {
  quantized_normal,  // "normal" (default): fill_quantized_normal_fp8, the data of anchors.md's DeepGEMM rows
  uniform,           // "uniform": fill_random_fp8 (exponents in [-4, 4], every mantissa equally likely)
};
Fp8Data fp8_data_from_env();
const char* fp8_data_name(Fp8Data data);

// Every int4 value -8 of the i4x2 weights w (contiguous, on the device) becomes -7: weights that a
// symmetric amax / 7 quantizer could have produced, which the sign-magnitude codes can hold.
void clear_int4_minus8(TensorView w, cudaStream_t stream);

// Positive f32 values (1 + u) * 2^e, u in [0, 1), e in [-10, -4], from a hash of (seed, index).
void fill_random_scales(TensorView x, std::uint64_t seed, cudaStream_t stream);

}  // namespace epmoe::bench
