#!/usr/bin/python3
"""Models sent over the API (issue 36): Triton's RepositoryModelLoad with the
parameters `config` (JSON) and `file:<path>` (bytes), as tritonclient's
load_model(name, config=..., files=...) sends them, through Triton's own
message definitions, against a real mha_server.

    MHA_SERVER=build/mha_server /usr/bin/python3 tests/server/test_model_upload.py

Checked: a model uploaded into an explicit-mode server answers as PyTorch
and leaves nothing in the upload folder; `config` alone reloads the
repository folder with that config; paths that would escape, files without
a config, bad JSON and other modes are refused and nothing is written.
"""

import glob
import os
import shutil
import sys
import tempfile
import unittest

import grpc
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mha_test_server import TestServer  # noqa: E402
from mha_export import export  # noqa: E402
from test_lifecycle import E, HEADS, MHA_SERVER, layer, write_version  # noqa: E402
from triton_messages import triton_stubs  # noqa: E402

tpb, trpc = triton_stubs()
TIMEOUT = 60
Q = np.random.default_rng(0).standard_normal((2, 5, E)).astype(np.float32)


def load_request(name, config=None, files=None):
    request = tpb.RepositoryModelLoadRequest(model_name=name)
    if config is not None:
        request.parameters["config"].string_param = config
    for path, data in (files or {}).items():
        request.parameters["file:" + path].bytes_param = data
    return request


def weights_of(module):
    with tempfile.TemporaryDirectory() as out:
        export(module, out)
        with open(os.path.join(out, "weights.safetensors"), "rb") as f:
            return f.read()


class ModelUploadTest(unittest.TestCase):
    def setUp(self):
        self.repo = tempfile.mkdtemp(prefix="mha_upload_repo_")
        self.uploads = tempfile.mkdtemp(prefix="mha_upload_dir_")
        write_version(os.path.join(self.repo, "a"), 1, layer(1))
        write_version(os.path.join(self.repo, "a"), 2, layer(2))

    def tearDown(self):
        shutil.rmtree(self.repo, ignore_errors=True)
        shutil.rmtree(self.uploads, ignore_errors=True)

    def server(self, mode="explicit"):
        return TestServer(MHA_SERVER, self.repo, [f"--model_control_mode={mode}",
                                                  "--load_model=a",
                                                  f"--upload_dir={self.uploads}"])

    def infer(self, triton, model, version=""):
        request = tpb.ModelInferRequest(model_name=model, model_version=version)
        request.inputs.add(name="query", datatype="FP32", shape=Q.shape)
        request.raw_input_contents.append(Q.tobytes())
        response = triton.ModelInfer(request, timeout=TIMEOUT)
        return np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(Q.shape)

    def uploaded(self):
        """What the running servers hold in --upload_dir, beside their own
        areas (mha-uploads-XXXXXX, with its lock file): [] when nothing."""
        found = []
        for area in os.listdir(self.uploads):
            inside = os.listdir(os.path.join(self.uploads, area))
            found += [f"{area}/{name}" for name in inside if name != "lock"]
        return found

    def refused(self, call, request, code=grpc.StatusCode.INVALID_ARGUMENT):
        with self.assertRaises(grpc.RpcError) as e:
            call(request, timeout=TIMEOUT)
        self.assertEqual(e.exception.code(), code, e.exception.details())
        return e.exception.details()

    def test_an_uploaded_model_answers_as_pytorch_and_leaves_nothing_behind(self):
        module = layer(7)
        config = f'{{"embed_dim": {E}, "num_heads": {HEADS}}}'
        with self.server() as s:
            triton = trpc.GRPCInferenceServiceStub(s.channel())
            triton.RepositoryModelLoad(load_request(
                "up", config, {"3/weights.safetensors": weights_of(module)}), timeout=TIMEOUT)
            self.assertEqual(self.uploaded(), [], "the private folder is removed")
            self.assertTrue(triton.ModelReady(tpb.ModelReadyRequest(name="up", version="3"),
                                              timeout=TIMEOUT).ready)
            with torch.no_grad():
                want, _ = module(*[torch.from_numpy(Q)] * 3)
            np.testing.assert_allclose(self.infer(triton, "up", "3"), want.numpy(),
                                       rtol=1e-5, atol=1e-5)
            # The same name again, new weights as version 1 beside the config.
            other = layer(8)
            triton.RepositoryModelLoad(load_request(
                "up", config, {"weights.safetensors": weights_of(other)}), timeout=TIMEOUT)
            with torch.no_grad():
                want, _ = other(*[torch.from_numpy(Q)] * 3)
            np.testing.assert_allclose(self.infer(triton, "up"), want.numpy(),
                                       rtol=1e-5, atol=1e-5)
            self.assertFalse(triton.ModelReady(tpb.ModelReadyRequest(name="up", version="3"),
                                               timeout=TIMEOUT).ready)
            unload = tpb.RepositoryModelUnloadRequest(model_name="up")
            unload.parameters["unload_dependents"].bool_param = False
            triton.RepositoryModelUnload(unload, timeout=TIMEOUT)
            self.assertFalse(triton.ModelReady(tpb.ModelReadyRequest(name="up"),
                                               timeout=TIMEOUT).ready)
        self.assertEqual(os.listdir(self.uploads), [])

    def test_config_alone_reloads_the_repository_folder_with_it(self):
        with self.server() as s:
            triton = trpc.GRPCInferenceServiceStub(s.channel())
            ready = triton.ModelMetadata(tpb.ModelMetadataRequest(name="a"), timeout=TIMEOUT)
            self.assertEqual(list(ready.versions), ["2"])  # the default policy: the newest
            triton.RepositoryModelLoad(load_request(
                "a", f'{{"embed_dim": {E}, "num_heads": {HEADS}, '
                     '"version_policy": {"all": {}}}'), timeout=TIMEOUT)
            meta = triton.ModelMetadata(tpb.ModelMetadataRequest(name="a"), timeout=TIMEOUT)
            self.assertEqual(sorted(meta.versions), ["1", "2"])
            with torch.no_grad():
                want, _ = layer(1)(*[torch.from_numpy(Q)] * 3)
            np.testing.assert_allclose(self.infer(triton, "a", "1"), want.numpy(),
                                       rtol=1e-5, atol=1e-5)
            # A load without parameters goes back to config.pbtxt.
            triton.RepositoryModelLoad(load_request("a"), timeout=TIMEOUT)
            meta = triton.ModelMetadata(tpb.ModelMetadataRequest(name="a"), timeout=TIMEOUT)
            self.assertEqual(list(meta.versions), ["2"])

    def test_escaping_paths_and_bad_parameters_are_refused_and_nothing_is_written(self):
        config = f'{{"embed_dim": {E}, "num_heads": {HEADS}}}'
        data = weights_of(layer(9))
        outside = os.path.join(os.path.dirname(self.uploads), "escaped.safetensors")
        with self.server() as s:
            triton = trpc.GRPCInferenceServiceStub(s.channel())
            load = triton.RepositoryModelLoad
            for path in ("../escaped.safetensors", "/tmp/escaped.safetensors",
                         "1/../../escaped.safetensors", "config.pbtxt", "01/weights.safetensors",
                         "1/2/weights.safetensors", "1/weights.safetensors/", ""):
                details = self.refused(load, load_request(
                    "evil", config, {"weights.safetensors": data, path: data}))
                self.assertIn("nothing else", details, path)
            self.assertIn("need a config", self.refused(load, load_request(
                "evil", None, {"weights.safetensors": data})))
            self.assertIn("JSON", self.refused(load, load_request("evil", "{not json")))
            self.assertIn("JSON", self.refused(load, load_request("evil", '{"no_such": 1}')))
            bad = load_request("evil")
            bad.parameters["file:weights.safetensors"].string_param = "text"
            self.assertIn("bytes_param", self.refused(load, bad))
            # A config that does not make a model: the load fails, and says why.
            self.assertIn("embed_dim", self.refused(load, load_request(
                "evil", '{"num_heads": 3}', {"weights.safetensors": data}),
                grpc.StatusCode.FAILED_PRECONDITION))
            self.assertEqual(self.uploaded(), [])
            self.assertFalse(os.path.exists(outside))
            index = triton.RepositoryIndex(tpb.RepositoryIndexRequest(ready=True),
                                           timeout=TIMEOUT)
            self.assertEqual([m.name for m in index.models], ["a"])

    def test_what_a_killed_server_was_loading_is_removed_at_the_next_start(self):
        """Issue 64: SIGKILL while an uploaded model loads leaves its files;
        the next server removes that dead server's area, and nothing else."""
        config = '{"embed_dim": 1024, "num_heads": 8}'
        data = weights_of(layer(5, embed_dim=1024))  # 16 MiB: a load of some length
        foreign = [os.path.join(self.uploads, "mha-upload-abc123"),  # another naming
                   os.path.join(self.uploads, "someone-else")]
        for path in foreign:
            os.makedirs(path)
        with self.server() as beside:  # a live server's area stays
            beside_area = [a for a in os.listdir(self.uploads) if a.startswith("mha-uploads-")]
            dead_area = None
            for _ in range(10):  # until the kill lands during a load
                killed = self.server()
                killed.start()
                triton = trpc.GRPCInferenceServiceStub(killed.channel())
                load = triton.RepositoryModelLoad.future(load_request(
                    "big", config, {"weights.safetensors": data}), timeout=TIMEOUT)
                while not load.done():
                    weights = glob.glob(os.path.join(
                        self.uploads, "mha-uploads-*", "upload-*", "weights.safetensors"))
                    if weights:
                        killed.process.kill()
                        dead_area = os.path.dirname(os.path.dirname(weights[0]))
                        break
                killed.process.wait()
                killed.stop()
                killed.remove_log()
                if dead_area is not None and os.path.exists(dead_area):
                    break
                dead_area = None
            self.assertIsNotNone(dead_area, "no kill landed during a load in 10 tries")
            self.assertTrue(glob.glob(os.path.join(dead_area, "upload-*", "*")), "left behind")
            with self.server() as after:
                self.assertFalse(os.path.exists(dead_area))
                self.assertIn(f"removed {dead_area}, the upload folder of a server", after.stderr())
                for path in foreign + [os.path.join(self.uploads, a) for a in beside_area]:
                    self.assertTrue(os.path.exists(path), path)
        for path in foreign:
            os.rmdir(path)
        self.assertEqual(os.listdir(self.uploads), [], "every live server removed its own")

    def test_only_explicit_mode_takes_a_models_config_or_files(self):
        with self.server(mode="poll") as s:
            triton = trpc.GRPCInferenceServiceStub(s.channel())
            details = self.refused(triton.RepositoryModelLoad, load_request(
                "a", f'{{"embed_dim": {E}, "num_heads": {HEADS}}}'),
                grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("explicit", details)


if __name__ == "__main__":
    unittest.main()
