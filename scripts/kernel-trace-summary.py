#!/usr/bin/env python3
"""Summarise the kernel timelines written by tools/kernel_trace (one kernels-<pid>.json per process).

Usage: scripts/kernel-trace-summary.py [--marker REGEX] [--last N] [--graph] [--json OUT] kernels-*.json

For each file (one rank): the forwards are cut at each launch of the marker kernel (default: the
router, whose launch starts every forward of the layer); of the last N complete forwards it prints
the mean forward period, each kernel's mean duration and start offset within the forward (sorted by
offset, with its stream), and the time in the forward when no kernel ran on the device (gaps).
"""
import argparse
import json
import re
import statistics
import sys


def load(path, graph_only):
    with open(path) as f:
        d = json.load(f)
    ev = [e for e in d["traceEvents"] if e.get("ph") == "X" and (not graph_only or e["args"]["graph"] != 0)]
    for e in ev:
        e["s"] = e["args"]["start_ns"]
        e["e"] = e["args"]["end_ns"]
    ev.sort(key=lambda e: e["s"])
    return d, ev


def short(name, width=70):
    name = re.sub(r"\(.*", "", name)  # drop the argument list
    name = re.sub(r"^void ", "", name)
    return name if len(name) <= width else name[: width - 3] + "..."


def summarise(path, marker, last, graph_only):
    d, ev = load(path, graph_only)
    starts = [i for i, e in enumerate(ev) if re.search(marker, e["name"])]
    if len(starts) < 3:
        return {"file": path, "error": f"fewer than 3 marker kernels matching {marker!r}"}
    starts = starts[-(last + 1):]
    forwards = []
    for a, b in zip(starts, starts[1:]):
        t0, t1 = ev[a]["s"], ev[b]["s"]
        forwards.append((t0, t1, [e for e in ev[a:b] if e["s"] < t1]))
    periods = [(t1 - t0) / 1e3 for t0, t1, _ in forwards]
    per_kernel = {}
    gaps = []
    for t0, t1, kernels in forwards:
        covered, cursor = 0, t0
        for e in sorted(kernels, key=lambda e: e["s"]):
            s, t = max(e["s"], cursor), min(e["e"], t1)
            if t > s:
                covered += t - s
                cursor = t
            key = (short(e["name"]), e["tid"])
            k = per_kernel.setdefault(key, {"dur": [], "off": []})
            k["dur"].append((e["e"] - e["s"]) / 1e3)
            k["off"].append((e["s"] - t0) / 1e3)
        gaps.append((t1 - t0 - covered) / 1e3)
    n = len(forwards)
    rows = []
    for (name, stream), k in per_kernel.items():
        rows.append({"kernel": name, "stream": stream, "per_forward": len(k["dur"]) / n,
                     "mean_us": statistics.mean(k["dur"]), "offset_us": statistics.median(k["off"])})
    rows.sort(key=lambda r: r["offset_us"])
    return {"file": path, "forwards": n, "period_us": statistics.median(periods),
            "idle_us": statistics.median(gaps), "kernels": rows}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--marker", default=r"route_(g8_)?(sieve_|softmax_)?kernel|route_kernel")
    ap.add_argument("--last", type=int, default=50)
    ap.add_argument("--graph", action="store_true", help="only work launched by CUDA graphs (replays)")
    ap.add_argument("--json")
    a = ap.parse_args()
    out = [summarise(f, a.marker, a.last, a.graph) for f in a.files]
    for s in out:
        if "error" in s:
            print(f"{s['file']}: {s['error']}")
            continue
        print(f"== {s['file']}: {s['forwards']} forwards, period {s['period_us']:.1f} us, "
              f"device idle {s['idle_us']:.1f} us per forward")
        print(f"  {'offset':>8} {'mean':>8} {'n/fwd':>5} {'stream':>6}  kernel")
        for r in s["kernels"]:
            print(f"  {r['offset_us']:8.1f} {r['mean_us']:8.1f} {r['per_forward']:5.2f} {r['stream']:6d}  {r['kernel']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
