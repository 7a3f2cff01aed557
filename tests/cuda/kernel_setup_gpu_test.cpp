// The kernels' one-time host set-up, registered when the library loads and run at once by
// prepare_kernels (cuda/kernel_setup.hpp; loopback ranks call it before their first call).
#include <gtest/gtest.h>

#include "cuda/kernel_setup.hpp"
#include "gpu_test_util.hpp"

namespace epmoe {
namespace {

// Every GEMM instantiation (FP8 and W4A8), the dispatch kernels with large shared memory and the
// router's kernels register themselves; preparing them all works on this GPU and is done once.
TEST(KernelSetup, EveryRegisteredSetUpRunsOnThisGpu) {
  EPMOE_REQUIRE_GPU();
  // Dozens of GEMM instantiations alone (the W4A8 family has more than 30).
  EXPECT_GE(cuda::kernel_setup_count(), std::size_t{30});
  EXPECT_NO_THROW(cuda::prepare_kernels());
  EXPECT_NO_THROW(cuda::prepare_kernels());  // (the second call returns at once)
}

}  // namespace
}  // namespace epmoe
