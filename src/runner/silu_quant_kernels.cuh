// Fused SiLU·mul + FP8 quantization kernels (device code; host launchers in silu_quant.cu).
//
// Memory-bound (per output element: 4 bytes of bf16 read, 1 byte of fp8 written): a half-warp owns
// one (row, 128-channel group) item; each of its 16 lanes loads 16 bytes of gate and 16 of up
// (8 values each), computes 8 act values (silu_math.hpp, the CPU's exact operation sequence), and
// the group's amax is a 4-step shuffle reduction. Two items per half-warp are in flight per step.
// Grids are persistent and stride over the work.
//
// Contiguous layout: rows whose m_indices is -1 (padding, often most rows at small batches) must
// cost next to nothing. Each warp looks at 32 candidate items at once (one m_indices load per lane,
// a ballot), then processes only the valid ones, two half-warps at a time. Candidates are
// interleaved across warps (candidate c of warp w is item base + c * num_warps + w), so valid work
// is spread over all warps whatever the padding pattern.
//
// Masked layout: each block scans masked_m (clamped to [0, M_max]) into a shared prefix, so the
// grid strides over exactly the valid (row, group) items; an item's expert is a binary search in
// that prefix.
#pragma once

#include <cstdint>

#include <cub/block/block_scan.cuh>

#include "cuda/ptx.cuh"
#include "runner/silu_math.hpp"

namespace epmoe::kernels {

inline constexpr int kSiluThreads = 256;
inline constexpr int kSiluWarps = kSiluThreads / 32;
inline constexpr int kSiluGroup = 128;        // channels per scale
inline constexpr int kSiluVec = 8;            // bf16 values per 16-byte vector
inline constexpr int kSiluUnroll = 2;         // items per half-warp per step
inline constexpr int kSiluMaxExperts = 1024;  // masked: the shared prefix holds E + 1 entries
inline constexpr float kSiluFp8Max = 448.0f;
inline constexpr float kSiluMinAmax = 1e-10f;  // == epmoe::kMinAmax

enum class SiluScaleMode : int { group, group_pow2, tensor };

struct SiluQuantParams {
  const std::uint16_t* h;         // GEMM1 output rows [.., 2I] bf16
  std::uint8_t* q;                // [.., I] fp8
  float* scales;                  // group modes: token-major or MN-major (scale_ld)
  const float* tensor_scale_ptr;  // tensor mode: device scale, or nullptr ...
  float tensor_scale;             // ... and then this one
  std::uint32_t groups;           // I / 128
  std::uint32_t scale_ld;         // MN-major: the padded row count of one scale column
};

// act[0..8) = silu(gate) * up for 8 packed bf16 gate and up values (element 0 in the low half).
__device__ __forceinline__ void silu_mul_vec8(uint4 gate, uint4 up, float (&out)[8]) {
  const std::uint32_t g[4] = {gate.x, gate.y, gate.z, gate.w};
  const std::uint32_t u[4] = {up.x, up.y, up.z, up.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 gf = ptx::bf16x2_to_float2(g[i]);
    const float2 uf = ptx::bf16x2_to_float2(u[i]);
    out[2 * i] = act::silu_mul(gf.x, uf.x);
    out[2 * i + 1] = act::silu_mul(gf.y, uf.y);
  }
}

// The scale of a group whose 8-value slices the 16 lanes of each half-warp hold (all 32 lanes must
// call); tensor mode: the static scale. Same operations as epmoe::fp8_scale_for_amax.
template <SiluScaleMode kMode>
__device__ __forceinline__ float silu_group_scale(const float (&a)[8], float tensor_scale) {
  if constexpr (kMode == SiluScaleMode::tensor) {
    return tensor_scale;
  } else {
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(a[i]));
    m = ptx::group_max<16>(m);
    float s = __fdiv_rn(fmaxf(m, kSiluMinAmax), kSiluFp8Max);
    if constexpr (kMode == SiluScaleMode::group_pow2) s = ptx::round_up_pow2(s);
    return s;
  }
}

// 8 f32 -> 8 e4m3 bytes, q = e4m3(a / s), bit-identical with the CPU's IEEE division:
//   group_pow2: a * (1/s); 1/s is exact for a power of two, so the product is the same real number
//               as a / s, rounded once.
//   group:      Markstein's division (act::div_markstein) with the correctly rounded reciprocal
//               y = RN(1/s), one per group: q0 = RN(a y), r = a - s q0 (exact by fma), q = RN(q0 +
//               r y) = RN(a / s) whenever r does not underflow, i.e. for |a| above ~2^-100; below,
//               s >= kMinAmax / 448 ~ 2^-42 makes |a / s| < 2^-58, which e4m3 rounds to (signed)
//               zero either way. |a| <= amax bounds |a / s| by ~448: no overflow. 4 operations
//               instead of a full division (~9 with its range check).
//   tensor:     the IEEE division itself (a static scale may be far from amax / 448).
template <SiluScaleMode kMode>
__device__ __forceinline__ uint2 silu_quantize_vec8(const float (&a)[8], float s) {
  float v[8];
  if constexpr (kMode == SiluScaleMode::group_pow2) {
    const float inv = __fdiv_rn(1.0f, s);  // exact for a power of two
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __fmul_rn(a[i], inv);
  } else if constexpr (kMode == SiluScaleMode::group) {
    const float y = __frcp_rn(s);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = act::div_markstein(a[i], s, y);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __fdiv_rn(a[i], s);
  }
  uint2 out;
  out.x = static_cast<std::uint32_t>(ptx::float2_to_e4m3x2(v[0], v[1])) |
          (static_cast<std::uint32_t>(ptx::float2_to_e4m3x2(v[2], v[3])) << 16);
  out.y = static_cast<std::uint32_t>(ptx::float2_to_e4m3x2(v[4], v[5])) |
          (static_cast<std::uint32_t>(ptx::float2_to_e4m3x2(v[6], v[7])) << 16);
  return out;
}

template <SiluScaleMode kMode>
__device__ __forceinline__ float silu_tensor_scale(const SiluQuantParams& p) {
  if constexpr (kMode == SiluScaleMode::tensor) {
    return p.tensor_scale_ptr != nullptr ? *p.tensor_scale_ptr : p.tensor_scale;
  } else {
    return 0.0f;
  }
}

// Block 0 writes 0.0f into the TMA padding of MN-major scales: `columns` columns of scale_ld
// entries, each padded from `valid` to scale_ld.
__device__ __forceinline__ void silu_zero_scale_padding(float* scales, std::uint32_t columns,
                                                        std::uint32_t valid, std::uint32_t scale_ld) {
  const std::uint32_t pad = scale_ld - valid;
  if (blockIdx.x != 0 || pad == 0) return;
  for (std::uint32_t i = threadIdx.x; i < columns * pad; i += kSiluThreads) {
    const std::uint32_t c = i / pad;
    scales[static_cast<std::uint64_t>(c) * scale_ld + valid + (i - c * pad)] = 0.0f;
  }
}

// ---------------------------------------------------------------- contiguous
// h [rows, 2I]; item = row * groups + j (< 2^32, checked by the launcher).
template <SiluScaleMode kMode, bool kMnMajor>
__global__ void __launch_bounds__(kSiluThreads)
    silu_quant_contiguous_kernel(SiluQuantParams p, const std::int32_t* __restrict__ m_indices,
                                 std::uint32_t rows) {
  const int lane = threadIdx.x % 32;
  const int half = lane / 16;
  const int hl = lane % 16;
  const std::uint32_t warp = (blockIdx.x * kSiluThreads + threadIdx.x) / 32;
  const std::uint32_t num_warps = gridDim.x * kSiluWarps;
  const std::uint32_t groups = p.groups;
  const std::uint64_t inter = static_cast<std::uint64_t>(groups) * kSiluGroup;
  const float tensor_scale = silu_tensor_scale<kMode>(p);
  if constexpr (kMnMajor) silu_zero_scale_padding(p.scales, groups, rows, p.scale_ld);

  const std::uint32_t items = rows * groups;
  for (std::uint64_t base = 0; base < items; base += 32ull * num_warps) {
    const std::uint64_t candidate = base + static_cast<std::uint64_t>(lane) * num_warps + warp;
    bool valid = false;
    if (candidate < items) valid = __ldg(m_indices + static_cast<std::uint32_t>(candidate) / groups) >= 0;
    std::uint32_t mask = __ballot_sync(0xffffffffu, valid);
    while (mask != 0u) {  // warp-uniform
      // The next 2 * kSiluUnroll valid candidates: half-warp h takes the (2u + h)-th.
      std::uint32_t row[kSiluUnroll], j[kSiluUnroll];
      bool has[kSiluUnroll];
#pragma unroll
      for (int u = 0; u < kSiluUnroll; ++u) {
        const int c0 = __ffs(static_cast<int>(mask)) - 1;
        mask &= mask - 1u;
        const int c1 = __ffs(static_cast<int>(mask)) - 1;
        mask &= mask - 1u;
        const int c = half != 0 ? c1 : c0;
        has[u] = c >= 0;
        const auto item =
            static_cast<std::uint32_t>(base + static_cast<std::uint64_t>(has[u] ? c : 0) * num_warps + warp);
        row[u] = item / groups;
        j[u] = item - row[u] * groups;
      }
      uint4 gate[kSiluUnroll], up[kSiluUnroll];
#pragma unroll
      for (int u = 0; u < kSiluUnroll; ++u) {
        if (has[u]) {
          const std::uint16_t* src = p.h + row[u] * 2 * inter + j[u] * kSiluGroup + hl * kSiluVec;
          gate[u] = ptx::ld_nc_v4(src);
          up[u] = ptx::ld_nc_v4(src + inter);
        } else {
          gate[u] = make_uint4(0, 0, 0, 0);
          up[u] = make_uint4(0, 0, 0, 0);
        }
      }
#pragma unroll
      for (int u = 0; u < kSiluUnroll; ++u) {
        float a[8];
        silu_mul_vec8(gate[u], up[u], a);
        const float s = silu_group_scale<kMode>(a, tensor_scale);  // all lanes: shuffles
        if (!has[u]) continue;
        ptx::st_v2(p.q + row[u] * inter + j[u] * kSiluGroup + hl * kSiluVec, silu_quantize_vec8<kMode>(a, s));
        if constexpr (kMode != SiluScaleMode::tensor) {
          if (hl == 0) {
            if constexpr (kMnMajor) {
              p.scales[static_cast<std::uint64_t>(j[u]) * p.scale_ld + row[u]] = s;
            } else {
              p.scales[static_cast<std::uint64_t>(row[u]) * groups + j[u]] = s;
            }
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------- masked
// Largest e in [0, experts) with prefix[e] <= r, given prefix[0] <= r < prefix[experts].
__device__ __forceinline__ std::uint32_t silu_find_expert(const std::uint32_t* prefix, std::uint32_t experts,
                                                          std::uint32_t r) {
  std::uint32_t lo = 0, hi = experts;
  while (hi - lo > 1) {
    const std::uint32_t mid = (lo + hi) / 2;
    if (prefix[mid] <= r) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// h [experts, m_max, 2I]; the valid items are numbered r * groups + j over the compacted rows r
// (expert by expert), r < Σ min(masked_m, m_max) (experts * m_max * groups < 2^32, checked by the
// launcher).
template <SiluScaleMode kMode, bool kMnMajor>
__global__ void __launch_bounds__(kSiluThreads)
    silu_quant_masked_kernel(SiluQuantParams p, const std::int32_t* __restrict__ masked_m,
                             std::uint32_t experts, std::uint32_t m_max) {
  using BlockScan = cub::BlockScan<std::uint32_t, kSiluThreads>;
  constexpr int kPerThread = kSiluMaxExperts / kSiluThreads;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ std::uint32_t prefix[kSiluMaxExperts + 1];

  std::uint32_t counts[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const std::uint32_t e = threadIdx.x * kPerThread + i;
    const int c = e < experts ? __ldg(masked_m + e) : 0;
    counts[i] = static_cast<std::uint32_t>(min(max(c, 0), static_cast<int>(m_max)));
  }
  std::uint32_t total = 0;
  BlockScan(scan_storage).ExclusiveSum(counts, counts, total);
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const std::uint32_t e = threadIdx.x * kPerThread + i;
    if (e < experts) prefix[e] = counts[i];
  }
  if (threadIdx.x == 0) prefix[experts] = total;
  __syncthreads();

  const std::uint32_t groups = p.groups;
  const std::uint64_t inter = static_cast<std::uint64_t>(groups) * kSiluGroup;
  const float tensor_scale = silu_tensor_scale<kMode>(p);
  if constexpr (kMnMajor) silu_zero_scale_padding(p.scales, experts * groups, m_max, p.scale_ld);

  const int lane = threadIdx.x % 32;
  const int half = lane / 16;
  const int hl = lane % 16;
  const std::uint32_t warp = (blockIdx.x * kSiluThreads + threadIdx.x) / 32;
  const std::uint32_t num_warps = gridDim.x * kSiluWarps;
  const std::uint32_t items = total * groups;
  const std::uint64_t step = 2ull * num_warps;
  for (std::uint64_t base = 2ull * warp; base < items; base += step * kSiluUnroll) {  // warp-uniform bound
    std::uint32_t e[kSiluUnroll], m[kSiluUnroll], j[kSiluUnroll];
    bool has[kSiluUnroll];
    uint4 gate[kSiluUnroll], up[kSiluUnroll];
#pragma unroll
    for (int u = 0; u < kSiluUnroll; ++u) {
      const std::uint64_t g = base + half + u * step;
      has[u] = g < items;
      const std::uint32_t item = has[u] ? static_cast<std::uint32_t>(g) : 0u;
      const std::uint32_t r = item / groups;
      j[u] = item - r * groups;
      e[u] = has[u] ? silu_find_expert(prefix, experts, r) : 0u;
      m[u] = r - prefix[e[u]];
      if (has[u]) {
        const std::uint16_t* src = p.h + (static_cast<std::uint64_t>(e[u]) * m_max + m[u]) * 2 * inter +
                                   j[u] * kSiluGroup + hl * kSiluVec;
        gate[u] = ptx::ld_nc_v4(src);
        up[u] = ptx::ld_nc_v4(src + inter);
      } else {
        gate[u] = make_uint4(0, 0, 0, 0);
        up[u] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int u = 0; u < kSiluUnroll; ++u) {
      float a[8];
      silu_mul_vec8(gate[u], up[u], a);
      const float s = silu_group_scale<kMode>(a, tensor_scale);  // all lanes: shuffles
      if (!has[u]) continue;
      const std::uint64_t flat = static_cast<std::uint64_t>(e[u]) * m_max + m[u];
      ptx::st_v2(p.q + flat * inter + j[u] * kSiluGroup + hl * kSiluVec, silu_quantize_vec8<kMode>(a, s));
      if constexpr (kMode != SiluScaleMode::tensor) {
        if (hl == 0) {
          if constexpr (kMnMajor) {
            p.scales[(static_cast<std::uint64_t>(e[u]) * groups + j[u]) * p.scale_ld + m[u]] = s;
          } else {
            p.scales[flat * groups + j[u]] = s;
          }
        }
      }
    }
  }
}

}  // namespace epmoe::kernels
