#!/usr/bin/python3
"""Sessions that branch and move (issue 33): what a fork costs, in time and
cache bytes, and how long a session takes to move between two servers.

    /usr/bin/python3 tests/bench/session_bench.py [--forks 200 --moves 5]

On the demo model (E = 256, h = 4, fp32 cache): a session of 4096 tokens is
forked --forks times (each fork closed at once); the median and p99 round
trip of ForkSession from a Python client on the same machine are an upper
bound of the server's cost. Then 8 forks of a 2048-token prefix each append
64 tokens; mha_session_cache_bytes against one session of 2112 tokens gives
the cache ratio. Last, a 4096-token session of an E = 512, h = 8 model
(fp32: 16 MiB of keys and values) is exported from one server and imported
into another over loopback, --moves times: the median end-to-end time of
Session.export() + MhaClient.import_session(). Prints one JSON object.
"""

import json
import os
import re
import statistics
import sys
import tempfile
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
from bench_args import server_bench_parser  # noqa: E402
from mha_client import MhaClient  # noqa: E402
from mha_local_server import LocalServer  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "tests", "server"))

E = 256


def cache_bytes(server):
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                timeout=10) as r:
        text = r.read().decode()
    return float(re.search(r"^mha_session_cache_bytes (\S+)$", text, re.M).group(1))


def main():
    args = server_bench_parser(forks=200, moves=5).parse_args()
    rng = np.random.default_rng(0)
    out = {}
    with LocalServer(args.mha_server, os.path.join(ROOT, "models"), []) as server, \
            MhaClient(server.target(), timeout=120) as client:
        with client.open_session("demo") as session:
            for _ in range(4):
                session.append(rng.standard_normal((1, 1024, E)).astype(np.float32))
            times, server_us = [], []
            for i in range(args.forks):
                start = time.perf_counter()
                info, call = client._stub.ForkSession.with_call(client._pb.ForkSessionRequest(
                    session_id=session.id, new_session_id=f"f{i}"), timeout=60)
                times.append(time.perf_counter() - start)
                server_us.append(int(dict(call.trailing_metadata())["mha-server-time-us"]))
                client._stub.CloseSession(client._pb.CloseSessionRequest(session_id=info.session_id),
                                          timeout=60)
            times.sort()
            server_us.sort()
            out["fork_4096_round_trip_us"] = {
                "median": statistics.median(times) * 1e6,
                "p99": times[int(len(times) * 0.99) - 1] * 1e6}
            out["fork_4096_server_us"] = {"median": statistics.median(server_us),
                                          "p99": server_us[int(len(server_us) * 0.99) - 1]}
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
    out["move_4096_tokens_e512"] = move(args, rng)
    print(json.dumps(out, indent=1))


def move(args, rng):
    import torch
    from test_server import _write_model
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(512, 8, batch_first=True).eval()
    with tempfile.TemporaryDirectory() as repo:
        _write_model(os.path.join(repo, "big"), {"embed_dim": 512, "num_heads": 8},
                     module.state_dict())
        with LocalServer(args.mha_server, repo, []) as a, LocalServer(args.mha_server, repo, []) as b, \
                MhaClient(a.target(), timeout=120) as ca, MhaClient(b.target(), timeout=120) as cb:
            session = ca.open_session("big")
            for _ in range(4):
                session.append(rng.standard_normal((1, 1024, 512)).astype(np.float32))
            times, size = [], 0
            for i in range(args.moves):
                start = time.perf_counter()
                data = session.export()
                moved = cb.import_session(data, session_id=f"moved-{i}")
                times.append(time.perf_counter() - start)
                size = len(data)
                assert moved.position == 4096
                moved.close()
            return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
                    "bytes": size}


if __name__ == "__main__":
    main()
