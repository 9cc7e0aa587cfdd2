#!/usr/bin/python3
"""Writes the fuzzers' seed corpora (tests/fuzz/corpus/<target>/): small
valid inputs the fuzzers mutate from. Run once; the seeds are committed.

  /usr/bin/python3 tests/fuzz/make_seeds.py
"""

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "parity"))
sys.path.insert(0, os.path.join(HERE, "..", "server"))
from mha_model_io import write_safetensors  # noqa: E402
from mha_test_server import load_stubs  # noqa: E402

RNG = np.random.default_rng(0)


def safetensors_bytes(tensors):
    path = os.path.join(HERE, ".seed.tmp")
    write_safetensors(path, tensors)
    with open(path, "rb") as f:
        data = f.read()
    os.unlink(path)
    return data


def randn(*shape):
    return (RNG.standard_normal(shape) * 0.5).astype(np.float32)


def write(target, name, data):
    folder = os.path.join(HERE, "corpus", target)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)


def model_seeds():
    e, h = 8, 2
    in_proj = {"in_proj_weight": (randn(3 * e, e), "F32"), "in_proj_bias": (randn(3 * e), "F32"),
               "out_proj.weight": (randn(e, e), "BF16"), "out_proj.bias": (randn(e), "F16")}
    write("fuzz_model", "in_proj", f"embed_dim: {e}\nnum_heads: {h}\n".encode() + b"\xff" +
          safetensors_bytes(in_proj))
    per_head = {"out_proj.weight": (randn(e, e), "F32"), "out_proj.bias": (randn(e), "F32"),
                "bias_k": (randn(1, 1, e), "F32"), "bias_v": (randn(1, 1, e), "F32"),
                "norm.weight": (randn(e), "F32"), "norm.bias": (randn(e), "F32")}
    for p, width in (("q", e), ("k", 6), ("v", 6)):
        for i in range(h):
            per_head[f"{p}_proj.{i}.weight"] = (randn(e // h, width), "F32")
            per_head[f"{p}_proj.{i}.bias"] = (randn(e // h), "F32")
    config = (f"embed_dim: {e}\nnum_heads: {h}\nkdim: 6\nvdim: 6\nadd_bias_kv: true\n"
              "add_zero_attn: true\npost_norm { eps: 1e-5 }\ncompute_dtype: DATA_TYPE_BF16\n")
    write("fuzz_model", "per_head", config.encode() + b"\xff" + safetensors_bytes(per_head))
    write("fuzz_safetensors", "in_proj", safetensors_bytes(in_proj))
    write("fuzz_safetensors", "mixed", safetensors_bytes(
        {"a": (randn(2, 3), "F32"), "b": (RNG.random((4,)) < 0.5, "BOOL"),
         "empty": (randn(0, 3), "F16")}))


def mha_tensor(array):
    """An mha.v1 Tensor of a float32 or bool array."""
    pb, _, cfg = load_stubs()
    if array.dtype == np.bool_:
        return pb.Tensor(dtype=cfg.DATA_TYPE_BOOL, shape=array.shape,
                         data=array.astype(np.uint8).tobytes())
    return pb.Tensor(dtype=cfg.DATA_TYPE_FP32, shape=array.shape, data=array.tobytes())


def request_seeds():
    pb, _, cfg = load_stubs()
    tensor = mha_tensor

    self_attn = pb.AttendRequest(model="m", query=tensor(randn(2, 3, 8)), need_weights=True,
                                 key_padding_mask=tensor(RNG.random((2, 3)) < 0.3))
    write("fuzz_request", "self", self_attn.SerializeToString())
    cross = pb.AttendRequest(model="m", query=tensor(randn(1, 4, 8)), key=tensor(randn(1, 5, 6)),
                             value=tensor(randn(1, 5, 6)), is_causal=True,
                             attn_mask=tensor(randn(4, 5)), need_weights=True,
                             per_head_weights=True)
    write("fuzz_request", "cross", cross.SerializeToString())
    unbatched = pb.AttendRequest(model="m", query=tensor(randn(3, 8)),
                                 attn_mask=tensor(RNG.random((2, 3, 3)) < 0.5))
    write("fuzz_request", "unbatched", unbatched.SerializeToString())


def kserve_seeds():
    import mha_client
    kpb, _ = mha_client.load_kserve_stubs()
    raw = kpb.ModelInferRequest(model_name="m", id="1")
    raw.inputs.add(name="query", datatype="FP32", shape=[2, 3, 8])
    raw.raw_input_contents.append(randn(2, 3, 8).tobytes())
    raw.inputs.add(name="key_padding_mask", datatype="BOOL", shape=[2, 3])
    raw.raw_input_contents.append((RNG.random((2, 3)) < 0.3).astype(np.uint8).tobytes())
    raw.parameters["need_weights"].bool_param = True
    raw.outputs.add(name="attn_weights")
    write("fuzz_kserve", "raw", raw.SerializeToString())
    typed = kpb.ModelInferRequest(model_name="m")
    for name, shape in (("query", [1, 4, 8]), ("key", [1, 5, 6]), ("value", [1, 5, 6]),
                        ("attn_mask", [4, 5])):
        t = typed.inputs.add(name=name, datatype="FP32", shape=shape)
        t.contents.fp32_contents.extend(randn(*shape).reshape(-1).tolist())
    typed.parameters["is_causal"].bool_param = True
    typed.parameters["per_head_weights"].bool_param = True
    write("fuzz_kserve", "typed", typed.SerializeToString())


def http_seeds():
    """HTTP infer requests as fuzz_http reads them: header lines, an empty
    line, the body (Triton's JSON, its binary extension, gzip)."""
    import gzip
    import json
    query = {"name": "query", "datatype": "FP32", "shape": [1, 2, 8],
             "data": randn(1, 2, 8).tolist()}
    key = {"name": "key", "datatype": "FP32", "shape": [1, 3, 6],
           "data": randn(3 * 6).tolist()}
    mask = {"name": "key_padding_mask", "datatype": "BOOL", "shape": [1, 3],
            "data": [False, True, False]}
    plain = json.dumps({"id": "1", "inputs": [query], "parameters": {"need_weights": True},
                        "outputs": [{"name": "output"},
                                    {"name": "attn_weights", "parameters": {"binary_data": True}}]
                        }).encode()
    write("fuzz_http", "json_self", b"Content-Type: application/json\n\n" + plain)
    write("fuzz_http", "gzip_self", b"Content-Encoding: gzip\n\n" + gzip.compress(plain))
    header = json.dumps({"inputs": [{"name": "query", "datatype": "FP32", "shape": [1, 2, 8],
                                     "parameters": {"binary_data_size": 64}}, key, mask],
                         "parameters": {"binary_data_output": True}}).encode()
    write("fuzz_http", "binary_cross", b"Inference-Header-Content-Length: %d\n\n" % len(header)
          + header + randn(1, 2, 8).tobytes())
    half = json.dumps({"inputs": [{"name": "query", "datatype": "BF16", "shape": [1, 1, 8],
                                   "parameters": {"binary_data_size": 16}}],
                       "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}
                      ).encode()
    write("fuzz_http", "binary_bf16", b"Inference-Header-Content-Length: %d\n\n" % len(half)
          + half + bytes(range(16)))


def session_seeds():
    pb, _, cfg = load_stubs()
    tensor = mha_tensor

    self_open = pb.StreamRequest(id="1", open_session=pb.OpenSessionRequest(
        model="m", session_id="s", max_tokens=64))
    write("fuzz_session", "open_self", self_open.SerializeToString())
    cross_open = pb.StreamRequest(id="2", open_session=pb.OpenSessionRequest(
        model="m", memory=tensor(randn(1, 5, 6)), memory_value=tensor(randn(1, 5, 6)),
        memory_key_padding_mask=tensor(RNG.random((1, 5)) < 0.3)))
    write("fuzz_session", "open_cross", cross_open.SerializeToString())
    append = pb.StreamRequest(id="3", append=pb.AppendRequest(
        session_id="s", query=tensor(randn(1, 3, 8)), expected_position=0, need_weights=True))
    write("fuzz_session", "append", append.SerializeToString())
    close = pb.StreamRequest(id="4", close_session=pb.CloseSessionRequest(session_id="s"))
    write("fuzz_session", "close", close.SerializeToString())
    fork = pb.StreamRequest(id="5", fork_session=pb.ForkSessionRequest(
        session_id="s", new_session_id="t"))
    write("fuzz_session", "fork", fork.SerializeToString())
    # Session files the import path accepts: a self session of the fuzzer's
    # self model (E = 8, h = 2) and a cross one of its cross model (kdim 6,
    # the same head dims), with their checksums.
    block_bytes = 2 * 32 * (4 + 4) * 4
    for name, cross, position in (("import_self", False, 3), ("import_cross", True, 5)):
        block = np.zeros(block_bytes // 4, np.float32)
        block[:] = randn(block.size)
        header = pb.SessionHeader(
            format_version=1, session_id=name, model="m", model_version=1, fingerprint=0,
            heads=2, qk_head_dim=4, v_head_dim=4, cache_dtype="FP32", position=position,
            cross=cross, max_tokens=64, idle_timeout_ms=1000, idle_left_ms=1000, blocks=1,
            block_bytes=block_bytes,
            key_padding=np.array([0, 0, 0, -np.inf, 0], np.float32).tobytes() if cross else b"")
        chunks = [pb.SessionChunk(header=header), pb.SessionChunk(block=block.tobytes()),
                  pb.SessionChunk(trailer=pb.SessionTrailer(
                      checksum=content_hash(block.tobytes())))]
        data = b"MHASESS1" + b"".join(
            len(c.SerializeToString()).to_bytes(4, "little") + c.SerializeToString()
            for c in chunks)
        write("fuzz_session", name, data)


M64 = (1 << 64) - 1
MUL_A, MUL_B = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F


def content_hash(data, seed=0):
    """server/models/content_hash.cc in Python (a check: "mha-serve" ->
    3006346188108175024), for checksums of seed session files."""
    def rotl(x, r):
        return ((x << r) | (x >> (64 - r))) & M64

    def mix(lane, word):
        return (rotl((lane + word * MUL_B) & M64, 31) * MUL_A) & M64

    def avalanche(h):
        h ^= h >> 33
        h = (h * 0xFF51AFD7ED558CCD) & M64
        h ^= h >> 33
        h = (h * 0xC4CEB9FE1A85EC53) & M64
        return h ^ (h >> 33)

    lanes = [(seed + MUL_A + MUL_B) & M64, (seed + MUL_B) & M64, seed & M64,
             (seed - MUL_A) & M64]
    full = len(data) // 32 * 32
    for pos in range(0, full, 32):
        for i in range(4):
            word = int.from_bytes(data[pos + 8 * i:pos + 8 * i + 8], "little")
            lanes[i] = mix(lanes[i], word)
    h = (rotl(lanes[0], 1) + rotl(lanes[1], 7) + rotl(lanes[2], 12) + rotl(lanes[3], 18)) & M64
    for i in range(4):
        h = (((h ^ mix(0, lanes[i])) * MUL_A) + MUL_B) & M64
    h = (h + len(data)) & M64
    for byte in data[full:]:
        h = (rotl(h ^ ((byte * MUL_B) & M64), 11) * MUL_A) & M64
    return avalanche(h)


def wire_seeds():
    """fuzz_wire: the request seeds above and a response of each API, behind
    two bytes that choose the pieces' sizes (no random numbers: the seeds
    before keep theirs)."""
    corpus = os.path.join(HERE, "corpus")
    for target in ("fuzz_request", "fuzz_kserve"):
        for name in sorted(os.listdir(os.path.join(corpus, target))):
            with open(os.path.join(corpus, target, name), "rb") as f:
                write("fuzz_wire", f"{target[5:]}_{name}", bytes([6, 200]) + f.read())
    pb, _, _ = load_stubs()
    response = pb.AttendResponse(model="m", model_version=1,
                                 output=mha_tensor(np.ones((1, 2, 8), np.float32)),
                                 attn_weights=mha_tensor(np.full((1, 2, 2), 0.5, np.float32)))
    write("fuzz_wire", "attend_response", bytes([0, 3]) + response.SerializeToString())


if __name__ == "__main__":
    model_seeds()
    request_seeds()
    kserve_seeds()
    session_seeds()
    http_seeds()  # last: the seeds before it keep their random numbers
    wire_seeds()
