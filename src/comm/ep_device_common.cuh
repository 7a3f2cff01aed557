// Device helpers shared by the expert-parallel dispatch / combine kernel families (ep_*_kernels.cuh):
// block constants, trace stamps, error records, bounded waits, the last-block pattern, the routing
// bitmaps' lookups, block scan, batched copies, row scales. Host launchers in ep_kernels.cu.
#pragma once

#include <cstdint>

#include "comm/ep_kernels.hpp"
#include "cuda/ptx.cuh"

namespace epmoe::comm_detail {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

// Phase stamps of the last call (globaltimer ns; read by the benchmark through read_trace).
__device__ unsigned long long g_trace[kTraceSlots];

// ---------------------------------------------------------------- memory-model helpers
// (inline PTX in cuda/ptx.cuh)
using ptx::lanemask_lt;
using ptx::ld_acquire_sys;
using ptx::ld_relaxed_sys_u64;
using ptx::st_relaxed_sys_u64;
using ptx::st_release_sys;
__device__ __forceinline__ void stamp(int slot) {
  g_trace[slot] = ptx::global_timer_ns_ordered();
}
__device__ __forceinline__ void stamp_max(int slot) {
  atomicMax(&g_trace[slot], static_cast<unsigned long long>(ptx::global_timer_ns_ordered()));
}
// Early counts' tagged words (see tagged_words in ep_kernels.hpp) go through ld_relaxed_sys_u64 /
// st_relaxed_sys_u64: a reader sees a whole word of one call.
__device__ __forceinline__ uint4 ld_v4(const void* p) {
  return *static_cast<const uint4*>(p);
}
__device__ __forceinline__ void st_v4(void* p, uint4 v) {
  *static_cast<uint4*>(p) = v;
}

__device__ void record_error(const DeviceErrorSink& sink, int code, CommPhase phase, int peer, int me,
                             int detail, std::uint64_t waited_ns, int seen = 0) {
  if (sink.claim == nullptr || atomicCAS(sink.claim, 0, 1) != 0) return;
  volatile DeviceErrorRecord* r = sink.record;
  r->seen = seen;
  r->phase = static_cast<std::int32_t>(phase);
  r->peer = peer;
  r->rank = me;
  r->detail = detail;
  r->waited_ns = waited_ns;
  __threadfence_system();
  r->code = code;
  __threadfence_system();
}

// Whether this rank has a recorded device error: a wait that timed out or gave up, a peer's refused
// input. Every wait then gives up at once, and the call's outputs are poisoned (see poison_bytes)
// instead of holding stale or partial rows, so a caller that reads them before the error surfaces (a
// graph replay reports it only at the next host check) cannot take them for a result.
__device__ __forceinline__ bool errors_recorded(const DeviceErrorSink& sink) {
  return sink.claim != nullptr && *static_cast<volatile std::int32_t*>(sink.claim) != 0;
}

// Sets every bit of bytes [0, bytes) of p: NaN in bf16 (0xFFFF), FP8 e4m3 (0xFF) and f32 alike. Thread i
// of `stride` threads; 16-byte stores where p and bytes allow (the payload rows), else 4-byte ones (a
// scale array); byte stores for a tail.
__device__ void poison_bytes(void* p, std::int64_t bytes, std::int64_t i, std::int64_t stride) {
  auto* b = static_cast<unsigned char*>(p);
  std::int64_t done = 0;
  if (reinterpret_cast<std::uintptr_t>(p) % 16 == 0) {
    const std::int64_t vecs = bytes / 16;
    for (std::int64_t v = i; v < vecs; v += stride)
      reinterpret_cast<uint4*>(b)[v] = make_uint4(~0u, ~0u, ~0u, ~0u);
    done = vecs * 16;
  } else if (reinterpret_cast<std::uintptr_t>(p) % 4 == 0) {
    const std::int64_t words = bytes / 4;
    for (std::int64_t w = i; w < words; w += stride) reinterpret_cast<std::uint32_t*>(b)[w] = ~0u;
    done = words * 4;
  }
  for (std::int64_t k = done + i; k < bytes; k += stride) b[k] = 0xFF;
}

// Waits until *flag reaches `expect` (sequence numbers compare modulo 2^32). Gives up after the
// timeout (recording which peer did not arrive) or as soon as another wait has given up.
__device__ bool wait_flag(const std::uint32_t* flag, std::uint32_t expect, const FlagSync& sync,
                          CommPhase phase, int me, int peer) {
  const std::uint64_t start = ptx::global_timer_ns();
  for (std::uint32_t spins = 0;; ++spins) {
    const std::uint32_t seen = ld_acquire_sys(flag);
    if (static_cast<std::int32_t>(seen - expect) >= 0) return true;
    if ((spins & 1023u) == 1023u) {
      const std::uint64_t waited = ptx::global_timer_ns() - start;
      if (waited > sync.timeout_ns) {
        record_error(sync.errors, kDeviceErrorTimeout, phase, peer, me, static_cast<int>(expect), waited,
                     static_cast<int>(seen));
        return false;
      }
      if (errors_recorded(sync.errors)) return false;
    }
  }
}

// Last-block pattern: every thread has fenced its own stores; returns true in the block that
// finished last (and resets the counter for the next call). kSystem: the fences at system scope (the
// blocks' stores are read by peers or the host). At GPU scope (finish_block_gpu) for blocks whose
// stores only this GPU reads (through a later kernel): a system fence waits until every store of the
// thread is visible to the peers and the host, which place's local row stores never need; the
// caller then fences at system scope whatever the last block writes for a peer.
template <bool kSystem = true>
__device__ bool finish_block(std::int32_t* done, int nblocks) {
  const auto fence = [] {
    if constexpr (kSystem) {
      __threadfence_system();
    } else {
      __threadfence();
    }
  };
  __shared__ bool last;
  fence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(done, 1) == nblocks - 1;
    if (last) *done = 0;
  }
  __syncthreads();
  if (last) fence();
  return last;
}
__device__ bool finish_block_gpu(std::int32_t* done, int nblocks) {
  return finish_block<false>(done, nblocks);
}

// The last index i in [0, n) with sorted[i] <= x (sorted non-decreasing, sorted[0] <= x).
__device__ __forceinline__ int last_at_most(const std::int32_t* sorted, int n, std::int64_t x) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (sorted[mid] <= x)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ bool bucket_has(const std::uint32_t* bitmaps, int W, int bucket, std::int64_t t) {
  return (bitmaps[static_cast<std::int64_t>(bucket) * W + (t >> 5)] >> (t & 31)) & 1u;
}
__device__ __forceinline__ int bucket_slot(const std::uint32_t* bitmaps, const std::int32_t* prefix, int W,
                                           int bucket, std::int64_t t) {
  const std::int64_t w = static_cast<std::int64_t>(bucket) * W + (t >> 5);
  return prefix[w] + __popc(bitmaps[w] & ((1u << (t & 31)) - 1u));
}

// Exclusive scan of one int per thread over the block; *total gets the sum.
__device__ int block_exclusive_scan(int v, int* total) {
  __shared__ int warp_sums[32];
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int warps = (static_cast<int>(blockDim.x) + 31) >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFull, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int s = lane < warps ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(kFull, s, o);
      if (lane >= o) s += y;
    }
    warp_sums[lane] = s;
  }
  __syncthreads();
  *total = warp_sums[warps - 1];
  return (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
}

// ---------------------------------------------------------------- batched copies
// Vectors per lane that a copy loop loads before it stores any (14 x 16 bytes: 7 KB per warp).
constexpr int kBatch = 14;  // a whole 7168-byte fp8 row per warp in one round trip

// One batch of a warp's copy: vectors base + lane + 32 u (u < kBatch) of src, loaded before any is
// stored; past `vecs` they are zero and not stored.
__device__ __forceinline__ void load_batch(uint4 (&r)[kBatch], const char* src, std::int64_t base,
                                           std::int64_t vecs, int lane) {
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    const std::int64_t v = base + lane + 32 * u;
    r[u] = v < vecs ? ld_v4(src + v * 16) : make_uint4(0, 0, 0, 0);
  }
}
__device__ __forceinline__ void store_batch(const uint4 (&r)[kBatch], char* const* dst, int n,
                                            std::int64_t base, std::int64_t vecs, int lane) {
  for (int i = 0; i < n; ++i) {
    char* d = dst[i];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const std::int64_t v = base + lane + 32 * u;
      if (v < vecs) st_v4(d + v * 16, r[u]);
    }
  }
}

// Copies vectors [from, vecs) of 16 bytes (from a multiple of 32 * kBatch) from src to each of
// dst[0..n) (a warp; lane-strided, a batch in flight at a time).
__device__ __forceinline__ void copy_fanout_from(std::int64_t from, const char* src, char* const* dst, int n,
                                                 std::int64_t vecs, int lane) {
  for (std::int64_t base = from; base < vecs; base += 32 * kBatch) {
    uint4 r[kBatch];
    load_batch(r, src, base, vecs, lane);
    store_batch(r, dst, n, base, vecs, lane);
  }
}

// Copies `vecs` 16-byte vectors from src to each of dst[0..n) (a warp; lane-strided).
__device__ __forceinline__ void copy_fanout(const char* src, char* const* dst, int n, std::int64_t vecs,
                                            int lane) {
  copy_fanout_from(0, src, dst, n, vecs, lane);
}

// copy_fanout whose first batch (vectors lane + 32 u, u < kBatch) the warp loaded earlier into
// `first` (early counts: the own token's row, loaded before the layout was known).
__device__ __forceinline__ void copy_fanout_preloaded(const uint4 (&first)[kBatch], const char* src,
                                                      char* const* dst, int n, std::int64_t vecs, int lane) {
  store_batch(first, dst, n, 0, vecs, lane);
  copy_fanout_from(32 * kBatch, src, dst, n, vecs, lane);
}

// A row's first 64 scales, two per lane (lane, lane + 32), loaded before the row's stores: after
// them the compiler may not hoist the loads (the char* stores may alias), and a dependent load at
// the end of each token costs every warp a round trip. row_scale reads scale c (the rest, c >= 64,
// from src).
struct RowScales {
  float lo = 0.0f, hi = 0.0f;
};
__device__ __forceinline__ RowScales load_row_scales(const float* src, int G, int lane) {
  RowScales r;
  if (lane < G) r.lo = src[lane];
  if (lane + 32 < G) r.hi = src[lane + 32];
  return r;
}
__device__ __forceinline__ float row_scale(const RowScales& r, const float* src, int c) {
  return c < 32 ? r.lo : c < 64 ? r.hi : src[c];
}

}  // namespace
}  // namespace epmoe::comm_detail
