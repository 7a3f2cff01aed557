// Subcommand registration: each cmd_*.cpp adds itself with a static CommandRegistration, so a
// new subcommand is one new file.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace epmoe::tools {

using AddCommand = std::function<void(CLI::App& app)>;

struct CommandRegistration {
  CommandRegistration(int order, AddCommand add);  // lower order lists first in --help
};

void register_commands(CLI::App& app);
int exit_code();
// The command line as main() received it (a multi-GPU run re-executes itself once per GPU).
void set_program_args(int argc, char** argv);
const std::vector<std::string>& program_args();
void set_exit_code(int code);

}  // namespace epmoe::tools
