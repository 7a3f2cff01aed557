#include "epmoe/tensor.hpp"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

namespace epmoe {

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return 4;
    case DType::f64:
      return 8;
    case DType::bf16:
      return 2;
    case DType::fp8_e4m3:
      return 1;
    case DType::i4x2:
      return 1;
    case DType::i32:
      return 4;
    case DType::i64:
      return 8;
    case DType::u8:
      return 1;
  }
  EPMOE_FAIL("unknown dtype {}", static_cast<int>(dtype));
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return "f32";
    case DType::f64:
      return "f64";
    case DType::bf16:
      return "bf16";
    case DType::fp8_e4m3:
      return "fp8_e4m3";
    case DType::i4x2:
      return "i4x2";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::u8:
      return "u8";
  }
  return "?";
}

std::string_view device_name(Device device) {
  return device == Device::cpu ? "cpu" : "cuda";
}

TensorView TensorView::contiguous(void* data, DType dtype, std::span<const std::int64_t> shape,
                                  Device device) {
  EPMOE_CHECK(shape.size() <= static_cast<std::size_t>(kMaxRank), "tensor rank {} exceeds {}", shape.size(),
              kMaxRank);
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.rank = static_cast<int>(shape.size());
  // Every stride and the size in bytes fit in int64 (a wrapped product would size a buffer too small).
  std::int64_t stride = 1;
  bool overflow = false;
  for (int d = v.rank - 1; d >= 0; --d) {
    EPMOE_CHECK(shape[d] >= 0, "tensor dimension {} is negative ({})", d, shape[d]);
    v.shape[d] = shape[d];
    v.stride[d] = stride;
    overflow = overflow || __builtin_mul_overflow(stride, shape[d], &stride);
  }
  std::int64_t bytes = 0;
  overflow = overflow || __builtin_mul_overflow(stride, static_cast<std::int64_t>(dtype_size(dtype)), &bytes);
  EPMOE_CHECK(!overflow, "tensor shape {} is too large: its size in bytes does not fit in 64 bits",
              v.describe());
  return v;
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                                  Device device) {
  return contiguous(data, dtype, std::span<const std::int64_t>(shape.begin(), shape.size()), device);
}

std::int64_t TensorView::numel() const {
  EPMOE_CHECK(rank >= 0 && rank <= kMaxRank, "tensor rank {} is outside [0, {}]", rank, kMaxRank);
  std::int64_t n = 1;
  for (int d = 0; d < rank; ++d) {
    EPMOE_CHECK(shape[d] >= 0, "tensor dimension {} is negative ({})", d, shape[d]);
    EPMOE_CHECK(!__builtin_mul_overflow(n, shape[d], &n),
                "tensor shape {} has more elements than int64 holds", describe());
  }
  return n;
}

std::size_t TensorView::nbytes() const {
  std::int64_t bytes = 0;
  EPMOE_CHECK(!__builtin_mul_overflow(numel(), static_cast<std::int64_t>(dtype_size(dtype)), &bytes),
              "tensor shape {} has more bytes than int64 holds", describe());
  return static_cast<std::size_t>(bytes);
}

std::int64_t TensorView::size(int dim) const {
  EPMOE_CHECK(dim >= 0 && dim < rank, "dimension {} out of range for a rank-{} tensor", dim, rank);
  return shape[dim];
}

bool TensorView::is_contiguous() const {
  std::int64_t expected = 1;
  for (int d = rank - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorView::describe() const {
  std::string s = fmt::format("{}[", dtype_name(dtype));
  if (rank < 0 || rank > kMaxRank) return s + fmt::format("<rank {}>] {}", rank, device_name(device));
  for (int d = 0; d < rank; ++d) s += fmt::format("{}{}", d ? ", " : "", shape[d]);
  return s + fmt::format("] {}", device_name(device));
}

TensorView TensorView::select(std::int64_t i) const {
  EPMOE_CHECK(rank >= 1, "select() on a rank-0 tensor");
  EPMOE_CHECK(i >= 0 && i < shape[0], "index {} out of range [0, {})", i, shape[0]);
  TensorView v = *this;
  v.data = static_cast<std::byte*>(data) + i * stride[0] * static_cast<std::int64_t>(dtype_size(dtype));
  for (int d = 1; d < rank; ++d) {
    v.shape[d - 1] = shape[d];
    v.stride[d - 1] = stride[d];
  }
  v.rank = rank - 1;
  return v;
}

TensorView TensorView::slice_rows(std::int64_t begin, std::int64_t end) const {
  EPMOE_CHECK(rank >= 1, "slice_rows() on a rank-0 tensor");
  EPMOE_CHECK(0 <= begin && begin <= end && end <= shape[0], "rows [{}, {}) out of range [0, {})", begin, end,
              shape[0]);
  TensorView v = *this;
  v.data = static_cast<std::byte*>(data) + begin * stride[0] * static_cast<std::int64_t>(dtype_size(dtype));
  v.shape[0] = end - begin;
  return v;
}

TensorView TensorView::reshaped(std::initializer_list<std::int64_t> new_shape) const {
  EPMOE_CHECK(is_contiguous(), "reshaped() needs a contiguous view, got {}", describe());
  TensorView v = contiguous(data, dtype, new_shape, device);
  EPMOE_CHECK(v.numel() <= numel() || data == nullptr, "reshaped(): {} elements do not fit in {}", v.numel(),
              describe());
  return v;
}

void expect_dtype(const TensorView& t, DType dtype, std::string_view name) {
  EPMOE_CHECK(t.dtype == dtype, "{} must have dtype {}, got {}", name, dtype_name(dtype), t.describe());
}

void expect_rank(const TensorView& t, int rank, std::string_view name) {
  EPMOE_CHECK(t.rank == rank, "{} must have rank {}, got {}", name, rank, t.describe());
}

void expect_shape(const TensorView& t, std::initializer_list<std::int64_t> shape, std::string_view name) {
  bool ok = t.rank == static_cast<int>(shape.size());
  int d = 0;
  for (std::int64_t s : shape) {
    if (ok && t.shape[d] != s) ok = false;
    ++d;
  }
  if (!ok) {
    std::string want = "[";
    d = 0;
    for (std::int64_t s : shape) want += fmt::format("{}{}", d++ ? ", " : "", s);
    EPMOE_FAIL("{} must have shape {}], got {}", name, want, t.describe());
  }
}

void expect_device(const TensorView& t, Device device, std::string_view name) {
  EPMOE_CHECK(t.device == device, "{} must live on {}, got {}", name, device_name(device), t.describe());
}

void expect_contiguous(const TensorView& t, std::string_view name) {
  EPMOE_CHECK(t.is_contiguous(), "{} must be contiguous (row-major), got {}", name, t.describe());
  EPMOE_CHECK(t.data != nullptr || t.numel() == 0, "{} has no data pointer", name);
}

void expect_aligned(const TensorView& t, std::uintptr_t alignment, std::string_view name) {
  const auto address = reinterpret_cast<std::uintptr_t>(t.data);
  EPMOE_CHECK(address % alignment == 0, "{} must be {}-byte aligned, got {} at {:#x}", name, alignment,
              t.describe(), address);
}

void expect_aligned_tensor(const TensorView& t, DType dtype, Device device, std::string_view name,
                           std::uintptr_t alignment) {
  expect_dtype(t, dtype, name);
  expect_device(t, device, name);
  expect_contiguous(t, name);
  expect_aligned(t, alignment, name);
}

void expect_device_tensor(const TensorView& t, DType dtype, std::string_view name, std::uintptr_t alignment) {
  expect_aligned_tensor(t, dtype, Device::cuda, name, alignment);
}

void expect_same_shape(const TensorView& t, const TensorView& ref, std::string_view name,
                       std::string_view ref_name) {
  bool same = t.rank == ref.rank;
  for (int d = 0; same && d < t.rank; ++d) same = t.shape[d] == ref.shape[d];
  EPMOE_CHECK(same, "{} must have the shape of {} ({}), got {}", name, ref_name, ref.describe(),
              t.describe());
}

void expect_host(const TensorView& t, std::string_view name) {
  expect_device(t, Device::cpu, name);
  expect_contiguous(t, name);
}

void expect_host_tensor(const TensorView& t, DType dtype, std::initializer_list<std::int64_t> shape,
                        std::string_view name) {
  expect_dtype(t, dtype, name);
  expect_shape(t, shape, name);
  expect_host(t, name);
}

void expect_disjoint(const TensorView& out, std::string_view out_name, const TensorView& other,
                     std::string_view other_name) {
  if (out.data == nullptr || other.data == nullptr || out.device != other.device) return;
  if (out.numel() == 0 || other.numel() == 0) return;  // no bytes, no overlap
  // The byte span each view can touch: [data, data + (Σ (shape - 1) * stride + 1) * element size).
  auto span_end = [](const TensorView& t) {
    std::int64_t last = 0;
    for (int d = 0; d < t.rank; ++d) {
      if (t.shape[d] == 0) return static_cast<const std::byte*>(t.data);
      last += (t.shape[d] - 1) * t.stride[d];
    }
    return static_cast<const std::byte*>(t.data) +
           (last + 1) * static_cast<std::int64_t>(dtype_size(t.dtype));
  };
  const auto* a = static_cast<const std::byte*>(out.data);
  const auto* b = static_cast<const std::byte*>(other.data);
  const bool overlap = a < span_end(other) && b < span_end(out);
  EPMOE_CHECK(!overlap, "{} ({}) must not overlap {} ({}) in memory", out_name, out.describe(), other_name,
              other.describe());
}

void expect_finite(const TensorView& t, std::string_view name) {
  expect_device(t, Device::cpu, name);
  expect_contiguous(t, name);
  const std::int64_t n = t.numel();
  auto fail = [&](std::int64_t i, double v) {
    EPMOE_FAIL("{} must be finite, element {} is {}", name, i, v);
  };
  switch (t.dtype) {
    case DType::f32:
      for (std::int64_t i = 0; i < n; ++i)
        if (!std::isfinite(t.as<float>()[i])) fail(i, t.as<float>()[i]);
      break;
    case DType::f64:
      for (std::int64_t i = 0; i < n; ++i)
        if (!std::isfinite(t.as<double>()[i])) fail(i, t.as<double>()[i]);
      break;
    case DType::bf16:
      for (std::int64_t i = 0; i < n; ++i) {
        const float v = t.as<bf16>()[i].to_float();
        if (!std::isfinite(v)) fail(i, v);
      }
      break;
    case DType::fp8_e4m3:
      for (std::int64_t i = 0; i < n; ++i) {
        const float v = t.as<fp8_e4m3>()[i].to_float();
        if (!std::isfinite(v)) fail(i, v);
      }
      break;
    default:
      break;  // integer types are always finite
  }
}

namespace {
bool valid_scale(float scale, float max_code) {
  return scale > 0.0f && std::isfinite(scale * max_code);
}
std::string scale_rule(float max_code) {
  return max_code == 1.0f ? std::string("positive and finite")
                          : fmt::format("positive and finite, with {} x it finite", max_code);
}
}  // namespace

void expect_scale(float scale, std::string_view name, float max_code) {
  EPMOE_CHECK(valid_scale(scale, max_code), "{} must be {}, got {}", name, scale_rule(max_code), scale);
}

void expect_scales(const TensorView& t, std::string_view name, float max_code) {
  expect_dtype(t, DType::f32, name);
  expect_host(t, name);
  const float* s = t.as<float>();
  const std::int64_t n = t.numel();
  for (std::int64_t i = 0; i < n; ++i) {
    EPMOE_CHECK(valid_scale(s[i], max_code), "{} must be {}: element {} is {}", name, scale_rule(max_code), i,
                s[i]);
  }
}

void HostTensor::Free::operator()(std::byte* p) const {
  ::operator delete[](p, std::align_val_t{64});
}

HostTensor::HostTensor(DType dtype, std::initializer_list<std::int64_t> shape)
    : HostTensor(dtype, std::span<const std::int64_t>(shape.begin(), shape.size())) {}

HostTensor::HostTensor(DType dtype, std::span<const std::int64_t> shape) {
  view_ = TensorView::contiguous(nullptr, dtype, shape);
  const std::size_t bytes = std::max<std::size_t>(view_.nbytes(), 1);
  // nothrow and a message of our own: a shape from a command line past the host's memory is an error
  // naming the size (and AddressSanitizer aborts where a throwing new would throw bad_alloc).
  storage_.reset(static_cast<std::byte*>(::operator new[](bytes, std::align_val_t{64}, std::nothrow)));
  EPMOE_CHECK(storage_ != nullptr, "HostTensor: out of host memory for {} bytes ({})", bytes,
              view_.describe());
  std::memset(storage_.get(), 0, bytes);
  view_.data = storage_.get();
}

void HostTensor::fill_bytes(std::uint8_t byte) {
  if (storage_) std::memset(storage_.get(), byte, view_.nbytes());
}

}  // namespace epmoe
