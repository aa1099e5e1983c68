#!/usr/bin/env bash
# Issue #22's quantised-base measurements in one device call: `dtune train` LoRA r16 at 1024² on the
# full-size random SDXL with base_model_precision no_change (bf16) / int8-quanto / fp8-torchao /
# fp8-quanto, batch 4 and batch 1, SimpleTuner's defaults otherwise; the frozen UNet's weight bytes
# (from the "quantised the UNet" log line), peak GPU memory and the median ms/step. Then LOSS_STEPS
# (300) steps of each precision at batch 1 for the loss curves (metrics.jsonl copied to $OUT). Also
# builds and runs the gpu-labelled tests and bench_quant (the pieces: dequantisation bandwidth, one
# Linear per format). STEPS changes the speed runs' length (40); PHASE=speed or
# PHASE=curves runs one half only; PHASE=threshold measures the fp8 GEMM size threshold.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-logs}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 DTUNE_FIXTURES=$PWD/shared/fixtures
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
tools/gpu/build.sh dtune make_random_pipeline bench_quant test_models_gpu test_trainer_graph_gpu || exit 1
echo "== build done at $SECONDS s"
W=/tmp/w STEPS=${STEPS:-40} PHASE=${PHASE:-all}
run() {  # name, time limit, then tools/gpu/train_full_size.sh arguments after the work dir
  local name=$1 limit=$2; shift 2
  timeout -k 10 "$limit" tools/gpu/train_full_size.sh build/dev $W "$@" >"$out/$name.log" 2>&1
  local rc=$?
  cp "$W/out-lora-1-1/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null
  local unet
  unet=$(grep -o 'quantised the UNet[^)]*)' "$out/$name.log" | head -1)
  echo "{\"run\": \"$name\", \"rc\": $rc, \"unet\": \"${unet:-bf16}\", \"result\": $(tail -1 "$out/$name.log" | grep '^{' || echo null)}"
  grep -E "cuda_graph|error" "$out/$name.log" | cut -c1-220 | head -3
}
if [[ $PHASE == speed || $PHASE == all ]]; then
  ctest --test-dir build/dev -j4 -L gpu --output-on-failure >"$out/ctest_gpu.log" 2>&1
  echo "== ctest -L gpu: $(grep -E 'tests passed|tests failed' "$out/ctest_gpu.log")"
  sed -n '/The following tests FAILED/,$p' "$out/ctest_gpu.log"
  grep -E "QuantizeGpu|max abs error (y|dx)" "$out/ctest_gpu.log" | head -20
  build/dev/bench/bench_quant --iters 50 2>&1 | tee "$out/bench_quant.log"
  for p in no_change int8-quanto fp8-torchao fp8-quanto; do
    run "lora4_$p" 200 lora "$STEPS" --base_model_precision "$p"
  done
  for p in no_change int8-quanto fp8-torchao; do
    run "lora1_$p" 200 lora "$STEPS" --train_batch_size 1 --base_model_precision "$p"
  done
fi
# PHASE=threshold: fp8-torchao at batch 4 and 1 with the fp8 GEMM used from several GEMM sizes on
# (DTUNE_FP8_GEMM_MIN_MACS: 0 = always, 1e30 = never), against bf16 in the same call.
if [[ $PHASE == threshold ]]; then
  run lora4_bf16 200 lora "$STEPS"
  run lora1_bf16 200 lora "$STEPS" --train_batch_size 1
  for t in 0 8589934592 34359738368 1e30; do
    DTUNE_FP8_GEMM_MIN_MACS=$t run "lora4_fp8_min$t" 200 lora "$STEPS" --base_model_precision fp8-torchao
    DTUNE_FP8_GEMM_MIN_MACS=$t run "lora1_fp8_min$t" 200 lora "$STEPS" --train_batch_size 1 --base_model_precision fp8-torchao
  done
  echo "== total $SECONDS s"; exit 0
fi
if [[ $PHASE == curves || $PHASE == all ]]; then
  for p in no_change int8-quanto fp8-torchao; do
    run "curve_$p" 300 lora "${LOSS_STEPS:-300}" --train_batch_size 1 --base_model_precision "$p"
  done
fi
echo "== total $SECONDS s"
