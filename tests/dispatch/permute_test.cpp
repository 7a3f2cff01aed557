// The CPU expert permutation (contiguous and masked layouts) and the weighted gather
// (epmoe/permute.hpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "epmoe/permute.hpp"
#include "epmoe/quant.hpp"
#include "test_random.hpp"

namespace epmoe {
namespace {

constexpr std::uint8_t kPoison = 0xff;

struct Tokens {
  HostTensor x, scales, ids;
};

// T tokens of width H (fp8 with scales, or bf16) and K distinct ids per token in [0, E), each
// replaced by -1 with probability `skip`. all_to: every id is this expert (K must be 1 then... or
// duplicates allowed) when >= 0.
Tokens make_tokens(std::int64_t tokens, std::int64_t hidden, int topk, int experts, bool fp8, double skip,
                   std::mt19937_64& rng, int all_to = -1) {
  Tokens b;
  HostTensor xf(DType::f32, {tokens, hidden});
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (std::int64_t i = 0; i < xf.numel(); ++i) {
    float v = 0.0f;
    while (v == 0.0f) v = normal(rng);
    xf.data<float>()[i] = v;
  }
  if (fp8) {
    b.x = HostTensor(DType::fp8_e4m3, {tokens, hidden});
    b.scales = HostTensor(DType::f32, {tokens, hidden / 128});
    quantize_per_token_group_fp8(xf, b.x, b.scales);
  } else {
    b.x = to_bf16(xf);
  }
  b.ids = HostTensor(DType::i32, {tokens, topk});
  std::uniform_int_distribution<int> expert(0, experts - 1);
  std::bernoulli_distribution skipped(skip);
  for (std::int64_t t = 0; t < tokens; ++t) {
    std::set<int> used;
    for (int k = 0; k < topk; ++k) {
      int id = all_to;
      if (id < 0) {
        do id = expert(rng);
        while (used.count(id) && static_cast<int>(used.size()) < experts);
        used.insert(id);
      }
      b.ids.data<std::int32_t>()[t * topk + k] = skipped(rng) ? -1 : id;
    }
  }
  return b;
}

struct Contiguous {
  HostTensor rows, scales, m_indices, row_src, src_row, offsets, counts;
  ContiguousLayout layout() const { return {rows, scales, m_indices, row_src, src_row, offsets, counts}; }
};

Contiguous make_contiguous(const Tokens& in, int experts, std::int64_t m) {
  const std::int64_t tokens = in.x.size(0), hidden = in.x.size(1), topk = in.ids.size(1);
  Contiguous c;
  c.rows = HostTensor(in.x.dtype(), {m, hidden});
  c.scales = HostTensor(DType::f32, {m, hidden / 128});
  c.m_indices = HostTensor(DType::i32, {m});
  c.row_src = HostTensor(DType::i32, {m});
  c.src_row = HostTensor(DType::i32, {tokens, topk});
  c.offsets = HostTensor(DType::i32, {experts + 1});
  c.counts = HostTensor(DType::i32, {experts});
  for (HostTensor* t : {&c.rows, &c.scales, &c.m_indices, &c.row_src, &c.src_row, &c.offsets, &c.counts})
    t->fill_bytes(kPoison);
  return c;
}

// Checks a contiguous layout against its definition, from first principles.
void check_contiguous(const Tokens& in, const Contiguous& c, int experts) {
  const std::int64_t tokens = in.x.size(0), hidden = in.x.size(1), topk = in.ids.size(1), m = c.rows.size(0);
  const std::size_t row_bytes = static_cast<std::size_t>(hidden) * dtype_size(in.x.dtype());
  const bool fp8 = in.x.dtype() == DType::fp8_e4m3;
  const std::int32_t* ids = in.ids.data<std::int32_t>();
  const std::int32_t* off = c.offsets.data<std::int32_t>();
  std::int64_t expect_off = 0;
  for (int e = 0; e < experts; ++e) {
    std::vector<std::int32_t> entries;
    for (std::int64_t i = 0; i < tokens * topk; ++i)
      if (ids[i] == e) entries.push_back(static_cast<std::int32_t>(i));
    ASSERT_EQ(off[e], expect_off) << "offset of expert " << e;
    ASSERT_EQ(c.counts.data<std::int32_t>()[e], static_cast<std::int32_t>(entries.size()))
        << "count of expert " << e;
    for (std::size_t j = 0; j < entries.size(); ++j) {
      const std::int64_t row = off[e] + static_cast<std::int64_t>(j), t = entries[j] / topk;
      ASSERT_EQ(c.m_indices.data<std::int32_t>()[row], e);
      ASSERT_EQ(c.row_src.data<std::int32_t>()[row], entries[j]);
      ASSERT_EQ(c.src_row.data<std::int32_t>()[entries[j]], row);
      ASSERT_EQ(std::memcmp(static_cast<const std::byte*>(c.rows.view().data) + row * row_bytes,
                            static_cast<const std::byte*>(in.x.view().data) + t * row_bytes, row_bytes),
                0)
          << "row " << row;
      if (fp8) {
        ASSERT_EQ(std::memcmp(c.scales.data<float>() + row * (hidden / 128),
                              in.scales.data<float>() + t * (hidden / 128),
                              static_cast<std::size_t>(hidden / 128) * 4),
                  0);
      }
    }
    // Padding rows of the block: m_indices and row_src -1, data untouched.
    const std::int64_t end = expect_off + (static_cast<std::int64_t>(entries.size()) + 127) / 128 * 128;
    for (std::int64_t row = off[e] + static_cast<std::int64_t>(entries.size()); row < end; ++row) {
      ASSERT_EQ(c.m_indices.data<std::int32_t>()[row], -1);
      ASSERT_EQ(c.row_src.data<std::int32_t>()[row], -1);
      const auto* bytes = static_cast<const std::uint8_t*>(c.rows.view().data) + row * row_bytes;
      ASSERT_TRUE(std::all_of(bytes, bytes + row_bytes, [](std::uint8_t v) { return v == kPoison; }))
          << "padding row " << row << " written";
    }
    expect_off = end;
  }
  ASSERT_EQ(off[experts], expect_off);
  for (std::int64_t row = expect_off; row < m; ++row) {
    ASSERT_EQ(c.m_indices.data<std::int32_t>()[row], -1);
    ASSERT_EQ(c.row_src.data<std::int32_t>()[row], -1);
  }
  for (std::int64_t i = 0; i < tokens * topk; ++i)
    if (ids[i] < 0) {
      ASSERT_EQ(c.src_row.data<std::int32_t>()[i], -1);
    }
}

// ---------------------------------------------------------------- capacity

TEST(PermuteCpu, ContiguousCapacityIsATightBound) {
  EXPECT_EQ(contiguous_capacity(0, 8), 0);
  EXPECT_EQ(contiguous_capacity(1, 8), 128);
  EXPECT_EQ(contiguous_capacity(5, 8), 5 * 128);         // each entry its own expert
  EXPECT_EQ(contiguous_capacity(1024, 128), 135 * 128);  // 127 experts of 1 entry and one of 897
  EXPECT_EQ(contiguous_capacity(128 * 64, 1), 128 * 64);
  testing::SeededRng rng;
  for (int it = 0; it < 2000; ++it) {
    const int experts = 1 + static_cast<int>(rng() % 40);
    const std::int64_t entries = static_cast<std::int64_t>(rng() % 700);
    std::vector<std::int64_t> c(static_cast<std::size_t>(experts), 0);
    for (std::int64_t i = 0; i < entries; ++i) {
      // skewed: half the entries to expert 0
      c[rng() % 2 ? 0 : rng() % static_cast<std::uint64_t>(experts)] += 1;
    }
    std::int64_t need = 0;
    for (std::int64_t n : c) need += (n + 127) / 128 * 128;
    ASSERT_LE(need, contiguous_capacity(entries, experts));
  }
}

// ---------------------------------------------------------------- contiguous

TEST(PermuteCpu, ContiguousLayoutFp8AndBf16) {
  for (const bool fp8 : {true, false}) {
    testing::SeededRng rng;
    SCOPED_TRACE(fp8 ? "fp8" : "bf16");
    const int experts = 6, topk = 3;
    const std::int64_t tokens = 97, hidden = 256;
    const Tokens in = make_tokens(tokens, hidden, topk, experts, fp8, 0.2, rng);
    const Contiguous c = make_contiguous(in, experts, contiguous_capacity(tokens * topk, experts));
    permute_contiguous_cpu({in.x, in.scales, in.ids}, c.layout());
    check_contiguous(in, c, experts);
  }
}

TEST(PermuteCpu, ContiguousEdgeCases) {
  testing::SeededRng rng;
  const int experts = 4;
  {  // all entries to one expert (duplicates within a token, too: ids need not be distinct)
    const Tokens in = make_tokens(50, 128, 4, experts, true, 0.0, rng, 2);
    const Contiguous c = make_contiguous(in, experts, contiguous_capacity(200, experts));
    permute_contiguous_cpu({in.x, in.scales, in.ids}, c.layout());
    check_contiguous(in, c, experts);
    EXPECT_EQ(c.counts.data<std::int32_t>()[2], 200);
  }
  {  // every entry skipped: all experts empty
    const Tokens in = make_tokens(9, 128, 2, experts, false, 1.0, rng);
    const Contiguous c = make_contiguous(in, experts, 256);
    permute_contiguous_cpu({in.x, in.scales, in.ids}, c.layout());
    check_contiguous(in, c, experts);
    EXPECT_EQ(c.offsets.data<std::int32_t>()[experts], 0);
  }
  {  // T = 0
    const Tokens in = make_tokens(0, 128, 2, experts, true, 0.0, rng);
    const Contiguous c = make_contiguous(in, experts, 0);
    permute_contiguous_cpu({in.x, in.scales, in.ids}, c.layout());
    EXPECT_EQ(c.offsets.data<std::int32_t>()[experts], 0);
  }
  {  // too few rows, bad ids
    Tokens in = make_tokens(10, 128, 2, experts, true, 0.0, rng);
    const Contiguous small = make_contiguous(in, experts, 128);
    EXPECT_THROW(permute_contiguous_cpu({in.x, in.scales, in.ids}, small.layout()), Error);
    const Contiguous c = make_contiguous(in, experts, contiguous_capacity(20, experts));
    in.ids.data<std::int32_t>()[3] = experts;
    EXPECT_THROW(permute_contiguous_cpu({in.x, in.scales, in.ids}, c.layout()), Error);
    in.ids.data<std::int32_t>()[3] = -2;
    EXPECT_THROW(permute_contiguous_cpu({in.x, in.scales, in.ids}, c.layout()), Error);
    in.ids.data<std::int32_t>()[3] = 0;
    Contiguous bad = make_contiguous(in, experts, contiguous_capacity(20, experts));
    bad.counts = HostTensor(DType::i32, {experts + 1});
    EXPECT_THROW(permute_contiguous_cpu({in.x, in.scales, in.ids}, bad.layout()), Error);
    HostTensor x_f32(DType::f32, {10, 128});
    EXPECT_THROW(permute_contiguous_cpu({x_f32, in.scales, in.ids}, c.layout()), Error);
  }
}

// ---------------------------------------------------------------- masked

TEST(PermuteCpu, MaskedLayout) {
  testing::SeededRng rng;
  const int experts = 5, topk = 2;
  const std::int64_t tokens = 40, hidden = 128, m_max = 40;
  const Tokens in = make_tokens(tokens, hidden, topk, experts, true, 0.1, rng);
  HostTensor rows(DType::fp8_e4m3, {experts, m_max, hidden}), scales(DType::f32, {experts, m_max, 1});
  HostTensor masked_m(DType::i32, {experts}), row_src(DType::i32, {experts, m_max}),
      src_row(DType::i32, {tokens, topk});
  for (HostTensor* t : {&rows, &scales, &masked_m, &row_src, &src_row}) t->fill_bytes(kPoison);
  permute_masked_cpu({in.x, in.scales, in.ids}, {rows, scales, masked_m, row_src, src_row});

  const std::int32_t* ids = in.ids.data<std::int32_t>();
  for (int e = 0; e < experts; ++e) {
    std::int64_t m = 0;
    for (std::int64_t i = 0; i < tokens * topk; ++i) {
      if (ids[i] != e) continue;
      const std::int64_t flat = e * m_max + m;
      ASSERT_EQ(row_src.data<std::int32_t>()[flat], i);
      ASSERT_EQ(src_row.data<std::int32_t>()[i], flat);
      ASSERT_EQ(std::memcmp(rows.data<fp8_e4m3>() + flat * hidden,
                            in.x.data<fp8_e4m3>() + (i / topk) * hidden, hidden),
                0);
      ASSERT_EQ(scales.data<float>()[flat], in.scales.data<float>()[i / topk]);
      ++m;
    }
    ASSERT_EQ(masked_m.data<std::int32_t>()[e], m);
    for (; m < m_max; ++m) {
      ASSERT_EQ(row_src.data<std::int32_t>()[e * m_max + m], -1);
      ASSERT_EQ(rows.data<fp8_e4m3>()[(e * m_max + m) * hidden].bits, kPoison) << "unused row written";
    }
  }
  for (std::int64_t i = 0; i < tokens * topk; ++i)
    if (ids[i] < 0) {
      ASSERT_EQ(src_row.data<std::int32_t>()[i], -1);
    }

  // More entries for one expert than M_max: refused.
  const Tokens crowd = make_tokens(41, hidden, 1, experts, true, 0.0, rng, 3);
  HostTensor src1(DType::i32, {41, 1});
  EXPECT_THROW(
      permute_masked_cpu({crowd.x, crowd.scales, crowd.ids}, {rows, scales, masked_m, row_src, src1}), Error);
}

// ---------------------------------------------------------------- gather

TEST(GatherCpu, WeightedSumInKOrder) {
  testing::SeededRng rng;
  const std::int64_t rows = 50, hidden = 256, tokens = 20, topk = 4;
  HostTensor out(DType::bf16, {rows, hidden}), src_row(DType::i32, {tokens, topk}),
      w(DType::f32, {tokens, topk});
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::int64_t i = 0; i < out.numel(); ++i) out.data<bf16>()[i] = bf16::from_float(normal(rng) + 0.01f);
  for (std::int64_t i = 0; i < tokens * topk; ++i) {
    src_row.data<std::int32_t>()[i] = rng() % 5 == 0 ? -1 : static_cast<std::int32_t>(rng() % rows);
    w.data<float>()[i] = std::uniform_real_distribution<float>(0.05f, 1.0f)(rng);
  }
  HostTensor y(DType::bf16, {tokens, hidden});
  y.fill_bytes(kPoison);
  gather_weighted_cpu(out, src_row, w, y);
  for (std::int64_t t = 0; t < tokens; ++t)
    for (std::int64_t h = 0; h < hidden; ++h) {
      float acc = 0.0f;
      double exact = 0.0;
      for (std::int64_t k = 0; k < topk; ++k) {
        const std::int32_t r = src_row.data<std::int32_t>()[t * topk + k];
        if (r < 0) continue;
        const float v = out.data<bf16>()[r * hidden + h].to_float(), wk = w.data<float>()[t * topk + k];
        const float p = wk * v;
        acc = acc + p;
        exact += static_cast<double>(wk) * v;
      }
      const float got = y.data<bf16>()[t * hidden + h].to_float();
      ASSERT_EQ(y.data<bf16>()[t * hidden + h].bits, bf16::from_float(acc).bits) << t << "," << h;
      ASSERT_LE(std::fabs(got - exact), 1e-2 * std::fabs(exact) + 1e-6) << t << "," << h;
    }

  // Masked expert output [E, M_max, H] is read as flat rows; bad rows are refused.
  TensorView out3 = out.view();
  out3.rank = 3;
  out3.shape = {5, 10, hidden, 0};
  out3.stride = {10 * hidden, hidden, 1, 0};
  HostTensor y2(DType::bf16, {tokens, hidden});
  gather_weighted_cpu(out3, src_row, w, y2);
  EXPECT_EQ(std::memcmp(y.data<bf16>(), y2.data<bf16>(), y.nbytes()), 0);
  src_row.data<std::int32_t>()[0] = static_cast<std::int32_t>(rows);
  EXPECT_THROW(gather_weighted_cpu(out, src_row, w, y), Error);
  src_row.data<std::int32_t>()[0] = 0;
  HostTensor w_bad(DType::f32, {tokens, topk + 1});
  EXPECT_THROW(gather_weighted_cpu(out, src_row, w_bad, y), Error);
}

// Permute then gather with weights 1 for one k: the round trip gives the tokens back (bf16).
TEST(GatherCpu, RoundTripThroughContiguous) {
  testing::SeededRng rng;
  const int experts = 3, topk = 2;
  const Tokens in = make_tokens(30, 128, topk, experts, false, 0.0, rng);
  const Contiguous c = make_contiguous(in, experts, contiguous_capacity(60, experts));
  permute_contiguous_cpu({in.x, in.scales, in.ids}, c.layout());
  HostTensor w(DType::f32, {30, topk});
  for (std::int64_t t = 0; t < 30; ++t) {
    w.data<float>()[t * topk] = 1.0f;
    w.data<float>()[t * topk + 1] = 0.0f;
  }
  HostTensor y(DType::bf16, {30, 128});
  gather_weighted_cpu(c.rows, c.src_row, w, y);
  EXPECT_EQ(std::memcmp(y.data<bf16>(), in.x.data<bf16>(), y.nbytes()), 0);
}

// An output that shares memory with an input (written while read) and non-finite weights: refused.
TEST(PermuteCpu, AliasingAndNonFiniteWeightsAreRefused) {
  testing::SeededRng rng;
  const int experts = 4;
  const Tokens in = make_tokens(10, 128, 2, experts, false, 0.0, rng);
  Contiguous c = make_contiguous(in, experts, contiguous_capacity(20, experts));
  ContiguousLayout aliased = c.layout();
  HostTensor big(DType::bf16, {c.rows.size(0) + 10, 128});
  aliased.rows = big.view().slice_rows(0, c.rows.size(0));
  const PermuteInput overlapping{big.view().slice_rows(0, 10), TensorView{}, in.ids};
  EXPECT_THROW(permute_contiguous_cpu(overlapping, aliased), Error);
  EXPECT_NO_THROW(permute_contiguous_cpu({in.x, in.scales, in.ids}, c.layout()));

  HostTensor expert_out(DType::bf16, {c.rows.size(0), 128}), w(DType::f32, {10, 2}),
      y(DType::bf16, {10, 128});
  expert_out.fill_bytes(0);
  for (int i = 0; i < 20; ++i) w.data<float>()[i] = 0.5f;
  EXPECT_NO_THROW(gather_weighted_cpu(expert_out, c.src_row, w, y));
  EXPECT_THROW(gather_weighted_cpu(expert_out, c.src_row, w, expert_out.view().slice_rows(0, 10)), Error);
  w.data<float>()[3] = std::nanf("");
  EXPECT_THROW(gather_weighted_cpu(expert_out, c.src_row, w, y), Error);
}

}  // namespace
}  // namespace epmoe
