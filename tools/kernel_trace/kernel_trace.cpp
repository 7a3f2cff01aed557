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
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "bench/cupti_records.hpp"

namespace {

using epmoe::cupti::Record;  // a memcpy's or memset's name here also says its kind and bytes

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

void keep(Record&& r) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_records.size() >= g_max_records) {
    ++g_dropped;
    return;
  }
  g_records.push_back(std::move(r));
}

void CUPTIAPI buffer_completed(CUcontext, std::uint32_t, std::uint8_t* buffer, std::size_t,
                               std::size_t valid) {
  CUpti_Activity* a = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &a) == CUPTI_SUCCESS) {
    std::optional<Record> r = epmoe::cupti::read_record(a);
    if (!r) continue;
    if (r->is_copy) {  // "memcpy <CUpti_ActivityMemcpyKind> (<bytes> B)", "memset (<bytes> B)"
      char label[64];
      const auto bytes = static_cast<unsigned long long>(r->bytes);
      if (r->copy_kind >= 0) {
        std::snprintf(label, sizeof(label), "memcpy %d (%llu B)", r->copy_kind, bytes);
      } else {
        std::snprintf(label, sizeof(label), "memset (%llu B)", bytes);
      }
      r->name = label;
    }
    keep(std::move(*r));
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
  const std::string folder = dir != nullptr && *dir != '\0' ? dir : ".";
  // The folder may not exist yet (a script that clears it before the run): make it, as `mkdir -p`
  // would; a failure shows as the fopen error below.
  std::error_code ignored;
  std::filesystem::create_directories(folder, ignored);
  const std::string path = folder + "/kernels-" + std::to_string(getpid()) + ".json";
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
  report(cuptiActivityRegisterCallbacks(epmoe::cupti::request_buffer, buffer_completed),
         "cuptiActivityRegisterCallbacks");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable memcpy");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable memset");
  std::atexit(write_trace);
  return 1;
}
