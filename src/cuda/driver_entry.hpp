// Driver API functions taken from the driver the CUDA runtime already loaded
// (cudaGetDriverEntryPointByVersion), so that nothing links libcuda.
#pragma once

#include <cuda_runtime_api.h>

#include <string_view>

#include "epmoe/cuda/runtime.hpp"
#include "epmoe/error.hpp"

namespace epmoe::cuda {

// The driver's `name` with the ABI of CUDA `version` (e.g. 12000), as Fn (its PFN_ type). Throws
// naming the function, followed by `remedy` (what the user can do instead), when the driver lacks it.
template <class Fn>
Fn driver_entry_point(const char* name, int version, std::string_view remedy = {}) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status{};
  EPMOE_CUDA_CHECK(
      cudaGetDriverEntryPointByVersion(name, &p, static_cast<unsigned>(version), cudaEnableDefault, &status));
  EPMOE_CHECK(status == cudaDriverEntryPointSuccess && p != nullptr,
              "the CUDA driver does not provide {} (status {}){}{}", name, static_cast<int>(status),
              remedy.empty() ? "" : "; ", remedy);
  return reinterpret_cast<Fn>(p);
}

}  // namespace epmoe::cuda
