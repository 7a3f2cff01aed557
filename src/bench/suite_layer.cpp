// Benchmark suite "layer": the GPU MoE layer (epmoe/cuda/layer.hpp) at DeepSeek-V3 dims with 32
// redundant experts, on one GPU or, under `epmoe launch -n N -- epmoe bench layer`, on N ranks:
// decode (low-latency mode, graph replay) at 1, 32, 64 and 128 tokens per rank, and prefill
// (normal mode) at 4096 and 8192 tokens per rank; --quant fp8 (default) or w4a8; --tokens picks
// the counts (<= 256: decode, larger: prefill).
// Floors: decode reads the weights of every local slot that gets rows, on the busiest rank, and the
// shared expert's, once (bytes / the copy ceiling; the slots counted from the layer's slot_load() over
// the timed input sets: `slots_read`); prefill is the larger of that and the routed + shared GEMM flops
// at 1979 TFLOP/s (tokens x top-k rows per rank when the load is balanced). `epmoe run` gives the same
// forward with its accuracy check and the phase breakdown. Per configuration, the rows issue 7's bars
// compare: decode by graph replay (`layer.decode`) and eagerly (`layer.decode_eager`); prefill
// (`layer.prefill`) and its expert GEMMs alone
// (`layer.prefill_gemm_alone`: GpuMoeLayer::time_gemms_alone, routed + shared); on N ranks both with
// two-batch overlap too (`layer.decode_tbo`, `layer.prefill_tbo`) and over the portable NCCL
// point-to-point transport (`layer.decode_nccl_p2p`, graph replay, and `layer.prefill_nccl_p2p`; the
// others use the dispatcher "auto" picks, named in each row). EPMOE_BENCH_LAYER_VARIANTS picks among
// graph, eager, gemm_alone, tbo, nccl_p2p, device_idle (default: all). With device_idle, each forward
// row's params carry device_idle_us: the time inside a forward when nothing ran on the device
// (bench::measure_forwards, CUPTI's records of a few more forwards after the row's timed ones; left out
// where CUPTI cannot be used).
// Beside the time, each configuration's first row (decode: the graph replay; prefill: the forward) carries
// what `epmoe run` reports for a phase: tokens_per_s (all ranks' tokens per second), the phase breakdown
// of three eager forwards timed with CUDA events (route_us, dispatch_us, gemm_us, combine_us, shared_us,
// eager_total_us; `timing` on, which adds a few events per phase), and the accuracy of one eager forward
// on this rank against the CPU reference on its first tokens (check_tokens, check_rel_l2,
// check_calc_diff, check_pass; design.md §8's tolerance, layer_tolerance). A failed check is printed and
// reported (SuiteOptions::on_failure: `epmoe bench` writes its rows, then exits 1); on N ranks
// check_pass is whether every rank passed. The checked tokens are the same rows of the same seeded batch
// in every configuration, so the reference builds the same few experts once (host copies, ~44 MB each).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "bench/bench.hpp"
#include "bench/device_activity.hpp"
#include "epmoe/comm.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/layer.hpp"
#include "epmoe/cuda/runtime.hpp"
#include "epmoe/cuda/synthetic.hpp"
#include "epmoe/cuda/w4a8_gemm.hpp"
#include "epmoe/error.hpp"
#include "epmoe/layer.hpp"

namespace epmoe::bench {
namespace {

constexpr double kPeakTflops = 1979.0;  // H200 dense FP8
constexpr std::int64_t kMaxDecodeTokens = 256;

// Bytes of one expert MLP's weights and scales (hidden H, intermediate I): FP8 with f32 128 x 128 block
// scales; W4A8 as the GEMM packs it (w13 [2I, H] and w2 [H, I]).
double expert_bytes(QuantScheme quant, std::int64_t H, std::int64_t I) {
  if (quant == QuantScheme::w4a8) {
    const auto packed = [](std::int64_t n, std::int64_t k) {
      return static_cast<double>(cuda::w4a8_packed_weight_bytes(1, n, k) +
                                 cuda::w4a8_packed_scale_bytes(1, n, k));
    };
    return packed(2 * I, H) + packed(H, I);
  }
  return 3.0 * H * I + 4.0 * ((2 * I / 128) * (H / 128) + (H / 128) * (I / 128));
}

std::vector<Result> run_layer_suite(const SuiteOptions& options) {
  std::vector<Result> results;
  std::shared_ptr<Communicator> comm = Communicator::process_default();
  const LaunchEnvironment env = LaunchEnvironment::from_env();
  if (!comm && env.present && env.world_size > 1) {
    if (const std::string missing = env.missing_gpus(cuda::device_count()); !missing.empty()) {
      std::printf("layer: skipped: %s\n", missing.c_str());
      return results;
    }
    comm = Communicator::from_environment();
  }
  const int ranks = comm ? comm->size() : 1;
  MoeConfig c = MoeConfig::preset("deepseek-v3");
  c.num_ranks = ranks;
  c.num_redundant_experts = 32;
  c.quant = parse_quant(options.quant.empty() ? "fp8" : options.quant);
  c.max_tokens_per_rank = static_cast<int>(kMaxDecodeTokens);
  c.validate();
  auto weights = std::make_shared<SyntheticWeights>(c, 1);  // the layer generates its slots on the device
  // The reference check's experts too (bit-identical with the host's make_synthetic_expert, faster).
  int device = 0;
  EPMOE_CUDA_CHECK(cudaGetDevice(&device));
  weights->set_expert_factory(cuda::gpu_expert_factory(device));
  std::vector<std::string> failures;

  std::vector<std::int64_t> decode, prefill;
  for (const std::int64_t t : options.tokens) (t <= kMaxDecodeTokens ? decode : prefill).push_back(t);
  if (options.tokens.empty()) {
    decode = options.quick ? std::vector<std::int64_t>{128} : std::vector<std::int64_t>{1, 32, 64, 128};
    prefill = options.quick ? std::vector<std::int64_t>{4096} : std::vector<std::int64_t>{4096, 8192};
  }
  const std::string quant(to_string(c.quant));
  const double slot_bytes = expert_bytes(c.quant, c.hidden, c.intermediate);
  const double shared_bytes = expert_bytes(QuantScheme::fp8, c.hidden, c.shared_intermediate());
  TimingOptions timing = timing_for(options);
  timing.iterations = std::min(timing.iterations, 50);
  timing.single_attempt = ranks > 1;  // every forward is collective: the same count on every rank
  constexpr int kSets = 4;

  // EPMOE_BENCH_LAYER_VARIANTS: a comma-separated list (graph, eager, gemm_alone, tbo, nccl_p2p,
  // device_idle);
  // unset: all.
  auto wants = [](std::string_view v) { return env_list_has("EPMOE_BENCH_LAYER_VARIANTS", v); };

  // One layer per mode, overlap choice and dispatcher; `eager` times decode without its graphs too.
  auto run_mode = [&](Mode mode, const std::vector<std::int64_t>& token_list, bool tbo,
                      const std::string& dispatcher) {
    if (token_list.empty()) return;
    cuda::GpuLayerOptions lo;
    lo.mode = mode;
    lo.max_tokens = *std::max_element(token_list.begin(), token_list.end());
    lo.tbo = tbo;
    lo.dispatcher = dispatcher;
    cuda::GpuMoeLayer layer(weights, lo, comm);
    const bool portable = dispatcher == "nccl-p2p";
    cudaStream_t s = layer.stream();
    // The synthetic token batches of `epmoe run` (moderate values, outlier channels): their routing
    // spreads over the experts like a real batch's. (Hash-filled bf16 of widely varied magnitude,
    // tried first, sent nearly every token to the same few experts: 0.18x the all-experts floor.)
    const int rank = comm ? comm->rank() : 0;
    std::vector<cuda::DeviceTensor> x;
    const HostTensor x0 = synthetic_tokens(c, 100, rank, lo.max_tokens);  // set 0, kept for the check
    x.push_back(cuda::to_device(x0, s));
    for (int set = 1; set < kSets; ++set)
      x.push_back(cuda::to_device(
          synthetic_tokens(c, 100 + static_cast<std::uint64_t>(set), rank, lo.max_tokens), s));
    cuda::DeviceTensor y(DType::bf16, {lo.max_tokens, c.hidden});
    const bool decode_mode = mode == Mode::low_latency;
    const std::string base = std::string(decode_mode ? "layer.decode" : "layer.prefill") +
                             (tbo ? "_tbo" : "") + (portable ? "_nccl_p2p" : "");
    const std::string dispatcher_used =
        layer.dispatcher_name(decode_mode ? BatchKind::decode : BatchKind::prefill);
    for (const std::int64_t T : token_list) {
      const double flops =
          2.0 * T * c.hidden * (3.0 * c.topk * c.intermediate + 3.0 * c.shared_intermediate());
      // One forward of T tokens from input set `set`, replayed as a graph or eager.
      auto forward = [&](int set, bool graph) {
        const TensorView xs = x[static_cast<std::size_t>(set % kSets)].view().slice_rows(0, T);
        if (graph) {
          layer.forward_graph(xs, y.view().slice_rows(0, T));
        } else {
          layer.forward(xs, y.view().slice_rows(0, T));
        }
      };
      // The weights a forward of T tokens reads (its floor's bytes): the slots the routing sends rows to
      // on the busiest rank (the collective forward waits for it), plus the shared expert; the mean over
      // the input sets the timing rotates through. Every local slot would overstate it: redundant replicas
      // the static choice never picks, and, at a few tokens, the experts no token chose (1 token reads 8 of
      // 256).
      double slots_read = 0;
      for (int set = 0; set < kSets; ++set) {
        layer.reset_load();
        forward(set, false);
        const std::vector<std::int64_t> load = layer.slot_load();  // every rank's slots (collective)
        const auto L = static_cast<std::size_t>(c.num_local_experts());
        std::int64_t busiest = 0;
        for (std::size_t r = 0; r < static_cast<std::size_t>(ranks); ++r)
          busiest = std::max<std::int64_t>(
              busiest, std::count_if(load.begin() + static_cast<std::ptrdiff_t>(r * L),
                                     load.begin() + static_cast<std::ptrdiff_t>((r + 1) * L),
                                     [](std::int64_t rows) { return rows > 0; }));
        slots_read += static_cast<double>(busiest) / kSets;
      }
      layer.reset_load();
      const double weight_bytes = slots_read * slot_bytes + shared_bytes;
      // The device's idle time inside a forward of the row's kind (CUPTI's records, a few forwards after
      // the timed ones; bench::measure_forwards), in the row's params where it could be taken.
      auto idle_us = [&](bool graph) {
        if (!wants("device_idle")) return -1.0;
        std::string why;
        const ActivitySummary a = measure_forwards([&](int i) { forward(i, graph); }, 3, &why, comm.get());
        return a.forwards > 0 ? 1e3 * a.idle_ms : -1.0;
      };
      // What `epmoe run` reports beside the time (see the top of the file), for the configuration's
      // first row.
      auto phases_and_check = [&](Params& p, double us) {
        p["tokens_per_s"] = us > 0 ? static_cast<double>(T * ranks) / (us * 1e-6) : 0.0;
        layer.reset_times();
        layer.set_timing(true);
        for (int i = 0; i < 3; ++i) forward(i, false);
        layer.set_timing(false);
        const cuda::GpuPhaseTimes& t = layer.times();
        const double per = 1e3 / static_cast<double>(std::max<std::int64_t>(1, t.forwards));
        p["route_us"] = t.route * per;
        p["dispatch_us"] = t.dispatch * per;
        p["gemm_us"] = t.gemm * per;
        p["combine_us"] = t.combine * per;
        p["shared_us"] = t.shared * per;
        p["eager_total_us"] = t.total * per;
        const std::int64_t S = std::min<std::int64_t>(4, T);
        y.fill_bytes(0xff, s);  // poisoned: an unwritten row is NaN
        forward(0, false);
        const HostTensor y0 = cuda::to_host(y.view().slice_rows(0, S), s);
        const HostTensor logits0 = cuda::to_host(layer.last_logits().slice_rows(0, S), s);
        HostTensor ref(DType::bf16, {S, c.hidden});
        reference_forward(*weights, x0.view().slice_rows(0, S), logits0.view(), ref, Numerics::mirror);
        const ErrorReport r = compare(y0.view(), ref);
        const double tolerance = layer_tolerance(c, S);
        p["check_tokens"] = S;
        p["check_rel_l2"] = r.rel_l2;
        p["check_calc_diff"] = r.calc_diff;
        const bool pass = r.within(tolerance);
        // Every rank's row says whether all ranks passed, and every rank reports a failure (so each
        // rank's JSON and exit status agree); the rank whose tokens failed prints its numbers.
        const bool all_pass = on_every_rank(comm.get(), pass, "the ranks' layer accuracy checks");
        p["check_pass"] = static_cast<std::int64_t>(all_pass ? 1 : 0);
        if (!pass)
          std::fprintf(stderr,
                       "layer: CHECK FAILED: %s tokens=%lld rank %d: rel_l2 %.3g, calc_diff %.3g, %lld "
                       "non-finite (tolerance %.3g)\n",
                       base.c_str(), static_cast<long long>(T), rank, r.rel_l2, r.calc_diff,
                       static_cast<long long>(r.non_finite), tolerance);
        if (!all_pass) {
          failures.push_back(fmt::format("{} tokens={}: the accuracy check failed on {} (see its stderr)",
                                         base, T, pass ? "another rank" : fmt::format("rank {}", rank)));
          if (options.on_failure) options.on_failure(failures.back());
        }
      };
      auto row = [&](const std::string& name, double us, const char* how, double device_idle_us = -1,
                     bool first = false) {
        Params p{{"tokens", T},
                 {"ranks", static_cast<std::int64_t>(ranks)},
                 {"mode", std::string(to_string(mode))},
                 {"quant", quant},
                 {"tbo", static_cast<std::int64_t>(tbo ? 1 : 0)},
                 {"dispatcher", dispatcher_used},
                 {"phase", std::string(how)},
                 {"slots_read", slots_read}};
        if (device_idle_us >= 0) p["device_idle_us"] = device_idle_us;
        if (first) phases_and_check(p, us);
        Result r = make_result(name, std::move(p), us, weight_bytes, flops);
        if (!decode_mode) r.floor_us = std::max(r.floor_us, flops / (kPeakTflops * 1e6));
        emit(options, results, r);
      };
      auto timed = [&](bool graph) {
        return time_us([&](int set, cudaStream_t) { forward(set, graph); }, kSets, s, timing);
      };
      if (decode_mode) {
        const std::int64_t sizes[] = {T};
        layer.capture_graphs(sizes);
        if (wants("graph") || tbo) {
          const double us = timed(true);
          row(base, us, "forward, graph replay", idle_us(true), true);
        }
        if (wants("eager") && !tbo && !portable) {
          const double us = timed(false);
          row(base + "_eager", us, "forward, eager", idle_us(false), !(wants("graph") || tbo));
        }
      } else {
        const double us = timed(false);
        row(base, us, "forward", idle_us(false), true);
        if (wants("gemm_alone") && !tbo && !portable) {
          const cuda::GpuMoeLayer::GemmTimes g = layer.time_gemms_alone();
          row("layer.prefill_gemm_alone", 1e3 * (g.routed_ms + g.shared_ms),
              "expert GEMMs alone (routed + shared)");
        }
      }
    }
  };
  for (const bool tbo : {false, true}) {
    if (tbo && !(ranks > 1 && wants("tbo"))) continue;  // two-batch overlap needs peers to overlap with
    run_mode(Mode::low_latency, decode, tbo, "auto");
    run_mode(Mode::normal, prefill, tbo, "auto");
  }
  if (ranks > 1 && wants("nccl_p2p")) {  // the transport across nodes, here over NVLink
    run_mode(Mode::low_latency, decode, false, "nccl-p2p");
    run_mode(Mode::normal, prefill, false, "nccl-p2p");
  }
  if (comm && ranks > 1) comm->barrier();
  EPMOE_CHECK(failures.empty() || options.on_failure,
              "layer: {} configuration(s) differ from the CPU reference; first: {}", failures.size(),
              failures.empty() ? std::string() : failures.front());
  return results;
}

const SuiteRegistration kLayer{
    "layer",
    "the GPU MoE layer at DeepSeek-V3 dims (1 GPU, or N ranks under epmoe launch): decode 1..128 tokens "
    "per rank (graph replay), prefill 4096 and 8192",
    90, run_layer_suite};

}  // namespace
}  // namespace epmoe::bench
