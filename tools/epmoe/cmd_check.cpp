// epmoe check: the layer (the N-rank simulation on the CPU) against the direct evaluation of
// design.md §1 on the same quantized values; exits 1 when over tolerance.
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "epmoe/layer.hpp"
#include "tools/epmoe/check_util.hpp"
#include "tools/epmoe/commands.hpp"
#include "tools/epmoe/options.hpp"

namespace epmoe::tools {
namespace {

struct CheckOptions {
  ModelOptions model;
  std::int64_t tokens = 8;
  std::string mode = "normal", batch = "prefill", dispatcher, json;
  double tolerance = 1e-2;
  bool exact = false;
};

// One progress line on stderr per step of the check, with the seconds since it started: at
// DeepSeek-V3 dims the CPU layer and reference take minutes for a few thousand tokens.
class CheckProgress {
 public:
  void step(const std::string& what) const {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    std::fprintf(stderr, "  [check %.1f s] %s\n", seconds, what.c_str());
  }

 private:
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

void run_check(const CheckOptions& o) {
  reserve_stdout_for_json(o.json);
  const CheckProgress progress;
  const MoeConfig config = build_config(o.model);
  LayerOptions lo;
  lo.mode = parse_mode(o.mode);
  lo.device = resolve_device(o.model.device);
  lo.dispatcher = o.dispatcher;
  auto weights = std::make_shared<SyntheticWeights>(config, o.model.seed);
  MoeLayer layer(weights, lo);

  std::vector<HostTensor> xs, ys;
  std::vector<TensorView> x, y;
  for (int r = 0; r < config.num_ranks; ++r) {
    xs.push_back(synthetic_tokens(config, o.model.seed + 1000, r, o.tokens));
    ys.emplace_back(DType::bf16, std::initializer_list<std::int64_t>{o.tokens, config.hidden});
    ys.back().fill_bytes(0xff);  // poison: NaN in bf16, so an unwritten element fails the check
    x.push_back(xs.back());
    y.push_back(ys.back());
  }
  const auto reference_progress = [&](const char* numerics) {
    return [&progress, numerics, ranks = x.size()](std::size_t r) {
      progress.step(fmt::format("{} reference, rank {}/{}", numerics, r + 1, ranks));
    };
  };
  progress.step(fmt::format("layer forward: {} ranks x {} tokens", config.num_ranks, o.tokens));
  ForwardStats stats;
  const BatchKind kind = parse_batch_kind(o.batch);
  layer.forward(x, y, kind, &stats);
  const CheckResult mirror =
      check_against_reference(*weights, x, y, Numerics::mirror, o.tolerance, reference_progress("mirrored"));

  std::printf("epmoe check: %s\n", config.describe().c_str());
  std::printf("  mode %s (a %s batch: %s), dispatcher %s, %lld tokens per rank, %zu experts built\n",
              std::string(to_string(lo.mode)).c_str(), o.batch.c_str(),
              std::string(to_string(stats.mode)).c_str(), layer.options().dispatcher.c_str(),
              static_cast<long long>(o.tokens), weights->experts_built());
  for (std::size_t r = 0; r < mirror.per_rank.size(); ++r)
    std::printf("  rank %zu: rel_l2 %.3e  calc_diff %.3e  rows %lld\n", r, mirror.per_rank[r].rel_l2,
                mirror.per_rank[r].calc_diff,
                static_cast<long long>(r < stats.rows_per_rank.size() ? stats.rows_per_rank[r] : 0));
  // An empty batch is a case worth running (every kernel and exchange with T = 0), but its check
  // compares nothing: say so rather than a bare PASS.
  std::printf("  overall vs mirrored reference: rel_l2 %.3e  calc_diff %.3e  (tolerance %g)  %s%s\n",
              mirror.overall.rel_l2, mirror.overall.calc_diff, o.tolerance, mirror.pass ? "PASS" : "FAIL",
              o.tokens == 0 ? " (0 tokens: the empty forward ran; nothing to compare)" : "");
  nlohmann::json j = result_header_json(lo.device, config, o.model);
  j.update({{"layer_mode", to_string(lo.mode)},
            {"batch", o.batch},
            {"forward_mode", to_string(stats.mode)},
            {"dispatcher", layer.options().dispatcher},
            {"tokens_per_rank", o.tokens},
            {"ranks", config.num_ranks},
            {"quant", to_string(config.quant)},
            {"mirror", to_json(mirror)},
            {"pass", mirror.pass}});
  if (o.exact) {
    // How far the quantized pipeline is from f64 arithmetic on the same quantized inputs (informational:
    // no tolerance, no verdict).
    const CheckResult exact =
        check_against_reference(*weights, x, y, Numerics::exact, 1.0, reference_progress("f64"));
    std::printf("  vs f64 reference (quantization error, informational): rel_l2 %.3e  calc_diff %.3e\n",
                exact.overall.rel_l2, exact.overall.calc_diff);
    nlohmann::json e = to_json(exact);
    e.erase("tolerance");
    e.erase("pass");
    e["informational"] = true;
    j["exact"] = e;
  }
  if (!o.json.empty()) write_text_file("--json", o.json, j.dump(2) + "\n");
  set_exit_code(mirror.pass ? 0 : 1);
}

const CommandRegistration kRegistration{
    20, [](CLI::App& app) {
      auto options = std::make_shared<CheckOptions>();
      CLI::App* cmd = app.add_subcommand(
          "check", "Run the layer and the reference on the same inputs; report both error measures");
      add_model_options(cmd, options->model);
      cmd->add_option("--tokens", options->tokens, "Tokens per rank")
          ->check(non_negative())
          ->capture_default_str();
      cmd->add_option("--mode", options->mode,
                      "normal, low-latency, or auto (the layer holds both; --batch picks the forward's)")
          ->check(CLI::IsMember({"normal", "low-latency", "auto"}))
          ->capture_default_str();
      cmd->add_option("--batch", options->batch,
                      "The forward's batch kind, prefill or decode (auto mode: normal or low-latency)")
          ->check(CLI::IsMember({"prefill", "decode"}))
          ->capture_default_str();
      cmd->add_option("--dispatcher", options->dispatcher,
                      "Dispatcher: cpu-sim (default) or cpu-local (one rank)")
          ->check(CLI::IsMember({"cpu-sim", "cpu-local"}));
      cmd->add_option("--tolerance", options->tolerance, "Largest allowed rel_l2 and calc_diff")
          ->check(positive())
          ->capture_default_str();
      cmd->add_flag("--exact", options->exact, "Also report the error against an f64 reference");
      cmd->add_option("--json", options->json, "Write the results as JSON to FILE ('-' = stdout)")
          ->check(writable_output(/*result_file=*/true));
      cmd->callback([options] { run_check(*options); });
    }};

}  // namespace
}  // namespace epmoe::tools
