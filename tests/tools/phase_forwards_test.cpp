// PhaseForwards: epmoe run's phases computed per forward (a billion forwards cost no memory).
#include "tools/epmoe/phase_forwards.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace epmoe::tools {
namespace {

TEST(PhaseForwards, ChunkedPromptsEndWithWhatIsLeft) {
  const PhaseForwards p = PhaseForwards::chunked(1000, 256);
  EXPECT_EQ(p.count, 4);
  EXPECT_EQ(p[0], 256);
  EXPECT_EQ(p[2], 256);
  EXPECT_EQ(p[3], 232);
  EXPECT_EQ(p.total(), 1000);
  EXPECT_EQ(p.max(), 256);
  EXPECT_EQ(p.sizes(), (std::vector<std::int64_t>{232, 256}));
}

TEST(PhaseForwards, ExactChunksAndOneShortChunk) {
  const PhaseForwards exact = PhaseForwards::chunked(1024, 256);
  EXPECT_EQ(exact.count, 4);
  EXPECT_EQ(exact[3], 256);
  EXPECT_EQ(exact.sizes(), (std::vector<std::int64_t>{256}));
  const PhaseForwards short_one = PhaseForwards::chunked(100, 4096);
  EXPECT_EQ(short_one.count, 1);
  EXPECT_EQ(short_one[0], 100);
  EXPECT_EQ(short_one.max(), 100);
  EXPECT_EQ(short_one.total(), 100);
  EXPECT_EQ(short_one.sizes(), (std::vector<std::int64_t>{100}));
  EXPECT_EQ(PhaseForwards::chunked(0, 256).count, 0);
  EXPECT_EQ(PhaseForwards::chunked(0, 256).sizes(), std::vector<std::int64_t>{});
}

TEST(PhaseForwards, HugeCountsAreNotListed) {
  const std::int64_t big = std::numeric_limits<std::int64_t>::max();
  const PhaseForwards p = PhaseForwards::chunked(big, 4096);
  EXPECT_EQ(p.count, big / 4096 + 1);
  EXPECT_EQ(p[p.count - 1], big % 4096);
  EXPECT_EQ(p.total(), big);
  const PhaseForwards d = PhaseForwards::uniform(std::numeric_limits<int>::max(), 128);
  EXPECT_EQ(d.total(), std::int64_t{std::numeric_limits<int>::max()} * 128);
  EXPECT_EQ(d[12345], 128);
  EXPECT_EQ(d.sizes(), (std::vector<std::int64_t>{128}));
}

}  // namespace
}  // namespace epmoe::tools
