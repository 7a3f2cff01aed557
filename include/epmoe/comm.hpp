// Communication runtime (design.md §6): an NCCL communicator per process (one GPU each), the
// unique id that starts one, symmetric memory windows with peer (LSA) pointers, and bounded waits.
//
//   * A Communicator wraps a borrowed ncclComm_t (an inference engine brings its own) or one it
//     created from a ncclUniqueId (epmoe's tools: `epmoe launch -n N -- cmd` hands each rank
//     EPMOE_RANK, EPMOE_WORLD_SIZE, EPMOE_LOCAL_RANK and EPMOE_NCCL_ID_FILE; multi-node start-up
//     passes the id as a file on a shared file system or as 256 hex digits in EPMOE_NCCL_ID).
//   * At creation it refuses an NCCL library whose version differs from the headers epmoe was
//     compiled against, and it refuses NVLink multicast: NCCL_NVLS_ENABLE must be 0. When the
//     variable is unset, an owning Communicator sets it to 0 itself before ncclCommInitRank; a
//     borrowing one cannot change how the communicator was made and refuses to start unless it is
//     "0". epmoe never creates multicast objects (no multimem requirements in the device comm).
//   * Every wait is bounded by timeout_s(): host waits poll the stream and, past the deadline, abort
//     an owned communicator and throw; device waits (flags of the low-latency kernels) read the
//     global timer and record {phase, peer} in a host-mapped DeviceErrorRecord, which
//     check_device_errors() turns into an epmoe::Error. Never a silent hang, and never a silent wrong
//     result: from the recorded error until reset_device_errors(), the dispatch and combine kernels
//     on this rank write NaN (all bits set) into their outputs (received rows, scales, y) and raise
//     no combine flag, so a caller that reads a graph replay's output before the error surfaces
//     sees NaN, and the peers' combines time out naming this rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "epmoe/error.hpp"

struct ncclDevComm;  // nccl_device/core.h: only device code needs its contents

namespace epmoe {

// ---------------------------------------------------------------- NCCL library version
struct NcclVersion {
  int code = 0;  // NCCL_VERSION_CODE encoding
  int major = 0, minor = 0, patch = 0;
  std::string str() const;  // "2.28.9"
};
NcclVersion decode_nccl_version(int code);
// The version of the libnccl loaded into this process (ncclGetVersion) and the file it came from
// (dladdr on ncclGetVersion; "unknown" when the loader cannot say).
NcclVersion loaded_nccl_version();
std::string loaded_nccl_library_path();
// The message of a mismatch: which library was loaded, which headers epmoe was compiled against,
// and how to point the loader at a matching libnccl.
std::string nccl_version_mismatch_message(int loaded_code, int compiled_code, std::string_view library_path);
// Throws epmoe::Error (the message above) unless the loaded library is the compiled-against one.
void check_nccl_version();

// ---------------------------------------------------------------- unique ids
inline constexpr std::size_t kNcclIdHexChars = 2 * NCCL_UNIQUE_ID_BYTES;
ncclUniqueId new_nccl_id();  // ncclGetUniqueId: this process hosts the bootstrap root
std::string nccl_id_to_hex(const ncclUniqueId& id);
// Throws on anything but exactly kNcclIdHexChars hex digits (surrounding whitespace ignored).
ncclUniqueId nccl_id_from_hex(std::string_view hex);
// The id as one line of hex in a file (written to a temporary name, then renamed, so readers
// never see half an id).
void write_nccl_id_file(const std::string& path, const ncclUniqueId& id);
// Reads the id, waiting up to wait_s seconds for the file to appear (another node may write it).
ncclUniqueId read_nccl_id_file(const std::string& path, double wait_s = 0.0);

// ---------------------------------------------------------------- launch environment
// What `epmoe launch` (or a multi-node start-up script) hands each rank.
struct LaunchEnvironment {
  bool present = false;           // EPMOE_WORLD_SIZE is set
  int rank = 0;                   // EPMOE_RANK
  int world_size = 1;             // EPMOE_WORLD_SIZE
  int local_rank = 0;             // EPMOE_LOCAL_RANK (default: rank)
  int device = 0;                 // EPMOE_LOCAL_DEVICE (default: local_rank): the CUDA device the rank uses
  bool one_gpu_per_rank = false;  // EPMOE_ONE_GPU_PER_RANK=1: the launcher showed this rank only its GPU
  std::string id_file;            // EPMOE_NCCL_ID_FILE
  std::string id_hex;             // EPMOE_NCCL_ID (takes precedence over the file)

  // Reads the variables; throws on malformed values (non-numbers, rank outside [0, world_size)).
  static LaunchEnvironment from_env();
  // Empty when `visible` GPUs serve this rank (its own, or with every GPU visible one per rank),
  // else why not. The same answer on every rank of a launch, so all skip or none does.
  std::string missing_gpus(int visible) const;
  // The unique id from EPMOE_NCCL_ID or EPMOE_NCCL_ID_FILE; throws when neither is given.
  ncclUniqueId unique_id(double wait_s) const;
};

// NVLink multicast stays off (design.md §6). With may_set, an unset NCCL_NVLS_ENABLE is set to "0"
// (before the communicator exists); any value but "0" is refused with an epmoe::Error.
void require_nvls_disabled(bool may_set);

// ---------------------------------------------------------------- phases and device errors
enum class CommPhase : std::int32_t {
  none = 0,
  setup,           // window registration, barriers
  count_exchange,  // normal mode: counts all-gathered, the host learns them
  dispatch_send,
  dispatch_recv,
  combine_send,
  combine_recv,
};
std::string_view to_string(CommPhase phase);

// Written by device code (host-mapped pinned memory, so the host reads it without a sync).
struct DeviceErrorRecord {
  std::int32_t code;    // 0 none; kDeviceErrorTimeout, PeerInput, BadSlot or ScaleMismatch
  std::int32_t phase;   // CommPhase
  std::int32_t peer;    // the rank waited for (timeout), that reported bad input, or written to (bad slot)
  std::int32_t rank;    // the rank that recorded it
  std::int32_t detail;  // timeout: the sequence number waited for; peer input: the peer's status bits;
                        // bad slot: the slot index; scale mismatch: the peer's scale (f32 bits)
  std::int32_t seen;    // timeout: the flag's (or tagged word's) sequence number when the wait gave up;
                        // bad slot: the token (send) or received row (combine) it was for; scale
                        // mismatch: this rank's scale (f32 bits)
  std::uint64_t waited_ns;
};
// Where kernels report errors: the first reporter wins the claim word (device memory, atomicCAS;
// atomics on host memory are not portable over PCIe), then writes the record with plain stores and
// `code` last.
struct DeviceErrorSink {
  DeviceErrorRecord* record;  // host-mapped (device address)
  std::int32_t* claim;        // device memory, 0 while no error is recorded
};
inline constexpr std::int32_t kDeviceErrorTimeout = 1;
inline constexpr std::int32_t kDeviceErrorPeerInput = 2;
// A store into a peer's window whose slot (or destination rank) lies outside the window's layout: the
// store is skipped (it would overwrite another source's rows or the flags after them).
inline constexpr std::int32_t kDeviceErrorBadSlot = 3;
// Per-tensor FP8 (ActivationFormat::fp8_tensor): a peer quantized with another static scale than this
// rank (nccl-p2p without a host sync checks it on the device; every rank must use the same).
inline constexpr std::int32_t kDeviceErrorScaleMismatch = 4;
// The message of a recorded error, e.g. "rank 0: timed out after 30.0 s in phase dispatch-recv
// waiting for rank 1 (arrival flag of sequence 7)".
std::string describe_device_error(const DeviceErrorRecord& record);

// Status bits a rank reports about its own input (exchanged before any payload moves).
inline constexpr std::int32_t kInputIdOutOfRange = 1;
inline constexpr std::int32_t kInputDuplicateId = 2;
inline constexpr std::int32_t kInputTooManyTokens = 4;
std::string describe_input_status(std::int32_t status);

// Default bound of every wait: $EPMOE_COMM_TIMEOUT_S seconds, else 60.
double default_comm_timeout_s();
// Default of CommOptions::nonblocking: $EPMOE_COMM_NONBLOCKING (0 or 1), else false.
bool default_comm_nonblocking();

// ---------------------------------------------------------------- symmetric memory
class Communicator;

// Device memory registered with the communicator as a symmetric window (ncclMemAlloc +
// ncclCommWindowRegister with NCCL_WIN_COLL_SYMMETRIC). Its address is fixed for its life, so CUDA
// graphs that captured it stay valid. Creation and destruction are collective: every rank of the
// communicator allocates the same size in the same order.
class SymmetricBuffer {
 public:
  ~SymmetricBuffer();
  SymmetricBuffer(const SymmetricBuffer&) = delete;
  SymmetricBuffer& operator=(const SymmetricBuffer&) = delete;

  void* local() const { return local_; }
  std::size_t size() const { return size_; }
  ncclWindow_t window() const { return window_; }
  // Device array [size] of this buffer's address on every rank as seen from this GPU (the LSA
  // pointers of the window; nullptr for ranks outside this rank's LSA team).
  void* const* peer_pointers_device() const { return peers_device_; }
  void* peer_pointer(int rank) const;  // the same, on the host (for checks; do not dereference)

 private:
  friend class Communicator;
  SymmetricBuffer() = default;
  std::shared_ptr<Communicator> comm_;
  void* local_ = nullptr;
  std::size_t size_ = 0;
  ncclWindow_t window_ = nullptr;
  void** peers_device_ = nullptr;
  std::unique_ptr<void*[]> peers_host_;
  bool nccl_memory_ = true;  // local_ from ncclMemAlloc (else cudaMalloc: a loopback rank's)
  // Loopback ranks: every rank's allocation of this buffer, freed together when the last rank's
  // buffer goes (LoopbackGroup::share_allocations); local_ is then not freed on its own.
  std::shared_ptr<void> loopback_memory_;
};

// ---------------------------------------------------------------- loopback ranks
// N ranks as threads of one process on one GPU, without NCCL (Communicator::create_loopback): the
// symmetric windows are plain device allocations whose peer pointers are the other ranks' (one
// address space), barriers are host barriers between the threads (bounded). For testing the
// load/store transports on a machine with one GPU: the kernels of the ranks run side by side on
// it (each rank its own stream), so their waits on each other resolve as across NVLink; the
// numbers mean nothing for NVLink. The NCCL point-to-point transport is not available on it.
class LoopbackGroup {
 public:
  static std::shared_ptr<LoopbackGroup> make(int size, int device);
  int size() const { return size_; }
  int device() const { return device_; }
  // Every rank's `ptr` for exchange number `seq` (each rank's n-th call has seq n), once every rank
  // has posted its own; throws after timeout_s.
  std::vector<void*> exchange(int rank, std::uint64_t seq, void* ptr, double timeout_s);
  // Returns once every rank has arrived (generation barrier); throws after timeout_s.
  void barrier(int rank, double timeout_s);
  // Every rank's device allocation of exchange `seq` (a symmetric buffer's), owned together: every
  // rank gets the same handle, and the allocations are freed when the last rank drops it. So a rank
  // that fails and unwinds first does not free a window that its peers' kernels still address (on
  // one GPU such a store faults the shared context, and every later call of every rank fails).
  std::shared_ptr<void> share_allocations(std::uint64_t seq, const std::vector<void*>& ptrs);

 private:
  LoopbackGroup(int size, int device) : size_(size), device_(device) {}
  struct State;
  int size_, device_;
  std::shared_ptr<State> state_;
};

// ---------------------------------------------------------------- Communicator
struct CommOptions {
  double timeout_s = default_comm_timeout_s();
  cudaStream_t stream = nullptr;  // borrowed; nullptr: the communicator owns a non-blocking stream
  // create() only: make the NCCL communicator nonblocking (ncclConfig_t::blocking = 0). Then the
  // collective set-up calls after its creation (window registration, the device communicator) are
  // bounded too: a rank whose peer never makes such a call aborts the communicator after
  // host_wait_limit_s() and throws, where on a blocking communicator NCCL waits inside the call
  // without a bound (`epmoe launch --timeout` then stops the ranks). Off by default: NCCL starts a
  // thread for every group end on a nonblocking communicator (each eager collective, each nccl-p2p
  // exchange; graph replays do not pay it). EPMOE_COMM_NONBLOCKING=1 turns it on.
  bool nonblocking = default_comm_nonblocking();
};

class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  // Owns a new communicator: sets the device, checks the NCCL version and the NVLS setting,
  // ncclCommInitRankConfig (collective over `size` ranks; nonblocking with options.nonblocking).
  static std::shared_ptr<Communicator> create(const ncclUniqueId& id, int rank, int size, int device,
                                              const CommOptions& options = {});
  // create() from LaunchEnvironment::from_env(): device = its device; waits up to the timeout for
  // the id file.
  static std::shared_ptr<Communicator> from_environment(const CommOptions& options = {});
  // Wraps a communicator the caller made and keeps owning (never finalized or aborted here), blocking
  // or nonblocking (config.blocking = 0: borrow waits, bounded, for one still setting up, and every
  // call epmoe makes on it is completed before the next; nothing of the caller's may be in flight on
  // it meanwhile).
  static std::shared_ptr<Communicator> borrow(ncclComm_t comm, const CommOptions& options = {});
  // Rank `rank` of a loopback group (see LoopbackGroup; tests): no NCCL communicator, every rank on
  // the group's GPU. Call from the rank's own thread; every collective (alloc_symmetric,
  // barrier) must be entered by all ranks, as with NCCL. The ranks share one context, so: the
  // process must load modules eagerly (CUDA_MODULE_LOADING=EAGER, else this throws) and make the
  // context with the most hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS=32, else this throws: a
  // rank's kernel queued behind a waiting peer's stream on a shared queue waits with it), and no rank may
  // allocate, free, set or copy device memory while a peer's dispatch or combine waits for it (those
  // calls may wait for the whole device): meet at a barrier around them.
  static std::shared_ptr<Communicator> create_loopback(std::shared_ptr<LoopbackGroup> group, int rank,
                                                       const CommOptions& options = {});
  bool loopback() const { return loopback_ != nullptr; }
  // Ranks whose kernels share this rank's GPU (loopback: the group's size; else 1): the dispatchers
  // size the grids of kernels that wait for peers to leave the others room.
  int ranks_on_device() const { return loopback_ != nullptr ? loopback_->size() : 1; }

  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  bool owned() const { return owned_; }
  // The NCCL communicator. create() starts ncclCommInitRankConfig on a thread of its own and returns at
  // once, so that a caller's other set-up (weights, buffers) overlaps NCCL's; this and every collective
  // entry point wait for it, bounded by host_wait_limit_s() (then a nonblocking communicator is
  // aborted; a blocking one's thread, still inside NCCL, is abandoned).
  ncclComm_t nccl() const;
  // All communication is enqueued on this stream; outputs are valid in its order.
  cudaStream_t stream() const { return stream_; }
  void set_stream(cudaStream_t stream);
  // Bound of device-side waits; host waits allow host_wait_limit_s() = 1.5 * timeout_s() + 1 s, so
  // that a kernel's own timeout, which names the peer, is seen first.
  double timeout_s() const { return timeout_s_; }
  double host_wait_limit_s() const { return timeout_s_ * 1.5 + 1.0; }
  void set_timeout_s(double seconds);

  // Host waits, bounded by timeout_s(). On timeout (or an asynchronous NCCL error) an owned
  // communicator is aborted and epmoe::Error names this rank, the phase and what it waited for.
  void synchronize(CommPhase phase = CommPhase::none, std::string_view waiting_for = {});
  void wait_event(cudaEvent_t event, CommPhase phase, std::string_view waiting_for);
  // Every rank has reached this point (then synchronize()). Where every rank is in this rank's LSA
  // team, a kernel over a small symmetric window of the communicator's own (a flag to each peer,
  // bounded waits), which spares NCCL setting up its collective channels (~0.5 GB per rank on an
  // H200) at a first collective; otherwise, or with EPMOE_COMM_NCCL_BARRIER=1, an ncclAllReduce of
  // one int.
  void barrier();

  // Completes a call on nccl(): an error status throws (naming `call`, e.g. its text); otherwise the
  // communicator's asynchronous state is polled (ncclCommGetAsyncError) until the call has completed,
  // as NCCL requires of a nonblocking communicator (an engine's, lent with borrow(); config.blocking =
  // 0) before the call's outputs are used or the next call is made. (Its window registrations and
  // device communicators answer ncclSuccess while still in progress, its collectives and group ends
  // ncclInProgress; a blocking communicator answers the poll at once.) Bounded by host_wait_limit_s():
  // then, or on an asynchronous error, an error naming this rank and the call (an owned communicator is
  // aborted). Every call of epmoe's that can leave work in progress goes through it (collectives, group
  // ends, window registration, the device communicator; EPMOE_NCCL_COMM_CHECK inside the library).
  // `phase` names the phase in the error (the set-up calls', by default).
  void complete_nccl(ncclResult_t status, const char* call, const char* file = "", int line = 0,
                     CommPhase phase = CommPhase::setup);
  // The same for teardown (deregistration, destruction): never throws; false when the call failed or
  // did not complete in time, and then no collective call may follow on the communicator (NCCL refuses
  // them): it is marked broken and, when owned, aborted.
  bool complete_nccl_quietly(ncclResult_t status) noexcept;
  // Whether collective calls (a window's deregistration, the device communicator's destruction) may
  // still be made: an NCCL communicator that was neither aborted nor broken by an earlier error.
  bool can_make_collective_calls() const { return comm_ != nullptr && broken_reason_.empty(); }

  // Collective: out[i] = the sum over the ranks of in[i] (n int64 in device memory on this rank's
  // GPU), ordered on `stream`; ncclAllReduce, or for loopback ranks a host-side sum (synchronous).
  void all_reduce_sum_i64(const std::int64_t* in, std::int64_t* out, std::size_t n, cudaStream_t stream);

  // Throws when a kernel recorded an error (a peer that did not arrive in time, bad peer input).
  // Cheap (reads host-mapped memory, no sync); called by the dispatchers at each entry point.
  void check_device_errors() const;
  // Throws when the communicator was aborted after a timeout, or a device error is recorded.
  void check_usable(std::string_view what) const;
  DeviceErrorSink device_error_sink() const { return {errors_device_, error_claim_}; }  // for kernels
  // Clears a recorded error (tests; or recovery once every object that used the communicator
  // since the error is gone).
  void reset_device_errors();
  bool broken() const { return !broken_reason_.empty(); }
  // What a user of the communicator (a dispatcher) knows of its own state, appended to the message
  // of a device error (a timed-out wait): its sequence numbers and flags. The function runs on the
  // thread that raises the error, after the failed kernel has returned; it must not throw. Returns
  // an id for remove_diagnostic (the user's destructor).
  int add_diagnostic(std::function<std::string()> describe);
  void remove_diagnostic(int id);
  std::string diagnostics() const;  // "; " + each user's description (empty when none)

  // Collective: allocates and registers `bytes` (rounded up to the allocation granularity) of
  // symmetric memory, zero-filled, and waits until every rank has zero-filled its part.
  std::unique_ptr<SymmetricBuffer> alloc_symmetric(std::size_t bytes);
  // Device memory (cudaMemGetInfo deltas on this GPU) that the symmetric allocations so far took, by
  // step: the buffers themselves (ncclMemAlloc, rounded to the granularity), their window
  // registration, the device communicator (once), and the barrier after each (NCCL sets up its
  // collective channels on a communicator's first collective). Says how much of a dispatcher's
  // footprint is ours and how much NCCL's.
  struct SetupMemory {
    std::size_t buffers = 0, window_register = 0, dev_comm = 0, barrier = 0;
  };
  const SetupMemory& setup_memory() const { return setup_memory_; }

  // Rank of this process and size of its load/store-accessible (LSA) team: ranks whose memory
  // this GPU reaches by NVLink loads and stores. Known after the first alloc_symmetric().
  int lsa_rank() const { return lsa_rank_; }
  int lsa_size() const { return lsa_size_; }
  bool all_ranks_lsa() const { return lsa_size_ == size_; }
  // Whether every rank's memory is reachable by this GPU's NVLink loads and stores (the LSA team is
  // the whole communicator), as the "nvlink" dispatchers need; false across nodes, where "nccl-p2p"
  // serves. Collective the first time on NCCL ranks (it creates NCCL's device communicator, which the
  // first symmetric window would create anyway); loopback ranks: true.
  bool all_ranks_load_store_reachable();
  const ncclDevComm* dev_comm() const { return dev_comm_; }

  // The communicator that dispatchers made through the DispatcherRegistry ("nccl-p2p",
  // "nvlink-ll") use: their DispatcherContext names no communicator. A thread's own default
  // (set_thread_default: loopback ranks are threads) takes precedence over the process's.
  static void set_process_default(std::shared_ptr<Communicator> comm);
  static void set_thread_default(std::shared_ptr<Communicator> comm);
  static std::shared_ptr<Communicator> process_default();  // nullptr when none is set

 private:
  Communicator() = default;
  void init_stream(cudaStream_t stream);
  void init_error_record();
  void ensure_dev_comm();
  void wait_init() const;  // the background ncclCommInitRank, if one is running
  // The barrier window (once, where every rank is in the LSA team): zeroed before it is registered, so
  // no barrier is needed after it (a peer can address it only once this rank has registered it).
  // False where the team is not all LSA (then barrier() takes the all-reduce).
  bool ensure_barrier_window();
  [[noreturn]] void fail_wait(CommPhase phase, std::string_view waiting_for, const std::string& why);

  mutable ncclComm_t comm_ = nullptr;
  struct PendingInit;                             // the thread running ncclCommInitRank (communicator.cpp)
  mutable std::shared_ptr<PendingInit> pending_;  // null once joined (or for a borrowed communicator)
  mutable std::string init_error_;                // why the background init failed, if it did
  bool owned_ = false;
  int rank_ = 0, size_ = 1, device_ = 0;
  cudaStream_t stream_ = nullptr;
  bool owns_stream_ = false;
  double timeout_s_ = 60.0;
  DeviceErrorRecord* errors_host_ = nullptr;
  DeviceErrorRecord* errors_device_ = nullptr;
  std::int32_t* error_claim_ = nullptr;
  int* barrier_word_ = nullptr;
  // barrier() over the LSA team: the window (its own, not a SymmetricBuffer, which would keep this
  // communicator alive), its LSA pointers on the device, and the epoch of the last barrier.
  void* barrier_local_ = nullptr;
  ncclWindow_t barrier_window_ = nullptr;
  void** barrier_peers_ = nullptr;
  std::uint32_t barrier_epoch_ = 0;
  std::string broken_reason_;
  ncclDevComm* dev_comm_ = nullptr;  // ncclDevCommCreate'd (zero requirements: no barriers, no multimem)
  std::shared_ptr<LoopbackGroup> loopback_;  // set: a loopback rank (no NCCL)
  std::uint64_t loopback_seq_ = 0;           // exchanges so far (alloc_symmetric)
  int lsa_rank_ = -1, lsa_size_ = 0;
  cudaEvent_t wait_event_ = nullptr;
  SetupMemory setup_memory_;
  mutable std::mutex diagnostics_mutex_;
  std::map<int, std::function<std::string()>> diagnostics_;
  int next_diagnostic_ = 0;
};

}  // namespace epmoe
