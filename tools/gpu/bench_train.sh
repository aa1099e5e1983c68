#!/usr/bin/env bash
# On the lent GPU machine: builds bench_train_step (release preset, CUDA libtorch) and runs
# bench/compare_diffusers.sh with the arguments given. Needs, in this checkout: .gpudeps.tar.xz and
# shared/fixtures (tools/gpu/prepare.sh), and DIFFUSERS_SRC pointing at a diffusers src/ folder or
# at the diffusers wheel (unpacked to /tmp here). Optional: WHEELS, a folder of wheels for Python
# packages the machine lacks (each installed only if its module does not import). Results go to $OUT.
#   tools/gpu/bench_train.sh --modes lora1,lora4 --steps 10 [--compile] [--profile $OUT/prof]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/bench}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
LOGS=${LOGS:-/tmp/dtune_build_logs}  # build logs stay on the machine; errors are printed
mkdir -p "$LOGS"

if [ -n "${WHEELS:-}" ]; then
    for pair in requests:requests urllib3:urllib3 idna:idna certifi:certifi charset_normalizer:charset_normalizer \
        regex:regex filelock:filelock importlib_metadata:importlib_metadata zipp:zipp; do
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

if [ ! -x build/release/bench/bench_train_step ]; then
    tar xJf .gpudeps.tar.xz && export CMAKE_PREFIX_PATH=$PWD/.gpudeps/usr
    t0=$(date +%s)
    cmake --preset release -DDTUNE_FIXTURES_DIR="$PWD/shared/fixtures" \
        -DCURL_LIBRARY=/usr/lib/x86_64-linux-gnu/libcurl.so.4 \
        -DCURL_INCLUDE_DIR="$PWD/.gpudeps/usr/include/x86_64-linux-gnu" \
        -DCMAKE_CXX_FLAGS="-isystem $PWD/.gpudeps/usr/include/x86_64-linux-gnu" >"$LOGS/configure.log" 2>&1 ||
        { tail -40 "$LOGS/configure.log"; }
    cmake --build build/release --target bench_train_step -j16 >"$LOGS/build.log" 2>&1 ||
        { grep -B2 -A12 "error" "$LOGS/build.log" | head -80; }
    echo "build: $(($(date +%s) - t0)) s"
fi
BENCH_BIN=build/release/bench/bench_train_step OUT="$OUT" bench/compare_diffusers.sh "$@"
