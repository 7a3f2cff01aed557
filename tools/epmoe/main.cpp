// epmoe: the command-line tool. Subcommands live in their own files (cmd_*.cpp).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "epmoe/error.hpp"
#include "tools/epmoe/commands.hpp"
#include "tools/epmoe/options.hpp"

int main(int argc, char** argv) {
  CLI::App app{"epmoe: expert-parallel Mixture-of-Experts layer for DeepSeek-V3/R1-class models"};
  app.require_subcommand(1);
  epmoe::tools::set_program_args(argc, argv);
  epmoe::tools::register_commands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // `epmoe nope`: CLI11 says only "A subcommand is required"; name the word it did not know.
    const std::vector<std::string> rest = app.remaining();
    // (Not for --help, which CLI11 answers before it looks at the rest: exit code 0.)
    if (e.get_exit_code() != 0 && app.get_subcommands().empty() && !rest.empty() &&
        !rest.front().starts_with("-")) {
      std::string names;
      for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
        names += (names.empty() ? "" : ", ") + sub->get_name();
      std::fprintf(stderr, "epmoe: unknown subcommand '%s' (expected one of: %s)\n", rest.front().c_str(),
                   names.c_str());
      return e.get_exit_code();
    }
    const int code = app.exit(e);
    if (code != 0) epmoe::tools::remove_results_of_refused_command_line(app);
    return code;
  } catch (const epmoe::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    epmoe::tools::remove_unwritten_results();
    return 2;
  } catch (const std::bad_alloc&) {
    // Sizes from the command line (tokens, --hidden, --experts, steps...) past this machine's memory:
    // a message and exit 2 instead of std::terminate's abort.
    std::fprintf(stderr,
                 "epmoe: out of host memory: the sizes asked for (tokens, steps, --hidden, --intermediate, "
                 "--experts, --max-tokens-per-rank...) need more memory than this machine has\n");
    epmoe::tools::remove_unwritten_results();
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "epmoe: %s\n", e.what());
    epmoe::tools::remove_unwritten_results();
    return 2;
  }
  return epmoe::tools::exit_code();
}
