// epmoe: the command-line tool. Subcommands live in their own files (cmd_*.cpp).
#include <CLI/CLI.hpp>
#include <cstdio>

#include "epmoe/error.hpp"
#include "tools/epmoe/commands.hpp"

int main(int argc, char** argv) {
  CLI::App app{"epmoe: expert-parallel Mixture-of-Experts layer for DeepSeek-V3/R1-class models"};
  app.require_subcommand(1);
  epmoe::tools::set_program_args(argc, argv);
  epmoe::tools::register_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const epmoe::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  return epmoe::tools::exit_code();
}
