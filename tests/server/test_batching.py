#!/usr/bin/python3
"""Dynamic batching: requests merged into one engine call get the answers
they get alone.

Two servers serve a copy of the demo model (nn.MultiheadAttention(256, 4)):
one with `dynamic_batching { max_queue_delay_us: 20000 }`, so that a burst
of concurrent requests reliably forms batches even on two cores, and one
started with --disable_batching. Both get the same burst of concurrent
requests (B = 1 or unbatched, L and S in [16, 128], with and without
padding masks, attention weights, attention masks, cross-attention), sent as
gRPC futures on one channel. Checks:

* every batched answer equals the unbatched one to 1e-5;
* the unbatched answers match the float64 PyTorch reference of the parity
  battery (tests/parity/mha_reference.py) to 1e-5;
* /metrics: the batching server merged requests (mha_batch_requests has
  fewer batches than requests, and batches of more than one), the other ran
  every request alone.

  MHA_SERVER=build/mha_server /usr/bin/python3 tests/server/test_batching.py
"""

import os
import random
import shutil
import sys
import tempfile
import unittest

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "parity"))
from mha_model_io import read_safetensors, tensors_to_params  # noqa: E402
from mha_reference import reference_mha  # noqa: E402
from mha_test_server import (MHA_SERVER, REPO_ROOT, TestServer, load_stubs,  # noqa: E402
                             metric_value, tensor, to_numpy)

DEMO_DIR = os.path.join(REPO_ROOT, "models", "demo")
MODEL = "demo"
EMBED_DIM, NUM_HEADS = 256, 4
CONFIG = f"""embed_dim: {EMBED_DIM}
num_heads: {NUM_HEADS}
dynamic_batching {{
  max_queue_delay_us: 20000
}}
"""
NUM_REQUESTS = 64
MIN_LEN, MAX_LEN = 16, 128
TOL = 1e-5
RPC_TIMEOUT_S = 60

# Request kinds, by request index % 16. Kinds that differ only in
# key_padding_mask or in the rank of the query share a batch signature, so
# their merged batches mix requests with and without padding masks (bool and
# float) and with 2-D and 3-D queries.
KINDS = [
    dict(unbatched=True),                          # 0
    dict(kpm="bool"),                              # 1
    dict(weights="avg", unbatched=True),           # 2
    dict(weights="avg", kpm="float"),              # 3
    dict(weights="head", kpm="bool"),              # 4
    dict(cross=True, kpm="bool"),                  # 5  key and value
    dict(key_only=True),                           # 6  value = key
    dict(attn_mask="2d-float", causal=True),       # 7
    dict(),                                        # 8
    dict(kpm="float"),                             # 9
    dict(weights="avg"),                           # 10
    dict(weights="avg", kpm="bool"),               # 11
    dict(weights="head"),                          # 12
    dict(cross=True),                              # 13
    dict(key_only=True, kpm="float"),              # 14
    dict(attn_mask="3d-bool", weights="head"),     # 15
]


def make_requests(seed):
    """NUM_REQUESTS (description, kind, numpy inputs) triples."""
    r = random.Random(seed)
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(NUM_REQUESTS):
        kind = KINDS[i % len(KINDS)]
        L = r.randint(MIN_LEN, MAX_LEN)
        S = r.randint(MIN_LEN, MAX_LEN) if kind.get("cross") or \
            kind.get("key_only") else L
        lead = () if kind.get("unbatched") else (1,)

        def randn(*shape):
            return (rng.standard_normal(shape) * 0.5).astype(np.float32)

        inputs = {"query": randn(*lead, L, EMBED_DIM)}
        if kind.get("cross") or kind.get("key_only"):
            inputs["key"] = randn(*lead, S, EMBED_DIM)
        if kind.get("cross"):
            inputs["value"] = randn(*lead, S, EMBED_DIM)
        if kind.get("kpm"):
            inputs["key_padding_mask"] = _mask(kind["kpm"], (*lead, S), rng)
        if kind.get("attn_mask"):
            dims, kind_of_mask = kind["attn_mask"].split("-")
            shape = (L, S) if dims == "2d" else (NUM_HEADS, L, S)
            inputs["attn_mask"] = _mask(kind_of_mask, shape, rng)
        description = f"request {i} (kind {i % len(KINDS)}: {kind}, L={L}, S={S})"
        requests.append((description, kind, inputs))
    return requests


def _mask(kind, shape, rng):
    """bool: ~25% True (masked); float: N(0, 1) with ~10% -inf."""
    u = rng.random(shape)
    if kind == "bool":
        return u < 0.25
    values = rng.standard_normal(shape).astype(np.float32)
    values[u < 0.1] = -np.inf
    return values


def attend_request(pb, config_pb, kind, inputs):
    request = pb.AttendRequest(model=MODEL, is_causal=kind.get("causal", False),
                               need_weights="weights" in kind,
                               per_head_weights=kind.get("weights") == "head")
    for field, array in inputs.items():
        getattr(request, field).CopyFrom(tensor(pb, config_pb, array))
    return request


def send_burst(server, pb, config_pb, requests):
    """Sends every request at once (futures on one channel); returns, per
    request, (response or None, error string or None)."""
    channel = server.channel()
    try:
        stub = server.stub(channel)
        futures = [stub.Attend.future(attend_request(pb, config_pb, kind, inputs),
                                      timeout=RPC_TIMEOUT_S)
                   for _, kind, inputs in requests]
        answers = []
        for future in futures:
            try:
                answers.append((future.result(), None))
            except Exception as e:  # grpc.RpcError, grpc.FutureTimeoutError
                code = getattr(e, "code", lambda: None)()
                details = getattr(e, "details", lambda: repr(e))()
                answers.append((None, f"{getattr(code, 'name', code)}: {details}"))
        return answers
    finally:
        channel.close()


def demo_params():
    tensors, _ = read_safetensors(os.path.join(DEMO_DIR, "weights.safetensors"))
    return tensors_to_params(tensors, "in_proj", NUM_HEADS)


def reference(params, kind, inputs):
    """(output, weights or None) from the float64 parity reference."""
    t = {k: torch.from_numpy(v) for k, v in inputs.items()}
    out, probs = reference_mha(params, NUM_HEADS, t["query"], t.get("key"),
                               t.get("value"), t.get("key_padding_mask"),
                               t.get("attn_mask"), kind.get("causal", False))
    weights = {"avg": probs.mean(dim=-3), "head": probs}.get(kind.get("weights"))
    return out.numpy(), None if weights is None else weights.numpy()


def max_abs_diff(a, b):
    if a.shape != b.shape:
        return np.inf
    if a.size == 0:
        return 0.0
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return np.inf if np.isnan(diff).any() else float(diff.max())


def batch_histogram(metrics_text):
    """(batches, requests computed, batches of one request) of the model."""
    return (metric_value(metrics_text, "mha_batch_requests_count", model=MODEL),
            metric_value(metrics_text, "mha_batch_requests_sum", model=MODEL),
            metric_value(metrics_text, "mha_batch_requests_bucket", model=MODEL,
                         le="1"))


class BatchingTest(unittest.TestCase):
    """One burst to each server in setUpClass; the tests check the answers
    and the metrics."""

    @classmethod
    def setUpClass(cls):
        cls.pb, _, cls.config_pb = load_stubs()
        repository = tempfile.mkdtemp(prefix="mha_batching_repo_")
        cls.addClassCleanup(shutil.rmtree, repository, ignore_errors=True)
        model_dir = os.path.join(repository, MODEL)
        os.makedirs(model_dir)
        shutil.copy(os.path.join(DEMO_DIR, "weights.safetensors"), model_dir)
        with open(os.path.join(model_dir, "config.pbtxt"), "w") as f:
            f.write(CONFIG)

        cls.requests = make_requests(seed=1)
        cls.batched_server = cls._start(TestServer(MHA_SERVER, repository))
        cls.unbatched_server = cls._start(
            TestServer(MHA_SERVER, repository, ["--disable_batching"]))
        cls.batched = send_burst(cls.batched_server, cls.pb, cls.config_pb,
                                 cls.requests)
        cls.unbatched = send_burst(cls.unbatched_server, cls.pb, cls.config_pb,
                                   cls.requests)
        cls.batched_metrics = cls.batched_server.metrics()
        cls.unbatched_metrics = cls.unbatched_server.metrics()

    @classmethod
    def _start(cls, server):
        cls.addClassCleanup(cls._stop, server)
        server.start()
        return server

    @staticmethod
    def _stop(server):
        if server.process is None:
            return
        code = server.stop()
        if code != 0:
            raise AssertionError(
                f"mha_server {server.extra_flags} exited with code {code} "
                f"after SIGTERM; stderr:\n{server.stderr()[-2000:]}")

    def _check_answer(self, description, kind, inputs, response, error):
        """Problems with one response: status, model, dtypes and shapes."""
        if error is not None:
            return [f"{description}: {error}"]
        problems = []
        query = inputs["query"]
        S = inputs["key"].shape[-2] if "key" in inputs else query.shape[-2]
        expected_weights = {
            "avg": (*query.shape[:-1], S),
            "head": (*query.shape[:-2], NUM_HEADS, query.shape[-2], S),
        }.get(kind.get("weights"))
        if response.model != MODEL:
            problems.append(f"model {response.model!r}")
        if response.output.dtype != self.config_pb.DATA_TYPE_FP32 or \
                tuple(response.output.shape) != query.shape:
            problems.append(f"output dtype {response.output.dtype} shape "
                            f"{list(response.output.shape)}, expected FP32 "
                            f"{list(query.shape)}")
        if expected_weights is None and response.HasField("attn_weights"):
            problems.append("attn_weights sent but not asked for")
        if expected_weights is not None and (
                response.attn_weights.dtype != self.config_pb.DATA_TYPE_FP32 or
                tuple(response.attn_weights.shape) != expected_weights):
            problems.append(f"attn_weights dtype {response.attn_weights.dtype}"
                            f" shape {list(response.attn_weights.shape)}, "
                            f"expected FP32 {list(expected_weights)}")
        return [f"{description}: {p}" for p in problems]

    def _answers_problems(self, answers):
        problems = []
        for (description, kind, inputs), (response, error) in zip(self.requests,
                                                                  answers):
            problems += self._check_answer(description, kind, inputs, response,
                                           error)
        return problems

    def test_every_batched_request_succeeds(self):
        problems = self._answers_problems(self.batched)
        self.assertEqual(problems, [], "\n".join(problems))

    def test_every_unbatched_request_succeeds(self):
        problems = self._answers_problems(self.unbatched)
        self.assertEqual(problems, [], "\n".join(problems))

    def test_batched_answers_equal_unbatched_answers(self):
        problems = []
        for (description, kind, _), (batched, _), (alone, _) in zip(
                self.requests, self.batched, self.unbatched):
            if batched is None or alone is None:
                continue  # reported by the *_succeeds tests
            fields = ["output"] + (["attn_weights"] if "weights" in kind else [])
            for field in fields:
                err = max_abs_diff(to_numpy(getattr(batched, field)),
                                   to_numpy(getattr(alone, field)))
                if not err <= TOL:
                    problems.append(f"{description}: {field} differs from the "
                                    f"unbatched answer by {err:.3g}")
        self.assertEqual(problems, [], "\n".join(problems))

    def test_unbatched_answers_match_pytorch_reference(self):
        params = demo_params()
        problems = []
        for (description, kind, inputs), (alone, _) in zip(self.requests,
                                                          self.unbatched):
            if alone is None:
                continue
            out, weights = reference(params, kind, inputs)
            checks = [("output", to_numpy(alone.output), out)]
            if weights is not None:
                checks.append(("attn_weights", to_numpy(alone.attn_weights),
                               weights))
            for field, got, want in checks:
                err = max_abs_diff(got, want)
                if not err <= TOL:
                    problems.append(f"{description}: {field} differs from the "
                                    f"reference by {err:.3g}")
        self.assertEqual(problems, [], "\n".join(problems))

    def test_empty_batch_answer_does_not_depend_on_batching(self):
        """Batch size 0: the same status alone as merged with others.

        Refusing such a query and answering it with an empty output are
        both fine; the answer must not depend on the batch it landed in."""
        empty = ("batch size 0", {}, {"query": np.zeros((0, 8, EMBED_DIM),
                                                        np.float32)})
        partner = ("partner", {}, {"query": np.full((1, 8, EMBED_DIM), 0.5,
                                                    np.float32)})

        def outcome(answer):
            response, error = answer
            if error is not None:
                return error.split(":")[0], error
            return "OK", f"output shape {list(response.output.shape)}"

        merged = send_burst(self.batched_server, self.pb, self.config_pb,
                            [partner, empty, partner])
        alone = send_burst(self.unbatched_server, self.pb, self.config_pb,
                           [empty])
        self.assertEqual(outcome(merged[1])[0], outcome(alone[0])[0],
                         f"merged with others: {outcome(merged[1])[1]}; "
                         f"alone: {outcome(alone[0])[1]}")

    def test_batching_server_merges_requests(self):
        batches, computed, singles = batch_histogram(self.batched_metrics)
        self.assertEqual(computed, NUM_REQUESTS, self.batched_metrics)
        self.assertEqual(metric_value(self.batched_metrics, "mha_requests_total",
                                      model=MODEL, code="OK"), NUM_REQUESTS)
        self.assertLess(batches, NUM_REQUESTS,
                        "no request shared an engine call")
        self.assertLess(singles, batches, "every batch held one request")

    def test_disable_batching_runs_requests_alone(self):
        batches, computed, singles = batch_histogram(self.unbatched_metrics)
        self.assertEqual(computed, NUM_REQUESTS, self.unbatched_metrics)
        self.assertEqual(batches, NUM_REQUESTS)
        self.assertEqual(singles, NUM_REQUESTS)


if __name__ == "__main__":
    unittest.main(verbosity=2)
