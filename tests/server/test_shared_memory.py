#!/usr/bin/python3
"""Triton's system shared memory (issue 36) on the real mha_server, through
Triton's own message definitions (tests/server/triton_messages.py).

    MHA_SERVER=build/mha_server /usr/bin/python3 tests/server/test_shared_memory.py

A same-host client registers POSIX shared-memory objects and names them in
ModelInfer's inputs and outputs (Triton's parameters shared_memory_region,
shared_memory_byte_size, shared_memory_offset). Checked: the answers equal
the raw-contents call bit for bit (all inputs and outputs in shared memory,
and mixed), the region RPCs (status, duplicates, unknown objects, ranges),
bad slices refused with INVALID_ARGUMENT, an object truncated behind the
server's back refused without harm, and unregistering while requests use a
region.
"""

import concurrent.futures
import os
import sys
import unittest
from multiprocessing import shared_memory

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from test_server import (CROSS_E, CROSS_KDIM, CROSS_VDIM, DEMO_E,  # noqa: E402
                         randn, reference)
from triton_messages import triton_server_per_class, triton_stubs  # noqa: E402

tpb, _ = triton_stubs()
TIMEOUT = 60
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def shm_params(tensor, region, byte_size, offset=0):
    tensor.parameters["shared_memory_region"].string_param = region
    tensor.parameters["shared_memory_byte_size"].int64_param = byte_size
    if offset:
        tensor.parameters["shared_memory_offset"].int64_param = offset


class Region:
    """A POSIX shared-memory object the test writes and reads as numpy."""

    def __init__(self, size):
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        self.key = "/" + self.shm.name

    def put(self, offset, array):
        data = np.ascontiguousarray(array, dtype="<f4").tobytes()
        self.shm.buf[offset:offset + len(data)] = data
        return len(data)

    def get(self, offset, shape):
        n = int(np.prod(shape)) * 4
        return np.frombuffer(bytes(self.shm.buf[offset:offset + n]), dtype="<f4").reshape(shape)

    def close(self):
        self.shm.close()
        self.shm.unlink()


class SharedMemoryTest(triton_server_per_class()):

    def setUp(self):
        self.regions = []

    def tearDown(self):
        self.triton.SystemSharedMemoryUnregister(tpb.SystemSharedMemoryUnregisterRequest(),
                                                 timeout=TIMEOUT)
        for r in self.regions:
            r.close()

    def region(self, size, name, offset=0, byte_size=None):
        r = Region(size)
        self.regions.append(r)
        self.triton.SystemSharedMemoryRegister(tpb.SystemSharedMemoryRegisterRequest(
            name=name, key=r.key, offset=offset,
            byte_size=size - offset if byte_size is None else byte_size), timeout=TIMEOUT)
        return r

    def refused(self, call, request, code=INVALID):
        with self.assertRaises(grpc.RpcError) as e:
            call(request, timeout=TIMEOUT)
        self.assertEqual(e.exception.code(), code, e.exception.details())
        self.assertTrue(e.exception.details())
        return e.exception.details()

    def raw_request(self, model, arrays, outputs=("output", "attn_weights")):
        request = tpb.ModelInferRequest(model_name=model)
        for name, a in arrays.items():
            request.inputs.add(name=name, datatype="FP32", shape=a.shape)
            request.raw_input_contents.append(a.astype("<f4").tobytes())
        for name in outputs:
            request.outputs.add(name=name)
        return request

    def raw_outputs(self, request):
        response = self.triton.ModelInfer(request, timeout=TIMEOUT)
        return {o.name: np.frombuffer(raw, dtype="<f4").reshape(tuple(o.shape))
                for o, raw in zip(response.outputs, response.raw_output_contents)}

    def test_shared_memory_answers_equal_raw_contents_bit_for_bit(self):
        rng = np.random.default_rng(1)
        q, k, v = (randn(rng, 2, 9, CROSS_E), randn(rng, 2, 13, CROSS_KDIM),
                   randn(rng, 2, 13, CROSS_VDIM))
        want = self.raw_outputs(self.raw_request("cross", {"query": q, "key": k, "value": v}))
        torch_out, _ = reference(self.models["cross"], q, k, v)
        np.testing.assert_allclose(want["output"], torch_out, rtol=1e-5, atol=1e-5)

        # Inputs in one region (at offsets), outputs in another with an offset.
        inputs = self.region(1 << 16, "in")
        outputs = self.region(1 << 16, "out", offset=4096, byte_size=(1 << 16) - 4096)
        request = tpb.ModelInferRequest(model_name="cross", id="shm-1")
        offset = 0
        for name, a in (("query", q), ("key", k), ("value", v)):
            size = inputs.put(offset, a)
            shm_params(request.inputs.add(name=name, datatype="FP32", shape=a.shape),
                       "in", size, offset)
            offset += size
        out_bytes = q.size * 4
        w_bytes = 2 * 9 * 13 * 4
        shm_params(request.outputs.add(name="output"), "out", out_bytes, 64)
        shm_params(request.outputs.add(name="attn_weights"), "out", w_bytes, 64 + out_bytes)
        response = self.triton.ModelInfer(request, timeout=TIMEOUT)
        self.assertEqual([o.name for o in response.outputs], ["output", "attn_weights"])
        self.assertEqual(list(response.outputs[0].shape), [2, 9, CROSS_E])
        self.assertEqual(list(response.raw_output_contents), [b"", b""],
                         "shared-memory outputs leave empty raw entries, one per output")
        # The output region starts 4096 bytes into its object.
        got = outputs.get(4096 + 64, want["output"].shape)
        got_w = outputs.get(4096 + 64 + out_bytes, want["attn_weights"].shape)
        self.assertEqual(got.tobytes(), want["output"].tobytes())
        self.assertEqual(got_w.tobytes(), want["attn_weights"].tobytes())

        # Mixed: the query in shared memory, the rest raw (raw entries for
        # the other inputs only), the output raw.
        request = tpb.ModelInferRequest(model_name="cross")
        shm_params(request.inputs.add(name="query", datatype="FP32", shape=q.shape), "in",
                   q.size * 4)
        for name, a in (("key", k), ("value", v)):
            request.inputs.add(name=name, datatype="FP32", shape=a.shape)
            request.raw_input_contents.append(a.astype("<f4").tobytes())
        request.outputs.add(name="output")
        self.assertEqual(self.raw_outputs(request)["output"].tobytes(), want["output"].tobytes())

    def test_region_rpcs(self):
        r = self.region(4096, "a", offset=1024, byte_size=2048)
        status = self.triton.SystemSharedMemoryStatus(tpb.SystemSharedMemoryStatusRequest(),
                                                      timeout=TIMEOUT)
        self.assertEqual(set(status.regions), {"a"})
        a = status.regions["a"]
        self.assertEqual((a.name, a.key, a.offset, a.byte_size), ("a", r.key, 1024, 2048))
        register = self.triton.SystemSharedMemoryRegister
        self.refused(register, tpb.SystemSharedMemoryRegisterRequest(
            name="a", key=r.key, byte_size=16), grpc.StatusCode.ALREADY_EXISTS)
        self.refused(register, tpb.SystemSharedMemoryRegisterRequest(
            name="b", key="/mha_no_such_object", byte_size=16), grpc.StatusCode.NOT_FOUND)
        self.assertIn("fewer than", self.refused(register, tpb.SystemSharedMemoryRegisterRequest(
            name="b", key=r.key, offset=4000, byte_size=200)))
        self.refused(register, tpb.SystemSharedMemoryRegisterRequest(
            name="b", key="../../etc/passwd", byte_size=16))
        self.refused(register, tpb.SystemSharedMemoryRegisterRequest(name="b", key=r.key))
        self.refused(self.triton.SystemSharedMemoryStatus,
                     tpb.SystemSharedMemoryStatusRequest(name="nosuch"),
                     grpc.StatusCode.NOT_FOUND)
        self.triton.SystemSharedMemoryUnregister(
            tpb.SystemSharedMemoryUnregisterRequest(name="a"), timeout=TIMEOUT)
        status = self.triton.SystemSharedMemoryStatus(tpb.SystemSharedMemoryStatusRequest(),
                                                      timeout=TIMEOUT)
        self.assertEqual(len(status.regions), 0)
        # No GPU: nothing to register, so Triton's clients that clear every
        # region at start (system, then CUDA) go on; registering says why not.
        self.triton.CudaSharedMemoryUnregister(tpb.CudaSharedMemoryUnregisterRequest(),
                                               timeout=TIMEOUT)
        cuda = self.triton.CudaSharedMemoryStatus(tpb.CudaSharedMemoryStatusRequest(),
                                                  timeout=TIMEOUT)
        self.assertEqual(len(cuda.regions), 0)
        self.assertIn("CPU", self.refused(
            self.triton.CudaSharedMemoryRegister, tpb.CudaSharedMemoryRegisterRequest(
                name="g", byte_size=16), grpc.StatusCode.UNIMPLEMENTED))
        # Trace settings are not served, and say so.
        self.assertIn("Trace", self.refused(self.triton.Trace, tpb.TraceRequest(),
                                            grpc.StatusCode.UNIMPLEMENTED))

    def test_bad_slices_are_refused(self):
        q = randn(np.random.default_rng(2), 1, 4, DEMO_E)
        self.region(8192, "r")

        def request(region="r", byte_size=q.size * 4, offset=0, out=None):
            r = tpb.ModelInferRequest(model_name="demo")
            shm_params(r.inputs.add(name="query", datatype="FP32", shape=q.shape), region,
                       byte_size, offset)
            if out is not None:
                shm_params(r.outputs.add(name="output"), "r", out)
            return r

        infer = self.triton.ModelInfer
        self.assertIn("no shared-memory region", self.refused(infer, request(region="nosuch")))
        self.assertIn("past the end", self.refused(infer, request(offset=8000)))
        self.assertIn("its shape and datatype take",
                      self.refused(infer, request(byte_size=q.size * 4 - 4)))
        self.assertIn("cannot hold", self.refused(infer, request(out=q.size * 4 - 4)))
        r = request()
        r.inputs[0].parameters["shared_memory_byte_size"].string_param = "lots"
        self.assertIn("shared_memory_byte_size", self.refused(infer, r))
        r = request()
        del r.inputs[0].parameters["shared_memory_region"]
        self.assertIn("need a shared_memory_region", self.refused(infer, r))

    def test_an_object_truncated_behind_the_servers_back_is_refused(self):
        r = self.region(8192, "t")
        q = randn(np.random.default_rng(3), 1, 4, DEMO_E)
        r.put(0, q)
        os.truncate(os.path.join("/dev/shm", r.shm.name), 16)
        request = tpb.ModelInferRequest(model_name="demo")
        shm_params(request.inputs.add(name="query", datatype="FP32", shape=q.shape), "t",
                   q.size * 4)
        self.assertIn("shorter than registered", self.refused(self.triton.ModelInfer, request))
        self.assertTrue(self.triton.ServerLive(tpb.ServerLiveRequest(), timeout=TIMEOUT).live)

    def test_unregistering_while_requests_use_the_region_is_safe(self):
        rng = np.random.default_rng(4)
        q = randn(rng, 1, 64, DEMO_E)
        want = self.raw_outputs(self.raw_request("demo", {"query": q}, outputs=("output",)))
        r = self.region(1 << 20, "busy")
        size = r.put(0, q)

        def call(i):
            request = tpb.ModelInferRequest(model_name="demo")
            shm_params(request.inputs.add(name="query", datatype="FP32", shape=q.shape), "busy",
                       size)
            shm_params(request.outputs.add(name="output"), "busy", size, size * (1 + i % 8))
            try:
                self.triton.ModelInfer(request, timeout=TIMEOUT)
                return r.get(size * (1 + i % 8), q.shape).tobytes() == want["output"].tobytes()
            except grpc.RpcError as e:
                return e.code() == INVALID and "no shared-memory region" in e.details()

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(call, i) for i in range(64)]
            self.triton.SystemSharedMemoryUnregister(
                tpb.SystemSharedMemoryUnregisterRequest(name="busy"), timeout=TIMEOUT)
            results = [f.result() for f in futures]
        self.assertTrue(all(results), results)
        self.assertTrue(self.triton.ServerLive(tpb.ServerLiveRequest(), timeout=TIMEOUT).live)


if __name__ == "__main__":
    unittest.main()
