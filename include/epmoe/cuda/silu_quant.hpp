// Fused SiLU·mul + FP8 quantization of the GEMM2 input on the GPU, for the contiguous and the masked
// layout (design.md §3, §4). The CPU reference epmoe/silu_quant.hpp is the definition; the GPU
// matches it within tolerance, not bit for bit: act = silu(gate) * up is computed with a fast
// approximation (exp2 and reciprocal approximations, relative error ~1e-6 instead of the CPU's
// IEEE-exact f32 sequence), then quantized exactly as the CPU quantizes a given act (the conventions
// of epmoe/quant.hpp: scale = max(amax, kMinAmax) / 448, correctly rounded, optionally rounded up to
// a power of two; q = e4m3(RN(act / scale)), round to nearest-even, saturating). So a q byte may
// differ from the CPU's by one e4m3 step where act lies next to a rounding boundary, and a group
// scale by a few ulp (a power-of-two scale by a factor of 2 where amax / 448 lies next to a power
// of two); dequantized values agree within design.md §8 (tests/runner/silu_quant_gpu_test.cu).
//
// h is GEMM1's bf16 output with gate = columns [0, I) and up = columns [I, 2I), I % 128 == 0. Every
// tensor is a contiguous Device::cuda view with a 16-byte aligned data pointer; the calls only
// enqueue work on `stream` (no allocation, no host synchronisation; CUDA-graph capturable) and throw
// epmoe::Error naming the argument when a rule is broken. A non-finite act gives an unspecified (but
// in-bounds) result; so does a per-tensor scale below 2^-92 (the division by it is exact above).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "epmoe/cuda/quant.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe::cuda {

enum class Fp8Scaling : std::uint8_t {
  per_token_group,  // one f32 scale per row and 128 channels, in `scale_layout`
  per_tensor,       // one static scale for the whole tensor (W4A8's a2_scale)
};

struct SiluQuantOptions {
  Fp8Scaling scaling = Fp8Scaling::per_token_group;
  // per_token_group: where the scales go (see below) and UE8M0 (power-of-two) rounding.
  ScaleLayout scale_layout = ScaleLayout::token_major;
  bool power_of_two = false;
  // per_tensor: the scale, read by the kernel from tensor_scale_device (f32 [1] on the device) when
  // that has data, else the host value tensor_scale. Positive and finite.
  float tensor_scale = 1.0f;
  TensorView tensor_scale_device;
};

// Contiguous layout: h [M, 2I] bf16, m_indices [M] i32 (rows with m_indices < 0 are padding: their
// q row and scales are left untouched), q (out) [M, I] fp8_e4m3.
// scales (out, per_token_group; per_tensor: ignored):
//   token_major  [M, I/128] f32, scale of (row r, group j) at r * (I/128) + j;
//   mn_major_tma [I/128, tma_aligned_tokens(M)] f32, at j * M_pad + r; entries r in [M, M_pad) are
//                written as 0.0f.
// M may be 0 (nothing is launched).
void silu_mul_quant_contiguous(TensorView h, TensorView m_indices, TensorView q, TensorView scales,
                               const SiluQuantOptions& options, cudaStream_t stream);

// Masked layout: h [E, M_max, 2I] bf16, masked_m [E] i32 on the device (E <= 1024): rows m <
// masked_m[e] of expert e are processed, the others left untouched (masked_m is clamped to
// [0, M_max]); q (out) [E, M_max, I] fp8_e4m3.
// scales (out, per_token_group; per_tensor: ignored):
//   token_major  [E, M_max, I/128] f32;
//   mn_major_tma [E, I/128, tma_aligned_tokens(M_max)] f32 (each expert's block MN-major, as the
//                masked grouped GEMM reads it); entries m in [M_max, M_pad) are written as 0.0f.
void silu_mul_quant_masked(TensorView h, TensorView masked_m, TensorView q, TensorView scales,
                           const SiluQuantOptions& options, cudaStream_t stream);

// The largest E silu_mul_quant_masked accepts.
inline constexpr int kSiluQuantMaxExperts = 1024;

}  // namespace epmoe::cuda
