// Benchmark suite "eplb": the GPU logical -> physical mapping (epmoe/cuda/eplb.hpp), DeepSeek-V3
// shape (E = 256, K = 8, 8 ranks, 32 redundant slots), static and dynamic replica choice, at T in
// tokens (default 128, 4096, 16384) ("eplb.map"; bytes: ids read, physical ids written, the tables
// are a few KiB), and the load counter on the physical ids into the P = 288 slot counters, as the
// layer runs it ("eplb.count"; bytes: ids read, counters written).
#include <cstdint>
#include <string>
#include <vector>

#include "bench/bench.hpp"
#include "cuda/hd.hpp"
#include "epmoe/config.hpp"
#include "epmoe/cuda/device_buffer.hpp"
#include "epmoe/cuda/eplb.hpp"
#include "epmoe/eplb.hpp"

namespace epmoe::bench {
namespace {

// Router-like ids: K distinct experts per token (a hash-driven walk, cheap for millions of ids).
void fill_ids(std::int32_t* p, std::int64_t tokens, int k, int num_logical, std::uint64_t seed) {
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::uint64_t z = detail::mix64_finalize((seed << 32) ^ static_cast<std::uint64_t>(t));
    const auto start = static_cast<int>(z % static_cast<std::uint64_t>(num_logical));
    const int step = 2 * static_cast<int>((z >> 32) % 64) + 1;  // odd: distinct ids for power-of-two E
    for (int j = 0; j < k; ++j) p[t * k + j] = (start + j * step) % num_logical;
  }
}

std::vector<Result> run_eplb_suite(const SuiteOptions& options) {
  std::vector<Result> results;
  const std::vector<std::int64_t> token_list = tokens_or_default(options);
  const TimingOptions timing = timing_for(options);
  cuda::Stream stream;
  SameBytesCopy copy(stream, timing);
  constexpr int kExperts = 256, kTopk = 8, kRanks = 8, kPhysical = 288;
  const ExpertPlacement placement = ExpertPlacement::initial(kExperts, kPhysical, kRanks);
  const cuda::DevicePlacement dpl = cuda::to_device(placement, stream);
  const cuda::DeviceTensor counts(DType::i64, {kPhysical});
  EPMOE_CUDA_CHECK(cudaMemsetAsync(counts.data<std::int64_t>(), 0, counts.nbytes(), stream));
  std::uint64_t seed = 1;

  for (const std::int64_t tokens : token_list) {
    const double bytes = static_cast<double>(tokens * kTopk * 8);
    const int sets = rotation_sets(static_cast<std::size_t>(bytes));
    std::vector<cuda::DeviceTensor> ids, physical;
    HostTensor host(DType::i32, {tokens, kTopk});
    for (int i = 0; i < sets; ++i) {
      fill_ids(host.data<std::int32_t>(), tokens, kTopk, kExperts, seed++);
      ids.push_back(cuda::to_device(host, stream));
      physical.emplace_back(DType::i32, std::initializer_list<std::int64_t>{tokens, kTopk});
      physical.back().fill_bytes(0xff, stream);
    }
    stream.synchronize();
    for (const DispatchAlgorithm algorithm :
         {DispatchAlgorithm::static_choice, DispatchAlgorithm::dynamic_choice}) {
      const double us = time_us(
          [&](int i, cudaStream_t s) {
            const auto set = static_cast<std::size_t>(i);
            cuda::map_to_physical(dpl.view(), ids[set], physical[set], 3, algorithm, s, 0);
          },
          sets, stream, timing);
      const Params p{{"tokens", tokens},
                     {"n", std::int64_t{kExperts}},
                     {"k", std::int64_t{kTopk}},
                     {"ranks", std::int64_t{kRanks}},
                     {"phase", std::string(to_string(algorithm))}};
      emit(options, results, copy.attach(make_result("eplb.map", p, us, bytes), bytes));
    }
    // The counter on what the mapping wrote (every set mapped once above: valid slot ids).
    const double count_bytes = static_cast<double>(tokens * kTopk * 4 + kPhysical * 8);
    const double count_us = time_us(
        [&](int i, cudaStream_t s) { cuda::count_experts(physical[static_cast<std::size_t>(i)], counts, s); },
        sets, stream, timing);
    const Params pc{{"tokens", tokens},
                    {"n", std::int64_t{kPhysical}},
                    {"k", std::int64_t{kTopk}},
                    {"ranks", std::int64_t{kRanks}}};
    emit(options, results, copy.attach(make_result("eplb.count", pc, count_us, count_bytes), count_bytes));
  }
  return results;
}

const SuiteRegistration kEplb{"eplb", "EPLB logical->physical mapping and the load counter, E=256 K=8", 30,
                              run_eplb_suite};

}  // namespace
}  // namespace epmoe::bench
