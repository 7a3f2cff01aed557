#!/usr/bin/env bash
# Sourced by the device scripts (comm-check, layer-check, startup-check, scaleout-check): what each of them
# needs the same way.

# The multi-rank comm tests under `epmoe launch`, without the loopback-only test (on ranks of their own
# processes it returns at once and would report OK without an assertion; tests/CMakeLists.txt leaves it
# out of CommGpu.two_ranks the same way).
# shellcheck disable=SC2034  # used by the scripts that source this file
EPMOE_LAUNCHED_COMM_FILTER='--gtest_filter=-CommWorld.ALoopbackWindowOutlivesTheRankThatDropsItFirst'

# use_matching_nccl BIN: puts a libnccl of the version BIN was compiled against first on LD_LIBRARY_PATH
# (the machine's /usr/lib may hold another; the communicator refuses a mismatch). Fails, saying so,
# where there is none.
use_matching_nccl() {
  local dir
  if dir=$(scripts/nccl-lib-dir.sh "$1"); then
    [[ -n $dir ]] && export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    return 0
  fi
  echo "no libnccl matching the headers $1 was built against: the communicator will refuse to start" >&2
  return 1
}
