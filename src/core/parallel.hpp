// Host-side work split over the cores. Every caller gives each output element to one thread, which
// computes it in one fixed order, so results never depend on the thread count.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace epmoe {

// Runs fn(begin, end) over [0, n) in `chunk`-wide items taken in turn by `threads` threads (this
// one included). An exception from fn (an epmoe::Error, std::bad_alloc) stops the items not yet
// taken, waits for every thread and is rethrown here: escaping a thread, or leaving threads
// unjoined, would end the process in std::terminate.
template <class Fn>
void parallel_chunks(std::int64_t n, std::int64_t chunk, unsigned threads, const Fn& fn) {
  std::atomic<std::int64_t> next{0};
  std::mutex failure_mutex;
  std::exception_ptr failure;
  auto worker = [&] {
    try {
      for (std::int64_t begin = next.fetch_add(chunk); begin < n; begin = next.fetch_add(chunk))
        fn(begin, std::min(n, begin + chunk));
    } catch (...) {
      next.store(n);  // (no new items; those under way finish)
      const std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  try {
    for (unsigned t = 1; t < threads; ++t) pool.emplace_back(worker);
  } catch (const std::system_error&) {
    // No more threads to be had (a process or system limit): the ones started and this one do the work.
  }
  worker();
  for (std::thread& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
}

// Threads worth starting for `work` units when one thread should get at least `per_thread` of them:
// between 1 and the core count.
inline unsigned threads_for(double work, double per_thread) {
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  return static_cast<unsigned>(std::clamp(work / per_thread, 1.0, static_cast<double>(hw)));
}

}  // namespace epmoe
