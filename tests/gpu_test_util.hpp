// Shared helpers of the GPU tests (tests/**/*_gpu_test.{cu,cpp}, ctest label "gpu").
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>

#include "epmoe/cuda/runtime.hpp"
#include "epmoe/error.hpp"
#include "expect_error.hpp"

// First statement of every GPU test: without a CUDA device the test is reported as skipped
// (ctest "Skipped", via the SKIP_REGULAR_EXPRESSION in tests/CMakeLists.txt), never as passed.
#define EPMOE_REQUIRE_GPU()                   \
  do {                                        \
    if (::epmoe::cuda::device_count() == 0) { \
      GTEST_SKIP() << "no CUDA device";       \
    }                                         \
  } while (0)

namespace epmoe::testing {

// Bitwise comparison of n elements of width sizeof(T); `describe(i)` explains element i. Reports
// the number of mismatches and the first few of them as one failure.
template <class T>
::testing::AssertionResult bits_equal(const T* got, const T* want, std::int64_t n,
                                      const std::function<std::string(std::int64_t)>& describe,
                                      int max_reported = 8) {
  std::int64_t mismatches = 0;
  std::ostringstream first;
  for (std::int64_t i = 0; i < n; ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      if (mismatches < max_reported) first << "\n  " << describe(i);
      ++mismatches;
    }
  }
  if (mismatches == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << mismatches << " of " << n << " elements differ; first:" << first.str();
}

}  // namespace epmoe::testing
