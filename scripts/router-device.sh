#!/usr/bin/env bash
# The router's device check in one call (issue 3): GPU router tests (bit-exact with route_cpu on
# every kernel choice, the branch-free sigmoid on all 2^32 floats), `epmoe bench router` with the
# kernel variants and the copy rows, then compute-sanitizer memcheck and racecheck on the router
# tests. Every step has its own time limit.
#
# Usage: scripts/router-device.sh OUTDIR [BUILD_DIR]    (run from the source root)
# BUILD_DIR (default build-gpu) holds bin/epmoe, tests/epmoe_gpu_tests and libepmoe.so; it is
# configured and built (preset gpu, those targets only) unless EPMOE_PREBUILT=1 says the binaries
# are already there (built for sm_90a elsewhere). OUTDIR receives tests.log, router.json,
# bench.log, memcheck.log, racecheck.log.
set -uo pipefail
out=${1:?usage: scripts/router-device.sh OUTDIR [BUILD_DIR]}
build=${2:-build-gpu}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EPMOE_COMMIT=${EPMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export LD_LIBRARY_PATH="$(cd "$build" 2>/dev/null && pwd):${LD_LIBRARY_PATH:-}"
start=$SECONDS
stamp() { echo "== $1 ($((SECONDS - start)) s)"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader || true
if [[ ${EPMOE_PREBUILT:-0} != 1 ]]; then
  stamp build
  cmake --preset gpu > "$out/build.log" 2>&1 &&
    timeout 400 cmake --build --preset gpu -j "$(nproc)" --target epmoe_gpu_tests epmoe_cli >> "$out/build.log" 2>&1 ||
    { grep -E "error|FAILED" "$out/build.log" | head -n 30; exit 1; }
fi
tests=$build/tests/epmoe_gpu_tests
filter='*Route*'

stamp tests
timeout 45 "$tests" --gtest_filter="$filter" > "$out/tests.log" 2>&1
rc_tests=$?
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|mismatches|seed" "$out/tests.log" | head -n 40
echo "tests exit: $rc_tests"

stamp bench
EPMOE_BENCH_ROUTER_VARIANTS=1 timeout 45 "$build/bin/epmoe" bench router --json "$out/router.json" > "$out/bench.log" 2>&1
echo "bench exit: $?"
cat "$out/bench.log"

sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
stamp memcheck
timeout 35 "$sanitizer" --tool memcheck --error-exitcode 1 "$tests" \
  --gtest_filter="$filter:-*EveryFloat*:*T16384*:*T20000*" > "$out/memcheck.log" 2>&1
echo "memcheck exit: $?"
grep -E "ERROR SUMMARY|\[  PASSED  \]|\[  FAILED  \]" "$out/memcheck.log" | tail -n 4
stamp racecheck
timeout 35 "$sanitizer" --tool racecheck --error-exitcode 1 "$tests" \
  --gtest_filter="$filter:-*EveryFloat*:*T16384*:*T20000*:*Softmax*:*Layouts*" > "$out/racecheck.log" 2>&1
echo "racecheck exit: $?"
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|\[  PASSED  \]|\[  FAILED  \]" "$out/racecheck.log" | tail -n 4
stamp done
