#!/usr/bin/python3
"""Memory tests of the real mha_server: one well-formed request must never
take the server down (issue 18).

    /usr/bin/python3 tests/server/test_memory.py [unittest options]

- Requests whose response could never be sent (above --max_message_bytes)
  are refused at once, on both front ends, with the numbers in the message.
- Requests that alone need more than the memory budget are refused; those
  that fit wait for each other; an allocation failure in the engine path
  answers RESOURCE_EXHAUSTED and the server goes on.
- The server stays up under RLIMIT_AS = 3 GiB (the address-space limit a
  container's memory limit amounts to), its peak RSS stays under 1 GiB,
  and RSS comes back after a large legitimate request.

The sanitizer build cannot run under RLIMIT_AS (AddressSanitizer maps
terabytes of shadow memory), so there the servers run without it and the
RSS bound allows for ASan's shadow and quarantine; every other assertion
is the same.
"""

import concurrent.futures
import os
import sys
import time
import unittest

import grpc
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "parity"))
from mha_model_io import format_pbtxt, write_safetensors  # noqa: E402
from mha_test_server import (ASAN, OneServerPerClass, TestServer, load_grpc_stubs, load_stubs,  # noqa: E402
                             metric_sample, proc_status, tensor, to_numpy, wait_for)
from test_server import DEMO_E, DEMO_H, MHA_SERVER, make_repository, reference  # noqa: E402
import mha_client  # noqa: E402

pb, rpc, cfg = load_stubs()
kpb, krpc = mha_client.load_kserve_stubs()
health_pb2, health_grpc, _, _ = load_grpc_stubs()

GiB, MiB = 1 << 30, 1 << 20
RLIMIT_AS_BYTES = 3 * GiB
WIDE_E, WIDE_H, WIDE_KDIM = 32, 4, 8   # cross-attention over 300k narrow keys
RPC_TIMEOUT = 120.0
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
CONCURRENT = 32   # requests at once just under the message limit


PEAK_RSS_BOUND = (3 * GiB) if ASAN else GiB


class LimitedServer(TestServer):
    """A TestServer started under RLIMIT_AS (but not under ASan): its binary is a
    script that execs prlimit, which execs the server, so the process (and
    its pid) is the server's own."""

    def __init__(self, repository, flags=(), folder=None, address_space=RLIMIT_AS_BYTES):
        binary = MHA_SERVER
        if not ASAN:
            binary = os.path.join(folder, "limited_server.sh")
            with open(binary, "w") as f:
                f.write(f'#!/bin/sh\nexec prlimit --as={address_space} -- {MHA_SERVER} "$@"\n')
            os.chmod(binary, 0o755)
        super().__init__(binary, repository, list(flags))

    def status(self, field):
        return proc_status(self.process.pid, field)

    def channel(self):
        return grpc.insecure_channel(self.target(), options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])


def make_wide_model(root):
    """A cross-attention model with narrow keys (kdim = vdim = 8)."""
    torch.manual_seed(5)
    module = torch.nn.MultiheadAttention(WIDE_E, WIDE_H, kdim=WIDE_KDIM, vdim=WIDE_KDIM,
                                         batch_first=True).eval()
    folder = os.path.join(root, "wide")
    os.makedirs(folder)
    write_safetensors(os.path.join(folder, "weights.safetensors"),
                      {n: (t.detach().numpy(), "F32") for n, t in module.state_dict().items()})
    with open(os.path.join(folder, "config.pbtxt"), "w") as f:
        f.write(format_pbtxt({"embed_dim": WIDE_E, "num_heads": WIDE_H, "kdim": WIDE_KDIM,
                              "vdim": WIDE_KDIM}))


def random(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def attend(query, model="demo", **fields):
    return pb.AttendRequest(model=model, query=tensor(pb, cfg, query), **fields)


def infer(query, need_weights=False, per_head=False):
    request = kpb.ModelInferRequest(model_name="demo")
    request.inputs.add(name="query", datatype="FP32", shape=query.shape)
    request.raw_input_contents.append(np.ascontiguousarray(query).tobytes())
    request.parameters["need_weights"].bool_param = need_weights
    request.parameters["per_head_weights"].bool_param = per_head
    return request


class MemoryTestBase(OneServerPerClass):
    """A server under RLIMIT_AS `address_space` on the demo and wide models
    (in cls.repo's models/, its core files beside)."""

    address_space = RLIMIT_AS_BYTES

    @classmethod
    def make_repository(cls, folder):
        repository = os.path.join(folder, "models")
        os.makedirs(repository)
        models = make_repository(repository, names=("demo",))
        make_wide_model(repository)
        return models

    @classmethod
    def make_server(cls):
        return LimitedServer(os.path.join(cls.repo, "models"), cls.server_flags, folder=cls.repo,
                             address_space=cls.address_space)

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.stub = rpc.AttentionServiceStub(cls.channel)
        cls.kserve = krpc.GRPCInferenceServiceStub(cls.channel)

    def assertRefused(self, call, *needles):
        """The call fails RESOURCE_EXHAUSTED in under 3 s (sending the request
        included; computing it would take far longer), naming `needles`."""
        start = time.monotonic()
        with self.assertRaises(grpc.RpcError) as caught:
            call()
        took = time.monotonic() - start
        self.assertEqual(caught.exception.code(), EXHAUSTED, caught.exception.details())
        self.assertLess(took, 3.0)
        for needle in needles:
            self.assertIn(needle, caught.exception.details())
        return caught.exception.details()

    def assertGoodAnswer(self, length=16, seed=1):
        query = random(1, length, DEMO_E, seed=seed)
        reply = self.stub.Attend(attend(query, need_weights=True), timeout=RPC_TIMEOUT)
        want, weights = reference(self.models["demo"], query)
        np.testing.assert_allclose(to_numpy(reply.output), want, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(to_numpy(reply.attn_weights), weights, atol=1e-5, rtol=1e-5)

    def assertAlive(self):
        self.assertIsNone(self.server.process.poll(), "the server exited")
        health = health_grpc.HealthStub(self.channel)
        self.assertEqual(health.Check(health_pb2.HealthCheckRequest(), timeout=10).status,
                         health_pb2.HealthCheckResponse.SERVING)


class AdmissionTest(MemoryTestBase):
    """Default limits (the budget from RLIMIT_AS), under RLIMIT_AS = 3 GiB."""

    def test_ready_line_says_where_the_limit_comes_from(self):
        self.assertRegex(self.server.ready_line, r"memory_limit_bytes=\d+ \(75% of ")
        # The allocator (CMakeLists.txt, MHA_TCMALLOC): glibc's grew without
        # bound under a mixed load (docs/RELIABILITY.md, "Memory").
        heap = os.environ.get("MHA_EXPECT_HEAP") or ("glibc" if ASAN else "tcmalloc")
        self.assertIn(f" heap={heap}", self.server.ready_line)
        if not ASAN:
            self.assertIn("RLIMIT_AS", self.server.ready_line)
            limit = int(self.server.ready_line.split("memory_limit_bytes=")[1].split()[0])
            self.assertLess(limit, RLIMIT_AS_BYTES * 3 // 4)
        text = self.server.metrics()
        self.assertGreater(metric_sample(text, "mha_memory_limit_bytes"), 0)
        self.assertIsNotNone(metric_sample(text, "mha_memory_reserved_bytes"))
        for reason in ("deadline", "cancelled", "queue_full", "memory", "message_size"):
            self.assertIsNotNone(
                metric_sample(text, "mha_dropped_requests_total", model="wide", reason=reason),
                reason)

    def test_the_reserve_holds_each_sessions_kept_answer(self):
        # 64 KiB a session for the answer kept for a step sent again
        # (docs/RELIABILITY.md): 1,024 sessions more, 64 MiB more.
        # A fixed session cache: by default it takes a share of what the
        # reserve leaves.
        def reserve(max_sessions):
            flags = ("--session_cache_bytes=16777216", f"--max_sessions={max_sessions}")
            with LimitedServer(os.path.join(self.repo, "models"), flags, folder=self.repo) as s:
                return metric_sample(s.metrics(), "mha_memory_engine_reserve_bytes")
        grown = reserve(2048) - reserve(1024)
        slack = 4 << 20  # the process's own resident set at its start (ASan: within 0.3 MB)
        self.assertGreater(grown, (64 << 20) - slack)
        self.assertLess(grown, (64 << 20) + slack)

    def test_responses_above_the_message_limit_are_refused_at_once(self):
        long = random(1, 16384, DEMO_E)
        before = metric_sample(self.server.metrics(), "mha_dropped_requests_total",
                               model="demo", reason="message_size")
        self.assertRefused(
            lambda: self.stub.Attend(attend(long, need_weights=True, per_head_weights=True),
                                     timeout=RPC_TIMEOUT),
            "attn_weights would be 4,294,967,296 bytes ([1, 4, 16384, 16384] FP32)",
            "the limit is 67,108,864 (--max_message_bytes)", "without need_weights")
        self.assertGoodAnswer()
        self.assertRefused(
            lambda: self.stub.Attend(attend(long, need_weights=True), timeout=RPC_TIMEOUT),
            "1,073,741,824 bytes ([1, 16384, 16384] FP32)")
        self.assertRefused(
            lambda: self.stub.Attend(attend(random(1, 8192, DEMO_E), need_weights=True,
                                            per_head_weights=True), timeout=RPC_TIMEOUT),
            "1,073,741,824 bytes ([1, 4, 8192, 8192] FP32)")
        keys = random(1, 300000, WIDE_KDIM)
        self.assertRefused(
            lambda: self.stub.Attend(attend(random(1, 64, WIDE_E), model="wide",
                                            key=tensor(pb, cfg, keys), need_weights=True),
                                     timeout=RPC_TIMEOUT),
            "76,800,000 bytes ([1, 64, 300000] FP32)")
        # KServe: the same check, the same message.
        self.assertRefused(
            lambda: self.kserve.ModelInfer(infer(long, need_weights=True, per_head=True),
                                           timeout=RPC_TIMEOUT),
            "attn_weights would be 4,294,967,296 bytes")
        self.assertGoodAnswer(seed=2)
        after = metric_sample(self.server.metrics(), "mha_dropped_requests_total",
                              model="demo", reason="message_size")
        self.assertEqual(after - before, 4)
        self.assertAlive()

    def test_cross_attention_over_300k_keys_within_the_limit_is_answered(self):
        keys = random(1, 300000, WIDE_KDIM, seed=3)
        query = random(1, 16, WIDE_E, seed=4)
        reply = self.stub.Attend(attend(query, model="wide", key=tensor(pb, cfg, keys),
                                        need_weights=True), timeout=RPC_TIMEOUT)
        self.assertEqual(list(reply.attn_weights.shape), [1, 16, 300000])
        weights = to_numpy(reply.attn_weights)
        np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-4)

    def test_concurrent_requests_just_under_the_message_limit(self):
        # Per-head weights of [1, 4, 2000, 2000] FP32 (64,000,000 bytes) and
        # the output: 66,048,000 bytes, under the 67,108,864 limit. 32 of
        # them at once would hold 2 GiB in responses alone (three times that
        # with the weights and the serialized copies): far beyond the budget.
        query = random(1, 2000, DEMO_E, seed=5)
        request = attend(query, need_weights=True, per_head_weights=True)
        answered = refused = 0
        with concurrent.futures.ThreadPoolExecutor(CONCURRENT) as pool:
            futures = [pool.submit(self.stub.Attend, request, timeout=RPC_TIMEOUT)
                       for _ in range(CONCURRENT)]
            first = None
            for f in concurrent.futures.as_completed(futures):
                try:
                    reply = f.result()
                except grpc.RpcError as e:
                    self.assertEqual(e.code(), EXHAUSTED, e.details())
                    self.assertIn("bytes", e.details())
                    refused += 1
                    continue
                self.assertEqual(list(reply.attn_weights.shape), [1, DEMO_H, 2000, 2000])
                if first is None:
                    first = (to_numpy(reply.output).copy(), to_numpy(reply.attn_weights).copy())
                answered += 1
        self.assertEqual(answered + refused, CONCURRENT)
        self.assertGreater(answered, 0)
        want, weights = reference(self.models["demo"], query, per_head=True)
        np.testing.assert_allclose(first[0], want, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(first[1], weights, atol=1e-5, rtol=1e-5)
        self.assertGoodAnswer(seed=6)
        self.assertAlive()

    def test_zz_peak_rss_stayed_bounded(self):
        # Runs last (alphabetical order): after every request above.
        self.assertLess(self.server.status("VmHWM"), PEAK_RSS_BOUND)
        self.assertAlive()


class BudgetTest(MemoryTestBase):
    """A small budget and no message limit in the way: the memory check
    itself, and RSS coming back."""
    # 640 MiB for requests beyond one worker's kept workspace (64 MiB each;
    # the server has two workers) and the 64 MiB of freed buffers kept for
    # reuse: one ~300 MB request at a time, with room for the others to wait
    # in the queue. 16 sessions, so that the answers they may keep (64 KiB
    # each, in the reserve) take 1 MiB of it, not the default's 64.
    limit = 768 * MiB
    server_flags = (f"--memory_limit_bytes={limit}", f"--max_message_bytes={2 * GiB - 1}",
                    "--max_sessions=16")

    def test_a_request_alone_above_the_budget_is_refused(self):
        details = self.assertRefused(
            lambda: self.stub.Attend(attend(random(1, 16384, DEMO_E), need_weights=True),
                                     timeout=RPC_TIMEOUT),
            "bytes of working memory", "--memory_limit_bytes", "without need_weights")
        self.assertIn("the server's memory budget for requests is ", details)
        self.assertGreater(metric_sample(self.server.metrics(), "mha_dropped_requests_total",
                                         model="demo", reason="memory"), 0)
        self.assertGoodAnswer()

    def test_requests_that_fit_one_at_a_time_wait_for_each_other(self):
        # Each needs ~300 MB (weights [1, 4096, 4096] FP32, twice, and the
        # response twice): the budget takes one at a time, none is refused.
        query = random(1, 4096, DEMO_E, seed=7)
        request = attend(query, need_weights=True)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: self.stub.Attend(request, timeout=RPC_TIMEOUT),
                                    range(4)))
        want, weights = reference(self.models["demo"], query)
        for reply in replies:
            np.testing.assert_allclose(to_numpy(reply.output), want, atol=1e-5, rtol=1e-5)
        # The server gives a request's bytes back when its RPC is done, which
        # may be just after the client has the answer.
        wait_for(lambda: metric_sample(self.server.metrics(), "mha_memory_reserved_bytes") == 0,
                 2.0, "the reserved bytes to come back")
        self.assertEqual(metric_sample(self.server.metrics(), "mha_memory_reserved_bytes"), 0)
        self.assertLess(self.server.status("VmHWM"), self.limit + (2 * GiB if ASAN else 0))

    def test_rss_comes_back_after_a_large_request(self):
        self.assertGoodAnswer(length=128)
        time.sleep(0.5)
        before = self.server.status("VmRSS")
        query = random(1, 4096, DEMO_E, seed=8)  # ~300 MB of working memory
        reply = self.stub.Attend(attend(query, need_weights=True), timeout=RPC_TIMEOUT)
        self.assertEqual(list(reply.attn_weights.shape), [1, 4096, 4096])
        del reply
        tcmalloc = " heap=tcmalloc" in self.server.ready_line
        if tcmalloc:  # what was freed sits in TCMalloc's page heap, shown
            self.assertGreater(self.heap_free(), 64 << 20)
        # The heap gives back what large requests freed once they have
        # stopped for 2 s (server/scheduling/heap_trim.h).
        wait_for(lambda: self.server.status("VmRSS") < 2 * before, 6.0, "RSS to come back")
        if tcmalloc:  # given back: no longer the heap's
            wait_for(lambda: self.heap_free() < 64 << 20, 6.0, "the free heap to be given back")
        self.assertAlive()

    def heap_free(self):
        return metric_sample(self.server.metrics(), "mha_memory_held_bytes", kind="heap_free")


@unittest.skipIf(ASAN, "RLIMIT_AS cannot apply to an AddressSanitizer build")
class AllocationFailureTest(MemoryTestBase):
    """A budget far above what RLIMIT_AS (1.5 GiB here) allows: admission
    lets a request through whose buffers cannot be allocated. It must get
    RESOURCE_EXHAUSTED, and the server must go on."""
    server_flags = (f"--memory_limit_bytes={256 * GiB}", f"--max_message_bytes={2 * GiB - 1}")
    address_space = 3 * GiB // 2

    def test_bad_alloc_answers_resource_exhausted(self):
        # weights [1, 22000, 22000]: 1.8 GiB, more than the address space
        # (with glibc's malloc, whose arenas reserve 64 MiB each, 1 GiB did
        # not fit; with TCMalloc it did).
        query = random(1, 22000, DEMO_E, seed=9)
        with self.assertRaises(grpc.RpcError) as caught:
            self.stub.Attend(attend(query, need_weights=True), timeout=RPC_TIMEOUT)
        self.assertEqual(caught.exception.code(), EXHAUSTED, caught.exception.details())
        self.assertIn("out of memory", caught.exception.details())
        self.assertGoodAnswer()
        self.assertAlive()


if __name__ == "__main__":
    unittest.main()
