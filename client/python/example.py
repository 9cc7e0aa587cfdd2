#!/usr/bin/python3
"""Calls a running mha_server from Python: lists its models, runs
self-attention on one (default: demo) and cross-attention with a padding
mask and attention weights, then a decoder layer token by token over
server-side sessions, checked against the whole sequence in one pass.

  /usr/bin/python3 client/python/example.py --target 127.0.0.1:50051 [--model demo]

Exit code 0 on success, 1 if a call fails (the gRPC status is printed).
"""

import argparse
import os
import sys

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mha_client import MhaClient, load_stubs  # noqa: E402


def show(values):
    return np.array2string(np.asarray(values, dtype=np.float32), precision=4, separator=", ")


def run(client, model):
    pb = load_stubs()[0]
    ready = pb.ModelInfo.STATE_READY
    print("models:")
    for m in client.list_models():
        state = pb.ModelInfo.State.Name(m.state)
        print(f"  {m.name}  {state}  E={m.embed_dim} h={m.num_heads} kdim={m.kdim} "
              f"vdim={m.vdim} layout={m.weight_layout}" + (f"  error: {m.error}" if m.error else ""))
    info = client.get_model(model)
    if info.state != ready:
        print(f"model {model} is not ready: {info.error}", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    e, kdim, vdim = info.embed_dim, info.kdim, info.vdim

    # Self-attention needs kdim == vdim == embed_dim; the query is also key and value.
    if kdim == vdim == e:
        query = rng.standard_normal((2, 16, e), dtype=np.float32)
        output, weights = client.attend(model, query, need_weights=True)
        print(f"self-attention on {model}: query {query.shape} -> output {output.shape} "
              f"{output.dtype}, weights {weights.shape}")
        print(f"  output[0, 0, :4] = {show(output[0, 0, :4])}")
        print(f"  weights[0, 0, :4] = {show(weights[0, 0, :4])} (row sums to "
              f"{weights[0, 0].sum():.4f})")
    else:
        print(f"self-attention on {model}: skipped (kdim {kdim}, vdim {vdim} != embed_dim {e})")

    # Cross-attention works with every model: 8 queries attend 24 keys; the
    # last 4 keys of the second sequence are padding.
    query = rng.standard_normal((2, 8, e), dtype=np.float32)
    key = rng.standard_normal((2, 24, kdim), dtype=np.float32)
    value = rng.standard_normal((2, 24, vdim), dtype=np.float32)
    padding = np.zeros((2, 24), dtype=bool)
    padding[1, 20:] = True
    output, weights = client.attend(model, query, key, value, key_padding_mask=padding,
                                    need_weights=True, per_head_weights=True)
    print(f"cross-attention on {model}: query {query.shape}, key {key.shape}, value "
          f"{value.shape} -> output {output.shape} {output.dtype}, per-head weights "
          f"{weights.shape}")
    print(f"  output[1, 0, :4] = {show(output[1, 0, :4])}")
    print(f"  weight on padded keys: {weights[1, :, :, 20:].max():.1f}")

    # float16 in, float16 out.
    half, _ = client.attend(model, query.astype(np.float16), key.astype(np.float16),
                            value.astype(np.float16), key_padding_mask=padding)
    print(f"float16 cross-attention on {model}: output {half.shape} {half.dtype}, "
          f"max |fp16 - fp32| = {np.abs(half.astype(np.float32) - output).max():.4f}")
    if kdim == vdim == e:
        return decode_step_by_step(client, model, rng, e)
    return 0


def decoder_layer_full(client, model, x, memory, ffn):
    """A post-norm-free decoder layer over the whole sequence at once:
    causal self-attention, cross-attention over the encoder's memory, a
    feed-forward, each with its residual."""
    h = x + client.attend(model, x, is_causal=True)[0]
    h = h + client.attend(model, h, memory)[0]
    return h + ffn(h)


def decode_step_by_step(client, model, rng, e, length=10):
    """The same layer one token at a time, as a decoder runs: the self
    session caches the keys and values of every token so far, the cross
    session holds the encoder's memory, projected once."""
    w1 = rng.standard_normal((e, 2 * e), dtype=np.float32) / np.sqrt(e)
    w2 = rng.standard_normal((2 * e, e), dtype=np.float32) / np.sqrt(2 * e)
    ffn = lambda h: np.maximum(h @ w1, 0) @ w2  # noqa: E731
    x = rng.standard_normal((1, length, e), dtype=np.float32)
    memory = rng.standard_normal((1, 20, e), dtype=np.float32)
    steps = []
    with client.open_session(model) as self_attn, \
            client.open_session(model, memory=memory) as cross_attn:
        for t in range(length):
            token = x[:, t:t + 1]
            h = token + self_attn.append(token)
            h = h + cross_attn.append(h)
            steps.append(h + ffn(h))
        print(f"decoder layer on {model}, token by token: self session at position "
              f"{self_attn.position}, cross session over {cross_attn.position} memory tokens")
    stepped = np.concatenate(steps, axis=1)
    diff = np.abs(stepped - decoder_layer_full(client, model, x, memory, ffn)).max()
    print(f"  max |step by step - whole sequence| = {diff:.2e}")
    if not diff < 1e-4:
        print("  step by step differs from the whole sequence", file=sys.stderr)
        return 1
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="127.0.0.1:50051", help="host:port of mha_server")
    p.add_argument("--model", default="demo")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per call")
    args = p.parse_args()
    try:
        with MhaClient(args.target, timeout=args.timeout) as client:
            return run(client, args.model)
    except grpc.RpcError as e:
        print(f"example: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
