#!/usr/bin/python3
"""One client over gRPC on mha_bench's standard shapes: the default server
against `--workers=1` (or any two sets of flags, or two builds with --b_server),
alternated in one run.

    /usr/bin/python3 tests/bench/one_client.py [--rounds 5] [--seconds 3]
        [--a_flags ""] [--b_flags "--workers=1"] [--b_server PATH]

Both servers serve one repository with a model per width of the shapes
(E 256 h 4, E 512 h 8, E 1024 h 16, random weights) and run side by side;
only one is loaded at a time. For each shape and round, `mha_client load
--concurrency 1` runs against each (the order swapped every round) and the
median latency is kept. Prints one JSON object per shape: the medians over
the rounds of each server's p50, and b / a (below 1: b is faster).
"""

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
from mha_local_server import LocalServer  # noqa: E402
from mha_model_folder import write_model_folder  # noqa: E402

# mha_bench's standard shapes: name, model, batch, L, S (0: self-attention).
SHAPES = [("self_b8_l128_e512_h8", "e512", 8, 128, 0),
          ("self_b1_l1024_e512_h8", "e512", 1, 1024, 0),
          ("cross_b8_l64_s256_e512_h8", "e512", 8, 64, 256),
          ("self_b1_l16_e256_h4", "e256", 1, 16, 0),
          ("self_b4_l512_e1024_h16", "e1024", 4, 512, 0)]
MODELS = {"e256": (256, 4), "e512": (512, 8), "e1024": (1024, 16)}
LATENCY = re.compile(r"latency ms: p50 ([\d.]+)")


def write_repository(path):
    rng = np.random.default_rng(0)
    for name, (e, h) in MODELS.items():
        tensors = {
            "in_proj_weight": ((rng.standard_normal((3 * e, e)) / np.sqrt(e)).astype(np.float32),
                               "F32"),
            "in_proj_bias": (np.zeros(3 * e, np.float32), "F32"),
            "out_proj.weight": ((rng.standard_normal((e, e)) / np.sqrt(e)).astype(np.float32),
                                "F32"),
            "out_proj.bias": (np.zeros(e, np.float32), "F32")}
        write_model_folder(os.path.join(path, name), {"embed_dim": e, "num_heads": h}, tensors)


def p50(args, server, shape):
    _, model, batch, length, kv_len = shape
    out = subprocess.run(
        [args.mha_client, "load", f"--target={server.target()}", f"--model={model}",
         "--concurrency=1", f"--batch={batch}", f"--len_range={length}:{length}",
         f"--kv_len={kv_len}", f"--duration={args.seconds}s"],
        capture_output=True, text=True, check=True).stdout
    return float(LATENCY.search(out).group(1))


def main():
    build = os.path.join(ROOT, "build")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mha_server", default=os.path.join(build, "mha_server"))
    parser.add_argument("--mha_client", default=os.path.join(build, "mha_client"))
    parser.add_argument("--a_flags", default="")
    parser.add_argument("--b_flags", default="--workers=1")
    parser.add_argument("--b_server", default="", help="b's binary (default: --mha_server)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3)
    parser.add_argument("--shapes", default="", help="substring filter of shape names")
    args = parser.parse_args()
    shapes = [s for s in SHAPES if args.shapes in s[0]]
    with tempfile.TemporaryDirectory() as repo:
        write_repository(repo)
        flags = {"a": shlex.split(args.a_flags), "b": shlex.split(args.b_flags)}
        binaries = {"a": args.mha_server, "b": args.b_server or args.mha_server}
        servers = {k: LocalServer(binaries[k], repo, f) for k, f in flags.items()}
        for s in servers.values():
            s.start()
        try:
            for shape in shapes:  # warm-up: primitives made, pages touched
                for s in servers.values():
                    p50(args, s, shape)
            for shape in shapes:
                runs = {"a": [], "b": []}
                for r in range(args.rounds):
                    for k in (("a", "b") if r % 2 == 0 else ("b", "a")):
                        runs[k].append(p50(args, servers[k], shape))
                a, b = (statistics.median(runs[k]) for k in ("a", "b"))
                print(json.dumps({"shape": shape[0], "a_flags": args.a_flags,
                                  "b_flags": args.b_flags, "b_server": args.b_server,
                                  "a_p50_ms": a, "b_p50_ms": b,
                                  "b_over_a": round(b / a, 3), "rounds": runs}), flush=True)
        finally:
            for s in servers.values():
                s.stop()


if __name__ == "__main__":
    main()
