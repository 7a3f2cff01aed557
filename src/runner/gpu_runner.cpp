// The GPU runner registry and the layout plumbing the backends share (gpu_runner.hpp).
#include "runner/gpu_runner.hpp"

namespace epmoe::cuda {

std::string gpu_runner_key(Layout layout, QuantScheme backend) {
  return fmt::format("{}/{}", to_string(layout), to_string(backend));
}

std::unique_ptr<GpuRunner> make_gpu_runner(Layout layout, const GpuRunnerContext& context) {
  return GpuRunnerRegistry::instance().make(gpu_runner_key(layout, context.config.quant), context);
}

std::vector<std::string> gpu_runner_keys() {
  return GpuRunnerRegistry::instance().keys();
}

namespace runner_detail {

GroupedMlpRunner::GroupedMlpRunner(const GpuRunnerContext& context, Layout layout)
    : context_(context), layout_(layout) {
  EPMOE_CHECK(context_.max_rows >= 0, "GpuRunnerContext.max_rows must be >= 0, got {}", context_.max_rows);
  expect_rank(context_.weights.w13, 3, "GpuRunnerContext.weights.w13");
  const std::int64_t R = context_.max_rows, I = intermediate();
  EPMOE_CHECK(I % 128 == 0, "the GPU runners need an intermediate size that is a multiple of 128, got {}", I);
  h_ = DeviceTensor(DType::bf16, {R, 2 * I});
  a2_ = DeviceTensor(DType::fp8_e4m3, {R, I});
  a2_scales_ = DeviceTensor(DType::f32, {R, I / 128});
}

void GroupedMlpRunner::run(const DispatchOutput& in, TensorView out, cudaStream_t stream) {
  const MoeConfig& c = context_.config;
  const std::int64_t H = c.hidden, I = intermediate(), L = slots();
  EPMOE_CHECK(in.layout == layout_, "runner {} got a {} dispatch output", name(), to_string(in.layout));
  EPMOE_CHECK(in.format == activation_format(c.quant), "runner {} got activations of another format", name());
  expect_dtype(out, DType::bf16, "out");
  expect_shape(out, {in.num_output_rows(), H}, "out");
  const SlotWeights& w = context_.weights;
  const SiluQuantOptions so = silu_options();
  if (layout_ == Layout::contiguous) {
    const std::int64_t M = in.rows.size(0);
    EPMOE_CHECK(M <= context_.max_rows, "runner {}: {} contiguous rows exceed its workspace ({} rows)",
                name(), M, context_.max_rows);
    if (M == 0) return;
    expect_device(out, Device::cuda, "out");
    const TensorView h = h_.view().slice_rows(0, M), a2 = a2_.view().slice_rows(0, M),
                     a2s = a2_scales_.view().slice_rows(0, M);
    gemm_contiguous({in.rows, in.scales, in.tensor_scale, w.w13, w.w13_scale, h}, in.m_indices, stream);
    silu_mul_quant_contiguous(h, in.m_indices, a2, a2s, so, stream);
    gemm_contiguous({a2, a2s, context_.a2_scale, w.w2, w.w2_scale, out}, in.m_indices, stream);
    return;
  }
  EPMOE_CHECK(layout_ == Layout::masked, "runner {}: no steps for this layout", name());
  const std::int64_t G = in.rows.size(0), M = in.rows.size(1);
  EPMOE_CHECK(G == L && G * M <= context_.max_rows,
              "runner {}: masked layout [{}, {}] does not fit its {} local experts and {} rows", name(), G, M,
              L, context_.max_rows);
  if (G * M == 0) return;
  expect_device(out, Device::cuda, "out");
  const TensorView h = h_.view().reshaped({G, M, 2 * I}), a2 = a2_.view().reshaped({G, M, I}),
                   a2s = a2_scales_.view().reshaped({G, M, I / 128});
  gemm_masked({in.rows, in.scales, in.tensor_scale, w.w13, w.w13_scale, h}, in.masked_m, in.expected_m,
              stream);
  silu_mul_quant_masked(h, in.masked_m, a2, a2s, so, stream);
  gemm_masked({a2, a2s, context_.a2_scale, w.w2, w.w2_scale, out.reshaped({G, M, H})}, in.masked_m,
              in.expected_m, stream);
}

}  // namespace runner_detail
}  // namespace epmoe::cuda
