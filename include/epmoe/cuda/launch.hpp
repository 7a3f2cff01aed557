// Kernel-launch essentials: the launch check and the device properties that size grids.
#pragma once

#include <cstddef>

#include "epmoe/cuda/runtime.hpp"

// After a <<<...>>> launch: throws epmoe::Error (with file:line) on a launch error (bad
// configuration, too many resources). Errors raised while the kernel runs surface at the next
// synchronising call.
#define EPMOE_CUDA_CHECK_LAUNCH() EPMOE_CUDA_CHECK(cudaGetLastError())

namespace epmoe::cuda {

// Properties of one device, read once per device and cached (cheap to call on hot paths).
struct DeviceProps {
  int device = 0;
  int sm_count = 0;  // multiprocessors
  int max_threads_per_sm = 0;
  std::size_t l2_bytes = 0;      // L2 cache size
  std::size_t global_bytes = 0;  // device memory
  int cc_major = 0;
  int cc_minor = 0;
  char name[256] = {};
};

// The current device (cudaGetDevice).
int current_device();
// Properties of `device` (default: the current device). Throws when there is no such device.
const DeviceProps& device_props(int device = -1);

}  // namespace epmoe::cuda
