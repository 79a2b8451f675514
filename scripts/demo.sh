#!/usr/bin/env bash
# `make demo`: a local HAProxy and backend on loopback, traced by tracetap; prints the spans.
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
front=$(free_port); back=$(free_port); admin=$(free_port)

mkdir -p "$work/www/api" && echo '{"hello":"world"}' > "$work/www/api/hello"
python3 -m http.server "$back" --bind 127.0.0.1 --directory "$work/www" >/dev/null 2>&1 &
pids+=($!)

cat > "$work/haproxy.cfg" <<CFG
global
    maxconn 256
defaults
    mode http
    timeout connect 2s
    timeout client 10s
    timeout server 10s
frontend fe_main
    bind 127.0.0.1:$front
    default_backend be_app
backend be_app
    server app1 127.0.0.1:$back
CFG
haproxy -db -f "$work/haproxy.cfg" &
hap=$!
pids+=($hap)

TRACETAP_TARGET_PIDS=$hap TRACETAP_ADMIN_ADDR=127.0.0.1:$admin OTEL_BSP_SCHEDULE_DELAY=200 \
    ./target/debug/tracetap > "$work/spans.jsonl" 2> "$work/agent.log" &
agent=$!
pids+=($agent)

for _ in $(seq 1 100); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$admin/readyz")" = 200 ] && break
    kill -0 "$agent" 2>/dev/null || { cat "$work/agent.log" >&2; exit 1; }
    sleep 0.1
done
echo "tracetap is ready (admin on 127.0.0.1:$admin); sending requests to HAProxy on 127.0.0.1:$front"

curl -s -o /dev/null "http://127.0.0.1:$front/api/hello"
curl -s -o /dev/null -H 'traceparent: 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01' "http://127.0.0.1:$front/api/hello?from=demo"
curl -s -o /dev/null "http://127.0.0.1:$front/missing"
curl -s -o /dev/null -I "http://127.0.0.1:$front/api/hello"
sleep 1
metrics=$(curl -s "http://127.0.0.1:$admin/metrics")
kill -TERM "$agent"; wait "$agent" || true

echo
[ -s "$work/spans.jsonl" ] || { echo "no spans: agent log follows" >&2; cat "$work/agent.log"; exit 1; }
echo "Spans, one waterfall per trace (tracetap view $work/spans.jsonl: the JSON lines tracetap"
echo "wrote on its stdout, as it does with no OTLP endpoint set):"
./target/debug/tracetap view "$work/spans.jsonl"
echo "First span in full:"
head -n 1 "$work/spans.jsonl" | python3 -m json.tool
echo
echo "Metrics (from /metrics before shutdown):"
grep -E '^tracetap_(requests_total|spans_built|events_captured|events_lost)' <<<"$metrics" || true
