#include "bench/device_activity.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <optional>

#include "epmoe/comm.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/runtime.hpp"
#include "epmoe/error.hpp"

#if EPMOE_HAVE_CUPTI
#include "bench/cupti_records.hpp"
#endif

namespace epmoe::bench {

const char* to_string(ActivityKind kind) {
  switch (kind) {
    case ActivityKind::route:
      return "route";
    case ActivityKind::dispatch_combine:
      return "dispatch_combine";
    case ActivityKind::experts:
      return "experts";
    case ActivityKind::copies:
      return "copies";
    case ActivityKind::other:
      return "other";
  }
  return "?";
}

// By the kernel's (demangled) name without its parameter list, first match wins:
//   copies            every memcpy and memset;
//   dispatch_combine  NCCL's kernels (the nccl-p2p transport, the all-gathers), every kernel of the
//                     transports (epmoe::comm_detail), the one-GPU permutation and its un-permute;
//   experts           the grouped GEMMs (FP8 and W4A8, their row-sum and operand-swap kernels), SiLU
//                     with its quantisation, the activations' FP8 quantisation;
//   route             the router's kernels, EPLB's mapping and counts, cuBLAS's gate GEMM (any other
//                     GEMM-named kernel: the experts' are matched above);
//   other             the rest (the layer's own small kernels: the shared and routed sum, copies).
ActivityKind classify_activity(std::string_view name, bool is_copy) {
  if (is_copy) return ActivityKind::copies;
  // Only the function's own name counts, not its parameters' types (a GEMM taking a comm_detail type
  // stays an expert kernel): the parameter list is the parenthesis that closes the name (namespaces may
  // hold "(anonymous namespace)").
  if (!name.empty() && name.back() == ')') {
    int depth = 0;
    for (std::size_t i = name.size(); i-- > 0;) {
      if (name[i] == ')') ++depth;
      if (name[i] == '(' && --depth == 0) {
        name = name.substr(0, i);
        break;
      }
    }
  }
  auto has = [&](std::string_view part) { return name.find(part) != std::string_view::npos; };
  if (has("nccl") || has("comm_detail::") || has("permute_")) return ActivityKind::dispatch_combine;
  if (has("grouped_gemm") || has("w4a8_") || has("masked_swap") || has("silu_quant") || has("_fp8_kernel"))
    return ActivityKind::experts;
  if (has("route") || has("eplb_") || has("gemm") || has("gemv") || has("nvjet") || has("cublas"))
    return ActivityKind::route;
  return ActivityKind::other;
}

namespace {

// Union of [start, end) intervals sorted by start: the time covered, and each gap charged to the
// kind of the record that ends it (gaps only inside the window: the first record starts it).
struct Sweep {
  std::uint64_t covered_end = 0, busy = 0;
  bool started = false;
  template <typename OnGap>
  void add(std::uint64_t start, std::uint64_t end, OnGap on_gap) {
    end = std::max(end, start);
    if (!started) {
      started = true;
      covered_end = start;
    }
    if (start > covered_end) on_gap(start - covered_end);
    if (end > covered_end) {
      busy += end - std::max(start, covered_end);
      covered_end = end;
    }
  }
};

constexpr double kNsToMs = 1e-6;

}  // namespace

ActivitySummary summarize_activity(std::vector<ActivityRecord> records) {
  ActivitySummary s;
  if (records.empty()) return s;
  std::sort(records.begin(), records.end(),
            [](const ActivityRecord& a, const ActivityRecord& b) { return a.start_ns < b.start_ns; });
  Sweep all;
  std::array<Sweep, kActivityKinds> by_kind{};
  std::uint64_t first = records.front().start_ns, last = 0;
  std::array<std::uint64_t, kActivityKinds> idle_before{};
  for (const ActivityRecord& r : records) {
    const int k = static_cast<int>(classify_activity(r.name, r.is_copy));
    all.add(r.start_ns, r.end_ns,
            [&](std::uint64_t gap) { idle_before[static_cast<std::size_t>(k)] += gap; });
    by_kind[static_cast<std::size_t>(k)].add(r.start_ns, r.end_ns, [](std::uint64_t) {});
    last = std::max(last, std::max(r.end_ns, r.start_ns));
  }
  s.forwards = 1;
  s.records = static_cast<double>(records.size());
  s.window_ms = static_cast<double>(last - first) * kNsToMs;
  s.busy_ms = static_cast<double>(all.busy) * kNsToMs;
  s.idle_ms = s.window_ms - s.busy_ms;
  for (std::size_t k = 0; k < kActivityKinds; ++k) {
    s.busy_by_kind_ms[k] = static_cast<double>(by_kind[k].busy) * kNsToMs;
    s.idle_before_kind_ms[k] = static_cast<double>(idle_before[k]) * kNsToMs;
  }
  return s;
}

ActivitySummary mean_activity(const std::vector<ActivitySummary>& per_forward) {
  ActivitySummary m;
  for (const ActivitySummary& s : per_forward) {
    if (s.forwards == 0) continue;
    m.forwards += 1;
    m.window_ms += s.window_ms;
    m.busy_ms += s.busy_ms;
    m.idle_ms += s.idle_ms;
    m.records += s.records;
    for (std::size_t k = 0; k < kActivityKinds; ++k) {
      m.busy_by_kind_ms[k] += s.busy_by_kind_ms[k];
      m.idle_before_kind_ms[k] += s.idle_before_kind_ms[k];
    }
  }
  if (m.forwards == 0) return m;
  const double n = m.forwards;
  m.window_ms /= n;
  m.busy_ms /= n;
  m.idle_ms /= n;
  m.records /= n;
  for (std::size_t k = 0; k < kActivityKinds; ++k) {
    m.busy_by_kind_ms[k] /= n;
    m.idle_before_kind_ms[k] /= n;
  }
  return m;
}

nlohmann::json ActivitySummary::json() const {
  if (forwards == 0) return nullptr;
  nlohmann::json busy = nlohmann::json::object(), idle_before = nlohmann::json::object();
  for (std::size_t k = 0; k < kActivityKinds; ++k) {
    busy[to_string(static_cast<ActivityKind>(k))] = busy_by_kind_ms[k];
    idle_before[to_string(static_cast<ActivityKind>(k))] = idle_before_kind_ms[k];
  }
  return {{"forwards", forwards},
          {"window_ms", window_ms},
          {"busy_ms", busy_ms},
          {"idle_ms", idle_ms},
          {"records", records},
          {"busy_by_kind_ms", busy},
          {"idle_before_kind_ms", idle_before}};
}

bool on_every_rank(Communicator* comm, bool mine, const char* what) {
  if (comm == nullptr || comm->size() == 1) return mine;
  const cudaStream_t stream = comm->stream();
  HostTensor host(DType::i64, {1});
  host.data<std::int64_t>()[0] = mine ? 1 : 0;
  const cuda::DeviceTensor flag = cuda::to_device(host, stream);
  comm->all_reduce_sum_i64(flag.data<std::int64_t>(), flag.data<std::int64_t>(), 1, stream);
  comm->synchronize(CommPhase::none, what);
  return cuda::to_host(flag, stream).data<std::int64_t>()[0] == comm->size();
}

ActivitySummary measure_forwards(const std::function<void(int)>& forward, int count, std::string* why_not,
                                 Communicator* comm) {
  EPMOE_CHECK(count >= 1, "measure_forwards: count must be >= 1, got {}", count);
  std::string why;
  std::unique_ptr<DeviceActivity> activity = DeviceActivity::open(&why);
  // The forwards are collective on N ranks: every rank runs them, or none does.
  if (!on_every_rank(comm, activity != nullptr, "the ranks' agreement to record the device's activity")) {
    if (why_not != nullptr) *why_not = activity ? "another rank could not record its device's activity" : why;
    return {};
  }
  EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
  if (comm != nullptr && comm->size() > 1) comm->barrier();
  bool recording = true;
  try {
    activity->begin();
  } catch (const Error& e) {
    recording = false;  // (the forwards still run: the peers run theirs)
    why = e.what();
  }
  for (int i = 0; i <= count; ++i) {
    if (recording) activity->mark();
    forward(i);
    // The whole device idle before the next mark: work of the layer's other streams lands in its own
    // forward.
    EPMOE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  std::vector<std::vector<ActivityRecord>> per_mark;
  if (recording) {
    try {
      per_mark = activity->end();
    } catch (const Error& e) {
      why = e.what();
    }
  }
  std::vector<ActivitySummary> per_forward;
  for (std::size_t i = 1; i < per_mark.size(); ++i)  // (forward 0: the warm-up)
    per_forward.push_back(summarize_activity(std::move(per_mark[i])));
  const ActivitySummary mean = mean_activity(per_forward);
  if (mean.forwards == 0 && why.empty()) why = "CUPTI delivered no records of the forwards";
  if (mean.forwards == 0 && why_not != nullptr) *why_not = why;
  return mean;
}

// ---------------------------------------------------------------- CUPTI (loaded at run time)
#if EPMOE_HAVE_CUPTI

struct DeviceActivity::Api {
  CUptiResult(CUPTIAPI* register_callbacks)(CUpti_BuffersCallbackRequestFunc,
                                            CUpti_BuffersCallbackCompleteFunc);
  CUptiResult(CUPTIAPI* enable)(CUpti_ActivityKind);
  CUptiResult(CUPTIAPI* disable)(CUpti_ActivityKind);
  CUptiResult(CUPTIAPI* flush_all)(std::uint32_t);
  CUptiResult(CUPTIAPI* next_record)(std::uint8_t*, std::size_t, CUpti_Activity**);
  CUptiResult(CUPTIAPI* result_string)(CUptiResult, const char**);
  CUptiResult(CUPTIAPI* timestamp)(std::uint64_t*);

  void check(CUptiResult r, const char* call) const {
    if (r == CUPTI_SUCCESS) return;
    const char* text = nullptr;
    result_string(r, &text);
    throw Error(fmt::format("{} failed: {} ({})", call, text != nullptr ? text : "?", static_cast<int>(r)));
  }
};

namespace {

constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                         CUPTI_ACTIVITY_KIND_MEMSET};

// CUPTI hands finished buffers to a callback, possibly on its own thread: the records land here.
std::mutex g_mutex;
std::vector<ActivityRecord> g_records;
std::atomic<const DeviceActivity::Api*> g_api{nullptr};  // set once, read by CUPTI's thread
bool g_in_use = false;

void CUPTIAPI buffer_completed(CUcontext, std::uint32_t, std::uint8_t* buffer, std::size_t,
                               std::size_t valid) {
  std::vector<ActivityRecord> got;
  CUpti_Activity* a = nullptr;
  const DeviceActivity::Api* api = g_api.load();
  while (api != nullptr && api->next_record(buffer, valid, &a) == CUPTI_SUCCESS) {
    if (std::optional<cupti::Record> r = cupti::read_record(a))
      got.push_back({std::move(r->name), r->start, r->end, r->is_copy});
  }
  std::free(buffer);
  std::lock_guard lock(g_mutex);
  g_records.insert(g_records.end(), std::make_move_iterator(got.begin()), std::make_move_iterator(got.end()));
}

// libcupti from where the build found it (EPMOE_CUPTI_LIBRARY), else by the loader's search.
const DeviceActivity::Api* load_api(std::string* why_not) {
  static std::string load_error;
  static const DeviceActivity::Api* api = [&]() -> const DeviceActivity::Api* {
    void* handle = nullptr;
    for (const char* name : {EPMOE_CUPTI_LIBRARY, "libcupti.so", "libcupti.so.13", "libcupti.so.12"}) {
      handle = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (handle != nullptr) break;
    }
    if (handle == nullptr) {
      load_error = fmt::format("no libcupti could be loaded (tried {}, libcupti.so, .so.13, .so.12)",
                               EPMOE_CUPTI_LIBRARY);
      return nullptr;
    }
    auto* a = new DeviceActivity::Api{};  // lives as long as the process (CUPTI is never unloaded)
    bool ok = true;
    auto bind = [&](auto& fn, const char* symbol) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(handle, symbol));
      if (fn == nullptr && ok) {
        ok = false;
        load_error = fmt::format("libcupti has no {}", symbol);
      }
    };
    bind(a->register_callbacks, "cuptiActivityRegisterCallbacks");
    bind(a->enable, "cuptiActivityEnable");
    bind(a->disable, "cuptiActivityDisable");
    bind(a->flush_all, "cuptiActivityFlushAll");
    bind(a->next_record, "cuptiActivityGetNextRecord");
    bind(a->result_string, "cuptiGetResultString");
    bind(a->timestamp, "cuptiGetTimestamp");
    if (!ok) {
      delete a;
      return nullptr;
    }
    return a;
  }();
  if (api == nullptr && why_not != nullptr) *why_not = load_error;
  return api;
}

}  // namespace

std::unique_ptr<DeviceActivity> DeviceActivity::open(std::string* why_not) {
  if (const char* injected = std::getenv("CUDA_INJECTION64_PATH"); injected != nullptr && *injected != '\0') {
    if (why_not != nullptr)
      *why_not = fmt::format("another CUPTI client is injected (CUDA_INJECTION64_PATH={})", injected);
    return nullptr;
  }
  const Api* api = load_api(why_not);
  if (api == nullptr) return nullptr;
  std::lock_guard lock(g_mutex);
  if (g_in_use) {
    if (why_not != nullptr) *why_not = "a DeviceActivity is already open in this process";
    return nullptr;
  }
  if (g_api.load() == nullptr) {
    const CUptiResult r = api->register_callbacks(cupti::request_buffer, buffer_completed);
    if (r != CUPTI_SUCCESS) {
      const char* text = nullptr;
      api->result_string(r, &text);
      if (why_not != nullptr)
        *why_not = fmt::format("cuptiActivityRegisterCallbacks failed: {}", text != nullptr ? text : "?");
      return nullptr;
    }
    g_api.store(api);
  }
  g_in_use = true;
  return std::unique_ptr<DeviceActivity>(new DeviceActivity(api));
}

DeviceActivity::~DeviceActivity() {
  // Whatever begin() enabled, even where it or end() failed half-way (never throws).
  if (enabled_ != 0) {
    for (std::size_t i = 0; i < std::size(kKinds); ++i)
      if ((enabled_ >> i) & 1u) api_->disable(kKinds[i]);
    api_->flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  }
  std::lock_guard lock(g_mutex);
  g_records.clear();
  g_in_use = false;
}

void DeviceActivity::begin() {
  EPMOE_CHECK(enabled_ == 0, "DeviceActivity::begin: already begun (call end() first)");
  {
    std::lock_guard lock(g_mutex);
    g_records.clear();
  }
  marks_.clear();
  for (std::size_t i = 0; i < std::size(kKinds); ++i) {
    api_->check(api_->enable(kKinds[i]), "cuptiActivityEnable");
    enabled_ |= 1u << i;
  }
}

void DeviceActivity::mark() {
  EPMOE_CHECK(enabled_ != 0, "DeviceActivity::mark: call begin() first");
  std::uint64_t now = 0;
  api_->check(api_->timestamp(&now), "cuptiGetTimestamp");
  marks_.push_back(now);
}

std::vector<std::vector<ActivityRecord>> DeviceActivity::end() {
  EPMOE_CHECK(enabled_ != 0, "DeviceActivity::end: call begin() first");
  for (std::size_t i = 0; i < std::size(kKinds); ++i) {
    api_->check(api_->disable(kKinds[i]), "cuptiActivityDisable");
    enabled_ &= ~(1u << i);
  }
  api_->check(api_->flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  std::vector<ActivityRecord> records;
  {
    std::lock_guard lock(g_mutex);
    records.swap(g_records);
  }
  std::vector<std::vector<ActivityRecord>> per_mark(marks_.size());
  for (ActivityRecord& r : records) {
    // The forward whose mark is the last one at or before the record's start.
    const auto it = std::upper_bound(marks_.begin(), marks_.end(), r.start_ns);
    if (it == marks_.begin()) continue;  // before the first mark
    per_mark[static_cast<std::size_t>(it - marks_.begin() - 1)].push_back(std::move(r));
  }
  return per_mark;
}

#else  // built without CUPTI's headers

struct DeviceActivity::Api {};

std::unique_ptr<DeviceActivity> DeviceActivity::open(std::string* why_not) {
  if (why_not != nullptr) *why_not = "epmoe was built without CUPTI's headers";
  return nullptr;
}
DeviceActivity::~DeviceActivity() = default;
void DeviceActivity::begin() {}
void DeviceActivity::mark() {}
std::vector<std::vector<ActivityRecord>> DeviceActivity::end() {
  return {};
}

#endif

}  // namespace epmoe::bench
