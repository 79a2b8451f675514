#!/usr/bin/env python3
"""Where the probes' time goes inside HAProxy (`make profile-probes`): `bench_overhead.py`'s setup
(HAProxy `nbthread 1` pinned to CPU 0, everything else on the other CPUs) at its fixed offered rate,
with `perf record` sampling CPU 0 by the clock (this machine has no hardware counters) while the
load runs. A sample is 1/PROFILE_HZ s of CPU 0, idle included, so a symbol's samples over the
requests served give its nanoseconds per request directly, without the BPF run-time statistics
(which add two clock reads to every probe run).

Per mode (PROFILE_MODES, comma-separated, default `floor,ratio 1.0,parent,unsampled parent`;
`bench_overhead.py` says what each is), PROFILE_ROUNDS runs (default 5, the modes rotated as the
bench rotates them) of PROFILE_SECONDS (default 8) each, and one table row of medians over the
runs with their ranges:
- HAProxy µs/req: its CPU time (utime+stime from /proc) per request during the profile;
- probes: everything under the tracepoints' BPF dispatch (`bpf_trace_run2`, children included),
  then its parts: the dispatch itself, the programs' own code (`bpf_prog_*` other than the scan's
  loop callback), the frontend head scan (`bpf_prog_*_scan_round`; `_scan_word` up to
  a81548a), user-memory copies (`bpf_probe_read_user` and what it calls),
  ring-buffer helpers, and hash-map lookups. The scan's loop itself (the calls into its
  callback) counts as the programs' code.
With PROFILE_BROWSER=1, every request also carries a browser's headers (see BROWSER_HEADERS).
With PROFILE_BASE (the path of another build of the agent, say of an earlier commit), every
traced mode also runs with that build, as `<mode> @base`, in the same rotation: a baseline measured
in the same run.
The parts do not add up to the whole: smaller helpers (the pid, the clock, array lookups the JIT
does not inline) are left out. Sampling error is about sqrt(samples): a part of 100 samples is
known to within about 10%.
Needs root, haproxy, h2load, perf (linux-perf) and the release builds `make bench` makes.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_overhead as bench  # noqa: E402  (the setup is the bench's own)

HZ = int(os.environ.get("PROFILE_HZ", "4999"))
ROUNDS = int(os.environ.get("PROFILE_ROUNDS", "5"))
SECONDS = int(os.environ.get("PROFILE_SECONDS", "8"))
MODES = [m.strip() for m in os.environ.get("PROFILE_MODES", "floor,ratio 1.0,parent,unsampled parent").split(",")]
BASE = os.environ.get("PROFILE_BASE")
# PROFILE_BROWSER=1: every request also carries the headers of a browser (a long user agent, accept
# lists, a cookie), a 400-byte head where h2load's own is 150 bytes: what the head scan costs on
# the heads real clients send, where long values take most of its rounds.
BROWSER_HEADERS = [
    "user-agent: Mozilla/5.0 (X11; Linux x86_64; rv:128.0) Gecko/20100101 Firefox/128.0",
    "accept: text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8",
    "accept-language: en-US,en;q=0.5",
    "cookie: session=abcdef0123456789abcdef0123456789; theme=dark",
] if os.environ.get("PROFILE_BROWSER", "0") == "1" else []
BASE_SUFFIX = " @base"
TRACED = ["floor", "ratio 1.0", "parent", "unsampled parent", "lines ratio 1.0"]

# (column, how a `perf report --children` line's symbol is matched, which of its counts is taken)
PARTS = [
    ("probes", lambda s: s == "bpf_trace_run2", "children"),
    ("dispatch", lambda s: s == "bpf_trace_run2", "self"),
    ("programs", lambda s: s.startswith("bpf_prog_") and not s.endswith(("_scan_word", "_scan_round")), "self"),
    ("head scan", lambda s: s.startswith("bpf_prog_") and s.endswith(("_scan_word", "_scan_round")), "self"),
    ("user copies", lambda s: s == "bpf_probe_read_user", "children"),
    ("ring", lambda s: "ringbuf" in s, "self"),
    ("hash lookups", lambda s: s in ("lookup_nulls_elem_raw", "__htab_map_lookup_elem", "htab_map_hash"), "self"),
]


def symbol_samples(data):
    """Per symbol, (children, self) sample counts of CPU 0's profile."""
    out = subprocess.run(["perf", "report", "-i", data, "--children", "--sort", "sym", "-g", "none", "--stdio"],
                         capture_output=True, text=True, check=True).stdout
    # perf rounds the sample count (`39K`); the event count is CPU 0's nanoseconds sampled.
    period = re.search(r"# Event count \(approx\.\): (\d+)", out)
    if not period:
        bench.fail(f"cannot read perf report's event count for {data}")
    total = round(int(period.group(1)) * HZ / 1e9)
    counts = {}
    for line in out.splitlines():
        m = re.match(r"\s+([\d.]+)%\s+([\d.]+)%\s+\[[k.]\]\s+(\S+)", line)
        if m:
            children, own, sym = float(m.group(1)), float(m.group(2)), m.group(3)
            prev = counts.get(sym, (0.0, 0.0))
            counts[sym] = (prev[0] + children * total / 100, prev[1] + own * total / 100)
    return total, counts


def profile(b, run_mode, work):
    mode = run_mode.removesuffix(BASE_SUFFIX)
    if mode not in bench.MODES and mode not in TRACED:
        bench.fail(f"profile_probes: unknown mode {mode!r}")
    haproxy, _ = b.start_haproxy(mode)
    headers = ["-H", f"traceparent: {bench.UNSAMPLED_TRACEPARENT}"] if mode in bench.UNSAMPLED_MODES else []
    headers += [arg for header in BROWSER_HEADERS for arg in ("-H", header)]
    agent = None
    if mode in TRACED:
        built = bench.AGENT
        bench.AGENT = BASE if run_mode.endswith(BASE_SUFFIX) else built
        try:
            agent, _ = b.start_agent(mode, haproxy.pid)
        finally:
            bench.AGENT = built
    bench.h2load(b.front_port, bench.FIXED_RATE, 1, None, headers)  # warm-up
    data = os.path.join(work, f"{run_mode.replace(' ', '-')}.perf")
    perf = subprocess.Popen(["perf", "record", "-q", "-C", "0", "-e", "cpu-clock", "-F", str(HZ), "-g",
                             "-o", data, "--", "sleep", str(SECONDS)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.2)  # perf has opened its events
    cpu0 = bench.cpu_seconds(haproxy.pid)
    load = bench.h2load(b.front_port, bench.FIXED_RATE, SECONDS - 1, None, headers)
    cpu = bench.cpu_seconds(haproxy.pid) - cpu0
    if perf.wait() != 0:
        bench.fail(f"perf record failed for {mode}")
    # The requests served while perf sampled: the load ran within the profile, at a fixed rate.
    n = load["requests"]
    total, counts = symbol_samples(data)
    ns = lambda samples: samples * 1e9 / HZ / n  # noqa: E731
    row = {"mode": run_mode, "haproxy_us": cpu * 1e6 / n, "samples": total}
    for name, match, which in PARTS:
        samples = sum(c[0 if which == "children" else 1] for s, c in counts.items() if match(s))
        row[name] = (ns(samples), samples)
    if agent:
        b.stop(agent)
    b.stop(haproxy)
    return row


def main():
    if os.geteuid() != 0:
        bench.fail("profile_probes needs root (the agent loads eBPF programs; perf samples the kernel)")
    for tool in ("haproxy", "h2load", "perf", "taskset"):
        if not shutil.which(tool):
            bench.fail(f"profile_probes needs {tool}")
    work = tempfile.mkdtemp(prefix="tracetap-profile-")
    b = bench.Bench(work)
    # The bench's configurations include the OpenTracing filter's; none is used here.
    b.plugin = os.path.join(work, "no-plugin.so")
    modes = MODES + ([m + BASE_SUFFIX for m in MODES if m in TRACED] if BASE else [])
    if BASE and not os.access(BASE, os.X_OK):
        bench.fail(f"PROFILE_BASE={BASE} is not an executable")
    runs = {mode: [] for mode in modes}
    try:
        b.write_configs()
        b.start_support()
        for r in range(ROUNDS):
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                row = profile(b, mode, work)
                runs[mode].append(row)
                bench.log(f"round {r + 1}/{ROUNDS} {mode}: " + ", ".join(
                    f"{k} {v[0]:.0f}" if isinstance(v, tuple) else f"{k} {v}" for k, v in row.items() if k != "mode"))
    finally:
        b.stop_all()
    names = [name for name, _, _ in PARTS]
    base = f"PROFILE_BASE={BASE} " if BASE else ""
    browser = "PROFILE_BROWSER=1 " if BROWSER_HEADERS else ""
    print(f"Command: `{base}{browser}PROFILE_ROUNDS={ROUNDS} PROFILE_SECONDS={SECONDS} PROFILE_MODES=\"{','.join(MODES)}\" "
          f"python3 scripts/profile_probes.py`; {bench.FIXED_RATE:,} req/s offered for {SECONDS - 1} s per run, CPU 0 "
          f"sampled at {HZ} Hz ({bench.machine()}). ns per request, medians over {ROUNDS} rounds [min–max]:")
    print()
    print("| mode | HAProxy µs/req | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for mode in modes:
        rows = runs[mode]
        print(f"| {mode} | {bench.med_range([r['haproxy_us'] for r in rows], '.1f')} | "
              + " | ".join(bench.med_range([r[k][0] for r in rows], '.0f') for k in names) + " |")
    samples = {k: min(r[k][1] for rows in runs.values() for r in rows if r[k][1]) for k in names
               if any(r[k][1] for rows in runs.values() for r in rows)}
    print()
    print("- Fewest samples behind a non-zero figure, per part: "
          + ", ".join(f"{k} {v:.0f}" for k, v in samples.items()) + ".")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
