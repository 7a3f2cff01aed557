#!/usr/bin/env python3
"""Tables of an `ab-device.sh` call, and its results JSON for bench/results/.

Usage: ab-table.py DIR [--json OUT --date DATE --note NOTE a=COMMIT b=COMMIT ...]
  DIR: the call's x/ folder (ab.tgz unpacked). Prints the untraced lines' median time per row for
  tree a and every other tree's ratio to it (ab_TREE_REP.json), then the traced runs' (tr_TREE_ROW_REP
  .json, AB_TRACE_ROWS) per-tile trace words by row, line and tree. With --json, writes every result
  of the call, each tagged with its tree, that tree's commit, the alternation and the kind of run, and
  the median table: the bench/results file of the call.
"""
import argparse
import glob
import json
import os
import re
import statistics

TRACE_KEYS = [
    "loop_cycles_per_tile", "producer_turn_per_tile", "producer_kb0_wait_per_tile", "consumer_turn_per_tile",
    "consumer_kb0_wait_per_tile", "epilogue_per_tile", "store_per_tile", "epi_done_wait_per_tile",
    "empty_wait_per_tile",
]
NAME = re.compile(r"(ab|abl|tr)_([a-z])_(?:(\S+)_)?(\d+)\.json$")


def row_key(p):
    return f"{p['layout']} {p['groups']}x{p.get('m_per_group')} n{p['n']} k{p['k']}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--json")
    parser.add_argument("--date", default="")
    parser.add_argument("--note", default="")
    parser.add_argument("trees", nargs="*", help="TREE=COMMIT")
    args = parser.parse_intermixed_args()
    commits = dict(t.split("=", 1) for t in args.trees)

    results, device = [], None
    for path in sorted(glob.glob(os.path.join(args.dir, "*.json"))):
        m = NAME.match(os.path.basename(path))
        if not m:
            continue
        kind, tree, _, rep = m.groups()
        data = json.load(open(path))
        device = device or data.get("device")
        for r in data.get("results", []):
            r = dict(r)
            r["params"] = dict(r["params"], tree=tree, tree_commit=commits.get(tree, "?"), rep=int(rep),
                               run={"ab": "untraced", "abl": "ablations", "tr": "traced"}[kind])
            results.append(r)

    times = {}
    for r in results:
        p = r["params"]
        if p["run"] == "untraced":
            times.setdefault(row_key(p), {}).setdefault(p["tree"], []).append(r["time_us"])
    trees = sorted({t for v in times.values() for t in v})
    summary = {}
    if times:
        print("row".ljust(36) + "a (us)".rjust(10) + "".join(f"{t + '/a':>9}" for t in trees if t != "a") + "  spread a")
    for row, by_tree in times.items():
        med = {t: statistics.median(v) for t, v in by_tree.items()}
        summary[row] = {t: round(v, 2) for t, v in sorted(med.items())}
        if "a" not in med:
            continue
        a = med["a"]
        spread = (max(by_tree["a"]) - min(by_tree["a"])) / a
        ratios = "".join(f"{med[t] / a:9.3f}" if t in med else " " * 9 for t in trees if t != "a")
        for t in trees:
            if t != "a" and t in med:
                summary[row][f"{t}_over_a"] = round(med[t] / a, 4)
        print(f"{row:36}{a:10.1f}{ratios}  {spread:.3f}")

    traced = {}
    for r in results:
        p = r["params"]
        if p["run"] != "untraced" and any(k in p for k in TRACE_KEYS):
            key = (row_key(p), r["bench"], p["tree"])
            traced.setdefault(key, []).append(dict(p, time_us=r["time_us"]))
    if traced:
        shown = ["time_us"] + TRACE_KEYS
        print("\ntraced, medians (cycles per tile)")
        print("row / line / tree".ljust(60) + "".join(f"{k.replace('_per_tile', '')[:14]:>15}" for k in shown))
        for key in sorted(traced):
            values = traced[key]
            cells = []
            for k in shown:
                v = [x[k] for x in values if k in x]
                cells.append(f"{statistics.median(v):15.0f}" if v else " " * 15)
            print(f"{key[0] + ' ' + key[1] + ' ' + key[2]:60}" + "".join(cells))

    if args.json:
        json.dump({"commit": commits.get("b", "?"), "device": device, "date": args.date, "note": args.note,
                   "trees": commits, "median_us_untraced": summary, "results": results},
                  open(args.json, "w"), indent=0)
        print(f"\nwrote {args.json}: {len(results)} results")


if __name__ == "__main__":
    main()
