// A small non-owning tensor view (dtype, shape, strides, host or device pointer) and an owning
// host tensor. Strides are in elements; a view of rank r uses shape[0..r) and stride[0..r).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "epmoe/error.hpp"
#include "epmoe/numerics.hpp"

namespace epmoe {

enum class DType : std::uint8_t {
  f32,
  f64,
  bf16,
  fp8_e4m3,
  i4x2,  // one byte holding two signed int4 values; shapes count bytes (e.g. [N, K/2])
  i32,
  i64,
  u8,
};

std::size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);

template <class T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::f32;
}
template <>
constexpr DType dtype_of<double>() {
  return DType::f64;
}
template <>
constexpr DType dtype_of<bf16>() {
  return DType::bf16;
}
template <>
constexpr DType dtype_of<fp8_e4m3>() {
  return DType::fp8_e4m3;
}
template <>
constexpr DType dtype_of<std::int32_t>() {
  return DType::i32;
}
template <>
constexpr DType dtype_of<std::int64_t>() {
  return DType::i64;
}
template <>
constexpr DType dtype_of<std::uint8_t>() {
  return DType::u8;
}

enum class Device : std::uint8_t { cpu, cuda };
std::string_view device_name(Device device);

inline constexpr int kMaxRank = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int rank = 0;
  std::array<std::int64_t, kMaxRank> shape{};
  std::array<std::int64_t, kMaxRank> stride{};

  // A contiguous (row-major) view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               Device device = Device::cpu);
  static TensorView contiguous(void* data, DType dtype, std::span<const std::int64_t> shape,
                               Device device = Device::cpu);

  // No data: a default-constructed view (an absent optional argument) or zero elements.
  bool empty_view() const { return data == nullptr && (rank == 0 || numel() == 0); }
  std::int64_t numel() const;
  std::int64_t size(int dim) const;
  // shape[0 .. rank): e.g. a new tensor of this one's shape.
  std::span<const std::int64_t> dims() const { return {shape.data(), static_cast<std::size_t>(rank)}; }
  bool is_contiguous() const;
  std::size_t nbytes() const;    // numel() x the dtype's size (throws where that overflows)
  std::string describe() const;  // e.g. "bf16[128, 7168] cpu"

  template <class T>
  T* as() const {
    EPMOE_CHECK(dtype_of<T>() == dtype, "tensor of dtype {} accessed as {}", dtype_name(dtype),
                dtype_name(dtype_of<T>()));
    return static_cast<T*>(data);
  }
  // The sub-tensor at index i of the first dimension (rank - 1 dims).
  TensorView select(std::int64_t i) const;
  // Rows [begin, end) of the first dimension.
  TensorView slice_rows(std::int64_t begin, std::int64_t end) const;
  // The first elements of this contiguous view, seen with another row-major shape (at most numel()
  // elements; any shape of a view without data): a workspace sized for the largest case viewed as
  // this call's tensor.
  TensorView reshaped(std::initializer_list<std::int64_t> shape) const;
};

// Argument validation shared by every entry point: each names the argument and the rule.
void expect_dtype(const TensorView& t, DType dtype, std::string_view name);
void expect_shape(const TensorView& t, std::initializer_list<std::int64_t> shape, std::string_view name);
void expect_rank(const TensorView& t, int rank, std::string_view name);
void expect_device(const TensorView& t, Device device, std::string_view name);
void expect_contiguous(const TensorView& t, std::string_view name);
// The data pointer is a multiple of `alignment` bytes (the kernels' vector loads and TMA need 16).
void expect_aligned(const TensorView& t, std::uintptr_t alignment, std::string_view name);
// dtype, device, contiguity and the data pointer's alignment, each named in the error; and the same on
// the GPU (Device::cuda), as every launcher checks its tensors.
void expect_aligned_tensor(const TensorView& t, DType dtype, Device device, std::string_view name,
                           std::uintptr_t alignment);
void expect_device_tensor(const TensorView& t, DType dtype, std::string_view name, std::uintptr_t alignment);
// `t` has the shape of `ref` (an output sized by an input).
void expect_same_shape(const TensorView& t, const TensorView& ref, std::string_view name,
                       std::string_view ref_name);
// A contiguous host (CPU) tensor; and one of this dtype and shape too.
void expect_host(const TensorView& t, std::string_view name);
void expect_host_tensor(const TensorView& t, DType dtype, std::initializer_list<std::int64_t> shape,
                        std::string_view name);
// Throws when the bytes of output `out` overlap those of `other` (an argument the call reads while it
// writes `out`): such aliasing gives silently wrong results. Views without data never overlap.
void expect_disjoint(const TensorView& out, std::string_view out_name, const TensorView& other,
                     std::string_view other_name);
// Throws when any element of a f32/f64/bf16/fp8 host tensor is NaN or Inf.
void expect_finite(const TensorView& t, std::string_view name);
// A quantization scale: positive and finite, and small enough that max_code x scale (the largest magnitude
// it dequantizes to: 448 for e4m3, 8 for int4's -8) is finite too. No quantizer gives a negative scale (it
// would flip the values' signs, and the GPU's power-of-two UE8M0 scales have no sign bit); zero loses them.
void expect_scale(float scale, std::string_view name, float max_code = 1.0f);
// Every element of an f32 host tensor is such a scale.
void expect_scales(const TensorView& t, std::string_view name, float max_code = 1.0f);

// What an owning tensor (HostTensor, cuda::DeviceTensor) shows of itself: its contiguous view and
// the view's properties. The owner sets view_ where it allocates.
class OwningTensor {
 public:
  TensorView view() const { return view_; }
  operator TensorView() const { return view_; }  // NOLINT: views are the currency of the API
  template <class T>
  T* data() const {
    return view_.as<T>();
  }
  std::int64_t numel() const { return view_.numel(); }
  std::int64_t size(int dim) const { return view_.size(dim); }
  DType dtype() const { return view_.dtype; }
  std::size_t nbytes() const { return view_.nbytes(); }

 protected:
  OwningTensor() = default;
  TensorView view_;
};

// An owning, 64-byte aligned, contiguous host tensor.
class HostTensor : public OwningTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::initializer_list<std::int64_t> shape);
  HostTensor(DType dtype, std::span<const std::int64_t> shape);

  bool defined() const { return storage_ != nullptr; }
  void fill_bytes(std::uint8_t byte);  // e.g. poison before a run

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  std::unique_ptr<std::byte, Free> storage_;
};

}  // namespace epmoe
