#!/usr/bin/env python3
"""CPU test of scripts/gemm-kernel-times.py on a synthetic burst-timed bench (tools/kernel_trace's format).

Three timed lines of 2 x 4 iterations each (gap memset, then the launch): a single-kernel line, a line
whose launches are a parent and its tail follower (the span counts), and between them a same-bytes copy
(memcpy iterations, no GEMM kernel: skipped). Untimed work sits between the lines: fills, each line's
warm-up launch, and the next line's warm-up right after a line's last iteration (must not be counted):
after 8 ms of host work, and once 10 us after it (lines that share their operands fill nothing in
between; an H100 run of session 58 saw this). The script must give each line the mean span of its second
four launches, and refuse a bench whose line count does not match the trace.
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "scripts", "gemm-kernel-times.py")
GAP = 8 << 30
GEMM = "void epmoe::cuda::kernels::fp8_grouped_gemm_kernel<128, 256, false, false>(CUtensorMap, GroupedGemmParams)"
FOLLOWER = "void epmoe::cuda::kernels::fp8_grouped_gemm_kernel<64, 128, false, false>(CUtensorMap, GroupedGemmParams)"


class Trace:
    def __init__(self):
        self.t = 1_000_000
        self.events = []

    def add(self, name, dur_ns, after_ns=2_000):
        start = self.t + after_ns
        self.events.append({"name": name, "ph": "X", "pid": 0, "tid": 7, "ts": start / 1e3, "dur": dur_ns / 1e3,
                            "args": {"start_ns": start, "end_ns": start + dur_ns, "graph": 0, "grid": 132,
                                     "block": 384, "correlation": len(self.events)}})
        self.t = start + dur_ns

    def line(self, kernels_per_iteration, warm_up_after_ns=5_000_000):
        """kernels_per_iteration(i) -> [(name, dur_ns, gap_before_ns)] for iteration i of 8."""
        for j, (name, dur, gap) in enumerate(kernels_per_iteration(0)):  # the untimed warm-up launch
            self.add(name, dur, after_ns=warm_up_after_ns if j == 0 else gap)
        for i in range(8):
            self.add(f"memset ({GAP} B)", 3_700_000)
            for name, dur, gap in kernels_per_iteration(i):
                self.add(name, dur, after_ns=gap)


def result(name, deepgemm_us):
    return {"bench": name, "time_us": 0.0,
            "params": {"layout": "masked", "groups": 32, "m_per_group": 192, "n": 4096, "k": 7168,
                       "deepgemm_us": deepgemm_us, "vs_deepgemm_tflops": 1.0}}


def main():
    tr = Trace()
    tr.add("fill_random_fp8", 50_000)
    # Line 1: one kernel; the first four (not averaged) 1000 us, the second four 300, 302, 304, 306 us.
    tr.line(lambda i: [(GEMM, 1_000_000 if i < 4 else 300_000 + 2_000 * (i - 4), 4_000)])
    # The copy's warm-up and iterations (memcpy, no GEMM kernel).
    tr.add("memcpy 8 (1000000 B)", 200_000, after_ns=3_000_000)
    for _ in range(8):
        tr.add(f"memset ({GAP} B)", 3_700_000)
        tr.add("memcpy 8 (1000000 B)", 200_000)
    tr.add("fill_random_fp8", 50_000)
    # Line 2: parent 200 us, a 1 us gap, follower 20 us: a span of 221 us in the second half.
    tr.line(lambda i: [(GEMM, 200_000, 3_000), (FOLLOWER, 20_000, 1_000)])
    # A third line, whose warm-up follows line 2's last iteration after 8 ms of host work.
    tr.line(lambda i: [(GEMM, 100_000, 3_000)])
    # A fourth, whose warm-up starts 10 us after line 3's last kernel ends.
    tr.line(lambda i: [(GEMM, 150_000, 3_000)], warm_up_after_ns=10_000)
    # A fifth, parent and follower, whose warm-up (two kernels) joins line 4's last iteration the same way:
    # line 4 keeps its one kernel, line 5's iterations keep both (an H100 run of session 60 saw this
    # split every iteration of such a line into a run of its own).
    tr.line(lambda i: [(GEMM, 180_000, 3_000), (FOLLOWER, 30_000, 1_000)], warm_up_after_ns=10_000)
    # A same-bytes copy, then a sixth line whose warm-up starts 10 us after the copy's last iteration
    # (joins it): the copy stays a run without GEMM kernels (skipped), the sixth line is paired.
    tr.add("memcpy 8 (1000000 B)", 200_000, after_ns=3_000_000)
    for _ in range(8):
        tr.add(f"memset ({GAP} B)", 3_700_000)
        tr.add("memcpy 8 (1000000 B)", 200_000)
    tr.line(lambda i: [(GEMM, 120_000, 3_000)], warm_up_after_ns=10_000)
    bench = {"results": [result("gemm.masked", 301.0), result("gemm.contiguous", 221.0), result("gemm.masked.x", 0),
                         result("gemm.masked.y", 0), result("gemm.contiguous.split", 0),
                         result("gemm.masked.after_copy", 0)]}
    for i, r in enumerate(bench["results"]):
        r["time_us"] = [304.2, 224.1, 103.1, 153.1, 214.0, 123.0][i]
    with tempfile.TemporaryDirectory() as d:
        trace = os.path.join(d, "kernels-1.json")
        json.dump({"pid": 1, "traceEvents": tr.events}, open(trace, "w"))
        bj = os.path.join(d, "bench.json")
        json.dump(bench, open(bj, "w"))
        oj = os.path.join(d, "out.json")
        subprocess.run([sys.executable, SCRIPT, bj, trace, "--json", oj], check=True, stdout=subprocess.DEVNULL)
        out = json.load(open(oj))
        assert out["iterations_per_line"] == 4, out
        got = [round(line["kernel_us"], 3) for line in out["lines"]]
        assert got == [303.0, 221.0, 100.0, 150.0, 211.0, 120.0], got
        assert abs(out["lines"][0]["vs_deepgemm_kernel"] - 301.0 / 303.0) < 1e-9, out["lines"][0]
        assert abs(out["lines"][1]["vs_deepgemm_tflops_kernel"] - 224.1 / 221.0) < 1e-9, out["lines"][1]
        assert "vs_deepgemm_kernel" not in out["lines"][2], out["lines"][2]
        # A bench of five lines for a trace of six: refused.
        bench["results"].pop()
        json.dump(bench, open(bj, "w"))
        r = subprocess.run([sys.executable, SCRIPT, bj, trace], capture_output=True, text=True)
        assert r.returncode != 0 and "do not pair" in r.stderr, (r.returncode, r.stderr)
    print("ok")


if __name__ == "__main__":
    main()
