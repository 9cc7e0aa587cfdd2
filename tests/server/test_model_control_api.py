#!/usr/bin/python3
"""Model control and statistics over the API, against a real mha_server:

* Triton's model_repository and statistics extensions, ModelReady,
  ModelMetadata and ModelConfig through a client generated from Triton's own
  message definitions (TRITON_PROTO below: the messages of
  triton-inference-server/common protobuf/grpc_service.proto and
  model_config.proto as published, field names and numbers unchanged,
  memory_usage and cache fields included), not from our copy in
  proto/inference/, so that a Triton client reads what we send:
  RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload,
  ModelStatistics, ModelReady, ModelMetadata, ModelConfig;
* mha.v1 GetModelStatistics: counts and times that follow the requests made.

  MHA_SERVER=build/mha_server /usr/bin/python3 tests/server/test_model_control_api.py
"""

import os
import shutil
import sys
import tempfile
import unittest

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mha_test_server import MHA_SERVER, TestServer, load_stubs, tensor  # noqa: E402
from test_lifecycle import layer, write_version  # noqa: E402
from triton_messages import triton_stubs  # noqa: E402

pb, rpc, cfg = load_stubs()

tpb, trpc = triton_stubs()
Q = np.random.default_rng(0).standard_normal((2, 5, 32)).astype(np.float32)  # B = 2


class ModelControlApiTest(unittest.TestCase):
    def setUp(self):
        self.repo = tempfile.mkdtemp(prefix="mha_control_api_")
        write_version(os.path.join(self.repo, "a"), 1, layer(1))
        write_version(os.path.join(self.repo, "a"), 2, layer(2))
        write_version(os.path.join(self.repo, "b"), 1, layer(3))

    def tearDown(self):
        shutil.rmtree(self.repo, ignore_errors=True)

    def index(self, triton, ready=False):
        response = triton.RepositoryIndex(tpb.RepositoryIndexRequest(ready=ready), timeout=30)
        return sorted((m.name, m.version, m.state) for m in response.models)

    def test_triton_repository_rpcs(self):
        with TestServer(MHA_SERVER, self.repo, ["--model_control_mode=explicit",
                                                "--load_model=a"]) as s:
            triton = trpc.GRPCInferenceServiceStub(s.channel())
            self.assertEqual(self.index(triton), [("a", "2", "READY"), ("b", "", "UNAVAILABLE")])
            self.assertEqual(self.index(triton, ready=True), [("a", "2", "READY")])
            triton.RepositoryModelLoad(tpb.RepositoryModelLoadRequest(model_name="b"), timeout=60)
            self.assertEqual(self.index(triton, ready=True), [("a", "2", "READY"),
                                                              ("b", "1", "READY")])
            s.stub().Attend(pb.AttendRequest(model="b", query=tensor(pb, cfg, Q)), timeout=30)
            # tritonclient's unload_model() always sends unload_dependents.
            unload = tpb.RepositoryModelUnloadRequest(model_name="a")
            unload.parameters["unload_dependents"].bool_param = False
            triton.RepositoryModelUnload(unload, timeout=60)
            self.assertEqual(self.index(triton), [("a", "", "UNAVAILABLE"), ("b", "1", "READY")])
            unload = tpb.RepositoryModelUnloadRequest(model_name="b")
            unload.parameters["unload_everything"].bool_param = True
            with self.assertRaises(grpc.RpcError) as e:
                triton.RepositoryModelUnload(unload, timeout=60)
            self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
            self.assertIn("unload_dependents", e.exception.details())
            with self.assertRaises(grpc.RpcError) as e:
                s.stub().Attend(pb.AttendRequest(model="a", query=tensor(pb, cfg, Q)), timeout=30)
            self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
            with self.assertRaises(grpc.RpcError) as e:
                triton.RepositoryModelLoad(tpb.RepositoryModelLoadRequest(model_name="nosuch"),
                                           timeout=60)
            self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
            # A config sent with the load replaces config.pbtxt (test_model_upload.py);
            # one that makes no model fails to load, and says why.
            request = tpb.RepositoryModelLoadRequest(model_name="b")
            request.parameters["config"].string_param = "{}"
            with self.assertRaises(grpc.RpcError) as e:
                triton.RepositoryModelLoad(request, timeout=60)
            self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)
            self.assertIn("embed_dim", e.exception.details())
            request.parameters["mode"].string_param = "fast"
            with self.assertRaises(grpc.RpcError) as e:
                triton.RepositoryModelLoad(request, timeout=60)
            self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)

    def test_model_ready_metadata_and_config_as_triton_reads_them(self):
        with TestServer(MHA_SERVER, self.repo, ["--model_control_mode=explicit",
                                                "--load_model=a"]) as s:
            triton = trpc.GRPCInferenceServiceStub(s.channel())
            ready = lambda name, version="": triton.ModelReady(  # noqa: E731
                tpb.ModelReadyRequest(name=name, version=version), timeout=30).ready
            self.assertTrue(ready("a"))
            self.assertFalse(ready("b"))  # in the repository, not loaded
            self.assertFalse(ready("nope"))
            self.assertFalse(ready("a", "1"))  # not served by a's policy (newest only)
            config = triton.ModelConfig(tpb.ModelConfigRequest(name="a"), timeout=30).config
            self.assertEqual((config.name, config.platform, config.backend),
                             ("a", "mha_onednn", "mha_onednn"))
            self.assertEqual(config.WhichOneof("scheduling_choice"), "dynamic_batching")
            self.assertEqual(config.dynamic_batching.max_queue_delay_microseconds, 0)
            self.assertEqual(config.version_policy.WhichOneof("policy_choice"), "latest")
            self.assertEqual(config.version_policy.latest.num_versions, 1)
            self.assertGreater(config.max_batch_size, 0)
            self.assertEqual([(g.kind, g.count) for g in config.instance_group],
                             [(tpb.ModelInstanceGroup.KIND_CPU, 1)])
            fp32, boolean = tpb.TYPE_FP32, tpb.TYPE_BOOL
            self.assertEqual(
                [(i.name, i.data_type, list(i.dims), i.optional) for i in config.input],
                [("query", fp32, [-1, 32], False), ("key", fp32, [-1, 32], True),
                 ("value", fp32, [-1, 32], True), ("key_padding_mask", boolean, [-1], True),
                 ("attn_mask", boolean, [-1], True)])
            self.assertTrue(all(i.allow_ragged_batch for i in config.input))
            self.assertEqual([(o.name, o.data_type, list(o.dims)) for o in config.output],
                             [("output", fp32, [-1, 32]), ("attn_weights", fp32, [-1, -1])])
            self.assertEqual(config.parameters["embed_dim"].string_value, "32")
            self.assertEqual(config.parameters["num_heads"].string_value, "4")
            # With max_batch_size > 0, Triton's metadata shape is [-1] + dims.
            meta = triton.ModelMetadata(tpb.ModelMetadataRequest(name="a"), timeout=30)
            datatype = {fp32: "FP32", boolean: "BOOL"}
            for declared, described in ((config.input, meta.inputs),
                                        (config.output, meta.outputs)):
                self.assertEqual([(t.name, datatype[t.data_type], [-1] + list(t.dims))
                                  for t in declared],
                                 [(t.name, t.datatype, list(t.shape)) for t in described])
            for name, version in (("b", ""), ("nope", ""), ("a", "1")):
                with self.assertRaises(grpc.RpcError) as e:
                    triton.ModelConfig(tpb.ModelConfigRequest(name=name, version=version),
                                       timeout=30)
                self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND, name)
                self.assertTrue(e.exception.details())

    def test_repository_rpcs_refused_in_mode_none(self):
        with TestServer(MHA_SERVER, self.repo, []) as s:
            triton = trpc.GRPCInferenceServiceStub(s.channel())
            with self.assertRaises(grpc.RpcError) as e:
                triton.RepositoryIndex(tpb.RepositoryIndexRequest(), timeout=30)
            self.assertEqual(e.exception.code(), grpc.StatusCode.FAILED_PRECONDITION)

    def test_statistics_follow_the_requests(self):
        with TestServer(MHA_SERVER, self.repo, ["--model_control_mode=explicit",
                                                "--load_model=a,b"]) as s:
            stub = s.stub()
            for version in (1, 2, 2):  # a's policy serves only 2: version 1 is refused
                try:
                    stub.Attend(pb.AttendRequest(model="a", query=tensor(pb, cfg, Q),
                                                 model_version=version), timeout=30)
                except grpc.RpcError as e:
                    self.assertEqual(e.code(), grpc.StatusCode.NOT_FOUND)
            triton = trpc.GRPCInferenceServiceStub(s.channel())
            stats = triton.ModelStatistics(tpb.ModelStatisticsRequest(name="a"), timeout=30)
            self.assertEqual([(m.name, m.version) for m in stats.model_stats], [("a", "2")])
            a = stats.model_stats[0]
            self.assertEqual(a.inference_count, 4)  # two requests of B = 2
            self.assertEqual(a.execution_count, 2)  # sequential: one per engine call
            self.assertEqual(a.inference_stats.success.count, 2)
            self.assertGreater(a.inference_stats.success.ns, 0)
            self.assertEqual(a.inference_stats.queue.count, 2)
            self.assertEqual(a.inference_stats.compute_infer.count, 2)
            self.assertGreater(a.inference_stats.compute_infer.ns, 0)
            self.assertLessEqual(a.inference_stats.compute_infer.ns, a.inference_stats.success.ns)
            # Triton's batch_size is the execution's batch in inference_count's
            # unit (rows of B): each call here held one request of B = 2.
            self.assertEqual([(b.batch_size, b.compute_infer.count) for b in a.batch_stats],
                             [(2, 2)])
            self.assertEqual(sum(b.batch_size * b.compute_infer.count for b in a.batch_stats),
                             a.inference_count)
            self.assertGreater(a.last_inference, 1_700_000_000_000)  # Unix ms
            every = triton.ModelStatistics(tpb.ModelStatisticsRequest(), timeout=30)
            self.assertEqual(sorted((m.name, m.version) for m in every.model_stats),
                             [("a", "2"), ("b", "1")])
            ours = stub.GetModelStatistics(pb.GetModelStatisticsRequest(name="a", version=2))
            self.assertEqual(len(ours.models), 1)
            self.assertEqual(ours.models[0].inference_count, 4)
            self.assertEqual(ours.models[0].execution_count, 2)
            self.assertEqual(ours.models[0].compute_infer.ns, a.inference_stats.compute_infer.ns)
            self.assertEqual([(b.requests, b.compute_infer.count) for b in ours.models[0].batches],
                             [(1, 2)])  # mha.v1 counts requests per call
            with self.assertRaises(grpc.RpcError) as e:
                stub.GetModelStatistics(pb.GetModelStatisticsRequest(name="a", version=1))
            self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)


if __name__ == "__main__":
    unittest.main(verbosity=2)
