// epmoe run: the main job. Builds a seeded synthetic model and serves a stream of forward passes
// like an inference engine would — a decode phase (low-latency mode) and a prefill phase
// (normal mode, chunked prompts) — then reports tokens/s, time per phase and the accuracy check.
#include <chrono>
#include <cstdio>
#include <memory>

#include "bench/bench.hpp"
#include "epmoe/cuda/runtime.hpp"
#include "epmoe/layer.hpp"
#include "tools/epmoe/check_util.hpp"
#include "tools/epmoe/commands.hpp"
#include "tools/epmoe/options.hpp"
#include "tools/epmoe/run.hpp"

namespace epmoe::tools {
namespace {

using Clock = std::chrono::steady_clock;

struct PhaseResult {
  std::string name;
  Mode mode = Mode::normal;
  std::int64_t tokens = 0, forwards = 0, bytes_sent = 0;
  double seconds = 0;
  PhaseTimes times;
  CheckResult check;
};

// The forwards of `kind` through `layer`, forward f with forwards[f] tokens on every rank; checks the
// first pass against the reference.
PhaseResult run_phase(const std::string& name, MoeLayer& layer, const ModelWeights& weights, BatchKind kind,
                      const PhaseForwards& forwards, std::uint64_t seed, double tolerance) {
  const MoeConfig& c = weights.config();
  PhaseResult result;
  result.name = name;
  result.mode = resolve_mode(layer.options().mode, kind);
  Progress progress(name);
  ForwardStats stats;
  for (std::int64_t f = 0; f < forwards.count; ++f) {
    const std::int64_t tokens_per_rank = forwards[f];
    std::vector<HostTensor> xs, ys;
    std::vector<TensorView> x, y;
    for (int r = 0; r < c.num_ranks; ++r) {
      xs.push_back(synthetic_tokens(c, seed + static_cast<std::uint64_t>(f) * 7919u, r, tokens_per_rank));
      ys.emplace_back(DType::bf16, std::initializer_list<std::int64_t>{tokens_per_rank, c.hidden});
      ys.back().fill_bytes(0xff);  // poison
      x.push_back(xs.back());
      y.push_back(ys.back());
    }
    const auto start = Clock::now();
    layer.forward(x, y, kind, &stats);
    result.seconds += std::chrono::duration<double>(Clock::now() - start).count();
    result.bytes_sent += stats.bytes_sent;
    if (f == 0) result.check = check_against_reference(weights, x, y, Numerics::mirror, tolerance);
    progress.update(f + 1, forwards.count, stats.tokens, result.seconds, f + 1 == forwards.count);
  }
  result.forwards = forwards.count;
  result.tokens = stats.tokens;
  result.times = stats.times;
  return result;
}

// The phase times under the GPU run's names (its "gemm" is the CPU's expert MLPs), each divided by
// `forwards` (1: the sums over the phase's forwards).
nlohmann::json phase_times_json(const PhaseTimes& t, double forwards) {
  return {{"route", t.route / forwards},   {"quantize", t.quantize / forwards},
          {"shared", t.shared / forwards}, {"dispatch", t.dispatch / forwards},
          {"gemm", t.experts / forwards},  {"combine", t.combine / forwards},
          {"total", t.total() / forwards}};
}

nlohmann::json to_json(const PhaseResult& p) {
  const double forwards = p.forwards > 0 ? static_cast<double>(p.forwards) : 1.0;
  return {{"mode", to_string(p.mode)},
          {"forwards", p.forwards},
          {"tokens", p.tokens},
          {"seconds", p.seconds},
          {"tokens_per_s", p.seconds > 0 ? static_cast<double>(p.tokens) / p.seconds : 0.0},
          {"ms_per_forward", 1e3 * p.seconds / forwards},
          {"dispatch_bytes_sent", p.bytes_sent},
          {"phases_ms_per_forward", phase_times_json(p.times, forwards)},
          {"phases_ms_all_forwards", phase_times_json(p.times, 1.0)},
          {"check", tools::to_json(p.check)}};
}

void print_phase(const PhaseResult& p) {
  const PhaseTimes& t = p.times;
  const double total = t.total() > 0 ? t.total() : 1.0;
  std::printf(
      "  %-8s %-11s %6lld forwards %9lld tokens %10.1f tokens/s   check rel_l2 %.2e calc_diff %.2e %s\n",
      p.name.c_str(), std::string(to_string(p.mode)).c_str(), static_cast<long long>(p.forwards),
      static_cast<long long>(p.tokens), p.seconds > 0 ? static_cast<double>(p.tokens) / p.seconds : 0.0,
      p.check.overall.rel_l2, p.check.overall.calc_diff, p.check.pass ? "PASS" : "FAIL");
  std::printf(
      "           time: route %.1f%%  quantize %.1f%%  shared %.1f%%  dispatch %.1f%%  experts %.1f%%  "
      "combine %.1f%%"
      "  (%.1f ms)\n",
      100 * t.route / total, 100 * t.quantize / total, 100 * t.shared / total, 100 * t.dispatch / total,
      100 * t.experts / total, 100 * t.combine / total, t.total());
}

void run_main(const RunOptions& o) {
  const Device device = resolve_device(o.model.device, /*gpu_path=*/true);
  if (device == Device::cuda) {
    run_gpu_main(o);
    return;
  }
  reserve_stdout_for_json(o.json);
  if (!o.gpu_options_given.empty()) {
    std::string names;
    for (const std::string& n : o.gpu_options_given) names += (names.empty() ? "" : ", ") + n;
    std::fprintf(stderr, "epmoe run: this run is on the CPU; GPU options have no effect here: %s\n",
                 names.c_str());
  }
  const MoeConfig config = build_config(o.model, device);
  const std::int64_t decode_tokens =
      o.tokens >= 0 ? o.tokens : std::min<std::int64_t>(32, config.max_tokens_per_rank);
  // --steps 0 or --tokens 0: no decode phase (as --prompt-tokens 0: no prefill phase).
  const int steps = decode_tokens > 0 ? (o.steps >= 0 ? o.steps : 32) : 0;
  EPMOE_CHECK(
      steps > 0 || o.prompt_tokens > 0,
      "nothing to run: no decode phase (--steps or --tokens 0) and no prefill phase (--prompt-tokens 0)");
  const std::int64_t chunk = o.chunk > 0 ? o.chunk : 256;
  // One layer serves both phases, as in an engine: in auto mode (the default) prefill batches run in
  // normal mode and decode batches in low-latency mode.
  const Mode layer_mode = parse_mode(o.mode);
  const Mode decode_mode = resolve_mode(layer_mode, BatchKind::decode);
  const Mode prefill_mode = resolve_mode(layer_mode, BatchKind::prefill);
  if (decode_mode == Mode::low_latency)
    EPMOE_CHECK(decode_tokens <= config.max_tokens_per_rank,
                "--tokens ({}) must be <= --max-tokens-per-rank ({}) in low-latency mode", decode_tokens,
                config.max_tokens_per_rank);
  if (prefill_mode == Mode::low_latency)
    EPMOE_CHECK(chunk <= config.max_tokens_per_rank,
                "--chunk ({}{}) must be <= --max-tokens-per-rank ({}) in low-latency mode", chunk,
                o.chunk > 0 ? "" : ", the default", config.max_tokens_per_rank);

  std::printf("epmoe run: %s\n", config.describe().c_str());
  std::printf("  device: %s, %d ranks simulated in one process (GPU present: %s)\n",
              std::string(device_name(device)).c_str(), config.num_ranks,
              cuda::device_description(0).c_str());
  std::fflush(stdout);  // the header before the progress lines on stderr
  auto weights = std::make_shared<SyntheticWeights>(config, o.model.seed);
  LayerOptions lo;
  lo.mode = layer_mode;
  lo.device = device;
  MoeLayer layer(weights, lo);

  std::vector<PhaseResult> phases;
  if (steps > 0) {
    phases.push_back(run_phase("decode", layer, *weights, BatchKind::decode,
                               PhaseForwards::uniform(steps, decode_tokens), o.model.seed + 1, o.tolerance));
  }
  if (o.prompt_tokens > 0) {
    phases.push_back(run_phase("prefill", layer, *weights, BatchKind::prefill,
                               PhaseForwards::chunked(o.prompt_tokens, chunk), o.model.seed + 2,
                               o.tolerance));
  }

  bool pass = true;
  nlohmann::json j = result_header_json(device, config, o.model);
  j.update({{"preset", config.name},
            {"ranks", config.num_ranks},
            {"quant", to_string(config.quant)},
            {"layer_mode", to_string(layer_mode)},
            {"decode_tokens_per_rank", decode_tokens},
            {"decode_steps", steps},
            {"prefill_chunk", chunk},
            {"prompt_tokens", o.prompt_tokens},
            {"tolerance", o.tolerance}});
  std::printf("results:\n");
  for (const PhaseResult& p : phases) {
    print_phase(p);
    j[p.name] = to_json(p);
    pass = pass && p.check.pass;
  }
  j["pass"] = pass;
  std::printf("check against the CPU reference (tolerance %g): %s\n", o.tolerance, pass ? "PASS" : "FAIL");
  if (!o.json.empty()) write_text_file("--json", o.json, j.dump(2) + "\n");
  set_exit_code(pass ? 0 : 1);
}

const CommandRegistration kRegistration{
    10, [](CLI::App& app) {
      auto options = std::make_shared<RunOptions>();
      CLI::App* cmd = app.add_subcommand("run",
                                         "The main job: a decode and a prefill phase on a synthetic model, "
                                         "with tokens/s, time per phase and the accuracy check");
      add_model_options(cmd, options->model);
      cmd->add_option("--steps", options->steps, "Decode steps (default: 32 on the CPU, 1000 on GPUs)")
          ->check(non_negative());
      cmd->add_option(
             "--tokens", options->tokens,
             "Decode tokens per rank (default: CPU min(32, max_tokens_per_rank); GPU concurrency / ranks; "
             "0: no decode phase)")
          ->check(non_negative());
      cmd->add_option("--concurrency", options->concurrency, "GPU: decode requests over all ranks")
          ->check(positive())
          ->capture_default_str();
      cmd->add_option("--prompt-tokens", options->prompt_tokens, "Prefill prompt length in tokens")
          ->check(non_negative())
          ->capture_default_str();
      cmd->add_option("--prompts", options->prompts,
                      "GPU: prompts per rank in the prefill phase (default: concurrency / ranks)")
          ->check(positive());
      cmd->add_option("--chunk", options->chunk,
                      "Prefill chunk size in tokens per rank (default: CPU 256, GPU 4096)")
          ->check(positive());
      cmd->add_flag("!--no-graphs", options->graphs,
                    "GPU: run decode eagerly instead of replaying CUDA graphs");
      cmd->add_option("--check-tokens", options->check_tokens,
                      "GPU: tokens per rank checked against the CPU reference")
          ->check(positive())
          ->capture_default_str();
      cmd->add_flag(
          "--tbo", options->tbo,
          "GPU: decode and prefill with two-batch overlap, and the same without it for comparison (N ranks)");
      cmd->add_option("--shared-stream", options->shared_stream,
                      "GPU: the shared expert on its own stream (own), inline on the main stream (main), or "
                      "auto (inline in prefill on one GPU)")
          ->check(CLI::IsMember({"auto", "own", "main"}))
          ->capture_default_str();
      cmd->add_option(
             "--w4a8-codes", options->w4a8_codes,
             "GPU, --quant w4a8: the routed experts' packed codes: sign_magnitude (weights in [-7, 7]), "
             "offset_binary (any int4) or auto (sign_magnitude unless an expert holds -8)")
          ->check(CLI::IsMember({"auto", "sign_magnitude", "offset_binary"}))
          ->capture_default_str();
      cmd->add_option("--tbo-comm-sms", options->tbo_comm_sms,
                      "GPU: SMs the overlapped GEMMs leave to communication")
          ->check(non_negative())
          ->capture_default_str();
      cmd->add_flag("!--no-host-sync", options->normal_host_sync,
                    "GPU, N ranks: prefill (normal mode) without the host's wait for the row counts: the "
                    "contiguous layout at its worst-case bound");
      cmd->add_option("--dispatcher", options->dispatcher,
                      "GPU, N ranks: auto (NVLink where every rank is load/store reachable, else nccl-p2p), "
                      "nvlink (nvlink in prefill, nvlink-ll in decode) or nccl-p2p (the portable transport)")
          ->check(CLI::IsMember({"auto", "nvlink", "nccl-p2p"}))
          ->capture_default_str();
      cmd->add_option("--zipf", options->zipf, "GPU: Zipf-like routing skew strength (0: none)")
          ->check(non_negative())
          ->capture_default_str();
      cmd->add_flag(
          "--rebalance", options->rebalance,
          "GPU: after the decode loop, rebalance experts (EPLB) on the recorded load and run the loop again");
      cmd->add_option(
             "--eplb-slot-cost", options->eplb_slot_cost,
             "GPU: --rebalance's cost of reading one slot's weights per forward, in tokens of GEMM work "
             "(-1: the layer's estimate for this GPU; 0: DeepSeek's EPLB unchanged)")
          ->check(finite())
          ->check(CLI::Range(-1.0, 1e9))
          ->capture_default_str();
      cmd->add_option("--trace", options->trace,
                      "GPU: write a Chrome-trace / Perfetto timeline of one forward per phase and rank")
          ->check(writable_output(/*result_file=*/true));
      cmd->add_flag("!--no-device-idle", options->device_idle,
                    "GPU: skip the device's idle time inside a forward (a few extra forwards with CUPTI's "
                    "activity records on)");
      cmd->add_option(
             "--mode", options->mode,
             "auto (decode low-latency, prefill normal), normal or low-latency (these two: CPU only)")
          ->check(CLI::IsMember({"auto", "normal", "low-latency"}))
          ->capture_default_str();
      cmd->add_option("--tolerance", options->tolerance, "Accuracy check tolerance")
          ->check(positive())
          ->capture_default_str();
      cmd->add_option("--json", options->json, "Write all results as JSON to FILE ('-' = stdout)")
          ->check(writable_output(/*result_file=*/true));
      cmd->callback([options, cmd] {
        for (const char* name :
             {"--concurrency", "--prompts", "--no-graphs", "--check-tokens", "--tbo", "--shared-stream",
              "--w4a8-codes", "--tbo-comm-sms", "--no-host-sync", "--dispatcher", "--zipf", "--rebalance",
              "--eplb-slot-cost", "--trace", "--no-device-idle"})
          if (cmd->count(name) > 0) options->gpu_options_given.emplace_back(name);
        run_main(*options);
      });
    }};

}  // namespace
}  // namespace epmoe::tools
