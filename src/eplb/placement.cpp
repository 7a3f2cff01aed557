// ExpertPlacement (design.md §5): the phy2log / log2phy / logcnt tables of one layer and the
// choice of a replica for each (token, k) at dispatch time.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "eplb/replica_choice.hpp"
#include "epmoe/eplb.hpp"
#include "epmoe/error.hpp"

namespace epmoe {
ExpertPlacement::ExpertPlacement(std::vector<std::int32_t> phy2log, int num_logical, int num_ranks)
    : phy2log_(std::move(phy2log)), num_logical_(num_logical), num_ranks_(num_ranks) {
  EPMOE_CHECK(num_logical > 0, "num_logical must be positive, got {}", num_logical);
  EPMOE_CHECK(num_ranks > 0, "num_ranks must be positive, got {}", num_ranks);
  const std::size_t num_physical = phy2log_.size();
  EPMOE_CHECK(num_physical > 0, "phy2log must not be empty");
  EPMOE_CHECK(num_physical <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
              "phy2log has {} slots, more than an int32 can index", num_physical);
  EPMOE_CHECK(num_physical % static_cast<std::size_t>(num_ranks) == 0,
              "the number of physical slots ({}) must be a multiple of num_ranks ({})", num_physical,
              num_ranks);

  logcnt_.assign(static_cast<std::size_t>(num_logical), 0);
  for (std::size_t p = 0; p < num_physical; ++p) {
    const std::int32_t id = phy2log_[p];
    EPMOE_CHECK(id >= 0 && id < num_logical, "phy2log[{}] = {} is out of range [0, {})", p, id, num_logical);
    ++logcnt_[static_cast<std::size_t>(id)];
  }
  for (int e = 0; e < num_logical; ++e) {
    EPMOE_CHECK(logcnt_[static_cast<std::size_t>(e)] > 0,
                "logical expert {} has no physical slot in phy2log (every expert in [0, {}) needs one)", e,
                num_logical);
  }
  max_replicas_ = *std::max_element(logcnt_.begin(), logcnt_.end());

  // Replicas of each expert in increasing slot order, -1 padded to max_replicas.
  log2phy_.assign(static_cast<std::size_t>(num_logical) * static_cast<std::size_t>(max_replicas_), -1);
  std::vector<int> filled(static_cast<std::size_t>(num_logical), 0);
  for (std::size_t p = 0; p < num_physical; ++p) {
    const auto id = static_cast<std::size_t>(phy2log_[p]);
    log2phy_[id * static_cast<std::size_t>(max_replicas_) + static_cast<std::size_t>(filled[id]++)] =
        static_cast<std::int32_t>(p);
  }
}

ExpertPlacement ExpertPlacement::initial(int num_logical, int num_physical, int num_ranks) {
  EPMOE_CHECK(num_logical > 0, "num_logical must be positive, got {}", num_logical);
  EPMOE_CHECK(num_physical >= num_logical, "num_physical ({}) must be at least num_logical ({})",
              num_physical, num_logical);
  std::vector<std::int32_t> phy2log(static_cast<std::size_t>(num_physical));
  for (int p = 0; p < num_physical; ++p) phy2log[static_cast<std::size_t>(p)] = p % num_logical;
  return ExpertPlacement(std::move(phy2log), num_logical, num_ranks);
}

std::int32_t ExpertPlacement::choose(std::int32_t logical, int src_rank, std::int64_t token, int k,
                                     DispatchAlgorithm algorithm) const {
  EPMOE_CHECK(logical >= 0 && logical < num_logical_, "logical expert id {} is out of range [0, {})", logical,
              num_logical_);
  EPMOE_CHECK(src_rank >= 0 && src_rank < num_ranks_, "src_rank {} is out of range [0, {})", src_rank,
              num_ranks_);
  const std::int32_t* replicas =
      log2phy_.data() + static_cast<std::size_t>(logical) * static_cast<std::size_t>(max_replicas_);
  const int count = logcnt_[static_cast<std::size_t>(logical)];
  // The GPU mapping kernel (eplb_kernels.cuh) makes the same choice through the same function.
  return eplb::choose_replica(replicas, count, src_rank, slots_per_rank(), token, k,
                              algorithm == DispatchAlgorithm::dynamic_choice);
}

void ExpertPlacement::map_to_physical(TensorView logical_ids, TensorView physical_ids, int src_rank,
                                      DispatchAlgorithm algorithm, std::int64_t token_offset) const {
  EPMOE_CHECK(num_logical_ > 0, "map_to_physical called on an empty ExpertPlacement");
  expect_device(logical_ids, Device::cpu, "logical_ids");
  expect_dtype(logical_ids, DType::i32, "logical_ids");
  expect_rank(logical_ids, 2, "logical_ids");
  const std::int64_t num_tokens = logical_ids.shape[0];
  const std::int64_t topk = logical_ids.shape[1];
  expect_device(physical_ids, Device::cpu, "physical_ids");
  expect_dtype(physical_ids, DType::i32, "physical_ids");
  expect_shape(physical_ids, {num_tokens, topk}, "physical_ids");
  EPMOE_CHECK(src_rank >= 0 && src_rank < num_ranks_, "src_rank {} is out of range [0, {})", src_rank,
              num_ranks_);
  EPMOE_CHECK(token_offset >= 0, "token_offset must be non-negative, got {}", token_offset);
  EPMOE_CHECK(topk <= std::numeric_limits<int>::max(), "logical_ids has too many columns ({})", topk);
  if (num_tokens == 0 || topk == 0) return;
  EPMOE_CHECK(logical_ids.data != nullptr, "logical_ids has no data");
  EPMOE_CHECK(physical_ids.data != nullptr, "physical_ids has no data");

  const auto* in = static_cast<const std::int32_t*>(logical_ids.data);
  auto* out = static_cast<std::int32_t*>(physical_ids.data);
  for (std::int64_t t = 0; t < num_tokens; ++t) {
    for (std::int64_t k = 0; k < topk; ++k) {
      const std::int32_t id = in[t * logical_ids.stride[0] + k * logical_ids.stride[1]];
      EPMOE_CHECK(id >= 0 && id < num_logical_, "logical_ids[{}, {}] = {} is out of range [0, {})", t, k, id,
                  num_logical_);
      out[t * physical_ids.stride[0] + k * physical_ids.stride[1]] =
          choose(id, src_rank, token_offset + t, static_cast<int>(k), algorithm);
    }
  }
}

}  // namespace epmoe
