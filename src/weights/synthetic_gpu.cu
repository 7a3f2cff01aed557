// Synthetic FP8 experts on the GPU (epmoe/cuda/synthetic.hpp).
#include <cmath>

#include "cuda/ptx.cuh"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/launch.hpp"
#include "epmoe/cuda/synthetic.hpp"
#include "weights/synthetic_math.hpp"

namespace epmoe::cuda {
namespace {

constexpr int kBlock = 128;                             // checkpoint scale block (rows and columns)
constexpr int kThreads = 256;                           // one CTA per 128 x 128 block
constexpr int kPerThread = kBlock * kBlock / kThreads;  // 64 values per thread

// One 128 x 128 block of an [N, K] matrix: values bound * uniform_pm1(stream, row * K + col), then
// quantized with the block's amax as quantize_block_fp8 does. N and K are multiples of 128.
__global__ void __launch_bounds__(kThreads)
    synthetic_block_fp8_kernel(std::uint64_t stream, float bound, std::uint32_t K,
                               std::uint8_t* __restrict__ q, float* __restrict__ scale_inv) {
  __shared__ float warp_max[kThreads / 32];
  const std::uint32_t cb = blockIdx.x, rb = blockIdx.y;
  float v[kPerThread];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const std::uint32_t idx = threadIdx.x + j * kThreads;
    const std::uint64_t row = rb * kBlock + idx / kBlock, col = cb * kBlock + idx % kBlock;
    v[j] = detail::rn_mul(bound, detail::synth_uniform_pm1(stream, row * K + col));
    amax = fmaxf(amax, fabsf(v[j]));
  }
  for (int offset = 16; offset > 0; offset /= 2)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_max[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) amax = fmaxf(amax, warp_max[w]);
  const float scale = fmaxf(amax, 1e-10f) / 448.0f;  // == fp8_scale_for_amax (kMinAmax, IEEE division)
  if (threadIdx.x == 0) scale_inv[rb * (K / kBlock) + cb] = scale;
#pragma unroll
  for (int j = 0; j < kPerThread; j += 2) {
    const std::uint32_t idx = threadIdx.x + j * kThreads;
    const std::uint16_t pair = ptx::float2_to_e4m3x2(v[j] / scale, v[j + 1] / scale);
    const std::uint64_t row = rb * kBlock + idx / kBlock, col = cb * kBlock + idx % kBlock;
    const std::uint64_t row2 = rb * kBlock + (idx + kThreads) / kBlock,
                        col2 = cb * kBlock + (idx + kThreads) % kBlock;
    q[row * K + col] = static_cast<std::uint8_t>(pair & 0xff);
    q[row2 * K + col2] = static_cast<std::uint8_t>(pair >> 8);
  }
}

// An [n, k] weight matrix in checkpoint format: w (wtype, [n, k / per_byte]) and its f32 scales.
void check_matrix(const TensorView& w, const TensorView& s, DType wtype, std::int64_t n, std::int64_t k,
                  std::int64_t scale_rows, std::int64_t scale_cols, const char* wname, const char* sname) {
  expect_dtype(w, wtype, wname);
  expect_shape(w, {n, wtype == DType::i4x2 ? k / 2 : k}, wname);
  expect_device(w, Device::cuda, wname);
  expect_contiguous(w, wname);
  expect_dtype(s, DType::f32, sname);
  expect_shape(s, {scale_rows, scale_cols}, sname);
  expect_device(s, Device::cuda, sname);
  expect_contiguous(s, sname);
}

// One warp per (row, 128-wide group) of an [N, K] matrix in the W4A8 checkpoint format, as
// quantize_int4_grouped does: scale = max(amax, kMinAmax) / 7, q = clamp(rint(x / scale), -8, 7)
// (round half to even), two values per byte, the even column in the low nibble.
constexpr int kInt4WarpsPerBlock = kThreads / 32;
__global__ void __launch_bounds__(kThreads)
    synthetic_int4_kernel(std::uint64_t stream, float bound, std::uint32_t K, std::uint64_t num_groups,
                          std::uint8_t* __restrict__ packed, float* __restrict__ scales) {
  const std::uint64_t group = blockIdx.x * static_cast<std::uint64_t>(kInt4WarpsPerBlock) + threadIdx.x / 32;
  if (group >= num_groups) return;  // the whole warp leaves together
  const int lane = threadIdx.x % 32;
  const std::uint32_t groups_per_row = K / kBlock;
  const std::uint64_t row = group / groups_per_row, g = group % groups_per_row;
  const std::uint64_t col0 = g * kBlock + static_cast<std::uint64_t>(lane) * 4;
  float v[4];
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[i] = detail::rn_mul(bound, detail::synth_uniform_pm1(stream, row * K + col0 + i));
    amax = fmaxf(amax, fabsf(v[i]));
  }
  for (int offset = 16; offset > 0; offset /= 2)
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  const float scale = fmaxf(amax, 1e-10f) / 7.0f;
  unsigned q[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    q[i] = static_cast<unsigned>(static_cast<int>(fminf(fmaxf(rintf(v[i] / scale), -8.0f), 7.0f))) & 0xfu;
  std::uint8_t* dst = packed + row * (K / 2) + col0 / 2;
  dst[0] = static_cast<std::uint8_t>(q[0] | (q[1] << 4));
  dst[1] = static_cast<std::uint8_t>(q[2] | (q[3] << 4));
  if (lane == 0) scales[row * groups_per_row + g] = scale;
}

void launch_int4_matrix(std::uint64_t stream_id, float bound, std::int64_t n, std::int64_t k,
                        const TensorView& w, const TensorView& s, cudaStream_t stream) {
  const auto groups = static_cast<std::uint64_t>(n * (k / kBlock));
  const auto blocks = static_cast<unsigned>((groups + kInt4WarpsPerBlock - 1) / kInt4WarpsPerBlock);
  synthetic_int4_kernel<<<blocks, kThreads, 0, stream>>>(stream_id, bound, static_cast<std::uint32_t>(k),
                                                         groups, static_cast<std::uint8_t*>(w.data),
                                                         s.as<float>());
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_matrix(std::uint64_t stream_id, float bound, std::int64_t n, std::int64_t k, const TensorView& w,
                   const TensorView& s, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(k / kBlock), static_cast<unsigned>(n / kBlock));
  synthetic_block_fp8_kernel<<<grid, kThreads, 0, stream>>>(
      stream_id, bound, static_cast<std::uint32_t>(k), static_cast<std::uint8_t*>(w.data), s.as<float>());
  EPMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

void synthetic_expert_fp8(std::uint64_t seed, std::int64_t hidden, std::int64_t intermediate, TensorView w13,
                          TensorView w13_scale, TensorView w2, TensorView w2_scale, cudaStream_t stream) {
  const std::int64_t H = hidden, I = intermediate;
  EPMOE_CHECK(H > 0 && H % kBlock == 0 && I > 0 && I % kBlock == 0,
              "hidden and intermediate must be positive multiples of 128, got {} and {}", H, I);
  check_matrix(w13, w13_scale, DType::fp8_e4m3, 2 * I, H, 2 * I / kBlock, H / kBlock, "w13", "w13_scale");
  check_matrix(w2, w2_scale, DType::fp8_e4m3, H, I, H / kBlock, I / kBlock, "w2", "w2_scale");
  // The same streams and bounds as make_synthetic_expert (src/weights/synthetic.cpp).
  launch_matrix(detail::splitmix64(seed ^ detail::kTagW13), 1.0f / std::sqrt(static_cast<float>(H)), 2 * I, H,
                w13, w13_scale, stream);
  launch_matrix(detail::splitmix64(seed ^ detail::kTagW2), 1.0f / std::sqrt(static_cast<float>(I)), H, I, w2,
                w2_scale, stream);
}

void synthetic_expert_w4a8(std::uint64_t seed, std::int64_t hidden, std::int64_t intermediate, TensorView w13,
                           TensorView w13_scale, TensorView w2, TensorView w2_scale, cudaStream_t stream) {
  const std::int64_t H = hidden, I = intermediate;
  EPMOE_CHECK(H > 0 && H % kBlock == 0 && I > 0 && I % kBlock == 0,
              "hidden and intermediate must be positive multiples of 128, got {} and {}", H, I);
  check_matrix(w13, w13_scale, DType::i4x2, 2 * I, H, 2 * I, H / kBlock, "w13", "w13_scale");
  check_matrix(w2, w2_scale, DType::i4x2, H, I, H, I / kBlock, "w2", "w2_scale");
  launch_int4_matrix(detail::splitmix64(seed ^ detail::kTagW13), 1.0f / std::sqrt(static_cast<float>(H)),
                     2 * I, H, w13, w13_scale, stream);
  launch_int4_matrix(detail::splitmix64(seed ^ detail::kTagW2), 1.0f / std::sqrt(static_cast<float>(I)), H, I,
                     w2, w2_scale, stream);
}

SyntheticWeights::ExpertFactory gpu_expert_factory(int device) {
  return [device](QuantScheme quant, std::int64_t H, std::int64_t I,
                  std::uint64_t seed) -> std::unique_ptr<ExpertWeights> {
    if (quant == QuantScheme::none) return make_synthetic_expert(quant, H, I, seed);
    int previous = 0;
    EPMOE_CUDA_CHECK(cudaGetDevice(&previous));
    EPMOE_CUDA_CHECK(cudaSetDevice(device));
    const bool fp8 = quant == QuantScheme::fp8;
    const DType wtype = fp8 ? DType::fp8_e4m3 : DType::i4x2;
    const std::int64_t kdiv = fp8 ? 1 : 2;  // int4: two values per byte
    auto e = std::make_unique<ExpertWeights>();
    e->quant = quant;
    e->hidden = H;
    e->intermediate = I;
    e->w13 = HostTensor(wtype, {2 * I, H / kdiv});
    e->w2 = HostTensor(wtype, {H, I / kdiv});
    if (fp8) {
      e->w13_scale = HostTensor(DType::f32, {2 * I / kBlock, H / kBlock});
      e->w2_scale = HostTensor(DType::f32, {H / kBlock, I / kBlock});
    } else {
      e->w13_scale = HostTensor(DType::f32, {2 * I, H / kBlock});
      e->w2_scale = HostTensor(DType::f32, {H, I / kBlock});
    }
    {
      Stream stream;
      DeviceTensor w13(wtype, {2 * I, H / kdiv}), w2(wtype, {H, I / kdiv});
      DeviceTensor s13(DType::f32, {e->w13_scale.size(0), e->w13_scale.size(1)});
      DeviceTensor s2(DType::f32, {e->w2_scale.size(0), e->w2_scale.size(1)});
      if (fp8) {
        synthetic_expert_fp8(seed, H, I, w13, s13, w2, s2, stream);
      } else {
        synthetic_expert_w4a8(seed, H, I, w13, s13, w2, s2, stream);
      }
      copy_to_host(e->w13, w13, stream);
      copy_to_host(e->w13_scale, s13, stream);
      copy_to_host(e->w2, w2, stream);
      copy_to_host(e->w2_scale, s2, stream);
      stream.synchronize();
    }
    EPMOE_CUDA_CHECK(cudaSetDevice(previous));
    e->validate();
    return e;
  };
}

}  // namespace epmoe::cuda
