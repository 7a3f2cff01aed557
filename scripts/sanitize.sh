#!/usr/bin/env bash
# The test suite with the host code under AddressSanitizer and UndefinedBehaviorSanitizer (preset
# "sanitize": build-sanitize/, RelWithDebInfo): out-of-bounds reads and writes, use after free, leaks,
# signed overflow, misaligned or null accesses in the library, the CLI and the tests stop the test
# that hit them. Device code is compute-sanitizer's (scripts/gpu-check.sh).
# Left out: install.* (the installed example is a program of its own, built without the sanitizers,
# which cannot load a sanitized libepmoe.so). Extra arguments go to ctest, e.g. -L cpu or -R Eplb.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
bash scripts/build.sh sanitize
# protect_shadow_gap=0: the CUDA driver maps memory where ASan's shadow gap would be (GPU machines).
export ASAN_OPTIONS=${ASAN_OPTIONS:-protect_shadow_gap=0:detect_leaks=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
ctest --test-dir build-sanitize --output-on-failure -j "$(nproc)" -E '^install\.' "$@"
