// Host launchers of the fused SiLU·mul + FP8 quantization kernels (silu_quant_kernels.cuh); API in
// epmoe/cuda/silu_quant.hpp.
#include "epmoe/cuda/silu_quant.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string_view>

#include "epmoe/cuda/launch.hpp"
#include "runner/silu_quant_kernels.cuh"

namespace epmoe::cuda {
namespace {

using kernels::kSiluThreads;
using kernels::SiluScaleMode;

static_assert(kSiluQuantMaxExperts == kernels::kSiluMaxExperts);

// (row, group) items (and MN-major scale entries) per launch: below 2^31, so that the kernels'
// positions a few steps past the end stay within 32 bits.
constexpr std::int64_t kMaxItems = std::numeric_limits<std::int32_t>::max();

// Resident blocks of kKernel on the current device, read once per kernel.
template <auto kKernel>
std::uint64_t resident_blocks() {
  static const int blocks_per_sm = [] {
    int n = 0;
    EPMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, kSiluThreads, 0));
    return std::max(n, 1);
  }();
  return static_cast<std::uint64_t>(device_props().sm_count) * static_cast<std::uint64_t>(blocks_per_sm);
}

// Blocks for `work_blocks` blocks of work, at most a full device (the kernels stride over the rest).
template <auto kKernel>
unsigned grid_for(std::uint64_t work_blocks) {
  return static_cast<unsigned>(std::clamp<std::uint64_t>(work_blocks, 1, resident_blocks<kKernel>()));
}

std::uint64_t ceil_div(std::uint64_t a, std::uint64_t b) {
  return (a + b - 1) / b;
}

// Validated shapes and kernel parameters shared by both layouts.
struct Plan {
  kernels::SiluQuantParams params{};
  SiluScaleMode mode = SiluScaleMode::group;
  bool mn_major = false;
};

// h is [lead..., 2I] (rank 2 or 3); checks q and the scales against it. `scale_rows`: the rows of
// one MN-major scale column (M or M_max), `experts`: 0 for contiguous.
Plan plan_for(const TensorView& h, const TensorView& q, const TensorView& scales, const SiluQuantOptions& o,
              int rank, std::int64_t experts, std::int64_t scale_rows) {
  expect_device_tensor(h, DType::bf16, "h", 16);
  expect_rank(h, rank, "h");
  const std::int64_t two_i = h.shape[rank - 1];
  EPMOE_CHECK(two_i > 0 && two_i % 256 == 0,
              "h: the last dimension (2I = {}) must be twice a positive multiple of 128", two_i);
  const std::int64_t inter = two_i / 2, groups = inter / 128;
  expect_device_tensor(q, DType::fp8_e4m3, "q", 16);
  if (rank == 2) {
    expect_shape(q, {h.shape[0], inter}, "q");
  } else {
    expect_shape(q, {h.shape[0], h.shape[1], inter}, "q");
  }
  Plan plan;
  plan.params.h = static_cast<const std::uint16_t*>(h.data);
  plan.params.q = static_cast<std::uint8_t*>(q.data);
  plan.params.groups = static_cast<std::uint32_t>(groups);
  if (o.scaling == Fp8Scaling::per_tensor) {
    plan.mode = SiluScaleMode::tensor;
    if (o.tensor_scale_device.data != nullptr) {
      expect_device_tensor(o.tensor_scale_device, DType::f32, "tensor_scale_device", 16);
      EPMOE_CHECK(o.tensor_scale_device.numel() == 1,
                  "tensor_scale_device must hold exactly one f32 value, got {}",
                  o.tensor_scale_device.describe());
      plan.params.tensor_scale_ptr = static_cast<const float*>(o.tensor_scale_device.data);
    } else {
      expect_scale(o.tensor_scale, "tensor_scale");
      plan.params.tensor_scale = o.tensor_scale;
    }
    return plan;
  }
  EPMOE_CHECK(o.scaling == Fp8Scaling::per_token_group, "unknown Fp8Scaling {}", static_cast<int>(o.scaling));
  plan.mode = o.power_of_two ? SiluScaleMode::group_pow2 : SiluScaleMode::group;
  expect_device_tensor(scales, DType::f32, "scales", 16);
  const std::int64_t padded = tma_aligned_tokens(scale_rows);
  if (o.scale_layout == ScaleLayout::token_major) {
    if (rank == 2) {
      expect_shape(scales, {h.shape[0], groups}, "scales (token_major)");
    } else {
      expect_shape(scales, {experts, h.shape[1], groups}, "scales (token_major)");
    }
  } else {
    EPMOE_CHECK(o.scale_layout == ScaleLayout::mn_major_tma, "unknown scale layout {}",
                static_cast<int>(o.scale_layout));
    plan.mn_major = true;
    if (rank == 2) {
      expect_shape(scales, {groups, padded}, "scales (mn_major_tma)");
    } else {
      expect_shape(scales, {experts, groups, padded}, "scales (mn_major_tma)");
    }
  }
  plan.params.scales = static_cast<float*>(scales.data);
  plan.params.scale_ld = static_cast<std::uint32_t>(padded);
  return plan;
}

// The persistent kernel of one variant over plan.params (rows, validity source set): at most one
// wave, and no more warps than there are (kSlots steps of) items.
template <class Cfg, SiluScaleMode kMode, bool kMn, bool kMasked>
void launch_config(const Plan& plan, cudaStream_t stream) {
  constexpr auto kernel = &kernels::silu_quant_kernel<Cfg, kMode, kMn, kMasked>;
  const std::uint64_t items = static_cast<std::uint64_t>(plan.params.rows) * plan.params.groups;
  const std::uint64_t per_block =
      static_cast<std::uint64_t>(kernels::kSiluWarps) * Cfg::kItemsPerWarp * Cfg::kSlots;
  kernel<<<grid_for<kernel>(ceil_div(items, per_block)), kSiluThreads, 0, stream>>>(plan.params);
  EPMOE_CUDA_CHECK_LAUNCH();
}

// Timing experiments only: EPMOE_SILU_CONFIG = 2 picks another kernel shape (read once; bench/NOTES.md).
int experiment_config() {
  static const int config = [] {
    const char* v = std::getenv("EPMOE_SILU_CONFIG");
    return v == nullptr ? 0 : std::atoi(v);
  }();
  return config;
}

template <SiluScaleMode kMode, bool kMn, bool kMasked>
void launch(const Plan& plan, cudaStream_t stream) {
  switch (experiment_config()) {
    case 2:
      launch_config<kernels::SiluConfig<8, 3, 2>, kMode, kMn, kMasked>(plan, stream);
      break;
    default:
      launch_config<kernels::SiluDefaultConfig, kMode, kMn, kMasked>(plan, stream);
      break;
  }
}

// Calls fn.template operator()<mode, mn_major>() for the plan's run-time choices.
template <class Fn>
void dispatch_variant(const Plan& plan, Fn&& fn) {
  switch (plan.mode) {
    case SiluScaleMode::group:
      plan.mn_major ? fn.template operator()<SiluScaleMode::group, true>()
                    : fn.template operator()<SiluScaleMode::group, false>();
      break;
    case SiluScaleMode::group_pow2:
      plan.mn_major ? fn.template operator()<SiluScaleMode::group_pow2, true>()
                    : fn.template operator()<SiluScaleMode::group_pow2, false>();
      break;
    case SiluScaleMode::tensor:
      fn.template operator()<SiluScaleMode::tensor, false>();
      break;
  }
}

}  // namespace

void silu_mul_quant_contiguous(TensorView h, TensorView m_indices, TensorView q, TensorView scales,
                               const SiluQuantOptions& options, cudaStream_t stream) {
  expect_rank(h, 2, "h");
  const std::int64_t rows = h.shape[0];
  Plan plan = plan_for(h, q, scales, options, 2, 0, rows);
  expect_device_tensor(m_indices, DType::i32, "m_indices", 16);
  expect_shape(m_indices, {rows}, "m_indices");
  EPMOE_CHECK(tma_aligned_tokens(rows) * plan.params.groups <= kMaxItems,
              "h {} has too many (row, group) items for one launch", h.describe());
  if (rows == 0) return;
  plan.params.rows = static_cast<std::uint32_t>(rows);
  plan.params.m_indices = static_cast<const std::int32_t*>(m_indices.data);
  dispatch_variant(plan, [&]<SiluScaleMode kMode, bool kMn>() { launch<kMode, kMn, false>(plan, stream); });
}

void silu_mul_quant_masked(TensorView h, TensorView masked_m, TensorView q, TensorView scales,
                           const SiluQuantOptions& options, cudaStream_t stream) {
  expect_rank(h, 3, "h");
  const std::int64_t experts = h.shape[0], m_max = h.shape[1];
  EPMOE_CHECK(experts >= 1 && experts <= kSiluQuantMaxExperts, "h: E = {} must lie in [1, {}]", experts,
              kSiluQuantMaxExperts);
  Plan plan = plan_for(h, q, scales, options, 3, experts, m_max);
  expect_device_tensor(masked_m, DType::i32, "masked_m", 16);
  expect_shape(masked_m, {experts}, "masked_m");
  EPMOE_CHECK(experts * tma_aligned_tokens(m_max) * plan.params.groups <= kMaxItems,
              "h {} has too many (row, group) items for one launch", h.describe());
  if (m_max == 0) {
    return;  // no rows, and no scale padding (tma_aligned_tokens(0) == 0)
  }
  plan.params.rows = static_cast<std::uint32_t>(experts * m_max);
  plan.params.masked_m = static_cast<const std::int32_t*>(masked_m.data);
  plan.params.experts = static_cast<std::uint32_t>(experts);
  plan.params.m_max = static_cast<std::uint32_t>(m_max);
  dispatch_variant(plan, [&]<SiluScaleMode kMode, bool kMn>() { launch<kMode, kMn, true>(plan, stream); });
}

}  // namespace epmoe::cuda
