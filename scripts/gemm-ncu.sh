#!/usr/bin/env bash
# Nsight Compute (clocks left alone) on one launch of the FP8 grouped GEMM's main line per bench row,
# with the binary at hand: gemm-device.sh's build, or one built elsewhere and carried (no build on
# the device: ~100 s of device time saved). Per row:
# details_ROW.txt (the details page), src_ROW.csv.gz (per-SASS-instruction stall samples) and
# regions_ROW.txt / .json (those samples by code region: scripts/ncu-regions.py, when the build's
# object file is at hand).
#
# Usage: scripts/gemm-ncu.sh OUTDIR [ROW ...]       ROW: GxMxN of `epmoe bench gemm` (default: the
#        K = 2048 and K = 7168 rows of 8 x 4096, i.e. 8x4096x7168 8x4096x4096)
# The binary: build-gpu/bin/epmoe if present, else build/bin/epmoe (built here for sm_90a and carried,
# e.g. run's carry ["build/bin/epmoe", "build/libepmoe.so"]); its library directory goes first on
# LD_LIBRARY_PATH.
set -uo pipefail
out=${1:?usage: scripts/gemm-ncu.sh OUTDIR [ROW ...]}
shift
rows=("$@")
((${#rows[@]})) || rows=(8x4096x7168 8x4096x4096)
mkdir -p "$out"
bin=build-gpu/bin/epmoe
[[ -x $bin ]] || bin=build/bin/epmoe
[[ -x $bin ]] || { echo "gemm-ncu: no epmoe binary (build-gpu/bin or build/bin)" >&2; exit 1; }
export LD_LIBRARY_PATH="$(cd "$(dirname "$bin")/.." && pwd):${LD_LIBRARY_PATH:-}"
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -n 1)
[[ -n $ncu ]] || { echo "gemm-ncu: ncu not found" >&2; exit 1; }
for row in "${rows[@]}"; do
  EPMOE_BENCH_GEMM_ROW=$row EPMOE_BENCH_GEMM_VARIANTS=main EPMOE_BENCH_GEMM_ONLY=contiguous \
    timeout 90 "$ncu" --clock-control none --kernel-name regex:fp8_grouped_gemm --launch-skip 3 --launch-count 1 \
    --set full --import-source no -f -o "$out/p_$row" "$bin" bench gemm --quant fp8 --quick > "$out/run_$row.log" 2>&1
  echo "ncu $row exit: $?"
  [[ -f $out/p_$row.ncu-rep ]] || { tail -n 5 "$out/run_$row.log"; continue; }
  "$ncu" -i "$out/p_$row.ncu-rep" --page details > "$out/details_$row.txt" 2>&1
  "$ncu" -i "$out/p_$row.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip -9 > "$out/src_$row.csv.gz"
  # The samples by code region, the regions from the build's line table (where pyelftools is).
  obj=$(dirname "$bin")/../CMakeFiles/epmoe.dir/src/gemm/fp8_grouped_gemm.cu.o
  if [[ -f $obj ]]; then
    python3 "$(dirname "$0")/ncu-regions.py" "$out/src_$row.csv.gz" "$obj" --json "$out/regions_$row.json" \
      > "$out/regions_$row.txt" 2>&1 || echo "ncu-regions failed (see regions_$row.txt)"
  fi
  rm -f "$out/p_$row.ncu-rep"
  grep -E "SM Frequency|^    Duration|Issue Slots Busy|No Eligible" "$out/details_$row.txt" | head -n 6
done
