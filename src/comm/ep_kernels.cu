// Host launchers of the expert-parallel dispatch / combine kernels (device code in the ep_*_kernels.cuh
// family headers and ep_device_common.cuh; see ep_kernels.hpp for the data flow).
#include "comm/ep_kernels.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "comm/ep_device_common.cuh"
#include "comm/ep_dispatch_kernels.cuh"
#include "comm/ep_place_kernels.cuh"
#include "comm/ep_reduce_kernels.cuh"
#include "comm/ep_route_kernels.cuh"
#include "comm/ep_send_kernels.cuh"
#include "comm/ep_sync_kernels.cuh"
#include "cuda/kernel_setup.hpp"
#include "epmoe/cuda/launch.hpp"

namespace epmoe::comm_detail {

EpGeometry EpGeometry::make(const MoeConfig& c, ActivationFormat format, int rank, int T_max) {
  EpGeometry g;
  g.N = c.num_ranks;
  g.me = rank;
  g.P = c.num_physical_experts();
  g.L = c.num_local_experts();
  g.K = c.topk;
  g.H = c.hidden;
  g.G = format == ActivationFormat::fp8_group ? static_cast<int>(c.hidden / 128) : 0;
  g.elt = format == ActivationFormat::bf16 ? 2 : 1;
  g.T_max = T_max;
  g.W = std::max(1, (T_max + 31) / 32);
  auto up16 = [](std::int64_t x) { return (x + 15) / 16 * 16; };
  g.x_bytes = g.H * g.elt;
  g.meta_off = up16(g.x_bytes + 4 * static_cast<std::int64_t>(g.G));
  g.row_stride = up16(g.meta_off + 12 * static_cast<std::int64_t>(g.K));
  g.partial_bytes = g.H * 2;
  EPMOE_CHECK(g.K >= 1 && g.K <= kMaxTopK, "the GPU dispatchers support top-k up to {}, got {}", kMaxTopK,
              g.K);
  EPMOE_CHECK(g.P <= kMaxPhysicalExperts, "the GPU dispatchers support up to {} physical experts, got {}",
              kMaxPhysicalExperts, g.P);
  const std::int64_t place_smem =
      4 * (3 * static_cast<std::int64_t>(g.N) + 2 + static_cast<std::int64_t>(g.L) * g.N +
           2 * static_cast<std::int64_t>(g.L));
  EPMOE_CHECK(place_smem <= 48 * 1024,
              "the GPU dispatchers' tables need {} bytes of shared memory for {} ranks x {} "
              "local experts, more than 48 KiB",
              place_smem, g.N, g.L);
  EPMOE_CHECK(g.x_bytes % 16 == 0, "hidden * element size must be a multiple of 16 bytes, got {}", g.x_bytes);
  return g;
}

namespace {

unsigned grid_for(std::int64_t warps_of_work) {
  const std::int64_t cap = static_cast<std::int64_t>(cuda::device_props().sm_count) * 4;
  return static_cast<unsigned>(std::clamp<std::int64_t>((warps_of_work + kWarps - 1) / kWarps, 1, cap));
}

}  // namespace

void read_trace(std::uint64_t (&out)[kTraceSlots]) {
  static_assert(sizeof(unsigned long long) == sizeof(std::uint64_t));
  EPMOE_CUDA_CHECK(cudaMemcpyFromSymbol(out, g_trace, sizeof(out)));
}

void reset_trace() {
  const std::uint64_t zero[kTraceSlots] = {};
  EPMOE_CUDA_CHECK(cudaMemcpyToSymbol(g_trace, zero, sizeof(zero)));
}

int work_blocks(std::int64_t warps) {
  return static_cast<int>(grid_for(warps));
}

int send_blocks(std::int64_t T) {
  const int sms = cuda::device_props().sm_count;
  int want = std::min(24, sms);
  if (const char* env = std::getenv("EPMOE_COMM_SEND_SMS")) {
    const int v = std::atoi(env);
    if (v > 0) want = std::min(v, sms);
  }
  const std::int64_t needed = (T + kSendWarps - 1) / kSendWarps;
  return static_cast<int>(std::clamp<std::int64_t>(needed, 1, want));
}

void launch_route(const EpGeometry& g, const std::int32_t* ids, std::int64_t T, std::int32_t host_status,
                  float tensor_scale, std::uint32_t* bitmaps, std::int32_t* prefix, std::int32_t* count_row,
                  cudaStream_t stream) {
  const std::int64_t buckets = g.N + g.P;
  const std::int64_t routed_T = host_status != 0 ? 0 : T;  // nothing is routed from a refused input
  std::uint32_t scale_bits = 0;
  static_assert(sizeof(scale_bits) == sizeof(tensor_scale));
  std::memcpy(&scale_bits, &tensor_scale, sizeof(scale_bits));
  if (buckets * g.W <= kRouteSmallWords && routed_T * g.K <= kRouteSmallItems) {
    const auto smem = static_cast<std::size_t>(buckets * g.W) * sizeof(std::uint32_t);
    route_small_kernel<<<1, kRouteSmallThreads, smem, stream>>>(g, ids, T, routed_T, host_status, scale_bits,
                                                                bitmaps, prefix, count_row);
    EPMOE_CUDA_CHECK_LAUNCH();
    return;
  }
  EPMOE_CUDA_CHECK(cudaMemsetAsync(bitmaps, 0, sizeof(std::uint32_t) * buckets * g.W, stream));
  EPMOE_CUDA_CHECK(cudaMemsetAsync(count_row, 0, sizeof(std::int32_t) * g.count_row_len(), stream));
  if (routed_T > 0) {
    const std::int64_t items = routed_T * g.K;
    const auto grid = static_cast<unsigned>(std::clamp<std::int64_t>(
        (items + kThreads - 1) / kThreads, 1, static_cast<std::int64_t>(cuda::device_props().sm_count) * 8));
    route_kernel<<<grid, kThreads, 0, stream>>>(g, ids, routed_T, bitmaps, count_row);
    EPMOE_CUDA_CHECK_LAUNCH();
  }
  scan_kernel<<<static_cast<unsigned>(buckets), kThreads, 0, stream>>>(g, bitmaps, prefix, count_row, T,
                                                                       host_status, scale_bits);
  EPMOE_CUDA_CHECK_LAUNCH();
}

namespace {
std::size_t place_smem(const EpGeometry& g) {
  return sizeof(int) * (static_cast<std::size_t>(g.N) * 3 + 1 + static_cast<std::size_t>(g.L) * g.N +
                        2 * static_cast<std::size_t>(g.L) + 1);
}

// Staging of the bulk-copy send: a stage holds x, the scales and one metadata tail per destination
// rank. The budget keeps the dispatch kernel at its register-bound occupancy (2 blocks of 256
// threads per SM at ~107 registers): ~100 KB of shared memory per block, static tables included.
constexpr std::int64_t kBulkSmemBudget = 96 * 1024;
int env_int(const char* name, int fallback) {
  const char* env = std::getenv(name);
  return env != nullptr && *env != '\0' ? std::atoi(env) : fallback;
}
// Fills the send path's tuning (EPMOE_COMM_SEND_BULK=1: bulk copies, bulk_warps / bulk_stage_bytes
// / bulk_lag; else per-lane stores with fence_batch); returns the bulk staging bytes (0: none).
std::size_t plan_bulk_send(const EpGeometry& g, SendArgs& s) {
  s.bulk_warps = 0;
  s.bulk_stage_bytes = 0;
  s.bulk_lag = std::clamp(env_int("EPMOE_COMM_BULK_LAG", 6), 0, kBulkMaxLag);
  s.fence_batch = std::max(1, env_int("EPMOE_COMM_FENCE_BATCH", 8));
  if (env_int("EPMOE_COMM_SEND_BULK", 0) != 1 || g.N > kBulkMaxDest) return 0;
  const std::int64_t stage = (g.meta_off + g.N * (g.row_stride - g.meta_off) + 127) / 128 * 128;
  const auto warps =
      static_cast<int>(std::min<std::int64_t>(kBulkWarps, kBulkSmemBudget / (kBulkStages * stage)));
  if (warps < 1) return 0;
  s.bulk_warps = warps;
  s.bulk_stage_bytes = static_cast<int>(stage);
  return static_cast<std::size_t>(warps) * kBulkStages * static_cast<std::size_t>(stage);
}
// Lets a kernel take more than 48 KB of dynamic shared memory (an attribute of the current device's
// function: set at every launch, cheap, and right whichever device the process uses). The first
// setting per device also runs for every such kernel through prepare_kernels (cuda/kernel_setup.hpp),
// before any call, where the registration below puts it: a first setting may wait for the context's
// outstanding copies, which loopback ranks cannot afford in the middle of a call.
void allow_large_smem(const void* kernel) {
  EPMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024));
}
[[maybe_unused]] const bool g_large_smem_registered = [] {
  for (const void* kernel :
       {reinterpret_cast<const void*>(send_kernel<true>), reinterpret_cast<const void*>(send_kernel<false>),
        reinterpret_cast<const void*>(dispatch_kernel<true, true>),
        reinterpret_cast<const void*>(dispatch_kernel<true, false>),
        reinterpret_cast<const void*>(dispatch_kernel<false, false>)})
    cuda::register_kernel_setup("a dispatch kernel's shared-memory limit",
                                [kernel] { allow_large_smem(kernel); });
  return true;
}();
}  // namespace

void launch_lsa_barrier(void* const* windows, std::uint32_t* own, int me, int n, std::uint32_t epoch,
                        const DeviceErrorSink& errors, std::uint64_t timeout_ns, cudaStream_t stream) {
  FlagSync sync;
  sync.errors = errors;
  sync.timeout_ns = timeout_ns;
  lsa_barrier_kernel<<<1, 128, 0, stream>>>(windows, own, me, n, epoch, sync);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_send(const EpGeometry& g, const SendArgs& a, cudaStream_t stream) {
  const bool early = a.tagged != nullptr;
  const void* kernel = early ? reinterpret_cast<const void*>(send_kernel<true>)
                             : reinterpret_cast<const void*>(send_kernel<false>);
  allow_large_smem(kernel);
  const int blocks = a.blocks > 0 ? a.blocks : send_blocks(a.T);
  SendArgs s = a;
  const std::size_t smem = plan_bulk_send(g, s);
  if (early)
    send_kernel<true><<<static_cast<unsigned>(blocks), kSendThreads, smem, stream>>>(g, s);
  else
    send_kernel<false><<<static_cast<unsigned>(blocks), kSendThreads, smem, stream>>>(g, s);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_pack(const EpGeometry& g, const PackArgs& a, cudaStream_t stream) {
  const int blocks = a.blocks > 0 ? a.blocks : send_blocks(a.T);
  pack_kernel<<<static_cast<unsigned>(blocks), kSendThreads, 0, stream>>>(g, a);
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_place(const EpGeometry& g, const PlaceArgs& a, cudaStream_t stream) {
  place_kernel<<<grid_for(static_cast<std::int64_t>(g.N) * g.T_max), kThreads, place_smem(g), stream>>>(g, a);
  EPMOE_CUDA_CHECK_LAUNCH();
}

bool route_fits_in_launch(const EpGeometry& g) {
  return route_in_launch_tables_smem(g) <= kRouteInLaunchMaxSmem &&
         static_cast<std::int64_t>(g.T_max) * g.K <= kRouteSmallItems;
}

int launch_dispatch(const EpGeometry& g, const SendArgs& send_args, const PlaceArgs& p, cudaStream_t stream) {
  const bool early = send_args.tagged != nullptr;
  const bool route_in_launch = send_args.route_in_launch;
  EPMOE_CHECK(early == (p.tagged != nullptr) && (!early || send_args.ce.staging == nullptr),
              "launch_dispatch: early counts need both tagged headers and the SM-store send");
  EPMOE_CHECK(!route_in_launch || (early && route_fits_in_launch(g)),
              "launch_dispatch: routing inside the launch needs early counts and a routing of at most {} "
              "bytes",
              kRouteInLaunchMaxSmem);
  const void* kernel = route_in_launch ? reinterpret_cast<const void*>(dispatch_kernel<true, true>)
                       : early         ? reinterpret_cast<const void*>(dispatch_kernel<true, false>)
                                       : reinterpret_cast<const void*>(dispatch_kernel<false, false>);
  allow_large_smem(kernel);
  SendArgs s = send_args;
  // The pack blocks of the copy-engine send need no staging in shared memory.
  const std::size_t tables =
      std::max(place_smem(g), s.ce.staging != nullptr ? std::size_t{0} : plan_bulk_send(g, s));
  const std::size_t route_off = (tables + 15) / 16 * 16;
  const std::size_t smem = route_in_launch ? route_off + route_in_launch_smem(g) : tables;
  int per_sm = 0;
  EPMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  const std::int64_t resident = static_cast<std::int64_t>(std::max(per_sm, 1)) *
                                cuda::device_props().sm_count / std::max(1, s.ranks_on_device);
  const int send = send_blocks(s.T);
  EPMOE_CHECK(resident > send,
              "the dispatch kernel fits {} blocks on this GPU, fewer than its {} send blocks + 1", resident,
              send);
  const auto place = static_cast<int>(
      std::min<std::int64_t>(grid_for(static_cast<std::int64_t>(g.N) * g.T_max), resident - send));
  const auto grid = static_cast<unsigned>(send + place);
  const auto off = static_cast<int>(route_off);
  if (route_in_launch)
    dispatch_kernel<true, true><<<grid, kThreads, smem, stream>>>(g, s, p, send, off);
  else if (early)
    dispatch_kernel<true, false><<<grid, kThreads, smem, stream>>>(g, s, p, send, off);
  else
    dispatch_kernel<false, false><<<grid, kThreads, smem, stream>>>(g, s, p, send, off);
  EPMOE_CUDA_CHECK_LAUNCH();
  return send + place;
}

void launch_reduce(const EpGeometry& g, const ReduceArgs& a, cudaStream_t stream) {
  const std::int64_t tokens = static_cast<std::int64_t>(g.N) * g.T_max;
  if (a.split > 1) {
    reduce_kernel<true><<<grid_for(tokens * a.split), kThreads, 0, stream>>>(g, a);
  } else {
    reduce_kernel<false><<<grid_for(tokens), kThreads, 0, stream>>>(g, a);
  }
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_home(const EpGeometry& g, const HomeArgs& a, cudaStream_t stream) {
  if (a.split > 1) {
    home_kernel<true><<<grid_for(a.T * a.split), kThreads, 0, stream>>>(g, a);
  } else {
    home_kernel<false><<<grid_for(a.T), kThreads, 0, stream>>>(g, a);
  }
  EPMOE_CUDA_CHECK_LAUNCH();
}

void launch_watch_flags(const std::uint32_t* local_flags, const std::uint32_t* const* peer_flags,
                        std::int64_t parity_stride, int n, std::uint32_t* out, unsigned long long* time_ns,
                        cudaStream_t stream) {
  watch_flags_kernel<<<1, 32, 0, stream>>>(local_flags, peer_flags, parity_stride / 4, n, out, time_ns);
  EPMOE_CUDA_CHECK_LAUNCH();
}

int low_latency_combine_split(const EpGeometry& g) {
  // One resident wave of the split reduce: S warps per token over N * T_max tokens.
  static const std::int64_t resident_warps = [] {
    int blocks_per_sm = 0;
    EPMOE_CUDA_CHECK(
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, reduce_kernel<true>, kThreads, 0));
    return static_cast<std::int64_t>(std::max(blocks_per_sm, 1)) * cuda::device_props().sm_count * kWarps;
  }();
  const std::int64_t tokens = static_cast<std::int64_t>(g.N) * g.T_max;
  for (const int split : {kLowLatencyCombineSplit, 4, 2})
    if (tokens * split <= resident_warps) return split;
  return 1;
}

int combine_split(int fallback) {
  return std::clamp(env_int("EPMOE_COMM_COMBINE_SPLIT", fallback), 1, kMaxCombineSplit);
}

}  // namespace epmoe::comm_detail
