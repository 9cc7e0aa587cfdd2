#!/usr/bin/python3
"""KServe v2 over HTTP (Triton's binary tensors) against gRPC on the demo
model: requests/s and server CPU per request at 1 and 64 clients, with the
same load generator for both (Triton's perf_analyzer, built by hand with
../shared/tools/triton/; not part of the project's tests), alternated in one
run. Then the JSON path's figures at one client, from Python's http.client.

    /usr/bin/python3 tests/bench/http_vs_grpc.py \
        --perf_analyzer /tmp/perf_analyzer/bin/perf_analyzer [--rounds 3]

Prints one JSON object: per protocol and concurrency the median requests/s
and server CPU microseconds per request, and HTTP / gRPC ratios. With
--idle N (say 1000), also HTTP at the highest concurrency alone and beside
N idle keep-alive connections (each has made one request and stays open),
alternated: what a front end with a thread per connection could not hold.
"""

import http.client
import json
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_args import ROOT, server_bench_parser  # noqa: E402
from server_cpu import cpu_seconds, scrape  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "client", "python"))
from mha_local_server import LocalServer, free_port  # noqa: E402

INPUT_DATA = os.path.join(ROOT, "client", "perf_analyzer", "demo_64x256.json")
API = {"grpc": "kserve.v2", "http": "kserve.v2.http"}


def requests_of(metrics, api):
    pattern = re.compile(rf'^mha_requests_total\{{[^}}]*api="{re.escape(api)}"[^}}]*\}} (\S+)$',
                         re.M)
    return sum(float(v) for v in pattern.findall(metrics))


def perf_analyzer(args, server, protocol, concurrency):
    """(requests/s, server CPU us per request) of one perf_analyzer run."""
    url = (f"127.0.0.1:{server.http_port}" if protocol == "http"
           else f"127.0.0.1:{server.grpc_port}")
    before_requests = requests_of(scrape(server.metrics_port), API[protocol])
    before_cpu = cpu_seconds(server.process.pid)
    start = time.monotonic()
    out = subprocess.run([args.perf_analyzer, "-m", "demo", "-i", protocol, "-u", url, "-b", "1",
                          "--input-data", INPUT_DATA, "--concurrency-range", str(concurrency),
                          "-p", "2000", "-s", "50", "-r", "3"],
                         capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - start
    if out.returncode != 0:
        raise RuntimeError(f"perf_analyzer {protocol}: {out.stdout[-2000:]} {out.stderr[-2000:]}")
    cpu = cpu_seconds(server.process.pid) - before_cpu
    requests = requests_of(scrape(server.metrics_port), API[protocol]) - before_requests
    match = re.search(r"Concurrency: \d+, throughput: ([\d.]+) infer/sec", out.stdout)
    return float(match.group(1)), 1e6 * cpu / requests, requests / wall


def python_http(server, binary, seconds=3.0):
    """(requests/s, server CPU us per request) of one http.client client."""
    query = np.random.default_rng(0).standard_normal((1, 64, 256)).astype(np.float32)
    if binary:
        header = json.dumps({"inputs": [{"name": "query", "datatype": "FP32",
                                         "shape": [1, 64, 256],
                                         "parameters": {"binary_data_size": query.nbytes}}],
                             "outputs": [{"name": "output",
                                          "parameters": {"binary_data": True}}]}).encode()
        body, headers = header + query.tobytes(), {"Inference-Header-Content-Length":
                                                   str(len(header))}
    else:
        body = json.dumps({"inputs": [{"name": "query", "datatype": "FP32",
                                       "shape": [1, 64, 256], "data": query.tolist()}]}).encode()
        headers = {"Content-Type": "application/json"}
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    before_cpu = cpu_seconds(server.process.pid)
    count, start = 0, time.monotonic()
    while time.monotonic() - start < seconds:
        conn.request("POST", "/v2/models/demo/infer", body=body, headers=headers)
        r = conn.getresponse()
        data = r.read()
        if binary:
            np.frombuffer(data[int(r.getheader("Inference-Header-Content-Length")):], "<f4")
        else:
            np.asarray(json.loads(data)["outputs"][0]["data"], np.float32)
        count += 1
    wall = time.monotonic() - start
    cpu = cpu_seconds(server.process.pid) - before_cpu
    conn.close()
    return count / wall, 1e6 * cpu / count


def idle_connections(server, count):
    """`count` keep-alive connections that made one request each and now
    wait, open."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, count + 1024)), hard))
    request = b"GET /v2/health/live HTTP/1.1\r\nHost: bench\r\n\r\n"
    idle = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", server.http_port), timeout=30)
        s.sendall(request)
        if not s.recv(4096).startswith(b"HTTP/1.1 200"):
            raise RuntimeError("an idle connection's first request failed")
        idle.append(s)
    return idle


def close_checked(idle):
    """Closes the idle connections, after checking each is still served."""
    for s in idle:
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: bench\r\n\r\n")
        if not s.recv(4096).startswith(b"HTTP/1.1 200"):
            raise RuntimeError("an idle connection was not served after the load")
        s.close()


def beside_idle(args, server, concurrency):
    """{"alone": [...], "beside_idle": [...]} HTTP requests/s, alternated."""
    runs = {"alone": [], "beside_idle": []}
    for r in range(args.rounds):
        for phase in (("alone", "beside_idle") if r % 2 == 0 else ("beside_idle", "alone")):
            idle = idle_connections(server, args.idle) if phase == "beside_idle" else []
            runs[phase].append(perf_analyzer(args, server, "http", concurrency)[0])
            close_checked(idle)
            print(f"round {r} http c={concurrency} {phase}: {runs[phase][-1]:.0f} req/s",
                  file=sys.stderr)
    return runs


def main():
    parser = server_bench_parser(__doc__, rounds=3)
    parser.add_argument("--perf_analyzer", required=True)
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--idle", type=int, default=0,
                        help="also HTTP beside this many idle keep-alive connections")
    args = parser.parse_args()
    runs = {}
    with LocalServer(args.mha_server, os.path.join(ROOT, "models"),
                     [f"--http_port={free_port()}"]) as server:
        for protocol in ("grpc", "http"):  # warm-up
            perf_analyzer(args, server, protocol, 1)
        for r in range(args.rounds):
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                order = ("grpc", "http") if r % 2 == 0 else ("http", "grpc")
                for protocol in order:
                    rps, cpu_us, counted_rps = perf_analyzer(args, server, protocol, concurrency)
                    runs.setdefault((protocol, concurrency), []).append((rps, cpu_us))
                    print(f"round {r} {protocol} c={concurrency}: {rps:.0f} req/s, "
                          f"{cpu_us:.0f} us server CPU/request", file=sys.stderr)
        json_path = [python_http(server, binary=False) for _ in range(args.rounds)]
        binary_path = [python_http(server, binary=True) for _ in range(args.rounds)]
        top = max(int(c) for c in args.concurrency.split(","))
        idle_runs = beside_idle(args, server, top) if args.idle else None
    report = {"machine_cores": os.cpu_count()}
    for (protocol, concurrency), values in sorted(runs.items()):
        report[f"{protocol}_c{concurrency}"] = {
            "rps": statistics.median(v[0] for v in values),
            "server_cpu_us": statistics.median(v[1] for v in values)}
    for concurrency in sorted({c for _, c in runs}):
        g, h = report[f"grpc_c{concurrency}"], report[f"http_c{concurrency}"]
        report[f"http_over_grpc_c{concurrency}"] = {
            "rps": h["rps"] / g["rps"], "server_cpu_us": h["server_cpu_us"] / g["server_cpu_us"]}
    report["python_http_c1_1x64x256"] = {
        "json": {"rps": statistics.median(v[0] for v in json_path),
                 "server_cpu_us": statistics.median(v[1] for v in json_path)},
        "binary": {"rps": statistics.median(v[0] for v in binary_path),
                   "server_cpu_us": statistics.median(v[1] for v in binary_path)}}
    if idle_runs:
        alone, beside = (statistics.median(idle_runs[k]) for k in ("alone", "beside_idle"))
        report[f"http_c{top}_beside_{args.idle}_idle"] = {
            "rps_alone": alone, "rps_beside_idle": beside, "ratio": beside / alone}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
