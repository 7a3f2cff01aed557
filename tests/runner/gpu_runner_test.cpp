// The GPU runner registry (epmoe/cuda/runner.hpp), without a GPU: every (layout, backend) the layer
// uses is registered from its backend's file, and a pair with no runner is refused with the list.
#include <gtest/gtest.h>

#include <algorithm>

#include "epmoe/cuda/runner.hpp"

namespace epmoe::cuda {
namespace {

TEST(GpuRunnerRegistry, EveryLayoutOfEveryGpuBackendIsRegistered) {
  const std::vector<std::string> keys = gpu_runner_keys();
  for (const Layout layout : {Layout::contiguous, Layout::masked})
    for (const QuantScheme quant : {QuantScheme::fp8, QuantScheme::w4a8}) {
      const std::string key = gpu_runner_key(layout, quant);
      EXPECT_NE(std::find(keys.begin(), keys.end(), key), keys.end()) << key << " is not registered";
    }
}

TEST(GpuRunnerRegistry, AMissingPairIsRefusedWithWhatIsRegistered) {
  GpuRunnerContext context;
  context.config = MoeConfig::preset("tiny");
  context.config.quant = QuantScheme::fp8;
  try {
    make_gpu_runner(Layout::token_major, context);  // no GPU runner takes the token-major layout
    FAIL() << "a token-major runner was made";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(gpu_runner_key(Layout::token_major, QuantScheme::fp8)), std::string::npos) << what;
    EXPECT_NE(what.find(gpu_runner_key(Layout::masked, QuantScheme::fp8)), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace epmoe::cuda
