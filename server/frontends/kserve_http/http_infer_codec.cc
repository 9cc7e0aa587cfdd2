#include "server/frontends/kserve_http/http_infer_codec.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/status_macros.h"
#include "wire/wire_reader.h"

namespace mha::server {
namespace {

using nlohmann::json;

struct TooDeep {};

absl::Status Invalid(absl::string_view what, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", why));
}

// A JSON parameter value as KServe's InferParameter.
absl::Status ToParameter(const std::string& name, const json& value,
                         inference::InferParameter* out) {
  if (value.is_boolean()) {
    out->set_bool_param(value.get<bool>());
  } else if (value.is_number_unsigned()) {
    const uint64_t v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      out->set_uint64_param(v);
    } else {
      out->set_int64_param(static_cast<int64_t>(v));
    }
  } else if (value.is_number_integer()) {
    out->set_int64_param(value.get<int64_t>());
  } else if (value.is_number_float()) {
    out->set_double_param(value.get<double>());
  } else if (value.is_string()) {
    out->set_string_param(value.get<std::string>());
  } else {
    return Invalid(absl::StrCat("parameter \"", name, "\""),
                   "expected a bool, a number or a string");
  }
  return absl::OkStatus();
}

// Copies `parameters` (a JSON object, or null) into `out`, but for `skip`
// (the HTTP-only one), whose value goes to `skipped`.
absl::Status ReadParameters(const json* parameters, absl::string_view where, absl::string_view skip,
                            google::protobuf::Map<std::string, inference::InferParameter>* out,
                            const json** skipped) {
  if (parameters == nullptr || parameters->is_null()) return absl::OkStatus();
  if (!parameters->is_object()) return Invalid(where, "\"parameters\" must be an object");
  for (const auto& [name, value] : parameters->items()) {
    if (name == skip) {
      *skipped = &value;
      continue;
    }
    RETURN_IF_ERROR(ToParameter(name, value, &(*out)[name]));
  }
  return absl::OkStatus();
}

const json* Field(const json& object, const char* name) {
  auto it = object.find(name);
  return it == object.end() ? nullptr : &*it;
}

// Appends `data` (nested arrays or flat, row-major) as `datatype`'s bytes.
absl::Status AppendElements(const json& data, const std::string& datatype, const std::string& input,
                            std::string& out, int64_t& count) {
  if (data.is_array()) {
    for (const json& element : data) {
      RETURN_IF_ERROR(AppendElements(element, datatype, input, out, count));
    }
    return absl::OkStatus();
  }
  if (datatype == "FP32") {
    if (!data.is_number())
      return Invalid(absl::StrCat("input '", input, "'"), "FP32 data holds a non-number");
    const float v = data.get<float>();
    out.append(reinterpret_cast<const char*>(&v), sizeof(v));
  } else if (datatype == "BOOL") {
    if (!data.is_boolean())
      return Invalid(absl::StrCat("input '", input, "'"), "BOOL data holds a non-bool");
    out.push_back(data.get<bool>() ? 1 : 0);
  } else {
    return Invalid(
        absl::StrCat("input '", input, "'"),
        absl::StrCat("datatype ", datatype,
                     " is taken as JSON data only for FP32 and BOOL; BF16 and FP16 only as "
                     "binary data (Triton's binary tensor extension)"));
  }
  ++count;
  return absl::OkStatus();
}

absl::Status DecodeInput(const json& in, absl::string_view binary, size_t& binary_used,
                         HttpInferRequest& decoded) {
  if (!in.is_object()) return absl::InvalidArgumentError("inputs: each input must be an object");
  const json* name = Field(in, "name");
  const json* datatype = Field(in, "datatype");
  const json* shape = Field(in, "shape");
  if (name == nullptr || !name->is_string())
    return absl::InvalidArgumentError("an input has no \"name\" string");
  const std::string input_name = name->get<std::string>();
  const std::string where = absl::StrCat("input '", input_name, "'");
  if (datatype == nullptr || !datatype->is_string())
    return Invalid(where, "no \"datatype\" string");
  if (shape == nullptr || !shape->is_array()) return Invalid(where, "no \"shape\" array");
  inference::ModelInferRequest::InferInputTensor* tensor = decoded.message.add_inputs();
  tensor->set_name(input_name);
  tensor->set_datatype(datatype->get<std::string>());
  int64_t elements = 1;
  for (const json& dim : *shape) {
    if (!dim.is_number_integer() || dim.get<int64_t>() < 0) {
      return Invalid(where, "\"shape\" must hold non-negative integers");
    }
    tensor->add_shape(dim.get<int64_t>());
    elements = dim.get<int64_t>() == 0
                   ? 0
                   : std::min<int64_t>(elements * dim.get<int64_t>(), int64_t{1} << 40);
  }
  const json* binary_size = nullptr;
  RETURN_IF_ERROR(ReadParameters(Field(in, "parameters"), where, "binary_data_size",
                                 tensor->mutable_parameters(), &binary_size));
  const bool in_shared_memory = tensor->parameters().contains("shared_memory_region");
  const json* data = Field(in, "data");
  if (binary_size != nullptr) {
    if (!binary_size->is_number_unsigned())
      return Invalid(where, "binary_data_size must be a non-negative integer");
    const uint64_t bytes = binary_size->get<uint64_t>();
    if (bytes > binary.size() - binary_used) {
      return Invalid(where,
                     absl::StrCat("binary_data_size ", bytes, " runs past the end of the body (",
                                  binary.size() - binary_used, " bytes left)"));
    }
    decoded.message.add_raw_input_contents();  // left in the body
    decoded.in_body.push_back({absl::MakeConstSpan(
        reinterpret_cast<const uint8_t*>(binary.data()) + binary_used, bytes)});
    binary_used += bytes;
  } else if (data != nullptr) {
    decoded.in_body.emplace_back();
    std::string* raw = decoded.message.add_raw_input_contents();
    int64_t count = 0;
    RETURN_IF_ERROR(AppendElements(*data, tensor->datatype(), input_name, *raw, count));
    if (count != elements) {
      return Invalid(where, absl::StrCat("shape [", absl::StrJoin(tensor->shape(), ", "), "] has ",
                                         elements, " elements but \"data\" holds ", count));
    }
  } else if (!in_shared_memory) {
    return Invalid(where, "no data: give \"data\", binary_data_size or shared_memory_region");
  }
  return absl::OkStatus();
}

absl::Status DecodeOutputs(const json* outputs, HttpInferRequest& decoded) {
  if (outputs == nullptr) return absl::OkStatus();
  if (!outputs->is_array()) return absl::InvalidArgumentError("\"outputs\" must be an array");
  for (const json& out : *outputs) {
    const json* name = out.is_object() ? Field(out, "name") : nullptr;
    if (name == nullptr || !name->is_string())
      return absl::InvalidArgumentError("an output has no \"name\" string");
    auto* tensor = decoded.message.add_outputs();
    tensor->set_name(name->get<std::string>());
    const json* binary = nullptr;
    RETURN_IF_ERROR(ReadParameters(Field(out, "parameters"),
                                   absl::StrCat("output '", tensor->name(), "'"), "binary_data",
                                   tensor->mutable_parameters(), &binary));
    if (binary != nullptr && !binary->is_boolean()) {
      return Invalid(absl::StrCat("output '", tensor->name(), "'"), "binary_data must be a bool");
    }
    decoded.outputs.emplace_back(tensor->name(), binary == nullptr
                                                     ? std::nullopt
                                                     : std::optional<bool>(binary->get<bool>()));
  }
  return absl::OkStatus();
}

// Appends `raw` (FP32 or BOOL) as a JSON array's text: floats in their
// shortest form that reads back to the same float (std::to_chars), a
// non-finite one as null (JSON has none).
void AppendJsonData(absl::string_view raw, const std::string& datatype, std::string& out) {
  out.push_back('[');
  if (datatype == "FP32") {
    const size_t n = raw.size() / sizeof(float);
    out.reserve(out.size() + n * 12);
    char number[32];
    for (size_t i = 0; i < n; ++i) {
      float v;
      std::memcpy(&v, raw.data() + i * sizeof(float), sizeof(float));
      if (i > 0) out.push_back(',');
      if (!std::isfinite(v)) {
        out += "null";
        continue;
      }
      const std::to_chars_result r = std::to_chars(number, number + sizeof(number), v);
      out.append(number, r.ptr);
    }
  } else {  // BOOL
    for (size_t i = 0; i < raw.size(); ++i) {
      if (i > 0) out.push_back(',');
      out += raw[i] != 0 ? "true" : "false";
    }
  }
  out.push_back(']');
}

json ParameterToJson(const inference::InferParameter& p) {
  switch (p.parameter_choice_case()) {
    case inference::InferParameter::kBoolParam:
      return p.bool_param();
    case inference::InferParameter::kInt64Param:
      return p.int64_param();
    case inference::InferParameter::kUint64Param:
      return p.uint64_param();
    case inference::InferParameter::kDoubleParam:
      return p.double_param();
    case inference::InferParameter::kStringParam:
      return p.string_param();
    default:
      return nullptr;
  }
}

}  // namespace

absl::StatusOr<json> ParseJson(absl::string_view text, absl::string_view what) {
  try {
    return json::parse(text.begin(), text.end(), [](int depth, json::parse_event_t, json&) {
      if (depth > kMaxJsonDepth) throw TooDeep{};
      return true;
    });
  } catch (const TooDeep&) {
    return Invalid(what, absl::StrCat("JSON nested deeper than ", kMaxJsonDepth, " levels"));
  } catch (const json::exception& e) {
    return Invalid(what, absl::StrCat("not JSON: ", e.what()));
  }
}

void HttpInferRequest::Materialize() {
  for (size_t i = 0; i < in_body.size(); ++i) {
    wire::AppendPieces(in_body[i], *message.mutable_raw_input_contents(static_cast<int>(i)));
    in_body[i].clear();
  }
}

bool HttpInferRequest::Binary(const std::string& output_name) const {
  for (const auto& [name, binary] : outputs) {
    if (name == output_name) return binary.value_or(binary_by_default);
  }
  return binary_by_default;
}

namespace {

// Triton's raw form: the body is one FP32 query [1, L, E], L deduced from
// its length; the answer is binary.
absl::StatusOr<HttpInferRequest> DecodeRawInfer(absl::string_view body, const std::string& model,
                                                const std::string& version, int64_t width) {
  const size_t row_bytes = static_cast<size_t>(width) * sizeof(float);
  if (width <= 0 || body.empty() || body.size() % row_bytes != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a raw body (Inference-Header-Content-Length 0) is one FP32 query [1, L, E] with E = ",
        width, " of model '", model, "', so a multiple of ", row_bytes, " bytes; got ",
        body.size()));
  }
  HttpInferRequest decoded;
  decoded.message.set_model_name(model);
  decoded.message.set_model_version(version);
  auto* query = decoded.message.add_inputs();
  query->set_name("query");
  query->set_datatype("FP32");
  for (const int64_t d : {int64_t{1}, static_cast<int64_t>(body.size() / row_bytes), width}) {
    query->add_shape(d);
  }
  decoded.message.add_raw_input_contents();  // left in the body
  decoded.in_body.push_back(
      {absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(body.data()), body.size())});
  decoded.binary_by_default = true;
  return decoded;
}

}  // namespace

absl::StatusOr<HttpInferRequest> DecodeHttpInfer(absl::string_view body,
                                                 std::optional<size_t> header_length,
                                                 const std::string& model,
                                                 const std::string& version,
                                                 int64_t raw_query_width) {
  const size_t json_bytes = header_length.value_or(body.size());
  if (json_bytes > body.size()) {
    return absl::InvalidArgumentError(absl::StrCat("Inference-Header-Content-Length ", json_bytes,
                                                   " is larger than the body (", body.size(),
                                                   " bytes)"));
  }
  if (json_bytes == 0) return DecodeRawInfer(body, model, version, raw_query_width);
  ASSIGN_OR_RETURN(json header, ParseJson(body.substr(0, json_bytes), "request"));
  if (!header.is_object()) return absl::InvalidArgumentError("request: the JSON must be an object");
  HttpInferRequest decoded;
  decoded.message.set_model_name(model);
  decoded.message.set_model_version(version);
  if (const json* id = Field(header, "id"); id != nullptr) {
    if (!id->is_string()) return absl::InvalidArgumentError("request: \"id\" must be a string");
    decoded.message.set_id(id->get<std::string>());
  }
  const json* binary_output = nullptr;
  RETURN_IF_ERROR(ReadParameters(Field(header, "parameters"), "request", "binary_data_output",
                                 decoded.message.mutable_parameters(), &binary_output));
  if (binary_output != nullptr) {
    if (!binary_output->is_boolean())
      return absl::InvalidArgumentError("parameter binary_data_output must be a bool");
    decoded.binary_by_default = binary_output->get<bool>();
  }
  const json* inputs = Field(header, "inputs");
  if (inputs == nullptr || !inputs->is_array())
    return absl::InvalidArgumentError("request: no \"inputs\" array");
  const absl::string_view binary = body.substr(json_bytes);
  size_t binary_used = 0;
  for (const json& in : *inputs) RETURN_IF_ERROR(DecodeInput(in, binary, binary_used, decoded));
  if (binary_used != binary.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(binary.size(),
                     " bytes of binary data follow the JSON but the inputs' binary_data_size take ",
                     binary_used));
  }
  RETURN_IF_ERROR(DecodeOutputs(Field(header, "outputs"), decoded));
  return decoded;
}

absl::StatusOr<HttpInferBody> EncodeHttpInfer(inference::ModelInferResponse& response,
                                              const HttpInferRequest& request,
                                              absl::Span<const DeferredOutput> views) {
  auto view_of = [&](int raw_index) -> const DeferredOutput* {
    for (const DeferredOutput& v : views)
      if (v.raw_index == raw_index) return &v;
    return nullptr;
  };
  // What a view sends, and what keeps those bytes alive: the worker's
  // converted output, or the f32 values.
  auto sent_of = [](const DeferredOutput& view) {
    if (IsConvertedFrom(view.converted, view.values, view.dtype)) {
      return HttpBytes(absl::string_view(reinterpret_cast<const char*>(view.converted.bytes.data()),
                                         view.converted.bytes.size()),
                       view.converted.owner);
    }
    return HttpBytes(absl::string_view(reinterpret_cast<const char*>(view.values.data()),
                                       view.values.size() * sizeof(float)),
                     view.owner);
  };
  json out = {{"model_name", response.model_name()}, {"model_version", response.model_version()}};
  if (!response.id().empty()) out["id"] = response.id();
  if (!response.parameters().empty()) {
    json& parameters = out["parameters"];
    for (const auto& [name, p] : response.parameters()) parameters[name] = ParameterToJson(p);
  }
  // The outputs' text is written here: their data arrays go straight from
  // the raw bytes to text, not through a JSON value per element.
  std::string outputs = "[";
  std::vector<int> binary;  // the raw entries sent as binary, in order
  for (int i = 0; i < response.outputs_size(); ++i) {
    const auto& tensor = response.outputs(i);
    json entry = {{"name", tensor.name()},
                  {"datatype", tensor.datatype()},
                  {"shape", std::vector<int64_t>(tensor.shape().begin(), tensor.shape().end())}};
    json parameters = json::object();
    for (const auto& [name, p] : tensor.parameters()) parameters[name] = ParameterToJson(p);
    const DeferredOutput* view = view_of(i);
    const absl::string_view raw = view != nullptr ? sent_of(*view).view
                                  : i < response.raw_output_contents_size()
                                      ? absl::string_view(response.raw_output_contents(i))
                                      : absl::string_view();
    const bool in_shared_memory = tensor.parameters().contains("shared_memory_region");
    bool json_data = false;
    if (!in_shared_memory) {
      if (request.Binary(tensor.name())) {
        parameters["binary_data_size"] = raw.size();
        binary.push_back(i);
      } else if (tensor.datatype() == "FP32" || tensor.datatype() == "BOOL") {
        json_data = true;
      } else {
        return Invalid(
            absl::StrCat("output '", tensor.name(), "'"),
            absl::StrCat(
                tensor.datatype(),
                " goes only as binary data (ask for it with binary_data: true), as in Triton"));
      }
    }
    if (!parameters.empty()) entry["parameters"] = std::move(parameters);
    if (i > 0) outputs.push_back(',');
    outputs += entry.dump(-1, ' ', false, json::error_handler_t::replace);
    if (json_data) {
      outputs.pop_back();  // its closing brace
      outputs += ",\"data\":";
      AppendJsonData(raw, tensor.datatype(), outputs);
      outputs.push_back('}');
    }
  }
  outputs.push_back(']');
  HttpInferBody encoded;
  encoded.body = out.dump(-1, ' ', false, json::error_handler_t::replace);
  encoded.body.pop_back();  // its closing brace: the outputs follow
  encoded.body += ",\"outputs\":";
  encoded.body += outputs;
  encoded.body.push_back('}');
  if (!binary.empty() || request.binary_by_default ||
      std::any_of(request.outputs.begin(), request.outputs.end(),
                  [](const auto& o) { return o.second.value_or(false); })) {
    encoded.header_length = encoded.body.size();
    for (int i : binary) {
      const DeferredOutput* view = view_of(i);
      if (view != nullptr) {
        encoded.binary.push_back(sent_of(*view));
      } else {
        encoded.binary.emplace_back(std::move(*response.mutable_raw_output_contents(i)));
      }
    }
  }
  return encoded;
}

json MessageToJson(const google::protobuf::Message& message) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Descriptor* d = message.GetDescriptor();
  const google::protobuf::Reflection* r = message.GetReflection();
  auto scalar = [](const google::protobuf::Message& m, const FieldDescriptor* f,
                   int index) -> json {
    const google::protobuf::Reflection* r = m.GetReflection();
    const bool rep = index >= 0;
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32:
        return rep ? r->GetRepeatedInt32(m, f, index) : r->GetInt32(m, f);
      case FieldDescriptor::CPPTYPE_INT64:
        return rep ? r->GetRepeatedInt64(m, f, index) : r->GetInt64(m, f);
      case FieldDescriptor::CPPTYPE_UINT32:
        return rep ? r->GetRepeatedUInt32(m, f, index) : r->GetUInt32(m, f);
      case FieldDescriptor::CPPTYPE_UINT64:
        return rep ? r->GetRepeatedUInt64(m, f, index) : r->GetUInt64(m, f);
      case FieldDescriptor::CPPTYPE_DOUBLE:
        return rep ? r->GetRepeatedDouble(m, f, index) : r->GetDouble(m, f);
      case FieldDescriptor::CPPTYPE_FLOAT:
        return rep ? r->GetRepeatedFloat(m, f, index) : r->GetFloat(m, f);
      case FieldDescriptor::CPPTYPE_BOOL:
        return rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f);
      case FieldDescriptor::CPPTYPE_ENUM:
        return rep ? r->GetRepeatedEnum(m, f, index)->name() : r->GetEnum(m, f)->name();
      case FieldDescriptor::CPPTYPE_STRING:
        return rep ? r->GetRepeatedString(m, f, index) : r->GetString(m, f);
      case FieldDescriptor::CPPTYPE_MESSAGE:
        return MessageToJson(rep ? r->GetRepeatedMessage(m, f, index) : r->GetMessage(m, f));
    }
    return nullptr;
  };
  json out = json::object();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    if (f->real_containing_oneof() != nullptr && !r->HasField(message, f)) continue;
    if (f->is_map()) {
      json& map = out[f->name()] = json::object();
      for (int k = 0; k < r->FieldSize(message, f); ++k) {
        const google::protobuf::Message& entry = r->GetRepeatedMessage(message, f, k);
        const json key = scalar(entry, entry.GetDescriptor()->field(0), -1);
        map[key.is_string() ? key.get<std::string>() : key.dump()] =
            scalar(entry, entry.GetDescriptor()->field(1), -1);
      }
    } else if (f->is_repeated()) {
      json& list = out[f->name()] = json::array();
      for (int k = 0; k < r->FieldSize(message, f); ++k) list.push_back(scalar(message, f, k));
    } else {
      out[f->name()] = scalar(message, f, -1);
    }
  }
  return out;
}

}  // namespace mha::server
