// Benchmark suites "permute" and "gather": the local expert permutation and the weighted gather
// back (epmoe/cuda/permute.hpp) at DeepSeek-V3 sizes: T tokens (default 128, 4096, 16384), H = 7168,
// top-8 over 128 local experts (random routing, distinct experts per token).
//   permute: fp8 tokens + scales -> contiguous (M = contiguous_capacity(8T, 128), scales token-major)
//            and masked (M_max = the largest count rounded up to 128); bf16 tokens -> contiguous.
//            Bytes: x, scales and ids read; 8T rows, their scales, src_row and the row maps written.
//   gather:  bf16 expert rows of the contiguous layout -> y [T, H]. Bytes: 8T rows read, the maps and
//            weights read, y written.
#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "bench/bench.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/permute.hpp"

namespace epmoe::bench {
namespace {

constexpr int kExperts = 128;
constexpr int kTopk = 8;
constexpr std::int64_t kHidden = 7168;

// topk ids [T, 8]: distinct random experts per token, seeded.
HostTensor route(std::int64_t tokens, std::uint64_t seed) {
  HostTensor ids(DType::i32, {tokens, kTopk});
  std::mt19937_64 rng(seed);
  std::vector<int> pool(kExperts);
  for (int e = 0; e < kExperts; ++e) pool[static_cast<std::size_t>(e)] = e;
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (int k = 0; k < kTopk; ++k) {
      const auto j =
          static_cast<std::size_t>(k + static_cast<int>(rng() % static_cast<std::uint64_t>(kExperts - k)));
      std::swap(pool[static_cast<std::size_t>(k)], pool[j]);
      ids.data<std::int32_t>()[t * kTopk + k] = pool[static_cast<std::size_t>(k)];
    }
  }
  return ids;
}

std::int64_t masked_rows(const HostTensor& ids) {
  std::vector<std::int64_t> counts(kExperts, 0);
  for (std::int64_t i = 0; i < ids.numel(); ++i)
    counts[static_cast<std::size_t>(ids.data<std::int32_t>()[i])] += 1;
  return (*std::max_element(counts.begin(), counts.end()) + 127) / 128 * 128;
}

// One rotated set: the input tokens (fp8 and bf16 share the buffer: the copy does not look at the
// values) and scales, and the permuted rows and scales written from them. The outputs rotate too: one
// output buffer rewritten every run keeps its dirty lines in L2 at small T, so most of the writes the row
// counts never reach HBM.
struct RotatedSet {
  cuda::DeviceTensor x_bytes;  // [T, 2H] bytes: viewed as fp8 [T, H] or bf16 [T, H]
  cuda::DeviceTensor scales;   // [T, H/128]
  cuda::DeviceTensor rows;     // [m, 2H] bytes: contiguous rows, viewed as fp8 or bf16
  cuda::DeviceTensor row_scales;
  cuda::DeviceTensor masked_rows;  // [E, m_max, H] fp8
  cuda::DeviceTensor masked_scales;
};

std::vector<Result> run_permute_suite(const SuiteOptions& options) {
  std::vector<Result> results;
  const TimingOptions timing = timing_for(options);
  cuda::Stream stream;
  SameBytesCopy copy(stream, timing);
  const std::int64_t groups = kHidden / 128;
  for (const std::int64_t tokens : tokens_or_default(options)) {
    const std::int64_t entries = tokens * kTopk;
    const HostTensor ids_host = route(tokens, static_cast<std::uint64_t>(tokens));
    const cuda::DeviceTensor ids = cuda::to_device(ids_host, stream);
    const std::int64_t m = contiguous_capacity(entries, kExperts), m_max = masked_rows(ids_host);
    const cuda::DeviceTensor ws(
        DType::u8, {static_cast<std::int64_t>(cuda::permute_workspace_bytes(entries, kExperts))});
    // The maps (small, one set) ...
    const cuda::DeviceTensor m_indices(DType::i32, {m}), row_src(DType::i32, {m}),
        src_row(DType::i32, {tokens, kTopk}), offsets(DType::i32, {kExperts + 1}),
        counts(DType::i32, {kExperts}), masked_m(DType::i32, {kExperts}),
        mrow_src(DType::i32, {kExperts, m_max});
    // ... and rotated tokens and rows: sets enough that the bytes allocated per set (the contiguous rows
    // at bf16, the masked rows, their scales), which bound what a run touches, exceed twice the L2 (the
    // masked layout's [E, m_max, H] alone is >= 117 MB: one set at a few tokens).
    const double set_bytes = static_cast<double>(tokens + m) * (2.0 * kHidden + 4.0 * groups) +
                             static_cast<double>(kExperts * m_max) * (kHidden + 4.0 * groups);
    const int sets = rotation_sets(static_cast<std::size_t>(set_bytes));
    std::vector<RotatedSet> in(static_cast<std::size_t>(sets));
    for (int i = 0; i < sets; ++i) {
      RotatedSet& s = in[static_cast<std::size_t>(i)];
      s.x_bytes = cuda::DeviceTensor(DType::bf16, {tokens, kHidden});
      s.scales = cuda::DeviceTensor(DType::f32, {tokens, groups});
      s.rows = cuda::DeviceTensor(DType::bf16, {m, kHidden});
      s.row_scales = cuda::DeviceTensor(DType::f32, {m, groups});
      s.masked_rows = cuda::DeviceTensor(DType::fp8_e4m3, {kExperts, m_max, kHidden});
      s.masked_scales = cuda::DeviceTensor(DType::f32, {kExperts, m_max, groups});
      fill_random_bf16(s.x_bytes, static_cast<std::uint64_t>(7 * tokens + i), stream);
      s.scales.fill_bytes(0x3c, stream);
    }
    stream.synchronize();
    auto fp8_view = [&](int i) {
      TensorView x = in[static_cast<std::size_t>(i)].x_bytes.view();
      x.dtype = DType::fp8_e4m3;
      return x;
    };
    auto rows_fp8 = [&](int i) {
      TensorView rows = in[static_cast<std::size_t>(i)].rows.view();
      rows.dtype = DType::fp8_e4m3;
      return rows;
    };

    const double fp8_scale_bytes = 4.0 * groups;
    const double maps = 4.0 * entries * 2;  // ids read, src_row written
    const Params base{{"tokens", tokens},
                      {"n", kHidden},
                      {"groups", std::int64_t{kExperts}},
                      {"m_per_group", entries / kExperts}};
    {  // contiguous, fp8
      const double us = time_us(
          [&](int i, cudaStream_t s) {
            const RotatedSet& set = in[static_cast<std::size_t>(i)];
            cuda::permute_contiguous(
                {fp8_view(i), set.scales, ids},
                {rows_fp8(i), set.row_scales, m_indices, row_src, src_row, offsets, counts}, ws, s);
          },
          sets, stream, timing);
      const double bytes = static_cast<double>(tokens) * (kHidden + fp8_scale_bytes) +
                           static_cast<double>(entries) * (kHidden + fp8_scale_bytes) + maps + 8.0 * m;
      Params p = base;
      p["layout"] = std::string("contiguous");
      p["quant"] = std::string("fp8_group128");
      emit(options, results, copy.attach(make_result("permute", p, us, bytes), bytes));
    }
    {  // masked, fp8
      const double us = time_us(
          [&](int i, cudaStream_t s) {
            const RotatedSet& set = in[static_cast<std::size_t>(i)];
            cuda::permute_masked({fp8_view(i), set.scales, ids},
                                 {set.masked_rows, set.masked_scales, masked_m, mrow_src, src_row}, ws, s);
          },
          sets, stream, timing);
      const double bytes = static_cast<double>(tokens) * (kHidden + fp8_scale_bytes) +
                           static_cast<double>(entries) * (kHidden + fp8_scale_bytes) + maps +
                           4.0 * kExperts * m_max;
      Params p = base;
      p["layout"] = std::string("masked");
      p["quant"] = std::string("fp8_group128");
      emit(options, results, copy.attach(make_result("permute", p, us, bytes), bytes));
    }
    {  // contiguous, bf16
      const double us = time_us(
          [&](int i, cudaStream_t s) {
            const RotatedSet& set = in[static_cast<std::size_t>(i)];
            cuda::permute_contiguous({set.x_bytes, TensorView{}, ids},
                                     {set.rows, TensorView{}, m_indices, row_src, src_row, offsets, counts},
                                     ws, s);
          },
          sets, stream, timing);
      const double bytes = static_cast<double>(tokens + entries) * 2.0 * kHidden + maps + 8.0 * m;
      Params p = base;
      p["layout"] = std::string("contiguous");
      p["quant"] = std::string("bf16");
      emit(options, results, copy.attach(make_result("permute", p, us, bytes), bytes));
    }
  }
  return results;
}

std::vector<Result> run_gather_suite(const SuiteOptions& options) {
  std::vector<Result> results;
  const TimingOptions timing = timing_for(options);
  cuda::Stream stream;
  SameBytesCopy copy(stream, timing);
  for (const std::int64_t tokens : tokens_or_default(options)) {
    const std::int64_t entries = tokens * kTopk;
    const HostTensor ids_host = route(tokens, static_cast<std::uint64_t>(tokens) + 1);
    const cuda::DeviceTensor ids = cuda::to_device(ids_host, stream);
    const std::int64_t m = contiguous_capacity(entries, kExperts);
    const cuda::DeviceTensor ws(
        DType::u8, {static_cast<std::int64_t>(cuda::permute_workspace_bytes(entries, kExperts))});
    const cuda::DeviceTensor x(DType::bf16, {tokens, kHidden}), m_indices(DType::i32, {m}),
        row_src(DType::i32, {m}), src_row(DType::i32, {tokens, kTopk}), offsets(DType::i32, {kExperts + 1}),
        counts(DType::i32, {kExperts});
    fill_random_bf16(x, 99, stream);
    HostTensor w_host(DType::f32, {tokens, kTopk});
    for (std::int64_t i = 0; i < w_host.numel(); ++i)
      w_host.data<float>()[i] = 0.125f + 0.01f * static_cast<float>(i % 7);
    const cuda::DeviceTensor w = cuda::to_device(w_host, stream);
    const double read_bytes = static_cast<double>(entries) * 2.0 * kHidden;
    const double y_bytes = 2.0 * static_cast<double>(tokens) * kHidden;
    const int sets = rotation_sets(static_cast<std::size_t>(read_bytes + y_bytes));
    // Rotated: the permuted rows (contiguous layout) read and the outputs written (as in permute).
    std::vector<cuda::DeviceTensor> expert_rows, ys;
    for (int i = 0; i < sets; ++i) {
      expert_rows.emplace_back(DType::bf16, std::initializer_list<std::int64_t>{m, kHidden});
      fill_random_bf16(expert_rows.back(), static_cast<std::uint64_t>(11 * tokens + i), stream);
      ys.emplace_back(DType::bf16, std::initializer_list<std::int64_t>{tokens, kHidden});
    }
    cuda::permute_contiguous({x, TensorView{}, ids},
                             {expert_rows[0], TensorView{}, m_indices, row_src, src_row, offsets, counts}, ws,
                             stream);
    stream.synchronize();
    const double us = time_us(
        [&](int i, cudaStream_t s) {
          cuda::gather_weighted(expert_rows[static_cast<std::size_t>(i)], src_row, w,
                                ys[static_cast<std::size_t>(i)], s);
        },
        sets, stream, timing);
    const double bytes = read_bytes + 8.0 * entries + y_bytes;
    emit(options, results,
         copy.attach(make_result("gather",
                                 {{"tokens", tokens},
                                  {"layout", std::string("contiguous")},
                                  {"n", kHidden},
                                  {"groups", std::int64_t{kExperts}},
                                  {"m_per_group", entries / kExperts}},
                                 us, bytes),
                     bytes));
  }
  return results;
}

const SuiteRegistration kPermute{"permute", "token-major -> contiguous / masked expert layout (one rank)", 50,
                                 run_permute_suite};
const SuiteRegistration kGather{"gather", "weighted gather of expert rows back to token-major (one rank)", 60,
                                run_gather_suite};

}  // namespace
}  // namespace epmoe::bench
