#!/usr/bin/python3
"""The Python clients' wire code (client/python/mha_wire.py) against
protobuf's own parser and writer, without a server:

* attend_request_bytes writes the message protobuf writes for the same
  arrays (every dtype, masks, non-contiguous and big-endian arrays), and
  copies no array that is already C-contiguous in its wire dtype before;
* read_message reads what protobuf reads, on responses and on every one-byte
  change and truncation of a small one (the same fields, the same refusals);
* tensors come back as read-only views of the received bytes.

  /usr/bin/python3 tests/client/test_python_wire.py
"""

import os
import resource
import sys
import unittest

import numpy as np
from google.protobuf.message import DecodeError

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "server"))  # the shared harness
from mha_test_server import load_stubs  # noqa: E402  (puts client/python on sys.path)
import mha_client  # noqa: E402
import mha_wire  # noqa: E402

pb, _, cfg = load_stubs()
RESPONSE_PAYLOADS = {1: {3: None}, 2: {3: None}}


def protobuf_request(model, query, key=None, value=None, key_padding_mask=None,
                     attn_mask=None, **flags):
    """The same request built the protobuf way (to_tensor)."""
    request = pb.AttendRequest(model=model, query=mha_client.to_tensor(query), **flags)
    mha_client._set_optional(request, {"key": key, "value": value},
                             {"key_padding_mask": key_padding_mask, "attn_mask": attn_mask})
    return request


def with_payloads(message, buf, payloads):
    """`message` with the payloads read apart put back into it."""
    for path, (offset, length) in payloads.items():
        tensor = message.output if path[0] == 1 else message.attn_weights
        tensor.data = buf[offset:offset + length]
    return message


class RequestBytesTest(unittest.TestCase):

    def test_every_dtype_and_layout_writes_what_protobuf_writes(self):
        rng = np.random.default_rng(0)
        q = rng.standard_normal((2, 5, 8)).astype(np.float32)
        cases = [
            dict(query=q),
            dict(query=q.astype(np.float64), is_causal=True, need_weights=True),
            dict(query=q.astype(np.float16), per_head_weights=True),
            dict(query=q[:, ::2], key=q.astype(">f4"), value=np.asfortranarray(q[0])[None]),
            dict(query=q, key_padding_mask=rng.random((2, 5)) < 0.5,
                 attn_mask=rng.standard_normal((5, 5)).astype(np.float64)),
            dict(query=q[:, :0]),  # an empty tensor
        ]
        for case in cases:
            with self.subTest(case=sorted(case)):
                written = mha_client.attend_request_bytes("demo", **case)
                self.assertEqual(pb.AttendRequest.FromString(written),
                                 protobuf_request("demo", **case))

    def test_contiguous_arrays_in_their_wire_dtype_are_not_copied_before_the_message(self):
        q = np.ones((2, 3, 8), np.float32)
        for array, dtype in ((q, "<f4"), (q.astype(np.float16), "<f2")):
            self.assertTrue(np.shares_memory(mha_wire.little_endian(array, dtype), array))
            view = mha_wire.bytes_of(mha_wire.little_endian(array, dtype))
            self.assertEqual(view.nbytes, array.nbytes)
            self.assertTrue(np.shares_memory(np.frombuffer(view, np.uint8), array))
        self.assertFalse(np.shares_memory(mha_wire.little_endian(q.astype(np.float64), "<f4"), q))


class ResponseReadTest(unittest.TestCase):

    def response(self, rows=3, weights=True):
        r = pb.AttendResponse(model="demo", model_version=2,
                              output=mha_client.to_tensor(np.arange(rows * 8, dtype=np.float32)
                                                          .reshape(1, rows, 8)))
        if weights:
            r.attn_weights.CopyFrom(mha_client.to_tensor(np.full((1, rows, rows), 0.5, np.float32)))
        return r

    def check_agrees(self, buf):
        try:
            expected = pb.AttendResponse.FromString(buf)
        except DecodeError:
            with self.assertRaises(DecodeError):
                mha_wire.read_message(pb.AttendResponse, buf, RESPONSE_PAYLOADS)
            return
        message, payloads = mha_wire.read_message(pb.AttendResponse, buf, RESPONSE_PAYLOADS)
        self.assertEqual(with_payloads(message, buf, payloads), expected, buf.hex())

    def test_outputs_are_read_only_views_of_the_received_bytes(self):
        buf = self.response(rows=300).SerializeToString()
        message, payloads = mha_wire.read_message(pb.AttendResponse, buf, RESPONSE_PAYLOADS)
        self.assertEqual(message.output.data, b"")  # left in `buf`
        output = mha_client._array_of(message.output, buf, payloads[(1, 3)])
        self.assertEqual(output.shape, (1, 300, 8))
        np.testing.assert_array_equal(output.reshape(-1), np.arange(2400, dtype=np.float32))
        self.assertFalse(output.flags.writeable)
        self.assertTrue(np.shares_memory(output, np.frombuffer(buf, np.uint8)))
        half = pb.AttendResponse(output=mha_client.to_tensor(np.ones((2, 4), np.float16)))
        buf = half.SerializeToString()
        message, payloads = mha_wire.read_message(pb.AttendResponse, buf, RESPONSE_PAYLOADS)
        out = mha_client._array_of(message.output, buf, payloads[(1, 3)])
        self.assertEqual(out.dtype, np.float16)
        self.assertTrue(np.shares_memory(out, np.frombuffer(buf, np.uint8)))

    def test_every_one_byte_change_and_truncation_is_read_as_protobuf_reads_it(self):
        good = self.response(rows=2).SerializeToString()
        for at in range(len(good)):
            self.check_agrees(good[:at])
            for value in (0x00, 0x01, 0x02, 0x03, 0x07, 0x0A, 0x12, 0x1A, 0x7F, 0x80, 0xFF):
                self.check_agrees(good[:at] + bytes([value]) + good[at + 1:])

    def test_repeated_fields_groups_and_long_encodings_are_read_as_protobuf_reads_them(self):
        one, two = self.response(rows=2), self.response(rows=3, weights=False)
        merged = one.SerializeToString() + two.SerializeToString()
        self.check_agrees(merged)
        for prefix in (b"\x5b\x08\x01\x5c", b"\x8a\x00\x00", b"\x0a\x80\x00", b"\x0a\x81\x00z"):
            self.check_agrees(prefix + one.SerializeToString())



class FreedPagesTest(unittest.TestCase):
    """What a large call allocates (its request, gRPC's copy, the answer:
    here three blocks of 16 MiB, written whole) is faulted in once, not at
    every call: glibc would otherwise give it back and map it again."""

    def test_a_clients_large_blocks_keep_their_pages_from_call_to_call(self):
        mha_client.MhaClient("127.0.0.1:1").close()  # a client sets it up
        self.assertTrue(mha_wire.keep_freed_pages())  # Debian's glibc

        def page_faults_of_a_call():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            blocks = [b"x" * (16 << 20) for _ in range(3)]
            del blocks
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

        page_faults_of_a_call()  # the first call maps its pages
        later = [page_faults_of_a_call() for _ in range(3)]
        self.assertLess(max(later), 1024, later)  # 12,288 pages of 4 KiB a call without


if __name__ == "__main__":
    unittest.main()
