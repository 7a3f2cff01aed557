#include <chrono>

#include "dispatch/dispatch_common.hpp"
#include "epmoe/layer.hpp"
#include "layer/layer_common.hpp"

namespace epmoe {
namespace {

class PhaseTimer {
 public:
  explicit PhaseTimer(double* sink) : sink_(sink), start_(std::chrono::steady_clock::now()) {}
  ~PhaseTimer() {
    if (sink_)
      *sink_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_).count();
  }
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

 private:
  double* sink_;
  std::chrono::steady_clock::time_point start_;
};

int mode_index(Mode mode) {
  return mode == Mode::normal ? 0 : 1;
}

}  // namespace

MoeLayer::MoeLayer(std::shared_ptr<const ModelWeights> weights, LayerOptions options)
    : weights_(std::move(weights)), options_(std::move(options)) {
  EPMOE_CHECK(weights_ != nullptr, "MoeLayer needs weights");
  const MoeConfig& c = weights_->config();
  c.validate();
  EPMOE_CHECK(options_.device == Device::cpu,
              "MoeLayer runs on the CPU (device must be cpu); the GPU layer is epmoe::cuda::GpuMoeLayer");
  placement_ = ExpertPlacement::initial(c.num_experts, c.num_physical_experts(), c.num_ranks);
  expert_load_.assign(static_cast<std::size_t>(c.num_experts), 0);
  if (options_.dispatcher.empty()) options_.dispatcher = "cpu-sim";
  for (const Mode mode : {Mode::normal, Mode::low_latency}) {
    if (options_.mode != Mode::automatic && options_.mode != mode) continue;
    const int m = mode_index(mode);
    const DispatcherContext dc{c, mode, activation_format(c.quant), 0, c.num_ranks, options_.host_sync};
    dispatchers_[m] = make_dispatcher(options_.dispatcher, dc);
    runners_[m] = make_runner(options_.device, dispatchers_[m]->layout(),
                              RunnerContext{c, weights_.get(), &placement_, options_.numerics});
  }
}

MoeLayer::~MoeLayer() = default;

const MoeConfig& MoeLayer::config() const {
  return weights_->config();
}

void MoeLayer::set_placement(ExpertPlacement placement) {
  const MoeConfig& c = config();
  EPMOE_CHECK(placement.num_logical() == c.num_experts &&
                  placement.num_physical() == c.num_physical_experts() &&
                  placement.num_ranks() == c.num_ranks,
              "placement must have {} logical experts, {} slots and {} ranks, got {}, {} and {}",
              c.num_experts, c.num_physical_experts(), c.num_ranks, placement.num_logical(),
              placement.num_physical(), placement.num_ranks());
  placement_ = std::move(placement);  // in place: the runner holds a pointer to this member
}

void MoeLayer::rebalance(int nodes) {
  const MoeConfig& c = config();
  const std::vector<double> load(expert_load_.begin(), expert_load_.end());
  set_placement(rebalance_placement(placement_, load, c.num_groups, nodes));
  std::fill(expert_load_.begin(), expert_load_.end(), 0);
}

void MoeLayer::forward(std::span<const TensorView> x, std::span<const TensorView> y, ForwardStats* stats) {
  EPMOE_CHECK(options_.mode != Mode::automatic,
              "a layer in auto mode needs each forward's batch kind: forward(x, y, BatchKind::prefill or "
              "BatchKind::decode, stats)");
  forward_in(options_.mode, x, y, stats);
}

void MoeLayer::forward(std::span<const TensorView> x, std::span<const TensorView> y, BatchKind kind,
                       ForwardStats* stats) {
  forward_in(resolve_mode(options_.mode, kind), x, y, stats);
}

void MoeLayer::forward_in(Mode mode, std::span<const TensorView> x, std::span<const TensorView> y,
                          ForwardStats* stats) {
  const MoeConfig& c = config();
  Dispatcher& dispatcher = *dispatchers_[mode_index(mode)];
  Runner& runner = *runners_[mode_index(mode)];
  const int N = dispatcher.context().num_ranks_served;
  EPMOE_CHECK(static_cast<int>(x.size()) == N && static_cast<int>(y.size()) == N,
              "forward needs one x and one y per served rank ({}), got {} and {}", N, x.size(), y.size());
  const ActivationFormat format = activation_format(c.quant);
  PhaseTimes* times = stats ? &stats->times : nullptr;
  auto sink = [&](double PhaseTimes::*field) { return times ? &(times->*field) : nullptr; };

  for (int r = 0; r < N; ++r) {
    const std::string name = fmt::format("rank {} x", r);
    expect_rank(x[r], 2, name);
    expect_shape(x[r], {x[r].size(0), c.hidden}, name);
    expect_dtype(x[r], DType::bf16, name);
    expect_device(x[r], Device::cpu, name);
    expect_contiguous(x[r], name);
    expect_finite(x[r], name);
    const std::string yname = fmt::format("rank {} y", r);
    expect_shape(y[r], {x[r].size(0), c.hidden}, yname);
    expect_dtype(y[r], DType::bf16, yname);
    expect_host(y[r], yname);
    // Refused here, before any work (the dispatcher would refuse it later).
    detail::check_token_bound(dispatcher.context(), x[r].size(0), fmt::format("rank {} ", r));
  }

  std::vector<HostTensor> logical(static_cast<std::size_t>(N)), physical(static_cast<std::size_t>(N)),
      topk_weights(static_cast<std::size_t>(N));
  {
    PhaseTimer timer(sink(&PhaseTimes::route));
    for (int r = 0; r < N; ++r) {
      auto& ids = logical[static_cast<std::size_t>(r)];
      detail::route_tokens(*weights_, x[r], ids, topk_weights[static_cast<std::size_t>(r)]);
      physical[static_cast<std::size_t>(r)] = HostTensor(DType::i32, {x[r].size(0), c.topk});
      placement_.map_to_physical(ids, physical[static_cast<std::size_t>(r)], r, c.dispatch_algorithm);
    }
  }

  std::vector<detail::QuantizedTokens> quantized(static_cast<std::size_t>(N));
  std::vector<DispatchInput> inputs(static_cast<std::size_t>(N));
  {
    PhaseTimer timer(sink(&PhaseTimes::quantize));
    for (int r = 0; r < N; ++r) {
      auto& q = quantized[static_cast<std::size_t>(r)];
      q = detail::quantize_tokens(format, x[r], weights_->a1_scale(), c.power_of_two_scales);
      inputs[static_cast<std::size_t>(r)] = {q.x, q.scales, q.tensor_scale,
                                             physical[static_cast<std::size_t>(r)],
                                             topk_weights[static_cast<std::size_t>(r)]};
    }
  }

  std::vector<HostTensor> shared(static_cast<std::size_t>(N));
  if (c.num_shared_experts > 0) {
    PhaseTimer timer(sink(&PhaseTimes::shared));
    for (int r = 0; r < N; ++r) {
      shared[static_cast<std::size_t>(r)] = HostTensor(DType::bf16, {x[r].size(0), c.hidden});
      detail::shared_expert_forward(*weights_, x[r], shared[static_cast<std::size_t>(r)], options_.numerics);
    }
  }

  std::vector<DispatchOutput> outputs(static_cast<std::size_t>(N));
  {
    PhaseTimer timer(sink(&PhaseTimes::dispatch));
    dispatcher.dispatch(inputs, outputs);
  }

  std::vector<HostTensor> expert_out(static_cast<std::size_t>(N));
  std::vector<TensorView> expert_views(static_cast<std::size_t>(N));
  {
    PhaseTimer timer(sink(&PhaseTimes::experts));
    for (int r = 0; r < N; ++r) {
      auto& out = expert_out[static_cast<std::size_t>(r)];
      out = HostTensor(DType::bf16, {outputs[static_cast<std::size_t>(r)].num_output_rows(), c.hidden});
      runner.run(outputs[static_cast<std::size_t>(r)], out, r);
      expert_views[static_cast<std::size_t>(r)] = out;
    }
  }

  {
    PhaseTimer timer(sink(&PhaseTimes::combine));
    dispatcher.combine(expert_views, y);
    if (c.num_shared_experts > 0) {
      for (int r = 0; r < N; ++r) {
        bf16* yr = y[r].as<bf16>();
        const bf16* sr = shared[static_cast<std::size_t>(r)].data<bf16>();
        const std::int64_t n = y[r].numel();
        for (std::int64_t i = 0; i < n; ++i) yr[i] = bf16::from_float(yr[i].to_float() + sr[i].to_float());
      }
    }
  }
  for (int r = 0; r < N; ++r) expect_finite(y[r], fmt::format("rank {} {}", r, detail::kOverflowedOutput));

  // The load counters see only a forward that completed: one refused anywhere above leaves them as they were.
  for (const HostTensor& ids : logical) {
    const std::int32_t* id = ids.data<std::int32_t>();
    const std::int64_t n = ids.numel();
    for (std::int64_t i = 0; i < n; ++i) ++expert_load_[static_cast<std::size_t>(id[i])];
  }

  if (stats) {
    stats->mode = mode;
    const DispatchStats& ds = dispatcher.last_stats();
    stats->rows_per_rank = ds.rows_received;
    stats->bytes_sent = 0;
    for (std::int64_t b : ds.bytes_sent) stats->bytes_sent += b;
    for (int r = 0; r < N; ++r) stats->tokens += x[r].size(0);
  }
}

}  // namespace epmoe
