// `epmoe run`: options shared by the CPU simulation (cmd_run.cpp) and the GPU run (run_gpu.cpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "tools/epmoe/options.hpp"
#include "tools/epmoe/phase_forwards.hpp"

namespace epmoe::tools {

struct RunOptions {
  ModelOptions model;
  int steps = -1;  // decode steps; -1: 32 on the CPU, 1000 on GPUs
  std::int64_t tokens =
      -1;  // decode tokens per rank; -1: CPU min(32, max_tokens_per_rank), GPU concurrency / ranks
  std::int64_t concurrency = 128;  // GPU: decode requests over all ranks (the seed's benchmark)
  std::int64_t prompt_tokens = 1000;
  std::int64_t prompts = -1;  // GPU: prompts per rank; -1: concurrency / ranks
  std::int64_t chunk = -1;    // prefill chunk per rank; -1: CPU 256, GPU 4096
  std::string mode = "auto", json;
  double tolerance = 1e-2;
  bool graphs = true;             // GPU: decode through CUDA graphs
  std::int64_t check_tokens = 4;  // GPU: tokens per rank and phase checked against the CPU reference
  bool tbo = false;       // GPU: two-batch overlap in decode and prefill (N ranks), also timed without it
  int tbo_comm_sms = 24;  // GPU: SMs the overlapped GEMMs leave to communication
  bool normal_host_sync = true;  // GPU, N ranks: GpuLayerOptions::normal_host_sync (prefill's count wait)
  std::string shared_stream = "auto";  // GPU: GpuLayerOptions::shared_stream
  std::string dispatcher = "auto";     // GPU, N ranks: GpuLayerOptions::dispatcher
  std::string w4a8_codes = "auto";     // GPU: GpuLayerOptions::w4a8_codes
  double zipf = 0;                     // GPU: Zipf-like routing skew (SyntheticWeights::skew_routing)
  bool rebalance = false;              // GPU: EPLB rebalance after the decode loop, then the loop again
  double eplb_slot_cost = -1;  // GPU: GpuMoeLayer::rebalance's slot_cost_tokens (-1: the layer's estimate)
  std::string trace;           // GPU: Chrome-trace / Perfetto JSON of one forward per phase and rank
  bool device_idle = true;     // GPU: the device's idle time inside a forward (CUPTI; --no-device-idle)
  std::vector<std::string>
      gpu_options_given;  // the GPU-only options on the command line (for a CPU run's note)
};

// Progress of a phase on stderr, at most once a second (or when forced), so long runs show they are
// alive: "  [label] done/total forwards, tokens, tokens/s".
class Progress {
 public:
  using Clock = std::chrono::steady_clock;
  explicit Progress(std::string label) : label_(std::move(label)), last_(Clock::now()) {}
  void update(std::int64_t done, std::int64_t total, std::int64_t tokens, double seconds,
              bool force = false) {
    const auto now = Clock::now();
    if (!force && now - last_ < std::chrono::seconds(1)) return;
    last_ = now;
    std::fprintf(stderr, "  [%s] %lld/%lld forwards, %lld tokens, %.0f tokens/s\n", label_.c_str(),
                 static_cast<long long>(done), static_cast<long long>(total), static_cast<long long>(tokens),
                 seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0);
  }

 private:
  std::string label_;
  Clock::time_point last_;
};

// The GPU run: one process per GPU (re-executes itself under the launcher when several GPUs and no
// launcher environment), the seed's decode and prefill phases, results on rank 0.
void run_gpu_main(const RunOptions& options);

}  // namespace epmoe::tools
