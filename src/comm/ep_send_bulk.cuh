// Send over bulk copies (cp.async.bulk), the default path of the send kernel's token loop
// (SendArgs::bulk_warps > 0). Included by ep_kernels.cu inside its anonymous namespace, after the
// routing helpers (bucket_has, bucket_slot, lanemask_lt) it uses.
//
// Why: with per-lane 16-byte stores each warp had one payload row in flight and, with arrival
// counters, a system fence per token that waited for the row to land on the peer (v3: 24 send SMs
// moved 146 GB/s; without the fence 265 GB/s). Here each copying warp stages whole payload rows in
// shared memory (x by a bulk load from HBM, scales and the per-destination top-k metadata by its
// lanes) and one lane streams them to the peers with bulk stores: the copy engine of the SM moves
// the bytes, several rows per warp are in flight, and a token's arrival counter moves only once
// its bulk group has completed, kBulkSignalLag rows later, so no wait stalls the stream of stores.
//
// Per warp, a ring of kBulkStages stages; token i (the warp's i-th token with a peer destination)
// uses stage i % kBulkStages: staged (load + metadata) kBulkLookahead tokens before it is stored,
// its counters bumped kBulkSignalLag stores after. Stage i % S is reused by token i + S only after
// token i's group completed (S >= lookahead + 1 + lag), which also means its source was read.
#pragma once

#include "cuda/ptx_hopper.cuh"

constexpr int kBulkWarps = 4;      // copying warps of a send block (at most; fewer if smem is short)
constexpr int kBulkStages = 3;     // staged payload rows per copying warp
constexpr int kBulkLookahead = 1;  // rows staged ahead of the one being stored
constexpr int kBulkSignalLag = 1;  // newer bulk groups still in flight when a token is signalled
constexpr int kBulkMaxDest = 32;   // destinations per token the staging tables hold
static_assert(kBulkStages >= kBulkLookahead + 1 + kBulkSignalLag, "a stage is reused before it is free");

// The warp's tokens t = first, first + stride, ... (< a.T) go to every destination rank they route
// to (this rank excepted with skip_self). smem: this block's staging area (kBulkWarps stages of
// a.bulk_stage_bytes each per warp, 128-byte aligned).
__device__ void send_bulk_rows(const EpGeometry& g, const SendArgs& a, int block, int nblocks,
                               std::int64_t parity_bytes, char* smem) {
  __shared__ __align__(8) std::uint64_t full[kBulkWarps][kBulkStages];
  __shared__ int dest_rank[kBulkWarps][kBulkStages][kBulkMaxDest];
  __shared__ int dest_slot[kBulkWarps][kBulkStages][kBulkMaxDest];
  __shared__ int dest_n[kBulkWarps][kBulkStages];
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  if (warp >= a.bulk_warps) return;
  const std::int64_t tail = g.row_stride - g.meta_off;  // metadata bytes of one destination's row
  const std::int64_t parity_ints = parity_bytes / 4;
  char* const ring = smem + static_cast<std::int64_t>(warp) * kBulkStages * a.bulk_stage_bytes;
  if (lane == 0) {
    for (int st = 0; st < kBulkStages; ++st) ptx::mbar_init(ptx::smem_addr(&full[warp][st]), 1);
    ptx::fence_barrier_init();
  }
  __syncwarp();

  const std::int64_t stride = static_cast<std::int64_t>(nblocks) * a.bulk_warps;
  std::int64_t t = static_cast<std::int64_t>(block) * a.bulk_warps + warp;
  int staged = 0, stored = 0, signalled = 0;

  // Stages the warp's next token that has a peer destination; false when there is none left.
  auto stage_next = [&]() -> bool {
    const int st = staged % kBulkStages;
    char* const row = ring + static_cast<std::int64_t>(st) * a.bulk_stage_bytes;
    for (; t < a.T; t += stride) {
      int n = 0;     // destinations of token t, in rank order
      __syncwarp();  // lane 0's wait for this stage's previous group happened before any lane writes it
      for (int d0 = 0; d0 < g.N; d0 += 32) {
        const int d = d0 + lane;
        const bool has = d < g.N && (!a.skip_self || d != g.me) && bucket_has(a.bitmaps, g.W, d, t);
        const unsigned m = __ballot_sync(kFull, has);
        if (has) {
          const int pos = n + __popc(m & lanemask_lt());
          dest_rank[warp][st][pos] = d;
          dest_slot[warp][st][pos] = bucket_slot(a.bitmaps, a.prefix, g.W, d, t);
        }
        n += __popc(m);
      }
      if (n == 0) continue;
      if (lane == 0) {
        dest_n[warp][st] = n;
        const std::uint32_t bar = ptx::smem_addr(&full[warp][st]);
        ptx::mbar_arrive_expect_tx(bar, static_cast<std::uint32_t>(g.x_bytes));
        ptx::bulk_load(ptx::smem_addr(row), static_cast<const char*>(a.x) + t * g.x_bytes,
                       static_cast<std::uint32_t>(g.x_bytes), bar);
      }
      for (int c = lane; c < g.G; c += 32)
        reinterpret_cast<float*>(row + g.x_bytes)[c] = a.scales[t * g.G + c];
      __syncwarp();
      if (lane < g.K) {
        const int id = a.ids[t * g.K + lane];
        const float w = a.weights[t * g.K + lane];
        const int slot_e = bucket_slot(a.bitmaps, a.prefix, g.W, g.N + id, t);
        for (int i = 0; i < n; ++i) {
          auto* meta = reinterpret_cast<std::int32_t*>(row + g.meta_off + i * tail) + 3 * lane;
          meta[0] = id / g.L == dest_rank[warp][st][i] ? id % g.L : -1;
          meta[1] = slot_e;
          meta[2] = __float_as_int(w);
        }
      }
      ptx::fence_proxy_async_shared();  // the lanes' shared writes before the bulk stores read them
      t += stride;
      ++staged;
      return true;
    }
    return false;
  };
  // Stores the oldest staged token to its destinations (one bulk group).
  auto store_oldest = [&] {
    const int st = stored % kBulkStages;
    __syncwarp();
    if (lane == 0) {
      char* const row = ring + static_cast<std::int64_t>(st) * a.bulk_stage_bytes;
      ptx::mbar_wait(ptx::smem_addr(&full[warp][st]), static_cast<std::uint32_t>(stored / kBulkStages) & 1u);
      for (int i = 0; i < dest_n[warp][st]; ++i) {
        char* const dst = a.dest[dest_rank[warp][st][i]] + parity_bytes +
                          static_cast<std::int64_t>(dest_slot[warp][st][i]) * g.row_stride;
        ptx::bulk_store(dst, ptx::smem_addr(row), static_cast<std::uint32_t>(g.meta_off));
        ptx::bulk_store(dst + g.meta_off, ptx::smem_addr(row + g.meta_off + i * tail),
                        static_cast<std::uint32_t>(tail));
      }
      ptx::bulk_commit();
    }
    ++stored;
  };
  // Lane 0, once the oldest unsignalled token's group has completed: its arrival counters.
  auto signal_oldest = [&] {
    const int st = signalled % kBulkStages;
    if (lane == 0 && a.chunks != nullptr) {
      ptx::fence_proxy_async_global();
      __threadfence_system();
      for (int i = 0; i < dest_n[warp][st]; ++i)
        atomicAdd_system(
            a.chunks[dest_rank[warp][st][i]] + parity_ints + dest_slot[warp][st][i] / kArrivalChunk, 1u);
    }
    ++signalled;
  };

  for (;;) {
    const bool more = stage_next();
    if (!more && stored == staged) break;
    if (more && staged - stored <= kBulkLookahead) continue;
    store_oldest();
    if (stored - signalled > kBulkSignalLag) {
      if (lane == 0) ptx::bulk_wait<kBulkSignalLag>();
      signal_oldest();
    }
  }
  if (lane == 0) {
    ptx::bulk_wait<0>();
    ptx::fence_proxy_async_global();  // the arrival flag (finish_block's fences) publishes them too
  }
  while (signalled < stored) signal_oldest();
  __syncwarp();
}
