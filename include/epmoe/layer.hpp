// MoeLayer: router -> EPLB mapping -> dispatch -> runner -> combine, plus the shared expert
// (design.md §1). On the CPU it serves every rank of an N-rank simulation in one process.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "epmoe/dispatch.hpp"
#include "epmoe/eplb.hpp"
#include "epmoe/runner.hpp"
#include "epmoe/weights.hpp"

namespace epmoe {

struct LayerOptions {
  // normal, low_latency, or automatic: both, each forward's BatchKind picking (resolve_mode).
  Mode mode = Mode::normal;
  Device device = Device::cpu;
  Numerics numerics = Numerics::mirror;
  std::string dispatcher;  // empty: "cpu-sim" (any rank count; "cpu-local" serves one rank)
  // Normal mode: the dispatcher learns the exact rows on the host (true) or hands out the layout at
  // its bound with no host sync (false; DispatcherContext::host_sync).
  bool host_sync = true;
};

struct PhaseTimes {  // milliseconds of host wall time, accumulated over forwards
  double route = 0, quantize = 0, dispatch = 0, experts = 0, combine = 0, shared = 0;
  double total() const { return route + quantize + dispatch + experts + combine + shared; }
};

struct ForwardStats {
  PhaseTimes times;
  Mode mode = Mode::normal;                 // the mode the last forward ran in
  std::int64_t tokens = 0;                  // over all served ranks
  std::vector<std::int64_t> rows_per_rank;  // expert rows each rank computed in the last forward
  std::int64_t bytes_sent = 0;              // dispatch payload to other ranks, last forward
};

class MoeLayer {
 public:
  MoeLayer(std::shared_ptr<const ModelWeights> weights, LayerOptions options);
  ~MoeLayer();

  const MoeConfig& config() const;
  const LayerOptions& options() const { return options_; }

  // x[r]: rank r's tokens [T_r, H] bf16 (finite; T_r <= max_tokens_per_rank in low-latency mode and
  // without a host sync),
  // y[r] (out): [T_r, H] bf16. One entry per served rank. A layer in auto mode needs the batch kind
  // (the overload below) and refuses this one.
  void forward(std::span<const TensorView> x, std::span<const TensorView> y, ForwardStats* stats = nullptr);
  // The same for a batch of `kind`: in auto mode prefill runs in normal mode and decode in
  // low-latency mode (resolve_mode); a layer of a fixed mode serves every kind in that mode.
  void forward(std::span<const TensorView> x, std::span<const TensorView> y, BatchKind kind,
               ForwardStats* stats = nullptr);

  const ExpertPlacement& placement() const { return placement_; }
  // Tokens routed to each logical expert, accumulated since construction or the last rebalance.
  const std::vector<std::int64_t>& expert_load() const { return expert_load_; }
  // DeepSeek EPLB over the accumulated load; installs the new placement (rebalance_placement: across
  // ranks, the current one stays where DeepSeek's would leave the busiest rank busier) and clears the
  // counters.
  // nodes: the number of nodes the ranks span (groups % nodes == 0 selects the hierarchical policy).
  void rebalance(int nodes = 1);
  void set_placement(ExpertPlacement placement);

 private:
  void forward_in(Mode mode, std::span<const TensorView> x, std::span<const TensorView> y,
                  ForwardStats* stats);

  std::shared_ptr<const ModelWeights> weights_;
  LayerOptions options_;
  ExpertPlacement placement_;
  std::vector<std::int64_t> expert_load_;
  // Per mode (index 0 normal, 1 low-latency); null for a mode the layer does not serve.
  std::unique_ptr<Dispatcher> dispatchers_[2];
  std::unique_ptr<Runner> runners_[2];
};

// Direct single-process evaluation of design.md §1 for tokens x [T, H] bf16 -> y [T, H] (bf16 or
// f64): route, and for each token Σ_k w·E_k(x) + shared(x), with the same quantized activations
// and weights and the same rounding points as the layer (numerics = mirror), or in f64 (exact).
void reference_forward(const ModelWeights& weights, TensorView x, TensorView y, Numerics numerics);
// The same, routed from given gate logits [T, E] f32 (host) instead of the CPU's own: those of a
// GPU forward, whose gate GEMM sums in another order (epmoe/cuda/gate.hpp says why).
void reference_forward(const ModelWeights& weights, TensorView x, TensorView logits, TensorView y,
                       Numerics numerics);

// Error measures of design.md §8 over all elements (bf16, f32 or f64 tensors of equal numel).
struct ErrorReport {
  double calc_diff = 0;  // 1 - 2Σxy / Σ(x² + y²)
  double rel_l2 = 0;     // ‖x - y‖ / ‖y‖
  std::int64_t non_finite = 0;
  std::int64_t count = 0;
  bool within(double tolerance) const {
    return non_finite == 0 && rel_l2 <= tolerance && calc_diff <= tolerance;
  }
};
ErrorReport compare(TensorView actual, TensorView expected);
// The relative error a layer's output may have against reference_forward (Numerics::mirror) over
// `tokens` tokens: design.md §8's 1e-2 at DeepSeek-V3 dims (measured 4e-3 to 6.3e-3, FP8 and W4A8 alike:
// FP8 tensor-core partial sums promoted every 128 K, then bf16 rounding and the FP8 re-quantisation of
// GEMM2's input, which turns a one-ulp bf16 difference into one e4m3 step); 1.5e-2 there for fewer than
// 16 tokens (a few tokens are a few samples of the statistic, not its mean: 163 checks of 1-15 tokens
// measured up to 7.4e-3, but one token 1.006e-2 (session 55) and one token with two-batch overlap
// 1.14e-2 (session 65; its quantization was not recorded, W4A8 then had the old mirror below)); 2e-2 for
// models with rows narrower than 2048 (the tiny preset's 256-wide rows: a few flipped e4m3 steps weigh more;
// 271 checks of 16+ tokens measured up to 1.0e-2), and 3e-2 there for fewer than 16 tokens (one token:
// median 4.0e-3, up to 1.27e-2 in 45 checks, a heavy tail). Measured on an H100 in session 66
// (bench/NOTES.md), against the mirror with the kernels' bf16 W4A8 scales (ed4c928); before it, W4A8 measured
// up to 2.25e-2 (tiny, 2 tokens) and 9.55e-3 (DeepSeek-V3).
double layer_tolerance(const MoeConfig& config, std::int64_t tokens);

}  // namespace epmoe
