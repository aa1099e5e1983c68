#!/usr/bin/env bash
# On the lent GPU machine: builds the data benchmarks with the release preset (JPEG decoding and
# resizing are CPU work: -O1 dev builds are about 4x slower there) and runs, in one call:
#   1. bench/compare_vae_cache.sh: dtune's VAE caching of JPEGs on disk vs diffusers' encode-only
#      rate (issue #11's target: >= 1.5x), with the arguments given here;
#   2. the GPU test of the cache builder's pinned, asynchronous path (test_data_cache);
#   3. bench/compare_image_prepare.sh: issue #5's header scan and decode+resize+crop vs Pillow
#      (skipped with SKIP_IMAGE_BENCH=1; Pillow missing: its line says so).
# Needs in this checkout: .gpudeps.tar.xz and shared/fixtures (tools/gpu/prepare.sh), and
# DIFFUSERS_SRC pointing at a diffusers src/ folder or the diffusers wheel (unpacked to /tmp here).
# Optional: WHEELS, a folder of wheels for modules diffusers imports (installed only if missing).
# Results: $OUT (default out/vae_bench): dtune_vae.jsonl, diffusers_vae.json, image_bench.jsonl.
# BUILD_ONLY=1 stops after the build (a first call, if building and running do not fit in one).
#   DIFFUSERS_SRC=.whl/diffusers-0.42.1-py3-none-any.whl tools/gpu/bench_vae.sh --count 200 --batch 8
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/vae_bench}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "cpu cores: $(nproc)"
LOGS=${LOGS:-/tmp/dtune_build_logs}
mkdir -p "$LOGS"
if [ -n "${WHEELS:-}" ]; then  # wheels for modules diffusers imports that the machine may lack
    for pair in regex:regex filelock:filelock importlib_metadata:importlib_metadata zipp:zipp; do
        mod=${pair#*:}
        python3 -c "import $mod" 2>/dev/null && continue
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WHEELS"/${pair%%:*}-*.whl
    done
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ -f "${DIFFUSERS_SRC:-}" ]; then  # a wheel: unpack it
    rm -rf /tmp/diffusers_src && mkdir -p /tmp/diffusers_src && python3 -m zipfile -e "$DIFFUSERS_SRC" /tmp/diffusers_src
    export DIFFUSERS_SRC=/tmp/diffusers_src
fi

targets=(bench_vae_cache bench_image_scan bench_image_prepare test_data_cache)
missing=0
for t in bench/bench_vae_cache bench/bench_image_scan bench/bench_image_prepare tests/data/test_data_cache; do
    [ -x "build/release/$t" ] || missing=1
done
if [ "$missing" = 1 ]; then
    [ -d .gpudeps ] || tar xJf .gpudeps.tar.xz
    export CMAKE_PREFIX_PATH=$PWD/.gpudeps/usr
    G=$PWD/.gpudeps/usr/include/x86_64-linux-gnu
    t0=$(date +%s)
    # Tests on: the release preset leaves them out, and test_data_cache's GPU case runs below.
    cmake --preset release -DDTUNE_BUILD_TESTS=ON -DDTUNE_FIXTURES_DIR="$PWD/shared/fixtures" \
        -DCURL_LIBRARY=/usr/lib/x86_64-linux-gnu/libcurl.so.4 -DCURL_INCLUDE_DIR="$G" \
        -DCMAKE_CXX_FLAGS="-isystem $G" >"$LOGS/configure.log" 2>&1 || { tail -40 "$LOGS/configure.log"; exit 1; }
    args=()
    for t in "${targets[@]}"; do args+=(--target "$t"); done
    cmake --build build/release "${args[@]}" -j"$(nproc)" >"$LOGS/build.log" 2>&1 ||
        { grep -B2 -A12 "error" "$LOGS/build.log" | head -80; exit 1; }
    echo "build: $(($(date +%s) - t0)) s"
fi

[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
BENCH_BIN=build/release/bench/bench_vae_cache OUT="$OUT" bench/compare_vae_cache.sh "$@"
echo "== GPU test of the cache builder (pinned rows, asynchronous read-back)"
build/release/tests/data/test_data_cache --gtest_filter='*Device*:*Pipeline*' 2>&1 | tail -4
if [ "${SKIP_IMAGE_BENCH:-0}" != 1 ]; then
    echo "== issue #5: header scan and decode+resize+crop vs Pillow"
    BIN=build/release/bench OUT="$OUT" bench/compare_image_prepare.sh --files "${PREPARE_FILES:-200}"
fi
