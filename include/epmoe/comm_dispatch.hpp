// GPU dispatchers over a Communicator (design.md §6). Each serves exactly one rank: the rank of
// its communicator; every call is collective over the communicator's ranks, and all work is
// enqueued on Communicator::stream() (outputs are valid in that stream's order).
//
//   "nccl-p2p"  the portable transport: ncclSend/ncclRecv inside ncclGroupStart/End, so it runs
//               wherever NCCL runs, across nodes too. The counts are computed on the device. Normal
//               mode (contiguous layout) with DispatcherContext::host_sync: they are all-gathered
//               first, the host learns them once per dispatch and sends exactly the packed bytes.
//               Low-latency mode (masked layout) and normal mode without the host sync: no host sync,
//               each peer gets this rank's count row and its whole region (max_tokens_per_rank rows)
//               in one group (one NCCL launch), CUDA-graph capturable; send and receive halves as
//               below.
//   "nvlink-ll" the low-latency transport over NVLink loads/stores (symmetric window, LSA
//               pointers): each token is written once per destination rank straight into the
//               peer's window, with a per-(source rank) arrival flag carrying a sequence number
//               kept on the device; masked layout; no host sync, no allocation, CUDA-graph
//               capturable; send and receive halves launch separately. Needs every rank in one LSA
//               team (one NVLink domain).
//   "nvlink"    the same transport, also in normal mode (contiguous layout; with the host sync one
//               bounded wait in dispatch_recv to learn the expert offsets, without it none: graph
//               capturable).
//
// Both produce exactly the CPU simulation's layout ("cpu-sim": rows, scales, weights, m_indices /
// masked_m and row_token, byte for byte) and combine the same way (per token, rows summed in f32
// in row order and rounded once to bf16 on the expert rank; partial sums added in rank order at
// home). Made through the DispatcherRegistry they use Communicator::process_default().
#pragma once

#include <memory>

#include "epmoe/comm.hpp"
#include "epmoe/dispatch.hpp"

namespace epmoe {

// The send and receive halves (every GPU dispatcher has them). dispatch() = dispatch_send() +
// dispatch_recv() and combine() = combine_send() + combine_recv(); the calls must alternate in that
// order. Without a host sync (low-latency mode; normal mode with host_sync = false):
//   dispatch_send: routes and sends this rank's tokens ("nvlink-ll": stores into the peers' windows
//                  and raises the flags; "nccl-p2p": packs, and enqueues the grouped send/recv of
//                  the count rows and the regions).
//   dispatch_recv: fans every source's tokens out to the layout once they are there (nvlink: a
//                  bounded device wait per source; nccl-p2p: in stream order after NCCL's transfers,
//                  bounded only by the host's waits, Communicator::synchronize). num_recv_tokens is -1
//                  (known only on the device); expected_m is an estimate (T * ranks * top-k / physical
//                  experts) that needs no sync.
//   combine_send:  per received token one bf16 partial sum to its home rank.
//   combine_recv:  adds the partial sums into y once they are there.
// A rank whose input is refused (too many tokens, bad ids) still sends its error status, so that
// its peers record the error (Communicator's device error record, reported by its next wait) instead
// of waiting for its tokens; with too many tokens it throws after sending. (nccl-p2p: a peer's next
// NCCL transfer with the refusing rank, its combine, can still wait until a host wait gives up.)
class LowLatencyDispatcher : public Dispatcher {
 public:
  virtual void dispatch_send(const DispatchInput& input) = 0;
  virtual void dispatch_recv(DispatchOutput& output) = 0;
  virtual void combine_send(const TensorView& expert_out) = 0;
  virtual void combine_recv(const TensorView& y) = 0;
  // Bytes of symmetric memory this dispatcher registered.
  virtual std::size_t window_bytes() const = 0;
};

std::unique_ptr<LowLatencyDispatcher> make_nccl_p2p_dispatcher(const DispatcherContext& context,
                                                               std::shared_ptr<Communicator> comm);
std::unique_ptr<LowLatencyDispatcher> make_nvlink_ll_dispatcher(const DispatcherContext& context,
                                                                std::shared_ptr<Communicator> comm);

// "nvlink": the same transport in either mode. Normal mode produces the contiguous layout; with
// DispatcherContext::host_sync its dispatch_recv learns the expert offsets with one bounded host sync
// (they size the output), so it is not graph capturable; without it the layout is at its bound and
// nothing syncs. Low-latency mode is exactly "nvlink-ll".
std::unique_ptr<LowLatencyDispatcher> make_nvlink_dispatcher(const DispatcherContext& context,
                                                             std::shared_ptr<Communicator> comm);

}  // namespace epmoe
