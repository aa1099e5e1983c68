#!/usr/bin/env bash
# SimpleTuner's Flux keys at full size on the GPU (issue #23), in one device call: the random
# FLUX.1-dev-shaped folder of tools/ref/make_random_flux_pipeline.py (bf16) and 8 shape images at
# 1024², LoRA r16 batch 1 bf16 with gradient checkpointing, STEPS steps per run:
#   base     the defaults (flash attention by name, flux_lora_target all)
#   masked   flux_attention_masked_training (a boolean key mask: SDPA picks its kernel)
#   context  flux_lora_target context (the image stream's q/k/v carry no adapter)
#   fused    the same with fuse_qkv_projections (those q/k/v as one matmul)
#   keys     random-range guidance, Beta sigmas, auto shift (the draws' cost)
# Each row: exit code, median ms/step over the second half, peak GPU memory, final loss, all finite.
# Needs .gpudeps.tar.xz and shared/ (tools/gpu/prepare.sh) and the diffusers wheel in .whl/.
# Carry [".gpudeps.tar.xz", "shared", ".whl"].
#   OUT=$OUT tools/gpu/flux_keys.sh         env: STEPS (12), RUNS ("base masked context fused keys"), FLUX
# Results: $OUT/flux_keys.json and $OUT/flux_keys_logs.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-logs}; mkdir -p "$out"; out=$(cd "$out" && pwd)
W=${WORK:-/tmp/flux_keys}; logs=$W/logs; rm -rf "$W"; mkdir -p "$logs"
STEPS=${STEPS:-12} RUNS=${RUNS:-"base masked context fused keys"}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$logs/gpu.txt"
whl=$(ls .whl/diffusers-*.whl 2>/dev/null | head -1)  # only the folder maker imports diffusers
[[ -n $whl ]] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_diffusers "$whl" \
    >"$logs/pip.log" 2>&1 && export PYTHONPATH=/tmp/site_diffusers${PYTHONPATH:+:$PYTHONPATH}
(PRESET=release OUT=$logs timeout -k 10 360 tools/gpu/build.sh dtune >"$logs/build.txt" 2>&1; echo $? >"$logs/build.rc") &
build_pid=$!
flux=${FLUX:-$W/flux}  # FLUX: an existing folder of make_random_flux_pipeline.py (34 GB) to reuse
[[ -f $flux/model_index.json ]] || timeout -k 10 240 python3 tools/ref/make_random_flux_pipeline.py "$flux" \
    --device cuda --seed 1 --no-check >"$logs/make.log" 2>&1 || { tail -20 "$logs/make.log"; exit 1; }
python3 tools/gpu/make_images.py "$W/images" --count 8 >/dev/null
wait $build_pid
[[ $(cat "$logs/build.rc") == 0 ]] || { tail -30 "$logs/build.txt"; exit 1; }
cat >"$W/mdb.json" <<JSON
[
  {"id": "shapes", "type": "local", "instance_data_dir": "$W/images", "caption_strategy": "textfile",
   "resolution": 1024, "resolution_type": "pixel_area", "cache_dir_vae": "$W/cache/vae"},
  {"id": "text", "type": "local", "dataset_type": "text_embeds", "default": true, "cache_dir": "$W/cache/text"}
]
JSON
echo "== ready at $SECONDS s"
: >"$out/flux_keys.json"
for run in $RUNS; do
    case $run in
        base) keys="" ;;
        masked) keys="--flux_attention_masked_training true" ;;
        context) keys="--flux_lora_target context" ;;
        fused) keys="--flux_lora_target context --fuse_qkv_projections true" ;;
        keys) keys="--flux_guidance_mode random-range --flow_use_beta_schedule true --flow_schedule_auto_shift true" ;;
    esac
    o=$W/out-$run
    timeout -k 10 240 build/release/bin/dtune train --model_family flux --pretrained_model_name_or_path "$flux" \
        --data_backend_config "$W/mdb.json" --output_dir "$o" --max_train_steps "$STEPS" --model_type lora \
        --lora_rank 16 --train_batch_size 1 --optimizer adamw_bf16 --learning_rate 1e-4 --mixed_precision bf16 \
        --gradient_checkpointing true --checkpoint_step_interval 1000 --seed 42 --device cuda $keys \
        >"$logs/$run.log" 2>&1
    rc=$?
    python3 - "$o/metrics.jsonl" "$run" "$rc" <<'PY' | tee -a "$out/flux_keys.json"
import json, math, statistics, sys
path, run, rc = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    rows = [json.loads(line) for line in open(path) if '"loss"' in line]
except OSError:
    rows = []
half = rows[len(rows) // 2:]
out = {"run": run, "rc": rc, "steps": rows[-1]["step"] if rows else 0}
if half:
    out["ms_per_step_median"] = round(1000.0 / statistics.median(r["img_per_s"] for r in half), 1)
    out["peak_gpu_gib"] = max((r.get("gpu_memory_gib", 0) for r in rows), default=None)
    out["final_loss"] = rows[-1]["loss"]
    out["all_finite"] = all(math.isfinite(r["loss"]) for r in rows)
print(json.dumps(out))
PY
    grep -h 'Flux training:\|error\|LoRA:' "$logs/$run.log" | head -4
done
echo "== done at $SECONDS s"
tar czf "$out/flux_keys_logs.tar.gz" -C "$W" logs
