// Errors: every host entry point validates its arguments and throws epmoe::Error with a
// message that names the argument and the rule it broke.
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace epmoe {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
[[noreturn]] void throw_error(const char* file, int line, const std::string& message);
}  // namespace detail

}  // namespace epmoe

// EPMOE_CHECK(cond, "fmt {}", args...) throws epmoe::Error("file:line: message") when cond is false.
#define EPMOE_CHECK(cond, ...)                                                      \
  do {                                                                              \
    if (!(cond)) [[unlikely]] {                                                     \
      ::epmoe::detail::throw_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__)); \
    }                                                                               \
  } while (0)

#define EPMOE_FAIL(...) ::epmoe::detail::throw_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__))
