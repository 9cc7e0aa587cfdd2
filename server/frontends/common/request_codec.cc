#include "server/frontends/common/request_codec.h"

#include <cstring>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/status_macros.h"
#include "engine/wire_dtype.h"

namespace mha::server {
absl::StatusOr<TensorView> ViewTensor(const v1::Tensor& wire, const char* field,
                                      const ReceivedBytes* received) {
  const std::optional<DType> dtype = FromWireDType(wire.dtype());
  if (!dtype.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": dtype ",
        v1::DataType_IsValid(wire.dtype()) ? v1::DataType_Name(wire.dtype())
                                           : absl::StrCat(static_cast<int>(wire.dtype())),
        " is not one of DATA_TYPE_FP32, DATA_TYPE_BF16, DATA_TYPE_FP16, DATA_TYPE_BOOL"));
  }
  TensorView view{*dtype, std::vector<int64_t>(wire.shape().begin(), wire.shape().end()), {}, {}};
  if (received == nullptr) {
    view.bytes = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(wire.data().data()),
                                     wire.data().size());
  } else {
    ViewReceived(*received, view);
  }
  return view;
}

void ViewReceived(const ReceivedBytes& received, TensorView& view) {
  if (received.size() == 1) {
    view.bytes = received.front();
  } else {
    view.pieces = received;
  }
}

namespace {

absl::Status ViewIfPresent(bool present, const v1::Tensor& wire, const char* field,
                           const ReceivedBytes* received, std::optional<TensorView>& view) {
  if (!present) return absl::OkStatus();
  ASSIGN_OR_RETURN(view, ViewTensor(wire, field, received));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<AttentionRequest> DecodeAttendRequest(const v1::AttendRequest& request,
                                                     const AttentionDims& dims,
                                                     const RequestLimits& limits,
                                                     const AttendReceived& received) {
  if (!request.has_query()) return absl::InvalidArgumentError("query: required");
  RequestInputs in;
  ASSIGN_OR_RETURN(in.query, ViewTensor(request.query(), "query", received[0]));
  RETURN_IF_ERROR(ViewIfPresent(request.has_key(), request.key(), "key", received[1], in.key));
  RETURN_IF_ERROR(
      ViewIfPresent(request.has_value(), request.value(), "value", received[2], in.value));
  RETURN_IF_ERROR(ViewIfPresent(request.has_key_padding_mask(), request.key_padding_mask(),
                                "key_padding_mask", received[3], in.key_padding_mask));
  RETURN_IF_ERROR(ViewIfPresent(request.has_attn_mask(), request.attn_mask(), "attn_mask",
                                received[4], in.attn_mask));
  in.is_causal = request.is_causal();
  in.need_weights = request.need_weights();
  in.per_head_weights = request.per_head_weights();
  return AttentionRequest::Create(dims, in, limits.max_tokens, DTypeSpelling::kMhaV1);
}

void WriteBytes(absl::Span<const float> values, DType dtype, uint8_t* out) {
  if (dtype == DType::kF32) {
    std::memcpy(out, values.data(), values.size() * sizeof(float));
    return;
  }
  ConvertFromFloat(values.data(), static_cast<int64_t>(values.size()), dtype, out);
}

void EncodeBytes(absl::Span<const float> values, DType dtype, std::string& out) {
  if (dtype == DType::kF32) {  // one copy, no zero-fill
    out.assign(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
    return;
  }
  out.resize(values.size() * DTypeSize(dtype));
  ConvertFromFloat(values.data(), static_cast<int64_t>(values.size()), dtype,
                   reinterpret_cast<uint8_t*>(out.data()));
}

void EncodeTensor(absl::Span<const float> values, const std::vector<int64_t>& shape, DType dtype,
                  v1::Tensor* wire) {
  wire->set_dtype(ToWireDType(dtype));
  wire->mutable_shape()->Assign(shape.begin(), shape.end());
  EncodeBytes(values, dtype, *wire->mutable_data());
}

}  // namespace mha::server
