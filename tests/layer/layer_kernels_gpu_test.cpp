// The GPU layer's small kernels (src/layer/layer_kernels.hpp) that no layer test isolates: the
// kernel copy that forward_graph uses for its static input and output, aligned and not.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <vector>

#include "epmoe/cuda/device_buffer.hpp"
#include "gpu_test_util.hpp"
#include "layer/layer_kernels.hpp"

namespace epmoe::layer_detail {
namespace {

// Copies n bf16 from element `src_offset` of one buffer to element `dst_offset` of a poisoned
// other, and checks that exactly those elements changed.
void check_copy(std::int64_t n, std::int64_t src_offset, std::int64_t dst_offset) {
  const std::int64_t len = n + 16;
  std::vector<std::uint16_t> src(static_cast<std::size_t>(len));
  std::iota(src.begin(), src.end(), std::uint16_t{1});
  const cuda::DeviceTensor d_src(DType::bf16, {len}), d_dst(DType::bf16, {len});
  EPMOE_CUDA_CHECK(cudaMemcpy(d_src.view().data, src.data(), src.size() * 2, cudaMemcpyHostToDevice));
  d_dst.fill_bytes(0xff, nullptr);
  TensorView from = d_src.view(), to = d_dst.view();
  from.data = static_cast<std::uint16_t*>(from.data) + src_offset;
  to.data = static_cast<std::uint16_t*>(to.data) + dst_offset;
  from.shape[0] = to.shape[0] = n;
  copy_bf16(from, to, nullptr);
  std::vector<std::uint16_t> got(static_cast<std::size_t>(len));
  EPMOE_CUDA_CHECK(cudaMemcpy(got.data(), d_dst.view().data, got.size() * 2, cudaMemcpyDeviceToHost));
  for (std::int64_t i = 0; i < len; ++i) {
    const bool copied = i >= dst_offset && i < dst_offset + n;
    const std::uint16_t want = copied ? src[static_cast<std::size_t>(i - dst_offset + src_offset)] : 0xffff;
    ASSERT_EQ(got[static_cast<std::size_t>(i)], want)
        << "element " << i << " (n " << n << ", offsets " << src_offset << " -> " << dst_offset << ")";
  }
}

TEST(LayerKernelsGpu, CopyBf16AlignedAndNot) {
  EPMOE_REQUIRE_GPU();
  check_copy(7168 * 3, 0, 0);  // 16-byte vectors
  check_copy(7168, 1, 0);      // unaligned source: element by element
  check_copy(1000, 8, 3);      // unaligned destination
  check_copy(5, 0, 0);         // not a multiple of 8
  check_copy(0, 0, 0);
}

TEST(LayerKernelsGpu, CopyBf16RefusesMismatches) {
  EPMOE_REQUIRE_GPU();
  const cuda::DeviceTensor a(DType::bf16, {64}), b(DType::bf16, {65}), f(DType::f32, {64});
  testing::expect_error_mentions([&] { copy_bf16(a, b, nullptr); }, "equal sizes");
  testing::expect_error_mentions([&] { copy_bf16(a, f, nullptr); }, "dst");
}

}  // namespace
}  // namespace epmoe::layer_detail
