// Device helpers the Hopper grouped GEMMs share (FP8 row-major and swapped kernels, W4A8 kernels):
// the K block and shared-memory budget, the ablation bits of the FP8 experiments, the pipeline
// position, the FP8 promotion, and the bf16 epilogue store of one wgmma wave. Device code only;
// include from .cuh/.cu.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include <cuda_bf16.h>

#include "cuda/ptx_hopper.cuh"

namespace epmoe::kernels {

inline constexpr int kGemmBlockK = 128;         // K per pipeline stage (one scale block; a 128-byte row)
inline constexpr int kGemmSmemBudget = 232448;  // dynamic shared memory a block may have on sm_90

// Ablation bits (GroupedGemmParams::ablation): timing experiments only, the output is garbage. The
// swapped kernel gives two of them meanings of its own (fp8_masked_swap_kernel.cuh).
inline constexpr int kAblateNone = 0;
inline constexpr int kAblateMath = 1;     // consumers skip the wgmma and the promotion
inline constexpr int kAblateLoads = 2;    // the producer arms the full barriers without loading A and B
inline constexpr int kAblatePromote = 4;  // consumers promote one accumulator per wave (wgmma and wait kept)
inline constexpr int kAblateOneWait = 8;  // all waves of a K block into one partial: one wait, one promotion
inline constexpr int kAblateEpilogue = 16;  // no output stores
inline constexpr int kAblateScales = 32;    // the scale warp copies nothing (arrives only)
inline constexpr int kAblateFullWait = 64;  // consumers do not wait on "full" (stale stages)
inline constexpr int kAblatePipe =
    128;  // no pipeline at all: producers idle, consumers neither wait nor free
// Timing ablation: each consumer warp spins 200 cycles after each K block's last wave completes (is
// the consumers' per-K-block latency hidden by the other warpgroup's wgmma, or exposed?).
inline constexpr int kAblateSpin = 512;
// (256 and 2048 are taken: kTraceLoop and kTraceCtas, fp8_grouped_gemm_kernel.cuh.)

using ptx::pack_bf16x2;

template <int kN>
__device__ __forceinline__ void fence_all(float (&r)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) ptx::fence_operand(r[i]);
}

// Calls f(std::integral_constant<int, I>{}) for I = 0 .. N - 1, in order.
template <typename F, int... I>
__device__ __forceinline__ void for_each_index(std::integer_sequence<int, I...>, F&& f) {
  (f(std::integral_constant<int, I>{}), ...);
}

// The pipeline position (stage, phase) that producer and consumers advance in lockstep.
struct PipeState {
  int stage = 0;
  std::uint32_t phase = 0;
  __device__ void advance(int stages) {
    if (++stage == stages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// acc += (sa·sw) · part on row a (elements 4j, 4j+1) and (sb·sw) · part on row b (4j+2, 4j+3), with
// acc held pair-swapped during the K loop: slot 2i holds element 2i + 1 and slot 2i + 1 element 2i
// (unswap_pairs() puts them back for the epilogue; in SSA that is a renaming, no instructions).
// Why: the partial is the wgmma's register block (element e in an 8-aligned base + e), ptxas keeps
// acc in aligned pairs in slot order, and the scale is one register; unswapped, half of the FFMAs
// read three registers of one bank parity and stall on dispatch (bench/NOTES.md, session 32: ncu
// showed every FFMA with partial, scale and accumulator of one parity at ~3x the samples of the others).
__device__ __forceinline__ void promote(float (&acc)[64], const float (&part)[64], float a, float b,
                                        float w) {
  const float s_a = a * w, s_b = b * w;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    acc[4 * j + 0] = fmaf(s_a, part[4 * j + 1], acc[4 * j + 0]);
    acc[4 * j + 1] = fmaf(s_a, part[4 * j + 0], acc[4 * j + 1]);
    acc[4 * j + 2] = fmaf(s_b, part[4 * j + 3], acc[4 * j + 2]);
    acc[4 * j + 3] = fmaf(s_b, part[4 * j + 2], acc[4 * j + 3]);
  }
}

// The element order back from promote()'s pair-swapped slots.
__device__ __forceinline__ void unswap_pairs(float (&acc)[64]) {
#pragma unroll
  for (int i = 0; i < 64; i += 2) {
    const float t = acc[i];
    acc[i] = acc[i + 1];
    acc[i + 1] = t;
  }
}

// Transposes 4 x 4 words across the 4 lanes of a quad (q = lane % 4): on return w[k] holds what
// lane k held in w[q] (two rounds of xor shuffles, two words each).
__device__ __forceinline__ void quad_transpose(std::uint32_t (&w)[4], int q) {
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const bool hi = (q & 2) != 0;
    const std::uint32_t got = __shfl_xor_sync(0xffffffffu, hi ? w[k] : w[k + 2], 2);
    if (hi) {
      w[k] = got;
    } else {
      w[k + 2] = got;
    }
  }
#pragma unroll
  for (int k = 0; k < 4; k += 2) {
    const bool odd = (q & 1) != 0;
    const std::uint32_t got = __shfl_xor_sync(0xffffffffu, odd ? w[k] : w[k + 1], 1);
    if (odd) {
      w[k] = got;
    } else {
      w[k + 1] = got;
    }
  }
}

// Lane q's 16 bytes of row h (0: row_a, 1: row_b), 8-column chunk 4 i + q, of one wave's 64
// accumulators v: the quad's 4 x 2 columns of chunks 4 i .. 4 i + 3 as bf16x2, transposed across the quad.
template <bool kScaled>
__device__ __forceinline__ void transposed_words_bf16(const float (&v)[64], float scale, int h, int i, int q,
                                                      std::uint32_t (&words)[4]) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int j = 4 * i + k;
    const float lo = v[4 * j + 2 * h], hi = v[4 * j + 2 * h + 1];
    words[k] = kScaled ? pack_bf16x2(lo * scale, hi * scale) : pack_bf16x2(lo, hi);
  }
  quad_transpose(words, q);
}

// One wave's 64 accumulators v (the wgmma m64n128 layout: this thread's rows row_a and row_b =
// row_a + 8), times `scale` when kScaled, as bf16 into the 128 columns at d_col of those rows (valid
// rows only; n: d's row stride in elements). Per row and 32 columns the quad's lanes hold 2 columns of
// each 8 (j = 4 i + k): after the transpose lane q holds the 8 columns of j = 4 i + q and stores them
// as one 16-byte word, so each store instruction writes 64 contiguous bytes of 8 rows. The epilogue
// of the FP8 and W4A8 kernels.
template <bool kScaled>
__device__ __forceinline__ void store_wave_bf16(const float (&v)[64], float scale, __nv_bfloat16* d_col,
                                                std::int64_t row_a, std::int64_t row_b, bool valid_a,
                                                bool valid_b, std::int64_t n, int lane) {
  const int q = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const bool valid = h == 0 ? valid_a : valid_b;
    __nv_bfloat16* d_row = d_col + (h == 0 ? row_a : row_b) * n;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      std::uint32_t words[4];
      transposed_words_bf16<kScaled>(v, scale, h, i, q, words);
      if (valid) ptx::st_global_v4(d_row + 8 * (4 * i + q), words[0], words[1], words[2], words[3]);
    }
  }
}

}  // namespace epmoe::kernels
