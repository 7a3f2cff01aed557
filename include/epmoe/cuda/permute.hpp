// Expert permutation and weighted gather on the GPU: the twins of epmoe/permute.hpp (same
// PermuteInput / ContiguousLayout / MaskedLayout structs, same bytes).
//
// Deterministic without host synchronisation: per-chunk expert histograms, one scan over chunks
// and experts, then every (token, k) entry's row from its chunk's base plus its stable rank inside
// the chunk; so each expert's rows are its entries in (token, k) order, as on the CPU. No atomics
// decide any output.
//
// Every tensor is a contiguous Device::cuda view with a 16-byte aligned data pointer; the calls
// only enqueue work on `stream` (no allocation, no host synchronisation; CUDA-graph capturable)
// and throw epmoe::Error naming the argument when a rule is broken. Ids outside [0, E) are treated
// as -1 (skipped) on the GPU; the CPU refuses them.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "epmoe/cuda/quant.hpp"
#include "epmoe/permute.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe::cuda {

inline constexpr int kPermuteMaxExperts = 1024;  // E
inline constexpr int kPermuteMaxTopk = 32;       // K

// Bytes of device workspace (a u8 tensor, 16-byte aligned) that permute_contiguous and
// permute_masked need for up to `max_entries` = T * K entries over `num_experts` experts.
std::size_t permute_workspace_bytes(std::int64_t max_entries, int num_experts);

// Token-major -> contiguous layout. E = expert_offsets.size(0) - 1. out.rows must have
// M >= contiguous_capacity(T * K, E) rows (the counts stay on the device); every element of
// m_indices and row_src is written (the rows past M_sum are padding).
// scale_layout (fp8 x): token_major scales [M, H/128], or mn_major_tma [H/128,
// tma_aligned_tokens(M)] (scale of (row r, group g) at g * M_pad + r; entries r >= M written 0).
void permute_contiguous(const PermuteInput& in, const ContiguousLayout& out, TensorView workspace,
                        cudaStream_t stream, ScaleLayout scale_layout = ScaleLayout::token_major);

// Token-major -> masked layout. E = masked_m.size(0), M_max = rows.size(1). An expert with more
// than M_max entries keeps its first M_max (in entry order): masked_m = M_max and src_row = -1 for
// the rest (the CPU throws instead). scale_layout (fp8 x): token_major [E, M_max, H/128], or
// mn_major_tma [E, H/128, tma_aligned_tokens(M_max)] (entries m >= M_max written 0).
void permute_masked(const PermuteInput& in, const MaskedLayout& out, TensorView workspace,
                    cudaStream_t stream, ScaleLayout scale_layout = ScaleLayout::token_major);

// y[t] = Σ_k w[t,k] · expert_out[src_row[t,k]], k ascending, f32 (acc + w * v, each rounded), bf16
// out: bit-identical with gather_weighted_cpu. Entries with src_row outside [0, R) are skipped.
//   expert_out [R, H] or [E, M_max, H] bf16 (H % 8 == 0), src_row [T, K] i32, topk_weights [T, K] f32,
//   y (out) [T, H] bf16.
void gather_weighted(TensorView expert_out, TensorView src_row, TensorView topk_weights, TensorView y,
                     cudaStream_t stream);

}  // namespace epmoe::cuda
