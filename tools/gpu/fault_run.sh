#!/usr/bin/env bash
# GPU circuit-breaker check on the GPU machine: a full-size LoRA run (tools/gpu/train_full_size.sh,
# NPROC GPUs) with an injected ECC fault and a raw webhook to a local listener. Prints the exit
# code (75 expected), the seconds from start to exit, and the webhook events received.
#   tools/gpu/fault_run.sh <build dir> <work dir>
set -uo pipefail
build=$1 work=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${OUT:-gpu-logs}; mkdir -p "$out"
hooks=$out/fault_hooks.jsonl; : >"$hooks"
python3 - "$hooks" <<'PY' &
import http.server, sys
path = sys.argv[1]
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with open(path, "ab") as f: f.write(body.replace(b"\n", b" ") + b"\n")
        self.send_response(200); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", 18080), H).serve_forever()
PY
listener=$!
sleep 1
start=$(date +%s)
DTUNE_INJECT_GPU_FAULT=ecc DTUNE_HEALTH_INTERVAL_S=1 timeout 300 "$root/tools/gpu/train_full_size.sh" "$build" "$work" \
  lora 400 --webhook_config '{"webhook_type":"raw","callback_url":"http://127.0.0.1:18080/hook","log_level":"info"}' \
  >"$out/fault_run.log" 2>&1
rc=$?
echo "fault run: rc=$rc after $(( $(date +%s) - start )) s"
grep -E "GPU fault|gpu.fault|exited|error" "$out/fault_run.log" | tail -6
kill $listener
python3 - "$hooks" <<'PY'
import json, sys, collections
events = collections.Counter()
for line in open(sys.argv[1]):
    try: events[json.loads(line).get("event", json.loads(line).get("type", "?"))] += 1
    except Exception: events["(unparsed)"] += 1
print("webhook events:", dict(events))
PY
