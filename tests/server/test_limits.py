#!/usr/bin/python3
"""The real mha_server's limits and its end: a message limit, a request token
limit and batching off on one server, warmed lengths, and SIGTERM under load
(what was taken is computed, the rest refused, the exit clean).

    /usr/bin/python3 tests/server/test_limits.py [unittest options]
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "parity"))
from mha_test_server import (MHA_SERVER, OneServerPerClass, TestServer,  # noqa: E402
                             metric_sample, metric_value)
from test_server import (DEMO_DIR, DEMO_E, RPC_TIMEOUT, ServerTestCase,  # noqa: E402
                         make_repository, pb, randn, reference, request_fields, to_numpy)


# ----------------------------------------------------------------- small limits

class RestrictedServerTest(ServerTestCase, OneServerPerClass):
    """A server with a 100 kB message limit, a 64-token request limit and
    batching off."""

    server_flags = ("--max_message_bytes=100000", "--max_request_tokens=64",
                    "--disable_batching")

    @classmethod
    def make_repository(cls, folder):
        models = make_repository(folder, names=("demo",))
        # The demo model again, with primitives for 8 and 12 tokens made at load.
        shutil.copytree(DEMO_DIR, os.path.join(folder, "warm"))
        with open(os.path.join(folder, "warm", "config.pbtxt"), "a") as f:
            f.write("warmup_lengths: [8, 12]\n")
        models["warm"] = models["demo"]
        return models

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.stub = cls.server.stub(cls.channel)

    def setUp(self):
        self.rng = np.random.default_rng(7)

    def test_message_larger_than_limit(self):
        query = randn(self.rng, 1, 100, DEMO_E)  # 102 400 bytes of data
        self.assert_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "",
                              pb.AttendRequest(model="demo", **request_fields(query)))
        small = randn(self.rng, 1, 4, DEMO_E)
        self.check_against_torch("demo", self.attend(**request_fields(small)), small)

    def test_request_token_limit(self):
        query = randn(self.rng, 2, 20, DEMO_E)  # 40 query + 40 key tokens
        self.assert_rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              "request has 80 query + key tokens, the limit is 64",
                              pb.AttendRequest(model="demo", **request_fields(query)))
        query = query[:, :16]  # 64 tokens: allowed
        self.check_against_torch("demo", self.attend(**request_fields(query)), query)

    def test_batching_off_computes_one_request_per_call(self):
        before = self.server.metrics()
        queries = [randn(self.rng, 1 + i % 2, 2 + i, DEMO_E) for i in range(10)]
        futures = [self.stub.Attend.future(pb.AttendRequest(model="demo", **request_fields(q)),
                                           timeout=RPC_TIMEOUT) for q in queries]
        for query, future in zip(queries, futures):
            self.check_against_torch("demo", future.result(), query)
        after = self.server.metrics()

        def delta(name):
            return (metric_value(after, name, model="demo")
                    - metric_value(before, name, model="demo"))

        self.assertEqual(delta("mha_batch_requests_count"), len(queries))
        self.assertEqual(delta("mha_batch_requests_sum"), len(queries))

    def test_warmed_lengths_create_no_primitive_while_serving(self):
        name = "mha_engine_primitive_cache_misses_total"
        for length in (8, 12):
            query = randn(self.rng, 1, length, DEMO_E)
            self.check_against_torch("warm", self.attend("warm", **request_fields(query)), query)
        self.assertEqual(metric_sample(self.server.metrics(), name, model="warm"), 0)
        query = randn(self.rng, 1, 10, DEMO_E)  # a length not warmed
        self.check_against_torch("warm", self.attend("warm", **request_fields(query)), query)
        self.assertGreater(metric_value(self.server.metrics(), name, model="warm"), 0)

# ----------------------------------------------------------------- shutdown

class GracefulShutdownTest(ServerTestCase):

    def test_sigterm_under_load(self):
        repo = tempfile.mkdtemp(prefix="mha_server_test_repo_")
        self.addCleanup(shutil.rmtree, repo, True)
        self.models = make_repository(repo, names=("demo",))
        rng = np.random.default_rng(3)
        query = randn(rng, 2, 128, DEMO_E)
        ref_out, _ = reference(self.models["demo"], query)
        request = pb.AttendRequest(model="demo", **request_fields(query))
        server = TestServer(MHA_SERVER, repo)
        server.start()
        self.addCleanup(server.stop)
        channel = server.channel()
        self.addCleanup(channel.close)
        stub = server.stub(channel)
        # One call first, so the connection is up and the rest arrive at once.
        stub.Attend(request, timeout=RPC_TIMEOUT)
        futures = [stub.Attend.future(request, timeout=RPC_TIMEOUT) for _ in range(50)]
        server.process.send_signal(signal.SIGTERM)
        start = time.monotonic()
        outcomes = {}
        for i, future in enumerate(futures):
            try:
                response = future.result(timeout=RPC_TIMEOUT + 5)
            except grpc.RpcError as error:
                outcomes.setdefault(error.code(), []).append(error.details())
                continue
            except grpc.FutureTimeoutError:
                self.fail(f"request {i} got no answer")
            outcomes.setdefault(grpc.StatusCode.OK, []).append(None)
            self.assertEqual(list(response.output.shape), [2, 128, DEMO_E])
            self.assert_close(to_numpy(response.output), ref_out)
        self.assertEqual(sum(len(v) for v in outcomes.values()), 50)
        unexpected = {code: details for code, details in outcomes.items() if code not in (
            grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)}
        self.assertEqual(unexpected, {}, f"outcomes: { {c: len(d) for c, d in outcomes.items()} }")
        # Requests the server had taken before SIGTERM were computed, not
        # dropped (in practice 40 to 50 of the 50 are).
        self.assertGreaterEqual(len(outcomes.get(grpc.StatusCode.OK, [])), 1)
        try:
            code = server.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.fail("server did not exit within 60 s of SIGTERM")
        self.assertEqual(code, 0, server.stderr())
        self.assertLess(time.monotonic() - start, 30)
        self.assertIn("draining", server.stderr())
        os.unlink(server.stderr_path)
        counts = {c.name: len(v) for c, v in outcomes.items()}
        print(f"\n  shutdown outcomes: {counts}", file=sys.stderr, end=" ")


if __name__ == "__main__":
    if not os.access(MHA_SERVER, os.X_OK):
        sys.exit(f"test_limits.py: no executable server at {MHA_SERVER} (set MHA_SERVER)")
    unittest.main(verbosity=2)
