#include "gemm/gemm_host.hpp"

#include "epmoe/cuda/launch.hpp"

namespace epmoe::cuda::gemm_host {

void expect_aligned_tensor(const TensorView& t, DType dtype, Device device, std::string_view name,
                           std::uintptr_t alignment) {
  expect_dtype(t, dtype, name);
  expect_device(t, device, name);
  expect_contiguous(t, name);
  const auto address = reinterpret_cast<std::uintptr_t>(t.data);
  EPMOE_CHECK(address % alignment == 0, "{} must be {}-byte aligned, got {} at {:#x}", name, alignment,
              t.describe(), address);
}

void require_hopper(std::string_view what) {
  const DeviceProps& props = device_props();
  EPMOE_CHECK(props.cc_major == 9, "{} needs a Hopper GPU (sm_90), got {} (sm_{}{})", what, props.name,
              props.cc_major, props.cc_minor);
}

}  // namespace epmoe::cuda::gemm_host
