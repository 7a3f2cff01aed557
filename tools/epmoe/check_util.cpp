#include "tools/epmoe/check_util.hpp"

#include <cstring>

#include "bench/bench.hpp"

namespace epmoe::tools {

CheckResult check_against_reference(const ModelWeights& weights, std::span<const TensorView> x,
                                    std::span<const TensorView> y, Numerics numerics, double tolerance,
                                    const std::function<void(std::size_t rank)>& on_rank) {
  EPMOE_CHECK(y.size() == x.size(), "check_against_reference needs one y per x ({}), got {}", x.size(),
              y.size());
  CheckResult result;
  result.tolerance = tolerance;
  const std::int64_t H = weights.config().hidden;
  std::int64_t total = 0;
  for (const TensorView& xr : x) total += xr.size(0);
  // Everything in f64 so the overall measure sees every rank's rows together.
  HostTensor all_actual(DType::f64, {total, H}), all_expected(DType::f64, {total, H});
  std::int64_t offset = 0;
  for (std::size_t r = 0; r < x.size(); ++r) {
    if (on_rank) on_rank(r);
    const std::int64_t T = x[r].size(0);
    HostTensor expected(numerics == Numerics::mirror ? DType::bf16 : DType::f64, {T, H});
    reference_forward(weights, x[r], expected, numerics);
    result.per_rank.push_back(compare(y[r], expected));
    for (std::int64_t i = 0; i < T * H; ++i) {
      all_actual.data<double>()[offset + i] = y[r].as<bf16>()[i].to_float();
      all_expected.data<double>()[offset + i] = numerics == Numerics::mirror
                                                    ? static_cast<double>(expected.data<bf16>()[i].to_float())
                                                    : expected.data<double>()[i];
    }
    offset += T * H;
  }
  result.overall = compare(all_actual, all_expected);
  result.pass = result.overall.within(tolerance);
  for (const ErrorReport& r : result.per_rank) result.pass = result.pass && r.within(tolerance);
  return result;
}

nlohmann::json model_json(const MoeConfig& c, const ModelOptions& o) {
  return {{"preset", c.name},
          {"hidden", c.hidden},
          {"intermediate", c.intermediate},
          {"experts", c.num_experts},
          {"topk", c.topk},
          {"groups", c.num_groups},
          {"topk_groups", c.topk_groups},
          {"scoring", to_string(c.scoring)},
          {"renormalize", c.renormalize},
          {"routed_scaling_factor", c.routed_scaling_factor},
          {"shared_experts", c.num_shared_experts},
          {"quant", to_string(c.quant)},
          {"pow2_scales", c.power_of_two_scales},
          {"ranks", c.num_ranks},
          {"redundant_experts", c.num_redundant_experts},
          {"max_tokens_per_rank", c.max_tokens_per_rank},
          {"dispatch_algorithm", to_string(c.dispatch_algorithm)},
          {"seed", o.seed}};
}

nlohmann::json result_header_json(Device device, const MoeConfig& config, const ModelOptions& options) {
  return {{"commit", bench::git_commit()},
          {"date", bench::utc_now_iso8601()},
          {"device", device == Device::cpu ? "cpu" : "gpu"},
          {"config", config.describe()},
          {"model", model_json(config, options)}};
}

nlohmann::json to_json(const ErrorReport& r) {
  return {
      {"rel_l2", r.rel_l2}, {"calc_diff", r.calc_diff}, {"non_finite", r.non_finite}, {"elements", r.count}};
}

nlohmann::json to_json(const CheckResult& result) {
  nlohmann::json per_rank = nlohmann::json::array();
  for (const ErrorReport& r : result.per_rank) per_rank.push_back(to_json(r));
  // (rel_l2, calc_diff and non_finite at the top as well: the overall values, where the GPU run's JSON has
  // its check's.)
  return {{"rel_l2", result.overall.rel_l2},
          {"calc_diff", result.overall.calc_diff},
          {"non_finite", result.overall.non_finite},
          {"overall", to_json(result.overall)},
          {"per_rank", per_rank},
          {"tolerance", result.tolerance},
          {"pass", result.pass}};
}

}  // namespace epmoe::tools
