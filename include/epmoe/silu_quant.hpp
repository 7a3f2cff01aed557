// SiLU·mul + quantization of the GEMM2 input (design.md §1, §4): the step between the two grouped
// GEMMs of the routed experts. CPU reference and definition; the GPU twin (epmoe/cuda/silu_quant.hpp)
// uses a faster SiLU and matches it within tolerance (one e4m3 step at rounding boundaries).
//
// The input is GEMM1's bf16 output h [.., 2I]: gate = columns [0, I), up = columns [I, 2I). Per
// element act = silu(gate) * up in f32 (silu_mul below: IEEE-exact operations only, reproducible on
// any host), then
//   fp8_group:  per row, per group of 128 channels, scale = max(amax, kMinAmax) / 448 (optionally
//               rounded up to a power of two), q = e4m3(act / scale) — quantize_per_token_group_fp8;
//   fp8_tensor: q = e4m3(act / tensor_scale) with one static scale — quantize_per_tensor_fp8;
//   bf16:       q = bf16(act) (round to nearest-even; the unquantized runner's GEMM2 input).
// expert_mlp_cpu's mirror numerics use exactly this function.
#pragma once

#include "epmoe/tensor.hpp"
#include "epmoe/weights.hpp"

namespace epmoe {

// How the GEMM2 input is produced from act.
struct ActQuant {
  ActivationFormat format = ActivationFormat::fp8_group;
  bool power_of_two = false;  // fp8_group: UE8M0 (power-of-two) scales
  float tensor_scale = 1.0f;  // fp8_tensor: the static scale (a2_scale); positive and finite
};

// silu(gate) * up in f32, the exact bits every CPU SiLU·mul of epmoe produces (src/runner/silu_math.hpp;
// the GPU kernels approximate it to ~1e-6 relative).
float silu_mul(float gate, float up);

// Every row: h [rows, 2I] bf16 (I % 128 == 0) -> q [rows, I] (fp8_e4m3, or bf16 for format bf16),
// scales [rows, I/128] f32 for fp8_group (ignored otherwise). Host tensors, contiguous. Throws
// epmoe::Error naming the argument on a wrong dtype/shape/device, a bad tensor_scale, and when some
// act is not finite (an overflowing silu(gate) * up).
void silu_mul_quant_cpu(TensorView h, TensorView q, TensorView scales, const ActQuant& quant);

// Contiguous layout: h [M, 2I], m_indices [M] i32; rows with m_indices[r] < 0 (padding) are skipped:
// their q and scales rows are left untouched. q [M, I], scales [M, I/128] (fp8_group).
void silu_mul_quant_contiguous_cpu(TensorView h, TensorView m_indices, TensorView q, TensorView scales,
                                   const ActQuant& quant);

// Masked layout: h [E, M_max, 2I], masked_m [E] i32 in [0, M_max]; only rows m < masked_m[e] of each
// expert are processed, the others are left untouched. q [E, M_max, I], scales [E, M_max, I/128]
// (fp8_group).
void silu_mul_quant_masked_cpu(TensorView h, TensorView masked_m, TensorView q, TensorView scales,
                               const ActQuant& quant);

}  // namespace epmoe
