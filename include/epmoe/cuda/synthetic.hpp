// Synthetic model weights generated on the GPU, bit-identical with the CPU's
// make_synthetic_expert (epmoe/weights.hpp): the same counter-based values (the generator is one
// function compiled for both), quantized to the 128 x 128 block FP8 checkpoint format exactly as
// quantize_block_fp8 does (amax, scale = max(amax, kMinAmax) / 448, e4m3 of x / scale, RNE,
// saturating). A DeepSeek-V3 expert (44 MB of FP8) takes well under a millisecond here against
// about a second on one CPU core, so GPU runs fill their expert slots this way, and the CPU
// reference of a GPU run gets its experts from here too (gpu_expert_factory).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "epmoe/tensor.hpp"
#include "epmoe/weights.hpp"

namespace epmoe::cuda {

// One FP8 expert (QuantScheme::fp8) of make_synthetic_expert(fp8, hidden, intermediate, seed):
//   w13 [2I, H] fp8_e4m3, w13_scale [2I/128, H/128] f32, w2 [H, I] fp8_e4m3, w2_scale [H/128, I/128] f32,
// contiguous Device::cuda views (e.g. one slot of a [slots, ...] tensor). Only enqueues work.
void synthetic_expert_fp8(std::uint64_t seed, std::int64_t hidden, std::int64_t intermediate, TensorView w13,
                          TensorView w13_scale, TensorView w2, TensorView w2_scale, cudaStream_t stream);

// One W4A8 expert (QuantScheme::w4a8, the checkpoint format, bit-identical with
// make_synthetic_expert(w4a8, ...): quantize_int4_grouped's scales and round-half-even):
//   w13 [2I, H/2] i4x2, w13_scale [2I, H/128] f32, w2 [H, I/2] i4x2, w2_scale [H, I/128] f32.
void synthetic_expert_w4a8(std::uint64_t seed, std::int64_t hidden, std::int64_t intermediate, TensorView w13,
                           TensorView w13_scale, TensorView w2, TensorView w2_scale, cudaStream_t stream);

// A SyntheticWeights::ExpertFactory that builds FP8 and W4A8 experts on `device` (through a
// temporary buffer, synchronously) and copies them to the host; unquantized ones on the CPU.
SyntheticWeights::ExpertFactory gpu_expert_factory(int device);

}  // namespace epmoe::cuda
