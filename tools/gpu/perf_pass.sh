#!/usr/bin/env bash
# One GPU call for issue #11's table: builds what it needs (dev preset), runs the CUDA tests of the
# fused kernels, then dtune's bench_train_step and the diffusers baseline on the same GPU, one after
# the other, and prints dtune vs diffusers per setting. Each stage has a time cap so that the call
# ends inside the device's limit and keeps what finished (everything lands in $OUT).
# Needs in the checkout: .gpudeps.tar.xz and shared/ (tools/gpu/prepare.sh), shared/bench/
# diffusers_sdxl_baseline.py, and the diffusers wheel (DIFFUSERS_WHL, default ./diffusers-*.whl).
#   tools/gpu/perf_pass.sh   (env: STEPS=8, DTUNE_MODES, BASE_MODES, AB_MODES + AB_FLAGS (the same
#                             modes again with fused paths off), GC_MODES + GC_INTERVALS, CL_MODES)
#   COMPILE_ONLY=1 tools/gpu/perf_pass.sh   only the diffusers baseline under torch.compile
#       (COMPILE_MODES, default lora4), capped at 540 s, into $OUT/diffusers_compile.log: its
#       compilation takes minutes, so it gets a call of its own; compare with a perf_pass run on the
#       same kind of card.
set -uo pipefail
cd "$(dirname "$0")/../.."
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-out/perf}; mkdir -p "$OUT"
STEPS=${STEPS:-8}
DTUNE_MODES=${DTUNE_MODES:-full4gccg,full1gccg,full4bfgccg,full1bfcg,lora4cg,lora1cg}
BASE_MODES=${BASE_MODES:-lora4,full4gc,lora1,full1gc}
AB_MODES=${AB_MODES:-lora4cg} AB_FLAGS=${AB_FLAGS:---no-fused-lora}  # again with a fused path off
GC_MODES=${GC_MODES:-full4bfgccg}  # again per gradient_checkpointing_interval in GC_INTERVALS
GC_INTERVALS=${GC_INTERVALS:-3 4}
CL_MODES=${CL_MODES:-}  # e.g. lora4cgcl: channels-last with dtune's NHWC GroupNorm
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
unpack_diffusers() {
    local whl=${DIFFUSERS_WHL:-$(ls diffusers-*.whl 2>/dev/null | head -1)}
    rm -rf /tmp/diffusers_src && mkdir -p /tmp/diffusers_src && python3 -m zipfile -e "$whl" /tmp/diffusers_src
}
if [ "${COMPILE_ONLY:-0}" = 1 ]; then
    unpack_diffusers
    OUT=$OUT DIFFUSERS_SRC=/tmp/diffusers_src PYTHONUNBUFFERED=1 timeout 540 python3 shared/bench/diffusers_sdxl_baseline.py \
        --modes "${COMPILE_MODES:-lora4}" --steps $((STEPS + 2)) --compile --tag _compile >"$OUT/diffusers_compile.log" 2>&1
    echo "diffusers compile: rc $? (124: did not finish in 540 s)"
    grep -E '^(lora|full)' "$OUT/diffusers_compile.log"
    exit 0
fi
t0=$(date +%s)
OUT=$OUT tools/gpu/build.sh bench_train_step test_models_gpu test_train_unit test_trainer_graph_gpu || exit 1
echo "build: $(($(date +%s) - t0)) s"
(cd build/dev && timeout 120 ctest -R "ModelsGpu|/Cuda|CudaGraphTrainerGpu" --output-on-failure) \
    >"$OUT/ctest_gpu.txt" 2>&1
grep -E "tests passed|Failed|FAILED" "$OUT/ctest_gpu.txt"
B=build/dev/bench/bench_train_step M=shared/fixtures/sdxl-base-configs
timeout 200 "$B" "$M" --modes "$DTUNE_MODES" --steps "$STEPS" >"$OUT/dtune.jsonl" 2>"$OUT/dtune.log"
echo "dtune bench: rc $?"
unpack_diffusers
OUT=$OUT DIFFUSERS_SRC=/tmp/diffusers_src PYTHONUNBUFFERED=1 timeout 240 python3 shared/bench/diffusers_sdxl_baseline.py \
    --modes "$BASE_MODES" --steps $((STEPS + 2)) >"$OUT/diffusers.log" 2>&1
echo "diffusers: rc $?"
if [ -n "$AB_MODES" ]; then
    # shellcheck disable=SC2086
    timeout 100 "$B" "$M" --modes "$AB_MODES" --steps "$STEPS" --no-peak $AB_FLAGS \
        >"$OUT/dtune_unfused.jsonl" 2>>"$OUT/dtune.log"
    echo "dtune A/B ($AB_FLAGS): rc $?"
fi
for n in $GC_INTERVALS; do
    [ -n "$GC_MODES" ] || break
    timeout 100 "$B" "$M" --modes "$GC_MODES" --steps "$STEPS" --no-peak --gc-interval "$n" \
        >"$OUT/dtune_gc$n.jsonl" 2>>"$OUT/dtune.log"
    echo "dtune gradient_checkpointing_interval $n: rc $?"
done
if [ -n "$CL_MODES" ]; then
    timeout 100 "$B" "$M" --modes "$CL_MODES" --steps "$STEPS" --no-peak --nhwc-group-norm \
        >"$OUT/dtune_cl.jsonl" 2>>"$OUT/dtune.log"
    echo "dtune channels-last + NHWC GroupNorm: rc $?"
fi
python3 bench/perf_table.py "$OUT"
