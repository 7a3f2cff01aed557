#!/usr/bin/env bash
# Packs binaries built on this (CPU) machine for sm_90a as the trees of `scripts/ab-device.sh OUTDIR
# --prebuilt BINS.tgz`, so that a device call spends no time building (~150 s of a 600 s call).
# Usage: scripts/ab-pack.sh BINS.tgz a=BUILD_DIR b=BUILD_DIR [c=BUILD_DIR ...]
#   BUILD_DIR: a build (e.g. build/) or a folder with a copy of its bin/epmoe, libepmoe.so and
#   tests/epmoe_gpu_tests (one build directory serving several branches in turn: copy those three
#   after each branch's build). Tree b needs tests/epmoe_gpu_tests (its GPU tests and sanitizers run).
set -euo pipefail
out=${1:?usage: scripts/ab-pack.sh BINS.tgz a=BUILD_DIR b=BUILD_DIR ...}
shift
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
for arg in "$@"; do
  t=${arg%%=*}
  dir=${arg#*=}
  [[ $t =~ ^[a-f]$ && -x $dir/bin/epmoe && -f $dir/libepmoe.so ]] ||
    { echo "ab-pack: $arg: want TREE=BUILD_DIR with bin/epmoe and libepmoe.so (TREE one of a-f)" >&2; exit 2; }
  mkdir -p "$stage/$t/build-gpu/bin" "$stage/$t/build-gpu/tests"
  cp "$dir"/bin/epmoe* "$stage/$t/build-gpu/bin/"  # (epmoe.real too, behind a wrapper that sets a switch)
  cp "$dir/libepmoe.so" "$stage/$t/build-gpu/"
  if [[ -x $dir/tests/epmoe_gpu_tests ]]; then cp "$dir/tests/epmoe_gpu_tests" "$stage/$t/build-gpu/tests/"; fi
done
[[ -x $stage/b/build-gpu/tests/epmoe_gpu_tests ]] || { echo "ab-pack: tree b needs tests/epmoe_gpu_tests" >&2; exit 2; }
tar -czf "$out" -C "$stage" .
echo "ab-pack: $(du -h "$out" | cut -f1) in $out (trees: ${*%%=*})"
