"""Triton's own message definitions, for tests that must read what a Triton
client reads: the messages of triton-inference-server/common's
protobuf/grpc_service.proto and model_config.proto as published (field
names and numbers unchanged), the parts our tests use, compiled into a
private package by protoc. Not our copy in proto/inference/.
"""

import functools
import importlib
import os
import subprocess
import sys
import tempfile

# Triton's definitions (grpc_service.proto, 2020-2023), the parts these tests use.
# ModelInfer's messages as of 2023 (InferParameter with double and uint64).
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
  rpc ServerLive(ServerLiveRequest) returns (ServerLiveResponse) {}
  rpc ModelInfer(ModelInferRequest) returns (ModelInferResponse) {}
  rpc ModelStreamInfer(stream ModelInferRequest) returns (stream ModelStreamInferResponse) {}
  rpc SystemSharedMemoryStatus(SystemSharedMemoryStatusRequest)
      returns (SystemSharedMemoryStatusResponse) {}
  rpc SystemSharedMemoryRegister(SystemSharedMemoryRegisterRequest)
      returns (SystemSharedMemoryRegisterResponse) {}
  rpc SystemSharedMemoryUnregister(SystemSharedMemoryUnregisterRequest)
      returns (SystemSharedMemoryUnregisterResponse) {}
  rpc CudaSharedMemoryStatus(CudaSharedMemoryStatusRequest)
      returns (CudaSharedMemoryStatusResponse) {}
  rpc CudaSharedMemoryRegister(CudaSharedMemoryRegisterRequest)
      returns (CudaSharedMemoryRegisterResponse) {}
  rpc CudaSharedMemoryUnregister(CudaSharedMemoryUnregisterRequest)
      returns (CudaSharedMemoryUnregisterResponse) {}
  rpc Trace(TraceRequest) returns (TraceResponse) {}
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
message InferParameter {
  oneof parameter_choice {
    bool bool_param = 1; int64 int64_param = 2; string string_param = 3;
    double double_param = 4; uint64 uint64_param = 5;
  }
}
message InferTensorContents {
  repeated bool bool_contents = 1; repeated int32 int_contents = 2;
  repeated int64 int64_contents = 3; repeated uint32 uint_contents = 4;
  repeated uint64 uint64_contents = 5; repeated float fp32_contents = 6;
  repeated double fp64_contents = 7; repeated bytes bytes_contents = 8;
}
message ModelInferRequest {
  message InferInputTensor {
    string name = 1; string datatype = 2; repeated int64 shape = 3;
    map<string, InferParameter> parameters = 4; InferTensorContents contents = 5;
  }
  message InferRequestedOutputTensor {
    string name = 1; map<string, InferParameter> parameters = 2;
  }
  string model_name = 1; string model_version = 2; string id = 3;
  map<string, InferParameter> parameters = 4;
  repeated InferInputTensor inputs = 5;
  repeated InferRequestedOutputTensor outputs = 6;
  repeated bytes raw_input_contents = 7;
}
message ModelInferResponse {
  message InferOutputTensor {
    string name = 1; string datatype = 2; repeated int64 shape = 3;
    map<string, InferParameter> parameters = 4; InferTensorContents contents = 5;
  }
  string model_name = 1; string model_version = 2; string id = 3;
  map<string, InferParameter> parameters = 4;
  repeated InferOutputTensor outputs = 5;
  repeated bytes raw_output_contents = 6;
}
message ServerLiveRequest {}
message ServerLiveResponse { bool live = 1; }
message SystemSharedMemoryStatusRequest { string name = 1; }
message SystemSharedMemoryStatusResponse {
  message RegionStatus { string name = 1; string key = 2; uint64 offset = 3; uint64 byte_size = 4; }
  map<string, RegionStatus> regions = 1;
}
message SystemSharedMemoryRegisterRequest {
  string name = 1; string key = 2; uint64 offset = 3; uint64 byte_size = 4;
}
message SystemSharedMemoryRegisterResponse {}
message SystemSharedMemoryUnregisterRequest { string name = 1; }
message SystemSharedMemoryUnregisterResponse {}
message CudaSharedMemoryStatusRequest { string name = 1; }
message CudaSharedMemoryStatusResponse {
  message RegionStatus { string name = 1; uint64 device_id = 2; uint64 byte_size = 3; }
  map<string, RegionStatus> regions = 1;
}
message CudaSharedMemoryRegisterRequest {
  string name = 1; bytes raw_handle = 2; int64 device_id = 3; uint64 byte_size = 4;
}
message CudaSharedMemoryRegisterResponse {}
message CudaSharedMemoryUnregisterRequest { string name = 1; }
message CudaSharedMemoryUnregisterResponse {}
message TraceRequest {
  message SettingValue { repeated string value = 3; }
  map<string, SettingValue> settings = 1; string model_name = 2; bool clear_setting = 3;
}
message TraceResponse {
  message SettingValue { repeated string value = 3; }
  map<string, SettingValue> settings = 1;
}
message ModelStreamInferResponse {
  string error_message = 1; ModelInferResponse infer_response = 2;
}
"""


@functools.cache
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




def triton_server_per_class():
    """A OneServerPerClass base on the demo and cross models whose tests
    call the server through Triton's stub, `cls.triton`."""
    from mha_test_server import OneServerPerClass
    from test_server import make_repository
    _, service = triton_stubs()

    class TritonServerPerClass(OneServerPerClass):
        @classmethod
        def make_repository(cls, folder):
            return make_repository(folder, ("demo", "cross"))

        @classmethod
        def setUpClass(cls):
            super().setUpClass()
            cls.triton = service.GRPCInferenceServiceStub(cls.channel)

    return TritonServerPerClass
