// Device code of the W4A8 weight preparation (host side in w4a8_grouped_gemm.cu): the checkpoint's
// int4 weights and f32 scales into the GEMM's packed order and back, and the scans that refuse weights
// the kernels cannot take (a bad scale, the nibble -8 under sign-magnitude codes).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "gemm/w4a8_layout.hpp"

namespace epmoe::kernels {

// Gathers, so that every output byte is written by one thread: forward, one thread step per packed
// byte (weights (n, k) and (n + 8, k) of the checkpoint, w4a8_layout.hpp); inverse, one per
// checkpoint byte (k = 2 i and 2 i + 1 of row n); then one per scale.
__device__ __forceinline__ int w4a8_checkpoint_int4(const std::uint8_t* __restrict__ w, std::int64_t row,
                                                    std::int64_t k, std::int64_t half_k) {
  const std::uint32_t b = w[row * half_k + k / 2];
  return static_cast<int>(static_cast<std::int8_t>((k % 2 == 0 ? b << 4 : b) & 0xf0u)) >> 4;
}

// Scales: forward, f32 (checkpoint) -> bf16 (packed, rounded to nearest-even); inverse, bf16 -> f32
// (exact).
__global__ void w4a8_prepare_kernel(const std::uint8_t* __restrict__ src, const void* __restrict__ src_scales,
                                    std::uint8_t* __restrict__ dst, void* __restrict__ dst_scales,
                                    std::int64_t groups, std::int64_t n, std::int64_t k, bool inverse,
                                    bool sm) {
  const std::int64_t half_k = k / 2, kb_count = k / w4a8::kBlockK;
  const std::int64_t bytes = groups * n * half_k, scales = groups * n * kb_count;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < bytes + scales;
       i += stride) {
    if (i < bytes) {
      const std::int64_t group = i / (n * half_k), rest = i % (n * half_k);
      const std::int64_t base = group * n * half_k;
      if (!inverse) {
        const w4a8::WeightPos at = w4a8::packed_byte_source(rest, kb_count, n);
        const int lo = w4a8_checkpoint_int4(src + base, at.n, at.k, half_k);
        const int hi = w4a8_checkpoint_int4(src + base, at.n + 8, at.k, half_k);
        int hi_prev = 0;  // (sm: the high value of the word's previous byte, whose sign this byte carries)
        if (sm) {
          const w4a8::WeightPos prev = w4a8::packed_byte_source(w4a8::word_prev_byte(rest), kb_count, n);
          hi_prev = w4a8_checkpoint_int4(src + base, prev.n + 8, prev.k, half_k);
        }
        dst[i] = w4a8::pack_byte(lo, hi, hi_prev, sm);
      } else {
        const std::int64_t row = rest / half_k, kk = 2 * (rest % half_k);
        std::uint32_t out = 0;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const w4a8::NibblePos pos = w4a8::packed_position(row, kk + e, kb_count, n);
          out |= (static_cast<std::uint32_t>(w4a8::unpack_value(src + base, pos.byte, pos.high, sm)) & 0xfu)
                 << (4 * e);
        }
        dst[i] = static_cast<std::uint8_t>(out);
      }
    } else {
      const std::int64_t j = i - bytes;
      const std::int64_t group = j / (n * kb_count), rest = j % (n * kb_count);
      const std::int64_t row = rest / kb_count, kb = rest % kb_count;
      const std::int64_t packed = group * n * kb_count + w4a8::packed_scale_index(row, kb, kb_count, n);
      if (!inverse) {
        static_cast<__nv_bfloat16*>(dst_scales)[packed] =
            __float2bfloat16_rn(static_cast<const float*>(src_scales)[j]);
      } else {
        static_cast<float*>(dst_scales)[j] =
            __bfloat162float(static_cast<const __nv_bfloat16*>(src_scales)[packed]);
      }
    }
  }
}

// Sets *found when a weight scale (n f32) is not a valid scale for codes up to max_code in magnitude
// (expect_scale's rule: positive, NaN refused, and max_code x it finite).
__global__ void w4a8_find_bad_scale_kernel(const float* __restrict__ scales, std::int64_t n, float max_code,
                                           int* found) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  bool any = false;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float v = scales[i];
    any |= !(v > 0.0f) || !isfinite(v * max_code);
  }
  if (__syncthreads_or(any) && threadIdx.x == 0) atomicExch(found, 1);
}

// Sets *found when a byte of the i4x2 weights (bytes long, 16-byte aligned) holds the nibble -8.
__global__ void w4a8_find_minus8_kernel(const std::uint8_t* __restrict__ w, std::int64_t bytes, int* found) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  bool any = false;
  const std::int64_t words = bytes / 16;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
       i += stride) {
    const uint4 v = reinterpret_cast<const uint4*>(w)[i];
    for (const std::uint32_t x : {v.x, v.y, v.z, v.w}) {
      // A nibble is 8 when its bit 3 is set and bits 0-2 are clear.
      const std::uint32_t lo3 = x & 0x77777777u;
      const std::uint32_t nonzero =
          (lo3 + 0x77777777u) & 0x88888888u;  // bit 3 of a nibble: its bits 0-2 != 0
      any |= ((x & 0x88888888u) & ~nonzero) != 0;
    }
  }
  for (std::int64_t i = words * 16 + static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < bytes; i += stride)
    any |= w4a8::byte_holds_minus8(w[i]);
  if (__syncthreads_or(any) && threadIdx.x == 0) atomicExch(found, 1);
}

}  // namespace epmoe::kernels
