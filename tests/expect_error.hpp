// expect_error_mentions: the one way the tests (CPU and GPU) check that a call is refused with a message
// that names what was wrong.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>

#include "epmoe/error.hpp"

namespace epmoe::testing {

// The message of the epmoe::Error that fn throws, or "<no throw>".
inline std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "<no throw>";
}

// Runs fn and expects an epmoe::Error whose message contains every needle (so that a validation failure is
// told apart from, say, a CUDA error that also throws epmoe::Error).
inline void expect_error_mentions(const std::function<void()>& fn,
                                  std::initializer_list<std::string_view> needles) {
  try {
    fn();
    ADD_FAILURE() << "expected an epmoe::Error mentioning \"" << (needles.size() > 0 ? *needles.begin() : "")
                  << "\", nothing was thrown";
  } catch (const Error& e) {
    const std::string what = e.what();
    for (std::string_view needle : needles)
      EXPECT_NE(what.find(needle), std::string::npos)
          << "message \"" << what << "\" does not mention \"" << needle << "\"";
  }
}
inline void expect_error_mentions(const std::function<void()>& fn, const std::string& needle) {
  expect_error_mentions(fn, {std::string_view(needle)});
}

}  // namespace epmoe::testing
