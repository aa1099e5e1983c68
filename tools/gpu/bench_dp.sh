#!/usr/bin/env bash
# Data-parallel scaling on a machine with >= 2 GPUs: the full-size SDXL run of train_full_size.sh
# (random weights, 1024²) on 1 GPU (`dtune train`), then on 2 GPUs (`dtune launch
# --nproc_per_node 2`), same per-GPU batch, NCCL_NVLS_ENABLE=0.
#   tools/gpu/bench_dp.sh <build dir> <work dir> [mode=lora] [steps=60] [extra dtune train options...]
# e.g. tools/gpu/bench_dp.sh build/release /tmp/w full 40 --zero_stage 2
# Prints one JSON line: img/s (the global throughput metrics.jsonl logs, median over the rows after
# the first WARMUP=10 steps) on 1 and 2 GPUs, the ratio (issue #8's target: >= 1.9), peak memory.
# Each run is stopped after RUN_TIMEOUT=1200 s so that a hang ends the script with its log tail.
set -euo pipefail
build=$1 work=$2 mode=${3:-lora} steps=${4:-60}
shift $(($# < 4 ? $# : 4))
here=$(cd "$(dirname "$0")" && pwd)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
((gpus >= 2)) || { echo "bench_dp.sh: needs 2 GPUs, this machine has $gpus" >&2; exit 2; }
export NCCL_NVLS_ENABLE=0
mkdir -p "$work"
for n in 1 2; do
  log=$work/bench-dp-$mode-$n.log
  echo "bench_dp.sh: $mode on $n GPU(s), $steps steps, log $log" >&2
  devices=$( ((n == 1)) && echo 0 || echo 0,1)
  CUDA_VISIBLE_DEVICES=$devices NPROC=$n timeout -k 30 "${RUN_TIMEOUT:-1200}" \
    "$here/train_full_size.sh" "$build" "$work" "$mode" "$steps" "$@" >"$log" 2>&1 ||
    { echo "bench_dp.sh: the $n-GPU run failed (exit $?; 124: timed out); its log ends:" >&2; tail -40 "$log" >&2; exit 1; }
done
python3 - "$work" "$mode" "${WARMUP:-10}" <<'PY'
import json, statistics, sys
work, mode, warmup = sys.argv[1], sys.argv[2], int(sys.argv[3])
def summary(n):
    rows = [json.loads(l) for l in open(f"{work}/out-{mode}-{n}/metrics.jsonl")]
    steady = [r for r in rows if r["step"] > warmup] or rows[-1:]
    return {"img_per_s": statistics.median(r["img_per_s"] for r in steady), "rows": len(steady),
            "peak_gpu_gib": max(r.get("gpu_memory_gib", 0) for r in rows), "final_loss": rows[-1]["loss"]}
one, two = summary(1), summary(2)
print(json.dumps({"mode": mode, "warmup_steps_skipped": warmup, "gpu1": one, "gpu2": two,
                  "scaling": two["img_per_s"] / one["img_per_s"]}))
PY
