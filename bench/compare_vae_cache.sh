#!/usr/bin/env bash
# VAE latent caching, dtune vs diffusers, in one command on one machine: writes N photo-like JPEGs
# (once), runs bench_vae_cache (JPEGs on disk → bucketing → decode/resize threads → encoder
# batches → cache files, full-size random SDXL VAE) once per variant, runs
# bench/diffusers_vae_encode.py (diffusers' encode-only rate: the same VAE config, dtype, batch and
# resolution, images already on the device), and prints the ratios. Target (issue #11): dtune's
# end-to-end rate >= 1.5 x diffusers' encode-only rate.
#
#   DIFFUSERS_SRC=<diffusers src/ or unpacked wheel> bench/compare_vae_cache.sh [--count 200]
#       [--batch 8] [--res 1024] [--variants base,cl+bm+gn,cl+fu,cl+bm+fu] [--threads 0] [--device cuda]
#       [--dtype bf16] [--profile DIR]
#
# --profile DIR: a Kineto trace of 2 encode-only batches per variant (GPU), summarised into
# $OUT/vae_profile.txt by bench/summarize_trace.py.
# Environment: BENCH_BIN (default build/dev/bench/bench_vae_cache), MODEL (SDXL config folder;
# default shared/fixtures/sdxl-base-configs or ../shared/fixtures/sdxl-base-configs), OUT (the JSON
# results; default out/vae_bench), SCRATCH (images and cache files; default /tmp/dtune_vae_bench),
# IMAGES (the JPEG folder; default $SCRATCH/images).
set -euo pipefail
cd "$(dirname "$0")/.."
count=200 batch=8 res=1024 variants=base,cl+bm+gn,cl+fu,cl+bm+fu threads=0 device=cuda dtype=bf16 steps=10 profile=()
while [ $# -gt 0 ]; do
    case "$1" in
        --count) count=$2; shift 2 ;;
        --batch) batch=$2; shift 2 ;;
        --res) res=$2; shift 2 ;;
        --variants) variants=$2; shift 2 ;;
        --threads) threads=$2; shift 2 ;;
        --device) device=$2; shift 2 ;;
        --dtype) dtype=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        --profile) profile=(--profile "$2"); shift 2 ;;
        *) echo "compare_vae_cache.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
first_of() { for p in "$@"; do [ -e "$p" ] && { echo "$p"; return; }; done; echo "$1"; }
BENCH_BIN=${BENCH_BIN:-build/dev/bench/bench_vae_cache}
MODEL=${MODEL:-$(first_of shared/fixtures/sdxl-base-configs ../shared/fixtures/sdxl-base-configs)}
OUT=${OUT:-out/vae_bench}
SCRATCH=${SCRATCH:-/tmp/dtune_vae_bench}  # images and cache files: large, kept out of $OUT
IMAGES=${IMAGES:-$SCRATCH/images}
[ -n "${DIFFUSERS_SRC:-}" ] || { echo "set DIFFUSERS_SRC to a diffusers src/ folder or unpacked wheel" >&2; exit 2; }
mkdir -p "$OUT"
: >"$OUT/dtune_vae.jsonl"

echo "== diffusers encode-only: batch $batch, ${res}x${res}, $dtype, $device"
DIFFUSERS_SRC="$DIFFUSERS_SRC" PYTHONUNBUFFERED=1 python3 bench/diffusers_vae_encode.py --model "$MODEL" \
    --batch "$batch" --res "$res" --dtype "$dtype" --device "$device" --steps "$steps" 2>"$OUT/diffusers_vae.err" |
    tee "$OUT/diffusers_vae.json" || { echo "diffusers baseline failed:"; tail -20 "$OUT/diffusers_vae.err"; }

for v in ${variants//,/ }; do
    echo "== dtune $v: $count JPEGs in $IMAGES, batch $batch, pixel_area $res"
    # Each variant in its own process: clean peak memory and cuDNN state.
    "$BENCH_BIN" --images "$IMAGES" --make-images "$count" --model "$MODEL" --work "$SCRATCH/work" \
        --device "$device" --dtype "$dtype" --batch "$batch" --res "$res" --threads "$threads" \
        --variant "$v" --encode-steps "$steps" "${profile[@]+"${profile[@]}"}" 2>"$OUT/dtune_vae_$v.err" | tee -a "$OUT/dtune_vae.jsonl" ||
        { echo "dtune $v failed:"; tail -20 "$OUT/dtune_vae_$v.err"; }
done

if [ ${#profile[@]} -gt 0 ]; then  # where the encoder's GPU time goes, per variant
    for t in "${profile[1]}"/trace_vae_*.json; do
        [ -f "$t" ] && { echo "== $t"; python3 bench/summarize_trace.py "$t" --steps 2 --top 15; }
    done >"$OUT/vae_profile.txt" 2>&1
    echo "encoder profiles: $OUT/vae_profile.txt"
fi
python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
base = {}
p = os.path.join(out, "diffusers_vae.json")
for line in open(p) if os.path.exists(p) else []:
    if line.startswith("{"):
        base = json.loads(line)
ref = base.get("img_per_s")
print(f"\n{'variant':8} {'dtune img/s':>11} {'busy':>5} {'dtune enc-only':>14} {'GiB':>5} | "
      f"{'diffusers enc-only':>18} {'GiB':>5} | {'ratio':>5} (target 1.5)")
for line in open(os.path.join(out, "dtune_vae.jsonl")):
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    if "skipped" in r and "img_per_s" not in r:
        print(r["skipped"]); continue
    ratio = f"{r['img_per_s'] / ref:5.2f}" if ref else "    -"
    print(f"{r['variant']:8} {r['img_per_s']:11.2f} {r['encoder_busy']:5.2f} {r['encode_only_img_per_s']:14.2f} "
          f"{r['peak_gpu_gib']:5.1f} | " + (f"{ref:18.2f} {base['peak_gpu_gib']:5.1f}" if ref else f"{'-':>24}")
          + f" | {ratio}")
EOF
