// The FP8 grouped GEMM's automatic choices (host functions, no GPU needed).
#include <gtest/gtest.h>

#include "epmoe/cuda/grouped_gemm.hpp"

namespace epmoe::cuda {
namespace {

TEST(GroupedGemmSplitTiles, SplitsOnlyShortKAndSmallGroupsInTheContiguousLayout) {
  // DeepSeek-V3 down (K = 2048): 32 groups of ~256 rows and 128 of ~128 split; 32 of ~1024 do not.
  EXPECT_TRUE(grouped_gemm_split_tiles(false, 32 * 320, 32, 2048));
  EXPECT_TRUE(grouped_gemm_split_tiles(false, 128 * 192, 128, 2048));
  EXPECT_FALSE(grouped_gemm_split_tiles(false, 32 * 1152, 32, 2048));
  // The edge: 512 rows per group on average.
  EXPECT_TRUE(grouped_gemm_split_tiles(false, 512 * 4, 4, 2048));
  EXPECT_FALSE(grouped_gemm_split_tiles(false, 512 * 4 + 1, 4, 2048));
  // gate_up (K = 7168) never; a shorter K does.
  EXPECT_FALSE(grouped_gemm_split_tiles(false, 32 * 320, 32, 7168));
  EXPECT_TRUE(grouped_gemm_split_tiles(false, 32 * 320, 32, 512));
  // The masked layout never; no groups never.
  EXPECT_FALSE(grouped_gemm_split_tiles(true, 32 * 320, 32, 2048));
  EXPECT_FALSE(grouped_gemm_split_tiles(false, 128, 0, 2048));
}

TEST(GroupedGemmBorrowEpilogue, OffOnlyInTheMaskedLayoutAtShortK) {
  // Masked DeepSeek-V3 down (K = 2048) and shorter: the consumers' own stores.
  EXPECT_FALSE(grouped_gemm_borrow_epilogue(true, 2048));
  EXPECT_FALSE(grouped_gemm_borrow_epilogue(true, 512));
  // Masked gate_up (K = 7168), and every contiguous K: v12.
  EXPECT_TRUE(grouped_gemm_borrow_epilogue(true, 7168));
  EXPECT_TRUE(grouped_gemm_borrow_epilogue(true, 2176));
  EXPECT_TRUE(grouped_gemm_borrow_epilogue(false, 2048));
  EXPECT_TRUE(grouped_gemm_borrow_epilogue(false, 7168));
}

TEST(GroupedGemmTileStore, AtShortKOrLargeContiguousGroups) {
  // K <= 2048: both layouts, any group size.
  EXPECT_TRUE(grouped_gemm_tile_store(false, 32 * 256, 32, 2048));
  EXPECT_TRUE(grouped_gemm_tile_store(true, 32 * 256, 32, 512));
  // K = 7168: contiguous groups of 512+ rows on average only.
  EXPECT_TRUE(grouped_gemm_tile_store(false, 8 * 4096, 8, 7168));
  EXPECT_TRUE(grouped_gemm_tile_store(false, 32 * 512, 32, 7168));
  EXPECT_FALSE(grouped_gemm_tile_store(false, 32 * 512 - 1, 32, 7168));
  EXPECT_FALSE(grouped_gemm_tile_store(false, 128 * 192, 128, 7168));
  EXPECT_FALSE(grouped_gemm_tile_store(true, 32 * 4096, 32, 7168));
  EXPECT_FALSE(grouped_gemm_tile_store(false, 32 * 256, 32, 2176));
  EXPECT_FALSE(grouped_gemm_tile_store(false, 0, 0, 7168));
}

TEST(GroupedGemmTile, HeuristicShapes) {
  EXPECT_EQ(grouped_gemm_tile(true, 16, 4096).block_m, 64);
  EXPECT_EQ(grouped_gemm_tile(true, 16, 4096).block_n, 128);
  EXPECT_EQ(grouped_gemm_tile(false, 0, 4096).block_n, 256);
  EXPECT_EQ(grouped_gemm_tile(false, 0, 1536).block_n, 256);
  EXPECT_EQ(grouped_gemm_tile(false, 0, 1664).block_n, 128);
}

}  // namespace
}  // namespace epmoe::cuda
