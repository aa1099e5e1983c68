#!/usr/bin/env bash
# Issue #18's table in one device call: `dtune train` with SimpleTuner's step defaults (only the
# model, data, batch and optimizer set; grad_clip_method value, max_grad_norm 2, lora_dropout 0.1,
# metrics_interval 1, cuda_graph auto) against the same run with cuda_graph false and against
# bench_train_step's graphed step, all from one dev build on one warm card. Also runs the gpu-labelled
# tests (graphed vs eager weights per option, the hash-dropout kernel). Prints one JSON line per
# run and a summary table; logs go to $OUT (or ./gpu-logs). STEPS changes the run length (40);
# RUNS picks runs by name (default all; "bench" is bench_train_step's), CTEST=0 skips the tests.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-logs}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 DTUNE_FIXTURES=$PWD/shared/fixtures
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
tools/gpu/build.sh dtune make_random_pipeline bench_train_step bench_trainer test_trainer_graph_gpu test_models_gpu \
  test_trainer_unit || exit 1
echo "== build done at $SECONDS s"
[[ ${CTEST:-1} == 1 ]] && ctest --test-dir build/dev -j4 -L gpu --output-on-failure >"$out/ctest_gpu.log" 2>&1
echo "== ctest -L gpu: $(grep -E 'tests passed|tests failed' "$out/ctest_gpu.log")"
sed -n '/The following tests FAILED/,$p' "$out/ctest_gpu.log"
W=/tmp/w STEPS=${STEPS:-40}
# RUNS: only these run names (space-separated; default all), e.g. RUNS="lora4_default full1_default".
run() {  # name, time limit, then tools/gpu/train_full_size.sh arguments
  local name=$1 limit=$2; shift 2
  [[ -z ${RUNS:-} || " $RUNS " == *" $name "* ]] || return 0
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "{\"run\": \"$name\", \"rc\": $rc, \"result\": $(tail -1 "$out/$name.log" | grep '^{' || echo null)}"
  grep -E "cuda_graph|CUDA graph" "$out/$name.log" | cut -c1-220 | head -3
}
# LoRA r16 batch 4 and full fine-tune batch 1 (adamw_bf16) at 1024²; defaults otherwise. Each
# one-GPU run is repeated through bench_trainer (bench_trainer_ms: the Trainer's step on synthetic
# batches), which `dtune train` should match within 5%.
export BENCH_TRAINER=1
run lora4_default 200 tools/gpu/train_full_size.sh build/dev $W lora "$STEPS"
run lora4_mi10 200 tools/gpu/train_full_size.sh build/dev $W lora "$STEPS" --metrics_interval 10
run lora4_eager 200 tools/gpu/train_full_size.sh build/dev $W lora "$STEPS" --cuda_graph false
run lora1_default 200 tools/gpu/train_full_size.sh build/dev $W lora "$STEPS" --train_batch_size 1
run full1_default 200 tools/gpu/train_full_size.sh build/dev $W full "$STEPS"
run full1gc_default 200 tools/gpu/train_full_size.sh build/dev $W full "$STEPS" --gradient_checkpointing true
run full4gc_default 300 tools/gpu/train_full_size.sh build/dev $W full "$STEPS" --gradient_checkpointing true --train_batch_size 4
# Five aspect buckets (BUCKETS=5): one capture per bucket, one shared graph memory pool.
BENCH_TRAINER=0 BUCKETS=5 run lora4_5buckets 300 tools/gpu/train_full_size.sh build/dev $W lora "$STEPS"
grep -sE "captured the step|capture failed" "$out/lora4_5buckets.log" | cut -c1-200
BENCH_TRAINER=0 DTUNE_CUDA_GRAPH_SHARED_POOL=0 BUCKETS=5 run lora4_5buckets_ownpools 300 tools/gpu/train_full_size.sh build/dev $W lora "$STEPS"
grep -sE "captured the step|capture failed" "$out/lora4_5buckets_ownpools.log" | cut -c1-200
# The benchmark's graphed steps, same build (bench_train_step has the same ms/step definition: the
# median of its timed steps).
[[ -z ${RUNS:-} || " $RUNS " == *" bench "* ]] || { echo "== total $SECONDS s"; exit 0; }
timeout 300 build/dev/bench/bench_train_step $W/sdxl --modes lora4cg,lora1cg,full1bfcg --steps 20 \
  >"$out/bench.log" 2>&1
echo "{\"run\": \"bench\", \"rc\": $?}"
grep '^{' "$out/bench.log" | cut -c1-400
echo "== total $SECONDS s"
