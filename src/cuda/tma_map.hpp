// TMA tensor maps built on the host (the GEMMs' operands, the router's logits).
#pragma once

#include <cuda.h>

#include <cstdint>
#include <string_view>

namespace epmoe::cuda {

// A 2D map over a row-major byte matrix [rows, cols] (cols contiguous), box [box_rows, 128 bytes]
// (one K block of FP8 / e4m3-converted operands; a group of 32 f32 router logits), 128-byte swizzle
// (the wgmma K-major layout: 16-byte chunk c of box row r lands at r * 128 + 16 (c ^ (r % 8)) from a
// 1024-byte aligned destination), out-of-bounds rows read as zeros. cuTensorMapEncodeTiled is looked
// up through the runtime's driver entry point (cudaGetDriverEntryPointByVersion), so nothing links
// libcuda.
CUtensorMap make_tma_2d(const void* base, std::int64_t rows, std::int64_t cols, int box_rows,
                        std::string_view name, CUtensorMapL2promotion promotion);

// v19's output map: a row-major byte matrix [rows, row_bytes] (rows % 16 == 0, row_bytes % 256 == 0) as
// 4D (128 bytes, 16 rows, row_bytes / 128 column blocks, rows / 16 row groups), box (128, 16, 2,
// box_row_groups), 128-byte swizzle: in shared memory [row group][column block][16 rows][128 bytes], so
// that a consumer warp's 16 rows x 256 bytes are one 4 KB box of two conflict-free swizzled 2 KB halves.
// Returns false (map untouched) where the driver refuses it.
bool make_tma_row_groups(void* base, std::int64_t rows, std::int64_t row_bytes, int box_row_groups,
                         CUtensorMap& map);

}  // namespace epmoe::cuda
