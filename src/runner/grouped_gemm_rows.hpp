// What the CPU grouped-GEMM references share (FP8 block-scaled: grouped_gemm_cpu.cpp; W4A8:
// w4a8_gemm_cpu.cpp): the rows of A by group from either layout, and one exact engine
//
//   D[row, n] = final_scale · Σ_kb block_scale(g, row, n, kb) · Σ_{k in block kb} A[row, k] · W[g, n, k]
//
// where each 128-wide block sum of products of exactly representable values is exact in f64 (eight
// partial sums in a fixed order, which the compiler vectorises) and only the scaled sum over the
// blocks rounds. Output columns are split over the cores; each element is summed by one thread in
// one order, so results do not depend on the thread count.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

#include "core/parallel.hpp"
#include "epmoe/grouped_gemm.hpp"
#include "epmoe/numerics.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe::detail {

// All 256 e4m3 codes as f64 (exact).
inline const std::array<double, 256>& fp8_values() {
  static const std::array<double, 256> table = [] {
    std::array<double, 256> t{};
    for (int i = 0; i < 256; ++i)
      t[static_cast<std::size_t>(i)] = fp8_e4m3::from_bits(static_cast<std::uint8_t>(i)).to_float();
    return t;
  }();
  return table;
}

using GroupRows = std::vector<std::vector<std::int64_t>>;  // [G]: flat rows of A (and of d) in group g

// Contiguous layout: row m belongs to group m_indices[m] (-1: none). m_indices [M] i32 host;
// refuses ids outside [-1, G).
GroupRows rows_from_m_indices(const TensorView& m_indices, std::int64_t M, std::int64_t G);
// Masked layout: rows [0, masked_m[g]) of group g, flat row g * M_max + r. masked_m [G] i32 host;
// refuses counts outside [0, M_max].
GroupRows rows_from_masked_m(const TensorView& masked_m, std::int64_t G, std::int64_t M_max);

// decode_a(row, out[K]) and decode_w(g, n, out[K]) write exact f64 values; block_scale(g, row, n, kb)
// is the f64 factor of block kb; d [R, N] flattened, bf16 (rounded once) or f64.
template <class DecodeA, class DecodeW, class BlockScale>
void grouped_gemm_rows(const GroupRows& rows_by_group, std::int64_t N, std::int64_t K, double final_scale,
                       const DecodeA& decode_a, const DecodeW& decode_w, const BlockScale& block_scale,
                       TensorView d) {
  constexpr std::int64_t kBlock = kGemmScaleBlock;
  constexpr std::int64_t kChunk = 16;  // output columns per work item
  const std::int64_t kb_count = K / kBlock;
  const bool f64_out = d.dtype == DType::f64;
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  for (std::size_t g = 0; g < rows_by_group.size(); ++g) {
    const std::vector<std::int64_t>& rows = rows_by_group[g];
    if (rows.empty()) continue;
    const auto R = static_cast<std::int64_t>(rows.size());
    std::vector<double> qa(static_cast<std::size_t>(R * K));
    for (std::int64_t i = 0; i < R; ++i) decode_a(rows[static_cast<std::size_t>(i)], qa.data() + i * K);
    const auto gi = static_cast<std::int64_t>(g);
    const double work = static_cast<double>(R) * static_cast<double>(N) * static_cast<double>(K);
    const auto threads = static_cast<unsigned>(std::clamp<double>(
        work / 2e7, 1.0, std::min<double>(hw, static_cast<double>((N + kChunk - 1) / kChunk))));
    parallel_chunks(N, kChunk, threads, [&](std::int64_t n_begin, std::int64_t n_end) {
      std::vector<double> qw(static_cast<std::size_t>(K));
      for (std::int64_t n = n_begin; n < n_end; ++n) {
        decode_w(gi, n, qw.data());
        for (std::int64_t i = 0; i < R; ++i) {
          const std::int64_t row = rows[static_cast<std::size_t>(i)];
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
            acc += block_scale(gi, row, n, kb) * block;
          }
          acc *= final_scale;
          if (f64_out) {
            d.as<double>()[row * N + n] = acc;
          } else {
            d.as<bf16>()[row * N + n] = bf16::from_float(static_cast<float>(acc));
          }
        }
      }
    });
  }
}

}  // namespace epmoe::detail
