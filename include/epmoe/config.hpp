// MoeConfig: the dims and choices of one MoE layer (design.md §2), with presets and validation.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace epmoe {

enum class Scoring : std::uint8_t { sigmoid, softmax };
enum class QuantScheme : std::uint8_t { fp8, w4a8, none };
// A dispatcher serves one of normal (prefill: contiguous layout, high bandwidth) and low_latency
// (decode: masked layout, fixed buffers, no host sync, graph capturable). A layer may also be
// `automatic` ("auto"): it holds both and each forward names its batch kind (resolve_mode).
enum class Mode : std::uint8_t { normal, low_latency, automatic };
// What a forward's batch is, as an engine knows it: prefill (extend) or decode. Every rank of a
// collective forward must pass the same kind (the two modes move data through different buffers).
enum class BatchKind : std::uint8_t { prefill, decode };
enum class DispatchAlgorithm : std::uint8_t { static_choice, dynamic_choice };

std::string_view to_string(Scoring v);
std::string_view to_string(QuantScheme v);
std::string_view to_string(Mode v);
std::string_view to_string(BatchKind v);
std::string_view to_string(DispatchAlgorithm v);
Scoring parse_scoring(std::string_view s);
QuantScheme parse_quant(std::string_view s);
Mode parse_mode(std::string_view s);  // "normal", "low-latency" (or "low_latency"), "auto"
BatchKind parse_batch_kind(std::string_view s);
// The mode a forward of `kind` runs in on a layer of `mode`: automatic picks normal for prefill and
// low_latency for decode (SGLang's DeepEP "auto"); a fixed mode serves every kind.
Mode resolve_mode(Mode mode, BatchKind kind);
DispatchAlgorithm parse_dispatch_algorithm(std::string_view s);

inline constexpr int kQuantGroup = 128;  // K values per activation scale / weight block edge

struct MoeConfig {
  std::string name = "custom";
  std::int64_t hidden = 7168;          // H
  std::int64_t intermediate = 2048;    // I, per routed expert
  int num_experts = 256;               // E, logical routed experts
  int topk = 8;                        // K
  int num_groups = 8;                  // expert groups for grouped top-k (1 = plain top-k)
  int topk_groups = 4;                 // groups kept per token
  Scoring scoring = Scoring::sigmoid;  // sigmoid + correction bias (noaux_tc) or softmax
  bool renormalize = true;             // renormalise the top-k weights to sum 1
  float routed_scaling_factor = 2.5f;  // s, applied to the routing weights
  int num_shared_experts = 1;          // shared experts of width `intermediate`, fused into one MLP
  QuantScheme quant = QuantScheme::fp8;
  bool power_of_two_scales = false;  // UE8M0 activation scales

  // Expert parallelism.
  int num_ranks = 1;
  int num_redundant_experts = 0;  // R: physical slots = E + R
  int max_tokens_per_rank = 128;  // sizes the low-latency buffers
  DispatchAlgorithm dispatch_algorithm = DispatchAlgorithm::static_choice;

  static MoeConfig preset(std::string_view name);  // "deepseek-v3" or "tiny"
  static std::vector<std::string> preset_names();

  // Throws epmoe::Error naming the field and the rule, e.g. "hidden must be a multiple of 128".
  void validate() const;

  int num_physical_experts() const { return num_experts + num_redundant_experts; }
  int num_local_experts() const { return num_physical_experts() / num_ranks; }
  std::int64_t shared_intermediate() const { return intermediate * num_shared_experts; }
  // Worst-case rows any local expert can receive in low-latency mode (every token of every rank).
  std::int64_t masked_max_m() const { return static_cast<std::int64_t>(max_tokens_per_rank) * num_ranks; }
  std::string describe() const;
};

}  // namespace epmoe
