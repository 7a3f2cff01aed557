// Replica choice of one (token, k) (design.md §5), shared by ExpertPlacement (placement.cpp, host)
// and the GPU mapping kernel (eplb_kernels.cuh): both call these functions, so they agree bit for bit.
// Integer operations only; compiled by the host compiler and by nvcc (as __host__ __device__).
#pragma once

#include <cstdint>

#include "cuda/hd.hpp"

namespace epmoe::eplb {

// The splitmix64 finaliser: a cheap bijective 64-bit mixer with good avalanche.
EPMOE_HD constexpr std::uint64_t mix64(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

// Hash of one (src_rank, token, k): the token is mixed first, then combined with rank and k
// packed into one word and mixed again.
EPMOE_HD constexpr std::uint64_t replica_hash(int src_rank, std::int64_t token, int k) {
  const std::uint64_t t = mix64(static_cast<std::uint64_t>(token) + 0x9e3779b97f4a7c15ULL);
  const std::uint64_t rk = (static_cast<std::uint64_t>(static_cast<std::uint32_t>(src_rank)) << 32) |
                           static_cast<std::uint64_t>(static_cast<std::uint32_t>(k));
  return mix64(t ^ rk);
}

// The replica of one logical expert that (src_rank, token, k) uses.
//   replicas: the expert's `count` >= 1 physical slots, in increasing slot order (its log2phy row);
//   static  (dynamic == false): the replica on src_rank (slots [src_rank * slots_per_rank, +slots_per_rank))
//            if there is one, else replica (src_rank % count); token and k are not used;
//   dynamic (dynamic == true):  replica (high 32 bits of replica_hash(src_rank, token, k)) * count / 2^32
//            (multiply-shift range reduction: as uniform as a modulo, without the 64-bit division that
//            cost the GPU kernel ~800 cycles per element).
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
  const std::uint64_t h = replica_hash(src_rank, token, k) >> 32;
  return replicas[(h * static_cast<std::uint32_t>(count)) >> 32];
}

}  // namespace epmoe::eplb
