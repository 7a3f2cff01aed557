#!/usr/bin/env bash
# Session 57, call 1 (one GPU): the review's fixes to the device-idle measurement, and the store-warp
# arrive patch A/B (racecheck, GEMM tests, bench gemm main vs patch, ABAB).
set -uo pipefail
out=${1:?OUTDIR}
l=$out/l; mkdir -p "$l"
deadline=$((SECONDS + ${2:-560}))
t() { local name=$1; shift; local left=$((deadline - SECONDS)); ((left > 5)) || { echo "$name: no time" | tee -a "$l/steps.txt"; return; }
  local s=$SECONDS; timeout --kill-after=5 "$left" "$@" > "$l/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - s)) s" | tee -a "$l/steps.txt"; }
export EPMOE_COMMIT=${EPMOE_COMMIT:-unknown} NCCL_NVLS_ENABLE=0
nvidia-smi > "$l/nvidia-smi.txt" 2>&1
t configure cmake --preset gpu
t build-main cmake --build build-gpu -j16
D=$(bash scripts/nccl-lib-dir.sh build-gpu/bin/epmoe); export LD_LIBRARY_PATH=${D:+$D:}${LD_LIBRARY_PATH:-}
mkdir -p /tmp/main && cp build-gpu/libepmoe.so build-gpu/bin/epmoe /tmp/main/
B=build-gpu/tests/epmoe_tests
t activity-tests $B --gtest_filter='DeviceActivityGpu.*'
t run-idle build-gpu/bin/epmoe run --steps 50 --json "$l/run-idle.json"
t run-noidle build-gpu/bin/epmoe run --steps 50 --no-device-idle --json "$l/run-noidle.json"
git apply bench/experiments/store-warp-arrive-s56.patch && echo patched >> "$l/steps.txt"
t build-patch cmake --build build-gpu -j16
grep -i "spill\|local" "$l/build-patch.log" | grep -v " 0 bytes" | head > "$l/patch-spills.txt"
t racecheck-patch compute-sanitizer --tool racecheck --racecheck-report hazard $B --gtest_filter='*TailPieces*'
t gemm-tests-patch $B --gtest_filter='*GroupedGemm*'
t gemm-main-1 env LD_LIBRARY_PATH=/tmp/main:$LD_LIBRARY_PATH /tmp/main/epmoe bench gemm --quick --json "$l/gemm-main-1.json"
t gemm-patch-1 build-gpu/bin/epmoe bench gemm --quick --json "$l/gemm-patch-1.json"
t gemm-main-2 env LD_LIBRARY_PATH=/tmp/main:$LD_LIBRARY_PATH /tmp/main/epmoe bench gemm --quick --json "$l/gemm-main-2.json"
t gemm-patch-2 build-gpu/bin/epmoe bench gemm --quick --json "$l/gemm-patch-2.json"
tar czf "$out/call1.tar.gz" -C "$out" l && rm -rf "$l"
