#!/usr/bin/env bash
# Issue #18 item 6 in one device call: a full-size SDXL folder with random bf16 weights
# (bench/make_random_pipeline from shared/fixtures/sdxl-base-configs), then, each RUNS times in
# turn, `dtune sample` (wall time of the whole process, and the load time it logs: "loaded ... in
# X s") and diffusers' StableDiffusionXLPipeline (tools/ref/sdxl_pipeline_timing.py: import, load,
# first call, warm call). STEPS (8) Euler steps at RES² (1024), bf16, guidance 5, the same prompt.
# The first pass also warms the page cache for both (the folder was just written, so it is there).
# One JSON line per run in $OUT/sdxl_sample.jsonl; logs in $OUT/sdxl_sample_logs.tar.gz.
#   OUT=$OUT tools/gpu/sdxl_sample.sh      env: STEPS, RES, RUNS (2), DTUNE_BIN (skips the build)
# Carry [".gpudeps.tar.xz", "shared", ".whl"] (diffusers' wheel in .whl/).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/sample}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
W=/tmp/sdxl_sample STEPS=${STEPS:-8} RES=${RES:-1024} RUNS=${RUNS:-2}
mkdir -p "$W/logs"
export PYTHONUNBUFFERED=1
if [[ -z ${DTUNE_BIN:-} ]]; then
    PRESET=release OUT=$W/logs tools/gpu/build.sh dtune make_random_pipeline >/dev/null || exit 1
    DTUNE_BIN=build/release/bin/dtune MAKER=build/release/bench/make_random_pipeline
fi
MAKER=${MAKER:-$(dirname "$DTUNE_BIN")/../bench/make_random_pipeline}
whl=$(ls .whl/diffusers-*.whl 2>/dev/null | head -1)
[[ -n $whl ]] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_diffusers "$whl" \
    >/dev/null 2>&1 && export PYTHONPATH=/tmp/site_diffusers${PYTHONPATH:+:$PYTHONPATH}
[[ -f $W/sdxl/model_index.json ]] || "$MAKER" --configs shared/fixtures/sdxl-base-configs \
    --tokenizers shared/fixtures/tiny-sdxl --out "$W/sdxl" --dtype bf16 >"$W/logs/make.log" 2>&1 ||
    { tail -5 "$W/logs/make.log"; exit 1; }
prompt="a red fox in the snow, golden hour, highly detailed photograph"
for i in $(seq 1 "$RUNS"); do
    t0=$(date +%s.%N)
    "$DTUNE_BIN" sample --model "$W/sdxl" --prompt "$prompt" --steps "$STEPS" --width "$RES" --height "$RES" ${DEVICE:+--device $DEVICE} \
        --seed 42 --dtype bf16 --output_dir "$W/dtune_$i" >"$W/logs/dtune_$i.log" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    python3 - "$W/logs/dtune_$i.log" "$rc" "$t0" "$t1" "$i" <<'PY' | tee -a "$OUT/sdxl_sample.jsonl"
import json, re, sys
log, rc, t0, t1, i = open(sys.argv[1]).read(), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
loads = {m.group(1): float(m.group(2)) for m in re.finditer(r"loaded (.+?) on \S+ in ([0-9.]+) s", log)}
print(json.dumps({"run": f"dtune sample #{i}", "exit": rc, "total_s": round(t1 - t0, 3), "loads_s": loads}))
PY
    timeout -k 10 300 python3 tools/ref/sdxl_pipeline_timing.py "$W/sdxl" --out-dir "$W/diffusers_$i" \
        --steps "$STEPS" --res "$RES" ${DEVICE:+--device $DEVICE} --json "$OUT/sdxl_sample.jsonl" >"$W/logs/diffusers_$i.log" 2>&1 ||
        tail -3 "$W/logs/diffusers_$i.log"
    tail -1 "$W/logs/diffusers_$i.log"
done
tar czf "$OUT/sdxl_sample_logs.tar.gz" -C "$W" logs
