// Replica choice of one (token, k) (design.md §5), shared by ExpertPlacement (placement.cpp, host)
// and the GPU mapping kernel (eplb_kernels.cuh): both call these functions, so they agree bit for bit.
// Integer operations only; compiled by the host compiler and by nvcc (as __host__ __device__).
#pragma once

#include <cstdint>

#include "cuda/hd.hpp"

namespace epmoe::eplb {

// The murmur3 32-bit finaliser: a cheap bijective mixer with good avalanche.
EPMOE_HD constexpr std::uint32_t mix32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x85ebca6bu;
  x ^= x >> 13;
  x *= 0xc2b2ae35u;
  x ^= x >> 16;
  return x;
}

// Hash of one (src_rank, token, k), in 32-bit operations (a 64-bit multiply is three or four GPU
// instructions, and the mapping kernel's dynamic choice is bound by this chain): the token's high word
// with rank and k mixed, then the token's low word (spread by an odd multiplier) with that.
EPMOE_HD constexpr std::uint32_t replica_hash(int src_rank, std::int64_t token, int k) {
  const auto t = static_cast<std::uint64_t>(token);
  const std::uint32_t rk = static_cast<std::uint32_t>(t >> 32) ^
                           (static_cast<std::uint32_t>(src_rank) * 0x01000193u) ^
                           (static_cast<std::uint32_t>(k) * 0x27d4eb2fu);
  return mix32((static_cast<std::uint32_t>(t) * 0x9e3779b9u) ^ mix32(rk));
}

// The replica of one logical expert that (src_rank, token, k) uses.
//   replicas: the expert's `count` >= 1 physical slots, in increasing slot order (its log2phy row);
//   static  (dynamic == false): the replica on src_rank (slots [src_rank * slots_per_rank, +slots_per_rank))
//            if there is one, else replica (src_rank % count); token and k are not used;
//   dynamic (dynamic == true):  replica replica_hash(src_rank, token, k) * count / 2^32 (multiply-shift
//            range reduction: as uniform as a modulo, without a division).
EPMOE_HD constexpr std::int32_t choose_replica(const std::int32_t* replicas, int count, int src_rank,
                                               int slots_per_rank, std::int64_t token, int k, bool dynamic) {
  if (count == 1) return replicas[0];
  if (!dynamic) {
    const int lo = src_rank * slots_per_rank;
    const int hi = lo + slots_per_rank;
    for (int i = 0; i < count; ++i) {
      if (replicas[i] >= lo && replicas[i] < hi) return replicas[i];
    }
    return replicas[src_rank % count];
  }
  const std::uint64_t h = replica_hash(src_rank, token, k);
  return replicas[(h * static_cast<std::uint32_t>(count)) >> 32];
}

}  // namespace epmoe::eplb
