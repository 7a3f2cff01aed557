// Benchmark suite "silu_quant": the fused SiLU·mul + FP8 quantization of the GEMM2 input
// (epmoe/cuda/silu_quant.hpp) at DeepSeek-V3 sizes: T tokens (default 128, 4096, 16384), top-8, so
// rows = 8 T spread over 128 local experts (random routing, distinct experts per token), I = 2048.
// Layouts: contiguous (each expert's block padded to 128 rows, m_indices -1 on padding) and masked
// (M_max = the largest count rounded up to 128). Bytes: the valid rows' h read (4I bytes each),
// q and scales written, plus m_indices / masked_m read.
#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "bench/bench.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/silu_quant.hpp"

namespace epmoe::bench {
namespace {

constexpr int kExperts = 128;
constexpr int kTopk = 8;
constexpr std::int64_t kInter = 2048;

// Rows per expert when each of `tokens` tokens picks kTopk distinct experts at random.
std::vector<std::int64_t> route(std::int64_t tokens, std::uint64_t seed) {
  std::vector<std::int64_t> counts(kExperts, 0);
  std::mt19937_64 rng(seed);
  std::vector<int> pool(kExperts);
  for (int e = 0; e < kExperts; ++e) pool[static_cast<std::size_t>(e)] = e;
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (int k = 0; k < kTopk; ++k) {  // partial Fisher-Yates: kTopk distinct experts
      const auto j =
          static_cast<std::size_t>(k + static_cast<int>(rng() % static_cast<std::uint64_t>(kExperts - k)));
      std::swap(pool[static_cast<std::size_t>(k)], pool[j]);
      counts[static_cast<std::size_t>(pool[static_cast<std::size_t>(k)])] += 1;
    }
  }
  return counts;
}

struct Variant {
  const char* quant;
  cuda::SiluQuantOptions options;
};

std::vector<Variant> variants() {
  std::vector<Variant> v(3);
  v[0].quant = "fp8_group128";          // f32 scales, token-major
  v[1].quant = "fp8_group128_pow2_mn";  // UE8M0 scales, MN-major TMA-aligned
  v[1].options.power_of_two = true;
  v[1].options.scale_layout = cuda::ScaleLayout::mn_major_tma;
  v[2].quant = "fp8_tensor_static";
  v[2].options.scaling = cuda::Fp8Scaling::per_tensor;
  v[2].options.tensor_scale = 0.37f;
  return v;
}

std::vector<Result> run_silu_quant_suite(const SuiteOptions& options) {
  std::vector<Result> results;
  const std::vector<std::int64_t> token_list = tokens_or_default(options);
  const TimingOptions timing = timing_for(options);
  cuda::Stream stream;
  SameBytesCopy copy(stream, timing);
  const std::int64_t groups = kInter / 128;

  for (const std::int64_t tokens : token_list) {
    const std::vector<std::int64_t> counts = route(tokens, static_cast<std::uint64_t>(tokens));
    const std::int64_t valid = tokens * kTopk;
    // Bytes of one run for valid rows: h read, q written, scales written (group modes).
    const double row_bytes_group = 4.0 * kInter + kInter + 4.0 * groups;
    const double row_bytes_tensor = 4.0 * kInter + kInter;

    // ---- contiguous
    std::vector<std::int32_t> m;
    for (int e = 0; e < kExperts; ++e) {
      const std::int64_t n = counts[static_cast<std::size_t>(e)], padded = (n + 127) / 128 * 128;
      for (std::int64_t r = 0; r < padded; ++r) m.push_back(r < n ? e : -1);
    }
    const auto rows = static_cast<std::int64_t>(m.size());
    // ---- masked
    const std::int64_t most = *std::max_element(counts.begin(), counts.end());
    const std::int64_t m_max = (most + 127) / 128 * 128;
    std::vector<std::int32_t> masked(counts.begin(), counts.end());

    HostTensor m_host(DType::i32, {rows}), mm_host(DType::i32, {kExperts});
    std::copy(m.begin(), m.end(), m_host.data<std::int32_t>());
    std::copy(masked.begin(), masked.end(), mm_host.data<std::int32_t>());
    const cuda::DeviceTensor m_indices = cuda::to_device(m_host, stream);
    const cuda::DeviceTensor masked_m = cuda::to_device(mm_host, stream);

    for (const bool is_masked : {false, true}) {
      const std::int64_t total_rows = is_masked ? kExperts * m_max : rows;
      const int sets = rotation_sets(static_cast<std::size_t>(static_cast<double>(valid) * row_bytes_group));
      std::vector<cuda::DeviceTensor> hs, qs, ss_token, ss_mn;
      for (int i = 0; i < sets; ++i) {
        hs.emplace_back(DType::bf16, std::initializer_list<std::int64_t>{total_rows, 2 * kInter});
        qs.emplace_back(DType::fp8_e4m3, std::initializer_list<std::int64_t>{total_rows, kInter});
        ss_token.emplace_back(DType::f32, std::initializer_list<std::int64_t>{total_rows, groups});
        if (is_masked) {
          ss_mn.emplace_back(DType::f32, std::initializer_list<std::int64_t>{kExperts, groups, m_max});
        } else {
          ss_mn.emplace_back(DType::f32, std::initializer_list<std::int64_t>{groups, rows});
        }
        fill_random_bf16(hs.back(), static_cast<std::uint64_t>(1000 * tokens + i), stream);
        qs.back().fill_bytes(0xff, stream);
      }
      stream.synchronize();

      for (const Variant& v : variants()) {
        const bool mn = v.options.scaling == cuda::Fp8Scaling::per_token_group &&
                        v.options.scale_layout == cuda::ScaleLayout::mn_major_tma;
        const double us = time_us(
            [&](int i, cudaStream_t s) {
              const auto k = static_cast<std::size_t>(i);
              const TensorView scales = mn ? ss_mn[k].view() : ss_token[k].view();
              if (is_masked) {
                TensorView h = hs[k].view(), q = qs[k].view(), sc = scales;
                h.rank = q.rank = 3;
                h.shape = {kExperts, m_max, 2 * kInter, 0};
                h.stride = {m_max * 2 * kInter, 2 * kInter, 1, 0};
                q.shape = {kExperts, m_max, kInter, 0};
                q.stride = {m_max * kInter, kInter, 1, 0};
                if (!mn) {
                  sc.rank = 3;
                  sc.shape = {kExperts, m_max, groups, 0};
                  sc.stride = {m_max * groups, groups, 1, 0};
                }
                cuda::silu_mul_quant_masked(h, masked_m, q, sc, v.options, s);
              } else {
                cuda::silu_mul_quant_contiguous(hs[k], m_indices, qs[k], scales, v.options, s);
              }
            },
            sets, stream, timing);
        const bool group = v.options.scaling == cuda::Fp8Scaling::per_token_group;
        const double bytes = static_cast<double>(valid) * (group ? row_bytes_group : row_bytes_tensor) +
                             (is_masked ? kExperts * 4.0 : static_cast<double>(rows) * 4.0);
        Params p{{"tokens", tokens},
                 {"layout", std::string(is_masked ? "masked" : "contiguous")},
                 {"quant", std::string(v.quant)},
                 {"n", kInter},
                 {"groups", std::int64_t{kExperts}},
                 {"m_per_group", valid / kExperts}};
        emit(options, results, copy.attach(make_result("silu_quant", p, us, bytes), bytes));
      }
    }
  }
  return results;
}

const SuiteRegistration kSiluQuant{
    "silu_quant", "fused SiLU·mul + FP8 quantization of the GEMM2 input (contiguous, masked)", 40,
    run_silu_quant_suite};

}  // namespace
}  // namespace epmoe::bench
