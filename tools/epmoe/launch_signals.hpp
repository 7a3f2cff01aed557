// The signals of a process that launches ranks (`epmoe launch`, `epmoe run` on several GPUs).
#pragma once

#include <signal.h>

#include <csignal>

namespace epmoe::tools {

// For its scope: SIGINT, SIGTERM, SIGHUP and SIGQUIT no longer end the process but set `interrupted()`
// to their number (LaunchOptions::interrupted: the launcher stops every rank and returns 128 + it), and
// SIGPIPE is ignored, so that a closed output (`| head`) reaches the launcher as EPIPE and it stops the
// ranks, instead of killing it and leaving them running. The previous dispositions come back at the end.
class LaunchSignals {
 public:
  LaunchSignals();
  ~LaunchSignals();
  LaunchSignals(const LaunchSignals&) = delete;
  LaunchSignals& operator=(const LaunchSignals&) = delete;

  const volatile std::sig_atomic_t* interrupted() const;

 private:
  static constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};
  struct sigaction previous_[sizeof(kStopSignals) / sizeof(int)]{};
  struct sigaction previous_pipe_ {};
};

}  // namespace epmoe::tools
