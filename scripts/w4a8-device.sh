#!/usr/bin/env bash
# The W4A8 grouped GEMM's whole device check in one call (issue 5): build the GPU targets, the W4A8
# and FP8 grouped GEMM GPU tests, compute-sanitizer memcheck on two small W4A8 tests, ptxas resource
# usage and a SASS summary of the W4A8 kernels, and `epmoe bench gemm --quant w4a8`. Every step has
# its own time limit.
#
# Usage: scripts/w4a8-device.sh OUTDIR [--no-bench]   (run from the source root; e.g. "$OUT")
# Knobs (environment): W4A8_TEST_FILTER (gtest filter), W4A8_PTXAS=0 (no -Xptxas -v recompile: SASS
# from the built object), W4A8_BENCH_S / W4A8_MEMCHECK_S (time limits), W4A8_PROBE=1 (compile and run
# bench/probe/tensor_probe.cu first: tensor-core instruction costs), W4A8_RACECHECK=1 (racecheck on
# small W4A8 tests, hazards printed), W4A8_MEMCHECK=0 (skip memcheck), W4A8_CPU_TESTS=1 (build and
# run the CPU W4A8 tests too), W4A8_TESTS=0 (skip the GPU tests: a second call for the bench alone,
# the build already there), W4A8_BENCH_ENV (extra
# environment for the bench, e.g. "EPMOE_BENCH_GEMM_ONLY=decode EPMOE_BENCH_GEMM_EXPERIMENTS=1"),
# W4A8_BUILD=0 (binaries built on another machine already in build-gpu/: no build, no ptxas; the
# SASS summary only if the object is there).
# The bench times v2 with two and three K blocks per stage (".w4a8.v2.k2", ".w4a8.v2.k3"), the offset warp
# (".w4a8.v2.offwarp.k2") and, on the 32-row decode rows, two partials (".w4a8.v2.p2"): bench/NOTES.md,
# W4A8 v5 and v6) on every row; memcheck's default filter (W4A8_MEMCHECK_FILTER) matches their variants of
# its tests too.
# The bench runs before memcheck, so that a tight overall limit still brings the numbers back.
# OUTDIR receives build.log (tail), gpu-tests.log, memcheck.log, ptxas.txt, bench.log, w4a8.json.
# On the shared device machine, unpack the tree into a directory of its own: files left in a shared
# one by another checkout are globbed into the build and can break it.
set -uo pipefail
out=${1:?usage: scripts/w4a8-device.sh OUTDIR [--no-bench]}
mode=${2:-}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EPMOE_COMMIT=${EPMOE_COMMIT:-$(git rev-parse --short HEAD 2> /dev/null || echo unknown)}
start=$SECONDS
stamp() { echo "== $1 ($((SECONDS - start)) s)"; }

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader || true
if [[ ${W4A8_BUILD:-1} == 1 ]]; then
  stamp build
  cmake --preset gpu > "$out/build.log" 2>&1 || { tail -n 30 "$out/build.log"; exit 1; }
  targets="epmoe_gpu_tests epmoe_cli epmoe_tensor_probe"
  [[ ${W4A8_CPU_TESTS:-0} == 1 ]] && targets="$targets epmoe_tests"
  # shellcheck disable=SC2086
  if ! timeout 300 cmake --build --preset gpu -j "$(nproc)" --target $targets >> "$out/build.log" 2>&1; then
    grep -E "error|FAILED" "$out/build.log" | head -n 30
    exit 1
  fi
  tail -n 3 "$out/build.log"
else
  # Binaries built elsewhere for sm_90a (the same sources) and unpacked into build-gpu/ (bin/epmoe,
  # tests/epmoe_gpu_tests, libepmoe.so): no build here, no ptxas step.
  stamp "prebuilt build-gpu"
  export LD_LIBRARY_PATH=$PWD/build-gpu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  W4A8_PTXAS=0
fi

if [[ ${W4A8_PROBE:-0} == 1 ]]; then
  stamp probe
  timeout 60 build-gpu/bin/epmoe_tensor_probe | tee "$out/probe.log"
fi

if [[ ${W4A8_CPU_TESTS:-0} == 1 ]]; then
  stamp cpu-tests
  timeout 120 build-gpu/tests/epmoe_tests --gtest_filter='*W4A8*' 2>&1 | grep -E "^\[  (PASSED|FAILED) |Failure|Expected|Which is" | head -n 20
fi

tests=build-gpu/tests/epmoe_gpu_tests
rc_tests=0
if [[ ${W4A8_TESTS:-1} == 1 ]]; then
  stamp gpu-tests
  timeout "${W4A8_TEST_S:-150}" "$tests" --gtest_filter="${W4A8_TEST_FILTER:-*W4A8*:*GroupedGemm*}" > "$out/gpu-tests.log" 2>&1
  rc_tests=$?
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|rel_l2|Failure|error|seed|Expected|Which is|differ" "$out/gpu-tests.log" | head -n 80
  echo "gpu tests exit: $rc_tests"
fi

stamp ptxas
obj=build-gpu/CMakeFiles/epmoe.dir/src/gemm/w4a8_grouped_gemm.cu.o
if [[ ${W4A8_PTXAS:-1} == 1 ]]; then
  cmd=$(python3 -c "
import json
for e in json.load(open('build-gpu/compile_commands.json')):
    if e['file'].endswith('src/gemm/w4a8_grouped_gemm.cu'):
        print(e['command'])
")
  (cd build-gpu && eval "${cmd/-o CMakeFiles*/-o /tmp/w4a8.o} -Xptxas -v" 2>&1) | c++filt |
    grep -E "Compiling entry|spill|Used|wgmma|serializ" | sed 's/ptxas info    : //' > "$out/ptxas.txt"
  grep -E "Used|spill" "$out/ptxas.txt" | paste - - | sed -E 's/ +/ /g' | head -n 20
  obj=/tmp/w4a8.o
fi
dump=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
[[ -f $obj ]] && "$dump" -sass "$obj" 2> /dev/null |
  grep -oE "Function : [^ ]+|[QH]GMMA[.A-Z0-9x]*|LDL[.A-Z0-9]*|STL[.A-Z0-9]*|UTMALDG[.A-Z0-9]*|UBLKCP[.A-Z0-9]*|PRMT|STS[.A-Z0-9]*|WARPGROUP[.A-Z]*" |
  awk '/Function/{f=$3; next} {c[f" "$0]++} END {for (k in c) print c[k], k}' | sort -k2 | tee -a "$out/ptxas.txt" | head -n 60

if [[ $mode != --no-bench && $rc_tests != 124 ]]; then
  stamp bench
  env ${W4A8_BENCH_ENV:-} timeout "${W4A8_BENCH_S:-200}" build-gpu/bin/epmoe bench gemm --quant w4a8 --quick --json "$out/w4a8.json" > "$out/bench.log" 2>&1
  echo "bench exit: $?"
  sed -E 's/ +/ /g' "$out/bench.log"
fi
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [[ ${W4A8_RACECHECK:-0} == 1 ]]; then
  stamp racecheck
  timeout "${W4A8_RACECHECK_S:-120}" "$sanitizer" --tool racecheck --print-limit 20 "$tests" \
    --gtest_filter="${W4A8_RACECHECK_FILTER:-*W4A8GemmMaskedGpu*v3_m64n128*:*W4A8GemmContiguousGpu*N1536_K1152_odd_k_blocks_v3*:*W4A8GemmMaskedGpu*block16_consumers2*:*W4A8GemmMaskedGpu*N512_K384*offwarp*}" \
    > "$out/racecheck.log" 2>&1
  echo "racecheck exit: $?"
  grep -E "RACECHECK SUMMARY|hazard|Race|Write|Read|at 0x|in .*kernel|\[  (PASSED|FAILED) " "$out/racecheck.log" | head -n 60
fi
if ((rc_tests != 124)) && [[ ${W4A8_MEMCHECK:-1} == 1 ]]; then
  stamp memcheck
  timeout "${W4A8_MEMCHECK_S:-120}" "$sanitizer" --tool memcheck --error-exitcode 1 "$tests" \
    --gtest_filter="${W4A8_MEMCHECK_FILTER:-*W4A8GemmMaskedGpu*block16_consumers2*:*W4A8GemmContiguousGpu*holes*:*W4A8GemmMaskedGpu*all_empty*:*W4A8GemmMaskedGpu*v3_m64n128*:*W4A8GemmMaskedGpu*small_box*:*W4A8GemmMaskedGpu*device_scale*}" \
    > "$out/memcheck.log" 2>&1
  echo "memcheck exit: $?"
  grep -E "ERROR SUMMARY|\[  PASSED  \]|\[  FAILED  \]" "$out/memcheck.log" | tail -n 4
fi

stamp done
