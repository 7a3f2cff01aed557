// Router: logits -> top-k logical expert ids and weights (design.md §5).
#pragma once

#include "epmoe/config.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe {

// The sigmoid every router uses, written with IEEE-exact operations only (no libm exp), so that
// the CPU reference and the GPU kernel produce the same bits.
float router_sigmoid(float x);

// DeepSeek-V3 "noaux_tc" (scoring = sigmoid) or softmax top-k (scoring = softmax).
//   logits            [T, E] f32 (host)
//   correction_bias   [E] f32, used by sigmoid scoring (may be an empty view for softmax)
//   topk_ids    (out) [T, K] i32 logical expert ids, ordered by decreasing selection score
//   topk_weights(out) [T, K] f32, renormalised when config.renormalize, times routed_scaling_factor
// Ties are broken towards the lower index, for groups and for experts.
// Non-finite logits or bias are refused with an epmoe::Error.
void route_cpu(const MoeConfig& config, TensorView logits, TensorView correction_bias, TensorView topk_ids,
               TensorView topk_weights);

// Gate GEMM on the CPU: logits[t, e] = Σ_h x[t, h] * gate[e, h], f32 accumulation.
//   x [T, H] bf16, gate_weight [E, H] bf16, logits (out) [T, E] f32
void router_logits_cpu(TensorView x, TensorView gate_weight, TensorView logits);

}  // namespace epmoe
