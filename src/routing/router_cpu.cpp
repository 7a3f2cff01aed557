// CPU reference router (design.md §5): DeepSeek-V3 "noaux_tc" sigmoid routing and softmax top-k,
// both with optional group-limited selection, plus the f32 gate GEMM.
//
// Selection order everywhere is a strict total order: higher value first, ties to the lower index.
// Hence the result does not depend on the sorting algorithm, and a GPU kernel that uses the same
// order (and, for sigmoid, the same f32 operation sequence) reproduces ids and weights bit for bit.
#include "epmoe/router.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "epmoe/error.hpp"
#include "routing/router_math.hpp"

namespace epmoe {

float router_sigmoid(float x) {
  return routing::sigmoid_f32(x);
}

namespace {

// The first `count` indices of [0, n) with keep[i] set, ordered by (value desc, index asc).
void select_top(const float* value, const std::uint8_t* keep, int n, int count, std::vector<int>& order,
                std::vector<int>& out) {
  order.clear();
  for (int i = 0; i < n; ++i)
    if (keep == nullptr || keep[i]) order.push_back(i);
  EPMOE_CHECK(static_cast<int>(order.size()) >= count, "router: {} candidates for top-{}", order.size(),
              count);
  const auto better = [value](int a, int b) {
    return value[a] > value[b] || (value[a] == value[b] && a < b);
  };
  std::partial_sort(order.begin(), order.begin() + count, order.end(), better);
  out.assign(order.begin(), order.begin() + count);
}

struct Workspace {
  std::vector<float> score;        // [E] unbiased scores (the weights come from these)
  std::vector<float> choice;       // [E] selection scores (biased for sigmoid, = score for softmax)
  std::vector<float> group_score;  // [G]
  std::vector<std::uint8_t> keep;  // [E] expert lies in a kept group
  std::vector<int> order, groups, experts;
};

void route_token(const MoeConfig& c, const float* logit, const float* bias, std::int32_t* ids, float* weights,
                 Workspace& ws) {
  const int num_experts = c.num_experts;
  const int k = c.topk;
  float* score = ws.score.data();
  float* choice = ws.choice.data();

  if (c.scoring == Scoring::sigmoid) {
    for (int e = 0; e < num_experts; ++e) {
      score[e] = router_sigmoid(logit[e]);
      choice[e] = score[e] + bias[e];
    }
  } else {
    // Softmax with std::exp: the GPU softmax path is checked against this within a tolerance, not
    // bitwise (its exp and its reduction order differ). Max-subtracted, sums in index order.
    float max_logit = logit[0];
    for (int e = 1; e < num_experts; ++e) max_logit = std::max(max_logit, logit[e]);
    float sum = 0.0f;
    for (int e = 0; e < num_experts; ++e) {
      score[e] = std::exp(logit[e] - max_logit);
      sum += score[e];
    }
    for (int e = 0; e < num_experts; ++e) {
      score[e] = score[e] / sum;
      choice[e] = score[e];
    }
  }

  const std::uint8_t* keep = nullptr;
  if (c.num_groups > 1) {
    const int per_group = num_experts / c.num_groups;
    for (int g = 0; g < c.num_groups; ++g) {
      const float* v = choice + static_cast<std::ptrdiff_t>(g) * per_group;
      if (c.scoring == Scoring::sigmoid) {
        // Sum of the two largest (a tie counts twice), the larger first.
        float top1 = v[0] >= v[1] ? v[0] : v[1];
        float top2 = v[0] >= v[1] ? v[1] : v[0];
        for (int i = 2; i < per_group; ++i) {
          if (v[i] > top1) {
            top2 = top1;
            top1 = v[i];
          } else if (v[i] > top2) {
            top2 = v[i];
          }
        }
        ws.group_score[g] = top1 + top2;
      } else {
        float top1 = v[0];
        for (int i = 1; i < per_group; ++i) top1 = std::max(top1, v[i]);
        ws.group_score[g] = top1;
      }
    }
    select_top(ws.group_score.data(), nullptr, c.num_groups, c.topk_groups, ws.order, ws.groups);
    std::fill(ws.keep.begin(), ws.keep.end(), std::uint8_t{0});
    for (int g : ws.groups)
      std::fill_n(ws.keep.begin() + static_cast<std::ptrdiff_t>(g) * per_group, per_group, std::uint8_t{1});
    keep = ws.keep.data();
  }

  select_top(choice, keep, num_experts, k, ws.order, ws.experts);

  // Weights: the unbiased scores of the chosen experts; the renormalising sum runs in selection order.
  float sum = 0.0f;
  for (int i = 0; i < k; ++i) sum += score[ws.experts[i]];
  const bool renormalize = c.renormalize;
  for (int i = 0; i < k; ++i) {
    float w = score[ws.experts[i]];
    if (renormalize) {
      // sum == 0 only when every chosen sigmoid score underflowed (logits below about -104): fall back
      // to equal weights rather than produce NaN.
      w = sum > 0.0f ? w / sum : 1.0f / static_cast<float>(k);
    }
    ids[i] = ws.experts[i];
    weights[i] = w * c.routed_scaling_factor;
  }
}

}  // namespace

void route_cpu(const MoeConfig& config, TensorView logits, TensorView correction_bias, TensorView topk_ids,
               TensorView topk_weights) {
  config.validate();
  const std::int64_t num_experts = config.num_experts;
  const std::int64_t k = config.topk;
  expect_rank(logits, 2, "logits");
  const std::int64_t tokens = logits.shape[0];
  expect_host_tensor(logits, DType::f32, {tokens, num_experts}, "logits");
  expect_host_tensor(topk_ids, DType::i32, {tokens, k}, "topk_ids");
  expect_host_tensor(topk_weights, DType::f32, {tokens, k}, "topk_weights");
  expect_finite(logits, "logits");
  const float* bias = nullptr;
  if (config.scoring == Scoring::sigmoid) {
    EPMOE_CHECK(!correction_bias.empty_view(), "correction_bias [{}] f32 is required for sigmoid scoring",
                num_experts);
    expect_host_tensor(correction_bias, DType::f32, {num_experts}, "correction_bias");
    expect_finite(correction_bias, "correction_bias");
    bias = correction_bias.as<float>();
  }  // softmax scoring ignores correction_bias

  Workspace ws;
  ws.score.resize(num_experts);
  ws.choice.resize(num_experts);
  ws.group_score.resize(config.num_groups);
  ws.keep.resize(num_experts);
  ws.order.reserve(num_experts);
  const float* logit = logits.as<float>();
  std::int32_t* ids = topk_ids.as<std::int32_t>();
  float* weights = topk_weights.as<float>();
  for (std::int64_t t = 0; t < tokens; ++t) {
    route_token(config, logit + t * num_experts, bias, ids + t * k, weights + t * k, ws);
  }
}

void router_logits_cpu(TensorView x, TensorView gate_weight, TensorView logits) {
  expect_rank(x, 2, "x");
  expect_rank(gate_weight, 2, "gate_weight");
  const std::int64_t tokens = x.shape[0];
  const std::int64_t hidden = x.shape[1];
  const std::int64_t num_experts = gate_weight.shape[0];
  expect_host_tensor(x, DType::bf16, {tokens, hidden}, "x");
  expect_host_tensor(gate_weight, DType::bf16, {num_experts, hidden}, "gate_weight");
  expect_host_tensor(logits, DType::f32, {tokens, num_experts}, "logits");
  expect_finite(x, "x");
  expect_finite(gate_weight, "gate_weight");

  std::vector<float> xf(static_cast<std::size_t>(hidden));
  std::vector<float> gate(static_cast<std::size_t>(num_experts * hidden));
  const bf16* g = gate_weight.as<bf16>();
  for (std::size_t i = 0; i < gate.size(); ++i) gate[i] = g[i].to_float();
  const bf16* xs = x.as<bf16>();
  float* out = logits.as<float>();
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t h = 0; h < hidden; ++h) xf[h] = xs[t * hidden + h].to_float();
    for (std::int64_t e = 0; e < num_experts; ++e) {
      const float* w = gate.data() + e * hidden;
      float acc = 0.0f;
      for (std::int64_t h = 0; h < hidden; ++h) {
        const float product = xf[h] * w[h];  // rounded, then added: no FMA (ISO mode, no contraction)
        acc += product;
      }
      // Finite inputs can still overflow f32 in the sum: a logit the router would then rank as NaN.
      EPMOE_CHECK(std::isfinite(acc),
                  "logits[{}, {}] = {}: the dot product of x's token and gate_weight's row overflows f32", t,
                  e, acc);
      out[t * num_experts + e] = acc;
    }
  }
}

}  // namespace epmoe
