#include <algorithm>

#include "epmoe/cuda/launch.hpp"
#include "layer/layer_kernels.cuh"
#include "layer/layer_kernels.hpp"

namespace epmoe::layer_detail {
namespace {

unsigned vector_blocks(std::uint64_t vectors) {
  const int sms = cuda::device_props().sm_count;
  return static_cast<unsigned>(std::min<std::uint64_t>((vectors + kThreads - 1) / kThreads, 8ull * sms));
}

}  // namespace

void add_bf16(TensorView a, TensorView b, TensorView y, cudaStream_t stream) {
  for (const auto& [t, name] : {std::pair{a, "a"}, {b, "b"}, {y, "y"}})
    expect_device_tensor(t, DType::bf16, name, 16);
  EPMOE_CHECK(a.numel() == b.numel() && a.numel() == y.numel(),
              "add_bf16: a, b and y must have equal sizes, got {}, {}, {}", a.numel(), b.numel(), y.numel());
  EPMOE_CHECK(a.numel() % 8 == 0, "add_bf16: the element count must be a multiple of 8, got {}", a.numel());
  const std::uint64_t vectors = static_cast<std::uint64_t>(a.numel()) / 8;
  if (vectors == 0) return;
  add_bf16_kernel<<<vector_blocks(vectors), kThreads, 0, stream>>>(static_cast<const uint4*>(a.data),
                                                                   static_cast<const uint4*>(b.data),
                                                                   static_cast<uint4*>(y.data), vectors);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void copy_bf16(TensorView src, TensorView dst, cudaStream_t stream) {
  for (const auto& [t, name] : {std::pair{src, "src"}, {dst, "dst"}})
    expect_device_tensor(t, DType::bf16, name, 2);
  EPMOE_CHECK(src.numel() == dst.numel(), "copy_bf16: src and dst must have equal sizes, got {} and {}",
              src.numel(), dst.numel());
  const auto n = static_cast<std::uint64_t>(src.numel());
  if (n == 0) return;
  const bool vectors = n % 8 == 0 && reinterpret_cast<std::uintptr_t>(src.data) % 16 == 0 &&
                       reinterpret_cast<std::uintptr_t>(dst.data) % 16 == 0;
  if (vectors) {
    copy_kernel<<<vector_blocks(n / 8), kThreads, 0, stream>>>(static_cast<const uint4*>(src.data),
                                                               static_cast<uint4*>(dst.data), n / 8);
  } else {
    copy_kernel<<<vector_blocks(n), kThreads, 0, stream>>>(static_cast<const unsigned short*>(src.data),
                                                           static_cast<unsigned short*>(dst.data), n);
  }
  EPMOE_CUDA_CHECK_LAUNCH();
}

void fill_i32(TensorView dst, std::int32_t value, cudaStream_t stream) {
  expect_dtype(dst, DType::i32, "dst");
  expect_device(dst, Device::cuda, "dst");
  EPMOE_CHECK(dst.numel() >= 1 && dst.data != nullptr, "fill_i32: dst must hold at least one element, got {}",
              dst.describe());
  fill_i32_kernel<<<1, 1, 0, stream>>>(dst.as<std::int32_t>(), value);
  EPMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace epmoe::layer_detail
