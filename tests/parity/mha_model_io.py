"""File formats shared by the parity test and the demo-model writer.

* safetensors reading/writing without the `safetensors` package,
* rounding of float32 values to the precision of a storage dtype,
* config.pbtxt (protobuf text format of mha.v1.ModelConfig) formatting,
* the weight layouts mha_run understands, as conversions between a
  "canonical" parameter dict and named tensors.

Canonical parameters (numpy float32, nn.Linear convention y = x W^T + b):
  wq [h*dk, E], wk [h*dk, kdim], wv [h*dv, vdim], wo [E, h*dv],
  bq, bk, bv, bo (None when bias=False), bias_k [1,1,h*dk] and
  bias_v [1,1,h*dv] (None unless add_bias_kv), norm_w, norm_b [E]
  (None unless post-norm).
"""

import json
import struct

import numpy as np
import torch

# ----------------------------------------------------------------- safetensors

_NUMPY_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BOOL": "u1",
                 "I64": "<i8", "I32": "<i4", "U8": "u1", "I8": "i1"}
_ITEM_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "BOOL": 1,
              "I64": 8, "I32": 4, "U8": 1, "I8": 1}


def _f32_to_bf16_bits(values):
    """bf16 bit patterns (uint16) of float32 values, rounded to nearest even
    by torch, i.e. the upper 16 bits of the rounded f32 pattern."""
    t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def _bf16_bits_to_f32(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def encode_tensor(array, dtype):
    """Raw little-endian bytes of `array` stored as safetensors `dtype`."""
    if dtype == "BF16":
        return _f32_to_bf16_bits(array).astype("<u2").tobytes()
    if dtype == "BOOL":
        return np.asarray(array, dtype=bool).astype(np.uint8).tobytes()
    return np.ascontiguousarray(array, dtype=_NUMPY_DTYPES[dtype]).tobytes()


def decode_tensor(raw, dtype, shape):
    """numpy array from raw bytes; float types are widened to float32."""
    if dtype == "BF16":
        bits = np.frombuffer(raw, dtype="<u2")
        return _bf16_bits_to_f32(bits).reshape(shape)
    values = np.frombuffer(raw, dtype=_NUMPY_DTYPES[dtype])
    if dtype == "BOOL":
        values = values != 0
    elif dtype in ("F16", "F64"):
        values = values.astype(np.float32)
    return values.reshape(shape).copy()


def round_to_dtype(array, dtype):
    """The float32 values a reader gets back after storing `array` as `dtype`."""
    if dtype in ("F32", "BOOL"):
        return np.asarray(array)
    return decode_tensor(encode_tensor(array, dtype), dtype, np.shape(array))


def write_safetensors(path, tensors, metadata=None):
    """tensors: {name: (numpy array, dtype string)}; order is kept."""
    header, chunks, offset = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, (array, dtype) in tensors.items():
        raw = encode_tensor(array, dtype)
        header[name] = {"dtype": dtype, "shape": list(np.shape(array)),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    # Pad the header with spaces to 8 bytes, as the reference writer does.
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for raw in chunks:
            f.write(raw)


def read_safetensors(path):
    """{name: numpy array} (floats as float32, BOOL as bool); also returns
    {name: dtype string} so callers can check what was written."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (header_len,) = struct.unpack("<Q", blob[:8])
    if 8 + header_len > len(blob):
        raise ValueError(f"{path}: header length {header_len} past end of file")
    header = json.loads(blob[8:8 + header_len])
    data = memoryview(blob)[8 + header_len:]
    arrays, dtypes = {}, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype, shape = info["dtype"], info["shape"]
        expected = int(np.prod(shape, dtype=np.int64)) * _ITEM_SIZE[dtype]
        if end - begin != expected or end > len(data):
            raise ValueError(f"{path}: tensor {name} has bad data_offsets")
        arrays[name] = decode_tensor(bytes(data[begin:end]), dtype, shape)
        dtypes[name] = dtype
    return arrays, dtypes


# ----------------------------------------------------------------- config.pbtxt

class Enum(str):
    """A protobuf enum value: formatted without quotes."""


def format_pbtxt(message, indent=""):
    """Protobuf text format of a dict. Values: int, float, bool, str, Enum,
    dict (sub-message) or list (repeated field; a map is a list of
    {"key": .., "value": ..} dicts)."""
    lines = []
    for field, value in message.items():
        for item in (value if isinstance(value, list) else [value]):
            if isinstance(item, dict):
                inner = format_pbtxt(item, indent + "  ")
                lines.append(f"{indent}{field} {{\n{inner}{indent}}}\n"
                             if inner else f"{indent}{field} {{}}\n")
            else:
                lines.append(f"{indent}{field}: {_pbtxt_scalar(item)}\n")
    return "".join(lines)


def _pbtxt_scalar(value):
    if isinstance(value, Enum):
        return str(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a double-quoted string with escapes
    if isinstance(value, float):
        return repr(value)        # shortest round-trip form, e.g. 1e-05
    return str(int(value))


# ----------------------------------------------------------------- layouts
#
# "in_proj":  nn.MultiheadAttention state_dict with a packed in_proj_weight.
# "qkv_proj": nn.MultiheadAttention state_dict when kdim/vdim != embed_dim
#             (q_proj_weight, k_proj_weight, v_proj_weight + in_proj_bias).
# "linear":   separate nn.Linear modules q_proj, k_proj, v_proj, out_proj.
# "per_head": one nn.Linear per head: q_proj.{i}, k_proj.{i}, v_proj.{i}.

LAYOUTS = ("in_proj", "qkv_proj", "linear", "per_head")


def params_to_tensors(p, layout, num_heads):
    """{canonical tensor name: float32 array} for the given layout."""
    t = {}
    has_bias = p["bq"] is not None
    if layout == "in_proj":
        t["in_proj_weight"] = np.concatenate([p["wq"], p["wk"], p["wv"]])
    elif layout == "qkv_proj":
        t["q_proj_weight"], t["k_proj_weight"] = p["wq"], p["wk"]
        t["v_proj_weight"] = p["wv"]
    if layout in ("in_proj", "qkv_proj") and has_bias:
        t["in_proj_bias"] = np.concatenate([p["bq"], p["bk"], p["bv"]])
    if layout == "linear":
        for x in "qkv":
            t[f"{x}_proj.weight"] = p[f"w{x}"]
            if has_bias:
                t[f"{x}_proj.bias"] = p[f"b{x}"]
    if layout == "per_head":
        t.update(_split_heads(p, num_heads, has_bias))
    t["out_proj.weight"] = p["wo"]
    if has_bias:
        t["out_proj.bias"] = p["bo"]
    _copy_optional(p, t, [("bias_k", "bias_k"), ("bias_v", "bias_v"),
                          ("norm_w", "norm.weight"), ("norm_b", "norm.bias")])
    return t


def tensors_to_params(t, layout, num_heads):
    """Inverse of params_to_tensors (used to get the canonical parameters
    back after rounding each stored tensor to its storage dtype)."""
    p = dict.fromkeys(["bq", "bk", "bv", "bo", "bias_k", "bias_v",
                       "norm_w", "norm_b"])
    if layout == "in_proj":
        p["wq"], p["wk"], p["wv"] = np.split(t["in_proj_weight"], 3)
    elif layout == "qkv_proj":
        p["wq"], p["wk"] = t["q_proj_weight"], t["k_proj_weight"]
        p["wv"] = t["v_proj_weight"]
    if "in_proj_bias" in t:
        # q and k outputs have the same width; v's may differ in general.
        dqk = p["wq"].shape[0]
        b = t["in_proj_bias"]
        p["bq"], p["bk"], p["bv"] = b[:dqk], b[dqk:2 * dqk], b[2 * dqk:]
    for x in "qkv":
        if layout == "linear":
            p[f"w{x}"] = t[f"{x}_proj.weight"]
            p[f"b{x}"] = t.get(f"{x}_proj.bias")
        elif layout == "per_head":
            heads = range(num_heads)
            p[f"w{x}"] = np.concatenate([t[f"{x}_proj.{i}.weight"] for i in heads])
            if f"{x}_proj.0.bias" in t:
                p[f"b{x}"] = np.concatenate([t[f"{x}_proj.{i}.bias"] for i in heads])
    p["wo"], p["bo"] = t["out_proj.weight"], t.get("out_proj.bias")
    _copy_optional(t, p, [("bias_k", "bias_k"), ("bias_v", "bias_v"),
                          ("norm.weight", "norm_w"), ("norm.bias", "norm_b")])
    return p


def _split_heads(p, num_heads, has_bias):
    t = {}
    for x in "qkv":
        weights = np.split(p[f"w{x}"], num_heads)
        biases = np.split(p[f"b{x}"], num_heads) if has_bias else None
        for i in range(num_heads):
            t[f"{x}_proj.{i}.weight"] = weights[i]
            if has_bias:
                t[f"{x}_proj.{i}.bias"] = biases[i]
    return t


def _copy_optional(src, dst, name_pairs):
    for src_name, dst_name in name_pairs:
        if src.get(src_name) is not None:
            dst[dst_name] = src[src_name]
