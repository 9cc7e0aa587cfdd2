"""Protobuf's wire format around tensor bytes, for the Python clients.

A request's tensors go into the message with one copy of their bytes (no
astype, tobytes or protobuf field in between); a response's tensors come
back as numpy arrays over the received bytes (read-only views; no copy when
the dtype is numpy's). Every other field goes through protobuf as usual,
and anything unusual in a response's encoding is parsed by protobuf whole.
The bytes are the same as protobuf's: any server or client reads them.
"""

import ctypes
import ctypes.util

import numpy as np

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5

# glibc's mallopt parameters (malloc.h), and what the clients set them to.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 << 20   # glibc's largest: blocks below it come from the heap
_TRIM_THRESHOLD = 256 << 20  # freed heap kept for the next call, at most
_kept = None


def keep_freed_pages():
    """Has this process keep the pages of large freed blocks for its next
    call (glibc's mallopt; elsewhere nothing). By default glibc maps every
    block from 128 KiB apart and gives it back when freed, or trims the
    heap once 32 MiB are free: a call of 16 MiB each way then faults in its
    request, gRPC's copy of it and the answer afresh every time, which
    doubled a Python call's cost above compute (AMD EPYC VM: 35-41 ms
    against 23-28). Blocks below 32 MiB now come from the heap, and up to
    256 MiB of freed heap is kept. Idempotent; returns whether it applied."""
    global _kept
    if _kept is None:
        _kept = False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):  # not glibc
            return False
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        _kept = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and
                     mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return _kept


class _Unusual(Exception):
    """An encoding the fast reader leaves to protobuf."""


def varint(value):
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def tag(number):
    """The tag of length-delimited field `number`."""
    return varint(number << 3 | _LENGTH)


def little_endian(array, dtype):
    """`array` as a C-contiguous array of `dtype` (little-endian): the array
    itself when it is one, else converted once."""
    return np.ascontiguousarray(array, dtype=dtype)


def bytes_of(array):
    """The bytes of a C-contiguous array, without a copy."""
    return memoryview(array.reshape(-1).view(np.uint8))


def message_with_bytes(number, fields, data_number, data):
    """The parts of message field `number`: its serialized `fields`, then
    bytes field `data_number` holding `data` (bytes-like, not copied)."""
    inner = fields + tag(data_number) + varint(len(data))
    return [tag(number), varint(len(inner) + len(data)), inner, data]


def _read_varint(buf, pos, end, limit=10):
    value = shift = 0
    for _ in range(limit):
        if pos >= end:
            raise _Unusual()
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise _Unusual()


def _split(buf, spec, start, end, path, payloads):
    """The fields of buf[start:end] except the payloads named in `spec`
    ({number: None for a bytes payload, or {...} for a message holding
    some}), which are appended to `payloads` as (path, offset, length)."""
    header = bytearray()
    pos = start
    while pos < end:
        tag_start = pos
        key, pos = _read_varint(buf, pos, end, 5)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise _Unusual()
        if wire_type == _VARINT:
            _, pos = _read_varint(buf, pos, end)
        elif wire_type in (_FIXED64, _FIXED32):
            pos += 8 if wire_type == _FIXED64 else 4
            if pos > end:
                raise _Unusual()
        elif wire_type == _LENGTH:
            size, data = _read_varint(buf, pos, end, 5)
            if data + size > end:
                raise _Unusual()
            if number in spec:
                header += buf[tag_start:pos]
                if spec[number] is None:
                    payloads.append((path + (number,), data, size))
                    header += b"\x00"
                else:
                    inner = _split(buf, spec[number], data, data + size, path + (number,),
                                   payloads)
                    header += varint(len(inner)) + inner
                pos = data + size
                continue
            pos = data + size
        else:  # groups and invalid types
            raise _Unusual()
        header += buf[tag_start:pos]
    return header


def read_message(message_class, buf, spec):
    """(message, {path: (offset, length)}): `buf` parsed by protobuf except
    the payloads of `spec` (left empty in the message; the last of a path
    wins, as in protobuf), or parsed whole ({} then)."""
    try:
        found = []
        header = _split(buf, spec, 0, len(buf), (), found)
    except _Unusual:
        return message_class.FromString(buf), {}
    return message_class.FromString(bytes(header)), {p: (o, n) for p, o, n in found}


# numpy dtypes of mha.v1's DataType values and KServe's datatypes that numpy has.
NUMPY_OF = {"FP32": np.dtype("<f4"), "FP16": np.dtype("<f2"), "BOOL": np.dtype(np.uint8)}


def array_of(datatype, buf, offset, length, shape):
    """A tensor of KServe's `datatype` (FP32, FP16, BF16, BOOL) held in
    buf[offset:offset + length], as numpy: a read-only view for FP32 and FP16,
    float32 for BF16 (numpy has none), bool for BOOL."""
    if datatype == "BF16":
        bits = np.frombuffer(buf, dtype="<u2", count=length // 2, offset=offset)
        return (bits.astype(np.uint32) << 16).view(np.float32).reshape(shape)
    if datatype not in NUMPY_OF:
        raise ValueError(f"tensor has unknown datatype {datatype}")
    dtype = NUMPY_OF[datatype]
    values = np.frombuffer(buf, dtype=dtype, count=length // dtype.itemsize, offset=offset)
    if datatype == "BOOL":
        return values.view(np.bool_).reshape(shape)
    return values.reshape(shape)


# ------------------------------------------------------- session files

SESSION_FILE_MAGIC = b"MHASESS1"


def session_file_bytes(chunks):
    """SessionChunk messages as session bytes: the magic, then each chunk's
    4-byte little-endian length and bytes (proto/mha/v1/session_file.h)."""
    out = [SESSION_FILE_MAGIC]
    for chunk in chunks:
        data = chunk.SerializeToString()
        out += [len(data).to_bytes(4, "little"), data]
    return b"".join(out)


def session_chunks(pb, data):
    """The SessionChunk messages of session bytes (Session.export, a spill
    file); ValueError when they are not that format."""
    if data[:8] != SESSION_FILE_MAGIC:
        raise ValueError("not a session file (no MHASESS1 header)")
    pos = 8
    while pos < len(data):
        if pos + 4 > len(data):
            raise ValueError("truncated session data")
        size = int.from_bytes(data[pos:pos + 4], "little")
        if pos + 4 + size > len(data):
            raise ValueError("truncated session data")
        chunk = pb.SessionChunk()
        chunk.ParseFromString(data[pos + 4:pos + 4 + size])
        pos += 4 + size
        yield chunk
