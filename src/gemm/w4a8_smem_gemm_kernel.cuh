// W4A8 grouped GEMM for Hopper, v3: int4 weights converted to e4m3 in shared memory (device code;
// host launcher in w4a8_grouped_gemm.cu, API in epmoe/cuda/w4a8_gemm.hpp, packed weight layout in
// w4a8_layout.hpp, shared with the register-operand kernel of w4a8_grouped_gemm_kernel.cuh).
//
//   D[m, n] = a_scale · Σ_kb s[g(m), n, kb] · Σ_{k in kb} A[m, k] · Q[g(m), n, k]
//
// Not transposed: the activations are the wgmma A operand (m64, kBM rows per tile), the weights the
// B operand (kBN columns per tile), both K-major in shared memory with the 128-byte swizzle, as in
// the FP8 kernel (fp8_grouped_gemm_kernel.cuh). The register-operand kernel issues one wgmma per
// 64 weight rows x 32 K whatever the activation rows; here one m64n128k32 covers 128 weight rows,
// and a dedicated warpgroup does the int4 -> e4m3 conversion off the consumers' path.
//
// One persistent CTA per SM, warp-specialised, 128 K per step, two rings of stages:
//   - raw ring (kRawStages): the packed int4 weights of the tile's kBN / 64 panels (4096 bytes
//     each), contiguous per K block in the packed layout: one bulk copy by producer warp 0; freed
//     by the converter;
//   - conversion ring (stages in use <= kConvStages): the activation tile [kBM x 128] (TMA by
//     producer warp 1; masked tiles with few valid rows load only a_small_rows of them) and the
//     tile's kBN scales (one bulk copy by producer warp 1: they go straight to the consumers), and
//     the e4m3 weight tile [kBN x 128] written by the converter; freed by the consumers;
//   - warpgroup 1 (the converter): per K block, waits for a raw stage and a free conversion stage;
//     thread t reads its two 16-byte words of each panel (the register-operand kernel's fragment
//     order: row 16 w + g (+ 8), k = 16 u + 4 q + j for word u), turns each word's low and high
//     nibbles into 4 + 4 e4m3 bytes (the codes c · 2^-9, or with kSigned the weights' own v · 2^-9;
//     w4a8_layout.hpp) and stores them at row r,
//     16-byte chunk u ^ (r % 8), byte 4 q of the swizzled tile (conflict-free: the 32 lanes of a store hit 32
//     distinct banks); frees the raw stage, and publishes the conversion stage after
//     fence.proxy.async (generic-proxy writes read by wgmma). Everything the consumers read with
//     generic loads (the scales) comes in by bulk copy, completing on the stage's "full" barrier,
//     as in the FP8 kernel: no generic store of one warp is read by another through an mbarrier
//     alone (racecheck does not model those waits, bench/NOTES.md);
//   - consumer warpgroups (kConsumers): consumer c owns activation rows 64 (c / kColGroups) and
//     kWaves x 128 weight columns from 128 kWaves (c % kColGroups); per wave four wgmma
//     m64n128k32 into a per-K-block partial, and (codes, not kSigned) once per K block four
//     m64n8k32 against a constant tile of e4m3(-8 · 2^-9) (the codes' offset, the same for every
//     column: -2^-6 Σ_k A[row, k]), then acc += s[n] · (part + offset[row]) with the two scales of
//     each of the thread's column pairs (f32, never re-quantised weights); a_scale · 2^9 in the
//     epilogue, 16-byte bf16 stores after a quad transpose, valid rows only;
//   - the tall tile (kBM = 256, kBN = 128, signed, contiguous only): consumer c owns rows 128 c as two
//     64-row waves against the same 128 converted columns, so each converted weight tile serves twice
//     the activation rows (half the conversion per flop); W4A8Scheduler pairs 128-row blocks of one
//     group, and a block whose pair partner is another group's runs alone (a half tile).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cuda.h>
#include <cuda_bf16.h>

#include "cuda/ptx_hopper.cuh"
#include "gemm/gemm_common.cuh"
#include "gemm/w4a8_grouped_gemm_kernel.cuh"  // W4A8Params, W4A8Scheduler, W4A8Pipe, w4a8_convert8
#include "gemm/w4a8_layout.hpp"

namespace epmoe::kernels {

// kSigned: the converter writes the e4m3 bytes of v · 2^-9 (w4a8::signed_codes_lo / _hi) instead of
// the codes c · 2^-9, so the consumers have no offset term (no m64n8k32 per K step, no offset
// registers, one FFMA per accumulator in the fold): the registers that lets 128 x 256 tiles keep two
// 128-column waves per consumer.
//
// kBM = 256 (the tall tile, kBN = 128, signed only): each converted weight tile feeds 256 activation rows
// instead of 128, so the conversion per flop halves; each of the two consumers owns 128 rows as two
// 64-row waves over the same 128 columns (kWaves counts those), and a tile whose second 128 rows
// are another group's (W4A8Scheduler's pairs) runs with one 64-row wave per consumer.
template <int kBM, int kBN, int kWaves, bool kSigned = false>
struct W4A8SmemTraits {
  static constexpr bool kTall = kBM == 256;
  static_assert(kTall ? (kBN == 128 && kWaves == 2 && kSigned)
                      : ((kBM == 64 || kBM == 128) && (kBN == 128 || kBN == 256) &&
                         (kWaves == 1 || kWaves == 2)));
  static constexpr int kConsN = kTall ? 128 : 128 * kWaves;  // weight columns per consumer
  static_assert(kBN % kConsN == 0);
  static constexpr int kColGroups = kBN / kConsN;
  static constexpr int kConsumers = kTall ? 2 : (kBM / 64) * kColGroups;
  static constexpr int kConsRows = kTall ? 128 : 64;  // activation rows per consumer (full tiles)
  // Scale pairs (of 16) each wave reads before its wgmma wait: the most without spills (ptxas: 14 spill
  // 20 bytes in the tall tile; the 128 x 256 two-wave tile spills with any).
  static constexpr int kEarlyPairs = kTall ? 12 : 0;
  static constexpr int kThreads = 128 * (2 + kConsumers);
  static constexpr int kPanels = kBN / w4a8::kPanelRows;
  static constexpr int kABytes = kBM * w4a8::kBlockK;  // multiples of 1024 (swizzle atoms)
  static constexpr int kBBytes = kBN * w4a8::kBlockK;
  static constexpr int kCScaleBytes = kBN * w4a8::kScaleBytes;
  static constexpr int kConvBytes = kABytes + kBBytes + kCScaleBytes + 16;  // + the two barriers
  static constexpr int kRawWBytes = kPanels * w4a8::kPanelBytes;
  static constexpr int kRawBytes = kRawWBytes + 16;
  // Four conversion stages where they fit (FP8 measured a fourth stage worth ~8%, session 15): the
  // 128 x 256 tile's (~49 KB each) fit beside two raw stages only without the 1024 bytes of
  // alignment slack, i.e. on the dynamic shared memory's own 1024-byte alignment (checked at entry).
  static constexpr int kConvStages = kBM == 64 && kBN == 256 ? 3 : 4;
  static constexpr int kAlignSlack = kBM == 128 && kBN == 256 ? 0 : 1024;
  static constexpr int kOffsetBytes =
      kSigned ? 0 : 1024;  // the constant B operand of the offset term (8 x 128)
  static constexpr int kRawStages =
      std::min(8, (kW4SmemBudget - kAlignSlack - kOffsetBytes - kConvStages * kConvBytes) / kRawBytes);
  static_assert(kRawStages >= 2);
  static constexpr int kSmemBytes =
      kAlignSlack + kOffsetBytes + kConvStages * kConvBytes + kRawStages * kRawBytes;
  // setmaxnreg (multiples of 8; the totals stay within the launch allocation, 512 x 128 or
  // 384 x 168; ptxas: no spills with these). The two-wave tile: 32 + 48 + 2 x 216, the producer's
  // chunk arithmetic in 32 bits (in 64 it spilled at 32), the converter's 48 for its pipelined panel
  // loads (at 40 they spilled), the consumers' 216 for acc[2][64] + part[64] (208 spilled).
  static constexpr bool kTwoWaves = kWaves == 2;
  // (The tall tile has the same split: its consumers also hold acc[2][64] + part[64].)
  static constexpr int kProducerRegs = kTwoWaves ? 32 : 40;
  static constexpr int kConverterRegs = kTwoWaves ? 48 : 56;
  static constexpr int kConsumerRegs = kConsumers == 1 ? 232 : (kTwoWaves ? 216 : 208);
};

template <int kBM, int kBN, int kWaves, bool kSigned>
__global__ void __launch_bounds__(W4A8SmemTraits<kBM, kBN, kWaves, kSigned>::kThreads, 1)
    w4a8_smem_gemm_kernel(const __grid_constant__ CUtensorMap tma_a,
                          const __grid_constant__ CUtensorMap tma_a_small,
                          const __grid_constant__ W4A8Params p) {
  using Traits = W4A8SmemTraits<kBM, kBN, kWaves, kSigned>;
  constexpr int kConvStages = Traits::kConvStages;
  constexpr int kRawStages = Traits::kRawStages;
  constexpr int kPanels = Traits::kPanels;

  extern __shared__ __align__(1024) std::uint8_t smem_raw[];
  const std::uint32_t smem_base = (ptx::smem_addr(smem_raw) + 1023u) & ~1023u;
  // (Without slack the base must be aligned already: a misaligned swizzled tile would compute garbage.)
  if (Traits::kAlignSlack == 0 && smem_base != ptx::smem_addr(smem_raw)) __trap();
  const std::uint32_t smem_offset = smem_base;                                 // [8 x 128] of -2^-6
  const std::uint32_t smem_a = smem_offset + Traits::kOffsetBytes;             // conv stages x [kBM x 128]
  const std::uint32_t smem_b = smem_a + kConvStages * Traits::kABytes;         // conv stages x [kBN x 128]
  const std::uint32_t smem_cs = smem_b + kConvStages * Traits::kBBytes;        // conv stages x kBN bf16
  const std::uint32_t smem_rw = smem_cs + kConvStages * Traits::kCScaleBytes;  // raw stages x panels x 4096
  const std::uint32_t raw_full = smem_rw + kRawStages * Traits::kRawWBytes;    // raw stages x 8 bytes
  const std::uint32_t raw_empty = raw_full + kRawStages * 8;
  const std::uint32_t conv_full = raw_empty + kRawStages * 8;  // conv stages x 8 bytes
  const std::uint32_t conv_empty = conv_full + kConvStages * 8;

  const int warp = static_cast<int>(threadIdx.x / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int32_t num_kb = p.k / w4a8::kBlockK;
  const int conv_stages = p.stages;  // in use, <= kConvStages

  if (threadIdx.x == 0) {
#pragma unroll 1
    for (int s = 0; s < kRawStages; ++s) {
      ptx::mbar_init(raw_full + 8 * s, 1);                        // producer warp 0 (+ bytes)
      ptx::mbar_init(raw_empty + 8 * s, 4 * ptx::kWarpArrivals);  // every converter lane
    }
#pragma unroll 1
    for (int s = 0; s < kConvStages; ++s) {
      ptx::mbar_init(conv_full + 8 * s,
                     1 + 4 * ptx::kWarpArrivals);  // producer warp 1 (+ bytes), converter lanes
      ptx::mbar_init(conv_empty + 8 * s, Traits::kConsumers * 4 * ptx::kWarpArrivals);  // every consumer lane
    }
    ptx::fence_barrier_init();
  }
  if (threadIdx.x == 32) {
    ptx::prefetch_tensormap(&tma_a);
    ptx::prefetch_tensormap(&tma_a_small);
  }
  // The offset operand: every byte e4m3(-8 · 2^-9), read by wgmma (the async proxy).
  if (!kSigned && threadIdx.x < Traits::kOffsetBytes / 4) {
    ptx::st_shared_u32(smem_offset + 4 * threadIdx.x, w4a8::kOffsetE4m3x4);
    ptx::fence_proxy_async_shared();
  }
  __syncthreads();

  W4A8Scheduler<kBM, kBN> scheduler(p);
  W4A8Tile tile;

  if (warp < 4) {
    // ------------------------------------------------------------ producer warpgroup (warps 0, 1)
    ptx::setmaxnreg_dec<Traits::kProducerRegs>();
    W4A8Pipe pipe;
    // A tile's chunk of K block kb is chunk0 + kb * step (w4a8::tile_chunks: 32 bits, for the
    // 32-register producer of the two-wave tile).
    const std::int32_t n_panels = p.n / w4a8::kPanelRows;
    const auto first_chunk = [&](const W4A8Tile& t, std::int32_t& step) {
      const w4a8::TileChunks c = w4a8::tile_chunks(t.n_tile * kPanels, num_kb, n_panels);
      step = c.step;
      return t.group * n_panels * num_kb + c.first;
    };
    if (warp == 0) {
      while (scheduler.next(tile, p)) {
        // The tile's panels are consecutive inside one panel group: per K block one bulk copy of
        // their weights (w4a8_layout.hpp).
        std::int32_t step;
        const std::int32_t chunk0 = first_chunk(tile, step);
        for (std::int32_t kb = 0; kb < num_kb; ++kb) {
          if (lane == 0) {
            const std::uint32_t full = raw_full + 8 * pipe.stage;
            ptx::mbar_wait(raw_empty + 8 * pipe.stage, pipe.phase ^ 1u);
            if ((p.ablation & kW4AblateLoads) != 0) {
              ptx::mbar_arrive(full);
            } else {
              ptx::mbar_arrive_expect_tx(full, Traits::kRawWBytes);
              const std::uint32_t chunk = static_cast<std::uint32_t>(chunk0 + kb * step);
              ptx::bulk_load(smem_rw + pipe.stage * Traits::kRawWBytes,
                             p.w + static_cast<std::uint64_t>(chunk) * w4a8::kPanelBytes, Traits::kRawWBytes,
                             full);
            }
          }
          pipe.advance(kRawStages);
        }
        __syncwarp();
      }
    } else if (warp == 1) {
      while (scheduler.next(tile, p)) {
        // Masked tiles with few valid rows load only the first a_small_rows activation rows: the rest
        // of the tile in shared memory is stale and feeds only output rows that are never stored.
        // (Also the tall tile's half tiles: 128 rows.)
        const std::int32_t rows_used = min(kBM, tile.row_end - tile.row0);
        const bool small = (p.masked_m != nullptr || Traits::kTall) && rows_used <= p.a_small_rows;
        const CUtensorMap* map = small ? &tma_a_small : &tma_a;
        const std::uint32_t bytes = small ? p.a_small_rows * w4a8::kBlockK : Traits::kABytes;
        // With the activations, the tile's kBN scales of the K block (one contiguous chunk, in the
        // packed order: panel-major, 64 rows each), straight into the conversion stage.
        std::int32_t step;
        const std::int32_t chunk0 = first_chunk(tile, step);
        for (std::int32_t kb = 0; kb < num_kb; ++kb) {
          if (lane == 0) {
            const std::uint32_t full = conv_full + 8 * pipe.stage;
            ptx::mbar_wait(conv_empty + 8 * pipe.stage, pipe.phase ^ 1u);
            ptx::mbar_arrive_expect_tx(full, bytes + Traits::kCScaleBytes);
            ptx::tma_load_2d(smem_a + pipe.stage * Traits::kABytes, map, full, kb * w4a8::kBlockK, tile.row0);
            const std::uint32_t chunk = static_cast<std::uint32_t>(chunk0 + kb * step);
            ptx::bulk_load(smem_cs + pipe.stage * Traits::kCScaleBytes,
                           p.ws + static_cast<std::uint64_t>(chunk) * w4a8::kPanelRows, Traits::kCScaleBytes,
                           full);
          }
          pipe.advance(conv_stages);
        }
        __syncwarp();
      }
    }
  } else if (warp < 8) {
    // ------------------------------------------------------------ converter warpgroup
    ptx::setmaxnreg_dec<Traits::kConverterRegs>();
    const int t = static_cast<int>(threadIdx.x % 128);
    // Word u's low half goes to row_base ^ 16 u of the panel's e4m3 rows (w4a8_layout.hpp).
    const std::uint32_t row_base = w4a8::converter_row_base(t);
    W4A8Pipe raw, conv;
    while (scheduler.next(tile, p)) {
      for (std::int32_t kb = 0; kb < num_kb; ++kb) {
        ptx::mbar_wait(raw_full + 8 * raw.stage, raw.phase);
        ptx::mbar_wait(conv_empty + 8 * conv.stage, conv.phase ^ 1u);
        const std::uint32_t src = smem_rw + raw.stage * Traits::kRawWBytes + t * 16;
        const std::uint32_t dst = smem_b + conv.stage * Traits::kBBytes;
        const bool convert = (p.ablation & kW4AblateConvert) == 0;
        // Panel c + 1's words are loaded before panel c's stores (the shared accesses are ordered
        // asm), so their latency hides behind a panel's conversion instead of following it; not in
        // the 40-register converter of two-wave tiles (it spills 48 bytes).
        constexpr bool kPipelined = Traits::kConverterRegs >= 48;
        uint4 next0{}, next1{};
        if (kPipelined && convert) {
          next0 = ptx::ld_shared_v4(src);
          next1 = ptx::ld_shared_v4(src + 2048);
        }
#pragma unroll
        for (int c = 0; c < kPanels && convert; ++c) {
          uint4 v0 = next0, v1 = next1;
          if (!kPipelined) {
            v0 = ptx::ld_shared_v4(src + c * w4a8::kPanelBytes);
            v1 = ptx::ld_shared_v4(src + c * w4a8::kPanelBytes + 2048);
          } else if (c + 1 < kPanels) {
            next0 = ptx::ld_shared_v4(src + (c + 1) * w4a8::kPanelBytes);
            next1 = ptx::ld_shared_v4(src + (c + 1) * w4a8::kPanelBytes + 2048);
          }
          const std::uint32_t words[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
          const std::uint32_t panel = dst + static_cast<std::uint32_t>(c * w4a8::kPanelRows * w4a8::kBlockK);
#pragma unroll
          for (int u = 0; u < 8; ++u) {
            std::uint32_t lo, hi;
            w4a8_convert8<kSigned>(words[u], lo, hi);
            const std::uint32_t at = panel + (row_base ^ static_cast<std::uint32_t>(16 * u));
            ptx::st_shared_u32(at, lo);
            ptx::st_shared_u32(at + 8 * w4a8::kBlockK, hi);
          }
        }
        if ((p.ablation & kW4AblateFence) == 0) ptx::fence_proxy_async_shared();
        ptx::mbar_arrive_warp(raw_empty + 8 * raw.stage);  // each lane after its reads and stores
        ptx::mbar_arrive_warp(conv_full + 8 * conv.stage);
        raw.advance(kRawStages);
        conv.advance(conv_stages);
      }
    }
  } else {
    // ------------------------------------------------------------ consumer warpgroups
    ptx::setmaxnreg_inc<Traits::kConsumerRegs>();
    const int consumer = warp / 4 - 2;
    const int row_block = consumer / Traits::kColGroups;                // which kConsRows activation rows
    const int col0 = (consumer % Traits::kColGroups) * Traits::kConsN;  // first weight column
    const int row_in_wave = (warp % 4) * 16 + lane / 4;                 // and + 8
    const int q = lane % 4;
    const float a_scale = (p.a_scale_ptr != nullptr ? __ldg(p.a_scale_ptr) : p.a_scale) * w4a8::kCodeScale;
    W4A8Pipe pipe;
    // wgmma descriptors of stage 0 (low words; the high word is constant): the activation tile (each
    // tile adds this consumer's first row) and this consumer's first weight column.
    const std::uint32_t a_desc_tile0 = ptx::wgmma_desc_sw128_lo(smem_a);
    const std::uint32_t b_desc0 = ptx::wgmma_desc_sw128_lo(smem_b + col0 * w4a8::kBlockK);
    float acc[kWaves][64];
    float part[64];
    [[maybe_unused]] float
        offset[4];  // (not kSigned) per K block: -2^-6 Σ_k A[row, k] for rows row_a (0, 1) and row_b (2, 3)

    while (scheduler.next(tile, p)) {
#pragma unroll
      for (int i = 0; i < 64; ++i) part[i] = 0.0f;
#pragma unroll
      for (int w = 0; w < kWaves; ++w) {
#pragma unroll
        for (int i = 0; i < 64; ++i) acc[w][i] = 0.0f;
      }
      // The tall tile's half tiles (at most 128 rows): one stored 64-row wave per consumer.
      const bool two_m = Traits::kTall && tile.row_end - tile.row0 > 128;
      // This consumer's first activation row in the tile; wave w's (tall) is 64 w further.
      const int cons_row0 = Traits::kTall && !two_m ? 64 * consumer : row_block * Traits::kConsRows;
      const std::uint32_t a_desc0 =
          a_desc_tile0 + static_cast<std::uint32_t>((cons_row0 * w4a8::kBlockK) >> 4);
      // Rows row_a and row_b = row_a + 8 of the wave starting at tile row r0: valid and of this group.
      const auto wave_rows = [&](int r0, std::int32_t& row_a, bool& valid_a, bool& valid_b) {
        row_a = tile.row0 + r0 + row_in_wave;
        const std::int32_t row_b = row_a + 8;
        valid_a = row_a < tile.row_end;
        valid_b = row_b < tile.row_end;
        if (p.m_indices != nullptr) {
          valid_a = valid_a && __ldg(p.m_indices + row_a) == tile.group;
          valid_b = valid_b && __ldg(p.m_indices + row_b) == tile.group;
        }
      };

      for (std::int32_t kb = 0; kb < num_kb; ++kb) {
        const int stage = pipe.stage;
        ptx::mbar_wait(conv_full + 8 * stage, pipe.phase);
        if ((p.ablation & kW4AblateMath) != 0) {
          ptx::mbar_arrive_warp(conv_empty + 8 * stage);
          pipe.advance(conv_stages);
          continue;
        }
        // The stage's descriptors: one 32-bit add from the first stage's (ptx::wgmma_desc_sw128_lo).
        const std::uint32_t a_desc = a_desc0 + static_cast<std::uint32_t>(stage) * (Traits::kABytes >> 4);
        const std::uint32_t b_desc = b_desc0 + static_cast<std::uint32_t>(stage) * (Traits::kBBytes >> 4);
        // The scales as bf16 pairs: word i holds columns 2 i (low half) and 2 i + 1; this thread's
        // first pair, as a shared address and as a pointer.
        const std::uint32_t scale_addr =
            smem_cs + stage * Traits::kCScaleBytes + w4a8::kScaleBytes * (col0 + 2 * q);
        const auto* scale_ptr =
            reinterpret_cast<const std::uint32_t*>(smem_raw + (scale_addr - ptx::smem_addr(smem_raw)));
        // (A generic lambda per wave, so that acc[w] is always indexed by a constant.)
        const auto wave = [&](auto wc) {
          constexpr int w = decltype(wc)::value;
          fence_all(part);
          if constexpr (w == 0 && !kSigned) fence_all(offset);
          ptx::wgmma_fence();
          // The offset term of the codes (w4a8_layout.hpp), once per K block: the same for every
          // column.
          if constexpr (w == 0 && !kSigned) {
            // (One descriptor for all four steps: the tile is constant.)
            const std::uint64_t offset_desc = ptx::wgmma_desc_sw128(smem_offset);
#pragma unroll
            for (int kk = 0; kk < w4a8::kBlockK / 32; ++kk)
              ptx::wgmma_m64n8k32_e4m3(offset, ptx::wgmma_desc_from_lo(a_desc + kk * (32 >> 4)), offset_desc,
                                       kk > 0);
          }
#pragma unroll
          for (int kk = 0; kk < w4a8::kBlockK / 32; ++kk) {
            // (Tall: wave w is the next 64 rows of A against the same columns; else the next 128
            // columns of B against the same rows.)
            constexpr int kAWave = Traits::kTall ? (w * 64 * w4a8::kBlockK) >> 4 : 0;
            constexpr int kBWave = Traits::kTall ? 0 : (w * 128 * w4a8::kBlockK) >> 4;
            ptx::wgmma_m64n128k32_e4m3(part, ptx::wgmma_desc_from_lo(a_desc + kAWave + kk * (32 >> 4)),
                                       ptx::wgmma_desc_from_lo(b_desc + kBWave + kk * (32 >> 4)), kk > 0);
          }
          ptx::wgmma_commit();
          // This wave's scales: its 128 columns' (tall: both waves have the same columns).
          constexpr int kWaveScaleBytes = Traits::kTall ? 0 : w * 128 * w4a8::kScaleBytes;
          // The first kEarlyPairs scale pairs are read while the wave's wgmma runs (their latency was on
          // the fold's path: ncu, session 24); as many as the registers allow.
          constexpr int kEarly = Traits::kEarlyPairs;
          [[maybe_unused]] std::uint32_t early_pairs[kEarly > 0 ? kEarly : 1];
#pragma unroll
          for (int j = 0; j < kEarly; ++j) {
            early_pairs[j] =
                static_cast<std::uint32_t>(ptx::ld_shared_s32(scale_addr + kWaveScaleBytes + 16 * j));
          }
          ptx::wgmma_wait<0>();
          fence_all(part);
          if constexpr (w == 0 && !kSigned) fence_all(offset);
          // The scales of this thread's columns 128 w + 8 j + 2 q + {0, 1}. With one wave they are
          // all read before the stage is given back (32 registers); with two the last wave frees
          // the stage after its promotion, unless the scales stay packed (kSigned: 16 registers).
          constexpr bool kEarlyFree = kWaves == 1 || (kSigned && w == kWaves - 1);
          // (Plain loads, which the compiler may interleave with the promotion.)
          const std::uint32_t* sc = scale_ptr + kWaveScaleBytes / 4;
          // (Signed: the bf16 pairs stay packed until their FFMAs, 16 registers instead of 32: the
          // two-wave consumers have none to spare.)
          [[maybe_unused]] float2 scv[kSigned ? 1 : 16];
          [[maybe_unused]] std::uint32_t pairs[kSigned ? 16 : 1];
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const std::uint32_t pair = j < kEarly ? early_pairs[j < kEarly ? j : 0] : sc[4 * j];
            if constexpr (kSigned) {
              pairs[j] = pair;
            } else {
              scv[j] = make_float2(__uint_as_float(pair << 16), __uint_as_float(pair & 0xffff0000u));
            }
          }
          // Column pair j's two scales, and a partial with the codes' offset term of its row added.
          const auto scales = [&](int j) {
            if constexpr (kSigned) {
              return make_float2(__uint_as_float(pairs[j] << 16), __uint_as_float(pairs[j] & 0xffff0000u));
            } else {
              return scv[j];
            }
          };
          const auto with_offset = [&](float x, float off) {
            if constexpr (kSigned) {
              return x;
            } else {
              return x + off;
            }
          };
          if constexpr (kEarlyFree) {
            ptx::mbar_arrive_warp(conv_empty + 8 * stage);  // each lane after its scale loads
          }
          fence_all(part);
#pragma unroll
          for (int j = 0; j < 16; ++j) {
            const float2 s = scales(j);
            acc[w][4 * j + 0] = fmaf(s.x, with_offset(part[4 * j + 0], offset[0]), acc[w][4 * j + 0]);
            acc[w][4 * j + 1] = fmaf(s.y, with_offset(part[4 * j + 1], offset[0]), acc[w][4 * j + 1]);
            acc[w][4 * j + 2] = fmaf(s.x, with_offset(part[4 * j + 2], offset[2]), acc[w][4 * j + 2]);
            acc[w][4 * j + 3] = fmaf(s.y, with_offset(part[4 * j + 3], offset[2]), acc[w][4 * j + 3]);
          }
          if (!kEarlyFree && w == kWaves - 1) {
            fence_all(acc[w]);
            ptx::mbar_arrive_warp(conv_empty + 8 * stage);  // each lane after its scale loads
          }
        };
        wave(std::integral_constant<int, 0>{});
        if constexpr (kWaves == 2) {
          // (A tall half tile runs its second wave too, on rows it does not store: a run-time
          // condition here cost ~26 spilled registers in the consumers.)
          wave(std::integral_constant<int, 1>{});
        }
        pipe.advance(conv_stages);
      }

      // Epilogue: a_scale, bf16, 16-byte stores of valid rows (as the FP8 kernel's).
      const auto store_wave = [&](auto wc) {
        constexpr int w = decltype(wc)::value;
        std::int32_t row_a;
        bool valid_a, valid_b;
        wave_rows(cons_row0 + (Traits::kTall ? 64 * w : 0), row_a, valid_a, valid_b);
        store_wave_bf16<true>(acc[w], a_scale, p.d + tile.n_tile * kBN + col0 + (Traits::kTall ? 0 : w * 128),
                              row_a, row_a + 8, valid_a, valid_b, p.n, lane);
      };
      store_wave(std::integral_constant<int, 0>{});
      if constexpr (kWaves == 2) {
        if (!Traits::kTall || two_m) store_wave(std::integral_constant<int, 1>{});
      }
    }
  }
}

}  // namespace epmoe::kernels
