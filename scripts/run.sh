#!/usr/bin/env bash
# Set-up-and-go for the main job: installs what is missing, builds, runs `epmoe run`
# (on the GPUs present, else on the CPU reference at the tiny preset). Extra arguments go to it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
bash scripts/build.sh default
exec ./build/bin/epmoe run "$@"
