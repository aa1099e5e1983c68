#!/usr/bin/env bash
# The README's first command: installs what is missing, builds dtune (release preset) and runs
# the main job on its built-in default: `dtune demo`, a small training run on the CPU (synthetic
# shapes, a built-in tiny SDXL-shaped model) that ends by printing where its report.html is.
# Extra arguments go to dtune demo (e.g. --steps 60 --output_dir /tmp/demo).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset release >/dev/null
cmake --build build/release -j "$(nproc)" --target dtune
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
build/release/bin/dtune --version
out=dtune-demo
for a in "$@"; do [ "${prev:-}" = "--output_dir" ] && out=$a; prev=$a; done
if [ -d "$out/run" ]; then
    echo "demo: $out/run exists from an earlier demo; moving it to $out.old.$$"
    mv "$out" "$out.old.$$"
fi
build/release/bin/dtune demo "$@"
