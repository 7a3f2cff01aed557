// Runner: computes the routed experts on a DispatchOutput (GEMM1 -> SiLU·mul -> GEMM2), writing
// bf16 rows in the same layout. Backends register by (device, layout, quant).
#pragma once

#include <memory>
#include <string>

#include "epmoe/dispatch.hpp"
#include "epmoe/eplb.hpp"
#include "epmoe/weights.hpp"

namespace epmoe {

// How the CPU backend rounds: `mirror` follows the GPU's quantization points (the W4A8 weight scales
// rounded to bf16 as the packer stores them, bf16 GEMM1 output, SiLU·mul in f32, FP8 re-quantization of
// the GEMM2 input, bf16 output); `exact` evaluates the checkpoint's quantized weights (f32 scales) and
// the same inputs in f64 without intermediate rounding.
enum class Numerics : std::uint8_t { mirror, exact };
std::string_view to_string(Numerics n);

struct RunnerContext {
  MoeConfig config;
  const ModelWeights* weights = nullptr;       // logical expert weights
  const ExpertPlacement* placement = nullptr;  // physical slot -> logical expert
  Numerics numerics = Numerics::mirror;
};

class Runner {
 public:
  virtual ~Runner() = default;
  virtual std::string name() const = 0;
  // in: one rank's dispatch output; out (bf16, [in.num_output_rows(), H]) receives every valid row.
  virtual void run(const DispatchOutput& in, TensorView out, int rank) = 0;
};

using RunnerRegistry = Registry<Runner, RunnerContext>;
std::string runner_key(Device device, Layout layout, QuantScheme quant);
std::unique_ptr<Runner> make_runner(Device device, Layout layout, const RunnerContext& context);

// One expert MLP on `rows` activation rows (CPU). The shared piece the runner, the shared expert
// and the reference all use.
//   x: [rows, H] in `format` (bf16 or fp8), x_scales [rows, H/128] f32 for fp8_group,
//   x_tensor_scale for fp8_tensor; out: [rows, H] bf16 (mirror) — or f64 when out.dtype is f64.
// a2_scale: the static per-tensor scale of the GEMM2 input (fp8_tensor only).
void expert_mlp_cpu(const ExpertWeights& weights, ActivationFormat format, TensorView x, TensorView x_scales,
                    float x_tensor_scale, float a2_scale, bool power_of_two_scales, Numerics numerics,
                    TensorView out);

}  // namespace epmoe
