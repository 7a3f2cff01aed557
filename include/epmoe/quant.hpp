// Quantizers and dequantizers (design.md §4). All CPU, all exact definitions that the GPU
// kernels are checked against bit for bit.
//
// Conventions shared by every FP8 quantizer: scale = max(amax, kMinAmax) / 448 in f32, rounded up
// to a power of two (2^ceil(log2(scale)), exactly) when pow2 scales are asked for; q = fp8(x / scale)
// with an IEEE f32 division, rounded to nearest-even and saturated at ±448. Dequantized value =
// float(q) * scale, in f32.
//
// Every function takes contiguous host (cpu) tensors and throws epmoe::Error, naming the argument,
// on a wrong dtype, shape, device or layout, on a group/block that is not positive or does not divide
// K, on a NaN or Inf input element (including NaN fp8 codes given to a dequantizer), and on a scale
// that is not positive and finite.
#pragma once

#include "epmoe/tensor.hpp"

namespace epmoe {

// Lower bound on amax, so that an all-zero group gets a finite, non-zero scale.
inline constexpr float kMinAmax = 1e-10f;

// Scale for a group whose absolute maximum is amax (see the conventions above). amax must be
// finite and >= 0.
float fp8_scale_for_amax(float amax, bool power_of_two);

// bf16 (round to nearest even, as bf16::from_float): x [..] f32, out (out) the same shape bf16, e.g.
// the activations of a bf16 dispatch from f32 data. to_bf16 returns a new tensor of x's shape. Not
// saturating: a finite |x| >= 0x1.ffp127 (half way from bf16's largest, 0x1.fep127, to 2^128) rounds
// to Inf.
void convert_to_bf16(TensorView x, TensorView out);
HostTensor to_bf16(TensorView x);

// Per-token-group FP8 (1 x group along K).
//   x [T, K] bf16 or f32, q (out) [T, K] fp8, scales (out) [T, K/group] f32. K % group == 0.
void quantize_per_token_group_fp8(TensorView x, TensorView q, TensorView scales, int group = 128,
                                  bool power_of_two = false);
//   q [T, K] fp8, scales [T, K/group] f32 -> out [T, K] f32
void dequantize_per_token_group_fp8(TensorView q, TensorView scales, TensorView out, int group = 128);

// 128 x 128 block weight FP8 (DeepSeek-V3 checkpoint format).
//   w [N, K] f32 or bf16, q (out) [N, K] fp8, scale_inv (out) [ceil(N/128), K/128] f32. K % 128 == 0;
//   N need not be, the last row block is then partial (its amax covers only the rows that exist).
//   scale_inv = max(amax, kMinAmax) / 448 (never rounded to a power of two); w ≈ float(q) * scale_inv.
void quantize_block_fp8(TensorView w, TensorView q, TensorView scale_inv, int block = 128);
void dequantize_block_fp8(TensorView q, TensorView scale_inv, TensorView out, int block = 128);

// Per-tensor FP8 with a given (static) scale: q = fp8(x / scale).
//   x [..] bf16 or f32, q (out) same shape fp8. scale must be positive and finite.
void quantize_per_tensor_fp8(TensorView x, TensorView q, float scale);
// The scale a per-tensor quantizer would use for x (amax over the whole tensor / 448).
float per_tensor_fp8_scale(TensorView x);
void dequantize_per_tensor_fp8(TensorView q, float scale, TensorView out);

// Signed int4 weights with one f32 scale per `group` consecutive K values of each row:
//   scale = max(amax, kMinAmax) / 7 (f32), v = clamp(round_half_even(w / scale), -8, 7) with an f32
//   division. w [N, K] f32 or bf16, packed (out) [N, K/2] i4x2 (pack_int4: element 2i in the low
//   nibble), scales (out) [N, K/group] f32. K must be even and a multiple of group.
//   Dequantized value = float(v) * scale, in f32 (out [N, K]).
void quantize_int4_grouped(TensorView w, TensorView packed, TensorView scales, int group = 128);
void dequantize_int4_grouped(TensorView packed, TensorView scales, TensorView out, int group = 128);

}  // namespace epmoe
