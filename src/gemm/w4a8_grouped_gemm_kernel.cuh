// W4A8 grouped GEMM for Hopper (device code; host launcher and weight preparation in
// w4a8_grouped_gemm.cu, the preparation's kernels in w4a8_prepare_kernels.cuh, API in
// epmoe/cuda/w4a8_gemm.hpp, packed layout in w4a8_layout.hpp).
//
//   D[m, n] = a_scale · Σ_kb s[g(m), n, kb] · Σ_{k in kb} A[m, k] · Q[g(m), n, k]
//
// Computed transposed, D^T = Q · A^T: wgmma takes only its A operand from registers, so the int4
// weights (the big operand in decode) are the A operand, converted to e4m3 in registers, and the
// activation tile (kBM rows x 128 K, e4m3, TMA-loaded with the 128-byte swizzle) is the B operand
// with wgmma N = kBM (16 .. 128). The codes are offset binary (c = v + 8, w4a8_layout.hpp), whose
// e4m3 bytes are just the masked nibbles (c · 2^-9). The offset term -8 · 2^-9 Σ_k A[m, k]: decode
// tiles (kBM <= 32) issue per K step one more wgmma, a constant A tile of -8 · 2^-9 from shared
// memory, into the same partial, which then holds 2^-9 Σ A · v; larger tiles compute it per
// activation row with m64n8k32 and add it in the promotion (W4A8Traits::kRowOffset); the v5
// variant (kOffsetWarp, any tile) has an otherwise idle producer warp sum the activation rows per
// stage and the consumers add those sums in the promotion, so they issue only the weights' wgmma;
// kOffsetSums (decode tiles) adds sums that a pre-pass kernel computed once per row and K block. (The
// conversion was the bottleneck of decode with the prmt table codes: 9 integer instructions per 8
// weights against 3 now; the extra wgmma per step costs the tensor core ~13 cycles per SM at
// m64n16k32, bench/NOTES.md.) The per-(row, K block) weight scale then scales accumulator rows:
// each K block's partial is folded into the total in f32 (acc += s[n, kb] · part), and
// a_scale · 2^9 is applied at the end.
//
// One persistent CTA per SM, warp-specialised, tiles of kBM activation rows x 64 kConsumers weight
// rows, 128 K per pipeline stage:
//   - warp 0 (the producer) walks the tile schedule and, per K block, waits for a free stage and
//     fills it: the activation tile (TMA, 2D map over A), and the tile's packed weight panels (4096
//     bytes each) and their 64 scales each (one bulk copy each: the panels of a tile are
//     contiguous per K block), all completing on the stage's "full" mbarrier;
//   - kOffsetWarp: warp 1 waits for the same "full" barrier, writes the stage's kBM activation-row
//     offsets into the stage's slot and arrives on the stage's "offset" mbarrier;
//   - kOffsetSums: warp 1 bulk-copies the tile's kBM precomputed row sums of each K block (the
//     pre-pass, w4a8_row_sums_kernel.cuh) into the stage's slot, as the full barrier's second arrival;
//   - consumer warpgroup c (64 weight rows): per K block, two 16-byte shared loads give each thread
//     its 64 int4 codes, masks turn them into 16 registers of e4m3, four wgmma m64nNk32 with the
//     codes (A from registers) and the offset wgmma accumulate the partial product, the stage is
//     given back (one arrive per warp on "empty") and the partial folded into the total with the
//     two scales of the thread's rows. The
//     epilogue swaps values between neighbouring lanes so that each lane stores two consecutive
//     columns of one output row (4-byte bf16x2 stores), valid rows only.
//
// Layouts. Contiguous: A [M, K], m_indices [M]; every 128-row block (from row 0) holds rows of at
// most one group (its group is the max of its m_indices; all -1: the block is skipped); a row is
// written only when m_indices[row] equals that group. Masked: A [G * M_max, K] viewed flat; group
// g's valid rows are [0, min(masked_m[g], M_max)), read on the device; only their kBM-row blocks
// are scheduled.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cuda.h>
#include <cuda_bf16.h>

#include "cuda/ptx_hopper.cuh"
#include "gemm/gemm_common.cuh"
#include "gemm/w4a8_kernel_choice.hpp"
#include "gemm/w4a8_layout.hpp"

namespace epmoe::kernels {

inline constexpr int kW4SmemBudget = 232448;  // dynamic shared memory a block may have on sm_90
// The wide tile's pair table (w4a8_build_pair_table): up to 4095 128-row blocks (M <= 524160 rows;
// longer calls pair the blocks from block 0).
inline constexpr int kW4PairTableMaxBlocks = 4095;
inline constexpr int kW4PairTableBytes = 4 * (1 + kW4PairTableMaxBlocks);

// Where the codes' offset term comes from (W4A8Traits below).
inline constexpr int kW4OffsetWgmma = 0;    // the consumers' wgmma (constant-operand SS, or kRowOffset)
inline constexpr int kW4OffsetWarp = 1;     // v5: a producer-side warp sums the stage's rows
inline constexpr int kW4OffsetSums = 2;     // the rows' sums from a pre-pass, copied in with the stage
inline constexpr int kW4OffsetNone = 3;     // signed codes (w4a8::signed_codes_lo / _hi): no offset term
inline constexpr int kW4OffsetSignMag = 4;  // sign-magnitude codes (w4a8::sm_codes_lo / _hi): none either

template <int kBM, int kConsumers, int kOffset_ = kW4OffsetWgmma, int kStageKB_ = 1>
struct W4A8Traits {
  static_assert(kBM == 16 || kBM == 32 || kBM == 64 || kBM == 128 || kBM == 256);
  static_assert(kConsumers == 2 || (kConsumers == 4 && kBM <= 32));
  // kBM = 256 (the wide tile, signed codes, contiguous only): each consumer converts its 64 weight
  // rows of a K block once and issues them against two 128-row waves of activations (two m64n128k32
  // groups into one partial, folded in turn), so the conversion per flop is half the 128-row tile's.
  static_assert(kBM != 256 || ((kOffset_ == kW4OffsetNone || kOffset_ == kW4OffsetSignMag) &&
                               kConsumers == 2 && kStageKB_ == 1));
  static constexpr int kWaves = kBM == 256 ? 2 : 1;
  static constexpr int kWaveN = kBM / kWaves;  // wgmma N: activation rows per wave
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kTileN = w4a8::kPanelRows * kConsumers;  // weight rows per tile
  // K blocks per pipeline stage: 1, 2 or 3 (one barrier round trip per kStageKB x 128 K: the
  // consumers' full-barrier waits, __syncwarp and releases and the producer's barrier work per K
  // block divided by kStageKB; the copies of a stage's K blocks go into [kStageKB][...] arrays, the
  // offset warp's sums into kStageKB slots). The byte counts below are per K block.
  static constexpr int kStageKB = kStageKB_;
  static_assert(kStageKB >= 1 && kStageKB <= 3);
  static constexpr int kABytes = kBM * w4a8::kBlockK;  // a multiple of 1024 (swizzle atoms)
  static constexpr int kWBytes = kConsumers * w4a8::kPanelBytes;
  static constexpr int kSBytes = kConsumers * w4a8::kPanelScaleBytes;
  static constexpr int kBlockBytes = kABytes + kWBytes + kSBytes;
  static constexpr int kStageBytes = kStageKB * kBlockBytes;
  // The codes' offset term (w4a8_layout.hpp), -2^-6 Σ_k A[m, k] for every activation row m.
  // Decode tiles (kBM <= 32): one more wgmma per K step with a constant A tile in shared memory,
  // 64 rows x 128 bytes of e4m3(-8 · 2^-9) (the steps' 32-byte slices are all alike): as many
  // wgmma as the weights, cheap at N <= 32. Larger tiles (kRowOffset): that would double the tensor
  // work, so each consumer gets the offsets of its activation rows from four m64n8k32 per 64 rows
  // (A = the activation tile, B = 8 constant rows: the first 1024 bytes of the same tile) and
  // passes them through shared memory to the threads whose columns they are (kBM floats per
  // consumer, double-buffered), one FADD per accumulator in the promotion.
  //
  // kOffsetWarp (v5, any tile): neither; warp 1 of the producer warpgroup, idle otherwise, sums each
  // activation row of every stage with mma.sync (w4a8::offset_warp_load) into a per-stage slot of
  // kBM floats and arrives on the stage's "offset" mbarrier; the consumers issue only the weights'
  // four wgmma per stage and add the slot in the promotion (one FADD per accumulator), waiting on
  // that barrier only there, after their wgmma, so the sums are off their issue path.
  //
  // kOffsetSums (decode tiles, kBM <= 32): the same fold as the offset warp's, but the slot's kBM
  // floats are precomputed for every (row, K block) by a small kernel before the GEMM
  // (w4a8_row_sums_kernel) and bulk-copied by producer warp 1 into the stage's slot as the "full"
  // barrier's second arrival: no offset wgmma (on the 32-row tile it read 3 KB of shared memory per
  // consumer and k32 step, the tile's bottleneck under ncu), and no hand-off to the consumers beyond
  // the full barrier they wait on anyway.
  //
  // kOffsetNone: signed codes, converted to e4m3(v · 2^-9) themselves (11 integer instructions per
  // packed word instead of 3), so there is no offset term at all.
  //
  // kOffsetSignMag: the weights prepared with W4A8Codes::sign_magnitude (values in [-7, 7]): their
  // e4m3 bytes are (sign << 7) | |v| (w4a8::sm_codes_lo / _hi: two LOP3 and a funnel shift per packed
  // word, as the offset-binary codes), so there is no offset term either; everything else as
  // kOffsetNone (session 28).
  static constexpr int kOffset = kOffset_;
  static_assert(kOffset >= kW4OffsetWgmma && kOffset <= kW4OffsetSignMag);
  static_assert(kOffset != kW4OffsetSums || kBM <= 32);
  static constexpr bool kOffsetWarp = kOffset == kW4OffsetWarp;
  static constexpr bool kOffsetSums = kOffset == kW4OffsetSums;
  static constexpr bool kSignMag = kOffset == kW4OffsetSignMag;
  // (kSigned: no offset term, whichever the codes: kOffsetNone's signed or kOffsetSignMag's.)
  static constexpr bool kSigned = kOffset == kW4OffsetNone || kSignMag;
  static constexpr bool kSlot = kOffsetWarp || kOffsetSums;  // the consumers add a per-stage slot
  static constexpr bool kRowOffset = kBM >= 64 && !kSlot && !kSigned;
  static constexpr bool kOffsetSS = kBM <= 32 && !kSlot && !kSigned;  // the constant-A wgmma per K step
  static constexpr int kOffsetBytes = kSlot || kSigned ? 0
                                      : kRowOffset     ? 1024
                                                       : w4a8::kPanelRows * w4a8::kBlockK;
  static constexpr int kRowOffsetBytes = kRowOffset ? kConsumers * 2 * kBM * 4 : 0;
  static constexpr int kSlotBytes = kSlot ? kBM * 4 : 0;  // per K block
  // The 16-row masked decode tiles on the sign-magnitude codes may claim their tiles dynamically
  // (W4A8Params::tile_counter): the producer passes each tile's index to the consumers in a per-stage
  // word beside the barriers (written before the tile's first stage is armed; -1 after the last tile,
  // on a stage armed without bytes). Measured (session 29, call 3): -2.0% / -3.5% on the 128 x 8 decode
  // rows with these codes, but +0.7% / +2.4% on the offset-binary tile (its extra constant-operand
  // wgmma per K step), which keeps the static schedule. (With four consumers the producer needs 40
  // registers, which leaves the consumers 104: the 32-row tile's two-partial variants spilled 176
  // bytes at 104; the two-consumer tile with three K blocks per stage spilled 8 bytes in the producer.)
  static constexpr bool kDynamicTiles = kBM == 16 && kSignMag && kStageKB == 1;
  // Per stage: full, empty (, offset) barriers (, the tile word, padded to 8).
  static constexpr int kBarBytes = (kOffsetWarp ? 3 * 8 : 2 * 8) + (kDynamicTiles ? 8 : 0);
  // The wide tile's pair table (w4a8_build_pair_table), after the barriers.
  static constexpr int kPairTableBytes = kBM == 256 ? kW4PairTableBytes : 0;
  static constexpr int kStages =
      std::min(16, (kW4SmemBudget - 1024 - kOffsetBytes - kRowOffsetBytes - kPairTableBytes) /
                       (kStageBytes + kStageKB * kSlotBytes + kBarBytes));
  static constexpr int kSmemBytes = 1024 + kOffsetBytes + kRowOffsetBytes +
                                    kStages * (kStageBytes + kStageKB * kSlotBytes + kBarBytes) +
                                    kPairTableBytes;
  static constexpr int kAcc = kBM / 2;  // f32 accumulator registers per thread (m64 x kBM)
  // setmaxnreg: the registers given up by the producer warpgroup go to the consumers (the totals
  // equal the launch allocation: 384 x 168 and 640 x 96). With the offset warp and two consumers,
  // 56 / 224 (ptxas: 40 / 232 spilled 8 bytes on the 128-row tile; the consumers no longer hold
  // the m64n8 offsets). Four consumers with the offset warp: 40 / 104 (32 / 112 spilled 4 bytes in
  // the offset warp once all its lanes arrive on the offset barrier).
  // The wide tile (acc 128 + one partial 64 + a K block's fragments 16 and the next block's codes 8)
  // fits 232 too.
  static constexpr int kProducerRegs =
      kConsumers == 2 ? (kOffsetWarp ? 56 : 40) : (kOffsetWarp || kDynamicTiles ? 40 : 32);
  static constexpr int kConsumerRegs =
      kConsumers == 2 ? (kOffsetWarp ? 224 : 232) : (kOffsetWarp || kDynamicTiles ? 104 : 112);
  // (setmaxnreg can only hand out what the launch allocated: __launch_bounds__(kThreads, 1) gives
  // each thread 65536 / kThreads registers rounded down to 8.)
  static_assert(128 * (kProducerRegs + kConsumers * kConsumerRegs) <= 65536 / kThreads / 8 * 8 * kThreads);
};

struct W4A8Params {
  const std::uint8_t* w;     // packed weights [G][N/256][K/128][4][4096] (w4a8_layout.hpp)
  const __nv_bfloat16* ws;   // packed scales [G][N/256][K/128][4][64] (bf16, w4a8_layout.hpp)
  const float* a_scale_ptr;  // f32 [1] on the device, or nullptr: a_scale
  float a_scale;
  const std::int32_t* m_indices;  // contiguous layout: [M]; masked: nullptr
  const std::int32_t* masked_m;   // masked layout: [G]; contiguous: nullptr
  __nv_bfloat16* d;               // [rows_total, N]
  std::int32_t rows;              // contiguous: M; masked: M_max
  std::int32_t n, k, groups;
  std::int32_t total_tiles;   // contiguous: ceil(M / kBM) * N / kTileN; masked: unused
  std::int32_t stages;        // pipeline stages in use (v3: conversion stages)
  std::int32_t a_small_rows;  // v3, masked: tiles with at most this many valid rows load only these
  std::int32_t ablation;      // kW4Ablate* bits (timing experiments), else 0
  // kOffsetSums, masked layout: -2^-6 Σ_{k in kb} A[g, r, k] at row_sums[(g * K/128 + kb) * sums_rows + r]
  // for r < round_up(min(masked_m[g], M_max), 32) (w4a8_row_sums_kernel); sums_rows a multiple of 32.
  const float* row_sums;
  std::int32_t sums_rows;
  // Masked decode tiles (W4A8Traits::kDynamicTiles), or nullptr: the static schedule. The tiles are
  // claimed from this word (in the call's workspace): bits 63..32 the launch's tag, bits 31..0 the
  // claims so far (w4a8_await_tile_counter, w4a8_claim_tile); the launch's last claim leaves (tag, 0)
  // behind for a graph replay of the same launch.
  unsigned long long* tile_counter;
  std::uint32_t tile_tag;
};

// Ablations (W4A8Params::ablation, bits; timing experiments only, the output is garbage). v3: the
// converter skips the conversion (arrives only), or the proxy fence; the consumers skip the wgmma
// and the promotion; the producer arms the raw stages without loading the weights. v2: the
// producer loads only the activations (no math ablation: a branch around the wgmma makes ptxas
// serialise them in every run; the no-conversion ablation of run 1, raw words as the A fragment,
// was taken out again: its branch cost the decode consumers registers).
inline constexpr int kW4AblateConvert = 1;
inline constexpr int kW4AblateFence = 2;
inline constexpr int kW4AblateMath = 4;
inline constexpr int kW4AblateLoads = 8;
// Not an ablation (the output is right): v2's producer warp stamps %globaltimer per CTA into
// g_w4a8_cta_trace: [0] at entry, [1] when its last copy is issued, [2] when the consumers have released
// every stage after it (their last K block read; the last tile's epilogue follows). Producer-side
// only: stamps in the consumers spilled their registers (session 21).
inline constexpr int kW4TraceCtas = cuda::kW4A8TraceCtas;
inline constexpr int kW4TraceMaxCtas = cuda::kW4A8TraceMaxCtas;
__device__ unsigned long long g_w4a8_cta_trace[3 * kW4TraceMaxCtas];

struct W4A8Tile {
  std::int32_t group;
  std::int32_t n_tile;   // weight rows [kTileN n_tile, kTileN (n_tile + 1))
  std::int32_t row0;     // first activation row of the tile in A's (flattened) rows
  std::int32_t row_end;  // rows >= row_end are never valid
};

// The group of the kRows-row block at row0 (contiguous layout): the largest id of its rows (-1:
// padding only). Warp-collective.
template <int kRows>
__device__ __forceinline__ std::int32_t w4a8_block_group(const W4A8Params& p, std::int32_t row0) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  std::int32_t g = -1;
#pragma unroll
  for (int i = 0; i * 32 < kRows; ++i) {
    const std::int32_t row = row0 + i * 32 + lane;
    if (i * 32 + lane < kRows && row < p.rows) g = max(g, __ldg(p.m_indices + row));
  }
  return __reduce_max_sync(0xffffffffu, g);
}

// The pairs of 128-row blocks that 256-row contiguous tiles cover, aligned to each group's first
// block (a CTA-local table in shared memory, built by every CTA before its warps take their roles):
// word 0 the count of whole pairs (bits 0-15) and of half tiles (bits 16-30), bit 31 set when half
// tiles get CTAs of their own (w4a8::half_tile_ctas; all ones: no table, the scheduler pairs blocks 2u
// and 2u + 1 instead), then one word per tile: its first block (bits 0-15), its group (bits 16-30),
// bit 31 set when the tile is that block alone (the group's last block, with an odd block count).
// The tiles fill words 1, 2, ... in block order, or with the split whole pairs words 1, 2, ... and
// half tiles words kW4PairTableMaxBlocks, kW4PairTableMaxBlocks - 1, .... With groups of ~1024
// rows, pairing from block 0 splits about one pair in eight between two groups, each half then a
// full-cost tile.

// Builds the table at `table` (all threads of the CTA; `scratch`: 4 bytes per block of shared memory
// not in use yet; allow_split false: never split, block order). Ends with __syncthreads().
__device__ inline void w4a8_build_pair_table(const W4A8Params& p, std::uint32_t table, std::uint32_t scratch,
                                             bool allow_split) {
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int warps = static_cast<int>(blockDim.x / 32);
  const std::int32_t blocks = (p.rows + 127) / 128;
  if (blocks > kW4PairTableMaxBlocks || p.groups > 32767) {
    if (threadIdx.x == 0) ptx::st_shared_u32(table, 0xffffffffu);
    __syncthreads();
    return;
  }
  // Each block's group (-1: padding only, or out of range) from its first row; a block whose first
  // row is padding (holes, all-padding blocks) takes the largest id of its rows.
  for (std::int32_t b0 = warp * 32; b0 < blocks; b0 += warps * 32) {
    const std::int32_t b = b0 + lane;
    std::int32_t g = b < blocks ? __ldg(p.m_indices + 128 * b) : 0;
    for (unsigned need = __ballot_sync(0xffffffffu, g < 0); need != 0; need &= need - 1) {
      const std::int32_t gb = w4a8_block_group<128>(p, 128 * (b0 + __ffs(need) - 1));
      if (lane == __ffs(need) - 1) g = gb;
    }
    if (b < blocks) ptx::st_shared_u32(scratch + 4 * b, static_cast<std::uint32_t>(g < p.groups ? g : -1));
  }
  __syncthreads();
  if (warp == 0) {
    // Runs of equal groups; a pair starts at each run's first block and every second block after it.
    // Two walks: the first counts the pairs and half tiles, the second writes the table, in block
    // order, or (where half tiles get CTAs of their own) pairs from the front, half tiles from the back.
    std::int32_t pairs = 0, halves = 0;
    bool split = false;
    for (int walk = 0; walk < 2; ++walk) {
      if (walk == 1) {
        split = allow_split && w4a8::half_tile_ctas(pairs, halves, static_cast<std::int32_t>(gridDim.x)) > 0;
        pairs = halves = 0;
      }
      std::int32_t carry_start = 0, carry_group = -2;
      for (std::int32_t b0 = 0; b0 < blocks; b0 += 32) {
        const std::int32_t b = b0 + lane;
        const std::int32_t g = b < blocks ? ptx::ld_shared_s32(scratch + 4 * b) : -1;
        std::int32_t before = __shfl_up_sync(0xffffffffu, g, 1);
        if (lane == 0) before = carry_group;
        std::int32_t after = __shfl_down_sync(0xffffffffu, g, 1);
        if (lane == 31) after = b + 1 < blocks ? ptx::ld_shared_s32(scratch + 4 * (b + 1)) : -1;
        // This block's run start: the largest run start at or before it (an inclusive max-scan).
        std::int32_t start = g != before ? b : carry_start;
#pragma unroll
        for (int o = 1; o < 32; o *= 2) {
          const std::int32_t v = __shfl_up_sync(0xffffffffu, start, o);
          if (lane >= o) start = max(start, v);
        }
        const bool first = b < blocks && g >= 0 && ((b - start) & 1) == 0;
        const bool alone = after != g;
        const unsigned firsts = __ballot_sync(0xffffffffu, first && !alone);
        const unsigned lone = __ballot_sync(0xffffffffu, first && alone);
        const unsigned below = (1u << lane) - 1u;
        if (walk == 1 && first) {
          const std::int32_t at = !split  ? pairs + halves + __popc((firsts | lone) & below)
                                  : alone ? kW4PairTableMaxBlocks - 1 - (halves + __popc(lone & below))
                                          : pairs + __popc(firsts & below);
          ptx::st_shared_u32(table + 4 * (1 + at), static_cast<std::uint32_t>(b) |
                                                       (static_cast<std::uint32_t>(g) << 16) |
                                                       (alone ? 0x80000000u : 0u));
        }
        pairs += __popc(firsts);
        halves += __popc(lone);
        carry_start = __shfl_sync(0xffffffffu, start, 31);
        carry_group = __shfl_sync(0xffffffffu, g, 31);
      }
    }
    if (lane == 0)
      ptx::st_shared_u32(table,
                         static_cast<std::uint32_t>(pairs | (halves << 16)) | (split ? 0x80000000u : 0u));
  }
  __syncthreads();
}

// The dynamic schedule's counter (W4A8Params::tile_counter; one thread per CTA). Tiles go to whichever
// CTA asks next, so CTAs that stream faster take more (the static schedule's last CTA drained ~8 µs
// after the median on the decode rows, session 21). Before its first claim a CTA waits until the word
// carries this launch's tag: CTA 0 puts (tag, 0) there if it holds another tag (an earlier launch, or
// memory never used), and no other CTA writes the word before it sees the tag, so that exchange is
// never raced. A graph replay finds (tag, 0) already, left by the launch's last claim. Then each
// claim is one atomicAdd (a compare-and-swap loop instead cost ~13-25 µs per round of 128 CTAs
// claiming together, session 29: 248 -> 940 µs on the 128 x 8, 7168 x 2048 row).
__device__ __forceinline__ void w4a8_await_tile_counter(unsigned long long* word, std::uint32_t tag) {
  const auto tag_of = [](unsigned long long v) { return static_cast<std::uint32_t>(v >> 32); };
  auto* volatile_word = reinterpret_cast<volatile unsigned long long*>(word);
  unsigned long long seen = *volatile_word;
  if (blockIdx.x == 0) {
    while (tag_of(seen) != tag) {
      const unsigned long long before = atomicCAS(word, seen, static_cast<unsigned long long>(tag) << 32);
      if (before == seen) break;
      seen = before;
    }
    return;
  }
  const std::uint64_t start = ptx::global_timer_ns();
  for (std::uint32_t i = 1; tag_of(seen) != tag; ++i) {
    if ((i & 1023u) == 0 && ptx::global_timer_ns() - start > ptx::kMbarWatchdogNs) __trap();
    seen = *volatile_word;
  }
}
// The next tile index of this launch (from 0; at least the number of tiles once they are all taken).
__device__ __forceinline__ std::int32_t w4a8_claim_tile(unsigned long long* word) {
  return static_cast<std::int32_t>(atomicAdd(word, 1ull) & 0xffffffffull);
}

// The static persistent schedule (tile t goes to CTA t mod gridDim.x). next() is warp-collective
// for the contiguous layout (a block's m_indices are reduced over the warp).
template <int kBM, int kTileN>
class W4A8Scheduler {
 public:
  // pair_table: 256-row tiles' w4a8_build_pair_table result (0: none, pairs from block 0).
  __device__ explicit W4A8Scheduler(const W4A8Params& p, std::uint32_t pair_table = 0)
      : t_(static_cast<std::int32_t>(blockIdx.x)), pair_table_(pair_table) {
    if (p.masked_m != nullptr) load_segment(p);
    if constexpr (kBM == 256) {
      if (pair_table != 0) split_halves();
    }
  }

  // Whether this CTA runs the table's half tiles (wave 0 only) rather than its whole pairs.
  __device__ bool half_tiles() const { return split_.half; }

  __device__ bool next(W4A8Tile& tile, const W4A8Params& p) {
    // (256-row tiles are contiguous only: the host refuses them for the masked layout.)
    if constexpr (kBM == 256) return next_contiguous_pairs(tile, p);
    return p.masked_m != nullptr ? next_masked(tile, p) : next_contiguous(tile, p);
  }

 private:
  // Contiguous, 256-row tiles (v2's wide tile, v3's tall tile). With a pair table (the wide tile): unit
  // t is the table's pair t / n_tiles. Without one: unit t is the pair of 128-row blocks 2u, 2u + 1; a
  // pair whose two blocks belong to one group is one tile; otherwise each block with a group is a tile
  // of its own (row_end - row0 <= 128: half tiles, whose second 128 rows nobody stores), the second one
  // on the next call. (Groups are padded to 128 rows, so a block never holds two groups' rows; without
  // the table a group starting at an odd block costs two half tiles instead of one.)
  __device__ bool next_contiguous_pairs(W4A8Tile& tile, const W4A8Params& p) {
    const std::int32_t n_tiles = p.n / kTileN;
    const auto counts = pair_table_ != 0 ? static_cast<std::uint32_t>(ptx::ld_shared_s32(pair_table_)) : ~0u;
    if (counts != ~0u) {
      // (Split: whole pairs from the front or half tiles from the back; else every tile in block order.)
      const auto pairs = static_cast<std::int32_t>(counts & 0xffffu);
      const auto halves = static_cast<std::int32_t>((counts >> 16) & 0x7fffu);
      const std::int32_t tiles = split_.all ? pairs + halves : split_.half ? halves : pairs;
      if (t_ >= tiles * n_tiles) return false;
      const std::int32_t t = t_;
      t_ += split_.stride;
      const std::int32_t u = t / n_tiles;
      const auto e = static_cast<std::uint32_t>(
          ptx::ld_shared_s32(pair_table_ + 4 * (1 + (split_.half ? kW4PairTableMaxBlocks - 1 - u : u))));
      const std::int32_t row0 = 128 * static_cast<std::int32_t>(e & 0xffffu);
      tile = W4A8Tile{static_cast<std::int32_t>((e >> 16) & 0x7fffu), t - u * n_tiles, row0,
                      (e >> 31) != 0 ? min(row0 + 128, p.rows) : p.rows};
      return true;
    }
    for (;;) {
      const bool second = second_pending_;
      if (!second && t_ >= p.total_tiles) return false;
      const std::int32_t t = second ? t_ - static_cast<std::int32_t>(gridDim.x) : t_;
      if (second) {
        second_pending_ = false;
      } else {
        t_ += static_cast<std::int32_t>(gridDim.x);
      }
      const std::int32_t m_pair = t / n_tiles;
      const std::int32_t n_tile = t - m_pair * n_tiles;
      const std::int32_t row0 = m_pair * 256, row1 = row0 + 128;
      const std::int32_t g0 = w4a8_block_group<128>(p, row0), g1 = w4a8_block_group<128>(p, row1);
      const bool ok0 = g0 >= 0 && g0 < p.groups, ok1 = g1 >= 0 && g1 < p.groups;
      if (!second && ok0 && g0 == g1) {
        tile = W4A8Tile{g0, n_tile, row0, p.rows};
        return true;
      }
      if (!second && ok0) {
        second_pending_ = ok1;
        tile = W4A8Tile{g0, n_tile, row0, min(row1, p.rows)};
        return true;
      }
      if (ok1) {
        tile = W4A8Tile{g1, n_tile, row1, min(row1 + 128, p.rows)};
        return true;
      }
    }
  }

  // Contiguous: the weight tiles vary fastest, so the CTAs of one wave share a few activation blocks
  // and one group's weights.
  __device__ bool next_contiguous(W4A8Tile& tile, const W4A8Params& p) {
    const std::int32_t n_tiles = p.n / kTileN;
    while (t_ < p.total_tiles) {
      const std::int32_t t = t_;
      t_ += static_cast<std::int32_t>(gridDim.x);
      const std::int32_t m_block = t / n_tiles;
      const std::int32_t row0 = m_block * kBM;
      const std::int32_t g = w4a8_block_group<kBM>(p, row0);
      if (g < 0 || g >= p.groups) continue;  // padding only (or ids out of range): nothing to do
      tile = W4A8Tile{g, t - m_block * n_tiles, row0, p.rows};
      return true;
    }
    return false;
  }

  // Masked: only the valid m-blocks of each group are enumerated (group-major, then weight tile,
  // then m-block).
  __device__ bool next_masked(W4A8Tile& tile, const W4A8Params& p) {
    const std::int32_t t = t_;
    t_ += static_cast<std::int32_t>(gridDim.x);
    return masked_tile(tile, p, t);
  }

 public:
  // Masked: tile t of the enumeration (t never below the previous call's: the walk over the groups
  // only goes forward). False past the last tile; then walked_tiles() is the number of tiles.
  __device__ bool masked_tile(W4A8Tile& tile, const W4A8Params& p, std::int32_t t) {
    while (g_ < p.groups && t >= seg_start_ + seg_tiles_) {
      seg_start_ += seg_tiles_;
      ++g_;
      if (g_ < p.groups) load_segment(p);
    }
    if (g_ >= p.groups) return false;
    const std::int32_t r = t - seg_start_;
    const std::int32_t m_block = r % seg_m_blocks_;
    const std::int32_t seg_row0 = g_ * p.rows;
    tile = W4A8Tile{g_, r / seg_m_blocks_, seg_row0 + m_block * kBM, seg_row0 + seg_count_};
    return true;
  }
  __device__ std::int32_t walked_tiles() const { return seg_start_; }

 private:
  __device__ void load_segment(const W4A8Params& p) {
    seg_count_ = min(max(__ldg(p.masked_m + g_), 0), p.rows);
    seg_m_blocks_ = (seg_count_ + kBM - 1) / kBM;
    seg_tiles_ = seg_m_blocks_ * (p.n / kTileN);
  }

  // The CTA's role by w4a8::half_tile_ctas (the build's choice, bit 31 of the table's counts): the last
  // CTAs of the grid run the half tiles. The counts are the whole table's, so every CTA (and role)
  // computes the same split.
  __device__ void split_halves() {
    const auto counts = static_cast<std::uint32_t>(ptx::ld_shared_s32(pair_table_));
    const auto grid = static_cast<std::int32_t>(gridDim.x);
    if (counts == ~0u || (counts >> 31) == 0) {
      split_.all = true;
      return;
    }
    const std::int32_t half_ctas =
        w4a8::half_tile_ctas(static_cast<std::int32_t>(counts & 0xffffu),
                             static_cast<std::int32_t>((counts >> 16) & 0x7fffu), grid);
    split_.half = t_ >= grid - half_ctas;
    if (split_.half) t_ -= grid - half_ctas;
    split_.stride = split_.half ? half_ctas : grid - half_ctas;
  }

  std::int32_t t_;
  // (256-row tiles only: the other tiles' code is as before the split.)
  struct HalfSplit {
    // t_'s stride; whether this CTA runs the half tiles; whether it runs both kinds (no CTA has the
    // half tiles to itself).
    std::int32_t stride = static_cast<std::int32_t>(gridDim.x);
    bool half = false;
    bool all = false;
  };
  struct NoSplit {
    static constexpr bool half = false;
  };
  [[no_unique_address]] std::conditional_t<kBM == 256, HalfSplit, NoSplit> split_;
  std::uint32_t pair_table_;
  bool second_pending_ = false;  // (256-row contiguous tiles) the pair's second block is next
  std::int32_t g_ = 0, seg_start_ = 0, seg_tiles_ = 0, seg_count_ = 0, seg_m_blocks_ = 1;
};

// PipeState with the K block's place inside a stage of several.
struct W4A8Pipe : PipeState {
  int sub = 0;  // consumers: the K block's index in its stage (kStageKB > 1)
  // The next K block's position: the next stage after a stage's last block, else the next block of
  // the same stage.
  __device__ void next_block(bool last_in_stage, int stages) {
    if (last_in_stage) {
      sub = 0;
      advance(stages);
    } else {
      ++sub;
    }
  }
};

// One packed word -> two fragment registers (registers r, r + 1 of a step: its low and high
// nibbles), e4m3 bytes c · 2^-9 of the codes (w4a8_layout.hpp): three integer instructions.
// kSigned: the e4m3 bytes of v · 2^-9 themselves (about 11 integer instructions); with kSignMag from
// the sign-magnitude codes (three).
template <bool kSigned, bool kSignMag = false>
__device__ __forceinline__ void w4a8_convert8(std::uint32_t w, std::uint32_t& lo, std::uint32_t& hi) {
  if constexpr (kSignMag) {
    lo = w4a8::sm_codes_lo(w);
    hi = w4a8::sm_codes_hi(w);
  } else {
    lo = kSigned ? w4a8::signed_codes_lo(w) : w4a8::codes_lo(w);
    hi = kSigned ? w4a8::signed_codes_hi(w) : w4a8::codes_hi(w);
  }
}

// kParts_: 0 = the partial accumulators by the rule below; 2 = two also where the rule says one
// (the 32-row four-consumer tile: fits 112 registers without the offset warp since v6).
// kHalfLoop (the wide tile): half tiles may run on CTAs of their own (the second consumer loop); false:
// the kernel without that loop, every CTA runs every kind (W4A8KernelChoice::half_tiles = 2: the
// automatic choice for groups of >= kW4A8WideNoHalfRows rows).
template <int kBM, int kConsumers, int kOffset, int kStageKB, int kParts_ = 0, bool kHalfLoop = true>
__global__ void __launch_bounds__(W4A8Traits<kBM, kConsumers, kOffset, kStageKB>::kThreads, 1)
    w4a8_grouped_gemm_kernel(const __grid_constant__ CUtensorMap tma_a,
                             const __grid_constant__ W4A8Params p) {
  using Traits = W4A8Traits<kBM, kConsumers, kOffset, kStageKB>;
  // Per-stage strides of the [kStageKB][...] arrays.
  constexpr int kAStride = kStageKB * Traits::kABytes, kWStride = kStageKB * Traits::kWBytes;
  constexpr int kSStride = kStageKB * Traits::kSBytes, kSlotStride = kStageKB * Traits::kSlotBytes;
  constexpr int kStages = Traits::kStages;
  constexpr int kAcc = Traits::kAcc;
  constexpr int kWaves = Traits::kWaves;
  constexpr int kWaveAcc = kAcc / kWaves;  // one wave's accumulators (and the partial's)
  constexpr int kTileN = Traits::kTileN;

  extern __shared__ __align__(1024) std::uint8_t smem_raw[];
  const std::uint32_t smem_base = (ptx::smem_addr(smem_raw) + 1023u) & ~1023u;
  const std::uint32_t smem_offset = smem_base;                         // [64 or 8 or 0 x 128] of -2^-6
  const std::uint32_t smem_rows = smem_offset + Traits::kOffsetBytes;  // kRowOffset: [consumer][2][kBM] f32
  const std::uint32_t smem_a = smem_rows + Traits::kRowOffsetBytes;    // kStages x [kBM x 128]
  const std::uint32_t smem_w = smem_a + kStages * kAStride;     // kStages x kStageKB x kConsumers x 4096
  const std::uint32_t smem_s = smem_w + kStages * kWStride;     // kStages x kStageKB x kConsumers x 64 f32
  const std::uint32_t smem_slot = smem_s + kStages * kSStride;  // kSlot: kStages x kStageKB x kBM f32
  const std::uint32_t full_bar = smem_slot + kStages * kSlotStride;  // kStages x 8 bytes
  const std::uint32_t empty_bar = full_bar + kStages * 8;            // kStages x 8 bytes
  const std::uint32_t offset_bar = empty_bar + kStages * 8;          // kOffsetWarp: kStages x 8 bytes
  const std::uint32_t tile_ring = empty_bar + kStages * 8;           // kDynamicTiles: kStages x 8 bytes
  const std::uint32_t pair_table =
      full_bar + kStages * Traits::kBarBytes;  // kBM = 256: w4a8_build_pair_table

  const int warp = static_cast<int>(threadIdx.x / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int32_t num_kb = p.k / w4a8::kBlockK;
  const int stages = p.stages;

  if (threadIdx.x == 0) {
    if ((p.ablation & kW4TraceCtas) != 0 && blockIdx.x < kW4TraceMaxCtas)
      g_w4a8_cta_trace[3 * blockIdx.x] = ptx::global_timer_ns();
#pragma unroll 1
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(full_bar + 8 * s, Traits::kOffsetSums ? 2 : 1);  // the producers' arrives (+ bytes)
      ptx::mbar_init(empty_bar + 8 * s, kConsumers * 4 * ptx::kWarpArrivals);  // every consumer lane
      if constexpr (Traits::kOffsetWarp)
        ptx::mbar_init(offset_bar + 8 * s, ptx::kWarpArrivals);  // the offset warp
    }
    ptx::fence_barrier_init();
  }
  if (threadIdx.x == 32) ptx::prefetch_tensormap(&tma_a);
  for (int i = static_cast<int>(threadIdx.x); i < Traits::kOffsetBytes / 4; i += Traits::kThreads)
    ptx::st_shared_u32(smem_offset + 4 * i, w4a8::kOffsetE4m3x4);
  // (The wide tile's pair table, with the activation ring as its scratch: the fence below orders
  // those writes before the ring's first copies.)
  if constexpr (kBM == 256) w4a8_build_pair_table(p, pair_table, smem_a, kHalfLoop);
  ptx::fence_proxy_async_shared();  // generic-proxy writes, read by wgmma (the async proxy)
  __syncthreads();

  if (warp < 4) {
    // ------------------------------------------------------------ producer warpgroup (warp 0 works)
    ptx::setmaxnreg_dec<Traits::kProducerRegs>();
    if (warp == 0) {
      W4A8Scheduler<kBM, kTileN> scheduler(p, kBM == 256 ? pair_table : 0u);
      W4A8Tile tile;
      W4A8Pipe pipe;
      const std::int64_t n_panels = p.n / w4a8::kPanelRows;
      // kDynamicTiles with a counter: each tile claimed when its copies are about to start (about a
      // pipeline's depth before the consumers reach it); the claim that finds no tile left ends this
      // CTA, and the launch's last claim resets the word for a replay.
      [[maybe_unused]] const bool dynamic = Traits::kDynamicTiles && p.tile_counter != nullptr;
      [[maybe_unused]] std::int32_t claimed = 0;
      if constexpr (Traits::kDynamicTiles) {
        if (dynamic && lane == 0) w4a8_await_tile_counter(p.tile_counter, p.tile_tag);
      }
      const auto next_tile = [&](W4A8Tile& next) {
        if constexpr (Traits::kDynamicTiles) {
          if (dynamic) {
            std::int32_t c = 0;
            if (lane == 0) c = w4a8_claim_tile(p.tile_counter);
            claimed = __shfl_sync(0xffffffffu, c, 0);
            const bool found = scheduler.masked_tile(next, p, claimed);
            if (!found && lane == 0 &&
                claimed == scheduler.walked_tiles() + static_cast<std::int32_t>(gridDim.x) - 1)
              atomicExch(p.tile_counter, static_cast<unsigned long long>(p.tile_tag) << 32);
            return found;
          }
        }
        return scheduler.next(next, p);
      };
      while (next_tile(tile)) {
        // The tile's panels are consecutive inside one panel group: per K block one bulk copy of
        // their weights and one of their scales (w4a8_layout.hpp).
        const std::int64_t group_chunks = static_cast<std::int64_t>(tile.group) * n_panels * num_kb;
        const std::int64_t panel0 = static_cast<std::int64_t>(tile.n_tile) * kConsumers;
        for (std::int32_t kb = 0; kb < num_kb; kb += kStageKB) {
          if (lane == 0) {
            const std::uint32_t full = full_bar + 8 * pipe.stage;
            ptx::mbar_wait(empty_bar + 8 * pipe.stage, pipe.phase ^ 1u);
            if constexpr (Traits::kDynamicTiles) {
              // (Before the stage is armed: its arrival publishes the word to the consumers.)
              if (dynamic && kb == 0) ptx::st_shared_u32(tile_ring + 8 * pipe.stage, claimed);
            }
            const bool weights = (p.ablation & kW4AblateLoads) == 0;
            if constexpr (kStageKB == 1) {
              ptx::mbar_arrive_expect_tx(full, weights ? Traits::kStageBytes : Traits::kABytes);
              ptx::tma_load_2d(smem_a + pipe.stage * kAStride, &tma_a, full, kb * w4a8::kBlockK, tile.row0);
              const std::int64_t chunk = group_chunks + w4a8::panel_chunk(panel0, kb, num_kb, n_panels);
              if (weights) {
                ptx::bulk_load(smem_w + pipe.stage * kWStride, p.w + chunk * w4a8::kPanelBytes,
                               Traits::kWBytes, full);
                ptx::bulk_load(smem_s + pipe.stage * kSStride, p.ws + chunk * w4a8::kPanelRows,
                               Traits::kSBytes, full);
              }
            } else {
              // kStageKB K blocks (fewer at the end of a tile whose count is not a multiple). With
              // four consumers the tile is a whole panel group, whose K blocks are consecutive
              // chunks: one copy each for all the blocks' weights and scales; else one per block.
              const int blocks = min(kStageKB, num_kb - kb);
              ptx::mbar_arrive_expect_tx(full, blocks * (weights ? Traits::kBlockBytes : Traits::kABytes));
              const std::uint32_t a_dst = smem_a + pipe.stage * kAStride;
#pragma unroll
              for (int c = 0; c < kStageKB; ++c) {
                if (c < blocks)
                  ptx::tma_load_2d(a_dst + c * Traits::kABytes, &tma_a, full, (kb + c) * w4a8::kBlockK,
                                   tile.row0);
              }
              if (weights) {
                constexpr bool kOneCopy = kConsumers == w4a8::kGroupPanels;
#pragma unroll
                for (int c = 0; c < (kOneCopy ? 1 : kStageKB); ++c) {
                  if (c < blocks) {
                    const std::uint32_t n = kOneCopy ? blocks : 1;
                    const std::int64_t chunk =
                        group_chunks + w4a8::panel_chunk(panel0, kb + c, num_kb, n_panels);
                    ptx::bulk_load(smem_w + pipe.stage * kWStride + c * Traits::kWBytes,
                                   p.w + chunk * w4a8::kPanelBytes, n * Traits::kWBytes, full);
                    ptx::bulk_load(smem_s + pipe.stage * kSStride + c * Traits::kSBytes,
                                   p.ws + chunk * w4a8::kPanelRows, n * Traits::kSBytes, full);
                  }
                }
              }
            }
          }
          pipe.advance(stages);
        }
        __syncwarp();
      }
      if constexpr (Traits::kDynamicTiles) {
        // The end: a stage armed with no bytes whose word is -1 (the host leaves the CTA stamps, which
        // wait for every stage's release, to the static schedule).
        if (dynamic && lane == 0) {
          ptx::mbar_wait(empty_bar + 8 * pipe.stage, pipe.phase ^ 1u);
          ptx::st_shared_u32(tile_ring + 8 * pipe.stage, 0xffffffffu);
          ptx::mbar_arrive(full_bar + 8 * pipe.stage);
        }
      }
      if ((p.ablation & kW4TraceCtas) != 0 && lane == 0 && blockIdx.x < kW4TraceMaxCtas) {
        g_w4a8_cta_trace[3 * blockIdx.x + 1] = ptx::global_timer_ns();
#pragma unroll 1
        for (int s = 0; s < stages; ++s) {
          ptx::mbar_wait(empty_bar + 8 * pipe.stage, pipe.phase ^ 1u);
          pipe.advance(stages);
        }
        g_w4a8_cta_trace[3 * blockIdx.x + 2] = ptx::global_timer_ns();
      }
    }
    if constexpr (Traits::kOffsetSums) {
      if (warp == 1) {
        // ---------------------------------------------------------- the sums' copies
        // kOffsetSums: per K block the tile's kBM row sums (consecutive in row_sums) into the stage's
        // slot, on the stage's "full" barrier (its second arrival). A warp of its own: in warp 0's
        // loop the pointer arithmetic spilled the producer warpgroup's 32 registers.
        ptx::grid_dependency_wait();  // the pre-pass (a programmatic dependent launch)
        W4A8Scheduler<kBM, kTileN> scheduler(p);
        W4A8Tile tile;
        W4A8Pipe pipe;
        while (scheduler.next(tile, p)) {
          const float* sums = p.row_sums + w4a8::row_sums_index(tile.group, num_kb, 0, p.sums_rows,
                                                                tile.row0 - tile.group * p.rows);
          for (std::int32_t kb = 0; kb < num_kb; kb += kStageKB) {
            if (lane == 0) {
              const std::uint32_t full = full_bar + 8 * pipe.stage;
              const int blocks = min(kStageKB, num_kb - kb);
              ptx::mbar_wait(empty_bar + 8 * pipe.stage, pipe.phase ^ 1u);
              ptx::mbar_arrive_expect_tx(full, blocks * Traits::kSlotBytes);
              for (int c = 0; c < blocks; ++c)
                ptx::bulk_load(smem_slot + pipe.stage * kSlotStride + c * Traits::kSlotBytes,
                               sums + static_cast<std::int64_t>(kb + c) * p.sums_rows, Traits::kSlotBytes,
                               full);
            }
            pipe.advance(stages);
          }
          __syncwarp();
        }
      }
    }
    if constexpr (Traits::kOffsetWarp) {
      if (warp == 1) {
        // ---------------------------------------------------------- the offset warp
        // Per stage, once its activation tile has landed: -2^-6 Σ_k A[m, k] for the tile's kBM
        // rows (mma.sync m16n8k32 with the constant B; all 8 columns of D are alike, lanes q = 0
        // store column 0), into the stage's slot. The slot of a stage is rewritten only after its
        // "full" barrier completes again, i.e. after every consumer warp read it and released the
        // stage (they read it before their release); the consumers' wait on the offset barrier,
        // before their release, also orders this warp's reads of the tile before the next copy.
        const int g = lane / 4, q = lane % 4;
        const std::uint32_t b_const[2] = {w4a8::kOffsetE4m3x4, w4a8::kOffsetE4m3x4};
        // The stages this CTA will fill, counted up front: the scheduler's state is then dead during
        // the sums (with it live, the loop spilled at the producer warpgroup's 32 registers).
        std::int32_t stages_left = 0;
        {
          W4A8Scheduler<kBM, kTileN> scheduler(p);
          W4A8Tile tile;
          while (scheduler.next(tile, p)) stages_left += (num_kb + kStageKB - 1) / kStageKB;
        }
        W4A8Pipe pipe;
#pragma unroll 1
        for (; stages_left > 0; --stages_left) {
          ptx::mbar_wait(full_bar + 8 * pipe.stage, pipe.phase);
          // The stage's kStageKB sub-tiles [kBM x 128] are consecutive, as are their slots: one
          // loop over 16-row slices of both. Also when a tile's odd last stage has only one block:
          // the second sub-tile then holds older bytes, whose sums no consumer reads (fewer
          // registers than tracking the K position here).
          const std::uint32_t a_stage = smem_a + pipe.stage * kAStride;
          const std::uint32_t slot_stage = smem_slot + pipe.stage * kSlotStride;
          constexpr int kSlices = kStageKB * kBM / 16;
          // (Fully unrolled up to four slices; else a slice at a time, within the producer
          // warpgroup's registers.)
#pragma unroll(kSlices <= 4 ? kSlices : 1)
          for (int r = 0; r < kSlices; ++r) {
            const std::uint32_t rows = a_stage + static_cast<std::uint32_t>(r * 16 * w4a8::kBlockK);
            float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const uint4 lo = ptx::ld_shared_v4(rows + w4a8::offset_warp_load(lane, 0, i));
              const uint4 hi = ptx::ld_shared_v4(rows + w4a8::offset_warp_load(lane, 1, i));
              const std::uint32_t f0[4] = {lo.x, hi.x, lo.y, hi.y};  // a[0], a[2]: row g; a[1], a[3]: g + 8
              const std::uint32_t f1[4] = {lo.z, hi.z, lo.w, hi.w};
              ptx::mma_m16n8k32_e4m3(d, f0, b_const);
              ptx::mma_m16n8k32_e4m3(d, f1, b_const);
            }
            if (q == 0) {
              ptx::st_shared_u32(slot_stage + 4 * (16 * r + g), __float_as_uint(d[0]));
              ptx::st_shared_u32(slot_stage + 4 * (16 * r + g + 8), __float_as_uint(d[2]));
            }
          }
          ptx::mbar_arrive_warp(offset_bar + 8 * pipe.stage);  // each lane after its reads and stores
          pipe.advance(stages);
        }
      }
    }
  } else {
    // ------------------------------------------------------------ consumer warpgroups
    ptx::setmaxnreg_inc<Traits::kConsumerRegs>();
    const int consumer = warp / 4 - 1;  // which 64 weight rows of the tile
    const int t = static_cast<int>(threadIdx.x % 128);
    const int warp_in_group = t / 32;
    const int g = lane / 4, q = lane % 4;
    const int row_in_panel = warp_in_group * 16 + g;  // and + 8

    W4A8Scheduler<kBM, kTileN> scheduler(p, kBM == 256 ? pair_table : 0u);
    float acc[kAcc];
    // Partial accumulators: two (the next K block's wgmma runs while the last one is folded) where
    // the registers allow, else one (with four consumers, 112 registers, 32 x 256 tiles spilled 4
    // bytes with two before v6; 16 x 256 tiles fit since the offset operand comes from shared
    // memory). kParts_ = 2 asks for two on the 32 x 256 tile (no spill since v6, ptxas).
    static_assert(kParts_ == 0 || (kParts_ == 2 && kBM <= 64 && !Traits::kOffsetWarp));
    constexpr int kParts = kParts_ != 0 ? kParts_ : kBM <= 64 && (kConsumers == 2 || kBM <= 16) ? 2 : 1;
    // (The wide tile's two waves share one partial: acc[wave w] = acc[kWaveAcc w, kWaveAcc (w + 1)).)
    static_assert(kWaves == 1 || kParts == 1);
    float part[kParts][kWaveAcc];
    // kRowOffset: per partial, the offset terms of activation rows 64 h + 16 w + g (+ 8) (the
    // m64n8 fragment: [h][0, 1] row g, [h][2, 3] row g + 8), and which of the two buffers is next.
    constexpr int kHalves = Traits::kRowOffset ? kBM / 64 : 1;
    float row_off[kParts][kHalves][4];
    int row_buf = 0;
    const std::uint32_t rows_base = smem_rows + static_cast<std::uint32_t>(consumer) * 2 * kBM * 4;
    std::uint32_t frag[2][4][4];  // converted weights of two K blocks (wgmma A operands)
    // This thread's codes and scales within a stage. Derived from threadIdx, ptxas re-made them (an
    // S2R of variable latency each) in every K block's load and fold; a shuffle's result is not
    // rematerialised, so they are held in two registers instead, except on the 32-row tile with two
    // partials, which then spills (ptxas).
    constexpr bool kHoldAddresses = !(kParts == 2 && kBM >= 32);
    const auto hold = [&](std::uint32_t v) { return kHoldAddresses ? __shfl_sync(0xffffffffu, v, lane) : v; };
    const std::uint32_t w_thread =
        hold(smem_w + static_cast<std::uint32_t>(consumer) * w4a8::kPanelBytes + t * 16);
    const std::uint32_t s_thread =
        hold(smem_s + static_cast<std::uint32_t>(consumer) * w4a8::kPanelScaleBytes +
             w4a8::kScaleBytes * row_in_panel);
    using I0 = std::integral_constant<int, 0>;
    using I1 = std::integral_constant<int, 1>;
    // (kSigned) the low word of stage 0's activation tile's wgmma descriptor.
    [[maybe_unused]] const std::uint32_t a_desc0 =
        Traits::kSigned ? hold(ptx::wgmma_desc_sw128_lo(smem_a)) : 0u;

    // The consumers run one K-block pipeline across their tiles: the K blocks of all of a CTA's
    // tiles form one stream (frag[0] and frag[1] alternate through it, also across a tile
    // boundary), so the first block of the next tile is loaded, converted and (with two partials)
    // issued while the last block of the current one is still in the tensor core, and that tile's
    // fold and epilogue run behind it. (Before, each tile drained the pipeline: its last wgmma
    // group, fold, epilogue and the next tile's first load were serial, once per tile: 16 tiles
    // per CTA at K = 7168, 28 at K = 2048 on the decode rows.) A K block's position in the ring
    // (stage, phase, index in the stage) is a W4A8Pipe; tiles start on a fresh stage.
    //
    // Waits for the stage at `at` if this is its first block, loads this thread's codes of the block
    // and converts them into frag[B].
    // (fetch and convert: its two halves, which the wide tile runs apart.)
    const auto fetch = [&](const W4A8Pipe& at, uint4& v0, uint4& v1) {
      const int sub = kStageKB == 1 ? 0 : at.sub;
      if (sub == 0) ptx::mbar_wait(full_bar + 8 * at.stage, at.phase);
      const std::uint32_t w_addr = w_thread + at.stage * kWStride + sub * Traits::kWBytes;
      v0 = ptx::ld_shared_v4(w_addr);
      v1 = ptx::ld_shared_v4(w_addr + 2048);
    };
    const auto convert = [&](auto b, const uint4& v0, const uint4& v1) {
      constexpr int B = decltype(b)::value;
      w4a8_convert8<Traits::kSigned, Traits::kSignMag>(v0.x, frag[B][0][0], frag[B][0][1]);
      w4a8_convert8<Traits::kSigned, Traits::kSignMag>(v0.y, frag[B][0][2], frag[B][0][3]);
      w4a8_convert8<Traits::kSigned, Traits::kSignMag>(v0.z, frag[B][1][0], frag[B][1][1]);
      w4a8_convert8<Traits::kSigned, Traits::kSignMag>(v0.w, frag[B][1][2], frag[B][1][3]);
      w4a8_convert8<Traits::kSigned, Traits::kSignMag>(v1.x, frag[B][2][0], frag[B][2][1]);
      w4a8_convert8<Traits::kSigned, Traits::kSignMag>(v1.y, frag[B][2][2], frag[B][2][3]);
      w4a8_convert8<Traits::kSigned, Traits::kSignMag>(v1.z, frag[B][3][0], frag[B][3][1]);
      w4a8_convert8<Traits::kSigned, Traits::kSignMag>(v1.w, frag[B][3][2], frag[B][3][3]);
    };
    const auto load = [&](auto b, const W4A8Pipe& at) {
      uint4 v0, v1;
      fetch(at, v0, v1);
      convert(b, v0, v1);
    };
    // Issues the K block in frag[B] against its activation tile (position `at`; the wide tile: the
    // tile's 128-row wave W) into part[P].
    const auto issue = [&](auto b, auto pp, const W4A8Pipe& at, auto wave) {
      constexpr int B = decltype(b)::value, P = decltype(pp)::value, W = decltype(wave)::value;
      const int sub = kStageKB == 1 ? 0 : at.sub;
      const std::uint32_t a_tile = smem_a + at.stage * kAStride + sub * Traits::kABytes +
                                   static_cast<std::uint32_t>(W * Traits::kWaveN * w4a8::kBlockK);
      fence_all(part[P]);
      if constexpr (Traits::kRowOffset) {
#pragma unroll
        for (int h = 0; h < kHalves; ++h) fence_all(row_off[P][h]);
      }
      ptx::wgmma_fence();
      // The offset from shared memory (SS): as a register operand it held registers across the
      // in-flight groups and spilled the 112-register consumers. Its descriptor is rebuilt per
      // issue (an opaque copy of the address: hoisted, it held two registers across the K loop).
      [[maybe_unused]] std::uint64_t offset_desc = 0;
      if constexpr (Traits::kOffsetSS || Traits::kRowOffset) {
        std::uint32_t offset_tile = smem_offset;
        ptx::opaque(offset_tile);
        offset_desc = ptx::wgmma_desc_sw128(offset_tile);
      }
      if constexpr (Traits::kRowOffset) {
#pragma unroll
        for (int h = 0; h < kHalves; ++h) {
#pragma unroll
          for (int s = 0; s < 4; ++s)
            ptx::wgmma_m64n8k32_e4m3(row_off[P][h],
                                     ptx::wgmma_desc_sw128(a_tile + h * 64 * w4a8::kBlockK + s * 32),
                                     offset_desc, s > 0);
        }
      }
      // (kSigned: from the ring's first descriptor by a 32-bit add, no descriptor built per wgmma.)
      [[maybe_unused]] const std::uint32_t a_desc_lo =
          a_desc0 +
          static_cast<std::uint32_t>((at.stage * kAStride + W * Traits::kWaveN * w4a8::kBlockK) >> 4);
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const std::uint64_t desc = Traits::kSigned ? ptx::wgmma_desc_from_lo(a_desc_lo + s * (32 >> 4))
                                                   : ptx::wgmma_desc_sw128(a_tile + s * 32);
        if constexpr (Traits::kOffsetSS) ptx::wgmma_m64k32_ss_e4m3<kBM>(part[P], offset_desc, desc, s > 0);
        ptx::wgmma_m64k32_rs_e4m3<Traits::kWaveN>(part[P], frag[B][s], desc,
                                                  Traits::kOffsetSS ? true : s > 0);
      }
      ptx::wgmma_commit();
    };
    // This thread's two weight rows' scales of the block at `at`. (Read at the fold, not with the
    // codes: two registers less across the K loop; the wide tile reads them once per K block, right
    // after issuing its first wave, for both folds.)
    const auto block_scales = [&](const W4A8Pipe& at) {
      const int sub = kStageKB == 1 ? 0 : at.sub;
      const std::uint32_t s_addr = s_thread + at.stage * kSStride + sub * Traits::kSBytes;
      return float2{ptx::ld_shared_bf16_as_f32(s_addr),
                    ptx::ld_shared_bf16_as_f32(s_addr + w4a8::kScaleBytes * 8)};
    };
    // After the wgmma into part[P] completed: frees the stage of the block at `at` if it was the stage's
    // last block (`last`) and folds part[P] into acc (the wide tile: into wave W's accumulators,
    // acc[kWaveAcc W ..]) with `scales`.
    const auto fold_scaled = [&](auto pp, const W4A8Pipe& at, bool last, auto wave, float2 scales) {
      constexpr int P = decltype(pp)::value, W0 = decltype(wave)::value * kWaveAcc;
      const int stage = at.stage;
      [[maybe_unused]] const int sub = kStageKB == 1 ? 0 : at.sub;  // (kSlot)
      const float s_lo = scales.x, s_hi = scales.y;
      if constexpr (Traits::kSlot) {
        // The stage's sums (the offset warp's, or the pre-pass's copied in with the stage), for this
        // thread's columns 8 j + 2 q + {0, 1} (activation rows), read before the release (the slot
        // is rewritten after it). The offset warp's barrier has normally completed long before: the
        // sums ran while this block's wgmma did.
        if constexpr (Traits::kOffsetWarp) {
          if (sub == 0) ptx::mbar_wait(offset_bar + 8 * stage, at.phase);
        }
        const std::uint32_t slot = smem_slot + stage * kSlotStride + sub * Traits::kSlotBytes;
        fence_all(part[P]);
#pragma unroll
        for (int j = 0; j < kAcc / 4; ++j) {
          const float2 o = ptx::ld_shared_f32x2(slot + 4 * (8 * j + 2 * q));
          acc[4 * j + 0] = fmaf(s_lo, part[P][4 * j + 0] + o.x, acc[4 * j + 0]);
          acc[4 * j + 1] = fmaf(s_lo, part[P][4 * j + 1] + o.y, acc[4 * j + 1]);
          acc[4 * j + 2] = fmaf(s_hi, part[P][4 * j + 2] + o.x, acc[4 * j + 2]);
          acc[4 * j + 3] = fmaf(s_hi, part[P][4 * j + 3] + o.y, acc[4 * j + 3]);
        }
        fence_all(part[P]);
        if (last) {
          ptx::mbar_arrive_warp(empty_bar + 8 * stage);  // each lane after its shared loads of the stage
        }
      } else {
        fence_all(part[P]);
        if (last) {
          ptx::mbar_arrive_warp(empty_bar + 8 * stage);  // each lane after its shared loads of the stage
        }
        fence_all(part[P]);
        if constexpr (Traits::kRowOffset) {
          // Offsets by activation row -> by this thread's columns 8 j + 2 q + {0, 1}, through this
          // consumer's buffer row_buf (the buffer written two folds later is read-free once every
          // thread has passed the next fold's barrier).
          const std::uint32_t buf = rows_base + static_cast<std::uint32_t>(row_buf) * kBM * 4;
          row_buf ^= 1;
          if (q == 0) {
#pragma unroll
            for (int h = 0; h < kHalves; ++h) {
              fence_all(row_off[P][h]);
              ptx::st_shared_u32(buf + 4 * (64 * h + row_in_panel), __float_as_uint(row_off[P][h][0]));
              ptx::st_shared_u32(buf + 4 * (64 * h + row_in_panel + 8), __float_as_uint(row_off[P][h][2]));
            }
          }
          ptx::named_bar_sync(1 + consumer, 128);
#pragma unroll
          for (int j = 0; j < kAcc / 4; ++j) {
            const float2 o = ptx::ld_shared_f32x2(buf + 4 * (8 * j + 2 * q));
            acc[4 * j + 0] = fmaf(s_lo, part[P][4 * j + 0] + o.x, acc[4 * j + 0]);
            acc[4 * j + 1] = fmaf(s_lo, part[P][4 * j + 1] + o.y, acc[4 * j + 1]);
            acc[4 * j + 2] = fmaf(s_hi, part[P][4 * j + 2] + o.x, acc[4 * j + 2]);
            acc[4 * j + 3] = fmaf(s_hi, part[P][4 * j + 3] + o.y, acc[4 * j + 3]);
          }
        } else {
#pragma unroll
          for (int j = 0; j < kWaveAcc / 4; ++j) {
            acc[W0 + 4 * j + 0] = fmaf(s_lo, part[P][4 * j + 0], acc[W0 + 4 * j + 0]);
            acc[W0 + 4 * j + 1] = fmaf(s_lo, part[P][4 * j + 1], acc[W0 + 4 * j + 1]);
            acc[W0 + 4 * j + 2] = fmaf(s_hi, part[P][4 * j + 2], acc[W0 + 4 * j + 2]);
            acc[W0 + 4 * j + 3] = fmaf(s_hi, part[P][4 * j + 3], acc[W0 + 4 * j + 3]);
          }
        }
      }
    };
    const auto fold = [&](auto pp, const W4A8Pipe& at, bool last, auto wave) {
      fold_scaled(pp, at, last, wave, block_scales(at));
    };
    // The signed tiles' epilogue (128 x 128, and the wide tile one 128-row wave at a time):
    // acc[4 j + 2 h + e] is D^T[n0 + 8 h, 8 j + 2 q + e]; packed to bf16 pairs, (j, h) is one 8 x 8
    // fragment of the warp, which movmatrix transposes, so that lane (g, q) then holds
    // D[8 j + g, n_w + 8 h + 2 q, + 1] (n_w: the warp's first weight row): one 4-byte store, no
    // shuffle and no lane-parity selects. `valid`: the tile's rows' validity, bit r of word i for row
    // 32 i + r. Clears the wave's accumulators. (Run under this consumer's own wgmma, i.e. with the
    // partial and a fragment in flight, either wave spilled.)
    [[maybe_unused]] const auto store_wave = [&](auto wave, const W4A8Tile& done,
                                                 const std::uint32_t* valid) {
      constexpr int W = decltype(wave)::value;
      constexpr int kJ = kWaveAcc / 4;  // 8-row column blocks per wave (16: called for 128-row waves only)
      const float a_scale = (p.a_scale_ptr != nullptr ? __ldg(p.a_scale_ptr) : p.a_scale) * w4a8::kCodeScale;
      __nv_bfloat16* const out = p.d + static_cast<std::int64_t>(done.row0 + g) * p.n + done.n_tile * kTileN +
                                 consumer * w4a8::kPanelRows + warp_in_group * 16 + 2 * q;
#pragma unroll
      for (int jj = 0; jj < kJ; ++jj) {
        const int j = kJ * W + jj;
        const bool ok = ((valid[4 * W + jj / 4] >> (8 * (jj % 4) + g)) & 1u) != 0;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const std::uint32_t pair = ptx::movmatrix_trans_b16(
              pack_bf16x2(acc[4 * j + 2 * h] * a_scale, acc[4 * j + 2 * h + 1] * a_scale));
          if (ok)
            *reinterpret_cast<std::uint32_t*>(out + static_cast<std::int64_t>(8 * j) * p.n + 8 * h) = pair;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[4 * j + e] = 0.0f;
      }
    };
    // Stores the finished tile `done` from acc and clears acc for the next one. acc[4 j + 2 h + e]
    // is D^T[n0 + 8 h, m0 + e] (n0 this thread's weight row, m0 = 8 j + 2 q). Lanes g and g ^ 1
    // (lane ^ 4) hold neighbouring weight rows: after one exchange the even lane holds columns
    // (n, n + 1) of activation row m0 and the odd lane those of m0 + 1. (a_scale and the lane parity
    // are looked up here: registers held across the K loop spill the four-consumer tiles.)
    const auto epilogue = [&](const W4A8Tile& done, bool half = false) {
      if constexpr (kBM == 256 || (kBM == 128 && Traits::kSigned)) {
        // (All the tile's validity loads at once: their latency once per tile, not once per wave.)
        std::uint32_t valid[kBM / 32];
#pragma unroll
        for (int i = 0; i < kBM / 32; ++i) {
          const std::int32_t row = done.row0 + 32 * i + lane;
          valid[i] = __ballot_sync(
              0xffffffffu,
              row < done.row_end && (p.m_indices == nullptr || __ldg(p.m_indices + row) == done.group));
        }
        store_wave(I0{}, done, valid);
        if constexpr (kWaves == 2) {
          if (!half) store_wave(I1{}, done, valid);  // (a half tile's wave 1: no rows, acc still 0)
        }
        return;
      }
      const float a_scale = (p.a_scale_ptr != nullptr ? __ldg(p.a_scale_ptr) : p.a_scale) * w4a8::kCodeScale;
      const bool odd = (g & 1) != 0;
      const std::int32_t n0 = done.n_tile * kTileN + consumer * w4a8::kPanelRows + row_in_panel;
#pragma unroll
      for (int j = 0; j < kAcc / 4; ++j) {
        const std::int32_t m = 8 * j + 2 * q + (odd ? 1 : 0);
        const std::int32_t row = done.row0 + m;
        bool valid = row < done.row_end;
        if (valid && p.m_indices != nullptr) valid = __ldg(p.m_indices + row) == done.group;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float x0 = acc[4 * j + 2 * h] * a_scale, x1 = acc[4 * j + 2 * h + 1] * a_scale;
          const float recv = __shfl_xor_sync(0xffffffffu, odd ? x0 : x1, 4);
          const std::uint32_t pair = odd ? pack_bf16x2(recv, x1) : pack_bf16x2(x0, recv);
          const std::int32_t col = n0 + 8 * h - (odd ? 1 : 0);
          if (valid)
            *reinterpret_cast<std::uint32_t*>(p.d + static_cast<std::int64_t>(row) * p.n + col) = pair;
        }
      }
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
    };

    // The next tile of the stream, whose first K block is at `at`: kDynamicTiles with a counter, the
    // producer's word for that stage (-1: no more), read once the stage is full; else the schedule.
    [[maybe_unused]] const bool dynamic = Traits::kDynamicTiles && p.tile_counter != nullptr;
    const auto next_tile = [&](W4A8Tile& next, const W4A8Pipe& at) {
      if constexpr (Traits::kDynamicTiles) {
        if (dynamic) {
          ptx::mbar_wait(full_bar + 8 * at.stage, at.phase);
          const std::int32_t t = ptx::ld_shared_s32(tile_ring + 8 * at.stage);
          return t >= 0 && scheduler.masked_tile(next, p, t);
        }
      }
      return scheduler.next(next, p);
    };
    W4A8Tile tile;  // the tile whose K blocks acc is summing (the oldest block not yet folded)
    bool more = next_tile(tile, W4A8Pipe{});
    if (more) {
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[i] = 0.0f;
#pragma unroll
      for (int P = 0; P < kParts; ++P) {
#pragma unroll
        for (int i = 0; i < kWaveAcc; ++i) part[P][i] = 0.0f;
      }
      W4A8Tile ld_tile = tile;  // the tile of the block issued next, and its index kb in it
      std::int32_t kb = 0;
      W4A8Pipe pipe;  // that block's position
      // Two partials: the block issued last (its position, whether it is its stage's last and its
      // tile's last), folded after the next block's issue (wait_group 1).
      W4A8Pipe prev{};
      bool prev_last = false, prev_ends = false, have_prev = false;
      load(I0{}, pipe);
      // Issues the block in frag[B] (loaded), folds the one before (two partials) or this one (one),
      // finishes the tile whose last block was folded, and loads the next block of the stream into
      // frag[B ^ 1]. Returns whether there is a next block.
      const auto step = [&](auto b, auto half) {
        using Other = std::integral_constant<int, decltype(b)::value ^ 1>;
        const bool ends = kb + 1 == num_kb;  // the last block of its tile
        const bool last = kStageKB == 1 || ends || pipe.sub + 1 == kStageKB;
        const W4A8Pipe cur = pipe;
        pipe.next_block(last, stages);
        if constexpr (kParts == 2) {
          issue(b, b, cur, I0{});
          if (have_prev) {
            ptx::wgmma_wait<1>();
            fold(Other{}, prev, prev_last, I0{});
            if (prev_ends) {
              epilogue(tile);
              tile = ld_tile;
            }
          }
          prev = cur;
          prev_last = last;
          prev_ends = ends;
          have_prev = true;
          // The next block (the next tile's first after a tile's last; the scheduler is asked only
          // now, so that `tile` above was still the finished one).
          if (ends) {
            more = next_tile(ld_tile, pipe);
            kb = 0;
          } else {
            ++kb;
          }
          if (more) load(Other{}, pipe);
        } else if constexpr (kWaves == 2) {
          // The wide tile: wave 0, its fold, then wave 1 with the next block's codes read under it,
          // its fold (which gives the stage back) and the codes' conversion, then (after a tile's
          // last block) the epilogue. (frag[B] is held by wave 1 until it completes: two K blocks'
          // fragments, or the conversion before the fold, beside acc and the partial spilled at 240
          // registers. The other consumer's waves keep the tensor core busy meanwhile.) Half tiles
          // (`half`: a CTA that runs only those) issue wave 0 alone, with the codes read under it.
          constexpr bool kHalf = decltype(half)::value;
          using Last = std::conditional_t<kHalf, I0, I1>;  // the wave whose fold ends the block
          issue(b, I0{}, cur, I0{});
          const float2 scales = block_scales(cur);
          if constexpr (!kHalf) {
            ptx::wgmma_wait<0>();
            fold_scaled(I0{}, cur, false, I0{}, scales);
            issue(b, I0{}, cur, I1{});
          }
          if (ends) {
            more = next_tile(ld_tile, pipe);
            kb = 0;
          } else {
            ++kb;
          }
          uint4 v0{}, v1{};
          if (more) fetch(pipe, v0, v1);
          ptx::wgmma_wait<0>();
          fold_scaled(I0{}, cur, last, Last{}, scales);
          if (ends) {
            epilogue(tile, kHalf);
            tile = ld_tile;
          }
          if (more) convert(Other{}, v0, v1);
        } else {
          issue(b, I0{}, cur, I0{});
          if (ends) {
            more = next_tile(ld_tile, pipe);
            kb = 0;
          } else {
            ++kb;
          }
          if (more) load(Other{}, pipe);
          ptx::wgmma_wait<0>();
          fold(I0{}, cur, last, I0{});
          if (ends) {
            epilogue(tile);
            tile = ld_tile;
          }
        }
        return more;
      };
      // The stream's last block: folded and its tile stored after the loop (two partials).
      const auto finish = [&](auto b) {
        if constexpr (kParts == 2) {
          ptx::wgmma_wait<0>();
          fold(b, prev, true, I0{});
          epilogue(tile);
        }
      };
      const auto loop = [&](auto half) {
        for (;;) {
          if (!step(I0{}, half)) {
            finish(I0{});
            break;
          }
          if (!step(I1{}, half)) {
            finish(I1{});
            break;
          }
        }
      };
      // (The wide tile's half tiles: a loop of their own, wave 0 only. A run-time branch around wave 1
      // inside one loop spilled the consumers in every form tried. The other tiles keep the loop
      // written out: through `loop` their SASS changed by 8 instructions, decode tiles included.)
      if constexpr (kWaves == 2 && kHalfLoop) {
        if (!scheduler.half_tiles()) {
          loop(std::false_type{});
        } else {
          loop(std::true_type{});
        }
      } else {
        for (;;) {
          if (!step(I0{}, std::false_type{})) {
            finish(I0{});
            break;
          }
          if (!step(I1{}, std::false_type{})) {
            finish(I1{});
            break;
          }
        }
      }
    }
  }
}

}  // namespace epmoe::kernels
