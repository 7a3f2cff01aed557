// Host launchers of the benchmark harness's device helpers (bench_kernels.cuh).
#include <algorithm>
#include <cmath>

#include "bench/bench.hpp"
#include "bench/bench_kernels.cuh"
#include "epmoe/cuda/launch.hpp"

namespace epmoe::bench {

void gpu_sleep(cudaStream_t stream, double microseconds) {
  if (!(microseconds > 0.0)) return;
  kernels::sleep_kernel<<<1, 1, 0, stream>>>(static_cast<std::uint64_t>(std::llround(microseconds * 1e3)));
  EPMOE_CUDA_CHECK_LAUNCH();
}

void fill_random_bf16(TensorView x, std::uint64_t seed, cudaStream_t stream) {
  expect_device_tensor(x, DType::bf16, "x", 2);
  const auto n = static_cast<std::uint64_t>(x.numel());
  if (n == 0) return;
  constexpr int kThreads = 256;
  const std::uint64_t blocks = std::min<std::uint64_t>(
      (n + kThreads - 1) / kThreads, static_cast<std::uint64_t>(cuda::device_props().sm_count) * 8);
  kernels::fill_random_bf16_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<__nv_bfloat16*>(x.data), n, seed);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void stream_fanout(const void* src, void* dst, std::size_t bytes, int fanout, int blocks, int passes,
                   cudaStream_t stream) {
  EPMOE_CHECK(bytes % 16 == 0 && fanout >= 1 && blocks >= 1 && passes >= 1,
              "stream_fanout: bytes {} (a multiple of 16), fanout {}, blocks {}, passes {}", bytes, fanout,
              blocks, passes);
  kernels::stream_fanout_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
      static_cast<const uint4*>(src), static_cast<uint4*>(dst), bytes / 16, fanout, passes);
  EPMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace epmoe::bench
