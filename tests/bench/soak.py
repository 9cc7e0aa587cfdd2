#!/usr/bin/python3
"""Soak benchmark (not part of the test command): sends many requests to a
real mha_server with mha_client's load generator and samples the server's
resident memory every second. Passes when no request failed and RSS grew
less than 5 % from the end of warm-up (the first 10 % of the run) to the end.

    /usr/bin/python3 tests/bench/soak.py --requests 1000000
    /usr/bin/python3 tests/bench/soak.py --requests 100000 --concurrency 16 --len_range 16:64
    /usr/bin/python3 tests/bench/soak.py --mixed 300

--mixed SECONDS: issue 85's mixed load instead, for that long: Attend at 8
clients (L 16-256) beside a loop of sessions that open, take 40 steps of 8
tokens and close. Passes when RSS over the last 10 s is at most 1.05x RSS
over 55-65 s (and no call failed): means over two periods of the trim
thread's 5 s check, as RSS at one instant swings by ~10 MB with it. Prints
RSS 15 s after the load stopped, and what the server says it holds
(mha_memory_held_bytes) with the primitives it made, at 60 s and at the end.

Prints a summary and writes it as JSON to --out (default soak.json).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
from mha_local_server import LocalServer  # noqa: E402


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default=os.path.join(ROOT, "build", "mha_server"))
    parser.add_argument("--client", default=os.path.join(ROOT, "build", "mha_client"))
    parser.add_argument("--repository", default=os.path.join(ROOT, "models"))
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--len_range", default="16:64")
    parser.add_argument("--out", default="soak.json")
    parser.add_argument("--mixed", type=int, default=0, metavar="SECONDS")
    args = parser.parse_args()
    if args.mixed:
        sys.exit(mixed(args))

    samples = []  # (seconds since start, RSS MB)
    with LocalServer(args.server, args.repository) as server:
        pid, start = server.process.pid, time.monotonic()
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                samples.append((time.monotonic() - start, rss_mb(pid)))
                stop.wait(1.0)

        sampler = threading.Thread(target=sample)
        sampler.start()
        load = subprocess.run(
            [args.client, "load", f"--target={server.target()}", "--model=demo", "--json",
             f"--requests={args.requests}", f"--concurrency={args.concurrency}",
             f"--len_range={args.len_range}", "--deadline_ms=30000", "--duration=100000s"],
            capture_output=True, text=True)
        stop.set()
        sampler.join()
        samples.append((time.monotonic() - start, rss_mb(pid)))
    if load.returncode != 0:
        sys.exit(f"load generator failed: {load.stderr}")
    report = json.loads(load.stdout)
    duration = samples[-1][0]
    warm = [mb for t, mb in samples if t >= 0.1 * duration]
    summary = {
        "requests": args.requests, "concurrency": args.concurrency,
        "len_range": args.len_range, "seconds": round(duration, 1),
        "load": report,
        "rss_mb_after_warmup": round(warm[0], 1), "rss_mb_end": round(samples[-1][1], 1),
        "rss_mb_max": round(max(mb for _, mb in samples), 1),
        "server_exit_code": server.exit_code,
    }
    summary["rss_growth_percent"] = round(
        100 * (summary["rss_mb_end"] - summary["rss_mb_after_warmup"])
        / summary["rss_mb_after_warmup"], 2)
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "rss_samples": samples}, f, indent=1)
    print(json.dumps(summary, indent=1))
    failed = sum(report.get("errors", {}).values())
    ok = failed == 0 and summary["rss_growth_percent"] < 5 and server.exit_code == 0
    print("soak", "passed" if ok else "FAILED")
    sys.exit(0 if ok else 1)


def held_mb(server):
    """mha_memory_held_bytes by kind, in MB: what the server says it holds."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as page:
        text = page.read().decode()
    found = re.findall(r'^mha_memory_held_bytes\{kind="(\w+)"\} (\S+)$', text, re.M)
    held = {kind: round(float(value) / 2**20, 1) for kind, value in found}
    made = re.findall(r'^mha_engine_primitive_cache_misses_total\{[^}]*\} (\S+)$', text, re.M)
    held["primitives_made"] = int(sum(float(v) for v in made))
    return held


def mixed(args):
    """Issue 85's mixed soak: returns the exit code."""
    samples, held = [], {}
    with LocalServer(args.server, args.repository) as server:
        pid, start = server.process.pid, time.monotonic()
        target = f"--target={server.target()}"
        stop = threading.Event()
        failed_sessions = []

        def sessions():
            while not stop.is_set():
                run = subprocess.run([args.client, target, "load", "--sessions=1", "--steps=40",
                                      "--step_tokens=8", "--model=demo"], capture_output=True)
                if run.returncode != 0:
                    failed_sessions.append(run.stderr[-300:])

        looping = threading.Thread(target=sessions)
        looping.start()
        load = subprocess.Popen([args.client, target, "load", "--model=demo", "--json",
                                 "--concurrency=8", "--len_range=16:256",
                                 f"--duration={args.mixed}s"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while load.poll() is None:
            time.sleep(1)
            samples.append((time.monotonic() - start, rss_mb(pid)))
            if "at_60s" not in held and samples[-1][0] >= 60:
                held["at_60s"] = held_mb(server)
        held["end"] = held_mb(server)
        stop.set()
        looping.join()
        out, err = load.communicate()
        time.sleep(15)
        after = rss_mb(pid)
    at_60 = next(mb for t, mb in samples if t >= 60)
    report = json.loads(out) if load.returncode == 0 else {"stderr": err}
    summary = {"seconds": args.mixed, "rss_mb_at_60s": round(at_60, 1),
               "rss_mb_end": round(samples[-1][1], 1),
               "rss_mb_max": round(max(mb for _, mb in samples), 1),
               "rss_mb_15s_after": round(after, 1), "session_failures": len(failed_sessions),
               "held_mb": held,
               "load": report}
    summary["end_over_60s"] = round(samples[-1][1] / at_60, 3)
    end = samples[-1][0]
    around_60 = [mb for t, mb in samples if 55 <= t < 65]
    last_10 = [mb for t, mb in samples if t >= end - 10]
    summary["rss_mb_mean_55_65s"] = round(sum(around_60) / len(around_60), 1)
    summary["rss_mb_mean_last_10s"] = round(sum(last_10) / len(last_10), 1)
    summary["last_10s_over_55_65s"] = round(
        summary["rss_mb_mean_last_10s"] / summary["rss_mb_mean_55_65s"], 3)
    with open(args.out, "w") as f:
        json.dump({"summary": summary, "rss_samples": samples}, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "load"}, indent=1))
    ok = (load.returncode == 0 and not failed_sessions and not sum(report.get("errors", {}).values())
          and summary["last_10s_over_55_65s"] <= 1.05)
    print("mixed soak", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    main()
