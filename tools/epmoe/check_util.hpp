// Layer output vs the direct reference evaluation, as `epmoe check` and `epmoe run` report it.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <span>
#include <vector>

#include "epmoe/layer.hpp"

namespace epmoe::tools {

struct CheckResult {
  std::vector<ErrorReport> per_rank;
  ErrorReport overall;  // over every rank's outputs together
  double tolerance = 1e-2;
  bool pass = false;
};

// y[r] is the layer's output for x[r]; each is compared with reference_forward(x[r], numerics).
// on_rank(r), if given, is called before rank r's reference (progress of long checks).
CheckResult check_against_reference(const ModelWeights& weights, std::span<const TensorView> x,
                                    std::span<const TensorView> y, Numerics numerics, double tolerance,
                                    const std::function<void(std::size_t rank)>& on_rank = {});
nlohmann::json to_json(const ErrorReport& report);
nlohmann::json to_json(const CheckResult& result);

}  // namespace epmoe::tools
