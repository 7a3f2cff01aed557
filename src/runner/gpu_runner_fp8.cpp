// The FP8 block-scaled GPU runner (DeepSeek-V3 weights: 128 x 128 weight scales, 1 x 128 activation
// scales; issue 4's grouped GEMMs), for the contiguous and masked layouts.
#include "epmoe/cuda/grouped_gemm.hpp"
#include "runner/gpu_runner.hpp"

namespace epmoe::cuda {
namespace {

class Fp8Runner final : public runner_detail::GroupedMlpRunner {
 public:
  using GroupedMlpRunner::GroupedMlpRunner;

 private:
  GroupedGemmOptions options() const {
    GroupedGemmOptions o;
    o.max_ctas = max_ctas_;
    return o;
  }
  void gemm_contiguous(const runner_detail::GemmOperands& g, TensorView m_indices,
                       cudaStream_t stream) override {
    fp8_grouped_gemm_contiguous(g.a, g.a_scales, ScaleLayout::token_major, g.w, g.w_scales, m_indices, g.d,
                                stream, options());
  }
  void gemm_masked(const runner_detail::GemmOperands& g, TensorView masked_m, std::int64_t expected_m,
                   cudaStream_t stream) override {
    GroupedGemmOptions o = options();
    // One group of a decode-sized batch (the shared expert): 64-row tiles, so that it spreads over 4x
    // more CTAs (with 128 x 256 tiles a 128-token batch gave 16 CTAs, each streaming its slice of the
    // 44 MB of weights alone: 0.68 ms beside the routed GEMMs).
    if (g.a.size(0) == 1 && expected_m <= 256) o.block_m = 64;
    fp8_grouped_gemm_masked(g.a, g.a_scales, ScaleLayout::token_major, g.w, g.w_scales, masked_m, expected_m,
                            g.d, stream, o);
  }
  SiluQuantOptions silu_options() const override {
    SiluQuantOptions so;  // per-token-group scales, token-major, as the GEMM reads them
    so.power_of_two = context_.config.power_of_two_scales;
    return so;
  }
};

const runner_detail::LayoutRegistrations<Fp8Runner> kRegistrations{QuantScheme::fp8};

}  // namespace
}  // namespace epmoe::cuda
