// bench::DeviceActivity on the GPU: CUPTI's records of real launches, split at the marks, and a gap the
// host leaves between two kernels seen as idle before the second one (what CUDA events cannot show).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <thread>

#include "bench/bench.hpp"
#include "bench/device_activity.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "gpu_test_util.hpp"

namespace epmoe::bench {
namespace {

// Skips where CUPTI cannot be had for a reason outside epmoe (a build without CUPTI's headers, no
// libcupti, another CUPTI client injected); any other failure to open fails the test.
#define EPMOE_REQUIRE_CUPTI(activity)                                                                    \
  std::string why;                                                                                       \
  std::unique_ptr<DeviceActivity> activity = DeviceActivity::open(&why);                                 \
  if (!activity &&                                                                                       \
      (why.find("without CUPTI") != std::string::npos || why.find("no libcupti") != std::string::npos || \
       why.find("another CUPTI client") != std::string::npos))                                           \
    GTEST_SKIP() << "SKIPPED: " << why;                                                                  \
  ASSERT_NE(activity, nullptr) << why

TEST(DeviceActivityGpu, AHostGapBetweenKernelsIsIdleBeforeTheSecond) {
  EPMOE_REQUIRE_GPU();
  EPMOE_REQUIRE_CUPTI(activity);
  std::string second_why;
  EXPECT_EQ(DeviceActivity::open(&second_why), nullptr);  // one at a time
  EXPECT_NE(second_why.find("already open"), std::string::npos) << second_why;

  cudaStream_t stream = nullptr;
  EPMOE_CUDA_CHECK(cudaStreamCreate(&stream));
  const cuda::DeviceTensor scratch(DType::i32, {1024});
  gpu_sleep(stream, 10);  // module loaded before the measurement
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));

  activity->begin();
  // Forward 0: a 2 ms kernel, the host away ~20 ms, a memset, another 2 ms kernel.
  activity->mark();
  gpu_sleep(stream, 2000);
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EPMOE_CUDA_CHECK(cudaMemsetAsync(scratch.data<std::int32_t>(), 0, scratch.nbytes(), stream));
  gpu_sleep(stream, 2000);
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  // Forward 1: two kernels queued back to back (no host gap).
  activity->mark();
  gpu_sleep(stream, 1000);
  gpu_sleep(stream, 1000);
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<std::vector<ActivityRecord>> forwards = activity->end();
  EPMOE_CUDA_CHECK(cudaStreamDestroy(stream));

  ASSERT_EQ(forwards.size(), 2u);
  ASSERT_EQ(forwards[0].size(), 3u);
  ASSERT_EQ(forwards[1].size(), 2u);
  const ActivitySummary f0 = summarize_activity(forwards[0]);
  const ActivitySummary f1 = summarize_activity(forwards[1]);
  auto at = [](const auto& a, ActivityKind k) { return a[static_cast<std::size_t>(k)]; };
  EXPECT_GE(f0.busy_ms, 3.9);
  EXPECT_GE(f0.idle_ms, 15.0);  // the host's 20 ms, less nothing the device could do meanwhile
  EXPECT_LT(f0.idle_ms, 500.0);
  EXPECT_NEAR(f0.window_ms, f0.busy_ms + f0.idle_ms, 1e-9);
  EXPECT_GT(at(f0.busy_by_kind_ms, ActivityKind::copies), 0.0);
  EXPECT_GE(at(f0.idle_before_kind_ms, ActivityKind::copies), 15.0);  // the memset ended the gap
  EXPECT_GE(f1.busy_ms, 1.9);
  EXPECT_LT(f1.idle_ms, 0.5);  // back to back: launch gaps only
  for (const ActivityRecord& r : forwards[1])
    EXPECT_NE(r.name.find("sleep_kernel"), std::string::npos) << r.name;

  // Closed, it opens again; a measurement with no launches gives empty forwards.
  activity.reset();
  activity = DeviceActivity::open(&why);
  ASSERT_NE(activity, nullptr) << why;
  activity->begin();
  activity->mark();
  const auto empty = activity->end();
  ASSERT_EQ(empty.size(), 1u);
  EXPECT_TRUE(empty[0].empty());
  EXPECT_EQ(summarize_activity(empty[0]).forwards, 0);
}

// A graph captured after an earlier measurement ended (CUPTI loaded, its records off) and replayed in a
// new one: its kernels are recorded. measure_forwards drops its warm-up forward and averages the rest.
TEST(DeviceActivityGpu, AGraphReplayedInALaterMeasurementIsRecorded) {
  EPMOE_REQUIRE_GPU();
  {
    EPMOE_REQUIRE_CUPTI(first);
    first->begin();
    first->mark();
    (void)first->end();
  }
  cudaStream_t stream = nullptr;
  EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  EPMOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  gpu_sleep(stream, 500);
  gpu_sleep(stream, 500);
  EPMOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  EPMOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  std::string why;
  int launches = 0;
  const ActivitySummary a = measure_forwards(
      [&](int) {
        ++launches;
        EPMOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
      },
      3, &why);
  EPMOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  EPMOE_CUDA_CHECK(cudaGraphDestroy(graph));
  EPMOE_CUDA_CHECK(cudaStreamDestroy(stream));
  EXPECT_EQ(launches, 4);  // a warm-up and three counted
  ASSERT_EQ(a.forwards, 3) << why;
  EXPECT_EQ(a.records, 2);
  EXPECT_GE(a.busy_ms, 0.9);
  EXPECT_LT(a.idle_ms, 0.5);
  EXPECT_NEAR(a.window_ms, a.busy_ms + a.idle_ms, 1e-9);
}

}  // namespace
}  // namespace epmoe::bench
