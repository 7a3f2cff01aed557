// `epmoe launch -n N [--timeout S] -- <command...>`: N local ranks of a multi-GPU program with a
// shared NCCL unique id (epmoe/launch.hpp). The exit code is 0 when every rank succeeded, the
// first failing rank's code otherwise, 124 on timeout.
#include <CLI/CLI.hpp>
#include <csignal>
#include <memory>
#include <string>
#include <vector>

#include "epmoe/launch.hpp"
#include "tools/epmoe/commands.hpp"
#include "tools/epmoe/options.hpp"

namespace epmoe::tools {
namespace {

volatile std::sig_atomic_t g_interrupted = 0;
extern "C" void on_interrupt(int) {
  g_interrupted = 1;
}

void run_launch(const LaunchOptions& options) {
  LaunchOptions o = options;
  o.interrupted = &g_interrupted;
  struct sigaction sa {};
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  struct sigaction old_int {
  }, old_term{};
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  const LaunchResult r = launch_ranks(o);
  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  set_exit_code(r.exit_code);
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
                      "Seconds between SIGTERM and SIGKILL when stopping ranks")
          ->check(non_negative())
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
