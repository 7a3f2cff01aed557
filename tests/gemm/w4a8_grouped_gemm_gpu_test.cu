// The W4A8 grouped GEMM on the GPU against its CPU reference (f64, from the checkpoint-order int4
// weights and the same FP8 activations): fresh random inputs for every run (never zeros; int4 values
// over all of [-8, 7]), outputs poisoned (0xff) before the run, relative L2 error <= 5e-3 over the
// valid rows, no NaN/Inf, every skipped row still poisoned afterwards. Also: the device weight
// preparation equals the CPU packer byte for byte and its inverse round-trips, graph replay of the
// masked call with new counts, and argument checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/w4a8_gemm.hpp"
#include "epmoe/grouped_gemm.hpp"
#include "epmoe/numerics.hpp"
#include "gemm/gemm_test_util.hpp"
#include "gemm/w4a8_kernel_choice.hpp"
#include "gemm/w4a8_layout.hpp"
#include "gpu_test_util.hpp"

namespace epmoe {
namespace {

using testing::expect_error_mentions;

using testing::check_output;
using testing::fill_masked_activations;
using testing::fill_random_fp8;
using testing::fill_random_scales;
using testing::host_i32;
using testing::kPoison;
using testing::kTolerance;
using testing::masked_valid;

constexpr auto kSM = cuda::W4A8Codes::sign_magnitude;
// A case again on weights with the sign-magnitude codes (in [-7, 7]), named "<name>_sm".
template <class Case>
Case sign_magnitude_case(Case c) {
  c.name += "_sm";
  c.codes = kSM;
  return c;
}

struct Weights {
  HostTensor w, s;  // checkpoint order: i4x2 [G, N, K/2], f32 [G, N, K/128]
};
// codes: sign_magnitude draws values in [-7, 7] only (a -8 nibble becomes -7), as the codes need.
Weights random_weights(std::int64_t G, std::int64_t N, std::int64_t K, std::mt19937_64& rng,
                       cuda::W4A8Codes codes = cuda::W4A8Codes::offset_binary) {
  Weights w{HostTensor(DType::i4x2, {G, N, K / 2}), HostTensor(DType::f32, {G, N, K / 128})};
  auto* b = static_cast<std::uint8_t*>(w.w.view().data);
  std::uint64_t bits = 0;
  for (std::int64_t i = 0; i < w.w.numel(); ++i) {
    if (i % 8 == 0) bits = rng();
    b[i] = static_cast<std::uint8_t>(bits >> (8 * (i % 8)));  // every int4 value, -8 included
    if (codes == cuda::W4A8Codes::sign_magnitude) {
      if ((b[i] & 0x0fu) == 0x08u) b[i] = static_cast<std::uint8_t>(b[i] + 1);
      if ((b[i] & 0xf0u) == 0x80u) b[i] = static_cast<std::uint8_t>(b[i] + 0x10);
    }
  }
  fill_random_scales(w.s.data<float>(), w.s.numel(), rng);
  return w;
}

// The scales as the kernels use them: the checkpoint's f32 ones rounded to bf16 at preparation
// (gemm/w4a8_layout.hpp). The reference takes these (design.md section 8: the same quantized inputs), so the
// whole error budget is the GEMM's own; with the f32 scales the rounding alone used ~45% of it.
HostTensor packed_scales(const HostTensor& s) {
  HostTensor rounded(DType::f32, {s.size(0), s.size(1), s.size(2)});
  for (std::int64_t i = 0; i < s.numel(); ++i) rounded.data<float>()[i] = round_to_bf16(s.data<float>()[i]);
  return rounded;
}

struct DeviceWeights {
  cuda::DeviceTensor w, s;
};
DeviceWeights prepare(const Weights& host, cuda::Stream& stream,
                      cuda::W4A8Codes codes = cuda::W4A8Codes::offset_binary) {
  const cuda::DeviceTensor dw = cuda::to_device(host.w, stream), ds = cuda::to_device(host.s, stream);
  DeviceWeights out{cuda::DeviceTensor(DType::i4x2, {host.w.size(0), host.w.size(1), host.w.size(2)}),
                    cuda::DeviceTensor(DType::bf16, {host.s.size(0), host.s.size(1), host.s.size(2)})};
  cuda::w4a8_prepare_weights(dw, ds, out.w, out.s, stream, codes);
  stream.synchronize();
  return out;
}

float random_a_scale(std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(0.5f, 2.0f);
  return u(rng) * 0.01f;
}

TEST(W4A8GemmGpu, PreparationMatchesTheCpuPackerAndRoundTrips) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  const std::int64_t G = 3, N = 384, K = 640;
  const Weights host = random_weights(G, N, K, rng);
  HostTensor pw(DType::i4x2, {G, N, K / 2}), ps(DType::bf16, {G, N, K / 128});
  cuda::w4a8_prepare_weights_cpu(host.w, host.s, pw, ps);
  cuda::Stream stream;
  const DeviceWeights dev = prepare(host, stream);
  const HostTensor got_w = cuda::to_host(dev.w, stream), got_s = cuda::to_host(dev.s, stream);
  EXPECT_EQ(std::memcmp(got_w.view().data, pw.view().data, pw.nbytes()), 0);
  EXPECT_EQ(std::memcmp(got_s.view().data, ps.view().data, ps.nbytes()), 0);
  const cuda::DeviceTensor back_w(DType::i4x2, {G, N, K / 2}), back_s(DType::f32, {G, N, K / 128});
  cuda::w4a8_unprepare_weights(dev.w, dev.s, back_w, back_s, stream);
  const HostTensor bw = cuda::to_host(back_w, stream), bs = cuda::to_host(back_s, stream);
  EXPECT_EQ(std::memcmp(bw.view().data, host.w.view().data, bw.nbytes()), 0);
  // The scales come back as their bf16 roundings (the device rounds as the CPU packer).
  for (std::int64_t i = 0; i < bs.numel(); ++i)
    ASSERT_EQ(bs.data<float>()[i], round_to_bf16(host.s.data<float>()[i])) << "scale " << i;
}

// The sign-magnitude codes: the device packer matches the CPU one and round-trips; w4a8_pick_codes picks
// them for weights in [-7, 7] only, and preparing weights that hold -8 with them is refused.
TEST(W4A8GemmGpu, SignMagnitudeCodesPrepareRoundTripAndRefuseMinus8) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  const std::int64_t G = 2, N = 384, K = 1152;
  const Weights host = random_weights(G, N, K, rng, kSM);
  HostTensor pw(DType::i4x2, {G, N, K / 2}), ps(DType::bf16, {G, N, K / 128});
  cuda::w4a8_prepare_weights_cpu(host.w, host.s, pw, ps, kSM);
  cuda::Stream stream;
  const cuda::DeviceTensor raw = cuda::to_device(host.w, stream);
  EXPECT_EQ(cuda::w4a8_pick_codes(raw, stream), kSM);
  const DeviceWeights dev = prepare(host, stream, kSM);
  const HostTensor got_w = cuda::to_host(dev.w, stream);
  EXPECT_EQ(std::memcmp(got_w.view().data, pw.view().data, pw.nbytes()), 0);
  const cuda::DeviceTensor back_w(DType::i4x2, {G, N, K / 2}), back_s(DType::f32, {G, N, K / 128});
  cuda::w4a8_unprepare_weights(dev.w, dev.s, back_w, back_s, stream, kSM);
  const HostTensor bw = cuda::to_host(back_w, stream);
  EXPECT_EQ(std::memcmp(bw.view().data, host.w.view().data, bw.nbytes()), 0);
  // One -8 (the last nibble of the last byte): offset-binary codes only.
  Weights bad{HostTensor(DType::i4x2, {G, N, K / 2}), HostTensor(DType::f32, {G, N, K / 128})};
  std::memcpy(bad.w.view().data, host.w.view().data, host.w.nbytes());
  std::memcpy(bad.s.view().data, host.s.view().data, host.s.nbytes());
  static_cast<std::uint8_t*>(bad.w.view().data)[bad.w.numel() - 1] = 0x83;
  const cuda::DeviceTensor bad_raw = cuda::to_device(bad.w, stream);
  EXPECT_EQ(cuda::w4a8_pick_codes(bad_raw, stream), cuda::W4A8Codes::offset_binary);
  expect_error_mentions([&] { (void)prepare(bad, stream, kSM); }, "holds -8");
}

// The device packer holds the checkpoint's scales to the CPU packer's rule (positive, 8 x it finite),
// naming the first bad one by index and value (a scan the packer waits for), and leaves the good ones
// as the CPU packer does.
TEST(W4A8GemmGpu, PrepareRefusesTheScalesTheCpuPackerRefuses) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  const std::int64_t G = 2, N = 256, K = 512;
  const Weights host = random_weights(G, N, K, rng);
  cuda::Stream stream;
  const std::int64_t last = host.s.numel() - 1;
  for (const auto& [i, v, shown] :
       {std::tuple{last, std::nanf(""), "nan"}, std::tuple{std::int64_t{0}, 0.0f, "0"},
        std::tuple{std::int64_t{77}, -0.5f, "-0.5"}, std::tuple{std::int64_t{300}, 3.4e38f, "3.4e+38"}}) {
    Weights bad{HostTensor(DType::i4x2, {G, N, K / 2}), HostTensor(DType::f32, {G, N, K / 128})};
    std::memcpy(bad.w.view().data, host.w.view().data, host.w.nbytes());
    std::memcpy(bad.s.view().data, host.s.view().data, host.s.nbytes());
    bad.s.data<float>()[i] = v;
    bad.s.data<float>()[last - 1] = -1.0f;  // a later bad one: the first is named
    if (i == last) bad.s.data<float>()[last - 1] = host.s.data<float>()[last - 1];
    const std::string want =
        fmt::format("w_scales must be positive and finite, with 8 x it finite: element {} is {}", i, shown);
    HostTensor pw(DType::i4x2, {G, N, K / 2}), ps(DType::bf16, {G, N, K / 128});
    expect_error_mentions([&] { cuda::w4a8_prepare_weights_cpu(bad.w, bad.s, pw, ps); }, want);
    expect_error_mentions([&] { (void)prepare(bad, stream); }, want);
  }
  (void)prepare(host, stream);  // the good scales pass
}

// ---------------------------------------------------------------- masked
struct MaskedCase {
  std::string name;
  std::int64_t m_max;
  std::vector<std::int32_t> masked_m;
  std::int64_t n, k;
  int block_m = 0;
  int consumers = 0;
  bool device_scale = false;
  cuda::W4A8KernelChoice pin{};  // gemm/w4a8_kernel_choice.hpp: version 0 = the automatic choice
  int max_ctas = 0;              // options.max_ctas: few CTAs, many tiles each
  bool workspace = false;        // options.workspace (poisoned with NaN before each run)
  cuda::W4A8Codes codes = cuda::W4A8Codes::offset_binary;  // sign_magnitude: weights in [-7, 7]
  std::int64_t expected_m = -1;                            // the launch's hint; -1: the mean of masked_m
  // When not empty: the counts on the device (some outside [0, M_max], which the kernel clamps to masked_m).
  std::vector<std::int32_t> device_masked_m{};
};

// v2 with the codes' offset term summed by the producer-side offset warp (bench/NOTES.md, W4A8 v5);
// with options.block_m / consumers set it applies to those tiles too.
constexpr cuda::W4A8KernelChoice kOffsetWarp{.version = 2, .offset_warp = 1};
// The same with two K blocks (256 K) per pipeline stage.
constexpr cuda::W4A8KernelChoice kOffsetWarpK2{.version = 2, .offset_warp = 1, .stage_k_blocks = 2};
// Masked rows of 20 groups for the many-tiles-per-CTA cases (two 16-row blocks in some, none in one).
const std::vector<std::int32_t> kManyTiles{7, 8, 1, 16, 3, 0, 5, 9, 12, 8, 8, 2, 4, 6, 11, 8, 13, 1, 10, 7};
// Plain v2 (the offset term from the constant-operand wgmma) with two and three K blocks per stage.
constexpr cuda::W4A8KernelChoice kK2{.version = 2, .stage_k_blocks = 2};
constexpr cuda::W4A8KernelChoice kK3{.version = 2, .stage_k_blocks = 3};
// v3 with the signed conversion (W4A8SmemTraits::kSigned): 128 x 256 with two waves, and 128 x 128.
constexpr cuda::W4A8KernelChoice kSigned256{
    .version = 3, .block_m = 128, .block_n = 256, .waves = 2, .signed_codes = 1};
constexpr cuda::W4A8KernelChoice kSigned128{
    .version = 3, .block_m = 128, .block_n = 128, .waves = 1, .signed_codes = 1};
// The tall tile: 256 activation rows x 128 columns (two 64-row waves per consumer), contiguous only.
constexpr cuda::W4A8KernelChoice kTall{
    .version = 3, .block_m = 256, .block_n = 128, .waves = 2, .signed_codes = 1};
// The register-operand kernel (v2) with signed codes: the wide tile (256 activation rows as two
// 128-row waves against each consumer's converted weights; contiguous only) and 128 x 128.
constexpr cuda::W4A8KernelChoice kV2Wide{.version = 2, .block_m = 256, .signed_codes = 1, .half_tiles = 1};
// The wide tile's kernel without the half-tile loop (W4A8KernelChoice::half_tiles = 2).
constexpr cuda::W4A8KernelChoice kV2WideNoHalf{
    .version = 2, .block_m = 256, .signed_codes = 1, .half_tiles = 2};
constexpr cuda::W4A8KernelChoice kV2Signed128{.version = 2, .block_m = 128, .signed_codes = 1};
// Two partials on the 32-row four-consumer tile, with one and two K blocks per stage.
constexpr cuda::W4A8KernelChoice kP2{.version = 2, .parts = 2};
constexpr cuda::W4A8KernelChoice kK2P2{.version = 2, .stage_k_blocks = 2, .parts = 2};
// The offset term from the row-sum pre-pass (needs options.workspace; decode tiles only), with one
// and two partials and two K blocks per stage.
constexpr cuda::W4A8KernelChoice kRS{.version = 2, .row_sums = 1};
constexpr cuda::W4A8KernelChoice kRSP2{.version = 2, .parts = 2, .row_sums = 1};
constexpr cuda::W4A8KernelChoice kRSK2{.version = 2, .stage_k_blocks = 2, .row_sums = 1};

// Pins the W4A8 kernel for the lifetime of the guard.
class PinKernel {
 public:
  explicit PinKernel(const cuda::W4A8KernelChoice& c) { cuda::w4a8_pin_kernel(c); }
  ~PinKernel() { cuda::w4a8_pin_kernel({}); }
  PinKernel(const PinKernel&) = delete;
  PinKernel& operator=(const PinKernel&) = delete;
};
void PrintTo(const MaskedCase& c, std::ostream* os) {
  *os << c.name;
}

struct MaskedInputs {
  HostTensor a, counts;
  Weights w;
};
MaskedInputs masked_inputs(std::int64_t G, std::int64_t M_max, std::int64_t N, std::int64_t K,
                           const std::vector<std::int32_t>& counts, std::mt19937_64& rng,
                           cuda::W4A8Codes codes = cuda::W4A8Codes::offset_binary) {
  MaskedInputs in{HostTensor(DType::fp8_e4m3, {G, M_max, K}), HostTensor(DType::i32, {G}),
                  random_weights(G, N, K, rng, codes)};
  fill_masked_activations(static_cast<std::uint8_t*>(in.a.view().data), counts, M_max, K,
                          in.counts.data<std::int32_t>(), rng);
  return in;
}

class W4A8GemmMaskedGpu : public ::testing::TestWithParam<MaskedCase> {};

// One masked case on fresh inputs from rng: against the reference (output poisoned first), then again
// (the workspace's sums poisoned too) for the same bits.
void check_masked_case(const MaskedCase& c, std::mt19937_64& rng) {
  const auto G = static_cast<std::int64_t>(c.masked_m.size());
  const std::int64_t N = c.n, K = c.k, M_max = c.m_max;
  const MaskedInputs in = masked_inputs(G, M_max, N, K, c.masked_m, rng, c.codes);
  const float a_scale = random_a_scale(rng);

  HostTensor ref(DType::f64, {G, M_max, N});
  w4a8_grouped_gemm_masked_cpu(in.a, a_scale, in.w.w, packed_scales(in.w.s), in.counts, ref);

  std::int64_t expected_m = c.expected_m;
  if (expected_m < 0) {
    expected_m = 0;
    for (const std::int32_t m : c.masked_m) expected_m += m;
    expected_m /= G;
  }

  cuda::Stream stream;
  const DeviceWeights dw = prepare(in.w, stream, c.codes);
  HostTensor device_counts(DType::i32, {G});
  std::memcpy(device_counts.data<std::int32_t>(),
              c.device_masked_m.empty() ? in.counts.data<std::int32_t>() : c.device_masked_m.data(),
              device_counts.nbytes());
  const cuda::DeviceTensor da = cuda::to_device(in.a, stream),
                           dcounts = cuda::to_device(device_counts, stream);
  cuda::DeviceTensor dscale;
  if (c.device_scale) {
    HostTensor hs(DType::f32, {1});
    hs.data<float>()[0] = a_scale;
    dscale = cuda::to_device(hs, stream);
  }
  const cuda::DeviceTensor dd(DType::bf16, {G, M_max, N});
  cuda::W4A8GemmOptions options;
  options.block_m = c.block_m;
  options.consumers = c.consumers;
  options.max_ctas = c.max_ctas;
  options.codes = c.codes;
  cuda::DeviceTensor workspace;
  // NaN in the row sums (a sum the pre-pass did not write poisons the output); the last 16 bytes, the
  // dynamic schedule's counter, zeroed once as documented and then left as each call leaves them.
  const std::size_t workspace_bytes = cuda::w4a8_workspace_bytes(G, M_max, K);
  const auto poison_sums = [&] {
    EPMOE_CUDA_CHECK(cudaMemsetAsync(workspace.view().data, 0xff, workspace_bytes - 16, stream));
  };
  if (c.workspace) {
    workspace = cuda::DeviceTensor(DType::f32, {static_cast<std::int64_t>(workspace_bytes / 4)});
    workspace.fill_bytes(0x00, stream);
    options.workspace = workspace.view();
  }
  const PinKernel pin(c.pin);
  // With a device scale the host float is garbage: the kernel must not read it.
  const float host_scale = c.device_scale ? std::nanf("") : a_scale;
  const TensorView scale_view = c.device_scale ? dscale.view() : TensorView{};
  const HostTensor got = testing::run_twice_same_bits(dd, stream, [&] {
    if (c.workspace) poison_sums();
    cuda::w4a8_grouped_gemm_masked(da, host_scale, scale_view, dw.w, dw.s, dcounts, expected_m, dd, stream,
                                   options);
  });
  check_output(got, ref, masked_valid(c.masked_m, M_max), N);
}

TEST_P(W4A8GemmMaskedGpu, MatchesCpuReference) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  check_masked_case(GetParam(), rng);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, W4A8GemmMaskedGpu,
    ::testing::Values(
        // Decode, gate_up: 16 x 256 tiles, an empty group, groups past one 16-row block.
        MaskedCase{"N4096_K7168_decode", 40, {8, 0, 13, 40, 1}, 4096, 7168},
        // Decode, down: 7168 x 2048, 32 x 256 tiles, a device a_scale.
        MaskedCase{"N7168_K2048_decode_block32_device_scale", 48, {20, 5, 48, 0}, 7168, 2048, 32, 0, true},
        // Every tile shape: 16 / 32 with 2 consumers, 64, 128.
        MaskedCase{"N1536_K2048_block16_consumers2", 37, {37, 3, 0, 17}, 1536, 2048, 16, 2},
        MaskedCase{"N1536_K2048_block32_consumers2", 70, {70, 33, 1}, 1536, 2048, 32, 2},
        MaskedCase{"N1536_K2048_block64", 130, {130, 0, 64, 65}, 1536, 2048, 64},
        MaskedCase{"N640_K7168_block128", 300, {300, 129, 7}, 640, 7168, 128},
        // N not a multiple of 256: the heuristic falls back to 128-row weight tiles.
        MaskedCase{"N640_K2048_decode_n_not_256", 24, {24, 9}, 640, 2048},
        // An odd number of K blocks (the last one folded from the second partial), and a single one.
        MaskedCase{"N1536_K1152_odd_k_blocks", 20, {20, 7}, 1536, 1152},
        MaskedCase{"N640_K128_one_k_block_block64", 70, {70, 5}, 640, 128, 64},
        MaskedCase{"N512_K384_odd_k_blocks_block32_consumers4", 40, {40, 31}, 512, 384, 32, 4},
        // masked_m = M_max everywhere, and nothing valid at all.
        MaskedCase{"N1536_K2048_all_full", 16, {16, 16, 16}, 1536, 2048},
        MaskedCase{"N1536_K2048_all_empty", 130, {0, 0}, 1536, 2048},
        // expected_m 40: the automatic choice is v3 (64 x 256).
        MaskedCase{"N1536_K2048_expected40_auto", 64, {64, 16, 40}, 1536, 2048},
        // expected_m > 64: v2's signed 128 x 128 (session 28), with M_max not a multiple of 128, an empty
        // group, a group of one row and one past a tile boundary.
        MaskedCase{"N1536_K1152_expected100_auto_v2_signed", 200, {200, 0, 1, 129, 170}, 1536, 1152},
        // Weights with the sign-magnitude codes (no offset term on any tile): the 16- and 32-row decode
        // tiles (automatic), a device scale, 16 rows with two consumers, 64, the automatic 128 x 128 of
        // groups of > 64 rows, an odd K-block count, N not a multiple of 256, one CTA.
        sign_magnitude_case(MaskedCase{"N4096_K7168_decode", 40, {8, 0, 13, 40, 1}, 4096, 7168}),
        sign_magnitude_case(MaskedCase{
            "N7168_K2048_decode17_device_scale", 48, {20, 5, 48, 0}, 7168, 2048, 0, 0, true}),
        sign_magnitude_case(MaskedCase{
            "N1536_K2048_block16_consumers2", 37, {37, 3, 0, 17}, 1536, 2048, 16, 2}),
        sign_magnitude_case(MaskedCase{"N1536_K2048_block64", 130, {130, 0, 64, 65}, 1536, 2048, 64}),
        sign_magnitude_case(MaskedCase{
            "N1536_K1152_expected100_auto", 200, {200, 0, 1, 129, 170}, 1536, 1152}),
        sign_magnitude_case(MaskedCase{
            "N640_K1152_decode_n_not_256_one_cta", 24, {24, 9, 17}, 640, 1152, 0, 0, false, {}, 1}),
        // The automatic choice is the register-operand kernel (v2) for masked decode rows
        // (expected_m <= 24; <= 12 with the offset warp and two K blocks per stage) and v3
        // otherwise (w4a8_kernel_choice): v2 pinned, and the
        // shared-memory-conversion kernel (v3) with its own
        // heuristic (64 x 256, activation boxes of 16 / 32 rows where the hint allows) and every
        // other v3 tile pinned.
        MaskedCase{"N4096_K7168_decode_v2", 40, {8, 0, 13, 40, 1}, 4096, 7168, 0, 0, false, {2}},
        MaskedCase{"N4096_K7168_decode_v3", 40, {8, 0, 13, 40, 1}, 4096, 7168, 0, 0, false, {3}},
        MaskedCase{"N640_K2048_decode_n_not_256_v3", 24, {24, 9}, 640, 2048, 0, 0, false, {3}},
        MaskedCase{"N1536_K2048_v3_m64n128", 37, {37, 3, 0, 17}, 1536, 2048, 0, 0, false, {3, 64, 128, 1}},
        MaskedCase{
            "N1536_K2048_v3_m128n128", 130, {130, 0, 64, 65}, 1536, 2048, 0, 0, false, {3, 128, 128, 1}},
        MaskedCase{"N640_K7168_v3_m128n128", 300, {300, 129, 7}, 640, 7168, 0, 0, false, {3, 128, 128, 1}},
        // v3 with the signed conversion: 128 x 256 (two waves), 128 x 128 and 64 x 256.
        MaskedCase{"N1536_K2048_v3_signed_m128n256",
                   300,
                   {300, 129, 0, 7, 256},
                   1536,
                   2048,
                   0,
                   0,
                   false,
                   kSigned256},
        MaskedCase{"N640_K1152_v3_signed_m128n128", 130, {130, 0, 64, 65}, 640, 1152, 0, 0, true, kSigned128},
        MaskedCase{"N640_K1152_v2_signed_m128", 130, {130, 0, 64, 65}, 640, 1152, 0, 0, true, kV2Signed128},
        MaskedCase{"N4096_K7168_v3_signed_m64n256",
                   40,
                   {8, 0, 13, 40, 1},
                   4096,
                   7168,
                   0,
                   0,
                   false,
                   {.version = 3, .block_m = 64, .block_n = 256, .waves = 1, .signed_codes = 1}},
        MaskedCase{"N512_K384_odd_k_blocks_v3_m64n256_device_scale",
                   70,
                   {70, 31, 2},
                   512,
                   384,
                   0,
                   0,
                   true,
                   {3, 64, 256, 1}},
        MaskedCase{"N1536_K1152_v3_m128n128_small_box",
                   40,
                   {40, 1, 33, 0},
                   1536,
                   1152,
                   0,
                   0,
                   false,
                   {3, 128, 128, 1}},
        // v2 with the offset warp (kOffsetWarp): every tile, the decode rows, odd and single K-block
        // counts (with two partials and one), a device scale, nothing valid.
        MaskedCase{"N4096_K7168_decode_offwarp", 40, {8, 0, 13, 40, 1}, 4096, 7168, 0, 0, false, kOffsetWarp},
        MaskedCase{"N7168_K2048_decode_block32_device_scale_offwarp",
                   48,
                   {20, 5, 48, 0},
                   7168,
                   2048,
                   32,
                   0,
                   true,
                   kOffsetWarp},
        MaskedCase{"N1536_K2048_block16_consumers2_offwarp",
                   37,
                   {37, 3, 0, 17},
                   1536,
                   2048,
                   16,
                   2,
                   false,
                   kOffsetWarp},
        MaskedCase{
            "N1536_K2048_block32_consumers2_offwarp", 70, {70, 33, 1}, 1536, 2048, 32, 2, false, kOffsetWarp},
        MaskedCase{
            "N1536_K2048_block64_offwarp", 130, {130, 0, 64, 65}, 1536, 2048, 64, 0, false, kOffsetWarp},
        MaskedCase{"N640_K7168_block128_offwarp", 300, {300, 129, 7}, 640, 7168, 128, 0, false, kOffsetWarp},
        MaskedCase{"N1536_K1152_odd_k_blocks_offwarp", 20, {20, 7}, 1536, 1152, 0, 0, false, kOffsetWarp},
        MaskedCase{"N512_K384_odd_k_blocks_block16_consumers4_offwarp",
                   40,
                   {40, 31},
                   512,
                   384,
                   16,
                   4,
                   false,
                   kOffsetWarp},
        MaskedCase{"N640_K128_one_k_block_block64_offwarp", 70, {70, 5}, 640, 128, 64, 0, false, kOffsetWarp},
        MaskedCase{"N1536_K2048_all_empty_offwarp", 130, {0, 0}, 1536, 2048, 0, 0, false, kOffsetWarp},
        // Two K blocks per stage: even and odd K-block counts (an odd count ends on a stage of one
        // block), one K block, the four-consumer tiles (one copy per stage for both blocks) and
        // the two-consumer ones (a copy per block).
        MaskedCase{
            "N4096_K7168_decode_offwarp_k2", 40, {8, 0, 13, 40, 1}, 4096, 7168, 0, 0, false, kOffsetWarpK2},
        MaskedCase{"N7168_K2048_decode_block32_device_scale_offwarp_k2",
                   48,
                   {20, 5, 48, 0},
                   7168,
                   2048,
                   32,
                   0,
                   true,
                   kOffsetWarpK2},
        MaskedCase{
            "N1536_K1152_odd_k_blocks_offwarp_k2", 20, {20, 7}, 1536, 1152, 0, 0, false, kOffsetWarpK2},
        MaskedCase{"N512_K384_odd_k_blocks_block16_consumers4_offwarp_k2",
                   40,
                   {40, 31},
                   512,
                   384,
                   16,
                   4,
                   false,
                   kOffsetWarpK2},
        MaskedCase{"N1536_K1152_odd_k_blocks_block32_consumers2_offwarp_k2",
                   70,
                   {70, 33, 1},
                   1536,
                   1152,
                   32,
                   2,
                   false,
                   kOffsetWarpK2},
        MaskedCase{"N1536_K2048_block16_consumers2_offwarp_k2",
                   37,
                   {37, 3, 0, 17},
                   1536,
                   2048,
                   16,
                   2,
                   false,
                   kOffsetWarpK2},
        MaskedCase{
            "N640_K128_one_k_block_block64_offwarp_k2", 70, {70, 5}, 640, 128, 64, 0, false, kOffsetWarpK2},
        MaskedCase{
            "N640_K7168_block128_offwarp_k2", 300, {300, 129, 7}, 640, 7168, 128, 0, false, kOffsetWarpK2},
        MaskedCase{"N1536_K2048_all_empty_offwarp_k2", 130, {0, 0}, 1536, 2048, 0, 0, false, kOffsetWarpK2},
        // Plain v2 with two and three K blocks per stage: the decode tiles (16 and 32 rows, four
        // consumers: one copy per stage), K-block counts that are and are not a multiple of the
        // stage (56, 16, 9, 3, 1: a tile's last stage partly filled, then the next tile's first
        // stage fresh), two-consumer tiles (a copy per block), the 64- and 128-row tiles (per-row
        // offset), nothing valid; many tiles per CTA (the consumers' pipeline across tiles).
        MaskedCase{"N4096_K7168_decode_k2", 40, {8, 0, 13, 40, 1}, 4096, 7168, 0, 0, false, kK2},
        MaskedCase{"N4096_K7168_decode_k3", 40, {8, 0, 13, 40, 1}, 4096, 7168, 0, 0, false, kK3},
        MaskedCase{
            "N7168_K2048_decode_block32_device_scale_k2", 48, {20, 5, 48, 0}, 7168, 2048, 32, 0, true, kK2},
        MaskedCase{
            "N7168_K2048_decode_block32_device_scale_k3", 48, {20, 5, 48, 0}, 7168, 2048, 32, 0, true, kK3},
        MaskedCase{"N1536_K1152_odd_k_blocks_k2", 20, {20, 7}, 1536, 1152, 0, 0, false, kK2},
        MaskedCase{"N1536_K1152_odd_k_blocks_k3", 20, {20, 7}, 1536, 1152, 0, 0, false, kK3},
        MaskedCase{
            "N512_K384_three_k_blocks_block16_consumers4_k2", 40, {40, 31}, 512, 384, 16, 4, false, kK2},
        MaskedCase{
            "N512_K384_three_k_blocks_block32_consumers4_k3", 40, {40, 31}, 512, 384, 32, 4, false, kK3},
        MaskedCase{
            "N1536_K1152_odd_k_blocks_block32_consumers2_k3", 70, {70, 33, 1}, 1536, 1152, 32, 2, false, kK3},
        MaskedCase{"N1536_K2048_block16_consumers2_k2", 37, {37, 3, 0, 17}, 1536, 2048, 16, 2, false, kK2},
        MaskedCase{"N640_K128_one_k_block_block64_k3", 70, {70, 5}, 640, 128, 64, 0, false, kK3},
        MaskedCase{"N640_K1152_block128_k2", 300, {300, 129, 7}, 640, 1152, 128, 0, false, kK2},
        MaskedCase{"N1536_K2048_all_empty_k3", 130, {0, 0}, 1536, 2048, 0, 0, false, kK3},
        // Few CTAs, many tiles each (the consumers' one K-block stream across tiles: a tile's last
        // block folded and stored after the next tile's first is issued, frag parity carried over
        // odd counts, empty and one-block groups between), with every stage size, the one-partial
        // 32-row tile and one K block per tile.
        MaskedCase{"N2048_K1152_many_tiles_per_cta_v2", 16, kManyTiles, 2048, 1152, 0, 0, false, {2}, 7},
        MaskedCase{"N2048_K1152_many_tiles_per_cta_k2", 16, kManyTiles, 2048, 1152, 0, 0, false, kK2, 7},
        MaskedCase{"N2048_K1280_many_tiles_per_cta_k3", 16, kManyTiles, 2048, 1280, 0, 0, true, kK3, 7},
        MaskedCase{"N2048_K1152_many_tiles_per_cta_offwarp_k2", 16, kManyTiles, 2048, 1152, 0, 0, false,
                   kOffsetWarpK2, 5},
        MaskedCase{"N2048_K1280_many_tiles_per_cta_block32_k3", 16, kManyTiles, 2048, 1280, 32, 0, false, kK3,
                   6},
        MaskedCase{
            "N2048_K1152_many_tiles_per_cta_block32_v2", 16, kManyTiles, 2048, 1152, 32, 0, false, {2}, 6},
        MaskedCase{
            "N2048_K128_many_tiles_per_cta_one_k_block_v2", 16, kManyTiles, 2048, 128, 0, 0, false, {2}, 3},
        MaskedCase{"N2048_K256_many_tiles_per_cta_k3", 16, kManyTiles, 2048, 256, 0, 0, false, kK3, 4},
        // The 32-row tile with two partials: decode shape, an odd K-block count with few CTAs, three
        // K blocks, one K block, two K blocks per stage.
        MaskedCase{
            "N7168_K2048_decode_block32_device_scale_p2", 48, {20, 5, 48, 0}, 7168, 2048, 32, 0, true, kP2},
        MaskedCase{"N2048_K1152_many_tiles_per_cta_block32_p2", 16, kManyTiles, 2048, 1152, 32, 0, false, kP2,
                   6},
        MaskedCase{
            "N512_K384_three_k_blocks_block32_consumers4_p2", 40, {40, 31}, 512, 384, 32, 4, false, kP2},
        MaskedCase{"N2048_K128_many_tiles_per_cta_one_k_block_block32_p2", 16, kManyTiles, 2048, 128, 32, 0,
                   false, kP2, 3},
        MaskedCase{"N2048_K1280_many_tiles_per_cta_block32_k2_p2", 16, kManyTiles, 2048, 1280, 32, 0, false,
                   kK2P2, 5},
        // The row-sum pre-pass (options.workspace): the decode tiles with four and two consumers, one
        // and two partials, two K blocks per stage over an odd count, M_max not a multiple of 32,
        // many tiles per CTA, nothing valid; the automatic choice with a workspace; a 64-row tile
        // pinned with row_sums (no pre-pass there: the per-row wgmma).
        MaskedCase{
            "N4096_K7168_decode_rowsums", 40, {8, 0, 13, 40, 1}, 4096, 7168, 0, 0, false, kRS, 0, true},
        MaskedCase{"N7168_K2048_decode_block32_device_scale_rowsums_p2",
                   48,
                   {20, 5, 48, 0},
                   7168,
                   2048,
                   32,
                   0,
                   true,
                   kRSP2,
                   0,
                   true},
        MaskedCase{
            "N7168_K2048_decode_block32_rowsums", 48, {20, 5, 48, 0}, 7168, 2048, 32, 0, false, kRS, 0, true},
        MaskedCase{"N1536_K2048_block16_consumers2_rowsums",
                   37,
                   {37, 3, 0, 17},
                   1536,
                   2048,
                   16,
                   2,
                   false,
                   kRS,
                   0,
                   true},
        MaskedCase{"N1536_K2048_block32_consumers2_rowsums_p2",
                   70,
                   {70, 33, 1},
                   1536,
                   2048,
                   32,
                   2,
                   false,
                   kRSP2,
                   0,
                   true},
        MaskedCase{
            "N1536_K1152_odd_k_blocks_rowsums_k2", 20, {20, 7}, 1536, 1152, 0, 0, false, kRSK2, 0, true},
        MaskedCase{"N2048_K1152_many_tiles_per_cta_block32_rowsums_p2", 16, kManyTiles, 2048, 1152, 32, 0,
                   false, kRSP2, 6, true},
        MaskedCase{"N2048_K128_many_tiles_per_cta_one_k_block_rowsums", 16, kManyTiles, 2048, 128, 0, 0,
                   false, kRS, 3, true},
        MaskedCase{"N1536_K2048_all_empty_rowsums", 130, {0, 0}, 1536, 2048, 0, 0, false, kRS, 0, true},
        MaskedCase{
            "N7168_K2048_decode_auto_workspace", 48, {20, 5, 48, 0}, 7168, 2048, 0, 0, false, {}, 0, true},
        MaskedCase{"N1536_K2048_block64_rowsums_not_used",
                   130,
                   {130, 0, 64, 65},
                   1536,
                   2048,
                   64,
                   0,
                   false,
                   kRS,
                   0,
                   true}),
    [](const ::testing::TestParamInfo<MaskedCase>& info) { return info.param.name; });

// ---------------------------------------------------------------- contiguous
struct ContiguousCase {
  std::string name;
  std::vector<std::int64_t> group_rows;  // valid rows per group; each group padded to 128
  std::int64_t n, k;
  std::int64_t trailing_blocks = 0;  // all-padding 128-row blocks at the end
  bool holes = false;                // -1 rows inside groups' rows too
  cuda::W4A8KernelChoice pin{};      // version 0: the automatic choice (v3 for the contiguous layout)
  int max_ctas = 0;                  // W4A8GemmOptions::max_ctas (0: the launch's own count)
  cuda::W4A8Codes codes = cuda::W4A8Codes::offset_binary;  // sign_magnitude: weights in [-7, 7]
};
void PrintTo(const ContiguousCase& c, std::ostream* os) {
  *os << c.name;
}

class W4A8GemmContiguousGpu : public ::testing::TestWithParam<ContiguousCase> {};

// One contiguous case on fresh inputs from rng (NaN codes in the padding rows): against the reference
// (output poisoned first), then again for the same bits.
void check_contiguous_case(const ContiguousCase& c, std::mt19937_64& rng) {
  const auto G = static_cast<std::int64_t>(c.group_rows.size());
  const std::int64_t N = c.n, K = c.k;
  std::vector<std::int32_t> ids;
  for (std::int64_t g = 0; g < G; ++g) {
    const std::int64_t rows = c.group_rows[static_cast<std::size_t>(g)];
    const std::int64_t padded = (rows + 127) / 128 * 128;
    for (std::int64_t r = 0; r < padded; ++r) {
      const bool hole = c.holes && r < rows && r % 7 == 3;
      ids.push_back(r < rows && !hole ? static_cast<std::int32_t>(g) : -1);
    }
  }
  for (std::int64_t i = 0; i < 128 * c.trailing_blocks; ++i) ids.push_back(-1);
  const auto M = static_cast<std::int64_t>(ids.size());  // (0: the call does nothing)

  HostTensor a(DType::fp8_e4m3, {M, K});
  const HostTensor m_indices = host_i32(ids);
  auto* a_bytes = static_cast<std::uint8_t*>(a.view().data);
  fill_random_fp8(a_bytes, M * K, rng);
  std::vector<bool> valid(static_cast<std::size_t>(M));
  for (std::int64_t m = 0; m < M; ++m) {
    valid[static_cast<std::size_t>(m)] = ids[static_cast<std::size_t>(m)] >= 0;
    if (!valid[static_cast<std::size_t>(m)]) std::memset(a_bytes + m * K, 0x7f, static_cast<std::size_t>(K));
  }
  const Weights w = random_weights(G, N, K, rng, c.codes);
  const float a_scale = random_a_scale(rng);
  HostTensor ref(DType::f64, {M, N});
  w4a8_grouped_gemm_contiguous_cpu(a, a_scale, w.w, packed_scales(w.s), m_indices, ref);

  cuda::Stream stream;
  const DeviceWeights dw = prepare(w, stream, c.codes);
  const cuda::DeviceTensor da = cuda::to_device(a, stream), dids = cuda::to_device(m_indices, stream);
  const cuda::DeviceTensor dd(DType::bf16, {M, N});
  const PinKernel pin(c.pin);
  cuda::W4A8GemmOptions options;
  options.max_ctas = c.max_ctas;
  options.codes = c.codes;
  const HostTensor got = testing::run_twice_same_bits(dd, stream, [&] {
    cuda::w4a8_grouped_gemm_contiguous(da, a_scale, {}, dw.w, dw.s, dids, dd, stream, options);
  });
  check_output(got, ref, valid, N);
}

TEST_P(W4A8GemmContiguousGpu, MatchesCpuReference) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  check_contiguous_case(GetParam(), rng);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, W4A8GemmContiguousGpu,
    ::testing::Values(
        ContiguousCase{"N4096_K7168_empty_and_single_row", {1, 0, 130}, 4096, 7168},
        ContiguousCase{"N7168_K2048", {150, 0, 64, 33}, 7168, 2048},
        ContiguousCase{"N1536_K2048_single_row_trailing", {0, 1}, 1536, 2048, 3},
        ContiguousCase{"N1536_K1152_odd_k_blocks", {130, 7}, 1536, 1152},
        ContiguousCase{"N640_K2048_many_groups_holes", {5, 17, 0, 128, 1, 90, 0, 33}, 640, 2048, 1, true},
        // The register-operand kernel (v2), v3's heuristic tile for K = 7168 and the other v3
        // tiles, pinned.
        ContiguousCase{"N4096_K7168_v3", {1, 0, 130}, 4096, 7168, 0, false, {3}},
        ContiguousCase{"N7168_K2048_v2", {150, 0, 64, 33}, 7168, 2048, 0, false, {2}},
        ContiguousCase{"N1536_K2048_holes_v2", {5, 130, 0, 33}, 1536, 2048, 1, true, {2}},
        ContiguousCase{
            "N1536_K1152_odd_k_blocks_v3_m128n128", {130, 7}, 1536, 1152, 0, false, {3, 128, 128, 1}},
        ContiguousCase{"N1536_K2048_holes_v3_m64n256", {5, 130, 0, 33}, 1536, 2048, 1, true, {3, 64, 256, 1}},
        // v3 with the signed conversion (no offset term): 128 x 256 with two waves per consumer and
        // 128 x 128, at both K, with holes and odd K-block counts; N = 640 (not a multiple of 256).
        ContiguousCase{"N4096_K7168_v3_signed_m128n256", {1, 0, 130}, 4096, 7168, 0, false, kSigned256},
        ContiguousCase{"N7168_K2048_v3_signed_m128n256", {150, 0, 64, 33}, 7168, 2048, 0, false, kSigned256},
        ContiguousCase{"N1536_K1152_odd_k_blocks_holes_v3_signed_m128n256",
                       {5, 130, 0, 33},
                       1536,
                       1152,
                       1,
                       true,
                       kSigned256},
        ContiguousCase{
            "N640_K2048_holes_v3_signed_m128n128", {5, 17, 0, 128, 1, 90}, 640, 2048, 1, true, kSigned128},
        // The tall tile (256 x 128): pairs of 128-row blocks of one group, pairs split between two
        // groups (half tiles), an empty group, a group of one block, a last pair of one block,
        // padding blocks, holes, both K and odd K-block counts.
        ContiguousCase{"N4096_K7168_v3_tall_m256n128", {300, 0, 520, 129}, 4096, 7168, 1, false, kTall},
        ContiguousCase{"N7168_K2048_v3_tall_m256n128", {150, 0, 64, 33, 255}, 7168, 2048, 0, false, kTall},
        ContiguousCase{"N640_K1152_odd_k_blocks_holes_v3_tall_m256n128",
                       {5, 130, 0, 33, 260},
                       640,
                       1152,
                       1,
                       true,
                       kTall},
        ContiguousCase{"N1536_K2048_one_block_v3_tall_m256n128", {77}, 1536, 2048, 0, false, kTall},
        // v2's wide tile (256 x 128, signed codes): the same pairs, half tiles, padding and holes as the
        // tall tile; and v2's signed 128 x 128.
        ContiguousCase{"N4096_K7168_v2_wide_m256", {300, 0, 520, 129}, 4096, 7168, 1, false, kV2Wide},
        // Weights with the sign-magnitude codes: the automatic wide tile (with and without its
        // half-tile loop), odd K blocks with holes, the automatic 128 x 128, the split on eight CTAs.
        sign_magnitude_case(ContiguousCase{"N4096_K7168_auto_wide", {300, 0, 520, 129}, 4096, 7168, 1}),
        sign_magnitude_case(ContiguousCase{
            "N384_K384_larger_groups_auto_wide_no_half_loop", {2100, 3000, 2400, 0}, 384, 384, 0, true}),
        sign_magnitude_case(ContiguousCase{
            "N640_K1152_odd_k_blocks_holes_wide", {5, 130, 0, 33, 260}, 640, 1152, 1, true}),
        sign_magnitude_case(ContiguousCase{
            "N640_K2048_sparse_groups_auto_128", {90, 0, 0, 200, 0, 0, 33}, 640, 2048}),
        sign_magnitude_case(ContiguousCase{
            "N640_K1152_split_eight_ctas_wide", {100, 5, 300, 60, 20, 90}, 640, 1152, 1, true, kV2Wide, 8}),
        ContiguousCase{"N7168_K2048_v2_wide_m256", {150, 0, 64, 33, 255}, 7168, 2048, 0, false, kV2Wide},
        ContiguousCase{"N640_K1152_holes_v2_wide_m256_no_half_loop",
                       {100, 5, 300, 60, 20, 90},
                       640,
                       1152,
                       1,
                       true,
                       kV2WideNoHalf},
        ContiguousCase{
            "N640_K1152_odd_k_blocks_holes_v2_wide_m256", {5, 130, 0, 33, 260}, 640, 1152, 1, true, kV2Wide},
        ContiguousCase{"N1536_K2048_one_block_v2_wide_m256", {77}, 1536, 2048, 0, false, kV2Wide},
        // The wide tile's half tiles on CTAs of their own (W4A8Scheduler::split_halves): whole pairs only
        // (no split); few half tiles for the CTA count, on one, two and three CTAs (every CTA runs both
        // kinds); half tiles only, on two CTAs (both run half tiles); 7 of 8 CTAs for the half tiles.
        ContiguousCase{
            "N640_K2048_whole_pairs_only_v2_wide_m256", {256, 0, 512, 200}, 640, 2048, 1, false, kV2Wide},
        ContiguousCase{
            "N640_K1152_holes_one_cta_v2_wide_m256", {5, 130, 0, 33, 260}, 640, 1152, 1, true, kV2Wide, 1},
        ContiguousCase{
            "N640_K1152_holes_two_ctas_v2_wide_m256", {5, 130, 0, 33, 260}, 640, 1152, 1, true, kV2Wide, 2},
        ContiguousCase{
            "N1536_K2048_three_ctas_v2_wide_m256", {300, 0, 520, 129}, 1536, 2048, 0, false, kV2Wide, 3},
        ContiguousCase{
            "N640_K2048_halves_only_two_ctas_v2_wide_m256", {100, 5, 60}, 640, 2048, 0, true, kV2Wide, 2},
        ContiguousCase{"N640_K1152_split_eight_ctas_v2_wide_m256",
                       {100, 5, 300, 60, 20, 90},
                       640,
                       1152,
                       1,
                       true,
                       kV2Wide,
                       8},
        ContiguousCase{
            "N640_K2048_holes_v2_signed_m128", {5, 17, 0, 128, 1, 90}, 640, 2048, 1, true, kV2Signed128},
        // The automatic choice on groups of >= 128 rows on average (padding included): v2's wide tile,
        // with large groups and with groups of one or two blocks (many half tiles); below, 128 x 128.
        ContiguousCase{"N384_K384_large_groups_auto_wide", {1100, 2400, 0, 700}, 384, 384, 0, true, {}},
        ContiguousCase{
            "N384_K384_larger_groups_auto_wide_no_half_loop", {2100, 3000, 2400, 0}, 384, 384, 0, true, {}},
        ContiguousCase{
            "N640_K1152_small_groups_auto_wide", {90, 200, 130, 1, 256, 60}, 640, 1152, 0, true, {}},
        ContiguousCase{
            "N640_K2048_sparse_groups_auto_128", {90, 0, 0, 200, 0, 0, 33}, 640, 2048, 0, false, {}},
        // v2 (128 x 128) with the offset warp.
        ContiguousCase{"N7168_K2048_v2_offwarp", {150, 0, 64, 33}, 7168, 2048, 0, false, kOffsetWarp},
        ContiguousCase{
            "N1536_K1152_odd_k_blocks_holes_v2_offwarp", {5, 130, 0, 33}, 1536, 1152, 1, true, kOffsetWarp},
        ContiguousCase{"N1536_K1152_odd_k_blocks_holes_v2_offwarp_k2",
                       {5, 130, 0, 33},
                       1536,
                       1152,
                       1,
                       true,
                       kOffsetWarpK2},
        // v2 (128 x 128) with three K blocks per stage (9 per tile: a partial last stage).
        ContiguousCase{"N1536_K1152_odd_k_blocks_holes_v2_k3", {5, 130, 0, 33}, 1536, 1152, 1, true, kK3}),
    [](const ::testing::TestParamInfo<ContiguousCase>& info) { return info.param.name; });

// The masked GEMM captured once in a CUDA graph, replayed with new counts written on the device;
// with row_sums, the 32-row tile with the row-sum pre-pass (two kernels in the graph).
void masked_graph_replay(bool row_sums) {
  testing::SeededRng rng;
  const std::int64_t G = 3, M_max = 24, N = 1536, K = 2048;
  const std::vector<std::int32_t> first{5, 24, 0}, second{0, 13, 17};
  const MaskedInputs in = masked_inputs(G, M_max, N, K, {24, 24, 24}, rng);
  const float a_scale = random_a_scale(rng);

  cuda::Stream stream;
  const DeviceWeights dw = prepare(in.w, stream);
  const cuda::DeviceTensor da = cuda::to_device(in.a, stream);
  const cuda::DeviceTensor dcounts(DType::i32, {G}), dd(DType::bf16, {G, M_max, N});
  dcounts.fill_bytes(0x00, stream);
  cuda::W4A8GemmOptions options;
  cuda::DeviceTensor workspace;
  if (row_sums) {
    workspace = cuda::DeviceTensor(DType::f32,
                                   {static_cast<std::int64_t>(cuda::w4a8_workspace_bytes(G, M_max, K) / 4)});
    workspace.fill_bytes(0xff, stream);
    options.workspace = workspace.view();
    options.block_m = 32;
  }
  const PinKernel pin(row_sums ? kRSP2 : cuda::W4A8KernelChoice{});
  cuda::w4a8_grouped_gemm_masked(da, a_scale, {}, dw.w, dw.s, dcounts, 8, dd, stream, options);
  stream.synchronize();

  const cuda::Graph graph = cuda::Graph::capture(stream, [&] {
    cuda::w4a8_grouped_gemm_masked(da, a_scale, {}, dw.w, dw.s, dcounts, 8, dd, stream, options);
  });
  for (const auto* counts : {&first, &second}) {
    HostTensor hc(DType::i32, {G});
    std::memcpy(hc.data<std::int32_t>(), counts->data(), static_cast<std::size_t>(G) * sizeof(std::int32_t));
    cuda::copy_to_device(dcounts, hc, stream);
    dd.fill_bytes(0xff, stream);
    graph.launch(stream);
    const HostTensor got = cuda::to_host(dd, stream);
    HostTensor ref(DType::f64, {G, M_max, N});
    w4a8_grouped_gemm_masked_cpu(in.a, a_scale, in.w.w, packed_scales(in.w.s), hc, ref);
    check_output(got, ref, masked_valid(*counts, M_max), N);
  }
}

// The row-sum pre-pass's output, read back from options.workspace after a call, against a CPU mirror
// of the kernel's summation order (per 16 bytes ((b0 + b1) + (b2 + b3)) + ((b4 + b5) + (b6 + b7)) ...,
// then the 8 pieces of a K block as a tree: bit for bit): the term of every valid row, 0 for the rows
// up to the next multiple of 32, and the rest untouched (still the NaN poison).
float row_sum_term_mirror(const std::uint8_t* block) {
  const auto f = [&](int i) { return fp8_e4m3::from_bits(block[i]).to_float(); };
  float piece[8];
  for (int c = 0; c < 8; ++c) {
    const int b = 16 * c;
    float word[4];
    for (int w = 0; w < 4; ++w)
      word[w] = (f(b + 4 * w) + f(b + 4 * w + 1)) + (f(b + 4 * w + 2) + f(b + 4 * w + 3));
    piece[c] = (word[0] + word[1]) + (word[2] + word[3]);
  }
  const float sum =
      ((piece[0] + piece[1]) + (piece[2] + piece[3])) + ((piece[4] + piece[5]) + (piece[6] + piece[7]));
  return w4a8::kOffsetFactor * sum;
}

// ---------------------------------------------------------------- random problems, automatic choice
// As the FP8 sweep (GroupedGemmSweepGpu): random problems (tests/gemm/gemm_test_util.hpp's draws: group
// counts, rows, N, K, a hint sometimes far off) under the automatic kernel choice, with either codes,
// and in the masked layout a device or host activation scale and a workspace or none.
void sweep(bool masked) {
  testing::SeededRng rng;
  for (int i = 0; i < testing::kSweepProblems; ++i) {
    const testing::SweepProblem p =
        masked ? testing::draw_masked_problem(rng) : testing::draw_contiguous_problem(rng);
    const cuda::W4A8Codes codes =
        testing::uniform(rng, 0, 1) == 0 ? cuda::W4A8Codes::offset_binary : cuda::W4A8Codes::sign_magnitude;
    std::ostringstream what;
    what << "problem " << i << ": " << p.describe() << "; "
         << (codes == cuda::W4A8Codes::sign_magnitude ? "sign-magnitude" : "offset-binary") << " codes";
    if (masked) {
      MaskedCase c{"sweep", p.m_max, p.rows, p.n, p.k};
      c.expected_m = p.expected_m;
      c.device_masked_m = p.device_rows;
      c.codes = codes;
      c.device_scale = testing::uniform(rng, 0, 1) == 0;
      c.workspace = testing::uniform(rng, 0, 1) == 0;
      what << ", " << (c.device_scale ? "device" : "host") << " scale, workspace " << c.workspace
           << ", tile block_m " << cuda::w4a8_gemm_tile(true, p.expected_m).block_m;
      SCOPED_TRACE(what.str());
      std::printf("  %s\n", what.str().c_str());
      check_masked_case(c, rng);
    } else {
      ContiguousCase c{"sweep", {p.rows.begin(), p.rows.end()}, p.n, p.k, p.trailing_blocks, p.holes};
      c.codes = codes;
      SCOPED_TRACE(what.str());
      std::printf("  %s\n", what.str().c_str());
      check_contiguous_case(c, rng);
    }
  }
}

TEST(W4A8GemmSweepGpu, RandomMaskedProblemsWithTheAutomaticChoice) {
  EPMOE_REQUIRE_GPU();
  sweep(true);
}

TEST(W4A8GemmSweepGpu, RandomContiguousProblemsWithTheAutomaticChoice) {
  EPMOE_REQUIRE_GPU();
  sweep(false);
}

TEST(W4A8GemmGpuMisc, RowSumsMatchTheCpuMirror) {
  EPMOE_REQUIRE_GPU();
  testing::SeededRng rng;
  const std::vector<std::int32_t> counts{40, 7, 0, 33};
  const auto G = static_cast<std::int64_t>(counts.size());
  const std::int64_t M_max = 40, N = 512, K = 1152;
  const MaskedInputs in = masked_inputs(G, M_max, N, K, counts, rng);
  cuda::Stream stream;
  const DeviceWeights dw = prepare(in.w, stream);
  const cuda::DeviceTensor da = cuda::to_device(in.a, stream), dcounts = cuda::to_device(in.counts, stream);
  const cuda::DeviceTensor dd(DType::bf16, {G, M_max, N});
  const std::size_t bytes = cuda::w4a8_workspace_bytes(G, M_max, K);
  const cuda::DeviceTensor workspace(DType::f32, {static_cast<std::int64_t>(bytes / 4)});
  workspace.fill_bytes(0xff, stream);
  cuda::W4A8GemmOptions options;
  options.block_m = 32;
  options.workspace = workspace.view();
  const PinKernel pin(kRS);
  cuda::w4a8_grouped_gemm_masked(da, 0.01f, {}, dw.w, dw.s, dcounts, 20, dd, stream, options);
  const HostTensor got = cuda::to_host(workspace, stream);
  const auto* sums = got.data<float>();
  const std::int64_t num_kb = K / 128, rows = w4a8::row_sums_rows(M_max);
  ASSERT_EQ(static_cast<std::int64_t>(bytes), G * num_kb * rows * 4 + 16);  // + the tile counter's 16
  const auto* a = static_cast<const std::uint8_t*>(in.a.view().data);
  std::int64_t checked = 0;
  for (std::int64_t g = 0; g < G; ++g) {
    const std::int64_t count = counts[static_cast<std::size_t>(g)];
    const std::int64_t zeros_to = std::min(w4a8::row_sums_rows(count), rows);
    for (std::int64_t kb = 0; kb < num_kb; ++kb) {
      for (std::int64_t r = 0; r < rows; ++r) {
        const float v = sums[w4a8::row_sums_index(g, num_kb, kb, rows, r)];
        if (r < count) {
          const float want = row_sum_term_mirror(a + (g * M_max + r) * K + kb * 128);
          ASSERT_EQ(std::memcmp(&v, &want, 4), 0)
              << "group " << g << " K block " << kb << " row " << r << ": " << v << " against " << want;
          ++checked;
        } else if (r < zeros_to) {
          ASSERT_EQ(v, 0.0f) << "group " << g << " K block " << kb << " row " << r << " (past the count)";
        } else {
          ASSERT_TRUE(std::isnan(v)) << "group " << g << " K block " << kb << " row " << r << " was written";
        }
      }
    }
  }
  EXPECT_EQ(checked, (40 + 7 + 0 + 33) * num_kb);
}

TEST(W4A8GemmGpuMisc, MaskedReplaysInACudaGraph) {
  EPMOE_REQUIRE_GPU();
  masked_graph_replay(false);
}

TEST(W4A8GemmGpuMisc, MaskedWithRowSumsReplaysInACudaGraph) {
  EPMOE_REQUIRE_GPU();
  masked_graph_replay(true);
}

// The dynamic tile schedule (W4A8GemmOptions::dynamic_tiles, masked decode tiles with a workspace)
// against the static one on the same inputs: bit for bit (a tile's sums do not depend on the CTA that
// runs it), and both against the CPU reference; repeated eager calls on a workspace zeroed once, a
// graph replayed three times (the launch's tag baked in: each replay must find the counter reset by
// the one before), eager again after the graph (another tag), and a workspace of garbage. The 16-row
// tile on the sign-magnitude codes (four and two consumers; the offset-binary codes keep the static
// schedule, which must leave the counter alone), few CTAs (max_ctas 5) with many tiles each, groups of
// several 16-row blocks, an empty group, an odd K-block count.
struct DynamicCase {
  std::string name;
  cuda::W4A8Codes codes;
  int consumers = 0;    // options.consumers: 0 (four on the 16-row tile) or 2
  bool dynamic = true;  // false: the codes keep the static schedule (the counter is never touched)
};
class W4A8GemmDynamicTilesGpu : public ::testing::TestWithParam<DynamicCase> {};
void PrintTo(const DynamicCase& c, std::ostream* os) {
  *os << c.name;
}

TEST_P(W4A8GemmDynamicTilesGpu, MatchTheStaticScheduleEagerAndInGraphs) {
  EPMOE_REQUIRE_GPU();
  const DynamicCase& c = GetParam();
  testing::SeededRng rng;
  const std::vector<std::int32_t> counts{7, 40, 0, 16, 33, 1, 12, 25, 8, 3};
  const auto G = static_cast<std::int64_t>(counts.size());
  const std::int64_t M_max = 40, N = 1536, K = 1152;
  const MaskedInputs in = masked_inputs(G, M_max, N, K, counts, rng, c.codes);
  const float a_scale = random_a_scale(rng);
  HostTensor ref(DType::f64, {G, M_max, N});
  w4a8_grouped_gemm_masked_cpu(in.a, a_scale, in.w.w, packed_scales(in.w.s), in.counts, ref);

  cuda::Stream stream;
  const DeviceWeights dw = prepare(in.w, stream, c.codes);
  const cuda::DeviceTensor da = cuda::to_device(in.a, stream), dcounts = cuda::to_device(in.counts, stream);
  const cuda::DeviceTensor dd(DType::bf16, {G, M_max, N});
  const cuda::DeviceTensor workspace(
      DType::f32, {static_cast<std::int64_t>(cuda::w4a8_workspace_bytes(G, M_max, K) / 4)});
  workspace.fill_bytes(0x00, stream);
  cuda::W4A8GemmOptions options;
  options.codes = c.codes;
  options.max_ctas = 5;
  options.workspace = workspace.view();
  options.block_m = 16;  // the tile with the dynamic schedule
  options.consumers = c.consumers;
  const auto call = [&](bool dynamic) {
    cuda::W4A8GemmOptions o = options;
    o.dynamic_tiles = dynamic;
    cuda::w4a8_grouped_gemm_masked(da, a_scale, {}, dw.w, dw.s, dcounts, 8, dd, stream, o);
  };
  const auto run_eager = [&](bool dynamic) {
    dd.fill_bytes(0xff, stream);
    call(dynamic);
    return cuda::to_host(dd, stream);
  };
  const HostTensor fixed = run_eager(false);
  check_output(fixed, ref, masked_valid(counts, M_max), N);
  const auto expect_same = [&](const HostTensor& got, const std::string& what) {
    EXPECT_EQ(std::memcmp(got.view().data, fixed.view().data, fixed.nbytes()), 0)
        << what << " differs from the static schedule";
  };
  for (int i = 0; i < 3; ++i) expect_same(run_eager(true), "eager call " + std::to_string(i));

  {
    const cuda::Graph graph = cuda::Graph::capture(stream, [&] { call(true); });
    for (int i = 0; i < 3; ++i) {
      dd.fill_bytes(0xff, stream);
      graph.launch(stream);
      expect_same(cuda::to_host(dd, stream), "graph replay " + std::to_string(i));
    }
  }
  expect_same(run_eager(true), "the eager call after the graph");
  workspace.fill_bytes(0xa5, stream);
  expect_same(run_eager(true), "the call on a workspace of garbage");
  // The counter is left at (the last tag, 0): its low word reads 0 (or, static, the garbage as it was).
  const HostTensor ws = cuda::to_host(workspace, stream);
  std::uint64_t word = 0;
  std::memcpy(&word, static_cast<const char*>(ws.view().data) + ws.nbytes() - 16, sizeof(word));
  if (c.dynamic) {
    EXPECT_EQ(word & 0xffffffffull, 0u) << "the counter was not reset";
    EXPECT_NE(word >> 32, 0u) << "the counter holds no launch tag";
  } else {
    EXPECT_EQ(word, 0xa5a5a5a5a5a5a5a5ull) << "the static schedule wrote the counter";
  }
}

INSTANTIATE_TEST_SUITE_P(Tiles, W4A8GemmDynamicTilesGpu,
                         ::testing::Values(DynamicCase{"block16_sm", kSM},
                                           DynamicCase{"block16_consumers2_sm", kSM, 2},
                                           DynamicCase{"block16_offset_binary_stays_static",
                                                       cuda::W4A8Codes::offset_binary, 0, false}),
                         [](const ::testing::TestParamInfo<DynamicCase>& info) { return info.param.name; });

TEST(W4A8GemmGpuMisc, RefusesBadArguments) {
  EPMOE_REQUIRE_GPU();
  cuda::Stream stream;
  const std::int64_t G = 2, M_max = 20, N = 256, K = 256;
  const cuda::DeviceTensor a(DType::fp8_e4m3, {G, M_max, K}), w(DType::i4x2, {G, N, K / 2}),
      s(DType::bf16, {G, N, K / 128}), counts(DType::i32, {G}), d(DType::bf16, {G, M_max, N});
  a.fill_bytes(0x38, stream);
  w.fill_bytes(0x11, stream);
  s.fill_bytes(0x3c, stream);
  counts.fill_bytes(0x00, stream);
  using cuda::w4a8_grouped_gemm_masked;
  EXPECT_NO_THROW(w4a8_grouped_gemm_masked(a, 1.0f, {}, w, s, counts, 8, d, stream));
  {
    // v2's wide tile pairs the contiguous layout's 128-row blocks: masked calls are refused.
    const PinKernel pin(kV2Wide);
    expect_error_mentions([&] { w4a8_grouped_gemm_masked(a, 1.0f, {}, w, s, counts, 8, d, stream); },
                          "the W4A8 v2 tile with block_m = 256 is for the contiguous layout only");
  }
  expect_error_mentions([&] { w4a8_grouped_gemm_masked(a, 0.0f, {}, w, s, counts, 8, d, stream); },
                        "a_scale must be positive and finite");
  expect_error_mentions([&] { w4a8_grouped_gemm_masked(a, std::nanf(""), {}, w, s, counts, 8, d, stream); },
                        "a_scale must be positive and finite");
  const cuda::DeviceTensor scale2(DType::f32, {2});
  expect_error_mentions([&] { w4a8_grouped_gemm_masked(a, 1.0f, scale2, w, s, counts, 8, d, stream); },
                        "a_scale_device must have shape [1]");
  const cuda::DeviceTensor w_k(DType::i4x2, {G, N, 100});
  expect_error_mentions([&] { w4a8_grouped_gemm_masked(a, 1.0f, {}, w_k, s, counts, 8, d, stream); },
                        "packed_w: K = 200 (2 x its last dimension) must be a positive multiple of 128");
  const cuda::DeviceTensor w_n(DType::i4x2, {G, 192, K / 2});
  expect_error_mentions([&] { w4a8_grouped_gemm_masked(a, 1.0f, {}, w_n, s, counts, 8, d, stream); },
                        "packed_w: N = 192 must be a positive multiple of 128");
  const cuda::DeviceTensor w_fp8(DType::fp8_e4m3, {G, N, K / 2});
  expect_error_mentions([&] { w4a8_grouped_gemm_masked(a, 1.0f, {}, w_fp8, s, counts, 8, d, stream); },
                        "packed_w must have dtype i4x2");
  const cuda::DeviceTensor s_f32(DType::f32, {G, N, K / 128});
  expect_error_mentions([&] { w4a8_grouped_gemm_masked(a, 1.0f, {}, w, s_f32, counts, 8, d, stream); },
                        "packed_scales must have dtype bf16");
  const cuda::DeviceTensor s_bad(DType::bf16, {G, N / 128, K / 128});
  expect_error_mentions([&] { w4a8_grouped_gemm_masked(a, 1.0f, {}, w, s_bad, counts, 8, d, stream); },
                        "packed_scales must have shape [2, 256, 2]");
  const cuda::DeviceTensor a_k(DType::fp8_e4m3, {G, M_max, 2 * K});
  expect_error_mentions([&] { w4a8_grouped_gemm_masked(a_k, 1.0f, {}, w, s, counts, 8, d, stream); },
                        "a (G and K of packed_w)");
  const cuda::DeviceTensor counts_bad(DType::i32, {G + 1});
  expect_error_mentions([&] { w4a8_grouped_gemm_masked(a, 1.0f, {}, w, s, counts_bad, 8, d, stream); },
                        "masked_m must have shape [2]");
  const cuda::DeviceTensor d_f32(DType::f32, {G, M_max, N});
  expect_error_mentions([&] { w4a8_grouped_gemm_masked(a, 1.0f, {}, w, s, counts, 8, d_f32, stream); },
                        "d must have dtype bf16");
  expect_error_mentions([&] { w4a8_grouped_gemm_masked(a, 1.0f, {}, w, s, counts, -1, d, stream); },
                        "expected_m must be >= 0");
  cuda::W4A8GemmOptions bad_m;
  bad_m.block_m = 48;
  expect_error_mentions([&] { w4a8_grouped_gemm_masked(a, 1.0f, {}, w, s, counts, 8, d, stream, bad_m); },
                        "options.block_m must be 0 (automatic), 16, 32, 64 or 128");
  cuda::W4A8GemmOptions bad_c;
  bad_c.block_m = 64;
  bad_c.consumers = 4;
  expect_error_mentions([&] { w4a8_grouped_gemm_masked(a, 1.0f, {}, w, s, counts, 8, d, stream, bad_c); },
                        "options.consumers = 4 needs block_m <= 32");
  cuda::W4A8GemmOptions bad_stages;
  bad_stages.stages = 99;
  expect_error_mentions(
      [&] { w4a8_grouped_gemm_masked(a, 1.0f, {}, w, s, counts, 8, d, stream, bad_stages); },
      "options.stages must be 0 (all) or 1..");
  cuda::W4A8GemmOptions small_ws;
  const cuda::DeviceTensor ws_small(
      DType::f32, {static_cast<std::int64_t>(cuda::w4a8_workspace_bytes(G, M_max, K) / 4) - 4});
  small_ws.workspace = ws_small.view();
  expect_error_mentions([&] { w4a8_grouped_gemm_masked(a, 1.0f, {}, w, s, counts, 8, d, stream, small_ws); },
                        "must hold at least 528 bytes (w4a8_workspace_bytes(2, 20, 256))");
  cuda::W4A8GemmOptions d_ws;
  d_ws.workspace = TensorView::contiguous(d.view().data, DType::f32,
                                          {static_cast<std::int64_t>(d.view().nbytes() / 4)}, Device::cuda);
  expect_error_mentions([&] { w4a8_grouped_gemm_masked(a, 1.0f, {}, w, s, counts, 8, d, stream, d_ws); },
                        "options.workspace must not overlap d");
  cuda::W4A8GemmOptions i32_ws;
  const cuda::DeviceTensor ws_i32(DType::i32, {1024});
  i32_ws.workspace = ws_i32.view();
  expect_error_mentions([&] { w4a8_grouped_gemm_masked(a, 1.0f, {}, w, s, counts, 8, d, stream, i32_ws); },
                        "options.workspace must have dtype f32");
  const HostTensor a_host(DType::fp8_e4m3, {G, M_max, K});
  expect_error_mentions([&] { w4a8_grouped_gemm_masked(a_host, 1.0f, {}, w, s, counts, 8, d, stream); },
                        "a must live on cuda");

  // Contiguous.
  const std::int64_t M = 256;
  const cuda::DeviceTensor ac(DType::fp8_e4m3, {M, K}), ids(DType::i32, {M}), dc(DType::bf16, {M, N});
  ac.fill_bytes(0x38, stream);
  ids.fill_bytes(0x00, stream);
  using cuda::w4a8_grouped_gemm_contiguous;
  EXPECT_NO_THROW(w4a8_grouped_gemm_contiguous(ac, 1.0f, {}, w, s, ids, dc, stream));
  const cuda::DeviceTensor ids_bad(DType::i32, {M + 1});
  expect_error_mentions([&] { w4a8_grouped_gemm_contiguous(ac, 1.0f, {}, w, s, ids_bad, dc, stream); },
                        "m_indices must have shape [256]");
  cuda::W4A8GemmOptions small;
  small.block_m = 16;
  expect_error_mentions([&] { w4a8_grouped_gemm_contiguous(ac, 1.0f, {}, w, s, ids, dc, stream, small); },
                        "options.block_m must be 0 or 128 for the contiguous layout");
  const cuda::DeviceBuffer raw(static_cast<std::size_t>(M * K) + 64);
  TensorView a_off = raw.view(DType::fp8_e4m3, {M, K});
  a_off.data = static_cast<std::byte*>(a_off.data) + 8;
  expect_error_mentions([&] { w4a8_grouped_gemm_contiguous(a_off, 1.0f, {}, w, s, ids, dc, stream); },
                        "a must be 16-byte aligned");

  // Preparation.
  const cuda::DeviceTensor pw(DType::i4x2, {G, N, K / 2}), ps(DType::bf16, {G, N, K / 128});
  expect_error_mentions([&] { cuda::w4a8_prepare_weights(w, s_f32, w, ps, stream); },
                        "must not alias the inputs");
  const cuda::DeviceTensor pw_small(DType::i4x2, {G, N - 128, K / 2});
  expect_error_mentions([&] { cuda::w4a8_prepare_weights(w, s_f32, pw_small, ps, stream); },
                        "packed_scales must have shape");
  expect_error_mentions([&] { cuda::w4a8_prepare_weights(w, s, pw, ps, stream); },
                        "w_scales must have dtype f32");
  stream.synchronize();
}

}  // namespace
}  // namespace epmoe
