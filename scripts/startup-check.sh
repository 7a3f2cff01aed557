#!/usr/bin/env bash
# Where the first forward's start-up time goes, in one device call (the 1 s budget): builds the CLI,
# times `epmoe launch` alone (the launcher with a child that does nothing), runs `epmoe run` (decode
# only, DeepSeek-V3 dims) several times and collects each run's `startup_s`, then once more with
# NCCL's INIT/BOOTSTRAP/ALLOC logging, every line stamped with the monotonic clock, so that NCCL's
# own set-up can be split into its steps.
#
# Usage: scripts/startup-check.sh OUTDIR [RANKS]   (EPMOE_BUILD=0: use an existing build-gpu;
#        EPMOE_STARTUP_RUNS: how many plain runs, default 3; EPMOE_STARTUP_QUANT: fp8 or w4a8)
# OUTDIR receives startup.json ({"commit", "device", "ranks", "pass", "launch_only_s": [... (null: failed)],
# "runs": [startup_s, ...], "runs_nccl_probing_off": [startup_s, ...] (NCCL_IB_DISABLE=1
# NCCL_NET_PLUGIN=none NCCL_MNNVL_ENABLE=0)}), runs.log and nccl-init.log.
set -uo pipefail
out=${1:?usage: scripts/startup-check.sh OUTDIR [RANKS]}
ranks=${2:-2}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EPMOE_COMMIT=${EPMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
tmp=$(mktemp -d)
if [[ ${EPMOE_BUILD:-1} != 0 ]]; then
  { cmake --preset gpu && cmake --build --preset gpu -j "$(nproc)" --target epmoe_cli; } >"$out/build.log" 2>&1 ||
    { tail -n 30 "$out/build.log"; exit 1; }
fi
epmoe=build-gpu/bin/epmoe
status=0
# shellcheck source=scripts/device-common.sh
source scripts/device-common.sh
use_matching_nccl "$epmoe" || status=1
args=(run --preset deepseek-v3 --redundant-experts 32 --ranks "$ranks" --quant "${EPMOE_STARTUP_QUANT:-fp8}"
  --tokens 128 --steps 20 --prompt-tokens 0)

# The launcher by itself: its own start, CUDA's device count, one process per rank that exits at once.
launch_only=()
for i in 1 2 3; do
  t0=$EPOCHREALTIME
  if "$epmoe" launch -n "$ranks" -- true >/dev/null 2>&1; then
    launch_only+=("$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.3f", b - a }')")
  else
    status=1
    launch_only+=(failed)  # (no time for a launch that failed: null in startup.json)
  fi
done
echo "launcher alone (s): ${launch_only[*]}"

# one_run NAME [VAR=VALUE...]: one timed run, its output in a log of its own (the line shown is this
# run's), appended to runs.log; its exit code in $tmp/rc-NAME for startup.json.
one_run() {
  local name=$1 rc=0
  shift
  timeout 120 env "$@" "$epmoe" "${args[@]}" --json "$tmp/$name.json" >"$tmp/$name.log" 2>&1 || rc=$?
  ((rc == 0)) || status=1
  echo "$rc" >"$tmp/rc-$name"
  { echo "== $name (exit $rc)"; cat "$tmp/$name.log"; } >>"$out/runs.log"
  grep -E "first forward" "$tmp/$name.log" | tail -n 1 || echo "$name: no first forward (exit $rc)"
}
for i in $(seq 1 "${EPMOE_STARTUP_RUNS:-3}"); do one_run "run-$i"; done

# NCCL settings that skip probing a single node does not need (InfiniBand devices, the network
# plugin, multi-node NVLink): does NCCL's set-up get shorter? (not set by epmoe; measured only)
for i in 1 2; do
  echo -n "IB / net plugin / MNNVL probing off: "
  one_run "probe-off-$i" NCCL_IB_DISABLE=1 NCCL_NET_PLUGIN=none NCCL_MNNVL_ENABLE=0
done

# NCCL's own steps: INFO lines of its init, bootstrap and allocations, stamped as they arrive.
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,BOOTSTRAP,ALLOC,ENV timeout 120 "$epmoe" "${args[@]}" 2>&1 |
  python3 -u -c 'import sys, time
t0 = time.monotonic()
for line in sys.stdin:
    sys.stdout.write(f"{time.monotonic() - t0:8.3f} {line}")' >"$out/nccl-init.log" || status=1
grep -E "first forward|Init COMPLETE|init.cc" "$out/nccl-init.log" | head -n 20

python3 - "$tmp" "$out/startup.json" "$ranks" "${launch_only[@]}" <<'PY'
import datetime, glob, json, os, subprocess, sys
tmp, dst, ranks = sys.argv[1], sys.argv[2], int(sys.argv[3])
launch = [None if x == "failed" else float(x) for x in sys.argv[4:]]
ok = None not in launch
def startups(prefix):
    # Every run started (an rc file each): its startup_s, or {"error", "exit"} where it left no JSON.
    global ok
    out = []
    for rc_file in sorted(glob.glob(f"{tmp}/rc-{prefix}-*")):
        name = os.path.basename(rc_file)[3:]
        rc = int(open(rc_file).read().strip() or "1")
        ok = ok and rc == 0
        try:
            out.append(json.load(open(f"{tmp}/{name}.json")).get("startup_s", {}))
        except Exception as e:  # a failed run leaves no or half a file
            out.append({"error": f"no JSON ({e})", "exit": rc})
            ok = False
    return out
runs, probe_off = startups("run"), startups("probe-off")
dev = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                     text=True).stdout.split("\n")[0]
json.dump({"commit": os.environ.get("EPMOE_COMMIT", "unknown"), "device": dev, "ranks": ranks,
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
           "pass": ok, "launch_only_s": launch, "runs": runs,
           "runs_nccl_probing_off": probe_off}, open(dst, "w"), indent=1)
PY
exit $status
