// What the device did during a few forwards: every kernel, memcpy and memset with its GPU timestamps
// (CUPTI's activity records), and from them the time inside a forward when nothing ran on the device
// (idle), split by what ran next. CUDA events cannot show that: an event's time is the later of the
// stream reaching it and the host recording it, so a stream that starves inside a phase looks busy.
//
// CUPTI is loaded at run time (dlopen), never linked: a machine whose CUDA runtime has no CUPTI (a
// runtime-only container) still runs everything else, and DeviceActivity::open says why it cannot.
// The summary (summarize_activity) is plain host code, tested without a GPU.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace epmoe {
class Communicator;
}

namespace epmoe::bench {

// One activity record: a kernel (name demangled) or a copy, on the device's clock (ns).
struct ActivityRecord {
  std::string name;
  std::uint64_t start_ns = 0, end_ns = 0;
  bool is_copy = false;  // memcpy or memset
};

// What a record belongs to in the layer's forward, from the kernel's name (documented in
// classify_activity): the router and EPLB mapping, the token movement (dispatch / combine kernels of
// every transport, NCCL's, the one-GPU permutation), the experts (grouped GEMMs and their
// activation / quantisation glue), copies, anything else (cuBLAS's gate GEMM counts as route).
enum class ActivityKind : int { route = 0, dispatch_combine, experts, copies, other };
inline constexpr int kActivityKinds = 5;
const char* to_string(ActivityKind kind);
ActivityKind classify_activity(std::string_view name, bool is_copy);

// One forward's records summarised (times in ms): the window from the first record's start to the
// last one's end, the time some record ran (the union over every stream), idle = window - busy; per
// kind, the union of that kind's records (kinds on different streams overlap, so these may sum to
// more than busy) and the idle gaps that ended when a record of that kind started (what the device
// waited for).
struct ActivitySummary {
  double forwards = 0;  // forwards averaged (0: none measured)
  double window_ms = 0, busy_ms = 0, idle_ms = 0;
  std::array<double, kActivityKinds> busy_by_kind_ms{};
  std::array<double, kActivityKinds> idle_before_kind_ms{};
  double records = 0;  // records per forward

  nlohmann::json json() const;  // null when forwards == 0
};
ActivitySummary summarize_activity(std::vector<ActivityRecord> records);
// The mean of several forwards' summaries (forwards = their count).
ActivitySummary mean_activity(const std::vector<ActivitySummary>& per_forward);

// CUPTI's activity API for the duration of a measurement: open() loads CUPTI (nullptr and the reason
// in why_not when it cannot: not built with CUPTI's headers, no libcupti found, another CUPTI client
// such as a profiler or tools/kernel_trace injected through CUDA_INJECTION64_PATH, or a CUPTI error).
// One at a time per process. begin() enables the kernel / memcpy / memset records, mark() starts a new
// forward (the host's CUPTI timestamp, on the records' clock), end() flushes and disables them and
// returns each forward's records (those that started after its mark and before the next one).
// Enabling records adds a little to each launch: measure forwards apart from the timed ones.
class DeviceActivity {
 public:
  static std::unique_ptr<DeviceActivity> open(std::string* why_not);
  ~DeviceActivity();
  DeviceActivity(const DeviceActivity&) = delete;
  DeviceActivity& operator=(const DeviceActivity&) = delete;

  void begin();
  void mark();
  std::vector<std::vector<ActivityRecord>> end();

  struct Api;  // the CUPTI entry points, loaded once per process (device_activity.cpp)

 private:
  explicit DeviceActivity(const Api* api) : api_(api) {}
  const Api* api_;
  std::vector<std::uint64_t> marks_;
  std::uint32_t enabled_ = 0;  // the activity kinds begin() enabled (bit i: kind i), for the destructor
};

// The device's activity in `count` forwards: forward(i) for i = 0 .. count (forward 0 a warm-up, not
// counted: CUPTI sets itself up for each kernel and graph the first time it sees one, which would show as
// idle), each started from an idle device (synchronised after each), under one DeviceActivity. With a
// communicator of N ranks (collective): the ranks first agree that every one of them can record, then
// meet at a barrier, and run the forwards (collective too) or, where one cannot, none of them does. A
// CUPTI error after that still runs every forward. Returns the mean of forwards 1 .. count, or forwards = 0
// with the reason in why_not (CUPTI cannot be used, a peer cannot, a CUPTI error, no records).
ActivitySummary measure_forwards(const std::function<void(int)>& forward, int count, std::string* why_not,
                                 Communicator* comm = nullptr);

// Whether `mine` holds on every rank of comm (collective: every rank calls it at the same point; `mine`
// alone without peers). On the communicator's stream, whose wait is bounded (a peer that never joins: an
// error naming `what`, no hang).
bool on_every_rank(Communicator* comm, bool mine, const char* what);

}  // namespace epmoe::bench
