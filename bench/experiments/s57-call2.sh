#!/usr/bin/env bash
# Session 57, call 2 (one GPU): the GPU tests call 1 missed (wrong binary), with the store-warp patch.
set -uo pipefail
out=${1:?OUTDIR}
l=$out/l; mkdir -p "$l"
deadline=$((SECONDS + ${2:-560}))
t() { local name=$1; shift; local left=$((deadline - SECONDS)); ((left > 5)) || { echo "$name: no time" | tee -a "$l/steps.txt"; return; }
  local s=$SECONDS; timeout --kill-after=5 "$left" "$@" > "$l/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - s)) s" | tee -a "$l/steps.txt"; }
export EPMOE_COMMIT=${EPMOE_COMMIT:-unknown} NCCL_NVLS_ENABLE=0
nvidia-smi > "$l/nvidia-smi.txt" 2>&1
git apply bench/experiments/store-warp-arrive-s56.patch && echo patched >> "$l/steps.txt"
t configure cmake --preset gpu
t build-patch cmake --build build-gpu -j16
D=$(bash scripts/nccl-lib-dir.sh build-gpu/bin/epmoe); export LD_LIBRARY_PATH=${D:+$D:}${LD_LIBRARY_PATH:-}
B=build-gpu/tests/epmoe_gpu_tests
t activity-tests $B --gtest_filter='DeviceActivityGpu.*'
t racecheck-patch compute-sanitizer --tool racecheck --racecheck-report hazard $B --gtest_filter='*TailPieces*'
t gemm-tests-patch $B --gtest_filter='*GroupedGemm*:*Fp8Gemm*'
t memcheck-patch compute-sanitizer --tool memcheck $B --gtest_filter='*TailPieces*'
t bench-layer build-gpu/bin/epmoe bench layer --quick --json "$l/bench-layer.json"
tar czf "$out/call2.tar.gz" -C "$out" l && rm -rf "$l"
