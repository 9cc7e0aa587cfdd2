#!/usr/bin/python3
"""KServe v2 / Open Inference Protocol tests against the real mha_server.

    /usr/bin/python3 tests/server/test_kserve.py [unittest options]

A Python client on stubs generated from proto/inference/grpc_service.proto
calls every RPC of inference.GRPCInferenceService. ModelInfer must answer
exactly what Attend answers (bit for bit, same status codes and messages),
and PyTorch's numbers. Calls are sequential, so each runs alone in its batch
on both APIs.
"""

import os
import sys
import tempfile
import unittest

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mha_test_server import (OneServerPerClass, TestServer, from_wire, half_tensor,  # noqa: E402
                             load_stubs, metric_value, tensor)
from test_server import (CROSS_E, CROSS_KDIM, CROSS_VDIM, DEMO_E, DEMO_H, MHA_SERVER,  # noqa: E402
                         make_repository, reference)
import mha_client  # noqa: E402

pb, rpc, cfg = load_stubs()
kpb, krpc = mha_client.load_kserve_stubs()
TIMEOUT = 30.0
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def bf16_bytes(array):
    """float32 -> bf16 bytes, rounding to nearest even (as torch does)."""
    import torch
    t = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().tobytes()


class Inputs:
    """One request's tensors as numpy arrays (bool masks, float data)."""

    def __init__(self, **arrays):
        self.arrays = {k: np.asarray(v) for k, v in arrays.items() if v is not None}

    def kserve(self, model, raw=True, params=None, outputs=(), bf16_query=False):
        request = kpb.ModelInferRequest(model_name=model, id="req-7")
        for name, a in self.arrays.items():
            datatype = "BOOL" if a.dtype == np.bool_ else "FP32"
            if name == "query" and bf16_query:
                datatype = "BF16"
            tensor_pb = request.inputs.add(name=name, datatype=datatype, shape=a.shape)
            if raw:
                if datatype == "BF16":
                    data = bf16_bytes(a)
                elif datatype == "BOOL":
                    data = a.astype(np.uint8).tobytes()
                else:
                    data = a.astype("<f4").tobytes()
                request.raw_input_contents.append(data)
            elif datatype == "BOOL":
                tensor_pb.contents.bool_contents.extend(a.reshape(-1).tolist())
            else:
                tensor_pb.contents.fp32_contents.extend(a.reshape(-1).tolist())
        for name, value in (params or {}).items():
            request.parameters[name].bool_param = value
        for name in outputs:
            request.outputs.add(name=name)
        return request

    def attend(self, model, bf16_query=False, **flags):
        request = pb.AttendRequest(model=model, **flags)
        for name, a in self.arrays.items():
            if name == "query" and bf16_query:
                wire = pb.Tensor(dtype=cfg.DATA_TYPE_BF16, shape=a.shape, data=bf16_bytes(a))
            else:
                wire = tensor(pb, cfg, a)
            getattr(request, name).CopyFrom(wire)
        return request


def random_inputs(seed, batch, length, source=None, embed=DEMO_E, kdim=None, vdim=None,
                  masks=False):
    rng = np.random.default_rng(seed)
    arrays = {"query": rng.standard_normal((batch, length, embed), dtype=np.float32)}
    if source is not None:
        arrays["key"] = rng.standard_normal((batch, source, kdim or embed), dtype=np.float32)
        arrays["value"] = rng.standard_normal((batch, source, vdim or embed), dtype=np.float32)
    s = length if source is None else source
    if masks:
        kpm = np.zeros((batch, s), dtype=bool)
        kpm[:, -1] = True
        arrays["key_padding_mask"] = kpm
        arrays["attn_mask"] = rng.standard_normal((length, s)).astype(np.float32)
    return Inputs(**arrays)


class KserveTest(OneServerPerClass):
    @classmethod
    def make_repository(cls, folder):
        return make_repository(folder, names=("demo", "cross", "broken"))

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.kserve = krpc.GRPCInferenceServiceStub(cls.channel)
        cls.attend = rpc.AttentionServiceStub(cls.channel)

    def both(self, inputs, model="demo", params=None, outputs=(), raw=True, bf16_query=False):
        """(ModelInferResponse, AttendResponse) for the same request."""
        params = params or {}
        infer = self.kserve.ModelInfer(
            inputs.kserve(model, raw=raw, params=params, outputs=outputs,
                          bf16_query=bf16_query), timeout=TIMEOUT)
        need = params.get("need_weights", False) or "attn_weights" in outputs
        attend = self.attend.Attend(
            inputs.attend(model, bf16_query=bf16_query, is_causal=params.get("is_causal", False),
                          need_weights=need,
                          per_head_weights=params.get("per_head_weights", False)),
            timeout=TIMEOUT)
        return infer, attend

    def assert_same_answer(self, infer, attend, names=("output",)):
        self.assertEqual([o.name for o in infer.outputs], list(names))
        self.assertEqual(len(infer.raw_output_contents), len(names))
        for out, raw in zip(infer.outputs, infer.raw_output_contents):
            wire = attend.output if out.name == "output" else attend.attn_weights
            self.assertEqual(list(out.shape), list(wire.shape), out.name)
            self.assertEqual(raw, wire.data, f"{out.name} differs from Attend's")

    # ------------------------------------------------------------ health, metadata

    def test_server_live_ready_metadata(self):
        self.assertTrue(self.kserve.ServerLive(kpb.ServerLiveRequest(), timeout=TIMEOUT).live)
        self.assertTrue(self.kserve.ServerReady(kpb.ServerReadyRequest(), timeout=TIMEOUT).ready)
        meta = self.kserve.ServerMetadata(kpb.ServerMetadataRequest(), timeout=TIMEOUT)
        self.assertEqual(meta.name, "mha-serve")
        self.assertRegex(meta.version, r"^\d+\.\d+\.\d+$")
        self.assertEqual(list(meta.extensions),
                         ["parameters", "model_repository", "statistics", "model_configuration",
                          "schedule_policy", "sequence", "system_shared_memory",
                          "binary_tensor_data", "logging"])

    def test_model_ready(self):
        ready = lambda name, version="": self.kserve.ModelReady(  # noqa: E731
            kpb.ModelReadyRequest(name=name, version=version), timeout=TIMEOUT).ready
        self.assertTrue(ready("demo"))
        self.assertTrue(ready("demo", "1"))
        self.assertTrue(ready("cross"))
        self.assertFalse(ready("broken"))
        # Triton answers OK with ready: false for an unknown model or
        # version (tritonclient's is_model_ready() returns False, not raises).
        self.assertFalse(ready("nope"))
        self.assertFalse(ready("demo", "2"))
        self.assertFalse(ready("demo", "one"))  # no such version either

    def test_model_metadata(self):
        meta = self.kserve.ModelMetadata(kpb.ModelMetadataRequest(name="cross"), timeout=TIMEOUT)
        self.assertEqual(meta.name, "cross")
        self.assertEqual(list(meta.versions), ["1"])
        inputs = {t.name: (t.datatype, list(t.shape)) for t in meta.inputs}
        self.assertEqual(inputs, {
            "query": ("FP32", [-1, -1, CROSS_E]), "key": ("FP32", [-1, -1, CROSS_KDIM]),
            "value": ("FP32", [-1, -1, CROSS_VDIM]), "key_padding_mask": ("BOOL", [-1, -1]),
            "attn_mask": ("BOOL", [-1, -1])})
        outputs = {t.name: (t.datatype, list(t.shape)) for t in meta.outputs}
        self.assertEqual(outputs, {"output": ("FP32", [-1, -1, CROSS_E]),
                                   "attn_weights": ("FP32", [-1, -1, -1])})
        for name, code in (("broken", grpc.StatusCode.FAILED_PRECONDITION),
                           ("nope", grpc.StatusCode.NOT_FOUND)):
            with self.assertRaises(grpc.RpcError) as e:
                self.kserve.ModelMetadata(kpb.ModelMetadataRequest(name=name), timeout=TIMEOUT)
            self.assertEqual(e.exception.code(), code, name)

    # ------------------------------------------------------------ ModelInfer == Attend

    def test_self_attention_equals_attend_and_torch(self):
        inputs = random_inputs(1, batch=2, length=7)
        infer, attend = self.both(inputs)
        self.assertEqual(infer.model_name, "demo")
        self.assertEqual(infer.model_version, "1")
        self.assertEqual(infer.id, "req-7")
        self.assertEqual(infer.outputs[0].datatype, "FP32")
        self.assert_same_answer(infer, attend)
        got = np.frombuffer(infer.raw_output_contents[0], dtype="<f4").reshape(2, 7, DEMO_E)
        want, _ = reference(self.models["demo"], inputs.arrays["query"])
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)

    def test_masks_causal_and_per_head_weights_equal_attend(self):
        inputs = random_inputs(2, batch=2, length=5, masks=True)
        params = {"is_causal": True, "need_weights": True, "per_head_weights": True}
        infer, attend = self.both(inputs, params=params)
        self.assert_same_answer(infer, attend, names=("output", "attn_weights"))
        self.assertEqual(list(infer.outputs[1].shape), [2, DEMO_H, 5, 5])
        self.assertEqual(infer.outputs[1].datatype, "FP32")

    def test_cross_attention_equals_attend(self):
        inputs = random_inputs(3, batch=3, length=4, source=9, embed=CROSS_E, kdim=CROSS_KDIM,
                               vdim=CROSS_VDIM)
        infer, attend = self.both(inputs, model="cross", params={"need_weights": True})
        self.assert_same_answer(infer, attend, names=("output", "attn_weights"))

    def test_bf16_query_equals_attend(self):
        inputs = random_inputs(4, batch=1, length=6)
        infer, attend = self.both(inputs, bf16_query=True)
        self.assertEqual(infer.outputs[0].datatype, "BF16")
        self.assert_same_answer(infer, attend)

    def test_large_raw_contents_in_many_slices_equal_attend_and_torch(self):
        # 1 MiB and more of raw contents arrive in many of gRPC's slices: the
        # server reads ModelInfer around them (proto/wire/) and writes the
        # outputs straight into the response's bytes.
        inputs = random_inputs(6, batch=4, length=256, masks=True)
        infer, attend = self.both(inputs, params={"need_weights": True})
        self.assert_same_answer(infer, attend, names=("output", "attn_weights"))
        got = np.frombuffer(infer.raw_output_contents[0], dtype="<f4").reshape(4, 256, DEMO_E)
        want, _ = reference(self.models["demo"], inputs.arrays["query"],
                            key_padding_mask=inputs.arrays["key_padding_mask"],
                            attn_mask=inputs.arrays["attn_mask"])
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        infer, attend = self.both(inputs, bf16_query=True)
        self.assert_same_answer(infer, attend)

    def test_large_half_outputs_are_the_f32_output_rounded(self):
        # From 256 KiB an FP16 or BF16 output is converted by the worker, in
        # the pass that checks it finite, and sent from there by the gRPC
        # front ends: the same bits as the FP32 output of the same (rounded)
        # query rounded to nearest even, on mha.v1 Attend and its stream and
        # on KServe ModelInfer and its stream (2 x 300 x 256 x 2 = 300 KiB).
        query = np.random.default_rng(12).standard_normal((2, 300, DEMO_E), dtype=np.float32)
        for dtype, name in ((cfg.DATA_TYPE_FP16, "FP16"), (cfg.DATA_TYPE_BF16, "BF16")):
            half = half_tensor(pb, cfg, query, dtype)
            f32 = self.attend.Attend(pb.AttendRequest(
                model="demo", query=tensor(pb, cfg, from_wire(cfg, half))), timeout=TIMEOUT)
            want = half_tensor(pb, cfg, from_wire(cfg, f32.output), dtype).data
            attend = pb.AttendRequest(model="demo", query=half)
            unary = self.attend.Attend(attend, timeout=TIMEOUT).output
            streamed = [r.attend.output for r in self.attend.Stream(
                iter([pb.StreamRequest(id="half", attend=attend)]), timeout=TIMEOUT)]
            infer = kpb.ModelInferRequest(model_name="demo")
            infer.inputs.add(name="query", datatype=name, shape=query.shape)
            infer.raw_input_contents.append(half.data)
            kserve = self.kserve.ModelInfer(infer, timeout=TIMEOUT)
            kserve_streamed = [r.infer_response for r in self.kserve.ModelStreamInfer(
                iter([infer]), timeout=TIMEOUT)]
            self.assertEqual((unary.dtype, len(streamed), len(kserve_streamed)), (dtype, 1, 1))
            self.assertEqual(kserve.outputs[0].datatype, name)
            for got in (unary.data, streamed[0].data, kserve.raw_output_contents[0],
                        kserve_streamed[0].raw_output_contents[0]):
                self.assertEqual(len(got), query.size * 2)
                self.assertTrue(got == want, f"{name}: differs from the rounded FP32 output")

    def test_typed_contents_equal_raw(self):
        inputs = random_inputs(5, batch=2, length=3, masks=True)
        raw, _ = self.both(inputs, raw=True)
        typed, attend = self.both(inputs, raw=False)
        self.assertEqual(raw.raw_output_contents, typed.raw_output_contents)
        self.assert_same_answer(typed, attend)

    def test_requested_outputs_are_honoured(self):
        inputs = random_inputs(6, batch=1, length=4)
        only_weights, attend = self.both(inputs, outputs=("attn_weights",))
        self.assert_same_answer(only_weights, attend, names=("attn_weights",))
        reversed_order, attend = self.both(inputs, outputs=("attn_weights", "output"))
        self.assert_same_answer(reversed_order, attend, names=("attn_weights", "output"))
        # need_weights without asking for attn_weights among explicit outputs: not returned.
        only_output, attend = self.both(inputs, params={"need_weights": True},
                                        outputs=("output",))
        self.assert_same_answer(only_output, attend, names=("output",))

    # ------------------------------------------------------------ errors

    def infer_error(self, request):
        with self.assertRaises(grpc.RpcError) as e:
            self.kserve.ModelInfer(request, timeout=TIMEOUT)
        return e.exception

    def attend_error(self, request):
        with self.assertRaises(grpc.RpcError) as e:
            self.attend.Attend(request, timeout=TIMEOUT)
        return e.exception

    def test_errors_match_attend(self):
        rng = np.random.default_rng(7)
        cases = {
            "wrong width": Inputs(query=rng.standard_normal((1, 3, DEMO_E + 1)).astype(np.float32)),
            "NaN": Inputs(query=np.full((1, 2, DEMO_E), np.nan, dtype=np.float32)),
            "mask shape": Inputs(query=rng.standard_normal((1, 3, DEMO_E)).astype(np.float32),
                                 key_padding_mask=np.zeros((1, 4), dtype=bool)),
        }
        for what, inputs in cases.items():
            for model in ("demo", "nope", "broken"):
                infer = self.infer_error(inputs.kserve(model))
                attend = self.attend_error(inputs.attend(model))
                self.assertEqual(infer.code(), attend.code(), (what, model))
                self.assertEqual(infer.details(), attend.details(), (what, model))
        self.assertEqual(infer.code(), grpc.StatusCode.FAILED_PRECONDITION)

    def test_malformed_kserve_requests(self):
        good = random_inputs(8, batch=1, length=2)

        def changed(*edits):
            """The good request with each edit(request) applied."""
            r = good.kserve("demo")
            for edit in edits:
                edit(r)
            return r

        def param(name, **value):
            return lambda r: r.parameters[name].CopyFrom(kpb.InferParameter(**value))

        cases = [
            (changed(lambda r: setattr(r.inputs[0], "name", "queries")),
             'unknown input "queries"'),
            (changed(lambda r: setattr(r.inputs[0], "datatype", "INT8")),
             'datatype "INT8" is not one of'),
            (changed(lambda r: r.raw_input_contents.append(b"x")),
             "raw_input_contents has 2 entries for 1 inputs"),
            (changed(lambda r: r.inputs.add(name="query", datatype="FP32", shape=[1, 2, DEMO_E]),
                     lambda r: r.raw_input_contents.append(r.raw_input_contents[0])),
             "input query given twice"),
            (changed(lambda r: r.inputs[0].contents.fp32_contents.append(1.0)),
             "contents and raw_input_contents both given"),
            (changed(param("is_causal", int64_param=1)), "parameter is_causal: expected bool_param"),
            (changed(param("need_weight", bool_param=True)), 'unknown parameter "need_weight"'),
            (changed(param("priorty", uint64_param=1)),
             "known: is_causal, need_weights, per_head_weights (bool); timeout"),
            (changed(param("priority", int64_param=-1)), "parameter priority: expected uint64"),
            (changed(param("timeout", int64_param=-5)), "parameter timeout: -5 microseconds"),
            (changed(param("timeout", bool_param=True)), "parameter timeout: expected int64_param"),
            (changed(param("triton_enable_empty_final_response", int64_param=1)),
             "parameter triton_enable_empty_final_response: expected bool_param"),
            (changed(lambda r: r.outputs.add(name="weights")), 'unknown output "weights"'),
            (changed(lambda r: r.outputs.add(name="output"), lambda r: r.outputs.add(name="output")),
             "output output requested twice"),
            (changed(lambda r: r.ClearField("inputs"), lambda r: r.ClearField("raw_input_contents")),
             "input query is required"),
            (changed(lambda r: r.inputs[0].shape.__setitem__(2, DEMO_E - 1)),
             "query: data has"),
        ]
        typed = good.kserve("demo", raw=False)
        typed.inputs[0].datatype = "BF16"
        cases.append((typed, "BF16 has no typed contents field"))
        wrong_field = good.kserve("demo", raw=False)
        wrong_field.inputs[0].contents.int_contents.append(1)
        cases.append((wrong_field, "datatype FP32 takes fp32_contents only"))
        version = good.kserve("demo")
        version.model_version = "3"
        for req, message in cases:
            err = self.infer_error(req)
            self.assertEqual(err.code(), INVALID, (message, err.details()))
            self.assertIn(message, err.details())
        err = self.infer_error(version)
        self.assertEqual(err.code(), grpc.StatusCode.NOT_FOUND)
        self.assertIn('has no ready version 3', err.details())
        # The server still answers good requests correctly.
        infer, attend = self.both(good)
        self.assert_same_answer(infer, attend)

    def test_model_stream_infer_answers_each_request_and_errors_in_place(self):
        good = [random_inputs(40 + i, 1, 3 + i) for i in range(3)]
        requests = [good[0].kserve("demo"), good[1].kserve("demo"),
                    kpb.ModelInferRequest(model_name="nope", id="bad"), good[2].kserve("demo")]
        for i, r in enumerate(requests):
            if r.id != "bad":
                r.id = f"ok{i}"
        answers = {}
        for answer in self.kserve.ModelStreamInfer(iter(requests), timeout=TIMEOUT):
            answers[answer.infer_response.id] = answer
        self.assertEqual(sorted(answers), ["bad", "ok0", "ok1", "ok3"])
        self.assertIn("nope", answers["bad"].error_message)
        self.assertEqual(answers["bad"].infer_response.model_name, "nope")
        # Computed side by side (batched together), so equal to Attend's
        # answers within fp32 rounding rather than bit for bit.
        for key, inputs in (("ok0", good[0]), ("ok1", good[1]), ("ok3", good[2])):
            self.assertEqual(answers[key].error_message, "")
            infer = answers[key].infer_response
            attend = self.attend.Attend(inputs.attend("demo"), timeout=TIMEOUT)
            self.assertEqual([o.name for o in infer.outputs], ["output"])
            self.assertEqual(list(infer.outputs[0].shape), list(attend.output.shape))
            np.testing.assert_allclose(np.frombuffer(infer.raw_output_contents[0], "<f4"),
                                       np.frombuffer(attend.output.data, "<f4"),
                                       rtol=1e-5, atol=1e-5)

    def test_model_stream_infer_answers_malformed_and_large_messages_in_place(self):
        # Read around their raw contents: bytes that do not parse are one
        # answer's error_message (the stream goes on), and a large request
        # (many of gRPC's slices) equals Attend's answer.
        large = random_inputs(50, batch=4, length=256)
        request = large.kserve("demo")
        request.id = "large"
        method = "/inference.GRPCInferenceService/ModelStreamInfer"
        call = self.channel.stream_stream(
            method, request_serializer=lambda b: b,
            response_deserializer=kpb.ModelStreamInferResponse.FromString)
        answers = list(call(iter([b"\x0a\xff", request.SerializeToString()]), timeout=TIMEOUT))
        self.assertEqual(len(answers), 2)
        bad = [a for a in answers if a.error_message]
        self.assertEqual(len(bad), 1)
        self.assertIn("ModelInferRequest: not a valid protobuf message", bad[0].error_message)
        good = [a for a in answers if not a.error_message][0].infer_response
        self.assertEqual(good.id, "large")
        attend = self.attend.Attend(large.attend("demo"), timeout=TIMEOUT)
        self.assertEqual(good.raw_output_contents[0], attend.output.data)

    def test_an_unusually_encoded_sequence_request_is_read_whole(self):
        # An unknown group field makes the server leave the message to
        # protobuf whole (no raw contents apart); a sequence's step then
        # reads them from the message, as for a plainly encoded request.
        inputs = random_inputs(60, batch=1, length=3)
        answers = []
        for sequence_id, prefix in ((4242, b"\x5b\x08\x01\x5c"), (4243, b"")):
            request = inputs.kserve("demo")
            request.parameters["sequence_id"].int64_param = sequence_id
            request.parameters["sequence_start"].bool_param = True
            request.parameters["sequence_end"].bool_param = True
            call = self.channel.unary_unary(
                "/inference.GRPCInferenceService/ModelInfer", request_serializer=lambda b: b,
                response_deserializer=kpb.ModelInferResponse.FromString)
            answers.append(call(prefix + request.SerializeToString(), timeout=TIMEOUT))
        self.assertEqual(len(answers[0].raw_output_contents[0]), 3 * DEMO_E * 4)
        self.assertEqual(answers[0].raw_output_contents, answers[1].raw_output_contents)

    def test_triton_timeout_parameter_tightens_the_deadline(self):
        # Triton's `timeout` (microseconds): the earlier of it and the gRPC
        # deadline wins, and an expired request is never computed.
        inputs = random_inputs(17, batch=1, length=4)
        dropped = lambda: metric_value(self.server.metrics(), "mha_dropped_requests_total",  # noqa: E731
                                       model="demo", reason="deadline")
        before = dropped()
        late = inputs.kserve("demo")
        late.parameters["timeout"].int64_param = 1
        err = self.infer_error(late)
        self.assertEqual(err.code(), grpc.StatusCode.DEADLINE_EXCEEDED, err.details())
        self.assertEqual(dropped() - before, 1)
        roomy = inputs.kserve("demo")
        roomy.parameters["timeout"].int64_param = 30_000_000
        roomy.parameters["triton_enable_empty_final_response"].bool_param = True
        roomy.parameters["priority"].uint64_param = 1  # demo has no levels: its one queue
        infer = self.kserve.ModelInfer(roomy, timeout=TIMEOUT)  # unary: as without them
        attend = self.attend.Attend(inputs.attend("demo"), timeout=TIMEOUT)
        self.assert_same_answer(infer, attend)
        self.assertEqual(len(infer.parameters), 0)

    def test_stream_responses_say_they_are_final_when_asked(self):
        # Triton's C++ client sets triton_enable_empty_final_response on every
        # request and, on a stream, waits for triton_final_response.
        ok = random_inputs(18, batch=1, length=3).kserve("demo")
        ok.id = "ok"
        bad = kpb.ModelInferRequest(model_name="nope", id="bad")
        plain = random_inputs(19, batch=1, length=3).kserve("demo")
        plain.id = "plain"
        for r in (ok, bad):
            r.parameters["triton_enable_empty_final_response"].bool_param = True
        answers = {a.infer_response.id: a
                   for a in self.kserve.ModelStreamInfer(iter([ok, bad, plain]), timeout=TIMEOUT)}
        self.assertEqual(sorted(answers), ["bad", "ok", "plain"])
        for key in ("ok", "bad"):
            final = answers[key].infer_response.parameters["triton_final_response"]
            self.assertTrue(final.bool_param, key)
        self.assertEqual(answers["ok"].error_message, "")
        self.assertIn("nope", answers["bad"].error_message)
        self.assertNotIn("triton_final_response", answers["plain"].infer_response.parameters)

    def test_unknown_methods_are_refused_with_a_message(self):
        # Triton's C++ client takes an error without a message for success.
        call = self.channel.unary_unary(
            "/inference.GRPCInferenceService/Trace")
        with self.assertRaises(grpc.RpcError) as e:
            call(b"", timeout=TIMEOUT)
        self.assertEqual(e.exception.code(), grpc.StatusCode.UNIMPLEMENTED)
        self.assertIn("/inference.GRPCInferenceService/Trace is not served",
                      e.exception.details())

    def test_metrics_count_kserve_calls_with_api_label(self):
        before = self.server.metrics()
        inputs = random_inputs(9, batch=1, length=2)
        for _ in range(3):
            self.both(inputs)
        self.infer_error(Inputs(query=np.zeros((1, 2, 3), dtype=np.float32)).kserve("demo"))
        after = self.server.metrics()

        def delta(api, code):
            return (metric_value(after, "mha_requests_total", api=api, model="demo", code=code)
                    - metric_value(before, "mha_requests_total", api=api, model="demo", code=code))
        self.assertEqual(delta("kserve.v2", "OK"), 3)
        self.assertEqual(delta("mha.v1", "OK"), 3)
        self.assertEqual(delta("kserve.v2", "INVALID_ARGUMENT"), 1)


class KserveAuthTest(unittest.TestCase):
    """With --auth_token_file: liveness/readiness open, the rest needs the token."""

    def test_token_required_except_probes(self):
        with tempfile.TemporaryDirectory() as tmp:
            repo = os.path.join(tmp, "repo")
            os.makedirs(repo)
            make_repository(repo, names=("demo",))
            token_file = os.path.join(tmp, "token")
            with open(token_file, "w") as f:
                f.write("s3cret-token\n")
            server = TestServer(MHA_SERVER, repo, [f"--auth_token_file={token_file}"])
            server.start()
            try:
                channel = server.channel()
                stub = krpc.GRPCInferenceServiceStub(channel)
                self.assertTrue(stub.ServerLive(kpb.ServerLiveRequest(), timeout=TIMEOUT).live)
                self.assertTrue(stub.ServerReady(kpb.ServerReadyRequest(), timeout=TIMEOUT).ready)
                self.assertTrue(stub.ModelReady(kpb.ModelReadyRequest(name="demo"),
                                                timeout=TIMEOUT).ready)
                request = random_inputs(10, batch=1, length=2).kserve("demo")
                calls = [(stub.ModelInfer, request),
                         (stub.ModelMetadata, kpb.ModelMetadataRequest(name="demo")),
                         (stub.ServerMetadata, kpb.ServerMetadataRequest())]
                for call, req in calls:
                    for metadata in ((), (("authorization", "Bearer wrong"),)):
                        with self.assertRaises(grpc.RpcError) as e:
                            call(req, timeout=TIMEOUT, metadata=metadata)
                        self.assertEqual(e.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
                    call(req, timeout=TIMEOUT, metadata=(("authorization", "Bearer s3cret-token"),))
                channel.close()
            finally:
                server.stop()


if __name__ == "__main__":
    unittest.main()
