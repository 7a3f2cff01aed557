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
// 2 (s % 2) + r / 2 holds registers r = 0, 1 (low / high 16 bits) or r = 2, 3, one 4-bit code per
// value, value j of the register in nibble j of the half word.
//
//   packed_w       [G][N / 256][K / 128][4 panels][4096 bytes]  (the checkpoint's byte count)
//   packed_scales  [G][N / 256][K / 128][4 panels][64] f32      (the checkpoint's scale count)
// Panels come in groups of 4 (256 rows; the last group of a matrix holds the N / 64 % 4 rest when
// N is not a multiple of 256): the chunks of one K block of a 128- or 256-row tile are contiguous,
// so a stage needs one bulk copy for its weights and one for its scales (panel_chunk below).
//
// Codes. A signed int4 v in [-8, 7] is stored as the nibble c = 8 h + i that two prmt lookups and
// one xor turn into the e4m3 bits of v (every int4 is exact in e4m3):
//   e4m3(v) = prmt(kLut1, c) ^ prmt(kLut2, c ^ 8)
// prmt (default mode) returns byte c & 7 of the 8-byte table when bit 3 of c is clear, else that
// byte's top bit replicated (0x00 or 0xff). Codes c and c ^ 8 share table slot i = c & 7: slot i < 4
// holds the values i (h = 0) and 4 + i (h = 1), slot i >= 4 the values -(i - 3) and -(i + 1); table 1
// has e4m3(value for h = 0) in slot i, table 2 has e4m3(value for h = 1), complemented for negative
// slots. For a positive slot both top bits are 0 and the xor leaves the looked-up byte; for a
// negative one table 1's top bit is 1, table 2's is 0: h = 0 gives table 1's byte ^ 0x00, h = 1
// gives 0xff ^ ~e4m3 = e4m3.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define EPMOE_HD __host__ __device__ __forceinline__
#else
#define EPMOE_HD inline
#endif

namespace epmoe::w4a8 {

inline constexpr int kPanelRows = 64;                         // weight rows per warpgroup
inline constexpr int kBlockK = 128;                           // K per scale group and stage
inline constexpr int kPanelBytes = kPanelRows * kBlockK / 2;  // 4096: one (panel, K block)
inline constexpr int kPanelScaleBytes = kPanelRows * 4;       // 256: its 64 scales
inline constexpr int kGroupPanels = 4;                        // panels per group (256 rows)

// Table 1 (slot 0..3 in the low word) and table 2, as prmt's {a, b} operands.
inline constexpr std::uint32_t kLut1Lo = 0x44403800u;  // e4m3(0), e4m3(1), e4m3(2), e4m3(3)
inline constexpr std::uint32_t kLut1Hi = 0xc8c4c0b8u;  // e4m3(-1), e4m3(-2), e4m3(-3), e4m3(-4)
inline constexpr std::uint32_t kLut2Lo = 0x4e4c4a48u;  // e4m3(4), e4m3(5), e4m3(6), e4m3(7)
inline constexpr std::uint32_t kLut2Hi = 0x2f313335u;  // ~e4m3(-5), ~e4m3(-6), ~e4m3(-7), ~e4m3(-8)

// The code of v in [-8, 7], and back.
EPMOE_HD std::uint32_t encode_int4(int v) {
  if (v >= 0) return static_cast<std::uint32_t>(((v >> 2) << 3) | (v & 3));
  const int a = -v - 1;  // 0..7
  return static_cast<std::uint32_t>(((a >> 2) << 3) | (4 + (a & 3)));
}
EPMOE_HD int decode_int4(std::uint32_t c) {
  const int h = static_cast<int>((c >> 3) & 1u), i = static_cast<int>(c & 7u);
  return i < 4 ? i + 4 * h : -(i - 3 + 4 * h);
}

// Index of chunk (panel, K block kb) among one matrix's chunks (4096 bytes / 64 scales each):
// groups of kGroupPanels panels, K-block-major inside a group. n_panels = N / 64.
EPMOE_HD std::int64_t panel_chunk(std::int64_t panel, std::int64_t kb, std::int64_t kb_count,
                                  std::int64_t n_panels) {
  const std::int64_t group = panel / kGroupPanels, within = panel % kGroupPanels;
  const std::int64_t rest = n_panels - group * kGroupPanels;
  const std::int64_t size = rest < kGroupPanels ? rest : kGroupPanels;
  return group * kGroupPanels * kb_count + kb * size + within;
}

// Byte offset of weight (n, k) of one group inside that group's packed bytes, and whether it is the
// high nibble. KB = K / 128, n_rows = N.
struct NibblePos {
  std::int64_t byte;
  bool high;
};
EPMOE_HD NibblePos packed_position(std::int64_t n, std::int64_t k, std::int64_t kb_count,
                                   std::int64_t n_rows) {
  const std::int64_t panel = n / kPanelRows, kb = k / kBlockK;
  const int r64 = static_cast<int>(n % kPanelRows), kk = static_cast<int>(k % kBlockK);
  const int w = r64 / 16, g = r64 % 8, rhalf = (r64 % 16) / 8;
  const int s = kk / 32, k32 = kk % 32, khalf = k32 / 16, q = (k32 % 16) / 4, j = k32 % 4;
  const int t = w * 32 + g * 4 + q;
  const int nibble = rhalf * 4 + j;  // inside the 32-bit word
  const int offset = (s / 2) * 2048 + t * 16 + ((s % 2) * 2 + khalf) * 4 + nibble / 2;
  return {panel_chunk(panel, kb, kb_count, n_rows / kPanelRows) * kPanelBytes + offset, (nibble & 1) != 0};
}

// Index of scale (n, kb) of one group inside that group's packed scales.
EPMOE_HD std::int64_t packed_scale_index(std::int64_t n, std::int64_t kb, std::int64_t kb_count,
                                         std::int64_t n_rows) {
  return panel_chunk(n / kPanelRows, kb, kb_count, n_rows / kPanelRows) * kPanelRows + n % kPanelRows;
}

// v3 (shared-memory conversion, w4a8_smem_gemm_kernel.cuh): thread t of the converter warpgroup
// holds the same 16 + 16 bytes of a (panel, K block) as above; word u (0..3 from the first 16 bytes,
// 4..7 from the second) covers k = 16 u + 4 q + j, its low half of row 16 w + g, its high half of
// row + 8. The e4m3 tile is K-major with the 128-byte swizzle (row r at r * 128, its 16-byte chunk c
// at chunk c ^ (r % 8)), so the 4 bytes of the low half go to the byte offset below inside the
// panel's 64 rows (8192 bytes), the high half's 1024 bytes further.
EPMOE_HD std::uint32_t converter_row_base(int t) {
  const int g = (t % 32) / 4, q = t % 4;
  return static_cast<std::uint32_t>((16 * (t / 32) + g) * kBlockK + 16 * g + 4 * q);
}
EPMOE_HD std::uint32_t converter_store_offset(int t, int u) {
  return converter_row_base(t) ^ static_cast<std::uint32_t>(16 * u);  // flips chunk bits 4-6 only
}

// Host model of prmt (default mode), for the CPU tests of the codes.
EPMOE_HD std::uint32_t prmt_model(std::uint32_t a, std::uint32_t b, std::uint32_t sel) {
  const std::uint64_t bytes = (static_cast<std::uint64_t>(b) << 32) | a;
  std::uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const std::uint32_t nib = (sel >> (4 * i)) & 0xfu;
    std::uint32_t byte = static_cast<std::uint32_t>(bytes >> (8 * (nib & 7u))) & 0xffu;
    if ((nib & 8u) != 0) byte = (byte & 0x80u) != 0 ? 0xffu : 0x00u;
    d |= byte << (8 * i);
  }
  return d;
}

// The e4m3 bits of the four codes in the low 16 bits of w (code j -> byte j), with prmt given as
// a callable (the instruction on the device, prmt_model on the host).
template <class Prmt>
EPMOE_HD std::uint32_t codes_to_e4m3x4(std::uint32_t w, Prmt prmt) {
  return prmt(kLut1Lo, kLut1Hi, w) ^ prmt(kLut2Lo, kLut2Hi, w ^ 0x8888u);
}

}  // namespace epmoe::w4a8
