// Shared helpers of the GPU tests (tests/**/*_gpu_test.{cu,cpp}, ctest label "gpu").
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>

#include "epmoe/cuda/device_buffer.hpp"
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

// Two outputs hold the same bits (two empty ones too).
inline bool same_bits(const HostTensor& x, const HostTensor& y) {
  return x.nbytes() == y.nbytes() &&
         (x.nbytes() == 0 || std::memcmp(x.view().data, y.view().data, x.nbytes()) == 0);
}

// Runs `launch` twice, `out` poisoned (0xff bytes) before each run, and returns the first run's output.
// The second must have the same bits: a kernel with a race, or one that reads what an earlier call left
// behind, differs. `launch` also does whatever else each run needs first (e.g. poison a workspace).
template <class Launch>
HostTensor run_twice_same_bits(const cuda::DeviceTensor& out, cudaStream_t stream, Launch&& launch) {
  out.fill_bytes(0xff, stream);
  launch();
  HostTensor got = cuda::to_host(out, stream);
  out.fill_bytes(0xff, stream);
  launch();
  const HostTensor again = cuda::to_host(out, stream);
  EXPECT_TRUE(same_bits(got, again)) << "two runs differ";
  return got;
}

}  // namespace epmoe::testing
