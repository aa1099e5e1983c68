#!/usr/bin/env bash
# Runs dtune's bench_train_step and the diffusers baseline (../shared/bench/diffusers_sdxl_baseline.py)
# with the same modes, resolution, LoRA rank and step count on this GPU, one after the other, and
# prints one table with the ratios. Numbers from different machines are never mixed: run it on the
# GPU that you report.
#
#   DIFFUSERS_SRC=<diffusers src/ folder> bench/compare_diffusers.sh [--modes lora1,lora4,lora4gc,full1gc]
#       [--steps 10] [--compile] [--dtune-extra lora1cg,lora4cg] [--profile DIR]
#
# Environment: BENCH_BIN (default build/dev/bench/bench_train_step), MODEL (an SDXL config folder;
# default shared/fixtures/sdxl-base-configs or ../shared/fixtures/sdxl-base-configs), BASELINE (the
# baseline script), OUT (where both write their JSON; default out/bench). --compile adds the
# baseline under torch.compile as a second reference. --dtune-extra adds modes that only dtune runs
# (suffixes cg: CUDA graph, cl: channels-last, bf: bf16 weights + adamw_bf16); each is compared with
# the baseline mode it extends.
set -euo pipefail
cd "$(dirname "$0")/.."
modes=lora1,lora4,lora4gc,full1gc
steps=10
compile=0
extra=""
profile=()
while [ $# -gt 0 ]; do
    case "$1" in
        --modes) modes=$2; shift 2 ;;
        --steps) steps=$2; shift 2 ;;
        --compile) compile=1; shift ;;
        --dtune-extra) extra=$2; shift 2 ;;
        --profile) profile=(--profile "$2"); shift 2 ;;
        *) echo "compare_diffusers.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
first_of() { for p in "$@"; do [ -e "$p" ] && { echo "$p"; return; }; done; echo "$1"; }
BENCH_BIN=${BENCH_BIN:-build/dev/bench/bench_train_step}
MODEL=${MODEL:-$(first_of shared/fixtures/sdxl-base-configs ../shared/fixtures/sdxl-base-configs)}
BASELINE=${BASELINE:-$(first_of ../shared/bench/diffusers_sdxl_baseline.py shared/bench/diffusers_sdxl_baseline.py)}
OUT=${OUT:-out/bench}
mkdir -p "$OUT"
[ -n "${DIFFUSERS_SRC:-}" ] || { echo "set DIFFUSERS_SRC to a diffusers src/ folder (pip download diffusers --no-deps, unzip)" >&2; exit 2; }
ours_modes=$modes${extra:+,$extra}

echo "== dtune: $BENCH_BIN $MODEL --modes $ours_modes --steps $steps"
"$BENCH_BIN" "$MODEL" --modes "$ours_modes" --steps "$steps" --warmup 3 "${profile[@]+"${profile[@]}"}" | tee "$OUT/dtune.jsonl" ||
    echo "dtune bench failed (exit $?)"
if [ ${#profile[@]} -gt 0 ]; then
    for t in "${profile[1]}"/trace_*.json; do
        [ -f "$t" ] && python3 "$(dirname "$0")/summarize_trace.py" "$t" --top 20
    done >"$OUT/profile.txt" 2>&1
fi
echo "== diffusers eager"
# The baseline skips its first 2 steps and takes the median of the rest: steps + 2 gives the same count.
OUT="$OUT" DIFFUSERS_SRC="$DIFFUSERS_SRC" PYTHONUNBUFFERED=1 python3 "$BASELINE" --modes "$modes" \
    --steps $((steps + 2)) --flops | tee "$OUT/diffusers.log" || echo "diffusers baseline failed"
if [ "$compile" = 1 ]; then
    echo "== diffusers torch.compile"
    OUT="$OUT" DIFFUSERS_SRC="$DIFFUSERS_SRC" PYTHONUNBUFFERED=1 python3 "$BASELINE" --modes "$modes" \
        --steps $((steps + 2)) --compile --tag _compile | tee "$OUT/diffusers_compile.log" ||
        echo "diffusers compile baseline failed"
fi
python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
ours = {}
for line in open(os.path.join(out, "dtune.jsonl")):
    if line.startswith("{"):
        r = json.loads(line)
        ours[r["mode"]] = r
def base_mode(mode):  # lora4cg -> lora4: dtune-only suffixes dropped
    while mode[-2:] in ("cg", "cl", "bf"):
        mode = mode[:-2]
    return mode
def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else {}
eager, comp = load("diffusers_baseline.json"), load("diffusers_baseline_compile.json")
print(f"\n{'mode':12} {'dtune ms':>9} {'img/s':>7} {'GiB':>6} {'MFU':>5} | {'diff ms':>8} {'img/s':>7} {'GiB':>6} {'x eager':>7} | {'compile ms':>10} {'x comp':>6}")
for mode, r in ours.items():
    e, c = eager.get(base_mode(mode), {}), comp.get(base_mode(mode), {})
    em, cm = e.get("ms_step_median"), c.get("ms_step_median")
    print(f"{mode:12} {r['ms_step_median']:9.1f} {r['img_per_s']:7.2f} {r['peak_gib']:6.1f} {r['mfu']:5.2f} | "
          + (f"{em:8.1f} {e['img_per_s']:7.2f} {e['peak_gib']:6.1f} {em / r['ms_step_median']:7.2f}" if em else f"{e.get('error', '-'):>31}")
          + " | " + (f"{cm:10.1f} {cm / r['ms_step_median']:6.2f}" if cm else f"{'-':>17}"))
EOF
