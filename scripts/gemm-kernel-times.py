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
both count: the span from the first start to the last end). Iterations without GEMM kernels (the
decode rows' same-bytes copies) are skipped. Writes per line: kernel_us (the mean span over the
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
    # Each gap memset opens an iteration; its launch is the GEMM kernels right after it.
    iterations = []
    for i, e in enumerate(ev):
        if memset_bytes(e) != gap:
            continue
        start = end = None
        for f in ev[i + 1:]:
            if memset_bytes(f) == gap:
                break
            if not GEMM.search(f["name"]):
                if start is not None:
                    break
                continue
            if start is None:
                if f["s"] - e["e"] > 50_000:
                    break
                start, end = f["s"], f["e"]
            elif f["s"] - end > 50_000:
                break
            else:
                end = max(end, f["e"])
        iterations.append(None if start is None else (end - start) * 1e-3)
    # Burst blocks: 2 x I iterations per timed line; I from the count (10 with --quick, else 30).
    gemm_iters = [t for t in iterations if t is not None]
    lines = len(results)
    if lines == 0 or len(gemm_iters) % (2 * lines) != 0:
        sys.exit(f"{len(gemm_iters)} timed GEMM launches do not divide into {lines} lines of 2 x I")
    per = len(gemm_iters) // (2 * lines)
    out = []
    for j, r in enumerate(results):
        block = gemm_iters[2 * per * j:2 * per * (j + 1)]
        kernel_us = statistics.fmean(block[per:])
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
