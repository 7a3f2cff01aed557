// Starting N local ranks of a multi-GPU program (`epmoe launch -n N -- <command...>`).
//
// The launcher writes a fresh NCCL unique id to a file (this process then hosts NCCL's bootstrap
// root, so it stays alive until the ranks exit), starts the command N times, each in its own
// process group with
//   EPMOE_RANK, EPMOE_WORLD_SIZE, EPMOE_LOCAL_RANK, EPMOE_LOCAL_WORLD_SIZE, EPMOE_NCCL_ID_FILE,
//   NCCL_NVLS_ENABLE=0 (NVLink multicast stays off, whatever the caller's environment says),
//   CUDA_VISIBLE_DEVICES=<its own GPU> and EPMOE_LOCAL_DEVICE=0 (one_gpu_per_rank, below)
// in its environment, forwards every line the ranks print with a "[rank r] " prefix, and waits.
// When one rank fails (non-zero exit or a signal) the others are stopped (SIGTERM, then SIGKILL
// after a grace period); past the overall timeout all of them are. Several nodes: run one
// launcher per node with --world-size and --first-rank; node 0's writes the id file (on a shared
// file system) or the others get the id in EPMOE_NCCL_ID.
#pragma once

#include <csignal>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace epmoe {

struct LaunchOptions {
  int num_ranks = 1;          // processes started here
  int world_size = 0;         // all ranks of the job; 0: num_ranks
  int first_rank = 0;         // this launcher's ranks are [first_rank, first_rank + num_ranks)
  double timeout_s = 0.0;     // overall limit; 0: none
  double kill_grace_s = 3.0;  // SIGTERM -> SIGKILL
  // first_rank == 0: the id is written here (default: a temporary file, removed at the end).
  // Otherwise the id is read from here by the ranks (or from EPMOE_NCCL_ID, inherited).
  std::string id_file;
  std::vector<std::string> command;  // argv; searched on PATH
  // Each rank sees only its GPU: CUDA_VISIBLE_DEVICES = the local rank's entry of the GPUs this
  // launcher sees (its CUDA_VISIBLE_DEVICES, else every GPU the driver lists), EPMOE_LOCAL_DEVICE=0.
  // CUDA start-up then initialises one device per process instead of all of them in each: the first
  // forward of `epmoe run` at 2 ranks on a 4-GPU host came 2.09 / 1.75 s -> 1.21 / 1.19 s after the
  // start (NCCL reaches the peers through its own handles either way). Without enough GPUs for the
  // ranks, or false (`epmoe launch --all-gpus`): every rank sees them all, EPMOE_LOCAL_DEVICE = the
  // local rank.
  bool one_gpu_per_rank = true;
  // Each complete line a rank prints (without its newline), stdout or stderr. Default: written to
  // the launcher's stdout / stderr as "[rank r] line" (stdout lines without the prefix when
  // !prefix_stdout: a rank's stdout that is a JSON document, `epmoe run --json -`).
  std::function<void(int rank, bool is_stderr, std::string_view line)> on_line;
  bool prefix_stdout = true;
  // The launcher's own messages. Default: "[launch] message" on stderr.
  std::function<void(std::string_view message)> on_note;
  // Set to a signal's number (from its handler: SIGINT, SIGTERM, SIGHUP, ...) to stop every rank and
  // return 128 + that number; any other non-zero value returns 130, as SIGINT.
  const volatile std::sig_atomic_t* interrupted = nullptr;
};

struct LaunchResult {
  // 0; the first failing rank's code (128 + signal if killed); 124 on timeout; 128 + the signal when
  // interrupted; 141 (128 + SIGPIPE) when the launcher's output was closed.
  int exit_code = 0;
  int first_failed_rank = -1;  // -1 when none failed
  bool timed_out = false;
  std::vector<int> rank_codes;  // per local rank: exit code, 128 + signal, or -1 if never started
  std::string id_file;          // the file the id was written to or read from
};

// The GPUs a launcher hands out, one per local rank: the entries of `cuda_visible_devices` (the
// launcher's CUDA_VISIBLE_DEVICES; ids, UUIDs or MIG names, kept as written) when set, else
// "0".."listed - 1" (`listed`: the GPUs the driver lists). Empty entries are dropped; a negative one
// ends the list, as it ends CUDA's.
std::vector<std::string> launch_gpu_ids(const char* cuda_visible_devices, int listed);

// Throws epmoe::Error for bad options (no command, num_ranks < 1, ranks outside the world, a timeout or
// grace that is not a finite number of seconds, a grace over a day). A rank that cannot be started (no
// such program) ends the launch with code 127 and stops those started before it; one that fails later
// is reported in the result.
//
// The ranks' stdin is /dev/null. Each has a death signal (SIGKILL) tied to the launching thread, so a
// launcher that dies does not leave its ranks running. With the default `on_line` / `on_note` the
// launcher never blocks on its own stdout / stderr: output waits in memory (up to 8 MiB, then the ranks'
// pipes are no longer read) while its timeout and signals go on; if that output is closed (EPIPE: the
// caller should ignore SIGPIPE) every rank is stopped and the result is 128 + SIGPIPE.
LaunchResult launch_ranks(const LaunchOptions& options);

}  // namespace epmoe
