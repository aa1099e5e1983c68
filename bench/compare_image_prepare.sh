#!/usr/bin/env bash
# Issue #5's speed section in one run, JSON out: the header scan of generated JPEG/PNG files
# (bench_image_scan, warm page cache, 1 thread and T threads; target >= 20,000 files/s), then
# decode + Lanczos resize + crop of 4000x3000 JPEGs to SDXL's 1024² bucket with dtune
# (bench_image_prepare, plain and with libjpeg's reduced-scale decode) and with Pillow
# (bench/pillow_prepare.py) on the same files, same geometry, same thread count.
#
#   bench/compare_image_prepare.sh [--scan-files 10000] [--files 1000] [--threads T]
#
# Environment: BIN (folder with bench_image_scan and bench_image_prepare; default
# build/release/bench, else build/dev/bench), OUT (default out/image_bench; the JSON lines go to
# $OUT/image_bench.jsonl), DIR (scratch folder for the images; default /tmp/dtune_image_bench).
# Pillow missing: its line says so and the dtune lines still print.
set -euo pipefail
cd "$(dirname "$0")/.."
scan_files=10000 files=1000 threads=$(nproc)
while [ $# -gt 0 ]; do
    case "$1" in
        --scan-files) scan_files=$2; shift 2 ;;
        --files) files=$2; shift 2 ;;
        --threads) threads=$2; shift 2 ;;
        *) echo "compare_image_prepare.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
BIN=${BIN:-$( [ -x build/release/bench/bench_image_prepare ] && echo build/release/bench || echo build/dev/bench)}
OUT=${OUT:-out/image_bench}
DIR=${DIR:-/tmp/dtune_image_bench}
mkdir -p "$OUT" "$DIR"
log="$OUT/image_bench.jsonl"
: >"$log"
echo "== $BIN, $(nproc) cores here"
for t in 1 "$threads"; do
    "$BIN/bench_image_scan" --files "$scan_files" --threads "$t" --dir "$DIR/scan" | tee -a "$log"
done
"$BIN/bench_image_prepare" --files "$files" --threads "$threads" --dir "$DIR/prepare_$files" | tee -a "$log"
"$BIN/bench_image_prepare" --files "$files" --threads "$threads" --dir "$DIR/prepare_$files" --fast 1 | tee -a "$log"
# The same geometry as the C++ run printed.
geometry=$(python3 -c "
import json, sys
r = [json.loads(l) for l in open('$log') if '\"image_prepare\"' in l][0]
(rw, rh), (tw, th), (top, left) = r['resize'], r['target'], r['crop_top_left']
print(rw, rh, top, left, tw, th)")
set -- $geometry
if python3 -c "import PIL" 2>/dev/null; then
    python3 bench/pillow_prepare.py --dir "$DIR/prepare_$files" --resize "$1" "$2" --crop "$3" "$4" "$5" "$6" \
        --threads "$threads" | tee -a "$log"
else
    echo '{"bench": "image_prepare", "impl": "pillow", "skipped": "Pillow is not installed"}' | tee -a "$log"
fi
python3 - "$log" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
scan = [r for r in rows if r["bench"] == "image_header_scan"]
prep = {r["impl"]: r for r in rows if r["bench"] == "image_prepare" and "images_per_s" in r}
summary = {"bench": "issue5_speed",
           "scan_files_per_s": {str(r["threads"]): r["files_per_s"] for r in scan},
           "scan_target_met": all(r["files_per_s"] >= 20000 for r in scan),
           "prepare_images_per_s_per_core": {k: v["images_per_s_per_core"] for k, v in prep.items()}}
if "pillow" in prep:
    p = prep["pillow"]["images_per_s"]
    summary["dtune_vs_pillow"] = {k: round(v["images_per_s"] / p, 2) for k, v in prep.items() if k != "pillow"}
print(json.dumps(summary))
EOF
