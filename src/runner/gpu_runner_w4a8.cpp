// The W4A8 GPU runner (int4 weights prepared for the kernel, per-128-K weight scales; FP8
// activations with static per-tensor scales; issue 5's grouped GEMMs), for the contiguous and masked
// layouts. The GEMM2 input is quantized by the fused SiLU·mul with the static scale a2.
#include <algorithm>
#include <cstdlib>
#include <string_view>

#include "epmoe/cuda/launch.hpp"
#include "epmoe/cuda/w4a8_gemm.hpp"
#include "runner/gpu_runner.hpp"

namespace epmoe::cuda {
namespace {

class W4A8Runner final : public runner_detail::GroupedMlpRunner {
 public:
  W4A8Runner(const GpuRunnerContext& context, Layout layout) : GroupedMlpRunner(context, layout) {
    if (layout != Layout::masked) return;
    // The masked GEMMs' workspace (the row-sum pre-pass and the tile counter of the decode tiles), for
    // the larger K of the two and the most rows per group the runner takes (G * M_max <= max_rows).
    const std::int64_t G = slots();
    if (G == 0) return;
    const std::int64_t k = std::max(context_.config.hidden, intermediate());
    const std::int64_t m_max = context_.max_rows / G;
    sums_ = DeviceTensor(DType::f32, {static_cast<std::int64_t>(w4a8_workspace_bytes(G, m_max, k) / 4)});
    // Zeroed once, as W4A8GemmOptions::workspace asks (the dynamic schedule's counter), and finished
    // before any stream of the layer uses it.
    sums_.fill_bytes(0);
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(nullptr));
  }
  std::size_t workspace_bytes() const override {
    return GroupedMlpRunner::workspace_bytes() + sums_.nbytes();
  }

 private:
  DeviceTensor sums_;

  W4A8GemmOptions options() const {
    W4A8GemmOptions o;
    o.max_ctas = max_ctas_;
    o.codes = context_.weights.w4a8_codes;
    return o;
  }
  void gemm_contiguous(const runner_detail::GemmOperands& g, TensorView m_indices,
                       cudaStream_t stream) override {
    w4a8_grouped_gemm_contiguous(g.a, g.a_tensor_scale, {}, g.w, g.w_scales, m_indices, g.d, stream,
                                 options());
  }
  void gemm_masked(const runner_detail::GemmOperands& g, TensorView masked_m, std::int64_t expected_m,
                   cudaStream_t stream) override {
    W4A8GemmOptions o = options();
    // EPMOE_W4A8_MASKED_ALL_SMS=1 (experiment, off by default): masked launches on every SM instead
    // of the CTA count that balances the rounds of the *expected* tiles; skewed routing runs more
    // (groups over one m-block), bench/NOTES.md (W4A8 in the layer, sixth session).
    static const bool all_sms = [] {
      const char* v = std::getenv("EPMOE_W4A8_MASKED_ALL_SMS");
      return v != nullptr && std::string_view(v) == "1";
    }();
    if (all_sms && o.max_ctas == 0) o.max_ctas = device_props().sm_count;
    o.workspace = sums_.view();
    w4a8_grouped_gemm_masked(g.a, g.a_tensor_scale, {}, g.w, g.w_scales, masked_m, expected_m, g.d, stream,
                             o);
  }
  SiluQuantOptions silu_options() const override {
    SiluQuantOptions so;
    so.scaling = Fp8Scaling::per_tensor;
    so.tensor_scale = context_.a2_scale;
    so.power_of_two = context_.config.power_of_two_scales;
    return so;
  }
};

const runner_detail::LayoutRegistrations<W4A8Runner> kRegistrations{QuantScheme::w4a8};

}  // namespace
}  // namespace epmoe::cuda
