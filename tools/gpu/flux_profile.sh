#!/usr/bin/env bash
# Where a Flux.1 [dev] training step's GPU time goes, in one device call: bench_flux (full-size
# transformer, random bf16 weights, 1024², forward and forward + backward to the input, the LoRA
# step's frozen-base shape) with a Kineto trace of one forward + backward summarised by kernel family
# (bench/summarize_trace.py), then the attention alone under each SDPA backend and layout
# (bench/flux_attention_probe.py). Carry [".gpudeps.tar.xz", "shared"].
#   OUT=$OUT tools/gpu/flux_profile.sh          env: STEPS (5), PROBE (1: run the attention probe),
#   CUDNN (1: also try cuDNN attention in the training pass)
# Results: $OUT/flux_profile.txt and $OUT/flux_profile_logs.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-gpu-logs}; mkdir -p "$out"; out=$(cd "$out" && pwd)
W=${WORK:-/tmp/flux_profile}; logs=$W/logs; rm -rf "$W"; mkdir -p "$logs"
report=$out/flux_profile.txt; : >"$report"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$report"
python3 -c 'import torch; print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())' | tee -a "$report"
probe=
if [[ ${PROBE:-1} == 1 ]]; then
    (python3 bench/flux_attention_probe.py >"$logs/attention.jsonl" 2>"$logs/attention.err"; echo $? >"$logs/attention.rc") &
    probe=$!
fi
PRESET=release OUT=$logs timeout -k 10 400 tools/gpu/build.sh bench_flux >"$logs/build.txt" 2>&1 ||
    { tail -30 "$logs/build.txt" | tee -a "$report"; }
if [[ -n $probe ]]; then
    wait $probe
    echo "== attention (1 x 24 x tokens x 128, bf16)" >>"$report"; cat "$logs/attention.jsonl" >>"$report"
    tail -3 "$logs/attention.err" >>"$report"
fi
bench=build/release/bench/bench_flux; [[ -x $bench ]] || bench=build/release/bin/bench_flux
if [[ -x $bench ]]; then
    echo "== bench_flux" >>"$report"
    $bench --steps "${STEPS:-5}" --profile "$logs/trace.json" >>"$report" 2>"$logs/bench.err" ||
        tail -5 "$logs/bench.err" >>"$report"
    [[ -f $logs/trace.json ]] && python3 bench/summarize_trace.py "$logs/trace.json" --steps 1 --top 40 >>"$report" 2>&1
    echo "== bench_flux with DTUNE_FUSED_KERNELS=0 (dtune's own kernels off: the composite ops)" >>"$report"
    DTUNE_FUSED_KERNELS=0 $bench --steps "${STEPS:-5}" >>"$report" 2>"$logs/bench_unfused.err" ||
        tail -5 "$logs/bench_unfused.err" >>"$report"
    [[ ${CUDNN:-1} == 1 ]] || { cat "$report"; tar czf "$out/flux_profile_logs.tar.gz" -C "$W" logs; exit 0; }
    echo "== bench_flux --cudnn_attention 1 (SDPA's own kernel choice in the training pass)" >>"$report"
    $bench --steps "${STEPS:-5}" --cudnn_attention 1 >>"$report" 2>"$logs/bench_cudnn.err" ||
        tail -5 "$logs/bench_cudnn.err" >>"$report"
fi
cat "$report"
gzip -f "$logs/trace.json" 2>/dev/null
tar czf "$out/flux_profile_logs.tar.gz" -C "$W" logs
