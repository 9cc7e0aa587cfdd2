#!/usr/bin/python3
"""Triton's sequences (issue 36) on the real mha_server, through Triton's own
message definitions (tests/server/triton_messages.py), checked against PyTorch.

    MHA_SERVER=build/mha_server /usr/bin/python3 tests/server/test_sequences.py

A ModelInfer request with `sequence_id` is a session step: the start opens a
session and appends, later requests append, the end is computed and closes
it. Each answer equals that request's rows of one causal pass over the whole
sequence (a cross sequence's: attention over the memory its start carried).
Unary and streamed requests, int and string ids, a start on an open id, the
refusals, idle expiry, and the shared registry and metrics are checked.
"""

import os
import sys
import tempfile
import time
import unittest

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mha_test_server import TestServer, metric_value, wait_for  # noqa: E402
from test_server import (CROSS_E, CROSS_KDIM, CROSS_VDIM, DEMO_E, MHA_SERVER,  # noqa: E402
                         make_repository, randn, reference)
from triton_messages import triton_server_per_class, triton_stubs  # noqa: E402
import mha_client  # noqa: E402

tpb, trpc = triton_stubs()
TOL = 1e-5
TIMEOUT = 60
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def infer_request(model, seq_id=None, start=False, end=False, outputs=(), **arrays):
    """A ModelInferRequest as tritonclient builds one: raw contents, and the
    sequence parameters only when there is a sequence id."""
    request = tpb.ModelInferRequest(model_name=model, id="r")
    for name, a in arrays.items():
        a = np.asarray(a)
        datatype = "BOOL" if a.dtype == np.bool_ else "FP32"
        request.inputs.add(name=name, datatype=datatype, shape=a.shape)
        request.raw_input_contents.append(
            a.astype(np.uint8).tobytes() if a.dtype == np.bool_ else a.astype("<f4").tobytes())
    for name in outputs:
        request.outputs.add(name=name)
    if seq_id is not None:
        if isinstance(seq_id, str):
            request.parameters["sequence_id"].string_param = seq_id
        else:
            request.parameters["sequence_id"].int64_param = seq_id
        request.parameters["sequence_start"].bool_param = start
        request.parameters["sequence_end"].bool_param = end
    return request


def outputs_of(response):
    """{name: float32 array} of a ModelInferResponse."""
    return {o.name: np.frombuffer(raw, dtype="<f4").reshape(tuple(o.shape))
            for o, raw in zip(response.outputs, response.raw_output_contents)}


class SequenceTest(triton_server_per_class()):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.client = mha_client.MhaClient(cls.server.target(), timeout=TIMEOUT)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        super().tearDownClass()

    def assert_close(self, actual, expected, what):
        np.testing.assert_allclose(actual, expected, rtol=TOL, atol=TOL, err_msg=what)

    def infer(self, request):
        return outputs_of(self.triton.ModelInfer(request, timeout=TIMEOUT))

    def refused(self, request, code=INVALID):
        with self.assertRaises(grpc.RpcError) as e:
            self.triton.ModelInfer(request, timeout=TIMEOUT)
        self.assertEqual(e.exception.code(), code, e.exception.details())
        self.assertTrue(e.exception.details())
        return e.exception.details()

    def sessions(self):
        return {s.session_id: s for s in self.client.list_sessions()}

    def test_a_sequence_in_chunks_equals_one_causal_pass(self):
        rng = np.random.default_rng(1)
        x = randn(rng, 1, 23, DEMO_E)
        want, want_w = reference(self.models["demo"], x, is_causal=True)
        bounds = [0, 1, 5, 18, 23]
        tokens_before = metric_value(self.server.metrics(), "mha_append_tokens_total")
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            last = b == bounds[-1]
            out = self.infer(infer_request("demo", 41, start=i == 0, end=last,
                                           outputs=("output", "attn_weights"),
                                           query=x[:, a:b]))
            what = f"tokens {a}..{b}"
            self.assert_close(out["output"], want[:, a:b], what)
            self.assertEqual(out["attn_weights"].shape, (1, b - a, b), what)
            self.assert_close(out["attn_weights"], want_w[:, a:b, :b], what)
            if not last:  # the same registry as mha.v1's sessions
                self.assertEqual(self.sessions()["sequence/demo/41"].position, b)
        self.assertNotIn("sequence/demo/41", self.sessions(), "the end closes the session")
        self.assertEqual(metric_value(self.server.metrics(), "mha_append_tokens_total"),
                         tokens_before + 23)
        details = self.refused(infer_request("demo", 41, query=x[:, :1]))
        self.assertIn("closed", details)
        self.assertIn("sequence_start", details)

    def test_a_cross_sequence_attends_to_the_memory_of_its_start(self):
        rng = np.random.default_rng(2)
        memory, value = randn(rng, 1, 19, CROSS_KDIM), randn(rng, 1, 19, CROSS_VDIM)
        padding = np.zeros((1, 19), dtype=bool)
        padding[0, 15:] = True
        q = randn(rng, 1, 5, CROSS_E)
        want, want_w = reference(self.models["cross"], q, memory, value,
                                 key_padding_mask=padding)
        out1 = self.infer(infer_request("cross", "dec-1", start=True, query=q[:, :2], key=memory,
                                        value=value, key_padding_mask=padding))
        self.assertTrue(self.sessions()["sequence/cross/dec-1"].cross)
        details = self.refused(infer_request("cross", "dec-1", query=q[:, 2:], key=memory))
        self.assertIn("sequence_start request only", details)
        out2 = self.infer(infer_request("cross", "dec-1", end=True, query=q[:, 2:],
                                        outputs=("output", "attn_weights")))
        self.assert_close(np.concatenate([out1["output"], out2["output"]], axis=1), want,
                          "cross outputs")
        self.assert_close(out2["attn_weights"], want_w[:, 2:], "cross weights")
        self.assertNotIn("sequence/cross/dec-1", self.sessions())

    def test_a_start_on_an_open_id_ends_the_old_sequence(self):
        rng = np.random.default_rng(3)
        old, new = randn(rng, 1, 6, DEMO_E), randn(rng, 1, 4, DEMO_E)
        self.infer(infer_request("demo", 7, start=True, query=old))
        self.assertEqual(self.sessions()["sequence/demo/7"].position, 6)
        out = self.infer(infer_request("demo", 7, start=True, query=new))
        want, _ = reference(self.models["demo"], new, is_causal=True)
        self.assert_close(out["output"], want, "a fresh sequence")
        self.assertEqual(self.sessions()["sequence/demo/7"].position, 4)
        self.infer(infer_request("demo", 7, end=True, query=new[:, :1]))

    def test_a_stream_carries_interleaved_sequences_in_order(self):
        rng = np.random.default_rng(4)
        xs = {1: randn(rng, 1, 9, DEMO_E), "s-2": randn(rng, 1, 9, DEMO_E)}
        wants = {k: reference(self.models["demo"], x, is_causal=True)[0] for k, x in xs.items()}
        requests, expected = [], []
        for i in range(9):  # one token each, the two sequences alternating
            for k, x in xs.items():
                r = infer_request("demo", k, start=i == 0, end=i == 8, query=x[:, i:i + 1])
                r.id = f"{k}-{i}"
                r.parameters["triton_enable_empty_final_response"].bool_param = True
                requests.append(r)
                expected[len(expected):] = [(r.id, wants[k][:, i:i + 1])]
        responses = list(self.triton.ModelStreamInfer(iter(requests), timeout=TIMEOUT))
        self.assertEqual(len(responses), len(requests))
        got = {}
        for r in responses:
            self.assertEqual(r.error_message, "")
            self.assertTrue(r.infer_response.parameters["triton_final_response"].bool_param)
            got[r.infer_response.id] = outputs_of(r.infer_response)["output"]
        for rid, want in expected:
            self.assert_close(got[rid], want, rid)
        self.assertFalse([s for s in self.sessions() if s.startswith("sequence/demo/")])

    def test_refusals_say_what_is_wrong(self):
        rng = np.random.default_rng(5)
        q = randn(rng, 1, 2, DEMO_E)
        details = self.refused(infer_request("demo", 999, query=q))
        self.assertIn("not open", details)
        self.assertIn("sequence_start", details)
        bad = infer_request("demo", query=q)
        bad.parameters["sequence_start"].bool_param = True
        self.assertIn("need a sequence_id", self.refused(bad))
        bad = infer_request("demo", 5, start=True, query=q)
        bad.parameters["sequence_id"].double_param = 5.0
        self.assertIn("sequence_id", self.refused(bad))
        self.assertIn("sequence_id", self.refused(
            infer_request("demo", "no spaces please", start=True, query=q)))
        self.assertIn("one sequence per step", self.refused(
            infer_request("demo", 5, start=True, query=randn(rng, 2, 2, DEMO_E))))
        self.assertIn("attn_mask", self.refused(
            infer_request("demo", 5, start=True, query=q, attn_mask=np.zeros((2, 2), bool))))
        self.assertIn("query", self.refused(
            infer_request("demo", 5, start=True, query=randn(rng, 1, 2, DEMO_E + 1))))
        self.assertNotIn("sequence/demo/5", self.sessions(), "a refused start leaves nothing")
        # A cross-attention model opens only cross sequences.
        self.refused(infer_request("cross", 6, start=True, query=randn(rng, 1, 2, CROSS_E)))
        self.assertNotIn("sequence/cross/6", self.sessions())
        self.refused(infer_request("nosuch", 1, start=True, query=q), grpc.StatusCode.NOT_FOUND)


class SequenceExpiryTest(unittest.TestCase):
    def test_an_idle_sequence_expires_like_a_session(self):
        with tempfile.TemporaryDirectory() as tmp:
            models = make_repository(tmp, ("demo",))
            with TestServer(MHA_SERVER, tmp, ["--session_idle_timeout_s=1"]) as server:
                triton = trpc.GRPCInferenceServiceStub(server.channel())
                x = randn(np.random.default_rng(6), 1, 3, DEMO_E)
                triton.ModelInfer(infer_request("demo", 3, start=True, query=x[:, :2]),
                                  timeout=TIMEOUT)
                time.sleep(1.5)
                with self.assertRaises(grpc.RpcError) as e:
                    triton.ModelInfer(infer_request("demo", 3, query=x[:, 2:]), timeout=TIMEOUT)
                self.assertEqual(e.exception.code(), INVALID)
                self.assertIn("expired", e.exception.details())
                wait_for(lambda: metric_value(server.metrics(), "mha_sessions_active") == 0,
                         what="the expired session's gauge")
                del models


if __name__ == "__main__":
    unittest.main()
