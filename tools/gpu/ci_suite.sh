#!/usr/bin/env bash
# CI's test command on the lent GPU machine's 16 cores, for quick feedback after a large merge: builds
# everything (dev preset) and runs every suite CI runs (all labels but perf and slow), with CUDA
# present. Tests that need tools the GPU image lacks (SeaweedFS, moto, chromium) fail there; read
# the failures against that list. Logs: $OUT/ctest_all.log; the summary prints.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-logs}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
tools/gpu/build.sh || exit 1
echo "== build done at $SECONDS s"
ctest --test-dir build/dev -j12 -LE "perf|slow" --output-on-failure --timeout 600 >"$out/ctest_all.log" 2>&1
echo "== ctest -LE perf|slow at $SECONDS s: $(grep -E 'tests passed|tests failed' "$out/ctest_all.log")"
sed -n '/The following tests FAILED/,$p' "$out/ctest_all.log"
