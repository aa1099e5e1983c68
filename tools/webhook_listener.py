#!/usr/bin/env python3
"""A throwaway webhook receiver for trying dtune's webhooks: prints each POST it receives as one
JSON line (path, headers of interest, the JSON body or the multipart field names) and answers 200.

usage: tools/webhook_listener.py [port] [--count N]   (exits after N requests when given)
then point a raw webhook at it: {"webhook_type": "raw", "callback_url": "http://127.0.0.1:PORT/hook"}
"""
import http.server
import json
import sys

COUNT = None
SEEN = 0


class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        global SEEN
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        record = {"path": self.path, "content_type": self.headers.get("Content-Type", "")}
        try:
            record["json"] = json.loads(body)
        except ValueError:
            record["bytes"] = len(body)
        print(json.dumps(record), flush=True)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")
        SEEN += 1

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--count" in args:
        i = args.index("--count")
        COUNT = int(args[i + 1])
        del args[i:i + 2]
    port = int(args[0]) if args else 8765
    server = http.server.HTTPServer(("127.0.0.1", port), Handler)
    while COUNT is None or SEEN < COUNT:
        server.handle_request()
