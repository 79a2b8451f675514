#!/usr/bin/env bash
# `make demo`: a local edge HAProxy (TLS with HTTP/2, cleartext) and a backend on loopback, traced by
# tracetap; prints each trace as a waterfall with HAProxy's timers and termination states.
# Everything it starts is stopped on exit. Set OTEL_EXPORTER_OTLP_ENDPOINT to send the spans to a
# collector instead of stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "demo: tracetap loads eBPF probes and must run as root" >&2; exit 1; }

work=$(mktemp -d /tmp/tracetap-demo.XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
front=$(free_port); tls=$(free_port); back=$(free_port); admin=$(free_port)
# The agent: the debug build `make demo` makes, or TRACETAP_BIN.
tracetap=${TRACETAP_BIN:-./target/debug/tracetap}

# The backend: JSON for any path, /slow answers after 300 ms, /fail with a 500, /hang never in
# time (HAProxy's `timeout server` of 1 s answers 504 for it).
cat > "$work/backend.py" <<'PY'
import http.server, sys, time
class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        delay = {"/slow": 0.3, "/hang": 2.0}.get(self.path.split("?")[0], 0)
        time.sleep(delay)
        status = 500 if self.path.startswith("/fail") else 200
        body = b'{"hello":"world"}\n'
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    do_HEAD = do_GET
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
PY
python3 "$work/backend.py" "$back" >/dev/null 2>&1 &
pids+=($!)

# A TLS frontend as an edge HAProxy has one (HTTP/2 and HTTP/1.1 by ALPN), beside a cleartext one.
openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost -keyout "$work/site.key" \
    -out "$work/site.crt" >/dev/null 2>&1
cat "$work/site.crt" "$work/site.key" > "$work/site.pem"

cat > "$work/haproxy.cfg" <<CFG
global
    maxconn 256
defaults
    mode http
    timeout connect 2s
    timeout client 10s
    timeout server 1s
frontend fe_edge
    bind 127.0.0.1:$tls ssl crt $work/site.pem alpn h2,http/1.1
    bind 127.0.0.1:$front
    default_backend be_app
backend be_app
    server app1 127.0.0.1:$back
CFG
haproxy -db -f "$work/haproxy.cfg" &
hap=$!
pids+=($hap)

TRACETAP_TARGET_PIDS=$hap TRACETAP_ADMIN_ADDR=127.0.0.1:$admin OTEL_BSP_SCHEDULE_DELAY=200 \
    "$tracetap" > "$work/spans.jsonl" 2> "$work/agent.log" &
agent=$!
pids+=($agent)

for _ in $(seq 1 100); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$admin/readyz")" = 200 ] && break
    kill -0 "$agent" 2>/dev/null || { cat "$work/agent.log" >&2; exit 1; }
    sleep 0.1
done
echo "tracetap is ready (admin on 127.0.0.1:$admin); HAProxy serves https://127.0.0.1:$tls and http://127.0.0.1:$front"
echo "requests: HTTP/2 over TLS (one continuing a trace), HTTP/1.1 over TLS, a slow one, a failing one,"
echo "one the server never answers in time, and one HAProxy rejects as malformed"

tp='traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'
curl -sk --max-time 10 -o /dev/null --http2 "https://127.0.0.1:$tls/api/hello"
curl -sk --max-time 10 -o /dev/null --http2 -H "$tp" "https://127.0.0.1:$tls/api/hello?from=demo"
curl -sk --max-time 10 -o /dev/null --http1.1 "https://127.0.0.1:$tls/api/hello"
curl -s --max-time 10 -o /dev/null "http://127.0.0.1:$front/slow"
curl -s --max-time 10 -o /dev/null "http://127.0.0.1:$front/fail"
curl -s --max-time 10 -o /dev/null "http://127.0.0.1:$front/hang"
printf 'GET /\x01 HTTP/1.1\r\n\r\n' | timeout 2 python3 -c '
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(sys.stdin.buffer.read())
s.recv(4096)' "$front" || true
sleep 1
metrics=$(curl -s "http://127.0.0.1:$admin/metrics")
kill -TERM "$agent"
# It stops within seconds once its queue is flushed; never wait for ever.
for _ in $(seq 1 100); do kill -0 "$agent" 2>/dev/null || break; sleep 0.1; done
kill -KILL "$agent" 2>/dev/null || true
wait "$agent" 2>/dev/null || true

echo
[ -s "$work/spans.jsonl" ] || { echo "no spans: agent log follows" >&2; cat "$work/agent.log"; exit 1; }
echo "Spans, one waterfall per trace (tracetap view $work/spans.jsonl: the JSON lines tracetap"
echo "wrote on its stdout, as it does with no OTLP endpoint set):"
"$tracetap" view "$work/spans.jsonl"
echo "First span in full:"
head -n 1 "$work/spans.jsonl" | python3 -m json.tool
echo
echo "Metrics (from /metrics before shutdown):"
grep -E '^tracetap_(requests_total|spans_built|events_captured|events_lost)' <<<"$metrics" || true
