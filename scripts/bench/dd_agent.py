#!/usr/bin/env python3
"""Stand-in Datadog trace agent for `make bench` (scripts/bench_overhead.py).

HAProxy's OpenTracing filter, with the Datadog tracer plugin (`libdd_opentracing_plugin.so`),
sends msgpack-encoded traces to `/v0.4/traces` (`/v0.3/traces` on older agents) of the host and
port in its JSON config. This server accepts them (PUT or POST), answers 200 `{}` and counts what
it got, so the benchmark can check that the filter really produced spans:

- `traces`: the sum of the tracer's `X-Datadog-Trace-Count` headers;
- `spans`: occurrences of the msgpack key `span_id` (the fixstr `\\xa7span_id`), one per span
  map; counted with `bytes.count`, cheap enough not to load the CPU it shares with the load
  generator;
- `bytes`: payload bytes; `payloads`: requests.

`GET /stats` returns those counters as JSON. Usage: `dd_agent.py PORT` (listens on 127.0.0.1).
Python 3.11 standard library only.
"""

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SPAN_KEY = b"\xa7span_id"
COUNTS = {"payloads": 0, "traces": 0, "spans": 0, "bytes": 0, "other": 0}
LOCK = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, status, body):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def read_body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length", "0")))

    def do_PUT(self):
        body = self.read_body()
        path = self.path.split("?", 1)[0]
        with LOCK:
            if path in ("/v0.4/traces", "/v0.3/traces"):
                COUNTS["payloads"] += 1
                COUNTS["traces"] += int(self.headers.get("X-Datadog-Trace-Count", "0") or 0)
                COUNTS["spans"] += body.count(SPAN_KEY)
                COUNTS["bytes"] += len(body)
            else:
                COUNTS["other"] += 1
        self.reply(200, b"{}")

    do_POST = do_PUT

    def do_GET(self):
        if self.path == "/stats":
            with LOCK:
                body = json.dumps(COUNTS).encode()
            self.reply(200, body)
        else:
            self.reply(404, b"{}")


def main():
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
