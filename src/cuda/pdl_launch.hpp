// Programmatic dependent launch from the host: kernel<<<grid, threads, 0, stream>>>(args...), with the
// stream-serialization attribute when `dependent` (the stream's previous work is one of our kernels).
// Its blocks may then be scheduled while that kernel runs; they must call ptx::grid_dependency_wait
// (cuda/ptx.cuh) before reading what it wrote. The first kernel of a call is launched plainly, so that
// whatever the caller enqueued before it (a copy, a memset) is simply waited for.
#pragma once

#include <utility>

#include <cuda_runtime_api.h>

#include "epmoe/cuda/launch.hpp"

namespace epmoe::cuda {

// The launch attribute that makes a launch a programmatic dependent one (when `allowed`).
inline cudaLaunchAttribute programmatic_serialization(bool allowed) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = allowed ? 1 : 0;
  return attribute;
}

template <class... Params, class... Args>
void launch_pdl(bool dependent, void (*kernel)(Params...), unsigned grid, unsigned threads,
                cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attribute[1] = {programmatic_serialization(dependent)};
  config.attrs = attribute;
  config.numAttrs = 1;
  EPMOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

}  // namespace epmoe::cuda
