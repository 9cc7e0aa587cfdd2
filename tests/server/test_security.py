#!/usr/bin/python3
"""TLS, mutual TLS and bearer-token auth, end to end: mha_server with the
security flags, mha_client with --tls/--ca/--tls_cert/--tls_key/--token.
Certificates are made by openssl at test time.

  MHA_SERVER=build/mha_server MHA_CLIENT=build/mha_client \
    /usr/bin/python3 tests/server/test_security.py
"""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mha_test_server import MHA_SERVER, REPO_ROOT, TestServer  # noqa: E402
from mha_local_server import free_port  # noqa: E402

MHA_CLIENT = os.environ.get("MHA_CLIENT", os.path.join(REPO_ROOT, "build", "mha_client"))
TOKEN = "s3cr3t-token-for-tests"


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(d):
    """ca.pem, server.pem/server.key (for 127.0.0.1), client.pem/client.key."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
            "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    with open(os.path.join(d, "san.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-extfile", "san.ext", "-out", f"{name}.pem", cwd=d)


class SecurityTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="mha_security_")
        make_certificates(cls.dir)
        cls.repo = os.path.join(cls.dir, "models")
        shutil.copytree(os.path.join(REPO_ROOT, "models", "demo"), os.path.join(cls.repo, "demo"))
        cls.token_file = os.path.join(cls.dir, "token")
        with open(cls.token_file, "w") as f:
            f.write(TOKEN + "\n")
        cls.wrong_token_file = os.path.join(cls.dir, "wrong")
        with open(cls.wrong_token_file, "w") as f:
            f.write(TOKEN + "x\n")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.dir, name)

    def client(self, server, *args):
        return subprocess.run([MHA_CLIENT, f"--target={server.target()}", "--deadline_ms=5000",
                               *args], capture_output=True, text=True, timeout=60)

    def curl(self, url, *args):
        """(HTTP code or 0, curl's exit code) of a GET."""
        run = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", *args, url],
                             capture_output=True, text=True, timeout=60)
        return int(run.stdout or 0), run.returncode

    def test_tls(self):
        http_port = free_port()
        flags = [f"--tls_cert={self.path('server.pem')}", f"--tls_key={self.path('server.key')}",
                 f"--http_port={http_port}"]
        with TestServer(MHA_SERVER, self.repo, flags) as server:
            # HTTP takes the same certificate: HTTPS only.
            url = f"https://127.0.0.1:{http_port}/v2/models/demo"
            self.assertEqual(self.curl(url, "--cacert", self.path("ca.pem")), (200, 0))
            self.assertNotEqual(self.curl(url)[1], 0, "an untrusted certificate is refused")
            self.assertNotEqual(self.curl(f"http://127.0.0.1:{http_port}/v2/models/demo")[0], 200)
            ok = self.client(server, "attend", "--tls", f"--ca={self.path('ca.pem')}",
                             "--model=demo", "--len=4")
            self.assertEqual(ok.returncode, 0, ok.stderr)
            self.assertIn("output [1, 4, 256]", ok.stdout)
            plain = self.client(server, "models")
            self.assertNotEqual(plain.returncode, 0)
            self.assertTrue(plain.stderr.startswith("UNAVAILABLE"), plain.stderr)
            untrusted = self.client(server, "models", "--tls")  # system roots only
            self.assertNotEqual(untrusted.returncode, 0)

    def test_mutual_tls(self):
        http_port = free_port()
        flags = [f"--tls_cert={self.path('server.pem')}", f"--tls_key={self.path('server.key')}",
                 f"--tls_client_ca={self.path('ca.pem')}", f"--http_port={http_port}"]
        with TestServer(MHA_SERVER, self.repo, flags) as server:
            url = f"https://127.0.0.1:{http_port}/v2/models/demo"
            ca = ["--cacert", self.path("ca.pem")]
            self.assertEqual(self.curl(url, *ca)[0], 403, "no client certificate")
            self.assertEqual(self.curl(url, *ca, "--cert", self.path("client.pem"), "--key",
                                       self.path("client.key")), (200, 0))
            tls = ["--tls", f"--ca={self.path('ca.pem')}"]
            no_cert = self.client(server, "models", *tls)
            self.assertNotEqual(no_cert.returncode, 0)
            with_cert = self.client(server, "models", *tls, f"--tls_cert={self.path('client.pem')}",
                                    f"--tls_key={self.path('client.key')}")
            self.assertEqual(with_cert.returncode, 0, with_cert.stderr)
            self.assertIn("demo", with_cert.stdout)

    def test_bearer_token(self):
        with TestServer(MHA_SERVER, self.repo, [f"--auth_token_file={self.token_file}"]) as server:
            for args in (["models"], ["info", "demo"], ["attend", "--model=demo"]):
                missing = self.client(server, *args)
                self.assertEqual(missing.returncode, 1, args)
                self.assertTrue(missing.stderr.startswith("UNAUTHENTICATED: "), missing.stderr)
                wrong = self.client(server, *args, f"--token={self.wrong_token_file}")
                self.assertTrue(wrong.stderr.startswith("UNAUTHENTICATED: "), wrong.stderr)
                right = self.client(server, *args, f"--token={self.token_file}")
                self.assertEqual(right.returncode, 0, right.stderr)
            health = self.client(server, "health")  # probes need no token
            self.assertEqual(health.returncode, 0, health.stderr)
            load = self.client(server, "load", "--model=demo", "--requests=50", "--duration=30s",
                               f"--token={self.token_file}", "--json")
            self.assertEqual(load.returncode, 0, load.stderr)
        self.assertNotIn(TOKEN, server.stderr())  # never logged


if __name__ == "__main__":
    unittest.main()
