#!/usr/bin/env python3
"""Nsight Compute's per-instruction samples of the FP8 GEMM summed by code region, the regions taken
from the kernel's line table (not from fixed addresses, which move with every edit: session 34's
fixed ranges missed the consumers' scheduler code, bench/NOTES.md session 35).

Usage: ncu-regions.py SRC_CSV[.gz] OBJECT [NAME_FILTER] [--json OUT]
  SRC_CSV: `ncu -i REP --page source --csv --print-source sass` of one launch (scripts/gemm-ncu.sh's
           src_ROW.csv.gz); OBJECT: the cubin or the build's object file of the same build
           (build-gpu/CMakeFiles/epmoe.dir/src/gemm/fp8_grouped_gemm.cu.o; -lineinfo, as the build
           has); NAME_FILTER: picks the kernel in OBJECT (default 128ELi256).
Regions (from src/gemm/fp8_grouped_gemm_kernel.cuh's markers): producer, consumer.turn (the consumer
loop's own code outside the K loop and the epilogue: its head, set-up, accumulator zeroing),
consumer.k_loop, consumer.epilogue; GemmScheduler's inlined code and helpers from other lines or files
count toward the region of the closest kernel-body instruction before them (".scheduler" appended
for the scheduler's), except promote() (gemm_common.cuh), which counts toward consumer.k_loop. Prints, per region, instructions and every sample column of the CSV.
"""
import argparse
import bisect
import collections
import csv
import gzip
import importlib.util
import io
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
KERNEL_SOURCE = os.path.join(HERE, "..", "src", "gemm", "fp8_grouped_gemm_kernel.cuh")
KERNEL_FILE = "fp8_grouped_gemm_kernel.cuh"
# The helpers the GEMMs share (promote() among them).
COMMON_SOURCE = os.path.join(HERE, "..", "src", "gemm", "gemm_common.cuh")
COMMON_FILE = "gemm_common.cuh"


def load(name):
    spec = importlib.util.spec_from_file_location(name.replace("-", "_"), os.path.join(HERE, name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def line_of(lines, pattern, start=0, path=KERNEL_SOURCE):
    for i in range(start, len(lines)):
        if re.search(pattern, lines[i]):
            return i + 1  # 1-based
    sys.exit(f"ncu-regions: no line matching {pattern!r} in {path}")


def body_regions():
    """[(first line, last line, region)] of the kernel body, the scheduler's line range, and promote()'s
    in gemm_common.cuh (inlined into the K loop only)."""
    lines = open(KERNEL_SOURCE).read().split("\n")
    scheduler_start = line_of(lines, r"^class GemmScheduler")
    scheduler = (scheduler_start, line_of(lines, r"^};", scheduler_start))
    kernel = line_of(lines, r"fp8_grouped_gemm_kernel\(const __grid_constant__")
    producer = line_of(lines, r"-{20,} producer warpgroup", kernel)
    consumer = line_of(lines, r"-{20,} consumer warpgroups", producer)
    # The K loop's code starts with free_stage (called per K block), then the loops themselves.
    k_loop = min(line_of(lines, r"const auto free_stage = \[&\]", consumer),
                 line_of(lines, r"const auto k_block = \[&\]", consumer),
                 line_of(lines, r"const auto two_partial_k_loop = \[&\]", consumer))
    k_loop_end = line_of(lines, r"const auto store_wave = \[&\]", k_loop)
    epilogue = line_of(lines, r"// Epilogue: bf16 to global memory, valid rows only \(store_wave above\)", k_loop_end)
    epilogue_end = line_of(lines, r"^\s+if \(trace\) \{", epilogue)
    end = len(lines)
    common = open(COMMON_SOURCE).read().split("\n")
    promote = line_of(common, r"^__device__ __forceinline__ void promote\(", path=COMMON_SOURCE)
    promote_lines = (promote, line_of(common, r"^}", promote, path=COMMON_SOURCE))
    return scheduler, promote_lines, [
        (kernel, producer - 1, "kernel.start"),
        (producer, consumer - 1, "producer"),
        (consumer, k_loop - 1, "consumer.turn"),
        (k_loop, k_loop_end - 1, "consumer.k_loop"),
        (k_loop_end, epilogue - 1, "consumer.turn"),
        (epilogue, epilogue_end - 1, "consumer.epilogue"),
        (epilogue_end, end, "consumer.turn"),
    ]


def read_csv(path):
    raw = gzip.open(path, "rt") if path.endswith(".gz") else open(path)
    rows = list(csv.reader(raw))
    header_at = next((i for i, r in enumerate(rows) if any(c.strip() == "Address" for c in r)), None)
    if header_at is None:
        sys.exit(f"ncu-regions: no 'Address' column in {path}")
    header = [c.strip() for c in rows[header_at]]
    address = header.index("Address")
    source = header.index("Source") if "Source" in header else None
    records = []
    for r in rows[header_at + 1:]:
        if len(r) != len(header):
            continue
        try:
            at = int(r[address].strip(), 16)
        except ValueError:
            continue
        values = {}
        for i, name in enumerate(header):
            if i == address:
                continue
            try:
                values[name] = float(r[i].replace(",", ""))
            except ValueError:
                pass
        records.append((at, values, r[source] if source is not None else ""))
    if not records:
        sys.exit(f"ncu-regions: no instruction rows in {path}")
    base = min(at for at, _, _ in records)
    columns = [c for c in header if "ampl" in c or "stall" in c.lower()]
    return [(at - base, v, s) for at, v, s in records], columns


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv")
    parser.add_argument("object")
    parser.add_argument("filter", nargs="?", default="128ELi256")
    parser.add_argument("--json")
    args = parser.parse_args()

    ffma = load("ffma-banks.py")
    sass = load("sass_stats.py")
    data = open(args.object, "rb").read()
    table = None
    for elf in ffma.cuda_elfs(data):
        for kernel, entries in sass.line_tables(elf).items():
            if args.filter in kernel:
                table = entries
                break
        if table:
            break
    if not table:
        sys.exit(f"ncu-regions: no line table for a kernel matching {args.filter!r} in {args.object}")
    addresses = [a for a, _ in table]
    scheduler, promote_lines, regions = body_regions()

    def body_region(line):
        for first, last, name in regions:
            if first <= line <= last:
                return name
        return None

    # Code of other files (ptx_hopper.cuh's wrappers) takes the region of the kernel-body code before
    # it, except the K loop's own instructions: K block 0's wgmma and waits follow the tile turn's code
    # in the unrolled loop (session 37: counted as the turn's, they were most of its samples).
    k_loop_ops = ("QGMMA", "HGMMA", "WARPGROUP.")

    def region_at(at, context):
        i = bisect.bisect_right(addresses, at) - 1
        name, line = table[i][1] if i >= 0 else ("?", 0)
        if name == KERNEL_FILE:
            region = body_region(line)
            if region is not None:
                return region, region
            if scheduler[0] <= line <= scheduler[1]:
                return context + ".scheduler", context
        if name == COMMON_FILE and promote_lines[0] <= line <= promote_lines[1]:
            return "consumer.k_loop", "consumer.k_loop"
        return context, context

    records, columns = read_csv(args.csv)
    sums = collections.defaultdict(collections.Counter)
    context = "kernel.start"
    for at, values, source in sorted(records, key=lambda r: r[0]):
        region, context = region_at(at, context)
        opcode = source.split()[1] if source.lstrip().startswith("@") and len(source.split()) > 1 else source.strip()
        if region == "consumer.turn" and opcode.startswith(k_loop_ops):
            region = "consumer.k_loop"
        sums[region]["instructions"] += 1
        for c in columns:
            sums[region][c] += values.get(c, 0.0)
    total = collections.Counter()
    for s in sums.values():
        total.update(s)
    shown = ["instructions"] + columns
    print("region".ljust(28) + "".join(f"{c[:22]:>24}" for c in shown))
    for region in sorted(sums):
        row = "".join(f"{sums[region][c]:>24.0f}" for c in shown)
        print(region.ljust(28) + row)
    print("total".ljust(28) + "".join(f"{total[c]:>24.0f}" for c in shown))
    if args.json:
        json.dump({r: dict(s) for r, s in sums.items()}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
