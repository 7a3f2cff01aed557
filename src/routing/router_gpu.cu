// Host launcher of the fused router kernel (router_kernels.cuh); API in epmoe/cuda/router.hpp.
#include "epmoe/cuda/router.hpp"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string_view>

#include "cuda/kernel_setup.hpp"
#include "cuda/tma_map.hpp"
#include "epmoe/cuda/launch.hpp"
#include "routing/router_kernels.cuh"

namespace epmoe::cuda {
namespace {

using kernels::kRouterThreads;

void expect_device_tensor(const TensorView& t, DType dtype, std::initializer_list<std::int64_t> shape,
                          std::string_view name) {
  expect_device(t, Device::cuda, name);
  expect_dtype(t, dtype, name);
  expect_shape(t, shape, name);
  expect_contiguous(t, name);
  EPMOE_CHECK(t.numel() == 0 || t.data != nullptr, "{} has no data", name);
}

// The lane layout of router_kernels.cuh for one config.
struct Layout {
  bool grouped = false;
  int groups = 1;             // G as the kernel sees it (1 when groups are not used)
  int experts_per_group = 0;  // P
  int lane_shift = 0;         // log2(lanes per group)
  int per_lane = 0;           // kV
};

Layout layout_of(const MoeConfig& c) {
  Layout l;
  l.grouped = c.num_groups > 1 && c.topk_groups < c.num_groups;  // all groups kept: plain top-k
  l.groups = l.grouped ? c.num_groups : 1;
  l.experts_per_group = c.num_experts / l.groups;
  if (l.groups > kernels::kRouterMaxGroups) return l;  // per_lane stays 0: unsupported
  const int lanes_per_group = 32 / static_cast<int>(std::bit_ceil(static_cast<unsigned>(l.groups)));
  l.lane_shift = std::countr_zero(static_cast<unsigned>(lanes_per_group));
  l.per_lane = static_cast<int>(
      std::bit_ceil(static_cast<unsigned>((l.experts_per_group + lanes_per_group - 1) / lanes_per_group)));
  return l;
}

// Blocks for `tokens` tokens (one per warp), no more than fit on the device at once (the kernel's
// warps stride over the rest).
template <auto kKernel>
unsigned grid_for(std::uint32_t tokens) {
  static const int blocks_per_sm = [] {
    int n = 0;
    EPMOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, kRouterThreads, 0));
    return std::max(n, 1);
  }();
  const std::uint64_t resident = static_cast<std::uint64_t>(device_props().sm_count) * blocks_per_sm;
  const std::uint64_t wanted =
      (static_cast<std::uint64_t>(tokens) + kernels::kRouterWarps - 1) / kernels::kRouterWarps;
  return static_cast<unsigned>(std::clamp<std::uint64_t>(wanted, 1, resident));
}

template <int kV, bool kSigmoid, bool kRnDiv>
void launch(const kernels::RouterParams& p, cudaStream_t stream) {
  constexpr auto kernel = &kernels::route_kernel<kV, kSigmoid, kRnDiv>;
  kernel<<<grid_for<kernel>(p.tokens), kRouterThreads, 0, stream>>>(p);
  EPMOE_CUDA_CHECK_LAUNCH();
}

template <bool kSigmoid, bool kRnDiv>
void launch_for(int per_lane, const kernels::RouterParams& p, cudaStream_t stream) {
  switch (per_lane) {
    case 1:
      return launch<1, kSigmoid, kRnDiv>(p, stream);
    case 2:
      return launch<2, kSigmoid, kRnDiv>(p, stream);
    case 4:
      return launch<4, kSigmoid, kRnDiv>(p, stream);
    case 8:
      return launch<8, kSigmoid, kRnDiv>(p, stream);
    case 16:
      return launch<16, kSigmoid, kRnDiv>(p, stream);
    default:
      EPMOE_FAIL("router: no kernel for {} experts per lane", per_lane);
  }
}

bool aligned16(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
}

// route_g8_kernel's shape: sigmoid, 8 groups of 32 experts, at most 4 kept, K <= min(8, 2 * kept)
// (the candidate threshold needs 2 * kept >= K known values), 16-byte aligned logits and bias.
// Below kRouterG8MinTokens the general kernel (a warp per token) is faster: both are latency-bound
// there and its chain per warp is shorter (H200: 6.7 vs 8.2 us at T = 128; 12.4 vs 10.1 us at
// T = 4096; the switch point between is not measured).
inline constexpr std::uint32_t kRouterG8MinTokens = 1024;
// Below this many tokens the sieve kernel routes pairs (16 lanes per token, v9), at and above it
// quads: pairs halve each lane's chain, quads take ~25% fewer instructions per token. H200 (bench
// "router", session 10): pairs 7.1 vs 7.7 us at T = 2048, 8.1 vs 8.6 at 4096, 9.1 vs 9.3 at 6144,
// level at 8192 (10.2), 12.1 vs 11.9 at 12288, 15.3 vs 13.6 at 16384; at T = 128 pairs (6.1 us) are
// level with the general kernel (6.1-6.2), so the sieve with pairs is taken below kRouterG8MinTokens
// too.
inline constexpr std::uint32_t kRouterSievePairsMaxTokens = 8192;

bool route_g8_applies(const MoeConfig& c, const kernels::RouterParams& p) {
  return c.scoring == Scoring::sigmoid && p.grouped && c.num_experts == 256 && c.num_groups == 8 &&
         c.topk_groups <= 4 && c.topk <= 8 && c.topk <= 2 * c.topk_groups && aligned16(p.logits) &&
         aligned16(p.bias);
}

// route_g8_softmax_kernel's shape: softmax over 256 experts without group selection, K <= 8,
// 16-byte aligned logits.
bool route_g8_softmax_applies(const MoeConfig& c, const kernels::RouterParams& p) {
  return c.scoring == Scoring::softmax && !p.grouped && c.num_experts == 256 && c.topk <= 8 &&
         aligned16(p.logits);
}

// Blocks for a g8 kernel (route_g8_kernel, route_g8_sieve_kernel, route_g8_softmax_kernel: the same
// layout): a warp per unit of kUnitTokens tokens (a quad; the sieve kernel also takes pairs), no more
// than fit on the device at once.
// Its carveout and the blocks that fit per SM, set and measured once: at the first launch, or before,
// through prepare_kernels (cuda/kernel_setup.hpp), where the registration puts it when the library
// loads (setting an attribute may wait for the context's outstanding copies).
template <auto kKernel>
struct G8Setup {
  static int blocks_per_sm() {
    static const int n = [] {
      // 8 blocks of 25.75 KB (5 of 41.75 KB) need the largest shared-memory carveout.
      EPMOE_CUDA_CHECK(cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                            cudaSharedmemCarveoutMaxShared));
      int blocks = 0;
      EPMOE_CUDA_CHECK(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kKernel, kernels::kRouterG8Threads, 0));
      return std::max(blocks, 1);
    }();
    return n;
  }
  static inline const bool registered =
      cuda::register_kernel_setup("a router kernel's carveout", [] { static_cast<void>(blocks_per_sm()); });
};

template <auto kKernel, int kUnitTokens = 4, typename... Extra>
void launch_g8(const kernels::RouterParams& p, cudaStream_t stream, const Extra&... extra) {
  static_cast<void>(G8Setup<kKernel>::registered);  // (instantiates the registration)
  const int blocks_per_sm = G8Setup<kKernel>::blocks_per_sm();
  const std::uint64_t resident = static_cast<std::uint64_t>(device_props().sm_count) * blocks_per_sm;
  const std::uint64_t units = (static_cast<std::uint64_t>(p.tokens) + kUnitTokens - 1) / kUnitTokens;
  const std::uint64_t wanted = (units + kernels::kRouterG8Warps - 1) / kernels::kRouterG8Warps;
  const auto grid = static_cast<unsigned>(std::clamp<std::uint64_t>(wanted, 1, resident));
  kKernel<<<grid, kernels::kRouterG8Threads, 0, stream>>>(p, extra...);
  EPMOE_CUDA_CHECK_LAUNCH();
}

// The TMA staging a g8 kernel takes: `tma_stages` (RouteKernelChoice), or 0 where TMA coordinates
// (int32 rows, 8 per token) would overflow (T >= 2^28).
int staging_for(const kernels::RouterParams& p, int tma_stages) {
  return p.tokens >= (1u << 28) ? 0 : std::clamp(tma_stages, 0, 2);
}

// The TMA map of the staged g8 kernels: the logits as rows of 128 bytes (one token's group of 32),
// a unit (a quad: 32 rows; a pair: 16) per box.
CUtensorMap logits_map(const kernels::RouterParams& p, int unit_tokens) {
  return make_tma_2d(p.logits, static_cast<std::int64_t>(p.tokens) * 8, 128, 8 * unit_tokens, "logits",
                     CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
}

// A staged g8 kernel, given as its instances with 0, 1 and 2 TMA stage buffers; `staging` from
// staging_for.
template <auto kPerLaneLoads, auto kOneBuffer, auto kTwoBuffers>
void launch_staged(const kernels::RouterParams& p, int staging, cudaStream_t stream) {
  switch (staging) {
    case 0:
      return launch_g8<kPerLaneLoads>(p, stream, CUtensorMap{});
    case 1:
      return launch_g8<kOneBuffer>(p, stream, logits_map(p, 4));
    default:
      return launch_g8<kTwoBuffers>(p, stream, logits_map(p, 4));
  }
}

// The sieve kernel: quads (8 lanes per token) with any staging; pairs (16 lanes per token, v9) with
// TMA staging only (the caller asks for pairs only then).
template <bool kRnDiv>
void launch_sieve(const kernels::RouterParams& p, int staging, bool pairs, cudaStream_t stream) {
  using kernels::route_g8_sieve_kernel;
  if (p.trace != nullptr) {  // the traced instances (one TMA buffer, RouteKernelChoice::trace)
    EPMOE_CHECK(!kRnDiv && staging == 1,
                "router trace: needs the branch-free sigmoid and tma_stages = 1, got rn_division = {}, "
                "tma_stages = {}",
                kRnDiv, staging);
    return pairs ? launch_g8<&route_g8_sieve_kernel<false, 1, 16, true>, 2>(p, stream, logits_map(p, 2))
                 : launch_g8<&route_g8_sieve_kernel<false, 1, 8, true>>(p, stream, logits_map(p, 4));
  }
  if (pairs) {
    return staging == 1 ? launch_g8<&route_g8_sieve_kernel<kRnDiv, 1, 16>, 2>(p, stream, logits_map(p, 2))
                        : launch_g8<&route_g8_sieve_kernel<kRnDiv, 2, 16>, 2>(p, stream, logits_map(p, 2));
  }
  launch_staged<&route_g8_sieve_kernel<kRnDiv, 0>, &route_g8_sieve_kernel<kRnDiv, 1>,
                &route_g8_sieve_kernel<kRnDiv, 2>>(p, staging, stream);
}

void launch_softmax(const kernels::RouterParams& p, int staging, cudaStream_t stream) {
  using kernels::route_g8_softmax_kernel;
  launch_staged<&route_g8_softmax_kernel<0>, &route_g8_softmax_kernel<1>, &route_g8_softmax_kernel<2>>(
      p, staging, stream);
}

}  // namespace

bool route_supports(const MoeConfig& c) {
  if (c.topk > kernels::kRouterMaxTopk) return false;
  const Layout l = layout_of(c);
  return l.per_lane >= 1 && l.per_lane <= kernels::kRouterMaxPerLane;
}

void route(const MoeConfig& config, TensorView logits, TensorView correction_bias, TensorView topk_ids,
           TensorView topk_weights, cudaStream_t stream, const RouteKernelChoice& choice) {
  config.validate();
  const std::int64_t num_experts = config.num_experts;
  const std::int64_t k = config.topk;
  EPMOE_CHECK(k <= kernels::kRouterMaxTopk, "GPU router: topk must be <= {}, got {}", kernels::kRouterMaxTopk,
              k);
  const Layout layout = layout_of(config);
  EPMOE_CHECK(layout.groups <= kernels::kRouterMaxGroups, "GPU router: num_groups must be <= {}, got {}",
              kernels::kRouterMaxGroups, config.num_groups);
  EPMOE_CHECK(layout.per_lane <= kernels::kRouterMaxPerLane,
              "GPU router: {} experts in {} groups need {} experts per lane, more than {}", num_experts,
              layout.groups, layout.per_lane, kernels::kRouterMaxPerLane);

  expect_rank(logits, 2, "logits");
  const std::int64_t tokens = logits.shape[0];
  expect_device_tensor(logits, DType::f32, {tokens, num_experts}, "logits");
  expect_device_tensor(topk_ids, DType::i32, {tokens, k}, "topk_ids");
  expect_device_tensor(topk_weights, DType::f32, {tokens, k}, "topk_weights");
  const bool sigmoid = config.scoring == Scoring::sigmoid;
  if (sigmoid) {
    EPMOE_CHECK(!correction_bias.empty_view(), "correction_bias [{}] f32 is required for sigmoid scoring",
                num_experts);
    expect_device_tensor(correction_bias, DType::f32, {num_experts}, "correction_bias");
  }  // softmax scoring ignores correction_bias
  EPMOE_CHECK(tokens <= std::numeric_limits<std::int32_t>::max(), "logits: too many tokens ({})", tokens);
  if (tokens == 0) return;

  kernels::RouterParams p{};
  p.logits = static_cast<const float*>(logits.data);
  p.bias = sigmoid ? static_cast<const float*>(correction_bias.data) : nullptr;
  p.ids = static_cast<std::int32_t*>(topk_ids.data);
  p.weights = static_cast<float*>(topk_weights.data);
  p.tokens = static_cast<std::uint32_t>(tokens);
  p.num_experts = config.num_experts;
  p.topk = config.topk;
  p.num_groups = layout.groups;
  p.topk_groups = layout.grouped ? config.topk_groups : 1;
  p.experts_per_group = layout.experts_per_group;
  p.lane_shift = layout.lane_shift;
  p.grouped = layout.grouped;
  // Lane l holds [l*kV, l*kV + kV) exactly when a group's lanes hold it without padding; rows are
  // then 16-byte aligned (E is a multiple of kV >= 4) when the base pointers are.
  p.vector_loads = layout.per_lane >= 4 && (layout.experts_per_group % layout.per_lane) == 0 &&
                   (layout.experts_per_group / layout.per_lane) == (1 << layout.lane_shift) &&
                   aligned16(p.logits) && (p.bias == nullptr || aligned16(p.bias));
  p.renormalize = config.renormalize;
  p.scaling = config.routed_scaling_factor;
  p.trace = choice.trace;
  using Kernel = RouteKernelChoice::Kernel;
  using namespace kernels;
  // The sieve kernel's lanes per token: forced, or pairs below kRouterSievePairsMaxTokens.
  const int lanes = choice.token_lanes != 0                 ? choice.token_lanes
                    : p.tokens < kRouterSievePairsMaxTokens ? 16
                                                            : 8;
  const int staging = staging_for(p, choice.tma_stages);
  const bool sieve_pairs = choice.sieve && lanes == 16 && staging > 0;
  // A g8 kernel where its shape applies: forced, or automatic from kRouterG8MinTokens (the sieve with
  // pairs at every T).
  const bool automatic = choice.kernel == Kernel::automatic;
  const bool large = p.tokens >= kRouterG8MinTokens;
  const bool g8 =
      route_g8_applies(config, p) && (choice.kernel == Kernel::g8 || (automatic && (large || sieve_pairs)));
  const bool g8_softmax =
      route_g8_softmax_applies(config, p) && (choice.kernel == Kernel::g8 || (automatic && large));
  EPMOE_CHECK(choice.trace == nullptr || (g8 && choice.sieve),
              "router trace: only the sieve kernel is traced (sigmoid, 8 groups of 32, T >= {} or pairs); "
              "this call takes another kernel",
              kRouterG8MinTokens);
  if (g8) {
    if (choice.sieve) {
      choice.rn_division ? launch_sieve<true>(p, staging, sieve_pairs, stream)
                         : launch_sieve<false>(p, staging, sieve_pairs, stream);
    } else {
      choice.rn_division ? launch_g8<&route_g8_kernel<true>>(p, stream)
                         : launch_g8<&route_g8_kernel<false>>(p, stream);
    }
  } else if (g8_softmax) {
    launch_softmax(p, staging, stream);
  } else if (sigmoid) {
    choice.rn_division ? launch_for<true, true>(layout.per_lane, p, stream)
                       : launch_for<true, false>(layout.per_lane, p, stream);
  } else {
    launch_for<false, false>(layout.per_lane, p, stream);
  }
}

std::size_t route_trace_words() {
  static_assert(kRouteTraceWordsPerWarp == kernels::kRouterTraceWords);
  return static_cast<std::size_t>(device_props().sm_count) * 64 * kRouteTraceWordsPerWarp;  // 64 warps per SM
}

RouteKernelChoice route_kernel_choice_from_env() {
  static const RouteKernelChoice choice = [] {
    RouteKernelChoice c;
    const char* g8 = std::getenv("EPMOE_ROUTER_G8");
    if (g8 != nullptr && std::string_view(g8) == "0") c.kernel = RouteKernelChoice::Kernel::general;
    const char* div = std::getenv("EPMOE_ROUTER_DIV");
    c.rn_division = div != nullptr && std::string_view(div) == "rn";
    const char* sieve = std::getenv("EPMOE_ROUTER_SIEVE");
    c.sieve = sieve == nullptr || std::string_view(sieve) != "0";
    if (const char* tma = std::getenv("EPMOE_ROUTER_TMA"); tma != nullptr)
      c.tma_stages = std::clamp(std::atoi(tma), 0, 2);
    if (const char* lanes = std::getenv("EPMOE_ROUTER_LANES"); lanes != nullptr)
      c.token_lanes = std::string_view(lanes) == "16" ? 16 : std::string_view(lanes) == "8" ? 8 : 0;
    return c;
  }();
  return choice;
}

void route(const MoeConfig& config, TensorView logits, TensorView correction_bias, TensorView topk_ids,
           TensorView topk_weights, cudaStream_t stream) {
  route(config, logits, correction_bias, topk_ids, topk_weights, stream, route_kernel_choice_from_env());
}

}  // namespace epmoe::cuda
