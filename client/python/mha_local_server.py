"""Runs an mha_server binary as a child process on free loopback ports.

    with LocalServer("build/mha_server", "path/to/model_repository") as server:
        client = MhaClient(server.target())
        ...
    server.exit_code          # 0 after a clean drain

mha_export.py --verify serves the folder it just wrote this way, and the
tests' TestServer (tests/server/mha_test_server.py) builds on it.
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def free_port():
    """A loopback TCP port that was free a moment ago (for a server that
    must be told its port, such as --http_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """Owns one mha_server process from start() to stop() (or a `with`
    block). Not thread-safe: start and stop it from one thread; any thread
    may call the server it runs. The server's stderr goes to the file
    `stderr_path`, which stays after stop() for the caller to read or
    delete."""

    def __init__(self, binary, repository, extra_flags=(), ready_timeout=60):
        self.binary, self.repository = binary, repository
        self.extra_flags, self.ready_timeout = list(extra_flags), ready_timeout
        self.process = None
        self.grpc_port = self.metrics_port = self.http_port = None
        self.exit_code = None
        self.stderr_path = None
        self.ready_line = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def start(self):
        """Starts the server and waits for its ready line, which names the
        ports it picked; RuntimeError (with its stderr) if it exits first."""
        err = tempfile.NamedTemporaryFile(prefix="mha_server_", suffix=".log", delete=False)
        err.close()
        self.stderr_path = err.name
        with open(self.stderr_path, "w") as stderr:
            self.process = subprocess.Popen(
                [self.binary, f"--model_repository={self.repository}", "--host=127.0.0.1",
                 "--port=0", "--metrics_port=0", "--http_port=0"] + self.extra_flags,
                stdout=subprocess.PIPE, stderr=stderr, text=True)
        deadline = time.monotonic() + self.ready_timeout
        line = self.process.stdout.readline()
        match = re.search(r"grpc_port=(\d+) metrics_port=(\d+)", line)
        if not match or time.monotonic() > deadline:
            self.process.kill()
            self.process.wait()
            raise RuntimeError(f"mha_server did not get ready: {line!r}; stderr: {self.stderr()}")
        self.grpc_port, self.metrics_port = int(match.group(1)), int(match.group(2))
        http = re.search(r"http_port=(\d+)", line)
        self.http_port = int(http.group(1)) if http else 0  # 0: off
        self.ready_line = line.strip()

    def stderr(self):
        with open(self.stderr_path) as f:
            return f.read()

    def stop(self, timeout=60):
        """SIGTERM (the server drains), then wait; returns the exit code."""
        if self.process is None or self.exit_code is not None:
            return self.exit_code
        self.process.send_signal(signal.SIGTERM)
        try:
            self.exit_code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.exit_code = self.process.wait()
        self.process.stdout.close()
        self._raise_on_sanitizer_report()
        return self.exit_code

    # What ASan, LSan, UBSan and TSan print; never seen from a plain build.
    _SANITIZER_MARKERS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer",
                          "runtime error:", "WARNING: ThreadSanitizer")

    def _raise_on_sanitizer_report(self):
        """A sanitizer build of the server reports memory errors, leaks and
        undefined behaviour on stderr: make every test that ran it fail."""
        if not self.stderr_path or not os.path.exists(self.stderr_path):
            return  # the caller removed the log already
        log = self.stderr()
        for marker in self._SANITIZER_MARKERS:
            if marker in log:
                start = log.index(marker)
                raise RuntimeError(f"mha_server sanitizer report:\n{log[start:start + 4000]}")

    def remove_log(self):
        """Deletes the stderr file (after stop())."""
        if self.stderr_path and os.path.exists(self.stderr_path):
            os.unlink(self.stderr_path)

    def target(self):
        return f"127.0.0.1:{self.grpc_port}"


def server_candidates(fallback):
    """Where mha_server is looked for, in order: the MHA_SERVER environment
    variable, `mha_server` on PATH, the build of the checkout the package
    was installed from (recorded at install time), then `fallback`."""
    candidates = []
    if os.environ.get("MHA_SERVER"):
        candidates.append(os.environ["MHA_SERVER"])
    on_path = shutil.which("mha_server")
    if on_path:
        candidates.append(on_path)
    try:
        from mha_client_stubs.source_checkout import CHECKOUT  # written by setup.py
        candidates.append(os.path.join(CHECKOUT, "build", "mha_server"))
    except ImportError:
        pass
    return candidates + [fallback]


def find_server(fallback, given=None):
    """(the first executable of server_candidates(fallback) or None, every
    candidate); only `given` when one is given (--server)."""
    candidates = [given] if given else server_candidates(fallback)
    found = (c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK))
    return next(found, None), candidates
