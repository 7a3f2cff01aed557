#!/usr/bin/env bash
# A/B of two (or more) source trees in one device call (bench/NOTES.md, session 26): the trees are built
# side by side (16 jobs shared), tree B's GPU tests run, `epmoe bench gemm` alternates A, B (, C, ...)
# REPS times, then compute-sanitizer memcheck and racecheck on B's tests; logs and JSON into OUTDIR/x,
# packed as OUTDIR/ab.tgz. Each tree is a `git archive` tar (e.g. in an ignored .carry/ that the device
# tool carries). Trees after B are named c, d, ... and get only the CLI and the bench (and AB_RUN).
#
# Usage: scripts/ab-device.sh OUTDIR A.tar B.tar [C.tar ...]   (on the device: ... "$OUT" ...)
#        scripts/ab-device.sh OUTDIR --prebuilt BINS.tgz      (no build there: ~150 s of device time saved)
# --prebuilt: BINS.tgz (scripts/ab-pack.sh) holds trees a/, b/, ... of binaries built on the CPU machine
# for sm_90a: build-gpu/{bin/epmoe, libepmoe.so} and, in b/, build-gpu/tests/epmoe_gpu_tests. Every
# binary runs with its tree's build-gpu first on LD_LIBRARY_PATH (their RUNPATH names the CPU machine's),
# and a libnccl of the version they were compiled against (scripts/nccl-lib-dir.sh).
# Read the result with scripts/ab-table.py (tables; --json writes the bench/results file). A tree with
# a patch of bench/experiments/: git worktree add /tmp/tb main && git -C /tmp/tb apply PATCH... &&
# tar -C /tmp/tb --exclude=.git -cf .carry/b.tar .
# Knobs (environment, with defaults):
#   AB_QUANT=w4a8                   bench gemm --quant
#   AB_ONLY=contiguous              EPMOE_BENCH_GEMM_ONLY (contiguous, masked, decode; empty: all rows)
#   AB_LINES=.w4a8                  EPMOE_BENCH_GEMM_VARIANTS (empty: every line)
#   AB_REPS=2                       A/B alternations
#   AB_ROUNDS=1                     EPMOE_BENCH_GEMM_ROUNDS (each row's lines in rotated rounds)
#   AB_TESTS='*W4A8*:*w4a8*'        gtest filter of B's GPU tests (empty: none)
#   AB_SANITIZE='*v2_wide*'         gtest filter for memcheck and racecheck on B (empty: none)
#   AB_RUN=0                        1: `epmoe run --quant $AB_QUANT --steps 20` on both trees too
#   AB_TRACE_ROWS=                  rows (GxMxN) whose lines run traced (EPMOE_BENCH_GEMM_TRACE=1) in every
#                                   tree after the bench: tr_TREE_ROW_REP.json (scripts/ab-table.py reads them)
#   AB_TRACE_LINES=main             EPMOE_BENCH_GEMM_VARIANTS of the traced runs (.exp.* lines allowed)
#   AB_TRACE_REPS=2                 alternations of the traced runs
#   AB_AFTER=                       a bash snippet run in tree B after the rest (its files into $x)
set -uo pipefail
out=${1:?usage: scripts/ab-device.sh OUTDIR A.tar B.tar}
shift
names=(a b c d e f)
tars=()
prebuilt=
if [[ ${1:-} == --prebuilt ]]; then
  prebuilt=$(realpath "${2:?--prebuilt BINS.tgz}")
  mapfile -t trees < <(tar -tzf "$prebuilt" | sed -n 's#^\(\./\)\{0,1\}\([a-f]\)/build-gpu/bin/epmoe$#\2#p' | sort)
else
  for f in "${@:?A.tar B.tar}"; do tars+=("$(realpath "$f")"); done
  ((${#tars[@]} <= ${#names[@]})) || { echo "at most ${#names[@]} trees" >&2; exit 2; }
  trees=("${names[@]:0:${#tars[@]}}")
fi
if ((${#trees[@]} < 2)) || [[ ${trees[1]} != b ]]; then
  echo "need trees a and b" >&2
  exit 2
fi
mkdir -p "$out/x"
out=$(cd "$out" && pwd)
x=$out/x
tests=${AB_TESTS-*W4A8*:*w4a8*}
sanitize=${AB_SANITIZE-*v2_wide*}
export NCCL_NVLS_ENABLE=0
start=$SECONDS
stamp() { echo "== $1 ($((SECONDS - start)) s)"; }
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv,noheader || true

work=$(mktemp -d)
# Each tree's binaries with its own library (LD_LIBRARY_PATH beats a prebuilt binary's RUNPATH).
epmoe() {  # epmoe SECONDS TREE ARGS...: tree TREE's CLI under timeout SECONDS
  local limit=$1 t=$2
  shift 2
  LD_LIBRARY_PATH="$work/$t/build-gpu:${LD_LIBRARY_PATH:-}" timeout "$limit" "$work/$t/build-gpu/bin/epmoe" "$@"
}
export LD_LIBRARY_PATH="$work/b/build-gpu:${LD_LIBRARY_PATH:-}"  # tree b's tests, sanitizers, AB_AFTER
if [[ -n $prebuilt ]]; then
  tar -xzf "$prebuilt" -C "$work"
else
  for i in "${!trees[@]}"; do
    mkdir -p "$work/${trees[$i]}"
    tar -xf "${tars[$i]}" -C "$work/${trees[$i]}"
  done
  jobs=$((16 / ${#trees[@]}))
  stamp build
  build() {  # build TREE TARGETS...
    local t=$1
    shift
    (cd "$work/$t" && cmake --preset gpu > "$x/cfg_$t.log" 2>&1 &&
      cmake --build --preset gpu -j "$jobs" --target "$@" > "$x/build_$t.log" 2>&1)
    echo "build $t rc $?"
  }
  for t in "${trees[@]}"; do
    if [[ $t == b ]]; then build b epmoe_cli epmoe_gpu_tests & else build "$t" epmoe_cli & fi
  done
  wait
  stamp built
fi
for t in "${trees[@]}"; do
  [[ -x $work/$t/build-gpu/bin/epmoe ]] || { tail -n 30 "$x/build_$t.log"; exit 1; }
done
# Binaries built on the CPU machine carry its NCCL headers (2.28.9); the device's /usr/lib has 2.28.3. Put a
# matching libnccl first (the communicator refuses a mismatch; the GEMM paths never load one).
if nccl_dir=$("$(dirname "$0")/nccl-lib-dir.sh" "$work/b/build-gpu/bin/epmoe"); then
  [[ -n $nccl_dir ]] && export LD_LIBRARY_PATH="$nccl_dir:$LD_LIBRARY_PATH" && echo "NCCL from $nccl_dir"
else
  echo "no libnccl matching tree b's headers: the communicator's tests will refuse to run" >&2
fi

cd "$work/b" || exit 1
if [[ -n $tests ]]; then
  stamp tests
  timeout 300 build-gpu/tests/epmoe_gpu_tests --gtest_filter="$tests" > "$x/tests.log" 2>&1
  echo "tests rc $?"
  grep -E "^\[  (PASSED|FAILED|SKIPPED)|FAILED  \]" "$x/tests.log" | tail -n 8
fi

stamp bench
export EPMOE_BENCH_GEMM_ONLY=${AB_ONLY-contiguous} EPMOE_BENCH_GEMM_VARIANTS=${AB_LINES-.w4a8}
export EPMOE_BENCH_GEMM_ROUNDS=${AB_ROUNDS:-1}
for rep in $(seq 1 "${AB_REPS:-2}"); do
  for t in "${trees[@]}"; do
    epmoe 200 "$t" bench gemm --quant "${AB_QUANT:-w4a8}" --quick \
      --json "$x/ab_${t}_$rep.json" > "$x/ab_${t}_$rep.log" 2>&1
    echo "bench $t $rep rc $?"
  done
done

if [[ -n ${AB_TRACE_ROWS:-} ]]; then
  stamp traced
  for rep in $(seq 1 "${AB_TRACE_REPS:-2}"); do
    for row in $AB_TRACE_ROWS; do
      for t in "${trees[@]}"; do
        EPMOE_BENCH_GEMM_TRACE=1 EPMOE_BENCH_GEMM_EXPERIMENTS=1 EPMOE_BENCH_GEMM_ONLY=contiguous \
          EPMOE_BENCH_GEMM_ROW=$row EPMOE_BENCH_GEMM_VARIANTS=${AB_TRACE_LINES:-main} \
          epmoe 100 "$t" bench gemm --quant "${AB_QUANT:-w4a8}" --quick \
          --json "$x/tr_${t}_${row}_$rep.json" > "$x/tr_${t}_${row}_$rep.log" 2>&1
        echo "traced $t $row $rep rc $?"
      done
    done
  done
fi

if [[ ${AB_RUN:-0} == 1 ]]; then
  stamp run
  for t in "${trees[@]}"; do
    epmoe 120 "$t" run --quant "${AB_QUANT:-w4a8}" --steps 20 \
      --json "$x/run_$t.json" > "$x/run_$t.log" 2>&1
    echo "run $t rc $?"
    grep -E "^  (prefill|decode) |^check" "$x/run_$t.log" | cut -c1-140
  done
fi

if [[ -n $sanitize ]]; then
  for tool in memcheck racecheck; do
    stamp "$tool"
    timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 9 build-gpu/tests/epmoe_gpu_tests \
      --gtest_filter="$sanitize" > "$x/$tool.log" 2>&1
    echo "$tool rc $?"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED" "$x/$tool.log" | tail -n 3
  done
fi

if [[ -n ${AB_AFTER:-} ]]; then
  stamp after
  (cd "$work/b" && x=$x bash -c "$AB_AFTER") > "$x/after.log" 2>&1
  echo "after rc $?"
fi

cd "$out" && tar -czf ab.tgz x && rm -rf x "$work"
stamp "done"
