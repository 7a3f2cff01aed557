// FP8 block-scaled grouped GEMM (design.md §3, §4): the CPU reference that the GPU kernels
// (epmoe/cuda/grouped_gemm.hpp) are checked against.
//
//   D[m, n] = Σ_k A[m, k] · B[g(m), n, k]
//
// with A e4m3 and one f32 scale per (row, 128-wide K block), B e4m3 [G, N, K] with one f32
// scale_inv per 128×128 block (the DeepSeek-V3 checkpoint format), bf16 output. The reference
// evaluates, in f64,
//
//   D[m, n] = Σ_kb  sa[m, kb] · sb[g, n / 128, kb] · Σ_{k in block kb} a[m, k] · b[g, n, k]
//
// (the inner sums of e4m3 products are exact in f64), and rounds once to bf16 (nearest-even) —
// or writes the unrounded f64 value when d is an f64 tensor.
//
// Rows that belong to no group (m_indices = -1, or past masked_m) are skipped: their rows of d
// are left untouched, so callers can poison d and see that they were never written.
#pragma once

#include <cstdint>

#include "epmoe/tensor.hpp"

namespace epmoe {

// K (and the N rows of a weight block) per scale.
inline constexpr std::int64_t kGemmScaleBlock = 128;

// Contiguous layout (DeepGEMM "contiguous", design.md §3):
//   a         [M, K] fp8_e4m3, K % 128 == 0
//   a_scales  [M, K/128] f32, token-major (scale of (m, kb) at m * K/128 + kb)
//   b         [G, N, K] fp8_e4m3
//   b_scales  [G, ceil(N/128), K/128] f32
//   m_indices [M] i32, each in [-1, G): the group of row m, -1 on padding rows
//   d         [M, N] bf16 or f64 (out)
// All host (cpu) tensors, contiguous. Throws epmoe::Error naming the argument on a wrong dtype,
// shape, device or layout, a group index out of range, or a NaN/Inf scale.
void grouped_gemm_contiguous_cpu(TensorView a, TensorView a_scales, TensorView b, TensorView b_scales,
                                 TensorView m_indices, TensorView d);

// Masked layout (DeepGEMM "masked", design.md §3):
//   a         [G, M_max, K] fp8_e4m3, K % 128 == 0
//   a_scales  [G, M_max, K/128] f32, token-major
//   b         [G, N, K] fp8_e4m3
//   b_scales  [G, ceil(N/128), K/128] f32
//   masked_m  [G] i32, each in [0, M_max]: rows [0, masked_m[g]) of group g are valid
//   d         [G, M_max, N] bf16 or f64 (out); rows >= masked_m[g] are left untouched
void grouped_gemm_masked_cpu(TensorView a, TensorView a_scales, TensorView b, TensorView b_scales,
                             TensorView masked_m, TensorView d);

// W4A8 (DeepSeek-R1-W4AFP8 format, design.md §4): e4m3 activations with one static per-tensor
// scale, signed int4 weights w i4x2 [G, N, K/2] (two per byte, element 2i in the low nibble) with
// one f32 scale per 128 consecutive K of each row, w_scales [G, N, K/128]. In f64:
//
//   D[m, n] = a_scale · Σ_kb  w_scales[g, n, kb] · Σ_{k in block kb} a[m, k] · w[g, n, k]
//
// (each block sum exact), rounded once to bf16 (or written unrounded to an f64 d). Rows outside
// every group are left untouched, as above. a_scale must be positive and finite.
void w4a8_grouped_gemm_contiguous_cpu(TensorView a, float a_scale, TensorView w, TensorView w_scales,
                                      TensorView m_indices, TensorView d);
void w4a8_grouped_gemm_masked_cpu(TensorView a, float a_scale, TensorView w, TensorView w_scales,
                                  TensorView masked_m, TensorView d);

}  // namespace epmoe
