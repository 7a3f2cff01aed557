#!/usr/bin/env python3
"""Resource usage of the library's CUDA kernels, from ptxas itself.

Usage: scripts/ptxas-report.py BUILD_DIR LOG [SASS_DIR]

Recompiles every src/**/*.cu of BUILD_DIR/compile_commands.json once more with `-Xptxas -v`
(to a temporary object, the build is untouched), writes ptxas's full report to LOG and prints
one line per kernel: registers, stack frame, spill stores/loads, shared memory. With SASS_DIR,
also writes `cuobjdump -sass` of each object there (when cuobjdump is on PATH or in the CUDA
toolkit). Exits 1 when a kernel spills or has a stack frame, 2 when a compile fails.
"""
import concurrent.futures
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile


def demangle(names):
    cxxfilt = shutil.which("c++filt")
    if not cxxfilt or not names:
        return {n: n for n in names}
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def find_cuobjdump(nvcc):
    tool = shutil.which("cuobjdump")
    if tool:
        return tool
    candidate = os.path.join(os.path.dirname(nvcc), "cuobjdump")
    return candidate if os.path.exists(candidate) else None


def compile_one(entry, tmpdir, sass_dir):
    args = shlex.split(entry["command"]) if "command" in entry else list(entry["arguments"])
    if "-o" in args:
        i = args.index("-o")
        del args[i : i + 2]
    for dep in ("-MD", "-MMD"):
        while dep in args:
            args.remove(dep)
    for flag in ("-MT", "-MF"):
        while flag in args:
            i = args.index(flag)
            del args[i : i + 2]
    obj = os.path.join(tmpdir, os.path.basename(entry["file"]) + ".o")
    args += ["-Xptxas", "-v", "-o", obj]
    proc = subprocess.run(args, cwd=entry.get("directory", "."), capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    if proc.returncode == 0 and sass_dir:
        cuobjdump = find_cuobjdump(args[0])
        if cuobjdump:
            sass = subprocess.run([cuobjdump, "-sass", obj], capture_output=True, text=True).stdout
            with open(os.path.join(sass_dir, os.path.basename(entry["file"]) + ".sass"), "w") as f:
                f.write(sass)
    return entry["file"], proc.returncode, text


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    build_dir, log_path = sys.argv[1], sys.argv[2]
    sass_dir = sys.argv[3] if len(sys.argv) > 3 else None
    if sass_dir:
        os.makedirs(sass_dir, exist_ok=True)
    with open(os.path.join(build_dir, "compile_commands.json")) as f:
        entries = [e for e in json.load(f) if e["file"].endswith(".cu") and "/src/" in e["file"]]
    if not entries:
        print("ptxas-report: no src/**/*.cu in compile_commands.json", file=sys.stderr)
        return 2
    failed = False
    rows = []
    with tempfile.TemporaryDirectory() as tmpdir, open(log_path, "w") as log:
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            results = list(pool.map(lambda e: compile_one(e, tmpdir, sass_dir), entries))
        for path, rc, text in results:
            log.write(f"==== {path} (exit {rc})\n{text}\n")
            if rc != 0:
                failed = True
                print(f"ptxas-report: compiling {path} failed:\n{text}", file=sys.stderr)
                continue
            # ptxas prints, per entry: Compiling entry function 'X' ..., Function properties for X,
            # "N bytes stack frame, N bytes spill stores, N bytes spill loads", "Used N registers, ...".
            current = None
            for line in text.splitlines():
                m = re.search(r"Function properties for (\S+)", line)
                if m:
                    current = {"file": os.path.basename(path), "name": m.group(1), "regs": "?", "stack": 0,
                               "spill_st": 0, "spill_ld": 0, "smem": 0}
                    rows.append(current)
                    continue
                if current is None:
                    continue
                m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
                if m:
                    current["stack"], current["spill_st"], current["spill_ld"] = map(int, m.groups())
                m = re.search(r"Used (\d+) registers", line)
                if m:
                    current["regs"] = int(m.group(1))
                    s = re.search(r"(\d+) bytes smem", line)
                    current["smem"] = int(s.group(1)) if s else 0
    names = demangle([r["name"] for r in rows])
    bad = False
    print(f"{'file':<18} {'regs':>4} {'stack':>5} {'spill st/ld':>11} {'smem':>6}  kernel")
    for r in rows:
        flag = ""
        if r["spill_st"] or r["spill_ld"] or r["stack"]:
            flag, bad = "  <-- spills/stack", True
        short = names[r["name"]]
        short = short if len(short) <= 110 else short[:107] + "..."
        print(f"{r['file']:<18} {r['regs']:>4} {r['stack']:>5} {r['spill_st']:>5}/{r['spill_ld']:<5} {r['smem']:>6}  {short}{flag}")
    if failed:
        return 2
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
