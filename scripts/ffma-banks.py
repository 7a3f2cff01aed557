#!/usr/bin/env python3
"""Register-bank parity of the FFMAs in a cubin's kernels (no disassembler needed).

An FFMA whose three source registers (a, b, c) share one parity stalls on dispatch (bench/NOTES.md,
session 32: in the FP8 GEMM's promotion, ncu sampled each such FFMA ~3x as often as its neighbours).
This reads the sm_90 machine code straight from the ELF: 128-bit instructions, FFMA with three
register sources has opcode 0x223 in bits 0-11, d in bits 16-23, a in 24-31, b in 32-39 and c in
bits 64-71 (checked against Nsight Compute's SASS listing of the same kernel; not a documented format,
so re-check it when the toolkit changes).

Usage: ffma-banks.py FILE.cubin [NAME_FILTER]
       (a cubin: nvcc ... -arch=sm_90a -cubin -x cu src/gemm/fp8_grouped_gemm.cu -o FILE.cubin)
Prints, per kernel: FFMA count, how many read three registers of one parity, and the runs of
consecutive FFMAs (a promotion is one run of 64) that contain such instructions.
"""
import sys

from elftools.elf.elffile import ELFFile


def ffmas(code):
    for i in range(0, len(code), 16):
        lo = int.from_bytes(code[i:i + 8], "little")
        hi = int.from_bytes(code[i + 8:i + 16], "little")
        if lo & 0xFFF == 0x223:
            yield i // 16, (lo >> 24) & 0xFF, (lo >> 32) & 0xFF, hi & 0xFF


def main():
    path = sys.argv[1]
    name_filter = sys.argv[2] if len(sys.argv) > 2 else ""
    elf = ELFFile(open(path, "rb"))
    for sec in elf.iter_sections():
        if not sec.name.startswith(".text.") or name_filter not in sec.name:
            continue
        found = list(ffmas(sec.data()))
        if not found:
            continue
        same = [f for f in found if f[1] % 2 == f[2] % 2 == f[3] % 2]
        print(f"{sec.name[6:]}: {len(found)} FFMA, {len(same)} with a, b, c of one parity")
        runs, run = [], [found[0]]
        for f in found[1:]:
            if f[0] - run[-1][0] > 40:
                runs.append(run)
                run = []
            run.append(f)
        runs.append(run)
        for r in runs:
            bad = [f for f in r if f[1] % 2 == f[2] % 2 == f[3] % 2]
            if bad and len(r) >= 16:
                regs = ", ".join(f"R{a}/R{b}/R{c}" for _, a, b, c in bad[:4])
                print(f"  run at instruction {r[0][0]}: {len(r)} FFMA, {len(bad)} one-parity ({regs} ...)")


if __name__ == "__main__":
    main()
