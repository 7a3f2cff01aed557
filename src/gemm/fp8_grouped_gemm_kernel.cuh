// FP8 block-scaled grouped GEMM for Hopper (device code; host launcher in fp8_grouped_gemm.cu,
// API in epmoe/cuda/grouped_gemm.hpp).
//
//   D[m, n] = Σ_kb sa[m, kb] · sb[g(m), n/128, kb] · Σ_{k in kb} A[m, k] · B[g(m), n, k]
//
// One persistent CTA per SM, warp-specialised, tiles of kBlockM x kBlockN (64 x 128, 128 x 128 or
// 128 x 256), 128 of K per pipeline stage:
//   - warpgroup 0 (the producer): warp 3 walks the tile schedule and hands each tile to the other
//     roles through a ring in shared memory (TileRing, v13); warp 0, per K block, waits for a free stage (its
//     "empty" mbarrier) and TMA-loads the A tile [kBlockM x 128] and the B tile [kBlockN x 128] (K-major,
//     128-byte swizzled) into it; warp 1 copies the K block's scales (sa of the tile's rows, sb of its
//     128-column blocks) into the stage with cp.async; the stage's "full" mbarrier completes when the TMA
//     bytes and every lane's copies have landed;
//   - warpgroups 1.. (the consumers, 64 rows of the tile each): wait on "full", read the stage's
//     scales, and per 128 columns (a "wave") issue four wgmma m64n128k32 (e4m3 x e4m3 -> f32) into
//     a per-K-block accumulator, wait for them, free the stage after the last (one arrive per warp
//     on "empty"), and promote: acc += sa·sb · partial (f32), as DeepGEMM does; the next K block's
//     "full" wait runs under the last wave (v9), and the loop is unrolled over the stages where K
//     allows (uniform addresses). Tiles of one wave (block_n = 128) alternate two partials instead,
//     each K block issued before the previous one is waited for and promoted (v7). After the last K
//     block, the f32 accumulators go to bf16 and to global memory (valid rows only), 16 bytes per
//     store after a transpose inside each quad of lanes. With p.split_tiles (v11; by default only
//     for short K and small groups, the host's choice: slower where loads set the pace, bench/NOTES.md
//     sessions 15 and 30; and for masked groups of 9-64 rows, session 48) a 128 x 256 tile with at
//     most 64 valid rows (a group's last block) is split: both consumers take its first 64 rows, each
//     one 128-column wave, so no warpgroup computes only padding rows.
// Ping-pong (p.pingpong, off by default): the two consumer warpgroups issue their waves in turn
// (named barriers 1 and 2 pass the turn), meant to run one warpgroup's promotion under the other's
// wgmma; measured 13% slower than leaving them alone (bench/NOTES.md, v3), kept for experiments.
// Clusters of two CTAs along N (p.cluster == 2): the two CTAs of a cluster compute the tiles
// (m, 2u) and (m, 2u + 1), which share the A tile: each CTA loads one 64-row half of it and the TMA
// multicasts it into both CTAs' shared memory (a sixth less L2 -> SM traffic for 128 x 256 tiles).
// A stage is refilled only once the consumers of both CTAs freed it (they arrive on both CTAs'
// "empty" barriers).
// No consumer touches global memory inside the K loop: scales come with the stage, so nothing
// waits on a load's latency there.
// Split tail (v21, p.split_quantum != 0, with a workspace): the tiles left after the grid's last whole
// round (tiles mod CTAs) are split along K into chunks of whole quanta for the CTAs that would idle
// (GemmScheduler::plan_split; the host's cost model picks the chunk count). A chunk's consumer warps
// write their f32 accumulators to the workspace and count themselves in; the warp that arrives last
// sums the chunks in chunk order (split_tile_reduce) and stores the tile's rows, the others store
// nothing. Its rows' bits then differ from an unsplit launch's (not batch-invariant).
// Tail pieces (v22, p.tail_pieces): instead, a 128 x 256 launch stops at its last whole round and a
// 64 x 128 launch (programmatic dependent, on the SMs the first one's CTAs leave) computes each tail
// tile as four 64 x 128 pieces over the whole of K: the same sums as a whole tile, bit for bit.
// The schedule is static (work unit u goes to cluster u mod the number of clusters); both CTAs of a
// cluster walk it identically and skip the same units, so their pipeline stages and phases stay in
// lockstep.
//
// Layouts. Contiguous: A [M, K], m_indices [M]; every 128-row block (from row 0) holds rows of at
// most one group (its group is the max of its m_indices; all -1: the block is skipped); a row is
// written only when m_indices[row] equals that group. Masked: A [G * M_max, K] viewed flat; the
// group's valid rows are [0, min(masked_m[g], M_max)), read on the device (no host sync).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <cuda.h>
#include <cuda_bf16.h>

#include "cuda/ptx_hopper.cuh"
#include "gemm/gemm_common.cuh"
#include "gemm/schedule_math.hpp"

namespace epmoe::kernels {

inline constexpr int kGemmWaveN = 128;  // columns per wgmma wave (one weight-scale block)
// Columns per band of the contiguous tile order (GroupedGemmOptions::band_columns; 512, 2048 and all
// of N measured level or slower, bench/NOTES.md session 30).
inline constexpr int kGemmBandColumns = 1024;

// v29: zeros for the A rows past a tile's valid ones (GroupedGemmParams::zero_padding_rows): the bytes of
// 128 rows of one K block, zero as every static object is at load; the kernels only read them.
static __device__ __align__(128) std::uint8_t g_zero_a_rows[128 * kGemmBlockK];

// v13's tile ring (bench/NOTES.md, session 35): the producer warpgroup's otherwise idle warp 3 walks
// the schedule up to kTileSlots tiles ahead of the TMA, scale and store warps and hands each tile over
// in shared memory. Walking it themselves (next(): in the contiguous layout a dependent read of
// m_indices and two warp reductions) took the TMA warp ~2 800 cycles at every tile turn under load,
// measured, and K block 0's loads waited for it. Per slot: the tile's words (kTileSlotBytes), "full"
// and "empty" barriers (8 bytes each).
// (Four slots: with fewer K blocks per tile than stages the producers run several tiles ahead.)
inline constexpr int kTileSlots = 4;
inline constexpr int kTileSlotBytes = 64;
inline constexpr int kTileRingBytes = kTileSlots * (kTileSlotBytes + 16);

template <int kBlockM, int kBlockN>
struct GemmTraits {
  static_assert((kBlockM == 64 || kBlockM == 128) && (kBlockN == 128 || kBlockN == 256));
  static constexpr int kConsumers = kBlockM / 64;      // consumer warpgroups
  static constexpr int kWaves = kBlockN / kGemmWaveN;  // 128-column waves per consumer and K block
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kABytes = kBlockM * kGemmBlockK;
  static constexpr int kAHalfBytes = kABytes / 2;  // one CTA's share of A in a cluster of two
  static constexpr int kBBytes = kBlockN * kGemmBlockK;
  static constexpr int kStageBytes = kABytes + kBBytes;
  // Per stage: sa of the tile's rows, then sb of its waves (padded to 16 bytes).
  static constexpr int kScaleFloats = kBlockM + 4;
  static constexpr int kScaleBytes = kScaleFloats * 4;
  // v18: the staged output's wave 0 (two [kBlockM rows x 128 bytes] swizzled boxes) in memory of its
  // own, so that a borrowing epilogue takes only the last stage (bench/NOTES.md, session 37). It fits
  // beside 128 x 256's four stages without the 1024 bytes of alignment slack (the dynamic shared
  // memory starts 1024-aligned, checked at run time) and without v13's unused ids (4 KB); the other
  // shapes keep their stage counts.
  static constexpr int kEpiBytes = kWaves == 2 ? kBlockM * 128 * 2 : 0;
  // The tiles, the scales and the stages' barriers; v18's wave-0 boxes; 96 bytes for v12's (v14's)
  // three barriers and eight consumer warps' row masks, then v13's tile ring (v14's barrier and v21's
  // split plan after it, in the 96 bytes' slack).
  static constexpr int kTailBytes = 96 + kTileRingBytes;
  static constexpr int kStages =
      std::min(8, (kGemmSmemBudget - kEpiBytes - kTailBytes) / (kStageBytes + kScaleBytes + 16));
  static constexpr int kSmemBytes = kStages * (kStageBytes + kScaleBytes + 16) + kEpiBytes + kTailBytes;
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
};

struct GroupedGemmParams {
  const float* sa;  // A scales: sa[g * sa_group_stride + row * sa_row_stride + kb * sa_kb_stride]
  std::int32_t sa_group_stride;  // masked: per group; contiguous: 0 (all offsets fit in 31 bits)
  std::int32_t sa_row_stride;    // row within the group (masked) or within A (contiguous)
  std::int32_t sa_kb_stride;
  const float* sb;                // [G, N/128, K/128]
  const std::int32_t* m_indices;  // contiguous layout: [M]; masked: nullptr
  const std::int32_t* masked_m;   // masked layout: [G]; contiguous: nullptr
  __nv_bfloat16* d;               // [rows_total, N]
  std::int32_t rows;              // contiguous: M; masked: M_max
  std::int32_t n, k, groups;
  std::int32_t m_blocks;         // contiguous: ceil(M / kBlockM); masked: ceil(M_max / kBlockM)
  std::int32_t total_units;      // contiguous: m_blocks * N/(kBlockN cluster); masked: unused (on the device)
  std::int32_t stages;           // pipeline stages in use, 1..GemmTraits::kStages
  std::int32_t a_small_rows;     // rows of tma_a_part's box: tiles using no more rows load only those
  std::int32_t cluster;          // CTAs per cluster along N (1 or 2; 2: A multicast, tma_a_part = 64 rows)
  std::int32_t pingpong;         // 1: the two consumer warpgroups issue their wgmma waves in turn
  std::int32_t skew;             // 1: consumer 1 starts each tile after consumer 0's first wave issue
  std::int32_t unroll;           // 1: the consumers' K loop unrolled over the stages (where it applies)
  std::int32_t vector_epilogue;  // 1: 16-byte stores after a quad transpose; 0: 4-byte stores
  std::int32_t two_partials;     // 1: single-wave tiles alternate two partials (wait_group 1)
  std::int32_t split_tiles;      // 1: 128 x 256 tiles with <= 64 valid rows split their columns (v11)
  std::int32_t borrow_epilogue;  // 1: v12 (wave 1 in the last stage, wave 0 in smem_epi); 3: v31; 4: v33
  std::int32_t tile_store;       // 1: a wave whose warps all staged leaves in one tensor store (v17, v19)
  std::int32_t row_group_maps;   // v19: tma_d / tma_d_tile are 4D row-group maps (make_tma_row_groups)
  std::int32_t n_units;          // N / (kBlockN cluster): work units (p.cluster tiles) per m-block
  std::int32_t band_units;       // contiguous: work units per band of the tile order
  std::int32_t band_tiles;       // contiguous: m_blocks * band_units
  // The schedule without integer division (a runtime divisor costs ~25 dependent instructions; a
  // tile turn had several, bench/NOTES.md session 35): units between one CTA's tiles (the grid's
  // clusters), and 1 / band_tiles, 1 / band_units, 1 / the last band's width as floats (div_small).
  std::int32_t unit_stride;
  float inv_band_tiles, inv_band_units, inv_last_width;
  std::int32_t ablation;  // kAblate*: timing experiments only
  // v21's split tail (bench/NOTES.md, session 38): the tiles past the last whole round of the grid
  // (tiles mod unit_stride) are split along K into chunks that idle CTAs take; each chunk's warps
  // write their f32 partials to split_partials, and the last warp to arrive on its counter sums them
  // in chunk order (deterministic) and stores the tile. 0: off; else K blocks per chunk quantum (the
  // stages of the unrolled loop, so that every chunk starts at stage 0).
  std::int32_t split_quantum;
  std::int32_t split_max_chunks;  // at most this many chunks per tile (<= kMaxSplitChunks)
  std::uint64_t split_table;      // nibble m: the chunks to use when at most m fit (1: no split)
  std::int32_t split_max_rounds;  // split only where the tiles fill fewer whole rounds of the grid
  float* split_partials;          // [tail tile x chunks + chunk][consumer warp][kWaves x 32 float2][32 lanes]
  std::int32_t* split_counters;   // [unit_stride][8]: zero between launches (the last warp resets its own)
  // v22, the tail as pieces (bench/NOTES.md session 39): kTailWhole in a 128 x 256 launch
  // (no cluster, no split tiles) leaves the tiles past the grid's last whole round to the 64 x 128
  // launch that follows it (kTailPieces) wherever four pieces of each fit that launch's CTAs
  // (piece_ctas); the follower computes each such tile as four 64 x 128 pieces (row half, column
  // half; empty halves skipped), one per CTA, from the parent's schedule (parent_stride CTAs,
  // parent_n_units = N / 256). Every element is the same sum over K as in a whole tile (batch
  // invariance holds), no workspace is needed, and the follower's CTAs start on the SMs the parent's
  // CTAs leave (programmatic dependent launch: the parent triggers it at its start; the follower
  // reads nothing the parent writes).
  // (Contiguous: the parent's tile order too, its band_units, band_tiles and their inverses.)
  std::int32_t tail_pieces;  // 0 (off), kTailWhole or kTailPieces
  std::int32_t piece_ctas;
  std::int32_t parent_stride, parent_n_units;
  std::int32_t parent_units;  // contiguous: the parent's total_units
  std::int32_t parent_band_units, parent_band_tiles;
  float inv_parent_band_tiles, inv_parent_band_units, inv_parent_last_width;
  // v29 (session 43): 1: tiles with fewer valid rows than kBlockM load only A's 32-row boxes (tma_a_part's)
  // that hold valid rows, and the rest of the stage's A rows are zeros (a bulk copy of g_zero_a_rows that
  // the scale warp issues when the tile first uses the stage; 2: the same, a split tile's zeros over all 128
  // rows, as before v37c: EPMOE_GEMM_SPLIT_ZEROS_ALL); 0: as a_small_rows says. (Last: beside
  // a_small_rows, the new member moved ptxas's allocation of the 128 x 256 consumers into spills.)
  std::int32_t zero_padding_rows;
  // v30 (session 44; GroupedGemmOptions::trim_ctas): 1: a masked launch whose tiles (counted on the
  // device) leave at least half of the grid's last round busy and are not split (v21) runs on only as
  // many CTAs as keep the same number of rounds, ceil(T / ceil(T / C)), every one with the same count;
  // the others exit at once. The fewer SMs the same rounds take, the higher the power-capped clock of
  // the busy ones (masked 32 x 192 at K = 7168 0.8-1.0% faster, bench/NOTES.md session 44). (Contiguous
  // launches get a trimmed grid from the host instead: 0 there.) (Last, as zero_padding_rows.)
  std::int32_t trim_ctas;
};

inline constexpr int kTailWhole = 1;
inline constexpr int kTailPieces = 2;
inline constexpr int kPiecesPerTile = 4;

// v21: chunks per split tile, at most (the ring packs the chunk and the count in 4 bits each).
inline constexpr int kMaxSplitChunks = 15;
// Per split tile, one counter per consumer warp (at most 8).
inline constexpr int kSplitCountersPerTile = 8;

// Not an ablation: consumer 0's first thread of every CTA adds its consumer loop's SM cycles and
// nanoseconds to g_fp8_gemm_trace (the loop's cycles per wgmma and the clock it ran at, against the
// probe's; read by fp8_grouped_gemm_take_trace).
inline constexpr int kTraceLoop = 256;
// Not an ablation: warp 0's lane 0 stamps %globaltimer per CTA into g_fp8_cta_trace (the first
// cuda::kGemmTraceMaxCtas CTAs): [0] entry, [1] its last TMA load issued, [2] every stage released by the
// consumers after it (read by fp8_grouped_gemm_take_cta_trace). Only the producer stamps: its waits are
// off the consumers' path.
inline constexpr int kTraceCtas = 2048;
inline constexpr int kTraceBits = kTraceLoop | kTraceCtas;
__device__ unsigned long long g_fp8_cta_trace[3 * cuda::kGemmTraceMaxCtas];
// Timing ablation (v12 launches), as GroupedGemmParams::borrow_epilogue == 2 (the ablation bits turn v12
// off): the producer loads the next tile's K blocks into the borrowed stages without waiting for the
// store warp's epi_done, i.e. what the hand-off costs the start of each next tile.
inline constexpr int kBorrowNoGate = 2;
// v31 (GroupedGemmOptions::borrow_epilogue 2) as GroupedGemmParams::borrow_epilogue == 3: the kWave0
// instances (see the kernel).
inline constexpr int kBorrowWave0 = 3;
// v33 (GroupedGemmOptions::borrow_epilogue 3) as GroupedGemmParams::borrow_epilogue == 4: v12 whose
// consumer warps stage wave 0 (smem_epi, their own rows) before the two consumers meet, wave 1 (the
// borrowed stage, which both consumers' wgmma read) after: the consumer that finishes its K loop first
// stages half its tile while the other still computes.
inline constexpr int kBorrowWave0First = 4;

// v11: whether a kBlockM x kBlockN tile with rows_used possibly valid rows is computed split (both
// consumers on its first 64 rows, one 128-column wave each; see the consumer loop). The scheduler
// picks the consumers' valid-row word by it; the consumers run the split loop by it.
template <int kBlockM, int kBlockN>
__device__ __forceinline__ bool split_tile(const GroupedGemmParams& p, std::int32_t rows_used) {
  return kBlockM == 128 && kBlockN == 256 && rows_used <= 64 && p.split_tiles != 0 && p.cluster == 1 &&
         p.pingpong == 0 && p.skew == 0 && p.vector_epilogue != 0 && (p.ablation & ~kTraceBits) == 0;
}

// One output tile.
struct GemmTile {
  std::int32_t group;         // B group
  std::int32_t n_block;       // columns [kBlockN n_block, kBlockN (n_block + 1))
  std::int32_t row0;          // first row of the tile in A's (flattened) rows
  std::int32_t seg_row0;      // first row of the tile's group segment (masked: g * M_max; else 0)
  std::int32_t row_end;       // rows >= row_end are never valid
  std::int32_t scale_group;   // masked: g; contiguous: 0 (selects the A-scale slab)
  std::int32_t rows_used;     // 1 + the last tile row that may be valid (A rows past it need no load)
  std::int32_t kb_begin = 0;  // v21: the K blocks [kb_begin, kb_begin + kb_count) of this unit
  std::int32_t kb_count = 0;
  std::int32_t split = -1;  // v21: -1 a whole tile; else (tail tile << 8) | (chunk << 4) | chunks
};

// The static persistent schedule over work units: a unit is p.cluster tiles side by side along N
// (one per CTA of a cluster: rank r takes n-block cluster * n_unit + r). next_all_rows() is warp-collective:
// every lane of the calling warp must call it (the contiguous layout reduces a block's m_indices
// over the warp). Only the walking state lives in registers; the problem is read from the
// (grid-constant) kernel parameters.
// Walked by one warp only since v13 (TileRing::write_all), which hands the tiles to the others.
template <int kBlockM, int kBlockN>
class GemmScheduler {
 public:
  // plan: 16 bytes of shared memory of the walking warp's own (v21's split plan; written here).
  __device__ GemmScheduler(const GroupedGemmParams& p, std::uint32_t plan)
      : u_(static_cast<std::int32_t>(blockIdx.x >> (p.cluster - 1))) {  // (cluster: 1 or 2)
    // (The plan first: its loads of masked_m, one round trip for all groups, then bring group 0's count
    // close for load_segment; the other order cost every masked launch a second round trip before its
    // first tile, ~0.7% at K = 2048, bench/NOTES.md session 38.)
    plan_split(p, plan);
    if (p.masked_m != nullptr) load_segment(p);
  }

  // The next tile of this CTA, or false at the end, and the valid rows of each of its 32-row words:
  // bit l of rows[i] is tile row 32 i + l, in both layouts (contiguous: the rows of the tile's group;
  // masked: the rows below tile.row_end).
  __device__ __forceinline__ bool next_all_rows(GemmTile& tile, const GroupedGemmParams& p,
                                                std::uint32_t (&rows)[kBlockM / 32], std::uint32_t plan) {
    if (p.masked_m == nullptr)
      return pieces(p) ? next_contiguous_piece(tile, p, rows, plan) : next_contiguous(tile, p, rows, plan);
    if (pieces(p)) {
      if (!next_piece(tile, p, plan)) return false;
    } else {
      std::int32_t t, v;
      if (!take(p, plan, t, v) || !next_masked(tile, p, t)) return false;
      set_k_range(tile, p, plan, t, v);
    }
#pragma unroll
    for (int i = 0; i < kBlockM / 32; ++i) {
      const std::int32_t n = tile.row_end - (tile.row0 + 32 * i);
      rows[i] = n >= 32 ? ~0u : (n <= 0 ? 0u : (1u << n) - 1u);
    }
    return true;
  }

 private:
  // v21: the split tail's plan (p.split_quantum != 0), warp-collective (the masked layout counts its
  // tiles over the warp): with T tiles and C = p.unit_stride CTAs, the last T mod C tiles (fewer than
  // half of C) are split into s = min(C / (T mod C), p.split_max_chunks) chunks each, work units
  // T - T mod C .. of one chunk each, so that the last round's CTAs each take a chunk. The plan's
  // words (kUnitsEnd, kSplitFrom, kChunks) live in shared memory: in the walking warp's 40 registers
  // they made ptxas spill. v30 (p.trim_ctas): kStride, the units between this CTA's tiles (the grid's
  // CTAs, or fewer where the plan trims them).
  enum PlanWord : std::uint32_t { kUnitsEnd = 0, kSplitFrom = 4, kChunks = 8, kStride = 12 };
  // (Not in 128 x 128 tiles, which masked launches take only for N not a multiple of 256: there the
  // trim's code moved ptxas's allocation of the promotion into 105 one-parity FFMAs.)
  static constexpr bool kTrimmable = !(kBlockM == 128 && kBlockN == 128);
  __device__ void plan_split(const GroupedGemmParams& p, std::uint32_t plan) {
    const std::int32_t end = p.masked_m == nullptr ? p.total_units : 0x7fffffff;  // masked: the groups end it
    write_plan(plan, end, end, 1, p.unit_stride);
    if (p.split_quantum == 0 && p.tail_pieces == 0 && (!kTrimmable || p.trim_ctas == 0)) return;
    std::int32_t tiles = pieces(p) ? p.parent_units : p.total_units;
    if (p.masked_m != nullptr) {
      // (v22's follower counts its parent's 128-row tiles.)
      const std::int32_t block_m = pieces(p) ? 128 : kBlockM;
      std::int32_t blocks = 0;
      for (std::int32_t g = static_cast<std::int32_t>(threadIdx.x % 32); g < p.groups; g += 32)
        blocks += (min(max(__ldg(p.masked_m + g), 0), p.rows) + block_m - 1) / block_m;
      tiles = static_cast<std::int32_t>(__reduce_add_sync(0xffffffffu, static_cast<std::uint32_t>(blocks))) *
              (pieces(p) ? p.parent_n_units : p.n_units);
    }
    if (p.tail_pieces != 0) {
      // v22: both launches decide alike from the same counts. The follower: the parent's tail tiles,
      // kPiecesPerTile units each (kSplitFrom: the first tail tile), or nothing.
      const std::int32_t stride = pieces(p) ? p.parent_stride : p.unit_stride;
      const std::int32_t ctas = pieces(p) ? p.unit_stride : p.piece_ctas;
      const std::int32_t tail = tiles % stride;
      const bool apply = tail > 0 && kPiecesPerTile * tail <= ctas;
      if (pieces(p)) {
        write_plan(plan, apply ? kPiecesPerTile * tail : 0, tiles - tail, 1, p.unit_stride);
        return;
      }
      if (apply) {
        write_plan(plan, tiles - tail, tiles - tail, 1, p.unit_stride);
        return;
      }
      if (p.split_quantum == 0) return;
    }
    const std::int32_t chunks = p.split_quantum != 0 ? split_chunks(p, tiles) : 1;
    const std::int32_t tail = tiles % p.unit_stride;
    if (chunks < 2) {
      // v30: the same rounds on fewer CTAs where the last one is at least half busy: trimmed_ctas's rule,
      // written out (the call compiled the 128 x 256 split instance to other registers, unmeasured).
      std::int32_t stride = p.unit_stride;
      if (kTrimmable && p.trim_ctas != 0 && 2 * tail >= stride) {
        const std::int32_t rounds = tiles / stride + 1;
        stride = (tiles + rounds - 1) / rounds;
      }
      write_plan(plan, u_ < stride ? tiles : 0, tiles, 1, stride);
    } else {
      write_plan(plan, tiles - tail + tail * chunks, tiles - tail, chunks, p.unit_stride);
    }
  }
  // The chunks per tail tile, or 1 (no split): the host's choice for the chunk limit min(CTAs / tail,
  // p.split_max_chunks) (GroupedGemmParams::split_table), where the grid runs at most
  // p.split_max_rounds rounds.
  __device__ static std::int32_t split_chunks(const GroupedGemmParams& p, std::int32_t tiles) {
    const std::int32_t tail = tiles % p.unit_stride;
    if (tail == 0 || tiles / p.unit_stride >= p.split_max_rounds) return 1;
    const std::int32_t limit = min(p.unit_stride / tail, p.split_max_chunks);
    return static_cast<std::int32_t>((p.split_table >> (4 * limit)) & 15u);
  }
  __device__ static void write_plan(std::uint32_t plan, std::int32_t units_end, std::int32_t split_from,
                                    std::int32_t chunks, std::int32_t stride) {
    __syncwarp();  // (every lane's reads of an earlier plan done)
    if (threadIdx.x % 32 == 0) {
      ptx::st_shared_u32(plan + kUnitsEnd, static_cast<std::uint32_t>(units_end));
      ptx::st_shared_u32(plan + kSplitFrom, static_cast<std::uint32_t>(split_from));
      ptx::st_shared_u32(plan + kChunks, static_cast<std::uint32_t>(chunks));
      ptx::st_shared_u32(plan + kStride, static_cast<std::uint32_t>(stride));
    }
    __syncwarp();
  }

  // This CTA's next work unit: its tile t and, for a chunk of a split tile, v (its index among the
  // chunks, tail tile (t - split_from_) times chunks_ plus the chunk); else v = -1.
  __device__ __forceinline__ bool take(const GroupedGemmParams& p, std::uint32_t plan, std::int32_t& t,
                                       std::int32_t& v) {
    if (u_ >= ptx::ld_shared_s32(plan + kUnitsEnd)) return false;
    const std::int32_t u = u_, split_from = ptx::ld_shared_s32(plan + kSplitFrom);
    u_ += kTrimmable ? ptx::ld_shared_s32(plan + kStride) : p.unit_stride;
    if (u < split_from) {
      t = u;
      v = -1;
    } else {
      v = u - split_from;
      t = split_from + v / ptx::ld_shared_s32(plan + kChunks);
    }
    return true;
  }

  // v22's follower: this CTA's next work unit, the parent's tail tile t (from the plan's kSplitFrom) and
  // its piece q (take()'s counterpart; the plan's kUnitsEnd counts pieces).
  __device__ __forceinline__ bool take_piece(const GroupedGemmParams& p, std::uint32_t plan, std::int32_t& t,
                                             std::int32_t& q) {
    if (u_ >= ptx::ld_shared_s32(plan + kUnitsEnd)) return false;
    const std::int32_t u = u_;
    u_ += p.unit_stride;
    t = ptx::ld_shared_s32(plan + kSplitFrom) + u / kPiecesPerTile;
    q = u % kPiecesPerTile;
    return true;
  }

  // The K blocks of unit (t, v) (take()): all, or chunk v % chunks_'s share of whole quanta.
  __device__ __forceinline__ void set_k_range(GemmTile& tile, const GroupedGemmParams& p, std::uint32_t plan,
                                              std::int32_t t, std::int32_t v) const {
    const std::int32_t num_kb = p.k / kGemmBlockK;
    if (v < 0) {
      tile.kb_begin = 0;
      tile.kb_count = num_kb;
      tile.split = -1;
      return;
    }
    const std::int32_t chunks = ptx::ld_shared_s32(plan + kChunks);
    const std::int32_t i = t - ptx::ld_shared_s32(plan + kSplitFrom), c = v - i * chunks;
    const std::int32_t quanta = num_kb / p.split_quantum;
    const std::int32_t q0 = c * quanta / chunks, q1 = (c + 1) * quanta / chunks;
    tile.kb_begin = q0 * p.split_quantum;
    tile.kb_count = (q1 - q0) * p.split_quantum;
    tile.split = (i << 8) | (c << 4) | chunks;
  }

  // This CTA's place in its cluster (re-read per tile rather than held in the walking state).
  __device__ __forceinline__ static std::int32_t rank(const GroupedGemmParams& p) {
    return static_cast<std::int32_t>(blockIdx.x & static_cast<unsigned>(p.cluster - 1));  // (1 or 2)
  }

  // Contiguous: bands of p.band_units n-units (kGemmBandColumns by default); inside a band the
  // n-units vary fastest, so a wave of CTAs shares a few A blocks and one band of B.

  // Unit t of a contiguous schedule of n_units units per m-block in bands of band_units (band_tiles =
  // m-blocks x band_units): its m-block and its n-unit.
  __device__ __forceinline__ static void band_unit(std::int32_t t, std::int32_t n_units,
                                                   std::int32_t band_units, std::int32_t band_tiles,
                                                   float inv_band_tiles, float inv_band_units,
                                                   float inv_last_width, std::int32_t& m_block,
                                                   std::int32_t& n_unit) {
    const std::int32_t band = div_small(t, band_tiles, inv_band_tiles);
    const std::int32_t r = t - band * band_tiles;
    const std::int32_t first_n = band * band_units;
    const std::int32_t width = min(band_units, n_units - first_n);
    m_block = div_small(r, width, width == band_units ? inv_band_units : inv_last_width);
    n_unit = first_n + (r - m_block * width);
  }
  // Unit t of this launch's contiguous schedule.
  __device__ __forceinline__ void unit(const GroupedGemmParams& p, std::int32_t t, std::int32_t& m_block,
                                       std::int32_t& n_unit) const {
    band_unit(t, p.n_units, p.band_units, p.band_tiles, p.inv_band_tiles, p.inv_band_units, p.inv_last_width,
              m_block, n_unit);
  }

  // This lane's m_indices of the kBlockM rows from row0 (row0 + 32 i + lane; -1 past the rows).
  __device__ __forceinline__ static void load_ids(const GroupedGemmParams& p, std::int32_t row0,
                                                  std::int32_t (&ids)[kBlockM / 32]) {
    const int lane = static_cast<int>(threadIdx.x % 32);
#pragma unroll
    for (int i = 0; i < kBlockM / 32; ++i) {
      const std::int32_t row = row0 + i * 32 + lane;
      ids[i] = row < p.rows ? __ldg(p.m_indices + row) : -1;
    }
  }

  // Warp-collective: the group g of kBlockM rows' ids (their largest; a block holds rows of at most
  // one group), 1 + its last row, and its rows as 32-row words; false for padding only (or ids out of
  // range): nothing to do.
  __device__ __forceinline__ static bool group_rows(const GroupedGemmParams& p,
                                                    const std::int32_t (&ids)[kBlockM / 32], std::int32_t& g,
                                                    std::int32_t& last, std::uint32_t (&rows)[kBlockM / 32]) {
    const int lane = static_cast<int>(threadIdx.x % 32);
    g = -1;
#pragma unroll
    for (int i = 0; i < kBlockM / 32; ++i) g = max(g, ids[i]);
    g = __reduce_max_sync(0xffffffffu, g);
    if (g < 0 || g >= p.groups) return false;
    last = 0;
#pragma unroll
    for (int i = 0; i < kBlockM / 32; ++i) {
      if (ids[i] == g) last = i * 32 + lane + 1;
    }
    last = __reduce_max_sync(0xffffffffu, last);
#pragma unroll
    for (int i = 0; i < kBlockM / 32; ++i) rows[i] = __ballot_sync(0xffffffffu, ids[i] == g);
    return true;
  }

  __device__ __forceinline__ bool next_contiguous(GemmTile& tile, const GroupedGemmParams& p,
                                                  std::uint32_t (&rows)[kBlockM / 32], std::uint32_t plan) {
    std::int32_t t, v;
    while (take(p, plan, t, v)) {
      std::int32_t m_block, n_unit;
      unit(p, t, m_block, n_unit);
      const std::int32_t row0 = m_block * kBlockM;
      std::int32_t g, last, ids[kBlockM / 32];
      load_ids(p, row0, ids);
      if (!group_rows(p, ids, g, last, rows)) continue;
      tile = GemmTile{g, n_unit * p.cluster + rank(p), row0, 0, p.rows, 0, last};
      set_k_range(tile, p, plan, t, v);
      return true;
    }
    return false;
  }

  // Masked: only the valid m-blocks of each group are enumerated (group-major, then n-block,
  // then m-block; with split tiles m-block, then n-block), so skipped rows cost nothing and the CTAs
  // stay balanced.
  // Tile t (the CTA's tiles come in increasing order: the segments are walked forward only).
  __device__ bool next_masked(GemmTile& tile, const GroupedGemmParams& p, std::int32_t t) {
    if (!seek_segment(p, t)) return false;
    const std::int32_t r = t - seg_start_;
    // With split tiles a group's m-blocks go slowest (its n-units fastest): m-block fastest, a
    // group's full blocks and its cheaper split tail alternate, and with an even number of CTAs the
    // round-robin gives some CTAs only tails (bench/NOTES.md, session 31).
    const bool m_slowest = p.split_tiles != 0;
    const std::int32_t m_block = m_slowest ? r / p.n_units : r % seg_m_blocks_;
    const std::int32_t n_unit = m_slowest ? r - m_block * p.n_units : r / seg_m_blocks_;
    const std::int32_t seg_row0 = g_ * p.rows;
    tile = GemmTile{g_,
                    n_unit * p.cluster + rank(p),
                    seg_row0 + m_block * kBlockM,
                    seg_row0,
                    seg_row0 + seg_count_,
                    g_,
                    min(kBlockM, seg_count_ - m_block * kBlockM)};
    return true;
  }

  // v22: this launch computes a parent's tail tiles as pieces (64 x 128 launches only).
  __device__ __forceinline__ static bool pieces(const GroupedGemmParams& p) {
    if constexpr (kBlockM == 64 && kBlockN == 128) {
      return p.tail_pieces == kTailPieces;
    } else {
      return false;
    }
  }

  // v22's follower: this CTA's next piece of the parent's tail tiles (unit u: tail tile u / 4, piece
  // u % 4: rows 64 (u % 4 / 2) and columns 128 (u % 2) of it), the parent's 128 x 256 tiles enumerated
  // as its masked schedule does (group-major, then n-block, then m-block); pieces of no valid rows are
  // skipped.
  __device__ bool next_piece(GemmTile& tile, const GroupedGemmParams& p, std::uint32_t plan) {
    std::int32_t t, q;
    while (take_piece(p, plan, t, q)) {
      if (!seek_segment(p, t)) return false;
      const std::int32_t r = t - seg_start_;
      const std::int32_t m_block = r % seg_m_blocks_, n_unit = r / seg_m_blocks_;
      const std::int32_t first_row = m_block * 128 + 64 * (q / 2);
      if (first_row >= seg_count_) continue;  // an empty lower half
      const std::int32_t seg_row0 = g_ * p.rows;
      tile = GemmTile{g_,
                      2 * n_unit + q % 2,
                      seg_row0 + first_row,
                      seg_row0,
                      seg_row0 + seg_count_,
                      g_,
                      min(64, seg_count_ - first_row)};
      set_k_range(tile, p, plan, t, -1);  // (the whole of K)
      return true;
    }
    return false;
  }

  // v22's follower, contiguous: the parent's tail units (its tile order, 128-row m-blocks, 256-column
  // n-units) as pieces; a piece's group is its 64 rows' (the parent block's at most one), a piece of
  // padding rows only is skipped.
  __device__ bool next_contiguous_piece(GemmTile& tile, const GroupedGemmParams& p,
                                        std::uint32_t (&rows)[kBlockM / 32], std::uint32_t plan) {
    std::int32_t t, q;
    while (take_piece(p, plan, t, q)) {
      std::int32_t m_block, n_unit;
      band_unit(t, p.parent_n_units, p.parent_band_units, p.parent_band_tiles, p.inv_parent_band_tiles,
                p.inv_parent_band_units, p.inv_parent_last_width, m_block, n_unit);
      const std::int32_t row0 = m_block * 128 + 64 * (q / 2);
      std::int32_t g, last, ids[kBlockM / 32];
      load_ids(p, row0, ids);
      if (!group_rows(p, ids, g, last, rows)) continue;
      tile = GemmTile{g, 2 * n_unit + q % 2, row0, 0, p.rows, 0, last};
      set_k_range(tile, p, plan, t, -1);  // (the whole of K)
      return true;
    }
    return false;
  }

  // Masked: walks the segments forward to the group of tile t (t never below an earlier call's);
  // false past the last group.
  __device__ __forceinline__ bool seek_segment(const GroupedGemmParams& p, std::int32_t t) {
    while (g_ < p.groups && t >= seg_start_ + seg_tiles_) {
      seg_start_ += seg_tiles_;
      ++g_;
      if (g_ < p.groups) load_segment(p);
    }
    return g_ < p.groups;
  }

  // The segment of group g_: its rows, m-blocks and tiles (v22's follower: its parent's 128 x 256 ones).
  __device__ void load_segment(const GroupedGemmParams& p) {
    seg_count_ = min(max(__ldg(p.masked_m + g_), 0), p.rows);
    if (pieces(p)) {
      seg_m_blocks_ = (seg_count_ + 127) / 128;
      seg_tiles_ = seg_m_blocks_ * p.parent_n_units;
    } else {
      seg_m_blocks_ = (seg_count_ + kBlockM - 1) / kBlockM;
      seg_tiles_ = seg_m_blocks_ * p.n_units;
    }
  }

  std::int32_t u_;  // this CTA's next work unit
  std::int32_t g_ = 0, seg_start_ = 0, seg_tiles_ = 0, seg_count_ = 0, seg_m_blocks_ = 1;
};

// v13's tile ring (kTileSlots above) at shared address `base`: slot s's words at base +
// kTileSlotBytes s, then the slots' "full" barriers, then their "empty" ones. A slot holds what the readers
// need of a tile, derived by the writer (warp 3) so that the readers, at the edge of their 40 registers, hold
// no more than before: the words below, kMore 0 marking the end of the schedule. Every lane of a reading warp
// calls next().
class TileRing {
 public:
  // try_wait rounds before a consumer gives up on a slot (each suspends the thread up to a hardware
  // time limit, so this is far beyond the producers' 10-second watchdog).
  static constexpr std::uint32_t kRingSpinLimit = 1u << 30;

  enum Word : int {
    kNBlock,        // tile.n_block
    kRow0,          // tile.row0
    kBRow,          // B's first row: group * N + n_block * kBlockN
    kRowsUsed,      // tile.rows_used
    kSaBase,        // A-scale offset of the tile's first row (its K block 0)
    kSbBase,        // B-scale offset of the tile's first wave (its K block 0)
    kMore,          // 1: a tile; 0: the end
    kSplit,         // v21: tile.split
    kRows = 8,      // kBlockM / 32 words: the valid rows of each 32-row word (bit l: row 32 i + l)
    kKbBegin = 12,  // v21: tile.kb_begin, tile.kb_count
    kKbCount,
  };
  static_assert(kRows + 4 <= kKbBegin && (kKbCount + 1) * 4 <= kTileSlotBytes);

  __device__ static constexpr std::uint32_t full(std::uint32_t base, std::uint32_t slot) {
    return base + kTileSlotBytes * kTileSlots + 8u * slot;
  }
  __device__ static constexpr std::uint32_t empty(std::uint32_t base, std::uint32_t slot) {
    return base + (kTileSlotBytes + 8) * kTileSlots + 8u * slot;
  }

  __device__ explicit TileRing(std::uint32_t base) : base_(base) {}

  // Tiles read (written) so far.
  __device__ __forceinline__ std::uint32_t tiles_read() const { return count_; }

  // The reading end: words kFirst .. kFirst + kCount - 1 of the next tile, or false at the end; with
  // kKbRange also its K range (kKbBegin, kKbCount) in words[kCount], words[kCount + 1].
  template <int kFirst, int kCount, bool kKbRange = false>
  __device__ __forceinline__ bool next(std::int32_t (&words)[kCount + (kKbRange ? 2 : 0)]) {
    static_assert(kFirst >= 0 && kFirst + kCount <= kMore);
    const std::uint32_t slot = this->slot();
    ptx::mbar_wait(full(base_, slot), parity());
    const std::uint32_t at = words_at(slot);
#pragma unroll
    for (int i = 0; i < kCount; ++i) words[i] = ptx::ld_shared_s32(at + 4u * (kFirst + i));
    if constexpr (kKbRange) {
      words[kCount] = ptx::ld_shared_s32(at + 4u * kKbBegin);
      words[kCount + 1] = ptx::ld_shared_s32(at + 4u * kKbCount);
    }
    const bool more = ptx::ld_shared_s32(at + 4u * kMore) != 0;
    ptx::mbar_arrive(empty(base_, slot));  // (release: the reads above come first)
    ++count_;
    return more;
  }

  // The consumers' reading end: the tile's n-block, first row and rows used, and the valid rows of
  // 32-row words `word` and `word % 2` (a split tile's). With kHold (v21's split tail) also its K
  // blocks, and the slot stays taken until release_rows() after the tile (its split word is read there;
  // the writer, kTileSlots tiles ahead at most, needs it back only then).
  template <bool kHold>
  __device__ __forceinline__ bool next_rows(std::int32_t& n_block, std::int32_t& row0,
                                            std::int32_t& rows_used, std::uint32_t& rows,
                                            std::uint32_t& split_rows, std::uint32_t word,
                                            std::int32_t& kb_count) {
    const std::uint32_t slot = this->slot();
    // Bounded without a trap here (mbar_wait's watchdog, or a counter and a trap, made ptxas spill the
    // consumers' accumulators, 2.4 KB): past the bound the consumer stops as at the schedule's end,
    // and the producers' watchdogs, waiting on stages it never frees, fail the launch.
    if (!ptx::mbar_wait_rounds(full(base_, slot), parity(), kRingSpinLimit)) return false;
    const std::uint32_t at = words_at(slot);
    const uint4 head = ptx::ld_shared_v4(at);  // kNBlock, kRow0, kBRow, kRowsUsed
    const bool more = ptx::ld_shared_s32(at + 4u * kMore) != 0;
    n_block = static_cast<std::int32_t>(head.x);
    row0 = static_cast<std::int32_t>(head.y);
    rows_used = static_cast<std::int32_t>(head.w);
    rows = static_cast<std::uint32_t>(ptx::ld_shared_s32(at + 4u * (kRows + word)));
    split_rows = static_cast<std::uint32_t>(ptx::ld_shared_s32(at + 4u * (kRows + word % 2u)));
    if constexpr (kHold) {
      kb_count = ptx::ld_shared_s32(at + 4u * kKbCount);
    } else {
      ptx::mbar_arrive(empty(base_, slot));  // (release: the reads above come first)
    }
    ++count_;
    return more;
  }

  // The consumers' end of the tile next_rows() gave: its GemmTile::split word, and the slot back.
  __device__ __forceinline__ std::int32_t release_rows() {
    const std::uint32_t slot = (count_ - 1u) % kTileSlots;
    const std::int32_t split = ptx::ld_shared_s32(words_at(slot) + 4u * kSplit);
    ptx::mbar_arrive(empty(base_, slot));  // (release: the read above comes first)
    return split;
  }

  // The writing end (warp 3, every lane): walks the whole schedule, then writes the end.
  template <int kBlockM, int kBlockN>
  __device__ __forceinline__ void write_all(const GroupedGemmParams& p) {
    GemmScheduler<kBlockM, kBlockN> scheduler(p, plan(base_));
    const bool writer = threadIdx.x % 32 == 0;
    const std::int32_t num_kb = p.k / kGemmBlockK;
    for (;;) {
      GemmTile tile{};
      std::uint32_t rows[kBlockM / 32] = {};
      const bool more =
          scheduler.next_all_rows(tile, p, rows, plan(base_));  // before the slot is free: overlaps
      const std::uint32_t slot = this->slot();
      ptx::mbar_wait(empty(base_, slot), parity() ^ 1u);
      if (writer) {
        const std::uint32_t at = words_at(slot);
        // (Both at the unit's first K block.)
        const std::int32_t sa_base = tile.scale_group * p.sa_group_stride +
                                     (tile.row0 - tile.seg_row0) * p.sa_row_stride +
                                     tile.kb_begin * p.sa_kb_stride;
        const std::int32_t sb_base =
            (tile.group * (p.n / kGemmWaveN) + tile.n_block * (kBlockN / kGemmWaveN)) * num_kb +
            tile.kb_begin;
        ptx::st_shared_v4(at, static_cast<std::uint32_t>(tile.n_block), static_cast<std::uint32_t>(tile.row0),
                          static_cast<std::uint32_t>(tile.group * p.n + tile.n_block * kBlockN),
                          static_cast<std::uint32_t>(tile.rows_used));
        ptx::st_shared_v4(at + 16u, static_cast<std::uint32_t>(sa_base), static_cast<std::uint32_t>(sb_base),
                          more ? 1u : 0u, static_cast<std::uint32_t>(tile.split));
        ptx::st_shared_u32(at + 4u * kKbBegin, static_cast<std::uint32_t>(tile.kb_begin));
        ptx::st_shared_u32(at + 4u * kKbCount, static_cast<std::uint32_t>(tile.kb_count));
#pragma unroll
        for (int i = 0; i < kBlockM / 32; ++i) ptx::st_shared_u32(at + 4u * (kRows + i), rows[i]);
        ptx::mbar_arrive(full(base_, slot));  // (release: the stores above come first)
      }
      __syncwarp();
      ++count_;
      if (!more) return;
    }
  }

 private:
  // The slot of tile count_, the parity of its "full" phase, and its words.
  __device__ __forceinline__ std::uint32_t slot() const {
    return count_ % kTileSlots;
  }
  __device__ __forceinline__ std::uint32_t parity() const {
    return (count_ / kTileSlots) & 1u;
  }
  __device__ __forceinline__ std::uint32_t words_at(std::uint32_t slot) const {
    return base_ + kTileSlotBytes * slot;
  }
  // v21: the writer's split plan (GemmScheduler::plan_split), after the ring and epi_done_bar1 (the
  // kernel's shared-memory map).
  __device__ static constexpr std::uint32_t plan(std::uint32_t base) {
    return base + kTileRingBytes + 8;
  }

  std::uint32_t base_;
  std::uint32_t count_ = 0;  // tiles read (written): slot count_ % kTileSlots, its parity the next bit
};

// The trace's sums: [0] loop cycles, [1] loop ns, [2] K blocks, [3] CTAs, [4] launch spans (first
// CTA entry to last loop exit, ns), [5] launches, [6] this launch's earliest entry, [7] its latest exit;
// v12's hand-off (borrowing launches), in cycles of the TMA warp's and store warp's lane 0: [8] the
// producer's waits for epi_done, [9] its waits for empty stages, [10] the store warp's time from a
// tile staged to its epi_done, [11] the store warp's waits for a staged tile, [12] tiles it stored;
// the traced consumer thread's [13] time from its K loop's end to the tile staged (v12) or stored,
// [14] its tiles. (Stamps around the consumers' first full-barrier waits of a tile made ptxas spill.)
// The tile turn, the TMA warp's lane 0: [15] its cycles in the tile ring's next() after each tile (the
// last, failing call included), [16] its waits for K block 0's empty stage. (Per tile: [14] counts the
// tiles.)
// v21's split tail, the traced thread's warp: [17] chunks of split tiles it computed, [18] the tiles
// it summed (its warp arrived last), [19] its cycles from the K loop's end to its arrival counted
// (the partial written), [20] its cycles summing (last arrivals).
inline constexpr int kFp8TraceWords = 21;
__device__ unsigned long long g_fp8_gemm_trace[kFp8TraceWords] = {0, 0, 0, 0, 0, 0, ~0ull};

// A trace stamp straight into its sum (a start added negated, the end as is: no register held across
// the timed code).
__device__ __forceinline__ void trace_stamp(unsigned long long* sum, bool start) {
  const auto c = static_cast<unsigned long long>(clock64());
  atomicAdd(sum, start ? 0ull - c : c);
}

// Named barrier of the two consumer warpgroups before v12's epilogue writes into the stages that
// either one's last wgmma read.
inline constexpr std::uint32_t kEpilogueBarrier = 3;
// Named barriers passing the wgmma turn between the two consumer warpgroups (ping-pong): consumer c
// waits on kTurnBarrier + c before issuing a wave and arrives on the other's after issuing it.
inline constexpr std::uint32_t kTurnBarrier = 1;
static_assert((kTurnBarrier ^ 3u) == kTurnBarrier + 1);

// v21: one consumer warp's part of a split tile's chunk (GroupedGemmParams::split_quantum): its
// accumulators (kWaves x 64 per lane) go to the chunk's partial as kWaves x 32 float2 per lane in lane
// order (coalesced; only this function reads them back; float2, not float4: 16-byte stores want the
// accumulators in aligned quads, and ptxas then gave up the promotion's bank-friendly pairs), then to
// the tile's counter of this warp. The warp that arrives last sums every chunk's partial into acc in
// chunk order (the sum does not depend on which chunk came last), resets the counter for the next
// launch and returns true; the others return false. (The classic fence pattern: every lane's stores,
// its fence, then one lane's atomic; the last one's fence before its loads, which bypass L1.)
template <int kWaves, int kWarps>
__device__ __forceinline__ bool split_tile_reduce(float (&acc)[kWaves][64], const GroupedGemmParams& p,
                                                  std::int32_t split, int warp_index, int lane,
                                                  unsigned long long* trace) {
  const std::int32_t tail_tile = split >> 8, chunk = (split >> 4) & 15, chunks = split & 15;
  const auto stamp = [&](int word, bool start) {
    if (trace != nullptr) trace_stamp(trace + word, start);
  };
  stamp(0, true);
  constexpr int kVecs = kWaves * 32;  // float2 per lane
  const auto partial = [&](std::int32_t c) {
    return reinterpret_cast<float2*>(p.split_partials) +
           (static_cast<std::int64_t>((tail_tile * chunks + c) * kWarps + warp_index) * kVecs) * 32 + lane;
  };
  float2* mine = partial(chunk);
#pragma unroll
  for (int v = 0; v < kVecs; ++v)
    __stcg(mine + 32 * v, make_float2(acc[v / 32][2 * (v % 32)], acc[v / 32][2 * (v % 32) + 1]));
  __threadfence();
  __syncwarp();
  std::int32_t* counter = p.split_counters + tail_tile * kSplitCountersPerTile + warp_index;
  std::int32_t arrived = 0;
  if (lane == 0) arrived = atomicAdd(counter, 1);
  arrived = __shfl_sync(0xffffffffu, arrived, 0);
  stamp(0, false);
  if (arrived != chunks - 1) return false;
  stamp(1, true);
  if (lane == 0) *counter = 0;  // every chunk has arrived: the next launch starts from 0
  __threadfence();
  // Chunk 0 straight into acc (all its loads in flight at once), then kBatch float2 of each further
  // chunk at a time, in the registers the K loop's partial held: the sum is latency-bound.
  {
    const float2* from = partial(0);
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const float2 x = __ldcg(from + 32 * v);
      acc[v / 32][2 * (v % 32)] = x.x;
      acc[v / 32][2 * (v % 32) + 1] = x.y;
    }
  }
  constexpr int kBatch = 32;
  static_assert(kVecs % kBatch == 0);
#pragma unroll
  for (int v0 = 0; v0 < kVecs; v0 += kBatch) {
#pragma unroll 1
    for (std::int32_t c = 1; c < chunks; ++c) {
      const float2* from = partial(c);
      float2 x[kBatch];
#pragma unroll
      for (int b = 0; b < kBatch; ++b) x[b] = __ldcg(from + 32 * (v0 + b));
#pragma unroll
      for (int b = 0; b < kBatch; ++b) {
        float* a = &acc[(v0 + b) / 32][2 * ((v0 + b) % 32)];
        a[0] += x[b].x;
        a[1] += x[b].y;
      }
    }
  }
  stamp(1, false);
  return true;
}

// kSplitTail: the consumers' side of v21's split tail (a unit's K range, the chunk's sum); the launcher
// picks the instantiation without it wherever no tail can split, so that those launches run the
// consumers' code as before v21 (whose extra per-tile work measured ~0.5-1% on short-K rows).
// kZeroPadding: v29's zero padding rows (128 x 256 tiles; GroupedGemmParams::zero_padding_rows), in
// instances of their own (with and without the split tail): its code in the kernel cost the rows with few
// partial tiles 0.7-0.8% even where it did nothing (8 x 4096, 4 x 8192 at K = 7168, bench/NOTES.md
// session 43), so those launch the kernels without it.
// kWave0 (v31, session 45): v12 with only wave 0 staged (in smem_epi, memory of its own) and
// stored by the store warp; the consumers store wave 1 themselves after the hand-over, so no pipeline stage
// is borrowed and the producer never waits for the store (in an instance of its own: the same code in
// the zero-padding instance moved its promotion into 211 one-parity FFMAs).
template <int kBlockM, int kBlockN, bool kSplitTail, bool kZeroPadding = false, bool kWave0 = false>
__global__ void __launch_bounds__(GemmTraits<kBlockM, kBlockN>::kThreads, 1)
    fp8_grouped_gemm_kernel(const __grid_constant__ CUtensorMap tma_a,
                            const __grid_constant__ CUtensorMap tma_a_part,
                            const __grid_constant__ CUtensorMap tma_b,
                            const __grid_constant__ CUtensorMap tma_d,
                            const __grid_constant__ CUtensorMap tma_d_tile,
                            const __grid_constant__ GroupedGemmParams p) {
  using Traits = GemmTraits<kBlockM, kBlockN>;
  constexpr int kStages = Traits::kStages;
  constexpr int kWaves = Traits::kWaves;
  // v29's zero padding rows: 128 x 256 tiles only (64 x 128 tiles, memory-bound, measured 0.4-1% slower
  // with them; in 128 x 128 tiles the code moved ptxas's register allocation of the promotion into 205
  // one-parity FFMAs; bench/NOTES.md session 43). With the split tail too (a chunk starts at stage 0, and
  // the scale warp zeros the stages a unit first uses, whole tile or chunk).
  static_assert(!kZeroPadding || (kBlockM == 128 && kBlockN == 256));
  static_assert(!kWave0 || (kBlockM == 128 && kBlockN == 256 && !kSplitTail));

  extern __shared__ __align__(1024) std::uint8_t smem_raw[];
  // (The swizzled tiles need 1024-byte alignment; Traits::kSmemBytes has no slack for more.)
  const std::uint32_t smem_base = ptx::smem_addr(smem_raw);
  if (threadIdx.x == 0 && (smem_base & 1023u) != 0) __trap();
  const std::uint32_t smem_a = smem_base;                                      // kStages x [kBlockM x 128]
  const std::uint32_t smem_b = smem_a + kStages * Traits::kABytes;             // kStages x [kBlockN x 128]
  const std::uint32_t smem_epi = smem_b + kStages * Traits::kBBytes;           // Traits::kEpiBytes (v18)
  const std::uint32_t smem_scales = smem_epi + Traits::kEpiBytes;              // kStages x kScaleFloats f32
  const std::uint32_t full_bar = smem_scales + kStages * Traits::kScaleBytes;  // kStages x 8 bytes
  const std::uint32_t empty_bar = full_bar + kStages * 8;                      // kStages x 8 bytes
  // v18: epi_done_bar once the store warp has read wave 0's boxes (the consumers stage the next tile's
  // there after it), epi_done_bar1 once it has read wave 1's (the producer loads the last stage after it).
  const std::uint32_t epi_done_bar = empty_bar + kStages * 8;      // 8 bytes (v12)
  const std::uint32_t staged_bar = epi_done_bar + 8;               // 8 bytes (v12)
  const std::uint32_t smem_row_masks = staged_bar + 8;             // 8 warps x 4 bytes (v12)
  const std::uint32_t tile_ring = smem_row_masks + 32;             // kTileRingBytes (v13)
  static_assert(Traits::kScaleBytes % 16 == 0);                    // (the ring's slots 16-aligned)
  const std::uint32_t epi_done_bar1 = tile_ring + kTileRingBytes;  // 8 bytes (v14)
  // v21: then the tile walker's split plan (16 bytes with v30's stride; TileRing::plan), within kTailBytes.
  static_assert(48 + kTileRingBytes + 8 + 16 <= Traits::kTailBytes);

  const int warp = static_cast<int>(threadIdx.x / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int32_t num_kb = p.k / kGemmBlockK;
  const int stages = p.stages;  // in use, <= kStages
  const bool clustered = p.cluster > 1;
  const std::uint32_t rank = static_cast<std::uint32_t>(blockIdx.x) % static_cast<std::uint32_t>(p.cluster);
  // The trace goes straight into its global sums (a stamp kept in registers across the K loop
  // costs the loop registers): a start stamp is added negated, the end stamp as is.
  const bool trace = (p.ablation & kTraceLoop) != 0 && threadIdx.x == 128;
  if (trace) atomicMin(g_fp8_gemm_trace + 6, static_cast<unsigned long long>(ptx::global_timer_ns()));
  // (kTraceCtas: warp 0's lane 0 stamps the entry here, the rest after its loads.)
  if ((p.ablation & kTraceCtas) != 0 && threadIdx.x == 0 && blockIdx.x < cuda::kGemmTraceMaxCtas)
    g_fp8_cta_trace[3 * blockIdx.x] = ptx::global_timer_ns();
  // v22: the tail's follower may be scheduled at once (its CTAs take the SMs this grid's CTAs leave).
  if (p.tail_pieces == kTailWhole) ptx::launch_dependents();

  // Whether v12 runs (see below; read from the parameters where needed, not held in a register).
  const auto borrowing = [&] {
    return kWaves == 2 && kStages >= 4 && p.borrow_epilogue != 0 && p.cluster == 1 && p.pingpong == 0 &&
           p.skew == 0 && p.split_tiles == 0 && p.vector_epilogue != 0 && (p.ablation & ~kTraceBits) == 0 &&
           p.unroll != 0 && p.stages == kStages && num_kb % kStages == 0;
  };
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(full_bar + 8 * s, 1 + 32);  // TMA arrive (+ bytes), 32 copy arrives
      // Every lane of every consumer warp of every CTA of the cluster (ptx::mbar_arrive_warp).
      ptx::mbar_init(empty_bar + 8 * s, Traits::kConsumers * 4 * p.cluster * ptx::kWarpArrivals);
    }
    ptx::mbar_init(epi_done_bar, 1);   // the store warp's lane 0: wave 0's boxes and the row masks read
    ptx::mbar_init(epi_done_bar1, 1);  // the same: wave 1's, the borrowed last stage
    ptx::mbar_init(staged_bar, Traits::kConsumers * 4 * ptx::kWarpArrivals);  // every consumer lane
    for (int s = 0; s < kTileSlots; ++s) {
      const auto slot = static_cast<std::uint32_t>(s);
      ptx::mbar_init(TileRing::full(tile_ring, slot), 1);  // warp 3's lane 0
      // Every lane of the TMA and scale warps, of the store warp when it runs, and of every consumer warp.
      ptx::mbar_init(TileRing::empty(tile_ring, slot),
                     ((borrowing() ? 3 : 2) + Traits::kConsumers * 4) * ptx::kWarpArrivals);
    }
    ptx::fence_barrier_init();
  }
  if (threadIdx.x == 32) {
    ptx::prefetch_tensormap(&tma_a);
    ptx::prefetch_tensormap(&tma_a_part);
    ptx::prefetch_tensormap(&tma_b);
    if (p.borrow_epilogue != 0) {
      ptx::prefetch_tensormap(&tma_d);
      ptx::prefetch_tensormap(&tma_d_tile);
    }
  }
  // The peer CTA's TMA and arrives reach this CTA's barriers only once they are initialised.
  if (clustered) {
    ptx::cluster_sync();
  } else {
    __syncthreads();
  }

  // v12 (p.borrow_epilogue, the default; 128 x 256 tiles, the unrolled loop, no cluster): the epilogue needs
  // 64 KB of shared memory to hand the output to TMA stores without waiting for them, and giving the
  // pipeline's memory to it for good costs a stage (8%, bench/NOTES.md session 15). So it borrows the
  // B half of the tile's last stage (32 KB; every tile starts at stage 0 in the unrolled loop, so it is
  // stage kStages - 1) for wave 1 and has 32 KB of its own (smem_epi, v18) for wave 0. After the K loop
  // each consumer warp whose 16 rows are all valid writes its 16 rows x 256 columns (bf16) there by
  // stmatrix in the 128-byte swizzle (v17, v19's layout at the staging), warps with invalid rows store
  // their valid rows themselves (padding rows stay untouched); each warp writes its mask, and every
  // consumer lane arrives on staged_bar; the consumers go on with the next tile at once. The producer
  // warpgroup's otherwise idle warp 2 (the store warp) then stores the tile with TMA tensor stores
  // (one per staged warp and wave, or one per wave: tile_store) and arrives on epi_done_bar1 once wave 1's
  // have read shared memory (the producer loads the next tile's K block kStages - 1 after it) and on
  // epi_done_bar once wave 0's have (the consumers stage the next tile's wave 0 after it). The next
  // tile's first kStages - 1 K blocks never wait for the store (bench/NOTES.md, sessions 36-37).
  // borrowing() (above) includes the unrolled loop's condition: every tile starts at stage 0.
  if (warp < 4) {
    // ------------------------------------------------------------ producer warpgroup
    // Warp 0 issues the TMA loads, warp 1 copies the scales (warp 2 stores, v12); warp 3 walks the
    // schedule and hands them its tiles (v13's tile ring).
    if constexpr (Traits::kConsumers > 1) ptx::setmaxnreg_dec<Traits::kProducerRegs>();
    TileRing ring(tile_ring);
    PipeState pipe;
    const auto stamp = [](int word, bool start) { trace_stamp(g_fp8_gemm_trace + word, start); };
    if ((p.ablation & kAblatePipe) != 0) {
      // timing ablation: no producer work
    } else if (warp == 3) {
      ring.write_all<kBlockM, kBlockN>(p);
      // v22's follower ends only after its parent: a later kernel of the stream that waits for the
      // follower alone (a programmatic dependent launch) then finds the parent's rows written too.
      if (p.tail_pieces == kTailPieces) ptx::grid_dependency_wait();
    } else if (warp == 0) {
      // v12: from the second tile on, the borrowed stages' loads wait for the consumers' epi_done.
      bool after_first = false;
      std::uint32_t epi_phase = 0;
      const bool trace_hand_off = (p.ablation & kTraceLoop) != 0 && lane == 0;
      std::int32_t w[kSplitTail ? 5 : 3];  // TileRing::kRow0, kBRow, kRowsUsed; the K range (split tail)
      while (ring.next<TileRing::kRow0, 3, kSplitTail>(w)) {
        if (trace_hand_off && after_first) stamp(15, false);
        const std::int32_t row0 = w[0], b_row = w[1], rows_used = w[2];
        // (The inner index keeps the whole kernel's w[3] in bounds. The K range as out-parameters of
        // next() compiled to a renumbering of the whole 128 x 256 kernel's registers,
        // unmeasured: kept.)
        const std::int32_t kb_begin = kSplitTail ? w[kSplitTail ? 3 : 0] : 0;
        const std::int32_t kb_count = kSplitTail ? w[kSplitTail ? 4 : 0] : num_kb;
        // Tiles with few valid rows (decode) load only the first a_small_rows rows of A: the rest
        // of the A tile in shared memory is stale, and feeds only rows that are never stored.
        // (Never in a cluster, where tma_a_part is this CTA's 64-row half of A.)
        // v29: or, with p.zero_padding_rows and at least one whole 32-row box of padding rows, only A's
        // 32-row boxes that hold valid rows; the rest of the stage's A rows are zeros (the scale warp's
        // bulk copy, below): the padding rows' products then cost the tensor cores less energy, and a card
        // whose clock drops under tensor work runs faster (bench/NOTES.md session 43). TMA's own zero fill
        // (boxes out of A's bounds) made those tiles ~1.5x slower, measured.
        // v35 (64-row tiles): A's a_small_rows-row boxes that hold valid rows (16 rows by default), the rest
        // stale as above: a tile of 33-48 rows loads 48 rows instead of 64, one of 1-16 rows 16 instead
        // of 32.
        // v37 (zero-padding tiles): their boxes are a_small_rows too (32, or 8 / 16 rows where the host
        // chose v35's row boxes for them).
        constexpr bool kRowBoxes = kBlockM == 64;
        const std::int32_t box_rows = kRowBoxes || kZeroPadding ? p.a_small_rows : 32;
        const std::int32_t valid_boxes =
            kRowBoxes
                ? (box_rows > 0 && rows_used <= kBlockM - box_rows ? (rows_used + box_rows - 1) / box_rows
                                                                   : 0)
                : (kZeroPadding && p.zero_padding_rows != 0 && rows_used <= kBlockM - box_rows
                       ? (rows_used + box_rows - 1) / box_rows
                       : 0);
        const bool small = valid_boxes > 0 || rows_used <= p.a_small_rows;
        const CUtensorMap* map_a = small ? &tma_a_part : &tma_a;
        const std::uint32_t bytes =
            small
                ? (valid_boxes > 0 ? valid_boxes * box_rows : p.a_small_rows) * kGemmBlockK + Traits::kBBytes
                : Traits::kStageBytes;
        const bool gate = !kWave0 && after_first && borrowing() && p.borrow_epilogue != kBorrowNoGate;
        after_first = true;
        for (std::int32_t kb = 0; kb < kb_count; ++kb) {
          if (lane == 0) {
            const std::uint32_t full = full_bar + 8 * pipe.stage;
            const long long c0 = trace_hand_off ? clock64() : 0;
            ptx::mbar_wait(empty_bar + 8 * pipe.stage, pipe.phase ^ 1u);
            const long long c1 = trace_hand_off ? clock64() : 0;
            if (trace_hand_off) {
              atomicAdd(g_fp8_gemm_trace + 9, static_cast<unsigned long long>(c1 - c0));
              if (kb == 0) atomicAdd(g_fp8_gemm_trace + 16, static_cast<unsigned long long>(c1 - c0));
            }
            // v18: the borrowed last stage waits for wave 1's boxes read out of it (epi_done_bar1).
            // (Its A half, never borrowed, loaded before the wait made ptxas spill.)
            if (gate && kb == kStages - 1) {
              ptx::mbar_wait(epi_done_bar1, epi_phase);
              epi_phase ^= 1u;
              if (trace_hand_off)
                atomicAdd(g_fp8_gemm_trace + 8, static_cast<unsigned long long>(clock64() - c1));
            }
            if ((p.ablation & kAblateLoads) != 0) {
              ptx::mbar_arrive(full);
            } else {
              // Both halves of A (this CTA's and the peer's multicast) count toward this barrier.
              ptx::mbar_arrive_expect_tx(full, bytes);
              const std::int32_t k0 = (kb_begin + kb) * kGemmBlockK;
              if (clustered) {
                ptx::tma_load_2d_multicast(smem_a + pipe.stage * Traits::kABytes + rank * Traits::kAHalfBytes,
                                           &tma_a_part, full, k0,
                                           row0 + static_cast<std::int32_t>(rank) * (kBlockM / 2), 0x3);
              } else {
                ptx::tma_load_2d(smem_a + pipe.stage * Traits::kABytes, map_a, full, k0, row0);
                for (int box = 1; box < valid_boxes; ++box)
                  ptx::tma_load_2d(smem_a + pipe.stage * Traits::kABytes + box * box_rows * kGemmBlockK,
                                   map_a, full, k0, row0 + box * box_rows);
              }
              ptx::tma_load_2d(smem_b + pipe.stage * Traits::kBBytes, &tma_b, full, k0, b_row);
            }
          }
          pipe.advance(stages);
        }
        if (trace_hand_off) stamp(15, true);
        __syncwarp();
      }
      if (trace_hand_off && after_first) stamp(15, false);
      // (kTraceCtas: the condition re-derived here; held across the loop it cost the split-tail instances a
      // spill.)
      if ((p.ablation & kTraceCtas) != 0 && lane == 0 && blockIdx.x < cuda::kGemmTraceMaxCtas) {
        g_fp8_cta_trace[3 * blockIdx.x + 1] = ptx::global_timer_ns();
        // Every stage's next fill would wait for its release: the consumers are done with them all.
        for (int s = 0; s < stages; ++s) {
          ptx::mbar_wait(empty_bar + 8 * pipe.stage, pipe.phase ^ 1u);
          pipe.advance(stages);
        }
        g_fp8_cta_trace[3 * blockIdx.x + 2] = ptx::global_timer_ns();
      }
    } else if (warp == 1) {
      // TileRing::kRowsUsed, kSaBase, kSbBase (at the unit's first K block); the K range (split tail)
      std::int32_t w[kSplitTail ? 5 : 3];
      while (ring.next<TileRing::kRowsUsed, 3, kSplitTail>(w)) {
        const std::int32_t kb_count = kSplitTail ? w[kSplitTail ? 4 : 0] : num_kb;
        // This lane's scale sources (32-bit element offsets; the launcher checks they fit): A rows
        // 32 i + lane of the tile, B wave `lane`.
        const std::int32_t rows_used = w[0];
        std::int32_t sa_off = w[1] + lane * p.sa_row_stride;
        const std::int32_t sb_off = w[2] + lane * num_kb;
        // v29: the bytes of A's rows past the tile's valid boxes (a_small_rows each, v37; the TMA warp
        // loads only those), zeros in each stage the tile uses from its first use on (the tile's loads leave
        // them).
        // v37c: a split tile's wgmma read only its first 64 rows, so its zeros end there (zero_padding_rows
        // 2: all 128, an experiment).
        const std::int32_t box_rows = p.a_small_rows;
        const std::int32_t zero_end =
            split_tile<kBlockM, kBlockN>(p, rows_used) && p.zero_padding_rows == 1 ? 64 : kBlockM;
        const std::uint32_t zero_bytes =
            kZeroPadding && p.zero_padding_rows != 0 && rows_used <= kBlockM - box_rows
                ? (zero_end - (rows_used + box_rows - 1) / box_rows * box_rows) * kGemmBlockK
                : 0u;
        for (std::int32_t kb = 0; kb < kb_count; ++kb) {
          ptx::mbar_wait(empty_bar + 8 * pipe.stage, pipe.phase ^ 1u);
          if (zero_bytes != 0 && kb < stages && lane == 0) {
            // (Counted on "full" before this warp's arrivals, so the stage cannot complete without them.)
            ptx::mbar_expect_tx(full_bar + 8 * pipe.stage, zero_bytes);
            ptx::bulk_load(smem_a + pipe.stage * Traits::kABytes + zero_end * kGemmBlockK - zero_bytes,
                           g_zero_a_rows, zero_bytes, full_bar + 8 * pipe.stage);
          }
          const std::uint32_t scales = smem_scales + pipe.stage * Traits::kScaleBytes + 4 * lane;
          if (kWaves == 1 || (p.ablation & kAblateScales) == 0) {
#pragma unroll
            for (int i = 0; i < kBlockM / 32; ++i) {
              // Rows past the tile's last valid one (padding, rows past masked_m) have no scale:
              // their quantizer skips them, and no consumer reads their slot.
              if (i * 32 + lane < rows_used)
                ptx::cp_async_4(scales + 4 * 32 * i, p.sa + sa_off + i * 32 * p.sa_row_stride);
            }
            if (lane < kWaves) ptx::cp_async_4(scales + 4 * kBlockM, p.sb + sb_off + kb);
          }
          ptx::cp_async_mbar_arrive_noinc(full_bar + 8 * pipe.stage);  // once this lane's copies land
          sa_off += p.sa_kb_stride;
          pipe.advance(stages);
        }
      }
    } else if (warp == 2 && borrowing()) {
      // v12's store warp (see borrowing()): per tile, once the consumers staged it, lane 0 stores it
      // (below), then arrives on epi_done_bar1 and epi_done_bar as the stores have read shared memory.
      std::uint32_t phase = 0;
      const bool trace_hand_off = (p.ablation & kTraceLoop) != 0 && lane == 0;
      std::int32_t t[2];  // TileRing::kNBlock, kRow0
      while (ring.next<TileRing::kNBlock, 2>(t)) {
        const long long c0 = trace_hand_off ? clock64() : 0;
        ptx::mbar_wait(staged_bar, phase);
        phase ^= 1u;
        const long long c1 = trace_hand_off ? clock64() : 0;
        // The staged tile, per wave w (128 columns), is [consumer warp cw][half h][16 rows][128 bytes] in
        // the 128-byte swizzle (v19; half h: columns 64 h .. of the wave); v18: wave 1 in the last stage's
        // B half, wave 0 in smem_epi right after it. Each TMA store costs the store warp ~150-200 cycles
        // whatever its size (v12's 16 per tile took ~3 400 cycles, on the next tile's critical path), so
        // a wave whose warps all staged leaves in one store (tile_store), else one store per warp that
        // staged (warps with invalid rows stored themselves), with the 4D row-group maps; with the 2D
        // map (row_group_maps 0) one per warp and half. Wave 1 first (bulk group 0): the producer's
        // load of the next tile's last stage waits for it (epi_done_bar1); wave 0 (group 1), before the
        // consumers stage the next tile's (epi_done_bar).
        static_assert(kWaves != 2 || Traits::kEpiBytes == 2 * kBlockM * 128);
        // Lane 0 alone reads the row masks (it alone stores): a read by another lane would be ordered
        // before the consumers' next mask only through __syncwarp and lane 0's arrive, which racecheck
        // does not follow (session 56); every lane arriving instead timed 0.6% slower on the contiguous
        // rows (H100, session 57).
        bool whole = false;
        if (lane == 0) {
          whole = p.tile_store != 0;
#pragma unroll
          for (int cw = 0; cw < Traits::kConsumers * 4; ++cw)
            whole = whole && ptx::ld_shared_s32(smem_row_masks + 4 * static_cast<std::uint32_t>(cw)) != 0;
        }
#pragma unroll 1
        for (int w = kWaves - 1; w >= 0; --w) {
          if (lane == 0 && (w == 0 || !kWave0)) {
            const std::uint32_t wave = smem_b + static_cast<std::uint32_t>((kStages - 1) * Traits::kBBytes) +
                                       static_cast<std::uint32_t>((1 - w) * kBlockM * 256);
            const std::int32_t col_block = t[0] * (kBlockN / 64) + 2 * w;
            if (whole) {
              ptx::tma_store_4d(&tma_d_tile, wave, col_block, t[1] / 16);
            } else {
#pragma unroll 1
              for (int cw = 0; cw < Traits::kConsumers * 4; ++cw) {
                if (ptx::ld_shared_s32(smem_row_masks + 4 * static_cast<std::uint32_t>(cw)) == 0) continue;
                const std::uint32_t rows = wave + static_cast<std::uint32_t>(cw * 4096);
                if (p.row_group_maps != 0) {
                  ptx::tma_store_4d(&tma_d, rows, col_block, t[1] / 16 + cw);
                } else {
                  ptx::tma_store_2d(&tma_d, rows, 128 * col_block, t[1] + 16 * cw);
                  ptx::tma_store_2d(&tma_d, rows + 2048u, 128 * col_block + 128, t[1] + 16 * cw);
                }
              }
            }
          }
          ptx::bulk_commit();  // (an empty group where this lane stored nothing)
        }
        ptx::bulk_wait_read<kWaves - 1>();  // group 0 (wave 1, the last stage) has read
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(epi_done_bar1);
        ptx::bulk_wait_read<0>();  // and group 1 (wave 0, smem_epi)
        __syncwarp();
        if (lane == 0) ptx::mbar_arrive(epi_done_bar);
        if (trace_hand_off) {
          atomicAdd(g_fp8_gemm_trace + 10, static_cast<unsigned long long>(clock64() - c1));
          atomicAdd(g_fp8_gemm_trace + 11, static_cast<unsigned long long>(c1 - c0));
          atomicAdd(g_fp8_gemm_trace + 12, 1ull);
        }
      }
      ptx::bulk_wait<0>();  // this lane's stores written before the kernel ends
    }
    // Neither CTA of a cluster leaves while the other may still arrive on its barriers (the last
    // remote "empty" arrives) or multicast into its shared memory. (In both branches: no code
    // follows the if/else whose roles set different register counts.)
    if (clustered) ptx::cluster_sync();
  } else {
    // ------------------------------------------------------------ consumer warpgroups
    if constexpr (Traits::kConsumers > 1) ptx::setmaxnreg_inc<Traits::kConsumerRegs>();
    const int consumer = warp / 4 - 1;  // which 64 rows of the tile
    const int warp_in_group = warp % 4;
    const int row_in_tile = consumer * 64 + warp_in_group * 16 + lane / 4;  // and + 8
    const int col_in_tile = (lane % 4) * 2;
    // Ping-pong between the two consumer warpgroups (never under the math ablation, which issues
    // no wgmma). Consumer 1 hands the first turn to consumer 0.
    const bool ordered =
        Traits::kConsumers == 2 && p.pingpong != 0 && (p.ablation & (kAblateMath | kAblateOneWait)) == 0;
    // The K loop unrolled over the stages (options.unrolled_k_loop): all stages in use and a whole
    // number of rounds of them per tile, so that every tile starts at stage 0.
    const bool unrolled = p.unroll != 0 && stages == kStages && num_kb % kStages == 0;
    // Skew: the same turn passing for the first wave of each tile only (strict alternation, as
    // ping-pong: no barrier phase can complete without both warpgroups).
    const bool skewed = Traits::kConsumers == 2 && !ordered && p.skew != 0 &&
                        (p.ablation & (kAblateMath | kAblateOneWait)) == 0;
    // v7's K loop (single-wave tiles: two partials, each K block's promotion under the next block's
    // wgmma); not with the turn passing or the ablations (the trace aside).
    const bool two_partials =
        kWaves == 1 && p.two_partials != 0 && !ordered && !skewed && (p.ablation & ~kTraceBits) == 0;
    // v11 (p.split_tiles; 128 x 256 tiles, no cluster): a tile with at most 64 valid rows (in the
    // contiguous layout a group's last block: ~a third of the blocks at ~128 rows per group) runs as
    // 64 x 256 with its columns split: both consumers take the tile's first 64 rows of A and consumer
    // c the 128 columns of wave c, one wave per K block each (the main loop's k_block with kSplit).
    // Without it consumer 1 computes 64 padding rows and consumer 0 two waves per K block. (v7's two
    // partials here made ptxas spill 0.2-2 KB in every arrangement tried.)
    constexpr bool kSplittable = kWaves == 2 && Traits::kConsumers == 2;
    const std::uint32_t my_turn =
        __shfl_sync(0xffffffffu, kTurnBarrier + static_cast<std::uint32_t>(consumer), 0);
    const std::uint32_t their_turn = my_turn ^ 3u;  // kTurnBarrier + (consumer ^ 1): barriers 1 and 2
    if ((ordered || skewed) && consumer == 1) ptx::named_bar_arrive(their_turn, 256);

    // What the K loop addresses, computed once and broadcast from lane 0 so that the compiler sees
    // warp-uniform values (uniform registers): with 192 of the 232 registers in accumulators it
    // otherwise re-derives the shared-memory window, the barrier addresses and each wgmma
    // descriptor (~10 instructions per wgmma) on every K block, between the waves (bench/NOTES.md, v5).
    const std::uint32_t u_smem = __shfl_sync(0xffffffffu, smem_base, 0);
    const std::uint32_t u_consumer = __shfl_sync(0xffffffffu, static_cast<std::uint32_t>(consumer), 0);
    const std::uint32_t u_full = u_smem + (full_bar - smem_base);
    const std::uint32_t u_empty = u_smem + (empty_bar - smem_base);
    // (v12's epi_done_bar, staged_bar and row masks sit a compile-time distance after the empty
    // barriers, no registers of their own.)
    constexpr std::uint32_t kEpiDoneFromEmpty = kStages * 8;
    constexpr std::uint32_t kStagedFromEmpty = kEpiDoneFromEmpty + 8;
    const std::uint32_t u_scales = u_smem + (smem_scales - smem_base);
    // The peer CTA's empty barriers (cluster of two), or 0.
    const std::uint32_t u_peer_empty =
        clustered ? __shfl_sync(0xffffffffu, ptx::mapa_cluster(empty_bar, rank ^ 1u), 0) : 0u;
    // Descriptors (low words) of stage 0: this consumer's 64 rows of A, the B tile.
    const std::uint32_t a_desc0 = ptx::wgmma_desc_sw128_lo(u_smem + u_consumer * 64 * kGemmBlockK);
    const std::uint32_t b_desc0 = ptx::wgmma_desc_sw128_lo(u_smem + (smem_b - smem_base));
    constexpr std::uint32_t kADescStage = Traits::kABytes >> 4;
    constexpr std::uint32_t kBDescStage = Traits::kBBytes >> 4;
    constexpr std::uint32_t kBDescWave = (kGemmWaveN * kGemmBlockK) >> 4;
    constexpr std::uint32_t kDescK = 32 >> 4;  // 32 bytes of K per wgmma

    // v13: the tiles from warp 3's ring (the slot's words read here; the tile's 32-row word of this
    // thread's rows, split tiles included, picked by the ring reader once rows_used is known).
    TileRing ring(__shfl_sync(0xffffffffu, tile_ring, 0));
    struct {
      std::int32_t n_block, row0, rows_used;
      std::int32_t kb_count;  // v21: this unit's K blocks
    } tile;

    PipeState pipe;
    float acc[kWaves][64];
    float part[1][64];  // one per-K-block partial (a second one does not fit: see bench/NOTES.md)

    // This warp's rows (row_in_tile and row_in_tile + 8, row_in_tile % 16 < 8) lie in one 32-row word.
    std::uint32_t tile_rows = 0;
    if (trace) {
      atomicAdd(g_fp8_gemm_trace + 0, 0ull - static_cast<unsigned long long>(clock64()));
      atomicAdd(g_fp8_gemm_trace + 1, 0ull - static_cast<unsigned long long>(ptx::global_timer_ns()));
    }
    std::uint32_t split_rows = 0;
    while (ring.next_rows<kSplitTail>(tile.n_block, tile.row0, tile.rows_used, tile_rows, split_rows,
                                      static_cast<std::uint32_t>(row_in_tile / 32), tile.kb_count)) {
      if constexpr (!kSplitTail) tile.kb_count = num_kb;
      const bool split = split_tile<kBlockM, kBlockN>(p, tile.rows_used);
      if (split) tile_rows = split_rows;
      // This thread's rows (my_row and my_row + 8): in a split tile consumer 1's warps take those of
      // consumer 0's.
      const int my_row = split ? row_in_tile - consumer * 64 : row_in_tile;
      // (The trace counts K blocks of kWaves waves: a split tile's consumer 0 runs half as many waves.)
      if (trace)
        atomicAdd(g_fp8_gemm_trace + 2,
                  static_cast<unsigned long long>(split ? tile.kb_count / 2 : tile.kb_count));
      const std::int32_t row_a = tile.row0 + my_row;
      const std::int32_t row_b = row_a + 8;
      // (my_row's word: the ring's; both layouts' valid rows are in it.)
      // (Cleared after the K loop for a chunk whose warp does not store: v21.)
      bool valid_a = ((tile_rows >> (my_row % 32)) & 1u) != 0;
      bool valid_b = ((tile_rows >> ((my_row + 8) % 32)) & 1u) != 0;
      // Per tile, after the split tile's branch (which zeroes its own): the wgmma asm reads part, so
      // a value from before the loop would keep these registers live through the epilogue and the
      // scheduler, and one from before that branch would be live into it.
      const auto zero_accumulators = [&] {
#pragma unroll
        for (int i = 0; i < 64; ++i) part[0][i] = 0.0f;
#pragma unroll
        for (int w = 0; w < kWaves; ++w) {
#pragma unroll
          for (int i = 0; i < 64; ++i) acc[w][i] = 0.0f;
        }
      };

      // This warp is done with a stage: it may be refilled (in every CTA of the cluster: the peer's
      // half of A lives here too).
      const auto free_stage = [&](int stage) {
        if ((p.ablation & kAblatePipe) != 0) return;
        ptx::mbar_arrive_warp(u_empty + 8 * stage);  // each lane after its reads of the stage (its scales)
        if (u_peer_empty != 0) ptx::mbar_arrive_remote(u_peer_empty + 8 * stage);
      };

      // v7 (p.two_partials, single-wave tiles): K block kb's 4 wgmma go into part2[kb % 2] and are
      // issued before block kb - 1's are waited for (wait_group 1), so that block kb - 1's promotion
      // and stage release run under block kb's wgmma (the probe keeps the tensor pipe at its peak
      // this way, where one partial loses ~24%: bench/NOTES.md). Every K block ends with the loop's
      // exit test, each exit draining its own in-flight partial, and the block count is hidden from
      // the compiler: otherwise ptxas cannot tell which partial is in flight where paths merge and
      // serializes every wgmma (C7514; session 10).
      const auto two_partial_k_loop = [&] {
        if constexpr (kWaves == 1) {
          float part2[2][64];
          struct Scales {
            float a, b, w;
          };
          const auto load_scales = [&](int stage) {
            const std::uint32_t scales = u_scales + stage * Traits::kScaleBytes;
            Scales sc;
            sc.a = valid_a ? ptx::ld_shared_f32(scales + 4 * row_in_tile) : 0.0f;
            sc.b = valid_b ? ptx::ld_shared_f32(scales + 4 * (row_in_tile + 8)) : 0.0f;
            sc.w = ptx::ld_shared_f32(scales + 4 * kBlockM);
            return sc;
          };
          const auto issue = [&](auto slot_v, int stage) {
            constexpr int kSlot = decltype(slot_v)::value;
            const std::uint32_t a_desc = a_desc0 + static_cast<std::uint32_t>(stage) * kADescStage;
            const std::uint32_t b_desc = b_desc0 + static_cast<std::uint32_t>(stage) * kBDescStage;
#pragma unroll
            for (int i = 0; i < 64; ++i) ptx::fence_operand(part2[kSlot][i]);
            ptx::wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kGemmBlockK / 32; ++kk) {
              ptx::wgmma_m64n128k32_e4m3(part2[kSlot], ptx::wgmma_desc_from_lo(a_desc + kk * kDescK),
                                         ptx::wgmma_desc_from_lo(b_desc + kk * kDescK), kk > 0);
            }
            ptx::wgmma_commit();
          };
          const auto retire = [&](auto slot_v, const Scales& sc) {
            constexpr int kSlot = decltype(slot_v)::value;
#pragma unroll
            for (int i = 0; i < 64; ++i) ptx::fence_operand(part2[kSlot][i]);
            promote(acc[0], part2[kSlot], sc.a, sc.b, sc.w);
#pragma unroll
            for (int i = 0; i < 64; ++i) ptx::fence_operand(part2[kSlot][i]);
          };
          // K blocks after the first: an opaque count (see above).
          std::int32_t blocks_left = tile.kb_count - 1;
          ptx::opaque(blocks_left);
          ptx::mbar_wait(u_full + 8 * pipe.stage, pipe.phase);
          Scales prev = load_scales(pipe.stage);
          issue(std::integral_constant<int, 0>{}, pipe.stage);
          int prev_stage = pipe.stage;
          pipe.advance(stages);
          if (blocks_left == 0) {
            ptx::wgmma_wait<0>();
            retire(std::integral_constant<int, 0>{}, prev);
            free_stage(prev_stage);
            return;
          }
          // One K block into part2[kSlot], retiring the block before it (in the other slot); true
          // once it was the tile's last (both drained).
          const auto step = [&](auto slot_v) {
            constexpr int kSlot = decltype(slot_v)::value;
            using Other = std::integral_constant<int, 1 - kSlot>;
            ptx::mbar_wait(u_full + 8 * pipe.stage, pipe.phase);
            const Scales cur = load_scales(pipe.stage);
            issue(slot_v, pipe.stage);
            ptx::wgmma_wait<1>();
            retire(Other{}, prev);
            free_stage(prev_stage);
            prev = cur;
            prev_stage = pipe.stage;
            pipe.advance(stages);
            if (--blocks_left != 0) return false;
            ptx::wgmma_wait<0>();
            retire(slot_v, prev);
            free_stage(prev_stage);
            return true;
          };
          for (;;) {
            if (step(std::integral_constant<int, 1>{})) break;
            if (step(std::integral_constant<int, 0>{})) break;
          }
        }
      };

      // The main loop waits for the next K block's stage while the current block's last wave runs
      // (v9): that "full" wait then leaves the turnaround between the wave's completion and the
      // next block's first wgmma (bench/NOTES.md, session 11). (Reading the next block's scales
      // there too needs 4 registers more, and ptxas then spills ~1.8 KB.)
      const bool wait_full = (p.ablation & (kAblateFullWait | kAblatePipe)) == 0;
      // One K block in stage `stage_v` (a run-time int, or a std::integral_constant: the unrolled
      // loop, where every barrier, scale and descriptor address is a uniform base plus an
      // immediate); next_stage / next_phase: the following K block's (the main loop's lookahead).
      // The timing ablations (kAblateOneWait, kAblatePromote) get their own copies, so the default
      // loop's code is what it is without them.
      // kSplit (split_v): a split tile's block, one wave (this consumer's) into acc[0].
      const auto k_block = [&](auto one_wait, auto no_promote, auto split_v, auto stage_v, std::int32_t kb,
                               std::uint32_t phase, int next_stage, std::uint32_t next_phase) {
        constexpr bool kOneWait = decltype(one_wait)::value;
        constexpr bool kNoPromote = decltype(no_promote)::value;
        constexpr bool kSplit = decltype(split_v)::value;
        constexpr bool kLookahead = !kOneWait && !kNoPromote;
        constexpr int kBlockWaves = kSplit ? 1 : kWaves;
        const int stage = stage_v;
        // (In the main loop the previous block waited for this one, except for a tile's first.)
        if ((!kLookahead || kb == 0) && wait_full) ptx::mbar_wait(u_full + 8 * stage, phase);
        // This K block's scales, read before the stage is given back.
        const std::uint32_t scales = u_scales + stage * Traits::kScaleBytes;
        // (my_row, re-derived: one register fewer across the loop.)
        const int scale_row = kSplit ? row_in_tile - static_cast<int>(u_consumer) * 64 : row_in_tile;
        const float s_a = valid_a ? ptx::ld_shared_f32(scales + 4 * scale_row) : 0.0f;
        const float s_b = valid_b ? ptx::ld_shared_f32(scales + 4 * (scale_row + 8)) : 0.0f;
        float s_w[kBlockWaves];
#pragma unroll
        for (int w = 0; w < kBlockWaves; ++w)
          s_w[w] = ptx::ld_shared_f32(scales + 4 * (kBlockM + (kSplit ? static_cast<int>(u_consumer) : w)));

        // (A split tile's: the tile's first 64 rows of A, this consumer's wave of B; derived here
        // rather than kept in two registers of their own.)
        const std::uint32_t a_desc = (kSplit ? a_desc0 - u_consumer * ((64 * kGemmBlockK) >> 4) : a_desc0) +
                                     static_cast<std::uint32_t>(stage) * kADescStage;
        const std::uint32_t b_desc = (kSplit ? b_desc0 + u_consumer * kBDescWave : b_desc0) +
                                     static_cast<std::uint32_t>(stage) * kBDescStage;
#pragma unroll
        for (int w = 0; w < kBlockWaves; ++w) {
          const bool turn = ordered || (skewed && kb == 0 && w == 0);
          if (turn) ptx::named_bar_sync(my_turn, 256);
          if (!kOneWait || w == 0) {
            fence_all(part[0]);
            ptx::wgmma_fence();
          }
#pragma unroll
          for (int kk = 0; kk < kGemmBlockK / 32; ++kk) {
            ptx::wgmma_m64n128k32_e4m3(part[0], ptx::wgmma_desc_from_lo(a_desc + kk * kDescK),
                                       ptx::wgmma_desc_from_lo(b_desc + w * kBDescWave + kk * kDescK),
                                       kk > 0 || (kOneWait && w > 0));
          }
          if (kOneWait && w < kBlockWaves - 1) continue;
          ptx::wgmma_commit();
          if (turn) ptx::named_bar_arrive(their_turn, 256);
          if constexpr (kLookahead) {
            if (w == kBlockWaves - 1 && kb + 1 < tile.kb_count && wait_full)
              ptx::mbar_wait(u_full + 8 * next_stage, next_phase);
          }
          ptx::wgmma_wait<0>();
          fence_all(part[0]);
          // After the last wave this warp is done with the stage; the fences keep the promotion
          // after the arrive, so the producers get the stage back early.
          if (w == kBlockWaves - 1) free_stage(stage);
          if (w == kBlockWaves - 1 && (p.ablation & kAblateSpin) != 0) {
            const long long spin0 = clock64();
            while (clock64() - spin0 < 200) {
            }
          }
          fence_all(part[0]);
          if constexpr (kNoPromote) {
            // One FFMA per wave, not 64: the wave's wgmma results must stay live, or ptxas drops the
            // wgmma itself (it did, before this line: the SASS held a dummy HGMMA.64x8x16 with RZ).
            acc[w][0] = fmaf(s_a, part[0][0], acc[w][0]);
          } else {
            promote(acc[w], part[0], s_a, s_b, s_w[w]);
          }
        }
      };
      const auto k_loop = [&](auto one_wait, auto no_promote, auto split_v) {
        if constexpr (!decltype(one_wait)::value && !decltype(no_promote)::value) {
          if (unrolled) {
            // Every tile starts at stage 0 here (num_kb, and a split tile's chunk, is a multiple of the
            // stages).
            for (std::int32_t kb0 = 0; kb0 < tile.kb_count; kb0 += kStages) {
              for_each_index(std::make_integer_sequence<int, kStages>{}, [&](auto s) {
                constexpr int kS = decltype(s)::value;
                k_block(one_wait, no_promote, split_v, s, kb0 + kS, pipe.phase, (kS + 1) % kStages,
                        kS + 1 == kStages ? pipe.phase ^ 1u : pipe.phase);
              });
              pipe.phase ^= 1u;
            }
            return;
          }
        }
        for (std::int32_t kb = 0; kb < tile.kb_count; ++kb) {
          PipeState next = pipe;
          next.advance(stages);
          k_block(one_wait, no_promote, split_v, pipe.stage, kb, pipe.phase, next.stage, next.phase);
          pipe = next;
        }
      };
      // Epilogue: bf16 to global memory, valid rows only: one wave's accumulators v to the tile's 128
      // columns of wave col_block.
      const auto store_wave = [&](const float(&v)[64], int col_block) {
        store_wave_bf16<false>(v, 1.0f, p.d + tile.n_block * kBlockN + col_block * kGemmWaveN, row_a, row_b,
                               valid_a, valid_b, p.n, lane);
      };
      if constexpr (kSplittable) {
        // A split tile, start to end in a branch of its own (where its loop and epilogue merged with
        // the full tile's, ptxas spilled ~2 KB).
        if (split) {
#pragma unroll
          for (int i = 0; i < 64; ++i) part[0][i] = 0.0f;
#pragma unroll
          for (int i = 0; i < 64; ++i) acc[0][i] = 0.0f;
          k_loop(std::false_type{}, std::false_type{}, std::true_type{});
          if constexpr (kSplitTail) ring.release_rows();  // (never a chunk: no split tail with split tiles)
          unswap_pairs(acc[0]);
          store_wave(acc[0], static_cast<int>(u_consumer));
          continue;
        }
      }
      zero_accumulators();
      if (two_partials) {
        two_partial_k_loop();
      } else if ((p.ablation & kAblateMath) != 0) {
        for (std::int32_t kb = 0; kb < tile.kb_count; ++kb) {
          ptx::mbar_wait(u_full + 8 * pipe.stage, pipe.phase);
          free_stage(pipe.stage);
          pipe.advance(stages);
        }
      } else {
        using False = std::integral_constant<bool, false>;
        using True = std::integral_constant<bool, true>;
        // (One wait per K block is what a single-wave tile does anyway.)
        const int timing = p.ablation & ((kWaves > 1 ? kAblateOneWait : 0) | kAblatePromote);
        if (timing == 0) {
          k_loop(False{}, False{}, False{});
        } else if (timing == kAblatePromote) {
          k_loop(False{}, True{}, False{});
        } else if constexpr (kWaves > 1) {
          if (timing == kAblateOneWait) {
            k_loop(True{}, False{}, False{});
          } else {
            k_loop(True{}, True{}, False{});
          }
        }
      }

      // v21: a chunk of a split tile. Its partial goes out; the warp that arrives last on its counter
      // sums the chunks' partials and stores the tile's rows, the others store nothing (and stage
      // nothing: the store warp skips warps whose mask is 0). (On the pair-swapped slots, before
      // unswap_pairs: the partials are in slot order, pairs as the promotion keeps them.)
      if (const std::int32_t split_now = kSplitTail ? ring.release_rows() : -1; split_now >= 0) {
        const bool last = split_tile_reduce<kWaves, Traits::kConsumers * 4>(
            acc, p, split_now, warp - 4, lane, trace ? g_fp8_gemm_trace + 19 : nullptr);
        if (trace) {
          atomicAdd(g_fp8_gemm_trace + 17, 1ull);
          if (last) atomicAdd(g_fp8_gemm_trace + 18, 1ull);
        }
        if (!last) {
          valid_a = false;
          valid_b = false;
        }
      }
      // Epilogue: bf16 to global memory, valid rows only (store_wave above).
#pragma unroll
      for (int w = 0; w < kWaves; ++w) unswap_pairs(acc[w]);
      if (trace) atomicAdd(g_fp8_gemm_trace + 13, 0ull - static_cast<unsigned long long>(clock64()));
      if ((p.ablation & kAblateEpilogue) != 0) {
        // timing ablation: no stores
      } else if (borrowing()) {
        // v12 (see borrowing()): both consumers' last wgmma, which read the borrowed stages, are
        // complete before either writes there; then this warp's 16 rows x 256 columns into its two
        // [16 rows x 256 bytes] boxes (one per wave) and its row mask (bit r: row r of the warp; lane
        // 4 (r % 8) held it, as row_a for r < 8) for the store warp.
        // v33: wave 0 first (its boxes are this warp's own), the meeting before wave 1.
        const bool wave0_first = !kWave0 && p.borrow_epilogue == kBorrowWave0First;
        if constexpr (!kWave0) {
          if (!wave0_first) ptx::named_bar_sync(kEpilogueBarrier, 256);
        }
        // v17: the tile in [16 rows x 128 bytes] boxes (v19: per wave [warp][half][16 rows][128 bytes],
        // half h: 64 columns; the waves where the store warp's comment says) in the 128-byte swizzle
        // (16-byte chunk c of row r at r * 128 + 16 (c ^ r % 8)), written by stmatrix straight from the
        // accumulator layout: no quad transposes and no bank conflicts (v12's 256-byte rows took two
        // wavefronts per 16-byte store). Per stmatrix: chunks j, j + 1 of rows 0-7 and 8-15 of this warp;
        // lane 8 i + r addresses row r + 8 (i % 2) of chunk j + i / 2. A warp with invalid rows (a group's
        // end) stores its valid rows itself and stages nothing (copying them out of the swizzle spilled the
        // store warp).
        const bool whole_warp = __all_sync(0xffffffffu, valid_a && valid_b);
        // v31 (kWave0): only wave 0 is staged; wave 1 leaves from registers after the hand-over (below).
        constexpr int kStagedWaves = kWave0 ? 1 : kWaves;
        if (whole_warp) {
          // v18: wave 0's boxes (smem_epi) are free once the store warp has read the previous tile's
          // (epi_done_bar's phase of that tile; the ring has counted this tile: parity count & 1, which
          // passes at once on the first tile). Bounded as the ring's reads (the producers' watchdogs
          // fail the launch first).
          ptx::mbar_wait_rounds(u_empty + kEpiDoneFromEmpty, ring.tiles_read() & 1u,
                                TileRing::kRingSpinLimit);
          // (The lane's address re-derived at each stmatrix: held across them it cost a spill.)
          const auto chunk_pair = [&](int w, int jj) {
            const std::uint32_t here = ptx::lane_id_here();
            const std::uint32_t rr = here & 7u;
            const std::uint32_t warp_rows =
                u_smem + (smem_b - smem_base) + (kStages - 1) * static_cast<std::uint32_t>(Traits::kBBytes) +
                (u_consumer * 64u + static_cast<std::uint32_t>(warp_in_group) * 16u) * 256u;
            return warp_rows + (rr + 8u * ((here >> 3) & 1u)) * 128u +
                   static_cast<std::uint32_t>((1 - w) * (kBlockM * 256) + (jj / 4) * 2048) +
                   (static_cast<std::uint32_t>(32 * (jj % 4)) ^ (16u * (((here >> 4) & 1u) ^ rr)));
          };
#pragma unroll
          for (int w = 0; w < kStagedWaves; ++w) {
            if (w == 1 && wave0_first) ptx::named_bar_sync(kEpilogueBarrier, 256);
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
              const int j = 2 * jj;
              ptx::stmatrix_x4(chunk_pair(w, jj), pack_bf16x2(acc[w][4 * j + 0], acc[w][4 * j + 1]),
                               pack_bf16x2(acc[w][4 * j + 2], acc[w][4 * j + 3]),
                               pack_bf16x2(acc[w][4 * j + 4], acc[w][4 * j + 5]),
                               pack_bf16x2(acc[w][4 * j + 6], acc[w][4 * j + 7]));
            }
          }
        } else {
          if (wave0_first) ptx::named_bar_sync(kEpilogueBarrier, 256);
#pragma unroll
          for (int w = 0; w < kStagedWaves; ++w) store_wave(acc[w], w);
          // v31: a warp that stages nothing waits too, before its row mask: with no borrowed stage the
          // producer's gate no longer orders the mask after the store warp's reads of the previous tile's.
          if constexpr (kWave0)
            ptx::mbar_wait_rounds(u_empty + kEpiDoneFromEmpty, ring.tiles_read() & 1u,
                                  TileRing::kRingSpinLimit);
        }
        if (lane == 0)
          ptx::st_shared_u32(u_empty + kStagedFromEmpty + 8 + 4 * static_cast<std::uint32_t>(warp - 4),
                             whole_warp ? 1u : 0u);
        ptx::fence_proxy_async_shared();  // this lane's writes, before the store warp's TMA reads them
        ptx::mbar_arrive_warp(u_empty + kStagedFromEmpty);  // (release: the mask and the boxes)
        if constexpr (kWave0) store_wave(acc[1], 1);  // (after the hand-over: the store warp starts first)
      } else if (p.vector_epilogue != 0) {
#pragma unroll
        for (int w = 0; w < kWaves; ++w) store_wave(acc[w], w);
      } else {
#pragma unroll
        for (int w = 0; w < kWaves; ++w) {
          __nv_bfloat16* d_col = p.d + tile.n_block * kBlockN + w * kGemmWaveN + col_in_tile;
          if (valid_a) {
            auto* out = reinterpret_cast<std::uint32_t*>(d_col + static_cast<std::int64_t>(row_a) * p.n);
#pragma unroll
            for (int j = 0; j < 16; ++j) out[4 * j] = pack_bf16x2(acc[w][4 * j + 0], acc[w][4 * j + 1]);
          }
          if (valid_b) {
            auto* out = reinterpret_cast<std::uint32_t*>(d_col + static_cast<std::int64_t>(row_b) * p.n);
#pragma unroll
            for (int j = 0; j < 16; ++j) out[4 * j] = pack_bf16x2(acc[w][4 * j + 2], acc[w][4 * j + 3]);
          }
        }
      }
      if (trace) {
        atomicAdd(g_fp8_gemm_trace + 13, static_cast<unsigned long long>(clock64()));
        atomicAdd(g_fp8_gemm_trace + 14, 1ull);
      }
    }
    if (trace) {
      const auto c1 = static_cast<unsigned long long>(clock64());
      const auto n1 = static_cast<unsigned long long>(ptx::global_timer_ns());
      unsigned long long* t = g_fp8_gemm_trace;
      atomicAdd(t + 0, c1);
      atomicAdd(t + 1, n1);
      atomicMax(t + 7, n1);
      __threadfence();
      // The launch's last CTA closes its span (CTAs of a launch finish before the next one starts).
      if ((atomicAdd(t + 3, 1ull) + 1) % gridDim.x == 0) {
        __threadfence();
        atomicAdd(t + 4, atomicAdd(t + 7, 0ull) - atomicAdd(t + 6, 0ull));
        atomicAdd(t + 5, 1ull);
        atomicExch(t + 6, ~0ull);
        atomicExch(t + 7, 0ull);
      }
    }
    // Consumer 1's last hand-over is consumer 0's to take: every bar.arrive meets its bar.sync.
    if ((ordered || skewed) && consumer == 0) ptx::named_bar_sync(my_turn, 256);
    if (clustered) ptx::cluster_sync();
  }
}

}  // namespace epmoe::kernels
