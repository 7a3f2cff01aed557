// Small kernels of the GPU layer (src/layer/gpu_layer.cpp).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "epmoe/tensor.hpp"

namespace epmoe::layer_detail {

// y = bf16(f32(a) + f32(b)) element-wise (the CPU layer's shared-expert add); bf16 tensors of equal
// numel (a multiple of 8), 16-byte aligned; y distinct from a and b (the kernel reads them as restrict).
void add_bf16(TensorView a, TensorView b, TensorView y, cudaStream_t stream);

// dst = src, contiguous bf16 tensors of equal numel on the device, by a kernel: a
// device-to-device cudaMemcpyAsync is on CUDA's implicit-synchronization list (it may wait for other
// streams' work), and with ranks sharing one GPU (loopback) a peer's dispatch may be waiting for this
// rank's next launch.
void copy_bf16(TensorView src, TensorView dst, cudaStream_t stream);

// dst[0] = value (i32 on the device): a constant that a captured graph re-writes on every replay.
void fill_i32(TensorView dst, std::int32_t value, cudaStream_t stream);

}  // namespace epmoe::layer_detail
