#!/usr/bin/env python3
"""Register-bank parity of the FFMAs in a cubin's kernels (no disassembler needed).

An FFMA whose three source registers (a, b, c) share one parity stalls on dispatch (bench/NOTES.md,
session 32: in the FP8 GEMM's promotion, ncu sampled each such FFMA ~3x as often as its neighbours).
This reads the sm_90 machine code straight from the ELF: 128-bit instructions, FFMA with three
register sources has opcode 0x223 in bits 0-11, d in bits 16-23, a in 24-31, b in 32-39 and c in
bits 64-71 (checked against Nsight Compute's SASS listing of the same kernel; not a documented format,
so re-check it when the toolkit changes).

Usage: ffma-banks.py FILE [NAME_FILTER] [--max-one-parity N]
  FILE: a cubin (nvcc ... -arch=sm_90a -cubin -x cu src/gemm/fp8_grouped_gemm.cu -o FILE.cubin), or
  an object file of the build (e.g. build/CMakeFiles/epmoe.dir/src/gemm/fp8_grouped_gemm.cu.o), whose
  embedded sm_90a cubin is read (nvcc embeds it uncompressed).
Prints, per kernel: FFMA count, how many read three registers of one parity, and the runs of
consecutive FFMAs (a promotion is one run of 64) that contain such instructions. With
--max-one-parity N it exits 1 when a kernel matching NAME_FILTER has more than N such FFMAs (the
test `gemm.fp8_ffma_register_banks` guards the FP8 GEMM's K loop this way: an unrelated edit of the
kernel can move ptxas's allocation and undo the pair-swap, 49 -> 322 such FFMAs and 2% slower in
bench/NOTES.md, session 33), and 2 when FILE holds no matching kernel.
"""
import argparse
import io
import sys

from elftools.elf.elffile import ELFFile


def ffmas(code):
    for i in range(0, len(code), 16):
        lo = int.from_bytes(code[i:i + 8], "little")
        hi = int.from_bytes(code[i + 8:i + 16], "little")
        if lo & 0xFFF == 0x223:
            yield i // 16, (lo >> 24) & 0xFF, (lo >> 32) & 0xFF, hi & 0xFF


def cuda_elfs(data):
    """The CUDA ELF images in data: data itself, or those embedded in a host object's fat binary."""
    elf = ELFFile(io.BytesIO(data))
    if elf["e_machine"] == "EM_CUDA":
        yield elf
        return
    start = data.find(b"\x7fELF", 1)
    while start >= 0:
        try:
            inner = ELFFile(io.BytesIO(data[start:]))
            if inner["e_machine"] == "EM_CUDA":
                yield inner
        except Exception:  # a stray magic number, not an ELF header
            pass
        start = data.find(b"\x7fELF", start + 1)


def main():
    parser = argparse.ArgumentParser(description="Register-bank parity of a cubin's FFMAs.")
    parser.add_argument("file")
    parser.add_argument("name_filter", nargs="?", default="")
    parser.add_argument("--max-one-parity", type=int, default=None)
    args = parser.parse_args()
    worst, kernels = 0, 0
    for elf in cuda_elfs(open(args.file, "rb").read()):
        worst_here, kernels_here = scan(elf, args.name_filter)
        worst, kernels = max(worst, worst_here), kernels + kernels_here
    if args.max_one_parity is not None:
        if kernels == 0:
            print(f"no kernel matching '{args.name_filter}' in {args.file}")
            sys.exit(2)
        if worst > args.max_one_parity:
            print(f"FAIL: {worst} one-parity FFMAs in a kernel, more than {args.max_one_parity}")
            sys.exit(1)
        print(f"ok: at most {worst} one-parity FFMAs per kernel (limit {args.max_one_parity})")


def scan(elf, name_filter):
    worst, kernels = 0, 0
    for sec in elf.iter_sections():
        if not sec.name.startswith(".text.") or name_filter not in sec.name:
            continue
        found = list(ffmas(sec.data()))
        if not found:
            continue
        same = [f for f in found if f[1] % 2 == f[2] % 2 == f[3] % 2]
        worst, kernels = max(worst, len(same)), kernels + 1
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
    return worst, kernels


if __name__ == "__main__":
    main()
