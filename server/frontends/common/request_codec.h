// mha.v1's wire tensors to the engine's request, and results back to wire
// tensors, with every check a hostile or careless client needs.
#ifndef MHA_SERVER_FRONTENDS_REQUEST_CODEC_H_
#define MHA_SERVER_FRONTENDS_REQUEST_CODEC_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/attention_request.h"
#include "engine/model_config.h"
#include "engine/tensor.h"
#include "mha/v1/attention.pb.h"

namespace mha::server {

// Limits a single request may not exceed.
struct RequestLimits {
  int64_t max_tokens = int64_t{1} << 20;          // query + key rows
  int64_t max_message_bytes = int64_t{64} << 20;  // a response larger is never sent
};

// Bytes as they were received, in pieces of gRPC's buffers (proto/wire/wire_reader.h).
using ReceivedBytes = std::vector<absl::Span<const uint8_t>>;

// A wire tensor as a view of its bytes (`wire` must outlive it), or of
// `received` when its data arrived apart from the message (they must
// outlive it then); an unknown dtype is INVALID_ARGUMENT naming `field`.
absl::StatusOr<TensorView> ViewTensor(const v1::Tensor& wire, const char* field,
                                      const ReceivedBytes* received = nullptr);

// `received` as `view`'s bytes: one piece in place, several as pieces.
void ViewReceived(const ReceivedBytes& received, TensorView& view);

// Where the data of AttendRequest's tensors arrived when the message was
// read around them: query, key, value, key_padding_mask, attn_mask (fields
// 2 to 6); null: in the tensor's own `data`.
using AttendReceived = std::array<const ReceivedBytes*, 5>;

// The request's tensors as views of its bytes (`request` must outlive the
// result), checked against the model's dimensions. Errors name the field
// and spell dtypes as mha.v1 does, e.g. "query: dtype DATA_TYPE_BOOL,
// expected DATA_TYPE_FP32, DATA_TYPE_BF16 or DATA_TYPE_FP16".
absl::StatusOr<AttentionRequest> DecodeAttendRequest(const v1::AttendRequest& request,
                                                     const AttentionDims& dims,
                                                     const RequestLimits& limits,
                                                     const AttendReceived& received = {});

// f32 values as little-endian bytes of `dtype` (F32, BF16 or F16) at `out`
// (values.size() * DTypeSize(dtype) bytes).
void WriteBytes(absl::Span<const float> values, DType dtype, uint8_t* out);
// f32 values as little-endian bytes of `dtype` (F32, BF16 or F16) in `out`.
void EncodeBytes(absl::Span<const float> values, DType dtype, std::string& out);
// f32 values as a wire tensor of `dtype` (F32, BF16 or F16).
void EncodeTensor(absl::Span<const float> values, const std::vector<int64_t>& shape, DType dtype,
                  v1::Tensor* wire);

}  // namespace mha::server

#endif  // MHA_SERVER_FRONTENDS_REQUEST_CODEC_H_
