#!/usr/bin/env bash
# The README's first command: installs what is missing, builds dtune (release preset) and runs
# the main job on its built-in default. Until the trainer lands that is `dtune --version` plus
# `dtune selfcheck`; it becomes `dtune demo` (a small training run on CPU) later.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --preset release >/dev/null
cmake --build build/release -j "$(nproc)" --target dtune
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
build/release/bin/dtune --version
build/release/bin/dtune selfcheck
