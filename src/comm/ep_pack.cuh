// Pack kernel of the copy-engine send (PackArgs, ep_kernels.hpp). Included by ep_kernels.cu inside
// its anonymous namespace, after the routing helpers and send_headers.
//
// Why: SM stores to a peer saturate at ~270 GB/s per direction on 2xH200 whatever the SM count
// (v3/v4 runs), and from 24 SMs at ~200 GB/s; the copy engines move ~396 GB/s peer to peer with no
// SM. They copy contiguous bytes only, so this kernel first lays out this rank's rows for each
// peer exactly as they must land there (slot order, metadata for that peer), in local memory at
// HBM speed, one piece of slots per launch so that the copy of piece p overlaps the packing of
// piece p + 1.
#pragma once

// The source token of slot j of bucket b (j < the bucket's count): the word that holds it by a
// binary search over the bucket's exclusive popcount prefix, then its bit.
__device__ std::int64_t token_of_slot(const std::uint32_t* bitmaps, const std::int32_t* prefix, int W,
                                      int bucket, std::int64_t j) {
  const std::int32_t* p = prefix + static_cast<std::int64_t>(bucket) * W;
  int lo = 0, hi = W - 1;  // the last word w with p[w] <= j
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (p[mid] <= j)
      lo = mid;
    else
      hi = mid - 1;
  }
  std::uint32_t m = bitmaps[static_cast<std::int64_t>(bucket) * W + lo];
  for (std::int64_t k = j - p[lo]; k > 0; --k) m &= m - 1u;
  return static_cast<std::int64_t>(lo) * 32 + (__ffs(static_cast<int>(m)) - 1);
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
  const std::int64_t vecs = g.x_bytes / 16;
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
      if (lane == 0) target[warp][0] = row;
      __syncwarp();
      copy_fanout(static_cast<const char*>(a.x) + t * g.x_bytes, target[warp], 1, vecs, lane);
      for (int c = lane; c < g.G; c += 32)
        reinterpret_cast<float*>(row + g.x_bytes)[c] = a.scales[t * g.G + c];
      if (lane < g.K) {
        const int id = a.ids[t * g.K + lane];
        auto* meta = reinterpret_cast<std::int32_t*>(row + g.meta_off) + 3 * lane;
        meta[0] = id / g.L == d ? id % g.L : -1;
        meta[1] = bucket_slot(a.bitmaps, a.prefix, g.W, g.N + id, t);
        meta[2] = __float_as_int(a.weights[t * g.K + lane]);
      }
      __syncwarp();
    }
  }
  if (tid == 0) stamp_max(kTraceSendCopied);
  // The next call's kernels compute their sequence number from *seq; nothing in this call reads it
  // after the first piece (the host passes s).
  if (a.last && blockIdx.x == 0 && tid == 0) *a.sync.seq = a.s;
}
