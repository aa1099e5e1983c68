#!/usr/bin/env bash
# Before/after in one device call: the same full-size SDXL `dtune train` runs (tools/gpu/train_full_size.sh,
# SimpleTuner's defaults) from two builds on one warm card, alternating old and new, so a change's
# effect is measured side by side. The old tree comes as a tarball of an earlier commit
# (git archive <commit> -o .gpusrc/old.tar); it is built under /tmp/ab_old with the same preset.
#   OUT=$OUT OLD_TAR=.gpusrc/old.tar tools/gpu/ab_step.sh
# env: RUNS ("full lora": full = batch 1 adamw_bf16, lora = r16 batch 4, lora0 = the same with lora_dropout 0, lora1 = batch 1; "fullgc4" = batch 4 with
#   gradient checkpointing), STEPS (40), ROUNDS (1: old,new pairs per run), PROFILE (A:B: a Kineto trace
#   of steps A..B of each run in the first round, summarised by kernel family), GPU_TESTS (like zero_scale.sh:
#   "dir/binary[:filter]" built from the new tree and run first; GPU_TEST_ENV: a comma-joined VAR=value
#   list set for the GPU tests only, e.g. GPU_TEST_ENV="DTUNE_FUSED_RESNET_TRAINING=1";
#   GPU_TEST_TIMEOUT: seconds per test binary, 300; the whole test_trainer_graph_gpu needs more),
#   VARIANTS (space-separated; each a comma-joined VAR=value list: every run again from the new
#   build with that environment, labelled new+VARS, e.g. VARIANTS="DTUNE_FUSED_QKV=1"),
#   VARIANT_RUNS (the runs that get the variants; default all),
#   BENCHES (space-separated bench targets, each "target[:arg,arg...]", built from the new tree and
#   run after the GPU tests, e.g. BENCHES="bench_lora_dropout:--r,16"). A Kineto trace adds ~35 s to a
#   run: leave PROFILE out of timing calls that are short of device time.
# Prints one JSON line per run: {"run", "build", "ms_per_step" (wall time of the second half of the
# steps / steps, from metrics.jsonl's step times), ...}; logs and profiles under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0 DTUNE_FIXTURES=$PWD/shared/fixtures
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
W=/tmp/ab STEPS=${STEPS:-40} GPU_TEST_ENV=${GPU_TEST_ENV:-} GPU_TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-300}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
targets=(dtune make_random_pipeline)
for t in ${GPU_TESTS:-}; do b=${t%%:*}; targets+=("${b##*/}"); done
for t in ${BENCHES:-}; do targets+=("${t%%:*}"); done
OUT=$OUT tools/gpu/build.sh "${targets[@]}" >/dev/null || exit 1
old=/tmp/ab_old
if [[ -n ${OLD_TAR:-} ]]; then
    mkdir -p $old && tar xf "$OLD_TAR" -C $old && ln -sfn "$PWD/shared" $old/shared && cp .gpudeps.tar.xz $old/
    (cd $old && OUT=$OUT/old tools/gpu/build.sh dtune make_random_pipeline >/dev/null) || { echo "old build failed"; exit 1; }
fi
echo "== builds done at $SECONDS s"
for t in ${GPU_TESTS:-}; do
    b=${t%%:*} filter=${t#*:}
    [[ $filter == "$t" ]] && filter='*'
    log=$OUT/gpu_test_${b##*/}.log
    env ${GPU_TEST_ENV//,/ } timeout -k 10 "$GPU_TEST_TIMEOUT" "build/dev/tests/$b" --gtest_filter="$filter" >"$log" 2>&1
    echo "gpu test $b ($filter): exit $? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$log" | tr '\n' ' ')"
    grep -E '^\[  FAILED  \]' "$log" | head -20
done
for t in ${BENCHES:-}; do
    b=${t%%:*} args=${t#*:}
    [[ $args == "$t" ]] && args=
    timeout -k 10 300 "build/dev/bench/$b" ${args//,/ } >"$OUT/bench_$b.log" 2>&1
    echo "bench $b: exit $?"; cat "$OUT/bench_$b.log"
done
one() {  # run name, build label, build dir[, environment VAR=value,...]
    local name=$1 label=$2 build=$3 vars=${4:-} mode extra=() prof=${PROFILE:-}
    ((round > 0)) && prof=
    case $name in
        full) mode=full ;;
        lora) mode=lora ;;
        lora0) mode=lora extra=(--lora_dropout 0) ;;
        lora1) mode=lora extra=(--train_batch_size 1) ;;
        fullgc4) mode=full extra=(--train_batch_size 4 --gradient_checkpointing true) ;;
        *) echo "unknown run $name"; return ;;
    esac
    local log=$OUT/${name}_${label//[^A-Za-z0-9+]/_}.log
    env ${vars//,/ } DTUNE_PROFILE_STEPS=$prof timeout -k 10 240 tools/gpu/train_full_size.sh "$build" $W \
        "$mode" "$STEPS" "${extra[@]}" >"$log" 2>&1
    local rc=$? o=$W/out-$mode-1-1
    python3 - "$o/metrics.jsonl" "$name" "$label" "$rc" <<'PY'
import json, statistics, sys
path, name, label, rc = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
out = {"run": name, "build": label, "exit": rc}
try:
    rows = [json.loads(l) for l in open(path) if '"img_per_s"' in l]
except OSError:
    rows = []
half = rows[len(rows) // 2:]
if half:
    # The rows' img_per_s is images over the host's time for the step: the time-weighted rate over
    # the window (total images / total time) is the honest figure; the median of per-step rates
    # can flatter a run whose steps alternate long and short.
    per_step = rows[-1]["samples_seen"] // rows[-1]["step"]
    seconds = sum(per_step / r["img_per_s"] for r in half)
    out.update(steps=len(rows), ms_per_step=1000.0 * seconds / len(half), img_per_s=per_step * len(half) / seconds,
               median_ms=1000.0 * per_step / statistics.median(r["img_per_s"] for r in half),
               peak_gpu_gib=max(r.get("gpu_memory_gib", 0) for r in rows), final_loss=rows[-1]["loss"])
print(json.dumps(out))
PY
    if [[ -n $prof && -f $o/profile/trace_rank0.json ]]; then
        python3 bench/summarize_trace.py "$o/profile/trace_rank0.json" --steps 2 --top 60 --csv "${log%.log}.kernels.csv" >"${log%.log}.prof.txt" 2>&1
        head -12 "${log%.log}.prof.txt"
    fi
}
for name in ${RUNS:-full lora}; do
    for ((round = 0; round < ${ROUNDS:-1}; round++)); do
        [[ -n ${OLD_TAR:-} ]] && one "$name" old $old/build/dev
        one "$name" new build/dev
        [[ " ${VARIANT_RUNS:-$name} " == *" $name "* ]] || continue
        for v in ${VARIANTS:-}; do one "$name" "new+$v" build/dev "$v"; done
    done
done
echo "== done at $SECONDS s"
tar czf "$OUT/ab_logs.tar.gz" -C "$OUT" $(cd "$OUT" && ls *.log *.prof.txt *.kernels.csv 2>/dev/null) 2>/dev/null
