// Benchmark suite "comm": expert-parallel dispatch and combine across ranks (issue 6 bars).
//
// Needs 2+ ranks, one process per GPU: `epmoe launch -n 2 -- epmoe bench comm` (each rank prints
// and, with --json, writes its own results: give each rank its own file, e.g.
// `epmoe launch -n 2 -- sh -c 'epmoe bench comm --json comm-rank$EPMOE_RANK.json'`). Started any
// other way (or with fewer GPUs than ranks) it says so and measures nothing.
//
//   normal mode   4096 tokens per rank, DeepSeek-V3 (H = 7168, top-8 of 256), FP8 dispatch / bf16
//                 combine over nvlink (LSA stores, one host sync per dispatch) and nccl-p2p, each
//                 also without the host sync ("-no-sync": the layout at its bound); and
//                 ncclAlltoAll moving the same bytes per peer.
//   low latency   1, 32, 64, 128, 256 tokens per rank (buffers sized to the batch), graph-replayed,
//                 over nvlink-ll and nccl-p2p ("nccl-p2p-eager": the same calls eager); plus the send
//                 halves of nvlink-ll alone.
// GB/s counts the bytes a rank sends to other ranks (token payloads: x + scales + ids + weights
// for dispatch, bf16 partial sums for combine) over the median time of one call; floor_us is those
// bytes at the measured NVLink P2P rate (396 GB/s). "sms": the SMs of the kernel that writes to the
// peers (nvlink dispatch: the send kernel, swept over EPMOE_COMM_SEND_SMS; combine: the reduce
// kernel); "sms_all": the most SMs any kernel of the call spans (place / reduce / home run on every
// SM: they move the rank's local HBM traffic, the fan-out to the expert rows and the reduction).
// "nvlink-<variant>": the send-path variants of send_variants() (fence batching, bulk copies, copy
// engines; for "ce" / "ce2" rows "sms" is the pack blocks', which write only local memory).
// "nvlink-halves" is dispatch_send + dispatch_recv (send, then place, one stream, own tokens
// through the window) next to the whole dispatch() call. "nvlink-ll-split<S>" / "nvlink-split<S>":
// the combine with S warps per token (EPMOE_COMM_COMBINE_SPLIT; the default "nvlink-ll" row has
// comm_detail::low_latency_combine_split, "nvlink-ll-split1" is the one-warp combine before it).
// "nvlink-ll-no-early": the LL dispatch without early counts (EPMOE_COMM_LL_EARLY_COUNTS=0; the
// default has them). "comm.peer_copy" /
// "comm.place_traffic": one 15 MiB copy-engine copy into the peer's window, alone and beside a
// kernel streaming the place step's HBM traffic (peer_copies below). "comm.sm_link": SM loads
// (pull) and stores (push) over NVLink by SM count (sm_link below). EPMOE_BENCH_COMM_ONLY=copy,
// link, ll or normal runs only that part.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "bench/bench.hpp"
#include "comm/comm_internal.hpp"
#include "comm/ep_kernels.hpp"
#include "dispatch/dispatch_common.hpp"
#include "epmoe/comm_dispatch.hpp"
#include "epmoe/cuda/device_buffer.hpp"

namespace epmoe::bench {
namespace {

constexpr double kNvlinkGBps = 396.0;

struct Inputs {
  cuda::DeviceTensor x, scales, ids, weights;
  std::int64_t tokens_out = 0;  // tokens of this rank that go to other ranks
  std::int64_t tokens_in = 0;   // tokens of other ranks that come to this rank
  DispatchInput view() const { return {x.view(), scales.view(), 1.0f, ids.view(), weights.view()}; }
};

// Every rank's ids from the same seed (so each rank knows what it will receive), uniform top-K
// distinct experts; x random bf16 bits reinterpreted as fp8, scales 1.
Inputs make_inputs(const MoeConfig& c, std::int64_t T, int me, std::uint64_t seed, cudaStream_t stream) {
  const int N = c.num_ranks, K = c.topk, P = c.num_physical_experts(), L = c.num_local_experts();
  Inputs in;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> any(0, P - 1);
  HostTensor ids(DType::i32, {T, K}), weights(DType::f32, {T, K});
  for (int r = 0; r < N; ++r) {
    for (std::int64_t t = 0; t < T; ++t) {
      std::set<int> used, ranks;
      for (int k = 0; k < K; ++k) {
        int id;
        do id = any(rng);
        while (used.count(id));
        used.insert(id);
        ranks.insert(id / L);
        if (r == me) {
          ids.data<std::int32_t>()[t * K + k] = id;
          weights.data<float>()[t * K + k] = 1.0f / static_cast<float>(K);
        }
      }
      if (r == me) in.tokens_out += static_cast<std::int64_t>(ranks.size()) - (ranks.count(me) ? 1 : 0);
      if (r != me && ranks.count(me)) in.tokens_in += 1;
    }
  }
  in.ids = cuda::to_device(ids, stream);
  in.weights = cuda::to_device(weights, stream);
  in.x = cuda::DeviceTensor(DType::fp8_e4m3, {T, c.hidden});
  in.scales = cuda::DeviceTensor(DType::f32, {T, c.hidden / 128});
  if (T > 0) {
    // Any bytes will do for the payload: fill through a bf16 view of the same memory.
    fill_random_bf16(TensorView::contiguous(in.x.view().data, DType::bf16, {T, c.hidden / 2}, Device::cuda),
                     seed, stream);
    HostTensor ones(DType::f32, {T, c.hidden / 128});
    for (std::int64_t i = 0; i < ones.numel(); ++i) ones.data<float>()[i] = 1.0f;
    cuda::copy(in.scales.view(), ones, stream);
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  return in;
}

MoeConfig deepseek(int ranks, int max_tokens) {
  MoeConfig c = MoeConfig::preset("deepseek-v3");
  c.num_ranks = ranks;
  c.max_tokens_per_rank = max_tokens;
  return c;
}

Params params(const std::string& transport, const std::string& mode, const std::string& phase, std::int64_t T,
              const Communicator& comm, int sms = -1, int sms_all = -1) {
  Params p{{"transport", transport}, {"mode", mode},       {"phase", phase}, {"tokens", T},
           {"ranks", comm.size()},   {"rank", comm.rank()}};
  if (sms >= 0) p["sms"] = sms;
  if (sms_all >= 0) p["sms_all"] = sms_all;
  return p;
}

int device_sms() {
  return cuda::device_props().sm_count;
}
// SMs a grid of `blocks` spans (at most one block per SM for the send kernel's 512 threads, all for
// the work kernels).
int sms_of(int blocks) {
  return std::min(blocks, device_sms());
}

// Times `launch` with every rank starting together.
double timed(Communicator& comm, const Launch& launch, const TimingOptions& t) {
  comm.barrier();
  TimingOptions collective = t;
  collective.single_attempt = comm.size() > 1;  // the calls are collective: the same count on every rank
  const double us = time_us(launch, 1, comm.stream(), collective);
  comm.check_device_errors();
  return us;
}

// A timed() launch that replays graph g.
auto replay(const cuda::Graph& g) {
  return [&g](int, cudaStream_t s) { g.launch(s); };
}

// Runs fn with the environment variables `vars` ({name, value}) set (every rank sets the same),
// then restores them.
using EnvVars = std::vector<std::pair<std::string, std::string>>;
template <typename Fn>
auto with_env(const EnvVars& vars, Fn&& fn) {
  std::vector<std::pair<std::string, const char*>> before;
  std::vector<std::string> keep;
  keep.reserve(vars.size());
  for (const auto& [name, value] : vars) {
    const char* b = std::getenv(name.c_str());
    keep.push_back(b != nullptr ? b : "");
    before.emplace_back(name, b != nullptr ? keep.back().c_str() : nullptr);
    setenv(name.c_str(), value.c_str(), 1);
  }
  auto result = fn();
  for (const auto& [name, b] : before) {
    if (b != nullptr)
      setenv(name.c_str(), b, 1);
    else
      unsetenv(name.c_str());
  }
  return result;
}

// Send-path variants timed beside the default (per-lane stores, a fence per 8 tokens): the v3
// send (a fence per token), fewer fences, and the bulk-copy send (EPMOE_COMM_SEND_BULK=1).
struct SendVariant {
  const char* label;
  EnvVars env;
};
const std::vector<SendVariant>& send_variants() {
  static const std::vector<SendVariant> v = {
      {"fence1", {{"EPMOE_COMM_FENCE_BATCH", "1"}}},
      {"fence4", {{"EPMOE_COMM_FENCE_BATCH", "4"}}},
      {"fence16", {{"EPMOE_COMM_FENCE_BATCH", "16"}}},
      {"bulk-lag6", {{"EPMOE_COMM_SEND_BULK", "1"}, {"EPMOE_COMM_BULK_LAG", "6"}}},
      // Normal mode only (the low-latency rows skip them): the copy engines move the rows. "ce":
      // separate pack launches (v4, measured in v4 run 3 with 4 / 16 pieces and 64 pack blocks);
      // "ce2": packing inside the dispatch launch, the side stream waiting on each piece's flag (v5).
      {"ce", {{"EPMOE_COMM_SEND_CE", "1"}}},
      {"ce2", {{"EPMOE_COMM_SEND_CE", "2"}}},
      {"ce2-pieces4", {{"EPMOE_COMM_SEND_CE", "2"}, {"EPMOE_COMM_CE_PIECES", "4"}}},
      {"ce2-pieces16", {{"EPMOE_COMM_SEND_CE", "2"}, {"EPMOE_COMM_CE_PIECES", "16"}}},
      {"ce2-streams2", {{"EPMOE_COMM_SEND_CE", "2"}, {"EPMOE_COMM_CE_STREAMS", "2"}}},
      {"ce2-streams2-pieces16",
       {{"EPMOE_COMM_SEND_CE", "2"}, {"EPMOE_COMM_CE_STREAMS", "2"}, {"EPMOE_COMM_CE_PIECES", "16"}}},
      {"ce2-pack48", {{"EPMOE_COMM_SEND_CE", "2"}, {"EPMOE_COMM_SEND_SMS", "48"}}},
      {"ce2-pack12", {{"EPMOE_COMM_SEND_CE", "2"}, {"EPMOE_COMM_SEND_SMS", "12"}}},
      {"ce2-pack32", {{"EPMOE_COMM_SEND_CE", "2"}, {"EPMOE_COMM_SEND_SMS", "32"}}},
      {"ce2-pieces2", {{"EPMOE_COMM_SEND_CE", "2"}, {"EPMOE_COMM_CE_PIECES", "2"}}},
      {"ce2-streams2-pieces4",
       {{"EPMOE_COMM_SEND_CE", "2"}, {"EPMOE_COMM_CE_STREAMS", "2"}, {"EPMOE_COMM_CE_PIECES", "4"}}},
  };
  return v;
}

// Low-latency dispatch variants timed beside the default at every batch size.
const std::vector<SendVariant>& low_latency_dispatch_variants() {
  static const std::vector<SendVariant> v = {
      {"route-kernel", {{"EPMOE_COMM_LL_ROUTE_IN_LAUNCH", "0"}}},
      {"chunk8", {{"EPMOE_COMM_LL_ARRIVAL_CHUNK", "8"}}},
      {"chunk64", {{"EPMOE_COMM_LL_ARRIVAL_CHUNK", "64"}}},
      {"v6", {{"EPMOE_COMM_LL_ROUTE_IN_LAUNCH", "0"}, {"EPMOE_COMM_LL_ARRIVAL_CHUNK", "64"}}},
  };
  return v;
}

// Warps per token of the split combine rows (EPMOE_COMM_COMBINE_SPLIT): at H = 7168 a partial is
// 28 units of 512 bytes, so 7 / 14 / 28 warps take 4 / 2 / 1 units each (2 / 1 / 1 load rounds of
// weighted_sum_rows, the last with half its loads).
const std::vector<int>& combine_splits() {
  static const std::vector<int> v = {1, 4, 14, 28};
  return v;
}

// The last call's phases (comm_detail::read_trace), in µs after `origin` (the routing's start for
// a dispatch, the reduce's start for a combine).
void print_trace(const std::string& what, int origin = comm_detail::kTraceRouteStart) {
  std::uint64_t t[comm_detail::kTraceSlots];
  comm_detail::read_trace(t);
  static const char* const kNames[] = {"route",  "send",       "count_flag", "send_copied",  "send_end",
                                       "place",  "counts",     "own_done",   "arrived",      "place_end",
                                       "reduce", "reduce_end", "home",       "home_arrived", "home_end"};
  std::string line = "trace " + what + ":";
  const std::uint64_t t0 = t[origin];
  for (int i = 0; i < comm_detail::kTraceSlots; ++i) {
    if (t[i] == 0 || t[i] < t0 || t[i] - t0 > 10'000'000) continue;
    char buf[64];
    std::snprintf(buf, sizeof(buf), " %s %.1f", kNames[i], 1e-3 * static_cast<double>(t[i] - t0));
    line += buf;
  }
  std::printf("%s\n", line.c_str());
  comm_detail::reset_trace();
}

void normal_mode(Communicator& comm, std::int64_t T, const SuiteOptions& options,
                 std::vector<Result>& results) {
  const TimingOptions timing = timing_for(options);
  const cudaStream_t stream = comm.stream();
  const MoeConfig c = deepseek(comm.size(), static_cast<int>(T));
  const DispatcherContext ctx{c, Mode::normal, ActivationFormat::fp8_group, comm.rank(), 1};
  const Inputs in = make_inputs(c, T, comm.rank(), 7, stream);
  const double dispatch_bytes =
      static_cast<double>(in.tokens_out) * static_cast<double>(detail::token_payload_bytes(ctx));
  const double combine_bytes = static_cast<double>(in.tokens_in) * static_cast<double>(c.hidden) * 2.0;

  const DispatchInput view = in.view();
  const cuda::DeviceTensor y(DType::bf16, {T, c.hidden});
  const TensorView yv = y.view();
  const int N = comm.size();
  const int work_sms = sms_of(comm_detail::work_blocks(static_cast<std::int64_t>(N) * T));
  // "-no-sync": DispatcherContext::host_sync = false (the layout at its bound; nccl-p2p sends whole
  // regions): what the host's count wait costs against what the bound costs.
  for (const std::string transport : {"nvlink", "nccl-p2p", "nvlink-no-sync", "nccl-p2p-no-sync"}) {
    DispatcherContext transport_ctx = ctx;
    transport_ctx.host_sync = !transport.ends_with("-no-sync");
    std::unique_ptr<Dispatcher> d;
    LowLatencyDispatcher* nv = nullptr;  // "nvlink": its variants are timed too
    try {
      if (transport.starts_with("nvlink")) {
        auto ll = make_nvlink_dispatcher(transport_ctx, comm.shared_from_this());
        if (transport == "nvlink") nv = ll.get();
        d = std::move(ll);
      } else {
        d = make_nccl_p2p_dispatcher(transport_ctx, comm.shared_from_this());
      }
    } catch (const Error& e) {
      std::printf("comm: %s unavailable here: %s\n", transport.c_str(), e.what());
      continue;
    }
    std::vector<DispatchOutput> out(1);
    d->dispatch({&view, 1}, out);
    auto time_dispatch = [&] {
      return timed(
          comm,
          [&](int, cudaStream_t) {
            d->dispatch({&view, 1}, out);
          },
          timing);
    };
    if (nv != nullptr) {
      // The send kernel's SMs: the default first, then a sweep (every rank sets the same).
      const char* before = std::getenv("EPMOE_COMM_SEND_SMS");
      const std::string keep = before != nullptr ? before : "";
      for (const int sms : {0, 16, 32, 48, 64, 96}) {
        if (sms > 0) setenv("EPMOE_COMM_SEND_SMS", std::to_string(sms).c_str(), 1);
        comm_detail::reset_trace();
        const double us = time_dispatch();
        print_trace("nvlink normal dispatch sms " + std::to_string(comm_detail::send_blocks(T)));
        emit(options, results,
             make_result("comm.dispatch",
                         params(transport, "normal", "dispatch", T, comm, sms_of(comm_detail::send_blocks(T)),
                                std::max(work_sms, sms_of(comm_detail::send_blocks(T)))),
                         us, dispatch_bytes, 0.0, kNvlinkGBps));
        if (keep.empty())
          unsetenv("EPMOE_COMM_SEND_SMS");
        else
          setenv("EPMOE_COMM_SEND_SMS", keep.c_str(), 1);
      }
      for (const SendVariant& v : send_variants()) {
        comm_detail::reset_trace();
        int sms = 0;
        const double us = with_env(v.env, [&] {
          sms = sms_of(comm_detail::send_blocks(T));
          return time_dispatch();
        });
        print_trace(std::string("nvlink normal dispatch ") + v.label);
        emit(options, results,
             make_result("comm.dispatch",
                         params(std::string("nvlink-") + v.label, "normal", "dispatch", T, comm, sms,
                                std::max(work_sms, sms)),
                         us, dispatch_bytes, 0.0, kNvlinkGBps));
      }
      {
        setenv("EPMOE_COMM_CHUNKS", "0", 1);  // place waits for each source's last token
        comm_detail::reset_trace();
        const double us = time_dispatch();
        print_trace("nvlink normal dispatch, no arrival counters");
        unsetenv("EPMOE_COMM_CHUNKS");
        emit(options, results,
             make_result("comm.dispatch",
                         params("nvlink-nochunks", "normal", "dispatch", T, comm,
                                sms_of(comm_detail::send_blocks(T)), work_sms),
                         us, dispatch_bytes, 0.0, kNvlinkGBps));
      }
      const double us_halves = timed(
          comm,
          [&](int, cudaStream_t) {
            nv->dispatch_send(view);
            nv->dispatch_recv(out[0]);
          },
          timing);
      print_trace("nvlink normal dispatch halves");
      emit(options, results,
           make_result("comm.dispatch",
                       params("nvlink-halves", "normal", "dispatch", T, comm,
                              sms_of(comm_detail::send_blocks(T)), work_sms),
                       us_halves, dispatch_bytes, 0.0, kNvlinkGBps));
    } else {
      emit(options, results,
           make_result("comm.dispatch", params(transport, "normal", "dispatch", T, comm, work_sms, work_sms),
                       time_dispatch(), dispatch_bytes, 0.0, kNvlinkGBps));
    }
    const cuda::DeviceTensor expert_out(DType::bf16,
                                        {std::max<std::int64_t>(out[0].num_output_rows(), 1), c.hidden});
    fill_random_bf16(expert_out.view(), 11, stream);
    const TensorView eo = expert_out.view().slice_rows(0, out[0].num_output_rows());
    const double us_combine = timed(
        comm,
        [&](int, cudaStream_t) {
          d->combine({&eo, 1}, {&yv, 1});
        },
        timing);
    // The reduce / home stamps of the last combine, against its reduce's start.
    if (nv != nullptr) print_trace("nvlink normal combine", comm_detail::kTraceReduceStart);
    emit(options, results,
         make_result("comm.combine", params(transport, "normal", "combine", T, comm, work_sms, work_sms),
                     us_combine, combine_bytes, 0.0, kNvlinkGBps));
    if (nv != nullptr) {
      // The split combine in normal mode (every SM busy already: expected the same or a little
      // slower; measured so that a default in both modes is an informed choice).
      for (const int split : {2, 7}) {
        const double us_s = with_env({{"EPMOE_COMM_COMBINE_SPLIT", std::to_string(split)}}, [&] {
          return timed(
              comm,
              [&](int, cudaStream_t) {
                d->combine({&eo, 1}, {&yv, 1});
              },
              timing);
        });
        print_trace("nvlink normal combine split " + std::to_string(split), comm_detail::kTraceReduceStart);
        emit(options, results,
             make_result("comm.combine",
                         params("nvlink-split" + std::to_string(split), "normal", "combine", T, comm,
                                work_sms, work_sms),
                         us_s, combine_bytes, 0.0, kNvlinkGBps));
      }
    }
    comm.synchronize(CommPhase::none, "the benchmark");
  }

  // ncclAlltoAll moving the same bytes to each peer (its own share is a local copy).
  for (const auto& [phase, bytes] : {std::pair<std::string, double>{"dispatch", dispatch_bytes},
                                     std::pair<std::string, double>{"combine", combine_bytes}}) {
    const auto per_peer = static_cast<std::size_t>(bytes / std::max(1, N - 1));
    if (per_peer == 0) continue;
    const cuda::DeviceBuffer send(per_peer * static_cast<std::size_t>(N)),
        recv(per_peer * static_cast<std::size_t>(N));
    send.fill_bytes(0x5a, stream);
    const double us = timed(
        comm,
        [&](int, cudaStream_t s) {
          EPMOE_NCCL_COMM_CHECK(comm,
                                ncclAlltoAll(send.data(), recv.data(), per_peer, ncclUint8, comm.nccl(), s));
        },
        timing);
    emit(options, results,
         make_result("comm.alltoall", params("nccl-alltoall", "normal", phase, T, comm), us,
                     static_cast<double>(per_peer) * (N - 1), 0.0, kNvlinkGBps));
  }
}

void low_latency(Communicator& comm, std::int64_t T, const SuiteOptions& options,
                 std::vector<Result>& results) {
  const TimingOptions timing = timing_for(options);
  const cudaStream_t stream = comm.stream();
  const MoeConfig c = deepseek(comm.size(), static_cast<int>(T));
  const DispatcherContext ctx{c, Mode::low_latency, ActivationFormat::fp8_group, comm.rank(), 1};
  const Inputs in = make_inputs(c, T, comm.rank(), 100 + static_cast<std::uint64_t>(T), stream);
  const double dispatch_bytes =
      static_cast<double>(in.tokens_out) * static_cast<double>(detail::token_payload_bytes(ctx));
  const double combine_bytes = static_cast<double>(in.tokens_in) * static_cast<double>(c.hidden) * 2.0;
  const std::int64_t rows = static_cast<std::int64_t>(c.num_local_experts()) * c.masked_max_m();
  const cuda::DeviceTensor expert_out(DType::bf16, {rows, c.hidden});
  fill_random_bf16(expert_out.view(), 12, stream);
  const cuda::DeviceTensor y(DType::bf16, {T, c.hidden});
  const DispatchInput view = in.view();
  const TensorView eo = expert_out.view(), yv = y.view();

  for (const std::string transport : {"nvlink-ll", "nccl-p2p"}) {
    std::vector<DispatchOutput> out(1);
    if (transport == "nvlink-ll") {
      std::unique_ptr<LowLatencyDispatcher> d;
      try {
        d = make_nvlink_ll_dispatcher(ctx, comm.shared_from_this());
      } catch (const Error& e) {
        std::printf("comm: nvlink-ll unavailable here: %s\n", e.what());
        continue;
      }
      d->dispatch({&view, 1}, out);
      d->combine({&eo, 1}, {&yv, 1});
      const cuda::Graph g_dispatch = cuda::Graph::capture(stream, [&] { d->dispatch({&view, 1}, out); });
      const cuda::Graph g_combine = cuda::Graph::capture(stream, [&] { d->combine({&eo, 1}, {&yv, 1}); });
      {
        // The floor under every graph-replayed row: a graph of one (nearly) empty kernel, timed the
        // same way ("comm.graph_floor", at every T: it should not move): graph launch, event pair and
        // the kernel boundary, which the dispatch's ~8 us after its last stamp includes (bench/NOTES.md,
        // LL v7).
        const cuda::Graph g_floor = cuda::Graph::capture(stream, [&] { gpu_sleep(stream, 0.001); });
        const double us_floor = timed(comm, replay(g_floor), timing);
        emit(options, results,
             make_result("comm.graph_floor", params(transport, "low_latency", "graph_floor", T, comm, 1, 1),
                         us_floor, 0.0, 0.0, kNvlinkGBps));
      }
      comm_detail::reset_trace();
      const double us_d = timed(comm, replay(g_dispatch), timing);
      print_trace("nvlink-ll dispatch T " + std::to_string(T));
      emit(options, results,
           make_result(
               "comm.dispatch",
               params(transport, "low_latency", "dispatch", T, comm, sms_of(comm_detail::send_blocks(T)),
                      sms_of(comm_detail::work_blocks(static_cast<std::int64_t>(comm.size()) * T))),
               us_d, dispatch_bytes, 0.0, kNvlinkGBps));
      {
        // Without early counts (EPMOE_COMM_LL_EARLY_COUNTS=0, read at capture; the default has
        // them), the same graph-replayed call: "nvlink-ll-no-early".
        const cuda::Graph g_e = with_env({{"EPMOE_COMM_LL_EARLY_COUNTS", "0"}}, [&] {
          return cuda::Graph::capture(stream, [&] { d->dispatch({&view, 1}, out); });
        });
        comm_detail::reset_trace();
        const double us_e = timed(comm, replay(g_e), timing);
        print_trace("nvlink-ll dispatch without early counts, T " + std::to_string(T));
        emit(options, results,
             make_result("comm.dispatch",
                         params("nvlink-ll-no-early", "low_latency", "dispatch", T, comm,
                                sms_of(comm_detail::send_blocks(T)),
                                sms_of(comm_detail::work_blocks(static_cast<std::int64_t>(comm.size()) * T))),
                         us_e, dispatch_bytes, 0.0, kNvlinkGBps));
      }
      // The low-latency dispatch's own switches (read at capture), the same graph-replayed call:
      // "nvlink-ll-route-kernel" routes in a kernel before the dispatch launch
      // (EPMOE_COMM_LL_ROUTE_IN_LAUNCH=0); "-chunk8" / "-chunk64": tokens per arrival counter
      // (EPMOE_COMM_LL_ARRIVAL_CHUNK; default 1); "-v6": both as before (LL v6's dispatch).
      for (const SendVariant& v : low_latency_dispatch_variants()) {
        const cuda::Graph g_v = with_env(v.env, [&] {
          return cuda::Graph::capture(stream, [&] { d->dispatch({&view, 1}, out); });
        });
        comm_detail::reset_trace();
        const double us_v = timed(comm, replay(g_v), timing);
        print_trace(std::string("nvlink-ll dispatch ") + v.label + ", T " + std::to_string(T));
        emit(options, results,
             make_result("comm.dispatch",
                         params(std::string("nvlink-ll-") + v.label, "low_latency", "dispatch", T, comm,
                                sms_of(comm_detail::send_blocks(T)),
                                sms_of(comm_detail::work_blocks(static_cast<std::int64_t>(comm.size()) * T))),
                         us_v, dispatch_bytes, 0.0, kNvlinkGBps));
      }
      if (T == 128) {
        // The send-path variants in the same graph-replayed call (the last one's SMs differ).
        for (const SendVariant& v : send_variants()) {
          if (std::string_view(v.label).starts_with("ce")) continue;
          const cuda::Graph g_v = with_env(v.env, [&] {
            return cuda::Graph::capture(stream, [&] { d->dispatch({&view, 1}, out); });
          });
          const double us_v = timed(comm, replay(g_v), timing);
          print_trace(std::string("nvlink-ll dispatch ") + v.label + ", T " + std::to_string(T));
          emit(options, results,
               make_result(
                   "comm.dispatch",
                   params(std::string("nvlink-ll-") + v.label, "low_latency", "dispatch", T, comm,
                          sms_of(comm_detail::send_blocks(T)),
                          sms_of(comm_detail::work_blocks(static_cast<std::int64_t>(comm.size()) * T))),
                   us_v, dispatch_bytes, 0.0, kNvlinkGBps));
        }
      }
      const double us_c = timed(comm, replay(g_combine), timing);
      print_trace("nvlink-ll combine T " + std::to_string(T), comm_detail::kTraceReduceStart);
      // The reduce grid has the low-latency default's warps per token (or EPMOE_COMM_COMBINE_SPLIT's).
      comm_detail::EpGeometry geometry;
      geometry.N = comm.size();
      geometry.T_max = static_cast<int>(T);
      const int default_split = comm_detail::combine_split(comm_detail::low_latency_combine_split(geometry));
      const int sms_combine =
          sms_of(comm_detail::work_blocks(static_cast<std::int64_t>(comm.size()) * T * default_split));
      emit(options, results,
           make_result("comm.combine",
                       params(transport, "low_latency", "combine", T, comm, sms_combine, sms_combine), us_c,
                       combine_bytes, 0.0, kNvlinkGBps));
      // The combine with S warps per token (EPMOE_COMM_COMBINE_SPLIT, read at capture), the same
      // graph-replayed call: "nvlink-ll-split<S>", sms = the reduce grid's SMs.
      for (const int split : combine_splits()) {
        const cuda::Graph g_s = with_env({{"EPMOE_COMM_COMBINE_SPLIT", std::to_string(split)}}, [&] {
          return cuda::Graph::capture(stream, [&] { d->combine({&eo, 1}, {&yv, 1}); });
        });
        const double us_s = timed(comm, replay(g_s), timing);
        print_trace("nvlink-ll combine split " + std::to_string(split) + ", T " + std::to_string(T),
                    comm_detail::kTraceReduceStart);
        const int sms_reduce =
            sms_of(comm_detail::work_blocks(static_cast<std::int64_t>(comm.size()) * T * split));
        emit(options, results,
             make_result("comm.combine",
                         params("nvlink-ll-split" + std::to_string(split), "low_latency", "combine", T, comm,
                                sms_reduce, sms_reduce),
                         us_s, combine_bytes, 0.0, kNvlinkGBps));
      }
      // The send halves are not timed alone: the transport checks that halves alternate (a
      // graph of one half replayed on its own is refused), so they need events inside a full cycle.
      // Bring every rank back to a completed call before the dispatcher goes.
      d->dispatch({&view, 1}, out);
      d->combine({&eo, 1}, {&yv, 1});
      comm.synchronize(CommPhase::none, "the last low-latency call");
    } else {
      // Graph-replayed like nvlink-ll (no host sync in low-latency mode): "nccl-p2p"; the same calls
      // eager: "nccl-p2p-eager" (before 2026-12-05, "nccl-p2p" was the eager call through a host sync).
      auto d = make_nccl_p2p_dispatcher(ctx, comm.shared_from_this());
      d->dispatch({&view, 1}, out);
      d->combine({&eo, 1}, {&yv, 1});
      const cuda::Graph g_dispatch = cuda::Graph::capture(stream, [&] { d->dispatch({&view, 1}, out); });
      const cuda::Graph g_combine = cuda::Graph::capture(stream, [&] { d->combine({&eo, 1}, {&yv, 1}); });
      const int sms_work = sms_of(comm_detail::work_blocks(static_cast<std::int64_t>(comm.size()) * T));
      const int sms_pack = sms_of(comm_detail::work_blocks(T));
      for (const bool graph : {true, false}) {
        const std::string label = graph ? transport : transport + "-eager";
        const double us_d = graph ? timed(comm, replay(g_dispatch), timing)
                                  : timed(
                                        comm,
                                        [&](int, cudaStream_t) {
                                          d->dispatch({&view, 1}, out);
                                        },
                                        timing);
        emit(options, results,
             make_result("comm.dispatch",
                         params(label, "low_latency", "dispatch", T, comm, sms_pack, sms_work), us_d,
                         dispatch_bytes, 0.0, kNvlinkGBps));
        const double us_c = graph ? timed(comm, replay(g_combine), timing)
                                  : timed(
                                        comm,
                                        [&](int, cudaStream_t) {
                                          d->combine({&eo, 1}, {&yv, 1});
                                        },
                                        timing);
        emit(options, results,
             make_result("comm.combine", params(label, "low_latency", "combine", T, comm, sms_work, sms_work),
                         us_c, combine_bytes, 0.0, kNvlinkGBps));
      }
      // Every rank back to a completed call (dispatch, then combine) before the dispatcher goes.
      d->dispatch({&view, 1}, out);
      d->combine({&eo, 1}, {&yv, 1});
      comm.synchronize(CommPhase::none, "the last low-latency call");
    }
    comm.synchronize(CommPhase::none, "the benchmark");
  }
}

// One copy-engine copy of a v5 piece's size (15 MiB) from local memory into the peer's symmetric
// window (cudaMemcpyAsync to the window's LSA pointer: what dispatch_by_copy_engines* enqueue; a
// cudaMemcpyPeerAsync needs the peer's pointer in this process, which only the window gives), alone
// and beside a kernel that streams the dispatch's place traffic (bench::stream_fanout: reads 60 MB,
// writes 4 x 60 MB, 3 passes, on 2 blocks per SM less the 24 send blocks), on every rank, so that
// both the sender's and the receiver's HBM are busy as in a dispatch. Directions: rank 0 -> 1 (the
// others idle or only streaming), 1 -> 0, and every rank -> the next at once ("both"). Per rank and
// configuration: the median of `kIters` barrier-separated runs of the copy's own events (rows
// "comm.peer_copy", GB/s of the copy, floor at 396 GB/s) and of the streaming kernel
// ("comm.place_traffic", GB/s of HBM read + written), with "copy_end_after_kernel_us" (median: < 0
// when the copy ended inside the kernel, i.e. it ran beside it throughout).
void peer_copies(Communicator& comm, const SuiteOptions& options, std::vector<Result>& results) {
  constexpr std::size_t kCopyBytes = std::size_t{15} << 20;
  constexpr std::size_t kTrafficRead = std::size_t{60} << 20;
  constexpr int kFanout = 4, kPasses = 3;
  const int kIters = options.quick ? 8 : 25, kWarmup = 3;
  const int N = comm.size(), me = comm.rank();
  const cudaStream_t main_stream = comm.stream();
  const cuda::Stream copy_stream;
  auto window = comm.alloc_symmetric(kCopyBytes);  // collective
  const cuda::DeviceBuffer src(kCopyBytes), t_src(kTrafficRead), t_dst(kTrafficRead * kFanout);
  src.fill_bytes(0x3c, main_stream);
  t_src.fill_bytes(0x5a, main_stream);
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(main_stream));
  const int blocks = std::max(1, 2 * device_sms() - 24);
  const cuda::Event k0, k1, c0, c1;
  struct Direction {
    const char* label;
    int from;  // the one sending rank, or -1: every rank to the next
  };
  for (const Direction dir : {Direction{"0to1", 0}, Direction{"1to0", 1}, Direction{"both", -1}}) {
    const bool sends = dir.from < 0 || dir.from == me;
    const int to = dir.from < 0 ? (me + 1) % N : (dir.from + 1) % N;
    char* dst = static_cast<char*>(window->peer_pointer(to));
    for (const bool beside : {false, true}) {
      std::vector<double> copy_us, kernel_us, after_us;
      for (int i = 0; i < kWarmup + kIters; ++i) {
        comm.barrier();
        if (beside) {
          k0.record(main_stream);
          stream_fanout(t_src.data(), t_dst.data(), kTrafficRead, kFanout, blocks, kPasses, main_stream);
          k1.record(main_stream);
        }
        if (sends) {
          if (beside) EPMOE_CUDA_CHECK(cudaStreamWaitEvent(copy_stream, k0, 0));
          c0.record(copy_stream);
          EPMOE_CUDA_CHECK(
              cudaMemcpyAsync(dst, src.data(), kCopyBytes, cudaMemcpyDeviceToDevice, copy_stream));
          c1.record(copy_stream);
        }
        EPMOE_CUDA_CHECK(cudaStreamSynchronize(copy_stream));
        EPMOE_CUDA_CHECK(cudaStreamSynchronize(main_stream));
        if (i < kWarmup) continue;
        if (sends) copy_us.push_back(1e3 * cuda::Event::elapsed_ms(c0, c1));
        if (beside) kernel_us.push_back(1e3 * cuda::Event::elapsed_ms(k0, k1));
        if (sends && beside)
          after_us.push_back(1e3 * (cuda::Event::elapsed_ms(k0, c1) - cuda::Event::elapsed_ms(k0, k1)));
      }
      auto median = [](std::vector<double> v) {
        if (v.empty()) return 0.0;
        std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
        return v[v.size() / 2];
      };
      const std::string load = beside ? "beside-place" : "alone";
      if (sends) {
        Params p = params("copy-engine", load, dir.label, 0, comm);
        p["bytes"] = static_cast<std::int64_t>(kCopyBytes);
        p["to"] = static_cast<std::int64_t>(to);
        if (beside) {
          p["kernel_us"] = median(kernel_us);
          p["copy_end_after_kernel_us"] = median(after_us);
        }
        emit(options, results,
             make_result("comm.peer_copy", std::move(p), median(copy_us), static_cast<double>(kCopyBytes),
                         0.0, kNvlinkGBps));
      }
      if (beside) {
        Params p = params("stream-fanout", sends ? "beside-copy" : "beside-peer-copy", dir.label, 0, comm,
                          std::min(blocks, device_sms()), std::min(blocks, device_sms()));
        p["passes"] = static_cast<std::int64_t>(kPasses);
        emit(options, results,
             make_result("comm.place_traffic", std::move(p), median(kernel_us),
                         static_cast<double>(kTrafficRead) * (1 + kFanout) * kPasses));
      }
    }
  }
  // The streaming kernel alone (no copy anywhere), as the reference for its rows beside a copy.
  {
    std::vector<double> kernel_us;
    for (int i = 0; i < kWarmup + kIters; ++i) {
      comm.barrier();
      k0.record(main_stream);
      stream_fanout(t_src.data(), t_dst.data(), kTrafficRead, kFanout, blocks, kPasses, main_stream);
      k1.record(main_stream);
      EPMOE_CUDA_CHECK(cudaStreamSynchronize(main_stream));
      if (i >= kWarmup) kernel_us.push_back(1e3 * cuda::Event::elapsed_ms(k0, k1));
    }
    std::nth_element(kernel_us.begin(), kernel_us.begin() + static_cast<std::ptrdiff_t>(kernel_us.size() / 2),
                     kernel_us.end());
    Params p = params("stream-fanout", "alone", "none", 0, comm, std::min(blocks, device_sms()),
                      std::min(blocks, device_sms()));
    p["passes"] = static_cast<std::int64_t>(kPasses);
    emit(options, results,
         make_result("comm.place_traffic", std::move(p), kernel_us[kernel_us.size() / 2],
                     static_cast<double>(kTrafficRead) * (1 + kFanout) * kPasses));
  }
  comm.barrier();  // every rank is done with the window before it goes (collective)
}

// "comm.sm_link": what the SMs themselves move over NVLink, by SM count: a 30 MiB stream through
// bench::stream_fanout (8 vectors of 16 bytes per lane loaded before any is stored) either pushed
// (local source, stores into the peer's window: the dispatch's send today) or pulled (loads from
// the peer's window, stores into local memory: a receiver that reads the tokens itself), one way
// (rank 0 moves, the others wait) or both ways at once (every rank with its next rank: the
// dispatch's traffic). GB/s of the bytes one rank moves; floor at the P2P copy's 396 GB/s.
void sm_link(Communicator& comm, const SuiteOptions& options, std::vector<Result>& results) {
  constexpr std::size_t kBytes = std::size_t{30} << 20;
  const int kIters = options.quick ? 8 : 20, kWarmup = 3;
  const int N = comm.size(), me = comm.rank();
  const cudaStream_t stream = comm.stream();
  auto window = comm.alloc_symmetric(kBytes);  // collective
  const cuda::DeviceBuffer local(kBytes);
  local.fill_bytes(0x3c, stream);
  EPMOE_CUDA_CHECK(cudaMemsetAsync(window->local(), 0x5a, kBytes, stream));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  comm.barrier();
  const cuda::Event e0, e1;
  const int sms = device_sms();
  for (const bool pull : {false, true}) {
    for (const bool both : {false, true}) {
      const bool moves = both || me == 0;
      const int peer = (me + 1) % N;
      for (const int blocks : {8, 16, 24, 32, 48, 66, 132, 264}) {
        if (blocks > 2 * sms) continue;
        std::vector<double> us;
        for (int i = 0; i < kWarmup + kIters; ++i) {
          comm.barrier();
          if (!moves) continue;
          e0.record(stream);
          if (pull)
            stream_fanout(window->peer_pointer(peer), local.data(), kBytes, 1, blocks, 1, stream);
          else
            stream_fanout(local.data(), window->peer_pointer(peer), kBytes, 1, blocks, 1, stream);
          e1.record(stream);
          EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
          if (i >= kWarmup) us.push_back(1e3 * cuda::Event::elapsed_ms(e0, e1));
        }
        if (!moves) continue;
        std::nth_element(us.begin(), us.begin() + static_cast<std::ptrdiff_t>(us.size() / 2), us.end());
        const int used = std::min(blocks, sms);
        Params p = params(pull ? "sm-pull" : "sm-push", both ? "both-ways" : "one-way",
                          both ? "both" : "0to1", 0, comm, used, used);
        p["blocks"] = static_cast<std::int64_t>(blocks);
        p["bytes"] = static_cast<std::int64_t>(kBytes);
        emit(options, results,
             make_result("comm.sm_link", std::move(p), us[us.size() / 2], static_cast<double>(kBytes), 0.0,
                         kNvlinkGBps));
      }
    }
  }
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  comm.barrier();  // every rank is done with the window before it goes (collective)
}

std::vector<Result> run_comm_suite(const SuiteOptions& options) {
  std::vector<Result> results;
  std::shared_ptr<Communicator> comm = Communicator::process_default();
  if (!comm) {
    const LaunchEnvironment env = LaunchEnvironment::from_env();
    if (!env.present || env.world_size < 2) {
      std::printf(
          "comm: skipped: needs 2+ ranks, one process per GPU: epmoe launch -n 2 -- epmoe bench comm\n");
      return results;
    }
    if (const std::string missing = env.missing_gpus(cuda::device_count()); !missing.empty()) {
      std::printf("comm: skipped: %s\n", missing.c_str());
      return results;
    }
    comm = Communicator::from_environment();
  }
  if (comm->size() < 2) {
    std::printf("comm: skipped: the communicator has 1 rank; run under epmoe launch -n 2\n");
    return results;
  }
  std::printf("comm: rank %d of %d, NCCL %s (%s)\n", comm->rank(), comm->size(),
              loaded_nccl_version().str().c_str(), loaded_nccl_library_path().c_str());
  // EPMOE_BENCH_COMM_ONLY=copy|ll|normal: only that part (the rows of one question in one short
  // device call); unset: everything.
  const char* only_env = std::getenv("EPMOE_BENCH_COMM_ONLY");
  const std::string only = only_env != nullptr ? only_env : "";
  if (only.empty() || only == "normal") normal_mode(*comm, options.quick ? 1024 : 4096, options, results);
  std::vector<std::int64_t> ll = options.tokens;
  if (ll.empty())
    ll = options.quick ? std::vector<std::int64_t>{1, 128} : std::vector<std::int64_t>{1, 32, 64, 128, 256};
  if (only.empty() || only == "ll")
    for (const std::int64_t T : ll) low_latency(*comm, T, options, results);
  // Last: the dispatchers' rows come first should the copy into the peer's window fail.
  if (only.empty() || only == "copy") peer_copies(*comm, options, results);
  if (only.empty() || only == "copy" || only == "link") sm_link(*comm, options, results);
  comm->barrier();
  return results;
}

const SuiteRegistration kComm{
    "comm",
    "EP dispatch/combine across ranks (needs epmoe launch -n 2): normal 4096 tokens vs "
    "ncclAlltoAll, low-latency 1..256 tokens graph-replayed",
    80, run_comm_suite};

}  // namespace
}  // namespace epmoe::bench
