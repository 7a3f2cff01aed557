#include "comm/gpu_dispatcher_base.hpp"

#include <algorithm>
#include <cmath>
#include <utility>

#include "dispatch/dispatch_common.hpp"

namespace epmoe::comm_detail {

GpuDispatcherBase::GpuDispatcherBase(std::string name, const DispatcherContext& context,
                                     std::shared_ptr<Communicator> comm)
    : name_(std::move(name)), context_(context), comm_(std::move(comm)) {
  const MoeConfig& c = context.config;
  c.validate();
  detail::check_dispatcher_mode(context, name_);
  EPMOE_CHECK(
      comm_ != nullptr,
      "{} needs a Communicator: create one (Communicator::from_environment() under `epmoe launch`) and pass "
      "it, or register it with Communicator::set_process_default() before making the dispatcher by name",
      name_);
  EPMOE_CHECK(c.num_ranks == comm_->size(), "{}: the config has {} ranks, the communicator {}", name_,
              c.num_ranks, comm_->size());
  EPMOE_CHECK(context.num_ranks_served == 1 && context.first_rank == comm_->rank(),
              "{} serves exactly one rank, its communicator's ({}); the context asks for ranks [{}, {})",
              name_, comm_->rank(), context.first_rank, context.first_rank + context.num_ranks_served);
  EPMOE_CHECK(c.max_tokens_per_rank >= 1, "{}: max_tokens_per_rank must be positive", name_);
  enter("construction");
  g_ = EpGeometry::make(c, context.format, comm_->rank(), c.max_tokens_per_rank);

  const std::int64_t buckets = g_.N + g_.P;
  bitmaps_ = cuda::DeviceBuffer(sizeof(std::uint32_t) * static_cast<std::size_t>(buckets * g_.W));
  prefix_ = cuda::DeviceBuffer(sizeof(std::int32_t) * static_cast<std::size_t>(buckets * g_.W));
  count_row_ = cuda::DeviceBuffer(sizeof(std::int32_t) * static_cast<std::size_t>(g_.count_row_len()));

  const std::int64_t slots = static_cast<std::int64_t>(g_.N) * g_.T_max;
  M_max_ = c.masked_max_m();
  if (contiguous()) {
    max_rows_ = contiguous_rows_bound(c, g_.T_max);
    m_indices_ = cuda::DeviceBuffer(sizeof(std::int32_t) * static_cast<std::size_t>(max_rows_));
  } else {
    max_rows_ = static_cast<std::int64_t>(g_.L) * M_max_;
    masked_m_ = cuda::DeviceBuffer(sizeof(std::int32_t) * static_cast<std::size_t>(g_.L));
  }
  rows_ = cuda::DeviceBuffer(static_cast<std::size_t>(max_rows_ * g_.x_bytes));
  if (g_.G > 0) scales_ = cuda::DeviceBuffer(sizeof(float) * static_cast<std::size_t>(max_rows_ * g_.G));
  row_token_ = cuda::DeviceBuffer(sizeof(std::int32_t) * static_cast<std::size_t>(max_rows_));
  row_weight_ = cuda::DeviceBuffer(sizeof(float) * static_cast<std::size_t>(max_rows_));
  recv_rows_ = cuda::DeviceBuffer(sizeof(std::int32_t) * static_cast<std::size_t>(slots * g_.K));
  recv_src_ = cuda::DeviceBuffer(sizeof(std::int32_t) * static_cast<std::size_t>(slots));
  recv_slot_ = cuda::DeviceBuffer(sizeof(std::int32_t) * static_cast<std::size_t>(slots));
  recv_total_ = cuda::DeviceBuffer(16);
  recv_total_.fill_bytes(0, comm_->stream());
  stats_.tokens_sent.assign(1, 0);
  stats_.bytes_sent.assign(1, 0);
  stats_.rows_received.assign(1, 0);
}

void GpuDispatcherBase::enter(std::string_view what) const {
  last_call_ = what;
  const auto at =
      std::find_if(host_calls_.begin(), host_calls_.end(), [&](const auto& c) { return c.first == what; });
  if (at == host_calls_.end()) {
    host_calls_.emplace_back(what, 1);
  } else {
    ++at->second;
  }
  comm_->check_usable(fmt::format("{} {}", name_, what));
  int current = -1;
  EPMOE_CUDA_CHECK(cudaGetDevice(&current));
  if (current != comm_->device()) EPMOE_CUDA_CHECK(cudaSetDevice(comm_->device()));
}

std::string GpuDispatcherBase::host_calls() const {
  std::string s;
  for (const auto& [what, n] : host_calls_) s += fmt::format("{}{} {}", s.empty() ? "" : ", ", what, n);
  return fmt::format("{} (last: {})", s.empty() ? "none" : s, last_call_.empty() ? "none" : last_call_);
}

std::int64_t GpuDispatcherBase::validate_input(const DispatchInput& in) const {
  const MoeConfig& c = context_.config;
  const std::string r = fmt::format("{}: rank {} ", name_, comm_->rank());
  auto device_tensor = [&](const TensorView& t, DType dtype, std::int64_t rows, std::int64_t cols,
                           const std::string& what) {
    expect_dtype(t, dtype, r + what);
    expect_shape(t, {rows, cols}, r + what);
    if (rows == 0) return;
    expect_device_tensor(t, dtype, r + what, 16);
  };
  expect_rank(in.x, 2, r + "x");
  const std::int64_t T = in.x.size(0);
  device_tensor(in.x, row_dtype(), T, c.hidden, "x");
  if (context_.format == ActivationFormat::fp8_group)
    device_tensor(in.x_scales, DType::f32, T, c.hidden / 128, "x_scales");
  if (context_.format == ActivationFormat::fp8_tensor) expect_scale(in.x_tensor_scale, r + "x_tensor_scale");
  device_tensor(in.topk_ids, DType::i32, T, c.topk, "topk_ids");
  device_tensor(in.topk_weights, DType::f32, T, c.topk, "topk_weights");
  return T;
}

void GpuDispatcherBase::validate_expert_out(const TensorView& expert_out) const {
  EPMOE_CHECK(dispatched_, "{}: combine needs a dispatch first", name_);
  const std::string r = fmt::format("{}: rank {} ", name_, comm_->rank());
  expect_dtype(expert_out, DType::bf16, r + "expert_out");
  expect_shape(expert_out, {output_rows_, context_.config.hidden}, r + "expert_out");
  if (output_rows_ > 0) {
    expect_device(expert_out, Device::cuda, r + "expert_out");
    expect_contiguous(expert_out, r + "expert_out");
  }
}

void GpuDispatcherBase::validate_y(const TensorView& y) const {
  const std::string r = fmt::format("{}: rank {} ", name_, comm_->rank());
  expect_dtype(y, DType::bf16, r + "y");
  expect_shape(y, {last_T_, context_.config.hidden}, r + "y");
  if (last_T_ > 0) {
    expect_device(y, Device::cuda, r + "y");
    expect_contiguous(y, r + "y");
  }
}

void GpuDispatcherBase::dispatch(std::span<const DispatchInput> inputs, std::span<DispatchOutput> outputs) {
  EPMOE_CHECK(inputs.size() == 1 && outputs.size() == 1,
              "{} serves one rank: pass one input and one output, got {} and {}", name_, inputs.size(),
              outputs.size());
  send(inputs[0], /*whole=*/true);
  recv(outputs[0], &inputs[0]);
}

void GpuDispatcherBase::combine(std::span<const TensorView> expert_out, std::span<const TensorView> y) {
  EPMOE_CHECK(expert_out.size() == 1 && y.size() == 1,
              "{} serves one rank: pass one expert output and one y, got {} and {}", name_, expert_out.size(),
              y.size());
  validate_y(y[0]);  // before anything is sent (expert_out: combine_send checks it before it sends)
  combine_send(expert_out[0]);
  combine_recv(y[0]);
}

SendArgs GpuDispatcherBase::send_inputs(const DispatchInput& in, std::int64_t T, std::int32_t host_status,
                                        const std::int32_t* count_row, bool whole) const {
  SendArgs s;
  s.x = in.x.data;
  s.scales = g_.G > 0 ? in.x_scales.as<float>() : nullptr;
  s.ids = in.topk_ids.as<std::int32_t>();
  s.weights = in.topk_weights.as<float>();
  s.T = host_status != 0 ? 0 : T;
  s.bitmaps = bitmaps_.as<std::uint32_t>();
  s.prefix = prefix_.as<std::int32_t>();
  s.count_row = count_row;
  s.skip_self = whole;
  return s;
}

void GpuDispatcherBase::place_own_inputs(PlaceArgs& p, const DispatchInput& own) const {
  p.own_x = own.x.data;
  p.own_scales = g_.G > 0 ? own.x_scales.as<float>() : nullptr;
  p.own_ids = own.topk_ids.as<std::int32_t>();
  p.own_weights = own.topk_weights.as<float>();
  p.own_T = last_T_;
  p.bitmaps = bitmaps_.as<std::uint32_t>();
  p.prefix = prefix_.as<std::int32_t>();
}

PlaceArgs GpuDispatcherBase::place_outputs() const {
  PlaceArgs a;
  a.contiguous = contiguous();
  a.M_max = M_max_;
  a.max_rows = max_rows_;
  a.empty_rows_to_max = contiguous() && !context_.host_sync;
  a.rows = rows_.as<char>();
  a.out_scales = scales_.as<float>();
  a.m_indices = m_indices_.as<std::int32_t>();
  a.masked_m = masked_m_.as<std::int32_t>();
  a.row_token = row_token_.as<std::int32_t>();
  a.row_weight = row_weight_.as<float>();
  a.recv_rows = recv_rows_.as<std::int32_t>();
  a.recv_src = recv_src_.as<std::int32_t>();
  a.recv_slot = recv_slot_.as<std::int32_t>();
  a.recv_total = recv_total_.as<std::int32_t>();
  return a;
}

ReduceArgs GpuDispatcherBase::reduce_inputs(const TensorView& expert_out) const {
  ReduceArgs r;
  r.expert_out = expert_out.data;
  r.row_weight = row_weight_.as<float>();
  r.recv_rows = recv_rows_.as<std::int32_t>();
  r.recv_src = recv_src_.as<std::int32_t>();
  r.recv_slot = recv_slot_.as<std::int32_t>();
  r.recv_total = recv_total_.as<std::int32_t>();
  return r;
}

HomeArgs GpuDispatcherBase::home_inputs(const TensorView& y) const {
  HomeArgs h;
  h.bitmaps = bitmaps_.as<std::uint32_t>();
  h.prefix = prefix_.as<std::int32_t>();
  h.T = last_T_;
  h.y = y.data;
  return h;
}

std::int64_t GpuDispatcherBase::estimated_m(std::int64_t T) const {
  return std::max<std::int64_t>(1, (T * g_.N * g_.K + g_.P - 1) / std::max(1, g_.P));
}

const DispatchStats& GpuDispatcherBase::stats_from_device(std::uint32_t dispatch_seq,
                                                          const std::int32_t* count_row) const {
  if (!dispatched_ || stats_seq_ == dispatch_seq) return stats_;
  comm_->synchronize(CommPhase::none, "the last dispatch, for its statistics");
  EPMOE_CUDA_CHECK(cudaSetDevice(comm_->device()));
  std::vector<std::int32_t> counts(static_cast<std::size_t>(g_.N));
  EPMOE_CUDA_CHECK(cudaMemcpy(counts.data(), count_row != nullptr ? count_row : count_row_.as<std::int32_t>(),
                              counts.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  std::int64_t tokens_out = 0;
  for (int d = 0; d < g_.N; ++d)
    if (d != g_.me) tokens_out += counts[static_cast<std::size_t>(d)];
  std::int64_t rows = 0;
  const bool by_rows = contiguous();
  std::vector<std::int32_t> values(static_cast<std::size_t>(by_rows ? output_rows_ : g_.L));
  if (!values.empty())
    EPMOE_CUDA_CHECK(cudaMemcpy(values.data(), by_rows ? m_indices_.data() : masked_m_.data(),
                                values.size() * sizeof(std::int32_t), cudaMemcpyDeviceToHost));
  for (const std::int32_t v : values) rows += by_rows ? (v >= 0 ? 1 : 0) : v;
  stats_.tokens_sent[0] = tokens_out;
  stats_.bytes_sent[0] = tokens_out * detail::token_payload_bytes(context_);
  stats_.rows_received[0] = rows;
  stats_seq_ = dispatch_seq;
  return stats_;
}

void GpuDispatcherBase::fill_output(DispatchOutput& out, std::int64_t rows, std::int64_t recv_tokens,
                                    float tensor_scale, std::vector<std::int64_t> expert_offsets,
                                    std::int64_t expected_m) const {
  const std::int64_t H = context_.config.hidden;
  out = DispatchOutput{};
  out.format = context_.format;
  out.num_local_experts = g_.L;
  out.num_recv_tokens = recv_tokens;
  out.tensor_scale = context_.format == ActivationFormat::fp8_tensor ? tensor_scale : 1.0f;
  if (contiguous()) {
    out.layout = Layout::contiguous;
    out.rows = rows_.view(row_dtype(), {rows, H});
    if (g_.G > 0) out.scales = scales_.view(DType::f32, {rows, g_.G});
    out.m_indices = m_indices_.view(DType::i32, {rows});
    out.expert_offsets = std::move(expert_offsets);
    out.row_token = row_token_.view(DType::i32, {rows});
    out.row_weight = row_weight_.view(DType::f32, {rows});
  } else {
    out.layout = Layout::masked;
    out.rows = rows_.view(row_dtype(), {g_.L, M_max_, H});
    if (g_.G > 0) out.scales = scales_.view(DType::f32, {g_.L, M_max_, g_.G});
    out.masked_m = masked_m_.view(DType::i32, {g_.L});
    out.expected_m = expected_m;
    out.row_token = row_token_.view(DType::i32, {max_rows_});
    out.row_weight = row_weight_.view(DType::f32, {max_rows_});
  }
}

std::size_t GpuDispatcherBase::base_buffer_bytes() const {
  std::size_t bytes = 0;
  for (const cuda::DeviceBuffer* b :
       {&bitmaps_, &prefix_, &count_row_, &rows_, &scales_, &m_indices_, &masked_m_, &row_token_,
        &row_weight_, &recv_rows_, &recv_src_, &recv_slot_, &recv_total_})
    bytes += b->size();
  return bytes;
}

cuda::DeviceBuffer upload_pointers(const std::vector<void*>& pointers) {
  cuda::DeviceBuffer b(sizeof(void*) * pointers.size());
  // Landed before any stream reads it: a plain cudaMemcpy from pageable memory returns before the upload
  // completes, and the dispatchers' non-blocking streams do not wait for the legacy stream.
  EPMOE_CUDA_CHECK(cudaMemcpyAsync(b.data(), pointers.data(), sizeof(void*) * pointers.size(),
                                   cudaMemcpyHostToDevice, cudaStreamPerThread));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
  return b;
}

}  // namespace epmoe::comm_detail
