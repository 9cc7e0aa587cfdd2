#!/usr/bin/python3
"""A thousand models in one server (issue 31), against a real mha_server:

* 1000 models of nn.MultiheadAttention(64, 4), each with its own weights,
  in one repository: the server starts at default flags (memory limit and
  session cache included), every model answers its own numbers (PyTorch,
  1e-5), and the process's threads stay few (a worker pool per server, not
  a worker and an OpenMP team per model);
* on the plain build, RSS stays within 200 MB + 1.5 x the weights;
* a model is loaded and another unloaded while clients call the rest: no
  request to a served model fails, and the threads do not grow.

  MHA_SERVER=build/mha_server /usr/bin/python3 tests/server/test_many_models.py
"""

import concurrent.futures
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import unittest

import grpc
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mha_test_server import (ASAN, MHA_SERVER, TestServer, load_stubs, random_layer,  # noqa: E402
                             rss_bytes, tensor, to_numpy)
from mha_export import export  # noqa: E402

MODELS = 1000
E, HEADS, LEN = 64, 4, 5
FP32_TOL = 1e-5
MAX_THREADS = 32
WEIGHT_BYTES = 4 * (4 * E * E + 4 * E)  # in_proj and out_proj, weights and biases

pb, rpc, cfg = load_stubs()


def name_of(i):
    return f"m{i:04d}"


def layer(seed):
    return random_layer(seed, E, HEADS)


def expected(module, q):
    with torch.inference_mode():
        x = torch.from_numpy(q)
        return module(x, x, x, need_weights=False)[0].numpy()


def threads_of(pid):
    return len(os.listdir(f"/proc/{pid}/task"))


class ManyModelsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.repo = tempfile.mkdtemp(prefix="mha_many_models_")
        cls.modules = [layer(1000 + i) for i in range(MODELS)]
        for i, m in enumerate(cls.modules):
            export(m, os.path.join(cls.repo, name_of(i)))

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.repo, ignore_errors=True)

    def check(self, stub, i, seed):
        q = np.random.default_rng(seed).standard_normal((1, LEN, E)).astype(np.float32)
        r = stub.Attend(pb.AttendRequest(model=name_of(i), query=tensor(pb, cfg, q)), timeout=60)
        return float(np.abs(to_numpy(r.output) - expected(self.modules[i], q)).max())

    def test_a_thousand_models_share_the_workers_and_answer_right(self):
        # The last model is loaded later, under load; the first unloaded.
        at_start = [name_of(i) for i in range(MODELS - 1)]
        started = time.monotonic()
        with TestServer(MHA_SERVER, self.repo,
                        ["--model_control_mode=explicit", "--load_model=" + ",".join(at_start)],
                        ready_timeout=600) as s:
            print(f"{MODELS - 1} models: ready in {time.monotonic() - started:.1f} s, "
                  f"{threads_of(s.process.pid)} threads, RSS {rss_bytes(s.process.pid) >> 20} MiB",
                  flush=True)
            stub = s.stub()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                errors = list(pool.map(lambda i: self.check(stub, i, i), range(MODELS - 1)))
            worst = int(np.argmax(errors))
            self.assertLessEqual(errors[worst], FP32_TOL, f"model {name_of(worst)}")
            threads = threads_of(s.process.pid)
            self.assertLessEqual(threads, MAX_THREADS)
            # ASan's allocator keeps what is freed: the RSS bound is checked on
            # the plain build only (as in test_memory.py and test_lifecycle.py).
            if not ASAN:
                limit = (200 << 20) + 1.5 * MODELS * WEIGHT_BYTES
                self.assertLessEqual(rss_bytes(s.process.pid), limit)
            self.load_and_unload_while_others_serve(s, stub)
            self.assertLessEqual(threads_of(s.process.pid), MAX_THREADS)

    def load_and_unload_while_others_serve(self, s, stub):
        failures, answered = [], [0]
        lock = threading.Lock()
        running = True

        def client(k):
            rng = random.Random(k)
            while running:
                i = rng.randrange(1, MODELS - 1)  # neither the loaded nor the unloaded one
                try:
                    err = self.check(stub, i, rng.randrange(1 << 30))
                except grpc.RpcError as e:
                    with lock:
                        failures.append(f"{name_of(i)}: {e.code()}: {e.details()}")
                    continue
                with lock:
                    answered[0] += 1
                    if err > FP32_TOL:
                        failures.append(f"{name_of(i)}: off by {err}")

        clients = [threading.Thread(target=client, args=(k,)) for k in range(8)]
        for t in clients:
            t.start()
        try:
            time.sleep(0.5)
            last = MODELS - 1
            stub.LoadModel(pb.LoadModelRequest(name=name_of(last)), timeout=120)
            self.assertLessEqual(self.check(stub, last, 7), FP32_TOL)
            stub.UnloadModel(pb.UnloadModelRequest(name=name_of(0)), timeout=120)
            with self.assertRaises(grpc.RpcError) as e:
                self.check(stub, 0, 8)
            self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
            time.sleep(0.5)
        finally:
            running = False
            for t in clients:
                t.join()
        self.assertEqual(failures, [])
        self.assertGreater(answered[0], 20)


if __name__ == "__main__":
    unittest.main(verbosity=2)
