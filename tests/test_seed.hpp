// The seed of a randomized test (tests print it in their failure messages).
#pragma once

#include <cstdint>
#include <cstdlib>
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

}  // namespace epmoe::testing
