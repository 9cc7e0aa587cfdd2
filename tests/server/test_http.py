#!/usr/bin/python3
"""KServe v2 over HTTP/REST (issue 49) against the real mha_server, with
Python's http.client and curl: Triton's routes, JSON and binary tensors
checked against PyTorch and against each other, errors with Triton's status
codes and a JSON message, compression, chunked bodies, limits, slow and
vanishing clients.

    MHA_SERVER=build/mha_server /usr/bin/python3 tests/server/test_http.py
"""

import gzip
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import unittest
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mha_test_server import ASAN, OneServerPerClass, metric_value  # noqa: E402
from mha_local_server import free_port  # noqa: E402
from test_server import CROSS_E, CROSS_KDIM, CROSS_VDIM, DEMO_E, make_repository, reference  # noqa: E402

MAX_BODY = 8 << 20


def minor_faults(pid):
    """The minor page faults process `pid` has taken (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


def bf16_bytes(array):
    import torch
    t = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().tobytes()


def json_input(name, array):
    a = np.asarray(array)
    datatype = "BOOL" if a.dtype == np.bool_ else "FP32"
    return {"name": name, "datatype": datatype, "shape": list(a.shape), "data": a.tolist()}


def binary_request(inputs, outputs=("output",), bf16_query=False, parameters=None):
    """(body, header length) of a binary-extension request."""
    header = {"inputs": [], "outputs": [{"name": n, "parameters": {"binary_data": True}}
                                        for n in outputs]}
    if parameters:
        header["parameters"] = parameters
    blobs = b""
    for name, a in inputs.items():
        a = np.asarray(a)
        if name == "query" and bf16_query:
            datatype, raw = "BF16", bf16_bytes(a)
        elif a.dtype == np.bool_:
            datatype, raw = "BOOL", a.astype(np.uint8).tobytes()
        else:
            datatype, raw = "FP32", a.astype("<f4").tobytes()
        header["inputs"].append({"name": name, "datatype": datatype, "shape": list(a.shape),
                                 "parameters": {"binary_data_size": len(raw)}})
        blobs += raw
    text = json.dumps(header).encode()
    return text + blobs, len(text)


def split_binary(body, header_length):
    """The response's JSON and {output name: numpy array}."""
    header = json.loads(body[:header_length])
    arrays, offset = {}, header_length
    for out in header["outputs"]:
        size = out.get("parameters", {}).get("binary_data_size")
        if size is None:
            arrays[out["name"]] = np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
            continue
        assert out["datatype"] == "FP32", out
        arrays[out["name"]] = np.frombuffer(body[offset:offset + size], "<f4").reshape(out["shape"])
        offset += size
    assert offset == len(body), (offset, len(body))
    return header, arrays


def cross_inputs(seed, q_len, kv_len, padded_row, padded_from):
    """A random batch of two for the cross model: query, key, value and a key
    padding mask that hides row padded_row's keys from padded_from on."""
    rng = np.random.default_rng(seed)
    query = rng.standard_normal((2, q_len, CROSS_E)).astype(np.float32)
    key = rng.standard_normal((2, kv_len, CROSS_KDIM)).astype(np.float32)
    value = rng.standard_normal((2, kv_len, CROSS_VDIM)).astype(np.float32)
    pad = np.zeros((2, kv_len), dtype=bool)
    pad[padded_row, padded_from:] = True
    return rng, query, key, value, pad


class HttpServerTest(OneServerPerClass):
    """One server with --http_port, shared by the tests of the class."""

    extra = ()

    @classmethod
    def make_repository(cls, folder):
        return make_repository(folder, names=("demo", "cross"))

    @classmethod
    def make_server(cls):
        cls.http_port = free_port()
        cls.server_flags = (f"--http_port={cls.http_port}", f"--max_message_bytes={MAX_BODY}",
                            "--http_idle_timeout_s=2") + tuple(cls.extra)
        return super().make_server()

    def call(self, method, path, body=None, headers=None, connection=None):
        """(status, headers, body bytes) of one request."""
        conn = connection or http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body).encode()
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            if connection is None:
                conn.close()

    def call_json(self, method, path, body=None):
        """The JSON answer of a call that must succeed."""
        status, _, data = self.call(method, path, body)
        self.assertEqual(status, 200, data)
        return json.loads(data)

    def expect_error(self, status, method, path, body=None, headers=None, contains=""):
        got, head, data = self.call(method, path, body, headers)
        self.assertEqual(got, status, data)
        self.assertEqual(head["content-type"], "application/json")
        message = json.loads(data)["error"]
        self.assertTrue(message, "an error message is never empty")
        self.assertIn(contains, message)
        return message


class RoutesTest(HttpServerTest):

    def test_health_and_server_metadata(self):
        self.assertEqual(self.call("GET", "/v2/health/live")[0], 200)
        self.assertEqual(self.call("GET", "/v2/health/ready")[0], 200)
        status, head, body = self.call("GET", "/v2")
        self.assertEqual((status, head["content-type"]), (200, "application/json"))
        metadata = json.loads(body)
        self.assertEqual(metadata["name"], "mha-serve")
        self.assertIn("binary_tensor_data", metadata["extensions"])

    def test_model_metadata_ready_config_and_stats(self):
        status, _, body = self.call("GET", "/v2/models/demo")
        self.assertEqual(status, 200, body)
        metadata = json.loads(body)
        self.assertEqual(metadata["name"], "demo")
        self.assertEqual(metadata["versions"], ["1"])
        query = next(i for i in metadata["inputs"] if i["name"] == "query")
        self.assertEqual(query["shape"], [-1, -1, DEMO_E])  # numbers, as Triton's
        self.assertEqual(self.call("GET", "/v2/models/demo/versions/1")[0], 200)
        self.assertEqual(self.call("GET", "/v2/models/demo/ready")[0], 200)
        self.assertEqual(self.call("GET", "/v2/models/demo/versions/1/ready")[0], 200)
        self.assertEqual(self.call("GET", "/v2/models/nothing/ready")[0], 400)
        status, _, body = self.call("GET", "/v2/models/demo/config")
        self.assertEqual(status, 200, body)
        self.assertEqual(json.loads(body)["name"], "demo")
        self.expect_error(404, "GET", "/v2/models/nothing/config", contains="nothing")
        self.expect_error(404, "GET", "/v2/models/nothing", contains="nothing")
        for path in ("/v2/models/demo/stats", "/v2/models/stats"):
            status, _, body = self.call("GET", path)
            self.assertEqual(status, 200, body)
            stats = json.loads(body)["model_stats"]
            demo = next(s for s in stats if s["name"] == "demo")
            # Every field, 64-bit counts as numbers (tools index them).
            self.assertIsInstance(demo["inference_count"], int)
            self.assertIsInstance(demo["inference_stats"]["success"]["count"], int)
            self.assertIsInstance(demo["inference_stats"]["queue"]["ns"], int)

    def test_unknown_routes_and_wrong_methods(self):
        self.expect_error(404, "GET", "/nothing", contains="/nothing")
        self.expect_error(404, "GET", "/v2/nothing/here")
        self.expect_error(404, "GET", "/v2/models/demo/unknown_verb")
        message = self.expect_error(405, "POST", "/v2/health/live", contains="GET")
        self.assertIn("POST", message)
        status, head, _ = self.call("GET", "/v2/models/demo/infer")
        self.assertEqual((status, head.get("allow")), (405, "POST"))

    def test_repository_index_and_shared_memory_status(self):
        status, _, body = self.call("POST", "/v2/repository/index", {})
        # Model control is off (mode none): refused as over gRPC.
        self.assertEqual(status, 400, body)
        self.assertTrue(json.loads(body)["error"])
        status, _, body = self.call("GET", "/v2/systemsharedmemory/status")
        self.assertEqual((status, json.loads(body)), (200, []))
        self.expect_error(501, "POST", "/v2/cudasharedmemory/region/r/register", {})

    def test_keep_alive_serves_many_requests_on_one_connection(self):
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)
        try:
            for _ in range(20):
                self.assertEqual(self.call("GET", "/v2/health/ready", connection=conn)[0], 200)
            sock = conn.sock
            self.assertEqual(self.call("GET", "/v2/models/demo", connection=conn)[0], 200)
            self.assertIs(conn.sock, sock, "the connection was kept")
        finally:
            conn.close()


class InferTest(HttpServerTest):

    def infer_json(self, model, inputs, parameters=None, outputs=None, headers=None):
        body = {"id": "r-1", "inputs": [json_input(n, a) for n, a in inputs.items()]}
        if parameters:
            body["parameters"] = parameters
        if outputs is not None:
            body["outputs"] = [{"name": n} for n in outputs]
        return self.call("POST", f"/v2/models/{model}/infer", body, headers)

    def test_json_self_attention_matches_pytorch(self):
        rng = np.random.default_rng(1)
        query = rng.standard_normal((2, 5, DEMO_E)).astype(np.float32)
        status, head, body = self.infer_json("demo", {"query": query})
        self.assertEqual(status, 200, body)
        self.assertEqual(head["content-type"], "application/json")
        answer = json.loads(body)
        self.assertEqual((answer["id"], answer["model_name"], answer["model_version"]),
                         ("r-1", "demo", "1"))
        out = next(o for o in answer["outputs"] if o["name"] == "output")
        self.assertEqual(out["shape"], [2, 5, DEMO_E])
        got = np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])
        want, _ = reference(self.models["demo"], query)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

    def test_json_cross_attention_with_mask_and_weights_matches_pytorch(self):
        _, query, key, value, pad = cross_inputs(2, 3, 7, padded_row=0, padded_from=5)
        status, _, body = self.infer_json(
            "cross", {"query": query, "key": key, "value": value, "key_padding_mask": pad},
            parameters={"need_weights": True}, outputs=["output", "attn_weights"])
        self.assertEqual(status, 200, body)
        outputs = {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"])
                   for o in json.loads(body)["outputs"]}
        want, weights = reference(self.models["cross"], query, key, value, key_padding_mask=pad)
        np.testing.assert_allclose(outputs["output"], want, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(outputs["attn_weights"], weights, atol=1e-5, rtol=1e-5)

    def test_binary_answers_as_json_does_and_pytorch(self):
        rng = np.random.default_rng(3)
        query = rng.standard_normal((1, 9, DEMO_E)).astype(np.float32)
        body, length = binary_request({"query": query})
        status, head, data = self.call("POST", "/v2/models/demo/infer", body,
                                       {"Inference-Header-Content-Length": str(length)})
        self.assertEqual(status, 200, data)
        self.assertEqual(head["content-type"], "application/octet-stream")
        header, arrays = split_binary(data, int(head["inference-header-content-length"]))
        self.assertEqual(header["model_version"], "1")
        _, _, json_body = self.infer_json("demo", {"query": query}, outputs=["output"])
        as_json = np.asarray(json.loads(json_body)["outputs"][0]["data"], np.float32)
        np.testing.assert_array_equal(arrays["output"].reshape(-1), as_json)
        want, _ = reference(self.models["demo"], query)
        np.testing.assert_allclose(arrays["output"], want, atol=1e-5, rtol=1e-5)
        # binary_data_output asks for every output in binary.
        body, length = binary_request({"query": query}, outputs=())
        head_json = json.loads(body[:length])
        del head_json["outputs"]
        head_json["parameters"] = {"binary_data_output": True}
        text = json.dumps(head_json).encode()
        status, head, data = self.call("POST", "/v2/models/demo/infer", text + body[length:],
                                       {"Inference-Header-Content-Length": str(len(text))})
        self.assertEqual(status, 200, data)
        _, arrays = split_binary(data, int(head["inference-header-content-length"]))
        np.testing.assert_array_equal(arrays["output"].reshape(-1), as_json)

    def test_raw_body_is_one_query_answered_in_binary(self):
        """Triton's raw form: Inference-Header-Content-Length 0, the body is
        the query's FP32 bytes ([1, L, E], L from its length)."""
        query = np.random.default_rng(13).standard_normal((1, 6, DEMO_E)).astype(np.float32)
        status, head, data = self.call("POST", "/v2/models/demo/infer", query.tobytes(),
                                       {"Inference-Header-Content-Length": "0"})
        self.assertEqual(status, 200, data)
        header, arrays = split_binary(data, int(head["inference-header-content-length"]))
        self.assertEqual(header["outputs"][0]["shape"], [1, 6, DEMO_E])
        want, _ = reference(self.models["demo"], query)
        np.testing.assert_allclose(arrays["output"], want, atol=1e-5, rtol=1e-5)
        self.expect_error(400, "POST", "/v2/models/demo/infer", query.tobytes()[:-4],
                          {"Inference-Header-Content-Length": "0"},
                          contains=f"a multiple of {4 * DEMO_E} bytes")
        self.expect_error(404, "POST", "/v2/models/nothing/infer", query.tobytes(),
                          {"Inference-Header-Content-Length": "0"})

    @unittest.skipIf(ASAN, "AddressSanitizer's allocator ignores glibc's malloc thresholds")
    def test_a_large_request_again_reuses_the_memory_of_the_last(self):
        """The server keeps what a large call freed while large calls come
        (server/scheduling/heap_trim.h): the next one's body and answer do
        not fault their pages in afresh. With blocks from 4 MiB mapped apart
        and trimmed after each large call, every call took a fault per 4 KiB
        of its body, and of its answer."""
        query = np.random.default_rng(14).standard_normal((30, 256, DEMO_E)).astype(np.float32)
        body, length = binary_request({"query": query})
        headers = {"Inference-Header-Content-Length": str(length)}
        faults = []
        for _ in range(6):
            before = minor_faults(self.server.process.pid)
            status, _, data = self.call("POST", "/v2/models/demo/infer", body, headers)
            faults.append(minor_faults(self.server.process.pid) - before)
            self.assertEqual(status, 200, data[:200])
        body_pages = query.nbytes // 4096
        self.assertLess(sorted(faults[2:])[1], body_pages // 4, faults)  # the second fewest

    def test_bf16_only_as_binary(self):
        rng = np.random.default_rng(4)
        query = rng.standard_normal((1, 4, DEMO_E)).astype(np.float32)
        body, length = binary_request({"query": query}, bf16_query=True)
        status, head, data = self.call("POST", "/v2/models/demo/infer", body,
                                       {"Inference-Header-Content-Length": str(length)})
        self.assertEqual(status, 200, data)
        header = json.loads(data[:int(head["inference-header-content-length"])])
        self.assertEqual(header["outputs"][0]["datatype"], "BF16")
        bad = {"inputs": [{"name": "query", "datatype": "BF16", "shape": [1, 1, 2],
                           "data": [1.0, 2.0]}]}
        self.expect_error(400, "POST", "/v2/models/demo/infer", bad, contains="binary")

    def test_large_half_outputs_are_the_f32_output_rounded(self):
        """From 256 KiB an FP16 or BF16 output is converted by the worker, in
        the pass that checks it finite, and sent from there: the same bits as
        the FP32 output of the same (rounded) query rounded to nearest even,
        plain and gzip-compressed (2 x 300 x 256 x 2 = 300 KiB)."""
        import torch
        query = np.random.default_rng(12).standard_normal((2, 300, DEMO_E)).astype(np.float32)
        torch_dtypes = {"FP16": torch.float16, "BF16": torch.bfloat16}

        def infer(datatype, raw, headers=()):
            header = {"inputs": [{"name": "query", "datatype": datatype, "shape": list(query.shape),
                                  "parameters": {"binary_data_size": len(raw)}}],
                      "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}
            text = json.dumps(header).encode()
            status, head, data = self.call(
                "POST", "/v2/models/demo/infer", text + raw,
                {"Inference-Header-Content-Length": str(len(text)), **dict(headers)})
            self.assertEqual(status, 200, data)
            if head.get("content-encoding") == "gzip":
                data = gzip.decompress(data)
            length = int(head["inference-header-content-length"])
            out = json.loads(data[:length])["outputs"][0]
            self.assertEqual((out["datatype"], out["shape"]), (datatype, list(query.shape)))
            return data[length:]

        def as_bits(array, name):
            t = torch.from_numpy(np.ascontiguousarray(array)).to(torch_dtypes[name])
            return t.view(torch.int16).numpy().tobytes()

        for name in ("FP16", "BF16"):
            half = as_bits(query, name)
            rounded = torch.frombuffer(bytearray(half), dtype=torch_dtypes[name]).float().numpy()
            f32 = np.frombuffer(infer("FP32", rounded.astype("<f4").tobytes()), "<f4")
            want = as_bits(f32, name)
            for headers in ((), (("Accept-Encoding", "gzip"),)):
                got = infer(name, half, headers)
                self.assertEqual(len(got), query.size * 2)
                self.assertTrue(got == want, f"{name} {headers}: differs from the rounded FP32")

    def test_bad_requests_are_400_with_the_reason(self):
        q = np.zeros((1, 2, DEMO_E), np.float32)
        cases = [
            ({"inputs": [{"name": "query", "datatype": "INT32", "shape": [1, 2, DEMO_E],
                          "data": [0] * (2 * DEMO_E)}]}, "INT32"),
            ({"inputs": [{"name": "query", "datatype": "FP32", "shape": [1, 3, DEMO_E],
                          "data": q.tolist()}]}, "elements"),
            ({"inputs": [{"name": "query", "datatype": "FP32", "shape": [1, 2, 3],
                          "data": [0.0] * 6}]}, "query"),
            ({"inputs": [{"name": "query", "datatype": "FP32", "shape": [2]}]}, "no data"),
            ({"inputs": "query"}, "inputs"),
            (b"{not json", "not JSON"),
            (b"[" * 10000 + b"]" * 10000, "deeper"),
        ]
        def refused():
            return metric_value(self.server.metrics(), "mha_requests_total", model="demo",
                                api="kserve.v2.http", code="INVALID_ARGUMENT")

        for body, words in cases:
            with self.subTest(words=words):
                before = refused()
                self.expect_error(400, "POST", "/v2/models/demo/infer", body, contains=words)
                # Issue 64: refused while decoded, and counted as gRPC's are.
                self.assertEqual(refused(), before + 1)
        # Issue 64: an empty body asked for the raw form with "E = 0".
        before = refused()
        self.expect_error(400, "POST", "/v2/models/demo/infer", b"",
                          contains="no inference header: the body is empty")
        message = self.expect_error(400, "POST", "/v2/models/demo/infer", b"",
                                    {"Inference-Header-Content-Length": "0"})
        self.assertIn(f"E = {DEMO_E}", message)
        self.assertEqual(refused(), before + 2)
        unknown = metric_value(self.server.metrics(), "mha_requests_total", model="_unknown",
                               api="kserve.v2.http", code="NOT_FOUND")
        self.expect_error(404, "POST", "/v2/models/nothing/infer", b"", contains="nothing")
        self.assertEqual(metric_value(self.server.metrics(), "mha_requests_total", model="_unknown",
                                      api="kserve.v2.http", code="NOT_FOUND"), unknown + 1)
        body, length = binary_request({"query": q})
        self.expect_error(400, "POST", "/v2/models/demo/infer", body,
                          {"Inference-Header-Content-Length": str(len(body) + 1)},
                          contains="larger than the body")
        self.expect_error(400, "POST", "/v2/models/demo/infer", body + b"xx",
                          {"Inference-Header-Content-Length": str(length)}, contains="follow")
        self.expect_error(404, "POST", "/v2/models/nothing/infer", {"inputs": []})

    def test_compressed_requests_and_answers(self):
        rng = np.random.default_rng(5)
        query = rng.standard_normal((1, 6, DEMO_E)).astype(np.float32)
        plain = json.dumps({"inputs": [json_input("query", query)]}).encode()
        want, _ = reference(self.models["demo"], query)
        for encoding, data in (("gzip", gzip.compress(plain)), ("deflate", zlib.compress(plain))):
            with self.subTest(encoding=encoding):
                status, head, body = self.call(
                    "POST", "/v2/models/demo/infer", data,
                    {"Content-Encoding": encoding, "Accept-Encoding": "gzip"})
                self.assertEqual(status, 200, body)
                self.assertEqual(head.get("content-encoding"), "gzip")
                out = json.loads(gzip.decompress(body))["outputs"][0]
                got = np.asarray(out["data"], np.float32).reshape(out["shape"])
                np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
        bomb = gzip.compress(b" " * (MAX_BODY + 1024), compresslevel=9)
        self.assertLess(len(bomb), MAX_BODY // 100)
        self.expect_error(413, "POST", "/v2/models/demo/infer", bomb,
                          {"Content-Encoding": "gzip"}, contains="decompressed")
        self.expect_error(400, "POST", "/v2/models/demo/infer", gzip.compress(plain)[:-20],
                          {"Content-Encoding": "gzip"}, contains="truncated")
        self.expect_error(400, "POST", "/v2/models/demo/infer", plain,
                          {"Content-Encoding": "br"}, contains="br")

    def test_chunked_body_and_expect_continue(self):
        rng = np.random.default_rng(6)
        query = rng.standard_normal((1, 8, DEMO_E)).astype(np.float32)
        plain = json.dumps({"inputs": [json_input("query", query)]}).encode()
        want, _ = reference(self.models["demo"], query)
        conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)
        try:
            pieces = (plain[i:i + 4096] for i in range(0, len(plain), 4096))
            conn.request("POST", "/v2/models/demo/infer", body=pieces,
                         headers={"Transfer-Encoding": "chunked"}, encode_chunked=True)
            r = conn.getresponse()
            data = r.read()
            self.assertEqual(r.status, 200, data)
        finally:
            conn.close()
        out = json.loads(data)["outputs"][0]
        np.testing.assert_allclose(np.asarray(out["data"], np.float32).reshape(out["shape"]),
                                   want, atol=1e-5, rtol=1e-5)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            f.write(plain)
            f.flush()
            run = subprocess.run(
                ["curl", "-sS", "-v", "-H", "Expect: 100-continue", "-H",
                 "Content-Type: application/json", "--data-binary", f"@{f.name}",
                 f"http://127.0.0.1:{self.http_port}/v2/models/demo/infer"],
                capture_output=True, timeout=60)
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertIn(b"HTTP/1.1 100 Continue", run.stderr)
        out = json.loads(run.stdout)["outputs"][0]
        np.testing.assert_allclose(np.asarray(out["data"], np.float32).reshape(out["shape"]),
                                   want, atol=1e-5, rtol=1e-5)

    def test_body_above_the_limit_is_413_and_http_calls_are_counted(self):
        # Refused from its Content-Length, before the body is read (curl
        # waits for 100 Continue, and gets the 413 instead).
        with tempfile.NamedTemporaryFile() as f:
            f.write(b"x" * (MAX_BODY + 1))
            f.flush()
            run = subprocess.run(
                ["curl", "-sS", "-w", "\n%{http_code}", "--data-binary", f"@{f.name}",
                 f"http://127.0.0.1:{self.http_port}/v2/models/demo/infer"],
                capture_output=True, timeout=60)
        body, _, code = run.stdout.rpartition(b"\n")
        self.assertEqual(code, b"413", run)
        self.assertIn("--max_message_bytes", json.loads(body)["error"])
        status, _, _ = self.infer_json("demo", {"query": np.zeros((1, 1, DEMO_E), np.float32)})
        self.assertEqual(status, 200)
        metrics = self.server.metrics()
        self.assertGreater(metric_value(metrics, "mha_requests_total", api="kserve.v2.http"), 0)


class SequencesAndSharedMemoryTest(HttpServerTest):
    """Triton's sequences (sessions) and system shared memory over HTTP, in
    the same registries as over gRPC."""

    def infer(self, body, headers=None):
        status, head, data = self.call("POST", "/v2/models/demo/infer", body, headers)
        self.assertEqual(status, 200, data)
        return head, data

    def test_a_sequence_in_chunks_equals_one_causal_pass(self):
        rng = np.random.default_rng(9)
        x = rng.standard_normal((1, 11, DEMO_E)).astype(np.float32)
        want, want_w = reference(self.models["demo"], x, is_causal=True)
        bounds = [0, 1, 6, 11]
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            body, length = binary_request(
                {"query": x[:, a:b]}, outputs=("output", "attn_weights"),
                parameters={"sequence_id": 77, "sequence_start": i == 0,
                            "sequence_end": b == bounds[-1]})
            head, data = self.infer(body, {"Inference-Header-Content-Length": str(length)})
            _, arrays = split_binary(data, int(head["inference-header-content-length"]))
            np.testing.assert_allclose(arrays["output"], want[:, a:b], atol=1e-5, rtol=1e-5)
            np.testing.assert_allclose(arrays["attn_weights"], want_w[:, a:b, :b], atol=1e-5,
                                       rtol=1e-5)
        message = self.expect_error(
            400, "POST", "/v2/models/demo/infer",
            {"inputs": [json_input("query", x[:, :1])], "parameters": {"sequence_id": 77}})
        self.assertIn("closed", message)

    def test_inputs_and_outputs_in_system_shared_memory(self):
        from multiprocessing import shared_memory
        rng = np.random.default_rng(10)
        query = rng.standard_normal((1, 5, DEMO_E)).astype(np.float32)
        region = shared_memory.SharedMemory(create=True, size=2 * query.nbytes)
        try:
            np.ndarray(query.shape, np.float32, region.buf)[:] = query
            status, _, body = self.call(
                "POST", "/v2/systemsharedmemory/region/io/register",
                {"key": "/" + region.name, "offset": 0, "byte_size": 2 * query.nbytes})
            self.assertEqual(status, 200, body)
            status, _, body = self.call("GET", "/v2/systemsharedmemory/region/io/status")
            self.assertEqual(json.loads(body)[0]["byte_size"], 2 * query.nbytes)
            shm = {"shared_memory_region": "io", "shared_memory_byte_size": query.nbytes}
            self.infer({"inputs": [{"name": "query", "datatype": "FP32",
                                    "shape": list(query.shape), "parameters": shm}],
                        "outputs": [{"name": "output", "parameters": {
                            **shm, "shared_memory_offset": query.nbytes}}]})
            got = np.ndarray(query.shape, np.float32, region.buf, offset=query.nbytes).copy()
            want, _ = reference(self.models["demo"], query)
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
            self.assertEqual(self.call("POST", "/v2/systemsharedmemory/region/io/unregister")[0],
                             200)
            self.assertEqual(json.loads(self.call("GET", "/v2/systemsharedmemory/status")[2]), [])
        finally:
            region.close()
            region.unlink()


class BadClientsTest(HttpServerTest):
    """Slow, vanishing and oversized clients get a closed connection or an
    error; the server goes on serving the others."""

    def still_serves(self):
        self.assertEqual(self.call("GET", "/v2/models/demo/ready")[0], 200)

    def raw(self, data, wait=0.0):
        s = socket.create_connection(("127.0.0.1", self.http_port), timeout=10)
        s.sendall(data)
        time.sleep(wait)
        return s

    def test_slow_headers_and_bodies_are_closed_after_the_idle_timeout(self):
        for partial in (b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n",
                        b"POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Length: 1000\r\n\r\n{\"inputs\""):
            with self.subTest(partial=partial[:20]):
                s = self.raw(partial)
                self.still_serves()  # meanwhile
                start = time.monotonic()
                got = s.recv(4096)  # closed after --http_idle_timeout_s=2
                self.assertLess(time.monotonic() - start, 8)
                self.assertFalse(got and got.startswith(b"HTTP/1.1 200"), got)
                s.close()
        self.still_serves()

    def test_a_client_gone_mid_body_leaves_the_server_serving(self):
        for _ in range(20):
            s = self.raw(b"POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Length: 100000\r\n\r\n{\"inputs\": [")
            s.close()
        self.still_serves()

    def test_a_chunked_body_past_the_limit_closes_the_connection(self):
        s = self.raw(b"POST /v2/models/demo/infer HTTP/1.1\r\nHost: x\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n" % (1 << 20) + b" " * (1 << 20) + b"\r\n"
        got = b""
        try:
            for _ in range(MAX_BODY // (1 << 20) + 2):
                s.sendall(chunk)
            s.sendall(b"0\r\n\r\n")
            got = s.recv(4096)
        except (BrokenPipeError, ConnectionResetError):
            pass
        s.close()
        self.assertFalse(got.startswith(b"HTTP/1.1 200"), got)
        self.still_serves()

    def test_oversize_headers_are_refused(self):
        s = self.raw(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (128 << 10)
                     + b"\r\n\r\n")
        got = b""
        try:
            got = s.recv(4096)
        except ConnectionResetError:
            pass
        s.close()
        self.assertFalse(got.startswith(b"HTTP/1.1 200"), got)
        self.still_serves()


class ManyConnectionsTest(HttpServerTest):
    """No thread per connection: 1,000 idle keep-alive connections stay open
    while 64 clients are served, and each idle one still answers after."""

    extra = ("--http_idle_timeout_s=120",)

    def test_a_thousand_idle_connections_beside_64_active_clients(self):
        import resource
        import threading
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4096)), hard))
        ping = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
        idle = []
        try:
            for _ in range(1000):
                s = socket.create_connection(("127.0.0.1", self.http_port), timeout=30)
                s.sendall(ping)
                self.assertTrue(s.recv(4096).startswith(b"HTTP/1.1 200"))
                idle.append(s)
            rng = np.random.default_rng(8)
            query = rng.standard_normal((1, 4, DEMO_E)).astype(np.float32)
            want, _ = reference(self.models["demo"], query)
            body = json.dumps({"inputs": [json_input("query", query)]}).encode()
            failures, answered = [], [0]
            lock = threading.Lock()

            def client():
                conn = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=60)
                try:
                    for _ in range(8):
                        status, _, data = self.call("POST", "/v2/models/demo/infer", body,
                                                    connection=conn)
                        out = json.loads(data)["outputs"][0] if status == 200 else None
                        ok = out is not None and np.allclose(
                            np.asarray(out["data"], np.float32).reshape(out["shape"]), want,
                            atol=1e-5, rtol=1e-5)
                        with lock:
                            answered[0] += 1
                            if not ok:
                                failures.append((status, data[:200]))
                finally:
                    conn.close()

            threads = [threading.Thread(target=client) for _ in range(64)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            self.assertEqual(failures, [])
            self.assertEqual(answered[0], 64 * 8)
            for s in idle:  # every idle connection was kept and still answers
                s.sendall(ping)
                self.assertTrue(s.recv(4096).startswith(b"HTTP/1.1 200"))
        finally:
            for s in idle:
                s.close()


class AuthTest(HttpServerTest):
    """The bearer token of gRPC guards HTTP too; health stays open."""

    @classmethod
    def make_server(cls):
        cls.token_dir = tempfile.TemporaryDirectory()
        path = os.path.join(cls.token_dir.name, "token")
        with open(path, "w") as f:
            f.write("s3cret\n")
        cls.extra = (f"--auth_token_file={path}",)
        return super().make_server()

    def test_token_needed_except_for_health(self):
        self.assertEqual(self.call("GET", "/v2/health/ready")[0], 200)
        self.assertEqual(self.call("GET", "/v2/models/demo/ready")[0], 200)
        self.expect_error(401, "GET", "/v2", contains="bearer token")
        self.expect_error(401, "POST", "/v2/models/demo/infer",
                          {"inputs": [json_input("query", np.zeros((1, 1, DEMO_E), np.float32))]},
                          contains="bearer token")
        good = {"Authorization": "Bearer s3cret"}
        self.assertEqual(self.call("GET", "/v2", headers=good)[0], 200)
        status, _, body = self.call(
            "POST", "/v2/models/demo/infer",
            {"inputs": [json_input("query", np.zeros((1, 1, DEMO_E), np.float32))]}, good)
        self.assertEqual(status, 200, body)


if __name__ == "__main__":
    unittest.main()
