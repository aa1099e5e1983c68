#!/usr/bin/env bash
# GPU acceptance pass on the lent machine (see docs/DEVELOPING.md): builds the dev preset, runs the
# gpu-labelled tests, then full-size dtune train runs (tools/gpu/train_full_size.sh): a full
# fine-tune, a LoRA with CUDA graphs, and a 2-GPU LoRA when two GPUs are present (with stack
# dumps if it has not finished in time). Logs go to $OUT (or ./gpu-logs).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-logs}; mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 DTUNE_FIXTURES=$PWD/shared/fixtures
rm -rf .gpudeps
tools/gpu/build.sh || exit 1
tools/gpu/build.sh make_random_pipeline || exit 1
ctest --test-dir build/dev -j8 -L gpu --output-on-failure >"$out/ctest_gpu.log" 2>&1; tail -4 "$out/ctest_gpu.log"
W=/tmp/w
step() { echo "== $1: rc=$2"; tail -1 "$out/$1.log"; }
timeout 150 tools/gpu/train_full_size.sh build/dev $W full ${FULL_STEPS:-150} >"$out/full1.log" 2>&1; step full1 $?
timeout 120 tools/gpu/train_full_size.sh build/dev $W lora ${LORA_STEPS:-200} --cuda_graph true \
  --grad_clip_method norm --max_grad_norm 1 --lora_dropout 0 --metrics_interval 10 >"$out/lora1cg.log" 2>&1
step lora1cg $?
if (( $(nvidia-smi -L | wc -l) >= 2 )); then
  (NPROC=2 DTUNE_SHARED_DIR_WAIT_S=5 NCCL_DEBUG=WARN timeout 100 tools/gpu/train_full_size.sh build/dev $W lora 60 \
     >"$out/lora2.log" 2>&1; echo "== lora2: rc=$?"; tail -1 "$out/lora2.log") &
  sleep 75
  for pid in $(pgrep -f "dtune train --model_family"); do
    command -v gdb >/dev/null && gdb -p "$pid" -batch -ex "thread apply all bt 15" >"$out/bt_$pid.log" 2>&1
  done
  wait
fi
