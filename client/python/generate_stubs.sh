#!/bin/sh
# Generates the Python stubs of the mha.v1 API and of KServe v2 from proto/:
#   mha/v1/model_config_pb2.py, mha/v1/attention_pb2.py, mha/v1/attention_pb2_grpc.py,
#   inference/model_config_pb2.py, inference/grpc_service_pb2.py,
#   inference/grpc_service_pb2_grpc.py
# into client/python/gen/ (or OUT_DIR), where mha_client.py looks for them.
#
#   client/python/generate_stubs.sh [OUT_DIR]
#
# Needs Debian's protobuf-compiler (protoc) and protobuf-compiler-grpc
# (/usr/bin/grpc_python_plugin); the stubs need python3-grpcio and
# python3-protobuf at run time. mha_client.py runs this same script into a
# temporary folder when gen/ is missing or older than proto/.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
proto="$here/../../proto"
out="${1:-$here/gen}"
mkdir -p "$out"
protoc -I"$proto" --python_out="$out" --grpc_out="$out" \
  --plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin \
  "$proto/mha/v1/model_config.proto" "$proto/mha/v1/attention.proto" \
  "$proto/inference/model_config.proto" "$proto/inference/grpc_service.proto"
