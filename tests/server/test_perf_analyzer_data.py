#!/usr/bin/python3
"""The perf_analyzer commands the docs show, checked without perf_analyzer
(it is not a Debian package; issue 47 ran the real one by hand).

    MHA_SERVER=build/mha_server /usr/bin/python3 tests/server/test_perf_analyzer_data.py

* client/perf_analyzer/demo_64x256.json is what make_input_data.py writes.
* Read the way perf_analyzer reads a model (ModelConfig from the server
  serving the repository's models/), the file gives data for every required
  input, only for inputs the model has, in shapes its dims allow: so
  perf_analyzer sends the query and skips the optional inputs.
* Its entries sent as perf_analyzer sends them (ModelInfer, raw contents,
  batch 1) are answered, equal to mha.v1 Attend on the same query.
* Every perf_analyzer line in README.md and docs/*.md names the demo model
  and an input-data file that exists, and none uses --shared-memory
  (perf_analyzer refuses optional inputs there).
"""

import glob
import json
import os
import re
import subprocess
import sys
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mha_test_server import TestServer, tensor, to_numpy  # noqa: E402
from test_server import MHA_SERVER, REPO_ROOT, cfg, pb  # noqa: E402
from test_sequences import infer_request, outputs_of  # noqa: E402
from triton_messages import triton_stubs  # noqa: E402

tpb, trpc = triton_stubs()
DATA_DIR = os.path.join(REPO_ROOT, "client", "perf_analyzer")
DEMO_DATA = os.path.join(DATA_DIR, "demo_64x256.json")
TIMEOUT = 60


def documented_commands():
    """(page, line) of every perf_analyzer command in README.md and docs/."""
    pages = [os.path.join(REPO_ROOT, "README.md")] + sorted(
        glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))
    found = []
    for page in pages:
        with open(page) as f:
            for line in f:
                if re.match(r"\s*perf_analyzer\s+-", line):
                    found.append((os.path.relpath(page, REPO_ROOT), line.strip()))
    return found


class PerfAnalyzerDataTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(DEMO_DATA) as f:
            cls.data = json.load(f)

    def test_file_is_what_the_generator_writes(self):
        made = subprocess.run(
            [sys.executable, os.path.join(DATA_DIR, "make_input_data.py"), "--lengths", "64",
             "--embed_dim", "256"], capture_output=True, text=True, check=True).stdout
        self.assertEqual(json.loads(made), self.data)
        bad = subprocess.run([sys.executable, os.path.join(DATA_DIR, "make_input_data.py"),
                              "--lengths", "0"], capture_output=True, text=True)
        self.assertEqual(bad.returncode, 2)
        self.assertIn("at least 1", bad.stderr)

    def test_demo_model_takes_the_file_as_perf_analyzer_sends_it(self):
        with TestServer(MHA_SERVER, os.path.join(REPO_ROOT, "models"), []) as server:
            triton = trpc.GRPCInferenceServiceStub(server.channel())
            config = triton.ModelConfig(tpb.ModelConfigRequest(name="demo"),
                                        timeout=TIMEOUT).config
            inputs = {i.name: i for i in config.input}
            self.assertGreater(config.max_batch_size, 0)  # -b 1 adds the batch dimension
            for entry in self.data["data"]:
                # perf_analyzer's rules: data for each input that is not
                # optional, none for inputs the model lacks, shapes that
                # fit the dims (-1: any).
                for name, declared in inputs.items():
                    self.assertTrue(declared.optional or name in entry, name)
                for name, given in entry.items():
                    self.assertIn(name, inputs)
                    dims = list(inputs[name].dims)
                    self.assertEqual(len(given["shape"]), len(dims))
                    for size, dim in zip(given["shape"], dims):
                        self.assertTrue(dim == -1 or dim == size, (name, given["shape"], dims))
                    self.assertEqual(len(given["content"]), int(np.prod(given["shape"])))
                query = np.asarray(entry["query"]["content"], dtype=np.float32).reshape(
                    [1] + entry["query"]["shape"])
                answer = outputs_of(triton.ModelInfer(infer_request("demo", query=query),
                                                      timeout=TIMEOUT))
                attend = server.stub().Attend(pb.AttendRequest(
                    model="demo", query=tensor(pb, cfg, query)), timeout=TIMEOUT)
                self.assertEqual(answer["output"].shape, query.shape)
                np.testing.assert_allclose(answer["output"], to_numpy(attend.output),
                                           rtol=1e-6, atol=1e-6)

    def test_documented_commands_name_the_file_and_no_shared_memory(self):
        commands = documented_commands()
        self.assertGreaterEqual(len(commands), 3)  # plain, --async, --streaming
        for page, line in commands:
            args = line.split()
            self.assertIn("-m demo", line, (page, line))
            self.assertIn("--input-data", args, (page, line))
            path = args[args.index("--input-data") + 1]
            self.assertTrue(os.path.isfile(os.path.join(REPO_ROOT, path)), (page, path))
            self.assertNotIn("--shared-memory", line, (page, line))
            self.assertNotIn("--shape", line, (page, line))


if __name__ == "__main__":
    unittest.main(verbosity=2)
