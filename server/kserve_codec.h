// Translation between the KServe v2 / Open Inference Protocol messages and
// mha.v1, so ModelInfer goes through exactly the checks, batcher and engine
// of Attend. No gRPC calls here: pure message conversion.
#ifndef MHA_SERVER_KSERVE_CODEC_H_
#define MHA_SERVER_KSERVE_CODEC_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model_config.h"
#include "inference/grpc_service.pb.h"
#include "mha/v1/attention.pb.h"
#include "server/attend_dispatch.h"

namespace mha::server {

// Output tensor names of ModelInfer.
inline constexpr char kOutputName[] = "output";
inline constexpr char kWeightsName[] = "attn_weights";
// The one model version every model has.
inline constexpr char kModelVersion[] = "1";

// A ModelInfer request as the Attend request it means, and the outputs to
// return, in order. Movable value type.
struct KserveCall {
  v1::AttendRequest attend;
  std::vector<std::string> outputs;
};

// Maps inputs by name (query, key, value, key_padding_mask, attn_mask;
// datatypes FP32, BF16, FP16, BOOL; raw_input_contents or typed contents),
// the bool parameters is_causal / need_weights / per_head_weights and the
// requested outputs. Shapes and sizes are checked later by
// DecodeAttendRequest, as for Attend. Errors are INVALID_ARGUMENT.
absl::StatusOr<KserveCall> KserveToAttend(const inference::ModelInferRequest& request);

// The response: the requested outputs, raw little-endian bytes.
void FillInferResponse(const inference::ModelInferRequest& request,
                       const std::vector<std::string>& outputs, const ResultLayout& layout,
                       const AttentionResult& result, inference::ModelInferResponse* response);

// Inputs and outputs of a model with these dimensions; -1 marks batch and
// sequence lengths.
void DescribeModel(const std::string& name, const AttentionDims& dims,
                   inference::ModelMetadataResponse* response);

}  // namespace mha::server

#endif  // MHA_SERVER_KSERVE_CODEC_H_
