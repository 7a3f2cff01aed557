// CPU quantizers and dequantizers: the exact definitions of design.md §4 (see quant.hpp).
#include "epmoe/quant.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string_view>
#include <vector>

namespace epmoe {
namespace {

// ---------------------------------------------------------------- argument checks

void expect_real_input(const TensorView& t, std::string_view name) {
  EPMOE_CHECK(t.dtype == DType::f32 || t.dtype == DType::bf16, "{} must have dtype f32 or bf16, got {}", name,
              t.describe());
}

// `group` must be positive and divide K (the last dimension of `tensor_name`).
void expect_group(int group, std::int64_t k, std::string_view group_name, std::string_view tensor_name) {
  EPMOE_CHECK(group > 0, "{} must be positive, got {}", group_name, group);
  EPMOE_CHECK(k % group == 0, "{}: K = {} must be a multiple of {} = {}", tensor_name, k, group_name, group);
}

// The int4 form of an [n, k] matrix `matrix_name` in groups of `group` along K: packed [n, k / 2] codes
// (two a byte) and f32 scales [n, k / group], both on the host.
void expect_int4_grouped(std::int64_t n, std::int64_t k, int group, const TensorView& packed,
                         const TensorView& scales, std::string_view matrix_name) {
  EPMOE_CHECK(k % 2 == 0, "{}: K = {} must be even (two int4 values per byte)", matrix_name, k);
  expect_group(group, k, "group", matrix_name);
  expect_host_tensor(packed, DType::i4x2, {n, k / 2}, "packed");
  expect_host_tensor(scales, DType::f32, {n, k / group}, "scales");
}

// ---------------------------------------------------------------- element access

// Reads an f32 or bf16 host tensor as float.
class RealReader {
 public:
  explicit RealReader(const TensorView& t)
      : f32_(t.dtype == DType::f32 ? t.as<float>() : nullptr),
        bf16_(t.dtype == DType::bf16 ? t.as<bf16>() : nullptr) {}
  float operator[](std::int64_t i) const { return f32_ ? f32_[i] : bf16_[i].to_float(); }

 private:
  const float* f32_;
  const bf16* bf16_;
};

// A rectangle [r0, r1) x [c0, c1) of a row-major matrix with leading dimension ld.
struct Rect {
  std::int64_t ld, r0, r1, c0, c1;
};

float rect_amax(const RealReader& x, const Rect& r) {
  float amax = 0.0f;
  for (std::int64_t i = r.r0; i < r.r1; ++i) {
    for (std::int64_t j = r.c0; j < r.c1; ++j) amax = std::max(amax, std::fabs(x[i * r.ld + j]));
  }
  return amax;
}

void rect_quantize_fp8(const RealReader& x, fp8_e4m3* q, const Rect& r, float scale) {
  for (std::int64_t i = r.r0; i < r.r1; ++i) {
    for (std::int64_t j = r.c0; j < r.c1; ++j) {
      const std::int64_t k = i * r.ld + j;
      q[k] = fp8_e4m3::from_float(x[k] / scale);
    }
  }
}

void rect_dequantize_fp8(const fp8_e4m3* q, float* out, const Rect& r, float scale) {
  for (std::int64_t i = r.r0; i < r.r1; ++i) {
    for (std::int64_t j = r.c0; j < r.c1; ++j) {
      const std::int64_t k = i * r.ld + j;
      out[k] = q[k].to_float() * scale;
    }
  }
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

// fn(block, index) for each block of `rows` x `cols` of a row-major [n, k] matrix (the last row block
// may be shorter; cols divides k), index = row block * (k / cols) + column block: the scales' layout.
template <class Fn>
void for_each_block(std::int64_t n, std::int64_t k, std::int64_t rows, std::int64_t cols, Fn&& fn) {
  const std::int64_t col_blocks = k / cols;
  for (std::int64_t rb = 0; rb < ceil_div(n, rows); ++rb) {
    for (std::int64_t cb = 0; cb < col_blocks; ++cb)
      fn(Rect{k, rb * rows, std::min(n, (rb + 1) * rows), cb * cols, (cb + 1) * cols}, rb * col_blocks + cb);
  }
}

// x [n, k] quantized in blocks of `rows` x `cols`, one scale per block.
void quantize_blocks_fp8(const RealReader& x, fp8_e4m3* q, float* scales, std::int64_t n, std::int64_t k,
                         std::int64_t rows, std::int64_t cols, bool power_of_two) {
  for_each_block(n, k, rows, cols, [&](const Rect& r, std::int64_t i) {
    scales[i] = fp8_scale_for_amax(rect_amax(x, r), power_of_two);
    rect_quantize_fp8(x, q, r, scales[i]);
  });
}

// The inverse of quantize_blocks_fp8, into f32.
void dequantize_blocks_fp8(const fp8_e4m3* q, const float* scales, float* out, std::int64_t n, std::int64_t k,
                           std::int64_t rows, std::int64_t cols) {
  for_each_block(n, k, rows, cols,
                 [&](const Rect& r, std::int64_t i) { rect_dequantize_fp8(q, out, r, scales[i]); });
}

}  // namespace

// ---------------------------------------------------------------- bf16

void convert_to_bf16(TensorView x, TensorView out) {
  expect_dtype(x, DType::f32, "x");
  expect_host(x, "x");
  expect_dtype(out, DType::bf16, "out");
  expect_same_shape(out, x, "out", "x");
  expect_host(out, "out");
  expect_disjoint(out, "out", x, "x");
  expect_finite(x, "x");
  const float* in = x.as<float>();
  bf16* o = out.as<bf16>();
  for (std::int64_t i = 0; i < x.numel(); ++i) o[i] = bf16::from_float(in[i]);
}

HostTensor to_bf16(TensorView x) {
  HostTensor out(DType::bf16, x.dims());
  convert_to_bf16(x, out);
  return out;
}

// ---------------------------------------------------------------- scales

float fp8_scale_for_amax(float amax, bool power_of_two) {
  EPMOE_CHECK(std::isfinite(amax) && amax >= 0.0f, "amax must be finite and non-negative, got {}", amax);
  const float scale = std::max(amax, kMinAmax) / kFp8E4m3Max;
  if (!power_of_two) return scale;
  // 2^ceil(log2(scale)), exactly: scale = m * 2^e with m in [0.5, 1).
  int e = 0;
  const float m = std::frexp(scale, &e);
  return std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
}

// ---------------------------------------------------------------- per-token-group FP8

void quantize_per_token_group_fp8(TensorView x, TensorView q, TensorView scales, int group,
                                  bool power_of_two) {
  expect_rank(x, 2, "x");
  expect_real_input(x, "x");
  expect_host(x, "x");
  const std::int64_t t = x.shape[0], k = x.shape[1];
  expect_group(group, k, "group", "x");
  expect_host_tensor(q, DType::fp8_e4m3, {t, k}, "q");
  expect_host_tensor(scales, DType::f32, {t, k / group}, "scales");
  expect_finite(x, "x");
  quantize_blocks_fp8(RealReader(x), q.as<fp8_e4m3>(), scales.as<float>(), t, k, 1, group, power_of_two);
}

void dequantize_per_token_group_fp8(TensorView q, TensorView scales, TensorView out, int group) {
  expect_rank(q, 2, "q");
  expect_dtype(q, DType::fp8_e4m3, "q");
  expect_host(q, "q");
  const std::int64_t t = q.shape[0], k = q.shape[1];
  expect_group(group, k, "group", "q");
  expect_host_tensor(scales, DType::f32, {t, k / group}, "scales");
  expect_host_tensor(out, DType::f32, {t, k}, "out");
  expect_finite(q, "q");
  expect_scales(scales, "scales", kFp8E4m3Max);
  dequantize_blocks_fp8(q.as<fp8_e4m3>(), scales.as<float>(), out.as<float>(), t, k, 1, group);
}

// ---------------------------------------------------------------- 128 x 128 block FP8

void quantize_block_fp8(TensorView w, TensorView q, TensorView scale_inv, int block) {
  expect_rank(w, 2, "w");
  expect_real_input(w, "w");
  expect_host(w, "w");
  const std::int64_t n = w.shape[0], k = w.shape[1];
  expect_group(block, k, "block", "w");
  expect_host_tensor(q, DType::fp8_e4m3, {n, k}, "q");
  expect_host_tensor(scale_inv, DType::f32, {ceil_div(n, block), k / block}, "scale_inv");
  expect_finite(w, "w");
  quantize_blocks_fp8(RealReader(w), q.as<fp8_e4m3>(), scale_inv.as<float>(), n, k, block, block, false);
}

void dequantize_block_fp8(TensorView q, TensorView scale_inv, TensorView out, int block) {
  expect_rank(q, 2, "q");
  expect_dtype(q, DType::fp8_e4m3, "q");
  expect_host(q, "q");
  const std::int64_t n = q.shape[0], k = q.shape[1];
  expect_group(block, k, "block", "q");
  expect_host_tensor(scale_inv, DType::f32, {ceil_div(n, block), k / block}, "scale_inv");
  expect_host_tensor(out, DType::f32, {n, k}, "out");
  expect_finite(q, "q");
  expect_scales(scale_inv, "scale_inv", kFp8E4m3Max);
  dequantize_blocks_fp8(q.as<fp8_e4m3>(), scale_inv.as<float>(), out.as<float>(), n, k, block, block);
}

// ---------------------------------------------------------------- per-tensor FP8

void quantize_per_tensor_fp8(TensorView x, TensorView q, float scale) {
  expect_real_input(x, "x");
  expect_host(x, "x");
  expect_dtype(q, DType::fp8_e4m3, "q");
  expect_same_shape(q, x, "q", "x");
  expect_host(q, "q");
  expect_scale(scale, "scale");
  expect_finite(x, "x");
  rect_quantize_fp8(RealReader(x), q.as<fp8_e4m3>(), Rect{0, 0, 1, 0, x.numel()}, scale);
}

float per_tensor_fp8_scale(TensorView x) {
  expect_real_input(x, "x");
  expect_host(x, "x");
  expect_finite(x, "x");
  return fp8_scale_for_amax(rect_amax(RealReader(x), Rect{0, 0, 1, 0, x.numel()}), false);
}

void dequantize_per_tensor_fp8(TensorView q, float scale, TensorView out) {
  expect_dtype(q, DType::fp8_e4m3, "q");
  expect_host(q, "q");
  expect_dtype(out, DType::f32, "out");
  expect_same_shape(out, q, "out", "q");
  expect_host(out, "out");
  expect_scale(scale, "scale", kFp8E4m3Max);
  expect_finite(q, "q");
  rect_dequantize_fp8(q.as<fp8_e4m3>(), out.as<float>(), Rect{0, 0, 1, 0, q.numel()}, scale);
}

// ---------------------------------------------------------------- grouped int4

void quantize_int4_grouped(TensorView w, TensorView packed, TensorView scales, int group) {
  expect_rank(w, 2, "w");
  expect_real_input(w, "w");
  expect_host(w, "w");
  const std::int64_t n = w.shape[0], k = w.shape[1];
  expect_int4_grouped(n, k, group, packed, scales, "w");
  const std::int64_t groups = k / group;
  expect_finite(w, "w");

  const RealReader ws(w);
  auto* ps = static_cast<std::uint8_t*>(packed.data);
  float* ss = scales.as<float>();
  std::vector<int> v(static_cast<std::size_t>(k));
  for (std::int64_t i = 0; i < n; ++i) {
    for (std::int64_t g = 0; g < groups; ++g) {
      const Rect r{k, i, i + 1, g * group, (g + 1) * group};
      const float scale = std::max(rect_amax(ws, r), kMinAmax) / static_cast<float>(kInt4Max);
      ss[i * groups + g] = scale;
      for (std::int64_t j = r.c0; j < r.c1; ++j) {
        const float rounded = std::nearbyint(ws[i * k + j] / scale);  // half-even in the default mode
        v[static_cast<std::size_t>(j)] =
            static_cast<int>(std::clamp(rounded, static_cast<float>(kInt4Min), static_cast<float>(kInt4Max)));
      }
    }
    for (std::int64_t j = 0; j < k / 2; ++j) {
      ps[i * (k / 2) + j] =
          pack_int4(v[static_cast<std::size_t>(2 * j)], v[static_cast<std::size_t>(2 * j + 1)]);
    }
  }
}

void dequantize_int4_grouped(TensorView packed, TensorView scales, TensorView out, int group) {
  expect_rank(out, 2, "out");
  expect_dtype(out, DType::f32, "out");
  expect_host(out, "out");
  const std::int64_t n = out.shape[0], k = out.shape[1];
  expect_int4_grouped(n, k, group, packed, scales, "out");
  const std::int64_t groups = k / group;
  expect_scales(scales, "scales", static_cast<float>(-kInt4Min));  // codes reach -8

  const auto* ps = static_cast<const std::uint8_t*>(packed.data);
  const float* ss = scales.as<float>();
  float* os = out.as<float>();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint8_t* row = ps + i * (k / 2);
    for (std::int64_t j = 0; j < k; ++j) {
      os[i * k + j] = static_cast<float>(unpack_int4(row, j)) * ss[i * groups + j / group];
    }
  }
}

}  // namespace epmoe
