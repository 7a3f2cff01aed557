// Device fills of the grouped GEMM benchmark's random inputs (suite_gemm_fill.hpp).
#include "bench/suite_gemm_fill.hpp"

#include <algorithm>
#include <cstdlib>
#include <string_view>

#include "bench/gemm_fill_kernels.cuh"
#include "epmoe/cuda/launch.hpp"

namespace epmoe::bench {
namespace {

unsigned blocks_for(std::uint64_t threads_needed) {
  const std::uint64_t cap = static_cast<std::uint64_t>(cuda::device_props().sm_count) * 8;
  return static_cast<unsigned>(std::clamp<std::uint64_t>((threads_needed + 255) / 256, 1, cap));
}

}  // namespace

void fill_random_fp8(TensorView x, std::uint64_t seed, cudaStream_t stream) {
  EPMOE_CHECK(x.dtype == DType::fp8_e4m3 || x.dtype == DType::u8, "x must be fp8_e4m3 or u8, got {}",
              x.describe());
  expect_device(x, Device::cuda, "x");
  expect_contiguous(x, "x");
  EPMOE_CHECK(reinterpret_cast<std::uintptr_t>(x.data) % 8 == 0, "x must be 8-byte aligned, got {}",
              x.describe());
  const auto n = static_cast<std::uint64_t>(x.numel());
  if (n == 0) return;
  fill_fp8_kernel<<<blocks_for((n + 7) / 8), 256, 0, stream>>>(static_cast<std::uint8_t*>(x.data), n, seed);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void clear_int4_minus8(TensorView w, cudaStream_t stream) {
  expect_device_tensor(w, DType::i4x2, "w", 1);
  const auto n = static_cast<std::uint64_t>(w.nbytes());
  if (n == 0) return;
  clear_int4_minus8_kernel<<<blocks_for(n), 256, 0, stream>>>(static_cast<std::uint8_t*>(w.data), n);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void fill_quantized_normal_fp8(TensorView x, std::int64_t block_rows, std::uint64_t seed,
                               cudaStream_t stream) {
  expect_device_tensor(x, DType::fp8_e4m3, "x", 16);
  EPMOE_CHECK(block_rows == 1 || block_rows == 128, "block_rows must be 1 or 128, got {}", block_rows);
  EPMOE_CHECK(x.rank >= 2 && x.size(x.rank - 1) % 128 == 0,
              "x must be [..., cols] with cols % 128 == 0, got {}", x.describe());
  const std::int64_t cols = x.size(x.rank - 1), rows = x.numel() / cols;
  if (rows == 0) return;
  const std::int64_t tiles = (rows + 127) / 128;
  EPMOE_CHECK(tiles <= 65535, "x has too many rows for the fill's grid ({} > 65535 * 128)", rows);
  fill_normal_fp8_kernel<<<dim3(static_cast<unsigned>(cols / 128), static_cast<unsigned>(tiles)), 128, 0,
                           stream>>>(static_cast<std::uint8_t*>(x.data), rows, cols, block_rows == 128, seed);
  EPMOE_CUDA_CHECK_LAUNCH();
}

Fp8Data fp8_data_from_env() {
  const char* e = std::getenv("EPMOE_BENCH_GEMM_DATA");
  const std::string_view v = e == nullptr ? "" : e;
  if (v.empty() || v == "normal") return Fp8Data::quantized_normal;
  if (v == "uniform") return Fp8Data::uniform;
  EPMOE_CHECK(false, "EPMOE_BENCH_GEMM_DATA must be 'normal' or 'uniform', got '{}'", v);
  return Fp8Data::quantized_normal;
}

const char* fp8_data_name(Fp8Data data) {
  return data == Fp8Data::uniform ? "uniform" : "normal";
}

void fill_random_scales(TensorView x, std::uint64_t seed, cudaStream_t stream) {
  expect_device_tensor(x, DType::f32, "x", 4);
  const auto n = static_cast<std::uint64_t>(x.numel());
  if (n == 0) return;
  fill_scales_kernel<<<blocks_for(n), 256, 0, stream>>>(static_cast<float*>(x.data), n, seed);
  EPMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace epmoe::bench
