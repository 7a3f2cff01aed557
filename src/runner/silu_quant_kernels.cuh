// Fused SiLU·mul + FP8 quantization kernels (device code; host launchers in silu_quant.cu).
//
// Numerics. act = silu(gate) * up uses the fast device formula silu_mul_fast below (ex2.approx and
// rcp.approx, relative error ~1e-6), not the CPU's IEEE-exact operation sequence
// (runner/silu_math.hpp, the definition): act may differ from the CPU's in the last bits, so q may
// differ by one e4m3 step where act lands next to a rounding boundary, and a group scale by an ulp
// or so. Given act, the quantization is exact (the CPU's): scale = max(amax, kMinAmax) / 448
// correctly rounded (optionally rounded up to a power of two), q = e4m3(RN(act / scale)).
//
// Memory-bound (per output element: 4 bytes of bf16 read, 1 byte of fp8 written). kLanes lanes
// (SiluConfig) own one (row, 128-channel group) item; each lane holds kVecs 16-byte vectors of gate
// and as many of up. The grid is persistent and software-pipelined: warp w takes items
// P (w + k W) + sub at steps k = 0, 1, ... (P = 32 / kLanes items per warp and step, sub = lane /
// kLanes, W warps), and keeps kSlots steps' loads in flight: slot d holds step k's vectors while
// the next kSlots - 1 steps load; as soon as step k's vectors are turned into act, slot d is refilled
// with step k + kSlots, then step k is reduced, quantized and stored. No per-step load-use bubble,
// no block launch per item, no dependent load on the critical path:
//   contiguous: a row is valid when m_indices[row] >= 0; m_indices is prefetched kSlots steps
//               before the row's vectors are requested (padding rows load nothing and, when a whole
//               warp's items are padding, cost a few instructions);
//   masked:     row = e * M_max + m is valid when m < min(max(masked_m[e], 0), M_max), masked_m held
//               in shared memory.
// Item -> (row, group j) and row -> (expert e, m) advance incrementally per step (a constant
// quotient and remainder plus one carry), no division in the loop.
#pragma once

#include <cstdint>

#include "cuda/ptx.cuh"
#include "runner/silu_math.hpp"

namespace epmoe::kernels {

inline constexpr int kSiluThreads = 256;
inline constexpr int kSiluWarps = kSiluThreads / 32;
inline constexpr int kSiluGroup = 128;        // channels per scale
inline constexpr int kSiluMaxExperts = 1024;  // masked: masked_m in shared memory
inline constexpr float kSiluFp8Max = 448.0f;
inline constexpr float kSiluMinAmax = 1e-10f;  // == epmoe::kMinAmax

enum class SiluScaleMode : int { group, group_pow2, tensor };

// The kernel's shape: kLanes lanes per (row, group) item, kSlots steps in flight per warp, register
// budget from kMinBlocks resident blocks per SM.
template <int kLanesT, int kSlotsT, int kMinBlocksT>
struct SiluConfig {
  static constexpr int kLanes = kLanesT;
  static constexpr int kItemsPerWarp = 32 / kLanes;      // P
  static constexpr int kVecs = kSiluGroup / 8 / kLanes;  // 16-byte vectors of gate per lane
  static constexpr int kVals = 8 * kVecs;                // act values per lane and item
  static constexpr int kSlots = kSlotsT;
  static constexpr int kMinBlocks = kMinBlocksT;
};
using SiluDefaultConfig = SiluConfig<8, 2, 3>;  // 64 bytes per lane and slot, <= 85 registers

struct SiluQuantParams {
  const std::uint16_t* h;         // GEMM1 output rows [rows, 2I] bf16
  std::uint8_t* q;                // [rows, I] fp8
  float* scales;                  // group modes: token-major or MN-major (scale_ld)
  const float* tensor_scale_ptr;  // tensor mode: device scale, or nullptr ...
  float tensor_scale;             // ... and then this one
  std::uint32_t groups;           // G = I / 128
  std::uint32_t scale_ld;         // MN-major: the padded row count of one scale column
  std::uint32_t rows;             // contiguous: M; masked: E * M_max
  const std::int32_t* m_indices;  // contiguous: [M]
  const std::int32_t* masked_m;   // masked: [E]
  std::uint32_t experts, m_max;   // masked
};

// silu(g) * u on the device: e = 2^(-g log2 e) = exp(-g) (ex2.approx.ftz, ~2 ulp, plus the
// rounding of its argument: relative error <= |g| 2^-24), r = 1 / (1 + e) (rcp.approx.ftz, ~1 ulp),
// act = (g r) u. g -> +inf: e = 0, r = 1; g < -88.7: e = +inf, r = 0, g r = -0 (the exact silu is
// below 1e-36 there); g r never overflows, so act overflows only where the exact value does.
__device__ __forceinline__ float silu_mul_fast(float g, float u) {
  const float e = ptx::ex2_approx_ftz(g * -1.4426950408889634f);
  const float r = ptx::rcp_approx_ftz(1.0f + e);
  return (g * r) * u;
}

// a / s correctly rounded for s = group scale (or a clamped a in tensor mode): Markstein's division
// with y = RN(1/s) (runner/silu_math.hpp, act::div_markstein; exact for the quantizer's operands).
__device__ __forceinline__ float silu_div(float a, float s, float y) {
  return act::div_markstein(a, s, y);
}

// RN(amax / 448), bit-identical with the IEEE division for every amax >= kMinAmax (Markstein with
// RN(1/448); checked exhaustively on the host for every f32 in [kMinAmax, FLT_MAX]).
__device__ __forceinline__ float silu_scale_for(float amax) {
  constexpr float kInv448 = 1.0f / 448.0f;  // RN(1/448)
  return act::div_markstein(fmaxf(amax, kSiluMinAmax), kSiluFp8Max, kInv448);
}

// 2^-k for s = 2^k with both normal (exact).
__device__ __forceinline__ float silu_pow2_inverse(float s) {
  return __uint_as_float((254u << 23) - __float_as_uint(s));
}

// Per-warp position in the item space, advanced by `step` items at a time.
struct SiluPos {
  std::uint32_t item, row, j;  // item = row * G + j
  std::uint32_t e, m;          // masked: row = e * M_max + m
};

struct SiluStride {
  std::uint32_t step;      // items per step (all warps)
  std::uint32_t drow, dj;  // step = drow * G + dj
  std::uint32_t de, dm;    // masked: drow = de * M_max + dm
};

template <bool kMasked>
__device__ __forceinline__ SiluPos silu_pos_at(std::uint32_t item, std::uint32_t groups,
                                               std::uint32_t m_max) {
  SiluPos p;
  p.item = item;
  p.row = item / groups;
  p.j = item - p.row * groups;
  if constexpr (kMasked) {
    p.e = p.row / m_max;
    p.m = p.row - p.e * m_max;
  } else {
    p.e = p.m = 0;
  }
  return p;
}

template <bool kMasked>
__device__ __forceinline__ void silu_advance(SiluPos& p, const SiluStride& s, std::uint32_t groups,
                                             std::uint32_t m_max) {
  p.item += s.step;
  p.j += s.dj;
  const std::uint32_t carry = p.j >= groups ? 1u : 0u;
  p.j -= carry * groups;
  p.row += s.drow + carry;
  if constexpr (kMasked) {
    p.m += s.dm + carry;
    const std::uint32_t carry_e = p.m >= m_max ? 1u : 0u;
    p.m -= carry_e * m_max;
    p.e += s.de + carry_e;
  }
}

// One step's item of this lane and its loaded vectors.
template <int kVecs>
struct SiluSlot {
  uint4 gate[kVecs], up[kVecs];
  std::uint32_t item;  // q at item * 128, token-major scale at item
  std::uint32_t sidx;  // MN-major: the scale's index
  bool valid;
};

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

// Grid: persistent, at most one wave; items = rows * G < 2^31 (checked by the launcher, so that
// positions a few steps past the end do not wrap).
template <class Cfg, SiluScaleMode kMode, bool kMnMajor, bool kMasked>
__global__ void __launch_bounds__(kSiluThreads, Cfg::kMinBlocks) silu_quant_kernel(SiluQuantParams p) {
  constexpr int kSiluLanes = Cfg::kLanes, kSiluItemsPerWarp = Cfg::kItemsPerWarp, kSiluVecs = Cfg::kVecs;
  constexpr int kSiluVals = Cfg::kVals, kSiluSlots = Cfg::kSlots;
  using Slot = SiluSlot<kSiluVecs>;
  __shared__ std::uint32_t valid_m[kMasked ? kSiluMaxExperts : 1];  // masked: clamped masked_m
  if constexpr (kMasked) {
    for (std::uint32_t e = threadIdx.x; e < p.experts; e += kSiluThreads)
      valid_m[e] = static_cast<std::uint32_t>(min(max(__ldg(p.masked_m + e), 0), static_cast<int>(p.m_max)));
    __syncthreads();
  }
  const std::uint32_t groups = p.groups;
  const std::uint32_t inter = groups * kSiluGroup;
  if constexpr (kMnMajor) {
    if constexpr (kMasked) {
      silu_zero_scale_padding(p.scales, p.experts * groups, p.m_max, p.scale_ld);
    } else {
      silu_zero_scale_padding(p.scales, groups, p.rows, p.scale_ld);
    }
  }

  float tensor_scale = 0.0f, tensor_y = 0.0f, tensor_lim = 0.0f;
  if constexpr (kMode == SiluScaleMode::tensor) {
    tensor_scale = p.tensor_scale_ptr != nullptr ? __ldg(p.tensor_scale_ptr) : p.tensor_scale;
    tensor_y = __frcp_rn(tensor_scale);
    tensor_lim = 512.0f * tensor_scale;  // |act| above it saturates either way (and q0 stays finite)
  }

  const int lane = threadIdx.x % 32;
  const std::uint32_t sub = static_cast<std::uint32_t>(lane) / kSiluLanes;
  const std::uint32_t sl = static_cast<std::uint32_t>(lane) % kSiluLanes;
  const std::uint32_t warp = (blockIdx.x * kSiluThreads + threadIdx.x) / 32;
  const std::uint32_t num_warps = gridDim.x * kSiluWarps;
  const std::uint32_t items = p.rows * groups;
  const std::uint32_t m_max = p.m_max;

  SiluStride st;
  st.step = kSiluItemsPerWarp * num_warps;
  st.drow = st.step / groups;
  st.dj = st.step - st.drow * groups;
  if constexpr (kMasked) {
    st.de = st.drow / m_max;
    st.dm = st.drow - st.de * m_max;
  } else {
    st.de = st.dm = 0;
  }

  // a: the next step to load; b (contiguous): the next step whose m_indices to prefetch.
  const std::uint32_t first = kSiluItemsPerWarp * warp + sub;
  SiluPos a = silu_pos_at<kMasked>(first, groups, m_max);
  SiluPos b = a;
  int mi[kSiluSlots];  // contiguous: m_indices of the step that slot d loads next

  auto prefetch_m = [&](int& out) {
    if constexpr (!kMasked) {
      out = b.row < p.rows ? __ldg(p.m_indices + b.row) : -1;
      silu_advance<false>(b, st, groups, m_max);
    } else {
      out = 0;
    }
  };
  auto issue = [&](Slot& s, int m_index) {
    bool valid;
    if constexpr (kMasked) {
      valid = a.row < p.rows && a.m < valid_m[a.e];
    } else {
      valid = m_index >= 0;
    }
    s.valid = valid;
    s.item = a.item;
    if constexpr (kMnMajor) {
      if constexpr (kMasked) {
        s.sidx = (a.e * groups + a.j) * p.scale_ld + a.m;
      } else {
        s.sidx = a.j * p.scale_ld + a.row;
      }
    } else {
      s.sidx = 0;
    }
    if (valid) {
      const std::uint16_t* src = p.h + static_cast<std::uint64_t>(a.item) * kSiluGroup +
                                 static_cast<std::uint64_t>(a.row) * inter + sl * 8;
#pragma unroll
      for (int v = 0; v < kSiluVecs; ++v) {
        s.gate[v] = ptx::ld_nc_v4(src + v * kSiluLanes * 8);
        s.up[v] = ptx::ld_nc_v4(src + inter + v * kSiluLanes * 8);
      }
    }
    silu_advance<kMasked>(a, st, groups, m_max);
  };

  Slot slot[kSiluSlots];
#pragma unroll
  for (int d = 0; d < kSiluSlots; ++d) {
#pragma unroll
    for (int v = 0; v < kSiluVecs; ++v) slot[d].gate[v] = slot[d].up[v] = make_uint4(0, 0, 0, 0);
    prefetch_m(mi[d]);
  }
#pragma unroll
  for (int d = 0; d < kSiluSlots; ++d) {
    issue(slot[d], mi[d]);
    prefetch_m(mi[d]);
  }

  for (std::uint32_t base = kSiluItemsPerWarp * warp;;) {
#pragma unroll
    for (int d = 0; d < kSiluSlots; ++d) {
      if (base >= items) return;  // warp-uniform: every item of this warp and later steps is past the end
      base += st.step;
      Slot& s = slot[d];
      const bool valid = s.valid;
      const std::uint32_t item = s.item, sidx = s.sidx;
      if (__any_sync(0xffffffffu, valid)) {
        float act[kSiluVals];
#pragma unroll
        for (int v = 0; v < kSiluVecs; ++v) {
          const std::uint32_t g[4] = {s.gate[v].x, s.gate[v].y, s.gate[v].z, s.gate[v].w};
          const std::uint32_t u[4] = {s.up[v].x, s.up[v].y, s.up[v].z, s.up[v].w};
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float2 gf = ptx::bf16x2_to_float2(g[i]);
            const float2 uf = ptx::bf16x2_to_float2(u[i]);
            act[8 * v + 2 * i] = silu_mul_fast(gf.x, uf.x);
            act[8 * v + 2 * i + 1] = silu_mul_fast(gf.y, uf.y);
          }
        }
        issue(s, mi[d]);  // the slot's vectors are consumed: refill it
        prefetch_m(mi[d]);

        float scale, y;
        if constexpr (kMode == SiluScaleMode::tensor) {
          scale = tensor_scale;
          y = tensor_y;
          // Saturated to the static scale's range, a NaN kept (fmaxf would drop it for -lim): a NaN
          // activation stays a NaN code, as torch.clamp keeps it in SGLang's per-tensor quantization.
#pragma unroll
          for (int i = 0; i < kSiluVals; ++i)
            act[i] = act[i] == act[i] ? fminf(fmaxf(act[i], -tensor_lim), tensor_lim) : act[i];
        } else {
          float m = 0.0f;
#pragma unroll
          for (int i = 0; i < kSiluVals; ++i) m = fmaxf(m, fabsf(act[i]));
          m = ptx::group_max<kSiluLanes>(m);
          scale = silu_scale_for(m);
          if constexpr (kMode == SiluScaleMode::group_pow2) {
            // An infinite amax gives a NaN scale, which the exponent arithmetic below would turn into
            // -0 (and the group into zeros): kept NaN, so the group's codes and scale are NaN, as without
            // power-of-two scales.
            const bool finite = scale <= 3.402823466e38f;  // false for NaN and Inf
            scale = finite ? ptx::round_up_pow2(scale) : __uint_as_float(0x7fffffffu);
            y = finite ? silu_pow2_inverse(scale) : scale;
          } else {
            y = __frcp_rn(scale);
          }
        }
        if (valid) {
          std::uint8_t* dst = p.q + static_cast<std::uint64_t>(item) * kSiluGroup + sl * 8;
#pragma unroll
          for (int v = 0; v < kSiluVecs; ++v) {
            float x[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              const float a_i = act[8 * v + i];
              x[i] = kMode == SiluScaleMode::group_pow2 ? a_i * y : silu_div(a_i, scale, y);
            }
            uint2 out;
            out.x = static_cast<std::uint32_t>(ptx::float2_to_e4m3x2(x[0], x[1])) |
                    (static_cast<std::uint32_t>(ptx::float2_to_e4m3x2(x[2], x[3])) << 16);
            out.y = static_cast<std::uint32_t>(ptx::float2_to_e4m3x2(x[4], x[5])) |
                    (static_cast<std::uint32_t>(ptx::float2_to_e4m3x2(x[6], x[7])) << 16);
            ptx::st_v2(dst + v * kSiluLanes * 8, out);
          }
          if constexpr (kMode != SiluScaleMode::tensor) {
            if (sl == 0) p.scales[kMnMajor ? sidx : item] = scale;
          }
        }
      } else {
        issue(s, mi[d]);
        prefetch_m(mi[d]);
      }
    }
  }
}

}  // namespace epmoe::kernels
