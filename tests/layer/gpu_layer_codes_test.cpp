// The W4A8 layer's choice of packed codes (GpuLayerOptions::w4a8_codes, gpu_layer_w4a8_codes): host
// only, so it runs without a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "epmoe/cuda/layer.hpp"
#include "epmoe/weights.hpp"
#include "gpu_test_util.hpp"

namespace epmoe {
namespace {

// Routed experts from the synthetic quantizer (amax / 7: never -8), with -8 written into one byte of
// one expert's W2 when asked; counts the experts read.
class TestWeights final : public ModelWeights {
 public:
  TestWeights(int minus8_expert, bool in_high_nibble) : config_(MoeConfig::preset("tiny")) {
    config_.quant = QuantScheme::w4a8;
    for (int e = 0; e < config_.num_experts; ++e) {
      experts_.push_back(make_synthetic_expert(QuantScheme::w4a8, config_.hidden, config_.intermediate,
                                               1000 + static_cast<std::uint64_t>(e)));
      if (e == minus8_expert) {
        auto* bytes = static_cast<std::uint8_t*>(experts_.back()->w2.view().data);
        std::uint8_t& b = bytes[experts_.back()->w2.nbytes() / 2 + 3];
        b = in_high_nibble ? static_cast<std::uint8_t>((b & 0x0fu) | 0x80u)
                           : static_cast<std::uint8_t>((b & 0xf0u) | 0x08u);
      }
    }
  }
  const MoeConfig& config() const override { return config_; }
  const ExpertWeights& routed_expert(int logical) const override {
    ++reads_;
    return *experts_.at(static_cast<std::size_t>(logical));
  }
  const ExpertWeights& shared_expert() const override { return *experts_.front(); }
  TensorView gate_weight() const override { return {}; }
  TensorView correction_bias() const override { return {}; }
  float a1_scale() const override { return 1.0f; }
  float a2_scale() const override { return 1.0f; }
  int reads() const { return reads_; }

 private:
  MoeConfig config_;
  std::vector<std::unique_ptr<ExpertWeights>> experts_;
  mutable int reads_ = 0;
};

using cuda::W4A8Codes;

TEST(GpuLayerW4A8Codes, AutoScansUserExpertsOnce) {
  const TestWeights clean(-1, false);
  EXPECT_EQ(cuda::gpu_layer_w4a8_codes(clean, "auto"), W4A8Codes::sign_magnitude);
  EXPECT_EQ(clean.reads(), clean.config().num_experts);  // every routed expert, once
  for (const bool high : {false, true}) {
    const TestWeights last(clean.config().num_experts - 1, high);
    EXPECT_EQ(cuda::gpu_layer_w4a8_codes(last, "auto"), W4A8Codes::offset_binary) << "high nibble " << high;
    const TestWeights first(0, high);
    EXPECT_EQ(cuda::gpu_layer_w4a8_codes(first, "auto"), W4A8Codes::offset_binary) << "high nibble " << high;
  }
}

TEST(GpuLayerW4A8Codes, ExplicitChoicesAreTakenWithoutAScan) {
  const TestWeights minus8(3, false);
  EXPECT_EQ(cuda::gpu_layer_w4a8_codes(minus8, "offset_binary"), W4A8Codes::offset_binary);
  // (An expert holding -8 under the sign-magnitude codes is refused when its slot is prepared.)
  EXPECT_EQ(cuda::gpu_layer_w4a8_codes(minus8, "sign_magnitude"), W4A8Codes::sign_magnitude);
  EXPECT_EQ(minus8.reads(), 0);
}

TEST(GpuLayerW4A8Codes, SyntheticWeightsNeedNoScan) {
  MoeConfig c = MoeConfig::preset("tiny");
  c.quant = QuantScheme::w4a8;
  const SyntheticWeights w(c, 7);
  const std::size_t built = w.experts_built();
  EXPECT_EQ(cuda::gpu_layer_w4a8_codes(w, "auto"), W4A8Codes::sign_magnitude);
  EXPECT_EQ(w.experts_built(), built);  // no expert built for the choice
}

TEST(GpuLayerW4A8Codes, RefusesBadRequestsAndOtherQuants) {
  const TestWeights clean(-1, false);
  testing::expect_error_mentions([&] { (void)cuda::gpu_layer_w4a8_codes(clean, "signed"); },
                                 "w4a8_codes must be \"auto\", \"offset_binary\" or \"sign_magnitude\"");
  MoeConfig c = MoeConfig::preset("tiny");
  c.quant = QuantScheme::fp8;
  class Fp8Weights final : public ModelWeights {
   public:
    explicit Fp8Weights(const MoeConfig& c) : c_(c) {}
    const MoeConfig& config() const override { return c_; }
    const ExpertWeights& routed_expert(int) const override { throw Error("not read"); }
    const ExpertWeights& shared_expert() const override { throw Error("not read"); }
    TensorView gate_weight() const override { return {}; }
    TensorView correction_bias() const override { return {}; }
    float a1_scale() const override { return 1.0f; }
    float a2_scale() const override { return 1.0f; }

   private:
    MoeConfig c_;
  } fp8(c);
  testing::expect_error_mentions([&] { (void)cuda::gpu_layer_w4a8_codes(fp8, "auto"); },
                                 "the weights' quant must be w4a8");
}

}  // namespace
}  // namespace epmoe
