#!/usr/bin/python3
"""Fault tests against the real mha_server: clients that go away mid-request,
and a server restarted while a client retries.

    /usr/bin/python3 tests/server/test_faults.py [unittest options]

A client that disconnects must cost the server nothing lasting: no crash,
no request stuck in flight, correct answers for everyone else. A client that
retries UNAVAILABLE across a restart must get every answer, and the right one.
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mha_test_server import ASAN, TestServer, load_stubs, metric_value, tensor, to_numpy  # noqa: E402
from mha_local_server import free_port  # noqa: E402
from test_server import DEMO_E, MHA_SERVER, make_repository, reference  # noqa: E402

pb, rpc, cfg = load_stubs()
TIMEOUT = 30.0

# A client process that sends big requests and is killed before answers come.
_CLIENT_SCRIPT = """
import sys, grpc, numpy as np
sys.path.insert(0, {tests!r})
from mha_test_server import load_stubs, tensor
pb, rpc, cfg = load_stubs()
stub = rpc.AttentionServiceStub(grpc.insecure_channel({target!r}, options=[
    ("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]))
query = np.random.default_rng(0).standard_normal((4, 512, {e}), dtype=np.float32)
futures = [stub.Attend.future(pb.AttendRequest(model="demo", query=tensor(pb, cfg, query),
                                               need_weights=True)) for _ in range(8)]
print("sent", flush=True)
for f in futures:
    f.result()
"""


class DisconnectTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.models = make_repository(cls.tmp.name, names=("demo",))
        cls.server = TestServer(MHA_SERVER, cls.tmp.name)
        cls.server.start()
        cls.stub = rpc.AttentionServiceStub(cls.server.channel())

    @classmethod
    def tearDownClass(cls):
        code = cls.server.stop()
        cls.tmp.cleanup()
        assert code == 0, f"server exit code {code}"

    def check_still_correct(self):
        query = np.random.default_rng(1).standard_normal((2, 9, DEMO_E), dtype=np.float32)
        got = self.stub.Attend(pb.AttendRequest(model="demo", query=tensor(pb, cfg, query)),
                               timeout=TIMEOUT)
        want, _ = reference(self.models["demo"], query)
        np.testing.assert_allclose(to_numpy(got.output), want, atol=1e-5, rtol=0)

    def wait_idle(self):
        """mha_inflight_requests back to 0: no call stuck after its client left."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            inflight = metric_value(self.server.metrics(), "mha_inflight_requests", model="demo")
            if inflight == 0:
                return
            time.sleep(0.1)
        self.fail(f"{inflight} requests still in flight 30 s after their clients left")

    def test_killed_client_processes(self):
        script = _CLIENT_SCRIPT.format(tests=HERE, target=self.server.target(), e=DEMO_E)
        for delay in (0.0, 0.05, 0.2, 0.5):
            client = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                      text=True)
            self.assertEqual(client.stdout.readline().strip(), "sent")
            time.sleep(delay)
            client.send_signal(signal.SIGKILL)
            client.wait()
            client.stdout.close()
        self.assertIsNone(self.server.process.poll(), "server died")
        self.wait_idle()
        self.check_still_correct()

    def test_cancelled_calls_and_short_deadlines(self):
        query = np.random.default_rng(2).standard_normal((4, 256, DEMO_E), dtype=np.float32)
        request = pb.AttendRequest(model="demo", query=tensor(pb, cfg, query), need_weights=True)
        before = self.server.metrics()
        futures = [self.stub.Attend.future(request, timeout=TIMEOUT) for _ in range(24)]
        for f in futures[::2]:
            f.cancel()
        expired = [self.stub.Attend.future(request, timeout=0.001) for _ in range(8)]
        for f in futures[1::2]:
            self.assertEqual(f.result().output.shape, [4, 256, DEMO_E])
        for f in expired:
            with self.assertRaises(grpc.RpcError) as e:
                f.result()
            self.assertEqual(e.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        self.wait_idle()
        after = self.server.metrics()
        total = lambda text: sum(  # noqa: E731
            metric_value(text, "mha_requests_total", model="demo", code=c)
            for c in ("OK", "CANCELLED", "DEADLINE_EXCEEDED"))
        # Every call that reached a handler was answered and counted once.
        self.assertLessEqual(total(after) - total(before), 32)
        self.assertGreaterEqual(total(after) - total(before), 12)
        self.check_still_correct()

    def server_cpu_seconds(self):
        with open(f"/proc/{self.server.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def test_a_call_past_its_deadline_stops(self):
        """Issue 64: a started call nobody waits for stops at its next yield
        point, counted as DEADLINE_EXCEEDED and dropped, not OK."""
        query = np.random.default_rng(4).standard_normal((1, 24000, DEMO_E), dtype=np.float32)
        request = pb.AttendRequest(model="demo", query=tensor(pb, cfg, query))
        before = self.server.metrics()
        sent = time.monotonic()
        with self.assertRaises(grpc.RpcError) as e:  # seconds of compute, 1.5 s allowed
            self.stub.Attend(request, timeout=1.5)
        self.assertEqual(e.exception.code(), grpc.StatusCode.DEADLINE_EXCEEDED)
        # The server's CPU goes idle: 50 ms slices until one uses < 10 % of a core.
        idle_after = None
        while time.monotonic() - sent < 10:
            start, cpu = time.monotonic(), self.server_cpu_seconds()
            time.sleep(0.05)
            if self.server_cpu_seconds() - cpu < 0.1 * (time.monotonic() - start):
                idle_after = time.monotonic() - sent - 1.5
                break
        self.assertIsNotNone(idle_after, "the server computed on for 10 s")
        # Under AddressSanitizer the server goes idle 0.28-0.34 s after the
        # deadline alone, and took 0.78 s once beside the other tests of a
        # `ctest -j2` (2026-11-29); the call itself would compute on for
        # seconds more.
        self.assertLess(idle_after, 1.0 if ASAN else 0.5,
                        "idle within a yield interval (and our sampling)")
        self.wait_idle()
        after = self.server.metrics()
        for name, labels in (("mha_requests_total", {"code": "DEADLINE_EXCEEDED"}),
                             ("mha_dropped_requests_total", {"reason": "deadline"})):
            self.assertEqual(metric_value(after, name, model="demo", **labels) -
                             metric_value(before, name, model="demo", **labels), 1, name)
        self.assertEqual(metric_value(after, "mha_requests_total", model="demo", code="OK"),
                         metric_value(before, "mha_requests_total", model="demo", code="OK"))
        self.check_still_correct()

    def test_half_open_and_garbage_connections(self):
        port = self.server.grpc_port
        sockets = []
        for payload in (b"", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
                        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x12\x04\x00\x00",
                        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", os.urandom(4096)):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(payload)
            sockets.append(s)
        self.check_still_correct()  # served while those hang open
        for s in sockets:
            s.close()
        self.assertIsNone(self.server.process.poll(), "server died")
        self.check_still_correct()


class RestartTest(unittest.TestCase):
    """The server is stopped (SIGTERM) and started again on the same port
    while a client sends requests one after another, retrying UNAVAILABLE."""

    def test_client_retrying_across_a_restart_gets_every_answer(self):
        with tempfile.TemporaryDirectory() as tmp:
            models = make_repository(tmp, names=("demo",))
            port = free_port()
            flags = [f"--port={port}"]
            queries = [np.random.default_rng(i).standard_normal((1, 4 + i % 5, DEMO_E),
                                                               dtype=np.float32)
                       for i in range(120)]
            answers, retries, other_errors = {}, [0], []
            server = TestServer(MHA_SERVER, tmp, flags)
            server.start()
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            stub = rpc.AttentionServiceStub(channel)

            def client():
                for i, q in enumerate(queries):
                    request = pb.AttendRequest(model="demo", query=tensor(pb, cfg, q))
                    deadline = time.monotonic() + 60
                    while time.monotonic() < deadline:
                        try:
                            answers[i] = to_numpy(stub.Attend(request, timeout=10,
                                                              wait_for_ready=True).output)
                            break
                        except grpc.RpcError as e:
                            # DEADLINE_EXCEEDED: the channel's reconnect backoff
                            # (1 s, 1.6 s, 2.6 s, ...) can outlast a restart's 10 s.
                            if e.code() not in (grpc.StatusCode.UNAVAILABLE,
                                                grpc.StatusCode.CANCELLED,
                                                grpc.StatusCode.DEADLINE_EXCEEDED):
                                other_errors.append((i, e.code(), e.details()))
                                return
                            retries[0] += 1
                            time.sleep(0.05)
                    time.sleep(0.01)

            thread = threading.Thread(target=client)
            thread.start()
            while len(answers) < 30:
                time.sleep(0.01)
            self.assertEqual(server.stop(), 0)
            answered_before_restart = len(answers)
            time.sleep(0.3)  # the client is now retrying against a closed port
            restarted = TestServer(MHA_SERVER, tmp, flags)
            restarted.start()
            thread.join(120)
            channel.close()
            self.assertEqual(restarted.stop(), 0)
            self.assertEqual(other_errors, [])
            self.assertLess(answered_before_restart, len(queries) - 10)  # restart mid-stream
            self.assertEqual(sorted(answers), list(range(len(queries))))
            for i, q in enumerate(queries):
                want, _ = reference(models["demo"], q)
                np.testing.assert_allclose(answers[i], want, atol=1e-5, rtol=0, err_msg=str(i))
            print(f"\n{retries[0]} retries across the restart", file=sys.stderr)


if __name__ == "__main__":
    unittest.main()
