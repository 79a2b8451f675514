#!/usr/bin/env python3
"""End-to-end overhead benchmark (`make bench`): what tracing costs HAProxy.

Setup (sized for a 2-CPU machine). The traced HAProxy (`nbthread 1`) is pinned to CPU 0 and proxies
with `http-reuse always` to an origin that answers by itself (`http-request return`): a symlink of
haproxy under another command name, so it is never a target. The load generators, the origin, the
span sinks and the agent share CPU 1 (taskset), so what is left on CPU 0 is HAProxy's own work plus
whatever the tracing adds inside HAProxy's process: the eBPF probes running in its syscalls, or the
OpenTracing filter and its tracer's writer thread.

Modes, every one on a freshly started traced HAProxy (same pinning, same configuration; the OT
modes add only the `filter` line):
- `none`: no tracing.
- `floor`: the agent with TRACETAP_PROBE_MODE=floor (the same hooks attached with programs that
  return at once), otherwise as `ratio 1.0`: the least any syscall-tracepoint probe can cost.
- `ratio 1.0` / `ratio 0.0`: the agent with head sampling `traceidratio` 1.0 / 0.0, spans sent over
  OTLP/HTTP to `otlp-discard`. A sampler that keeps nothing (`traceidratio` 0.0 among them) loads no
  probe at all, so `ratio 0.0` measures an agent that traces nothing.
- `parent`: the agent as it starts by default (`parentbased_always_on`) on the plain requests of
  `none`, which carry no `traceparent`: every request is kept, and the probes look at each
  frontend read for a `traceparent` they could drop it by.
- `unsampled none` / `unsampled parent` (unless BENCH_UNSAMPLED=0): every request carries a
  `traceparent` whose sampled flag is off; untraced, and with the agent at `parentbased_always_on`
  (its default), which drops every request by that flag after the probes copied and the agent
  parsed it: what a sampled-out request costs when the sampler can keep some. `unsampled parent` is
  also taken against `unsampled none` of the same round (the same traffic).
- `ot 100` / `ot 0`: HAProxy's own OpenTracing filter (Debian's haproxy is built with USE_OT) with
  the Datadog tracer plugin from `libdd-opentracing0`, configured like HAProxy's `cmp` speed test
  (scripts/bench/ot-cmp.cfg), rate-limit 100 and 0, sending to a stand-in Datadog trace agent
  (scripts/bench/dd_agent.py) that counts the spans it receives. The filter opens the plugin at
  "<working directory>/<plugin>", so this HAProxy runs in the work directory, where a symlink to
  the plugin is made. The filter's spans are counted where they arrive; the Datadog tracer keeps
  at most 7000 traces between its writes (once a second) and drops the rest inside HAProxy, so
  above 7000 req/s fewer than one trace per request arrives, and the report says so.
- `tail 1%` (only with BENCH_TAIL=1): head ratio 1.0, tail sampling keeps errors and 1%.
- `lines none` / `lines ratio 1.0` (unless BENCH_LINES=0): the same HAProxy with the lines `tracetap
  haproxy-snippet` prints (parentbased_traceidratio 1.0) in its frontend, untraced and with the agent
  (same sampler): what propagating trace context in HAProxy's configuration costs. Each is taken
  against `none` / `ratio 1.0` of the same round.
- BENCH_MODES (comma-separated) runs a subset (`none` always runs; the idle and zero-loss checks
  only with `ratio 1.0`, the filter check only with an `ot` mode).
- The edge (unless BENCH_EDGE=0): the same HAProxy terminating TLS (`bind ... ssl crt ... alpn
  h2,http/1.1`, a P-256 certificate made for the run), untraced and with the agent at ratio 1.0:
  `tls none` / `tls ratio 1.0` with HTTP/1.1 clients, `h2 none` / `h2 ratio 1.0` with HTTP/2
  clients (4 concurrent streams per connection), `tls floor`: the floor (below) with the TLS
  probes' points attached too, to programs that return at once (what the uprobe traps alone
  cost: a breakpoint exception each, which no BPF statistic counts), and `tls entry`: ratio 1.0 with the TLS probes
  at the functions' entries and returns (`TRACETAP_TLS_PROBES=entry`, what a TLS library the agent
  does not recognise gets) instead of on their internal call. Their load is h2load over TLS (wrk does not speak
  HTTP/2): saturated `-c64` for BENCH_SECONDS, and a fixed EDGE_RATE (6 000 req/s: TLS costs
  HAProxy several times what cleartext does, and the rate must stay below saturation). Their
  ratios are taken against the same family's untraced run of the same round; the TLS probes'
  cost includes what BPF statistics do not show, the uprobe traps, which only HAProxy's CPU per
  request does.

The modes alternate: BENCH_ROUNDS rounds (default 5), round r starting at mode r, so no mode always
runs first or after the same neighbour. In each run, after a 1 s warm-up:
(a) saturated: `wrk -t1 -c64` for BENCH_SECONDS (default 8): req/s;
(b) fixed offered rate: `h2load --h1 -c32 --rps=375` (12 000 req/s) for BENCH_SECONDS. At the same
    load, HAProxy's CPU time per request (utime+stime of all its threads from /proc/PID/stat) is
    the capacity measure: 1 / (CPU per request) is how many requests its core can carry, and the
    untraced-over-traced ratio of it is the share of capacity tracing leaves. It starts once the
    agent has read what the saturated run left in the ring. Saturated req/s also
    falls when the agent takes CPU 1 from the load generator; CPU per request does not. Also the
    agent's CPU per request, ring-buffer losses and spans per request (exported by the agent, or
    received by the stand-in Datadog agent), and h2load's failures.
The probes' ns per request (tracetap_probe_run_time_ns_total, from the kernel's BPF run-time
statistics) is taken during (a) only: the bench turns the statistics on (BPF_ENABLE_STATS) for the
saturated run and off before the fixed-rate run, because they add two clock reads to every probe
run (about 20 ns each time, on every syscall of every process), which would inflate the capacity
figures of the traced modes and of the floor.
Once per bench: the agent's CPU with HAProxy idle (% of a core over BENCH_IDLE_SECONDS, default
10), and a zero-loss check at 20 000 req/s sustained (ratio 1.0, BENCH_ZERO_LOSS_SECONDS, default
twice BENCH_SECONDS).

Ratios are taken per round against the same round's `none` run; the table gives the median over
rounds with its range [min-max]. Progress goes to stderr, one markdown table and its notes to
stdout. Needs root (the agent loads eBPF programs), haproxy, wrk, h2load (nghttp2-client),
libdd-opentracing0, and the release builds of tracetap and otlp-discard (`make bench` does all
that).
"""

import ctypes
import json
import os
import re
import shutil
import signal
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGENT = os.path.join(ROOT, "target/release/tracetap")
DISCARD = os.path.join(ROOT, "target/release/otlp-discard")
OT_CFG_TEMPLATE = os.path.join(ROOT, "scripts/bench/ot-cmp.cfg")
DD_AGENT = os.path.join(ROOT, "scripts/bench/dd_agent.py")
SECONDS = int(os.environ.get("BENCH_SECONDS", "8"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
IDLE_SECONDS = int(os.environ.get("BENCH_IDLE_SECONDS", "10"))
ZERO_LOSS_SECONDS = int(os.environ.get("BENCH_ZERO_LOSS_SECONDS", str(2 * SECONDS)))
TAIL = os.environ.get("BENCH_TAIL", "0") == "1"
EDGE = os.environ.get("BENCH_EDGE", "1") == "1"
EDGE_RATE = 6_000  # req/s offered in the TLS and HTTP/2 modes
WRK_CONNECTIONS = 64
H2LOAD_CLIENTS = 32
FIXED_RATE = 12_000  # req/s offered in all, h2load --rps is per client
ZERO_LOSS_RATE = 20_000
AGENT_SETTLE = 0.5  # s after the load before reading the agent's CPU and counters
FLUSH_WAIT = 1.5  # s after the load before reading HAProxy and the sinks (the Datadog tracer writes every 1 s)
CLK_TCK = os.sysconf("SC_CLK_TCK")
NCPU = os.cpu_count() or 2
OTHER_CPUS = ",".join(str(c) for c in range(1, NCPU)) if NCPU > 1 else "0"

LINES = os.environ.get("BENCH_LINES", "1") == "1"
EDGE_MODES = ["tls none", "tls floor", "tls ratio 1.0", "tls entry", "h2 none", "h2 ratio 1.0"]
LINES_MODES = ["lines none", "lines ratio 1.0"]
UNSAMPLED = os.environ.get("BENCH_UNSAMPLED", "1") == "1"
UNSAMPLED_MODES = ["unsampled none", "unsampled parent"]
# The parent every request of the `unsampled` modes carries: valid, sampled flag off.
UNSAMPLED_TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
MODES = (["none", "floor", "ratio 1.0", "parent", "ratio 0.0", "ot 100", "ot 0"] + (["tail 1%"] if TAIL else [])
         + (LINES_MODES if LINES else []) + (UNSAMPLED_MODES if UNSAMPLED else []) + (EDGE_MODES if EDGE else []))
if os.environ.get("BENCH_MODES"):
    # A subset, for a quicker run (the untraced run is always kept: every ratio is taken against it).
    wanted = [m.strip() for m in os.environ["BENCH_MODES"].split(",")]
    unknown = [m for m in wanted if m not in MODES]
    if unknown:
        print(f"bench_overhead: BENCH_MODES names unknown modes {unknown}; known: {MODES}", file=sys.stderr)
        sys.exit(2)
    MODES = [m for m in MODES if m == "none" or m in wanted]
# The sampler of the `lines` modes, for both the printed lines and the agent.
LINES_SAMPLER = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1.0"}
LABELS = {
    "none": "no tracing",
    "floor": "tracetap floor (empty programs)",
    "ratio 1.0": "tracetap, ratio 1.0",
    "ratio 0.0": "tracetap, ratio 0.0",
    "parent": "tracetap, `parentbased_always_on` (the default), requests without `traceparent`",
    "ot 100": "OpenTracing filter (Datadog tracer, `cmp` scopes), rate-limit 100",
    "ot 0": "same filter, rate-limit 0",
    "tail 1%": "tracetap, ratio 1.0, tail keeps errors + 1%",
    "tls none": "TLS, HTTP/1.1: no tracing",
    "tls floor": "TLS, HTTP/1.1: tracetap floor (empty programs, TLS probes' traps included)",
    "tls ratio 1.0": "TLS, HTTP/1.1: tracetap, ratio 1.0",
    "tls entry": "TLS, HTTP/1.1: tracetap, ratio 1.0, `TRACETAP_TLS_PROBES=entry`",
    "h2 none": "TLS, HTTP/2: no tracing",
    "h2 ratio 1.0": "TLS, HTTP/2: tracetap, ratio 1.0",
    "lines none": "no tracing, with the `tracetap haproxy-snippet` lines",
    "unsampled none": "no tracing, requests with an unsampled `traceparent`",
    "unsampled parent": "tracetap, `parentbased_always_on`, requests with an unsampled `traceparent`",
    "lines ratio 1.0": "tracetap, ratio 1.0, with the `tracetap haproxy-snippet` lines",
}
OT_RATE = {"ot 100": "100.0", "ot 0": "0.0"}


def fail(msg):
    print(f"bench_overhead: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def tail_of(path, lines=20):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


class BpfStats:
    """Turns on the kernel's BPF run-time statistics while held (`bpf(BPF_ENABLE_STATS)`, x86_64)."""

    SYS_BPF, BPF_ENABLE_STATS, BPF_STATS_RUN_TIME = 321, 32, 0

    def __enter__(self):
        libc = ctypes.CDLL(None, use_errno=True)
        attr = ctypes.c_uint32(self.BPF_STATS_RUN_TIME)
        self.fd = libc.syscall(self.SYS_BPF, self.BPF_ENABLE_STATS, ctypes.byref(attr), ctypes.sizeof(attr))
        if self.fd < 0:
            fail(f"cannot enable BPF run-time statistics: {os.strerror(ctypes.get_errno())}")
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc, what, logfile=None, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            fail(f"{what} exited with status {proc.returncode} before listening on port {port}"
                 + (f"; its output ({logfile}):\n{tail_of(logfile)}" if logfile else ""))
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    fail(f"{what} does not listen on port {port} after {timeout}s" + (f"; its output:\n{tail_of(logfile)}" if logfile else ""))


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def peak_rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def http_get(url, timeout=5):
    return urllib.request.urlopen(url, timeout=timeout).read().decode()


def agent_metrics(admin):
    text = http_get(f"http://{admin}/metrics")
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(tracetap_\w+) (\d+)$", text, re.M)}


def dd_stats(port):
    return json.loads(http_get(f"http://127.0.0.1:{port}/stats"))


def run_tool(args, what):
    try:
        res = subprocess.run(["taskset", "-c", OTHER_CPUS] + args, capture_output=True, text=True, timeout=SECONDS * 3 + 60)
    except subprocess.TimeoutExpired:
        fail(f"{what} did not finish: {' '.join(args)}")
    if res.returncode != 0:
        fail(f"{what} failed (status {res.returncode}): {' '.join(args)}\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return res.stdout


def wrk(port, seconds, headers=()):
    out = run_tool(["wrk", "-t1", f"-c{WRK_CONNECTIONS}", f"-d{seconds}s", *headers, f"http://127.0.0.1:{port}/bench"], "wrk")
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    if not rps or not total:
        fail(f"cannot read wrk's output:\n{out}")
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = (int(non2xx.group(1)) if non2xx else 0) + (sum(int(g) for g in sock.groups()) if sock else 0)
    return float(rps.group(1)), int(total.group(1)), errors


def edge_family(mode):
    """`tls` or `h2` for the edge modes (TLS frontend), None for the cleartext ones."""
    family = mode.split()[0]
    return family if family in ("tls", "h2") else None


def h2load_args(family):
    """h2load's protocol options and URL scheme for a mode family."""
    return {None: (["--h1"], "http"), "tls": (["--h1"], "https"), "h2": (["-m4"], "https")}[family]


def h2load_saturated(port, seconds, family):
    """Saturated h2load over TLS (the edge modes' counterpart of wrk): (req/s, requests, errors)."""
    opts, scheme = h2load_args(family)
    out = run_tool(["h2load"] + opts + [f"-c{WRK_CONNECTIONS}", "-D", str(seconds), f"{scheme}://127.0.0.1:{port}/bench"], "h2load")
    req = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored, (\d+) timeout", out)
    if not req:
        fail(f"cannot read h2load's output:\n{out}")
    ok, failed, errored = int(req.group(4)), int(req.group(5)), int(req.group(6))
    return ok / seconds, ok, failed + errored


def h2load(port, total_rate, seconds, family=None, headers=()):
    per_client = total_rate // H2LOAD_CLIENTS
    opts, scheme = h2load_args(family)
    out = run_tool(["h2load"] + opts + [f"-c{H2LOAD_CLIENTS}", f"--rps={per_client}", "-D", str(seconds), *headers,
                    f"{scheme}://127.0.0.1:{port}/bench"], "h2load")
    req = re.search(r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored, (\d+) timeout", out)
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    if not req or not codes:
        fail(f"cannot read h2load's output:\n{out}")
    total, _, done, ok, failed, errored, timeout = (int(g) for g in req.groups())
    if ok == 0:
        fail(f"h2load completed no request:\n{out}")
    return {"requests": ok, "rate": ok / seconds, "failed": failed + errored + timeout + (total - done),
            "non2xx": done - int(codes.group(1))}


class Bench:
    def __init__(self, work):
        self.work = work
        self.procs = []
        self.front_port = free_port()
        self.origin_port = free_port()
        self.sink_port = free_port()
        self.dd_port = free_port()
        self.plugin = None

    def spawn(self, args, name, cpus, env=None, cwd=None):
        logfile = os.path.join(self.work, f"{name}.log")
        with open(logfile, "ab") as out:
            proc = subprocess.Popen(["taskset", "-c", cpus] + args, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, cwd=cwd)
        self.procs.append(proc)
        return proc, logfile

    def stop(self, proc, sig=signal.SIGTERM, timeout=30):
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self):
        for p in list(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in list(self.procs):
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs.clear()

    def write_configs(self):
        w = self.work
        # The origin runs under another command name, so it is never a target.
        os.symlink(shutil.which("haproxy"), os.path.join(w, "origin"))
        # The filter opens "<cwd>/<plugin>": HAProxy runs in the work directory with this symlink.
        os.symlink(self.plugin, os.path.join(w, os.path.basename(self.plugin)))
        common = """global
    nbthread 1
    maxconn 1000
defaults
    mode http
    timeout connect 2s
    timeout client 30s
    timeout server 30s
"""
        with open(os.path.join(w, "origin.cfg"), "w") as f:
            f.write(common + f"""frontend origin
    bind 127.0.0.1:{self.origin_port}
    http-request return status 200 content-type text/plain string ok
""")
        with open(os.path.join(w, "dd-tracer.json"), "w") as f:
            json.dump({"service": "haproxy-bench", "agent_host": "127.0.0.1", "agent_port": self.dd_port}, f)
        with open(OT_CFG_TEMPLATE) as f:
            template = string.Template(f.read())
        for mode, rate in OT_RATE.items():
            with open(os.path.join(w, f"ot-{rate}.cfg"), "w") as f:
                f.write(template.substitute(plugin=os.path.basename(self.plugin),
                                            tracer_config=os.path.join(w, "dd-tracer.json"), rate_limit=rate))
        # The edge modes' certificate and configuration: the same proxy behind a TLS bind.
        pem = os.path.join(w, "cert.pem")
        res = subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                              "-days", "2", "-subj", "/CN=localhost", "-keyout", pem + ".key", "-out", pem],
                             capture_output=True, text=True)
        if res.returncode != 0:
            fail(f"openssl could not make the edge modes' certificate:\n{res.stderr}")
        with open(pem, "a") as cert, open(pem + ".key") as key:
            cert.write(key.read())
        with open(os.path.join(w, "haproxy-tls.cfg"), "w") as f:
            f.write(common + f"""frontend fe_bench
    bind 127.0.0.1:{self.front_port} ssl crt {pem} alpn h2,http/1.1
    default_backend be_origin
backend be_origin
    http-reuse always
    server origin 127.0.0.1:{self.origin_port}
""")
        # The propagation lines, as a user prints them (`lines` modes).
        res = subprocess.run([AGENT, "haproxy-snippet"], env={**LINES_SAMPLER, "PATH": os.environ.get("PATH", "")},
                             capture_output=True, text=True)
        if res.returncode != 0:
            fail(f"tracetap haproxy-snippet failed:\n{res.stderr}")
        lines = "".join(f"    {line}\n" for line in res.stdout.splitlines() if line and not line.startswith("#"))
        # One HAProxy configuration for every mode; the OT modes add the filter line, the `lines`
        # modes the propagation lines, nothing else.
        for name, filt in [("haproxy", ""), ("haproxy-lines", lines)] + [
                (f"haproxy-ot-{r}", f"    filter opentracing id bench-ot config {os.path.join(w, f'ot-{r}.cfg')}\n")
                for r in OT_RATE.values()]:
            with open(os.path.join(w, f"{name}.cfg"), "w") as f:
                f.write(common + f"""frontend fe_bench
    bind 127.0.0.1:{self.front_port}
{filt}    default_backend be_origin
backend be_origin
    http-reuse always
    server origin 127.0.0.1:{self.origin_port}
""")

    def start_support(self):
        w = self.work
        origin, lf = self.spawn([os.path.join(w, "origin"), "-db", "-f", os.path.join(w, "origin.cfg")], "origin", OTHER_CPUS)
        wait_port(self.origin_port, origin, "the origin HAProxy", lf)
        sink, lf = self.spawn([DISCARD, f"127.0.0.1:{self.sink_port}"], "otlp-discard", OTHER_CPUS)
        wait_port(self.sink_port, sink, "otlp-discard", lf)
        dd, lf = self.spawn([sys.executable, DD_AGENT, str(self.dd_port)], "dd-agent", OTHER_CPUS)
        wait_port(self.dd_port, dd, "the stand-in Datadog agent", lf)

    def start_haproxy(self, mode):
        cfg = os.path.join(self.work, f"haproxy-ot-{OT_RATE[mode]}.cfg" if mode in OT_RATE
                           else "haproxy-tls.cfg" if edge_family(mode)
                           else "haproxy-lines.cfg" if mode in LINES_MODES else "haproxy.cfg")
        proc, lf = self.spawn(["haproxy", "-db", "-f", cfg], "haproxy", "0", cwd=self.work)
        what = "the traced HAProxy" + (" with the OpenTracing filter (did it load the plugin?)" if mode in OT_RATE else "")
        wait_port(self.front_port, proc, what, lf)
        return proc, lf

    def start_agent(self, mode, haproxy_pid):
        admin = f"127.0.0.1:{free_port()}"
        env = {
            "PATH": os.environ.get("PATH", ""),
            "TRACETAP_TARGET_PIDS": str(haproxy_pid),
            "TRACETAP_ADMIN_ADDR": admin,
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.sink_port}",
            "OTEL_TRACES_SAMPLER": "traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.0" if mode == "ratio 0.0" else "1.0",
            "TRACETAP_LOG": "warn",
        }
        if mode == "floor":
            env["TRACETAP_PROBE_MODE"] = "floor"
        if mode == "lines ratio 1.0":
            env.update(LINES_SAMPLER)
        if mode in ("parent", "unsampled parent"):
            env["OTEL_TRACES_SAMPLER"] = "parentbased_always_on"
            del env["OTEL_TRACES_SAMPLER_ARG"]
        if mode == "tls entry":
            env["TRACETAP_TLS_PROBES"] = "entry"
        if mode == "tail 1%":
            env.update({"TRACETAP_TAIL_ENABLED": "true", "TRACETAP_TAIL_RATIO": "0.01",
                        "TRACETAP_STATE_DIR": os.path.join(self.work, "state")})
        proc, lf = self.spawn([AGENT], "agent", OTHER_CPUS, env=env)
        deadline = time.time() + 30
        while True:
            try:
                if urllib.request.urlopen(f"http://{admin}/readyz", timeout=1).status == 200:
                    return proc, admin
            except OSError:
                pass
            if proc.poll() is not None:
                fail(f"the agent ({mode}) exited with status {proc.returncode} before it was ready; its log ({lf}):\n{tail_of(lf)}")
            if time.time() > deadline:
                fail(f"the agent ({mode}) was not ready after 30 s (GET http://{admin}/readyz); its log ({lf}):\n{tail_of(lf)}")
            time.sleep(0.1)

    def drained(self, admin, timeout=60):
        """The agent's metrics once it has handled what a saturated run left in the ring (its count
        of records read stops moving), so that the fixed-rate run measures its own work only."""
        last = agent_metrics(admin)
        deadline = time.time() + timeout
        while time.time() < deadline:
            time.sleep(0.5)
            now = agent_metrics(admin)
            if now.get("tracetap_events_captured_total") == last.get("tracetap_events_captured_total"):
                return now
            last = now
        fail(f"the agent was still reading records {timeout} s after the saturated run")

    def check_ot(self):
        """Fails fast unless the filter at rate-limit 100 loads the plugin and its spans arrive."""
        haproxy, lf = self.start_haproxy("ot 100")
        before = dd_stats(self.dd_port)
        for _ in range(20):
            http_get(f"http://127.0.0.1:{self.front_port}/check")
        time.sleep(FLUSH_WAIT + 0.5)
        got = dd_stats(self.dd_port)["spans"] - before["spans"]
        self.stop(haproxy)
        if got == 0:
            fail(f"the OpenTracing filter (rate-limit 100) sent no span to the stand-in Datadog agent for 20 requests; "
                 f"HAProxy's output ({lf}):\n{tail_of(lf)}")
        log(f"OpenTracing filter check: {got} spans for 20 requests")

    def run(self, mode):
        family = edge_family(mode)
        haproxy, hlf = self.start_haproxy(mode)
        agent = admin = None
        headers = ["-H", f"traceparent: {UNSAMPLED_TRACEPARENT}"] if mode in UNSAMPLED_MODES else []
        if mode not in ("none", "tls none", "h2 none", "lines none", "unsampled none") and mode not in OT_RATE:
            agent_mode = "tls entry" if mode == "tls entry" else mode.removeprefix(f"{family} ") if family else mode
            agent, admin = self.start_agent(agent_mode, haproxy.pid)
        row = {}
        saturate = (lambda secs: h2load_saturated(self.front_port, secs, family)) if family else (lambda secs: wrk(self.front_port, secs, headers))
        saturate(1)  # warm-up
        time.sleep(0.5)
        m0 = agent_metrics(admin) if agent else {}
        with BpfStats():
            row["rps"], sat_requests, row["wrk_errors"] = saturate(SECONDS)
        time.sleep(1.0)  # the agent drains what the saturated run left, and publishes the probe times
        if agent:
            m1 = self.drained(admin)
            d = lambda k: m1.get(k, 0) - m0.get(k, 0)
            row["probe_ns"] = d("tracetap_probe_run_time_ns_total") / sat_requests
            row["probe_runs"] = d("tracetap_probe_runs_total") / sat_requests
            row["sat_lost"] = m1.get("tracetap_events_lost_ring_full_total", 0) - m0.get("tracetap_events_lost_ring_full_total", 0)
            a_cpu0, a0 = cpu_seconds(agent.pid), m1
            if family and m1.get("tracetap_tls_processes", 0) < 1:
                # Without its TLS probes, a TLS mode would measure the cleartext hooks only.
                fail(f"the agent ({mode}) attached no TLS probes to HAProxy (tracetap_tls_processes is 0)")
        dd0 = dd_stats(self.dd_port)
        h_cpu0 = cpu_seconds(haproxy.pid)
        load = h2load(self.front_port, EDGE_RATE if family else FIXED_RATE, SECONDS, family, headers)
        n = load["requests"]
        row.update(rate=load["rate"], h2_failed=load["failed"], h2_non2xx=load["non2xx"])
        time.sleep(AGENT_SETTLE)
        if agent:
            row["agent_us"] = (cpu_seconds(agent.pid) - a_cpu0) * 1e6 / n
            a1 = agent_metrics(admin)
            d = lambda k: a1.get(k, 0) - a0.get(k, 0)
            row["lost"] = d("tracetap_events_lost_ring_full_total")
        time.sleep(FLUSH_WAIT - AGENT_SETTLE)
        row["haproxy_us"] = (cpu_seconds(haproxy.pid) - h_cpu0) * 1e6 / n
        if agent:
            a2 = agent_metrics(admin)
            d = lambda k: a2.get(k, 0) - a0.get(k, 0)
            row["spans_per_req"] = d("tracetap_spans_exported_total") / n
            row["disagreements"] = d("tracetap_sampling_disagreements_total")
            row["sampled_out_per_req"] = d("tracetap_requests_sampled_out_total") / n
            row["dropped"] = d("tracetap_spans_dropped_queue_full_total") + d("tracetap_spans_dropped_export_failed_total")
            if mode == "tail 1%":
                row["shed_traces"] = d("tracetap_tail_shed_traces_total")
        if mode in OT_RATE:
            dd1 = dd_stats(self.dd_port)
            row["spans_per_req"] = (dd1["spans"] - dd0["spans"]) / n
            row["traces_per_req"] = (dd1["traces"] - dd0["traces"]) / n
            row["bytes_per_req"] = (dd1["bytes"] - dd0["bytes"]) / n
            if mode == "ot 100" and dd1["spans"] == dd0["spans"]:
                fail(f"the OpenTracing filter at rate-limit 100 sent no span during {n} requests; HAProxy's output ({hlf}):\n{tail_of(hlf)}")
        if agent:
            row["agent_rss_mib"] = peak_rss_kib(agent.pid) / 1024
            self.stop(agent)
        if haproxy.poll() is not None:
            fail(f"the traced HAProxy ({mode}) died during the run; its output ({hlf}):\n{tail_of(hlf)}")
        self.stop(haproxy)
        return row

    def extras(self):
        """Agent idle CPU, then the zero-loss check at 20 000 req/s, with the agent at ratio 1.0."""
        haproxy, hlf = self.start_haproxy("ratio 1.0")
        agent, admin = self.start_agent("ratio 1.0", haproxy.pid)
        time.sleep(2.0)
        c0 = cpu_seconds(agent.pid)
        time.sleep(IDLE_SECONDS)
        idle_pct = (cpu_seconds(agent.pid) - c0) * 100 / IDLE_SECONDS
        log(f"agent idle: {idle_pct:.2f}% of a core over {IDLE_SECONDS} s")
        wrk(self.front_port, 1)
        time.sleep(1.0)
        m0 = agent_metrics(admin)
        load = h2load(self.front_port, ZERO_LOSS_RATE, ZERO_LOSS_SECONDS)
        time.sleep(FLUSH_WAIT)
        m1 = agent_metrics(admin)
        d = lambda k: m1.get(k, 0) - m0.get(k, 0)
        zero = {"rate": load["rate"], "failed": load["failed"] + load["non2xx"],
                "lost": d("tracetap_events_lost_ring_full_total"),
                "spans_per_req": d("tracetap_spans_exported_total") / load["requests"],
                "dropped": d("tracetap_spans_dropped_queue_full_total") + d("tracetap_spans_dropped_export_failed_total")}
        log(f"zero-loss check: {zero}")
        self.stop(agent)
        self.stop(haproxy)
        return idle_pct, zero


def check_prerequisites():
    for tool in ("haproxy", "wrk", "h2load", "taskset", "dpkg", "openssl"):
        if not shutil.which(tool):
            hint = "apt-get install nghttp2-client" if tool == "h2load" else "run `make bench` (it installs what is missing)"
            fail(f"{tool} is missing: {hint}")
    for path in (AGENT, DISCARD):
        if not os.access(path, os.X_OK):
            fail(f"{path} is missing: `cargo build --release -p tracetap -p tracetap-tests --bin tracetap --bin otlp-discard`")
    if os.geteuid() != 0:
        fail("run as root: the agent loads eBPF programs")
    if "OpenTracing support" not in subprocess.run(["haproxy", "-vv"], capture_output=True, text=True).stdout:
        fail("this haproxy is built without OpenTracing (USE_OT) support")
    files = subprocess.run(["dpkg", "-L", "libdd-opentracing0"], capture_output=True, text=True)
    plugin = [p for p in files.stdout.split() if p.endswith("/libdd_opentracing_plugin.so")]
    if files.returncode != 0 or not plugin or not os.path.exists(plugin[0]):
        fail("the Datadog OpenTracing plugin (libdd_opentracing_plugin.so) is missing: apt-get install libdd-opentracing0")
    return plugin[0]


def med_range(values, fmt):
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    if len(values) == 1:
        return format(values[0], fmt)
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)}–{format(max(values), fmt)}]"


def machine():
    model = "unknown CPU"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    version = lambda args, rx: (re.search(rx, subprocess.run(args, capture_output=True, text=True).stdout + "") or [None, "?"])[1]
    haproxy = version(["haproxy", "-v"], r"version (\S+)")
    dd = version(["dpkg-query", "-W", "-f", "${Version}", "libdd-opentracing0"], r"(\S+)")
    h2 = version(["h2load", "--version"], r"nghttp2/(\S+)")
    return (f"{NCPU} CPUs ({model}), kernel {os.uname().release}; HAProxy {haproxy}, "
            f"libdd-opentracing0 {dd}, h2load {h2}")


def edge_report(runs):
    """The TLS and HTTP/2 modes: each traced run against its family's untraced run of the same round."""
    print(f"\nThe edge: the same HAProxy terminating TLS; saturated `h2load -c{WRK_CONNECTIONS} -D {SECONDS}` "
          f"(`--h1` for HTTP/1.1, `-m4` for HTTP/2), fixed rate `h2load -c{H2LOAD_CLIENTS} --rps={EDGE_RATE // H2LOAD_CLIENTS}` "
          f"({EDGE_RATE:,} req/s offered). Probe ns/req counts the eBPF programs (the syscall and TLS probes), not the "
          "uprobe traps, which the capacity ratio includes.\n")
    print(f"| mode | saturated req/s ratio | HAProxy CPU µs/req at {EDGE_RATE // 1000}k/s | capacity ratio (CPU/req untraced ÷ traced) "
          f"| agent CPU µs/req at {EDGE_RATE // 1000}k/s | probe ns/req (saturated) | ring losses | spans/req |")
    print("|---|---|---|---|---|---|---|---|")
    # A BENCH_MODES subset runs some of the edge modes only (a family needs its untraced run).
    present = [m for m in EDGE_MODES if m in runs]
    families = [f for f in ("tls", "h2") if f"{f} none" in runs]
    for family in families:
        base = runs[f"{family} none"]
        rounds = range(len(base))
        for m in [m for m in present if edge_family(m) == family]:
            rows = runs[m]
            col = lambda k, rows=rows: [row.get(k) for row in rows] if k in rows[0] else []
            sat = [rows[r]["rps"] / base[r]["rps"] for r in rounds]
            cap = [base[r]["haproxy_us"] / rows[r]["haproxy_us"] for r in rounds]
            losses = col("lost")
            print(f"| {LABELS[m]} | {med_range(sat, '.3f')} | {med_range(col('haproxy_us'), '.1f')} | {med_range(cap, '.3f')} "
                  f"| {med_range(col('agent_us'), '.2f')} | {med_range(col('probe_ns'), '.0f')} | {sum(losses) if losses else '–'} "
                  f"| {med_range(col('spans_per_req'), '.2f')} |")
    print()
    bad = {m: (sum(r["h2_failed"] for r in runs[m]), sum(r["h2_non2xx"] for r in runs[m]), sum(r["wrk_errors"] for r in runs[m])) for m in present}
    print("- Failures (fixed-rate h2load failed/errored/timed out, non-2xx, saturated h2load failed/errored): "
          + ", ".join(f"{m} {a}/{b}/{c}" for m, (a, b, c) in bad.items()) + ".")
    print("- Untraced: " + ", ".join(
        f"{f} {statistics.median(r['rps'] for r in runs[f + ' none']):,.0f} req/s saturated" for f in families) + "; completed at the "
          "fixed rate (median req/s): " + ", ".join(f"{m} {statistics.median(r['rate'] for r in runs[m]):,.0f}" for m in present) + ".")


def report(runs, idle_pct, zero):
    edge = {m: runs.pop(m) for m in EDGE_MODES if m in runs}
    modes = list(runs)
    none = runs["none"]
    rounds = range(len(none))
    sat = {m: [runs[m][r]["rps"] / none[r]["rps"] for r in rounds] for m in modes}
    cap = {m: [none[r]["haproxy_us"] / runs[m][r]["haproxy_us"] for r in rounds] for m in modes}
    col = lambda m, k: [row.get(k) for row in runs[m]] if k in runs[m][0] else []
    print(f"Machine: {machine()}.")
    print(f"Command: `BENCH_ROUNDS={ROUNDS} BENCH_SECONDS={SECONDS} make bench` (scripts/bench_overhead.py); "
          f"{len(modes) + len(edge)} modes alternated over {ROUNDS} rounds, each round starting at the next mode; "
          f"saturated: `wrk -t1 -c{WRK_CONNECTIONS} -d{SECONDS}s`; fixed rate: "
          f"`h2load --h1 -c{H2LOAD_CLIENTS} --rps={FIXED_RATE // H2LOAD_CLIENTS} -D {SECONDS}` ({FIXED_RATE:,} req/s offered). "
          "Medians over rounds, [min–max]; ratios against the same round's untraced run. Ring losses: summed over the "
          "fixed-rate runs. Spans/req: exported by the agent, or received by the stand-in Datadog agent from the filter.\n")
    print(f"| mode | saturated req/s ratio | HAProxy CPU µs/req at {FIXED_RATE // 1000}k/s | capacity ratio (CPU/req untraced ÷ traced) "
          f"| agent CPU µs/req at {FIXED_RATE // 1000}k/s | probe ns/req (saturated) | ring losses | spans/req |")
    print("|---|---|---|---|---|---|---|---|")
    for m in modes:
        losses = col(m, "lost")
        print(f"| {LABELS[m]} | {'1.000' if m == 'none' else med_range(sat[m], '.3f')} | {med_range(col(m, 'haproxy_us'), '.1f')} "
              f"| {'1.000' if m == 'none' else med_range(cap[m], '.3f')} | {med_range(col(m, 'agent_us'), '.2f')} "
              f"| {med_range(col(m, 'probe_ns'), '.0f')} | {sum(losses) if losses else '–'} | {med_range(col(m, 'spans_per_req'), '.2f')} |")
    print()
    print(f"- Untraced HAProxy: {statistics.median(r['rps'] for r in none):,.0f} req/s saturated, "
          f"{statistics.median(r['haproxy_us'] for r in none):.1f} µs CPU per request at {FIXED_RATE:,} req/s (medians).")
    if "ot 100" in runs and "ratio 1.0" in runs:
        vs = [runs["ot 100"][r]["haproxy_us"] / runs["ratio 1.0"][r]["haproxy_us"] for r in rounds]
        print(f"- Capacity against HAProxy's OpenTracing filter at full sampling (tracetap ratio 1.0 ÷ filter rate-limit 100, "
              f"CPU/req of the filter ÷ tracetap's): {med_range(vs, '.2f')}.")
    if "ot 0" in runs and "ratio 0.0" in runs:
        vs = [runs["ot 0"][r]["haproxy_us"] / runs["ratio 0.0"][r]["haproxy_us"] for r in rounds]
        print(f"- Same at sampling 0 (tracetap ratio 0.0, which loads no probe, ÷ filter rate-limit 0): {med_range(vs, '.2f')}.")
    if "ot 100" in runs:
        r100 = runs["ot 100"]
        traces = [r["traces_per_req"] for r in r100]
        per_trace = [r["spans_per_req"] / r["traces_per_req"] for r in r100 if r["traces_per_req"]]
        print(f"- The filter at rate-limit 100 delivered per request: {med_range([r['spans_per_req'] for r in r100], '.2f')} spans, "
              f"{med_range(traces, '.3f')} traces, {med_range([r['bytes_per_req'] for r in r100], '.0f')} payload bytes "
              f"({med_range(per_trace, '.1f')} spans per trace) to the stand-in Datadog agent. The tracer's writer thread runs "
              "in HAProxy's process (on CPU 0) and is counted in HAProxy's CPU.")
        if statistics.median(traces) < 0.99:
            print(f"  Fewer than one trace per request arrived: the Datadog tracer queues at most 7000 traces between its "
                  f"writes (once a second) and drops the rest, so at {FIXED_RATE:,} req/s it delivers about "
                  f"{min(1.0, 7000 / FIXED_RATE):.2f} of the traces, and its CPU per request leaves out encoding and "
                  "sending the dropped ones.")
    if "floor" in runs and "ratio 1.0" in runs:
        vs = [runs["ratio 1.0"][r]["probe_ns"] / runs["floor"][r]["probe_ns"] if runs["floor"][r]["probe_ns"] else None for r in rounds]
        vs0 = [runs["ratio 0.0"][r]["probe_ns"] / runs["floor"][r]["probe_ns"] if runs["floor"][r]["probe_ns"] else None for r in rounds] if "ratio 0.0" in runs else []
        print(f"- Probe time against the floor: ratio 1.0 {med_range(vs, '.2f')}x, ratio 0.0 {med_range(vs0, '.2f')}x; "
              f"probe runs per request: " + ", ".join(f"{m} {med_range(col(m, 'probe_runs'), '.1f')}" for m in modes if col(m, "probe_runs")) + ".")
    if "floor" in runs and statistics.median(r["spans_per_req"] for r in runs["floor"]) > 0:
        print("- WARNING: the floor mode exported spans: this agent does not know TRACETAP_PROBE_MODE=floor, "
              "so the floor row measured the full probes.")
    print(f"- Offered {FIXED_RATE:,} req/s, completed (median req/s): "
          + ", ".join(f"{m} {statistics.median(r['rate'] for r in runs[m]):,.0f}" for m in modes) + ".")
    bad = {m: (sum(r["h2_failed"] for r in runs[m]), sum(r["h2_non2xx"] for r in runs[m]), sum(r["wrk_errors"] for r in runs[m])) for m in modes}
    if any(any(v) for v in bad.values()):
        print("- Failures (h2load failed/errored/timed out, h2load non-2xx, wrk errors and non-2xx): "
              + ", ".join(f"{m} {a}/{b}/{c}" for m, (a, b, c) in bad.items()) + ".")
    else:
        print("- No failed, errored, timed-out or non-2xx request in any h2load or wrk run.")
    sat_lost = {m: sum(r["sat_lost"] for r in runs[m]) for m in modes if "sat_lost" in runs[m][0]}
    dropped = {m: sum(r["dropped"] for r in runs[m]) for m in modes if "dropped" in runs[m][0]}
    if sat_lost:
        print("- Ring losses during the saturated runs: " + ", ".join(f"{m} {v}" for m, v in sat_lost.items())
              + "; spans dropped by the agent at the fixed rate: " + ", ".join(f"{m} {v}" for m, v in dropped.items()) + ".")
    if "lines none" in runs or "lines ratio 1.0" in runs:
        parts = []
        for lines_mode, base in (("lines none", "none"), ("lines ratio 1.0", "ratio 1.0")):
            if lines_mode in runs and base in runs:
                vs = [runs[lines_mode][r]["haproxy_us"] / runs[base][r]["haproxy_us"] for r in rounds]
                parts.append(f"{base} {med_range(vs, '.3f')}")
        print("- Propagation lines (`tracetap haproxy-snippet`, parentbased_traceidratio 1.0): HAProxy CPU per request "
              "with the lines ÷ without, same round: " + ", ".join(parts) + ".")
        if "lines ratio 1.0" in runs:
            print(f"  Sampling disagreements counted by the agent: {sum(r['disagreements'] for r in runs['lines ratio 1.0'])}.")
    if "unsampled none" in runs and "unsampled parent" in runs:
        vs = [runs["unsampled none"][r]["haproxy_us"] / runs["unsampled parent"][r]["haproxy_us"] for r in rounds]
        print("- Requests with an unsampled parent, `parentbased_always_on`: capacity against the same traffic untraced "
              f"(`unsampled none`), same round: {med_range(vs, '.3f')}; sampled out by the agent per request: "
              f"{med_range(col('unsampled parent', 'sampled_out_per_req'), '.2f')}.")
    if "tail 1%" in runs:
        print(f"- tail 1%: traces shed by the tail stage per run: {[r['shed_traces'] for r in runs['tail 1%']]}.")
        print(f"- tail 1%: agent peak RSS (MiB) per run: {[round(r['agent_rss_mib']) for r in runs['tail 1%']]}.")
        if "ratio 1.0" in runs:
            rounds = range(min(len(runs["tail 1%"]), len(runs["ratio 1.0"])))
            vs = [runs["tail 1%"][r]["agent_us"] / runs["ratio 1.0"][r]["agent_us"] for r in rounds]
            print(f"- tail 1%: agent CPU per request, tail over head sampling alone (ratio 1.0), same round: "
                  f"{med_range(vs, '.2f')} (per round: {', '.join(f'{v:.2f}' for v in vs)}).")
    if zero is None:
        print("- Agent idle and the zero-loss check: not run (BENCH_MODES without `ratio 1.0`).")
        zero = {}
    else:
        print(f"- Agent idle (ratio 1.0, HAProxy idle): {idle_pct:.2f}% of a core over {IDLE_SECONDS} s.")
    if zero:
        print(f"- Zero-loss check (ratio 1.0, {ZERO_LOSS_RATE:,} req/s offered for {ZERO_LOSS_SECONDS} s, "
          f"`h2load --h1 -c{H2LOAD_CLIENTS} --rps={ZERO_LOSS_RATE // H2LOAD_CLIENTS}`): {zero['rate']:,.0f} req/s completed, "
          f"{zero['lost']} ring losses, {zero['failed']} failed requests, {zero['spans_per_req']:.2f} spans exported/req, "
          f"{zero['dropped']} spans dropped.")
    print("- Each run's saturated req/s: " + "; ".join(f"{m} {[round(r['rps']) for r in runs[m]]}" for m in modes) + ".")
    if edge:
        edge_report(edge)


def main():
    plugin = check_prerequisites()
    work = tempfile.mkdtemp(prefix="tracetap-bench-")
    bench = Bench(work)
    bench.plugin = plugin
    signal.signal(signal.SIGTERM, lambda *_: fail("terminated"))
    ok = False
    try:
        bench.write_configs()
        bench.start_support()
        if any(m in OT_RATE for m in MODES):
            bench.check_ot()
        idle_pct, zero = bench.extras() if "ratio 1.0" in MODES else (None, None)
        runs = {m: [] for m in MODES}
        for r in range(ROUNDS):
            order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
            for mode in order:
                row = bench.run(mode)
                runs[mode].append(row)
                shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
                log(f"round {r + 1}/{ROUNDS} {mode:9}: {shown}")
        report(runs, idle_pct, zero)
        ok = True
    finally:
        bench.stop_all()
        if ok:
            shutil.rmtree(work, ignore_errors=True)
        else:
            log(f"bench_overhead: logs and configurations kept in {work}")


if __name__ == "__main__":
    main()
