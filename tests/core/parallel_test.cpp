// parallel_chunks: every item exactly once at any thread count, and an exception from any thread
// reaches the caller after every thread has stopped (it used to end the process in std::terminate).
#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

#include "core/parallel.hpp"
#include "epmoe/error.hpp"

namespace epmoe {
namespace {

TEST(ParallelChunks, EveryItemOnceAtAnyThreadCount) {
  for (const unsigned threads : {1u, 2u, 3u, 8u}) {
    for (const std::int64_t chunk : {1, 7, 64}) {
      const std::int64_t n = 1000;
      std::vector<std::atomic<int>> seen(n);
      parallel_chunks(n, chunk, threads, [&](std::int64_t begin, std::int64_t end) {
        ASSERT_LE(end - begin, chunk);
        for (std::int64_t i = begin; i < end; ++i) seen[static_cast<std::size_t>(i)].fetch_add(1);
      });
      for (std::int64_t i = 0; i < n; ++i)
        ASSERT_EQ(seen[static_cast<std::size_t>(i)].load(), 1) << "item " << i << ", threads " << threads;
    }
  }
}

TEST(ParallelChunks, AnExceptionFromAnyThreadReachesTheCaller) {
  // The item that throws lands on whichever thread takes it: the caller's thread or a pool thread.
  for (const unsigned threads : {1u, 2u, 4u}) {
    for (const std::int64_t bad : {0, 5, 99}) {
      EXPECT_THROW(parallel_chunks(100, 1, threads,
                                   [&](std::int64_t begin, std::int64_t) {
                                     if (begin == bad) EPMOE_FAIL("item {} failed", begin);
                                   }),
                   Error)
          << "threads " << threads << ", item " << bad;
    }
  }
  EXPECT_THROW(parallel_chunks(64, 4, 4,
                               [](std::int64_t begin, std::int64_t) {
                                 if (begin == 32) throw std::bad_alloc();
                               }),
               std::bad_alloc);
}

}  // namespace
}  // namespace epmoe
