// What the randomized tests share: the seed (printed in their failure messages) and uniform draws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <random>

namespace epmoe::testing {

// EPMOE_TEST_SEED (decimal) when set, to replay a run whose failure printed its seed; else a fresh seed
// per call.
inline std::uint64_t fresh_seed() {
  if (const char* fixed = std::getenv("EPMOE_TEST_SEED"); fixed != nullptr && *fixed != '\0')
    return std::strtoull(fixed, nullptr, 10);
  std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

// An integer uniform in [lo, hi].
inline std::int64_t uniform(std::mt19937_64& rng, std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
}

// One of `values`, each as likely.
template <class T>
T pick(std::mt19937_64& rng, std::initializer_list<T> values) {
  return values.begin()[std::uniform_int_distribution<std::size_t>(0, values.size() - 1)(rng)];
}

}  // namespace epmoe::testing
