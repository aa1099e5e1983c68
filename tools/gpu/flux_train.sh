#!/usr/bin/env bash
# A first measurement of Flux.1 [dev] training with `dtune train` at full size (issue #23's
# starting point), in one device call: the random FLUX.1-dev-shaped folder of
# tools/ref/make_random_flux_pipeline.py (bf16), 8 shape images at 1024² with captions, then LoRA
# r16 batch 1 in bf16 with SimpleTuner's defaults otherwise (the T5 + CLIP text cache and the
# 16-channel latent cache are built by the first run), with and without gradient_checkpointing:
# median ms/step over the second half and peak GPU memory from metrics.jsonl.
# Needs, in the checkout: .gpudeps.tar.xz and shared/fixtures (tools/gpu/prepare.sh) and the diffusers
# wheel in .whl/ (only the folder maker imports diffusers). Carry [".gpudeps.tar.xz", "shared", ".whl"].
#   OUT=$OUT tools/gpu/flux_train.sh        env: STEPS (20), RUNS ("gc nogc"; also masked, context, fused,
#   keys, graph, graphnogc, int8, fp8, fp8nogc: see the loop), RUN_LIMIT (240 s a run), FLUX (an existing make_random_flux_pipeline.py folder to reuse), BASELINE (1: the diffusers
#   step after dtune's, same card), BASELINE_MODES (lora1,lora1gc), COMPILE (0; 1: also under torch.compile; COMPILE_MODES, default BASELINE_MODES, picks its modes),
#   BENCH (1: each run's options again through bench/bench_trainer, synthetic batches), PROFILE (A:B: a Kineto trace of steps A..B of each run, summarised into the logs),
#   GPU_TESTS ("dir/binary[:filter] ...": test binaries built with the same release build and run before the runs),
#   MICRO ("bench_lora_dropout ...": bench/ binaries built the same way and run after the tests, JSON lines printed).
#   A run name may carry environment settings after '+': "nogc+DTUNE_FUSED_QK_NORM_ROPE=0" is the nogc run with that variable set
#   ("nogc+DTUNE_PROFILE_STEPS=2:2" traces that run's second step, an eager one, instead of PROFILE's).
# Results: $OUT/flux_train.json (one row per run) and $OUT/flux_train_logs.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
out=${OUT:-gpu-logs}; mkdir -p "$out"; out=$(cd "$out" && pwd)
W=${WORK:-/tmp/flux_train}; logs=$W/logs; rm -rf "$W"; mkdir -p "$logs"
STEPS=${STEPS:-20} RUNS=${RUNS:-"gc nogc"}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$logs/gpu.txt"
whl=$(ls .whl/diffusers-*.whl 2>/dev/null | head -1)
[[ -n $whl ]] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_diffusers "$whl" \
    >"$logs/pip.log" 2>&1 && export PYTHONPATH=/tmp/site_diffusers${PYTHONPATH:+:$PYTHONPATH}
targets=(dtune bench_trainer ${MICRO:-})
for t in ${GPU_TESTS:-}; do b=${t%%:*}; targets+=("${b##*/}"); done
tests_on=$([[ -n ${GPU_TESTS:-} ]] && echo -DDTUNE_BUILD_TESTS=ON)
(CMAKE_ARGS=$tests_on PRESET=release OUT=$logs timeout -k 10 420 tools/gpu/build.sh "${targets[@]}" >"$logs/build.txt" 2>&1; echo $? >"$logs/build.rc") &
build_pid=$!
flux=${FLUX:-$W/flux}
[[ -f $flux/model_index.json ]] || timeout -k 10 240 python3 tools/ref/make_random_flux_pipeline.py "$flux" --device cuda --seed 1 >"$logs/make.log" 2>&1 ||
    { tail -20 "$logs/make.log"; exit 1; }
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
for t in ${GPU_TESTS:-}; do
    b=${t%%:*} filter=${t#*:}
    [[ $filter == "$t" ]] && filter='*'
    DTUNE_FIXTURES=$root/shared/fixtures timeout -k 10 300 "build/release/tests/$b" --gtest_filter="$filter" \
        >"$logs/gpu_test_${b##*/}.log" 2>&1
    echo "gpu test $b ($filter): exit $? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$logs/gpu_test_${b##*/}.log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]|Failure|Expected|Which is|actual' "$logs/gpu_test_${b##*/}.log" | head -30
done
for b in ${MICRO:-}; do  # microbenchmarks (bench/), before the runs: their JSON lines into the logs
    timeout -k 10 120 "build/release/bench/$b" >"$logs/micro_$b.log" 2>&1
    echo "micro $b: exit $?"; grep '^{' "$logs/micro_$b.log"
done
: >"$out/flux_train.json"
for spec in $RUNS; do
    run=${spec%%+*} vars=()
    [[ $spec == *+* ]] && IFS=+ read -r -a vars <<<"${spec#*+}"
    # gc / nogc: SimpleTuner's defaults with and without checkpointing; the others checkpoint and
    # add SimpleTuner's Flux keys: masked (flux_attention_masked_training), context
    # (flux_lora_target context), fused (the same with fuse_qkv_projections), keys (random-range
    # guidance, Beta sigmas, auto shift: the draws' cost); graph / graphnogc: cuda_graph true;
    # int8 / fp8 / fp8nogc: a quantised frozen base (int8-quanto / fp8-torchao), quantised in host memory.
    gc=$([[ $run == nogc || $run == graphnogc || $run == fp8nogc ]] && echo false || echo true)
    case $run in
        masked) keys="--flux_attention_masked_training true" ;;
        context) keys="--flux_lora_target context" ;;
        fused) keys="--flux_lora_target context --fuse_qkv_projections true" ;;
        keys) keys="--flux_guidance_mode random-range --flow_use_beta_schedule true --flow_schedule_auto_shift true" ;;
        graph) keys="--cuda_graph true" ;;      # checkpointing, the step as one CUDA graph
        graphnogc) keys="--cuda_graph true" ;;  # the same without checkpointing
        int8) keys="--base_model_precision int8-quanto --quantize_via cpu" ;;  # the 24 GB recipe
        fp8 | fp8nogc) keys="--base_model_precision fp8-torchao --quantize_via cpu" ;;  # fp8nogc: no checkpointing
        *) keys="" ;;
    esac
    name=${spec//[+=]/_} o=$W/out-${spec//[+=]/_}
    args=(--model_family flux --pretrained_model_name_or_path "$flux" --output_dir "$o" --max_train_steps "$STEPS"
        --model_type lora --lora_rank 16 --train_batch_size 1 --optimizer adamw_bf16 --learning_rate 1e-4
        --mixed_precision bf16 --gradient_checkpointing "$gc" --checkpoint_step_interval 1000 --seed 42 --device cuda $keys)
    env DTUNE_PROFILE_STEPS=${PROFILE:-} "${vars[@]}" timeout -k 10 ${RUN_LIMIT:-240} build/release/bin/dtune train "${args[@]}" \
        --data_backend_config "$W/mdb.json" >"$logs/$name.log" 2>&1
    rc=$?
    python3 - "$o/metrics.jsonl" "$spec" "$rc" <<'PY' | tee -a "$out/flux_train.json"
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
    # time-weighted: the summed step times (batch 1), the throughput figure (see train_full_size.sh)
    out["ms_per_step"] = round(1000.0 * sum(1.0 / r["img_per_s"] for r in half) / len(half), 1)
    out["peak_gpu_gib"] = max((r.get("gpu_memory_gib", 0) for r in rows), default=None)
    out["final_loss"] = rows[-1]["loss"]
    out["all_finite"] = all(math.isfinite(r["loss"]) for r in rows)
print(json.dumps(out))
PY
    grep -h 'loaded the\|cuda_graph\|text cache\|latent\|error' "$logs/$name.log" | head -8
    # BENCH=1: the same options through bench_trainer (the real Trainer, synthetic batches of the
    # same shapes): `dtune train` should come within 5% of it.
    if [[ ${BENCH:-1} == 1 ]]; then
        env "${vars[@]}" timeout -k 10 ${RUN_LIMIT:-240} build/release/bench/bench_trainer "${args[@]}" \
            --output_dir "$W/bench-$name" >"$logs/bench_$name.log" 2>&1
        tail -1 "$logs/bench_$name.log" | grep '^{' | sed "s/^{/{\"run\": \"$spec\", /" | tee -a "$out/flux_train.json"
    fi
    if [[ -f $o/profile/trace_rank0.json ]]; then  # PROFILE=A:B (DTUNE_PROFILE_STEPS) traced steps A..B
        span=${PROFILE#*:}; span=$(( span - ${PROFILE%%:*} + 1 ))
        python3 bench/summarize_trace.py "$o/profile/trace_rank0.json" --steps "$span" --top 40 \
            --csv "$logs/kernels_$name.csv" >"$logs/profile_$name.txt" 2>&1
        head -${PROFILE_LINES:-60} "$logs/profile_$name.txt"
        gzip -c "$o/profile/trace_rank0.json" >"$logs/trace_$name.json.gz"
    fi
done
# The diffusers + PEFT step on the same card (bench/diffusers_flux_baseline.py), eager and, with
# COMPILE=1, under torch.compile in its own process.
if [[ ${BASELINE:-1} == 1 ]]; then
    timeout -k 10 300 python3 bench/diffusers_flux_baseline.py --modes "${BASELINE_MODES:-lora1,lora1gc}" --steps 8 \
        >"$logs/diffusers_eager.log" 2>&1
    grep RESULT "$logs/diffusers_eager.log" | sed 's/^RESULT/{"diffusers_eager":/; s/$/}/' | tee -a "$out/flux_train.json"
    tail -3 "$logs/diffusers_eager.log"
fi
if [[ ${COMPILE:-0} == 1 ]]; then
    timeout -k 10 480 python3 bench/diffusers_flux_baseline.py --modes "${COMPILE_MODES:-${BASELINE_MODES:-lora1,lora1gc}}" --steps 8 \
        --compile >"$logs/diffusers_compile.log" 2>&1
    grep RESULT "$logs/diffusers_compile.log" | sed 's/^RESULT/{"diffusers_compile":/; s/$/}/' | tee -a "$out/flux_train.json"
    tail -3 "$logs/diffusers_compile.log"
fi
echo "== done at $SECONDS s"
tar czf "$out/flux_train_logs.tar.gz" -C "$W" logs $(cd "$W" && ls -d out-*/metrics.jsonl 2>/dev/null)
