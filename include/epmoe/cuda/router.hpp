// The router on the GPU (design.md §5): logits -> top-k logical expert ids and weights, one fused
// kernel. CPU twin: epmoe::route_cpu (epmoe/router.hpp).
//
//  - sigmoid scoring (DeepSeek-V3 "noaux_tc"): bit-exact with route_cpu, ids and weights. The
//    sigmoid is routing::sigmoid_f32_branch_free (sigmoid_f32 bit for bit), the selections use the same
//    strict order (higher value first, ties to the lower index, for groups and for experts), and
//    the weights the same f32 operation sequence (sum of the chosen unbiased scores in selection
//    order, then each score / sum — 1/K each when the sum is 0 —, times routed_scaling_factor).
//  - softmax scoring: the same selection and weights, but exp and the softmax sum differ from the
//    CPU's std::exp and index-order sum, so results agree within f32 rounding (ids agree wherever
//    the scores are not within rounding of each other), not bitwise.
//
// All tensors are Device::cuda views, contiguous; the call only enqueues work on `stream` (no
// allocation, no host synchronisation, CUDA-graph capturable) and throws epmoe::Error naming the
// argument when a rule is broken. Inputs must be finite (the CPU checks this, the GPU cannot
// cheaply): NaN or Inf inputs give unspecified weights, but the ids are still K distinct experts
// in [0, E).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "epmoe/config.hpp"
#include "epmoe/tensor.hpp"

namespace epmoe::cuda {

// Limits of the GPU router (on top of MoeConfig::validate): topk <= 32, num_groups <= 32 when
// groups are used (num_groups > 1 and topk_groups < num_groups), and at most 16 experts per lane,
// i.e. E <= 512 without groups; with G groups, ceil(E/G / (32 / bit_ceil(G))) <= 16.
bool route_supports(const MoeConfig& config);

//   logits            [T, E] f32
//   correction_bias   [E] f32, required for sigmoid scoring (ignored, may be empty, for softmax)
//   topk_ids    (out) [T, K] i32 logical expert ids, in selection order (decreasing biased score)
//   topk_weights(out) [T, K] f32
// T may be 0 (nothing is launched).
void route(const MoeConfig& config, TensorView logits, TensorView correction_bias, TensorView topk_ids,
           TensorView topk_weights, cudaStream_t stream);

// Which kernel route() takes, for tests and benchmarks (every choice gives the same bits).
// automatic: route_g8_kernel where it applies (DeepSeek-V3's shape, T >= 1024; with the sieve and
// 16 lanes per token at every T) and, for softmax, route_g8_softmax_kernel (E = 256 without group
// selection, K <= 8, T >= 1024), else the general kernel; EPMOE_ROUTER_G8=0 in the environment means
// general. g8: those kernels at any T.
// rn_division: the sigmoid with __fdiv_rn (sigmoid_f32_fast) instead of the branch-free division;
// EPMOE_ROUTER_DIV=rn sets it.
// sieve: wherever route_g8_kernel is taken, route_g8_sieve_kernel instead (v5: the exact sigmoid
// only for the experts that can decide the outcome; the default since it measured 2-17% faster at
// T >= 4096 on H200, bench/NOTES.md); EPMOE_ROUTER_SIEVE=0 clears it.
struct RouteKernelChoice {
  enum class Kernel { automatic, general, g8 };
  Kernel kernel = Kernel::automatic;
  bool rn_division = false;
  bool sieve = true;
  // The staged g8 kernels' logits staging (route_g8_sieve_kernel, route_g8_softmax_kernel): 0 = each
  // lane loads its part; 1 = one TMA copy per quad;
  // 2 = two TMA stage buffers per warp (the next quad loads while this one is ranked);
  // EPMOE_ROUTER_TMA=0|1|2 sets it. 1 by default (v7: sigmoid 9% faster than 0 at T = 16384 on H200).
  int tma_stages = 1;
  // The sieve kernel's lanes per token: 8 (a warp routes 4 tokens at a time, each lane a group of 32
  // experts), 16 (2 tokens, each lane half a group: half the chain per lane; needs tma_stages >= 1,
  // else 8), or 0: 16 at small T (then also below the g8 switch at 1024 tokens, in place of the
  // general kernel), 8 above. EPMOE_ROUTER_LANES=8|16 forces one.
  int token_lanes = 0;
  // Diagnostics: a device buffer of route_trace_words() words that the sieve kernel (TMA staging, the
  // branch-free sigmoid) fills with per-warp phase stamps (router_kernels.cuh: RouterStamps), through an
  // instance of its own; nullptr (default) for the untraced kernels. Refused where that kernel does
  // not run.
  std::uint64_t* trace = nullptr;
};
// Words of a RouteKernelChoice::trace buffer on the current device (16 per warp that can be resident).
std::size_t route_trace_words();
inline constexpr int kRouteTraceWordsPerWarp = 16;
// The choice route() makes from the environment.
RouteKernelChoice route_kernel_choice_from_env();
// route() with an explicit choice; Kernel::g8 where g8 does not apply falls back to general.
void route(const MoeConfig& config, TensorView logits, TensorView correction_bias, TensorView topk_ids,
           TensorView topk_weights, cudaStream_t stream, const RouteKernelChoice& choice);

}  // namespace epmoe::cuda
