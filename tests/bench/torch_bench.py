"""PyTorch's nn.MultiheadAttention on the standard shapes, timed like mha_bench.

Prints one JSON object per line: {"name", "dtype", "ms", "gflops"}; dtype is
"torch_<mode>", with "_bf16" appended for --dtype bf16 (module and inputs
.to(torch.bfloat16)).
--mode best: timed from a worker thread after a warm-up on the main thread
(run with OPENBLAS_CORETYPE=SkylakeX; run_bench.py sets it), which keeps
OpenMP and OpenBLAS from oversubscribing the cores. --mode default: Debian's
defaults, on the main thread.
"""

import argparse
import json
import statistics
import threading
import time

import torch

SHAPES = [  # name, batch, q_len, kv_len (0: self), embed_dim, heads
    ("self_b8_l128_e512_h8", 8, 128, 0, 512, 8),
    ("self_b1_l1024_e512_h8", 1, 1024, 0, 512, 8),
    ("cross_b8_l64_s256_e512_h8", 8, 64, 256, 512, 8),
    ("self_b1_l16_e256_h4", 1, 16, 0, 256, 4),
    ("self_b4_l512_e1024_h16", 4, 512, 0, 1024, 16),
]

WIDE_SHAPES = [  # mha_bench --wide
    ("self_b8_l128_e1024_h16", 8, 128, 0, 1024, 16),
    ("self_b8_l128_e1024_h32", 8, 128, 0, 1024, 32),
    ("self_b4_l512_e2048_h16", 4, 512, 0, 2048, 16),
    ("self_b4_l512_e2048_h32", 4, 512, 0, 2048, 32),
    ("cross_b8_l64_s256_e2048_h32", 8, 64, 256, 2048, 32),
]


def flops(batch, q_len, kv_len, e):
    """Same count as mha_bench: projections plus the two attention products."""
    s = kv_len or q_len
    t, tk = batch * q_len, batch * s
    return 2 * t * e * e + 2 * tk * e * 2 * e + 2 * t * e * e + 4.0 * batch * q_len * s * e


def median_seconds(fn, min_reps, min_seconds):
    for _ in range(3):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_case(batch, q_len, kv_len, e, heads, dtype=torch.float32):
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(e, heads, batch_first=True).eval().to(dtype)
    query = (torch.randn(batch, q_len, e) * 0.5).to(dtype)
    memory = (torch.randn(batch, kv_len, e) * 0.5).to(dtype) if kv_len else query

    def call():
        with torch.inference_mode():
            module(query, memory, memory, need_weights=False)

    return call


def bench_all(args, report):
    shapes = WIDE_SHAPES if args.wide else SHAPES
    if args.seq_lengths:
        shapes = [(f"seq_l{n}_e512_h8", 1, n, 0, 512, 8)
                  for n in map(int, args.seq_lengths.split(","))]
    for name, batch, q_len, kv_len, e, heads in shapes:
        if args.shapes not in name:
            continue
        call = make_case(batch, q_len, kv_len, e, heads,
                         torch.bfloat16 if args.dtype == "bf16" else torch.float32)
        if args.mode == "best":
            call()  # warm-up on the main thread, then measure from a worker
            result = {}
            worker = threading.Thread(target=lambda: result.update(
                s=median_seconds(call, args.min_reps, args.min_seconds)))
            worker.start()
            worker.join()
            seconds = result["s"]
        else:
            seconds = median_seconds(call, args.min_reps, args.min_seconds)
        report(name, seconds, flops(batch, q_len, kv_len, e))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=["best", "default"], default="best")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    parser.add_argument("--min_reps", type=int, default=10)
    parser.add_argument("--min_seconds", type=float, default=1.0)
    parser.add_argument("--shapes", default="")
    parser.add_argument("--wide", action="store_true", help="the wider models instead of SHAPES")
    parser.add_argument("--seq_lengths", default="",
                        help="instead of SHAPES: self-attention B=1 E=512 h=8 at these lengths")
    args = parser.parse_args()
    if args.mode == "best":
        torch.set_num_threads(args.threads)
    dtype = "torch_" + args.mode + ("_bf16" if args.dtype == "bf16" else "")

    def report(name, seconds, flop):
        print(json.dumps({"name": name, "dtype": dtype, "ms": seconds * 1e3,
                          "gflops": flop / seconds * 1e-9}), flush=True)

    bench_all(args, report)


if __name__ == "__main__":
    main()
