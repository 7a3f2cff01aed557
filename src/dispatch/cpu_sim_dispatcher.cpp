// "cpu-sim": N ranks of expert parallelism simulated in one process, with the semantics of
// design.md §6. Each token is sent at most once to each destination rank (with its payload,
// scales and top-k ids/weights); the receiver fans it out to its local experts, producing the
// contiguous layout (normal mode) or the masked layout (low-latency mode); the combine reduces
// each token's rows on the expert rank first and sends one bf16 partial sum home per
// (token, rank), where the partial sums are added in rank order.
#include <algorithm>
#include <cstring>
#include <vector>

#include "dispatch/dispatch_common.hpp"

namespace epmoe {
namespace {

struct RecvToken {
  int src_rank;
  std::int64_t src_token;
};

struct RankState {
  // Receive side, valid from one dispatch to its combine.
  std::vector<RecvToken> recv;
  HostTensor rows, scales, m_indices, masked_m, row_token, row_weight;
  std::int64_t home_tokens = 0;
};

class CpuSimDispatcher final : public Dispatcher {
 public:
  explicit CpuSimDispatcher(const DispatcherContext& context) : context_(context) {
    EPMOE_CHECK(context.num_ranks_served == context.config.num_ranks && context.first_rank == 0,
                "cpu-sim serves all {} ranks in one process, got [{}, {})", context.config.num_ranks,
                context.first_rank, context.first_rank + context.num_ranks_served);
    ranks_.resize(static_cast<std::size_t>(context.config.num_ranks));
    if (context.mode == Mode::low_latency) {
      // Fixed buffers sized once from max_tokens_per_rank, as the GPU low-latency path has them.
      const MoeConfig& c = context.config;
      const std::int64_t L = c.num_local_experts(), M = c.masked_max_m(), H = c.hidden;
      for (RankState& s : ranks_) {
        s.rows = HostTensor(row_dtype(), {L, M, H});
        if (context.format == ActivationFormat::fp8_group) s.scales = HostTensor(DType::f32, {L, M, H / 128});
        s.masked_m = HostTensor(DType::i32, {L});
        s.row_token = HostTensor(DType::i32, {L * M});
        s.row_weight = HostTensor(DType::f32, {L * M});
      }
    }
  }

  std::string name() const override { return "cpu-sim"; }
  Layout layout() const override {
    return context_.mode == Mode::normal ? Layout::contiguous : Layout::masked;
  }
  const DispatcherContext& context() const override { return context_; }
  const DispatchStats& last_stats() const override { return stats_; }

  void dispatch(std::span<const DispatchInput> inputs, std::span<DispatchOutput> outputs) override {
    const MoeConfig& c = context_.config;
    const int N = c.num_ranks, K = c.topk, L = c.num_local_experts();
    EPMOE_CHECK(static_cast<int>(inputs.size()) == N && static_cast<int>(outputs.size()) == N,
                "cpu-sim dispatch needs one input and one output per rank ({}), got {} and {}", N,
                inputs.size(), outputs.size());
    for (int r = 0; r < N; ++r)
      detail::validate_dispatch_input(context_, inputs[r], r);  // before anything moves

    stats_ = DispatchStats{};
    stats_.tokens_sent.assign(static_cast<std::size_t>(N), 0);
    stats_.bytes_sent.assign(static_cast<std::size_t>(N), 0);
    stats_.rows_received.assign(static_cast<std::size_t>(N), 0);
    const std::int64_t payload = detail::token_payload_bytes(context_);

    // Send: each token goes once to every rank that owns at least one of its experts. Receive
    // buffers are ordered by source rank, then source token, as per-source regions of a real one
    // (rotated to start at the receiver in low-latency mode, below).
    for (RankState& s : ranks_) s.recv.clear();
    dispatched_ = true;
    std::vector<char> sent(static_cast<std::size_t>(N));
    for (int src = 0; src < N; ++src) {
      const std::int64_t T = inputs[src].x.size(0);
      ranks_[static_cast<std::size_t>(src)].home_tokens = T;
      const std::int32_t* ids = inputs[src].topk_ids.as<std::int32_t>();
      for (std::int64_t t = 0; t < T; ++t) {
        std::fill(sent.begin(), sent.end(), 0);
        for (int k = 0; k < K; ++k) {
          const int dst = ids[t * K + k] / L;
          if (sent[static_cast<std::size_t>(dst)]) continue;
          sent[static_cast<std::size_t>(dst)] = 1;
          ranks_[static_cast<std::size_t>(dst)].recv.push_back({src, t});
          if (dst != src) {
            stats_.tokens_sent[static_cast<std::size_t>(src)] += 1;
            stats_.bytes_sent[static_cast<std::size_t>(src)] += payload;
          }
        }
      }
    }

    // Low-latency mode (masked layout): a rank receives its own tokens first, then the sources
    // after it in rank order, wrapping around (me, me + 1, ..., me - 1 mod N), as the GPU
    // transports place them: the own rows need no peer's counts there.
    if (context_.mode == Mode::low_latency)
      for (int dst = 0; dst < N; ++dst)
        std::stable_sort(ranks_[static_cast<std::size_t>(dst)].recv.begin(),
                         ranks_[static_cast<std::size_t>(dst)].recv.end(),
                         [dst, N](const RecvToken& a, const RecvToken& b) {
                           return (a.src_rank - dst + N) % N < (b.src_rank - dst + N) % N;
                         });

    // Receive: fan each received token out to its local experts.
    for (int dst = 0; dst < N; ++dst) build_layout(inputs, dst, outputs[dst]);
  }

  void combine(std::span<const TensorView> expert_out, std::span<const TensorView> y) override {
    const MoeConfig& c = context_.config;
    const int N = c.num_ranks;
    const std::int64_t H = c.hidden;
    EPMOE_CHECK(dispatched_, "cpu-sim combine needs a dispatch first");
    EPMOE_CHECK(static_cast<int>(expert_out.size()) == N && static_cast<int>(y.size()) == N,
                "cpu-sim combine needs one expert output and one y per rank ({}), got {} and {}", N,
                expert_out.size(), y.size());
    for (int r = 0; r < N; ++r) {
      const RankState& s = ranks_[static_cast<std::size_t>(r)];
      expect_host_tensor(y[r], DType::bf16, {s.home_tokens, H}, fmt::format("rank {} y", r));
      expect_host_tensor(expert_out[r], DType::bf16, {s.row_token.numel(), H},
                         fmt::format("rank {} expert_out", r));
    }

    // Expert side: one bf16 partial sum per received token, reduced in f32 over its local rows.
    std::vector<std::vector<bf16>> partial(static_cast<std::size_t>(N));
    for (int r = 0; r < N; ++r) {
      const RankState& s = ranks_[static_cast<std::size_t>(r)];
      const std::int64_t recv = static_cast<std::int64_t>(s.recv.size());
      std::vector<float> acc(static_cast<std::size_t>(recv * H), 0.0f);
      const std::int32_t* row_token = s.row_token.data<std::int32_t>();
      const float* row_weight = s.row_weight.data<float>();
      const bf16* out = expert_out[r].as<bf16>();
      const std::int64_t rows = s.row_token.numel();
      for (std::int64_t row = 0; row < rows; ++row) {
        const std::int32_t i = row_token[row];
        if (i < 0) continue;  // padding, or past masked_m
        detail::accumulate_weighted_row(acc.data() + i * H, out + row * H, row_weight[row], H);
      }
      auto& p = partial[static_cast<std::size_t>(r)];
      p.resize(acc.size());
      for (std::size_t i = 0; i < acc.size(); ++i) p[i] = bf16::from_float(acc[i]);
    }

    // Home side: add the partial sums of every expert rank, in rank order, in f32.
    std::vector<std::vector<float>> home(static_cast<std::size_t>(N));
    for (int r = 0; r < N; ++r)
      home[static_cast<std::size_t>(r)].assign(
          static_cast<std::size_t>(ranks_[static_cast<std::size_t>(r)].home_tokens * H), 0.0f);
    for (int r = 0; r < N; ++r) {
      const RankState& s = ranks_[static_cast<std::size_t>(r)];
      for (std::size_t i = 0; i < s.recv.size(); ++i) {
        float* dst = home[static_cast<std::size_t>(s.recv[i].src_rank)].data() + s.recv[i].src_token * H;
        const bf16* src = partial[static_cast<std::size_t>(r)].data() + static_cast<std::int64_t>(i) * H;
        for (std::int64_t h = 0; h < H; ++h) dst[h] += src[h].to_float();
      }
    }
    for (int r = 0; r < N; ++r) {
      const auto& h = home[static_cast<std::size_t>(r)];
      for (std::size_t i = 0; i < h.size(); ++i) y[r].as<bf16>()[i] = bf16::from_float(h[i]);
    }
  }

 private:
  DType row_dtype() const {
    return context_.format == ActivationFormat::bf16 ? DType::bf16 : DType::fp8_e4m3;
  }

  void build_layout(std::span<const DispatchInput> inputs, int dst, DispatchOutput& out) {
    const MoeConfig& c = context_.config;
    const int K = c.topk, L = c.num_local_experts();
    const std::int64_t H = c.hidden, G = H / 128;
    const std::size_t row_bytes = static_cast<std::size_t>(H) * dtype_size(row_dtype());
    const bool has_scales = context_.format == ActivationFormat::fp8_group;
    RankState& s = ranks_[static_cast<std::size_t>(dst)];

    // Rows per local expert, in receive order.
    struct Row {
      std::int32_t recv_index;
      int k;
    };
    std::vector<std::vector<Row>> per_expert(static_cast<std::size_t>(L));
    for (std::size_t i = 0; i < s.recv.size(); ++i) {
      const DispatchInput& in = inputs[s.recv[i].src_rank];
      const std::int32_t* ids = in.topk_ids.as<std::int32_t>() + s.recv[i].src_token * K;
      for (int k = 0; k < K; ++k)
        if (ids[k] / L == dst)
          per_expert[static_cast<std::size_t>(ids[k] % L)].push_back({static_cast<std::int32_t>(i), k});
    }

    auto copy_row = [&](const Row& row, void* dst_row, float* dst_scales) {
      const RecvToken& tok = s.recv[static_cast<std::size_t>(row.recv_index)];
      const DispatchInput& in = inputs[tok.src_rank];
      std::memcpy(dst_row, in.x.select(tok.src_token).data, row_bytes);
      if (has_scales) std::memcpy(dst_scales, in.x_scales.as<float>() + tok.src_token * G, G * sizeof(float));
    };
    auto weight_of = [&](const Row& row) {
      const RecvToken& tok = s.recv[static_cast<std::size_t>(row.recv_index)];
      return inputs[tok.src_rank].topk_weights.as<float>()[tok.src_token * K + row.k];
    };

    out = DispatchOutput{};
    out.layout = layout();
    out.format = context_.format;
    out.num_local_experts = L;
    out.num_recv_tokens = static_cast<std::int64_t>(s.recv.size());
    out.tensor_scale = context_.format == ActivationFormat::fp8_tensor ? inputs[0].x_tensor_scale : 1.0f;
    for (int r = 1; r < c.num_ranks && context_.format == ActivationFormat::fp8_tensor; ++r)
      EPMOE_CHECK(inputs[r].x_tensor_scale == inputs[0].x_tensor_scale,
                  "every rank must quantize with the same static scale: rank 0 has {}, rank {} has {}",
                  inputs[0].x_tensor_scale, r, inputs[r].x_tensor_scale);

    std::int64_t total_rows = 0;
    if (context_.mode == Mode::normal) {
      out.expert_offsets.assign(static_cast<std::size_t>(L) + 1, 0);
      for (int j = 0; j < L; ++j) {
        const std::int64_t n = static_cast<std::int64_t>(per_expert[static_cast<std::size_t>(j)].size());
        total_rows += n;
        out.expert_offsets[static_cast<std::size_t>(j) + 1] =
            out.expert_offsets[static_cast<std::size_t>(j)] +
            (n + kContiguousAlign - 1) / kContiguousAlign * kContiguousAlign;
      }
      // Without a host sync the GPU dispatchers hand out the layout at its bound: the same rows,
      // then -1 (m_indices, row_token) to the end; the host learns neither the offsets nor the count.
      std::int64_t M = out.expert_offsets.back();
      if (!context_.host_sync) {
        M = contiguous_rows_bound(c, c.max_tokens_per_rank);
        EPMOE_CHECK(out.expert_offsets.back() <= M, "rank {}: {} contiguous rows exceed the bound {}", dst,
                    out.expert_offsets.back(), M);
      }
      s.rows = HostTensor(row_dtype(), {M, H});
      s.scales = has_scales ? HostTensor(DType::f32, {M, G}) : HostTensor();
      s.m_indices = HostTensor(DType::i32, {M});
      s.row_token = HostTensor(DType::i32, {M});
      s.row_weight = HostTensor(DType::f32, {M});
      std::fill_n(s.m_indices.data<std::int32_t>(), M, -1);
      std::fill_n(s.row_token.data<std::int32_t>(), M, -1);
      for (int j = 0; j < L; ++j) {
        std::int64_t row_index = out.expert_offsets[static_cast<std::size_t>(j)];
        for (const Row& row : per_expert[static_cast<std::size_t>(j)]) {
          copy_row(row, s.rows.view().select(row_index).data,
                   has_scales ? s.scales.data<float>() + row_index * G : nullptr);
          s.m_indices.data<std::int32_t>()[row_index] = j;
          s.row_token.data<std::int32_t>()[row_index] = row.recv_index;
          s.row_weight.data<float>()[row_index] = weight_of(row);
          ++row_index;
        }
      }
      out.rows = s.rows;
      out.scales = has_scales ? s.scales.view() : TensorView{};
      out.m_indices = s.m_indices;
      if (!context_.host_sync) {
        out.expert_offsets.clear();
        out.num_recv_tokens = -1;
      }
    } else {
      const std::int64_t M = c.masked_max_m();
      std::fill_n(s.row_token.data<std::int32_t>(), L * M, -1);
      int touched = 0;
      for (int j = 0; j < L; ++j) {
        const auto& list = per_expert[static_cast<std::size_t>(j)];
        const std::int64_t n = static_cast<std::int64_t>(list.size());
        EPMOE_CHECK(n <= M, "rank {} local expert {} received {} rows, more than M_max = {}", dst, j, n, M);
        s.masked_m.data<std::int32_t>()[j] = static_cast<std::int32_t>(n);
        total_rows += n;
        touched += n > 0;
        for (std::int64_t m = 0; m < n; ++m) {
          const std::int64_t flat = j * M + m;
          copy_row(list[static_cast<std::size_t>(m)], s.rows.view().select(j).select(m).data,
                   has_scales ? s.scales.data<float>() + flat * G : nullptr);
          s.row_token.data<std::int32_t>()[flat] = list[static_cast<std::size_t>(m)].recv_index;
          s.row_weight.data<float>()[flat] = weight_of(list[static_cast<std::size_t>(m)]);
        }
      }
      out.rows = s.rows;
      out.scales = has_scales ? s.scales.view() : TensorView{};
      out.masked_m = s.masked_m;
      out.expected_m = touched ? (total_rows + touched - 1) / touched : 0;
    }
    out.row_token = s.row_token;
    out.row_weight = s.row_weight;
    stats_.rows_received[static_cast<std::size_t>(dst)] = total_rows;
  }

  DispatcherContext context_;
  std::vector<RankState> ranks_;
  bool dispatched_ = false;
  DispatchStats stats_;
};

const DispatcherRegistry::Registration kRegistration{
    "cpu-sim", [](const DispatcherContext& c) { return std::make_unique<CpuSimDispatcher>(c); }};

}  // namespace
}  // namespace epmoe
