// The FP8 block-scaled grouped GEMM on the GPU against its CPU reference (f64): fresh random FP8
// inputs for every run (never zeros), outputs poisoned (0xff) before the run, relative L2 error
// <= 5e-3 over the valid rows, no NaN/Inf, and every skipped row still poisoned afterwards.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/grouped_gemm.hpp"
#include "epmoe/grouped_gemm.hpp"
#include "gemm/gemm_test_util.hpp"
#include "gemm/schedule_math.hpp"
#include "gpu_test_util.hpp"

namespace epmoe {
namespace {

using cuda::ScaleLayout;
using testing::expect_error_mentions;

using testing::check_output;
using testing::fill_masked_activations;
using testing::fill_random_fp8;
using testing::fill_random_scales;
using testing::host_i32;
using testing::kPoison;
using testing::kTolerance;
using testing::masked_valid;
using testing::pick;
using testing::uniform;

// Token-major [rows, kb] -> MN-major TMA-aligned [kb, tma_aligned(rows)] (padding 0).
void to_mn_major(const float* token_major, std::int64_t rows, std::int64_t kb, float* out) {
  const std::int64_t padded = cuda::tma_aligned_tokens(rows);
  for (std::int64_t j = 0; j < kb; ++j)
    for (std::int64_t t = 0; t < padded; ++t) out[j * padded + t] = t < rows ? token_major[t * kb + j] : 0.0f;
}

struct Weights {
  HostTensor b, b_scales;
};
Weights random_weights(std::int64_t groups, std::int64_t n, std::int64_t k, std::mt19937_64& rng) {
  Weights w{HostTensor(DType::fp8_e4m3, {groups, n, k}), HostTensor(DType::f32, {groups, n / 128, k / 128})};
  fill_random_fp8(static_cast<std::uint8_t*>(w.b.view().data), w.b.numel(), rng);
  fill_random_scales(w.b_scales.data<float>(), w.b_scales.numel(), rng);
  return w;
}

// The kernel knobs both layouts' cases carry (ContiguousCase, MaskedCase), as options.
template <class Case>
cuda::GroupedGemmOptions kernel_options(const Case& c) {
  cuda::GroupedGemmOptions options;
  options.block_m = c.block_m;
  options.block_n = c.block_n;
  options.cluster = c.cluster;
  options.pingpong = c.pingpong;
  options.vector_epilogue = c.vector_epilogue;
  options.consumer_skew = c.skew;
  options.unrolled_k_loop = c.unrolled;
  options.two_partials = c.two_partials;
  options.split_tiles = c.split_tiles;
  options.borrow_epilogue = c.borrow;
  options.tile_store = c.tile_store;
  return options;
}

// ---------------------------------------------------------------- contiguous
struct ContiguousCase {
  std::string name;
  std::vector<std::int64_t> group_rows;  // valid rows per group; each group padded to 128
  std::int64_t n, k;
  ScaleLayout layout;
  int block_m = 0;                   // 0: heuristic
  std::int64_t trailing_blocks = 0;  // all-padding 128-row blocks at the end (a worst-case sized buffer)
  bool holes = false;                // also put -1 rows inside groups' rows
  int block_n = 0;                   // 0: heuristic (256 where N allows)
  int cluster = 0;                   // 0: the heuristic's (1)
  bool pingpong = false;
  bool vector_epilogue = true;
  bool skew = false;  // consumer_skew
  bool unrolled = cuda::GroupedGemmOptions{}.unrolled_k_loop;
  bool two_partials = cuda::GroupedGemmOptions{}.two_partials;
  int split_tiles = cuda::GroupedGemmOptions{}.split_tiles;  // -1: automatic
  int borrow = cuda::GroupedGemmOptions{}.borrow_epilogue;   // -1: automatic
  int band_columns = 0;                                      // 0: the default tile order
  int tile_store = cuda::GroupedGemmOptions{}.tile_store;    // -1: automatic (grouped_gemm_tile_store)
};

void PrintTo(const ContiguousCase& c, std::ostream* os) {
  *os << c.name;
}

class GroupedGemmContiguousGpu : public ::testing::TestWithParam<ContiguousCase> {};

// The contiguous layout's m_indices: each group's rows (with `holes`, every 7th from the 4th -1 too),
// then -1 up to the next multiple of 128; then `trailing_blocks` all-padding 128-row blocks.
template <typename Rows>
std::vector<std::int32_t> contiguous_ids(const std::vector<Rows>& group_rows, bool holes,
                                         std::int64_t trailing_blocks) {
  std::vector<std::int32_t> ids;
  for (std::size_t g = 0; g < group_rows.size(); ++g) {
    const auto rows = static_cast<std::int64_t>(group_rows[g]);
    const std::int64_t padded = (rows + 127) / 128 * 128;
    for (std::int64_t r = 0; r < padded; ++r) {
      const bool hole = holes && r < rows && r % 7 == 3;
      ids.push_back(r < rows && !hole ? static_cast<std::int32_t>(g) : -1);
    }
  }
  for (std::int64_t i = 0; i < 128 * trailing_blocks; ++i) ids.push_back(-1);
  return ids;
}

// Groups ending anywhere in a warp's 16 rows and in a tile's two 64-row halves (tails of 1, 33, 64,
// 65, 72, 127 and 128 rows), -1 rows inside groups, a trailing empty block, several tiles per CTA:
// for v11's split tiles (opt-in) and the epilogues (borrow: GroupedGemmOptions::borrow_epilogue, 0-3).
ContiguousCase tails_holes_case(std::string name, bool split, int borrow) {
  ContiguousCase c{std::move(name),
                   {1, 64, 65, 127, 128, 129, 192, 200, 0, 33, 300},
                   4096,
                   2048,
                   ScaleLayout::token_major,
                   0,
                   1,
                   true};
  c.split_tiles = split;
  c.borrow = borrow;
  return c;
}

// N = K = 7168 with a 16-row group, an empty one and tails (128 x 256 tiles over 56 K blocks), with the
// epilogue `borrow` (GroupedGemmOptions::borrow_epilogue) and whole-tile stores as `tile_store` says.
ContiguousCase n7168_k7168_epilogue_case(std::string name, int borrow, int tile_store = -1) {
  ContiguousCase c{std::move(name), {300, 16, 0, 250, 128}, 7168, 7168, ScaleLayout::mn_major_tma};
  c.borrow = borrow;
  c.tile_store = tile_store;
  return c;
}

TEST_P(GroupedGemmContiguousGpu, MatchesCpuReference) {
  EPMOE_REQUIRE_GPU();
  const ContiguousCase& c = GetParam();
  testing::SeededRng rng;
  const auto G = static_cast<std::int64_t>(c.group_rows.size());
  const std::int64_t N = c.n, K = c.k, KB = K / 128;

  const std::vector<std::int32_t> ids = contiguous_ids(c.group_rows, c.holes, c.trailing_blocks);
  const auto M = static_cast<std::int64_t>(ids.size());
  ASSERT_GT(M, 0);

  HostTensor a(DType::fp8_e4m3, {M, K}), sa(DType::f32, {M, KB});
  const HostTensor m_indices = host_i32(ids);
  auto* a_bytes = static_cast<std::uint8_t*>(a.view().data);
  fill_random_fp8(a_bytes, M * K, rng);
  fill_random_scales(sa.data<float>(), M * KB, rng);
  std::vector<bool> valid(static_cast<std::size_t>(M));
  for (std::int64_t m = 0; m < M; ++m) {
    valid[static_cast<std::size_t>(m)] = ids[static_cast<std::size_t>(m)] >= 0;
    // Padding rows hold NaN codes: nothing of them may leak into valid rows.
    if (!valid[static_cast<std::size_t>(m)]) std::memset(a_bytes + m * K, 0x7f, static_cast<std::size_t>(K));
  }
  const Weights w = random_weights(G, N, K, rng);

  HostTensor ref(DType::f64, {M, N});
  grouped_gemm_contiguous_cpu(a, sa, w.b, w.b_scales, m_indices, ref);

  HostTensor sa_mn;
  TensorView sa_gpu = sa.view();  // token-major as is
  if (c.layout == ScaleLayout::mn_major_tma) {
    sa_mn = HostTensor(DType::f32, {KB, cuda::tma_aligned_tokens(M)});
    to_mn_major(sa.data<float>(), M, KB, sa_mn.data<float>());
    sa_gpu = sa_mn.view();
  }
  cuda::Stream stream;
  const cuda::DeviceTensor da = cuda::to_device(a, stream), dsa = cuda::to_device(sa_gpu, stream),
                           db = cuda::to_device(w.b, stream), dsb = cuda::to_device(w.b_scales, stream),
                           dids = cuda::to_device(m_indices, stream);
  const cuda::DeviceTensor dd(DType::bf16, {M, N});
  cuda::GroupedGemmOptions options = kernel_options(c);
  options.band_columns = c.band_columns;
  const HostTensor got = testing::run_twice_same_bits(dd, stream, [&] {
    cuda::fp8_grouped_gemm_contiguous(da, dsa, c.layout, db, dsb, dids, dd, stream, options);
  });
  check_output(got, ref, valid, N);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GroupedGemmContiguousGpu,
    ::testing::Values(
        // v11's split tiles (opt-in; 128 x 256, <= 64 valid rows: consumer 1 on consumer 0's rows and
        // the second wave): split and not, with the plain K loop, and at K = 7168 with MN-major scales.
        tails_holes_case("N4096_K2048_split_tails_holes", true, 0),
        tails_holes_case("N4096_K2048_split_tails_holes_unsplit", false, 0),
        [] {
          ContiguousCase c{"N4096_K1536_split_tails_plain_k_loop",
                           {3, 130, 60, 190},
                           4096,
                           1536,
                           ScaleLayout::mn_major_tma};
          c.unrolled = false;
          c.split_tiles = true;
          return c;
        }(),
        [] {
          ContiguousCase c{
              "N7168_K7168_split_tails_mn_major", {20, 130, 0, 250}, 7168, 7168, ScaleLayout::mn_major_tma};
          c.split_tiles = true;
          return c;
        }(),
        // v12's borrowed-stage epilogue (the store warp: tensor stores for whole warps of rows, bulk
        // stores per row for the others): tails of every size, holes, a trailing empty block, many
        // tiles per CTA (K = 2048: 16 K blocks, 4 rounds), K = 7168 with N = 7168, and K = 512 (one
        // round: the borrowed stages are the tile's second half).
        tails_holes_case("N4096_K2048_borrow_holes", false, 1),
        n7168_k7168_epilogue_case("N7168_K7168_borrow", 1),
        [] {
          ContiguousCase c{
              "N4096_K512_borrow_one_round", {700, 3, 130}, 4096, 512, ScaleLayout::mn_major_tma};
          c.borrow = 1;
          c.split_tiles = 0;  // (K <= 2048 with 384 rows per group: split, without v12, by default)
          return c;
        }(),
        // Whole-tile stores off at K = 2048 (per-warp stores of every whole warp) and on at K = 7168
        // (whole tiles among partial ones).
        [] {
          ContiguousCase c = tails_holes_case("N4096_K2048_borrow_holes_no_tile_store", false, 1);
          c.tile_store = 0;
          return c;
        }(),
        n7168_k7168_epilogue_case("N7168_K7168_borrow_tile_store", 1, 1),
        // The consumers' own stores (borrow_epilogue off) on the same shape as the first.
        tails_holes_case("N4096_K2048_direct_epilogue_holes", false, 0),
        // v31's wave-0 staging (borrow_epilogue 2; a masked default, allowed here too): the same tails
        // and holes, and K = 7168 with N = 7168.
        tails_holes_case("N4096_K2048_wave0_holes", false, 2),
        n7168_k7168_epilogue_case("N7168_K7168_wave0", 2),
        // v33 (borrow_epilogue 3): v12 with wave 0 staged before the consumers meet; the same shapes.
        tails_holes_case("N4096_K2048_wave0_first_holes", false, 3),
        n7168_k7168_epilogue_case("N7168_K7168_wave0_first_tile_store", 3, 1),
        // The tile order's bands: one column tile wide (300 columns round down to it), and all of N
        // (8 column tiles of 128 x 256 over 12 m-blocks: every CTA's tiles cross bands differently).
        [] {
          ContiguousCase c = tails_holes_case("N4096_K2048_band_one_tile", false, 1);
          c.band_columns = 300;
          return c;
        }(),
        [] {
          ContiguousCase c = tails_holes_case("N4096_K2048_band_all", false, 1);
          c.band_columns = 1 << 30;
          return c;
        }(),
        [] {
          ContiguousCase c{"N7168_K2048_band_2048_cluster2",
                           {300, 16, 0, 250, 128},
                           7168,
                           2048,
                           ScaleLayout::mn_major_tma};
          c.cluster = 2;
          c.band_columns = 2048;
          return c;
        }(),
        // DeepSeek-V3 gate_up: an empty expert and a single-row expert.
        ContiguousCase{"N4096_K7168_empty_and_single_row", {1, 0, 130}, 4096, 7168, ScaleLayout::token_major},
        // DeepSeek-V3 down, MN-major scales as the GPU quantizer writes them.
        ContiguousCase{"N7168_K2048_mn_major", {150, 0, 64, 33}, 7168, 2048, ScaleLayout::mn_major_tma},
        // A non-power-of-two N, forced 64-row tiles.
        ContiguousCase{"N1536_K7168_block64", {128, 257}, 1536, 7168, ScaleLayout::token_major, 64},
        // One valid row in the whole batch, in a worst-case sized buffer (trailing empty blocks).
        ContiguousCase{
            "N1536_K2048_single_row_trailing", {0, 1}, 1536, 2048, ScaleLayout::mn_major_tma, 0, 3},
        // Many small groups with -1 rows inside them too; 128 x 128 tiles.
        ContiguousCase{"N1536_K2048_many_groups_holes_block_n128",
                       {5, 17, 0, 128, 1, 90, 0, 33},
                       1536,
                       2048,
                       ScaleLayout::token_major,
                       0,
                       1,
                       true,
                       128},
        // DeepSeek-V3 gate_up with 128 x 128 tiles.
        ContiguousCase{
            "N4096_K7168_block_n128", {77, 200}, 4096, 7168, ScaleLayout::mn_major_tma, 0, 0, false, 128},
        // DeepSeek-V3 gate_up with the plain (not unrolled) K loop.
        [] {
          ContiguousCase c{"N4096_K7168_plain_k_loop", {77, 0, 300}, 4096, 7168, ScaleLayout::mn_major_tma};
          c.unrolled = false;
          return c;
        }(),
        // The same with one partial per K block (two_partials off), and 128 x 128 tiles with a
        // single K block (the two-partial loop's first block is its last).
        [] {
          ContiguousCase c{"N4096_K7168_block_n128_one_partial",
                           {77, 200},
                           4096,
                           7168,
                           ScaleLayout::mn_major_tma,
                           0,
                           0,
                           false,
                           128};
          c.two_partials = false;
          return c;
        }(),
        ContiguousCase{"N1536_K128_block_n128_one_k_block",
                       {100, 0, 33},
                       1536,
                       128,
                       ScaleLayout::token_major,
                       0,
                       0,
                       true,
                       128},
        // An odd number of column tiles (5 x 128): no cluster.
        ContiguousCase{"N640_K2048_odd_column_tiles", {200, 77}, 640, 2048, ScaleLayout::token_major},
        // No cluster with ping-pong and 16-byte stores; a cluster with ping-pong; then the v2 paths
        // (no cluster, no ping-pong, 4-byte stores) with holes.
        ContiguousCase{"N4096_K2048_cluster1_pingpong",
                       {130, 250},
                       4096,
                       2048,
                       ScaleLayout::mn_major_tma,
                       0,
                       0,
                       false,
                       0,
                       1,
                       true},
        ContiguousCase{"N1536_K2048_cluster2_pingpong",
                       {130, 0, 200},
                       1536,
                       2048,
                       ScaleLayout::token_major,
                       0,
                       0,
                       false,
                       0,
                       2,
                       true},
        // Consumer skew (the turn passed once per tile): K = 256 (2 K blocks, fewer than the
        // stages, so consumer 0 could run tiles ahead) in a cluster with holes and a trailing
        // empty block; then K = 2048 with the heuristic's cluster.
        ContiguousCase{"N1536_K256_cluster2_skew_short_k",
                       {130, 0, 200, 5},
                       1536,
                       256,
                       ScaleLayout::mn_major_tma,
                       0,
                       1,
                       true,
                       0,
                       2,
                       false,
                       true,
                       true},
        ContiguousCase{"N4096_K2048_skew",
                       {300, 77},
                       4096,
                       2048,
                       ScaleLayout::token_major,
                       0,
                       0,
                       false,
                       0,
                       0,
                       false,
                       true,
                       true},
        // The K loop unrolled over the stages: 128 x 256 (4 stages, 16 K blocks) in a cluster with
        // holes and a trailing empty block; 128 x 128 tiles with K = 1536 (6 stages, 12 K blocks).
        ContiguousCase{"N4096_K2048_cluster2_unrolled_holes",
                       {300, 0, 77, 129},
                       4096,
                       2048,
                       ScaleLayout::mn_major_tma,
                       0,
                       1,
                       true,
                       0,
                       2,
                       false,
                       true,
                       false,
                       true},
        ContiguousCase{"N1536_K1536_block_n128_unrolled",
                       {200, 5},
                       1536,
                       1536,
                       ScaleLayout::token_major,
                       0,
                       0,
                       false,
                       128,
                       0,
                       false,
                       true,
                       false,
                       true},
        ContiguousCase{"N7168_K2048_v2_paths_holes",
                       {150, 0, 64, 33},
                       7168,
                       2048,
                       ScaleLayout::token_major,
                       0,
                       1,
                       true,
                       0,
                       1,
                       false,
                       false}),
    [](const ::testing::TestParamInfo<ContiguousCase>& info) { return info.param.name; });

// ---------------------------------------------------------------- masked
struct MaskedCase {
  std::string name;
  std::int64_t m_max;
  std::vector<std::int32_t> masked_m;
  std::int64_t n, k;
  ScaleLayout layout;
  int block_m = 0;
  bool small_a_box = true;
  int block_n = 0;
  int cluster = 0;
  bool pingpong = false;
  bool vector_epilogue = true;
  bool skew = false;  // consumer_skew
  bool unrolled = cuda::GroupedGemmOptions{}.unrolled_k_loop;
  bool two_partials = cuda::GroupedGemmOptions{}.two_partials;
  int split_tiles = cuda::GroupedGemmOptions{}.split_tiles;  // -1: automatic (1-64 expected rows)
  int borrow = cuda::GroupedGemmOptions{}.borrow_epilogue;   // -1: automatic (off at K <= 2048 here)
  int tile_store = cuda::GroupedGemmOptions{}.tile_store;    // -1: automatic (grouped_gemm_tile_store)
  int swap_ab = cuda::GroupedGemmOptions{}.swap_ab;          // -1: automatic (grouped_gemm_swap_ab)
  bool zero_padding = cuda::GroupedGemmOptions{}.zero_padding_rows;
  int a_row_box_rows = cuda::GroupedGemmOptions{}.a_row_box_rows;
};

// v29's zero boxes off (zero_padding_rows false): A's padding rows loaded as they are (small_a_box as given).
MaskedCase masked_unzeroed_case(std::string name, std::int64_t m_max, std::vector<std::int32_t> masked_m,
                                std::int64_t n, std::int64_t k, int block_m, bool small_a_box) {
  MaskedCase c{std::move(name),           m_max,   std::move(masked_m), n, k,
               ScaleLayout::mn_major_tma, block_m, small_a_box};
  c.zero_padding = false;
  return c;
}

// v35's A row boxes of `box_rows` rows (GroupedGemmOptions::a_row_box_rows) in 64-row tiles, M_max 64,
// N = 1536, K = 2048 (where the automatic choice takes none).
MaskedCase row_boxes_case(std::string name, std::vector<std::int32_t> masked_m, int box_rows) {
  MaskedCase c = masked_unzeroed_case(std::move(name), 64, std::move(masked_m), 1536, 2048, 64, true);
  c.a_row_box_rows = box_rows;
  return c;
}

// v37's row boxes in zero-padding 128 x 256 tiles (`box_rows` rows, the rest of A zeros), whole
// (split_tiles 0) or split (1), M_max 128, N = 512, K = 2048.
MaskedCase zero_row_boxes_case(std::string name, int box_rows, int split_tiles) {
  MaskedCase c{std::move(name),
               128,
               {1, 5, 8, 9, 16, 17, 33, 40, 64, 0, 65, 100, 112, 113, 120, 121, 128},
               512,
               2048,
               ScaleLayout::mn_major_tma,
               128};
  c.a_row_box_rows = box_rows;
  c.split_tiles = split_tiles;
  return c;
}

// The swapped-operand kernel (options.swap_ab = 1) on `masked_m`.
MaskedCase masked_swap_case(std::string name, std::int64_t m_max, std::vector<std::int32_t> masked_m,
                            std::int64_t n, std::int64_t k, ScaleLayout layout) {
  MaskedCase c{std::move(name), m_max, std::move(masked_m), n, k, layout};
  c.swap_ab = 1;
  return c;
}

void PrintTo(const MaskedCase& c, std::ostream* os) {
  *os << c.name;
}

// v12's borrowed-stage epilogue (borrow 1) or v31's wave-0 staging (2) at N = 4096, K = 2048 (128 x 256
// tiles), with whole-tile stores as `tile_store` says.
MaskedCase masked_borrow_case(std::string name, std::int64_t m_max, std::vector<std::int32_t> masked_m,
                              int tile_store, int borrow = 1) {
  MaskedCase c{std::move(name), m_max, std::move(masked_m), 4096, 2048, ScaleLayout::mn_major_tma};
  c.borrow = borrow;
  c.tile_store = tile_store;
  return c;
}

struct MaskedInputs {
  HostTensor a, sa, sa_mn, counts;  // sa_mn: the MN-major copy of sa, when asked for
  Weights w;
  TensorView sa_gpu() const { return sa_mn.defined() ? sa_mn.view() : sa.view(); }
};

MaskedInputs masked_inputs(std::int64_t G, std::int64_t M_max, std::int64_t N, std::int64_t K,
                           ScaleLayout layout, const std::vector<std::int32_t>& counts,
                           std::mt19937_64& rng) {
  const std::int64_t KB = K / 128;
  MaskedInputs in{HostTensor(DType::fp8_e4m3, {G, M_max, K}), HostTensor(DType::f32, {G, M_max, KB}),
                  HostTensor(), HostTensor(DType::i32, {G}), random_weights(G, N, K, rng)};
  fill_masked_activations(static_cast<std::uint8_t*>(in.a.view().data), counts, M_max, K,
                          in.counts.data<std::int32_t>(), rng);
  fill_random_scales(in.sa.data<float>(), in.sa.numel(), rng);
  if (layout == ScaleLayout::mn_major_tma) {
    const std::int64_t padded = cuda::tma_aligned_tokens(M_max);
    in.sa_mn = HostTensor(DType::f32, {G, KB, padded});
    for (std::int64_t g = 0; g < G; ++g)
      to_mn_major(in.sa.data<float>() + g * M_max * KB, M_max, KB, in.sa_mn.data<float>() + g * KB * padded);
  }
  return in;
}

class GroupedGemmMaskedGpu : public ::testing::TestWithParam<MaskedCase> {};

TEST_P(GroupedGemmMaskedGpu, MatchesCpuReference) {
  EPMOE_REQUIRE_GPU();
  const MaskedCase& c = GetParam();
  testing::SeededRng rng;
  const auto G = static_cast<std::int64_t>(c.masked_m.size());
  const std::int64_t N = c.n, K = c.k, M_max = c.m_max;
  const MaskedInputs in = masked_inputs(G, M_max, N, K, c.layout, c.masked_m, rng);

  HostTensor ref(DType::f64, {G, M_max, N});
  grouped_gemm_masked_cpu(in.a, in.sa, in.w.b, in.w.b_scales, in.counts, ref);

  std::int64_t expected_m = 0;
  for (const std::int32_t m : c.masked_m) expected_m += m;
  expected_m /= G;

  cuda::Stream stream;
  const cuda::DeviceTensor da = cuda::to_device(in.a, stream), dsa = cuda::to_device(in.sa_gpu(), stream),
                           db = cuda::to_device(in.w.b, stream), dsb = cuda::to_device(in.w.b_scales, stream),
                           dcounts = cuda::to_device(in.counts, stream);
  const cuda::DeviceTensor dd(DType::bf16, {G, M_max, N});
  dd.fill_bytes(0xff, stream);
  cuda::GroupedGemmOptions options = kernel_options(c);
  options.small_a_box = c.small_a_box;
  options.a_row_box_rows = c.a_row_box_rows;
  options.swap_ab = c.swap_ab;
  options.zero_padding_rows = c.zero_padding;
  cuda::fp8_grouped_gemm_masked(da, dsa, c.layout, db, dsb, dcounts, expected_m, dd, stream, options);
  const HostTensor got = cuda::to_host(dd, stream);
  check_output(got, ref, masked_valid(c.masked_m, M_max), N);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GroupedGemmMaskedGpu,
    ::testing::Values(
        // v11's split tiles in the masked layout (128 x 256 tiles: expected m above 64): groups of
        // 1, 64, 65, 130 and 192 rows (their last tiles split where <= 64 rows), and unsplit.
        [] {
          MaskedCase c{"N4096_K2048_mmax200_split_tails", 200, {1, 64, 65, 130, 192, 0}, 4096, 2048,
                       ScaleLayout::mn_major_tma};
          c.split_tiles = true;
          return c;
        }(),
        [] {
          MaskedCase c{"N4096_K2048_mmax200_split_tails_unsplit",
                       200,
                       {1, 64, 65, 130, 192, 0},
                       4096,
                       2048,
                       ScaleLayout::mn_major_tma};
          c.split_tiles = false;
          return c;
        }(),
        // v12's borrowed-stage epilogue, masked (128 x 256 tiles: expected m above 64).
        // (M_max = 200: not a multiple of 16, so the 2D output map and two stores per warp and wave.)
        masked_borrow_case("N4096_K2048_mmax200_borrow", 200, {1, 64, 65, 130, 200, 0, 77}, -1),
        masked_borrow_case("N4096_K2048_mmax200_borrow_no_tile_store", 200, {1, 64, 65, 130, 200, 0, 77}, 0),
        // v19's 4D row-group output maps in the masked layout (M_max = 144, a multiple of 16: groups
        // start 16-aligned, at g x 144 rows): whole tiles, a 16-row tail (one whole warp), tails with a
        // partial warp, an empty group; stores per wave and per warp.
        masked_borrow_case("N4096_K2048_mmax144_borrow_tile_store", 144, {144, 0, 130, 16, 129, 128}, 1),
        masked_borrow_case("N4096_K2048_mmax144_borrow_no_tile_store", 144, {144, 0, 130, 16, 129, 128}, 0),
        // v31 (borrow_epilogue 2, the masked default at K <= 2048): wave 0 staged and stored by the store
        // warp, wave 1 by the consumers; the same row patterns (partial warps, 2D and 4D output maps).
        masked_borrow_case("N4096_K2048_mmax200_wave0", 200, {1, 64, 65, 130, 200, 0, 77}, -1, 2),
        masked_borrow_case("N4096_K2048_mmax144_wave0_tile_store", 144, {144, 0, 130, 16, 129, 128}, 1, 2),
        masked_borrow_case("N4096_K2048_mmax144_wave0_no_tile_store", 144, {144, 0, 130, 16, 129, 128}, 0, 2),
        // v33 (borrow_epilogue 3), masked: partial warps with the 2D map, whole tiles with the 4D one.
        masked_borrow_case("N4096_K2048_mmax200_wave0_first", 200, {1, 64, 65, 130, 200, 0, 77}, -1, 3),
        masked_borrow_case("N4096_K2048_mmax144_wave0_first_tile_store", 144, {144, 0, 130, 16, 129, 128}, 1,
                           3),
        // Swapped operands: every wave shape (1-176 tokens: one wave of 16 .. 176; 177-240: two of
        // 96 .. 120; 241-256: three of 88), chunks of 256 tokens past it (257, 300: a second chunk of 1
        // and 44), empty groups; N = 384 (3 weight blocks) and K = 640 (5 K blocks: the 4 stages wrap
        // inside a tile).
        masked_swap_case("N384_K640_swap_every_wave_shape", 300,
                         {1,   16,  17,  40,  64,  65,  90,  100, 128, 129, 160, 176, 177,
                          192, 200, 224, 225, 236, 240, 241, 256, 257, 300, 0,   299},
                         384, 640, ScaleLayout::mn_major_tma),
        // DeepSeek-V3's down shape (N = 7168 in 56 weight blocks, K = 2048), token-major scales.
        masked_swap_case("N7168_K2048_swap_token_major", 200, {200, 0, 77, 150, 9}, 7168, 2048,
                         ScaleLayout::token_major),
        // K = 7168, N = 1536 (not a power of two), M_max = 40 (every chunk's token boxes past the last
        // group's rows: TMA fills them with zeros).
        masked_swap_case("N1536_K7168_swap_mmax40", 40, {40, 33, 0, 1}, 1536, 7168,
                         ScaleLayout::mn_major_tma),
        // M_max not a multiple of the tile; an empty group and a single-row group.
        MaskedCase{"N4096_K2048_mmax200", 200, {0, 1, 200, 77}, 4096, 2048, ScaleLayout::token_major},
        // The same without v29's zero boxes (the padding rows' NaN codes loaded and computed, never stored;
        // 128 x 256 tiles, the only ones with zero boxes), and two 64-row-tile cases (which never zero: the
        // small A box and the full one on such groups).
        masked_unzeroed_case("N4096_K2048_mmax200_no_zero_padding", 200, {0, 1, 200, 77, 33, 130}, 4096, 2048,
                             128, true),
        masked_unzeroed_case("N1536_K2048_mmax200_block64_no_zero_padding", 200, {0, 1, 200, 77, 31, 64},
                             1536, 2048, 64, true),
        masked_unzeroed_case("N1536_K2048_mmax200_block64_no_zero_padding_full_a_box", 200,
                             {0, 1, 200, 77, 31}, 1536, 2048, 64, false),
        // v35's 16-row A boxes in 64-row tiles: tiles of 1, 5, 16 (one box), 17, 31 (two), 33, 40, 48 (three)
        // and 49, 64 rows (the whole box), an empty group (asked for: the automatic choice has none at
        // K = 2048); and the same with 32-row boxes only.
        row_boxes_case("N1536_K2048_mmax64_block64_row_boxes", {16, 17, 33, 48, 49, 5, 40, 0, 64, 1, 31}, 16),
        row_boxes_case("N1536_K2048_mmax64_block64_no_row_boxes", {16, 17, 33, 48, 49, 5, 40, 0, 64, 1, 31},
                       0),
        // The automatic choice at K = 7168 and decode sizes (expected m 15): 8-row boxes.
        masked_unzeroed_case("N1536_K7168_mmax40_block64_auto_row_boxes", 40, {8, 9, 16, 1, 0, 40, 33}, 1536,
                             7168, 64, true),
        // 8-row boxes (the automatic choice at decode sizes): 1-7 boxes, and all 64 rows from 57 on.
        row_boxes_case("N1536_K2048_mmax64_block64_row_boxes8", {8, 9, 16, 17, 33, 55, 56, 57, 5, 0, 64, 1},
                       8),
        MaskedCase{"N4096_K2048_mmax200_block64_mn_major_full_a_box",
                   200,
                   {0, 1, 200, 77},
                   4096,
                   2048,
                   ScaleLayout::mn_major_tma,
                   64,
                   false},
        // Decode-like: a few rows per group, DeepSeek-V3 down shape with K = 7168, in 64 x 128 tiles (the
        // heuristic's pick up to 8 expected rows; these average 27).
        MaskedCase{"N7168_K7168_decode", 72, {72, 0, 9}, 7168, 7168, ScaleLayout::mn_major_tma, 64},
        // The same with one partial per K block; then 3 K blocks (the two-partial loop leaves from
        // its second slot).
        [] {
          MaskedCase c{"N7168_K7168_decode_one_partial", 72, {72, 0, 9}, 7168, 7168,
                       ScaleLayout::mn_major_tma,        64};
          c.two_partials = false;
          return c;
        }(),
        // The heuristic's pick for 9-64 expected rows: 128 x 256 tiles, split where a tile has <= 64 rows
        // (v36; 32-row A boxes: these expect 38 rows), whole past that (72, 65); then 19 expected rows at
        // K = 7168 (v37's 16-row boxes).
        MaskedCase{"N7168_K7168_mmax72_split_auto",
                   72,
                   {72, 0, 9, 40, 64, 65, 17},
                   7168,
                   7168,
                   ScaleLayout::token_major},
        MaskedCase{"N1536_K7168_mmax48_split_auto_row_boxes",
                   48,
                   {9, 33, 17, 1, 40, 0, 30, 48, 16, 2},
                   1536,
                   7168,
                   ScaleLayout::mn_major_tma},
        MaskedCase{
            "N4096_K2048_mmax64_split_auto", 64, {33, 1, 64, 0, 20}, 4096, 2048, ScaleLayout::mn_major_tma},
        // v37: zero-padding 128 x 256 tiles with 8- and 16-row A boxes: 1-15 boxes loaded (the rest zeros),
        // all 128 rows past the last box's start; whole tiles and split ones.
        zero_row_boxes_case("N512_K2048_mmax128_zero_row_boxes8", 8, 0),
        zero_row_boxes_case("N512_K2048_mmax128_zero_row_boxes16", 16, 0),
        zero_row_boxes_case("N512_K2048_mmax128_zero_row_boxes8_split", 8, 1),
        zero_row_boxes_case("N512_K2048_mmax128_zero_row_boxes16_split", 16, 1),
        MaskedCase{"N4096_K384_decode_block64", 40, {40, 3, 0, 17}, 4096, 384, ScaleLayout::token_major, 64},
        // 128 x 128 tiles (the heuristic's pick here is 128 x 256).
        MaskedCase{"N1536_K7168_mmax300_block128x128",
                   300,
                   {300, 129},
                   1536,
                   7168,
                   ScaleLayout::token_major,
                   128,
                   true,
                   128},
        // Nothing valid at all: nothing may be written.
        MaskedCase{"N1536_K2048_all_empty", 130, {0, 0}, 1536, 2048, ScaleLayout::token_major},
        // 128 x 256 tiles in a cluster with ping-pong (the default for masked: neither), and the v2
        // paths.
        MaskedCase{"N4096_K2048_mmax200_cluster2_pingpong",
                   200,
                   {3, 200, 0, 140},
                   4096,
                   2048,
                   ScaleLayout::token_major,
                   128,
                   true,
                   0,
                   2,
                   true},
        // Consumer skew with K = 256 (fewer K blocks than stages).
        MaskedCase{"N1536_K256_mmax300_skew",
                   300,
                   {300, 0, 129},
                   1536,
                   256,
                   ScaleLayout::token_major,
                   128,
                   true,
                   0,
                   1,
                   false,
                   true,
                   true},
        // Unrolled K loop: 64 x 128 decode tiles (8 stages, 16 K blocks), 128 x 256 with skew.
        MaskedCase{"N4096_K2048_mmax72_block64_unrolled",
                   72,
                   {72, 0, 9},
                   4096,
                   2048,
                   ScaleLayout::mn_major_tma,
                   64,
                   true,
                   0,
                   0,
                   false,
                   true,
                   false,
                   true},
        MaskedCase{"N4096_K2048_mmax200_skew_unrolled",
                   200,
                   {3, 200, 0, 140},
                   4096,
                   2048,
                   ScaleLayout::token_major,
                   128,
                   true,
                   0,
                   1,
                   false,
                   true,
                   true,
                   true},
        MaskedCase{"N4096_K2048_mmax200_v2_paths",
                   200,
                   {3, 200, 0, 140},
                   4096,
                   2048,
                   ScaleLayout::mn_major_tma,
                   128,
                   true,
                   0,
                   1,
                   false,
                   false}),
    [](const ::testing::TestParamInfo<MaskedCase>& info) { return info.param.name; });

// The masked GEMM captured once in a CUDA graph, replayed with new counts written on the device in
// between: no host sync and no host-side knowledge of the counts.
// The launchers' experiment switches (src/gemm: read once per process) override the options with which
// each case here pins its path: with one set, those cases would test some other path and still pass.
TEST(GroupedGemmGpuMisc, NoLauncherSwitchIsSetInTheEnvironment) {
  EPMOE_REQUIRE_GPU();
  std::string set;
  for (const char* name :
       {"EPMOE_GEMM_BORROW_EPILOGUE", "EPMOE_GEMM_MAX_CTAS", "EPMOE_GEMM_SPLIT_ROUNDS",
        "EPMOE_GEMM_SPLIT_TAIL", "EPMOE_GEMM_SPLIT_TILES", "EPMOE_GEMM_SPLIT_ZEROS_ALL", "EPMOE_GEMM_SWAP_AB",
        "EPMOE_GEMM_SWAP_ORDER", "EPMOE_GEMM_TAIL_PIECES", "EPMOE_GEMM_TILE_STORE", "EPMOE_GEMM_TRIM_CTAS",
        "EPMOE_GEMM_TWO_PARTIALS", "EPMOE_W4A8_MASKED_ALL_SMS"}) {
    if (const char* value = std::getenv(name)) set += std::string(" ") + name + "=" + value;
  }
  EXPECT_TRUE(set.empty()) << "unset these to test the paths the cases pin:" << set;
}

TEST(GroupedGemmGpuMisc, MaskedReplaysInACudaGraph) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  const std::int64_t G = 3, M_max = 96, N = 1536, K = 2048;
  const std::vector<std::int32_t> first{5, 96, 0}, second{0, 33, 64};
  const MaskedInputs in = masked_inputs(G, M_max, N, K, ScaleLayout::token_major, {96, 96, 96}, rng);

  cuda::Stream stream;
  const cuda::DeviceTensor da = cuda::to_device(in.a, stream), dsa = cuda::to_device(in.sa_gpu(), stream),
                           db = cuda::to_device(in.w.b, stream), dsb = cuda::to_device(in.w.b_scales, stream);
  const cuda::DeviceTensor dcounts(DType::i32, {G}), dd(DType::bf16, {G, M_max, N});
  // Both kernels: the row-major one and the swapped-operand one.
  for (const int swap_ab : {0, 1}) {
    SCOPED_TRACE("swap_ab " + std::to_string(swap_ab));
    cuda::GroupedGemmOptions options;
    options.swap_ab = swap_ab;
    // One plain run first: one-time host work (driver entry point, shared-memory attribute) stays
    // out of the capture.
    dcounts.fill_bytes(0x00, stream);
    cuda::fp8_grouped_gemm_masked(da, dsa, ScaleLayout::token_major, db, dsb, dcounts, 32, dd, stream,
                                  options);
    stream.synchronize();

    const cuda::Graph graph = cuda::Graph::capture(stream, [&] {
      cuda::fp8_grouped_gemm_masked(da, dsa, ScaleLayout::token_major, db, dsb, dcounts, 32, dd, stream,
                                    options);
    });

    for (const auto* counts : {&first, &second}) {
      HostTensor hc(DType::i32, {G});
      std::memcpy(hc.data<std::int32_t>(), counts->data(),
                  static_cast<std::size_t>(G) * sizeof(std::int32_t));
      cuda::copy_to_device(dcounts, hc, stream);
      dd.fill_bytes(0xff, stream);
      graph.launch(stream);
      const HostTensor got = cuda::to_host(dd, stream);
      HostTensor ref(DType::f64, {G, M_max, N});
      grouped_gemm_masked_cpu(in.a, in.sa, in.w.b, in.w.b_scales, hc, ref);
      check_output(got, ref, masked_valid(*counts, M_max), N);
    }
  }
}

// The swapped-operand kernel and the row-major one give every valid row the same bits (the same
// products, the same promotions in the same order), so that a caller may pick either per batch without
// breaking batch invariance; both against the reference too.
TEST(GroupedGemmGpuMisc, SwappedOperandsGiveTheRowMajorKernelsBits) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  const std::int64_t M_max = 256, N = 1536, K = 7168;
  const std::vector<std::int32_t> counts{150, 40, 230, 256, 7};
  const auto G = static_cast<std::int64_t>(counts.size());
  const MaskedInputs in = masked_inputs(G, M_max, N, K, ScaleLayout::mn_major_tma, counts, rng);
  HostTensor ref(DType::f64, {G, M_max, N});
  grouped_gemm_masked_cpu(in.a, in.sa, in.w.b, in.w.b_scales, in.counts, ref);
  const std::vector<bool> valid = masked_valid(counts, M_max);

  cuda::Stream stream;
  const cuda::DeviceTensor da = cuda::to_device(in.a, stream), dsa = cuda::to_device(in.sa_gpu(), stream),
                           db = cuda::to_device(in.w.b, stream), dsb = cuda::to_device(in.w.b_scales, stream),
                           dcounts = cuda::to_device(in.counts, stream);
  std::vector<HostTensor> outputs;
  for (const int swap_ab : {0, 1}) {
    const cuda::DeviceTensor dd(DType::bf16, {G, M_max, N});
    dd.fill_bytes(0xff, stream);
    cuda::GroupedGemmOptions options;
    options.swap_ab = swap_ab;
    cuda::fp8_grouped_gemm_masked(da, dsa, ScaleLayout::mn_major_tma, db, dsb, dcounts, 128, dd, stream,
                                  options);
    outputs.push_back(cuda::to_host(dd, stream));
    check_output(outputs.back(), ref, valid, N);
  }
  std::int64_t differing = 0;
  const auto* x = static_cast<const std::uint16_t*>(outputs[0].view().data);
  const auto* y = static_cast<const std::uint16_t*>(outputs[1].view().data);
  for (std::int64_t row = 0; row < G * M_max; ++row) {
    if (!valid[static_cast<std::size_t>(row)]) continue;
    for (std::int64_t col = 0; col < N; ++col) differing += x[row * N + col] != y[row * N + col] ? 1 : 0;
  }
  EXPECT_EQ(differing, 0) << "elements whose bits differ between the two kernels";
}

// A masked or contiguous problem on fresh random inputs (masked: scales MN-major, expected_m M_max / 2;
// contiguous: token-major scales, groups padded to 128 rows, with `holes` and `trailing_blocks` as
// contiguous_ids, NaN codes in the padding rows; `scale_layout` overrides the layout), its f64 reference
// and valid rows, its device operands and output, and its launch.
struct GemmProblem {
  bool masked;
  std::int64_t m_max;       // masked only
  std::int64_t expected_m;  // masked only: the launch's hint
  ScaleLayout scale_layout;
  HostTensor ref;
  std::vector<bool> valid;
  std::vector<cuda::DeviceTensor> operands;  // a, a scales, b, b scales, masked_m or m_indices
  cuda::DeviceTensor d;

  void launch(const cuda::GroupedGemmOptions& options, cudaStream_t stream) const {
    const auto& o = operands;
    if (masked) {
      cuda::fp8_grouped_gemm_masked(o[0], o[1], scale_layout, o[2], o[3], o[4], expected_m, d, stream,
                                    options);
    } else {
      cuda::fp8_grouped_gemm_contiguous(o[0], o[1], scale_layout, o[2], o[3], o[4], d, stream, options);
    }
  }
};

GemmProblem gemm_problem(bool masked, const std::vector<std::int32_t>& rows, std::int64_t m_max,
                         std::int64_t n, std::int64_t k, bool holes, std::int64_t trailing_blocks,
                         std::mt19937_64& rng, cudaStream_t stream,
                         std::optional<ScaleLayout> scale_layout = std::nullopt) {
  const auto G = static_cast<std::int64_t>(rows.size());
  const ScaleLayout layout =
      scale_layout.value_or(masked ? ScaleLayout::mn_major_tma : ScaleLayout::token_major);
  GemmProblem problem{masked, m_max, m_max / 2, layout, {}, {}, {}, {}};
  if (masked) {
    const MaskedInputs in = masked_inputs(G, m_max, n, k, layout, rows, rng);
    problem.ref = HostTensor(DType::f64, {G, m_max, n});
    grouped_gemm_masked_cpu(in.a, in.sa, in.w.b, in.w.b_scales, in.counts, problem.ref);
    problem.valid = masked_valid(rows, m_max);
    for (const TensorView& v :
         {in.a.view(), in.sa_gpu(), in.w.b.view(), in.w.b_scales.view(), in.counts.view()})
      problem.operands.push_back(cuda::to_device(v, stream));
    problem.d = cuda::DeviceTensor(DType::bf16, {G, m_max, n});
    return problem;
  }
  const std::vector<std::int32_t> ids = contiguous_ids(rows, holes, trailing_blocks);
  const auto M = static_cast<std::int64_t>(ids.size());
  const std::int64_t KB = k / 128;
  HostTensor a(DType::fp8_e4m3, {M, k}), sa(DType::f32, {M, KB});
  const HostTensor m_indices = host_i32(ids);
  auto* a_bytes = static_cast<std::uint8_t*>(a.view().data);
  fill_random_fp8(a_bytes, a.numel(), rng);
  fill_random_scales(sa.data<float>(), sa.numel(), rng);
  for (std::int64_t m = 0; m < M; ++m) {
    problem.valid.push_back(ids[static_cast<std::size_t>(m)] >= 0);
    if (!problem.valid.back()) std::memset(a_bytes + m * k, 0x7f, static_cast<std::size_t>(k));
  }
  const Weights w = random_weights(G, n, k, rng);
  problem.ref = HostTensor(DType::f64, {M, n});
  grouped_gemm_contiguous_cpu(a, sa, w.b, w.b_scales, m_indices, problem.ref);
  HostTensor sa_mn;
  TensorView sa_gpu = sa.view();
  if (layout == ScaleLayout::mn_major_tma) {
    sa_mn = HostTensor(DType::f32, {KB, cuda::tma_aligned_tokens(M)});
    to_mn_major(sa.data<float>(), M, KB, sa_mn.data<float>());
    sa_gpu = sa_mn.view();
  }
  for (const TensorView& v : {a.view(), sa_gpu, w.b.view(), w.b_scales.view(), m_indices.view()})
    problem.operands.push_back(cuda::to_device(v, stream));
  problem.d = cuda::DeviceTensor(DType::bf16, {M, n});
  return problem;
}

// `launch` captured in a CUDA graph, replayed twice into d (poisoned first): the same bits as `want`.
void expect_graph_replays_give(const std::function<void()>& launch, const cuda::DeviceTensor& d,
                               const HostTensor& want, cuda::Stream& stream) {
  const cuda::Graph graph = cuda::Graph::capture(stream, launch);
  for (int replay = 0; replay < 2; ++replay) {
    d.fill_bytes(0xff, stream);
    graph.launch(stream);
    const HostTensor replayed = cuda::to_host(d, stream);
    EXPECT_EQ(std::memcmp(want.view().data, replayed.view().data, want.nbytes()), 0)
        << "replay " << replay << " differs";
  }
}

// ---------------------------------------------------------------- v21's split tail
// The tiles past the grid's last whole round split along K (GroupedGemmOptions::split_tail): a grid of
// max_ctas CTAs over a problem whose tiles leave a tail of fewer than half of them, so that the tail
// splits into `chunks` chunks each. Checked: the output against the reference (poisoned first), the
// trace's count of chunks and of summed tiles (the split ran, every chunk once, one sum per tile),
// two more launches bit-identical (the counters left at zero; the sum in chunk order, whichever
// chunk finishes last), and a CUDA graph replayed twice giving the same bits.
struct SplitTailCase {
  std::string name;
  bool masked;
  std::vector<std::int32_t> rows;  // contiguous: rows per group (each padded to 128); masked: masked_m
  std::int64_t m_max;              // masked only
  std::int64_t n, k;
  int block_m, block_n;  // the tile the launch gets (forced)
  int max_ctas;
  std::int64_t chunks;  // expected chunks per tail tile (the kernel's plan, worked out by hand)
};

void PrintTo(const SplitTailCase& c, std::ostream* os) {
  *os << c.name;
}

class GroupedGemmSplitTailGpu : public ::testing::TestWithParam<SplitTailCase> {};

TEST_P(GroupedGemmSplitTailGpu, MatchesTheReferenceDeterministicallyEagerAndInGraphs) {
  EPMOE_REQUIRE_GPU();
  const SplitTailCase& c = GetParam();
  testing::SeededRng rng;
  const std::int64_t N = c.n, K = c.k, KB = K / 128;
  std::int64_t m_blocks = 0;
  for (const std::int32_t r : c.rows) m_blocks += (r + c.block_m - 1) / c.block_m;
  const std::int64_t tiles = m_blocks * (N / c.block_n), tail = tiles % c.max_ctas;
  ASSERT_GT(tail, 0);
  ASSERT_LE(tail * c.chunks, c.max_ctas);

  cuda::Stream stream;
  const cuda::DeviceTensor workspace(DType::i32,
                                     {static_cast<std::int64_t>(cuda::grouped_gemm_workspace_bytes() / 4)});
  workspace.fill_bytes(0x00, stream);
  cuda::GroupedGemmOptions options;
  options.block_m = c.block_m;
  options.block_n = c.block_n;
  options.max_ctas = c.max_ctas;
  options.split_tiles = 0;
  options.split_tail = 1;
  options.tail_pieces = 0;  // (v22's pieces would take the masked tails)
  options.workspace = workspace.view().data;
  options.workspace_bytes = cuda::grouped_gemm_workspace_bytes();
  options.ablation = 256;  // the trace (output intact)

  const GemmProblem problem = gemm_problem(c.masked, c.rows, c.m_max, N, K, false, 0, rng, stream);
  const cuda::DeviceTensor& dd = problem.d;
  cuda::fp8_grouped_gemm_take_trace();  // zero it
  dd.fill_bytes(0xff, stream);
  problem.launch(options, stream);
  const HostTensor got = cuda::to_host(dd, stream);
  check_output(got, problem.ref, problem.valid, N);
  const cuda::Fp8GemmTrace t = cuda::fp8_grouped_gemm_take_trace();
  EXPECT_EQ(t.launches, 1u);
  EXPECT_EQ(t.k_blocks, static_cast<std::uint64_t>(tiles * KB));  // the chunks partition K
  EXPECT_EQ(t.split_chunks, static_cast<std::uint64_t>(tail * c.chunks));
  EXPECT_EQ(t.split_reductions, static_cast<std::uint64_t>(tail));

  for (int run = 0; run < 2; ++run) {
    dd.fill_bytes(0xff, stream);
    problem.launch(options, stream);
    const HostTensor again = cuda::to_host(dd, stream);
    EXPECT_EQ(std::memcmp(got.view().data, again.view().data, got.nbytes()), 0)
        << "eager run " << run << " differs";
  }
  expect_graph_replays_give([&] { problem.launch(options, stream); }, dd, got, stream);
  cuda::fp8_grouped_gemm_take_trace();  // (the replays' sums)
}

// Chunks: whole quanta of K blocks (the stages where the unrolled loop runs: 4 for 128 x 256, 8 for
// 64 x 128 at K = 7168; 1 for 128 x 128 at K = 2048, 16 K blocks over 6 stages), at most 15.
INSTANTIATE_TEST_SUITE_P(
    Shapes, GroupedGemmSplitTailGpu,
    ::testing::Values(
        // 128 x 256, K = 2048 (4 quanta): 6 m-blocks x 4 = 24 tiles on 20 CTAs: tail 4, 4 chunks (the
        // borrowed-stage epilogue).
        SplitTailCase{
            "contiguous_N1024_K2048_128x256", false, {300, 130, 77}, 0, 1024, 2048, 128, 256, 20, 4},
        // K = 7168 (14 quanta): 4 m-blocks x 8 = 32 tiles on 30 CTAs: tail 2, 14 chunks; a group tail of 72
        // rows (a partial warp), one of 122.
        SplitTailCase{"contiguous_N2048_K7168_128x256", false, {250, 200}, 0, 2048, 7168, 128, 256, 30, 14},
        // Masked, K = 7168: 5 m-blocks x 4 = 20 tiles on 18 CTAs: tail 2, 9 chunks; an empty group.
        SplitTailCase{
            "masked_N1024_K7168_128x256", true, {130, 0, 77, 200}, 200, 1024, 7168, 128, 256, 18, 9},
        // 64 x 128 decode tiles (two partials, 7 quanta of 8): 3 m-blocks x 12 = 36 tiles on 32 CTAs:
        // tail 4, 7 chunks.
        SplitTailCase{"masked_N1536_K7168_64x128", true, {72, 0, 9}, 72, 1536, 7168, 64, 128, 32, 7},
        // 128 x 128 at K = 2048 (16 quanta of 1): 4 m-blocks x 12 = 48 tiles on 40 CTAs: tail 8, 5 chunks.
        SplitTailCase{"contiguous_N1536_K2048_128x128", false, {128, 257}, 0, 1536, 2048, 128, 128, 40, 5}),
    [](const ::testing::TestParamInfo<SplitTailCase>& info) { return info.param.name; });

// v22, the tail as pieces (128 x 256 tiles): the tiles past the grid's last whole round, where four
// pieces of each fit the CTAs, are left to a 64 x 128 follower launch. Checked: the output against the
// reference (poisoned first); the trace's K blocks and tiles (the tiles before the tail, then every
// non-empty piece; without pieces every tile); the same bits as without pieces (batch invariance) and
// in two CUDA graph replays.
struct TailPiecesCase {
  std::string name;
  bool masked;
  std::vector<std::int32_t>
      rows;            // masked: masked_m; contiguous: rows per group (holes inside, padded to 128)
  std::int64_t m_max;  // masked: M_max; contiguous: all-padding 128-row blocks at the end
  std::int64_t n, k;
  int max_ctas;
  std::int64_t computed;  // tiles and pieces with valid rows the two launches compute (worked out by hand)
};

void PrintTo(const TailPiecesCase& c, std::ostream* os) {
  *os << c.name;
}

class GroupedGemmTailPiecesGpu : public ::testing::TestWithParam<TailPiecesCase> {};

TEST_P(GroupedGemmTailPiecesGpu, MatchesTheReferenceAndTheWholeTilesBits) {
  EPMOE_REQUIRE_GPU();
  const TailPiecesCase& c = GetParam();
  testing::SeededRng rng;
  const std::int64_t N = c.n, K = c.k, KB = K / 128;
  cuda::Stream stream;
  // (Contiguous: holes inside the groups, m_max all-padding blocks at the end.)
  const GemmProblem problem = gemm_problem(c.masked, c.rows, c.m_max, N, K, true, c.m_max, rng, stream);
  const auto options = [&](int tail_pieces, int ablation) {
    cuda::GroupedGemmOptions o;
    o.block_m = 128;
    o.block_n = 256;
    o.max_ctas = c.max_ctas;
    o.tail_pieces = tail_pieces;
    o.ablation = ablation;
    o.split_tiles = 0;
    return o;
  };
  const auto run = [&](int tail_pieces, int ablation) {
    problem.d.fill_bytes(0xff, stream);
    problem.launch(options(tail_pieces, ablation), stream);
    return cuda::to_host(problem.d, stream);
  };
  cuda::fp8_grouped_gemm_take_trace();  // zero it
  const HostTensor got = run(1, 256);
  check_output(got, problem.ref, problem.valid, N);
  const cuda::Fp8GemmTrace t = cuda::fp8_grouped_gemm_take_trace();
  EXPECT_EQ(t.k_blocks, static_cast<std::uint64_t>(c.computed * KB));
  EXPECT_EQ(t.consumer_tiles, static_cast<std::uint64_t>(c.computed));

  const HostTensor whole = run(0, 0);
  EXPECT_EQ(std::memcmp(got.view().data, whole.view().data, got.nbytes()), 0)
      << "the pieces' bits differ from the whole tiles'";
  const HostTensor again = run(-1, 0);
  EXPECT_EQ(std::memcmp(got.view().data, again.view().data, got.nbytes()), 0) << "a second run differs";
  // (The two launches captured: a programmatic edge between them.)
  expect_graph_replays_give([&] { problem.launch(options(1, 0), stream); }, problem.d, got, stream);
}

// N = 512: two 256-column n-units per m-block (masked: group-major, then n-unit, then m-block;
// contiguous: one band, m-block-major).
INSTANTIATE_TEST_SUITE_P(
    Shapes, GroupedGemmTailPiecesGpu,
    ::testing::Values(
        // 2+2+1+1+0+2+1+2 m-blocks x 2 = 22 tiles on 7 CTAs: tail 1 (group 7's rows 128-199, columns
        // 256-511): 21 whole tiles and 4 pieces (the lower half of 8 rows).
        TailPiecesCase{"masked_tail1_K2048", true, {130, 200, 64, 1, 0, 256, 65, 200}, 256, 512, 2048, 7, 25},
        // 20 tiles on 9 CTAs: tail 2 (group 7's 33 rows, both n-units): 18 + 4 pieces (lower halves empty).
        TailPiecesCase{"masked_tail2_empty_halves_K7168",
                       true,
                       {130, 200, 64, 1, 0, 256, 65, 33},
                       256,
                       512,
                       7168,
                       9,
                       22},
        // 22 tiles on 5 CTAs: tail 2, 8 pieces > 5 CTAs: the 22 tiles whole.
        TailPiecesCase{
            "masked_tail_too_large", true, {130, 200, 64, 1, 0, 256, 65, 200}, 256, 512, 2048, 5, 22},
        // 4 tiles (M_max 256: the parent's grid 8 CTAs, the follower's 16), no whole round: all pieces
        // (group 0: 2 tiles x 4, group 1's 30 rows: 2 tiles x 2).
        TailPiecesCase{"masked_all_pieces", true, {100, 30}, 256, 512, 2048, 16, 12},
        // Contiguous (v11's split tiles off: they exclude the pieces), 6 m-blocks x 2 = 12 units on 10
        // CTAs: tail 2 (group 3's 100 rows, holes inside, both n-units): 10 + 2 x 4 pieces.
        TailPiecesCase{"contiguous_tail2_K2048", false, {130, 200, 64, 100}, 0, 512, 2048, 10, 18},
        // With an all-padding block at the end: 14 units on 12 CTAs, tail 2 = that block: 12 + 0 pieces.
        TailPiecesCase{"contiguous_padding_tail_K7168", false, {130, 200, 64, 100}, 1, 512, 7168, 12, 12},
        // Group 3 of 33 rows (holes: 28 valid, all in the first half), 12 units on 10 CTAs: 10 + 2 x 2
        // pieces.
        TailPiecesCase{"contiguous_tail2_half_K2048", false, {130, 200, 64, 33}, 0, 512, 2048, 10, 14}),
    [](const ::testing::TestParamInfo<TailPiecesCase>& info) { return info.param.name; });

// v30, the trimmed grid (GroupedGemmOptions::trim_ctas): a problem whose tiles leave the grid's last
// round at least half busy runs on ceil(T / ceil(T / CTAs)) CTAs (masked: the others leaving at once;
// contiguous: a smaller grid).
// Checked: the output against the reference (poisoned first; a unit the trimmed stride skipped would
// stay poisoned), the same bits as the untrimmed grid (every tile whole on one CTA either way), and a
// CUDA graph replayed twice. The case's tiles are worked out here, and must meet the rule.
struct TrimCase {
  std::string name;
  std::vector<std::int32_t> rows;  // masked_m
  std::int64_t m_max, n, k;
  int block_m, block_n;
  int max_ctas;
  bool workspace;      // with v21's split-tail workspace (the split instances; no tail of this rule splits)
  bool masked = true;  // else contiguous: rows per group, each padded to 128
};

void PrintTo(const TrimCase& c, std::ostream* os) {
  *os << c.name;
}

class GroupedGemmTrimmedGridGpu : public ::testing::TestWithParam<TrimCase> {};

TEST_P(GroupedGemmTrimmedGridGpu, MatchesTheReferenceAndTheFullGridsBits) {
  EPMOE_REQUIRE_GPU();
  const TrimCase& c = GetParam();
  testing::SeededRng rng;
  std::int64_t m_blocks = 0;
  for (const std::int32_t r : c.rows) m_blocks += (r + c.block_m - 1) / c.block_m;
  const std::int64_t tiles = m_blocks * (c.n / c.block_n), tail = tiles % c.max_ctas;
  ASSERT_GT(tiles, c.max_ctas);
  ASSERT_GE(2 * tail, c.max_ctas) << "the case does not meet the trim's rule";

  cuda::Stream stream;
  const cuda::DeviceTensor workspace(
      DType::i32, {c.workspace ? static_cast<std::int64_t>(cuda::grouped_gemm_workspace_bytes() / 4) : 0});
  workspace.fill_bytes(0x00, stream);
  cuda::GroupedGemmOptions options;
  options.block_m = c.block_m;
  options.block_n = c.block_n;
  options.max_ctas = c.max_ctas;
  options.split_tiles = 0;  // (v11's split tiles, automatic in contiguous K <= 2048, exclude the trim)
  if (c.workspace) {
    options.workspace = workspace.view().data;
    options.workspace_bytes = cuda::grouped_gemm_workspace_bytes();
  }
  const GemmProblem problem = gemm_problem(c.masked, c.rows, c.m_max, c.n, c.k, false, 0, rng, stream);
  const cuda::DeviceTensor& dd = problem.d;
  std::vector<HostTensor> outputs;
  for (const int trim : {1, 0}) {
    options.trim_ctas = trim;
    dd.fill_bytes(0xff, stream);
    problem.launch(options, stream);
    outputs.push_back(cuda::to_host(dd, stream));
    check_output(outputs.back(), problem.ref, problem.valid, c.n);
  }
  // (Rows never stored keep the poison in both.)
  EXPECT_EQ(std::memcmp(outputs[0].view().data, outputs[1].view().data, outputs[0].nbytes()), 0)
      << "the trimmed grid's bits differ from the full grid's";
  options.trim_ctas = 1;
  expect_graph_replays_give([&] { problem.launch(options, stream); }, dd, outputs[0], stream);
  // The contiguous grid itself is trimmed on the host: count the CTAs that ran by their entry stamps
  // (options.ablation 2048, output intact). (A masked grid keeps its size, its CTAs past the trimmed
  // stride leaving after their entry: the same bits above are what checks them.)
  if (!c.masked) {
    const std::int32_t want_trimmed =
        kernels::trimmed_ctas(static_cast<std::int32_t>(tiles), static_cast<std::int32_t>(c.max_ctas));
    ASSERT_LT(want_trimmed, c.max_ctas);
    for (const int trim : {1, 0}) {
      SCOPED_TRACE("trim_ctas " + std::to_string(trim));
      cuda::GroupedGemmOptions traced = options;
      traced.trim_ctas = trim;
      traced.ablation |= 2048;
      static_cast<void>(cuda::fp8_grouped_gemm_take_cta_trace(cuda::kGemmTraceMaxCtas, stream));
      problem.launch(traced, stream);
      int ran = 0;
      for (const cuda::GemmCtaStamps& s :
           cuda::fp8_grouped_gemm_take_cta_trace(cuda::kGemmTraceMaxCtas, stream))
        ran += s.entry != 0 ? 1 : 0;
      EXPECT_EQ(ran, trim == 1 ? want_trimmed : c.max_ctas);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GroupedGemmTrimmedGridGpu,
    ::testing::Values(
        // 128 x 256 (v29's zeros: groups of 77 and 150 rows have whole padding boxes), K = 2048:
        // 7 m-blocks x 4 = 28 tiles on 16 CTAs, tail 12: 2 rounds of 14 CTAs; an empty group.
        TrimCase{"N1024_K2048_128x256", {200, 130, 77, 0, 150}, 200, 1024, 2048, 128, 256, 16, false},
        // The same at K = 7168 with the split tail's workspace (the split instance with zeros; the tail
        // is too large to split).
        TrimCase{
            "N1024_K7168_128x256_workspace", {200, 130, 77, 0, 150}, 200, 1024, 7168, 128, 256, 16, true},
        // 64 x 128 decode tiles, K = 1024: 4 m-blocks x 12 = 48 tiles on 28 CTAs, tail 20: 2 rounds of
        // 24 CTAs; a 64-row group and a single row.
        TrimCase{"N1536_K1024_64x128", {40, 1, 64, 0, 33}, 64, 1536, 1024, 64, 128, 28, false},
        // 3 rounds: 5 m-blocks x 12 = 60 tiles on 22 CTAs, tail 16: 3 rounds of 20 CTAs.
        TrimCase{"N1536_K1024_64x128_3_rounds", {40, 9, 64, 17, 33}, 64, 1536, 1024, 64, 128, 22, false},
        // Contiguous (groups padded to 128 rows): 6 m-blocks x 4 = 24 tiles on 14 CTAs, tail 10: a grid of
        // 12; the workspace given (no tail of the rule splits) and v22's pieces left automatic (none fit).
        TrimCase{"contiguous_N1024_K2048_128x256", {300, 130, 77}, 0, 1024, 2048, 128, 256, 14, true, false}),
    [](const ::testing::TestParamInfo<TrimCase>& info) { return info.param.name; });

// The consumer-loop trace (options.ablation bit 256): the output as without it (checked against the
// reference), and the trace counts every K block of every tile once, in one launch, at an SM clock
// (cycles per nanosecond) a Hopper part can run at, and every tile's epilogue (and v12's stores) once;
// the read zeroes it.
TEST(GroupedGemmGpuMisc, LoopTraceCountsEveryKBlockAndKeepsTheOutput) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  const std::int64_t G = 3, M_max = 96, N = 1536, K = 2048, KB = K / 128;
  const std::vector<std::int32_t> counts{96, 33, 0};
  const MaskedInputs in = masked_inputs(G, M_max, N, K, ScaleLayout::token_major, counts, rng);
  cuda::Stream stream;
  const cuda::DeviceTensor da = cuda::to_device(in.a, stream), dsa = cuda::to_device(in.sa_gpu(), stream),
                           db = cuda::to_device(in.w.b, stream), dsb = cuda::to_device(in.w.b_scales, stream),
                           dcounts = cuda::to_device(in.counts, stream);
  const cuda::DeviceTensor dd(DType::bf16, {G, M_max, N});
  HostTensor ref(DType::f64, {G, M_max, N});
  grouped_gemm_masked_cpu(in.a, in.sa, in.w.b, in.w.b_scales, in.counts, ref);
  // 64 x 128 tiles (expected_m 8; two partials) and 128 x 256 tiles (expected_m 128).
  for (const std::int64_t block_m : {64, 128}) {
    SCOPED_TRACE("block_m " + std::to_string(block_m));
    cuda::GroupedGemmOptions options;
    options.ablation = 256;
    options.borrow_epilogue = 1;          // (masked at K = 2048: off by default)
    options.tail_pieces = 0;              // (one launch: v22's follower would take these few tiles)
    cuda::fp8_grouped_gemm_take_trace();  // zero it
    dd.fill_bytes(0xff, stream);
    cuda::fp8_grouped_gemm_masked(da, dsa, ScaleLayout::token_major, db, dsb, dcounts,
                                  block_m == 64 ? 8 : 128, dd, stream, options);
    const HostTensor got = cuda::to_host(dd, stream);
    check_output(got, ref, masked_valid(counts, M_max), N);
    const cuda::Fp8GemmTrace t = cuda::fp8_grouped_gemm_take_trace();
    const std::int64_t block_n = block_m == 64 ? 128 : 256;
    std::int64_t tiles = 0;
    for (const std::int32_t c : counts) tiles += (c + block_m - 1) / block_m * (N / block_n);
    EXPECT_EQ(t.launches, 1u);
    EXPECT_EQ(t.k_blocks, static_cast<std::uint64_t>(tiles * KB));
    // Every tile's epilogue once; v12's store warp (128 x 256 tiles borrow) every tile once, or none.
    EXPECT_EQ(t.consumer_tiles, static_cast<std::uint64_t>(tiles));
    EXPECT_GT(t.epilogue_cycles, 0u);
    EXPECT_EQ(t.stored_tiles, block_m == 128 ? static_cast<std::uint64_t>(tiles) : 0u);
    // Every CTA's next() after its last tile takes some cycles.
    EXPECT_GT(t.producer_turn_cycles, 0u);
    EXPECT_GE(t.ctas, 1u);
    EXPECT_GT(t.span_ns, 0u);
    ASSERT_GT(t.loop_ns, 0u);
    const double ghz = static_cast<double>(t.loop_cycles) / static_cast<double>(t.loop_ns);
    EXPECT_GT(ghz, 0.3);
    EXPECT_LT(ghz, 3.0);
    const cuda::Fp8GemmTrace again = cuda::fp8_grouped_gemm_take_trace();
    EXPECT_EQ(again.launches, 0u);
    EXPECT_EQ(again.k_blocks, 0u);
  }
}

// The per-CTA stamps (options.ablation 2048, fp8_grouped_gemm_take_cta_trace): the output intact, every
// CTA that ran stamped in order (entry <= last load issued <= stages released, within a second), at most
// one per SM, and the stamps cleared by the take. Both tile kernels, masked
// (64 x 128 and 128 x 256 with v12) and contiguous (128 x 256 with v33, the default).
TEST(GroupedGemmGpuMisc, CtaStampsAreOrderedAndKeepTheOutput) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  const std::int64_t N = 1536, K = 2048;
  cuda::Stream stream;
  int sm_count = 0;
  EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0));
  const auto check_stamps = [&] {
    const std::vector<cuda::GemmCtaStamps> st =
        cuda::fp8_grouped_gemm_take_cta_trace(cuda::kGemmTraceMaxCtas, stream);
    int ran = 0;
    for (const cuda::GemmCtaStamps& s : st) {
      if (s.entry == 0) {
        EXPECT_EQ(s.loads_issued, 0u);
        EXPECT_EQ(s.drained, 0u);
        continue;
      }
      ++ran;
      EXPECT_LE(s.entry, s.loads_issued);
      EXPECT_LE(s.loads_issued, s.drained);
      EXPECT_LT(s.drained - s.entry, 1'000'000'000u);
    }
    EXPECT_GE(ran, 1);
    EXPECT_LE(ran, sm_count);
    for (const cuda::GemmCtaStamps& s :
         cuda::fp8_grouped_gemm_take_cta_trace(cuda::kGemmTraceMaxCtas, stream))
      EXPECT_EQ(s.entry, 0u);
  };
  for (const bool masked : {true, false}) {
    for (const std::int64_t block_m : {64, 128}) {
      if (!masked && block_m == 64) continue;
      SCOPED_TRACE(std::string(masked ? "masked" : "contiguous") + " block_m " + std::to_string(block_m));
      const std::vector<std::int32_t> rows{96, 33, 0, 200};
      const GemmProblem problem = gemm_problem(masked, rows, 200, N, K, false, 0, rng, stream);
      cuda::GroupedGemmOptions options;
      options.ablation = 2048;
      options.block_m = static_cast<int>(block_m);
      if (masked) options.borrow_epilogue = 1;
      static_cast<void>(cuda::fp8_grouped_gemm_take_cta_trace(cuda::kGemmTraceMaxCtas, stream));
      problem.d.fill_bytes(0xff, stream);
      problem.launch(options, stream);
      const HostTensor got = cuda::to_host(problem.d, stream);
      check_output(got, problem.ref, problem.valid, N);
      check_stamps();
    }
  }
}

// Batch invariance: without the split tail (no workspace), a row's output bits depend only on its own
// activations and its group's weights - not on the other groups in the launch, the tile shape, the
// layout, the CTA count or the cluster - since every output element is the same f32 sum over K in
// the same order. (The layer's two-batch overlap and its bit-exact tests rely on it; a split tail
// sums K in chunks and is why the layer's runner passes no workspace: bench/NOTES.md session 39.)
TEST(GroupedGemmGpuMisc, RowsDoNotDependOnTheBatchTheTileOrTheLayout) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  const std::int64_t N = 1536, K = 7168, KB = K / 128;
  // Group 0 (the rows compared: 200, so one whole and one partial 128-row block) beside three others.
  const std::vector<std::int32_t> rows{200, 129, 64, 300};
  const auto G = static_cast<std::int64_t>(rows.size());
  const std::int64_t r0 = rows[0];
  const Weights w = random_weights(G, N, K, rng);
  const std::vector<std::int32_t> ids = contiguous_ids(rows, false, 0);
  const auto M = static_cast<std::int64_t>(ids.size());
  HostTensor a(DType::fp8_e4m3, {M, K}), sa(DType::f32, {M, KB});
  const HostTensor m_indices = host_i32(ids);
  fill_random_fp8(static_cast<std::uint8_t*>(a.view().data), a.numel(), rng);
  fill_random_scales(sa.data<float>(), sa.numel(), rng);

  cuda::Stream stream;
  const cuda::DeviceTensor da = cuda::to_device(a, stream), dsa = cuda::to_device(sa, stream),
                           db = cuda::to_device(w.b, stream), dsb = cuda::to_device(w.b_scales, stream),
                           dids = cuda::to_device(m_indices, stream);
  // Group 0's rows [0, r0) x N of an output, as bytes.
  const auto group0 = [&](const cuda::DeviceTensor& d) {
    const HostTensor h = cuda::to_host(d, stream);
    const auto* bytes = static_cast<const std::uint8_t*>(h.view().data);
    return std::vector<std::uint8_t>(bytes, bytes + r0 * N * 2);
  };
  const auto contiguous = [&](const cuda::GroupedGemmOptions& o) {
    const cuda::DeviceTensor dd(DType::bf16, {M, N});
    dd.fill_bytes(0xff, stream);
    cuda::fp8_grouped_gemm_contiguous(da, dsa, ScaleLayout::token_major, db, dsb, dids, dd, stream, o);
    return group0(dd);
  };
  const std::vector<std::uint8_t> want = contiguous({});
  {  // Against the reference once (the bits compared below are the right ones).
    const cuda::DeviceTensor dd(DType::bf16, {M, N});
    dd.fill_bytes(0xff, stream);
    cuda::fp8_grouped_gemm_contiguous(da, dsa, ScaleLayout::token_major, db, dsb, dids, dd, stream, {});
    HostTensor ref(DType::f64, {M, N});
    grouped_gemm_contiguous_cpu(a, sa, w.b, w.b_scales, m_indices, ref);
    std::vector<bool> valid;
    for (const std::int32_t id : ids) valid.push_back(id >= 0);
    check_output(cuda::to_host(dd, stream), ref, valid, N);
  }
  struct Variant {
    const char* name;
    int block_m, block_n, max_ctas, cluster;
  };
  for (const Variant v :
       {Variant{"128 x 128 tiles", 128, 128, 0, 0}, Variant{"64 x 128 tiles", 64, 128, 0, 0},
        Variant{"7 CTAs", 0, 0, 7, 0}, Variant{"a cluster pair", 128, 256, 0, 2}}) {
    cuda::GroupedGemmOptions o;
    o.block_m = v.block_m;
    o.block_n = v.block_n;
    o.max_ctas = v.max_ctas;
    o.cluster = v.cluster;
    EXPECT_TRUE(contiguous(o) == want) << v.name << " changes group 0's bits";
  }
  {  // Group 0 alone (its rows and weights only).
    const cuda::DeviceTensor db0 = cuda::to_device(w.b.view().slice_rows(0, 1), stream),
                             dsb0 = cuda::to_device(w.b_scales.view().slice_rows(0, 1), stream);
    const std::int64_t M0 = (r0 + 127) / 128 * 128;
    const cuda::DeviceTensor dd(DType::bf16, {M0, N});
    dd.fill_bytes(0xff, stream);
    cuda::fp8_grouped_gemm_contiguous(da.view().slice_rows(0, M0), dsa.view().slice_rows(0, M0),
                                      ScaleLayout::token_major, db0, dsb0, dids.view().slice_rows(0, M0), dd,
                                      stream, {});
    EXPECT_TRUE(group0(dd) == want) << "group 0 alone differs";
    // And in the masked layout (M_max 256, the scales MN-major), at two tile heights.
    const std::int64_t M_max = 256;
    HostTensor am(DType::fp8_e4m3, {1, M_max, K}), sam(DType::f32, {1, M_max, KB}), count(DType::i32, {1});
    std::memcpy(am.view().data, a.view().data, static_cast<std::size_t>(r0 * K));
    std::memset(static_cast<std::uint8_t*>(am.view().data) + r0 * K, 0x7f,
                static_cast<std::size_t>((M_max - r0) * K));
    std::memcpy(sam.data<float>(), sa.data<float>(), static_cast<std::size_t>(r0 * KB) * sizeof(float));
    for (std::int64_t i = r0 * KB; i < M_max * KB; ++i) sam.data<float>()[i] = 1.0f;
    count.data<std::int32_t>()[0] = static_cast<std::int32_t>(r0);
    const std::int64_t padded = cuda::tma_aligned_tokens(M_max);
    HostTensor sam_mn(DType::f32, {1, KB, padded});
    to_mn_major(sam.data<float>(), M_max, KB, sam_mn.data<float>());
    const cuda::DeviceTensor dam = cuda::to_device(am, stream), dsam = cuda::to_device(sam_mn, stream),
                             dcount = cuda::to_device(count, stream);
    // (128-row tiles: 12 of them, all v22's pieces by default; whole without.)
    for (const auto& [block_m, tail_pieces] : {std::pair{128, 0}, std::pair{128, 1}, std::pair{64, 0}}) {
      cuda::GroupedGemmOptions o;
      o.block_m = block_m;
      o.tail_pieces = tail_pieces;
      const cuda::DeviceTensor dm(DType::bf16, {1, M_max, N});
      dm.fill_bytes(0xff, stream);
      cuda::fp8_grouped_gemm_masked(dam, dsam, ScaleLayout::mn_major_tma, db0, dsb0, dcount, r0, dm, stream,
                                    o);
      EXPECT_TRUE(group0(dm) == want)
          << "the masked layout with " << block_m << "-row tiles (tail pieces " << tail_pieces << ") differs";
    }
  }
}

// ---------------------------------------------------------------- random problems, automatic choices
// The cases above pin one path each. Here the automatic choices (tile shape, split tiles, A row boxes,
// zero padding, the trimmed grid, swapped operands, the epilogue, whole-tile stores; the split tail where a
// workspace is given) meet random problems: group counts, rows per group (empty groups, full M_max, a few
// masked counts outside [0, M_max], which the kernel clamps), N, K, both scale layouts and an expected_m
// hint that is sometimes far off (a caller's estimate picks the tiles, never the result). A fresh seed per
// run (in the failure message); every problem against the reference with its output poisoned, then again
// for the same bits.

// Poisons d, launches, checks against the reference; then once more: the same bits.
void expect_problem_matches(const GemmProblem& problem, const cuda::GroupedGemmOptions& options,
                            std::int64_t n, cuda::Stream& stream) {
  const HostTensor got =
      testing::run_twice_same_bits(problem.d, stream, [&] { problem.launch(options, stream); });
  check_output(got, problem.ref, problem.valid, n);
}

// Where the problem's masked counts leave [0, M_max] on the device (SweepProblem::device_rows), the
// launch reads those.
void use_device_rows(GemmProblem& problem, const testing::SweepProblem& p, cuda::Stream& stream) {
  if (p.device_rows.empty()) return;
  problem.operands[4] = cuda::to_device(host_i32(p.device_rows), stream);
}

void sweep(bool masked) {
  testing::SeededRng rng;
  cuda::Stream stream;
  const cuda::DeviceTensor workspace(DType::i32,
                                     {static_cast<std::int64_t>(cuda::grouped_gemm_workspace_bytes() / 4)});
  workspace.fill_bytes(0x00, stream);  // (its counters: zero once, and the kernel leaves them so)
  for (int i = 0; i < testing::kSweepProblems; ++i) {
    const testing::SweepProblem p =
        masked ? testing::draw_masked_problem(rng) : testing::draw_contiguous_problem(rng);
    const ScaleLayout layout = uniform(rng, 0, 1) == 0 ? ScaleLayout::mn_major_tma : ScaleLayout::token_major;
    GemmProblem problem =
        gemm_problem(masked, p.rows, p.m_max, p.n, p.k, p.holes, p.trailing_blocks, rng, stream, layout);
    problem.expected_m = p.expected_m;
    use_device_rows(problem, p, stream);
    cuda::GroupedGemmOptions options;
    const bool with_workspace = uniform(rng, 0, 1) == 0;
    if (with_workspace) {
      options.workspace = workspace.view().data;
      options.workspace_bytes = cuda::grouped_gemm_workspace_bytes();
    }
    std::ostringstream what;
    what << "problem " << i << ": " << p.describe() << "; "
         << (layout == ScaleLayout::mn_major_tma ? "MN-major" : "token-major") << " scales, workspace "
         << with_workspace;
    if (masked) {
      const cuda::GemmTileShape tile = cuda::grouped_gemm_tile(true, p.expected_m, p.n);
      what << ", tile " << tile.block_m << " x " << tile.block_n;
    }
    SCOPED_TRACE(what.str());
    std::printf("  %s\n", what.str().c_str());
    expect_problem_matches(problem, options, p.n, stream);
  }
}

TEST(GroupedGemmSweepGpu, RandomMaskedProblemsWithTheAutomaticChoices) {
  EPMOE_REQUIRE_GPU();
  sweep(true);
}

TEST(GroupedGemmSweepGpu, RandomContiguousProblemsWithTheAutomaticChoices) {
  EPMOE_REQUIRE_GPU();
  sweep(false);
}

TEST(GroupedGemmGpuMisc, RefusesBadArguments) {
  EPMOE_REQUIRE_GPU();
  cuda::Stream stream;
  const std::int64_t G = 2, M = 256, N = 256, K = 256;
  const cuda::DeviceTensor a(DType::fp8_e4m3, {M, K}), sa(DType::f32, {M, K / 128}),
      sa_mn(DType::f32, {K / 128, M}), b(DType::fp8_e4m3, {G, N, K}), sb(DType::f32, {G, N / 128, K / 128}),
      ids(DType::i32, {M}), d(DType::bf16, {M, N});
  a.fill_bytes(0x38, stream);  // 1.0 everywhere: initialised inputs
  b.fill_bytes(0x38, stream);
  sa.fill_bytes(0x3c, stream);  // about 0.0117
  sa_mn.fill_bytes(0x3c, stream);
  sb.fill_bytes(0x3c, stream);
  ids.fill_bytes(0x00, stream);  // every row in group 0
  EXPECT_NO_THROW(cuda::fp8_grouped_gemm_contiguous(a, sa, ScaleLayout::token_major, b, sb, ids, d, stream));
  EXPECT_NO_THROW(
      cuda::fp8_grouped_gemm_contiguous(a, sa_mn, ScaleLayout::mn_major_tma, b, sb, ids, d, stream));

  using cuda::fp8_grouped_gemm_contiguous;
  const auto tm = ScaleLayout::token_major;
  expect_error_mentions(
      [&] { fp8_grouped_gemm_contiguous(a, sa, ScaleLayout::mn_major_tma, b, sb, ids, d, stream); },
      "a_scales (mn_major_tma) must have shape [2, 256]");
  const cuda::DeviceTensor a_bf16(DType::bf16, {M, K});
  expect_error_mentions([&] { fp8_grouped_gemm_contiguous(a_bf16, sa, tm, b, sb, ids, d, stream); },
                        "a must have dtype fp8_e4m3");
  const cuda::DeviceTensor a_k(DType::fp8_e4m3, {M, 384});
  expect_error_mentions([&] { fp8_grouped_gemm_contiguous(a_k, sa, tm, b, sb, ids, d, stream); },
                        "a (K of b)");
  const cuda::DeviceTensor b_k(DType::fp8_e4m3, {G, N, 200});
  expect_error_mentions([&] { fp8_grouped_gemm_contiguous(a, sa, tm, b_k, sb, ids, d, stream); },
                        "K = 200 must be a positive multiple of 128");
  const cuda::DeviceTensor b_n(DType::fp8_e4m3, {G, 192, K});
  expect_error_mentions([&] { fp8_grouped_gemm_contiguous(a, sa, tm, b_n, sb, ids, d, stream); },
                        "N = 192 must be a positive multiple of 128");
  const cuda::DeviceTensor sb_bad(DType::f32, {G, N / 128, K / 64});
  expect_error_mentions([&] { fp8_grouped_gemm_contiguous(a, sa, tm, b, sb_bad, ids, d, stream); },
                        "b_scales must have shape");
  const cuda::DeviceTensor ids_bad(DType::i64, {M});
  expect_error_mentions([&] { fp8_grouped_gemm_contiguous(a, sa, tm, b, sb, ids_bad, d, stream); },
                        "m_indices must have dtype i32");
  const cuda::DeviceTensor d_bad(DType::bf16, {M, 2 * N});
  expect_error_mentions([&] { fp8_grouped_gemm_contiguous(a, sa, tm, b, sb, ids, d_bad, stream); },
                        "d must have shape");
  const cuda::DeviceTensor d_f32(DType::f32, {M, N});
  expect_error_mentions([&] { fp8_grouped_gemm_contiguous(a, sa, tm, b, sb, ids, d_f32, stream); },
                        "d must have dtype bf16");
  const HostTensor a_host(DType::fp8_e4m3, {M, K});
  expect_error_mentions([&] { fp8_grouped_gemm_contiguous(a_host, sa, tm, b, sb, ids, d, stream); },
                        "a must live on cuda");
  // Misaligned (TMA needs 16-byte aligned global addresses) and non-contiguous views.
  const cuda::DeviceBuffer raw(static_cast<std::size_t>(M * K) + 64);
  TensorView a_off = raw.view(DType::fp8_e4m3, {M, K});
  a_off.data = static_cast<std::byte*>(a_off.data) + 8;
  expect_error_mentions([&] { fp8_grouped_gemm_contiguous(a_off, sa, tm, b, sb, ids, d, stream); },
                        "a must be 16-byte aligned");
  TensorView a_strided = a.view();
  a_strided.stride[0] = 2 * K;
  expect_error_mentions([&] { fp8_grouped_gemm_contiguous(a_strided, sa, tm, b, sb, ids, d, stream); },
                        "a must be contiguous");
  // Each bad option (or pair) alone, and the message that must name it.
  struct BadOptions {
    std::function<void(cuda::GroupedGemmOptions&)> set;
    std::string message;
  };
  const std::vector<BadOptions> bad_options{
      {[](cuda::GroupedGemmOptions& o) { o.block_n = 192; },
       "options.block_n must be 0 (automatic), 128 or 256"},
      {[](cuda::GroupedGemmOptions& o) {
         o.block_m = 64;
         o.block_n = 256;
       },
       "64 x 256 tiles are not built"},
      {[](cuda::GroupedGemmOptions& o) { o.block_m = 96; },
       "options.block_m must be 0 (automatic), 64 or 128"},
      {[](cuda::GroupedGemmOptions& o) { o.stages = 99; }, "options.stages must be 0 (all) or 1.."},
      {[](cuda::GroupedGemmOptions& o) { o.cluster = 3; }, "options.cluster must be 0 (automatic), 1 or 2"},
      {[](cuda::GroupedGemmOptions& o) {
         o.cluster = 2;
         o.block_m = 64;
       },
       "options.cluster = 2 needs 128-row tiles"},
      // N = 256 with 256-wide tiles: one column tile.
      {[](cuda::GroupedGemmOptions& o) { o.cluster = 2; },
       "options.cluster = 2 needs an even number of column tiles"},
      {[](cuda::GroupedGemmOptions& o) { o.l2_promotion = 3; }, "options.l2_promotion must be 0, 1 or 2"},
      {[](cuda::GroupedGemmOptions& o) { o.split_tiles = 2; },
       "options.split_tiles must be -1 (automatic), 0 or 1"},
      {[](cuda::GroupedGemmOptions& o) { o.borrow_epilogue = -2; },
       "options.borrow_epilogue must be -1 (automatic), 0, 1, 2 or 3"},
      {[](cuda::GroupedGemmOptions& o) { o.band_columns = -1; }, "options.band_columns must be >= 0"},
      {[](cuda::GroupedGemmOptions& o) { o.max_ctas = -1; }, "options.max_ctas must be >= 0, got -1"},
      {[](cuda::GroupedGemmOptions& o) { o.a_row_box_rows = 4; },
       "options.a_row_box_rows must be -1 (automatic), 0, 8 or 16"},
      {[](cuda::GroupedGemmOptions& o) { o.tile_store = 2; },
       "options.tile_store must be -1 (automatic), 0 or 1"},
      {[](cuda::GroupedGemmOptions& o) { o.ablation = -1; }, "options.ablation must be a bit set in 0.."},
      {[](cuda::GroupedGemmOptions& o) { o.tail_pieces = 2; },
       "options.tail_pieces must be -1 (automatic), 0 or 1"},
      {[](cuda::GroupedGemmOptions& o) { o.trim_ctas = -2; },
       "options.trim_ctas must be -1 (automatic), 0 or 1"},
      {[](cuda::GroupedGemmOptions& o) { o.split_tail = 2; },
       "options.split_tail must be -1 (automatic), 0 or 1"},
      {[](cuda::GroupedGemmOptions& o) { o.split_tail = 1; },
       "options.split_tail = 1 needs options.workspace"},
      // (Fake workspace addresses: refused before anything is launched.)
      {[](cuda::GroupedGemmOptions& o) {
         o.workspace = reinterpret_cast<void*>(std::uintptr_t{0x1000});
         o.workspace_bytes = 1;
       },
       "options.workspace_bytes must be >= grouped_gemm_workspace_bytes()"},
      {[](cuda::GroupedGemmOptions& o) {
         o.workspace = reinterpret_cast<void*>(std::uintptr_t{0x1010});
         o.workspace_bytes = cuda::grouped_gemm_workspace_bytes();
       },
       "options.workspace must be 256-byte aligned"},
  };
  for (const BadOptions& bad : bad_options) {
    cuda::GroupedGemmOptions o;
    bad.set(o);
    expect_error_mentions([&] { fp8_grouped_gemm_contiguous(a, sa, tm, b, sb, ids, d, stream, o); },
                          bad.message);
  }

  // Masked.
  const std::int64_t M_max = 100;
  const cuda::DeviceTensor am(DType::fp8_e4m3, {G, M_max, K}), sam(DType::f32, {G, M_max, K / 128}),
      sam_mn(DType::f32, {G, K / 128, cuda::tma_aligned_tokens(M_max)}), counts(DType::i32, {G}),
      dm(DType::bf16, {G, M_max, N});
  am.fill_bytes(0x38, stream);
  sam.fill_bytes(0x3c, stream);
  sam_mn.fill_bytes(0x3c, stream);
  counts.fill_bytes(0x00, stream);
  using cuda::fp8_grouped_gemm_masked;
  EXPECT_NO_THROW(fp8_grouped_gemm_masked(am, sam, tm, b, sb, counts, 8, dm, stream));
  EXPECT_NO_THROW(
      fp8_grouped_gemm_masked(am, sam_mn, ScaleLayout::mn_major_tma, b, sb, counts, 8, dm, stream));
  const cuda::DeviceTensor am_g(DType::fp8_e4m3, {G + 1, M_max, K});
  expect_error_mentions([&] { fp8_grouped_gemm_masked(am_g, sam, tm, b, sb, counts, 8, dm, stream); },
                        "a (G and K of b)");
  expect_error_mentions([&] { fp8_grouped_gemm_masked(am, sam_mn, tm, b, sb, counts, 8, dm, stream); },
                        "a_scales (token_major) must have shape [2, 100, 2]");
  const cuda::DeviceTensor counts_bad(DType::i32, {G + 1});
  expect_error_mentions([&] { fp8_grouped_gemm_masked(am, sam, tm, b, sb, counts_bad, 8, dm, stream); },
                        "masked_m must have shape [2]");
  expect_error_mentions([&] { fp8_grouped_gemm_masked(am, sam, tm, b, sb, counts, -1, dm, stream); },
                        "expected_m must be >= 0");
  expect_error_mentions([&] { fp8_grouped_gemm_masked(a, sa, tm, b, sb, counts, 8, d, stream); },
                        "a must have rank 3");
  cuda::GroupedGemmOptions swap;
  swap.swap_ab = 1;
  EXPECT_NO_THROW(fp8_grouped_gemm_masked(am, sam, tm, b, sb, counts, 8, dm, stream, swap));
  expect_error_mentions([&] { fp8_grouped_gemm_contiguous(a, sa, tm, b, sb, ids, d, stream, swap); },
                        "options.swap_ab = 1 applies to the masked layout only");
  swap.block_m = 64;
  expect_error_mentions([&] { fp8_grouped_gemm_masked(am, sam, tm, b, sb, counts, 8, dm, stream, swap); },
                        "options.swap_ab = 1 picks its own tiles");
  swap.block_m = 0;
  swap.stages = 9;
  expect_error_mentions([&] { fp8_grouped_gemm_masked(am, sam, tm, b, sb, counts, 8, dm, stream, swap); },
                        "options.stages must be 0 (all) or 1..");
  swap.stages = 0;
  swap.swap_ab = 2;
  expect_error_mentions([&] { fp8_grouped_gemm_masked(am, sam, tm, b, sb, counts, 8, dm, stream, swap); },
                        "options.swap_ab must be -1 (automatic), 0 or 1, got 2");
  stream.synchronize();
}

}  // namespace
}  // namespace epmoe
