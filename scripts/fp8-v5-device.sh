#!/usr/bin/env bash
# FP8 grouped GEMM v5 evidence run (one device call): carried binaries (built off the device),
# the kernel's SASS, the contiguous bench with the v5 timing ablations, and Nsight Compute on one
# launch of the 8 x 4096, 4096 x 7168 main line.
# Usage (repo root on the device): scripts/fp8-v5-device.sh OUTDIR TARBALL [ncu|noncu] [tests]
set -uo pipefail
out=${1:?outdir}; tarball=${2:?tarball}; mode=${3:-ncu}; tests=${4:-}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
start=$SECONDS
stamp() { echo "== $1 ($((SECONDS - start)) s)"; }
work=/tmp/fp8b; rm -rf "$work"; mkdir -p "$work"; tar xzf "$tarball" -C "$work" || exit 1
export LD_LIBRARY_PATH=$work/build-f:/usr/local/cuda/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
ldd "$work/build-f/bin/epmoe" | grep "not found"
bin=$work/build-f/bin/epmoe
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,power.limit --format=csv,noheader
if [[ -n $tests ]]; then
  stamp tests
  timeout 120 "$work/build-f/tests/epmoe_gpu_tests" --gtest_filter='*GroupedGemm*' > "$out/gpu-tests.log" 2>&1
  echo "gpu tests exit: $?"; grep -E "^\[  (PASSED|FAILED) |^\[  FAILED" "$out/gpu-tests.log" | head -n 30
fi
stamp sass
dump=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
"$dump" -sass "$work/build-f/libepmoe.so" 2> /dev/null |
  awk '/Function : .*fp8_grouped_gemm_kernel/{p=1} /Function : / && !/fp8_grouped_gemm_kernel/{p=0} p' > "$out/sass.txt"
grep -oE "Function : [^ ]+|QGMMA[.A-Z0-9x]*|WARPGROUP[.A-Z0-9]*|LDL[.A-Z0-9]*|STL[.A-Z0-9]*" "$out/sass.txt" | sort | uniq -c
stamp bench
nvidia-smi dmon -s pc -d 1 > "$out/dmon.txt" 2>&1 &
dmon=$!
EPMOE_BENCH_GEMM_ONLY=contiguous EPMOE_BENCH_GEMM_EXPERIMENTS=${EXPERIMENTS:-1} timeout ${BENCH_S:-150} "$bin" bench gemm --quick \
  --json "$out/gemm.json" > "$out/bench.log" 2>&1
echo "bench exit: $?"
kill "$dmon" 2> /dev/null
grep -E "gemm\.contiguous" "$out/bench.log" | sed -E 's/  +/ /g' | cut -c1-200
awk 'NR <= 2 || NR % 4 == 0' "$out/dmon.txt" | head -n 30
if [[ $mode == ncu ]]; then
  stamp ncu
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -n 1)
  EPMOE_BENCH_GEMM_ROW=8x4096x4096 EPMOE_BENCH_GEMM_MAIN_ONLY=1 EPMOE_BENCH_GEMM_EXPERIMENTS=0 EPMOE_BENCH_GEMM_ONLY=contiguous \
    timeout 150 "$ncu" --clock-control none --kernel-name regex:fp8_grouped_gemm --launch-skip 3 --launch-count 1 \
    --set full --import-source no -f -o "$out/prof" "$bin" bench gemm --quick > "$out/ncu-run.log" 2>&1
  echo "ncu exit: $?"; tail -n 5 "$out/ncu-run.log"
  "$ncu" -i "$out/prof.ncu-rep" --page details > "$out/ncu-details.txt" 2>&1
  "$ncu" -i "$out/prof.ncu-rep" --page source --csv --print-source sass > "$out/ncu-source.csv" 2>&1
  grep -E "SM Frequency|Duration|Compute \(SM\) Throughput|Memory Throughput|L1/TEX Cache Throughput|L2 Cache Throughput|DRAM Throughput|Issue Slots Busy|Executed Ipc A|No Eligible|Registers Per|Shared Memory Configuration|Bank" "$out/ncu-details.txt" | head -n 40
fi
stamp pack
cd "$out" && gzip -9 sass.txt ncu-source.csv 2> /dev/null
rm -f dmon.txt prof.ncu-rep
tar czf results.tgz --remove-files $(ls | grep -v results.tgz) 2> /dev/null
ls -la "$out"
stamp done
