// Model weights as the CPU backend and the reference consume them, and a seeded synthetic model.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "epmoe/config.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe {

// How activations enter a GEMM. Follows from the quant scheme (design.md §4):
//   fp8  -> fp8_group  (per-token 1x128 scales)
//   w4a8 -> fp8_tensor (one static per-tensor scale per GEMM input)
//   none -> bf16
enum class ActivationFormat : std::uint8_t { bf16, fp8_group, fp8_tensor };
ActivationFormat activation_format(QuantScheme quant);

// One expert MLP (W13 = [gate; up], W2 = down) in checkpoint format:
//   fp8:  w13 [2I, H] fp8, w13_scale [2I/128, H/128] f32; w2 [H, I] fp8, w2_scale [H/128, I/128]
//   w4a8: w13 [2I, H/2] i4x2, w13_scale [2I, H/128] f32; w2 [H, I/2] i4x2, w2_scale [H, I/128]
//   none: w13 [2I, H] bf16; w2 [H, I] bf16 (no scales)
struct ExpertWeights {
  QuantScheme quant = QuantScheme::none;
  std::int64_t hidden = 0, intermediate = 0;
  HostTensor w13, w13_scale, w2, w2_scale;

  // Throws when the tensors do not have the shapes above for (quant, hidden, intermediate).
  void validate() const;
};

// Where the layer gets its weights from. Routed experts are addressed by logical id; their
// storage in physical slots is the runner's business.
class ModelWeights {
 public:
  virtual ~ModelWeights() = default;
  virtual const MoeConfig& config() const = 0;
  virtual const ExpertWeights& routed_expert(int logical) const = 0;
  // The fused shared-expert MLP (width shared_intermediate()); FP8 block-scaled unless quant=none,
  // as in the DeepSeek-R1-W4AFP8 checkpoint, whose shared expert stays FP8.
  virtual const ExpertWeights& shared_expert() const = 0;
  virtual TensorView gate_weight() const = 0;      // [E, H] bf16
  virtual TensorView correction_bias() const = 0;  // [E] f32
  // Static per-tensor FP8 scales of the W4A8 GEMM inputs (1.0 when unused).
  virtual float a1_scale() const = 0;
  virtual float a2_scale() const = 0;
};

// Deterministic synthetic weights: expert e's tensors depend only on (seed, e), and are built on
// first use, so a run at DeepSeek-V3 dims holds only the experts it touches.
class SyntheticWeights final : public ModelWeights {
 public:
  // Builds one expert from (quant, hidden, intermediate, expert seed); must give exactly the tensors
  // make_synthetic_expert gives (e.g. generated on a GPU and copied back, which is faster).
  using ExpertFactory =
      std::function<std::unique_ptr<ExpertWeights>(QuantScheme, std::int64_t, std::int64_t, std::uint64_t)>;

  SyntheticWeights(const MoeConfig& config, std::uint64_t seed);
  const MoeConfig& config() const override { return config_; }
  const ExpertWeights& routed_expert(int logical) const override;
  const ExpertWeights& shared_expert() const override;
  TensorView gate_weight() const override { return gate_weight_; }
  TensorView correction_bias() const override { return correction_bias_; }
  float a1_scale() const override { return a1_scale_; }
  float a2_scale() const override { return a2_scale_; }
  std::size_t experts_built() const;
  std::uint64_t seed() const { return seed_; }
  // The seed make_synthetic_expert gets for a routed expert, and for the shared expert (whose quant
  // is fp8 unless the model is unquantized).
  std::uint64_t expert_seed(int logical) const;
  std::uint64_t shared_seed() const;
  // A Zipf-like expert load for EPLB experiments: the expert of popularity rank j (a seeded
  // permutation) gets strength * -ln(1 + j) added to its correction bias, so the router prefers the
  // popular ones (bias changes selection only, not the weights). Call before the weights are used.
  void skew_routing(double strength);
  // Replaces how experts not built yet are built (call before the first routed_expert()).
  void set_expert_factory(ExpertFactory factory) { factory_ = std::move(factory); }

 private:
  MoeConfig config_;
  std::uint64_t seed_;
  HostTensor gate_weight_, correction_bias_;
  float a1_scale_ = 1.0f, a2_scale_ = 1.0f;
  mutable std::mutex mutex_;
  mutable std::unordered_map<int, std::unique_ptr<ExpertWeights>> experts_;
  mutable std::unique_ptr<ExpertWeights> shared_;
  ExpertFactory factory_;
};

// Builds one expert in `quant` format from seeded f32 values (uniform in ±bound, bound = 1/sqrt(K)).
std::unique_ptr<ExpertWeights> make_synthetic_expert(QuantScheme quant, std::int64_t hidden,
                                                     std::int64_t intermediate, std::uint64_t seed);

// Seeded token batch [tokens, H] bf16 with values in about ±kSyntheticInputBound, never all zero.
inline constexpr float kSyntheticInputBound = 4.0f;
HostTensor synthetic_tokens(const MoeConfig& config, std::uint64_t seed, int rank, std::int64_t tokens);

// Counter-based generator shared by everything synthetic: value i of stream `stream`.
std::uint64_t mix64(std::uint64_t x);
float uniform_pm1(std::uint64_t stream, std::uint64_t i);  // in [-1, 1)

}  // namespace epmoe
