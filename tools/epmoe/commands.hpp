// Subcommand registration: each cmd_*.cpp adds itself with a static CommandRegistration, so a
// new subcommand is one new file.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace epmoe::tools {

using AddCommand = std::function<void(CLI::App& app)>;

struct CommandRegistration {
  CommandRegistration(int order, AddCommand add);  // lower order lists first in --help
};

void register_commands(CLI::App& app);
int exit_code();
void set_exit_code(int code);

}  // namespace epmoe::tools
