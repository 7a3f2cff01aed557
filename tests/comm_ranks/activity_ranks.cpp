// bench::measure_forwards on N ranks (src/bench/device_activity): the forwards it runs are collective
// (each one meets the peers at a barrier here, as the layer's dispatch and combine do), so every rank
// runs all of them or none does, whatever CUPTI allows on each rank. Ranks of their own processes can all
// record; loopback ranks (threads of one process) cannot, since only one measurement may be open per
// process: then no rank runs a forward, and each says why.
#include <gtest/gtest.h>

#include <string>

#include "bench/bench.hpp"
#include "bench/device_activity.hpp"
#include "ranks_util.hpp"

namespace epmoe::ranks {
namespace {

TEST(DeviceActivityRanks, EveryRankRunsTheForwardsOrNoneDoes) {
  on_ranks([&] {
    Communicator& comm = world();
    cudaStream_t stream = comm.stream();
    int calls = 0;
    std::string why;
    const bench::ActivitySummary a = bench::measure_forwards(
        [&](int) {
          ++calls;
          bench::gpu_sleep(stream, 200);
          comm.barrier();  // a peer that skipped its forwards makes this a timeout
        },
        2, &why, &comm);
    // The same number of forwards on every rank.
    cuda::DeviceTensor count(DType::i64, {1});
    HostTensor mine(DType::i64, {1});
    mine.data<std::int64_t>()[0] = calls;
    cuda::copy_to_device(count, mine, stream);
    comm.all_reduce_sum_i64(count.data<std::int64_t>(), count.data<std::int64_t>(), 1, stream);
    const std::int64_t total = cuda::to_host(count, stream).data<std::int64_t>()[0];
    EXPECT_EQ(total, static_cast<std::int64_t>(calls) * comm.size());
    if (calls == 0) {
      EXPECT_EQ(a.forwards, 0);
      EXPECT_FALSE(why.empty());
    } else {
      EXPECT_EQ(calls, 3);  // a warm-up and two counted
      EXPECT_TRUE(a.forwards == 2 || !why.empty()) << why;
      if (a.forwards == 2) {
        EXPECT_GE(a.busy_ms, 0.15);
      }
    }
  });
}

}  // namespace
}  // namespace epmoe::ranks
