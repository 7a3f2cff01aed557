// The communicator's background set-up on one GPU: create() returns before NCCL is up, the first
// use waits for it, and a peer that never starts is reported after the timeout instead of hanging.
#include <gtest/gtest.h>

#include <chrono>
#include <memory>

#include "epmoe/comm.hpp"
#include "gpu_test_util.hpp"

namespace epmoe {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

TEST(CommunicatorSetup, OneRankIsUsableAfterTheBackgroundInit) {
  EPMOE_REQUIRE_GPU();
  auto comm = Communicator::create(new_nccl_id(), 0, 1, 0);
  ASSERT_NE(comm->nccl(), nullptr);  // waits for the set-up
  comm->barrier();
  EXPECT_FALSE(comm->broken());
}

TEST(CommunicatorSetup, APeerThatNeverStartsIsReportedAfterTheTimeout) {
  EPMOE_REQUIRE_GPU();
  CommOptions o;
  o.timeout_s = 1.0;  // host waits allow 1.5 * 1 + 1 = 2.5 s
  const auto start = Clock::now();
  auto comm = Communicator::create(new_nccl_id(), 0, 2, 0, o);  // rank 1 never comes
  EXPECT_LT(seconds_since(start), 2.0) << "create() should not wait for NCCL's set-up";
  testing::expect_error_mentions([&] { comm->barrier(); }, "was not set up within 2.5 s");
  const double waited = seconds_since(start);
  EXPECT_GE(waited, 2.4);
  EXPECT_LT(waited, 10.0);
  // Every later use names the same reason, without waiting again.
  testing::expect_error_mentions([&] { (void)comm->nccl(); }, "did every rank start");
  const auto destroy = Clock::now();
  comm.reset();
  EXPECT_LT(seconds_since(destroy), 2.0);
}

}  // namespace
}  // namespace epmoe
