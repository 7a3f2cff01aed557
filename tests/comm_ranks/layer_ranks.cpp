// The GPU layer on every rank of the world communicator (issue 7): each rank's output against the
// CPU reference (mirror numerics, routed from the GPU's logits) at DeepSeek-V3 dims and the tiny
// model, low-latency eager and graph replay (identical bits), both modes with and without two-batch
// overlap (identical bits; W4A8 low latency: both against the reference, its kernel choice follows the
// micro-batch size), graph replay after a rebalance that moves experts, the nccl-p2p transport, and the
// layer on an engine's own NCCL communicator (Communicator::borrow).
#include <gtest/gtest.h>

#include <cstdio>
#include <memory>
#include <optional>

#include <nccl.h>

#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/layer.hpp"
#include "epmoe/cuda/synthetic.hpp"
#include "epmoe/layer.hpp"
#include "expect_error.hpp"
#include "gpu_test_util.hpp"
#include "layer/layer_test_util.hpp"
#include "ranks_util.hpp"

namespace epmoe::ranks {
namespace {

using cuda::DeviceTensor;

using Out = testing::LayerForward;

// A forward on every rank, with the ranks meeting around everything that may wait for the whole
// device. With loopback ranks (one GPU) a rank blocked in such a call while a peer's dispatch already
// waits for it deadlocks until the peer's timeout: cudaFree synchronizes the device, allocations,
// memsets and same-device copies may (CUDA's implicit synchronization), and so may ending a capture
// or instantiating a graph. So: a graph forward captures (once per batch size); x and y are allocated
// and filled; then the ranks meet; after the forward they meet before the buffers are freed (no
// rank's kernels may still read a peer's data) and again after (no rank starts its next dispatch
// while a peer is in cudaFree).
// kind: the eager forward's batch kind (auto-mode layers).
Out layer_forward(cuda::GpuMoeLayer& layer, const HostTensor& x, bool graph,
                  std::optional<BatchKind> kind = std::nullopt) {
  if (graph) {
    const std::int64_t sizes[] = {x.size(0)};
    layer.capture_graphs(sizes);
  }
  const auto meet = [] { world().barrier(); };
  Out out = testing::layer_forward(layer, x, graph, meet, meet, kind);
  world().barrier();
  return out;
}

// One eager forward of a layer that is then destroyed (its frees as in layer_forward).
Out forward_and_destroy(std::unique_ptr<cuda::GpuMoeLayer> layer, const HostTensor& x) {
  Out out = layer_forward(*layer, x, false);
  layer.reset();
  world().barrier();
  return out;
}

// A rebalance on every rank, then a barrier: moving the weights may free memory (see layer_forward).
int rebalance(cuda::GpuMoeLayer& layer) {
  const int rewritten = layer.rebalance();
  world().barrier();
  return rewritten;
}

void expect_reference(const ModelWeights& w, const HostTensor& x, const Out& o, const char* what) {
  testing::expect_matches_reference(w, x, o,
                                    std::string(what) + " on rank " + std::to_string(world().rank()));
}

// A timed two-batch-overlap forward's spans follow the streams' order: each micro-batch's GEMMs start
// after its dispatch ends (on the compute stream) and its combine after its GEMMs.
void expect_overlap_spans(const cuda::GpuForwardSpans& sp) {
  EXPECT_TRUE(sp.gemm_on_compute_stream);
  for (std::size_t part = 0; part < 2; ++part) {
    SCOPED_TRACE("micro-batch " + std::to_string(part));
    EXPECT_GE(sp.dispatch[part][0], sp.route[1]);
    EXPECT_LE(sp.dispatch[part][0], sp.dispatch[part][1]);
    EXPECT_GE(sp.gemm[part][0], sp.dispatch[part][1]);
    EXPECT_LE(sp.gemm[part][0], sp.gemm[part][1]);
    EXPECT_GE(sp.combine[part][0], sp.gemm[part][1]);
    EXPECT_LE(sp.combine[part][1], sp.total[1]);
  }
}

using testing::same_bits;

// Test parameters: "preset/quant".
std::string_view preset_of(std::string_view p) {
  return p.substr(0, p.find('/'));
}
QuantScheme quant_of(std::string_view p) {
  return parse_quant(p.substr(p.find('/') + 1));
}

MoeConfig config_for(std::string_view param, int redundant, int max_tokens) {
  MoeConfig c = MoeConfig::preset(preset_of(param));
  c.quant = quant_of(param);
  c.num_ranks = world().size();
  c.num_redundant_experts = redundant;
  c.max_tokens_per_rank = max_tokens;
  c.validate();
  return c;
}

std::shared_ptr<SyntheticWeights> weights_for(const MoeConfig& c) {
  auto w = std::make_shared<SyntheticWeights>(c, input_seed(17));
  w->set_expert_factory(cuda::gpu_expert_factory(world().device()));
  return w;
}

// The low-latency tests' model: DeepSeek-V3 dims with 32 redundant slots and 8 tokens per rank, or
// the tiny model with 4 and 32.
MoeConfig low_latency_config(std::string_view param) {
  const bool big = preset_of(param) == "deepseek-v3";
  return config_for(param, big ? 32 : 4, big ? 8 : 32);
}

// A layer on this rank, then a barrier: its set-up frees memory, and cudaFree waits for every kernel
// of the process (with loopback ranks, a peer's first dispatch waiting for this rank).
std::unique_ptr<cuda::GpuMoeLayer> make_layer(const std::shared_ptr<SyntheticWeights>& w,
                                              const cuda::GpuLayerOptions& o) {
  auto layer = std::make_unique<cuda::GpuMoeLayer>(w, o, world_ptr());
  world().barrier();
  return layer;
}
std::unique_ptr<cuda::GpuMoeLayer> make_layer(const std::shared_ptr<SyntheticWeights>& w, Mode mode,
                                              bool tbo = false, std::int64_t max_tokens = 0,
                                              bool whole_dispatch = false) {
  cuda::GpuLayerOptions o;
  o.mode = mode;
  o.tbo = tbo;
  o.max_tokens = max_tokens;
  o.whole_dispatch = whole_dispatch;
  return make_layer(w, o);
}

class LayerRanks : public ::testing::TestWithParam<const char*> {};

// A placement that one rank's slots cannot take is installed on no rank (a rank left on the old tables
// would route unlike the others): that rank's error is the refusal, every other rank's names it, and
// each keeps its placement and its output bits.
TEST(LayerRanksPlacement, ARefusalOnOneRankKeepsEveryRanksPlacement) {
  on_ranks([] {
    const MoeConfig c = config_for("tiny/fp8", 4, 32);
    auto w = std::make_shared<testing::RefusingWeights>(weights_for(c));
    auto layer = std::make_unique<cuda::GpuMoeLayer>(w, cuda::GpuLayerOptions{}, world_ptr());
    world().barrier();
    const HostTensor x = synthetic_tokens(c, input_seed(31), world().rank(), 16);
    const Out before = layer_forward(*layer, x, false);
    expect_reference(*w, x, before, "before the refused placement");
    const std::vector<std::int32_t> initial = layer->placement().phy2log();
    // Every logical expert in the reverse slot order; rank 0 refuses the expert of its middle slot.
    const int E = c.num_experts, P = c.num_physical_experts(), L = P / world().size();
    std::vector<std::int32_t> phy2log(static_cast<std::size_t>(P));
    for (int s = 0; s < P; ++s) phy2log[static_cast<std::size_t>(s)] = E - 1 - s % E;
    const ExpertPlacement reversed(phy2log, E, world().size());
    if (world().rank() == 0) {
      w->refuse_once = phy2log[static_cast<std::size_t>(L / 2)];
      ASSERT_NE(initial[static_cast<std::size_t>(L / 2)], w->refuse_once);
    }
    const std::string message = testing::message_of([&] { layer->set_placement(reversed); });
    world().barrier();
    if (world().rank() == 0) {
      EXPECT_NE(message.find("refused by the test"), std::string::npos) << message;
      EXPECT_EQ(w->refuse_once, -1) << "the refused expert was never read: the test checks nothing";
    } else {
      EXPECT_NE(message.find("another rank's expert slots could not take the new placement"),
                std::string::npos)
          << message;
    }
    EXPECT_EQ(layer->placement().phy2log(), initial);
    EXPECT_TRUE(same_bits(layer_forward(*layer, x, false).y, before.y)) << "after the refusal";
    layer.reset();
    world().barrier();
  });
}

TEST_P(LayerRanks, LowLatencyEagerAndGraphMatchTheReference) {
  on_ranks([&] {
    const MoeConfig c = low_latency_config(GetParam());
    auto w = weights_for(c);
    const auto layer_ptr = make_layer(w, Mode::low_latency);
    cuda::GpuMoeLayer& layer = *layer_ptr;
    // Different token counts per rank, one rank with a single token.
    const std::int64_t T = world().rank() == 0 ? 1 : c.max_tokens_per_rank - world().rank();
    const HostTensor x = synthetic_tokens(c, input_seed(33), world().rank(), T);
    const Out eager = layer_forward(layer, x, false);
    expect_reference(*w, x, eager, "low-latency eager");
    EXPECT_TRUE(same_bits(layer_forward(layer, x, true).y, eager.y))
        << "graph capture + replay differs from eager";
    EXPECT_TRUE(same_bits(layer_forward(layer, x, true).y, eager.y))
        << "second graph replay differs from eager";
    // A rebalance moves experts between slots in place; the captured graph stays valid. On one rank
    // the result keeps its bits (tests/layer). Across ranks it cannot: combine sends one bf16 partial
    // sum per (token, rank) (design.md §6), so an expert that changes rank changes which products are
    // summed before that rounding. What must hold: graph replay = eager with the new placement, both
    // within tolerance of the reference, and close to the result before.
    const int rewritten = rebalance(layer);
    const Out after = layer_forward(layer, x, false);
    expect_reference(*w, x, after, "low-latency eager after a rebalance");
    EXPECT_TRUE(same_bits(layer_forward(layer, x, true).y, after.y))
        << "graph replay after a rebalance (" << rewritten << " slots rewritten) differs from eager";
    const ErrorReport drift = compare(after.y, eager.y);
    EXPECT_EQ(drift.non_finite, 0);
    EXPECT_LE(drift.rel_l2, 1e-2) << "the result moved more than bf16 partial-sum rounding explains";
    if (rewritten == 0) {
      EXPECT_TRUE(same_bits(after.y, eager.y)) << "no slot moved, yet the result changed";
    }
  });
}

// Repeated calls give the same bits, eager and replayed alike (the sums of the combine are in a fixed
// order; nothing depends on which rank's kernels run first).
TEST_P(LayerRanks, LowLatencyRepeatedCallsGiveTheSameBits) {
  on_ranks([&] {
    const MoeConfig c = low_latency_config(GetParam());
    auto w = weights_for(c);
    const auto layer_ptr = make_layer(w, Mode::low_latency);
    cuda::GpuMoeLayer& layer = *layer_ptr;
    const std::int64_t T = c.max_tokens_per_rank - world().rank();
    const HostTensor x = synthetic_tokens(c, input_seed(34), world().rank(), T);
    const Out first = layer_forward(layer, x, false);
    // The repeats are compared with this one alone: a forward that wrote nothing (the poison left) would
    // repeat its bits too.
    expect_reference(*w, x, first, "low-latency eager");
    for (int i = 0; i < 3; ++i)
      EXPECT_TRUE(same_bits(layer_forward(layer, x, false).y, first.y))
          << "eager call " << i + 2 << " differs";
    const Out replay = layer_forward(layer, x, true);
    for (int i = 0; i < 3; ++i)
      EXPECT_TRUE(same_bits(layer_forward(layer, x, true).y, replay.y)) << "replay " << i + 2 << " differs";
    EXPECT_TRUE(same_bits(replay.y, first.y)) << "graph replay differs from eager";
  });
}

// GpuLayerOptions::whole_dispatch: the dispatcher's whole call instead of its halves gives the same
// bits, in both modes, eager and (low latency) replayed.
TEST_P(LayerRanks, WholeDispatchCallGivesTheSameBitsAsTheHalves) {
  on_ranks([&] {
    for (const Mode mode : {Mode::low_latency, Mode::normal}) {
      SCOPED_TRACE(mode == Mode::normal ? "normal" : "low latency");
      const bool ll = mode == Mode::low_latency;
      const MoeConfig c = ll ? low_latency_config(GetParam()) : config_for(GetParam(), 4, 128);
      auto w = weights_for(c);
      const std::int64_t T = ll ? c.max_tokens_per_rank - 1 - world().rank() : 60 + 9 * world().rank();
      const HostTensor x = synthetic_tokens(c, input_seed(38), world().rank(), T);
      const Out halves = forward_and_destroy(make_layer(w, mode, false, ll ? 0 : 128), x);
      const auto layer_ptr = make_layer(w, mode, false, ll ? 0 : 128, /*whole_dispatch=*/true);
      const Out whole = layer_forward(*layer_ptr, x, false);
      EXPECT_TRUE(same_bits(whole.y, halves.y)) << "the whole dispatch call changes the result";
      expect_reference(*w, x, whole, "whole dispatch call");
      if (ll) {
        EXPECT_TRUE(same_bits(layer_forward(*layer_ptr, x, true).y, halves.y))
            << "graph replay of the whole dispatch call differs";
      }
    }
  });
}

TEST_P(LayerRanks, LowLatencyTwoBatchOverlapMatchesWithout) {
  on_ranks([&] {
    const MoeConfig c = low_latency_config(GetParam());
    auto w = weights_for(c);
    // Odd token counts (micro-batches of different sizes), and one rank whose second micro-batch is empty.
    const std::int64_t T = world().rank() == 0 ? 1 : c.max_tokens_per_rank - world().rank();
    const HostTensor x = synthetic_tokens(c, input_seed(37), world().rank(), T);
    const Out plain = forward_and_destroy(make_layer(w, Mode::low_latency), x);
    const auto layer_ptr = make_layer(w, Mode::low_latency, /*tbo=*/true);
    cuda::GpuMoeLayer& layer = *layer_ptr;
    layer.set_timing(true);
    const Out tbo = layer_forward(layer, x, false);
    layer.set_timing(false);
    expect_overlap_spans(layer.last_spans());
    expect_reference(*w, x, tbo, "low-latency two-batch overlap");
    // Each token's rows meet the same experts on the same ranks either way: the same bits where the
    // GEMMs run the same kernels. W4A8 picks its kernel by the expected rows per expert (the 16/32-row
    // tile kernel up to 24), which a micro-batch halves (at 4 ranks it switches at the tiny dims):
    // there both outputs match the reference instead (above, and the plain one in the eager test).
    if (quant_of(GetParam()) == QuantScheme::fp8) {
      EXPECT_TRUE(same_bits(tbo.y, plain.y)) << "two-batch overlap changes the low-latency result";
    }
    EXPECT_TRUE(same_bits(layer_forward(layer, x, true).y, tbo.y))
        << "graph replay with two-batch overlap differs";
    EXPECT_TRUE(same_bits(layer_forward(layer, x, true).y, tbo.y)) << "second graph replay differs";
  });
}

TEST_P(LayerRanks, NormalWithAndWithoutTwoBatchOverlapMatchTheReference) {
  on_ranks([&] {
    const bool big = preset_of(GetParam()) == "deepseek-v3";
    const MoeConfig c = config_for(GetParam(), big ? 32 : 4, 128);
    auto w = weights_for(c);
    const std::int64_t T = big ? 6 + world().rank() : 100 + 7 * world().rank();
    const HostTensor x = synthetic_tokens(c, input_seed(35), world().rank(), T);
    const Out plain = forward_and_destroy(make_layer(w, Mode::normal, false, 128), x);
    expect_reference(*w, x, plain, "normal");
    const auto layer_ptr = make_layer(w, Mode::normal, /*tbo=*/true, 128);
    cuda::GpuMoeLayer& layer = *layer_ptr;
    layer.set_timing(true);
    const Out tbo = layer_forward(layer, x, false);
    layer.set_timing(false);
    expect_overlap_spans(layer.last_spans());
    EXPECT_TRUE(same_bits(tbo.y, plain.y)) << "two-batch overlap changes the result";
    EXPECT_TRUE(same_bits(layer_forward(layer, x, false).y, plain.y))
        << "a repeated overlapped forward differs";
  });
}

// Normal mode without a host sync (GpuLayerOptions::normal_host_sync = false): the runner gets the
// contiguous layout at its bound and skips the rows past the last expert block: the same bits.
TEST_P(LayerRanks, NormalWithoutAHostSyncGivesTheSameBits) {
  on_ranks([&] {
    const bool big = preset_of(GetParam()) == "deepseek-v3";
    const MoeConfig c = config_for(GetParam(), big ? 32 : 4, 128);
    auto w = weights_for(c);
    const std::int64_t T = big ? 7 + world().rank() : 90 + 5 * world().rank();
    const HostTensor x = synthetic_tokens(c, input_seed(43), world().rank(), T);
    const Out exact = forward_and_destroy(make_layer(w, Mode::normal, false, 128), x);
    // The forwards without the sync are compared with this one alone: it must be right itself.
    expect_reference(*w, x, exact, "normal with a host sync");
    cuda::GpuLayerOptions o;
    o.mode = Mode::normal;
    o.max_tokens = 128;
    o.normal_host_sync = false;
    const auto layer = make_layer(w, o);
    const Out bound = layer_forward(*layer, x, false);
    EXPECT_TRUE(same_bits(bound.y, exact.y)) << "normal mode without a host sync changes the result";
    EXPECT_TRUE(same_bits(layer_forward(*layer, x, false).y, exact.y)) << "a repeated forward differs";
  });
}

// One layer in auto mode on every rank: prefill batches through the normal-mode dispatcher, decode
// batches through the low-latency one, each with the bits of a layer of that mode; decode replayed.
TEST_P(LayerRanks, AutoModeGivesEachBatchKindItsModesBits) {
  on_ranks([&] {
    const bool big = preset_of(GetParam()) == "deepseek-v3";
    const MoeConfig c = low_latency_config(GetParam());
    auto w = weights_for(c);
    const std::int64_t prefill_max = 128;
    const std::int64_t T_prefill = big ? 9 + world().rank() : 60 + 9 * world().rank();
    const std::int64_t T_decode = c.max_tokens_per_rank - world().rank();
    const HostTensor xp = synthetic_tokens(c, input_seed(41), world().rank(), T_prefill);
    const HostTensor xd = synthetic_tokens(c, input_seed(42), world().rank(), T_decode);
    const Out normal = forward_and_destroy(make_layer(w, Mode::normal, false, prefill_max), xp);
    const Out low_latency = forward_and_destroy(make_layer(w, Mode::low_latency), xd);
    const auto layer_ptr = make_layer(w, Mode::automatic, false, prefill_max);
    cuda::GpuMoeLayer& layer = *layer_ptr;
    const Out prefill = layer_forward(layer, xp, false, BatchKind::prefill);
    expect_reference(*w, xp, prefill, "auto mode, prefill");
    EXPECT_TRUE(same_bits(prefill.y, normal.y)) << "auto mode's prefill differs from normal mode";
    const Out decode = layer_forward(layer, xd, false, BatchKind::decode);
    expect_reference(*w, xd, decode, "auto mode, decode");
    EXPECT_TRUE(same_bits(decode.y, low_latency.y)) << "auto mode's decode differs from low-latency mode";
    EXPECT_TRUE(same_bits(layer_forward(layer, xd, true).y, low_latency.y))
        << "auto mode's decode graph differs";
    EXPECT_TRUE(same_bits(layer_forward(layer, xp, false, BatchKind::prefill).y, normal.y))
        << "a prefill forward after the graph differs";
    EXPECT_TRUE(same_bits(layer_forward(layer, xd, true).y, low_latency.y))
        << "the decode graph replayed after a prefill forward differs";
  });
}

// The budget DeepEP's users ask of decode (bench/NOTES.md's standing: 0.287-0.297 GB measured at 2 ranks):
// communication + layout buffers at most 0.5 GB per rank for DeepSeek-V3 at 128 tokens per rank in
// low-latency mode, with the seed's 32 redundant slots. (The tiny model's instances hold far less; the
// check is the DeepSeek-V3 ones'.) A layer is made, not run: the buffers are sized at construction.
TEST_P(LayerRanks, LowLatencyBuffersAtHalfAGigabytePerRank) {
  on_ranks([&] {
    const MoeConfig c = config_for(GetParam(), 32, 128);
    auto w = weights_for(c);
    const auto layer_ptr = make_layer(w, Mode::low_latency);
    const double gb = static_cast<double>(layer_ptr->comm_layout_bytes()) / 1e9;
    std::printf(
        "    rank %d: communication + layout buffers %.3f GB (all device memory of the layer %.3f GB)\n",
        world().rank(), gb, static_cast<double>(layer_ptr->device_bytes()) / 1e9);
    EXPECT_GT(gb, 0.0);
    EXPECT_LE(gb, 0.5) << "communication + layout buffers per rank at 128 tokens per rank, low latency";
  });
}

// The portable transport in the layer (GpuLayerOptions::dispatcher = "nccl-p2p", as across nodes):
// the bits of the NVLink dispatchers that "auto" picks here, low latency eager, replayed and with
// two-batch overlap (the send / receive halves), normal mode with and without the host sync.
TEST(LayerNcclP2p, GivesTheBitsOfTheNvlinkDispatchers) {
  on_ranks([&] {
    if (world().size() < 2) return;  // one rank: the local dispatcher
    const MoeConfig c = low_latency_config("tiny/fp8");
    auto w = weights_for(c);
    const HostTensor xd =
        synthetic_tokens(c, input_seed(44), world().rank(), c.max_tokens_per_rank - world().rank());
    const HostTensor xp = synthetic_tokens(c, input_seed(45), world().rank(), 60 + 9 * world().rank());
    auto options = [](Mode mode, const char* dispatcher, bool tbo = false, bool host_sync = true) {
      cuda::GpuLayerOptions o;
      o.mode = mode;
      o.dispatcher = dispatcher;
      o.tbo = tbo;
      o.normal_host_sync = host_sync;
      o.max_tokens = mode == Mode::normal ? 128 : 0;
      return o;
    };
    const Out decode = forward_and_destroy(make_layer(w, options(Mode::low_latency, "auto")), xd);
    const Out prefill = forward_and_destroy(make_layer(w, options(Mode::normal, "auto")), xp);
    for (const bool tbo : {false, true}) {
      SCOPED_TRACE(tbo ? "low latency, two-batch overlap" : "low latency");
      auto layer = make_layer(w, options(Mode::low_latency, "nccl-p2p", tbo));
      const Out eager = layer_forward(*layer, xd, false);
      expect_reference(*w, xd, eager, "nccl-p2p low latency");
      EXPECT_TRUE(same_bits(eager.y, decode.y)) << "nccl-p2p differs from nvlink-ll";
      EXPECT_TRUE(same_bits(layer_forward(*layer, xd, true).y, decode.y)) << "graph replay differs";
      EXPECT_TRUE(same_bits(layer_forward(*layer, xd, true).y, decode.y)) << "second graph replay differs";
      layer.reset();
      world().barrier();
    }
    for (const bool host_sync : {true, false}) {
      SCOPED_TRACE(host_sync ? "normal" : "normal without a host sync");
      const Out got =
          forward_and_destroy(make_layer(w, options(Mode::normal, "nccl-p2p", false, host_sync)), xp);
      expect_reference(*w, xp, got, "nccl-p2p normal");
      EXPECT_TRUE(same_bits(got.y, prefill.y)) << "nccl-p2p differs from nvlink";
    }
  });
}

// An inference engine brings its own NCCL communicator (issue 6): here one split off the world's, lent
// to the layer through Communicator::borrow. The layer gives the bits it gives on the world's own
// communicator, eager and replayed; destroying the layer and the borrowing Communicator leaves the
// engine's communicator working (an all-reduce over it afterwards), and the engine destroys it.
// (NCCL ranks only: loopback ranks have no NCCL communicator to split.)
TEST(LayerNcclBorrowed, AnEnginesOwnCommunicatorGivesTheSameBits) {
  on_ranks([&] {
    const MoeConfig c = low_latency_config("tiny/fp8");
    auto w = weights_for(c);
    const std::int64_t T = c.max_tokens_per_rank - world().rank();
    const HostTensor x = synthetic_tokens(c, input_seed(39), world().rank(), T);
    const Out on_world = forward_and_destroy(make_layer(w, Mode::low_latency), x);
    // The borrowed communicator's forwards are compared with this one alone: it must be right itself.
    expect_reference(*w, x, on_world, "low latency on the world's communicator");

    // (A blocking engine communicator, also where the world's is nonblocking: EPMOE_COMM_NONBLOCKING=1.)
    ncclComm_t engine_comm = nullptr;
    ncclConfig_t engine_config = NCCL_CONFIG_INITIALIZER;
    engine_config.blocking = 1;
    world().complete_nccl(
        ncclCommSplit(world().nccl(), /*color=*/0, /*key=*/world().rank(), &engine_comm, &engine_config),
        "ncclCommSplit");
    ASSERT_NE(engine_comm, nullptr);
    {
      std::shared_ptr<Communicator> borrowed = Communicator::borrow(engine_comm);
      EXPECT_EQ(borrowed->rank(), world().rank());
      EXPECT_EQ(borrowed->size(), world().size());
      EXPECT_EQ(borrowed->device(), world().device());
      cuda::GpuLayerOptions o;
      o.mode = Mode::low_latency;
      auto layer = std::make_unique<cuda::GpuMoeLayer>(w, o, borrowed);
      world().barrier();
      EXPECT_TRUE(same_bits(layer_forward(*layer, x, false).y, on_world.y))
          << "eager on the borrowed communicator differs from the world's";
      EXPECT_TRUE(same_bits(layer_forward(*layer, x, true).y, on_world.y))
          << "graph replay on the borrowed communicator differs from the world's";
      layer.reset();
      world().barrier();
      borrowed.reset();  // (collective: its windows are deregistered)
    }
    const cuda::Stream stream;
    HostTensor ones(DType::f32, {4});
    for (int i = 0; i < 4; ++i) ones.data<float>()[i] = static_cast<float>(world().rank() + 1 + i);
    const cuda::DeviceTensor v = cuda::to_device(ones, stream);
    ASSERT_EQ(ncclAllReduce(v.data<float>(), v.data<float>(), 4, ncclFloat, ncclSum, engine_comm, stream),
              ncclSuccess);
    const HostTensor sum = cuda::to_host(v, stream);
    const int n = world().size();
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(sum.data<float>()[i], static_cast<float>(n * (n + 1) / 2 + n * i))
          << "the engine's communicator after the layer let it go, element " << i;
    }
    EXPECT_EQ(ncclCommDestroy(engine_comm), ncclSuccess);
    world().barrier();
  });
}

INSTANTIATE_TEST_SUITE_P(Models, LayerRanks,
                         ::testing::Values("tiny/fp8", "deepseek-v3/fp8", "tiny/w4a8", "deepseek-v3/w4a8"),
                         [](const auto& param_info) {
                           const std::string_view p = param_info.param;
                           return std::string(p[0] == 't' ? "tiny_" : "dsv3_") +
                                  std::string(p.substr(p.find('/') + 1));
                         });

}  // namespace
}  // namespace epmoe::ranks
