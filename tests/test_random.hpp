// What the randomized tests share: the seed (printed in their failure messages) and uniform draws.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <random>
#include <source_location>
#include <string>

#include <gtest/gtest.h>

namespace epmoe::testing {

// EPMOE_TEST_SEED (decimal) when set, to replay a run whose failure printed its seed; else a fresh seed
// per call.
inline std::uint64_t fresh_seed() {
  if (const char* fixed = std::getenv("EPMOE_TEST_SEED"); fixed != nullptr && *fixed != '\0')
    return std::strtoull(fixed, nullptr, 10);
  std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

// A randomized test's engine, seeded by fresh_seed(), with the seed in every failure message of the
// scope it lives in (a GoogleTest scoped trace at the line that declares it):
//   testing::SeededRng rng;  // then pick(rng, ...), uniform(rng, ...), any distribution
class SeededRng : public std::mt19937_64 {
 public:
  explicit SeededRng(std::source_location where = std::source_location::current())
      : SeededRng(fresh_seed(), where) {}
  std::uint64_t seed() const { return seed_; }

 private:
  SeededRng(std::uint64_t seed, const std::source_location& where)
      : std::mt19937_64(seed),
        seed_(seed),
        trace_(where.file_name(), static_cast<int>(where.line()),
               "seed " + std::to_string(seed) + " (EPMOE_TEST_SEED replays it)") {}
  std::uint64_t seed_;
  ::testing::ScopedTrace trace_;
};

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
