#!/usr/bin/env bash
# The README's test command: installs what is missing, builds the dev preset and runs the suites
# CI runs (every label but perf, slow and heavy; gpu tests skip themselves without CUDA), plus the
# formatting check. `scripts/test.sh -L slow` runs the slow suites (diffusers loading our exports),
# `scripts/test.sh -L heavy` the slowest multi-process runs (resume across world sizes, offload).
# Usage: scripts/test.sh [extra ctest args]      e.g. scripts/test.sh -L unit
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/check_format.sh
jobs=$(nproc)
start=$(date +%s)
cmake --preset dev >/dev/null
cmake --build build/dev -j "$jobs"
built=$(date +%s)
echo "test: build took $((built - start)) s"
# OMP_NUM_THREADS=1 per test (set in tests/CMakeLists.txt): ctest runs $jobs tests at once.
if [ $# -eq 0 ]; then set -- -LE "perf|slow|heavy"; fi
ctest --test-dir build/dev -j "$jobs" --output-on-failure --timeout 900 "$@"
echo "test: tests took $(( $(date +%s) - built )) s"
