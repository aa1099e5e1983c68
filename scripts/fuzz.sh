#!/usr/bin/env bash
# Builds a libFuzzer target with clang (ASan + UBSan) and runs it for a few seconds.
# Usage: scripts/fuzz.sh <target> [seconds]     targets: fuzz/fuzz_<target>.cpp
# Crashing inputs are written to build/fuzz/<target>/crash-* and make the script fail.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:?usage: scripts/fuzz.sh <target> [seconds]}
seconds=${2:-20}
CXX=${FUZZ_CXX:-clang++}
command -v "$CXX" >/dev/null || { echo "fuzz: $CXX not found; run scripts/setup.sh" >&2; exit 1; }

# Torch-free sources each target needs (the fuzzers never link libtorch).
declare -A sources=(
    [safetensors_header]="src/io/safetensors_header.cpp"
    [parquet]="src/io/table.cpp src/io/thrift_compact.cpp src/io/parquet_meta.cpp src/io/parquet_codec.cpp
               src/io/parquet_decode.cpp src/io/parquet_column.cpp src/io/parquet.cpp"
)
declare -A libs=(
    [safetensors_header]=""
    [parquet]="-lz -lzstd -lsnappy"
)
# Seed corpora besides fuzz/corpus/<target>.
declare -A extra_seeds=(
    [parquet]="../shared/fixtures/parquet"
)
[ -n "${sources[$target]+x}" ] || { echo "fuzz: unknown target '$target' (known: ${!sources[*]})" >&2; exit 2; }

out=build/fuzz/$target
mkdir -p "$out/corpus"
bin=$out/fuzz_$target
# Rebuild only when a source is newer than the binary.
if [ ! -x "$bin" ] || [ -n "$(find fuzz/fuzz_$target.cpp ${sources[$target]} src -newer "$bin" -name '*.[ch]*' 2>/dev/null | head -1)" ]; then
    echo "fuzz: building $bin"
    "$CXX" -std=c++20 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
        -Isrc "fuzz/fuzz_$target.cpp" ${sources[$target]} ${libs[$target]} -o "$bin"
fi
seed_dirs=()
for d in fuzz/corpus/$target ${extra_seeds[$target]:-}; do
    [ -d "$d" ] && seed_dirs+=("$d")
done
echo "fuzz: running $target for ${seconds}s"
"$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=1048576 \
    -artifact_prefix="$out/" "$out/corpus" "${seed_dirs[@]}" 2>"$out/log" || {
    tail -40 "$out/log" >&2
    echo "fuzz: $target FAILED; crashing input in $out/" >&2
    exit 1
}
grep -E '^#[0-9]+.*(DONE|pulse)' "$out/log" | tail -1
echo "fuzz: $target ok"
