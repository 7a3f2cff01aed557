// main() of the multi-rank GPU tests: run under `epmoe launch -n N -- epmoe_comm_tests`; without
// the launcher, one rank (world size 1). Fewer GPUs than ranks: prints "[  SKIPPED ]" and exits 0
// (ctest's SKIP_REGULAR_EXPRESSION reports it as skipped).
#include <gtest/gtest.h>

#include <cstdio>

#include "epmoe/cuda/runtime.hpp"
#include "ranks_util.hpp"

namespace epmoe::ranks {
namespace {
std::shared_ptr<Communicator> g_world;
}
Communicator& world() {
  return *g_world;
}
std::shared_ptr<Communicator> world_ptr() {
  return g_world;
}
}  // namespace epmoe::ranks

namespace {
// A failed test can leave a recorded device error (a peer's refusal, a timeout) in the shared world
// communicator; clearing it keeps one failure from failing every later test on every rank.
class ClearDeviceErrorsAfterAFailure : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (!info.result()->Failed() || !epmoe::ranks::g_world || epmoe::ranks::g_world->broken()) return;
    try {
      epmoe::ranks::g_world->reset_device_errors();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "epmoe_comm_tests: clearing device errors after %s: %s\n", info.name(), e.what());
    }
  }
};
}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
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
    if (env.present) {
      ranks::g_world = Communicator::from_environment();
    } else {
      ranks::g_world = Communicator::create(new_nccl_id(), 0, 1, 0);
    }
    Communicator::set_process_default(ranks::g_world);
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
    if (!ranks::g_world->broken()) ranks::g_world->barrier();
  } catch (const Error& e) {
    std::fprintf(stderr, "epmoe_comm_tests: final barrier: %s\n", e.what());
  }
  Communicator::set_process_default(nullptr);
  ranks::g_world.reset();
  return rc;
}
