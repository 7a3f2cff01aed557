// What the GPU dispatchers (nvlink / nvlink-ll, nccl-p2p) share: the whole calls made of their halves,
// the checks of their context and inputs, the routing workspace and the receive-side buffers of both
// layouts.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/ep_kernels.hpp"
#include "epmoe/comm.hpp"
#include "epmoe/comm_dispatch.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/dispatch.hpp"

namespace epmoe::comm_detail {

class GpuDispatcherBase : public LowLatencyDispatcher {
 public:
  std::string name() const override { return name_; }
  Layout layout() const override { return contiguous() ? Layout::contiguous : Layout::masked; }
  const DispatcherContext& context() const override { return context_; }
  // One rank's whole calls: both halves in a row (combine() checks y before anything is sent).
  void dispatch(std::span<const DispatchInput> inputs, std::span<DispatchOutput> outputs) override;
  void combine(std::span<const TensorView> expert_out, std::span<const TensorView> y) override;
  void dispatch_send(const DispatchInput& in) override { send(in, /*whole=*/false); }
  void dispatch_recv(DispatchOutput& out) override { recv(out, nullptr); }

 protected:
  GpuDispatcherBase(std::string name, const DispatcherContext& context, std::shared_ptr<Communicator> comm);

  // The transport's halves of a dispatch. `whole`: called by dispatch(), whose recv follows at once;
  // `own`: the input of that whole call (nullptr after a separate dispatch_send).
  virtual void send(const DispatchInput& in, bool whole) = 0;
  virtual void recv(DispatchOutput& out, const DispatchInput* own) = 0;

  // Shapes, dtypes, device and alignment of one rank's input; returns T.
  std::int64_t validate_input(const DispatchInput& in) const;
  // A combine's inputs: expert_out [rows of the last dispatch's output, H] bf16 (after a dispatch), y
  // [T of the last dispatch, H] bf16.
  void validate_expert_out(const TensorView& expert_out) const;
  void validate_y(const TensorView& y) const;
  // Makes the communicator's device current and throws if an earlier error left it unusable; counts
  // the host calls (for a timed-out wait's message: which calls this rank made). `what` is a string
  // literal (kept as a view: no allocation per call).
  void enter(std::string_view what) const;
  std::string host_calls() const;  // "dispatch 2, combine_send 1, ... (last: combine_send)"

  DType row_dtype() const {
    return context_.format == ActivationFormat::bf16 ? DType::bf16 : DType::fp8_e4m3;
  }
  bool contiguous() const { return context_.mode == Mode::normal; }
  // The output of the last dispatch (views into the buffers below).
  void fill_output(DispatchOutput& out, std::int64_t rows_or_m_sum, std::int64_t recv_tokens,
                   float tensor_scale, std::vector<std::int64_t> expert_offsets,
                   std::int64_t expected_m) const;
  PlaceArgs place_outputs() const;
  // The send kernel's arguments from one rank's input and this dispatch's routing tables (the
  // transport adds its destinations, flags, sync and grid): T tokens (none where host_status refused
  // the input), this rank's count row at `count_row`; skip_self for whole calls (place reads the
  // own tokens from x).
  SendArgs send_inputs(const DispatchInput& in, std::int64_t T, std::int32_t host_status,
                       const std::int32_t* count_row, bool whole) const;
  // Place's own-token arguments (PlaceArgs::own_x ..., for the whole calls whose send skipped this rank):
  // `own` is the input of the last dispatch_send, its T last_T_, its routing tables this dispatch's.
  void place_own_inputs(PlaceArgs& p, const DispatchInput& own) const;
  // The combine kernels' arguments from the last dispatch's tables (the transport adds its destinations,
  // flags and sync).
  ReduceArgs reduce_inputs(const TensorView& expert_out) const;
  HomeArgs home_inputs(const TensorView& y) const;
  // expected_m where the host does not learn the counts: T * ranks * top-k / physical experts (>= 1).
  std::int64_t estimated_m(std::int64_t T) const;
  // The last dispatch's statistics read from the device (for the dispatches that never sync the host
  // for them): this rank's tokens per destination from the routing's count row, its rows from
  // m_indices (contiguous, output_rows_ of them) or masked_m. `dispatch_seq` numbers the dispatches
  // (stats_ is re-read once per dispatch). Synchronises the stream (bounded): not inside a capture.
  // `count_row`: where the routing wrote this rank's count row (nullptr: count_row_).
  const DispatchStats& stats_from_device(std::uint32_t dispatch_seq,
                                         const std::int32_t* count_row = nullptr) const;
  // Bytes of the buffers below.
  std::size_t base_buffer_bytes() const;

  std::string name_;
  mutable std::vector<std::pair<std::string_view, int>> host_calls_;  // in first-call order
  mutable std::string_view last_call_;
  DispatcherContext context_;
  std::shared_ptr<Communicator> comm_;
  EpGeometry g_;
  std::int64_t max_rows_ = 0;  // contiguous: contiguous_rows_bound(config, T_max); masked: L * M_max
  std::int64_t M_max_ = 0;

  // Routing (persists from a dispatch to its combine).
  cuda::DeviceBuffer bitmaps_, prefix_, count_row_;
  // Receive side.
  cuda::DeviceBuffer rows_, scales_, m_indices_, masked_m_, row_token_, row_weight_;
  cuda::DeviceBuffer recv_rows_, recv_src_, recv_slot_, recv_total_;
  std::int64_t last_T_ = 0;
  std::int64_t output_rows_ = 0;  // rows of the last dispatch's output
  bool dispatched_ = false;
  mutable DispatchStats stats_;          // mutable: read from the device when asked (stats_from_device)
  mutable std::uint32_t stats_seq_ = 0;  // the dispatch whose statistics stats_ holds
};

// dest[d] table of N device pointers.
cuda::DeviceBuffer upload_pointers(const std::vector<void*>& pointers);

}  // namespace epmoe::comm_detail
