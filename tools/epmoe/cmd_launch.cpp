// `epmoe launch -n N [--timeout S] -- <command...>`: N local ranks of a multi-GPU program with a
// shared NCCL unique id (epmoe/launch.hpp). The exit code is 0 when every rank succeeded, the
// first failing rank's code otherwise, 124 on timeout, 128 + the signal that stopped it (SIGINT, SIGTERM,
// SIGHUP, SIGQUIT: every rank is stopped first), 141 when its output was closed.
#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <vector>

#include "epmoe/launch.hpp"
#include "tools/epmoe/commands.hpp"
#include "tools/epmoe/launch_signals.hpp"
#include "tools/epmoe/options.hpp"

namespace epmoe::tools {
namespace {

void run_launch(const LaunchOptions& options) {
  const LaunchSignals signals;
  LaunchOptions o = options;
  o.interrupted = signals.interrupted();
  set_exit_code(launch_ranks(o).exit_code);
}

const CommandRegistration kRegistration{
    60, [](CLI::App& app) {
      auto o = std::make_shared<LaunchOptions>();
      CLI::App* cmd = app.add_subcommand(
          "launch",
          "Start N local ranks of a multi-GPU program (one per GPU) with a shared NCCL unique id: "
          "epmoe launch -n 2 -- <command...>");
      cmd->add_option("-n,--ranks", o->num_ranks, "Ranks (processes) to start on this machine")
          ->required()
          ->check(positive());
      cmd->add_option("--timeout", o->timeout_s, "Stop every rank after this many seconds (0: no limit)")
          ->check(non_negative())
          ->capture_default_str();
      cmd->add_option("--world-size", o->world_size, "Ranks of the whole job, several nodes (default: -n)")
          ->check(positive());
      cmd->add_option("--first-rank", o->first_rank, "First rank started here (several nodes)")
          ->check(non_negative())
          ->capture_default_str();
      cmd->add_option(
          "--id-file", o->id_file,
          "NCCL id file: written here by the launcher of rank 0 (default: a temporary file), read by "
          "the others");
      cmd->add_option("--kill-grace", o->kill_grace_s,
                      "Seconds between SIGTERM and SIGKILL when stopping ranks (at most 86400)")
          ->check(non_negative())
          ->check(at_most(86400))
          ->capture_default_str();
      cmd->add_flag_callback(
          "--all-gpus", [o] { o->one_gpu_per_rank = false; },
          "Every rank sees every GPU (default: each rank's CUDA_VISIBLE_DEVICES is its own GPU, which "
          "makes CUDA start-up faster)");
      cmd->add_option("command", o->command, "The program and its arguments (after --)")->required();
      cmd->callback([o] { run_launch(*o); });
    }};

}  // namespace
}  // namespace epmoe::tools
