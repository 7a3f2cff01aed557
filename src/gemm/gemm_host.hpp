// Host pieces both grouped GEMM launchers use (fp8_grouped_gemm.cu, w4a8_grouped_gemm.cu): the TMA
// maps of their byte-matrix operands, the aligned-tensor argument check, the Hopper check.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <string_view>

#include "epmoe/cuda/launch.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe::cuda::gemm_host {

// A 2D map over a row-major byte matrix [rows, cols] (cols contiguous), box [box_rows, 128 bytes]
// (one K block of FP8 / e4m3-converted operands), 128-byte swizzle (the wgmma K-major layout),
// out-of-bounds rows read as zeros. cuTensorMapEncodeTiled is looked up through the runtime's
// driver entry point (cudaGetDriverEntryPointByVersion), so nothing links libcuda.
CUtensorMap make_tma_2d(const void* base, std::int64_t rows, std::int64_t cols, int box_rows,
                        std::string_view name, CUtensorMapL2promotion promotion);

// dtype, device, contiguity and the alignment of the data pointer, each named in the error.
void expect_aligned_tensor(const TensorView& t, DType dtype, Device device, std::string_view name,
                           std::uintptr_t alignment);

// Raises kKernel's dynamic shared-memory limit to `bytes` (needed above 48 KB), once per device.
template <auto kKernel>
void allow_dynamic_smem(int bytes) {
  static std::atomic<std::uint64_t> raised{0};
  const std::uint64_t bit = std::uint64_t{1} << (device_props().device % 64);
  if ((raised.load(std::memory_order_acquire) & bit) != 0) return;
  EPMOE_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  raised.fetch_or(bit, std::memory_order_acq_rel);
}

// Refuses anything but a Hopper GPU (sm_90), naming `what` (e.g. "the FP8 grouped GEMM").
void require_hopper(std::string_view what);

}  // namespace epmoe::cuda::gemm_host
