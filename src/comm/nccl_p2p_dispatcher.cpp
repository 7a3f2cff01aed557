// "nccl-p2p": dispatch / combine over ncclSend / ncclRecv (epmoe/comm_dispatch.hpp).
//
// dispatch: route (device) -> ncclAllGather of every rank's count row (tokens per destination,
// rows per physical expert, input status) -> the host learns them (one bounded wait) and refuses
// bad input on every rank alike -> pack each token once per destination (own tokens straight
// into the own receive region) -> grouped send/recv of the regions -> place (contiguous or
// masked layout). combine: reduce per received token -> grouped send/recv of the partial sums
// -> home sums in rank order.
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

class NcclP2pDispatcher final : public Dispatcher, comm_detail::GpuDispatcherBase {
 public:
  NcclP2pDispatcher(const DispatcherContext& context, std::shared_ptr<Communicator> comm)
      : GpuDispatcherBase("nccl-p2p", context, std::move(comm)) {
    EPMOE_CHECK(
        context.host_sync || context.mode == Mode::low_latency,
        "nccl-p2p needs the host sync of normal mode (DispatcherContext::host_sync): its transfers are "
        "sized on the host from the exchanged counts; the nvlink dispatcher works without it");
    const std::size_t region = static_cast<std::size_t>(g_.T_max) * static_cast<std::size_t>(g_.row_stride);
    const std::size_t partials =
        static_cast<std::size_t>(g_.T_max) * static_cast<std::size_t>(g_.partial_bytes);
    const auto N = static_cast<std::size_t>(g_.N), me = static_cast<std::size_t>(g_.me);
    send_ = cuda::DeviceBuffer(region * N);
    recv_ = cuda::DeviceBuffer(region * N);
    comb_send_ = cuda::DeviceBuffer(partials * N);
    comb_recv_ = cuda::DeviceBuffer(partials * N);
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

  std::string name() const override { return name_; }
  Layout layout() const override { return contiguous() ? Layout::contiguous : Layout::masked; }
  const DispatcherContext& context() const override { return context_; }
  const DispatchStats& last_stats() const override { return stats_; }

  void dispatch(std::span<const DispatchInput> inputs, std::span<DispatchOutput> outputs) override {
    EPMOE_CHECK(inputs.size() == 1 && outputs.size() == 1,
                "nccl-p2p serves one rank: pass one input and one output, got {} and {}", inputs.size(),
                outputs.size());
    enter("dispatch");
    const DispatchInput& in = inputs[0];
    const std::int64_t T = validate_input(in);
    const int N = g_.N, me = g_.me, L = g_.L, row_len = g_.count_row_len();
    const cudaStream_t stream = comm_->stream();
    const std::int32_t host_status = T > g_.T_max ? kInputTooManyTokens : 0;
    dispatched_ = false;

    // Counts: computed on the device, all-gathered, learnt by the host once.
    comm_detail::launch_route(g_, in.topk_ids.as<std::int32_t>(), T, host_status, in.x_tensor_scale,
                              bitmaps_.as<std::uint32_t>(), prefix_.as<std::int32_t>(),
                              count_row_.as<std::int32_t>(), stream);
    EPMOE_NCCL_CHECK(ncclAllGather(count_row_.data(), matrix_.data(), static_cast<std::size_t>(row_len),
                                   ncclInt32, comm_->nccl(), stream));
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
    float scale = in.x_tensor_scale;
    if (context_.format == ActivationFormat::fp8_tensor) {
      for (int r = 1; r < N; ++r)
        EPMOE_CHECK(at_scale(r) == at_scale(0),
                    "every rank must quantize with the same static scale: rank 0 has {}, rank {} has {}",
                    at_scale(0), r, at_scale(r));
      scale = at_scale(0);
    }

    send_tokens_.assign(static_cast<std::size_t>(N), 0);
    recv_tokens_.assign(static_cast<std::size_t>(N), 0);
    std::vector<std::int64_t> total(static_cast<std::size_t>(L), 0);
    std::int64_t recv_total = 0, rows = 0, tokens_out = 0;
    for (int r = 0; r < N; ++r) {
      send_tokens_[static_cast<std::size_t>(r)] = at(me, r);
      recv_tokens_[static_cast<std::size_t>(r)] = at(r, me);
      recv_total += at(r, me);
      if (r != me) tokens_out += at(me, r);
      for (int e = 0; e < L; ++e) total[static_cast<std::size_t>(e)] += at(r, N + me * L + e);
    }
    std::vector<std::int64_t> offsets;
    std::int64_t m_sum = 0, touched = 0, valid_rows = 0;
    if (contiguous()) offsets.push_back(0);
    for (int e = 0; e < L; ++e) {
      const std::int64_t n = total[static_cast<std::size_t>(e)];
      valid_rows += n;
      touched += n > 0;
      if (contiguous()) {
        m_sum += (n + kContiguousAlign - 1) / kContiguousAlign * kContiguousAlign;
        offsets.push_back(m_sum);
      }
    }
    rows = contiguous() ? m_sum : max_rows_;
    stats_.tokens_sent[0] = tokens_out;
    stats_.bytes_sent[0] = tokens_out * detail::token_payload_bytes(context_);
    stats_.rows_received[0] = valid_rows;
    wire_bytes_ = tokens_out * g_.row_stride;

    // Payload: once per destination rank.
    comm_detail::SendArgs s;
    s.x = in.x.data;
    s.scales = g_.G > 0 ? in.x_scales.as<float>() : nullptr;
    s.ids = in.topk_ids.as<std::int32_t>();
    s.weights = in.topk_weights.as<float>();
    s.T = T;
    s.bitmaps = bitmaps_.as<std::uint32_t>();
    s.prefix = prefix_.as<std::int32_t>();
    s.count_row = count_row_.as<std::int32_t>();
    s.dest = dest_.as<char* const>();
    s.skip_self = true;  // place reads the own tokens from x
    // Packing into the send buffers is on this transport's critical path: every SM.
    s.blocks = std::max(1, comm_detail::work_blocks(T));
    comm_detail::launch_send(g_, s, stream);
    exchange(send_, recv_, g_.row_stride, send_tokens_, recv_tokens_);

    comm_detail::PlaceArgs p = place_outputs();
    p.header = static_cast<const std::int32_t*>(matrix_.data());
    p.header_stride = row_len;
    p.flag_field = -1;
    p.status_field = g_.status_index();
    p.tokens_field = me;
    p.counts_field = N + me * L;
    p.slots = recv_.as<const char>();
    p.own_x = in.x.data;
    p.own_scales = g_.G > 0 ? in.x_scales.as<float>() : nullptr;
    p.own_ids = in.topk_ids.as<std::int32_t>();
    p.own_weights = in.topk_weights.as<float>();
    p.own_T = T;
    p.bitmaps = bitmaps_.as<std::uint32_t>();
    p.prefix = prefix_.as<std::int32_t>();
    comm_detail::launch_place(g_, p, stream);

    const std::int64_t expected = touched > 0 ? (valid_rows + touched - 1) / touched : 0;
    fill_output(outputs[0], rows, recv_total, scale, std::move(offsets), expected);
    output_rows_ = outputs[0].num_output_rows();
    last_T_ = T;
    dispatched_ = true;
  }

  void combine(std::span<const TensorView> expert_out, std::span<const TensorView> y) override {
    EPMOE_CHECK(expert_out.size() == 1 && y.size() == 1,
                "nccl-p2p serves one rank: pass one expert output and one y, got {} and {}",
                expert_out.size(), y.size());
    enter("combine");
    validate_combine(expert_out[0], y[0]);
    expect_shape(expert_out[0], {output_rows_, context_.config.hidden}, "nccl-p2p: expert_out");
    const cudaStream_t stream = comm_->stream();
    comm_detail::ReduceArgs r;
    r.expert_out = expert_out[0].data;
    r.row_weight = row_weight_.as<float>();
    r.recv_rows = recv_rows_.as<std::int32_t>();
    r.recv_src = recv_src_.as<std::int32_t>();
    r.recv_slot = recv_slot_.as<std::int32_t>();
    r.recv_total = recv_total_.as<std::int32_t>();
    r.dest = comb_dest_.as<char* const>();
    comm_detail::launch_reduce(g_, r, stream);
    // Partial sums go back the way the tokens came.
    exchange(comb_send_, comb_recv_, g_.partial_bytes, recv_tokens_, send_tokens_);
    comm_detail::HomeArgs h;
    h.partials = comb_recv_.as<const char>();
    h.bitmaps = bitmaps_.as<std::uint32_t>();
    h.prefix = prefix_.as<std::int32_t>();
    h.T = last_T_;
    h.y = y[0].data;
    comm_detail::launch_home(g_, h, stream);
  }

 private:
  float at_scale(int r) const {
    float s;
    const std::int32_t bits =
        host_matrix_[static_cast<std::size_t>(r) * g_.count_row_len() + g_.status_index() + 2];
    std::memcpy(&s, &bits, sizeof(s));
    return s;
  }

  // Region d of `send` (count_out[d] items of `item` bytes) to rank d, region d of `recv` from it.
  std::size_t device_bytes() const override {
    std::size_t bytes = base_buffer_bytes();
    for (const cuda::DeviceBuffer* b :
         {&send_, &recv_, &comb_send_, &comb_recv_, &matrix_, &dest_, &comb_dest_})
      bytes += b->size();
    return bytes;
  }
  void exchange(const cuda::DeviceBuffer& send, const cuda::DeviceBuffer& recv, std::int64_t item,
                const std::vector<std::int64_t>& count_out, const std::vector<std::int64_t>& count_in) {
    const std::size_t region = static_cast<std::size_t>(g_.T_max) * static_cast<std::size_t>(item);
    EPMOE_NCCL_CHECK(ncclGroupStart());
    for (int d = 0; d < g_.N; ++d) {
      if (d == g_.me) continue;
      const auto i = static_cast<std::size_t>(d);
      if (count_out[i] > 0)
        EPMOE_NCCL_CHECK(ncclSend(send.as<char>() + region * i, static_cast<std::size_t>(count_out[i] * item),
                                  ncclUint8, d, comm_->nccl(), comm_->stream()));
      if (count_in[i] > 0)
        EPMOE_NCCL_CHECK(ncclRecv(recv.as<char>() + region * i, static_cast<std::size_t>(count_in[i] * item),
                                  ncclUint8, d, comm_->nccl(), comm_->stream()));
    }
    EPMOE_NCCL_CHECK(ncclGroupEnd());
  }

  cuda::DeviceBuffer send_, recv_, comb_send_, comb_recv_, matrix_, dest_, comb_dest_;
  std::int32_t* host_matrix_ = nullptr;
  std::vector<std::int64_t> send_tokens_, recv_tokens_;
  std::int64_t output_rows_ = 0, wire_bytes_ = 0;
};

const DispatcherRegistry::Registration kRegistration{
    "nccl-p2p", [](const DispatcherContext& c) {
      return make_nccl_p2p_dispatcher(c, c.communicator ? c.communicator : Communicator::process_default());
    }};

}  // namespace

std::unique_ptr<Dispatcher> make_nccl_p2p_dispatcher(const DispatcherContext& context,
                                                     std::shared_ptr<Communicator> comm) {
  return std::make_unique<NcclP2pDispatcher>(context, std::move(comm));
}

}  // namespace epmoe
