// Host launchers of the EPLB mapping kernel (eplb_kernels.cuh) and the token counter
// (eplb_count_kernel.cuh); API in epmoe/cuda/eplb.hpp.
#include "epmoe/cuda/eplb.hpp"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string_view>

#include "eplb/eplb_count_kernel.cuh"
#include "eplb/eplb_kernels.cuh"
#include "epmoe/cuda/launch.hpp"

namespace epmoe::cuda {
namespace {

void expect_device_i32(const TensorView& t, std::string_view name) {
  expect_device(t, Device::cuda, name);
  expect_dtype(t, DType::i32, name);
  expect_contiguous(t, name);
}

// Threads per block (EPMOE_EPLB_THREADS: 256, 512 or 1024; 512 by default, measured best of the three
// in session 17), each mapping kEplbWidth ids per pass. Each block builds its tables: the grid is as
// small as one pass allows.
unsigned eplb_threads() {
  static const unsigned threads = [] {
    const char* v = std::getenv("EPMOE_EPLB_THREADS");
    if (v == nullptr) return 512u;
    const int t = std::atoi(v);
    EPMOE_CHECK(t == 256 || t == 512 || t == 1024, "EPMOE_EPLB_THREADS must be 256, 512 or 1024, got '{}'",
                v);
    return static_cast<unsigned>(t);
  }();
  return threads;
}

template <bool kDynamic, bool kPow2K, bool kWide>
void launch_kernel(const kernels::EplbParams& p, cudaStream_t stream) {
  constexpr auto kernel = &kernels::eplb_map_kernel<kDynamic, kPow2K, kWide>;
  const unsigned threads = eplb_threads();
  static const int blocks_per_sm = [&] {
    int b = 0;
    // Occupancy at the most shared memory a block can ask for (kEplbSmemInts * 4 bytes = 48 KiB).
    EPMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, static_cast<int>(threads),
                                                                   kernels::kEplbSmemInts * sizeof(int)));
    return std::max(b, 1);
  }();
  const std::uint64_t resident = static_cast<std::uint64_t>(device_props().sm_count) * blocks_per_sm;
  const std::uint64_t per_block = std::uint64_t{threads} * (kWide ? kernels::kEplbWidth : 1);
  const auto grid =
      static_cast<unsigned>(std::clamp<std::uint64_t>((p.n + per_block - 1) / per_block, 1, resident));
  const auto smem = static_cast<std::size_t>(
      kernels::eplb_smem_ints(p.num_logical, p.max_replicas, p.topk, kDynamic, p.rows_in_smem) * sizeof(int));
  kernel<<<grid, threads, smem, stream>>>(p);
  EPMOE_CUDA_CHECK_LAUNCH();
}

// One launch over p's elements: picks the kernel instance (dynamic / static, K a power of two,
// 16-byte vectors when n and both pointers allow them).
void launch(const kernels::EplbParams& p, bool dynamic, cudaStream_t stream) {
  const bool pow2 = dynamic && p.topk_shift >= 0;  // (static choice does not use K)
  const bool wide = p.n % kernels::kEplbWidth == 0 && reinterpret_cast<std::uintptr_t>(p.logical) % 16 == 0 &&
                    reinterpret_cast<std::uintptr_t>(p.physical) % 16 == 0;
  // The instance table, indexed by (dynamic, pow2, wide) as bits 2..0 (pow2 is never set for static
  // choice, whose entries repeat the plain instances).
  using Launch = void (*)(const kernels::EplbParams&, cudaStream_t);
  static constexpr Launch kLaunch[8] = {launch_kernel<false, false, false>, launch_kernel<false, false, true>,
                                        launch_kernel<false, false, false>, launch_kernel<false, false, true>,
                                        launch_kernel<true, false, false>,  launch_kernel<true, false, true>,
                                        launch_kernel<true, true, false>,   launch_kernel<true, true, true>};
  kLaunch[(dynamic ? 4 : 0) + (pow2 ? 2 : 0) + (wide ? 1 : 0)](p, stream);
}

template <bool kShared, bool kWide>
void launch_count(const std::int32_t* ids, std::uint32_t n, int num_counters, unsigned long long* counts,
                  cudaStream_t stream) {
  constexpr auto kernel = &kernels::eplb_count_kernel<kShared, kWide>;
  constexpr unsigned kThreads = kernels::kEplbCountThreads;
  const std::size_t smem = kShared ? static_cast<std::size_t>(num_counters) * sizeof(unsigned) : 0;
  static const int blocks_per_sm = [] {
    int b = 0;
    EPMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &b, kernel, static_cast<int>(kThreads), kShared ? kernels::kEplbCountBins * sizeof(unsigned) : 0));
    return std::max(b, 1);
  }();
  const std::uint64_t resident = static_cast<std::uint64_t>(device_props().sm_count) * blocks_per_sm;
  const std::uint64_t per_block = std::uint64_t{kThreads} * (kWide ? 4 : 1);
  const auto grid =
      static_cast<unsigned>(std::clamp<std::uint64_t>((n + per_block - 1) / per_block, 1, resident));
  kernel<<<grid, kThreads, smem, stream>>>(ids, n, num_counters, counts);
  EPMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace

DevicePlacement to_device(const ExpertPlacement& placement, cudaStream_t stream) {
  EPMOE_CHECK(placement.num_logical() > 0, "to_device: empty ExpertPlacement");
  const std::int64_t e = placement.num_logical();
  const std::int64_t r = placement.max_replicas();
  DevicePlacement d;
  d.log2phy = DeviceTensor(DType::i32, {e, r});
  d.logcnt = DeviceTensor(DType::i32, {e});
  d.num_ranks = placement.num_ranks();
  d.slots_per_rank = placement.slots_per_rank();
  auto* log2phy = const_cast<std::int32_t*>(placement.log2phy().data());
  auto* logcnt = const_cast<std::int32_t*>(placement.logcnt().data());
  copy_to_device(d.log2phy, TensorView::contiguous(log2phy, DType::i32, {e, r}), stream);
  copy_to_device(d.logcnt, TensorView::contiguous(logcnt, DType::i32, {e}), stream);
  EPMOE_CUDA_CHECK(cudaStreamSynchronize(stream));  // the host tables may go away after we return
  return d;
}

void map_to_physical(const PlacementView& placement, TensorView logical_ids, TensorView physical_ids,
                     int src_rank, DispatchAlgorithm algorithm, cudaStream_t stream,
                     std::int64_t token_offset) {
  expect_device_i32(placement.log2phy, "log2phy");
  expect_rank(placement.log2phy, 2, "log2phy");
  const std::int64_t num_logical = placement.log2phy.shape[0];
  const std::int64_t max_replicas = placement.log2phy.shape[1];
  EPMOE_CHECK(num_logical >= 1 && num_logical <= kMaxMappedExperts,
              "log2phy: the number of logical experts must be in [1, {}], got {}", kMaxMappedExperts,
              num_logical);
  EPMOE_CHECK(max_replicas >= 1, "log2phy: max_replicas must be >= 1, got {}", max_replicas);
  EPMOE_CHECK(placement.log2phy.data != nullptr, "log2phy has no data");
  expect_device_i32(placement.logcnt, "logcnt");
  expect_shape(placement.logcnt, {num_logical}, "logcnt");
  EPMOE_CHECK(placement.logcnt.data != nullptr, "logcnt has no data");
  EPMOE_CHECK(placement.num_ranks >= 1, "num_ranks must be >= 1, got {}", placement.num_ranks);
  EPMOE_CHECK(placement.slots_per_rank >= 1, "slots_per_rank must be >= 1, got {}", placement.slots_per_rank);
  EPMOE_CHECK(static_cast<std::int64_t>(placement.num_ranks) * placement.slots_per_rank <=
                  std::numeric_limits<std::int32_t>::max(),
              "num_ranks * slots_per_rank ({} * {}) overflows an int32", placement.num_ranks,
              placement.slots_per_rank);
  EPMOE_CHECK(src_rank >= 0 && src_rank < placement.num_ranks, "src_rank {} is out of range [0, {})",
              src_rank, placement.num_ranks);
  EPMOE_CHECK(algorithm == DispatchAlgorithm::static_choice || algorithm == DispatchAlgorithm::dynamic_choice,
              "unknown dispatch algorithm {}", static_cast<int>(algorithm));
  EPMOE_CHECK(token_offset >= 0 && token_offset <= std::numeric_limits<std::int64_t>::max() / 2,
              "token_offset must be in [0, 2^62], got {}", token_offset);

  expect_device_i32(logical_ids, "logical_ids");
  expect_rank(logical_ids, 2, "logical_ids");
  const std::int64_t tokens = logical_ids.shape[0];
  const std::int64_t topk = logical_ids.shape[1];
  expect_device_i32(physical_ids, "physical_ids");
  expect_shape(physical_ids, {tokens, topk}, "physical_ids");
  const std::int64_t n = tokens * topk;
  EPMOE_CHECK(n <= std::numeric_limits<std::int32_t>::max(), "logical_ids {} has too many elements",
              logical_ids.describe());
  if (n == 0) return;
  EPMOE_CHECK(logical_ids.data != nullptr, "logical_ids has no data");
  EPMOE_CHECK(physical_ids.data != nullptr, "physical_ids has no data");

  EPMOE_CHECK(num_logical * max_replicas <= std::numeric_limits<std::int32_t>::max(),
              "log2phy {} has too many elements", placement.log2phy.describe());
  EPMOE_CHECK(topk <= kMaxMappedExperts, "logical_ids: K must be at most {}, got {}", kMaxMappedExperts,
              topk);

  kernels::EplbParams p{};
  p.logical = static_cast<const std::int32_t*>(logical_ids.data);
  p.physical = static_cast<std::int32_t*>(physical_ids.data);
  p.topk = static_cast<std::uint32_t>(topk);
  p.topk_shift = (topk & (topk - 1)) == 0 ? std::countr_zero(static_cast<std::uint64_t>(topk)) : -1;
  p.log2phy = static_cast<const std::int32_t*>(placement.log2phy.data);
  p.logcnt = static_cast<const std::int32_t*>(placement.logcnt.data);
  p.num_logical = static_cast<int>(num_logical);
  p.max_replicas = static_cast<int>(max_replicas);
  p.src_rank = src_rank;
  p.slots_per_rank = placement.slots_per_rank;
  const bool dynamic = algorithm == DispatchAlgorithm::dynamic_choice;
  p.static_in_registers = !dynamic && max_replicas <= 4;
  p.rows_in_smem = !p.static_in_registers && kernels::eplb_smem_ints(num_logical, max_replicas, topk, dynamic,
                                                                     true) <= kernels::kEplbSmemInts;
  // The dynamic hash takes the token's high word from a per-launch table, so a launch never crosses a
  // multiple of 2^32 tokens: such a call (T < 2^31 tokens cross at most one) is two launches.
  std::int64_t first = 0;
  while (first < tokens) {
    const std::int64_t token = token_offset + first;
    const std::int64_t next_high = ((token >> 32) + 1) << 32;
    const std::int64_t end = dynamic ? std::min(tokens, first + (next_high - token)) : tokens;
    p.logical = static_cast<const std::int32_t*>(logical_ids.data) + first * topk;
    p.physical = static_cast<std::int32_t*>(physical_ids.data) + first * topk;
    p.n = static_cast<std::uint32_t>((end - first) * topk);
    p.token_high = static_cast<std::uint32_t>(static_cast<std::uint64_t>(token) >> 32);
    p.token_low = static_cast<std::uint32_t>(static_cast<std::uint64_t>(token));
    launch(p, dynamic, stream);
    first = end;
  }
}

void count_experts(TensorView ids, TensorView counts, cudaStream_t stream) {
  expect_device_i32(ids, "ids");
  expect_device(counts, Device::cuda, "counts");
  expect_dtype(counts, DType::i64, "counts");
  expect_rank(counts, 1, "counts");
  expect_contiguous(counts, "counts");
  const std::int64_t num_counters = counts.shape[0];
  EPMOE_CHECK(num_counters >= 1 && num_counters <= std::numeric_limits<std::int32_t>::max(),
              "counts: the number of counters must be in [1, 2^31), got {}", num_counters);
  EPMOE_CHECK(counts.data != nullptr, "counts has no data");
  const std::int64_t n = ids.numel();
  EPMOE_CHECK(n <= std::numeric_limits<std::int32_t>::max(), "ids {} has too many elements", ids.describe());
  if (n == 0) return;
  EPMOE_CHECK(ids.data != nullptr, "ids has no data");
  const auto* p = static_cast<const std::int32_t*>(ids.data);
  auto* c = static_cast<unsigned long long*>(counts.data);
  const bool shared = num_counters <= kernels::kEplbCountBins;
  const bool wide = n % 4 == 0 && reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
  const auto un = static_cast<std::uint32_t>(n);
  const int nc = static_cast<int>(num_counters);
  if (shared) {
    if (wide) return launch_count<true, true>(p, un, nc, c, stream);
    return launch_count<true, false>(p, un, nc, c, stream);
  }
  if (wide) return launch_count<false, true>(p, un, nc, c, stream);
  launch_count<false, false>(p, un, nc, c, stream);
}

}  // namespace epmoe::cuda
