#!/usr/bin/env bash
# Full-size SDXL training runs with `dtune train` on the GPU machine: a random-weight pipeline built
# from ../shared/fixtures/sdxl-base-configs, 1024² shape images, LoRA and/or full fine-tune.
#   tools/gpu/train_full_size.sh <build dir> <work dir> <mode> [steps] [extra dtune train options...]
# mode: lora (rank 16, batch 4) or full (batch 1, adamw_bf16). Prints the last metrics line and a
# JSON summary (ms/step and img/s over the second half of the run, time-weighted, and the median of
# the steps' rates; peak memory, final loss).
# NPROC=2 runs it data-parallel through `dtune launch --nproc_per_node 2` (batch is per GPU).
# BENCH_TRAINER=1 also runs the options through bench/bench_trainer (build it) and adds its ms/step.
set -euo pipefail
build=$1 work=$2 mode=$3 steps=${4:-200}
shift $(( $# < 4 ? $# : 4 ))
root=$(cd "$(dirname "$0")/../.." && pwd)
fixtures=${DTUNE_FIXTURES:-$root/shared/fixtures}
mkdir -p "$work"
if [[ ! -f $work/sdxl/model_index.json ]]; then
  "$build/bench/make_random_pipeline" --configs "$fixtures/sdxl-base-configs" \
    --tokenizers "$fixtures/tiny-sdxl" --out "$work/sdxl" --dtype bf16
fi
# BUCKETS=5: eight images in each of five aspect ratios near 1 MP (five aspect buckets) instead of
# 32 square ones.
images=$work/images
if [[ ${BUCKETS:-1} == 5 ]]; then
  images=$work/images5
  if [[ ! -d $images ]]; then
    for wh in 1024x1024 1152x896 896x1152 1216x832 832x1216; do
      python3 "$root/tools/gpu/make_images.py" "$images/$wh" --count 8 --width "${wh%x*}" --height "${wh#*x}"
    done
  fi
fi
[[ -d $images ]] || python3 "$root/tools/gpu/make_images.py" "$images" --count 32
cat > "$work/mdb.json" <<JSON
[
  {"id": "shapes", "type": "local", "instance_data_dir": "$images", "caption_strategy": "textfile",
   "resolution": 1024, "resolution_type": "pixel_area", "cache_dir_vae": "$work/cache/vae-${BUCKETS:-1}"},
  {"id": "text", "type": "local", "dataset_type": "text_embeds", "default": true, "cache_dir": "$work/cache/text"}
]
JSON
nproc=${NPROC:-1} nnodes=${NNODES:-1} node_rank=${NODE_RANK:-0}
out=$work/out-$mode-$nproc-${BUCKETS:-1}
run=("$build/bin/dtune" train)
# A port of its own per run: a run its time cap killed may leave a rank holding the last one's.
(( nproc > 1 )) && run=("$build/bin/dtune" launch --master_port "${MASTER_PORT:-$((29500 + RANDOM % 2000))}"
  --nproc_per_node "$nproc" -- train)
# NNODES=2 NODE_RANK=0|1 MASTER_PORT=p: one of two `dtune launch --node_rank` processes on this
# host (start node 1 in the background first, with its own CUDA_VISIBLE_DEVICES); they share $out.
(( nnodes > 1 )) && run=("$build/bin/dtune" launch --nnodes "$nnodes" --node_rank "$node_rank" --master_addr 127.0.0.1
  --master_port "${MASTER_PORT:-29500}" --nproc_per_node "$nproc" -- train)
(( node_rank == 0 )) && rm -rf "$out"
if [[ $mode == lora ]]; then
  args=(--model_type lora --lora_rank 16 --train_batch_size 4 --optimizer torch-adamw --learning_rate 1e-4)
else
  args=(--model_type full --train_batch_size 1 --optimizer adamw_bf16 --learning_rate 1e-5)
fi
common=(--model_family sdxl --pretrained_model_name_or_path "$work/sdxl" --output_dir "$out" --max_train_steps "$steps"
  --mixed_precision bf16 --gradient_checkpointing false --checkpoint_step_interval "$steps"
  --seed 42 --device cuda --caption_dropout_probability 0.1 --lr_scheduler constant "${args[@]}" "$@")
"${run[@]}" "${common[@]}" --data_backend_config "$work/mdb.json"
(( node_rank == 0 )) || exit 0  # node 0 prints the summary
# BENCH_TRAINER=1 (one process): the same options through bench/bench_trainer (the real Trainer,
# synthetic batches of SDXL's shapes); its ms/step joins the summary as bench_trainer_ms.
bench_json=$out-bench.json
rm -f "$bench_json"
if [[ ${BENCH_TRAINER:-0} == 1 && $nproc == 1 ]]; then
  rm -rf "$out-bench"
  "$build/bench/bench_trainer" "${common[@]}" --output_dir "$out-bench" >"$out-bench.log" 2>&1
  tail -1 "$out-bench.log" | grep '^{' >"$bench_json" || tail -3 "$out-bench.log" >&2
fi
per_gpu=$([[ $mode == lora ]] && echo 4 || echo 1)
extra=("$@")
for i in "${!extra[@]}"; do [[ ${extra[$i]} == --train_batch_size ]] && per_gpu=${extra[$((i + 1))]}; done
batch=$(( per_gpu * nproc * nnodes ))
python3 - "$out/metrics.jsonl" "$mode" "$batch" "$bench_json" <<'PY'
import json, math, os, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
half = rows[len(rows) // 2:]  # past warm-up and caching
ips = statistics.median(r["img_per_s"] for r in half)
# A row's img_per_s is images over the host's time for that step. The time-weighted rate (images over
# the summed step times) is the throughput; the median of per-step rates flatters a run whose host
# times alternate (a 2-GPU run reported 22.9 img/s by median while its steps took 150 ms of GPU time
# for 2 images). Both are printed; tables quote the time-weighted one.
images = int(sys.argv[3])
seconds = sum(images / r["img_per_s"] for r in half)
print(json.dumps({"mode": sys.argv[2], "images_per_step": images, "steps": rows[-1]["step"], "final_loss": rows[-1]["loss"],
                  "all_finite": all(math.isfinite(r["loss"]) for r in rows),
                  "img_per_s": images * len(half) / seconds, "ms_per_step": 1000.0 * seconds / len(half),
                  "img_per_s_median": ips, "ms_per_step_median": 1000.0 * images / ips,
                  "peak_gpu_gib": max(r.get("gpu_memory_gib", 0) for r in rows),
                  **({"bench_trainer_ms": json.load(open(sys.argv[4]))["ms_per_step_median"]}
                     if os.path.exists(sys.argv[4]) else {})}))
PY
