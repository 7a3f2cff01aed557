#include "tools/epmoe/commands.hpp"

namespace epmoe::tools {
namespace {
int g_exit_code = 0;
}
int exit_code() { return g_exit_code; }
void set_exit_code(int code) { g_exit_code = code; }
void register_commands(CLI::App& app) { (void)app; }
}  // namespace epmoe::tools
