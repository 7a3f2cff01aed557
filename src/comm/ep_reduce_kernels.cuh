// Combine kernels of expert-parallel dispatch: reduce (expert side) and home (token side), with their
// bf16 weighted row sums. Host launchers in ep_kernels.cu.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "comm/ep_device_common.cuh"
#include "comm/ep_kernels.hpp"

namespace epmoe::comm_detail {
namespace {

__device__ __forceinline__ float bf16_at(const uint4& v, int q) {
  const std::uint32_t w = (&v.x)[q >> 1];
  return __uint_as_float((q & 1) ? (w & 0xffff0000u) : (w << 16));
}
__device__ __forceinline__ uint4 pack_bf16(const float (&a)[8]) {
  uint4 v;
  std::uint32_t* w = &v.x;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const std::uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(a[2 * i]));
    const std::uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(a[2 * i + 1]));
    w[i] = lo | (hi << 16);
  }
  return v;
}

// out = bf16(sum_i w[i] * row_i) over i = 0..n-1 in that order (f32, each product and sum rounded
// once, as the CPU simulation does; w == nullptr: weight 1, plain sum), for `vecs` vectors of 8.
// Rows are loaded 4 at a time, 2 vectors per lane each, before any is used.
__device__ __forceinline__ void weighted_sum_rows(const char* const* rows, const float* w, int n, char* out,
                                                  std::int64_t vecs, int lane) {
  constexpr int kU = 2, kR = 4;
  for (std::int64_t base = 0; base < vecs; base += 32 * kU) {
    float acc[kU][8];
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
      for (int q = 0; q < 8; ++q) acc[u][q] = 0.0f;
    for (int i0 = 0; i0 < n; i0 += kR) {
      uint4 x[kR][kU];
#pragma unroll
      for (int ii = 0; ii < kR; ++ii)
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const std::int64_t v = base + lane + 32 * u;
          x[ii][u] = i0 + ii < n && v < vecs ? ld_v4(rows[i0 + ii] + v * 16) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
      for (int ii = 0; ii < kR; ++ii) {
        if (i0 + ii >= n) break;
        const float wi = w != nullptr ? w[i0 + ii] : 1.0f;
#pragma unroll
        for (int u = 0; u < kU; ++u)
#pragma unroll
          for (int q = 0; q < 8; ++q)
            acc[u][q] = w != nullptr ? __fadd_rn(acc[u][q], __fmul_rn(wi, bf16_at(x[ii][u], q)))
                                     : __fadd_rn(acc[u][q], bf16_at(x[ii][u], q));
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const std::int64_t v = base + lane + 32 * u;
      if (v < vecs) st_v4(out + v * 16, pack_bf16(acc[u]));
    }
  }
}

// ---------------------------------------------------------------- reduce (expert side of combine)
// Vectors of 16 bytes per slice of a split combine (ReduceArgs::split / HomeArgs::split): a
// partial's H * 2 bytes in slices of whole 512-byte units, ceil(units / split) units each, one
// warp per (token, slice); the last slices may be empty.
constexpr std::int64_t kSplitUnitVecs = 32;
__device__ __forceinline__ std::int64_t split_slice_vecs(std::int64_t vecs, int split) {
  const std::int64_t units = (vecs + kSplitUnitVecs - 1) / kSplitUnitVecs;
  return (units + split - 1) / split * kSplitUnitVecs;
}

// kSplit false: one warp per received token (the default); true: a.split warps per token, each
// summing one slice of the hidden dimension (the same sums, element by element, in the same order:
// the same bits), so that a small batch keeps more warps' loads in flight.
template <bool kSplit>
__global__ void __launch_bounds__(kThreads) reduce_kernel(EpGeometry g, ReduceArgs a) {
  __shared__ const char* rows_s[kWarps][kMaxTopK];
  __shared__ float w_s[kWarps][kMaxTopK];
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const bool lsa = a.sync.seq != nullptr;
  const std::uint32_t c = lsa ? *a.sync.seq + 1u : 0u;
  const std::int64_t parity_bytes = lsa ? static_cast<std::int64_t>(c & 1u) * a.sync.parity_stride : 0;
  if (blockIdx.x == 0 && tid == 0) stamp(kTraceReduceStart);
  const int R = *a.recv_total;
  const std::int64_t vecs = g.partial_bytes / 16;
  const auto* out = static_cast<const char*>(a.expert_out);
  const int S = kSplit ? a.split : 1;
  const std::int64_t slice_vecs = kSplit ? split_slice_vecs(vecs, S) : vecs;

  for (std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarps + warp;
       item < static_cast<std::int64_t>(R) * S; item += static_cast<std::int64_t>(gridDim.x) * kWarps) {
    const std::int64_t r = kSplit ? item / S : item;
    const std::int64_t v0 = kSplit ? (item % S) * slice_vecs : 0;
    const std::int64_t n_vecs = kSplit ? (vecs - v0 < slice_vecs ? vecs - v0 : slice_vecs) : vecs;
    if (kSplit && n_vecs <= 0) continue;  // an empty last slice (warp-uniform)
    const int row = lane < g.K ? a.recv_rows[r * g.K + lane] : -1;
    // Rows in ascending order (expert order, as the CPU simulation sums them).
    int rank = 0;
    for (int i = 0; i < g.K; ++i) {
      const int other = __shfl_sync(kFull, row, i);
      rank += other >= 0 && other < row;
    }
    const int n = __popc(__ballot_sync(kFull, row >= 0));
    if (row >= 0) {
      rows_s[warp][rank] = out + static_cast<std::int64_t>(row) * g.partial_bytes + v0 * 16;
      w_s[warp][rank] = a.row_weight[row];
    }
    __syncwarp();
    const int src = a.recv_src[r], slot = a.recv_slot[r];
    if (src < 0 || src >= g.N || slot < 0 || slot >= g.T_max) {  // warp-uniform
      if (lane == 0)
        record_error(a.sync.errors, kDeviceErrorBadSlot, CommPhase::combine_send, src, g.me, slot, 0,
                     static_cast<int>(r));
      continue;
    }
    char* dest = a.dest[src] + parity_bytes + static_cast<std::int64_t>(slot) * g.partial_bytes + v0 * 16;
    weighted_sum_rows(rows_s[warp], w_s[warp], n, dest, n_vecs, lane);
    __syncwarp();
  }
  if (tid == 0) stamp_max(kTraceReduceEnd);
  if (a.flag == nullptr) return;
  if (!finish_block(a.sync.done, static_cast<int>(gridDim.x))) return;
  // After a recorded error (this call's dispatch gave up or was refused, or a bad slot above) the sums
  // were made from poisoned, missing or stale rows: no combine flag is raised, so each peer's combine
  // times out naming this rank (and poisons its output) instead of taking them. Every block has run
  // its work and the finish above, so the done counter stays balanced.
  if (__syncthreads_or(errors_recorded(a.sync.errors))) return;
  for (int d = tid; d < g.N; d += static_cast<int>(blockDim.x))
    st_release_sys(a.flag[d] + parity_bytes / 4, c);
}

// ---------------------------------------------------------------- home (token side of combine)
template <bool kSplit>
__global__ void __launch_bounds__(kThreads) home_kernel(EpGeometry g, HomeArgs a) {
  __shared__ const char* part[kWarps][kMaxTopK];
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const bool lsa = a.sync.seq != nullptr;
  const std::uint32_t c = lsa ? *a.sync.seq + 1u : 0u;
  const std::int64_t parity_bytes = lsa ? static_cast<std::int64_t>(c & 1u) * a.sync.parity_stride : 0;
  if (blockIdx.x == 0 && tid == 0) stamp(kTraceHomeStart);
  // An error recorded before this kernel (this call's dispatch or combine send gave up or was refused)
  // or a wait here that gives up: some partial sums are missing or stale, so the whole output is NaN
  // rather than a plausible wrong sum. The claim is read before the waits, its load in flight with them.
  bool failed = errors_recorded(a.sync.errors);
  if (lsa) {
    for (int d = tid; d < g.N; d += static_cast<int>(blockDim.x))
      if (!wait_flag(a.flags + parity_bytes / 4 + d * a.flag_stride, c, a.sync, CommPhase::combine_recv, g.me,
                     d))
        failed = true;
  }
  const bool poisoned = __syncthreads_or(failed);
  if (lsa && tid == 0) stamp_max(kTraceHomeArrived);
  const std::int64_t vecs = g.partial_bytes / 16;
  const int S = kSplit ? a.split : 1;
  const std::int64_t slice_vecs = kSplit ? split_slice_vecs(vecs, S) : vecs;
  for (std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * kWarps + warp; item < a.T * S;
       item += static_cast<std::int64_t>(gridDim.x) * kWarps) {
    const std::int64_t t = kSplit ? item / S : item;
    const std::int64_t v0 = kSplit ? (item % S) * slice_vecs : 0;
    const std::int64_t n_vecs = kSplit ? (vecs - v0 < slice_vecs ? vecs - v0 : slice_vecs) : vecs;
    if (kSplit && n_vecs <= 0) continue;  // an empty last slice (warp-uniform)
    int n = 0;
    for (int d0 = 0; d0 < g.N; d0 += 32) {
      const int d = d0 + lane;
      const bool has = d < g.N && bucket_has(a.bitmaps, g.W, d, t);
      const unsigned m = __ballot_sync(kFull, has);
      if (has) {
        const int j = bucket_slot(a.bitmaps, a.prefix, g.W, d, t);
        part[warp][n + __popc(m & lanemask_lt())] =
            a.partials + parity_bytes + (static_cast<std::int64_t>(d) * g.T_max + j) * g.partial_bytes +
            v0 * 16;
      }
      n += __popc(m);
    }
    __syncwarp();
    char* y_t = static_cast<char*>(a.y) + t * g.partial_bytes + v0 * 16;
    if (poisoned)
      poison_bytes(y_t, n_vecs * 16, lane, 32);
    else
      weighted_sum_rows(part[warp], nullptr, n, y_t, n_vecs, lane);
    __syncwarp();
  }
  if (tid == 0) stamp_max(kTraceHomeEnd);
  if (lsa && finish_block(a.sync.done, static_cast<int>(gridDim.x)) && tid == 0) *a.sync.seq = c;
}

}  // namespace
}  // namespace epmoe::comm_detail
