// Host launchers of the permutation and weighted-gather kernels (permute_kernels.cuh,
// gather_kernels.cuh); API in epmoe/cuda/permute.hpp.
#include "epmoe/cuda/permute.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string_view>
#include <utility>

#include "cuda/pdl_launch.hpp"
#include "dispatch/gather_kernels.cuh"
#include "dispatch/permute_kernels.cuh"
#include "epmoe/cuda/launch.hpp"

namespace epmoe::cuda {
namespace {

using kernels::kPermuteThreads;

static_assert(kPermuteMaxExperts == kernels::kPermuteExpertsMax);
static_assert(kPermuteMaxTopk == 32);  // a lane per k

constexpr std::int64_t kI32Max = std::numeric_limits<std::int32_t>::max();

template <auto kKernel>
unsigned grid_for(std::uint64_t work_blocks, int threads = kPermuteThreads) {
  static const int blocks_per_sm = [threads] {
    int n = 0;
    EPMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, threads, 0));
    return std::max(n, 1);
  }();
  const std::uint64_t resident = static_cast<std::uint64_t>(device_props().sm_count) * blocks_per_sm;
  return static_cast<unsigned>(std::clamp<std::uint64_t>(work_blocks, 1, resident));
}

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) {
  return (a + b - 1) / b;
}

// Timing experiments only (read once): EPMOE_PERMUTE_EXPERIMENT bit 1 = no programmatic dependent
// launch, bit 4 = no index launches after the first call on the same maps and entry count (the copy
// alone, on the row maps of that call: wrong unless the ids are the same), bit 5 = rows written in
// token order (t*K + k, contiguous only: the write-pattern ceiling; wrong output), bit 10 = the copy
// launched plainly (not PDL), bit 12 = count and scan + rank as two launches instead of the fused
// cooperative one. (Bits 0, 2, 3 and 7 were a persistent copy grid, the bulk copy engine, streaming
// stores and the v2 copy kernel; bits 6, 8, 9 and 11 other copy variants; all removed:
// bench/NOTES.md.)
unsigned experiment_bits() {
  static const unsigned bits = [] {
    const char* v = std::getenv("EPMOE_PERMUTE_EXPERIMENT");
    return v == nullptr ? 0u : static_cast<unsigned>(std::atoi(v));
  }();
  return bits;
}

// launch_pdl (cuda/pdl_launch.hpp), with PDL switched off by EPMOE_PERMUTE_EXPERIMENT bit 2.
template <class... Params, class... Args>
void launch_dependent(bool dependent, void (*kernel)(Params...), unsigned grid, unsigned threads,
                      cudaStream_t stream, Args&&... args) {
  launch_pdl(dependent && (experiment_bits() & 2u) == 0, kernel, grid, threads, stream,
             std::forward<Args>(args)...);
}

std::int64_t chunks_for(std::int64_t entries) {
  return static_cast<std::int64_t>(ceil_div(static_cast<std::uint64_t>(entries), kernels::kPermuteChunk));
}

struct InShape {
  std::int64_t tokens = 0, hidden = 0, groups = 0, topk = 0, vecs_per_row = 0;
  bool fp8 = false;
};

InShape check_input(const PermuteInput& in) {
  expect_rank(in.x, 2, "x");
  EPMOE_CHECK(in.x.dtype == DType::fp8_e4m3 || in.x.dtype == DType::bf16,
              "x must have dtype fp8_e4m3 or bf16, got {}", in.x.describe());
  expect_device_tensor(in.x, in.x.dtype, "x", 16);
  InShape s;
  s.tokens = in.x.shape[0];
  s.hidden = in.x.shape[1];
  s.groups = s.hidden / 128;
  s.fp8 = in.x.dtype == DType::fp8_e4m3;
  EPMOE_CHECK(s.hidden > 0 && s.hidden % 128 == 0, "x: H = {} must be a positive multiple of 128", s.hidden);
  s.vecs_per_row = s.hidden * static_cast<std::int64_t>(dtype_size(in.x.dtype)) / 16;
  if (s.fp8) {
    expect_device_tensor(in.x_scales, DType::f32, "x_scales", 4);
    expect_shape(in.x_scales, {s.tokens, s.groups}, "x_scales");
  }
  expect_rank(in.topk_ids, 2, "topk_ids");
  expect_device_tensor(in.topk_ids, DType::i32, "topk_ids", 4);
  EPMOE_CHECK(in.topk_ids.shape[0] == s.tokens, "topk_ids must have {} rows (x's tokens), got {}", s.tokens,
              in.topk_ids.describe());
  s.topk = in.topk_ids.shape[1];
  EPMOE_CHECK(s.topk >= 1 && s.topk <= kPermuteMaxTopk, "topk_ids: K = {} must lie in [1, {}]", s.topk,
              kPermuteMaxTopk);
  EPMOE_CHECK(s.tokens * s.topk <= kI32Max && s.tokens * s.vecs_per_row <= kI32Max,
              "x {} with K = {} is too large for one launch", in.x.describe(), s.topk);
  return s;
}

void check_experts(std::int64_t experts, std::string_view what) {
  EPMOE_CHECK(experts >= 1 && experts <= kPermuteMaxExperts, "{}: E = {} must lie in [1, {}]", what, experts,
              kPermuteMaxExperts);
}

void check_workspace(const TensorView& workspace, std::int64_t entries, std::int64_t experts) {
  expect_device_tensor(workspace, DType::u8, "workspace", 16);
  const std::size_t need = permute_workspace_bytes(entries, static_cast<int>(experts));
  EPMOE_CHECK(workspace.nbytes() >= need,
              "workspace must hold at least {} bytes for T*K = {} and E = {}, got {}", need, entries, experts,
              workspace.describe());
}

void check_i32(const TensorView& t, std::initializer_list<std::int64_t> shape, std::string_view name) {
  expect_device_tensor(t, DType::i32, name, 4);
  expect_shape(t, shape, name);
}

// The scales of the rows: token-major [lead..., rows, G] or MN-major [lead..., G, pad(rows)].
// Returns scale_ld (MN-major: the padded row count).
std::int64_t check_out_scales(const TensorView& scales, ScaleLayout layout, std::int64_t experts,
                              std::int64_t rows, std::int64_t groups) {
  expect_device_tensor(scales, DType::f32, "scales", 4);
  const std::int64_t padded = tma_aligned_tokens(rows);
  if (layout == ScaleLayout::token_major) {
    if (experts == 0) {
      expect_shape(scales, {rows, groups}, "scales (token_major)");
    } else {
      expect_shape(scales, {experts, rows, groups}, "scales (token_major)");
    }
    return 0;
  }
  EPMOE_CHECK(layout == ScaleLayout::mn_major_tma, "unknown scale layout {}", static_cast<int>(layout));
  if (experts == 0) {
    expect_shape(scales, {groups, padded}, "scales (mn_major_tma)");
  } else {
    expect_shape(scales, {experts, groups, padded}, "scales (mn_major_tma)");
  }
  return padded;
}

// 0.0f into the MN-major TMA padding: `columns` columns of scale_ld floats, each padded from `valid`.
void zero_scale_padding(const TensorView& scales, std::int64_t columns, std::int64_t valid,
                        std::int64_t scale_ld, cudaStream_t stream) {
  if (scale_ld == valid || columns == 0) return;
  EPMOE_CUDA_CHECK(cudaMemset2DAsync(
      static_cast<float*>(scales.data) + valid, static_cast<std::size_t>(scale_ld) * 4, 0,
      static_cast<std::size_t>(scale_ld - valid) * 4, static_cast<std::size_t>(columns), stream));
}

// Blocks of the fused count + scan + rank kernel that fit on the device at once (its cooperative
// launch needs them all resident).
template <bool kMasked>
std::uint32_t cooperative_blocks() {
  static const std::uint32_t blocks = [] {
    int n = 0;
    EPMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &n, &kernels::permute_scan_rank_kernel<kMasked, true>, kPermuteThreads, 0));
    int cooperative = 0;
    EPMOE_CUDA_CHECK(cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, current_device()));
    return cooperative != 0
               ? static_cast<std::uint32_t>(n) * static_cast<std::uint32_t>(device_props().sm_count)
               : 0u;
  }();
  return blocks;
}

// Launches 1-3 (count, scan, rank): the one-block version of all three for small batches; up to
// kPermuteInlineScanChunks chunks all three in one cooperative launch when every chunk's block fits
// on the device at once (else count + fused scan/rank); beyond, three launches. offsets / counts
// (contiguous) and masked_m (masked) are the scan's outputs.
template <bool kMasked>
void launch_index(const InShape& s, const PermuteInput& in, const TensorView& workspace, std::int64_t experts,
                  kernels::PermuteRankParams rank, std::int32_t* offsets, std::int32_t* counts,
                  std::int32_t* masked_m, cudaStream_t stream) {
  const std::int64_t entries = s.tokens * s.topk;
  const auto chunks = static_cast<std::uint32_t>(chunks_for(entries));
  auto* hist = static_cast<std::int32_t*>(workspace.data);
  const auto e = static_cast<std::uint32_t>(experts);
  rank.ids = static_cast<const std::int32_t*>(in.topk_ids.data);
  rank.entries = static_cast<std::uint32_t>(entries);
  rank.experts = e;
  rank.chunks = chunks;
  rank.chunk_base = hist;
  rank.offsets = offsets;
  if ((experiment_bits() & 16u) != 0) {  // the index of these maps and ids once, then the copy alone
    static const void* last_maps[2] = {nullptr, nullptr};
    static std::uint32_t last_entries = 0;
    const bool same =
        last_maps[0] == rank.src_row && last_maps[1] == rank.row_src && last_entries == rank.entries;
    last_maps[0] = rank.src_row;
    last_maps[1] = rank.row_src;
    last_entries = rank.entries;
    if (same) return;
  }
  if (chunks <= kernels::kPermuteSmallChunks) {
    launch_dependent(false, &kernels::permute_index_small_kernel<kMasked>, 1, kPermuteThreads, stream, rank,
                     offsets, counts, masked_m);
    return;
  }
  if (chunks <= kernels::kPermuteInlineScanChunks && (experiment_bits() & 4096u) == 0 &&
      chunks <= cooperative_blocks<kMasked>()) {
    // Count, scan and rank in one cooperative launch (grid-wide barrier after the count).
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(chunks);
    config.blockDim = dim3(kPermuteThreads);
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeCooperative;
    attribute[0].val.cooperative = 1;
    config.attrs = attribute;
    config.numAttrs = 1;
    EPMOE_CUDA_CHECK(cudaLaunchKernelEx(&config, &kernels::permute_scan_rank_kernel<kMasked, true>, rank,
                                        offsets, counts, masked_m, hist));
    return;
  }
  launch_dependent(false, &kernels::permute_count_kernel, chunks, kPermuteThreads, stream, rank.ids,
                   rank.entries, e, hist);
  if (chunks <= kernels::kPermuteInlineScanChunks) {
    launch_dependent(true, &kernels::permute_scan_rank_kernel<kMasked>, chunks, kPermuteThreads, stream, rank,
                     offsets, counts, masked_m, nullptr);
    return;
  }
  launch_dependent(true, &kernels::permute_scan_kernel<kMasked>, 1, kernels::kPermuteScanThreads, stream,
                   hist, chunks, e, rank.m_max, offsets, counts, masked_m);
  launch_dependent(true, &kernels::permute_rank_kernel<kMasked>, chunks, kPermuteThreads, stream, rank);
}

// Launch 4 (copy, with the fill blocks first).
template <bool kScales, bool kMnMajor, bool kMasked>
void launch_copy_variant(kernels::PermuteCopyParams p, cudaStream_t stream) {
  const std::uint64_t warps = static_cast<std::uint64_t>(p.tokens) * p.segments;
  const std::uint64_t copy_blocks = ceil_div(warps, kernels::kPermuteCopyWarps);
  p.fill_blocks = static_cast<std::uint32_t>(
      std::clamp<std::uint64_t>(ceil_div(p.total_rows, 4 * kernels::kPermuteCopyThreads), 1,
                                static_cast<std::uint64_t>(device_props().sm_count)));
  EPMOE_CHECK(p.fill_blocks + copy_blocks <= 0x7fffffffu, "too many blocks for one launch");
  // The kernel's thread index over the copy blocks is 32-bit: past 2^32 threads (fp8 rows of 128 at
  // 2^27 tokens) it wrapped, and the last tokens were never copied.
  EPMOE_CHECK(copy_blocks * kernels::kPermuteCopyThreads <= std::numeric_limits<std::uint32_t>::max(),
              "{} tokens x {} row segments are too many for one launch (at most {} warps)", p.tokens,
              p.segments, std::numeric_limits<std::uint32_t>::max() / 32);
  p.token_order_rows = (experiment_bits() & 32u) != 0 && !kMasked ? 1u : 0u;
  launch_dependent(
      (experiment_bits() & 1024u) == 0, &kernels::permute_copy_kernel<kScales, kMnMajor, kMasked>,
      static_cast<unsigned>(p.fill_blocks + copy_blocks), kernels::kPermuteCopyThreads, stream, p);
}

// p: the fill fields already set.
template <bool kMasked>
void launch_copy(const InShape& s, const PermuteInput& in, const TensorView& rows, const TensorView& scales,
                 const TensorView& src_row, ScaleLayout layout, std::int64_t scale_ld, std::int64_t m_max,
                 kernels::PermuteCopyParams p, cudaStream_t stream) {
  p.x = static_cast<const uint4*>(in.x.data);
  p.x_scales = s.fp8 ? static_cast<const float*>(in.x_scales.data) : nullptr;
  p.src_row = static_cast<const std::int32_t*>(src_row.data);
  p.tokens = static_cast<std::uint32_t>(s.tokens);
  p.topk = static_cast<std::uint32_t>(s.topk);
  p.vecs_per_row = static_cast<std::uint32_t>(s.vecs_per_row);
  p.segments = static_cast<std::uint32_t>(ceil_div(p.vecs_per_row, 32 * kernels::kPermuteCopyVecs));
  p.groups = static_cast<std::uint32_t>(s.groups);
  p.rows = static_cast<uint4*>(rows.data);
  p.scales = s.fp8 ? static_cast<float*>(scales.data) : nullptr;
  p.scale_ld = static_cast<std::uint32_t>(scale_ld);
  p.m_max = static_cast<std::uint32_t>(m_max);
  EPMOE_CHECK(static_cast<std::uint64_t>(p.tokens) * p.segments <= std::numeric_limits<std::uint32_t>::max(),
              "x {} has too many segments for one launch", in.x.describe());
  if (!s.fp8) {
    launch_copy_variant<false, false, kMasked>(p, stream);
  } else if (layout == ScaleLayout::token_major) {
    launch_copy_variant<true, false, kMasked>(p, stream);
  } else {
    launch_copy_variant<true, true, kMasked>(p, stream);
  }
}

}  // namespace

std::size_t permute_workspace_bytes(std::int64_t max_entries, int num_experts) {
  EPMOE_CHECK(max_entries >= 0 && max_entries <= kI32Max, "max_entries = {} must lie in [0, 2^31)",
              max_entries);
  check_experts(num_experts, "permute_workspace_bytes");
  const std::size_t bytes =
      static_cast<std::size_t>(chunks_for(max_entries)) * static_cast<std::size_t>(num_experts) * 4;
  return std::max<std::size_t>((bytes + 15) / 16 * 16, 16);
}

void permute_contiguous(const PermuteInput& in, const ContiguousLayout& out, TensorView workspace,
                        cudaStream_t stream, ScaleLayout scale_layout) {
  const InShape s = check_input(in);
  expect_rank(out.expert_offsets, 1, "expert_offsets");
  const std::int64_t experts = out.expert_offsets.shape[0] - 1;
  check_experts(experts, "expert_offsets");
  check_i32(out.expert_offsets, {experts + 1}, "expert_offsets");
  check_i32(out.counts, {experts}, "counts");
  expect_rank(out.rows, 2, "rows");
  const std::int64_t m = out.rows.shape[0];
  expect_device_tensor(out.rows, in.x.dtype, "rows", 16);
  expect_shape(out.rows, {m, s.hidden}, "rows");
  const std::int64_t need = contiguous_capacity(s.tokens * s.topk, static_cast<int>(experts));
  EPMOE_CHECK(m >= need, "rows must have at least contiguous_capacity(T*K = {}, E = {}) = {} rows, got {}",
              s.tokens * s.topk, experts, need, out.rows.describe());
  EPMOE_CHECK(tma_aligned_tokens(m) <= kI32Max, "rows {} has too many rows", out.rows.describe());
  const std::int64_t scale_ld = s.fp8 ? check_out_scales(out.scales, scale_layout, 0, m, s.groups) : 0;
  check_i32(out.m_indices, {m}, "m_indices");
  check_i32(out.row_src, {m}, "row_src");
  check_i32(out.src_row, {s.tokens, s.topk}, "src_row");
  check_workspace(workspace, s.tokens * s.topk, experts);

  auto* offsets = static_cast<std::int32_t*>(out.expert_offsets.data);
  auto* counts = static_cast<std::int32_t*>(out.counts.data);
  kernels::PermuteRankParams rank{};
  rank.src_row = static_cast<std::int32_t*>(out.src_row.data);
  rank.row_src = static_cast<std::int32_t*>(out.row_src.data);
  launch_index<false>(s, in, workspace, experts, rank, offsets, counts, nullptr, stream);
  kernels::PermuteCopyParams fill{};
  fill.experts = static_cast<std::uint32_t>(experts);
  fill.total_rows = static_cast<std::uint32_t>(m);
  fill.offsets = offsets;
  fill.counts = counts;
  fill.m_indices = static_cast<std::int32_t*>(out.m_indices.data);
  fill.row_src = rank.row_src;
  launch_copy<false>(s, in, out.rows, out.scales, out.src_row, scale_layout, scale_ld, 0, fill, stream);
  if (s.fp8 && scale_layout == ScaleLayout::mn_major_tma)
    zero_scale_padding(out.scales, s.groups, m, scale_ld, stream);
}

void permute_masked(const PermuteInput& in, const MaskedLayout& out, TensorView workspace,
                    cudaStream_t stream, ScaleLayout scale_layout) {
  const InShape s = check_input(in);
  expect_rank(out.masked_m, 1, "masked_m");
  const std::int64_t experts = out.masked_m.shape[0];
  check_experts(experts, "masked_m");
  check_i32(out.masked_m, {experts}, "masked_m");
  expect_rank(out.rows, 3, "rows");
  const std::int64_t m_max = out.rows.shape[1];
  expect_device_tensor(out.rows, in.x.dtype, "rows", 16);
  expect_shape(out.rows, {experts, m_max, s.hidden}, "rows");
  EPMOE_CHECK(m_max >= 1 && experts * tma_aligned_tokens(m_max) <= kI32Max,
              "rows {}: M_max must be positive and E * M_max must fit in i32", out.rows.describe());
  const std::int64_t scale_ld =
      s.fp8 ? check_out_scales(out.scales, scale_layout, experts, m_max, s.groups) : 0;
  check_i32(out.row_src, {experts, m_max}, "row_src");
  check_i32(out.src_row, {s.tokens, s.topk}, "src_row");
  check_workspace(workspace, s.tokens * s.topk, experts);

  auto* masked_m = static_cast<std::int32_t*>(out.masked_m.data);
  kernels::PermuteRankParams rank{};
  rank.m_max = static_cast<std::int32_t>(m_max);
  rank.src_row = static_cast<std::int32_t*>(out.src_row.data);
  rank.row_src = static_cast<std::int32_t*>(out.row_src.data);
  launch_index<true>(s, in, workspace, experts, rank, nullptr, nullptr, masked_m, stream);
  kernels::PermuteCopyParams fill{};
  fill.experts = static_cast<std::uint32_t>(experts);
  fill.total_rows = static_cast<std::uint32_t>(experts * m_max);
  fill.masked_m = masked_m;
  fill.row_src = rank.row_src;
  launch_copy<true>(s, in, out.rows, out.scales, out.src_row, scale_layout, scale_ld, m_max, fill, stream);
  if (s.fp8 && scale_layout == ScaleLayout::mn_major_tma)
    zero_scale_padding(out.scales, experts * s.groups, m_max, scale_ld, stream);
}

void gather_weighted(TensorView expert_out, TensorView src_row, TensorView topk_weights, TensorView y,
                     cudaStream_t stream) {
  EPMOE_CHECK(expert_out.rank == 2 || expert_out.rank == 3, "expert_out must have rank 2 or 3, got {}",
              expert_out.describe());
  expect_device_tensor(expert_out, DType::bf16, "expert_out", 16);
  const std::int64_t hidden = expert_out.shape[expert_out.rank - 1];
  EPMOE_CHECK(hidden > 0 && hidden % 8 == 0, "expert_out: H = {} must be a positive multiple of 8", hidden);
  const std::int64_t rows = expert_out.numel() / hidden;
  expect_rank(src_row, 2, "src_row");
  expect_device_tensor(src_row, DType::i32, "src_row", 4);
  const std::int64_t tokens = src_row.shape[0], topk = src_row.shape[1];
  EPMOE_CHECK(topk >= 1 && topk <= kPermuteMaxTopk, "src_row: K = {} must lie in [1, {}]", topk,
              kPermuteMaxTopk);
  expect_device_tensor(topk_weights, DType::f32, "topk_weights", 4);
  expect_shape(topk_weights, {tokens, topk}, "topk_weights");
  expect_device_tensor(y, DType::bf16, "y", 16);
  expect_shape(y, {tokens, hidden}, "y");
  const std::int64_t vecs_per_row = hidden / 8;
  const std::int64_t segments = static_cast<std::int64_t>(ceil_div(vecs_per_row, 32 * kernels::kGatherVecs));
  EPMOE_CHECK(rows <= kI32Max && tokens * topk <= kI32Max && tokens * segments <= kI32Max,
              "expert_out {} / src_row {} too large for one launch", expert_out.describe(),
              src_row.describe());
  if (tokens == 0) return;

  kernels::GatherParams p{};
  p.rows = static_cast<const uint4*>(expert_out.data);
  p.num_rows = static_cast<std::uint32_t>(rows);
  p.src_row = static_cast<const std::int32_t*>(src_row.data);
  p.weights = static_cast<const float*>(topk_weights.data);
  p.tokens = static_cast<std::uint32_t>(tokens);
  p.topk = static_cast<std::uint32_t>(topk);
  p.vecs_per_row = static_cast<std::uint32_t>(vecs_per_row);
  p.segments = static_cast<std::uint32_t>(segments);
  p.y = static_cast<uint4*>(y.data);
  constexpr auto kernel = &kernels::gather_weighted_kernel;
  const unsigned grid =
      grid_for<kernel>(ceil_div(static_cast<std::uint64_t>(tokens * segments), kernels::kGatherWarps),
                       kernels::kGatherThreads);
  kernel<<<grid, kernels::kGatherThreads, 0, stream>>>(p);
  EPMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace epmoe::cuda
