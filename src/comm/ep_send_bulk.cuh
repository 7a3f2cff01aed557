// Send over bulk copies (cp.async.bulk), a path of the send kernel's token loop
// (SendArgs::bulk_warps > 0, EPMOE_COMM_SEND_BULK=1). Included by ep_send_kernels.cuh inside its
// anonymous namespace, after the helpers it uses (for_each_destination, send_slot, bucket_slot,
// write_topk_meta).
//
// Why: with per-lane 16-byte stores each warp has one payload row in flight and, with arrival
// counters, a system fence per token that waits for the row to land on the peer (v3: 24 send SMs
// moved 146 GB/s; without the fence 265 GB/s). Here each copying warp stages whole payload rows in
// shared memory (x by a bulk load from HBM, scales and the per-destination top-k metadata by its
// lanes) and one lane streams them to the peers with bulk stores: a stage is free again as soon as
// its bulk group has *read* it, so the rows in flight are not bounded by the staging memory, and a
// token's arrival counters move once its group has *completed*, a.bulk_lag groups later.
// (v4 run 1 reused a stage only after its group completed, one group late: ~7.7 µs per token per
// warp, 94 GB/s from 24 SMs.)
//
// Measured (bench/NOTES.md, v4 runs 1-3, 2xH200): ~4 GB/s per SM to a peer whatever the lag (94
// GB/s from 24 SMs, 170 from 64), below per-lane stores (~8 GB/s per SM): the bulk engine's rate to
// a peer, not completion latency, bounds it. Opt-in for that reason.
//
// Per warp: a ring of kBulkStages stages (token i, the warp's i-th token with a peer destination,
// uses stage i % kBulkStages and is staged kBulkLookahead tokens before it is stored) and a ring
// of kBulkTables destination tables (token i's ranks and slots, kept until it is signalled).
#pragma once

#include "cuda/ptx_hopper.cuh"

constexpr int kBulkWarps = 4;      // copying warps of a send block (at most; fewer if smem is short)
constexpr int kBulkStages = 3;     // staged payload rows per copying warp
constexpr int kBulkLookahead = 1;  // rows staged ahead of the one being stored
constexpr int kBulkTables = 8;     // destination tables per warp
constexpr int kBulkMaxLag = kBulkTables - 1 - kBulkLookahead;
constexpr int kBulkMaxDest = 32;  // destinations per token a table holds
static_assert(kBulkStages >= kBulkLookahead + 1, "a stage is staged again before its store was issued");

// Waits until at most `pending` of this thread's newest bulk groups are incomplete (pending is
// rounded down to one of 0, 1, 2, 3, 4, 6).
__device__ __forceinline__ void bulk_wait_at_most(int pending) {
  if (pending >= 6)
    ptx::bulk_wait<6>();
  else if (pending >= 4)
    ptx::bulk_wait<4>();
  else if (pending == 3)
    ptx::bulk_wait<3>();
  else if (pending == 2)
    ptx::bulk_wait<2>();
  else if (pending == 1)
    ptx::bulk_wait<1>();
  else
    ptx::bulk_wait<0>();
}

// The warp's tokens t = first, first + stride, ... (< a.T) go to every destination rank they route
// to (this rank excepted with skip_self). smem: this block's staging area (kBulkStages stages of
// a.bulk_stage_bytes per copying warp, 128-byte aligned).
__device__ void send_bulk_rows(const EpGeometry& g, const SendArgs& a, int block, int nblocks,
                               std::int64_t parity_bytes, char* smem) {
  __shared__ __align__(8) std::uint64_t full[kBulkWarps][kBulkStages];
  __shared__ int dest_rank[kBulkWarps][kBulkTables][kBulkMaxDest];
  __shared__ int dest_slot[kBulkWarps][kBulkTables][kBulkMaxDest];
  __shared__ int dest_n[kBulkWarps][kBulkTables];
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  if (warp >= a.bulk_warps) return;
  // Groups left in flight when the oldest one is signalled; the tables hold lookahead + 1 + lag.
  const int lag = min(max(a.bulk_lag, 0), kBulkMaxLag);
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
    const int st = staged % kBulkStages, tb = staged % kBulkTables;
    char* const row = ring + static_cast<std::int64_t>(st) * a.bulk_stage_bytes;
    // The stage's previous token (staged - kBulkStages) was stored at least one store ago: wait
    // until its group has read the stage (its table was signalled: staged - kBulkTables < signalled).
    if (lane == 0) ptx::bulk_wait_read<kBulkStages - 1 - kBulkLookahead>();
    for (; t < a.T; t += stride) {
      __syncwarp();  // lane 0's wait happened before any lane writes the stage or the table
      const int n = for_each_destination(g, a, t, lane, [&](int pos, int d) {
        dest_rank[warp][tb][pos] = d;
        dest_slot[warp][tb][pos] = send_slot(g, a, d, t);
      });
      if (n == 0) continue;
      if (lane == 0) {
        dest_n[warp][tb] = n;
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
        for (int i = 0; i < n; ++i)
          write_topk_meta(reinterpret_cast<std::int32_t*>(row + g.meta_off + i * tail) + 3 * lane, g,
                          dest_rank[warp][tb][i], id, slot_e, w);
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
    const int st = stored % kBulkStages, tb = stored % kBulkTables;
    __syncwarp();
    if (lane == 0) {
      char* const row = ring + static_cast<std::int64_t>(st) * a.bulk_stage_bytes;
      ptx::mbar_wait(ptx::smem_addr(&full[warp][st]), static_cast<std::uint32_t>(stored / kBulkStages) & 1u);
      for (int i = 0; i < dest_n[warp][tb]; ++i) {
        char* const dst = a.dest[dest_rank[warp][tb][i]] + parity_bytes +
                          static_cast<std::int64_t>(dest_slot[warp][tb][i]) * g.row_stride;
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
    const int tb = signalled % kBulkTables;
    if (lane == 0 && a.chunks != nullptr) {
      ptx::fence_proxy_async_global();
      __threadfence_system();
      for (int i = 0; i < dest_n[warp][tb]; ++i)
        atomicAdd_system(
            a.chunks[dest_rank[warp][tb][i]] + parity_ints + dest_slot[warp][tb][i] / a.arrival_chunk, 1u);
    }
    ++signalled;
  };

  for (;;) {
    const bool more = stage_next();
    if (!more && stored == staged) break;
    if (more && staged - stored <= kBulkLookahead) continue;
    store_oldest();
    if (stored - signalled > lag) {
      if (lane == 0) bulk_wait_at_most(stored - 1 - signalled);
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
