#pragma once

#include <CLI/CLI.hpp>

namespace epmoe::tools {

// Adds every subcommand to `app`; each runs from its callback and records its exit code.
void register_commands(CLI::App& app);
int exit_code();
void set_exit_code(int code);

}  // namespace epmoe::tools
