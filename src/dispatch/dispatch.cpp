#include <algorithm>
#include <cmath>

#include "dispatch/dispatch_common.hpp"
#include "epmoe/permute.hpp"

namespace epmoe {

std::string_view to_string(Layout layout) {
  switch (layout) {
    case Layout::token_major:
      return "token-major";
    case Layout::contiguous:
      return "contiguous";
    case Layout::masked:
      return "masked";
  }
  return "?";
}

std::int64_t DispatchOutput::num_output_rows() const {
  switch (layout) {
    case Layout::token_major:
      return local_ids.rank == 2 ? local_ids.size(0) * local_ids.size(1) : 0;
    case Layout::contiguous:
      return rows.rank == 2 ? rows.size(0) : 0;
    case Layout::masked:
      return rows.rank == 3 ? rows.size(0) * rows.size(1) : 0;
  }
  return 0;
}

std::unique_ptr<Dispatcher> make_dispatcher(const std::string& name, const DispatcherContext& context) {
  context.config.validate();
  EPMOE_CHECK(context.first_rank >= 0 && context.num_ranks_served >= 1 &&
                  context.first_rank + context.num_ranks_served <= context.config.num_ranks,
              "served ranks [{}, {}) must lie in [0, ranks={})", context.first_rank,
              context.first_rank + context.num_ranks_served, context.config.num_ranks);
  detail::check_dispatcher_mode(context, name);
  return DispatcherRegistry::instance().make(name, context);
}

std::int64_t contiguous_rows_bound(const MoeConfig& c, std::int64_t tokens_per_rank) {
  c.validate();
  EPMOE_CHECK(tokens_per_rank >= 0, "contiguous_rows_bound: tokens_per_rank must be >= 0, got {}",
              tokens_per_rank);
  const int L = c.num_local_experts();
  // Each of the ranks' tokens brings at most min(K, L) rows here; the blocks of those rows, each
  // expert's padded to 128 (a multiple of 128 in all, as the GEMMs' m-blocks want).
  std::int64_t entries = 0;
  EPMOE_CHECK(!__builtin_mul_overflow(static_cast<std::int64_t>(c.num_ranks) * std::min(c.topk, L),
                                      tokens_per_rank, &entries),
              "contiguous_rows_bound: {} tokens per rank x {} ranks x top-{} overflows 64 bits",
              tokens_per_rank, c.num_ranks, std::min(c.topk, L));
  return contiguous_capacity(entries, L);
}

namespace detail {

void check_token_bound(const DispatcherContext& context, std::int64_t T, std::string_view who) {
  if (context.mode != Mode::low_latency && context.host_sync) return;
  EPMOE_CHECK(T <= context.config.max_tokens_per_rank,
              "{}has {} tokens, more than {} (max_tokens_per_rank = {})", who, T,
              context.mode == Mode::low_latency ? "the low-latency buffers hold"
                                                : "the layout's bound allows without a host sync",
              context.config.max_tokens_per_rank);
}

void check_dispatcher_mode(const DispatcherContext& context, std::string_view name) {
  EPMOE_CHECK(context.mode == Mode::normal || context.mode == Mode::low_latency,
              "dispatcher '{}': the context's mode must be normal or low-latency, got {} (a layer in auto "
              "mode resolves it per forward: resolve_mode)",
              name, to_string(context.mode));
}

std::int64_t token_payload_bytes(const DispatcherContext& context) {
  const MoeConfig& c = context.config;
  std::int64_t bytes = c.hidden * (context.format == ActivationFormat::bf16 ? 2 : 1);
  if (context.format == ActivationFormat::fp8_group) bytes += c.hidden / 128 * 4;
  return bytes + c.topk * 8;  // i32 id + f32 weight per k
}

void validate_dispatch_input(const DispatcherContext& context, const DispatchInput& in, int rank) {
  const MoeConfig& c = context.config;
  const std::string r = fmt::format("rank {} ", rank);
  expect_rank(in.x, 2, r + "x");
  const std::int64_t T = in.x.size(0);
  expect_shape(in.x, {T, c.hidden}, r + "x");
  expect_host(in.x, r + "x");
  expect_dtype(in.x, context.format == ActivationFormat::bf16 ? DType::bf16 : DType::fp8_e4m3, r + "x");
  if (context.format == ActivationFormat::fp8_group) {
    expect_dtype(in.x_scales, DType::f32, r + "x_scales");
    expect_shape(in.x_scales, {T, c.hidden / 128}, r + "x_scales");
    expect_scales(in.x_scales, r + "x_scales");
  }
  if (context.format == ActivationFormat::fp8_tensor) {
    expect_scale(in.x_tensor_scale, r + "x_tensor_scale");
  }
  expect_dtype(in.topk_ids, DType::i32, r + "topk_ids");
  expect_shape(in.topk_ids, {T, c.topk}, r + "topk_ids");
  expect_host(in.topk_ids, r + "topk_ids");
  expect_dtype(in.topk_weights, DType::f32, r + "topk_weights");
  expect_shape(in.topk_weights, {T, c.topk}, r + "topk_weights");
  expect_contiguous(in.topk_weights, r + "topk_weights");
  expect_finite(in.topk_weights, r + "topk_weights");
  const int P = c.num_physical_experts();
  for (std::int64_t i = 0; i < T * c.topk; ++i) {
    const std::int32_t id = in.topk_ids.as<std::int32_t>()[i];
    EPMOE_CHECK(id >= 0 && id < P, "{}topk_ids[{}][{}] = {} is out of range [0, {})", r, i / c.topk,
                i % c.topk, id, P);
  }
  check_token_bound(context, T, r);
}

}  // namespace detail
}  // namespace epmoe
