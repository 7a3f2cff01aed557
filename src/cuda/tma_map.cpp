#include "cuda/tma_map.hpp"

#include <cudaTypedefs.h>

#include "cuda/driver_entry.hpp"
#include "epmoe/cuda/launch.hpp"

namespace epmoe::cuda {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const auto fn =
      driver_entry_point<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled", 12000);
  return fn;
}

}  // namespace

namespace {

CUtensorMap encode_2d_bytes(const void* base, std::int64_t rows, std::int64_t cols, int box_cols,
                            int box_rows, CUtensorMapSwizzle swizzle, CUtensorMapL2promotion promotion,
                            std::string_view name) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols)};  // bytes between rows
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<void*>(base), dims,
                                    strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                    promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  EPMOE_CHECK(r == CUDA_SUCCESS,
              "cuTensorMapEncodeTiled failed for {} ([{}, {}] bytes, box {} rows x {} bytes): error {}", name,
              rows, cols, box_rows, box_cols, static_cast<int>(r));
  return map;
}

}  // namespace

CUtensorMap make_tma_2d(const void* base, std::int64_t rows, std::int64_t cols, int box_rows,
                        std::string_view name, CUtensorMapL2promotion promotion) {
  // One 128-byte swizzle row of columns.
  return encode_2d_bytes(base, rows, cols, 128, box_rows, CU_TENSOR_MAP_SWIZZLE_128B, promotion, name);
}

bool make_tma_row_groups(void* base, std::int64_t rows, std::int64_t row_bytes, int box_row_groups,
                         CUtensorMap& map) {
  if (rows <= 0 || rows % 16 != 0 || row_bytes <= 0 || row_bytes % 256 != 0) return false;
  const cuuint64_t dims[4] = {128, 16, static_cast<cuuint64_t>(row_bytes / 128),
                              static_cast<cuuint64_t>(rows / 16)};
  // Bytes between rows, column blocks, row groups (not increasing: the driver accepts or refuses).
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(row_bytes), 128,
                                 static_cast<cuuint64_t>(16 * row_bytes)};
  const cuuint32_t box[4] = {128, 16, 2, static_cast<cuuint32_t>(box_row_groups)};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  CUtensorMap m{};
  const CUresult r =
      encode_tiled()(&m, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, base, dims, strides, box, element_strides,
                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                     CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return false;
  map = m;
  return true;
}

}  // namespace epmoe::cuda
