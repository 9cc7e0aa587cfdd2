#!/usr/bin/python3
"""What one large model costs in resident memory (issue 31's target: RSS after
load and one warm call <= 1.5 x weights + 64 MiB; unload gives it back).

    /usr/bin/python3 tests/bench/model_memory.py [--server build/mha_server ...]
        [--embed_dim 2048 --heads 16]

Starts each server given (explicit model control, a small model loaded),
loads an nn.MultiheadAttention(embed_dim, heads) exported to safetensors,
calls it once (checked against PyTorch), unloads it, and prints the RSS
growth at each point in MiB, one JSON object per server. Give two servers
(e.g. an older build's) to compare them in one run.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "server"))
import test_lifecycle as lifecycle  # noqa: E402
from mha_test_server import TestServer, tensor, to_numpy  # noqa: E402

MIB = 1 << 20


def measure(server, repo, module, embed_dim):
    with TestServer(server, repo, ["--model_control_mode=explicit", "--load_model=small"]) as s:
        stub = s.stub()
        time.sleep(1)
        before = lifecycle.rss(s.process.pid)
        stub.LoadModel(lifecycle.pb.LoadModelRequest(name="big"), timeout=300)
        time.sleep(1)
        loaded = lifecycle.rss(s.process.pid)
        q = np.random.default_rng(1).standard_normal((1, 16, embed_dim)).astype(np.float32)
        r = stub.Attend(lifecycle.pb.AttendRequest(
            model="big", query=tensor(lifecycle.pb, lifecycle.cfg, q)), timeout=120)
        with torch.inference_mode():
            x = torch.from_numpy(q)
            want = module(x, x, x, need_weights=False)[0].numpy()
        time.sleep(1)
        called = lifecycle.rss(s.process.pid)
        stub.UnloadModel(lifecycle.pb.UnloadModelRequest(name="big"), timeout=60)
        time.sleep(3)
        unloaded = lifecycle.rss(s.process.pid)
    weights = sum(p.numel() for p in module.parameters()) * 4
    return {"server": server, "weights_mib": round(weights / MIB, 1),
            "loaded_mib": round((loaded - before) / MIB, 1),
            "after_call_mib": round((called - before) / MIB, 1),
            "target_mib": round((1.5 * weights + 64 * MIB) / MIB, 1),
            "after_unload_mib": round((unloaded - before) / MIB, 1),
            "max_error": float(np.abs(to_numpy(r.output) - want).max())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", action="append",
                        default=None, help="a server binary (repeat to compare)")
    parser.add_argument("--embed_dim", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args()
    servers = args.server or [lifecycle.MHA_SERVER]
    torch.manual_seed(5)
    module = nn.MultiheadAttention(args.embed_dim, args.heads, batch_first=True).eval()
    repo = tempfile.mkdtemp(prefix="mha_model_memory_")
    try:
        lifecycle.write_version(os.path.join(repo, "big"), 1, module)
        lifecycle.write_version(os.path.join(repo, "small"), 1, lifecycle.layer(42))
        for server in servers:
            print(json.dumps(measure(server, repo, module, args.embed_dim)), flush=True)
    finally:
        shutil.rmtree(repo, ignore_errors=True)


if __name__ == "__main__":
    main()
