#include "epmoe/config.hpp"

#include "epmoe/error.hpp"

namespace epmoe {

std::string_view to_string(Scoring v) {
  return v == Scoring::sigmoid ? "sigmoid" : "softmax";
}
std::string_view to_string(QuantScheme v) {
  switch (v) {
    case QuantScheme::fp8:
      return "fp8";
    case QuantScheme::w4a8:
      return "w4a8";
    case QuantScheme::none:
      return "none";
  }
  return "?";
}
std::string_view to_string(Mode v) {
  switch (v) {
    case Mode::normal:
      return "normal";
    case Mode::low_latency:
      return "low-latency";
    case Mode::automatic:
      return "auto";
  }
  return "?";
}
std::string_view to_string(BatchKind v) {
  return v == BatchKind::prefill ? "prefill" : "decode";
}
std::string_view to_string(DispatchAlgorithm v) {
  return v == DispatchAlgorithm::static_choice ? "static" : "dynamic";
}

Scoring parse_scoring(std::string_view s) {
  if (s == "sigmoid") return Scoring::sigmoid;
  if (s == "softmax") return Scoring::softmax;
  EPMOE_FAIL("scoring must be 'sigmoid' or 'softmax', got '{}'", s);
}
QuantScheme parse_quant(std::string_view s) {
  if (s == "fp8") return QuantScheme::fp8;
  if (s == "w4a8") return QuantScheme::w4a8;
  if (s == "none") return QuantScheme::none;
  EPMOE_FAIL("quant must be 'fp8', 'w4a8' or 'none', got '{}'", s);
}
Mode parse_mode(std::string_view s) {
  if (s == "normal") return Mode::normal;
  if (s == "low-latency" || s == "low_latency") return Mode::low_latency;
  if (s == "auto") return Mode::automatic;
  EPMOE_FAIL("mode must be 'normal', 'low-latency' or 'auto', got '{}'", s);
}
BatchKind parse_batch_kind(std::string_view s) {
  if (s == "prefill") return BatchKind::prefill;
  if (s == "decode") return BatchKind::decode;
  EPMOE_FAIL("batch kind must be 'prefill' or 'decode', got '{}'", s);
}
Mode resolve_mode(Mode mode, BatchKind kind) {
  if (mode != Mode::automatic) return mode;
  return kind == BatchKind::prefill ? Mode::normal : Mode::low_latency;
}
DispatchAlgorithm parse_dispatch_algorithm(std::string_view s) {
  if (s == "static") return DispatchAlgorithm::static_choice;
  if (s == "dynamic") return DispatchAlgorithm::dynamic_choice;
  EPMOE_FAIL("dispatch_algorithm must be 'static' or 'dynamic', got '{}'", s);
}

MoeConfig MoeConfig::preset(std::string_view name) {
  MoeConfig c;
  if (name == "deepseek-v3") {
    c.name = "deepseek-v3";
    return c;  // the defaults are DeepSeek-V3's
  }
  if (name == "tiny") {
    c.name = "tiny";
    c.hidden = 256;
    c.intermediate = 128;
    c.num_experts = 16;
    c.topk = 4;
    c.num_groups = 4;
    c.topk_groups = 2;
    c.max_tokens_per_rank = 64;
    return c;
  }
  EPMOE_FAIL("preset must be one of 'deepseek-v3', 'tiny', got '{}'", name);
}

std::vector<std::string> MoeConfig::preset_names() {
  return {"deepseek-v3", "tiny"};
}

void MoeConfig::validate() const {
  // Upper bounds far above any model (DeepSeek-V3: H 7168, I 2048, 256 experts), so that every product
  // the layer forms (H x I x experts, tokens x ranks, E + R) stays inside int64 / int.
  constexpr std::int64_t kMaxDim = std::int64_t{1} << 20;
  constexpr int kMaxCount = 1 << 20;
  EPMOE_CHECK(hidden > 0 && hidden % kQuantGroup == 0 && hidden <= kMaxDim,
              "hidden must be a positive multiple of {} and <= {}, got {}", kQuantGroup, kMaxDim, hidden);
  EPMOE_CHECK(intermediate > 0 && intermediate % kQuantGroup == 0 && intermediate <= kMaxDim,
              "intermediate must be a positive multiple of {} and <= {}, got {}", kQuantGroup, kMaxDim,
              intermediate);
  EPMOE_CHECK(num_experts >= 1 && num_experts <= kMaxCount, "experts must be in [1, {}], got {}", kMaxCount,
              num_experts);
  EPMOE_CHECK(topk >= 1 && topk <= num_experts, "topk must be in [1, experts={}], got {}", num_experts, topk);
  EPMOE_CHECK(num_groups >= 1 && num_experts % num_groups == 0,
              "groups must be >= 1 and divide experts={}, got {}", num_experts, num_groups);
  EPMOE_CHECK(topk_groups >= 1 && topk_groups <= num_groups, "topk_groups must be in [1, groups={}], got {}",
              num_groups, topk_groups);
  const int experts_per_group = num_experts / num_groups;
  EPMOE_CHECK(static_cast<std::int64_t>(topk_groups) * experts_per_group >= topk,
              "topk_groups * experts per group ({} * {}) must be >= topk={}", topk_groups, experts_per_group,
              topk);
  if (scoring == Scoring::sigmoid && num_groups > 1) {
    EPMOE_CHECK(
        experts_per_group >= 2,
        "grouped sigmoid routing sums the top-2 scores of each group: experts per group must be >= 2, "
        "got {}",
        experts_per_group);
  }
  EPMOE_CHECK(routed_scaling_factor > 0.0f && routed_scaling_factor < 1e6f,
              "routed_scaling_factor must be positive and finite, got {}", routed_scaling_factor);
  EPMOE_CHECK(num_shared_experts >= 0 && shared_intermediate() <= kMaxDim,
              "shared_experts must be >= 0 with shared_experts x intermediate <= {}, got {} x {}", kMaxDim,
              num_shared_experts, intermediate);
  EPMOE_CHECK(num_ranks >= 1 && num_ranks <= kMaxCount, "ranks must be in [1, {}], got {}", kMaxCount,
              num_ranks);
  EPMOE_CHECK(num_redundant_experts >= 0 && num_redundant_experts <= kMaxCount,
              "redundant_experts must be in [0, {}], got {}", kMaxCount, num_redundant_experts);
  EPMOE_CHECK(num_physical_experts() % num_ranks == 0,
              "experts + redundant_experts ({} + {}) must be a multiple of ranks={}", num_experts,
              num_redundant_experts, num_ranks);
  constexpr int kMaxTokens = 1 << 30;
  EPMOE_CHECK(max_tokens_per_rank >= 1 && max_tokens_per_rank <= kMaxTokens,
              "max_tokens_per_rank must be in [1, {}], got {}", kMaxTokens, max_tokens_per_rank);
}

std::string MoeConfig::describe() const {
  return fmt::format(
      "{}: H={} I={} experts={} topk={} groups={}/{} scoring={} s={} shared={} quant={} ranks={} "
      "redundant={} max_tokens_per_rank={} dispatch={}{}{}",
      name, hidden, intermediate, num_experts, topk, num_groups, topk_groups, to_string(scoring),
      routed_scaling_factor, num_shared_experts, to_string(quant), num_ranks, num_redundant_experts,
      max_tokens_per_rank, to_string(dispatch_algorithm), renormalize ? "" : " renormalize=off",
      power_of_two_scales ? " pow2_scales=on" : "");
}

}  // namespace epmoe
