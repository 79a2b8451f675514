#!/usr/bin/env python3
"""Instructions per proxied request on the agent's per-record path (`make bench`, after criterion).

The same cases as agent/benches/record_path.rs (ratio 1.0; an unsampled parent under
parentbased_always_on), each run alone in the bench binary (`RECORD_PATH_CASE=<case>`: no
criterion, no timing) under callgrind, which counts the instructions executed inside
`record_path::Path::run`. Unlike time, that count does not move with whatever else runs on the
machine (runs agree to a few hundredths of a percent), so a rise of a few percent is the code's
doing. Each case is compared with its baseline in agent/benches/record_path_budget.txt
(`instructions <case> <count>`): more than 3% over is said plainly (OVER BASELINE), and a change
that makes the path cheaper should lower the baseline in the same commit.

Needs valgrind (`make bench` installs it). Exit status 0 either way: this reports, it does not
fail a build.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET = os.path.join(ROOT, "agent/benches/record_path_budget.txt")
CASES = ["ratio 1.0", "unsampled parent"]
TOLERANCE = 0.03


def bench_binary():
    """Builds the bench (release profile) and returns its executable."""
    out = subprocess.run(
        ["cargo", "bench", "-p", "tracetap", "--bench", "record_path", "--no-run", "--message-format=json"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        msg = json.loads(line)
        if msg.get("reason") == "compiler-artifact" and msg.get("target", {}).get("name") == "record_path" \
                and msg.get("executable"):
            return msg["executable"]
    sys.exit("record_path_instructions: cargo built no record_path bench executable")


def baselines():
    found = {}
    with open(BUDGET) as f:
        for line in f:
            m = re.match(r"instructions (.+) (\d+)$", line.strip())
            if m:
                found[m.group(1)] = int(m.group(2))
    return found


def count(binary, case):
    """Instructions per request of `case`: callgrind's count inside Path::run over the runs the
    binary reports (`runs=R requests=Q` on its standard output)."""
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out", "--toggle-collect=record_path::Path::run",
             binary],
            env={**os.environ, "RECORD_PATH_CASE": case}, capture_output=True, text=True)
        if res.returncode != 0:
            sys.exit(f"record_path_instructions: valgrind failed on {case!r}:\n{res.stderr[-2000:]}")
    collected = re.findall(r"Collected : (\d+)", res.stderr)
    shape = re.search(r"runs=(\d+) requests=(\d+)", res.stdout)
    if not collected or not shape:
        sys.exit(f"record_path_instructions: cannot read the counts of {case!r}:\n{res.stdout}\n{res.stderr[-2000:]}")
    return int(collected[-1]) / (int(shape.group(1)) * int(shape.group(2)))


def main():
    binary = bench_binary()
    base = baselines()
    for case in CASES:
        per_request = count(binary, case)
        if case not in base:
            print(f"record_path {case}: {per_request:,.0f} instructions per request (no baseline in {BUDGET})")
            continue
        change = per_request / base[case] - 1
        verdict = f"OVER BASELINE by {change:.1%}" if change > TOLERANCE else "within baseline"
        print(f"record_path {case}: {per_request:,.0f} instructions per request "
              f"(baseline {base[case]:,}, {change:+.1%}): {verdict}")


if __name__ == "__main__":
    main()
