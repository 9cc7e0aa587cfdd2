#!/usr/bin/python3
"""What the server costs around the engine: its CPU time per request under
load against the engine's CPU time per request on the same kind of batch.

    /usr/bin/python3 tests/bench/server_cpu.py [--flags="--workers=2 ..."]

1. Starts mha_server on the demo model (with --flags), runs `mha_client load
   --concurrency 64 --len_range 16:128`, and reads the server's user + system
   time from /proc/PID/stat before and after: server CPU per request. The
   batches it formed (mha_batch_requests) give their mean size.
2. Runs mha_bench on ragged self-attention batches of that many requests
   (lengths uniform in [16, 128], the demo model's E and h) with the
   threads per engine call the server's calls get under this load (a call's
   share of the cores: calls run side by side): wall time x threads /
   requests is the engine's
   CPU time per request (a spinning OpenMP thread counts, as it does in the
   server).
Prints one JSON object. The client runs on the same cores, so compare the
ratio, not the absolute numbers, across runs and machines.
"""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
from mha_local_server import LocalServer  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """User + system CPU seconds of process `pid` (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def metric_sum(text, name, model="demo"):
    pattern = re.compile(rf'^{name}\{{[^}}]*model="{model}"[^}}]*\}} (\S+)$', re.M)
    return sum(float(v) for v in pattern.findall(text))


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def measure_server(args, flags):
    # The report's own arguments have no client flags.
    client_flags = shlex.split(getattr(args, "client_flags", ""))
    with LocalServer(args.mha_server, os.path.join(ROOT, "models"), flags) as server:
        # A short warm-up: primitives for the lengths, workspaces grown.
        subprocess.run([args.mha_client, "load", f"--target={server.target()}", "--model=demo",
                        f"--concurrency={args.concurrency}", "--len_range=16:128",
                        "--duration=2s", *client_flags], check=True, capture_output=True)
        before_metrics = scrape(server.metrics_port)
        before_cpu = cpu_seconds(server.process.pid)
        start = time.monotonic()
        out = subprocess.run([args.mha_client, "load", f"--target={server.target()}",
                              "--model=demo", f"--concurrency={args.concurrency}",
                              "--len_range=16:128", f"--duration={args.seconds}s",
                              *client_flags],
                             check=True, capture_output=True, text=True)
        wall = time.monotonic() - start
        cpu = cpu_seconds(server.process.pid) - before_cpu
        after_metrics = scrape(server.metrics_port)
    diff = {name: metric_sum(after_metrics, name) - metric_sum(before_metrics, name)
            for name in ("mha_requests_total", "mha_batch_requests_sum",
                         "mha_batch_requests_count")}
    requests = diff["mha_requests_total"]
    return {"server_cpu_us": 1e6 * cpu / requests, "requests": requests,
            "rps": requests / wall, "server_cores": cpu / wall,
            "mean_batch": diff["mha_batch_requests_sum"] /
            max(1.0, diff["mha_batch_requests_count"]),
            "client_summary": out.stdout.strip().splitlines()[-1] if out.stdout else ""}


def measure_engine(args, batch, threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([args.mha_bench, "--json", "--dtypes=f32", f"--rounds={args.rounds}",
                          f"--ragged_batch={batch}", "--shapes=ragged"],
                         check=True, capture_output=True, text=True, env=env).stdout
    ms = [json.loads(line)["ms"] for line in out.splitlines() if line.startswith("{")]
    ms.sort()
    median = ms[len(ms) // 2]
    return {"engine_ms": median, "engine_cpu_us": 1e3 * median * threads / batch}


def threads_under_load(flags):
    """Threads per engine call of a server started with `flags` under load:
    --intra_op_threads when set, else a call's share of the cores (calls run
    side by side: cores / --workers, 2 workers by default)."""
    values = dict(f.lstrip("-").split("=", 1) for f in flags if "=" in f)
    if int(values.get("intra_op_threads", 0)) > 0:
        return int(values["intra_op_threads"])
    return max(1, os.cpu_count() // int(values.get("workers", 2)))


def measure(args, flags=(), threads=0):
    """One run: the server's and the engine's CPU per request and their ratio.
    `args` names the binaries and the load (see main); `threads` is the
    threads per engine call (0: what the flags give under load)."""
    server = measure_server(args, list(flags))
    threads = threads or threads_under_load(flags)
    engine = measure_engine(args, max(1, round(server["mean_batch"])), threads)
    return {"flags": " ".join(flags), "client_flags": getattr(args, "client_flags", ""),
            **server, **engine,
            "ratio": server["server_cpu_us"] / engine["engine_cpu_us"]}


def main():
    build = os.path.join(ROOT, "build")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mha_server", default=os.path.join(build, "mha_server"))
    parser.add_argument("--mha_client", default=os.path.join(build, "mha_client"))
    parser.add_argument("--mha_bench", default=os.path.join(build, "mha_bench"))
    parser.add_argument("--flags", default="", help="extra mha_server flags")
    parser.add_argument("--client_flags", default="",
                        help="extra `mha_client load` flags (--stream: one Stream per client)")
    parser.add_argument("--threads", type=int, default=0,
                        help="threads per engine call in the server under load "
                             "(0: --intra_op_threads, or cores / --workers)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(json.dumps(measure(args, args.flags.split(), args.threads)))


if __name__ == "__main__":
    main()
