#!/usr/bin/python3
"""What a call costs above the engine, against the machine's own loopback
(issue 63), in one run.

    /usr/bin/python3 tests/bench/wire.py [--calls 20] [--rounds 3]
        [--sizes 64K,2M,16M] [--mha_server build/mha_server]
        [--grpc_echo build/grpc_echo] [--mha_client build/mha_client]

The demo model (E = 256) serves self-attention on a query of B x L x 256
fp32, so the request's tensor and the response's are the same size: 64 KiB
(1 x 64), 2 MiB (8 x 256), 16 MiB (16 x 1024). For each size and round:
- echo: a Python TCP loopback echo of the same bytes (one connection,
  TCP_NODELAY, recv_into a preallocated buffer): the wire itself;
- cpp: `mha_client load --concurrency 1` (the C++ client); cpp_fp16: the
  same with --fp16 (half the bytes each way); in blocks alternating with
  grpc_floor: build/grpc_echo, a C++ generic gRPC service answering the
  same bytes (no protobuf) to a C++ client: gRPC's own floor, tuned as
  our processes run (glibc's heap thresholds fixed on both ends, the
  client's thread polling its own completion queue: grpc_echo.cc says
  what each is worth); grpc_floor_half, the same with half the bytes;
  and grpc_floor_computing, the same bytes with each answer held as long
  as the block's C++ calls computed, both cores busy, then sent from a
  thread of its own as mha_server's worker sends (less the hold): gRPC's
  floor for a call that computes, which cpp is also given against
  (over_grpc_floor_computing);
- python_grpc: MhaClient.attend; fp16: the same with a float16 query (half
  the bytes each way); python_grpc_floor: a grpcio client sending the same
  bytes to that echo (bytes both ways, no protobuf), grpcio's own floor,
  which the Python gRPC path is also given against (over_python_grpc_floor);
  python_grpc_floor_half: the same with half the bytes. These call by call,
  in turn: this machine changes speed from second to second, and a floor
  measured apart moved by 1.3-1.4x between rounds;
- python_http: MhaHttpClient.attend;
- shared_memory: KServe ModelInfer with the query and output in Triton's
  system shared memory (Python gRPC stub).
For each path, medians over the calls after a warm-up call: the round
trip, the compute of the engine call that computed it (each answer's
mha-compute-time-us, a gRPC trailer or an HTTP header: the C++ client
reads it, the Python paths wrap their client's own transport call),
overhead = round trip - compute, taken call by call, and overhead / echo
(and / the gRPC floor). The C++ client's overhead is also split in two:
cpp_server_stages_ms (its mha-server-time-us minus the compute: decode,
queue, check, encode) and cpp_above_server_ms (the rest: the wire, gRPC in
both processes, the client). fp16's overhead over fp32's is given for each
client beside the floors' own ratio (half the bytes / the bytes): what it
would be if a call cost nothing beyond the wire. Prints one JSON object:
the medians over the rounds. Name the machine beside any figure quoted
from it.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
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


def grpc_floor_ms(echo_binary, port, nbytes, calls, hold_ms=0.0):
    """grpc_echo's median round trip, less the hold it asked the server for
    (each answer held that long, both cores busy: a call that computes)."""
    hold_us = int(hold_ms * 1000)
    out = subprocess.run([echo_binary, f"--target=127.0.0.1:{port}", f"--bytes={nbytes}",
                          f"--calls={calls}", f"--hold_us={hold_us}"],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)["p50_ms"] - hold_us / 1000


class PythonGrpcEcho:
    """Python gRPC's own floor: `nbytes` each way from a grpcio client
    (bytes in, bytes out: no protobuf, no code of ours) to the C++ echo.
    What grpcio itself adds to gRPC's floor: the request copied into a
    slice, the response into `bytes`. Call it; close() when done."""

    def __init__(self, port, nbytes):
        import grpc
        options = [("grpc.max_send_message_length", 128 << 20),
                   ("grpc.max_receive_message_length", 128 << 20)]
        self.payload = np.random.default_rng(1).bytes(nbytes)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=options)
        self.echo = self.channel.unary_unary("/echo.Echo/Echo")
        for _ in range(3):
            self()

    def __call__(self):
        self.echo(self.payload, timeout=60)

    def close(self):
        self.channel.close()


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


def interleaved(paths, calls):
    """Medians over `calls` rounds of calling every path once, the order
    turning each round, so that all of them see the machine in the same
    state (it changes speed from second to second). `paths` maps a name to
    (call, compute): compute a ComputeOfLastAnswer, or None for an echo.
    Returns name -> (round trip, compute of the engine call that computed
    it, round trip - compute), in ms; the compute is read from the answer."""
    for call, _ in paths.values():
        call()  # warm-up: the connection's windows open
    names = list(paths)
    times = {name: ([], []) for name in names}
    for i in range(calls):
        for name in names[i % len(names):] + names[:i % len(names)]:
            call, compute = paths[name]
            if compute is not None:
                compute.ms = None
            start = time.perf_counter()
            call()
            times[name][0].append((time.perf_counter() - start) * 1e3)
            if compute is not None:
                assert compute.ms is not None, "the answer carried no mha-compute-time-us"
                times[name][1].append(compute.ms)
    result = {}
    for name, (round_trips, computes) in times.items():
        computes = computes or [0.0] * len(round_trips)
        above = [r - c for r, c in zip(round_trips, computes)]
        result[name] = (statistics.median(round_trips), statistics.median(computes),
                        statistics.median(above))
    return result


def cpp_client(args, server, batch, length, calls, flags=()):
    """The same medians for `mha_client load --concurrency 1` (one
    connection, after calls not counted that open its windows, as
    grpc_echo's client does, and wake this VM's cores: 20 below 16 MiB,
    whose first calls computed up to 2x slower on a client that made its
    few requests at once); the compute is each call's mha-compute-time-us
    trailer."""
    warmup = 3 if batch * length * E * 4 >= (8 << 20) else 20
    out = subprocess.run([args.mha_client, f"--target={server.target()}", "load", "--model=demo",
                          "--concurrency=1", f"--batch={batch}", f"--len_range={length}:{length}",
                          f"--requests={calls}", f"--warmup_requests={warmup}", "--json", *flags],
                         check=True, capture_output=True, text=True)
    report = json.loads(out.stdout)
    return report["p50_ms"], report["p50_ms"] - report["above_compute_p50_ms"], \
        report["above_compute_p50_ms"], report["above_server_p50_ms"]


def cpp_and_floor(args, server, echo_port, batch, length, calls, blocks=3):
    """The C++ client in fp32 and in fp16, and gRPC's floor of the same
    bytes and of half of them (all C++ processes), in alternating blocks of
    at least 10 calls each (a new connection opens its windows over its
    first calls). floor_computing is the floor with each answer held for
    the compute of the block's fp32 calls, both cores busy, then sent from
    a thread of its own (grpc_echo --hold_us), less that hold: what gRPC
    costs on this machine for a call that computes that long. Returns the
    medians of the blocks' medians: the clients' (round trip, compute,
    overhead, round trip - server time) by path, and the floors' by name."""
    nbytes = batch * length * E * 4
    per_block = max(calls // blocks, 10)
    times = {"cpp": [], "cpp_fp16": [], "floor": [], "floor_half": [], "floor_computing": []}
    runs = {"cpp": lambda: cpp_client(args, server, batch, length, per_block),
            "cpp_fp16": lambda: cpp_client(args, server, batch, length, per_block, ["--fp16"]),
            "floor": lambda: grpc_floor_ms(args.grpc_echo, echo_port, nbytes, per_block),
            "floor_half": lambda: grpc_floor_ms(args.grpc_echo, echo_port, nbytes // 2, per_block),
            "floor_computing": lambda: grpc_floor_ms(args.grpc_echo, echo_port, nbytes, per_block,
                                                     hold_ms=times["cpp"][-1][1])}
    for _ in range(blocks):
        for name, run in runs.items():
            times[name].append(run())
    clients = {name: tuple(statistics.median(t[i] for t in times[name]) for i in range(4))
               for name in ("cpp", "cpp_fp16")}
    floors = {name: statistics.median(times[name])
              for name in ("floor", "floor_half", "floor_computing")}
    return clients, floors


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
    result = {"bytes": nbytes, "echo_ms": tcp_echo_ms(nbytes, args.calls)}
    paths = {}
    cpp, floors = cpp_and_floor(args, server, echo_port, batch, length, args.calls)
    result["grpc_floor_ms"], result["grpc_floor_half_ms"] = floors["floor"], floors["floor_half"]
    result["grpc_floor_computing_ms"] = floors["floor_computing"]
    # The C++ client's overhead in two: the server's stages (decode, queue,
    # check, encode: its mha-server-time-us minus the compute) and the rest
    # (the wire, gRPC in both processes, the client).
    for name, (round_trip, compute, overhead, above_server) in cpp.items():
        paths[name] = (round_trip, compute, overhead)
        result[f"{name}_server_stages_ms"] = overhead - above_server
        result[f"{name}_above_server_ms"] = above_server
    # The Python gRPC paths and grpcio's floors (the same bytes and half of
    # them: what fp16's halving saves on the wire itself), call by call.
    floor, floor_half = PythonGrpcEcho(echo_port, nbytes), PythonGrpcEcho(echo_port, nbytes // 2)
    with MhaClient(server.target(), max_message_bytes=128 << 20) as client:
        compute = ComputeOfLastAnswer()
        client._attend_bytes = compute.grpc(client._attend_bytes)  # the client's own call
        half = query.astype(np.float16)
        python = interleaved({"python_grpc": (lambda: client.attend("demo", query), compute),
                              "fp16": (lambda: client.attend("demo", half), compute),
                              "python_grpc_floor": (floor, None),
                              "python_grpc_floor_half": (floor_half, None)}, args.calls)
    floor.close()
    floor_half.close()
    result["python_grpc_floor_ms"] = python.pop("python_grpc_floor")[0]
    result["python_grpc_floor_half_ms"] = python.pop("python_grpc_floor_half")[0]
    paths.update(python)
    with MhaHttpClient(f"http://127.0.0.1:{server.http_port}") as http:
        compute = ComputeOfLastAnswer()
        http._request = compute.http(http._request)
        paths.update(interleaved({"python_http": (lambda: http.attend("demo", query), compute)},
                                 args.calls))
    compute = ComputeOfLastAnswer()
    call, close = shared_memory_call(server, query, compute)
    try:
        paths.update(interleaved({"shared_memory": (call, compute)}, args.calls))
    finally:
        close()
    for name, (round_trip, compute, overhead) in paths.items():
        result[name] = {"round_trip_ms": round_trip, "compute_ms": compute,
                        "overhead_ms": overhead, "over_echo": overhead / result["echo_ms"],
                        "over_grpc_floor": overhead / result["grpc_floor_ms"]}
    result["cpp"]["over_grpc_floor_computing"] = (result["cpp"]["overhead_ms"] /
                                                  result["grpc_floor_computing_ms"])
    result["python_grpc"]["over_python_grpc_floor"] = (result["python_grpc"]["overhead_ms"] /
                                                       result["python_grpc_floor_ms"])
    result["fp16_over_fp32_overhead"] = (result["fp16"]["overhead_ms"] /
                                         result["python_grpc"]["overhead_ms"])
    result["cpp_fp16_over_fp32_overhead"] = (result["cpp_fp16"]["overhead_ms"] /
                                             result["cpp"]["overhead_ms"])
    result["cpp_fp16_over_fp32_above_server"] = (result["cpp_fp16_above_server_ms"] /
                                                 result["cpp_above_server_ms"])
    # The same ratio for the floors (half the bytes / the bytes): the least
    # fp16's ratio can be, where a call costs nothing beyond the wire.
    result["grpc_floor_half_over_full"] = result["grpc_floor_half_ms"] / result["grpc_floor_ms"]
    result["python_grpc_floor_half_over_full"] = (result["python_grpc_floor_half_ms"] /
                                                  result["python_grpc_floor_ms"])
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
