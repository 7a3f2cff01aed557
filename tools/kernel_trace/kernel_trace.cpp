// A kernel-level GPU timeline where Nsight Systems is not installed: a CUPTI injection library.
//
//   CUDA_INJECTION64_PATH=build-gpu/lib/libepmoe_kernel_trace.so EPMOE_KERNEL_TRACE_DIR=out
//   build-gpu/bin/epmoe run ...     (both variables in the environment of the command)
//
// The CUDA driver loads the library in every process that initialises CUDA (each rank of
// `epmoe launch` / `epmoe run`) and calls InitializeInjection(). It records every kernel, memcpy and
// memset with GPU timestamps through the CUPTI activity API (kernels in captured CUDA graphs
// included) and, at process exit, writes EPMOE_KERNEL_TRACE_DIR/kernels-<pid>.json: a Chrome trace
// (chrome://tracing, Perfetto; one process per device, one thread per stream) whose events also
// carry the raw nanosecond timestamps, for scripts (scripts/kernel-trace-summary.py). Records are
// kept in memory until exit (about 100 bytes each); EPMOE_KERNEL_TRACE_MAX caps their number
// (default 2,000,000) so that a long run cannot exhaust host memory.
#include <cupti.h>
#include <cxxabi.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Record {
  std::string name;  // demangled kernel name, or "memcpy <kind>" / "memset"
  std::uint64_t start = 0, end = 0;
  std::uint32_t device = 0, stream = 0;
  std::uint32_t correlation = 0;
  std::uint32_t graph = 0;  // CUDA graph id (0: not in a graph)
  std::int32_t grid = 0, block = 0;
};

std::mutex g_mutex;
std::vector<Record> g_records;
std::size_t g_max_records = 2000000;
std::size_t g_dropped = 0;
bool g_failed = false;

void report(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* text = nullptr;
  cuptiGetResultString(r, &text);
  std::fprintf(stderr, "epmoe kernel trace: %s failed: %s\n", what, text != nullptr ? text : "?");
  g_failed = true;
}

std::string demangle(const char* name) {
  if (name == nullptr) return "?";
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> d(abi::__cxa_demangle(name, nullptr, nullptr, &status),
                                                std::free);
  return status == 0 && d ? std::string(d.get()) : std::string(name);
}

void CUPTIAPI buffer_requested(std::uint8_t** buffer, std::size_t* size, std::size_t* max_records) {
  constexpr std::size_t kBytes = 8u << 20;
  *buffer = static_cast<std::uint8_t*>(std::aligned_alloc(8, kBytes));
  *size = *buffer != nullptr ? kBytes : 0;
  *max_records = 0;  // as many as fit
}

void keep(Record&& r) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_records.size() >= g_max_records) {
    ++g_dropped;
    return;
  }
  g_records.push_back(std::move(r));
}

// A memcpy's or memset's record: the fields the two activity kinds share, no grid or block.
template <typename Activity>
Record copy_record(std::string name, const Activity& m) {
  return {std::move(name), m.start, m.end, m.deviceId, m.streamId, m.correlationId, m.graphId, 0, 0};
}

void CUPTIAPI buffer_completed(CUcontext, std::uint32_t, std::uint8_t* buffer, std::size_t,
                               std::size_t valid) {
  CUpti_Activity* a = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &a) == CUPTI_SUCCESS) {
    Record r;
    switch (a->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(a);
        r = {demangle(k->name),
             k->start,
             k->end,
             k->deviceId,
             k->streamId,
             k->correlationId,
             k->graphId,
             k->gridX * k->gridY * k->gridZ,
             k->blockX * k->blockY * k->blockZ};
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(a);
        r = copy_record("memcpy " + std::to_string(m->copyKind) + " (" + std::to_string(m->bytes) + " B)",
                        *m);
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(a);
        r = copy_record("memset (" + std::to_string(m->bytes) + " B)", *m);
        break;
      }
      default:
        continue;
    }
    keep(std::move(r));
  }
  std::free(buffer);
}

// JSON string contents: the characters a kernel name can hold that JSON must escape.
std::string escaped(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (const char c : s) {
    if (c == '"' || c == '\\') out.push_back('\\');
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out.push_back(c);
  }
  return out;
}

void write_trace() {
  report(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  const char* dir = std::getenv("EPMOE_KERNEL_TRACE_DIR");
  const std::string path = std::string(dir != nullptr && *dir != '\0' ? dir : ".") + "/kernels-" +
                           std::to_string(getpid()) + ".json";
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "epmoe kernel trace: cannot write %s\n", path.c_str());
    return;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  std::uint64_t t0 = ~0ull;
  for (const Record& r : g_records) t0 = r.start < t0 ? r.start : t0;
  std::fprintf(f,
               "{\"pid\": %d, \"dropped\": %zu, \"cupti_failed\": %s, \"t0_ns\": %llu, \"traceEvents\": [\n",
               static_cast<int>(getpid()), g_dropped, g_failed ? "true" : "false",
               static_cast<unsigned long long>(t0 == ~0ull ? 0 : t0));
  for (std::size_t i = 0; i < g_records.size(); ++i) {
    const Record& r = g_records[i];
    std::fprintf(
        f,
        "{\"name\": \"%s\", \"ph\": \"X\", \"pid\": %u, \"tid\": %u, \"ts\": %.3f, \"dur\": %.3f, "
        "\"args\": {\"start_ns\": %llu, \"end_ns\": %llu, \"graph\": %u, \"grid\": %d, \"block\": %d, "
        "\"correlation\": %u}}%s\n",
        escaped(r.name).c_str(), r.device, r.stream, static_cast<double>(r.start - t0) * 1e-3,
        static_cast<double>(r.end - r.start) * 1e-3, static_cast<unsigned long long>(r.start),
        static_cast<unsigned long long>(r.end), r.graph, r.grid, r.block, r.correlation,
        i + 1 < g_records.size() ? "," : "");
  }
  std::fprintf(f, "]}\n");
  std::fclose(f);
  std::fprintf(stderr, "epmoe kernel trace: %zu records (%zu dropped) in %s\n", g_records.size(), g_dropped,
               path.c_str());
}

}  // namespace

extern "C" int InitializeInjection() {
  if (const char* max = std::getenv("EPMOE_KERNEL_TRACE_MAX"); max != nullptr)
    g_max_records = static_cast<std::size_t>(std::strtoull(max, nullptr, 10));
  report(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed),
         "cuptiActivityRegisterCallbacks");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable memcpy");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable memset");
  std::atexit(write_trace);
  return 1;
}
