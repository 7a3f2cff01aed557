// Benchmark suite "router": the fused GPU router (epmoe/cuda/router.hpp) at E = 256, K = 8:
// DeepSeek-V3 sigmoid noaux_tc (8 groups, 4 kept) and plain softmax top-k, at T in tokens
// (default 128, 4096, 16384). Bytes: logits and bias read, ids and weights written.
#include <cstdint>
#include <string>
#include <vector>

#include "bench/bench.hpp"
#include "epmoe/config.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/router.hpp"

namespace epmoe::bench {
namespace {

// Pseudo-random f32 in about [-4, 4), never 0, from a hash of (seed, i) (fast enough for the
// tens of millions of logits of the rotation sets).
void fill_logits(float* p, std::int64_t n, std::uint64_t seed) {
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint64_t z = seed * 0x9e3779b97f4a7c15ull + static_cast<std::uint64_t>(i);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    p[i] = (static_cast<float>(z >> 40) + 0.5f) * 0x1p-21f - 4.0f;  // (k + 0.5) / 2^21 - 4: never 0
  }
}

std::vector<Result> run_router_suite(const SuiteOptions& options) {
  std::vector<Result> results;
  std::vector<std::int64_t> token_list = options.tokens;
  if (token_list.empty()) {
    token_list =
        options.quick ? std::vector<std::int64_t>{128, 4096} : std::vector<std::int64_t>{128, 4096, 16384};
  }
  const TimingOptions timing = timing_for(options);
  cuda::Stream stream;
  std::uint64_t seed = 1;

  MoeConfig sigmoid = MoeConfig::preset("deepseek-v3");
  MoeConfig softmax = sigmoid;
  softmax.scoring = Scoring::softmax;
  softmax.num_groups = 1;
  softmax.topk_groups = 1;
  softmax.routed_scaling_factor = 1.0f;
  const std::int64_t e = sigmoid.num_experts, k = sigmoid.topk;

  HostTensor bias(DType::f32, {e});
  fill_logits(bias.data<float>(), e, 12345);
  for (std::int64_t i = 0; i < e; ++i) bias.data<float>()[i] *= 0.01f;
  const cuda::DeviceTensor dbias = cuda::to_device(bias, stream);

  for (const std::int64_t tokens : token_list) {
    const double bytes = static_cast<double>(tokens * e * 4 + e * 4 + tokens * k * 8);
    const int sets = rotation_sets(static_cast<std::size_t>(bytes));
    std::vector<cuda::DeviceTensor> logits, ids, weights;
    HostTensor host(DType::f32, {tokens, e});
    for (int i = 0; i < sets; ++i) {
      fill_logits(host.data<float>(), tokens * e, seed++);
      logits.push_back(cuda::to_device(host, stream));
      ids.emplace_back(DType::i32, std::initializer_list<std::int64_t>{tokens, k});
      weights.emplace_back(DType::f32, std::initializer_list<std::int64_t>{tokens, k});
      ids.back().fill_bytes(0xff, stream);
      weights.back().fill_bytes(0xff, stream);
    }
    stream.synchronize();
    for (const MoeConfig* c : {&sigmoid, &softmax}) {
      const double us = time_us(
          [&](int i, cudaStream_t s) {
            const auto set = static_cast<std::size_t>(i);
            cuda::route(*c, logits[set], dbias, ids[set], weights[set], s);
          },
          sets, stream, timing);
      const Params p{{"tokens", tokens},
                     {"n", e},
                     {"k", k},
                     {"groups", static_cast<std::int64_t>(c->num_groups)},
                     {"phase", std::string(to_string(c->scoring))}};
      emit(options, results, make_result("router", p, us, bytes));
    }
  }
  return results;
}

const SuiteRegistration kRouter{"router", "fused router (sigmoid noaux_tc, softmax top-k), E=256 K=8", 20,
                                run_router_suite};

}  // namespace
}  // namespace epmoe::bench
