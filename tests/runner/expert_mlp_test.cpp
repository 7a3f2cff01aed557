// The expert MLP, the runner registry and the reference refuse bad input with clear messages.
#include <gtest/gtest.h>

#include <cmath>

#include "epmoe/layer.hpp"
#include "epmoe/quant.hpp"
#include "epmoe/weights.hpp"
#include "expect_error.hpp"

namespace epmoe {
namespace {

using testing::message_of;

TEST(ExpertMlp, RefusesBadShapesAndScales) {
  const auto w = make_synthetic_expert(QuantScheme::fp8, 256, 128, 3);
  HostTensor x(DType::fp8_e4m3, {4, 256}), s(DType::f32, {4, 2}), y(DType::bf16, {4, 256});
  for (std::int64_t i = 0; i < s.numel(); ++i) s.data<float>()[i] = 0.01f;
  EXPECT_NO_THROW(expert_mlp_cpu(*w, ActivationFormat::fp8_group, x, s, 1, 1, false, Numerics::mirror, y));
  HostTensor wide(DType::fp8_e4m3, {4, 384});
  EXPECT_NE(message_of([&] {
              expert_mlp_cpu(*w, ActivationFormat::fp8_group, wide, s, 1, 1, false, Numerics::mirror, y);
            }).find("x must have shape [4, 256]"),
            std::string::npos);
  HostTensor bad_scales(DType::f32, {4, 3});
  EXPECT_NE(message_of([&] {
              expert_mlp_cpu(*w, ActivationFormat::fp8_group, x, bad_scales, 1, 1, false, Numerics::mirror,
                             y);
            }).find("x_scales"),
            std::string::npos);
  HostTensor bf(DType::bf16, {4, 256});
  EXPECT_NE(message_of([&] {
              expert_mlp_cpu(*w, ActivationFormat::fp8_group, bf, s, 1, 1, false, Numerics::mirror, y);
            }).find("x must have dtype fp8_e4m3"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              expert_mlp_cpu(*w, ActivationFormat::fp8_tensor, x, {}, 0.0f, 1, false, Numerics::mirror, y);
            }).find("x_tensor_scale must be positive"),
            std::string::npos);
  HostTensor y_f32(DType::f32, {4, 256});
  EXPECT_NE(message_of([&] {
              expert_mlp_cpu(*w, ActivationFormat::fp8_group, x, s, 1, 1, false, Numerics::mirror, y_f32);
            }).find("out must be bf16 or f64"),
            std::string::npos);
}

TEST(ExpertMlp, ExpertWeightsValidateNamesTheTensor) {
  auto w = make_synthetic_expert(QuantScheme::w4a8, 256, 128, 3);
  EXPECT_NO_THROW(w->validate());
  w->w2_scale = HostTensor(DType::f32, {256, 2});
  EXPECT_NE(message_of([&] { w->validate(); }).find("w2_scale must have shape [256, 1]"), std::string::npos);
}

TEST(ExpertMlp, MirrorAndExactAgreeClosely) {
  for (QuantScheme q : {QuantScheme::fp8, QuantScheme::w4a8, QuantScheme::none}) {
    MoeConfig c = MoeConfig::preset("tiny");
    c.quant = q;
    SyntheticWeights weights(c, 4);
    HostTensor x = synthetic_tokens(c, 9, 0, 6);
    HostTensor mirror(DType::bf16, {6, c.hidden}), exact(DType::f64, {6, c.hidden});
    reference_forward(weights, x, mirror, Numerics::mirror);
    reference_forward(weights, x, exact, Numerics::exact);
    const ErrorReport e = compare(mirror, exact);
    EXPECT_EQ(e.non_finite, 0);
    EXPECT_GT(e.rel_l2, 0.0) << "mirror must round somewhere";
    EXPECT_LE(e.rel_l2, q == QuantScheme::none ? 2e-2 : 8e-2) << to_string(q);
  }
}

TEST(Reference, RefusesBadInput) {
  const MoeConfig c = MoeConfig::preset("tiny");
  SyntheticWeights weights(c, 1);
  HostTensor x = synthetic_tokens(c, 1, 0, 3), y(DType::bf16, {3, c.hidden});
  x.data<bf16>()[5] = bf16::from_float(std::numeric_limits<float>::infinity());
  EXPECT_NE(message_of([&] { reference_forward(weights, x, y, Numerics::mirror); }).find("x must be finite"),
            std::string::npos);
  HostTensor x2 = synthetic_tokens(c, 1, 0, 3), y2(DType::bf16, {4, c.hidden});
  EXPECT_NE(
      message_of([&] { reference_forward(weights, x2, y2, Numerics::mirror); }).find("y must have shape"),
      std::string::npos);
  EXPECT_NE(message_of([&] { (void)weights.routed_expert(16); }).find("logical expert id must be in [0, 16)"),
            std::string::npos);
}

TEST(Runner, RegistryNamesEveryCpuBackendAndRefusesUnknown) {
  const MoeConfig c = MoeConfig::preset("tiny");
  SyntheticWeights weights(c, 1);
  const ExpertPlacement placement =
      ExpertPlacement::initial(c.num_experts, c.num_physical_experts(), c.num_ranks);
  for (Layout l : {Layout::token_major, Layout::contiguous, Layout::masked})
    EXPECT_NO_THROW((void)make_runner(Device::cpu, l, {c, &weights, &placement, Numerics::mirror}));
  EXPECT_NE(message_of([&] {
              (void)make_runner(Device::cuda, Layout::masked, {c, &weights, &placement});
            }).find("no implementation registered for 'cuda/masked/fp8'"),
            std::string::npos);
  EXPECT_NE(message_of([&] {
              (void)make_runner(Device::cpu, Layout::masked, {c, nullptr, &placement});
            }).find("weights must be set"),
            std::string::npos);
}

TEST(Compare, MeasuresAndFlagsNonFinite) {
  HostTensor a(DType::f32, {3}), b(DType::f32, {3});
  for (int i = 0; i < 3; ++i) a.data<float>()[i] = b.data<float>()[i] = 1.0f + static_cast<float>(i);
  EXPECT_EQ(compare(a, b).rel_l2, 0.0);
  EXPECT_NEAR(compare(a, b).calc_diff, 0.0, 1e-15);
  a.data<float>()[1] = 2.2f;
  EXPECT_NEAR(compare(a, b).rel_l2, 0.2 / std::sqrt(14.0), 1e-6);
  a.data<float>()[2] = std::numeric_limits<float>::quiet_NaN();
  const ErrorReport e = compare(a, b);
  EXPECT_EQ(e.non_finite, 1);
  EXPECT_FALSE(e.within(1.0));
}

// Weights that do not match their declared dims (a hand-edited expert, a custom factory's mistake) and
// non-finite or absent activation scales: refused before any read past a buffer.
TEST(ExpertMlp, RefusesMismatchedWeightsAndBadScales) {
  auto w = make_synthetic_expert(QuantScheme::fp8, 256, 128, 3);
  HostTensor x(DType::fp8_e4m3, {4, 256}), s(DType::f32, {4, 2}), y(DType::bf16, {4, 256});
  x.fill_bytes(0x38);  // 1.0
  for (std::int64_t i = 0; i < s.numel(); ++i) s.data<float>()[i] = 0.01f;
  s.data<float>()[1] = std::nanf("");
  EXPECT_NE(message_of([&] {
              expert_mlp_cpu(*w, ActivationFormat::fp8_group, x, s, 1, 1, false, Numerics::exact, y);
            }).find("x_scales must be positive and finite"),
            std::string::npos);
  s.data<float>()[1] = -0.01f;  // a negative scale flips the row's sign, which no quantizer gives
  EXPECT_NE(message_of([&] {
              expert_mlp_cpu(*w, ActivationFormat::fp8_group, x, s, 1, 1, false, Numerics::exact, y);
            }).find("x_scales must be positive and finite: element 1 is -0.01"),
            std::string::npos);
  s.data<float>()[1] = 0.01f;
  w->intermediate = 256;  // the tensors still hold I = 128
  EXPECT_NE(message_of([&] {
              expert_mlp_cpu(*w, ActivationFormat::fp8_group, x, s, 1, 1, false, Numerics::mirror, y);
            }).find("w13 must have shape"),
            std::string::npos);

  MoeConfig c = MoeConfig::preset("tiny");
  SyntheticWeights weights(c, 1);
  weights.set_expert_factory(
      [](QuantScheme quant, std::int64_t hidden, std::int64_t intermediate, std::uint64_t seed) {
        return make_synthetic_expert(quant, hidden, intermediate + 128, seed);  // not the I it was asked for
      });
  EXPECT_NE(
      message_of([&] { (void)weights.routed_expert(0); }).find("the expert factory built a routed expert"),
      std::string::npos);
}

}  // namespace
}  // namespace epmoe
