#include "server/frontends/grpc/wire_responses.h"

#include <cstring>
#include <string>

#include "engine/wire_dtype.h"
#include "mha/v1/attention.pb.h"
#include "server/frontends/common/request_codec.h"

namespace mha::server {

void AppendWireTensor(int number, absl::Span<const float> values, const std::vector<int64_t>& shape,
                      DType dtype, const std::shared_ptr<const void>& owner,
                      wire::WireWriter& writer, const ConvertedOutput& converted) {
  v1::Tensor fields;
  fields.set_dtype(ToWireDType(dtype));
  fields.mutable_shape()->Assign(shape.begin(), shape.end());
  if (IsConvertedFrom(converted, values, dtype)) {
    writer.AppendMessageWithBytes(number, fields, 3, converted.bytes, converted.owner);
    return;
  }
  if (dtype == DType::kF32 && owner != nullptr) {
    writer.AppendMessageWithBytes(number, fields, 3,
                                  AsBytes(values.data(), values.size() * sizeof(float)), owner);
    return;
  }
  writer.AppendMessageWithBytes(number, fields, 3, values.size() * DTypeSize(dtype),
                                [&](uint8_t* out) { WriteBytes(values, dtype, out); });
}

void WriteAttendResponse(const std::string& model, int64_t version, const ResultLayout& layout,
                         const AttentionResult& result, wire::WireWriter& writer) {
  AppendWireTensor(1, result.output, layout.output_shape, layout.output_dtype, result.owner, writer,
                   result.converted);
  if (!layout.weights_shape.empty()) {
    AppendWireTensor(2, result.weights, layout.weights_shape, DType::kF32, result.owner, writer);
  }
  v1::AttendResponse rest;
  rest.set_model(model);
  rest.set_model_version(version);
  writer.Append(rest);
}

void WriteAppendResponse(const StepLayout& layout, const StepResult& result,
                         wire::WireWriter& writer) {
  AppendWireTensor(1, result.output, layout.output_shape, layout.output_dtype, nullptr, writer);
  if (layout.need_weights) {
    AppendWireTensor(3, result.weights, StepWeightsShape(layout, result.keys), DType::kF32, nullptr,
                     writer);
  }
  v1::AppendResponse rest;
  rest.set_position(result.position);
  writer.Append(rest);
}

void WriteInferResponse(const inference::ModelInferResponse& response,
                        const std::vector<DeferredOutput>& deferred, wire::WireWriter& writer) {
  inference::ModelInferResponse fields = response;
  fields.clear_raw_output_contents();
  writer.Append(fields);
  size_t next = 0;
  for (int i = 0; i < response.raw_output_contents_size(); ++i) {
    if (next < deferred.size() && deferred[next].raw_index == i) {
      const DeferredOutput& out = deferred[next++];
      if (IsConvertedFrom(out.converted, out.values, out.dtype)) {
        writer.AppendBytes(6, out.converted.bytes, out.converted.owner);
        continue;
      }
      if (out.dtype == DType::kF32 && out.owner != nullptr) {
        writer.AppendBytes(6, AsBytes(out.values.data(), out.values.size() * sizeof(float)),
                           out.owner);
        continue;
      }
      writer.AppendBytes(6, out.values.size() * DTypeSize(out.dtype),
                         [&](uint8_t* to) { WriteBytes(out.values, out.dtype, to); });
    } else {
      const std::string& raw = response.raw_output_contents(i);
      writer.AppendBytes(6, raw.size(),
                         [&](uint8_t* to) { std::memcpy(to, raw.data(), raw.size()); });
    }
  }
}

grpc::ByteBuffer AttendResponseBytes(const std::string& model, int64_t version,
                                     const ResultLayout& layout, const AttentionResult& result) {
  wire::WireWriter writer;
  WriteAttendResponse(model, version, layout, result, writer);
  return writer.Finish();
}

grpc::ByteBuffer AppendResponseBytes(const StepLayout& layout, const StepResult& result) {
  wire::WireWriter writer;
  WriteAppendResponse(layout, result, writer);
  return writer.Finish();
}

grpc::ByteBuffer MessageBytes(const google::protobuf::MessageLite& message) {
  const std::string serialized = message.SerializeAsString();
  grpc::Slice slice(serialized);
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace mha::server
