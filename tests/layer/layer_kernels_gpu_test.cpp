// The GPU layer's small kernels (src/layer/layer_kernels.hpp) that no layer test isolates: the
// kernel copy that forward_graph uses for its static input and output, aligned and not; the
// shared-expert add against the CPU's bf16 rounding; the i32 fill a captured graph replays.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/numerics.hpp"
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

TEST(LayerKernelsGpu, AddBf16RoundsAsTheCpu) {
  EPMOE_REQUIRE_GPU();
  constexpr std::int64_t n = 7168 * 5 + 8;
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<bf16> a(n), b(n);
  for (std::int64_t i = 0; i < n; ++i) {
    a[static_cast<std::size_t>(i)] = bf16::from_float(normal(rng));
    b[static_cast<std::size_t>(i)] = bf16::from_float(normal(rng) * (i % 7 == 0 ? 1e3f : 1.0f));
  }
  // Overflow to Inf, Inf + -Inf, and NaN in; both stay non-finite.
  a[0] = bf16::from_float(3.0e38f), b[0] = bf16::from_float(3.0e38f);
  a[1] = bf16::from_float(INFINITY), b[1] = bf16::from_float(-INFINITY);
  a[2] = bf16::from_float(NAN);
  const cuda::DeviceTensor d_a(DType::bf16, {n}), d_b(DType::bf16, {n}), d_y(DType::bf16, {n});
  EPMOE_CUDA_CHECK(cudaMemcpy(d_a.view().data, a.data(), n * 2, cudaMemcpyHostToDevice));
  EPMOE_CUDA_CHECK(cudaMemcpy(d_b.view().data, b.data(), n * 2, cudaMemcpyHostToDevice));
  d_y.fill_bytes(0xff, nullptr);
  auto expect_sum = [&](const TensorView& y, const char* what) {
    std::vector<bf16> got(n);
    EPMOE_CUDA_CHECK(cudaMemcpy(got.data(), y.data, n * 2, cudaMemcpyDeviceToHost));
    for (std::int64_t i = 0; i < n; ++i) {
      const auto k = static_cast<std::size_t>(i);
      const bf16 want = bf16::from_float(a[k].to_float() + b[k].to_float());
      if (std::isnan(want.to_float())) {
        ASSERT_TRUE(std::isnan(got[k].to_float())) << what << " element " << i;
      } else {
        ASSERT_EQ(got[k].bits, want.bits)
            << what << " element " << i << ": " << a[k].to_float() << " + " << b[k].to_float();
      }
    }
  };
  add_bf16(d_a, d_b, d_y, nullptr);
  expect_sum(d_y.view(), "y");
  add_bf16(d_b, d_a, d_y, nullptr);  // (the operands swapped: the same sums)
  expect_sum(d_y.view(), "b + a");
  const cuda::DeviceTensor odd(DType::bf16, {12}), other(DType::bf16, {16});
  testing::expect_error_mentions([&] { add_bf16(odd, odd, odd, nullptr); }, "multiple of 8");
  testing::expect_error_mentions([&] { add_bf16(d_a, other, d_y, nullptr); }, "equal sizes");
}

TEST(LayerKernelsGpu, FillI32WritesItsOneWordOnly) {
  EPMOE_REQUIRE_GPU();
  const cuda::DeviceTensor d(DType::i32, {4});
  d.fill_bytes(0xff, nullptr);
  TensorView first = d.view();
  first.shape[0] = 1;
  fill_i32(first, 123456789, nullptr);
  std::vector<std::int32_t> got(4);
  EPMOE_CUDA_CHECK(cudaMemcpy(got.data(), d.view().data, 16, cudaMemcpyDeviceToHost));
  EXPECT_EQ(got, (std::vector<std::int32_t>{123456789, -1, -1, -1}));
  TensorView none = d.view();
  none.shape[0] = 0;
  testing::expect_error_mentions([&] { fill_i32(none, 1, nullptr); }, "at least one element");
  const cuda::DeviceTensor f(DType::f32, {1});
  testing::expect_error_mentions([&] { fill_i32(f, 1, nullptr); }, "dst");
}

}  // namespace
}  // namespace epmoe::layer_detail
