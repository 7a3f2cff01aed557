// main() of the multi-rank GPU tests: run under `epmoe launch -n N -- epmoe_comm_tests`; without
// the launcher, one rank (world size 1); with EPMOE_LOOPBACK_RANKS=N (no launcher), N loopback ranks
// as threads on GPU 0 (each test body runs on every rank's thread: on_ranks). Fewer GPUs than ranks: prints
// "[  SKIPPED ]" and exits 0 (ctest's SKIP_REGULAR_EXPRESSION reports it as skipped).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "cuda/hd.hpp"
#include "epmoe/cuda/runtime.hpp"
#include "ranks_util.hpp"
#include "test_random.hpp"

namespace epmoe::ranks {
namespace {
std::shared_ptr<Communicator> g_world;               // this process's rank (one process per GPU)
std::vector<std::shared_ptr<Communicator>> g_ranks;  // loopback: every rank, each run by a thread
thread_local std::shared_ptr<Communicator> t_world;  // loopback: the rank of this thread
std::uint64_t g_seed = 0;                            // test_seed()
}  // namespace
std::uint64_t test_seed() {
  return g_seed;
}
std::uint64_t input_seed(std::uint64_t salt) {
  return detail::splitmix64(g_seed ^ detail::splitmix64(salt));
}
Communicator& world() {
  return *world_ptr();
}
std::shared_ptr<Communicator> world_ptr() {
  return t_world ? t_world : g_world;
}
void on_ranks(const std::function<void()>& body) {
  // Every failure message names the seed that replays it (a trace is per thread: one in each rank's).
  const std::string seed_trace = "test seed " + std::to_string(g_seed) + " (EPMOE_TEST_SEED replays it)";
  if (g_ranks.empty()) {
    SCOPED_TRACE(seed_trace);
    body();
    return;
  }
  // Loopback: one thread per rank, each with its rank as world() and as the thread's default
  // communicator (dispatchers made by name). GoogleTest's assertions are thread-safe here; an
  // exception ends that rank's part as a failure (the others then time out at their next wait).
  std::vector<std::thread> threads;
  for (const auto& rank : g_ranks) {
    threads.emplace_back([&body, &seed_trace, rank] {
      SCOPED_TRACE(seed_trace);
      t_world = rank;
      Communicator::set_thread_default(rank);
      try {
        EPMOE_CUDA_CHECK(cudaSetDevice(rank->device()));
        body();
      } catch (const std::exception& e) {
        ADD_FAILURE() << "loopback rank " << rank->rank() << ": " << e.what();
      }
      Communicator::set_thread_default(nullptr);
      t_world.reset();
    });
  }
  for (auto& t : threads) t.join();
}
}  // namespace epmoe::ranks

namespace {
// A failed test can leave a recorded device error (a peer's refusal, a timeout) in the shared world
// communicator; clearing it keeps one failure from failing every later test on every rank.
class ClearDeviceErrorsAfterAFailure : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (!info.result()->Failed()) return;
    std::vector<std::shared_ptr<epmoe::Communicator>> all = epmoe::ranks::g_ranks;
    if (all.empty()) all.push_back(epmoe::ranks::g_world);
    for (const auto& w : all) {
      if (!w || w->broken()) continue;
      try {
        w->reset_device_errors();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "epmoe_comm_tests: clearing device errors after %s: %s\n", info.name(),
                     e.what());
      }
    }
  }
};
}  // namespace

int main(int argc, char** argv) {
  // Loopback ranks share one CUDA context, where a lazily loaded kernel synchronizes the context
  // (Communicator::create_loopback refuses lazy loading): load every module at the first CUDA call.
  // They also share its hardware work queues: the most of them (create_loopback refuses fewer).
  if (const char* n = std::getenv("EPMOE_LOOPBACK_RANKS"); n != nullptr && *n != '\0') {
    setenv("CUDA_MODULE_LOADING", "EAGER", 0);
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  }
  ::testing::InitGoogleTest(&argc, argv);
  // A listing needs no GPU and no ranks (--gtest_list_tests on a machine without one).
  if (GTEST_FLAG_GET(list_tests)) return RUN_ALL_TESTS();
  ::testing::UnitTest::GetInstance()->listeners().Append(new ClearDeviceErrorsAfterAFailure);
  using namespace epmoe;
  try {
    const LaunchEnvironment env = LaunchEnvironment::from_env();
    // The launcher gives each rank its own GPU where there are enough, else every rank sees every
    // GPU and needs one per rank.
    if (const std::string missing = env.missing_gpus(cuda::device_count()); !missing.empty()) {
      std::printf("[  SKIPPED ] epmoe_comm_tests: %s (%s)\n", missing.c_str(),
                  cuda::device_description().c_str());
      return 0;
    }
    const char* loopback = std::getenv("EPMOE_LOOPBACK_RANKS");
    if (loopback != nullptr && *loopback != '\0') {
      // N ranks as threads on GPU 0, without NCCL (Communicator::create_loopback): the load/store
      // transports tested on a machine with one GPU.
      const int n = std::atoi(loopback);
      EPMOE_CHECK(n >= 2 && !env.present,
                  "EPMOE_LOOPBACK_RANKS='{}': a number of ranks >= 2, without epmoe launch", loopback);
      const auto group = LoopbackGroup::make(n, 0);
      for (int r = 0; r < n; ++r) ranks::g_ranks.push_back(Communicator::create_loopback(group, r));
      ranks::g_world = ranks::g_ranks[0];
      std::printf(
          "loopback: %d ranks as threads on GPU 0 (%s), no NCCL: the NCCL point-to-point cases fail "
          "by design\n",
          n, cuda::device_description(0).c_str());
    } else if (env.present) {
      ranks::g_world = Communicator::from_environment();
    } else {
      ranks::g_world = Communicator::create(new_nccl_id(), 0, 1, 0);
    }
    if (!ranks::g_world->loopback() && CommOptions{}.nonblocking)
      std::printf("the world's NCCL communicator is nonblocking (EPMOE_COMM_NONBLOCKING=1)\n");
    if (ranks::g_ranks.empty()) Communicator::set_process_default(ranks::g_world);
    // The randomized tests' seed, the same on every rank: EPMOE_TEST_SEED when set (fresh_seed reads it);
    // else launched ranks hash the NCCL unique id they share (a fresh one per launch), and loopback ranks
    // and a lone rank draw one.
    if (const char* fixed = std::getenv("EPMOE_TEST_SEED");
        env.present && (fixed == nullptr || *fixed == '\0')) {
      const ncclUniqueId id = env.unique_id(0.0);
      std::uint64_t h = 14695981039346656037ull;  // FNV-1a over the id's bytes
      for (const char byte : id.internal) h = (h ^ static_cast<unsigned char>(byte)) * 1099511628211ull;
      ranks::g_seed = h;
    } else {
      ranks::g_seed = epmoe::testing::fresh_seed();
    }
    std::printf("test seed %llu (EPMOE_TEST_SEED replays it)\n",
                static_cast<unsigned long long>(ranks::g_seed));
    std::printf("rank %d of %d on GPU %d (%s), NCCL %s from %s\n", ranks::g_world->rank(),
                ranks::g_world->size(), ranks::g_world->device(),
                cuda::device_description(ranks::g_world->device()).c_str(),
                loaded_nccl_version().str().c_str(), loaded_nccl_library_path().c_str());
  } catch (const Error& e) {
    std::fprintf(stderr, "epmoe_comm_tests: cannot start: %s\n", e.what());
    return 1;
  }
  const int rc = RUN_ALL_TESTS();
  try {
    if (ranks::g_ranks.empty() && !ranks::g_world->broken()) ranks::g_world->barrier();
  } catch (const Error& e) {
    std::fprintf(stderr, "epmoe_comm_tests: final barrier: %s\n", e.what());
  }
  Communicator::set_process_default(nullptr);
  ranks::g_world.reset();
  ranks::g_ranks.clear();
  return rc;
}
