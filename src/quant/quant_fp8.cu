// Host launchers of the FP8 quantization kernels (quant_fp8_kernels.cuh); API in
// epmoe/cuda/quant.hpp.
#include "epmoe/cuda/quant.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string_view>

#include "cuda/pdl_launch.hpp"
#include "epmoe/cuda/launch.hpp"
#include "quant/quant_fp8_kernels.cuh"

namespace epmoe::cuda {
namespace {

using kernels::kQuantThreads;

// Blocks for `work_blocks` blocks of work: no more than fit on the device at once (the kernels
// stride over the rest). The occupancy is read once per kernel (kKernel is a template argument,
// so kernels of one signature keep separate values).
template <auto kKernel>
unsigned grid_for(std::uint64_t work_blocks) {
  static const int blocks_per_sm = [] {
    int n = 0;
    EPMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, kQuantThreads, 0));
    return std::max(n, 1);
  }();
  const std::uint64_t resident = static_cast<std::uint64_t>(device_props().sm_count) * blocks_per_sm;
  return static_cast<unsigned>(std::clamp<std::uint64_t>(work_blocks, 1, resident));
}

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) {
  return (a + b - 1) / b;
}

// One block per block of work, each thread's loads issued once (kUnroll vectors): the hardware
// refills SMs as blocks retire, so memory stays busy without a persistent loop's per-iteration
// load-use bubble. (Measured against the persistent grid in bench/NOTES.md.)
unsigned oneshot_grid(std::uint64_t work_blocks) {
  return static_cast<unsigned>(std::clamp<std::uint64_t>(work_blocks, 1, 0x7fffffffu));
}

template <bool kPow2, bool kMnMajor>
void launch_per_token_group(const TensorView& x, const TensorView& q, const TensorView& scales,
                            std::uint32_t num_groups, std::uint32_t groups_per_row, std::uint32_t tokens,
                            std::uint32_t tokens_padded, cudaStream_t stream) {
  constexpr auto kernel = &kernels::per_token_group_fp8_kernel<kPow2, kMnMajor>;
  // kUnroll groups per half-warp.
  const unsigned grid =
      oneshot_grid(ceil_div(num_groups, kQuantThreads / kernels::kLanesPerGroup * kernels::kUnroll));
  // The kernel's thread index is 32-bit (past 2^32 threads it would wrap and leave groups unquantized).
  EPMOE_CHECK(static_cast<std::uint64_t>(grid) * kQuantThreads <= std::numeric_limits<std::uint32_t>::max(),
              "{} groups of {} are too many for one launch", num_groups, kernels::kQuantGroup);
  kernel<<<grid, kQuantThreads, 0, stream>>>(
      static_cast<const std::uint16_t*>(x.data), static_cast<std::uint8_t*>(q.data),
      static_cast<float*>(scales.data), num_groups, groups_per_row, tokens, tokens_padded);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_per_tensor(const TensorView& x, const TensorView& q, const float* scale_ptr, float scale_value,
                       cudaStream_t stream) {
  const auto n = static_cast<std::uint64_t>(x.numel());
  if (n == 0) return;
  const unsigned grid = oneshot_grid(ceil_div(ceil_div(n, kernels::kVec), kQuantThreads * kernels::kUnroll));
  kernels::per_tensor_fp8_kernel<<<grid, kQuantThreads, 0, stream>>>(
      static_cast<const std::uint16_t*>(x.data), static_cast<std::uint8_t*>(q.data), n, scale_ptr,
      scale_value);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void expect_scalar_f32(const TensorView& t, std::string_view name) {
  expect_device_tensor(t, DType::f32, name, 16);
  EPMOE_CHECK(t.numel() == 1, "{} must hold exactly one f32 value, got {}", name, t.describe());
}

// The amax of x into out (f32 bits), and with `to_scale` the scale from it (quant_fp8_kernels.cuh).
void launch_amax(const TensorView& x, const TensorView& out, std::string_view out_name, bool to_scale,
                 cudaStream_t stream) {
  expect_device_tensor(x, DType::bf16, "x", 16);
  expect_scalar_f32(out, out_name);
  auto* const bits = static_cast<unsigned int*>(out.data);
  kernels::zero_amax_kernel<<<1, 1, 0, stream>>>(bits);
  EPMOE_CUDA_CHECK_LAUNCH();
  const auto n = static_cast<std::uint64_t>(x.numel());
  if (n > 0) {
    const unsigned grid =
        grid_for<&kernels::amax_kernel>(ceil_div(ceil_div(n, kernels::kVec), kQuantThreads));
    launch_pdl(true, &kernels::amax_kernel, grid, kQuantThreads, stream,
               static_cast<const std::uint16_t*>(x.data), n, bits);
  }
  if (to_scale)
    launch_pdl(true, &kernels::amax_to_fp8_scale_kernel, 1, 1, stream, static_cast<float*>(out.data));
}

}  // namespace

std::string_view to_string(ScaleLayout layout) {
  switch (layout) {
    case ScaleLayout::token_major:
      return "token_major";
    case ScaleLayout::mn_major_tma:
      return "mn_major_tma";
  }
  return "?";
}

void quantize_per_token_group_fp8(TensorView x, TensorView q, TensorView scales, cudaStream_t stream,
                                  ScaleLayout layout, bool power_of_two) {
  expect_device_tensor(x, DType::bf16, "x", 16);
  expect_rank(x, 2, "x");
  const std::int64_t tokens = x.shape[0], k = x.shape[1];
  EPMOE_CHECK(k % kernels::kQuantGroup == 0, "x: K = {} must be a multiple of {}", k, kernels::kQuantGroup);
  expect_device_tensor(q, DType::fp8_e4m3, "q", 16);
  expect_shape(q, {tokens, k}, "q");
  expect_device_tensor(scales, DType::f32, "scales", 16);
  const std::int64_t groups_per_row = k / kernels::kQuantGroup;
  const std::int64_t tokens_padded = tma_aligned_tokens(tokens);
  if (layout == ScaleLayout::token_major) {
    expect_shape(scales, {tokens, groups_per_row}, "scales (token_major)");
  } else {
    EPMOE_CHECK(layout == ScaleLayout::mn_major_tma, "unknown scale layout {}", static_cast<int>(layout));
    expect_shape(scales, {groups_per_row, tokens_padded}, "scales (mn_major_tma)");
  }
  const std::int64_t num_groups = tokens * groups_per_row;
  EPMOE_CHECK(num_groups <= std::numeric_limits<std::uint32_t>::max() &&
                  tokens_padded <= std::numeric_limits<std::int32_t>::max(),
              "x {} has too many groups for one launch", x.describe());
  if (num_groups == 0) return;

  const auto g = static_cast<std::uint32_t>(num_groups), gpr = static_cast<std::uint32_t>(groups_per_row);
  const auto t = static_cast<std::uint32_t>(tokens), tp = static_cast<std::uint32_t>(tokens_padded);
  const bool mn = layout == ScaleLayout::mn_major_tma;
  if (power_of_two) {
    mn ? launch_per_token_group<true, true>(x, q, scales, g, gpr, t, tp, stream)
       : launch_per_token_group<true, false>(x, q, scales, g, gpr, t, tp, stream);
  } else {
    mn ? launch_per_token_group<false, true>(x, q, scales, g, gpr, t, tp, stream)
       : launch_per_token_group<false, false>(x, q, scales, g, gpr, t, tp, stream);
  }
}

void quantize_per_tensor_fp8(TensorView x, TensorView q, float scale, cudaStream_t stream) {
  expect_device_tensor(x, DType::bf16, "x", 16);
  expect_device_tensor(q, DType::fp8_e4m3, "q", 16);
  expect_same_shape(q, x, "q", "x");
  expect_scale(scale, "scale");
  launch_per_tensor(x, q, nullptr, scale, stream);
}

void quantize_per_tensor_fp8(TensorView x, TensorView q, TensorView scale, cudaStream_t stream) {
  expect_device_tensor(x, DType::bf16, "x", 16);
  expect_device_tensor(q, DType::fp8_e4m3, "q", 16);
  expect_same_shape(q, x, "q", "x");
  expect_scalar_f32(scale, "scale");
  launch_per_tensor(x, q, static_cast<const float*>(scale.data), 0.0f, stream);
}

void per_tensor_amax(TensorView x, TensorView amax, cudaStream_t stream) {
  launch_amax(x, amax, "amax", false, stream);
}

void per_tensor_fp8_scale(TensorView x, TensorView scale, cudaStream_t stream) {
  launch_amax(x, scale, "scale", true, stream);  // the amax lands in `scale` and becomes it
}

}  // namespace epmoe::cuda
