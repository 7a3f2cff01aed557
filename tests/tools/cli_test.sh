#!/usr/bin/env bash
# End-to-end checks of the epmoe CLI. $1 is the epmoe binary.
# Each check is counted; the last line is "N passed, M failed" and the exit status is non-zero
# when any check failed.
set -uo pipefail
epmoe=$1
passed=0
failed=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

pass() { passed=$((passed + 1)); }
fail() {
  failed=$((failed + 1))
  echo "FAIL: $1"
  [[ -s "$tmp/stderr" ]] && sed 's/^/  stderr: /' "$tmp/stderr" | head -20
}
# check NAME CMD...: CMD must succeed (its stdout is kept in $tmp/stdout).
check() {
  local name=$1
  shift
  if "$@" >"$tmp/stdout" 2>"$tmp/stderr"; then pass; else fail "$name"; fi
}
# check_fails NAME PATTERN CMD...: CMD must exit non-zero and print PATTERN (grep -E) on stderr.
check_fails() {
  local name=$1 pattern=$2
  shift 2
  if "$@" >"$tmp/stdout" 2>"$tmp/stderr"; then
    fail "$name (exited 0)"
  elif ! grep -Eq -- "$pattern" "$tmp/stderr"; then
    fail "$name (stderr lacks '$pattern')"
  else
    pass
  fi
}

check "--help" "$epmoe" --help

# --- version ----------------------------------------------------------------------------------
# The CI machine's toolkit supplies both the NCCL headers and the library: they match.
check "version" "$epmoe" version --json "$tmp/version.json"
if grep -q "^NCCL: compiled against .*: match$" "$tmp/stdout" &&
  python3 - "$tmp/version.json" <<'PY'; then pass; else fail "version: text or JSON"; fi
import json, sys
doc = json.load(open(sys.argv[1]))
assert set(doc) == {"commit", "cuda_runtime", "cuda_driver", "gpus", "nccl"}, sorted(doc)
n = doc["nccl"]
assert n["match"] is True and n["compiled"] == n["loaded"] and n["compiled_code"] == n["loaded_code"], n
assert n["compiled_code"] >= 22800 and n["library"], n
for g in doc["gpus"]:
    assert g["sms"] > 0 and g["memory_gib"] > 0 and g["sm"].isdigit(), g
PY

# --- eplb -------------------------------------------------------------------------------------
# 2 layers x 16 experts; expert 5 (layer 0) and expert 12 (layer 1) are hot.
cat >"$tmp/load.json" <<'JSON'
{"load": [[10, 12, 9, 11, 10, 400, 8, 10, 12, 9, 11, 10, 10, 9, 11, 10],
          [5, 6, 5, 7, 5, 6, 5, 7, 5, 6, 5, 7, 300, 6, 5, 7]]}
JSON
# Checks the eplb JSON in $1 for L=2, E=16, P=$2: shapes, consistency, hot experts replicated.
validate_eplb() {
  python3 - "$1" "$2" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
P = int(sys.argv[2])
assert list(doc) == ["phy2log", "log2phy", "logcnt"], list(doc)
phy2log, log2phy, logcnt = doc["phy2log"], doc["log2phy"], doc["logcnt"]
assert len(phy2log) == len(log2phy) == len(logcnt) == 2
for l in range(2):
    assert len(phy2log[l]) == P and len(logcnt[l]) == 16 and len(log2phy[l]) == 16
    assert sum(logcnt[l]) == P and min(logcnt[l]) >= 1
    for e in range(16):
        slots = [p for p in range(P) if phy2log[l][p] == e]
        assert len(slots) == logcnt[l][e]
        row = log2phy[l][e]
        assert row[:len(slots)] == slots and all(x == -1 for x in row[len(slots):]), (l, e, row)
assert logcnt[0][5] == max(logcnt[0]) and logcnt[0][5] >= 2, logcnt[0]
assert logcnt[1][12] == max(logcnt[1]) and logcnt[1][12] >= 2, logcnt[1]
PY
}
# Hierarchical (groups 4 % nodes 2 == 0), to stdout.
check "eplb hierarchical runs" "$epmoe" eplb --load "$tmp/load.json" --replicas 24 --groups 4 --nodes 2 --gpus 4
cp "$tmp/stdout" "$tmp/hier.json"
check "eplb hierarchical output is a consistent placement" validate_eplb "$tmp/hier.json" 24
# Global (groups 3 % nodes 2 != 0), to --output.
check "eplb global --output runs" "$epmoe" eplb --load "$tmp/load.json" --replicas 20 --groups 3 --nodes 2 \
  --gpus 4 --output "$tmp/global.json"
cp "$tmp/stdout" "$tmp/eplb_output_stdout"  # (check sends test's own stdout to $tmp/stdout, emptying it)
check "eplb --output leaves stdout empty" test ! -s "$tmp/eplb_output_stdout"
check "eplb global output is a consistent placement" validate_eplb "$tmp/global.json" 20
check "eplb hierarchical runs again" "$epmoe" eplb --load "$tmp/load.json" --replicas 24 --groups 4 --nodes 2 --gpus 4
cp "$tmp/stdout" "$tmp/hier_again.json"
check "eplb is deterministic" cmp -s "$tmp/hier_again.json" "$tmp/hier.json"

# Bad inputs: clear message, non-zero exit.
echo '{"load": [[1, 2, 3' >"$tmp/bad_json.json"
echo '{"load": [[1, 2, 3, 4], [1, 2, 3]]}' >"$tmp/ragged.json"
echo '{"load": [[1, -2, 3, 4]]}' >"$tmp/negative.json"
echo '{"load": [[1, "x", 3, 4]]}' >"$tmp/string.json"
echo '{"counts": [[1, 2, 3, 4]]}' >"$tmp/no_load.json"
echo '{"load": [[1, 2, 3, 4]]}' >"$tmp/small.json"
check_fails "eplb missing file" "cannot open --load file" \
  "$epmoe" eplb --load "$tmp/missing.json" --replicas 4
check_fails "eplb bad JSON" "not valid JSON" "$epmoe" eplb --load "$tmp/bad_json.json" --replicas 4
check_fails "eplb ragged rows" "load\[1\] has 3 experts" "$epmoe" eplb --load "$tmp/ragged.json" --replicas 4
check_fails "eplb negative load" "load\[0\]\[1\] = -2 must be finite and non-negative" \
  "$epmoe" eplb --load "$tmp/negative.json" --replicas 4
check_fails "eplb non-number load" "load\[0\]\[1\].*must be a number" \
  "$epmoe" eplb --load "$tmp/string.json" --replicas 4
check_fails "eplb no load field" "\"load\" field" "$epmoe" eplb --load "$tmp/no_load.json" --replicas 4
check_fails "eplb replicas < experts" "--replicas \(2\) must be at least" \
  "$epmoe" eplb --load "$tmp/small.json" --replicas 2
check_fails "eplb replicas not a multiple of gpus" "--replicas \(6\) must be a multiple of --gpus \(4\)" \
  "$epmoe" eplb --load "$tmp/small.json" --replicas 6 --gpus 4
check_fails "eplb --replicas required" "replicas" "$epmoe" eplb --load "$tmp/small.json"

# --- run / check ------------------------------------------------------------------------------
# The main job at its defaults (tiny preset on the CPU), with JSON a script can read.
# The CPU path of `epmoe run` (--device cpu: on a GPU machine auto would pick the GPUs).
check "run defaults" "$epmoe" run --device cpu --steps 4 --prompt-tokens 300 --chunk 128 --json "$tmp/run.json"
check "run JSON" python3 - "$tmp/run.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
assert doc["pass"] is True, doc
for phase, mode in (("decode", "low-latency"), ("prefill", "normal")):
    p = doc[phase]
    assert p["mode"] == mode, p
    assert p["tokens_per_s"] > 0 and p["tokens"] > 0, p
    assert p["check"]["pass"] is True and p["check"]["overall"]["rel_l2"] < 1e-2, p
    # The GPU run's names too: the overall values at the check's top.
    assert p["check"]["rel_l2"] == p["check"]["overall"]["rel_l2"] and p["check"]["non_finite"] == 0, p
    assert p["ms_per_forward"] > 0 and p["check"]["tolerance"] == doc["tolerance"], p
    for block in ("phases_ms_per_forward", "phases_ms_all_forwards"):
        assert set(p[block]) >= {"route", "dispatch", "gemm", "combine", "shared", "total"}, p
assert doc["prefill"]["forwards"] == 3 and doc["prefill"]["tokens"] == 600, doc["prefill"]
assert doc["layer_mode"] == "auto", doc  # one layer served both phases
# What ran, as fields a script reads without parsing the config line: the build's commit, the model's
# dims and seed, the phase sizes.
assert doc["commit"] and doc["device"] == "cpu" and doc["date"].endswith("Z"), doc
model = doc["model"]
assert model["preset"] == "tiny" and model["seed"] == 1 and model["pow2_scales"] is False, model
assert model["hidden"] > 0 and model["experts"] > 0 and model["ranks"] == doc["ranks"], model
assert doc["decode_steps"] == 4 and doc["prefill_chunk"] == 128 and doc["prompt_tokens"] == 300, doc
PY
check "run w4a8 dynamic redundant" "$epmoe" run --device cpu --quant w4a8 --ranks 4 --redundant-experts 4 \
  --dispatch-algorithm dynamic --steps 2 --prompt-tokens 64
for ranks in 1 2 4; do
  for mode in normal low-latency; do
    for quant in fp8 w4a8 none; do
      check "check ranks=$ranks $mode $quant" "$epmoe" check --ranks "$ranks" --mode "$mode" --quant "$quant" --tokens 12
    done
  done
done
# One auto-mode layer: a decode batch in low-latency mode, a prefill batch (over max_tokens_per_rank) in
# normal mode; the same batch as decode is refused.
check "check auto decode" "$epmoe" check --ranks 2 --mode auto --batch decode --tokens 12 --json "$tmp/auto.json"
check "check auto decode JSON" python3 -c \
  "import json; d=json.load(open('$tmp/auto.json')); assert d['forward_mode'] == 'low-latency' and d['mirror']['pass'], d"
check "check auto prefill" "$epmoe" check --ranks 2 --mode auto --batch prefill --tokens 80 --json "$tmp/auto.json"
check "check auto prefill JSON" python3 -c \
  "import json; d=json.load(open('$tmp/auto.json')); assert d['forward_mode'] == 'normal' and d['mirror']['pass'], d"
check_fails "check auto decode over the buffers" "max_tokens_per_rank" \
  "$epmoe" check --ranks 2 --mode auto --batch decode --tokens 80
check_fails "check bad batch kind" "--batch" "$epmoe" check --mode auto --batch extend
check "check cpu-local" "$epmoe" check --ranks 1 --dispatcher cpu-local --exact --json "$tmp/check.json"
check "check JSON" python3 -c "import json,sys; d=json.load(open('$tmp/check.json')); assert d['mirror']['pass'] and 'exact' in d"
# The verdict at the top; the f64 comparison is informational (no verdict of its own); the seed and the
# scale rounding in the model's fields.
check "check --pow2-scales --seed" "$epmoe" check --ranks 1 --pow2-scales --seed 7 --exact --json "$tmp/check.json"
# Mixtral / Qwen-style routing from the command line: softmax over all experts, s = 1, with and without
# renormalised top-k weights.
for renorm in "" --no-renormalize; do
  check "check softmax routing $renorm" "$epmoe" check --scoring softmax --groups 1 --topk-groups 1 \
    --routed-scaling-factor 1 $renorm --json "$tmp/softmax.json"
  check "check softmax routing JSON $renorm" python3 -c "import json; m=json.load(open('$tmp/softmax.json'))['model']; \
assert m['scoring'] == 'softmax' and m['routed_scaling_factor'] == 1 and m['groups'] == 1, m; \
assert m['renormalize'] == ('$renorm' == ''), m"
done
check_fails "check scaling factor past float" "--routed-scaling-factor must be positive and finite" \
  "$epmoe" check --routed-scaling-factor 1e300
check "check JSON fields" python3 - "$tmp/check.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["pass"] is True and d["mirror"]["pass"] is True and d["commit"] and d["device"] == "cpu", d
assert d["model"]["seed"] == 7 and d["model"]["pow2_scales"] is True and "pow2_scales=on" in d["config"], d
assert d["exact"]["informational"] is True and "pass" not in d["exact"] and "tolerance" not in d["exact"], d
PY
check "check deepseek-v3 dims, 2 ranks" "$epmoe" check --preset deepseek-v3 --ranks 2 --tokens 2 --mode low-latency
check_fails "check bad hidden" "^epmoe: --hidden must be a positive multiple of 128" "$epmoe" check --hidden 200
check_fails "check bad preset" "--preset must be one of" "$epmoe" check --preset nope
check_fails "check ranks not dividing slots" "--experts \+ --redundant-experts \(16 \+ 0\) must be a multiple of --ranks=3" "$epmoe" check --ranks 3
# Config errors name the flags (MoeConfig's messages name its fields).
check_fails "check topk groups named as flags" "--topk-groups must be in \[1, --groups=4\], got 9" \
  "$epmoe" check --topk-groups 9
# ... but not the user's own value quoted back.
check_fails "check quoted value stays" "--scoring must be 'sigmoid' or 'softmax', got 'groups'" \
  "$epmoe" check --scoring groups
check_fails "run tokens below int64" "--tokens: is out of range \(at least -9223372036854775808\)" \
  "$epmoe" run --device cpu --tokens -9223372036854775809
check_fails "run too many decode tokens" "--tokens \(65\) must be <= --max-tokens-per-rank \(64\)" "$epmoe" run --device cpu --tokens 65
check "check 8 ranks low-latency" "$epmoe" check --ranks 8 --mode low-latency --tokens 12
check "check 8 ranks normal w4a8 dynamic" "$epmoe" check --ranks 8 --mode normal --quant w4a8 --redundant-experts 8 \
  --dispatch-algorithm dynamic --tokens 12
if ! nvidia-smi -L > /dev/null 2>&1; then
  check_fails "run gpu without a GPU" "no CUDA device" "$epmoe" run --device gpu
fi
check_fails "check has no GPU path" "runs on the CPU only" "$epmoe" check --device gpu
# Numbers out of range and unwritable outputs are refused when the command line is parsed, before any
# work (a negative value used to mean "the default" quietly; a bad --json path failed after the run).
check_fails "run negative steps" "--steps: must be >= 0, got -1" "$epmoe" run --device cpu --steps -1
check_fails "run negative tokens" "--tokens: must be >= 0, got -5" "$epmoe" run --device cpu --tokens -5
check_fails "run zero chunk" "--chunk: must be > 0, got 0" "$epmoe" run --device cpu --chunk 0
check_fails "run negative redundant experts" "--redundant-experts: must be >= 0" \
  "$epmoe" run --device cpu --redundant-experts -3
check_fails "run zero tolerance" "--tolerance: must be > 0" "$epmoe" run --device cpu --tolerance 0
check_fails "run zero check tokens" "--check-tokens: must be > 0" "$epmoe" run --device cpu --check-tokens 0
check_fails "run non-number tokens" "--tokens: must be a number" "$epmoe" run --device cpu --tokens x
check_fails "run --json in a missing directory" "the directory of '$tmp/missing/r.json' does not exist" \
  "$epmoe" run --device cpu --json "$tmp/missing/r.json"
check_fails "run --json naming a directory" "exists and is not a regular file" "$epmoe" run --device cpu --json "$tmp"
check_fails "run --trace in a missing directory" "does not exist" "$epmoe" run --device cpu --trace "$tmp/missing/t.json"
check_fails "check negative tokens" "--tokens: must be >= 0" "$epmoe" check --tokens -1
check_fails "run unknown mode lists auto" "not in \{auto,normal,low-latency\}" "$epmoe" run --device cpu --mode nope
check_fails "run negative seed" "--seed: must be >= 0" "$epmoe" run --device cpu --seed -1
check_fails "run unknown dispatcher lists them" "not in \{auto,nvlink,nccl-p2p\}" "$epmoe" run --device cpu --dispatcher nope
check_fails "bench zero tokens" "--tokens: must be > 0, got 0" "$epmoe" bench router --tokens 0,4096
check_fails "eplb --output in a missing directory" "does not exist" \
  "$epmoe" eplb --load "$tmp/load.json" --replicas 24 --output "$tmp/missing/p.json"
check "run --steps 0 runs the prefill only" "$epmoe" run --device cpu --steps 0 --prompt-tokens 300 --json "$tmp/steps0.json"
check "run --steps 0 JSON has no decode phase" python3 -c "import json,sys; d=json.load(open('$tmp/steps0.json')); sys.exit('decode' in d or 'prefill' not in d)"
check "run --tokens 0 runs the prefill only" "$epmoe" run --device cpu --tokens 0 --prompt-tokens 300 --json "$tmp/tokens0.json"
check "run --tokens 0 JSON has no decode phase" python3 -c "import json,sys; d=json.load(open('$tmp/tokens0.json')); sys.exit('decode' in d or 'prefill' not in d)"
check_fails "run with no phase" "nothing to run: no decode phase" "$epmoe" run --device cpu --tokens 0 --prompt-tokens 0
# GPU-only options on a CPU run: the run goes on, and says they have no effect.
# (The run's own exit status counts: a run that warned and then failed is a failure.)
check "cpu run with GPU options runs" "$epmoe" run --device cpu --steps 1 --prompt-tokens 10 \
  --tbo --dispatcher nccl-p2p --trace "$tmp/t.json" --no-device-idle
cp "$tmp/stderr" "$tmp/gpu_options_stderr"
check "cpu run names the GPU options it ignores" \
  grep -q 'GPU options have no effect here: --tbo, --dispatcher, --trace, --no-device-idle' "$tmp/gpu_options_stderr"
# --json -: stdout is the JSON document alone (the report goes to stderr).
check "run --json - runs" "$epmoe" run --device cpu --steps 2 --prompt-tokens 100 --json -
cp "$tmp/stdout" "$tmp/run_stdout.json"
check "run --json - leaves only JSON on stdout" python3 -c "import json; d=json.load(open('$tmp/run_stdout.json')); assert d['pass'] is True and 'decode' in d"
check "check --json - runs" "$epmoe" check --json -
cp "$tmp/stdout" "$tmp/check_stdout.json"
check "check --json - leaves only JSON on stdout" python3 -c "import json; d=json.load(open('$tmp/check_stdout.json')); assert 'mirror' in d"

# Bad input found by an audit: each refused with a message naming the option, nothing half-written.
check_fails "unknown subcommand is named" "unknown subcommand 'nope' \(expected one of: run, check" "$epmoe" nope
# CLI11 reads integers in base 0 and saturates past 64 bits: "010" was 8 tokens, 2^64 the seed 2^64 - 1.
check_fails "run octal-looking tokens" "--tokens: must be written without leading zeros" \
  "$epmoe" run --device cpu --tokens 010
# strtoll / strtod read hexadecimal, CLI11 binary too: only decimal is taken.
check_fails "check hexadecimal tokens" "--tokens: must be a decimal number, got 0x10" "$epmoe" check --tokens 0x10
check_fails "run hexadecimal float tolerance" "--tolerance: must be a decimal number, got 0x1p-3" \
  "$epmoe" run --device cpu --tolerance 0x1p-3
check_fails "check hexadecimal seed" "--seed: must be a decimal number, got 0x10" "$epmoe" check --seed 0x10
# A command line refused by the parser also removes an earlier run's result file (the --json after the bad
# option included), so a script cannot take it for this run's.
echo '{"pass": true}' > "$tmp/stale.json"
check_fails "check refused tokens" "--tokens" "$epmoe" check --json "$tmp/stale.json" --tokens -1
check "the refused command line's stale --json is gone" test ! -e "$tmp/stale.json"
echo '{"pass": true}' > "$tmp/stale.json"
check_fails "run refused tokens, --json after it" "--tokens" "$epmoe" run --device cpu --tokens -1 --json "$tmp/stale.json"
check "the stale --json after the refused option is gone" test ! -e "$tmp/stale.json"
check_fails "check seed past 64 bits" "--seed: is out of range \(at most 18446744073709551615\)" \
  "$epmoe" check --seed 18446744073709551616
check "check takes the largest seed" "$epmoe" check --seed 18446744073709551615
# A signed 64-bit option past 2^63 - 1 (strtoll would read it as 2^63 - 1).
check_fails "run tokens past int64" "--tokens: is out of range \(at most 9223372036854775807\)" \
  "$epmoe" run --device cpu --tokens 9223372036854775808
check_fails "run nan slot cost" "--eplb-slot-cost: must be a finite number, got nan" \
  "$epmoe" run --device cpu --eplb-slot-cost nan
check_fails "run infinite tolerance" "--tolerance: must be a finite number, got inf" \
  "$epmoe" run --device cpu --tolerance inf
# A directory that takes no new files (root passes access(W_OK) on /proc): refused before the run.
check_fails "run --json under /proc" "directory of '/proc/x.json'" "$epmoe" run --device cpu --json /proc/x.json
cp "$tmp/stdout" "$tmp/proc_stdout"
check "run --json under /proc prints no report" test ! -s "$tmp/proc_stdout"
check_fails "version --json under /proc" "directory of '/proc/x.json'" "$epmoe" version --json /proc/x.json
# A write that fails at the close (a full disk; here a file size limit of 0) used to exit 0 with an
# empty file.
for cmd in "check --json" "version --json" "eplb --load $tmp/load.json --replicas 24 --output"; do
  name=${cmd%% *}
  check_fails "$name: a failed write is an error" "(--json|--output): cannot write '$tmp/full.json'" bash -c \
    "set -o pipefail; (trap '' XFSZ; ulimit -f 0; exec '$epmoe' $cmd '$tmp/full.json') 2>&1 | cat >&2"
  check "$name: a failed write leaves no file" test ! -e "$tmp/full.json"
done
# Sizes past the machine's memory: a message naming the size, not std::terminate. (Under ASan, which
# scripts/sanitize.sh runs this script with, an allocation that large aborts unless the allocator may
# return null; its other options are kept.)
check_fails "check with 10^12 tokens" "out of host memory for [0-9]+ bytes" \
  env ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}allocator_may_return_null=1" "$epmoe" check --tokens 1000000000000
# '-' is stdout for version --json and eplb --output too (both wrote a file named '-'). Run in $tmp (a file
# named '-' would land there), each run's exit status its own.
check "version --json - runs" bash -c "cd '$tmp' && exec '$epmoe' version --json -"
cp "$tmp/stdout" "$tmp/version_stdout.json"
check "version --json - is JSON on stdout" python3 -c \
  "import json; assert 'nccl' in json.load(open('$tmp/version_stdout.json'))"
check "version --json - writes no file named -" test ! -e "$tmp/-"
check "eplb --output - runs" bash -c "cd '$tmp' && exec '$epmoe' eplb --load load.json --replicas 24 --groups 4 \
  --nodes 2 --gpus 4 --output -"
cp "$tmp/stdout" "$tmp/eplb_stdout.json"
check "eplb --output - is stdout" cmp -s "$tmp/eplb_stdout.json" "$tmp/hier.json"
check "eplb --output - writes no file named -" test ! -e "$tmp/-"
check_fails "eplb --load a directory" "cannot open --load file '$tmp': it is a directory" \
  "$epmoe" eplb --load "$tmp" --replicas 4
check_fails "eplb zero replicas" "--replicas: must be > 0, got 0" "$epmoe" eplb --load "$tmp/load.json" --replicas 0
check_fails "eplb negative gpus" "--gpus: must be > 0, got -1" \
  "$epmoe" eplb --load "$tmp/load.json" --replicas 16 --gpus -1
check_fails "launch -n 0" "--ranks: must be > 0, got 0" "$epmoe" launch -n 0 -- true
check_fails "launch without a command" "command is required" "$epmoe" launch -n 2
check_fails "launch nan timeout" "--timeout: must be a finite number, got nan" "$epmoe" launch -n 1 --timeout nan -- true
check_fails "launch negative kill grace" "--kill-grace: must be >= 0, got -5" \
  "$epmoe" launch -n 1 --kill-grace -5 -- true
check_fails "launch negative world size" "--world-size: must be > 0, got -1" \
  "$epmoe" launch -n 1 --world-size -1 -- true
# A run that fails before writing its results removes an earlier run's, so that a script cannot take them
# for this run's; eplb's --output (which may also be its --load) is left alone.
echo '{"stale": true}' >"$tmp/stale.json"
check_fails "check failing with an old --json file" "removed '$tmp/stale.json', an earlier run's output" \
  "$epmoe" check --experts 7 --json "$tmp/stale.json"
check "the old --json file is gone" test ! -e "$tmp/stale.json"
check_fails "launch kill grace over a day" "--kill-grace: must be <= 86400, got 1e10" \
  "$epmoe" launch -n 1 --kill-grace 1e10 -- true

# The launcher's end never leaves its ranks running. alive MARK: a process whose command line holds MARK
# runs (read from /proc: no procps on a bare machine).
alive() {
  local f
  for f in /proc/[0-9]*/cmdline; do
    [[ $f == "/proc/$BASHPID/cmdline" ]] && continue
    if { tr '\0' ' ' <"$f"; } 2>/dev/null | grep -q -- "$1"; then return 0; fi  # (it may exit meanwhile)
  done
  return 1
}
# launch_and_signal SIG MARK: a launcher of two `sleep MARK` ranks gets SIG; prints its exit status.
launch_and_signal() {
  "$epmoe" launch -n 2 -- sleep "$2" 2>/dev/null &
  local pid=$!
  sleep 1
  kill -"$1" "$pid"
  wait "$pid"
  echo $?
}
rc=$(launch_and_signal HUP 47.1231)
sleep 0.5
if [[ $rc == 129 ]] && ! alive "sleep 47.1231"; then pass; else fail "launch: SIGHUP stops the ranks (exit $rc)"; fi
rc=$(launch_and_signal KILL 47.1232)  # (no handler runs: the ranks' death signal does it)
sleep 0.5
if [[ $rc == 137 ]] && ! alive "sleep 47.1232"; then pass; else fail "launch: SIGKILL takes the ranks (exit $rc)"; fi
# A reader that goes away (`| head`): the ranks are stopped, exit 141 (128 + SIGPIPE), the id file removed.
ids_before=$(find "${TMPDIR:-/tmp}" -maxdepth 1 -name 'epmoe-nccl-id-*' 2>/dev/null | wc -l)
"$epmoe" launch -n 2 -- sh -c 'echo a; sleep 0.3; echo b; exec sleep 47.1233' 2>/dev/null | head -n 1 >/dev/null
rc=${PIPESTATUS[0]}
sleep 0.5
ids_after=$(find "${TMPDIR:-/tmp}" -maxdepth 1 -name 'epmoe-nccl-id-*' 2>/dev/null | wc -l)
if [[ $rc == 141 && $ids_after -le $ids_before ]] && ! alive "sleep 47.1233"; then pass; else
  fail "launch: a closed output stops the ranks (exit $rc, id files $ids_before -> $ids_after)"
fi
# A reader that stops reading: the launcher's timeout still ends the launch (124, about 2 + 1 + 1 s).
(
  start=$SECONDS
  "$epmoe" launch -n 1 --timeout 2 --kill-grace 1 -- sh -c 'yes | head -c 2000000; exec sleep 47.1234' 2>/dev/null
  echo "$? $((SECONDS - start))" >"$tmp/blocked"
) | sleep 8
read -r rc took <"$tmp/blocked"
if [[ $rc == 124 && $took -le 6 ]] && ! alive "sleep 47.1234"; then pass; else
  fail "launch: a blocked output does not stop the timeout (exit $rc after $took s)"
fi

# The CPU prefill's forwards are counted as it goes (a list of 4e9 chunks for 10^12 prompt tokens ran
# out of memory): the ragged last chunk is still right.
check "run prefill with a ragged last chunk" "$epmoe" run --device cpu --steps 0 --prompt-tokens 1000 --chunk 300 \
  --json "$tmp/ragged.json"
check "run ragged prefill JSON" python3 -c \
  "import json; d=json.load(open('$tmp/ragged.json'))['prefill']; assert d['forwards'] == 4 and d['tokens'] == 2000, d"

echo "$passed passed, $failed failed"
[[ $failed -eq 0 ]]
