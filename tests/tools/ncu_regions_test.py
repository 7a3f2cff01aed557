#!/usr/bin/env python3
"""scripts/ncu-regions.py on the library's own FP8 GEMM object: a synthetic source-page CSV (one row
per instruction, every sample column 1) must come out with every instruction in one region, the
regions' markers found in the kernel source (an edit that renames them fails here, not on the GPU
machine), and a K loop, an epilogue and a producer of plausible size; with every instruction a wgmma
(QGMMA), none may count toward the tile turn (K block 0's wgmma follow the turn's code).

Usage: ncu_regions_test.py OBJECT
"""
import csv
import gzip
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "..", "..", "scripts")


def main():
    obj = sys.argv[1]
    spec = importlib.util.spec_from_file_location("ffma_banks", os.path.join(SCRIPTS, "ffma-banks.py"))
    ffma = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ffma)
    count = 0
    for elf in ffma.cuda_elfs(open(obj, "rb").read()):
        for section in elf.iter_sections():
            if section.name.startswith(".text.") and "128ELi256" in section.name:
                count = len(section.data()) // 16
    assert count > 1000, f"no 128 x 256 kernel in {obj}"
    def run(opcode):
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "src.csv.gz")
            with gzip.open(src, "wt", newline="") as f:
                w = csv.writer(f)
                w.writerow(["Address", "Source", "Warp Stall Sampling (All Samples)"])
                for i in range(count):
                    w.writerow([hex(0x7F0000000000 + 16 * i), opcode, 1])
            out = os.path.join(tmp, "regions.json")
            subprocess.run([sys.executable, os.path.join(SCRIPTS, "ncu-regions.py"), src, obj, "--json", out],
                           check=True, stdout=subprocess.DEVNULL)
            return json.load(open(out))

    regions = run("NOP")
    total = sum(r["instructions"] for r in regions.values())
    assert total == count, (total, count)
    samples = sum(r["Warp Stall Sampling (All Samples)"] for r in regions.values())
    assert samples == count, (samples, count)
    for name in ("producer", "consumer.k_loop", "consumer.epilogue", "consumer.turn"):
        assert regions.get(name, {}).get("instructions", 0) > 100, (name, regions.get(name))
    wgmma = run("QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR24], R24")
    assert "consumer.turn" not in wgmma, wgmma.get("consumer.turn")
    moved = regions["consumer.k_loop"]["instructions"] + regions["consumer.turn"]["instructions"]
    assert wgmma["consumer.k_loop"]["instructions"] == moved, (wgmma["consumer.k_loop"], moved)
    print("ok:", {k: int(v["instructions"]) for k, v in sorted(regions.items())})


if __name__ == "__main__":
    main()
