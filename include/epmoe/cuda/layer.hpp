// The MoE layer on GPUs (design.md §1): gate GEMM -> router -> EPLB mapping (with per-expert load
// counters) -> FP8 quantization -> dispatch -> expert GEMMs (GEMM1, SiLU·mul + FP8, GEMM2) ->
// combine, plus the shared expert on its own stream, overlapped with dispatch and the routed GEMMs.
// One object per process and GPU (rank); every call is collective over the communicator's ranks.
//
//   one rank:  no communication; the permutation kernels build the layout (contiguous in normal
//              mode, masked in low-latency mode) and the weighted gather is the combine.
//   N ranks:   the NVLink dispatchers of epmoe/comm_dispatch.hpp ("nvlink" in normal mode, whose
//              receive learns the row counts with one host sync; "nvlink-ll" in low-latency mode,
//              with no host sync at all), or "nccl-p2p".
//
// Low-latency forwards are CUDA-graph capturable: forward_graph() captures one graph per batch size
// on first use (or capture_graphs() ahead of time) and replays it, with the input and output
// copied through static buffers. Expert weights live in fixed slots; rebalance() rewrites the slots
// whose expert changed in place, so captured graphs stay valid.
//
// Quant schemes: fp8 (DeepSeek-V3 block-scaled weights, per-token-group activations) and w4a8 (int4
// routed experts, FP8 activations with static per-tensor scales; the shared expert stays FP8). The
// routed experts run through the GPU runner registered for (the dispatcher's layout, the quant
// scheme): epmoe/cuda/runner.hpp. Unquantized models are refused.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <cuda_runtime_api.h>

#include "epmoe/comm.hpp"
#include "epmoe/config.hpp"
#include "epmoe/cuda/w4a8_gemm.hpp"
#include "epmoe/eplb.hpp"
#include "epmoe/tensor.hpp"
#include "epmoe/weights.hpp"

namespace epmoe::cuda {

struct GpuLayerOptions {
  // low_latency, normal, or automatic: both around the same weights (each mode's dispatchers, layout
  // buffers and runner), each forward's BatchKind picking one (resolve_mode: prefill normal, decode
  // low-latency), as an engine serves prefill and decode batches with one layer.
  Mode mode = Mode::low_latency;
  // The largest batch (tokens on this rank) of one forward; sizes every buffer. 0: the config's
  // max_tokens_per_rank. Low-latency mode refuses more than max_tokens_per_rank; in auto mode decode
  // batches stop at max_tokens_per_rank and prefill batches at max_tokens.
  std::int64_t max_tokens = 0;
  // "auto" (one rank: "local"; N ranks on one node: "nvlink" in normal mode, "nvlink-ll" in
  // low-latency mode; ranks not all load/store reachable, as across nodes: "nccl-p2p"), "local",
  // "nvlink", "nvlink-ll" or "nccl-p2p".
  std::string dispatcher = "auto";
  // Where the shared expert runs: "own" (its own stream, overlapped with dispatch and the routed
  // experts), "main" (inline on the main stream, before dispatch) or "auto": inline in normal mode on
  // one rank, where there is no communication to hide it behind and, beside the persistent routed
  // GEMMs, it made a prefill forward 6% slower on one H200 (5.72 against 5.39 ms; bench/NOTES.md,
  // session 15); its own stream otherwise.
  std::string shared_stream = "auto";
  // Per-phase CUDA events on eager forwards (adds one host sync per forward to read them).
  bool timing = false;
  // Two-batch overlap (N ranks): the batch splits into two micro-batches, each with its own
  // dispatcher buffers; one's dispatch and combine run on the communication stream while the other's
  // expert GEMMs run on a compute stream, whose persistent GEMMs leave tbo_comm_sms SMs to the
  // communication kernels. Low-latency mode goes through the dispatcher's send / receive halves
  // (both sends first) and stays graph capturable. Off by default: on 2 x H200 it measured slower
  // than running without it (bench/NOTES.md, layer): in prefill the GEMMs lose the SMs the
  // communication keeps, in decode each micro-batch reads the expert weights again.
  bool tbo = false;
  int tbo_comm_sms = 24;
  // Without two-batch overlap, dispatch through the dispatcher's whole call (send and place in one
  // launch; own tokens read from the input; in low-latency mode early counts and the routing inside
  // the launch: what `epmoe bench comm` times) instead of its send / receive halves, which the layer
  // used alone until 2026-12-01 (every GPU dispatcher has both; "nccl-p2p" since 2026-12-05, its halves
  // send the own tokens through its receive buffer). Off until measured on 2 GPUs (bench/NOTES.md,
  // session 12); EPMOE_LAYER_WHOLE_DISPATCH=0|1 overrides it.
  bool whole_dispatch = false;
  // Normal mode on N ranks: the dispatcher's receive learns the exact row counts with one host wait
  // (true), or hands the runner the contiguous layout at its worst-case bound with no host sync at
  // all (false: the GEMMs skip the -1 rows past the last expert block; "nccl-p2p" then sends every
  // peer its whole region of max_tokens rows). One rank never syncs.
  bool normal_host_sync = true;
  // W4A8: the codes the routed experts are packed with (W4A8Codes, epmoe/cuda/w4a8_gemm.hpp):
  // "sign_magnitude" (faster; weights in [-7, 7] only: an expert holding -8 is refused when its slot is
  // loaded), "offset_binary" (any int4), or "auto": sign-magnitude for SyntheticWeights (an amax / 7
  // quantizer: never -8), and for other weights sign-magnitude unless some routed expert holds -8,
  // found by scanning every routed expert once at construction (gpu_layer_w4a8_codes).
  std::string w4a8_codes = "auto";
  // Called on the constructing thread after each set-up step, for start-up timing: "weights" (the
  // gate, buffers and expert slots; their fill is enqueued, not finished), "dispatchers" (N ranks:
  // waits for NCCL's initialisation, registers the windows), "runner" (GEMM runners and the
  // remaining buffers; the constructor then waits for the stream).
  std::function<void(const char* step)> on_setup_step;
};

// The codes a W4A8 layer packs its routed experts with, for GpuLayerOptions::w4a8_codes = `requested`
// ("auto", "offset_binary" or "sign_magnitude"; see there). Host only: "auto" on weights other than
// SyntheticWeights reads every routed expert's int4 tensors once.
W4A8Codes gpu_layer_w4a8_codes(const ModelWeights& weights, std::string_view requested);

// Milliseconds measured with CUDA events, accumulated over timed eager forwards.
struct GpuPhaseTimes {
  double route = 0;     // gate GEMM, top-k, EPLB mapping, FP8 quantization of the tokens
  double dispatch = 0;  // to the expert owners (permutation alone on one rank)
  double gemm = 0;      // GEMM1, SiLU·mul + FP8 quantization, GEMM2
  double combine = 0;   // weighted results home, plus the shared expert's add
  double shared = 0;    // the shared expert (its own stream: overlapped, not part of total)
  double total = 0;     // the whole forward on the main stream
  std::int64_t forwards = 0;
};

// When each phase of the last timed eager forward ran, in ms from its start on the main stream
// ({begin, end} from CUDA events recorded around the phase on the stream that ran it; {-1, -1} where
// the forward had no such phase). With two-batch overlap, index 0 and 1 are the two micro-batches
// (their GEMMs on the compute stream, overlapping the other's dispatch and combine); without it the
// whole batch is micro-batch 0. A span includes the waits inside it (a dispatch waiting for its peers).
// What `epmoe run --trace` draws, per rank.
struct GpuForwardSpans {
  using Span = std::array<double, 2>;
  Span route{-1, -1}, shared{-1, -1}, total{-1, -1};
  std::array<Span, 2> dispatch{Span{-1, -1}, Span{-1, -1}}, gemm{Span{-1, -1}, Span{-1, -1}},
      combine{Span{-1, -1}, Span{-1, -1}};
  bool gemm_on_compute_stream = false;  // two-batch overlap: the GEMMs on their own stream
  bool shared_on_own_stream = false;    // the shared expert on its own stream (else inline)
};

class GpuMoeLayer {
 public:
  // comm: nullptr for one rank (config.num_ranks must be 1), else config.num_ranks must equal
  // comm->size() and the layer serves comm->rank() on comm->device(), enqueuing on comm->stream().
  GpuMoeLayer(std::shared_ptr<const ModelWeights> weights, GpuLayerOptions options,
              std::shared_ptr<Communicator> comm = nullptr);
  ~GpuMoeLayer();
  GpuMoeLayer(const GpuMoeLayer&) = delete;
  GpuMoeLayer& operator=(const GpuMoeLayer&) = delete;

  const MoeConfig& config() const;
  const GpuLayerOptions& options() const;
  int rank() const;
  int num_ranks() const;
  // GpuLayerOptions::shared_stream, resolved for the forwards of `kind` (a layer of one mode: its mode).
  bool shared_expert_on_own_stream(BatchKind kind = BatchKind::decode) const;
  std::int64_t max_tokens() const;  // the largest batch of any forward
  cudaStream_t stream() const;      // where forward() enqueues; outputs are valid in its order

  // x [T, H] bf16, y (out) [T, H] bf16, contiguous Device::cuda views, T <= max_tokens(); every rank
  // calls it (T may differ per rank, and may be 0). Enqueues on stream(); returns without waiting,
  // except for the host sync of the "nvlink" / "nccl-p2p" dispatch in normal mode (none with
  // normal_host_sync = false). A layer in auto
  // mode refuses this one: it needs the batch kind (below).
  void forward(TensorView x, TensorView y);
  // The same for a batch of `kind`: in auto mode prefill runs in normal mode and decode in
  // low-latency mode; a layer of one mode runs every kind in it. Every rank must pass the same kind.
  void forward(TensorView x, TensorView y, BatchKind kind);

  // The same through a CUDA graph captured for this T (low-latency mode only, or auto mode's decode
  // batches; the first call for a T captures, later calls replay). x and y may be any device tensors: they
  // are copied into and out of the layer's static buffers inside the stream order.
  void forward_graph(TensorView x, TensorView y);
  void capture_graphs(std::span<const std::int64_t> batch_sizes);
  std::size_t graphs_captured() const;

  // The gate logits [T, E] f32 of the last forward (device view; valid until the next forward):
  // the CPU reference routes from these (epmoe/cuda/gate.hpp says why).
  TensorView last_logits() const;

  // The expert GEMMs of the last eager forward (without two-batch overlap) run again by themselves,
  // nothing else on the GPU, `reps` times each after a warm-up: the routed experts (GEMM1, SiLU·mul
  // + FP8, GEMM2) on its dispatch output, and the shared expert on its tokens. Ms per run; local (no
  // communication), synchronises the stream. What "the layer's GEMM time alone" means in the bars.
  struct GemmTimes {
    double routed_ms = 0, shared_ms = 0;
  };
  GemmTimes time_gemms_alone(int reps = 5);

  const GpuPhaseTimes& times() const;
  const GpuForwardSpans& last_spans() const;  // of the last timed eager forward
  void reset_times();
  void set_timing(bool on);  // GpuLayerOptions::timing, for the following forwards

  // Device memory the layer holds, in bytes: all of it, and the communication + layout part
  // (symmetric windows, receive-side layout, routing and permutation buffers).
  std::size_t device_bytes() const;
  std::size_t comm_layout_bytes() const;
  // What creating the dispatchers took from the device's free memory, NCCL's own allocations for
  // window registration and the device communicator included (cudaMemGetInfo before and after).
  std::size_t dispatcher_setup_bytes() const;
  // The dispatcher that serves batches of `kind` ("auto" resolved: "local" on one rank, "nvlink",
  // "nvlink-ll" or "nccl-p2p"); refused where the layer does not serve that kind's mode.
  std::string dispatcher_name(BatchKind kind) const;

  // Tokens routed to each logical expert since construction or the last rebalance, summed over the
  // ranks (collective; synchronises the stream).
  std::vector<std::int64_t> expert_load();
  // DeepSeek EPLB over expert_load() (collective): installs the new placement on every rank
  // (rebalance_placement: across ranks, the current one stays where DeepSeek's would leave the busiest
  // rank busier), rewrites the local slots whose expert changed in place, clears the counters. Returns the
  // slots rewritten on this rank. slot_cost_tokens: what reading one slot's weights costs per forward, in
  // tokens of GEMM work (rebalance_experts' slot_cost, times the forwards counted): -1 takes
  // weight_read_tokens(), so that at decode a replica is made only where it carries enough tokens to
  // pay for its reads; 0 is DeepSeek's algorithm unchanged.
  int rebalance(int nodes = 1, double slot_cost_tokens = -1.0);
  // The layer's estimate of one local expert's weight read in tokens of GEMM work (H200 rates).
  double weight_read_tokens() const;
  const ExpertPlacement& placement() const;
  // (token, k) entries sent to each physical slot since construction, the last rebalance or
  // reset_load(), summed over the ranks (collective; synchronises the stream). Tokens per GPU are
  // the sums over each rank's slots.
  std::vector<std::int64_t> slot_load();
  void reset_load();  // clears the expert and slot counters
  // Installs a placement (collective: every rank must pass the same one); rewrites the changed local
  // slots. All or nothing: if any rank's slots cannot take their experts (W4A8 sign-magnitude codes and a
  // -8, a bad scale, a checkpoint read that throws), every rank keeps the previous placement and its
  // experts, and throws (that rank its own error, the others one that names it). rebalance() likewise.
  int set_placement(const ExpertPlacement& placement);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace epmoe::cuda
