#!/usr/bin/env bash
# Prints a directory holding the libnccl that EPMOE_BIN (an epmoe CLI) was compiled against, to put first
# on LD_LIBRARY_PATH; prints nothing and exits 1 if none is found. The loader's own choice first (prints
# nothing, exits 0, when it already matches), then the Python environment's nvidia/nccl/lib (the lent GPU
# machines: /usr/lib has NCCL 2.28.3, the CPU machine's toolkit 2.28.9), the CUDA toolkit, /usr/lib.
# `epmoe version` decides (exit 0: the loaded library is the compiled-against version).
#
# Usage: export LD_LIBRARY_PATH=$(scripts/nccl-lib-dir.sh build/bin/epmoe)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
set -uo pipefail
bin=${1:?usage: scripts/nccl-lib-dir.sh EPMOE_BIN}
"$bin" version > /dev/null 2>&1 && exit 0
candidates=()
python_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
[[ -n $python_dir ]] && candidates+=("$python_dir")
candidates+=(/usr/local/cuda/lib64 /usr/local/cuda/lib /usr/lib/x86_64-linux-gnu /usr/lib64)
for dir in "${candidates[@]}"; do
  [[ -e $dir/libnccl.so.2 ]] || continue
  if LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$bin" version > /dev/null 2>&1; then
    echo "$dir"
    exit 0
  fi
done
"$bin" version >&2
exit 1
