// Host pieces both grouped GEMM launchers use (fp8_grouped_gemm.cu, w4a8_grouped_gemm.cu): the
// Hopper check (their TMA maps: cuda/tma_map.hpp).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <string_view>
#include <vector>

#include "cuda/kernel_setup.hpp"
#include "cuda/tma_map.hpp"
#include "epmoe/cuda/grouped_gemm.hpp"
#include "epmoe/cuda/launch.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe::cuda::gemm_host {

// Raises kKernel's dynamic shared-memory limit to kBytes (needed above 48 KB), once per device: at
// the kernel's first launch (allow_dynamic_smem), or before, for every kernel at once, through
// prepare_kernels (cuda/kernel_setup.hpp), where the registration below puts it when the library loads.
template <auto kKernel, int kBytes>
struct DynamicSmem {
  static inline std::atomic<std::uint64_t> raised{0};  // bit d: done on device d % 64
  static void raise() {
    const std::uint64_t bit = std::uint64_t{1} << (device_props().device % 64);
    if ((raised.load(std::memory_order_acquire) & bit) != 0) return;
    EPMOE_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
    raised.fetch_or(bit, std::memory_order_acq_rel);
  }
  // (A limit above what the device allows is left to the launch, which reports it.)
  static void prepare() {
    int optin = 0;
    EPMOE_CUDA_CHECK(
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_props().device));
    if (kBytes <= optin) raise();
  }
  static inline const bool registered =
      register_kernel_setup("a GEMM kernel's shared-memory limit", &prepare);
};
template <auto kKernel, int kBytes>
void allow_dynamic_smem() {
  static_cast<void>(DynamicSmem<kKernel, kBytes>::registered);  // (instantiates the registration)
  DynamicSmem<kKernel, kBytes>::raise();
}

// Refuses anything but a Hopper GPU (sm_90), naming `what` (e.g. "the FP8 grouped GEMM").
void require_hopper(std::string_view what);

// The first `ctas` CTAs' stamps out of a kernel's stamp array `symbol` (3 words per CTA, max_ctas CTAs:
// GemmCtaStamps' order), which it then clears.
std::vector<GemmCtaStamps> take_cta_stamps(const void* symbol, int ctas, int max_ctas, cudaStream_t stream);

}  // namespace epmoe::cuda::gemm_host
