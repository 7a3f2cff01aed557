#include <algorithm>
#include <cmath>
#include <string_view>
#include <vector>

#include "core/parallel.hpp"
#include "epmoe/quant.hpp"
#include "epmoe/runner.hpp"
#include "epmoe/weights.hpp"
#include "weights/synthetic_math.hpp"

namespace epmoe {

ActivationFormat activation_format(QuantScheme quant) {
  switch (quant) {
    case QuantScheme::fp8:
      return ActivationFormat::fp8_group;
    case QuantScheme::w4a8:
      return ActivationFormat::fp8_tensor;
    case QuantScheme::none:
      return ActivationFormat::bf16;
  }
  EPMOE_FAIL("unknown quant scheme {}", static_cast<int>(quant));
}

namespace {
// The dims of every expert (both GEMMs' N and K on the 128 grid); `what` names the caller.
void expect_expert_dims(std::int64_t hidden, std::int64_t intermediate, std::string_view what) {
  EPMOE_CHECK(hidden > 0 && hidden % kQuantGroup == 0 && intermediate > 0 && intermediate % kQuantGroup == 0,
              "{}: hidden and intermediate must be positive multiples of {}, got {} and {}", what,
              kQuantGroup, hidden, intermediate);
}
}  // namespace

void ExpertWeights::validate() const {
  const std::int64_t H = hidden, I = intermediate;
  expect_expert_dims(H, I, "ExpertWeights");
  switch (quant) {
    case QuantScheme::fp8:
      expect_dtype(w13, DType::fp8_e4m3, "w13");
      expect_shape(w13, {2 * I, H}, "w13");
      expect_dtype(w13_scale, DType::f32, "w13_scale");
      expect_shape(w13_scale, {2 * I / 128, H / 128}, "w13_scale");
      expect_dtype(w2, DType::fp8_e4m3, "w2");
      expect_shape(w2, {H, I}, "w2");
      expect_dtype(w2_scale, DType::f32, "w2_scale");
      expect_shape(w2_scale, {H / 128, I / 128}, "w2_scale");
      break;
    case QuantScheme::w4a8:
      expect_dtype(w13, DType::i4x2, "w13");
      expect_shape(w13, {2 * I, H / 2}, "w13");
      expect_dtype(w13_scale, DType::f32, "w13_scale");
      expect_shape(w13_scale, {2 * I, H / 128}, "w13_scale");
      expect_dtype(w2, DType::i4x2, "w2");
      expect_shape(w2, {H, I / 2}, "w2");
      expect_dtype(w2_scale, DType::f32, "w2_scale");
      expect_shape(w2_scale, {H, I / 128}, "w2_scale");
      break;
    case QuantScheme::none:
      expect_dtype(w13, DType::bf16, "w13");
      expect_shape(w13, {2 * I, H}, "w13");
      expect_dtype(w2, DType::bf16, "w2");
      expect_shape(w2, {H, I}, "w2");
      break;
  }
}

std::uint64_t mix64(std::uint64_t x) {
  return detail::splitmix64(x);
}

float uniform_pm1(std::uint64_t stream, std::uint64_t i) {
  return detail::synth_uniform_pm1(stream, i);
}

namespace {

using namespace detail;  // the stream tags

std::uint64_t stream_id(std::uint64_t seed, std::uint64_t tag, std::uint64_t index) {
  return mix64(mix64(seed * 0x100000001b3ull + tag) + index);
}

// Row-blocks of 128 (the FP8 scale block) of an [N, K] matrix over the cores: every element is
// computed by one thread, so the bits do not depend on the thread count. A DeepSeek-V3 expert on one
// core took ~0.8 s, most of the W4A8 start-up (its activation scale is calibrated on one expert).
template <class Fn>
void for_row_blocks(std::int64_t rows, std::int64_t cols, const Fn& fn) {
  constexpr std::int64_t kRows = 128;
  const auto blocks = (rows + kRows - 1) / kRows;
  parallel_chunks(
      blocks, 1, threads_for(static_cast<double>(rows) * static_cast<double>(cols), 1 << 21),
      [&](std::int64_t b0, std::int64_t b1) { fn(b0, b1, b0 * kRows, std::min(rows, b1 * kRows)); });
}

HostTensor random_matrix(std::uint64_t stream, std::int64_t rows, std::int64_t cols, float bound) {
  HostTensor w(DType::f32, {rows, cols});
  float* p = w.data<float>();
  for_row_blocks(rows, cols, [&](std::int64_t, std::int64_t, std::int64_t r0, std::int64_t r1) {
    for (std::int64_t i = r0 * cols; i < r1 * cols; ++i)
      p[i] = bound * uniform_pm1(stream, static_cast<std::uint64_t>(i));
  });
  return w;
}

// Quantizes an f32 [N, K] matrix into the checkpoint format of `quant`.
void quantize_matrix(QuantScheme quant, const HostTensor& w, HostTensor& q, HostTensor& scale) {
  const std::int64_t N = w.size(0), K = w.size(1);
  switch (quant) {
    case QuantScheme::fp8:
      q = HostTensor(DType::fp8_e4m3, {N, K});
      scale = HostTensor(DType::f32, {(N + 127) / 128, K / 128});
      for_row_blocks(N, K, [&](std::int64_t b0, std::int64_t b1, std::int64_t r0, std::int64_t r1) {
        quantize_block_fp8(w.view().slice_rows(r0, r1), q.view().slice_rows(r0, r1),
                           scale.view().slice_rows(b0, b1));
      });
      break;
    case QuantScheme::w4a8:
      q = HostTensor(DType::i4x2, {N, K / 2});
      scale = HostTensor(DType::f32, {N, K / 128});
      for_row_blocks(N, K, [&](std::int64_t, std::int64_t, std::int64_t r0, std::int64_t r1) {
        quantize_int4_grouped(w.view().slice_rows(r0, r1), q.view().slice_rows(r0, r1),
                              scale.view().slice_rows(r0, r1));
      });
      break;
    case QuantScheme::none:
      q = to_bf16(w);
      break;
  }
}

}  // namespace

std::unique_ptr<ExpertWeights> make_synthetic_expert(QuantScheme quant, std::int64_t hidden,
                                                     std::int64_t intermediate, std::uint64_t seed) {
  expect_expert_dims(hidden, intermediate, "make_synthetic_expert");  // (before any matrix is drawn)
  auto e = std::make_unique<ExpertWeights>();
  e->quant = quant;
  e->hidden = hidden;
  e->intermediate = intermediate;
  {
    HostTensor w13 = random_matrix(mix64(seed ^ kTagW13), 2 * intermediate, hidden,
                                   1.0f / std::sqrt(static_cast<float>(hidden)));
    quantize_matrix(quant, w13, e->w13, e->w13_scale);
  }
  {
    HostTensor w2 = random_matrix(mix64(seed ^ kTagW2), hidden, intermediate,
                                  1.0f / std::sqrt(static_cast<float>(intermediate)));
    quantize_matrix(quant, w2, e->w2, e->w2_scale);
  }
  e->validate();
  return e;
}

SyntheticWeights::SyntheticWeights(const MoeConfig& config, std::uint64_t seed)
    : config_(config), seed_(seed) {
  config_.validate();
  const std::int64_t E = config_.num_experts, H = config_.hidden;
  // Gate rows of norm ~2 give logits of spread ~3 on the synthetic tokens: routing is far from uniform.
  HostTensor gate =
      random_matrix(stream_id(seed, kTagGate, 0), E, H, 2.0f / std::sqrt(static_cast<float>(H)));
  gate_weight_ = to_bf16(gate);
  correction_bias_ = HostTensor(DType::f32, {E});
  for (std::int64_t e = 0; e < E; ++e)
    correction_bias_.data<float>()[e] =
        0.05f * uniform_pm1(stream_id(seed, kTagBias, 0), static_cast<std::uint64_t>(e));

  if (config_.quant == QuantScheme::w4a8) {
    // Static activation scales, as a W4AFP8 checkpoint ships them: a1 covers the synthetic token
    // range; a2 is calibrated on a batch through expert 0 with 2x headroom.
    a1_scale_ = kSyntheticInputBound / kFp8E4m3Max;
    const std::int64_t I = config_.intermediate;
    constexpr std::int64_t calib = 32;
    HostTensor x = synthetic_tokens(config_, seed ^ kTagCalib, /*rank=*/0, calib);
    const ExpertWeights& e0 = routed_expert(0);
    HostTensor w13(DType::f32, {2 * I, H});
    for_row_blocks(2 * I, H, [&](std::int64_t, std::int64_t, std::int64_t r0, std::int64_t r1) {
      dequantize_int4_grouped(e0.w13.view().slice_rows(r0, r1), e0.w13_scale.view().slice_rows(r0, r1),
                              w13.view().slice_rows(r0, r1));
    });
    // The tokens transposed ([H][calib] f32), so that one pass over each weight row feeds all of them:
    // the innermost loop runs over independent per-token sums, which the compiler vectorizes (the
    // calibration runs at every start-up of a W4A8 model and must stay well under the 1 s budget; f32
    // sums of 7168 products are plenty for a 2x-headroom amax).
    std::vector<float> xt(static_cast<std::size_t>(H * calib));
    for (std::int64_t t = 0; t < calib; ++t)
      for (std::int64_t h = 0; h < H; ++h)
        xt[static_cast<std::size_t>(h * calib + t)] = x.data<bf16>()[t * H + h].to_float();
    // One amax per 128 intermediate columns (each column summed by one thread in one order), then the max.
    std::vector<float> block_amax(static_cast<std::size_t>((I + 127) / 128), 0.0f);
    for_row_blocks(I, 2 * H * calib, [&](std::int64_t b0, std::int64_t, std::int64_t j0, std::int64_t j1) {
      float amax = 0.0f;
      for (std::int64_t j = j0; j < j1; ++j) {
        float g[calib] = {}, u[calib] = {};
        const float* wg = w13.data<float>() + j * H;
        const float* wu = w13.data<float>() + (I + j) * H;
        for (std::int64_t h = 0; h < H; ++h) {
          const float* xh = xt.data() + h * calib;
          for (std::int64_t t = 0; t < calib; ++t) {
            g[t] += xh[t] * wg[h];
            u[t] += xh[t] * wu[h];
          }
        }
        for (std::int64_t t = 0; t < calib; ++t) {
          const double gv = g[t];
          amax = std::max(amax, static_cast<float>(std::fabs(gv / (1.0 + std::exp(-gv)) * u[t])));
        }
      }
      block_amax[static_cast<std::size_t>(b0)] = amax;
    });
    const float amax = *std::max_element(block_amax.begin(), block_amax.end());
    a2_scale_ = std::max(2.0f * amax, 1e-6f) / kFp8E4m3Max;
  }
}

namespace {
// What a factory built matches what was asked (a custom factory's mistake is named here, not found as
// an out-of-bounds read in a GEMM).
std::unique_ptr<ExpertWeights> checked_expert(std::unique_ptr<ExpertWeights> expert, QuantScheme quant,
                                              std::int64_t hidden, std::int64_t intermediate,
                                              std::string_view what) {
  EPMOE_CHECK(expert != nullptr, "the expert factory returned no {}", what);
  EPMOE_CHECK(expert->quant == quant && expert->hidden == hidden && expert->intermediate == intermediate,
              "the expert factory built {} as {} H={} I={}, asked for {} H={} I={}", what,
              to_string(expert->quant), expert->hidden, expert->intermediate, to_string(quant), hidden,
              intermediate);
  expert->validate();
  return expert;
}
}  // namespace

const ExpertWeights& SyntheticWeights::routed_expert(int logical) const {
  EPMOE_CHECK(logical >= 0 && logical < config_.num_experts, "logical expert id must be in [0, {}), got {}",
              config_.num_experts, logical);
  std::lock_guard lock(mutex_);
  auto& slot = experts_[logical];
  if (!slot) {
    slot = factory_ ? checked_expert(
                          factory_(config_.quant, config_.hidden, config_.intermediate, expert_seed(logical)),
                          config_.quant, config_.hidden, config_.intermediate, "a routed expert")
                    : make_synthetic_expert(config_.quant, config_.hidden, config_.intermediate,
                                            expert_seed(logical));
  }
  return *slot;
}

const ExpertWeights& SyntheticWeights::shared_expert() const {
  EPMOE_CHECK(config_.num_shared_experts > 0, "the config has no shared expert (shared_experts = 0)");
  std::lock_guard lock(mutex_);
  if (!shared_) {
    const QuantScheme quant = config_.quant == QuantScheme::none ? QuantScheme::none : QuantScheme::fp8;
    shared_ =
        factory_
            ? checked_expert(factory_(quant, config_.hidden, config_.shared_intermediate(), shared_seed()),
                             quant, config_.hidden, config_.shared_intermediate(), "the shared expert")
            : make_synthetic_expert(quant, config_.hidden, config_.shared_intermediate(), shared_seed());
  }
  return *shared_;
}

std::uint64_t SyntheticWeights::expert_seed(int logical) const {
  EPMOE_CHECK(logical >= 0 && logical < config_.num_experts, "logical expert id must be in [0, {}), got {}",
              config_.num_experts, logical);
  return stream_id(seed_, kTagW13, static_cast<std::uint64_t>(logical));
}

void SyntheticWeights::skew_routing(double strength) {
  EPMOE_CHECK(std::isfinite(strength) && strength >= 0 && strength <= 1e6,
              "routing skew must be in [0, 1e6] (a bias past f32's range routes nothing), got {}", strength);
  const int E = config_.num_experts;
  std::vector<int> order(static_cast<std::size_t>(E));
  for (int e = 0; e < E; ++e) order[static_cast<std::size_t>(e)] = e;
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return mix64(seed_ ^ (0x5eed0000ull + static_cast<std::uint64_t>(a))) <
           mix64(seed_ ^ (0x5eed0000ull + static_cast<std::uint64_t>(b)));
  });
  for (int j = 0; j < E; ++j)
    correction_bias_.data<float>()[order[static_cast<std::size_t>(j)]] +=
        static_cast<float>(-strength * std::log1p(static_cast<double>(j)));
}

std::uint64_t SyntheticWeights::shared_seed() const {
  return stream_id(seed_, kTagShared, 0);
}

std::size_t SyntheticWeights::experts_built() const {
  std::lock_guard lock(mutex_);
  return experts_.size();
}

HostTensor synthetic_tokens(const MoeConfig& config, std::uint64_t seed, int rank, std::int64_t tokens) {
  EPMOE_CHECK(tokens >= 0, "tokens must be >= 0, got {}", tokens);
  const std::int64_t H = config.hidden;
  HostTensor x(DType::bf16, {tokens, H});
  const std::uint64_t stream = stream_id(seed, kTagTokens, static_cast<std::uint64_t>(rank));
  for (std::int64_t i = 0; i < tokens * H; ++i) {
    // Mostly moderate values with an occasional outlier channel, as real activations have.
    float v = uniform_pm1(stream, static_cast<std::uint64_t>(i));
    v = (i % 97 == 13) ? kSyntheticInputBound * v : v;
    if (v == 0.0f) v = 0.5f;
    x.data<bf16>()[i] = bf16::from_float(v);
  }
  return x;
}

}  // namespace epmoe
