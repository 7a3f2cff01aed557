// The W4A8 packed weight layout and its int4 -> e4m3 codes, on the CPU: every code converts through
// the kernel's masks to the e4m3 c · 2^-9 that stands for its int4 value v = c - 8,
// the CPU packer and its inverse round-trip, and a thread-by-thread model of the kernel's loads
// finds every weight where the wgmma A fragment wants it. Plus the W4A8 CPU reference against a
// direct evaluation, and argument checks.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "epmoe/cuda/w4a8_gemm.hpp"
#include "epmoe/grouped_gemm.hpp"
#include "epmoe/numerics.hpp"
#include "gemm/w4a8_kernel_choice.hpp"
#include "gemm/w4a8_layout.hpp"
#include "gpu_test_util.hpp"

namespace epmoe {
namespace {

using testing::expect_error_mentions;

// The e4m3 value of a converted byte, as the int4 it stands for: e4m3(byte) · 2^9 - 8.
double code_value(std::uint32_t byte) {
  return static_cast<double>(fp8_e4m3::from_bits(static_cast<std::uint8_t>(byte)).to_float()) *
             static_cast<double>(w4a8::kCodeScale) -
         8.0;
}

TEST(W4A8Codes, EveryInt4ConvertsToItsExactE4m3) {
  // The offset operand is e4m3(-8 · 2^-9).
  EXPECT_EQ(fp8_e4m3::from_bits(static_cast<std::uint8_t>(w4a8::kOffsetE4m3x4 & 0xffu)).to_float() *
                w4a8::kCodeScale,
            -8.0f);
  for (int v = kInt4Min; v <= kInt4Max; ++v) {
    const std::uint32_t c = w4a8::encode_int4(v);
    ASSERT_LT(c, 16u);
    EXPECT_EQ(w4a8::decode_int4(c), v);
    // The same code in all eight nibbles of a word: four equal bytes in each register.
    const std::uint32_t w = c * 0x11111111u;
    for (const std::uint32_t e : {w4a8::codes_lo(w), w4a8::codes_hi(w)})
      for (int j = 0; j < 4; ++j)
        EXPECT_EQ(code_value((e >> (8 * j)) & 0xffu), v) << "v = " << v << " byte " << j;
  }
  // Mixed codes: each byte follows its own nibble (low nibbles -> codes_lo, high -> codes_hi).
  for (int trial = 0; trial < 1000; ++trial) {
    int v[8];
    std::uint32_t w = 0;
    for (int i = 0; i < 8; ++i) {
      v[i] = (trial * (2 * i + 1) + 3 * i) % 16 - 8;
      w |= w4a8::encode_int4(v[i]) << (4 * i);
    }
    for (int j = 0; j < 4; ++j) {
      EXPECT_EQ(code_value((w4a8::codes_lo(w) >> (8 * j)) & 0xffu), v[2 * j]);
      EXPECT_EQ(code_value((w4a8::codes_hi(w) >> (8 * j)) & 0xffu), v[2 * j + 1]);
    }
  }
}

// A conversion to e4m3(v · 2^-9) bytes (to_lo / to_hi: the two registers of a packed word, decode:
// a nibble's value) gives every byte its own value, for every code in every nibble of a word (trial %
// 16 in nibble trial / 16 % 8, the rest random), whatever its neighbours (no carry between bytes).
template <class ToLo, class ToHi, class Decode>
void expect_each_byte_its_e4m3(ToLo to_lo, ToHi to_hi, Decode decode, std::uint64_t seed) {
  const auto value = [](std::uint32_t byte) {
    return static_cast<double>(fp8_e4m3::from_bits(static_cast<std::uint8_t>(byte)).to_float()) *
           static_cast<double>(w4a8::kCodeScale);
  };
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 4096; ++trial) {
    std::uint32_t w = static_cast<std::uint32_t>(rng());
    const int nibble = (trial / 16) % 8;
    w = (w & ~(0xfu << (4 * nibble))) | (static_cast<std::uint32_t>(trial % 16) << (4 * nibble));
    const std::uint32_t lo = to_lo(w), hi = to_hi(w);
    for (int j = 0; j < 4; ++j) {
      const int v_lo = decode(w >> (8 * j)), v_hi = decode(w >> (8 * j + 4));
      ASSERT_EQ(value((lo >> (8 * j)) & 0xffu), v_lo) << std::hex << "w = " << w << " byte " << j;
      ASSERT_EQ(value((hi >> (8 * j)) & 0xffu), v_hi) << std::hex << "w = " << w << " byte " << j;
    }
  }
}

// v3's signed conversion (w4a8::signed_codes_lo / _hi) of the offset-binary codes.
TEST(W4A8Codes, SignedConversionGivesEachInt4ItsOwnE4m3) {
  expect_each_byte_its_e4m3(w4a8::signed_codes_lo, w4a8::signed_codes_hi, w4a8::decode_int4, 11);
}

// The sign-magnitude words (w4a8::pack_byte with sm, w4a8::sm_codes_lo / _hi): every v in [-7, 7] in
// every value of every byte of a word, the other seven random, converts to its own e4m3 byte and
// unpacks to itself (w4a8::unpack_value), the high values' signs coming from the next byte.
TEST(W4A8Codes, SignMagnitudeConversionGivesEachInt4ItsOwnE4m3) {
  const auto value = [](std::uint32_t byte) {
    return static_cast<double>(fp8_e4m3::from_bits(static_cast<std::uint8_t>(byte)).to_float()) *
           static_cast<double>(w4a8::kCodeScale);
  };
  std::mt19937_64 rng(12);
  std::uniform_int_distribution<int> any(-7, 7);
  for (int trial = 0; trial < 8 * 15 * 8; ++trial) {
    int v[8];  // byte j: v[2 j] low, v[2 j + 1] high
    for (int& x : v) x = any(rng);
    v[trial % 8] = trial / 8 % 15 - 7;
    std::uint8_t bytes[4];
    for (int j = 0; j < 4; ++j)
      bytes[j] = w4a8::pack_byte(v[2 * j], v[2 * j + 1], v[2 * ((j + 3) % 4) + 1], true);
    std::uint32_t w = 0;
    std::memcpy(&w, bytes, 4);
    const std::uint32_t lo = w4a8::sm_codes_lo(w), hi = w4a8::sm_codes_hi(w);
    for (int j = 0; j < 4; ++j) {
      ASSERT_EQ(value((lo >> (8 * j)) & 0xffu), v[2 * j]) << std::hex << "w = " << w << " byte " << j;
      ASSERT_EQ(value((hi >> (8 * j)) & 0xffu), v[2 * j + 1]) << std::hex << "w = " << w << " byte " << j;
      ASSERT_EQ(w4a8::unpack_value(bytes, j, false, true), v[2 * j]);
      ASSERT_EQ(w4a8::unpack_value(bytes, j, true, true), v[2 * j + 1]);
    }
  }
}

// The CPU packer with the sign-magnitude codes: round trip, the choice of codes, -8 refused.
TEST(W4A8Codes, SignMagnitudePackingRoundTripsAndRefusesMinus8) {
  constexpr auto kSM = cuda::W4A8Codes::sign_magnitude;
  const std::int64_t G = 2, N = 256, K = 384;
  HostTensor w(DType::i4x2, {G, N, K / 2}), s(DType::f32, {G, N, K / 128});
  std::mt19937_64 rng(13);
  auto* b = static_cast<std::uint8_t*>(w.view().data);
  for (std::int64_t i = 0; i < w.numel(); ++i) {
    const int lo = static_cast<int>(rng() % 15) - 7, hi = static_cast<int>(rng() % 15) - 7;
    b[i] = pack_int4(lo, hi);
  }
  for (std::int64_t i = 0; i < s.numel(); ++i) s.data<float>()[i] = 1e-3f * static_cast<float>(1 + i % 7);
  EXPECT_EQ(cuda::w4a8_pick_codes_cpu(w), kSM);
  HostTensor pw(DType::i4x2, {G, N, K / 2}), ps(DType::bf16, {G, N, K / 128});
  HostTensor w2(DType::i4x2, {G, N, K / 2}), s2(DType::f32, {G, N, K / 128});
  cuda::w4a8_prepare_weights_cpu(w, s, pw, ps, kSM);
  cuda::w4a8_unprepare_weights_cpu(pw, ps, w2, s2, kSM);
  EXPECT_EQ(std::memcmp(w.view().data, w2.view().data, w.nbytes()), 0);
  // The offset-binary packing of the same weights differs (the codes are not the same bytes).
  HostTensor pw_ob(DType::i4x2, {G, N, K / 2}), ps_ob(DType::bf16, {G, N, K / 128});
  cuda::w4a8_prepare_weights_cpu(w, s, pw_ob, ps_ob);
  EXPECT_NE(std::memcmp(pw.view().data, pw_ob.view().data, pw.nbytes()), 0);
  b[5] = pack_int4(3, -8);
  EXPECT_EQ(cuda::w4a8_pick_codes_cpu(w), cuda::W4A8Codes::offset_binary);
  expect_error_mentions([&] { cuda::w4a8_prepare_weights_cpu(w, s, pw, ps, kSM); }, "holds -8");
  expect_error_mentions(
      [&] { cuda::w4a8_prepare_weights_cpu(w, s, pw, ps, static_cast<cuda::W4A8Codes>(7)); },
      "W4A8Codes must be offset_binary (0) or sign_magnitude (1), got 7");
}

struct Checkpoint {
  HostTensor w, s;
};
// (symmetric: values in [-7, 7] only, as the sign-magnitude codes need; else every int4 value)
Checkpoint random_checkpoint(std::int64_t G, std::int64_t N, std::int64_t K, std::mt19937_64& rng,
                             bool symmetric = false) {
  Checkpoint c{HostTensor(DType::i4x2, {G, N, K / 2}), HostTensor(DType::f32, {G, N, K / 128})};
  auto* w = static_cast<std::uint8_t*>(c.w.view().data);
  std::uniform_int_distribution<int> any(-7, 7);
  for (std::int64_t i = 0; i < c.w.numel(); ++i)
    w[i] = symmetric ? pack_int4(any(rng), any(rng)) : static_cast<std::uint8_t>(rng());
  std::uniform_real_distribution<float> u(0.5f, 2.0f);
  for (std::int64_t i = 0; i < c.s.numel(); ++i) c.s.data<float>()[i] = u(rng) * 1e-3f;
  return c;
}

class W4A8PackN : public ::testing::TestWithParam<std::int64_t> {};

// N = 640: the last panel group holds 2 panels.
TEST_P(W4A8PackN, RoundTripsAndIsAPermutation) {
  std::mt19937_64 rng(7);
  const std::int64_t G = 2, N = GetParam(), K = 384;
  const Checkpoint c = random_checkpoint(G, N, K, rng);
  HostTensor pw(DType::i4x2, {G, N, K / 2}), ps(DType::bf16, {G, N, K / 128});
  cuda::w4a8_prepare_weights_cpu(c.w, c.s, pw, ps);
  HostTensor w2(DType::i4x2, {G, N, K / 2}), s2(DType::f32, {G, N, K / 128});
  cuda::w4a8_unprepare_weights_cpu(pw, ps, w2, s2);
  EXPECT_EQ(std::memcmp(c.w.view().data, w2.view().data, c.w.nbytes()), 0);
  // The scales come back as their bf16 roundings (nearest-even), each within a relative 2^-8 (half a bf16
  // ulp) of the checkpoint's.
  std::int64_t inexact = 0;
  for (std::int64_t i = 0; i < c.s.numel(); ++i) {
    const float want = c.s.data<float>()[i];
    ASSERT_EQ(s2.data<float>()[i], round_to_bf16(want)) << "scale " << i;
    ASSERT_LE(std::abs(s2.data<float>()[i] - want), std::ldexp(std::abs(want), -8)) << "scale " << i;
    inexact += s2.data<float>()[i] != want ? 1 : 0;
  }
  EXPECT_GT(inexact, 0);  // the random scales are not bf16 values: the rounding was exercised
  // Every nibble position is hit exactly once, and packed_byte_source inverts packed_position:
  // a byte holds (n, k) low and (n + 8, k) high.
  std::vector<int> hits(static_cast<std::size_t>(N * K));
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t k = 0; k < K; ++k) {
      const w4a8::NibblePos pos = w4a8::packed_position(n, k, K / 128, N);
      ASSERT_TRUE(pos.byte >= 0 && pos.byte < N * K / 2);
      ASSERT_EQ(pos.high, n % 16 >= 8);
      ++hits[static_cast<std::size_t>(2 * pos.byte + (pos.high ? 1 : 0))];
      const w4a8::WeightPos src = w4a8::packed_byte_source(pos.byte, K / 128, N);
      ASSERT_EQ(src.n + (pos.high ? 8 : 0), n);
      ASSERT_EQ(src.k, k);
    }
  for (const int h : hits) ASSERT_EQ(h, 1);
  std::vector<int> scale_hits(static_cast<std::size_t>(N * K / 128));
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t kb = 0; kb < K / 128; ++kb)
      ++scale_hits[static_cast<std::size_t>(w4a8::packed_scale_index(n, kb, K / 128, N))];
  for (const int h : scale_hits) ASSERT_EQ(h, 1);
}
INSTANTIATE_TEST_SUITE_P(N, W4A8PackN, ::testing::Values(256, 640));

// The chunks of one K block of a 128-row tile (and of a 256-row tile when N is a multiple of 256)
// are consecutive (one bulk copy per stage), and the chunk index is a permutation.
TEST(W4A8Pack, TileChunksAreContiguous) {
  for (const std::int64_t N : {128, 384, 640, 4096, 7168}) {
    for (const std::int64_t KB : {1, 3, 56}) {
      const std::int64_t P = N / 64;
      std::vector<int> hits(static_cast<std::size_t>(P * KB));
      for (std::int64_t panel = 0; panel < P; ++panel)
        for (std::int64_t kb = 0; kb < KB; ++kb) {
          const std::int64_t c = w4a8::panel_chunk(panel, kb, KB, P);
          ASSERT_TRUE(c >= 0 && c < P * KB);
          ++hits[static_cast<std::size_t>(c)];
        }
      for (const int h : hits) ASSERT_EQ(h, 1);
      for (const std::int64_t tile_panels : {2, 4}) {
        if (P % tile_panels != 0) continue;
        for (std::int64_t p0 = 0; p0 < P; p0 += tile_panels)
          for (std::int64_t kb = 0; kb < KB; ++kb)
            for (std::int64_t i = 1; i < tile_panels; ++i)
              ASSERT_EQ(w4a8::panel_chunk(p0 + i, kb, KB, P), w4a8::panel_chunk(p0, kb, KB, P) + i)
                  << "N " << N << " KB " << KB << " panel " << p0 + i;
      }
      // The producers' 32-bit form (w4a8::tile_chunks) names the same chunks.
      for (std::int64_t p0 = 0; p0 < P; ++p0) {
        const w4a8::TileChunks t = w4a8::tile_chunks(
            static_cast<std::int32_t>(p0), static_cast<std::int32_t>(KB), static_cast<std::int32_t>(P));
        for (std::int64_t kb = 0; kb < KB; ++kb)
          ASSERT_EQ(t.first + kb * t.step, w4a8::panel_chunk(p0, kb, KB, P))
              << "N " << N << " KB " << KB << " panel " << p0;
      }
    }
  }
}

// The kernel's view: thread t of the warpgroup loads 16 bytes at t * 16 and at 2048 + t * 16 of a
// (panel, K block) chunk, converts word 2 (s % 2) + khalf into registers (r = 2 khalf, 2 khalf + 1)
// of step s (low and high nibbles), and wgmma reads register r, byte j as A[row, k] with the m64nNk32
// fragment layout.
// For both codes (the sign-magnitude ones on weights in [-7, 7]).
class W4A8PackCodes : public ::testing::TestWithParam<cuda::W4A8Codes> {};

TEST_P(W4A8PackCodes, KernelLoadsMatchTheWgmmaFragment) {
  const bool sm = GetParam() == cuda::W4A8Codes::sign_magnitude;
  std::mt19937_64 rng(11);
  const std::int64_t G = 1, N = 128, K = 256, KB = K / 128;
  const Checkpoint c = random_checkpoint(G, N, K, rng, sm);
  HostTensor pw(DType::i4x2, {G, N, K / 2}), ps(DType::bf16, {G, N, K / 128});
  cuda::w4a8_prepare_weights_cpu(c.w, c.s, pw, ps, GetParam());
  const auto value = [&](std::uint32_t byte) {  // the register byte's int4 value
    return sm ? static_cast<double>(fp8_e4m3::from_bits(static_cast<std::uint8_t>(byte)).to_float()) *
                    static_cast<double>(w4a8::kCodeScale)
              : code_value(byte);
  };
  const auto* packed = static_cast<const std::uint8_t*>(pw.view().data);
  const auto* plain = static_cast<const std::uint8_t*>(c.w.view().data);
  std::int64_t checked = 0;
  for (std::int64_t panel = 0; panel < N / 64; ++panel) {
    for (std::int64_t kb = 0; kb < KB; ++kb) {
      const std::uint8_t* chunk = packed + w4a8::panel_chunk(panel, kb, KB, N / 64) * w4a8::kPanelBytes;
      for (int t = 0; t < 128; ++t) {
        std::uint32_t words[8];
        std::memcpy(words, chunk + t * 16, 16);
        std::memcpy(words + 4, chunk + 2048 + t * 16, 16);
        const int warp = t / 32, lane = t % 32, g = lane / 4, q = lane % 4;
        for (int s = 0; s < 4; ++s) {
          for (int khalf = 0; khalf < 2; ++khalf) {
            const std::uint32_t w = words[(s / 2) * 4 + (s % 2) * 2 + khalf];
            const std::uint32_t regs[2] = {sm ? w4a8::sm_codes_lo(w) : w4a8::codes_lo(w),
                                           sm ? w4a8::sm_codes_hi(w) : w4a8::codes_hi(w)};
            for (int rhalf = 0; rhalf < 2; ++rhalf) {
              for (int j = 0; j < 4; ++j) {
                const std::int64_t row = panel * 64 + warp * 16 + g + 8 * rhalf;
                const std::int64_t k = kb * 128 + s * 32 + khalf * 16 + 4 * q + j;
                const int v = unpack_int4(plain + row * (K / 2), k);
                ASSERT_EQ(value((regs[rhalf] >> (8 * j)) & 0xffu), v)
                    << "panel " << panel << " kb " << kb << " thread " << t << " step " << s << " row " << row
                    << " k " << k;
                ++checked;
              }
            }
          }
        }
        // The two scales of the thread's rows.
        const bf16* scales = ps.data<bf16>() + w4a8::panel_chunk(panel, kb, KB, N / 64) * 64;
        EXPECT_EQ(scales[warp * 16 + g].bits,
                  bf16::from_float(c.s.data<float>()[(panel * 64 + warp * 16 + g) * KB + kb]).bits);
        EXPECT_EQ(scales[warp * 16 + g + 8].bits,
                  bf16::from_float(c.s.data<float>()[(panel * 64 + warp * 16 + g + 8) * KB + kb]).bits);
      }
    }
  }
  EXPECT_EQ(checked, N * K);
}
INSTANTIATE_TEST_SUITE_P(Codes, W4A8PackCodes,
                         ::testing::Values(cuda::W4A8Codes::offset_binary, cuda::W4A8Codes::sign_magnitude));

// v3: a thread-by-thread model of the converter warpgroup (w4a8_smem_gemm_kernel.cuh) writes every
// weight's e4m3 exactly once where the 128-byte-swizzled K-major wgmma B tile wants it (row n at
// n * 128, 16-byte chunk k / 16 at chunk (k / 16) ^ (n % 8)), and each of its 4-byte stores is
// free of bank conflicts (the 32 lanes hit 32 distinct banks).
TEST(W4A8Pack, ConverterStoresMatchTheSwizzledTile) {
  std::mt19937_64 rng(12);
  const std::int64_t G = 1, N = 256, K = 256, KB = K / 128;
  const Checkpoint c = random_checkpoint(G, N, K, rng);
  HostTensor pw(DType::i4x2, {G, N, K / 2}), ps(DType::bf16, {G, N, K / 128});
  cuda::w4a8_prepare_weights_cpu(c.w, c.s, pw, ps);
  const auto* packed = static_cast<const std::uint8_t*>(pw.view().data);
  const auto* plain = static_cast<const std::uint8_t*>(c.w.view().data);
  constexpr int kTileN = 256;  // the converter's tile: kTileN / 64 panels
  for (std::int64_t kb = 0; kb < KB; ++kb) {
    std::vector<std::uint8_t> tile(kTileN * 128, 0);
    std::vector<int> writes(tile.size(), 0);
    for (int panel = 0; panel < kTileN / 64; ++panel) {
      const std::uint8_t* chunk = packed + w4a8::panel_chunk(panel, kb, KB, N / 64) * w4a8::kPanelBytes;
      for (int u = 0; u < 8; ++u) {
        for (int half = 0; half < 2; ++half) {
          for (int warp = 0; warp < 4; ++warp) {
            std::vector<int> banks;
            for (int lane = 0; lane < 32; ++lane) {
              const int t = warp * 32 + lane;
              std::uint32_t words[8];
              std::memcpy(words, chunk + t * 16, 16);
              std::memcpy(words + 4, chunk + 2048 + t * 16, 16);
              const std::uint32_t e = half == 0 ? w4a8::codes_lo(words[u]) : w4a8::codes_hi(words[u]);
              const std::uint32_t at = static_cast<std::uint32_t>(panel * 64 * 128) +
                                       w4a8::converter_store_offset(t, u) + 1024u * half;
              ASSERT_EQ(at % 4, 0u);
              ASSERT_LT(at + 4, tile.size() + 1);
              banks.push_back(static_cast<int>((at / 4) % 32));
              for (int j = 0; j < 4; ++j) {
                tile[at + j] = static_cast<std::uint8_t>(e >> (8 * j));
                ++writes[at + j];
              }
            }
            std::sort(banks.begin(), banks.end());
            EXPECT_EQ(std::unique(banks.begin(), banks.end()), banks.end())
                << "bank conflict: panel " << panel << " word " << u << " half " << half << " warp " << warp;
          }
        }
      }
    }
    for (int n = 0; n < kTileN; ++n) {
      for (int k = 0; k < 128; ++k) {
        const std::size_t at = static_cast<std::size_t>(n * 128 + (((k / 16) ^ (n % 8)) * 16) + k % 16);
        ASSERT_EQ(writes[at], 1) << "n " << n << " k " << k;
        const int v = unpack_int4(plain + n * (K / 2), kb * 128 + k);
        ASSERT_EQ(code_value(tile[at]), v) << "kb " << kb << " n " << n << " k " << k;
      }
    }
  }
  // The scales in packed order are the tile's columns in order (panel-major, 64 rows each): what
  // the converter copies, column i of the tile from packed index (panel, kb, i % 64).
  for (std::int64_t kb = 0; kb < KB; ++kb)
    for (int i = 0; i < kTileN; ++i)
      EXPECT_EQ(ps.data<bf16>()[w4a8::panel_chunk(i / 64, kb, KB, N / 64) * 64 + i % 64].bits,
                bf16::from_float(c.s.data<float>()[i * KB + kb]).bits);
}

// v2's offset warp (w4a8_grouped_gemm_kernel.cuh, kOffsetWarp): a lane-by-lane model of its
// shared loads over a 16-row slice of the activation tile reads every byte exactly once, into a
// fragment register of the byte's own row (the load of `half` feeds a[1], a[3] of mma.sync m16n8k32,
// row g + 8; else a[0], a[2], row g), so that against the constant B each mma row is that row's sum
// whatever the swizzle; and each 16-byte load is free of bank conflicts (every quarter warp, 8
// lanes x 16 bytes, covers the 32 banks once).
TEST(W4A8Pack, OffsetWarpLoadsCoverEveryRowOnce) {
  std::vector<int> reads(16 * 128, 0);
  for (int half = 0; half < 2; ++half) {
    for (int i = 0; i < 2; ++i) {
      for (int quarter = 0; quarter < 4; ++quarter) {
        std::vector<int> banks;
        for (int lane = 8 * quarter; lane < 8 * quarter + 8; ++lane) {
          const std::uint32_t at = w4a8::offset_warp_load(lane, half, i);
          ASSERT_EQ(at % 16, 0u);
          ASSERT_EQ(static_cast<int>(at / 128), lane / 4 + 8 * half) << "lane " << lane << " half " << half;
          for (std::uint32_t b = 0; b < 16; ++b) ++reads[at + b];
          for (std::uint32_t w = 0; w < 4; ++w) banks.push_back(static_cast<int>((at / 4 + w) % 32));
        }
        std::sort(banks.begin(), banks.end());
        EXPECT_EQ(std::unique(banks.begin(), banks.end()) - banks.begin(), 32)
            << "bank conflict: half " << half << " load " << i << " quarter " << quarter;
      }
    }
  }
  for (std::size_t b = 0; b < reads.size(); ++b) ASSERT_EQ(reads[b], 1) << "byte " << b;
}

TEST(W4A8Pack, RefusesBadArguments) {
  const HostTensor w(DType::i4x2, {2, 128, 128}), s(DType::f32, {2, 128, 2});
  HostTensor pw(DType::i4x2, {2, 128, 128}), ps(DType::bf16, {2, 128, 2});
  std::fill_n(s.data<float>(), s.numel(), 0.25f);
  EXPECT_NO_THROW(cuda::w4a8_prepare_weights_cpu(w, s, pw, ps));
  const HostTensor w_k(DType::i4x2, {2, 128, 100});
  expect_error_mentions([&] { cuda::w4a8_prepare_weights_cpu(w_k, s, pw, ps); },
                        "w_int4: K = 200 (2 x its last dimension) must be a positive multiple of 128");
  const HostTensor w_n(DType::i4x2, {2, 100, 128});
  expect_error_mentions([&] { cuda::w4a8_prepare_weights_cpu(w_n, s, pw, ps); },
                        "w_int4: N = 100 must be a positive multiple of 128");
  const HostTensor w_u8(DType::u8, {2, 128, 128});
  expect_error_mentions([&] { cuda::w4a8_prepare_weights_cpu(w_u8, s, pw, ps); },
                        "w_int4 must have dtype i4x2");
  const HostTensor s_bad(DType::f32, {2, 128, 4});
  expect_error_mentions([&] { cuda::w4a8_prepare_weights_cpu(w, s_bad, pw, ps); },
                        "w_scales must have shape");
  // Scales of 1 but for one value: NaN, zero and negative ones are refused (as the CPU GEMM reference
  // refuses them), and so is one whose -8 code would overflow (3.4e38, also infinite as a packed bf16).
  const auto scales_with = [](std::int64_t i, float v) {
    HostTensor t(DType::f32, {2, 128, 2});
    std::fill_n(t.data<float>(), t.numel(), 1.0f);
    t.data<float>()[i] = v;
    return t;
  };
  for (const auto& [i, v, shown] : {std::tuple{5, std::nanf(""), "nan"}, std::tuple{0, 0.0f, "0"},
                                    std::tuple{511, -0.5f, "-0.5"}, std::tuple{3, 3.4e38f, "3.4e+38"}}) {
    const HostTensor bad = scales_with(i, v);
    expect_error_mentions(
        [&] { cuda::w4a8_prepare_weights_cpu(w, bad, pw, ps); },
        fmt::format("w_scales must be positive and finite, with 8 x it finite: element {} is {}", i, shown));
  }
  const HostTensor ps_f32(DType::f32, {2, 128, 2});
  expect_error_mentions([&] { cuda::w4a8_prepare_weights_cpu(w, s, pw, ps_f32); },
                        "packed_scales must have dtype bf16");
  const HostTensor s_bf16(DType::bf16, {2, 128, 2});
  expect_error_mentions([&] { cuda::w4a8_prepare_weights_cpu(w, s_bf16, pw, ps); },
                        "w_scales must have dtype f32");
  const HostTensor pw_small(DType::i4x2, {1, 128, 128});
  const HostTensor ps_small(DType::bf16, {1, 128, 2});
  expect_error_mentions([&] { cuda::w4a8_prepare_weights_cpu(w, s, pw_small, ps_small); },
                        "must have the shape of the input weights");
  expect_error_mentions([&] { cuda::w4a8_prepare_weights_cpu(w, s, w, ps); }, "must not alias the inputs");
  // The offset warp is a variant of v2 only.
  expect_error_mentions([&] { cuda::w4a8_pin_kernel({.version = 3, .offset_warp = 1}); },
                        "W4A8 offset_warp must be 0, or 1 with version 2, got 1 with version 3");
  expect_error_mentions([&] { cuda::w4a8_pin_kernel({.version = 2, .offset_warp = 2}); },
                        "W4A8 offset_warp must be 0, or 1 with version 2");
  EXPECT_NO_THROW(cuda::w4a8_pin_kernel({.version = 2, .offset_warp = 1}));
  // Two or three K blocks per stage: v2 only, three without the offset warp.
  EXPECT_NO_THROW(cuda::w4a8_pin_kernel({.version = 2, .stage_k_blocks = 2}));
  EXPECT_NO_THROW(cuda::w4a8_pin_kernel({.version = 2, .stage_k_blocks = 3}));
  EXPECT_NO_THROW(cuda::w4a8_pin_kernel({.version = 2, .offset_warp = 1, .stage_k_blocks = 2}));
  expect_error_mentions([&] { cuda::w4a8_pin_kernel({.version = 2, .offset_warp = 1, .stage_k_blocks = 3}); },
                        "got 3 with version 2 and offset_warp 1");
  expect_error_mentions([&] { cuda::w4a8_pin_kernel({.version = 3, .stage_k_blocks = 2}); },
                        "got 2 with version 3 and offset_warp 0");
  expect_error_mentions([&] { cuda::w4a8_pin_kernel({.version = 2, .stage_k_blocks = 4}); },
                        "W4A8 stage_k_blocks must be 0 or 1, 2 with version 2, or 3");
  // Two partials on the 32-row tile: v2 without the offset warp.
  EXPECT_NO_THROW(cuda::w4a8_pin_kernel({.version = 2, .stage_k_blocks = 2, .parts = 2}));
  expect_error_mentions([&] { cuda::w4a8_pin_kernel({.version = 2, .offset_warp = 1, .parts = 2}); },
                        "W4A8 parts must be 0 or 1, or 2 with version 2 and no offset warp, got 2");
  expect_error_mentions([&] { cuda::w4a8_pin_kernel({.version = 2, .parts = 3}); }, "W4A8 parts must be");
  // The row-sum pre-pass: v2 without the offset warp.
  EXPECT_NO_THROW(cuda::w4a8_pin_kernel({.version = 2, .parts = 2, .row_sums = 1}));
  expect_error_mentions(
      [&] { cuda::w4a8_pin_kernel({.version = 3, .row_sums = 1}); },
      "W4A8 row_sums must be 0, or 1 with version 2 and no offset warp, got 1 with version 3");
  expect_error_mentions([&] { cuda::w4a8_pin_kernel({.version = 2, .offset_warp = 1, .row_sums = 1}); },
                        "got 1 with version 2 and offset_warp 1");
  expect_error_mentions([&] { cuda::w4a8_pin_kernel({.version = 2, .row_sums = 2}); },
                        "W4A8 row_sums must be");
  cuda::w4a8_pin_kernel({});
}

// The automatic choice (bench/NOTES.md, W4A8 v6): decode rows (expected_m <= 24) take the plain
// register-operand kernel, one K block per stage (the offset-warp variants stay pinned-only:
// racecheck), the rest v3.
TEST(W4A8KernelChoice, DecodeTilesAndTheRest) {
  const auto is = [](const cuda::W4A8KernelChoice& c, int version, int offset_warp, int stage_k_blocks) {
    return c.version == version && c.offset_warp == offset_warp && c.stage_k_blocks == stage_k_blocks;
  };
  EXPECT_TRUE(is(cuda::w4a8_kernel_choice(true, 1, 4096, 7168), 2, 0, 0));
  EXPECT_TRUE(is(cuda::w4a8_kernel_choice(true, 8, 7168, 2048), 2, 0, 0));
  EXPECT_TRUE(is(cuda::w4a8_kernel_choice(true, 12, 640, 2048), 2, 0, 0));
  EXPECT_TRUE(is(cuda::w4a8_kernel_choice(true, 16, 4096, 7168), 2, 0, 0));
  EXPECT_TRUE(is(cuda::w4a8_kernel_choice(true, 24, 7168, 2048), 2, 0, 0));
  EXPECT_EQ(cuda::w4a8_kernel_choice(true, 32, 4096, 7168).version, 3);
  // Masked groups of 25..64 rows: v3's 64 x 256 tile with the offset-binary codes; larger: v2's signed
  // 128 x 128 (below).
  const auto expect_v3 = [](const cuda::W4A8KernelChoice& c, int block_m, int block_n, int waves,
                            int signed_codes) {
    EXPECT_EQ(c.version, 3);
    EXPECT_EQ(c.block_m, block_m);
    EXPECT_EQ(c.block_n, block_n);
    EXPECT_EQ(c.waves, waves);
    EXPECT_EQ(c.signed_codes, signed_codes);
  };
  // Contiguous: v2 with signed codes, its wide tile for groups of >= 128 rows on average (the hint:
  // M / groups), else 128 x 128; the wide tile's kernel without the half-tile loop from 2048 rows.
  for (const auto& [m, block_m, half_tiles] : {std::tuple<std::int64_t, int, int>{0, 128, 0},
                                               {127, 128, 0},
                                               {128, 256, 1},
                                               {1024, 256, 1},
                                               {2047, 256, 1},
                                               {2048, 256, 2},
                                               {4096, 256, 2}}) {
    const cuda::W4A8KernelChoice c = cuda::w4a8_kernel_choice(false, m, 7168, 2048);
    EXPECT_EQ(c.version, 2);
    EXPECT_EQ(c.block_m, block_m);
    EXPECT_EQ(c.signed_codes, 1);
    EXPECT_EQ(c.half_tiles, half_tiles) << "M / groups = " << m;
  }
  expect_v3(cuda::w4a8_kernel_choice(true, 40, 4096, 7168), 64, 256, 1, 0);
  expect_v3(cuda::w4a8_kernel_choice(true, 64, 4096, 7168), 64, 256, 1, 0);
  for (const std::int64_t m : {65, 128, 192, 4096}) {
    const cuda::W4A8KernelChoice c = cuda::w4a8_kernel_choice(true, m, 7168, 2048);
    EXPECT_EQ(c.version, 2) << "expected_m = " << m;
    EXPECT_EQ(c.block_m, 128) << "expected_m = " << m;
    EXPECT_EQ(c.signed_codes, 1) << "expected_m = " << m;
  }
  // The signed conversion: v3, and v2's 128- and 256-row tiles without its other variants.
  EXPECT_NO_THROW(cuda::w4a8_pin_kernel({.version = 2, .signed_codes = 1}));
  EXPECT_NO_THROW(cuda::w4a8_pin_kernel({.version = 2, .block_m = 256, .signed_codes = 1}));
  EXPECT_NO_THROW(cuda::w4a8_pin_kernel({.version = 2, .block_m = 128, .signed_codes = 1}));
  expect_error_mentions([&] { cuda::w4a8_pin_kernel({.version = 2, .block_m = 64, .signed_codes = 1}); },
                        "signed_codes");
  // The wide tile with and without its half-tile loop: that tile only.
  EXPECT_NO_THROW(cuda::w4a8_pin_kernel({.version = 2, .block_m = 256, .signed_codes = 1, .half_tiles = 1}));
  EXPECT_NO_THROW(cuda::w4a8_pin_kernel({.version = 2, .block_m = 256, .signed_codes = 1, .half_tiles = 2}));
  expect_error_mentions(
      [&] { cuda::w4a8_pin_kernel({.version = 2, .block_m = 128, .signed_codes = 1, .half_tiles = 1}); },
      "half_tiles");
  expect_error_mentions(
      [&] { cuda::w4a8_pin_kernel({.version = 2, .block_m = 128, .signed_codes = 1, .half_tiles = 2}); },
      "half_tiles");
  expect_error_mentions([&] { cuda::w4a8_pin_kernel({.version = 3, .half_tiles = 2}); }, "half_tiles");
  expect_error_mentions([&] { cuda::w4a8_pin_kernel({.half_tiles = 3}); }, "half_tiles");
  expect_error_mentions([&] { cuda::w4a8_pin_kernel({.version = 2, .offset_warp = 1, .signed_codes = 1}); },
                        "signed_codes");
  expect_error_mentions([&] { cuda::w4a8_pin_kernel({.version = 2, .row_sums = 1, .signed_codes = 1}); },
                        "signed_codes");
  cuda::w4a8_pin_kernel({});
  // The offset-binary two-wave tile does not exist.
  expect_error_mentions(
      [&] {
        cuda::w4a8_resolve_v3({.version = 3, .block_m = 128, .block_n = 256, .waves = 2}, false, 0, 4096);
      },
      "waves = 2, signed_codes = 0");
  // The tall tile (256 x 128, two 64-row waves per consumer): its zeros filled, contiguous and signed
  // only.
  expect_v3(cuda::w4a8_resolve_v3({.version = 3, .block_m = 256, .signed_codes = 1}, false, 0, 4096), 256,
            128, 2, 1);
  expect_error_mentions(
      [&] { cuda::w4a8_resolve_v3({.version = 3, .block_m = 256, .signed_codes = 1}, true, 200, 4096); },
      "contiguous layout only");
  expect_error_mentions([&] { cuda::w4a8_resolve_v3({.version = 3, .block_m = 256}, false, 0, 4096); },
                        "signed_codes = 0");
}

// The wide tile's split of the grid between whole pairs and half tiles (w4a8::half_tile_ctas): no half
// tiles, none; only half tiles, every CTA; a few half tiles beside many pairs (groups of ~4096 rows:
// under 4 CTAs' share), none; groups of ~1024 rows (32 x 1024: ~133 pairs, ~15 half tiles), their
// share rounded up; and never all CTAs while there are pairs.
TEST(W4A8KernelChoice, HalfTileCtas) {
  EXPECT_EQ(w4a8::half_tile_ctas(140, 0, 132), 0);
  EXPECT_EQ(w4a8::half_tile_ctas(0, 7, 132), 132);
  EXPECT_EQ(w4a8::half_tile_ctas(0, 7, 1), 1);
  EXPECT_EQ(w4a8::half_tile_ctas(140, 4, 132), 0);  // 132 * 12 / 712 = 2.2 CTAs
  EXPECT_EQ(w4a8::half_tile_ctas(141, 2, 132), 0);
  EXPECT_EQ(w4a8::half_tile_ctas(133, 15, 132), 9);  // 132 * 45 / 710 = 8.4, rounded up
  EXPECT_EQ(w4a8::half_tile_ctas(64, 64, 132), 50);  // 132 * 192 / 512 = 49.5
  EXPECT_EQ(w4a8::half_tile_ctas(1, 6, 8), 7);       // 8 * 18 / 23 = 6.3
  EXPECT_EQ(w4a8::half_tile_ctas(1, 1000, 8), 7);    // (the pairs keep one CTA)
  EXPECT_EQ(w4a8::half_tile_ctas(2, 3, 2), 0);       // (too few CTAs: 2 * 9 < 4 * 19)
  EXPECT_EQ(w4a8::half_tile_ctas(2, 3, 1), 0);
  // (Exactly 4 CTAs' share splits, 8 * 15 = 4 * 30; just under does not.)
  EXPECT_EQ(w4a8::half_tile_ctas(3, 5, 8), 4);
  EXPECT_EQ(w4a8::half_tile_ctas(3, 5, 7), 0);
}

TEST(W4A8Reference, MatchesADirectSum) {
  std::mt19937_64 rng(3);
  const std::int64_t G = 2, M_max = 5, N = 8, K = 256;
  const Checkpoint c = random_checkpoint(G, N, K, rng);
  HostTensor a(DType::fp8_e4m3, {G, M_max, K}), counts(DType::i32, {G}), d(DType::f64, {G, M_max, N});
  auto* ab = static_cast<std::uint8_t*>(a.view().data);
  for (std::int64_t i = 0; i < a.numel(); ++i) ab[i] = static_cast<std::uint8_t>(0x30 + rng() % 0x20);
  counts.data<std::int32_t>()[0] = 5;
  counts.data<std::int32_t>()[1] = 2;
  for (std::int64_t i = 0; i < d.numel(); ++i) d.data<double>()[i] = -1234.5;
  const float a_scale = 0.37f;
  w4a8_grouped_gemm_masked_cpu(a, a_scale, c.w, c.s, counts, d);
  const auto* w = static_cast<const std::uint8_t*>(c.w.view().data);
  for (std::int64_t g = 0; g < G; ++g)
    for (std::int64_t m = 0; m < M_max; ++m)
      for (std::int64_t n = 0; n < N; ++n) {
        const double got = d.data<double>()[(g * M_max + m) * N + n];
        if (m >= counts.data<std::int32_t>()[g]) {
          EXPECT_EQ(got, -1234.5);
          continue;
        }
        double want = 0;
        for (std::int64_t k = 0; k < K; ++k)
          want += static_cast<double>(fp8_e4m3::from_bits(ab[(g * M_max + m) * K + k]).to_float()) *
                  unpack_int4(w + (g * N + n) * (K / 2), k) *
                  static_cast<double>(c.s.data<float>()[(g * N + n) * 2 + k / 128]) *
                  static_cast<double>(a_scale);
        EXPECT_NEAR(got, want, 1e-9 * std::abs(want) + 1e-12);
      }
}

TEST(W4A8Sizes, ByteCountsOfTheDeepSeekShapes) {
  // gate_up of 32 experts at DeepSeek-V3 dims: N 4096, K 7168: half a byte per weight, a bf16 per 128 K.
  EXPECT_EQ(cuda::w4a8_packed_weight_bytes(32, 4096, 7168), std::size_t{32} * 4096 * 7168 / 2);
  EXPECT_EQ(cuda::w4a8_packed_scale_bytes(32, 4096, 7168), std::size_t{32} * 4096 * 56 * 2);
  // The row sums pad M_max to 32 rows, then 16 bytes of counter: 2 x 32 x 2 x 4 + 16.
  EXPECT_EQ(cuda::w4a8_workspace_bytes(2, 20, 256), 528u);
  EXPECT_EQ(cuda::w4a8_workspace_bytes(0, 0, 0), 16u);
}

TEST(W4A8Sizes, ByteCountsRefuseSizesNoTensorCouldHave) {
  using cuda::w4a8_packed_scale_bytes;
  using cuda::w4a8_packed_weight_bytes;
  using cuda::w4a8_workspace_bytes;
  // Negative sizes used to wrap to a huge size_t, and K off the 128 grid was truncated.
  expect_error_mentions([] { (void)w4a8_packed_weight_bytes(-1, 4096, 7168); },
                        "groups, n and k must be >= 0");
  expect_error_mentions([] { (void)w4a8_packed_scale_bytes(32, -4096, 7168); },
                        "groups, n and k must be >= 0");
  expect_error_mentions([] { (void)w4a8_packed_weight_bytes(32, 4096, 7000); },
                        "k must be a multiple of 128");
  expect_error_mentions([] { (void)w4a8_packed_scale_bytes(32, 4096, 200); }, "k must be a multiple of 128");
  expect_error_mentions([] { (void)w4a8_workspace_bytes(2, -20, 256); }, "groups, m_max and k must be >= 0");
  expect_error_mentions([] { (void)w4a8_workspace_bytes(2, 20, 100); }, "k must be a multiple of 128");
  expect_error_mentions(
      [] { (void)w4a8_workspace_bytes(1, std::numeric_limits<std::int64_t>::max() - 3, 128); }, "overflows");
  expect_error_mentions(
      [] { (void)w4a8_packed_weight_bytes(std::int64_t{1} << 40, std::int64_t{1} << 40, 128); }, "overflows");
}

}  // namespace
}  // namespace epmoe
