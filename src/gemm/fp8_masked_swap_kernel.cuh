// FP8 block-scaled grouped GEMM, masked layout, with swapped operands (device code; host launcher in
// fp8_grouped_gemm.cu, API in epmoe/cuda/grouped_gemm.hpp: GroupedGemmOptions::swap_ab).
//
//   D^T[n, m] = Σ_kb sb[g, n/128, kb] · sa[g, m, kb] · Σ_{k in kb} B[g, n, k] · A[g, m, k]
//
// Why (bench/NOTES.md, session 40, v23): in the row-major kernel a group's tokens are the wgmma M
// dimension, in 64-row steps per consumer warpgroup, so a group of 134-250 rows computes 256 rows, and
// the padding costs whole waves. Here the weights are the wgmma M (64 rows per consumer, 128 per tile)
// and a group's tokens the wgmma N, in one wave of 16 .. 176 tokens, two of 96 .. 120 or three of 88
// (swap_waves): the work follows the valid rows to within 16 per wave.
// Status (bench/NOTES.md, sessions 41-42): correct and bit-identical to the row-major kernel, but 5.6-12.1%
// slower than it on every masked anchor row, so off by default (GroupedGemmOptions::swap_ab). Where the
// time goes (session 42's ablations): on decode, the scale copies' round trip (a stage freed, the scale
// warp's cp.async issued, landed, "full" complete: ~4 400 cycles) over only 4 stages (the row-major
// decode tile has 8); on groups of 134-250 rows, the promotion (16% of the time with loads, 33% without;
// the row-major kernel's ~10%), which neither ping-pong turns nor two partials per K block recovered.
//
// One persistent CTA per SM, tiles (group g, 256-token chunk c, 128-row weight block nb) dealt from a
// segment table of (group, chunk) pairs that warp 3 builds in shared memory at the start (by descending
// cost, then weight block; SwapScheduler's snake order over rounds). Every role reads the same table:
//   - warp 0 (lane 0): per K block, waits for a free stage and TMA-loads the weights [128 x 128 of K]
//     and the chunk's token rows [waves x width x 128], in 32-row boxes (128-byte swizzle, K-major);
//   - warp 1: copies the K block's token scales (one per valid token) and the weight block's scale
//     into the stage with cp.async, arriving on the stage's "full" barrier as they land;
//   - warpgroups 1 and 2 (the consumers, 64 weight rows each): per K block and wave, four wgmma
//     m64nN_wk32 into a partial, wait, promote acc += (sa[token] sb) · partial (one scale per column
//     pair, pair-swapped slots as gemm_common.cuh's promote()), free the stage after the last
//     wave; after the last K block, bf16 stores of the valid tokens, transposed back to D[m, n]: two
//     neighbouring weight rows (lanes l and l ^ 4) make one 4-byte store per token.
// A token past the chunk's valid ones (padding of the last wave) only ever reaches its own column
// of D^T, which is never stored: stale shared memory or another group's rows cannot leak into D.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

#include <cuda.h>
#include <cuda_bf16.h>

#include "cuda/ptx_hopper.cuh"
#include "gemm/gemm_common.cuh"

namespace epmoe::kernels {

inline constexpr int kSwapWeightRows = 128;  // weight rows per tile (two consumers x the wgmma M of 64)
inline constexpr int kSwapChunk = 256;       // tokens per tile, at most
inline constexpr int kSwapTokenBox = 32;     // rows per TMA box of tokens
// Token rows per stage: the widest chunk's waves (3 x 88), in whole boxes.
inline constexpr int kSwapTokenRows = 288;
// The swapped kernel's own timing ablations (its experiment instance only), on bits whose row-major
// meanings (one wait per K block, the consumer spin) do not apply to it: the promotion with one scale for
// every column (no per-column scale loads or multiplies), and consumer 1 idle (it waits and frees only).
inline constexpr int kSwapAblateScalarPromote = kAblateOneWait;
inline constexpr int kSwapAblateOneConsumer = kAblateSpin;

struct SwapGemmTraits {
  static constexpr int kThreads = 384;  // the producer warpgroup and two consumers
  static constexpr int kTokenBytes = kSwapTokenRows * kGemmBlockK;    // 36 KB per stage
  static constexpr int kWeightBytes = kSwapWeightRows * kGemmBlockK;  // 16 KB per stage
  // Per stage: the chunk's token scales (a slot per token row), then the weight block's (padded to 16
  // bytes).
  static constexpr int kScaleFloats = kSwapTokenRows + 4;
  static constexpr int kScaleBytes = kScaleFloats * 4;
  static constexpr int kPerStage = kTokenBytes + kWeightBytes + kScaleBytes + 16;  // + full, empty
  static constexpr int kParkBytes = 8 * 32;       // per consumer warp: SwapScheduler::park
  static constexpr int kSegmentBytes = 9 * 1024;  // SwapSegments::kBytes, checked below
  static constexpr int kStages = std::min(6, (kGemmSmemBudget - kParkBytes - kSegmentBytes) / kPerStage);
  static constexpr int kSmemBytes = kStages * kPerStage + kParkBytes + kSegmentBytes;
  // Offsets in shared memory: the stages' tokens, weights, scales, full and empty barriers, the park.
  static constexpr std::uint32_t kWeightOffset = kStages * kTokenBytes;
  static constexpr std::uint32_t kScaleOffset = kWeightOffset + kStages * kWeightBytes;
  static constexpr std::uint32_t kFullOffset = kScaleOffset + kStages * kScaleBytes;
  static constexpr std::uint32_t kEmptyOffset = kFullOffset + kStages * 8;
  static constexpr std::uint32_t kParkOffset = kEmptyOffset + kStages * 8;
  static constexpr std::uint32_t kSegmentOffset = kParkOffset + kParkBytes;
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
};

struct SwapGemmParams {
  const float* sa;  // A scales: sa[g * sa_group_stride + row * sa_row_stride + kb * sa_kb_stride]
  std::int32_t sa_group_stride, sa_row_stride, sa_kb_stride;
  const float* sb;               // [G, N/128, K/128]
  const std::int32_t* masked_m;  // [G]
  __nv_bfloat16* d;              // [G, M_max, N]
  std::int32_t m_max, n, k, groups;
  std::int32_t stages;    // in use, 1..SwapGemmTraits::kStages
  std::int32_t balanced;  // 1: segments by descending cost, snake order (SwapScheduler); 0: group order
  // Timing ablations (output garbage; GroupedGemmOptions::ablation's bits): kAblateLoads (2) no TMA loads,
  // kAblateEpilogue (16) no output stores.
  std::int32_t ablation;
};

// The waves of a chunk of `tokens` (1..kSwapChunk) tokens: one wave up to 176 tokens, two up to 240,
// three of 88 above; the width a multiple of 16 (two waves: at most 120, three: 88). One wave as wide as
// the registers allow (one wgmma wait per K block instead of two; measured level with two waves of 80-96,
// bench/NOTES.md session 41). The widest shapes are what the consumers' 232 registers hold: two waves of
// 128 tokens (192 accumulators) made ptxas spill beside the other shapes.
struct SwapWaves {
  std::int32_t count, width;
};
__host__ __device__ constexpr SwapWaves swap_waves(std::int32_t tokens) {
  if (tokens <= 176) return {1, (tokens + 15) / 16 * 16};
  if (tokens <= 240) return {2, std::min<std::int32_t>(((tokens + 1) / 2 + 15) / 16 * 16, 120)};
  return {3, 88};
}
static_assert(swap_waves(1).width == 16 && swap_waves(128).width == 128 && swap_waves(176).count == 1 &&
              swap_waves(176).width == 176 && swap_waves(177).count == 2 && swap_waves(177).width == 96 &&
              swap_waves(192).width == 96 && swap_waves(224).width == 112 && swap_waves(225).width == 120 &&
              swap_waves(240).width == 120 && swap_waves(241).count == 3 &&
              3 * swap_waves(256).width >= 256 && 3 * 88 <= kSwapTokenRows);

struct SwapTile {
  std::int32_t group, chunk, n_block, tokens;  // tokens of the chunk, 1..kSwapChunk
};

// The schedule's segments: one per (group, 256-token chunk) with tokens, at most kSwapSegmentsMax per
// launch (the host checks G x ceil(M_max / 256)); each segment has N / 128 tiles (its weight blocks).
// Built once per CTA into shared memory (build_segments), identically in every CTA.
inline constexpr int kSwapSegmentsMax = 1024;
// Segment cost classes (the chunk's computed tokens / 8: 2 .. 33).
inline constexpr int kSwapCostClasses = 34;

// The shared-memory segment table at `base`: the segment count, kSwapCostClasses counters, then per
// segment its group and (chunk << 9 | tokens).
struct SwapSegments {
  static constexpr std::uint32_t kCount = 0, kClasses = 16, kGroups = kClasses + 4 * 48;
  static constexpr std::uint32_t kChunks = kGroups + 4 * kSwapSegmentsMax;
  static constexpr std::uint32_t kBytes = kChunks + 4 * kSwapSegmentsMax;
  static_assert(kSwapCostClasses <= 48);
};
static_assert(SwapSegments::kBytes <= SwapGemmTraits::kSegmentBytes);

// The chunk's cost class: its computed tokens (all waves) / 8.
__device__ __forceinline__ std::int32_t swap_cost_class(std::int32_t tokens) {
  const SwapWaves w = swap_waves(tokens);
  return w.count * w.width / 8;
}

// Warp-collective (one warp, before the roles start): the segment table at `base`, in descending cost
// class with p.balanced (so that the snake order below deals the costliest tiles first and the cheap
// ones last, where they even out the CTAs' totals), else in group order; within a class in a fixed
// order (batches of 32 groups, chunk by chunk, group by group), the same in every CTA.
__device__ void build_segments(const SwapGemmParams& p, std::uint32_t base, int lane) {
  for (int c = lane; c < kSwapCostClasses; c += 32)
    ptx::st_shared_u32(base + SwapSegments::kClasses + 4 * c, 0);
  __syncwarp();
  // Pass 0 counts the segments per class; pass 1 places them.
  for (int pass = 0; pass < 2; ++pass) {
    for (std::int32_t g0 = 0; g0 < p.groups; g0 += 32) {
      const std::int32_t g = g0 + lane;
      const std::int32_t tokens = g < p.groups ? min(max(__ldg(p.masked_m + g), 0), p.m_max) : 0;
      const std::int32_t chunks = (tokens + kSwapChunk - 1) / kSwapChunk;
      const std::int32_t most = __reduce_max_sync(0xffffffffu, static_cast<std::uint32_t>(chunks));
      for (std::int32_t c = 0; c < most; ++c) {
        const bool active = c < chunks;
        const std::int32_t chunk_tokens = active ? min(tokens - c * kSwapChunk, kSwapChunk) : 0;
        const std::int32_t cls = p.balanced != 0 && active ? swap_cost_class(chunk_tokens) : 0;
        // Lanes of one class (inactive lanes each in a class of their own).
        const std::uint32_t same = __match_any_sync(0xffffffffu, active ? cls : -1 - lane);
        const std::uint32_t counter = base + SwapSegments::kClasses + 4 * static_cast<std::uint32_t>(cls);
        const bool leader = active && (same & ((1u << lane) - 1u)) == 0;
        if (pass == 0) {
          if (leader) ptx::st_shared_u32(counter, ptx::ld_shared_s32(counter) + __popc(same));
        } else {
          const std::int32_t pos =
              active ? ptx::ld_shared_s32(counter) + __popc(same & ((1u << lane) - 1u)) : 0;
          __syncwarp();
          if (leader) ptx::st_shared_u32(counter, pos + __popc(same));
          if (active) {
            ptx::st_shared_u32(base + SwapSegments::kGroups + 4 * pos, g);
            ptx::st_shared_u32(base + SwapSegments::kChunks + 4 * pos, (c << 9) | chunk_tokens);
          }
        }
        __syncwarp();
      }
    }
    if (pass == 0 && lane == 0) {
      // The classes' first places, costliest class first; the count.
      std::int32_t next = 0;
      for (int c = kSwapCostClasses - 1; c >= 0; --c) {
        const std::uint32_t counter = base + SwapSegments::kClasses + 4 * c;
        const std::int32_t n = ptx::ld_shared_s32(counter);
        ptx::st_shared_u32(counter, next);
        next += n;
      }
      ptx::st_shared_u32(base + SwapSegments::kCount, next);
    }
    __syncwarp();
  }
}

// The static schedule over the segment table, read the same way by every role: CTA c's i-th tile is
// tile i G' + c of the table (G' CTAs), or with p.balanced on odd rounds i G' + G' - 1 - c (a snake:
// the CTAs that take the cheaper end of one round take the dearer end of the next); tile t is weight
// block t mod (N / 128) of segment t / (N / 128).
class SwapScheduler {
 public:
  __device__ explicit SwapScheduler(std::uint32_t segments) : segments_(segments) {}

  // This CTA's next tile, or false past the last.
  __device__ bool next(const SwapGemmParams& p, SwapTile& tile) {
    const auto grid = static_cast<std::int32_t>(gridDim.x), cta = static_cast<std::int32_t>(blockIdx.x);
    const std::int32_t t = taken_ * grid + (p.balanced != 0 && (taken_ & 1) != 0 ? grid - 1 - cta : cta);
    ++taken_;
    // (N / 128 from the parameters, re-derived: the producer warps have 40 registers.)
    const std::int32_t n_blocks = p.n / kSwapWeightRows;
    if (t >= ptx::ld_shared_s32(segments_ + SwapSegments::kCount) * n_blocks) return false;
    const std::int32_t s = t / n_blocks;
    tile.n_block = t - s * n_blocks;
    tile.group = ptx::ld_shared_s32(segments_ + SwapSegments::kGroups + 4 * s);
    const std::int32_t chunk_tokens = ptx::ld_shared_s32(segments_ + SwapSegments::kChunks + 4 * s);
    tile.chunk = chunk_tokens >> 9;
    tile.tokens = chunk_tokens & 511;
    return true;
  }

  // The walking state and `tile` to 32 bytes of shared memory at `addr` (lane 0 of the calling warp)
  // and back (every lane): the consumers park them there across the K loop, whose widest wave shapes
  // have few registers to spare.
  __device__ void park(std::uint32_t addr, const SwapTile& tile, int lane) const {
    __syncwarp();  // (the previous tile's reads done)
    if (lane == 0) {
      ptx::st_shared_v4(addr, taken_, segments_, tile.group, tile.chunk);
      ptx::st_shared_v4(addr + 16, tile.n_block, tile.tokens, 0, 0);
    }
    __syncwarp();
  }
  __device__ void unpark(std::uint32_t addr, SwapTile& tile) {
    const uint4 a = ptx::ld_shared_v4(addr), b = ptx::ld_shared_v4(addr + 16);
    taken_ = static_cast<std::int32_t>(a.x);
    segments_ = a.y;
    tile.group = static_cast<std::int32_t>(a.z);
    tile.chunk = static_cast<std::int32_t>(a.w);
    tile.n_block = static_cast<std::int32_t>(b.x);
    tile.tokens = static_cast<std::int32_t>(b.y);
  }

 private:
  std::uint32_t segments_;
  std::int32_t taken_ = 0;
};

// acc += (sa[token] · sb) · part over one wave of kN tokens, acc pair-swapped (slot 2i holds element
// 2i + 1: gemm_common.cuh's promote() explains why). Thread column pair j: tokens 8 j + 2 q and
// + 1 of the wave, whose scales sit side by side at `scales` + 4 (8 j + 2 q).
template <int kN>
__device__ __forceinline__ void promote_columns(float (&acc)[kN / 2], const float (&part)[kN / 2],
                                                std::uint32_t scales, float sb, int q) {
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    const float2 sa = ptx::ld_shared_f32x2(scales + 4 * (8 * j + 2 * q));
    const float s0 = sa.x * sb, s1 = sa.y * sb;
    acc[4 * j + 0] = fmaf(s1, part[4 * j + 1], acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(s0, part[4 * j + 0], acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(s1, part[4 * j + 3], acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(s0, part[4 * j + 2], acc[4 * j + 3]);
  }
}

// One wave's accumulators (pair-swapped) to D: this thread holds weight rows r and r + 8 (r = the
// tile's row of lane / 4) of tokens c = 8 j + 2 q and c + 1; lanes l and l ^ 4 hold neighbouring rows.
// Each thread packs its row's two tokens as bf16x2 and swaps the word with its partner; the lane of
// the even row keeps token c of both rows (the words' low halves), its partner token c + 1 (the high
// halves), and each stores rows (r, r + 1) and (r + 8, r + 9) of its token, 4 bytes each. d_rows: D
// at the wave's token 0 and this thread's even row; tokens at or past `valid` (of the wave) are not
// stored.
template <int kN>
__device__ __forceinline__ void store_wave_transposed(const float (&acc)[kN / 2], __nv_bfloat16* d_rows,
                                                      std::int32_t n, int valid, int lane) {
  const int q = lane % 4;
  const bool even = ((lane / 4) % 2) == 0;
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    // Slots (pair-swapped): 4j+1 = (r, c), 4j+0 = (r, c+1), 4j+3 = (r+8, c), 4j+2 = (r+8, c+1).
    const std::uint32_t mine_a = pack_bf16x2(acc[4 * j + 1], acc[4 * j + 0]);
    const std::uint32_t mine_b = pack_bf16x2(acc[4 * j + 3], acc[4 * j + 2]);
    const std::uint32_t got_a = __shfl_xor_sync(0xffffffffu, mine_a, 4);
    const std::uint32_t got_b = __shfl_xor_sync(0xffffffffu, mine_b, 4);
    // Even lane: low halves (token c) of (mine = row r, got = row r + 1); odd lane: high halves (token
    // c + 1) of (got = row r - 1, mine = row r).
    const std::uint32_t lo = even ? __byte_perm(mine_a, got_a, 0x5410) : __byte_perm(got_a, mine_a, 0x7632);
    const std::uint32_t hi = even ? __byte_perm(mine_b, got_b, 0x5410) : __byte_perm(got_b, mine_b, 0x7632);
    const int token = 8 * j + 2 * q + (even ? 0 : 1);
    if (token < valid) {
      __nv_bfloat16* row = d_rows + static_cast<std::uint32_t>(token * n);  // (< 256 N: 32 bits)
      *reinterpret_cast<std::uint32_t*>(row) = lo;
      *reinterpret_cast<std::uint32_t*>(row + 8) = hi;
    }
  }
}

template <int kN, int kWaves>
struct SwapWaveShape {
  static constexpr int n = kN, waves = kWaves;
};

// Calls f(SwapWaveShape<N, W>{}) for the tile's wave shape (every shape swap_waves can return).
template <typename F>
__device__ __forceinline__ void with_wave_shape(SwapWaves w, F&& f) {
  if (w.count == 1) {
    switch (w.width) {
      case 16:
        f(SwapWaveShape<16, 1>{});
        break;
      case 32:
        f(SwapWaveShape<32, 1>{});
        break;
      case 48:
        f(SwapWaveShape<48, 1>{});
        break;
      case 64:
        f(SwapWaveShape<64, 1>{});
        break;
      case 80:
        f(SwapWaveShape<80, 1>{});
        break;
      case 96:
        f(SwapWaveShape<96, 1>{});
        break;
      case 112:
        f(SwapWaveShape<112, 1>{});
        break;
      case 128:
        f(SwapWaveShape<128, 1>{});
        break;
      case 144:
        f(SwapWaveShape<144, 1>{});
        break;
      case 160:
        f(SwapWaveShape<160, 1>{});
        break;
      default:
        f(SwapWaveShape<176, 1>{});
        break;
    }
  } else if (w.count == 2) {
    switch (w.width) {
      case 96:
        f(SwapWaveShape<96, 2>{});
        break;
      case 112:
        f(SwapWaveShape<112, 2>{});
        break;
      default:
        f(SwapWaveShape<120, 2>{});
        break;
    }
  } else {
    f(SwapWaveShape<88, 3>{});
  }
}

// kExperiments: the timing-experiment instance (bench lines ".swap.exp.*", bench/NOTES.md session 42),
// which also reads kAblateScales (the scale warp arrives without copying), kAblateFullWait (consumers
// compute on stale stages), kAblateMath (consumers wait and free, nothing else), kAblatePromote (one add
// per wave instead of the promotion), kSwapAblateScalarPromote and kSwapAblateOneConsumer; the default
// instance reads only kAblateLoads and kAblateEpilogue, so that its allocation does not carry the branches.
template <bool kExperiments>
__global__ void __launch_bounds__(SwapGemmTraits::kThreads, 1)
    fp8_masked_swap_kernel(const __grid_constant__ CUtensorMap tma_tokens,
                           const __grid_constant__ CUtensorMap tma_weights,
                           const __grid_constant__ SwapGemmParams p) {
  using Traits = SwapGemmTraits;
  constexpr int kStages = Traits::kStages;
  extern __shared__ __align__(1024) std::uint8_t smem_raw[];
  const std::uint32_t smem_base = ptx::smem_addr(smem_raw);
  if (threadIdx.x == 0 && (smem_base & 1023u) != 0) __trap();
  const std::uint32_t smem_tokens = smem_base;                           // kStages x 36 KB
  const std::uint32_t smem_weights = smem_base + Traits::kWeightOffset;  // kStages x 16 KB
  const std::uint32_t smem_scales = smem_base + Traits::kScaleOffset;
  const std::uint32_t full_bar = smem_base + Traits::kFullOffset;
  const std::uint32_t empty_bar = smem_base + Traits::kEmptyOffset;

  const int warp = static_cast<int>(threadIdx.x / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int32_t num_kb = p.k / kGemmBlockK;
  const int stages = p.stages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbar_init(full_bar + 8 * s, 1 + 32);    // the TMA arrive (+ bytes), 32 scale-copy arrives
      ptx::mbar_init(empty_bar + 8 * s, 2 * 128);  // every consumer lane
    }
    ptx::fence_barrier_init();
  }
  if (threadIdx.x == 32) {
    ptx::prefetch_tensormap(&tma_tokens);
    ptx::prefetch_tensormap(&tma_weights);
  }
  if (warp == 3) build_segments(p, smem_base + Traits::kSegmentOffset, lane);
  __syncthreads();

  SwapScheduler schedule(smem_base + Traits::kSegmentOffset);
  SwapTile tile;
  PipeState pipe;
  if (warp < 4) {
    // ------------------------------------------------------------ producer warpgroup
    ptx::setmaxnreg_dec<Traits::kProducerRegs>();
    if (warp == 0) {
      while (schedule.next(p, tile)) {
        const SwapWaves waves = swap_waves(tile.tokens);
        const std::int32_t boxes = (waves.count * waves.width + kSwapTokenBox - 1) / kSwapTokenBox;
        const std::uint32_t bytes = Traits::kWeightBytes + boxes * kSwapTokenBox * kGemmBlockK;
        const std::int32_t token_row = tile.group * p.m_max + tile.chunk * kSwapChunk;
        const std::int32_t weight_row = tile.group * p.n + tile.n_block * kSwapWeightRows;
        for (std::int32_t kb = 0; kb < num_kb; ++kb) {
          if (lane == 0) {
            const std::uint32_t full = full_bar + 8 * pipe.stage;
            ptx::mbar_wait(empty_bar + 8 * pipe.stage, pipe.phase ^ 1u);
            if ((p.ablation & kAblateLoads) != 0) {
              ptx::mbar_arrive(full);
              pipe.advance(stages);
              continue;
            }
            ptx::mbar_arrive_expect_tx(full, bytes);
            const std::int32_t k0 = kb * kGemmBlockK;
            ptx::tma_load_2d(smem_weights + pipe.stage * Traits::kWeightBytes, &tma_weights, full, k0,
                             weight_row);
            for (std::int32_t b = 0; b < boxes; ++b)
              ptx::tma_load_2d(
                  smem_tokens + pipe.stage * Traits::kTokenBytes + b * kSwapTokenBox * kGemmBlockK,
                  &tma_tokens, full, k0, token_row + b * kSwapTokenBox);
          }
          pipe.advance(stages);
        }
        __syncwarp();
      }
    } else if (warp == 1) {
      while (schedule.next(p, tile)) {
        // This lane's tokens 32 i + lane of the chunk; lane 0 also the weight block's scale.
        std::int32_t sa_off =
            tile.group * p.sa_group_stride + (tile.chunk * kSwapChunk + lane) * p.sa_row_stride;
        const std::int32_t sb_off = (tile.group * (p.n / kSwapWeightRows) + tile.n_block) * num_kb;
        for (std::int32_t kb = 0; kb < num_kb; ++kb) {
          ptx::mbar_wait(empty_bar + 8 * pipe.stage, pipe.phase ^ 1u);
          if constexpr (kExperiments) {
            if ((p.ablation & kAblateScales) != 0) {
              ptx::mbar_arrive(full_bar + 8 * pipe.stage);
              pipe.advance(stages);
              continue;
            }
          }
          const std::uint32_t scales = smem_scales + pipe.stage * Traits::kScaleBytes;
          // (Not unrolled: eight copies' addresses at once do not fit the producer's 40 registers.)
#pragma unroll 1
          for (int i = 0; i < kSwapChunk / 32; ++i) {
            // Tokens past the chunk's valid ones have no scale (their quantizer skips them); their
            // slots feed only columns that are never stored.
            if (i * 32 + lane < tile.tokens)
              ptx::cp_async_4(scales + 4 * (32 * i + lane), p.sa + sa_off + i * 32 * p.sa_row_stride);
          }
          if (lane == 0) ptx::cp_async_4(scales + 4 * kSwapTokenRows, p.sb + sb_off + kb);
          ptx::cp_async_mbar_arrive_noinc(full_bar + 8 * pipe.stage);  // once this lane's copies land
          sa_off += p.sa_kb_stride;
          pipe.advance(stages);
        }
      }
    }
  } else {
    // ------------------------------------------------------------ consumer warpgroups
    ptx::setmaxnreg_inc<Traits::kConsumerRegs>();
    constexpr std::uint32_t kDescK = 32 >> 4;  // 32 bytes of K per wgmma
    while (schedule.next(p, tile)) {
      with_wave_shape(swap_waves(tile.tokens), [&](auto shape) {
        constexpr int kN = decltype(shape)::n;
        constexpr int kWaves = decltype(shape)::waves;
        // (Everything below derived per tile, inside the shape's branch: values held across the branches
        // made ptxas spill the widest shape's.)
        const int thread_lane = static_cast<int>(threadIdx.x % 32);
        const int consumer_warp = static_cast<int>(threadIdx.x / 32) - 4;  // 0..7
        const int q = thread_lane % 4;
        // Shared-memory addresses broadcast from lane 0, so that the compiler sees warp-uniform values
        // and keeps them (and the descriptors and barrier addresses derived per K block) in uniform
        // registers, not among the accumulators' (as the row-major kernel does, bench/NOTES.md v5).
        const std::uint32_t u_smem = __shfl_sync(0xffffffffu, ptx::smem_addr(smem_raw), 0);
        const std::uint32_t u_consumer =
            __shfl_sync(0xffffffffu, static_cast<std::uint32_t>(consumer_warp / 4), 0);
        const std::uint32_t u_full = u_smem + Traits::kFullOffset;
        const std::uint32_t u_empty = u_smem + Traits::kEmptyOffset;
        const std::uint32_t u_scales = u_smem + Traits::kScaleOffset;
        const std::uint32_t u_park =
            u_smem + Traits::kParkOffset + 32 * (u_consumer * 4 + (consumer_warp % 4));
        const std::uint32_t w_desc0 =
            ptx::wgmma_desc_sw128_lo(u_smem + Traits::kWeightOffset + u_consumer * 64 * kGemmBlockK);
        const std::uint32_t t_desc0 = ptx::wgmma_desc_sw128_lo(u_smem);
        float acc[kWaves][kN / 2];
        float part[kN / 2];
#pragma unroll
        for (int w = 0; w < kWaves; ++w) {
#pragma unroll
          for (int i = 0; i < kN / 2; ++i) acc[w][i] = 0.0f;
        }
        schedule.park(u_park, tile, thread_lane);
        for (std::int32_t kb = 0; kb < num_kb; ++kb) {
          // (Broadcast: the compiler then keeps the stage's descriptors in uniform registers; derived from
          // pipe.stage as is, every wgmma's descriptors were moved there one R2UR at a time: 10% of the
          // kernel's instructions, ncu, bench/NOTES.md session 41.)
          const int stage = __shfl_sync(0xffffffffu, pipe.stage, 0);
          if constexpr (kExperiments) {
            if ((p.ablation & kAblateFullWait) == 0) ptx::mbar_wait(u_full + 8 * stage, pipe.phase);
            // (kSwapAblateOneConsumer: is one consumer's wgmma stream as fast per group alone as beside
            // the other's?)
            if ((p.ablation & kAblateMath) != 0 ||
                ((p.ablation & kSwapAblateOneConsumer) != 0 && u_consumer == 1)) {
              ptx::mbar_arrive_warp(u_empty + 8 * stage);
              pipe.advance(stages);
              continue;
            }
          } else {
            ptx::mbar_wait(u_full + 8 * stage, pipe.phase);
          }
          const std::uint32_t scales = u_scales + stage * Traits::kScaleBytes;
          const float sb = ptx::ld_shared_f32(scales + 4 * kSwapTokenRows);
          const std::uint32_t w_desc =
              w_desc0 + static_cast<std::uint32_t>(stage) * (Traits::kWeightBytes >> 4);
          const std::uint32_t t_desc =
              t_desc0 + static_cast<std::uint32_t>(stage) * (Traits::kTokenBytes >> 4);
#pragma unroll
          for (int w = 0; w < kWaves; ++w) {
            fence_all(part);
            ptx::wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < kGemmBlockK / 32; ++kk) {
              ptx::wgmma_m64k32_ss_e4m3<kN>(
                  part, ptx::wgmma_desc_from_lo(w_desc + kk * kDescK),
                  ptx::wgmma_desc_from_lo(t_desc + ((w * kN * kGemmBlockK) >> 4) + kk * kDescK), kk > 0);
            }
            ptx::wgmma_commit();
            ptx::wgmma_wait<0>();
            fence_all(part);
            if constexpr (kExperiments) {
              if ((p.ablation & kAblatePromote) != 0) {
                acc[w][0] += part[0];  // (keeps the wgmma's results live)
                continue;
              }
              if ((p.ablation & kSwapAblateScalarPromote) != 0) {
#pragma unroll
                for (int i = 0; i < kN / 2; ++i) acc[w][i] = fmaf(sb, part[i], acc[w][i]);
                continue;
              }
            }
            promote_columns<kN>(acc[w], part, scales + 4 * (w * kN), sb, q);
          }
          ptx::mbar_arrive_warp(u_empty + 8 * stage);  // each lane after its reads of the stage
          pipe.advance(stages);
        }
        schedule.unpark(u_park, tile);
        // This thread's weight rows r and r + 8 of the tile; the epilogue's even row of (r, r ^ 1).
        const int row_in_tile = consumer_warp * 16 + thread_lane / 4;
        const int even_row = row_in_tile & ~1;
        __nv_bfloat16* d_tile =
            p.d + (static_cast<std::int64_t>(tile.group) * p.m_max + tile.chunk * kSwapChunk) * p.n +
            tile.n_block * kSwapWeightRows + even_row;
        if ((p.ablation & kAblateEpilogue) != 0) {
          // (One conditional store keeps the accumulators, and so the K loop, live.)
          if (acc[0][0] == -1.5e-38f) p.d[0] = __float2bfloat16(acc[kWaves - 1][kN / 2 - 1]);
          return;
        }
#pragma unroll
        for (int w = 0; w < kWaves; ++w)
          store_wave_transposed<kN>(acc[w], d_tile + static_cast<std::int64_t>(w * kN) * p.n, p.n,
                                    static_cast<int>(tile.tokens) - w * kN, thread_lane);
      });
    }
  }
}

}  // namespace epmoe::kernels
