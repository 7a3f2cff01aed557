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
// with rank and k mixed (replica_hash_high: the same for every token of a launch whose high word does
// not change, so the GPU kernel tabulates it per k), then the token's low word (spread by an odd
// multiplier) with that (replica_hash_finish).
EPMOE_HD constexpr std::uint32_t replica_hash_high(int src_rank, std::uint32_t token_high, int k) {
  return mix32(token_high ^ (static_cast<std::uint32_t>(src_rank) * 0x01000193u) ^
               (static_cast<std::uint32_t>(k) * 0x27d4eb2fu));
}
EPMOE_HD constexpr std::uint32_t replica_hash_finish(std::uint32_t high, std::uint32_t token_low) {
  return mix32((token_low * 0x9e3779b9u) ^ high);
}
EPMOE_HD constexpr std::uint32_t replica_hash(int src_rank, std::int64_t token, int k) {
  const auto t = static_cast<std::uint64_t>(token);
  return replica_hash_finish(replica_hash_high(src_rank, static_cast<std::uint32_t>(t >> 32), k),
                             static_cast<std::uint32_t>(t));
}

// The index in [0, count) of the replica that hash h picks (multiply-shift range reduction: as uniform
// as a modulo, without a division).
EPMOE_HD constexpr int replica_index(std::uint32_t h, int count) {
  return static_cast<int>((static_cast<std::uint64_t>(h) * static_cast<std::uint32_t>(count)) >> 32);
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
  return replicas[replica_index(replica_hash(src_rank, token, k), count)];
}

// choose_replica's static choice for an expert with count <= 4 replicas held in registers (r[j] for
// j < count; the rest unused), without indexing them by a run-time value (which would put them in
// local memory on the GPU): the same slot as choose_replica(r, count, src_rank, slots_per_rank, ...,
// false).
EPMOE_HD constexpr std::int32_t choose_static_replica4(const std::int32_t (&r)[4], int count, int src_rank,
                                                       int slots_per_rank) {
  if (count == 1) return r[0];
  const int lo = src_rank * slots_per_rank;
  const int hi = lo + slots_per_rank;
  // Written out (no loops) so that r stays in registers.
  const auto in = [&](int j, std::int32_t v) { return j < count && v >= lo && v < hi; };
  if (in(0, r[0])) return r[0];
  if (in(1, r[1])) return r[1];
  if (in(2, r[2])) return r[2];
  if (in(3, r[3])) return r[3];
  const int m = src_rank % count;
  return m == 0 ? r[0] : m == 1 ? r[1] : m == 2 ? r[2] : r[3];
}

}  // namespace epmoe::eplb
