"""The two files of an mha-serve model folder, written and read by our own
code (no `safetensors` package):

* weights.safetensors: u64 little-endian header length, a JSON header
  {name: {dtype, shape, data_offsets}} padded with spaces to 8 bytes, then
  the raw little-endian tensor bytes;
* config.pbtxt: protobuf text format of mha.v1.ModelConfig, formatted from a
  plain dict (format_pbtxt), so writing a model needs no generated stubs.

Used by mha_export.py and by the tests (tests/parity/mha_model_io.py
re-exports these names). Every function is pure or touches only the paths
it is given; nothing here keeps state.
"""

import json
import os
import struct

import numpy as np

# ----------------------------------------------------------------- safetensors

_NUMPY_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "BOOL": "u1",
                 "I64": "<i8", "I32": "<i4", "U8": "u1", "I8": "i1"}
_ITEM_SIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "BOOL": 1,
              "I64": 8, "I32": 4, "U8": 1, "I8": 1}


def _f32_to_bf16_bits(values):
    """bf16 bit patterns (uint16) of float32 values, rounded to nearest even
    by torch, i.e. the upper 16 bits of the rounded f32 pattern."""
    import torch  # only BF16 needs it
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
    """tensors: {name: (numpy array, dtype string)}; order is kept.
    metadata: optional {str: str}, stored as the header's __metadata__."""
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


# ----------------------------------------------------------------- a folder

CONFIG_FILE = "config.pbtxt"
WEIGHTS_FILE = "weights.safetensors"


def write_model_folder(model_dir, config, tensors, metadata=None):
    """Writes model_dir/config.pbtxt (from the dict `config`, see
    format_pbtxt) and model_dir/weights.safetensors (`tensors` as for
    write_safetensors); creates model_dir if needed, overwrites both files."""
    os.makedirs(model_dir, exist_ok=True)
    write_safetensors(os.path.join(model_dir, WEIGHTS_FILE), tensors, metadata)
    with open(os.path.join(model_dir, CONFIG_FILE), "w") as f:
        f.write(format_pbtxt(config))
