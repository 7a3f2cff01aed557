#include "tools/epmoe/launch_signals.hpp"

#include <iterator>

namespace epmoe::tools {
namespace {
volatile std::sig_atomic_t g_interrupted = 0;
extern "C" void on_stop_signal(int sig) {
  g_interrupted = sig;
}
}  // namespace

LaunchSignals::LaunchSignals() {
  g_interrupted = 0;
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  for (std::size_t i = 0; i < std::size(kStopSignals); ++i) sigaction(kStopSignals[i], &sa, &previous_[i]);
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  sigaction(SIGPIPE, &ignore, &previous_pipe_);
}

LaunchSignals::~LaunchSignals() {
  for (std::size_t i = 0; i < std::size(kStopSignals); ++i)
    sigaction(kStopSignals[i], &previous_[i], nullptr);
  sigaction(SIGPIPE, &previous_pipe_, nullptr);
}

const volatile std::sig_atomic_t* LaunchSignals::interrupted() const {
  return &g_interrupted;
}

}  // namespace epmoe::tools
