// The GPU dispatchers against the CPU simulation, on every rank of the world communicator.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

#include <nccl.h>

#include "epmoe/comm_dispatch.hpp"
#include "ranks_util.hpp"
#include "scoped_env.hpp"
#include "test_random.hpp"

namespace epmoe::ranks {
namespace {

// A peer that never dispatches: the receive times out naming the phase and the rank it waited
// for, and the communicator stays usable once the device errors are reset (which synchronizes).
void expect_recoverable_dispatch_timeout(const std::string& m) {
  EXPECT_NE(m.find("timed out after"), std::string::npos) << m;
  EXPECT_NE(m.find("dispatch-recv"), std::string::npos) << m;
  EXPECT_NE(m.find("waiting for rank"), std::string::npos) << m;
  EXPECT_FALSE(world().broken()) << "a device-side timeout leaves the communicator usable";
  world().reset_device_errors();
}

// nvlink_normal_ce: the "nvlink" transport with EPMOE_COMM_SEND_CE=2 (the copy-engine send packed
// inside the dispatch launch) for the whole test; nvlink_normal_ce_launches: with EPMOE_COMM_SEND_CE=1
// (v4: separate pack launches, a piece each, before the copies). "nvlink-ll" runs its defaults (early counts,
// the combine split by size: at the tiny dims a partial is one 512-byte unit, so all slices but one are
// empty; at DeepSeek-V3's 4 units each); nvlink_ll_one_warp: with EPMOE_COMM_COMBINE_SPLIT=1 (one
// warp per token, the combine before the split); nvlink_ll_fenced_counts: with
// EPMOE_COMM_LL_EARLY_COUNTS=0 (the count header behind a fence and a flag, before early counts);
// nvlink_normal_early: "nvlink" with EPMOE_COMM_LL_EARLY_COUNTS=1 (tagged counts without the fence,
// the own first token loaded before the layout; off by default in normal mode, and with it the
// routing inside the dispatch launch); nvlink_ll_route_kernel: "nvlink-ll" with
// EPMOE_COMM_LL_ROUTE_IN_LAUNCH=0 (early counts after a route kernel, before the launch routed
// the tokens itself).
enum class Transport {
  p2p_normal,
  p2p_low_latency,
  p2p_normal_no_sync,  // nccl-p2p with DispatcherContext::host_sync = false: whole regions, the bound
  nvlink_ll,
  nvlink_normal,
  nvlink_normal_ce,
  nvlink_normal_ce_launches,
  nvlink_ll_one_warp,
  nvlink_ll_fenced_counts,
  nvlink_normal_early,
  nvlink_ll_route_kernel,
  nvlink_normal_no_sync  // DispatcherContext::host_sync = false: the layout at its bound
};

// Every rank runs the same tests in the same order, so every rank sets the same switch values (the
// send-path switches are read at each dispatch_send).
using testing::ScopedEnv;

std::string name_of(Transport t) {
  switch (t) {
    case Transport::p2p_normal:
      return "nccl-p2p normal";
    case Transport::p2p_low_latency:
      return "nccl-p2p low-latency";
    case Transport::p2p_normal_no_sync:
      return "nccl-p2p normal, no host sync";
    case Transport::nvlink_ll:
      return "nvlink-ll";
    case Transport::nvlink_normal:
      return "nvlink normal";
    case Transport::nvlink_normal_ce:
      return "nvlink normal, copy engines";
    case Transport::nvlink_normal_ce_launches:
      return "nvlink normal, copy engines after pack launches";
    case Transport::nvlink_ll_one_warp:
      return "nvlink-ll, combine split 7";
    case Transport::nvlink_ll_fenced_counts:
      return "nvlink-ll, early counts";
    case Transport::nvlink_normal_early:
      return "nvlink normal, early counts";
    case Transport::nvlink_ll_route_kernel:
      return "nvlink-ll, route kernel";
    case Transport::nvlink_normal_no_sync:
      return "nvlink normal, no host sync";
  }
  return "?";
}
Mode mode_of(Transport t) {
  return t == Transport::p2p_normal || t == Transport::p2p_normal_no_sync || t == Transport::nvlink_normal ||
                 t == Transport::nvlink_normal_ce || t == Transport::nvlink_normal_ce_launches ||
                 t == Transport::nvlink_normal_early || t == Transport::nvlink_normal_no_sync
             ? Mode::normal
             : Mode::low_latency;
}

cudaStream_t stream() {
  return world().stream();
}

// tiny (or DeepSeek-V3) dims over the world's ranks; with 2+ ranks, redundant slots too.
MoeConfig test_config(int max_tokens, bool deepseek = false) {
  MoeConfig c = MoeConfig::preset(deepseek ? "deepseek-v3" : "tiny");
  const int N = world().size();
  c.num_ranks = N;
  c.num_redundant_experts = (N - c.num_experts % N) % N + (N > 1 && !deepseek ? N : 0);
  c.max_tokens_per_rank = max_tokens;
  return c;
}

std::unique_ptr<LowLatencyDispatcher> make(Transport t, const MoeConfig& c, ActivationFormat f) {
  const bool host_sync = t != Transport::nvlink_normal_no_sync && t != Transport::p2p_normal_no_sync;
  const DispatcherContext ctx{c, mode_of(t), f, world().rank(), 1, host_sync};
  if (t == Transport::nvlink_ll || t == Transport::nvlink_ll_one_warp ||
      t == Transport::nvlink_ll_fenced_counts || t == Transport::nvlink_ll_route_kernel)
    return make_nvlink_ll_dispatcher(ctx, world_ptr());
  if (t == Transport::nvlink_normal || t == Transport::nvlink_normal_ce ||
      t == Transport::nvlink_normal_ce_launches || t == Transport::nvlink_normal_early ||
      t == Transport::nvlink_normal_no_sync)
    return make_nvlink_dispatcher(ctx, world_ptr());
  return make_nccl_p2p_dispatcher(ctx, world_ptr());
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// The ranks meet around every allocation, memset and free between their calls. With loopback ranks
// (one GPU, one context) a rank inside cudaFree, cudaMalloc or cudaMemset (CUDA's implicit
// synchronization: they wait for the whole device) while a peer's dispatch or combine kernel already
// waits for this rank deadlocks until the peer's timeout (call 152: round 4 of
// RepeatedCallsReuseTheBuffers, one rank freeing round 3's buffers while the other's next dispatch
// waited for it; bench/NOTES.md, session 22). So a call's device buffers are allocated and poisoned,
// then the ranks meet, then the call; and its buffers are freed before they meet again. (The layer
// tests meet the same way, layer_ranks.cpp.)
void meet() {
  world().barrier();
}
// The same where only loopback ranks need it: between calls that every rank makes with no meet of their
// own, after a rank's device allocations or copies. Processes on GPUs of their own are left to drift
// apart between calls, as an engine's ranks do. (Under compute-sanitizer even a copy to the host waits
// for the whole device: session 63's deadlocks until the timeout.)
void meet_on_loopback() {
  if (world().loopback()) meet();
}

// The error text of one dispatch of `in` on `d`, waited for (a device-side refusal or timeout
// surfaces at the synchronize); "" when it succeeds. (No meet after it: some callers dispatch on one rank
// only, and a refusal leaves the communicator unusable for a barrier.) `every_rank`: every rank makes this
// call, so loopback ranks meet between the upload and the dispatch.
std::string dispatch_error(Dispatcher& d, const RankInput& in, bool every_rank = false) {
  const DeviceInput dev = to_device(in, stream());
  if (every_rank) meet_on_loopback();
  const DispatchInput view = dev.view();
  std::vector<DispatchOutput> out(1);
  return error_of([&] {
    d.dispatch({&view, 1}, out);
    world().synchronize(CommPhase::none, "the dispatch");
  });
}

// Bytes of a device view that are not 0xFF: once an error is recorded on a rank, its calls write all
// bits set (NaN in bf16, e4m3 and f32) instead of results.
std::int64_t bytes_not_poisoned(const TensorView& device_view) {
  const HostTensor h = cuda::to_host(device_view, stream());
  const auto* b = static_cast<const unsigned char*>(h.view().data);
  return std::count_if(b, b + h.nbytes(), [](unsigned char x) { return x != 0xFF; });
}

// Elements of a bf16 device view that are not finite. Over a y poisoned with 0xFF before its combine:
// the elements the combine left unwritten (a combine that ran cleanly writes finite sums everywhere).
std::int64_t non_finite_elements(const TensorView& device_view) {
  const HostTensor h = cuda::to_host(device_view, stream());
  return compare_bf16(h, h).non_finite;
}

// Sets every byte of a dispatch's outputs (rows, scales, m_indices / masked_m, row_token, row_weight) on
// the stream: the views point into buffers the dispatcher keeps from call to call, so a later call that
// wrote nothing would still show the last call's data. Poisoned, its rows hold NaN and every row_token
// -1 (no token) unless this call writes them. Before a call on the same dispatcher, with the same
// extents (the same inputs, or the masked layout's fixed ones); enqueued like any other device fill, so
// loopback ranks meet after it (meet()).
void poison_outputs(const DispatchOutput& out) {
  for (const TensorView* v :
       {&out.rows, &out.scales, &out.m_indices, &out.masked_m, &out.row_token, &out.row_weight}) {
    if (v->rank > 0 && v->data != nullptr)
      EPMOE_CUDA_CHECK(cudaMemsetAsync(v->data, 0xFF, v->nbytes(), stream()));
  }
}

// A combine that a peer never joined (`peer`: the rank it must name, or -1 for any): it times out in
// combine-recv naming the rank, y is NaN throughout (no plausible wrong sum is left behind), and the
// communicator stays usable once the device errors are reset.
void expect_recoverable_combine_timeout(const std::string& m, const TensorView& y, int peer) {
  EXPECT_NE(m.find("timed out after"), std::string::npos) << m;
  EXPECT_NE(m.find("combine-recv"), std::string::npos) << m;
  EXPECT_NE(m.find(peer < 0 ? std::string("waiting for rank") : fmt::format("waiting for rank {}", peer)),
            std::string::npos)
      << m;
  EXPECT_EQ(bytes_not_poisoned(y), 0) << "y is not NaN throughout";
  EXPECT_FALSE(world().broken()) << "a device-side timeout leaves the communicator usable";
  world().reset_device_errors();
}

// Rank 0 sent more tokens than the buffers hold: it refuses on the host, and its peers learn it
// from its status instead of timing out.
void expect_rank0_too_many_reported(const std::string& m) {
  if (world().rank() == 0) {
    EXPECT_NE(m.find("more than the buffers hold"), std::string::npos) << m;
  } else {
    EXPECT_NE(m.find("rank 0 refused its input"), std::string::npos) << m;
    EXPECT_NE(m.find("more tokens"), std::string::npos) << m;
  }
}

// What every rank should receive: cpu-sim over every rank's inputs (`want` views the simulator's
// buffers, so it lives as long as `sim`), with the dispatcher's host_sync (normal mode's layout at its
// bound without it).
struct Simulated {
  std::unique_ptr<Dispatcher> sim;
  std::vector<DispatchOutput> want;
};
Simulated simulate(const MoeConfig& c, Mode mode, ActivationFormat f, const std::vector<RankInput>& in,
                   bool host_sync = true) {
  Simulated r{make_dispatcher("cpu-sim", {c, mode, f, 0, c.num_ranks, host_sync}), {}};
  std::vector<DispatchInput> views;
  for (const RankInput& ri : in) views.push_back(ri.view());
  r.want.resize(static_cast<std::size_t>(c.num_ranks));
  r.sim->dispatch(views, r.want);
  return r;
}
// cpu-sim's combine of the stand-in expert outputs (fake_expert_out) of what each rank received:
// every rank's y ([tokens[r], H] bf16).
std::vector<HostTensor> simulate_combine(Simulated& s, const MoeConfig& c,
                                         const std::vector<std::int64_t>& tokens) {
  std::vector<HostTensor> expert_out, ys;
  std::vector<TensorView> expert_out_views, y_views;
  for (int r = 0; r < c.num_ranks; ++r) {
    expert_out.push_back(fake_expert_out(s.want[static_cast<std::size_t>(r)], c));
    ys.emplace_back(DType::bf16,
                    std::initializer_list<std::int64_t>{tokens[static_cast<std::size_t>(r)], c.hidden});
  }
  for (int r = 0; r < c.num_ranks; ++r) {
    expert_out_views.push_back(expert_out[static_cast<std::size_t>(r)]);
    y_views.push_back(ys[static_cast<std::size_t>(r)]);
  }
  s.sim->combine(expert_out_views, y_views);
  return ys;
}

// One dispatch + combine on `d`, checked against cpu-sim run over every rank's inputs.
// This rank's input through the dispatcher's halves (dispatch_send, then `between` enqueued on the
// stream, then dispatch_recv) against cpu-sim's output for this rank.
void check_halves(LowLatencyDispatcher& d, const MoeConfig& c, ActivationFormat f,
                  const std::vector<RankInput>& in, const std::string& what,
                  const std::function<void()>& between = {}) {
  const int me = world().rank();
  const Simulated simulated = simulate(c, d.context().mode, f, in, d.context().host_sync);
  {
    const DeviceInput dev = to_device(in[static_cast<std::size_t>(me)], stream());
    meet();
    d.dispatch_send(dev.view());
    if (between) between();
    DispatchOutput out;
    d.dispatch_recv(out);
    const HostOutput host = download(out, stream());
    expect_same_dispatch(host.view, simulated.want[static_cast<std::size_t>(me)], what);
  }
  meet();
}

void check_round(Dispatcher& d, const MoeConfig& c, ActivationFormat f, const std::vector<RankInput>& in,
                 const std::string& what) {
  SCOPED_TRACE(what);
  const int me = world().rank();
  const Mode mode = d.context().mode;
  Simulated simulated = simulate(c, mode, f, in, d.context().host_sync);
  const std::vector<DispatchOutput>& want = simulated.want;

  const std::int64_t T = in[static_cast<std::size_t>(me)].x.size(0);
  std::vector<std::int64_t> tokens;
  for (const RankInput& r : in) tokens.push_back(r.x.size(0));
  const std::vector<HostTensor> ys = simulate_combine(simulated, c, tokens);
  HostTensor y;
  {
    const DeviceInput dev = to_device(in[static_cast<std::size_t>(me)], stream());
    const DispatchInput dev_view = dev.view();
    const cuda::DeviceTensor y_dev(DType::bf16, {T, c.hidden});
    y_dev.fill_bytes(0xff, stream());  // poison: every element must be written
    meet();
    std::vector<DispatchOutput> got(1);
    d.dispatch({&dev_view, 1}, got);
    const HostOutput host = download(got[0], stream());
    expect_same_dispatch(host.view, want[static_cast<std::size_t>(me)], what);
    // Every transport's statistics (the NVLink ones read from the device when asked): each token at
    // most once per other rank, its bytes, the rows this rank received.
    EXPECT_EQ(d.last_stats().tokens_sent.at(0),
              simulated.sim->last_stats().tokens_sent.at(static_cast<std::size_t>(me)));
    EXPECT_EQ(d.last_stats().bytes_sent.at(0),
              simulated.sim->last_stats().bytes_sent.at(static_cast<std::size_t>(me)));
    EXPECT_EQ(d.last_stats().rows_received.at(0),
              simulated.sim->last_stats().rows_received.at(static_cast<std::size_t>(me)));

    // Combine: the same stand-in expert outputs on both sides.
    const cuda::DeviceTensor out_dev = cuda::to_device(fake_expert_out(host.view, c), stream());
    meet();
    const TensorView out_view = out_dev.view(), y_view = y_dev.view();
    d.combine({&out_view, 1}, {&y_view, 1});
    world().synchronize(CommPhase::none, "the combine to finish");
    y = cuda::to_host(y_dev, stream());
  }
  meet();  // every rank's frees done before any rank's next call
  const Diff diff = compare_bf16(y, ys[static_cast<std::size_t>(me)]);
  EXPECT_EQ(diff.non_finite, 0);
  EXPECT_LE(diff.rel_l2, 1e-2);
  EXPECT_LE(diff.worst_row_rel_l2, 1e-2) << "worst token " << diff.worst_row << " of y";
  if (diff.bit_mismatches != 0)
    std::printf("  note: %s combine: %lld of %lld elements differ in bits from cpu-sim (rel_l2 %.3g)\n",
                what.c_str(), static_cast<long long>(diff.bit_mismatches), static_cast<long long>(y.numel()),
                diff.rel_l2);
}

// Token counts that differ by rank yet stay within [first, last] at any world size: rank 0 gets
// first, rank N-1 gets last, the others in between (a formula like a + b * rank outgrows the buffers
// at 4 or 8 ranks).
std::int64_t ramp(int rank, std::int64_t first, std::int64_t last) {
  const int n = world().size();
  return n < 2 ? first : first + (last - first) * rank / (n - 1);
}

std::vector<std::int64_t> per_rank(const std::function<std::int64_t(int)>& f) {
  std::vector<std::int64_t> t;
  for (int r = 0; r < world().size(); ++r) t.push_back(f(r));
  return t;
}

class Transports : public ::testing::TestWithParam<Transport> {
 protected:
  void SetUp() override {
    if (GetParam() == Transport::nvlink_normal_ce) send_ce_.emplace("EPMOE_COMM_SEND_CE", "2");
    if (GetParam() == Transport::nvlink_normal_ce_launches) send_ce_.emplace("EPMOE_COMM_SEND_CE", "1");
    if (GetParam() == Transport::nvlink_ll_one_warp) split_.emplace("EPMOE_COMM_COMBINE_SPLIT", "1");
    if (GetParam() == Transport::nvlink_ll_fenced_counts) early_.emplace("EPMOE_COMM_LL_EARLY_COUNTS", "0");
    if (GetParam() == Transport::nvlink_normal_early) early_.emplace("EPMOE_COMM_LL_EARLY_COUNTS", "1");
    if (GetParam() == Transport::nvlink_ll_route_kernel) route_.emplace("EPMOE_COMM_LL_ROUTE_IN_LAUNCH", "0");
  }
  void TearDown() override {
    send_ce_.reset();
    split_.reset();
    early_.reset();
    route_.reset();
  }

 private:
  std::optional<ScopedEnv> send_ce_, split_, early_, route_;
};

TEST_P(Transports, UnevenRoutingAndARankThatSendsNothing) {
  on_ranks([&] {
    const MoeConfig c = test_config(64);
    auto d = make(GetParam(), c, ActivationFormat::fp8_group);
    const auto tokens = per_rank([](int r) -> std::int64_t { return r == 1 ? 0 : ramp(r, 9, 48); });
    check_round(*d, c, ActivationFormat::fp8_group,
                make_inputs(c, ActivationFormat::fp8_group, tokens, 11, Routing::random),
                name_of(GetParam()) + " uneven");
  });
}

TEST_P(Transports, NoTokensAnywhere) {
  on_ranks([&] {
    const MoeConfig c = test_config(64);
    auto d = make(GetParam(), c, ActivationFormat::fp8_group);
    check_round(
        *d, c, ActivationFormat::fp8_group,
        make_inputs(c, ActivationFormat::fp8_group, per_rank([](int) { return 0; }), 12, Routing::random),
        name_of(GetParam()) + " T = 0");
  });
}

TEST_P(Transports, MaxTokensEverywhere) {
  on_ranks([&] {
    const MoeConfig c = test_config(64);
    auto d = make(GetParam(), c, ActivationFormat::fp8_group);
    check_round(
        *d, c, ActivationFormat::fp8_group,
        make_inputs(c, ActivationFormat::fp8_group, per_rank([](int) { return 64; }), 13, Routing::random),
        name_of(GetParam()) + " T = max");
  });
}

TEST_P(Transports, AllTokensToTheSameExperts) {
  on_ranks([&] {
    const MoeConfig c = test_config(64);
    auto d = make(GetParam(), c, ActivationFormat::fp8_group);
    check_round(*d, c, ActivationFormat::fp8_group,
                make_inputs(c, ActivationFormat::fp8_group, per_rank([](int r) { return 40 + r; }), 14,
                            Routing::same_experts),
                name_of(GetParam()) + " same experts");
  });
}

TEST_P(Transports, OnlyRankZerosExpertsSoTheOthersReceiveNothing) {
  on_ranks([&] {
    const MoeConfig c = test_config(64);
    auto d = make(GetParam(), c, ActivationFormat::fp8_group);
    check_round(*d, c, ActivationFormat::fp8_group,
                make_inputs(c, ActivationFormat::fp8_group, per_rank([](int r) { return 30 - r; }), 15,
                            Routing::first_rank_only),
                name_of(GetParam()) + " rank 0's experts only");
  });
}

// Random rounds through one dispatcher (test_seed(), the same on every rank): per round every rank's token
// count (0 in one draw of five, the buffer's 64 in another, else uniform), the routing (random, all to
// the same experts, only rank 0's experts) and the inputs' seed; each round's received data byte for
// byte against the simulation and its combine within 1e-2, the buffers reused from round to round.
TEST_P(Transports, RandomRoundsMatchTheSimulation) {
  on_ranks([&] {
    const std::uint64_t seed = test_seed() ^ (static_cast<std::uint64_t>(GetParam()) << 48);
    std::mt19937_64 rng(seed);
    const auto uniform = [&](std::int64_t lo, std::int64_t hi) {
      return epmoe::testing::uniform(rng, lo, hi);
    };
    const MoeConfig c = test_config(64);
    auto d = make(GetParam(), c, ActivationFormat::fp8_group);
    for (int round = 0; round < 6; ++round) {
      const std::vector<std::int64_t> tokens = per_rank([&](int) {
        const std::int64_t kind = uniform(0, 4);
        return kind == 0 ? 0 : kind == 1 ? 64 : uniform(1, 63);
      });
      const auto routing = static_cast<Routing>(uniform(0, 2));
      const std::uint64_t round_salt = rng();
      std::ostringstream what;
      what << name_of(GetParam()) << " random round " << round << ": tokens";
      for (const std::int64_t t : tokens) what << " " << t;
      what << ", routing " << static_cast<int>(routing);
      check_round(*d, c, ActivationFormat::fp8_group,
                  make_inputs(c, ActivationFormat::fp8_group, tokens, round_salt, routing), what.str());
    }
  });
}

TEST_P(Transports, RepeatedCallsReuseTheBuffers) {
  on_ranks([&] {
    const MoeConfig c = test_config(64);
    auto d = make(GetParam(), c, ActivationFormat::fp8_group);
    for (int round = 0; round < 5; ++round) {
      const auto tokens = per_rank([&](int r) -> std::int64_t { return (round * 17 + r * 23) % 65; });
      const Routing routing = round == 3 ? Routing::same_experts : Routing::random;
      check_round(
          *d, c, ActivationFormat::fp8_group,
          make_inputs(c, ActivationFormat::fp8_group, tokens, 100u + static_cast<unsigned>(round), routing),
          fmt::format("{} round {}", name_of(GetParam()), round));
    }
  });
}

TEST_P(Transports, DeepSeekDims) {
  on_ranks([&] {
    const MoeConfig c = test_config(64, /*deepseek=*/true);
    auto d = make(GetParam(), c, ActivationFormat::fp8_group);
    check_round(*d, c, ActivationFormat::fp8_group,
                make_inputs(c, ActivationFormat::fp8_group, per_rank([](int r) { return ramp(r, 48, 64); }),
                            16, Routing::random),
                name_of(GetParam()) + " deepseek-v3 dims");
  });
}

TEST_P(Transports, Bf16AndPerTensorFp8) {
  on_ranks([&] {
    for (const ActivationFormat f : {ActivationFormat::bf16, ActivationFormat::fp8_tensor}) {
      const MoeConfig c = test_config(32);
      auto d = make(GetParam(), c, f);
      check_round(*d, c, f,
                  make_inputs(c, f, per_rank([](int r) { return ramp(r, 20, 29); }), 17, Routing::random),
                  fmt::format("{} format {}", name_of(GetParam()),
                              f == ActivationFormat::bf16 ? "bf16" : "fp8 per tensor"));
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Comm, Transports,
                         ::testing::Values(Transport::p2p_normal, Transport::p2p_low_latency,
                                           Transport::p2p_normal_no_sync, Transport::nvlink_ll,
                                           Transport::nvlink_normal, Transport::nvlink_normal_ce,
                                           Transport::nvlink_normal_ce_launches,
                                           Transport::nvlink_ll_one_warp, Transport::nvlink_ll_fenced_counts,
                                           Transport::nvlink_normal_early, Transport::nvlink_ll_route_kernel,
                                           Transport::nvlink_normal_no_sync),
                         [](const ::testing::TestParamInfo<Transport>& p) {
                           switch (p.param) {
                             case Transport::p2p_normal:
                               return std::string("NcclP2pNormal");
                             case Transport::p2p_low_latency:
                               return std::string("NcclP2pLowLatency");
                             case Transport::p2p_normal_no_sync:
                               return std::string("NcclP2pNormalNoHostSync");
                             case Transport::nvlink_ll:
                               return std::string("NvlinkLl");
                             case Transport::nvlink_normal:
                               return std::string("NvlinkNormal");
                             case Transport::nvlink_normal_ce:
                               return std::string("NvlinkNormalCopyEngines");
                             case Transport::nvlink_normal_ce_launches:
                               return std::string("NvlinkNormalCopyEnginesPackLaunches");
                             case Transport::nvlink_ll_one_warp:
                               return std::string("NvlinkLlOneWarpCombine");
                             case Transport::nvlink_ll_fenced_counts:
                               return std::string("NvlinkLlFencedCounts");
                             case Transport::nvlink_normal_early:
                               return std::string("NvlinkNormalEarlyCounts");
                             case Transport::nvlink_ll_route_kernel:
                               return std::string("NvlinkLlRouteKernel");
                             case Transport::nvlink_normal_no_sync:
                               return std::string("NvlinkNormalNoHostSync");
                           }
                           return std::string("unknown");
                         });

// Rank 0 dispatches alone (the other ranks never do) on `transport` with `tokens` tokens: the
// dispatch ends in a bounded timeout naming the phase and the peer, and the communicator stays
// usable (expect_recoverable_dispatch_timeout synchronizes: side streams have finished too).
void check_a_lone_dispatch_times_out(Transport transport, int max_tokens, std::int64_t tokens,
                                     std::uint32_t seed) {
  const int N = world().size(), me = world().rank();
  if (N < 2) return;
  const double saved = world().timeout_s();
  world().set_timeout_s(0.5);
  {
    const MoeConfig c = test_config(max_tokens);
    auto d = make(transport, c, ActivationFormat::fp8_group);
    if (me == 0) {
      auto in = make_inputs(c, ActivationFormat::fp8_group, per_rank([&](int) { return tokens; }), seed,
                            Routing::random);
      const std::string m = dispatch_error(*d, in[0]);  // the other ranks never dispatch
      // The nvlink dispatchers add their state: sequence numbers, the flags each source wrote.
      if (mode_of(transport) == Mode::low_latency
              ? transport != Transport::p2p_low_latency
              : transport != Transport::p2p_normal && transport != Transport::p2p_normal_no_sync) {
        EXPECT_NE(m.find("device seq receive"), std::string::npos) << m;
        EXPECT_NE(m.find("combine flags by source [parity 0|1]: 0:"), std::string::npos) << m;
      }
      expect_recoverable_dispatch_timeout(m);
    }
    world().set_timeout_s(saved);
    world().barrier();
  }
  world().barrier();
}

// ---------------------------------------------------------------- refusals
TEST(CommNcclP2p, BadInputOnOneRankIsRefusedOnEveryRankAndTheNextCallWorks) {
  on_ranks([&] {
    const MoeConfig c = test_config(32);
    auto d = make(Transport::p2p_normal, c, ActivationFormat::fp8_group);
    const int N = world().size(), me = world().rank(), bad = N - 1;
    for (const bool too_many : {false, true}) {
      auto in =
          make_inputs(c, ActivationFormat::fp8_group,
                      per_rank([&](int r) { return too_many && r == bad ? 33 : 20; }), 18, Routing::random);
      if (!too_many) in[static_cast<std::size_t>(bad)].ids.data<std::int32_t>()[5] = c.num_physical_experts();
      const DeviceInput dev = to_device(in[static_cast<std::size_t>(me)], stream());
      const DispatchInput view = dev.view();
      std::vector<DispatchOutput> out(1);
      const std::string m = error_of([&] { d->dispatch({&view, 1}, out); });
      EXPECT_NE(m.find(fmt::format("rank {} has", bad)), std::string::npos) << m;
      EXPECT_NE(m.find(too_many ? "more tokens" : "out of range"), std::string::npos) << m;
    }
    check_round(
        *d, c, ActivationFormat::fp8_group,
        make_inputs(c, ActivationFormat::fp8_group, per_rank([](int) { return 25; }), 19, Routing::random),
        "nccl-p2p after refusals");
  });
}

// Without a host sync (low-latency mode): rank 0 refuses on the host after sending its status, its
// peers record the status instead of waiting.
void check_too_many_tokens_reported_to_peers(Transport transport) {
  on_ranks([&] {
    const int N = world().size(), me = world().rank();
    if (N < 2) return;  // needs a peer
    {
      const MoeConfig c = test_config(32);
      auto d = make(transport, c, ActivationFormat::fp8_group);
      auto in = make_inputs(c, ActivationFormat::fp8_group, per_rank([](int r) { return r == 0 ? 33 : 10; }),
                            20, Routing::random);
      expect_rank0_too_many_reported(
          dispatch_error(*d, in[static_cast<std::size_t>(me)], /*every_rank=*/true));
      world().reset_device_errors();
      world().barrier();
    }  // the dispatcher (its window) goes, collectively
    world().barrier();
  });
}
TEST(CommNvlinkLl, TooManyTokensOnOneRankIsReportedToItsPeers) {
  check_too_many_tokens_reported_to_peers(Transport::nvlink_ll);
}
TEST(CommNcclP2p, LowLatencyTooManyTokensOnOneRankIsReportedToItsPeers) {
  check_too_many_tokens_reported_to_peers(Transport::p2p_low_latency);
}

// An engine's nonblocking NCCL communicator (config.blocking = 0), lent with Communicator::borrow
// while it is still setting up: borrow waits for it, and every call epmoe makes on it completes before
// the next (Communicator::complete_nccl; before, ncclInProgress was taken for success and the next call
// made at once, which NCCL forbids, and a window registration's or device communicator's outputs were
// used before NCCL wrote them). The transports give the simulation's data as on the world's own
// communicator: nccl-p2p in both modes; on 2+ ranks also the LSA query (a device communicator), a
// barrier (its window) and nvlink-ll (a window).
TEST(CommNcclP2p, OnAnEnginesNonblockingCommunicator) {
  on_ranks([&] {
    const int N = world().size(), me = world().rank();
    const ncclUniqueId id = shared_nccl_id();
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t engine = nullptr;
    const ncclResult_t init = ncclCommInitRankConfig(&engine, N, id, me, &config);
    ASSERT_TRUE(init == ncclSuccess || init == ncclInProgress) << ncclGetErrorString(init);
    ASSERT_NE(engine, nullptr);
    {
      CommOptions o;
      o.stream = world().stream();  // the test's copies and the transports in one order
      std::shared_ptr<Communicator> borrowed = Communicator::borrow(engine, o);  // waits for the set-up
      EXPECT_EQ(borrowed->rank(), me);
      EXPECT_EQ(borrowed->size(), N);
      const MoeConfig c = test_config(32);
      auto round = [&](std::unique_ptr<LowLatencyDispatcher> d, const char* what) {
        check_round(*d, c, ActivationFormat::fp8_group,
                    make_inputs(c, ActivationFormat::fp8_group,
                                per_rank([](int r) { return ramp(r, 20, 29); }), 25, Routing::random),
                    what);
      };
      for (const Mode mode : {Mode::normal, Mode::low_latency}) {
        const DispatcherContext ctx{c, mode, ActivationFormat::fp8_group, me, 1};
        round(make_nccl_p2p_dispatcher(ctx, borrowed),
              mode == Mode::normal ? "nccl-p2p, nonblocking, normal" : "nccl-p2p, nonblocking, low latency");
      }
      if (N > 1) {
        const bool lsa = borrowed->all_ranks_load_store_reachable();
        EXPECT_EQ(lsa, world().all_ranks_load_store_reachable());
        borrowed->barrier();
        if (lsa) {
          const DispatcherContext ctx{c, Mode::low_latency, ActivationFormat::fp8_group, me, 1};
          round(make_nvlink_ll_dispatcher(ctx, borrowed), "nvlink-ll, nonblocking");
        }
      }
      world().barrier();
    }  // (windows deregistered, collectively)
    // The engine's teardown of a nonblocking communicator: finalize, wait, then destroy (or abort).
    const ncclResult_t finalize = ncclCommFinalize(engine);
    EXPECT_TRUE(finalize == ncclSuccess || finalize == ncclInProgress) << ncclGetErrorString(finalize);
    ncclResult_t state = ncclInProgress;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (state == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
      ASSERT_EQ(ncclCommGetAsyncError(engine, &state), ncclSuccess);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(state, ncclSuccess);
    if (state == ncclSuccess) {
      EXPECT_EQ(ncclCommDestroy(engine), ncclSuccess);
    } else {
      (void)ncclCommAbort(engine);
    }
    world().barrier();
  });
}

// An owned nonblocking communicator (CommOptions::nonblocking) bounds the collective set-up calls
// made after its creation: rank 0 registers a window that no peer registers until rank 0 has given
// up, and throws within its host limit, naming the call (on a blocking communicator NCCL would wait
// inside the call without a bound); the late ranks' registration then fails too (their peer is gone),
// bounded the same way. Both communicators are aborted, the world's stays usable.
TEST(CommNcclOwned, ASetUpCallAPeerNeverMakesIsBoundedWhenNonblocking) {
  on_ranks([&] {
    const int N = world().size(), me = world().rank();
    // (Needs a peer that leaves the call out; not a GTEST_SKIP, which would mark a whole ctest entry
    // of this suite skipped. The one-rank entries leave it out.)
    if (N < 2) return;
    CommOptions o;
    o.nonblocking = true;
    o.timeout_s = 2.0;
    std::shared_ptr<Communicator> own = Communicator::create(shared_nccl_id(), me, N, world().device(), o);
    ASSERT_NE(own->nccl(), nullptr);  // (waits for the set-up, bounded)
    auto register_window = [&](const char* who) {
      const auto start = std::chrono::steady_clock::now();
      std::string message;
      try {
        (void)own->alloc_symmetric(std::size_t{1} << 20);
      } catch (const Error& e) {
        message = e.what();
      }
      const double took_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_FALSE(message.empty()) << who << ": the window registration succeeded without its peers";
      EXPECT_LE(took_s, own->host_wait_limit_s() + 5.0) << who << ": " << message;
      return message;
    };
    if (me == 0) {
      const std::string message = register_window("rank 0, alone");
      EXPECT_NE(message.find("ncclCommWindowRegister"), std::string::npos) << message;
      EXPECT_NE(message.find("did not complete within"), std::string::npos) << message;
      EXPECT_NE(message.find("rank 0"), std::string::npos) << message;
      EXPECT_TRUE(own->broken()) << "rank 0's communicator was not aborted after the timeout";
    }
    world().barrier();  // rank 0 has given up and aborted its communicator
    if (me != 0) (void)register_window("a late rank");
    world().barrier();
    own.reset();
    world().barrier();  // the world's communicator still works
  });
}

// Per-tensor FP8 without a host sync: a peer whose static scale differs from this rank's is recorded
// on the device (the host-synced path refuses it on every rank before sending).
TEST(CommNcclP2p, LowLatencyPerTensorScalesThatDifferAreReported) {
  on_ranks([&] {
    const int N = world().size(), me = world().rank();
    if (N < 2) return;  // needs a peer
    const MoeConfig c = test_config(32);
    auto d = make(Transport::p2p_low_latency, c, ActivationFormat::fp8_tensor);
    auto in =
        make_inputs(c, ActivationFormat::fp8_tensor, per_rank([](int) { return 12; }), 24, Routing::random);
    in[0].tensor_scale *= 2.0f;  // rank 0 alone
    const std::string m = dispatch_error(*d, in[static_cast<std::size_t>(me)]);
    EXPECT_NE(m.find("static scale"), std::string::npos) << m;
    if (me != 0) {
      EXPECT_NE(m.find("rank 0 quantized"), std::string::npos) << m;  // (rank 0: any peer may be named)
    }
    world().reset_device_errors();
    world().barrier();
  });
}

TEST(CommNvlinkLl, APeerThatNeverArrivesIsATimeoutNamingIt) {
  on_ranks([&] { check_a_lone_dispatch_times_out(Transport::nvlink_ll, 32, 10, 21); });
}

// Every rank dispatches, then rank 0 alone combines (the others never send their partial sums): its
// combine ends in a bounded timeout naming the phase and the peer, and the communicator stays usable.
TEST(CommNvlinkLl, ACombineThatAPeerNeverJoinsIsATimeoutNamingIt) {
  on_ranks([&] {
    const int N = world().size(), me = world().rank();
    if (N < 2) return;  // needs a peer
    const double saved = world().timeout_s();
    {
      const MoeConfig c = test_config(32);
      auto d = make(Transport::nvlink_ll, c, ActivationFormat::fp8_group);
      const auto in =
          make_inputs(c, ActivationFormat::fp8_group, per_rank([](int) { return 20; }), 28, Routing::random);
      const DeviceInput dev = to_device(in[static_cast<std::size_t>(me)], stream());
      const DispatchInput view = dev.view();
      std::vector<DispatchOutput> out(1);
      meet();
      d->dispatch({&view, 1}, out);
      world().synchronize(CommPhase::none, "the dispatch");
      world().set_timeout_s(0.5);
      if (me == 0) {
        const cuda::DeviceTensor expert_out(DType::bf16, {out[0].num_output_rows(), c.hidden});
        const cuda::DeviceTensor y(DType::bf16, {20, c.hidden});
        expert_out.fill_bytes(0, stream());
        y.fill_bytes(0, stream());
        const TensorView expert_view = expert_out.view(), y_view = y.view();
        const std::string m = error_of([&] {
          d->combine({&expert_view, 1}, {&y_view, 1});
          world().synchronize(CommPhase::none, "the combine");
        });
        expect_recoverable_combine_timeout(m, y_view, -1);
      }
      world().set_timeout_s(saved);
      world().barrier();
    }  // the dispatcher (its window) goes, collectively
    world().barrier();
  });
}

// What the poison tests share: a dispatcher on `transport`, every rank's `tokens` random tokens (for
// cpu-sim), this rank's on the device, and y for them.
struct PoisonRig {
  PoisonRig(Transport transport, std::int64_t tokens, std::uint32_t seed)
      : inputs(make_inputs(c, ActivationFormat::fp8_group, per_rank([&](int) { return tokens; }), seed,
                           Routing::random)),
        d(make(transport, c, ActivationFormat::fp8_group)),
        dev(to_device(inputs[static_cast<std::size_t>(world().rank())], stream())),
        view(dev.view()),
        y(DType::bf16, {tokens, c.hidden}) {}
  const MoeConfig c = test_config(32);
  const std::vector<RankInput> inputs;
  std::unique_ptr<LowLatencyDispatcher> d;
  const DeviceInput dev;
  const DispatchInput view;
  const cuda::DeviceTensor y;
};

// Takes this rank's error claim without a record, in stream order: its kernels act as after a wait
// that gave up, while its host sees no error and goes on, as a graph replay would.
void take_error_claim() {
  const std::int32_t taken = 1;
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(world().device_error_sink().claim, &taken, sizeof(taken),
                                   cudaMemcpyHostToDevice, stream()));
}

// One dispatch of `view` into `out` that the host must accept, waited for; then finite stand-in expert
// outputs for its rows (allocated before any meet: see meet()).
cuda::DeviceTensor dispatch_with_stand_in_outputs(Dispatcher& d, const DispatchInput& view,
                                                  std::vector<DispatchOutput>& out, std::int64_t hidden) {
  EXPECT_EQ(error_of([&] {
              d.dispatch({&view, 1}, out);
              world().synchronize(CommPhase::none, "the dispatch");
            }),
            "");
  cuda::DeviceTensor expert_out(DType::bf16, {out[0].num_output_rows(), hidden});
  expert_out.fill_bytes(0x3c, stream());
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream()));
  return expert_out;
}

// A rank whose wait gave up (its error claim taken by hand on rank 0: take_error_claim) poisons what it
// writes: its received rows and y are NaN throughout, and it raises no combine flag, so its peers' combines
// time out naming it (and their y is NaN) instead of summing what it sent. Round 1 runs clean: its received
// data is cpu-sim's (the rows buffer cannot be poisoned before it: the dispatcher's buffers are known only
// from a call's outputs), and its combine writes every element of a y poisoned beforehand. The rows buffer is
// then zeroed, and y zeroed before round 2, so that only round 2's poisoning can set all their bits. Each
// rank dispatches, waits for it, allocates the stand-in expert outputs, then meets the others before
// combining (meet() says why). Normal mode keeps the dispatcher's host sync: rank 0's host learns a layout
// and goes on.
void check_a_rank_that_gave_up_poisons(Transport transport) {
  on_ranks([&] {
    const int N = world().size(), me = world().rank();
    if (N < 2) return;  // needs a peer
    const double saved = world().timeout_s();
    {
      PoisonRig rig(transport, 20, 30);
      const Simulated simulated =
          simulate(rig.c, mode_of(transport), ActivationFormat::fp8_group, rig.inputs);
      const TensorView y_view = rig.y.view();
      for (const bool gave_up : {false, true}) {
        SCOPED_TRACE(gave_up ? "rank 0's claim taken" : "a clean round");
        std::vector<DispatchOutput> out(1);
        rig.y.fill_bytes(gave_up ? 0x00 : 0xFF, stream());
        meet();
        if (gave_up) {
          world().set_timeout_s(0.5);
          if (me == 0) take_error_claim();
        }
        const cuda::DeviceTensor expert_out =
            dispatch_with_stand_in_outputs(*rig.d, rig.view, out, rig.c.hidden);
        const TensorView expert_view = expert_out.view();
        meet();
        std::int64_t rows_not_poisoned = -1;
        const std::string m = error_of([&] {
          rig.d->combine({&expert_view, 1}, {&y_view, 1});
          world().synchronize(CommPhase::none, "the combine");
          rows_not_poisoned = bytes_not_poisoned(out[0].rows) + bytes_not_poisoned(out[0].scales);
        });
        if (!gave_up) {
          EXPECT_EQ(m, "");
          const HostOutput host = download(out[0], stream());
          expect_same_dispatch(host.view, simulated.want[static_cast<std::size_t>(me)], "the clean round");
          EXPECT_EQ(non_finite_elements(y_view), 0) << "the clean combine left elements of y unwritten";
          // Zeroed, so that only round 2's place can set their bits.
          EPMOE_CUDA_CHECK(cudaMemsetAsync(out[0].rows.data, 0, out[0].rows.nbytes(), stream()));
          EPMOE_CUDA_CHECK(cudaMemsetAsync(out[0].scales.data, 0, out[0].scales.nbytes(), stream()));
          EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream()));
          continue;
        }
        if (me == 0) {
          EXPECT_EQ(m, "") << "rank 0's error record was left empty: its host sees nothing";
          EXPECT_EQ(rows_not_poisoned, 0) << "rank 0's received rows and scales are not NaN throughout";
          EXPECT_EQ(bytes_not_poisoned(y_view), 0) << "rank 0's y is not NaN throughout";
          world().reset_device_errors();
        } else {
          expect_recoverable_combine_timeout(m, y_view, 0);
        }
        world().set_timeout_s(saved);
      }
      world().barrier();
    }  // the dispatcher (its window) goes, collectively
    world().barrier();
  });
}
// The NCCL point-to-point transport has no flags to withhold: a rank with a recorded error (its claim
// set by hand on rank 0, as above) still takes part in every NCCL call, and its home kernel writes NaN
// into y instead of the sums (runs on one rank too: CommGpu.one_rank_nccl).
TEST(CommNcclP2p, ARankWithARecordedErrorWritesNaNIntoY) {
  on_ranks([&] {
    const int me = world().rank();
    PoisonRig rig(Transport::p2p_low_latency, 16, 31);
    const TensorView y_view = rig.y.view();
    for (const bool recorded : {false, true}) {
      SCOPED_TRACE(recorded ? "rank 0's claim taken" : "a clean round");
      // Zeroed where the combine must set every bit (NaN), poisoned where it must write every element.
      const bool writes_nan = recorded && me == 0;
      rig.y.fill_bytes(writes_nan ? 0x00 : 0xFF, stream());
      if (recorded && me == 0) take_error_claim();
      std::vector<DispatchOutput> out(1);
      const cuda::DeviceTensor expert_out =
          dispatch_with_stand_in_outputs(*rig.d, rig.view, out, rig.c.hidden);
      const TensorView expert_view = expert_out.view();
      EXPECT_EQ(error_of([&] {
                  rig.d->combine({&expert_view, 1}, {&y_view, 1});
                  world().synchronize(CommPhase::none, "the combine");
                }),
                "");
      if (writes_nan)
        EXPECT_EQ(bytes_not_poisoned(y_view), 0) << "rank 0's y is not NaN throughout";
      else
        EXPECT_EQ(non_finite_elements(y_view), 0) << "the combine left elements of y unwritten";
      if (recorded) world().reset_device_errors();
      world().barrier();
    }
  });
}

TEST(CommNvlinkLl, ARankWhoseWaitGaveUpPoisonsItsOutputsAndItsPeersTimeOut) {
  check_a_rank_that_gave_up_poisons(Transport::nvlink_ll);
}
TEST(CommNvlinkNormal, ARankWhoseWaitGaveUpPoisonsItsOutputsAndItsPeersTimeOut) {
  check_a_rank_that_gave_up_poisons(Transport::nvlink_normal);
}

// EPMOE_COMM_WATCH=1: after one round (dispatch, combine) the dispatcher's state in the
// communicator's diagnostics lists, in order, the combine flags after each call: after the combine,
// every source's flag of sequence 1 (parity 1) in this rank's window, and this rank's in every
// peer's window. (The switch exists to find the loopback low-latency timeout whose combine flag
// went missing, bench/NOTES.md session 20.)
TEST(CommNvlinkLl, TheFlagWatchSeesEveryCombineFlag) {
  const ScopedEnv watch("EPMOE_COMM_WATCH", "1");
  on_ranks([&] {
    const int N = world().size();
    if (N > 8) return;  // the watch covers up to 8 ranks
    const MoeConfig c = test_config(32);
    auto d = make(Transport::nvlink_ll, c, ActivationFormat::fp8_group);
    const auto in = make_inputs(c, ActivationFormat::fp8_group, per_rank([](int r) { return 9 + r; }), 24,
                                Routing::random);
    check_round(*d, c, ActivationFormat::fp8_group, in, "watched round");
    const std::string m = world().diagnostics();
    // Each record carries the GPU timer when its kernel ran and the host clock when its call had
    // enqueued (ms): each in call order, never decreasing.
    std::string pattern = R"(#1 dispatch_recv @([0-9.]+) \(host ([0-9.]+)\):.* #2 combine_send @([0-9.]+) )"
                          R"(\(host ([0-9.]+)\):.* #3 combine_recv @([0-9.]+) \(host ([0-9.]+)\):)";
    for (int src = 0; src < N; ++src) pattern += fmt::format(" {}:0\\|1/0\\|1", src);
    std::smatch match;
    ASSERT_TRUE(std::regex_search(m, match, std::regex(pattern))) << m;
    EXPECT_LE(std::stod(match[1].str()), std::stod(match[3].str())) << m;  // GPU
    EXPECT_LE(std::stod(match[3].str()), std::stod(match[5].str())) << m;
    EXPECT_LE(std::stod(match[2].str()), std::stod(match[4].str())) << m;  // host
    EXPECT_LE(std::stod(match[4].str()), std::stod(match[6].str())) << m;
    world().barrier();
  });
}

// ---------------------------------------------------------------- low latency: halves, graphs
void check_halves_with_work_between(Transport transport) {
  on_ranks([&] {
    const MoeConfig c = test_config(64);
    auto d = make(transport, c, ActivationFormat::fp8_group);
    const auto in = make_inputs(c, ActivationFormat::fp8_group,
                                per_rank([](int r) { return ramp(r, 50, 1); }), 22, Routing::random);
    const cuda::DeviceBuffer other(std::size_t{64} << 20);
    check_halves(*d, c, ActivationFormat::fp8_group, in, "halves",
                 [&] { other.fill_bytes(0x3c, stream()); });  // unrelated work between the halves
  });
}
TEST(CommNvlinkLl, HalvesWithOtherWorkInBetween) {
  check_halves_with_work_between(Transport::nvlink_ll);
}
TEST(CommNcclP2p, LowLatencyHalvesWithOtherWorkInBetween) {
  check_halves_with_work_between(Transport::p2p_low_latency);
}
TEST(CommNcclP2p, NormalHalvesWithoutAHostSync) {
  check_halves_with_work_between(Transport::p2p_normal_no_sync);
}

// Normal mode through the halves (own tokens through the window / the own receive region),
// alternating with whole dispatch() calls (own tokens read from x): the same bytes either way, and
// the sequence numbers (nvlink) stay in step.
void check_halves_and_whole_calls_alternate(Transport transport) {
  on_ranks([&] {
    const MoeConfig c = test_config(64);
    auto d = make(transport, c, ActivationFormat::fp8_group);
    const int me = world().rank();
    const auto in = make_inputs(c, ActivationFormat::fp8_group,
                                per_rank([](int r) { return ramp(r, 40, 55); }), 23, Routing::random);
    const Simulated simulated = simulate(c, Mode::normal, ActivationFormat::fp8_group, in);
    const std::vector<DispatchOutput>& want = simulated.want;
    const DeviceInput dev = to_device(in[static_cast<std::size_t>(me)], stream());
    const DispatchInput dev_view = dev.view();
    DispatchOutput last;  // the last round's outputs: the buffers (and extents) this round writes
    for (int round = 0; round < 4; ++round) {
      // Every round has the same inputs: poisoned, the last round's bytes cannot pass for this round's.
      poison_outputs(last);
      // (After the upload, the poisoning and the last round's copies. Under compute-sanitizer a rank still
      // copying round r out held back its round r + 1 while the peer's round r + 1 kernel waited for it,
      // until the timeout: session 63, memcheck.)
      meet_on_loopback();
      std::vector<DispatchOutput> out(1);
      if (round % 2 == 0) {
        d->dispatch_send(dev_view);
        d->dispatch_recv(out[0]);
      } else {
        d->dispatch({&dev_view, 1}, out);
      }
      const HostOutput host = download(out[0], stream());
      expect_same_dispatch(host.view, want[static_cast<std::size_t>(me)], "round " + std::to_string(round));
      last = out[0];
    }
  });
}
TEST(CommNvlinkNormal, HalvesAndWholeCallsAlternate) {
  check_halves_and_whole_calls_alternate(Transport::nvlink_normal);
}
TEST(CommNcclP2p, NormalHalvesAndWholeCallsAlternate) {
  check_halves_and_whole_calls_alternate(Transport::p2p_normal);
}

// ---------------------------------------------------------------- normal: copy-engine send
// The copy-engine sends (EPMOE_COMM_SEND_CE=2: packing inside the dispatch launch, the side
// streams wait for each piece's flag; 1: the v4 pack launches) with few and many pieces (one piece
// per 64-slot chunk at most, a last piece that ends mid-chunk), one and two side streams, and
// between them the SM-store send and the halves, on one dispatcher: the same bytes every time, and
// the sequence numbers, parities and arrival counters stay in step across the paths. 1200 tokens
// per rank at most make the warp's slot search take two rounds (W = 38 words > 32), and 700+ per
// call use every pack block.
TEST(CommNvlinkNormal, CopyEngineSendPiecesStreamsAndPathsAlternate) {
  on_ranks([&] {
    const MoeConfig c = test_config(883 + 37 * 9);
    const DispatcherContext ctx{c, Mode::normal, ActivationFormat::fp8_group, world().rank(), 1};
    auto d = make_nvlink_dispatcher(ctx, world_ptr());
    const int N = world().size();
    struct Round {
      const char* send_ce;  // EPMOE_COMM_SEND_CE
      int pieces, streams;
      bool halves;
    };
    const Round rounds[] = {{"2", 8, 1, false},  {"2", 1, 1, false}, {"0", 8, 1, false}, {"2", 64, 2, false},
                            {"2", 3, 2, false},  {"0", 8, 1, true},  {"1", 8, 1, false}, {"2", 5, 1, false},
                            {"2", 16, 2, false}, {"2", 8, 1, true}};
    int index = 0;
    for (const Round& r : rounds) {
      const ScopedEnv send_ce("EPMOE_COMM_SEND_CE", r.send_ce);
      const ScopedEnv pieces("EPMOE_COMM_CE_PIECES", std::to_string(r.pieces));
      const ScopedEnv streams("EPMOE_COMM_CE_STREAMS", std::to_string(r.streams));
      const std::string what = fmt::format("round {}: send_ce {} pieces {} streams {}{}", index, r.send_ce,
                                           r.pieces, r.streams, r.halves ? " halves" : "");
      SCOPED_TRACE(what);
      const auto tokens = per_rank([&](int rank) -> std::int64_t {
        return index == 4 && rank == N - 1 ? 0 : ramp(rank, 700, 883) + 37 * index;  // a rank with none once
      });
      const auto in = make_inputs(c, ActivationFormat::fp8_group, tokens, 200u + static_cast<unsigned>(index),
                                  index == 7 ? Routing::same_experts : Routing::random);
      if (!r.halves) {
        check_round(*d, c, ActivationFormat::fp8_group, in, what);
      } else {
        // The halves never take the copy-engine path (own tokens through the window).
        check_halves(*d, c, ActivationFormat::fp8_group, in, what);
      }
      ++index;
    }
  });
}

// A device-side refusal (an expert id out of range on one rank) under the copy-engine send: that
// rank packs nothing but raises every piece flag, so no side stream waits forever; every rank
// reports the refusal, and the next call on the same dispatcher is correct.
TEST(CommNvlinkNormal, CopyEngineSendRefusedInputIsReportedAndTheNextCallWorks) {
  on_ranks([&] {
    const int N = world().size(), me = world().rank();
    if (N < 2) return;
    const ScopedEnv send_ce("EPMOE_COMM_SEND_CE", "2");
    const MoeConfig c = test_config(256);
    auto d = make(Transport::nvlink_normal, c, ActivationFormat::fp8_group);
    const int bad = N - 1;
    auto in = make_inputs(c, ActivationFormat::fp8_group, per_rank([](int r) { return 200 + r; }), 24,
                          Routing::random);
    in[static_cast<std::size_t>(bad)].ids.data<std::int32_t>()[5] = c.num_physical_experts();
    {
      const std::string m = dispatch_error(*d, in[static_cast<std::size_t>(me)]);
      EXPECT_NE(m.find(fmt::format("rank {} refused its input", bad)), std::string::npos) << m;
      EXPECT_NE(m.find("out of range"), std::string::npos) << m;
      world().reset_device_errors();  // synchronizes: the side streams have finished
      world().barrier();
    }
    check_round(*d, c, ActivationFormat::fp8_group,
                make_inputs(c, ActivationFormat::fp8_group, per_rank([](int r) { return 150 + 9 * r; }), 25,
                            Routing::random),
                "copy engines after a refusal");
  });
}

// A peer that never dispatches, under the copy-engine send: the side stream's waits depend only on
// this rank's own launch, so they end; the error is place's bounded wait, naming the peer and the
// phase, and the communicator stays usable.
TEST(CommNvlinkNormal, CopyEngineSendAPeerThatNeverArrivesIsATimeoutNamingIt) {
  on_ranks([&] {
    const ScopedEnv send_ce("EPMOE_COMM_SEND_CE", "2");
    check_a_lone_dispatch_times_out(Transport::nvlink_normal, 256, 200, 26);
  });
}

// Dispatch and combine captured once (halves) and replayed on new inputs: the layout and y of each.
void check_graph_replays(Transport transport) {
  on_ranks([&] {
    const MoeConfig c = test_config(64);
    auto d = make(transport, c, ActivationFormat::fp8_group);
    const int me = world().rank();
    const auto tokens = per_rank([](int r) { return ramp(r, 37, 52); });
    std::vector<RankInput> first = make_inputs(c, ActivationFormat::fp8_group, tokens, 30, Routing::random);
    DeviceInput dev = to_device(first[static_cast<std::size_t>(me)], stream());
    const Mode mode = d->context().mode;  // normal: without a host sync, the layout at its bound
    const std::int64_t rows = mode == Mode::low_latency
                                  ? static_cast<std::int64_t>(c.num_local_experts()) * c.masked_max_m()
                                  : contiguous_rows_bound(c, c.max_tokens_per_rank);
    const cuda::DeviceTensor out_dev(DType::bf16, {rows, c.hidden});
    const cuda::DeviceTensor y_dev(DType::bf16, {tokens[static_cast<std::size_t>(me)], c.hidden});

    DispatchOutput out;
    const cuda::Graph g_dispatch = cuda::Graph::capture(stream(), [&] {
      d->dispatch_send(dev.view());
      d->dispatch_recv(out);
    });
    const cuda::Graph g_combine = cuda::Graph::capture(stream(), [&] {
      d->combine_send(out_dev.view());
      d->combine_recv(y_dev.view());
    });

    for (int replay = 0; replay < 4; ++replay) {
      SCOPED_TRACE(fmt::format("replay {}", replay));
      const auto in = make_inputs(c, ActivationFormat::fp8_group, tokens, 31u + static_cast<unsigned>(replay),
                                  replay == 2 ? Routing::same_experts : Routing::random);
      copy_into(dev, in[static_cast<std::size_t>(me)], stream());
      Simulated simulated = simulate(c, mode, ActivationFormat::fp8_group, in, d->context().host_sync);
      const std::vector<DispatchOutput>& want = simulated.want;

      meet_on_loopback();  // (after the set-up, the upload, and the last replay's copies)
      g_dispatch.launch(stream());
      const HostOutput host = download(out, stream());
      expect_same_dispatch(host.view, want[static_cast<std::size_t>(me)], "graph dispatch");
      const std::vector<HostTensor> ys = simulate_combine(simulated, c, tokens);
      const HostTensor mine = fake_expert_out(host.view, c);
      cuda::copy(out_dev.view(), mine, stream());
      y_dev.fill_bytes(0xff, stream());
      meet_on_loopback();
      g_combine.launch(stream());
      world().synchronize(CommPhase::none, "the combine graph");
      const HostTensor y = cuda::to_host(y_dev.view(), stream());
      const Diff diff = compare_bf16(y, ys[static_cast<std::size_t>(me)]);
      EXPECT_EQ(diff.non_finite, 0);
      EXPECT_LE(diff.rel_l2, 1e-2);
      EXPECT_LE(diff.worst_row_rel_l2, 1e-2) << "worst token " << diff.worst_row << " of y";
    }
  });
}
TEST(CommNvlinkLl, GraphReplaysReuseTheBuffers) {
  check_graph_replays(Transport::nvlink_ll);
}
TEST(CommNvlinkNormal, GraphReplaysWithoutAHostSync) {
  check_graph_replays(Transport::nvlink_normal_no_sync);
}
TEST(CommNcclP2p, LowLatencyGraphReplaysReuseTheBuffers) {
  check_graph_replays(Transport::p2p_low_latency);
}
TEST(CommNcclP2p, NormalGraphReplaysWithoutAHostSync) {
  check_graph_replays(Transport::p2p_normal_no_sync);
}

// ---------------------------------------------------------------- combine: warps per token
// The split combine (EPMOE_COMM_COMBINE_SPLIT=S: S warps per token, one slice of the hidden
// dimension each) sums every element in the same order as one warp per token, so y must be the
// same bits, in both modes, eagerly and (low latency) replayed from a graph captured with the
// switch set. Hidden 7168 (28 units of 512 bytes: splits that divide it and ones that do not, more
// slices than units) and 640 (2.5 units: a short last slice). The dispatch runs once; the combines
// repeat on its output (the combine's own sequence numbers and parities alternate).
TEST(CommNvlinkCombineSplit, SameBitsAsOneWarpPerTokenEagerAndGraphed) {
  on_ranks([&] {
    const int me = world().rank();
    for (const bool deepseek : {true, false}) {
      for (const Mode mode : {Mode::low_latency, Mode::normal}) {
        MoeConfig c = test_config(64, deepseek);
        if (!deepseek) c.hidden = 640;
        const std::string what =
            fmt::format("hidden {} {}", c.hidden, mode == Mode::normal ? "normal" : "low latency");
        SCOPED_TRACE(what);
        const DispatcherContext ctx{c, mode, ActivationFormat::fp8_group, me, 1};
        auto d = mode == Mode::normal ? make_nvlink_dispatcher(ctx, world_ptr())
                                      : make_nvlink_ll_dispatcher(ctx, world_ptr());
        const auto tokens = per_rank([](int r) -> std::int64_t { return ramp(r, 45, 64); });
        const auto in = make_inputs(c, ActivationFormat::fp8_group, tokens, 40, Routing::random);
        const DeviceInput dev = to_device(in[static_cast<std::size_t>(me)], stream());
        const DispatchInput view = dev.view();
        std::vector<DispatchOutput> out(1);
        d->dispatch({&view, 1}, out);
        const HostOutput host = download(out[0], stream());
        const cuda::DeviceTensor eo_dev = cuda::to_device(fake_expert_out(host.view, c), stream());
        const std::int64_t T = tokens[static_cast<std::size_t>(me)];
        const cuda::DeviceTensor y_dev(DType::bf16, {T, c.hidden});
        const TensorView eo = eo_dev.view(), yv = y_dev.view();
        auto combine = [&](const std::string& split) {
          const ScopedEnv env("EPMOE_COMM_COMBINE_SPLIT", split);
          y_dev.fill_bytes(0xff, stream());
          d->combine({&eo, 1}, {&yv, 1});
          world().synchronize(CommPhase::none, "the combine");
          return cuda::to_host(y_dev, stream());
        };
        auto same_bits = [](const HostTensor& a, const HostTensor& b) {
          std::int64_t differ = 0;
          for (std::int64_t i = 0; i < a.numel(); ++i)
            differ += a.data<bf16>()[i].bits != b.data<bf16>()[i].bits;
          return differ;
        };
        const HostTensor want = combine("1");
        EXPECT_EQ(compare_bf16(want, want).non_finite, 0) << "the unsplit combine wrote every element";
        for (const int split : {2, 3, 7, 28, 64, 1000}) {
          const HostTensor got = combine(std::to_string(split));
          EXPECT_EQ(same_bits(got, want), 0)
              << what << ": split " << split << " differs from one warp per token";
        }
        if (mode == Mode::low_latency) {
          const cuda::Graph graph = [&] {
            const ScopedEnv env("EPMOE_COMM_COMBINE_SPLIT", "14");
            return cuda::Graph::capture(stream(), [&] { d->combine({&eo, 1}, {&yv, 1}); });
          }();
          for (int replay = 0; replay < 3; ++replay) {
            y_dev.fill_bytes(0xff, stream());
            graph.launch(stream());
            world().synchronize(CommPhase::none, "the combine graph");
            EXPECT_EQ(same_bits(cuda::to_host(y_dev, stream()), want), 0)
                << what << ": graph replay " << replay;
          }
        }
        world().barrier();  // every rank is done before the dispatcher (its window) goes
      }
    }
  });
}

// ---------------------------------------------------------------- dispatch: early counts
// Early counts (EPMOE_COMM_LL_EARLY_COUNTS=1: the header as tagged words without the fence, the own
// first token loaded before the layout) must give the same bits as the default dispatch: the
// received data (byte for byte) and, through the combine that reads place's internal tables
// (recv_rows / recv_src / recv_slot / recv_total), the same y. Both modes; token counts 0 everywhere,
// 1, uneven with a rank that sends nothing, the maximum, all tokens to the same experts, DeepSeek-V3
// dims (one 7 KB fp8 row = one preloaded batch) and bf16 rows (two batches: the rest is loaded
// after the layout; small batches: the 128 local experts' masked rows are made on the host each
// round), and 3000 tokens (more own tokens than placing warps: the loop after the first).
// Low latency also replays a dispatch graph captured with the switch set, 3 times on new inputs.
struct EarlyCase {
  std::string what;
  bool deepseek = false;
  int max_tokens = 64;
  ActivationFormat format = ActivationFormat::fp8_group;
  std::function<std::int64_t(int)> tokens;
  Routing routing = Routing::random;
};

std::vector<EarlyCase> early_cases() {
  return {
      {"T = 0 everywhere", false, 64, ActivationFormat::fp8_group, [](int) { return 0; }},
      {"T = 1", false, 64, ActivationFormat::fp8_group, [](int) { return 1; }},
      {"uneven, rank 1 sends nothing", false, 64, ActivationFormat::fp8_group,
       [](int r) -> std::int64_t { return r == 1 ? 0 : ramp(r, 9, 48); }},
      {"T = max", false, 64, ActivationFormat::fp8_group, [](int) { return 64; }},
      {"same experts", false, 64, ActivationFormat::fp8_group, [](int r) -> std::int64_t { return 40 + r; },
       Routing::same_experts},
      {"rank 0's experts only", false, 64, ActivationFormat::fp8_group,
       [](int r) -> std::int64_t { return 30 - r; }, Routing::first_rank_only},
      {"deepseek-v3 dims", true, 32, ActivationFormat::fp8_group,
       [](int r) -> std::int64_t { return ramp(r, 32, 17); }},
      {"deepseek-v3 dims, bf16", true, 16, ActivationFormat::bf16,
       [](int r) -> std::int64_t { return ramp(r, 16, 7); }},
      {"3000 tokens", false, 4096, ActivationFormat::fp8_group,
       [](int r) -> std::int64_t { return ramp(r, 3000, 1500); }},
  };
}

std::int64_t bits_differ(const HostTensor& a, const HostTensor& b) {
  if (a.numel() != b.numel()) return std::max<std::int64_t>(1, std::max(a.numel(), b.numel()));
  std::int64_t differ = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) differ += a.data<bf16>()[i].bits != b.data<bf16>()[i].bits;
  return differ;
}

TEST(CommNvlinkEarlyCounts, SameBitsAsTheDefaultEagerAndGraphed) {
  on_ranks([&] {
    const int me = world().rank();
    for (const Mode mode : {Mode::low_latency, Mode::normal}) {
      for (const EarlyCase& k : early_cases()) {
        const MoeConfig c = test_config(k.max_tokens, k.deepseek);
        const std::string what =
            fmt::format("{}, {}", k.what, mode == Mode::normal ? "normal" : "low latency");
        SCOPED_TRACE(what);
        const DispatcherContext ctx{c, mode, k.format, me, 1};
        auto d = mode == Mode::normal ? make_nvlink_dispatcher(ctx, world_ptr())
                                      : make_nvlink_ll_dispatcher(ctx, world_ptr());
        const auto tokens = per_rank(k.tokens);
        const std::int64_t T = tokens[static_cast<std::size_t>(me)];
        const cuda::DeviceTensor y_dev(DType::bf16, {T, c.hidden});
        const TensorView yv = y_dev.view();
        // The last call's outputs: the buffers every call of `d` writes, poisoned before the next call so
        // that a path that writes nothing cannot pass on the other path's bytes (both paths get the same
        // inputs, so the same extents). (This test runs on launched ranks only: no loopback meets.)
        DispatchOutput last;
        // One dispatch (eager) and the combine of its stand-in expert outputs.
        auto round = [&](const DeviceInput& dev, const std::string& early) {
          const ScopedEnv env("EPMOE_COMM_LL_EARLY_COUNTS", early);
          const DispatchInput view = dev.view();
          std::vector<DispatchOutput> out(1);
          poison_outputs(last);
          d->dispatch({&view, 1}, out);
          last = out[0];
          HostOutput host = download(out[0], stream());
          const cuda::DeviceTensor eo_dev = cuda::to_device(fake_expert_out(host.view, c), stream());
          const TensorView eo = eo_dev.view();
          y_dev.fill_bytes(0xff, stream());
          d->combine({&eo, 1}, {&yv, 1});
          world().synchronize(CommPhase::none, "the combine");
          return std::make_pair(std::move(host), cuda::to_host(y_dev, stream()));
        };
        const auto in = make_inputs(c, k.format, tokens, 50, k.routing);
        DeviceInput dev = to_device(in[static_cast<std::size_t>(me)], stream());
        // default, early, default, early: the parities and the tagged words' sequence numbers move
        // on between the two paths.
        for (int rep = 0; rep < 2; ++rep) {
          const auto want = round(dev, "0");
          const auto got = round(dev, "1");
          expect_same_dispatch(got.first.view, want.first.view, what + ": early vs default dispatch");
          EXPECT_EQ(bits_differ(got.second, want.second), 0)
              << what << ": early vs default combine, rep " << rep;
        }
        if (mode == Mode::low_latency) {
          std::vector<DispatchOutput> out(1);
          const cuda::Graph graph = [&] {
            const ScopedEnv env("EPMOE_COMM_LL_EARLY_COUNTS", "1");
            const DispatchInput view = dev.view();
            return cuda::Graph::capture(stream(), [&] { d->dispatch({&view, 1}, out); });
          }();
          for (int replay = 0; replay < 3; ++replay) {
            SCOPED_TRACE(fmt::format("graph replay {}", replay));
            const auto next = make_inputs(c, k.format, tokens, 60u + static_cast<unsigned>(replay),
                                          replay == 1 ? Routing::same_experts : k.routing);
            poison_outputs(last);  // (low latency: the masked extents do not depend on the inputs)
            copy_into(dev, next[static_cast<std::size_t>(me)], stream());
            graph.launch(stream());
            last = out[0];
            const HostOutput graphed = download(out[0], stream());
            const cuda::DeviceTensor eo_dev = cuda::to_device(fake_expert_out(graphed.view, c), stream());
            const TensorView eo = eo_dev.view();
            y_dev.fill_bytes(0xff, stream());
            d->combine({&eo, 1}, {&yv, 1});
            world().synchronize(CommPhase::none, "the combine after the graph");
            const HostTensor y_graphed = cuda::to_host(y_dev, stream());
            const auto want = round(dev, "0");
            expect_same_dispatch(graphed.view, want.first.view, what + ": graphed early vs default dispatch");
            EXPECT_EQ(bits_differ(y_graphed, want.second), 0) << what << ": graphed early vs default combine";
          }
        }
        world().barrier();  // every rank is done before the dispatcher (its window) goes
      }
    }
  });
}

// Early counts, refusals and a missing peer: a rank whose host refuses its input (too many tokens)
// still writes the tagged status, so its peers report the refusal instead of timing out; an id out
// of range (refused on the device) is reported on every rank and the next call works; a peer that
// never dispatches is place's bounded wait on the tagged words, naming it.
TEST(CommNvlinkEarlyCounts, RefusalsAndAMissingPeerAreReported) {
  on_ranks([&] {
    const int N = world().size(), me = world().rank();
    if (N < 2) return;
    const ScopedEnv early("EPMOE_COMM_LL_EARLY_COUNTS", "1");
    {
      const MoeConfig c = test_config(32);
      auto d = make(Transport::nvlink_ll, c, ActivationFormat::fp8_group);
      const auto in = make_inputs(c, ActivationFormat::fp8_group,
                                  per_rank([](int r) { return r == 0 ? 33 : 10; }), 70, Routing::random);
      expect_rank0_too_many_reported(dispatch_error(*d, in[static_cast<std::size_t>(me)]));
      world().reset_device_errors();
      world().barrier();
    }
    world().barrier();
    for (const Transport t : {Transport::nvlink_ll, Transport::nvlink_normal}) {
      SCOPED_TRACE(name_of(t));
      const MoeConfig c = test_config(64);
      auto d = make(t, c, ActivationFormat::fp8_group);
      const int bad = N - 1;
      auto in = make_inputs(c, ActivationFormat::fp8_group, per_rank([](int r) { return 40 + r; }), 71,
                            Routing::random);
      in[static_cast<std::size_t>(bad)].ids.data<std::int32_t>()[5] = c.num_physical_experts();
      const std::string m = dispatch_error(*d, in[static_cast<std::size_t>(me)]);
      EXPECT_NE(m.find(fmt::format("rank {} refused its input", bad)), std::string::npos) << m;
      EXPECT_NE(m.find("out of range"), std::string::npos) << m;
      world().reset_device_errors();
      world().barrier();
      check_round(*d, c, ActivationFormat::fp8_group,
                  make_inputs(c, ActivationFormat::fp8_group, per_rank([](int r) { return ramp(r, 50, 1); }),
                              72, Routing::random),
                  name_of(t) + ", early counts after a refusal");
      world().barrier();
    }
    const double saved = world().timeout_s();
    world().set_timeout_s(0.5);
    {
      const MoeConfig c = test_config(32);
      auto d = make(Transport::nvlink_ll, c, ActivationFormat::fp8_group);
      if (me == 0) {
        const auto in = make_inputs(c, ActivationFormat::fp8_group, per_rank([](int) { return 10; }), 73,
                                    Routing::random);
        const std::string m = dispatch_error(*d, in[0]);  // the other ranks never dispatch
        expect_recoverable_dispatch_timeout(m);
      }
      world().set_timeout_s(saved);
      world().barrier();
    }
    world().barrier();
  });
}

// ---------------------------------------------------------------- the communicator itself
TEST(CommWorld, BarrierAndASymmetricWindowThatEveryRankWritesInto) {
  on_ranks([&] {
    const int N = world().size(), me = world().rank();
    world().barrier();
    auto buf = world().alloc_symmetric(std::size_t{1} << 20);
    EXPECT_GE(buf->size(), std::size_t{1} << 20);
    EXPECT_GE(world().lsa_size(), 1);
    std::printf("  LSA team: rank %d of %d (world %d)\n", world().lsa_rank(), world().lsa_size(), N);
    if (!world().all_ranks_lsa()) return;
    const std::int32_t mine = 1000 + me;
    for (int d = 0; d < N; ++d) {
      ASSERT_NE(buf->peer_pointer(d), nullptr);
      EPMOE_CUDA_CHECK(
          cudaMemcpy(static_cast<char*>(buf->peer_pointer(d)) + 4 * me, &mine, 4, cudaMemcpyHostToDevice));
    }
    world().barrier();
    std::vector<std::int32_t> got(static_cast<std::size_t>(N));
    EPMOE_CUDA_CHECK(
        cudaMemcpy(got.data(), buf->local(), 4 * static_cast<std::size_t>(N), cudaMemcpyDeviceToHost));
    for (int r = 0; r < N; ++r)
      EXPECT_EQ(got[static_cast<std::size_t>(r)], 1000 + r) << "written by rank " << r;
    world().barrier();
  });
}

// Loopback ranks (one GPU): a symmetric buffer that one rank drops first stays allocated until every
// rank has dropped it, so a peer's kernels may still write into it (as they may after that rank failed
// and unwound: in session 22's loopback failure a freed window under the peer's kernels faulted the
// shared context, and every later test failed with it); the memory is freed once the last rank
// drops it. Whether an address is still allocated is asked of the driver for this process: the device's
// free memory would also count the other processes that ctest runs beside this one.
TEST(CommWorld, ALoopbackWindowOutlivesTheRankThatDropsItFirst) {
  on_ranks([&] {
    const int N = world().size(), me = world().rank();
    if (!world().loopback() || N < 2) return;  // (NCCL windows: destruction is collective)
    constexpr std::size_t kBytes = std::size_t{64} << 20;
    const auto memory_type = [](const void* p) {
      cudaPointerAttributes attributes{};
      EPMOE_CUDA_CHECK(cudaPointerGetAttributes(&attributes, p));
      return attributes.type;
    };
    auto buf = world().alloc_symmetric(kBytes);
    void* const rank0_window = buf->peer_pointer(0);
    if (me == 0) buf.reset();  // rank 0 drops it first
    world().barrier();
    if (me == N - 1) {  // a peer still writes into rank 0's window
      EXPECT_EQ(memory_type(rank0_window), cudaMemoryTypeDevice)
          << "rank 0's window was freed under its peers";
      EPMOE_CUDA_CHECK(cudaMemsetAsync(rank0_window, 0x5a, kBytes, stream()));
      world().synchronize(CommPhase::none, "a write into a window its rank dropped");
    }
    world().barrier();
    buf.reset();
    world().barrier();
    // No rank allocates between the last drop and this look (they wait at the barrier below).
    if (me == 0) {
      EXPECT_EQ(memory_type(rank0_window), cudaMemoryTypeUnregistered)
          << "rank 0's window is still allocated after every rank dropped it";
    }
    world().barrier();
  });
}

}  // namespace
}  // namespace epmoe::ranks
