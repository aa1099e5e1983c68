#!/usr/bin/env bash
# Issue #21's full-size check of `dtune sample` on FLUX.1 [dev] against diffusers' FluxPipeline, in one
# device call: a random-weight FLUX.1-dev-shaped folder (tools/ref/make_random_flux_pipeline.py, bf16,
# ~34 GB on disk), then
#   fp32   diffusers (tools/ref/flux_pipeline_diffusers.py compare, TF32 off) and `dtune sample --dtype
#          fp32` at RES² (1024), STEPS (28), guidance 3.5, SEED, the same prompt; the two PNGs compared
#          (mean / max absolute difference in 0-255 units; MAX_MEAN, default 1, is the bar)
#   bf16   `dtune sample` (wall time of the whole process, its generate time, peak GPU memory from an
#          nvidia-smi poll) and diffusers from_pretrained(bf16).to(cuda) + pipe(...) in one process
#          (import, load, first call, a warm second call, torch's and nvidia-smi's peak memory)
# Order: the fp32 agreement first. dtune builds (release) in the background while the folder is written
# and diffusers' fp32 run goes (neither is timed); both timed bf16 runs come after the build, one at a
# time. Each phase has its own `timeout` and appends its JSON line as soon as it ends.
# Needs, in the checkout: .gpudeps.tar.xz and shared/fixtures (tools/gpu/prepare.sh), the diffusers
# wheel in .whl/ (pip download diffusers==0.42.1 --no-deps -d .whl). Carry [".gpudeps.tar.xz", "shared",
# ".whl"]. Results in $OUT: flux_parity.json (every phase), flux_parity_logs.tar.gz (logs, nvidia-smi
# traces, dtune's sidecars), flux_parity_images.tar (the PNGs, while under 15 MiB).
#   OUT=$OUT tools/gpu/flux_parity.sh
# env: PHASES (fp32,bf16), RES, STEPS, SEED, PROMPT, MAX_MEAN, WORK (/tmp/flux_parity), DEVICE (cuda);
# TINY=1 with DTUNE_BIN=<built dtune> and DEVICE=cpu tests the flow on a CPU with toy models (64², 2 steps
# unless RES/STEPS say otherwise); DTUNE_BIN also skips the build on a GPU machine where dtune is built.
# Exit code: 0 (the fp32 images agree, or fp32 was not run), 1 (the folder or the build failed),
# 2 (the fp32 images differ by more than MAX_MEAN on average, or one of the two fp32 runs failed).
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
out=${OUT:-gpu-logs}; mkdir -p "$out"; out=$(cd "$out" && pwd)
W=${WORK:-/tmp/flux_parity}; logs=$W/logs
rm -rf "$W"; mkdir -p "$logs"
TINY=${TINY:-0} DEVICE=${DEVICE:-cuda} PHASES=${PHASES:-fp32,bf16}
if [[ $TINY == 1 ]]; then RES=${RES:-64} STEPS=${STEPS:-2}; else RES=${RES:-1024} STEPS=${STEPS:-28}; fi
SEED=${SEED:-42} GUIDANCE=3.5 MAX_MEAN=${MAX_MEAN:-1}
PROMPT=${PROMPT:-a red fox in the snow, golden hour, highly detailed photograph}
# Time caps per phase (seconds) at full size, each cut to what is left of BUDGET (the whole script's
# seconds: it ends, results written, before the device call's 600 s; a phase with under 20 s left is
# skipped and says so).
T_MAKE=${T_MAKE:-240} T_DIFF32=${T_DIFF32:-330} T_DTUNE32=${T_DTUNE32:-240} T_DTUNE16=${T_DTUNE16:-120}
T_DIFF16=${T_DIFF16:-180} T_BUILD=${T_BUILD:-420} BUDGET=${BUDGET:-570}
results=$logs/results.jsonl
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
start=$SECONDS
note() { echo "== $(( SECONDS - start )) s: $*"; }
record() { echo "$1" >>"$results"; echo "$1"; }  # one JSON object per line
last_json() { local j; j=$(grep '^{' "$1" 2>/dev/null | tail -1); echo "${j:-null}"; }

cap() {  # prints the phase's time cap: the wanted one or what is left of BUDGET (10 s kept for the end)
    local want=$1 left=$(( BUDGET - (SECONDS - start) - 10 ))
    echo $(( want < left ? want : left ))
}
skip() {  # phase name, its cap: true (and recorded) when too little time is left
    (( $2 >= 20 )) && return 1
    record "{\"phase\": \"$1\", \"skipped\": \"time budget: $2 s left of BUDGET=$BUDGET\"}"
}

snapshot() {  # results JSON and the tarballs as they stand: after each phase, so a cut-off run leaves them
    python3 - "$results" "$out/flux_parity.json" "$(( SECONDS - start ))" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()] if __import__("os").path.exists(sys.argv[1]) else []
summary = {"total_s": int(sys.argv[3]), "phases": rows}
for r in rows:
    if r.get("diff") == "fp32":
        summary["fp32_mean_abs_diff"] = r.get("mean_abs_diff")
        summary["fp32_max_abs_diff"] = r.get("max_abs_diff")
        summary["fp32_pass"] = r.get("pass")
json.dump(summary, open(sys.argv[2], "w"), indent=1)
PY
    cp "$out/flux_parity.json" "$logs/" 2>/dev/null
    for f in "$W"/dtune_*/sample_*.json; do  # dtune's sidecars, named by phase
        [[ -f $f ]] && cp "$f" "$logs/$(basename "$(dirname "$f")").sidecar.json"
    done
    tar czf "$out/flux_parity_logs.tar.gz" -C "$W" logs
    (cd "$W" && ls -d diffusers_*/*.png dtune_*/*.png 2>/dev/null | tar cf "$out/flux_parity_images.tar" -T -)
    if (( $(stat -c %s "$out/flux_parity_images.tar") > 15 * 1024 * 1024 )); then  # keep the fp32 pair
        (cd "$W" && ls -d diffusers_fp32/diffusers_fp32.png dtune_fp32/*.png 2>/dev/null |
            tar cf "$out/flux_parity_images.tar" -T -)
    fi
}
finish() {
    snapshot
    python3 -c 'import json, sys; s = json.load(open(sys.argv[1])); s.pop("phases"); print(json.dumps(s))' \
        "$out/flux_parity.json"
    ls -la "$out"
}
trap finish EXIT

# nvidia-smi's used memory every 200 ms into a file while a phase runs (the card is ours alone: its
# used memory is the phase's process, CUDA context and caching allocator included).
smi_pid=
smi_start() {
    smi_pid=
    command -v nvidia-smi >/dev/null || return 0
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$1" 2>/dev/null &
    smi_pid=$!
}
smi_stop() { [[ -n $smi_pid ]] && { kill "$smi_pid" 2>/dev/null; wait "$smi_pid" 2>/dev/null; }; }
smi_peak() { sort -n "$1" 2>/dev/null | tail -1; }

command -v nvidia-smi >/dev/null &&
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$logs/gpu.txt"
smi_base=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1)
note "res ${RES}², $STEPS steps, seed $SEED, device $DEVICE, tiny $TINY, phases $PHASES"

# diffusers from the carried wheel, into a folder of its own (the machine has no registry).
whl=$(ls .whl/diffusers-*.whl 2>/dev/null | head -1)
if [[ -n $whl ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_diffusers "$whl" \
        >"$logs/pip.log" 2>&1 || { cat "$logs/pip.log"; exit 1; }
    export PYTHONPATH=/tmp/site_diffusers${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c 'import diffusers, transformers, torch; print("diffusers", diffusers.__version__, "transformers",
    transformers.__version__, "torch", torch.__version__)' | tee "$logs/versions.txt" || exit 1

# dtune, release build, in the background (CPU only) while the GPU makes the folder and runs diffusers.
build_pid=
if [[ -n ${DTUNE_BIN:-} ]]; then
    DTUNE=$DTUNE_BIN
else
    DTUNE=$root/build/release/bin/dtune
    (t0=$SECONDS
     OUT=$logs PRESET=release timeout -k 10 "$(cap "$T_BUILD")" tools/gpu/build.sh dtune >"$logs/build_errors.txt" 2>&1
     rc=$?; echo "{\"phase\": \"build\", \"rc\": $rc, \"seconds\": $(( SECONDS - t0 ))}" >"$logs/build.json") &
    build_pid=$!
fi

make_args=(--device "$DEVICE" --seed "$SEED")
[[ $TINY == 1 ]] && make_args+=(--tiny)
timeout -k 10 "$(cap "$T_MAKE")" python3 tools/ref/make_random_flux_pipeline.py "$W/flux" "${make_args[@]}" \
    >"$logs/make.log" 2>&1
rc=$?
record "{\"phase\": \"make\", \"rc\": $rc, \"result\": $(last_json "$logs/make.log")}"
(( rc == 0 )) || { tail -20 "$logs/make.log"; exit 1; }
du -sh "$W/flux" | tee -a "$logs/make.log"
df -h "$W" >>"$logs/make.log"
note "folder made"; snapshot

sample_args=(--prompt "$PROMPT" --seed "$SEED" --width "$RES" --height "$RES" --steps "$STEPS" --guidance "$GUIDANCE"
             --device "$DEVICE")
diffusers_run() {  # phase name, time cap, then flux_pipeline_diffusers.py arguments
    local name=$1 limit=$2; shift 2
    smi_start "$logs/$name.smi"
    timeout -k 10 "$limit" python3 tools/ref/flux_pipeline_diffusers.py "$@" "$W/flux" --out-dir "$W/$name" \
        --json "$logs/$name.json" "${sample_args[@]}" >"$logs/$name.log" 2>&1
    local rc=$?
    smi_stop
    local peak
    peak=$(smi_peak "$logs/$name.smi")
    record "$(printf '{"phase": "%s", "rc": %s, "smi_peak_mib": %s, "smi_base_mib": %s, "result": %s}' "$name" "$rc" \
        "${peak:-null}" "${smi_base:-null}" "$(last_json "$logs/$name.json")")"
    (( rc == 0 )) || grep -E "Error|error|Traceback" "$logs/$name.log" | tail -5
}
dtune_run() {  # phase name, time cap, dtype
    local name=$1 limit=$2 dtype=$3
    smi_start "$logs/$name.smi"
    local t0 t1 rc
    t0=$(date +%s.%N)
    timeout -k 10 "$limit" "$DTUNE" sample --model "$W/flux" "${sample_args[@]}" --dtype "$dtype" \
        --output_dir "$W/$name" >"$logs/$name.log" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    smi_stop
    record "$(python3 - "$name" "$rc" "$t0" "$t1" "$W/$name/sample_${SEED}_0.json" "$logs/$name.log" \
        "$(smi_peak "$logs/$name.smi")" "${smi_base:-}" <<'PY'
import json, os, re, sys
name, rc, t0, t1, sidecar, log, peak, base = sys.argv[1:]
r = {"phase": name, "rc": int(rc), "wall_s": round(float(t1) - float(t0), 2)}
text = open(log, errors="replace").read()
m = re.search(r"loaded Flux pipeline .* in ([0-9.e+-]+) s", text)
r["load_s"] = round(float(m.group(1)), 2) if m else None
if os.path.exists(sidecar):
    s = json.load(open(sidecar))
    r.update(generate_s=round(s.get("seconds_per_batch", float("nan")), 2), dtype=s.get("dtype"),
             device=s.get("device"), png=sidecar[:-5] + ".png")
r["smi_peak_mib"] = int(float(peak)) if peak else None
r["smi_base_mib"] = int(float(base)) if base else None
print(json.dumps(r))
PY
)"
    (( rc == 0 )) || tail -5 "$logs/$name.log"
}
wait_build() {
    [[ -n $build_pid ]] || return 0
    wait "$build_pid"
    build_pid=
    record "$(cat "$logs/build.json" 2>/dev/null || echo '{"phase": "build", "rc": -1}')"
    [[ -x $DTUNE ]] || { cat "$logs/build_errors.txt"; return 1; }
    note "dtune built"
}
diff_images() {  # tag, a, b, then options (--max-mean X: pass/fail bar)
    python3 tools/ref/flux_pipeline_diffusers.py diff "$2" "$3" --tag "$1" "${@:4}" --json "$results" 2>&1 | tail -1
}

if [[ ,$PHASES, == *,fp32,* ]]; then
    c=$(cap "$T_DIFF32"); skip diffusers_fp32 "$c" || diffusers_run diffusers_fp32 "$c" compare
    note "diffusers fp32 done"; snapshot
    wait_build || exit 1
    c=$(cap "$T_DTUNE32"); skip dtune_fp32 "$c" || dtune_run dtune_fp32 "$c" fp32
    note "dtune fp32 done"
    d=$W/dtune_fp32/sample_${SEED}_0.png
    if [[ -f $d && -f $W/diffusers_fp32/diffusers_fp32.png ]]; then
        diff_images fp32 "$W/diffusers_fp32/diffusers_fp32.png" "$d" --max-mean "$MAX_MEAN"
        diff_images fp32_vs_cudnn_tf32_decode "$W/diffusers_fp32/diffusers_fp32_cudnn_tf32.png" "$d"
        diff_images diffusers_cudnn_tf32_effect "$W/diffusers_fp32/diffusers_fp32.png" \
            "$W/diffusers_fp32/diffusers_fp32_cudnn_tf32.png"
    fi
    snapshot
fi
if [[ ,$PHASES, == *,bf16,* ]]; then
    wait_build || exit 1
    c=$(cap "$T_DTUNE16"); skip dtune_bf16 "$c" || dtune_run dtune_bf16 "$c" bf16
    note "dtune bf16 done"; snapshot
    c=$(cap "$T_DIFF16"); skip diffusers_bf16 "$c" || diffusers_run diffusers_bf16 "$c" timing --dtype bf16
    note "diffusers bf16 done"
    [[ -f $W/dtune_bf16/sample_${SEED}_0.png && -f $W/diffusers_bf16/diffusers_bf16.png ]] &&
        diff_images bf16 "$W/diffusers_bf16/diffusers_bf16.png" "$W/dtune_bf16/sample_${SEED}_0.png"
fi
note "done"
if [[ ,$PHASES, == *,fp32,* ]] && ! grep -q '"diff": "fp32",.*"pass": true' "$results"; then
    exit 2
fi
