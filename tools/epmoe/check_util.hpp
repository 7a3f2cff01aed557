// Layer output vs the direct reference evaluation, as `epmoe check` and `epmoe run` report it.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <span>
#include <vector>

#include "epmoe/layer.hpp"
#include "tools/epmoe/options.hpp"

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
// The model a command ran, for its JSON: the preset's name, every dimension and choice of `config` as
// its own field (what describe() writes as one line), and the synthetic weights' and inputs' seed.
nlohmann::json model_json(const MoeConfig& config, const ModelOptions& options);
// What every command's JSON starts with: "commit" (bench::git_commit()), "date" (UTC, ISO 8601), "device"
// ("cpu" or "gpu"), "config" (config.describe(), one line) and "model" (model_json: each field apart).
nlohmann::json result_header_json(Device device, const MoeConfig& config, const ModelOptions& options);
nlohmann::json to_json(const ErrorReport& report);
nlohmann::json to_json(const CheckResult& result);

}  // namespace epmoe::tools
