#include "layer/layer_common.hpp"

#include "epmoe/quant.hpp"
#include "epmoe/router.hpp"

namespace epmoe::detail {

void route_tokens(const ModelWeights& weights, TensorView x, HostTensor& ids, HostTensor& topk_weights) {
  const MoeConfig& c = weights.config();
  const std::int64_t T = x.size(0);
  HostTensor logits(DType::f32, {T, c.num_experts});
  router_logits_cpu(x, weights.gate_weight(), logits);
  route_from_logits(weights, logits, ids, topk_weights);
}

void route_from_logits(const ModelWeights& weights, TensorView logits, HostTensor& ids,
                       HostTensor& topk_weights) {
  const MoeConfig& c = weights.config();
  const std::int64_t T = logits.size(0);
  ids = HostTensor(DType::i32, {T, c.topk});
  topk_weights = HostTensor(DType::f32, {T, c.topk});
  route_cpu(c, logits, weights.correction_bias(), ids, topk_weights);
}

QuantizedTokens quantize_tokens(ActivationFormat format, TensorView x, float a1_scale, bool power_of_two) {
  QuantizedTokens out;
  const std::int64_t T = x.size(0), H = x.size(1);
  switch (format) {
    case ActivationFormat::bf16:
      out.x = x;
      break;
    case ActivationFormat::fp8_group:
      out.q = HostTensor(DType::fp8_e4m3, {T, H});
      out.scales = HostTensor(DType::f32, {T, H / 128});
      quantize_per_token_group_fp8(x, out.q, out.scales, 128, power_of_two);
      out.x = out.q;
      break;
    case ActivationFormat::fp8_tensor:
      out.q = HostTensor(DType::fp8_e4m3, {T, H});
      out.tensor_scale = a1_scale;
      quantize_per_tensor_fp8(x, out.q, a1_scale);
      out.x = out.q;
      break;
  }
  return out;
}

void shared_expert_forward(const ModelWeights& weights, TensorView x, TensorView out, Numerics numerics) {
  const MoeConfig& c = weights.config();
  const ExpertWeights& shared = weights.shared_expert();
  // The shared expert is FP8 block-scaled unless the model is unquantized (weights.hpp).
  const ActivationFormat format =
      shared.quant == QuantScheme::none ? ActivationFormat::bf16 : ActivationFormat::fp8_group;
  const QuantizedTokens q = quantize_tokens(format, x, 1.0f, c.power_of_two_scales);
  expert_mlp_cpu(shared, format, q.x, q.scales, 1.0f, 1.0f, c.power_of_two_scales, numerics, out);
}

}  // namespace epmoe::detail
