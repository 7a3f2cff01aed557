// Host launcher of the FP8 block-scaled grouped GEMM (device code in fp8_grouped_gemm_kernel.cuh,
// API in epmoe/cuda/grouped_gemm.hpp): argument checks, TMA tensor maps, tile choice, launch.
//
// Tensor maps are encoded on the host for every call (a few microseconds of CPU work, no device
// work) with cuTensorMapEncodeTiled, which is looked up through the runtime's driver entry point
// (cudaGetDriverEntryPointByVersion), so nothing links libcuda. They travel to the kernel by value
// as __grid_constant__ parameters, which also keeps the launch capturable in a CUDA graph.
#include "epmoe/cuda/grouped_gemm.hpp"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string_view>

#include "cuda/pdl_launch.hpp"
#include "epmoe/cuda/launch.hpp"
#include "gemm/fp8_grouped_gemm_kernel.cuh"
#include "gemm/fp8_masked_swap_kernel.cuh"
#include "gemm/gemm_host.hpp"

namespace epmoe::cuda {
namespace {

using kernels::GemmTraits;
using kernels::GroupedGemmParams;
using kernels::kGemmBlockK;

constexpr std::int64_t kInt32Max = std::numeric_limits<std::int32_t>::max();
// Rows of the small A box (tiles with at most this many valid rows: decode).
constexpr int kSmallABoxRows = 32;
constexpr int kRowBoxRows = 16;      // v35
constexpr int kSmallRowBoxRows = 8;  // v35 at decode sizes (expected_m <= kSmallRowBoxMaxM)
constexpr int kSmallRowBoxMaxM = 16;
// v37: masked launches that split their tiles load A in row boxes up to this many expected rows per group
// (measured: 8 and 16 rows with 8-row boxes, 32 with 16-row ones, bench/NOTES.md session 48); from 24 to 64
// expected rows every box size measured within 0.3% (session 49), and launches expecting more have whole
// tiles of 65+ rows, where up to 8 loads of A per K block made 32 x 192 17% slower.
constexpr std::int64_t kSplitRowBoxMaxM = 32;
// v35's boxes measured level or slower at K = 2048 (decode 128 x 16 0.3%, 32 x 32 0.15%; one more TMA load
// per box and K block, with few K blocks per tile), faster at K = 7168 (decode 128 x 8 1.2%): from this K on.
constexpr std::int32_t kRowBoxMinK = 4096;

// A boolean option's override from the environment (A/B timing without rebuilding): -1 when
// `name` is unset or empty, 1 when it is "1", else 0. Read once per process.
int env_switch(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || *v == '\0' ? -1 : std::string_view(v) == "1" ? 1 : 0;
}
// An environment mode 0..max_mode, or -1 when unset (anything else is refused).
int env_mode(const char* name, int max_mode) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return -1;
  const std::string_view s(v);
  EPMOE_CHECK(s.size() == 1 && s[0] >= '0' && s[0] - '0' <= max_mode, "{} must be 0..{}, got '{}'", name,
              max_mode, s);
  return s[0] - '0';
}
bool with_env(int env, bool option) {
  return env < 0 ? option : env == 1;
}
// A three-way option (-1 automatic, 0 off, 1 on) resolved against the automatic choice.
bool resolve_choice(int option, bool automatic) {
  return option < 0 ? automatic : option == 1;
}

// b [G, N, K] and b_scales [G, N/128, K/128]; returns (G, N, K).
struct Dims {
  std::int64_t groups, n, k;
};
Dims check_weights(const TensorView& b, const TensorView& b_scales) {
  expect_device_tensor(b, DType::fp8_e4m3, "b", 16);
  expect_rank(b, 3, "b");
  const Dims dims{b.shape[0], b.shape[1], b.shape[2]};
  EPMOE_CHECK(dims.groups > 0, "b must hold at least one group, got {}", b.describe());
  EPMOE_CHECK(dims.k > 0 && dims.k % kGemmBlockK == 0, "b: K = {} must be a positive multiple of {}", dims.k,
              kGemmBlockK);
  EPMOE_CHECK(dims.n > 0 && dims.n % 128 == 0, "b: N = {} must be a positive multiple of 128", dims.n);
  EPMOE_CHECK(dims.groups * dims.n <= kInt32Max && dims.k <= kInt32Max && b_scales.numel() <= kInt32Max,
              "b {} is too large for one launch", b.describe());
  expect_device_tensor(b_scales, DType::f32, "b_scales", 4);
  expect_shape(b_scales, {dims.groups, dims.n / 128, dims.k / 128}, "b_scales");
  return dims;
}

// Strides of the A scales: (per group, per row, per K block), in elements.
struct ScaleStrides {
  std::int64_t group, row, kb;
};
ScaleStrides check_a_scales(const TensorView& s, ScaleLayout layout, std::int64_t groups, std::int64_t rows,
                            std::int64_t kb, bool masked) {
  expect_device_tensor(s, DType::f32, "a_scales", 4);
  EPMOE_CHECK(s.numel() <= kInt32Max, "a_scales {} is too large for one launch", s.describe());
  const std::int64_t padded = tma_aligned_tokens(rows);
  if (layout == ScaleLayout::token_major) {
    if (masked) {
      expect_shape(s, {groups, rows, kb}, "a_scales (token_major)");
      return {rows * kb, kb, 1};
    }
    expect_shape(s, {rows, kb}, "a_scales (token_major)");
    return {0, kb, 1};
  }
  EPMOE_CHECK(layout == ScaleLayout::mn_major_tma, "unknown scale layout {}", static_cast<int>(layout));
  if (masked) {
    expect_shape(s, {groups, kb, padded}, "a_scales (mn_major_tma)");
    return {kb * padded, 1, padded};
  }
  expect_shape(s, {kb, padded}, "a_scales (mn_major_tma)");
  return {0, 1, padded};
}

void check_device() {
  gemm_host::require_hopper("the FP8 grouped GEMM");
}

// options.ablation bit 1024: v12 without the producer's epi_done gate (kernels::kBorrowNoGate).
constexpr int kAblateNoEpiGate = 1024;

// The tile of this call: options, else the heuristic.
GemmTileShape check_tile(const GroupedGemmOptions& options, bool masked, std::int64_t expected_m,
                         std::int64_t n) {
  EPMOE_CHECK(options.block_m == 0 || options.block_m == 64 || options.block_m == 128,
              "options.block_m must be 0 (automatic), 64 or 128, got {}", options.block_m);
  EPMOE_CHECK(options.block_n == 0 || options.block_n == 128 || options.block_n == 256,
              "options.block_n must be 0 (automatic), 128 or 256, got {}", options.block_n);
  EPMOE_CHECK(options.max_ctas >= 0, "options.max_ctas must be >= 0, got {}", options.max_ctas);
  EPMOE_CHECK(options.split_tiles >= -1 && options.split_tiles <= 1,
              "options.split_tiles must be -1 (automatic), 0 or 1, got {}", options.split_tiles);
  EPMOE_CHECK(options.tile_store >= -1 && options.tile_store <= 1,
              "options.tile_store must be -1 (automatic), 0 or 1, got {}", options.tile_store);
  EPMOE_CHECK(options.a_row_box_rows == -1 || options.a_row_box_rows == 0 || options.a_row_box_rows == 8 ||
                  options.a_row_box_rows == 16,
              "options.a_row_box_rows must be -1 (automatic), 0, 8 or 16, got {}", options.a_row_box_rows);
  EPMOE_CHECK(options.borrow_epilogue >= -1 && options.borrow_epilogue <= 3,
              "options.borrow_epilogue must be -1 (automatic), 0, 1, 2 or 3, got {}",
              options.borrow_epilogue);
  EPMOE_CHECK(options.band_columns >= 0, "options.band_columns must be >= 0 (0: 1024), got {}",
              options.band_columns);
  EPMOE_CHECK(options.ablation >= 0 && options.ablation <= 4095,
              "options.ablation must be a bit set in 0..4095, got {}", options.ablation);
  EPMOE_CHECK(options.l2_promotion >= 0 && options.l2_promotion <= 2,
              "options.l2_promotion must be 0, 1 or 2, got {}", options.l2_promotion);
  EPMOE_CHECK(options.cluster >= 0 && options.cluster <= 2,
              "options.cluster must be 0 (automatic), 1 or 2, got {}", options.cluster);
  EPMOE_CHECK(options.swap_ab >= -1 && options.swap_ab <= 1,
              "options.swap_ab must be -1 (automatic), 0 or 1, got {}", options.swap_ab);
  EPMOE_CHECK(options.tail_pieces >= -1 && options.tail_pieces <= 1,
              "options.tail_pieces must be -1 (automatic), 0 or 1, got {}", options.tail_pieces);
  EPMOE_CHECK(options.trim_ctas >= -1 && options.trim_ctas <= 1,
              "options.trim_ctas must be -1 (automatic), 0 or 1, got {}", options.trim_ctas);
  EPMOE_CHECK(options.split_tail >= -1 && options.split_tail <= 1,
              "options.split_tail must be -1 (automatic), 0 or 1, got {}", options.split_tail);
  EPMOE_CHECK(options.split_tail != 1 || options.workspace != nullptr,
              "options.split_tail = 1 needs options.workspace (grouped_gemm_workspace_bytes() bytes)");
  EPMOE_CHECK(options.workspace == nullptr || options.workspace_bytes >= grouped_gemm_workspace_bytes(),
              "options.workspace_bytes must be >= grouped_gemm_workspace_bytes() = {}, got {}",
              grouped_gemm_workspace_bytes(), options.workspace_bytes);
  EPMOE_CHECK(reinterpret_cast<std::uintptr_t>(options.workspace) % 256 == 0,
              "options.workspace must be 256-byte aligned");
  GemmTileShape tile = grouped_gemm_tile(masked, expected_m, n);
  if (options.block_m != 0) tile.block_m = options.block_m;
  if (options.block_n != 0) tile.block_n = options.block_n;
  // A forced height without a forced width: the heuristic's width for that height.
  if (options.block_m != 0 && options.block_n == 0)
    tile.block_n = tile.block_m == 128 && n % 256 == 0 ? 256 : 128;
  EPMOE_CHECK(n % tile.block_n == 0, "N = {} must be a multiple of options.block_n = {}", n, tile.block_n);
  EPMOE_CHECK(!(tile.block_m == 64 && tile.block_n == 256), "64 x 256 tiles are not built; use block_n 128");
  EPMOE_CHECK(options.cluster != 2 || tile.block_m == 128,
              "options.cluster = 2 needs 128-row tiles, got {} x {}", tile.block_m, tile.block_n);
  EPMOE_CHECK(options.cluster != 2 || (n / tile.block_n) % 2 == 0,
              "options.cluster = 2 needs an even number of column tiles, got N = {} with block_n = {}", n,
              tile.block_n);
  return tile;
}

// CTAs per cluster: the option, else 1. A pair (2: two column tiles sharing A by multicast; 128-row
// tiles, an even number of column tiles) was the contiguous default until the session-13 bench
// (burst timing, every anchor row): level on large groups (within 0.4%) and slower on small ones
// (128 groups x 128 rows: 1453 vs 1294 us, 104 vs 88 cycles per wgmma); masked layouts already ran
// up to 6% faster without (v3 bench).
int cluster_size(const GroupedGemmOptions& options) {
  return options.cluster != 0 ? options.cluster : 1;
}

// The TMA loads' L2 promotion (GroupedGemmOptions::l2_promotion, checked by check_tile).
CUtensorMapL2promotion l2_promotion(const GroupedGemmOptions& options) {
  constexpr CUtensorMapL2promotion kPromotions[] = {CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                                    CU_TENSOR_MAP_L2_PROMOTION_NONE,
                                                    CU_TENSOR_MAP_L2_PROMOTION_L2_128B};
  return kPromotions[options.l2_promotion];
}

// The persistent CTAs a launch may have: one per SM, at most options.max_ctas.
std::int64_t ctas_allowed(const GroupedGemmOptions& options) {
  const std::int64_t sms = device_props().sm_count;
  // EPMOE_GEMM_MAX_CTAS=C: the same cap where the options leave it open (experiments, A/B timing).
  static const std::int64_t env_ctas = [] {
    const char* e = std::getenv("EPMOE_GEMM_MAX_CTAS");
    return e != nullptr && *e != '\0' ? std::max(0, std::atoi(e)) : 0;
  }();
  const std::int64_t cap = options.max_ctas > 0 ? options.max_ctas : env_ctas;
  return cap > 0 ? std::min<std::int64_t>(sms, cap) : sms;
}

// The layout-specific parts of a launch.
struct Problem {
  GroupedGemmParams params;         // everything but the tile-dependent fields
  std::int64_t a_rows;              // rows of A viewed as a 2D [a_rows, K] tensor
  std::int64_t tile_rows;           // contiguous: M; masked: M_max (per group)
  std::int64_t groups_in_schedule;  // masked: G (upper bound of the tiles); contiguous: 1
  std::int64_t expected_m = 0;      // masked: the caller's expected rows per group (a hint)
};

// A checked call's problem: `rows` per group of `groups_in_schedule` (contiguous: M and 1; masked: M_max
// and G), with m_indices (contiguous) or masked_m (masked) as given, the other null.
Problem make_problem(const TensorView& a_scales, const ScaleStrides& ss, const TensorView& b_scales,
                     const Dims& w, const TensorView& d, std::int64_t rows, std::int64_t groups_in_schedule,
                     const std::int32_t* m_indices, const std::int32_t* masked_m) {
  Problem problem{};
  GroupedGemmParams& p = problem.params;
  p.sa = static_cast<const float*>(a_scales.data);
  p.sa_group_stride = static_cast<std::int32_t>(ss.group);
  p.sa_row_stride = static_cast<std::int32_t>(ss.row);
  p.sa_kb_stride = static_cast<std::int32_t>(ss.kb);
  p.sb = static_cast<const float*>(b_scales.data);
  p.m_indices = m_indices;
  p.masked_m = masked_m;
  p.d = static_cast<__nv_bfloat16*>(d.data);
  p.rows = static_cast<std::int32_t>(rows);
  p.n = static_cast<std::int32_t>(w.n);
  p.k = static_cast<std::int32_t>(w.k);
  p.groups = static_cast<std::int32_t>(w.groups);
  problem.a_rows = groups_in_schedule * rows;
  problem.tile_rows = rows;
  problem.groups_in_schedule = groups_in_schedule;
  return problem;
}

// v21's workspace: the counters (per CTA kSplitCountersPerTile), then per CTA one partial of the largest
// tile.
constexpr std::int64_t kSplitPartialFloats = 128 * 256;
std::size_t split_counter_bytes(int sm_count) {
  const std::size_t bytes = static_cast<std::size_t>(sm_count) * kernels::kSplitCountersPerTile * 4;
  return (bytes + 255) / 256 * 256;
}

// v21's chunk choice (kernels::GroupedGemmParams::split_table), for each limit m (0..15) on the chunks
// that fit: the s in 2..min(m, the quanta, kMaxSplitChunks) of least cost, in tenths of a K block - a chunk's
// whole quanta of K blocks plus ~2.3 K blocks per chunk for the last warp's sum of s partials (latency-bound
// loads; measured, bench/NOTES.md session 38) - or 1 (no split) unless that beats the whole tile by ~4 K
// blocks (the partial written, the fence, the extra tile turn). With `most`, as many chunks as fit (forced
// on: the tests' and experiments' choice).
std::uint64_t split_table(std::int32_t num_kb, std::int32_t quantum, bool most) {
  constexpr std::int32_t kChunkCost = 23, kSplitCost = 40;
  const std::int32_t quanta = num_kb / quantum;
  const std::int32_t max_chunks = std::min(kernels::kMaxSplitChunks, quanta);
  std::uint64_t table = 0;
  std::int32_t best = 1, best_cost = 10 * num_kb - kSplitCost;
  for (std::int32_t m = 0; m < 16; ++m) {
    if (most && m >= 2 && m <= max_chunks) {
      best = m;
    } else if (m >= 2 && m <= max_chunks) {
      const std::int32_t cost = 10 * ((quanta + m - 1) / m) * quantum + kChunkCost * m;
      if (cost < best_cost) {
        best = m;
        best_cost = cost;
      }
    }
    table |= static_cast<std::uint64_t>(best) << (4 * m);
  }
  return table;
}

// v22's tail pieces (GroupedGemmOptions::tail_pieces) between the two launches of a problem: the
// 128 x 256 parent's request (mode kTailWhole, the follower's CTAs) and what the 64 x 128 follower needs
// of its parent (mode kTailPieces).
struct TailPieces {
  int mode = 0;
  std::int32_t piece_ctas = 0;
  const kernels::GroupedGemmParams* parent = nullptr;  // kTailPieces: the parent's launch
};

// Launches one kernel; returns its parameters (for a kTailWhole request, tail_pieces says whether the
// launch took it: its follower must then be launched).
template <int kBlockM, int kBlockN>
GroupedGemmParams launch(const TensorView& a, const TensorView& b, Problem problem,
                         const GroupedGemmOptions& options, int cluster, cudaStream_t stream,
                         const TailPieces& tail = {}) {
  using Traits = GemmTraits<kBlockM, kBlockN>;
  // Without and with v21's split tail (the consumers' side; picked below).
  constexpr auto kernel_whole = &kernels::fp8_grouped_gemm_kernel<kBlockM, kBlockN, false>;
  constexpr auto kernel_split = &kernels::fp8_grouped_gemm_kernel<kBlockM, kBlockN, true>;
  // v29's zero padding rows in an instance of their own (128 x 256 only; the others never take it).
  constexpr bool kZeroPaddingTile = kBlockM == 128 && kBlockN == 256;
  constexpr auto kernel_zero = &kernels::fp8_grouped_gemm_kernel<kBlockM, kBlockN, false, kZeroPaddingTile>;
  // (And with the split tail: a launch with a workspace runs the split instance whether or not its tail
  // splits, so without this one the masked K = 7168 rows lost v29's zeros, session 44.)
  constexpr auto kernel_split_zero =
      &kernels::fp8_grouped_gemm_kernel<kBlockM, kBlockN, true, kZeroPaddingTile>;
  // v31 (kernels::kBorrowWave0): only wave 0 staged, with and without the zeros (no split tail).
  constexpr auto kernel_wave0 =
      &kernels::fp8_grouped_gemm_kernel<kBlockM, kBlockN, false, false, kZeroPaddingTile>;
  constexpr auto kernel_zero_wave0 =
      &kernels::fp8_grouped_gemm_kernel<kBlockM, kBlockN, false, kZeroPaddingTile, kZeroPaddingTile>;
  const DeviceProps& props = device_props();
  gemm_host::allow_dynamic_smem<kernel_whole, Traits::kSmemBytes>();
  gemm_host::allow_dynamic_smem<kernel_split, Traits::kSmemBytes>();
  if constexpr (kZeroPaddingTile) {
    gemm_host::allow_dynamic_smem<kernel_zero, Traits::kSmemBytes>();
    gemm_host::allow_dynamic_smem<kernel_split_zero, Traits::kSmemBytes>();
    gemm_host::allow_dynamic_smem<kernel_wave0, Traits::kSmemBytes>();
    gemm_host::allow_dynamic_smem<kernel_zero_wave0, Traits::kSmemBytes>();
  }
  EPMOE_CHECK(options.stages >= 0 && options.stages <= Traits::kStages,
              "options.stages must be 0 (all) or 1..{} for {} x {} tiles, got {}", Traits::kStages, kBlockM,
              kBlockN, options.stages);
  GroupedGemmParams& params = problem.params;
  params.m_blocks = static_cast<std::int32_t>((problem.tile_rows + kBlockM - 1) / kBlockM);
  const std::int64_t max_tiles = problem.groups_in_schedule * params.m_blocks * (params.n / kBlockN);
  EPMOE_CHECK(max_tiles <= kInt32Max / 2, "too many tiles ({}) for one launch", max_tiles);
  const std::int64_t max_units = max_tiles / cluster;  // cluster divides the column tiles
  params.total_units = params.masked_m != nullptr ? 0 : static_cast<std::int32_t>(max_units);
  params.stages = options.stages > 0 ? options.stages : Traits::kStages;
  params.ablation = options.ablation & ~kAblateNoEpiGate;  // (kernels::kBorrowNoGate below)
  {
    // The contiguous tile order (kernels::GemmScheduler::unit); the products fit in 32 bits as the
    // tile count does.
    const std::int64_t columns = options.band_columns > 0 ? options.band_columns : kernels::kGemmBandColumns;
    const std::int64_t n_units = params.n / (kBlockN * cluster);
    params.n_units = static_cast<std::int32_t>(n_units);
    params.band_units = static_cast<std::int32_t>(
        std::clamp<std::int64_t>(columns / (kBlockN * cluster), 1, std::max<std::int64_t>(n_units, 1)));
    params.band_tiles = params.m_blocks * params.band_units;
    // div_small's range (the contiguous schedule's unit indices): below 2^24.
    // (v22's follower walks its parent's units, which the parent's launch checked.)
    EPMOE_CHECK(params.masked_m != nullptr || tail.mode == kernels::kTailPieces ||
                    max_units < (std::int64_t{1} << 24),
                "too many work units ({}) for one contiguous launch (at most 2^24)", max_units);
    const std::int64_t last_width =
        n_units - (std::max<std::int64_t>(n_units - 1, 0) / params.band_units) * params.band_units;
    params.inv_band_tiles = 1.0f / static_cast<float>(std::max(params.band_tiles, 1));
    params.inv_band_units = 1.0f / static_cast<float>(params.band_units);
    params.inv_last_width = 1.0f / static_cast<float>(std::max<std::int64_t>(last_width, 1));
  }
  params.cluster = cluster;
  params.pingpong = options.pingpong ? 1 : 0;
  params.skew = options.consumer_skew && !options.pingpong ? 1 : 0;
  params.unroll = options.unrolled_k_loop ? 1 : 0;
  params.vector_epilogue = options.vector_epilogue ? 1 : 0;
  static const int two_partials_env = env_switch("EPMOE_GEMM_TWO_PARTIALS");
  static const int split_tiles_env = env_switch("EPMOE_GEMM_SPLIT_TILES");
  static const int borrow_env = env_mode("EPMOE_GEMM_BORROW_EPILOGUE", 3);
  params.two_partials = with_env(two_partials_env, options.two_partials) ? 1 : 0;
  // split_tiles -1: split where measured faster (see GroupedGemmOptions::split_tiles).
  const bool split =
      resolve_choice(options.split_tiles,
                     grouped_gemm_split_tiles(
                         params.masked_m != nullptr,
                         params.masked_m != nullptr ? problem.expected_m * params.groups : problem.a_rows,
                         params.groups, params.k));
  params.split_tiles = with_env(split_tiles_env, split) ? 1 : 0;
  // Only 128 x 256 tiles without a cluster can borrow (the kernel checks the rest): other launches
  // (the 64 x 128 decode tiles among them) encode no output map and prefetch none.
  // borrow_epilogue -1: where measured faster (see GroupedGemmOptions::borrow_epilogue).
  // (2, v31, runs as kernels::kBorrowWave0 in an instance of its own.)
  const int borrow = borrow_env >= 0 ? borrow_env
                     : options.borrow_epilogue >= 0
                         ? options.borrow_epilogue
                         : grouped_gemm_borrow_epilogue(params.masked_m != nullptr, params.k);
  params.borrow_epilogue = kBlockN == 256 && cluster == 1 && borrow != 0
                               ? (borrow == 2   ? kernels::kBorrowWave0
                                  : borrow == 3 ? kernels::kBorrowWave0First
                                                : 1)
                               : 0;
  static const int tile_store_env = env_switch("EPMOE_GEMM_TILE_STORE");
  params.tile_store =
      with_env(tile_store_env,
               resolve_choice(options.tile_store,
                              grouped_gemm_tile_store(params.masked_m != nullptr, problem.a_rows,
                                                      params.groups, params.k)))
          ? 1
          : 0;
  if (params.borrow_epilogue == 1 && (options.ablation & kAblateNoEpiGate) != 0)
    params.borrow_epilogue = kernels::kBorrowNoGate;
  // v29: zeros past a tile's valid boxes of A (the small box's rows; not in a cluster), where tiles
  // with padding rows are common: masked launches, and contiguous ones with groups of fewer than
  // kZeroPaddingMaxRows rows on average (measured: 32 x 256 -1.8%, 128 x 128 -1.9%, 32 x 1024 -0.4%; the
  // kernel with the code cost 8 x 4096 and 4 x 8192 0.7-0.8%, bench/NOTES.md session 43).
  constexpr std::int64_t kZeroPaddingMaxRows = 2048;
  const bool padding_common =
      params.masked_m != nullptr ||
      problem.tile_rows < kZeroPaddingMaxRows * std::max<std::int64_t>(params.groups, 1);
  // (EPMOE_GEMM_SPLIT_ZEROS_ALL=1, an experiment: 2, a split tile's zeros over all 128 rows as before v37c.)
  static const int split_zeros_all_env = env_switch("EPMOE_GEMM_SPLIT_ZEROS_ALL");
  params.zero_padding_rows = kZeroPaddingTile && options.zero_padding_rows && cluster == 1 && padding_common
                                 ? (split_zeros_all_env == 1 ? 2 : 1)
                                 : 0;
  // The rows of tma_a_part's box (a_small_rows). The small A box is for decode tiles; in a cluster the
  // second A map is this CTA's half instead. v35: 64-row tiles load A in boxes of row_box_rows rows, those
  // that hold valid rows; v37: so do the zero-padding tiles (which take precedence over small_a_box; 32
  // rows otherwise) where a masked launch splits its tiles and expects at most kSplitRowBoxMaxM rows per
  // group, or where the caller asked for the boxes.
  const int row_box_rows = options.a_row_box_rows >= 0 ? options.a_row_box_rows
                           : params.k < kRowBoxMinK    ? 0
                           : problem.expected_m > 0 && problem.expected_m <= kSmallRowBoxMaxM
                               ? kSmallRowBoxRows
                               : kRowBoxRows;
  const bool split_row_boxes =
      params.masked_m != nullptr && params.split_tiles != 0 && problem.expected_m <= kSplitRowBoxMaxM;
  const bool row_boxes = row_box_rows > 0 && (params.zero_padding_rows != 0
                                                  ? options.a_row_box_rows > 0 || split_row_boxes
                                                  : kBlockM == 64 && options.small_a_box && cluster == 1);
  params.a_small_rows = row_boxes                              ? row_box_rows
                        : params.zero_padding_rows != 0        ? kSmallABoxRows
                        : !options.small_a_box || cluster != 1 ? 0
                                                               : std::min(kSmallABoxRows, kBlockM);
  const CUtensorMapL2promotion promotion = l2_promotion(options);
  const CUtensorMap tma_a = make_tma_2d(a.data, problem.a_rows, params.k, kBlockM, "a", promotion);
  const CUtensorMap tma_a_part =
      cluster > 1
          ? make_tma_2d(a.data, problem.a_rows, params.k, kBlockM / cluster, "a (cluster part)", promotion)
          : make_tma_2d(a.data, problem.a_rows, params.k, std::max(params.a_small_rows, 8), "a (small box)",
                        promotion);
  const CUtensorMap tma_b = make_tma_2d(b.data, static_cast<std::int64_t>(params.groups) * params.n, params.k,
                                        kBlockN, "b", promotion);
  // v12's TMA stores (p.borrow_epilogue): d as bytes [a_rows, 2 N] in the 128-byte swizzle (v17: the
  // staging's stmatrix layout). Without it the B map stands in (never read).
  // v19: 4D row-group maps (a consumer warp's 16 rows x 128 columns, or a tile's kBlockM rows, in one
  // store) where the rows allow (M, or the masked layout's M_max, a multiple of 16: every tile's rows
  // start 16-aligned) and the driver takes them; else the 2D map and per-box stores, whole tiles never.
  CUtensorMap tma_d = tma_b, tma_d_tile = tma_b;
  params.row_group_maps = 0;
  if (params.borrow_epilogue != 0) {
    const std::int64_t row_bytes = 2 * static_cast<std::int64_t>(params.n);
    if (problem.tile_rows % 16 == 0 && make_tma_row_groups(params.d, problem.a_rows, row_bytes, 1, tma_d) &&
        make_tma_row_groups(params.d, problem.a_rows, row_bytes, kBlockM / 16, tma_d_tile)) {
      params.row_group_maps = 1;
    } else {
      tma_d = make_tma_2d(params.d, problem.a_rows, row_bytes, 16, "d", CU_TENSOR_MAP_L2_PROMOTION_NONE);
      params.tile_store = 0;
    }
  }
  std::int64_t ctas = ctas_allowed(options);
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute attributes[1]{};
  config.blockDim = dim3(Traits::kThreads);
  config.dynamicSmemBytes = Traits::kSmemBytes;
  config.stream = stream;
  if (cluster > 1) {
    attributes[0].id = cudaLaunchAttributeClusterDimension;
    attributes[0].val.clusterDim.x = static_cast<unsigned>(cluster);
    attributes[0].val.clusterDim.y = 1;
    attributes[0].val.clusterDim.z = 1;
    config.attrs = attributes;
    config.numAttrs = 1;
    // The persistent schedule wants every cluster resident at once: no more clusters than fit
    // (asked once per device; the schedule is correct for any grid size).
    static std::atomic<int> max_clusters[64]{};  // per device; 0: not asked yet
    std::atomic<int>& slot = max_clusters[props.device % 64];
    int fit = slot.load(std::memory_order_acquire);
    if (fit == 0) {
      config.gridDim = dim3(static_cast<unsigned>(props.sm_count / cluster * cluster));
      int n = 0;
      // A failed query (none should fail) costs only the cap: the schedule works for any grid.
      if (cudaOccupancyMaxActiveClusters(&n, kernel_whole, &config) != cudaSuccess || n <= 0) {
        (void)cudaGetLastError();
        n = props.sm_count / cluster;
      }
      fit = n;
      slot.store(fit, std::memory_order_release);
    }
    ctas = std::min<std::int64_t>(ctas, std::int64_t{fit} * cluster);
  }
  // (v22's follower runs the grid its parent was told of, tail.piece_ctas: both decide from it.)
  ctas = tail.mode == kernels::kTailPieces
             ? tail.piece_ctas
             : std::clamp<std::int64_t>(ctas / cluster, 1, std::max<std::int64_t>(max_units, 1)) * cluster;
  // v30 (GroupedGemmOptions::trim_ctas) in the contiguous layout: the tiles are known here, so the grid
  // itself is trimmed where the last round would be at least half busy (masked: on the device, below).
  // Not with v11's split tiles, whose tiles cost unequal time.
  static const int trim_env = env_switch("EPMOE_GEMM_TRIM_CTAS");
  if (params.masked_m == nullptr && cluster == 1 && tail.mode != kernels::kTailPieces &&
      params.split_tiles == 0 && with_env(trim_env, resolve_choice(options.trim_ctas, true))) {
    // (ctas <= max_units < 2^31, checked above.)
    ctas = kernels::trimmed_ctas(static_cast<std::int32_t>(max_units), static_cast<std::int32_t>(ctas));
  }
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  params.unit_stride = static_cast<std::int32_t>(ctas / cluster);
  // v22: the parent leaves its tail to the follower where the device finds it fits (GemmScheduler::
  // plan_split); the follower computes only that.
  // (Problem's params come zeroed: the parent fields stay 0 but in a follower.)
  // (Both tail schemes want the plain launch: no cluster, split tiles, ping-pong, skew or ablation but the
  // trace.)
  const bool plain = cluster == 1 && params.split_tiles == 0 && params.pingpong == 0 && params.skew == 0 &&
                     (params.ablation & ~kernels::kTraceBits) == 0;
  if (tail.mode == kernels::kTailWhole && plain && kBlockM == 128 && kBlockN == 256) {
    // Contiguous: the tail is known here (every unit counts, padding ones too), masked only on the device.
    const std::int32_t tail_units = params.total_units % params.unit_stride;
    if (params.masked_m != nullptr ||
        (tail_units > 0 && kernels::kPiecesPerTile * tail_units <= tail.piece_ctas)) {
      params.tail_pieces = kernels::kTailWhole;
      params.piece_ctas = tail.piece_ctas;
    }
  } else if (tail.mode == kernels::kTailPieces) {
    EPMOE_CHECK(plain && kBlockM == 64 && kBlockN == 128 && tail.parent != nullptr,
                "the tail's follower runs plain 64 x 128 tiles");
    const GroupedGemmParams& parent = *tail.parent;
    params.tail_pieces = kernels::kTailPieces;
    params.parent_stride = parent.unit_stride;
    params.parent_n_units = parent.n_units;
    params.parent_units = parent.total_units;
    params.parent_band_units = parent.band_units;
    params.parent_band_tiles = parent.band_tiles;
    params.inv_parent_band_tiles = parent.inv_band_tiles;
    params.inv_parent_band_units = parent.inv_band_units;
    params.inv_parent_last_width = parent.inv_last_width;
    // (Launched plainly, the follower cost the rows it served 1.5% more: session 39.)
    attributes[0] = programmatic_serialization(true);
    config.attrs = attributes;
    config.numAttrs = 1;
  }
  // v30's trimmed grid (GroupedGemmOptions::trim_ctas): the device decides from the tiles it counts;
  // automatic where the tiles expected from expected_m would leave the last round at least half busy.
  params.trim_ctas = 0;
  // (Not in 128 x 128 tiles: kernels::GemmScheduler::kTrimmable.)
  if (params.masked_m != nullptr && cluster == 1 && params.tail_pieces == 0 &&
      !(kBlockM == 128 && kBlockN == 128)) {
    const std::int64_t expected_blocks =
        (std::min(problem.expected_m, problem.tile_rows) + kBlockM - 1) / kBlockM;
    const std::int64_t expected_tiles = problem.groups_in_schedule * expected_blocks * (params.n / kBlockN);
    // (expected_tiles <= max_tiles < 2^31, checked above; 0 tiles: no trim.) Not where the launch splits
    // its tiles (the small groups, memory-bound): every SM pulling weights measured 0.2-0.5% faster there
    // (bench/NOTES.md, session 48).
    const bool automatic =
        params.split_tiles == 0 && kernels::trimmed_ctas(static_cast<std::int32_t>(expected_tiles),
                                                         params.unit_stride) < params.unit_stride;
    params.trim_ctas = with_env(trim_env, resolve_choice(options.trim_ctas, automatic)) ? 1 : 0;
  }
  // v21's split tail (GroupedGemmOptions::split_tail): chunks of whole quanta of K blocks, a quantum
  // being the stages where the unrolled loop runs (every unit must start at stage 0 there).
  params.split_quantum = 0;
  params.split_max_chunks = 0;
  params.split_table = 0;
  params.split_max_rounds = 0;
  params.split_partials = nullptr;
  params.split_counters = nullptr;
  static const int split_tail_env = env_switch("EPMOE_GEMM_SPLIT_TAIL");
  const std::int32_t num_kb = params.k / kGemmBlockK;
  const std::int32_t quantum =
      params.unroll != 0 && params.stages == Traits::kStages && num_kb % Traits::kStages == 0
          ? Traits::kStages
          : 1;
  // (v31's wave-0 instances have no split tail.)
  const bool split_tail_applies = plain && params.vector_epilogue != 0 && num_kb / quantum >= 2 &&
                                  params.borrow_epilogue != kernels::kBorrowWave0;
  // (A table of 1s: no tail can split, the whole kernel runs.)
  constexpr std::uint64_t kNoSplit = 0x1111111111111111ull;
  const std::uint64_t table = split_table(num_kb, quantum, options.split_tail == 1);
  if (params.tail_pieces != kernels::kTailPieces && split_tail_applies && table != kNoSplit &&
      options.workspace != nullptr && with_env(split_tail_env, resolve_choice(options.split_tail, true))) {
    params.split_quantum = quantum;
    params.split_max_chunks = std::min(kernels::kMaxSplitChunks, num_kb / quantum);  // (the table's own cap)
    params.split_table = table;
    // Any number of rounds (the cost model's chunks measured 0.7-1.7% faster on contiguous rows of 22-34
    // rounds at K = 7168, bench/NOTES.md session 38); EPMOE_GEMM_SPLIT_ROUNDS=R splits only below R
    // whole rounds (experiments).
    static const int rounds_env = [] {
      const char* e = std::getenv("EPMOE_GEMM_SPLIT_ROUNDS");
      return e != nullptr && *e != '\0' ? std::max(1, std::atoi(e)) : 0;
    }();
    params.split_max_rounds = options.split_tail != 1 && rounds_env > 0 ? rounds_env : kInt32Max;
    params.split_counters = static_cast<std::int32_t*>(options.workspace);
    params.split_partials =
        reinterpret_cast<float*>(static_cast<char*>(options.workspace) + split_counter_bytes(props.sm_count));
    static_assert(kBlockM * kBlockN <= kSplitPartialFloats);
  }
  const bool wave0 = kZeroPaddingTile && params.borrow_epilogue == kernels::kBorrowWave0;
  EPMOE_CUDA_CHECK(cudaLaunchKernelEx(
      &config,
      wave0                       ? (params.zero_padding_rows != 0 ? kernel_zero_wave0 : kernel_wave0)
      : params.split_quantum != 0 ? (params.zero_padding_rows != 0 ? kernel_split_zero : kernel_split)
                                  : (params.zero_padding_rows != 0 ? kernel_zero : kernel_whole),
      tma_a, tma_a_part, tma_b, tma_d, tma_d_tile, params));
  EPMOE_CUDA_CHECK_LAUNCH();
  return params;
}

void launch(GemmTileShape tile, const TensorView& a, const TensorView& b, const Problem& problem,
            const GroupedGemmOptions& options, cudaStream_t stream) {
  const int cluster = cluster_size(options);
  static const int tail_pieces_env = env_switch("EPMOE_GEMM_TAIL_PIECES");
  if (tile.block_m == 64) {
    launch<64, 128>(a, b, problem, options, cluster, stream);
  } else if (tile.block_n == 256) {
    // v22: the 64 x 128 follower takes the tail where it fits (masked: as the device finds); its grid
    // is fixed here, before the parent, which decides from it.
    // Automatic: contiguous only, where the host sees the tail fit (masked, the follower is launched
    // whether or not the device finds a tail that fits, and that launch cost the masked rows 2-4%,
    // bench/NOTES.md session 39).
    TailPieces whole;
    const bool automatic = problem.params.masked_m == nullptr;
    if (cluster == 1 && with_env(tail_pieces_env, resolve_choice(options.tail_pieces, automatic))) {
      whole.mode = kernels::kTailWhole;
      whole.piece_ctas = static_cast<std::int32_t>(ctas_allowed(options));
    }
    const GroupedGemmParams parent = launch<128, 256>(a, b, problem, options, cluster, stream, whole);
    if (parent.tail_pieces == kernels::kTailWhole) {
      TailPieces pieces = whole;
      pieces.mode = kernels::kTailPieces;
      pieces.parent = &parent;
      GroupedGemmOptions follower = options;
      follower.split_tail = 0;
      launch<64, 128>(a, b, problem, follower, 1, stream, pieces);
    }
  } else {
    launch<128, 128>(a, b, problem, options, cluster, stream);
  }
}

// The swapped-operand kernel's schedule segments, at most: (group, 256-row chunk) pairs.
std::int64_t swap_segments(std::int64_t groups, std::int64_t m_max) {
  return groups * ((m_max + kernels::kSwapChunk - 1) / kernels::kSwapChunk);
}

// The swapped-operand masked kernel (GroupedGemmOptions::swap_ab): one launch, its tiles its own.
void launch_swapped(const TensorView& a, const TensorView& b, const Problem& problem,
                    const GroupedGemmOptions& options, cudaStream_t stream) {
  using Traits = kernels::SwapGemmTraits;
  // The experiment instance where an ablation only it reads is asked for (bench lines ".swap.exp.*").
  constexpr int kExperimentBits = kernels::kAblateMath | kernels::kAblateScales | kernels::kAblateFullWait |
                                  kernels::kAblatePromote | kernels::kSwapAblateScalarPromote |
                                  kernels::kSwapAblateOneConsumer;
  constexpr auto kDefault = &kernels::fp8_masked_swap_kernel<false>;
  constexpr auto kExperiment = &kernels::fp8_masked_swap_kernel<true>;
  const bool experiment = (options.ablation & kExperimentBits) != 0;
  if (experiment) {
    gemm_host::allow_dynamic_smem<kExperiment, Traits::kSmemBytes>();
  } else {
    gemm_host::allow_dynamic_smem<kDefault, Traits::kSmemBytes>();
  }
  const auto kernel = experiment ? kExperiment : kDefault;
  EPMOE_CHECK(options.stages >= 0 && options.stages <= Traits::kStages,
              "options.stages must be 0 (all) or 1..{} with swap_ab, got {}", Traits::kStages,
              options.stages);
  const GroupedGemmParams& gp = problem.params;
  kernels::SwapGemmParams p{};
  p.sa = gp.sa;
  p.sa_group_stride = gp.sa_group_stride;
  p.sa_row_stride = gp.sa_row_stride;
  p.sa_kb_stride = gp.sa_kb_stride;
  p.sb = gp.sb;
  p.masked_m = gp.masked_m;
  p.d = gp.d;
  p.m_max = gp.rows;
  p.n = gp.n;
  p.k = gp.k;
  p.groups = gp.groups;
  p.stages = options.stages > 0 ? options.stages : Traits::kStages;
  // EPMOE_GEMM_SWAP_ORDER=0: the tiles in group order, dealt round-robin (experiments); else by cost.
  static const int order_env = env_switch("EPMOE_GEMM_SWAP_ORDER");
  p.balanced = order_env == 0 ? 0 : 1;
  p.ablation = options.ablation & (kernels::kAblateLoads | kernels::kAblateEpilogue | kExperimentBits);
  // (Token rows are addressed up to kSwapTokenRows past the last group's: TMA fills rows past the end with
  // zeros.)
  EPMOE_CHECK(problem.a_rows + kernels::kSwapTokenRows <= kInt32Max,
              "a has too many rows ({}) for one launch", problem.a_rows);
  const CUtensorMapL2promotion promotion = l2_promotion(options);
  const CUtensorMap tma_tokens =
      make_tma_2d(a.data, problem.a_rows, p.k, kernels::kSwapTokenBox, "a (token box)", promotion);
  const CUtensorMap tma_weights = make_tma_2d(b.data, static_cast<std::int64_t>(p.groups) * p.n, p.k,
                                              kernels::kSwapWeightRows, "b", promotion);
  const std::int64_t max_segments = swap_segments(p.groups, p.m_max);
  EPMOE_CHECK(max_segments <= kernels::kSwapSegmentsMax,
              "options.swap_ab = 1 takes at most {} (group, 256-row chunk) pairs, got G = {} x ceil(M_max = "
              "{} / 256)",
              kernels::kSwapSegmentsMax, p.groups, p.m_max);
  const std::int64_t max_tiles = max_segments * (p.n / kernels::kSwapWeightRows);
  EPMOE_CHECK(max_tiles <= kInt32Max / 2, "too many tiles ({}) for one launch", max_tiles);
  const std::int64_t ctas =
      std::clamp<std::int64_t>(ctas_allowed(options), 1, std::max<std::int64_t>(max_tiles, 1));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  config.blockDim = dim3(Traits::kThreads);
  config.dynamicSmemBytes = Traits::kSmemBytes;
  config.stream = stream;
  EPMOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, tma_tokens, tma_weights, p));
  EPMOE_CUDA_CHECK_LAUNCH();
}

// Whether a masked call runs swapped (GroupedGemmOptions::swap_ab), after check_tile.
bool swapped(const GroupedGemmOptions& options, std::int64_t expected_m, std::int64_t groups,
             std::int64_t m_max) {
  const bool own_tile = options.block_m == 0 && options.block_n == 0 && options.cluster != 2 &&
                        !options.pingpong && !options.consumer_skew;
  EPMOE_CHECK(
      options.swap_ab != 1 || own_tile,
      "options.swap_ab = 1 picks its own tiles: block_m and block_n must be 0, cluster not 2, pingpong "
      "and consumer_skew off");
  static const int swap_env = env_switch("EPMOE_GEMM_SWAP_AB");
  if (options.swap_ab != -1) return options.swap_ab == 1;
  return own_tile && swap_segments(groups, m_max) <= kernels::kSwapSegmentsMax &&
         with_env(swap_env, grouped_gemm_swap_ab(expected_m));
}

}  // namespace

std::vector<GemmCtaStamps> fp8_grouped_gemm_take_cta_trace(int ctas, cudaStream_t stream) {
  return gemm_host::take_cta_stamps(&kernels::g_fp8_cta_trace, ctas, kGemmTraceMaxCtas, stream);
}

Fp8GemmTrace fp8_grouped_gemm_take_trace() {
  unsigned long long sums[kernels::kFp8TraceWords] = {};
  EPMOE_CUDA_CHECK(cudaMemcpyFromSymbol(sums, kernels::g_fp8_gemm_trace, sizeof sums));
  unsigned long long zero[kernels::kFp8TraceWords] = {};
  zero[6] = ~0ull;
  EPMOE_CUDA_CHECK(cudaMemcpyToSymbol(kernels::g_fp8_gemm_trace, zero, sizeof zero));
  return {sums[0],  sums[1],  sums[2],  sums[3],  sums[4],  sums[5],  sums[8],  sums[9],  sums[10], sums[11],
          sums[12], sums[13], sums[14], sums[15], sums[16], sums[17], sums[18], sums[19], sums[20]};
}

std::size_t grouped_gemm_workspace_bytes() {
  const int sm_count = device_props().sm_count;
  return split_counter_bytes(sm_count) + static_cast<std::size_t>(sm_count) * kSplitPartialFloats * 4;
}

int grouped_gemm_split_tail_chunks(std::int64_t k, int quantum, int limit) {
  EPMOE_CHECK(k > 0 && k % kGemmBlockK == 0, "k must be a positive multiple of 128, got {}", k);
  const auto num_kb = static_cast<std::int32_t>(k / kGemmBlockK);
  EPMOE_CHECK(quantum >= 1 && num_kb % quantum == 0, "quantum must divide K / 128 = {}, got {}", num_kb,
              quantum);
  EPMOE_CHECK(limit >= 0, "limit must be >= 0, got {}", limit);
  return static_cast<int>((split_table(num_kb, quantum, false) >> (4 * std::min(limit, 15))) & 15u);
}

bool grouped_gemm_split_tiles(bool masked, std::int64_t m, std::int64_t groups, std::int64_t k) {
  // Contiguous, measured (bench/NOTES.md, session 30): 6% faster on 32 groups x 256 rows and 3% on
  // 128 x 128 at K = 2048; 1-2% slower on groups of 1024+ rows there and 1-11% slower on every K = 7168 row.
  // Masked, measured (session 48, against whole 128 x 256 tiles): 2.2-2.4% faster with groups of 24-48
  // rows (+-30%) at K = 7168, level at 64; 9-14% slower on 32 x 128 / 32 x 192 at K = 7168 (session 31),
  // where a group's last m-block alone splits and falls out of step with its neighbours.
  constexpr std::int64_t kMaxRowsPerGroup = 512, kMaxK = 2048, kMaskedMaxRowsPerGroup = 64;
  if (masked) return groups > 0 && m > 0 && m <= kMaskedMaxRowsPerGroup * groups;
  return k <= kMaxK && groups > 0 && m <= kMaxRowsPerGroup * groups;
}

int grouped_gemm_borrow_epilogue(bool masked, std::int64_t k) {
  // Measured (bench/NOTES.md, sessions 31 and 45): at masked K <= 2048 v12 lost 2-7% to the consumers'
  // own stores, and v31 (wave 0 staged, no borrowed stage) beat those by 1-3%; v12 level or faster on
  // every K = 7168 row and every contiguous row, where v31 was 2-4% slower on the large groups. v33 (v12
  // with wave 0 staged before the consumers meet) took ~135 cycles off each tile's epilogue: contiguous
  // K = 2048 rows 0.1-0.5% faster, K = 7168 level; masked K = 7168 0.2% slower twice (session 47).
  constexpr std::int64_t kMaxWave0K = 2048;
  if (!masked) return 3;
  return k <= kMaxWave0K ? 2 : 1;
}

bool grouped_gemm_tile_store(bool masked, std::int64_t m, std::int64_t groups, std::int64_t k) {
  // Measured (bench/NOTES.md, sessions 36-37; whole-tile against per-warp stores): 2.6-4.2% faster on
  // the contiguous K = 2048 rows that borrow (the store is on the next tile's critical path there);
  // at K = 7168 0.8-1.5% faster on groups of 1024+ rows (8 x 4096, 4 x 8192, 32 x 1024) but slower on
  // groups of 128-256 rows: 32 x 256 1.001, masked 32 x 192 1.020 with v19's staging (1.013, 1.086
  // with v18's).
  constexpr std::int64_t kMaxK = 2048, kMinRowsPerGroup = 512;
  return k <= kMaxK || (!masked && groups > 0 && m >= kMinRowsPerGroup * groups);
}

bool grouped_gemm_swap_ab(std::int64_t /*expected_m*/) {
  // Measured (bench/NOTES.md, session 41): 5-12% slower than the row-major kernel on every masked anchor
  // row, decode and 32 x 32 included: off until it is faster somewhere.
  return false;
}

GemmTileShape grouped_gemm_tile(bool masked, std::int64_t expected_m, std::int64_t n) {
  // Measured (bench/NOTES.md, session 48; masked, +-30% groups, against 64 x 128): split 128 x 256 tiles
  // 1.6-2.2% faster with 24-48 rows per group at K = 7168 and 0.5-0.8% at K = 2048, 8-11% with 64 (where
  // 64 x 128 tiles take two m-blocks of many groups); with v37's 8-row A boxes 1.6% faster on the decode
  // row 128 x 16 at K = 7168 (level at K = 2048), but 0.25% slower on 128 x 8.
  constexpr std::int64_t kDecodeMaxM = 8, kSmallMaxM = 64;
  if (masked && (expected_m <= kDecodeMaxM || (expected_m <= kSmallMaxM && n % 256 != 0))) return {64, 128};
  return {128, n % 256 == 0 ? 256 : 128};
}

void fp8_grouped_gemm_contiguous(TensorView a, TensorView a_scales, ScaleLayout a_scale_layout, TensorView b,
                                 TensorView b_scales, TensorView m_indices, TensorView d, cudaStream_t stream,
                                 const GroupedGemmOptions& options) {
  const Dims w = check_weights(b, b_scales);
  expect_device_tensor(a, DType::fp8_e4m3, "a", 16);
  expect_rank(a, 2, "a");
  const std::int64_t M = a.shape[0];
  expect_shape(a, {M, w.k}, "a (K of b)");
  const ScaleStrides ss = check_a_scales(a_scales, a_scale_layout, 1, M, w.k / 128, false);
  expect_device_tensor(m_indices, DType::i32, "m_indices", 4);
  expect_shape(m_indices, {M}, "m_indices");
  expect_device_tensor(d, DType::bf16, "d", 16);
  expect_shape(d, {M, w.n}, "d");
  const GemmTileShape tile = check_tile(options, false, 0, w.n);
  EPMOE_CHECK(options.swap_ab != 1, "options.swap_ab = 1 applies to the masked layout only");
  EPMOE_CHECK(M + 128 <= kInt32Max, "a {} has too many rows for one launch", a.describe());
  if (M == 0) return;
  check_device();

  const Problem problem = make_problem(a_scales, ss, b_scales, w, d, M, 1,
                                       static_cast<const std::int32_t*>(m_indices.data), nullptr);
  launch(tile, a, b, problem, options, stream);
}

void fp8_grouped_gemm_masked(TensorView a, TensorView a_scales, ScaleLayout a_scale_layout, TensorView b,
                             TensorView b_scales, TensorView masked_m, std::int64_t expected_m, TensorView d,
                             cudaStream_t stream, const GroupedGemmOptions& options) {
  const Dims w = check_weights(b, b_scales);
  expect_device_tensor(a, DType::fp8_e4m3, "a", 16);
  expect_rank(a, 3, "a");
  const std::int64_t M_max = a.shape[1];
  expect_shape(a, {w.groups, M_max, w.k}, "a (G and K of b)");
  const ScaleStrides ss = check_a_scales(a_scales, a_scale_layout, w.groups, M_max, w.k / 128, true);
  expect_device_tensor(masked_m, DType::i32, "masked_m", 4);
  expect_shape(masked_m, {w.groups}, "masked_m");
  expect_device_tensor(d, DType::bf16, "d", 16);
  expect_shape(d, {w.groups, M_max, w.n}, "d");
  EPMOE_CHECK(expected_m >= 0, "expected_m must be >= 0, got {}", expected_m);
  const GemmTileShape tile = check_tile(options, true, expected_m, w.n);
  const bool swap = swapped(options, expected_m, w.groups, M_max);
  EPMOE_CHECK(w.groups * (M_max + 128) <= kInt32Max, "a {} has too many rows for one launch", a.describe());
  if (M_max == 0) return;
  check_device();

  Problem problem = make_problem(a_scales, ss, b_scales, w, d, M_max, w.groups, nullptr,
                                 static_cast<const std::int32_t*>(masked_m.data));
  problem.expected_m = expected_m;
  if (swap) {
    launch_swapped(a, b, problem, options, stream);
    return;
  }
  launch(tile, a, b, problem, options, stream);
}

}  // namespace epmoe::cuda
