#!/bin/bash
# What HAProxy configuration primitives cost per request: the measurements behind the shape of the
# `tracetap haproxy-snippet` lines (docs/PERFORMANCE.md, "Propagation lines").
#
# An untraced HAProxy (nbthread 1, CPU 0) proxies to an origin that answers by itself (CPU 1);
# h2load offers 12 000 req/s for ROUND_SECONDS; the figure is HAProxy's CPU time per request
# (utime+stime from /proc/PID/stat). Each variant repeats one primitive N times (10 or 5, distinct
# names) so that its cost stands out of the run-to-run noise; the variants rotate over ROUNDS
# rounds and the medians are printed with the cost per repetition against `none`.
# Usage: ROUNDS=3 ROUND_SECONDS=6 scripts/bench/config_costs.sh   (root not needed; ports 18080-1)
set -euo pipefail
ROUNDS=${ROUNDS:-3}
ROUND_SECONDS=${ROUND_SECONDS:-6}
work=$(mktemp -d /tmp/tracetap-config-costs-XXXX)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
cd "$work"
front=18080 origin=18081

cat > origin.cfg <<EOF
global
    nbthread 1
defaults
    mode http
    timeout connect 2s
    timeout client 30s
    timeout server 30s
frontend origin
    bind 127.0.0.1:$origin
    http-request return status 200 content-type text/plain string ok
EOF
taskset -c 1 haproxy -db -f origin.cfg >/dev/null 2>&1 &

# Variants: name, repetitions, and one rule with N where each repetition's number goes.
declare -A RULE REPS
add() { RULE[$1]=$3; REPS[$1]=$2; }
add none 1 ''
add set-var-int 10 'http-request set-var(txn.vN) int(3)'
add set-header-constant 10 'http-request set-header x-tN 1'
add acl-var-found 10 'http-request set-header x-tN 1 if { var(txn.never) -m found }'
add header-from-uuid 5 'http-request set-header x-tN %[uuid]'
add header-from-date-uuid-regsub 5 "http-request set-header x-tN \"00-%[date,hex,lower]%[uuid,regsub('^(.{8})-(.{4})-(.{4})-(.{4})-(.{12})','\\4\\5-\\1\\2\\3-03')]\""
add header-from-four-fields 5 'http-request set-header x-tN "00-%[date,hex,lower]%[uuid,field(2,-)]%[uuid,field(5,-)]-%[uuid,field(3,-)]%[uuid,field(5,-)]-03"'
add var-then-header-from-it 5 'http-request set-var(txn.uN) uuid
http-request set-header x-tN "00-%[var(txn.uN),field(5,-)]%[var(txn.uN),field(1,-)]-%[var(txn.uN),field(4,-)]-03"'
order=(none set-var-int set-header-constant acl-var-found header-from-uuid header-from-date-uuid-regsub header-from-four-fields var-then-header-from-it)

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

measure() {
    local name=$1 rules="" i
    for i in $(seq 1 "${REPS[$name]}"); do
        [ -n "${RULE[$name]}" ] && rules+=$(printf '%s\n' "${RULE[$name]}" | sed "s/N/$i/g; s/^/    /")$'\n'
    done
    cat > "$name.cfg" <<EOF
global
    nbthread 1
    maxconn 1000
defaults
    mode http
    timeout connect 2s
    timeout client 30s
    timeout server 30s
frontend fe
    bind 127.0.0.1:$front
$rules    default_backend be
backend be
    http-reuse always
    server origin 127.0.0.1:$origin
EOF
    taskset -c 0 haproxy -db -f "$name.cfg" >"$name.log" 2>&1 &
    local hp=$!
    sleep 0.5
    taskset -c 1 h2load --h1 -c32 -D 2 "http://127.0.0.1:$front/x" >/dev/null 2>&1
    local t0 t1 out n
    t0=$(cpu_ticks $hp)
    out=$(taskset -c 1 h2load --h1 -c32 --rps=375 -D "$ROUND_SECONDS" "http://127.0.0.1:$front/x" 2>&1)
    t1=$(cpu_ticks $hp)
    n=$(echo "$out" | grep -oP 'requests: \d+ total, \d+ started, \K\d+(?= done)')
    kill $hp; wait $hp 2>/dev/null || true
    echo "$name $(( (t1 - t0) * 10000 )) $n"   # CPU in µs (100 ticks a second), requests
}

results=$work/results
for r in $(seq 1 "$ROUNDS"); do
    for i in "${!order[@]}"; do
        name=${order[$(( (i + r) % ${#order[@]} ))]}
        measure "$name" | tee -a "$results" >&2
    done
done
python3 - "$results" <<'EOF'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    name, cpu_us, n = line.split()
    runs[name].append(int(cpu_us) / int(n))
base = statistics.median(runs["none"])
print("| variant | µs/req (median [range]) | cost per repetition |")
print("|---|---|---|")
for name, v in runs.items():
    reps = {"set-var-int": 10, "set-header-constant": 10, "acl-var-found": 10}.get(name, 5)
    per = "–" if name == "none" else f"{(statistics.median(v) - base) / reps * 1000:.0f} ns"
    print(f"| {name} | {statistics.median(v):.2f} [{min(v):.2f}–{max(v):.2f}] | {per} |")
EOF
