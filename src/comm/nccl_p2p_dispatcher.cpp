// "nccl-p2p": dispatch / combine over ncclSend / ncclRecv (epmoe/comm_dispatch.hpp).
//
// dispatch_send: route (device; this rank's count row: tokens per destination, rows per physical
// expert, input status) -> pack each token once per destination (whole dispatch() calls: the own
// tokens stay in x) -> grouped send/recv of the count rows and the regions, one NCCL launch.
// dispatch_recv: place (contiguous or masked layout) from every rank's count row. combine_send: reduce
// per received token -> grouped send/recv of the partial sums; combine_recv: home sums in rank order.
// Normal mode with DispatcherContext::host_sync: the host learns the counts once per dispatch (one
// bounded wait), refuses bad input on every rank alike, and sends exactly the packed bytes. Otherwise
// (low-latency mode, normal mode without the host sync) nothing waits for the host: the count rows
// travel in the same group as whole regions (T_max rows per peer), the receive sizes the layout on
// the device, and the calls can be captured in a CUDA graph.
#include <algorithm>
#include <cstring>
#include <numeric>

#include "comm/comm_internal.hpp"
#include "comm/gpu_dispatcher_base.hpp"
#include "dispatch/dispatch_common.hpp"
#include "epmoe/comm_dispatch.hpp"

namespace epmoe {
namespace {

using comm_detail::EpGeometry;

class NcclP2pDispatcher final : public comm_detail::GpuDispatcherBase {
 public:
  NcclP2pDispatcher(const DispatcherContext& context, std::shared_ptr<Communicator> comm)
      : GpuDispatcherBase("nccl-p2p", context, std::move(comm)),
        sized_on_host_(contiguous() && context.host_sync) {
    const std::size_t region = static_cast<std::size_t>(g_.T_max) * static_cast<std::size_t>(g_.row_stride);
    const std::size_t partials =
        static_cast<std::size_t>(g_.T_max) * static_cast<std::size_t>(g_.partial_bytes);
    const auto N = static_cast<std::size_t>(g_.N), me = static_cast<std::size_t>(g_.me);
    send_ = cuda::DeviceBuffer(region * N);
    recv_ = cuda::DeviceBuffer(region * N);
    comb_send_ = cuda::DeviceBuffer(partials * N);
    comb_recv_ = cuda::DeviceBuffer(partials * N);
    if (!sized_on_host_) {
      // Whole regions travel, past the slots a call packs: defined bytes (and compute-sanitizer's
      // initcheck quiet), once.
      send_.fill_bytes(0, comm_->stream());
      comb_send_.fill_bytes(0, comm_->stream());
    }
    matrix_ = cuda::DeviceBuffer(sizeof(std::int32_t) * N * static_cast<std::size_t>(g_.count_row_len()));
    std::vector<void*> dest(N), comb_dest(N);
    for (std::size_t d = 0; d < N; ++d) {
      dest[d] = d == me ? recv_.as<char>() + region * me : send_.as<char>() + region * d;
      comb_dest[d] = d == me ? comb_recv_.as<char>() + partials * me : comb_send_.as<char>() + partials * d;
    }
    dest_ = comm_detail::upload_pointers(dest);
    comb_dest_ = comm_detail::upload_pointers(comb_dest);
    void* host = nullptr;
    EPMOE_CUDA_CHECK(cudaMallocHost(&host, matrix_.size()));
    host_matrix_ = static_cast<std::int32_t*>(host);
  }
  ~NcclP2pDispatcher() override {
    if (host_matrix_ != nullptr) (void)cudaFreeHost(host_matrix_);
  }

  // Normal mode with the host sync: counted on the host in dispatch_send; otherwise read from the device
  // when asked.
  const DispatchStats& last_stats() const override {
    return sized_on_host_ ? stats_ : stats_from_device(dispatch_seq_, own_count_row());
  }
  std::size_t window_bytes() const override { return 0; }  // no symmetric memory

  void combine_send(const TensorView& expert_out) override {
    enter("combine_send");
    validate_expert_out(expert_out);
    comm_detail::ReduceArgs r = reduce_inputs(expert_out);
    r.dest = comb_dest_.as<char* const>();
    r.sync = errors_only();
    comm_detail::launch_reduce(g_, r, comm_->stream());
    // Partial sums go back the way the tokens came.
    exchange(comb_send_, comb_recv_, g_.partial_bytes, recv_tokens_, send_tokens_, /*with_count_rows=*/false,
             CommPhase::combine_send);
    combine_sent_ = true;
  }

  void combine_recv(const TensorView& y) override {
    enter("combine_recv");
    EPMOE_CHECK(combine_sent_, "{}: combine_recv needs a combine_send first", name_);
    validate_y(y);
    comm_detail::HomeArgs h = home_inputs(y);
    h.partials = comb_recv_.as<const char>();
    h.sync = errors_only();
    comm_detail::launch_home(g_, h, comm_->stream());
    combine_sent_ = false;
  }

 private:
  // Routes, packs each token once per destination (whole calls: the own tokens stay in x, place reads
  // them there; halves: into the own receive region) and exchanges the count rows and the regions.
  // Normal mode with the host sync all-gathers the count rows first, learns them (one bounded wait) and
  // refuses a bad input on every rank before anything is sent. Otherwise a refused input sends its status and
  // no token: too many tokens throws here after the exchange, ids out of range (found on the device) do not;
  // every rank's place records the status in the communicator's device error record, which its next bounded
  // wait reports. The peers' next calls (combine) may meanwhile wait in NCCL for the refusing rank until that
  // wait gives up (Communicator::synchronize aborts the communicator).
  void send(const DispatchInput& in, bool whole) override {
    enter("dispatch_send");
    const std::int64_t T = validate_input(in);
    const int me = g_.me, row_len = g_.count_row_len();
    const cudaStream_t stream = comm_->stream();
    const std::int32_t host_status = T > g_.T_max ? kInputTooManyTokens : 0;
    dispatched_ = false;
    sent_ = false;
    combine_sent_ = false;

    // Counts: computed on the device into this rank's row of matrix_ (place reads every source's row
    // there). With the host sync all-gathered now (in place) and learnt; otherwise they travel with the
    // regions (exchange), which spares an NCCL launch.
    std::int32_t* const own_row = own_count_row();
    comm_detail::launch_route(g_, in.topk_ids.as<std::int32_t>(), T, host_status, in.x_tensor_scale,
                              bitmaps_.as<std::uint32_t>(), prefix_.as<std::int32_t>(), own_row, stream);
    if (sized_on_host_) {
      EPMOE_NCCL_COMM_CHECK(*comm_, ncclAllGather(own_row, matrix_.data(), static_cast<std::size_t>(row_len),
                                                  ncclInt32, comm_->nccl(), stream));
    }
    ++dispatch_seq_;
    tensor_scale_ = in.x_tensor_scale;
    if (sized_on_host_) learn_counts();

    comm_detail::SendArgs s = send_inputs(in, T, host_status, own_row, whole);
    s.dest = dest_.as<char* const>();
    s.sync = errors_only();
    // Packing into the send buffers is on this transport's critical path: every SM.
    s.blocks = std::max(1, comm_detail::work_blocks(s.T));
    comm_detail::launch_send(g_, s, stream);
    exchange(send_, recv_, g_.row_stride, send_tokens_, recv_tokens_, /*with_count_rows=*/!sized_on_host_,
             CommPhase::dispatch_send);
    last_T_ = host_status != 0 ? 0 : T;
    own_direct_ = whole;
    // The peers got an error status instead of tokens; now refuse here too.
    EPMOE_CHECK(host_status == 0,
                "{}: rank {} has {} tokens, more than the buffers hold (max_tokens_per_rank = {})", name_, me,
                T, g_.T_max);
    sent_ = true;
  }

  // own: the input of a whole dispatch() (own tokens are read from it), else nullptr.
  void recv(DispatchOutput& out, const DispatchInput* own) override {
    enter("dispatch_recv");
    EPMOE_CHECK(sent_, "{}: dispatch_recv needs a dispatch_send first", name_);
    EPMOE_CHECK(own_direct_ == (own != nullptr),
                "{}: dispatch_recv must follow dispatch_send (and dispatch() runs both)", name_);
    comm_detail::PlaceArgs p = place_outputs();
    p.header = static_cast<const std::int32_t*>(matrix_.data());
    p.header_stride = g_.count_row_len();
    p.flag_field = -1;
    p.status_field = g_.status_index();
    p.tokens_field = g_.me;
    p.counts_field = g_.N + g_.me * g_.L;
    p.slots = recv_.as<const char>();
    p.sync = errors_only();
    // Without the host's check: every source's static scale against this rank's, on the device.
    if (!sized_on_host_ && context_.format == ActivationFormat::fp8_tensor)
      p.scale_field = g_.status_index() + 2;
    if (own != nullptr) place_own_inputs(p, *own);
    comm_detail::launch_place(g_, p, comm_->stream());
    sent_ = false;
    if (sized_on_host_) {
      fill_output(out, known_.rows, known_.recv_total, tensor_scale_, known_.offsets, 0);
    } else {
      // No host sync: the contiguous layout at its bound (place marks the rows past the last expert
      // block -1), or the masked layout with an estimated expected_m.
      fill_output(out, max_rows_, -1, tensor_scale_, {}, contiguous() ? 0 : estimated_m(last_T_));
    }
    output_rows_ = out.num_output_rows();
    dispatched_ = true;
  }

  // Normal mode with the host sync: the host learns every rank's counts (one bounded wait), refuses a
  // bad input on every rank alike, and sizes the exchange and the layout from them.
  void learn_counts() {
    const int N = g_.N, me = g_.me, L = g_.L, row_len = g_.count_row_len();
    const cudaStream_t stream = comm_->stream();
    EPMOE_CUDA_CHECK(
        cudaMemcpyAsync(host_matrix_, matrix_.data(), matrix_.size(), cudaMemcpyDeviceToHost, stream));
    comm_->synchronize(CommPhase::count_exchange, "the token counts of every rank");
    auto at = [&](int src, int field) {
      return host_matrix_[static_cast<std::size_t>(src) * row_len + field];
    };
    std::string refused;
    for (int r = 0; r < N; ++r) {
      const std::int32_t status = at(r, g_.status_index());
      if (status != 0)
        refused +=
            fmt::format("{}rank {} has {} (T = {}, max_tokens_per_rank = {})", refused.empty() ? "" : "; ", r,
                        describe_input_status(status), at(r, g_.status_index() + 1), g_.T_max);
    }
    EPMOE_CHECK(refused.empty(), "nccl-p2p dispatch refused on every rank before anything was sent: {}",
                refused);
    if (context_.format == ActivationFormat::fp8_tensor) {
      for (int r = 1; r < N; ++r)
        EPMOE_CHECK(at_scale(r) == at_scale(0),
                    "every rank must quantize with the same static scale: rank 0 has {}, rank {} has {}",
                    at_scale(0), r, at_scale(r));
      tensor_scale_ = at_scale(0);
    }

    send_tokens_.assign(static_cast<std::size_t>(N), 0);
    recv_tokens_.assign(static_cast<std::size_t>(N), 0);
    std::vector<std::int64_t> total(static_cast<std::size_t>(L), 0);
    std::int64_t tokens_out = 0;
    known_ = Known{};
    for (int r = 0; r < N; ++r) {
      send_tokens_[static_cast<std::size_t>(r)] = at(me, r);
      recv_tokens_[static_cast<std::size_t>(r)] = at(r, me);
      known_.recv_total += at(r, me);
      if (r != me) tokens_out += at(me, r);
      for (int e = 0; e < L; ++e) total[static_cast<std::size_t>(e)] += at(r, N + me * L + e);
    }
    std::int64_t valid_rows = 0;
    known_.offsets.push_back(0);
    for (int e = 0; e < L; ++e) {
      const std::int64_t n = total[static_cast<std::size_t>(e)];
      valid_rows += n;
      known_.rows += (n + kContiguousAlign - 1) / kContiguousAlign * kContiguousAlign;
      known_.offsets.push_back(known_.rows);
    }
    stats_.tokens_sent[0] = tokens_out;
    stats_.bytes_sent[0] = tokens_out * detail::token_payload_bytes(context_);
    stats_.rows_received[0] = valid_rows;
  }

  // This rank's row of matrix_ (the routing writes its counts there).
  std::int32_t* own_count_row() const {
    return matrix_.as<std::int32_t>() +
           static_cast<std::size_t>(g_.me) * static_cast<std::size_t>(g_.count_row_len());
  }

  // The kernels' error reporting (no flags: NCCL orders the transfers).
  comm_detail::FlagSync errors_only() const {
    comm_detail::FlagSync s;
    s.errors = comm_->device_error_sink();
    return s;
  }

  float at_scale(int r) const {
    float s;
    const std::int32_t bits =
        host_matrix_[static_cast<std::size_t>(r) * g_.count_row_len() + g_.status_index() + 2];
    std::memcpy(&s, &bits, sizeof(s));
    return s;
  }

  std::size_t device_bytes() const override {
    std::size_t bytes = base_buffer_bytes();
    for (const cuda::DeviceBuffer* b :
         {&send_, &recv_, &comb_send_, &comb_recv_, &matrix_, &dest_, &comb_dest_})
      bytes += b->size();
    return bytes;
  }
  // Region d of `send` to rank d, region d of `recv` from it: count_out[d] / count_in[d] items of `item`
  // bytes where the host learnt the counts, else whole regions (T_max items: the receiver cannot size
  // what it does not know, and NCCL needs both sides' sizes equal), so that nothing waits for the host.
  // with_count_rows: first this rank's count row to every peer and theirs into matrix_, in the same
  // group (one NCCL launch; a pair's sends and receives match in the order they are posted).
  void exchange(const cuda::DeviceBuffer& send, const cuda::DeviceBuffer& recv, std::int64_t item,
                const std::vector<std::int64_t>& count_out, const std::vector<std::int64_t>& count_in,
                bool with_count_rows, CommPhase phase) {
    const auto row_len = static_cast<std::size_t>(g_.count_row_len());
    const std::size_t region = static_cast<std::size_t>(g_.T_max) * static_cast<std::size_t>(item);
    auto bytes = [&](const std::vector<std::int64_t>& counts, std::size_t i) {
      return sized_on_host_ ? static_cast<std::size_t>(counts[i] * item) : region;
    };
    EPMOE_NCCL_CHECK(ncclGroupStart());
    try {
      for (int d = 0; d < g_.N; ++d) {
        if (d == g_.me) continue;
        const auto i = static_cast<std::size_t>(d);
        if (with_count_rows) {
          EPMOE_NCCL_CHECK(ncclSend(own_count_row(), row_len, ncclInt32, d, comm_->nccl(), comm_->stream()));
          EPMOE_NCCL_CHECK(ncclRecv(matrix_.as<std::int32_t>() + row_len * i, row_len, ncclInt32, d,
                                    comm_->nccl(), comm_->stream()));
        }
        if (const std::size_t n = bytes(count_out, i); n > 0)
          EPMOE_NCCL_CHECK(
              ncclSend(send.as<char>() + region * i, n, ncclUint8, d, comm_->nccl(), comm_->stream()));
        if (const std::size_t n = bytes(count_in, i); n > 0)
          EPMOE_NCCL_CHECK(
              ncclRecv(recv.as<char>() + region * i, n, ncclUint8, d, comm_->nccl(), comm_->stream()));
      }
    } catch (...) {
      // Not left open on this thread (later NCCL calls would join it), and completed where it is in
      // progress (a nonblocking communicator refuses the next call meanwhile).
      if (const ncclResult_t end = ncclGroupEnd(); end == ncclInProgress)
        (void)comm_->complete_nccl_quietly(end);
      throw;
    }
    // (Inside the group the calls answer at once.)
    comm_->complete_nccl(ncclGroupEnd(), "ncclGroupEnd of the nccl-p2p exchange", __FILE__, __LINE__, phase);
  }

  // What learn_counts() found (normal mode with the host sync).
  struct Known {
    std::int64_t rows = 0, recv_total = 0;
    std::vector<std::int64_t> offsets;
  };

  const bool sized_on_host_;  // normal mode with DispatcherContext::host_sync
  cuda::DeviceBuffer send_, recv_, comb_send_, comb_recv_, matrix_, dest_, comb_dest_;
  std::int32_t* host_matrix_ = nullptr;
  std::vector<std::int64_t> send_tokens_, recv_tokens_;  // learn_counts()'s, per rank
  Known known_;
  std::uint32_t dispatch_seq_ = 0;
  float tensor_scale_ = 1.0f;
  bool sent_ = false, combine_sent_ = false, own_direct_ = false;
};

const DispatcherRegistry::Registration kRegistration{
    "nccl-p2p", [](const DispatcherContext& c) {
      return make_nccl_p2p_dispatcher(c, c.communicator ? c.communicator : Communicator::process_default());
    }};

}  // namespace

std::unique_ptr<LowLatencyDispatcher> make_nccl_p2p_dispatcher(const DispatcherContext& context,
                                                               std::shared_ptr<Communicator> comm) {
  return std::make_unique<NcclP2pDispatcher>(context, std::move(comm));
}

}  // namespace epmoe
