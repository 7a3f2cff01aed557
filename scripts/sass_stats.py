#!/usr/bin/python3
"""Static SASS statistics of the kernels in a cubin, without cuobjdump or nvdisasm (neither is in
the build machine's toolkit, and the GPU machine's cuobjdump printed nothing for our cubins).

Per kernel: its instruction count, its S2R instructions by special register (S2R SR_CgaCtaId is how
ptxas re-makes a shared-memory array's base address on sm_90; S2R SR_TID.X a re-read threadIdx.x;
many of either mean values rematerialised under register pressure), its local-memory spill stores
and loads (STL, LDL), and with --lines where they sit: for an S2R the source line of the first
following instruction of another line, for STL / LDL their own line (build with -lineinfo).
--perline prints the instruction count of every source line of the first matching kernel.

Build the cubin as the project does, plus -cubin and -lineinfo, e.g.
  nvcc -I include -I src -O3 -DNDEBUG -DFMT_SHARED -arch=sm_90a -std=c++20 --expt-relaxed-constexpr \
       -cubin -lineinfo -x cu src/routing/router_gpu.cu -o /tmp/router.cubin
  scripts/sass_stats.py /tmp/router.cubin sieve_kernel --lines

The decoding relies on two facts of the sm_90 encoding read off our own cubins, not on a
specification: each instruction is 16 bytes, little-endian, with the opcode in its low 12 bits
(S2R = 0x919, STL = 0x387, LDL = 0x983), and an S2R's special register in byte 9 (0x21 SR_TID.X, 0x25 SR_CTAID.X, 0x88
SR_CgaCtaId). Source lines come from the DWARF .debug_line section that -lineinfo adds, read with
pyelftools (Debian: python3-pyelftools, for /usr/bin/python3).
"""
import argparse
import bisect
import collections
import os
import sys

try:
    from elftools.elf.elffile import ELFFile
except ImportError:
    sys.exit("sass_stats.py needs pyelftools: apt-get install python3-pyelftools (then run it with /usr/bin/python3)")

OPCODE_S2R = 0x919
OPCODES_LOCAL = {0x387: "STL", 0x983: "LDL"}  # spill stores and loads
SPECIAL_REGISTERS = {0x21: "TID.X", 0x22: "TID.Y", 0x23: "TID.Z", 0x25: "CTAID.X", 0x88: "CgaCtaId"}


def line_tables(elf):
    """{kernel section name: sorted [(address, (file, line))]} from .debug_line, whose sequences
    start at a relocated DW_LNE_set_address (one relocation per sequence, in order)."""
    debug_line = elf.get_section_by_name(".debug_line")
    if debug_line is None:
        return {}
    dwarf = elf.get_dwarf_info(relocate_dwarf_sections=False)
    symtab = elf.get_section_by_name(".symtab")
    targets = {}
    relocations = elf.get_section_by_name(".rela.debug_line")
    if relocations is not None:
        for r in relocations.iter_relocations():
            sym = symtab.get_symbol(r["r_info_sym"])
            targets[r["r_offset"]] = sym.name or elf.get_section(sym["st_shndx"]).name
    tables = collections.defaultdict(dict)
    offset = 0
    while offset < debug_line["sh_size"]:
        program = dwarf._parse_line_program_at_offset(offset, dwarf.structs)  # no CUs to go through
        files = [f.name.decode() for f in program["file_entry"]]
        length = program["unit_length"] + (4 if dwarf.structs.dwarf_format == 32 else 12)
        starts = sorted(k for k in targets if offset <= k < offset + length)
        sequence = 0
        kernel = None
        for entry in program.get_entries():
            if entry.is_extended and entry.command == 2:  # DW_LNE_set_address: a new sequence
                kernel = targets[starts[sequence]] if sequence < len(starts) else None
                sequence += 1
            state = entry.state
            if state is not None and kernel is not None:
                index = state.file - 1
                name = os.path.basename(files[index]) if 0 <= index < len(files) else "?"
                tables[kernel][state.address] = (name, state.line)
        offset += length
    return {k: sorted(v.items()) for k, v in tables.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cubin")
    parser.add_argument("filter", nargs="?", default="", help="substring of the kernels' mangled names")
    parser.add_argument("--lines", action="store_true", help="where the S2R instructions sit")
    parser.add_argument("--perline", action="store_true", help="instructions per source line (first kernel)")
    args = parser.parse_args()

    elf = ELFFile(open(args.cubin, "rb"))
    tables = line_tables(elf) if args.lines or args.perline else {}
    perline_done = False
    for section in elf.iter_sections():
        if not section.name.startswith(".text.") or args.filter not in section.name:
            continue
        kernel = section.name.removeprefix(".text.")
        code = section.data()
        table = tables.get(kernel, [])
        addresses = [a for a, _ in table]

        def source(address):
            i = bisect.bisect_right(addresses, address) - 1
            return table[i][1] if i >= 0 else ("?", 0)

        counts = collections.Counter()  # S2R by register, STL, LDL
        places = collections.defaultdict(collections.Counter)
        per_line = collections.Counter()
        for at in range(0, len(code), 16):
            word = int.from_bytes(code[at:at + 8], "little")
            if table:
                per_line[source(at)] += 1
            if word & 0xFFF in OPCODES_LOCAL:
                name = OPCODES_LOCAL[word & 0xFFF]
                counts[name] += 1
                if table:
                    places[name]["%s:%d" % source(at)] += 1
                continue
            if word & 0xFFF != OPCODE_S2R:
                continue
            register = SPECIAL_REGISTERS.get(code[at + 9], f"SR{code[at + 9]:#x}")
            counts[register] += 1
            if table:
                own = source(at)
                after = (source(b) for b in range(at + 16, min(len(code), at + 96), 16))
                places[register]["%s:%d" % next((s for s in after if s != own), own)] += 1
        print(len(code) // 16, "instructions;", "S2R / STL / LDL", dict(sorted(counts.items())), kernel)
        if args.lines:
            for register, where in sorted(places.items()):
                print("   ", register, ", ".join(f"{k} x{v}" for k, v in sorted(where.items())))
        if args.perline and not perline_done and table:
            perline_done = True
            for (name, line), n in sorted(per_line.items(), key=lambda kv: -kv[1]):
                print(f"  {n:6d} {name}:{line}")


if __name__ == "__main__":
    main()
