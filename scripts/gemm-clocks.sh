#!/usr/bin/env bash
# The FP8 grouped GEMM's configurations one at a time, with the card's clock and power beside each
# time (issue 4; session 9 found the card power-capped at ~1.5 GHz with real data and ~1.98 GHz in
# the light ablations, so times are only comparable with their clocks), then the consumer loop alone
# (bench/probe/tensor_probe.cu gemm). One device call.
#
# Usage: scripts/gemm-clocks.sh OUTDIR [ROW [VARIANTS]]   (run from anywhere; EPMOE_BUILD=0: use an
#        existing build-gpu)
#   ROW      a contiguous anchor row GxMxN (default 8x4096x4096)
#   VARIANTS comma-separated bench lines: main and `.exp.*` / `.c2` / ... suffixes (default
#            main,.exp.no_promote,.exp.tensor_only,.exp.no_math,main)
# EPMOE_GEMM_CLOCKS_PROBE=0 skips the probe. Lines are timed back to back (EPMOE_BENCH_GEMM_TIMING=sustained
# unless set): the clock under continuous load is the question here.
# Each line runs alone for EPMOE_GEMM_CLOCKS_REPEAT (default 10) timings of 100 launches while NVML is
# read every 20 ms. OUTDIR receives clocks.json ({"commit", "device", "row", "lines": [{"variant",
# "time_us_median", "time_us": [...], "sm_mhz_median", "sm_mhz_min", "power_w_median", "samples",
# "loop_cycles_per_wgmma", "loop_mhz", "clock_reasons": {NVML clocks-event mask: samples}}],
# "probe": "..."}), samples.txt and probe.txt.
set -uo pipefail
out=${1:?usage: scripts/gemm-clocks.sh OUTDIR [ROW [VARIANTS]]}
row=${2:-8x4096x4096}
variants=${3:-main,.exp.no_promote,.exp.tensor_only,.exp.no_math,main}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EPMOE_COMMIT=${EPMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [[ ${EPMOE_BUILD:-1} != 0 ]]; then
  { cmake --preset gpu && cmake --build --preset gpu -j "$(nproc)" --target epmoe_cli epmoe_tensor_probe; } > "$out/build.log" 2>&1 ||
    { tail -n 30 "$out/build.log"; exit 1; }
fi
export LD_LIBRARY_PATH=$PWD/build-gpu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
tmp=$(mktemp -d)

# NVML sampler: time, SM clock (MHz), power (W), until the file `stop` appears.
cat > "$tmp/sampler.py" << 'PY'
import os, sys, time
import pynvml
pynvml.nvmlInit()
h = pynvml.nvmlDeviceGetHandleByIndex(0)
out, stop = open(sys.argv[1], "w"), sys.argv[2]
end = time.time() + 600
# Why the clock is below its maximum: NVML's clocks-event (throttle) reasons, a bit mask (0x1 idle,
# 0x4 SW power cap, 0x8 HW slowdown, 0x20 SW thermal, 0x40 HW thermal, 0x80 HW power brake, ...).
reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
    pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
while not os.path.exists(stop) and time.time() < end:
    out.write(f"{time.time():.3f} {pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)} "
              f"{pynvml.nvmlDeviceGetPowerUsage(h) / 1000:.0f} {reasons(h)}\n")
    out.flush()
    time.sleep(0.02)
PY
timeout 600 python3 "$tmp/sampler.py" "$out/samples.txt" "$tmp/stop" &
sampler=$!
sleep 1
: > "$tmp/spans.txt"
i=0
IFS=, read -r -a lines <<< "$variants"
for v in "${lines[@]}"; do
  i=$((i + 1))
  t0=$(date +%s.%N)
  EPMOE_BENCH_GEMM_TIMING=${EPMOE_BENCH_GEMM_TIMING:-sustained} EPMOE_BENCH_GEMM_ROW=$row EPMOE_BENCH_GEMM_EXPERIMENTS=1 EPMOE_BENCH_GEMM_TRACE=1 EPMOE_BENCH_GEMM_VARIANTS=$v \
    EPMOE_BENCH_GEMM_REPEAT=${EPMOE_GEMM_CLOCKS_REPEAT:-10} timeout 120 build-gpu/bin/epmoe bench gemm \
    --json "$tmp/line$i.json" > "$tmp/line$i.log" 2>&1 || { echo "line $v failed:"; tail -n 5 "$tmp/line$i.log"; }
  echo "$i $v $t0 $(date +%s.%N)" >> "$tmp/spans.txt"
  sleep 2  # the clocks between lines
done
touch "$tmp/stop"
wait "$sampler" 2> /dev/null

# The consumer loop alone.
if [[ ${EPMOE_GEMM_CLOCKS_PROBE:-1} != 0 ]]; then
  timeout 60 build-gpu/bin/epmoe_tensor_probe gemm > "$out/probe.txt" 2>&1 || { echo "probe failed:"; tail -n 5 "$out/probe.txt"; }
fi

python3 - "$tmp" "$out" "$row" << 'PY'
import json, statistics, sys
tmp, out, row = sys.argv[1:4]
samples = [tuple(map(float, l.split())) for l in open(out + "/samples.txt") if l.strip()]
lines, meta = [], {}
for l in open(tmp + "/spans.txt"):
    i, variant, t0, t1 = l.split()
    try:
        d = json.load(open(f"{tmp}/line{i}.json"))
    except (OSError, ValueError):
        continue
    meta = meta or d
    times = [r["time_us"] for r in d["results"]]
    # The first ~0.8 s of a line is its process start and warm-up.
    xs = [s for s in samples if float(t0) + 0.8 <= s[0] <= float(t1) - 0.1]
    line = {"variant": variant, "time_us": times, "time_us_median": statistics.median(times) if times else None,
            "samples": len(xs)}
    # The consumer loop's cycles per wgmma and its own clock (EPMOE_BENCH_GEMM_TRACE=1 above).
    for key in ("loop_cycles_per_wgmma", "loop_mhz"):
        vals = [r["params"][key] for r in d["results"] if key in r["params"]]
        if vals:
            line[key] = statistics.median(vals)
    if xs:
        line.update(sm_mhz_median=statistics.median(x[1] for x in xs), sm_mhz_min=min(x[1] for x in xs),
                    power_w_median=statistics.median(x[2] for x in xs))
        if all(len(x) > 3 for x in xs):
            masks = [int(x[3]) for x in xs]
            line["clock_reasons"] = {hex(m): masks.count(m) for m in sorted(set(masks))}
    lines.append(line)
    print(f"{variant:32s} {line['time_us_median'] or 0:8.0f} us  "
          f"{line.get('sm_mhz_median', 0):6.0f} MHz (min {line.get('sm_mhz_min', 0):.0f})  "
          f"{line.get('power_w_median', 0):4.0f} W  ({len(xs)} samples)"
          + (f"  loop {line['loop_cycles_per_wgmma']:.1f} cycles/wgmma" if "loop_cycles_per_wgmma" in line else "")
          + (f"  reasons {line['clock_reasons']}" if "clock_reasons" in line else ""))
try:
    probe = open(out + "/probe.txt").read()
except OSError:
    probe = ""
print(probe)
json.dump({"commit": meta.get("commit"), "device": meta.get("device"), "date": meta.get("date"), "row": row,
           "lines": lines, "probe": probe}, open(out + "/clocks.json", "w"), indent=1)
PY
rm -rf "$tmp"
