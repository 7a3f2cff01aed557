// Kernel launches with Hopper's launch attributes (cudaLaunchKernelEx): kernel<<<grid, threads, smem,
// stream>>>(args...) as
//  - a programmatic dependent launch when `dependent` (the stream's previous work is one of our
//    kernels): its blocks may be scheduled while that kernel runs and must call
//    ptx::grid_dependency_wait (cuda/ptx.cuh) before reading what it wrote. The first kernel of a call
//    is launched plainly, so that whatever the caller enqueued before it (a copy, a memset) is simply
//    waited for;
//  - thread-block clusters of `cluster` blocks (> 1; grid a multiple of it).
#pragma once

#include <cstddef>
#include <utility>

#include <cuda_runtime_api.h>

#include "epmoe/cuda/launch.hpp"

namespace epmoe::cuda {

struct LaunchExtras {
  std::size_t smem = 0;    // dynamic shared memory, bytes
  bool dependent = false;  // programmatic dependent launch
  unsigned cluster = 1;    // blocks per cluster (1: no cluster attribute)
};

template <class... Params, class... Args>
void launch_ex(void (*kernel)(Params...), unsigned grid, unsigned threads, const LaunchExtras& extras,
               cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = extras.smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  unsigned count = 0;
  attribute[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[count++].val.programmaticStreamSerializationAllowed = extras.dependent ? 1 : 0;
  if (extras.cluster > 1) {
    attribute[count].id = cudaLaunchAttributeClusterDimension;
    attribute[count++].val.clusterDim = {extras.cluster, 1, 1};
  }
  config.attrs = attribute;
  config.numAttrs = count;
  EPMOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

template <class... Params, class... Args>
void launch_pdl(bool dependent, void (*kernel)(Params...), unsigned grid, unsigned threads,
                cudaStream_t stream, Args&&... args) {
  launch_ex(kernel, grid, threads, LaunchExtras{0, dependent, 1}, stream, std::forward<Args>(args)...);
}

}  // namespace epmoe::cuda
