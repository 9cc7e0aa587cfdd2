#!/usr/bin/python3
"""Sessions that move (issue 33): ExportSession / ImportSession between two
real servers, checked against PyTorch, and every bad stream refused with
the server left as it was.

    MHA_SERVER=build/mha_server /usr/bin/python3 tests/server/test_session_transfer.py

- A self session (demo, extras) and a cross session exported from one
  server and imported on another go on as one causal pass (or attention
  over the memory) would: the steps after the move equal PyTorch.
- Another fingerprint (other weights under the same name) is
  FAILED_PRECONDITION naming both; truncated, corrupt, reordered and
  oversized streams are refused; nothing is left behind (no session, no
  cache bytes). The CLI moves a session through a file.
- --session_spill_dir: sessions written at SIGTERM come back at the next
  start with their positions and go on as PyTorch; one whose model is gone
  answers NOT_FOUND saying it was not restored, and why.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest

import grpc
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mha_test_server import TestServer, load_stubs, metric_value  # noqa: E402
from test_server import (CROSS_E, CROSS_KDIM, CROSS_VDIM, DEMO_E, MHA_SERVER,  # noqa: E402
                         _randomize_biases, _write_model, make_repository, randn, reference)
from test_sessions import EXTRAS_E, make_extras_model  # noqa: E402
sys.path.insert(0, os.path.join(HERE, "..", "fuzz"))
from make_seeds import content_hash  # noqa: E402  server/models/content_hash.h's, in Python
import mha_client  # noqa: E402

pb, rpc, cfg = load_stubs()
TOL = 1e-5
MHA_CLIENT = os.environ.get("MHA_CLIENT", os.path.join(HERE, "..", "..", "build", "mha_client"))


def chunks_of(data):
    return list(mha_client._session_chunks(pb, data))


def header_checksum(header):
    """The format-2 header checksum (attention.proto, SessionHeader)."""
    unchecked = type(header)()
    unchecked.CopyFrom(header)
    unchecked.header_checksum = 0
    return content_hash(mha_client.SESSION_FILE_MAGIC + unchecked.SerializeToString())


def as_bytes(chunks):
    out = [mha_client.SESSION_FILE_MAGIC]
    for c in chunks:
        b = c.SerializeToString()
        out += [len(b).to_bytes(4, "little"), b]
    return b"".join(out)


class SessionTransferTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = [tempfile.TemporaryDirectory() for _ in range(3)]
        cls.models = make_repository(cls.tmp[0].name, ("demo", "cross"))
        cls.models["extras"] = make_extras_model(cls.tmp[0].name)
        make_repository(cls.tmp[1].name, ("demo", "cross"))
        make_extras_model(cls.tmp[1].name)
        # The third server's "demo" has other weights under the same name.
        torch.manual_seed(99)
        other = torch.nn.MultiheadAttention(DEMO_E, 4, batch_first=True).eval()
        _randomize_biases(other, 3)
        _write_model(os.path.join(cls.tmp[2].name, "demo"),
                     {"embed_dim": DEMO_E, "num_heads": 4}, other.state_dict())
        cls.servers = [TestServer(MHA_SERVER, t.name, []).__enter__() for t in cls.tmp]
        cls.clients = [mha_client.MhaClient(s.target(), timeout=60) for s in cls.servers]

    @classmethod
    def tearDownClass(cls):
        for c in cls.clients:
            c.close()
        for s in cls.servers:
            s.__exit__(None, None, None)
        for t in cls.tmp:
            t.cleanup()

    def assert_close(self, actual, expected, what):
        np.testing.assert_allclose(actual, expected, rtol=TOL, atol=TOL, err_msg=what)

    def move_self(self, model, width, prefix, after):
        rng = np.random.default_rng(prefix)
        x = randn(rng, 1, prefix + after, width)
        want, _ = reference(self.models[model], x, is_causal=True)
        a, b = self.clients[0], self.clients[1]
        with a.open_session(model) as session:
            session.append(x[:, :prefix])
            data = session.export()
            self.assertEqual(session.append(x[:, prefix:prefix + 1]).shape, (1, 1, width),
                             "the exported session stays open")
        with b.import_session(data) as moved:
            self.assertEqual(moved.position, prefix)
            out = moved.append(x[:, prefix:])
        self.assert_close(out, want[:, prefix:], f"{model} after the move")

    def test_self_sessions_move_between_servers(self):
        self.move_self("demo", DEMO_E, 45, 7)     # a partly filled last block
        self.move_self("demo", DEMO_E, 64, 3)     # whole blocks
        self.move_self("extras", EXTRAS_E, 5, 4)

    def test_a_cross_session_moves_with_its_memory_and_padding(self):
        rng = np.random.default_rng(2)
        memory, value = randn(rng, 1, 37, CROSS_KDIM), randn(rng, 1, 37, CROSS_VDIM)
        padding = np.zeros((1, 37), bool)
        padding[0, 30:] = True
        q = randn(rng, 1, 3, CROSS_E)
        want, _ = reference(self.models["cross"], q, memory, value, key_padding_mask=padding)
        with self.clients[0].open_session("cross", memory=memory, memory_value=value,
                                          memory_key_padding_mask=padding) as session:
            data = session.export()
        with self.clients[1].import_session(data, session_id="moved-cross") as moved:
            self.assertEqual((moved.id, moved.cross, moved.position), ("moved-cross", True, 37))
            self.assert_close(moved.append(q), want, "cross after the move")

    def test_the_cli_moves_a_session_through_a_file(self):
        rng = np.random.default_rng(4)
        x = randn(rng, 1, 40, DEMO_E)
        want, _ = reference(self.models["demo"], x, is_causal=True)
        with tempfile.TemporaryDirectory() as tmp, \
                self.clients[0].open_session("demo", session_id="by-file") as session:
            session.append(x[:, :33])
            path = os.path.join(tmp, "s.mhasession")
            run = subprocess.run([MHA_CLIENT, f"--target={self.servers[0].target()}",
                                  "export_session", "by-file", path],
                                 capture_output=True, text=True, timeout=60)
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
            self.assertIn("position 33, 2 blocks", run.stdout)
            run = subprocess.run([MHA_CLIENT, f"--target={self.servers[1].target()}",
                                  "import_session", path, "by-file-2"],
                                 capture_output=True, text=True, timeout=60)
            self.assertEqual(run.returncode, 0, run.stdout + run.stderr)
            self.assertIn("session by-file-2 on demo version 1, position 33", run.stdout)
            with open(path, "rb") as f:
                data = f.read()
            moved = self.clients[1].import_session(data, session_id="by-file-3")
            self.assert_close(moved.append(x[:, 33:]), want[:, 33:], "after the file")
            moved.close()
            self.clients[1]._stub.CloseSession(pb.CloseSessionRequest(session_id="by-file-2"),
                                               timeout=30)
            with open(path, "wb") as f:
                f.write(data[:-7])
            run = subprocess.run([MHA_CLIENT, f"--target={self.servers[1].target()}",
                                  "import_session", path], capture_output=True, text=True,
                                 timeout=60)
            self.assertNotEqual(run.returncode, 0)
            self.assertIn("truncated", run.stdout + run.stderr)
            # One changed byte of the header (its idle time left): refused whole.
            at = data.index(b"\x70", 12)  # SessionHeader field 14 (idle_left_ms)
            with open(path, "wb") as f:
                f.write(data[:at + 1] + bytes([data[at + 1] ^ 4]) + data[at + 2:])
            run = subprocess.run([MHA_CLIENT, f"--target={self.servers[1].target()}",
                                  "import_session", path], capture_output=True, text=True,
                                 timeout=60)
            self.assertNotEqual(run.returncode, 0)
            self.assertIn("DATA_LOSS", run.stdout + run.stderr)
            self.assertIn("session by-file: the header's checksum", run.stdout + run.stderr)

    def test_bad_streams_are_refused_and_leave_nothing(self):
        rng = np.random.default_rng(3)
        with self.clients[0].open_session("demo", session_id="travel") as session:
            session.append(randn(rng, 1, 70, DEMO_E))   # 3 blocks
            good = chunks_of(session.export())
        self.assertEqual([c.WhichOneof("part") for c in good],
                         ["header", "block", "block", "block", "trailer"])
        header = good[0].header
        self.assertEqual((header.format_version, header.model, header.position, header.blocks),
                         (2, "demo", 70, 3))
        self.assertEqual(header.header_checksum, header_checksum(header))
        target = self.clients[1]
        before = metric_value(self.servers[1].metrics(), "mha_session_cache_bytes")

        def refused(chunks, code, text, client=target):
            with self.assertRaises(grpc.RpcError) as e:
                client.import_session(as_bytes(chunks))
            self.assertEqual(e.exception.code(), code, e.exception.details())
            self.assertIn(text, e.exception.details())

        invalid = grpc.StatusCode.INVALID_ARGUMENT
        refused(good[:3], invalid, "ended early")                     # truncated
        refused(good[:4] + good[3:4] + good[4:], invalid, "more than")  # a block too many
        refused(good[1:], invalid, "before the header")
        corrupt = [type(c)() for c in good]
        for c, g in zip(corrupt, good):
            c.CopyFrom(g)
        corrupt[2].block = corrupt[2].block[:-1] + bytes([corrupt[2].block[-1] ^ 1])
        refused(corrupt, grpc.StatusCode.DATA_LOSS, "checksum")
        short = [type(c)() for c in good]
        for c, g in zip(short, good):
            c.CopyFrom(g)
        short[1].block = short[1].block[:100]
        refused(short, invalid, "a block of 100 bytes")
        big = [type(c)() for c in good]
        for c, g in zip(big, good):
            c.CopyFrom(g)
        big[0].header.position = big[0].header.max_tokens = 1 << 40
        big[0].header.blocks = (1 << 40) // 32
        # A changed header is corrupt (issue 64: 277 -> 276 was imported)...
        refused(big, grpc.StatusCode.DATA_LOSS, "session travel: the header's checksum")
        # ... and what a sealed header says is checked as before.
        big[0].header.header_checksum = header_checksum(big[0].header)
        refused(big, grpc.StatusCode.RESOURCE_EXHAUSTED, "more than the cache holds")
        big[0].header.max_tokens = 64
        big[0].header.header_checksum = header_checksum(big[0].header)
        refused(big, invalid, "with max_tokens 64")
        shifted = [type(c)() for c in good]
        for c, g in zip(shifted, good):
            c.CopyFrom(g)
        shifted[0].header.position -= 1  # the same blocks: only the checksum can tell
        refused(shifted, grpc.StatusCode.DATA_LOSS, "header's checksum does not match")
        shifted[0].header.header_checksum = header_checksum(shifted[0].header)
        refused(shifted, grpc.StatusCode.DATA_LOSS, "session travel: the checksum does not match")
        future = [type(c)() for c in good]
        for c, g in zip(future, good):
            c.CopyFrom(g)
        future[0].header.format_version = 3
        future[0].header.header_checksum = header_checksum(future[0].header)
        refused(future, grpc.StatusCode.FAILED_PRECONDITION, "format version 3")
        # Another server's "demo" has other weights: both fingerprints named.
        with self.assertRaises(grpc.RpcError) as e:
            self.clients[2].import_session(as_bytes(good))
        self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
        self.assertIn(f"{header.fingerprint:016x}", e.exception.details())
        self.assertEqual(len(self.clients[2].list_sessions()), 0)
        # Nothing half-made on the target; then the good stream imports.
        self.assertNotIn("travel", [s.session_id for s in target.list_sessions()])
        self.assertEqual(metric_value(self.servers[1].metrics(), "mha_session_cache_bytes"),
                         before)
        with target.import_session(as_bytes(good)) as moved:
            self.assertEqual((moved.id, moved.position), ("travel", 70))
            with self.assertRaises(grpc.RpcError) as e:
                target.import_session(as_bytes(good))
            self.assertEqual(e.exception.code(), grpc.StatusCode.ALREADY_EXISTS)
        with self.assertRaises(grpc.RpcError) as e:
            list(self.clients[0]._stub.ExportSession(pb.ExportSessionRequest(
                session_id="nobody"), timeout=30))
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)


class SpillAndRestartTest(unittest.TestCase):
    """--session_spill_dir across a real SIGTERM and restart."""

    def test_sessions_survive_a_restart_and_those_that_cannot_say_why(self):
        rng = np.random.default_rng(5)
        x = randn(rng, 1, 50, DEMO_E)
        memory, value = randn(rng, 1, 9, CROSS_KDIM), randn(rng, 1, 9, CROSS_VDIM)
        with tempfile.TemporaryDirectory() as repo, tempfile.TemporaryDirectory() as spill:
            models = make_repository(repo, ("demo", "cross"))
            want, _ = reference(models["demo"], x, is_causal=True)
            flags = [f"--session_spill_dir={spill}", "--session_idle_timeout_s=600"]
            with TestServer(MHA_SERVER, repo, flags) as first:
                client = mha_client.MhaClient(first.target(), timeout=60)
                keep = client.open_session("demo", session_id="keep")
                keep.append(x[:, :45])
                client.open_session("cross", session_id="keep-cross", memory=memory,
                                    memory_value=value)
                for i in range(30):  # more sessions, so the restart restores a few dozen
                    client.open_session("demo", session_id=f"extra-{i}").append(x[:, :i + 1])
                client.close()
                first.stop()
                self.assertIn("32 sessions written", first.stderr())
            self.assertEqual(len([f for f in os.listdir(spill) if f.endswith(".mhasession")]),
                             32)
            # The cross model is gone from the repository at the restart.
            shutil.rmtree(os.path.join(repo, "cross"))
            with TestServer(MHA_SERVER, repo, flags) as second:
                self.assertIn("31 sessions restored", second.stderr())
                self.assertEqual(os.listdir(spill), [], "the files are consumed")
                client = mha_client.MhaClient(second.target(), timeout=60)
                listed = {s.session_id: s for s in client.list_sessions()}
                self.assertEqual(listed["keep"].position, 45)
                self.assertEqual(listed["extra-29"].position, 30)
                response = client._stub.Append(pb.AppendRequest(
                    session_id="keep", query=mha_client.to_tensor(x[:, 45:]),
                    expected_position=45), timeout=60)
                np.testing.assert_allclose(mha_client.from_tensor(response.output),
                                           want[:, 45:], rtol=TOL, atol=TOL)
                with self.assertRaises(grpc.RpcError) as e:
                    client._stub.Append(pb.AppendRequest(
                        session_id="keep-cross",
                        query=mha_client.to_tensor(randn(rng, 1, CROSS_E))), timeout=60)
                self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
                self.assertIn("not restored after a restart", e.exception.details())
                self.assertIn("cross", e.exception.details())
                client.close()

    def test_a_spill_killed_midway_leaves_nothing_after_the_next_start(self):
        """Issue 64: SIGKILL while sessions are written leaves a partial
        file; the next start removes it (and only what a spill names so),
        and restores the sessions that were written whole."""
        rng = np.random.default_rng(6)
        x = randn(rng, 1, 100, DEMO_E)
        with tempfile.TemporaryDirectory() as repo, tempfile.TemporaryDirectory() as spill:
            make_repository(repo, ("demo",))
            flags = [f"--session_spill_dir={spill}", "--session_idle_timeout_s=600"]
            foreign = ["notes.partial", "abc.mhasession.partial", "0123456789abcdef.partial"]
            for name in foreign:
                with open(os.path.join(spill, name), "w") as f:
                    f.write("not a spill's")
            partial = None
            for _ in range(10):  # until the kill lands during the spill
                for name in os.listdir(spill):
                    if name not in foreign:
                        os.unlink(os.path.join(spill, name))
                server = TestServer(MHA_SERVER, repo, flags)
                server.start()
                client = mha_client.MhaClient(server.target(), timeout=60)
                for i in range(60):  # 4 blocks each: a spill of some length
                    client.open_session("demo", session_id=f"s{i}").append(x)
                client.close()
                server.process.send_signal(signal.SIGTERM)
                while server.process.poll() is None:
                    names = [n for n in os.listdir(spill) if n.endswith(".mhasession.partial")
                             and n not in foreign]
                    if names:
                        server.process.kill()
                        partial = names[0]
                        break
                server.stop()
                server.remove_log()
                if partial is not None and os.path.exists(os.path.join(spill, partial)):
                    break
                partial = None
            self.assertIsNotNone(partial, "no kill landed during a spill in 10 tries")
            whole = len([n for n in os.listdir(spill) if n.endswith(".mhasession")])
            with TestServer(MHA_SERVER, repo, flags) as again:
                self.assertIn(f"removed 1 partial session file(s) of an earlier spill that did "
                              f"not finish: {partial}", again.stderr())
                client = mha_client.MhaClient(again.target(), timeout=60)
                self.assertEqual(len(client.list_sessions()), whole, "the whole files came back")
                client.close()
                self.assertEqual(sorted(os.listdir(spill)), sorted(foreign))


if __name__ == "__main__":
    unittest.main()
