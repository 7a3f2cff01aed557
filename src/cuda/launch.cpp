#include "epmoe/cuda/launch.hpp"

#include <algorithm>
#include <array>
#include <iterator>
#include <mutex>

namespace epmoe::cuda {

int current_device() {
  int device = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

const DeviceProps& device_props(int device) {
  constexpr int kMaxDevices = 64;
  static std::array<DeviceProps, kMaxDevices> cache;
  static std::array<std::once_flag, kMaxDevices> once;
  if (device < 0) device = current_device();
  EPMOE_CHECK(device < kMaxDevices, "CUDA device {} is out of range (at most {} are supported)", device,
              kMaxDevices);
  std::call_once(once[device], [device] {
    cudaDeviceProp prop{};  // throws (and leaves the flag unset) when the device does not exist
    EPMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    DeviceProps& p = cache[device];
    p.device = device;
    p.sm_count = prop.multiProcessorCount;
    p.max_threads_per_sm = prop.maxThreadsPerMultiProcessor;
    p.l2_bytes = static_cast<std::size_t>(prop.l2CacheSize);
    p.global_bytes = prop.totalGlobalMem;
    p.cc_major = prop.major;
    p.cc_minor = prop.minor;
    static_assert(sizeof(p.name) == sizeof(prop.name));
    std::copy(std::begin(prop.name), std::end(prop.name), std::begin(p.name));
  });
  return cache[device];
}

}  // namespace epmoe::cuda
