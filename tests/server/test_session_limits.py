#!/usr/bin/python3
"""Sessions of the real mha_server at their limits (issue 22): refusals that
name what is wrong, max_tokens, close and list, eviction of the least
recently used idle session, expiry, SIGTERM while streams step, the cache
budget, and a step closing a waiting batch of Attend requests.

    /usr/bin/python3 tests/server/test_session_limits.py [unittest options]
"""

import concurrent.futures
import os
import signal
import sys
import tempfile
import time
import unittest

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "parity"))
from mha_test_server import ASAN, TestServer, metric_value, proc_status, wait_for  # noqa: E402
from test_server import DEMO_E, MHA_SERVER, make_repository, randn, reference  # noqa: E402
from test_sessions import DEMO_BLOCK_BYTES, TOL, SessionServer, pb, rpc  # noqa: E402
import mha_client  # noqa: E402


class SessionLimitsTest(SessionServer):
    """A server whose cache holds 4 demo blocks (128 tokens)."""

    server_flags = ("--session_cache_bytes", str(4 * DEMO_BLOCK_BYTES))

    def test_full_cache_evicts_the_least_recently_used_idle_session(self):
        rng = np.random.default_rng(8)
        a = self.client.open_session("demo")
        b = self.client.open_session("demo")
        a.append(randn(rng, 64, DEMO_E))
        time.sleep(0.1)
        b.append(randn(rng, 64, DEMO_E))  # the cache is full
        self.assertEqual(metric_value(self.server.metrics(), "mha_session_cache_bytes"),
                         4 * DEMO_BLOCK_BYTES)
        with self.client.open_session("demo") as c:
            c.append(randn(rng, 1, DEMO_E))  # evicts a, the least recently used
        with self.assertRaises(grpc.RpcError) as caught:
            a.append(randn(rng, 1, DEMO_E))
        self.assertEqual(caught.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.assertRegex(caught.exception.details(),
                         rf"session {a.id} was evicted: idle \d+ s, cache full")
        b.append(randn(rng, 1, DEMO_E))  # b survived
        text = self.server.metrics()
        self.assertEqual(metric_value(text, "mha_session_evictions_total", model="demo",
                                      reason="cache_full"), 1)
        # A session that alone needs more than the cache.
        with self.client.open_session("demo") as big:
            with self.assertRaises(grpc.RpcError) as caught:
                big.append(randn(rng, 200, DEMO_E))
            self.assertEqual(caught.exception.code(), grpc.StatusCode.RESOURCE_EXHAUSTED)
            self.assertIn("session cache full", caught.exception.details())
        b.close()

    def test_idle_sessions_expire(self):
        rng = np.random.default_rng(9)
        # 2 s: room for a slow (sanitizer) build between the calls; the
        # expiry thread looks every second.
        session = self.client.open_session("demo", idle_timeout_s=2)
        session.append(randn(rng, 1, DEMO_E))
        self.assertEqual(metric_value(self.server.metrics(), "mha_sessions_active", model="demo"),
                         1)
        time.sleep(3.5)
        with self.assertRaises(grpc.RpcError) as caught:
            session.append(randn(rng, 1, DEMO_E))
        self.assertEqual(caught.exception.code(), grpc.StatusCode.NOT_FOUND)
        self.assertIn("expired: idle", caught.exception.details())
        text = self.server.metrics()
        self.assertEqual(metric_value(text, "mha_sessions_active", model="demo"), 0)
        self.assertEqual(metric_value(text, "mha_session_evictions_total", model="demo",
                                      reason="expired"), 1)


class SessionDrainAndMemoryTest(unittest.TestCase):
    def test_sigterm_refuses_new_sessions_and_lets_open_streams_step(self):
        with tempfile.TemporaryDirectory() as tmp:
            make_repository(tmp, ("demo",))
            server = TestServer(MHA_SERVER, tmp, ["--shutdown_grace_s=20"]).__enter__()
            try:
                requests = queue_iter()
                call = rpc.AttentionServiceStub(server.channel()).Stream(requests, timeout=60)
                rng = np.random.default_rng(12)
                x = randn(rng, 1, 1, DEMO_E)
                requests.put(pb.StreamRequest(id="open", open_session=pb.OpenSessionRequest(
                    model="demo", session_id="draining")))
                self.assertEqual(next(call).code, 0)
                server.process.send_signal(signal.SIGTERM)
                wait_for(lambda: "signal 15, draining" in server.stderr(), what="draining")
                requests.put(pb.StreamRequest(id="step", append=pb.AppendRequest(
                    session_id="draining", query=mha_client.to_tensor(x))))
                step = next(call)
                self.assertEqual((step.id, step.code), ("step", 0), step.error_message)
                self.assertEqual(step.append.position, 1)
                requests.put(pb.StreamRequest(id="new", open_session=pb.OpenSessionRequest(
                    model="demo")))
                refused = next(call)
                self.assertEqual(refused.code, grpc.StatusCode.UNAVAILABLE.value[0])
                self.assertIn("shutting down", refused.error_message)
                requests.close()
                list(call)
            finally:
                self.assertEqual(server.stop(), 0)

    def test_the_cache_budget_bounds_memory(self):
        budget = 48 << 20
        with tempfile.TemporaryDirectory() as tmp:
            make_repository(tmp, ("demo",))
            server = TestServer(MHA_SERVER, tmp, [f"--session_cache_bytes={budget}"]).__enter__()
            try:
                client = mha_client.MhaClient(server.target(), timeout=60)
                rng = np.random.default_rng(13)
                chunk = randn(rng, 1, 512, DEMO_E)
                client.attend("demo", chunk, is_causal=True)  # workspaces at this size
                held = lambda text, kind: metric_value(  # noqa: E731
                    text, "mha_memory_held_bytes", kind=kind)
                on_purpose = ("weights", "workspaces", "kept_buffers", "kv_cache", "primitives")
                text = server.metrics()
                rss_before = proc_status(server.process.pid, "VmRSS")
                held_before = sum(held(text, k) for k in on_purpose)
                # 40 sessions of 1024 tokens (2 KiB each): 80 MiB asked of a 48 MiB cache.
                for _ in range(40):
                    session = client.open_session("demo")
                    session.append(chunk)
                    session.append(chunk)
                text = server.metrics()
                self.assertLessEqual(metric_value(text, "mha_session_cache_bytes"), budget)
                self.assertLessEqual(held(text, "kv_cache"), budget, "what the budget promises")
                # The primitives made at load and for these shapes, within
                # the reserve's 512 of them (MhaEngine::kPrimitiveCacheBytes).
                self.assertGreater(held(text, "primitives"), 0)
                self.assertLessEqual(held(text, "primitives"), 512 * (112 << 10))
                self.assertGreater(metric_value(text, "mha_session_evictions_total",
                                                reason="cache_full"), 0)
                # The resident set follows what the server holds on purpose: its
                # growth beyond that is the heap's free memory, which the trim
                # thread gives back within seconds (it once grew 81 MiB against
                # an 80 MiB bound on what glibc happened to keep). Under
                # AddressSanitizer freed memory sits in its quarantine instead.
                if not ASAN:
                    def within_what_is_held():
                        now = server.metrics()
                        grown = proc_status(server.process.pid, "VmRSS") - rss_before
                        return grown <= sum(held(now, k) for k in on_purpose) - held_before + (
                            16 << 20)
                    wait_for(within_what_is_held, timeout=20,
                             what="RSS growth within what is held on purpose + 16 MiB")
                client.close()
            finally:
                self.assertEqual(server.stop(), 0)


class SessionStepsRideAlongTest(unittest.TestCase):
    def test_a_step_closes_a_waiting_batch_and_goes_first(self):
        """demo with max_queue_delay_us of 3 s: an Attend request waits for
        company; a session step arrives and both are computed at once, the
        step in an engine call of its own first, each answer right."""
        with tempfile.TemporaryDirectory() as tmp:
            models = make_repository(tmp, ("demo",))
            with open(os.path.join(tmp, "demo", "config.pbtxt"), "a") as f:
                f.write("dynamic_batching {\n  max_queue_delay_us: 3000000\n}\n")
            server = TestServer(MHA_SERVER, tmp).__enter__()
            try:
                client = mha_client.MhaClient(server.target(), timeout=60)
                rng = np.random.default_rng(14)
                x, step = randn(rng, 1, 6, DEMO_E), randn(rng, 1, 2, DEMO_E)
                session = client.open_session("demo")
                calls = metric_value(server.metrics(), "mha_compute_duration_seconds_count",
                                     model="demo")
                start = time.monotonic()
                with concurrent.futures.ThreadPoolExecutor(1) as pool:
                    attended = pool.submit(client.attend, "demo", x)
                    wait_for(lambda: metric_value(server.metrics(), "mha_queue_depth",
                                                  model="demo") == 1,
                             2.0, "the request to wait in the queue")
                    self.assertFalse(attended.done(), "the request should wait for company")
                    stepped = session.append(step)
                    out, _ = attended.result()
                self.assertLess(time.monotonic() - start, 2.0, "the step closed the batch")
                after = metric_value(server.metrics(), "mha_compute_duration_seconds_count",
                                     model="demo")
                self.assertEqual(after - calls, 2, "the step's engine call, then the request's")
                want, _ = reference(models["demo"], x)
                np.testing.assert_allclose(out, want, rtol=TOL, atol=TOL)
                want_step, _ = reference(models["demo"], step, is_causal=True)
                np.testing.assert_allclose(stepped, want_step, rtol=TOL, atol=TOL)
                session.close()
                client.close()
            finally:
                self.assertEqual(server.stop(), 0)


class queue_iter:
    """A request iterator fed from the test, for a stream kept open."""

    def __init__(self):
        import queue
        self.q = queue.Queue()

    def put(self, item):
        self.q.put(item)

    def close(self):
        self.q.put(None)

    def __iter__(self):
        return self

    def __next__(self):
        item = self.q.get()
        if item is None:
            raise StopIteration
        return item


if __name__ == "__main__":
    unittest.main()
