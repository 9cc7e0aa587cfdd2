#!/usr/bin/python3
"""The Python client as a package (issue 20): installed outside the source
tree, and its options for servers that are away.

- `pip install --no-deps --no-build-isolation --no-index --target DIR` of a
  copy of client/python + proto/ (nothing else of the repository) works
  offline; a script run elsewhere with only DIR on PYTHONPATH uses the
  installed stubs and gets the demo model's answer, checked against
  PyTorch; the `mha_export` entry point runs.
- mha_client.py copied alone (no stubs, no protos) says how to install it.
- retries: a call answered UNAVAILABLE is sent again `retries` times (a
  request above gRPC's default 256 KiB retry buffer too); other codes are
  not retried.
- wait_for_ready: a call made before the server is up waits for it; without
  it the call fails at once with UNAVAILABLE.

The fake server is an in-process grpc.server whose Attend fails a given
number of times before answering, so attempts can be counted.

  MHA_SERVER=build/mha_server /usr/bin/python3 tests/client/test_python_package.py
"""

import concurrent.futures
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "server"))  # the shared harness
sys.path.insert(0, os.path.join(HERE, "..", "parity"))
from mha_test_server import REPO_ROOT, TestServer, load_stubs  # noqa: E402
from mha_local_server import free_port  # noqa: E402
from test_server import DEMO_E, MHA_SERVER, make_repository, reference  # noqa: E402
from mha_client import MhaClient  # noqa: E402

pb, rpc, cfg = load_stubs()
TOL = 1e-5

# Run by the installed package, outside the tree: prints where mha_client and
# its stubs came from, and writes the demo model's output for query.npy.
INSTALLED_SCRIPT = """
import sys
import numpy as np
import mha_client
from mha_client import MhaClient
with MhaClient(sys.argv[1], wait_for_ready=True, retries=2) as client:
    output, _ = client.attend("demo", np.load("query.npy"))
import mha.v1.attention_pb2 as stubs  # importable once a client made (on sys.path)
np.save("output.npy", output)
print(mha_client.__file__)
print(stubs.__file__)
"""


class FlakyAttention(rpc.AttentionServiceServicer):
    """Attend fails `failures` times with `code`, then echoes the query as
    the output. Counts every attempt."""

    def __init__(self, failures, code=grpc.StatusCode.UNAVAILABLE):
        self.failures, self.code, self.attempts = failures, code, 0
        self.lock = threading.Lock()

    def Attend(self, request, context):
        with self.lock:
            self.attempts += 1
            failing = self.attempts <= self.failures
        if failing:
            context.abort(self.code, f"attempt {self.attempts} refused")
        return pb.AttendResponse(output=request.query)


def start_fake(servicer, port):
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4), options=[
        ("grpc.max_receive_message_length", 64 << 20)])
    rpc.add_AttentionServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


class InstalledPackageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="mha_package_")
        src = os.path.join(cls.tmp, "src")
        shutil.copytree(os.path.join(REPO_ROOT, "client", "python"),
                        os.path.join(src, "client", "python"),
                        ignore=shutil.ignore_patterns("gen", "build", "*.egg-info", "__pycache__"))
        shutil.copytree(os.path.join(REPO_ROOT, "proto"), os.path.join(src, "proto"))
        cls.site = os.path.join(cls.tmp, "site")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--root-user-action=ignore", "--no-deps",
                        "--no-build-isolation", "--no-index", "--target", cls.site,
                        os.path.join(src, "client", "python")], check=True)
        repo = os.path.join(cls.tmp, "models")
        os.makedirs(repo)
        cls.models = make_repository(repo, names=("demo",))
        cls.server = TestServer(MHA_SERVER, repo)
        cls.server.start()

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        cls.server.remove_log()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def run_outside(self, args, **kwargs):
        """Runs python3 in a fresh folder with only the installed package
        on PYTHONPATH."""
        work = tempfile.mkdtemp(dir=self.tmp)
        env = dict(os.environ, PYTHONPATH=self.site)
        return work, subprocess.run(args, cwd=work, env=env, capture_output=True, text=True,
                                    timeout=120, **kwargs)

    def test_installed_client_answers_as_pytorch_does(self):
        query = np.random.default_rng(3).standard_normal((2, 5, DEMO_E)).astype(np.float32)
        work = tempfile.mkdtemp(dir=self.tmp)
        np.save(os.path.join(work, "query.npy"), query)
        run = subprocess.run([sys.executable, "-c", INSTALLED_SCRIPT, self.server.target()],
                             cwd=work, env=dict(os.environ, PYTHONPATH=self.site),
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(run.returncode, 0, run.stderr)
        module_file, stub_file = run.stdout.split()
        self.assertEqual(module_file, os.path.join(self.site, "mha_client.py"))
        self.assertTrue(stub_file.startswith(os.path.join(self.site, "mha_client_stubs")),
                        stub_file)
        expected, _ = reference(self.models["demo"], query)
        output = np.load(os.path.join(work, "output.npy"))
        np.testing.assert_allclose(output, expected, atol=TOL, rtol=0)

    def test_export_entry_point_runs(self):
        _, run = self.run_outside([os.path.join(self.site, "bin", "mha_export"), "--help"])
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertIn("--module", run.stdout)

    def export_verify(self, path_dirs, env_server=None):
        """Runs the installed mha_export --verify (no --server) on a small
        layer with PATH = `path_dirs` + the system's, outside the tree."""
        work = tempfile.mkdtemp(dir=self.tmp)
        layer = os.path.join(work, "layer.pt")
        import torch
        torch.save(torch.nn.MultiheadAttention(32, 4, batch_first=True), layer)
        env = dict(os.environ, PYTHONPATH=self.site,
                   PATH=os.pathsep.join(path_dirs + ["/usr/bin", "/bin"]))
        env.pop("MHA_SERVER", None)
        if env_server:
            env["MHA_SERVER"] = env_server
        return subprocess.run([os.path.join(self.site, "bin", "mha_export"), "--module", layer,
                               "--out", os.path.join(work, "m"), "--verify"], cwd=work, env=env,
                              capture_output=True, text=True, timeout=300)

    def test_export_verify_finds_the_server_on_path_then_in_the_checkout(self):
        # On PATH: a wrapper that says it ran, then runs the real server.
        bin_dir = tempfile.mkdtemp(dir=self.tmp)
        ran = os.path.join(bin_dir, "ran")
        with open(os.path.join(bin_dir, "mha_server"), "w") as f:
            f.write(f'#!/bin/sh\ntouch "{ran}"\nexec "{os.path.abspath(MHA_SERVER)}" "$@"\n')
        os.chmod(os.path.join(bin_dir, "mha_server"), 0o755)
        run = self.export_verify([bin_dir])
        self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        self.assertTrue(os.path.exists(ran), "the mha_server on PATH served the check")
        # Not on PATH: the build of the checkout it was installed from.
        checkout_build = os.path.join(self.tmp, "src", "build")
        os.makedirs(checkout_build, exist_ok=True)
        os.symlink(os.path.abspath(MHA_SERVER), os.path.join(checkout_build, "mha_server"))
        try:
            run = self.export_verify([])
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
        finally:
            os.remove(os.path.join(checkout_build, "mha_server"))
        # Nowhere: exit 2, naming every place it looked and what to do.
        run = self.export_verify([])
        self.assertEqual(run.returncode, 2, run.stdout + run.stderr)
        self.assertIn(os.path.join(self.tmp, "src", "build", "mha_server"), run.stderr)
        self.assertIn("put it on PATH or pass --server PATH", run.stderr)

    def test_copied_module_without_stubs_says_how_to_install(self):
        lone = tempfile.mkdtemp(dir=self.tmp)
        shutil.copy(os.path.join(REPO_ROOT, "client", "python", "mha_client.py"), lone)
        run = subprocess.run([sys.executable, "-c", "import mha_client; mha_client.load_stubs()"],
                             cwd=lone, env=dict(os.environ, PYTHONPATH=lone),
                             capture_output=True, text=True, timeout=60)
        self.assertNotEqual(run.returncode, 0)
        self.assertIn("ImportError", run.stderr)
        self.assertIn("pip install --no-deps --no-build-isolation ./client/python", run.stderr)


class ConnectionOptionsTest(unittest.TestCase):
    # 300 KiB: above gRPC's default per-call retry buffer (256 KiB)
    QUERY = np.ones((1, 300, DEMO_E), dtype=np.float32)

    def call_flaky(self, failures, retries, code=grpc.StatusCode.UNAVAILABLE):
        """(attempts the server saw, the call's error or None)."""
        port = free_port()
        servicer = FlakyAttention(failures, code)
        server = start_fake(servicer, port)
        try:
            with MhaClient(f"127.0.0.1:{port}", timeout=30, retries=retries,
                           retry_backoff=(0.05, 0.2)) as client:
                try:
                    output, _ = client.attend("demo", self.QUERY)
                    np.testing.assert_array_equal(output, self.QUERY)
                    return servicer.attempts, None
                except grpc.RpcError as e:
                    return servicer.attempts, e
        finally:
            server.stop(None)

    def test_unavailable_is_retried_up_to_retries(self):
        attempts, error = self.call_flaky(failures=2, retries=2)
        self.assertIsNone(error)
        self.assertEqual(attempts, 3)

    def test_without_retries_one_attempt(self):
        attempts, error = self.call_flaky(failures=1, retries=0)
        self.assertEqual(error.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertEqual(attempts, 1)

    def test_retries_give_up_with_the_last_status(self):
        attempts, error = self.call_flaky(failures=10, retries=4)
        self.assertEqual(error.code(), grpc.StatusCode.UNAVAILABLE)
        self.assertIn("attempt 5 refused", error.details())
        self.assertEqual(attempts, 5)

    def test_other_codes_are_not_retried(self):
        attempts, error = self.call_flaky(failures=1, retries=3,
                                          code=grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(error.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertEqual(attempts, 1)

    def test_bad_option_values_are_refused(self):
        with self.assertRaisesRegex(ValueError, "caps a call at 5 attempts"):
            MhaClient("127.0.0.1:1", retries=5)
        with self.assertRaisesRegex(ValueError, "reconnect_backoff"):
            MhaClient("127.0.0.1:1", reconnect_backoff=(2.0, 1.0))

    def test_wait_for_ready_waits_for_a_server_that_comes_up(self):
        port = free_port()
        with MhaClient(f"127.0.0.1:{port}", timeout=5) as impatient:
            with self.assertRaises(grpc.RpcError) as refused:
                impatient.attend("demo", self.QUERY)
            self.assertEqual(refused.exception.code(), grpc.StatusCode.UNAVAILABLE)
        servicer = FlakyAttention(failures=0)
        started = []
        starter = threading.Timer(1.0, lambda: started.append(start_fake(servicer, port)))
        t0 = time.monotonic()
        starter.start()
        try:
            with MhaClient(f"127.0.0.1:{port}", timeout=30, wait_for_ready=True) as patient:
                output, _ = patient.attend("demo", self.QUERY)
                self.assertGreaterEqual(time.monotonic() - t0, 1.0)  # it waited for the server
            np.testing.assert_array_equal(output, self.QUERY)
            self.assertEqual(servicer.attempts, 1)
        finally:
            starter.join()
            for server in started:
                server.stop(None)


if __name__ == "__main__":
    unittest.main()
