// The kernels' one-time host set-ups register when the library loads (cuda/kernel_setup.hpp): no GPU
// needed to count them.
#include <gtest/gtest.h>

#include <cstdio>

#include "cuda/kernel_setup.hpp"

namespace epmoe {
namespace {

// Every FP8 and W4A8 GEMM instantiation (more than 30 W4A8 ones alone), five dispatch kernels and
// the router's g8 kernels: registered before main, so prepare_kernels can run them all before any
// call.
TEST(KernelSetup, EveryKernelFamilyRegistersWhenTheLibraryLoads) {
  const std::size_t n = cuda::kernel_setup_count();
  std::printf("  %zu kernel set-ups registered\n", n);
  EXPECT_GE(n, std::size_t{40});
}

}  // namespace
}  // namespace epmoe
