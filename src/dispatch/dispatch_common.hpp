// Pieces every dispatcher shares: input validation and the f32 weighted row reduction.
#pragma once

#include <string_view>

#include "epmoe/dispatch.hpp"

namespace epmoe::detail {

// T <= max_tokens_per_rank where the buffers are sized by it (low-latency mode, or normal mode without a
// host sync); `who` starts the message ("rank 1 ").
void check_token_bound(const DispatcherContext& context, std::int64_t T, std::string_view who);

// A dispatcher serves one mode: refuses Mode::automatic, naming the dispatcher.
void check_dispatcher_mode(const DispatcherContext& context, std::string_view name);

// Checks one rank's DispatchInput against the config before anything moves: shapes, dtypes,
// physical ids in [0, P), finite weights, and (low-latency) T <= max_tokens_per_rank.
void validate_dispatch_input(const DispatcherContext& context, const DispatchInput& input, int rank);

// Bytes of one token's payload: activation row, its scales and its top-k ids + weights.
std::int64_t token_payload_bytes(const DispatcherContext& context);

// acc[h] += w * row[h] for a bf16 row.
inline void accumulate_weighted_row(float* acc, const bf16* row, float w, std::int64_t H) {
  for (std::int64_t h = 0; h < H; ++h) acc[h] += w * row[h].to_float();
}

}  // namespace epmoe::detail
