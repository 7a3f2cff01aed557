// `epmoe run`'s phases as counts of forwards (the CPU simulation and the GPU run).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace epmoe::tools {

// The forwards of a phase, tokens per rank computed per forward rather than listed (--steps or
// --prompt-tokens may ask for billions of forwards): `count` forwards of `tokens` each but the last, of
// `last` (prefill's prompts in chunks end with what is left).
struct PhaseForwards {
  std::int64_t count = 0, tokens = 0, last = 0;

  static PhaseForwards uniform(std::int64_t count, std::int64_t tokens) { return {count, tokens, tokens}; }
  // `total` tokens in forwards of `chunk` (> 0).
  static PhaseForwards chunked(std::int64_t total, std::int64_t chunk) {
    if (total <= 0) return {};
    const std::int64_t count = total / chunk + (total % chunk != 0 ? 1 : 0);
    return {count, std::min(chunk, total), total - (count - 1) * chunk};
  }
  std::int64_t operator[](std::int64_t f) const { return f + 1 == count ? last : tokens; }
  std::int64_t max() const { return count > 0 ? std::max(tokens, last) : 0; }
  std::int64_t total() const { return count > 0 ? (count - 1) * tokens + last : 0; }
  // The distinct batch sizes, ascending (a graph is captured per size).
  std::vector<std::int64_t> sizes() const {
    if (count == 0) return {};
    if (count == 1 || last == tokens) return {last};
    return {std::min(tokens, last), std::max(tokens, last)};
  }
};

}  // namespace epmoe::tools
