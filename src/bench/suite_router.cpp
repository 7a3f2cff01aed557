// Benchmark suite "router": the fused GPU router (epmoe/cuda/router.hpp) at E = 256, K = 8:
// DeepSeek-V3 sigmoid noaux_tc (8 groups, 4 kept) and plain softmax top-k, at T in tokens
// (default 128, 4096, 16384, 65536, 131072). Bytes: logits and bias read, ids and weights written.
// Beside each T, "router.copy": cudaMemcpyAsync of half the router's bytes (so that the same
// bytes move), timed the same way (rotating buffers; SameBytesCopy, also each row's copy_us / vs_copy):
// the router's ratio to a copy at that size.
// "sigmoid" is the default choice (route_g8_sieve_kernel: pairs below 8192 tokens, quads above);
// "sigmoid-no-sieve" (T >= 1024) is route_g8_kernel, v4, the default before the sieve measured faster;
// "sigmoid-sieve-tmaN" (T >= 1024) the sieve kernel with each logits staging (RouteKernelChoice::tma_stages,
// N = 0, 1, 2), and "softmax-tmaN" route_g8_softmax_kernel with each. EPMOE_BENCH_ROUTER_VARIANTS=1 adds the
// kernel choices (RouteKernelChoice) as phases: "sigmoid-rn-div" (the sigmoid with __fdiv_rn),
// "sigmoid-no-sieve-rn-div" (T >= 1024) and, below the g8 switch, "sigmoid-general" (a warp per token),
// "sigmoid-g8-quads" / "sigmoid-g8-pairs" (the sieve kernel with 8 / 16 lanes per token) and
// "sigmoid-g8-no-sieve". "sigmoid-sieve-pairs-tmaN" (T >= 1024) is the sieve kernel with pairs (v9; the
// default below 8192 tokens). EPMOE_BENCH_ROUTER_TRACE=1 adds "router.trace" rows: the sieve kernel's
// phase stamps (RouteKernelChoice::trace) for one launch per T, quads and pairs (trace_rows below).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "bench/bench.hpp"
#include "cuda/hd.hpp"
#include "epmoe/config.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/router.hpp"

namespace epmoe::bench {
namespace {

// Pseudo-random f32 in about [-4, 4), never 0, from a hash of (seed, i) (fast enough for the
// tens of millions of logits of the rotation sets).
void fill_logits(float* p, std::int64_t n, std::uint64_t seed) {
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint64_t z =
        detail::mix64_finalize(seed * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(i));
    p[i] = (static_cast<float>(z >> 40) + 0.5f) * 0x1p-21f - 4.0f;  // (k + 0.5) / 2^21 - 4: never 0
  }
}

// Quantile q of v (sorted in place); 0 for an empty v.
double quantile(std::vector<double>& v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[static_cast<std::size_t>(q * static_cast<double>(v.size() - 1) + 0.5)];
}

// One traced launch of the sieve kernel (quads or pairs) per call, the third of three on different input
// sets, summarised: each warp's stamps are measured from its SM's first entry stamp (SM clocks are not
// aligned), the clock from the warps' cycles over their globaltimer spans. time_us is the slowest SM's
// span (first entry to last store) at that clock; params carry, in cycles, the quantiles of the warps'
// entry, data arrival (the TMA wait's end), chain (arrival to stores) and end, the phases' medians
// (router_kernels.cuh: RouterStamps) and those of the warp that ends last.
void trace_rows(const SuiteOptions& options, std::vector<Result>& results, const MoeConfig& config,
                const std::vector<cuda::DeviceTensor>& logits, const cuda::DeviceTensor& bias,
                const std::vector<cuda::DeviceTensor>& ids, const std::vector<cuda::DeviceTensor>& weights,
                std::int64_t tokens, double bytes, cuda::Stream& stream) {
  constexpr int kWords = cuda::kRouteTraceWordsPerWarp, kPhases = kWords - 4;
  const std::size_t words = cuda::route_trace_words();
  cuda::DeviceBuffer trace(words * sizeof(std::uint64_t));
  std::vector<std::uint64_t> h(words);
  for (const int lanes : {8, 16}) {
    cuda::RouteKernelChoice choice = cuda::route_kernel_choice_from_env();
    choice.kernel = cuda::RouteKernelChoice::Kernel::g8;
    choice.sieve = true;
    choice.rn_division = false;
    choice.tma_stages = 1;
    choice.token_lanes = lanes;
    choice.trace = trace.as<std::uint64_t>();
    for (int r = 0; r < 3; ++r) {
      const auto set = static_cast<std::size_t>(r) % logits.size();
      trace.fill_bytes(0, stream);
      cuda::route(config, logits[set], bias, ids[set], weights[set], stream, choice);
    }
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(h.data(), trace.data(), words * sizeof(std::uint64_t),
                                     cudaMemcpyDeviceToHost, stream));
    stream.synchronize();
    std::vector<std::uint64_t> base(4096, ~0ull);  // per SM id: its first entry stamp
    double cycles = 0.0, ns = 0.0;
    for (std::size_t w = 0; w + kWords <= words; w += kWords) {
      const std::uint64_t* r = &h[w];
      if (r[2] == 0 || r[0] >= base.size()) continue;  // not launched
      base[r[0]] = std::min(base[r[0]], r[2]);
    }
    std::vector<double> entry, arrive, chain, end, phase[kPhases - 1];
    std::vector<double> sm_span(base.size(), 0.0);
    const std::uint64_t* last = nullptr;
    double last_end = -1.0;
    for (std::size_t w = 0; w + kWords <= words; w += kWords) {
      const std::uint64_t* r = &h[w];
      if (r[2] == 0 || r[0] >= base.size() || r[2 + kPhases - 1] == 0) continue;  // no unit
      const double b = static_cast<double>(base[r[0]]);
      const auto c = [&](int i) { return static_cast<double>(r[2 + i]); };
      entry.push_back(c(0) - b);
      arrive.push_back(c(2) - b);
      chain.push_back(c(kPhases - 1) - c(2));
      end.push_back(c(kPhases - 1) - b);
      for (int i = 0; i + 1 < kPhases; ++i) phase[i].push_back(c(i + 1) - c(i));
      // The warp's end: after its last unit (past one round of units: several).
      const double leave = std::max(c(kPhases - 1), static_cast<double>(r[3 + kPhases])) - b;
      sm_span[r[0]] = std::max(sm_span[r[0]], leave);
      if (leave > last_end) last_end = leave, last = r;
      cycles += c(kPhases - 1) - c(0);
      ns += static_cast<double>(r[2 + kPhases] - r[1]);
    }
    if (last == nullptr || ns <= 0.0) continue;
    const double mhz = cycles / ns * 1e3;
    static constexpr const char* kNames[kPhases - 1] = {"prologue",  "wait",   "approx", "groups",
                                                        "mask",      "items",  "spread", "rank_keys",
                                                        "rank_loop", "ranked", "store"};
    Params p{{"tokens", tokens},
             {"phase", std::string(lanes == 8 ? "quads" : "pairs")},
             {"mhz", mhz},
             {"warps", static_cast<std::int64_t>(end.size())}};
    for (const auto& [name, v] : {std::pair{"entry", &entry}, std::pair{"arrive", &arrive},
                                  std::pair{"chain", &chain}, std::pair{"end", &end}}) {
      p[std::string(name) + "_p50"] = quantile(*v, 0.5);
      p[std::string(name) + "_p90"] = quantile(*v, 0.9);
      p[std::string(name) + "_max"] = quantile(*v, 1.0);
    }
    for (int i = 0; i + 1 < kPhases; ++i) {
      p[std::string(kNames[i]) + "_p50"] = quantile(phase[i], 0.5);
      p[std::string("last_") + kNames[i]] = static_cast<double>(last[3 + i] - last[2 + i]);
    }
    std::vector<double> spans;
    for (const double v : sm_span)
      if (v > 0.0) spans.push_back(v);
    p["sm_span_p50"] = quantile(spans, 0.5);
    emit(options, results, make_result("router.trace", p, last_end / mhz, bytes));
  }
}

std::vector<Result> run_router_suite(const SuiteOptions& options) {
  std::vector<Result> results;
  const std::vector<std::int64_t> token_list = tokens_or_default(options, {128, 4096, 16384, 65536, 131072});
  const TimingOptions timing = timing_for(options);
  const char* variants_env = std::getenv("EPMOE_BENCH_ROUTER_VARIANTS");
  const bool variants = variants_env != nullptr && std::string_view(variants_env) == "1";
  const char* trace_env = std::getenv("EPMOE_BENCH_ROUTER_TRACE");
  const bool traced = trace_env != nullptr && std::string_view(trace_env) == "1";
  cuda::Stream stream;
  SameBytesCopy copy(stream, timing);
  std::uint64_t seed = 1;

  MoeConfig sigmoid = MoeConfig::preset("deepseek-v3");
  MoeConfig softmax = sigmoid;
  softmax.scoring = Scoring::softmax;
  softmax.num_groups = 1;
  softmax.topk_groups = 1;
  softmax.routed_scaling_factor = 1.0f;
  const std::int64_t e = sigmoid.num_experts, k = sigmoid.topk;

  HostTensor bias(DType::f32, {e});
  fill_logits(bias.data<float>(), e, 12345);
  for (std::int64_t i = 0; i < e; ++i) bias.data<float>()[i] *= 0.01f;
  const cuda::DeviceTensor dbias = cuda::to_device(bias, stream);

  for (const std::int64_t tokens : token_list) {
    const double bytes = static_cast<double>(tokens * e * 4 + e * 4 + tokens * k * 8);
    const int sets = rotation_sets(static_cast<std::size_t>(bytes));
    std::vector<cuda::DeviceTensor> logits, ids, weights;
    HostTensor host(DType::f32, {tokens, e});
    for (int i = 0; i < sets; ++i) {
      fill_logits(host.data<float>(), tokens * e, seed++);
      logits.push_back(cuda::to_device(host, stream));
      ids.emplace_back(DType::i32, std::initializer_list<std::int64_t>{tokens, k});
      weights.emplace_back(DType::f32, std::initializer_list<std::int64_t>{tokens, k});
      ids.back().fill_bytes(0xff, stream);
      weights.back().fill_bytes(0xff, stream);
    }
    stream.synchronize();
    struct Row {
      const MoeConfig* config;
      std::string phase;
      cuda::RouteKernelChoice choice;
    };
    const cuda::RouteKernelChoice automatic = cuda::route_kernel_choice_from_env();
    const bool g8_switch = tokens >= 1024;  // automatic takes route_g8_kernel (router_gpu.cu)
    cuda::RouteKernelChoice no_sieve = automatic;
    no_sieve.sieve = false;
    std::vector<Row> rows{{&sigmoid, "sigmoid", automatic}, {&softmax, "softmax", automatic}};
    if (g8_switch) {
      rows.push_back({&sigmoid, "sigmoid-no-sieve", no_sieve});
      for (const int stages : {0, 1, 2}) {  // the sieve kernel's staging (v7), each measured
        cuda::RouteKernelChoice staged = automatic;
        staged.tma_stages = stages;
        staged.token_lanes = 8;
        rows.push_back({&sigmoid, "sigmoid-sieve-tma" + std::to_string(stages), staged});
        rows.push_back({&softmax, "softmax-tma" + std::to_string(stages), staged});
        if (stages > 0) {  // pairs (v9): 16 lanes per token
          staged.token_lanes = 16;
          rows.push_back({&sigmoid, "sigmoid-sieve-pairs-tma" + std::to_string(stages), staged});
        }
      }
    }
    if (variants) {
      cuda::RouteKernelChoice rn = automatic;
      rn.rn_division = true;
      rows.push_back({&sigmoid, "sigmoid-rn-div", rn});
      if (g8_switch) {
        cuda::RouteKernelChoice no_sieve_rn = no_sieve;
        no_sieve_rn.rn_division = true;
        rows.push_back({&sigmoid, "sigmoid-no-sieve-rn-div", no_sieve_rn});
      } else {
        cuda::RouteKernelChoice general = automatic;
        general.kernel = cuda::RouteKernelChoice::Kernel::general;
        rows.push_back({&sigmoid, "sigmoid-general", general});
        cuda::RouteKernelChoice g8 = automatic;
        g8.kernel = cuda::RouteKernelChoice::Kernel::g8;
        g8.token_lanes = 8;
        rows.push_back({&sigmoid, "sigmoid-g8-quads", g8});
        g8.token_lanes = 16;
        rows.push_back({&sigmoid, "sigmoid-g8-pairs", g8});
        g8.sieve = false;
        rows.push_back({&sigmoid, "sigmoid-g8-no-sieve", g8});
      }
    }
    for (const Row& row : rows) {
      const double us = time_us(
          [&](int i, cudaStream_t s) {
            const auto set = static_cast<std::size_t>(i);
            cuda::route(*row.config, logits[set], dbias, ids[set], weights[set], s, row.choice);
          },
          sets, stream, timing);
      const Params p{{"tokens", tokens},
                     {"n", e},
                     {"k", k},
                     {"groups", static_cast<std::int64_t>(row.config->num_groups)},
                     {"phase", row.phase}};
      emit(options, results, copy.attach(make_result("router", p, us, bytes), bytes));
    }
    if (traced) trace_rows(options, results, sigmoid, logits, dbias, ids, weights, tokens, bytes, stream);
    logits.clear();
    ids.clear();
    weights.clear();

    emit(options, results,
         make_result("router.copy", {{"tokens", tokens}, {"n", static_cast<std::int64_t>(bytes / 2)}},
                     copy.us(bytes), bytes));
  }
  return results;
}

const SuiteRegistration kRouter{"router", "fused router (sigmoid noaux_tc, softmax top-k), E=256 K=8", 20,
                                run_router_suite};

}  // namespace
}  // namespace epmoe::bench
