// Dispatch and combine (design.md §3, §6): tokens move to the ranks that own their experts and
// weighted results come home.
//
// A Dispatcher serves the ranks whose data this process holds: one for a GPU process, all N for
// the CPU simulation. Each call is collective over those ranks.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "epmoe/config.hpp"
#include "epmoe/eplb.hpp"
#include "epmoe/registry.hpp"
#include "epmoe/tensor.hpp"
#include "epmoe/weights.hpp"

namespace epmoe {

class Communicator;  // epmoe/comm.hpp

enum class Layout : std::uint8_t { token_major, contiguous, masked };
std::string_view to_string(Layout layout);

// Rows of each local expert's block in the contiguous layout are padded to this multiple.
inline constexpr std::int64_t kContiguousAlign = 128;

// One rank's activations ready to send, token-major, already quantized as the runner wants.
struct DispatchInput {
  TensorView x;              // [T, H]: bf16 (format bf16) or fp8 (fp8_group / fp8_tensor)
  TensorView x_scales;       // fp8_group: [T, H/128] f32; otherwise empty
  float x_tensor_scale = 1;  // fp8_tensor: the static scale
  TensorView topk_ids;       // [T, K] i32 physical expert ids in [0, P)
  TensorView topk_weights;   // [T, K] f32
};

// One rank's received tokens in one layout. Views into buffers the dispatcher owns; valid until
// its next dispatch.
struct DispatchOutput {
  Layout layout = Layout::token_major;
  ActivationFormat format = ActivationFormat::bf16;
  int num_local_experts = 0;
  std::int64_t num_recv_tokens = 0;  // distinct tokens this rank received (each at most once)

  TensorView rows;            // token_major [T, H]; contiguous [M_sum, H]; masked [E_local, M_max, H]
  TensorView scales;          // fp8_group: rows' shape with H -> H/128, f32; otherwise empty
  float tensor_scale = 1.0f;  // fp8_tensor

  // token_major: per (token, k) the local expert index, or -1 when another rank owns it.
  TensorView local_ids;      // [T, K] i32
  TensorView local_weights;  // [T, K] f32

  // contiguous (M_sum: the exact rows, or contiguous_rows_bound() without a host sync)
  TensorView m_indices;                      // [M_sum] i32, local expert per row, -1 on padding
  std::vector<std::int64_t> expert_offsets;  // [E_local + 1] first row of each expert (host; empty
                                             // without a host sync)

  // masked
  TensorView masked_m;          // [E_local] i32 valid rows per expert
  std::int64_t expected_m = 0;  // mean rows per touched expert, a hint for tile choice

  // contiguous / masked: per row, which received token it holds (-1 on padding) and its weight.
  // Received tokens (and each expert's rows) are ordered by source rank, then source token; in the
  // masked layout the source order starts at the receiving rank (me, me + 1, ..., me - 1 mod N).
  TensorView row_token;   // [rows] i32 (masked: flattened [E_local * M_max])
  TensorView row_weight;  // [rows] f32

  // Rows of the expert output a runner writes for this dispatch: token_major T*K (row t*K + k),
  // contiguous M_sum, masked E_local * M_max.
  std::int64_t num_output_rows() const;
};

struct DispatcherContext {
  MoeConfig config;
  Mode mode = Mode::normal;
  ActivationFormat format = ActivationFormat::fp8_group;
  int first_rank = 0;  // ranks served are [first_rank, first_rank + num_ranks_served)
  int num_ranks_served = 1;
  // Normal mode: true, the host learns the exact row counts of the contiguous layout once per
  // dispatch (one wait); false, no host sync at all: the layout has contiguous_rows_bound() rows,
  // those past the last expert block -1 in m_indices and row_token (the GEMMs skip them),
  // expert_offsets is empty and num_recv_tokens -1. (Low-latency mode never syncs.)
  bool host_sync = true;
  // The GPU dispatchers' communicator ("nvlink", "nvlink-ll", "nccl-p2p" made by name); null: the
  // thread's or process's default (Communicator::process_default()). The CPU ones take none.
  std::shared_ptr<Communicator> communicator;
};

// The contiguous layout's worst case on one rank: each of ranks x tokens_per_rank tokens at most
// min(K, E_local) rows here, in expert blocks padded to kContiguousAlign (contiguous_capacity of
// those rows; a multiple of kContiguousAlign).
std::int64_t contiguous_rows_bound(const MoeConfig& config, std::int64_t tokens_per_rank);

struct DispatchStats {
  std::vector<std::int64_t> tokens_sent;    // per served rank: (token, destination) pairs to other ranks
  std::vector<std::int64_t> bytes_sent;     // per served rank: payload bytes to other ranks
  std::vector<std::int64_t> rows_received;  // per served rank: expert rows after fan-out
};

class Dispatcher {
 public:
  virtual ~Dispatcher() = default;
  virtual std::string name() const = 0;
  virtual Layout layout() const = 0;
  virtual const DispatcherContext& context() const = 0;

  // inputs[i] and outputs[i] belong to rank first_rank + i. Refuses (before moving anything)
  // physical ids out of range, more tokens than the buffers hold, and malformed shapes.
  virtual void dispatch(std::span<const DispatchInput> inputs, std::span<DispatchOutput> outputs) = 0;

  // expert_out[i]: bf16 [outputs[i].num_output_rows(), H] from the runner, for the last dispatch.
  // y[i] (out): [T_i, H] bf16, Σ_k w[t,k]·E_k(x[t]) for rank i's tokens; each rank reduces its
  // own experts' rows per token first and sends home one partial sum per (token, rank).
  virtual void combine(std::span<const TensorView> expert_out, std::span<const TensorView> y) = 0;

  virtual const DispatchStats& last_stats() const = 0;

  // Device memory this dispatcher holds (communication windows, receive-side layout, routing
  // workspace), in bytes; 0 for the CPU dispatchers.
  virtual std::size_t device_bytes() const { return 0; }
};

using DispatcherRegistry = Registry<Dispatcher, DispatcherContext>;

// "cpu-local" (one rank, token-major), "cpu-sim" (N ranks simulated in one process; normal mode ->
// contiguous, low-latency -> masked).
std::unique_ptr<Dispatcher> make_dispatcher(const std::string& name, const DispatcherContext& context);

}  // namespace epmoe
