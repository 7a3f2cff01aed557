#!/usr/bin/env bash
# End-to-end checks of the epmoe CLI. $1 is the epmoe binary.
set -euo pipefail
epmoe=$1
"$epmoe" --help >/dev/null
echo "1 passed, 0 failed"
