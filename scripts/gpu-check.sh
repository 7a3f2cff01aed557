#!/usr/bin/env bash
# The GPU machine's whole check: build (preset gpu: sm_90a into build-gpu), kernel resource usage,
# GPU tests, compute-sanitizer (memcheck, racecheck, initcheck) on the GPU tests' small shapes,
# benchmarks, the layer runs, and a summary table. On one H200 all of it takes ~15 minutes, more
# than one 10-minute device call: split it with EPMOE_GPU_CHECK_STEPS, e.g. tests in one call, then
# sanitizers, then bench,layer (a warm machine keeps build-gpu, so the later calls skip the build; on one
# H100, build + tests took ~265 s and the sanitizers ~240 s: session 71).
#
# Usage: scripts/gpu-check.sh OUTDIR      (e.g. scripts/gpu-check.sh "$OUT")
#        EPMOE_GPU_CHECK_TIME_S=540 scripts/gpu-check.sh "$OUT"   (stop each step in time to pack the logs)
#        EPMOE_SANITIZER_SHARDS=N: GoogleTest shards per sanitizer, run side by side (default 3)
#        EPMOE_GPU_TEST_JOBS=N: GPU test entries run side by side (ctest -j; default 8: 16 was slower on one
#          H100, session 74, the tests sharing the cores and the GPU)
#
# OUTDIR receives summary.txt, bench.json, layer.json (scripts/layer-check.sh) and logs.tar.gz (nvidia-smi.txt, version.{txt,json}, configure.log,
# build.log, ptxas.log (+ ptxas-summary.txt and sass/ when cuobjdump exists), gpu-tests.log, gpu-tests-full.log,
# memcheck.log, racecheck.log, initcheck.log, asan-{build,gpu-tests}.log, bench.log, gemm-kernel-times.{txt,json}). Every step runs even when an earlier one fails (steps
# that need the build are skipped without it); the exit status is non-zero when the build, a
# test, a sanitizer, a benchmark's check or the layer runs failed, when a kernel spills or has a stack
# frame (the ptxas report), or when epmoe sees fewer GPUs than nvidia-smi lists (the GPU tests would then
# only skip).
set -euo pipefail
out=${1:?usage: scripts/gpu-check.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
# An earlier run's results in a reused OUTDIR (the packing keeps these three) are not this run's.
rm -f "$out/summary.txt" "$out/bench.json" "$out/layer.json"
cd "$(dirname "$0")/.."
root=$(pwd)
jobs=$(nproc)

# Never NVLink multicast on the lent machines (shared hosts).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export EPMOE_COMMIT=${EPMOE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

# Checked before anything runs (a bad value found after the build would leave no summary).
shards=${EPMOE_SANITIZER_SHARDS:-3}
[[ $shards =~ ^[1-9][0-9]*$ ]] || { echo "EPMOE_SANITIZER_SHARDS must be a positive integer, got '$shards'" >&2; exit 2; }
test_jobs=${EPMOE_GPU_TEST_JOBS:-8}
[[ $test_jobs =~ ^[1-9][0-9]*$ ]] || { echo "EPMOE_GPU_TEST_JOBS must be a positive integer, got '$test_jobs'" >&2; exit 2; }

declare -A result
order=()
# EPMOE_GPU_CHECK_TIME_S=N: every step ends by N seconds after the start, less a margin for the
# summary and the archive (a step cut short is FAILED, exit 124), so that the logs come back packed
# even where the device call's own limit would have cut the script off with its files loose (the device
# tool returns only a few files). 0 or unset: no limit.
time_limit=${EPMOE_GPU_CHECK_TIME_S:-0}
# Seconds a step may still take under the limit (at least 1).
time_left() {
  local left=$((time_limit - SECONDS - 20))
  echo $((left >= 1 ? left : 1))
}
# limited CMD...: CMD under the time left (a shell function runs as it is: timeout cannot run one).
limited() {
  if ((time_limit <= 0)) || declare -F "$1" > /dev/null; then
    "$@"
    return
  fi
  timeout --kill-after=5 "$(time_left)" "$@"
}
# step NAME CMD...: runs CMD, records ok/FAILED (never stops the script).
step() {
  local name=$1
  shift
  order+=("$name")
  echo "== $name"
  local start=$SECONDS
  if limited "$@"; then
    result[$name]="ok ($((SECONDS - start)) s)"
  else
    result[$name]="FAILED (exit $?, $((SECONDS - start)) s)"
  fi
}
skip() {
  order+=("$1")
  result[$1]="skipped ($2)"
}
# The whole check takes longer than one 10-minute device call: EPMOE_GPU_CHECK_STEPS picks the
# groups to run (comma-separated, any of tests,sanitizers,comm-sanitizers,bench,layer,asan; default all
# but asan; sanitizers includes comm-sanitizers, which alone runs only the comm tests' step). The
# build always runs. asan builds the host code under AddressSanitizer + UndefinedBehaviorSanitizer
# (preset sanitize, build-sanitize/: ~2 minutes on 16 cores) and runs the GPU tests with it: the host side
# of the GPU paths (launchers, the GPU layer, the dispatchers), which scripts/sanitize.sh on a machine
# without a GPU never reaches.
steps=",${EPMOE_GPU_CHECK_STEPS:-tests,sanitizers,bench,layer},"
want() { [[ $steps == *",$1,"* ]]; }

# ---------------------------------------------------------------- the machine
step nvidia-smi bash -o pipefail -c "nvidia-smi 2>&1 | tee '$out/nvidia-smi.txt'"
# shellcheck disable=SC2317  # called through step

# ---------------------------------------------------------------- build
step configure bash -o pipefail -c "cmake --preset gpu > '$out/configure.log' 2>&1"
step build bash -o pipefail -c "cmake --build --preset gpu -j '$jobs' > '$out/build.log' 2>&1"
built=1
if [[ ${result[build]} != ok* ]]; then
  grep -E "FAILED:|error" "$out/build.log" | head -n 20 || true
  # Something outside the GPU harness may be broken: still build what the GPU steps need.
  step build-gpu-targets bash -o pipefail -c \
    "cmake --build --preset gpu -j '$jobs' --target epmoe epmoe_gpu_tests epmoe_comm_tests epmoe_cli epmoe_tensor_probe > '$out/build-gpu-targets.log' 2>&1"
  [[ ${result[build-gpu-targets]} == ok* ]] || built=0
fi

# ---------------------------------------------------------------- NCCL
# The communicator refuses a libnccl other than the headers' version (NCCL's device API is inline):
# `epmoe version` says which was loaded; scripts/nccl-lib-dir.sh finds a matching one if the loader's is not.
# shellcheck disable=SC2317  # called through step
nccl_check() {
  local dir
  dir=$(scripts/nccl-lib-dir.sh build-gpu/bin/epmoe) || return 1
  [[ -n $dir ]] && export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  build-gpu/bin/epmoe version --json "$out/version.json" | tee "$out/version.txt"
}
if ((built)); then
  # (Not through step: its export must reach the steps below.)
  order+=(nccl)
  if nccl_check; then result[nccl]="ok"; else result[nccl]="FAILED (no libnccl matching the headers)"; fi
  # Every GPU test skips itself where CUDA sees no GPU (a driver too old for the runtime, a bad
  # CUDA_VISIBLE_DEVICES): then the tests and the sanitizers all "pass". Where nvidia-smi lists GPUs, epmoe
  # must see them too.
  order+=(gpus-visible)
  smi_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  epmoe_gpus=$(python3 -c "import json,sys; print(len(json.load(open(sys.argv[1]))['gpus']))" "$out/version.json" 2>/dev/null || echo 0)
  if ((epmoe_gpus > 0 && epmoe_gpus >= smi_gpus)); then
    result[gpus-visible]="ok ($epmoe_gpus)"
  else
    result[gpus-visible]="FAILED (nvidia-smi lists ${smi_gpus:-0}, epmoe sees $epmoe_gpus: the GPU tests would only skip)"
  fi
else
  skip nccl "no build"
fi

# ---------------------------------------------------------------- kernel resources and tests
# (With the tests group only: a call that runs only the sanitizers or the benchmarks skips it.)
# The ptxas report recompiles every .cu on the CPU (~50 s on 16 cores): it runs beside the GPU tests,
# niced, so that it takes the cores `ctest -j` leaves idle instead of a minute of its own (session 71:
# one after the other, 48 s + 243 s).
gpu_tests=build-gpu/tests/epmoe_gpu_tests
if ((built)) && want tests; then
  order+=(ptxas)
  ptxas_start=$SECONDS
  (
    rc=0
    limited nice -n 19 bash -o pipefail -c \
      "python3 '$root/scripts/ptxas-report.py' build-gpu '$out/ptxas.log' '$out/sass' > '$out/ptxas-summary.txt'" || rc=$?
    echo "$rc $((SECONDS - ptxas_start))" > "$out/ptxas.rc"
  ) &
  ptxas_pid=$!
  # The GPUs' memory in use, sampled each second while the tests run side by side (ctest -j): the
  # peak says how much room is left for more of them at once (gpu-memory.csv; the peak in the summary).
  nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits -lms 1000 \
    > "$out/gpu-memory.csv" 2> /dev/null &
  memory_pid=$!
  step gpu-tests bash -o pipefail -c "ctest --test-dir build-gpu -L gpu --no-tests=error --output-on-failure -j $test_jobs > '$out/gpu-tests.log' 2>&1"
  kill "$memory_pid" 2> /dev/null || true
  wait "$memory_pid" 2> /dev/null || true
  # Every test's own output (ctest keeps it for the passed ones too): the GoogleTest cases' times inside
  # each ctest entry, e.g. which cases of the loopback suite make it the long pole.
  cp build-gpu/Testing/Temporary/LastTest.log "$out/gpu-tests-full.log" 2> /dev/null || true
  grep -E "tests passed|tests failed|\(Failed\)|\(Skipped\)" "$out/gpu-tests.log" | tail -n 20 || true
  wait "$ptxas_pid" || true
  read -r ptxas_rc ptxas_s < "$out/ptxas.rc" 2>/dev/null || { ptxas_rc=none ptxas_s=$((SECONDS - ptxas_start)); }
  rm -f "$out/ptxas.rc"
  if [[ $ptxas_rc == 0 ]]; then
    result[ptxas]="ok ($ptxas_s s, beside the tests)"
  else
    result[ptxas]="FAILED (exit $ptxas_rc, $ptxas_s s, beside the tests)"
  fi
  echo "== ptxas: ${result[ptxas]}"
else
  skip ptxas "no build or tests not in EPMOE_GPU_CHECK_STEPS"
fi
# Every GPU test except the large shapes: sanitizers slow kernels down a lot. racecheck and
# initcheck are 2-10x slower than memcheck again, so they also leave out the repeats of
# already-covered kernels at big sizes (the 65537-token router cases, the DeepSeek-V3-dim layer
# cases, the W4A8 many-tiles cases, the random sweeps of up to 1.5e9 multiply-adds a problem); memcheck
# keeps them (one sweep round under memcheck: ~20 s on one H200). DeviceActivityGpu is left out of all three:
# CUPTI is a second profiling client beside the sanitizer. (Outside the build's branch: the
# asan group, which builds on its own, takes the slow filter too.)
# CommunicatorSetup is left out of all three too: it has no kernel of ours, and its bounds are the host's
# wall-clock times, which the side-by-side sanitizer shards stretch (session 69: its destroy took 6.1 s
# against a 2 s bound beside the other shards, the whole test suite and two loopback ranks; alone under
# memcheck it passes).
filter=${EPMOE_SANITIZER_FILTER:-'*:-*4096*:*4097*:*16384*:CommunicatorSetup.*:DeviceActivityGpu.*'}
slow_filter=${EPMOE_SLOW_SANITIZER_FILTER:-'*:-*4096*:*4097*:*16384*:*65537*:*dsv3*:*many_tiles*:*Sweep*:CommunicatorSetup.*:DeviceActivityGpu.*'}
if ((built)); then
  # cuBLAS's kernels (the gate GEMM) are not ours to check, but they stay instrumented: left out by
  # name, their writes are not seen and initcheck flags every read of the logits after them, and
  # racecheck breaks their launch. racecheck reports hazards inside one of them (split-K), so it
  # skips the gate's own test (the layer tests still run the gate).
  sanitizer=$(command -v compute-sanitizer || true)
  [[ -n $sanitizer || ! -x /usr/local/cuda/bin/compute-sanitizer ]] || sanitizer=/usr/local/cuda/bin/compute-sanitizer
  if [[ -n $sanitizer ]] && want sanitizers; then
    # The three tools run side by side, each as EPMOE_SANITIZER_SHARDS GoogleTest shards (default 3):
    # a sanitizer is bound by its own host-side work, and one GPU holds all of them, so the group takes
    # about as long as racecheck's slowest shard (racecheck unsharded: ~500 s, session 65).
    declare -A sanitizer_pid
    sanitizer_start=$SECONDS
    for tool in memcheck racecheck initcheck; do
      rm -f "$out/$tool.log"
      tool_filter=$slow_filter
      case $tool in
        memcheck) tool_filter=$filter ;;
        racecheck) tool_filter="$slow_filter:GateGemmGpu.*" ;;
      esac
      # --report-api-errors no: libnccl probes its kernel images with cudaFuncGetAttributes during
      # ncclCommInitRank and handles the "no kernel image" answers itself; every CUDA call of ours
      # goes through EPMOE_CUDA_CHECK, so an API error of ours fails its test anyway.
      for ((shard = 0; shard < shards; ++shard)); do
        (
          rc=0
          GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$shard limited "$sanitizer" --tool "$tool" \
            --report-api-errors no --error-exitcode 1 "$gpu_tests" --gtest_filter="$tool_filter" \
            > "$out/$tool-$shard.log" 2>&1 || rc=$?
          echo "$rc" > "$out/$tool-$shard.rc"
        ) &
        sanitizer_pid[$tool-$shard]=$!
      done
    done
    for tool in memcheck racecheck initcheck; do
      failed=()
      for ((shard = 0; shard < shards; ++shard)); do
        wait "${sanitizer_pid[$tool-$shard]}" || true
        rc=$(cat "$out/$tool-$shard.rc" 2>/dev/null || echo "none")
        [[ $rc == 0 ]] || failed+=("shard $shard exit $rc")
        # One log per tool (what the summary and the packing read), shard by shard.
        { echo "==== $tool shard $shard of $shards (exit $rc)"; cat "$out/$tool-$shard.log"; } >> "$out/$tool.log"
        rm -f "$out/$tool-$shard.log" "$out/$tool-$shard.rc"
      done
      order+=("$tool")
      if ((${#failed[@]} == 0)); then
        result[$tool]="ok ($((SECONDS - sanitizer_start)) s, $shards shards, in parallel)"
      else
        result[$tool]="FAILED (${failed[*]}, $((SECONDS - sanitizer_start)) s, in parallel)"
      fi
      echo "== $tool: ${result[$tool]}"
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|\[  PASSED  \]|\[  FAILED  \]" "$out/$tool.log" || true
    done
  elif [[ -n $sanitizer ]]; then
    for tool in memcheck racecheck initcheck; do skip "$tool" "not in EPMOE_GPU_CHECK_STEPS"; done
  else
    skip memcheck "no compute-sanitizer"
    skip racecheck "no compute-sanitizer"
    skip initcheck "no compute-sanitizer"
  fi
  # The communication kernels live in a test binary of their own (epmoe_comm_tests). On one GPU: every
  # load/store transport's data rounds and the poison / timeout cases on two loopback ranks under memcheck
  # and racecheck, and the NCCL point-to-point transport's error case on a one-rank communicator under
  # memcheck (also alone: EPMOE_GPU_CHECK_STEPS=comm-sanitizers). Not the whole loopback suite: its layer
  # cases take minutes under a sanitizer (bench/NOTES.md, session 63).
  if [[ -n $sanitizer ]] && { want sanitizers || want comm-sanitizers; }; then
    # (One step, bounded as a whole; the three runs' status is the step's.)
    comm_tests=build-gpu/tests/epmoe_comm_tests
    comm_loopback='Comm/Transports.*:*GaveUp*:*CombineThatAPeer*:*HalvesAndWholeCallsAlternate:*GraphReplays*:*TooManyTokensOnOneRank*:-*NcclP2p*'
    step comm-sanitize bash -c "exec > '$out/comm-sanitize.log' 2>&1
      status=0
      for tool in memcheck racecheck; do
        EPMOE_LOOPBACK_RANKS=2 EPMOE_COMM_TIMEOUT_S=30 '$sanitizer' --tool \$tool --error-exitcode 1 $comm_tests \\
          --gtest_filter='$comm_loopback' || status=1
      done
      '$sanitizer' --tool memcheck --report-api-errors no --error-exitcode 1 $comm_tests \\
        --gtest_filter='CommNcclP2p.ARankWithARecordedError*' || status=1
      exit \$status"
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|\[  PASSED  \]|\[  FAILED  \]" "$out/comm-sanitize.log" || true
  elif [[ -n $sanitizer ]]; then
    skip comm-sanitize "not in EPMOE_GPU_CHECK_STEPS"
  else
    skip comm-sanitize "no compute-sanitizer"
  fi
fi
((built)) || skip gpu-tests "no build"
((built)) && ! want tests && skip gpu-tests "not in EPMOE_GPU_CHECK_STEPS"

# ---------------------------------------------------------------- host sanitizers on the GPU paths
if want asan; then
  step asan-build bash -o pipefail -c "cmake --preset sanitize > '$out/asan-configure.log' 2>&1 &&
    cmake --build --preset sanitize -j '$jobs' --target epmoe epmoe_gpu_tests epmoe_cli > '$out/asan-build.log' 2>&1"
  if [[ ${result[asan-build]} == ok* ]]; then
    # protect_shadow_gap=0: the CUDA driver maps memory inside ASan's shadow gap. detect_leaks=0: the
    # driver's and NCCL's allocations that live until exit would drown ours (scripts/sanitize.sh keeps
    # leak checks on for everything that runs without a GPU). The slow sanitizers' filter (no large
    # shapes, no sweeps): the CPU references under ASan are slow, and one process ran 169 tests in 580 s
    # (session 51), so the tests run as EPMOE_ASAN_SHARDS GoogleTest shards side by side (the time is the
    # CPU references', the GPU has room for all). EPMOE_ASAN_FILTER chooses other tests (`rest`: the
    # ones the default leaves out, i.e. the slow filter's exclusions).
    # EPMOE_ASAN_SHARD_TIMEOUT (seconds, default 420) bounds each shard, so that a call's limit leaves
    # the logs of what ran (the large shapes' CPU references crawl under ASan: session 52).
    asan_shards=${EPMOE_ASAN_SHARDS:-12}
    asan_timeout=${EPMOE_ASAN_SHARD_TIMEOUT:-420}
    asan_filter=${EPMOE_ASAN_FILTER:-$slow_filter}
    [[ $asan_filter == rest ]] && asan_filter=${slow_filter#*:-}
    # shellcheck disable=SC2317  # called through step
    asan_gpu_tests() {
      local shard pids=() rc=0
      if ((time_limit > 0)); then  # (EPMOE_GPU_CHECK_TIME_S: the shards end in time too)
        local left
        left=$(time_left)
        ((asan_timeout <= left)) || asan_timeout=$left
      fi
      for ((shard = 0; shard < asan_shards; ++shard)); do
        ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=0 UBSAN_OPTIONS=print_stacktrace=1 \
          GTEST_TOTAL_SHARDS=$asan_shards GTEST_SHARD_INDEX=$shard timeout "$asan_timeout" \
          build-sanitize/tests/epmoe_gpu_tests --gtest_filter="$asan_filter" \
          > "$out/asan-shard-$shard.log" 2>&1 &
        pids+=($!)
      done
      for shard in "${!pids[@]}"; do
        wait "${pids[$shard]}" || {
          echo "asan shard $shard failed (exit $?; 124: stopped at EPMOE_ASAN_SHARD_TIMEOUT)"
          rc=1
        }
      done
      # One log comes back (the device returns few files): the shards' logs one after another.
      for ((shard = 0; shard < asan_shards; ++shard)); do
        echo "==== shard $shard"
        cat "$out/asan-shard-$shard.log"
        rm -f "$out/asan-shard-$shard.log"
      done > "$out/asan-gpu-tests.log"
      return "$rc"
    }
    step asan-gpu-tests asan_gpu_tests
    grep -E "ERROR: AddressSanitizer|runtime error|\[  PASSED  \]|\[  FAILED  \]|^asan shard" "$out/asan-gpu-tests.log" | head -n 40 || true
  else
    grep -E "FAILED:|error" "$out/asan-build.log" | head -n 20 || true
  fi
fi

# ---------------------------------------------------------------- benchmarks
if ((built)) && want bench; then
  step bench bash -o pipefail -c "build-gpu/bin/epmoe bench all --json '$out/bench.json' 2>&1 | tee '$out/bench.log'"
  # The tensor cores alone under the FP8 GEMM's consumer-loop shapes (cycles per wgmma; 64 = peak).
  step tensor-probe bash -o pipefail -c "build-gpu/bin/epmoe_tensor_probe gemm 2>&1 | tee '$out/tensor-probe.log'"
  # The FP8 GEMM rows again under the CUPTI tracer: kernel durations, DeepGEMM's own way of timing
  # its anchors, beside the event times (which also hold ~3 us of launch and events).
  if [[ -f build-gpu/lib/libepmoe_kernel_trace.so ]]; then
    step gemm-kernel-times bash -o pipefail -c "rm -rf '$out/gemm-trace' &&
      LD_LIBRARY_PATH=/usr/local/cuda/lib64:\${LD_LIBRARY_PATH:-} CUDA_INJECTION64_PATH='$root/build-gpu/lib/libepmoe_kernel_trace.so' \
      EPMOE_KERNEL_TRACE_DIR='$out/gemm-trace' build-gpu/bin/epmoe bench gemm --quant fp8 --json '$out/gemm-traced.json' > '$out/gemm-traced.log' 2>&1 &&
      python3 scripts/gemm-kernel-times.py '$out/gemm-traced.json' '$out'/gemm-trace/kernels-*.json --json '$out/gemm-kernel-times.json' | tee '$out/gemm-kernel-times.txt'"
  else
    skip gemm-kernel-times "no kernel trace library"
  fi
else
  skip bench "no build or not in EPMOE_GPU_CHECK_STEPS"
fi

# ---------------------------------------------------------------- the layer (epmoe run)
# The MoE layer at DeepSeek-V3 dims on every GPU present, in the configurations of issue 7's bars
# (scripts/layer-check.sh; its tests already ran above).
if ((built)) && want layer; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || echo 1)
  step layer bash -o pipefail -c "bash scripts/layer-check.sh '$out/layer' '$gpus' --no-tests > '$out/layer.log' 2>&1"
  grep -E "^(\[rank 0\] )?  (decode|prefill)" "$out/layer/runs.log" 2>/dev/null | cut -c1-160 || true
else
  skip layer "no build or not in EPMOE_GPU_CHECK_STEPS"
fi

# ---------------------------------------------------------------- summary
{
  echo
  echo "==================== gpu-check summary ($(date -u +%Y-%m-%dT%H:%M:%SZ), commit $EPMOE_COMMIT)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /' || true
  printf '%-14s %s\n' step result
  for name in "${order[@]}"; do printf '%-14s %s\n' "$name" "${result[$name]}"; done
  [[ -f $out/version.txt ]] && sed 's/^/version:   /' "$out/version.txt"
  if [[ -f $out/gpu-tests.log ]]; then
    echo "tests:     $(grep -E 'tests passed' "$out/gpu-tests.log" | tail -n 1)"
    echo "skipped:   $(grep -c '(Skipped)' "$out/gpu-tests.log" || true)"
    grep -E '\(Failed\)|\(Timeout\)|\(SEGFAULT\)|Exception' "$out/gpu-tests.log" | sed 's/^/  /' | head -n 20 || true
    # The long poles of the tests' wall time (ctest's "Test #N: NAME ...   Passed   12.34 sec" lines).
    echo "longest:   $(sed -nE 's/^.*Test +#[0-9]+: ([^ ]+) .* ([0-9]+\.[0-9]+) sec$/\2 s \1/p' "$out/gpu-tests.log" |
      sort -rn | head -n 5 | paste -sd ';' | sed 's/;/; /g')"
    # ... and the longest GoogleTest cases inside them ("[       OK ] Suite.Case (1234 ms)").
    [[ -f $out/gpu-tests-full.log ]] &&
      echo "cases:     $(sed -nE 's/^\[ +OK \] ([^ ]+) \(([0-9]+) ms\)$/\2 \1/p' "$out/gpu-tests-full.log" |
        sort -rn | head -n 5 | awk '{printf "%s%.1f s %s", (NR > 1 ? "; " : ""), $1 / 1000, $2}')"
  fi
  if [[ -s $out/gpu-memory.csv ]]; then
    awk -F', *' '$2 + 0 > peak[$1] { peak[$1] = $2 + 0; total[$1] = $3 }
      END { for (g in peak) printf "gpu memory: GPU %s peak %d of %d MiB during the GPU tests (ctest -j '"$test_jobs"')\n", g, peak[g], total[g] }' \
      "$out/gpu-memory.csv" | sort || true
  fi
  for tool in memcheck racecheck initcheck; do
    if [[ -f $out/$tool.log ]]; then  # (one line per shard)
      echo "$tool: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/$tool.log" | sed 's/^=* *//' | paste -sd ';' | sed 's/;/; /g' || true)"
    fi
  done
  # (Three runs: loopback memcheck, loopback racecheck, the NCCL case's memcheck.)
  [[ -f $out/comm-sanitize.log ]] &&
    grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/comm-sanitize.log" | sed 's/^/comm-sanitize: /' || true
  if [[ -f $out/ptxas-summary.txt ]]; then
    echo "kernels (regs / stack / spills):"
    sed 's/^/  /' "$out/ptxas-summary.txt" | cut -c1-150
  fi
  if [[ -f $out/layer/runs.log ]]; then
    echo "layer (epmoe run):"
    grep -E "^(\[rank 0\] )?  (decode|prefill)" "$out/layer/runs.log" | sed 's/^/  /' | cut -c1-170 || true
  fi
  if [[ -f $out/gemm-kernel-times.txt ]]; then
    echo "FP8 GEMM kernel durations (CUPTI) against DeepGEMM's:"
    sed 's/^/  /' "$out/gemm-kernel-times.txt"
  fi
  if [[ -f $out/bench.log ]]; then
    echo "bench:"
    grep -E ' us ' "$out/bench.log" | sed 's/^/  /' || true
  fi
  true
} | tee "$out/summary.txt"

# The device tool returns at most 8 files: keep summary.txt and bench.json beside one archive
# of every log.
[[ -f $out/layer/layer.json ]] && cp "$out/layer/layer.json" "$out/layer.json"
# The archive is written outside OUTDIR and moved in: written inside, GNU tar sees "." change while it
# reads it and exits 1, which left every log loose (session 57: the tool then dropped summary.txt).
archive=$(mktemp --suffix=.tar.gz)
if (cd "$out" && tar czf "$archive" --exclude=./summary.txt --exclude=./bench.json --exclude=./layer.json .); then
  (cd "$out" && find . -mindepth 1 ! -path ./summary.txt ! -path ./bench.json ! -path ./layer.json -delete) || true
  mv "$archive" "$out/logs.tar.gz"
else
  echo "gpu-check: packing the logs failed; they stay loose in $out" >&2
  rm -f "$archive"
fi

status=0
for name in configure build nccl gpus-visible ptxas gpu-tests memcheck racecheck initcheck comm-sanitize asan-build \
  asan-gpu-tests bench layer; do
  [[ ${result[$name]:-} == FAILED* ]] && status=1
done
exit "$status"
