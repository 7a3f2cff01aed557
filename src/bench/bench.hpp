// Benchmark harness: CUDA-event timing (warm-up, median of many runs, inputs rotated through
// enough buffer sets to defeat the L2), result records and the JSON report.
//
// Methodology (see METHOD.md of the device notes): every timed run is bracketed by its own pair
// of events; a short GPU sleep before the timed loop lets the host queue the launches ahead of
// the GPU so that launch gaps stay out of the per-run times; the reported time is the median.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <cuda_runtime_api.h>
#include <nlohmann/json.hpp>

#include "epmoe/tensor.hpp"

namespace epmoe::bench {

// Device-to-device copy bandwidth (bytes read + written) measured on an H200 of this workplace
// (anchors.md): the memory ceiling that floor_us is computed from on an H200.
inline constexpr double kCopyCeilingGBps = 4269.0;

// The memory ceiling of the current device that floor_us is computed from (GB/s, bytes read + written):
// kCopyCeilingGBps on an H200; on any other GPU (an H100's HBM3 is ~25% slower) a 1 GiB device-to-device
// copy timed once, at the first call, so that its floors are its own. copy_ceiling_source() says which.
double copy_ceiling_gbps();
std::string copy_ceiling_source();

// Parameter values: use the names tokens, ranks, mode, quant, layout, groups, m_per_group, n, k,
// phase.
using ParamValue = std::variant<std::string, std::int64_t, double>;
using Params = std::map<std::string, ParamValue>;

struct Result {
  std::string bench;  // e.g. "quant.per_token_group"
  Params params;
  double time_us = 0;   // median time of one run
  double gbps = 0;      // bytes moved (read + written) / time
  double tflops = 0;    // 0 for memory-bound work
  double floor_us = 0;  // bytes / copy_ceiling_gbps() (or the larger of that and the flops floor)
  // Memory-bound suites: a device-to-device copy of the same bytes, timed the same way in the same run
  // (0 where not measured). Small kernels cannot reach the 2 GiB copy's bandwidth (launch, ramp-up and
  // tail weigh as much as the traffic), so issue 3's bar (>= 80% of copy bandwidth) reads as
  // time_us <= 1.25 copy_us; JSON "copy_us" and "vs_copy" = time_us / copy_us.
  double copy_us = 0;
};

struct TimingOptions {
  int warmup = 10;       // untimed runs first (module load, caches, clocks), at least one per input set
  int iterations = 100;  // timed runs; the median is reported
  // DeepGEMM's method (its bench_kineto, which measured anchors.md's DeepGEMM rows) instead of
  // back-to-back runs: one untimed run, then two rounds of `iterations` runs, each after an 8 GB
  // memset (L2 flushed, and the card given a memory-bound pause, so that its power limiter does not
  // hold the clock down as it does in back-to-back tensor-core work); the mean of the second round
  // is reported. `warmup` is ignored.
  bool burst = false;
  // Collective launches (every rank must run the same number): queue the timed runs once, never again
  // behind a longer sleep when the host was slower than the sleep (each rank would decide alone).
  bool single_attempt = false;
};

// Enqueues exactly the work to time on `stream`, using input set `set` (of the rotation).
using Launch = std::function<void(int set, cudaStream_t stream)>;

// Median microseconds of one launch (the mean with options.burst). Runs the launch max(warmup,
// num_sets) + iterations times, cycling `set` through [0, num_sets). Throws epmoe::Error on any CUDA error.
double time_us(const Launch& launch, int num_sets, cudaStream_t stream, const TimingOptions& options = {});

// How many input sets of bytes_per_set bytes to rotate through so that together they exceed
// twice the L2 of the current device (at least 1, at most max_sets).
int rotation_sets(std::size_t bytes_per_set, int max_sets = 1024);

// The time of cudaMemcpyAsync (device to device) of half of `bytes` (so that `bytes` are read + written),
// with its buffers rotated like the kernels' inputs and the same timing options; the faster of two
// measurements, once per size, remembered. attach() sets a result's copy_us.
class SameBytesCopy {
 public:
  SameBytesCopy(cudaStream_t stream, const TimingOptions& timing) : stream_(stream), timing_(timing) {}
  double us(double bytes);
  Result attach(Result r, double bytes) {
    r.copy_us = us(bytes);
    return r;
  }

 private:
  cudaStream_t stream_;
  TimingOptions timing_;
  std::map<std::size_t, double> measured_;  // copy size (bytes / 2, 16-aligned) -> µs
};

// A result with gbps, tflops and floor_us derived from the bytes and flops of one run.
// (ceiling_gbps < 0: copy_ceiling_gbps().)
Result make_result(std::string bench, Params params, double time_us, double bytes, double flops = 0.0,
                   double ceiling_gbps = -1.0);

// One human-readable line: name, params, µs, GB/s, floor and time/floor.
std::string describe(const Result& result);

// The commit this build compiles: git's short HEAD at build time, "-dirty" when tracked files differed
// from it, "unknown" when the build was not in a git checkout (generated by cmake/build_commit.cmake).
const char* build_commit();
// What results record as their "commit": build_commit(); where that is "unknown", $EPMOE_COMMIT if set
// (scripts building from a tree without git set it), else "unknown". Never the working directory's
// checkout: a binary run from another checkout would name that one's commit.
std::string git_commit();
// Now, UTC, ISO 8601 ("2026-12-01T14:24:49Z").
std::string utc_now_iso8601();
// {"commit", "device", "date" (UTC, ISO 8601), "results": [...]}.
nlohmann::json report_json(const std::vector<Result>& results);
nlohmann::json to_json(const Result& result);

// ---------------------------------------------------------------- device helpers (bench.cu)
// Holds the GPU for about `microseconds` (spinning on the global timer).
void gpu_sleep(cudaStream_t stream, double microseconds);
// Fills a bf16 device tensor with pseudo-random non-zero values of varied magnitude (a hash of
// the index and seed; never all zeros, never NaN or Inf).
void fill_random_bf16(TensorView x, std::uint64_t seed, cudaStream_t stream);
// HBM traffic of a given shape: `passes` times, reads src (bytes) and writes it `fanout` times into
// dst (fanout * bytes), on `blocks` blocks of 256 threads (comm's peer-copy rows: a stand-in for
// the dispatch's place step beside the copy engines).
void stream_fanout(const void* src, void* dst, std::size_t bytes, int fanout, int blocks, int passes,
                   cudaStream_t stream);

// ---------------------------------------------------------------- suites (suites.cpp)
struct SuiteOptions {
  std::vector<std::int64_t> tokens;              // empty: the suite's defaults
  bool quick = false;                            // fewer runs and shapes
  std::string quant;                             // suites with variants per scheme: "" = default
  std::function<void(const Result&)> on_result;  // called as each result is measured
  // Called for each result a suite checked and found wrong (e.g. the layer against the CPU reference):
  // the caller keeps the rows and fails after writing them. Unset: the suite throws instead.
  std::function<void(const std::string&)> on_failure;
};
using SuiteFn = std::function<std::vector<Result>(const SuiteOptions& options)>;

// Suites register themselves from their own files (`epmoe bench <name>`); `order` sorts them for
// `epmoe bench all`.
struct SuiteRegistration {
  SuiteRegistration(std::string name, std::string help, int order, SuiteFn run);
};
struct Suite {
  std::string name, help;
  int order = 0;
  SuiteFn run;
};
std::vector<Suite> suites();  // sorted by order

// Shared by the suites: timing options for --quick, and reporting a result as it is measured.
TimingOptions timing_for(const SuiteOptions& options);
// --tokens, or else the memory-bound suites' token counts (128, 4096 and 16384; --quick: 128, 4096),
// or `full` where given.
std::vector<std::int64_t> tokens_or_default(const SuiteOptions& options,
                                            std::vector<std::int64_t> full = {128, 4096, 16384});
void emit(const SuiteOptions& options, std::vector<Result>& results, Result r);
// Whether the comma-separated list in environment variable `variable` names `name` (the suites'
// EPMOE_BENCH_*_VARIANTS switches); unset or empty: every name is listed.
bool env_list_has(const char* variable, std::string_view name);

}  // namespace epmoe::bench
