// Kernels of expert-parallel dispatch and combine, shared by the NCCL point-to-point transport
// ("nccl-p2p") and the NVLink load/store transport ("nvlink-ll"). Host-side declarations.
//
// One rank's view (N ranks, L local experts each, P = N*L physical experts, top-K):
//
//   route    ids [T, K] -> bitmaps [N + P][W] (bit t of bucket b: token t goes to destination
//            rank b (b < N) / to physical expert b - N), their exclusive popcount prefixes, and a
//            count row {tokens per destination [N], rows per physical expert [P], status, T, ...}.
//            A token's slot in a bucket is the number of earlier tokens in it: stable, so every
//            destination receives tokens in source order, as the CPU simulation orders them.
//   send     each token once per destination rank: a payload row {x, scales, K x (local expert or
//            -1, slot among the sender's tokens of that expert, weight)} into slot j of this rank's
//            region on the destination (NCCL: a local send buffer; NVLink: the peer's window).
//   place    on the receiver: regions ordered by source rank; token j of source s is received
//            token r = (tokens of sources < s) + j; its rows go to expert e at
//            (contiguous: offset of e, blocks padded to 128 | masked: e * M_max) + (rows of e from
//            sources < s) + its slot: exactly the CPU simulation's order.
//   reduce   on the expert rank: per received token, the weighted sum of its rows (f32, rows in
//            ascending order, rounded once to bf16), into its slot of the source's region.
//   home     per token, the partial sums of its destination ranks added in rank order (f32), bf16.
//
// With a FlagSync (NVLink transport) the senders signal per-(source rank) flags carrying a sequence
// number kept on the device (no host sync, graph capturable): a count flag as soon as the header
// (status, tokens, rows per local expert) is written, at the start of send, and an arrival flag once
// every token is written; two parities of every window region alternate between calls. Every wait
// is bounded (DeviceErrorSink on timeout). Once an error is recorded on a rank (a wait that gave up, a
// peer's refused input; until Communicator::reset_device_errors) its calls write NaN (all bits set)
// instead of results: on the NVLink transport place poisons the laid-out rows and scales and reduce
// raises no combine flag (so each peer's combine times out naming this rank instead of taking its
// sums); on either transport home writes NaN into y.
//
// Copies are latency-bound unless each warp keeps many loads in flight: every copy loop below loads
// a batch of 16-byte vectors (up to 8 per lane, 4 KB per warp) before it stores or uses any of them.
//
// Own tokens: with PlaceArgs::own_x set (a whole dispatch() call, where x stays valid throughout),
// send skips the rank itself and place reads its own tokens straight from x / ids / weights, while
// the peers' tokens are still arriving; the bytes placed are the same.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "epmoe/comm.hpp"
#include "epmoe/config.hpp"
#include "epmoe/weights.hpp"

#ifdef __CUDACC__
#define EPMOE_COMM_HD __host__ __device__
#else
#define EPMOE_COMM_HD
#endif

namespace epmoe::comm_detail {

inline constexpr int kMaxTopK = 32;
// NVLink: tokens per arrival counter. The sender bumps the counter of a token's slot chunk on its
// destination once the token is written; place copies a chunk's tokens as soon as it is complete
// (instead of after the source's last token), and its last block zeroes the counters again.
// kArrivalChunk in normal mode (the copy-engine sends copy whole chunks); low-latency mode takes
// SendArgs / PlaceArgs::arrival_chunk per call (EPMOE_COMM_LL_ARRIVAL_CHUNK, default
// kLowLatencyArrivalChunk: a token is placed as soon as it is in, not after the slowest of 64).
inline constexpr int kArrivalChunk = 64;
inline constexpr int kLowLatencyArrivalChunk = 1;
inline constexpr int kMaxPhysicalExperts = 8192;
// Copy-engine send: pieces per call at most (EPMOE_COMM_CE_PIECES is clamped to it).
inline constexpr int kMaxCePieces = 64;

struct EpGeometry {
  int N = 1, me = 0, L = 1, P = 1, K = 1;
  int G = 0;  // scale groups per row (fp8_group), else 0
  std::int64_t H = 0;
  int elt = 1;                                             // bytes per activation element
  int T_max = 0, W = 1;                                    // W: 32-bit words per bucket bitmap
  std::int64_t x_bytes = 0, meta_off = 0, row_stride = 0;  // payload row layout, 16-byte multiples
  std::int64_t partial_bytes = 0;                          // one bf16 partial sum: H * 2

  EPMOE_COMM_HD int count_row_len() const { return N + P + 4; }
  EPMOE_COMM_HD int status_index() const { return N + P; }
  static EpGeometry make(const MoeConfig& config, ActivationFormat format, int rank, int T_max);
};

// The NVLink transport's flag protocol; for the NCCL transport only `errors` is set (no flags).
struct FlagSync {
  std::uint32_t* seq = nullptr;    // this call uses s = *seq + 1 and parity s & 1
  std::int32_t* done = nullptr;    // finished-block counter of the last-block pattern
  std::int64_t parity_stride = 0;  // bytes between the two parities of every window region
  DeviceErrorSink errors{};
  std::uint64_t timeout_ns = 0;
};

void launch_route(const EpGeometry& g, const std::int32_t* ids, std::int64_t T, std::int32_t host_status,
                  float tensor_scale, std::uint32_t* bitmaps, std::int32_t* prefix, std::int32_t* count_row,
                  cudaStream_t stream);

struct SendArgs {
  const void* x = nullptr;
  const float* scales = nullptr;
  const std::int32_t* ids = nullptr;
  const float* weights = nullptr;
  std::int64_t T = 0;
  const std::uint32_t* bitmaps = nullptr;
  const std::int32_t* prefix = nullptr;
  const std::int32_t* count_row = nullptr;
  char* const* dest = nullptr;            // [N]: slot 0 of this rank's region on each destination
  std::int32_t* const* header = nullptr;  // [N] NVLink: this rank's header on each destination
  bool skip_self = false;                 // place reads this rank's own tokens from x (PlaceArgs::own_x)
  std::uint32_t* const* chunks =
      nullptr;  // [N] NVLink, optional: this rank's arrival counters on each destination
  int arrival_chunk = kArrivalChunk;  // tokens per arrival counter (kArrivalChunk)
  int blocks = 0;                     // grid; 0: send_blocks(T)
  // Set by the launchers: copying warps per send block and bytes per staged payload row of the
  // bulk-copy send (ep_send_bulk.cuh, EPMOE_COMM_SEND_BULK=1), or 0: per-lane stores (the default).
  int bulk_warps = 0, bulk_stage_bytes = 0;
  // Bulk path: bulk groups left in flight when the oldest token's counters move
  // (EPMOE_COMM_BULK_LAG, default 6). Per-lane stores: tokens per warp between system fences
  // (EPMOE_COMM_FENCE_BATCH, default 8; 1 = v3).
  int bulk_lag = 6, fence_batch = 8;
  // Copy-engine send inside the dispatch launch (EPMOE_COMM_SEND_CE=2, normal mode, whole calls;
  // ep_pack.cuh pack_pieces): with ce.staging set, the send blocks do not write to the peers but
  // pack this rank's rows for each peer into local staging memory, piece by piece, and raise a
  // per-piece ready flag on which the dispatcher's side stream waits (cuStreamWaitValue32) before
  // it copies the piece to the peer with the copy engines.
  struct CopyEngine {
    char* staging = nullptr;           // destination d's slot j: staging + (d * T_max + j) * row_stride
    std::uint32_t* want = nullptr;     // [N][n_chunks]: tokens of each 64-slot chunk (the counters' values)
    std::uint32_t* ready = nullptr;    // [pieces]: ready[p] = s once piece p is packed for every peer
    std::uint32_t* arrived = nullptr;  // [pieces]: pack warps done with piece p (zeroed by the last)
    int n_chunks = 0, pieces = 0;
    std::int64_t piece_slots = 0;  // slots per piece (a multiple of kArrivalChunk)
    std::uint32_t s = 0;           // this call's send sequence number as the host counts it
  } ce;
  FlagSync sync;
  // Early counts (EPMOE_COMM_LL_EARLY_COUNTS=1, whole dispatch() calls over SM stores; see
  // tagged_words): [N] this rank's tagged header on each destination, or null (the default:
  // header stores, a system fence, the count flag).
  std::uint64_t* const* tagged = nullptr;
  // Routing inside the dispatch launch (EPMOE_COMM_LL_ROUTE_IN_LAUNCH, with early counts;
  // launch_dispatch only): no launch_route before; every block of the launch routes ids / T
  // itself into shared memory, and block 0 also writes bitmaps, prefix and count_row (the
  // combine reads them). tensor_scale: the count row's scale word.
  bool route_in_launch = false;
  float tensor_scale = 0.0f;
  // Ranks whose kernels share this GPU (Communicator::ranks_on_device(): loopback tests): a whole
  // dispatch launch, whose blocks wait for the peers, takes at most 1/n of the resident blocks, so
  // that the peers' launches find room beside it.
  int ranks_on_device = 1;
};
// Shared memory per block of the routing inside the dispatch launch: the bitmaps and prefixes of
// the N + P buckets and the count row (at most kRouteInLaunchMaxSmem), then the T_max x K ids,
// staged in one round of loads (the routing reads each id up to K times).
inline constexpr std::size_t kRouteInLaunchMaxSmem = 32 * 1024;
inline std::size_t route_in_launch_tables_smem(const EpGeometry& g) {
  return sizeof(std::int32_t) * (2 * static_cast<std::size_t>(g.N + g.P) * static_cast<std::size_t>(g.W) +
                                 static_cast<std::size_t>(g.count_row_len()));
}
inline std::size_t route_in_launch_smem(const EpGeometry& g) {
  // + 16: the ids start at the next 16-byte boundary (vector stores).
  return route_in_launch_tables_smem(g) + 16 + sizeof(std::int32_t) * static_cast<std::size_t>(g.T_max) * g.K;
}
// Whether the routing of up to g.T_max tokens fits inside the dispatch launch.
bool route_fits_in_launch(const EpGeometry& g);
// Early counts: a source's header on a destination as tagged_words(L) 8-byte words {status,
// tokens, rows per local expert [L]}, each (sequence number s << 32) | value, written by the
// sender's block 0 with one relaxed system-scope 64-bit store per word and no fence and no count
// flag; the receiver polls every word until its tag reaches s (a naturally aligned 64-bit store
// is single-copy atomic, so a word whose tag reads s carries that call's value).
inline constexpr int kTaggedFixed = 2;  // status, tokens; then the counts
EPMOE_COMM_HD inline int tagged_words(int L) {
  return kTaggedFixed + L;
}
// NVLink header of a source on a destination:
// {arrival flag, status, tokens, T, count flag, rows per local expert [L]}.
inline constexpr int kHeaderFlag = 0, kHeaderStatus = 1, kHeaderTokens = 2, kHeaderT = 3,
                     kHeaderCountFlag = 4, kHeaderCounts = 5;
void launch_send(const EpGeometry& g, const SendArgs& a, cudaStream_t stream);
// Blocks of the send kernel (kSendThreads threads each; the block scheduler puts them on distinct
// SMs): EPMOE_COMM_SEND_SMS if set, else min(24, SMs); `T` tokens.
inline constexpr int kSendThreads = 256;
int send_blocks(std::int64_t T);
// Copy-engine send in separate launches (normal mode, EPMOE_COMM_SEND_CE=1; v4): pack writes this rank's
// payload rows for each peer into a local staging area, in the peer's slot order, one piece of destination
// slots [slot_begin, slot_end) per launch; the dispatcher copies each packed piece to the peer with
// cudaMemcpyAsync on a side stream (the copy engines: no SM writes to the peer), then the piece's
// arrival counters (want: the tokens of each 64-slot chunk) after it.
struct PackArgs {
  const void* x = nullptr;
  const float* scales = nullptr;
  const std::int32_t* ids = nullptr;
  const float* weights = nullptr;
  std::int64_t T = 0;  // 0 for a refused input
  const std::uint32_t* bitmaps = nullptr;
  const std::int32_t* prefix = nullptr;
  const std::int32_t* count_row = nullptr;
  char* staging = nullptr;        // destination d's slot j: staging + (d * T_max + j) * row_stride
  std::uint32_t* want = nullptr;  // [N][n_chunks]
  int n_chunks = 0;
  std::int64_t slot_begin = 0, slot_end = 0;
  std::int32_t* const* header = nullptr;  // [N]: this rank's header on each destination
  bool first = false, last = false;       // first piece: headers + count flags; last: the sequence
  std::uint32_t s = 0;                    // this call's send sequence number (the host's mirror)
  int blocks = 0;                         // grid; 0: send_blocks(T)
  FlagSync sync;
};
void launch_pack(const EpGeometry& g, const PackArgs& a, cudaStream_t stream);

// Phase stamps (globaltimer, ns) that the kernels of this process leave behind: the start of the
// scan / one-block route, send (block 0 start, count flags raised, last block's copies done, arrival
// flags raised), place (block 0 start, layout known, last block's own tokens done, arrival seen,
// last block done), reduce (start, last block done), home (start, flags seen, last block done).
// For the benchmark's breakdown; "max" slots are atomicMax over blocks (reset_trace zeroes them).
enum TraceSlot : int {
  kTraceRouteStart,
  kTraceSendStart,
  kTraceCountFlag,
  kTraceSendCopied,
  kTraceSendEnd,
  kTracePlaceStart,
  kTraceCounts,
  kTraceOwnDone,
  kTraceArrived,
  kTracePlaceEnd,
  kTraceReduceStart,
  kTraceReduceEnd,
  kTraceHomeStart,
  kTraceHomeArrived,
  kTraceHomeEnd,
  kTraceSlots
};
void read_trace(std::uint64_t (&out)[kTraceSlots]);
void reset_trace();
// Blocks (256 threads) of the place / reduce / home kernels for `warps` warp-sized work items.
int work_blocks(std::int64_t warps);

struct PlaceArgs {
  // What each source told this rank: field f of source s is
  // header[s * header_stride + f + parity * parity_stride / 4] for f in {flag_field (NVLink only,
  // -1 otherwise), status_field, tokens_field, counts_field + e}.
  // The count flag (NVLink) guards status, tokens and counts; the arrival flag the slots.
  const std::int32_t* header = nullptr;
  std::int64_t header_stride = 0;
  int flag_field = -1, count_flag_field = -1, status_field = 0, tokens_field = 0, counts_field = 0;
  // Optional (NCCL transport, fp8 per tensor, no host sync): the header's scale word (f32 bits), which
  // must be this rank's on every source (else kDeviceErrorScaleMismatch is recorded).
  int scale_field = -1;
  const char* slots = nullptr;  // slot j of source s: slots + parity * ps + (s * T_max + j) * row_stride
  // Optional (NVLink): arrival counters, source s at chunks + parity * ps / 4 + s * n_chunks; place
  // waits per chunk instead of for the source's arrival flag.
  std::uint32_t* chunks = nullptr;
  int n_chunks = 0;                   // counters per source (the window's, for the smallest chunk)
  int arrival_chunk = kArrivalChunk;  // tokens per counter: the sender's SendArgs::arrival_chunk
  bool contiguous = true;
  std::int64_t M_max = 0;     // masked
  std::int64_t max_rows = 0;  // rows the output buffers hold
  // Contiguous without a host sync: the layout is handed out at max_rows, so the rows past the last
  // expert block are marked -1 (m_indices, row_token) too.
  bool empty_rows_to_max = false;
  char* rows = nullptr;
  float* out_scales = nullptr;
  std::int32_t* m_indices = nullptr;  // contiguous
  std::int32_t* masked_m = nullptr;   // masked
  std::int32_t* row_token = nullptr;
  float* row_weight = nullptr;
  std::int32_t* recv_rows = nullptr;       // [N * T_max, K]
  std::int32_t* recv_src = nullptr;        // [N * T_max]
  std::int32_t* recv_slot = nullptr;       // [N * T_max]
  std::int32_t* recv_total = nullptr;      // [1]
  std::int32_t* expert_offsets = nullptr;  // [L + 1] contiguous, optional: first row of each expert
  // Optional, mapped host memory: block 0 writes {first row of each expert [L + 1], received tokens}
  // and then host_stamp at [L + 2] as soon as the counts are known, before any row is copied.
  std::int32_t* host_offsets = nullptr;
  std::int32_t host_stamp = 0;
  // Own tokens straight from the input (SendArgs::skip_self): x, scales, ids, weights, T and the
  // routing of this rank.
  const void* own_x = nullptr;
  const float* own_scales = nullptr;
  const std::int32_t* own_ids = nullptr;
  const float* own_weights = nullptr;
  std::int64_t own_T = 0;
  const std::uint32_t* bitmaps = nullptr;
  const std::int32_t* prefix = nullptr;
  // This rank's count row (set by the dispatch launch that routes inside itself: its status lets
  // the masked layout place the own tokens before the peers' counts arrive).
  const std::int32_t* count_row = nullptr;
  FlagSync sync;
  // Early counts (SendArgs::tagged; launch_dispatch only): source s's tagged header at
  // tagged + parity * ps / 8 + s * tagged_words(L). Place reads the layout from it instead of the
  // count flag and header, loads its own first token before the layout is known, and waits for
  // every peer's arrival flag before its last block recycles the parity.
  const std::uint64_t* tagged = nullptr;
};
void launch_place(const EpGeometry& g, const PlaceArgs& a, cudaStream_t stream);

// Communicator::barrier() over the LSA team, without an NCCL collective (NCCL sets up its
// collective channels, ~0.5 GB per rank on an H200, at a communicator's first collective): rank
// `me` of `n` stores `epoch` into word `me` of every rank's barrier window (`windows`: a device
// array of the n LSA pointers), then waits until words 0..n-1 of its own window (`own`) reach
// `epoch`. Bounded: a rank that does not arrive within timeout_ns is recorded in `errors`.
void launch_lsa_barrier(void* const* windows, std::uint32_t* own, int me, int n, std::uint32_t epoch,
                        const DeviceErrorSink& errors, std::uint64_t timeout_ns, cudaStream_t stream);
// Send and place in one launch (a whole dispatch() call): send_blocks(s.T) blocks send, the rest
// place, the grid capped so that every block is resident. Returns the grid size. With
// s.tagged / p.tagged set (both or neither) the early-counts instance runs.
int launch_dispatch(const EpGeometry& g, const SendArgs& s, const PlaceArgs& p, cudaStream_t stream);

struct ReduceArgs {
  const void* expert_out = nullptr;  // bf16 [rows, H]
  const float* row_weight = nullptr;
  const std::int32_t* recv_rows = nullptr;
  const std::int32_t* recv_src = nullptr;
  const std::int32_t* recv_slot = nullptr;
  const std::int32_t* recv_total = nullptr;
  char* const* dest = nullptr;           // [N]: slot 0 of this rank's partial region on each source
  std::uint32_t* const* flag = nullptr;  // [N] NVLink: this rank's combine flag on each source
  // Warps per received token (combine_split()): 1, the default, one warp sums a token's whole
  // partial; S > 1: S warps each sum one slice of the hidden dimension (same bits, S times the
  // warps, grid S times larger): a small batch keeps S times the loads in flight.
  int split = 1;
  FlagSync sync;
};
// EPMOE_COMM_COMBINE_SPLIT (clamped to [1, kMaxCombineSplit]; unset: `fallback`): warps per token
// of the combine's reduce and home kernels (ReduceArgs::split, HomeArgs::split), read by the NVLink
// transport at each combine_send / combine_recv (so at capture time for a graph). The transport's
// fallback is low_latency_combine_split(g) in low-latency mode and 1 in normal mode.
inline constexpr int kMaxCombineSplit = 64;
// 2xH200, H = 7168 (bench/NOTES.md, comm LL v6): at 128 tokens per rank the LL combine took 38.7 us
// with one warp per token, 24.2 with 4, 22.3 with 7, 26.8 with 14 (two waves of blocks); at 256
// tokens 47.5 / 31.7 / 36.7 (7 is two waves there). Normal mode gains nothing (4096 tokens already
// fill the GPU with one warp each: split 2 293 us, 7 303, 1 294).
inline constexpr int kLowLatencyCombineSplit = 7;
// The largest of kLowLatencyCombineSplit, 4, 2 whose split reduce over N * T_max tokens fits in one
// resident wave on this device, else 1.
int low_latency_combine_split(const EpGeometry& g);
int combine_split(int fallback);
void launch_reduce(const EpGeometry& g, const ReduceArgs& a, cudaStream_t stream);

struct HomeArgs {
  const char* partials = nullptr;  // from d, slot j: partials + parity * ps + (d * T_max + j) * partial_bytes
  const std::uint32_t* flags = nullptr;  // NVLink: flag of d at flags + parity * ps / 4 + d * flag_stride
  std::int64_t flag_stride = 0;          // in 32-bit words
  const std::uint32_t* bitmaps = nullptr;
  const std::int32_t* prefix = nullptr;
  std::int64_t T = 0;
  void* y = nullptr;  // bf16 [T, H]
  int split = 1;      // warps per token, as ReduceArgs::split
  FlagSync sync;
};
void launch_home(const EpGeometry& g, const HomeArgs& a, cudaStream_t stream);

// Debugging the combine flags (EPMOE_COMM_WATCH=1, nvlink_ll_dispatcher.cpp): one thread per source d
// copies, in stream order, the combine flag source d wrote into this rank's window and the one this
// rank wrote into d's window, at both parities, into out[4 d .. 4 d + 3] (host-mapped memory).
void launch_watch_flags(const std::uint32_t* local_flags, const std::uint32_t* const* peer_flags,
                        std::int64_t parity_stride, int n, std::uint32_t* out, unsigned long long* time_ns,
                        cudaStream_t stream);

}  // namespace epmoe::comm_detail
