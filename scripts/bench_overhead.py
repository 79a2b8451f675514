#!/usr/bin/env python3
"""End-to-end overhead benchmark (`make bench`).

HAProxy (nbthread 1, pinned to CPU 0) proxies to an origin HAProxy that answers by itself
(`http-request return`, not traced). wrk (keep-alive, 64 connections) loads it for a fixed time.
Three modes run in alternation, REPEAT times each: no agent, agent at ratio 1.0, agent at ratio
0.0 (spans to an OTLP endpoint that discards). Everything but the traced HAProxy is pinned to the
other CPUs, so the agent's userspace work does not steal HAProxy's core and what remains on it is
the probes' cost.

Reports HAProxy req/s as a ratio of the no-agent runs of the same invocation, HAProxy's own CPU
time per request (utime+stime from /proc, which includes the probes running in its syscalls) and
the capacity ratio it implies, agent CPU per request, probe time per request (kernel BPF run-time
statistics), ring-buffer losses and spans exported per request. Prints a markdown table.

On a 2-CPU machine wrk, the origin and the agent share the second CPU, so req/s also falls when
the agent takes CPU from the load generator; HAProxy's CPU per request is the measure of what the
agent costs HAProxy itself.
"""

import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGENT = os.path.join(ROOT, "target/release/tracetap")
DISCARD = os.path.join(ROOT, "target/release/otlp-discard")
DURATION = int(os.environ.get("BENCH_SECONDS", "10"))
REPEAT = int(os.environ.get("BENCH_REPEAT", "3"))
# BENCH_TAIL=1 adds a mode with tail sampling on (head ratio 1.0, tail: errors + 1%).
TAIL = os.environ.get("BENCH_TAIL", "0") == "1"
CONNECTIONS = int(os.environ.get("BENCH_CONNECTIONS", "64"))
CLK_TCK = os.sysconf("SC_CLK_TCK")
NCPU = os.cpu_count() or 2
OTHER_CPUS = ",".join(str(c) for c in range(1, NCPU)) if NCPU > 1 else "0"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"nothing listens on port {port}")


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def metrics(admin):
    text = urllib.request.urlopen(f"http://{admin}/metrics", timeout=5).read().decode()
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(tracetap_\w+) (\d+)$", text, re.M)}


def wrk(port):
    out = subprocess.run(
        ["taskset", "-c", OTHER_CPUS, "wrk", "-t1", f"-c{CONNECTIONS}", f"-d{DURATION}s", f"http://127.0.0.1:{port}/bench"],
        capture_output=True, text=True, check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    total = int(re.search(r"(\d+) requests in", out).group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return rps, total, int(errors.group(1)) if errors else 0


def main():
    for tool in ("haproxy", "wrk", "taskset"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing: run `make setup`")
    work = tempfile.mkdtemp(prefix="tracetap-bench-")
    procs = []
    try:
        origin_port, front_port, sink_port = free_port(), free_port(), free_port()
        # The origin runs under another command name, so it is never a target.
        origin_bin = os.path.join(work, "origin")
        os.symlink(shutil.which("haproxy"), origin_bin)
        with open(os.path.join(work, "origin.cfg"), "w") as f:
            f.write(f"""global
    nbthread 1
    maxconn 1000
defaults
    mode http
    timeout connect 2s
    timeout client 30s
    timeout server 30s
frontend origin
    bind 127.0.0.1:{origin_port}
    http-request return status 200 content-type text/plain string ok
""")
        with open(os.path.join(work, "haproxy.cfg"), "w") as f:
            f.write(f"""global
    nbthread 1
    maxconn 1000
defaults
    mode http
    timeout connect 2s
    timeout client 30s
    timeout server 30s
frontend fe_bench
    bind 127.0.0.1:{front_port}
    default_backend be_origin
backend be_origin
    http-reuse always
    server origin 127.0.0.1:{origin_port}
""")
        procs.append(subprocess.Popen(["taskset", "-c", OTHER_CPUS, origin_bin, "-db", "-f", os.path.join(work, "origin.cfg")]))
        haproxy = subprocess.Popen(["taskset", "-c", "0", "haproxy", "-db", "-f", os.path.join(work, "haproxy.cfg")])
        procs.append(haproxy)
        procs.append(subprocess.Popen(["taskset", "-c", OTHER_CPUS, DISCARD, f"127.0.0.1:{sink_port}"]))
        for port in (origin_port, front_port, sink_port):
            wait_port(port)
        wrk(front_port)  # warm-up

        runs = {"none": [], "ratio 1.0": [], "ratio 0.0": []}
        if TAIL:
            runs["tail 1%"] = []
        for rep in range(REPEAT):
            for mode in runs:
                agent = None
                admin = f"127.0.0.1:{free_port()}"
                if mode != "none":
                    env = {
                        "PATH": os.environ.get("PATH", ""),
                        "TRACETAP_TARGET_PIDS": str(haproxy.pid),
                        "TRACETAP_ADMIN_ADDR": admin,
                        "TRACETAP_PROBE_STATS": "true",
                        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{sink_port}",
                        "OTEL_TRACES_SAMPLER": "traceidratio",
                        "OTEL_TRACES_SAMPLER_ARG": "0.0" if mode == "ratio 0.0" else "1.0",
                        "TRACETAP_LOG": "warn",
                    }
                    if mode == "tail 1%":
                        # Every request recorded at the head; the tail keeps errors and 1%.
                        env.update({"TRACETAP_TAIL_ENABLED": "true", "TRACETAP_TAIL_RATIO": "0.01",
                                    "TRACETAP_STATE_DIR": os.path.join(work, "state")})
                    agent = subprocess.Popen(["taskset", "-c", OTHER_CPUS, AGENT], env=env)
                    deadline = time.time() + 30
                    while True:
                        try:
                            if urllib.request.urlopen(f"http://{admin}/readyz", timeout=1).status == 200:
                                break
                        except OSError:
                            pass
                        if time.time() > deadline or agent.poll() is not None:
                            sys.exit("agent did not become ready")
                        time.sleep(0.1)
                    before_cpu, before = cpu_seconds(agent.pid), metrics(admin)
                haproxy_cpu = cpu_seconds(haproxy.pid)
                rps, total, errors = wrk(front_port)
                row = {"rps": rps, "requests": total, "errors": errors,
                       "haproxy_us": (cpu_seconds(haproxy.pid) - haproxy_cpu) * 1e6 / total}
                if agent:
                    # Let the agent drain the ring and export (tail: decide too, after its 2 s grace).
                    time.sleep(3.0 if mode == "tail 1%" else 0.5)
                    after_cpu, after = cpu_seconds(agent.pid), metrics(admin)
                    delta = lambda k: after.get(k, 0) - before.get(k, 0)
                    row["agent_us"] = (after_cpu - before_cpu) * 1e6 / total
                    row["probe_ns"] = delta("tracetap_probe_run_time_ns_total") / total
                    row["lost"] = delta("tracetap_events_lost_ring_full_total")
                    row["spans_per_req"] = delta("tracetap_spans_exported_total") / total
                    row["dropped"] = delta("tracetap_spans_dropped_queue_full_total") + delta("tracetap_spans_dropped_export_failed_total")
                    if mode == "tail 1%":
                        row["shed_traces"] = delta("tracetap_tail_shed_traces_total")
                        row["pending_at_end"] = after.get("tracetap_tail_traces_pending", 0)
                    agent.send_signal(signal.SIGTERM)
                    agent.wait(timeout=30)
                runs[mode].append(row)
                print(f"run {rep + 1}/{REPEAT} {mode:9}: {row}", file=sys.stderr)

        base = statistics.median(r["rps"] for r in runs["none"])
        base_us = statistics.median(r["haproxy_us"] for r in runs["none"])
        cpu = subprocess.run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"], capture_output=True, text=True).stdout.strip()
        print(f"Machine: {NCPU} CPUs ({cpu}), kernel {os.uname().release}; {DURATION}s per run, {REPEAT} runs per mode in alternation, "
              f"wrk -t1 -c{CONNECTIONS}; medians.\n")
        print("| mode | HAProxy req/s | req/s ratio | HAProxy CPU us/req | capacity ratio | agent CPU us/req | probe ns/req | ring losses | spans exported/req | spans dropped |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for mode, rows in runs.items():
            med = lambda k: statistics.median(r[k] for r in rows) if k in rows[0] else None
            fmt = lambda v, f: "-" if v is None else format(v, f)
            print(f"| {mode} | {med('rps'):,.0f} | {med('rps') / base:.3f} | {med('haproxy_us'):.2f} | {base_us / med('haproxy_us'):.3f} | {fmt(med('agent_us'), '.2f')} | {fmt(med('probe_ns'), '.0f')} | "
                  f"{fmt(sum(r.get('lost', 0) for r in rows) if mode != 'none' else None, 'd')} | {fmt(med('spans_per_req'), '.3f')} | "
                  f"{fmt(sum(r.get('dropped', 0) for r in rows) if mode != 'none' else None, 'd')} |")
        print("\nEach run's req/s:", {m: [round(r["rps"]) for r in rows] for m, rows in runs.items()})
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
