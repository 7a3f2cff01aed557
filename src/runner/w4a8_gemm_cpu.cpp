// The CPU reference of the W4A8 grouped GEMM (epmoe/grouped_gemm.hpp, w4a8_*_cpu).
//
// Every e4m3 and int4 value is exact in f64 and so is their product (a multiple of 2^-9 below 2^12),
// and a sum of 128 of them too, so each 128-wide K block is summed exactly; only the scaled sum over
// the blocks rounds (in f64). The engine is runner/grouped_gemm_rows.hpp.
#include <cmath>

#include "epmoe/grouped_gemm.hpp"
#include "runner/grouped_gemm_rows.hpp"

namespace epmoe {
namespace {

constexpr std::int64_t kBlock = kGemmScaleBlock;

// The operands as the shared engine (runner/grouped_gemm_rows.hpp) reads them; a_scale is applied
// once to each output's scaled sum.
void run(const TensorView& a, float a_scale, const TensorView& w, const TensorView& w_scales,
         const detail::GroupRows& rows, const TensorView& d) {
  const auto& fp8 = detail::fp8_values();
  const std::int64_t N = w.shape[1], K = 2 * w.shape[2], kb_count = K / kBlock;
  const auto* qa = static_cast<const std::uint8_t*>(a.data);
  const auto* qw = static_cast<const std::uint8_t*>(w.data);
  const float* s = w_scales.as<float>();
  detail::grouped_gemm_rows(
      rows, N, K, static_cast<double>(a_scale),
      [&](std::int64_t row, double* out) {
        for (std::int64_t k = 0; k < K; ++k) out[k] = fp8[qa[row * K + k]];
      },
      [&](std::int64_t g, std::int64_t n, double* out) {
        const std::uint8_t* packed = qw + (g * N + n) * (K / 2);
        for (std::int64_t k = 0; k < K; ++k) out[k] = static_cast<double>(unpack_int4(packed, k));
      },
      [&](std::int64_t g, std::int64_t, std::int64_t n, std::int64_t kb) {
        return static_cast<double>(s[(g * N + n) * kb_count + kb]);
      },
      d);
}

// a [.., K] e4m3, w [G, N, K/2] i4x2, w_scales [G, N, K/128] f32, d bf16 or f64; host, contiguous.
void check_operands(const TensorView& a, float a_scale, const TensorView& w, const TensorView& w_scales,
                    const TensorView& d) {
  for (const auto& [t, name] :
       {std::pair{&a, "a"}, std::pair{&w, "w"}, std::pair{&w_scales, "w_scales"}, std::pair{&d, "d"}}) {
    expect_device(*t, Device::cpu, name);
    expect_contiguous(*t, name);
  }
  expect_dtype(a, DType::fp8_e4m3, "a");
  expect_dtype(w, DType::i4x2, "w");
  expect_dtype(w_scales, DType::f32, "w_scales");
  EPMOE_CHECK(d.dtype == DType::bf16 || d.dtype == DType::f64, "d must be bf16 or f64, got {}", d.describe());
  expect_scale(a_scale, "a_scale");
  expect_rank(w, 3, "w");
  const std::int64_t G = w.shape[0], N = w.shape[1], K = 2 * w.shape[2];
  EPMOE_CHECK(K > 0 && K % kBlock == 0, "w: K = {} must be a positive multiple of {}", K, kBlock);
  EPMOE_CHECK(N > 0 && G > 0, "w must have at least one group and one row, got {}", w.describe());
  expect_shape(w_scales, {G, N, K / kBlock}, "w_scales");
  expect_scales(w_scales, "w_scales");
}

}  // namespace

void w4a8_grouped_gemm_contiguous_cpu(TensorView a, float a_scale, TensorView w, TensorView w_scales,
                                      TensorView m_indices, TensorView d) {
  expect_rank(a, 2, "a");
  expect_rank(w, 3, "w");
  const std::int64_t M = a.shape[0], G = w.shape[0], N = w.shape[1], K = 2 * w.shape[2];
  expect_shape(a, {M, K}, "a (K of w)");
  check_operands(a, a_scale, w, w_scales, d);
  expect_shape(d, {M, N}, "d");
  run(a, a_scale, w, w_scales, detail::rows_from_m_indices(m_indices, M, G), d);
}

void w4a8_grouped_gemm_masked_cpu(TensorView a, float a_scale, TensorView w, TensorView w_scales,
                                  TensorView masked_m, TensorView d) {
  expect_rank(a, 3, "a");
  expect_rank(w, 3, "w");
  const std::int64_t G = a.shape[0], M_max = a.shape[1], N = w.shape[1], K = 2 * w.shape[2];
  expect_shape(a, {G, M_max, K}, "a (G and K of w)");
  check_operands(a, a_scale, w, w_scales, d);
  expect_shape(w, {G, N, K / 2}, "w (G of a)");
  expect_shape(d, {G, M_max, N}, "d");
  run(a, a_scale, w, w_scales, detail::rows_from_masked_m(masked_m, G, M_max), d);
}

}  // namespace epmoe
