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
cd "$(dirname "$0")/.."
ranks=${2:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EPMOE_COMMIT=${EPMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
tmp=$(mktemp -d)

{
  nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -n $((ranks + 2))
} >"$out/machine.txt" 2>&1
[ -x build-gpu/bin/epmoe ] || { cmake --preset gpu >/dev/null && cmake --build --preset gpu -j "$(nproc)" >"$tmp/build.log" 2>&1; } ||
  { tail -n 30 "$tmp/build.log"; exit 1; }
# A tree built elsewhere (the CPU machine: NCCL 2.28.9 headers) needs a matching libnccl first on the path.
if nccl_dir=$(scripts/nccl-lib-dir.sh build-gpu/bin/epmoe); then
  [ -n "$nccl_dir" ] && export LD_LIBRARY_PATH="$nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
  echo "no libnccl matching the headers epmoe was built against: the communicator will refuse to start" >&2
  status_nccl=1
fi
ldd build-gpu/bin/epmoe | grep -i nccl >>"$out/machine.txt"
build-gpu/bin/epmoe version >>"$out/machine.txt" 2>&1

status=${status_nccl:-0}
echo "== single-GPU tests"
ctest --test-dir build-gpu -L gpu -E 'CommGpu' -j 8 >"$tmp/gpu-tests.log" 2>&1 || status=1
grep -E "tests passed|tests failed" "$tmp/gpu-tests.log"
echo "== ${ranks}-rank communication tests"
timeout 600 build-gpu/bin/epmoe launch -n "$ranks" --timeout 580 -- build-gpu/tests/epmoe_comm_tests \
  >"$tmp/comm-tests.log" 2>&1 || status=1
grep -E "PASSED|FAILED|SKIPPED|error|Error" "$tmp/comm-tests.log" | tail -n 30
echo "== benchmarks"
for what in silu_quant permute gather eplb router; do
  build-gpu/bin/epmoe bench "$what" --json "$tmp/bench-$what.json" >>"$tmp/bench.log" 2>&1 || status=1
done
timeout 600 build-gpu/bin/epmoe launch -n "$ranks" --timeout 580 -- \
  sh -c "build-gpu/bin/epmoe bench comm --json $tmp/bench-comm-rank\$EPMOE_RANK.json" >>"$tmp/bench.log" 2>&1 || status=1
grep -E ' us ' "$tmp/bench.log" | grep -v '^\[rank 1\]'
python3 - "$tmp" "$out/bench.json" <<'PY'
import glob, json, sys
merged = None
for f in sorted(glob.glob(sys.argv[1] + "/bench-*.json")):
    d = json.load(open(f))
    if merged is None:
        merged = {k: v for k, v in d.items() if k != "results"}
        merged["results"] = []
    for r in d["results"]:
        if "rank" in f:
            r.setdefault("params", {})["rank"] = int(f.split("rank")[-1].split(".")[0])
        merged["results"].append(r)
json.dump(merged or {}, open(sys.argv[2], "w"), indent=2)
PY
tar czf "$out/logs.tar.gz" -C "$tmp" .
exit $status
