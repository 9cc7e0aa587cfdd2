#!/usr/bin/python3
"""Model versions and live model control against a real mha_server:

* version folders and version_policy (latest, all, specific, a flat folder
  as version 1); requests naming a version; responses saying which version
  computed them, each matched against that version's weights (<= 1e-5);
* reloads under load: 32 clients call without pause while a new version is
  moved into the repository (poll mode) and loaded with LoadModel
  (explicit mode), and while a version's bytes are replaced: no request
  fails, and every answer matches the weights of the version it names;
* a corrupt version keeps the old one serving, reports its error and counts
  mha_model_load_failures_total; health stays SERVING;
* UnloadModel under load finishes what is in flight, then NOT_FOUND naming
  what is served; the memory comes back; mode none refuses model control.

  MHA_SERVER=build/mha_server /usr/bin/python3 tests/server/test_lifecycle.py
"""

import os
import shutil
import subprocess
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
from mha_test_server import (ASAN, MHA_SERVER, REPO_ROOT, TestServer, load_grpc_stubs,  # noqa: E402
                             load_stubs, metric_sample, metric_value, random_layer, rss_bytes,
                             tensor, to_numpy, wait_for)
from mha_export import export  # noqa: E402
import mha_client  # noqa: E402

E, HEADS, LEN = 32, 4, 6
FP32_TOL = 1e-5
CLIENTS = 32

pb, rpc, cfg = load_stubs()
health_pb2, health_pb2_grpc, _, _ = load_grpc_stubs()


def layer(seed, embed_dim=E):
    return random_layer(seed, embed_dim, HEADS)


def write_version(model_dir, version, module, config_extra=""):
    """model_dir/config.pbtxt and model_dir/<version>/weights.safetensors,
    the folder written beside and moved in at once (as a user should)."""
    staging = tempfile.mkdtemp(dir=os.path.dirname(model_dir))
    export(module, staging)
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(staging, "config.pbtxt")) as f:
        config = f.read() + config_extra
    with open(os.path.join(model_dir, "config.pbtxt"), "w") as f:
        f.write(config)
    version_dir = os.path.join(staging, str(version))
    os.makedirs(version_dir)
    os.rename(os.path.join(staging, "weights.safetensors"),
              os.path.join(version_dir, "weights.safetensors"))
    target = os.path.join(model_dir, str(version))
    if os.path.exists(target):  # replace the bytes of a served version
        os.rename(os.path.join(version_dir, "weights.safetensors"),
                  os.path.join(target, "weights.safetensors"))
    else:
        os.rename(version_dir, target)
    shutil.rmtree(staging)


QUERIES = [np.random.default_rng(i).standard_normal((1, LEN, E)).astype(np.float32)
           for i in range(4)]


def expected(module, q):
    with torch.inference_mode():
        x = torch.from_numpy(q)
        return module(x, x, x, need_weights=False)[0].numpy()


class Load:
    """CLIENTS threads calling Attend without pause until stop(); every
    answer is checked against the modules the version it names may hold
    (`modules`: version -> list; a version whose bytes are replaced has
    two)."""

    def __init__(self, stub, model, modules):
        self.stub, self.model, self.modules = stub, model, modules
        self.answers = {}  # version -> count
        self.errors, self.mismatches = [], []
        self.lock = threading.Lock()
        self.running = True
        self.threads = [threading.Thread(target=self.run, args=(i,)) for i in range(CLIENTS)]
        for t in self.threads:
            t.start()

    def run(self, i):
        n = 0
        while self.running:
            q = QUERIES[(i + n) % len(QUERIES)]
            n += 1
            try:
                r = self.stub.Attend(pb.AttendRequest(model=self.model, query=tensor(pb, cfg, q)),
                                     timeout=30)
            except grpc.RpcError as e:
                with self.lock:
                    self.errors.append(f"{e.code()}: {e.details()}")
                continue
            err = min((np.abs(to_numpy(r.output) - expected(m, q)).max()
                       for m in self.modules.get(r.model_version, [])), default=float("inf"))
            with self.lock:
                self.answers[r.model_version] = self.answers.get(r.model_version, 0) + 1
                if err > FP32_TOL:
                    self.mismatches.append((r.model_version, err))

    def seen(self, version):
        with self.lock:
            return self.answers.get(version, 0)

    def stop(self):
        self.running = False
        for t in self.threads:
            t.join()


class LifecycleTest(unittest.TestCase):
    def setUp(self):
        self.repo = tempfile.mkdtemp(prefix="mha_lifecycle_")

    def tearDown(self):
        shutil.rmtree(self.repo, ignore_errors=True)

    def server(self, *flags):
        return TestServer(MHA_SERVER, self.repo, list(flags))

    def health(self, server, service=""):
        stub = health_pb2_grpc.HealthStub(server.channel())
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status

    def attend(self, stub, model, q, version=0):
        return stub.Attend(pb.AttendRequest(model=model, query=tensor(pb, cfg, q),
                                            model_version=version), timeout=30)

    def assert_version_answers(self, stub, model, module, version, ask=0):
        r = self.attend(stub, model, QUERIES[0], ask)
        self.assertEqual(r.model_version, version)
        self.assertLess(np.abs(to_numpy(r.output) - expected(module, QUERIES[0])).max(), FP32_TOL)

    def test_version_policies_and_named_versions(self):
        mods = {v: layer(v) for v in (1, 2, 3)}
        for v in (1, 2, 3):
            write_version(os.path.join(self.repo, "latest"), v, mods[v])
            write_version(os.path.join(self.repo, "every"), v, mods[v],
                          "version_policy { all {} }\n")
            write_version(os.path.join(self.repo, "two"), v, mods[v],
                          "version_policy { latest { num_versions: 2 } }\n")
        write_version(os.path.join(self.repo, "chosen"), 1, mods[1],
                      "version_policy { specific { versions: [1, 4] } }\n")
        export(mods[2], os.path.join(self.repo, "flat"))  # weights beside the config
        with self.server() as s:
            stub = s.stub()
            self.assert_version_answers(stub, "latest", mods[3], 3)
            with self.assertRaises(grpc.RpcError) as e:
                self.attend(stub, "latest", QUERIES[0], version=1)
            self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
            self.assertIn("no ready version 1; it serves version(s) 3", e.exception.details())
            for v in (1, 2, 3):
                self.assert_version_answers(stub, "every", mods[v], v, ask=v)
            self.assert_version_answers(stub, "every", mods[3], 3)
            info = stub.GetModel(pb.GetModelRequest(name="two"))
            self.assertEqual([v.version for v in info.versions], [3, 2])
            self.assertTrue(all(v.state == pb.ModelInfo.STATE_READY for v in info.versions))
            self.assert_version_answers(stub, "two", mods[2], 2, ask=2)
            info = stub.GetModel(pb.GetModelRequest(name="chosen"))
            self.assertEqual(info.state, pb.ModelInfo.STATE_READY)
            states = {v.version: (v.state, v.error) for v in info.versions}
            self.assertEqual(states[1][0], pb.ModelInfo.STATE_READY)
            self.assertEqual(states[4][0], pb.ModelInfo.STATE_FAILED)
            self.assertIn("does not exist", states[4][1])
            self.assert_version_answers(stub, "flat", mods[2], 1)

    def test_reload_under_load_in_poll_mode(self):
        model_dir = os.path.join(self.repo, "m")
        mods = {1: layer(11), 2: layer(12)}
        write_version(model_dir, 1, mods[1])
        with self.server("--model_control_mode=poll", "--repository_poll_s=1") as s:
            load = Load(s.stub(), "m", {v: [m] for v, m in mods.items()})
            try:
                wait_for(lambda: load.seen(1) > 50, what="answers of version 1")
                write_version(model_dir, 2, mods[2])
                wait_for(lambda: load.seen(2) > 50, what="answers of version 2")
                self.assertEqual(self.health(s, "m"), health_pb2.HealthCheckResponse.SERVING)
            finally:
                load.stop()
            self.assertEqual(load.errors, [])
            self.assertEqual(load.mismatches, [])
            # latest { num_versions: 1 }: version 1 is gone once 2 serves,
            # and so are its series once its requests are done.
            info = s.stub().GetModel(pb.GetModelRequest(name="m"))
            self.assertEqual([v.version for v in info.versions], [2])
            self.assertGreater(metric_value(s.metrics(), "mha_requests_total", model="m",
                                            version="2", code="OK"), 50)
            wait_for(lambda: not series(s.metrics(), "m", "1"),
                     what="version 1's series to be removed")
            # A removed folder is unloaded at the next poll.
            shutil.rmtree(model_dir)
            wait_for(lambda: not any(m.name == "m" for m in
                                     s.stub().ListModels(pb.ListModelsRequest()).models),
                     what="the removed model to be unloaded")
            self.assertEqual(self.health(s, "m"), health_pb2.HealthCheckResponse.NOT_SERVING)

    def test_reload_under_load_in_explicit_mode(self):
        model_dir = os.path.join(self.repo, "m")
        mods = {1: layer(21), 2: layer(22)}
        replaced = layer(23)  # version 2's second bytes
        write_version(model_dir, 1, mods[1])
        write_version(os.path.join(self.repo, "other"), 1, layer(5))
        with self.server("--model_control_mode=explicit", "--load_model=m") as s:
            stub = s.stub()
            names = [m.name for m in stub.ListModels(pb.ListModelsRequest()).models]
            self.assertEqual(names, ["m"])  # only what --load_model names
            load = Load(s.stub(), "m", {1: [mods[1]], 2: [mods[2], replaced]})
            try:
                wait_for(lambda: load.seen(1) > 50, what="answers of version 1")
                write_version(model_dir, 2, mods[2])
                time.sleep(0.5)
                self.assertEqual(load.seen(2), 0)  # nothing changes without LoadModel
                info = stub.LoadModel(pb.LoadModelRequest(name="m"), timeout=60)
                self.assertEqual([v.version for v in info.versions], [2])
                seen = load.seen(2)
                wait_for(lambda: load.seen(2) > seen + 50, what="answers of version 2")
                # The same version with other bytes: reloaded, never stale.
                write_version(model_dir, 2, replaced)
                stub.LoadModel(pb.LoadModelRequest(name="m"), timeout=60)
                self.assert_version_answers(stub, "m", replaced, 2)
            finally:
                load.stop()
            self.assertEqual(load.errors, [])
            self.assertEqual(load.mismatches, [])
            self.assertEqual(self.health(s, "m"), health_pb2.HealthCheckResponse.SERVING)

    def test_corrupt_version_keeps_the_old_one_serving(self):
        model_dir = os.path.join(self.repo, "m")
        mods = {1: layer(31)}
        write_version(model_dir, 1, mods[1])
        with self.server("--model_control_mode=explicit", "--load_model=m") as s:
            stub = s.stub()
            os.makedirs(os.path.join(model_dir, "2"))
            with open(os.path.join(model_dir, "1", "weights.safetensors"), "rb") as f:
                good = f.read()
            with open(os.path.join(model_dir, "2", "weights.safetensors"), "wb") as f:
                f.write(good[:len(good) // 2])  # truncated
            with self.assertRaises(grpc.RpcError) as e:
                stub.LoadModel(pb.LoadModelRequest(name="m"), timeout=60)
            self.assertIn("version 2 failed to load", e.exception.details())
            self.assert_version_answers(stub, "m", mods[1], 1)
            info = stub.GetModel(pb.GetModelRequest(name="m"))
            self.assertEqual(info.state, pb.ModelInfo.STATE_READY)
            states = {v.version: v for v in info.versions}
            self.assertEqual(states[2].state, pb.ModelInfo.STATE_FAILED)
            self.assertIn("weights.safetensors", states[2].error)
            self.assertEqual(states[1].state, pb.ModelInfo.STATE_READY)
            self.assertEqual(metric_value(s.metrics(), "mha_model_load_failures_total",
                                          model="m"), 1.0)
            self.assertEqual(self.health(s, "m"), health_pb2.HealthCheckResponse.SERVING)

    def test_unload_under_load_finishes_in_flight_and_frees_memory(self):
        big = layer(41, embed_dim=1024)  # 16 MiB of weights, packed once (16 MiB resident)
        write_version(os.path.join(self.repo, "big"), 1, big)
        write_version(os.path.join(self.repo, "small"), 1, layer(42))
        with self.server("--model_control_mode=explicit", "--load_model=small") as s:
            stub = s.stub()
            reserve = lambda: metric_sample(s.metrics(), "mha_memory_engine_reserve_bytes")
            rss_without, reserve_without = rss_bytes(s.process.pid), reserve()
            stub.LoadModel(pb.LoadModelRequest(name="big"), timeout=60)
            rss_with, reserve_with = rss_bytes(s.process.pid), reserve()
            self.assertGreater(rss_with - rss_without, 12 << 20)
            # The reserve follows the models: big's packed weights (in_proj
            # and out_proj; the layers of cross calls read in_proj in place
            # on machines whose packed format allows it) come in.
            self.assertGreaterEqual(reserve_with - reserve_without, 16 << 20)
            load = Load(s.stub(), "small", {1: [layer(42)]})
            try:
                wait_for(lambda: load.seen(1) > 20, what="answers")
                stub.UnloadModel(pb.UnloadModelRequest(name="small"), timeout=60)
                time.sleep(0.3)
            finally:
                load.stop()
            self.assertEqual(load.mismatches, [])
            self.assertGreater(load.seen(1), 20)
            # After the unload: NOT_FOUND naming what is served, nothing else.
            self.assertTrue(load.errors)
            for e in load.errors:
                self.assertIn("NOT_FOUND", e)
                self.assertIn("this server has: big", e)
            stub.UnloadModel(pb.UnloadModelRequest(name="big"), timeout=60)
            # AddressSanitizer's allocator keeps what is freed (quarantine, its
            # own caches; RSS stayed up even with quarantine_size_mb=0): this
            # runs on the plain build only, as in test_memory.py.
            if not ASAN:
                wait_for(lambda: rss_bytes(s.process.pid) < rss_without + (rss_with - rss_without) / 2,
                         what="the unloaded model's memory to come back")
            # The version is freed (and its series leave) by the control thread
            # once it has drained, just after UnloadModel answers: under ASan,
            # where the RSS wait above is skipped, a scrape can come first.
            wait_for(lambda: series(s.metrics(), "big", "1") == [],
                     what="big version 1's series to leave /metrics")
            text = s.metrics()
            # ... and goes with them (small was unloaded too).
            self.assertLess(metric_sample(text, "mha_memory_engine_reserve_bytes"),
                            reserve_without)
            self.assertEqual(metric_value(text, "mha_model_loaded", model="big"), 0)
            self.assertEqual(series(text, "big", "1"), [])
            with self.assertRaises(grpc.RpcError) as e:
                stub.UnloadModel(pb.UnloadModelRequest(name="big"), timeout=60)
            self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)

    def test_client_cli_loads_and_unloads(self):
        client = os.environ.get("MHA_CLIENT", os.path.join(REPO_ROOT, "build", "mha_client"))
        model_dir = os.path.join(self.repo, "m")
        write_version(model_dir, 1, layer(71))
        os.makedirs(os.path.join(self.repo, ".staging"))  # hidden: never a model
        with self.server("--model_control_mode=explicit") as s:
            run = lambda *args: subprocess.run(  # noqa: E731
                [client, *args, f"--target={s.target()}"], capture_output=True, text=True)
            r = run("load_model", "m")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(r.stdout.strip(), "m version 1: READY")
            r = run("models")
            self.assertRegex(r.stdout, r"m\s+READY\s+E=32 h=4 .* versions=1")
            r = run("attend", "--model=m", "--len=4", "--model_version=1")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("model m version 1:", r.stdout)
            r = run("load_model", ".staging")
            self.assertNotEqual(r.returncode, 0)
            # Loaded here: test_model_control_api imports this module beside its
            # own rendition of Triton's messages, of the same package.
            kpb, krpc = mha_client.load_kserve_stubs()
            kserve = krpc.GRPCInferenceServiceStub(s.channel())
            model_ready = lambda: kserve.ModelReady(  # noqa: E731
                kpb.ModelReadyRequest(name="m"), timeout=30).ready
            self.assertTrue(model_ready())
            r = run("unload_model", "m")
            self.assertEqual((r.returncode, r.stdout.strip()), (0, "m: unloaded"))
            self.assertFalse(model_ready(), "an unloaded model is not ready, as in Triton")
            r = run("attend", "--model=m", "--len=4")
            self.assertNotEqual(r.returncode, 0)
            self.assertIn("NOT_FOUND", r.stderr)

    def test_mode_none_refuses_model_control(self):
        write_version(os.path.join(self.repo, "m"), 1, layer(51))
        with self.server() as s:
            with self.assertRaises(grpc.RpcError) as e:
                s.stub().LoadModel(pb.LoadModelRequest(name="m"), timeout=30)
            self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("--model_control_mode", e.exception.details())

    def test_model_control_needs_the_token(self):
        write_version(os.path.join(self.repo, "m"), 1, layer(61))
        token_file = os.path.join(self.repo, "token")
        with open(token_file, "w") as f:
            f.write("s3cret\n")
        with self.server("--model_control_mode=explicit", f"--auth_token_file={token_file}") as s:
            stub = s.stub()
            with self.assertRaises(grpc.RpcError) as e:
                stub.LoadModel(pb.LoadModelRequest(name="m"), timeout=30)
            self.assertEqual(e.exception.code(), grpc.StatusCode.UNAUTHENTICATED)
            info = stub.LoadModel(pb.LoadModelRequest(name="m"), timeout=60,
                                  metadata=[("authorization", "Bearer s3cret")])
            self.assertEqual(info.state, pb.ModelInfo.STATE_READY)


def series(metrics_text, model, version):
    """The lines of /metrics of that model version."""
    return [line for line in metrics_text.splitlines()
            if f'model="{model}"' in line and f'version="{version}"' in line]


if __name__ == "__main__":
    unittest.main(verbosity=2)
