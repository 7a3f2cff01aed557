// The fused router kernel (device code; the host launcher is router_gpu.cu, API in
// epmoe/cuda/router.hpp).
//
// One warp per token, many tokens per block, a persistent grid striding over the tokens. Each lane
// holds kV consecutive experts of one group in registers:
//   G' = bit_ceil(G) groups of Lg = 32 / G' consecutive lanes; lane l is lane i = l % Lg of group
//   g = l / Lg and holds experts g*P + i*kV + j, j < kV, of those < g*P + P (P = E / G experts per
//   group; lanes of groups >= G hold nothing). Without groups, G = 1 and P = E.
// Experts increase with (lane, j), so "the lowest lane holding the maximum" is "the lowest expert
// index", the tie rule of route_cpu. For DeepSeek-V3 (E = 256, G = 8) that is lane l holding
// experts [8l, 8l + 8): two 16-byte loads per lane, a group on 4 lanes.
//
// Selections need no shared memory: values are compared through a 32-bit order-preserving key
// (order_key), the warp maximum of the lanes' best keys is one redux.sync, and the winner is the
// lowest lane of the ballot of lanes holding it. The winning lane drops its candidate and rescans
// its kV registers. Top-2 per group is a butterfly merge over the group's Lg lanes.
#pragma once

#include <cstdint>

#include "cuda/ptx_hopper.cuh"
#include "routing/router_math.hpp"

namespace epmoe::kernels {

// 4 warps (4 tokens at a time) per block: at small T (decode, T = 128) the tokens spread over
// 32 SMs with one warp per scheduler, which is what bounds the latency of one warp's token.
inline constexpr int kRouterThreads = 128;
inline constexpr int kRouterWarps = kRouterThreads / 32;
inline constexpr int kRouterMaxTopk = 32;  // lane k holds the k-th choice
inline constexpr int kRouterMaxGroups = 32;
inline constexpr int kRouterMaxPerLane = 16;

struct RouterParams {
  const float* logits;  // [T, E]
  const float* bias;    // [E] (sigmoid) or nullptr
  std::int32_t* ids;    // [T, K]
  float* weights;       // [T, K]
  std::uint32_t tokens;
  int num_experts;
  int topk;
  int num_groups;         // G (1 when groups are not used)
  int topk_groups;        // groups kept (== num_groups when groups are not used)
  int experts_per_group;  // P = E / G
  int lane_shift;         // log2(Lg), Lg = 32 / bit_ceil(G) lanes per group
  bool grouped;           // select groups first (G > 1 and topk_groups < G)
  bool vector_loads;      // lane l holds experts [l*kV, l*kV + kV), 16-byte aligned rows (kV >= 4)
  bool renormalize;
  float scaling;  // routed_scaling_factor
  // RouteKernelChoice::trace: kRouterTraceWords per warp of the grid (the sieve kernel's kTrace
  // instances only; nullptr otherwise).
  std::uint64_t* trace;
};

// Phase stamps of the sieve kernel (RouteKernelChoice::trace; compiled into the kTrace instances
// only): for the first unit of each warp, lane 0 writes its record
//   [0] SM id, [1] globaltimer at entry (ns), [2 + i] clock64 at phase i, [2 + kRouterTracePhases]
//   globaltimer at the end of the unit, [3 + kRouterTracePhases] clock64 when the warp leaves (after its
//   last unit; 0 for a warp without one),
// phases 0 entry, 1 prologue done (bias, barriers), 2 the unit's logits in shared memory (the TMA
// wait), 3 approximations and group top-2, 4 kept groups (the exact group step included), 5 the
// candidate masks and warp prefix, 6 the spread's item list written, 7 the spread (exact sigmoids and
// keys), 8 the ranks' own keys read, 9 the rank loop, 10 ranked (slots written), 11 weights and
// outputs stored (8 and 9 are stamped at 7's time where the ranks take another path). Warps without
// a unit leave phases 2.. as the caller filled them.
inline constexpr int kRouterTracePhases = 12;
inline constexpr int kRouterTraceWords = kRouterTracePhases + 4;
template <bool kOn>
struct RouterStamps {
  std::uint64_t* record = nullptr;  // this warp's record while its first unit runs
  __device__ void at(int phase) const {
    if constexpr (kOn) {
      if (record != nullptr && threadIdx.x % 32 == 0) record[2 + phase] = ptx::clock_ordered();
    }
  }
};

// An unsigned key ordered like the float values (-0 taken as +0, as the f32 comparison does; NaN
// ends up somewhere, but never at 0). 0 is below every key of a non-NaN float: "no candidate".
__device__ __forceinline__ std::uint32_t order_key(float v) {
  std::uint32_t u = __float_as_uint(v);
  u = u == 0x80000000u ? 0u : u;
  return (u & 0x80000000u) != 0u ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_to_float(std::uint32_t key) {
  return __uint_as_float((key & 0x80000000u) != 0u ? (key & 0x7fffffffu) : ~key);
}

// The kV values of one lane, from its slot 0 at `p`; 0 in slots that hold no expert. With
// `vector`, 16-byte loads (every slot of a used lane valid, p 16-byte aligned).
template <int kV>
__device__ __forceinline__ void load_values(const float* p, bool vector, bool lane_used,
                                            const bool (&valid)[kV], float (&out)[kV]) {
#pragma unroll
  for (int j = 0; j < kV; ++j) out[j] = 0.0f;
  if constexpr (kV >= 4) {
    if (vector) {
      if (lane_used) {
#pragma unroll
        for (int j = 0; j < kV; j += 4) {
          const float4 v = __ldg(reinterpret_cast<const float4*>(p + j));
          out[j] = v.x, out[j + 1] = v.y, out[j + 2] = v.z, out[j + 3] = v.w;
        }
      }
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < kV; ++j)
    if (valid[j]) out[j] = __ldg(p + j);
}

template <int kV, bool kSigmoid, bool kRnDiv>
__global__ void __launch_bounds__(kRouterThreads) route_kernel(const RouterParams p) {
  static_assert(kV >= 1 && kV <= kRouterMaxPerLane && (kV & (kV - 1)) == 0);
  using namespace routing;
  constexpr unsigned kFull = 0xffffffffu;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int group = lane >> p.lane_shift;
  const int first = (lane & ((1 << p.lane_shift) - 1)) * kV;  // slot 0's index inside the group
  const int base = group * p.experts_per_group + first;       // slot 0's expert
  const bool lane_used = group < p.num_groups;
  bool valid[kV];
#pragma unroll
  for (int j = 0; j < kV; ++j) valid[j] = lane_used && first + j < p.experts_per_group;

  float bias[kV];
  if constexpr (kSigmoid) {
    load_values<kV>(p.bias + base, p.vector_loads, lane_used, valid, bias);
  } else {
#pragma unroll
    for (int j = 0; j < kV; ++j) bias[j] = 0.0f;
  }

  const std::uint32_t num_warps = gridDim.x * kRouterWarps;
  for (std::uint32_t t = (blockIdx.x * kRouterThreads + threadIdx.x) / 32; t < p.tokens; t += num_warps) {
    // ---- logits
    const float* row = p.logits + static_cast<std::uint64_t>(t) * static_cast<std::uint32_t>(p.num_experts);
    float x[kV];
    load_values<kV>(row + base, p.vector_loads, lane_used, valid, x);

    // ---- scores (the weights come from these) and selection values
    float score[kV], choice[kV];
    if constexpr (kSigmoid) {
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        score[j] = sigmoid_f32_gpu<kRnDiv>(x[j]);
        choice[j] = rn_add(score[j], bias[j]);
      }
    } else {
      std::uint32_t max_key = 0;
#pragma unroll
      for (int j = 0; j < kV; ++j)
        if (valid[j]) max_key = max(max_key, order_key(x[j]));
      const float max_logit = key_to_float(__reduce_max_sync(kFull, max_key));
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        score[j] = valid[j] ? expf(x[j] - max_logit) : 0.0f;
        sum += score[j];
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(kFull, sum, offset);
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        score[j] = rn_div(score[j], sum);
        choice[j] = score[j];
      }
    }

    // ---- groups: score each (sigmoid: sum of its top-2 selection values, a tie counting twice;
    // softmax: its maximum), keep the best topk_groups
    bool kept = lane_used;
    if (p.grouped) {
      const float kNegInf = __int_as_float(static_cast<int>(0xff800000u));
      float top1 = kNegInf, top2 = kNegInf;
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        if (!valid[j]) continue;
        const float v = choice[j];
        if (v > top1) {
          top2 = top1;
          top1 = v;
        } else if (v > top2) {
          top2 = v;
        }
      }
      // Top-2 of the union of the group's lanes: exact (values only, no arithmetic).
      for (int offset = 1; offset < (1 << p.lane_shift); offset *= 2) {
        const float o1 = __shfl_xor_sync(kFull, top1, offset);
        const float o2 = __shfl_xor_sync(kFull, top2, offset);
        const float second = top1 >= o1 ? fmaxf(top2, o1) : fmaxf(top1, o2);
        top1 = fmaxf(top1, o1);
        top2 = second;
      }
      const float group_score = kSigmoid ? rn_add(top1, top2) : top1;
      std::uint32_t key = lane_used && first == 0 ? order_key(group_score) : 0u;  // one lane per group
      std::uint32_t kept_groups = 0;
      for (int r = 0; r < p.topk_groups; ++r) {
        const std::uint32_t best = __reduce_max_sync(kFull, key);
        const int winner = __ffs(__ballot_sync(kFull, key == best)) - 1;
        kept_groups |= 1u << (winner >> p.lane_shift);
        if (lane == winner) key = 0u;
      }
      kept = lane_used && ((kept_groups >> group) & 1u) != 0u;
    }

    // ---- experts: top-K of the kept groups, in order
    std::uint32_t key[kV];
#pragma unroll
    for (int j = 0; j < kV; ++j) key[j] = kept && valid[j] ? order_key(choice[j]) : 0u;
    std::uint32_t best_key = 0;
    int best_j = 0;
    float best_score = 0.0f;
    auto rescan = [&] {
      best_key = 0;
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        if (key[j] > best_key) {  // strict: the lowest j among equal keys
          best_key = key[j];
          best_j = j;
          best_score = score[j];
        }
      }
    };
    rescan();
    float sum = 0.0f;  // the chosen unbiased scores, in selection order
    int my_id = 0;
    float my_score = 0.0f;
    for (int k = 0; k < p.topk; ++k) {
      const std::uint32_t best = __reduce_max_sync(kFull, best_key);
      const int winner = __ffs(__ballot_sync(kFull, best_key == best)) - 1;
      const int id = __shfl_sync(kFull, base + best_j, winner);
      const float s = __shfl_sync(kFull, best_score, winner);
      sum = rn_add(sum, s);
      if (lane == k) {
        my_id = id;
        my_score = s;
      }
      if (lane == winner) {
#pragma unroll
        for (int j = 0; j < kV; ++j)
          if (j == best_j) key[j] = 0u;
        rescan();
      }
    }

    // ---- weights, as route_cpu: score / sum (1/K each when the sum is 0), times s
    if (lane < p.topk) {
      float w = my_score;
      if (p.renormalize) w = sum > 0.0f ? rn_div(w, sum) : rn_div(1.0f, static_cast<float>(p.topk));
      const std::uint64_t out = static_cast<std::uint64_t>(t) * static_cast<std::uint32_t>(p.topk) + lane;
      p.ids[out] = my_id;
      p.weights[out] = rn_mul(w, p.scaling);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// DeepSeek-V3 shape, sigmoid noaux_tc: E = 256 in G = 8 groups of 32, K <= 8, kg <= 4 groups kept
// with 2 * kg >= K (route_g8_eligible in router_gpu.cu). Bit-exact with route_cpu like the kernel
// above, in ~350 instead of ~1300 warp-instructions per token (counted on the PTX):
//  - 8 lanes per token, 4 tokens (a quad) per warp; lane (tw, g) = (lane / 8, lane % 8) holds group
//    g of token tw: 32 experts, so the group top-2 is in-lane (3 min/max per value, no shuffles).
//  - The warp's 4 rows (4 KB, contiguous) are loaded with coalesced 16-byte loads into shared
//    memory and read back a group per lane; chunk c (16 bytes) of row r sits at chunk c ^ (r % 8)
//    so that both the stores and the reads are free of bank conflicts. The sigmoid scores replace
//    the logits there (the weights of the chosen experts are read back from them).
//  - sigmoid_f32_gpu: sigmoid_f32's bits, without a branch by default (div_rn_sigmoid), so that
//    a lane's 32 sigmoids can interleave.
//  - Groups: each lane's rank among its token's 8 group scores (8 shuffles), kept iff < kg.
//  - Experts, without selection rounds: every top-K expert of the kept groups has a selection value
//    >= tau = min over kept groups of their second-largest value (those 2 * kg >= K values belong
//    to distinct experts). The experts >= tau (C of them, ~11 for random data) are compacted into
//    a per-token list of 64-bit keys (order_key(value), ~id) (higher key = earlier in route_cpu's
//    order: higher value, then lower index); each one's rank is the number of larger keys in the
//    list; ranks < K go to their output slot. The list holds kRouterG8Candidates per token; a quad
//    with a longer one (ties: C is up to 128 for a row of equal values) runs K selection rounds
//    over its candidates instead (the maximum key of the token's 8 lanes per round).
//  - Occupancy: 8 blocks of 4 warps per SM (25.75 KB of shared memory and <= 64 registers each),
//    so that 132 SMs hold 4224 quads: T = 16384 in one round. Each warp's first quad's logits are in
//    flight with the block's bias load. (Loading the next quad into registers while this one is
//    ranked makes the 32 logits live across the loop and spills at 64 registers.)
inline constexpr int kRouterG8Warps = 4;
inline constexpr int kRouterG8Threads = kRouterG8Warps * 32;
inline constexpr int kRouterG8Candidates = 64;
// +2 entries: the 4 tokens' lists start 4 banks apart (the rank loop reads one key per token).
inline constexpr int kRouterG8ListStride = kRouterG8Candidates + 2;
inline constexpr int kRouterG8MinBlocks = 8;
// The sieve's candidates listed per warp for the spread (sieve_route_quad); a warp with more (ties)
// finds each item's lane by a binary search instead. 1 KB per block: 8 blocks still fit an SM.
inline constexpr int kRouterG8SpreadItems = 128;

// A candidate's 64-bit key: higher = earlier in route_cpu's order (higher value, then lower id).
__device__ __forceinline__ std::uint64_t g8_key(float value, int id) {
  return (static_cast<std::uint64_t>(order_key(value)) << 32) | ~static_cast<std::uint32_t>(id);
}

// count + (key > a), given not_a = ~a: the carry out of key + ~a (= key - a - 1 + 2^64) is 1 exactly
// when key > a. Three integer adds with carry, where the compiler's 64-bit compare and select took four.
__device__ __forceinline__ int add_if_above(int count, std::uint64_t key, std::uint64_t not_a) {
  return ptx::add_carry_out(count, key, not_a);
}

// count + (key > a) on 32-bit keys, given not_a = ~a: the carry out of key + ~a (two instructions).
__device__ __forceinline__ int add_if_above32(int count, std::uint32_t key, std::uint32_t not_a) {
  return ptx::add_carry_out(count, key, not_a);
}

// The two largest of a lane's N values (a tie counting twice), larger first; NaN is skipped (fmaxf /
// fminf) unless every value is NaN.
struct G8Top2 {
  float first, second;
};
template <int N>
__device__ __forceinline__ G8Top2 g8_top2(const float (&v)[N]) {
  float t1 = fmaxf(v[0], v[1]), t2 = fminf(v[0], v[1]);
#pragma unroll
  for (int j = 2; j < N; ++j) {
    t2 = fmaxf(t2, fminf(t1, v[j]));
    t1 = fmaxf(t1, v[j]);
  }
  return {t1, t2};
}

// A warp's place in the g8 kernels: a unit of tokens at a time, kTokenLanes lanes per token, the grid's
// warps striding over the units. kTokenLanes = 8 (a quad of 4 tokens per warp): lane g of a token
// holds its group g of 32 experts (softmax: experts [32 g, 32 g + 32)). kTokenLanes = 16 (a pair of 2
// tokens per warp; the sieve kernel, v9): lanes 2g and 2g + 1 of a token hold the lower and upper 16
// experts of group g, so that each lane's chain (its values' sigmoids, top-2, candidate bits) is half
// as long at the same work per token.
template <int kTokenLanes = 8>
struct G8Warp {
  static_assert(kTokenLanes == 8 || kTokenLanes == 16);
  static constexpr int kTokens = 32 / kTokenLanes;     // tokens per unit (per warp at a time)
  static constexpr int kGroupLanes = kTokenLanes / 8;  // lanes per group
  static constexpr int kPerLane = 32 / kGroupLanes;    // values per lane
  static constexpr std::uint32_t kTokenMask = (1ull << kTokenLanes) - 1;  // a token's lanes from `first`
  int warp, lane;
  int tw;                     // token of the unit
  int li;                     // lane of the token (0 .. kTokenLanes - 1)
  int g;                      // group
  int h;                      // half of the group (kTokenLanes = 16), else 0
  int row;                    // the stage row of this lane's group: tw * 8 + g
  int first;                  // lane of the token's group 0
  std::uint32_t units, step;  // units of the call; units between a warp's consecutive ones
  __device__ explicit G8Warp(std::uint32_t tokens)
      : warp(static_cast<int>(threadIdx.x / 32)),
        lane(static_cast<int>(threadIdx.x % 32)),
        tw(lane / kTokenLanes),
        li(lane % kTokenLanes),
        g(li / kGroupLanes),
        h(li % kGroupLanes),
        row(lane / kGroupLanes),
        first(lane & ~(kTokenLanes - 1)),
        units((tokens + kTokens - 1u) / kTokens),
        step(gridDim.x * kRouterG8Warps) {}
  __device__ static std::uint32_t first_unit(int warp) {
    return blockIdx.x * kRouterG8Warps + static_cast<std::uint32_t>(warp);
  }
  // Place of expert j (of a group's 32) in its stage row: chunk j / 4 of row r at chunk (j / 4) ^ (r % 8),
  // and r % 8 is the group.
  __device__ static int place_in_row(int j, int group) { return (((j >> 2) ^ group) << 2) | (j & 3); }
  // This lane's value jj as an expert of its group.
  __device__ int expert_in_group(int jj) const { return h * kPerLane + jj; }
};

// This lane's two largest values (t1 >= t2) merged with those of the partner lane `xor_mask` (a tie
// counting twice): exact on values, so both lanes end with the top-2 of the union of their values.
__device__ __forceinline__ void merge_top2(float& t1, float& t2, int xor_mask) {
  const float o1 = __shfl_xor_sync(0xffffffffu, t1, xor_mask);
  const float o2 = __shfl_xor_sync(0xffffffffu, t2, xor_mask);
  const float second = t1 >= o1 ? fmaxf(t2, o1) : fmaxf(t1, o2);
  t1 = fmaxf(t1, o1);
  t2 = second;
}

// The end of the g8 kernels, the same steps in all: from a token's candidates (`mask`: this lane's
// values whose key can be among the top K, bit jj for value jj) to the ranked top K (S) and the outputs
// of token u * kTokens + tw of unit u. Sigmoid: Xf holds the candidates' exact sigmoid, Bf the bias, the
// selection value is their sum and the weight the sigmoid. Softmax (kSoftmax): Xf holds the logits,
// which are the selection values (softmax is increasing), Bf is unused, and the weight is
// exp(x - max) over the chosen experts' sum (renormalised) or over `softmax_sum`, the token's sum of
// exp(x - max). L and S are the token's candidate list and slots; the token's lanes are w.first ..
// w.first + kTokenLanes - 1. With kListBuilt the caller has written the token's `built_total`
// candidate keys into L already (unless some token of the warp has more than kRouterG8Candidates:
// then the rounds run).
template <bool kSoftmax, bool kListBuilt = false, int kTokenLanes = 8, typename Stamps = RouterStamps<false>>
__device__ __forceinline__ void g8_select_and_store(const RouterParams& p, const G8Warp<kTokenLanes>& w,
                                                    std::uint32_t mask, const float* Xf, const float* Bf,
                                                    std::uint64_t* L, std::uint32_t* S, std::uint32_t u,
                                                    float softmax_sum = 0.0f, int built_total = 0,
                                                    const Stamps& stamps = {}) {
  using namespace routing;
  using Warp = G8Warp<kTokenLanes>;
  constexpr unsigned kFull = 0xffffffffu;
  const int li = w.li, g = w.g, first = w.first, row = w.row;
  const auto value_at = [&](int at) {
    if constexpr (kSoftmax) {
      return Xf[row * 32 + at];
    } else {
      return rn_add(Xf[row * 32 + at], Bf[g * 32 + at]);
    }
  };
  int total = built_total;
  int end = 0;  // inclusive prefix of the candidate counts over the token's lanes
  if constexpr (!kListBuilt) {
    end = __popc(mask);
#pragma unroll
    for (int o = 1; o < kTokenLanes; o *= 2) {
      const int y = __shfl_up_sync(kFull, end, o);
      if (li >= o) end += y;
    }
    total = __shfl_sync(kFull, end, first | (kTokenLanes - 1));
  }
  stamps.at(8);
  stamps.at(9);
  if (!__any_sync(kFull, total > kRouterG8Candidates)) {
    if constexpr (!kListBuilt) {
      int pos = end - __popc(mask);
      for (std::uint32_t m = mask; m != 0u; m &= m - 1u) {
        const int j = w.expert_in_group(__ffs(static_cast<int>(m)) - 1);
        L[pos++] = g8_key(value_at(Warp::place_in_row(j, g)), g * 32 + j);
      }
      __syncwarp();
    }

    // ---- rank of each candidate = number of larger keys. Lists of at most 16 in every token of the
    // warp (random rows: ~11): lane li ranks candidates li and (with 8 lanes per token) li + 8 by the
    // keys' high words (the values) alone, 1.5 instructions per comparison where the 64-bit keys take
    // 2.5. That is the keys' order unless two candidates share a value, which the ranks' sum tells:
    // distinct ranks are 0 .. total - 1 and sum to total (total - 1) / 2, while tied candidates share
    // the lowest of their ranks (a smaller sum). Ties and longer lists: the 64-bit keys.
    bool ranked = false;
    if (!__any_sync(kFull, total > 16)) {
      const bool has_a = li < total, has_b = kTokenLanes == 8 && li + 8 < total;
      const std::uint64_t a = has_a ? L[li] : 0ull, b = has_b ? L[li + 8] : 0ull;
      const std::uint32_t not_a = ~static_cast<std::uint32_t>(a >> 32),
                          not_b = ~static_cast<std::uint32_t>(b >> 32);
      stamps.at(8);
      int rank_a = 0, rank_b = 0;
#pragma unroll 4
      for (int k = 0; k < total; ++k) {
        const std::uint32_t key = static_cast<std::uint32_t>(L[k] >> 32);
        rank_a = add_if_above32(rank_a, key, not_a);
        if constexpr (kTokenLanes == 8) rank_b = add_if_above32(rank_b, key, not_b);
      }
      stamps.at(9);
      int rank_sum = (has_a ? rank_a : 0) + (has_b ? rank_b : 0);
#pragma unroll
      for (int o = 1; o < kTokenLanes; o *= 2) rank_sum += __shfl_xor_sync(kFull, rank_sum, o);
      ranked = __all_sync(kFull, 2 * rank_sum == total * (total - 1));
      if (ranked) {
        if (has_a && rank_a < p.topk) S[rank_a] = ~static_cast<std::uint32_t>(a);
        if (has_b && rank_b < p.topk) S[rank_b] = ~static_cast<std::uint32_t>(b);
      }
    }
    for (int i = li; !ranked && i < total; i += 2 * kTokenLanes) {
      const std::uint64_t a = L[i];
      const bool has_b = i + kTokenLanes < total;
      const std::uint64_t b = has_b ? L[i + kTokenLanes] : ~0ull;
      const std::uint64_t not_a = ~a, not_b = ~b;
      int rank_a = 0, rank_b = 0;
#pragma unroll 4
      for (int k = 0; k < total; ++k) {
        const std::uint64_t key = L[k];
        rank_a = add_if_above(rank_a, key, not_a);
        rank_b = add_if_above(rank_b, key, not_b);
      }
      if (rank_a < p.topk) S[rank_a] = ~static_cast<std::uint32_t>(a);
      if (has_b && rank_b < p.topk) S[rank_b] = ~static_cast<std::uint32_t>(b);
    }
  } else {
    // ---- a list past kRouterG8Candidates in the warp (ties): K rounds, each the largest key
    // (value, ~id) left among the token's candidates
    for (int k = 0; k < p.topk; ++k) {
      std::uint64_t best = 0;
      for (std::uint32_t m = mask; m != 0u; m &= m - 1u) {
        const int j = w.expert_in_group(__ffs(static_cast<int>(m)) - 1);
        const std::uint64_t key = g8_key(value_at(Warp::place_in_row(j, g)), g * 32 + j);
        best = key > best ? key : best;
      }
      std::uint64_t top = best;
#pragma unroll
      for (int o = 1; o < kTokenLanes; o *= 2) {
        const std::uint64_t other = __shfl_xor_sync(kFull, top, o);
        top = other > top ? other : top;
      }
      const std::uint32_t id = ~static_cast<std::uint32_t>(top);
      // Keys are distinct: the lane that holds the winner drops it.
      if (best == top) mask &= ~(1u << ((id & 31u) - static_cast<std::uint32_t>(w.h * Warp::kPerLane)));
      if (li == 0) S[k] = id;
    }
  }
  __syncwarp();
  stamps.at(10);

  // ---- weights, as route_cpu: lane li writes choice li of its token
  int id = 0;
  float score = 0.0f;
  if (li < p.topk) {
    id = static_cast<int>(S[li]);
    const int group = id >> 5;
    score = Xf[(w.tw * 8 + group) * 32 + Warp::place_in_row(id & 31, group)];
  }
  if constexpr (kSoftmax) {  // choice 0 (lane first) holds the largest logit
    score = expf(__fsub_rn(score, __shfl_sync(kFull, score, first)));
  }
  float sum = 0.0f;  // in selection order
  for (int k = 0; k < p.topk; ++k) sum = rn_add(sum, __shfl_sync(kFull, score, first | k));
  const std::uint32_t t = u * static_cast<std::uint32_t>(Warp::kTokens) + static_cast<std::uint32_t>(w.tw);
  if (li < p.topk && t < p.tokens) {
    float wt = score;
    if (p.renormalize) {
      wt = sum > 0.0f ? rn_div(wt, sum) : rn_div(1.0f, static_cast<float>(p.topk));
    } else if constexpr (kSoftmax) {
      wt = rn_div(wt, softmax_sum);
    }
    const std::uint64_t out = static_cast<std::uint64_t>(t) * static_cast<std::uint32_t>(p.topk) + li;
    p.ids[out] = id;
    p.weights[out] = rn_mul(wt, p.scaling);
  }
  __syncwarp();  // before the next unit overwrites stage, cand and slot
}

// Quad q's logits (rows q*4 .. q*4+3, 4 KB, contiguous) into the warp's stage X with coalesced
// 16-byte loads: chunk c of row r at X[r * 8 + (c ^ (r % 8))]; zeros for rows at or past `tokens`.
// A whole quad (every quad but perhaps the last) takes the branch with 8 plain loads at fixed offsets
// from one address: per-row predicates on each load cost ~150 address instructions per quad (SASS).
__device__ __forceinline__ void stage_quad(float4* X, const float* logits, std::uint32_t tokens,
                                           std::uint32_t q, int lane) {
  const std::uint32_t t0 = q * 4u;
  const float4* const src =
      reinterpret_cast<const float4*>(logits) + static_cast<std::uint64_t>(t0) * 64u + lane;
  float4 v[8];
  if (t0 + 4u <= tokens) {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __ldg(src + i * 32);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      v[i] = t0 + static_cast<std::uint32_t>(i / 2) < tokens ? __ldg(src + i * 32)
                                                             : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int r = i * 4 + (lane >> 3);
    X[r * 8 + ((lane & 7) ^ (r & 7))] = v[i];
  }
}

template <bool kRnDiv>
__global__ void __launch_bounds__(kRouterG8Threads, kRouterG8MinBlocks)
    route_g8_kernel(const RouterParams p) {
  using namespace routing;
  constexpr unsigned kFull = 0xffffffffu;
  __shared__ float4 bias_s[64];                  // [group][chunk ^ group]
  __shared__ float4 stage[kRouterG8Warps][256];  // per warp: [token * 8 + group][chunk ^ group]
  __shared__ std::uint64_t cand[kRouterG8Warps][4][kRouterG8ListStride];
  __shared__ std::uint32_t slot[kRouterG8Warps][4][8];

  const G8Warp<8> w(p.tokens);
  const int warp = w.warp, lane = w.lane, tw = w.tw, g = w.g, first = w.first, row = w.row;
  const std::uint32_t quads = w.units, step = w.step;
  std::uint32_t q = G8Warp<8>::first_unit(warp);
  float4* const X = stage[warp];
  const float* const Xf = reinterpret_cast<const float*>(X);
  const float* const Bf = reinterpret_cast<const float*>(bias_s);
  std::uint64_t* const L = cand[warp][tw];
  std::uint32_t* const S = slot[warp][tw];

  float4 b0 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (threadIdx.x < 64) b0 = __ldg(reinterpret_cast<const float4*>(p.bias) + threadIdx.x);
  if (q < quads) stage_quad(X, p.logits, p.tokens, q, lane);
  if (threadIdx.x < 64) {
    const int g8 = static_cast<int>(threadIdx.x) >> 3, c = static_cast<int>(threadIdx.x) & 7;
    bias_s[g8 * 8 + (c ^ g8)] = b0;
  }
  __syncthreads();

  // The next quad's logits are staged at the end of the loop body rather than at the start of the
  // next iteration (the same operations in the same order): ptxas then fits route_g8_kernel<false>
  // in 64 registers without its 4-byte spill.
  while (q < quads) {
    __syncwarp();

    // ---- scores (back into shared memory) and selection values (registers)
    float ch[32];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      const float4 x = X[row * 8 + (c ^ g)];
      const float4 b = bias_s[g * 8 + (c ^ g)];
      float4 s;
      s.x = sigmoid_f32_gpu<kRnDiv>(x.x);
      s.y = sigmoid_f32_gpu<kRnDiv>(x.y);
      s.z = sigmoid_f32_gpu<kRnDiv>(x.z);
      s.w = sigmoid_f32_gpu<kRnDiv>(x.w);
      X[row * 8 + (c ^ g)] = s;
      ch[4 * c] = rn_add(s.x, b.x);
      ch[4 * c + 1] = rn_add(s.y, b.y);
      ch[4 * c + 2] = rn_add(s.z, b.z);
      ch[4 * c + 3] = rn_add(s.w, b.w);
    }

    // ---- group score: sum of the two largest (a tie counting twice), as route_cpu. The values
    // are never -0 (a score is >= +0 and s + b rounds to +0, not -0, when it is 0).
    const auto [t1, t2] = g8_top2(ch);
    const std::uint32_t gkey = order_key(rn_add(t1, t2));
    int above = 0;  // groups ahead of this one: higher score, or equal and lower index
#pragma unroll
    for (int h = 0; h < 8; ++h) {
      const std::uint32_t k = __shfl_sync(kFull, gkey, first | h);
      above += (k > gkey || (k == gkey && h < g)) ? 1 : 0;
    }
    const bool kept = above < p.topk_groups;

    // ---- candidates: the kept groups' experts >= tau (NaN included: never fewer than K of them)
    float tau = kept ? t2 : __int_as_float(0x7f800000);
#pragma unroll
    for (int o = 1; o < 8; o *= 2) tau = fminf(tau, __shfl_xor_sync(kFull, tau, o));
    std::uint32_t mask = 0;
#pragma unroll
    for (int j = 0; j < 32; ++j) mask |= ch[j] < tau ? 0u : 1u << j;
    if (!kept) mask = 0;

    g8_select_and_store<false>(p, w, mask, Xf, Bf, L, S, q);
    q += step;
    if (q < quads) stage_quad(X, p.logits, p.tokens, q, lane);
  }
}

// ---------------------------------------------------------------------------------------------
// route_g8_kernel with a sieve (v5): the same shape, occupancy (8 blocks of 4 warps per SM, one round
// at T = 16384), staging and ranking, the same outputs bit for bit, but the exact sigmoid (~26
// instructions) only for the experts whose exact value can decide something (~10 of a token's 256 on
// random logits); every expert first gets sigmoid_approx (5 instructions, MUFU ex2 and rcp) with the
// proven bound routing::kSieveApproxErr. The argument (margins: routing::sieve_margin):
//  - With the bias, every approximate selection value ca is within delta of the exact c, and a
//    group's approximate score rn(a1 + a2) within M of the exact rn(t1 + t2) (a1, a2: the group's
//    approximate top-2; t1, t2: the exact one).
//  - Kept groups: a group is surely ahead of another when its approximate score is more than 2M
//    higher (then its exact score is strictly higher). A lane knows its group is kept when fewer than
//    kg groups may be ahead of it, and dropped when at least kg surely are. Otherwise (near-ties, ~0.4%
//    of random tokens; every tie of group scores) the token's 8 lanes compute the exact group scores
//    as route_g8_kernel does, from the experts with ca >= a2 - M only: any other expert is exactly
//    below both of the group's approximate top-2 experts, so not in the exact top-2.
//  - Candidates: route_g8_kernel's list is the kept experts with c >= tau = min over kept groups of
//    t2. tau >= tau' - delta with tau' = min over kept groups of a2, so each has ca >= tau' - M: the
//    list here (kept experts with ca >= tau' - M, exact keys) holds all of them, plus perhaps a few
//    with c < tau, whose keys are below every one of the exact list's >= 2 kg >= K keys, so they
//    rank >= K and the ranks < K are those of route_g8_kernel. A longer list can reach the rounds
//    path (more than kRouterG8Candidates in a token) where route_g8_kernel would not; the rounds
//    select the same K.
//  - The candidates' exact sigmoids and keys (all of the warp's 4 tokens; the group step's exact
//    values are reused) are spread over the 32 lanes, about 1.3 items per lane, rather than each
//    lane looping over its own (up to 32 when values tie): item i goes to lane i % 32, which reads
//    the item (lane, expert, place in its token's list) from a per-warp list the lanes wrote (v8;
//    v6-v7, and v8 past 128 items: a binary search over the warp's prefix counts and the n-th set
//    bit of the owner's mask) and writes the key straight into its token's list.
//  - The margin comes from the block's bias load: threads 0..63 hold the bias, warps 0 and 1 reduce
//    the largest |b| as bits (NaN and inf compare above every finite |b|).
// Approximate values are finite whenever the bias is (sigmoid_approx is in [2^-126, 1] for every
// input, NaN included), and exactly kg groups are then kept, each with >= 2 candidates: K distinct
// ids in [0, E) for any logits.

// 1 / (1 + 2^(-x log2e)) with the MUFU ex2 and rcp approximations; the exponent is clamped to 126
// (NaN becomes 126 too: 2^-126 for NaN).
__device__ __forceinline__ float sigmoid_approx(float x) {
  const float u = fminf(__fmul_rn(x, -0x1.715476p+0f), 126.0f);
  return ptx::rcp_approx_ftz(__fadd_rn(1.0f, ptx::ex2_approx_ftz(u)));
}

// One unit (kTokenLanes = 8: a quad, 16: a pair) of route_g8_sieve_kernel: X holds its logits as
// stage_quad writes them (a token's 8 groups as rows of 32; the scores replace them there), cand the
// warp's candidate lists (one per token), S this lane's token's slots.
template <bool kRnDiv, int kTokenLanes, typename Stamps>
__device__ __forceinline__ void sieve_route_unit(const RouterParams& p, const G8Warp<kTokenLanes>& w,
                                                 float4* X, const float4* bias_s,
                                                 std::uint64_t (*cand)[kRouterG8ListStride], std::uint32_t* S,
                                                 std::uint16_t* items, float margin, float margin2,
                                                 std::uint32_t u, const Stamps& stamps) {
  using namespace routing;
  using Warp = G8Warp<kTokenLanes>;
  constexpr int kPerLane = Warp::kPerLane, kGroupLanes = Warp::kGroupLanes;
  constexpr unsigned kFull = 0xffffffffu;
  const float kInf = __int_as_float(0x7f800000);
  const int lane = w.lane, g = w.g, first = w.first, row = w.row;
  float* const Xf = reinterpret_cast<float*>(X);
  const float* const Bf = reinterpret_cast<const float*>(bias_s);
  std::uint64_t* const L = cand[w.tw];

  // ---- approximate selection values (registers) and their group top-2
  float ca[kPerLane];
#pragma unroll
  for (int c = 0; c < kPerLane / 4; ++c) {
    const int chunk = w.h * (kPerLane / 4) + c;
    const float4 x = X[row * 8 + (chunk ^ g)];
    const float4 b = bias_s[g * 8 + (chunk ^ g)];
    ca[4 * c] = __fadd_rn(sigmoid_approx(x.x), b.x);
    ca[4 * c + 1] = __fadd_rn(sigmoid_approx(x.y), b.y);
    ca[4 * c + 2] = __fadd_rn(sigmoid_approx(x.z), b.z);
    ca[4 * c + 3] = __fadd_rn(sigmoid_approx(x.w), b.w);
  }
  auto [a1, a2] = g8_top2(ca);
  if constexpr (kGroupLanes == 2) merge_top2(a1, a2, 1);
  stamps.at(3);

  // ---- kept groups: from the approximate scores where they are more than 2M apart
  const float ga = __fadd_rn(a1, a2);
  // The token's 7 other groups by xor shuffles (fixed lane masks, no index arithmetic; v8), one
  // difference each: rn(ga - o) = -rn(o - ga), so "not surely below" is !(rn(o - ga) < -2M).
  const float neg_margin2 = -margin2;
  int sure_above = 0, maybe_above = 0;
#pragma unroll
  for (int x = 1; x < 8; ++x) {
    const float d = __fsub_rn(__shfl_xor_sync(kFull, ga, x * kGroupLanes), ga);
    sure_above += d > margin2 ? 1 : 0;
    maybe_above += d < neg_margin2 ? 0 : 1;
  }
  bool kept = maybe_above < p.topk_groups;
  const bool known = kept || sure_above >= p.topk_groups;
  std::uint32_t done = 0;  // values of this lane already evaluated exactly (stage holds s there)
  const std::uint32_t unknown = __ballot_sync(kFull, !known);
  if (unknown != 0u) {  // warp-uniform (the shuffles below take every lane)
    // Exact group scores, as route_g8_kernel, for the tokens with a lane that does not know, from
    // the experts that may be among the exact top-2.
    const bool exact = ((unknown >> first) & Warp::kTokenMask) != 0u;
    const float thr = __fsub_rn(a2, margin);
    if (exact) {
#pragma unroll
      for (int jj = 0; jj < kPerLane; ++jj) done |= ca[jj] < thr ? 0u : 1u << jj;
    }
    float t1 = -kInf, t2 = -kInf;
    for (std::uint32_t m = done; m != 0u; m &= m - 1u) {
      const int j = w.expert_in_group(__ffs(static_cast<int>(m)) - 1);
      const int at = row * 32 + Warp::place_in_row(j, g);
      const float s = sigmoid_f32_gpu<kRnDiv>(Xf[at]);
      Xf[at] = s;
      const float c = rn_add(s, Bf[g * 32 + (at & 31)]);
      t2 = fmaxf(t2, fminf(t1, c));
      t1 = fmaxf(t1, c);
    }
    if constexpr (kGroupLanes == 2) merge_top2(t1, t2, 1);
    const std::uint32_t gkey = order_key(rn_add(t1, t2));
    int above = 0;  // groups ahead of this one: higher score, or equal and lower index
#pragma unroll
    for (int hg = 0; hg < 8; ++hg) {
      const std::uint32_t k = __shfl_sync(kFull, gkey, first | (hg * kGroupLanes));
      above += (k > gkey || (k == gkey && hg < g)) ? 1 : 0;
    }
    if (exact) kept = above < p.topk_groups;
    __syncwarp();  // the exact scores stored before other lanes read them (the spread loop below)
  }

  stamps.at(4);

  // ---- candidates: the kept groups' experts with ca >= tau' - M (a kept group's `done` experts,
  // ca >= a2 - M >= tau' - M, are among them)
  float tau = kept ? a2 : kInf;
#pragma unroll
  for (int o = kGroupLanes; o < kTokenLanes; o *= 2) tau = fminf(tau, __shfl_xor_sync(kFull, tau, o));
  const float thr = __fsub_rn(tau, margin);
  // Bit jj: ca[jj] >= thr, NaN included, i.e. the sign of rn(ca[jj] - thr) is 0: equal values give +0
  // (ca is never -0), ca < thr a negative difference (or -0, were it flushed to zero), and a NaN
  // operand the positive canonical NaN. Gathered one funnel shift per value in two independent chains
  // (v8; ~2.6 instructions per value as compare, select and add).
  constexpr int kHalf = kPerLane / 2;
  std::uint32_t below_hi = 0, below_lo = 0;
#pragma unroll
  for (int jj = kHalf - 1; jj >= 0; --jj) {
    below_hi = __funnelshift_l(__float_as_uint(__fsub_rn(ca[jj + kHalf], thr)), below_hi, 1);
    below_lo = __funnelshift_l(__float_as_uint(__fsub_rn(ca[jj], thr)), below_lo, 1);
  }
  constexpr std::uint32_t kLaneBits = static_cast<std::uint32_t>((1ull << kPerLane) - 1);
  const std::uint32_t mask = kept ? ~((below_hi << kHalf) | below_lo) & kLaneBits : 0u;

  // ---- the candidates' exact sigmoids and keys, spread over the warp: item i of the warp's
  // candidates (lane order, then bit order) is taken by lane i % 32.
  const int count = __popc(mask);
  int end = count;  // inclusive prefix over the warp
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int y = __shfl_up_sync(kFull, end, o);
    if (lane >= o) end += y;
  }
  const int before = end - count;
  const int warp_total = __shfl_sync(kFull, end, 31);
  const int token_start = __shfl_sync(kFull, before, first);
  const int token_total = __shfl_sync(kFull, end, first | (kTokenLanes - 1)) - token_start;
  const bool overflow = __any_sync(kFull, token_total > kRouterG8Candidates);  // then the rounds
  stamps.at(5);
  // Item (owner lane, its expert j of the group, the item's place in its token's list): the exact
  // sigmoid (unless the group step computed it) back into the stage, and the key into the token's list.
  const auto evaluate = [&](int owner, int j, int place, std::uint32_t owner_done) {
    const int orow = owner / kGroupLanes, og = orow & 7;
    const int at = Warp::place_in_row(j, og);
    float* const x = Xf + orow * 32 + at;
    float sig = *x;
    if (((owner_done >> (j % kPerLane)) & 1u) == 0u) {
      sig = sigmoid_f32_gpu<kRnDiv>(sig);
      *x = sig;
    }
    if (!overflow) cand[owner / kTokenLanes][place] = g8_key(rn_add(sig, Bf[og * 32 + at]), og * 32 + j);
  };
  if (warp_total <= kRouterG8SpreadItems) {  // warp-uniform; random rows: ~44 items
    // v8: each lane lists its own candidates as 16-bit items (lane << 11 | j << 6 | place), item i
    // at i = before + n for its n-th set bit (max over the lanes of their counts, ~5 rounds of a
    // short loop); lane i % 32 then reads item i. Before (v6, v7, and below for longer lists) every
    // item's lane came from a 5-shuffle binary search and its expert from an n-th-set-bit loop, a
    // dependent chain of ~200 cycles per round.
    int pos = before;
    for (std::uint32_t m = mask; m != 0u; m &= m - 1u, ++pos) {
      const int j = w.expert_in_group(__ffs(static_cast<int>(m)) - 1);
      items[pos] = static_cast<std::uint16_t>((lane << 11) | (j << 6) | ((pos - token_start) & 63));
    }
    __syncwarp();  // the items stored
    stamps.at(6);
    for (int base = 0; base < warp_total; base += 32) {  // warp-uniform trip count
      const int i = base + lane;
      const std::uint32_t item = i < warp_total ? items[i] : 0u;
      const int owner = static_cast<int>(item >> 11);
      const std::uint32_t owner_done = unknown != 0u ? __shfl_sync(kFull, done, owner) : 0u;
      if (i < warp_total)
        evaluate(owner, static_cast<int>(item >> 6) & 31, static_cast<int>(item & 63u), owner_done);
    }
  } else {
    stamps.at(6);
    for (int base = 0; base < warp_total; base += 32) {  // warp-uniform trip count
      const int i = base + lane;
      int owner = 0;
#pragma unroll
      for (int step_size = 16; step_size >= 1; step_size /= 2) {
        if (__shfl_sync(kFull, end, owner + step_size - 1) <= i) owner += step_size;
      }
      const std::uint32_t owner_mask = __shfl_sync(kFull, mask, owner);
      const std::uint32_t owner_done = __shfl_sync(kFull, done, owner);
      const int owner_before = __shfl_sync(kFull, before, owner);
      const int owner_start = __shfl_sync(kFull, token_start, owner);
      if (i < warp_total) {
        // Its (i - owner_before)-th set bit: a plain loop (__fns took ~45 instructions; the
        // compiler's unrolling by 4 with its remainder code ~30, v7's profile).
        std::uint32_t m = owner_mask;
#pragma unroll 1
        for (int n = i - owner_before; n > 0; --n) m &= m - 1u;
        const int jj = __ffs(static_cast<int>(m)) - 1;
        evaluate(owner, (owner % kGroupLanes) * kPerLane + jj, i - owner_start, owner_done);
      }
    }
  }
  __syncwarp();  // the scores and keys stored
  stamps.at(7);

  g8_select_and_store<false, true>(p, w, mask, Xf, Bf, L, S, u, 0.0f, token_total, stamps);
}

// Blocks per SM of a staged g8 kernel (route_g8_sieve_kernel, route_g8_softmax_kernel): 8 with 4 KB
// of stage buffers per warp (one quad, or two pairs; ~26 KB per block); 5 with 8 KB (two quads).
template <int kTmaStages, int kTokenLanes = 8>
inline constexpr int kRouterG8StagedMinBlocks = (kTmaStages >= 2 ? 2 : 1) * (32 / kTokenLanes) * 1024 > 4096
                                                    ? 5
                                                    : kRouterG8MinBlocks;

// The staged g8 kernels' unit loop, one per warp: stages each of the warp's units (kTokenLanes = 8:
// quads of 4 tokens, 16: pairs) into its buffer and hands it to the kernel's per-unit body.
// kTmaStages = 0 (quads only): each lane loads its part of the next quad (stage_quad) at the end of a
// quad, as route_g8_kernel. kTmaStages = 1 or 2 (v7): lane 0 loads whole units with one TMA copy each
// (the map: the logits as rows of 128 bytes, one token's group per row, box kRows rows = a unit,
// 128-byte swizzle, which is stage_quad's layout: chunk c of row r at r * 8 + (c ^ (r % 8)) when the
// buffer is 1024-byte aligned; rows past the tokens read as zeros), completing on the buffer's
// mbarrier. With 2 buffers the warp's next unit is in flight while it ranks this one; with 1 the copy
// is issued where stage_quad's loads were (fewer instructions).
template <int kTmaStages, int kTokenLanes = 8>
struct G8QuadPipe {
  static_assert(kTmaStages > 0 || kTokenLanes == 8, "per-lane staging (stage_quad) loads quads");
  static constexpr int kBuffers = kTmaStages > 0 ? kTmaStages : 1;
  static constexpr int kRows = 8 * (32 / kTokenLanes);  // a unit's groups (rows of 128 bytes)
  static constexpr std::uint32_t kUnitBytes = kRows * 128;
  // The block's buffers, 1024-byte aligned for the swizzle (a whole number of 1 KB units: nothing is
  // padded), and their barriers.
  struct Stage {
    alignas(1024) float4 unit[kRouterG8Warps][kBuffers][kRows * 8];  // [token * 8 + group][chunk ^ group]
  };
  using Barriers = std::uint64_t[kRouterG8Warps][kBuffers];  // TMA: the buffer's unit has landed
  const RouterParams& p;
  const CUtensorMap* map;
  const G8Warp<kTokenLanes>& w;
  float4 (*stage)[kRows * 8];  // this warp's buffers
  std::uint64_t* full;         // this warp's barriers
  std::uint32_t u;             // the warp's current unit

  __device__ G8QuadPipe(const RouterParams& params, const CUtensorMap* logits_map,
                        const G8Warp<kTokenLanes>& warp, Stage& stages, Barriers& barriers)
      : p(params),
        map(logits_map),
        w(warp),
        stage(stages.unit[warp.warp]),
        full(barriers[warp.warp]),
        u(G8Warp<kTokenLanes>::first_unit(warp.warp)) {}

  __device__ void load(int buffer, std::uint32_t unit) {  // lane 0, TMA stages only
    const std::uint32_t bar = ptx::smem_addr(&full[buffer]);
    ptx::mbar_arrive_expect_tx(bar, kUnitBytes);  // the whole box, zero-filled rows included
    ptx::tma_load_2d(ptx::smem_addr(stage[buffer]), map, bar, 0, static_cast<std::int32_t>(unit * kRows));
  }

  // The warp's first units on their way (before the block's own prologue, so that they overlap it).
  __device__ void start() {
    if constexpr (kTmaStages > 0) {
      if (w.lane == 0) {
        if ((ptx::smem_addr(stage) & 1023u) != 0u) __trap();  // the swizzle needs 1024-byte alignment
        for (int b = 0; b < kBuffers; ++b) ptx::mbar_init(ptx::smem_addr(&full[b]), 1);
        ptx::fence_barrier_init();
        for (int b = 0; b < kBuffers; ++b) {
          const std::uint32_t unit = u + static_cast<std::uint32_t>(b) * w.step;
          if (unit < w.units) load(b, unit);
        }
      }
      __syncwarp();  // the barriers initialised before the other lanes wait on them
    } else {
      if (u < w.units) stage_quad(stage[0], p.logits, p.tokens, u, w.lane);
    }
  }

  // body(X, u) for each of the warp's units, X its staged logits (the body may overwrite them).
  template <typename Body>
  __device__ void run(Body&& body) {
    for (std::uint32_t i = 0; u < w.units; ++i) {
      const int buffer = kTmaStages > 0 ? static_cast<int>(i % kBuffers) : 0;
      float4* const X = stage[buffer];
      if constexpr (kTmaStages > 0) {
        ptx::mbar_wait(ptx::smem_addr(&full[buffer]), (i / kBuffers) & 1u);
      } else {
        __syncwarp();
      }
      body(X, u);
      const std::uint32_t refill = u + kBuffers * w.step;  // the unit this buffer takes next (TMA)
      u += w.step;
      if constexpr (kTmaStages > 0) {
        // This lane's generic-proxy reads and writes of the buffer before the TMA copy overwrites it.
        ptx::fence_proxy_async_shared();
        __syncwarp();
        if (w.lane == 0 && refill < w.units) load(buffer, refill);
      } else {
        if (u < w.units) stage_quad(X, p.logits, p.tokens, u, w.lane);
      }
    }
  }
};

template <bool kRnDiv, int kTmaStages, int kTokenLanes = 8, bool kTrace = false>
__global__ void __launch_bounds__(kRouterG8Threads, kRouterG8StagedMinBlocks<kTmaStages, kTokenLanes>)
    route_g8_sieve_kernel(const RouterParams p, const __grid_constant__ CUtensorMap logits_map) {
  constexpr unsigned kFull = 0xffffffffu;
  using Pipe = G8QuadPipe<kTmaStages, kTokenLanes>;
  constexpr int kTokens = G8Warp<kTokenLanes>::kTokens;
  // One shared-memory object: every address is then one base plus an offset, and the base is the one
  // symbol ptxas materialises (S2R SR_CgaCtaId on sm_90), instead of one per array.
  struct Shared {
    typename Pipe::Stage pipe_stage;
    typename Pipe::Barriers pipe_full;
    float4 bias_s[64];  // [group][chunk ^ group]
    // Per warp: its tokens' candidate keys.
    std::uint64_t cand[kRouterG8Warps][kTokens][kRouterG8ListStride];
    std::uint32_t slot[kRouterG8Warps][kTokens][8];
    std::uint32_t bias_abs_max[2];  // bits of the largest |b| seen by warps 0 and 1
    std::uint16_t spread_items[kRouterG8Warps][kRouterG8SpreadItems];  // sieve_route_unit's items
  };
  __shared__ Shared sh;
  auto& pipe_stage = sh.pipe_stage;
  auto& pipe_full = sh.pipe_full;
  auto& bias_s = sh.bias_s;
  auto& cand = sh.cand;
  auto& slot = sh.slot;
  auto& bias_abs_max = sh.bias_abs_max;
  auto& spread_items = sh.spread_items;

  RouterStamps<kTrace> stamps;
  // This warp's trace record (kTrace): stamps.record while its first unit runs, this for its leave stamp.
  std::uint64_t* const trace_record =
      kTrace ? p.trace + (static_cast<std::uint64_t>(blockIdx.x) * kRouterG8Warps + threadIdx.x / 32) *
                             kRouterTraceWords
             : nullptr;
  if constexpr (kTrace) {
    stamps.record = trace_record;
    if (threadIdx.x % 32 == 0) {
      stamps.record[0] = ptx::sm_id();
      stamps.record[1] = ptx::global_timer_ns_ordered();
    }
    stamps.at(0);
  }
  const G8Warp<kTokenLanes> w(p.tokens);
  Pipe pipe(p, &logits_map, w, pipe_stage, pipe_full);
  float4 b0 = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (threadIdx.x < 64) b0 = __ldg(reinterpret_cast<const float4*>(p.bias) + threadIdx.x);
  pipe.start();
  if (threadIdx.x < 64) {  // warps 0 and 1, whole
    const int g8 = static_cast<int>(threadIdx.x) >> 3, c = static_cast<int>(threadIdx.x) & 7;
    bias_s[g8 * 8 + (c ^ g8)] = b0;
    const std::uint32_t m = max(max(__float_as_uint(fabsf(b0.x)), __float_as_uint(fabsf(b0.y))),
                                max(__float_as_uint(fabsf(b0.z)), __float_as_uint(fabsf(b0.w))));
    const std::uint32_t wm = __reduce_max_sync(kFull, m);
    if (w.lane == 0) bias_abs_max[w.warp] = wm;
  }
  __syncthreads();
  const float margin = routing::sieve_margin(__uint_as_float(max(bias_abs_max[0], bias_abs_max[1])));
  const float margin2 = __fmul_ru(2.0f, margin);
  stamps.at(1);
  pipe.run([&](float4* X, std::uint32_t u) {
    stamps.at(2);
    sieve_route_unit<kRnDiv>(p, w, X, bias_s, cand[w.warp], slot[w.warp][w.tw], spread_items[w.warp], margin,
                             margin2, u, stamps);
    stamps.at(11);
    if constexpr (kTrace) {
      if (stamps.record != nullptr && w.lane == 0)
        stamps.record[2 + kRouterTracePhases] = ptx::global_timer_ns_ordered();
      stamps.record = nullptr;  // the first unit only
    }
  });
  if constexpr (kTrace) {
    if (w.lane == 0 && stamps.record == nullptr) trace_record[3 + kRouterTracePhases] = ptx::clock_ordered();
  }
}

// ---------------------------------------------------------------------------------------------
// Softmax top-K over E = 256 experts without groups (Mixtral / Qwen style at DeepSeek-V3's width),
// K <= 8, in route_g8_kernel's shape: 8 lanes per token, 32 experts per lane, the same staging,
// occupancy, candidate list, ranking and rounds path (g8_select_and_store<true>). Softmax is
// increasing, so the experts are selected on the logits themselves (order: higher logit, then lower
// index, route_cpu's order on equal scores); no exp is needed before the selection.
//  - Candidates: tau = the K-th largest of the 16 values {top-1, top-2 of each lane} (a tie counting
//    twice). Those 16 are values of 16 distinct experts, so at least K experts are >= tau and the
//    top K all are: the candidates are the experts >= tau (NaN included; ~10 on random logits).
//    Without a K-th value (NaN everywhere) tau is -inf and every expert is a candidate.
//  - Weights: exp(x - max) of the chosen (expf; max = choice 0's logit), renormalised over them in
//    selection order, or, without renormalisation, over the token's sum of exp(x - max) (__expf, the
//    only pass over all 256 values after the loads). route_cpu divides by the full sum first and
//    then renormalises: the same value within a few ulp (tests: 1e-5 relative).
// One quad of route_g8_softmax_kernel: X holds its logits as stage_quad writes them, L and S this
// lane's token's candidate list and slots.
__device__ __forceinline__ void softmax_route_quad(const RouterParams& p, const G8Warp<8>& w, float4* X,
                                                   std::uint64_t* L, std::uint32_t* S, std::uint32_t q) {
  constexpr unsigned kFull = 0xffffffffu;
  const float kInf = __int_as_float(0x7f800000);
  const int g = w.g, first = w.first, row = w.row;
  const float* const Xf = reinterpret_cast<const float*>(X);
  float x[32];
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const float4 v = X[row * 8 + (c ^ g)];
    x[4 * c] = v.x;
    x[4 * c + 1] = v.y;
    x[4 * c + 2] = v.z;
    x[4 * c + 3] = v.w;
  }
  const auto [t1, t2] = g8_top2(x);

  // ---- tau: the K-th largest of the token's 16 lane top-2 values
  int above1 = 0, above2 = 0;  // of the 16 values, how many are >= t1, >= t2
#pragma unroll
  for (int h = 0; h < 8; ++h) {
    const float o1 = __shfl_sync(kFull, t1, first | h);
    const float o2 = __shfl_sync(kFull, t2, first | h);
    above1 += (o1 >= t1 ? 1 : 0) + (o2 >= t1 ? 1 : 0);
    above2 += (o1 >= t2 ? 1 : 0) + (o2 >= t2 ? 1 : 0);
  }
  float tau = above1 >= p.topk ? t1 : (above2 >= p.topk ? t2 : -kInf);
#pragma unroll
  for (int o = 1; o < 8; o *= 2) tau = fmaxf(tau, __shfl_xor_sync(kFull, tau, o));
  std::uint32_t mask = 0;
#pragma unroll
  for (int j = 0; j < 32; ++j) mask |= x[j] < tau ? 0u : 1u << j;

  float sum = 0.0f;  // the token's sum of exp(x - max), for weights without renormalisation
  if (!p.renormalize) {
    float m = t1;
#pragma unroll
    for (int o = 1; o < 8; o *= 2) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
#pragma unroll
    for (int j = 0; j < 32; ++j) sum += __expf(x[j] - m);
#pragma unroll
    for (int o = 1; o < 8; o *= 2) sum += __shfl_xor_sync(kFull, sum, o);
  }

  g8_select_and_store<true>(p, w, mask, Xf, nullptr, L, S, q, sum);
}

template <int kTmaStages>
__global__ void __launch_bounds__(kRouterG8Threads, kRouterG8StagedMinBlocks<kTmaStages>)
    route_g8_softmax_kernel(const RouterParams p, const __grid_constant__ CUtensorMap logits_map) {
  __shared__ typename G8QuadPipe<kTmaStages>::Stage pipe_stage;
  __shared__ typename G8QuadPipe<kTmaStages>::Barriers pipe_full;
  __shared__ std::uint64_t cand[kRouterG8Warps][4][kRouterG8ListStride];
  __shared__ std::uint32_t slot[kRouterG8Warps][4][8];

  const G8Warp<8> w(p.tokens);
  G8QuadPipe<kTmaStages> pipe(p, &logits_map, w, pipe_stage, pipe_full);
  pipe.start();
  pipe.run([&](float4* X, std::uint32_t q) {
    softmax_route_quad(p, w, X, cand[w.warp][w.tw], slot[w.warp][w.tw], q);
  });
}

}  // namespace epmoe::kernels
