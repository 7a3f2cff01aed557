// The CPU reference of the W4A8 grouped GEMM (epmoe/grouped_gemm.hpp, w4a8_*_cpu).
//
// Every e4m3 and int4 value is exact in f64 and so is their product (a multiple of 2^-9 below 2^12),
// and a sum of 128 of them too, so each 128-wide K block is summed exactly; only the scaled sum over
// the blocks rounds (in f64). Work is split over the output columns across the machine's cores.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include "epmoe/grouped_gemm.hpp"

namespace epmoe {
namespace {

constexpr std::int64_t kBlock = kGemmScaleBlock;

struct Problem {
  const std::uint8_t* a = nullptr;  // [R, K] e4m3
  double a_scale = 1.0;
  const std::uint8_t* w = nullptr;  // [G, N, K/2] i4x2
  const float* w_scales = nullptr;  // [G, N, K/128]
  std::int64_t n = 0, k = 0, groups = 0;
  std::vector<std::vector<std::int64_t>> rows;  // rows[g]: the flat rows of group g
  TensorView d;                                 // [R, N] bf16 or f64
};

void run(const Problem& p) {
  std::array<double, 256> fp8{};
  for (int i = 0; i < 256; ++i)
    fp8[static_cast<std::size_t>(i)] = fp8_e4m3::from_bits(static_cast<std::uint8_t>(i)).to_float();
  const std::int64_t K = p.k, N = p.n, kb_count = K / kBlock;
  const bool f64_out = p.d.dtype == DType::f64;
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());

  for (std::int64_t g = 0; g < p.groups; ++g) {
    const std::vector<std::int64_t>& rows = p.rows[static_cast<std::size_t>(g)];
    if (rows.empty()) continue;
    const auto R = static_cast<std::int64_t>(rows.size());
    std::vector<double> qa(static_cast<std::size_t>(R * K));
    for (std::int64_t i = 0; i < R; ++i) {
      const std::int64_t row = rows[static_cast<std::size_t>(i)];
      for (std::int64_t k = 0; k < K; ++k) qa[static_cast<std::size_t>(i * K + k)] = fp8[p.a[row * K + k]];
    }
    const std::uint8_t* wg = p.w + g * N * (K / 2);
    const float* sg = p.w_scales + g * N * kb_count;
    std::atomic<std::int64_t> next{0};
    constexpr std::int64_t kChunk = 16;
    auto worker = [&] {
      std::vector<double> qw(static_cast<std::size_t>(K));
      for (;;) {
        const std::int64_t n0 = next.fetch_add(kChunk);
        if (n0 >= N) return;
        for (std::int64_t n = n0; n < std::min(N, n0 + kChunk); ++n) {
          for (std::int64_t k = 0; k < K; ++k)
            qw[static_cast<std::size_t>(k)] = static_cast<double>(unpack_int4(wg + n * (K / 2), k));
          const float* s = sg + n * kb_count;
          for (std::int64_t i = 0; i < R; ++i) {
            const double* x_row = qa.data() + i * K;
            double acc = 0.0;
            for (std::int64_t kb = 0; kb < kb_count; ++kb) {
              double part[8] = {};
              const double* x = x_row + kb * kBlock;
              const double* y = qw.data() + kb * kBlock;
              for (std::int64_t k = 0; k < kBlock; k += 8) {
                for (int u = 0; u < 8; ++u) part[u] += x[k + u] * y[k + u];
              }
              const double block =
                  ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
              acc += static_cast<double>(s[kb]) * block;
            }
            acc *= p.a_scale;
            const std::int64_t out = rows[static_cast<std::size_t>(i)] * N + n;
            if (f64_out) {
              p.d.as<double>()[out] = acc;
            } else {
              p.d.as<bf16>()[out] = bf16::from_float(static_cast<float>(acc));
            }
          }
        }
      }
    };
    const double work = static_cast<double>(R) * static_cast<double>(N) * static_cast<double>(K);
    const auto threads = static_cast<unsigned>(std::clamp<double>(
        work / 2e7, 1.0, std::min<double>(hw, static_cast<double>((N + kChunk - 1) / kChunk))));
    std::vector<std::thread> pool;
    for (unsigned t = 1; t < threads; ++t) pool.emplace_back(worker);
    worker();
    for (std::thread& t : pool) t.join();
  }
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
  EPMOE_CHECK(std::isfinite(a_scale) && a_scale > 0.0f, "a_scale must be positive and finite, got {}",
              a_scale);
  expect_rank(w, 3, "w");
  const std::int64_t G = w.shape[0], N = w.shape[1], K = 2 * w.shape[2];
  EPMOE_CHECK(K > 0 && K % kBlock == 0, "w: K = {} must be a positive multiple of {}", K, kBlock);
  EPMOE_CHECK(N > 0 && G > 0, "w must have at least one group and one row, got {}", w.describe());
  expect_shape(w_scales, {G, N, K / kBlock}, "w_scales");
  expect_finite(w_scales, "w_scales");
}

Problem make_problem(const TensorView& a, float a_scale, const TensorView& w, const TensorView& w_scales,
                     const TensorView& d) {
  Problem p;
  p.a = static_cast<const std::uint8_t*>(a.data);
  p.a_scale = a_scale;
  p.w = static_cast<const std::uint8_t*>(w.data);
  p.w_scales = w_scales.as<float>();
  p.groups = w.shape[0];
  p.n = w.shape[1];
  p.k = 2 * w.shape[2];
  p.rows.resize(static_cast<std::size_t>(p.groups));
  p.d = d;
  return p;
}

}  // namespace

void w4a8_grouped_gemm_contiguous_cpu(TensorView a, float a_scale, TensorView w, TensorView w_scales,
                                      TensorView m_indices, TensorView d) {
  expect_rank(a, 2, "a");
  expect_rank(w, 3, "w");
  const std::int64_t M = a.shape[0], G = w.shape[0], N = w.shape[1], K = 2 * w.shape[2];
  expect_shape(a, {M, K}, "a (K of w)");
  check_operands(a, a_scale, w, w_scales, d);
  expect_dtype(m_indices, DType::i32, "m_indices");
  expect_device(m_indices, Device::cpu, "m_indices");
  expect_contiguous(m_indices, "m_indices");
  expect_shape(m_indices, {M}, "m_indices");
  expect_shape(d, {M, N}, "d");
  Problem p = make_problem(a, a_scale, w, w_scales, d);
  const std::int32_t* ids = m_indices.as<std::int32_t>();
  for (std::int64_t m = 0; m < M; ++m) {
    EPMOE_CHECK(ids[m] >= -1 && ids[m] < G, "m_indices[{}] = {} must be -1 or a group in [0, {})", m, ids[m],
                G);
    if (ids[m] >= 0) p.rows[static_cast<std::size_t>(ids[m])].push_back(m);
  }
  run(p);
}

void w4a8_grouped_gemm_masked_cpu(TensorView a, float a_scale, TensorView w, TensorView w_scales,
                                  TensorView masked_m, TensorView d) {
  expect_rank(a, 3, "a");
  expect_rank(w, 3, "w");
  const std::int64_t G = a.shape[0], M_max = a.shape[1], N = w.shape[1], K = 2 * w.shape[2];
  expect_shape(a, {G, M_max, K}, "a (G and K of w)");
  check_operands(a, a_scale, w, w_scales, d);
  expect_shape(w, {G, N, K / 2}, "w (G of a)");
  expect_dtype(masked_m, DType::i32, "masked_m");
  expect_device(masked_m, Device::cpu, "masked_m");
  expect_contiguous(masked_m, "masked_m");
  expect_shape(masked_m, {G}, "masked_m");
  expect_shape(d, {G, M_max, N}, "d");
  Problem p = make_problem(a, a_scale, w, w_scales, d);
  const std::int32_t* counts = masked_m.as<std::int32_t>();
  for (std::int64_t g = 0; g < G; ++g) {
    EPMOE_CHECK(counts[g] >= 0 && counts[g] <= M_max, "masked_m[{}] = {} must be in [0, {}]", g, counts[g],
                M_max);
    for (std::int64_t r = 0; r < counts[g]; ++r) p.rows[static_cast<std::size_t>(g)].push_back(g * M_max + r);
  }
  run(p);
}

}  // namespace epmoe
