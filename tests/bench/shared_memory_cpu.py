#!/usr/bin/python3
"""Server CPU per request for a large same-host call, with its tensors in the
message (raw contents) and in Triton's system shared memory (issue 36).

    /usr/bin/python3 tests/bench/shared_memory_cpu.py [--rounds 3 --calls 8]

One model of E = 512, h = 8; each call is self-attention on a query of
8 x 1024 x 512 fp32 (16 MiB in, 16 MiB out), one call at a time, so each
engine call holds one request. The two modes alternate in rounds, in one
run. For each mode: the server's user + system CPU per request (from
/proc/PID/stat), the engine's CPU per request (ModelStatistics'
compute_infer wall time x the threads of an engine call), and the overhead
above the engine. Prints one JSON object; compare the overheads' ratio.
"""

import json
import os
import statistics
import sys
import tempfile
from multiprocessing import shared_memory

import grpc
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "server"))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
from bench_args import server_bench_parser  # noqa: E402
from mha_local_server import LocalServer  # noqa: E402
from test_server import _write_model  # noqa: E402
from triton_messages import triton_stubs  # noqa: E402

tpb, trpc = triton_stubs()
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
B, L, E, H = 8, 1024, 512, 8


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def compute_ns(triton):
    stats = triton.ModelStatistics(tpb.ModelStatisticsRequest(name="big"), timeout=60)
    return sum(m.inference_stats.compute_infer.ns for m in stats.model_stats)


def raw_request(query):
    request = tpb.ModelInferRequest(model_name="big")
    request.inputs.add(name="query", datatype="FP32", shape=query.shape)
    request.raw_input_contents.append(query.tobytes())
    request.outputs.add(name="output")
    return request


def shm_request(nbytes):
    request = tpb.ModelInferRequest(model_name="big")
    tensor = request.inputs.add(name="query", datatype="FP32", shape=[B, L, E])
    tensor.parameters["shared_memory_region"].string_param = "in"
    tensor.parameters["shared_memory_byte_size"].int64_param = nbytes
    out = request.outputs.add(name="output")
    out.parameters["shared_memory_region"].string_param = "out"
    out.parameters["shared_memory_byte_size"].int64_param = nbytes
    return request


def measure(server, triton, request, calls, threads):
    cpu0, ns0 = cpu_seconds(server.process.pid), compute_ns(triton)
    for _ in range(calls):
        triton.ModelInfer(request, timeout=600)
    cpu = (cpu_seconds(server.process.pid) - cpu0) / calls
    engine = (compute_ns(triton) - ns0) / 1e9 / calls * threads
    return {"server_cpu_ms": cpu * 1e3, "engine_cpu_ms": engine * 1e3,
            "overhead_ms": (cpu - engine) * 1e3}


def main():
    parser = server_bench_parser(rounds=3, calls=8)
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="threads of one engine call (the server's default: every core)")
    args = parser.parse_args()
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    query = np.random.default_rng(0).standard_normal((B, L, E)).astype("<f4")
    nbytes = query.nbytes
    regions = [shared_memory.SharedMemory(create=True, size=nbytes) for _ in range(2)]
    regions[0].buf[:nbytes] = query.tobytes()
    results = {"raw": [], "shared_memory": []}
    with tempfile.TemporaryDirectory() as repo:
        _write_model(os.path.join(repo, "big"), {"embed_dim": E, "num_heads": H},
                     module.state_dict())
        with LocalServer(args.mha_server, repo, []) as server:
            channel = grpc.insecure_channel(server.target(), options=[
                ("grpc.max_send_message_length", 128 << 20),
                ("grpc.max_receive_message_length", 128 << 20)])
            triton = trpc.GRPCInferenceServiceStub(channel)
            for name, region in zip(("in", "out"), regions):
                triton.SystemSharedMemoryRegister(tpb.SystemSharedMemoryRegisterRequest(
                    name=name, key="/" + region.name, byte_size=nbytes), timeout=60)
            raw, shm = raw_request(query), shm_request(nbytes)
            want = np.frombuffer(triton.ModelInfer(raw, timeout=600).raw_output_contents[0],
                                 dtype="<f4")
            triton.ModelInfer(shm, timeout=600)  # warm-up, and the same answer
            got = np.frombuffer(bytes(regions[1].buf[:nbytes]), dtype="<f4")
            assert got.tobytes() == want.tobytes(), "shared memory answered differently"
            for _ in range(args.rounds):
                results["raw"].append(measure(server, triton, raw, args.calls, args.threads))
                results["shared_memory"].append(
                    measure(server, triton, shm, args.calls, args.threads))
    for region in regions:
        region.close()
        region.unlink()
    summary = {mode: {key: statistics.median(r[key] for r in rounds)
                      for key in rounds[0]} for mode, rounds in results.items()}
    summary["overhead_ratio_shm_over_raw"] = (summary["shared_memory"]["overhead_ms"] /
                                              summary["raw"]["overhead_ms"])
    summary["shape"] = [B, L, E]
    summary["rounds"] = results
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
