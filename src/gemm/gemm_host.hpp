// Host pieces both grouped GEMM launchers use (fp8_grouped_gemm.cu, w4a8_grouped_gemm.cu): the
// aligned-tensor argument check, the Hopper check (their TMA maps: cuda/tma_map.hpp).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <string_view>

#include "cuda/tma_map.hpp"
#include "epmoe/cuda/launch.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe::cuda::gemm_host {

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
