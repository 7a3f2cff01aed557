// The GPU MoE layer (epmoe/cuda/layer.hpp): buffers sized once at construction, one stream order
// per forward, and the shared expert forked onto a second stream.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <map>
#include <string_view>

#include "epmoe/comm_dispatch.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/eplb.hpp"
#include "epmoe/cuda/gate.hpp"
#include "epmoe/cuda/layer.hpp"
#include "epmoe/cuda/permute.hpp"
#include "epmoe/cuda/quant.hpp"
#include "epmoe/cuda/router.hpp"
#include "epmoe/cuda/runner.hpp"
#include "epmoe/cuda/synthetic.hpp"
#include "epmoe/cuda/w4a8_gemm.hpp"
#include "epmoe/permute.hpp"
#include "layer/layer_kernels.hpp"

namespace epmoe::cuda {
namespace {

// The first `rows` rows of a [R, ...] device tensor, as [rows, ...].
TensorView rows_of(const DeviceTensor& t, std::int64_t rows) {
  return t.view().slice_rows(0, rows);
}

enum EventId { kStart, kRouted, kDispatched, kComputed, kCombined, kNumEvents };
// The spans of GpuForwardSpans beyond route, shared and total (which kStart .. kCombined and the shared
// expert's events give): two events each, begin and end, per micro-batch.
enum SpanId {
  kSpanDispatch0,
  kSpanDispatch1,
  kSpanGemm0,
  kSpanGemm1,
  kSpanCombine0,
  kSpanCombine1,
  kNumSpans
};

int mode_index(Mode mode) {
  return mode == Mode::normal ? 0 : 1;
}

// What the forwards of one mode need: the dispatchers (N ranks; two with two-batch overlap) or the
// local permutation's buffers (one rank), the runner for their layout and the expert output. A
// layer of one mode holds one path; a layer in auto mode holds both, around the same weights.
struct ModePath {
  Mode mode = Mode::normal;
  std::int64_t T_max = 0;  // the largest batch of a forward in this mode
  std::int64_t M_max = 0;  // masked rows per expert
  std::int64_t R_max = 0;  // expert rows of the layout
  std::string dispatcher_name;
  bool own_shared_stream = true;  // GpuLayerOptions::shared_stream, resolved for this mode

  std::unique_ptr<Dispatcher> dispatchers[2];
  LowLatencyDispatcher* lls[2] = {nullptr, nullptr};  // the same objects when they have send / receive halves
  Dispatcher* dispatcher = nullptr;                   // dispatchers[0]; null on one rank
  std::size_t dispatcher_bytes = 0;  // the dispatchers' own buffers and windows (Dispatcher::device_bytes)
  DeviceTensor perm_workspace, perm_rows, perm_scales, perm_m_indices, perm_row_src, perm_src_row,
      perm_offsets, perm_counts;

  // The runner for the layout and the quant scheme (epmoe/cuda/runner.hpp); the expert output (one
  // per micro-batch).
  std::unique_ptr<GpuRunner> runner;
  DeviceTensor expert_out, expert_out2;

  bool normal() const { return mode == Mode::normal; }
};

}  // namespace

struct GpuMoeLayer::Impl {
  std::int64_t forwards_since_reset =
      0;  // forward() and forward_graph() calls since the load counters' reset
  std::shared_ptr<const ModelWeights> weights;
  const SyntheticWeights* synthetic = nullptr;
  MoeConfig c;
  GpuLayerOptions o;
  std::shared_ptr<Communicator> comm;
  int rank = 0, ranks = 1, L = 0, E = 0, K = 0, P = 0;
  // T_max: the largest batch of any forward (in auto mode the normal path's; the low-latency path
  // stops at max_tokens_per_rank).
  std::int64_t H = 0, I = 0, Is = 0, T_max = 0;
  // W4A8: int4 routed experts, per-tensor FP8 activations with the static scales a1 / a2 (the
  // shared expert stays FP8 block-scaled, with per-token-group activations of its own).
  bool w4a8 = false;
  // w4a8: the slots' codes (GpuLayerOptions::w4a8_codes, gpu_layer_w4a8_codes).
  W4A8Codes w4a8_codes = W4A8Codes::offset_binary;
  float a1_scale = 1.0f, a2_scale = 1.0f;
  ActivationFormat format = ActivationFormat::fp8_group;
  DeviceTensor stage_w13, stage_s13, stage_w2, stage_s2;  // one expert in checkpoint order (W4A8 prepare)
  DeviceTensor shared_q, shared_q_scales;                 // W4A8: the shared expert's FP8 input

  Stream own_stream;
  cudaStream_t s0 = nullptr;
  Stream s1;
  Event fork{cudaEventDisableTiming}, join{cudaEventDisableTiming};
  std::vector<Event> events;  // kNumEvents on s0, then the shared expert's start and end on s1
  GpuPhaseTimes times;
  // GpuForwardSpans of the last timed forward: a begin and an end event per SpanId, and which of them
  // this forward recorded (only those are read).
  std::vector<Event> span_events;
  unsigned span_recorded = 0;
  bool timing_forward = false;  // this forward is timed (o.timing, not capturing)
  GpuForwardSpans spans;
  void span_mark(int span, bool end, cudaStream_t stream) {
    if (!timing_forward) return;
    const int i = 2 * span + (end ? 1 : 0);
    span_events[static_cast<std::size_t>(i)].record(stream);
    span_recorded |= 1u << i;
  }

  std::unique_ptr<GateGemm> gate;
  DeviceTensor gate_weight, correction_bias;

  // Routing.
  DeviceTensor logits, topk_ids, topk_weights, physical_ids, expert_counts, slot_counts, q, q_scales;
  DeviceTensor load_sum;  // sum_over_ranks' result, and install_placement's all-ranks verdict
  ExpertPlacement placement;
  DeviceTensor log2phy, logcnt;  // fixed width P - E + 1 (the most replicas any placement can have)
  std::int64_t last_T = 0;

  // Routed experts in this rank's L slots, and the shared expert.
  DeviceTensor w13, w13_scale, w2, w2_scale;
  std::vector<int> slot_logical;
  DeviceTensor sw13, sw13_scale, sw2, sw2_scale, shared_m, shared_out;
  std::unique_ptr<GpuRunner> shared_runner;  // one group of T rows, masked

  // Dispatch, experts and combine per mode (mode_index; a path with T_max 0 is a mode the layer
  // does not serve).
  ModePath paths[2];
  bool tbo = false;
  bool whole_dispatch = false;  // GpuLayerOptions::whole_dispatch (or its variable), without tbo
  Stream s2;                    // two-batch overlap: the compute stream
  Event dispatched[2] = {Event{cudaEventDisableTiming}, Event{cudaEventDisableTiming}};
  Event computed[2] = {Event{cudaEventDisableTiming}, Event{cudaEventDisableTiming}};
  int gemm_max_ctas = 0;                   // two-batch overlap: the SMs the runners' GEMMs may take (0: all)
  std::size_t dispatcher_setup_bytes = 0;  // device memory the dispatchers' creation took (NCCL's too)
  DeviceTensor y_routed;                   // the routed combine result

  bool serves(Mode mode) const { return paths[mode_index(mode)].T_max > 0; }  // set for the modes served
  // The path of a forward of `kind` (resolve_mode), refused where the layer does not serve its mode.
  ModePath& path_for(BatchKind kind) { return path_for(resolve_mode(o.mode, kind)); }
  ModePath& path_for(Mode mode) {
    EPMOE_CHECK(serves(mode), "this layer serves {} mode, not {}", to_string(o.mode), to_string(mode));
    return paths[mode_index(mode)];
  }
  // A forward's path without a batch kind: the layer's one mode (auto mode needs the kind).
  ModePath& single_path() {
    EPMOE_CHECK(
        o.mode != Mode::automatic,
        "a GpuMoeLayer in auto mode needs each forward's batch kind: forward(x, y, BatchKind::prefill "
        "or BatchKind::decode)");
    return path_for(o.mode);
  }
  void make_path(Mode mode);

  // Waits for s0 (or an event on it) where peers may hold it up: through the communicator, bounded
  // by its timeout (an error naming this rank and `what`, not a hang: a stuck NCCL kernel of the
  // nccl-p2p transport has no device-side timeout of its own); one rank: a plain wait.
  void wait_s0(std::string_view what) {
    if (comm && comm->size() > 1) {
      comm->synchronize(CommPhase::none, what);
    } else {
      EPMOE_CUDA_CHECK(cudaStreamSynchronize(s0));
    }
  }
  void wait_event(const Event& event, std::string_view what) {
    if (comm && comm->size() > 1) {
      comm->wait_event(event.get(), CommPhase::none, what);
    } else {
      event.synchronize();
    }
  }

  // Graphs.
  DeviceTensor x_static, y_static;
  std::map<std::int64_t, Graph> graphs;
  bool capturing = false;

  Impl(std::shared_ptr<const ModelWeights> w, GpuLayerOptions options, std::shared_ptr<Communicator> cm);
  void load_slot(int local_slot, int logical);
  void load_shared();
  int install_placement(const ExpertPlacement& p);
  // True on every rank when `ok` is true on every rank (collective on N ranks; one rank: `ok`).
  bool all_ranks_agree(bool ok);
  // Puts the experts of `before` back into the slots `touched` (install_placement's failure path).
  void restore_slots(const std::vector<int>& before, const std::vector<int>& touched);
  // The per-expert load: the slot counts since the last fold, through the placement they were
  // counted under, into load_carry (this rank's; synchronises s0, which joins the count's stream).
  void fold_load();
  std::vector<std::int64_t> load_carry;  // [E] this rank's tokens per logical expert, folded so far
  std::vector<std::int64_t> slot_base;   // [P] slot_counts at the last fold
  // x and y [T, H] bf16 contiguous device tensors, T <= the path's T_max; returns T.
  std::int64_t check_io(const TensorView& x, const TensorView& y, const ModePath& p) const;
  void forward(ModePath& p, TensorView x, TensorView y);
  void shared_forward(TensorView x, std::int64_t T, cudaStream_t stream);
  void shared_experts(std::int64_t T, cudaStream_t stream);  // on the tokens shared_forward quantized
  // The last eager forward's dispatch output without two-batch overlap, and its path
  // (time_gemms_alone()).
  DispatchOutput last_dispatch;
  ModePath* last_dispatch_path = nullptr;
  bool has_last_dispatch = false;  // an eager forward has set them
  DispatchOutput dispatch(ModePath& p, int part, std::int64_t row0, std::int64_t T);
  // Tokens [row0, row0 + T) of this forward, as a dispatcher takes them.
  DispatchInput dispatch_input(std::int64_t row0, std::int64_t T) const {
    auto part_rows = [&](const DeviceTensor& t) { return t.view().slice_rows(row0, row0 + T); };
    return {part_rows(q), w4a8 ? TensorView{} : part_rows(q_scales), w4a8 ? a1_scale : 1.0f,
            part_rows(physical_ids), part_rows(topk_weights)};
  }
  // Two-batch overlap: the first micro-batch's token count, about half, rounded up to 4 tokens so
  // that the second one's rows (x_scales: hidden / 128 floats a token) start 16-byte aligned, as the
  // dispatchers require. 4 ranks found it: an odd half at the tiny dims (8-byte scale rows).
  static std::int64_t first_micro_batch(std::int64_t T) { return std::min(T, ((T + 1) / 2 + 3) / 4 * 4); }

  // Ends a capture that an exception interrupted: joins the side streams that the forward had forked
  // (else the capture ends unjoined and leaves them capturing, which fails every later set-up call on
  // this thread), discards the graph and clears the error that ending it left behind.
  void abandon_capture() {
    for (cudaStream_t side : {s1.get(), s2.get()}) {
      cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
      if (side != nullptr && cudaStreamIsCapturing(side, &status) == cudaSuccess &&
          status == cudaStreamCaptureStatusActive) {
        cudaEvent_t joined = nullptr;
        if (cudaEventCreateWithFlags(&joined, cudaEventDisableTiming) == cudaSuccess) {
          (void)cudaEventRecord(joined, side);
          (void)cudaStreamWaitEvent(s0, joined, 0);
          (void)cudaEventDestroy(joined);
        }
      }
    }
    cudaGraph_t graph = nullptr;
    (void)cudaStreamEndCapture(s0, &graph);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    capturing = false;
  }

  // The routed experts on a dispatch output, into `out` (the path's expert_out or expert_out2).
  static void run_experts(const ModePath& p, const DispatchOutput& d, const DeviceTensor& out,
                          cudaStream_t stream) {
    p.runner->run(d, rows_of(out, d.num_output_rows()), stream);
  }
  void combine(ModePath& p, int part, const DispatchOutput& d, std::int64_t T, TensorView y);
  std::size_t comm_layout_bytes() const;
  std::size_t device_bytes() const;
};

W4A8Codes gpu_layer_w4a8_codes(const ModelWeights& weights, std::string_view requested) {
  if (requested == "offset_binary") return W4A8Codes::offset_binary;
  if (requested == "sign_magnitude") return W4A8Codes::sign_magnitude;
  EPMOE_CHECK(requested == "auto",
              "w4a8_codes must be \"auto\", \"offset_binary\" or \"sign_magnitude\", got \"{}\"", requested);
  // (SyntheticWeights' experts come from a symmetric amax / 7 quantizer: no scan, which would build
  // every expert on the host.)
  if (dynamic_cast<const SyntheticWeights*>(&weights) != nullptr) return W4A8Codes::sign_magnitude;
  const MoeConfig& c = weights.config();
  EPMOE_CHECK(c.quant == QuantScheme::w4a8, "w4a8_codes: the weights' quant must be w4a8, got {}",
              to_string(c.quant));
  for (int e = 0; e < c.num_experts; ++e) {
    const ExpertWeights& x = weights.routed_expert(e);
    if (w4a8_pick_codes_cpu(x.w13) == W4A8Codes::offset_binary ||
        w4a8_pick_codes_cpu(x.w2) == W4A8Codes::offset_binary)
      return W4A8Codes::offset_binary;  // expert e holds -8
  }
  return W4A8Codes::sign_magnitude;
}

GpuMoeLayer::Impl::Impl(std::shared_ptr<const ModelWeights> w, GpuLayerOptions options,
                        std::shared_ptr<Communicator> cm)
    : weights(std::move(w)), o(std::move(options)), comm(std::move(cm)) {
  EPMOE_CHECK(weights != nullptr, "GpuMoeLayer needs weights");
  c = weights->config();
  c.validate();
  EPMOE_CHECK(c.quant == QuantScheme::fp8 || c.quant == QuantScheme::w4a8,
              "GpuMoeLayer: quant '{}' is not available on the GPU (fp8 and w4a8 are)", to_string(c.quant));
  w4a8 = c.quant == QuantScheme::w4a8;
  a1_scale = weights->a1_scale();
  a2_scale = weights->a2_scale();
  format = activation_format(c.quant);
  synthetic = dynamic_cast<const SyntheticWeights*>(weights.get());
  if (w4a8) w4a8_codes = gpu_layer_w4a8_codes(*weights, o.w4a8_codes);
  if (comm) {
    EPMOE_CHECK(c.num_ranks == comm->size(), "config.num_ranks ({}) must equal the communicator's size ({})",
                c.num_ranks, comm->size());
    rank = comm->rank();
    ranks = comm->size();
    EPMOE_CUDA_CHECK(cudaSetDevice(comm->device()));
    s0 = comm->stream();
  } else {
    EPMOE_CHECK(c.num_ranks == 1,
                "GpuMoeLayer without a communicator serves one rank; config.num_ranks is {}", c.num_ranks);
    s0 = own_stream.get();
  }
  E = c.num_experts;
  K = c.topk;
  P = c.num_physical_experts();
  L = c.num_local_experts();
  H = c.hidden;
  I = c.intermediate;
  Is = c.shared_intermediate();
  T_max = o.max_tokens > 0 ? o.max_tokens : c.max_tokens_per_rank;
  EPMOE_CHECK(T_max >= 1, "max_tokens must be >= 1, got {}", T_max);
  if (o.mode == Mode::low_latency)
    EPMOE_CHECK(T_max <= c.max_tokens_per_rank,
                "max_tokens ({}) must be <= max_tokens_per_rank ({}) in low-latency mode", T_max,
                c.max_tokens_per_rank);
  EPMOE_CHECK(route_supports(c), "the GPU router does not support this config ({})", c.describe());
  EPMOE_CHECK(o.shared_stream == "auto" || o.shared_stream == "own" || o.shared_stream == "main",
              "GpuLayerOptions.shared_stream must be \"auto\", \"own\" or \"main\", got \"{}\"",
              o.shared_stream);
  // The modes served (auto: both), named and checked before anything is allocated.
  for (const Mode mode : {Mode::normal, Mode::low_latency}) {
    if (o.mode != Mode::automatic && o.mode != mode) continue;
    ModePath& p = paths[mode_index(mode)];
    p.mode = mode;
    const bool normal = p.normal();
    p.T_max = normal ? T_max : std::min<std::int64_t>(T_max, c.max_tokens_per_rank);
    std::string& name = p.dispatcher_name;
    name = o.dispatcher;
    // auto on N ranks is resolved by make_path, where the dispatchers are made: it asks the
    // communicator, which waits for NCCL's initialisation (overlapped with the weights' set-up here).
    if (name == "auto" && ranks == 1) name = "local";
    p.own_shared_stream = o.shared_stream == "own" || (o.shared_stream == "auto" && !(normal && ranks == 1));
    // Any GPU dispatcher registered by name (DispatcherRegistry: "nvlink", "nvlink-ll", "nccl-p2p"),
    // not the CPU simulation's.
    const DispatcherRegistry& registry = DispatcherRegistry::instance();
    if (name != "auto" && name != "local" && (!registry.contains(name) || name.starts_with("cpu-"))) {
      std::string known = "auto, local";
      for (const std::string& key : registry.keys())
        if (!key.starts_with("cpu-")) known += ", " + key;
      EPMOE_FAIL("dispatcher must be one of {}, got '{}'", known, name);
    }
    EPMOE_CHECK((name == "local") == (ranks == 1),
                "dispatcher '{}' does not fit {} rank(s): 'local' serves exactly one rank", name, ranks);
    EPMOE_CHECK(name != "nvlink-ll" || !normal, "dispatcher 'nvlink-ll' serves low-latency mode only{}",
                o.mode == Mode::automatic ? " (an auto-mode layer runs prefill batches in normal mode)" : "");
  }

  for (int i = 0; i < kNumEvents + 2; ++i) events.emplace_back();
  for (int i = 0; i < 2 * kNumSpans; ++i) span_events.emplace_back();
  gate = std::make_unique<GateGemm>();
  gate_weight = to_device(weights->gate_weight(), s0);
  // cuBLAS's first calls (every decode-sized batch) at set-up, not in a forward (GateGemm says why).
  gate->warm_up(gate_weight, std::max<std::int64_t>(T_max, 1), s0);
  // A NaN bias would win every comparison in the router's kernels (its order key is the largest):
  // refused here, as route_cpu refuses it, while it is still a host tensor.
  if (!weights->correction_bias().empty_view()) expect_finite(weights->correction_bias(), "correction_bias");
  correction_bias = to_device(weights->correction_bias(), s0);

  logits = DeviceTensor(DType::f32, {T_max, E});
  // Zeroed once, for compute-sanitizer initcheck only: at small shapes cuBLAS's gate kernel writes
  // the logits in a way initcheck does not track (it reported the router's reads of every forward's
  // logits as uninitialized), while GateGemmGpu.EveryLogitWrittenAtSmallShapes shows on poisoned
  // outputs that every logit is written each call.
  EPMOE_CUDA_CHECK(cudaMemsetAsync(logits.data<float>(), 0, logits.nbytes(), s0));
  topk_ids = DeviceTensor(DType::i32, {T_max, K});
  topk_weights = DeviceTensor(DType::f32, {T_max, K});
  physical_ids = DeviceTensor(DType::i32, {T_max, K});
  expert_counts = DeviceTensor(DType::i64, {E});  // expert_load()'s staging for the sum over ranks
  slot_counts = DeviceTensor(DType::i64, {P});
  load_sum = DeviceTensor(DType::i64, {std::max<std::int64_t>(E, P)});
  load_carry.assign(static_cast<std::size_t>(E), 0);
  slot_base.assign(static_cast<std::size_t>(P), 0);
  EPMOE_CUDA_CHECK(cudaMemsetAsync(slot_counts.data<std::int64_t>(), 0, slot_counts.nbytes(), s0));
  q = DeviceTensor(DType::fp8_e4m3, {T_max, H});
  q_scales = DeviceTensor(DType::f32, {T_max, H / 128});

  // Expert slots, then the placement (which fills them).
  if (w4a8) {
    // Prepared (packed) int4 slots, the checkpoint's shapes, bf16 scales (epmoe/cuda/w4a8_gemm.hpp).
    w13 = DeviceTensor(DType::i4x2, {L, 2 * I, H / 2});
    w13_scale = DeviceTensor(DType::bf16, {L, 2 * I, H / 128});
    w2 = DeviceTensor(DType::i4x2, {L, H, I / 2});
    w2_scale = DeviceTensor(DType::bf16, {L, H, I / 128});
    stage_w13 = DeviceTensor(DType::i4x2, {1, 2 * I, H / 2});
    stage_s13 = DeviceTensor(DType::f32, {1, 2 * I, H / 128});
    stage_w2 = DeviceTensor(DType::i4x2, {1, H, I / 2});
    stage_s2 = DeviceTensor(DType::f32, {1, H, I / 128});
    // The permutation copies per-token-group scales along with fp8 rows; W4A8 has none, so it
    // copies these zeros (the W4A8 GEMM never reads them).
    EPMOE_CUDA_CHECK(cudaMemsetAsync(q_scales.data<float>(), 0, q_scales.nbytes(), s0));
  } else {
    w13 = DeviceTensor(DType::fp8_e4m3, {L, 2 * I, H});
    w13_scale = DeviceTensor(DType::f32, {L, 2 * I / 128, H / 128});
    w2 = DeviceTensor(DType::fp8_e4m3, {L, H, I});
    w2_scale = DeviceTensor(DType::f32, {L, H / 128, I / 128});
  }
  slot_logical.assign(static_cast<std::size_t>(L), -1);
  log2phy = DeviceTensor(DType::i32, {E, P - E + 1});
  logcnt = DeviceTensor(DType::i32, {E});
  install_placement(ExpertPlacement::initial(E, P, ranks));
  if (c.num_shared_experts > 0) load_shared();
  if (o.on_setup_step) o.on_setup_step("weights");

  // Dispatch: every rank creates the dispatchers in the same order (collective), normal mode first.
  if (ranks > 1) {
    tbo = o.tbo;
    whole_dispatch = o.whole_dispatch;
    if (const char* env = std::getenv("EPMOE_LAYER_WHOLE_DISPATCH"); env != nullptr && *env != '\0')
      whole_dispatch = std::string_view(env) == "1";
    whole_dispatch = whole_dispatch && !tbo;  // with two-batch overlap the halves stay
    if (tbo) gemm_max_ctas = std::max(1, device_props().sm_count - std::max(0, o.tbo_comm_sms));
  }
  std::size_t free_before = 0, free_after = 0, total = 0;
  EPMOE_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  for (const Mode mode : {Mode::normal, Mode::low_latency})
    if (serves(mode)) make_path(mode);
  EPMOE_CUDA_CHECK(cudaMemGetInfo(&free_after, &total));
  if (ranks > 1) dispatcher_setup_bytes = free_before > free_after ? free_before - free_after : 0;
  if (o.on_setup_step) o.on_setup_step("dispatchers");
  for (ModePath& p : paths) {
    if (p.T_max == 0) continue;
    p.runner = make_gpu_runner(
        p.normal() ? Layout::contiguous : Layout::masked,
        GpuRunnerContext{c, SlotWeights{w13, w13_scale, w2, w2_scale, w4a8_codes}, p.R_max, a2_scale});
    p.runner->set_max_ctas(gemm_max_ctas);
    p.expert_out = DeviceTensor(DType::bf16, {p.R_max, H});
    if (tbo) p.expert_out2 = DeviceTensor(DType::bf16, {p.R_max, H});
  }
  if (shared_runner) shared_runner->set_max_ctas(gemm_max_ctas);
  y_routed = DeviceTensor(DType::bf16, {T_max, H});
  if (serves(Mode::low_latency)) {  // the graphs' static input and output
    const std::int64_t T_ll = paths[mode_index(Mode::low_latency)].T_max;
    x_static = DeviceTensor(DType::bf16, {T_ll, H});
    y_static = DeviceTensor(DType::bf16, {T_ll, H});
  }
  if (o.on_setup_step) o.on_setup_step("runner");
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(s0));
}

void GpuMoeLayer::Impl::make_path(Mode mode) {
  ModePath& p = paths[mode_index(mode)];
  const bool normal = p.normal();
  if (p.dispatcher_name == "local") {
    p.M_max = p.T_max;  // an expert gets each token at most once
    p.R_max = normal ? contiguous_capacity(p.T_max * K, L) : L * p.M_max;
    p.perm_workspace =
        DeviceTensor(DType::u8, {static_cast<std::int64_t>(permute_workspace_bytes(p.T_max * K, L))});
    p.perm_rows = DeviceTensor(DType::fp8_e4m3, {p.R_max, H});
    p.perm_scales = DeviceTensor(DType::f32, {p.R_max, H / 128});
    p.perm_row_src = DeviceTensor(DType::i32, {p.R_max});
    p.perm_src_row = DeviceTensor(DType::i32, {p.T_max, K});
    if (normal) {
      p.perm_m_indices = DeviceTensor(DType::i32, {p.R_max});
      p.perm_offsets = DeviceTensor(DType::i32, {L + 1});
    }
    p.perm_counts = DeviceTensor(DType::i32, {L});  // normal: rows per expert; low-latency: masked_m
    return;
  }
  // auto: the NVLink dispatchers where every peer is load/store reachable (one node), else the
  // portable NCCL point-to-point transport (across nodes). The query is collective: every rank asks
  // here, in the same order.
  if (p.dispatcher_name == "auto")
    p.dispatcher_name = !comm->all_ranks_load_store_reachable() ? "nccl-p2p"
                        : normal                                ? "nvlink"
                                                                : "nvlink-ll";
  // With two-batch overlap each dispatcher carries one micro-batch: about half the tokens (the first
  // is the larger one).
  const std::int64_t T_part = tbo ? first_micro_batch(p.T_max) : p.T_max;
  MoeConfig dc = c;
  dc.max_tokens_per_rank = static_cast<int>(T_part);
  const DispatcherContext context{dc, mode, format, rank, 1, !normal || o.normal_host_sync, comm};
  for (int part = 0; part < (tbo ? 2 : 1); ++part) {
    // By name from the registry (each dispatcher registers itself in its own file); the ones with send
    // / receive halves serve two-batch overlap in low-latency mode through them.
    p.dispatchers[part] = make_dispatcher(p.dispatcher_name, context);
    p.lls[part] = dynamic_cast<LowLatencyDispatcher*>(p.dispatchers[part].get());
  }
  for (const auto& d : p.dispatchers)
    if (d) p.dispatcher_bytes += d->device_bytes();
  p.dispatcher = p.dispatchers[0].get();
  p.M_max = dc.masked_max_m();
  p.R_max = normal ? contiguous_rows_bound(dc, T_part) : L * p.M_max;  // the receive side's bound
}

void GpuMoeLayer::Impl::load_slot(int local_slot, int logical) {
  const TensorView dw13 = w13.view().select(local_slot), ds13 = w13_scale.view().select(local_slot);
  const TensorView dw2 = w2.view().select(local_slot), ds2 = w2_scale.view().select(local_slot);
  if (w4a8) {
    // Checkpoint order into the staging expert, then the one-time preparation into the slot (the next
    // slot's staging writes follow this preparation in the stream order: no sync needed).
    if (synthetic) {
      synthetic_expert_w4a8(synthetic->expert_seed(logical), H, I, stage_w13.view().select(0),
                            stage_s13.view().select(0), stage_w2.view().select(0), stage_s2.view().select(0),
                            s0);
    } else {
      const ExpertWeights& e = weights->routed_expert(logical);
      copy_to_device(stage_w13.view().select(0), e.w13, s0);
      copy_to_device(stage_s13.view().select(0), e.w13_scale, s0);
      copy_to_device(stage_w2.view().select(0), e.w2, s0);
      copy_to_device(stage_s2.view().select(0), e.w2_scale, s0);
    }
    w4a8_prepare_weights(stage_w13, stage_s13, dw13.reshaped({1, 2 * I, H / 2}),
                         ds13.reshaped({1, 2 * I, H / 128}), s0, w4a8_codes);
    w4a8_prepare_weights(stage_w2, stage_s2, dw2.reshaped({1, H, I / 2}), ds2.reshaped({1, H, I / 128}), s0,
                         w4a8_codes);
  } else if (synthetic) {
    // Bit-identical with the host tensors routed_expert() would build, without building them.
    synthetic_expert_fp8(synthetic->expert_seed(logical), H, I, dw13, ds13, dw2, ds2, s0);
  } else {
    const ExpertWeights& e = weights->routed_expert(logical);
    copy_to_device(dw13, e.w13, s0);
    copy_to_device(ds13, e.w13_scale, s0);
    copy_to_device(dw2, e.w2, s0);
    copy_to_device(ds2, e.w2_scale, s0);
    wait_s0("an expert's weights upload");  // the host tensors of routed_expert() go away
  }
  slot_logical[static_cast<std::size_t>(local_slot)] = logical;
}

void GpuMoeLayer::Impl::load_shared() {
  sw13 = DeviceTensor(DType::fp8_e4m3, {1, 2 * Is, H});
  sw13_scale = DeviceTensor(DType::f32, {1, 2 * Is / 128, H / 128});
  sw2 = DeviceTensor(DType::fp8_e4m3, {1, H, Is});
  sw2_scale = DeviceTensor(DType::f32, {1, H / 128, Is / 128});
  if (synthetic) {
    synthetic_expert_fp8(synthetic->shared_seed(), H, Is, sw13.view().select(0), sw13_scale.view().select(0),
                         sw2.view().select(0), sw2_scale.view().select(0), s0);
  } else {
    const ExpertWeights& e = weights->shared_expert();
    EPMOE_CHECK(e.quant == QuantScheme::fp8, "the GPU layer's shared expert must be fp8, got {}",
                to_string(e.quant));
    copy_to_device(sw13.view().select(0), e.w13, s0);
    copy_to_device(sw13_scale.view().select(0), e.w13_scale, s0);
    copy_to_device(sw2.view().select(0), e.w2, s0);
    copy_to_device(sw2_scale.view().select(0), e.w2_scale, s0);
  }
  shared_m = DeviceTensor(DType::i32, {1});
  if (w4a8) {
    shared_q = DeviceTensor(DType::fp8_e4m3, {T_max, H});
    shared_q_scales = DeviceTensor(DType::f32, {T_max, H / 128});
  }
  MoeConfig sc = c;  // the shared expert is FP8 block-scaled whatever the routed experts are
  sc.quant = QuantScheme::fp8;
  shared_runner = make_gpu_runner(
      Layout::masked, GpuRunnerContext{sc, SlotWeights{sw13, sw13_scale, sw2, sw2_scale}, T_max, 1.0f});
  shared_out = DeviceTensor(DType::bf16, {T_max, H});
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(s0));
}

int GpuMoeLayer::Impl::install_placement(const ExpertPlacement& p) {
  EPMOE_CHECK(p.num_logical() == E && p.num_physical() == P && p.num_ranks() == ranks,
              "placement must have {} logical experts, {} slots and {} ranks, got {}, {} and {}", E, P, ranks,
              p.num_logical(), p.num_physical(), p.num_ranks());
  int rewritten = 0;
  const bool constructing = placement.num_logical() == 0;
  // The forwards in flight read the slots about to be rewritten: wait for them, bounded by the
  // communicator's timeout (the slot loads below may synchronize s0 plainly, e.g. W4A8's -8 scan).
  if (!constructing) wait_s0("the forwards before rewriting expert slots");
  // All or nothing, on every rank: a slot that cannot take its expert (W4A8 sign-magnitude codes and a
  // -8, a bad scale) throws half-way, with earlier slots (and that slot's w13) rewritten while the tables
  // still name the old experts: every later forward would send tokens to the wrong weights. So the
  // slots rewritten so far get their old experts back, and on N ranks no rank installs the placement
  // unless every rank's slots took it (a rank left on the old tables would route unlike the others).
  const std::vector<int> before = slot_logical;
  std::vector<int> touched;
  std::exception_ptr failure;
  try {
    for (int s = 0; s < L; ++s) {
      const int logical = p.phy2log()[static_cast<std::size_t>(rank * L + s)];
      if (slot_logical[static_cast<std::size_t>(s)] != logical) {
        touched.push_back(s);
        load_slot(s, logical);
        ++rewritten;
      }
    }
  } catch (...) {
    failure = std::current_exception();
  }
  // (Not at construction: a rank whose constructor throws ends the layer anyway, and the first NCCL
  // all-reduce's connection set-up would cost the first forward's start-up budget.)
  const bool others_failed = !constructing && !all_ranks_agree(failure == nullptr);
  if (failure != nullptr || others_failed) {
    restore_slots(before, touched);
    if (failure != nullptr) std::rethrow_exception(failure);
    EPMOE_FAIL(
        "rank {}: another rank's expert slots could not take the new placement; every rank keeps "
        "the previous one",
        rank);
  }
  // The tables in place, padded to the fixed width with -1.
  const std::int64_t width = P - E + 1;
  std::vector<std::int32_t> table(static_cast<std::size_t>(E * width), -1);
  for (int e = 0; e < E; ++e)
    for (int r = 0; r < p.max_replicas(); ++r)
      table[static_cast<std::size_t>(e * width + r)] =
          p.log2phy()[static_cast<std::size_t>(e * p.max_replicas() + r)];
  std::vector<std::int32_t> counts = p.logcnt();
  copy_to_device(log2phy, TensorView::contiguous(table.data(), DType::i32, {E, width}), s0);
  copy_to_device(logcnt, TensorView::contiguous(counts.data(), DType::i32, {E}), s0);
  wait_s0("the placement tables' upload");  // the host tables go away
  if (!constructing) fold_load();           // the counts so far were made under the old placement
  placement = p;
  return rewritten;
}

bool GpuMoeLayer::Impl::all_ranks_agree(bool ok) {
  if (!comm || comm->size() <= 1) return ok;
  // Ranks that failed, summed: load_sum's first word is the input, its second the sum.
  const std::int64_t failed = ok ? 0 : 1;
  std::int64_t* words = load_sum.data<std::int64_t>();
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(words, &failed, sizeof(failed), cudaMemcpyHostToDevice, s0));
  comm->all_reduce_sum_i64(words, words + 1, 1, s0);
  comm->synchronize(CommPhase::none, "the ranks' verdict on a new placement");
  std::int64_t failed_ranks = 0;
  EPMOE_CUDA_CHECK(
      cudaMemcpyAsync(&failed_ranks, words + 1, sizeof(failed_ranks), cudaMemcpyDeviceToHost, s0));
  wait_s0("the ranks' verdict on a new placement");
  return failed_ranks == 0;
}

void GpuMoeLayer::Impl::restore_slots(const std::vector<int>& before, const std::vector<int>& touched) {
  for (const int s : touched) {
    const int logical = before[static_cast<std::size_t>(s)];
    if (logical < 0) continue;  // (never loaded: the layer's construction failed, and the layer with it)
    try {
      load_slot(s, logical);  // these experts were in place before: they load again
    } catch (const std::exception& e) {
      EPMOE_FAIL(
          "rank {}: putting expert {} back into slot {} after a failed placement failed too ({}); "
          "this layer's expert slots are inconsistent: build a new layer",
          rank, logical, s, e.what());
    }
  }
  wait_s0("restoring the previous experts");
}

void GpuMoeLayer::Impl::fold_load() {
  wait_s0("the forwards before reading the expert load");
  const HostTensor counts = to_host(slot_counts, s0);
  const auto* now = counts.data<std::int64_t>();
  const std::vector<std::int32_t>& phy2log = placement.phy2log();
  for (std::int64_t slot = 0; slot < P; ++slot) {
    const auto s = static_cast<std::size_t>(slot);
    load_carry[static_cast<std::size_t>(phy2log[s])] += now[slot] - slot_base[s];
    slot_base[s] = now[slot];
  }
}

void GpuMoeLayer::Impl::shared_forward(TensorView x, std::int64_t T, cudaStream_t ss) {
  // One group of T rows through the masked grouped GEMM (masked_m written in the stream order, so a
  // captured graph carries it).
  if (w4a8)  // the shared expert is FP8 block-scaled: per-token-group activations of its own
    quantize_per_token_group_fp8(x, rows_of(shared_q, T), rows_of(shared_q_scales, T), ss,
                                 ScaleLayout::token_major, c.power_of_two_scales);
  shared_experts(T, ss);
}

void GpuMoeLayer::Impl::shared_experts(std::int64_t T, cudaStream_t ss) {
  const DeviceTensor& sq = w4a8 ? shared_q : q;
  const DeviceTensor& sqs = w4a8 ? shared_q_scales : q_scales;
  layer_detail::fill_i32(shared_m, static_cast<std::int32_t>(T), ss);
  DispatchOutput d;  // the masked layout of one group holding all T tokens
  d.layout = Layout::masked;
  d.format = ActivationFormat::fp8_group;
  d.num_local_experts = 1;
  d.num_recv_tokens = T;
  d.rows = sq.view().reshaped({1, T, H});
  d.scales = sqs.view().reshaped({1, T, H / 128});
  d.masked_m = shared_m;
  d.expected_m = T;
  shared_runner->run(d, rows_of(shared_out, T), ss);
}

DispatchOutput GpuMoeLayer::Impl::dispatch(ModePath& p, int part, std::int64_t row0, std::int64_t T) {
  DispatchOutput d;
  if (!p.dispatcher) {
    const PermuteInput in{rows_of(q, T), rows_of(q_scales, T), rows_of(physical_ids, T)};
    d.format = format;
    d.tensor_scale = w4a8 ? a1_scale : 1.0f;
    d.num_local_experts = L;
    d.num_recv_tokens = T;
    if (p.normal()) {
      const ContiguousLayout out{
          p.perm_rows,    p.perm_scales, p.perm_m_indices, p.perm_row_src, rows_of(p.perm_src_row, T),
          p.perm_offsets, p.perm_counts};
      permute_contiguous(in, out, p.perm_workspace, s0);
      d.layout = Layout::contiguous;
      d.rows = p.perm_rows;
      d.scales = p.perm_scales;
      d.m_indices = p.perm_m_indices;
    } else {
      const MaskedLayout out{p.perm_rows.view().reshaped({L, p.M_max, H}),
                             p.perm_scales.view().reshaped({L, p.M_max, H / 128}), p.perm_counts,
                             p.perm_row_src.view().reshaped({L, p.M_max}), rows_of(p.perm_src_row, T)};
      permute_masked(in, out, p.perm_workspace, s0);
      d.layout = Layout::masked;
      d.rows = out.rows;
      d.scales = out.scales;
      d.masked_m = p.perm_counts;
      d.expected_m = std::max<std::int64_t>(1, (T * K + L - 1) / L);
    }
    return d;
  }
  const DispatchInput in = dispatch_input(row0, T);
  LowLatencyDispatcher* ll = p.lls[part];
  if (ll != nullptr && !whole_dispatch) {
    ll->dispatch_send(in);
    ll->dispatch_recv(d);
  } else {
    std::span<DispatchOutput> outs(&d, 1);
    p.dispatchers[part]->dispatch(std::span<const DispatchInput>(&in, 1), outs);
  }
  return d;
}

void GpuMoeLayer::Impl::combine(ModePath& p, int part, const DispatchOutput& d, std::int64_t T,
                                TensorView y) {
  const DeviceTensor& out_buffer = part == 0 ? p.expert_out : p.expert_out2;
  if (!p.dispatcher) {
    gather_weighted(rows_of(out_buffer, d.num_output_rows()), rows_of(p.perm_src_row, T),
                    rows_of(topk_weights, T), y, s0);
    return;
  }
  const TensorView out = rows_of(out_buffer, d.num_output_rows());
  if (LowLatencyDispatcher* ll = p.lls[part]) {
    ll->combine_send(out);
    ll->combine_recv(y);
  } else {
    p.dispatchers[part]->combine(std::span<const TensorView>(&out, 1), std::span<const TensorView>(&y, 1));
  }
}

std::int64_t GpuMoeLayer::Impl::check_io(const TensorView& x, const TensorView& y, const ModePath& p) const {
  expect_rank(x, 2, "x");
  const std::int64_t T = x.size(0);
  for (const auto& [t, name] : {std::pair{&x, "x"}, std::pair{&y, "y"}}) {
    expect_shape(*t, {T, H}, name);
    expect_device_tensor(*t, DType::bf16, name, 2);
  }
  if (p.normal() || p.T_max == T_max) {
    EPMOE_CHECK(T <= p.T_max, "x has {} tokens, more than the layer's buffers hold (max_tokens = {})", T,
                p.T_max);
  } else {  // auto mode, where decode batches stop at max_tokens_per_rank
    EPMOE_CHECK(T <= p.T_max,
                "x has {} tokens, more than the layer's low-latency buffers hold (max_tokens_per_rank = {}): "
                "a batch this large is a prefill batch",
                T, p.T_max);
  }
  return T;
}

void GpuMoeLayer::Impl::forward(ModePath& p, TensorView x, TensorView y) {
  const std::int64_t T = check_io(x, y, p);
  last_T = T;
  const bool timed = o.timing && !capturing;
  timing_forward = timed;
  span_recorded = 0;
  auto mark = [&](int id, cudaStream_t s) {
    if (timed) events[static_cast<std::size_t>(id)].record(s);
  };
  if (T == 0 && !p.dispatcher) return;

  mark(kStart, s0);
  gate->run(x, gate_weight, rows_of(logits, T), s0);
  route(c, rows_of(logits, T), correction_bias, rows_of(topk_ids, T), rows_of(topk_weights, T), s0);
  const PlacementView pv{log2phy, logcnt, ranks, L};
  map_to_physical(pv, rows_of(topk_ids, T), rows_of(physical_ids, T), rank, c.dispatch_algorithm, s0, 0);
  if (w4a8) {
    quantize_per_tensor_fp8(x, rows_of(q, T), a1_scale, s0);
  } else {
    quantize_per_token_group_fp8(x, rows_of(q, T), rows_of(q_scales, T), s0, ScaleLayout::token_major,
                                 c.power_of_two_scales);
  }
  mark(kRouted, s0);

  // The shared expert, and the per-slot load count (bookkeeping): forked onto s1, off the critical
  // path (overlapped with dispatch and the routed experts), or inline. s0 joins s1 before the final
  // add, so the next forward's mapping cannot overwrite physical_ids under the count.
  const bool shared = c.num_shared_experts > 0 && T > 0;
  const bool fork_side = shared && p.own_shared_stream;
  cudaStream_t ss = s0;
  if (fork_side) {
    ss = s1.get();
    fork.record(s0);
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(ss, fork, 0));
  }
  count_experts(rows_of(physical_ids, T), slot_counts, ss);
  if (shared) {
    mark(kNumEvents, ss);
    shared_forward(x, T, ss);
    mark(kNumEvents + 1, ss);
  }
  if (fork_side) join.record(ss);

  const TensorView y_out = shared ? rows_of(y_routed, T) : y;
  if (!tbo) {
    span_mark(kSpanDispatch0, false, s0);
    last_dispatch = dispatch(p, 0, 0, T);  // kept (not copied) for time_gemms_alone()
    last_dispatch_path = &p;
    has_last_dispatch = has_last_dispatch || !capturing;
    const DispatchOutput& d = last_dispatch;
    mark(kDispatched, s0);
    span_mark(kSpanDispatch0, true, s0);
    span_mark(kSpanGemm0, false, s0);
    run_experts(p, d, p.expert_out, s0);
    span_mark(kSpanGemm0, true, s0);
    mark(kComputed, s0);
    span_mark(kSpanCombine0, false, s0);
    combine(p, 0, d, T, y_out);
    span_mark(kSpanCombine0, true, s0);
  } else if (!p.normal() && p.lls[0] != nullptr) {
    // Two micro-batches through the send / receive halves: both sends go out at once; A's experts
    // run on s2 while B's receive and, later, A's combine send run on s0; B's experts overlap A's
    // combine. (Each micro-batch reads the expert weights again: it pays where communication, not
    // the weight read, bounds a step.)
    const std::int64_t T_a = first_micro_batch(T), T_b = T - T_a;
    span_mark(kSpanDispatch0, false, s0);
    p.lls[0]->dispatch_send(dispatch_input(0, T_a));
    span_mark(kSpanDispatch1, false, s0);
    p.lls[1]->dispatch_send(dispatch_input(T_a, T_b));
    DispatchOutput d[2];
    for (int part = 0; part < 2; ++part) {
      p.lls[part]->dispatch_recv(d[part]);
      span_mark(kSpanDispatch0 + part, true, s0);
      if (part == 1) mark(kDispatched, s0);
      dispatched[part].record(s0);
      EPMOE_CUDA_CHECK(cudaStreamWaitEvent(s2, dispatched[part], 0));
      span_mark(kSpanGemm0 + part, false, s2);
      run_experts(p, d[part], part == 0 ? p.expert_out : p.expert_out2, s2);
      span_mark(kSpanGemm0 + part, true, s2);
      computed[part].record(s2);
    }
    for (int part = 0; part < 2; ++part) {
      EPMOE_CUDA_CHECK(cudaStreamWaitEvent(s0, computed[part], 0));
      span_mark(kSpanCombine0 + part, false, s0);
      p.lls[part]->combine_send(rows_of(part == 0 ? p.expert_out : p.expert_out2, d[part].num_output_rows()));
    }
    mark(kComputed, s0);
    p.lls[0]->combine_recv(y_out.slice_rows(0, T_a));
    span_mark(kSpanCombine0, true, s0);
    p.lls[1]->combine_recv(y_out.slice_rows(T_a, T));
    span_mark(kSpanCombine1, true, s0);
  } else {
    // Two micro-batches: B's dispatch overlaps A's GEMMs, A's combine overlaps B's GEMMs.
    const std::int64_t T_a = first_micro_batch(T), T_b = T - T_a;
    span_mark(kSpanDispatch0, false, s0);
    const DispatchOutput da = dispatch(p, 0, 0, T_a);
    span_mark(kSpanDispatch0, true, s0);
    dispatched[0].record(s0);
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(s2, dispatched[0], 0));
    span_mark(kSpanGemm0, false, s2);
    run_experts(p, da, p.expert_out, s2);
    span_mark(kSpanGemm0, true, s2);
    computed[0].record(s2);
    span_mark(kSpanDispatch1, false, s0);
    const DispatchOutput db = dispatch(p, 1, T_a, T_b);
    span_mark(kSpanDispatch1, true, s0);
    mark(kDispatched, s0);
    dispatched[1].record(s0);
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(s2, dispatched[1], 0));
    span_mark(kSpanGemm1, false, s2);
    run_experts(p, db, p.expert_out2, s2);
    span_mark(kSpanGemm1, true, s2);
    computed[1].record(s2);
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(s0, computed[0], 0));
    span_mark(kSpanCombine0, false, s0);
    combine(p, 0, da, T_a, y_out.slice_rows(0, T_a));
    span_mark(kSpanCombine0, true, s0);
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(s0, computed[1], 0));
    mark(kComputed, s0);
    span_mark(kSpanCombine1, false, s0);
    combine(p, 1, db, T_b, y_out.slice_rows(T_a, T));
    span_mark(kSpanCombine1, true, s0);
  }
  if (shared) {
    if (fork_side) EPMOE_CUDA_CHECK(cudaStreamWaitEvent(s0, join, 0));
    layer_detail::add_bf16(rows_of(y_routed, T), rows_of(shared_out, T), y, s0);
  }
  mark(kCombined, s0);

  if (timed) {
    wait_event(events[kCombined], "a timed forward");
    auto ms = [&](int a, int b) {
      return static_cast<double>(
          Event::elapsed_ms(events[static_cast<std::size_t>(a)], events[static_cast<std::size_t>(b)]));
    };
    // With two-batch overlap the phases overlap: dispatch ends with B's dispatch, gemm with B's
    // GEMMs (A's combine inside it), combine is B's.
    times.route += ms(kStart, kRouted);
    times.dispatch += ms(kRouted, kDispatched);
    times.gemm += ms(kDispatched, kComputed);
    times.combine += ms(kComputed, kCombined);
    times.total += ms(kStart, kCombined);
    if (shared) times.shared += ms(kNumEvents, kNumEvents + 1);
    ++times.forwards;
    // The spans, from the forward's start (events recorded in this forward only).
    spans = GpuForwardSpans{};
    spans.route = {0.0, ms(kStart, kRouted)};
    spans.total = {0.0, ms(kStart, kCombined)};
    if (shared) spans.shared = {ms(kStart, kNumEvents), ms(kStart, kNumEvents + 1)};
    spans.shared_on_own_stream = fork_side;
    spans.gemm_on_compute_stream = tbo;
    auto span_ms = [&](int span) -> GpuForwardSpans::Span {
      const unsigned both = 3u << (2 * span);
      if ((span_recorded & both) != both) return {-1.0, -1.0};
      auto since_start = [&](int i) {
        return static_cast<double>(
            Event::elapsed_ms(events[kStart], span_events[static_cast<std::size_t>(i)]));
      };
      return {since_start(2 * span), since_start(2 * span + 1)};
    };
    for (int part = 0; part < 2; ++part) {
      spans.dispatch[static_cast<std::size_t>(part)] = span_ms(kSpanDispatch0 + part);
      spans.gemm[static_cast<std::size_t>(part)] = span_ms(kSpanGemm0 + part);
      spans.combine[static_cast<std::size_t>(part)] = span_ms(kSpanCombine0 + part);
    }
  }
}

std::size_t GpuMoeLayer::Impl::comm_layout_bytes() const {
  std::size_t bytes = 0;
  for (const DeviceTensor* t : {&logits, &topk_ids, &topk_weights, &physical_ids, &expert_counts,
                                &slot_counts, &q, &q_scales, &log2phy, &logcnt})
    bytes += t->nbytes();
  for (const ModePath& p : paths) {
    for (const DeviceTensor* t : {&p.perm_workspace, &p.perm_rows, &p.perm_scales, &p.perm_m_indices,
                                  &p.perm_row_src, &p.perm_src_row, &p.perm_offsets, &p.perm_counts})
      bytes += t->nbytes();
    bytes += p.dispatcher_bytes;
  }
  return bytes;
}

std::size_t GpuMoeLayer::Impl::device_bytes() const {
  std::size_t bytes = comm_layout_bytes();  // includes the dispatchers' memory
  for (const DeviceTensor* t :
       {&gate_weight, &correction_bias, &w13,      &w13_scale, &w2,       &w2_scale,
        &sw13,        &sw13_scale,      &sw2,      &sw2_scale, &shared_m, &shared_out,
        &stage_w13,   &stage_s13,       &stage_w2, &stage_s2,  &shared_q, &shared_q_scales,
        &y_routed,    &x_static,        &y_static})
    bytes += t->nbytes();
  for (const ModePath& p : paths)
    if (p.runner) bytes += p.expert_out.nbytes() + p.expert_out2.nbytes() + p.runner->workspace_bytes();
  return bytes + (shared_runner ? shared_runner->workspace_bytes() : 0);
}

// ---------------------------------------------------------------- GpuMoeLayer

GpuMoeLayer::GpuMoeLayer(std::shared_ptr<const ModelWeights> weights, GpuLayerOptions options,
                         std::shared_ptr<Communicator> comm)
    : impl_(std::make_unique<Impl>(std::move(weights), std::move(options), std::move(comm))) {}

GpuMoeLayer::~GpuMoeLayer() = default;

const MoeConfig& GpuMoeLayer::config() const {
  return impl_->c;
}
const GpuLayerOptions& GpuMoeLayer::options() const {
  return impl_->o;
}
int GpuMoeLayer::rank() const {
  return impl_->rank;
}
int GpuMoeLayer::num_ranks() const {
  return impl_->ranks;
}
bool GpuMoeLayer::shared_expert_on_own_stream(BatchKind kind) const {
  return impl_->path_for(kind).own_shared_stream;
}
std::int64_t GpuMoeLayer::max_tokens() const {
  return impl_->T_max;
}
cudaStream_t GpuMoeLayer::stream() const {
  return impl_->s0;
}
const GpuPhaseTimes& GpuMoeLayer::times() const {
  return impl_->times;
}
const GpuForwardSpans& GpuMoeLayer::last_spans() const {
  return impl_->spans;
}
void GpuMoeLayer::reset_times() {
  impl_->times = GpuPhaseTimes{};
}
void GpuMoeLayer::set_timing(bool on) {
  impl_->o.timing = on;
}
std::size_t GpuMoeLayer::device_bytes() const {
  return impl_->device_bytes();
}
std::size_t GpuMoeLayer::comm_layout_bytes() const {
  return impl_->comm_layout_bytes();
}
std::size_t GpuMoeLayer::dispatcher_setup_bytes() const {
  return impl_->dispatcher_setup_bytes;
}
std::string GpuMoeLayer::dispatcher_name(BatchKind kind) const {
  return impl_->path_for(kind).dispatcher_name;
}
const ExpertPlacement& GpuMoeLayer::placement() const {
  return impl_->placement;
}
std::size_t GpuMoeLayer::graphs_captured() const {
  return impl_->graphs.size();
}

TensorView GpuMoeLayer::last_logits() const {
  return rows_of(impl_->logits, impl_->last_T);
}

void GpuMoeLayer::forward(TensorView x, TensorView y) {
  impl_->forward(impl_->single_path(), x, y);
  ++impl_->forwards_since_reset;
}

void GpuMoeLayer::forward(TensorView x, TensorView y, BatchKind kind) {
  impl_->forward(impl_->path_for(kind), x, y);
  ++impl_->forwards_since_reset;
}

GpuMoeLayer::GemmTimes GpuMoeLayer::time_gemms_alone(int reps) {
  Impl& m = *impl_;
  EPMOE_CHECK(reps >= 1, "time_gemms_alone: reps must be >= 1, got {}", reps);
  EPMOE_CHECK(m.has_last_dispatch,
              "time_gemms_alone() needs an eager forward without two-batch overlap first");
  m.wait_s0("the forwards before timing the GEMMs alone");
  Event start, end;
  auto time = [&](auto&& step) {
    step();  // warm-up
    start.record(m.s0);
    for (int i = 0; i < reps; ++i) step();
    end.record(m.s0);
    end.synchronize();
    return static_cast<double>(Event::elapsed_ms(start, end)) / reps;
  };
  GemmTimes t;
  const ModePath& p = *m.last_dispatch_path;
  t.routed_ms = time([&] { Impl::run_experts(p, m.last_dispatch, p.expert_out, m.s0); });
  if (m.shared_runner && m.last_T > 0) t.shared_ms = time([&] { m.shared_experts(m.last_T, m.s0); });
  return t;
}

void GpuMoeLayer::capture_graphs(std::span<const std::int64_t> batch_sizes) {
  Impl& m = *impl_;
  EPMOE_CHECK(m.serves(Mode::low_latency),
              "CUDA graphs serve the low-latency mode (normal mode syncs the host)");
  ModePath& p = m.path_for(Mode::low_latency);
  for (const std::int64_t T : batch_sizes) {
    EPMOE_CHECK(T >= 0 && T <= p.T_max, "graph batch size {} must be in [0, {}]", T, p.T_max);
    if (m.graphs.count(T)) continue;
    cudaGraph_t graph = nullptr;
    // (`capturing` is cleared on every way out: left set, it would keep every later eager forward
    // untimed.)
    m.capturing = true;
    if (const cudaError_t begun = cudaStreamBeginCapture(m.s0, cudaStreamCaptureModeThreadLocal);
        begun != cudaSuccess) {
      m.capturing = false;
      EPMOE_CUDA_CHECK(begun);
    }
    try {
      m.forward(p, rows_of(m.x_static, T), rows_of(m.y_static, T));
    } catch (...) {
      m.abandon_capture();
      throw;
    }
    const cudaError_t ended = cudaStreamEndCapture(m.s0, &graph);
    m.capturing = false;
    EPMOE_CUDA_CHECK(ended);
    m.graphs.emplace(T, Graph::instantiate(graph));
  }
}

void GpuMoeLayer::forward_graph(TensorView x, TensorView y) {
  Impl& m = *impl_;
  EPMOE_CHECK(m.serves(Mode::low_latency),
              "CUDA graphs serve the low-latency mode (normal mode syncs the host)");
  const std::int64_t T = m.check_io(x, y, m.path_for(Mode::low_latency));
  const std::int64_t sizes[] = {T};
  capture_graphs(sizes);
  // Kernel copies, not cudaMemcpyAsync (layer_detail::copy_bf16 says why).
  if (x.data != m.x_static.view().data) layer_detail::copy_bf16(x, m.x_static.view().slice_rows(0, T), m.s0);
  m.graphs.at(T).launch(m.s0);
  ++m.forwards_since_reset;
  m.last_T = T;
  if (y.data != m.y_static.view().data) layer_detail::copy_bf16(m.y_static.view().slice_rows(0, T), y, m.s0);
}

namespace {
// A device i64 counter array summed over the ranks, on the host (collective), through `sum` (at least
// as large; allocated once: a cudaFree here waited for the whole device, and on loopback ranks sharing
// one GPU a peer's next dispatch then waited for this rank until the communicator's timeout).
std::vector<std::int64_t> sum_over_ranks(const DeviceTensor& counts, const DeviceTensor& sum_buffer,
                                         const std::shared_ptr<Communicator>& comm, cudaStream_t stream) {
  const std::int64_t n = counts.numel();
  const TensorView sum = sum_buffer.view().slice_rows(0, n);
  if (comm && comm->size() > 1) {
    comm->all_reduce_sum_i64(counts.data<std::int64_t>(), sum.as<std::int64_t>(), static_cast<std::size_t>(n),
                             stream);
    comm->synchronize(CommPhase::none, "the load counters' sum over the ranks");  // bounded: stream is comm's
  } else {
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(sum.as<std::int64_t>(), counts.data<std::int64_t>(), sum.nbytes(),
                                     cudaMemcpyDeviceToDevice, stream));
  }
  HostTensor host = to_host(sum, stream);
  return std::vector<std::int64_t>(host.data<std::int64_t>(), host.data<std::int64_t>() + n);
}
}  // namespace

std::vector<std::int64_t> GpuMoeLayer::expert_load() {
  Impl& m = *impl_;
  m.fold_load();
  copy_to_device(m.expert_counts,
                 TensorView::contiguous(m.load_carry.data(), DType::i64, {static_cast<std::int64_t>(m.E)}),
                 m.s0);
  return sum_over_ranks(m.expert_counts, m.load_sum, m.comm, m.s0);
}
std::vector<std::int64_t> GpuMoeLayer::slot_load() {
  return sum_over_ranks(impl_->slot_counts, impl_->load_sum, impl_->comm, impl_->s0);
}

void GpuMoeLayer::reset_load() {
  Impl& m = *impl_;
  EPMOE_CUDA_CHECK(cudaMemsetAsync(m.slot_counts.data<std::int64_t>(), 0, m.slot_counts.nbytes(), m.s0));
  m.wait_s0("clearing the load counters");
  std::fill(m.load_carry.begin(), m.load_carry.end(), 0);
  std::fill(m.slot_base.begin(), m.slot_base.end(), 0);
  m.forwards_since_reset = 0;
}

double GpuMoeLayer::weight_read_tokens() const {
  // One expert's weights read from HBM against one token's share of its GEMMs (6·H·I flops), at the
  // rates our kernels reach on an H200: 4269 GB/s (copy) and ~660 TFLOP/s (grouped FP8 GEMM;
  // bench/NOTES.md). FP8: 44 MB -> ~77 tokens; W4A8 (half the bytes): ~39.
  const Impl& m = *impl_;
  const double weight_bytes =
      static_cast<double>(m.w13.nbytes() + m.w13_scale.nbytes() + m.w2.nbytes() + m.w2_scale.nbytes()) /
      std::max(1, m.L);
  const double flops_per_token = 6.0 * static_cast<double>(m.H) * static_cast<double>(m.I);
  return (weight_bytes / 4269e9) / (flops_per_token / 660e12);
}

int GpuMoeLayer::rebalance(int nodes, double slot_cost_tokens) {
  Impl& m = *impl_;
  EPMOE_CHECK(std::isfinite(slot_cost_tokens) && (slot_cost_tokens >= 0 || slot_cost_tokens == -1.0),
              "rebalance: slot_cost_tokens must be -1 (the layer's estimate) or finite and >= 0, got {}",
              slot_cost_tokens);
  const std::vector<std::int64_t> counts = expert_load();
  const std::vector<double> load(counts.begin(), counts.end());
  // The load counters sum over the forwards since the last reset: the per-forward slot cost scales alike.
  const double per_forward = slot_cost_tokens < 0 ? weight_read_tokens() : slot_cost_tokens;
  const double slot_cost = per_forward * static_cast<double>(m.forwards_since_reset);
  const int rewritten =
      m.install_placement(rebalance_placement(placement(), load, m.c.num_groups, nodes, slot_cost));
  reset_load();
  return rewritten;
}

int GpuMoeLayer::set_placement(const ExpertPlacement& placement) {
  return impl_->install_placement(placement);
}

}  // namespace epmoe::cuda
