// Communicator, unique ids, the NCCL version check and bounded waits (epmoe/comm.hpp).
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include <cudaTypedefs.h>

#include "comm/comm_internal.hpp"
#include "comm/ep_kernels.hpp"
#include "cuda/driver_entry.hpp"
#include "cuda/kernel_setup.hpp"
#include "epmoe/cuda/runtime.hpp"

namespace epmoe {

namespace comm_detail {
void throw_nccl_error(ncclResult_t status, const char* expr, const char* file, int line) {
  const char* last = ncclGetLastError(nullptr);
  detail::throw_error(
      file, line,
      fmt::format("NCCL error {} ({}){}{} in {}", static_cast<int>(status), ncclGetErrorString(status),
                  last != nullptr && *last != '\0' ? ": " : "", last != nullptr ? last : "", expr));
}
}  // namespace comm_detail

namespace {
// Polls a communicator's asynchronous state until it leaves ncclInProgress (a nonblocking
// communicator's call completing in the background) or limit_s passes; returns the state then, or
// ncclInProgress on timeout (the first poll is immediate: a blocking communicator answers at once).
ncclResult_t poll_async(ncclComm_t comm, double limit_s) noexcept {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(limit_s);
  for (int spins = 0;; ++spins) {
    ncclResult_t async = ncclInProgress;
    const ncclResult_t query = ncclCommGetAsyncError(comm, &async);
    if (query != ncclSuccess) return query;
    if (async != ncclInProgress) return async;
    if (std::chrono::steady_clock::now() > deadline) return ncclInProgress;
    if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}
}  // namespace

// ---------------------------------------------------------------- version
std::string NcclVersion::str() const {
  return fmt::format("{}.{}.{}", major, minor, patch);
}

NcclVersion decode_nccl_version(int code) {
  NcclVersion v;
  v.code = code;
  if (code >= 10000) {  // NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z from 2.9 on
    v.major = code / 10000;
    v.minor = (code % 10000) / 100;
    v.patch = code % 100;
  } else {  // X*1000 + Y*100 + Z before
    v.major = code / 1000;
    v.minor = (code % 1000) / 100;
    v.patch = code % 100;
  }
  return v;
}

NcclVersion loaded_nccl_version() {
  int code = 0;
  EPMOE_NCCL_CHECK(ncclGetVersion(&code));
  return decode_nccl_version(code);
}

std::string loaded_nccl_library_path() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<void*>(&ncclGetVersion), &info) != 0 && info.dli_fname != nullptr)
    return info.dli_fname;
  return "unknown";
}

std::string nccl_version_mismatch_message(int loaded_code, int compiled_code, std::string_view library_path) {
  const NcclVersion loaded = decode_nccl_version(loaded_code), compiled = decode_nccl_version(compiled_code);
  return fmt::format(
      "NCCL version mismatch: the library loaded into this process, {}, is NCCL {} (version code {}), but "
      "epmoe was compiled against the headers of NCCL {} (nccl.h, NCCL_VERSION_CODE {}). epmoe uses the NCCL "
      "device API (symmetric windows, LSA pointers), whose structures must match the library. Load a "
      "matching "
      "libnccl, e.g. LD_LIBRARY_PATH=/path/to/nccl-{}/lib:$LD_LIBRARY_PATH, or rebuild epmoe against the "
      "headers of the library you load.",
      library_path, loaded.str(), loaded_code, compiled.str(), compiled_code, compiled.str());
}

void check_nccl_version() {
  int code = 0;
  EPMOE_NCCL_CHECK(ncclGetVersion(&code));
  EPMOE_CHECK(code == NCCL_VERSION_CODE, "{}",
              nccl_version_mismatch_message(code, NCCL_VERSION_CODE, loaded_nccl_library_path()));
}

// ---------------------------------------------------------------- ids
ncclUniqueId new_nccl_id() {
  ncclUniqueId id;
  EPMOE_NCCL_CHECK(ncclGetUniqueId(&id));
  return id;
}

std::string nccl_id_to_hex(const ncclUniqueId& id) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex(kNcclIdHexChars, '0');
  for (std::size_t i = 0; i < NCCL_UNIQUE_ID_BYTES; ++i) {
    const auto b = static_cast<unsigned char>(id.internal[i]);
    hex[2 * i] = kDigits[b >> 4];
    hex[2 * i + 1] = kDigits[b & 15];
  }
  return hex;
}

ncclUniqueId nccl_id_from_hex(std::string_view hex) {
  while (!hex.empty() && std::isspace(static_cast<unsigned char>(hex.front()))) hex.remove_prefix(1);
  while (!hex.empty() && std::isspace(static_cast<unsigned char>(hex.back()))) hex.remove_suffix(1);
  EPMOE_CHECK(hex.size() == kNcclIdHexChars,
              "an NCCL unique id is {} hex digits ({} bytes), got {} characters", kNcclIdHexChars,
              NCCL_UNIQUE_ID_BYTES, hex.size());
  auto nibble = [&](std::size_t i) {
    const char c = hex[i];
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    EPMOE_FAIL("an NCCL unique id is hex digits only; character {} is '{}'", i, c);
  };
  ncclUniqueId id;
  for (std::size_t i = 0; i < NCCL_UNIQUE_ID_BYTES; ++i)
    id.internal[i] = static_cast<char>((nibble(2 * i) << 4) | nibble(2 * i + 1));
  return id;
}

void write_nccl_id_file(const std::string& path, const ncclUniqueId& id) {
  const std::string tmp = fmt::format("{}.tmp.{}", path, static_cast<long>(getpid()));
  {
    std::ofstream out(tmp, std::ios::trunc);
    EPMOE_CHECK(out.is_open(), "cannot write the NCCL id file '{}': {}", tmp, std::strerror(errno));
    out << nccl_id_to_hex(id) << "\n";
    out.close();
    EPMOE_CHECK(!out.fail(), "writing the NCCL id file '{}' failed", tmp);
  }
  EPMOE_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "cannot rename '{}' to '{}': {}", tmp, path,
              std::strerror(errno));
}

ncclUniqueId read_nccl_id_file(const std::string& path, double wait_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
  while (true) {
    std::ifstream in(path);
    bool empty = false;
    if (in.is_open()) {
      std::stringstream text;
      text << in.rdbuf();
      const std::string hex = text.str();
      // An empty file is one not written yet: `epmoe launch` creates it before it starts the ranks
      // and renames the id over it after (the id's creation overlaps the ranks' start-up).
      empty = hex.find_first_not_of(" \t\r\n") == std::string::npos;
      if (!empty) {
        try {
          return nccl_id_from_hex(hex);
        } catch (const Error& e) {
          EPMOE_FAIL("the NCCL id file '{}' does not hold an id: {}", path, e.what());
        }
      }
    }
    EPMOE_CHECK(std::chrono::steady_clock::now() < deadline,
                "the NCCL id file '{}' {}{} (rank 0's launcher writes it; on several nodes it must lie on a "
                "shared file "
                "system, or pass the id as EPMOE_NCCL_ID)",
                path, empty ? "is still empty" : "does not exist",
                wait_s > 0 ? fmt::format(" after waiting {:.1f} s", wait_s) : "");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// ---------------------------------------------------------------- environment
namespace {
int env_int(const char* name, int fallback, bool* found = nullptr) {
  const char* v = std::getenv(name);
  if (found != nullptr) *found = v != nullptr;
  if (v == nullptr) return fallback;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  EPMOE_CHECK(end != v && *end == '\0' && errno == 0 && x >= 0 && x <= 1 << 20,
              "{}='{}' must be a non-negative integer", name, v);
  return static_cast<int>(x);
}
std::string env_str(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}
}  // namespace

LaunchEnvironment LaunchEnvironment::from_env() {
  LaunchEnvironment e;
  e.world_size = env_int("EPMOE_WORLD_SIZE", 1, &e.present);
  e.rank = env_int("EPMOE_RANK", 0);
  bool has_local = false;
  e.local_rank = env_int("EPMOE_LOCAL_RANK", e.rank, &has_local);
  e.device = env_int("EPMOE_LOCAL_DEVICE", e.local_rank);
  e.one_gpu_per_rank = env_int("EPMOE_ONE_GPU_PER_RANK", 0) == 1;
  e.id_file = env_str("EPMOE_NCCL_ID_FILE");
  e.id_hex = env_str("EPMOE_NCCL_ID");
  EPMOE_CHECK(e.world_size >= 1, "EPMOE_WORLD_SIZE must be at least 1, got {}", e.world_size);
  EPMOE_CHECK(e.rank < e.world_size, "EPMOE_RANK={} must be below EPMOE_WORLD_SIZE={}", e.rank, e.world_size);
  EPMOE_CHECK(e.device >= 0, "EPMOE_LOCAL_DEVICE must be a device index (>= 0), got {}", e.device);
  return e;
}

std::string LaunchEnvironment::missing_gpus(int visible) const {
  const int needed = present && !one_gpu_per_rank ? world_size : 1;
  if (visible >= needed && device < visible) return {};
  return one_gpu_per_rank ? fmt::format("rank {} was given a GPU, but none is visible", rank)
                          : fmt::format("{} rank(s) need as many GPUs, {} visible", world_size, visible);
}

ncclUniqueId LaunchEnvironment::unique_id(double wait_s) const {
  if (!id_hex.empty()) return nccl_id_from_hex(id_hex);
  EPMOE_CHECK(
      !id_file.empty(),
      "no NCCL unique id: set EPMOE_NCCL_ID (256 hex digits) or EPMOE_NCCL_ID_FILE (a file holding them); "
      "`epmoe launch -n N -- cmd` sets EPMOE_NCCL_ID_FILE");
  return read_nccl_id_file(id_file, wait_s);
}

void require_nvls_disabled(bool may_set) {
  const char* v = std::getenv("NCCL_NVLS_ENABLE");
  if (v == nullptr) {
    EPMOE_CHECK(
        may_set,
        "NCCL_NVLS_ENABLE is not set: epmoe never uses NVLink multicast (NVLS) and needs NCCL_NVLS_ENABLE=0 "
        "in "
        "the environment of a process whose NCCL communicator it borrows (set it before the communicator "
        "is created)");
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    return;
  }
  EPMOE_CHECK(
      std::string_view(v) == "0",
      "NCCL_NVLS_ENABLE={}: epmoe refuses to run with NVLink multicast (NVLS) enabled; it can put shared "
      "hosts' GPUs out of service. Set NCCL_NVLS_ENABLE=0 (epmoe launch does)",
      v);
}

// ---------------------------------------------------------------- phases, errors
std::string_view to_string(CommPhase phase) {
  switch (phase) {
    case CommPhase::none:
      return "none";
    case CommPhase::setup:
      return "setup";
    case CommPhase::count_exchange:
      return "count-exchange";
    case CommPhase::dispatch_send:
      return "dispatch-send";
    case CommPhase::dispatch_recv:
      return "dispatch-recv";
    case CommPhase::combine_send:
      return "combine-send";
    case CommPhase::combine_recv:
      return "combine-recv";
  }
  return "unknown";
}

std::string describe_input_status(std::int32_t status) {
  std::string s;
  auto add = [&](const char* what) { s += (s.empty() ? "" : ", ") + std::string(what); };
  if (status & kInputIdOutOfRange) add("a physical expert id out of range");
  if (status & kInputDuplicateId) add("a token with the same physical expert twice in its top-k");
  if (status & kInputTooManyTokens) add("more tokens than the buffers hold (max_tokens_per_rank)");
  if (s.empty()) s = fmt::format("status {:#x}", status);
  return s;
}

void* comm_detail::alloc_host_mapped(std::size_t bytes, void** device) {
  void* host = nullptr;
  EPMOE_CUDA_CHECK(cudaHostAlloc(&host, bytes, cudaHostAllocMapped));
  std::memset(host, 0, bytes);
  EPMOE_CUDA_CHECK(cudaHostGetDevicePointer(device, host, 0));
  return host;
}

std::string describe_device_error(const DeviceErrorRecord& r) {
  const auto phase = to_string(static_cast<CommPhase>(r.phase));
  if (r.code == kDeviceErrorTimeout)
    return fmt::format(
        "rank {}: timed out after {:.1f} s in phase {} waiting for rank {} (arrival flag of sequence {}; it "
        "read {})",
        r.rank, static_cast<double>(r.waited_ns) * 1e-9, phase, r.peer, r.detail, r.seen);
  if (r.code == kDeviceErrorPeerInput)
    return fmt::format("rank {}: in phase {}, rank {} refused its input ({}); nothing of it was used", r.rank,
                       phase, r.peer, describe_input_status(r.detail));
  if (r.code == kDeviceErrorBadSlot)
    return fmt::format(
        "rank {}: in phase {}, a store for rank {} at slot {} (for token / row {}) lies outside the window's "
        "layout; it was skipped",
        r.rank, phase, r.peer, r.detail, r.seen);
  if (r.code == kDeviceErrorScaleMismatch) {
    float theirs = 0, mine = 0;
    std::memcpy(&theirs, &r.detail, sizeof(theirs));
    std::memcpy(&mine, &r.seen, sizeof(mine));
    return fmt::format(
        "rank {}: in phase {}, rank {} quantized with the static scale {} and this rank with {}: every rank "
        "must use the same per-tensor scale",
        r.rank, phase, r.peer, theirs, mine);
  }
  return fmt::format("rank {}: device error code {} in phase {} (peer {})", r.rank, r.code, phase, r.peer);
}

bool default_comm_nonblocking() {
  const char* v = std::getenv("EPMOE_COMM_NONBLOCKING");
  if (v == nullptr || *v == '\0') return false;
  const std::string_view value(v);
  EPMOE_CHECK(value == "0" || value == "1", "EPMOE_COMM_NONBLOCKING='{}' must be 0 or 1", value);
  return value == "1";
}

double default_comm_timeout_s() {
  const char* v = std::getenv("EPMOE_COMM_TIMEOUT_S");
  if (v == nullptr) return 60.0;
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  EPMOE_CHECK(end != v && *end == '\0' && x > 0,
              "EPMOE_COMM_TIMEOUT_S='{}' must be a positive number of seconds", v);
  return x;
}

// ---------------------------------------------------------------- SymmetricBuffer
SymmetricBuffer::~SymmetricBuffer() {
  // Collective (deregistration); skipped once the communicator was aborted.
  if (window_ != nullptr && comm_ && comm_->can_make_collective_calls())
    (void)comm_->complete_nccl_quietly(ncclCommWindowDeregister(comm_->nccl(), window_));
  if (local_ != nullptr && nccl_memory_) (void)ncclMemFree(local_);
  if (local_ != nullptr && !nccl_memory_ && !loopback_memory_) (void)cudaFree(local_);
  if (peers_device_ != nullptr) (void)cudaFree(peers_device_);
}

void* SymmetricBuffer::peer_pointer(int rank) const {
  EPMOE_CHECK(comm_ && rank >= 0 && rank < comm_->size(), "peer_pointer: rank {} is outside [0, {})", rank,
              comm_ ? comm_->size() : 0);
  return peers_host_[static_cast<std::size_t>(rank)];
}

// ---------------------------------------------------------------- Communicator
namespace {
std::mutex g_default_mutex;
std::shared_ptr<Communicator> g_default;
}  // namespace

void Communicator::set_process_default(std::shared_ptr<Communicator> comm) {
  std::lock_guard lock(g_default_mutex);
  g_default = std::move(comm);
}
namespace {
thread_local std::shared_ptr<Communicator> t_default;
}
void Communicator::set_thread_default(std::shared_ptr<Communicator> comm) {
  t_default = std::move(comm);
}
std::shared_ptr<Communicator> Communicator::process_default() {
  if (t_default) return t_default;
  std::lock_guard lock(g_default_mutex);
  return g_default;
}

// ---------------------------------------------------------------- loopback ranks
struct LoopbackGroup::State {
  std::mutex mutex;
  std::condition_variable changed;
  int arrived = 0;
  std::uint64_t generation = 0;
  std::map<std::uint64_t, std::vector<void*>> posted;  // exchange seq -> every rank's pointer
  std::map<std::uint64_t, int> posted_count;
  // Exchange seq -> the owner of its allocations and how many ranks have taken it: held here until
  // every rank has (a rank that unwinds at once cannot free them before a slower one took its share).
  std::map<std::uint64_t, std::pair<std::shared_ptr<void>, int>> shared;
};

std::shared_ptr<LoopbackGroup> LoopbackGroup::make(int size, int device) {
  EPMOE_CHECK(size >= 1, "LoopbackGroup: size must be at least 1, got {}", size);
  EPMOE_CHECK(device >= 0, "LoopbackGroup: device must be >= 0, got {}", device);
  std::shared_ptr<LoopbackGroup> g(new LoopbackGroup(size, device));
  g->state_ = std::make_shared<State>();
  return g;
}

std::vector<void*> LoopbackGroup::exchange(int rank, std::uint64_t seq, void* ptr, double timeout_s) {
  EPMOE_CHECK(rank >= 0 && rank < size_, "LoopbackGroup::exchange: rank {} outside [0, {})", rank, size_);
  std::unique_lock lock(state_->mutex);
  auto& slot = state_->posted[seq];
  if (slot.empty()) slot.assign(static_cast<std::size_t>(size_), nullptr);
  slot[static_cast<std::size_t>(rank)] = ptr;
  const int n = ++state_->posted_count[seq];
  if (n == size_) state_->changed.notify_all();
  const bool ok = state_->changed.wait_for(lock, std::chrono::duration<double>(timeout_s),
                                           [&] { return state_->posted_count[seq] >= size_; });
  if (!ok) {  // the exchange is abandoned: drop what was posted to it
    state_->posted.erase(seq);
    state_->posted_count.erase(seq);
  }
  EPMOE_CHECK(ok, "loopback rank {}: timed out after {:.1f} s in exchange {} waiting for the other ranks",
              rank, timeout_s, seq);
  std::vector<void*> all = state_->posted[seq];
  if (++state_->posted_count[seq] == 2 * size_) {  // every rank has read it
    state_->posted.erase(seq);
    state_->posted_count.erase(seq);
  }
  return all;
}

void LoopbackGroup::barrier(int rank, double timeout_s) {
  EPMOE_CHECK(rank >= 0 && rank < size_, "LoopbackGroup::barrier: rank {} outside [0, {})", rank, size_);
  std::unique_lock lock(state_->mutex);
  const std::uint64_t gen = state_->generation;
  if (++state_->arrived == size_) {
    state_->arrived = 0;
    ++state_->generation;
    state_->changed.notify_all();
    return;
  }
  const bool ok = state_->changed.wait_for(lock, std::chrono::duration<double>(timeout_s),
                                           [&] { return state_->generation != gen; });
  // A rank that gives up takes its arrival back, so that the next barrier counts afresh (else a
  // later arrival of one rank alone would complete it).
  if (!ok) --state_->arrived;
  EPMOE_CHECK(ok, "loopback rank {}: timed out after {:.1f} s at a barrier waiting for the other ranks", rank,
              timeout_s);
}

std::shared_ptr<void> LoopbackGroup::share_allocations(std::uint64_t seq, const std::vector<void*>& ptrs) {
  // One allocation per rank (every rank passes the same list; the first one's is kept).
  EPMOE_CHECK(ptrs.size() == static_cast<std::size_t>(size_),
              "LoopbackGroup::share_allocations: {} allocations for a group of {} ranks", ptrs.size(), size_);
  const std::lock_guard lock(state_->mutex);
  auto& [owner, takers] = state_->shared[seq];
  if (!owner) {
    const int device = device_;
    owner = std::shared_ptr<void>(new std::vector<void*>(ptrs), [device](void* p) {
      auto* allocations = static_cast<std::vector<void*>*>(p);
      (void)cudaSetDevice(device);
      for (void* a : *allocations)
        if (a != nullptr) (void)cudaFree(a);
      delete allocations;
    });
  }
  std::shared_ptr<void> taken = owner;
  if (++takers >= size_) state_->shared.erase(seq);  // every rank holds it now
  return taken;
}

std::shared_ptr<Communicator> Communicator::create_loopback(std::shared_ptr<LoopbackGroup> group, int rank,
                                                            const CommOptions& options) {
  EPMOE_CHECK(group != nullptr, "Communicator::create_loopback: the group is null");
  EPMOE_CHECK(rank >= 0 && rank < group->size(), "Communicator: rank {} must lie in [0, size={})", rank,
              group->size());
  EPMOE_CHECK(options.timeout_s > 0, "Communicator: timeout_s must be positive, got {}", options.timeout_s);
  const int devices = cuda::device_count();
  EPMOE_CHECK(group->device() < devices,
              "Communicator: the loopback group's GPU {} asked for, {} visible ({})", group->device(),
              devices, cuda::device_description());
  std::shared_ptr<Communicator> c(new Communicator());
  c->rank_ = rank;
  c->size_ = group->size();
  c->device_ = group->device();
  c->owned_ = false;
  c->timeout_s_ = options.timeout_s;
  c->lsa_rank_ = rank;
  c->lsa_size_ = group->size();
  c->loopback_ = std::move(group);
  EPMOE_CUDA_CHECK(cudaSetDevice(c->device_));
  // The ranks share one context, and loading a kernel lazily (at its first launch) synchronizes the
  // context: a rank's first launch of a kernel would wait for a peer's kernel that waits for this
  // rank, until the timeout. Refuse that mode rather than hang in it.
  static const auto loading_mode =
      cuda::driver_entry_point<PFN_cuModuleGetLoadingMode_v11070>("cuModuleGetLoadingMode", 11070);
  CUmoduleLoadingMode mode{};
  EPMOE_CHECK(loading_mode(&mode) == CUDA_SUCCESS, "Communicator: cuModuleGetLoadingMode failed");
  EPMOE_CHECK(mode == CU_MODULE_EAGER_LOADING,
              "Communicator: loopback ranks need CUDA_MODULE_LOADING=EAGER in the environment before the "
              "first CUDA call (they share one context, and a lazily loaded kernel waits for the peers' "
              "kernels, which may be waiting for it)");
  // The ranks' streams also share the context's hardware work queues (CUDA_DEVICE_MAX_CONNECTIONS,
  // read when the context is made; 8 by default). Streams beyond that count are aliased onto the same
  // queues, and a queue starts its work in order: a rank's kernel queued behind a peer's stream whose
  // next work waits for a kernel that waits for this rank (a combine waiting for this rank's flag)
  // cannot start until that wait times out. The most queues (32) make such aliasing rare; fewer are
  // refused, as lazy loading is. (The loopback timeouts of sessions 20-22 turned out to be a rank
  // blocked in cudaFree while a peer's kernel waited for it, bench/NOTES.md session 22; the tests
  // meet around their allocations and frees. The aliasing remains a hazard of its own.)
  const char* connections = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  EPMOE_CHECK(connections != nullptr && std::atoi(connections) >= 32,
              "Communicator: loopback ranks need CUDA_DEVICE_MAX_CONNECTIONS=32 in the environment before "
              "the first CUDA call (they share one context's hardware queues, and a rank's kernel queued "
              "behind a waiting peer's stream waits with it), got '{}'",
              connections != nullptr ? connections : "(unset)");
  c->init_stream(options.stream);
  c->init_error_record();
  // Every kernel's one-time host set-up now, before any rank's first call (cuda/kernel_setup.hpp):
  // a first attribute setting in the middle of a rank's call may wait for a peer's copy queued behind
  // the peer's kernel, which waits for this rank.
  cuda::prepare_kernels();
  return c;
}

void Communicator::init_stream(cudaStream_t stream) {
  if (stream != nullptr) {
    stream_ = stream;
  } else {
    EPMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    owns_stream_ = true;
  }
  EPMOE_CUDA_CHECK(cudaEventCreateWithFlags(&wait_event_, cudaEventDisableTiming));
}

void Communicator::init_error_record() {
  void* d = nullptr;
  errors_host_ =
      static_cast<DeviceErrorRecord*>(comm_detail::alloc_host_mapped(sizeof(DeviceErrorRecord), &d));
  errors_device_ = static_cast<DeviceErrorRecord*>(d);
  EPMOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&barrier_word_), 16));
  EPMOE_CUDA_CHECK(cudaMemset(barrier_word_, 0, 16));
  EPMOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&error_claim_), 16));
  EPMOE_CUDA_CHECK(cudaMemset(error_claim_, 0, 16));
}

struct Communicator::PendingInit {
  std::thread thread;
  std::promise<void> result;
  std::future<void> done;
  ncclComm_t comm = nullptr;
};

std::shared_ptr<Communicator> Communicator::create(const ncclUniqueId& id, int rank, int size, int device,
                                                   const CommOptions& options) {
  check_nccl_version();
  require_nvls_disabled(/*may_set=*/true);
  EPMOE_CHECK(size >= 1 && rank >= 0 && rank < size, "Communicator: rank {} must lie in [0, size={})", rank,
              size);
  const int devices = cuda::device_count();
  EPMOE_CHECK(device >= 0 && device < devices,
              "Communicator: rank {} wants GPU {}, but {} GPU(s) are visible ({})", rank, device, devices,
              cuda::device_description());
  EPMOE_CHECK(options.timeout_s > 0, "Communicator: timeout_s must be positive, got {}", options.timeout_s);
  std::shared_ptr<Communicator> c(new Communicator());
  c->rank_ = rank;
  c->size_ = size;
  c->device_ = device;
  c->owned_ = true;
  c->timeout_s_ = options.timeout_s;
  EPMOE_CUDA_CHECK(cudaSetDevice(device));
  c->init_stream(options.stream);
  c->init_error_record();
  // NCCL's set-up (~0.4-0.6 s for 2 ranks on an H200 host) runs on its own thread; its state is
  // shared with that thread so that a thread abandoned after a timeout never writes into a
  // destroyed Communicator.
  // A nonblocking communicator's ncclCommInitRankConfig answers ncclInProgress at once (NCCL sets it up
  // on a thread of its own); wait_init polls it, bounded, and aborts it on timeout. A blocking one
  // (unless NCCL_COMM_BLOCKING=0 in the environment) answers when every rank has joined: on timeout
  // wait_init abandons this thread.
  auto pending = std::make_shared<PendingInit>();
  pending->done = pending->result.get_future();
  const bool nonblocking = options.nonblocking;
  pending->thread = std::thread([state = pending, size, id, rank, device, nonblocking]() mutable {
    try {
      EPMOE_CUDA_CHECK(cudaSetDevice(device));
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      if (nonblocking) config.blocking = 0;  // (else NCCL's default: NCCL_COMM_BLOCKING, else blocking)
      const ncclResult_t status = ncclCommInitRankConfig(&state->comm, size, id, rank, &config);
      if (status != ncclSuccess && status != ncclInProgress) {
        if (state->comm != nullptr) (void)ncclCommAbort(state->comm);  // (a half-made one)
        state->comm = nullptr;
        comm_detail::throw_nccl_error(status, "ncclCommInitRankConfig", __FILE__, __LINE__);
      }
      state->result.set_value();
    } catch (...) {
      state->result.set_exception(std::current_exception());
    }
  });
  c->pending_ = std::move(pending);
  return c;
}

void Communicator::wait_init() const {
  if (!pending_) {
    EPMOE_CHECK(init_error_.empty(), "rank {}: {}", rank_, init_error_);
    return;
  }
  const double limit_s = host_wait_limit_s();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(limit_s);
  const std::string late = fmt::format(
      "the NCCL communicator (rank {} of {}) was not set up within {:.1f} s: did every rank start, with "
      "the same NCCL id?",
      rank_, size_, limit_s);
  if (pending_->done.wait_until(deadline) != std::future_status::ready) {
    // A peer that never starts keeps a blocking ncclCommInitRankConfig waiting: abandon the thread (it
    // owns its state).
    pending_->thread.detach();
    pending_.reset();
    init_error_ = late;
    EPMOE_FAIL("{}", init_error_);
  }
  pending_->thread.join();
  std::shared_ptr<PendingInit> pending = std::move(pending_);
  try {
    pending->done.get();
  } catch (const std::exception& e) {
    init_error_ = fmt::format("setting up the NCCL communicator failed: {}", e.what());
    EPMOE_FAIL("rank {}: {}", rank_, init_error_);
  }
  // A nonblocking communicator is still setting up (a blocking one answers the first poll).
  const double left_s =
      std::max(0.0, std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count());
  const ncclResult_t state = poll_async(pending->comm, left_s);
  if (state != ncclSuccess) {
    init_error_ = state == ncclInProgress
                      ? late
                      : fmt::format("setting up the NCCL communicator failed: NCCL error {} ({})",
                                    static_cast<int>(state), ncclGetErrorString(state));
    (void)ncclCommAbort(pending->comm);  // (a nonblocking communicator may be aborted at any time)
    EPMOE_FAIL("rank {}: {}", rank_, init_error_);
  }
  comm_ = pending->comm;
}

ncclComm_t Communicator::nccl() const {
  EPMOE_CHECK(loopback_ == nullptr,
              "rank {}: this communicator is a loopback of {} ranks on one GPU (tests): it has no NCCL "
              "communicator, so NCCL collectives and the NCCL point-to-point transport are not available",
              rank_, size_);
  wait_init();
  return comm_;
}

std::shared_ptr<Communicator> Communicator::from_environment(const CommOptions& options) {
  const LaunchEnvironment env = LaunchEnvironment::from_env();
  EPMOE_CHECK(env.present,
              "EPMOE_WORLD_SIZE is not set: start the ranks with `epmoe launch -n N -- <command>` (or set "
              "EPMOE_RANK, EPMOE_WORLD_SIZE, EPMOE_LOCAL_RANK and EPMOE_NCCL_ID_FILE / EPMOE_NCCL_ID)");
  return create(env.unique_id(options.timeout_s), env.rank, env.world_size, env.device, options);
}

std::shared_ptr<Communicator> Communicator::borrow(ncclComm_t comm, const CommOptions& options) {
  EPMOE_CHECK(comm != nullptr, "Communicator::borrow: the communicator is null");
  check_nccl_version();
  require_nvls_disabled(/*may_set=*/false);
  EPMOE_CHECK(options.timeout_s > 0, "Communicator: timeout_s must be positive, got {}", options.timeout_s);
  std::shared_ptr<Communicator> c(new Communicator());
  c->comm_ = comm;
  c->owned_ = false;
  c->timeout_s_ = options.timeout_s;
  // A nonblocking communicator (ncclCommInitRankConfig with config.blocking = 0) may still be setting
  // up, and its queries answer only once it is done: wait for that (bounded).
  const ncclResult_t ready = poll_async(comm, c->host_wait_limit_s());
  EPMOE_CHECK(ready != ncclInProgress,
              "Communicator::borrow: the lent NCCL communicator did not finish its set-up within {:.1f} s",
              c->host_wait_limit_s());
  if (ready != ncclSuccess)
    comm_detail::throw_nccl_error(ready, "the lent communicator's set-up", __FILE__, __LINE__);
  EPMOE_NCCL_CHECK(ncclCommUserRank(comm, &c->rank_));
  EPMOE_NCCL_CHECK(ncclCommCount(comm, &c->size_));
  EPMOE_NCCL_CHECK(ncclCommCuDevice(comm, &c->device_));
  EPMOE_CUDA_CHECK(cudaSetDevice(c->device_));
  c->init_stream(options.stream);
  c->init_error_record();
  return c;
}

Communicator::~Communicator() {
  if (pending_) {  // never used: finish the set-up so that the communicator can be destroyed cleanly
    try {
      wait_init();
    } catch (const std::exception&) {  // nothing to destroy (the reason was already reported, or is moot)
    }
  }
  // The barrier window before the device communicator and NCCL's (deregistration is collective:
  // every rank destroys its communicator; skipped once aborted).
  if (barrier_window_ != nullptr && can_make_collective_calls())
    (void)complete_nccl_quietly(ncclCommWindowDeregister(comm_, barrier_window_));
  if (barrier_local_ != nullptr) (void)ncclMemFree(barrier_local_);
  if (barrier_peers_ != nullptr) (void)cudaFree(barrier_peers_);
  if (comm_ != nullptr) comm_detail::destroy_dev_comm(*this, comm_, dev_comm_);
  if (owned_ && comm_ != nullptr) {
    // (A nonblocking communicator's finalize may answer ncclInProgress, and destroy must wait for it;
    // when it fails or does not complete, complete_nccl_quietly aborts the communicator instead.)
    if (complete_nccl_quietly(ncclCommFinalize(comm_))) (void)ncclCommDestroy(comm_);
  }
  if (wait_event_ != nullptr) (void)cudaEventDestroy(wait_event_);
  if (owns_stream_ && stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  if (errors_host_ != nullptr) (void)cudaFreeHost(errors_host_);
  if (barrier_word_ != nullptr) (void)cudaFree(barrier_word_);
  if (error_claim_ != nullptr) (void)cudaFree(error_claim_);
}

void Communicator::set_stream(cudaStream_t stream) {
  EPMOE_CHECK(stream != nullptr || owns_stream_, "Communicator::set_stream: pass a stream");
  if (owns_stream_ && stream != nullptr) {
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
    EPMOE_CUDA_CHECK(cudaStreamDestroy(stream_));
    owns_stream_ = false;
  }
  if (stream != nullptr) stream_ = stream;
}

void Communicator::set_timeout_s(double seconds) {
  EPMOE_CHECK(seconds > 0, "Communicator: timeout_s must be positive, got {}", seconds);
  timeout_s_ = seconds;
}

void Communicator::check_usable(std::string_view what) const {
  wait_init();
  EPMOE_CHECK(broken_reason_.empty(), "rank {}: {}: the communicator is unusable after an earlier error: {}",
              rank_, what, broken_reason_);
  check_device_errors();
}

void Communicator::check_device_errors() const {
  const volatile DeviceErrorRecord* r = errors_host_;
  if (r == nullptr || r->code == 0) return;
  DeviceErrorRecord copy;
  std::memcpy(&copy, const_cast<const DeviceErrorRecord*>(errors_host_), sizeof(copy));
  EPMOE_FAIL("{}{}", describe_device_error(copy), diagnostics());
}

std::string Communicator::diagnostics() const {
  std::string state;
  const std::lock_guard lock(diagnostics_mutex_);
  for (const auto& [id, describe] : diagnostics_) state += "; " + describe();
  return state;
}

int Communicator::add_diagnostic(std::function<std::string()> describe) {
  const std::lock_guard lock(diagnostics_mutex_);
  diagnostics_.emplace(next_diagnostic_, std::move(describe));
  return next_diagnostic_++;
}

void Communicator::remove_diagnostic(int id) {
  const std::lock_guard lock(diagnostics_mutex_);
  diagnostics_.erase(id);
}

void Communicator::reset_device_errors() {
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (errors_host_ != nullptr) std::memset(errors_host_, 0, sizeof(DeviceErrorRecord));
  if (error_claim_ != nullptr) EPMOE_CUDA_CHECK(cudaMemset(error_claim_, 0, 16));
}

void Communicator::fail_wait(CommPhase phase, std::string_view waiting_for, const std::string& why) {
  std::string msg = fmt::format("rank {}: {} in phase {}{}{}", rank_, why, to_string(phase),
                                waiting_for.empty() ? "" : " waiting for ", waiting_for);
  if (owned_ && comm_ != nullptr) {
    (void)ncclCommAbort(comm_);  // makes the stuck NCCL kernels return
    comm_ = nullptr;
    dev_comm_ = nullptr;  // its host struct is leaked on purpose: destroying it would talk to the dead peers
    msg += "; the communicator was aborted";
  } else if (!owned_) {
    msg += "; the communicator is borrowed and was not aborted (the owner may call ncclCommAbort)";
  }
  broken_reason_ = msg;
  EPMOE_FAIL("{}", msg);
}

void Communicator::complete_nccl(ncclResult_t status, const char* call, const char* file, int line,
                                 CommPhase phase) {
  if (status != ncclSuccess && status != ncclInProgress)
    comm_detail::throw_nccl_error(status, call, file, line);
  if (comm_ == nullptr) return;
  // Also after ncclSuccess: NCCL's calls that run as a group of their own (window registration, the
  // device communicator) answer ncclSuccess on a nonblocking communicator while the work is still in
  // progress, their outputs not yet written.
  const double limit_s = host_wait_limit_s();
  const ncclResult_t async = poll_async(comm_, limit_s);
  if (async == ncclSuccess) return;
  if (async == ncclInProgress)
    fail_wait(phase, call,
              fmt::format(
                  "a nonblocking NCCL call (at {}:{}) did not complete within {:.1f} s: did every rank make "
                  "it?",
                  file, line, limit_s));
  const char* last = ncclGetLastError(comm_);
  fail_wait(phase, call,
            fmt::format("NCCL reported error {} ({}{}{}) after the call at {}:{}", static_cast<int>(async),
                        ncclGetErrorString(async), last != nullptr && *last ? ": " : "",
                        last != nullptr ? last : "", file, line));
}

bool Communicator::complete_nccl_quietly(ncclResult_t status) noexcept {
  bool completed = status == ncclSuccess || status == ncclInProgress;
  if (comm_ == nullptr) return completed;
  if (completed) completed = poll_async(comm_, host_wait_limit_s()) == ncclSuccess;
  if (!completed) {
    // The communicator may be left in the middle of the call, when NCCL refuses every later call (and
    // some of them return inside an open NCCL group): no more collective calls on it. An owned one is
    // aborted (allowed at any time), a borrowed one left to its owner.
    try {
      broken_reason_ = "an NCCL call on a teardown or error path failed or did not complete";
    } catch (...) {  // (no memory for the reason: an owned communicator is still aborted below)
    }
    if (owned_) {
      (void)ncclCommAbort(comm_);
      comm_ = nullptr;
      dev_comm_ = nullptr;  // (its host struct: see fail_wait)
    }
  }
  return completed;
}

void Communicator::wait_event(cudaEvent_t event, CommPhase phase, std::string_view waiting_for) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  // Longer than the device-side bound, so that a kernel's own timeout (which names the peer) is
  // reported first.
  const double limit_s = host_wait_limit_s();
  const auto deadline = start + std::chrono::duration<double>(limit_s);
  for (int spins = 0;; ++spins) {
    const cudaError_t q = cudaEventQuery(event);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) EPMOE_CUDA_CHECK(q);
    if (comm_ != nullptr && (spins & 63) == 0) {
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm_, &async) == ncclSuccess && async != ncclSuccess &&
          async != ncclInProgress) {
        const char* last = ncclGetLastError(comm_);
        fail_wait(
            phase, waiting_for,
            fmt::format("NCCL reported an asynchronous error {} ({}{}{})", static_cast<int>(async),
                        ncclGetErrorString(async), last != nullptr && *last ? ": " : "", last ? last : ""));
      }
    }
    if (clock::now() > deadline) {
      check_device_errors();  // a kernel's own timeout says more (which peer) than ours
      fail_wait(phase, waiting_for, fmt::format("timed out after {:.1f} s", limit_s));
    }
    if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void Communicator::synchronize(CommPhase phase, std::string_view waiting_for) {
  try {
    EPMOE_CUDA_CHECK(cudaEventRecord(wait_event_, stream_));
    wait_event(wait_event_, phase, waiting_for);
  } catch (const Error& e) {
    if (!broken_reason_.empty()) throw;  // fail_wait's (a timeout): complete as it is
    // A CUDA error (sticky: a fault anywhere in the context) says nothing of this rank's calls; its
    // dispatchers' state does (the loopback failure of session 22 showed only the error on one rank).
    EPMOE_FAIL("rank {}: {} (phase {}{}{}){}", rank_, e.what(), to_string(phase),
               waiting_for.empty() ? "" : ", waiting for ", waiting_for, diagnostics());
  }
  check_device_errors();
}

void Communicator::barrier() {
  check_usable("barrier");  // waits for the set-up
  EPMOE_CUDA_CHECK(cudaSetDevice(device_));
  if (loopback_ != nullptr) {
    // This rank's work first, then the threads meet: whatever each rank enqueued before the
    // barrier is done when any rank leaves it.
    synchronize(CommPhase::setup, "this rank's stream before a barrier");
    try {
      loopback_->barrier(rank_, host_wait_limit_s());
    } catch (const Error& e) {
      EPMOE_FAIL("{}{}", e.what(), diagnostics());  // what this rank's dispatchers saw
    }
    return;
  }
  const char* nccl_barrier = std::getenv("EPMOE_COMM_NCCL_BARRIER");
  const bool lsa = size_ > 1 && !(nccl_barrier != nullptr && std::string_view(nccl_barrier) == "1");
  if (lsa && ensure_barrier_window()) {
    ++barrier_epoch_;
    comm_detail::launch_lsa_barrier(barrier_peers_, static_cast<std::uint32_t*>(barrier_local_), rank_, size_,
                                    barrier_epoch_, device_error_sink(),
                                    static_cast<std::uint64_t>(timeout_s_ * 1e9), stream_);
  } else {
    EPMOE_NCCL_COMM_CHECK(
        *this, ncclAllReduce(barrier_word_, barrier_word_ + 1, 1, ncclInt32, ncclSum, comm_, stream_));
  }
  synchronize(CommPhase::setup, size_ > 1 ? "every rank at a barrier" : "");
}

void Communicator::all_reduce_sum_i64(const std::int64_t* in, std::int64_t* out, std::size_t n,
                                      cudaStream_t stream) {
  check_usable("all_reduce_sum_i64");
  EPMOE_CHECK(n == 0 || (in != nullptr && out != nullptr),
              "all_reduce_sum_i64: in and out must be non-null for n = {} values, got in = {}, out = {}", n,
              static_cast<const void*>(in), static_cast<const void*>(out));
  EPMOE_CUDA_CHECK(cudaSetDevice(device_));
  if (loopback_ == nullptr) {
    EPMOE_NCCL_COMM_CHECK(*this, ncclAllReduce(in, out, n, ncclInt64, ncclSum, comm_, stream));
    return;
  }
  // Loopback: every rank's counts on the host, summed by each rank in rank order; the barrier keeps
  // each rank's vector alive until every rank has read it.
  std::vector<std::int64_t> mine(n), sum(n, 0);
  EPMOE_CUDA_CHECK(
      cudaMemcpyAsync(mine.data(), in, n * sizeof(std::int64_t), cudaMemcpyDeviceToHost, stream));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<void*> all =
      loopback_->exchange(rank_, loopback_seq_++, mine.data(), host_wait_limit_s());
  for (void* p : all)
    for (std::size_t i = 0; i < n; ++i) sum[i] += static_cast<const std::int64_t*>(p)[i];
  loopback_->barrier(rank_, host_wait_limit_s());
  // On the caller's stream, complete before `sum` goes. (A plain cudaMemcpy ran on the legacy stream,
  // which the callers' non-blocking streams do not wait for, and returns from pageable memory before
  // the upload lands: the layer's load counters then read an uninitialised `out` now and then, seen
  // as a rebalance refusing load = -4.7e18 and as ranks installing different placements, session 16.)
  EPMOE_CUDA_CHECK(
      cudaMemcpyAsync(out, sum.data(), n * sizeof(std::int64_t), cudaMemcpyHostToDevice, stream));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

bool Communicator::ensure_barrier_window() {
  if (barrier_window_ != nullptr) return true;
  ensure_dev_comm();
  if (!all_ranks_lsa()) return false;  // the same answer on every rank: all register the window or none
  constexpr std::size_t kBytes = std::size_t{2} << 20;  // the allocation granularity; one word a rank is used
  EPMOE_NCCL_CHECK(ncclMemAlloc(&barrier_local_, kBytes));
  EPMOE_CUDA_CHECK(cudaMemsetAsync(barrier_local_, 0, kBytes, stream_));
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  EPMOE_NCCL_COMM_CHECK(*this, ncclCommWindowRegister(comm_, barrier_local_, kBytes, &barrier_window_,
                                                      NCCL_WIN_COLL_SYMMETRIC));
  EPMOE_CUDA_CHECK(
      cudaMalloc(reinterpret_cast<void**>(&barrier_peers_), sizeof(void*) * static_cast<std::size_t>(size_)));
  comm_detail::fill_peer_pointers(barrier_window_, rank_, lsa_rank_, lsa_size_, size_, barrier_peers_,
                                  stream_);
  return true;
}

bool Communicator::all_ranks_load_store_reachable() {
  if (loopback_ != nullptr) return true;  // one process on one GPU
  check_usable("all_ranks_load_store_reachable");
  EPMOE_CUDA_CHECK(cudaSetDevice(device_));
  ensure_dev_comm();
  return all_ranks_lsa();
}

void Communicator::ensure_dev_comm() {
  if (dev_comm_ != nullptr) return;
  wait_init();
  dev_comm_ = comm_detail::create_dev_comm(*this, &lsa_rank_, &lsa_size_);
}

std::unique_ptr<SymmetricBuffer> Communicator::alloc_symmetric(std::size_t bytes) {
  check_usable("alloc_symmetric");
  EPMOE_CHECK(bytes > 0, "alloc_symmetric: size must be positive");
  EPMOE_CUDA_CHECK(cudaSetDevice(device_));
  constexpr std::size_t kGranule = std::size_t{2} << 20;
  bytes = (bytes + kGranule - 1) / kGranule * kGranule;
  std::unique_ptr<SymmetricBuffer> b(new SymmetricBuffer());
  b->comm_ = shared_from_this();
  b->size_ = bytes;
  // The peer pointer table (filled below), before the steps are measured.
  const std::size_t table_bytes = sizeof(void*) * static_cast<std::size_t>(size_);
  b->peers_host_ = std::make_unique<void*[]>(static_cast<std::size_t>(size_));
  EPMOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b->peers_device_), table_bytes));
  // Device memory taken by each step, accumulated into setup_memory_ (free memory before minus after).
  std::size_t free_before = 0, total = 0;
  EPMOE_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  auto took = [&](std::size_t& into) {
    std::size_t free_now = 0;
    EPMOE_CUDA_CHECK(cudaMemGetInfo(&free_now, &total));
    into += free_before > free_now ? free_before - free_now : 0;
    free_before = free_now;
  };
  if (loopback_ != nullptr) {
    // Plain device memory; the peers' addresses are the other ranks' allocations (one process).
    b->nccl_memory_ = false;
    EPMOE_CUDA_CHECK(cudaMalloc(&b->local_, bytes));
    took(setup_memory_.buffers);
    const std::uint64_t seq = loopback_seq_++;
    const std::vector<void*> all = loopback_->exchange(rank_, seq, b->local_, host_wait_limit_s());
    b->loopback_memory_ = loopback_->share_allocations(seq, all);
    std::copy(all.begin(), all.end(), b->peers_host_.get());
    // On this communicator's stream, which the barrier below synchronises (see all_reduce_sum_i64).
    EPMOE_CUDA_CHECK(cudaMemcpyAsync(b->peers_device_, b->peers_host_.get(), table_bytes,
                                     cudaMemcpyHostToDevice, stream_));
  } else {
    EPMOE_NCCL_CHECK(ncclMemAlloc(&b->local_, bytes));
    took(setup_memory_.buffers);
    EPMOE_NCCL_COMM_CHECK(
        *this, ncclCommWindowRegister(comm_, b->local_, bytes, &b->window_, NCCL_WIN_COLL_SYMMETRIC));
    took(setup_memory_.window_register);
    ensure_dev_comm();
    took(setup_memory_.dev_comm);
    comm_detail::fill_peer_pointers(b->window_, rank_, lsa_rank_, lsa_size_, size_, b->peers_device_,
                                    stream_);
    EPMOE_CUDA_CHECK(cudaMemcpy(b->peers_host_.get(), b->peers_device_, table_bytes, cudaMemcpyDeviceToHost));
  }
  EPMOE_CUDA_CHECK(cudaMemsetAsync(b->local_, 0, bytes, stream_));
  EPMOE_CUDA_CHECK(cudaMemGetInfo(&free_before, &total));
  barrier();  // nobody writes into a peer's window before the peer has zeroed it
  took(setup_memory_.barrier);
  return b;
}

}  // namespace epmoe
