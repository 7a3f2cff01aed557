#!/usr/bin/env bash
# The grouped GEMM's whole device check in one call (issue 4): build the GPU targets, run the
# GroupedGemm GPU tests, compute-sanitizer memcheck on two small ones, the kernel's SASS summary
# (QGMMA count, local memory), and `epmoe bench gemm`. Every step has its own time limit, so a
# hang costs minutes, not the lease.
#
# Usage: scripts/gemm-device.sh OUTDIR [--full]    (run from the source root; e.g. "$OUT")
# OUTDIR receives build.log, gpu-tests.log, memcheck.log, sass.txt, bench.log, gemm.json (the clocks
# during the bench and the SASS summary are printed).
# EPMOE_BENCH_GEMM_EXPERIMENTS=1 in the environment adds the bench's timing experiments;
# EPMOE_GEMM_NCU=1 adds Nsight Compute on one launch of the 8 x 4096, 4096 x 7168 contiguous line
# (scripts/gemm-ncu.sh, on this build).
set -uo pipefail
out=${1:?usage: scripts/gemm-device.sh OUTDIR [--full]}
mode=${2:-}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EPMOE_COMMIT=${EPMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
start=$SECONDS
stamp() { echo "== $1 ($((SECONDS - start)) s)"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader || true
stamp configure
cmake --preset gpu > "$out/build.log" 2>&1 || { tail -n 30 "$out/build.log"; exit 1; }
stamp build
if ! timeout 420 cmake --build --preset gpu -j "$(nproc)" --target epmoe_gpu_tests epmoe_cli >> "$out/build.log" 2>&1; then
  grep -E "error|FAILED" "$out/build.log" | head -n 30
  exit 1
fi

stamp gpu-tests
tests=build-gpu/tests/epmoe_gpu_tests
timeout 100 "$tests" --gtest_filter='*GroupedGemm*' > "$out/gpu-tests.log" 2>&1
rc_tests=$?
grep -E "^\[  (PASSED|FAILED) |^\[       OK|^\[  FAILED|rel_l2|Failure|error|seed" "$out/gpu-tests.log" | head -n 60
echo "gpu tests exit: $rc_tests"

if ((rc_tests != 124)); then
  stamp memcheck
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  timeout 90 "$sanitizer" --tool memcheck --error-exitcode 1 "$tests" \
    --gtest_filter='*GroupedGemmMaskedGpu*all_empty*:*GroupedGemmMaskedGpu*block64*:*GroupedGemmContiguousGpu*single_row_trailing*:*GroupedGemmContiguousGpu*holes_block_n128*' \
    > "$out/memcheck.log" 2>&1
  echo "memcheck exit: $?"
  grep -E "ERROR SUMMARY|\[  PASSED  \]|\[  FAILED  \]" "$out/memcheck.log" | tail -n 4
fi

stamp sass
lib=build-gpu/libepmoe.so
if command -v cuobjdump > /dev/null || [[ -x /usr/local/cuda/bin/cuobjdump ]]; then
  dump=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
  "$dump" -sass "$lib" 2> /dev/null | awk '/Function : .*fp8_grouped_gemm_kernel/{p=1} /Function : / && !/fp8_grouped_gemm_kernel/{p=0} p' > "$out/sass.txt"
  {
    echo "SASS of the grouped GEMM kernels: instruction counts"
    grep -oE "Function : [^ ]+|QGMMA[.A-Z0-9]*|HGMMA[.A-Z0-9]*|LDL[.A-Z0-9]*|STL[.A-Z0-9]*|UTMALDG[.A-Z0-9]*|SYNCS[.A-Z0-9]*|USETMAXREG[.A-Z0-9]*|WARPGROUP[.A-Z0-9]*" "$out/sass.txt" | sort | uniq -c
  } | tee "$out/sass-summary.txt"
fi

if ((rc_tests != 124)); then
  stamp baseline
  # The card's FP8 rate through cuBLAS (PyTorch), as a yardstick for this machine on this day.
  timeout 60 python3 scripts/fp8-matmul-baseline.py 2>&1 | tail -n 3
  stamp bench
  quick=--quick
  [[ $mode == --full ]] && quick=
  nvidia-smi dmon -s pc -d 1 > "$out/dmon.txt" 2>&1 &
  dmon=$!
  timeout 150 build-gpu/bin/epmoe bench gemm $quick --json "$out/gemm.json" > "$out/bench.log" 2>&1
  echo "bench exit: $?"
  kill "$dmon" 2> /dev/null
  cat "$out/bench.log"
  echo "clocks and power during the bench (nvidia-smi dmon, every 3rd second):"
  awk 'NR <= 2 || NR % 3 == 0' "$out/dmon.txt" | head -n 40
  # At most 8 files come back from the device tool: what is printed above need not.
  rm -f "$out/dmon.txt" "$out/sass-summary.txt"
fi

if [[ ${EPMOE_GEMM_NCU:-0} == 1 ]]; then
  # Nsight Compute (clocks left alone) on one launch of the 8 x 4096, 4096 x 7168 contiguous main
  # line: details_ROW.txt and the per-instruction stall samples src_ROW.csv.gz (scripts/gemm-ncu.sh).
  stamp ncu
  bash scripts/gemm-ncu.sh "$out" 8x4096x4096
fi
stamp done
