// "cpu-local": one rank, no communication. The output is the token-major input itself plus each
// (token, k)'s local expert; the combine is the weighted sum over k in f32.
#include <vector>

#include "dispatch/dispatch_common.hpp"

namespace epmoe {
namespace {

class CpuLocalDispatcher final : public Dispatcher {
 public:
  explicit CpuLocalDispatcher(const DispatcherContext& context) : context_(context) {
    EPMOE_CHECK(context.config.num_ranks == 1, "cpu-local serves exactly one rank, the config has ranks={}",
                context.config.num_ranks);
  }
  std::string name() const override { return "cpu-local"; }
  Layout layout() const override { return Layout::token_major; }
  const DispatcherContext& context() const override { return context_; }
  const DispatchStats& last_stats() const override { return stats_; }

  void dispatch(std::span<const DispatchInput> inputs, std::span<DispatchOutput> outputs) override {
    EPMOE_CHECK(inputs.size() == 1 && outputs.size() == 1,
                "cpu-local dispatch takes one input and one output");
    const DispatchInput& in = inputs[0];
    detail::validate_dispatch_input(context_, in, 0);
    const std::int64_t T = in.x.size(0);
    const int K = context_.config.topk;
    local_ids_ = HostTensor(DType::i32, {T, K});
    std::copy_n(in.topk_ids.as<std::int32_t>(), T * K,
                local_ids_.data<std::int32_t>());  // one rank: slot = local id
    // A copy: the caller may free its weights before the combine.
    weights_ = HostTensor(DType::f32, {T, K});
    std::copy_n(in.topk_weights.as<float>(), T * K, weights_.data<float>());
    DispatchOutput& out = outputs[0];
    out = DispatchOutput{};
    out.layout = Layout::token_major;
    out.format = context_.format;
    out.num_local_experts = context_.config.num_local_experts();
    out.num_recv_tokens = T;
    out.rows = in.x;
    out.scales = in.x_scales;
    out.tensor_scale = in.x_tensor_scale;
    out.local_ids = local_ids_;
    out.local_weights = weights_;
    stats_ = DispatchStats{{0}, {0}, {T * K}};
  }

  void combine(std::span<const TensorView> expert_out, std::span<const TensorView> y) override {
    EPMOE_CHECK(expert_out.size() == 1 && y.size() == 1,
                "cpu-local combine takes one expert output and one y");
    EPMOE_CHECK(local_ids_.defined(), "cpu-local combine needs a dispatch first");
    const std::int64_t T = local_ids_.size(0), H = context_.config.hidden;
    const int K = context_.config.topk;
    expect_host_tensor(expert_out[0], DType::bf16, {T * K, H}, "expert_out");
    expect_host_tensor(y[0], DType::bf16, {T, H}, "y");
    std::vector<float> acc(static_cast<std::size_t>(H));
    for (std::int64_t t = 0; t < T; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int k = 0; k < K; ++k)
        detail::accumulate_weighted_row(acc.data(), expert_out[0].as<bf16>() + (t * K + k) * H,
                                        weights_.data<float>()[t * K + k], H);
      for (std::int64_t h = 0; h < H; ++h)
        y[0].as<bf16>()[t * H + h] = bf16::from_float(acc[static_cast<std::size_t>(h)]);
    }
  }

 private:
  DispatcherContext context_;
  HostTensor local_ids_, weights_;
  DispatchStats stats_;
};

const DispatcherRegistry::Registration kRegistration{
    "cpu-local", [](const DispatcherContext& c) { return std::make_unique<CpuLocalDispatcher>(c); }};

}  // namespace
}  // namespace epmoe
