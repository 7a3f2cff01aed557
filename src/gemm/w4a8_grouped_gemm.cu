// Host side of the W4A8 grouped GEMM (device code in w4a8_grouped_gemm_kernel.cuh, API in
// epmoe/cuda/w4a8_gemm.hpp): argument checks, weight preparation (device and CPU), the TMA map of
// the activations, tile choice, launch.
//
// The activation tensor map is encoded on the host for every call (cuTensorMapEncodeTiled, looked up
// through the runtime's driver entry point, so nothing links libcuda) and travels by value as a
// __grid_constant__ parameter, which keeps the launch capturable in a CUDA graph. Weights and scales
// are plain bulk copies (no tensor map).
#include "epmoe/cuda/w4a8_gemm.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string_view>

#include "cuda/pdl_launch.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/launch.hpp"
#include "gemm/gemm_host.hpp"
#include "gemm/w4a8_grouped_gemm_kernel.cuh"
#include "gemm/w4a8_kernel_choice.hpp"
#include "gemm/w4a8_prepare_kernels.cuh"
#include "gemm/w4a8_row_sums_kernel.cuh"
#include "gemm/w4a8_smem_gemm_kernel.cuh"

namespace epmoe::cuda {
namespace {

using kernels::W4A8Params;
using kernels::W4A8Traits;

constexpr std::int64_t kInt32Max = std::numeric_limits<std::int32_t>::max();
constexpr std::int64_t kBlockK = w4a8::kBlockK;

// The activations, a row-major byte matrix [rows, k], box [box_rows, 128 bytes].
CUtensorMap make_tma_a(const void* base, std::int64_t rows, std::int64_t k, int box_rows) {
  return make_tma_2d(base, rows, k, box_rows, "a", CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
}

struct Dims {
  std::int64_t groups, n, k;
};

// Weights i4x2 [G, N, K/2] and scales [G, N, K/128] (checkpoint or packed: the same shapes; the
// checkpoint's scales are f32, the packed ones bf16).
Dims check_weight_pair(const TensorView& w, const TensorView& s, DType scale_dtype, Device device,
                       std::string_view w_name, std::string_view s_name) {
  expect_aligned_tensor(w, DType::i4x2, device, w_name, 16);
  expect_rank(w, 3, w_name);
  const Dims dims{w.shape[0], w.shape[1], 2 * w.shape[2]};
  EPMOE_CHECK(dims.groups > 0, "{} must hold at least one group, got {}", w_name, w.describe());
  EPMOE_CHECK(dims.k > 0 && dims.k % kBlockK == 0,
              "{}: K = {} (2 x its last dimension) must be a positive multiple of {}", w_name, dims.k,
              kBlockK);
  EPMOE_CHECK(dims.n > 0 && dims.n % 128 == 0, "{}: N = {} must be a positive multiple of 128", w_name,
              dims.n);
  expect_aligned_tensor(s, scale_dtype, device, s_name, 16);
  expect_shape(s, {dims.groups, dims.n, dims.k / kBlockK}, s_name);
  return dims;
}

void check_device() {
  gemm_host::require_hopper("the W4A8 grouped GEMM");
}

W4A8TileShape check_tile(const W4A8GemmOptions& options, bool masked, std::int64_t expected_m,
                         std::int64_t n) {
  EPMOE_CHECK(options.block_m == 0 || options.block_m == 16 || options.block_m == 32 ||
                  options.block_m == 64 || options.block_m == 128,
              "options.block_m must be 0 (automatic), 16, 32, 64 or 128, got {}", options.block_m);
  EPMOE_CHECK(masked || options.block_m == 0 || options.block_m == 128,
              "options.block_m must be 0 or 128 for the contiguous layout, got {}", options.block_m);
  EPMOE_CHECK(options.consumers == 0 || options.consumers == 2 || options.consumers == 4,
              "options.consumers must be 0 (automatic), 2 or 4, got {}", options.consumers);
  EPMOE_CHECK(options.max_ctas >= 0, "options.max_ctas must be >= 0, got {}", options.max_ctas);
  EPMOE_CHECK(options.stages >= 0, "options.stages must be >= 0, got {}", options.stages);
  W4A8TileShape tile = w4a8_gemm_tile(masked, expected_m);
  if (options.block_m != 0) {
    tile.block_m = options.block_m;
    tile.consumers = options.block_m <= 32 ? 4 : 2;
  }
  if (options.consumers != 0) tile.consumers = options.consumers;
  // N must be a multiple of the tile's weight rows; fall back to 128-row tiles.
  if (options.consumers == 0 && n % (64 * tile.consumers) != 0) tile.consumers = 2;
  EPMOE_CHECK(tile.consumers == 2 || tile.block_m <= 32,
              "options.consumers = 4 needs block_m <= 32, got block_m = {}", tile.block_m);
  EPMOE_CHECK(n % (64 * tile.consumers) == 0, "N = {} must be a multiple of {} for options.consumers = {}", n,
              64 * tile.consumers, tile.consumers);
  return tile;
}

struct Problem {
  W4A8Params params;
  std::int64_t a_rows;     // rows of A viewed as [a_rows, K]
  std::int64_t tile_rows;  // contiguous: M; masked: M_max
  std::int64_t schedule_groups;
  std::int64_t expected_m;  // masked: the host hint; contiguous: rows per group on average (M / groups)
  std::int32_t ablation;    // timing experiments (W4A8KernelChoice::ablation)
  // Masked with a workspace: its tile counter (the kernels with W4A8Traits::kDynamicTiles use it
  // unless options.dynamic_tiles is false or the CTA stamps are asked for).
  unsigned long long* tile_counter;
};

// A tag per launch for the dynamic schedule's counter (W4A8Params::tile_counter; never 0, the tag of a
// zeroed workspace).
std::uint32_t next_tile_tag() {
  static std::atomic<std::uint32_t> last{0};
  std::uint32_t tag = last.fetch_add(1, std::memory_order_relaxed) + 1;
  if (tag == 0) tag = last.fetch_add(1, std::memory_order_relaxed) + 1;
  return tag;
}

W4A8KernelChoice g_pinned{};  // version 0: none

// CTAs for a persistent launch of about `tiles` equal tiles: with options.max_ctas unset, as few as
// keep the same number of rounds as all SMs would (2048 decode tiles: 128 CTAs x 16 instead of 132
// CTAs with 68 of them doing a 16th tile while the others idle; a memory-bound kernel streams the
// same bytes with fewer SMs, so the last round no longer runs at half the bandwidth). Masked:
// `tiles` is estimated from expected_m (the real counts are on the device).
std::int64_t persistent_ctas(std::int64_t tiles, std::int64_t max_tiles, const W4A8GemmOptions& options) {
  const std::int64_t sms = device_props().sm_count;
  std::int64_t ctas = sms;
  if (options.max_ctas > 0) {
    ctas = std::min<std::int64_t>(ctas, options.max_ctas);
  } else if (tiles > sms) {
    const std::int64_t rounds = (tiles + sms - 1) / sms;
    ctas = (tiles + rounds - 1) / rounds;
  }
  return std::clamp<std::int64_t>(ctas, 1, std::max<std::int64_t>(max_tiles, 1));
}

// The tiles a launch is expected to run (masked: every group with expected_m rows).
std::int64_t expected_tiles(const Problem& problem, int block_m, int block_n) {
  const std::int64_t rows = problem.params.masked_m != nullptr
                                ? std::min(problem.expected_m, problem.tile_rows)
                                : problem.tile_rows;
  return problem.schedule_groups * ((rows + block_m - 1) / block_m) * (problem.params.n / block_n);
}

// What both kernel versions set before a persistent launch with block_m x block_n tiles and at most
// `max_stages` pipeline stages: the tile count, the stages, the ablation; returns the CTAs.
std::int64_t plan_persistent(Problem& problem, const W4A8GemmOptions& options, int block_m, int block_n,
                             int max_stages) {
  EPMOE_CHECK(options.stages <= max_stages, "options.stages must be 0 (all) or 1..{} for this tile, got {}",
              max_stages, options.stages);
  W4A8Params& params = problem.params;
  const std::int64_t m_blocks = (problem.tile_rows + block_m - 1) / block_m;
  const std::int64_t max_tiles = problem.schedule_groups * m_blocks * (params.n / block_n);
  EPMOE_CHECK(max_tiles <= kInt32Max / 2, "too many tiles ({}) for one launch", max_tiles);
  params.total_tiles = params.masked_m != nullptr ? 0 : static_cast<std::int32_t>(max_tiles);
  params.stages = options.stages > 0 ? options.stages : max_stages;
  params.ablation = problem.ablation;
  return persistent_ctas(expected_tiles(problem, block_m, block_n), max_tiles, options);
}

// (With `attribute`, filled here: a programmatic dependent launch, which may start while the stream's
// previous kernel runs, W4A8Traits::kOffsetSums; the attribute must outlive the launch call.)
cudaLaunchConfig_t launch_config(std::int64_t ctas, int threads, int smem_bytes, cudaStream_t stream,
                                 cudaLaunchAttribute* attribute = nullptr) {
  cudaLaunchConfig_t config{};
  if (attribute != nullptr) {
    *attribute = programmatic_serialization(true);
    config.attrs = attribute;
    config.numAttrs = 1;
  }
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = static_cast<std::size_t>(smem_bytes);
  config.stream = stream;
  return config;
}

template <int kBM, int kConsumers, int kOffset, int kStageKB, int kParts = 0, bool kHalfLoop = true>
void launch(const TensorView& a, Problem problem, const W4A8GemmOptions& options, cudaStream_t stream) {
  using Traits = W4A8Traits<kBM, kConsumers, kOffset, kStageKB>;
  constexpr auto kernel =
      &kernels::w4a8_grouped_gemm_kernel<kBM, kConsumers, kOffset, kStageKB, kParts, kHalfLoop>;
  gemm_host::allow_dynamic_smem<kernel, Traits::kSmemBytes>();
  const std::int64_t ctas = plan_persistent(problem, options, kBM, Traits::kTileN, Traits::kStages);
  const CUtensorMap tma_a = make_tma_a(a.data, problem.a_rows, problem.params.k, kBM);
  // kOffsetSums: a dependent launch behind the row-sum pre-pass (only the warp that copies the sums
  // waits for it: ptx::grid_dependency_wait).
  if constexpr (Traits::kDynamicTiles) {
    if (problem.tile_counter != nullptr && options.dynamic_tiles &&
        (problem.params.ablation & kernels::kW4TraceCtas) == 0) {
      problem.params.tile_counter = problem.tile_counter;
      problem.params.tile_tag = next_tile_tag();
    }
  }
  cudaLaunchAttribute pdl{};
  const cudaLaunchConfig_t config =
      launch_config(ctas, Traits::kThreads, Traits::kSmemBytes, stream, Traits::kOffsetSums ? &pdl : nullptr);
  EPMOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, tma_a, problem.params));
  EPMOE_CUDA_CHECK_LAUNCH();
}

// parts = 2: the 32-row four-consumer tile with two partials (W4A8KernelChoice::parts). kOffsetSums
// has only the decode tiles (block_m <= 32; run() checks).
template <int kOffset, int kStageKB>
void launch(W4A8TileShape tile, int parts, const TensorView& a, const Problem& problem,
            const W4A8GemmOptions& options, cudaStream_t stream) {
  constexpr bool kWarp = kOffset == kernels::kW4OffsetWarp;
  constexpr bool kDecodeOnly = kOffset == kernels::kW4OffsetSums;
  if (tile.consumers == 4) {
    if (tile.block_m == 16) return launch<16, 4, kOffset, kStageKB>(a, problem, options, stream);
    if constexpr (!kWarp) {
      if (parts == 2) return launch<32, 4, kOffset, kStageKB, 2>(a, problem, options, stream);
    }
    return launch<32, 4, kOffset, kStageKB>(a, problem, options, stream);
  }
  switch (tile.block_m) {
    case 16:
      return launch<16, 2, kOffset, kStageKB>(a, problem, options, stream);
    case 32:
      return launch<32, 2, kOffset, kStageKB>(a, problem, options, stream);
    default:
      break;
  }
  if constexpr (!kDecodeOnly) {
    if (tile.block_m == 64) return launch<64, 2, kOffset, kStageKB>(a, problem, options, stream);
    return launch<128, 2, kOffset, kStageKB>(a, problem, options, stream);
  }
}

// The register-operand kernel with signed codes (W4A8KernelChoice::signed_codes with version 2):
// 128-row tiles, or the wide tile (256 activation rows, two waves; contiguous only).
// (kOffset: kW4OffsetNone, or kW4OffsetSignMag for weights with the sign-magnitude codes.)
template <int kOffset>
void launch_v2_signed(int block_m, int half_tiles, const TensorView& a, const Problem& problem,
                      const W4A8GemmOptions& options, cudaStream_t stream) {
  if (block_m == 256 && half_tiles == 2)
    return launch<256, 2, kOffset, 1, 0, false>(a, problem, options, stream);
  if (block_m == 256) return launch<256, 2, kOffset, 1>(a, problem, options, stream);
  launch<128, 2, kOffset, 1>(a, problem, options, stream);
}

// Fills the zeros of a version-2 signed choice and checks it: the wide tile for contiguous groups of
// >= 128 rows on average (expected_m: M / groups), else 128 x 128. Since its half tiles (a group's odd
// last block) run wave 0 alone on CTAs of their own, the wide tile is 4-15% faster than 128 x 128 on
// the 32 x 256 and 128 x 128 rows as well (session 26, bench/NOTES.md). The wide tile's kernel
// without the half-tile loop from 2048 rows per group: with few half tiles (one per ~16 blocks) the
// loop wins little, and its kernel was 2-6% slower on the 8 x 4096 and 4 x 8192 rows (session 27).
W4A8KernelChoice resolve_v2_signed(W4A8KernelChoice c, bool masked, std::int64_t expected_m, std::int64_t n) {
  if (c.block_m == 0) c.block_m = !masked && expected_m >= 128 ? 256 : 128;
  if (c.block_m == 256 && c.half_tiles == 0) c.half_tiles = expected_m >= kW4A8WideNoHalfRows ? 2 : 1;
  EPMOE_CHECK(c.block_m == 128 || c.block_m == 256,
              "the W4A8 register-operand kernel with signed codes has block_m = 128 or 256, got {}",
              c.block_m);
  // (The wide tile's scheduler pairs the contiguous layout's 128-row blocks; masked groups have none.)
  EPMOE_CHECK(c.block_m != 256 || !masked,
              "the W4A8 v2 tile with block_m = 256 is for the contiguous layout only");
  EPMOE_CHECK(n % 128 == 0, "N = {} must be a multiple of 128 for the W4A8 v2 signed tiles", n);
  return c;
}

// The offset term's row sums for a masked problem (kOffsetSums) into options.workspace.
void launch_row_sums(const TensorView& a, const Problem& problem, float* sums, std::int32_t sums_rows,
                     cudaStream_t stream) {
  const W4A8Params& p = problem.params;
  const int slabs =
      std::min(kernels::kW4SumsSlabs, (sums_rows + kernels::kW4SumsWarps - 1) / kernels::kW4SumsWarps);
  const dim3 grid(static_cast<unsigned>(slabs), static_cast<unsigned>(p.groups));
  kernels::w4a8_row_sums_kernel<<<grid, kernels::kW4SumsWarps * 32, 0, stream>>>(
      static_cast<const std::uint8_t*>(a.data), p.masked_m, p.rows, p.k, sums_rows, sums);
  EPMOE_CUDA_CHECK_LAUNCH();
}

// The shared-memory-conversion kernel (v3).
template <int kBM, int kBN, int kWaves, bool kSigned>
void launch_v3(const TensorView& a, Problem problem, const W4A8GemmOptions& options, cudaStream_t stream) {
  using Traits = kernels::W4A8SmemTraits<kBM, kBN, kWaves, kSigned>;
  constexpr auto kernel = &kernels::w4a8_smem_gemm_kernel<kBM, kBN, kWaves, kSigned>;
  gemm_host::allow_dynamic_smem<kernel, Traits::kSmemBytes>();
  const std::int64_t ctas = plan_persistent(problem, options, kBM, kBN, Traits::kConvStages);
  W4A8Params& params = problem.params;
  // Masked tiles whose valid rows fit a smaller box load only that many activation rows.
  params.a_small_rows = 0;
  if (params.masked_m != nullptr) {
    for (const int rows : {16, 32, 64}) {
      if (rows < kBM && problem.expected_m <= rows) {
        params.a_small_rows = rows;
        break;
      }
    }
  }
  if (Traits::kTall) params.a_small_rows = 128;  // the half tiles (W4A8Scheduler's split pairs)
  const CUtensorMap tma_a = make_tma_a(a.data, problem.a_rows, params.k, kBM);
  const CUtensorMap tma_a_small =
      params.a_small_rows > 0 ? make_tma_a(a.data, problem.a_rows, params.k, params.a_small_rows) : tma_a;
  const cudaLaunchConfig_t config = launch_config(ctas, Traits::kThreads, Traits::kSmemBytes, stream);
  EPMOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, tma_a, tma_a_small, params));
  EPMOE_CUDA_CHECK_LAUNCH();
}

// Fills the zeros of a version-3 choice and checks it.
W4A8KernelChoice resolve_v3(W4A8KernelChoice c, bool masked, std::int64_t expected_m, std::int64_t n) {
  if (c.block_m == 0) c.block_m = masked && expected_m <= 64 ? 64 : 128;
  if (c.block_n == 0)
    c.block_n = c.block_m != 256 && (c.block_m == 64 || c.signed_codes != 0) && n % 256 == 0 ? 256 : 128;
  if (c.waves == 0)
    c.waves = c.signed_codes != 0 && ((c.block_n == 256 && c.block_m == 128) || c.block_m == 256) ? 2 : 1;
  // (128 x 256 with two waves per consumer was retired with the offset-binary codes: its consumers
  // have no registers left for the offset term, bench/NOTES.md; the signed conversion has none.)
  const bool known = (c.block_m == 64 && c.waves == 1 && (c.block_n == 128 || c.block_n == 256)) ||
                     (c.block_m == 128 && c.block_n == 128 && c.waves == 1) ||
                     (c.block_m == 128 && c.block_n == 256 && c.waves == 2 && c.signed_codes != 0) ||
                     (c.block_m == 256 && c.block_n == 128 && c.waves == 2 && c.signed_codes != 0);
  EPMOE_CHECK(known, "no W4A8 v3 kernel for block_m = {}, block_n = {}, waves = {}, signed_codes = {}",
              c.block_m, c.block_n, c.waves, c.signed_codes);
  // (The tall tile's scheduler pairs the contiguous layout's 128-row blocks; masked groups have none.)
  EPMOE_CHECK(c.block_m != 256 || !masked,
              "the W4A8 v3 tile with block_m = 256 is for the contiguous layout only");
  EPMOE_CHECK(n % c.block_n == 0, "N = {} must be a multiple of {} for the W4A8 v3 tile", n, c.block_n);
  return c;
}

void launch_v3(const W4A8KernelChoice& c, const TensorView& a, const Problem& problem,
               const W4A8GemmOptions& options, cudaStream_t stream) {
  if (c.signed_codes != 0) {
    if (c.block_m == 64) {
      if (c.block_n == 256) return launch_v3<64, 256, 1, true>(a, problem, options, stream);
      return launch_v3<64, 128, 1, true>(a, problem, options, stream);
    }
    if (c.block_m == 256) return launch_v3<256, 128, 2, true>(a, problem, options, stream);
    if (c.block_n == 256) return launch_v3<128, 256, 2, true>(a, problem, options, stream);
    return launch_v3<128, 128, 1, true>(a, problem, options, stream);
  }
  if (c.block_m == 64) {
    if (c.block_n == 256) return launch_v3<64, 256, 1, false>(a, problem, options, stream);
    return launch_v3<64, 128, 1, false>(a, problem, options, stream);
  }
  return launch_v3<128, 128, 1, false>(a, problem, options, stream);
}

// Whether `codes` is W4A8Codes::sign_magnitude (checked: no other value).
bool sign_magnitude(W4A8Codes codes) {
  EPMOE_CHECK(codes == W4A8Codes::offset_binary || codes == W4A8Codes::sign_magnitude,
              "W4A8Codes must be offset_binary (0) or sign_magnitude (1), got {}", static_cast<int>(codes));
  return codes == W4A8Codes::sign_magnitude;
}

// Weights with the sign-magnitude codes: v2 without an offset term on every tile. Automatic: v2's signed
// tiles where the offset-binary weights take them (contiguous, masked groups of > 64 rows), else the
// tile of `tile` (the decode tiles); pinned: version 2 without the offset variants (its block_m,
// half_tiles, parts).
void run_sign_magnitude(W4A8TileShape tile, const TensorView& a, const Problem& problem,
                        const W4A8GemmOptions& options, bool masked, bool explicit_tile,
                        cudaStream_t stream) {
  const W4A8KernelChoice c = g_pinned;
  EPMOE_CHECK(
      c.version == 0 || (c.version == 2 && c.offset_warp == 0 && c.row_sums == 0 && c.stage_k_blocks <= 1),
      "weights with W4A8Codes::sign_magnitude run the W4A8 register-operand kernel (version 2) "
      "without the offset warp, row sums or K blocks per stage; the pinned choice has version {}, "
      "offset_warp {}, row_sums {}, stage_k_blocks {}",
      c.version, c.offset_warp, c.row_sums, c.stage_k_blocks);
  Problem with = problem;
  with.ablation = c.ablation;
  constexpr int kSignMag = kernels::kW4OffsetSignMag;
  const bool wide_or_128 =
      c.version == 2 ? (c.block_m == 128 || c.block_m == 256) : !masked || problem.expected_m > 64;
  if (!explicit_tile && wide_or_128) {
    const W4A8KernelChoice r = resolve_v2_signed(
        W4A8KernelChoice{.version = 2, .block_m = c.block_m, .signed_codes = 1, .half_tiles = c.half_tiles},
        masked, problem.expected_m, problem.params.n);
    return launch_v2_signed<kSignMag>(r.block_m, r.half_tiles, a, with, options, stream);
  }
  launch<kSignMag, 1>(tile, c.parts, a, with, options, stream);
}

// Runs the chosen kernel: explicit tiles are the register-operand kernel's; otherwise the pinned or
// the heuristic choice.
void run(W4A8TileShape tile, const TensorView& a, const Problem& problem, const W4A8GemmOptions& options,
         bool masked, cudaStream_t stream) {
  const bool explicit_tile = options.block_m != 0 || options.consumers != 0;
  if (sign_magnitude(options.codes))
    return run_sign_magnitude(tile, a, problem, options, masked, explicit_tile, stream);
  W4A8KernelChoice c{2};
  if (!explicit_tile) {
    c = g_pinned.version != 0
            ? g_pinned
            : w4a8_kernel_choice(masked, problem.expected_m, problem.params.n, problem.params.k);
  } else if (g_pinned.version == 2) {
    c.offset_warp = g_pinned.offset_warp;
    c.stage_k_blocks = g_pinned.stage_k_blocks;
    c.parts = g_pinned.parts;
    c.row_sums = g_pinned.row_sums;
  }
  // The automatic choice's row sums need a workspace; without one the 32-row tile keeps two partials
  // (its best plain variant, session 19).
  // (The pre-pass's grid has one row of blocks per group: at most 65535.)
  const bool sums_usable =
      masked && tile.block_m <= 32 && !options.workspace.empty_view() && problem.params.groups <= 65535;
  if (!explicit_tile && g_pinned.version == 0 && c.row_sums != 0 && !sums_usable) c.parts = 2;
  Problem with = problem;
  with.ablation = c.ablation;
  if (c.version == 3)
    return launch_v3(resolve_v3(c, masked, problem.expected_m, problem.params.n), a, with, options, stream);
  if (c.signed_codes != 0) {
    const W4A8KernelChoice r = resolve_v2_signed(c, masked, problem.expected_m, problem.params.n);
    return launch_v2_signed<kernels::kW4OffsetNone>(r.block_m, r.half_tiles, a, with, options, stream);
  }
  constexpr int kWgmma = kernels::kW4OffsetWgmma, kWarp = kernels::kW4OffsetWarp;
  if (c.offset_warp != 0) {
    if (c.stage_k_blocks == 2) return launch<kWarp, 2>(tile, c.parts, a, with, options, stream);
    return launch<kWarp, 1>(tile, c.parts, a, with, options, stream);
  }
  // The pre-pass's row sums: masked decode tiles with a workspace (else the offset wgmma).
  if (c.row_sums != 0 && sums_usable) {
    const auto sums_rows = static_cast<std::int32_t>(w4a8::row_sums_rows(problem.tile_rows));
    auto* sums = static_cast<float*>(options.workspace.data);
    with.params.row_sums = sums;
    with.params.sums_rows = sums_rows;
    launch_row_sums(a, with, sums, sums_rows, stream);
    constexpr int kSums = kernels::kW4OffsetSums;
    if (c.stage_k_blocks == 2) return launch<kSums, 2>(tile, c.parts, a, with, options, stream);
    return launch<kSums, 1>(tile, c.parts, a, with, options, stream);
  }
  if (c.stage_k_blocks == 2) return launch<kWgmma, 2>(tile, c.parts, a, with, options, stream);
  if (c.stage_k_blocks == 3) return launch<kWgmma, 3>(tile, c.parts, a, with, options, stream);
  launch<kWgmma, 1>(tile, c.parts, a, with, options, stream);
}

// Checks shared by both layouts; fills the weight and scale fields of p.
Dims check_common(const TensorView& a, float a_scale, const TensorView& a_scale_device,
                  const TensorView& packed_w, const TensorView& packed_scales, const TensorView& d,
                  W4A8Params& p) {
  const Dims w =
      check_weight_pair(packed_w, packed_scales, DType::bf16, Device::cuda, "packed_w", "packed_scales");
  EPMOE_CHECK(w.groups * w.n * (w.k / 2) < (std::int64_t{1} << 40), "packed_w {} is too large",
              packed_w.describe());
  EPMOE_CHECK(w.n <= kInt32Max / 2 && w.k <= kInt32Max / 2, "packed_w {} is too large for one launch",
              packed_w.describe());
  expect_aligned_tensor(a, DType::fp8_e4m3, Device::cuda, "a", 16);
  expect_aligned_tensor(d, DType::bf16, Device::cuda, "d", 16);
  p.a_scale_ptr = nullptr;
  p.a_scale = a_scale;
  if (a_scale_device.empty_view()) {
    expect_scale(a_scale, "a_scale");
  } else {
    expect_aligned_tensor(a_scale_device, DType::f32, Device::cuda, "a_scale_device", 4);
    expect_shape(a_scale_device, {1}, "a_scale_device");
    p.a_scale_ptr = static_cast<const float*>(a_scale_device.data);
  }
  p.w = static_cast<const std::uint8_t*>(packed_w.data);
  p.ws = static_cast<const __nv_bfloat16*>(packed_scales.data);
  p.d = static_cast<__nv_bfloat16*>(d.data);
  p.n = static_cast<std::int32_t>(w.n);
  p.k = static_cast<std::int32_t>(w.k);
  p.groups = static_cast<std::int32_t>(w.groups);
  return w;
}

// The CPU packer (the device kernel's twin): gathers, as w4a8_prepare_kernel.
// Scales: forward, f32 -> bf16 (nearest-even, as the device kernel); inverse, bf16 -> f32.
void transform_cpu(const std::uint8_t* src, const void* src_scales, std::uint8_t* dst, void* dst_scales,
                   const Dims& dims, bool inverse, bool sm) {
  const std::int64_t half_k = dims.k / 2, kb_count = dims.k / kBlockK, per_group = dims.n * half_k;
  const auto int4_at = [&](const std::uint8_t* w, std::int64_t row, std::int64_t k) {
    const std::uint8_t b = w[row * half_k + k / 2];
    return k % 2 == 0 ? unpack_int4_lo(b) : unpack_int4_hi(b);
  };
  for (std::int64_t group = 0; group < dims.groups; ++group) {
    const std::uint8_t* s = src + group * per_group;
    std::uint8_t* d = dst + group * per_group;
    for (std::int64_t i = 0; i < per_group; ++i) {
      if (!inverse) {
        const w4a8::WeightPos at = w4a8::packed_byte_source(i, kb_count, dims.n);
        int hi_prev = 0;
        if (sm) {
          const w4a8::WeightPos prev = w4a8::packed_byte_source(w4a8::word_prev_byte(i), kb_count, dims.n);
          hi_prev = int4_at(s, prev.n + 8, prev.k);
        }
        d[i] = w4a8::pack_byte(int4_at(s, at.n, at.k), int4_at(s, at.n + 8, at.k), hi_prev, sm);
      } else {
        const std::int64_t row = i / half_k, k = 2 * (i % half_k);
        int v[2];
        for (int e = 0; e < 2; ++e) {
          const w4a8::NibblePos pos = w4a8::packed_position(row, k + e, kb_count, dims.n);
          v[e] = w4a8::unpack_value(s, pos.byte, pos.high, sm);
        }
        d[i] = pack_int4(v[0], v[1]);
      }
    }
    for (std::int64_t row = 0; row < dims.n; ++row) {
      for (std::int64_t kb = 0; kb < kb_count; ++kb) {
        const std::int64_t plain = (group * dims.n + row) * kb_count + kb;
        const std::int64_t packed =
            group * dims.n * kb_count + w4a8::packed_scale_index(row, kb, kb_count, dims.n);
        if (!inverse) {
          static_cast<bf16*>(dst_scales)[packed] =
              bf16::from_float(static_cast<const float*>(src_scales)[plain]);
        } else {
          static_cast<float*>(dst_scales)[plain] = static_cast<const bf16*>(src_scales)[packed].to_float();
        }
      }
    }
  }
}

// The largest magnitude an int4 code dequantizes to (-8): the checkpoint's f32 weight scales must be
// valid for it (expect_scale's rule, as the CPU dequantizer's), so that no prepared bf16 scale or
// dequantized value overflows.
constexpr float kInt4MaxCode = static_cast<float>(-kInt4Min);

// What one scan of checkpoint weights on the device found; both scans share one wait.
struct DeviceWeightScan {
  bool holds_minus8 = false;  // w_int4 holds a -8
  bool bad_scale = false;     // some scale is not valid for the int4 codes (expect_scale, kInt4MaxCode)
};
DeviceWeightScan scan_device_weights(const TensorView* w_int4, const TensorView* w_scales,
                                     cudaStream_t stream) {
  int* found_d = nullptr;  // [0]: a -8, [1]: a bad scale
  EPMOE_CUDA_CHECK(cudaMallocAsync(&found_d, 2 * sizeof(int), stream));
  EPMOE_CUDA_CHECK(cudaMemsetAsync(found_d, 0, 2 * sizeof(int), stream));
  const auto grid = [](std::int64_t items) {
    return static_cast<unsigned>(
        std::clamp<std::int64_t>((items + 255) / 256, 1, device_props().sm_count * 8));
  };
  if (w_int4 != nullptr) {
    expect_aligned_tensor(*w_int4, DType::i4x2, Device::cuda, "w_int4", 16);
    const std::int64_t bytes = static_cast<std::int64_t>(w_int4->nbytes());
    kernels::w4a8_find_minus8_kernel<<<grid(bytes / 16), 256, 0, stream>>>(
        static_cast<const std::uint8_t*>(w_int4->data), bytes, found_d);
    EPMOE_CUDA_CHECK_LAUNCH();
  }
  if (w_scales != nullptr) {
    const std::int64_t n = w_scales->numel();
    kernels::w4a8_find_bad_scale_kernel<<<grid(n), 256, 0, stream>>>(
        static_cast<const float*>(w_scales->data), n, kInt4MaxCode, found_d + 1);
    EPMOE_CUDA_CHECK_LAUNCH();
  }
  int found[2] = {};
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(found, found_d, sizeof(found), cudaMemcpyDeviceToHost, stream));
  EPMOE_CUDA_CHECK(cudaFreeAsync(found_d, stream));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return {found[0] != 0, found[1] != 0};
}

bool host_holds_minus8(const TensorView& w_int4) {
  expect_aligned_tensor(w_int4, DType::i4x2, Device::cpu, "w_int4", 1);
  const auto* b = static_cast<const std::uint8_t*>(w_int4.data);
  return std::any_of(b, b + w_int4.nbytes(), [](std::uint8_t x) { return w4a8::byte_holds_minus8(x); });
}

// A preparation's four tensors (inverse: packed -> checkpoint): input and output weight pairs of one
// shape, on `device`, not aliased. Returns the shape.
Dims check_prepare_args(const TensorView& src, const TensorView& src_scales, const TensorView& dst,
                        const TensorView& dst_scales, bool inverse, Device device) {
  const Dims dims =
      check_weight_pair(src, src_scales, inverse ? DType::bf16 : DType::f32, device,
                        inverse ? "packed_w" : "w_int4", inverse ? "packed_scales" : "w_scales");
  const Dims out = check_weight_pair(dst, dst_scales, inverse ? DType::f32 : DType::bf16, device,
                                     inverse ? "w_int4" : "packed_w", inverse ? "w_scales" : "packed_scales");
  EPMOE_CHECK(out.groups == dims.groups && out.n == dims.n && out.k == dims.k,
              "the output weights {} must have the shape of the input weights {}", dst.describe(),
              src.describe());
  EPMOE_CHECK(src.data != dst.data && src_scales.data != dst_scales.data,
              "the prepared tensors must not alias the inputs");
  return dims;
}

void prepare_device(const TensorView& src, const TensorView& src_scales, const TensorView& dst,
                    const TensorView& dst_scales, bool inverse, cudaStream_t stream, bool sm) {
  const Dims dims = check_prepare_args(src, src_scales, dst, dst_scales, inverse, Device::cuda);
  const std::int64_t items = dims.groups * dims.n * (dims.k / 2 + dims.k / kBlockK);
  const std::int64_t blocks = std::clamp<std::int64_t>((items + 255) / 256, 1, device_props().sm_count * 16);
  if (!inverse) {
    const DeviceWeightScan scan = scan_device_weights(sm ? &src : nullptr, &src_scales, stream);
    // Refused as the CPU packer refuses it, naming the first bad scale (the error path only copies them).
    if (scan.bad_scale) expect_scales(to_host(src_scales, stream).view(), "w_scales", kInt4MaxCode);
    EPMOE_CHECK(!scan.holds_minus8,
                "w_int4 holds -8, which W4A8Codes::sign_magnitude cannot store: prepare it with "
                "W4A8Codes::offset_binary (w4a8_pick_codes picks)");
  }
  kernels::w4a8_prepare_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      static_cast<const std::uint8_t*>(src.data), src_scales.data, static_cast<std::uint8_t*>(dst.data),
      dst_scales.data, dims.groups, dims.n, dims.k, inverse, sm);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void prepare_host(const TensorView& src, const TensorView& src_scales, const TensorView& dst,
                  const TensorView& dst_scales, bool inverse, bool sm) {
  const Dims dims = check_prepare_args(src, src_scales, dst, dst_scales, inverse, Device::cpu);
  // Checkpoint scales: valid for the int4 codes (the device packer scans them alike); packed ones: finite.
  if (inverse) {
    const std::int64_t scale_count = src_scales.numel();
    for (std::int64_t i = 0; i < scale_count; ++i) {
      const float v = static_cast<const bf16*>(src_scales.data)[i].to_float();
      EPMOE_CHECK(std::isfinite(v), "packed_scales[{}] = {} must be finite", i, v);
    }
  } else {
    expect_scales(src_scales, "w_scales", kInt4MaxCode);
  }
  EPMOE_CHECK(inverse || !sm || !host_holds_minus8(src),
              "w_int4 holds -8, which W4A8Codes::sign_magnitude cannot store: prepare it with "
              "W4A8Codes::offset_binary (w4a8_pick_codes_cpu picks)");
  transform_cpu(static_cast<const std::uint8_t*>(src.data), src_scales.data,
                static_cast<std::uint8_t*>(dst.data), dst_scales.data, dims, inverse, sm);
}

}  // namespace

// Measured with the offset-binary codes (bench/NOTES.md, W4A8 v4 and v5;
// 2026-11-30T1300Z-h200-w4a8-v4.json, 2026-11-30T1428Z-h200-w4a8-v5.json): the register-operand
// kernel wins the decode rows (masked, expected_m <= 24: its 16- and 32-row tiles, 1.3-1.7x faster
// than v3); v3 wins every other row, masked (64 x 256 for expected_m <= 64) and contiguous (128 x 128:
// v2's larger tiles pay for the codes' offset term). The offset warp with two K blocks per stage is
// 6% faster on the 16-row tiles' 4096 x 7168 decode GEMM (503 against 536 µs, level on 7168 x 2048)
// but racecheck reports its offset-slot hand-off (believed false: mbarrier-ordered, see NOTES W4A8
// v5), so it stays a pinned variant until racecheck can see that order: a default must pass it.
// v6 (2026-11-30T1628Z-h200-w4a8-v6-run1.json): with the consumers' K-block stream across tiles plain
// v2 (one K block per stage, the offset term from the constant-operand wgmma, no hand-off between
// warps) runs the 128 x 8 decode rows at 1.02x / 1.06x their weight floor, level with two K blocks
// per stage and 3-14% ahead of the offset warp's k2.
W4A8KernelChoice w4a8_kernel_choice(bool masked, std::int64_t expected_m, std::int64_t n, std::int64_t k) {
  static_cast<void>(k);
  // The 32-row tile (expected_m 13..24) takes the offset term from the row-sum pre-pass where the call
  // has a workspace: 11% faster on the 128 x 16 decode rows; the 16-row tile, at its weight floor
  // already, 1% slower with it (session 20). Without a workspace the 32-row tile keeps two partials
  // (run() sets them: 2-3% faster than one, session 19).
  if (masked && expected_m > 12 && expected_m <= 24) return W4A8KernelChoice{.version = 2, .row_sums = 1};
  if (masked && expected_m <= 12) return W4A8KernelChoice{.version = 2};
  // Contiguous: v2 with signed codes (converted in the consumers' registers, per-row scales), faster
  // than v3 on every contiguous row in session 25 (bench/NOTES.md): its wide tile (256 activation rows
  // x 128 weight rows: 8 x 4096 1109-1111 TFLOP/s at 4096 x 7168 against v3's tall tile at 929-937)
  // or its 128 x 128 tile (128 x 128 groups: 1530 against v3's 128 x 256 at 1671 us), by
  // resolve_v2_signed. Masked groups of > 64 rows: v2's signed 128 x 128 as well, 4-16% faster than
  // v3's signed 128 x 256 on the masked 32 x 128 and 32 x 192 rows (session 28; v3 was the choice
  // there since session 23, before v2's signed tiles got their movmatrix epilogue in session 26).
  if (!masked || expected_m > 64)
    return resolve_v2_signed(W4A8KernelChoice{.version = 2, .signed_codes = 1}, masked, expected_m, n);
  // The masked 64 x 256 tile (expected_m 25..64) keeps v3 with the codes' offset term: the signed
  // conversion was 5-9% slower there (session 23, bench/NOTES.md).
  return resolve_v3(W4A8KernelChoice{.version = 3}, masked, expected_m, n);
}

std::vector<W4A8CtaStamps> w4a8_take_cta_trace(int ctas, cudaStream_t stream) {
  return gemm_host::take_cta_stamps(&kernels::g_w4a8_cta_trace, ctas, kW4A8TraceMaxCtas, stream);
}

W4A8KernelChoice w4a8_resolve_v3(const W4A8KernelChoice& choice, bool masked, std::int64_t expected_m,
                                 std::int64_t n) {
  return resolve_v3(choice, masked, expected_m, n);
}

void w4a8_pin_kernel(const W4A8KernelChoice& choice) {
  EPMOE_CHECK(choice.version == 0 || choice.version == 2 || choice.version == 3,
              "W4A8 kernel version must be 0, 2 or 3, got {}", choice.version);
  EPMOE_CHECK(choice.offset_warp == 0 || (choice.offset_warp == 1 && choice.version == 2),
              "W4A8 offset_warp must be 0, or 1 with version 2, got {} with version {}", choice.offset_warp,
              choice.version);
  EPMOE_CHECK(choice.stage_k_blocks >= 0 && choice.stage_k_blocks <= 3 &&
                  (choice.stage_k_blocks <= 1 || choice.version == 2) &&
                  (choice.stage_k_blocks != 3 || choice.offset_warp == 0),
              "W4A8 stage_k_blocks must be 0 or 1, 2 with version 2, or 3 with version 2 and no offset warp, "
              "got {} with version {} and offset_warp {}",
              choice.stage_k_blocks, choice.version, choice.offset_warp);
  EPMOE_CHECK(
      choice.row_sums == 0 || (choice.row_sums == 1 && choice.version == 2 && choice.offset_warp == 0),
      "W4A8 row_sums must be 0, or 1 with version 2 and no offset warp, got {} with version {} and "
      "offset_warp {}",
      choice.row_sums, choice.version, choice.offset_warp);
  // (v2's decode tiles with the signed conversion were 4-7% slower than their defaults, session 23: v2
  // has it on its 128- and 256-row tiles only.)
  EPMOE_CHECK(choice.signed_codes == 0 ||
                  (choice.signed_codes == 1 &&
                   (choice.version == 3 ||
                    (choice.version == 2 && choice.offset_warp == 0 && choice.row_sums == 0 &&
                     choice.parts <= 1 && choice.stage_k_blocks <= 1 &&
                     (choice.block_m == 0 || choice.block_m == 128 || choice.block_m == 256)))),
              "W4A8 signed_codes must be 0, or 1 with version 3, or with version 2 and block_m 0, 128 or 256 "
              "and no offset warp, row sums, second partial or K blocks per stage, got {} with version {}",
              choice.signed_codes, choice.version);
  EPMOE_CHECK(
      choice.half_tiles >= 0 && choice.half_tiles <= 2 &&
          (choice.half_tiles == 0 ||
           (choice.version == 2 && choice.signed_codes == 1 && choice.block_m == 256)),
      "W4A8 half_tiles must be 0, or 1 or 2 with version 2, signed_codes 1 and block_m 256, got {} with "
      "version {}, signed_codes {}, block_m {}",
      choice.half_tiles, choice.version, choice.signed_codes, choice.block_m);
  EPMOE_CHECK(choice.parts >= 0 && choice.parts <= 2 &&
                  (choice.parts != 2 || (choice.version == 2 && choice.offset_warp == 0)),
              "W4A8 parts must be 0 or 1, or 2 with version 2 and no offset warp, got {} with version {} and "
              "offset_warp {}",
              choice.parts, choice.version, choice.offset_warp);
  EPMOE_CHECK(
      choice.ablation >= 0 && choice.ablation <= 31 &&
          (choice.ablation == 0 || (choice.version == 3 && (choice.ablation & kW4A8TraceCtas) == 0) ||
           (choice.version == 2 && (choice.ablation & 6) == 0)),
      "W4A8 ablation bits: 0..15 for version 3, 1, 8 and 16 (the CTA stamps) for version 2, got ablation {} "
      "with version {}",
      choice.ablation, choice.version);
  g_pinned = choice;
}

W4A8TileShape w4a8_gemm_tile(bool masked, std::int64_t expected_m) {
  if (!masked) return {128, 2};
  if (expected_m <= 12) return {16, 4};
  if (expected_m <= 24) return {32, 4};
  if (expected_m <= 48) return {64, 2};
  return {128, 2};
}

// The workspace: the row sums (a multiple of 128 bytes), then 16 bytes for the dynamic schedule's
// counter word (at the end of the caller's workspace, however large).
namespace {
constexpr std::size_t kTileCounterBytes = 16;

// The sizes each byte count takes: non-negative, K whole 128-wide scale blocks, and a product that
// fits (a negative or wrapped count would otherwise come back as a huge size_t).
std::size_t checked_bytes(const char* function, const char* rows_name, std::int64_t groups, std::int64_t rows,
                          std::int64_t k, std::int64_t bytes_per_k_block_row) {
  EPMOE_CHECK(groups >= 0 && rows >= 0 && k >= 0, "{}: groups, {} and k must be >= 0, got {}, {}, {}",
              function, rows_name, groups, rows, k);
  EPMOE_CHECK(k % kBlockK == 0, "{}: k must be a multiple of {}, got {}", function, kBlockK, k);
  std::int64_t bytes = 0;
  EPMOE_CHECK(!__builtin_mul_overflow(groups, rows, &bytes) &&
                  !__builtin_mul_overflow(bytes, k / kBlockK, &bytes) &&
                  !__builtin_mul_overflow(bytes, bytes_per_k_block_row, &bytes),
              "{}: groups {} x {} {} x k {} overflows", function, groups, rows_name, rows, k);
  return static_cast<std::size_t>(bytes);
}
}  // namespace

std::size_t w4a8_workspace_bytes(std::int64_t groups, std::int64_t m_max, std::int64_t k) {
  // The row sums' rows: m_max padded to 32 (a negative m_max passed on as it is, for the message).
  EPMOE_CHECK(m_max <= std::numeric_limits<std::int64_t>::max() - 31,
              "w4a8_workspace_bytes: m_max {} overflows", m_max);
  const std::int64_t sums_rows = m_max >= 0 ? w4a8::row_sums_rows(m_max) : m_max;
  return checked_bytes("w4a8_workspace_bytes", "m_max", groups, sums_rows, k, sizeof(float)) +
         kTileCounterBytes;
}

std::size_t w4a8_packed_weight_bytes(std::int64_t groups, std::int64_t n, std::int64_t k) {
  return checked_bytes("w4a8_packed_weight_bytes", "n", groups, n, k, kBlockK / 2);  // two int4 per byte
}
std::size_t w4a8_packed_scale_bytes(std::int64_t groups, std::int64_t n, std::int64_t k) {
  return checked_bytes("w4a8_packed_scale_bytes", "n", groups, n, k, w4a8::kScaleBytes);
}

void w4a8_prepare_weights(TensorView w_int4, TensorView w_scales, TensorView packed_w,
                          TensorView packed_scales, cudaStream_t stream, W4A8Codes codes) {
  prepare_device(w_int4, w_scales, packed_w, packed_scales, false, stream, sign_magnitude(codes));
}

void w4a8_unprepare_weights(TensorView packed_w, TensorView packed_scales, TensorView w_int4,
                            TensorView w_scales, cudaStream_t stream, W4A8Codes codes) {
  prepare_device(packed_w, packed_scales, w_int4, w_scales, true, stream, sign_magnitude(codes));
}

W4A8Codes w4a8_pick_codes(TensorView w_int4, cudaStream_t stream) {
  return scan_device_weights(&w_int4, nullptr, stream).holds_minus8 ? W4A8Codes::offset_binary
                                                                    : W4A8Codes::sign_magnitude;
}

void w4a8_prepare_weights_cpu(TensorView w_int4, TensorView w_scales, TensorView packed_w,
                              TensorView packed_scales, W4A8Codes codes) {
  prepare_host(w_int4, w_scales, packed_w, packed_scales, false, sign_magnitude(codes));
}

void w4a8_unprepare_weights_cpu(TensorView packed_w, TensorView packed_scales, TensorView w_int4,
                                TensorView w_scales, W4A8Codes codes) {
  prepare_host(packed_w, packed_scales, w_int4, w_scales, true, sign_magnitude(codes));
}

W4A8Codes w4a8_pick_codes_cpu(TensorView w_int4) {
  return host_holds_minus8(w_int4) ? W4A8Codes::offset_binary : W4A8Codes::sign_magnitude;
}

void w4a8_grouped_gemm_masked(TensorView a, float a_scale, TensorView a_scale_device, TensorView packed_w,
                              TensorView packed_scales, TensorView masked_m, std::int64_t expected_m,
                              TensorView d, cudaStream_t stream, const W4A8GemmOptions& options) {
  Problem problem{};
  W4A8Params& p = problem.params;
  const Dims w = check_common(a, a_scale, a_scale_device, packed_w, packed_scales, d, p);
  expect_rank(a, 3, "a");
  const std::int64_t M_max = a.shape[1];
  expect_shape(a, {w.groups, M_max, w.k}, "a (G and K of packed_w)");
  expect_aligned_tensor(masked_m, DType::i32, Device::cuda, "masked_m", 4);
  expect_shape(masked_m, {w.groups}, "masked_m");
  expect_shape(d, {w.groups, M_max, w.n}, "d");
  EPMOE_CHECK(expected_m >= 0, "expected_m must be >= 0, got {}", expected_m);
  const W4A8TileShape tile = check_tile(options, true, expected_m, w.n);
  EPMOE_CHECK(w.groups * (M_max + 128) <= kInt32Max, "a {} has too many rows for one launch", a.describe());
  if (!options.workspace.empty_view()) {
    expect_aligned_tensor(options.workspace, DType::f32, Device::cuda, "options.workspace", 16);
    const std::size_t need = w4a8_workspace_bytes(w.groups, M_max, w.k);
    EPMOE_CHECK(options.workspace.nbytes() >= need,
                "options.workspace {} must hold at least {} bytes (w4a8_workspace_bytes({}, {}, {}))",
                options.workspace.describe(), need, w.groups, M_max, w.k);
    // The pre-pass writes it while the GEMM reads a (and, launched behind it, may write d).
    const auto* ws = static_cast<const char*>(options.workspace.data);
    for (const auto& [t, name] : {std::pair{a, "a"}, {d, "d"}}) {
      const auto* begin = static_cast<const char*>(t.data);
      EPMOE_CHECK(ws + need <= begin || begin + t.nbytes() <= ws, "options.workspace must not overlap {}",
                  name);
    }
  }
  if (M_max == 0) return;
  check_device();
  if (!options.workspace.empty_view())
    // (The workspace's last 16 bytes, past any call's row sums: calls of other K sharing one
    // workspace use the same word, which each leaves ready for the next.)
    problem.tile_counter = reinterpret_cast<unsigned long long*>(
        static_cast<char*>(options.workspace.data) +
        ((options.workspace.nbytes() - kTileCounterBytes) & ~std::size_t{7}));
  p.m_indices = nullptr;
  p.masked_m = static_cast<const std::int32_t*>(masked_m.data);
  p.rows = static_cast<std::int32_t>(M_max);
  problem.a_rows = w.groups * M_max;
  problem.tile_rows = M_max;
  problem.schedule_groups = w.groups;
  problem.expected_m = expected_m;
  run(tile, a, problem, options, true, stream);
}

void w4a8_grouped_gemm_contiguous(TensorView a, float a_scale, TensorView a_scale_device, TensorView packed_w,
                                  TensorView packed_scales, TensorView m_indices, TensorView d,
                                  cudaStream_t stream, const W4A8GemmOptions& options) {
  Problem problem{};
  W4A8Params& p = problem.params;
  const Dims w = check_common(a, a_scale, a_scale_device, packed_w, packed_scales, d, p);
  expect_rank(a, 2, "a");
  const std::int64_t M = a.shape[0];
  expect_shape(a, {M, w.k}, "a (K of packed_w)");
  expect_aligned_tensor(m_indices, DType::i32, Device::cuda, "m_indices", 4);
  expect_shape(m_indices, {M}, "m_indices");
  expect_shape(d, {M, w.n}, "d");
  const W4A8TileShape tile = check_tile(options, false, 0, w.n);
  EPMOE_CHECK(M + 128 <= kInt32Max, "a {} has too many rows for one launch", a.describe());
  if (M == 0) return;
  check_device();
  p.m_indices = static_cast<const std::int32_t*>(m_indices.data);
  p.masked_m = nullptr;
  p.rows = static_cast<std::int32_t>(M);
  problem.a_rows = M;
  problem.tile_rows = M;
  problem.schedule_groups = 1;
  problem.expected_m = M / w.groups;  // (padding included: the kernel choice's hint)
  run(tile, a, problem, options, false, stream);
}

}  // namespace epmoe::cuda
