#!/usr/bin/env bash
# The scale-out runs of issue 8 in one call, for a machine with 4 or 8 GPUs: build, the multi-rank
# tests on every GPU, `epmoe bench comm` (normal 4096 tokens per rank, low-latency 1..256) and the
# layer (`epmoe run`: decode and prefill, FP8 and W4A8, 32 redundant experts, dynamic dispatch as
# in the seed's set-up, two-batch overlap timed against none). Run from the source root in a
# directory of its own.
#
# Usage: scripts/scaleout-check.sh OUTDIR [RANKS]     (RANKS defaults to the GPUs present)
# OUTDIR receives tests.log, comm.json (every rank's bench comm results), and from layer-check.sh
# layer.json, runs.log and trace.json. At 4 ranks (2026-11-30, 4 x H200) the steps took ~30 s (build,
# 64 cores), ~35 s (tests), ~150 s (bench comm) and ~60 s (the four runs): one device call of 600 s.
set -uo pipefail
out=${1:?usage: scripts/scaleout-check.sh OUTDIR [RANKS]}
ranks=${2:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EPMOE_COMMIT=${EPMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
tmp=$(mktemp -d)
status=0
echo "== build"
cmake --preset gpu >"$tmp/configure.log" 2>&1 || { tail -n 30 "$tmp/configure.log"; exit 1; }
timeout 400 cmake --build --preset gpu -j "$(nproc)" >"$tmp/build.log" 2>&1 || { grep -E "error|FAILED" "$tmp/build.log" | head -n 30; exit 1; }
# shellcheck source=scripts/device-common.sh
source "$(dirname "$0")/device-common.sh"
use_matching_nccl build-gpu/bin/epmoe || status=1
echo "== $ranks-rank tests"
timeout 150 build-gpu/bin/epmoe launch -n "$ranks" --timeout 140 -- build-gpu/tests/epmoe_comm_tests \
  "$EPMOE_LAUNCHED_COMM_FILTER" >"$out/tests.log" 2>&1 || status=1
grep -E "^\[rank 0\] \[  (PASSED|FAILED)" "$out/tests.log" | tail -n 5
echo "== bench comm"
timeout 240 build-gpu/bin/epmoe launch -n "$ranks" --timeout 230 -- \
  sh -c "build-gpu/bin/epmoe bench comm --json $tmp/comm-rank\$EPMOE_RANK.json" >"$tmp/comm.log" 2>&1 || status=1
grep -E ' us ' "$tmp/comm.log" | grep '^\[rank 0\]' | cut -c1-160
# Every rank's results, or {"error"} where a rank left none; `pass` only when every rank's are there and
# passed.
python3 - "$tmp" "$out/comm.json" "$ranks" <<'PY' || status=1
import json, sys
ranks, ok = {}, True
for r in range(int(sys.argv[3])):
    try:
        ranks[str(r)] = json.load(open(f"{sys.argv[1]}/comm-rank{r}.json"))
        ok = ok and ranks[str(r)].get("pass", True)
    except Exception as e:
        ranks[str(r)] = {"error": f"no results ({e})"}
        ok = False
json.dump({"pass": ok, "ranks": ranks}, open(sys.argv[2], "w"), indent=1)
sys.exit(0 if ok else 1)
PY
echo "== layer"
# The layer runs through scripts/layer-check.sh (its build is up to date; tests ran above).
common='--preset deepseek-v3 --redundant-experts 32 --dispatch-algorithm dynamic --ranks $ranks'
EPMOE_LAYER_RUNS="fp8|$common --tbo --trace \$tmp/trace.json
w4a8|$common --quant w4a8 --tbo
fp8-decode128|$common --tokens 128 --steps 300 --prompt-tokens 0
w4a8-decode128|$common --quant w4a8 --tokens 128 --steps 300 --prompt-tokens 0" \
  bash "$(dirname "$0")/layer-check.sh" "$out" "$ranks" --no-tests || status=1
exit $status
