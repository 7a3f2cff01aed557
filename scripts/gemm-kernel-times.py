#!/usr/bin/env python3
"""Kernel durations of `epmoe bench gemm`'s burst-timed lines, from a tools/kernel_trace timeline.

DeepGEMM's anchors (anchors.md) are kernel durations from the profiler (its bench_kineto); the bench's
time_us are CUDA-event times, which also hold the launch and the events (~3 us, bench/NOTES.md session
21). Run the bench under the CUPTI injection library and this script pairs each timed launch with its
kernels, so that the two sides are compared the same way:

  CUDA_INJECTION64_PATH=build/lib/libepmoe_kernel_trace.so EPMOE_KERNEL_TRACE_DIR=tr \\
      build/bin/epmoe bench gemm --quant fp8 --json bench.json
  scripts/gemm-kernel-times.py bench.json tr/kernels-*.json [--json OUT]

Burst timing (src/bench/bench.cpp) runs each line as: one untimed launch, then 2 x I iterations of
(memset of the gap buffer, the launch), the second I averaged. A launch's kernels are the GEMM kernels
that start within 50 us of the memset's end, one after another (a parent and its tail follower
both count: the span from the first start to the last end); a line's iterations follow each other
with nothing else between (a next line's warm-up that joins the last iteration is cut off by its kernel
count), so the runs of iterations pair with the bench's lines one to one (runs
without GEMM kernels, the decode rows' same-bytes copies, are skipped). Writes per line: kernel_us (the mean span over the
second I iterations), event_us (the bench's time_us), and vs_deepgemm_kernel (deepgemm_us / kernel_us).
"""
import argparse
import json
import re
import statistics
import sys

GEMM = re.compile(r"grouped_gemm|masked_swap")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("bench")
    ap.add_argument("trace")
    ap.add_argument("--json")
    a = ap.parse_args()
    bench = json.load(open(a.bench))
    results = bench["results"]
    ev = [e for e in json.load(open(a.trace))["traceEvents"] if e.get("ph") == "X"]
    for e in ev:
        e["s"], e["e"] = e["args"]["start_ns"], e["args"]["end_ns"]
    ev.sort(key=lambda e: e["s"])

    def memset_bytes(e):
        m = re.match(r"memset \((\d+) B\)", e["name"])
        return int(m.group(1)) if m else 0

    gap = max((memset_bytes(e) for e in ev), default=0)
    if gap < (1 << 30):
        sys.exit("no gap-buffer memsets (>= 1 GiB) in the trace: was the bench burst-timed?")
    # Each gap memset opens an iteration; its launch is what starts within 50 us of it, one event after
    # another (the GEMM kernels of it: the span). Anything else before the next gap memset (a warm-up
    # launch, fills, host work's kernels) ends a line's run of iterations.
    # Each iteration: the list of its GEMM kernels' (start, end).
    runs, run = [], []
    i = 0
    while i < len(ev):
        e = ev[i]
        if memset_bytes(e) != gap:
            if run:
                runs.append(run)
                run = []
            i += 1
            continue
        last_end, kernels = e["e"], []
        i += 1
        while i < len(ev) and memset_bytes(ev[i]) != gap and ev[i]["s"] - last_end <= 50_000:
            f = ev[i]
            last_end = max(last_end, f["e"])
            if GEMM.search(f["name"]):
                kernels.append((f["s"], f["e"]))
            i += 1
        run.append(kernels)
    if run:
        runs.append(run)
    # The next line's warm-up launch may start within 50 us of a line's last iteration (lines that share
    # their operands fill nothing in between) and join it: an iteration with more GEMM kernels than the one
    # before it keeps as many as that one had, and its run ends there.
    split_runs = []
    for r in runs:
        begin = 0
        for j in range(1, len(r)):
            # Compared within the current run only: the first iteration after a cut belongs to the next
            # line, whose launches may hold more kernels (a parent and its tail follower) than the last.
            # (A same-bytes copy's iteration has no GEMM kernel: a GEMM warm-up joining its last one is cut
            # off the same way, to none.)
            if j - 1 >= begin and len(r[j]) > len(r[j - 1]):
                r[j] = r[j][: len(r[j - 1])]
                split_runs.append(r[begin : j + 1])
                begin = j + 1
        if begin < len(r):
            split_runs.append(r[begin:])
    runs = [[(max(k[1] for k in it) - it[0][0]) * 1e-3 if it else None for it in r] for r in split_runs]
    # A line's run: 2 x I launches with GEMM kernels (I: 10 with --quick, else 30); runs without any
    # (the decode rows' same-bytes copies) are not lines.
    line_runs = []
    for r in runs:
        if all(t is None for t in r):
            continue
        if any(t is None for t in r) or len(r) % 2 != 0:
            sys.exit(f"a run of {len(r)} timed launches mixes GEMM and other launches or is odd")
        line_runs.append(r)
    lines = len(results)
    if len(line_runs) != lines or len({len(r) for r in line_runs}) != 1:
        sys.exit(f"{len(line_runs)} runs of timed GEMM launches ({sorted({len(r) for r in line_runs})} each) do "
                 f"not pair with the bench's {lines} lines")
    per = len(line_runs[0]) // 2
    out = []
    for j, r in enumerate(results):
        kernel_us = statistics.fmean(line_runs[j][per:])
        p = r["params"]
        row = {
            "bench": r["bench"],
            "layout": p.get("layout"),
            "groups": p.get("groups"),
            "m_per_group": p.get("m_per_group"),
            "n": p.get("n"),
            "k": p.get("k"),
            "event_us": r["time_us"],
            "kernel_us": kernel_us,
            "deepgemm_us": p.get("deepgemm_us"),
        }
        if p.get("deepgemm_us"):
            row["vs_deepgemm_kernel"] = p["deepgemm_us"] / kernel_us
            # TFLOPS on the kernel time (both sides' valid rows: the bench's ratio of rates, rescaled).
            if p.get("vs_deepgemm_tflops"):
                row["vs_deepgemm_tflops_kernel"] = p["vs_deepgemm_tflops"] * r["time_us"] / kernel_us
        out.append(row)
        print(f"{row['bench']:<34} {p.get('groups', ''):>4} x {p.get('m_per_group', ''):<5} "
              f"{p.get('n', '')} x {p.get('k', '')}  event {r['time_us']:8.1f}  kernel {kernel_us:8.1f}"
              + (f"  DeepGEMM {p['deepgemm_us']:7.1f}  time ratio {row['vs_deepgemm_kernel']:.3f}"
                 if "vs_deepgemm_kernel" in row else ""))
    if a.json:
        json.dump({"iterations_per_line": per, "lines": out}, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
