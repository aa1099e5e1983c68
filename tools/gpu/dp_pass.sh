#!/usr/bin/env bash
# One 2-GPU call for issue #8's remaining measurements (NCCL_NVLS_ENABLE=0): builds what it needs
# (dev preset), runs the /Cuda instances of the unit tests (optimizer offload, adamw_bf16's kernel),
# then full-size SDXL full fine-tunes (adamw_bf16, batch 1 per GPU, tools/gpu/train_full_size.sh)
# on 2 GPUs with each ZeRO setting in ZERO_RUNS, and a LoRA run launched as two nodes of one GPU
# each on this host (`dtune launch --nnodes 2 --node_rank 0|1`, CUDA_VISIBLE_DEVICES 0 and 1), and
# the same two-node launch with rank 1 SIGKILLed at step 5 (DTUNE_INJECT_STEP_ERROR=kill:1:5): how
# long node 0's NCCL rank takes to stop after node 1's launcher reports the dead rank.
# Each run has a time cap; results land in $OUT (dp_pass.jsonl: one line per run).
#   tools/gpu/dp_pass.sh        env: STEPS=20, OFFLOAD_STEPS=8, ZERO_RUNS="0 1 2 2+offload"
#                               (+torch: torch-adamw), TWO_NODE=1,
#                               KILL_RUN=1, CAP=240 (seconds per run)
# (the offloaded run's adamw_bf16 update runs on the host's cores: seconds per step, hence fewer steps)
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-out/dp}; mkdir -p "$OUT"
STEPS=${STEPS:-20} W=/tmp/dp_pass CAP=${CAP:-240}  # CAP: seconds per run
ZERO_RUNS=${ZERO_RUNS:-0 1 2 2+offload}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
OUT=$OUT tools/gpu/build.sh dtune make_random_pipeline test_train_unit || exit 1
(cd build/dev && timeout 120 ctest -R '/Cuda' --output-on-failure) >"$OUT/ctest_cuda.txt" 2>&1
grep -E "tests passed|tests failed" "$OUT/ctest_cuda.txt"
summary() {  # <label> <metrics.jsonl> <exit code> <seconds>
    python3 - "$@" <<'PY' | tee -a "$OUT/dp_pass.jsonl"
import json, statistics, sys
label, path, rc, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
try:
    rows = [json.loads(l) for l in open(path)]
except OSError:
    rows = []
steady = [r for r in rows if r["step"] > 5] or rows[-1:]
print(json.dumps({"run": label, "exit": rc, "seconds": secs, "steps": len(rows),
                  "img_per_s": statistics.median(r["img_per_s"] for r in steady) if steady else None,
                  "peak_gpu_gib_rank0": max((r.get("gpu_memory_gib", 0) for r in rows), default=None)}))
PY
}
for z in $ZERO_RUNS; do
    stage=${z%%+*} extra=() steps=$STEPS
    [[ $z == *offload* ]] && extra=(--offload_optimizer_device cpu) steps=${OFFLOAD_STEPS:-8}
    [[ $z == *torch* ]] && extra+=(--optimizer torch-adamw)  # fp32 master weights instead of adamw_bf16
    t0=$SECONDS
    CUDA_VISIBLE_DEVICES=0,1 NPROC=2 timeout -k 20 "$CAP" tools/gpu/train_full_size.sh build/dev "$W" full "$steps" \
        --zero_stage "$stage" "${extra[@]}" >"$OUT/full_zero$z.log" 2>&1
    rc=$?
    summary "full 2 GPUs zero_stage $z" "$W/out-full-2/metrics.jsonl" $rc $((SECONDS - t0))
done
if [[ ${TWO_NODE:-1} == 1 ]]; then
    port=$((29000 + RANDOM % 1000)) t0=$SECONDS
    common=(--nnodes 2 --nproc_per_node 1 --master_addr 127.0.0.1 --master_port $port)
    args=(train --model_family sdxl --pretrained_model_name_or_path "$W/sdxl" --data_backend_config "$W/mdb.json"
          --output_dir "$W/out-two-node" --max_train_steps "$STEPS" --mixed_precision bf16
          --gradient_checkpointing false --model_type lora --lora_rank 16 --train_batch_size 4
          --optimizer torch-adamw --learning_rate 1e-4 --seed 42 --device cuda --lr_scheduler constant)
    CUDA_VISIBLE_DEVICES=1 timeout -k 20 "$CAP" build/dev/bin/dtune launch "${common[@]}" --node_rank 1 -- "${args[@]}" \
        >"$OUT/two_node_1.log" 2>&1 &
    CUDA_VISIBLE_DEVICES=0 timeout -k 20 "$CAP" build/dev/bin/dtune launch "${common[@]}" --node_rank 0 -- "${args[@]}" \
        >"$OUT/two_node_0.log" 2>&1
    rc0=$?
    wait $!; rc1=$?
    summary "lora two node_ranks x 1 GPU (node 1 exit $rc1)" "$W/out-two-node/metrics.jsonl" $rc0 $((SECONDS - t0))
    if [[ ${KILL_RUN:-1} == 1 ]]; then  # rank 1 SIGKILLed at step 5: both launchers must end within seconds
        port=$((port + 7))
        common=(--nnodes 2 --nproc_per_node 1 --master_addr 127.0.0.1 --master_port $port)
        args[8]=$W/out-kill  # --output_dir's value
        stamp() { "$@"; local rc=$?; echo "exit $rc at $(date +%s.%N)"; }
        stamp env DTUNE_INJECT_STEP_ERROR=kill:1:5 CUDA_VISIBLE_DEVICES=1 timeout -k 20 "$CAP" build/dev/bin/dtune launch \
            "${common[@]}" --node_rank 1 -- "${args[@]}" >"$OUT/kill_node_1.log" 2>&1 &
        stamp env DTUNE_INJECT_STEP_ERROR=kill:1:5 CUDA_VISIBLE_DEVICES=0 timeout -k 20 "$CAP" build/dev/bin/dtune launch \
            "${common[@]}" --node_rank 0 -- "${args[@]}" >"$OUT/kill_node_0.log" 2>&1
        wait
        python3 - "$OUT/kill_node_0.log" "$OUT/kill_node_1.log" <<'PY' | tee -a "$OUT/dp_pass.jsonl"
import json, re, sys
logs = [open(p, errors="replace").read() for p in sys.argv[1:]]
ends = [re.findall(r"exit (\d+) at ([0-9.]+)", t)[-1] for t in logs]
print(json.dumps({"run": "SIGKILL rank 1 at step 5, two node_ranks, NCCL",
                  "exit_node0": int(ends[0][0]), "exit_node1": int(ends[1][0]),
                  "node0_after_node1_s": round(float(ends[0][1]) - float(ends[1][1]), 2),
                  "node0_names_rank1": "rank 1 failed" in logs[0],
                  "node1_reports_signal": "killed by signal 9" in logs[1]}))
PY
    fi
fi
