// What every GPU runner backend shares (epmoe/cuda/runner.hpp): the workspace, the argument checks
// and the three steps per layout — grouped GEMM1, fused SiLU·mul + FP8 quantization, grouped GEMM2.
// A backend supplies its two grouped GEMM calls and how its GEMM2 input is scaled.
#pragma once

#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/runner.hpp"
#include "epmoe/cuda/silu_quant.hpp"

namespace epmoe::cuda::runner_detail {

// One grouped GEMM's operands: a [rows, K] (or [G, M_max, K]) FP8 activations with per-token-group
// scales a_scales, or with one per-tensor scale a_tensor_scale; w / w_scales the slots' weights.
struct GemmOperands {
  TensorView a, a_scales;
  float a_tensor_scale = 1.0f;
  TensorView w, w_scales, d;
};

class GroupedMlpRunner : public GpuRunner {
 public:
  GroupedMlpRunner(const GpuRunnerContext& context, Layout layout);
  std::string name() const override { return gpu_runner_key(layout_, context_.config.quant); }
  Layout layout() const override { return layout_; }
  void run(const DispatchOutput& in, TensorView out, cudaStream_t stream) override;
  void set_max_ctas(int max_ctas) override { max_ctas_ = max_ctas; }
  std::size_t workspace_bytes() const override { return h_.nbytes() + a2_.nbytes() + a2_scales_.nbytes(); }

 protected:
  virtual void gemm_contiguous(const GemmOperands& g, TensorView m_indices, cudaStream_t stream) = 0;
  virtual void gemm_masked(const GemmOperands& g, TensorView masked_m, std::int64_t expected_m,
                           cudaStream_t stream) = 0;
  virtual SiluQuantOptions silu_options() const = 0;

  // From the slot weights (w13 [slots, 2I, ...]): the routed experts' or the shared expert's.
  std::int64_t slots() const { return context_.weights.w13.size(0); }
  std::int64_t intermediate() const { return context_.weights.w13.size(1) / 2; }

  const GpuRunnerContext context_;
  int max_ctas_ = 0;

 private:
  Layout layout_;
  // GEMM1 output [R, 2I] bf16; GEMM2 input [R, I] e4m3 and its per-token-group scales [R, I/128].
  DeviceTensor h_, a2_, a2_scales_;
};

// Registers a backend's runner for both layouts, under (layout, backend): one static object per
// backend file.
template <class Backend>
struct LayoutRegistrations {
  explicit LayoutRegistrations(QuantScheme backend) {
    for (const Layout layout : {Layout::contiguous, Layout::masked})
      GpuRunnerRegistry::instance().add(
          gpu_runner_key(layout, backend), [layout](const GpuRunnerContext& context) {
            return std::unique_ptr<GpuRunner>(std::make_unique<Backend>(context, layout));
          });
  }
};

}  // namespace epmoe::cuda::runner_detail
