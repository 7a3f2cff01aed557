// The FP8 grouped GEMM's automatic choices (host functions, no GPU needed).
#include <gtest/gtest.h>

#include "epmoe/cuda/grouped_gemm.hpp"
#include "epmoe/error.hpp"

namespace epmoe::cuda {
namespace {

TEST(GroupedGemmSplitTiles, SplitsShortKAndSmallGroupsContiguousAndSmallGroupsMasked) {
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
  // Masked: groups expected to hold 1-64 rows, at any K; more, unknown (0) or no groups never.
  EXPECT_TRUE(grouped_gemm_split_tiles(true, 32 * 32, 32, 7168));
  EXPECT_TRUE(grouped_gemm_split_tiles(true, 32 * 64, 32, 2048));
  EXPECT_TRUE(grouped_gemm_split_tiles(true, 128 * 1, 128, 7168));
  EXPECT_FALSE(grouped_gemm_split_tiles(true, 32 * 64 + 1, 32, 7168));
  EXPECT_FALSE(grouped_gemm_split_tiles(true, 32 * 320, 32, 2048));
  EXPECT_FALSE(grouped_gemm_split_tiles(true, 0, 32, 2048));
  EXPECT_FALSE(grouped_gemm_split_tiles(true, 64, 0, 2048));
  EXPECT_FALSE(grouped_gemm_split_tiles(false, 128, 0, 2048));
}

TEST(GroupedGemmBorrowEpilogue, PerLayoutAndK) {
  // Masked DeepSeek-V3 down (K = 2048) and shorter: v31 (wave 0 staged, no borrowed stage).
  EXPECT_EQ(grouped_gemm_borrow_epilogue(true, 2048), 2);
  EXPECT_EQ(grouped_gemm_borrow_epilogue(true, 512), 2);
  // Masked gate_up (K = 7168): v12; every contiguous K: v33 (v12 with wave 0 staged first).
  EXPECT_EQ(grouped_gemm_borrow_epilogue(true, 7168), 1);
  EXPECT_EQ(grouped_gemm_borrow_epilogue(true, 2176), 1);
  EXPECT_EQ(grouped_gemm_borrow_epilogue(false, 2048), 3);
  EXPECT_EQ(grouped_gemm_borrow_epilogue(false, 512), 3);
  EXPECT_EQ(grouped_gemm_borrow_epilogue(false, 7168), 3);
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

TEST(GroupedGemmSplitTail, ChunksByTheCostModel) {
  // K = 7168 with 128 x 256 tiles (quanta of 4 K blocks, 14 of them): 5 chunks (3 quanta each at
  // most, ~23.5 K blocks of cost against 56) wherever 5 fit; fewer where fewer fit; none of 1.
  EXPECT_EQ(grouped_gemm_split_tail_chunks(7168, 4, 5), 5);
  EXPECT_EQ(grouped_gemm_split_tail_chunks(7168, 4, 11), 5);
  EXPECT_EQ(grouped_gemm_split_tail_chunks(7168, 4, 15), 5);
  EXPECT_EQ(grouped_gemm_split_tail_chunks(7168, 4, 4), 4);
  EXPECT_EQ(grouped_gemm_split_tail_chunks(7168, 4, 2), 2);
  EXPECT_EQ(grouped_gemm_split_tail_chunks(7168, 4, 1), 1);
  EXPECT_EQ(grouped_gemm_split_tail_chunks(7168, 4, 0), 1);
  // 64 x 128 decode tiles at K = 7168 (quanta of 8, 7 of them): one quantum each where 7 fit.
  EXPECT_EQ(grouped_gemm_split_tail_chunks(7168, 8, 7), 7);
  EXPECT_EQ(grouped_gemm_split_tail_chunks(7168, 8, 5), 4);
  // K = 2048: the sum costs more than the chunks save (measured slower), whatever fits.
  EXPECT_EQ(grouped_gemm_split_tail_chunks(2048, 4, 15), 1);
  EXPECT_EQ(grouped_gemm_split_tail_chunks(2048, 1, 15), 1);
  EXPECT_THROW(grouped_gemm_split_tail_chunks(2048, 3, 4), Error);
  EXPECT_THROW(grouped_gemm_split_tail_chunks(100, 1, 4), Error);
}

TEST(GroupedGemmTile, HeuristicShapes) {
  // Masked decode (<= 8 rows per group, or unknown): 64 x 128.
  EXPECT_EQ(grouped_gemm_tile(true, 8, 4096).block_m, 64);
  EXPECT_EQ(grouped_gemm_tile(true, 8, 4096).block_n, 128);
  EXPECT_EQ(grouped_gemm_tile(true, 0, 7168).block_m, 64);
  // Masked 9-64 rows: 128 x 256 (split) where N allows, else 64 x 128; more: as contiguous.
  EXPECT_EQ(grouped_gemm_tile(true, 9, 4096).block_m, 128);
  EXPECT_EQ(grouped_gemm_tile(true, 16, 4096).block_n, 256);
  EXPECT_EQ(grouped_gemm_tile(true, 32, 7168).block_n, 256);
  EXPECT_EQ(grouped_gemm_tile(true, 64, 4096).block_m, 128);
  EXPECT_EQ(grouped_gemm_tile(true, 32, 1664).block_m, 64);
  EXPECT_EQ(grouped_gemm_tile(true, 32, 1664).block_n, 128);
  EXPECT_EQ(grouped_gemm_tile(true, 65, 1664).block_m, 128);
  EXPECT_EQ(grouped_gemm_tile(true, 65, 1664).block_n, 128);
  EXPECT_EQ(grouped_gemm_tile(false, 0, 4096).block_n, 256);
  EXPECT_EQ(grouped_gemm_tile(false, 0, 1536).block_n, 256);
  EXPECT_EQ(grouped_gemm_tile(false, 0, 1664).block_n, 128);
}

}  // namespace
}  // namespace epmoe::cuda
