// Pack of the copy-engine send: lays out this rank's payload rows for each peer in local staging
// memory exactly as they must land there. Two forms: pack_kernel (PackArgs, one launch per piece,
// EPMOE_COMM_SEND_CE=1, v4) and pack_pieces (SendArgs::ce, the send blocks of the one dispatch
// launch, EPMOE_COMM_SEND_CE=2, v5). Included by ep_send_kernels.cuh inside its anonymous namespace,
// after the routing helpers, send_headers and finish_block.
//
// Why: SM stores to a peer saturate at ~270 GB/s per direction on 2xH200 whatever the SM count
// (v3/v4 runs), and from 24 SMs at ~200 GB/s; the copy engines move ~396 GB/s peer to peer with no
// SM. They copy contiguous bytes only, so the rows are first laid out locally (slot order, the
// metadata for that peer) at HBM speed, a piece of slots at a time, so that the copy of piece p
// overlaps the packing of piece p + 1.
//
// v4 measured the separate launches: each costs ~8-12 µs before its rows (one thread's binary
// search for the piece's token range, a block barrier, launch and event), and place, queued behind
// them on the stream, started only after the last (254 µs per dispatch). pack_pieces runs beside
// place in the dispatch launch instead, finds the ranges with a warp each, and tells the copy
// engines that a piece is ready through a flag in device memory (a stream wait-value on the side
// stream), so neither the packing nor place waits for a launch.
#pragma once

// The source token of slot j of bucket b (j < the bucket's count): the word that holds it by a
// binary search over the bucket's exclusive popcount prefix, then its bit.
__device__ std::int64_t token_of_slot(const std::uint32_t* bitmaps, const std::int32_t* prefix, int W,
                                      int bucket, std::int64_t j) {
  const std::int32_t* p = prefix + static_cast<std::int64_t>(bucket) * W;
  const int lo = last_at_most(p, W, j);  // the word that holds slot j
  std::uint32_t m = bitmaps[static_cast<std::int64_t>(bucket) * W + lo];
  for (std::int64_t k = j - p[lo]; k > 0; --k) m &= m - 1u;
  return static_cast<std::int64_t>(lo) * 32 + (__ffs(static_cast<int>(m)) - 1);
}

// token_of_slot by a whole warp (every lane gets the result): each round the lanes test 32 evenly
// spaced prefix words at once, so W = 128 words (4096 tokens) take two dependent loads instead of
// the binary search's seven. The prefix is non-decreasing, so the words with p[w] <= j are a
// prefix of the candidates and the last of them is found by one ballot.
__device__ std::int64_t warp_token_of_slot(const std::uint32_t* bitmaps, const std::int32_t* prefix, int W,
                                           int bucket, std::int64_t j, int lane) {
  const std::int32_t* p = prefix + static_cast<std::int64_t>(bucket) * W;
  int lo = 0, n = W;  // the answer lies in [lo, lo + n); p[lo] <= j always (p[0] = 0)
  for (;;) {
    const int step = n > 32 ? (n + 31) / 32 : 1;
    const int w = lo + lane * step;
    const unsigned ok = __ballot_sync(kFull, lane * step < n && p[w] <= j);
    lo += (__popc(ok) - 1) * step;
    if (step == 1) break;
    n = min(step, n - (__popc(ok) - 1) * step);
  }
  std::uint32_t m = bitmaps[static_cast<std::int64_t>(bucket) * W + lo];
  for (std::int64_t k = j - p[lo]; k > 0; --k) m &= m - 1u;
  return static_cast<std::int64_t>(lo) * 32 + (__ffs(static_cast<int>(m)) - 1);
}

// A warp: token t's payload row for destination d (x, scales, the top-k metadata as d reads it)
// at `row`. target: the warp's one-entry pointer table in shared memory (copy_fanout's argument).
__device__ __forceinline__ void pack_row(const EpGeometry& g, const void* x, const float* scales,
                                         const std::int32_t* ids, const float* weights,
                                         const std::uint32_t* bitmaps, const std::int32_t* prefix, int d,
                                         std::int64_t t, char* row, char** target, int lane) {
  if (lane == 0) target[0] = row;
  __syncwarp();
  copy_fanout(static_cast<const char*>(x) + t * g.x_bytes, target, 1, g.x_bytes / 16, lane);
  for (int c = lane; c < g.G; c += 32) reinterpret_cast<float*>(row + g.x_bytes)[c] = scales[t * g.G + c];
  if (lane < g.K) {
    const int id = ids[t * g.K + lane];
    write_topk_meta(reinterpret_cast<std::int32_t*>(row + g.meta_off) + 3 * lane, g, d, id,
                    bucket_slot(bitmaps, prefix, g.W, g.N + id, t), weights[t * g.K + lane]);
  }
  __syncwarp();
}

// Grid: any number of kSendThreads blocks. For every peer d: the tokens whose slot on d lies in
// [slot_begin, slot_end) (a contiguous token range, slots grow with the token index), a warp per
// token: x, scales and the top-k metadata as d must receive them.
__global__ void __launch_bounds__(kSendThreads) pack_kernel(EpGeometry g, PackArgs a) {
  __shared__ char* target[kSendWarps][1];
  __shared__ std::int64_t token_range[2];
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const std::int64_t parity_ints = static_cast<std::int64_t>(a.s & 1u) * a.sync.parity_stride / 4;
  const int status = a.count_row[g.status_index()];
  if (blockIdx.x == 0 && tid == 0 && a.first) stamp(kTraceSendStart);
  if (blockIdx.x == 0 && a.first) send_headers(g, a.header, a.count_row, status, a.T, a.s, parity_ints);
  for (int d = 0; d < g.N; ++d) {
    if (d == g.me) continue;
    // A refused input sends no rows (count 0), but its counters are still written: every counter
    // the copy engine delivers holds this call's value (0 where the peer waits for nothing), so a
    // late copy never leaves a stale count behind for the call after next.
    const std::int64_t count = status != 0 ? 0 : a.count_row[d];
    const std::int64_t j0 = min(a.slot_begin, count), j1 = min(a.slot_end, count);
    if (blockIdx.x == 0)
      for (std::int64_t c = a.slot_begin / kArrivalChunk + tid; c * kArrivalChunk < a.slot_end;
           c += kSendThreads) {
        // Tokens of chunk c on d: what d's place waits for; the copy engine delivers it after the rows.
        const std::int64_t left = count - c * kArrivalChunk;
        const std::int64_t tokens = left < 0 ? 0 : (left > kArrivalChunk ? kArrivalChunk : left);
        a.want[static_cast<std::int64_t>(d) * a.n_chunks + c] = static_cast<std::uint32_t>(tokens);
      }
    if (j0 >= j1) continue;
    if (tid == 0) {
      token_range[0] = token_of_slot(a.bitmaps, a.prefix, g.W, d, j0);
      token_range[1] = j1 < count ? token_of_slot(a.bitmaps, a.prefix, g.W, d, j1) : a.T;
    }
    __syncthreads();
    const std::int64_t t0 = token_range[0], t1 = token_range[1];
    __syncthreads();
    char* const region = a.staging + static_cast<std::int64_t>(d) * g.T_max * g.row_stride;
    for (std::int64_t t = t0 + static_cast<std::int64_t>(blockIdx.x) * kSendWarps + warp; t < t1;
         t += static_cast<std::int64_t>(gridDim.x) * kSendWarps) {
      if (!bucket_has(a.bitmaps, g.W, d, t)) continue;
      char* const row = region + bucket_slot(a.bitmaps, a.prefix, g.W, d, t) * g.row_stride;
      pack_row(g, a.x, a.scales, a.ids, a.weights, a.bitmaps, a.prefix, d, t, row, target[warp], lane);
    }
  }
  if (tid == 0) stamp_max(kTraceSendCopied);
  // The next call's kernels compute their sequence number from *seq; nothing in this call reads it
  // after the first piece (the host passes s).
  if (a.last && blockIdx.x == 0 && tid == 0) *a.sync.seq = a.s;
}

// A warp: token t's payload row for peer d at its slot in `region`, if t is in d's bucket (else
// nothing). Every load of the row is issued before any of its stores, in two dependent rounds
// (the bucket word, its prefix, the top-k ids and weights, the scales; then x and the slots of the
// token's experts): one row at a time per warp, a row had seven dependent round trips in v5 run 1
// (~7 µs beside place's HBM traffic), now two. Scales beyond 64 groups per row take a slower loop.
__device__ __forceinline__ void pack_row_if_in_bucket(const EpGeometry& g, const SendArgs& a, int d,
                                                      std::int64_t t, char* region, int lane) {
  const std::int64_t wi = static_cast<std::int64_t>(d) * g.W + (t >> 5);
  const std::uint32_t word = a.bitmaps[wi];
  const std::int32_t pre = a.prefix[wi];
  int id = 0;
  float w = 0.0f;
  if (lane < g.K) {
    id = a.ids[t * g.K + lane];
    w = a.weights[t * g.K + lane];
  }
  const float* sc = a.scales + t * g.G;
  const float s0 = lane < g.G ? sc[lane] : 0.0f, s1 = lane + 32 < g.G ? sc[lane + 32] : 0.0f;
  if (((word >> (t & 31)) & 1u) == 0) return;  // the same for every lane
  char* const row =
      region + static_cast<std::int64_t>(pre + __popc(word & ((1u << (t & 31)) - 1u))) * g.row_stride;
  const int slot_e = lane < g.K ? bucket_slot(a.bitmaps, a.prefix, g.W, g.N + id, t) : 0;
  const char* const src = static_cast<const char*>(a.x) + t * g.x_bytes;
  const std::int64_t vecs = g.x_bytes / 16;
  for (std::int64_t base = 0; base < vecs; base += 32 * kBatch) {
    uint4 r[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const std::int64_t v = base + lane + 32 * u;
      r[u] = v < vecs ? ld_v4(src + v * 16) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const std::int64_t v = base + lane + 32 * u;
      if (v < vecs) st_v4(row + v * 16, r[u]);
    }
  }
  float* const row_scales = reinterpret_cast<float*>(row + g.x_bytes);
  if (lane < g.G) row_scales[lane] = s0;
  if (lane + 32 < g.G) row_scales[lane + 32] = s1;
  for (int c = lane + 64; c < g.G; c += 32) row_scales[c] = sc[c];
  if (lane < g.K)
    write_topk_meta(reinterpret_cast<std::int32_t*>(row + g.meta_off) + 3 * lane, g, d, id, slot_e, w);
}

// The send blocks of the dispatch launch under the copy-engine send (SendArgs::ce): block 0 writes
// the headers, count flags and every peer's chunk counter values first; then every warp packs, piece
// by piece, the rows of every token t = its warp index mod the pack warps (balanced over the whole
// call, not per piece) whose slot on a peer lies in the piece, into local staging in the peer's slot
// order. No block-wide meeting point per piece (v5 run 1 measured one: each piece cost its slowest
// warp's few rows, ~5-11 µs a piece): each warp fences its own rows (system scope: the reader is a
// copy engine) and arrives at the piece's counter; the last of all the pack warps raises
// ready[p] = s, on which the dispatcher's side stream waits. The token range of a piece on a peer:
// [end of the previous piece, the token of the piece's last slot + 1), the end found by a warp
// search and carried by lane d (peers d < 32; a search for both ends beyond). A pack warp waits for
// nothing, so every flag is always raised (a stream wait cannot time out).
__device__ void pack_pieces(const EpGeometry& g, const SendArgs& a, int block, int nblocks) {
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const SendArgs::CopyEngine& ce = a.ce;
  // The host's count of this call (the parity of the rows it copies; *seq + 1 on the device).
  const std::uint32_t s = ce.s;
  const std::int64_t parity_ints = static_cast<std::int64_t>(s & 1u) * a.sync.parity_stride / 4;
  const int status = a.count_row[g.status_index()];
  if (block == 0 && tid == 0) stamp(kTraceSendStart);
  if (block == 0) {
    send_headers(g, a.header, a.count_row, status, a.T, s, parity_ints);
    // Tokens of chunk c on d: what d's place waits for once the copy engine has delivered it
    // after the chunk's rows; 0 where d waits for nothing, so that a copy landing late never
    // leaves a stale count behind for the call after next.
    for (int i = tid; i < g.N * ce.n_chunks; i += kSendThreads) {
      const int d = i / ce.n_chunks, c = i % ce.n_chunks;
      const std::int64_t count = status != 0 || d == g.me ? 0 : a.count_row[d];
      const std::int64_t left = count - static_cast<std::int64_t>(c) * kArrivalChunk;
      ce.want[i] = static_cast<std::uint32_t>(left < 0 ? 0 : (left > kArrivalChunk ? kArrivalChunk : left));
    }
    // Every thread's counter values are visible before any warp of this block arrives at a piece.
    __threadfence_system();
    __syncthreads();
  }
  const std::int64_t nwarps = static_cast<std::int64_t>(nblocks) * kSendWarps;
  const std::int64_t gwarp = static_cast<std::int64_t>(block) * kSendWarps + warp;
  std::int64_t carried_t0 = 0;  // lane d: where peer d's next piece starts (its tokens before are done)
  for (int p = 0; p < ce.pieces; ++p) {
    const std::int64_t slot_begin = static_cast<std::int64_t>(p) * ce.piece_slots;
    const std::int64_t slot_end = min(slot_begin + ce.piece_slots, a.T);
    for (int d = 0; d < g.N && status == 0; ++d) {
      if (d == g.me) continue;
      const std::int64_t count = a.count_row[d];
      const std::int64_t j0 = min(slot_begin, count), j1 = min(slot_end, count);
      if (j0 >= j1) continue;
      const std::int64_t t0 = d < 32 ? __shfl_sync(kFull, carried_t0, d)
                                     : warp_token_of_slot(a.bitmaps, a.prefix, g.W, d, j0, lane);
      const std::int64_t t1 = j1 < count ? warp_token_of_slot(a.bitmaps, a.prefix, g.W, d, j1, lane) : a.T;
      if (lane == d) carried_t0 = t1;
      char* const region = ce.staging + static_cast<std::int64_t>(d) * g.T_max * g.row_stride;
      // The first token >= t0 that is this warp's (t = gwarp mod nwarps).
      for (std::int64_t t = t0 + ((gwarp - t0 % nwarps) + nwarps) % nwarps; t < t1; t += nwarps)
        pack_row_if_in_bucket(g, a, d, t, region, lane);
    }
    // This warp's rows of the piece are in memory before the copy engine can read them; the last
    // pack warp to arrive raises the flag.
    __syncwarp();
    __threadfence_system();
    __syncwarp();
    if (lane == 0 && atomicAdd(&ce.arrived[p], 1u) == static_cast<std::uint32_t>(nwarps - 1)) {
      ce.arrived[p] = 0;  // for the next call (no warp of this one touches it again)
      __threadfence_system();
      st_release_sys(&ce.ready[p], s);
    }
  }
  __syncthreads();
  if (tid == 0) stamp_max(kTraceSendCopied);
  // The next call's kernels compute their sequence number from *seq.
  if (finish_block(a.sync.done, nblocks) && tid == 0) {
    *a.sync.seq = s;
    stamp(kTraceSendEnd);
  }
}
