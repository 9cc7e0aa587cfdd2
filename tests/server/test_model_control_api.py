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

import importlib
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import grpc
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mha_test_server import REPO_ROOT, TestServer, load_stubs, tensor  # noqa: E402
from test_lifecycle import layer, write_version  # noqa: E402

MHA_SERVER = os.environ.get("MHA_SERVER", os.path.join(REPO_ROOT, "build", "mha_server"))
pb, rpc, cfg = load_stubs()

# Triton's definitions (grpc_service.proto, 2020-2023), the parts these RPCs use.
TRITON_PROTO = """
syntax = "proto3";
package inference;
service GRPCInferenceService {
  rpc ModelStatistics(ModelStatisticsRequest) returns (ModelStatisticsResponse) {}
  rpc RepositoryIndex(RepositoryIndexRequest) returns (RepositoryIndexResponse) {}
  rpc RepositoryModelLoad(RepositoryModelLoadRequest) returns (RepositoryModelLoadResponse) {}
  rpc RepositoryModelUnload(RepositoryModelUnloadRequest)
      returns (RepositoryModelUnloadResponse) {}
  rpc ModelReady(ModelReadyRequest) returns (ModelReadyResponse) {}
  rpc ModelMetadata(ModelMetadataRequest) returns (ModelMetadataResponse) {}
  rpc ModelConfig(ModelConfigRequest) returns (ModelConfigResponse) {}
}
message ModelReadyRequest { string name = 1; string version = 2; }
message ModelReadyResponse { bool ready = 1; }
message ModelMetadataRequest { string name = 1; string version = 2; }
message ModelMetadataResponse {
  message TensorMetadata { string name = 1; string datatype = 2; repeated int64 shape = 3; }
  string name = 1; repeated string versions = 2; string platform = 3;
  repeated TensorMetadata inputs = 4; repeated TensorMetadata outputs = 5;
}
message ModelConfigRequest { string name = 1; string version = 2; }
message ModelConfigResponse { ModelConfig config = 1; }
enum DataType {
  TYPE_INVALID = 0; TYPE_BOOL = 1; TYPE_UINT8 = 2; TYPE_UINT16 = 3; TYPE_UINT32 = 4;
  TYPE_UINT64 = 5; TYPE_INT8 = 6; TYPE_INT16 = 7; TYPE_INT32 = 8; TYPE_INT64 = 9;
  TYPE_FP16 = 10; TYPE_FP32 = 11; TYPE_FP64 = 12; TYPE_STRING = 13; TYPE_BF16 = 14;
}
message ModelInstanceGroup {
  enum Kind { KIND_AUTO = 0; KIND_GPU = 1; KIND_CPU = 2; KIND_MODEL = 3; }
  string name = 1; Kind kind = 4; int32 count = 2; repeated int32 gpus = 3;
  repeated string profile = 5; bool passive = 7; string host_policy = 9;
}
message ModelTensorReshape { repeated int64 shape = 1; }
message ModelInput {
  enum Format { FORMAT_NONE = 0; FORMAT_NHWC = 1; FORMAT_NCHW = 2; }
  string name = 1; DataType data_type = 2; Format format = 3; repeated int64 dims = 4;
  ModelTensorReshape reshape = 5; bool is_shape_tensor = 6; bool allow_ragged_batch = 7;
  bool optional = 8;
}
message ModelOutput {
  string name = 1; DataType data_type = 2; repeated int64 dims = 3;
  ModelTensorReshape reshape = 5; string label_filename = 4; bool is_shape_tensor = 6;
}
message ModelVersionPolicy {
  message Latest { uint32 num_versions = 1; }
  message All {}
  message Specific { repeated int64 versions = 1; }
  oneof policy_choice { Latest latest = 1; All all = 2; Specific specific = 3; }
}
message ModelDynamicBatching {
  repeated int32 preferred_batch_size = 1; uint64 max_queue_delay_microseconds = 2;
  bool preserve_ordering = 3; uint64 priority_levels = 4; uint64 default_priority_level = 5;
}
message ModelSequenceBatching { uint64 max_sequence_idle_microseconds = 1; }
message ModelParameter { string string_value = 1; }
message ModelConfig {
  string name = 1; string platform = 2; string backend = 17; string runtime = 25;
  ModelVersionPolicy version_policy = 3; int32 max_batch_size = 4;
  repeated ModelInput input = 5; repeated ModelOutput output = 6;
  oneof scheduling_choice {
    ModelDynamicBatching dynamic_batching = 11; ModelSequenceBatching sequence_batching = 13;
  }
  repeated ModelInstanceGroup instance_group = 7; string default_model_filename = 8;
  map<string, string> cc_model_filenames = 9; map<string, string> metric_tags = 10;
  map<string, ModelParameter> parameters = 14;
}
message ModelStatisticsRequest { string name = 1; string version = 2; }
message StatisticDuration { uint64 count = 1; uint64 ns = 2; }
message InferStatistics {
  StatisticDuration success = 1; StatisticDuration fail = 2; StatisticDuration queue = 3;
  StatisticDuration compute_input = 4; StatisticDuration compute_infer = 5;
  StatisticDuration compute_output = 6; StatisticDuration cache_hit = 7;
  StatisticDuration cache_miss = 8;
}
message InferBatchStatistics {
  uint64 batch_size = 1; StatisticDuration compute_input = 2;
  StatisticDuration compute_infer = 3; StatisticDuration compute_output = 4;
}
message MemoryUsage { string type = 1; int64 id = 2; uint64 byte_size = 3; }
message ModelStatistics {
  string name = 1; string version = 2; uint64 last_inference = 3; uint64 inference_count = 4;
  uint64 execution_count = 5; InferStatistics inference_stats = 6;
  repeated InferBatchStatistics batch_stats = 7; repeated MemoryUsage memory_usage = 8;
}
message ModelStatisticsResponse { repeated ModelStatistics model_stats = 1; }
message RepositoryIndexRequest { string repository_name = 1; bool ready = 2; }
message RepositoryIndexResponse {
  message ModelIndex { string name = 1; string version = 2; string state = 3; string reason = 4; }
  repeated ModelIndex models = 1;
}
message ModelRepositoryParameter {
  oneof parameter_choice {
    bool bool_param = 1; int64 int64_param = 2; string string_param = 3; bytes bytes_param = 4;
  }
}
message RepositoryModelLoadRequest {
  string repository_name = 1; string model_name = 2;
  map<string, ModelRepositoryParameter> parameters = 3;
}
message RepositoryModelLoadResponse {}
message RepositoryModelUnloadRequest {
  string repository_name = 1; string model_name = 2;
  map<string, ModelRepositoryParameter> parameters = 3;
}
message RepositoryModelUnloadResponse {}
"""


def triton_stubs():
    folder = tempfile.mkdtemp(prefix="mha_triton_stubs_")
    package = os.path.join(folder, "triton_client")
    os.makedirs(package)
    with open(os.path.join(package, "grpc_service.proto"), "w") as f:
        f.write(TRITON_PROTO)
    subprocess.run(["protoc", f"-I{folder}", f"--python_out={folder}", f"--grpc_out={folder}",
                    "--plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin",
                    os.path.join(package, "grpc_service.proto")], check=True)
    sys.path.insert(0, folder)
    return (importlib.import_module("triton_client.grpc_service_pb2"),
            importlib.import_module("triton_client.grpc_service_pb2_grpc"))


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
            request = tpb.RepositoryModelLoadRequest(model_name="a")
            request.parameters["config"].string_param = "{}"
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
