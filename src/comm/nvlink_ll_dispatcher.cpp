// "nvlink-ll" / "nvlink": dispatch / combine over NVLink loads and stores into a symmetric window
// (epmoe/comm_dispatch.hpp). Low-latency mode (masked layout) has no host sync; normal mode
// ("nvlink" only; contiguous layout) learns the expert offsets in dispatch_recv.
//
// Window of every rank, two parities (calls alternate between them, so a fast rank's next call
// never overwrites what a slow rank is still reading):
//   parity p: [headers: N x {flag, status, tokens, T, rows per local expert [L]}]
//             [token slots: N x T_max x payload row]      (source s writes region s)
//             [combine flags: N x 16 bytes]
//             [partial sums: N x T_max x H bf16]           (expert rank d writes region d)
//             [arrival counters: N x ceil(T_max / 64)]    (source s bumps region s per token written)
//             [tagged headers: N x (2 + L) 8-byte words]   (early counts: source s writes region s)
// Sequence numbers live on the device (send, receive and combine): a call uses s = seq + 1 and
// parity s & 1, the kernel's last block stores seq = s. Nothing depends on the host, so the four
// halves can be captured in CUDA graphs and replayed.
//
// A whole dispatch() call (x valid throughout) is one launch after the routing: a few blocks send
// (comm_detail::send_blocks: the SMs that write to the peers) while the others place; the own
// tokens skip the window (send writes only to the peers, place reads them from x). Place sizes the
// layout from the count flags (raised before any token is sent), places the own tokens, then the
// peers' as their arrival flags come. Normal mode: place publishes the layout to mapped host
// memory first, so the host returns as soon as it knows it, while the rows are still being copied.
// EPMOE_COMM_SEND_CE=1 / 2 (normal mode): the copy engines move the rows instead of send's SM
// stores (dispatch_by_copy_engines: separate pack launches, v4; dispatch_by_copy_engines_in_launch:
// the packing inside the one dispatch launch, v5). EPMOE_COMM_COMBINE_SPLIT=S (both modes): the
// combine's reduce and home kernels give each token S warps, one per slice of the hidden dimension
// (comm_detail::combine_split; default low_latency_combine_split in low-latency mode, 1 in normal
// mode). Early counts (EPMOE_COMM_LL_EARLY_COUNTS=1 / 0; default on in low-latency mode, off in
// normal mode; both modes, whole dispatch() calls over SM stores; the same on every rank): send's block 0
// writes the header as tagged 8-byte words with no fence and no count flag, place polls the
// words, loads its first own token before the layout is known and waits for the peers' arrival
// flags at its end (comm_detail::send_tagged_counts has the ordering argument). With early counts
// the dispatch launch also routes the tokens itself (no route kernel before it;
// EPMOE_COMM_LL_ROUTE_IN_LAUNCH=0 for the route kernel).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>

#include <cudaTypedefs.h>

#include "comm/comm_internal.hpp"
#include "comm/gpu_dispatcher_base.hpp"
#include "cuda/driver_entry.hpp"
#include "dispatch/dispatch_common.hpp"
#include "epmoe/comm_dispatch.hpp"

namespace epmoe {
namespace {

std::int64_t up(std::int64_t x, std::int64_t a) {
  return (x + a - 1) / a * a;
}

// cuStreamWaitValue32 from the driver the runtime already loaded (nothing extra is linked). The
// v2 stream memory operations are available by default on every platform (CUDA >= 11.7).
PFN_cuStreamWaitValue32_v11070 stream_wait_value32() {
  static const auto fn = cuda::driver_entry_point<PFN_cuStreamWaitValue32_v11070>(
      "cuStreamWaitValue32", 12000, "unset EPMOE_COMM_SEND_CE");
  return fn;
}

class NvlinkLlDispatcher final : public comm_detail::GpuDispatcherBase {
 public:
  NvlinkLlDispatcher(const std::string& name, const DispatcherContext& context,
                     std::shared_ptr<Communicator> comm, bool allow_normal)
      : GpuDispatcherBase(name, context, std::move(comm)) {
    EPMOE_CHECK(
        allow_normal || context.mode == Mode::low_latency,
        "nvlink-ll serves low-latency mode (masked layout); use \"nvlink\" or nccl-p2p for normal mode");
    // NCCL gives a one-rank communicator no symmetric memory (its own error says only that).
    EPMOE_CHECK(comm_->size() > 1 || comm_->loopback(),
                "{} needs at least 2 ranks (NCCL has no symmetric memory for a one-rank communicator); "
                "on one GPU the layer uses the local permutation (dispatcher \"local\")",
                name_);
    const std::int64_t N = g_.N, me = g_.me;
    header_ints_ = up(comm_detail::kHeaderCounts + g_.L, 4);
    hdr_off_ = 0;
    slot_off_ = up(hdr_off_ + N * header_ints_ * 4, 256);
    cflag_off_ = up(slot_off_ + N * g_.T_max * g_.row_stride, 256);
    cslot_off_ = up(cflag_off_ + N * 16, 256);
    // Arrival counters per source: one per kArrivalChunk tokens in normal mode; one per token in
    // low-latency mode, so that any EPMOE_COMM_LL_ARRIVAL_CHUNK fits (a few hundred words).
    n_chunks_ =
        contiguous() ? (g_.T_max + comm_detail::kArrivalChunk - 1) / comm_detail::kArrivalChunk : g_.T_max;
    chunk_off_ = up(cslot_off_ + N * g_.T_max * g_.partial_bytes, 256);
    tag_off_ = up(chunk_off_ + N * n_chunks_ * 4, 256);
    parity_stride_ = up(tag_off_ + N * comm_detail::tagged_words(g_.L) * 8, 4096);
    window_ = comm_->alloc_symmetric(static_cast<std::size_t>(2 * parity_stride_));  // collective, zeroed
    EPMOE_CHECK(comm_->all_ranks_lsa(),
                "{} needs every rank's memory reachable by NVLink loads and stores, but this rank's LSA team "
                "has {} of the {} ranks; use nccl-p2p",
                name_, comm_->lsa_size(), comm_->size());

    std::vector<void*> send_dest, send_hdr, reduce_dest, reduce_flag, send_chunks, send_tagged;
    for (int d = 0; d < g_.N; ++d) {
      auto* peer = static_cast<char*>(window_->peer_pointer(d));
      EPMOE_CHECK(peer != nullptr, "{}: no load/store pointer to rank {}'s window", name_, d);
      send_dest.push_back(peer + slot_off_ + me * g_.T_max * g_.row_stride);
      send_hdr.push_back(peer + hdr_off_ + me * header_ints_ * 4);
      reduce_dest.push_back(peer + cslot_off_ + me * g_.T_max * g_.partial_bytes);
      reduce_flag.push_back(peer + cflag_off_ + me * 16);
      send_chunks.push_back(peer + chunk_off_ + me * n_chunks_ * 4);
      send_tagged.push_back(peer + tag_off_ + me * comm_detail::tagged_words(g_.L) * 8);
    }
    for (int d = 0; d < g_.N; ++d) {
      send_dest_host_.push_back(static_cast<char*>(send_dest[static_cast<std::size_t>(d)]));
      send_chunks_host_.push_back(static_cast<std::uint32_t*>(send_chunks[static_cast<std::size_t>(d)]));
    }
    send_dest_ = comm_detail::upload_pointers(send_dest);
    send_hdr_ = comm_detail::upload_pointers(send_hdr);
    reduce_dest_ = comm_detail::upload_pointers(reduce_dest);
    reduce_flag_ = comm_detail::upload_pointers(reduce_flag);
    send_chunks_ = comm_detail::upload_pointers(send_chunks);
    send_tagged_ = comm_detail::upload_pointers(send_tagged);
    // [0] receive seq, [1] combine seq, [2] send seq, [4..8) done counters
    sync_state_ = cuda::DeviceBuffer(64);
    sync_state_.fill_bytes(0, comm_->stream());
    if (contiguous()) {
      // Normal mode: the host learns the expert offsets once per dispatch (they size the output),
      // from mapped memory that place writes as soon as it knows them: {offsets [L + 1], tokens, stamp}.
      offsets_dev_ = cuda::DeviceBuffer(sizeof(std::int32_t) * static_cast<std::size_t>(g_.L + 1));
      void* mapped = nullptr;
      offsets_host_ = static_cast<std::int32_t*>(
          comm_detail::alloc_host_mapped(sizeof(std::int32_t) * static_cast<std::size_t>(g_.L + 3), &mapped));
      offsets_mapped_ = static_cast<std::int32_t*>(mapped);
    }
    if (env_int("EPMOE_COMM_WATCH", 0) == 1 && g_.N <= kWatchMaxRanks) {
      void* mapped = nullptr;
      watch_host_ = static_cast<WatchRecord*>(
          comm_detail::alloc_host_mapped(sizeof(WatchRecord) * kWatchRecords, &mapped));
      watch_dev_ = static_cast<WatchRecord*>(mapped);
    }
    comm_->barrier();  // every rank's state is ready before anyone sends
    diagnostic_ = comm_->add_diagnostic([this] { return describe_state(); });
  }

  ~NvlinkLlDispatcher() override {
    comm_->remove_diagnostic(diagnostic_);
    // Nothing of ours may still run when the window goes (every device wait is bounded; the copy
    // engines' stream waits end once the dispatch launch before them has packed).
    (void)cudaStreamSynchronize(comm_->stream());
    for (const cuda::Stream& side : ce_streams_) (void)cudaStreamSynchronize(side);
    if (offsets_host_ != nullptr) (void)cudaFreeHost(offsets_host_);
    if (watch_host_ != nullptr) (void)cudaFreeHost(watch_host_);
  }

  // Read from the device when asked (the dispatch itself never syncs for them).
  const DispatchStats& last_stats() const override { return stats_from_device(send_seq_); }
  std::size_t window_bytes() const override { return window_->size(); }
  std::size_t device_bytes() const override {
    std::size_t bytes = base_buffer_bytes() + window_->size();
    for (const cuda::DeviceBuffer* b :
         {&send_dest_, &send_hdr_, &reduce_dest_, &reduce_flag_, &send_chunks_, &send_tagged_, &sync_state_,
          &offsets_dev_, &staging_, &want_, &ce_flags_})
      bytes += b->size();
    return bytes;
  }

  void send(const DispatchInput& in, bool whole) override {
    enter("dispatch_send");
    const std::int64_t T = validate_input(in);
    const std::int32_t host_status = T > g_.T_max ? kInputTooManyTokens : 0;
    const cudaStream_t stream = comm_->stream();
    chunked_ = chunks_enabled();
    // Early counts: whole calls over SM stores; a refused input too (send alone then writes the
    // tagged status, so that the peers' early-count place reports it instead of timing out).
    early_ = whole && !(contiguous() && chunked_ && copy_engine_mode() != 0) && early_counts_enabled();
    // Routing inside the dispatch launch: whole calls with early counts whose input is accepted
    // (a refused input goes to send alone, which reads the routing from the route kernel).
    const bool route_in_launch =
        early_ && host_status == 0 && route_in_launch_enabled() && comm_detail::route_fits_in_launch(g_);
    if (!route_in_launch)
      comm_detail::launch_route(g_, in.topk_ids.as<std::int32_t>(), T, host_status, in.x_tensor_scale,
                                bitmaps_.as<std::uint32_t>(), prefix_.as<std::int32_t>(),
                                count_row_.as<std::int32_t>(), stream);
    comm_detail::SendArgs s = send_inputs(in, T, host_status, count_row_.as<std::int32_t>(), whole);
    s.dest = send_dest_.as<char* const>();
    s.header = send_hdr_.as<std::int32_t* const>();
    s.chunks = chunked_ ? send_chunks_.as<std::uint32_t* const>() : nullptr;
    arrival_chunk_ = contiguous() ? comm_detail::kArrivalChunk : low_latency_arrival_chunk();
    s.arrival_chunk = arrival_chunk_;
    s.sync = sync(2, 4);
    own_direct_ = whole && host_status == 0;
    copy_engines_ = own_direct_ && contiguous() && chunked_ ? copy_engine_mode() : 0;
    if (early_) s.tagged = send_tagged_.as<std::uint64_t* const>();
    s.route_in_launch = route_in_launch;
    s.tensor_scale = in.x_tensor_scale;
    s.ranks_on_device = comm_->ranks_on_device();
    if (own_direct_) {
      pending_send_ = s;  // recv launches it together with place
    } else {
      s.skip_self = false;
      comm_detail::launch_send(g_, s, stream);
    }
    ++send_seq_;  // every send advances the device's send sequence by one
    tensor_scale_ = in.x_tensor_scale;
    last_T_ = host_status != 0 ? 0 : T;
    dispatched_ = false;
    // The peers got an error status instead of tokens; now refuse here too.
    EPMOE_CHECK(host_status == 0,
                "{}: rank {} has {} tokens, more than the buffers hold (max_tokens_per_rank = {})", name_,
                g_.me, T, g_.T_max);
    sent_ = true;
  }

  // own: the input of a whole dispatch() (own tokens are read from it), else nullptr.
  void recv(DispatchOutput& out, const DispatchInput* own) override {
    enter("dispatch_recv");
    EPMOE_CHECK(sent_, "{}: dispatch_recv needs a dispatch_send first", name_);
    comm_detail::PlaceArgs p = place_outputs();
    p.header = reinterpret_cast<const std::int32_t*>(static_cast<const char*>(window_->local()) + hdr_off_);
    p.header_stride = header_ints_;
    p.flag_field = comm_detail::kHeaderFlag;
    p.status_field = comm_detail::kHeaderStatus;
    p.tokens_field = comm_detail::kHeaderTokens;
    p.count_flag_field = comm_detail::kHeaderCountFlag;
    p.counts_field = comm_detail::kHeaderCounts;
    p.slots = static_cast<const char*>(window_->local()) + slot_off_;
    if (chunked_) {
      p.chunks = reinterpret_cast<std::uint32_t*>(static_cast<char*>(window_->local()) + chunk_off_);
      p.n_chunks = static_cast<int>(n_chunks_);
      p.arrival_chunk = arrival_chunk_;
    }
    p.sync = sync(0, 5);
    if (early_)
      p.tagged =
          reinterpret_cast<const std::uint64_t*>(static_cast<const char*>(window_->local()) + tag_off_);
    if (own != nullptr && own_direct_) place_own_inputs(p, *own);
    EPMOE_CHECK(own_direct_ == (own != nullptr),
                "{}: dispatch_recv must follow dispatch_send (and dispatch() "
                "runs both)",
                name_);
    if (contiguous()) {
      p.expert_offsets = offsets_dev_.as<std::int32_t>();
      p.host_offsets = offsets_mapped_;
      p.host_stamp = static_cast<std::int32_t>(++host_stamp_ & 0x7fffffff);
    }
    if (copy_engines_ == 1)
      dispatch_by_copy_engines(p);
    else if (copy_engines_ == 2)
      dispatch_by_copy_engines_in_launch(p);
    else if (own_direct_)
      comm_detail::launch_dispatch(g_, pending_send_, p, comm_->stream());
    else
      comm_detail::launch_place(g_, p, comm_->stream());
    sent_ = false;
    if (contiguous() && !context_.host_sync) {
      // The layout at its bound (max_rows_): place marks the rows past the last expert block -1
      // (PlaceArgs::empty_rows_to_max), so the host needs neither the offsets nor a wait.
      fill_output(out, max_rows_, -1, tensor_scale_, {}, 0);
    } else if (contiguous()) {
      // One bounded host wait: the contiguous layout's size and offsets, written by place before it
      // copies any row.
      wait_offsets(p.host_stamp);
      std::vector<std::int64_t> offsets(offsets_host_, offsets_host_ + g_.L + 1);
      const std::int64_t m_sum = offsets.back();
      fill_output(out, m_sum, offsets_host_[g_.L + 1], tensor_scale_, std::move(offsets), 0);
    } else {
      fill_output(out, max_rows_, -1, tensor_scale_, {}, estimated_m(last_T_));
    }
    output_rows_ = out.num_output_rows();
    dispatched_ = true;
    watch(1);
  }

  // Spins (bounded) until place has published the offsets of this call; a device-side error (a peer
  // that never raised its count flag, a refused input) is reported by its record, a hang by the
  // stream wait that ends every spin past the device timeout.
  void wait_offsets(std::int32_t stamp) {
    const volatile std::int32_t* flag = offsets_host_ + g_.L + 2;
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(comm_->timeout_s() + 1.0);
    for (std::uint32_t spins = 0; *flag != stamp; ++spins) {
      if ((spins & 255u) == 255u) {
        comm_->check_device_errors();
        if (std::chrono::steady_clock::now() > deadline) {
          comm_->synchronize(CommPhase::dispatch_recv, "the token counts of every rank");
          break;
        }
        if (spins > 100000) std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
    }
    std::atomic_thread_fence(std::memory_order_acquire);
    comm_->check_device_errors();
    EPMOE_CHECK(*flag == stamp, "{}: rank {}: place did not publish the layout", name_, g_.me);
  }

  // Copy-engine send (EPMOE_COMM_SEND_CE=1, normal mode, whole dispatch() calls): pack kernels lay
  // out this rank's rows for each peer in local staging memory, a piece of slots per launch; a side
  // stream copies each piece to the peer's window with cudaMemcpyAsync once it is packed, then the
  // piece's arrival counters (copies on one stream complete in order, so a peer that sees a counter
  // sees the rows). Meanwhile place (own tokens from x, then the peers' chunks as their counters
  // come) runs on the main stream, which finally waits for the side stream: the next call packs
  // into the same staging memory. The copies cover the first T slots of every peer (the host does
  // not know how many a peer gets; the rows past its count are not read).
  void dispatch_by_copy_engines(const comm_detail::PlaceArgs& p) {
    const cudaStream_t stream = comm_->stream();
    const std::int64_t T = last_T_, stride = g_.row_stride;
    ensure_copy_engine_state();
    const std::int64_t parity_bytes = static_cast<std::int64_t>(send_seq_ & 1u) * parity_stride_;
    const std::int64_t piece = piece_slots(T);
    const comm_detail::SendArgs& s = pending_send_;
    comm_detail::PackArgs a;
    a.x = s.x;
    a.scales = s.scales;
    a.ids = s.ids;
    a.weights = s.weights;
    a.T = T;
    a.bitmaps = s.bitmaps;
    a.prefix = s.prefix;
    a.count_row = s.count_row;
    a.staging = staging_.as<char>();
    a.want = want_.as<std::uint32_t>();
    a.n_chunks = static_cast<int>(n_chunks_);
    a.header = s.header;
    a.s = send_seq_;
    a.sync = s.sync;
    std::size_t piece_index = 0;
    for (std::int64_t begin = 0;; begin += piece) {
      a.slot_begin = begin;
      a.slot_end = std::min(T, begin + piece);
      a.first = begin == 0;
      a.last = a.slot_end >= T;
      comm_detail::launch_pack(g_, a, stream);
      if (a.slot_end > a.slot_begin) {
        if (piece_index == piece_events_.size()) piece_events_.emplace_back(cudaEventDisableTiming);
        const cuda::Event& packed = piece_events_[piece_index++];
        packed.record(stream);
        EPMOE_CUDA_CHECK(cudaStreamWaitEvent(ce_streams_[0], packed, 0));
        const std::int64_t c0 = a.slot_begin / comm_detail::kArrivalChunk;
        const std::int64_t c1 = (a.slot_end + comm_detail::kArrivalChunk - 1) / comm_detail::kArrivalChunk;
        for (int d = 0; d < g_.N; ++d) {
          if (d == g_.me) continue;
          EPMOE_CUDA_CHECK(cudaMemcpyAsync(
              send_dest_host_[static_cast<std::size_t>(d)] + parity_bytes + a.slot_begin * stride,
              staging_.as<char>() + (std::int64_t{d} * g_.T_max + a.slot_begin) * stride,
              static_cast<std::size_t>((a.slot_end - a.slot_begin) * stride), cudaMemcpyDeviceToDevice,
              ce_streams_[0]));
          EPMOE_CUDA_CHECK(
              cudaMemcpyAsync(reinterpret_cast<char*>(send_chunks_host_[static_cast<std::size_t>(d)]) +
                                  parity_bytes + c0 * static_cast<std::int64_t>(sizeof(std::uint32_t)),
                              want_.as<std::uint32_t>() + d * n_chunks_ + c0,
                              static_cast<std::size_t>(c1 - c0) * sizeof(std::uint32_t),
                              cudaMemcpyDeviceToDevice, ce_streams_[0]));
        }
      }
      if (a.last) break;
    }
    comm_detail::launch_place(g_, p, stream);
    ce_done_[0].record(ce_streams_[0]);
    EPMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, ce_done_[0], 0));
  }

  // Copy-engine send with the packing inside the one dispatch launch (EPMOE_COMM_SEND_CE=2, normal
  // mode, whole dispatch() calls; v5). The send blocks pack this rank's rows for each peer into the
  // staging memory piece by piece, beside place, and raise ready[p] = s once piece p is packed
  // (comm_detail::pack_pieces); a side stream waits for each flag with cuStreamWaitValue32 and
  // copies the piece to every peer's window, then the piece's arrival counters (copies on one stream
  // complete in order, so a peer that sees a counter sees the rows). EPMOE_COMM_CE_STREAMS=2
  // alternates the pieces over two side streams, so that one piece's counter copy and the next
  // piece's wait can overlap a row copy. The main stream finally waits for the side streams: the
  // next call packs into the same staging memory.
  //
  // Ordering and hangs. The side streams' work is enqueued after the launch (host order) and waits
  // for an event recorded before it (after the routing): a dependency CUDA sees. The one it does
  // not see, "piece p packed", is the flag. A stream wait cannot time out, so the flags are raised
  // unconditionally: a pack warp waits for nothing (no peer, no other warp), and a refused input
  // still raises every flag. A peer that never arrives is reported by place's bounded waits
  // (dispatch-recv, naming it) while the copies complete into its window regardless.
  //
  // Not capturable as a whole: normal mode publishes the layout to the host at every call (the
  // host sizes the output from it). The stream wait-values would capture as batch memory-operation
  // nodes (CUDA >= 11.7); that was not tried.
  void dispatch_by_copy_engines_in_launch(const comm_detail::PlaceArgs& p) {
    const cudaStream_t stream = comm_->stream();
    const std::int64_t T = last_T_, stride = g_.row_stride;
    ensure_copy_engine_state();
    const std::int64_t parity_bytes = static_cast<std::int64_t>(send_seq_ & 1u) * parity_stride_;
    const std::int64_t piece = piece_slots(T);
    const int pieces = static_cast<int>((T + piece - 1) / piece);
    const auto streams = static_cast<std::size_t>(std::clamp(env_int("EPMOE_COMM_CE_STREAMS", 1), 1, 2));
    std::uint32_t* const ready = ce_flags_.as<std::uint32_t>();
    comm_detail::SendArgs s = pending_send_;
    s.ce.staging = staging_.as<char>();
    s.ce.want = want_.as<std::uint32_t>();
    s.ce.ready = ready;
    s.ce.arrived = ready + comm_detail::kMaxCePieces;
    s.ce.n_chunks = static_cast<int>(n_chunks_);
    s.ce.pieces = pieces;
    s.ce.piece_slots = piece;
    s.ce.s = send_seq_;
    ce_routed_->record(stream);
    comm_detail::launch_dispatch(g_, s, p, stream);
    const PFN_cuStreamWaitValue32_v11070 wait_value = stream_wait_value32();
    for (std::size_t q = 0; q < streams; ++q)
      EPMOE_CUDA_CHECK(cudaStreamWaitEvent(ce_streams_[q], *ce_routed_, 0));
    for (int k = 0; k < pieces; ++k) {
      const cudaStream_t side = ce_streams_[static_cast<std::size_t>(k) % streams];
      const CUresult r =
          wait_value(side, reinterpret_cast<CUdeviceptr>(ready + k), send_seq_, CU_STREAM_WAIT_VALUE_GEQ);
      EPMOE_CHECK(r == CUDA_SUCCESS, "{}: rank {}: cuStreamWaitValue32 failed ({}); unset EPMOE_COMM_SEND_CE",
                  name_, g_.me, static_cast<int>(r));
      const std::int64_t begin = k * piece, end = std::min(T, begin + piece);
      const std::int64_t c0 = begin / comm_detail::kArrivalChunk;
      const std::int64_t c1 = (end + comm_detail::kArrivalChunk - 1) / comm_detail::kArrivalChunk;
      for (int d = 0; d < g_.N; ++d) {
        if (d == g_.me) continue;
        EPMOE_CUDA_CHECK(cudaMemcpyAsync(
            send_dest_host_[static_cast<std::size_t>(d)] + parity_bytes + begin * stride,
            staging_.as<char>() + (std::int64_t{d} * g_.T_max + begin) * stride,
            static_cast<std::size_t>((end - begin) * stride), cudaMemcpyDeviceToDevice, side));
        EPMOE_CUDA_CHECK(cudaMemcpyAsync(
            reinterpret_cast<char*>(send_chunks_host_[static_cast<std::size_t>(d)]) + parity_bytes +
                c0 * static_cast<std::int64_t>(sizeof(std::uint32_t)),
            want_.as<std::uint32_t>() + d * n_chunks_ + c0,
            static_cast<std::size_t>(c1 - c0) * sizeof(std::uint32_t), cudaMemcpyDeviceToDevice, side));
      }
    }
    for (std::size_t q = 0; q < streams; ++q) {
      ce_done_[q].record(ce_streams_[q]);
      EPMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, ce_done_[q], 0));
    }
  }

  // Slots per piece of the copy-engine sends: T in EPMOE_COMM_CE_PIECES pieces (default 8, at
  // most kMaxCePieces), whole arrival chunks each.
  static std::int64_t piece_slots(std::int64_t T) {
    const std::int64_t pieces =
        std::clamp<std::int64_t>(env_int("EPMOE_COMM_CE_PIECES", 8), 1, comm_detail::kMaxCePieces);
    return std::max<std::int64_t>(comm_detail::kArrivalChunk,
                                  up((T + pieces - 1) / pieces, comm_detail::kArrivalChunk));
  }

  // The copy-engine sends' staging, counter values, piece flags (ready [kMaxCePieces] and arrived
  // [kMaxCePieces], zeroed), side streams and events, made at the first such call.
  void ensure_copy_engine_state() {
    if (!staging_.empty()) return;
    staging_ = cuda::DeviceBuffer(static_cast<std::size_t>(std::int64_t{g_.N} * g_.T_max * g_.row_stride));
    want_ = cuda::DeviceBuffer(static_cast<std::size_t>(g_.N) * static_cast<std::size_t>(n_chunks_) *
                               sizeof(std::uint32_t));
    ce_flags_ = cuda::DeviceBuffer(2 * comm_detail::kMaxCePieces * sizeof(std::uint32_t));
    ce_flags_.fill_bytes(0, comm_->stream());
    for (int q = 0; q < 2; ++q) {
      ce_streams_.emplace_back();
      ce_done_.emplace_back(cudaEventDisableTiming);
    }
    ce_routed_.emplace(cudaEventDisableTiming);
  }

  void combine_send(const TensorView& expert_out) override {
    enter("combine_send");
    validate_expert_out(expert_out);
    comm_detail::ReduceArgs r = reduce_inputs(expert_out);
    r.dest = reduce_dest_.as<char* const>();
    r.flag = reduce_flag_.as<std::uint32_t* const>();
    r.sync = sync(1, 6);
    r.split = combine_split();
    comm_detail::launch_reduce(g_, r, comm_->stream());
    combine_sent_ = true;
    watch(2);
  }

  void combine_recv(const TensorView& y) override {
    enter("combine_recv");
    EPMOE_CHECK(combine_sent_, "{}: combine_recv needs a combine_send first", name_);
    validate_y(y);
    comm_detail::HomeArgs h = home_inputs(y);
    h.partials = static_cast<const char*>(window_->local()) + cslot_off_;
    h.flags = reinterpret_cast<const std::uint32_t*>(static_cast<const char*>(window_->local()) + cflag_off_);
    h.flag_stride = 4;
    h.sync = sync(1, 7);
    h.split = combine_split();
    comm_detail::launch_home(g_, h, comm_->stream());
    combine_sent_ = false;
    watch(3);
  }

 private:
  comm_detail::FlagSync sync(int seq_index, int done_index) const {
    comm_detail::FlagSync s;
    s.seq = sync_state_.as<std::uint32_t>() + seq_index;
    s.done = sync_state_.as<std::int32_t>() + done_index;
    s.parity_stride = parity_stride_;
    s.errors = comm_->device_error_sink();
    s.timeout_ns = static_cast<std::uint64_t>(comm_->timeout_s() * 1e9);
    return s;
  }

  std::unique_ptr<SymmetricBuffer> window_;
  // Arrival counters per 64 tokens (on unless EPMOE_COMM_CHUNKS=0: then place waits for each
  // source's last token); read at each dispatch_send, the same on every rank.
  static int env_int(const char* name, int fallback) {
    const char* env = std::getenv(name);
    return env != nullptr && *env != '\0' ? std::atoi(env) : fallback;
  }
  // EPMOE_COMM_SEND_CE: 0 (default) SM stores, 1 separate pack launches (v4), 2 packing inside the
  // dispatch launch (v5).
  static int copy_engine_mode() {
    const int v = env_int("EPMOE_COMM_SEND_CE", 0);
    return v == 1 || v == 2 ? v : 0;
  }
  // EPMOE_COMM_LL_EARLY_COUNTS=1 / 0: early counts on / off (see the top of the file); unset: on in
  // low-latency mode (2xH200, 128 tokens per rank: 31.7 -> 27.0 us), off in normal mode (not
  // measured there); read at each send.
  bool early_counts_enabled() const {
    return env_int("EPMOE_COMM_LL_EARLY_COUNTS", context_.mode == Mode::low_latency ? 1 : 0) == 1;
  }
  // EPMOE_COMM_LL_ROUTE_IN_LAUNCH=0: the route kernel before the dispatch launch even where early
  // counts would let the launch route the tokens itself (the default, 1; read at each dispatch).
  static bool route_in_launch_enabled() { return env_int("EPMOE_COMM_LL_ROUTE_IN_LAUNCH", 1) == 1; }
  // EPMOE_COMM_LL_ARRIVAL_CHUNK (low-latency mode; clamped to [1, kArrivalChunk], read at each
  // dispatch_send): tokens per arrival counter.
  static int low_latency_arrival_chunk() {
    return std::clamp(env_int("EPMOE_COMM_LL_ARRIVAL_CHUNK", comm_detail::kLowLatencyArrivalChunk), 1,
                      comm_detail::kArrivalChunk);
  }
  // Warps per token of the combine (comm_detail::combine_split): by mode unless the environment says.
  int combine_split() const {
    return comm_detail::combine_split(
        context_.mode == Mode::low_latency ? comm_detail::low_latency_combine_split(g_) : 1);
  }
  static bool chunks_enabled() {
    const char* env = std::getenv("EPMOE_COMM_CHUNKS");
    return env == nullptr || std::string(env) != "0";
  }

  // For a timed-out wait's message: the device sequence numbers and done counters, and what every
  // source wrote into this rank's window (combine flags, the first header words) at both parities.
  std::string describe_state() const {
    // Each word read on its own ("?" where a read fails: a peer that has gone freed its window).
    const auto read = [](const void* device, std::size_t bytes) -> std::vector<std::string> {
      std::vector<std::uint32_t> v(bytes / 4);
      std::vector<std::string> out;
      const bool ok = cudaMemcpyAsync(v.data(), device, bytes, cudaMemcpyDeviceToHost, cudaStreamPerThread) ==
                          cudaSuccess &&
                      cudaStreamSynchronize(cudaStreamPerThread) == cudaSuccess;
      if (!ok) (void)cudaGetLastError();
      for (const std::uint32_t w : v) out.push_back(ok ? std::to_string(w) : "?");
      return out;
    };
    const std::vector<std::string> st = read(sync_state_.data(), 64);
    const auto* local = static_cast<const char*>(window_->local());
    std::string flags, headers, sent, windows;
    for (int d = 0; d < g_.N; ++d) {
      std::string f, h, o;
      const auto* peer = static_cast<const char*>(window_->peer_pointer(d));
      for (int parity = 0; parity < 2; ++parity) {
        const char* sep = parity == 0 ? "" : "|";
        const char* base = local + parity * parity_stride_;
        f += fmt::format("{}{}", sep, read(base + cflag_off_ + d * 16, 4)[0]);
        const std::vector<std::string> w = read(base + hdr_off_ + d * header_ints_ * 4, 16);
        h += fmt::format("{}{},{},{},{}", sep, w[0], w[1], w[2], w[3]);
        o += fmt::format("{}{}", sep, read(peer + parity * parity_stride_ + cflag_off_ + g_.me * 16, 4)[0]);
      }
      flags += fmt::format(" {}:{}", d, f);
      headers += fmt::format(" {}:{}", d, h);
      sent += fmt::format(" {}:{}", d, o);
      windows += fmt::format(" {}:{}", d, static_cast<const void*>(peer));
    }
    return fmt::format(
               "{} on rank {} (window {}): host calls {}; "
               "device seq receive {} combine {} send {}, done counters {} {} {} {}, host send seq {}; "
               "combine flags by source [parity 0|1]:{}; "
               "this rank's combine flag in each peer's window [parity 0|1]:{}; "
               "header words by source:{}; peer windows:{}",
               name_, g_.me, static_cast<const void*>(local), host_calls(), st[0], st[1], st[2], st[4], st[5],
               st[6], st[7], send_seq_, flags, sent, headers, windows) +
           describe_watch();
  }

  // EPMOE_COMM_WATCH=1 (debugging the combine flags, eager calls only; at most kWatchMaxRanks ranks):
  // after dispatch_recv (step 1), combine_send (2) and combine_recv (3), in stream order, the combine
  // flags at both parities that every source wrote into this rank's window and that this rank wrote
  // into every peer's, into a ring of host-mapped records that describe_state prints.
  static constexpr int kWatchMaxRanks = 8, kWatchRecords = 16;
  struct WatchRecord {
    std::uint32_t step, call;
    unsigned long long time_ns;               // the GPU's global timer when the watch kernel ran
    unsigned long long host_ns;               // the host's clock when the call had enqueued its work
    std::uint32_t words[4 * kWatchMaxRanks];  // per source d: [own p0, own p1, in d's window p0, p1]
  };
  WatchRecord* watch_host_ = nullptr;
  WatchRecord* watch_dev_ = nullptr;
  std::uint32_t watch_calls_ = 0;
  void watch(std::uint32_t step) {
    if (watch_host_ == nullptr) return;
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    EPMOE_CUDA_CHECK(cudaStreamIsCapturing(comm_->stream(), &capturing));
    if (capturing != cudaStreamCaptureStatusNone) return;
    const std::uint32_t i = watch_calls_++ % kWatchRecords;
    watch_host_[i].step = step;
    watch_host_[i].call = watch_calls_;
    // Host time beside the GPU's: a call enqueued late (the thread held, e.g. in a call that waits for
    // the whole device) and a call enqueued at once whose kernels started late (the stream held) read
    // differently.
    watch_host_[i].host_ns =
        static_cast<unsigned long long>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                            std::chrono::system_clock::now().time_since_epoch())
                                            .count());
    const auto* local =
        reinterpret_cast<const std::uint32_t*>(static_cast<const char*>(window_->local()) + cflag_off_);
    comm_detail::launch_watch_flags(local, reduce_flag_.as<std::uint32_t* const>(), parity_stride_, g_.N,
                                    watch_dev_[i].words, &watch_dev_[i].time_ns, comm_->stream());
  }
  std::string describe_watch() const {
    if (watch_host_ == nullptr) return {};
    static constexpr const char* kSteps[] = {"?", "dispatch_recv", "combine_send", "combine_recv"};
    std::string out =
        "; watch (after call @ GPU global timer (host clock at its enqueue), ms mod 1e6: flags by source "
        "[p0|p1] / this rank's in each peer's [p0|p1]):";
    const std::uint32_t first = watch_calls_ > kWatchRecords ? watch_calls_ - kWatchRecords : 0;
    for (std::uint32_t c = first; c < watch_calls_; ++c) {
      const WatchRecord& r = watch_host_[c % kWatchRecords];
      const auto ms = [](unsigned long long ns) { return static_cast<double>(ns % 1000000000000ull) * 1e-6; };
      out += fmt::format(" #{} {} @{:.3f} (host {:.3f}):", r.call, kSteps[r.step <= 3 ? r.step : 0],
                         ms(r.time_ns), ms(r.host_ns));
      for (int d = 0; d < g_.N; ++d) {
        const std::uint32_t* w = r.words + 4 * d;
        out += fmt::format(" {}:{}|{}/{}|{}", d, w[0], w[1], w[2], w[3]);
      }
    }
    return out;
  }

  int diagnostic_ = -1;
  std::int64_t header_ints_ = 0, hdr_off_ = 0, slot_off_ = 0, cflag_off_ = 0, cslot_off_ = 0, chunk_off_ = 0,
               tag_off_ = 0, parity_stride_ = 0, n_chunks_ = 0;
  bool chunked_ = true;
  int arrival_chunk_ = comm_detail::kArrivalChunk;  // this call's tokens per arrival counter
  bool early_ = false;  // this call's EPMOE_COMM_LL_EARLY_COUNTS (false where the path does not apply)
  cuda::DeviceBuffer send_dest_, send_hdr_, reduce_dest_, reduce_flag_, send_chunks_, send_tagged_,
      sync_state_;
  cuda::DeviceBuffer offsets_dev_;
  std::int32_t* offsets_host_ = nullptr;
  std::int32_t* offsets_mapped_ = nullptr;
  std::uint32_t host_stamp_ = 0;
  comm_detail::SendArgs pending_send_;
  bool own_direct_ = false;
  int copy_engines_ = 0;  // this call's EPMOE_COMM_SEND_CE (0 where the path does not apply)
  // The device's send sequence as the host counts it (one per send; the copy-engine path needs the
  // parity on the host) and the copy-engine path's buffers, side stream and events.
  std::uint32_t send_seq_ = 0;
  std::vector<char*> send_dest_host_;
  std::vector<std::uint32_t*> send_chunks_host_;
  cuda::DeviceBuffer staging_, want_, ce_flags_;
  std::vector<cuda::Stream> ce_streams_;
  std::vector<cuda::Event> ce_done_;
  std::optional<cuda::Event> ce_routed_;
  std::vector<cuda::Event> piece_events_;
  float tensor_scale_ = 1.0f;
  bool sent_ = false, combine_sent_ = false;
};

const DispatcherRegistry::Registration kRegistration{
    "nvlink-ll", [](const DispatcherContext& c) -> std::unique_ptr<Dispatcher> {
      return make_nvlink_ll_dispatcher(c, c.communicator ? c.communicator : Communicator::process_default());
    }};
const DispatcherRegistry::Registration kRegistrationNormal{
    "nvlink", [](const DispatcherContext& c) -> std::unique_ptr<Dispatcher> {
      return make_nvlink_dispatcher(c, c.communicator ? c.communicator : Communicator::process_default());
    }};

}  // namespace

std::unique_ptr<LowLatencyDispatcher> make_nvlink_ll_dispatcher(const DispatcherContext& context,
                                                                std::shared_ptr<Communicator> comm) {
  return std::make_unique<NvlinkLlDispatcher>("nvlink-ll", context, std::move(comm), /*allow_normal=*/false);
}

std::unique_ptr<LowLatencyDispatcher> make_nvlink_dispatcher(const DispatcherContext& context,
                                                             std::shared_ptr<Communicator> comm) {
  return std::make_unique<NvlinkLlDispatcher>("nvlink", context, std::move(comm), /*allow_normal=*/true);
}

}  // namespace epmoe
