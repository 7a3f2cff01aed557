#include "epmoe/error.hpp"

#include <cstring>

namespace epmoe::detail {

void throw_error(const char* file, int line, const std::string& message) {
  // Keep only the path below the repository root so messages stay short.
  const char* short_file = file;
  for (const char* marker : {"/src/", "/include/", "/tools/", "/tests/", "/bench/"}) {
    if (const char* p = std::strstr(file, marker)) {
      short_file = p + 1;
      break;
    }
  }
  throw Error(fmt::format("epmoe: {} ({}:{})", message, short_file, line));
}

}  // namespace epmoe::detail
