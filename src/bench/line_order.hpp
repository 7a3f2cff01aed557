// The order in which `epmoe bench gemm` times a row's lines (suite_gemm.cpp).
#pragma once

#include <cstddef>
#include <vector>

namespace epmoe::bench {

// One timing of a line: the line (an index into the row's lines), the round and the place in it.
struct LinePlace {
  std::size_t line;
  int round;
  int place;
};

// `listed`: the row's lines to time, in the row's order; `rounds` (>= 1) rounds of them, round r
// starting at its r-th line (the order rotated by one per round). Over as many rounds as lines,
// each line runs once at every place of the row. Why: a line timed right after another on a large
// row starts on a warmer card, up to 5% slower (bench/NOTES.md, session 30), so lines compare fairly
// only across places.
inline std::vector<LinePlace> rotated_line_order(const std::vector<std::size_t>& listed, int rounds) {
  std::vector<LinePlace> order;
  if (listed.empty()) return order;
  order.reserve(listed.size() * static_cast<std::size_t>(rounds > 0 ? rounds : 0));
  for (int r = 0; r < rounds; ++r) {
    for (std::size_t j = 0; j < listed.size(); ++j)
      order.push_back({listed[(j + static_cast<std::size_t>(r)) % listed.size()], r, static_cast<int>(j)});
  }
  return order;
}

}  // namespace epmoe::bench
