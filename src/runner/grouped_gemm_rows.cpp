#include "runner/grouped_gemm_rows.hpp"

namespace epmoe::detail {

GroupRows rows_from_m_indices(const TensorView& m_indices, std::int64_t M, std::int64_t G) {
  expect_dtype(m_indices, DType::i32, "m_indices");
  expect_device(m_indices, Device::cpu, "m_indices");
  expect_contiguous(m_indices, "m_indices");
  expect_shape(m_indices, {M}, "m_indices");
  GroupRows rows(static_cast<std::size_t>(G));
  const std::int32_t* ids = m_indices.as<std::int32_t>();
  // The contiguous layout pads each group to 128 rows (design.md §3), and the GPU kernels take each
  // 128-row block (from row 0) as one group's: a block that mixes groups is refused here, where the GPU
  // would leave some of its rows unwritten, so that the reference never accepts what they cannot run.
  std::int32_t block_group = -1;
  for (std::int64_t m = 0; m < M; ++m) {
    EPMOE_CHECK(ids[m] >= -1 && ids[m] < G, "m_indices[{}] = {} must be -1 or a group in [0, {})", m, ids[m],
                G);
    if (m % 128 == 0) block_group = -1;
    if (ids[m] < 0) continue;
    EPMOE_CHECK(
        block_group < 0 || ids[m] == block_group,
        "m_indices[{}] = {} shares the 128-row block of rows [{}, {}) with group {}: each group's rows "
        "must be padded to a multiple of 128 (-1 rows), one group per block",
        m, ids[m], m / 128 * 128, m / 128 * 128 + 128, block_group);
    block_group = ids[m];
    rows[static_cast<std::size_t>(ids[m])].push_back(m);
  }
  return rows;
}

GroupRows rows_from_masked_m(const TensorView& masked_m, std::int64_t G, std::int64_t M_max) {
  expect_dtype(masked_m, DType::i32, "masked_m");
  expect_device(masked_m, Device::cpu, "masked_m");
  expect_contiguous(masked_m, "masked_m");
  expect_shape(masked_m, {G}, "masked_m");
  GroupRows rows(static_cast<std::size_t>(G));
  const std::int32_t* counts = masked_m.as<std::int32_t>();
  for (std::int64_t g = 0; g < G; ++g) {
    EPMOE_CHECK(counts[g] >= 0 && counts[g] <= M_max, "masked_m[{}] = {} must be in [0, {}]", g, counts[g],
                M_max);
    for (std::int64_t r = 0; r < counts[g]; ++r) rows[static_cast<std::size_t>(g)].push_back(g * M_max + r);
  }
  return rows;
}

}  // namespace epmoe::detail
