#!/usr/bin/env bash
# Issue #24's scaling table in one multi-GPU call (NCCL_NVLS_ENABLE=0): full-size SDXL full
# fine-tunes (adamw_bf16, batch 1 per GPU, tools/gpu/train_full_size.sh, SimpleTuner's defaults
# otherwise) on 1 GPU and on 2 and 4 GPUs with each ZeRO stage in STAGES; LoRA r16 batch 4 on 1 and
# on every GPU (LORA=1); then, with FLUX=1, a Flux.1-dev full fine-tune (random full-size folder,
# 1024², gradient checkpointing, zero_stage 3) on 2 and 4 GPUs. img/s, ms/step and rank 0's peak
# memory (metrics.jsonl: the steps' peak) per run; one JSON line each in $OUT/zero_scale.jsonl.
#   OUT=$OUT tools/gpu/zero_scale.sh     env: STEPS (20), STAGES ("0 1 2 3"; "" runs no SDXL full run), GPUS ("1 2 4", capped at
#   the machine's count), LORA (1), LORA_GPUS (the LoRA runs' GPU counts; default 1 and the most), FLUX (0), FLUX_STEPS (6), CAP (240 s a run), FLAT_GPUS (""),
#   GRAPH_TEST (0: 1 builds and runs dist_graph_gpu_tests first), TWO_NODE (0; 1: two node processes
#   on this host, 2 GPUs each on 4 GPUs, 1 each on 2), TWO_NODE_STAGE (1),
#   FULL_EXTRA (more train_full_size.sh options for the SDXL full runs, e.g. "--gradient_checkpointing true"),
#   Z3_EXTRA (more options for the SDXL zero_stage 3 runs only, e.g. "--offload_optimizer_device cpu"),
#   DEADLINE (seconds after the start; a run that would start later is skipped, a running one is cut
#   there: keeps a capped device call from losing every result to its time limit).
#   ENV_VARIANTS (space-separated; each a comma-joined list of VAR=value: the SDXL full run on the
#   largest GPU count, zero_stage VARIANT_STAGE (0), again with those variables, e.g.
#   "NCCL_MAX_NCHANNELS=8 DTUNE_BUCKET_MB=100"; with VARIANT_STAGE=2 e.g. "DTUNE_ZERO2_SLOTS=8";
#   "DTUNE_PROFILE_STEPS=15:16" also writes rank 0's and the last rank's trace summaries, *.prof.txt;
#   the pseudo-variables GPUS=n and ZERO=z run that variant on n GPUs / with zero_stage z instead),
#   MEM (1: on the largest GPU count, or on each of MEM_GPUS, the memory runs zero_stage 1, 2 and 3
#   with gradient checkpointing, and 3 with the optimizer offloaded too).
#   MEM_SPECS (the memory runs, "stage|options;stage|options"; a third field "|VAR=v,VAR=v" sets that
#   run's environment, e.g. "3|--gradient_checkpointing true|DTUNE_ZERO3_REDUCE_IN_FLIGHT=8"), FLUX_OUT (the Flux runs' output_dir
#   root, default $W: a 12 B full fine-tune's checkpoint is ~72 GB, so /dev/shm where the disk is short),
#   GPU_TESTS (gtest binaries under build/dev/tests to build and run on GPU 0 first, each
#   "dir/binary" or "dir/binary:gtest_filter", e.g. "train/test_trainer_graph_gpu").
# With FLUX=1 the random Flux folder is written while the build runs, and the Flux runs go first.
# Carry [".gpudeps.tar.xz", "shared", ".whl"] (the Flux folder maker imports diffusers).
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-out/zero}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
W=/tmp/zero_scale STEPS=${STEPS:-20} CAP=${CAP:-240} STAGES=${STAGES-"0 1 2 3"}
have=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
DEADLINE=${DEADLINE:-100000}
limit() {  # this run's time cap: CAP, or less where DEADLINE is near; 0: skip it
    local left=$((DEADLINE - SECONDS))
    (( left < 45 )) && { echo 0; return; }
    echo $(( left < CAP ? left : CAP ))
}
flux=$W/flux
if [[ ${FLUX:-0} == 1 ]]; then  # the 34 GB folder is written on GPU 0 while the CPU builds
    whl=$(ls .whl/diffusers-*.whl 2>/dev/null | head -1)
    [[ -n $whl ]] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_diffusers "$whl" \
        >/dev/null 2>&1 && export PYTHONPATH=/tmp/site_diffusers${PYTHONPATH:+:$PYTHONPATH}
    mkdir -p "$W"
    if [[ ! -f $flux/model_index.json ]]; then
        timeout -k 10 300 python3 tools/ref/make_random_flux_pipeline.py "$flux" --device cuda --seed 1 --no-check \
            >"$OUT/flux_make.log" 2>&1 &
        flux_make=$!
    fi
fi
targets=(dtune make_random_pipeline)
[[ ${GRAPH_TEST:-0} == 1 ]] && targets+=(dist_graph_gpu_tests)
for t in ${GPU_TESTS:-}; do b=${t%%:*}; targets+=("${b##*/}"); done
OUT=$OUT tools/gpu/build.sh "${targets[@]}" >/dev/null || { tail -40 "$OUT/build.log"; exit 1; }
echo "== build done at $SECONDS s"
if [[ ${GRAPH_TEST:-0} == 1 ]]; then  # the graphed 2-GPU step against eager and one GPU (label gpu)
    timeout -k 10 300 build/dev/tests/dist/dist_graph_gpu_tests >"$OUT/graph_gpu_test.log" 2>&1
    echo "graph gpu test exit $?: $(grep -E 'graphed 2 GPUs|PASSED|FAILED' "$OUT/graph_gpu_test.log" | tr '\n' ' ')"
fi
for t in ${GPU_TESTS:-}; do  # the GPU tests first: what they check decides whether the rest means anything
    b=${t%%:*} filter=${t#*:}
    [[ $filter == "$t" ]] && filter='*'
    log=$OUT/gpu_test_${b##*/}.log cap=$(CAP=300 limit)
    (( cap > 0 )) || { echo "gpu test $b: skipped (DEADLINE)"; continue; }
    CUDA_VISIBLE_DEVICES=0 timeout -k 10 "$cap" "build/dev/tests/$b" --gtest_filter="$filter" >"$log" 2>&1
    echo "gpu test $b ($filter): exit $? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]' "$log" | head -20
done
gpus=()
for n in ${GPUS:-1 2 4}; do (( n <= have )) && gpus+=("$n"); done
row() {  # label, log, exit code, seconds: train_full_size.sh's JSON line + the run's label
    local json
    json=$(tail -1 "$2" | grep '^{' || echo '{}')
    echo "{\"run\": \"$1\", \"exit\": $3, \"seconds\": $4, \"result\": $json}" | tee -a "$OUT/zero_scale.jsonl"
    [[ $3 == 0 ]] || grep -E "error|Error|rank [0-9]+ failed" "$2" | head -3
}
# Flux first: the costliest runs and the ones never measured before.
if [[ ${FLUX:-0} == 1 ]]; then
    if [[ -n ${flux_make:-} ]]; then
        wait "$flux_make" || { echo "flux folder: make failed"; tail -5 "$OUT/flux_make.log"; }
        echo "== flux folder written at $SECONDS s"
    fi
    [[ -d $W/flux_images ]] || python3 tools/gpu/make_images.py "$W/flux_images" --count 16 >/dev/null
    cat >"$W/flux_mdb.json" <<JSON
[
  {"id": "shapes", "type": "local", "instance_data_dir": "$W/flux_images", "caption_strategy": "textfile",
   "resolution": 1024, "resolution_type": "pixel_area", "cache_dir_vae": "$W/cache/flux_vae"},
  {"id": "text", "type": "local", "dataset_type": "text_embeds", "default": true, "cache_dir": "$W/cache/flux_text"}
]
JSON
    for n in "${gpus[@]}"; do
        (( n < 2 )) && continue
        t0=$SECONDS o=${FLUX_OUT:-$W}/out-flux-$n
        rm -rf "$o"
        cap=$(CAP=${FLUX_CAP:-420} limit)
        (( cap > 0 )) || { echo "flux full, $n GPUs: skipped (DEADLINE)"; continue; }
        timeout -k 20 "$cap" build/dev/bin/dtune launch --nproc_per_node "$n" -- train --model_family flux \
            --pretrained_model_name_or_path "$flux" --data_backend_config "$W/flux_mdb.json" --output_dir "$o" \
            --max_train_steps "${FLUX_STEPS:-6}" --model_type full --train_batch_size 1 --optimizer adamw_bf16 \
            --learning_rate 1e-5 --mixed_precision bf16 --gradient_checkpointing true --zero_stage 3 \
            --checkpoint_step_interval 1000 --seed 42 --device cuda >"$OUT/flux_full_${n}gpu.log" 2>&1
        rc=$?
        python3 - "$o/metrics.jsonl" "$n" "$rc" $((SECONDS - t0)) <<'PY' | tee -a "$OUT/zero_scale.jsonl"
import json, statistics, sys
path, n, rc, secs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
try:
    rows = [json.loads(l) for l in open(path) if '"loss"' in l]
except OSError:
    rows = []
half = rows[len(rows) // 2:]
out = {"run": f"flux full, {n} GPUs, zero_stage 3, gc", "exit": rc, "seconds": secs, "steps": len(rows)}
if half:
    # time-weighted (images over the summed step times; see train_full_size.sh), not a median
    ips = n * len(half) / sum(n / r["img_per_s"] for r in half)
    out.update(img_per_s=ips, img_per_s_per_gpu=ips / n, ms_per_step=1000.0 * n / ips,
               peak_gpu_gib_rank0=max(r.get("gpu_memory_gib", 0) for r in rows))
print(json.dumps(out))
PY
        [[ $rc == 0 ]] || grep -E "error|Error|failed" "$OUT/flux_full_${n}gpu.log" | head -3
        du -sh "$o"/checkpoint-* 2>/dev/null | head -2
        rm -rf "$o"  # a 12 B checkpoint is ~72 GB: the next runs need the disk
    done
fi
# LoRA r16 batch 4 with SimpleTuner's defaults on 1 GPU and on the most (issue #18's data-parallel
# target), before the full fine-tunes: short runs.
if [[ ${LORA:-1} == 1 ]]; then
    for n in ${LORA_GPUS:-1 ${gpus[-1]}}; do
        (( n <= have )) || continue
        t0=$SECONDS cap=$(limit)
        (( cap > 0 )) || { echo "lora, $n GPUs: skipped (DEADLINE)"; continue; }
        NPROC=$n timeout -k 20 "$cap" tools/gpu/train_full_size.sh build/dev "$W" lora "$STEPS" >"$OUT/lora_${n}gpu.log" 2>&1
        row "sdxl lora r16 batch 4, $n GPUs, defaults" "$OUT/lora_${n}gpu.log" $? $((SECONDS - t0))
    done
fi
for n in "${gpus[@]}"; do
    for z in $STAGES; do
        (( n == 1 && z != 0 )) && continue  # one GPU: ZeRO has nothing to shard
        t0=$SECONDS cap=$(limit) extra="${FULL_EXTRA:-}"
        (( z == 3 )) && extra+="${Z3_EXTRA:+ $Z3_EXTRA}"
        (( cap > 0 )) || { echo "sdxl full, $n GPUs, zero_stage $z: skipped (DEADLINE)"; continue; }
        NPROC=$n timeout -k 20 "$cap" tools/gpu/train_full_size.sh build/dev "$W" full "$STEPS" --zero_stage "$z" \
            $extra >"$OUT/full_${n}gpu_zero$z.log" 2>&1
        row "sdxl full, $n GPUs, zero_stage $z${extra:+, $extra}" "$OUT/full_${n}gpu_zero$z.log" $? \
            $((SECONDS - t0))
    done
done
# MEM=1: peak memory per GPU of the sharded stages with gradient checkpointing (issue #24's ZeRO-3
# target is measured against ZeRO-2 at the same settings), and ZeRO-3 with the optimizer in host memory.
if [[ ${MEM:-0} == 1 ]]; then
  for n in ${MEM_GPUS:-${gpus[-1]}}; do
    (( n <= have )) || continue
    IFS=';' read -ra specs <<<"${MEM_SPECS:-1|--gradient_checkpointing true;2|--gradient_checkpointing true;3|--gradient_checkpointing true;3|--gradient_checkpointing true --offload_optimizer_device cpu}"
    for spec in "${specs[@]}"; do
        # "stage|options" or "stage|options|VAR=value,VAR=value" (environment of that run only)
        IFS='|' read -r z extra vars <<<"$spec"
        t0=$SECONDS cap=$(limit)
        log=$OUT/mem_${n}gpu_zero${z}_${extra//[^A-Za-z0-9]/_}${vars:+_${vars//[^A-Za-z0-9]/_}}.log
        (( cap > 0 )) || { echo "memory run zero_stage $z $extra $vars: skipped (DEADLINE)"; continue; }
        env ${vars//,/ } NPROC=$n timeout -k 20 "$cap" tools/gpu/train_full_size.sh build/dev "$W" full "$STEPS" \
            --zero_stage "$z" $extra >"$log" 2>&1
        row "sdxl full, $n GPUs, zero_stage $z, $extra${vars:+, $vars}" "$log" $? $((SECONDS - t0))
    done
  done
fi
# ENV_VARIANTS: the same run with other NCCL / bucket settings.
for v in ${ENV_VARIANTS:-}; do
    n=${gpus[-1]} z=${VARIANT_STAGE:-0} vars=()
    IFS=',' read -ra kv <<<"$v"
    for x in "${kv[@]}"; do  # GPUS=n and ZERO=z pick this variant's GPU count and stage
        case $x in GPUS=*) n=${x#GPUS=} ;; ZERO=*) z=${x#ZERO=} ;; *) vars+=("$x") ;; esac
    done
    t0=$SECONDS cap=$(limit) log=$OUT/full_${n}gpu_zero${z}_${v//[^A-Za-z0-9]/_}.log
    (( cap > 0 )) || { echo "variant $v: skipped (DEADLINE)"; continue; }
    env "${vars[@]}" NPROC=$n timeout -k 20 "$cap" tools/gpu/train_full_size.sh build/dev "$W" full "$STEPS" \
        --zero_stage "$z" >"$log" 2>&1
    row "sdxl full, $n GPUs, zero_stage $z, $v" "$log" $? $((SECONDS - t0))
    # a variant with DTUNE_PROFILE_STEPS=A:B: rank 0's and the last rank's traces, summarised
    for tr in "$W/out-full-$n-1"/profile/trace_rank{0,$((n - 1))}.json; do
        [[ -f $tr ]] && python3 bench/summarize_trace.py "$tr" --steps 2 >"${log%.log}.$(basename "${tr%.json}").prof.txt" 2>&1
    done
done
# FLAT_GPUS: zero_stage 0 again on these GPU counts with DTUNE_GRAPH_REDUCER=0 (the graph's former
# flat all-reduce after backward), against the overlapped bucket all-reduce above.
for n in ${FLAT_GPUS:-}; do
    (( n <= have )) || continue
    t0=$SECONDS
    DTUNE_GRAPH_REDUCER=0 NPROC=$n timeout -k 20 "$CAP" tools/gpu/train_full_size.sh build/dev "$W" full "$STEPS" \
        --zero_stage 0 >"$OUT/full_${n}gpu_zero0_flat.log" 2>&1
    row "sdxl full, $n GPUs, zero_stage 0, flat all-reduce after backward" "$OUT/full_${n}gpu_zero0_flat.log" $? \
        $((SECONDS - t0))
done
# TWO_NODE=1: the same full fine-tune as two `dtune launch --nnodes 2 --node_rank` processes on this
# host (one shared output_dir), zero_stage TWO_NODE_STAGE (1): 2 GPUs each (GPUs 0,1 and 2,3) on a
# 4-GPU host, 1 GPU each on a 2-GPU host.
if [[ ${TWO_NODE:-0} == 1 ]] && (( have >= 2 )); then
    t0=$SECONDS port=$((29000 + RANDOM % 1000)) z=${TWO_NODE_STAGE:-1} cap=$(limit)
    if (( have >= 4 )); then per=2 dev0=0,1 dev1=2,3; else per=1 dev0=0 dev1=1; fi
    if (( cap > 0 )); then
        CUDA_VISIBLE_DEVICES=$dev1 NNODES=2 NODE_RANK=1 MASTER_PORT=$port NPROC=$per timeout -k 20 "$cap" \
            tools/gpu/train_full_size.sh build/dev "$W" full "$STEPS" --zero_stage "$z" >"$OUT/two_node_1.log" 2>&1 &
        CUDA_VISIBLE_DEVICES=$dev0 NNODES=2 NODE_RANK=0 MASTER_PORT=$port NPROC=$per timeout -k 20 "$cap" \
            tools/gpu/train_full_size.sh build/dev "$W" full "$STEPS" --zero_stage "$z" >"$OUT/two_node_0.log" 2>&1
        rc=$?
        wait
        row "sdxl full, 2 nodes x $per GPU(s) on one host, zero_stage $z" "$OUT/two_node_0.log" $rc $((SECONDS - t0))
    else
        echo "two nodes: skipped (DEADLINE)"
    fi
fi
echo "== done at $SECONDS s"
tar czf "$OUT/zero_scale_logs.tar.gz" -C "$OUT" $(cd "$OUT" && ls *.log *.prof.txt 2>/dev/null) 2>/dev/null
