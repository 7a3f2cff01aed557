// Send kernels of expert-parallel dispatch: headers / tagged counts, send_body and send_kernel, with the
// copy-engine pack (ep_pack.cuh) and bulk-copy send (ep_send_bulk.cuh). Host launchers in ep_kernels.cu.
#pragma once

#include <cstdint>

#include "comm/ep_device_common.cuh"
#include "comm/ep_kernels.hpp"
#include "cuda/ptx_hopper.cuh"  // before the namespace: ep_send_bulk.cuh includes it inside

namespace epmoe::comm_detail {
namespace {

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

// Token t's destination ranks in rank order (this rank left out with skip_self): on the lane of
// each destination d, on_destination(pos, d) with pos its place in that order. Returns how many there
// are (the same on every lane). Both send paths.
template <typename OnDestination>
__device__ __forceinline__ int for_each_destination(const EpGeometry& g, const SendArgs& a, std::int64_t t,
                                                    int lane, OnDestination&& on_destination) {
  int n = 0;
  for (int d0 = 0; d0 < g.N; d0 += 32) {
    const int d = d0 + lane;
    const bool has = d < g.N && (!a.skip_self || d != g.me) && bucket_has(a.bitmaps, g.W, d, t);
    const unsigned m = __ballot_sync(kFull, has);
    if (has) on_destination(n + __popc(m & lanemask_lt()), d);
    n += __popc(m);
  }
  return n;
}

// One top-k entry of a row's metadata at `meta` (3 words), for a row bound for rank `rank`: the
// expert's local index there (-1 where another rank owns it), the expert's receive slot, the weight.
__device__ __forceinline__ void write_topk_meta(std::int32_t* meta, const EpGeometry& g, int rank, int id,
                                                int slot_e, float w) {
  meta[0] = id / g.L == rank ? id % g.L : -1;
  meta[1] = slot_e;
  meta[2] = __float_as_int(w);
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
      const int n = for_each_destination(g, a, t, lane, [&](int pos, int d) {
        const int j = send_slot(g, a, d, t);
        target[warp][pos] = a.dest[d] + parity_bytes + static_cast<std::int64_t>(j) * g.row_stride;
        target_rank[warp][pos] = d;
        target_slot[warp][pos] = j;
      });
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
        for (int i = 0; i < n; ++i)
          write_topk_meta(reinterpret_cast<std::int32_t*>(target[warp][i] + g.meta_off) + 3 * lane, g,
                          target_rank[warp][i], id, slot_e, w);
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

}  // namespace
}  // namespace epmoe::comm_detail
