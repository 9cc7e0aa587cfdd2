#!/usr/bin/python3
"""What a call costs above the engine, against the machine's own loopback
(issue 63), in one run.

    /usr/bin/python3 tests/bench/wire.py [--calls 20] [--rounds 3]
        [--sizes 64K,2M,16M] [--mha_server build/mha_server]
        [--grpc_echo build/grpc_echo] [--mha_client build/mha_client]

The demo model (E = 256) serves self-attention on a query of B x L x 256
fp32, so the request's tensor and the response's are the same size: 64 KiB
(1 x 64), 2 MiB (8 x 256), 16 MiB (16 x 1024). For each size and round, in
this order:
- echo: a Python TCP loopback echo of the same bytes (one connection,
  TCP_NODELAY, recv_into a preallocated buffer): the wire itself;
- grpc_floor: build/grpc_echo, a C++ generic gRPC service answering the
  same bytes (no protobuf) to a C++ client: gRPC's own floor;
- python_grpc_floor: a grpcio client sending the same bytes to that echo
  (bytes both ways, no protobuf): grpcio's own floor, which the Python
  gRPC path is also given against (over_python_grpc_floor);
- cpp: `mha_client load --concurrency 1` (the C++ client);
- python_grpc: MhaClient.attend; python_http: MhaHttpClient.attend;
- shared_memory: KServe ModelInfer with the query and output in Triton's
  system shared memory (Python gRPC stub);
- fp16: MhaClient.attend with a float16 query (half the bytes each way).
For each path, medians over the calls after a warm-up call: the round
trip, the compute of the engine call that computed it (each answer's
mha-compute-time-us, a gRPC trailer or an HTTP header: the C++ client
reads it, the Python paths wrap their client's own transport call),
overhead = round trip - compute, taken call by call, and overhead / echo (and / the gRPC
floor: the p50 of each). Prints
one JSON object: the medians over the rounds. Name the machine beside any figure quoted from it.
"""

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from multiprocessing import shared_memory

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
sys.path.insert(0, os.path.join(ROOT, "tests", "server"))
from mha_client import MhaClient  # noqa: E402
from mha_http import MhaHttpClient  # noqa: E402
from mha_local_server import LocalServer  # noqa: E402

E = 256
SHAPES = {"64K": (1, 64), "2M": (8, 256), "16M": (16, 1024)}


def tcp_echo_ms(nbytes, calls):
    """Mean round trip of `nbytes` each way over a loopback TCP echo."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve():
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf, out = bytearray(nbytes), bytes(nbytes)
        view = memoryview(buf)
        while True:
            got = 0
            while got < nbytes:
                k = conn.recv_into(view[got:])
                if k == 0:
                    return
                got += k
            conn.sendall(out)

    threading.Thread(target=serve, daemon=True).start()
    client = socket.create_connection(listener.getsockname())
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data, buf = bytes(nbytes), bytearray(nbytes)
    view = memoryview(buf)
    times = []
    for i in range(calls + 3):
        start = time.perf_counter()
        client.sendall(data)
        got = 0
        while got < nbytes:
            got += client.recv_into(view[got:])
        if i >= 3:
            times.append(time.perf_counter() - start)
    client.close()
    listener.close()
    return statistics.median(times) * 1e3


def grpc_floor_ms(echo_binary, port, nbytes, calls):
    out = subprocess.run([echo_binary, f"--target=127.0.0.1:{port}", f"--bytes={nbytes}",
                          f"--calls={calls}"], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)["p50_ms"]


def python_grpc_floor_ms(port, nbytes, calls):
    """Python gRPC's own floor: the median round trip of `nbytes` each way
    from a grpcio client (bytes in, bytes out: no protobuf, no code of
    ours) to the same C++ echo. What grpcio itself adds to gRPC's floor:
    the request copied into a slice, the response into `bytes`."""
    import grpc
    options = [("grpc.max_send_message_length", 128 << 20),
               ("grpc.max_receive_message_length", 128 << 20)]
    payload = np.random.default_rng(1).bytes(nbytes)
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        echo = channel.unary_unary("/echo.Echo/Echo")
        for _ in range(3):
            echo(payload, timeout=60)
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            echo(payload, timeout=60)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def compute_total(metrics_port):
    """(count, seconds) of mha_compute_duration_seconds for the demo model."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    def value(name):
        m = re.search(rf'^mha_compute_duration_seconds_{name}\{{model="demo",version="1"\}} (\S+)$',
                      text, re.M)
        return float(m.group(1)) if m else 0.0
    return value("count"), value("sum")


class ComputeOfLastAnswer:
    """Keeps the `mha-compute-time-us` the server sent with the last answer
    (a gRPC trailer or an HTTP header): the compute of the engine call that
    computed it, call-exact, with nothing else asked of the server between
    calls. Wraps a client's own transport call, so the client's path is
    the one timed."""

    def __init__(self):
        self.ms = None

    def grpc(self, multicallable):
        def call(request, **kwargs):
            response, rpc = multicallable.with_call(request, **kwargs)
            self.ms = int(dict(rpc.trailing_metadata())["mha-compute-time-us"]) / 1e3
            return response
        return call

    def http(self, request):
        def call(*args, **kwargs):
            status, headers, body = request(*args, **kwargs)
            if "mha-compute-time-us" in headers:
                self.ms = int(headers["mha-compute-time-us"]) / 1e3
            return status, headers, body
        return call


def timed(call, compute, calls):
    """Medians over `calls` calls of `call`: (round trip, compute of the
    engine call that computed it, round trip - compute), in ms, the
    compute read from the answer (`compute`, a ComputeOfLastAnswer)."""
    call()  # warm-up: the connection's windows open
    round_trips, computes = [], []
    for _ in range(calls):
        compute.ms = None
        start = time.perf_counter()
        call()
        round_trips.append((time.perf_counter() - start) * 1e3)
        assert compute.ms is not None, "the answer carried no mha-compute-time-us"
        computes.append(compute.ms)
    above = [r - c for r, c in zip(round_trips, computes)]
    return (statistics.median(round_trips), statistics.median(computes),
            statistics.median(above))


def cpp_client(args, server, batch, length, calls):
    """The same medians for `mha_client load` (one connection: the median
    is robust to its first call, which opens the windows); the compute is
    each call's mha-compute-time-us trailer."""
    count0, sum0 = compute_total(server.metrics_port)
    out = subprocess.run([args.mha_client, f"--target={server.target()}", "load", "--model=demo",
                          "--concurrency=1", f"--batch={batch}", f"--len_range={length}:{length}",
                          f"--requests={calls + 1}", "--json"],
                         check=True, capture_output=True, text=True)
    report = json.loads(out.stdout)
    if "above_compute_p50_ms" not in report:  # a client before the trailer: the mean compute
        count1, sum1 = compute_total(server.metrics_port)
        compute = (sum1 - sum0) / max(count1 - count0, 1) * 1e3
        return report["p50_ms"], compute, report["p50_ms"] - compute
    return report["p50_ms"], report["p50_ms"] - report["above_compute_p50_ms"], \
        report["above_compute_p50_ms"]


def shared_memory_call(server, query, compute):
    """A ModelInfer call with its query and output in system shared memory."""
    from triton_messages import triton_stubs
    import grpc
    tpb, trpc = triton_stubs()
    channel = grpc.insecure_channel(server.target(), options=[
        ("grpc.max_send_message_length", 128 << 20), ("grpc.max_receive_message_length", 128 << 20)])
    stub = trpc.GRPCInferenceServiceStub(channel)
    regions = [shared_memory.SharedMemory(create=True, size=query.nbytes) for _ in range(2)]
    regions[0].buf[:query.nbytes] = query.tobytes()
    for name, region in zip(("in", "out"), regions):
        stub.SystemSharedMemoryRegister(tpb.SystemSharedMemoryRegisterRequest(
            name=name, key="/" + region.name, byte_size=query.nbytes), timeout=60)
    request = tpb.ModelInferRequest(model_name="demo")
    tensor = request.inputs.add(name="query", datatype="FP32", shape=query.shape)
    tensor.parameters["shared_memory_region"].string_param = "in"
    tensor.parameters["shared_memory_byte_size"].int64_param = query.nbytes
    out = request.outputs.add(name="output")
    out.parameters["shared_memory_region"].string_param = "out"
    out.parameters["shared_memory_byte_size"].int64_param = query.nbytes

    infer = compute.grpc(stub.ModelInfer)

    def call():
        infer(request, timeout=600)

    def close():
        for name in ("in", "out"):
            stub.SystemSharedMemoryUnregister(tpb.SystemSharedMemoryUnregisterRequest(name=name))
        for region in regions:
            region.close()
            region.unlink()
        channel.close()
    return call, close


def one_round(args, server, echo_port, size):
    batch, length = SHAPES[size]
    query = np.random.default_rng(0).standard_normal((batch, length, E)).astype(np.float32)
    nbytes = query.nbytes
    result = {"bytes": nbytes, "echo_ms": tcp_echo_ms(nbytes, args.calls),
              "grpc_floor_ms": grpc_floor_ms(args.grpc_echo, echo_port, nbytes, args.calls),
              "python_grpc_floor_ms": python_grpc_floor_ms(echo_port, nbytes, args.calls)}
    paths = {}
    paths["cpp"] = cpp_client(args, server, batch, length, args.calls)
    with MhaClient(server.target(), max_message_bytes=128 << 20) as client:
        compute = ComputeOfLastAnswer()
        client._attend_bytes = compute.grpc(client._attend_bytes)  # the client's own call
        paths["python_grpc"] = timed(lambda: client.attend("demo", query), compute, args.calls)
        half = query.astype(np.float16)
        paths["fp16"] = timed(lambda: client.attend("demo", half), compute, args.calls)
    with MhaHttpClient(f"http://127.0.0.1:{server.http_port}") as http:
        compute = ComputeOfLastAnswer()
        http._request = compute.http(http._request)
        paths["python_http"] = timed(lambda: http.attend("demo", query), compute, args.calls)
    compute = ComputeOfLastAnswer()
    call, close = shared_memory_call(server, query, compute)
    try:
        paths["shared_memory"] = timed(call, compute, args.calls)
    finally:
        close()
    for name, (round_trip, compute, overhead) in paths.items():
        result[name] = {"round_trip_ms": round_trip, "compute_ms": compute,
                        "overhead_ms": overhead, "over_echo": overhead / result["echo_ms"],
                        "over_grpc_floor": overhead / result["grpc_floor_ms"]}
    result["python_grpc"]["over_python_grpc_floor"] = (result["python_grpc"]["overhead_ms"] /
                                                       result["python_grpc_floor_ms"])
    result["fp16_over_fp32_overhead"] = (result["fp16"]["overhead_ms"] /
                                         result["python_grpc"]["overhead_ms"])
    return result


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median_of(rounds):
    """The per-key medians of a list of equally shaped dicts."""
    first = rounds[0]
    if isinstance(first, dict):
        return {k: median_of([r[k] for r in rounds]) for k in first}
    return statistics.median(rounds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mha_server", default=os.path.join(ROOT, "build", "mha_server"))
    parser.add_argument("--mha_client", default=os.path.join(ROOT, "build", "mha_client"))
    parser.add_argument("--grpc_echo", default=os.path.join(ROOT, "build", "grpc_echo"))
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", default="64K,2M,16M")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    echo_port, http_port = free_port(), free_port()
    echo = subprocess.Popen([args.grpc_echo, f"--serve=127.0.0.1:{echo_port}"],
                            stdout=subprocess.PIPE, text=True)
    echo.stdout.readline()  # "serving ..."
    results = {size: [] for size in sizes}
    try:
        with LocalServer(args.mha_server, os.path.join(ROOT, "models"),
                         ["--max_message_bytes=134217728", f"--http_port={http_port}"]) as server:
            for _ in range(args.rounds):
                for size in sizes:
                    results[size].append(one_round(args, server, echo_port, size))
    finally:
        echo.kill()
    print(json.dumps({size: median_of(rounds) for size, rounds in results.items()}, indent=1))


if __name__ == "__main__":
    main()
