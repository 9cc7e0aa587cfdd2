#!/usr/bin/python3
"""Triton's statistics under load, on the real mha_server (issue 47).

    MHA_SERVER=build/mha_server /usr/bin/python3 tests/server/test_statistics.py

perf_analyzer reads ModelStatistics before and after each window and stops
when the compute_input, compute_infer and compute_output counts moved apart.
Here 64 clients send every kind of inference at once (mha.v1 Attend, KServe
ModelInfer, ModelStreamInfer, Triton sequences and mha.v1 session steps)
while a reader takes snapshots in a tight loop. In every snapshot of a model
with no failures:
  success.count == queue.count == compute_input.count
                == compute_infer.count == compute_output.count,
  sum(batch_size x executions) == inference_count,
and at the end each request and step the clients got back OK is counted
once: success.count is their number and inference_count their sequences.
"""

import os
import sys
import tempfile
import threading
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mha_test_server import TestServer, tensor  # noqa: E402
from test_server import DEMO_E, MHA_SERVER, cfg, make_repository, pb  # noqa: E402
from triton_messages import triton_stubs  # noqa: E402
from test_sequences import infer_request  # noqa: E402

tpb, trpc = triton_stubs()
TIMEOUT = 60
CLIENTS_PER_KIND = 13  # 5 kinds: 65 clients
REQUESTS_PER_CLIENT = 24
SEQUENCE_STEPS = 6  # steps a sequence or session takes before it ends


def query(rng, batch, length):
    return rng.standard_normal((batch, length, DEMO_E)).astype(np.float32)


class Tally:
    """What the clients got back OK: requests (steps included) and their
    sequences (B of a request, 1 a step). Thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = 0
        self.sequences = 0

    def add(self, sequences):
        with self.lock:
            self.requests += 1
            self.sequences += sequences


def violations(stats):
    """What is inconsistent in one ModelStatistics entry (empty: nothing)."""
    s = stats.inference_stats
    counts = {"success": s.success.count, "queue": s.queue.count,
              "compute_input": s.compute_input.count,
              "compute_infer": s.compute_infer.count,
              "compute_output": s.compute_output.count}
    found = []
    if len(set(counts.values())) != 1:
        found.append(f"counts apart: {counts}")
    batched = sum(b.batch_size * b.compute_infer.count for b in stats.batch_stats)
    if batched != stats.inference_count:
        found.append(f"batch_stats sum {batched} != inference_count {stats.inference_count}")
    for b in stats.batch_stats:
        if not b.compute_input.count == b.compute_infer.count == b.compute_output.count:
            found.append(f"batch {b.batch_size}: counts apart")
    if s.fail.count:
        found.append(f"{s.fail.count} failures")
    return found


class StatisticsUnderLoadTest(unittest.TestCase):
    def test_every_snapshot_is_consistent(self):
        with tempfile.TemporaryDirectory() as tmp:
            make_repository(tmp, names=("demo",))
            with TestServer(MHA_SERVER, tmp, []) as server:
                self.run_load(server)

    def run_load(self, server):
        tally, errors = Tally(), []
        done = threading.Event()

        def client(kind, index):
            rng = np.random.default_rng(1000 * len(kind) + index)
            channel = server.channel()
            try:
                KINDS[kind](channel, rng, index, tally)
            except Exception as e:  # noqa: BLE001 - reported by the test
                errors.append(f"{kind} {index}: {e!r}")
            finally:
                channel.close()

        snapshots, bad = [], []

        def reader():
            channel = server.channel()
            triton = trpc.GRPCInferenceServiceStub(channel)
            while not done.is_set():
                stats = triton.ModelStatistics(tpb.ModelStatisticsRequest(name="demo"),
                                               timeout=TIMEOUT).model_stats[0]
                snapshots.append(stats.inference_stats.success.count)
                if found := violations(stats):
                    bad.append(found)
            channel.close()

        threads = [threading.Thread(target=client, args=(kind, i))
                   for kind in KINDS for i in range(CLIENTS_PER_KIND)]
        watcher = threading.Thread(target=reader)
        watcher.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()
        watcher.join()

        self.assertEqual(errors, [])
        # Snapshots taken while the load ran, most of them mid-way.
        self.assertGreater(len(snapshots), 50)
        self.assertGreater(len([n for n in snapshots if 0 < n < tally.requests]), 20)
        self.assertEqual(bad[:3], [], f"{len(bad)} of {len(snapshots)} snapshots inconsistent")

        triton = trpc.GRPCInferenceServiceStub(server.channel())
        final = triton.ModelStatistics(tpb.ModelStatisticsRequest(name="demo"),
                                       timeout=TIMEOUT).model_stats[0]
        self.assertEqual(violations(final), [])
        self.assertEqual(final.inference_stats.success.count, tally.requests)
        self.assertEqual(final.inference_count, tally.sequences)
        # Calls of more than one request or step were formed.
        self.assertLess(final.execution_count, tally.requests)
        # mha.v1's view of the same version agrees.
        ours = server.stub().GetModelStatistics(pb.GetModelStatisticsRequest(name="demo"))
        self.assertEqual(ours.models[0].inference_count, tally.sequences)
        self.assertEqual(ours.models[0].success.count, tally.requests)


class FailuresCountedOnceTest(unittest.TestCase):
    """Each refused or failed request and step counts once under `fail`,
    and nothing else moves: before the queue (decoding), in the engine
    (a result that overflows float32), for every transport."""

    def test_each_failure_counts_once(self):
        import grpc
        with tempfile.TemporaryDirectory() as tmp:
            make_repository(tmp, names=("demo",))
            with TestServer(MHA_SERVER, tmp, []) as server:
                stub = server_stub(server.channel())
                triton = trpc.GRPCInferenceServiceStub(server.channel())
                rng = np.random.default_rng(7)
                wrong_width = rng.standard_normal((1, 4, DEMO_E + 1)).astype(np.float32)
                huge = np.full((1, 4, DEMO_E), 3e38, np.float32)  # finite, overflows
                session = stub.OpenSession(pb.OpenSessionRequest(model="demo"), timeout=TIMEOUT)
                stub.Append(pb.AppendRequest(session_id=session.session_id, query=tensor(
                    pb, cfg, query(rng, 1, 2))), timeout=TIMEOUT)
                triton.ModelInfer(infer_request("demo", seq_id=5, start=True,
                                                query=query(rng, 1, 2)), timeout=TIMEOUT)
                before = triton.ModelStatistics(tpb.ModelStatisticsRequest(name="demo"),
                                                timeout=TIMEOUT).model_stats[0]
                self.assertEqual(before.inference_stats.success.count, 2)
                failing = [
                    lambda: stub.Attend(pb.AttendRequest(
                        model="demo", query=tensor(pb, cfg, wrong_width)), timeout=TIMEOUT),
                    lambda: stub.Attend(pb.AttendRequest(
                        model="demo", query=tensor(pb, cfg, huge)), timeout=TIMEOUT),
                    lambda: triton.ModelInfer(infer_request("demo", query=wrong_width),
                                              timeout=TIMEOUT),
                    lambda: triton.ModelInfer(infer_request("demo", query=huge),
                                              timeout=TIMEOUT),
                    lambda: stub.Append(pb.AppendRequest(
                        session_id=session.session_id, query=tensor(pb, cfg, wrong_width[:1])),
                        timeout=TIMEOUT),
                    lambda: triton.ModelInfer(infer_request("demo", seq_id=5,
                                                            query=wrong_width), timeout=TIMEOUT),
                ]
                for call in failing:
                    with self.assertRaises(grpc.RpcError) as e:
                        call()
                    self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
                streamed = list(triton.ModelStreamInfer(iter([
                    infer_request("demo", query=wrong_width), infer_request("demo", query=huge)]),
                    timeout=TIMEOUT))
                self.assertTrue(all(r.error_message for r in streamed))
                after = triton.ModelStatistics(tpb.ModelStatisticsRequest(name="demo"),
                                               timeout=TIMEOUT).model_stats[0]
                self.assertEqual(after.inference_stats.fail.count,
                                 before.inference_stats.fail.count + len(failing) + 2)
                self.assertEqual(after.inference_stats.success.count, 2)
                self.assertEqual(after.inference_count, before.inference_count)


def attend_unary(channel, rng, index, tally):
    stub = server_stub(channel)
    for _ in range(REQUESTS_PER_CLIENT):
        batch = int(rng.integers(1, 4))
        stub.Attend(pb.AttendRequest(model="demo", query=tensor(pb, cfg, query(
            rng, batch, int(rng.integers(2, 17))))), timeout=TIMEOUT)
        tally.add(batch)


def kserve_unary(channel, rng, index, tally):
    triton = trpc.GRPCInferenceServiceStub(channel)
    for _ in range(REQUESTS_PER_CLIENT):
        batch = int(rng.integers(1, 4))
        triton.ModelInfer(infer_request("demo", query=query(rng, batch, int(rng.integers(2, 17)))),
                          timeout=TIMEOUT)
        tally.add(batch)


def kserve_stream(channel, rng, index, tally):
    triton = trpc.GRPCInferenceServiceStub(channel)
    batches = [int(rng.integers(1, 4)) for _ in range(REQUESTS_PER_CLIENT)]
    requests = [infer_request("demo", query=query(rng, b, int(rng.integers(2, 17))))
                for b in batches]
    answers = list(triton.ModelStreamInfer(iter(requests), timeout=TIMEOUT))
    assert len(answers) == len(requests), len(answers)
    for answer, batch in zip(answers, batches):
        assert not answer.error_message, answer.error_message
        tally.add(batch)


def triton_sequences(channel, rng, index, tally):
    triton = trpc.GRPCInferenceServiceStub(channel)
    for n in range(REQUESTS_PER_CLIENT // SEQUENCE_STEPS):
        for step in range(SEQUENCE_STEPS):
            triton.ModelInfer(infer_request(
                "demo", seq_id=f"s{index}-{n}", start=step == 0, end=step == SEQUENCE_STEPS - 1,
                query=query(rng, 1, int(rng.integers(1, 4)))), timeout=TIMEOUT)
            tally.add(1)


def session_steps(channel, rng, index, tally):
    stub = server_stub(channel)
    for n in range(REQUESTS_PER_CLIENT // SEQUENCE_STEPS):
        session = stub.OpenSession(pb.OpenSessionRequest(model="demo"), timeout=TIMEOUT)
        for _ in range(SEQUENCE_STEPS):
            stub.Append(pb.AppendRequest(session_id=session.session_id, query=tensor(
                pb, cfg, query(rng, 1, int(rng.integers(1, 4))))), timeout=TIMEOUT)
            tally.add(1)
        stub.CloseSession(pb.CloseSessionRequest(session_id=session.session_id),
                          timeout=TIMEOUT)


def server_stub(channel):
    from test_server import rpc
    return rpc.AttentionServiceStub(channel)


KINDS = {"attend": attend_unary, "kserve": kserve_unary, "stream": kserve_stream,
         "sequence": triton_sequences, "session": session_steps}


if __name__ == "__main__":
    unittest.main(verbosity=2)
