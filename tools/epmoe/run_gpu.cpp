// `epmoe run` on GPUs: the seed's benchmark at the layer. One process per GPU (the command re-executes
// itself under the launcher when it finds several GPUs and no launcher environment), DeepSeek-V3-class
// synthetic weights generated on the device, a decode phase (low-latency mode, CUDA graphs) and a
// prefill phase (normal mode, chunked prompts), each checked against the CPU reference on a sample.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>

#include "bench/bench.hpp"
#include "bench/device_activity.hpp"
#include "epmoe/comm.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/layer.hpp"
#include "epmoe/cuda/runtime.hpp"
#include "epmoe/cuda/synthetic.hpp"
#include "epmoe/launch.hpp"
#include "epmoe/layer.hpp"
#include "tools/epmoe/check_util.hpp"
#include "tools/epmoe/commands.hpp"
#include "tools/epmoe/launch_signals.hpp"
#include "tools/epmoe/run.hpp"

namespace epmoe::tools {
namespace {

using Clock = std::chrono::steady_clock;
const Clock::time_point g_process_start = Clock::now();  // static initialisation: the process start

// Start-up is counted from when the user's command started: a rank started by `epmoe run`'s own
// launcher counts from its parent's start (passed in EPMOE_RUN_START_NS; steady_clock is the
// system-wide monotonic clock on Linux, so the two processes' readings compare).
constexpr const char* kRunStartVar = "EPMOE_RUN_START_NS";
Clock::time_point run_start() {
  static const Clock::time_point start = [] {
    const char* v = std::getenv(kRunStartVar);
    if (v == nullptr) return g_process_start;
    const Clock::time_point parent{std::chrono::nanoseconds(std::strtoll(v, nullptr, 10))};
    return std::min(parent, g_process_start);
  }();
  return start;
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Start-up milestones of this process (seconds since it started), in the order they were reached: the
// first-forward budget (1 s) is spent across CUDA, NCCL, the weights and the layer, and the run's JSON
// shows where. Written by the main thread and the weights thread, hence the lock.
class StartupMarks {
 public:
  void mark(const std::string& what, Clock::time_point when = Clock::now()) {
    const double t = std::chrono::duration<double>(when - run_start()).count();
    std::lock_guard lock(mutex_);
    marks_.emplace_back(what, t);
  }
  nlohmann::json json() const {
    std::lock_guard lock(mutex_);
    nlohmann::json j = nlohmann::json::object();
    for (const auto& [what, t] : marks_) j[what] = t;
    return j;
  }
  std::string describe() const {  // in the order reached
    std::lock_guard lock(mutex_);
    std::string out;
    for (const auto& [what, t] : marks_)
      out += fmt::format("{}{} {:.2f} s", out.empty() ? "" : ", ", what, t);
    return out;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::pair<std::string, double>> marks_;
};
StartupMarks g_startup;

std::string self_executable() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  EPMOE_CHECK(n > 0, "cannot find this program's path (/proc/self/exe)");
  return std::string(buf, static_cast<std::size_t>(n));
}

// One rank's results for one phase, as a flat array of doubles (all-gathered over the ranks).
struct PhaseStats {
  double seconds = 0, forwards = 0, tokens = 0;
  double route = 0, dispatch = 0, gemm = 0, combine = 0, shared = 0, total = 0;  // ms per eager forward
  double rel_l2 = 0, calc_diff = 0, non_finite = 0, checked = 0, pass = 1, first_forward_s = 0;
  double eager_seconds = 0;       // the same forwards without graphs (decode with graphs only)
  double load_max_over_mean = 0;  // tokens per GPU over the timed loop (from the slot counters)
  double rebalanced_seconds = 0, rebalanced_load_max_over_mean = 0, slots_rewritten = 0;  // --rebalance
  double slot_cost_tokens = 0;  // --rebalance: the per-forward slot cost it used (tokens)
  double device_gb = 0, comm_layout_gb = 0, dispatcher_setup_gb = 0;
  double gemm_alone_routed = 0, gemm_alone_shared = 0;  // ms, GpuMoeLayer::time_gemms_alone (no TBO)
  // Rows per slot and forward over the timed loop (every rank's slots): the largest, and how many
  // slots average more than 16 / 32 rows (a 16-row GEMM tile reads such a slot's weights twice).
  double slot_rows_max = 0, slots_over_16 = 0, slots_over_32 = 0;
  double shared_own_stream = 0;  // 1: the shared expert ran on its own stream (else inline, in dispatch)
  // The last timed eager forward's spans (GpuForwardSpans, ms from its start; -1: none): route,
  // shared, dispatch / gemm / combine of micro-batch 0 and 1, and whether the GEMMs ran on the
  // compute stream (two-batch overlap).
  double span_route[2] = {-1, -1}, span_shared[2] = {-1, -1};
  double span_dispatch[2][2] = {{-1, -1}, {-1, -1}}, span_gemm[2][2] = {{-1, -1}, {-1, -1}},
         span_combine[2][2] = {{-1, -1}, {-1, -1}};
  double span_gemm_on_compute_stream = 0;
  // What the device did in a few forwards apart from the timed ones (CUPTI's records; forwards = 0
  // where they could not be taken): eager, and replayed as graphs where the phase has graphs.
  bench::ActivitySummary activity_eager, activity_graph;
  // Only doubles: all-gathered as they are laid out (gather()).
  static constexpr int kActivityFields = 5 + 2 * bench::kActivityKinds;
  static constexpr int kFields = 47 + 2 * kActivityFields;
};

static_assert(sizeof(bench::ActivitySummary) == PhaseStats::kActivityFields * sizeof(double));
static_assert(sizeof(PhaseStats) == PhaseStats::kFields * sizeof(double) &&
              std::is_trivially_copyable_v<PhaseStats>);

// Every rank's stats, in rank order (collective).
std::vector<PhaseStats> gather(const PhaseStats& mine, const std::shared_ptr<Communicator>& comm) {
  if (!comm || comm->size() == 1) return {mine};
  const int n = comm->size();
  PhaseStats local = mine;
  cuda::DeviceTensor send(DType::f64, {PhaseStats::kFields}), recv(DType::f64, {n, PhaseStats::kFields});
  cuda::copy_to_device(send, TensorView::contiguous(&local, DType::f64, {PhaseStats::kFields}),
                       comm->stream());
  comm->complete_nccl(ncclAllGather(send.data<double>(), recv.data<double>(), PhaseStats::kFields,
                                    ncclFloat64, comm->nccl(), comm->stream()),
                      "ncclAllGather of the run statistics", __FILE__, __LINE__);
  const HostTensor all = cuda::to_host(recv, comm->stream());
  std::vector<PhaseStats> out(static_cast<std::size_t>(n));
  std::memcpy(static_cast<void*>(out.data()), all.data<double>(),
              all.nbytes());  // trivially copyable (above)
  return out;
}

struct PhasePlan {
  std::string name;
  Mode mode = Mode::low_latency;
  PhaseForwards forwards;  // tokens per forward on this rank
  bool graphs = false;
  std::uint64_t seed = 0;
  bool tbo = true;
  bool eager_compare = false;  // graphs: also time the same forwards eagerly
  bool rebalance = false;      // after the timed loop: EPLB rebalance, then the loop again
  bool check = true;
};

// max / mean of the tokens each GPU received (sums of its slots' counts).
double load_imbalance(const std::vector<std::int64_t>& slot_load, int ranks) {
  const std::size_t per_rank = slot_load.size() / static_cast<std::size_t>(ranks);
  double max = 0, sum = 0;
  for (int r = 0; r < ranks; ++r) {
    double t = 0;
    for (std::size_t i = 0; i < per_rank; ++i) t += static_cast<double>(slot_load[r * per_rank + i]);
    max = std::max(max, t);
    sum += t;
  }
  return sum > 0 ? max / (sum / ranks) : 0.0;
}

// dispatcher_used (out): the dispatcher the layer resolved for the phase; activity_unavailable (out): why
// the device's activity was not recorded (for the graph replays: so prefixed), or empty.
PhaseStats run_phase(const PhasePlan& plan, const std::shared_ptr<const ModelWeights>& weights,
                     const std::shared_ptr<Communicator>& comm, const RunOptions& o, bool first_phase,
                     std::string& dispatcher_used, std::string& activity_unavailable) {
  const MoeConfig& c = weights->config();
  const int rank = comm ? comm->rank() : 0;
  const bool root = rank == 0;
  const std::int64_t T_max = std::max<std::int64_t>(1, plan.forwards.max());
  cuda::GpuLayerOptions lo;
  lo.mode = plan.mode;
  lo.max_tokens = T_max;
  lo.tbo = plan.tbo;
  lo.tbo_comm_sms = o.tbo_comm_sms;
  lo.normal_host_sync = o.normal_host_sync;
  lo.shared_stream = o.shared_stream;
  lo.w4a8_codes = o.w4a8_codes;
  lo.dispatcher = o.dispatcher;
  if (first_phase) lo.on_setup_step = [](const char* step) { g_startup.mark(std::string("layer_") + step); };
  cuda::GpuMoeLayer layer(weights, lo, comm);
  if (first_phase) g_startup.mark("layer_constructed");
  dispatcher_used = layer.dispatcher_name(plan.mode == Mode::normal ? BatchKind::prefill : BatchKind::decode);
  cudaStream_t s = layer.stream();
  const std::int64_t H = c.hidden;

  // A pool of distinct input batches on the device (generated once, outside the timed loop).
  constexpr int kPool = 4;
  std::vector<HostTensor> host_x;
  std::vector<cuda::DeviceTensor> pool;
  for (int b = 0; b < kPool; ++b) {
    host_x.push_back(synthetic_tokens(c, plan.seed + static_cast<std::uint64_t>(b) * 7919u, rank, T_max));
    pool.push_back(cuda::to_device(host_x.back(), s));
  }
  cuda::DeviceTensor y(DType::bf16, {T_max, H});
  auto x_rows = [&](std::size_t f, std::int64_t T) { return pool[f % kPool].view().slice_rows(0, T); };
  // Forward f of the phase, replayed as a graph or eager.
  auto forward = [&](std::size_t f, bool graphs) {
    const std::int64_t T = plan.forwards[static_cast<std::int64_t>(f)];
    if (graphs) {
      layer.forward_graph(x_rows(f, T), y.view().slice_rows(0, T));
    } else {
      layer.forward(x_rows(f, T), y.view().slice_rows(0, T));
    }
  };

  PhaseStats st;
  st.device_gb = static_cast<double>(layer.device_bytes()) / 1e9;
  st.comm_layout_gb = static_cast<double>(layer.comm_layout_bytes()) / 1e9;
  st.dispatcher_setup_gb = static_cast<double>(layer.dispatcher_setup_bytes()) / 1e9;
  // 1. The first forward, eager, poisoned output: the accuracy sample.
  const std::int64_t T0 = plan.forwards[0];
  y.fill_bytes(0xff, s);
  layer.forward(x_rows(0, T0), y.view().slice_rows(0, T0));
  const HostTensor y0 = cuda::to_host(y.view().slice_rows(0, T0), s);
  const HostTensor logits0 = cuda::to_host(layer.last_logits(), s);
  if (first_phase) {
    st.first_forward_s = seconds_since(run_start());
    g_startup.mark("first_forward_done");
  }

  // 2. The phase breakdown from a few eager forwards timed with CUDA events.
  layer.set_timing(true);
  for (std::int64_t f = 0; f < 3 && f < plan.forwards.count; ++f) forward(static_cast<std::size_t>(f), false);
  layer.set_timing(false);
  if (!plan.tbo || layer.num_ranks() == 1) {
    const cuda::GpuMoeLayer::GemmTimes g = layer.time_gemms_alone();
    st.gemm_alone_routed = g.routed_ms;
    st.gemm_alone_shared = g.shared_ms;
  }
  const cuda::GpuPhaseTimes& t = layer.times();
  const double n = std::max<double>(1.0, static_cast<double>(t.forwards));
  st.route = t.route / n;
  st.dispatch = t.dispatch / n;
  st.gemm = t.gemm / n;
  st.combine = t.combine / n;
  st.shared = t.shared / n;
  st.shared_own_stream = layer.shared_expert_on_own_stream() ? 1.0 : 0.0;
  {
    const cuda::GpuForwardSpans& sp = layer.last_spans();
    for (int e = 0; e < 2; ++e) {
      st.span_route[e] = sp.route[static_cast<std::size_t>(e)];
      st.span_shared[e] = sp.shared[static_cast<std::size_t>(e)];
      for (int part = 0; part < 2; ++part) {
        st.span_dispatch[part][e] = sp.dispatch[static_cast<std::size_t>(part)][static_cast<std::size_t>(e)];
        st.span_gemm[part][e] = sp.gemm[static_cast<std::size_t>(part)][static_cast<std::size_t>(e)];
        st.span_combine[part][e] = sp.combine[static_cast<std::size_t>(part)][static_cast<std::size_t>(e)];
      }
    }
    st.span_gemm_on_compute_stream = sp.gemm_on_compute_stream ? 1.0 : 0.0;
  }
  st.total = t.total / n;

  // 3. Graphs captured ahead of the timed loop (one per batch size).
  if (plan.graphs) {
    layer.capture_graphs(plan.forwards.sizes());
    layer.forward_graph(x_rows(0, T0), y.view().slice_rows(0, T0));  // warm replay
  }

  // 4. The timed phase (and, on request, the same eagerly, and again after a rebalance).
  const auto forwards = static_cast<std::size_t>(plan.forwards.count);
  const std::int64_t tokens = plan.forwards.total();
  auto timed_loop = [&](bool graphs, std::size_t count, const char* label) {
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
    if (comm && comm->size() > 1) comm->barrier();
    const auto start = Clock::now();
    // Progress of rank 0, printed as this rank's tokens (the stream synced every 64 forwards).
    Progress progress(plan.name + label);
    std::int64_t done_tokens = 0;
    for (std::size_t f = 0; f < count; ++f) {
      forward(f, graphs);
      done_tokens += plan.forwards[static_cast<std::int64_t>(f)];
      if (f % 64 == 63 || f + 1 == count) {
        EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
        if (root)
          progress.update(static_cast<std::int64_t>(f + 1), static_cast<std::int64_t>(count), done_tokens,
                          seconds_since(start), f + 1 == count);
      }
    }
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(s));
    return seconds_since(start);
  };
  const int ranks = layer.num_ranks();
  layer.reset_load();
  st.seconds = timed_loop(plan.graphs, forwards, "");
  const std::vector<std::int64_t> slot_load = layer.slot_load();
  st.load_max_over_mean = load_imbalance(slot_load, ranks);
  if (forwards > 0) {
    for (const std::int64_t load : slot_load) {
      const double rows = static_cast<double>(load) / static_cast<double>(forwards);
      st.slot_rows_max = std::max(st.slot_rows_max, rows);
      st.slots_over_16 += rows > 16 ? 1 : 0;
      st.slots_over_32 += rows > 32 ? 1 : 0;
    }
  }
  st.forwards = static_cast<double>(forwards);
  st.tokens = static_cast<double>(tokens);
  if (plan.graphs && plan.eager_compare) st.eager_seconds = timed_loop(false, forwards, " eager");
  if (plan.rebalance) {
    st.slot_cost_tokens = o.eplb_slot_cost < 0 ? layer.weight_read_tokens() : o.eplb_slot_cost;
    st.slots_rewritten = layer.rebalance(1, st.slot_cost_tokens);
    st.rebalanced_seconds = timed_loop(plan.graphs, forwards, " after rebalance");
    st.rebalanced_load_max_over_mean = load_imbalance(layer.slot_load(), ranks);
  }

  // 5. The device's idle time inside a forward (CUPTI's records; forwards apart from the timed ones).
  if (o.device_idle) {
    const int measured = static_cast<int>(std::min<std::size_t>(3, forwards));
    auto measure = [&](bool graphs) {
      std::string why;
      const bench::ActivitySummary a =
          bench::measure_forwards([&](int i) { forward(static_cast<std::size_t>(i) % forwards, graphs); },
                                  measured, &why, comm.get());
      if (a.forwards == 0) activity_unavailable = fmt::format("{}{}", graphs ? "graph replay: " : "", why);
      return a;
    };
    if (measured > 0) {
      st.activity_eager = measure(false);
      if (plan.graphs) st.activity_graph = measure(true);
    }
  }

  // 6. The accuracy check of the first forward on a sample of tokens (the CPU reference, routed from
  // the GPU's logits).
  const std::int64_t S = plan.check ? std::min(o.check_tokens, T0) : 0;
  if (S > 0) {
    const TensorView xs = host_x[0].view().slice_rows(0, S);
    HostTensor ref(DType::bf16, {S, H});
    reference_forward(*weights, xs, logits0.view().slice_rows(0, S), ref, Numerics::mirror);
    const ErrorReport r = compare(y0.view().slice_rows(0, S), ref);
    st.rel_l2 = r.rel_l2;
    st.calc_diff = r.calc_diff;
    st.non_finite = static_cast<double>(r.non_finite);
    st.checked = static_cast<double>(S);
    st.pass = r.within(o.tolerance) ? 1 : 0;
  }
  return st;
}

nlohmann::json phase_json(const PhasePlan& plan, const std::vector<PhaseStats>& ranks, std::int64_t ranks_n,
                          double tolerance) {
  double max_s = 0, tokens = 0, rel = 0, cd = 0, nf = 0;
  bool pass = true;
  nlohmann::json per_rank = nlohmann::json::array();
  for (const PhaseStats& r : ranks) {
    // Idle: what the eager forward loses to the host (launch gaps, host waits) beside the same
    // forwards replayed as CUDA graphs, which leave the stream no gap to wait in; null where the
    // phase has no graph replay to compare with (normal mode, --no-graphs). (The phase times are
    // consecutive CUDA-event intervals that make up the total: they cannot show the stream starving.)
    const nlohmann::json idle =
        r.eager_seconds > 0 && r.seconds > 0 && r.forwards > 0
            ? nlohmann::json(std::max(0.0, (r.eager_seconds - r.seconds) / r.forwards * 1e3))
            : nlohmann::json(nullptr);
    max_s = std::max(max_s, r.seconds);
    tokens += r.tokens;
    rel = std::max(rel, r.rel_l2);
    cd = std::max(cd, r.calc_diff);
    nf += r.non_finite;
    pass = pass && r.pass > 0;
    per_rank.push_back(
        {{"seconds", r.seconds},
         {"tokens", r.tokens},
         {"ms_per_forward",
          {{"route", r.route},
           {"dispatch", r.dispatch},
           {"gemm", r.gemm},
           {"combine", r.combine},
           {"shared", r.shared},
           {"shared_own_stream", r.shared_own_stream > 0},
           {"gemm_alone_routed", r.gemm_alone_routed},
           {"gemm_alone_shared", r.gemm_alone_shared},
           {"total", r.total},
           {"idle", idle}}},
         {"device_activity", {{"eager", r.activity_eager.json()}, {"graph", r.activity_graph.json()}}},
         {"check",
          {{"tokens", r.checked},
           {"rel_l2", r.rel_l2},
           {"calc_diff", r.calc_diff},
           {"non_finite", r.non_finite},
           {"pass", r.pass > 0}}}});
  }
  const double forwards = ranks.front().forwards;
  const PhaseStats& r0 = ranks.front();
  double eager_max = 0, rebal_max = 0, rewritten = 0;
  for (const PhaseStats& r : ranks) {
    eager_max = std::max(eager_max, r.eager_seconds);
    rebal_max = std::max(rebal_max, r.rebalanced_seconds);
    rewritten += r.slots_rewritten;
  }
  nlohmann::json extra = nlohmann::json::object();
  extra["load_max_over_mean"] = r0.load_max_over_mean;
  extra["slot_rows_per_forward"] = {
      {"max", r0.slot_rows_max}, {"slots_over_16", r0.slots_over_16}, {"slots_over_32", r0.slots_over_32}};
  extra["device_gb_per_rank"] = r0.device_gb;
  extra["comm_layout_gb_per_rank"] = r0.comm_layout_gb;
  extra["dispatcher_setup_gb_per_rank"] = r0.dispatcher_setup_gb;
  double gemm_alone = 0;  // the slowest rank's routed + shared expert GEMMs, re-run by themselves
  for (const PhaseStats& r : ranks)
    gemm_alone = std::max(gemm_alone, r.gemm_alone_routed + r.gemm_alone_shared);
  if (gemm_alone > 0 && forwards > 0) {
    extra["gemm_alone_ms"] = gemm_alone;
    extra["layer_over_gemm_alone"] = 1e3 * max_s / forwards / gemm_alone;
  }
  if (eager_max > 0) {
    extra["eager_ms_per_forward"] = 1e3 * eager_max / forwards;
    extra["graph_speedup"] = max_s > 0 ? eager_max / max_s : 0.0;
  }
  if (plan.rebalance) {
    extra["rebalance"] = {
        {"slots_rewritten", rewritten},
        {"slot_cost_tokens_per_forward", r0.slot_cost_tokens},
        {"before",
         {{"ms_per_forward", 1e3 * max_s / forwards}, {"load_max_over_mean", r0.load_max_over_mean}}},
        {"after",
         {{"ms_per_forward", 1e3 * rebal_max / forwards},
          {"load_max_over_mean", r0.rebalanced_load_max_over_mean}}},
        {"speedup", rebal_max > 0 ? max_s / rebal_max : 0.0}};
  }
  // Rank 0's device activity at the phase's level (every rank's in per_rank): the idle time inside a
  // forward, which the CUDA-event phase times cannot show; null with the reason where not recorded.
  // (run_rank adds rank 0's reason where it was not recorded: "unavailable".)
  extra["device_activity"] = {{"eager", r0.activity_eager.json()},
                              {"graph", r0.activity_graph.json()},
                              {"measured_after_rebalance", plan.rebalance}};
  nlohmann::json j = {
      {"mode", to_string(plan.mode)},
      {"graphs", plan.graphs},
      {"ranks", ranks_n},
      {"forwards", forwards},
      {"tokens", tokens},
      {"seconds", max_s},
      {"tokens_per_s", max_s > 0 ? tokens / max_s : 0.0},
      {"ms_per_forward", forwards > 0 ? 1e3 * max_s / forwards : 0.0},
      {"check",
       {{"rel_l2", rel}, {"calc_diff", cd}, {"non_finite", nf}, {"tolerance", tolerance}, {"pass", pass}}},
      {"tbo", plan.tbo && ranks_n > 1},
      {"per_rank", per_rank}};
  j.update(extra);
  return j;
}

// One eager forward per phase and rank as Chrome-trace "complete" events (pid = rank; tid 0 = the
// main stream, 1 = the shared expert's, 2 = the compute stream of two-batch overlap), from the spans
// the layer recorded with CUDA events on the stream that ran each phase (GpuForwardSpans): where the
// micro-batches' GEMMs overlap the other's dispatch and combine, the timeline shows it. Each rank's
// forward starts at offset_us (the ranks' clocks are not aligned beyond that).
nlohmann::json trace_events(const std::string& phase, const std::vector<PhaseStats>& ranks,
                            double offset_us) {
  nlohmann::json events = nlohmann::json::array();
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    const PhaseStats& s = ranks[r];
    const int gemm_tid = s.span_gemm_on_compute_stream > 0 ? 2 : 0;
    auto span = [&](const std::string& name, const double* b_e, int tid) {
      if (b_e[0] < 0 || b_e[1] < b_e[0]) return;
      events.push_back({{"name", phase + " " + name},
                        {"ph", "X"},
                        {"ts", offset_us + 1e3 * b_e[0]},
                        {"dur", 1e3 * (b_e[1] - b_e[0])},
                        {"pid", r},
                        {"tid", tid}});
    };
    span("route", s.span_route, 0);
    for (int part = 0; part < 2; ++part) {
      const std::string mb = s.span_dispatch[1][0] >= 0 ? (part == 0 ? " A" : " B") : "";
      span("dispatch" + mb, s.span_dispatch[part], 0);
      span("gemm" + mb, s.span_gemm[part], gemm_tid);
      span("combine" + mb, s.span_combine[part], 0);
    }
    span(s.shared_own_stream > 0 ? "shared expert" : "shared expert (inline, main stream)", s.span_shared, 1);
    const std::pair<int, const char*> threads[] = {
        {0, "main stream"}, {1, "shared expert stream"}, {2, "compute stream (two-batch overlap)"}};
    for (const auto& [tid, name] : threads)
      events.push_back(
          {{"name", "thread_name"}, {"ph", "M"}, {"pid", r}, {"tid", tid}, {"args", {{"name", name}}}});
  }
  return events;
}

void print_phase(const std::string& name, const nlohmann::json& j) {
  std::printf(
      "  %-8s %-11s %-9s %5.0f forwards %9.0f tokens %11.1f tokens/s %8.3f ms/forward  check rel_l2 %.2e "
      "%s\n",
      name.c_str(), j["mode"].get<std::string>().c_str(), j["dispatcher"].get<std::string>().c_str(),
      j["forwards"].get<double>(), j["tokens"].get<double>(), j["tokens_per_s"].get<double>(),
      j["ms_per_forward"].get<double>(), j["check"]["rel_l2"].get<double>(),
      j["check"]["pass"].get<bool>() ? "PASS" : "FAIL");
  const auto& r0 = j["per_rank"][0]["ms_per_forward"];
  const std::string idle =
      r0["idle"].is_null() ? std::string("n/a (no graph replay to compare)")
                           : fmt::format("{:.3f} ms (eager minus graph replay)", r0["idle"].get<double>());
  std::printf(
      "           rank 0 eager forward: route %.3f  dispatch %.3f  gemm %.3f  combine %.3f  = %.3f ms"
      " (shared expert %.3f ms, %s); idle %s\n",
      r0["route"].get<double>(), r0["dispatch"].get<double>(), r0["gemm"].get<double>(),
      r0["combine"].get<double>(), r0["total"].get<double>(), r0["shared"].get<double>(),
      r0["shared_own_stream"].get<bool>() ? "on its own stream" : "inline, inside dispatch", idle.c_str());
  const auto& activity = j["device_activity"];
  for (const char* how : {"eager", "graph"}) {
    const auto& a = activity[how];
    if (a.is_null()) continue;
    const auto& before = a["idle_before_kind_ms"];
    std::printf(
        "           rank 0 device (CUPTI, %s): idle %.3f of %.3f ms per forward; idle before route %.3f  "
        "dispatch/combine %.3f  experts %.3f  copies %.3f  other %.3f\n",
        how, a["idle_ms"].get<double>(), a["window_ms"].get<double>(), before["route"].get<double>(),
        before["dispatch_combine"].get<double>(), before["experts"].get<double>(),
        before["copies"].get<double>(), before["other"].get<double>());
  }
  if (activity.contains("unavailable"))
    std::printf("           device idle: not recorded (%s)\n",
                activity["unavailable"].get<std::string>().c_str());
}

// The host side of the synthetic model (gate, bias, the W4A8 activation-scale calibration), started on
// its own thread before CUDA and NCCL come up, so that their set-up hides it.
std::future<std::shared_ptr<SyntheticWeights>> start_host_weights(const RunOptions& o,
                                                                  const MoeConfig& config) {
  return std::async(std::launch::async, [&o, config] {
    auto weights = std::make_shared<SyntheticWeights>(config, o.model.seed);
    if (o.zipf > 0) weights->skew_routing(o.zipf);
    g_startup.mark("host_weights_ready");
    return weights;
  });
}

void run_rank(const RunOptions& o, const MoeConfig& config, std::shared_ptr<Communicator> comm,
              std::future<std::shared_ptr<SyntheticWeights>> host_weights) {
  reserve_stdout_for_json(o.json);
  const int rank = comm ? comm->rank() : 0;
  const int ranks = config.num_ranks;
  const int device = comm ? comm->device() : 0;
  EPMOE_CHECK(
      o.dispatcher == "auto" || ranks > 1,
      "--dispatcher {} needs 2 or more ranks (`epmoe launch -n N -- epmoe run`); one GPU runs the local "
      "permutation",
      o.dispatcher);
  EPMOE_CUDA_CHECK(cudaSetDevice(device));
  const bool root = rank == 0;
  if (root) {
    std::printf("epmoe run: %s\n", config.describe().c_str());
    std::printf("  device: gpu, %d rank(s), one process per GPU: %s\n", ranks,
                cuda::device_description(device).c_str());
    std::fflush(stdout);
  }
  std::shared_ptr<SyntheticWeights> weights = host_weights.get();
  weights->set_expert_factory(cuda::gpu_expert_factory(device));

  const std::int64_t decode_tokens =
      o.tokens >= 0 ? o.tokens : std::max<std::int64_t>(1, o.concurrency / std::max(1, ranks));
  // --steps 0 or --tokens 0: no decode phase (as --prompt-tokens 0: no prefill phase).
  const int steps = decode_tokens > 0 ? (o.steps >= 0 ? o.steps : 1000) : 0;
  const std::int64_t chunk = o.chunk > 0 ? o.chunk : 4096;
  const std::int64_t prompts =
      o.prompts >= 0 ? o.prompts : std::max<std::int64_t>(1, o.concurrency / std::max(1, ranks));
  EPMOE_CHECK(o.mode == "auto",
              "--mode: the GPU run uses low-latency mode for decode and normal mode for prefill "
              "(auto); got '{}'",
              o.mode);
  EPMOE_CHECK(
      decode_tokens <= config.max_tokens_per_rank,
      "decode tokens per rank ({}: --tokens, or --concurrency / ranks) must be <= --max-tokens-per-rank "
      "({})",
      decode_tokens, config.max_tokens_per_rank);

  std::vector<PhasePlan> plans;
  if (steps > 0) {
    PhasePlan p{"decode", Mode::low_latency, PhaseForwards::uniform(steps, decode_tokens),
                o.graphs, o.model.seed + 1,  o.tbo,
                o.graphs, o.rebalance,       true};
    plans.push_back(p);
    if (o.tbo && ranks > 1) {  // the same without two-batch overlap, for the comparison
      p.name = "decode-no-tbo";
      p.tbo = false;
      p.eager_compare = false;
      p.rebalance = false;
      p.check = false;
      plans.push_back(std::move(p));
    }
  }
  if (o.prompt_tokens > 0 && prompts > 0) {
    PhasePlan p{"prefill", Mode::normal, {}, false, o.model.seed + 2, o.tbo, false, false, true};
    EPMOE_CHECK(o.prompt_tokens <= LLONG_MAX / prompts,
                "--prompts ({}) x --prompt-tokens ({}): the prefill tokens per rank overflow 64 bits",
                prompts, o.prompt_tokens);
    p.forwards = PhaseForwards::chunked(prompts * o.prompt_tokens, chunk);
    plans.push_back(p);
    if (o.tbo && ranks > 1) {  // the same without two-batch overlap, for the comparison
      p.name = "prefill-no-tbo";
      p.tbo = false;
      p.check = false;
      plans.push_back(std::move(p));
    }
  }
  EPMOE_CHECK(
      !plans.empty(),
      "nothing to run: no decode phase (--steps or --tokens 0) and no prefill phase (--prompt-tokens 0)");

  nlohmann::json j = result_header_json(Device::cuda, config, o.model);
  j.update({{"gpu", cuda::device_description(device)},
            {"preset", config.name},
            {"ranks", ranks},
            {"quant", to_string(config.quant)},
            {"layer_mode", "auto"},
            {"decode_tokens_per_rank", decode_tokens},
            {"decode_steps", steps},
            {"prefill_chunk", chunk},
            {"prompts_per_rank", prompts},
            {"prompt_tokens", o.prompt_tokens},
            {"shared_stream", o.shared_stream},
            {"normal_host_sync", o.normal_host_sync},
            {"dispatcher", o.dispatcher},
            {"w4a8_codes", o.w4a8_codes},
            {"tolerance", o.tolerance}});
  bool pass = true;
  std::vector<std::pair<std::string, nlohmann::json>> printed;
  nlohmann::json trace = nlohmann::json::array();
  double trace_offset_us = 0;
  for (std::size_t i = 0; i < plans.size(); ++i) {
    std::string dispatcher_used, activity_unavailable;
    const PhaseStats mine =
        run_phase(plans[i], weights, comm, o, i == 0, dispatcher_used, activity_unavailable);
    const std::vector<PhaseStats> all = gather(mine, comm);
    nlohmann::json pj = phase_json(plans[i], all, ranks, o.tolerance);
    pj["dispatcher"] = dispatcher_used;
    if (!activity_unavailable.empty()) pj["device_activity"]["unavailable"] = activity_unavailable;
    if (i == 0) pj["first_forward_s_after_start"] = all.front().first_forward_s;
    pass = pass && pj["check"]["pass"].get<bool>();
    j[plans[i].name] = pj;
    printed.emplace_back(plans[i].name, pj);
    for (auto& e : trace_events(plans[i].name, all, trace_offset_us)) trace.push_back(e);
    trace_offset_us += 1e3 * (all.front().total + 1.0);
  }
  if (j.contains("decode") && j.contains("decode-no-tbo")) {
    const double with = j["decode"]["ms_per_forward"].get<double>();
    j["decode"]["tbo_speedup"] = with > 0 ? j["decode-no-tbo"]["ms_per_forward"].get<double>() / with : 0.0;
  }
  if (j.contains("prefill") && j.contains("prefill-no-tbo")) {
    // Two-batch overlap against the same forwards without it, and against the GEMM time alone (the
    // eager breakdown of the run without overlap, where the GEMMs run by themselves).
    const double with = j["prefill"]["ms_per_forward"].get<double>();
    const double without = j["prefill-no-tbo"]["ms_per_forward"].get<double>();
    // The GEMM time alone: the routed and the shared expert's GEMMs of a forward re-run by themselves
    // (time_gemms_alone), the slowest rank; beside it the routed GEMM phase of the eager breakdown
    // (which the shared expert, running on its own stream, slows down).
    double gemm = 0, gemm_phase = 0;
    for (const auto& r : j["prefill-no-tbo"]["per_rank"]) {
      const auto& m = r["ms_per_forward"];
      gemm = std::max(gemm, m["gemm_alone_routed"].get<double>() + m["gemm_alone_shared"].get<double>());
      gemm_phase = std::max(gemm_phase, m["gemm"].get<double>());
    }
    j["prefill"]["tbo_speedup"] = with > 0 ? without / with : 0.0;
    j["prefill"]["gemm_alone_ms"] = gemm;
    j["prefill"]["gemm_phase_ms"] = gemm_phase;
    j["prefill"]["layer_over_gemm"] = gemm > 0 ? with / gemm : 0.0;
    j["prefill"]["layer_no_tbo_over_gemm"] = gemm > 0 ? without / gemm : 0.0;
  }
  if (comm) {  // this rank's (the root's) symmetric-memory set-up over every phase's dispatchers
    const Communicator::SetupMemory& m = comm->setup_memory();
    j["comm_setup_gb"] = {{"buffers", static_cast<double>(m.buffers) / 1e9},
                          {"window_register", static_cast<double>(m.window_register) / 1e9},
                          {"dev_comm", static_cast<double>(m.dev_comm) / 1e9},
                          {"first_barrier", static_cast<double>(m.barrier) / 1e9}};
  }
  // Rank 0's start-up milestones (seconds since its process started).
  j["startup_s"] = g_startup.json();
  j["pass"] = pass;
  if (root) {
    std::printf("results:\n");
    for (const auto& [name, pj] : printed) print_phase(name, pj);
    if (j.contains("decode")) {
      std::printf("  first forward done %.2f s after the command started (%s)\n",
                  j["decode"]["first_forward_s_after_start"].get<double>(), g_startup.describe().c_str());
    }
    std::printf("check against the CPU reference (%lld tokens per rank and phase, tolerance %g): %s\n",
                static_cast<long long>(o.check_tokens), o.tolerance, pass ? "PASS" : "FAIL");
    if (j.contains("decode") && j["decode"].contains("graph_speedup"))
      std::printf("  decode: CUDA graphs %.2fx faster than eager (%.3f vs %.3f ms/forward)\n",
                  j["decode"]["graph_speedup"].get<double>(), j["decode"]["ms_per_forward"].get<double>(),
                  j["decode"]["eager_ms_per_forward"].get<double>());
    if (j.contains("decode") && j["decode"].contains("rebalance")) {
      const auto& rb = j["decode"]["rebalance"];
      std::printf(
          "  decode: EPLB rebalance (slot cost %.0f tokens) rewrote %.0f slots; tokens per GPU max/mean %.3f "
          "-> %.3f; %.3f -> %.3f "
          "ms/forward\n",
          rb["slot_cost_tokens_per_forward"].get<double>(), rb["slots_rewritten"].get<double>(),
          rb["before"]["load_max_over_mean"].get<double>(), rb["after"]["load_max_over_mean"].get<double>(),
          rb["before"]["ms_per_forward"].get<double>(), rb["after"]["ms_per_forward"].get<double>());
    }
    if (j.contains("decode") && j["decode"].contains("tbo_speedup"))
      std::printf("  decode: two-batch overlap %.2fx faster than without (%.3f vs %.3f ms/forward)\n",
                  j["decode"]["tbo_speedup"].get<double>(), j["decode"]["ms_per_forward"].get<double>(),
                  j["decode-no-tbo"]["ms_per_forward"].get<double>());
    if (j.contains("prefill") && j["prefill"].contains("tbo_speedup"))
      std::printf(
          "  prefill: two-batch overlap %.2fx faster than without; layer %.2fx (%.2fx without overlap) its "
          "GEMM time alone (%.3f ms: routed + shared expert, re-run by themselves)\n",
          j["prefill"]["tbo_speedup"].get<double>(), j["prefill"]["layer_over_gemm"].get<double>(),
          j["prefill"]["layer_no_tbo_over_gemm"].get<double>(), j["prefill"]["gemm_alone_ms"].get<double>());
    if (!o.json.empty()) write_text_file("--json", o.json, j.dump(2) + "\n");
    if (!o.trace.empty())
      write_text_file("--trace", o.trace, nlohmann::json{{"traceEvents", trace}}.dump() + "\n");
  }
  set_exit_code(pass ? 0 : 1);
}

}  // namespace

void run_gpu_main(const RunOptions& o) {
  const MoeConfig config = build_config(o.model, Device::cuda);
  const int gpus = cuda::device_count_without_cuda_init();
  const LaunchEnvironment env = LaunchEnvironment::from_env();
  if (config.num_ranks == 1 && !env.present) {
    auto host_weights = start_host_weights(o, config);
    EPMOE_CUDA_CHECK(cudaSetDevice(0));
    EPMOE_CUDA_CHECK(cudaFree(nullptr));  // the context now, while the weights thread works
    g_startup.mark("cuda_context");
    run_rank(o, config, nullptr, std::move(host_weights));
    return;
  }
  if (!env.present) {
    // One process per GPU: this command again under the launcher.
    EPMOE_CHECK(config.num_ranks <= gpus, "--ranks {} needs {} GPUs, {} present", config.num_ranks,
                config.num_ranks, gpus);
    const auto start_ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(g_process_start.time_since_epoch());
    setenv(kRunStartVar, std::to_string(start_ns.count()).c_str(), 1);  // the ranks inherit it
    LaunchOptions lo;
    lo.num_ranks = config.num_ranks;
    lo.command = program_args();
    lo.command.at(0) = self_executable();
    // With --json - the ranks keep stdout for rank 0's JSON (their reports go to stderr): passed on
    // unprefixed.
    lo.prefix_stdout = o.json != "-";
    const LaunchSignals signals;  // Ctrl-C, SIGTERM, SIGHUP stop the ranks too, not only this process
    lo.interrupted = signals.interrupted();
    const LaunchResult r = launch_ranks(lo);
    set_exit_code(r.exit_code);
    return;
  }
  EPMOE_CHECK(env.world_size == config.num_ranks, "the launcher started {} ranks but --ranks is {}",
              env.world_size, config.num_ranks);
  // Communication on a high-priority stream: with two-batch overlap its kernels then get SMs ahead
  // of the GEMMs queued on the compute streams.
  if (run_start() < g_process_start) g_startup.mark("rank_process_started", g_process_start);
  auto host_weights = start_host_weights(o, config);
  EPMOE_CUDA_CHECK(cudaSetDevice(env.device));
  cuda::Stream comm_stream(cuda::Stream::highest_priority());
  g_startup.mark("cuda_context");
  CommOptions co;
  co.stream = comm_stream.get();
  auto comm = Communicator::from_environment(co);
  g_startup.mark("nccl_init_started");  // it completes in the background (Communicator::create)
  run_rank(o, config, comm, std::move(host_weights));
}

}  // namespace epmoe::tools
