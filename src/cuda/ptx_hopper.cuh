// Hopper (sm_90a) PTX wrappers: mbarriers, TMA (cp.async.bulk.tensor, multicast too), bulk copies,
// clusters, named barriers, wgmma (shared-memory and register A operands), mma.sync e4m3 (the
// tensor-core probe, bench/probe), setmaxnreg and prmt.
// The sibling of ptx.cuh for the Hopper-only machinery; include only from .cuh/.cu device code.
//
// Facts these rely on (PTX ISA 8.x, "Asynchronous Warpgroup Level Matrix Operations" and
// "Tensor Copy"):
//  - A wgmma shared-memory matrix descriptor is 64 bits: start address >> 4 in bits 0-13, leading
//    dimension byte offset >> 4 in bits 16-29, stride dimension byte offset >> 4 in bits 32-45,
//    base offset in bits 49-51 (0 when the swizzle pattern starts 1024-byte aligned), swizzle mode
//    in bits 62-63 (1 = 128-byte swizzle).
//  - For a K-major operand in the 128-byte swizzle layout (rows of 128 bytes, 8-row / 1024-byte
//    swizzle atoms, as TMA writes with CU_TENSOR_MAP_SWIZZLE_128B), the stride byte offset is the
//    distance between 8-row groups (1024) and the leading byte offset is unused; a K step inside
//    the 128-byte row advances the start address by the bytes of that step.
//  - wgmma's f32 accumulator fragment of an m64nN tile: thread t of the warpgroup (warp w = t / 32,
//    lane l) holds rows 16 w + l / 4 and 16 w + l / 4 + 8, columns 8 j + 2 (l % 4) + {0, 1}:
//    d[4 j + 0, 1] on the first row, d[4 j + 2, 3] on the second, j < N / 8.
#pragma once

#include <cstdint>

#include <cuda.h>  // CUtensorMap (the type only: nothing links libcuda)

#include "cuda/ptx.cuh"  // global_timer_ns (the watchdogs)

namespace epmoe::ptx {

// ---------------------------------------------------------------- shared memory addresses
__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// ---------------------------------------------------------------- mbarrier
__device__ __forceinline__ void mbar_init(std::uint32_t bar, std::uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Makes barrier initialisation visible to the async proxy (TMA) and the other threads (before a
// __syncthreads).
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(std::uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// A warp's release of a pipeline stage (or hand-over of what it wrote): every lane arrives, so the
// barrier counts kWarpArrivals per warp. One arrive by lane 0 after __syncwarp orders the same
// accesses (__syncwarp is a memory fence among the warp's lanes), but compute-sanitizer's racecheck
// does not carry __syncwarp's ordering into the barrier and reports the other lanes' accesses as
// racing the stage's next fill (bench/NOTES.md, session 14).
inline constexpr std::uint32_t kWarpArrivals = 32;
__device__ __forceinline__ void mbar_arrive_warp(std::uint32_t bar) {
  mbar_arrive(bar);
}

// Adds `bytes` to the transaction count the current phase waits for, without arriving (bytes that a copy
// issued by this thread will complete on it).
__device__ __forceinline__ void mbar_expect_tx(std::uint32_t bar, std::uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Arrives and adds `bytes` to the transaction count the current phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(std::uint32_t bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ bool mbar_try_wait(std::uint32_t bar, std::uint32_t parity) {
  std::uint32_t done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// A pipeline wait that has not completed after this long is a deadlock (a bug): trap, so that the
// launch fails with an error instead of hanging the GPU. No legitimate wait comes near it.
inline constexpr std::uint64_t kMbarWatchdogNs = 10'000'000'000ull;

// Waits until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(std::uint32_t bar, std::uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
  const std::uint64_t start = global_timer_ns();
  for (std::uint32_t i = 1;; ++i) {
    if (mbar_try_wait(bar, parity)) return;
    if ((i & 1023u) == 0 && global_timer_ns() - start > kMbarWatchdogNs) __trap();
  }
}

// Waits at most `rounds` try_wait rounds (each suspends the thread up to a hardware time limit) for the
// phase of parity `parity`; false if it had not completed. For waits whose register budget has no room
// for mbar_wait's watchdog (the FP8 GEMM's consumers), bounded by the waits of other warps that trap.
__device__ __forceinline__ bool mbar_wait_rounds(std::uint32_t bar, std::uint32_t parity,
                                                 std::uint32_t rounds) {
  for (std::uint32_t i = 0; !mbar_try_wait(bar, parity); ++i) {
    if (i == rounds) return false;
  }
  return true;
}

// ---------------------------------------------------------------- TMA
__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<std::uint64_t>(map)) : "memory");
}

// 2D tiled bulk tensor copy global -> shared (box at coordinates (c0 innermost, c1)), completing
// on the mbarrier `bar` with its byte count. Out-of-bounds elements are filled with zeros.
__device__ __forceinline__ void tma_load_2d(std::uint32_t dst, const CUtensorMap* map, std::uint32_t bar,
                                            std::int32_t c0, std::int32_t c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// The same copy delivered to every CTA of the cluster in `cta_mask` (bit r: rank r), at the same
// shared-memory offset in each, completing on the mbarrier at `bar`'s offset in each.
__device__ __forceinline__ void tma_load_2d_multicast(std::uint32_t dst, const CUtensorMap* map,
                                                      std::uint32_t bar, std::int32_t c0, std::int32_t c1,
                                                      std::uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], "
      "[%1, {%2, %3}], [%4], %5;" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(cta_mask)
      : "memory");
}

// ---------------------------------------------------------------- clusters
__device__ __forceinline__ std::uint32_t cluster_cta_rank() {
  std::uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

// Every thread of every CTA of the cluster (exited threads excepted) arrives, then waits for all;
// orders the shared-memory operations (mbarrier ones included) before it cluster-wide.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Arrives on the mbarrier at shared offset `bar` of the cluster's CTA `rank`. Default semantics
// (release at CTA scope), as CUTLASS's ClusterBarrier does: ".release.cluster" compiles to a
// MEMBAR.ALL.GPU before the arrive, which waits for every earlier global store of the thread (seen
// on sm_90a with nvcc 13.0; it made the clustered kernel 1.7x slower). An arrive that only tells
// "this stage's shared memory was read" (by wgmma, already waited for) needs no more.
__device__ __forceinline__ void mbar_arrive_cluster(std::uint32_t bar, std::uint32_t rank) {
  asm volatile(
      "{\n"
      ".reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
      "}\n" ::"r"(bar),
      "r"(rank)
      : "memory");
}

// 2D tiled bulk tensor copy shared -> global (box at coordinates (c0 innermost, c1); out-of-bounds
// parts are not written) into this thread's current bulk async-group; the shared source's generic
// writes must be ordered before it (fence_proxy_async_shared by the writers, then a barrier).
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, std::uint32_t src, std::int32_t c0,
                                             std::int32_t c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
                   reinterpret_cast<std::uint64_t>(map)),
               "r"(src), "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, std::uint32_t src, std::int32_t c2,
                                             std::int32_t c3) {  // (c0 = c1 = 0)
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %2, %3, %4}], [%1];" ::"l"(
                   reinterpret_cast<std::uint64_t>(map)),
               "r"(src), "r"(0), "r"(c2), "r"(c3)
               : "memory");
}

// ---------------------------------------------------------------- named barriers
// bar.sync / bar.arrive on hardware barrier `id` (1..15; 0 is __syncthreads) for `count` threads
// (a multiple of 32): sync waits until `count` threads arrived, arrive only counts itself.
__device__ __forceinline__ void named_bar_sync(std::uint32_t id, std::uint32_t count) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(std::uint32_t id, std::uint32_t count) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// ---------------------------------------------------------------- global stores
// One 16-byte store (ptr 16-byte aligned).
__device__ __forceinline__ void st_global_v4(void* ptr, std::uint32_t a, std::uint32_t b, std::uint32_t c,
                                             std::uint32_t d) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}

// ---------------------------------------------------------------- cp.async (4-byte copies)
// Asynchronous global -> shared copy of 4 bytes (no register is involved, so nothing waits on it).
__device__ __forceinline__ void cp_async_4(std::uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}

// An arrive on `bar` that happens once all of this thread's earlier cp.async have landed; it counts
// toward the barrier's expected arrivals (.noinc).
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(std::uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ std::int32_t ld_shared_s32(std::uint32_t addr) {
  std::int32_t v;
  asm volatile("ld.shared.s32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

__device__ __forceinline__ float ld_shared_f32(std::uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

// A bf16 in shared memory, widened to f32 (exact: its bits are the f32's upper half).
__device__ __forceinline__ float ld_shared_bf16_as_f32(std::uint32_t addr) {
  std::uint32_t v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return __uint_as_float(v << 16);
}

// ---------------------------------------------------------------- setmaxnreg
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// ---------------------------------------------------------------- wgmma
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accesses to an accumulator register across the wgmma that
// writes it asynchronously.
__device__ __forceinline__ void fence_operand(float& r) {
  asm volatile("" : "+f"(r)::"memory");
}

// Descriptor of a K-major operand tile in the 128-byte swizzle layout starting at shared address
// `addr` (1024-byte aligned for the tile; a K offset inside the 128-byte row may be added).
__device__ __forceinline__ std::uint64_t wgmma_desc_sw128(std::uint32_t addr) {
  constexpr std::uint64_t kLeading = 16 >> 4;   // unused for swizzled K-major; 1 by convention
  constexpr std::uint64_t kStride = 1024 >> 4;  // 8 rows of 128 bytes
  constexpr std::uint64_t kSwizzle128B = 1;
  return static_cast<std::uint64_t>((addr & 0x3ffffu) >> 4) | (kLeading << 16) | (kStride << 32) |
         (kSwizzle128B << 62);
}

// The same descriptor as two 32-bit words: the low word (start address >> 4 and the leading byte
// offset) varies with the address, the high word (stride byte offset, swizzle mode) does not. For
// addresses below 256 KB (all of shared memory) the address field has room for any offset inside
// it, so desc(addr + off) = desc(addr) + off / 16 in the low word: a descriptor for the next K
// step, stage or wave is one 32-bit add, and both words can live in uniform registers.
__device__ __forceinline__ std::uint32_t wgmma_desc_sw128_lo(std::uint32_t addr) {
  return static_cast<std::uint32_t>(wgmma_desc_sw128(addr));
}
inline constexpr std::uint32_t kWgmmaDescSw128Hi = static_cast<std::uint32_t>((1024u >> 4) | (1u << 30));
__device__ __forceinline__ std::uint64_t wgmma_desc_from_lo(std::uint32_t lo) {
  return (static_cast<std::uint64_t>(kWgmmaDescSw128Hi) << 32) | lo;
}

// The shared::cluster address of `bar` (a shared::cta address) in CTA `rank` of the cluster: the
// peer's window is contiguous, so addresses of its other barriers follow by plain offsets.
__device__ __forceinline__ std::uint32_t mapa_cluster(std::uint32_t bar, std::uint32_t rank) {
  std::uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(bar), "r"(rank));
  return remote;
}
// Arrive on an mbarrier of another CTA of the cluster, at a shared::cluster address (mapa_cluster).
__device__ __forceinline__ void mbar_arrive_remote(std::uint32_t remote_bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote_bar) : "memory");
}

// The wgmma wrappers' operand lists, written once: EPMOE_WGMMA_ACC_<R> is the accumulators' place-holders
// "%0, %1, ..., %<R - 1>" and EPMOE_WGMMA_OUT_<R> their operands "+f"(d[0]), ..., "+f"(d[R - 1]), for R a
// multiple of 4 up to 96 (an m64nN tile holds N / 2 per thread).
#define EPMOE_WGMMA_PCT4(i0, i1, i2, i3) "%" #i0 ", %" #i1 ", %" #i2 ", %" #i3
#define EPMOE_WGMMA_OUT4(i0, i1, i2, i3) "+f"(d[i0]), "+f"(d[i1]), "+f"(d[i2]), "+f"(d[i3])
#define EPMOE_WGMMA_ACC_4 EPMOE_WGMMA_PCT4(0, 1, 2, 3)
#define EPMOE_WGMMA_OUT_4 EPMOE_WGMMA_OUT4(0, 1, 2, 3)
#define EPMOE_WGMMA_ACC_8 EPMOE_WGMMA_ACC_4 ", " EPMOE_WGMMA_PCT4(4, 5, 6, 7)
#define EPMOE_WGMMA_OUT_8 EPMOE_WGMMA_OUT_4, EPMOE_WGMMA_OUT4(4, 5, 6, 7)
#define EPMOE_WGMMA_ACC_12 EPMOE_WGMMA_ACC_8 ", " EPMOE_WGMMA_PCT4(8, 9, 10, 11)
#define EPMOE_WGMMA_OUT_12 EPMOE_WGMMA_OUT_8, EPMOE_WGMMA_OUT4(8, 9, 10, 11)
#define EPMOE_WGMMA_ACC_16 EPMOE_WGMMA_ACC_12 ", " EPMOE_WGMMA_PCT4(12, 13, 14, 15)
#define EPMOE_WGMMA_OUT_16 EPMOE_WGMMA_OUT_12, EPMOE_WGMMA_OUT4(12, 13, 14, 15)
#define EPMOE_WGMMA_ACC_20 EPMOE_WGMMA_ACC_16 ", " EPMOE_WGMMA_PCT4(16, 17, 18, 19)
#define EPMOE_WGMMA_OUT_20 EPMOE_WGMMA_OUT_16, EPMOE_WGMMA_OUT4(16, 17, 18, 19)
#define EPMOE_WGMMA_ACC_24 EPMOE_WGMMA_ACC_20 ", " EPMOE_WGMMA_PCT4(20, 21, 22, 23)
#define EPMOE_WGMMA_OUT_24 EPMOE_WGMMA_OUT_20, EPMOE_WGMMA_OUT4(20, 21, 22, 23)
#define EPMOE_WGMMA_ACC_28 EPMOE_WGMMA_ACC_24 ", " EPMOE_WGMMA_PCT4(24, 25, 26, 27)
#define EPMOE_WGMMA_OUT_28 EPMOE_WGMMA_OUT_24, EPMOE_WGMMA_OUT4(24, 25, 26, 27)
#define EPMOE_WGMMA_ACC_32 EPMOE_WGMMA_ACC_28 ", " EPMOE_WGMMA_PCT4(28, 29, 30, 31)
#define EPMOE_WGMMA_OUT_32 EPMOE_WGMMA_OUT_28, EPMOE_WGMMA_OUT4(28, 29, 30, 31)
#define EPMOE_WGMMA_ACC_36 EPMOE_WGMMA_ACC_32 ", " EPMOE_WGMMA_PCT4(32, 33, 34, 35)
#define EPMOE_WGMMA_OUT_36 EPMOE_WGMMA_OUT_32, EPMOE_WGMMA_OUT4(32, 33, 34, 35)
#define EPMOE_WGMMA_ACC_40 EPMOE_WGMMA_ACC_36 ", " EPMOE_WGMMA_PCT4(36, 37, 38, 39)
#define EPMOE_WGMMA_OUT_40 EPMOE_WGMMA_OUT_36, EPMOE_WGMMA_OUT4(36, 37, 38, 39)
#define EPMOE_WGMMA_ACC_44 EPMOE_WGMMA_ACC_40 ", " EPMOE_WGMMA_PCT4(40, 41, 42, 43)
#define EPMOE_WGMMA_OUT_44 EPMOE_WGMMA_OUT_40, EPMOE_WGMMA_OUT4(40, 41, 42, 43)
#define EPMOE_WGMMA_ACC_48 EPMOE_WGMMA_ACC_44 ", " EPMOE_WGMMA_PCT4(44, 45, 46, 47)
#define EPMOE_WGMMA_OUT_48 EPMOE_WGMMA_OUT_44, EPMOE_WGMMA_OUT4(44, 45, 46, 47)
#define EPMOE_WGMMA_ACC_52 EPMOE_WGMMA_ACC_48 ", " EPMOE_WGMMA_PCT4(48, 49, 50, 51)
#define EPMOE_WGMMA_OUT_52 EPMOE_WGMMA_OUT_48, EPMOE_WGMMA_OUT4(48, 49, 50, 51)
#define EPMOE_WGMMA_ACC_56 EPMOE_WGMMA_ACC_52 ", " EPMOE_WGMMA_PCT4(52, 53, 54, 55)
#define EPMOE_WGMMA_OUT_56 EPMOE_WGMMA_OUT_52, EPMOE_WGMMA_OUT4(52, 53, 54, 55)
#define EPMOE_WGMMA_ACC_60 EPMOE_WGMMA_ACC_56 ", " EPMOE_WGMMA_PCT4(56, 57, 58, 59)
#define EPMOE_WGMMA_OUT_60 EPMOE_WGMMA_OUT_56, EPMOE_WGMMA_OUT4(56, 57, 58, 59)
#define EPMOE_WGMMA_ACC_64 EPMOE_WGMMA_ACC_60 ", " EPMOE_WGMMA_PCT4(60, 61, 62, 63)
#define EPMOE_WGMMA_OUT_64 EPMOE_WGMMA_OUT_60, EPMOE_WGMMA_OUT4(60, 61, 62, 63)
#define EPMOE_WGMMA_ACC_68 EPMOE_WGMMA_ACC_64 ", " EPMOE_WGMMA_PCT4(64, 65, 66, 67)
#define EPMOE_WGMMA_OUT_68 EPMOE_WGMMA_OUT_64, EPMOE_WGMMA_OUT4(64, 65, 66, 67)
#define EPMOE_WGMMA_ACC_72 EPMOE_WGMMA_ACC_68 ", " EPMOE_WGMMA_PCT4(68, 69, 70, 71)
#define EPMOE_WGMMA_OUT_72 EPMOE_WGMMA_OUT_68, EPMOE_WGMMA_OUT4(68, 69, 70, 71)
#define EPMOE_WGMMA_ACC_76 EPMOE_WGMMA_ACC_72 ", " EPMOE_WGMMA_PCT4(72, 73, 74, 75)
#define EPMOE_WGMMA_OUT_76 EPMOE_WGMMA_OUT_72, EPMOE_WGMMA_OUT4(72, 73, 74, 75)
#define EPMOE_WGMMA_ACC_80 EPMOE_WGMMA_ACC_76 ", " EPMOE_WGMMA_PCT4(76, 77, 78, 79)
#define EPMOE_WGMMA_OUT_80 EPMOE_WGMMA_OUT_76, EPMOE_WGMMA_OUT4(76, 77, 78, 79)
#define EPMOE_WGMMA_ACC_84 EPMOE_WGMMA_ACC_80 ", " EPMOE_WGMMA_PCT4(80, 81, 82, 83)
#define EPMOE_WGMMA_OUT_84 EPMOE_WGMMA_OUT_80, EPMOE_WGMMA_OUT4(80, 81, 82, 83)
#define EPMOE_WGMMA_ACC_88 EPMOE_WGMMA_ACC_84 ", " EPMOE_WGMMA_PCT4(84, 85, 86, 87)
#define EPMOE_WGMMA_OUT_88 EPMOE_WGMMA_OUT_84, EPMOE_WGMMA_OUT4(84, 85, 86, 87)
#define EPMOE_WGMMA_ACC_92 EPMOE_WGMMA_ACC_88 ", " EPMOE_WGMMA_PCT4(88, 89, 90, 91)
#define EPMOE_WGMMA_OUT_92 EPMOE_WGMMA_OUT_88, EPMOE_WGMMA_OUT4(88, 89, 90, 91)
#define EPMOE_WGMMA_ACC_96 EPMOE_WGMMA_ACC_92 ", " EPMOE_WGMMA_PCT4(92, 93, 94, 95)
#define EPMOE_WGMMA_OUT_96 EPMOE_WGMMA_OUT_92, EPMOE_WGMMA_OUT4(92, 93, 94, 95)

// D[64 x N] (+)= A[64 x 32] · B[N x 32]^T, e4m3 x e4m3 -> f32, both operands K-major in shared
// memory; accumulate = false overwrites d. N = 8, 16 .. 176 in steps of 16, 88, 120 or 192 (d holds N / 2
// values).
template <int N>
__device__ __forceinline__ void wgmma_m64k32_ss_e4m3(float (&d)[N / 2], std::uint64_t desc_a,
                                                     std::uint64_t desc_b, bool accumulate);

// The text of one e4m3 x e4m3 -> f32 wgmma m64nNk32 around its operands (both wrappers below): the
// scale-d predicate from operand IP, then the instruction; its operands; the scales and its end.
#define EPMOE_WGMMA_E4M3_HEAD(N, IP) \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" #IP ", 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 "
#define EPMOE_WGMMA_E4M3_TAIL ", p, 1, 1;\n}\n"

// The specialisation for N: R = N / 2 accumulators, then desc_a, desc_b and the flag as operands R, R + 1
// and R + 2 (IA, IB, IP: the preprocessor does not add).
#define EPMOE_WGMMA_SS_E4M3(N, R, IA, IB, IP)                                                         \
  template <>                                                                                         \
  __device__ __forceinline__ void wgmma_m64k32_ss_e4m3<N>(float(&d)[R], std::uint64_t desc_a,         \
                                                          std::uint64_t desc_b, bool accumulate) {    \
    asm volatile(EPMOE_WGMMA_E4M3_HEAD(N, IP) "{" EPMOE_WGMMA_ACC_##R "}, %" #IA                      \
                                                                      ", %" #IB EPMOE_WGMMA_E4M3_TAIL \
                 : EPMOE_WGMMA_OUT_##R                                                                \
                 : "l"(desc_a), "l"(desc_b), "r"(static_cast<std::uint32_t>(accumulate)));            \
  }
EPMOE_WGMMA_SS_E4M3(8, 4, 4, 5, 6)
EPMOE_WGMMA_SS_E4M3(16, 8, 8, 9, 10)
EPMOE_WGMMA_SS_E4M3(32, 16, 16, 17, 18)
EPMOE_WGMMA_SS_E4M3(48, 24, 24, 25, 26)
EPMOE_WGMMA_SS_E4M3(64, 32, 32, 33, 34)
EPMOE_WGMMA_SS_E4M3(80, 40, 40, 41, 42)
EPMOE_WGMMA_SS_E4M3(88, 44, 44, 45, 46)
EPMOE_WGMMA_SS_E4M3(96, 48, 48, 49, 50)
EPMOE_WGMMA_SS_E4M3(112, 56, 56, 57, 58)
EPMOE_WGMMA_SS_E4M3(120, 60, 60, 61, 62)
EPMOE_WGMMA_SS_E4M3(128, 64, 64, 65, 66)
EPMOE_WGMMA_SS_E4M3(144, 72, 72, 73, 74)
EPMOE_WGMMA_SS_E4M3(160, 80, 80, 81, 82)
EPMOE_WGMMA_SS_E4M3(176, 88, 88, 89, 90)
EPMOE_WGMMA_SS_E4M3(192, 96, 96, 97, 98)
#undef EPMOE_WGMMA_SS_E4M3

// The FP8 grouped GEMM's wave (N = 128) and the W4A8 shared-memory kernel's offset term (N = 8: B is a
// constant tile), by their own names.
__device__ __forceinline__ void wgmma_m64n128k32_e4m3(float (&d)[64], std::uint64_t desc_a,
                                                      std::uint64_t desc_b, bool accumulate) {
  wgmma_m64k32_ss_e4m3<128>(d, desc_a, desc_b, accumulate);
}
__device__ __forceinline__ void wgmma_m64n8k32_e4m3(float (&d)[4], std::uint64_t desc_a, std::uint64_t desc_b,
                                                    bool accumulate) {
  wgmma_m64k32_ss_e4m3<8>(d, desc_a, desc_b, accumulate);
}

// ---------------------------------------------------------------- bulk copies, shared loads, prmt
// Non-tensor bulk copy global -> shared of `bytes` bytes (a multiple of 16; both addresses 16-byte
// aligned), completing on the mbarrier `bar` with its byte count.
__device__ __forceinline__ void bulk_load(std::uint32_t dst, const void* src, std::uint32_t bytes,
                                          std::uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(src)), "r"(bytes), "r"(bar)
      : "memory");
}

// Non-tensor bulk copy shared -> global of `bytes` bytes (a multiple of 16; both addresses 16-byte
// aligned) into this thread's current bulk async-group. `dst` may be a peer GPU's memory mapped
// for loads and stores (NVLink): the copy engine of the SM then streams the bytes to the peer
// without a register or a store instruction per 16 bytes.
__device__ __forceinline__ void bulk_store(void* dst, std::uint32_t src, std::uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                   reinterpret_cast<std::uint64_t>(dst)),
               "r"(src), "r"(bytes)
               : "memory");
}
// Closes this thread's current bulk async-group.
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
// Waits until at most kPending of this thread's newest bulk async-groups are still reading their
// shared-memory source (the older ones' sources may be overwritten).
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
// Waits until at most kPending of this thread's newest bulk async-groups are incomplete (the older
// ones' writes are performed).
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}
// Orders this thread's completed async-proxy (bulk copy) global writes before its later generic
// accesses, e.g. the release that publishes them to another GPU (fence_proxy_async_shared, below,
// is the shared-memory counterpart).
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// This thread's lane, read where it is used (volatile: the compiler cannot hoist it, and what is
// derived from it, out of a loop, so it holds no register across the loop).
__device__ __forceinline__ std::uint32_t lane_id_here() {
  std::uint32_t lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

// Four 8 x 8 matrices of 16-bit elements into shared memory (stmatrix .x4): register i of every
// lane holds 2 consecutive elements of matrix i in the mma accumulator layout (row lane / 4, columns
// 2 (lane % 4) ..), and lane 8 i + r gives the 16-byte aligned address of matrix i's row r.
__device__ __forceinline__ void stmatrix_x4(std::uint32_t addr, std::uint32_t r0, std::uint32_t r1,
                                            std::uint32_t r2, std::uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// 16-byte shared-memory load (addr 16-byte aligned).
__device__ __forceinline__ uint4 ld_shared_v4(std::uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// 16-byte and 4-byte shared-memory stores and an 8-byte shared-memory load (addresses aligned to
// their size).
__device__ __forceinline__ void st_shared_v4(std::uint32_t addr, std::uint32_t a, std::uint32_t b,
                                             std::uint32_t c, std::uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}
__device__ __forceinline__ void st_shared_u32(std::uint32_t addr, std::uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ float2 ld_shared_f32x2(std::uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

// Orders this thread's earlier generic-proxy shared-memory writes before later async-proxy accesses
// (wgmma operand reads, TMA) that are ordered after it (e.g. through an mbarrier arrive / wait).
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// prmt.b32 (default mode): byte i of the result is byte (sel >> 4i) & 7 of {b, a} (a = bytes 0-3,
// b = bytes 4-7); when bit 3 of that selector nibble is set, the selected byte's top bit is
// replicated over the whole result byte instead. Only the low 16 bits of sel are used.
__device__ __forceinline__ std::uint32_t prmt(std::uint32_t a, std::uint32_t b, std::uint32_t sel) {
  std::uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// D[64 x N] (+)= A[64 x 32] · B[N x 32]^T, e4m3 x e4m3 -> f32, A from registers (the m64nNk32 A
// fragment: a[0] row 16 w + l / 4, k 4 (l % 4) + 0..3; a[1] the same k, row + 8; a[2] / a[3] as
// a[0] / a[1] with k + 16; warp w, lane l of the warpgroup), B K-major in shared memory
// (descriptor); accumulate = false overwrites d. N = 8, 16, 32, 64 or 128 (d holds N / 2 values).
template <int N>
__device__ __forceinline__ void wgmma_m64k32_rs_e4m3(float (&d)[N / 2], const std::uint32_t (&a)[4],
                                                     std::uint64_t desc_b, bool accumulate);

// The specialisation for N: R = N / 2 accumulators, then a[0..3], desc_b and the flag as operands R .. R + 5.
#define EPMOE_WGMMA_RS_E4M3(N, R, IA0, IA1, IA2, IA3, IB, IP)                                       \
  template <>                                                                                       \
  __device__ __forceinline__ void wgmma_m64k32_rs_e4m3<N>(float(&d)[R], const std::uint32_t(&a)[4], \
                                                          std::uint64_t desc_b, bool accumulate) {  \
    asm volatile(EPMOE_WGMMA_E4M3_HEAD(N, IP) "{" EPMOE_WGMMA_ACC_##R                               \
                 "}, {" EPMOE_WGMMA_PCT4(IA0, IA1, IA2, IA3) "}, %" #IB EPMOE_WGMMA_E4M3_TAIL       \
                 : EPMOE_WGMMA_OUT_##R                                                              \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b),                         \
                   "r"(static_cast<std::uint32_t>(accumulate)));                                    \
  }
EPMOE_WGMMA_RS_E4M3(8, 4, 4, 5, 6, 7, 8, 9)
EPMOE_WGMMA_RS_E4M3(16, 8, 8, 9, 10, 11, 12, 13)
EPMOE_WGMMA_RS_E4M3(32, 16, 16, 17, 18, 19, 20, 21)
EPMOE_WGMMA_RS_E4M3(64, 32, 32, 33, 34, 35, 36, 37)
EPMOE_WGMMA_RS_E4M3(128, 64, 64, 65, 66, 67, 68, 69)
#undef EPMOE_WGMMA_RS_E4M3
#undef EPMOE_WGMMA_E4M3_HEAD
#undef EPMOE_WGMMA_E4M3_TAIL
#undef EPMOE_WGMMA_PCT4
#undef EPMOE_WGMMA_OUT4
#undef EPMOE_WGMMA_ACC_4
#undef EPMOE_WGMMA_OUT_4
#undef EPMOE_WGMMA_ACC_8
#undef EPMOE_WGMMA_OUT_8
#undef EPMOE_WGMMA_ACC_12
#undef EPMOE_WGMMA_OUT_12
#undef EPMOE_WGMMA_ACC_16
#undef EPMOE_WGMMA_OUT_16
#undef EPMOE_WGMMA_ACC_20
#undef EPMOE_WGMMA_OUT_20
#undef EPMOE_WGMMA_ACC_24
#undef EPMOE_WGMMA_OUT_24
#undef EPMOE_WGMMA_ACC_28
#undef EPMOE_WGMMA_OUT_28
#undef EPMOE_WGMMA_ACC_32
#undef EPMOE_WGMMA_OUT_32
#undef EPMOE_WGMMA_ACC_36
#undef EPMOE_WGMMA_OUT_36
#undef EPMOE_WGMMA_ACC_40
#undef EPMOE_WGMMA_OUT_40
#undef EPMOE_WGMMA_ACC_44
#undef EPMOE_WGMMA_OUT_44
#undef EPMOE_WGMMA_ACC_48
#undef EPMOE_WGMMA_OUT_48
#undef EPMOE_WGMMA_ACC_52
#undef EPMOE_WGMMA_OUT_52
#undef EPMOE_WGMMA_ACC_56
#undef EPMOE_WGMMA_OUT_56
#undef EPMOE_WGMMA_ACC_60
#undef EPMOE_WGMMA_OUT_60
#undef EPMOE_WGMMA_ACC_64
#undef EPMOE_WGMMA_OUT_64
#undef EPMOE_WGMMA_ACC_68
#undef EPMOE_WGMMA_OUT_68
#undef EPMOE_WGMMA_ACC_72
#undef EPMOE_WGMMA_OUT_72
#undef EPMOE_WGMMA_ACC_76
#undef EPMOE_WGMMA_OUT_76
#undef EPMOE_WGMMA_ACC_80
#undef EPMOE_WGMMA_OUT_80
#undef EPMOE_WGMMA_ACC_84
#undef EPMOE_WGMMA_OUT_84
#undef EPMOE_WGMMA_ACC_88
#undef EPMOE_WGMMA_OUT_88
#undef EPMOE_WGMMA_ACC_92
#undef EPMOE_WGMMA_OUT_92
#undef EPMOE_WGMMA_ACC_96
#undef EPMOE_WGMMA_OUT_96

// ---------------------------------------------------------------- mma.sync (warp level)
// D[16 x 8] += A[16 x 32] · B[8 x 32]^T, e4m3 x e4m3 -> f32 (sm_89+), the warp-level tensor-core
// instruction (no warpgroup, no descriptors). Lane l (g = l / 4, q = l % 4): a[0] row g, k 4 q + 0..3;
// a[1] row g + 8, same k; a[2] / a[3] as a[0] / a[1] with k + 16; b[0] column (B row) g, k 4 q + 0..3;
// b[1] the same with k + 16; d[0, 1] row g, columns 2 q + {0, 1}; d[2, 3] row g + 8.
__device__ __forceinline__ void mma_m16n8k32_e4m3(float (&d)[4], const std::uint32_t (&a)[4],
                                                  const std::uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

}  // namespace epmoe::ptx
