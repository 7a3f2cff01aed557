#!/usr/bin/env bash
# The GPU layer's device check in one call (issue 7): build, every GPU test, the multi-rank tests,
# and `epmoe run` at DeepSeek-V3 dims in the configurations the issue's bars name. Run from the
# source root in a directory of its own (files another checkout left in a shared one are globbed
# into the build).
#
# Usage: scripts/layer-check.sh OUTDIR [RANKS] [--no-tests]   (EPMOE_LAYER_RUNS: other runs, below)
# OUTDIR receives tests.log, runs.log, layer.json ({"commit", "device", "date", "pass", "runs": {name: the
# run's --json with its "exit", or {"error", "exit"} where it left none}}) and trace.json (the main run's timeline, Chrome trace / Perfetto).
set -uo pipefail
out=${1:?usage: scripts/layer-check.sh OUTDIR [RANKS] [--no-tests]}
ranks=${2:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
tests=${3:-}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EPMOE_COMMIT=${EPMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
tmp=$(mktemp -d)
export EPMOE_RANKS=$ranks
start=$SECONDS
stamp() { echo "== $1 ($((SECONDS - start)) s)"; }

stamp build
cmake --preset gpu >"$tmp/configure.log" 2>&1 || { tail -n 30 "$tmp/configure.log"; exit 1; }
if ! timeout 400 cmake --build --preset gpu -j "$(nproc)" >"$tmp/build.log" 2>&1; then
  grep -E "error|FAILED" "$tmp/build.log" | head -n 30
  exit 1
fi
status=0
# shellcheck source=scripts/device-common.sh
source "$(dirname "$0")/device-common.sh"
use_matching_nccl build-gpu/bin/epmoe || status=1
if [[ $tests != --no-tests ]]; then
  stamp gpu-tests
  timeout 420 ctest --test-dir build-gpu -L gpu -E CommGpu --no-tests=error --output-on-failure -j 8 >"$out/tests.log" 2>&1 ||
    status=1
  grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)" "$out/tests.log" | tail -n 20
  stamp "compute-sanitizer (layer tests, tiny model)"
  for tool in memcheck racecheck; do
    timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 build-gpu/tests/epmoe_gpu_tests \
      --gtest_filter='*GpuLayerOneRank*tiny*:GpuLayer.*' >"$tmp/$tool.log" 2>&1 || status=1
    echo "$tool: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$tmp/$tool.log" | tr '\n' ' ' | cut -c1-200)"
    # The first reports in full (a hazard's kernel, addresses and lines), then the summary.
    { grep -v -E "^\[ +(RUN|OK) +\]" "$tmp/$tool.log" | grep -E -A 12 "^========= [A-Z]" | head -n 80
      tail -n 5 "$tmp/$tool.log"; } >>"$out/tests.log"
  done
  if ((ranks > 1)); then
    stamp "$ranks-rank tests"
    timeout 300 build-gpu/bin/epmoe launch -n "$ranks" --timeout 280 -- build-gpu/tests/epmoe_comm_tests \
      "$EPMOE_LAUNCHED_COMM_FILTER" >>"$out/tests.log" 2>&1 || status=1
    grep -E "^\[rank 0\] \[  (PASSED|FAILED)" "$out/tests.log" | tail -n 5
  fi
fi

# name|arguments[|VAR=VALUE ...]: each run's JSON lands in $tmp/run-NAME.json; the optional third field
# sets environment variables for that run only. EPMOE_LAYER_RUNS (one name|arguments
# per line, $ranks and $tmp expanded) replaces the list (scripts/scaleout-check.sh uses it).
runs=(
  "main|--preset deepseek-v3 --redundant-experts 32 --ranks $ranks --trace $tmp/trace.json"
  "decode128|--preset deepseek-v3 --redundant-experts 32 --ranks $ranks --tokens 128 --steps 300 --prompt-tokens 0"
  "decode128-whole|--preset deepseek-v3 --redundant-experts 32 --ranks $ranks --tokens 128 --steps 300 --prompt-tokens 0|EPMOE_LAYER_WHOLE_DISPATCH=1"
  "decode128-tbo|--preset deepseek-v3 --redundant-experts 32 --ranks $ranks --tokens 128 --steps 300 --prompt-tokens 0 --tbo"
  "decode32|--preset deepseek-v3 --redundant-experts 32 --ranks $ranks --tokens 32 --steps 500 --prompt-tokens 0"
  "prefill8192|--preset deepseek-v3 --redundant-experts 32 --ranks $ranks --steps 0 --prompt-tokens 8192 --prompts 4 --chunk 8192 --tbo"
  "prefill8192-comm48|--preset deepseek-v3 --redundant-experts 32 --ranks $ranks --steps 0 --prompt-tokens 8192 --prompts 4 --chunk 8192 --tbo --tbo-comm-sms 48"
  "prefill8192-whole|--preset deepseek-v3 --redundant-experts 32 --ranks $ranks --steps 0 --prompt-tokens 8192 --prompts 4 --chunk 8192 --tbo|EPMOE_LAYER_WHOLE_DISPATCH=1"
  "prefill8192-ce|--preset deepseek-v3 --redundant-experts 32 --ranks $ranks --steps 0 --prompt-tokens 8192 --prompts 4 --chunk 8192 --tbo|EPMOE_COMM_SEND_CE=2"
  "decode128-w4a8|--preset deepseek-v3 --redundant-experts 32 --ranks $ranks --quant w4a8 --tokens 128 --steps 300 --prompt-tokens 1000 --prompts 8"
  "one-gpu|--preset deepseek-v3 --redundant-experts 32 --ranks 1 --steps 200 --prompts 8"
  "zipf-rebalance|--preset deepseek-v3 --redundant-experts 32 --ranks $ranks --tokens 128 --steps 300 --prompt-tokens 0 --zipf ${EPMOE_ZIPF:-0.5} --rebalance"
  "zipf-rebalance-deepseek|--preset deepseek-v3 --redundant-experts 32 --ranks $ranks --tokens 128 --steps 300 --prompt-tokens 0 --zipf ${EPMOE_ZIPF:-0.5} --rebalance --eplb-slot-cost 0"
)
if [[ -n ${EPMOE_LAYER_RUNS:-} ]]; then
  mapfile -t runs < <(eval "printf '%s\n' \"$EPMOE_LAYER_RUNS\"" | sed '/^$/d')
fi
for r in "${runs[@]}"; do
  name=${r%%|*}
  args=${r#*|}
  envs=
  if [[ $args == *"|"* ]]; then  # a third field: VAR=VALUE ... for this run only
    envs=${args#*|}
    args=${args%%|*}
  fi
  stamp "run $name${envs:+ ($envs)}"
  # (Each run's output in a log of its own first, so that the lines shown are this run's: a run that
  # died before printing would otherwise show the previous run's numbers. Its exit code goes to layer.json.)
  rc=0
  # shellcheck disable=SC2086  # args and envs are word lists
  timeout 240 env $envs build-gpu/bin/epmoe run $args --json "$tmp/run-$name.json" >"$tmp/run-$name.log" 2>&1 || rc=$?
  ((rc == 0)) || status=1
  echo "$rc" >"$tmp/rc-$name"
  grep -E "^(\[rank 0\] )?(  (decode|prefill)|  first|check|  decode:|  prefill:)" "$tmp/run-$name.log" | tail -n 12
  { echo "== run $name (exit $rc)"; cat "$tmp/run-$name.log"; echo "--"; } >>"$out/runs.log"
done
cp "$tmp/trace.json" "$out/trace.json" 2>/dev/null || true
# Every run that was started has an entry: its JSON, or {"error", "exit"} where it left none (epmoe removes
# its --json on an error; 124: the time limit); `pass`: every run exited 0 and its check passed.
python3 - "$tmp" "$out/layer.json" <<'PY' || status=1
import datetime, glob, json, os, subprocess, sys
runs, ok = {}, True
for rc_file in sorted(glob.glob(sys.argv[1] + "/rc-*")):
    name = os.path.basename(rc_file)[3:]
    rc = int(open(rc_file).read().strip() or "1")
    try:
        runs[name] = json.load(open(f"{sys.argv[1]}/run-{name}.json"))
        runs[name]["exit"] = rc
        ok = ok and rc == 0 and runs[name].get("pass", False)
    except Exception as e:  # a run that failed leaves no or half a file
        runs[name] = {"error": f"no JSON ({e})", "exit": rc}
        ok = False
dev = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.split("\n")[0]
json.dump({"commit": os.environ.get("EPMOE_COMMIT", "unknown"), "device": dev, "ranks": int(os.environ.get("EPMOE_RANKS", "0")),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"), "pass": ok, "runs": runs},
          open(sys.argv[2], "w"), indent=1)
sys.exit(0 if ok else 1)
PY
stamp done
exit $status
