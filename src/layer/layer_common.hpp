// Steps the layer and the reference share, so that both quantize and route identically.
#pragma once

#include <string_view>

#include "epmoe/layer.hpp"

namespace epmoe::detail {

// x [T, H] bf16 -> logical top-k ids [T, K] i32 and weights [T, K] f32.
void route_tokens(const ModelWeights& weights, TensorView x, HostTensor& ids, HostTensor& topk_weights);
// The same from given gate logits [T, E] f32 (host).
void route_from_logits(const ModelWeights& weights, TensorView logits, HostTensor& ids,
                       HostTensor& topk_weights);

// Activations in the format the routed runner wants (design.md §4).
struct QuantizedTokens {
  HostTensor q, scales;    // fp8 formats
  float tensor_scale = 1;  // fp8_tensor
  TensorView x;            // the rows to send: q, or the bf16 input itself
};
QuantizedTokens quantize_tokens(ActivationFormat format, TensorView x, float a1_scale, bool power_of_two);

// The shared expert on x [T, H] bf16 -> out [T, H] (bf16 or f64).
void shared_expert_forward(const ModelWeights& weights, TensorView x, TensorView out, Numerics numerics);

// The name an overflowed output goes by in the error (x finite but too large for the layer's bf16 sums).
inline constexpr std::string_view kOverflowedOutput = "y (the layer's output; x is too large for bf16)";

}  // namespace epmoe::detail
