#!/usr/bin/env bash
# Set-up-and-go for the main job: installs what is missing, builds, runs `epmoe run`
# (on the GPUs present, else on the CPU reference at the tiny preset). Extra arguments go to it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
bash scripts/build.sh default
# On GPU machines whose loader finds another libnccl than the headers' (the communicator refuses it): a
# matching one first on the path, where there is one.
# shellcheck source=scripts/device-common.sh
source scripts/device-common.sh
use_matching_nccl ./build/bin/epmoe || true
exec ./build/bin/epmoe run "$@"
