// GPU expert permutation and weighted gather against the CPU reference (epmoe/permute.hpp): the
// permutation byte for byte over the whole output buffers (both sides start from the same poison,
// so unwritten elements must match too), the gather bit for bit and within 1e-2 of f64, fresh
// random inputs per run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/permute.hpp"
#include "epmoe/permute.hpp"
#include "gpu_test_util.hpp"
#include "test_random.hpp"

namespace epmoe {
namespace {

using cuda::ScaleLayout;
using testing::bits_equal;
using testing::expect_error_mentions;

constexpr std::uint8_t kPoison = 0xff;

std::string hex(std::uint32_t v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

// How the ids are drawn.
enum class Routing { random, skip_some, one_expert, none };

struct Tokens {
  HostTensor x, scales, ids;
};

// Random tokens: fp8 bytes that are never NaN (or bf16 values never zero), positive random scales,
// and K ids per token (distinct when routing = random / skip_some).
Tokens make_tokens(std::int64_t tokens, std::int64_t hidden, int topk, int experts, bool fp8, Routing routing,
                   std::mt19937_64& rng) {
  Tokens b;
  if (fp8) {
    b.x = HostTensor(DType::fp8_e4m3, {tokens, hidden});
    auto* p = reinterpret_cast<std::uint8_t*>(b.x.data<fp8_e4m3>());
    for (std::int64_t i = 0; i < b.x.numel(); ++i) {
      std::uint8_t v = 0;
      while ((v & 0x7f) == 0x7f || v == 0) v = static_cast<std::uint8_t>(rng());
      p[i] = v;
    }
    b.scales = HostTensor(DType::f32, {tokens, hidden / 128});
    for (std::int64_t i = 0; i < b.scales.numel(); ++i)
      b.scales.data<float>()[i] = std::uniform_real_distribution<float>(1e-4f, 10.0f)(rng);
  } else {
    b.x = HostTensor(DType::bf16, {tokens, hidden});
    std::normal_distribution<float> normal(0.0f, 3.0f);
    for (std::int64_t i = 0; i < b.x.numel(); ++i) {
      float v = 0.0f;
      while (v == 0.0f) v = bf16::from_float(normal(rng)).to_float();
      b.x.data<bf16>()[i] = bf16::from_float(v);
    }
  }
  b.ids = HostTensor(DType::i32, {tokens, topk});
  std::int32_t* ids = b.ids.data<std::int32_t>();
  const int favourite = static_cast<int>(rng() % static_cast<std::uint64_t>(experts));
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::set<int> used;
    for (int k = 0; k < topk; ++k) {
      int id = -1;
      if (routing == Routing::one_expert) {
        id = favourite;
      } else if (routing != Routing::none) {
        do id = static_cast<int>(rng() % static_cast<std::uint64_t>(experts));
        while (used.count(id) && static_cast<int>(used.size()) < experts);
        used.insert(id);
        if (routing == Routing::skip_some && rng() % 3 == 0) id = -1;
      }
      ids[t * topk + k] = id;
    }
  }
  return b;
}

template <class T>
void expect_same(const HostTensor& got, const HostTensor& want, const std::string& what) {
  ASSERT_EQ(got.nbytes(), want.nbytes()) << what;
  const auto* g = static_cast<const T*>(got.view().data);
  const auto* w = static_cast<const T*>(want.view().data);
  EXPECT_TRUE(bits_equal(g, w, static_cast<std::int64_t>(got.nbytes() / sizeof(T)), [&](std::int64_t i) {
    std::uint32_t gv = 0, wv = 0;
    std::memcpy(&gv, &g[i], sizeof(T));
    std::memcpy(&wv, &w[i], sizeof(T));
    return what + "[" + std::to_string(i) + "]: got " + hex(gv) + ", want " + hex(wv);
  }));
}

// A host tensor and its device twin, both poisoned.
struct Pair {
  HostTensor host;
  cuda::DeviceTensor device;
  Pair(DType dtype, std::initializer_list<std::int64_t> shape, cudaStream_t stream)
      : host(dtype, shape), device(dtype, shape) {
    host.fill_bytes(kPoison);
    device.fill_bytes(kPoison, stream);
  }
  HostTensor fetch(cudaStream_t stream) const { return cuda::to_host(device, stream); }
};

// Token-major [rows, G] CPU scales as the GPU's MN-major [G, pad(rows)] (per expert block of
// `block_rows` rows when experts > 0); TMA padding is 0.
HostTensor to_mn_major(const HostTensor& s, std::int64_t experts, std::int64_t block_rows,
                       std::int64_t groups) {
  const std::int64_t blocks = std::max<std::int64_t>(experts, 1);
  const std::int64_t padded = cuda::tma_aligned_tokens(block_rows);
  HostTensor out(DType::f32, {blocks, groups, padded});
  for (std::int64_t e = 0; e < blocks; ++e)
    for (std::int64_t g = 0; g < groups; ++g)
      for (std::int64_t r = 0; r < padded; ++r)
        out.data<float>()[(e * groups + g) * padded + r] =
            r < block_rows ? s.data<float>()[(e * block_rows + r) * groups + g] : 0.0f;
  return out;
}

// ---------------------------------------------------------------- contiguous

// T, H, K, E, fp8, routing
using PermuteCase = std::tuple<std::int64_t, std::int64_t, int, int, bool, Routing>;

std::string case_name(const PermuteCase& c) {
  static const char* routings[] = {"random", "skip", "one", "none"};
  return std::string("T") + std::to_string(std::get<0>(c)) + "_H" + std::to_string(std::get<1>(c)) + "_K" +
         std::to_string(std::get<2>(c)) + "_E" + std::to_string(std::get<3>(c)) +
         (std::get<4>(c) ? "_fp8_" : "_bf16_") + routings[static_cast<int>(std::get<5>(c))];
}

void run_contiguous(const PermuteCase& c, ScaleLayout layout) {
  const auto [tokens, hidden, topk, experts, fp8, routing] = c;
  testing::SeededRng rng;
  SCOPED_TRACE("scales " + std::string(cuda::to_string(layout)));
  const Tokens in = make_tokens(tokens, hidden, topk, experts, fp8, routing, rng);
  const std::int64_t m = contiguous_capacity(tokens * topk, experts), groups = hidden / 128;

  cuda::Stream stream;
  Pair rows(in.x.dtype(), {m, hidden}, stream), scales(DType::f32, {m, groups}, stream);
  Pair m_indices(DType::i32, {m}, stream), row_src(DType::i32, {m}, stream);
  Pair src_row(DType::i32, {tokens, topk}, stream), offsets(DType::i32, {experts + 1}, stream);
  Pair counts(DType::i32, {experts}, stream);
  const cuda::DeviceTensor scales_mn(DType::f32, {groups, cuda::tma_aligned_tokens(m)});
  scales_mn.fill_bytes(kPoison, stream);
  const cuda::DeviceTensor ws(
      DType::u8, {static_cast<std::int64_t>(cuda::permute_workspace_bytes(tokens * topk, experts))});
  ws.fill_bytes(kPoison, stream);  // the workspace needs no initialisation

  permute_contiguous_cpu({in.x, in.scales, in.ids}, {rows.host, scales.host, m_indices.host, row_src.host,
                                                     src_row.host, offsets.host, counts.host});
  const cuda::DeviceTensor dx = cuda::to_device(in.x, stream);
  const cuda::DeviceTensor ds = fp8 ? cuda::to_device(in.scales, stream) : cuda::DeviceTensor();
  const cuda::DeviceTensor dids = cuda::to_device(in.ids, stream);
  const TensorView out_scales = layout == ScaleLayout::token_major ? scales.device.view() : scales_mn.view();
  cuda::permute_contiguous({dx, ds, dids},
                           {rows.device, out_scales, m_indices.device, row_src.device, src_row.device,
                            offsets.device, counts.device},
                           ws, stream, layout);

  expect_same<std::uint8_t>(rows.fetch(stream), rows.host, "rows");
  expect_same<std::int32_t>(m_indices.fetch(stream), m_indices.host, "m_indices");
  expect_same<std::int32_t>(row_src.fetch(stream), row_src.host, "row_src");
  expect_same<std::int32_t>(src_row.fetch(stream), src_row.host, "src_row");
  expect_same<std::int32_t>(offsets.fetch(stream), offsets.host, "expert_offsets");
  expect_same<std::int32_t>(counts.fetch(stream), counts.host, "counts");
  if (fp8) {
    if (layout == ScaleLayout::token_major) {
      expect_same<std::uint32_t>(scales.fetch(stream), scales.host, "scales");
    } else {
      expect_same<std::uint32_t>(cuda::to_host(scales_mn, stream), to_mn_major(scales.host, 0, m, groups),
                                 "scales (mn)");
    }
  }
}

class PermuteGpuContiguous : public ::testing::TestWithParam<PermuteCase> {};

TEST_P(PermuteGpuContiguous, ByteExactWithCpu) {
  EPMOE_REQUIRE_GPU();
  run_contiguous(GetParam(), ScaleLayout::token_major);
  if (std::get<4>(GetParam())) run_contiguous(GetParam(), ScaleLayout::mn_major_tma);
}

const auto kCases = ::testing::Values(
    PermuteCase{1, 7168, 8, 128, true, Routing::random}, PermuteCase{3, 7168, 8, 128, true, Routing::random},
    PermuteCase{128, 7168, 8, 128, true, Routing::skip_some},
    PermuteCase{4096, 7168, 8, 128, true, Routing::random},
    PermuteCase{4096, 7168, 8, 32, false, Routing::skip_some},
    PermuteCase{128, 7168, 8, 256, false, Routing::random},
    PermuteCase{300, 256, 4, 5, true, Routing::one_expert},
    PermuteCase{2100, 128, 8, 3, true, Routing::skip_some}, PermuteCase{37, 384, 3, 7, false, Routing::none},
    PermuteCase{0, 256, 2, 4, true, Routing::random}, PermuteCase{50, 128, 32, 1024, true, Routing::random},
    PermuteCase{9, 128, 1, 1, false, Routing::random},
    // Many chunks: the fused scan + rank with E > 256 experts, and the separate scan (> 256 chunks).
    PermuteCase{2000, 128, 16, 1000, true, Routing::random},
    PermuteCase{40000, 128, 8, 16, false, Routing::skip_some});

INSTANTIATE_TEST_SUITE_P(Shapes, PermuteGpuContiguous, kCases,
                         [](const ::testing::TestParamInfo<PermuteCase>& info) {
                           return case_name(info.param);
                         });

// ---------------------------------------------------------------- masked

void run_masked(const PermuteCase& c, ScaleLayout layout, bool overflow) {
  const auto [tokens, hidden, topk, experts, fp8, routing] = c;
  testing::SeededRng rng;
  SCOPED_TRACE("scales " + std::string(cuda::to_string(layout)) + (overflow ? " overflow" : ""));
  const Tokens in = make_tokens(tokens, hidden, topk, experts, fp8, routing, rng);
  std::vector<std::int64_t> per_expert(static_cast<std::size_t>(experts), 0);
  for (std::int64_t i = 0; i < tokens * topk; ++i)
    if (in.ids.data<std::int32_t>()[i] >= 0)
      per_expert[static_cast<std::size_t>(in.ids.data<std::int32_t>()[i])] += 1;
  const std::int64_t most = *std::max_element(per_expert.begin(), per_expert.end());
  // The CPU needs room for every entry; the GPU gets m_max (fewer rows when testing overflow).
  const std::int64_t m_cpu = std::max<std::int64_t>(most, 1) + static_cast<std::int64_t>(rng() % 5);
  const std::int64_t m_max = overflow ? std::max<std::int64_t>(most / 2, 1) : m_cpu;
  const std::int64_t groups = hidden / 128;

  cuda::Stream stream;
  HostTensor rows_ref(in.x.dtype(), {experts, m_cpu, hidden}),
      scales_ref(DType::f32, {experts, m_cpu, groups});
  HostTensor mm_ref(DType::i32, {experts}), row_src_ref(DType::i32, {experts, m_cpu}),
      src_row_ref(DType::i32, {tokens, topk});
  for (HostTensor* t : {&rows_ref, &scales_ref, &mm_ref, &row_src_ref, &src_row_ref}) t->fill_bytes(kPoison);
  permute_masked_cpu({in.x, in.scales, in.ids}, {rows_ref, scales_ref, mm_ref, row_src_ref, src_row_ref});

  const cuda::DeviceTensor rows(in.x.dtype(), {experts, m_max, hidden});
  const cuda::DeviceTensor scales =
      layout == ScaleLayout::token_major
          ? cuda::DeviceTensor(DType::f32, {experts, m_max, groups})
          : cuda::DeviceTensor(DType::f32, {experts, groups, cuda::tma_aligned_tokens(m_max)});
  const cuda::DeviceTensor mm(DType::i32, {experts}), row_src(DType::i32, {experts, m_max}),
      src_row(DType::i32, {tokens, topk});
  for (const cuda::DeviceTensor* t : {&rows, &scales, &mm, &row_src, &src_row})
    t->fill_bytes(kPoison, stream);
  const cuda::DeviceTensor ws(
      DType::u8, {static_cast<std::int64_t>(cuda::permute_workspace_bytes(tokens * topk, experts))});
  const cuda::DeviceTensor dx = cuda::to_device(in.x, stream);
  const cuda::DeviceTensor ds = fp8 ? cuda::to_device(in.scales, stream) : cuda::DeviceTensor();
  const cuda::DeviceTensor dids = cuda::to_device(in.ids, stream);
  cuda::permute_masked({dx, ds, dids}, {rows, scales, mm, row_src, src_row}, ws, stream, layout);

  // The reference cut to the GPU's M_max: the first M_max entries of each expert stay.
  const std::size_t row_bytes = static_cast<std::size_t>(hidden) * dtype_size(in.x.dtype());
  HostTensor rows_want(in.x.dtype(), {experts, m_max, hidden}),
      scales_want(DType::f32, {experts, m_max, groups});
  HostTensor mm_want(DType::i32, {experts}), row_src_want(DType::i32, {experts, m_max}),
      src_row_want(DType::i32, {tokens, topk});
  for (std::int64_t e = 0; e < experts; ++e) {
    mm_want.data<std::int32_t>()[e] =
        static_cast<std::int32_t>(std::min<std::int64_t>(mm_ref.data<std::int32_t>()[e], m_max));
    for (std::int64_t mrow = 0; mrow < m_max; ++mrow) {
      const std::int64_t from = e * m_cpu + mrow, to = e * m_max + mrow;
      std::memcpy(static_cast<std::byte*>(rows_want.view().data) + to * row_bytes,
                  static_cast<const std::byte*>(rows_ref.view().data) + from * row_bytes, row_bytes);
      std::memcpy(scales_want.data<float>() + to * groups, scales_ref.data<float>() + from * groups,
                  static_cast<std::size_t>(groups) * 4);
      row_src_want.data<std::int32_t>()[to] = row_src_ref.data<std::int32_t>()[from];
    }
  }
  for (std::int64_t i = 0; i < tokens * topk; ++i) {
    const std::int32_t flat = src_row_ref.data<std::int32_t>()[i];
    const std::int64_t e = flat / m_cpu, mrow = flat % m_cpu;
    src_row_want.data<std::int32_t>()[i] =
        flat < 0 || mrow >= m_max ? -1 : static_cast<std::int32_t>(e * m_max + mrow);
  }

  expect_same<std::uint8_t>(cuda::to_host(rows, stream), rows_want, "rows");
  expect_same<std::int32_t>(cuda::to_host(mm, stream), mm_want, "masked_m");
  expect_same<std::int32_t>(cuda::to_host(row_src, stream), row_src_want, "row_src");
  expect_same<std::int32_t>(cuda::to_host(src_row, stream), src_row_want, "src_row");
  if (fp8) {
    const HostTensor got = cuda::to_host(scales, stream);
    if (layout == ScaleLayout::token_major) {
      expect_same<std::uint32_t>(got, scales_want, "scales");
    } else {
      expect_same<std::uint32_t>(got, to_mn_major(scales_want, experts, m_max, groups), "scales (mn)");
    }
  }
}

class PermuteGpuMasked : public ::testing::TestWithParam<PermuteCase> {};

TEST_P(PermuteGpuMasked, ByteExactWithCpu) {
  EPMOE_REQUIRE_GPU();
  run_masked(GetParam(), ScaleLayout::token_major, false);
  if (std::get<4>(GetParam())) run_masked(GetParam(), ScaleLayout::mn_major_tma, false);
}

INSTANTIATE_TEST_SUITE_P(Shapes, PermuteGpuMasked, kCases,
                         [](const ::testing::TestParamInfo<PermuteCase>& info) {
                           return case_name(info.param);
                         });

// An expert with more entries than M_max keeps its first M_max.
TEST(PermuteGpuMaskedMisc, OverflowKeepsTheFirstRows) {
  EPMOE_REQUIRE_GPU();
  run_masked({200, 256, 4, 3, true, Routing::random}, ScaleLayout::token_major, true);
  run_masked({100, 128, 2, 1, false, Routing::one_expert}, ScaleLayout::token_major, true);
}

// ---------------------------------------------------------------- gather

// T, H, K, rows R
using GatherCase = std::tuple<std::int64_t, std::int64_t, int, std::int64_t>;
class GatherGpu : public ::testing::TestWithParam<GatherCase> {};

TEST_P(GatherGpu, BitExactWithCpu) {
  EPMOE_REQUIRE_GPU();
  const auto [tokens, hidden, topk, rows] = GetParam();
  testing::SeededRng rng;
  HostTensor out(DType::bf16, {rows, hidden}), src_row(DType::i32, {tokens, topk}),
      w(DType::f32, {tokens, topk});
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-4, 4);
  for (std::int64_t r = 0; r < rows; ++r) {
    const float scale = std::ldexp(1.0f, exponent(rng));
    for (std::int64_t h = 0; h < hidden; ++h) {
      float v = 0.0f;
      while (v == 0.0f) v = bf16::from_float(normal(rng) * scale).to_float();
      out.data<bf16>()[r * hidden + h] = bf16::from_float(v);
    }
  }
  // A permutation-like map: distinct rows per token, some entries skipped (-1).
  for (std::int64_t i = 0; i < tokens * topk; ++i) {
    src_row.data<std::int32_t>()[i] =
        rng() % 6 == 0 ? -1 : static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(rows));
    w.data<float>()[i] = std::uniform_real_distribution<float>(0.01f, 2.5f)(rng);
  }
  HostTensor y_ref(DType::bf16, {tokens, hidden});
  gather_weighted_cpu(out, src_row, w, y_ref);

  cuda::Stream stream;
  const cuda::DeviceTensor dout = cuda::to_device(out, stream), dsrc = cuda::to_device(src_row, stream),
                           dw = cuda::to_device(w, stream);
  const cuda::DeviceTensor dy(DType::bf16, {tokens, hidden});
  dy.fill_bytes(kPoison, stream);  // bf16 0xffff is NaN
  cuda::gather_weighted(dout, dsrc, dw, dy, stream);
  const HostTensor y = cuda::to_host(dy, stream);

  // Within 1e-2 of f64 (relative, over the whole output), NaN never passes; then bit for bit.
  double err2 = 0.0, ref2 = 0.0;
  std::int64_t non_finite = 0;
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t h = 0; h < hidden; ++h) {
      double exact = 0.0;
      for (int k = 0; k < topk; ++k) {
        const std::int32_t r = src_row.data<std::int32_t>()[t * topk + k];
        if (r >= 0)
          exact += static_cast<double>(w.data<float>()[t * topk + k]) *
                   out.data<bf16>()[r * hidden + h].to_float();
      }
      const double got = y.data<bf16>()[t * hidden + h].to_float();
      if (!std::isfinite(got)) ++non_finite;
      err2 += (got - exact) * (got - exact);
      ref2 += exact * exact;
    }
  EXPECT_EQ(non_finite, 0);
  EXPECT_LE(std::sqrt(err2 / std::max(ref2, 1e-300)), 1e-2);
  expect_same<std::uint16_t>(y, y_ref, "y");
}

INSTANTIATE_TEST_SUITE_P(Shapes, GatherGpu,
                         ::testing::Values(GatherCase{1, 7168, 8, 64}, GatherCase{3, 7168, 8, 64},
                                           GatherCase{128, 7168, 8, 2048}, GatherCase{4096, 7168, 8, 40000},
                                           GatherCase{33, 136, 3, 10}, GatherCase{7, 2048, 32, 300},
                                           GatherCase{5, 8, 1, 5}),
                         [](const ::testing::TestParamInfo<GatherCase>& info) {
                           return std::string("T") + std::to_string(std::get<0>(info.param)) + "_H" +
                                  std::to_string(std::get<1>(info.param)) + "_K" +
                                  std::to_string(std::get<2>(info.param)) + "_R" +
                                  std::to_string(std::get<3>(info.param));
                         });

// Permute on the GPU, then gather the permuted rows back with one-hot weights: the tokens return.
TEST(GatherGpuMisc, RoundTripThroughPermute) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  const std::int64_t tokens = 257, hidden = 7168;
  const int topk = 8, experts = 64;
  const Tokens in = make_tokens(tokens, hidden, topk, experts, false, Routing::random, rng);
  const std::int64_t m = contiguous_capacity(tokens * topk, experts);
  cuda::Stream stream;
  const cuda::DeviceTensor rows(DType::bf16, {m, hidden}), m_indices(DType::i32, {m}),
      row_src(DType::i32, {m}), src_row(DType::i32, {tokens, topk}), offsets(DType::i32, {experts + 1}),
      counts(DType::i32, {experts});
  const cuda::DeviceTensor ws(
      DType::u8, {static_cast<std::int64_t>(cuda::permute_workspace_bytes(tokens * topk, experts))});
  const cuda::DeviceTensor dx = cuda::to_device(in.x, stream), dids = cuda::to_device(in.ids, stream);
  rows.fill_bytes(kPoison, stream);
  cuda::permute_contiguous({dx, TensorView{}, dids},
                           {rows, TensorView{}, m_indices, row_src, src_row, offsets, counts}, ws, stream);
  HostTensor w(DType::f32, {tokens, topk});
  for (std::int64_t t = 0; t < tokens; ++t)
    w.data<float>()[t * topk + static_cast<std::int64_t>(rng() % topk)] = 1.0f;
  const cuda::DeviceTensor dw = cuda::to_device(w, stream);
  const cuda::DeviceTensor y(DType::bf16, {tokens, hidden});
  y.fill_bytes(kPoison, stream);
  cuda::gather_weighted(rows, src_row, dw, y, stream);
  expect_same<std::uint16_t>(cuda::to_host(y, stream), in.x, "round trip");
}

// ---------------------------------------------------------------- arguments

TEST(PermuteGpuMisc, RefusesBadArguments) {
  EPMOE_REQUIRE_GPU();
  cuda::Stream stream;
  const std::int64_t tokens = 4, hidden = 256, experts = 3;
  const int topk = 2;
  const cuda::DeviceTensor x(DType::fp8_e4m3, {tokens, hidden}), xs(DType::f32, {tokens, 2}),
      ids(DType::i32, {tokens, topk});
  x.fill_bytes(0x3c, stream);
  xs.fill_bytes(0x3c, stream);
  ids.fill_bytes(0, stream);
  const std::int64_t m = contiguous_capacity(tokens * topk, experts);
  const cuda::DeviceTensor rows(DType::fp8_e4m3, {m, hidden}), scales(DType::f32, {m, 2}),
      mi(DType::i32, {m}), rs(DType::i32, {m}), sr(DType::i32, {tokens, topk}),
      off(DType::i32, {experts + 1}), cnt(DType::i32, {experts});
  const cuda::DeviceTensor ws(
      DType::u8, {static_cast<std::int64_t>(cuda::permute_workspace_bytes(tokens * topk, experts))});
  const ContiguousLayout good{rows, scales, mi, rs, sr, off, cnt};
  EXPECT_NO_THROW(cuda::permute_contiguous({x, xs, ids}, good, ws, stream));

  const cuda::DeviceTensor x_f32(DType::f32, {tokens, hidden});
  expect_error_mentions(
      [&] {
        cuda::permute_contiguous({x_f32, xs, ids}, good, ws, stream);
      },
      "x must have dtype fp8_e4m3 or bf16");
  const cuda::DeviceTensor xs_bad(DType::f32, {tokens, 3});
  expect_error_mentions(
      [&] {
        cuda::permute_contiguous({x, xs_bad, ids}, good, ws, stream);
      },
      "x_scales must have shape");
  const cuda::DeviceTensor ids_wide(DType::i32, {tokens, 33});
  expect_error_mentions(
      [&] {
        cuda::permute_contiguous({x, xs, ids_wide}, good, ws, stream);
      },
      "must lie in [1, 32]");
  const cuda::DeviceTensor rows_small(DType::fp8_e4m3, {m - 128, hidden});
  expect_error_mentions(
      [&] {
        cuda::permute_contiguous({x, xs, ids}, {rows_small, scales, mi, rs, sr, off, cnt}, ws, stream);
      },
      "contiguous_capacity");
  const cuda::DeviceTensor rows_bf16(DType::bf16, {m, hidden});
  expect_error_mentions(
      [&] {
        cuda::permute_contiguous({x, xs, ids}, {rows_bf16, scales, mi, rs, sr, off, cnt}, ws, stream);
      },
      "rows must have dtype fp8_e4m3");
  const cuda::DeviceTensor ws_small(DType::u8, {0});
  expect_error_mentions(
      [&] {
        cuda::permute_contiguous({x, xs, ids}, good, ws_small, stream);
      },
      "workspace must hold at least");
  expect_error_mentions(
      [&] {
        cuda::permute_contiguous({x, xs, ids}, good, ws, stream, ScaleLayout::mn_major_tma);
      },
      "scales (mn_major_tma) must have shape");
  const HostTensor ids_host(DType::i32, {tokens, topk});
  expect_error_mentions(
      [&] {
        cuda::permute_contiguous({x, xs, ids_host}, good, ws, stream);
      },
      "topk_ids must live on cuda");
  const cuda::DeviceTensor off_many(DType::i32, {1026}), cnt_many(DType::i32, {1025});
  expect_error_mentions(
      [&] {
        cuda::permute_contiguous({x, xs, ids}, {rows, scales, mi, rs, sr, off_many, cnt_many}, ws, stream);
      },
      "must lie in [1, 1024]");

  // Masked.
  const std::int64_t m_max = 5;
  const cuda::DeviceTensor mrows(DType::fp8_e4m3, {experts, m_max, hidden}),
      mscales(DType::f32, {experts, m_max, 2}), mm(DType::i32, {experts}), mrs(DType::i32, {experts, m_max});
  const MaskedLayout mgood{mrows, mscales, mm, mrs, sr};
  EXPECT_NO_THROW(cuda::permute_masked({x, xs, ids}, mgood, ws, stream));
  const cuda::DeviceTensor mrs_bad(DType::i32, {experts * m_max});
  expect_error_mentions(
      [&] {
        cuda::permute_masked({x, xs, ids}, {mrows, mscales, mm, mrs_bad, sr}, ws, stream);
      },
      "row_src must have shape");
  const cuda::DeviceTensor mm_bad(DType::i32, {experts + 1});
  expect_error_mentions(
      [&] {
        cuda::permute_masked({x, xs, ids}, {mrows, mscales, mm_bad, mrs, sr}, ws, stream);
      },
      "rows must have shape");

  // Gather.
  const cuda::DeviceTensor out(DType::bf16, {10, hidden}), w(DType::f32, {tokens, topk}),
      y(DType::bf16, {tokens, hidden});
  out.fill_bytes(0x3c, stream);
  w.fill_bytes(0x3c, stream);
  sr.fill_bytes(0, stream);
  EXPECT_NO_THROW(cuda::gather_weighted(out, sr, w, y, stream));
  const cuda::DeviceTensor w_bad(DType::f32, {tokens, topk + 1});
  expect_error_mentions([&] { cuda::gather_weighted(out, sr, w_bad, y, stream); },
                        "topk_weights must have shape");
  const cuda::DeviceTensor y_bad(DType::bf16, {tokens, hidden + 8});
  expect_error_mentions([&] { cuda::gather_weighted(out, sr, w, y_bad, stream); }, "y must have shape");
  const cuda::DeviceTensor out_f32(DType::f32, {10, hidden});
  expect_error_mentions([&] { cuda::gather_weighted(out_f32, sr, w, y, stream); },
                        "expert_out must have dtype bf16");
  stream.synchronize();
}

}  // namespace
}  // namespace epmoe
