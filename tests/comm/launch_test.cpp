// `epmoe launch` (launch_ranks) with trivial commands: exit codes, environment, forwarded output,
// stopping the other ranks when one fails, the overall timeout.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "epmoe/comm.hpp"
#include "epmoe/launch.hpp"
#include "scoped_env.hpp"

namespace epmoe {
namespace {

using testing::ScopedEnv;

struct Captured {
  std::map<int, std::vector<std::string>> out, err;
  std::vector<std::string> notes;
};

LaunchResult run(LaunchOptions o, Captured& c) {
  o.on_line = [&c](int rank, bool is_stderr, std::string_view line) {
    (is_stderr ? c.err : c.out)[rank].emplace_back(line);
  };
  o.on_note = [&c](std::string_view m) { c.notes.emplace_back(m); };
  return launch_ranks(o);
}

LaunchOptions sh(int n, const std::string& script) {
  LaunchOptions o;
  o.num_ranks = n;
  o.command = {"sh", "-c", script};
  return o;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

TEST(LaunchTest, TrueSucceedsOnEveryRank) {
  Captured c;
  LaunchOptions o;
  o.num_ranks = 3;
  o.command = {"true"};
  const LaunchResult r = run(o, c);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.first_failed_rank, -1);
  EXPECT_EQ(r.rank_codes, (std::vector<int>{0, 0, 0}));
  EXPECT_FALSE(r.timed_out);
}

TEST(LaunchTest, FalseFails) {
  Captured c;
  LaunchOptions o;
  o.num_ranks = 2;
  o.command = {"false"};
  const LaunchResult r = run(o, c);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_GE(r.first_failed_rank, 0);
}

TEST(LaunchTest, TheFailingRanksExitCodeIsReturned) {
  Captured c;
  const LaunchResult r = run(sh(2, "exit 3"), c);
  EXPECT_EQ(r.exit_code, 3);
  ASSERT_FALSE(c.notes.empty());
  EXPECT_NE(c.notes[0].find("exited with code 3"), std::string::npos) << c.notes[0];
}

TEST(LaunchTest, RanksGetTheirEnvironmentAndOneId) {
  Captured c;
  const LaunchResult r = run(
      sh(2,
         "echo $EPMOE_RANK $EPMOE_WORLD_SIZE $EPMOE_LOCAL_RANK $EPMOE_LOCAL_WORLD_SIZE $NCCL_NVLS_ENABLE; "
         // The id is written after the ranks start (read_nccl_id_file waits the same way).
         "while [ ! -s \"$EPMOE_NCCL_ID_FILE\" ]; do sleep 0.01; done; cat \"$EPMOE_NCCL_ID_FILE\""),
      c);
  ASSERT_EQ(r.exit_code, 0);
  for (int rank = 0; rank < 2; ++rank) {
    ASSERT_EQ(c.out[rank].size(), 2u) << "rank " << rank;
    EXPECT_EQ(c.out[rank][0], fmt::format("{} 2 {} 2 0", rank, rank));
    EXPECT_EQ(c.out[rank][1].size(), kNcclIdHexChars);
    EXPECT_NO_THROW(nccl_id_from_hex(c.out[rank][1]));
  }
  EXPECT_EQ(c.out[0][1], c.out[1][1]) << "every rank reads the same id";
  EXPECT_NE(access(r.id_file.c_str(), F_OK), 0) << "the temporary id file is removed at the end";
}

TEST(LaunchTest, StderrAndUnterminatedLinesAreForwardedWithTheirRank) {
  Captured c;
  const LaunchResult r = run(sh(2, "echo oops >&2; printf 'no newline'"), c);
  ASSERT_EQ(r.exit_code, 0);
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_EQ(c.err[rank], std::vector<std::string>{"oops"});
    EXPECT_EQ(c.out[rank], std::vector<std::string>{"no newline"});
  }
}

TEST(LaunchTest, OneFailingRankStopsTheOthers) {
  Captured c;
  LaunchOptions o = sh(3, "if [ \"$EPMOE_RANK\" = 1 ]; then exit 4; fi; sleep 60");
  o.kill_grace_s = 1.0;
  const auto start = std::chrono::steady_clock::now();
  const LaunchResult r = run(o, c);
  EXPECT_LT(seconds_since(start), 20.0);
  EXPECT_EQ(r.exit_code, 4);
  EXPECT_EQ(r.first_failed_rank, 1);
  ASSERT_EQ(r.rank_codes.size(), 3u);
  EXPECT_EQ(r.rank_codes[1], 4);
  EXPECT_GT(r.rank_codes[0], 128) << "rank 0 was stopped by a signal";
  EXPECT_GT(r.rank_codes[2], 128);
}

TEST(LaunchTest, TheTimeoutStopsEveryRank) {
  Captured c;
  LaunchOptions o;
  o.num_ranks = 2;
  o.command = {"sleep", "60"};
  o.timeout_s = 0.5;
  o.kill_grace_s = 1.0;
  const auto start = std::chrono::steady_clock::now();
  const LaunchResult r = run(o, c);
  EXPECT_LT(seconds_since(start), 20.0);
  EXPECT_EQ(r.exit_code, 124);
  EXPECT_TRUE(r.timed_out);
  ASSERT_FALSE(c.notes.empty());
  EXPECT_NE(c.notes[0].find("timed out"), std::string::npos);
}

TEST(LaunchTest, AProgramThatDoesNotExistIs127) {
  Captured c;
  LaunchOptions o;
  o.num_ranks = 2;
  o.command = {"/nonexistent/epmoe-program"};
  const LaunchResult r = run(o, c);
  EXPECT_EQ(r.exit_code, 127);
  ASSERT_FALSE(c.notes.empty());
  EXPECT_NE(c.notes[0].find("cannot start rank 0"), std::string::npos) << c.notes[0];
}

// A rank's stdin is /dev/null: one that reads reads nothing, not the launcher's input (under a terminal
// a rank in its own process group that read it was stopped by SIGTTIN, and the launch hung for ever).
TEST(LaunchTest, RanksReadNothingFromTheLaunchersStdin) {
  int input[2];
  ASSERT_EQ(pipe(input), 0);
  ASSERT_EQ(write(input[1], "hello\n", 6), 6);
  close(input[1]);
  const int saved_stdin = dup(STDIN_FILENO);
  ASSERT_GE(saved_stdin, 0);
  ASSERT_GE(dup2(input[0], STDIN_FILENO), 0);
  close(input[0]);
  Captured c;
  const LaunchResult r = run(sh(1, "if read x; then echo \"got $x\"; else echo eof; fi"), c);
  dup2(saved_stdin, STDIN_FILENO);
  close(saved_stdin);
  ASSERT_EQ(r.exit_code, 0);
  EXPECT_EQ(c.out[0], std::vector<std::string>{"eof"});
}

// Rank 0's launcher writes a fresh id: an EPMOE_NCCL_ID left in the environment (an earlier job's) would
// take precedence over the id file in the ranks and send them to a bootstrap root that is gone. The
// launchers of the other nodes pass it on (that is how they may get the id).
TEST(LaunchTest, AnInheritedNcclIdIsDroppedOnlyByRankZerosLauncher) {
  const ScopedEnv id("EPMOE_NCCL_ID", "abab");
  Captured c;
  const LaunchResult r = run(sh(1, "echo ${EPMOE_NCCL_ID:-unset}"), c);
  ASSERT_EQ(r.exit_code, 0);
  EXPECT_EQ(c.out[0], std::vector<std::string>{"unset"});
  ASSERT_FALSE(c.notes.empty());
  EXPECT_NE(c.notes[0].find("EPMOE_NCCL_ID in the environment ignored"), std::string::npos) << c.notes[0];
  LaunchOptions second = sh(1, "echo ${EPMOE_NCCL_ID:-unset}");
  second.world_size = 2;
  second.first_rank = 1;
  Captured c2;
  ASSERT_EQ(run(second, c2).exit_code, 0);
  EXPECT_EQ(c2.out[1], std::vector<std::string>{"abab"});
}

// An interrupt names its signal and the launch returns 128 + it (SIGTERM: 143, as a shell reports a
// process that SIGTERM ended), after stopping every rank.
TEST(LaunchTest, AnInterruptReturnsItsSignal) {
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) {
    volatile std::sig_atomic_t interrupted = sig;
    Captured c;
    LaunchOptions o = sh(2, "sleep 60");
    o.interrupted = &interrupted;
    o.kill_grace_s = 1.0;
    const auto start = std::chrono::steady_clock::now();
    const LaunchResult r = run(o, c);
    EXPECT_LT(seconds_since(start), 20.0);
    EXPECT_EQ(r.exit_code, 128 + sig);
    ASSERT_FALSE(c.notes.empty());
    EXPECT_NE(c.notes[0].find(fmt::format("interrupted (signal {})", sig)), std::string::npos) << c.notes[0];
  }
}

TEST(LaunchTest, BadOptionsAreRefused) {
  Captured c;
  LaunchOptions o;
  o.num_ranks = 2;
  EXPECT_THROW(run(o, c), Error);  // no command
  o.command = {"true"};
  o.num_ranks = 0;
  EXPECT_THROW(run(o, c), Error);
  o.num_ranks = 2;
  o.world_size = 2;
  o.first_rank = 1;
  EXPECT_THROW(run(o, c), Error);  // ranks [1, 3) do not fit
}

// Each bad number is named with its value (the old message named neither timeout and called nan
// negative); a negative world size is refused rather than read as "num_ranks".
TEST(LaunchTest, BadNumbersAreNamedWithTheirValue) {
  const auto message = [](const LaunchOptions& o) {
    Captured c;
    try {
      run(o, c);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  LaunchOptions o;
  o.num_ranks = 1;
  o.command = {"true"};
  o.timeout_s = -1;
  EXPECT_NE(message(o).find("timeout_s must be >= 0 seconds (0: no limit), got -1"), std::string::npos)
      << message(o);
  o.timeout_s = std::numeric_limits<double>::quiet_NaN();
  EXPECT_NE(message(o).find("timeout_s must be >= 0 seconds (0: no limit), got nan"), std::string::npos)
      << message(o);
  o.timeout_s = 0;
  o.kill_grace_s = -2;
  EXPECT_NE(message(o).find("kill_grace_s must be in [0, 86400] seconds, got -2"), std::string::npos)
      << message(o);
  o.kill_grace_s = 1e10;  // (its nanoseconds overflowed the clock: no grace at all)
  EXPECT_NE(message(o).find("kill_grace_s must be in [0, 86400] seconds, got 10000000000"), std::string::npos)
      << message(o);
  o.kill_grace_s = 3;
  o.timeout_s = std::numeric_limits<double>::infinity();
  EXPECT_NE(message(o).find("timeout_s must be >= 0 seconds (0: no limit), got inf"), std::string::npos)
      << message(o);
  o.timeout_s = 0;
  o.world_size = -4;
  EXPECT_NE(message(o).find("world_size must be >= 0 (0: num_ranks), got -4"), std::string::npos)
      << message(o);
}

TEST(LaunchTest, MulticastIsTurnedOffForTheRanks) {
  Captured c;
  LaunchResult r;
  {
    const ScopedEnv nvls("NCCL_NVLS_ENABLE", "1");
    r = run(sh(1, "echo $NCCL_NVLS_ENABLE"), c);
  }
  ASSERT_EQ(r.exit_code, 0);
  EXPECT_EQ(c.out[0], std::vector<std::string>{"0"});
  ASSERT_FALSE(c.notes.empty());
  EXPECT_NE(c.notes[0].find("overridden"), std::string::npos);
}

TEST(LaunchTest, SecondNodeReadsTheGivenIdFile) {
  const std::string path = fmt::format("/tmp/epmoe-launch-test-id-{}", getpid());
  Captured c;
  LaunchOptions first = sh(1, "true");
  first.id_file = path;
  first.world_size = 2;
  ASSERT_EQ(run(first, c).exit_code, 0);
  EXPECT_EQ(access(path.c_str(), F_OK), 0) << "a given id file stays";
  LaunchOptions second = sh(1, "echo $EPMOE_RANK $EPMOE_WORLD_SIZE $EPMOE_LOCAL_RANK $EPMOE_NCCL_ID_FILE");
  second.world_size = 2;
  second.first_rank = 1;
  second.id_file = path;
  Captured c2;
  ASSERT_EQ(run(second, c2).exit_code, 0);
  EXPECT_EQ(c2.out[1], std::vector<std::string>{fmt::format("1 2 0 {}", path)});
  EXPECT_NO_THROW(read_nccl_id_file(path));
  std::remove(path.c_str());
}

TEST(LaunchTest, GpuIdsComeFromCudaVisibleDevicesOrTheDriversList) {
  EXPECT_EQ(launch_gpu_ids(nullptr, 3), (std::vector<std::string>{"0", "1", "2"}));
  EXPECT_EQ(launch_gpu_ids(nullptr, 0), std::vector<std::string>{});
  EXPECT_EQ(launch_gpu_ids("", 4), std::vector<std::string>{}) << "CUDA_VISIBLE_DEVICES='' hides every GPU";
  EXPECT_EQ(launch_gpu_ids("3, 1,,GPU-5e2a ", 8), (std::vector<std::string>{"3", "1", "GPU-5e2a"}));
  EXPECT_EQ(launch_gpu_ids("-1", 8), std::vector<std::string>{}) << "the usual way to hide every GPU";
  EXPECT_EQ(launch_gpu_ids("2,-1,0", 8), std::vector<std::string>{"2"});
}

// The launcher's GPUs are the ones in its CUDA_VISIBLE_DEVICES: with enough for the ranks each rank
// sees only its own (device 0); with too few, or --all-gpus, every rank sees them all and uses
// the device of its local rank.
TEST(LaunchTest, EachRankSeesItsOwnGpuWhenThereAreEnough) {
  const ScopedEnv visible("CUDA_VISIBLE_DEVICES", "4,6,GPU-7");
  const std::string script = "echo \"$CUDA_VISIBLE_DEVICES|$EPMOE_LOCAL_DEVICE|$EPMOE_ONE_GPU_PER_RANK\"";
  {
    Captured c;
    ASSERT_EQ(run(sh(3, script), c).exit_code, 0);
    EXPECT_EQ(c.out[0], std::vector<std::string>{"4|0|1"});
    EXPECT_EQ(c.out[1], std::vector<std::string>{"6|0|1"});
    EXPECT_EQ(c.out[2], std::vector<std::string>{"GPU-7|0|1"});
  }
  {
    Captured c;
    ASSERT_EQ(run(sh(4, script), c).exit_code, 0);  // 4 ranks, 3 GPUs
    for (int rank = 0; rank < 4; ++rank)
      EXPECT_EQ(c.out[rank], std::vector<std::string>{fmt::format("4,6,GPU-7|{}|0", rank)});
  }
  {
    Captured c;
    LaunchOptions o = sh(2, script);
    o.one_gpu_per_rank = false;
    ASSERT_EQ(run(o, c).exit_code, 0);
    for (int rank = 0; rank < 2; ++rank)
      EXPECT_EQ(c.out[rank], std::vector<std::string>{fmt::format("4,6,GPU-7|{}|0", rank)});
  }
}

TEST(LaunchTest, TheRanksEnvironmentSaysWhetherItsGpusSuffice) {
  LaunchEnvironment e;
  EXPECT_EQ(e.missing_gpus(1), "") << "no launcher: one GPU";
  EXPECT_NE(e.missing_gpus(0), "");
  e.present = true;
  e.world_size = 4;
  e.rank = 2;
  e.device = 2;  // every GPU visible: one per rank
  EXPECT_EQ(e.missing_gpus(4), "");
  EXPECT_NE(e.missing_gpus(3).find("4 rank(s) need as many GPUs, 3 visible"), std::string::npos)
      << e.missing_gpus(3);
  e.one_gpu_per_rank = true;  // its own GPU only
  e.device = 0;
  EXPECT_EQ(e.missing_gpus(1), "");
  EXPECT_NE(e.missing_gpus(0).find("rank 2"), std::string::npos) << e.missing_gpus(0);
  {
    const ScopedEnv w("EPMOE_WORLD_SIZE", "2"), r("EPMOE_RANK", "1"), l("EPMOE_LOCAL_RANK", "1"),
        d("EPMOE_LOCAL_DEVICE", "0"), one("EPMOE_ONE_GPU_PER_RANK", "1");
    const LaunchEnvironment from = LaunchEnvironment::from_env();
    EXPECT_EQ(from.device, 0);
    EXPECT_TRUE(from.one_gpu_per_rank);
  }
  {
    const ScopedEnv w("EPMOE_WORLD_SIZE", "2"), r("EPMOE_RANK", "1"), l("EPMOE_LOCAL_RANK", "1"),
        d("EPMOE_LOCAL_DEVICE", nullptr), one("EPMOE_ONE_GPU_PER_RANK", nullptr);
    const LaunchEnvironment from = LaunchEnvironment::from_env();
    EXPECT_EQ(from.device, 1) << "the device defaults to the local rank";
    EXPECT_FALSE(from.one_gpu_per_rank);
  }
}

}  // namespace
}  // namespace epmoe
