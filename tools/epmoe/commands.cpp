#include "tools/epmoe/commands.hpp"

#include <algorithm>
#include <utility>
#include <vector>

namespace epmoe::tools {
namespace {
int g_exit_code = 0;
std::vector<std::pair<int, AddCommand>>& commands() {
  static std::vector<std::pair<int, AddCommand>> list;
  return list;
}
}  // namespace

CommandRegistration::CommandRegistration(int order, AddCommand add) {
  commands().emplace_back(order, std::move(add));
}

void register_commands(CLI::App& app) {
  auto& list = commands();
  std::stable_sort(list.begin(), list.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (auto& [order, add] : list) add(app);
}
int exit_code() {
  return g_exit_code;
}
namespace {
std::vector<std::string>& args() {
  static std::vector<std::string> list;
  return list;
}
}  // namespace
void set_program_args(int argc, char** argv) {
  args().assign(argv, argv + argc);
}
const std::vector<std::string>& program_args() {
  return args();
}
void set_exit_code(int code) {
  g_exit_code = code;
}
}  // namespace epmoe::tools
