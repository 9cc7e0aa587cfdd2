#include "server/request_codec.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/status_macros.h"

namespace mha::server {
namespace {

absl::StatusOr<DType> EngineDType(v1::DataType dtype, const char* field) {
  switch (dtype) {
    case v1::DATA_TYPE_FP32:
      return DType::kF32;
    case v1::DATA_TYPE_BF16:
      return DType::kBF16;
    case v1::DATA_TYPE_FP16:
      return DType::kF16;
    case v1::DATA_TYPE_BOOL:
      return DType::kBool;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": dtype ", v1::DataType_IsValid(dtype) ? v1::DataType_Name(dtype)
                                                         : absl::StrCat(static_cast<int>(dtype)),
          absl::EndsWith(field, "mask") ? " is not one of DATA_TYPE_BOOL, DATA_TYPE_FP32"
                                        : " is not one of DATA_TYPE_FP32, DATA_TYPE_BF16, "
                                          "DATA_TYPE_FP16"));
  }
}

// Uint16 halves of f32 values (bf16: truncation with rounding; fp16: IEEE).
uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const int32_t exponent = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  uint32_t mantissa = x & 0x7fffffu;
  if (((x >> 23) & 0xff) == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (mantissa ? 0x200u : 0));
  if (exponent >= 31) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow: inf
  if (exponent <= 0) {                                                // subnormal or zero
    if (exponent < -10) return static_cast<uint16_t>(sign);
    mantissa |= 0x800000u;
    const int shift = 14 - exponent;
    uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rest > mid || (rest == mid && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = (static_cast<uint32_t>(exponent) << 10) | (mantissa >> 13);
  const uint32_t rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;  // may carry into exponent
  return static_cast<uint16_t>(sign | half);
}

// NaN or Inf in query/key/value would come back as NaN outputs: reject.
// Float masks may hold -inf (masked out) but not NaN or +inf.
absl::Status CheckFinite(const Tensor& t, const char* field, bool allow_neg_inf = false) {
  const int64_t n = t.num_elements();
  for (int64_t i = 0; i < n; ++i) {
    float value;
    if (t.dtype() == DType::kF32) {
      value = t.f32()[i];
    } else {
      uint16_t half;
      std::memcpy(&half, t.raw() + 2 * i, 2);
      value = t.dtype() == DType::kBF16 ? Bf16ToFloat(half) : HalfToFloat(half);
    }
    if (!std::isfinite(value) && !(allow_neg_inf && value < 0 && std::isinf(value))) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, ": element ", i, " is ", value,
          allow_neg_inf ? ", expected a finite number or -inf" : ", expected a finite number"));
    }
  }
  return absl::OkStatus();
}

// Decodes an optional field; absent (no dtype, shape or data) gives nullopt.
absl::StatusOr<std::optional<Tensor>> DecodeOptional(bool present, const v1::Tensor& wire,
                                                     const char* field, bool is_mask) {
  if (!present) return std::optional<Tensor>();
  ASSIGN_OR_RETURN(Tensor t, DecodeTensor(wire, field));
  if (t.dtype() != DType::kBool) RETURN_IF_ERROR(CheckFinite(t, field, is_mask));
  return std::optional<Tensor>(std::move(t));
}

}  // namespace

absl::StatusOr<Tensor> DecodeTensor(const v1::Tensor& wire, const char* field) {
  ASSIGN_OR_RETURN(DType dtype, EngineDType(wire.dtype(), field));
  std::vector<int64_t> shape(wire.shape().begin(), wire.shape().end());
  if (shape.empty() || shape.size() > 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": expected 1 to 4 dimensions, got shape ", ShapeString(shape)));
  }
  const absl::StatusOr<int64_t> count = NumElements(shape);
  if (!count.ok()) return absl::InvalidArgumentError(absl::StrCat(field, ": ", count.status().message()));
  const uint64_t elem = DTypeSize(dtype);
  if (static_cast<uint64_t>(*count) > wire.data().size() / elem ||
      static_cast<uint64_t>(*count) * elem != wire.data().size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": data has ", wire.data().size(), " bytes, expected ",
        absl::StrJoin(shape, " x "), " x ", elem, " bytes (", v1::DataType_Name(wire.dtype()),
        ")"));
  }
  Tensor t(dtype, std::move(shape));
  if (t.num_bytes() > 0) std::memcpy(t.raw(), wire.data().data(), t.num_bytes());
  return t;
}

absl::StatusOr<DecodedRequest> DecodeAttendRequest(const v1::AttendRequest& request,
                                                   const AttentionDims& dims,
                                                   const RequestLimits& limits) {
  if (!request.has_query()) return absl::InvalidArgumentError("query: required");
  DenseInputs in;
  ASSIGN_OR_RETURN(in.query, DecodeTensor(request.query(), "query"));
  if (in.query.dtype() == DType::kBool) {
    return absl::InvalidArgumentError("query: dtype DATA_TYPE_BOOL, expected FP32, BF16 or FP16");
  }
  RETURN_IF_ERROR(CheckFinite(in.query, "query"));
  ASSIGN_OR_RETURN(in.key, DecodeOptional(request.has_key(), request.key(), "key", false));
  ASSIGN_OR_RETURN(in.value, DecodeOptional(request.has_value(), request.value(), "value", false));
  ASSIGN_OR_RETURN(in.key_padding_mask,
                   DecodeOptional(request.has_key_padding_mask(), request.key_padding_mask(),
                                  "key_padding_mask", true));
  ASSIGN_OR_RETURN(in.attn_mask, DecodeOptional(request.has_attn_mask(), request.attn_mask(),
                                                "attn_mask", true));
  for (const auto* mask : {&in.key_padding_mask, &in.attn_mask}) {
    if (mask->has_value() && (*mask)->dtype() != DType::kBool && (*mask)->dtype() != DType::kF32) {
      return absl::InvalidArgumentError(absl::StrCat(
          mask == &in.attn_mask ? "attn_mask" : "key_padding_mask", ": dtype ",
          DTypeName((*mask)->dtype()), ", expected DATA_TYPE_BOOL or DATA_TYPE_FP32"));
    }
  }
  in.is_causal = request.is_causal();
  const int64_t q_tokens = in.query.num_elements() / dims.embed_dim;
  const int64_t kv_tokens = in.key.has_value() ? in.key->num_elements() / dims.kdim : q_tokens;

  ASSIGN_OR_RETURN(DenseBatch batch, DenseBatch::Create(dims, std::move(in)));
  DecodedRequest d(std::move(batch));
  d.tokens = q_tokens + kv_tokens;
  if (d.tokens > limits.max_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request has ", d.tokens, " query + key tokens, the limit is ", limits.max_tokens));
  }
  for (const v1::Tensor* t : {&request.query(), &request.key(), &request.value(),
                              &request.key_padding_mask(), &request.attn_mask()}) {
    d.bytes += static_cast<int64_t>(t->data().size());
  }
  d.output_dtype = request.query().dtype();
  d.output_shape = d.batch.OutputShape();
  d.need_weights = request.need_weights();
  d.per_head_weights = request.per_head_weights();
  if (d.need_weights) d.weights_shape = d.batch.WeightsShape(d.per_head_weights);
  return d;
}

void EncodeTensor(const float* values, const std::vector<int64_t>& shape, v1::DataType dtype,
                  v1::Tensor* wire) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  wire->set_dtype(dtype);
  wire->mutable_shape()->Assign(shape.begin(), shape.end());
  std::string* data = wire->mutable_data();
  if (dtype == v1::DATA_TYPE_FP32) {
    data->assign(reinterpret_cast<const char*>(values), n * sizeof(float));
    return;
  }
  data->resize(n * 2);
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t h = dtype == v1::DATA_TYPE_BF16 ? FloatToBf16(values[i]) : FloatToHalf(values[i]);
    std::memcpy(data->data() + 2 * i, &h, 2);
  }
}

}  // namespace mha::server
