// The MoE layer from a program of plain C++, as an inference engine would take it: weights of its
// own behind epmoe::ModelWeights (a checkpoint loader would fill them; here seeded values stand in),
// the layer on the CPU (two expert-parallel ranks simulated in one process) and, where a GPU is
// present, on the GPU (low-latency mode, eager and through a CUDA graph), each checked against the
// library's reference. One layer serves both kinds of batch, as in an engine: made in auto mode, it
// runs a prefill batch in normal mode and decode batches in low-latency mode (decode on the GPU also
// through a CUDA graph) around one set of weights. Prints one JSON object; exit code 1 when a check
// fails.
//
//   epmoe_example_layer [--device auto|cpu|gpu] [--tokens N] [--quant fp8|w4a8]
//   epmoe launch -n N -- epmoe_example_layer --device gpu     (N ranks, one GPU each)
//
// Started by `epmoe launch`, each process is one rank and, as an engine does, creates its own NCCL
// communicator from the launcher's unique id and lends it to the layer (Communicator::borrow); rank r
// has `--tokens` - r decode tokens (and a prefill batch of twice that). Without it, one rank and no
// communicator. --device gpu without the GPUs
// prints "SKIPPED" and exits 0.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include <nccl.h>
#include <nlohmann/json.hpp>

#include "epmoe/comm.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/layer.hpp"
#include "epmoe/cuda/runtime.hpp"
#include "epmoe/epmoe.hpp"

namespace {

// Weights as an engine holds them: one ExpertWeights per routed expert in the checkpoint's format
// (epmoe/weights.hpp), the fused shared expert, the gate and the router's correction bias.
class EngineWeights final : public epmoe::ModelWeights {
 public:
  EngineWeights(const epmoe::MoeConfig& config, std::uint64_t seed) : config_(config) {
    config_.validate();
    const std::int64_t H = config_.hidden, E = config_.num_experts;
    for (int e = 0; e < config_.num_experts; ++e) {
      routed_.push_back(epmoe::make_synthetic_expert(config_.quant, H, config_.intermediate,
                                                     seed + 1 + static_cast<std::uint64_t>(e)));
    }
    const epmoe::QuantScheme shared_quant =
        config_.quant == epmoe::QuantScheme::none ? epmoe::QuantScheme::none : epmoe::QuantScheme::fp8;
    shared_ = epmoe::make_synthetic_expert(shared_quant, H, config_.intermediate * config_.num_shared_experts,
                                           seed + 1 + static_cast<std::uint64_t>(E));
    gate_ = epmoe::HostTensor(epmoe::DType::bf16, {E, H});
    bias_ = epmoe::HostTensor(epmoe::DType::f32, {E});
    auto* gate = gate_.data<epmoe::bf16>();
    for (std::int64_t i = 0; i < E * H; ++i) {
      gate[i] = epmoe::bf16::from_float(0.05f * epmoe::uniform_pm1(seed, static_cast<std::uint64_t>(i)));
    }
    auto* bias = bias_.data<float>();
    for (std::int64_t e = 0; e < E; ++e)
      bias[e] = 0.01f * epmoe::uniform_pm1(seed + E + 2, static_cast<std::uint64_t>(e));
  }
  const epmoe::MoeConfig& config() const override { return config_; }
  const epmoe::ExpertWeights& routed_expert(int logical) const override { return *routed_.at(logical); }
  const epmoe::ExpertWeights& shared_expert() const override { return *shared_; }
  epmoe::TensorView gate_weight() const override { return gate_; }
  epmoe::TensorView correction_bias() const override { return bias_; }
  // W4A8's static per-tensor activation scales, which a W4AFP8 checkpoint ships calibrated: a bound of
  // each GEMM input over 448. Here the tokens' bound (±kSyntheticInputBound) and a fixed 8 for
  // SiLU(gate)·up (values past it saturate, in the layer and the reference alike). FP8 models do not
  // use them.
  float a1_scale() const override { return epmoe::kSyntheticInputBound / epmoe::kFp8E4m3Max; }
  float a2_scale() const override { return 8.0f / epmoe::kFp8E4m3Max; }

 private:
  epmoe::MoeConfig config_;
  std::vector<std::unique_ptr<epmoe::ExpertWeights>> routed_;
  std::unique_ptr<epmoe::ExpertWeights> shared_;
  epmoe::HostTensor gate_, bias_;
};

constexpr std::uint64_t kSeed = 2026;

// Against the mirrored reference within epmoe::layer_tolerance (design.md §8; wider for small models
// and a handful of tokens).
nlohmann::json report(const epmoe::ErrorReport& r, double tolerance) {
  return {{"rel_l2", r.rel_l2},
          {"calc_diff", r.calc_diff},
          {"non_finite", r.non_finite},
          {"tolerance", tolerance},
          {"pass", r.within(tolerance)}};
}

// Two ranks of expert parallelism simulated in one process: the CPU layer serves both, a prefill
// batch and then a decode batch through the same layer (auto mode).
nlohmann::json run_cpu(epmoe::MoeConfig config, std::int64_t tokens, bool& pass) {
  config.num_ranks = 2;
  const auto weights = std::make_shared<const EngineWeights>(config, kSeed);
  epmoe::LayerOptions options;
  options.mode = epmoe::Mode::automatic;
  epmoe::MoeLayer layer(weights, options);
  nlohmann::json out = {{"ranks", config.num_ranks}, {"layer_mode", "auto"}};
  for (const epmoe::BatchKind kind : {epmoe::BatchKind::prefill, epmoe::BatchKind::decode}) {
    const std::int64_t batch = kind == epmoe::BatchKind::prefill ? 2 * tokens : tokens;
    std::vector<epmoe::HostTensor> x, y;
    std::vector<epmoe::TensorView> xv, yv;
    std::vector<std::int64_t> per_rank_tokens;
    for (int r = 0; r < config.num_ranks; ++r) {
      // Uneven batches: the second rank has one token fewer (none in decode at --tokens 1).
      const std::int64_t rank_tokens = batch - r;
      per_rank_tokens.push_back(rank_tokens);
      x.push_back(epmoe::synthetic_tokens(config, kind == epmoe::BatchKind::prefill ? kSeed + 1 : kSeed, r,
                                          rank_tokens));
      y.emplace_back(epmoe::DType::bf16, std::initializer_list<std::int64_t>{rank_tokens, config.hidden});
      y.back().fill_bytes(0xff);  // NaN everywhere: every row must be written
      xv.push_back(x.back());
      yv.push_back(y.back());
    }
    epmoe::ForwardStats stats;
    layer.forward(xv, yv, kind, &stats);
    nlohmann::json ranks = nlohmann::json::array();
    for (int r = 0; r < config.num_ranks; ++r) {
      const std::int64_t rank_tokens = per_rank_tokens[static_cast<std::size_t>(r)];
      epmoe::HostTensor expected(epmoe::DType::bf16, {rank_tokens, config.hidden});
      epmoe::reference_forward(*weights, x[r], expected, epmoe::Numerics::mirror);
      const epmoe::ErrorReport e = epmoe::compare(y[r], expected);
      const double tolerance = epmoe::layer_tolerance(config, rank_tokens);
      pass = pass && e.within(tolerance);
      ranks.push_back(report(e, tolerance));
    }
    out[std::string(epmoe::to_string(kind))] = {
        {"mode", epmoe::to_string(stats.mode)}, {"tokens_per_rank", per_rank_tokens}, {"per_rank", ranks}};
  }
  return out;
}

// The engine's NCCL communicator, destroyed by its owner after the layer and the borrowing
// Communicator are gone.
struct EngineComm {
  ncclComm_t nccl = nullptr;
  ~EngineComm() {
    if (nccl != nullptr) (void)ncclCommDestroy(nccl);
  }
};

// This rank on its GPU, one layer in auto mode: a prefill forward (normal mode), then a decode forward
// (low-latency mode), eager with a poisoned output, then twice through the CUDA graph the layer
// captures for this batch size (the same bits). Under a launch every rank runs it (each call is
// collective over the ranks).
nlohmann::json run_gpu(epmoe::MoeConfig config, std::int64_t tokens, const epmoe::LaunchEnvironment& env,
                       bool& pass) {
  namespace cuda = epmoe::cuda;
  EngineComm engine;
  std::shared_ptr<epmoe::Communicator> comm;  // (declared after `engine`: released before it)
  config.num_ranks = env.world_size;
  // The fewest redundant slots that spread the experts evenly over the ranks.
  config.num_redundant_experts = (env.world_size - config.num_experts % env.world_size) % env.world_size;
  if (env.present) {
    EPMOE_CUDA_CHECK(cudaSetDevice(env.device));
    const ncclUniqueId id = env.unique_id(/*wait_s=*/60.0);
    if (const ncclResult_t r = ncclCommInitRank(&engine.nccl, env.world_size, id, env.rank);
        r != ncclSuccess) {
      throw epmoe::Error(std::string("ncclCommInitRank: ") + ncclGetErrorString(r));
    }
    comm = epmoe::Communicator::borrow(engine.nccl);
  }
  const auto weights = std::make_shared<const EngineWeights>(config, kSeed);
  cuda::GpuLayerOptions options;
  options.mode = epmoe::Mode::automatic;
  options.max_tokens = 2 * tokens;  // the prefill batch; decode batches stop at max_tokens_per_rank
  cuda::GpuMoeLayer layer(weights, options, comm);
  const cudaStream_t stream = layer.stream();
  // `batch` (this rank's tokens of `kind`) through the layer, eager, into a poisoned output (copied to
  // `out`); checked against the reference.
  const auto checked_forward = [&](epmoe::BatchKind kind, const epmoe::HostTensor& batch,
                                   epmoe::HostTensor& out) {
    const cuda::DeviceTensor d_in = cuda::to_device(batch, stream);
    const cuda::DeviceTensor d_out(epmoe::DType::bf16, {batch.size(0), config.hidden});
    d_out.fill_bytes(0xff, stream);  // NaN everywhere: every row must be written
    layer.forward(d_in, d_out, kind);
    out = cuda::to_host(d_out, stream);
    const epmoe::HostTensor logits = cuda::to_host(layer.last_logits(), stream);
    epmoe::HostTensor expected(epmoe::DType::bf16, {batch.size(0), config.hidden});
    // Routed from the GPU's gate logits: its gate GEMM sums in another order than the CPU's.
    epmoe::reference_forward(*weights, batch, logits, expected, epmoe::Numerics::mirror);
    const epmoe::ErrorReport e = epmoe::compare(out, expected);
    const double tolerance = epmoe::layer_tolerance(config, batch.size(0));
    pass = pass && e.within(tolerance);
    return report(e, tolerance);
  };
  epmoe::HostTensor prefill_y, y;
  const nlohmann::json prefill = checked_forward(
      epmoe::BatchKind::prefill,
      epmoe::synthetic_tokens(config, kSeed + 1, env.rank, std::max<std::int64_t>(2 * tokens - env.rank, 0)),
      prefill_y);
  const std::int64_t rank_tokens = std::max<std::int64_t>(tokens - env.rank, 0);
  const epmoe::HostTensor x = epmoe::synthetic_tokens(config, kSeed, env.rank, rank_tokens);
  nlohmann::json out = checked_forward(epmoe::BatchKind::decode, x, y);

  // The decode batch again through the layer's CUDA graph for its size: the same bits.
  const cuda::DeviceTensor dx = cuda::to_device(x, stream);
  const cuda::DeviceTensor dy(epmoe::DType::bf16, {rank_tokens, config.hidden});
  bool graph_same = true;
  for (int replay = 0; replay < 2; ++replay) {
    dy.fill_bytes(0xff, stream);
    layer.forward_graph(dx, dy);
    const epmoe::HostTensor again = cuda::to_host(dy, stream);
    graph_same = graph_same && std::memcmp(again.view().data, y.view().data, y.nbytes()) == 0;
  }
  pass = pass && graph_same;
  out["device"] = cuda::device_description(env.present ? env.device : 0);
  out["rank"] = env.rank;
  out["ranks"] = env.world_size;
  out["communicator"] = env.present ? "the engine's own NCCL communicator, borrowed" : "none (one rank)";
  out["tokens"] = rank_tokens;
  out["graph_replays_identical"] = graph_same;
  out["layer_mode"] = "auto";
  out["prefill"] = prefill;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string device = "auto", quant = "fp8";
  std::int64_t tokens = 48;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 < argc && arg == "--device") {
      device = argv[++i];
    } else if (i + 1 < argc && arg == "--tokens") {
      tokens = std::stoll(argv[++i]);
    } else if (i + 1 < argc && arg == "--quant") {
      quant = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--device auto|cpu|gpu] [--tokens N] [--quant fp8|w4a8]\n", argv[0]);
      return 2;
    }
  }
  try {
    if (device != "auto" && device != "cpu" && device != "gpu") {
      throw epmoe::Error("--device must be auto, cpu or gpu, got '" + device + "'");
    }
    epmoe::MoeConfig config = epmoe::MoeConfig::preset("tiny");
    config.quant = epmoe::parse_quant(quant);
    if (tokens < 1 || tokens > config.max_tokens_per_rank) {
      throw epmoe::Error("--tokens must be in [1, " + std::to_string(config.max_tokens_per_rank) + "], got " +
                         std::to_string(tokens));
    }
    // Under `epmoe launch`: this rank's GPU (the launcher's environment says which, and whether every
    // rank has one: the same answer on all of them, so all skip or none does).
    const epmoe::LaunchEnvironment env = epmoe::LaunchEnvironment::from_env();
    const int visible = epmoe::cuda::device_count();
    const std::string no_gpu =
        env.present ? env.missing_gpus(visible) : (visible > 0 ? "" : "no GPU is present");
    if (device == "gpu" && !no_gpu.empty()) {
      std::printf("SKIPPED: --device gpu: %s\n", no_gpu.c_str());
      return 0;
    }
    bool pass = true;
    nlohmann::json out = {{"model", config.name}, {"quant", quant}};
    if (device != "gpu" && env.rank == 0) out["cpu"] = run_cpu(config, tokens, pass);
    if (device != "cpu")
      out["gpu"] = no_gpu.empty() ? run_gpu(config, tokens, env, pass) : nlohmann::json(no_gpu);
    out["pass"] = pass;
    std::printf("%s\n", out.dump(2).c_str());
    return pass ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epmoe_example_layer: %s\n", e.what());
    return 2;
  }
}
