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

// A 2D map over a row-major byte matrix [rows, cols], box [box_rows, box_cols bytes] (a multiple of
// 16), no swizzle (the box dense in shared memory: row r at r * box_cols), for TMA stores of staged
// output tiles; out-of-bounds parts of a box are not written.
CUtensorMap make_tma_2d_plain(void* base, std::int64_t rows, std::int64_t cols, int box_cols, int box_rows,
                              std::string_view name);

}  // namespace epmoe::cuda
