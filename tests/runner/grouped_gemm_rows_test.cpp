// The CPU grouped-GEMM references' row lists (src/runner/grouped_gemm_rows.cpp): which rows of A each
// group owns in the contiguous layout (-1 padding skipped, one group per 128-row block) and in the
// masked layout (the first masked_m[g] rows of group g), and the layouts the GPU kernels cannot run,
// refused with the offending entry named.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "expect_error.hpp"
#include "runner/grouped_gemm_rows.hpp"

namespace epmoe::detail {
namespace {

using testing::expect_error_mentions;

HostTensor i32_tensor(const std::vector<std::int32_t>& values) {
  HostTensor t(DType::i32, {static_cast<std::int64_t>(values.size())});
  std::copy(values.begin(), values.end(), t.data<std::int32_t>());
  return t;
}

TEST(GroupedGemmRows, ContiguousRowsSkipPaddingAndEmptyGroups) {
  // Group 2 in block 0 (rows 0-2), group 0 in blocks 1-2 (rows 128-299), group 1 empty, group 3 last.
  std::vector<std::int32_t> ids(512, -1);
  for (int m = 0; m < 3; ++m) ids[static_cast<std::size_t>(m)] = 2;
  for (int m = 128; m < 300; ++m) ids[static_cast<std::size_t>(m)] = 0;
  ids[384] = 3;
  ids[511] = 3;
  const GroupRows rows = rows_from_m_indices(i32_tensor(ids).view(), 512, 4);
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_EQ(rows[2], (std::vector<std::int64_t>{0, 1, 2}));
  ASSERT_EQ(rows[0].size(), 172u);
  EXPECT_EQ(rows[0].front(), 128);
  EXPECT_EQ(rows[0].back(), 299);
  EXPECT_TRUE(rows[1].empty());
  EXPECT_EQ(rows[3], (std::vector<std::int64_t>{384, 511}));
}

TEST(GroupedGemmRows, ContiguousLayoutsTheKernelsCannotRunAreRefused) {
  std::vector<std::int32_t> ids(256, -1);
  ids[5] = 4;  // G = 4: ids lie in [0, 4)
  expect_error_mentions([&] { (void)rows_from_m_indices(i32_tensor(ids).view(), 256, 4); },
                        "m_indices[5] = 4 must be -1 or a group in [0, 4)");
  ids[5] = -2;
  expect_error_mentions([&] { (void)rows_from_m_indices(i32_tensor(ids).view(), 256, 4); },
                        "m_indices[5] = -2 must be -1");
  ids[5] = 1;
  ids[127] = 2;  // a second group in block 0, behind padding
  expect_error_mentions([&] { (void)rows_from_m_indices(i32_tensor(ids).view(), 256, 4); },
                        {"m_indices[127] = 2 shares the 128-row block of rows [0, 128) with group 1"});
  ids[127] = -1;
  ids[128] = 2;  // the next block may hold another group
  EXPECT_EQ(rows_from_m_indices(i32_tensor(ids).view(), 256, 4)[2], (std::vector<std::int64_t>{128}));
  expect_error_mentions([&] { (void)rows_from_m_indices(i32_tensor(ids).view(), 255, 4); }, "m_indices");
}

TEST(GroupedGemmRows, MaskedRowsAreEachGroupsFirstMaskedM) {
  const GroupRows rows = rows_from_masked_m(i32_tensor({2, 0, 5}).view(), 3, 5);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0], (std::vector<std::int64_t>{0, 1}));
  EXPECT_TRUE(rows[1].empty());
  EXPECT_EQ(rows[2], (std::vector<std::int64_t>{10, 11, 12, 13, 14}));
  expect_error_mentions(
      [] {
        (void)rows_from_masked_m(i32_tensor({2, 6, 0}).view(), 3, 5);
      },
      "masked_m[1] = 6 must be in [0, 5]");
  expect_error_mentions(
      [] {
        (void)rows_from_masked_m(i32_tensor({-1, 0, 0}).view(), 3, 5);
      },
      "masked_m[0] = -1 must be in [0, 5]");
  expect_error_mentions([] { (void)rows_from_masked_m(i32_tensor({1, 1}).view(), 3, 5); }, "masked_m");
}

}  // namespace
}  // namespace epmoe::detail
