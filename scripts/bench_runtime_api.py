#!/usr/bin/env python3
"""What one runtime API read (`show servers state`, the agent's only command) costs HAProxy.

Starts Debian's HAProxy with BACKENDS backends of SLOTS `server-template` slots each (the HAProxy
Kubernetes Ingress Controller's shape: 42 slots per backend by default), reads the table READS
times over its stats socket, and reports the answer's size and HAProxy's CPU time per read
(utime + stime from /proc/PID/stat). Needs root (HAProxy, a socket in /tmp).

    BACKENDS=100 SLOTS=42 READS=200 python3 scripts/bench_runtime_api.py
"""
import os
import socket
import subprocess
import tempfile
import time

BACKENDS = int(os.environ.get("BACKENDS", "100"))
SLOTS = int(os.environ.get("SLOTS", "42"))
READS = int(os.environ.get("READS", "200"))


def main():
    with tempfile.TemporaryDirectory() as d:
        sock = os.path.join(d, "admin.sock")
        cfg = os.path.join(d, "h.cfg")
        pidfile = os.path.join(d, "pid")
        with open(cfg, "w") as f:
            f.write(f"global\n    stats socket {sock} mode 600 level admin\n")
            f.write("defaults\n    mode http\n    timeout connect 2s\n    timeout client 10s\n    timeout server 10s\n")
            # A frontend without a bind: the table is all this measures.
            f.write("frontend fe\n    default_backend be0\n")
            for b in range(BACKENDS):
                f.write(f"backend be{b}\n    server-template SRV_ {SLOTS} 127.0.0.1:1 disabled\n")
        subprocess.run(["haproxy", "-D", "-p", pidfile, "-f", cfg], check=True)
        try:
            for _ in range(50):
                if os.path.exists(sock):
                    break
                time.sleep(0.05)
            pid = open(pidfile).read().strip()
            tick = os.sysconf("SC_CLK_TCK")

            def cpu():
                fields = open(f"/proc/{pid}/stat").read().split(")")[1].split()
                return (int(fields[11]) + int(fields[12])) / tick

            def read():
                c = socket.socket(socket.AF_UNIX)
                c.connect(sock)
                c.sendall(b"show servers state\n")
                n = 0
                while True:
                    chunk = c.recv(65536)
                    if not chunk:
                        return n
                    n += len(chunk)

            size = read()
            c0, t0 = cpu(), time.time()
            for _ in range(READS):
                read()
            c1, t1 = cpu(), time.time()
            print(
                f"{BACKENDS * SLOTS} servers: answer {size} bytes; HAProxy CPU per read "
                f"{(c1 - c0) / READS * 1000:.2f} ms; wall per read {(t1 - t0) / READS * 1000:.2f} ms"
            )
        finally:
            subprocess.run(["kill", open(pidfile).read().strip()])


if __name__ == "__main__":
    main()
