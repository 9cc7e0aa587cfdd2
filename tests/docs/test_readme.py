#!/usr/bin/python3
"""The README's commands, run as a reader would run them, so they cannot go stale.

Every fenced block preceded by `<!-- test -->` runs, in the README's order and
then in each of docs/*.md (by file name),
in one scratch folder that looks like the repository root (`build/` is the
build under test, `models/` the repository's, `client/` and `proto/` copies,
so pip's in-tree build writes nothing into the source tree); `sh` blocks in
bash -e -o pipefail, `python` blocks in python3, with `.venv/bin` (made by
a block) first on PATH as if the reader had activated it, then a fresh Debian
machine's PATH (no pyenv or other python3 ahead of Debian's). Each must exit 0.
`<!-- test: background -->` blocks are servers started the way the README
starts them: the test waits for the ready line and stops them (SIGTERM, exit
0) at the end. The quick start's `run.sh` is not run (it would rebuild the
tree under test); its server is started as its last line starts it:
`build/mha_server --model_repository models`.

The README uses the default ports (50051, 9464, and 50052/9465 for the
second server), so the test runs in a network namespace of its own
(`unshare -n`, or `unshare -rn` without root) where they are always free.

Also: every relative link in README.md and docs/*.md names a file that exists.

  MHA_SERVER=build/mha_server /usr/bin/python3 tests/docs/test_readme.py
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
README = os.path.join(REPO_ROOT, "README.md")
MHA_SERVER = os.path.abspath(os.environ.get("MHA_SERVER",
                                            os.path.join(REPO_ROOT, "build", "mha_server")))
NETNS_MARK = "MHA_README_TEST_NETNS"
BLOCK = re.compile(r"<!-- test(?P<background>: background)? -->\n```(?P<lang>sh|python)\n"
                   r"(?P<code>.*?)```", re.S)
BLOCK_TIMEOUT_S = 300
DEBIAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # a fresh machine's


def reexec_in_own_network():
    """Runs this script again in a new network namespace with loopback up;
    returns its exit code, or None when no namespace can be made."""
    script = f'ip link set lo up && exec "{sys.executable}" "$0" "$@"'
    for unshare in (["unshare", "-n"], ["unshare", "-rn"]):
        probe = subprocess.run(unshare + ["true"], capture_output=True)
        if probe.returncode == 0:
            return subprocess.run(unshare + ["sh", "-c", script, os.path.abspath(__file__)] +
                                  sys.argv[1:], env=dict(os.environ, **{NETNS_MARK: "1"})
                                  ).returncode
    return None


def marked_pages():
    """README.md, then docs/*.md by name."""
    docs = os.path.join(REPO_ROOT, "docs")
    return [README] + [os.path.join(docs, f) for f in sorted(os.listdir(docs))
                       if f.endswith(".md")]


def marked_blocks(page):
    """[(lang, code, background)] of `page`'s marked blocks, and its markers."""
    with open(page) as f:
        text = f.read()
    blocks = [(m["lang"], m["code"], bool(m["background"])) for m in BLOCK.finditer(text)]
    return blocks, len(re.findall(r"(?m)^<!-- test", text))


def start_server(args, cwd, env):
    """Starts a server command and waits for its ready line; the process."""
    log = tempfile.TemporaryFile(mode="w+")  # a pipe nobody reads could fill and block it
    process = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=log,
                               text=True)
    line = process.stdout.readline()
    if "ready" not in line:
        process.kill()
        process.wait()
        log.seek(0)
        raise AssertionError(f"{args}: no ready line, got {line!r}; stderr: {log.read()[-3000:]}")
    process.log = log
    return process


class ReadmeTest(unittest.TestCase):
    def setUp(self):
        self.folder = tempfile.mkdtemp(prefix="mha_readme_")
        for name in ("client", "proto"):
            shutil.copytree(os.path.join(REPO_ROOT, name), os.path.join(self.folder, name),
                            ignore=shutil.ignore_patterns("gen", "build", "*.egg-info",
                                                          "__pycache__"))
        os.symlink(os.path.join(REPO_ROOT, "models"), os.path.join(self.folder, "models"))
        os.symlink(os.path.dirname(MHA_SERVER), os.path.join(self.folder, "build"))
        venv_bin = os.path.join(self.folder, ".venv", "bin")
        self.env = dict(os.environ, PATH=venv_bin + os.pathsep + DEBIAN_PATH)
        self.servers = []

    def tearDown(self):
        codes = []
        for server in self.servers:
            server.send_signal(signal.SIGTERM)
            codes.append(server.wait(60))
            server.stdout.close()
            server.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        self.assertEqual(codes, [0] * len(codes), "servers did not drain and exit 0")

    def run_block(self, where, lang, code):
        command = (["bash", "-e", "-o", "pipefail", "-c", code] if lang == "sh"
                   else ["python3", "-c", code])
        run = subprocess.run(command, cwd=self.folder, env=self.env, capture_output=True,
                             text=True, timeout=BLOCK_TIMEOUT_S)
        self.assertEqual(run.returncode, 0, f"{where} ({lang}) failed:\n{code}\n"
                         f"stdout: {run.stdout[-3000:]}\nstderr: {run.stderr[-3000:]}")

    def test_marked_blocks_run(self):
        self.servers.append(start_server(["build/mha_server", "--model_repository", "models"],
                                         self.folder, self.env))
        ran = {}
        for page in marked_pages():
            name = os.path.relpath(page, REPO_ROOT)
            blocks, markers = marked_blocks(page)
            self.assertEqual(len(blocks), markers,
                             f"{name}: a <!-- test --> marker not followed by a block")
            for number, (lang, code, background) in enumerate(blocks, 1):
                if background:
                    self.servers.append(start_server(["bash", "-c", "exec " + code.strip()],
                                                     self.folder, self.env))
                else:
                    self.run_block(f"{name} block {number}", lang, code)
            ran[name] = len(blocks)
        self.assertGreaterEqual(ran["README.md"], 5)
        self.assertGreaterEqual(ran["docs/KSERVE.md"], 1)


class LinkTest(unittest.TestCase):
    def test_relative_links_name_files_that_exist(self):
        pages = [README] + [os.path.join(REPO_ROOT, "docs", f)
                            for f in os.listdir(os.path.join(REPO_ROOT, "docs"))
                            if f.endswith(".md")]
        for page in pages:
            with open(page) as f:
                links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", f.read())
            for link in links:
                if re.match(r"[a-z]+://", link):
                    continue
                target = os.path.normpath(os.path.join(os.path.dirname(page), link))
                self.assertTrue(os.path.exists(target), f"{page}: link to {link}: no such file")


if __name__ == "__main__":
    if os.environ.get(NETNS_MARK) != "1":
        code = reexec_in_own_network()
        if code is not None:
            sys.exit(code)
        print("test_readme: no network namespace could be made; using this one's ports",
              file=sys.stderr)
    unittest.main()
