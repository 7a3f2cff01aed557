// The CPU reference of the FP8 block-scaled grouped GEMM (epmoe/grouped_gemm.hpp).
//
// Every e4m3 value is exact in f32, every product of two is exact in f64, and so is a sum of 128
// of them (multiples of 2^-18 below 2^43), so each 128-wide K block is summed exactly and only the
// scaled sum over the K blocks rounds (in f64). Work is split over the output columns across the
// machine's cores: the GPU tests call this at DeepSeek-V3 sizes (N, K up to 7168).
#include "epmoe/grouped_gemm.hpp"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

namespace epmoe {
namespace {

constexpr std::int64_t kBlock = kGemmScaleBlock;

// All 256 e4m3 codes as f32 (exact).
const std::array<float, 256>& fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i)
      t[static_cast<std::size_t>(i)] = fp8_e4m3::from_bits(static_cast<std::uint8_t>(i)).to_float();
    return t;
  }();
  return table;
}

// One problem in a layout-free form: rows of A (flat index into a [R, K] and its scales [R, K/128])
// grouped by the group whose B they multiply; output row = the same flat index into d [R, N].
struct Problem {
  const std::uint8_t* a = nullptr;  // [R, K]
  const float* a_scales = nullptr;  // [R, K/128]
  const std::uint8_t* b = nullptr;  // [G, N, K]
  const float* b_scales = nullptr;  // [G, ceil(N/128), K/128]
  std::int64_t n = 0, k = 0, groups = 0;
  std::vector<std::vector<std::int64_t>> rows;  // rows[g]: the flat rows of group g
  TensorView d;                                 // [R, N] bf16 or f64 (flattened view)
};

void run(const Problem& p) {
  const auto& table = fp8_table();
  const std::int64_t K = p.k, N = p.n, kb_count = K / kBlock, nb_count = (N + kBlock - 1) / kBlock;
  const bool f64_out = p.d.dtype == DType::f64;
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());

  for (std::int64_t g = 0; g < p.groups; ++g) {
    const std::vector<std::int64_t>& rows = p.rows[static_cast<std::size_t>(g)];
    if (rows.empty()) continue;
    const auto R = static_cast<std::int64_t>(rows.size());
    // A rows of this group as f64 (exact), with their scales.
    std::vector<double> qa(static_cast<std::size_t>(R * K));
    std::vector<double> sa(static_cast<std::size_t>(R * kb_count));
    for (std::int64_t i = 0; i < R; ++i) {
      const std::int64_t row = rows[static_cast<std::size_t>(i)];
      for (std::int64_t k = 0; k < K; ++k) qa[static_cast<std::size_t>(i * K + k)] = table[p.a[row * K + k]];
      for (std::int64_t kb = 0; kb < kb_count; ++kb)
        sa[static_cast<std::size_t>(i * kb_count + kb)] = p.a_scales[row * kb_count + kb];
    }

    const std::uint8_t* bg = p.b + g * N * K;
    const float* sbg = p.b_scales + g * nb_count * kb_count;
    std::atomic<std::int64_t> next{0};
    constexpr std::int64_t kChunk = 16;  // output columns per work item
    auto worker = [&] {
      std::vector<double> qb(static_cast<std::size_t>(K));
      for (;;) {
        const std::int64_t n0 = next.fetch_add(kChunk);
        if (n0 >= N) return;
        for (std::int64_t n = n0; n < std::min(N, n0 + kChunk); ++n) {
          for (std::int64_t k = 0; k < K; ++k) qb[static_cast<std::size_t>(k)] = table[bg[n * K + k]];
          const float* sb = sbg + (n / kBlock) * kb_count;
          for (std::int64_t i = 0; i < R; ++i) {
            const double* qa_row = qa.data() + i * K;
            const double* sa_row = sa.data() + i * kb_count;
            double acc = 0.0;
            for (std::int64_t kb = 0; kb < kb_count; ++kb) {
              // Exact block sum (eight partial sums, which the compiler vectorises; each is exact).
              double s[8] = {};
              const double* x = qa_row + kb * kBlock;
              const double* y = qb.data() + kb * kBlock;
              for (std::int64_t k = 0; k < kBlock; k += 8) {
                for (int u = 0; u < 8; ++u) s[u] += x[k + u] * y[k + u];
              }
              const double block = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
              acc += sa_row[kb] * static_cast<double>(sb[kb]) * block;
            }
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
  expect_finite(b_scales, "b_scales");
  expect_finite(a_scales, "a_scales");
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
  expect_dtype(m_indices, DType::i32, "m_indices");
  expect_device(m_indices, Device::cpu, "m_indices");
  expect_contiguous(m_indices, "m_indices");
  expect_shape(m_indices, {M}, "m_indices");
  expect_shape(d, {M, N}, "d");

  Problem p;
  p.a = static_cast<const std::uint8_t*>(a.data);
  p.a_scales = a_scales.as<float>();
  p.b = static_cast<const std::uint8_t*>(b.data);
  p.b_scales = b_scales.as<float>();
  p.n = N;
  p.k = K;
  p.groups = G;
  p.rows.resize(static_cast<std::size_t>(G));
  const std::int32_t* ids = m_indices.as<std::int32_t>();
  for (std::int64_t m = 0; m < M; ++m) {
    EPMOE_CHECK(ids[m] >= -1 && ids[m] < G, "m_indices[{}] = {} must be -1 or a group in [0, {})", m, ids[m],
                G);
    if (ids[m] >= 0) p.rows[static_cast<std::size_t>(ids[m])].push_back(m);
  }
  p.d = d;
  run(p);
}

void grouped_gemm_masked_cpu(TensorView a, TensorView a_scales, TensorView b, TensorView b_scales,
                             TensorView masked_m, TensorView d) {
  expect_rank(a, 3, "a");
  expect_rank(b, 3, "b");
  const std::int64_t G = a.shape[0], M_max = a.shape[1], K = a.shape[2], N = b.shape[1];
  expect_shape(b, {G, N, K}, "b (G and K of a)");
  check_operands(a, a_scales, b, b_scales, d);
  expect_shape(a_scales, {G, M_max, K / kBlock}, "a_scales");
  expect_dtype(masked_m, DType::i32, "masked_m");
  expect_device(masked_m, Device::cpu, "masked_m");
  expect_contiguous(masked_m, "masked_m");
  expect_shape(masked_m, {G}, "masked_m");
  expect_shape(d, {G, M_max, N}, "d");

  Problem p;
  p.a = static_cast<const std::uint8_t*>(a.data);
  p.a_scales = a_scales.as<float>();
  p.b = static_cast<const std::uint8_t*>(b.data);
  p.b_scales = b_scales.as<float>();
  p.n = N;
  p.k = K;
  p.groups = G;
  p.rows.resize(static_cast<std::size_t>(G));
  const std::int32_t* counts = masked_m.as<std::int32_t>();
  for (std::int64_t g = 0; g < G; ++g) {
    EPMOE_CHECK(counts[g] >= 0 && counts[g] <= M_max, "masked_m[{}] = {} must be in [0, {}]", g, counts[g],
                M_max);
    for (std::int64_t r = 0; r < counts[g]; ++r) p.rows[static_cast<std::size_t>(g)].push_back(g * M_max + r);
  }
  p.d = d;
  run(p);
}

}  // namespace epmoe
