// DeviceBuffer / DeviceTensor / Stream / Event and the copy helpers.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/launch.hpp"
#include "epmoe/cuda/runtime.hpp"
#include "gpu_test_util.hpp"

namespace epmoe::cuda {
namespace {

using epmoe::testing::expect_error_mentions;

TEST(DeviceBufferGpu, RoundTripThroughDevice) {
  EPMOE_REQUIRE_GPU();
  Stream stream;
  HostTensor h(DType::i32, {3, 1000});
  for (std::int64_t i = 0; i < h.numel(); ++i)
    h.data<std::int32_t>()[i] = static_cast<std::int32_t>(i * 7 - 11);
  const DeviceTensor a = to_device(h, stream);
  const DeviceTensor b(DType::i32, {3, 1000});
  b.fill_bytes(0xff, stream);
  copy(b, a, stream);  // device to device
  HostTensor back(DType::i32, {3, 1000});
  back.fill_bytes(0xab);
  copy_to_host(back, b, stream);
  stream.synchronize();
  EXPECT_EQ(std::memcmp(back.data<std::int32_t>(), h.data<std::int32_t>(), h.nbytes()), 0);
  const HostTensor row = to_host(b.view().select(2), stream);
  EXPECT_EQ(row.data<std::int32_t>()[5], (2 * 1000 + 5) * 7 - 11);
}

TEST(DeviceBufferGpu, MoveOnlyOwnershipAndViews) {
  EPMOE_REQUIRE_GPU();
  DeviceBuffer a(4096);
  void* p = a.data();
  EXPECT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 256, 0u);
  DeviceBuffer b(std::move(a));
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(b.size(), 4096u);
  EXPECT_TRUE(a.empty());  // NOLINT(bugprone-use-after-move): moved-from state is specified
  const TensorView v = b.view(DType::f32, {8, 128});
  EXPECT_EQ(v.device, Device::cuda);
  EXPECT_EQ(v.data, p);
  EXPECT_EQ(v.nbytes(), 4096u);
  expect_error_mentions([&] { (void)b.view(DType::f32, {8, 129}); }, "the device buffer holds 4096");
  b = DeviceBuffer(16);
  EXPECT_EQ(b.size(), 16u);
  EXPECT_TRUE(DeviceBuffer(0).empty());
}

TEST(DeviceBufferGpu, CopyRefusesMismatches) {
  EPMOE_REQUIRE_GPU();
  Stream stream;
  const DeviceTensor a(DType::f32, {4, 4});
  const DeviceTensor b(DType::f32, {4, 5});
  const DeviceTensor c(DType::i32, {4, 4});
  const HostTensor h(DType::f32, {4, 4});
  expect_error_mentions([&] { copy(b, a, stream); }, "differ in shape");
  expect_error_mentions([&] { copy(c, a, stream); }, "differ in dtype");
  expect_error_mentions([&] { copy_to_device(h, a, stream); }, "dst must live on cuda");
  expect_error_mentions([&] { copy_to_host(h, h, stream); }, "src must live on cuda");
}

TEST(DeviceBufferGpu, EventsTimeAndPropsAreRead) {
  EPMOE_REQUIRE_GPU();
  const DeviceProps& props = device_props();
  EXPECT_GT(props.sm_count, 0);
  EXPECT_GT(props.l2_bytes, 0u);
  EXPECT_EQ(&device_props(), &props);  // cached
  Stream stream;
  Event start, end;
  const DeviceBuffer buf(64 << 20);
  start.record(stream);
  buf.fill_bytes(0x5a, stream);
  end.record(stream);
  end.synchronize();
  EXPECT_GE(Event::elapsed_ms(start, end), 0.0f);
}

// The launcher's count (no cuInit: the driver's /proc listing) agrees with CUDA's on a GPU machine.
// CUDA read CUDA_VISIBLE_DEVICES once, at its initialisation (before this test), so only the process's
// own setting can be checked against it: unset, the /proc listing must equal CUDA's count; set, the
// count must be CUDA's (device_count() by construction: that part only shows the /proc path was not
// taken, and tells that apart only where the variable hides some of the listed GPUs).
TEST(RuntimeGpu, DeviceCountWithoutCudaInitAgreesWithCuda) {
  EPMOE_REQUIRE_GPU();
  const int listed = listed_gpu_count();
  if (listed == 0) {
    GTEST_SKIP() << "the driver lists no GPU in /proc/driver/nvidia/gpus (not mounted here): "
                    "device_count_without_cuda_init() falls back to device_count(), nothing to compare";
  }
  const char* saved = std::getenv("CUDA_VISIBLE_DEVICES");
  if (saved == nullptr) {
    EXPECT_EQ(listed, device_count()) << "the driver's listing differs from the GPUs CUDA sees";
    EXPECT_EQ(device_count_without_cuda_init(), listed);
    return;
  }
  const std::string keep = saved;
  EXPECT_EQ(device_count_without_cuda_init(), device_count())
      << "with CUDA_VISIBLE_DEVICES=" << keep << ": CUDA's own count";
  // Without the variable the launcher reads the listing, whatever CUDA saw.
  unsetenv("CUDA_VISIBLE_DEVICES");
  const int unrestricted = device_count_without_cuda_init();
  setenv("CUDA_VISIBLE_DEVICES", keep.c_str(), 1);
  EXPECT_EQ(unrestricted, listed);
}

}  // namespace
}  // namespace epmoe::cuda
