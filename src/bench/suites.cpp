// Benchmark suites: each measures one family of kernels at the shapes that matter and returns
// its results (bench.hpp).
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "bench/bench.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/quant.hpp"

namespace epmoe::bench {

namespace {
std::vector<Suite>& registry() {
  static std::vector<Suite> list;
  return list;
}
}  // namespace

SuiteRegistration::SuiteRegistration(std::string name, std::string help, int order, SuiteFn run) {
  registry().push_back({std::move(name), std::move(help), order, std::move(run)});
}

std::vector<Suite> suites() {
  std::vector<Suite> list = registry();
  std::stable_sort(list.begin(), list.end(),
                   [](const Suite& a, const Suite& b) { return a.order < b.order; });
  return list;
}

std::vector<std::int64_t> tokens_or_default(const SuiteOptions& options, std::vector<std::int64_t> full) {
  if (!options.tokens.empty()) return options.tokens;
  return options.quick ? std::vector<std::int64_t>{128, 4096} : full;
}

TimingOptions timing_for(const SuiteOptions& options) {
  TimingOptions t;
  if (options.quick) {
    t.warmup = 3;
    t.iterations = 20;
  }
  return t;
}

bool env_list_has(const char* variable, std::string_view name) {
  const char* value = std::getenv(variable);
  if (value == nullptr || *value == '\0') return true;
  for (std::string_view list = value; !list.empty();) {
    const std::size_t comma = list.find(',');
    if (list.substr(0, comma) == name) return true;
    list = comma == std::string_view::npos ? std::string_view{} : list.substr(comma + 1);
  }
  return false;
}

void emit(const SuiteOptions& options, std::vector<Result>& results, Result r) {
  if (options.on_result) options.on_result(r);
  results.push_back(std::move(r));
}

namespace {

// Device-to-device copy (cudaMemcpyAsync of 2 GiB): the memory ceiling. EPMOE_COPY_BYTES sets
// another size (the time a copy of a small kernel's bytes takes, launch and ramp included).
std::vector<Result> run_copy_suite(const SuiteOptions& options) {
  std::vector<Result> results;
  cuda::Stream stream;
  const char* env = std::getenv("EPMOE_COPY_BYTES");
  const std::size_t bytes =  // 2 GiB copied: 4 GiB moved
      env != nullptr ? static_cast<std::size_t>(std::strtoull(env, nullptr, 10)) : std::size_t{2} << 30;
  EPMOE_CHECK(bytes > 0, "EPMOE_COPY_BYTES must be positive, got '{}'", env == nullptr ? "" : env);
  const cuda::DeviceBuffer src(bytes), dst(bytes);
  src.fill_bytes(0x5a, stream);
  dst.fill_bytes(0xa5, stream);
  TimingOptions t = timing_for(options);
  t.iterations = options.quick ? 5 : 20;
  t.warmup = 2;
  const double us = time_us(
      [&](int, cudaStream_t s) {
        EPMOE_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, s));
      },
      1, stream, t);
  emit(options, results, make_result("copy.d2d", {{"n", static_cast<std::int64_t>(bytes)}}, us, 2.0 * bytes));
  return results;
}

// FP8 activation quantizers: per-token-group (both scale layouts) and per-tensor, at
// T in tokens (default 128, 4096, 16384) and K in {7168, 2048}.
std::vector<Result> run_quant_suite(const SuiteOptions& options) {
  std::vector<Result> results;
  const std::vector<std::int64_t> token_list = tokens_or_default(options);
  const TimingOptions timing = timing_for(options);
  cuda::Stream stream;
  SameBytesCopy copy(stream, timing);
  std::uint64_t seed = 1;

  for (const std::int64_t k : {std::int64_t{7168}, std::int64_t{2048}}) {
    for (const std::int64_t tokens : token_list) {
      const std::int64_t groups = k / 128;
      const std::int64_t tokens_padded = cuda::tma_aligned_tokens(tokens);
      const std::int64_t elems = tokens * k;
      const std::size_t set_bytes =
          static_cast<std::size_t>(elems) * 3 + static_cast<std::size_t>(groups * tokens_padded) * 4;
      const int sets = rotation_sets(set_bytes);
      std::vector<cuda::DeviceTensor> xs, qs, ss_token, ss_mn;
      for (int i = 0; i < sets; ++i) {
        xs.emplace_back(DType::bf16, std::initializer_list<std::int64_t>{tokens, k});
        qs.emplace_back(DType::fp8_e4m3, std::initializer_list<std::int64_t>{tokens, k});
        ss_token.emplace_back(DType::f32, std::initializer_list<std::int64_t>{tokens, groups});
        ss_mn.emplace_back(DType::f32, std::initializer_list<std::int64_t>{groups, tokens_padded});
        fill_random_bf16(xs.back(), seed++, stream);
        qs.back().fill_bytes(0xff, stream);
      }
      const cuda::DeviceTensor scale(DType::f32, {1});
      stream.synchronize();

      const double group_bytes =
          static_cast<double>(elems) * 3.0 + static_cast<double>(tokens * groups) * 4.0;
      const Params base{{"tokens", tokens}, {"k", k}, {"groups", groups}};
      struct Variant {
        cuda::ScaleLayout layout;
        bool pow2;
      };
      for (const Variant v :
           {Variant{cuda::ScaleLayout::token_major, false}, Variant{cuda::ScaleLayout::mn_major_tma, true}}) {
        auto& ss = v.layout == cuda::ScaleLayout::token_major ? ss_token : ss_mn;
        const double us = time_us(
            [&](int i, cudaStream_t s) {
              cuda::quantize_per_token_group_fp8(xs[static_cast<std::size_t>(i)],
                                                 qs[static_cast<std::size_t>(i)],
                                                 ss[static_cast<std::size_t>(i)], s, v.layout, v.pow2);
            },
            sets, stream, timing);
        Params p = base;
        p["quant"] = std::string(v.pow2 ? "fp8_group128_pow2" : "fp8_group128");
        p["layout"] = std::string(cuda::to_string(v.layout));
        emit(options, results,
             copy.attach(make_result("quant.per_token_group", p, us, group_bytes), group_bytes));
      }
      {
        const double us = time_us(
            [&](int i, cudaStream_t s) {
              cuda::quantize_per_tensor_fp8(xs[static_cast<std::size_t>(i)], qs[static_cast<std::size_t>(i)],
                                            0.5f, s);
            },
            sets, stream, timing);
        Params p = base;
        p["quant"] = std::string("fp8_tensor_static");
        const double bytes = static_cast<double>(elems) * 3.0;
        emit(options, results, copy.attach(make_result("quant.per_tensor", p, us, bytes), bytes));
      }
      {
        const double us = time_us(
            [&](int i, cudaStream_t s) {
              cuda::per_tensor_fp8_scale(xs[static_cast<std::size_t>(i)], scale, s);
            },
            sets, stream, timing);
        Params p = base;
        p["quant"] = std::string("fp8_tensor_scale");
        const double bytes = static_cast<double>(elems) * 2.0;
        emit(options, results, copy.attach(make_result("quant.per_tensor_scale", p, us, bytes), bytes));
      }
    }
  }
  return results;
}

const SuiteRegistration kCopy{"copy", "device-to-device copy: the memory ceiling", 0, run_copy_suite};
const SuiteRegistration kQuant{"quant", "FP8 activation quantizers", 10, run_quant_suite};

}  // namespace
}  // namespace epmoe::bench
