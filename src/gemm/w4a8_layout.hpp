// The packed weight layout of the W4A8 grouped GEMM (host and device code; API in
// epmoe/cuda/w4a8_gemm.hpp): where each int4 weight and each scale lives after preparation, and the
// 4-bit code it is stored as. One definition shared by the CPU packer, the device preparation
// kernels and the GEMM kernel.
//
// The GEMM computes D^T = W · A^T: the weight tile is the wgmma A operand, taken from registers.
// A warpgroup multiplies 64 weight rows (a "panel") by the activation tile, 128 K (a "K block", one
// scale group) at a time, as four m64nNk32 steps. In the m64nNk32 A fragment, thread t of the
// warpgroup (warp w = t / 32, lane l, g = l / 4, q = l % 4) holds, for step s, four registers of four
// e4m3 values each:
//   r = 0: row 16 w + g,     k = 32 s + 4 q + j        r = 2: row 16 w + g,     k = 32 s + 16 + 4 q + j
//   r = 1: row 16 w + g + 8, k = 32 s + 4 q + j        r = 3: row 16 w + g + 8, k = 32 s + 16 + 4 q + j
// (j = 0..3 the byte of the register). Packed, one (panel, K block) is 4096 contiguous bytes, and
// thread t's 64 values of it are the 16 bytes at t * 16 (steps 0, 1) and the 16 at 2048 + t * 16
// (steps 2, 3): two conflict-free 16-byte shared-memory loads. Inside those 16 bytes, word
// 2 (s % 2) + r / 2 holds registers r = 0, 1 (r even: r = 0 or 2) as its low and high nibbles:
// byte j of the word = value j of register r (low nibble) | value j of register r + 1 (high nibble)
// << 4, i.e. one packed byte holds weights (n, k) and (n + 8, k).
//
//   packed_w       [G][N / 256][K / 128][4 panels][4096 bytes]  (the checkpoint's byte count)
//   packed_scales  [G][N / 256][K / 128][4 panels][64] bf16     (the checkpoint's scale count)
// Panels come in groups of 4 (256 rows; the last group of a matrix holds the N / 64 % 4 rest when
// N is not a multiple of 256): the chunks of one K block of a 128- or 256-row tile are contiguous,
// so a stage needs one bulk copy for its weights and one for its scales (panel_chunk below).
//
// Scales: the checkpoint's f32 scales rounded once to bf16 (nearest-even) at preparation, as SGLang's
// W4AFP8 MoE does when it loads them (`process_weights_after_loading`: `.to(torch.bfloat16)`).
// Decode reads every scale once per forward: f32 scales were 5.9% of the bytes a 128 x 8-row
// decode GEMM streams, bf16 ones are 3.0%. The kernels widen them to f32 and scale each K block's
// partial sum in f32 as before.
//
// Codes: offset binary, c = v + 8 in [0, 15] for the signed int4 v in [-8, 7]. The e4m3 byte whose
// bits are c (bits 7-4 zero) is exactly c · 2^-9: exponent field 0 (subnormal, c < 8) gives
// c / 8 · 2^-6 and exponent field 1 gives (1 + (c - 8) / 8) · 2^-6, both c · 2^-9. So a packed word
// w becomes two A-fragment registers with three integer instructions, w & 0x0f0f0f0f and
// (w >> 4) & 0x0f0f0f0f, instead of a table lookup per value. The offset is taken out on the tensor
// core: per K block, Σ_k A[m, k] · e4m3(c) + Σ_k A[m, k] · e4m3(-8 · 2^-9) = 2^-9 Σ_k A[m, k] · v,
// the second sum one more wgmma per K step with a constant operand (kOffsetE4m3x4, -2^-6 is an
// e4m3 normal; the shared-memory kernel uses a constant B operand of 8 columns instead); the
// kernels multiply by kCodeScale = 2^9 once, in the epilogue. Every product is exact, as for any
// e4m3 wgmma; the offset roughly doubles the magnitudes the tensor core sums.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__CUDACC__)
#define EPMOE_W4A8_HD __host__ __device__ __forceinline__
#else
#define EPMOE_W4A8_HD inline
#endif

namespace epmoe::w4a8 {

inline constexpr int kPanelRows = 64;                              // weight rows per warpgroup
inline constexpr int kBlockK = 128;                                // K per scale group and stage
inline constexpr int kPanelBytes = kPanelRows * kBlockK / 2;       // 4096: one (panel, K block)
inline constexpr int kScaleBytes = 2;                              // bf16 (above)
inline constexpr int kPanelScaleBytes = kPanelRows * kScaleBytes;  // 128: its 64 scales
inline constexpr int kGroupPanels = 4;                             // panels per group (256 rows)

// Four e4m3(-8 · 2^-9) = -2^-6 bytes (sign, exponent field 1, mantissa 0): the offset operand.
inline constexpr std::uint32_t kOffsetE4m3x4 = 0x88888888u;
// Its value: the offset term of a K block is kOffsetFactor · Σ_k A[m, k] (the row-sum pre-pass).
inline constexpr float kOffsetFactor = -1.0f / 64.0f;
// The row-sum pre-pass's output (w4a8_row_sums_kernel.cuh), f32 [G][K / 128][sums_rows]: rows padded
// to a multiple of 32 (the largest decode tile copies 32 consecutive ones).
EPMOE_W4A8_HD std::int64_t row_sums_rows(std::int64_t m_max) {
  return (m_max + 31) / 32 * 32;
}
EPMOE_W4A8_HD std::int64_t row_sums_index(std::int64_t g, std::int64_t num_kb, std::int64_t kb,
                                          std::int64_t sums_rows, std::int64_t r) {
  return (g * num_kb + kb) * sums_rows + r;
}
// The e4m3 value of code c is c / kCodeScale.
inline constexpr float kCodeScale = 512.0f;
inline constexpr std::uint32_t kLowNibbles = 0x0f0f0f0fu;

// The code of v in [-8, 7], and back.
EPMOE_W4A8_HD std::uint32_t encode_int4(int v) {
  return static_cast<std::uint32_t>(v + 8);
}
EPMOE_W4A8_HD int decode_int4(std::uint32_t c) {
  return static_cast<int>(c & 0xfu) - 8;
}

// The two A-fragment registers of one packed word: e4m3 bytes c · 2^-9 of its low nibbles
// (register r) and of its high nibbles (register r + 1).
EPMOE_W4A8_HD std::uint32_t codes_lo(std::uint32_t w) {
  return w & kLowNibbles;
}
EPMOE_W4A8_HD std::uint32_t codes_hi(std::uint32_t w) {
  return (w >> 4) & kLowNibbles;
}

// Sign-magnitude codes (W4A8Codes::sign_magnitude, for weights in [-7, 7] only: a symmetric amax / 7
// quantizer never produces -8): the e4m3 byte of v · 2^-9 is (sign << 7) | |v| (|v| <= 7: exponent
// field 0, subnormal), so there is no offset term. The packed word is laid out so that both
// A-fragment registers come out of it with one instruction each plus a funnel shift, as the
// offset-binary codes do (bench/NOTES.md, session 28): byte j of a 32-bit word (the same two weights
// (n, k), (n + 8, k) as above) holds |v_lo| in bits 0-2, |v_hi| in bits 4-6, the sign of v_lo in bit
// 7, and in bit 3 the sign of the high value of byte j - 1 (mod 4) of the word. Then
//   register r     = w & 0x87878787                  (|v_lo| and its sign in every byte),
//   register r + 1 = rotate_right(w, 4) & 0x87878787 (|v_hi| from bits 4-6, its sign from the next
//                                                     byte's bit 3).
// A sign with magnitude 0 (-0) reads as 0.
inline constexpr std::uint32_t kSignMagnitudeMask = 0x87878787u;
EPMOE_W4A8_HD std::uint32_t sm_codes_lo(std::uint32_t w) {
  return w & kSignMagnitudeMask;
}
EPMOE_W4A8_HD std::uint32_t sm_codes_hi(std::uint32_t w) {
  return ((w >> 4) | (w << 28)) & kSignMagnitudeMask;
}
// Whether a checkpoint byte (two two's-complement int4) holds -8, which the sign-magnitude codes lack.
EPMOE_W4A8_HD bool byte_holds_minus8(std::uint32_t b) {
  return (b & 0x0fu) == 0x08u || (b & 0xf0u) == 0x80u;
}
// Byte j of a packed word from its two values and the high value of byte j - 1 (mod 4) of the word
// (sm), or from its two values alone (offset binary).
EPMOE_W4A8_HD std::uint8_t pack_byte(int v_lo, int v_hi, int v_hi_prev, bool sm) {
  if (!sm) return static_cast<std::uint8_t>(encode_int4(v_lo) | (encode_int4(v_hi) << 4));
  const auto mag = [](int v) { return static_cast<std::uint32_t>(v < 0 ? -v : v) & 7u; };
  return static_cast<std::uint8_t>(mag(v_lo) | (v_hi_prev < 0 ? 8u : 0u) | (mag(v_hi) << 4) |
                                   (v_lo < 0 ? 0x80u : 0u));
}
// The index of the byte whose high value's sign byte `byte` carries (sm: byte j - 1 of its word), and of
// the byte that carries the sign of `byte`'s high value (byte j + 1).
EPMOE_W4A8_HD std::int64_t word_prev_byte(std::int64_t byte) {
  return (byte & ~std::int64_t{3}) | ((byte + 3) & 3);
}
EPMOE_W4A8_HD std::int64_t word_next_byte(std::int64_t byte) {
  return (byte & ~std::int64_t{3}) | ((byte + 1) & 3);
}
// The value of the low (high = false) or high nibble of packed byte `byte` (bytes: the packed weights,
// indexed as packed words are aligned).
EPMOE_W4A8_HD int unpack_value(const std::uint8_t* bytes, std::int64_t byte, bool high, bool sm) {
  const std::uint32_t b = bytes[byte];
  if (!sm) return decode_int4(b >> (high ? 4 : 0));
  const int m = static_cast<int>((high ? b >> 4 : b) & 7u);
  const bool negative = high ? (bytes[word_next_byte(byte)] & 8u) != 0 : (b & 0x80u) != 0;
  return negative ? -m : m;
}

// v3's signed conversion (W4A8SmemTraits::kSigned): the e4m3 bytes of v · 2^-9 themselves (sign and
// magnitude, no offset term) from the same codes. For a code c of a byte, nb = 1 when c < 8 (v < 0):
// the magnitude's low bits d = (c ^ 7 nb) & 7 are v (c >= 8) or 7 - c (c < 8), and the byte is
// d + 0x81 nb, i.e. v, or 0x80 | (8 - c) = e4m3(-(8 - c) · 2^-9) (|v| = 8 is exponent field 1,
// mantissa 0). Per byte, so whole words at once with no carry between bytes (d + 0x81 <= 0x88):
// about 11 integer instructions per packed word instead of 3, in the converter warpgroup, in exchange
// for the consumers' offset wgmma and its term in every fold.
EPMOE_W4A8_HD std::uint32_t signed_codes_of(std::uint32_t x, std::uint32_t high_bits) {
  // x: the codes in bits 0-2 of each byte (other bits free); high_bits: bit 3 of each code at bit 0.
  const std::uint32_t nb = ~high_bits & 0x01010101u;
  return nb * 0x81u + ((x ^ (nb * 7u)) & 0x07070707u);
}
EPMOE_W4A8_HD std::uint32_t signed_codes_lo(std::uint32_t w) {
  return signed_codes_of(w, w >> 3);
}
EPMOE_W4A8_HD std::uint32_t signed_codes_hi(std::uint32_t w) {
  return signed_codes_of(w >> 4, w >> 7);
}

// Index of chunk (panel, K block kb) among one matrix's chunks (4096 bytes / 64 scales each):
// groups of kGroupPanels panels, K-block-major inside a group. n_panels = N / 64.
EPMOE_W4A8_HD std::int64_t panel_chunk(std::int64_t panel, std::int64_t kb, std::int64_t kb_count,
                                       std::int64_t n_panels) {
  const std::int64_t group = panel / kGroupPanels, within = panel % kGroupPanels;
  const std::int64_t rest = n_panels - group * kGroupPanels;
  const std::int64_t size = rest < kGroupPanels ? rest : kGroupPanels;
  return group * kGroupPanels * kb_count + kb * size + within;
}

// panel_chunk for the tiles of the GEMM's producers, in 32 bits (fewer live registers than 64-bit
// arithmetic per K block): a tile's panels from panel0 lie in one group, so the chunk of its K block
// kb is first + kb * step, relative to the matrix's first chunk.
struct TileChunks {
  std::int32_t first, step;
};
EPMOE_W4A8_HD TileChunks tile_chunks(std::int32_t panel0, std::int32_t kb_count, std::int32_t n_panels) {
  const std::int32_t group0 = panel0 / kGroupPanels * kGroupPanels, rest = n_panels - group0;
  return {group0 * kb_count + panel0 - group0, rest < kGroupPanels ? rest : kGroupPanels};
}

// Byte offset of weight (n, k) of one group inside that group's packed bytes, and whether it is the
// high nibble. KB = K / 128, n_rows = N.
struct NibblePos {
  std::int64_t byte;
  bool high;
};
EPMOE_W4A8_HD NibblePos packed_position(std::int64_t n, std::int64_t k, std::int64_t kb_count,
                                        std::int64_t n_rows) {
  const std::int64_t panel = n / kPanelRows, kb = k / kBlockK;
  const int r64 = static_cast<int>(n % kPanelRows), kk = static_cast<int>(k % kBlockK);
  const int w = r64 / 16, g = r64 % 8, rhalf = (r64 % 16) / 8;
  const int s = kk / 32, k32 = kk % 32, khalf = k32 / 16, q = (k32 % 16) / 4, j = k32 % 4;
  const int t = w * 32 + g * 4 + q;
  const int offset = (s / 2) * 2048 + t * 16 + ((s % 2) * 2 + khalf) * 4 + j;
  return {panel_chunk(panel, kb, kb_count, n_rows / kPanelRows) * kPanelBytes + offset, rhalf != 0};
}

// The inverse for whole bytes: packed byte `byte` of one group holds weight (n, k) in its low
// nibble and (n + 8, k) in its high nibble.
struct WeightPos {
  std::int64_t n, k;
};
EPMOE_W4A8_HD WeightPos packed_byte_source(std::int64_t byte, std::int64_t kb_count, std::int64_t n_rows) {
  const std::int64_t n_panels = n_rows / kPanelRows;
  const std::int64_t chunk = byte / kPanelBytes, off = byte % kPanelBytes;
  const std::int64_t group = chunk / (kGroupPanels * kb_count), rest = chunk % (kGroupPanels * kb_count);
  const std::int64_t left = n_panels - group * kGroupPanels;
  const std::int64_t size = left < kGroupPanels ? left : kGroupPanels;
  const std::int64_t kb = rest / size, panel = group * kGroupPanels + rest % size;
  const int o = static_cast<int>(off % 2048), t = o / 16, word = (o % 16) / 4, j = o % 4;
  const int s = 2 * static_cast<int>(off / 2048) + word / 2, khalf = word % 2;
  const int w = t / 32, g = (t % 32) / 4, q = t % 4;
  return {panel * kPanelRows + 16 * w + g, kb * kBlockK + 32 * s + 16 * khalf + 4 * q + j};
}

// Index of scale (n, kb) of one group inside that group's packed scales.
EPMOE_W4A8_HD std::int64_t packed_scale_index(std::int64_t n, std::int64_t kb, std::int64_t kb_count,
                                              std::int64_t n_rows) {
  return panel_chunk(n / kPanelRows, kb, kb_count, n_rows / kPanelRows) * kPanelRows + n % kPanelRows;
}

// v3 (shared-memory conversion, w4a8_smem_gemm_kernel.cuh): thread t of the converter warpgroup
// holds the same 16 + 16 bytes of a (panel, K block) as above; word u (0..3 from the first 16 bytes,
// 4..7 from the second) covers k = 16 u + 4 q + j, its low nibbles of row 16 w + g, its high nibbles
// of row + 8. The e4m3 tile is K-major with the 128-byte swizzle (row r at r * 128, its 16-byte chunk c
// at chunk c ^ (r % 8)), so the 4 bytes of the low nibbles go to the byte offset below inside
// the panel's 64 rows (8192 bytes), the high nibbles' 1024 bytes further.
EPMOE_W4A8_HD std::uint32_t converter_row_base(int t) {
  const int g = (t % 32) / 4, q = t % 4;
  return static_cast<std::uint32_t>((16 * (t / 32) + g) * kBlockK + 16 * g + 4 * q);
}
EPMOE_W4A8_HD std::uint32_t converter_store_offset(int t, int u) {
  return converter_row_base(t) ^ static_cast<std::uint32_t>(16 * u);  // flips chunk bits 4-6 only
}

// v2's offset warp (W4A8Traits::kOffsetWarp): per K block it sums each activation row of the
// [kBM x 128] e4m3 tile with mma.sync m16n8k32 against a constant B operand (-2^-6 in every byte),
// 16 rows at a time. With a constant B the sum does not care which K a fragment byte holds, only
// its row: lane (g, q) loads 32 bytes of row g and 32 of row g + 8 (two 16-byte loads each) and
// feeds them to four mma as it likes. Which 16-byte chunks it takes does not matter for the sum
// either (nor does the tile's 128-byte swizzle, which only permutes chunks inside a row); they
// are picked so that every quarter warp's 16-byte load covers 32 distinct banks: rows g and g + 1
// are 128 bytes apart (the same banks), so odd rows start at the row's other half. Byte offset
// inside a 16-row slice of the tile for load i (0, 1) of row g + 8 half.
EPMOE_W4A8_HD std::uint32_t offset_warp_load(int lane, int half, int i) {
  const int g = lane / 4, q = lane % 4;
  const int chunk = (q + 4 * (g % 2)) ^ (4 * i);
  return static_cast<std::uint32_t>((g + 8 * half) * kBlockK + 16 * chunk);
}

// The wide tile's half tiles (a group's odd last 128-row block; W4A8Scheduler, w4a8_build_pair_table):
// how many of `grid` CTAs run them on their own (0: none; every CTA runs both kinds, the half tiles as
// whole pairs with wave 1 idle). A half tile costs a CTA about 3/5 of a whole pair's time (wave 0
// only; the conversion and the per-tile work stay): their share of that cost, rounded up (rounded to
// nearest, one CTA took ~1.1 CTAs' share of a few half tiles on 4 x 8192 and was the slowest: +14%,
// call 174), where it is at least 4 CTAs (groups of ~4096 rows and more have too few half tiles: 1-3
// CTAs of them were 1-9% slower than none on 8 x 4096 and 4 x 8192, calls 175-176; bench/NOTES.md).
// (The device code's min / max: with std::min / std::max the wide kernels grew by 16 instructions.)
EPMOE_W4A8_HD std::int32_t half_tile_ctas(std::int32_t pairs, std::int32_t halves, std::int32_t grid) {
  const std::int64_t whole = 5 * static_cast<std::int64_t>(pairs),
                     half = 3 * static_cast<std::int64_t>(halves);
  if (half == 0) return 0;
  if (whole == 0) return grid;
  if (grid * half < 4 * (whole + half)) return 0;
  const auto share = static_cast<std::int32_t>((grid * half + whole + half - 1) / (whole + half));
#if defined(__CUDA_ARCH__)
  return max(1, min(share, grid - 1));
#else
  return std::max(1, std::min(share, grid - 1));
#endif
}

}  // namespace epmoe::w4a8
