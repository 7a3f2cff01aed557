#!/usr/bin/env bash
# Multi-GPU check in one call (run from the repository root of a built tree, or it builds):
# the single-GPU tests, the multi-rank communication tests under `epmoe launch`, and the
# kernel and communication benchmarks. Writes at most 8 files into OUTDIR.
#
# Usage: scripts/comm-check.sh OUTDIR [RANKS]      (RANKS defaults to the GPUs present)
set -uo pipefail
out=${1:?usage: scripts/comm-check.sh OUTDIR [RANKS]}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 1
ranks=${2:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EPMOE_COMMIT=${EPMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
tmp=$(mktemp -d)

{
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -n $((ranks + 2))
} >"$out/machine.txt" 2>&1
# shellcheck source=scripts/device-common.sh
source scripts/device-common.sh
# Always built (a no-op when up to date): the lent machine keeps build outputs between calls, and a
# binary older than the sources would be tested under the sources' commit. EPMOE_BUILD=0: as it is.
if [[ ${EPMOE_BUILD:-1} != 0 ]]; then
  { cmake --preset gpu >/dev/null && cmake --build --preset gpu -j "$(nproc)" >"$tmp/build.log" 2>&1; } ||
    { tail -n 30 "$tmp/build.log"; exit 1; }
fi
# A tree built elsewhere (the CPU machine: NCCL 2.28.9 headers) needs a matching libnccl first on the path.
use_matching_nccl build-gpu/bin/epmoe || status_nccl=1
ldd build-gpu/bin/epmoe | grep -i nccl >>"$out/machine.txt"
build-gpu/bin/epmoe version >>"$out/machine.txt" 2>&1

status=${status_nccl:-0}
echo "== single-GPU tests"
ctest --test-dir build-gpu -L gpu -E 'CommGpu' --no-tests=error -j 8 >"$tmp/gpu-tests.log" 2>&1 || status=1
grep -E "tests passed|tests failed" "$tmp/gpu-tests.log"
echo "== ${ranks}-rank communication tests"
timeout 600 build-gpu/bin/epmoe launch -n "$ranks" --timeout 580 -- build-gpu/tests/epmoe_comm_tests \
  "$EPMOE_LAUNCHED_COMM_FILTER" >"$tmp/comm-tests.log" 2>&1 || status=1
grep -E "PASSED|FAILED|SKIPPED|error|Error" "$tmp/comm-tests.log" | tail -n 30
echo "== benchmarks"
for what in silu_quant permute gather eplb router; do
  build-gpu/bin/epmoe bench "$what" --json "$tmp/bench-$what.json" >>"$tmp/bench.log" 2>&1 || status=1
done
timeout 600 build-gpu/bin/epmoe launch -n "$ranks" --timeout 580 -- \
  sh -c "build-gpu/bin/epmoe bench comm --json $tmp/bench-comm-rank\$EPMOE_RANK.json" >>"$tmp/bench.log" 2>&1 || status=1
grep -E ' us ' "$tmp/bench.log" | grep -v '^\[rank 1\]'
# One bench.json: every expected suite's rows (each rank's for comm); a suite whose JSON is missing (its
# command failed, and epmoe removed the file) or unreadable is a failure in `failures`, and `pass` is
# true only when every suite's file is there and passed.
python3 - "$tmp" "$out/bench.json" "$ranks" <<'PY' || status=1
import json, sys
tmp, dst, ranks = sys.argv[1], sys.argv[2], int(sys.argv[3])
expected = [(w, None) for w in ("silu_quant", "permute", "gather", "eplb", "router")]
expected += [("comm", r) for r in range(ranks)]
merged = {"results": [], "failures": [], "pass": True}
for what, rank in expected:
    f = f"{tmp}/bench-{what}.json" if rank is None else f"{tmp}/bench-comm-rank{rank}.json"
    try:
        d = json.load(open(f))
    except Exception as e:
        merged["failures"].append(f"{what}{'' if rank is None else f' rank {rank}'}: no results ({e})")
        merged["pass"] = False
        continue
    for k in ("commit", "device", "date", "floor_gbps", "floor_gbps_source"):
        if k in d:
            merged.setdefault(k, d[k])
    merged["failures"] += d.get("failures", [])
    merged["pass"] = merged["pass"] and d.get("pass", True)
    for r in d["results"]:
        if rank is not None:
            r.setdefault("params", {})["rank"] = rank
        merged["results"].append(r)
json.dump(merged, open(dst, "w"), indent=2)
sys.exit(0 if merged["pass"] else 1)
PY
tar czf "$out/logs.tar.gz" -C "$tmp" .
exit "$status"
