#!/usr/bin/python3
"""The Python client against the golden session file the C++ module writes
(tests/proto/golden_session.mhasess, checked byte for byte by
tests/proto/session_file_test.cc): it reads the same chunks and writes the
same bytes, so files move between the C++ client, the server's spill and
Python both ways.

    /usr/bin/python3 tests/proto/test_session_file.py
"""

import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "client", "python"))
import mha_client  # noqa: E402
from golden_session import golden_chunks  # noqa: E402

GOLDEN = os.path.join(HERE, "golden_session.mhasess")


class SessionFileTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pb, _, _ = mha_client.load_stubs()
        with open(GOLDEN, "rb") as f:
            cls.golden = f.read()

    def test_reads_the_golden_file_chunk_for_chunk(self):
        read = list(mha_client._session_chunks(self.pb, self.golden))
        self.assertEqual(read, golden_chunks(self.pb))
        self.assertEqual(read[0].header.session_id, "golden-1")
        self.assertEqual(read[0].header.fingerprint, 0x0123456789ABCDEF)

    def test_writes_the_golden_file_byte_for_byte(self):
        self.assertEqual(mha_client._session_file_bytes(golden_chunks(self.pb)), self.golden)

    def test_refuses_other_and_truncated_files(self):
        with self.assertRaisesRegex(ValueError, "not a session file"):
            list(mha_client._session_chunks(self.pb, b"MHASESS2" + self.golden[8:]))
        with self.assertRaisesRegex(ValueError, "truncated"):
            list(mha_client._session_chunks(self.pb, self.golden[:-3]))


if __name__ == "__main__":
    unittest.main()
