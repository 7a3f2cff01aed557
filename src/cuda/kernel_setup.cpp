#include "cuda/kernel_setup.hpp"

#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "epmoe/cuda/launch.hpp"
#include "epmoe/error.hpp"

namespace epmoe::cuda {
namespace {

struct Registry {
  std::mutex mutex;
  std::vector<std::pair<const char*, std::function<void()>>> setups;
  std::uint64_t prepared_devices = 0;  // bit d: device d % 64 done
};
Registry& registry() {
  static Registry r;  // built at its first use (static initialisers of any translation unit)
  return r;
}

}  // namespace

bool register_kernel_setup(const char* what, std::function<void()> setup) {
  Registry& r = registry();
  const std::lock_guard lock(r.mutex);
  r.setups.emplace_back(what, std::move(setup));
  return true;
}

void prepare_kernels() {
  Registry& r = registry();
  const std::lock_guard lock(r.mutex);
  const std::uint64_t bit = std::uint64_t{1} << (current_device() % 64);
  if ((r.prepared_devices & bit) != 0) return;
  for (const auto& [what, setup] : r.setups) {
    try {
      setup();
    } catch (const Error& e) {
      EPMOE_FAIL("prepare_kernels: the set-up of {} failed: {}", what, e.what());
    }
  }
  r.prepared_devices |= bit;
}

std::size_t kernel_setup_count() {
  Registry& r = registry();
  const std::lock_guard lock(r.mutex);
  return r.setups.size();
}

}  // namespace epmoe::cuda
