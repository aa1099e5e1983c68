#!/usr/bin/env bash
# Starts a throwaway SeaweedFS (weed mini, S3 on loopback, signatures checked) and runs
# bench_s3_get (parallel GETs) and bench_s3_prefetch (read-ahead vs decoding) against it.
# Usage: bench/run_s3_bench.sh [build-dir] (default build/dev)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/dev}
cmake --build "$build" --target bench_s3_get bench_s3_prefetch >/dev/null
dir=$(mktemp -d)
base=$((30000 + RANDOM % 10000))
export AWS_ACCESS_KEY_ID=DTUNEBENCH AWS_SECRET_ACCESS_KEY=dtune-bench-secret
printf '{"identities":[{"name":"bench","credentials":[{"accessKey":"%s","secretKey":"%s"}],"actions":["Admin","Read","Write","List"]}]}' \
    "$AWS_ACCESS_KEY_ID" "$AWS_SECRET_ACCESS_KEY" > "$dir/s3.json"
weed mini -dir="$dir" -ip=127.0.0.1 -ip.bind=127.0.0.1 -master.port=$base -volume.port=$((base + 1)) \
    -filer.port=$((base + 2)) -s3.port=$((base + 3)) -webdav.port=$((base + 4)) -admin.port=$((base + 5)) \
    -s3.port.iceberg=0 -s3.port.lance=0 -master.telemetry=false -s3.config="$dir/s3.json" > "$dir/weed.log" 2>&1 &
weed_pid=$!
trap 'kill $weed_pid 2>/dev/null; wait $weed_pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 1 100); do
    (echo > /dev/tcp/127.0.0.1/$((base + 3))) 2>/dev/null && break
    sleep 0.2
done
"$build/bench/bench_s3_get" "http://127.0.0.1:$((base + 3))" dtune-bench "${OBJECTS:-1000}" "${OBJECT_KB:-200}"
"$build/bench/bench_s3_prefetch" "http://127.0.0.1:$((base + 3))" dtune-bench "${IMAGES:-200}" "${EDGE:-512}"
