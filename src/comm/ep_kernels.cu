// Expert-parallel dispatch / combine kernels (see ep_kernels.hpp for the data flow).
#include "comm/ep_kernels.hpp"

#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cuda/kernel_setup.hpp"
#include "cuda/ptx_hopper.cuh"
#include "epmoe/cuda/launch.hpp"

namespace epmoe::comm_detail {

EpGeometry EpGeometry::make(const MoeConfig& c, ActivationFormat format, int rank, int T_max) {
  EpGeometry g;
  g.N = c.num_ranks;
  g.me = rank;
  g.P = c.num_physical_experts();
  g.L = c.num_local_experts();
  g.K = c.topk;
  g.H = c.hidden;
  g.G = format == ActivationFormat::fp8_group ? static_cast<int>(c.hidden / 128) : 0;
  g.elt = format == ActivationFormat::bf16 ? 2 : 1;
  g.T_max = T_max;
  g.W = std::max(1, (T_max + 31) / 32);
  auto up16 = [](std::int64_t x) { return (x + 15) / 16 * 16; };
  g.x_bytes = g.H * g.elt;
  g.meta_off = up16(g.x_bytes + 4 * static_cast<std::int64_t>(g.G));
  g.row_stride = up16(g.meta_off + 12 * static_cast<std::int64_t>(g.K));
  g.partial_bytes = g.H * 2;
  EPMOE_CHECK(g.K >= 1 && g.K <= kMaxTopK, "the GPU dispatchers support top-k up to {}, got {}", kMaxTopK,
              g.K);
  EPMOE_CHECK(g.P <= kMaxPhysicalExperts, "the GPU dispatchers support up to {} physical experts, got {}",
              kMaxPhysicalExperts, g.P);
  const std::int64_t place_smem =
      4 * (3 * static_cast<std::int64_t>(g.N) + 2 + static_cast<std::int64_t>(g.L) * g.N +
           2 * static_cast<std::int64_t>(g.L));
  EPMOE_CHECK(place_smem <= 48 * 1024,
              "the GPU dispatchers' tables need {} bytes of shared memory for {} ranks x {} "
              "local experts, more than 48 KiB",
              place_smem, g.N, g.L);
  EPMOE_CHECK(g.x_bytes % 16 == 0, "hidden * element size must be a multiple of 16 bytes, got {}", g.x_bytes);
  return g;
}

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

// Early counts: waits until the tagged word *word carries sequence number `expect` (or a later
// one, which the protocol never lets a reader see; compared modulo 2^32) and returns its value in
// *value; bounded like wait_flag (false: timed out or another wait gave up, *value = 0).
__device__ bool wait_tagged(const std::uint64_t* word, std::uint32_t expect, const FlagSync& sync,
                            CommPhase phase, int me, int peer, int* value) {
  const std::uint64_t start = ptx::global_timer_ns();
  for (std::uint32_t spins = 0;; ++spins) {
    const std::uint64_t v = ld_relaxed_sys_u64(word);
    if (static_cast<std::int32_t>(static_cast<std::uint32_t>(v >> 32) - expect) >= 0) {
      *value = static_cast<int>(static_cast<std::uint32_t>(v));
      return true;
    }
    if ((spins & 1023u) == 1023u) {
      const std::uint64_t waited = ptx::global_timer_ns() - start;
      if (waited > sync.timeout_ns) {
        record_error(sync.errors, kDeviceErrorTimeout, phase, peer, me, static_cast<int>(expect), waited,
                     static_cast<int>(v >> 32));
        *value = 0;
        return false;
      }
      if (errors_recorded(sync.errors)) {
        *value = 0;
        return false;
      }
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

// ---------------------------------------------------------------- route
__device__ __forceinline__ void route_item(const EpGeometry& g, const std::int32_t* ids, std::int64_t i,
                                           std::uint32_t* bitmaps, int* status) {
  const std::int64_t t = i / g.K;
  const int k = static_cast<int>(i % g.K);
  const int id = ids[i];
  if (id < 0 || id >= g.P) {
    atomicOr(status, kInputIdOutOfRange);
    return;
  }
  bool duplicate = false;
  for (int k2 = 0; k2 < k; ++k2) duplicate |= ids[t * g.K + k2] == id;
  if (duplicate) {
    atomicOr(status, kInputDuplicateId);
    return;
  }
  const std::uint32_t bit = 1u << (t & 31);
  atomicOr(&bitmaps[static_cast<std::int64_t>(id / g.L) * g.W + (t >> 5)], bit);
  atomicOr(&bitmaps[static_cast<std::int64_t>(g.N + id) * g.W + (t >> 5)], bit);
}

__global__ void __launch_bounds__(kThreads)
    route_kernel(EpGeometry g, const std::int32_t* ids, std::int64_t T, std::uint32_t* bitmaps,
                 std::int32_t* count_row) {
  const std::int64_t items = T * g.K;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < items;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    route_item(g, ids, i, bitmaps, &count_row[g.status_index()]);
}

// One block per bucket: exclusive popcount prefix over its words; the total into the count row.
__global__ void __launch_bounds__(kThreads)
    scan_kernel(EpGeometry g, const std::uint32_t* bitmaps, std::int32_t* prefix, std::int32_t* count_row,
                std::int64_t T, std::int32_t host_status, std::uint32_t scale_bits) {
  const int bucket = static_cast<int>(blockIdx.x);
  if (bucket == 0 && threadIdx.x == 0) stamp(kTraceRouteStart);
  const int per = (g.W + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  const int begin = std::min(g.W, static_cast<int>(threadIdx.x) * per), end = std::min(g.W, begin + per);
  const std::uint32_t* words = bitmaps + static_cast<std::int64_t>(bucket) * g.W;
  int local = 0;
  for (int w = begin; w < end; ++w) local += __popc(words[w]);
  int total = 0;
  int running = block_exclusive_scan(local, &total);
  for (int w = begin; w < end; ++w) {
    prefix[static_cast<std::int64_t>(bucket) * g.W + w] = running;
    running += __popc(words[w]);
  }
  if (threadIdx.x == 0) {
    count_row[bucket] = total;  // tokens per destination (bucket < N), rows per physical expert
    if (bucket == 0) {
      if (host_status != 0) atomicOr(&count_row[g.status_index()], host_status);
      count_row[g.status_index() + 1] = static_cast<std::int32_t>(T);
      count_row[g.status_index() + 2] = static_cast<std::int32_t>(scale_bits);
    }
  }
}

// Small shapes (the low-latency path): route and scan in one block, the bitmaps in shared memory;
// replaces two memsets and two kernels. Same outputs as route + scan.
constexpr int kRouteSmallThreads = 1024;
constexpr std::int64_t kRouteSmallWords = 12 * 1024;  // 48 KB of bitmaps
constexpr std::int64_t kRouteSmallItems = 8 * 1024;
__global__ void __launch_bounds__(kRouteSmallThreads)
    route_small_kernel(EpGeometry g, const std::int32_t* ids, std::int64_t T, std::int64_t routed_T,
                       std::int32_t host_status, std::uint32_t scale_bits, std::uint32_t* bitmaps,
                       std::int32_t* prefix, std::int32_t* count_row) {
  extern __shared__ std::uint32_t sbits[];
  __shared__ int status;
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0) stamp(kTraceRouteStart);
  const int buckets = g.N + g.P;
  const int words = buckets * g.W;
  for (int i = tid; i < words; i += kRouteSmallThreads) sbits[i] = 0;
  if (tid == 0) status = host_status;
  __syncthreads();
  const std::int64_t items = routed_T * g.K;
  for (std::int64_t i = tid; i < items; i += kRouteSmallThreads) route_item(g, ids, i, sbits, &status);
  __syncthreads();
  for (int b = tid; b < buckets; b += kRouteSmallThreads) {
    int running = 0;
    for (int w = 0; w < g.W; ++w) {
      const std::uint32_t v = sbits[b * g.W + w];
      prefix[static_cast<std::int64_t>(b) * g.W + w] = running;
      bitmaps[static_cast<std::int64_t>(b) * g.W + w] = v;
      running += __popc(v);
    }
    count_row[b] = running;
  }
  if (tid == 0) {
    count_row[g.status_index()] = status;
    count_row[g.status_index() + 1] = static_cast<std::int32_t>(T);
    count_row[g.status_index() + 2] = static_cast<std::int32_t>(scale_bits);
    count_row[g.status_index() + 3] = 0;
  }
}

// Routing inside the dispatch launch (SendArgs::route_in_launch): every block of the launch routes
// the T tokens itself, block-wide, into shared memory (route_small_kernel's outputs: bitmaps,
// prefixes, count row), so that no block waits for a route kernel and its kernel boundary (~3 us
// of the 128-token call, bench/NOTES.md LL v6). The ids are staged in shared memory (`sids`, T x K)
// in one round of loads, issued together with the clearing of the bitmaps: routing item by item
// from global memory made each thread wait for one id load (and the duplicate check's) per round,
// ~4 round trips at 128 tokens (LL v7's stamps: 4.5 us before the send). `global_*` (one block's,
// else null) also receive the routing: the combine's home kernel reads the bitmaps and prefixes.
__device__ void route_in_block(const EpGeometry& g, const std::int32_t* ids, std::int64_t T,
                               float tensor_scale, std::uint32_t* bitmaps, std::int32_t* prefix,
                               std::int32_t* count_row, std::int32_t* sids, std::uint32_t* global_bitmaps,
                               std::int32_t* global_prefix, std::int32_t* global_count_row) {
  const int tid = static_cast<int>(threadIdx.x), nthreads = static_cast<int>(blockDim.x);
  const int buckets = g.N + g.P;
  const int words = buckets * g.W;
  const int items = static_cast<int>(T) * g.K;
  if ((reinterpret_cast<std::uintptr_t>(ids) & 15u) == 0) {
    const int quads = items / 4;
    for (int i = tid; i < quads; i += nthreads)
      reinterpret_cast<int4*>(sids)[i] = reinterpret_cast<const int4*>(ids)[i];
    for (int i = 4 * quads + tid; i < items; i += nthreads) sids[i] = ids[i];
  } else {
    for (int i = tid; i < items; i += nthreads) sids[i] = ids[i];
  }
  for (int i = tid; i < words; i += nthreads) bitmaps[i] = 0;
  if (tid == 0) count_row[g.status_index()] = 0;
  __syncthreads();
  for (int i = tid; i < items; i += nthreads) route_item(g, sids, i, bitmaps, &count_row[g.status_index()]);
  __syncthreads();
  for (int b = tid; b < buckets; b += nthreads) {
    int running = 0;
    for (int w = 0; w < g.W; ++w) {
      prefix[b * g.W + w] = running;
      running += __popc(bitmaps[b * g.W + w]);
    }
    count_row[b] = running;
  }
  if (tid == 0) {
    count_row[g.status_index() + 1] = static_cast<std::int32_t>(T);
    count_row[g.status_index() + 2] = __float_as_int(tensor_scale);
    count_row[g.status_index() + 3] = 0;
  }
  __syncthreads();
  if (global_bitmaps != nullptr) {
    for (int i = tid; i < words; i += nthreads) {
      global_bitmaps[i] = bitmaps[i];
      global_prefix[i] = prefix[i];
    }
    for (int i = tid; i < g.count_row_len(); i += nthreads) global_count_row[i] = count_row[i];
  }
}

// ---------------------------------------------------------------- send
// A few blocks of kSendThreads (the SMs it uses are what the issue-6 bar counts); a warp per token.
// NVLink: block 0 first writes every destination's header and raises its count flag (the receiver
// can size its layout and place the tokens it has while these arrive); the block that finishes
// last raises the arrival flags.
constexpr int kSendWarps = kSendThreads / 32;

// Block-wide (every thread): this rank's header on every destination (status, tokens, T, rows per
// local expert), then, after a system fence, the count flags (sequence number s).
__device__ void send_headers(const EpGeometry& g, std::int32_t* const* header, const std::int32_t* count_row,
                             int status, std::int64_t T, std::uint32_t s, std::int64_t parity_ints) {
  for (int d = 0; d < g.N; ++d) {
    std::int32_t* h = header[d] + parity_ints;
    for (int e = static_cast<int>(threadIdx.x); e < g.L; e += static_cast<int>(blockDim.x))
      h[kHeaderCounts + e] = status != 0 ? 0 : count_row[g.N + d * g.L + e];
    if (threadIdx.x == 0) {
      h[kHeaderStatus] = status;
      h[kHeaderTokens] = status != 0 ? 0 : count_row[d];
      h[kHeaderT] = static_cast<std::int32_t>(T);
    }
  }
  __threadfence_system();
  __syncthreads();
  for (int d = static_cast<int>(threadIdx.x); d < g.N; d += static_cast<int>(blockDim.x))
    st_release_sys(reinterpret_cast<std::uint32_t*>(header[d] + parity_ints + kHeaderCountFlag), s);
  if (threadIdx.x == 0) stamp(kTraceCountFlag);
}

// Early counts (SendArgs::tagged): block-wide, this rank's tagged header on every destination,
// one relaxed 64-bit system-scope store per word, (s << 32) | value, and nothing else: no fence
// (a fence here waits for whatever this SM's other warps and the other send blocks have in flight
// on NVLink), no count flag.
//
// Why no fence is needed (PTX memory model). The receiver uses nothing but the values themselves:
// each word is written once per call by one strong store, naturally aligned, so it is single-copy
// atomic; a reader that sees tag s sees the value stored with it, whatever order the words
// arrive in, so it needs no release / acquire pair to read them. What the count flag's release
// also published, the rows, are not covered by it anyway: place reads a peer's rows only after
// their arrival counters (atomicAdd_system after a system fence in the writing warp; ld.acquire
// on the reader's side), unchanged. The one thing the count flag's release did order is reuse:
// the receiver's zeroing of its arrival counters and its reads of this parity (kernel s) happen
// before the sender writes this parity again (call s + 2). Early-count place keeps that chain by
// waiting, at its end, for every peer's arrival flag s (st.release.sys by the peer's last send
// block after every send thread's system fence), so the sender's call s + 2 starts only after its
// place s + 1 acquired this rank's arrival flag s + 1, raised in a launch after this rank's
// place s: the same kernel-boundary-then-release chain as the count flag's.
__device__ void send_tagged_counts(const EpGeometry& g, std::uint64_t* const* tagged,
                                   const std::int32_t* count_row, int status, std::uint32_t s,
                                   std::int64_t parity_words) {
  const int per = tagged_words(g.L);
  const std::uint64_t tag = static_cast<std::uint64_t>(s) << 32;
  for (int i = static_cast<int>(threadIdx.x); i < g.N * per; i += static_cast<int>(blockDim.x)) {
    const int d = i / per, f = i % per;
    std::int32_t v = status;
    if (f > 0) v = status != 0 ? 0 : f == 1 ? count_row[d] : count_row[g.N + d * g.L + (f - kTaggedFixed)];
    st_relaxed_sys_u64(tagged[d] + parity_words + f, tag | static_cast<std::uint32_t>(v));
  }
  if (threadIdx.x == 0) stamp(kTraceCountFlag);
}

// The slot of token t's row at destination d (both send paths). One outside [0, T_max) would
// overwrite another source's rows or the combine flags after them: it is reported
// (kDeviceErrorBadSlot) and slot 0 of this source is used instead.
__device__ __forceinline__ int send_slot(const EpGeometry& g, const SendArgs& a, int d, std::int64_t t) {
  const int j = bucket_slot(a.bitmaps, a.prefix, g.W, d, t);
  if (j >= 0 && j < g.T_max) return j;
  record_error(a.sync.errors, kDeviceErrorBadSlot, CommPhase::dispatch_send, d, g.me, j, 0,
               static_cast<int>(t));
  return 0;
}

#include "comm/ep_pack.cuh"
#include "comm/ep_send_bulk.cuh"

// smem: the bulk-copy staging area (SendArgs::bulk_warps > 0). kEarly: early counts (a.tagged).
template <bool kEarly>
__device__ void send_body(const EpGeometry& g, const SendArgs& a, int block, int nblocks, char* smem) {
  __shared__ char* target[kSendWarps][kMaxTopK];
  __shared__ int target_rank[kSendWarps][kMaxTopK];
  __shared__ int target_slot[kSendWarps][kMaxTopK];
  __shared__ std::uint32_t* pending[kSendWarps][32];  // arrival counters to bump after the next fence
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  int npending = 0, batched = 0;
  auto flush = [&] {
    if (npending == 0) return;
    __threadfence_system();  // every lane's rows reach their destinations before a counter moves
    __syncwarp();
    if (lane < npending) atomicAdd_system(pending[warp][lane], 1u);
    __syncwarp();
    npending = 0;
    batched = 0;
  };
  const bool lsa = a.sync.seq != nullptr;
  const std::uint32_t s = lsa ? *a.sync.seq + 1u : 0u;
  const std::int64_t parity_bytes = lsa ? static_cast<std::int64_t>(s & 1u) * a.sync.parity_stride : 0;
  const int status = a.count_row[g.status_index()];
  const std::int64_t vecs = g.x_bytes / 16;
  const std::int64_t parity_ints = parity_bytes / 4;

  if (block == 0 && threadIdx.x == 0) stamp(kTraceSendStart);
  if constexpr (kEarly) {
    if (block == 0) send_tagged_counts(g, a.tagged, a.count_row, status, s, parity_bytes / 8);
  } else {
    if (a.header != nullptr && block == 0)
      send_headers(g, a.header, a.count_row, status, a.T, s, parity_ints);
  }

  if (status == 0 && a.bulk_warps > 0) {
    send_bulk_rows(g, a, block, nblocks, parity_bytes, smem);
  } else if (status == 0) {
    for (std::int64_t t = static_cast<std::int64_t>(block) * kSendWarps + warp; t < a.T;
         t += static_cast<std::int64_t>(nblocks) * kSendWarps) {
      int n = 0;  // destinations of token t, in rank order
      for (int d0 = 0; d0 < g.N; d0 += 32) {
        const int d = d0 + lane;
        const bool has = d < g.N && (!a.skip_self || d != g.me) && bucket_has(a.bitmaps, g.W, d, t);
        const unsigned m = __ballot_sync(kFull, has);
        if (has) {
          const int pos = n + __popc(m & lanemask_lt());
          const int j = send_slot(g, a, d, t);
          target[warp][pos] = a.dest[d] + parity_bytes + static_cast<std::int64_t>(j) * g.row_stride;
          target_rank[warp][pos] = d;
          target_slot[warp][pos] = j;
        }
        n += __popc(m);
      }
      __syncwarp();
      if (n == 0) continue;
      int id = -1, slot_e = 0;
      float w = 0.0f;
      if (lane < g.K) {
        id = a.ids[t * g.K + lane];
        w = a.weights[t * g.K + lane];
        slot_e = bucket_slot(a.bitmaps, a.prefix, g.W, g.N + id, t);
      }
      const RowScales pre_scales = load_row_scales(a.scales + t * g.G, g.G, lane);
      copy_fanout(static_cast<const char*>(a.x) + t * g.x_bytes, target[warp], n, vecs, lane);
      for (int c = lane; c < g.G; c += 32) {
        const float sc = row_scale(pre_scales, a.scales + t * g.G, c);
        for (int i = 0; i < n; ++i) reinterpret_cast<float*>(target[warp][i] + g.x_bytes)[c] = sc;
      }
      if (lane < g.K) {
        for (int i = 0; i < n; ++i) {
          std::int32_t* meta = reinterpret_cast<std::int32_t*>(target[warp][i] + g.meta_off) + 3 * lane;
          meta[0] = id / g.L == target_rank[warp][i] ? id % g.L : -1;
          meta[1] = slot_e;
          meta[2] = __float_as_int(w);
        }
      }
      if (a.chunks != nullptr) {
        // The counters of this token's chunks join the warp's pending list; every fence_batch
        // tokens (or when the list could overflow) every lane's stores are fenced once and the
        // whole list is bumped: the fence waits for the rows in flight, so one per token (v3)
        // left each warp a single row on NVLink at a time.
        if (lane < n)
          pending[warp][npending + lane] =
              a.chunks[target_rank[warp][lane]] + parity_ints + target_slot[warp][lane] / a.arrival_chunk;
        npending += n;
        if (++batched >= a.fence_batch || npending + min(g.N, 32) > 32) flush();
      }
      __syncwarp();
    }
    flush();
  }
  if (threadIdx.x == 0) stamp_max(kTraceSendCopied);
  if (a.header == nullptr) return;

  // NVLink: the block that finishes last raises the arrival flags and advances the send sequence
  // (its own counter: place may run concurrently and advances the receive one).
  if (!finish_block(a.sync.done, nblocks)) return;
  for (int d = static_cast<int>(threadIdx.x); d < g.N; d += static_cast<int>(blockDim.x))
    st_release_sys(reinterpret_cast<std::uint32_t*>(a.header[d] + parity_ints + kHeaderFlag), s);
  if (threadIdx.x == 0) {
    *a.sync.seq = s;
    stamp(kTraceSendEnd);
  }
}

// kEarly: early counts (a.tagged): only for a whole dispatch() call whose input the host refused
// (the peers' early-count place learns the refusal from the tagged status).
template <bool kEarly>
__global__ void __launch_bounds__(kSendThreads) send_kernel(EpGeometry g, SendArgs a) {
  extern __shared__ __align__(128) int smem[];
  send_body<kEarly>(g, a, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x),
                    reinterpret_cast<char*>(smem));
}

// ---------------------------------------------------------------- place
// smem: the tables, sized as launch_place computes. kEarly: early counts (a.tagged; whole calls
// with the own tokens from x). kRouteInLaunch (dispatch_kernel's, with kEarly): the rows that hold
// no token are marked while the peers' rows are still in flight (they are disjoint from the rows
// place_token writes: m < total[e] there, m >= total[e] here), and the last-block pattern runs at
// GPU scope (place's rows and tables are read on this GPU only, by later kernels; the one store a
// peer depends on, the zeroed arrival counters, keeps the last block's system fence).
template <bool kEarly, bool kRouteInLaunch = false>
__device__ void place_body(const EpGeometry& g, const PlaceArgs& a, int block, int nblocks, int* smem) {
  int* tok = smem;                // [N]
  int* roff = tok + g.N;          // [N + 1] first received token of each position (src_at)
  int* ok = roff + g.N + 1;       // [N]
  int* base = ok + g.N;           // [L * N] rows of expert e from sources before s
  int* total = base + g.L * g.N;  // [L]
  int* eoff = total + g.L;        // [L + 1] contiguous: first row of each expert
  __shared__ int target_row[kWarps][kMaxTopK];
  __shared__ char* target[kWarps][kMaxTopK];

  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int nthreads = static_cast<int>(blockDim.x);
  const bool lsa = a.sync.seq != nullptr;
  const bool own = a.own_x != nullptr;
  // The masked layout (low-latency mode) orders the received tokens, and each expert's rows, by
  // source rank starting at this rank (position q holds source me + q mod N): the own tokens come
  // first, so their rows (row = e * M_max + slot_e) need no peer's counts. The contiguous layout
  // keeps rank order (q = source): its expert offsets need every source's counts anyway.
  const bool rotate = !a.contiguous;
  auto src_at = [&](int q) { return rotate ? (g.me + q) % g.N : q; };
  const int me_pos = rotate ? 0 : g.me;
  // Routing inside the launch, masked: the own tokens are placed before the peers' counts are
  // waited for (their status is this rank's own count row).
  const bool own_first = kRouteInLaunch && rotate && own;
  const std::uint32_t s = lsa ? *a.sync.seq + 1u : 0u;
  const std::int64_t parity_bytes = lsa ? static_cast<std::int64_t>(s & 1u) * a.sync.parity_stride : 0;
  auto field = [&](int src, int f) -> const volatile std::int32_t* {
    return a.header + static_cast<std::int64_t>(src) * a.header_stride + f + parity_bytes / 4;
  };
  auto flag_of = [&](int src, int f) {
    return reinterpret_cast<const std::uint32_t*>(const_cast<const std::int32_t*>(field(src, f)));
  };

  if (block == 0 && tid == 0) stamp(kTracePlaceStart);
  // Early counts: the warp's first own token (its slot, routing and the first kBatch vectors of its
  // row) is loaded before the layout is known; it is stored once the tables are built.
  struct OwnFirst {
    uint4 v[kBatch];
    int j, e, slot_e;
    float w;
    bool has;
  } first{};
  const std::int64_t vecs = g.x_bytes / 16;
  // Received token r (source src, slot j): lanes < K hold its (local expert or -1, slot among the
  // source's tokens of that expert, weight); its payload is x_src / scales_src.
  // own_early (own_first): an own token placed before the tables exist: its rows are the first of
  // each expert (base 0), bounded by M_max instead of the expert's total.
  auto place_token = [&](std::int64_t r, int src, int j, int e, int slot_e, float w, const char* x_src,
                         const float* scales_src, const OwnFirst* pre = nullptr, bool own_early = false) {
    int row = -1;
    const RowScales pre_scales = load_row_scales(scales_src, g.G, lane);
    if (lane < g.K) {
      if (e >= 0 && e < g.L) {
        const std::int64_t m = (own_early ? 0 : static_cast<std::int64_t>(base[e * g.N + src])) + slot_e;
        const std::int64_t candidate = a.contiguous ? eoff[e] + m : e * a.M_max + m;
        if ((own_early ? m < a.M_max : m < total[e]) && candidate < a.max_rows)
          row = static_cast<int>(candidate);
      }
      a.recv_rows[r * g.K + lane] = row;
      if (row >= 0) {
        a.row_token[row] = static_cast<std::int32_t>(r);
        a.row_weight[row] = w;
        if (a.contiguous) a.m_indices[row] = e;
      }
    }
    if (lane == 0) {
      a.recv_src[r] = src;
      a.recv_slot[r] = j;
    }
    const unsigned m = __ballot_sync(kFull, row >= 0);
    const int n = __popc(m);
    if (row >= 0) {
      const int pos = __popc(m & lanemask_lt());
      target_row[warp][pos] = row;
      target[warp][pos] = a.rows + static_cast<std::int64_t>(row) * g.x_bytes;
    }
    __syncwarp();
    if constexpr (kEarly) {
      if (pre != nullptr)
        copy_fanout_preloaded(pre->v, x_src, target[warp], n, vecs, lane);
      else
        copy_fanout(x_src, target[warp], n, vecs, lane);
    } else {
      copy_fanout(x_src, target[warp], n, vecs, lane);
    }
    for (int c = lane; c < g.G; c += 32) {
      const float sc = row_scale(pre_scales, scales_src, c);
      for (int i = 0; i < n; ++i) a.out_scales[static_cast<std::int64_t>(target_row[warp][i]) * g.G + c] = sc;
    }
    __syncwarp();
  };

  const std::int64_t wid = static_cast<std::int64_t>(block) * kWarps + warp;
  const std::int64_t wstride = static_cast<std::int64_t>(nblocks) * kWarps;
  // This rank's own tokens, from the input, while the peers' tokens arrive (early: own_first, before
  // the tables; r = j, position 0). Early counts otherwise: the warp's first one was loaded before
  // the tables.
  auto place_own = [&](bool early) {
    const std::int64_t r0 = early ? 0 : roff[me_pos];
    std::int64_t t_begin = wid;
    if constexpr (kEarly) {
      if (!early) {
        if (first.has)
          place_token(r0 + first.j, g.me, first.j, first.e, first.slot_e, first.w,
                      static_cast<const char*>(a.own_x) + wid * g.x_bytes, a.own_scales + wid * g.G, &first);
        t_begin = wid + wstride;
      }
    }
    for (std::int64_t t = t_begin; t < a.own_T; t += wstride) {
      if (!bucket_has(a.bitmaps, g.W, g.me, t)) continue;
      const char* x_t = static_cast<const char*>(a.own_x) + t * g.x_bytes;
      if constexpr (kEarly) {
        if (early) load_batch(first.v, x_t, 0, vecs, lane);  // the row in flight with the routing's loads
      }
      const int j = bucket_slot(a.bitmaps, a.prefix, g.W, g.me, t);
      int e = -1, slot_e = 0;
      float w = 0.0f;
      if (lane < g.K) {
        const int id = a.own_ids[t * g.K + lane];
        w = a.own_weights[t * g.K + lane];
        slot_e = bucket_slot(a.bitmaps, a.prefix, g.W, g.N + id, t);
        e = id / g.L == g.me ? id % g.L : -1;
      }
      place_token(r0 + j, g.me, j, e, slot_e, w, x_t, a.own_scales + t * g.G, early ? &first : nullptr,
                  early);
    }
  };

  if constexpr (kEarly) {
    const std::int64_t t = static_cast<std::int64_t>(block) * kWarps + warp;
    if (own_first) {
      if (a.count_row[g.status_index()] == 0) place_own(true);
      if (tid == 0) stamp_max(kTraceOwnDone);
    } else if (own && t < a.own_T && bucket_has(a.bitmaps, g.W, g.me, t)) {
      first.has = true;
      first.j = bucket_slot(a.bitmaps, a.prefix, g.W, g.me, t);
      first.e = -1;
      if (lane < g.K) {
        const int id = a.own_ids[t * g.K + lane];
        first.w = a.own_weights[t * g.K + lane];
        if (id >= 0 && id < g.P) {  // else the rank's status refuses the input: nothing is placed
          first.slot_e = bucket_slot(a.bitmaps, a.prefix, g.W, g.N + id, t);
          first.e = id / g.L == g.me ? id % g.L : -1;
        }
      }
      const char* x_t = static_cast<const char*>(a.own_x) + t * g.x_bytes;
      load_batch(first.v, x_t, 0, g.x_bytes / 16, lane);
    }
    // The layout from the tagged headers: every word polled until it carries s (bounded).
    for (int src = tid; src < g.N; src += nthreads) ok[src] = 1;
    __syncthreads();
    const int per = tagged_words(g.L);
    const std::uint64_t* words = a.tagged + parity_bytes / 8;
    for (int i = tid; i < g.N * per; i += nthreads) {
      const int src = i / per, f = i % per;
      int v = 0;
      if (!wait_tagged(words + i, s, a.sync, CommPhase::dispatch_recv, g.me, src, &v)) ok[src] = 0;
      if (f == 0)
        roff[src] = v;  // the status, until roff is computed below
      else if (f == 1)
        tok[src] = v;
      else
        base[(f - kTaggedFixed) * g.N + src] = v;
    }
    __syncthreads();
    for (int src = tid; src < g.N; src += nthreads) {
      bool good = ok[src] != 0;
      const int status = good ? roff[src] : 0;
      if (good && status != 0) {
        if (block == 0)
          record_error(a.sync.errors, kDeviceErrorPeerInput, CommPhase::dispatch_recv, src, g.me, status, 0);
        good = false;
      }
      ok[src] = good;
      if (!good) tok[src] = 0;
    }
    __syncthreads();
    for (int i = tid; i < g.L * g.N; i += nthreads)
      if (!ok[i % g.N]) base[i] = 0;
    __syncthreads();
  } else {
    for (int src = tid; src < g.N; src += nthreads) {
      bool good = true;
      if (lsa)
        good = wait_flag(flag_of(src, a.count_flag_field), s, a.sync, CommPhase::dispatch_recv, g.me, src);
      const int status = good ? *field(src, a.status_field) : 0;
      if (good && status != 0) {
        if (block == 0)
          record_error(a.sync.errors, kDeviceErrorPeerInput, CommPhase::dispatch_recv, src, g.me, status, 0);
        good = false;
      }
      if (good && a.scale_field >= 0 && block == 0) {
        const int theirs = *field(src, a.scale_field), mine = *field(g.me, a.scale_field);
        if (theirs != mine)
          record_error(a.sync.errors, kDeviceErrorScaleMismatch, CommPhase::dispatch_recv, src, g.me, theirs,
                       0, mine);
      }
      tok[src] = good ? *field(src, a.tokens_field) : 0;
      ok[src] = good;
    }
    __syncthreads();
    for (int i = tid; i < g.L * g.N; i += nthreads) {
      const int e = i / g.N, src = i % g.N;
      base[i] = ok[src] ? *field(src, a.counts_field + e) : 0;
    }
    __syncthreads();
  }
  for (int e = tid; e < g.L; e += nthreads) {
    int acc = 0;
    for (int q = 0; q < g.N; ++q) {
      const int src = src_at(q);
      const int c = base[e * g.N + src];
      base[e * g.N + src] = acc;
      acc += c;
    }
    total[e] = acc;
  }
  if (tid == 0) {
    int acc = 0;
    for (int q = 0; q < g.N; ++q) {
      roff[q] = acc;  // by position from here on
      acc += tok[src_at(q)];
    }
    roff[g.N] = acc;
  }
  __syncthreads();
  {
    // eoff: exclusive scan of the padded totals, nthreads experts at a time.
    int carry = 0;
    for (int e0 = 0; e0 < g.L; e0 += nthreads) {
      const int e = e0 + tid;
      const int v = e < g.L && a.contiguous ? (total[e] + 127) / 128 * 128 : 0;
      int sum = 0;
      const int x = block_exclusive_scan(v, &sum);
      if (e < g.L) eoff[e] = carry + x;
      carry += sum;
      __syncthreads();
    }
    if (tid == 0) eoff[g.L] = carry;
  }
  __syncthreads();
  const int R = roff[g.N];
  if (block == 0 && tid == 0) stamp(kTraceCounts);
  if (block == 0 && a.host_offsets != nullptr) {
    // The host learns the layout now, while the rows are still being copied.
    for (int e = tid; e <= g.L; e += nthreads) a.host_offsets[e] = eoff[e];
    if (tid == 0) a.host_offsets[g.L + 1] = R;
    __threadfence_system();
    __syncthreads();
    if (tid == 0) *static_cast<volatile std::int32_t*>(a.host_offsets + g.L + 2) = a.host_stamp;
  }

  // Rows that hold no token: -1 (contiguous padding; masked rows past masked_m), and block 0's
  // per-expert outputs; needs only the tables.
  auto mark_empty_rows = [&] {
    const std::int64_t gtid = static_cast<std::int64_t>(block) * nthreads + tid;
    const std::int64_t gthreads = static_cast<std::int64_t>(nblocks) * nthreads;
    if (a.contiguous) {
      const std::int64_t rows = eoff[g.L];
      const std::int64_t end = a.empty_rows_to_max && a.max_rows > rows ? a.max_rows : rows;
      for (std::int64_t row = gtid; row < end; row += gthreads) {
        if (row >= rows) {  // past the last expert block (empty_rows_to_max)
          a.row_token[row] = -1;
          a.m_indices[row] = -1;
          continue;
        }
        const int lo = last_at_most(eoff, g.L, row);  // the expert whose block holds `row`
        if (row >= eoff[lo] + total[lo]) {
          a.row_token[row] = -1;
          a.m_indices[row] = -1;
        }
      }
    } else {
      const std::int64_t rows = static_cast<std::int64_t>(g.L) * a.M_max;
      for (std::int64_t row = gtid; row < rows; row += gthreads)
        if (row % a.M_max >= total[row / a.M_max]) a.row_token[row] = -1;
    }
    if (block == 0) {
      if (!a.contiguous)
        for (int e = tid; e < g.L; e += nthreads) a.masked_m[e] = total[e];
      if (a.expert_offsets != nullptr)
        for (int e = tid; e <= g.L; e += nthreads) a.expert_offsets[e] = eoff[e];
      if (tid == 0) *a.recv_total = R;
    }
  };

  if (!own_first && own && ok[g.me]) place_own(false);
  if (!own_first && tid == 0) stamp_max(kTraceOwnDone);
  if constexpr (kRouteInLaunch) mark_empty_rows();
  const bool chunked = lsa && a.chunks != nullptr;
  // A wait below that gives up leaves its error claimed: the rows go on being placed (stale for a
  // source that never arrived) and the last block poisons them all.
  if (lsa && !chunked) {
    for (int src = tid; src < g.N; src += nthreads)
      if (ok[src] && tok[src] > 0 && !(own && src == g.me))
        wait_flag(flag_of(src, a.flag_field), s, a.sync, CommPhase::dispatch_recv, g.me, src);
    __syncthreads();
    if (tid == 0) stamp_max(kTraceArrived);
  }
  // The peers' tokens: received token r = i, own ones skipped. kRouteInLaunch: i numbers the
  // received tokens other than the own ones, and the warp after the last own token's (each warp's
  // first own token is t = wid) takes i = 0: on a rank with peers before it in the received order
  // (rank 1 of 2) the first warps no longer take both an own and a peer token while the warps past
  // own_T idle.
  const std::int64_t own_count = own ? tok[g.me] : 0;
  std::int64_t i_begin = wid, i_end = R;
  if constexpr (kRouteInLaunch) {
    i_end = R - own_count;
    if (own && ok[g.me]) i_begin = (wid + wstride - a.own_T % wstride) % wstride;
  }
  for (std::int64_t i = i_begin; i < i_end; i += wstride) {
    std::int64_t r = i;
    if constexpr (kRouteInLaunch) r = !own || i < roff[me_pos] ? i : i + own_count;
    int q = 0;
    while (r >= roff[q + 1]) ++q;
    const int src = src_at(q);
    if constexpr (!kRouteInLaunch) {
      if (own && src == g.me) continue;
    }
    const int j = static_cast<int>(r - roff[q]);
    const char* slot = a.slots + parity_bytes + (static_cast<std::int64_t>(src) * g.T_max + j) * g.row_stride;
    if (chunked) {
      // The chunk of slot j is complete once all its tokens (arrival_chunk, fewer in the source's
      // last) are in.
      const int c = j / a.arrival_chunk;
      const int want = min(a.arrival_chunk, tok[src] - c * a.arrival_chunk);
      const std::uint32_t* counter =
          a.chunks + parity_bytes / 4 + static_cast<std::int64_t>(src) * a.n_chunks + c;
      wait_flag(counter, static_cast<std::uint32_t>(want), a.sync, CommPhase::dispatch_recv, g.me, src);
      // Normal mode: when a source's last chunk was seen complete (the copy engines deliver the
      // chunks in order, so this is when their copies ended); one stamp per source.
      if (a.contiguous && lane == 0 && j == tok[src] - 1) stamp_max(kTraceArrived);
    }
    int e = -1, slot_e = 0;
    float w = 0.0f;
    if (lane < g.K) {
      const std::int32_t* meta = reinterpret_cast<const std::int32_t*>(slot + g.meta_off) + 3 * lane;
      e = meta[0];
      slot_e = meta[1];
      w = __int_as_float(meta[2]);
    }
    place_token(r, src, j, e, slot_e, w, slot, reinterpret_cast<const float*>(slot + g.x_bytes));
  }

  if constexpr (!kRouteInLaunch) mark_empty_rows();
  if (tid == 0) stamp_max(kTracePlaceEnd);
  if constexpr (kEarly) {
    // No count flag orders this parity's reuse: every peer's arrival flag s does (see
    // send_tagged_counts), raised by its send's last block, normally long before this point.
    for (int src = tid; src < g.N; src += nthreads)
      if (src != g.me && ok[src])
        wait_flag(flag_of(src, a.flag_field), s, a.sync, CommPhase::dispatch_recv, g.me, src);
  }
  bool last_block = false;
  if (lsa)
    last_block = kRouteInLaunch ? finish_block_gpu(a.sync.done, nblocks) : finish_block(a.sync.done, nblocks);
  if (last_block) {
    // A wait gave up (or a peer refused its input): rows whose tokens never arrived were placed from
    // stale slots, or not at all, and the layout lacks the sources that did not answer. Every laid-out
    // row (the rows past eoff[L] in contiguous mode hold m_indices -1) becomes NaN, so nothing computed
    // from this call passes for a result. One block writes them all: slow (a few ms for a normal-mode
    // batch), but only after an error.
    if (__syncthreads_or(errors_recorded(a.sync.errors))) {
      const std::int64_t laid_out = a.contiguous ? eoff[g.L] : static_cast<std::int64_t>(g.L) * a.M_max;
      const std::int64_t rows = laid_out < a.max_rows ? laid_out : a.max_rows;
      poison_bytes(a.rows, rows * g.x_bytes, tid, nthreads);
      if (a.out_scales != nullptr) poison_bytes(a.out_scales, rows * g.G * 4, tid, nthreads);
    }
    // Every block has read its tokens: zero this parity's arrival counters for the call after next
    // (the senders reach this parity again only after this rank's next count flag).
    if (chunked)
      for (int i = tid; i < g.N * a.n_chunks; i += nthreads) a.chunks[parity_bytes / 4 + i] = 0;
    __threadfence_system();
    __syncthreads();
    if (tid == 0) *a.sync.seq = s;
  }
}

__global__ void __launch_bounds__(kThreads) place_kernel(EpGeometry g, PlaceArgs a) {
  extern __shared__ __align__(128) int smem[];
  place_body<false>(g, a, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x), smem);
}

// A whole dispatch in one launch: blocks [0, send_blocks) send (or, with s.ce set, pack for the
// copy engines), the others place. Every block is resident at once (the launcher caps the grid at
// the occupancy), so the placing blocks that wait for the peers can never keep this rank's own send
// or pack blocks from running.
// kEarly: early counts (s.tagged and p.tagged set; never with the copy-engine packing).
// kRouteInLaunch (s.route_in_launch, with kEarly): every block first routes the tokens into its
// shared memory at route_smem_off (route_in_block; no route kernel before the launch), and send
// and place read the routing from there.
template <bool kEarly, bool kRouteInLaunch>
__global__ void __launch_bounds__(kThreads)
    dispatch_kernel(EpGeometry g, SendArgs s, PlaceArgs p, int send_blocks, int route_smem_off) {
  extern __shared__ __align__(128) int smem[];
  const int b = static_cast<int>(blockIdx.x);
  if constexpr (kRouteInLaunch) {
    static_assert(kEarly, "routing inside the launch comes with early counts");
    if (b == 0 && threadIdx.x == 0) stamp(kTraceRouteStart);
    const int words = (g.N + g.P) * g.W;
    auto* bitmaps = reinterpret_cast<std::uint32_t*>(reinterpret_cast<char*>(smem) + route_smem_off);
    auto* prefix = reinterpret_cast<std::int32_t*>(bitmaps + words);
    auto* count_row = prefix + words;
    auto* sids = reinterpret_cast<std::int32_t*>(
        (reinterpret_cast<std::uintptr_t>(count_row + g.count_row_len()) + 15u) & ~std::uintptr_t{15});
    const bool publish = b == 0;
    route_in_block(g, s.ids, s.T, s.tensor_scale, bitmaps, prefix, count_row, sids,
                   publish ? const_cast<std::uint32_t*>(s.bitmaps) : nullptr,
                   publish ? const_cast<std::int32_t*>(s.prefix) : nullptr,
                   publish ? const_cast<std::int32_t*>(s.count_row) : nullptr);
    if (b < send_blocks) {
      SendArgs routed = s;
      routed.bitmaps = bitmaps;
      routed.prefix = prefix;
      routed.count_row = count_row;
      send_body<true>(g, routed, b, send_blocks, reinterpret_cast<char*>(smem));
    } else {
      PlaceArgs routed = p;
      routed.bitmaps = bitmaps;
      routed.prefix = prefix;
      routed.count_row = count_row;
      place_body<true, true>(g, routed, b - send_blocks, static_cast<int>(gridDim.x) - send_blocks, smem);
    }
  } else if constexpr (kEarly) {
    if (b < send_blocks)
      send_body<true>(g, s, b, send_blocks, reinterpret_cast<char*>(smem));
    else
      place_body<true>(g, p, b - send_blocks, static_cast<int>(gridDim.x) - send_blocks, smem);
  } else {
    if (b < send_blocks && s.ce.staging != nullptr)
      pack_pieces(g, s, b, send_blocks);
    else if (b < send_blocks)
      send_body<false>(g, s, b, send_blocks, reinterpret_cast<char*>(smem));
    else
      place_body<false>(g, p, b - send_blocks, static_cast<int>(gridDim.x) - send_blocks, smem);
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

// The communicator's barrier over its LSA team: this rank's `epoch` into its slot of every rank's
// barrier window (itself included; a release store at system scope, so whatever this rank's stream
// did before is visible to whoever sees it), then a bounded wait until every rank's slot in this
// rank's window reaches `epoch` (epochs compare modulo 2^32, like the sequence numbers).
__global__ void lsa_barrier_kernel(void* const* windows, std::uint32_t* own, int me, int n,
                                   std::uint32_t epoch, FlagSync sync) {
  const int tid = static_cast<int>(threadIdx.x);
  __threadfence_system();  // the stream's earlier kernels wrote into peers' windows too
  for (int d = tid; d < n; d += static_cast<int>(blockDim.x))
    st_release_sys(static_cast<std::uint32_t*>(windows[d]) + me, epoch);
  for (int d = tid; d < n; d += static_cast<int>(blockDim.x))
    if (!wait_flag(own + d, epoch, sync, CommPhase::setup, me, d)) return;
}

unsigned grid_for(std::int64_t warps_of_work) {
  const std::int64_t cap = static_cast<std::int64_t>(cuda::device_props().sm_count) * 4;
  return static_cast<unsigned>(std::clamp<std::int64_t>((warps_of_work + kWarps - 1) / kWarps, 1, cap));
}

}  // namespace

void read_trace(std::uint64_t (&out)[kTraceSlots]) {
  static_assert(sizeof(unsigned long long) == sizeof(std::uint64_t));
  EPMOE_CUDA_CHECK(cudaMemcpyFromSymbol(out, g_trace, sizeof(out)));
}

void reset_trace() {
  const std::uint64_t zero[kTraceSlots] = {};
  EPMOE_CUDA_CHECK(cudaMemcpyToSymbol(g_trace, zero, sizeof(zero)));
}

int work_blocks(std::int64_t warps) {
  return static_cast<int>(grid_for(warps));
}

int send_blocks(std::int64_t T) {
  const int sms = cuda::device_props().sm_count;
  int want = std::min(24, sms);
  if (const char* env = std::getenv("EPMOE_COMM_SEND_SMS")) {
    const int v = std::atoi(env);
    if (v > 0) want = std::min(v, sms);
  }
  const std::int64_t needed = (T + kSendWarps - 1) / kSendWarps;
  return static_cast<int>(std::clamp<std::int64_t>(needed, 1, want));
}

void launch_route(const EpGeometry& g, const std::int32_t* ids, std::int64_t T, std::int32_t host_status,
                  float tensor_scale, std::uint32_t* bitmaps, std::int32_t* prefix, std::int32_t* count_row,
                  cudaStream_t stream) {
  const std::int64_t buckets = g.N + g.P;
  const std::int64_t routed_T = host_status != 0 ? 0 : T;  // nothing is routed from a refused input
  std::uint32_t scale_bits = 0;
  static_assert(sizeof(scale_bits) == sizeof(tensor_scale));
  std::memcpy(&scale_bits, &tensor_scale, sizeof(scale_bits));
  if (buckets * g.W <= kRouteSmallWords && routed_T * g.K <= kRouteSmallItems) {
    const auto smem = static_cast<std::size_t>(buckets * g.W) * sizeof(std::uint32_t);
    route_small_kernel<<<1, kRouteSmallThreads, smem, stream>>>(g, ids, T, routed_T, host_status, scale_bits,
                                                                bitmaps, prefix, count_row);
    EPMOE_CUDA_CHECK_LAUNCH();
    return;
  }
  EPMOE_CUDA_CHECK(cudaMemsetAsync(bitmaps, 0, sizeof(std::uint32_t) * buckets * g.W, stream));
  EPMOE_CUDA_CHECK(cudaMemsetAsync(count_row, 0, sizeof(std::int32_t) * g.count_row_len(), stream));
  if (routed_T > 0) {
    const std::int64_t items = routed_T * g.K;
    const auto grid = static_cast<unsigned>(std::clamp<std::int64_t>(
        (items + kThreads - 1) / kThreads, 1, static_cast<std::int64_t>(cuda::device_props().sm_count) * 8));
    route_kernel<<<grid, kThreads, 0, stream>>>(g, ids, routed_T, bitmaps, count_row);
    EPMOE_CUDA_CHECK_LAUNCH();
  }
  scan_kernel<<<static_cast<unsigned>(buckets), kThreads, 0, stream>>>(g, bitmaps, prefix, count_row, T,
                                                                       host_status, scale_bits);
  EPMOE_CUDA_CHECK_LAUNCH();
}

namespace {
std::size_t place_smem(const EpGeometry& g) {
  return sizeof(int) * (static_cast<std::size_t>(g.N) * 3 + 1 + static_cast<std::size_t>(g.L) * g.N +
                        2 * static_cast<std::size_t>(g.L) + 1);
}

// Staging of the bulk-copy send: a stage holds x, the scales and one metadata tail per destination
// rank. The budget keeps the dispatch kernel at its register-bound occupancy (2 blocks of 256
// threads per SM at ~107 registers): ~100 KB of shared memory per block, static tables included.
constexpr std::int64_t kBulkSmemBudget = 96 * 1024;
int env_int(const char* name, int fallback) {
  const char* env = std::getenv(name);
  return env != nullptr && *env != '\0' ? std::atoi(env) : fallback;
}
// Fills the send path's tuning (EPMOE_COMM_SEND_BULK=1: bulk copies, bulk_warps / bulk_stage_bytes
// / bulk_lag; else per-lane stores with fence_batch); returns the bulk staging bytes (0: none).
std::size_t plan_bulk_send(const EpGeometry& g, SendArgs& s) {
  s.bulk_warps = 0;
  s.bulk_stage_bytes = 0;
  s.bulk_lag = std::clamp(env_int("EPMOE_COMM_BULK_LAG", 6), 0, kBulkMaxLag);
  s.fence_batch = std::max(1, env_int("EPMOE_COMM_FENCE_BATCH", 8));
  if (env_int("EPMOE_COMM_SEND_BULK", 0) != 1 || g.N > kBulkMaxDest) return 0;
  const std::int64_t stage = (g.meta_off + g.N * (g.row_stride - g.meta_off) + 127) / 128 * 128;
  const auto warps =
      static_cast<int>(std::min<std::int64_t>(kBulkWarps, kBulkSmemBudget / (kBulkStages * stage)));
  if (warps < 1) return 0;
  s.bulk_warps = warps;
  s.bulk_stage_bytes = static_cast<int>(stage);
  return static_cast<std::size_t>(warps) * kBulkStages * static_cast<std::size_t>(stage);
}
// Lets a kernel take more than 48 KB of dynamic shared memory (an attribute of the current device's
// function: set at every launch, cheap, and right whichever device the process uses). The first
// setting per device also runs for every such kernel through prepare_kernels (cuda/kernel_setup.hpp),
// before any call, where the registration below puts it: a first setting may wait for the context's
// outstanding copies, which loopback ranks cannot afford in the middle of a call.
void allow_large_smem(const void* kernel) {
  EPMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024));
}
[[maybe_unused]] const bool g_large_smem_registered = [] {
  for (const void* kernel :
       {reinterpret_cast<const void*>(send_kernel<true>), reinterpret_cast<const void*>(send_kernel<false>),
        reinterpret_cast<const void*>(dispatch_kernel<true, true>),
        reinterpret_cast<const void*>(dispatch_kernel<true, false>),
        reinterpret_cast<const void*>(dispatch_kernel<false, false>)})
    cuda::register_kernel_setup("a dispatch kernel's shared-memory limit",
                                [kernel] { allow_large_smem(kernel); });
  return true;
}();
}  // namespace

void launch_lsa_barrier(void* const* windows, std::uint32_t* own, int me, int n, std::uint32_t epoch,
                        const DeviceErrorSink& errors, std::uint64_t timeout_ns, cudaStream_t stream) {
  FlagSync sync;
  sync.errors = errors;
  sync.timeout_ns = timeout_ns;
  lsa_barrier_kernel<<<1, 128, 0, stream>>>(windows, own, me, n, epoch, sync);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_send(const EpGeometry& g, const SendArgs& a, cudaStream_t stream) {
  const bool early = a.tagged != nullptr;
  const void* kernel = early ? reinterpret_cast<const void*>(send_kernel<true>)
                             : reinterpret_cast<const void*>(send_kernel<false>);
  allow_large_smem(kernel);
  const int blocks = a.blocks > 0 ? a.blocks : send_blocks(a.T);
  SendArgs s = a;
  const std::size_t smem = plan_bulk_send(g, s);
  if (early)
    send_kernel<true><<<static_cast<unsigned>(blocks), kSendThreads, smem, stream>>>(g, s);
  else
    send_kernel<false><<<static_cast<unsigned>(blocks), kSendThreads, smem, stream>>>(g, s);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_pack(const EpGeometry& g, const PackArgs& a, cudaStream_t stream) {
  const int blocks = a.blocks > 0 ? a.blocks : send_blocks(a.T);
  pack_kernel<<<static_cast<unsigned>(blocks), kSendThreads, 0, stream>>>(g, a);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_place(const EpGeometry& g, const PlaceArgs& a, cudaStream_t stream) {
  place_kernel<<<grid_for(static_cast<std::int64_t>(g.N) * g.T_max), kThreads, place_smem(g), stream>>>(g, a);
  EPMOE_CUDA_CHECK_LAUNCH();
}

bool route_fits_in_launch(const EpGeometry& g) {
  return route_in_launch_tables_smem(g) <= kRouteInLaunchMaxSmem &&
         static_cast<std::int64_t>(g.T_max) * g.K <= kRouteSmallItems;
}

int launch_dispatch(const EpGeometry& g, const SendArgs& send_args, const PlaceArgs& p, cudaStream_t stream) {
  const bool early = send_args.tagged != nullptr;
  const bool route_in_launch = send_args.route_in_launch;
  EPMOE_CHECK(early == (p.tagged != nullptr) && (!early || send_args.ce.staging == nullptr),
              "launch_dispatch: early counts need both tagged headers and the SM-store send");
  EPMOE_CHECK(!route_in_launch || (early && route_fits_in_launch(g)),
              "launch_dispatch: routing inside the launch needs early counts and a routing of at most {} "
              "bytes",
              kRouteInLaunchMaxSmem);
  const void* kernel = route_in_launch ? reinterpret_cast<const void*>(dispatch_kernel<true, true>)
                       : early         ? reinterpret_cast<const void*>(dispatch_kernel<true, false>)
                                       : reinterpret_cast<const void*>(dispatch_kernel<false, false>);
  allow_large_smem(kernel);
  SendArgs s = send_args;
  // The pack blocks of the copy-engine send need no staging in shared memory.
  const std::size_t tables =
      std::max(place_smem(g), s.ce.staging != nullptr ? std::size_t{0} : plan_bulk_send(g, s));
  const std::size_t route_off = (tables + 15) / 16 * 16;
  const std::size_t smem = route_in_launch ? route_off + route_in_launch_smem(g) : tables;
  int per_sm = 0;
  EPMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  const std::int64_t resident = static_cast<std::int64_t>(std::max(per_sm, 1)) *
                                cuda::device_props().sm_count / std::max(1, s.ranks_on_device);
  const int send = send_blocks(s.T);
  EPMOE_CHECK(resident > send,
              "the dispatch kernel fits {} blocks on this GPU, fewer than its {} send blocks + 1", resident,
              send);
  const auto place = static_cast<int>(
      std::min<std::int64_t>(grid_for(static_cast<std::int64_t>(g.N) * g.T_max), resident - send));
  const auto grid = static_cast<unsigned>(send + place);
  const auto off = static_cast<int>(route_off);
  if (route_in_launch)
    dispatch_kernel<true, true><<<grid, kThreads, smem, stream>>>(g, s, p, send, off);
  else if (early)
    dispatch_kernel<true, false><<<grid, kThreads, smem, stream>>>(g, s, p, send, off);
  else
    dispatch_kernel<false, false><<<grid, kThreads, smem, stream>>>(g, s, p, send, off);
  EPMOE_CUDA_CHECK_LAUNCH();
  return send + place;
}

void launch_reduce(const EpGeometry& g, const ReduceArgs& a, cudaStream_t stream) {
  const std::int64_t tokens = static_cast<std::int64_t>(g.N) * g.T_max;
  if (a.split > 1) {
    reduce_kernel<true><<<grid_for(tokens * a.split), kThreads, 0, stream>>>(g, a);
  } else {
    reduce_kernel<false><<<grid_for(tokens), kThreads, 0, stream>>>(g, a);
  }
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_home(const EpGeometry& g, const HomeArgs& a, cudaStream_t stream) {
  if (a.split > 1) {
    home_kernel<true><<<grid_for(a.T * a.split), kThreads, 0, stream>>>(g, a);
  } else {
    home_kernel<false><<<grid_for(a.T), kThreads, 0, stream>>>(g, a);
  }
  EPMOE_CUDA_CHECK_LAUNCH();
}

namespace {
__global__ void watch_flags_kernel(const std::uint32_t* local_flags, const std::uint32_t* const* peer_flags,
                                   std::int64_t parity_words, int n, std::uint32_t* out,
                                   unsigned long long* time_ns) {
  // The GPU's global timer, one clock for every process on the device: the ranks' records order.
  if (threadIdx.x == 0) *time_ns = ptx::global_timer_ns_ordered();
  for (int d = static_cast<int>(threadIdx.x); d < n; d += static_cast<int>(blockDim.x)) {
    for (int parity = 0; parity < 2; ++parity) {
      out[4 * d + parity] = ld_acquire_sys(local_flags + parity * parity_words + 4 * d);
      out[4 * d + 2 + parity] = ld_acquire_sys(peer_flags[d] + parity * parity_words);
    }
  }
  __threadfence_system();
}
}  // namespace

void launch_watch_flags(const std::uint32_t* local_flags, const std::uint32_t* const* peer_flags,
                        std::int64_t parity_stride, int n, std::uint32_t* out, unsigned long long* time_ns,
                        cudaStream_t stream) {
  watch_flags_kernel<<<1, 32, 0, stream>>>(local_flags, peer_flags, parity_stride / 4, n, out, time_ns);
  EPMOE_CUDA_CHECK_LAUNCH();
}

int low_latency_combine_split(const EpGeometry& g) {
  // One resident wave of the split reduce: S warps per token over N * T_max tokens.
  static const std::int64_t resident_warps = [] {
    int blocks_per_sm = 0;
    EPMOE_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, reduce_kernel<true>, kThreads, 0));
    return static_cast<std::int64_t>(std::max(blocks_per_sm, 1)) * cuda::device_props().sm_count * kWarps;
  }();
  const std::int64_t tokens = static_cast<std::int64_t>(g.N) * g.T_max;
  for (const int split : {kLowLatencyCombineSplit, 4, 2})
    if (tokens * split <= resident_warps) return split;
  return 1;
}

int combine_split(int fallback) {
  return std::clamp(env_int("EPMOE_COMM_COMBINE_SPLIT", fallback), 1, kMaxCombineSplit);
}

}  // namespace epmoe::comm_detail
