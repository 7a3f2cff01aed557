#!/usr/bin/env bash
# FP8 grouped GEMM v5, second device call: GPU tests + memcheck of the new build, its SASS, the
# contiguous bench of the new build (with the timing ablations) beside the v4 build (carried from
# the first call) in the same run, and Nsight Compute on the new 8 x 4096, 4096 x 7168 main line.
# Usage (repo root on the device): scripts/fp8-v5-device2.sh OUTDIR NEW_TARBALL OLD_TARBALL
set -uo pipefail
out=${1:?outdir}; new_tgz=${2:?new}; old_tgz=${3:?old}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
start=$SECONDS
stamp() { echo "== $1 ($((SECONDS - start)) s)"; }
rm -rf /tmp/fp8new /tmp/fp8old; mkdir -p /tmp/fp8new /tmp/fp8old
tar xzf "$new_tgz" -C /tmp/fp8new && tar xzf "$old_tgz" -C /tmp/fp8old || exit 1
base_ld=/usr/local/cuda/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
new() { LD_LIBRARY_PATH=/tmp/fp8new/build-f:$base_ld "$@"; }
old() { LD_LIBRARY_PATH=/tmp/fp8old/build-f:$base_ld "$@"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,power.limit --format=csv,noheader
stamp tests
tests=/tmp/fp8new/build-f/tests/epmoe_gpu_tests
new timeout 120 "$tests" --gtest_filter='*GroupedGemm*' > "$out/gpu-tests.log" 2>&1
echo "gpu tests exit: $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|tests ran" "$out/gpu-tests.log" | head -n 30
stamp memcheck
san=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
new timeout 90 "$san" --tool memcheck --error-exitcode 1 "$tests" \
  --gtest_filter='*GroupedGemmMaskedGpu*all_empty*:*GroupedGemmMaskedGpu*block64*:*GroupedGemmContiguousGpu*single_row_trailing*:*GroupedGemmContiguousGpu*holes_block_n128*' \
  > "$out/memcheck.log" 2>&1
echo "memcheck exit: $?"; grep -E "ERROR SUMMARY|\[  PASSED  \]|\[  FAILED  \]" "$out/memcheck.log" | tail -n 4
stamp sass
dump=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
"$dump" -sass /tmp/fp8new/build-f/libepmoe.so 2> /dev/null |
  awk '/Function : .*fp8_grouped_gemm_kernel/{p=1} /Function : / && !/fp8_grouped_gemm_kernel/{p=0} p' > "$out/sass-new.txt"
grep -oE "Function : [^ ]+|QGMMA[.A-Z0-9x]*|WARPGROUP[.A-Z0-9]*|LDL[.A-Z0-9]*|STL[.A-Z0-9]*|R2UR" "$out/sass-new.txt" | sort | uniq -c
stamp bench
nvidia-smi dmon -s pc -d 1 > "$out/dmon.txt" 2>&1 &
dmon=$!
bench() {  # tag, binary runner, experiments
  EPMOE_BENCH_GEMM_ONLY=contiguous EPMOE_BENCH_GEMM_EXPERIMENTS=$3 $2 timeout 150 /tmp/fp8$2/build-f/bin/epmoe bench gemm --quick \
    --json "$out/gemm-$1.json" > "$out/bench-$1.log" 2>&1
  echo "bench $1 exit: $?"
}
bench new new 1
bench old old 0
bench new2 new 0
kill "$dmon" 2> /dev/null
for t in new old new2; do
  echo "-- $t"; grep -E "^gemm\.contiguous" "$out/bench-$t.log" | awk '{for(i=1;i<=NF;i++) if($i=="us") t=$(i-1); n=$1; g="";m="";nn="";k=""; for(i=2;i<=NF;i++){split($i,a,"="); if(a[1]=="groups")g=a[2]; if(a[1]=="m_per_group")m=a[2]; if(a[1]=="n")nn=a[2]; if(a[1]=="k")k=a[2]; if(a[1]=="deepgemm_us")d=a[2]} printf "%-52s %4sx%-5s %5sx%-5s %9s us  dg %5s  x%.3f\n", n, g, m, nn, k, t, d, d/t}'
done
awk 'NR <= 2 || NR % 5 == 0' "$out/dmon.txt" | head -n 40
stamp ncu
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -n 1)
EPMOE_BENCH_GEMM_ROW=8x4096x4096 EPMOE_BENCH_GEMM_MAIN_ONLY=1 EPMOE_BENCH_GEMM_EXPERIMENTS=0 EPMOE_BENCH_GEMM_ONLY=contiguous \
  new timeout 120 "$ncu" --clock-control none --kernel-name regex:fp8_grouped_gemm --launch-skip 3 --launch-count 1 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  --section SourceCounters --section InstructionStats --import-source no -f -o "$out/prof" \
  /tmp/fp8new/build-f/bin/epmoe bench gemm --quick > "$out/ncu-run.log" 2>&1
echo "ncu exit: $?"
"$ncu" -i "$out/prof.ncu-rep" --page details > "$out/ncu-details.txt" 2>&1
"$ncu" -i "$out/prof.ncu-rep" --page source --csv --print-source sass > "$out/ncu-source.csv" 2>&1
grep -E "SM Frequency|Duration|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|highest-utilized" "$out/ncu-details.txt" | head -n 12
stamp pack
cd "$out" && gzip -9 sass-new.txt ncu-source.csv 2> /dev/null
rm -f dmon.txt prof.ncu-rep
tar czf results2.tgz --remove-files $(ls | grep -v results2.tgz) 2> /dev/null
ls -la "$out"
stamp done
