// GPU FP8 quantizers against their CPU definitions (epmoe/quant.hpp), bit for bit: every byte
// of q, every bit of every scale, outputs poisoned before each run, fresh random inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <tuple>

#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/quant.hpp"
#include "epmoe/quant.hpp"
#include "gpu_test_util.hpp"
#include "test_random.hpp"

namespace epmoe::cuda {
// gtest prints parameters with this (found by ADL).
inline void PrintTo(ScaleLayout layout, std::ostream* os) {
  *os << to_string(layout);
}
}  // namespace epmoe::cuda

namespace epmoe {
namespace {

using cuda::ScaleLayout;
using testing::bits_equal;
using testing::expect_error_mentions;

constexpr std::uint8_t kPoison = 0xff;  // fp8 0xff is NaN, f32 0xffffffff is NaN: never a valid output

std::string hex32(std::uint32_t v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}
std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Random bf16 activations [T, K], never all zero. Rows cycle through kinds that stress the
// quantizer: plain N(0, 1) rows at random magnitudes (so that q covers e4m3 subnormals too),
// large-magnitude rows, a row with one huge value, rows whose groups are exactly zero in places,
// rows below kMinAmax (the clamp), and rows with scattered exact zeros.
HostTensor random_activations(std::int64_t tokens, std::int64_t k, std::mt19937_64& rng) {
  HostTensor x(DType::bf16, {tokens, k});
  bf16* p = x.data<bf16>();
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-20, 20);
  std::uniform_int_distribution<std::int64_t> column(0, k - 1);
  std::uniform_int_distribution<int> coin(0, 3);
  auto nonzero = [&](float scale) {
    for (;;) {
      const bf16 v = bf16::from_float(normal(rng) * scale);
      if (v.to_float() != 0.0f) return v;
    }
  };
  for (std::int64_t t = 0; t < tokens; ++t) {
    bf16* row = p + t * k;
    const int kind = static_cast<int>(t % 7);
    const float magnitude = std::ldexp(1.0f, exponent(rng));
    switch (kind) {
      case 1:  // large magnitude
        for (std::int64_t j = 0; j < k; ++j) row[j] = nonzero(1e30f);
        break;
      case 2:  // one huge value among ordinary ones
        for (std::int64_t j = 0; j < k; ++j) row[j] = nonzero(1.0f);
        row[column(rng)] = bf16::from_float(-3.0e38f);
        break;
      case 3:  // exact-zero groups (some of them; group 0 always, when K > 128 group 1 never)
        for (std::int64_t j = 0; j < k; ++j) row[j] = nonzero(magnitude);
        for (std::int64_t g = 0; g < k / 128; ++g) {
          if (g == 0 || (g != 1 && coin(rng) == 0)) {
            for (std::int64_t j = g * 128; j < (g + 1) * 128; ++j) row[j] = bf16::from_float(0.0f);
          }
        }
        break;
      case 4:  // amax < kMinAmax: the clamped scale
        for (std::int64_t j = 0; j < k; ++j) row[j] = nonzero(1e-12f);
        break;
      case 5:  // scattered exact zeros and negative zeros
        for (std::int64_t j = 0; j < k; ++j) {
          const int c = coin(rng);
          row[j] = c == 0 ? bf16::from_float(0.0f) : c == 1 ? bf16::from_bits(0x8000) : nonzero(magnitude);
        }
        break;
      default:
        for (std::int64_t j = 0; j < k; ++j) row[j] = nonzero(magnitude);
        break;
    }
  }
  return x;
}

// Random bf16 [rows, cols] ~ N(0, magnitude^2) with about 1% exact zeros (never all zero: the
// first element is not).
HostTensor random_plain(std::int64_t rows, std::int64_t cols, float magnitude, std::mt19937_64& rng) {
  HostTensor x(DType::bf16, {rows, cols});
  bf16* p = x.data<bf16>();
  std::normal_distribution<float> normal(0.0f, magnitude);
  std::uniform_int_distribution<int> percent(0, 99);
  for (std::int64_t i = 0; i < rows * cols; ++i) {
    float v = 0.0f;
    while (v == 0.0f) v = bf16::from_float(normal(rng)).to_float();
    p[i] = i > 0 && percent(rng) == 0 ? bf16::from_float(0.0f) : bf16::from_float(v);
  }
  return x;
}

// ---------------------------------------------------------------- per-token-group
using GroupCase = std::tuple<std::int64_t, std::int64_t, ScaleLayout, bool>;  // T, K, layout, pow2

class QuantPerTokenGroupGpu : public ::testing::TestWithParam<GroupCase> {};

TEST_P(QuantPerTokenGroupGpu, BitExactWithCpu) {
  EPMOE_REQUIRE_GPU();
  const auto [tokens, k, layout, pow2] = GetParam();
  testing::SeededRng rng;
  const std::int64_t groups = k / 128;
  const std::int64_t tokens_padded = cuda::tma_aligned_tokens(tokens);

  const HostTensor x = random_activations(tokens, k, rng);
  HostTensor q_ref(DType::fp8_e4m3, {tokens, k});
  HostTensor s_ref(DType::f32, {tokens, groups});
  quantize_per_token_group_fp8(x, q_ref, s_ref, 128, pow2);

  cuda::Stream stream;
  const cuda::DeviceTensor dx = cuda::to_device(x, stream);
  const cuda::DeviceTensor dq(DType::fp8_e4m3, {tokens, k});
  const cuda::DeviceTensor ds = layout == ScaleLayout::token_major
                                    ? cuda::DeviceTensor(DType::f32, {tokens, groups})
                                    : cuda::DeviceTensor(DType::f32, {groups, tokens_padded});
  dq.fill_bytes(kPoison, stream);
  ds.fill_bytes(kPoison, stream);
  cuda::quantize_per_token_group_fp8(dx, dq, ds, stream, layout, pow2);
  const HostTensor q = cuda::to_host(dq, stream);
  const HostTensor s = cuda::to_host(ds, stream);

  const bf16* xs = x.data<bf16>();
  const float* sr = s_ref.data<float>();
  const auto* qg = q.data<fp8_e4m3>();
  const auto* qr = q_ref.data<fp8_e4m3>();
  EXPECT_TRUE(bits_equal(qg, qr, tokens * k, [&](std::int64_t i) {
    const std::int64_t t = i / k, j = i % k;
    return "q[" + std::to_string(t) + ", " + std::to_string(j) +
           "]: x = " + std::to_string(xs[i].to_float()) +
           ", scale = " + std::to_string(sr[t * groups + j / 128]) + ", got " + hex32(qg[i].bits) +
           ", want " + hex32(qr[i].bits);
  }));

  // The GPU scales in the CPU's token-major order (padding checked apart).
  HostTensor s_got(DType::f32, {tokens, groups});
  float* sg = s_got.data<float>();
  const float* sd = s.data<float>();
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (std::int64_t g = 0; g < groups; ++g) {
      sg[t * groups + g] =
          layout == ScaleLayout::token_major ? sd[t * groups + g] : sd[g * tokens_padded + t];
    }
  }
  EXPECT_TRUE(bits_equal(sg, sr, tokens * groups, [&](std::int64_t i) {
    return "scale[" + std::to_string(i / groups) + ", " + std::to_string(i % groups) + "]: got " +
           hex32(bits_of(sg[i])) + ", want " + hex32(bits_of(sr[i]));
  }));
  if (layout == ScaleLayout::mn_major_tma) {
    for (std::int64_t g = 0; g < groups; ++g) {
      for (std::int64_t t = tokens; t < tokens_padded; ++t) {
        EXPECT_EQ(bits_of(sd[g * tokens_padded + t]), 0u) << "TMA padding scale [" << g << ", " << t << "]";
      }
    }
  }
  if (pow2) {
    for (std::int64_t i = 0; i < tokens * groups; ++i) {
      int e = 0;
      ASSERT_EQ(std::frexp(sg[i], &e), 0.5f) << "scale " << i << " is not a power of two: " << sg[i];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, QuantPerTokenGroupGpu,
    ::testing::Combine(::testing::Values<std::int64_t>(1, 3, 128, 4097),
                       ::testing::Values<std::int64_t>(128, 7168),
                       ::testing::Values(ScaleLayout::token_major, ScaleLayout::mn_major_tma),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<GroupCase>& param_info) {
      // (std::get, not a structured binding: its commas would split the macro argument)
      const GroupCase& c = param_info.param;
      return "T" + std::to_string(std::get<0>(c)) + "_K" + std::to_string(std::get<1>(c)) + "_" +
             std::string(cuda::to_string(std::get<2>(c))) + (std::get<3>(c) ? "_pow2" : "_f32");
    });

// The same input quantized twice gives the CPU's bytes both times (no dependence on leftover state: the
// outputs are poisoned before each run).
TEST(QuantPerTokenGroupGpuMisc, RepeatableAndEmpty) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  const HostTensor x = random_activations(257, 2048, rng);
  HostTensor q_ref(DType::fp8_e4m3, {257, 2048});
  HostTensor s_ref(DType::f32, {257, 16});
  quantize_per_token_group_fp8(x, q_ref, s_ref, 128, false);
  cuda::Stream stream;
  const cuda::DeviceTensor dx = cuda::to_device(x, stream);
  const cuda::DeviceTensor dq(DType::fp8_e4m3, {257, 2048});
  const cuda::DeviceTensor ds(DType::f32, {257, 16});
  for (int run = 0; run < 2; ++run) {
    SCOPED_TRACE("run " + std::to_string(run));
    dq.fill_bytes(kPoison, stream);
    ds.fill_bytes(kPoison, stream);
    cuda::quantize_per_token_group_fp8(dx, dq, ds, stream);
    const HostTensor q = cuda::to_host(dq, stream);
    const HostTensor s = cuda::to_host(ds, stream);
    EXPECT_EQ(std::memcmp(q.view().data, q_ref.view().data, q_ref.nbytes()), 0);
    EXPECT_EQ(std::memcmp(s.view().data, s_ref.view().data, s_ref.nbytes()), 0);
  }

  // T = 0: accepted, nothing launched.
  const cuda::DeviceTensor ex(DType::bf16, {0, 256});
  const cuda::DeviceTensor eq(DType::fp8_e4m3, {0, 256});
  const cuda::DeviceTensor es(DType::f32, {2, 0});
  EXPECT_NO_THROW(cuda::quantize_per_token_group_fp8(ex, eq, es, stream, ScaleLayout::mn_major_tma));
  stream.synchronize();
}

TEST(QuantPerTokenGroupGpuMisc, RefusesBadArguments) {
  EPMOE_REQUIRE_GPU();
  cuda::Stream stream;
  const cuda::DeviceTensor x(DType::bf16, {4, 256});
  const cuda::DeviceTensor q(DType::fp8_e4m3, {4, 256});
  const cuda::DeviceTensor s(DType::f32, {4, 2});
  const cuda::DeviceTensor s_mn(DType::f32, {2, 4});
  x.fill_bytes(0x3c, stream);  // bf16 0x3c3c, about 0.0115: initialised input (initcheck)
  EXPECT_NO_THROW(cuda::quantize_per_token_group_fp8(x, q, s, stream));
  EXPECT_NO_THROW(cuda::quantize_per_token_group_fp8(x, q, s_mn, stream, ScaleLayout::mn_major_tma));

  const cuda::DeviceTensor x_f32(DType::f32, {4, 256});
  expect_error_mentions([&] { cuda::quantize_per_token_group_fp8(x_f32, q, s, stream); },
                        "x must have dtype bf16");
  const cuda::DeviceTensor q_bad(DType::fp8_e4m3, {4, 128});
  expect_error_mentions([&] { cuda::quantize_per_token_group_fp8(x, q_bad, s, stream); },
                        "q must have shape");
  expect_error_mentions([&] { cuda::quantize_per_token_group_fp8(x, x, s, stream); },
                        "q must have dtype fp8_e4m3");
  expect_error_mentions([&] { cuda::quantize_per_token_group_fp8(x, q, s_mn, stream); },
                        "scales (token_major) must have shape [4, 2]");
  expect_error_mentions(
      [&] { cuda::quantize_per_token_group_fp8(x, q, s, stream, ScaleLayout::mn_major_tma); },
      "scales (mn_major_tma) must have shape [2, 4]");
  const cuda::DeviceTensor x_k(DType::bf16, {4, 200});
  const cuda::DeviceTensor q_k(DType::fp8_e4m3, {4, 200});
  expect_error_mentions([&] { cuda::quantize_per_token_group_fp8(x_k, q_k, s, stream); }, "multiple of 128");
  // Host memory.
  const HostTensor x_host(DType::bf16, {4, 256});
  expect_error_mentions([&] { cuda::quantize_per_token_group_fp8(x_host, q, s, stream); },
                        "x must live on cuda");
  const HostTensor s_host(DType::f32, {4, 2});
  expect_error_mentions([&] { cuda::quantize_per_token_group_fp8(x, q, s_host, stream); },
                        "scales must live on cuda");
  // Misaligned and non-contiguous views.
  const cuda::DeviceBuffer raw(4 * 256 * 2 + 64);
  TensorView x_off = raw.view(DType::bf16, {4, 256});
  x_off.data = static_cast<std::byte*>(x_off.data) + 8;
  expect_error_mentions([&] { cuda::quantize_per_token_group_fp8(x_off, q, s, stream); }, "16-byte aligned");
  TensorView x_strided = x.view();
  x_strided.stride[0] = 512;
  expect_error_mentions([&] { cuda::quantize_per_token_group_fp8(x_strided, q, s, stream); }, "contiguous");
  stream.synchronize();
}

// ---------------------------------------------------------------- per-tensor
class QuantPerTensorGpu : public ::testing::TestWithParam<std::tuple<std::int64_t, std::int64_t>> {};

TEST_P(QuantPerTensorGpu, BitExactWithCpu) {
  EPMOE_REQUIRE_GPU();
  const auto [rows, cols] = GetParam();
  testing::SeededRng rng;
  const std::int64_t n = rows * cols;
  const HostTensor x =
      random_plain(rows, cols, std::uniform_real_distribution<float>(0.01f, 100.0f)(rng), rng);
  const float ref_scale = per_tensor_fp8_scale(x);
  float ref_amax = 0.0f;
  for (std::int64_t i = 0; i < n; ++i) ref_amax = std::max(ref_amax, std::fabs(x.data<bf16>()[i].to_float()));

  cuda::Stream stream;
  const cuda::DeviceTensor dx = cuda::to_device(x, stream);
  const cuda::DeviceTensor dq(DType::fp8_e4m3, {rows, cols});
  const cuda::DeviceTensor dscale(DType::f32, {1});
  const cuda::DeviceTensor damax(DType::f32, {1});
  dscale.fill_bytes(kPoison, stream);
  damax.fill_bytes(kPoison, stream);
  cuda::per_tensor_amax(dx, damax, stream);
  cuda::per_tensor_fp8_scale(dx, dscale, stream);
  const float got_amax = cuda::to_host(damax, stream).data<float>()[0];
  const float got_scale = cuda::to_host(dscale, stream).data<float>()[0];
  EXPECT_EQ(bits_of(got_amax), bits_of(ref_amax)) << "amax " << got_amax << " vs " << ref_amax;
  EXPECT_EQ(bits_of(got_scale), bits_of(ref_scale)) << "scale " << got_scale << " vs " << ref_scale;

  // The computed scale, a static scale that saturates many values, and the scale read on device.
  for (const float scale : {ref_scale, ref_scale / 64.0f, 0.37f}) {
    SCOPED_TRACE("scale " + std::to_string(scale));
    HostTensor q_ref(DType::fp8_e4m3, {rows, cols});
    quantize_per_tensor_fp8(x, q_ref, scale);
    dq.fill_bytes(kPoison, stream);
    cuda::quantize_per_tensor_fp8(dx, dq, scale, stream);
    const HostTensor q = cuda::to_host(dq, stream);
    const auto* qg = q.data<fp8_e4m3>();
    const auto* qr = q_ref.data<fp8_e4m3>();
    EXPECT_TRUE(bits_equal(qg, qr, n, [&](std::int64_t i) {
      return "q[" + std::to_string(i) + "]: x = " + std::to_string(x.data<bf16>()[i].to_float()) + ", got " +
             hex32(qg[i].bits) + ", want " + hex32(qr[i].bits);
    }));
  }
  {
    HostTensor q_ref(DType::fp8_e4m3, {rows, cols});
    quantize_per_tensor_fp8(x, q_ref, ref_scale);
    dq.fill_bytes(kPoison, stream);
    cuda::quantize_per_tensor_fp8(dx, dq, dscale.view(), stream);  // scale from device memory
    const HostTensor q = cuda::to_host(dq, stream);
    EXPECT_TRUE(bits_equal(q.data<fp8_e4m3>(), q_ref.data<fp8_e4m3>(), n,
                           [](std::int64_t i) { return "q[" + std::to_string(i) + "] (device scale)"; }));
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, QuantPerTensorGpu,
                         ::testing::Values(std::make_tuple<std::int64_t, std::int64_t>(1, 128),
                                           std::make_tuple<std::int64_t, std::int64_t>(3, 7168),
                                           std::make_tuple<std::int64_t, std::int64_t>(5, 13),
                                           std::make_tuple<std::int64_t, std::int64_t>(1, 1),
                                           std::make_tuple<std::int64_t, std::int64_t>(128, 2048),
                                           std::make_tuple<std::int64_t, std::int64_t>(4097, 7168)),
                         [](const auto& param_info) {
                           return "N" + std::to_string(std::get<0>(param_info.param)) + "x" +
                                  std::to_string(std::get<1>(param_info.param));
                         });

TEST(QuantPerTensorGpuMisc, RefusesBadArguments) {
  EPMOE_REQUIRE_GPU();
  cuda::Stream stream;
  const cuda::DeviceTensor x(DType::bf16, {4, 256});
  const cuda::DeviceTensor q(DType::fp8_e4m3, {4, 256});
  const cuda::DeviceTensor scale(DType::f32, {1});
  const cuda::DeviceTensor two(DType::f32, {2});
  x.fill_bytes(0x3c, stream);
  EXPECT_NO_THROW(cuda::quantize_per_tensor_fp8(x, q, 1.0f, stream));
  expect_error_mentions([&] { cuda::quantize_per_tensor_fp8(x, q, 0.0f, stream); }, "scale must be positive");
  expect_error_mentions([&] { cuda::quantize_per_tensor_fp8(x, q, -1.0f, stream); },
                        "scale must be positive");
  expect_error_mentions([&] { cuda::quantize_per_tensor_fp8(x, q, std::nanf(""), stream); },
                        "scale must be positive");
  expect_error_mentions([&] { cuda::quantize_per_tensor_fp8(x, q, two.view(), stream); }, "exactly one");
  const cuda::DeviceTensor q_bad(DType::fp8_e4m3, {4, 128});
  expect_error_mentions([&] { cuda::quantize_per_tensor_fp8(x, q_bad, 1.0f, stream); },
                        "q must have the shape of x");
  const HostTensor x_host(DType::bf16, {4, 256});
  expect_error_mentions([&] { cuda::quantize_per_tensor_fp8(x_host, q, 1.0f, stream); },
                        "x must live on cuda");
  expect_error_mentions([&] { cuda::per_tensor_fp8_scale(x, two.view(), stream); },
                        "scale must hold exactly one");
  expect_error_mentions([&] { cuda::per_tensor_amax(x, q, stream); }, "amax must have dtype f32");
  const HostTensor s_host(DType::f32, {1});
  expect_error_mentions([&] { cuda::per_tensor_fp8_scale(x, s_host, stream); }, "scale must live on cuda");
  stream.synchronize();
}

}  // namespace
}  // namespace epmoe
