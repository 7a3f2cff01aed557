// The CPU runner backend: every layout, every quant scheme. Experts are looked up through the
// placement (local slot -> physical slot -> logical expert), exactly as a GPU runner addresses
// its weight slots.
#include <cstring>
#include <vector>

#include "epmoe/runner.hpp"

namespace epmoe {

std::string runner_key(Device device, Layout layout, QuantScheme quant) {
  return fmt::format("{}/{}/{}", device_name(device), to_string(layout), to_string(quant));
}

std::unique_ptr<Runner> make_runner(Device device, Layout layout, const RunnerContext& context) {
  EPMOE_CHECK(context.weights != nullptr, "RunnerContext.weights must be set");
  EPMOE_CHECK(context.placement != nullptr, "RunnerContext.placement must be set");
  return RunnerRegistry::instance().make(runner_key(device, layout, context.config.quant), context);
}

namespace {

class CpuRunner final : public Runner {
 public:
  CpuRunner(const RunnerContext& context, Layout layout) : context_(context), layout_(layout) {}
  std::string name() const override { return runner_key(Device::cpu, layout_, context_.config.quant); }

  void run(const DispatchOutput& in, TensorView out, int rank) override {
    const MoeConfig& cfg = context_.config;
    const std::int64_t H = cfg.hidden;
    EPMOE_CHECK(in.layout == layout_, "runner {} got a {} dispatch output", name(), to_string(in.layout));
    EPMOE_CHECK(in.format == activation_format(cfg.quant), "runner {} needs {} activations", name(),
                static_cast<int>(activation_format(cfg.quant)));
    EPMOE_CHECK(rank >= 0 && rank < cfg.num_ranks, "rank must be in [0, {}), got {}", cfg.num_ranks, rank);
    expect_dtype(out, DType::bf16, "out");
    expect_shape(out, {in.num_output_rows(), H}, "out");
    expect_host(out, "out");
    const int local_experts = cfg.num_local_experts();

    switch (layout_) {
      case Layout::token_major: {
        // Gather the (token, k) pairs of each local expert, run them as one batch, scatter back.
        const std::int64_t T = in.rows.size(0), K = cfg.topk;
        expect_host_tensor(in.local_ids, DType::i32, {T, K}, "local_ids");
        // Rows are copied out by pointer below: host, contiguous, H wide (the expert call checks only the
        // copies).
        expect_host_tensor(in.rows, in.rows.dtype, {T, H}, "rows");
        if (in.format == ActivationFormat::fp8_group)
          expect_host_tensor(in.scales, DType::f32, {T, H / 128}, "scales");
        std::vector<std::vector<std::int64_t>> pairs(static_cast<std::size_t>(local_experts));
        for (std::int64_t i = 0; i < T * K; ++i) {
          const std::int32_t j = in.local_ids.as<std::int32_t>()[i];
          EPMOE_CHECK(j >= -1 && j < local_experts, "local_ids[{}] must be in [-1, {}), got {}", i,
                      local_experts, j);
          if (j >= 0) pairs[static_cast<std::size_t>(j)].push_back(i);
        }
        for (int j = 0; j < local_experts; ++j) {
          const auto& list = pairs[static_cast<std::size_t>(j)];
          if (list.empty()) continue;
          const std::int64_t n = static_cast<std::int64_t>(list.size());
          HostTensor x(in.rows.dtype, {n, H}), scales(DType::f32, {n, H / 128}), y(DType::bf16, {n, H});
          const std::size_t row_bytes = static_cast<std::size_t>(H) * dtype_size(in.rows.dtype);
          for (std::int64_t r = 0; r < n; ++r) {
            const std::int64_t t = list[static_cast<std::size_t>(r)] / K;
            std::memcpy(static_cast<std::byte*>(x.view().data) + r * static_cast<std::int64_t>(row_bytes),
                        in.rows.select(t).data, row_bytes);
            if (in.format == ActivationFormat::fp8_group)
              std::memcpy(scales.data<float>() + r * (H / 128), in.scales.select(t).data,
                          (H / 128) * sizeof(float));
          }
          run_expert(rank, j, in, x, scales, y);
          for (std::int64_t r = 0; r < n; ++r)
            std::memcpy(out.select(list[static_cast<std::size_t>(r)]).data, y.view().select(r).data,
                        H * sizeof(bf16));
        }
        break;
      }
      case Layout::contiguous: {
        // Each expert's rows are one run of its index in m_indices (padding and, without a host sync,
        // everything past the last block is -1), so the runs are found without expert_offsets.
        expect_host_tensor(in.m_indices, DType::i32, {in.rows.size(0)}, "m_indices");
        const std::int32_t* m_indices = in.m_indices.as<std::int32_t>();
        const std::int64_t rows = in.m_indices.numel();
        for (std::int64_t begin = 0; begin < rows;) {
          const std::int32_t j = m_indices[begin];
          std::int64_t end = begin + 1;
          while (end < rows && m_indices[end] == j) ++end;
          if (j >= 0) {
            EPMOE_CHECK(j < local_experts, "m_indices[{}] = {} is out of range [0, {})", begin, j,
                        local_experts);
            run_expert(
                rank, j, in, in.rows.slice_rows(begin, end),
                in.format == ActivationFormat::fp8_group ? in.scales.slice_rows(begin, end) : TensorView{},
                out.slice_rows(begin, end));
          }
          begin = end;
        }
        break;
      }
      case Layout::masked: {
        const std::int64_t max_m = in.rows.size(1);
        expect_host_tensor(in.masked_m, DType::i32, {local_experts}, "masked_m");
        for (int j = 0; j < local_experts; ++j) {
          const std::int64_t m = in.masked_m.as<std::int32_t>()[j];
          EPMOE_CHECK(m >= 0 && m <= max_m, "masked_m[{}] must be in [0, {}], got {}", j, max_m, m);
          if (m == 0) continue;
          run_expert(
              rank, j, in, in.rows.select(j).slice_rows(0, m),
              in.format == ActivationFormat::fp8_group ? in.scales.select(j).slice_rows(0, m) : TensorView{},
              out.slice_rows(j * max_m, j * max_m + m));
        }
        break;
      }
    }
  }

 private:
  void run_expert(int rank, int local_slot, const DispatchOutput& in, TensorView x, TensorView scales,
                  TensorView y) {
    const int physical = rank * context_.config.num_local_experts() + local_slot;
    const int logical = context_.placement->phy2log()[static_cast<std::size_t>(physical)];
    expert_mlp_cpu(context_.weights->routed_expert(logical), in.format, x, scales, in.tensor_scale,
                   context_.weights->a2_scale(), context_.config.power_of_two_scales, context_.numerics, y);
  }

  RunnerContext context_;
  Layout layout_;
};

// Every (layout, quant) combination of the CPU backend.
[[maybe_unused]] const bool kRegistered = [] {
  for (Layout layout : {Layout::token_major, Layout::contiguous, Layout::masked})
    for (QuantScheme quant : {QuantScheme::fp8, QuantScheme::w4a8, QuantScheme::none})
      RunnerRegistry::instance().add(
          runner_key(Device::cpu, layout, quant),
          [layout](const RunnerContext& c) { return std::make_unique<CpuRunner>(c, layout); });
  return true;
}();

}  // namespace
}  // namespace epmoe
