#include "server/kserve_codec.h"

#include <algorithm>
#include <cstring>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"

namespace mha::server {
namespace {

constexpr const char* kParameterNames[] = {"is_causal", "need_weights", "per_head_weights"};

absl::StatusOr<v1::DataType> WireDType(const std::string& datatype, const std::string& input) {
  if (datatype == "FP32") return v1::DATA_TYPE_FP32;
  if (datatype == "BF16") return v1::DATA_TYPE_BF16;
  if (datatype == "FP16") return v1::DATA_TYPE_FP16;
  if (datatype == "BOOL") return v1::DATA_TYPE_BOOL;
  return absl::InvalidArgumentError(absl::StrCat(input, ": datatype \"", datatype,
                                                 "\" is not one of FP32, BF16, FP16, BOOL"));
}

const char* DatatypeName(v1::DataType dtype) {
  switch (dtype) {
    case v1::DATA_TYPE_BF16:
      return "BF16";
    case v1::DATA_TYPE_FP16:
      return "FP16";
    case v1::DATA_TYPE_BOOL:
      return "BOOL";
    default:
      return "FP32";
  }
}

// The v1 tensor field an input name stands for, or null.
v1::Tensor* TensorField(const std::string& name, v1::AttendRequest& attend) {
  if (name == "query") return attend.mutable_query();
  if (name == "key") return attend.mutable_key();
  if (name == "value") return attend.mutable_value();
  if (name == "key_padding_mask") return attend.mutable_key_padding_mask();
  if (name == "attn_mask") return attend.mutable_attn_mask();
  return nullptr;
}

// Typed contents as little-endian bytes: fp32_contents for FP32,
// bool_contents for BOOL (one byte each). BF16 and FP16 have no typed field.
absl::StatusOr<std::string> ContentsBytes(const inference::InferTensorContents& contents,
                                          v1::DataType dtype, const std::string& input) {
  const int other_fields = contents.int_contents_size() + contents.int64_contents_size() +
                           contents.uint_contents_size() + contents.uint64_contents_size() +
                           contents.fp64_contents_size() + contents.bytes_contents_size();
  if (dtype == v1::DATA_TYPE_FP32 && contents.bool_contents_size() + other_fields == 0) {
    return std::string(reinterpret_cast<const char*>(contents.fp32_contents().data()),
                       contents.fp32_contents_size() * sizeof(float));
  }
  if (dtype == v1::DATA_TYPE_BOOL && contents.fp32_contents_size() + other_fields == 0) {
    std::string bytes(contents.bool_contents_size(), '\0');
    std::transform(contents.bool_contents().begin(), contents.bool_contents().end(),
                   bytes.begin(), [](bool b) { return static_cast<char>(b); });
    return bytes;
  }
  if (dtype == v1::DATA_TYPE_BF16 || dtype == v1::DATA_TYPE_FP16) {
    return absl::InvalidArgumentError(
        absl::StrCat(input, ": ", DatatypeName(dtype),
                     " has no typed contents field; send it in raw_input_contents"));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      input, ": datatype ", DatatypeName(dtype), " takes ",
      dtype == v1::DATA_TYPE_FP32 ? "fp32_contents" : "bool_contents", " only"));
}

absl::Status ReadParameters(const inference::ModelInferRequest& request,
                            v1::AttendRequest& attend) {
  for (const auto& [name, value] : request.parameters()) {
    if (std::find(std::begin(kParameterNames), std::end(kParameterNames), name) ==
        std::end(kParameterNames)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown parameter \"", name, "\" (known: is_causal, need_weights, per_head_weights)"));
    }
    if (value.parameter_choice_case() != inference::InferParameter::kBoolParam) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", name, ": expected bool_param"));
    }
    if (name == "is_causal") attend.set_is_causal(value.bool_param());
    if (name == "need_weights") attend.set_need_weights(value.bool_param());
    if (name == "per_head_weights") attend.set_per_head_weights(value.bool_param());
  }
  return absl::OkStatus();
}

// Requested outputs in order; none requested: output, and attn_weights when
// need_weights. Asking for attn_weights computes them whatever need_weights says.
absl::StatusOr<std::vector<std::string>> RequestedOutputs(
    const inference::ModelInferRequest& request, v1::AttendRequest& attend) {
  std::vector<std::string> outputs;
  for (const auto& requested : request.outputs()) {
    const std::string& name = requested.name();
    if (name != kOutputName && name != kWeightsName) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown output \"", name, "\" (outputs: output, attn_weights)"));
    }
    if (std::find(outputs.begin(), outputs.end(), name) != outputs.end()) {
      return absl::InvalidArgumentError(absl::StrCat("output ", name, " requested twice"));
    }
    if (!requested.parameters().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("output ", name, ": output parameters are not supported"));
    }
    outputs.push_back(name);
  }
  if (outputs.empty()) {
    outputs.push_back(kOutputName);
    if (attend.need_weights()) outputs.push_back(kWeightsName);
  }
  attend.set_need_weights(std::find(outputs.begin(), outputs.end(), kWeightsName) !=
                          outputs.end());
  return outputs;
}

}  // namespace

absl::StatusOr<KserveCall> KserveToAttend(const inference::ModelInferRequest& request) {
  KserveCall call;
  const bool raw = request.raw_input_contents_size() > 0;
  if (raw && request.raw_input_contents_size() != request.inputs_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("raw_input_contents has ", request.raw_input_contents_size(),
                     " entries for ", request.inputs_size(), " inputs"));
  }
  for (int i = 0; i < request.inputs_size(); ++i) {
    const auto& input = request.inputs(i);
    v1::Tensor* field = TensorField(input.name(), call.attend);
    if (field == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown input \"", input.name(),
          "\" (inputs: query, key, value, key_padding_mask, attn_mask)"));
    }
    if (field->dtype() != v1::DATA_TYPE_UNSPECIFIED) {
      return absl::InvalidArgumentError(absl::StrCat("input ", input.name(), " given twice"));
    }
    absl::StatusOr<v1::DataType> dtype = WireDType(input.datatype(), input.name());
    if (!dtype.ok()) return dtype.status();
    field->set_dtype(*dtype);
    field->mutable_shape()->Assign(input.shape().begin(), input.shape().end());
    if (raw && input.has_contents()) {
      return absl::InvalidArgumentError(absl::StrCat(
          input.name(), ": contents and raw_input_contents both given; use one"));
    }
    if (raw) {
      field->set_data(request.raw_input_contents(i));
    } else {
      absl::StatusOr<std::string> bytes = ContentsBytes(input.contents(), *dtype, input.name());
      if (!bytes.ok()) return bytes.status();
      field->set_data(*std::move(bytes));
    }
  }
  if (!call.attend.has_query()) return absl::InvalidArgumentError("input query is required");
  if (absl::Status s = ReadParameters(request, call.attend); !s.ok()) return s;
  absl::StatusOr<std::vector<std::string>> outputs = RequestedOutputs(request, call.attend);
  if (!outputs.ok()) return outputs.status();
  call.outputs = *std::move(outputs);
  return call;
}

void FillInferResponse(const inference::ModelInferRequest& request,
                       const std::vector<std::string>& outputs, const ResultLayout& layout,
                       const AttentionResult& result, inference::ModelInferResponse* response) {
  response->set_model_name(request.model_name());
  response->set_model_version(kModelVersion);
  response->set_id(request.id());
  for (const std::string& name : outputs) {
    const bool is_output = name == kOutputName;
    v1::Tensor wire;
    EncodeTensor(is_output ? result.output.data() : result.weights.data(),
                 is_output ? layout.output_shape : layout.weights_shape,
                 is_output ? layout.output_dtype : v1::DATA_TYPE_FP32, &wire);
    inference::ModelInferResponse::InferOutputTensor* tensor = response->add_outputs();
    tensor->set_name(name);
    tensor->set_datatype(DatatypeName(wire.dtype()));
    tensor->mutable_shape()->Assign(wire.shape().begin(), wire.shape().end());
    *response->add_raw_output_contents() = std::move(*wire.mutable_data());
  }
}

void DescribeModel(const std::string& name, const AttentionDims& dims,
                   inference::ModelMetadataResponse* response) {
  response->set_name(name);
  response->mutable_versions()->Add(std::string(kModelVersion));
  response->set_platform("mha_onednn");
  auto add = [](auto* list, const char* tensor, const char* datatype,
                std::vector<int64_t> shape) {
    auto* meta = list->Add();
    meta->set_name(tensor);
    meta->set_datatype(datatype);
    meta->mutable_shape()->Assign(shape.begin(), shape.end());
  };
  add(response->mutable_inputs(), "query", "FP32", {-1, -1, dims.embed_dim});
  add(response->mutable_inputs(), "key", "FP32", {-1, -1, dims.kdim});
  add(response->mutable_inputs(), "value", "FP32", {-1, -1, dims.vdim});
  add(response->mutable_inputs(), "key_padding_mask", "BOOL", {-1, -1});
  add(response->mutable_inputs(), "attn_mask", "BOOL", {-1, -1});
  add(response->mutable_outputs(), kOutputName, "FP32", {-1, -1, dims.embed_dim});
  add(response->mutable_outputs(), kWeightsName, "FP32", {-1, -1, -1});
}

}  // namespace mha::server
