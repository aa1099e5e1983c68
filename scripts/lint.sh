#!/usr/bin/env bash
# clang-tidy on the C++ files changed since a base commit (default: the merge base with main).
# Needs a configured build (compile_commands.json): cmake --preset dev first.
# Usage: scripts/lint.sh [base]
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:-$(git merge-base HEAD main 2>/dev/null || echo HEAD~1)}
[ -f build/dev/compile_commands.json ] || { echo "lint: run cmake --preset dev first" >&2; exit 1; }
mapfile -t files < <(git diff --name-only "$base" -- '*.cpp' | while read -r f; do [ -f "$f" ] && echo "$f"; done)
[ ${#files[@]} -gt 0 ] || { echo "lint: no changed .cpp files since $base"; exit 0; }
# The gcc precompiled header flags mean nothing to clang: drop them from the compile database.
mkdir -p build/lint
sed -E 's/ -include [^ ]*cmake_pch\.hxx//g; s/ -Winvalid-pch//g' build/dev/compile_commands.json > build/lint/compile_commands.json
clang-tidy -p build/lint --quiet "${files[@]}"
