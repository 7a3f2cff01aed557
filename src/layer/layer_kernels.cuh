// Device code of the layer helpers: the bf16 add, copy and i32 fill kernels (host launchers in
// layer_kernels.cu).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "cuda/ptx.cuh"

namespace epmoe::layer_detail {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ std::uint32_t add_bf16x2(std::uint32_t a, std::uint32_t b) {
  const float2 fa = ptx::bf16x2_to_float2(a), fb = ptx::bf16x2_to_float2(b);
  return ptx::pack_bf16x2(__fadd_rn(fa.x, fb.x), __fadd_rn(fa.y, fb.y));
}

__global__ void __launch_bounds__(kThreads)
    add_bf16_kernel(const uint4* __restrict__ a, const uint4* __restrict__ b, uint4* y,
                    std::uint64_t vectors) {
  for (std::uint64_t i = blockIdx.x * static_cast<std::uint64_t>(kThreads) + threadIdx.x; i < vectors;
       i += static_cast<std::uint64_t>(gridDim.x) * kThreads) {
    const uint4 va = a[i], vb = b[i];
    y[i] = make_uint4(add_bf16x2(va.x, vb.x), add_bf16x2(va.y, vb.y), add_bf16x2(va.z, vb.z),
                      add_bf16x2(va.w, vb.w));
  }
}

// T: uint4 (16-byte aligned tensors) or unsigned short (any bf16 tensor).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    copy_kernel(const T* __restrict__ src, T* __restrict__ dst, std::uint64_t n) {
  for (std::uint64_t i = blockIdx.x * static_cast<std::uint64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<std::uint64_t>(gridDim.x) * kThreads)
    dst[i] = src[i];
}

__global__ void fill_i32_kernel(std::int32_t* dst, std::int32_t value) {
  *dst = value;
}

}  // namespace
}  // namespace epmoe::layer_detail
