#include "server/frontends/common/kserve_codec.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/status_macros.h"
#include "engine/too_large.h"

namespace mha::server {
namespace {

constexpr const char* kParameterNames[] = {"is_causal", "need_weights", "per_head_weights"};
// Triton's request parameters about the call rather than the attention.
constexpr char kTimeout[] = "timeout";
constexpr char kPriority[] = "priority";
constexpr char kEmptyFinalResponse[] = "triton_enable_empty_final_response";
constexpr char kSequenceId[] = "sequence_id";
constexpr char kSequenceStart[] = "sequence_start";
constexpr char kSequenceEnd[] = "sequence_end";
constexpr const char* kCallParameterNames[] = {kTimeout,    kPriority,      kEmptyFinalResponse,
                                               kSequenceId, kSequenceStart, kSequenceEnd};
constexpr char kKnownParameters[] =
    "known: is_causal, need_weights, per_head_weights (bool); timeout (int64, microseconds); "
    "priority (uint64, 1 is the highest level); triton_enable_empty_final_response (bool); "
    "sequence_id (int64 or string), sequence_start, sequence_end (bool)";
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
    return AsBytes(contents.fp32_contents().data(), contents.fp32_contents_size() * sizeof(float));
  }
  if (dtype == DType::kBool && contents.fp32_contents_size() + other_fields == 0) {
    std::string& bytes = converted.emplace_back(contents.bool_contents_size(), '\0');
    std::transform(contents.bool_contents().begin(), contents.bool_contents().end(), bytes.begin(),
                   [](bool b) { return static_cast<char>(b); });
    return AsBytes(bytes.data(), bytes.size());
  }
  const char* name = DTypeName(dtype, DTypeSpelling::kKserve);
  if (dtype == DType::kBF16 || dtype == DType::kF16) {
    return absl::InvalidArgumentError(absl::StrCat(
        input, ": ", name, " has no typed contents field; send it in raw_input_contents"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(input, ": datatype ", name, " takes ",
                   dtype == DType::kF32 ? "fp32_contents" : "bool_contents", " only"));
}

// An input's or output's shared-memory slice (Triton's parameters), or none
// when it names no region. Any other tensor parameter is refused.
absl::StatusOr<std::optional<SharedMemorySlice>> SharedMemoryOf(
    const google::protobuf::Map<std::string, inference::InferParameter>& parameters,
    const SharedMemoryRegistry* registry, const std::string& what) {
  auto number = [&](const char* name, uint64_t& out) -> absl::Status {
    auto it = parameters.find(name);
    if (it == parameters.end()) return absl::OkStatus();
    const inference::InferParameter& p = it->second;
    if (p.parameter_choice_case() == inference::InferParameter::kInt64Param &&
        p.int64_param() >= 0) {
      out = static_cast<uint64_t>(p.int64_param());
    } else if (p.parameter_choice_case() == inference::InferParameter::kUint64Param) {
      out = p.uint64_param();
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": parameter ", name, ": expected a non-negative int64_param"));
    }
    return absl::OkStatus();
  };
  for (const auto& [name, value] : parameters) {
    if (name != kShmRegion && name != kShmByteSize && name != kShmOffset) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": unknown parameter \"", name,
                                                     "\" (tensors take ", kShmRegion, ", ",
                                                     kShmByteSize, ", ", kShmOffset, ")"));
    }
  }
  auto region = parameters.find(kShmRegion);
  if (region == parameters.end()) {
    if (!parameters.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": ", kShmByteSize, " and ", kShmOffset, " need a ", kShmRegion));
    }
    return std::nullopt;
  }
  if (region->second.parameter_choice_case() != inference::InferParameter::kStringParam) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": parameter ", kShmRegion, ": expected string_param"));
  }
  if (parameters.find(kShmByteSize) == parameters.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", kShmRegion, " needs ", kShmByteSize));
  }
  uint64_t byte_size = 0, offset = 0;
  RETURN_IF_ERROR(number(kShmByteSize, byte_size));
  RETURN_IF_ERROR(number(kShmOffset, offset));
  if (registry == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": shared memory is not served here"));
  }
  ASSIGN_OR_RETURN(SharedMemorySlice slice,
                   registry->Slice(region->second.string_param(), offset, byte_size, what));
  return slice;
}

// A shared-memory input's bytes, read into `converted`: exactly its shape's
// bytes, at most `max_bytes`.
absl::StatusOr<absl::Span<const uint8_t>> ReadSharedInput(const SharedMemorySlice& slice,
                                                          const TensorView& view,
                                                          const std::string& input,
                                                          int64_t max_bytes,
                                                          std::deque<std::string>& converted) {
  uint64_t expected = DTypeSize(view.dtype);
  for (const int64_t d : view.shape) {
    const uint64_t limit = static_cast<uint64_t>(max_bytes);
    if (d < 0 || (d > 0 && expected > limit / static_cast<uint64_t>(d))) {
      expected = UINT64_MAX;
      break;
    }
    expected *= static_cast<uint64_t>(d);
  }
  if (expected > static_cast<uint64_t>(max_bytes)) {
    return TooLargeError(absl::StrCat(input, ": a shared-memory input is bounded like a message, ",
                                      max_bytes, " bytes"));
  }
  if (slice.byte_size != expected) {
    return absl::InvalidArgumentError(absl::StrCat(input, ": ", kShmByteSize, " ", slice.byte_size,
                                                   " is not the ", expected,
                                                   " bytes its shape and datatype take"));
  }
  std::string& bytes = converted.emplace_back(expected, '\0');
  RETURN_IF_ERROR(
      slice.Read(absl::MakeSpan(reinterpret_cast<uint8_t*>(bytes.data()), bytes.size())));
  return AsBytes(bytes.data(), bytes.size());
}

absl::Status ReadParameters(const inference::ModelInferRequest& request, RequestInputs& in) {
  for (const auto& [name, value] : request.parameters()) {
    if (std::find(std::begin(kCallParameterNames), std::end(kCallParameterNames), name) !=
        std::end(kCallParameterNames)) {
      continue;  // read by ReadCallParameters
    }
    if (std::find(std::begin(kParameterNames), std::end(kParameterNames), name) ==
        std::end(kParameterNames)) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown parameter \"", name, "\" (", kKnownParameters, ")"));
    }
    if (value.parameter_choice_case() != inference::InferParameter::kBoolParam) {
      return absl::InvalidArgumentError(absl::StrCat("parameter ", name, ": expected bool_param"));
    }
    if (name == "is_causal") in.is_causal = value.bool_param();
    if (name == "need_weights") in.need_weights = value.bool_param();
    if (name == "per_head_weights") in.per_head_weights = value.bool_param();
  }
  return absl::OkStatus();
}

// Requested outputs in order; none requested: output, and attn_weights when
// need_weights. Asking for attn_weights computes them whatever need_weights says.
absl::StatusOr<std::vector<RequestedOutput>> RequestedOutputs(
    const inference::ModelInferRequest& request, const SharedMemoryRegistry* shared_memory,
    RequestInputs& in) {
  std::vector<RequestedOutput> outputs;
  auto named = [&outputs](const std::string& name) {
    return std::any_of(outputs.begin(), outputs.end(),
                       [&name](const RequestedOutput& o) { return o.name == name; });
  };
  for (const auto& requested : request.outputs()) {
    const std::string& name = requested.name();
    if (name != kOutputName && name != kWeightsName) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown output \"", name, "\" (outputs: output, attn_weights)"));
    }
    if (named(name)) {
      return absl::InvalidArgumentError(absl::StrCat("output ", name, " requested twice"));
    }
    ASSIGN_OR_RETURN(
        std::optional<SharedMemorySlice> slice,
        SharedMemoryOf(requested.parameters(), shared_memory, absl::StrCat("output ", name)));
    outputs.push_back(RequestedOutput{name, std::move(slice)});
  }
  if (outputs.empty()) {
    outputs.push_back(RequestedOutput{kOutputName, std::nullopt});
    if (in.need_weights) outputs.push_back(RequestedOutput{kWeightsName, std::nullopt});
  }
  in.need_weights = named(kWeightsName);
  return outputs;
}

// Whether each shared-memory output's slice holds what it will receive.
absl::Status CheckOutputSlices(const std::vector<RequestedOutput>& outputs,
                               const AttentionRequest& decoded) {
  for (const RequestedOutput& o : outputs) {
    if (!o.shared_memory.has_value()) continue;
    const bool is_output = o.name == kOutputName;
    const std::vector<int64_t> shape = is_output ? decoded.output_shape() : decoded.weights_shape();
    uint64_t bytes = is_output ? DTypeSize(decoded.output_dtype()) : sizeof(float);
    for (const int64_t d : shape) bytes *= static_cast<uint64_t>(d);
    if (bytes > o.shared_memory->byte_size) {
      return absl::InvalidArgumentError(absl::StrCat("output ", o.name, ": ", kShmByteSize, " ",
                                                     o.shared_memory->byte_size,
                                                     " cannot hold its ", bytes, " bytes"));
    }
  }
  return absl::OkStatus();
}

// The inputs as views, in the slots their names give.
absl::Status ViewInputs(const inference::ModelInferRequest& request,
                        const SharedMemoryRegistry* shared_memory, int64_t max_shared_bytes,
                        const RawReceived* received, RequestInputs& in,
                        std::deque<std::string>& converted) {
  const bool raw = request.raw_input_contents_size() > 0;
  const int in_messages = static_cast<int>(
      std::count_if(request.inputs().begin(), request.inputs().end(), [](const auto& input) {
        return input.parameters().find(kShmRegion) == input.parameters().end();
      }));
  if (raw && request.raw_input_contents_size() != in_messages) {
    return absl::InvalidArgumentError(
        absl::StrCat("raw_input_contents has ", request.raw_input_contents_size(), " entries for ",
                     in_messages, " inputs not in shared memory"));
  }
  std::optional<TensorView> query;
  int raw_index = 0;
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
      return absl::InvalidArgumentError(
          absl::StrCat(input.name(), ": contents and raw_input_contents both given; use one"));
    }
    TensorView view{
        *dtype, std::vector<int64_t>(input.shape().begin(), input.shape().end()), {}, {}};
    ASSIGN_OR_RETURN(std::optional<SharedMemorySlice> slice,
                     SharedMemoryOf(input.parameters(), shared_memory, input.name()));
    if (slice.has_value()) {
      if (input.has_contents()) {
        return absl::InvalidArgumentError(
            absl::StrCat(input.name(), ": contents and ", kShmRegion, " both given; use one"));
      }
      ASSIGN_OR_RETURN(view.bytes,
                       ReadSharedInput(*slice, view, input.name(), max_shared_bytes, converted));
    } else if (raw) {
      const int index = raw_index++;
      const ReceivedBytes* pieces =
          received != nullptr && index < static_cast<int>(received->size()) ? (*received)[index]
                                                                            : nullptr;
      if (pieces == nullptr) {
        const std::string& bytes = request.raw_input_contents(index);
        view.bytes = AsBytes(bytes.data(), bytes.size());
      } else {
        ViewReceived(*pieces, view);
      }
    } else {
      ASSIGN_OR_RETURN(view.bytes,
                       ContentsBytes(input.contents(), *dtype, input.name(), converted));
    }
    *slot = std::move(view);
  }
  if (!query.has_value()) return absl::InvalidArgumentError("input query is required");
  in.query = *std::move(query);
  return absl::OkStatus();
}

}  // namespace

absl::Status ReadRequest(const inference::ModelInferRequest& request,
                         const SharedMemoryRegistry* shared_memory, const RequestLimits& limits,
                         RequestInputs& in, std::deque<std::string>& converted,
                         std::vector<RequestedOutput>& outputs, const RawReceived* received) {
  RETURN_IF_ERROR(
      ViewInputs(request, shared_memory, limits.max_message_bytes, received, in, converted));
  RETURN_IF_ERROR(ReadParameters(request, in));
  ASSIGN_OR_RETURN(outputs, RequestedOutputs(request, shared_memory, in));
  return absl::OkStatus();
}

absl::StatusOr<AttentionRequest> DecodeInferRequest(const inference::ModelInferRequest& request,
                                                    const AttentionDims& dims,
                                                    const RequestLimits& limits,
                                                    const SharedMemoryRegistry* shared_memory,
                                                    std::vector<RequestedOutput>& outputs,
                                                    const RawReceived* received) {
  auto converted = std::make_shared<std::deque<std::string>>();
  RequestInputs in;
  RETURN_IF_ERROR(ReadRequest(request, shared_memory, limits, in, *converted, outputs, received));
  ASSIGN_OR_RETURN(AttentionRequest decoded,
                   AttentionRequest::Create(dims, in, limits.max_tokens, DTypeSpelling::kKserve));
  RETURN_IF_ERROR(CheckOutputSlices(outputs, decoded));
  if (!converted->empty()) decoded.KeepAlive(std::move(converted));
  return decoded;
}

namespace {

// sequence_id, sequence_start and sequence_end, or none when sequence_id is
// absent, 0 or "".
absl::Status ReadSequenceParameters(
    const google::protobuf::Map<std::string, inference::InferParameter>& parameters,
    InferCallParameters& call) {
  auto flag = [&](const char* name, bool& out) -> absl::Status {
    auto it = parameters.find(name);
    if (it == parameters.end()) return absl::OkStatus();
    if (it->second.parameter_choice_case() != inference::InferParameter::kBoolParam) {
      return absl::InvalidArgumentError(absl::StrCat("parameter ", name, ": expected bool_param"));
    }
    out = it->second.bool_param();
    return absl::OkStatus();
  };
  InferCallParameters::Sequence sequence;
  RETURN_IF_ERROR(flag(kSequenceStart, sequence.start));
  RETURN_IF_ERROR(flag(kSequenceEnd, sequence.end));
  if (auto it = parameters.find(kSequenceId); it != parameters.end()) {
    const inference::InferParameter& p = it->second;
    switch (p.parameter_choice_case()) {
      case inference::InferParameter::kInt64Param:
        if (p.int64_param() < 0) {
          return absl::InvalidArgumentError("parameter sequence_id: a negative number");
        }
        if (p.int64_param() != 0) sequence.id = absl::StrCat(p.int64_param());
        break;
      case inference::InferParameter::kUint64Param:
        if (p.uint64_param() != 0) sequence.id = absl::StrCat(p.uint64_param());
        break;
      case inference::InferParameter::kStringParam:
        sequence.id = p.string_param();
        break;
      default:
        return absl::InvalidArgumentError(
            "parameter sequence_id: expected int64_param, uint64_param or string_param");
    }
  }
  if (sequence.id.empty()) {
    if (sequence.start || sequence.end) {
      return absl::InvalidArgumentError(
          "sequence_start and sequence_end need a sequence_id (not 0 or \"\")");
    }
    return absl::OkStatus();
  }
  if (sequence.id.size() > kMaxSessionIdLength ||
      sequence.id.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                    "0123456789._:-") != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter sequence_id: a number, or a string of at most ",
                     kMaxSessionIdLength, " characters of [A-Za-z0-9._:-]"));
  }
  call.sequence = std::move(sequence);
  return absl::OkStatus();
}

}  // namespace

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
      return absl::InvalidArgumentError("parameter timeout: expected int64_param, in microseconds");
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
  RETURN_IF_ERROR(ReadSequenceParameters(parameters, call));
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

}  // namespace mha::server
