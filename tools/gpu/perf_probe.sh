#!/usr/bin/env bash
# One GPU call that finds where time and memory go before a change (issue #11), each stage capped:
#   1. bench_train_step per gradient_checkpointing_interval (GC_INTERVALS, mode GC_MODE): ms/step and
#      peak memory, to find the fastest full batch-4 step that stays under diffusers' 40 GiB;
#   2. channels-last with dtune's NHWC GroupNorm against the same modes without (CL_MODES);
#   3. Kineto profiles of PROFILE_MODES (bench_train_step --profile) and of the VAE encoder
#      (bench_vae_cache --profile, variants VAE_VARIANTS), summarised by bench/summarize_trace.py;
#   4. a full fine-tune with the optimizer offloaded to the host (tools/gpu/train_full_size.sh,
#      torch-adamw, OFFLOAD_STEPS steps) on one GPU, all host cores for the update.
# Needs .gpudeps.tar.xz and shared/ in the checkout (tools/gpu/prepare.sh). Results in $OUT.
#   OUT=$OUT tools/gpu/perf_probe.sh    env: STEPS=8, GC_MODE, GC_INTERVALS, CL_MODES, PROFILE_MODES,
#                                       VAE_VARIANTS, OFFLOAD_STEPS (0: skip stage 4)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-out/probe}; mkdir -p "$OUT"
STEPS=${STEPS:-8}
GC_MODE=${GC_MODE:-full4bfgccg} GC_INTERVALS=${GC_INTERVALS:-1 2 3 4}
CL_MODES=${CL_MODES:-lora4cg,lora4cgcl}
PROFILE_MODES=${PROFILE_MODES:-lora4cg} VAE_VARIANTS=${VAE_VARIANTS:-base cl+bm+gn}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$SECONDS
OUT=$OUT tools/gpu/build.sh bench_train_step bench_vae_cache dtune make_random_pipeline || exit 1
echo "build: $((SECONDS - t0)) s"
B=build/dev/bench/bench_train_step M=shared/fixtures/sdxl-base-configs
for n in $GC_INTERVALS; do
    timeout 100 "$B" "$M" --modes "$GC_MODE" --steps "$STEPS" --no-peak --gc-interval "$n" 2>>"$OUT/probe.log" |
        sed "s/^{/{\"gc_interval\": $n, /" | tee -a "$OUT/probe.jsonl"
done
[ -n "$CL_MODES" ] && timeout 120 "$B" "$M" --modes "$CL_MODES" --steps "$STEPS" --no-peak --nhwc-group-norm \
    2>>"$OUT/probe.log" | tee -a "$OUT/probe.jsonl"
for m in ${PROFILE_MODES//,/ }; do
    timeout 100 "$B" "$M" --modes "$m" --steps 3 --no-peak --profile /tmp/prof >/dev/null 2>>"$OUT/probe.log" &&
        python3 bench/summarize_trace.py "/tmp/prof/trace_$m.json" --top 30 >"$OUT/profile_$m.txt"
done
for v in $VAE_VARIANTS; do
    timeout 120 build/dev/bench/bench_vae_cache --images /tmp/vae_images --make-images 16 --model "$M" \
        --work /tmp/vae_work --device cuda --dtype bf16 --batch 8 --res 1024 --variant "$v" --encode-steps 5 \
        --profile /tmp/vprof 2>>"$OUT/probe.log" | tee -a "$OUT/probe.jsonl"
done
for f in /tmp/vprof/trace_vae_*.json; do
    [ -f "$f" ] && python3 bench/summarize_trace.py "$f" --top 30 >>"$OUT/profile_vae.txt"
done
if [ "${OFFLOAD_STEPS:-8}" -gt 0 ]; then
    timeout 200 tools/gpu/train_full_size.sh build/dev /tmp/offload full "${OFFLOAD_STEPS:-8}" \
        --offload_optimizer_device cpu --optimizer torch-adamw >"$OUT/offload.log" 2>&1
    echo "offload run: rc $?"
    tail -1 "$OUT/offload.log" | sed 's/^{/{"run": "full b1, 1 GPU, offload cpu, torch-adamw", /' | tee -a "$OUT/probe.jsonl"
fi
