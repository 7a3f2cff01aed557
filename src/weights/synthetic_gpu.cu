// Synthetic FP8 experts on the GPU (epmoe/cuda/synthetic.hpp).
#include <cmath>

#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/launch.hpp"
#include "epmoe/cuda/synthetic.hpp"
#include "weights/synthetic_kernels.cuh"
#include "weights/synthetic_math.hpp"

namespace epmoe::cuda {
namespace {

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
