// GPU runners (design.md §1): the routed experts' GEMM1 -> SiLU·mul + FP8 -> GEMM2 on one rank's
// dispatch output, in the dispatcher's layout. A runner is the adapter between a dispatcher's layout
// and a GEMM backend (the typed form of SGLang's pre/post-permute functions): the registry is keyed
// by (layout, backend), and each backend registers its layouts from its own file
// (src/runner/gpu_runner_fp8.cpp, gpu_runner_w4a8.cpp), so a new backend, or a dispatcher with a new
// layout, is one new file. No per-expert host loop: every GEMM is one grouped launch whose group
// sizes stay on the device.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "epmoe/config.hpp"
#include "epmoe/cuda/w4a8_gemm.hpp"
#include "epmoe/dispatch.hpp"
#include "epmoe/registry.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe::cuda {

// One rank's expert weights in their slots, in the backend's format and at fixed addresses (a
// rebalance rewrites the slots in place, so a runner and the graphs captured through it stay valid).
//   fp8:  w13 [L, 2I, H] e4m3 + w13_scale [L, 2I/128, H/128] f32; w2 [L, H, I] + w2_scale [L, H/128, I/128]
//   w4a8: w13 [L, 2I, H/2] prepared int4 + w13_scale [L, 2I, H/128]; w2 [L, H, I/2] + w2_scale [L, H, I/128]
struct SlotWeights {
  TensorView w13, w13_scale, w2, w2_scale;
  // w4a8: the codes the slots were prepared with (w4a8_prepare_weights).
  W4A8Codes w4a8_codes = W4A8Codes::offset_binary;
};

struct GpuRunnerContext {
  MoeConfig config;     // hidden size, quant scheme (the backend), scale rounding
  SlotWeights weights;  // the slots (the number of experts and their intermediate size come from these)
  // The most rows one dispatch output can hold (contiguous: M_sum; masked: E_local * M_max): the
  // runner sizes its workspace for it once.
  std::int64_t max_rows = 0;
  // W4A8: the GEMM2 input's static per-tensor FP8 scale (the GEMM1 input's comes with the dispatch).
  float a2_scale = 1.0f;
};

class GpuRunner {
 public:
  virtual ~GpuRunner() = default;
  virtual std::string name() const = 0;  // "layout/backend"
  virtual Layout layout() const = 0;
  // in: this rank's dispatch output in layout() (device tensors); out [in.num_output_rows(), H]
  // bf16 (device) receives every valid row. Enqueues on stream; no host sync, graph capturable.
  virtual void run(const DispatchOutput& in, TensorView out, cudaStream_t stream) = 0;
  // At most this many CTAs per GEMM (0: every SM): two-batch overlap leaves SMs to communication.
  virtual void set_max_ctas(int max_ctas) = 0;
  virtual std::size_t workspace_bytes() const = 0;
};

using GpuRunnerRegistry = Registry<GpuRunner, GpuRunnerContext>;
std::string gpu_runner_key(Layout layout, QuantScheme backend);
// The runner for the dispatcher's layout and the config's quant scheme; a clear error (naming what is
// registered) when there is none.
std::unique_ptr<GpuRunner> make_gpu_runner(Layout layout, const GpuRunnerContext& context);
std::vector<std::string> gpu_runner_keys();

}  // namespace epmoe::cuda
