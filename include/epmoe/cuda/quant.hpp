// FP8 activation quantizers on the GPU (design.md §4). Each is bit-exact with its CPU twin in
// epmoe/quant.hpp: scale = max(amax, kMinAmax) / 448 (IEEE f32 division), optionally rounded up
// to a power of two; q = e4m3(x / scale), round to nearest-even, saturated at ±448.
//
// All tensors are Device::cuda views, contiguous, with 16-byte aligned data pointers; the calls
// only enqueue work on `stream` (no allocation, no host synchronisation) and throw epmoe::Error
// naming the argument when a rule is broken. Inputs must be finite: a NaN or Inf input gives an
// unspecified (but in-bounds) result.
#pragma once

#include <cstdint>
#include <string_view>

#include <cuda_runtime_api.h>

#include "epmoe/tensor.hpp"

namespace epmoe::cuda {

// ---------------------------------------------------------------- per-token-group FP8
// Where the [T, K/128] scales go.
enum class ScaleLayout : std::uint8_t {
  // scales [T, K/128] f32, row-major: scale of (token t, group g) at t * (K/128) + g.
  token_major,
  // scales [K/128, T_pad] f32, row-major, T_pad = tma_aligned_tokens(T) (T rounded up to a
  // multiple of 4, so each group's column of T scales starts 16-byte aligned): scale of (t, g) at
  // g * T_pad + t. This is DeepGEMM's MN-major, TMA-aligned scale layout for the A operand (the
  // [T, K/128] tensor with strides (1, T_pad)). The padding entries t in [T, T_pad) are written
  // as 0.0f.
  mn_major_tma,
};
std::string_view to_string(ScaleLayout layout);

inline constexpr std::int64_t tma_aligned_tokens(std::int64_t tokens) {
  return (tokens + 3) / 4 * 4;
}

// Per-token, per-128-channel-group FP8 quantization (CPU twin: epmoe::quantize_per_token_group_fp8
// with group = 128).
//   x [T, K] bf16, K % 128 == 0; q (out) [T, K] fp8_e4m3;
//   scales (out) f32, [T, K/128] (token_major) or [K/128, tma_aligned_tokens(T)] (mn_major_tma).
// T may be 0 (nothing is launched).
void quantize_per_token_group_fp8(TensorView x, TensorView q, TensorView scales, cudaStream_t stream,
                                  ScaleLayout layout = ScaleLayout::token_major, bool power_of_two = false);

// ---------------------------------------------------------------- per-tensor FP8
// q = e4m3(x / scale) with one static scale (CPU twin: epmoe::quantize_per_tensor_fp8).
//   x [..] bf16 (any rank, any element count); q (out) the same shape, fp8_e4m3.
//   scale: positive and finite.
void quantize_per_tensor_fp8(TensorView x, TensorView q, float scale, cudaStream_t stream);
// The same with the scale read from device memory (e.g. computed by per_tensor_fp8_scale on the
// same stream, with no host round trip): scale f32 [1] on the device, positive and finite.
void quantize_per_tensor_fp8(TensorView x, TensorView q, TensorView scale, cudaStream_t stream);

// amax (out) f32 [1] on the device = max |x| over all of x [..] bf16 (0 for an empty x).
void per_tensor_amax(TensorView x, TensorView amax, cudaStream_t stream);
// scale (out) f32 [1] on the device = max(amax(x), kMinAmax) / 448 (CPU twin:
// epmoe::per_tensor_fp8_scale).
void per_tensor_fp8_scale(TensorView x, TensorView scale, cudaStream_t stream);

}  // namespace epmoe::cuda
