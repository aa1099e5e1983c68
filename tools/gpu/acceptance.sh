#!/usr/bin/env bash
# GPU acceptance pass on the lent machine (see docs/DEVELOPING.md), one device call: builds what it
# runs (dev preset), the gpu-labelled tests and the cache suite (its CUDA case),
# then full-size `dtune train` runs (tools/gpu/train_full_size.sh): full fine-tune with adamw_bf16
# eager and with cuda_graph, LoRA with cuda_graph; with two GPUs also dist-selftest over NCCL, the
# 2-GPU LoRA with cuda_graph, a CUDA error injected on rank 1 (the fault channel must end the job
# with exit 75 within seconds) and a ZeRO-2 full fine-tune. Each step has its own time limit and
# prints one line; logs go to $OUT (or ./gpu-logs). STEPS_FULL / STEPS_LORA change the lengths.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-logs}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 DTUNE_FIXTURES=$PWD/shared/fixtures
gpus=$(nvidia-smi -L | grep -c '^GPU')
rm -rf .gpudeps
tools/gpu/build.sh dtune make_random_pipeline test_trainer_graph_gpu test_models_gpu test_data_cache test_train_unit || exit 1
echo "== build done at $SECONDS s"
ctest --test-dir build/dev -j8 -L gpu --output-on-failure >"$out/ctest_gpu.log" 2>&1
echo "== ctest -L gpu: $(grep -E 'tests passed|tests failed' "$out/ctest_gpu.log")"
(cd build/dev && ctest -R 'CacheTest' --output-on-failure) >"$out/ctest_cuda_cases.log" 2>&1
echo "== cache suite with CUDA (pinned async encoder): $(grep -E 'tests passed|tests failed' "$out/ctest_cuda_cases.log")"
# Device-parameterised unit tests (adamw_bf16's fused kernel, optimizer offload): their /Cuda instances.
(cd build/dev && ctest -R '/Cuda' --output-on-failure) >"$out/ctest_cuda_instances.log" 2>&1
echo "== /Cuda instances of unit tests: $(grep -E 'tests passed|tests failed' "$out/ctest_cuda_instances.log")"
W=/tmp/w
G=(--cuda_graph true --grad_clip_method norm --max_grad_norm 1 --metrics_interval 10)
run() {  # name, time limit, then NPROC=.. tools/gpu/train_full_size.sh arguments
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  echo "== $name: rc=$? in $((SECONDS - t0)) s: $(tail -1 "$out/$name.log")"
}
FULL=${STEPS_FULL:-60} LORA=${STEPS_LORA:-100}
run full1 120 tools/gpu/train_full_size.sh build/dev $W full "$FULL" --metrics_interval 10
run full1cg 120 tools/gpu/train_full_size.sh build/dev $W full "$FULL" "${G[@]}"
run lora1cg 100 tools/gpu/train_full_size.sh build/dev $W lora "$LORA" "${G[@]}" --lora_dropout 0
if ((gpus >= 2)); then
  timeout 120 build/dev/bin/dtune launch --nproc_per_node 2 -- dist-selftest --device cuda >"$out/selftest.log" 2>&1
  echo "== dist-selftest nccl: rc=$? $(tail -1 "$out/selftest.log")"
  export NPROC=2
  run lora2cg 120 tools/gpu/train_full_size.sh build/dev $W lora "$LORA" "${G[@]}" --lora_dropout 0
  t0=$SECONDS
  DTUNE_INJECT_STEP_ERROR=cuda:1:5 DTUNE_COLLECTIVE_TIMEOUT_S=300 timeout 150 \
    tools/gpu/train_full_size.sh build/dev $W lora 40 >"$out/fault2.log" 2>&1
  echo "== fault2 (CUDA error on rank 1 at step 5): rc=$? after $((SECONDS - t0)) s"
  grep -E "stops because|exited with|GPU fault|error:" "$out/fault2.log" | cut -c1-200 | head -4
  run full2zero2 150 tools/gpu/train_full_size.sh build/dev $W full "$FULL" --zero_stage 2 --metrics_interval 10
fi
echo "== total $SECONDS s"
