#!/usr/bin/python3
"""The Python HTTP client (client/python/mha_http.py) against the real
mha_server: every dtype and large binary tensors against PyTorch, tensors
refused before any call, errors with their codes, sessions as Triton's
sequences.

    MHA_SERVER=build/mha_server /usr/bin/python3 tests/server/test_http_client.py
"""

import os
import sys
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_http import HttpServerTest, cross_inputs, json_input  # noqa: E402
from test_server import DEMO_E, reference  # noqa: E402
from mha_local_server import free_port  # noqa: E402  (on the path test_http set)


class PythonHttpClientTest(HttpServerTest):
    """mha_http.MhaHttpClient: MhaClient's attend over HTTP, stdlib + numpy."""

    def test_attend_matches_pytorch_in_every_dtype(self):
        from mha_http import MhaHttpClient
        rng, query, key, value, pad = cross_inputs(7, 4, 6, padded_row=1, padded_from=4)
        additive = np.where(rng.random((4, 6)) < 0.3, -np.inf, 0).astype(np.float32)
        with MhaHttpClient(f"http://127.0.0.1:{self.http_port}") as client:
            self.assertTrue(client.ready())
            self.assertEqual(client.get_model("cross")["name"], "cross")
            out, weights = client.attend("cross", query, key, value, key_padding_mask=pad,
                                         attn_mask=additive, need_weights=True)
            want, want_weights = reference(self.models["cross"], query, key, value,
                                           key_padding_mask=pad, attn_mask=additive)
            np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(weights, want_weights, atol=1e-5, rtol=1e-5)
            self.assertEqual(out.dtype, np.float32)
            out64, none = client.attend("cross", query.astype(np.float64), key, value)
            self.assertIsNone(none)
            self.assertEqual(out64.dtype, np.float64)
            out16, _ = client.attend("cross", query.astype(np.float16), key.astype(np.float16),
                                     value.astype(np.float16))
            self.assertEqual((out16.dtype, out16.shape), (np.float16, query.shape))
            self.assertLess(np.abs(out16.astype(np.float32) - reference(
                self.models["cross"], query, key, value)[0]).max(), 0.05)

    def test_large_binary_requests_and_answers_match_pytorch(self):
        # 1 MiB in, 1 MiB + 1 MiB of weights out: the server reads the
        # binary inputs where they are in the body and sends each output
        # from its own buffer; the client sends the arrays without joining
        # them and returns read-only views of the answer's bytes.
        from mha_http import MhaHttpClient
        rng = np.random.default_rng(17)
        query = rng.standard_normal((4, 256, DEMO_E)).astype(np.float32)
        with MhaHttpClient(f"http://127.0.0.1:{self.http_port}") as client:
            out, weights = client.attend("demo", query, need_weights=True)
            want, want_weights = reference(self.models["demo"], query)
            np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(weights, want_weights, atol=1e-5, rtol=1e-5)
            self.assertFalse(out.flags.writeable)
            self.assertFalse(out.flags.owndata)
            half, _ = client.attend("demo", query.astype(np.float16))
            self.assertEqual(half.dtype, np.float16)
            self.assertLess(np.abs(half.astype(np.float32) - want).max(), 0.05)

    def test_misread_tensors_are_refused_before_any_call_and_errors_carry_codes(self):
        from mha_http import HttpError, MhaHttpClient
        query = np.zeros((1, 2, DEMO_E), np.float32)
        with MhaHttpClient(f"127.0.0.1:{self.http_port}") as client:
            with self.assertRaisesRegex(TypeError, "int64 mask"):
                client.attend("demo", query, key_padding_mask=np.zeros((1, 2), np.int64))
            with self.assertRaisesRegex(TypeError, r"int32 tensor: use float32, float64 or "
                                        r"float16 \(bool only for masks\)"):
                client.attend("demo", query.astype(np.int32))
            with self.assertRaises(HttpError) as e:
                client.attend("nothing", query)
            self.assertEqual((e.exception.status, e.exception.code()), (404, "NOT_FOUND"))
            with self.assertRaises(HttpError) as e:
                client.attend("demo", np.zeros((1, 2, DEMO_E - 1), np.float32))
            self.assertEqual(e.exception.code(), "INVALID_ARGUMENT")
            self.assertIn("query", e.exception.details())
            # An answer over the message limit never passes as asked: 413,
            # RESOURCE_EXHAUSTED as over gRPC, not retryable (it was 503).
            with self.assertRaises(HttpError) as e:
                client.attend("demo", np.zeros((1, 1500, DEMO_E), np.float32), need_weights=True)
            self.assertEqual((e.exception.status, e.exception.code(), e.exception.retryable()),
                             (413, "RESOURCE_EXHAUSTED", False))
            self.assertIn("attn_weights would be", e.exception.details())
        with self.assertRaises(HttpError) as e:
            MhaHttpClient(f"http://127.0.0.1:{free_port()}", timeout=5).attend("demo", query)
        self.assertEqual((e.exception.code(), e.exception.retryable()), ("UNAVAILABLE", True))


    def test_sessions_are_sequences_and_match_pytorch(self):
        from mha_http import MhaHttpClient
        rng = np.random.default_rng(11)
        x = rng.standard_normal((1, 7, DEMO_E)).astype(np.float32)
        want, want_w = reference(self.models["demo"], x, is_causal=True)
        _, query, key, value, pad = cross_inputs(12, 3, 5, padded_row=0, padded_from=4)
        query, key, value, pad = query[:1], key[:1], value[:1], pad[:1]
        cross_want, _ = reference(self.models["cross"], query, key, value, key_padding_mask=pad)
        with MhaHttpClient(f"127.0.0.1:{self.http_port}") as client:
            with client.open_session("demo") as session:
                self.assertEqual((session.position, session.cross), (0, False))
                np.testing.assert_allclose(session.append(x[:, :4]), want[:, :4], atol=1e-5,
                                           rtol=1e-5)
                out, weights = session.append(x[0, 4:], need_weights=True)  # [T, E]
                np.testing.assert_allclose(out, want[0, 4:], atol=1e-5, rtol=1e-5)
                np.testing.assert_allclose(weights, want_w[0, 4:], atol=1e-5, rtol=1e-5)
                self.assertEqual(session.position, 7)
                sequence_id = session.id
            # Closed by a sequence_end without tokens: the id is not open.
            message = self.expect_error(
                400, "POST", "/v2/models/demo/infer",
                {"inputs": [json_input("query", x[:, :1])],
                 "parameters": {"sequence_id": sequence_id}})
            self.assertIn("is not open", message)
            session.close()  # again: nothing to do
            with self.assertRaisesRegex(ValueError, "closed"):
                session.append(x[:, :1])
            with client.open_session("cross", key, value, pad, session_id="http-cross") as cross:
                self.assertTrue(cross.cross)
                for t in range(3):
                    np.testing.assert_allclose(cross.append(query[:, t:t + 1]),
                                               cross_want[:, t:t + 1], atol=1e-5, rtol=1e-5)
            # A session that never appended sent nothing, and closes quietly.
            client.open_session("demo").close()
            with client.open_session("demo") as unknown:
                with self.assertRaises(Exception) as e:
                    unknown.append(np.zeros((1, 1, DEMO_E - 1), np.float32))
                self.assertEqual(e.exception.code(), "INVALID_ARGUMENT")

    def test_an_end_without_tokens_only_ends_the_sequence(self):
        x = np.ones((1, 2, DEMO_E), np.float32)
        empty = {"name": "query", "datatype": "FP32", "shape": [1, 0, DEMO_E], "data": []}
        self.call_json("POST", "/v2/models/demo/infer", {
            "inputs": [json_input("query", x)],
            "parameters": {"sequence_id": "e", "sequence_start": True}})
        answer = self.call_json("POST", "/v2/models/demo/infer", {
            "inputs": [empty],
            "parameters": {"sequence_id": "e", "sequence_end": True}})
        self.assertEqual(answer["outputs"][0]["shape"], [1, 0, DEMO_E])
        self.assertEqual(answer["outputs"][0]["data"], [])
        # Not on a start, and not on an id that is not open.
        for parameters, needle in (({"sequence_start": True}, "has no tokens"),
                                   ({"sequence_end": True}, "is not open")):
            message = self.expect_error(400, "POST", "/v2/models/demo/infer", {
                "inputs": [empty],
                "parameters": {"sequence_id": "e", **parameters}})
            self.assertIn(needle, message)


if __name__ == "__main__":
    unittest.main()
