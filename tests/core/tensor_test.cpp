#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>

#include "epmoe/tensor.hpp"
#include "expect_error.hpp"

namespace epmoe {
namespace {

TEST(Tensor, ContiguousStridesAndSlices) {
  HostTensor t(DType::f32, {3, 4});
  EXPECT_EQ(t.view().stride[0], 4);
  EXPECT_EQ(t.view().stride[1], 1);
  EXPECT_EQ(t.numel(), 12);
  EXPECT_TRUE(t.view().is_contiguous());
  for (int i = 0; i < 12; ++i) t.data<float>()[i] = static_cast<float>(i);
  TensorView row = t.view().select(2);
  EXPECT_EQ(row.rank, 1);
  EXPECT_EQ(row.as<float>()[1], 9.0f);
  TensorView rows = t.view().slice_rows(1, 3);
  EXPECT_EQ(rows.size(0), 2);
  EXPECT_EQ(rows.as<float>()[0], 4.0f);
  EXPECT_THROW(t.view().select(3), Error);
  EXPECT_THROW(t.view().slice_rows(2, 4), Error);
  EXPECT_THROW((void)t.view().as<double>(), Error);
}

TEST(Tensor, EmptyViewMeansAbsent) {
  EXPECT_TRUE(TensorView{}.empty_view());  // an optional argument left out
  EXPECT_TRUE(TensorView::contiguous(nullptr, DType::f32, {0, 4}).empty_view());
  HostTensor t(DType::f32, {2});
  EXPECT_FALSE(t.view().empty_view());
}

TEST(Tensor, ValidationNamesArgument) {
  HostTensor t(DType::bf16, {2, 128});
  try {
    expect_shape(t, {2, 256}, "x");
    FAIL() << "expected a throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("x must have shape [2, 256]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(expect_dtype(t, DType::f32, "x"), Error);
  EXPECT_NO_THROW(expect_dtype(t, DType::bf16, "x"));
}

// The launchers' tensor checks: alignment of the data pointer (named with the address), dtype, device and
// contiguity in one call, and an output shaped like its input.
TEST(Tensor, AlignedTensorsAndSameShapes) {
  HostTensor t(DType::bf16, {4, 64});  // host tensors are 64-byte aligned
  EXPECT_NO_THROW(expect_aligned(t, 16, "x"));
  EXPECT_NO_THROW(expect_aligned_tensor(t, DType::bf16, Device::cpu, "x", 16));
  const TensorView off = TensorView::contiguous(t.data<bf16>() + 1, DType::bf16, {4, 8}, Device::cpu);
  testing::expect_error_mentions([&] { expect_aligned(off, 16, "x"); }, {"x must be 16-byte aligned", "0x"});
  EXPECT_NO_THROW(expect_aligned(off, 2, "x"));
  testing::expect_error_mentions([&] { expect_aligned_tensor(t, DType::f32, Device::cpu, "x", 16); },
                                 {"x must have dtype f32"});
  testing::expect_error_mentions([&] { expect_device_tensor(t, DType::bf16, "x", 16); }, {"x must live on"});
  EXPECT_NO_THROW(
      expect_aligned_tensor(t.view().select(1), DType::bf16, Device::cpu, "x", 16));  // row 1: 128 B in
  HostTensor strided(DType::bf16, {4, 64});
  TensorView column = strided.view();
  column.shape[1] = 32;  // rows of 32 with a stride of 64: not contiguous
  testing::expect_error_mentions([&] { expect_aligned_tensor(column, DType::bf16, Device::cpu, "x", 16); },
                                 {"x must be contiguous"});

  HostTensor same(DType::f32, {4, 64}), other(DType::f32, {64, 4});
  EXPECT_NO_THROW(expect_same_shape(same, t, "q", "x"));  // shapes only, not dtypes
  testing::expect_error_mentions([&] { expect_same_shape(other, t, "q", "x"); },
                                 {"q must have the shape of x"});
}

TEST(Tensor, FiniteCheckFindsNaNAndInf) {
  HostTensor t(DType::f32, {4});
  for (int i = 0; i < 4; ++i) t.data<float>()[i] = 1.0f + static_cast<float>(i);
  EXPECT_NO_THROW(expect_finite(t, "t"));
  t.data<float>()[2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(expect_finite(t, "t"), Error);
  t.data<float>()[2] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(expect_finite(t, "t"), Error);
  HostTensor b(DType::bf16, {2});
  b.data<bf16>()[0] = bf16::from_float(1.0f);
  b.data<bf16>()[1] = bf16::from_bits(0x7fc0);
  EXPECT_THROW(expect_finite(b, "b"), Error);
}

// Shapes whose size wraps around int64 would size a buffer too small: refused at construction.
// Quantization scales: positive and finite, and (given the largest code) dequantizable without overflow.
TEST(Tensor, ScalesArePositiveFiniteAndDequantizable) {
  using testing::expect_error_mentions;
  EXPECT_NO_THROW(expect_scale(0.5f, "s"));
  for (float bad :
       {0.0f, -0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()})
    expect_error_mentions([&] { expect_scale(bad, "s"); }, "s must be positive and finite, got");
  EXPECT_NO_THROW(expect_scale(1e37f, "s"));
  expect_error_mentions([&] { expect_scale(1e37f, "s", 448.0f); },
                        "s must be positive and finite, with 448 x it finite");
  HostTensor t(DType::f32, {3});
  for (int i = 0; i < 3; ++i) t.data<float>()[i] = 0.25f;
  EXPECT_NO_THROW(expect_scales(t, "t", 448.0f));
  t.data<float>()[2] = -0.0f;
  expect_error_mentions([&] { expect_scales(t, "t"); }, "t must be positive and finite: element 2 is -0");
  HostTensor half(DType::bf16, {3});
  expect_error_mentions([&] { expect_scales(half, "h"); }, "h must have dtype f32");
  TensorView on_gpu = t;
  on_gpu.device = Device::cuda;
  expect_error_mentions([&] { expect_scales(on_gpu, "g"); }, "g must live on cpu");
}

TEST(Tensor, ShapesPastInt64AreRefused) {
  EXPECT_THROW(HostTensor(DType::f32, {std::int64_t{1} << 62, 4}), Error);
  EXPECT_THROW(HostTensor(DType::f32, {std::int64_t{1} << 62}), Error);  // 2^64 bytes
  EXPECT_THROW(TensorView::contiguous(nullptr, DType::f32, {0, std::int64_t{1} << 40, std::int64_t{1} << 40}),
               Error);
  TensorView hand;  // a hand-built view: numel() checks its product
  hand.rank = 2;
  hand.shape = {std::int64_t{1} << 40, std::int64_t{1} << 40, 0, 0};
  EXPECT_THROW((void)hand.numel(), Error);
  hand.rank = 5;
  EXPECT_THROW((void)hand.numel(), Error);
  EXPECT_NE(hand.describe().find("rank 5"), std::string::npos);
}

TEST(Tensor, OverlappingOutputsAreRefused) {
  HostTensor a(DType::f32, {4, 8}), b(DType::f32, {4, 8});
  EXPECT_NO_THROW(expect_disjoint(a, "out", b, "in"));
  EXPECT_THROW(expect_disjoint(a, "out", a, "in"), Error);
  EXPECT_THROW(expect_disjoint(a.view().slice_rows(1, 3), "out", a.view().slice_rows(2, 4), "in"), Error);
  EXPECT_NO_THROW(expect_disjoint(a.view().slice_rows(0, 2), "out", a.view().slice_rows(2, 4), "in"));
  EXPECT_NO_THROW(expect_disjoint(TensorView{}, "out", a, "in"));  // an absent argument
}

}  // namespace
}  // namespace epmoe
