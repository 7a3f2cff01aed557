#include "bench/line_order.hpp"

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <utility>

namespace epmoe::bench {
namespace {

TEST(RotatedLineOrder, OneRoundKeepsTheRowOrder) {
  const std::vector<LinePlace> order = rotated_line_order({0, 2, 5}, 1);
  ASSERT_EQ(order.size(), 3u);
  for (int j = 0; j < 3; ++j) {
    EXPECT_EQ(order[j].line, (std::vector<std::size_t>{0, 2, 5})[j]);
    EXPECT_EQ(order[j].round, 0);
    EXPECT_EQ(order[j].place, j);
  }
}

TEST(RotatedLineOrder, EveryLineAtEveryPlaceOnceOverAsManyRoundsAsLines) {
  const std::vector<std::size_t> listed{1, 3, 4, 7};
  const std::vector<LinePlace> order = rotated_line_order(listed, 4);
  ASSERT_EQ(order.size(), 16u);
  std::set<std::pair<std::size_t, int>> seen;  // (line, place)
  std::map<int, std::set<std::size_t>> per_round;
  for (std::size_t i = 0; i < order.size(); ++i) {
    EXPECT_EQ(order[i].round, static_cast<int>(i / 4));
    EXPECT_EQ(order[i].place, static_cast<int>(i % 4));
    EXPECT_TRUE(seen.insert({order[i].line, order[i].place}).second)
        << "line " << order[i].line << " twice at place " << order[i].place;
    per_round[order[i].round].insert(order[i].line);
  }
  for (const auto& [round, lines] : per_round) EXPECT_EQ(lines.size(), 4u) << "round " << round;
  // Round 1 starts at the second line.
  EXPECT_EQ(order[4].line, 3u);
  EXPECT_EQ(order[7].line, 1u);
}

TEST(RotatedLineOrder, NoLinesNoTimings) {
  EXPECT_TRUE(rotated_line_order({}, 3).empty());
}

}  // namespace
}  // namespace epmoe::bench
