// CUDA runtime essentials: error checking with file:line and device discovery.
#pragma once

#include <string>

#include <cuda_runtime_api.h>

#include "epmoe/error.hpp"

namespace epmoe::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t status, const char* expr, const char* file, int line);

// Number of usable CUDA devices; 0 when there is no driver or no GPU (never throws).
int device_count();
// The same count for a process that itself will not use CUDA (a launcher of one process per GPU):
// without CUDA_VISIBLE_DEVICES, the GPUs the driver lists in /proc/driver/nvidia/gpus, which costs
// no cuInit (~0.2 s of the first forward's 1 s budget); otherwise, or where the driver lists none,
// device_count(). Never throws.
int device_count_without_cuda_init();
// The GPUs the driver lists in /proc/driver/nvidia/gpus, whatever CUDA_VISIBLE_DEVICES says; no
// cuInit; 0 without the driver. Never throws.
int listed_gpu_count();
// "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)" or "no GPU".
std::string device_description(int device = 0);

}  // namespace epmoe::cuda

#define EPMOE_CUDA_CHECK(expr)                                                   \
  do {                                                                           \
    const cudaError_t epmoe_status_ = (expr);                                    \
    if (epmoe_status_ != cudaSuccess) [[unlikely]] {                             \
      ::epmoe::cuda::throw_cuda_error(epmoe_status_, #expr, __FILE__, __LINE__); \
    }                                                                            \
  } while (0)
