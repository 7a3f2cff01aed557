// The CPU reference of the FP8 block-scaled grouped GEMM (epmoe/grouped_gemm.hpp).
//
// Every e4m3 value is exact in f32, every product of two is exact in f64, and so is a sum of 128
// of them (multiples of 2^-18 below 2^43), so each 128-wide K block is summed exactly and only the
// scaled sum over the K blocks rounds (in f64); the engine is runner/grouped_gemm_rows.hpp, which
// splits the output columns over the cores (the GPU tests call this at DeepSeek-V3 sizes).
#include "epmoe/grouped_gemm.hpp"

#include <cmath>

#include "runner/grouped_gemm_rows.hpp"

namespace epmoe {
namespace {

constexpr std::int64_t kBlock = kGemmScaleBlock;

// The operands as the shared engine (runner/grouped_gemm_rows.hpp) reads them.
void run(const TensorView& a, const TensorView& a_scales, const TensorView& b, const TensorView& b_scales,
         const detail::GroupRows& rows, const TensorView& d) {
  const auto& table = detail::fp8_values();
  const std::int64_t N = b.shape[1], K = b.shape[2], kb_count = K / kBlock,
                     nb_count = (N + kBlock - 1) / kBlock;
  const auto* qa = static_cast<const std::uint8_t*>(a.data);
  const auto* qb = static_cast<const std::uint8_t*>(b.data);
  const float* sa = a_scales.as<float>();
  const float* sb = b_scales.as<float>();
  // e4m3's NaN codes (S.1111.111) in what the GEMM reads: A's rows of each group and the groups' weights
  // (padding rows, which the layouts leave unread and the GPU tests fill with NaN, are not looked at).
  auto is_nan_code = [](std::uint8_t q) { return (q & 0x7f) == 0x7f; };
  for (std::size_t g = 0; g < rows.size(); ++g) {
    if (rows[g].empty()) continue;
    for (const std::int64_t row : rows[g]) {
      for (std::int64_t k = 0; k < K; ++k)
        EPMOE_CHECK(!is_nan_code(qa[row * K + k]), "a must be finite: row {} column {} is an e4m3 NaN", row,
                    k);
      for (std::int64_t kb = 0; kb < kb_count; ++kb)
        EPMOE_CHECK(sa[row * kb_count + kb] > 0.0f, "a_scales must be positive: row {} block {} is {}", row,
                    kb, sa[row * kb_count + kb]);
    }
    const std::uint8_t* w = qb + static_cast<std::int64_t>(g) * N * K;
    for (std::int64_t i = 0; i < N * K; ++i)
      EPMOE_CHECK(!is_nan_code(w[i]), "b must be finite: group {} row {} column {} is an e4m3 NaN", g, i / K,
                  i % K);
  }
  detail::grouped_gemm_rows(
      rows, N, K, 1.0,
      [&](std::int64_t row, double* out) {
        for (std::int64_t k = 0; k < K; ++k) out[k] = table[qa[row * K + k]];
      },
      [&](std::int64_t g, std::int64_t n, double* out) {
        for (std::int64_t k = 0; k < K; ++k) out[k] = table[qb[(g * N + n) * K + k]];
      },
      [&](std::int64_t g, std::int64_t row, std::int64_t n, std::int64_t kb) {
        return static_cast<double>(sa[row * kb_count + kb]) *
               static_cast<double>(sb[(g * nb_count + n / kBlock) * kb_count + kb]);
      },
      d);
}

// Checks shared by both layouts: a [.., K], a_scales [.., K/128], b [G, N, K], b_scales.
void check_operands(const TensorView& a, const TensorView& a_scales, const TensorView& b,
                    const TensorView& b_scales, const TensorView& d) {
  for (const auto& [t, name] : {std::pair{&a, "a"}, std::pair{&a_scales, "a_scales"}, std::pair{&b, "b"},
                                std::pair{&b_scales, "b_scales"}, std::pair{&d, "d"}}) {
    expect_device(*t, Device::cpu, name);
    expect_contiguous(*t, name);
  }
  expect_dtype(a, DType::fp8_e4m3, "a");
  expect_dtype(a_scales, DType::f32, "a_scales");
  expect_dtype(b, DType::fp8_e4m3, "b");
  expect_dtype(b_scales, DType::f32, "b_scales");
  EPMOE_CHECK(d.dtype == DType::bf16 || d.dtype == DType::f64, "d must be bf16 or f64, got {}", d.describe());
  expect_rank(b, 3, "b");
  const std::int64_t G = b.shape[0], N = b.shape[1], K = b.shape[2];
  EPMOE_CHECK(K > 0 && K % kBlock == 0, "b: K = {} must be a positive multiple of {}", K, kBlock);
  EPMOE_CHECK(N > 0 && G > 0, "b must have at least one group and one row, got {}", b.describe());
  expect_shape(b_scales, {G, (N + kBlock - 1) / kBlock, K / kBlock}, "b_scales");
  expect_scales(b_scales, "b_scales");
  expect_finite(a_scales, "a_scales");  // (positive where the GEMM reads: run())
}

}  // namespace

void grouped_gemm_contiguous_cpu(TensorView a, TensorView a_scales, TensorView b, TensorView b_scales,
                                 TensorView m_indices, TensorView d) {
  expect_rank(a, 2, "a");
  expect_rank(b, 3, "b");
  const std::int64_t M = a.shape[0], K = a.shape[1], G = b.shape[0], N = b.shape[1];
  expect_shape(b, {G, N, K}, "b (K of a)");
  check_operands(a, a_scales, b, b_scales, d);
  expect_shape(a_scales, {M, K / kBlock}, "a_scales");
  expect_shape(d, {M, N}, "d");
  run(a, a_scales, b, b_scales, detail::rows_from_m_indices(m_indices, M, G), d);
}

void grouped_gemm_masked_cpu(TensorView a, TensorView a_scales, TensorView b, TensorView b_scales,
                             TensorView masked_m, TensorView d) {
  expect_rank(a, 3, "a");
  expect_rank(b, 3, "b");
  const std::int64_t G = a.shape[0], M_max = a.shape[1], K = a.shape[2], N = b.shape[1];
  expect_shape(b, {G, N, K}, "b (G and K of a)");
  check_operands(a, a_scales, b, b_scales, d);
  expect_shape(a_scales, {G, M_max, K / kBlock}, "a_scales");
  expect_shape(d, {G, M_max, N}, "d");
  run(a, a_scales, b, b_scales, detail::rows_from_masked_m(masked_m, G, M_max), d);
}

}  // namespace epmoe
