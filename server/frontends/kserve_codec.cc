#include "server/frontends/kserve_codec.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/status_macros.h"

namespace mha::server {
namespace {

constexpr const char* kParameterNames[] = {"is_causal", "need_weights", "per_head_weights"};
// Triton's request parameters about the call rather than the attention.
constexpr char kTimeout[] = "timeout";
constexpr char kPriority[] = "priority";
constexpr char kEmptyFinalResponse[] = "triton_enable_empty_final_response";
constexpr char kKnownParameters[] =
    "known: is_causal, need_weights, per_head_weights (bool); timeout (int64, microseconds); "
    "priority (uint64, 1 is the highest level); triton_enable_empty_final_response (bool)";
constexpr const char* kInputNames[] = {"query", "key", "value", "key_padding_mask", "attn_mask"};

// Where each named input's view goes.
std::optional<TensorView>* InputSlot(const std::string& name, RequestInputs& in,
                                     std::optional<TensorView>& query) {
  if (name == "query") return &query;
  if (name == "key") return &in.key;
  if (name == "value") return &in.value;
  if (name == "key_padding_mask") return &in.key_padding_mask;
  if (name == "attn_mask") return &in.attn_mask;
  return nullptr;
}

absl::Span<const uint8_t> Bytes(const void* data, size_t size) {
  return absl::MakeConstSpan(static_cast<const uint8_t*>(data), size);
}

// Typed contents as bytes: fp32_contents for FP32 (viewed in place),
// bool_contents for BOOL (one byte each, made in `converted`). BF16 and
// FP16 have no typed field.
absl::StatusOr<absl::Span<const uint8_t>> ContentsBytes(
    const inference::InferTensorContents& contents, DType dtype, const std::string& input,
    std::deque<std::string>& converted) {
  const int other_fields = contents.int_contents_size() + contents.int64_contents_size() +
                           contents.uint_contents_size() + contents.uint64_contents_size() +
                           contents.fp64_contents_size() + contents.bytes_contents_size();
  if (dtype == DType::kF32 && contents.bool_contents_size() + other_fields == 0) {
    return Bytes(contents.fp32_contents().data(), contents.fp32_contents_size() * sizeof(float));
  }
  if (dtype == DType::kBool && contents.fp32_contents_size() + other_fields == 0) {
    std::string& bytes = converted.emplace_back(contents.bool_contents_size(), '\0');
    std::transform(contents.bool_contents().begin(), contents.bool_contents().end(),
                   bytes.begin(), [](bool b) { return static_cast<char>(b); });
    return Bytes(bytes.data(), bytes.size());
  }
  const char* name = DTypeName(dtype, DTypeSpelling::kKserve);
  if (dtype == DType::kBF16 || dtype == DType::kF16) {
    return absl::InvalidArgumentError(absl::StrCat(
        input, ": ", name, " has no typed contents field; send it in raw_input_contents"));
  }
  return absl::InvalidArgumentError(absl::StrCat(input, ": datatype ", name, " takes ",
                                                 dtype == DType::kF32 ? "fp32_contents"
                                                                      : "bool_contents",
                                                 " only"));
}

absl::Status ReadParameters(const inference::ModelInferRequest& request, RequestInputs& in) {
  for (const auto& [name, value] : request.parameters()) {
    if (name == kTimeout || name == kPriority || name == kEmptyFinalResponse) {
      continue;  // read by ReadCallParameters
    }
    if (std::find(std::begin(kParameterNames), std::end(kParameterNames), name) ==
        std::end(kParameterNames)) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown parameter \"", name, "\" (", kKnownParameters, ")"));
    }
    if (value.parameter_choice_case() != inference::InferParameter::kBoolParam) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", name, ": expected bool_param"));
    }
    if (name == "is_causal") in.is_causal = value.bool_param();
    if (name == "need_weights") in.need_weights = value.bool_param();
    if (name == "per_head_weights") in.per_head_weights = value.bool_param();
  }
  return absl::OkStatus();
}

// Requested outputs in order; none requested: output, and attn_weights when
// need_weights. Asking for attn_weights computes them whatever need_weights says.
absl::StatusOr<std::vector<std::string>> RequestedOutputs(
    const inference::ModelInferRequest& request, RequestInputs& in) {
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
    if (in.need_weights) outputs.push_back(kWeightsName);
  }
  in.need_weights = std::find(outputs.begin(), outputs.end(), kWeightsName) != outputs.end();
  return outputs;
}

// The inputs as views, in the slots their names give.
absl::Status ViewInputs(const inference::ModelInferRequest& request, RequestInputs& in,
                        std::deque<std::string>& converted) {
  const bool raw = request.raw_input_contents_size() > 0;
  if (raw && request.raw_input_contents_size() != request.inputs_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("raw_input_contents has ", request.raw_input_contents_size(),
                     " entries for ", request.inputs_size(), " inputs"));
  }
  std::optional<TensorView> query;
  for (int i = 0; i < request.inputs_size(); ++i) {
    const auto& input = request.inputs(i);
    std::optional<TensorView>* slot = InputSlot(input.name(), in, query);
    if (slot == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown input \"", input.name(), "\" (inputs: ", absl::StrJoin(kInputNames, ", "), ")"));
    }
    if (slot->has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("input ", input.name(), " given twice"));
    }
    const std::optional<DType> dtype = ParseDType(input.datatype(), DTypeSpelling::kKserve);
    if (!dtype.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(input.name(), ": datatype \"",
                                                     input.datatype(),
                                                     "\" is not one of FP32, BF16, FP16, BOOL"));
    }
    if (raw && input.has_contents()) {
      return absl::InvalidArgumentError(absl::StrCat(
          input.name(), ": contents and raw_input_contents both given; use one"));
    }
    TensorView view{*dtype, std::vector<int64_t>(input.shape().begin(), input.shape().end()), {}};
    if (raw) {
      const std::string& bytes = request.raw_input_contents(i);
      view.bytes = Bytes(bytes.data(), bytes.size());
    } else {
      ASSIGN_OR_RETURN(view.bytes, ContentsBytes(input.contents(), *dtype, input.name(), converted));
    }
    *slot = std::move(view);
  }
  if (!query.has_value()) return absl::InvalidArgumentError("input query is required");
  in.query = *std::move(query);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<AttentionRequest> DecodeInferRequest(const inference::ModelInferRequest& request,
                                                    const AttentionDims& dims,
                                                    const RequestLimits& limits,
                                                    std::vector<std::string>& outputs) {
  auto converted = std::make_shared<std::deque<std::string>>();
  RequestInputs in;
  RETURN_IF_ERROR(ViewInputs(request, in, *converted));
  RETURN_IF_ERROR(ReadParameters(request, in));
  ASSIGN_OR_RETURN(outputs, RequestedOutputs(request, in));
  ASSIGN_OR_RETURN(AttentionRequest decoded,
                   AttentionRequest::Create(dims, in, limits.max_tokens, DTypeSpelling::kKserve));
  if (!converted->empty()) decoded.KeepAlive(std::move(converted));
  return decoded;
}

absl::StatusOr<InferCallParameters> ReadCallParameters(
    const inference::ModelInferRequest& request) {
  InferCallParameters call;
  const auto& parameters = request.parameters();
  if (auto it = parameters.find(kTimeout); it != parameters.end()) {
    const inference::InferParameter& p = it->second;
    int64_t us = 0;
    if (p.parameter_choice_case() == inference::InferParameter::kInt64Param) {
      us = p.int64_param();
    } else if (p.parameter_choice_case() == inference::InferParameter::kUint64Param &&
               p.uint64_param() <= static_cast<uint64_t>(INT64_MAX)) {
      us = static_cast<int64_t>(p.uint64_param());
    } else {
      return absl::InvalidArgumentError(
          "parameter timeout: expected int64_param, in microseconds");
    }
    if (us < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter timeout: ", us, " microseconds; expected 0 (none) or more"));
    }
    if (us > 0) call.timeout = absl::Microseconds(us);
  }
  if (auto it = parameters.find(kPriority); it != parameters.end()) {
    const inference::InferParameter& p = it->second;
    if (p.parameter_choice_case() == inference::InferParameter::kUint64Param) {
      call.priority = p.uint64_param();
    } else if (p.parameter_choice_case() == inference::InferParameter::kInt64Param &&
               p.int64_param() >= 0) {
      call.priority = static_cast<uint64_t>(p.int64_param());
    } else {
      return absl::InvalidArgumentError(
          "parameter priority: expected uint64_param (1 is the highest level; 0: the model's "
          "default)");
    }
  }
  if (auto it = parameters.find(kEmptyFinalResponse); it != parameters.end()) {
    if (it->second.parameter_choice_case() != inference::InferParameter::kBoolParam) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", kEmptyFinalResponse, ": expected bool_param"));
    }
    call.final_response_flag = it->second.bool_param();
  }
  return call;
}

absl::StatusOr<int64_t> ParseModelVersion(const std::string& model, const std::string& version) {
  if (version.empty()) return 0;
  int64_t number = 0;
  if (version.find_first_not_of("0123456789") != std::string::npos ||
      !absl::SimpleAtoi(version, &number) || number < 1) {
    return absl::NotFoundError(absl::StrCat("model '", model, "' has no version \"", version,
                                            "\": versions are positive numbers"));
  }
  return number;
}

void FillInferResponse(const inference::ModelInferRequest& request, int64_t version,
                       const std::vector<std::string>& outputs, const ResultLayout& layout,
                       const AttentionResult& result, inference::ModelInferResponse* response) {
  response->set_model_name(request.model_name());
  response->set_model_version(absl::StrCat(version));
  response->set_id(request.id());
  for (const std::string& name : outputs) {
    const bool is_output = name == kOutputName;
    const DType dtype = is_output ? layout.output_dtype : DType::kF32;
    const std::vector<int64_t>& shape = is_output ? layout.output_shape : layout.weights_shape;
    inference::ModelInferResponse::InferOutputTensor* tensor = response->add_outputs();
    tensor->set_name(name);
    tensor->set_datatype(DTypeName(dtype, DTypeSpelling::kKserve));
    tensor->mutable_shape()->Assign(shape.begin(), shape.end());
    EncodeBytes(is_output ? result.output : result.weights, dtype,
                *response->add_raw_output_contents());
  }
}

void DescribeModel(const std::string& name, const AttentionDims& dims,
                   const std::vector<int64_t>& versions,
                   inference::ModelMetadataResponse* response) {
  response->set_name(name);
  for (const int64_t v : versions) response->add_versions(absl::StrCat(v));
  response->set_platform("mha_onednn");
  const char* fp32 = DTypeName(DType::kF32, DTypeSpelling::kKserve);
  const char* boolean = DTypeName(DType::kBool, DTypeSpelling::kKserve);
  auto add = [](auto* list, const char* tensor, const char* datatype,
                std::vector<int64_t> shape) {
    auto* meta = list->Add();
    meta->set_name(tensor);
    meta->set_datatype(datatype);
    meta->mutable_shape()->Assign(shape.begin(), shape.end());
  };
  add(response->mutable_inputs(), "query", fp32, {-1, -1, dims.embed_dim});
  add(response->mutable_inputs(), "key", fp32, {-1, -1, dims.kdim});
  add(response->mutable_inputs(), "value", fp32, {-1, -1, dims.vdim});
  add(response->mutable_inputs(), "key_padding_mask", boolean, {-1, -1});
  add(response->mutable_inputs(), "attn_mask", boolean, {-1, -1});
  add(response->mutable_outputs(), kOutputName, fp32, {-1, -1, dims.embed_dim});
  add(response->mutable_outputs(), kWeightsName, fp32, {-1, -1, -1});
}

}  // namespace mha::server
