#!/usr/bin/env bash
# Set-up-and-go for the tests: installs what is missing, builds, runs the whole suite.
# GPU tests are part of it; without a GPU they are reported as skipped (ctest "Not Run").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
bash scripts/build.sh default
ctest --preset default --no-tests=error -j "$(nproc)" "$@"
