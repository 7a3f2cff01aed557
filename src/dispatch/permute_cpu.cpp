// Expert permutation and weighted gather on the CPU (epmoe/permute.hpp): the definitions the GPU
// kernels (permute.cu) are checked against byte for byte.
#include "epmoe/permute.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string_view>
#include <utility>
#include <vector>

#include "epmoe/dispatch.hpp"

namespace epmoe {

static_assert(kPermuteAlign == kContiguousAlign);

std::int64_t contiguous_capacity(std::int64_t entries, int num_experts) {
  // (The bound keeps (entries + 127 n) and blocks x 128 inside int64.)
  constexpr std::int64_t kMaxEntries = std::int64_t{1} << 53;
  EPMOE_CHECK(entries >= 0 && entries <= kMaxEntries,
              "contiguous_capacity: entries must be in [0, 2^53], got {}", entries);
  EPMOE_CHECK(num_experts > 0, "contiguous_capacity: num_experts must be > 0, got {}", num_experts);
  // Σ_e ceil(c_e / 128) blocks over the n <= min(E, entries) non-empty experts with Σ c_e = entries:
  // at most (entries + 127 n) / 128, and at most one block per entry.
  const std::int64_t busy = std::min<std::int64_t>(num_experts, entries);
  const std::int64_t blocks = std::min(entries, (entries + (kPermuteAlign - 1) * busy) / kPermuteAlign);
  return blocks * kPermuteAlign;
}

namespace {

// No output of a permutation may share memory with its inputs (it writes while it reads them).
void expect_outputs_apart(const PermuteInput& in,
                          std::initializer_list<std::pair<TensorView, const char*>> outs) {
  for (const auto& [out, name] : outs) {
    expect_disjoint(out, name, in.x, "x");
    expect_disjoint(out, name, in.x_scales, "x_scales");
    expect_disjoint(out, name, in.topk_ids, "topk_ids");
  }
}

struct Shape {
  std::int64_t tokens, hidden, groups;
  int topk;
  bool fp8;
};

Shape check_input(const PermuteInput& in) {
  expect_rank(in.x, 2, "x");
  EPMOE_CHECK(in.x.dtype == DType::fp8_e4m3 || in.x.dtype == DType::bf16,
              "x must have dtype fp8_e4m3 or bf16, got {}", in.x.describe());
  expect_host(in.x, "x");
  Shape s{in.x.shape[0], in.x.shape[1], in.x.shape[1] / 128, 0, in.x.dtype == DType::fp8_e4m3};
  EPMOE_CHECK(s.hidden > 0 && s.hidden % 128 == 0, "x: H = {} must be a positive multiple of 128", s.hidden);
  if (s.fp8) {
    expect_dtype(in.x_scales, DType::f32, "x_scales");
    expect_shape(in.x_scales, {s.tokens, s.groups}, "x_scales");
    expect_host(in.x_scales, "x_scales");
  }
  expect_rank(in.topk_ids, 2, "topk_ids");
  expect_dtype(in.topk_ids, DType::i32, "topk_ids");
  EPMOE_CHECK(in.topk_ids.shape[0] == s.tokens, "topk_ids must have {} rows (x's tokens), got {}", s.tokens,
              in.topk_ids.describe());
  expect_host(in.topk_ids, "topk_ids");
  EPMOE_CHECK(in.topk_ids.shape[1] >= 1 && s.tokens * in.topk_ids.shape[1] <= INT32_MAX,
              "topk_ids {}: K must be positive and T * K must fit in i32", in.topk_ids.describe());
  s.topk = static_cast<int>(in.topk_ids.shape[1]);
  return s;
}

// Entries of each expert, in entry order. Throws on an id outside [-1, E).
std::vector<std::vector<std::int32_t>> entries_per_expert(const PermuteInput& in, const Shape& s,
                                                          int experts) {
  std::vector<std::vector<std::int32_t>> lists(static_cast<std::size_t>(experts));
  const std::int32_t* ids = in.topk_ids.as<std::int32_t>();
  const std::int64_t n = s.tokens * s.topk;
  for (std::int64_t i = 0; i < n; ++i) {
    EPMOE_CHECK(ids[i] >= -1 && ids[i] < experts,
                "topk_ids[{}, {}] = {} must be -1 or a local expert in [0, {})", i / s.topk, i % s.topk,
                ids[i], experts);
    if (ids[i] >= 0) lists[static_cast<std::size_t>(ids[i])].push_back(static_cast<std::int32_t>(i));
  }
  return lists;
}

// Copies entry i's token (row and scales) into row `row` of rows / scales (flattened).
void copy_entry(const PermuteInput& in, const Shape& s, std::int32_t entry, std::int64_t row,
                const TensorView& rows, const TensorView& scales) {
  const std::int64_t t = entry / s.topk;
  const std::size_t row_bytes = static_cast<std::size_t>(s.hidden) * dtype_size(in.x.dtype);
  std::memcpy(static_cast<std::byte*>(rows.data) + row * static_cast<std::int64_t>(row_bytes),
              static_cast<const std::byte*>(in.x.data) + t * static_cast<std::int64_t>(row_bytes), row_bytes);
  if (s.fp8)
    std::memcpy(scales.as<float>() + row * s.groups, in.x_scales.as<float>() + t * s.groups,
                static_cast<std::size_t>(s.groups) * sizeof(float));
}

void check_i32(const TensorView& t, std::initializer_list<std::int64_t> shape, std::string_view name) {
  expect_dtype(t, DType::i32, name);
  expect_shape(t, shape, name);
  expect_host(t, name);
}

}  // namespace

void permute_contiguous_cpu(const PermuteInput& in, const ContiguousLayout& out) {
  const Shape s = check_input(in);
  expect_rank(out.expert_offsets, 1, "expert_offsets");
  const std::int64_t experts = out.expert_offsets.shape[0] - 1;
  EPMOE_CHECK(experts >= 1, "expert_offsets must hold E + 1 >= 2 entries, got {}",
              out.expert_offsets.describe());
  check_i32(out.expert_offsets, {experts + 1}, "expert_offsets");
  check_i32(out.counts, {experts}, "counts");
  expect_rank(out.rows, 2, "rows");
  const std::int64_t m = out.rows.shape[0];
  expect_dtype(out.rows, in.x.dtype, "rows");
  expect_shape(out.rows, {m, s.hidden}, "rows");
  expect_host(out.rows, "rows");
  if (s.fp8) {
    expect_dtype(out.scales, DType::f32, "scales");
    expect_shape(out.scales, {m, s.groups}, "scales");
    expect_host(out.scales, "scales");
  }
  check_i32(out.m_indices, {m}, "m_indices");
  check_i32(out.row_src, {m}, "row_src");
  check_i32(out.src_row, {s.tokens, s.topk}, "src_row");
  expect_outputs_apart(in, {{out.rows, "rows"},
                            {out.scales, "scales"},
                            {out.m_indices, "m_indices"},
                            {out.row_src, "row_src"},
                            {out.src_row, "src_row"},
                            {out.expert_offsets, "expert_offsets"},
                            {out.counts, "counts"}});

  const auto lists = entries_per_expert(in, s, static_cast<int>(experts));
  std::vector<std::int64_t> offsets(static_cast<std::size_t>(experts) + 1, 0);
  for (std::int64_t e = 0; e < experts; ++e) {
    const auto n = static_cast<std::int64_t>(lists[static_cast<std::size_t>(e)].size());
    offsets[static_cast<std::size_t>(e) + 1] =
        offsets[static_cast<std::size_t>(e)] + (n + kPermuteAlign - 1) / kPermuteAlign * kPermuteAlign;
  }
  EPMOE_CHECK(offsets.back() <= m, "rows: the contiguous layout needs {} rows here, rows has {}",
              offsets.back(), m);

  std::int32_t* m_indices = out.m_indices.as<std::int32_t>();
  std::int32_t* row_src = out.row_src.as<std::int32_t>();
  std::int32_t* src_row = out.src_row.as<std::int32_t>();
  std::fill_n(m_indices, m, -1);
  std::fill_n(row_src, m, -1);
  std::fill_n(src_row, s.tokens * s.topk, -1);
  for (std::int64_t e = 0; e < experts; ++e) {
    const auto& list = lists[static_cast<std::size_t>(e)];
    out.expert_offsets.as<std::int32_t>()[e] =
        static_cast<std::int32_t>(offsets[static_cast<std::size_t>(e)]);
    out.counts.as<std::int32_t>()[e] = static_cast<std::int32_t>(list.size());
    std::int64_t row = offsets[static_cast<std::size_t>(e)];
    for (const std::int32_t entry : list) {
      copy_entry(in, s, entry, row, out.rows, out.scales);
      m_indices[row] = static_cast<std::int32_t>(e);
      row_src[row] = entry;
      src_row[entry] = static_cast<std::int32_t>(row);
      ++row;
    }
  }
  out.expert_offsets.as<std::int32_t>()[experts] = static_cast<std::int32_t>(offsets.back());
}

void permute_masked_cpu(const PermuteInput& in, const MaskedLayout& out) {
  const Shape s = check_input(in);
  expect_rank(out.masked_m, 1, "masked_m");
  const std::int64_t experts = out.masked_m.shape[0];
  EPMOE_CHECK(experts >= 1, "masked_m must hold E >= 1 entries, got {}", out.masked_m.describe());
  check_i32(out.masked_m, {experts}, "masked_m");
  expect_rank(out.rows, 3, "rows");
  const std::int64_t m_max = out.rows.shape[1];
  expect_dtype(out.rows, in.x.dtype, "rows");
  expect_shape(out.rows, {experts, m_max, s.hidden}, "rows");
  expect_host(out.rows, "rows");
  if (s.fp8) {
    expect_dtype(out.scales, DType::f32, "scales");
    expect_shape(out.scales, {experts, m_max, s.groups}, "scales");
    expect_host(out.scales, "scales");
  }
  check_i32(out.row_src, {experts, m_max}, "row_src");
  check_i32(out.src_row, {s.tokens, s.topk}, "src_row");
  expect_outputs_apart(in, {{out.rows, "rows"},
                            {out.scales, "scales"},
                            {out.masked_m, "masked_m"},
                            {out.row_src, "row_src"},
                            {out.src_row, "src_row"}});

  const auto lists = entries_per_expert(in, s, static_cast<int>(experts));
  for (std::int64_t e = 0; e < experts; ++e) {
    const auto n = static_cast<std::int64_t>(lists[static_cast<std::size_t>(e)].size());
    EPMOE_CHECK(n <= m_max, "local expert {} has {} entries, more than M_max = {}", e, n, m_max);
  }
  std::int32_t* row_src = out.row_src.as<std::int32_t>();
  std::int32_t* src_row = out.src_row.as<std::int32_t>();
  std::fill_n(row_src, experts * m_max, -1);
  std::fill_n(src_row, s.tokens * s.topk, -1);
  for (std::int64_t e = 0; e < experts; ++e) {
    const auto& list = lists[static_cast<std::size_t>(e)];
    out.masked_m.as<std::int32_t>()[e] = static_cast<std::int32_t>(list.size());
    std::int64_t row = e * m_max;
    for (const std::int32_t entry : list) {
      copy_entry(in, s, entry, row, out.rows, out.scales);
      row_src[row] = entry;
      src_row[entry] = static_cast<std::int32_t>(row);
      ++row;
    }
  }
}

void gather_weighted_cpu(TensorView expert_out, TensorView src_row, TensorView topk_weights, TensorView y) {
  EPMOE_CHECK(expert_out.rank == 2 || expert_out.rank == 3, "expert_out must have rank 2 or 3, got {}",
              expert_out.describe());
  expect_dtype(expert_out, DType::bf16, "expert_out");
  expect_host(expert_out, "expert_out");
  const std::int64_t hidden = expert_out.shape[expert_out.rank - 1];
  EPMOE_CHECK(hidden > 0, "expert_out: H must be positive, got {}", expert_out.describe());
  const std::int64_t rows = expert_out.numel() / hidden;
  expect_rank(src_row, 2, "src_row");
  expect_dtype(src_row, DType::i32, "src_row");
  expect_host(src_row, "src_row");
  const std::int64_t tokens = src_row.shape[0], topk = src_row.shape[1];
  expect_dtype(topk_weights, DType::f32, "topk_weights");
  expect_shape(topk_weights, {tokens, topk}, "topk_weights");
  expect_host(topk_weights, "topk_weights");
  expect_dtype(y, DType::bf16, "y");
  expect_shape(y, {tokens, hidden}, "y");
  expect_host(y, "y");
  expect_finite(topk_weights, "topk_weights");
  expect_disjoint(y, "y", expert_out, "expert_out");
  expect_disjoint(y, "y", src_row, "src_row");
  expect_disjoint(y, "y", topk_weights, "topk_weights");

  const std::int32_t* map = src_row.as<std::int32_t>();
  for (std::int64_t i = 0; i < tokens * topk; ++i)
    EPMOE_CHECK(map[i] >= -1 && map[i] < rows, "src_row[{}, {}] = {} must be -1 or a row in [0, {})",
                i / topk, i % topk, map[i], rows);
  const bf16* out = expert_out.as<bf16>();
  const float* w = topk_weights.as<float>();
  std::vector<float> acc(static_cast<std::size_t>(hidden));
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (std::int64_t k = 0; k < topk; ++k) {
      const std::int32_t row = map[t * topk + k];
      if (row < 0) continue;
      const float wk = w[t * topk + k];
      const bf16* v = out + row * hidden;
      for (std::int64_t h = 0; h < hidden; ++h) {
        const float product = wk * v[h].to_float();
        acc[static_cast<std::size_t>(h)] = acc[static_cast<std::size_t>(h)] + product;
      }
    }
    bf16* dst = y.as<bf16>() + t * hidden;
    for (std::int64_t h = 0; h < hidden; ++h) dst[h] = bf16::from_float(acc[static_cast<std::size_t>(h)]);
  }
}

}  // namespace epmoe
