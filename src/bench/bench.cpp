#include "bench/bench.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <utility>

#include <cuda_runtime.h>

#include <fmt/format.h>

#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/launch.hpp"
#include "epmoe/cuda/runtime.hpp"
#include "epmoe/error.hpp"

namespace epmoe::bench {

namespace {

// TimingOptions::burst: the memset target (8 GB as DeepGEMM's bench_kineto, less where free memory
// is short), allocated at the first use and kept for the process.
const cuda::DeviceBuffer& burst_gap_buffer() {
  static const cuda::DeviceBuffer buffer = [] {
    std::size_t free_bytes = 0, total = 0;
    EPMOE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total));
    return cuda::DeviceBuffer(std::min<std::size_t>(std::size_t{8} << 30, free_bytes / 4));
  }();
  return buffer;
}

double time_us_burst(const Launch& launch, int num_sets, cudaStream_t stream, int iterations) {
  const cuda::DeviceBuffer& gap = burst_gap_buffer();
  int set = 0;
  launch(set, stream);
  std::vector<cuda::Event> starts(static_cast<std::size_t>(iterations)),
      ends(static_cast<std::size_t>(iterations));
  double sum_us = 0;
  for (int round = 0; round < 2; ++round) {
    for (int i = 0; i < iterations; ++i) {
      EPMOE_CUDA_CHECK(cudaMemsetAsync(gap.data(), 0, gap.size(), stream));
      starts[static_cast<std::size_t>(i)].record(stream);
      set = (set + 1) % num_sets;
      launch(set, stream);
      ends[static_cast<std::size_t>(i)].record(stream);
    }
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (round == 1)
      for (int i = 0; i < iterations; ++i)
        sum_us += 1e3 * cuda::Event::elapsed_ms(starts[static_cast<std::size_t>(i)],
                                                ends[static_cast<std::size_t>(i)]);
  }
  return sum_us / iterations;
}

}  // namespace

double time_us(const Launch& launch, int num_sets, cudaStream_t stream, const TimingOptions& options) {
  EPMOE_CHECK(num_sets >= 1, "num_sets must be >= 1, got {}", num_sets);
  EPMOE_CHECK(options.iterations >= 1 && options.warmup >= 0, "bad timing options: {} iterations, {} warm-up",
              options.iterations, options.warmup);
  if (options.burst) return time_us_burst(launch, num_sets, stream, options.iterations);
  int set = 0;
  auto next_set = [&] {
    const int s = set;
    set = (set + 1) % num_sets;
    return s;
  };
  // The warm-up touches every input set once (at least options.warmup runs): a set's first run pays
  // for its pages' first translations (the TLB), which no steady-state call does, and which the first
  // kernel timed over fresh sets paid alone: +0.3-0.5 us of a 5 us EPLB mapping at T = 4096 against the
  // same kernel timed second (session 21, NOTES).
  const int warmup = std::max(options.warmup, num_sets);
  for (int i = 0; i < warmup; ++i) launch(next_set(), stream);
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));

  std::vector<cuda::Event> starts, ends;
  starts.reserve(static_cast<std::size_t>(options.iterations));
  ends.reserve(static_cast<std::size_t>(options.iterations));
  for (int i = 0; i < options.iterations; ++i) {
    starts.emplace_back();
    ends.emplace_back();
  }
  // The GPU sleeps while the host queues the timed runs, so that each run starts right after the one
  // before and the host's own time (argument checks, launch calls, event records: over 10 us per run) never
  // shows in an event pair. Whether the sleep outlasted the queueing is checked; if not, the runs are queued
  // again behind a four times longer sleep (the kernels' times would otherwise include host gaps,
  // which a plain copy's cheaper call hides better: session 18, NOTES).
  std::vector<double> times;
  double sleep_us = 40.0 * options.iterations;  // 10 us per run was short on every suite (session 18)
  const cuda::Event slept;
  for (int attempt = 0;; ++attempt) {
    gpu_sleep(stream, sleep_us);
    slept.record(stream);
    for (int i = 0; i < options.iterations; ++i) {
      starts[static_cast<std::size_t>(i)].record(stream);
      launch(next_set(), stream);
      ends[static_cast<std::size_t>(i)].record(stream);
    }
    const bool covered = !slept.done();
    EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (covered || attempt == 3 || options.single_attempt) break;
    sleep_us = std::min(4 * sleep_us, 200000.0);
    fmt::print(
        stderr,
        "bench: the host queued {} runs after the GPU's sleep ended; timing them again behind {:.0f} us\n",
        options.iterations, sleep_us);
  }
  times.reserve(starts.size());
  for (std::size_t i = 0; i < starts.size(); ++i)
    times.push_back(1e3 * cuda::Event::elapsed_ms(starts[i], ends[i]));
  std::nth_element(times.begin(), times.begin() + static_cast<std::ptrdiff_t>(times.size() / 2), times.end());
  return times[times.size() / 2];
}

int rotation_sets(std::size_t bytes_per_set, int max_sets) {
  const std::size_t target = 2 * cuda::device_props().l2_bytes;
  if (bytes_per_set == 0) return 1;
  const std::size_t sets = target / bytes_per_set + 1;
  return static_cast<int>(std::clamp<std::size_t>(sets, 1, static_cast<std::size_t>(std::max(max_sets, 1))));
}

double SameBytesCopy::us(double bytes) {
  const std::size_t copy_bytes = (static_cast<std::size_t>(bytes) / 2 + 15) / 16 * 16;
  if (const auto it = measured_.find(copy_bytes); it != measured_.end()) return it->second;
  const int sets = rotation_sets(2 * copy_bytes);
  std::vector<cuda::DeviceBuffer> src, dst;
  for (int i = 0; i < sets; ++i) {
    src.emplace_back(copy_bytes);
    dst.emplace_back(copy_bytes);
    src.back().fill_bytes(0x5a, stream_);
    dst.back().fill_bytes(0xa5, stream_);
  }
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const auto copy = [&](int i, cudaStream_t s) {
    const auto set = static_cast<std::size_t>(i);
    EPMOE_CUDA_CHECK(
        cudaMemcpyAsync(dst[set].data(), src[set].data(), copy_bytes, cudaMemcpyDeviceToDevice, s));
  };
  // The faster of two measurements: the first copy timed in a process ran up to 2 µs slow at T = 128
  // (session 17), which would flatter the kernel beside it.
  const double t = std::min(time_us(copy, sets, stream_, timing_), time_us(copy, sets, stream_, timing_));
  measured_.emplace(copy_bytes, t);
  return t;
}

namespace {
struct CopyCeiling {
  double gbps = 0;
  std::string source;
};

const CopyCeiling& copy_ceiling() {
  static const CopyCeiling ceiling = [] {
    // The rank's own GPU under `epmoe launch` (EPMOE_LOCAL_DEVICE; with --all-gpus every rank sees every
    // GPU, and all would otherwise time device 0 at once), restored after.
    int previous = 0;
    EPMOE_CUDA_CHECK(cudaGetDevice(&previous));
    int device = previous;
    if (const char* local = std::getenv("EPMOE_LOCAL_DEVICE"); local != nullptr && *local != '\0') {
      const int d = std::atoi(local);
      if (d >= 0 && d < cuda::device_count()) device = d;
    }
    cudaDeviceProp props{};
    EPMOE_CUDA_CHECK(cudaGetDeviceProperties(&props, device));
    const std::string description = cuda::device_description(device);
    const std::string name = props.name;
    // The H200 of anchors.md: its full 132 SMs (not a MIG slice), not a GH200 (another memory system).
    if (name.find("H200") != std::string::npos && name.find("GH200") == std::string::npos &&
        props.multiProcessorCount == 132)
      return CopyCeiling{kCopyCeilingGBps, "H200: anchors.md's device-to-device copy"};
    EPMOE_CUDA_CHECK(cudaSetDevice(device));
    CopyCeiling measured;
    // 1 GiB each way, far past any L2; 256 MiB where that much memory is not free.
    for (const std::size_t bytes : {std::size_t{1} << 30, std::size_t{256} << 20}) {
      try {
        cuda::Stream stream;
        TimingOptions t;
        t.iterations = 5;
        t.warmup = 2;
        const double moved = 2.0 * static_cast<double>(bytes);  // read + written
        measured = {
            moved / (SameBytesCopy(stream, t).us(moved) * 1e3),
            fmt::format("measured: a {} MiB device-to-device copy on this {}", bytes >> 20, description)};
        break;
      } catch (const Error&) {
        (void)cudaGetLastError();  // (the failed allocation's error is not sticky)
      }
    }
    EPMOE_CUDA_CHECK(cudaSetDevice(previous));
    if (measured.gbps <= 0)
      measured = {kCopyCeilingGBps, "not measured (no memory free for the copy): the H200's 4269 GB/s"};
    return measured;
  }();
  return ceiling;
}
}  // namespace

double copy_ceiling_gbps() {
  return copy_ceiling().gbps;
}

std::string copy_ceiling_source() {
  return copy_ceiling().source;
}

Result make_result(std::string bench, Params params, double time_us, double bytes, double flops,
                   double ceiling_gbps) {
  if (ceiling_gbps < 0) ceiling_gbps = copy_ceiling_gbps();
  Result r;
  r.bench = std::move(bench);
  r.params = std::move(params);
  r.time_us = time_us;
  r.gbps = time_us > 0 ? bytes / (time_us * 1e3) : 0.0;
  r.tflops = time_us > 0 ? flops / (time_us * 1e6) : 0.0;
  r.floor_us = ceiling_gbps > 0 ? bytes / (ceiling_gbps * 1e3) : 0.0;
  return r;
}

namespace {
std::string param_text(const ParamValue& v) {
  if (const auto* s = std::get_if<std::string>(&v)) return *s;
  if (const auto* i = std::get_if<std::int64_t>(&v)) return std::to_string(*i);
  return fmt::format("{:g}", std::get<double>(v));
}
}  // namespace

std::string describe(const Result& r) {
  std::string params;
  for (const auto& [name, value] : r.params)
    params += fmt::format("{}{}={}", params.empty() ? "" : " ", name, param_text(value));
  std::string line =
      fmt::format("{:<28} {:<52} {:>10.2f} us {:>8.1f} GB/s", r.bench, params, r.time_us, r.gbps);
  if (r.tflops > 0) line += fmt::format(" {:>7.1f} TFLOP/s", r.tflops);
  if (r.floor_us > 0) line += fmt::format("  floor {:>8.2f} us  x{:.2f}", r.floor_us, r.time_us / r.floor_us);
  if (r.copy_us > 0) line += fmt::format("  copy {:>8.2f} us  x{:.2f}", r.copy_us, r.time_us / r.copy_us);
  return line;
}

std::string git_commit() {
  const std::string built = build_commit();
  if (built != "unknown") return built;
  if (const char* env = std::getenv("EPMOE_COMMIT"); env != nullptr && *env != '\0') return env;
  return built;
}

nlohmann::json to_json(const Result& r) {
  nlohmann::json params = nlohmann::json::object();
  for (const auto& [name, value] : r.params) {
    std::visit([&, &key = name](const auto& v) { params[key] = v; }, value);
  }
  nlohmann::json j = {{"bench", r.bench}, {"params", params},   {"time_us", r.time_us},
                      {"gbps", r.gbps},   {"tflops", r.tflops}, {"floor_us", r.floor_us}};
  if (r.copy_us > 0) {
    j["copy_us"] = r.copy_us;
    j["vs_copy"] = r.time_us / r.copy_us;
  }
  return j;
}

std::string utc_now_iso8601() {
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm utc{};
  gmtime_r(&now, &utc);
  std::array<char, 32> date{};
  std::strftime(date.data(), date.size(), "%Y-%m-%dT%H:%M:%SZ", &utc);
  return date.data();
}

nlohmann::json report_json(const std::vector<Result>& results) {
  nlohmann::json list = nlohmann::json::array();
  for (const Result& r : results) list.push_back(to_json(r));
  return {{"commit", git_commit()},
          {"device", cuda::device_description()},
          {"date", utc_now_iso8601()},
          {"floor_gbps", copy_ceiling_gbps()},
          {"floor_gbps_source", copy_ceiling_source()},
          {"results", list}};
}

}  // namespace epmoe::bench
