// expect_error_mentions: the one way the tests (CPU and GPU) check that a call is refused with a message
// that names what was wrong.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "epmoe/error.hpp"

namespace epmoe::testing {

// Runs fn and expects an epmoe::Error whose message contains `needle` (so that a validation
// failure is told apart from, say, a CUDA error that also throws epmoe::Error).
inline void expect_error_mentions(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an epmoe::Error mentioning \"" << needle << "\", nothing was thrown";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message \"" << e.what() << "\" does not mention \"" << needle << "\"";
  }
}

}  // namespace epmoe::testing
