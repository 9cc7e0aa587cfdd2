#!/usr/bin/python3
"""Session forks (issue 33): what a fork costs, in time and cache bytes.

    /usr/bin/python3 tests/bench/fork_bench.py [--forks 200]

On the demo model (E = 256, h = 4, fp32 cache): a session of 4096 tokens is
forked --forks times (each fork closed at once); the median and p99 round
trip of ForkSession from a Python client on the same machine are an upper
bound of the server's cost. Then 8 forks of a 2048-token prefix each append
64 tokens; mha_session_cache_bytes against one session of 2112 tokens gives
the cache ratio. Prints one JSON object.
"""

import argparse
import json
import os
import re
import statistics
import sys
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
from mha_client import MhaClient  # noqa: E402
from mha_local_server import LocalServer  # noqa: E402

E = 256


def cache_bytes(server):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                timeout=10) as r:
        text = r.read().decode()
    return float(re.search(r"^mha_session_cache_bytes (\S+)$", text, re.M).group(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mha_server", default=os.path.join(ROOT, "build", "mha_server"))
    parser.add_argument("--forks", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    out = {}
    with LocalServer(args.mha_server, os.path.join(ROOT, "models"), []) as server, \
            MhaClient(server.target(), timeout=120) as client:
        with client.open_session("demo") as session:
            for _ in range(4):
                session.append(rng.standard_normal((1, 1024, E)).astype(np.float32))
            times = []
            for i in range(args.forks):
                start = time.perf_counter()
                fork = session.fork()
                times.append(time.perf_counter() - start)
                fork.close()
            times.sort()
            out["fork_4096_round_trip_us"] = {
                "median": statistics.median(times) * 1e6,
                "p99": times[int(len(times) * 0.99) - 1] * 1e6}
        base = cache_bytes(server)
        with client.open_session("demo") as one:
            one.append(rng.standard_normal((1, 2112, E)).astype(np.float32))
            single = cache_bytes(server) - base
        with client.open_session("demo") as parent:
            parent.append(rng.standard_normal((1, 2048, E)).astype(np.float32))
            forks = [parent.fork() for _ in range(8)]
            for f in forks:
                f.append(rng.standard_normal((1, 64, E)).astype(np.float32))
            eight = cache_bytes(server) - base
            for f in forks:
                f.close()
        out["one_session_2112_bytes"] = single
        out["eight_forks_of_2048_plus_64_bytes"] = eight
        out["ratio"] = eight / single
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
