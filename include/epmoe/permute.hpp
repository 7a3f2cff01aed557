// Expert permutation on one rank (all experts local): token-major tokens -> the contiguous or the
// masked layout of design.md §3, and the weighted gather back to token-major. CPU reference; the
// GPU twins (epmoe/cuda/permute.hpp) produce the same bytes.
//
// Entries are the (token, k) pairs of topk_ids [T, K] in row-major order i = t*K + k; an entry
// with id -1 is not on this rank and is skipped. Each expert's rows hold its entries in entry order
// (token order, then k), so the result is unique: no atomics decide it.
#pragma once

#include <cstdint>

#include "epmoe/tensor.hpp"

namespace epmoe {

// Contiguous-layout block alignment (== kContiguousAlign of dispatch.hpp).
inline constexpr std::int64_t kPermuteAlign = 128;

// Rows the contiguous layout can need for `entries` (token, k) pairs over `num_experts` experts:
// every non-empty expert block rounded up to 128 rows. A multiple of 128.
std::int64_t contiguous_capacity(std::int64_t entries, int num_experts);

struct PermuteInput {
  TensorView x;         // [T, H] fp8_e4m3 or bf16; H % 128 == 0
  TensorView x_scales;  // fp8: [T, H/128] f32 (token-major); bf16: ignored
  TensorView topk_ids;  // [T, K] i32: local expert in [0, E), or -1 (not on this rank)
};

// The contiguous layout, M rows (M >= the rows needed; the GPU launcher asks for
// M >= contiguous_capacity(T*K, E) since it does not learn the counts on the host).
struct ContiguousLayout {
  TensorView rows;       // [M, H] x's dtype: expert e's entries at rows [offsets[e], offsets[e] + counts[e])
  TensorView scales;     // fp8: [M, H/128] f32; bf16: ignored
  TensorView m_indices;  // [M] i32: expert of each row; -1 on padding and past the last block
  TensorView row_src;    // [M] i32: entry t*K + k of each row; -1 where m_indices is -1
  TensorView src_row;    // [T, K] i32: row of each entry; -1 where topk_ids is -1
  TensorView expert_offsets;  // [E + 1] i32: first row of each expert's block (multiples of 128);
                              //   [E] = M_sum, the end of the last block
  TensorView counts;          // [E] i32: entries (valid rows) of each expert
};

// The masked layout: expert e's entries at rows [0, masked_m[e]) of rows[e].
struct MaskedLayout {
  TensorView rows;      // [E, M_max, H] x's dtype
  TensorView scales;    // fp8: [E, M_max, H/128] f32; bf16: ignored
  TensorView masked_m;  // [E] i32
  TensorView row_src;   // [E, M_max] i32: entry t*K + k of each row; -1 for m >= masked_m[e]
  TensorView src_row;   // [T, K] i32: flat row e * M_max + m of each entry; -1 where topk_ids is -1
};

// Data rows and scales that hold no entry (padding, m >= masked_m[e]) are left untouched; every
// element of m_indices, row_src, src_row, expert_offsets, counts and masked_m is written.
// Host tensors, contiguous. Throws epmoe::Error naming the argument on a wrong dtype, shape or
// device, an id outside [-1, E), too few rows (contiguous), or an expert with more than M_max
// entries (masked).
void permute_contiguous_cpu(const PermuteInput& in, const ContiguousLayout& out);
void permute_masked_cpu(const PermuteInput& in, const MaskedLayout& out);

// The weighted gather (unpermute): y[t] = Σ_k w[t,k] · expert_out[src_row[t,k]] over k ascending,
// skipping entries with src_row < 0, accumulated in f32 as acc = acc + w * v (one rounding for the
// product, one for the sum, starting from +0), then rounded to bf16.
//   expert_out [R, H] bf16, or [E, M_max, H] (masked; read as R = E * M_max rows); src_row [T, K]
//   i32 in [-1, R); topk_weights [T, K] f32; y (out) [T, H] bf16.
void gather_weighted_cpu(TensorView expert_out, TensorView src_row, TensorView topk_weights, TensorView y);

}  // namespace epmoe
