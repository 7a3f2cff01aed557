// Place kernels of expert-parallel dispatch (receiver side): wait_tagged, place_body and place_kernel.
// Host launcher in ep_kernels.cu.
#pragma once

#include <cstdint>

#include "comm/ep_device_common.cuh"
#include "comm/ep_kernels.hpp"

namespace epmoe::comm_detail {
namespace {

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

}  // namespace
}  // namespace epmoe::comm_detail
