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
# bench.log, memcheck.log, racecheck.log; with EPMOE_ROUTER_PROFILE=1 also the SASS of
# route_g8_kernel and route_g8_sieve_kernel (g8-sass.txt, sieve-sass.txt, opcode histograms
# printed) and Nsight Compute sections for one launch of each at T = 16384 and 131072
# (ncu-KERNEL-T.txt).
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
timeout 150 "$tests" --gtest_filter="$filter" > "$out/tests.log" 2>&1
rc_tests=$?
grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|mismatches|seed" "$out/tests.log" | head -n 40
echo "tests exit: $rc_tests"

stamp bench
EPMOE_BENCH_ROUTER_VARIANTS=1 timeout 100 "$build/bin/epmoe" bench router --json "$out/router.json" > "$out/bench.log" 2>&1
echo "bench exit: $?"
cat "$out/bench.log"

if [[ ${EPMOE_ROUTER_PROFILE:-0} == 1 ]]; then
  # route_g8_kernel's SASS (opcode histogram) and an Nsight Compute look at one launch per T.
  stamp profile
  dump=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
  # The sieve kernel with the staging EPMOE_ROUTER_TMA picks (1, the default, unless set).
  # (The quads instance unless EPMOE_ROUTER_LANES=16: the profiled T are quads' by default.)
  sieve_args="ILb0ELi${EPMOE_ROUTER_TMA:-1}ELi${EPMOE_ROUTER_LANES:-8}EEEvNS0_12RouterParamsE14CUtensorMap_st"
  for k in g8:15route_g8_kernel:ILb0EEEvNS0_12RouterParamsE sieve:21route_g8_sieve_kernel:$sieve_args; do
    name=${k#*:}
    "$dump" -sass -fun "_ZN5epmoe7kernels${name%%:*}${name#*:}" "$build/libepmoe.so" \
      > "$out/${k%%:*}-sass.txt" 2>&1
    echo "${k%%:*} SASS: $(grep -cE '^\s+/\*[0-9a-f]{4}\*/' "$out/${k%%:*}-sass.txt") instructions; by opcode:"
    grep -oE '^\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P[0-9T] )?[A-Z0-9_]+' "$out/${k%%:*}-sass.txt" | awk '{print $NF}' |
      sort | uniq -c | sort -rn | head -n 40 | tr '\n' ' '
    echo
  done
  ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2> /dev/null || echo ncu)
  # route_g8_sieve_kernel (the default "sigmoid" row) and route_g8_kernel (the "sigmoid-no-sieve" row).
  for kernel in route_g8_kernel route_g8_sieve_kernel; do
    for t in 16384 131072; do
      timeout 30 "$ncu" --kernel-name "regex:$kernel" --launch-skip 5 --launch-count 1 \
        --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section InstructionStats \
        --section Occupancy --section LaunchStats "$build/bin/epmoe" bench router --quick --tokens "$t" \
        > "$out/ncu-$kernel-$t.txt" 2>&1
      echo "ncu $kernel T=$t exit: $?"
      grep -vE '^\s*$|----' "$out/ncu-$kernel-$t.txt" | grep -E "Duration|Throughput|Issue|Issued|Eligible|Active Warps|No Eligible|Stall|Executed Ipc|Occupancy|Registers|Block Limit|Warp Cycles|Instructions|==PROF==|error|ERR" | head -n 40
    done
  done
fi

sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
stamp memcheck
timeout 150 "$sanitizer" --tool memcheck --error-exitcode 1 "$tests" \
  --gtest_filter="$filter:-*EveryFloat*:*T16384*:*T20000*:*T65537*" > "$out/memcheck.log" 2>&1
echo "memcheck exit: $?"
grep -E "ERROR SUMMARY|\[  PASSED  \]|\[  FAILED  \]" "$out/memcheck.log" | tail -n 4
stamp racecheck
timeout 150 "$sanitizer" --tool racecheck --error-exitcode 1 "$tests" \
  --gtest_filter="$filter:-*EveryFloat*:*T16384*:*T20000*:*T65537*:*Softmax*:*Layouts*" > "$out/racecheck.log" 2>&1
echo "racecheck exit: $?"
grep -E "ERROR SUMMARY|RACECHECK SUMMARY|\[  PASSED  \]|\[  FAILED  \]" "$out/racecheck.log" | tail -n 4
stamp done
