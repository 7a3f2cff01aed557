#!/usr/bin/env python3
"""CPU test of scripts/kernel-trace-summary.py on a synthetic kernel trace (tools/kernel_trace's format).

Two processes' worth of forwards are generated with known kernel durations, offsets and gaps, plus
eager (non-graph) work that --graph must ignore; the summary must give the period, the device idle
time, each kernel's mean duration, offset and count per forward, and refuse a trace without markers.
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "scripts", "kernel-trace-summary.py")


def event(name, start_ns, dur_ns, stream, graph):
    return {"name": name, "ph": "X", "pid": 0, "tid": stream, "ts": start_ns / 1e3, "dur": dur_ns / 1e3,
            "args": {"start_ns": start_ns, "end_ns": start_ns + dur_ns, "graph": graph, "grid": 1, "block": 1,
                     "correlation": 0}}


def trace(forwards, period_ns):
    ev = []
    t0 = 1_000_000
    for f in range(forwards):
        base = t0 + f * period_ns
        ev.append(event("void epmoe::kernels::route_kernel<8, true, false>(RouterParams)", base, 4_000, 14, 7))
        ev.append(event("void gemm_kernel<64>(Params)", base + 10_000, 50_000, 25, 7))
        ev.append(event("void side_kernel(Params)", base + 20_000, 10_000, 30, 7))  # inside the gemm
        ev.append(event("void gemm_kernel<64>(Params)", base + 70_000, 20_000, 25, 7))
        # eager work between graph replays (--graph ignores it)
        ev.append(event("void epmoe::kernels::route_kernel<8, true, false>(RouterParams)", base + 95_000, 1_000, 14, 0))
    return {"pid": 1, "dropped": 0, "cupti_failed": False, "t0_ns": t0, "traceEvents": ev}


def run(args):
    return subprocess.run([sys.executable, SCRIPT] + args, capture_output=True, text=True, check=True)


def main():
    period = 100_000
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "kernels-1.json")
        with open(path, "w") as f:
            json.dump(trace(12, period), f)
        out = os.path.join(d, "summary.json")
        run(["--graph", "--last", "10", "--json", out, path])
        s = json.load(open(out))[0]
        assert s["forwards"] == 10, s
        assert abs(s["period_us"] - 100.0) < 1e-6, s
        # busy: route 0-4, gemm 10-60 (side kernel inside it), gemm 70-90 -> 74 us; idle 26 us
        assert abs(s["idle_us"] - 26.0) < 1e-6, s
        rows = {(r["kernel"], r["stream"]): r for r in s["kernels"]}
        gemm = rows[("gemm_kernel<64>", 25)]
        assert abs(gemm["per_forward"] - 2.0) < 1e-9 and abs(gemm["mean_us"] - 35.0) < 1e-6, gemm
        side = rows[("side_kernel", 30)]
        assert abs(side["offset_us"] - 20.0) < 1e-6 and abs(side["mean_us"] - 10.0) < 1e-6, side
        route = rows[("epmoe::kernels::route_kernel<8, true, false>", 14)]
        assert abs(route["per_forward"] - 1.0) < 1e-9, route  # the eager launches were left out
        # Without --graph the eager router launches are markers too: "forwards" of 95 and 5 us
        # alternate, whose median is 50.
        run(["--last", "10", "--json", out, path])
        s = json.load(open(out))[0]
        assert s["forwards"] == 10 and abs(s["period_us"] - 50.0) < 1e-6, s
        # A trace without the marker: a clear error entry, not a crash.
        empty = os.path.join(d, "kernels-2.json")
        with open(empty, "w") as f:
            json.dump({"traceEvents": [event("void other(P)", 0, 10, 1, 1)]}, f)
        run(["--json", out, empty])
        assert "error" in json.load(open(out))[0]
    print("kernel-trace-summary: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
