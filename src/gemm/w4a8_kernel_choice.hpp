// Which W4A8 grouped GEMM kernel an automatic call runs (internal: the bench and the tests pin one;
// the public API, epmoe/cuda/w4a8_gemm.hpp, only has the automatic choice and the register-operand
// kernel's explicit tiles).
//
//   version 2: the register-operand kernel (w4a8_grouped_gemm_kernel.cuh), tile by
//              w4a8_gemm_tile() unless options.block_m / options.consumers are given;
//   version 3: weights converted to e4m3 in shared memory (w4a8_smem_gemm_kernel.cuh; the automatic
//              choice's 128-row tiles with signed_codes = 1 from session 23, masked only from session
//              25, and since session 28 only the masked 64 x 256 tile, expected_m 25..64), tiles of
//              block_m (64 or 128) activation rows x block_n (128 or 256) weight columns, each
//              consumer warpgroup owning 64 rows x 128 waves columns; or the tall tile (block_m = 256,
//              block_n = 128, waves = 2, signed_codes = 1, contiguous only: each consumer 128 rows as
//              two 64-row waves; the automatic choice for groups of >= 2048 rows on average in
//              session 24, replaced by v2's wide tile in session 25); zeros pick by the heuristic.
//   offset_warp (version 2 only; bench/NOTES.md, W4A8 v5): the same kernel with the codes' offset
//              term summed per stage by a producer-side warp (W4A8Traits::kOffsetWarp) instead of
//              by the consumers (a constant-operand wgmma per K step for tiles of <= 32 rows, or
//              m64n8k32 and a named barrier per K block for 64 and 128);
//   stage_k_blocks (version 2): K blocks per pipeline stage, 1 (0), 2 or 3 (3 without the offset
//              warp): one barrier round trip per 128 x stage_k_blocks K. Pinned only: since the
//              consumers' K-block stream runs across tiles (v6), 2 is 0-1% slower than 1 on the
//              16-row decode tiles and 1-17% on the 32-row ones, 3 2-13% (NOTES, W4A8 v6); the
//              offset warp with 2 also: racecheck reports its hand-off (NOTES, W4A8 v5).
//   parts = 2 (version 2, no offset warp): the 32-row four-consumer tile (masked expected_m in
//              13..24) keeps two partial accumulators in flight instead of one. The automatic choice
//              since session 19 (2-3% faster on the 128 x 16 decode rows; in W4A8 v6 it was 1-6% slower).
//   signed_codes = 1 (version 3): the converter writes the weights' signed e4m3 values (11 integer
//              instructions per 8 weights instead of 3) and the consumers drop the codes' offset term;
//              128 x 256 tiles then run with two 128-column waves per consumer (waves = 2).
//              (version 2, block_m 128 or 256, 0: as the automatic choice; no offset warp, row sums,
//              second partial or K blocks per stage): the consumers convert the signed values in
//              registers; block_m = 256 is v2's wide tile (contiguous only): each consumer's converted
//              64 weight rows of a K block feed two 128-row waves of activations. The automatic
//              choice for the contiguous layout since session 25: the wide tile for groups of >= 128
//              rows on average (padding included; >= 1024 before session 26), else 128 x 128; the
//              wide tile's kernel with or without its half-tile loop by half_tiles below.
//   row_sums = 1 (version 2, no offset warp): on the masked decode tiles (block_m <= 32) of a call with
//              options.workspace, a pre-pass kernel sums each activation row per K block and the GEMM's
//              producer copies the sums in with each stage (W4A8Traits::kOffsetSums); without a
//              workspace, or on other tiles, the constant-operand wgmma as before.
//
// Calls with options.block_m or options.consumers set always run version 2 (those are its tiles),
// with offset_warp and stage_k_blocks as pinned when the pinned version is 2.
// Weights with W4A8Codes::sign_magnitude (session 28) run version 2 without an offset term on every
// tile (W4A8Traits::kSignMag): automatically v2's signed tiles where the offset-binary weights take
// them (contiguous; masked groups of > 64 rows), else the decode tile of w4a8_gemm_tile(); a pinned
// choice may only be version 2 without the offset warp, row sums or K blocks per stage.
#pragma once

#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "epmoe/cuda/grouped_gemm.hpp"

namespace epmoe::cuda {

struct W4A8KernelChoice {
  int version = 0;         // 0: the heuristic; 2 or 3
  int block_m = 0;         // version 3: 64, 128 or 256 (the tall tile; 0: heuristic); version 2 with
                           // signed_codes: 128 or 256 (the wide tile)
  int block_n = 0;         // 128 or 256
  int waves = 0;           // waves per consumer: 1, or 2 (signed_codes only: 128 x 256's two 128-column
                           // waves, or the tall tile's two 64-row waves)
  int ablation = 0;        // timing experiments only (garbage output): bits 1 no conversion, 2 no proxy
                           // fence (v3), 4 no wgmma / promotion (v3), 8 no weight loads; 16 (v2; the
                           // output is right): per-CTA stamps (w4a8_take_cta_trace)
  int offset_warp = 0;     // version 2 only: 1 = the offset term from the producer-side offset warp
  int stage_k_blocks = 0;  // version 2: K blocks per stage, 0 or 1 (one), 2, 3 (not with offset_warp)
  int parts = 0;           // version 2 without offset_warp: 2 = two partials on the 32-row 4-consumer tile
  int row_sums = 0;        // version 2 without offset_warp: 1 = the offset term from the row-sum pre-pass
                           // (masked decode tiles, block_m <= 32, when the call has a workspace)
  int signed_codes = 0;    // version 3: 1 = the converter writes e4m3(v · 2^-9), no offset term
                           // (W4A8SmemTraits::kSigned); the only way to 128 x 256 with two waves
  int half_tiles = 0;      // version 2, block_m 256 (the wide tile): 1 = the kernel with the half-tile
                           // loop (a group's odd last block runs wave 0 alone, on CTAs of their own where
                           // they fill >= 4 CTAs; session 26); 2 = the kernel without it (every tile
                           // costs a whole pair); 0 = by the rows per group (kW4A8WideNoHalfRows)
};

// The wide tile's automatic half_tiles: the kernel without the half-tile loop from this many rows per
// group on average (contiguous expected_m; bench/NOTES.md, session 27).
inline constexpr std::int64_t kW4A8WideNoHalfRows = 2048;

// The choice of an automatic call (masked: by expected_m; contiguous: by the average rows per group,
// M / groups, padding included; n, k: the weight matrix), resolved
// (version 3 with its tile, or version 2, whose tile w4a8_gemm_tile() picks).
W4A8KernelChoice w4a8_kernel_choice(bool masked, std::int64_t expected_m, std::int64_t n, std::int64_t k);

// A version-3 choice with its zeros filled by v3's own tile heuristic (64 x 256 for masked
// expected_m <= 64, else 128 x 128, or 128 x 256 with two waves with signed_codes; 128 columns when
// N is not a multiple of 256).
W4A8KernelChoice w4a8_resolve_v3(const W4A8KernelChoice& choice, bool masked, std::int64_t expected_m,
                                 std::int64_t n);

// Ablation bit 16 and the CTAs it stamps (the first 1024).
inline constexpr int kW4A8TraceCtas = 16;
inline constexpr int kW4A8TraceMaxCtas = kGemmTraceMaxCtas;

// The per-CTA %globaltimer stamps (ns) of the launches since the last take that ran with ablation bit
// 16 (version 2 only): entry, the producer's last copy issued, every stage released after it (0: the
// CTA did not run). Reads the first `ctas` CTAs' stamps and clears them.
using W4A8CtaStamps = GemmCtaStamps;
std::vector<W4A8CtaStamps> w4a8_take_cta_trace(int ctas, cudaStream_t stream);

// Pins the kernel of later automatic calls in this process (version 0 unpins). Not thread-safe:
// for the bench and the tests.
void w4a8_pin_kernel(const W4A8KernelChoice& choice);

}  // namespace epmoe::cuda
