#!/usr/bin/python3
"""Restarts that keep sessions (issue 33): how long a server with
--session_spill_dir takes to write its sessions at SIGTERM and to bring
them back at start.

    /usr/bin/python3 tests/bench/spill_bench.py [--sessions 256 --tokens 512]

Demo model (E = 256, h = 4, fp32 cache: 2 KiB per token). Opens --sessions
sessions of --tokens tokens each, stops the server (SIGTERM), starts it
again with the same flag, and reports the spill and restore times the
server logs and the wall time from start to ready. Then one step of each
of 8 sessions is checked against the step the first server would have
computed. Prints one JSON object.
"""

import json
import os
import re
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
from bench_args import server_bench_parser  # noqa: E402
from mha_client import MhaClient  # noqa: E402
from mha_local_server import LocalServer  # noqa: E402


def main():
    args = server_bench_parser(sessions=256, tokens=512).parse_args()
    rng = np.random.default_rng(0)
    prefix = rng.standard_normal((1, args.tokens, 256)).astype(np.float32)
    step = rng.standard_normal((1, 1, 256)).astype(np.float32)
    out = {"sessions": args.sessions, "tokens": args.tokens}
    with tempfile.TemporaryDirectory() as spill:
        flags = [f"--session_spill_dir={spill}", "--session_idle_timeout_s=3600",
                 f"--max_sessions={args.sessions + 8}"]
        models = os.path.join(ROOT, "models")
        with LocalServer(args.mha_server, models, flags) as first, \
                MhaClient(first.target(), timeout=120) as client:
            want = []
            for i in range(args.sessions):
                s = client.open_session("demo", session_id=f"s{i}")
                s.append(prefix)
                if i < 8:  # what the next step gives, computed on a fork
                    with s.fork(f"probe{i}") as probe:
                        want.append(probe.append(step))
            first.stop()
            out["spill_log"] = re.search(r"\d+ sessions written.*", first.stderr()).group(0)
        out["spill_bytes"] = sum(os.path.getsize(os.path.join(spill, f))
                                 for f in os.listdir(spill))
        start = time.perf_counter()
        with LocalServer(args.mha_server, models, flags) as second:
            out["start_to_ready_ms"] = (time.perf_counter() - start) * 1e3
            out["restore_log"] = re.search(r"\d+ sessions restored.*", second.stderr()).group(0)
            with MhaClient(second.target(), timeout=120) as client:
                worst = 0.0
                for i in range(8):
                    r = client._stub.Append(client._pb.AppendRequest(
                        session_id=f"s{i}", query=client_tensor(step),
                        expected_position=args.tokens), timeout=60)
                    got = from_tensor(r.output)
                    worst = max(worst, float(np.abs(got - want[i]).max()))
                out["max_abs_diff_after_restart"] = worst
    print(json.dumps(out, indent=1))


def client_tensor(array):
    import mha_client
    return mha_client.to_tensor(array)


def from_tensor(tensor):
    import mha_client
    return mha_client.from_tensor(tensor)


if __name__ == "__main__":
    main()
