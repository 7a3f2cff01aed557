// W4A8 grouped GEMM on Hopper (sm_90a): signed int4 weights x FP8 e4m3 activations, contiguous and
// masked layouts (design.md §3, §4; issue 5). CPU twin: epmoe/grouped_gemm.hpp (w4a8_*_cpu).
//
//   D[m, n] = a_scale · Σ_kb s[g(m), n, kb] · Σ_{k in block kb} A[m, k] · Q[g(m), n, k]
//
// A e4m3 with one static per-tensor scale; Q signed int4, two per byte (the checkpoint's i4x2
// [G, N, K/2], element 2i in the low nibble); s f32, one per 128 consecutive K of each row
// ([G, N, K/128]); f32 accumulation, each 128-K block's partial sum scaled by s in f32; bf16 output.
//
// The weights are prepared once (w4a8_prepare_weights) into a packed order and 4-bit codes
// (W4A8Codes) that the kernels convert to e4m3 in registers with a few integer instructions per
// eight values (src/gemm/w4a8_layout.hpp); the packed tensors have the same shapes, dtypes and byte
// counts as the checkpoint's. Every GEMM call only enqueues one kernel on
// `stream`, or two with options.workspace (no allocation, no host synchronisation; the masked call
// reads masked_m on the device and can be captured in a CUDA graph). Tensors are Device::cuda views,
// contiguous; a, the weights and d 16-byte aligned; K and N multiples of 128. Argument errors throw
// epmoe::Error naming the argument. Needs an sm_90 GPU.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "epmoe/tensor.hpp"

namespace epmoe::cuda {

// How the prepared weights store each int4 value (w4a8_prepare_weights):
//   offset_binary:  v + 8 (any v in [-8, 7]); the kernels take the codes' offset term out per 128 K;
//   sign_magnitude: sign and |v| (v in [-7, 7] only, as a symmetric amax / 7 quantizer produces; see
//                   w4a8_pick_codes): no offset term; on one H200, 4.9-6.7% faster at K = 7168,
//                   2.2-3.5% at K = 2048 and 3-6.5% on the decode tiles of 17-32 rows, level to 0.5%
//                   slower on those of <= 12 rows (bench/NOTES.md, session 28, call 8).
// A GEMM call must name the codes its weights were prepared with (W4A8GemmOptions::codes).
enum class W4A8Codes : int { offset_binary = 0, sign_magnitude = 1 };

struct W4A8GemmOptions {
  // Activation rows per tile (the wgmma N): 0 picks by w4a8_gemm_tile(); else 16, 32, 64 or 128
  // (contiguous: 128 only, one 128-row block of m_indices per tile).
  int block_m = 0;
  // Consumer warpgroups per CTA, 64 weight rows each: 0 picks; else 2 or 4 (4 with block_m <= 64).
  int consumers = 0;
  // At most this many CTAs (persistent, one per SM); 0: as few as keep the number of tile rounds
  // that every SM of the device would run (masked: tiles estimated from expected_m).
  int max_ctas = 0;
  // Pipeline stages: 0 = as many as fit (at most 16), else 1 .. that many.
  int stages = 0;
  // Masked layout only (ignored by the contiguous call): an optional f32 device buffer of at least
  // w4a8_workspace_bytes(G, M_max, K) bytes, 16-byte aligned, that the call may overwrite. With it the
  // decode tiles (block_m <= 32) can take the codes' offset term from a pre-pass that sums each
  // activation row once per 128 K (a second kernel on `stream`, before the GEMM), instead of one more
  // wgmma per K step in every consumer warpgroup; and the 16-row tiles on the sign-magnitude codes can
  // claim their tiles dynamically (dynamic_tiles).
  // Allocate it once, beside the output, and zero it once then (cudaMemset); a call leaves its last
  // 16 bytes ready for the next call or graph replay (calls of different K, one after the other, may
  // share one workspace sized for the larger). Calls that may run at the same time (other streams)
  // need workspaces of their own.
  TensorView workspace{};
  // The 16-row masked decode tiles with W4A8Codes::sign_magnitude and a workspace: the CTAs claim tiles
  // from a counter in the workspace as they go instead of taking every gridDim-th one, so that CTAs
  // that stream faster take more tiles (a static schedule ends on its slowest CTA; 2-3.5% faster on the
  // 128 x 8 decode rows, bench/NOTES.md session 29). false: the static schedule. (Other tiles and the
  // offset-binary codes always run the static one: slower dynamically, or not built for it.)
  bool dynamic_tiles = true;
  // The codes packed_w was prepared with.
  W4A8Codes codes = W4A8Codes::offset_binary;
};

// Bytes of W4A8GemmOptions::workspace for a masked call with G groups of M_max rows and K: the row-sum
// pre-pass's sums, then 16 bytes for the dynamic schedule's counter (the workspace's last 16 bytes).
std::size_t w4a8_workspace_bytes(std::int64_t groups, std::int64_t m_max, std::int64_t k);

struct W4A8TileShape {
  int block_m = 128;  // activation rows per tile
  int consumers = 2;  // weight rows per tile = 64 * consumers
};
// Masked with expected_m <= 12: 16 activation rows x 256 weight rows (decode: reading the weights
// bounds the time, the small tile wastes no tensor work); <= 24: 32 x 256; <= 48: 64 x 256; else,
// and contiguous: 128 x 128.
W4A8TileShape w4a8_gemm_tile(bool masked, std::int64_t expected_m);

// Sizes of the prepared tensors (the checkpoint's shapes): packed_w i4x2 [G, N, K/2], packed_scales
// bf16 [G, N, K/128] (half the checkpoint's f32 scale bytes).
std::size_t w4a8_packed_weight_bytes(std::int64_t groups, std::int64_t n, std::int64_t k);
std::size_t w4a8_packed_scale_bytes(std::int64_t groups, std::int64_t n, std::int64_t k);

// Once per checkpoint: w_int4 i4x2 [G, N, K/2] and w_scales f32 [G, N, K/128] (device) -> packed_w
// i4x2 [G, N, K/2] and packed_scales bf16 [G, N, K/128] (device, distinct from the inputs) in the
// kernel's order. The scales are rounded once to bf16 (nearest-even), as SGLang's W4AFP8 MoE rounds
// the same checkpoint's scales when it loads them; the GEMM widens them to f32 and scales each
// 128-K partial sum in f32. Scales must be positive with 8 x scale finite (expect_scale's rule for the
// int4 codes, as the CPU reference's; so the bf16 scales stay finite too).
// `codes`: sign_magnitude refuses weights holding -8. The device version scans the scales (and, for
// sign_magnitude, the weights) first, waits for the scan (synchronising `stream` once) and refuses the
// first bad scale by index and value.
void w4a8_prepare_weights(TensorView w_int4, TensorView w_scales, TensorView packed_w,
                          TensorView packed_scales, cudaStream_t stream,
                          W4A8Codes codes = W4A8Codes::offset_binary);
// The inverse (tests): packed -> checkpoint order, the scales widened back to f32 (the bf16 values).
void w4a8_unprepare_weights(TensorView packed_w, TensorView packed_scales, TensorView w_int4,
                            TensorView w_scales, cudaStream_t stream,
                            W4A8Codes codes = W4A8Codes::offset_binary);
// The faster codes the checkpoint weights w_int4 (i4x2, device) allow: sign_magnitude unless some
// value is -8. Scans them on `stream` and waits for the scan.
W4A8Codes w4a8_pick_codes(TensorView w_int4, cudaStream_t stream);

// The same transforms on host tensors (CPU reference of the device ones; bit-identical).
void w4a8_prepare_weights_cpu(TensorView w_int4, TensorView w_scales, TensorView packed_w,
                              TensorView packed_scales, W4A8Codes codes = W4A8Codes::offset_binary);
void w4a8_unprepare_weights_cpu(TensorView packed_w, TensorView packed_scales, TensorView w_int4,
                                TensorView w_scales, W4A8Codes codes = W4A8Codes::offset_binary);
W4A8Codes w4a8_pick_codes_cpu(TensorView w_int4);

// a_scale: the static per-tensor activation scale, a host float, unless a_scale_device is given
// (non-empty: f32 [1] on the device, read by the kernel).

// Masked layout:
//   a [G, M_max, K] fp8_e4m3; packed_w, packed_scales as prepared; masked_m [G] i32 on the device:
//   rows [0, masked_m[g]) of group g are valid (clamped to [0, M_max]); expected_m: a host hint of
//   the typical masked_m (tile choice only). d [G, M_max, N] bf16 (out): other rows are untouched.
void w4a8_grouped_gemm_masked(TensorView a, float a_scale, TensorView a_scale_device, TensorView packed_w,
                              TensorView packed_scales, TensorView masked_m, std::int64_t expected_m,
                              TensorView d, cudaStream_t stream, const W4A8GemmOptions& options = {});

// Contiguous layout:
//   a [M, K] fp8_e4m3; m_indices [M] i32: the group of each row, -1 on padding rows; every 128-row
//   block (from row 0) holds rows of at most one group. d [M, N] bf16 (out): rows whose m_indices
//   is not the block's group are untouched.
void w4a8_grouped_gemm_contiguous(TensorView a, float a_scale, TensorView a_scale_device, TensorView packed_w,
                                  TensorView packed_scales, TensorView m_indices, TensorView d,
                                  cudaStream_t stream, const W4A8GemmOptions& options = {});

}  // namespace epmoe::cuda
