#!/usr/bin/env bash
# Configures and builds the dev preset on the GPU machine from the packed Debian dependencies
# (.gpudeps.tar.xz, made by tools/gpu/prepare.sh on the dev machine). Arguments: targets to build
# (default: everything). Logs go to $out/cfg.log and $out/build.log; on failure the errors print.
# PRESET=release builds build/release instead (-O3, no tests); CMAKE_ARGS adds configure options
# (e.g. -DDTUNE_BUILD_TESTS=ON to build test binaries there too).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-logs}; mkdir -p "$out"
[[ -d .gpudeps ]] || tar xJf .gpudeps.tar.xz
export CMAKE_PREFIX_PATH=$PWD/.gpudeps/usr; G=$PWD/.gpudeps/usr/include/x86_64-linux-gnu
preset=${PRESET:-dev}
cmake --preset "$preset" -DDTUNE_FIXTURES_DIR=$PWD/shared/fixtures -DCURL_LIBRARY=/usr/lib/x86_64-linux-gnu/libcurl.so.4 \
  -DCURL_INCLUDE_DIR=$G -DCMAKE_CXX_FLAGS="-isystem $G" ${CMAKE_ARGS:-} >"$out/cfg.log" 2>&1 || { tail -30 "$out/cfg.log"; exit 1; }
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "build/$preset" -j"$(nproc)" "${targets[@]}" >"$out/build.log" 2>&1 ||
  { grep -B2 -A12 'error' "$out/build.log" | head -80; exit 1; }
