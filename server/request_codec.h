// Conversion between the wire tensors of mha.v1 and the engine's tensors,
// with every check a hostile or careless client needs.
#ifndef MHA_SERVER_REQUEST_CODEC_H_
#define MHA_SERVER_REQUEST_CODEC_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/dense_batch.h"
#include "engine/model_config.h"
#include "engine/tensor.h"
#include "mha/v1/attention.pb.h"

namespace mha::server {

// Limits a single request may not exceed.
struct RequestLimits {
  int64_t max_tokens = int64_t{1} << 20;  // query + key rows
  int64_t max_message_bytes = int64_t{64} << 20;  // a response larger is never sent
};

// A decoded Attend request: validated engine inputs plus what the response
// needs. Movable value type.
struct DecodedRequest {
  explicit DecodedRequest(DenseBatch b) : batch(std::move(b)) {}

  DenseBatch batch;
  v1::DataType output_dtype = v1::DATA_TYPE_FP32;
  std::vector<int64_t> output_shape;
  std::vector<int64_t> weights_shape;  // empty unless need_weights
  bool need_weights = false;
  bool per_head_weights = false;
  int64_t tokens = 0;  // query rows + key rows
  int64_t bytes = 0;   // tensor bytes as sent (what the queue limit counts)
};

// One wire tensor as an engine tensor. `field` names it in errors, e.g.
// "query: data has 12 bytes, expected 2 x 3 x 4 bytes (FP32) = 24".
absl::StatusOr<Tensor> DecodeTensor(const v1::Tensor& wire, const char* field);

// Validates the whole request against the model's dimensions.
absl::StatusOr<DecodedRequest> DecodeAttendRequest(const v1::AttendRequest& request,
                                                   const AttentionDims& dims,
                                                   const RequestLimits& limits);

// f32 values as a wire tensor of `dtype` (FP32, BF16 or FP16).
void EncodeTensor(const float* values, const std::vector<int64_t>& shape,
                  v1::DataType dtype, v1::Tensor* wire);

}  // namespace mha::server

#endif  // MHA_SERVER_REQUEST_CODEC_H_
